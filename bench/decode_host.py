"""The host's share of a tiered-cache decode step: the engine's work around the kernels, the kernels left out.

    python bench/decode_host.py --json bench/results/decode_host_cpu.json [--streams 128 --context 4080]

Compiles the built-in ``tiny`` model for llvm with the tiered cache (the page tables and the step inputs do not
depend on the model's size), fills ``--streams`` sequences to ``--context`` tokens through the page tables alone
(appends in 1024-token chunks, each followed by a re-rank plan, as prefill leaves them), then times
``Engine._decode_step`` with the compiled ``decode`` entry and the re-rank kernel replaced by no-ops: what is left
is the page-table bookkeeping, the step's input arrays and their copies into device tensors. ``--device cuda``
(on the GPU machine, runtime-only TVM, an artifact compiled for sm_90 given with ``--artifact``) counts the
host-to-device copies too.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np


def measure(art: Path, device: str, streams: int, context: int, steps: int) -> dict:
    import moec

    e = moec.load(art, device=device, max_batch=streams, max_total_tokens=streams * (context + steps + 64))
    seqs = [e.add_sequence() for _ in range(streams)]
    st = e.tiered
    for s in seqs:
        for c in range(0, context, 1024):
            st.tables.append({st.slot[s]: min(1024, context - c)})
            st.tables.plan_rerank(st.slot[s])
        e.lengths[s] = context

    def no_kernels(*args):
        return [args[0]]

    e._decode = no_kernels
    st._rerank = lambda *args: None
    tokens = list(range(streams))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        e._decode_step(seqs, tokens, on_device=True)
        times.append(time.perf_counter() - t)
    ms = 1e3 * np.asarray(times)
    return {"streams": streams, "context": context, "steps": steps, "host_ms_median": float(np.median(ms)),
            "host_ms_p90": float(np.percentile(ms, 90)), "host_ms_max": float(ms.max()),
            "reranks_planned": st.reranks}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--artifact", type=Path, default=None, help="a tiered artifact (default: tiny, compiled for llvm)")
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--context", type=int, default=4080)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--commit", default=None)
    a = ap.parse_args()
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        art = a.artifact
        if art is None:
            import moec
            from moec.models import build_reference, get_config
            from moec.models.export import save_onnx

            cfg = get_config("tiny")
            save_onnx(build_reference(cfg), cfg.vocab_size, Path(tmp) / "tiny.onnx")
            art = moec.compile(Path(tmp) / "tiny.onnx", Path(tmp) / "art", target="llvm", kv_cache="tiered")
        res = measure(Path(art), a.device, a.streams, a.context, a.steps)
    doc = {"benchmark": "decode_host", "command": "python bench/decode_host.py " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if v is not None and k not in ("json", "commit"))
           + f" --json {a.json.name}", "git_commit": commit, "device": a.device, "machine": platform.processor() or
           platform.machine(), "python": platform.python_version(), **res}
    a.json.write_text(json.dumps(doc, indent=2))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
