"""Fidelity of cascade gating on a trained reference model: top-k agreement and perplexity, per (G, g).

  python bench/cascade_fidelity.py TRAINED_MODEL_DIR --json OUT.json [--groups 2,4,8] [--calib-tokens 65536]
        [--eval-tokens 32768] [--context 1024] [--stride 512] [--confirm G,g] [--confirm-tokens 8192]
        [--device cpu|cuda]

1. ``moec calibrate`` (``compiler.calibrate.calibrate``) on the corpus train split: co-activation groups
   and least-squares coarse routers for every G.
2. On held-out windows (``models.evaluate``: context 1024, stride 512), the PyTorch reference routes
   every layer with ``models.cascade.cascade_route`` (the numerics CascadeGating emits) for each G,
   each kept count g (1..G where g*E/G >= top-k) and both groupings: data-free (what ``moec compile
   --cascade-groups G`` uses) and calibrated (``--calibration``). Per layer, the cascade's top-k set
   is compared with the flat router's on the same hidden states (exact-set share and mean overlap);
   perplexity is compared with the flat model's on the same windows.
3. One setting (``--confirm``) is compiled (llvm) from ``model.onnx`` with the calibration and scored on
   the same windows, against the reference with the same cascade: the compiled model computes what
   the table measured.

The router cost column is the router rows read per token, (G + g*E/G) / E of the flat router's.
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

import numpy as np

GOAL_AGREEMENT, GOAL_PPL = 0.99, 0.005


def _specs(kind, model, calib, num_groups, keep):
    from moec.passes.cascade_gating import CascadeSpec, data_free_groups, fit_coarse

    specs = {}
    if kind == "calibrated":
        groups, coarse = calib.cascade_inputs(num_groups)
        for i, grp in groups.items():
            specs[i] = CascadeSpec(np.asarray(grp), coarse[i][0], coarse[i][1], keep)
        return specs
    for i, layer in enumerate(model.layers):
        w = layer.moe.router.weight.detach().float().numpy()
        grp = np.asarray(data_free_groups(w, num_groups))
        cr, b = fit_coarse(w, grp, layer.post_attention_norm.weight.detach().float().numpy())
        specs[i] = CascadeSpec(grp, cr.astype(np.float32), b.astype(np.float32), keep)
    return specs


def _oracle(flat_ids: np.ndarray, groups: np.ndarray, keep: int) -> float:
    """Share of tokens whose flat top-k lies in at most ``keep`` groups: the best any coarse router can do."""
    group_of = np.empty(groups.size, dtype=np.int64)
    group_of[groups.reshape(-1)] = np.repeat(np.arange(groups.shape[0]), groups.shape[1])
    g = np.sort(group_of[flat_ids], axis=1)  # T, K
    distinct = 1 + (np.diff(g, axis=1) != 0).sum(axis=1)
    return float((distinct <= keep).mean())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--groups", default="2,4,8")
    ap.add_argument("--calib-tokens", type=int, default=65536)
    ap.add_argument("--eval-tokens", type=int, default=32768)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--confirm", default="4,2", help="G,g compiled and checked against the reference ('none' to skip)")
    ap.add_argument("--confirm-tokens", type=int, default=8192)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calibration", type=Path, default=None, help="write (and keep) the calibration here")
    args = ap.parse_args()

    import torch

    import moec
    from moec.compiler.calibrate import calibrate, load_calibration
    from moec.models.cascade import cascaded, set_agreement
    from moec.models.evaluate import ArtifactSubject, TorchSubject, evaluate
    from moec.models.train import corpus_of, load_trained

    model, meta = load_trained(args.model)
    cfg = model.config
    e, k = cfg.num_experts, cfg.top_k
    corpus = corpus_of(meta)
    group_counts = [int(x) for x in args.groups.split(",")]
    tmp = tempfile.TemporaryDirectory()
    calib_dir = args.calibration or Path(tmp.name) / "calibration"
    t = time.perf_counter()
    calibrate(args.model, "train", calib_dir, groups=group_counts, context=args.context, max_tokens=args.calib_tokens,
              device=args.device)
    calib = load_calibration(calib_dir)
    calib_seconds = time.perf_counter() - t
    print(f"[bench] calibrated on {calib.meta['data']['tokens']} train tokens in {calib_seconds:.1f}s", flush=True)

    def score(specs=None, record=None):
        subject = TorchSubject(model, "torch", device=args.device)
        if specs is None:
            return evaluate(subject, corpus, "heldout", context=args.context, stride=args.stride, max_tokens=args.eval_tokens)
        with cascaded(model, specs, record):
            return evaluate(subject, corpus, "heldout", context=args.context, stride=args.stride, max_tokens=args.eval_tokens)

    flat = score()
    print(f"[bench] flat: perplexity {flat['perplexity']:.4f}", flush=True)
    rows = []
    for num_groups in group_counts:
        n = e // num_groups
        for keep in range(1, num_groups + 1):
            if keep * n < k:
                continue
            for kind in ("data-free", "calibrated"):
                record: dict = {}
                specs = _specs(kind, model, calib, num_groups, keep)
                rep = score(specs, record)
                exact, overlap, oracle = [], [], []
                for i in sorted(record):
                    a = torch.cat([c for c, _ in record[i]]).numpy()
                    b = torch.cat([f for _, f in record[i]]).numpy()
                    x, o = set_agreement(a, b)
                    exact.append(round(x, 6))
                    overlap.append(round(o, 6))
                    oracle.append(round(_oracle(b, specs[i].groups, keep), 6))
                row = {"G": num_groups, "g": keep, "grouping": kind, "router_cost": round((num_groups + keep * n) / e, 4),
                       "topk_agreement_per_layer": exact, "topk_overlap_per_layer": overlap,
                       "oracle_agreement_per_layer": oracle,
                       "perplexity": rep["perplexity"], "perplexity_delta_rel": rep["perplexity"] / flat["perplexity"] - 1,
                       }
                row["meets_goal"] = bool(min(exact) >= GOAL_AGREEMENT and row["perplexity_delta_rel"] <= GOAL_PPL)
                rows.append(row)
                print(f"[bench] G={num_groups} g={keep} {kind:<10} cost {row['router_cost']:.3f} agreement "
                      f"{' '.join(f'{x:.4f}' for x in exact)} ppl {rep['perplexity']:.4f} "
                      f"({row['perplexity_delta_rel'] * 100:+.3f}%)", flush=True)
    saving = [r for r in rows if r["meets_goal"] and r["router_cost"] < 1.0]
    best = min(saving, key=lambda r: (r["router_cost"], -min(r["topk_agreement_per_layer"]))) if saving else None

    confirm = None
    if args.confirm != "none":
        cg, ck = (int(x) for x in args.confirm.split(","))
        with tempfile.TemporaryDirectory() as art_tmp:
            art = moec.compile(args.model / "model.onnx", Path(art_tmp) / "art", calibration=calib_dir, cascade_groups=cg,
                               cascade_keep=ck)
            compiled = evaluate(ArtifactSubject(art, mode="prefill"), corpus, "heldout", context=args.context,
                                stride=args.stride, max_tokens=args.confirm_tokens)
        subject = TorchSubject(model, "torch", device=args.device)
        with cascaded(model, _specs("calibrated", model, calib, cg, ck)):
            ref = evaluate(subject, corpus, "heldout", context=args.context, stride=args.stride, max_tokens=args.confirm_tokens)
        confirm = {"G": cg, "g": ck, "tokens_scored": compiled["tokens_scored"], "compiled_perplexity": compiled["perplexity"],
                   "reference_perplexity": ref["perplexity"],
                   "perplexity_rel_diff": compiled["perplexity"] / ref["perplexity"] - 1}
        print(f"[bench] compiled G={cg} g={ck}: perplexity {compiled['perplexity']:.5f}, reference with the same cascade "
              f"{ref['perplexity']:.5f}", flush=True)

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "benchmark": "cascade_fidelity", "command": " ".join(["python"] + sys.argv), "git_commit": commit,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.machine(),
        "model": {"dir": str(args.model), "size": meta.get("size"), "num_experts": e, "top_k": k,
                  "num_layers": cfg.num_layers},
        "data": {"corpus": corpus.id, "calibration": calib.meta["data"], "eval_split": "heldout", "context": args.context,
                 "stride": args.stride, "tokens_scored": flat["tokens_scored"]},
        "goal": {"topk_agreement_min": GOAL_AGREEMENT, "perplexity_delta_max": GOAL_PPL},
        "flat": {"perplexity": flat["perplexity"]},
        "calibration_seconds": round(calib_seconds, 1),
        "calibration_keep_default": {str(gg): calib.default_keep(gg) for gg in group_counts},
        "rows": rows, "cheapest_meeting_goal": best, "compiled_check": confirm,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print("| G | g | router rows | grouping | top-k agreement per layer | bound for these groups | overlap per layer "
          "| perplexity | vs flat |")
    print("|---|---|---|---|---|---|---|---|---|")
    pct = lambda xs: " / ".join(f"{x * 100:.2f}%" for x in xs)  # noqa: E731
    for r in rows:
        print(f"| {r['G']} | {r['g']} | {r['router_cost']:.3f} | {r['grouping']} | {pct(r['topk_agreement_per_layer'])} | "
              f"{pct(r['oracle_agreement_per_layer'])} | {pct(r['topk_overlap_per_layer'])} | {r['perplexity']:.4f} | "
              f"{r['perplexity_delta_rel'] * 100:+.3f}% |")
    print(f"flat perplexity {flat['perplexity']:.4f}; cheapest setting meeting the goal with cost < 1: "
          f"{(best['G'], best['g'], best['grouping']) if best else 'none'}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
