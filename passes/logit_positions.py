"""Logits at the requested positions only: the prefill entries' LM head runs on ``logit_pos``'s rows.

A prefill call of N prompt tokens needs the logits of a few positions (``logit_pos``: usually each prompt's last
token). Gathering them after the LM head computes N x vocab logits and throws almost all away: at N = 2048 and
a 50k vocabulary that is a 0.4 GB float32 tensor and an LM-head GEMM 2048 / b times larger than needed.

``logits_at_positions`` moves the gather up the chain of token-wise operations that ends in the logits, found
by structure: from the entry's output back through the LM head's matmul (against a weight with no token axis),
elementwise operations whose other operand has no token axis (a norm weight, a bias, a logit scale or soft
cap), dtype casts and reshapes that keep the token axis apart (``[1, N, D] <-> [N, D]``). It stops at the first
operation that mixes tokens or whose operands both carry them (the final norm's ``x * rsqrt(mean(x^2))``), and
the gather goes there. Every operation moved is per token, so the logits are the same numbers, computed for
``len(logit_pos)`` rows.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ..compiler.graph import same_dim as _is
from ..compiler.graph import shape_of

_UNARY = {"relax.astype", "relax.tanh", "relax.sigmoid", "relax.negative"}
_BINARY = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide"}


def _has(shape, n) -> bool:
    return any(_is(d, n) for d in shape)


def _ones_before(shape, axis) -> bool:
    return all(isinstance(d, int) and d == 1 for d in shape[:axis])


def _token_step(call: relax.Call, axis: int, n):
    """``(operand index, its token axis)`` when ``call``'s output row ``axis`` depends on that operand's row only."""
    name = call.op.name
    out = shape_of(call)
    if out is None or axis >= len(out) or not _is(out[axis], n):
        return None
    shapes = [shape_of(a) for a in call.args]
    if name in _UNARY:
        return (0, axis) if shapes[0] is not None and len(shapes[0]) == len(out) else None
    if name in _BINARY:
        tok = [i for i, s in enumerate(shapes) if s is not None and _has(s, n)]
        if len(tok) != 1 or shapes[1 - tok[0]] is None or len(shapes[tok[0]]) != len(out):
            return None
        other = shapes[1 - tok[0]]
        at = axis - (len(out) - len(other))  # the other operand's dim broadcast against the token axis
        if at >= 0 and other[at] != 1:
            return None
        return tok[0], axis
    if name == "relax.matmul":
        x, w = shapes
        if x is None or w is None or len(w) != 2 or _has(w, n) or len(x) != len(out) or axis >= len(out) - 1:
            return None
        return 0, axis
    if name == "relax.reshape":
        x = shapes[0]
        if x is None or sum(_is(d, n) for d in out) != 1 or not _ones_before(out, axis):
            return None
        j = [i for i, d in enumerate(x) if _is(d, n)]
        if len(j) != 1 or not _ones_before(x, j[0]):
            return None
        return 0, j[0]
    return None


def logits_at_positions(body: relax.SeqExpr, logit_pos: relax.Var, n) -> relax.SeqExpr | None:
    """``body`` (an entry's forward, returning logits ``[1, N, V]`` or a tuple of them first) returning
    ``[1, len(logit_pos), V]``: the gather moved up the token-wise chain. None when no operation could move
    (the caller then gathers after the logits)."""
    if not body.blocks:
        return None
    bindings = {b.var: b.value for blk in body.blocks for b in blk.bindings}
    out = body.body
    while isinstance(out, relax.Var) and isinstance(bindings.get(out), (relax.Var, relax.Tuple)):
        out = bindings[out]
    if isinstance(out, relax.Tuple):
        out = out.fields[0]
    chain, v, axis = [], out, 1
    while isinstance(v, relax.Var):
        val = bindings.get(v)
        if isinstance(val, relax.Var):
            v = val
            continue
        if not isinstance(val, relax.Call) or not isinstance(val.op, tvm.ir.Op):
            break
        step = _token_step(val, axis, n)
        if step is None or not isinstance(val.args[step[0]], relax.Var):
            break
        chain.append((val, step[0], axis))
        v, axis = val.args[step[0]], step[1]
    if not chain:
        return None
    last = body.blocks[-1]
    local = {b.var for b in last.bindings}
    for val, idx, _ in chain:  # every operand the moved chain reads must be visible at the end of the last block
        for a in [v] + [x for i, x in enumerate(val.args) if i != idx]:
            if isinstance(a, relax.DataflowVar) and a not in local:
                return None
    dataflow = isinstance(last, relax.DataflowBlock)
    bb = relax.BlockBuilder()
    b = shape_of(logit_pos)[0]
    new, prev = [], v
    steps = [(relax.op.take(v, logit_pos, axis=axis), None)] + [(val, (idx, ax)) for val, idx, ax in reversed(chain)]
    for k, (expr, how) in enumerate(steps):
        if how is not None:
            idx, ax = how
            if expr.op.name == "relax.reshape":
                expr = relax.op.reshape(prev, [b if i == ax else d for i, d in enumerate(shape_of(expr))])
            else:
                args = list(expr.args)
                args[idx] = prev
                expr = relax.Call(expr.op, args, expr.attrs, expr.ty_args)
        expr = bb.normalize(expr)
        final = k == len(steps) - 1
        var = (relax.DataflowVar if dataflow and not final else relax.Var)(f"logits_at{k}", expr.ty)
        new.append(relax.VarBinding(var, expr))
        prev = var
    block = (relax.DataflowBlock if dataflow else relax.BindingBlock)(list(last.bindings) + new)
    return relax.SeqExpr(list(body.blocks[:-1]) + [block], prev)
