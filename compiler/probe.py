"""Read intermediate tensors of an imported model: ``main`` with chosen bindings as its outputs, run on the CPU.

``probe(func, num_inputs, targets)`` returns a function that takes the model inputs and weights and
gives the values of ``targets`` (variables bound in ``func``, e.g. the router inputs that
``moe_structure.analyze`` found). The probed function keeps ``func``'s bindings up to the targets and
exposes each target as an output of its dataflow block; dead-code elimination drops the rest (the LM
head and every layer after the last target). Compiled for llvm with the same top-k lowering as the
pipeline, so what it reads is what the compiled model computes.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from .errors import MoecError


def probe_function(func: relax.Function, targets: list) -> tvm.IRModule:
    """``main(*params) -> (target_0, ...)``: ``func`` with ``targets`` (bound vars of ``func``) as outputs."""
    wanted = {t: i for i, t in enumerate(targets)}
    outs: list = [None] * len(targets)
    blocks = []
    for block in func.body.blocks:
        extra = []
        for binding in block.bindings:
            i = wanted.get(binding.var)
            if i is not None and outs[i] is None:
                out = relax.Var(f"probe_{i}", binding.var.ty)
                extra.append(relax.VarBinding(out, binding.var))
                outs[i] = out
        kind = relax.DataflowBlock if isinstance(block, relax.DataflowBlock) else relax.BindingBlock
        blocks.append(kind(list(block.bindings) + extra))
    missing = [str(targets[i]) for i, o in enumerate(outs) if o is None]
    if missing:
        raise MoecError(f"probe: {', '.join(missing)} not bound in the function")
    body = relax.SeqExpr(blocks, relax.Tuple(outs))
    new = relax.Function(func.params, body, ret_ty=relax.TupleType([o.ty for o in outs]), is_pure=func.is_pure,
                         attrs=func.attrs)
    for bound in ("tir_var_upper_bound", "tir_var_lower_bound"):
        # an export's (batch, seq) maxima would make memory planning reserve the largest possible buffers
        if func.attrs is not None and bound in func.attrs:
            new = new.without_attr(bound)
    mod = relax.transform.Normalize()(tvm.IRModule({"main": new}))
    return relax.transform.DeadCodeElimination(["main"])(mod)


def probe(func: relax.Function, targets: list, num_threads: int | None = None):
    """Compile ``probe_function(func, targets)`` for the CPU; returns ``run(inputs, weights) -> [np.ndarray]``."""
    from ..passes.legalize_topk import legalize_topk

    mod = relax.transform.LegalizeOps({"relax.topk": legalize_topk})(probe_function(func, targets))
    target = {"kind": "llvm"} if num_threads is None else {"kind": "llvm", "num-cores": int(num_threads)}
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target(target)), tvm.cpu())
    device_weights: list = []

    def run(inputs: list[np.ndarray], weights: list[np.ndarray]) -> list[np.ndarray]:
        if not device_weights:
            device_weights.extend(tvm.runtime.tensor(np.ascontiguousarray(w)) for w in weights)
        res = vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in inputs], *device_weights)
        return [res[i].numpy() for i in range(len(targets))]

    return run


__all__ = ["probe", "probe_function"]
