"""ViewOutputReshape: a reshape that makes an entry's output becomes a view, not a copy.

TVM's ``RewriteDataflowReshape`` turns the reshape kernels of a dataflow block back into views (``relax.reshape``,
lowered to ``vm.builtin.reshape``) but leaves those whose result leaves the block, so each entry that ends in a
reshape copies its output once more: the logits ``[T, V] -> [1, T, V]`` after the LM head, at 128 decode rows of
a 50k vocabulary 26 MB read and written every step (25 us of a 9.3 ms step on an H100). A reshape moves no element
and a view of the LM head's output is as good an output as a copy of it: the memory planner follows views to their
base, so the base is not reused while the view is alive, and in a captured CUDA graph the base is the graph's
static buffer exactly as the copy's would be (an entry's outputs are read before the next call, as before).

Expects: phase-3 IR (reshape PrimFuncs called through ``call_tir``), after ``RewriteDataflowReshape``. Guarantees:
each dataflow output bound to ``call_tir`` of a PrimFunc with the reshape pattern (one tensor argument, no
symbolic arguments) whose argument the same block's ``call_tir`` made (a fresh tensor: not a parameter, not a
buffer updated in place) is bound to ``relax.reshape`` of that argument to the same shape instead. Nothing else
changes; a reshape PrimFunc no call uses any more is removed.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.analysis import has_reshape_pattern

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _reshape_call(mod: tvm.IRModule, value) -> relax.Expr | None:
    """The tensor a ``call_tir`` of a reshape PrimFunc reads, or None."""
    if not (isinstance(value, relax.Call) and value.op.same_as(_CALL_TIR)) or len(value.args) != 2:
        return None  # (a third argument: symbolic values the PrimFunc takes)
    gv, args = value.args[0], value.args[1]
    if not isinstance(gv, relax.GlobalVar) or not isinstance(args, relax.Tuple) or len(args.fields) != 1:
        return None
    func = mod[gv]
    if not isinstance(func, tvm.tirx.PrimFunc) or not has_reshape_pattern(func):
        return None
    if not isinstance(value.ty, relax.TensorType) or value.ty.shape is None:
        return None
    return args.fields[0]


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod_ = mod
        self.rewritten = 0

    def visit_var_binding_(self, binding) -> None:
        src = None if isinstance(binding.var, relax.DataflowVar) else _reshape_call(self.mod_, binding.value)
        if src is not None:  # only a tensor the block's own call_tir made: a view of a parameter or of a buffer
            made = self.lookup_binding(src) if isinstance(src, relax.DataflowVar) else None  # updated in place aliases
            if not (isinstance(made, relax.Call) and made.op.same_as(_CALL_TIR)):
                src = None
        if src is None:
            super().visit_var_binding_(binding)
            return
        shape = binding.value.ty.shape
        new = self.builder_.normalize(relax.op.reshape(self.visit_expr(src), shape))
        self.builder_.emit_normalized(relax.VarBinding(binding.var, new))
        self.rewritten += 1


@tvm.transform.module_pass(opt_level=0, name="ViewOutputReshape")
class ViewOutputReshape:
    """See the module docstring; ``rewritten`` counts the reshapes made views in the last run."""

    def __init__(self):
        self.rewritten = 0

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        self.rewritten = 0
        rewriter = _Rewriter(mod)
        for gv, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                new = rewriter.visit_expr(func)
                if not new.same_as(func):
                    rewriter.builder_.update_func(gv, new)
        self.rewritten = rewriter.rewritten
        if not self.rewritten:
            return mod
        out = rewriter.builder_.get()
        return _drop_unused(out)


def _drop_unused(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` without the PrimFuncs no function calls any more."""
    used = set()
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            for gv in relax.analysis.all_global_vars(func):
                used.add(gv.name_hint)
    keep = {gv: f for gv, f in mod.functions.items() if isinstance(f, relax.Function) or gv.name_hint in used}
    if len(keep) == len(mod.functions):
        return mod
    return tvm.IRModule(keep, attrs=mod.attrs, global_infos=mod.global_infos)
