"""The "moec" compilation pipeline: one flat list of passes, split into phases.

Phase 1 turns the user's single forward into decode-ready entry points over a paged KV cache
(TVM's paged cache of bf16/fp16/fp32 elements, or moec's tiered FP8 + 2-bit cache);
phase 2 lowers operators to TIR and fuses them; phase 3 schedules TIR for the target (dlight rules
from ``schedules.rules``); phase 4 lowers to the VM. ``debug_dump`` writes the IR after each phase.
"""

from __future__ import annotations

from pathlib import Path

import tvm
from tvm import relax

from ..compiler.errors import MoecError
from ..schedules.rules import schedule_pass
from .cascade_gating import CascadeGating
from .cuda_graph import GraphBounds, PrepareDecodeGraph, RewriteDecodeGraph
from .device_sampling import ENTRY as ARGMAX, AddGreedySampler
from .fuse_router_norm import FuseRouterIntoNorm, FuseTopKIntoRouterNorm
from .legalize_topk import FuseSoftmaxTopK, legalize_topk
from .output_views import ViewOutputReshape
from .paged_kv_attention import InsertPagedKVAttention
from .simplify_layout import SimplifyLayout
from .simplify_power import SimplifyPower
from .tiered_kv_attention import InsertTieredKVAttention, TieredOptions


def _dump(directory: Path | None, name: str):
    @tvm.transform.module_pass(opt_level=0, name=f"Dump[{name}]")
    def _pass(mod, _ctx):
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / f"{name}.py").write_text(mod.script(show_meta=False))
        return mod

    return _pass


def _record_graph(rewrite):
    """Keep the final kernel split of ``decode_graph`` (``cuda_graph.graph_summary``) on the rewrite pass."""

    @tvm.transform.module_pass(opt_level=0, name="RecordDecodeGraph")
    def _pass(mod, _ctx):
        rewrite.record(mod)
        return mod

    return _pass


def fusion_passes(entries: list[str]) -> list:
    """Phase 2 alone (lower to TIR and fuse); tuning runs it on entries with static token/batch sizes."""
    return [
        # reshape chains between kernels ([T, D] -> [1, T, D] -> [T, D]) merged, identities dropped: each is a VM
        # call on the host at every step
        relax.transform.RemoveRedundantReshape(),
        relax.transform.LegalizeOps({"relax.topk": legalize_topk}),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(entries),
    ]


def _lowering(target: tvm.target.Target, entries: list[str], dump: Path | None, schedules=None, graph=None) -> list:
    """Phases 2-4: what every entry function goes through once phase 1 has built it.

    ``graph`` (a ``(PrepareDecodeGraph, RewriteDecodeGraph)`` pair, or None) adds the ``decode_graph`` entry:
    a copy of ``decode`` whose kernel launches run as CUDA graphs (``passes/cuda_graph.py``).
    """
    prepare, rewrite = graph if graph is not None else (None, None)
    return [
        # Phase 2. Lower to TIR and fuse.
        *fusion_passes(entries),
        _dump(dump, "phase2_fused"),
        # Phase 3. Schedules for the target (tuned records first when given, then the dlight rules).
        schedules if schedules is not None else schedule_pass(target),
        _dump(dump, "phase3_scheduled"),
        # Phase 4. Lower to the VM (with CUDA graphs: decode_graph, statically planned, then its regions lifted).
        *([prepare] if prepare is not None else []),
        relax.transform.RewriteDataflowReshape(),
        ViewOutputReshape(),  # (the entries' last reshape, which the pass above leaves: the logits' copy)
        relax.transform.ToNonDataflow(),
        relax.transform.RemovePurityChecking(),
        relax.transform.CallTIRRewrite(),
        relax.transform.StaticPlanBlockMemory(),
        *([rewrite] if rewrite is not None else []),
        relax.transform.LowerAllocTensor(),
        relax.transform.KillAfterLastUse(),
        relax.transform.LowerRuntimeBuiltin(),
        relax.transform.ComputePrimValue(),
        relax.transform.VMShapeLower(),
        relax.transform.AttachGlobalSymbol(),
        *([_record_graph(rewrite)] if rewrite is not None else []),
        _dump(dump, "phase4_vm"),
    ]


def lowering_pipeline(target: tvm.target.Target, entries: list[str]) -> tvm.transform.Pass:
    """Phases 2-4 of the "moec" pipeline alone, for a module whose entry functions are already built
    (e.g. a kernel benchmark compiling norm + router exactly as a model's entries get compiled)."""
    seq = tvm.transform.Sequential(_lowering(target, list(entries), None), name="moec-lowering")

    @tvm.transform.module_pass(opt_level=0, name="moec-lowering")
    def _pipeline(mod, _ctx):
        with target:
            return seq(mod)

    return _pipeline


def moec_pipeline(num_inputs: int, target: tvm.target.Target, source: str = "model", debug_dump: str | Path | None = None,
                  kv_dtype: str | None = None, tiered: TieredOptions | None = None, cascade: CascadeGating | None = None,
                  fuse_router_norm: FuseRouterIntoNorm | None = None, tuning=None, phases: int = 4,
                  grouped_experts=None, dense_gemm=None, cuda_graph: GraphBounds | None = None, rms_norm=None,
                  combine_norm=None, rope_norm=None):
    """Build the pipeline; returns ``(pass, insert_pass)`` so callers can read the recognised structure.

    ``tuning`` (a ``schedules.database.TunedSchedules``) sees the phase-1 module and applies its
    database's records in phase 3; the phase-3 pass is ``pass.schedules`` (its ``sources`` name each
    kernel's schedule). ``phases=1`` stops after phase 1 (``moec tune`` takes its tasks from there).

    ``tiered`` selects the tiered FP8 + 2-bit cache (``InsertTieredKVAttention``) instead of the paged
    cache of ``kv_dtype`` elements (``InsertPagedKVAttention``). ``cascade`` (off by default), a
    configured ``CascadeGating`` pass, rewrites the routers of ``main`` before the entries are built.
    ``fuse_router_norm`` (a ``FuseRouterIntoNorm`` pass, or None for unfused) then fuses each router
    matmul (the coarse one after cascade gating) with its RMSNorm in the entries (and, after ``FuseSoftmaxTopK``, the
    softmax top-k reading its logits: ``FuseTopKIntoRouterNorm``), and ``rms_norm`` (an
    ``InsertRMSNorm`` pass, or None) makes each remaining RMSNorm one kernel; ``rope_norm`` (a ``FuseRoPEIntoNorm``
    pass, or None) computes the rotary embedding after Q- and K-norms in their kernel.
    ``grouped_experts`` (an ``InsertGroupedExperts`` pass, or None) then replaces each recognised routed-expert
    computation of the entries with the grouped expert GEMM kernels, ``combine_norm`` (a ``FuseCombineIntoNorm``
    pass, or None) computes each of their combines in the residual add + RMSNorm kernel after it, and ``dense_gemm`` (an
    ``InsertDenseGEMM`` pass, or None) each linear layer against a transposed 16-bit weight with ``dense_gemm``.
    ``cuda_graph`` (``GraphBounds``, CUDA only) adds ``decode_graph``, the decode step as CUDA graphs for steps
    within those bounds (``passes/cuda_graph.py``); None leaves the module as without it.
    """
    dump = Path(debug_dump) if debug_dump else None
    if tiered is not None:
        insert = InsertTieredKVAttention(num_inputs, target, tiered, source)
        entries = ["prefill", "decode", ARGMAX] + (["rerank"] if tiered.mode == "tiered" else [])
    else:
        insert = InsertPagedKVAttention(num_inputs, target, source, kv_dtype)
        entries = ["prefill", "decode", ARGMAX, "create_kv_cache"]
    topk = FuseSoftmaxTopK(target, source)
    passes = [
        # Phase 1. Decode-ready entry points (attention -> paged KV cache); optional cascade routers first,
        # optional norm + router fusion in the entries last.
        *([cascade] if cascade is not None else []),
        insert,
        SimplifyPower(),
        SimplifyLayout(),
        *([fuse_router_norm] if fuse_router_norm is not None else []),
        *([rms_norm] if rms_norm is not None else []),
        *([rope_norm] if rope_norm is not None else []),
        *([grouped_experts] if grouped_experts is not None else []),
        *([combine_norm] if combine_norm is not None else []),
        *([dense_gemm] if dense_gemm is not None else []),
        topk,
        *([FuseTopKIntoRouterNorm(fuse_router_norm, topk, target, source)] if fuse_router_norm is not None else []),
        AddGreedySampler(target, source),
        relax.transform.DeadCodeElimination(entries),
        _dump(dump, "phase1_entries"),
        *([tuning.capture(entries)] if tuning is not None else []),
    ]
    schedules = schedule_pass(target, tuning)
    graph = None
    if cuda_graph is not None:
        if target.kind.name != "cuda":
            raise MoecError(f"{source}: CUDA graphs need --target cuda (got {target.kind.name})")
        pages = (tiered.t1_page, tiered.t2_page) if tiered is not None else None
        graph = (PrepareDecodeGraph(cuda_graph, pages, source), RewriteDecodeGraph(tiered is not None))
    if phases > 1:
        passes += _lowering(target, entries, dump, schedules, graph)
    seq = tvm.transform.Sequential(passes, name="moec")

    @tvm.transform.module_pass(opt_level=0, name="moec")
    def _pipeline(mod, _ctx):
        with target:
            return seq(mod)

    _pipeline.schedules = schedules
    _pipeline.entries = entries
    _pipeline.graph = graph[1] if graph is not None else None  # its .summary once the pipeline ran
    return _pipeline, insert
