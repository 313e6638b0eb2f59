"""Train the `small` reference MoE on the GPU, compile it with moec, evaluate both there side by side.

  python3 bench/reference_small.py --json OUT.json --commit SHA [--steps N] [--device cuda] [--work DIR]

On the GPU machine (compiler staged: ../shared/device/README.md, two calls back to back):
  call 1, carry [.devcarry/base, .devcarry/c1]:  bash .devcarry/base/install.sh stage
  call 2, carry [.devcarry/base, .devcarry/c2]:  source bench/device_env.sh full &&
          python3 bench/reference_small.py --json $OUT/reference_small.json --commit <sha>

Steps: build the stdlib BPE corpus of the machine's interpreter (or take ``--corpus DIR``, e.g. one built
here with ``moec corpus -o .devcarry/corpus-bpe --tokenizer bpe`` and carried: the GPU machine's Python
ships its stdlib without the test suites, a third of the text); `train_reference("small")` (held-out
perplexity of the trained model at its eval context); export to ONNX; `moec.compile` for the GPU;
then held-out perplexity at a 4096-token context of the PyTorch model and of the compiled artifact on
the same windows (prefill path), and a shorter decode-path run (tokens decoded one step at a time
over the paged KV cache). With ``--device cpu`` the same steps run on the CPU (target llvm) as a dry run.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--steps", type=int, default=None, help="override the training steps (dry runs)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--work", type=Path, default=Path("/tmp/moec-reference-small"))
    ap.add_argument("--corpus", type=Path, default=None, help="a corpus directory built elsewhere (`moec corpus`); "
                    "default: build the BPE corpus from this machine's interpreter")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--stride", type=int, default=None, help="targets per window (default: context / 2)")
    ap.add_argument("--train-eval-tokens", type=int, default=None, help="override the held-out tokens scored after training")
    ap.add_argument("--prefill-tokens", type=int, default=65536)
    ap.add_argument("--decode-tokens", type=int, default=16384)
    args = ap.parse_args()

    import torch

    import moec
    from moec.models.corpus import get_corpus, load_corpus
    from moec.models.evaluate import ArtifactSubject, TorchSubject, evaluate
    from moec.models.train import TRAIN_SIZES, load_trained, train_reference

    commit = args.commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    spec = TRAIN_SIZES["small"]
    doc = {
        "benchmark": "reference_small",
        "command": " ".join(["python3"] + sys.argv),
        "git_commit": commit,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu",
        "python": platform.python_version(), "torch": torch.__version__,
    }
    stages = {}

    def save():
        doc["stage_seconds"] = stages
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2))

    t = time.perf_counter()
    corpus = load_corpus(args.corpus) if args.corpus else get_corpus(spec.tokenizer, spec.vocab_size, root=args.work / "corpus")
    stages["corpus"] = round(time.perf_counter() - t, 1)
    doc["corpus"] = {k: corpus.meta[k] for k in ("id", "source", "tokenizer", "splits", "unigram_heldout_perplexity")}
    t = time.perf_counter()
    model_dir = train_reference("small", args.work / "model", device=args.device, steps=args.steps,
                                corpus_dir=corpus.root, export=("onnx",),
                                eval_tokens=args.train_eval_tokens)
    stages["train_eval_export"] = round(time.perf_counter() - t, 1)
    model, meta = load_trained(model_dir)
    train = dict(meta["training"])
    train.pop("log")
    doc["training"] = train
    doc["training"]["loss_curve"] = [(e["step"], e["loss"]) for e in meta["training"]["log"]]
    doc["trained_heldout"] = meta["heldout"]
    doc["config"] = meta["config"]
    doc["parameters"] = sum(p.numel() for p in model.parameters())
    save()

    t = time.perf_counter()
    target = "cuda" if args.device == "cuda" else "llvm"
    art = moec.compile(model_dir / "model.onnx", args.work / "artifact", target=target, progress=True)
    stages["compile"] = round(time.perf_counter() - t, 1)
    save()

    runs = {}
    for mode, tokens in (("prefill", args.prefill_tokens), ("decode", args.decode_tokens)):
        t = time.perf_counter()
        stride = args.stride or args.context // 2
        batch = 8 if mode == "prefill" else max(1, min(64, tokens // stride))
        report = evaluate(ArtifactSubject(art, device=args.device, mode=mode, batch_size=batch), corpus,
                          context=args.context, stride=stride, max_tokens=tokens,
                          reference=TorchSubject(model, "torch", device=args.device, batch_size=2))
        stages[f"eval_{mode}"] = round(time.perf_counter() - t, 1)
        runs[mode] = report
        print(json.dumps({"mode": mode, "artifact_ppl": report["perplexity"], "torch_ppl": report["reference"]["perplexity"],
                          **report["comparison"]}), flush=True)
        doc["evaluation"] = runs
        save()
    doc["passed"] = all(abs(r["comparison"]["perplexity_delta_rel"]) < 1e-3 for r in runs.values())
    save()
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
