"""The pipelined greedy decode (``Engine.decode_greedy_steps``) against the synchronous loop on the GPU.

  python bench/pipelined_decode.py prepare DIR                        # here: tiny model for sm_90, three caches
  python3 bench/pipelined_decode.py run DIR --json OUT --commit SHA   # GPU machine, runtime-only TVM

``prepare`` compiles the built-in ``tiny`` model (ONNX) for sm_90 with the paged, FP8 and tiered caches. ``run``
loads each artifact twice, prefills the same prompts (lengths 300 to 600, so the tiered cache demotes pages to 2-bit
and re-ranks during the steps) into both engines, then runs ``STEPS`` greedy steps: one engine with
``decode_greedy`` in a loop, the other with ``decode_greedy_steps`` (each step's argmax fed to the next step on the
device, inputs copied asynchronously through page-locked memory, tokens read back a step late). The check: the
same tokens at every step, and the same lengths after. Each loop's median step time is recorded too (a model
this small is bound by the host, which is what the pipelined loop overlaps).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

CACHES = ("paged", "fp8", "tiered")
STEPS = 40
PROMPTS = (300, 451, 600, 377)


def prepare(out: Path) -> None:
    from cuda_graph import prepare as prepare_tiny  # (bench/ is this script's path)

    prepare_tiny(out, CACHES, cuda_graph=False)


def check(art: Path, device: str) -> dict:
    import moec

    rng = np.random.default_rng(0)
    a, b = (moec.load(art, device=device, max_batch=8, max_total_tokens=8192) for _ in range(2))
    prompts = [rng.integers(3, a.vocab_size, n).tolist() for n in PROMPTS]
    sa, la = a.prefill(prompts)
    sb, lb = b.prefill(prompts)
    first = la.argmax(-1)
    sync, t_sync, tok = [], [], first
    for _ in range(STEPS):
        t = time.perf_counter()
        tok = a.decode_greedy(sa, list(tok))
        t_sync.append(time.perf_counter() - t)
        sync.append(tok)
    pipe, t_pipe = [], []
    t = time.perf_counter()
    for tok in b.decode_greedy_steps(sb, list(lb.argmax(-1)), STEPS):
        now = time.perf_counter()
        t_pipe.append(now - t)
        t = now
        pipe.append(tok)
    sync, pipe = np.stack(sync), np.stack(pipe)
    row = {"artifact": art.name, "prefill_logits_equal": bool(np.array_equal(la, lb)),
           "steps": STEPS, "tokens_equal_steps": int((sync == pipe).all(axis=1).sum()),
           "lengths_equal": a.lengths == b.lengths, "chained_steps": b.chained_steps,
           "reranks": [a.tiered.reranks, b.tiered.reranks] if a.tiered is not None else None,
           "step_ms_sync": 1e3 * float(np.median(t_sync)), "step_ms_pipelined": 1e3 * float(np.median(t_pipe))}
    row["passed"] = bool(row["prefill_logits_equal"] and row["tokens_equal_steps"] == STEPS and row["lengths_equal"]
                         and row["chained_steps"] == STEPS - 1)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("dir", type=Path)
    r = sub.add_parser("run")
    r.add_argument("dir", type=Path)
    r.add_argument("--json", type=Path, required=True)
    r.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    r.add_argument("--commit", default=None)
    args = ap.parse_args()
    if args.cmd == "prepare":
        prepare(args.dir)
        return 0
    rows = []
    for cache in CACHES:
        row = check(args.dir / f"tiny-{cache}", args.device)
        print(json.dumps(row), flush=True)
        rows.append(row)
    commit = args.commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    device = platform.processor() or platform.machine()
    if args.device == "cuda":
        try:
            import torch

            device = torch.cuda.get_device_name(0)
        except Exception:  # noqa: BLE001 - no torch there: the CPU's name stays
            pass
    cmd = f"python3 bench/pipelined_decode.py run {args.dir} --json {args.json} --commit {commit}"
    doc = {"benchmark": "pipelined_decode", "command": cmd, "git_commit": commit, "device": device,
           "rows": rows, "passed": all(r["passed"] for r in rows)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2))
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
