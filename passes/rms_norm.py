"""InsertRMSNorm: every remaining RMSNorm becomes one ``rms_norm`` kernel.

Expects entry functions (attribute ``num_input``: leading non-weight parameters, then the weights),
after ``FuseRouterIntoNorm`` (the norms before routers are fused with them there; this pass takes the
rest: the attention input norms, QK-norms, the final norm, norms without a router). In each entry it
matches, by structure only, the forms ``FuseRouterIntoNorm`` checks op by op (legend: D the normalised
last axis)::

    o = w * (x * rsqrt(mean(x*x, -1, keepdims) + eps))      # w a 1-D weight or constant [D]

(also ``power(x, 2)``, ``1 / sqrt``, ``x / sqrt``, an upcast of x to float32 before the square, a cast
between ``x * r`` and ``w *``, and ``nn.rms_norm``), over any leading shape: per-head norms ([.., H, Dh]) too.

Why: after TVM's operator fusion an exported RMSNorm is three kernels (the upcast, the square, and the
mean with the rest), each a pass over the row, the first two writing float32 copies of it; at decode
batch sizes they are launch-bound. One kernel reads the row once (``schedules.kernels.rms_norm``).

Guarantees after: each match is ``reshape(call_tir(rms_norm, [reshape(x, [N, D]), w]), o's shape)``
with ``o``'s dtype; every user of ``o`` reads it. The unfused bindings are left dead for the dead-code
elimination after phase 1. Results equal the unfused graph's up to one rounding (the kernel rounds
``w * x * r`` once; HF's form rounds ``x * r`` to the input dtype first). Nothing else changes.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import tvm
from tvm import relax
from tvm.sym.analyzer import Analyzer

from ..compiler.errors import MoecError
from ..compiler.graph import KernelCache, dtype_of, is_static, materialize, num_input_entries, prod, shape_of
from ..schedules.kernels.rms_norm import RMSNormSpec, check_supported, make_rms_norm
from .fuse_router_norm import _Matcher, residual_add

_CANDIDATES = ("relax.multiply", "relax.nn.rms_norm")


def _find(matcher: _Matcher) -> tuple[dict, dict, list[str]]:
    """``{o: (x, w, spec, add)}`` for each RMSNorm of the function (``add``: ``(x, a, b)`` when x = a + b, fused),
    ``{x: o}`` for those adds, and why recognised-looking norms were left."""
    g = matcher.g
    found, adds, skipped = {}, {}, []  # adds: residual add var -> the norm var fused with it
    for var in sorted((v for op in _CANDIDATES for v in g.calls_of(op)), key=lambda v: g.order[v]):
        parsed = matcher.norm(var)
        if parsed is None:
            continue
        x, w, eps = parsed
        shape = shape_of(var)
        if not shape or not is_static(shape[-1]) or dtype_of(var) not in ("float32", "float16", "bfloat16") \
                or dtype_of(w) not in ("float32", "float16", "bfloat16"):
            skipped.append(f"norm {var.name}: shape {shape} / dtypes {dtype_of(x)}, {dtype_of(w)} -> {dtype_of(var)}")
            continue
        x = g.alias(x)
        add = residual_add(g, x) if x not in adds else None  # computed in the kernel too
        spec = RMSNormSpec(hidden=int(shape[-1]), eps=eps, x_dtype=dtype_of(x), weight_dtype=dtype_of(w),
                           y_dtype=dtype_of(var), residual=add is not None)
        try:
            check_supported(spec, matcher.form)
        except MoecError as exc:
            skipped.append(f"norm {var.name}: {exc}")
            continue
        found[var] = (x, w, spec, add)
        if add is not None:
            adds[x] = var
    return found, adds, skipped


def _pairs(g, found: dict) -> dict:
    """``{second: first}``: consecutive norms of one spec (no residual add) in one launch at the second's place, where
    the second is not computed from the first (a model's Q- and K-norms); taken in order, each in one pair at most.
    What reads the first before the second moves after it (``_Rewriter``)."""
    norms = sorted((v for v, (_, _, spec, add) in found.items() if add is None), key=lambda v: g.order[v])
    pairs, i = {}, 0
    while i + 1 < len(norms):
        first, second = norms[i], norms[i + 1]
        before = g.order[first]  # (nothing bound before the first is computed from it)
        if found[first][2] == found[second][2] and first not in g.ancestors(second, stop=lambda v: g.order.get(v, -1) <= before):
            pairs[second] = first
            i += 2
        else:
            i += 1
    return pairs


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod, graph, matches: dict, adds: dict, kernel, pairs: dict | None = None) -> None:
        super().__init__(mod)
        self.g = graph
        self.matches = matches
        self.adds = adds  # residual add var -> its norm var
        self.pairs = pairs or {}  # second norm var -> first: both computed at the second (one launch)
        self.firsts = set(self.pairs.values())
        self.pending, self.deferred = set(), []  # a first's var and what reads it before its second: emitted after it
        self.normed = {}  # norm var -> the fused kernel's normalised output (emitted at the add)
        self.kernel = kernel
        self.position = -1

    def _materialize(self, expr):
        return materialize(self, self.g, self.position, expr)

    def _rows(self, tensors, shape, hidden):
        """``tensors`` as [N, D] rows (reshaped unless 2-D already) and N."""
        rows = prod(shape[:-1]) if len(shape) > 1 else 1
        rows = rows if isinstance(rows, int) else Analyzer().simplify(rows)
        if len(shape) == 2:
            return tensors, rows
        return [self.builder_.emit(relax.op.reshape(t, [rows, hidden])) for t in tensors], rows

    def _back(self, t, shape):
        return t if len(shape) == 2 else self.builder_.emit(relax.op.reshape(t, shape))

    def visit_var_binding_(self, binding) -> None:
        var = binding.var
        self.position = self.g.order.get(var, self.position)
        if var in self.normed:  # its kernel ran at the residual add
            self.set_var_remap(var, self.normed[var])
            return
        if var in self.adds:  # the residual add and the norm after it: one kernel, here
            norm = self.adds[var]
            _, w, spec, (_, a, b) = self.matches[norm]
            shape, nshape = list(shape_of(var)), list(shape_of(norm))
            (av, bv), rows = self._rows([self.visit_expr(a), self.visit_expr(b)], shape, spec.hidden)
            out = self.builder_.emit(relax.call_tir(self.kernel(spec), [av, bv, self._materialize(w)], out_ty=[
                relax.TensorType([rows, spec.hidden], spec.x_dtype), relax.TensorType([rows, spec.hidden], spec.y_dtype)]))
            self.set_var_remap(var, self._back(self.builder_.emit(relax.TupleGetItem(out, 0)), shape))
            self.normed[norm] = self._back(self.builder_.emit(relax.TupleGetItem(out, 1)), nshape)
            return
        if var in self.firsts:  # computed with its pair's second
            self.pending.add(var)
            return
        if self.pending and any(v in self.pending for v in relax.analysis.free_vars(binding.value)):
            self.pending.add(var)  # reads a first: after the pair (the second is not computed from it)
            self.deferred.append(binding)
            return
        if var in self.pairs:
            self._pair(self.pairs[var], var)
            deferred, self.pending, self.deferred = self.deferred, set(), []
            for b in deferred:
                self.visit_var_binding_(b)
            return
        m = self.matches.get(var)
        if m is None:
            super().visit_var_binding_(binding)
            return
        x, w, spec, _ = m
        shape = list(shape_of(var))
        (xv,), rows = self._rows([self.visit_expr(x)], shape, spec.hidden)
        y = self.builder_.emit(relax.call_tir(self.kernel(spec), [xv, self._materialize(w)],
                                              out_ty=relax.TensorType([rows, spec.hidden], spec.y_dtype)))
        self.set_var_remap(var, self._back(y, shape))

    def _pair(self, first, second) -> None:
        (x1, w1, spec, _), (x2, w2, _, _) = self.matches[first], self.matches[second]
        s1, s2 = list(shape_of(first)), list(shape_of(second))
        (v1,), r1 = self._rows([self.visit_expr(x1)], s1, spec.hidden)
        (v2,), r2 = self._rows([self.visit_expr(x2)], s2, spec.hidden)
        out = self.builder_.emit(relax.call_tir(self.kernel(replace(spec, pair=True)), [v1, self._materialize(w1), v2, self._materialize(w2)],
                                                out_ty=[relax.TensorType([r1, spec.hidden], spec.y_dtype),
                                                        relax.TensorType([r2, spec.hidden], spec.y_dtype)]))
        self.set_var_remap(first, self._back(self.builder_.emit(relax.TupleGetItem(out, 0)), s1))
        self.set_var_remap(second, self._back(self.builder_.emit(relax.TupleGetItem(out, 1)), s2))


@tvm.transform.module_pass(opt_level=0, name="InsertRMSNorm")
class InsertRMSNorm:
    """Replace each RMSNorm with the one-pass ``rms_norm`` kernel.

    Parameters
    ----------
    target : tvm.target.Target
        Picks the kernel form: CUDA for ``cuda`` targets, the serial llvm form otherwise.
    source : str
        Model name for messages.
    """

    def __init__(self, target: tvm.target.Target, source: str = "model") -> None:
        if not isinstance(target, tvm.target.Target):
            raise MoecError(f"InsertRMSNorm needs a tvm.target.Target, got {type(target).__name__}")
        self.target, self.source = target, source
        self.replaced: dict[str, int] = {}
        self.residual: dict[str, int] = {}  # of them, norms computed with the residual add before them
        self.paired: dict[str, int] = {}  # pairs of them computed in one launch (a layer's Q- and K-norms)
        self.skipped: dict[str, list[str]] = {}
        self.kernels: dict[RMSNormSpec, str] = {}

    def manifest(self) -> dict:
        return {"replaced": dict(self.replaced), "with_residual_add": dict(self.residual), "paired": dict(self.paired),
                "skipped": {k: v for k, v in self.skipped.items() if v},
                "kernels": {name: asdict(spec) for spec, name in self.kernels.items()}}

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        form = "cuda" if self.target.kind.name == "cuda" else "llvm"
        kernels = KernelCache(lambda spec: make_rms_norm(spec, form), lambda spec: "rms_norm", self.kernels)
        out = mod
        for gv, func in num_input_entries(mod, "InsertRMSNorm", self.source):
            func = relax.analysis.remove_all_unused(func)  # e.g. the norms FuseRouterIntoNorm replaced
            matcher = _Matcher(func, int(func.attrs["num_input"]), self.source, form)
            matches, adds, skipped = _find(matcher)
            self.replaced[gv.name_hint] = len(matches)
            self.residual[gv.name_hint] = len(adds)
            self.skipped[gv.name_hint] = skipped
            self.paired[gv.name_hint] = 0
            if not matches:
                continue
            pairs = _pairs(matcher.g, matches)
            self.paired[gv.name_hint] = len(pairs)
            rewriter = _Rewriter(out, matcher.g, matches, adds, None, pairs)
            rewriter.kernel = lambda spec, b=rewriter.builder_: kernels.get(b, spec)
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
            out = rewriter.builder_.get()
        return out


__all__ = ["InsertRMSNorm"]
