"""What each recognised attention adds to its scores: a causal mask, a causal sliding window, or something moec
does not implement.

moec's paged attention (and the tiered cache) attends each query over every cached token of its sequence: the
export's mask computation becomes dead code. That is exact for a causal mask (with the padding mask, which the
runtime's per-sequence lengths replace). A sliding window (``kv > q - W``: Cohere2-MoE, EXAONE-MoE, AFMoE layers)
is exact only while a sequence holds at most ``W`` tokens, so the window is found here, recorded per layer, and the
runtime refuses to grow a sequence past the smallest one (``max_context`` in the manifest). Anything else added to
the scores (ALiBi or relative-position biases, chunked or bidirectional masks) would be silently dropped: refused.

The mask is read where its computation holds constants other than a causal mask's (an integer of 2 or more: a
window; a float other than 0, 1 and the masking value): its bindings alone (they depend on the inputs' shapes and
the padding mask, never on weights) are compiled for the CPU and run for one sequence of ``window + 2`` tokens
(at most ``PROBE_MAX``), and every (query, key) entry is compared with the causal and sliding-window patterns. A
plain causal mask's constants leave it unread (no cost for the common case).
"""

from __future__ import annotations

import numpy as np
from tvm import relax

from .errors import UnsupportedModel
from .graph import DataflowGraph, const_scalar, dtype_of

PROBE_MAX = 8192  # longest probe sequence (its [L, L] float32 mask: 268 MB)
_MASKED = -1e30  # an additive mask entry at or below this hides the key (HF uses finfo.min or -inf)


def _constants(g: DataflowGraph, mask: relax.Var) -> tuple[list[int], list[float]]:
    """Integer constants of magnitude 2 or more, and float constants other than 0, 1 and masking values, used by
    the bindings ``mask`` is computed from."""
    ints, floats = [], []
    for v in g.ancestors(mask):
        call = g.call(v)
        if call is None:
            continue
        for a in call.args:
            c = const_scalar(a)
            if c is None or not np.isfinite(c) and c < 0:
                continue
            kind = (dtype_of(a) or "").split("x")[0]
            if kind.startswith(("int", "uint")):
                if abs(c) >= 2:
                    ints.append(int(abs(c)))
            elif kind.startswith(("float", "bfloat")) and c not in (0.0, 1.0) and c > _MASKED:
                floats.append(c)
    return ints, floats


def _probe_masks(g: DataflowGraph, masks: list, length: int, source: str) -> list[np.ndarray]:
    """Each mask's values ``[length, length]`` for one sequence of ``length`` tokens (padding mask all ones)."""
    import tvm

    keep = set()
    for m in masks:
        keep |= g.ancestors(m)
    used = [w for w in g.weights if w in keep]
    if used:
        raise UnsupportedModel(f"{source}: the attention mask {masks[0].name} is computed from the weight "
                               f"{used[0].name}: only causal masks and sliding windows are supported")
    blocks = []
    for block in g.func.body.blocks:
        kind = relax.DataflowBlock if isinstance(block, relax.DataflowBlock) else relax.BindingBlock
        blocks.append(kind([b for b in block.bindings if b.var in keep]))
    body = relax.SeqExpr(blocks, relax.Tuple(list(masks)))
    func = relax.Function(g.inputs, body, ret_ty=relax.TupleType([m.ty for m in masks]), is_pure=g.func.is_pure)
    mod = relax.transform.Normalize()(tvm.IRModule({"main": func}))
    mod = relax.transform.DeadCodeElimination(["main"])(mod)
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"})), tvm.cpu())
    args = []
    for inp in g.inputs:
        dt = dtype_of(inp) or "int64"
        args.append(tvm.runtime.tensor(np.ones((1, length), dtype=dt) if inp is not g.inputs[0] else
                                       np.arange(length, dtype=dt).reshape(1, length) % 3 + 3))
    res = vm["main"](*args)
    out = []
    for i, m in enumerate(masks):
        a = res[i].numpy()
        a = a.reshape((-1,) + a.shape[-2:])[0] if a.ndim >= 2 else a
        out.append(np.broadcast_to(a, (length, length)))
    return out


def _window_of(values: np.ndarray, what: str) -> int | None:
    """None for a causal mask, W for a causal sliding window of W keys; refuses anything else."""
    n = values.shape[0]
    if values.dtype == np.bool_:
        visible = values
    else:
        v = values.astype(np.float64)
        visible = v > _MASKED
        if np.any(v[visible] != 0.0):
            raise UnsupportedModel(f"{what} adds values other than 0 and the masking value to the attention scores "
                                   "(a positional bias such as ALiBi): not supported")
    q = np.arange(n)[:, None]
    k = np.arange(n)[None, :]
    width = int(visible[-1].sum())
    if np.array_equal(visible, k <= q):
        return None
    if 0 < width < n and np.array_equal(visible, (k <= q) & (k > q - width)):
        return width
    raise UnsupportedModel(f"{what} is neither causal nor a causal sliding window (e.g. chunked or bidirectional "
                           "attention): not supported")


def find_windows(func: relax.Function, num_inputs: int, attentions: list, source: str = "model") -> None:
    """Set ``sliding_window`` on each of ``attentions`` (``AttentionInfo`` with ``mask`` anchors of ``func``):
    None where its mask is causal, W where it is a sliding window of W keys; refuses other masks."""
    g = DataflowGraph(func, num_inputs)
    groups: dict = {}
    for att in attentions:
        if att.mask is not None:
            groups.setdefault(att.mask, []).append(att)
    todo = {}
    for mask, atts in groups.items():
        ints, floats = _constants(g, mask)
        if ints or floats:
            todo[mask] = max(ints, default=0)
    if not todo:
        return
    length = min(max(todo.values()) + 2, PROBE_MAX)
    length = max(length, 8)
    masks = list(todo)
    for mask, values in zip(masks, _probe_masks(g, masks, length, source)):
        what = f"{source}: the attention mask {mask.name} (of {len(groups[mask])} attention layer(s))"
        window = _window_of(values, what)
        if window is None and todo[mask] + 2 > length:
            # the probe was shorter than the constant: a window beyond PROBE_MAX keys is assumed (conservative: the
            # runtime then refuses sequences longer than it, which a causal mask would have served)
            window = todo[mask]
        for att in groups[mask]:
            att.sliding_window = window


__all__ = ["find_windows", "PROBE_MAX"]
