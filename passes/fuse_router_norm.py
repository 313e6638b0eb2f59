"""FuseRouterIntoNorm: the RMSNorm before a router and the router matmul become one kernel.

Expects entry functions (attribute ``num_input``: leading non-weight parameters, then the weights),
as ``InsertPagedKVAttention`` / ``InsertTieredKVAttention`` build them, after ``CascadeGating`` if it
runs and after ``SimplifyPower``. In each entry it matches, by structure only (legend: T tokens, D
hidden, E router outputs):

  * an RMSNorm (those ``compiler.moe_structure`` recognises, and any other router input), checked op by op:
    ``o = w * (x * rsqrt(mean(x*x, -1) + eps))`` (also ``power(x, 2)``, ``1 / sqrt``, ``x / sqrt``, an
    upcast of x to float32 before the square, a cast between ``x * r`` and ``w *``, and
    ``nn.rms_norm``), with ``w`` a 1-D weight [D];
  * a router reading ``o``: ``logits = reshape|astype(o) @ R^T [+ b]`` (R [E, D], or R^T [D, E]; R and b
    weights or constants, through layout ops) whose logits reach a ``topk`` through softmax, sigmoid,
    bias adds and layout ops only: the flat router (R the router weight, [E, D]) and, after cascade
    gating, the coarse group router (R = Cr [G, D], b [G]). The cascade's fine router (a gather of
    router rows) is not a matmul and stays as it is.

Guarantees after: each match is one ``call_tir`` of ``schedules.kernels.norm_router`` (llvm or CUDA
form by target) with two outputs, the normalised hidden state [T, D] (``o``'s dtype) and the logits
[T, E] (the matmul's, or bias add's, dtype); every user of ``o`` reads the first, every user of the
logits the second. The unfused norm and matmul bindings are left dead for the dead-code elimination
after phase 1. Nothing else changes; norms and routers that do not match stay unfused (``skipped``
says why where a norm did reach a router). The kernel computes in float32 and the router reads the
normalised row as stored, so results equal the unfused graph's up to float rounding.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import tvm
from tvm import relax
from tvm.sym.analyzer import Analyzer

from ..compiler.errors import MoecError
from ..compiler.graph import (LAYOUT_OPS, DataflowGraph, KernelCache, const_scalar, dtype_of, is_static, materialize,
                              num_input_entries, prod, same_shape, shape_of)
from ..compiler.moe_structure import _Analyzer
from ..schedules.kernels.norm_router import NormRouterSpec, check_supported, make_norm_router, prefill_spec

_SCORE_OPS = frozenset({"relax.nn.softmax", "relax.sigmoid"})


@dataclass
class _Match:
    norm: relax.Var  # o [.., D], the norm output
    x: relax.Expr  # the norm input [.., D]
    weight: relax.Expr  # w [D]
    logits: relax.Var  # the router logits [.., E] (matmul, or bias add after it)
    matmul: relax.Var
    rows: relax.Expr  # R [E, D] ("ed") or R^T [D, E] ("de")
    bias: relax.Expr | None
    spec: NormRouterSpec
    add: tuple | None = None  # (x, ra, rb) when x = ra + rb (the residual add): computed in the kernel too


class _Matcher:
    """Norm + router matches of one function (``DataflowGraph`` over its ``num_input`` split)."""

    def __init__(self, func: relax.Function, num_inputs: int, source: str, form: str) -> None:
        self.analyzer = _Analyzer(func, num_inputs, source)
        self.form = form  # kernel form: "llvm" | "cuda"
        self.g = self.analyzer.g
        self.skipped: list[str] = []

    def static(self, expr) -> bool:
        """A weight or constant, maybe through layout ops (and so computable anywhere in the function)."""
        g = self.g
        while isinstance(expr, relax.Var) and expr not in g.weight_set:
            value = g.value.get(expr)
            if isinstance(value, relax.Var):  # alias binding
                expr = value
            elif g.op(expr) in LAYOUT_OPS:
                expr = value.args[0]
            else:
                return False
        return isinstance(expr, tvm.ir.GenericConst) or expr in g.weight_set

    # ---------------------------------------------------------------- the norm
    def norm(self, o):
        """``(x, w, eps)`` if ``o`` is exactly ``w * (x * rsqrt(mean(x^2, -1) + eps))`` (or a form above)."""
        g = self.g
        d = (shape_of(o) or (None,))[-1]
        if not is_static(d):
            return None
        if g.op(o) == "relax.nn.rms_norm":
            call = g.call(o)
            axes = [int(a) for a in call.attrs.axes]
            nd = len(shape_of(o))
            if axes not in ([-1], [nd - 1]) or not self.static(call.args[1]) or shape_of(call.args[1]) != (d,):
                return None
            return call.args[0], call.args[1], float(call.attrs.epsilon)
        if g.op(o) != "relax.multiply":
            return None
        a, b = g.call(o).args
        if self.static(a) and shape_of(a) == (d,):
            w, n = a, b
        elif self.static(b) and shape_of(b) == (d,):
            w, n = b, a
        else:
            return None
        n = self._upcast(n, any_dtype=True)  # x * r, maybe cast to the output dtype
        op, call = g.op(n), g.call(n)
        if op == "relax.multiply":
            p, q = call.args
            s = self._recip_sqrt(q)
            xx, s = (p, s) if s is not None else (q, self._recip_sqrt(p))
        elif op == "relax.divide":
            xx, den = call.args
            s = g.call(den).args[0] if g.op(den) == "relax.sqrt" else None
        else:
            return None
        if s is None:
            return None
        eps = 0.0
        if g.op(s) == "relax.add":
            m, c = g.call(s).args
            if const_scalar(c) is None:
                m, c = c, m
            if const_scalar(c) is None:
                return None
            eps = const_scalar(c)
            s = m
        if g.op(s) != "relax.mean":
            return None
        mc = g.call(s)
        nd = len(shape_of(s))
        if [int(a) for a in mc.attrs.axis] not in ([-1], [nd - 1]) or not bool(mc.attrs.keepdims):
            return None
        sq = mc.args[0]
        while isinstance(g.value.get(sq), relax.Var):  # alias bindings
            sq = g.value[sq]
        if g.op(sq) == "relax.multiply" and g.call(sq).args[0].same_as(g.call(sq).args[1]):
            base = g.call(sq).args[0]
        elif g.op(sq) == "relax.power" and const_scalar(g.call(sq).args[1]) == 2.0:
            base = g.call(sq).args[0]
        else:
            return None
        if not base.same_as(xx):
            return None
        x = self._upcast(xx)
        if shape_of(x) != shape_of(o) or dtype_of(x) not in ("float32", "float16", "bfloat16"):
            return None
        return x, w, float(eps)

    def _upcast(self, expr, any_dtype: bool = False):
        """Through one ``astype`` (to float32 unless ``any_dtype``): the cast's input."""
        g = self.g
        if g.op(expr) == "relax.astype" and (any_dtype or dtype_of(expr) == "float32"):
            return g.call(expr).args[0]
        return expr

    def _recip_sqrt(self, r):
        """``s`` if ``r`` is ``rsqrt(s)`` or ``1 / sqrt(s)``."""
        g = self.g
        if g.op(r) == "relax.rsqrt":
            return g.call(r).args[0]
        if g.op(r) == "relax.divide" and const_scalar(g.call(r).args[0]) == 1.0 and g.op(g.call(r).args[1]) == "relax.sqrt":
            return g.call(g.call(r).args[1]).args[0]
        return None

    # ---------------------------------------------------------------- the router
    def router_matmul(self, tk):
        """The matmul whose logits ``tk`` selects over (through scores, bias adds, layout ops), or None."""
        g = self.g
        e = g.call(tk).args[0]
        while isinstance(e, relax.Var):
            value, op = g.value.get(e), g.op(e)
            if isinstance(value, relax.Var):
                e = value
            elif op in LAYOUT_OPS or op in _SCORE_OPS:
                e = g.call(e).args[0]
            elif op == "relax.add":
                a, b = g.call(e).args
                e = a if self.static(b) else (b if self.static(a) else None)
            elif op == "relax.matmul":
                return e
            else:
                return None
        return None

    def match(self, m, norms: dict):
        """The ``_Match`` of router matmul ``m`` if it reads a recognised norm, else None."""
        g = self.g
        h, rhs = g.call(m).args
        # the matmul input: the norm output through reshapes (last axis kept) and an upcast to float32
        o = h
        while isinstance(o, relax.Var) and o not in norms:
            value, op = g.value.get(o), g.op(o)
            if isinstance(value, relax.Var):
                o = value
            elif op == "relax.reshape" or (op == "relax.astype" and dtype_of(o) == "float32"):
                if shape_of(o)[-1:] != shape_of(g.call(o).args[0])[-1:]:
                    return None
                o = g.call(o).args[0]
            else:
                break
        if o in norms:
            where = f"norm {norms[o][0]} -> router matmul {m.name}"
            parsed = norms[o][1]
            if parsed is None:
                self.skipped.append(f"{where}: the norm is not w * (x * rsqrt(mean(x^2) + eps)) over the last axis")
                return None
        else:  # a norm the structure analysis does not list (e.g. a cast between x * r and w *): checked here
            if not isinstance(o, relax.Var) or o not in g.value:
                return None
            where, parsed = f"norm {o.name} -> router matmul {m.name}", self.norm(o)
            if parsed is None:
                return None
        x, w, eps = parsed
        d = shape_of(o)[-1]
        out = shape_of(m)
        e = out[-1] if out else None
        if len(shape_of(rhs) or ()) != 2 or not is_static(e):
            self.skipped.append(f"{where}: the router weight is not a 2-D [E, D] matrix")
            return None
        if g.op(rhs) == "relax.permute_dims" and shape_of(g.call(rhs).args[0]) == (e, d) and self.static(g.call(rhs).args[0]):
            rows, layout = g.call(rhs).args[0], "ed"
        elif shape_of(rhs) == (d, e) and self.static(rhs):
            rows, layout = rhs, "de"
        else:
            self.skipped.append(f"{where}: the router weight is not a weight or constant R^T ([E, D] transposed) or [D, E]")
            return None
        logits, bias = m, None
        users = g.users.get(m, [])
        if len(users) == 1 and g.op(users[0]) == "relax.add":
            a, b = g.call(users[0]).args
            other = b if a.same_as(m) else a
            if self.static(other) and shape_of(other) in ((e,), (1, e)) and dtype_of(other) == dtype_of(m):
                logits, bias = users[0], other
        spec = NormRouterSpec(hidden=int(d), outputs=int(e), eps=eps, x_dtype=dtype_of(x), weight_dtype=dtype_of(w),
                              rows_dtype=dtype_of(rows), y_dtype=dtype_of(o), logits_dtype=dtype_of(logits),
                              bias_dtype=dtype_of(bias) if bias is not None else None, rows_layout=layout)
        try:
            check_supported(spec, self.form)
        except MoecError as exc:
            self.skipped.append(f"{where}: {exc}")
            return None
        add = residual_add(g, x)
        if add is not None:
            spec = replace(spec, residual=True)
        return _Match(norm=o, x=x, weight=w, logits=logits, matmul=m, rows=rows, bias=bias, spec=spec, add=add)

    def run(self) -> list[_Match]:
        g = self.g
        norms = {}
        for info in self.analyzer.find_norms():
            if info.out_var not in norms:
                norms[info.out_var] = (info.weight, self.norm(info.out_var))
        # router matmuls: the structure analysis' (weight rows, group-limited routers too) and the plain
        # logits -> [bias] -> scores -> top-k chains (also constant rows: the cascade's coarse router)
        routers = set()
        for tk in g.calls_of("relax.topk"):
            info = self.analyzer.find_router(tk)
            routers |= {m for m in (info.linear_var if info is not None else None, self.router_matmul(tk)) if m is not None}
        found = []
        adds = set()
        for m in sorted(routers, key=lambda v: g.order[v]):
            match = self.match(m, norms)
            if match is not None and all(not match.norm.same_as(f.norm) for f in found):
                if match.add is not None and match.add[0] in adds:  # one kernel per residual add
                    match = replace(match, add=None, spec=replace(match.spec, residual=False))
                if match.add is not None:
                    adds.add(match.add[0])
                found.append(match)
        return found


def residual_add(g: DataflowGraph, x):
    """``(x, a, b)`` if ``x`` (through aliases) is ``a + b`` of its own shape and dtype (a residual add before a
    norm, which the norm kernels then compute too), else None."""
    x = g.alias(x)
    if g.op(x) != "relax.add":
        return None
    a, b = g.call(x).args
    if all(dtype_of(t) == dtype_of(x) and same_shape(shape_of(t), shape_of(x)) for t in (a, b)):
        return x, a, b
    return None


@relax.expr_functor.mutator
class _FuseRouterNormRewriter(relax.PyExprMutator):
    def __init__(self, mod, graph: DataflowGraph, matches: list[_Match], kernel) -> None:
        super().__init__(mod)
        self.g = graph
        self.by_norm = {m.norm: m for m in matches}
        self.by_add = {m.add[0]: m for m in matches if m.add is not None}
        self.normed = {}  # norm var -> the kernel's normalised output, for norms computed at their residual add
        self.replaced = {}  # logits var -> the kernel's logits output
        self.dropped = {m.matmul for m in matches if not m.matmul.same_as(m.logits)}  # matmul feeding a fused bias add
        self.kernel = kernel  # spec -> GlobalVar
        self.position = -1

    def _materialize(self, expr):
        return materialize(self, self.g, self.position, expr)

    def visit_var_binding_(self, binding) -> None:
        var = binding.var
        self.position = self.g.order.get(var, self.position)
        if var in self.by_add:  # the residual add, the norm and the router: one kernel, here
            self.set_var_remap(var, self._fuse(self.by_add[var]))
        elif var in self.normed:
            self.set_var_remap(var, self.normed[var])
        elif var in self.by_norm:
            self.set_var_remap(var, self._fuse(self.by_norm[var]))
        elif var in self.replaced:
            self.set_var_remap(var, self.replaced[var])
        elif var not in self.dropped:
            super().visit_var_binding_(binding)

    def _fuse(self, m: _Match):
        """The kernel for ``m``: returns the normalised state, or with a residual add (emitted at the add) the sum,
        the normalised state then waiting in ``normed`` for the norm's binding."""
        # T tokens, D hidden, E router outputs
        bb, s = self.builder_, m.spec
        inputs = [m.add[1], m.add[2]] if m.add is not None else [m.x]
        inputs = [self.visit_expr(v) for v in inputs]
        lead = list(shape_of(inputs[0])[:-1])
        t = Analyzer().simplify(prod(lead))
        if len(lead) != 1:
            inputs = [bb.emit(relax.op.reshape(v, [t, s.hidden])) for v in inputs]  # T, D
        w = self._materialize(m.weight)
        rows = self._materialize(m.rows)
        args = inputs + [w, rows]
        if m.bias is not None:
            bias = self._materialize(m.bias)
            args.append(bias if shape_of(m.bias) == (s.outputs,) else bb.emit(relax.op.reshape(bias, [s.outputs])))
        outs = [relax.TensorType([t, s.hidden], s.y_dtype), relax.TensorType([t, s.outputs], s.logits_dtype)]
        if m.add is not None:
            outs.insert(0, relax.TensorType([t, s.hidden], s.x_dtype))
        out = bb.emit(relax.call_tir(self.kernel(s), args, out_ty=outs))
        y = bb.emit(relax.TupleGetItem(out, len(outs) - 2))  # T, D
        logits = bb.emit(relax.TupleGetItem(out, len(outs) - 1))  # T, E
        if len(shape_of(m.norm)) != 2:
            y = bb.emit(relax.op.reshape(y, list(shape_of(m.norm))))
        if len(shape_of(m.logits)) != 2:
            logits = bb.emit(relax.op.reshape(logits, list(shape_of(m.logits))))
        self.replaced[m.logits] = logits
        if m.add is None:
            return y
        self.normed[m.norm] = y
        x = bb.emit(relax.TupleGetItem(out, 0))
        return x if len(lead) == 1 else bb.emit(relax.op.reshape(x, list(shape_of(m.add[0]))))


@tvm.transform.module_pass(opt_level=0, name="FuseRouterIntoNorm")
class FuseRouterIntoNorm:
    """Fuse each router matmul with the RMSNorm it reads into one ``norm_router`` kernel.

    Parameters
    ----------
    target : tvm.target.Target
        Picks the kernel form: CUDA for ``cuda`` targets, the serial llvm form otherwise.
    source : str
        Model name for messages.

    On CUDA the prefill entry's kernels take the multi-token form (``norm_router.prefill_spec``: several rows a
    block, each router row read once for all of them), decode's a block per token and logit group.
    """

    def __init__(self, target: tvm.target.Target, source: str = "model") -> None:
        if not isinstance(target, tvm.target.Target):
            raise MoecError(f"FuseRouterIntoNorm needs a tvm.target.Target, got {type(target).__name__}")
        self.target, self.source = target, source
        self.fused: dict[str, int] = {}
        self.skipped: dict[str, list[str]] = {}
        self.kernels: dict[NormRouterSpec, str] = {}
        self.topk_fused: dict[str, int] = {}  # per entry, the kernels that took the softmax top-k too (FuseTopKIntoRouterNorm)
        self.topk_skipped: dict[str, list[str]] = {}

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        entries = num_input_entries(mod, "FuseRouterIntoNorm", self.source)
        form = "cuda" if self.target.kind.name == "cuda" else "llvm"
        kernels = KernelCache(lambda spec: make_norm_router(spec, form),
                              lambda spec: "norm_router" + (f"_t{spec.tokens}" if spec.tokens else ""), self.kernels)
        out = mod
        for gv, func in entries:
            func = relax.analysis.remove_all_unused(func)  # e.g. the routers CascadeGating replaced
            matcher = _Matcher(func, int(func.attrs["num_input"]), self.source, form)
            matches = matcher.run()
            self.fused[gv.name_hint] = len(matches)
            self.skipped[gv.name_hint] = matcher.skipped
            if not matches:
                continue
            rewriter = _FuseRouterNormRewriter(out, matcher.g, matches, None)
            rows = prefill_spec if form == "cuda" and gv.name_hint == "prefill" else (lambda spec: spec)
            rewriter.kernel = lambda spec, b=rewriter.builder_, rows=rows: kernels.get(b, rows(spec))
            new_func = rewriter.visit_expr(func)
            rewriter.builder_.update_func(gv, new_func)
            out = rewriter.builder_.get()
        return out

    def manifest(self) -> dict:
        """Fused norm + router pairs per entry, the kernels (one per distinct shape/dtype), and what was skipped."""
        return {"fused": dict(self.fused), "kernels": {name: asdict(spec) for spec, name in self.kernels.items()},
                "skipped": {k: v for k, v in self.skipped.items() if v}, "topk_fused": dict(self.topk_fused),
                "topk_skipped": {k: v for k, v in self.topk_skipped.items() if v}}


def _dims(ty) -> tuple:
    """The shape of a tensor type (``shape_of`` takes an expression)."""
    return shape_of(relax.Var("t", ty))


@relax.expr_functor.mutator
class _TopKRewriter(relax.PyExprMutator):
    """Each matched ``norm_router`` call becomes its top-k form; its logits' outputs and the ``topk_softmax`` call's go."""

    def __init__(self, mod, matches: dict, kernel) -> None:
        super().__init__(mod)
        self.matches = matches  # norm_router call var -> (spec, logits index, topk call var, its output type)
        self.kernel = kernel  # spec -> GlobalVar
        self.new: dict[relax.Var, relax.Var] = {}  # norm_router call var -> the top-k form's call
        self.topk: dict[relax.Var, list] = {}  # topk_softmax call var -> [idx, val] (reshaped to its outputs)
        self.dead: set = set()  # the logits' items and the reshapes to the top-k: their users are gone

    def visit_var_binding_(self, binding) -> None:
        var, value = binding.var, binding.value
        if var in self.matches:
            spec, at, tk, tk_ty = self.matches[var]
            rows = _dims(var.ty.fields[at])[0]  # T
            outs = list(var.ty.fields[:at]) + [relax.TensorType([rows, spec.topk], spec.index_dtype),
                                               relax.TensorType([rows, spec.topk], spec.values_dtype)]
            new = self.builder_.emit(relax.call_tir(self.kernel(spec), [self.visit_expr(a) for a in value.args[1].fields],
                                                    out_ty=outs))
            res = []
            for i, ty in enumerate(tk_ty.fields):  # idx, val as the topk call gave them
                got = self.builder_.emit(relax.TupleGetItem(new, at + i))
                res.append(got if same_shape(shape_of(got), _dims(ty)) else self.builder_.emit(relax.op.reshape(got, _dims(ty))))
            self.topk[tk] = res
            self.new[var] = new
        elif isinstance(value, relax.TupleGetItem) and value.tuple_value in self.matches:
            spec, at, _, _ = self.matches[value.tuple_value]
            if value.index != at:  # x, y: the same positions in the new call's outputs
                self.set_var_remap(var, self.builder_.emit(relax.TupleGetItem(self.new[value.tuple_value], value.index)))
        elif isinstance(value, relax.TupleGetItem) and value.tuple_value in self.topk:
            self.set_var_remap(var, self.topk[value.tuple_value][value.index])
        elif var in self.topk or var in self.dead:
            pass
        else:
            super().visit_var_binding_(binding)


# why the decode entry's norm + router keeps its own top-k kernel on CUDA
PER_TOKEN_REASON = ("the per-token form (a block per token and logit group) would become a block per token, slower at "
                    "decode: 13.1 us a layer on the H100 at 128 tokens against 7.5 + 3.7 for the pair "
                    "(bench/results/serve_h100_olmoe_128x4096_tiered_a0d4c1c.json, ..._profile_e639275.json)")


@tvm.transform.module_pass(opt_level=0, name="FuseTopKIntoRouterNorm")
class FuseTopKIntoRouterNorm:
    """The softmax top-k after a fused norm + router goes into the same kernel (``norm_router``'s top-k form).

    Expects the ``norm_router`` calls of ``FuseRouterIntoNorm`` and the ``topk_softmax`` calls of ``FuseSoftmaxTopK``
    (run after both). Matches, by structure: a ``norm_router`` call without a router bias whose logits output [T, E]
    has one user chain, through reshapes only, ending in a ``topk_softmax`` call over the same T rows of E (its input
    dtype the logits' own). Guarantees after: one ``call_tir`` of the kernel's top-k form (``NormRouterSpec.topk``)
    with outputs [x,] y, idx [T, K], val [T, K]: the ``topk_softmax`` call's outputs are those (reshaped to its
    shapes), the norm's and the residual's as before; no logits are written. On CUDA only the multi-token form fuses
    (the prefill entry's, ``tokens`` > 0, where a block already holds its rows' logits): the per-token form (decode's)
    keeps its grid of a block per (token, logit group) and the top-k its own kernel, faster at decode than a block
    per token (``PER_TOKEN_REASON``). The same indices as the two kernels give and the same values up to float
    rounding: the kernel selects over the logits rounded to their dtype as the unfused pair stores them. Others stay
    (``skipped`` says why where a norm_router's logits reached a top-k another way)."""

    def __init__(self, fuse: FuseRouterIntoNorm, topk, target: tvm.target.Target, source: str = "model") -> None:
        self.fuse, self.topk_pass, self.target, self.source = fuse, topk, target, source
        self.fused, self.skipped = fuse.topk_fused, fuse.topk_skipped  # (the fuse pass's manifest reports them)

    def _match(self, g: DataflowGraph, var, spec: NormRouterSpec, topk_keys: dict):
        """(logits index, topk call var, its output type, K, index dtype, values dtype, the bindings from the logits to
        the top-k) for the norm_router call ``var``, or a reason string."""
        at = len(var.ty.fields) - 1  # the logits: the last output
        if spec.bias_dtype is not None:
            return "a router bias"
        items = [u for u in g.users.get(var, []) if isinstance(g.value.get(u), relax.TupleGetItem)]
        logits = [u for u in items if g.value[u].index == at]
        if len(logits) != 1 or len(items) != len(g.users.get(var, [])):
            return "its outputs read other than item by item"
        cur, chain = logits[0], [logits[0]]  # (chain: the logits' item and the reshapes to the top-k, left dead)
        while True:
            users = g.users.get(cur, [])
            if len(users) != 1:
                return "the logits have other users"
            cur = users[0]
            if g.op(cur) == "relax.reshape" or isinstance(g.value.get(cur), relax.Var):
                chain.append(cur)
                continue
            break
        tk = g.call(cur)
        if g.op(cur) != "relax.call_tir" or tk.args[0].name_hint not in topk_keys:
            return "the logits reach no topk_softmax"
        n, k, dtype, index_dtype, values_dtype = topk_keys[tk.args[0].name_hint]
        rows = _dims(cur.ty.fields[0])[0]
        if n != spec.outputs or dtype != spec.logits_dtype or not same_shape((rows,), _dims(var.ty.fields[at])[:1]):
            return "the top-k is over other rows"
        return at, cur, cur.ty, k, index_dtype, values_dtype, chain

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        form = "cuda" if self.target.kind.name == "cuda" else "llvm"
        specs = {name: spec for spec, name in self.fuse.kernels.items()}
        topk_keys = {name: key for key, name in self.topk_pass.kernels.items()}
        kernels = KernelCache(lambda spec: make_norm_router(spec, form),
                              lambda spec: "norm_router_topk" + (f"_t{spec.tokens}" if spec.tokens else ""), self.fuse.kernels)
        out = mod
        for gv, func in num_input_entries(mod, "FuseTopKIntoRouterNorm", self.source):
            func = relax.analysis.remove_all_unused(func)  # (the softmax FuseSoftmaxTopK left dead)
            g = DataflowGraph(func, int(func.attrs["num_input"]))
            matches, skipped, dead = {}, [], set()
            for b in g.bindings:
                call = g.call(b.var)
                if g.op(b.var) != "relax.call_tir" or call.args[0].name_hint not in specs:
                    continue
                spec = specs[call.args[0].name_hint]
                got = self._match(g, b.var, spec, topk_keys)
                if not isinstance(got, str) and form == "cuda" and not spec.tokens:
                    got = PER_TOKEN_REASON
                if isinstance(got, str):
                    skipped.append(f"{call.args[0].name_hint} ({b.var.name}): {got}")
                    continue
                at, tk, tk_ty, k, index_dtype, values_dtype, chain = got
                new = replace(spec, topk=k, index_dtype=index_dtype, values_dtype=values_dtype)
                try:
                    check_supported(new, form)
                except MoecError as exc:
                    skipped.append(f"{call.args[0].name_hint} ({b.var.name}): {exc}")
                    continue
                matches[b.var] = (new, at, tk, tk_ty)
                dead.update(chain)
            self.fused[gv.name_hint] = len(matches)
            self.skipped[gv.name_hint] = skipped
            if not matches:
                continue
            rewriter = _TopKRewriter(out, matches, None)
            rewriter.dead = dead
            rewriter.kernel = lambda spec, b=rewriter.builder_: kernels.get(b, spec)
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
            out = rewriter.builder_.get()
        return out


__all__ = ["FuseRouterIntoNorm", "FuseTopKIntoRouterNorm"]
