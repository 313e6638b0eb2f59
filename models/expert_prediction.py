"""Speculative expert prediction on the reference MoE: which experts will layer l + 1 route to?

When expert weights live in host memory, the experts of layer l + 1 must be copied to the GPU before
its router runs. ``predict`` guesses them from what is known earlier, by applying layer l + 1's own
post-attention norm and router to an earlier hidden state:

  ``post_attention``  layer l's post-attention hidden state (the input of its MoE block): known before
                      layer l's experts run, so the copy overlaps layer l's experts and layer l + 1's
                      attention;
  ``layer_output``    layer l's output (the input of layer l + 1): closer to the truth, but the copy
                      only overlaps layer l + 1's attention.

``calibrate_correction`` optionally fits, per layer pair, a least-squares linear map from the source
state to layer l + 1's post-attention state on calibration tokens (the residual stream changes by
attention and experts in between); ``predict(..., correction=maps)`` applies it first.

Scores: ``recall`` is, per token, the share of the experts the router picked that were predicted
(mean over tokens), and ``batch_recall`` the same for a batch of S streams decoding together, where a
prefetch serves every stream (the union of the streams' experts). Predicting ``top_k + extra``
experts trades copy bytes for recall. Group-limited routing (DeepSeek) is predicted by the experts'
unrestricted scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .reference import MoEForCausalLM

SOURCES = ("post_attention", "layer_output")


@dataclass
class RoutingTrace:
    """Per layer, for T tokens: the post-attention state [T, D], the layer output [T, D], the routed ids [T, K]."""

    post_attention: list[torch.Tensor]
    layer_output: list[torch.Tensor]
    routed: list[torch.Tensor]

    @property
    def num_layers(self) -> int:
        return len(self.routed)


@torch.no_grad()
def routing_trace(model: MoEForCausalLM, input_ids: torch.Tensor) -> RoutingTrace:
    """Run ``model`` on ``input_ids [B, S]`` and record each layer's states and routed experts (tokens flattened)."""
    post, out, routed, hooks = {}, {}, {}, []
    for i, layer in enumerate(model.layers):
        d = model.config.hidden_size
        hooks.append(layer.post_attention_norm.register_forward_hook(
            lambda _m, args, _o, i=i: post.__setitem__(i, args[0].reshape(-1, d).clone())))
        hooks.append(layer.moe.router.register_forward_hook(lambda _m, _a, o, i=i: routed.__setitem__(i, o[1].clone())))
        hooks.append(layer.register_forward_hook(lambda _m, _a, o, i=i: out.__setitem__(i, o.reshape(-1, d).clone())))
    was = model.training_kernels
    model.use_training_kernels(True)  # experts grouped: the gathered per-token weights of a long trace do not fit
    try:
        model(input_ids)
    finally:
        model.use_training_kernels(was)
        for h in hooks:
            h.remove()
    n = len(model.layers)
    return RoutingTrace([post[i] for i in range(n)], [out[i] for i in range(n)], [routed[i] for i in range(n)])


def _choice(router, x: torch.Tensor) -> torch.Tensor:
    logits = torch.nn.functional.linear(x, router.weight)
    scores = torch.softmax(logits, -1) if router.cfg.router_score == "softmax" else torch.sigmoid(logits)
    return scores if router.bias is None else scores + router.bias


@torch.no_grad()
def predict(model: MoEForCausalLM, trace: RoutingTrace, layer: int, source: str = "post_attention", extra: int = 0,
            correction: dict | None = None) -> torch.Tensor:
    """Predicted experts of ``layer`` (>= 1), ``[T, top_k + extra]``, from ``layer - 1``'s ``source`` state."""
    if source not in SOURCES:
        raise ValueError(f"unknown prediction source {source!r}: expected one of {', '.join(SOURCES)}")
    if not 1 <= layer < trace.num_layers:
        raise ValueError(f"layer {layer}: a prediction needs a previous layer (1 <= layer < {trace.num_layers})")
    h = getattr(trace, source)[layer - 1]
    if correction is not None and (source, layer) in correction:
        a, b = correction[(source, layer)]
        h = h @ a + b
    target = model.layers[layer]
    k = min(model.config.top_k + extra, model.config.num_experts)
    return torch.topk(_choice(target.moe.router, target.post_attention_norm(h)), k, dim=-1).indices


@torch.no_grad()
def calibrate_correction(trace: RoutingTrace, source: str = "post_attention", ridge: float = 1e-3) -> dict:
    """Per layer l >= 1, the least-squares map ``(A, b)`` with ``state_{l-1} @ A + b ~ post_attention_l``."""
    maps = {}
    for layer in range(1, trace.num_layers):
        x = getattr(trace, source)[layer - 1].double()
        y = trace.post_attention[layer].double()
        xa = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
        reg = ridge * torch.eye(xa.shape[1], dtype=x.dtype) * (xa * xa).mean()
        w = torch.linalg.solve(xa.T @ xa + reg, xa.T @ y)
        maps[(source, layer)] = (w[:-1].float(), w[-1].float())
    return maps


def recall(predicted: torch.Tensor, routed: torch.Tensor) -> float:
    """Mean over tokens of |predicted & routed| / |routed|."""
    hit = (predicted[:, :, None] == routed[:, None, :]).any(1)  # T, K: routed expert predicted
    return float(hit.float().mean())


def batch_recall(predicted: torch.Tensor, routed: torch.Tensor, streams: int, num_experts: int) -> dict:
    """Streams decode together in groups of ``streams`` consecutive tokens' rows: per group, the share of the
    union of routed experts that the union of predictions covers (mean over groups), and the predicted
    experts per group (the copies a prefetch makes) against the routed ones."""
    t = (len(routed) // streams) * streams
    if t == 0:
        raise ValueError(f"{len(routed)} tokens do not fill one group of {streams} streams")
    def sets(ids):
        onehot = torch.zeros(t // streams, num_experts, dtype=torch.bool)
        grp = ids[:t].reshape(t // streams, -1)
        onehot.scatter_(1, grp, True)
        return onehot

    p, r = sets(predicted), sets(routed)
    need = r.sum(1).float()
    return {"recall": float(((p & r).sum(1).float() / need).mean()), "predicted_per_step": float(p.sum(1).float().mean()),
            "routed_per_step": float(need.mean())}


def evaluate_prediction(model: MoEForCausalLM, tokens: np.ndarray, context: int = 256, max_tokens: int = 8192,
                        calibration_tokens: np.ndarray | None = None, extras=(0, 1, 2), streams=(1, 4, 16)) -> dict:
    """Recall per layer, source and extra (and with a correction fitted on ``calibration_tokens``) on windows of
    ``context`` tokens of ``tokens`` (held-out text)."""
    def windows(toks):
        n = min(len(toks) // context, max(1, max_tokens // context))
        return torch.from_numpy(np.asarray(toks[: n * context], dtype=np.int64).reshape(n, context))

    cfg = model.config
    trace = routing_trace(model, windows(tokens))
    corrections = {}
    if calibration_tokens is not None:
        ctrace = routing_trace(model, windows(calibration_tokens))
        corrections = {s: calibrate_correction(ctrace, s) for s in SOURCES}
    rows = []
    for layer in range(1, trace.num_layers):
        for source in SOURCES:
            for corrected in ([False, True] if corrections else [False]):
                for extra in extras:
                    pred = predict(model, trace, layer, source, extra, corrections.get(source) if corrected else None)
                    row = {"layer": layer, "source": source, "corrected": corrected, "extra": extra,
                           "recall": recall(pred, trace.routed[layer])}
                    row["batch"] = {str(s): batch_recall(pred, trace.routed[layer], s, cfg.num_experts) for s in streams}
                    rows.append(row)
    # a predictor that knows nothing: the previous layer's own experts
    base = [{"layer": layer, "recall": recall(trace.routed[layer - 1], trace.routed[layer])} for layer in range(1, trace.num_layers)]
    return {"tokens": int(len(trace.routed[0])), "context": context, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
            "rows": rows, "baseline_previous_layer_experts": base,
            "random_recall": {str(e): min(1.0, (cfg.top_k + e) / cfg.num_experts) for e in extras}}
