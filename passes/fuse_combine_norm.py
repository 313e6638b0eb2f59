"""FuseCombineIntoNorm: the routed experts' combine computed in the residual add + RMSNorm kernel after it.

Expects entry functions after ``InsertRMSNorm`` and ``InsertGroupedExperts`` (phase 1). There, an MoE layer ends
with ``combine(y [T K, D], ids [T, K]) -> out [T, D]`` (the K weighted slot outputs of each token summed), and the
residual add with the RMSNorm after it (the next layer's input norm, or the final norm) is one ``rms_norm`` kernel
with ``residual``: ``(x, normed) = add_rms_norm(a, b, w)`` with ``x = a + b``. Where ``b`` (or ``a``) is the
combine's output, through reshapes that keep its [T, D] shape, and nothing else reads it, this pass replaces the
pair with one ``rms_norm`` kernel with ``combine`` K (``schedules.kernels.rms_norm``), which sums each token's
valid slots itself: ``(x, normed) = combine_add_rms_norm(a, y, ids, w)``.

Why: at decode batch sizes each kernel of a layer is a launch of a few microseconds, most of it latency, and the
combine's [T, D] float32 output was written only to be read back by the next kernel. One launch a MoE layer less.

Guarantees after: every user of the norm's outputs reads the fused kernel's, which equal the pair's bit for bit
(the slots summed in the same order, rounded to the residual dtype as the combine stored them, then added and
normalised as before); the combine's binding is left dead for the dead-code elimination after phase 1. Combines
read elsewhere too (e.g. shared experts added to them), residual streams of float16 and norms without the residual
add stay as they were. Nothing else changes.
"""

from __future__ import annotations

from dataclasses import replace

import tvm
from tvm import relax

from ..compiler.errors import MoecError
from ..compiler.graph import DataflowGraph, KernelCache, dtype_of, num_input_entries, op_name, same_shape, shape_of
from ..schedules.kernels.rms_norm import make_rms_norm


def _callee(value) -> str | None:
    """The PrimFunc name a ``call_tir`` calls, or None."""
    return value.args[0].name_hint if op_name(value) == "relax.call_tir" else None


class _Finder:
    """The fusable (norm, combine) pairs of one entry: ``{norm var: (other operand, y, ids, w, norm spec, combine
    spec)}``."""

    def __init__(self, func: relax.Function, norm_specs: dict, combine_specs: dict) -> None:
        self.g = DataflowGraph(func, int(func.attrs["num_input"]))
        self.norm_specs, self.combine_specs = norm_specs, combine_specs

    def _combine_of(self, x):
        """The ``(combine call, spec)`` ``x`` is (through reshapes keeping its shape), each step read once, or None."""
        g, shape = self.g, shape_of(x)
        while isinstance(x, relax.Var) and len(g.users.get(x, [])) == 1:
            value = g.value.get(x)
            name = _callee(value)
            if name in self.combine_specs:
                return (value, self.combine_specs[name]) if same_shape(shape_of(x), shape) else None
            if op_name(value) != "relax.reshape":
                return None
            x = value.args[0]
        return None

    def pairs(self) -> dict:
        found = {}
        for var, value in self.g.value.items():
            spec = self.norm_specs.get(_callee(value))
            if spec is None or not spec.residual or spec.combine or spec.x_dtype not in ("float32", "bfloat16"):
                continue
            a, b, w = value.args[1].fields
            for mine, other in ((b, a), (a, b)):  # (x = a + b: float addition commutes exactly)
                hit = self._combine_of(mine)
                if hit is None:
                    continue
                call, cspec = hit
                y, ids = call.args[1].fields
                if cspec.out_dtype != spec.x_dtype or shape_of(y)[-1] != spec.hidden:
                    continue
                found[var] = (other, y, ids, w, spec, cspec)
                break
        return found


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod, pairs: dict, kernel) -> None:
        super().__init__(mod)
        self.pairs, self.kernel = pairs, kernel

    def visit_var_binding_(self, binding) -> None:
        hit = self.pairs.get(binding.var)
        if hit is None:
            super().visit_var_binding_(binding)
            return
        other, y, ids, w, spec, cspec = hit
        fused = replace(spec, combine=cspec.top_k, experts=cspec.experts, ids_dtype=dtype_of(ids))
        out_ty = binding.value.ty  # (x, normed): [rows, D] each, as the norm's
        call = relax.call_tir(self.kernel(fused), [self.visit_expr(other), self.visit_expr(y), self.visit_expr(ids),
                                                   self.visit_expr(w)], out_ty=list(out_ty.fields))
        self.set_var_remap(binding.var, self.builder_.emit(call))


@tvm.transform.module_pass(opt_level=0, name="FuseCombineIntoNorm")
class FuseCombineIntoNorm:
    """Fuse each routed-expert combine into the residual add + RMSNorm kernel that reads it.

    Parameters
    ----------
    norms : moec.passes.rms_norm.InsertRMSNorm
        The pass that made the norm kernels (its ``kernels``: spec -> function name).
    grouped : moec.passes.grouped_experts.InsertGroupedExperts
        The pass that made the combine kernels (its ``kernels``: (spec, kernel) -> function name).
    target : tvm.target.Target
    source : str
        Model name for messages.
    """

    def __init__(self, norms, grouped, target: tvm.target.Target, source: str = "model") -> None:
        if not isinstance(target, tvm.target.Target):
            raise MoecError(f"FuseCombineIntoNorm needs a tvm.target.Target, got {type(target).__name__}")
        self.norms, self.grouped, self.target, self.source = norms, grouped, target, source
        self.fused: dict[str, int] = {}
        self.kernels: dict = {}

    def manifest(self) -> dict:
        from dataclasses import asdict

        return {"fused": dict(self.fused), "kernels": {name: asdict(spec) for spec, name in self.kernels.items()}}

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        form = "cuda" if self.target.kind.name == "cuda" else "llvm"
        norm_specs = {name: spec for spec, name in self.norms.kernels.items()}
        combine_specs = {name: spec for (spec, kind), name in self.grouped.kernels.items() if kind == "combine"}
        kernels = KernelCache(lambda spec: make_rms_norm(spec, form), lambda spec: "rms_norm", self.kernels)
        out = mod
        for gv, func in num_input_entries(mod, "FuseCombineIntoNorm", self.source):
            pairs = _Finder(func, norm_specs, combine_specs).pairs()
            self.fused[gv.name_hint] = len(pairs)
            if not pairs:
                continue
            rewriter = _Rewriter(out, pairs, None)
            rewriter.kernel = lambda spec, b=rewriter.builder_: kernels.get(b, spec)
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
            out = rewriter.builder_.get()
        return out


__all__ = ["FuseCombineIntoNorm"]
