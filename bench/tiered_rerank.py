"""Cost of the tiered-KV re-rank on the GPU, amortised over the decode steps between re-ranks.

  python bench/tiered_rerank.py prepare DIR                        # here: compile for sm_90 (fatbin)
  python3 bench/tiered_rerank.py run DIR --json OUT --commit SHA    # GPU machine, runtime-only TVM

OLMoE-1B-7B attention shape (16 KV heads, Dh 128; tier-1 pages of 16, tier-2 pages of 128) at 4096
tokens per sequence: each re-ranked sequence holds 768 tier-1 tokens (its 15% budget plus one tier-2
page of excess) and demotes one page of 128. The re-rank of one layer is timed for 128 sequences
(every sequence demotes at once: the worst case) and for the steady state, where a sequence grows
by one token a step, its budget by 0.15 tokens, so it demotes one page every 128 / 0.85 = 151 steps:
with a re-rank every N = 16 steps, 128 * 16 / 151 = 14 of 128 sequences demote per re-rank (the
engine passes only those rows). Amortised cost per decode step and layer = time / N.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HKV, D, PS1, PS2, SINK, RECENT = 16, 128, 16, 128, 4, 64
CONTEXT, T1, EVERY, STREAMS = 4096, 768, 16, 128


def prepare(out: Path) -> None:
    import tvm

    from moec.compiler.artifact import atomic_directory
    from moec.compiler.build import _compile_cuda_kernels
    from moec.compiler.targets import make_target
    from moec.schedules.kernels.tiered_rerank import make_tiered_rerank

    target = make_target("cuda", "sm_90")
    with atomic_directory(out) as tmp:
        ex = tvm.compile(tvm.IRModule({"tiered_rerank": make_tiered_rerank(HKV, D, PS1, PS2, SINK, RECENT, target="cuda")}),
                         target=target)
        kernels = _compile_cuda_kernels(ex, target, tmp, progress=True)
        ex.export_library(str(tmp / "lib.so"))
        (tmp / "index.json").write_text(json.dumps({"cuda_kernels": kernels}))


def _inputs(rows: int, rng):
    from moec.runtime.kv_cache import POOLS, pool_specs

    pages1 = T1 // PS1
    p1, p2 = rows * pages1, rows * (CONTEXT // PS2 + 1)
    specs = pool_specs(1, p1, p2, HKV, D, PS1, PS2)
    host = {}
    for name, (shape, dt) in specs.items():
        if dt == "uint8":
            host[name] = (rng.integers(0, 256, shape, dtype=np.uint8) & 0x77).astype(np.uint8)  # no NaN codes
        elif dt == "float16":
            host[name] = rng.uniform(0.01, 0.1, shape).astype(np.float16)
        elif dt == "float32":
            host[name] = rng.uniform(0.0, 3.0, shape).astype(np.float32)
        else:
            host[name] = np.zeros(shape, np.int32)
    table = np.arange(p1, dtype=np.int32).reshape(rows, pages1)
    for b in range(rows):  # distinct positions per head: sinks, the recent window and the rest at random
        for h in range(HKV):
            mid = rng.choice(np.arange(SINK, CONTEXT - RECENT), T1 - SINK - RECENT, replace=False)
            pos = rng.permutation(np.concatenate([np.arange(SINK), mid, np.arange(CONTEXT - RECENT, CONTEXT)]))
            host["t1_pos"][0, table[b], h, :] = pos.reshape(pages1, PS1)
    new_t2 = (np.arange(rows, dtype=np.int32) * (CONTEXT // PS2 + 1))[:, None]
    args = [host[n] for n in POOLS] + [table, np.full(rows, T1, np.int32), np.full(rows, CONTEXT, np.int32),
                                       np.full(rows, PS2, np.int32), new_t2,
                                       np.zeros((rows, HKV, T1), np.float32), np.zeros((rows, HKV, T1), np.int32),
                                       np.zeros((rows, HKV, 2 * T1), np.int32)]
    return args


def run(root: Path, json_out: Path, commit: str) -> int:
    import torch
    import tvm

    from moec.runtime.engine import _load_cuda_runtime, _register_fatbins

    _load_cuda_runtime()
    _register_fatbins(root, json.loads((root / "index.json").read_text()))
    mod = tvm.runtime.load_module(str(root / "lib.so"))
    dev = tvm.cuda(0)
    rng = np.random.default_rng(0)
    steady = round(STREAMS * EVERY / (PS2 / 0.85))
    rows_out = {}
    for rows in (steady, STREAMS):
        args = [tvm.runtime.tensor(a, dev) for a in _inputs(rows, rng)]
        fn = mod["tiered_rerank"]
        fn(*args, 0)
        dev.sync()
        times = []
        for _ in range(10):
            t = time.perf_counter()
            fn(*args, 0)
            dev.sync()
            times.append(time.perf_counter() - t)
        ms = float(np.median(times) * 1e3)
        rows_out[str(rows)] = {"rows_demoting": rows, "ms_per_layer": ms, "ms_per_step_per_layer_amortised": ms / EVERY}
        print(json.dumps(rows_out[str(rows)]), flush=True)
    result = {"benchmark": "tiered_rerank", "command": " ".join(["python3"] + sys.argv), "git_commit": commit,
              "device": torch.cuda.get_device_name(0), "host": platform.node(),
              "shape": {"kv_heads": HKV, "head_dim": D, "t1_page": PS1, "t2_page": PS2, "context": CONTEXT,
                        "tier1_tokens_before": T1, "demoted_per_row": PS2, "rerank_every": EVERY, "streams": STREAMS},
              "steady_state_rows": steady, "results": rows_out}
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("out", type=Path)
    p = sub.add_parser("run")
    p.add_argument("root", type=Path)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--commit", default=None)
    args = ap.parse_args()
    if args.cmd == "prepare":
        prepare(args.out)
        return 0
    commit = args.commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    return run(args.root, args.json, commit)


if __name__ == "__main__":
    sys.exit(main())
