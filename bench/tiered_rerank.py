"""Cost of the tiered-KV re-rank on the GPU, amortised over the decode steps between re-ranks.

  python bench/tiered_rerank.py prepare DIR [--threads 512]       # here: compile for sm_90 (fatbin) and llvm
  python3 bench/tiered_rerank.py run DIR --json OUT --commit SHA    # GPU machine, runtime-only TVM

OLMoE-1B-7B attention shape (16 KV heads, Dh 128; tier-1 pages of 16, tier-2 pages of 128) at 4096
tokens per sequence: each re-ranked sequence holds 768 tier-1 tokens (its 15% budget plus one tier-2
page of excess) and demotes one page of 128. The re-rank of one layer is timed for 128 sequences
(every sequence demotes at once: the worst case) and for the steady state, where a sequence grows
by one token a step, its budget by 0.15 tokens, so it demotes one page every 128 / 0.85 = 151 steps:
with a re-rank every N = 16 steps, 128 * 16 / 151 = 14 of 128 sequences demote per re-rank (the
engine passes only those rows). Amortised cost per decode step and layer = time / N.

The kernels are the ones compiled models use (least-squares 2-bit fit; five launches a layer: scores, ranks
and orders a block per 512 tier-1 slots, packing a block per new page, compaction), each also timed alone. A third case is the re-rank after a
2048-token prefill chunk: one sequence of 2048 tokens, all in tier 1, demotes 13 pages (down to its budget),
so one block per KV head does the quadratic ranking over 2048 tokens; a fourth is the prompt's second chunk
(2432 tier-1 tokens, 14 pages demoted). Each case is first checked against the llvm build of the same kernel run on the host (the pools
after the call: compaction and positions exact, 2-bit statistics within float16 rounding, codes all but a
few that lie on a threshold).
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


# rows, context, tier-1 tokens, pages: "prefill-chunk" is a prompt's first 2048-token chunk, "prefill-chunk-2" its second
# (the first chunk's 384 kept tokens and 2048 new ones, down to the budget at 4096 tokens)
CASES = {"steady": None, "worst": None, "prefill-chunk": (1, 2048, 2048, 13), "prefill-chunk-2": (1, 4096, 2432, 14)}


def prepare(out: Path, threads: int = 512, stage_bytes: int | None = None) -> None:
    import tvm

    from moec.compiler.artifact import atomic_directory
    from moec.compiler.build import _compile_cuda_kernels
    from moec.compiler.targets import make_target
    from moec.schedules.kernels.tiered_rerank import make_tiered_rerank

    target = make_target("cuda", "sm_90")
    with atomic_directory(out) as tmp:
        stage = {} if stage_bytes is None else {"stage_bytes": stage_bytes}
        funcs = make_tiered_rerank(HKV, D, PS1, PS2, SINK, RECENT, target="cuda", fit="lloyd", threads=threads, **stage)
        ex = tvm.compile(tvm.IRModule(funcs), target=target)
        kernels = _compile_cuda_kernels(ex, target, tmp, progress=True)
        ex.export_library(str(tmp / "lib.so"))
        funcs = make_tiered_rerank(HKV, D, PS1, PS2, SINK, RECENT, fit="lloyd", threads=threads)
        cpu = tvm.compile(tvm.IRModule(funcs), target=make_target("llvm", None))
        cpu.export_library(str(tmp / "lib_cpu.so"))
        (tmp / "index.json").write_text(json.dumps({"cuda_kernels": kernels, "threads": threads, "stage_bytes": stage_bytes,
                                                    "launches": list(funcs)}))


def _inputs(rows: int, rng, context: int = CONTEXT, t1: int = T1, pages: int = 1, posw: bool = True):
    from moec.runtime.kv_cache import POOLS, pool_specs
    from moec.schedules.kernels.tiered_rerank import workspaces

    pages1 = t1 // PS1
    per_row2 = context // PS2 + 1
    p1, p2 = rows * pages1, rows * per_row2
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
            mid = rng.choice(np.arange(SINK, context - RECENT), t1 - SINK - RECENT, replace=False)
            pos = rng.permutation(np.concatenate([np.arange(SINK), mid, np.arange(context - RECENT, context)]))
            host["t1_pos"][0, table[b], h, :] = pos.reshape(pages1, PS1)
    new_t2 = (np.arange(rows, dtype=np.int32) * per_row2)[:, None] + np.arange(pages, dtype=np.int32)[None, :]
    args = [host[n] for n in POOLS] + [table, np.full(rows, t1, np.int32), np.full(rows, context, np.int32),
                                       np.full(rows, pages * PS2, np.int32), new_t2]
    # the kernels' workspaces; a directory prepared before the five launches takes the first three (no posw)
    return args + workspaces(rows, HKV, t1)[:None if posw else 3]


def _check(gpu_out: dict, cpu_out: dict) -> dict:
    """The pools after the call on the GPU against the host build's."""
    exact = ["t1_k", "t1_v", "t1_ks", "t1_vs", "t1_pos", "t1_mass", "t2_pos"]
    res = {"exact": {n: bool(np.array_equal(gpu_out[n], cpu_out[n])) for n in exact}}
    # per-page statistics against the largest of their array: a mean near zero summed in another order
    # differs from the host's by float16 rounding, which relative to itself can look large
    stats = {n: float(np.max(np.abs(gpu_out[n].astype(np.float32) - cpu_out[n].astype(np.float32))) /
                      max(float(np.max(np.abs(cpu_out[n].astype(np.float32)))), 1e-6))
             for n in ("t2_kmu", "t2_ksig", "t2_vmu", "t2_vsig")}
    # the compiled fit is Lloyd's: its cell assignments are discontinuous in the data, so a product that the
    # GPU build contracts into one FMA (and the host does not) can move a value across a cell boundary and the
    # block's refit statistics with it; such blocks are counted, and must stay isolated
    off = {n: float(np.mean(np.abs(gpu_out[n].astype(np.float32) - cpu_out[n].astype(np.float32)) >
                            2e-3 * max(float(np.max(np.abs(cpu_out[n].astype(np.float32)))), 1e-6)))
           for n in ("t2_kmu", "t2_ksig", "t2_vmu", "t2_vsig")}
    codes = {n: float(np.mean(gpu_out[n] != cpu_out[n])) for n in ("t2_k", "t2_v")}
    res.update(stats_max_error_vs_array_max=stats, stats_entries_off=off, code_bytes_differing=codes)
    res["passed"] = all(res["exact"].values()) and max(off.values()) < 1e-5 and max(codes.values()) < 1e-3
    return res


def run(root: Path, json_out: Path, commit: str) -> int:
    import torch
    import tvm

    from moec.runtime.engine import _load_cuda_runtime, _register_fatbins

    _load_cuda_runtime()
    _register_fatbins(root, json.loads((root / "index.json").read_text()))
    mod = tvm.runtime.load_module(str(root / "lib.so"))
    dev = tvm.cuda(0)
    # a directory prepared before the re-rank was three launches holds one function, "tiered_rerank"
    launches = json.loads((root / "index.json").read_text()).get("launches", ["tiered_rerank"])
    from moec.schedules.kernels.tiered_rerank import call_rerank

    cpu_mod = tvm.runtime.load_module(str(root / "lib_cpu.so"))
    rng = np.random.default_rng(0)
    steady = round(STREAMS * EVERY / (PS2 / 0.85))
    rows_out = {}
    from moec.runtime.kv_cache import POOLS

    for case in CASES:
        rows, context, t1, pages = CASES[case] or ({"steady": steady, "worst": STREAMS}[case], CONTEXT, T1, 1)
        host = _inputs(rows, rng, context, t1, pages, posw="tiered_rerank_score" in launches)
        args = [tvm.runtime.tensor(a, dev) for a in host]
        call_rerank(mod.__getitem__, args, 0, launches)
        dev.sync()
        cpu_args = [tvm.runtime.tensor(a, tvm.cpu()) for a in host]
        call_rerank(cpu_mod.__getitem__, cpu_args, 0, launches)
        check = _check({n: args[i].numpy() for i, n in enumerate(POOLS)}, {n: cpu_args[i].numpy() for i, n in enumerate(POOLS)})
        times, launch = [], {name: [] for name in launches}
        for _ in range(10):
            args = [tvm.runtime.tensor(a, dev) for a in host]  # fresh inputs: the call compacts tier 1 in place
            dev.sync()
            t = time.perf_counter()
            call_rerank(mod.__getitem__, args, 0, launches)
            dev.sync()
            times.append(time.perf_counter() - t)
            args = [tvm.runtime.tensor(a, dev) for a in host]
            for name in launches:  # each launch alone, between synchronisations
                dev.sync()
                t = time.perf_counter()
                mod[name](*args, 0)
                dev.sync()
                launch[name].append(time.perf_counter() - t)
        ms = float(np.median(times) * 1e3)
        rows_out[case] = {"rows": rows, "context": context, "tier1_tokens": t1, "pages_demoted_per_row": pages,
                          "ms_per_layer": ms, "ms_per_step_per_layer_amortised": ms / EVERY,
                          "launch_ms": {k: float(np.median(v) * 1e3) for k, v in launch.items()}, "check": check}
        print(json.dumps({"case": case, **rows_out[case]}), flush=True)
    result = {"benchmark": "tiered_rerank", "command": " ".join(["python3"] + sys.argv), "git_commit": commit,
              "device": torch.cuda.get_device_name(0), "host": platform.node(),
              "shape": {"kv_heads": HKV, "head_dim": D, "t1_page": PS1, "t2_page": PS2, "context": CONTEXT,
                        "tier1_tokens_before": T1, "demoted_per_row": PS2, "rerank_every": EVERY, "streams": STREAMS},
              "threads": json.loads((root / "index.json").read_text()).get("threads"),
              "stage_bytes": json.loads((root / "index.json").read_text()).get("stage_bytes"),
              "steady_state_rows": steady, "results": rows_out}
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2))
    return 0 if all(r["check"]["passed"] for r in rows_out.values()) else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("out", type=Path)
    p.add_argument("--threads", type=int, default=512, help="threads per block (head_dim: the form before 21983bf)")
    p.add_argument("--stage-bytes", type=int, default=None,
                   help="shared memory for staging a new page's rows (0: the gathering form, the default before a8c1171)")
    p = sub.add_parser("run")
    p.add_argument("root", type=Path)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--commit", default=None)
    args = ap.parse_args()
    if args.cmd == "prepare":
        prepare(args.out, args.threads, args.stage_bytes)
        return 0
    commit = args.commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    return run(args.root, args.json, commit)


if __name__ == "__main__":
    sys.exit(main())
