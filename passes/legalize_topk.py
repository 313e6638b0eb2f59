"""Legalization of ``relax.topk`` over the last axis as rank-select TIR (no sort, no extern call).

The stock CPU legalization calls ``tvm.contrib.sort.topk``, a packed function that lives in TVM's
compiler library, so an artifact using it cannot run with the runtime library alone. MoE routers take
top-k over at most a few hundred experts: ranking every score against every other (E^2 compares per
token) is cheap, parallel and exact. Ties go to the lower index, as a stable sort would.

Expects: ``topk`` calls with any rank and ``axis`` (moved to last internally).
Guarantees: one ``call_tir`` (two small reductions) for the indices and a gather for the values; same values and indices as ``topk``.
"""

from __future__ import annotations

from tvm import relax, te, tirx


def _topk_rank_select(x: te.Tensor, k: int, largest: bool, index_dtype: str):
    rows, n = x.shape
    i = te.reduce_axis((0, n), "i")

    def before(r, a, b):  # does element a rank before element b?
        xa, xb = x[r, a], x[r, b]
        better = xa > xb if largest else xa < xb
        return tirx.Or(better, tirx.And(xa == xb, a < b))

    rank = te.compute((rows, n), lambda r, j: te.sum(tirx.Select(before(r, i, j), 1, 0), axis=i), name="topk_rank")
    j = te.reduce_axis((0, n), "j")
    idx = te.compute(
        (rows, k),
        lambda r, p: te.sum(tirx.Select(rank[r, j] == p, j.astype(index_dtype), tirx.const(0, index_dtype)), axis=j),
        name="topk_index",
    )
    return idx


def legalize_topk(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    x = call.args[0]
    attrs = call.attrs
    k, axis, largest = int(attrs.k), int(attrs.axis), bool(attrs.largest)
    ret_type, index_dtype = str(attrs.ret_type), str(attrs.dtype)
    shape = list(x.ty.shape.values)
    rank = len(shape)
    axis = axis % rank
    if axis != rank - 1:
        perm = [d for d in range(rank) if d != axis] + [axis]
        x = bb.normalize(relax.op.permute_dims(x, perm))
        shape = [shape[d] for d in perm]
    lead = shape[:-1]
    rows = 1
    for d in lead:
        rows = rows * d
    flat = bb.normalize(relax.op.reshape(x, [rows, shape[-1]]))
    idx = bb.emit_te(_topk_rank_select, flat, k, largest, index_dtype, primfunc_name_hint="topk_rank_select")
    val = bb.normalize(relax.op.gather_elements(flat, idx, axis=1))
    vals = bb.normalize(relax.op.reshape(val, lead + [k]))
    idxs = bb.normalize(relax.op.reshape(idx, lead + [k]))
    if axis != rank - 1:
        inv = list(range(rank - 1))
        inv.insert(axis, rank - 1)
        vals = bb.normalize(relax.op.permute_dims(vals, inv))
        idxs = bb.normalize(relax.op.permute_dims(idxs, inv))
    if ret_type == "values":
        return vals
    if ret_type == "indices":
        return idxs
    return relax.Tuple([vals, idxs])
