"""Perplexity of KV-cache policies on the reference model trained on real text (decode path).

  python bench/kv_quality.py MODEL_DIR --json OUT.json [--context 1024] [--max-tokens 32768]
        [--page-tokens 32] [--recent 32] [--sink 4] [--tier1-fraction 0.15] [--rerank-every 16]
        [--score keynorm[,uniform...]] [--random-seeds 0,1,2] [--device cpu|cuda] [--train small --corpus DIR]

On the GPU (4096-token context): ``--device cuda``; ``--train small --corpus DIR`` first trains the
reference model into MODEL_DIR there (``moec.models.train.train_reference``), so one command trains
and measures.

Each policy decodes the same held-out windows (prefill ``context - stride`` tokens, then one token a
step) with the PyTorch tiered-KV reference decoder (``moec.models.kv_reference``): full float32,
bf16, FP8-only, 2-bit-only, tiered by importance and tiered by random choice at the same budget.
Each score of ``--score`` gives a tiered row (``tiered`` for the first, ``tiered@SCORE`` for the
others; the compiled cache's ``mass`` importance is the reference's ``uniform``). The JSON is rewritten
after every row, so a run stopped early keeps what it measured.
The JSON holds each policy's perplexity, its relative change against bf16, the measured tier-1 share
and the bytes per element its formats cost; a markdown table is printed. ``tiered-random`` is run once
per seed of ``--random-seeds`` (rows ``tiered-random`` for the first seed, ``tiered-random:SEED`` for
the others); ``paired`` compares ``tiered`` and ``2bit`` with the mean over the random seeds token for
token: the relative perplexity change and its standard error over the windows (the per-window mean
NLL differences).
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

MODES = ["full", "bf16", "fp8", "2bit", "tiered", "tiered-random"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--stride", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--page-tokens", type=int, default=32)
    ap.add_argument("--recent", type=int, default=32)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--tier1-fraction", type=float, default=0.15)
    ap.add_argument("--rerank-every", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--score", default="keynorm", help="importance score of the tiered policy (TierPolicy.score)")
    ap.add_argument("--random-seeds", default="0,1,2", help="seeds of the tiered-random policy")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--demote", choices=["kv", "k", "v"], default="kv",
                    help="ablation: quantize only keys (k) or only values (v) to 2-bit at a demotion")
    ap.add_argument("--fit", choices=["moments", "lloyd"], default="lloyd",
                    help="2-bit mu/sigma fit at a demotion (lloyd: the compiled cache's default)")
    ap.add_argument("--rotate", choices=["", "k", "v", "kv"], default="",
                    help="quantize keys and/or values to 2-bit in a rotated basis (randomised Hadamard)")
    ap.add_argument("--device", default="cpu", help="torch device of the reference decoder (cpu, cuda)")
    ap.add_argument("--train", choices=["tiny", "small"], default=None,
                    help="first train the reference model of this size into MODEL (on --device)")
    ap.add_argument("--corpus", type=Path, default=None, help="corpus directory for --train")
    ap.add_argument("--train-steps", type=int, default=None, help="override the training steps (dry runs)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated policies (bf16 is always run: the baseline)")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from moec.models.evaluate import evaluate
    from moec.models.kv_reference import KVPolicySubject, TierPolicy
    from moec.models.train import corpus_of, load_trained
    from moec.runtime.kv_quant import bytes_per_element

    commit = args.commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if args.device.startswith("cuda"):
        device_name = torch.cuda.get_device_name(0)
    else:
        device_name = platform.processor() or platform.machine()
    training = None
    if args.train:
        from moec.models.train import train_reference

        t = time.perf_counter()
        train_reference(args.train, args.model, device=args.device, steps=args.train_steps,
                        corpus_dir=args.corpus, export=())
        training = {"size": args.train, "seconds": round(time.perf_counter() - t, 1)}
    model, meta = load_trained(args.model)
    if training:
        training.update({k: meta["training"].get(k) for k in ("steps", "tokens", "final_loss")})
        training["heldout"] = meta.get("heldout")
    corpus = corpus_of(meta)
    kw = dict(tier1_fraction=args.tier1_fraction, sink=args.sink, recent=args.recent,
              rerank_every=args.rerank_every, page_tokens=args.page_tokens, demote=args.demote,
              fit=args.fit, rotate=args.rotate)
    seeds = [int(x) for x in args.random_seeds.split(",")]
    scores = args.score.split(",")
    dh = model.config.dim_head
    rows, nll = {}, {}
    runs = []
    for mode in [m for m in MODES if m in set(args.modes.split(",")) | {"bf16"}]:
        if mode == "tiered-random":
            runs += [(mode if i == 0 else f"{mode}:{s}", mode, {"seed": s}) for i, s in enumerate(seeds)]
        elif mode == "tiered":
            runs += [("tiered" if i == 0 else f"tiered@{sc}", mode, {"score": sc}) for i, sc in enumerate(scores)]
        else:
            runs.append((mode, mode, {}))
    stride = args.stride or args.context // 2
    doc = {
        "benchmark": "kv_quality", "command": " ".join(["python"] + sys.argv), "git_commit": commit,
        "device": device_name, "decoder": "PyTorch tiered-KV reference (moec.models.kv_reference)",
        "model": {"dir": str(args.model), "size": meta["size"], "config": meta["config"]},
        "training": training,
        "policy": {**kw, "score": scores, "random_seeds": seeds}, "results": rows,
    }

    def save(report) -> None:
        """Deltas against bf16, paired comparisons with the random seeds; the JSON rewritten."""
        base = rows["bf16"]["perplexity"]
        for r in rows.values():
            r["perplexity_delta_vs_bf16"] = r["perplexity"] / base - 1
        paired = {}
        rand = [r for r, m, _ in runs if m == "tiered-random" and r in nll]
        if rand:
            ref = np.mean([nll[r] for r in rand], 0)
            rp = [rows[r]["perplexity"] for r in rand]
            paired["tiered-random_seeds"] = {"seeds": seeds[:len(rand)], "perplexity_min": min(rp),
                                             "perplexity_max": max(rp), "perplexity_mean": float(np.mean(rp))}
            for row in [r for r, m, _ in runs if m in ("tiered", "2bit", "bf16") and r in nll]:
                d = (nll[row] - ref).reshape(-1, stride).mean(1)  # per window
                paired[f"{row}_vs_random_mean"] = {"perplexity_delta": float(np.expm1(d.mean())),
                                                   "standard_error": float(d.std(ddof=1) / np.sqrt(d.size))}
        doc["paired"] = paired
        doc["data"] = {"corpus": corpus.id, "split": "heldout", "context": args.context, "stride": stride,
                       "tokens_scored": report["tokens_scored"]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2))

    # bf16 (the baseline) first, so every saved JSON has its deltas; then the comparison the cache
    # stands on (tiered against random tiering), so a run stopped early still holds it
    first = ["bf16", "tiered", "tiered-random", "2bit", "fp8", "full"]
    runs.sort(key=lambda r: first.index(r[0]) if r[0] in first else len(first))
    for row, mode, extra in runs:
        t = time.perf_counter()
        subject = KVPolicySubject(model, TierPolicy.named(mode, **kw, **extra), batch_size=args.batch_size,
                                  device=args.device)
        report = evaluate(subject, corpus, context=args.context, stride=args.stride, max_tokens=args.max_tokens)
        share = float(np.mean(subject.tier1_share))
        if mode in ("full", "bf16"):
            nbytes = {"full": 4.0, "bf16": 2.0}[mode]
        elif mode == "fp8":
            nbytes = bytes_per_element(1.0, dh, args.page_tokens)["tier1"]
        else:
            nbytes = bytes_per_element(share, dh, args.page_tokens)["blend"]
        rows[row] = {"perplexity": report["perplexity"], "tier1_share": share, "bytes_per_element": nbytes,
                     "top1_accuracy": report["top1_accuracy"], "seconds": round(time.perf_counter() - t, 1), **extra}
        nll[row] = subject.nll
        print(row, json.dumps(rows[row]), flush=True)
        save(report)
    print("| policy | perplexity | vs bf16 | tier-1 share | bytes/element |\n|---|---|---|---|---|")
    for mode, r in rows.items():
        print(f"| {mode} | {r['perplexity']:.4f} | {r['perplexity_delta_vs_bf16'] * 100:+.2f}% | {r['tier1_share']:.3f} | {r['bytes_per_element']:.3f} |")
    for k, v in doc["paired"].items():
        print(k, json.dumps(v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
