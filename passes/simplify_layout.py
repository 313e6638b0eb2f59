"""SimplifyLayout: consecutive ``permute_dims`` composed into one, identity permutations dropped, a widening cast
and the cast back dropped.

The attention passes hand each layer's output back in the model's heads-first layout ([1, H, N, Dh]) as a
permute of the tokens-first one; the model's own ``transpose(1, 2)`` then permutes it straight back. Composed,
the pair is the identity and both copies disappear (TVM keeps a transposing kernel for each otherwise).

Expects: any Relax module. Guarantees: ``permute_dims(permute_dims(x, p), q)`` becomes
``permute_dims(x, p . q)`` (when the inner result has no other use it is left dead), also through casts (the
cast then follows the permute), reshapes that keep the shape, and reshapes that add leading unit axes which
the outer permute keeps in place; an identity permutation becomes ``x``, and so does ``broadcast_to`` of a
tensor to its own shape. ``astype(L(astype(y, wide)), dt)`` becomes ``L(y)`` where ``y`` is of ``dt``, ``wide`` holds
every ``dt`` value exactly (float32 of float16 / bfloat16) and ``L`` is reshapes and permutes (the tiered decode
kernel writes the 16-bit dtype a model narrows its attention output to; the float32 in between goes). The values
are unchanged. Nothing else changes.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ..compiler.graph import same_dim, same_shape


EXACT_IN = {"float32": ("float16", "bfloat16"), "float64": ("float16", "bfloat16", "float32")}  # wide: its exact subsets


def _axes(call: relax.Call, rank: int) -> list[int]:
    axes = call.attrs.axes
    return list(range(rank))[::-1] if axes is None else [int(a) % rank for a in axes]


def _shape(expr):
    shape = getattr(getattr(expr, "ty", None), "shape", None)
    return list(shape.values) if shape is not None and hasattr(shape, "values") else None


def _op(value, name: str) -> bool:
    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == name


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def _alias(self, x):
        while isinstance(x, relax.Var) and isinstance(self.lookup_binding(x), relax.Var):
            x = self.lookup_binding(x)
        return x

    def _bound(self, x):
        x = self._alias(x)
        return self.lookup_binding(x) if isinstance(x, relax.Var) else None

    def _reshaped(self, x):
        """What ``x`` reshapes, through a chain of reshapes (``x`` if it is not one)."""
        while _op(self._bound(x), "relax.reshape"):
            x = self._bound(x).args[0]
        return self._alias(x)

    def _emitted(self, expr):
        return expr if isinstance(expr, relax.Var) else self.builder_.emit(expr)

    def _permute(self, x, axes: list[int]):
        """An expression for ``permute_dims(x, axes)``: through casts (moved after it), reshapes that keep the shape or
        only add leading unit axes kept in place, composed with a permute ``x`` is bound to, nothing for the
        identity."""
        x = self._alias(x)
        rank = len(axes)
        bound = self._bound(x)
        if _op(bound, "relax.astype"):  # elementwise: permute first, cast after (a cast fuses into its producer)
            return relax.op.astype(self._emitted(self._permute(bound.args[0], axes)), str(bound.attrs.dtype))
        y = self._reshaped(x)
        shape, ys = _shape(x), _shape(y)
        if y is not x and shape is not None and ys is not None:
            k = rank - len(ys)
            if k == 0 and same_shape(shape, ys):
                return self._permute(y, axes)
            if k > 0 and axes[:k] == list(range(k)) and all(same_dim(d, 1) for d in shape[:k]) and same_shape(shape[k:], ys):
                inner = self._emitted(self._permute(y, [a - k for a in axes[k:]]))
                return relax.op.reshape(inner, [shape[a] for a in axes])
        if _op(bound, "relax.permute_dims"):
            first = _axes(bound, rank)
            x, axes = self._alias(bound.args[0]), [first[a] for a in axes]  # out[i] = in[first[axes[i]]]
        return x if axes == list(range(rank)) else relax.op.permute_dims(x, axes)

    def _unwidened(self, call: relax.Call):
        """``astype(L(astype(y, wide)), dt)`` with ``y`` of ``dt``, ``wide`` holding every ``dt`` value exactly and ``L``
        reshapes and permutes: ``L(y)``; else None."""
        dt = str(call.attrs.dtype)
        layout, x = [], self._alias(call.args[0])
        while _op(self._bound(x), "relax.reshape") or _op(self._bound(x), "relax.permute_dims"):
            layout.append(self._bound(x))
            x = self._alias(self._bound(x).args[0])
        inner = self._bound(x)
        if not _op(inner, "relax.astype") or dt not in EXACT_IN.get(str(inner.attrs.dtype), ()):
            return None
        y = self._alias(inner.args[0])
        if getattr(y.ty, "dtype", None) != dt:
            return None
        for op in reversed(layout):
            y = self._emitted(relax.op.reshape(y, op.args[1]) if _op(op, "relax.reshape") else
                              relax.op.permute_dims(y, op.attrs.axes))
        return y

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if _op(call, "relax.astype"):  # a widening cast and the narrowing back: neither
            y = self._unwidened(call)
            return call if y is None else y
        if _op(call, "relax.broadcast_to"):  # to its own shape: the identity
            x = call.args[0]
            return x if _shape(x) is not None and same_shape(_shape(x), _shape(call)) else call
        if not _op(call, "relax.permute_dims"):
            return call
        shape = _shape(call.args[0])
        if shape is None:
            return call
        return self._permute(call.args[0], _axes(call, len(shape)))


@tvm.transform.module_pass(opt_level=0, name="SimplifyLayout")
class SimplifyLayout:
    """Compose consecutive permutations; drop identities and exact cast round trips."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _Rewriter(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get()


__all__ = ["SimplifyLayout"]
