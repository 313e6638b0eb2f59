"""Cascade routing in PyTorch, computed the way ``passes.cascade_gating.emit_cascade`` computes it.

One function, ``cascade_route``, is the numerical reference of the pass: the calibration statistics,
the fidelity benchmark and the tests route with it, and the compiled model is checked against it.
``cascaded(model, specs)`` installs it in the routers of a reference ``MoEForCausalLM``.

Legend: T tokens, D hidden, E experts, G groups, n = E/G per group, g kept, C = g*n candidates, K active.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch


def _tensor(a, dtype, device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a), device=device).to(dtype)


def cascade_route(x: torch.Tensor, rows: torch.Tensor, spec, top_k: int, score: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores and global ids ``(values [T, K], ids [T, K])`` of the cascade router (module docstring of the pass).

    Parameters
    ----------
    x : [T, D] router inputs; rows : [E, D] the router weight.
    spec : has ``groups [G, n]`` (expert ids), ``coarse [G, D]``, ``bias [G]`` and ``keep`` (g), e.g. a
        ``passes.cascade_gating.CascadeSpec``.
    score : "softmax" | "sigmoid"
    """
    dev, dt = x.device, x.dtype
    groups = torch.as_tensor(np.asarray(spec.groups, dtype=np.int64), device=dev)  # G, n
    big_g, n = groups.shape
    g = int(spec.keep)
    c = g * n
    coarse = x @ _tensor(spec.coarse, torch.float32, dev).to(dt).T  # T, G
    bias = np.asarray(spec.bias)
    if np.any(bias):
        coarse = coarse + _tensor(bias, torch.float32, dev).to(dt)
    need_dropped = score == "softmax" and g < big_g
    ranked = torch.topk(coarse, big_g if need_dropped else g, dim=-1)
    chosen = ranked.indices[:, :g]  # T, g
    cand = groups[chosen].reshape(x.shape[0], c)  # T, C global expert ids
    fine = (rows[cand] * x[:, None, :]).sum(-1)  # T, C: only the candidates' router rows
    if score == "softmax":
        z = torch.cat([fine, ranked.values[:, g:]], dim=1) if need_dropped else fine  # T, C + G - g
        p = torch.softmax(z, dim=-1)[:, :c]
    elif score == "sigmoid":
        p = torch.sigmoid(fine)
    else:
        raise ValueError(f"cascade routing needs softmax or sigmoid scores, got {score!r}")
    values, j = torch.topk(p, top_k, dim=-1)  # T, K
    return values, cand.gather(1, j)


def flat_topk(x: torch.Tensor, rows: torch.Tensor, top_k: int) -> torch.Tensor:
    """The flat router's top-k expert ids ``[T, K]`` (softmax and sigmoid keep the order of the logits)."""
    return torch.topk(x @ rows.T, top_k, dim=-1).indices


def set_agreement(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> tuple[float, float]:
    """``(exact, overlap)``: share of tokens whose top-k sets are equal, and mean |a ∩ b| / k."""
    a, b = np.asarray(a), np.asarray(b)
    inter = (a[:, :, None] == b[:, None, :]).any(-1).sum(-1)  # T
    k = a.shape[1]
    return float((inter == k).mean()), float(inter.mean() / k)


@contextmanager
def cascaded(model, specs: dict, record: dict | None = None):
    """Route ``model``'s layers (index -> spec) with ``cascade_route`` inside the block.

    The weights follow the router's own rule (renormalised over the top-k when the model does).
    With ``record`` (a dict), each routed layer appends ``(cascade ids, flat ids)`` of every call to
    ``record[layer]``: the flat router's choice on the same hidden states.
    """
    from .reference import Router

    saved = []
    try:
        for i, layer in enumerate(model.layers):
            router = layer.moe.router
            if i not in specs:
                continue
            if not isinstance(router, Router) or router.cfg.n_group > 1 or router.bias is not None:
                raise ValueError(f"layer {i}: cascade routing replaces flat routers without a bias only")

            def forward(x, _r=router, _spec=specs[i], _i=i):
                cfg = _r.cfg
                values, ids = cascade_route(x, _r.weight, _spec, cfg.top_k, cfg.router_score)
                if record is not None:
                    record.setdefault(_i, []).append((ids.detach().cpu(), flat_topk(x, _r.weight, cfg.top_k).cpu()))
                if cfg.norm_topk_prob:
                    values = values / values.sum(dim=-1, keepdim=True)
                return values, ids

            saved.append(router)
            router.forward = forward
        yield model
    finally:
        for router in saved:
            del router.forward  # back to the class's forward


__all__ = ["cascade_route", "cascaded", "flat_topk", "set_agreement"]
