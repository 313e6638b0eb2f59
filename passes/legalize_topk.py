"""Legalization of ``relax.topk`` as a selection kernel in TIR (no sort, no extern call).

The stock CPU legalization calls ``tvm.contrib.sort.topk``, a packed function that lives in TVM's
compiler library, so an artifact using it cannot run with the runtime library alone; the GPU one sorts
whole rows. MoE routers take top-k (k <= 16) over at most a few hundred experts per token: selecting the k best
in k passes over the row is exact and needs no scratch memory. The CPU form is one row per loop
iteration; the CUDA form is one warp per row: each lane holds ceil(n / 32) entries in registers, and
each pass is a warp argmax by xor shuffles (about 10 shuffles per pass, no memory traffic after the
first read). One thread walking a row of 64 experts 8 times took 0.15 ms per router on the H200 at
128 tokens, more than the layer's dense projections. Ties go to the lower index, as a stable sort would.

Expects: ``topk`` calls with any rank and ``axis`` (moved to last internally), static row length and k.
Guarantees: one scheduled (``tirx.is_scheduled``) ``call_tir``, opaque to fusion, writing the indices and
(unless only the indices are asked for) the values; same results as ``topk``.

``FuseSoftmaxTopK`` (phase 1, before the legalization) gives a router's ``topk(softmax(x))`` the same kernel
with the softmax folded in (``topk_softmax``): see its docstring.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.sym.analyzer import Analyzer
from tvm.script import tirx as T

from ..schedules.kernels import memoized
from ..schedules.kernels.topk import NEG, warp_select

_ROW_WARPS = 4  # CUDA form: rows (warps) per block


@memoized
def topk_select_func(n: int, k: int, dtype: str, index_dtype: str, largest: bool, gpu: bool,
                     values_dtype: str | None = None, softmax: bool = False) -> tirx.PrimFunc:
    """PrimFunc ``(x[R, n], idx[R, k] [, val[R, k]])``: indices of the k largest (smallest) entries of each row and,
    with ``values_dtype``, their values; with ``softmax`` (largest only) the values are those of ``softmax(x)``
    over the row, computed in float32 (the order is the same: softmax is increasing)."""
    if softmax and not (largest and values_dtype is not None):
        raise ValueError("topk of a softmax: the k largest, with values")
    sign = T.float32(1.0 if largest else -1.0)
    if gpu:
        return _topk_select_warp(n, k, dtype, index_dtype, largest, values_dtype, softmax)

    @T.macro
    def select_row(x, idx, val, r, best, best_i, taken, stat):
        if softmax:  # the row's max and sum of exponentials first
            stat[0] = T.float32(-3.0e38)
            for e in range(n):
                stat[0] = T.max(stat[0], T.Cast("float32", x[r, e]))
            stat[1] = T.float32(0)
            for e in range(n):
                stat[1] = stat[1] + T.exp(T.Cast("float32", x[r, e]) - stat[0])
        # k passes; each takes the best entry not chosen by an earlier pass (first index wins ties)
        for p in range(k):
            best[0] = T.float32(-3.0e38)
            best_i[0] = T.int64(-1)
            for e in range(n):
                taken[0] = 0
                for q in range(p):
                    if T.Cast("int64", idx[r, q]) == T.int64(e):
                        taken[0] = 1
                if taken[0] == 0:
                    if best_i[0] < T.int64(0) or T.Cast("float32", x[r, e]) * sign > best[0]:
                        best[0] = T.Cast("float32", x[r, e]) * sign
                        best_i[0] = T.int64(e)
            idx[r, p] = T.Cast(index_dtype, best_i[0])
            if values_dtype is not None:
                if softmax:
                    val[r, p] = T.Cast(values_dtype, T.exp(best[0] - stat[0]) / stat[1])
                else:
                    val[r, p] = T.Cast(values_dtype, best[0] * sign)

    @T.macro
    def rows_loop(x, idx, val, rows):
        with T.sblock("root"):
            for r in T.parallel(rows):
                best = T.decl_buffer((1,), "float32", scope="local")
                best_i = T.decl_buffer((1,), "int64", scope="local")
                taken = T.decl_buffer((1,), "int32", scope="local")
                stat = T.decl_buffer((2,), "float32", scope="local")
                select_row(x, idx, val, r, best, best_i, taken, stat)

    if values_dtype is None:
        @T.prim_func(private=True, s_tir=True)
        def topk_select_cpu(var_x: T.handle, var_idx: T.handle):
            T.func_attr({"tirx.is_scheduled": True, "tir.noalias": True, "op_pattern": 8})
            rows = T.int64()
            x = T.match_buffer(var_x, (rows, n), dtype)
            idx = T.match_buffer(var_idx, (rows, k), index_dtype)
            rows_loop(x, idx, idx, rows)  # no values: never written
        return topk_select_cpu

    @T.prim_func(private=True, s_tir=True)
    def topk_values_cpu(var_x: T.handle, var_idx: T.handle, var_val: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tir.noalias": True, "op_pattern": 8})
        rows = T.int64()
        x = T.match_buffer(var_x, (rows, n), dtype)
        idx = T.match_buffer(var_idx, (rows, k), index_dtype)
        val = T.match_buffer(var_val, (rows, k), values_dtype)
        rows_loop(x, idx, val, rows)

    return topk_values_cpu


def _topk_select_warp(n: int, k: int, dtype: str, index_dtype: str, largest: bool, values_dtype: str | None = None,
                      softmax: bool = False) -> tirx.PrimFunc:
    """CUDA form: a warp per row. Lane l holds entries l, l + 32, ... (sign-adjusted float32) and a bit
    mask of those already taken; each pass reduces (value, index) over the warp with xor shuffles, the
    larger value winning and, on a tie, the lower index (as the CPU form), and the owning lane marks it.
    With ``softmax`` the row's max and sum of exponentials are reduced first (shuffles too)."""
    C = -(-n // 32)  # entries per lane
    sign = T.float32(1.0 if largest else -1.0)
    select = warp_select(n, k, index_dtype, values_dtype, softmax, largest)  # (raises past 992 entries)

    @T.macro
    def body(x, idx, val, rows):
        with T.sblock("root"):
            for bx in T.thread_binding((rows + _ROW_WARPS - 1) // _ROW_WARPS, thread="blockIdx.x"):
                for ty in T.thread_binding(_ROW_WARPS, thread="threadIdx.y"):
                    for tx in T.thread_binding(32, thread="threadIdx.x"):
                        vals = T.decl_buffer((C,), "float32", scope="local")
                        taken = T.decl_buffer((1,), "int32", scope="local")
                        bv = T.decl_buffer((1,), "float32", scope="local")
                        bi = T.decl_buffer((1,), "int32", scope="local")  # n: no candidate
                        ov = T.decl_buffer((1,), "float32", scope="local")
                        oi = T.decl_buffer((1,), "int32", scope="local")
                        stat = T.decl_buffer((2,), "float32", scope="local")  # softmax: row max, sum of exp
                        r: T.let[T.int64] = bx * _ROW_WARPS + T.Cast("int64", ty)
                        if r < rows:  # the same for the whole warp: the shuffles see every lane
                            for c in T.unroll(C):
                                vals[c] = T.if_then_else(c * 32 + tx < n,
                                                         T.Cast("float32", x[r, T.min(c * 32 + tx, n - 1)]) * sign, T.float32(NEG))
                            select(vals, taken, stat, bv, bi, ov, oi, tx, idx, val, r)

    if values_dtype is None:
        @T.prim_func(private=True, s_tir=True)
        def topk_select(var_x: T.handle, var_idx: T.handle):
            T.func_attr({"tirx.is_scheduled": True, "tir.noalias": True, "op_pattern": 8})
            rows = T.int64()
            x = T.match_buffer(var_x, (rows, n), dtype)
            idx = T.match_buffer(var_idx, (rows, k), index_dtype)
            body(x, idx, idx, rows)  # no values: never written
        return topk_select

    @T.prim_func(private=True, s_tir=True)
    def topk_values(var_x: T.handle, var_idx: T.handle, var_val: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tir.noalias": True, "op_pattern": 8})
        rows = T.int64()
        x = T.match_buffer(var_x, (rows, n), dtype)
        idx = T.match_buffer(var_idx, (rows, k), index_dtype)
        val = T.match_buffer(var_val, (rows, k), values_dtype)
        body(x, idx, val, rows)

    return topk_values


def legalize_topk(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    from tvm.target import Target

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
    n = int(shape[-1])
    flat = bb.normalize(relax.op.reshape(x, [rows, n]))
    target = Target.current(allow_none=True)
    gpu = target is not None and target.kind.name != "llvm"
    dtype = str(x.ty.dtype)
    if ret_type == "indices":
        gv = bb.add_func(topk_select_func(n, k, dtype, index_dtype, largest, gpu), "topk_select")
        idx, val = bb.emit(relax.call_tir(gv, [flat], relax.TensorType([rows, k], index_dtype))), None
    else:  # the kernel writes the values too (no gather after it)
        gv = bb.add_func(topk_select_func(n, k, dtype, index_dtype, largest, gpu, values_dtype=dtype), "topk_select")
        out = bb.emit(relax.call_tir(gv, [flat], [relax.TensorType([rows, k], index_dtype), relax.TensorType([rows, k], dtype)]))
        idx, val = bb.emit(relax.TupleGetItem(out, 0)), bb.emit(relax.TupleGetItem(out, 1))
    idxs = bb.normalize(relax.op.reshape(idx, lead + [k]))
    vals = bb.normalize(relax.op.reshape(val, lead + [k])) if val is not None else None
    if axis != rank - 1:
        inv = list(range(rank - 1))
        inv.insert(axis, rank - 1)
        vals = bb.normalize(relax.op.permute_dims(vals, inv)) if vals is not None else None
        idxs = bb.normalize(relax.op.permute_dims(idxs, inv))
    if ret_type == "values":
        return vals
    if ret_type == "indices":
        return idxs
    return relax.Tuple([vals, idxs])


@relax.expr_functor.mutator
class _SoftmaxTopKRewriter(relax.PyExprMutator):
    def __init__(self, mod, matches: dict, kernel) -> None:
        super().__init__(mod)
        self.matches = matches  # topk var -> (logits, n, k, index dtype, values dtype, ret_type, cast var)
        self.kernel = kernel
        self.cast = {}  # the values' cast var -> the kernel's values, written in its dtype

    def visit_var_binding_(self, binding) -> None:
        if binding.var in self.cast:
            self.set_var_remap(binding.var, self.cast[binding.var])
            return
        m = self.matches.get(binding.var)
        if m is None:
            super().visit_var_binding_(binding)
            return
        from ..compiler.graph import dtype_of

        logits, n, k, index_dtype, values_dtype, ret_type, cast = m
        stored = dtype_of(cast) if cast is not None else values_dtype  # the only use of the values casts them
        bb = self.builder_
        x = self.visit_expr(logits)
        lead = list(x.ty.shape.values)[:-1]
        rows = 1
        for d in lead:
            rows = rows * d
        rows = Analyzer().simplify(rows) if not isinstance(rows, int) else rows
        flat = bb.emit(relax.op.reshape(x, [rows, n])) if len(lead) != 1 else x
        out = bb.emit(relax.call_tir(self.kernel((n, k, str(x.ty.dtype), index_dtype, stored)), [flat],
                                     [relax.TensorType([rows, k], index_dtype), relax.TensorType([rows, k], stored)]))
        idx, val = bb.emit(relax.TupleGetItem(out, 0)), bb.emit(relax.TupleGetItem(out, 1))
        if len(lead) != 1:
            idx, val = bb.emit(relax.op.reshape(idx, lead + [k])), bb.emit(relax.op.reshape(val, lead + [k]))
        if cast is not None:  # the cast reads the kernel's values (the topk's values, now of its dtype, go dead)
            self.cast[cast] = val
        result = {"both": lambda: bb.emit(relax.Tuple([val, idx])), "values": lambda: val, "indices": lambda: idx}[ret_type]()
        self.set_var_remap(binding.var, result)


@tvm.transform.module_pass(opt_level=0, name="FuseSoftmaxTopK")
class FuseSoftmaxTopK:
    """Each ``topk(softmax(x), k)`` over the last axis (a router choosing its experts; ``x`` maybe upcast to
    float32 first) becomes one ``topk_softmax`` kernel reading ``x``: the row's softmax statistics and the top-k
    in one pass (a warp per row on CUDA), instead of a cast, a softmax and the top-k kernel.

    Expects entry functions (attribute ``num_input``), after the passes that recognise routers by their
    ``topk`` (cascade gating, norm + router fusion, grouped experts). Guarantees after: each match's ``topk``
    binding is replaced by the kernel's (values, indices), reshaped to the ``topk``'s; values are the softmax's,
    computed in float32 from ``x`` as stored (the cast was exact) and equal up to float rounding (written in the
    dtype of a cast that is their only use, which then reads them); indices are the same, ties to the lower index. A softmax with other users, another axis, ``largest=False`` or a row too long
    for the warp form stays (the plain ``topk`` legalization then takes it)."""

    def __init__(self, target: tvm.target.Target, source: str = "model") -> None:
        self.target, self.source = target, source
        self.fused: dict[str, int] = {}
        self.kernels: dict = {}

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        from ..compiler.graph import DataflowGraph, KernelCache, dtype_of, num_input_entries, shape_of

        gpu = self.target.kind.name != "llvm"
        kernels = KernelCache(lambda key: topk_select_func(key[0], key[1], key[2], key[3], True, gpu, values_dtype=key[4],
                                                           softmax=True), lambda key: "topk_softmax", self.kernels)
        out = mod
        for gv, func in num_input_entries(mod, "FuseSoftmaxTopK", self.source):
            func = relax.analysis.remove_all_unused(func)
            g = DataflowGraph(func, int(func.attrs["num_input"]))
            matches = {}
            for tk in g.calls_of("relax.topk"):
                call = g.call(tk)
                s = g.alias(call.args[0])
                shape = shape_of(s)
                if g.op(s) != "relax.nn.softmax" or not shape or len(g.users.get(s, [])) != 1 or not bool(call.attrs.largest):
                    continue
                rank = len(shape)
                if int(call.attrs.axis) % rank != rank - 1 or int(g.call(s).attrs.axis) % rank != rank - 1:
                    continue
                x = g.alias(g.call(s).args[0])
                if g.op(x) == "relax.astype" and dtype_of(x) == "float32" and len(g.users.get(x, [])) == 1:
                    x = g.alias(g.call(x).args[0])  # the upcast: the kernel computes in float32
                n = shape[-1]
                if not isinstance(n, int) or (gpu and n > 992) or dtype_of(x) not in ("float32", "float16", "bfloat16") \
                        or dtype_of(s) not in ("float32", "float16", "bfloat16"):
                    continue
                ret = str(call.attrs.ret_type)
                # the values' only use a cast (to the model's dtype, before the experts): written in that dtype
                cast = None
                got = [u for u in g.users.get(tk, []) if isinstance(g.value.get(u), relax.TupleGetItem)]
                vals = [u for u in got if g.value[u].index == 0]
                if ret == "both" and len(vals) == 1 and len(g.users.get(vals[0], [])) == 1:
                    u = g.users[vals[0]][0]
                    if g.op(u) == "relax.astype" and dtype_of(u) in ("float32", "float16", "bfloat16"):
                        cast = u
                matches[tk] = (x, n, int(call.attrs.k), str(call.attrs.dtype), dtype_of(s), ret, cast)
            self.fused[gv.name_hint] = len(matches)
            if not matches:
                continue
            rewriter = _SoftmaxTopKRewriter(out, matches, None)
            rewriter.kernel = lambda key, b=rewriter.builder_: kernels.get(b, key)
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
            out = rewriter.builder_.get()
        return out
