"""Expert prediction for offloaded experts on a trained reference model (CPU): recall, and the copies a
decode step waits for with on-demand loading vs prefetching, from the same routing.

    python bench/expert_prediction.py /tmp/trained_tiny --json bench/results/expert_prediction_cpu_tiny.json

For each layer l >= 1 it applies layer l's post-attention norm and router to layer l - 1's
post-attention state (``post_attention``) or output (``layer_output``), with and without a linear
correction fitted on training text, predicting top-k + extra experts (``moec.models.expert_prediction``);
and (``router_fit``) the predictor ``moec calibrate`` fits and compiled offloaded models prefetch with: layer l's
router logits fitted on layer l - 1's router input by ridge least squares (``compiler.calibrate.fit_prefetch``)
on the training text.
Then decode steps of S streams (S consecutive held-out tokens' routing per step) run through
``moec.runtime.expert_cache`` at a capacity of ``--capacity`` of all experts: stalls are experts a layer
waited for, against on-demand loading (no prefetch) and against a perfect prediction.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from pathlib import Path

import numpy as np
import torch


def main(argv=None) -> int:
    from moec.models.expert_prediction import calibrate_correction, evaluate_prediction, predict, routing_trace
    from moec.models.train import corpus_of, load_trained
    from moec.runtime.expert_cache import simulate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--json", required=True)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--capacity", type=float, default=0.5, help="cache slots as a share of all experts")
    ap.add_argument("--commit", default=None)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    model, meta = load_trained(a.model)
    corpus = corpus_of(meta)
    held, train = corpus.tokens("heldout"), corpus.tokens("train")
    streams = [int(s) for s in a.streams.split(",")]
    doc = evaluate_prediction(model, held, a.context, a.max_tokens, calibration_tokens=train[: a.max_tokens],
                              extras=(0, 1, 2), streams=streams)
    cfg = model.config
    n = min(len(held) // a.context, max(1, a.max_tokens // a.context))
    trace = routing_trace(model, torch.from_numpy(np.asarray(held[: n * a.context], np.int64).reshape(n, a.context)))
    capacity = max(1, int(a.capacity * cfg.num_layers * cfg.num_experts))
    ntr = min(len(train) // a.context, max(1, a.max_tokens // a.context))
    ctrace = routing_trace(model, torch.from_numpy(np.asarray(train[: ntr * a.context], np.int64).reshape(ntr, a.context)))
    maps = {src: calibrate_correction(ctrace, src) for src in ("post_attention", "layer_output")}
    from moec.compiler.calibrate import PREFETCH_TARGET, fit_prefetch, prefetch_recall
    from moec.models.expert_prediction import batch_recall, recall

    def router_in(tr, layer):
        with torch.no_grad():
            return model.layers[layer].post_attention_norm(tr.post_attention[layer]).float().numpy()

    k = cfg.top_k
    fit_pred, auto = [None], [0]
    for layer in range(1, cfg.num_layers):
        xs, zs = router_in(ctrace, layer - 1), router_in(ctrace, layer) @ model.layers[layer].moe.router.weight.detach().float().numpy().T
        cut = len(xs) - len(xs) // 8  # as moec calibrate: fitted on most of the text, extras chosen on the rest
        pw, pb = fit_prefetch(xs[:cut], zs[:cut])
        routed_chk = np.argsort(-zs[cut:], axis=1, kind="stable")[:, :k]
        auto.append(next((n for n in range(7) if prefetch_recall(xs[cut:] @ pw.T + pb, routed_chk, k, n) >= PREFETCH_TARGET), 6))
        scores = router_in(trace, layer - 1) @ pw.T + pb
        order = torch.from_numpy(np.argsort(-scores, axis=1, kind="stable"))
        fit_pred.append(order)
        for extra in sorted({0, 1, 2, 3, 4, auto[-1]}):
            pred = order[:, : k + extra]
            doc["rows"].append({"layer": layer, "source": "router_fit", "corrected": True, "extra": extra,
                                "auto": extra == auto[-1],
                                "recall": recall(pred, trace.routed[layer]),
                                "batch": {str(s_): batch_recall(pred, trace.routed[layer], s_, cfg.num_experts) for s_ in streams}})
    sims = {}
    for s in streams:
        steps = len(trace.routed[0]) // s
        def per_step(ids_by_layer):
            return [[sorted(set(ids_by_layer[layer][i * s:(i + 1) * s].reshape(-1).tolist())) if ids_by_layer[layer] is not None
                     else None for layer in range(cfg.num_layers)] for i in range(steps)]
        routed = per_step(trace.routed)
        row = {"steps": steps, "on_demand": simulate(routed, None, capacity),
               "perfect": simulate(routed, per_step([None] + trace.routed[1:]), capacity)}
        for source in ("post_attention", "layer_output"):
            for corrected in (False, True):
                for extra in (0, 1, 2):
                    pred = [None] + [predict(model, trace, layer, source, extra, maps[source] if corrected else None)
                                     for layer in range(1, cfg.num_layers)]
                    row[f"{source}{'-corrected' if corrected else ''}+{extra}"] = simulate(routed, per_step(pred), capacity)
        for extra in (0, 1, 2, "auto"):
            pred = [None] + [o[:, : k + (auto[i + 1] if extra == "auto" else extra)] for i, o in enumerate(fit_pred[1:])]
            row[f"router_fit+{extra}"] = simulate(routed, per_step(pred), capacity)
        sims[str(s)] = row
    commit = a.commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                        cwd=Path(__file__).resolve().parent).stdout.strip()
    out = {"benchmark": "expert_prediction", "command": "python bench/expert_prediction.py " + " ".join(argv or __import__("sys").argv[1:]),
           "git_commit": commit, "device": platform.processor() or platform.machine(), "model": str(a.model),
           "capacity_slots": capacity, "capacity_share": a.capacity, **doc, "router_fit_auto_extra": auto[1:],
           "cache_simulation": sims}
    Path(a.json).write_text(json.dumps(out, indent=2))
    for r in doc["rows"]:
        print(f"layer {r['layer']} {r['source']:>14} corrected={r['corrected']!s:5} +{r['extra']}: recall {r['recall']:.3f}",
              " ".join(f"S={k}: {v['recall']:.3f}" for k, v in r["batch"].items()))
    for s, row in sims.items():
        print(f"S={s}: stalls on-demand {row['on_demand']['stalls']}, prefetch post_attention-corrected+2 "
              f"{row['post_attention-corrected+2']['stalls']}, perfect {row['perfect']['stalls']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
