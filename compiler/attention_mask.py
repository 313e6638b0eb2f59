"""What each recognised attention adds to its scores: a causal mask, a causal sliding window, or something moec
does not implement.

moec's paged attention (and the tiered cache) attends each query over every cached token of its sequence: the
export's mask computation becomes dead code. That is exact for a causal mask (with the padding mask, which the
runtime's per-sequence lengths replace). A sliding window (``kv > q - W``: Cohere2-MoE, EXAONE-MoE, AFMoE layers)
is exact only while a sequence holds at most ``W`` tokens, so the window is found here, recorded per layer, and the
runtime refuses to grow a sequence past the smallest one (``max_context`` in the manifest). Anything else added to
the scores (ALiBi or relative-position biases, chunked or bidirectional masks) would be silently dropped: refused.

Every term the scores add is read unless it is computed as a causal mask is (a comparison of positions or a
triangle, and no constant but 0, 1 and the masking value): where it holds an integer of 2 or more (a window), another
float, a table (a bias per head or position), or no comparison at all, its bindings alone (they depend on the inputs'
shapes and the padding mask; one computed from weights is refused) are compiled for the CPU and run for one sequence
of ``window + 2`` tokens (at most ``PROBE_MAX``), and every (query, key) entry is compared with the causal and
sliding-window patterns. A plain causal mask is left unread (no cost for the common case).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from .errors import UnsupportedModel
from .graph import DataflowGraph, const_scalar, dtype_of

PROBE_MAX = 8192  # longest probe sequence (its [L, L] float32 mask: 268 MB)
_MASKED = -1e30  # an additive mask entry at or below this hides the key (HF uses finfo.min or -inf)


_COMPARES = ("relax.less", "relax.less_equal", "relax.greater", "relax.greater_equal", "relax.tril", "relax.triu")


def _probe_length(g: DataflowGraph, mask) -> int | None:
    """None where ``mask`` is computed as a causal mask is (a comparison of positions or a triangle, and no constant
    but 0, 1 and the masking value); else the sequence length to probe it at (the largest integer constant + 2:
    the window, if there is one, fits)."""
    if not isinstance(mask, relax.Var):  # a constant: one number shifts every score alike (softmax ignores it)
        return None if const_scalar(mask) is not None else 8
    anc = g.ancestors(mask)
    ints, other, compares = [], False, False
    for v in anc:
        call = g.call(v)
        if call is None:
            continue
        compares |= g.op(v) in _COMPARES
        for a in call.args:
            if isinstance(a, tvm.ir.GenericConst) and const_scalar(a) is None:
                other = True  # a table (a bias per head or position)
                continue
            c = const_scalar(a)
            if c is None or not np.isfinite(c) and c < 0:
                continue
            if (dtype_of(a) or "").startswith(("int", "uint")):
                if abs(c) >= 2:
                    ints.append(int(abs(c)))
            elif c not in (0.0, 1.0) and c > _MASKED:
                other = True
    if ints or other or not compares:
        return max(ints, default=6) + 2
    return None


def _probe_masks(g: DataflowGraph, masks: list, length: int, source: str) -> list[np.ndarray]:
    """Each mask's values for one sequence of ``length`` tokens (padding mask all ones): ``[n, length, length]``,
    the first and the last of its leading entries (heads)."""
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
        a = a.reshape((-1,) + a.shape[-2:]) if a.ndim >= 2 else a.reshape(1, 1, -1)
        out.append(np.broadcast_to(a[[0, -1]], (2, length, length)))
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
    """Set ``sliding_window`` on each of ``attentions`` (``AttentionInfo`` with the ``masks`` its scores add, anchors
    of ``func``): None where they are causal, W where one is a sliding window of W keys; refuses other masks."""
    g = DataflowGraph(func, num_inputs)
    users: dict = {}
    for att in attentions:
        for m in att.masks:
            users.setdefault(m, []).append(att)
    todo = {m: n for m in users if (n := _probe_length(g, m)) is not None}
    if not todo:
        return
    const = [m for m in todo if not isinstance(m, relax.Var)]
    if const:
        raise UnsupportedModel(f"{source}: an attention adds a constant table to its scores (a positional bias): not supported")
    length = max(8, min(max(todo.values()), PROBE_MAX))
    masks = list(todo)
    try:
        probed = _probe_masks(g, masks, length, source)
    except UnsupportedModel:
        raise
    except Exception as exc:  # refused rather than compiled unchecked: a wrong mask would change every output
        msg = str(exc).strip().splitlines()
        raise UnsupportedModel(f"{source}: the attention mask {masks[0].name} could not be evaluated to check that it is "
                               f"causal or a sliding window ({msg[-1] if msg else type(exc).__name__})") from None
    for mask, values in zip(masks, probed):
        what = f"{source}: the attention mask {mask.name} (of {len(users[mask])} attention layer(s))"
        windows = {_window_of(v, what) for v in values}
        if len(windows) > 1:
            raise UnsupportedModel(f"{what} differs between heads: not supported")
        window = windows.pop()
        if window is None and todo[mask] > length:
            # the probe was shorter than the constant: a window beyond PROBE_MAX keys is assumed (conservative: the
            # runtime then refuses sequences longer than it, which a causal mask would have served)
            window = todo[mask] - 2
        for att in users[mask]:
            if window is not None:
                att.sliding_window = window if att.sliding_window is None else min(att.sliding_window, window)


__all__ = ["find_windows", "PROBE_MAX"]
