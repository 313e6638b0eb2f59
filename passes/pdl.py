"""Programmatic dependent launch (PDL) for every CUDA kernel of a build (sm_90 and later; ``--pdl``).

A decode step is a chain of a few hundred kernels on one stream; between two of them the GPU drains
the first grid, flushes its writes and only then starts dispatching the next grid's blocks. With PDL
the next kernel is launched while the previous one still runs: its blocks are dispatched to SMs as
the previous grid's blocks have all started, and they wait in ``griddepcontrol.wait`` until that
grid has completed and its writes are visible. The dispatch and the blocks' start-up overlap the
previous kernel instead of following it (inside a CUDA graph as well: the capture records the launch
attribute as a programmatic edge).

``ProgrammaticDependentLaunch`` is a TIR module pass that runs after TVM's lowering has split the
device kernels from the host code (``tir_pipeline``). Guarantees after, for every device kernel
(a PrimFunc with ``tirx.kernel_launch_params``):

- its body starts with ``griddepcontrol.wait`` and then ``griddepcontrol.launch_dependents``: nothing
  of the kernel reads or writes memory before the grid it depends on has completed (so a kernel
  reading what the kernel two launches back wrote is safe too: its predecessor completed after
  that one), and its successor may be launched once all of its blocks have passed that point;
- its launch parameters carry ``tirx.use_programtic_dependent_launch`` (TVM's spelling), before
  ``tirx.use_dyn_shared_memory`` where that is present (it must stay last), so that TVM's CUDA
  runtime launches it with ``cuLaunchKernelEx`` and the programmatic stream serialization attribute.

A kernel following a copy or a host operation waits as without PDL (``griddepcontrol.wait`` returns at
once when there is no programmatic dependency). Host functions are unchanged.
"""

from __future__ import annotations

import tvm
from tvm import tirx

from ..compiler.errors import MoecError

PIPELINE = "moec_pdl"  # the TIR pipeline name tvm.compile takes (registered by ``tir_pipeline``)
LAUNCH_TAG = "tirx.use_programtic_dependent_launch"  # (sic: TVM's runtime reads this spelling)
_DYN_SHARED = "tirx.use_dyn_shared_memory"
_PARAMS = "tirx.kernel_launch_params"
MIN_ARCH = 90  # griddepcontrol needs sm_90


def _griddepcontrol(action: str) -> tirx.Stmt:
    """``griddepcontrol.<action>;`` as TVM's PTX dialect writes it (``T.ptx.griddepcontrol.<action>()``)."""
    return tirx.Evaluate(tirx.call_intrin("void", "tirx.ptx.griddepcontrol", action, ""))


def is_pdl_kernel(func) -> bool:
    """Whether ``func`` (a lowered device kernel) is launched with PDL and waits first (both, as the pass leaves it)."""
    params = func.attrs.get(_PARAMS) if isinstance(func, tirx.PrimFunc) and func.attrs is not None else None
    if params is None or LAUNCH_TAG not in [str(p) for p in params]:
        return False
    body = func.body
    first = body.seq[:2] if isinstance(body, tirx.SeqStmt) else []
    return len(first) == 2 and all(isinstance(s, tirx.Evaluate) and isinstance(s.value, tvm.ir.expr.Call)
                                   and s.value.op.name == "tirx.ptx.griddepcontrol" and s.value.args[0].value == a
                                   for s, a in zip(first, ("wait", "launch_dependents")))


@tvm.transform.module_pass(opt_level=0, name="ProgrammaticDependentLaunch")
class ProgrammaticDependentLaunch:
    """Every device kernel waits on its predecessor grid first and is launched with PDL (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out = mod
        for gv, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc) or func.attrs is None or func.attrs.get(_PARAMS) is None:
                continue
            params = [str(p) for p in func.attrs[_PARAMS]]
            if LAUNCH_TAG in params:
                continue
            at = params.index(_DYN_SHARED) if _DYN_SHARED in params else len(params)
            params.insert(at, LAUNCH_TAG)
            body = tirx.SeqStmt([_griddepcontrol("wait"), _griddepcontrol("launch_dependents"), func.body])
            out[gv] = func.with_body(body).with_attr(_PARAMS, params)
        return out


def _arch_number(target: tvm.target.Target) -> int:
    arch = str(target.attrs.get("arch", "")) if target.attrs is not None else ""
    digits = "".join(c for c in arch.removeprefix("sm_") if c.isdigit())
    return int(digits) if digits else 0


# why --pdl is refused with TVM's paged KV cache (the "paged" and "bf16" caches)
PAGED_REASON = ("with programmatic dependent launch TVM's paged KV cache gave other greedy tokens than without it on "
                "an H100 (one stream of four from its 10th decode step: bench/results/gpu_tests_h100_a0d4c1c.json); "
                "use --kv-cache fp8 or tiered with --pdl, or drop --pdl")


def tir_pipeline(target: tvm.target.Target) -> str:
    """The name of the TIR pipeline (TVM's default, then ``ProgrammaticDependentLaunch``) for ``tvm.compile``'s
    ``tir_pipeline``, registered on first use. Refuses targets other than CUDA sm_90 and later."""
    if target.kind.name != "cuda" or _arch_number(target) < MIN_ARCH:
        arch = target.attrs.get("arch") if target.kind.name == "cuda" and target.attrs is not None else None
        raise MoecError(f"--pdl needs a CUDA target of sm_{MIN_ARCH} or later (got {target.kind.name}"
                        f"{' ' + str(arch) if arch else ''}): griddepcontrol is a Hopper instruction")
    from tvm.tirx import compilation_pipeline as cp

    if PIPELINE not in cp.PIPELINE_MAP:
        def factory():
            lower, finalize_host, finalize_device = cp.get_tir_pipeline("default")
            return tvm.transform.Sequential([lower, ProgrammaticDependentLaunch()], name=PIPELINE), finalize_host, finalize_device

        cp.register_tir_pipeline(PIPELINE, factory)
    return PIPELINE


__all__ = ["LAUNCH_TAG", "PIPELINE", "ProgrammaticDependentLaunch", "is_pdl_kernel", "tir_pipeline"]
