"""SimplifyLayout: consecutive ``permute_dims`` composed into one, identity permutations dropped.

The attention passes hand each layer's output back in the model's heads-first layout ([1, H, N, Dh]) as a
permute of the tokens-first one; the model's own ``transpose(1, 2)`` then permutes it straight back. Composed,
the pair is the identity and both copies disappear (TVM keeps a transposing kernel for each otherwise).

Expects: any Relax module. Guarantees: ``permute_dims(permute_dims(x, p), q)`` becomes
``permute_dims(x, p . q)`` (when the inner result has no other use it is left dead), an identity permutation
becomes ``x``; the values are unchanged. Nothing else changes.
"""

from __future__ import annotations

import tvm
from tvm import relax


def _axes(call: relax.Call, rank: int) -> list[int]:
    axes = call.attrs.axes
    return list(range(rank))[::-1] if axes is None else [int(a) % rank for a in axes]


def _shape(expr):
    shape = getattr(getattr(expr, "ty", None), "shape", None)
    return list(shape.values) if shape is not None and hasattr(shape, "values") else None


def _op(value, name: str) -> bool:
    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == name


def _same(a, b) -> bool:
    return len(a) == len(b) and all(tvm_ffi_equal(x, y) for x, y in zip(a, b))


def tvm_ffi_equal(x, y) -> bool:
    """Two dims equal: static ones by value, symbolic ones structurally."""
    import tvm_ffi

    sx, sy = (int(d.value) if isinstance(d, tvm.tirx.IntImm) else d for d in (x, y))
    if isinstance(sx, int) or isinstance(sy, int):
        return sx == sy
    return bool(tvm_ffi.structural_equal(sx, sy))


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def _reshaped(self, x):
        """What ``x`` reshapes, through a chain of reshapes (``x`` if it is not one)."""
        while isinstance(x, relax.Var) and _op(self.lookup_binding(x), "relax.reshape"):
            x = self.lookup_binding(x).args[0]
        return x

    def _permute(self, x, axes: list[int]):
        """``permute_dims(x, axes)``, composed with a permute ``x`` is bound to (through reshapes that keep its
        shape); ``x`` itself for the identity."""
        y = self._reshaped(x)
        if y is not x and _shape(y) is not None and _same(_shape(y), _shape(x)):
            x = y
        inner = self.lookup_binding(x) if isinstance(x, relax.Var) else None
        if _op(inner, "relax.permute_dims"):
            first = _axes(inner, len(axes))
            x, axes = inner.args[0], [first[a] for a in axes]  # out[i] = in[first[axes[i]]]
        return x if axes == list(range(len(axes))) else relax.op.permute_dims(x, axes)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not _op(call, "relax.permute_dims"):
            return call
        x = call.args[0]
        shape = _shape(x)
        if shape is None:
            return call
        rank = len(shape)
        axes = _axes(call, rank)
        y = self._reshaped(x)
        if y is not x and _shape(y) is not None:
            # x = reshape(y, [1] * k + y.shape) (leading unit axes added) and the permute keeps them in place:
            # permute y itself (maybe composing with y's own permute), then add the unit axes
            k = rank - len(_shape(y))
            if k > 0 and axes[:k] == list(range(k)) and all(tvm_ffi_equal(d, 1) for d in shape[:k]) \
                    and _same(shape[k:], _shape(y)):
                out = self._permute(y, [a - k for a in axes[k:]])
                if not isinstance(out, relax.Var):
                    out = self.builder_.emit(out)
                return relax.op.reshape(out, _shape(call))
        return self._permute(x, axes)


@tvm.transform.module_pass(opt_level=0, name="SimplifyLayout")
class SimplifyLayout:
    """Compose consecutive permutations; drop identities."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _Rewriter(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get()


__all__ = ["SimplifyLayout"]
