"""SimplifyPower: ``power(x, c)`` with a small constant exponent becomes multiplies / sqrt / rsqrt.

RMSNorm exports compute ``x ** 2`` with ``power``. On CUDA TVM lowers ``power`` to ``__powf``
(``exp2(y * log2(x))``), which is NaN for every negative ``x``: a model's hidden states are NaN after
the first norm. Integer and half-integer exponents have exact, cheaper forms; this pass uses them.

Expects: any Relax module. Guarantees: no ``relax.power`` whose exponent is a scalar constant in
{-1, -0.5, 0.5, 1, 2, 3, 4} remains; every other call is untouched.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ..compiler.graph import const_scalar


@relax.expr_functor.mutator
class _SimplifyPowerRewriter(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.power"):
            return call
        x, exponent = call.args
        c = const_scalar(exponent)
        if c is None:
            return call
        dtype = str(x.ty.dtype)
        if c == 1.0:
            return x
        if c in (2.0, 3.0, 4.0):
            sq = self.builder_.emit(relax.op.multiply(x, x))
            if c == 2.0:
                return sq
            return relax.op.multiply(sq, x) if c == 3.0 else relax.op.multiply(sq, sq)
        if c == 0.5:
            return relax.op.sqrt(x)
        if c == -0.5:
            return relax.op.rsqrt(x)
        if c == -1.0:
            return relax.op.divide(relax.const(1.0, dtype), x)
        return call


@tvm.transform.module_pass(opt_level=0, name="SimplifyPower")
class SimplifyPower:
    """Rewrite ``power`` by small constant exponents into exact elementwise forms."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _SimplifyPowerRewriter(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get()
