"""Schedule rules per target kind (a registry, not an if-chain).

GPU targets get dlight rules. ``dlight.gpu.Matmul`` is left out: in this TVM release it crashes
(Tensorize) on fp16 matmuls for sm_90; GEMV/Reduction/GeneralReduction/Fallback cover decode shapes.
CPU (llvm) kernels use TVM's default CPU lowering.
"""

from __future__ import annotations

import tvm


def _guarded(rule):
    """A rule that declines (returns None) where the wrapped dlight rule raises, so the next rule applies.

    dlight rules assume shapes they do not always check (e.g. GEMV on a matrix-vector product with a
    single output row fails in ``fuse``); one such kernel must not fail the whole build.
    """
    from tvm.s_tir.dlight.base import ScheduleRule

    class Guarded(ScheduleRule):
        def apply(self, func, target, tunable):
            try:
                return rule.apply(func, target, tunable)
            except Exception:  # noqa: BLE001 - any failure means "this rule does not apply"
                return None

        def __repr__(self) -> str:
            return f"Guarded({type(rule).__name__})"

    return Guarded()


def _gpu_rules():
    from tvm.s_tir import dlight as dl

    return [_guarded(r) for r in (dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction())] + [dl.gpu.Fallback()]


SCHEDULE_RULES = {
    "cuda": _gpu_rules,
    "llvm": lambda: [],
}


def schedule_pass(target: tvm.target.Target) -> tvm.transform.Pass:
    kind = target.kind.name
    if kind not in SCHEDULE_RULES:
        raise ValueError(f"no schedule rules for target kind {kind!r}; known: {sorted(SCHEDULE_RULES)}")
    rules = SCHEDULE_RULES[kind]()
    if not rules:
        return tvm.transform.Sequential([], name="NoSchedule")
    from tvm.s_tir import dlight as dl

    inner = dl.ApplyDefaultSchedule(*rules)

    @tvm.transform.module_pass(opt_level=0, name="ApplySchedules")
    def _apply(mod, _ctx):
        with target:
            return inner(mod)

    return _apply
