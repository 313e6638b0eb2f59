"""Schedule rules per target kind (a registry, not an if-chain).

GPU targets get dlight rules. ``dlight.gpu.Matmul`` is left out: in this TVM release it crashes
(Tensorize) on fp16 matmuls for sm_90; GEMV/Reduction/GeneralReduction/Fallback cover decode shapes.
CPU (llvm) kernels use TVM's default CPU lowering.
"""

from __future__ import annotations

import re

import tvm
from tvm import s_tir, tirx


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

    guarded = Guarded()
    guarded.rule = rule  # the schedule report names the wrapped rule
    return guarded


def _gpu_rules():
    from tvm.s_tir import dlight as dl

    return [_guarded(r) for r in (dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction())] + [dl.gpu.Fallback()]


SCHEDULE_RULES = {
    "cuda": _gpu_rules,
    "llvm": lambda: [],
}

# Hand-written kernels, by the name their pass gives the PrimFunc (a numeric suffix may follow), and the
# file that writes them. TVM's own paged-KV-cache kernels (relax.frontend.nn.llm) come with a global symbol.
HAND_KERNELS = {
    "norm_router": "schedules/kernels/norm_router.py",
    "rms_norm": "schedules/kernels/rms_norm.py",  # from passes/rms_norm.py
    "tiered_append": "schedules/kernels/tiered_append.py",
    "tiered_attention": "schedules/kernels/tiered_attention.py",
    "tiered_mass": "schedules/kernels/tiered_attention.py",
    "tiered_decode": "schedules/kernels/tiered_decode.py",
    "tiered_rerank": "schedules/kernels/tiered_rerank.py",
    "topk_select": "passes/legalize_topk.py",
    "topk_softmax": "passes/legalize_topk.py",  # FuseSoftmaxTopK
    "moe": "schedules/kernels/grouped_experts.py",  # moe_<kernel> from passes/grouped_experts.py
    "dense_gemm": "schedules/kernels/dense_gemm.py",  # from passes/dense_gemm.py
    "argmax_rows": "schedules/kernels/sampling.py",  # from passes/device_sampling.py
}
TVM_KV_KERNELS = "tvm.relax.frontend.nn.llm (paged KV cache kernels)"
FALLBACK_RULES = ("Fallback",)  # rules that only make a kernel run (one thread per element), not fast


def is_scheduled(func) -> bool:
    return isinstance(func, tirx.PrimFunc) and func.attrs is not None and bool(func.attrs.get("tirx.is_scheduled", False))


def hand_kernel_source(name: str, func) -> str | None:
    """``kernel:<file>`` for a hand-written kernel, None for a PrimFunc that rules or tuning schedule."""
    base = re.sub(r"\d+$", "", name)
    for prefix, path in HAND_KERNELS.items():
        if base == prefix or base.startswith(prefix + "_"):
            return f"kernel:{path}"
    if func.attrs is not None and func.attrs.get("global_symbol") is not None:
        return f"kernel:{TVM_KV_KERNELS}"
    if is_scheduled(func):
        return "kernel:(hand-scheduled, tirx.is_scheduled; not in schedules.rules.HAND_KERNELS)"
    return None


def _injective(func) -> bool:
    """Every block of ``func`` iterates spatially only (no reduction axis): elementwise, gather, reshape."""
    from tvm.s_tir.dlight.analysis import normalize_prim_func

    try:
        blocks = normalize_prim_func(s_tir.Schedule(func))
    except Exception:  # noqa: BLE001 - unanalysable: not known to be injective
        return False
    return blocks is not None and all(b.is_injective() for b in blocks)


def rule_source(rule, func=None) -> str:
    """``dlight:<Rule>``; dlight's catch-all on a reduction or matmul is ``fallback:dlight.gpu.Fallback``.

    On an elementwise/injective kernel Fallback is dlight's schedule for it (one thread per output
    element, coalesced): no other rule applies to those, so it is reported as a rule, not a fallback.
    """
    name = type(getattr(rule, "rule", rule)).__name__
    if name not in FALLBACK_RULES:
        return f"dlight:{name}"
    if func is not None and _injective(func):
        return f"dlight:{name} (injective)"
    return f"fallback:dlight.gpu.{name}"


@tvm.transform.module_pass(opt_level=0, name="ApplySchedules")
class ApplySchedules:
    """Phase 3: tuned records (``tuning``, a ``schedules.apply.TunedSchedules``), then the target's rules.

    After the pass ``sources`` maps every PrimFunc to where its schedule came from: ``kernel:<file>``
    (hand-written), ``tuning-db:...`` (MetaSchedule records), ``dlight:<Rule>``, ``fallback:<Rule>``
    (dlight's catch-all on a reduction or matmul: it runs, slowly) or ``default:llvm`` (TVM's default
    CPU lowering: llvm has no rules). A dynamic kernel with tuned twins reads
    ``tuning-db (token/batch 1,16) else <its rule>``.
    """

    def __init__(self, target: tvm.target.Target, tuning=None):
        kind = target.kind.name
        if kind not in SCHEDULE_RULES:
            raise ValueError(f"no schedule rules for target kind {kind!r}; known: {sorted(SCHEDULE_RULES)}")
        self.target = target
        self.rules = SCHEDULE_RULES[kind]()
        self.tuning = tuning
        self.sources: dict[str, str] = {}

    def transform_module(self, mod, _ctx):
        with self.target:
            if self.tuning is not None:
                mod = self.tuning.add_tuned(mod, self.target)
            sources = dict(self.tuning.sources) if self.tuning is not None else {}
            updated = {}
            for gv, func in mod.functions_items():
                if not isinstance(func, tirx.PrimFunc) or gv.name_hint in sources:
                    continue
                hand = hand_kernel_source(gv.name_hint, func)
                if is_scheduled(func):
                    sources[gv.name_hint] = hand
                    continue
                # hand-written TIR without a schedule of its own (TVM's CPU KV-cache kernels) gets the rules too
                sources[gv.name_hint] = hand or ("default:llvm" if not self.rules else "unscheduled")
                for rule in self.rules:
                    space = rule.apply(func, self.target, False)
                    if space is None:
                        continue
                    sch = space if isinstance(space, s_tir.Schedule) else space[0]
                    updated[gv] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
                    sources[gv.name_hint] = rule_source(rule, func) + (f" on {hand}" if hand else "")
                    break
            for gv, func in updated.items():
                mod[gv] = func
            if self.tuning is not None:
                mod = self.tuning.dispatch(mod)
                for name, buckets in self.tuning.dispatched.items():
                    if name in sources and not sources[name].startswith("tuning-db"):
                        sources[name] = f"tuning-db (token/batch {','.join(map(str, buckets))}) else {sources[name]}"
        present = {gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}
        self.sources = dict(sorted((k, v) for k, v in sources.items() if k in present))  # dispatch drops dead reshapes
        return mod


def schedule_pass(target: tvm.target.Target, tuning=None) -> tvm.transform.Pass:
    """The phase-3 pass for ``target``; its ``sources`` say how each PrimFunc got scheduled."""
    return ApplySchedules(target, tuning)


def source_kind(source: str) -> str:
    """kernel, tuning-db, dlight, fallback or default (the part before the first colon or space)."""
    return re.split(r"[: ]", source, maxsplit=1)[0]


def format_schedule_report(sources: dict[str, str]) -> str:
    """One line per kernel (PrimFunc) with its schedule source, then the count of each kind."""
    width = min(max((len(k) for k in sources), default=6), 64)
    lines = [f"{'kernel':<{width}}  schedule"]
    for name, src in sorted(sources.items()):
        shown = name if len(name) <= width else name[: width - 3] + "..."
        lines.append(f"{shown:<{width}}  {src}")
    counts: dict[str, int] = {}
    for src in sources.values():
        counts[source_kind(src)] = counts.get(source_kind(src), 0) + 1
    lines.append(f"{len(sources)} kernels: " + ", ".join(f"{counts[k]} {k}" for k in sorted(counts)))
    fallback = sorted(k for k, v in sources.items() if source_kind(v) == "fallback")
    if fallback:
        lines.append(f"on dlight's fallback schedule (a matmul/reduction no rule took): {', '.join(fallback)}")
    return "\n".join(lines)
