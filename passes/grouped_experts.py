"""InsertGroupedExperts: the routed experts of each MoE layer become grouped expert GEMMs.

Expects entry functions (attribute ``num_input``: leading non-weight parameters, then the weights),
as ``InsertPagedKVAttention`` / ``InsertTieredKVAttention`` build them, after ``FuseRouterIntoNorm``
if it runs. In each entry it matches, by structure only (legend: T tokens, K active experts,
S = T * K slots, E experts, D hidden, I expert width), the gathered-weights form that exports of
stacked experts produce (the reference model's ``Experts.forward``; HF transformers' ``batched_mm``
experts, torch.export and ONNX)::

    idx  = reshape(ids)                    # S        ids [T, K] integer, downstream of a top-k
           (ONNX: where(idx < 0, idx + E, idx) as [S, 1] for gather_nd)
    xs   = reshape(broadcast_to(expand_dims(x, 1), [T, K, D]), [S, D(, 1)])   # x [T, D]
    gu   = squeeze(matmul(take(W1, idx) | gather_nd(W1, idx), xs[.., None]))  # S, 2I   W1 [E, 2I, D] weight
    g, u = split(gu, 2, -1)                # silu on one half: a * sigmoid(a) or nn.silu(a)
    h    = silu(g) * u                     # S, I
    y    = squeeze(matmul(take(W2, idx), expand_dims(h, -1)))                # S, D    W2 [E, D, I] weight
    out  = sum(reshape(y * reshape(rw, [S, 1]), [T, K, D]), axis=1)         # T, D    rw [T, K]

with float casts (``astype``) allowed between these steps, as reduced-precision exports write them. The
torch.export of HF OLMoE in bfloat16 (TVM's importer gives every matmul a float32 result) reads::

    gu  = squeeze(matmul(take(W1, idx), xs[.., None], out_dtype=float32))     # float32, not rounded
    g, u = split(gu)                                                          # float32
    a   = astype(g, float32);  act = astype(astype(a * sigmoid(a), bfloat16), float32)   # silu(g) rounded
    h   = act * u                                                             # float32
    y   = squeeze(matmul(astype(take(W2, idx), float32), expand_dims(h, -1))) # float32
    out = sum(reshape(y * astype(reshape(astype(rw, bfloat16), [S, 1]), float32), [T, K, D]), axis=1)

A cast that widens (bfloat16/float16 -> float32, or to its own dtype) is exact; one that narrows rounds.
How the kernels treat each rounding of the graph:

  * gathered weights: only widening casts (the kernels read the weights in their dtype, as float32);
  * routing weights: the kernels read the tensor after the last narrowing cast (rw above: bfloat16), so
    its rounding is kept exactly;
  * h: stored in ``h_dtype``, the one narrow dtype h is held in between the product and the down
    projection (float32 if none; two different narrow dtypes on the way are not matched), so a rounding of
    h is kept exactly;
  * anywhere else (gu or its halves, silu(g) or its input, y, the weighted slots) the graph rounds and the
    kernels do not: they compute gate/up, silu(g) * u, the down projection, the routing weight product and
    the sum over slots in float32. ``rounding`` (and the manifest) lists each such narrowing cast per entry;
    it does not list ops that the graph computes in a narrow dtype (a bfloat16 matmul result, as other
    exports write it), which the kernels compute in float32 as well.

In the bfloat16 OLMoE form above the one such rounding is silu(g): the graph rounds it to bfloat16 (a
relative error of at most 2^-8 per element) before the product, the kernels keep it in float32. The
compiled unfused graph keeps that round trip on CUDA (its fused SwiGLU kernel casts to ``nv_bfloat16`` and
back) but not on llvm (there TVM's BF16ComputeLegalize keeps a kernel's bfloat16 intermediates in
float32), so builds with and without this pass agree to float32 rounding on llvm and differ by that
rounding on CUDA.

On CUDA, with 16-bit weights and activations of their dtype, the kernels add one rounding where the
graph keeps float32 h (as this form does): h is stored in the weights' dtype, the operand type of the
tensor-core down projection (``schedules.kernels.grouped_experts.mma_eligible``), a relative error of at
most 2^-8 per element, the rounding the model's own bfloat16 forward makes (its SwiGLU output is a bfloat16
tensor). ``rounding`` lists it too.

FP8 expert weights (``expert_weights="fp8"``) of a bfloat16 model on CUDA with ``fp8_compute="float16"``: the
tensor cores multiply in float16 instead, where an e4m3 pair becomes two float16 values in one conversion
instruction (bfloat16 takes three integer operations a pair, ``_fp8_widen_pair``). The layer's input x is cast
to float16 before gate_up (one elementwise kernel: values past +-65504 saturated, below 2^-14 float16
subnormals, both exact in between, as bfloat16 has fewer mantissa bits) and h is held in float16 (saturated
likewise) instead of bfloat16; ``rounding`` lists both.

Guarantees after: each match is four ``call_tir`` of ``schedules.kernels.grouped_experts`` (llvm or
CUDA form by target): ``route_prep(ids) -> (offsets, order)``, ``gate_up(x, W1, offsets, order) -> h``,
``down(h, W2, offsets, order, rw) -> y`` (per slot, float32) and ``combine(y, ids) -> out``; every user
of ``out`` reads the last. The gathered bindings are left dead for the dead-code elimination after
phase 1. Each active expert's weights are read once for all of its tokens instead of once per
(token, slot). Results equal the unfused graph's up to float rounding (float32 accumulation, and the
roundings of the graph the kernels do not make, listed above). An MoE layer whose experts take another
form stays unchanged, and ``skipped`` says why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import tvm
from tvm import relax
from tvm.ir.prim.expr import IntImm
from tvm.sym.analyzer import Analyzer

from ..compiler.errors import MoecError
from ..runtime.expert_cache import RESIDENCY_FUNC  # (ids [T, K], x [T, D], layer) -> slot of each expert [E] int32
from ..compiler.graph import DataflowGraph, KernelCache, const_scalar, dtype_of, is_static, num_input_entries, shape_of
from ..schedules.kernels.grouped_experts import (_BYTES, F16_MAX, KERNELS, GroupedExpertsSpec, check_supported, mma_eligible,
                                                 prefill_spec, tile_fp8)

# CUDA, FP8 expert weights of a bfloat16 model: the tensor cores' operand type (``InsertGroupedExperts(fp8_compute=)``)
FP8_COMPUTE = "bfloat16"
# CUDA, FP8 expert weights: stored tile-major (``schedules.kernels.grouped_experts.tile_fp8``, the kernels' ``w_tiles``):
# faster at every measured point on an H100 (bench/results/grouped_experts_fp8_forms_h100_f62db23.json, cold: OLMoE at
# 128 tokens 168.1 against 170.8 us, Mixtral 534.2 against 549.0) and the same end to end (e2e_cuda_fp8tiles_h100_10172e6)
FP8_W_TILES = True

# ops that keep the row-major order of ids / routing weights (slot s = t * K + k); a permute would not
_ORDER_KEEPING = frozenset({"relax.reshape", "relax.expand_dims", "relax.squeeze"})
_FLOATS = frozenset({"float32", "float16", "bfloat16"})


def _exact_in(dtype: str) -> set:
    """The float dtypes that hold every value of ``dtype`` exactly."""
    return {dtype, "float32"}


def _roundings(chain: list[str]) -> tuple[list[str], set]:
    """The narrowing casts along a chain of float dtypes (the first the source's): the dtypes the value is
    rounded to, in order, and the dtypes that hold the result exactly."""
    exact, rounded = _exact_in(chain[0]), []
    for dt in chain[1:]:
        if dt not in exact:
            rounded.append(dt)
            exact = _exact_in(dt)
    return rounded, exact


def _int_value(expr) -> int | None:
    """An integer scalar argument (an IntImm, a PrimValue holding one, or a one-element constant), else None."""
    if not isinstance(expr, IntImm) and isinstance(getattr(expr, "value", None), IntImm):
        expr = expr.value
    if isinstance(expr, IntImm):
        return int(expr.value)
    v = const_scalar(expr)
    return int(v) if v is not None and float(v).is_integer() else None


@dataclass
class _Match:
    out: relax.Var  # the [T, D] sum over the K slots
    x: relax.Expr  # [T, D]
    ids: relax.Expr  # [T, K] integer
    rw: relax.Expr  # [T, K] routing weights
    w1: relax.Var  # [E, 2I, D]
    w2: relax.Var  # [E, D, I]
    spec: GroupedExpertsSpec
    where: str
    down: relax.Var  # the down projection's matmul
    rounding: list[str]  # roundings of the graph that the kernels do not make (they keep float32)


class _Skip(Exception):
    pass


def _eq(a, b) -> bool:
    if is_static(a) and is_static(b):
        return int(a) == int(b)
    return bool(Analyzer().can_prove_equal(a if not is_static(a) else tvm.tirx.IntImm("int64", int(a)),
                                           b if not is_static(b) else tvm.tirx.IntImm("int64", int(b))))


class _Matcher:
    def __init__(self, func: relax.Function, num_inputs: int, form: str) -> None:
        self.g = DataflowGraph(func, num_inputs)
        self.alias = self.g.alias
        self.form = form
        self.skipped: list[str] = []

    # ------------------------------------------------------------ helpers
    def users(self, var):
        out = []
        for u in self.g.users.get(var, []):
            if isinstance(self.g.value.get(u), relax.Var):  # alias binding: its users
                out += self.users(u)
            else:
                out.append(u)
        return out

    def only_user(self, var, op: str | None, what: str):
        us = self.users(var)
        if len(us) != 1 or (op is not None and self.g.op(us[0]) != op):
            raise _Skip(f"{what}: expected one {op or 'user'}, found {[self.g.op(u) or type(self.g.value[u]).__name__ for u in us]}")
        return us[0]

    def float_cast(self, v):
        """The source of ``v`` if it is a float-to-float astype, else None."""
        g = self.g
        if g.op(v) != "relax.astype":
            return None
        src = self.alias(g.call(v).args[0])
        if dtype_of(src) in _FLOATS and dtype_of(v) in _FLOATS:
            return src
        return None

    def uncast(self, v):
        """``(source, dtypes)``: ``v`` followed back through float casts; dtypes from the source's to ``v``'s."""
        v = self.alias(v)
        chain = [dtype_of(v)]
        while (src := self.float_cast(v)) is not None:
            v = src
            chain.append(dtype_of(v))
        return v, chain[::-1]

    def casts_down(self, var):
        """``(last, dtypes)``: ``var`` followed forward through its only users while they are float casts."""
        chain = [dtype_of(var)]
        while True:
            us = self.users(var)
            if len(us) != 1 or self.float_cast(us[0]) is None:
                return var, chain
            var = us[0]
            chain.append(dtype_of(var))

    def note(self, rounding: list, chain: list[str], what: str) -> None:
        """Record where the graph rounds (a narrowing cast along ``chain``) and the kernels do not."""
        for dt in _roundings(chain)[0]:
            rounding.append(f"{what} rounded to {dt}")

    def weight(self, expr):
        expr = self.alias(expr)
        return expr if expr in self.g.weight_set else None

    def gathered(self, expr):
        """``(W, idx)`` if ``expr`` is take(W, idx, axis=0) or gather_nd(W, idx [S, 1]) of a rank-3 weight,
        possibly cast to a dtype that holds W's values exactly (bf16 -> float32)."""
        g = self.g
        v, chain = self.uncast(expr)
        if _roundings(chain)[0]:
            return None
        op, call = g.op(v), g.call(v)
        if op == "relax.take" and int(call.attrs.axis) == 0:
            w = self.weight(call.args[0])
            if w is not None and len(shape_of(w) or ()) == 3:
                return w, call.args[1]
        if op == "relax.gather_nd" and int(call.attrs.batch_dims) == 0:
            w = self.weight(call.args[0])
            idx = call.args[1]
            if w is not None and len(shape_of(w) or ()) == 3 and (shape_of(idx) or (0, 0))[-1] == 1:
                return w, idx
        return None

    def ids_of(self, idx, num_experts: int):
        """The [T, K] integer ids behind a gather index: through layout ops, ONNX's wrap of negatives and a
        clamp to the expert range (``clip(i, 0, E - 1)``, which transformers adds; top-k ids are in range). The torch
        importer gives an integer clamp as ``maximum(i, 0)`` then ``minimum(i, E - 1)``; each is looked through where
        its bound cannot change an id."""
        g = self.g
        e = self.alias(idx)
        for _ in range(8):
            e = self.alias(g.strip(e, _ORDER_KEEPING))
            if g.op(e) == "relax.clip":
                lo, hi = (_int_value(a) for a in g.call(e).args[1:3])
                if lo is not None and hi is not None and lo <= 0 and hi >= num_experts - 1:
                    e = g.call(e).args[0]
                    continue
            if g.op(e) in ("relax.maximum", "relax.minimum"):
                a, b = g.call(e).args
                bound = const_scalar(b)
                if bound is not None and (bound <= 0 if g.op(e) == "relax.maximum" else bound >= num_experts - 1):
                    e = a
                    continue
            if g.op(e) == "relax.where":  # where(less(i, 0), add(i, E), i)
                c, a, b = g.call(e).args
                if (g.op(c) == "relax.less" and const_scalar(g.call(c).args[1]) == 0 and g.op(a) == "relax.add"
                        and self.alias(g.call(a).args[0]).same_as(self.alias(b))):
                    e = b
                    continue
            break
        shp = shape_of(e)
        if shp is None or len(shp) != 2 or not (dtype_of(e) or "").startswith("int"):
            return None
        anc = g.ancestors(e)
        if not any(g.op(v) == "relax.topk" for v in anc):
            return None
        return e

    def hidden_of(self, xs, t, k, d):
        """x [T, D] if ``xs`` is x broadcast over the K slots ([S, D] or [S, D, 1])."""
        g = self.g
        e = self.alias(xs)
        for _ in range(4):
            if g.op(e) not in ("relax.reshape", "relax.expand_dims"):
                break
            e = self.alias(g.call(e).args[0])
        if g.op(e) != "relax.broadcast_to":
            return None
        bshape = shape_of(e)
        if len(bshape) != 3 or not (_eq(bshape[0], t) and _eq(bshape[1], k) and _eq(bshape[2], d)):
            return None
        src = self.alias(g.call(e).args[0])
        sshape = shape_of(src)
        if len(sshape) != 3 or sshape[1] != 1 or g.op(src) not in ("relax.expand_dims", "relax.reshape"):
            return None
        x = self.alias(g.call(src).args[0])
        xshape = shape_of(x)
        if xshape is None or len(xshape) != 2 or not (_eq(xshape[0], t) and _eq(xshape[1], d)):
            return None
        return x

    def silu_of(self, v):
        """``a`` if ``v`` is silu(a): nn.silu(a) or a * sigmoid(a)."""
        g = self.g
        v = self.alias(v)
        if g.op(v) == "relax.nn.silu":
            return self.alias(g.call(v).args[0])
        if g.op(v) == "relax.multiply":
            a, b = (self.alias(x) for x in g.call(v).args)
            if g.op(b) == "relax.sigmoid" and self.alias(g.call(b).args[0]).same_as(a):
                return a
            if g.op(a) == "relax.sigmoid" and self.alias(g.call(a).args[0]).same_as(b):
                return b
        return None

    def downstream(self, var, depth: int) -> list:
        """The bindings that read ``var`` within ``depth`` steps (breadth first, each once)."""
        seen, frontier, out = {var}, [var], []
        for _ in range(depth):
            nxt = []
            for v in frontier:
                for u in self.users(v):
                    if u not in seen:
                        seen.add(u)
                        nxt.append(u)
                        out.append(u)
            frontier = nxt
        return out

    def routing_weights(self, col):
        """The tensor behind the [S, 1] routing weight column: through order-keeping layout ops and
        widening casts, up to the last narrowing cast (the kernels read its result, so its rounding stays)."""
        g, e = self.g, self.alias(col)
        while True:
            e = self.alias(g.strip(e, _ORDER_KEEPING))
            src = self.float_cast(e)
            if src is None or _roundings([dtype_of(src), dtype_of(e)])[0]:
                return e
            e = src

    # ------------------------------------------------------------ one candidate
    def match(self, m1) -> _Match:
        g = self.g
        where = f"expert matmul {m1.name}"
        w1, idx1 = self.gathered(g.call(m1).args[0])
        e, two_i, d = shape_of(w1)
        if two_i % 2:
            raise _Skip(f"{where}: gate/up weight {w1.name} has an odd number of rows {two_i}")
        i = two_i // 2
        ids = self.ids_of(idx1, e)
        if ids is None:
            raise _Skip(f"{where}: the gather index does not come from [T, K] top-k expert ids")
        t, k = shape_of(ids)
        if not is_static(k):
            raise _Skip(f"{where}: dynamic top-k")
        xcol = g.call(m1).args[1]
        if not (_eq(shape_of(m1)[0], t * k) and shape_of(m1)[1:] == (two_i, 1)):
            raise _Skip(f"{where}: not [S, 2I, 1] = [T*K, {two_i}, 1] (shape {shape_of(m1)})")
        x = self.hidden_of(xcol, t, k, d)
        if x is None:
            raise _Skip(f"{where}: its input is not the hidden state [T, D] broadcast over the K slots")
        rounding: list[str] = []
        sq = self.only_user(m1, "relax.squeeze", where)
        sqc, chain = self.casts_down(sq)
        self.note(rounding, chain, "gate/up output")
        sp = self.only_user(sqc, "relax.split", where)
        halves = {}
        for u in self.users(sp):
            item = g.value[u]
            if not isinstance(item, relax.TupleGetItem):
                raise _Skip(f"{where}: the split output is used whole")
            halves[item.index] = u
        if set(halves) != {0, 1} or len(sp.ty.fields) != 2 or any(shape_of(v)[-1] != i for v in halves.values()):
            raise _Skip(f"{where}: the gate/up output is not split into two halves of {i}")
        # h = silu(gate) * up, with float casts anywhere on the way
        prod = None
        for gate_idx in (0, 1):
            for u2 in self.downstream(halves[gate_idx], 6):
                if g.op(u2) != "relax.multiply" or self.silu_of(u2) is not None:
                    continue
                a, b = g.call(u2).args
                for s_, o_ in ((a, b), (b, a)):
                    up, up_chain = self.uncast(o_)
                    act, act_chain = self.uncast(s_)
                    if not up.same_as(halves[1 - gate_idx]) or self.silu_of(act) is None:
                        continue
                    gate, gate_chain = self.uncast(self.silu_of(act))
                    if gate.same_as(halves[gate_idx]):
                        prod, gate_first = u2, gate_idx == 0
                        chains = (("gate half", gate_chain), ("silu(gate)", act_chain), ("up half", up_chain))
        if prod is None:
            raise _Skip(f"{where}: no silu(gate) * up over the two halves")
        for what, chain in chains:
            self.note(rounding, chain, what)
        # h: float casts and one expand_dims(-1) on the way to the down projection's right operand
        hv, h_chain, h3 = prod, ["float32", dtype_of(prod)], None  # the product as if computed in float32
        while True:
            us = self.users(hv)
            nxt = us[0] if len(us) == 1 else None
            if nxt is not None and self.float_cast(nxt) is not None:
                h_chain.append(dtype_of(nxt))
            elif nxt is not None and h3 is None and g.op(nxt) == "relax.expand_dims":
                if [int(a) for a in g.call(nxt).attrs.axis] not in ([-1], [2]):
                    raise _Skip(f"{where}: h is not expanded to a column [S, I, 1]")
                h3 = nxt
            else:
                break
            hv = nxt
        if h3 is None:
            self.only_user(prod, "relax.expand_dims", where)  # raises, naming what reads h instead
            raise _Skip(f"{where}: h does not reach the down projection as a column [S, I, 1]")
        h_round, h_exact = _roundings(h_chain)
        if len(set(h_round)) > 1:
            raise _Skip(f"{where}: h is rounded to {' then '.join(h_round)} on its way to the down projection")
        h_dtype = min(h_exact - {"float32"}, default="float32")
        m2 = self.only_user(hv, "relax.matmul", where)
        if not self.alias(g.call(m2).args[1]).same_as(hv):
            raise _Skip(f"{where}: the down projection does not read h as its right operand")
        gd = self.gathered(g.call(m2).args[0])
        if gd is None:
            raise _Skip(f"{where}: the down projection's weight is not a gathered [E, D, I] weight")
        w2, idx2 = gd
        if shape_of(w2) != (e, d, i):
            raise _Skip(f"{where}: down weight {w2.name} is {shape_of(w2)}, expected {(e, d, i)}")
        ids2 = self.ids_of(idx2, e)
        if ids2 is None or not ids2.same_as(ids):
            raise _Skip(f"{where}: gate/up and down gather by different indices")
        sq2 = self.only_user(m2, "relax.squeeze", where)
        sq2c, chain = self.casts_down(sq2)
        self.note(rounding, chain, "down output")
        mul = self.only_user(sq2c, "relax.multiply", where)
        a, b = (self.alias(v) for v in g.call(mul).args)
        rwc = b if a.same_as(sq2c) else a
        rs = shape_of(rwc)
        if rs is None or len(rs) != 2 or rs[1] != 1:
            raise _Skip(f"{where}: the routing weight is not a [S, 1] column")
        rw = self.routing_weights(rwc)
        if shape_of(rw) is None or len(shape_of(rw)) != 2 or not (_eq(shape_of(rw)[0], t) and shape_of(rw)[1] == k):
            # the weights may be reshaped from [T, K] to [S] and then to [S, 1]: strip gave the [T, K] tensor
            raise _Skip(f"{where}: the routing weights do not come from a [T, K] tensor")
        mulc, chain = self.casts_down(mul)
        self.note(rounding, chain, "weighted slots")
        r3 = self.only_user(mulc, "relax.reshape", where)
        if not (len(shape_of(r3)) == 3 and _eq(shape_of(r3)[0], t) and shape_of(r3)[1:] == (k, d)):
            raise _Skip(f"{where}: the weighted slots are not reshaped to [T, K, D]")
        r3c, chain = self.casts_down(r3)
        self.note(rounding, chain, "weighted slots")
        out = self.only_user(r3c, "relax.sum", where)
        sc = g.call(out)
        if [int(a) for a in sc.attrs.axis] not in ([1], [-2]) or bool(sc.attrs.keepdims):
            raise _Skip(f"{where}: the slots are not summed over axis 1")
        spec = GroupedExpertsSpec(hidden=int(d), inter=int(i), experts=int(e), top_k=int(k), x_dtype=dtype_of(x),
                                  w_dtype=dtype_of(w1), h_dtype=h_dtype, rw_dtype=dtype_of(rw),
                                  out_dtype=dtype_of(out), ids_dtype=dtype_of(ids), gate_first=gate_first)
        if dtype_of(w2) != dtype_of(w1):
            raise _Skip(f"{where}: gate/up ({dtype_of(w1)}) and down ({dtype_of(w2)}) weights differ in dtype")
        try:
            check_supported(spec, self.form)
        except MoecError as exc:
            raise _Skip(f"{where}: {exc}") from None
        notes = [f"{where}: {r} by the graph, kept in float32 by the kernels" for r in rounding]
        narrow = replace(spec, h_dtype=spec.w_dtype)
        if self.form == "cuda" and h_dtype == "float32" and h_dtype != spec.w_dtype and mma_eligible(narrow, "down"):
            # tensor cores take h in the weights' dtype: the one rounding the kernels add (see the docstring)
            spec = narrow
            notes.append(f"{where}: h rounded to {spec.w_dtype} by the kernels for the tensor-core down projection "
                         "(the graph keeps it in float32)")
        return _Match(out=out, x=x, ids=ids, rw=rw, w1=w1, w2=w2, spec=spec, where=where, down=m2, rounding=notes)

    def run(self) -> list[_Match]:
        g = self.g
        found, failed = [], []
        cands = [v for v in g.calls_of("relax.matmul") if self.gathered(g.call(v).args[0]) is not None]
        for m in cands:
            w, _ = self.gathered(g.call(m).args[0])
            shp = shape_of(m)
            if not (shp and len(shp) == 3 and shp[-1] == 1 and shp[1] == shape_of(w)[1] and shape_of(w)[1] % 2 == 0):
                continue
            try:
                found.append(self.match(m))
            except _Skip as exc:
                failed.append((m, str(exc)))
        downs = {mt.down for mt in found}  # a matched layer's down projection is a candidate too
        self.skipped += [msg for m, msg in failed if m not in downs]
        # top-k routers no match consumed: their experts are in a form not recognised here
        matched = set()
        for mt in found:
            matched |= g.ancestors(mt.ids)
        for tk in g.calls_of("relax.topk"):
            if tk in matched or not any(isinstance(g.value[u], relax.TupleGetItem) and g.value[u].index == 1
                                        for u in self.users(tk)):
                continue
            self.skipped.append(f"top-k {tk.name}: no gathered expert matmuls recognised downstream "
                                "(the experts' form is not one InsertGroupedExperts matches)")
        return found


@relax.expr_functor.mutator


class _GroupedExpertsRewriter(relax.PyExprMutator):
    def __init__(self, mod, matches: list[_Match], kernel, converted: dict | None = None, pools=None,
                 layer_of: dict | None = None) -> None:
        super().__init__(mod)
        self.by_out = {m.out: m for m in matches}
        self.kernel = kernel  # (spec, name) -> GlobalVar
        self.converted = converted or {}  # weight name -> (new param, scale param or None)
        # offloaded experts: the pools (W1, W2; FP8: W1 codes, scales, W2 codes, scales), W1 name -> layer
        self.pools, self.layer_of = pools, layer_of or {}

    def _weight(self, w):
        """The weight argument(s) of a kernel: the param itself, or its converted param (and FP8 scales)."""
        if w.name not in self.converted:
            return [self.visit_expr(w)]
        new, scale = self.converted[w.name]
        return [new] + ([scale] if scale is not None else [])

    def visit_var_binding_(self, binding) -> None:
        m = self.by_out.get(binding.var)
        if m is None:
            super().visit_var_binding_(binding)
            return
        # T tokens, K active, S = T*K slots, E experts, D hidden, I expert width
        bb, s = self.builder_, m.spec
        x, ids, rw = self.visit_expr(m.x), self.visit_expr(m.ids), self.visit_expr(m.rw)
        t = shape_of(ids)[0]
        n = Analyzer().simplify(t * s.top_k)
        prep = bb.emit(relax.call_tir(self.kernel(s, "route_prep"), [ids], out_ty=[
            relax.TensorType([s.experts + 1], "int32"), relax.TensorType([n], "int32")]))
        offsets = bb.emit(relax.TupleGetItem(prep, 0))  # E + 1
        order = bb.emit(relax.TupleGetItem(prep, 1))  # S, slots grouped by expert
        w1, w2 = self._weight(m.w1), self._weight(m.w2)
        if self.pools is not None:  # the runtime makes the routed experts resident and says where (E + 1 + E)
            table = bb.emit(relax.call_pure_packed(RESIDENCY_FUNC, ids, x, relax.prim_value(tvm.tirx.IntImm("int64", self.layer_of[m.w1.name])),
                                                   ty_args=relax.TensorType([s.experts], "int32")))
            offsets = bb.emit(relax.op.concat([offsets, table], axis=0))
            w1, w2 = self.pools[:len(w1)], self.pools[len(w1):len(w1) + len(w2)]  # (FP8: codes and scales of each)
        xin = x
        if dtype_of(x) != s.x_dtype:  # (only) FP8 experts multiplied in float16 (fp8_compute): x saturated into its range
            xin = bb.emit(relax.op.astype(relax.op.clip(x, -F16_MAX, F16_MAX), s.x_dtype))
        h = bb.emit(relax.call_tir(self.kernel(s, "gate_up"), [xin, *w1, offsets, order],
                                   out_ty=relax.TensorType([n, s.inter], s.h_dtype)))  # S, I (expert order)
        y = bb.emit(relax.call_tir(self.kernel(s, "down"), [h, *w2, offsets, order, rw],
                                   out_ty=relax.TensorType([n, s.hidden], "float32")))  # S, D (slot order)
        out = bb.emit(relax.call_tir(self.kernel(s, "combine"), [y, ids],
                                     out_ty=relax.TensorType([t, s.hidden], s.out_dtype)))  # T, D
        self.set_var_remap(binding.var, out)


def check_offload_options(expert_slots, memory_budget) -> None:
    """Refuse offloaded-expert options that cannot go together (before any model is read)."""
    if expert_slots is not None and (not isinstance(expert_slots, int) or isinstance(expert_slots, bool) or expert_slots < 1):
        raise MoecError(f"expert slots must be a positive integer, got {expert_slots!r}")
    if memory_budget is not None and expert_slots is not None:
        raise MoecError("give either expert slots or a device memory budget, not both")


def _expert_bytes(spec: GroupedExpertsSpec) -> int:
    """One expert's W1 and W2 bytes (one slot of the offloaded experts' pools): FP8 codes and their float32 scales
    per output channel, or the weights of ``w_dtype``."""
    if spec.w_format == "fp8":
        return 3 * spec.hidden * spec.inter + 4 * (2 * spec.inter + spec.hidden)
    return 3 * spec.hidden * spec.inter * _BYTES[spec.w_dtype]


@tvm.transform.module_pass(opt_level=0, name="InsertGroupedExperts")
class InsertGroupedExperts:
    """Replace each recognised routed-expert computation with grouped expert GEMM kernels.

    Parameters
    ----------
    target : tvm.target.Target
        Picks the kernel form: CUDA for ``cuda`` targets, the serial llvm form otherwise.
    source : str
        Model name for messages.
    expert_weights : {None, "bf16", "fp8"}
        Storage of the matched experts' stacked weights: None keeps the model's; "bf16" casts them to
        bfloat16; "fp8" stores e4m3 bytes with one float32 scale per output channel (half of bf16's bytes).
        Either changes the entries' signatures: each converted weight parameter takes the new storage in
        place, and FP8 scale parameters (``<weight>.fp8_scale``, [E, rows]) follow all weights;
        ``converted_weights`` gives the arrays to store in that order.
    weights : dict[str, numpy.ndarray], optional
        The weight values by parameter name (needed for ``expert_weights``).
    fp8_compute : {None, "bfloat16", "float16"}
        CUDA, FP8 expert weights of a bfloat16 model: the tensor cores' operand type (see the module docstring).
        None: ``FP8_COMPUTE``.
    prefill_tiled : bool
        CUDA: the prefill entry's expert GEMMs in the block-tiled forms (``prefill_spec(..., tiled=True)``: 128 tokens
        x 128 weight rows a block, both operands in shared memory) where they serve, instead of the decode kernels'
        per-warp weight streams with 64-token passes.
    """

    def __init__(self, target: tvm.target.Target, source: str = "model", expert_weights: str | None = None,
                 weights: dict | None = None, expert_slots: int | None = None, memory_budget: tuple[int, int] | None = None,
                 prefill_tiled: bool = False, fp8_compute: str | None = None) -> None:
        if not isinstance(target, tvm.target.Target):
            raise MoecError(f"InsertGroupedExperts needs a tvm.target.Target, got {type(target).__name__}")
        check_offload_options(expert_slots, memory_budget)
        if expert_weights not in (None, "bf16", "fp8"):
            raise MoecError(f"expert weights must be bf16 or fp8 (or None: the model's dtype), got {expert_weights!r}")
        if expert_weights is not None and weights is None:
            raise MoecError("InsertGroupedExperts: converting the expert weights needs their values (weights=)")
        self.target, self.source = target, source
        self.prefill_tiled = bool(prefill_tiled)
        self.expert_weights, self.weights = expert_weights, weights
        self.fp8_compute = FP8_COMPUTE if fp8_compute is None else fp8_compute
        if self.fp8_compute not in ("bfloat16", "float16"):
            raise MoecError(f"FP8 expert compute must be bfloat16 or float16, got {self.fp8_compute!r}")
        self.converted: dict[str, dict] = {}  # weight name -> {"dtype": ..., "scale": name or None}
        self._arrays: dict[str, object] = {}  # converted arrays by (new) weight name
        self.replaced: dict[str, int] = {}
        self.skipped: dict[str, list[str]] = {}
        self.rounding: dict[str, list[str]] = {}  # per entry: roundings of the graph the kernels do not make
        self.kernels: dict[tuple, str] = {}
        self.expert_slots = expert_slots
        # (budget bytes, bytes of all the model's weights): the slots are what the budget leaves after the weights
        # that stay on the device; none when every expert fits
        self.memory_budget = memory_budget
        self.budget_note: str | None = None
        self.offload: dict | None = None  # with expert slots: the pools and each layer's offloaded weights
        self.error: MoecError | None = None  # the refusal of the last run, if any

    def _slots_for_budget(self, found, stored) -> int | None:
        """Expert slots that a device memory budget leaves after every weight that stays on the device (None: the
        experts fit, nothing is offloaded)."""
        budget, total = self.memory_budget  # total: the model's weight bytes as imported
        experts, per_expert, num = {}, None, None
        for (_, _, matches), (_, _, conv) in zip(found, stored):
            for m, c in zip(matches, conv):  # a layer's W1 and W2 hold E experts' bytes (as imported; a slot as stored)
                experts[m.w1.name] = m.spec.experts * _expert_bytes(m.spec)
                per_expert, num = _expert_bytes(c.spec), m.spec.experts
        if not experts:
            raise MoecError(f"{self.source}: a device memory budget offloads experts, and no MoE layer was recognised "
                            "in the grouped form")
        resident = total - sum(experts.values())
        if budget >= total:
            self.budget_note = f"all {total} weight bytes fit the {budget}-byte budget: nothing offloaded"
            return None
        slots = (budget - resident) // per_expert
        if slots < num:
            raise MoecError(f"{self.source}: a device memory budget of {budget} bytes leaves "
                            f"{max(budget - resident, 0)} after the {resident} bytes of weights that stay on the device: "
                            f"{max(slots, 0)} expert slots of {per_expert} bytes, fewer than one layer's {num}; "
                            f"give at least {resident + num * per_expert} bytes")
        self.budget_note = (f"{budget}-byte budget: {resident} bytes of resident weights, {slots} expert slots of "
                            f"{per_expert} bytes ({sum(experts.values())} bytes of experts offloaded)")
        return int(slots)

    def _plan_offload(self, found) -> tuple[dict, GroupedExpertsSpec]:
        """Offloaded experts: one slot pool for every layer (the same expert shapes everywhere), layers numbered
        by their W1 parameter's place."""
        specs = {m.spec for _, _, matches in found for m in matches}
        if not specs:
            raise MoecError(f"{self.source}: offloaded experts (expert slots) need grouped experts, and no MoE layer "
                            "was recognised in the grouped form")
        if len(specs) > 1:
            raise MoecError(f"{self.source}: offloaded experts need every MoE layer's experts to have one shape and "
                            f"dtype; found {len(specs)} kinds")
        spec = replace(next(iter(specs)), slots=self.expert_slots)
        if self.expert_slots < spec.experts:
            raise MoecError(f"{self.source}: {self.expert_slots} expert slots cannot hold one layer's {spec.experts} "
                            "experts, which one prefill chunk may route to; give at least that many")
        order, w2_of = [], {}
        for gv, func, matches in found:
            pos = {p.name: i for i, p in enumerate(func.params)}
            for m in sorted(matches, key=lambda m: pos[m.w1.name]):
                if m.w1.name not in w2_of:
                    order.append(m.w1.name)
                    w2_of[m.w1.name] = m.w2.name
                elif w2_of[m.w1.name] != m.w2.name:
                    raise MoecError(f"{self.source}: expert weight {m.w1.name} pairs with {w2_of[m.w1.name]} and {m.w2.name}")
        if len(set(w2_of.values())) != len(w2_of):
            raise MoecError(f"{self.source}: offloaded experts need each layer's own expert weights (layers share them)")
        D, I, E, S = spec.hidden, spec.inter, spec.experts, self.expert_slots
        if spec.w_format == "fp8":  # codes and their scales per output channel, each weight's pair
            pools = [{"name": "experts.pool.w1", "shape": [S, 2 * I, D], "dtype": "uint8"},
                     {"name": "experts.pool.w1.fp8_scale", "shape": [S, 2 * I], "dtype": "float32"},
                     {"name": "experts.pool.w2", "shape": [S, D, I], "dtype": "uint8"},
                     {"name": "experts.pool.w2.fp8_scale", "shape": [S, D], "dtype": "float32"}]
            layers = [[n, self.converted[n]["scale"], w2_of[n], self.converted[w2_of[n]]["scale"]] for n in order]
        else:
            pools = [{"name": "experts.pool.w1", "shape": [S, 2 * I, D], "dtype": spec.w_dtype},
                     {"name": "experts.pool.w2", "shape": [S, D, I], "dtype": spec.w_dtype}]
            layers = [[n, w2_of[n]] for n in order]
        # layers: per offloaded layer the stored arrays of its experts, in the order of the pools they are copied into
        self.offload = {"slots": S, "experts": E, "pools": pools, "layers": layers, "slot_bytes": _expert_bytes(spec),
                        "weights": spec.w_format if spec.w_format == "fp8" else spec.w_dtype}
        return {n: i for i, n in enumerate(order)}, spec

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        try:
            return self._transform(mod)
        except MoecError as exc:  # kept: TVM's pass machinery hands it on as a RuntimeError
            self.error = exc
            raise

    def _transform(self, mod: tvm.IRModule) -> tvm.IRModule:
        entries = num_input_entries(mod, "InsertGroupedExperts", self.source)
        form = "cuda" if self.target.kind.name == "cuda" else "llvm"
        # (names distinct per token tiling: the prefill entry's GEMMs are added by another builder than decode's, which
        # would not rename a clash)
        kernels = KernelCache(lambda key: KERNELS[key[1]](key[0], form),
                              lambda key: f"moe_{key[1]}" + (f"_nt{key[0].n_tiles}" if key[0].n_tiles else "")
                              + ("_pb" if key[0].pass_blocks else "") + ("_tiled" if key[0].tiled else ""), self.kernels)
        found = []
        for gv, func in entries:
            func = relax.analysis.remove_all_unused(func)
            matcher = _Matcher(func, int(func.attrs["num_input"]), form)
            matches = matcher.run()
            self.replaced[gv.name_hint] = len(matches)
            self.skipped[gv.name_hint] = matcher.skipped
            self.rounding[gv.name_hint] = [r for m in matches for r in m.rounding]
            found.append((gv, func, matches))
        convert = self._plan_conversion(found) if self.expert_weights is not None else []
        # the experts as they will be stored (converted to bf16 / FP8): what the slots hold
        stored = [(gv, func, [self._converted_match(m) for m in matches]) for gv, func, matches in found] if convert else found
        if self.memory_budget is not None:
            self.expert_slots = self._slots_for_budget(found, stored)
        layer_of = None
        if self.expert_slots is not None:
            layer_of, slot_spec = self._plan_offload(stored)
            self.offload["budget"] = self.budget_note
            found = [(gv, func, [replace(m, spec=slot_spec) for m in matches]) for gv, func, matches in found]
        if form == "cuda":  # the prefill entry's own token tiles (prefill_spec)
            found = [(gv, func, [replace(m, spec=prefill_spec(m.spec, self.prefill_tiled)) for m in matches]
                      if gv.name_hint == "prefill" else matches)
                     for gv, func, matches in found]
        out = mod
        for gv, func, matches in found:
            if not matches:
                continue
            num_input = int(func.attrs["num_input"])
            if convert:
                names = [p.name for p in list(func.params)[num_input:]]
                if names != list(self.weights):
                    raise MoecError(f"{self.source}: entry {gv.name_hint}'s weight parameters are not the model's weights "
                                    "in order; cannot convert the expert weights")
                matches = [self._converted_match(m) for m in matches]
                self.rounding[gv.name_hint] = [r for m in matches for r in m.rounding]
            params = {p.name: p for p in func.params}
            conv = {n: (relax.Var(n, relax.TensorType(params[n].ty.shape, self.converted[n]["dtype"])),
                        relax.Var(self.converted[n]["scale"], relax.TensorType(params[n].ty.shape.values[:2], "float32"))
                        if self.converted[n]["scale"] else None) for n in convert}
            pools = None
            if layer_of is not None:
                pools = [relax.Var(p["name"], relax.TensorType(p["shape"], p["dtype"])) for p in self.offload["pools"]]
            rewriter = _GroupedExpertsRewriter(out, matches, None, conv, pools, layer_of)

            # (route_prep and combine do not depend on the token tiles: one of each serves both entries' specs)
            rewriter.kernel = lambda spec, name, b=rewriter.builder_: kernels.get(
                b, (spec if name in ("gate_up", "down") else replace(spec, n_tiles=0, pass_blocks=False, tiled=False), name))
            new_func = rewriter.visit_expr(func)
            if conv:
                new_func = relax.analysis.remove_all_unused(new_func)
                free = relax.analysis.free_vars(new_func.body)
                left = [n for n in conv if any(params[n].same_as(v) for v in free)]
                if left:
                    raise MoecError(f"{self.source}: entry {gv.name_hint} still reads {left} outside the grouped experts; "
                                    "cannot convert them")
                new_params = [conv[p.name][0] if p.name in conv else p for p in new_func.params]
                new_params += [conv[n][1] for n in convert if conv[n][1] is not None]
                new_func = relax.Function(new_params, new_func.body, new_func.ret_ty, new_func.is_pure, new_func.attrs)
            if pools is not None:  # the layers' expert weights leave the signature, the pools join at its end
                new_func = relax.analysis.remove_all_unused(new_func)
                free = relax.analysis.free_vars(new_func.body)
                gone = {n for pair in self.offload["layers"] for n in pair}
                left = [p.name for p in new_func.params if p.name in gone and any(p.same_as(v) for v in free)]
                if left:
                    raise MoecError(f"{self.source}: entry {gv.name_hint} still reads {left} outside the grouped experts; "
                                    "cannot offload them")
                new_params = [p for p in new_func.params if p.name not in gone] + pools
                new_func = relax.Function(new_params, new_func.body, new_func.ret_ty, new_func.is_pure, new_func.attrs)
            rewriter.builder_.update_func(gv, new_func)
            out = rewriter.builder_.get()
        return out

    def offloaded_weights(self, names: list[str], arrays: list) -> tuple[list[str], list, dict]:
        """With expert slots: the entries' weights (the offloaded ones left out, the pools last, as None: the runtime
        allocates them) and the offloaded arrays by name."""
        if self.offload is None:
            return list(names), list(arrays), {}
        gone = {n for pair in self.offload["layers"] for n in pair}
        keep = [(n, a) for n, a in zip(names, arrays) if n not in gone]
        return ([n for n, _ in keep] + [p["name"] for p in self.offload["pools"]], [a for _, a in keep] + [None] * len(self.offload["pools"]),
                {n: a for n, a in zip(names, arrays) if n in gone})

    def _plan_conversion(self, found) -> list[str]:
        """Weight names to convert: the experts' weights matched in every entry that has any match."""
        import numpy as np

        with_matches = [matches for _, _, matches in found if matches]
        if not with_matches:
            return []
        per_entry = [{w.name for m in matches for w in (m.w1, m.w2)} for matches in with_matches]
        common = set.intersection(*per_entry)
        for names in per_entry:
            for n in sorted(names - common):
                self.skipped.setdefault("conversion", []).append(f"{n}: not matched in every entry, kept as {self.weights[n].dtype}")
        order = [n for n in self.weights if n in common]
        tiles = self._tileable(with_matches) if self.expert_weights == "fp8" else set()
        for n in order:
            w = np.asarray(self.weights[n])
            if self.expert_weights == "bf16":
                import ml_dtypes

                self._arrays[n] = w.astype(ml_dtypes.bfloat16)
                self.converted[n] = {"dtype": "bfloat16", "scale": None, "from": str(w.dtype)}
            else:
                from ..schedules.kernels.grouped_experts import quantize_fp8

                codes, scale = quantize_fp8(w)
                if n in tiles:  # the CUDA cp.async forms read each 16-row tile's k-steps as contiguous KB
                    codes = tile_fp8(codes)
                self._arrays[n], self._arrays[f"{n}.fp8_scale"] = codes, scale
                self.converted[n] = {"dtype": "uint8", "scale": f"{n}.fp8_scale", "from": str(w.dtype),
                                     "layout": "tiles" if n in tiles else "rows"}
        return order

    def _tileable(self, with_matches) -> set[str]:
        """FP8 weights to store tile-major (``tile_fp8``): on CUDA with ``FP8_W_TILES``, those whose every match's
        kernels take the tile-major cp.async forms (a weight and its layer's other weight alike)."""
        if not FP8_W_TILES or self.target.kind.name != "cuda":
            return set()
        ok, bad = set(), set()
        for matches in with_matches:
            for m in matches:
                try:
                    check_supported(replace(m.spec, w_format="fp8", w_tiles=True), "cuda")
                    ok |= {m.w1.name, m.w2.name}
                except MoecError:
                    bad |= {m.w1.name, m.w2.name}
        return ok - bad

    def _converted_match(self, m: _Match) -> _Match:
        if m.w1.name not in self.converted or m.w2.name not in self.converted:
            return m
        if self.expert_weights == "bf16":
            return replace(m, spec=replace(m.spec, w_dtype="bfloat16"))
        # FP8 weights take the tensor-core forms (bytes staged by cp.async, widened in registers; the register-load
        # form matched NumPy on the H200: tests/schedules/test_grouped_experts.py::test_cuda_fp8_matches_numpy_on_gpu,
        # bench/results/gpu_tests_h200_33b9d7f.json)
        layouts = {self.converted[w.name].get("layout") for w in (m.w1, m.w2)}
        if len(layouts) > 1:
            raise MoecError(f"{self.source}: {m.where}: gate/up and down FP8 weights stored in different layouts {sorted(layouts)}")
        spec = replace(m.spec, w_format="fp8", w_tiles=layouts == {"tiles"})
        if self.fp8_compute == "float16" and self.target.kind.name == "cuda" and spec.x_dtype == "bfloat16":
            f16 = replace(spec, x_dtype="float16", h_dtype="float16")
            if mma_eligible(f16, "gate_up") and mma_eligible(f16, "down"):
                kept = [r for r in m.rounding if not r.startswith(f"{m.where}: h rounded to bfloat16 by the kernels")]
                return replace(m, spec=f16, rounding=kept + [
                    f"{m.where}: x rounded to float16 for the FP8 experts' float16 tensor cores (saturated past +-65504)",
                    f"{m.where}: h held in float16 by the kernels (saturated past +-65504)"])
        return replace(m, spec=spec)

    def converted_weights(self, names: list[str], arrays: list) -> tuple[list[str], list]:
        """The weights to store for the rewritten entries: converted ones in place, then the FP8 scales."""
        if not self.converted:
            return list(names), list(arrays)
        out_names, out = [], []
        for n, a in zip(names, arrays):
            out_names.append(n)
            out.append(self._arrays.get(n, a))
        for n in names:
            scale = self.converted.get(n, {}).get("scale")
            if scale:
                out_names.append(scale)
                out.append(self._arrays[scale])
        return out_names, out

    def manifest(self) -> dict:
        """Expert layers replaced per entry, the kernels (one set per distinct spec), what was skipped, and
        where the graph rounds what the kernels keep in float32."""
        kernels = []
        for spec in dict.fromkeys(s for s, _ in self.kernels):
            kernels.append({"spec": spec.to_dict(), "functions": {n: g for (s, n), g in self.kernels.items() if s == spec}})
        return {"replaced": dict(self.replaced), "kernels": kernels, "offload": self.offload, "memory_budget": self.budget_note, "skipped": {k: v for k, v in self.skipped.items() if v},
                "rounding": {k: v for k, v in self.rounding.items() if v},
                "expert_weights": self.expert_weights, "converted": dict(self.converted),
                "fp8_compute": self.fp8_compute if self.expert_weights == "fp8" else None}


__all__ = ["InsertGroupedExperts"]
