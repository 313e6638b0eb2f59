"""Perplexity of KV-cache choices on compiled models (CPU): the quality table from moec's own kernels.

  python bench/kv_quality_compiled.py TRAINED_MODEL_DIR --json OUT.json [--context 1024] [--stride 512]
        [--max-tokens 8192] [--recent 64] [--sink 4]

The trained reference model (``moec train-reference``) is compiled for llvm once per KV cache: paged
bf16, fp8, 2-bit (tiered with no FP8 budget, sink or window), tiered by importance (attention mass
over the uniform share; the cached key's norm) and tiered by random choice at the same budget. Each
artifact decodes the same held-out windows through the runtime engine (prefill ``context - stride``
tokens, then ``stride`` teacher-forced decode steps with re-ranks). ``bench/tiered_e2e.py`` runs the
same rows on the GPU at 4096.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS = {  # name: (kv_cache, TieredOptions overrides)
    "bf16": ("bf16", {}),
    "fp8": ("fp8", {}),
    "2bit": ("tiered", dict(tier1_fraction=0.0, sink=0, recent=0)),
    "tiered-mass": ("tiered", dict(importance="mass")),
    "tiered-keynorm": ("tiered", dict(importance="keynorm")),
    "tiered-random": ("tiered", dict(importance="random")),
    # the 2-bit statistics fit (default lloyd) against plain moments
    "2bit-moments": ("tiered", dict(tier1_fraction=0.0, sink=0, recent=0, t2_fit="moments")),
    "tiered-mass-moments": ("tiered", dict(importance="mass", t2_fit="moments")),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--recent", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--commit", default=None, help="git commit to record (default: this checkout's HEAD)")
    args = ap.parse_args()

    import moec
    from moec.models.evaluate import ArtifactSubject, evaluate
    from moec.models.train import corpus_of, load_trained
    from moec.passes.tiered_kv_attention import TieredOptions

    _, meta = load_trained(args.model)
    corpus = corpus_of(meta)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.rows.split(","):
            kv, over = ROWS[name]
            opts = TieredOptions(**{"sink": args.sink, "recent": args.recent, **over}) if kv != "bf16" else None
            art = moec.compile(args.model / "model.onnx", Path(tmp) / name, kv_cache=kv, tiered_options=opts)
            subject = ArtifactSubject(art, mode="decode", batch_size=args.batch_size)
            t = time.perf_counter()
            rep = evaluate(subject, corpus, "heldout", context=args.context, stride=args.stride, max_tokens=args.max_tokens)
            rows[name] = {"perplexity": rep["perplexity"], "top1_accuracy": rep["top1_accuracy"],
                          "tier1_share": sum(subject.tier1_share) / len(subject.tier1_share) if subject.tier1_share else None,
                          "seconds": round(time.perf_counter() - t, 1)}
            print(f"[bench] {name}: {rows[name]}", flush=True)
    if "bf16" in rows:
        for r in rows.values():
            r["perplexity_delta_vs_bf16"] = r["perplexity"] / rows["bf16"]["perplexity"] - 1
    commit = args.commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"benchmark": "kv_quality_compiled", "command": " ".join(["python"] + sys.argv), "git_commit": commit,
              "device": platform.machine(), "model": {"dir": str(args.model), "size": meta.get("size")},
              "data": {"corpus": corpus.id, "split": "heldout", "context": args.context, "stride": args.stride,
                       "tokens_scored": args.max_tokens},
              "policy": {"sink": args.sink, "recent": args.recent, "tier1_fraction": 0.15, "rerank_every": 16,
                         "t2_page": 128, "t2_fit": "lloyd unless the row says moments"}, "results": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print("| cache | perplexity | vs bf16 |\n|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['perplexity']:.4f} | {100 * r.get('perplexity_delta_vs_bf16', 0):+.2f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
