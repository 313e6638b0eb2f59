"""``moec.compile``: model -> Relax -> the "moec" pipeline -> artifact directory."""

from __future__ import annotations

import hashlib
import platform
import time
from pathlib import Path

import numpy as np
import tvm

from .. import __version__
from .artifact import LIBRARY, OFFLOADED_PREFIX, PREFETCH_PREFIX, WEIGHTS, atomic_directory, write_manifest
from .errors import MoecError
from .importers import ImportedModel, import_model
from .targets import make_target


def _cuda_modules(mod) -> list:
    found = [mod] if mod.kind == "cuda" else []
    for sub in mod.imports:
        found += _cuda_modules(sub)
    return found


def nvcc_arch(arch: str):
    """nvcc's architecture arguments for ``sm_XX`` / ``sm_XXa``. An architecture-specific target (``sm_90a``: wgmma) is
    one explicit code generation: ``-arch sm_90a`` alone also asks for compute_90 PTX, which ptxas refuses for the
    instructions only sm_90a has."""
    if arch.endswith("a"):
        v = arch[3:]
        return ["-gencode", f"arch=compute_{v},code=sm_{v}"]
    return arch


def _compile_cuda_kernels(executable, target, out_dir: Path, progress: bool) -> list[dict]:
    """Compile every CUDA device module's source to an sm_XX fatbin with nvcc, ahead of time.

    TVM keeps CUDA device code as source and compiles it when the library is loaded (NVRTC through
    the compiler's Python side). The runtime instead hands the loader these fatbins, matched by the
    SHA-256 of the source, so loading compiles nothing.
    """
    from tvm.support import nvcc

    arch = target.arch
    kernels = []
    for i, mod in enumerate(_cuda_modules(executable.mod)):
        source = mod.inspect_source("cuda")
        t = time.perf_counter()
        with target:
            fatbin = nvcc.compile_cuda(source, target_format="fatbin", arch=nvcc_arch(arch), compiler="nvcc")
        name = f"cuda_kernels_{i}.fatbin"
        (out_dir / name).write_bytes(bytes(fatbin))
        kernels.append({"file": name, "arch": arch, "source_sha256": hashlib.sha256(source.encode()).hexdigest()})
        _log(progress, f"nvcc: {name} ({len(fatbin) / 1e6:.1f} MB, {arch}) in {time.perf_counter() - t:.1f}s")
    if not kernels:
        raise MoecError("CUDA build produced no device module")
    return kernels


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[moec] {msg}", flush=True)


def compile(  # noqa: A001 - the public name users call
    model,
    output_dir: str | Path,
    target: str = "llvm",
    arch: str | None = None,
    example_inputs=None,
    debug_dump: str | Path | None = None,
    progress: bool = False,
    kv_cache_dtype: str | None = None,
    kv_cache: str = "paged",
    tiered_options=None,
    cascade_groups: int | None = None,
    cascade_keep: int | None = None,
    fuse_router_norm: bool = True,
    calibration: str | Path | None = None,
    grouped_experts: bool = True,
    expert_weights: str | None = None,
    tuning_db: str | Path | None = "auto",
    dense_gemm: bool = True,
    rms_norm: bool = True,
    cuda_graph="auto",
    expert_slots: int | None = None,
    gpu_memory_budget: int | None = None,
    prefill_gemm: str = "auto",
    pdl: bool = False,
    fp8_compute: str | None = None,
    _until_phase1: bool = False,
) -> Path:
    """Compile an MoE model into an artifact directory.

    Parameters
    ----------
    model : str | Path | torch.nn.Module | torch.export.ExportedProgram | ImportedModel
        An ONNX file, a ``.pt2`` file, a module (exported with dynamic batch/sequence axes) or a program.
    output_dir : str | Path
        The artifact directory; written atomically (nothing is left behind on failure).
    target : {"llvm", "cuda"}
    arch : str, optional
        CUDA architecture (``sm_90`` by default for cuda).
    debug_dump : str | Path, optional
        Write the IR after each pipeline phase into this directory.
    kv_cache_dtype : {"float32", "float16", "bfloat16"}, optional
        Element type of the paged KV cache (default: the model's dtype).
    kv_cache : {"paged", "bf16", "fp8", "tiered"}
        "paged": TVM's paged cache of ``kv_cache_dtype`` elements; "bf16": the same with bfloat16;
        "tiered": moec's FP8 + 2-bit tiered cache (importance re-rank every N steps); "fp8": that
        cache with every token in FP8 (no re-rank).
    tiered_options : moec.passes.tiered_kv_attention.TieredOptions, optional
        Pages, sink, recent window, tier-1 fraction and re-rank interval of the tiered cache.
    cascade_groups : int, optional
        Cascade gating (``moec.passes.cascade_gating``): split each MoE layer's experts into this many
        equal groups (data-free grouping of the router rows), route each token to its best groups with a
        coarse router, then score only those groups' experts. Off when not given.
    cascade_keep : int, optional
        Groups kept per token, 1..cascade_groups (default: the calibration's ``keep_default`` for G, a
        group-limited router's own ``topk_group``, else all of them); equal to ``cascade_groups`` it
        reproduces the original routing.
    calibration : str | Path, optional
        A ``moec calibrate`` directory: cascade gating takes its groups and coarse routers (fitted on
        data) for G = ``cascade_groups`` instead of the data-free ones, and offloaded experts its fitted
        prefetch predictors (stored in the artifact; the runtime's prefetch uses them in place of the next
        router applied to the previous layer's input). It must have been made for this model (same layers,
        experts and router weights) and, with cascade gating, for G; the artifact records it.
    fuse_router_norm : bool
        Compute each router matmul (the coarse group router with cascade gating) in one kernel with the
        RMSNorm before it (``moec.passes.fuse_router_norm``): one launch instead of the norm's and the
        matmul's, the same results up to float rounding. On by default.
    grouped_experts : bool
        Run the routed experts as grouped expert GEMMs (``moec.passes.grouped_experts``): tokens sorted
        by expert, each active expert's weights read once for all of its tokens (instead of the export's
        per-(token, slot) gathers), SwiGLU fused. On by default; expert forms it does not recognise stay
        as imported and the manifest says why.
    expert_weights : {None, "bf16", "fp8"}
        Storage of the grouped experts' weights: the model's dtype (default), bfloat16, or FP8 e4m3 with one
        float32 scale per output channel (half the bytes of bf16; weights quantized at compile time).
        Needs ``grouped_experts``.
    fp8_compute : {None, "bfloat16", "float16"}
        CUDA, ``expert_weights="fp8"`` on a bfloat16 model: the expert GEMMs' tensor-core operand type (float16: the
        layer input cast to float16, FP8 pairs widened by one instruction; see ``moec.passes.grouped_experts``).
        None: the pass's default.
    dense_gemm : bool
        Run the linear layers (matmuls against a transposed bf16/fp16 weight: attention projections, LM head)
        as ``dense_gemm`` kernels (``moec.passes.dense_gemm``; tensor cores on CUDA) that read the weight in its
        stored layout, instead of transposing it on every call. On by default.
    prefill_gemm : {"auto", "streamed", "tiled"}
        CUDA: the prefill entry's dense projections and expert GEMMs. "streamed": the decode kernels' forms, each
        warp streaming weight rows against 64-token passes (the expert GEMMs a block per pass); "tiled": block-tiled
        kernels, 128 tokens x 128 rows a block with both operands staged in shared memory
        (``InsertDenseGEMM(prefill_tiled=True)``, ``InsertGroupedExperts(prefill_tiled=True)``), where the shapes
        allow; "auto" (default): the dense projections tiled, the expert GEMMs streamed, the faster of each on the
        H100 at 2048-token chunks (bench/results/dense_gemm_tiled_h100_0a49c75.json: OLMoE's 2048 x 2048 projection
        76 against 109 us, Mixtral's 4096 x 4096 261 against 399; grouped_experts_ge4_h100_0a49c75.json: OLMoE's
        expert GEMMs 1.28 ms streamed against 1.35 tiled). Decode keeps its kernels either way.
    rms_norm : bool
        Run every RMSNorm not fused with a router (attention input norms, QK-norms, the final norm) as one
        ``rms_norm`` kernel (``moec.passes.rms_norm``): one pass over the row instead of the three kernels
        TVM's fusion leaves. On by default. With ``grouped_experts`` too, each MoE layer's combine (its tokens'
        expert outputs summed) is computed in the residual add + RMSNorm kernel after it
        (``moec.passes.fuse_combine_norm``): one launch a layer less, the same values.
    tuning_db : "auto" | "none" | str | Path
        MetaSchedule records from ``moec tune`` (``moec.schedules.database``): "auto" uses the target's
        default database (``~/.cache/moec/tuning/<target-key>/``) if it exists, a path that directory
        (refused when tuned for another target), "none" only the rules. Kernels with records at a
        token/batch bucket run tuned at that size; all others keep the dlight rules. The manifest's
        ``tuning`` says which database and how many kernels, ``schedules`` each kernel's source.
    expert_slots : int, optional
        Offloaded experts: the routed experts' weights stay in host memory and the device holds a pool of this
        many expert slots (at least one layer's experts), filled on demand by the runtime as each layer's router
        chooses (least recently used slots are reused). For models whose experts do not fit in device memory.
    gpu_memory_budget : int, optional
        Bytes of device memory for the model's weights: when they do not all fit, the experts are offloaded
        (as ``expert_slots``) into as many slots as the budget leaves after the weights that stay on the device
        (attention, norms, routers, embeddings). The KV cache is not counted.
    cuda_graph : "auto" | bool | moec.passes.cuda_graph.GraphBounds
        CUDA only: also build ``decode_graph``, the decode step with its kernel launches captured and
        replayed as CUDA graphs (``moec.passes.cuda_graph``), for steps of at most ``max_batch`` streams
        of at most ``max_context`` tokens (``True``: ``GraphBounds()``, 128 and 4096). Its intermediates
        get memory planned for those bounds, held while the engine lives. The engine uses it for the
        steps within the bounds (``moec.load(..., cuda_graph=False)`` turns it off) and the plain
        ``decode`` for the rest. "auto" (default): ``GraphBounds()`` for the CUDA target unless the experts
        are offloaded (``expert_slots`` or ``gpu_memory_budget``: the runtime's residency calls between the
        kernels cannot be replayed), otherwise off.
    pdl : bool
        CUDA sm_90 and later: launch every kernel with programmatic dependent launch (``moec.passes.pdl``): each
        kernel waits for the previous grid in its first instruction, so the next grid's launch and block dispatch
        overlap the kernel before it (in the CUDA graphs too). Off by default: slower at the headline point on the
        H100 (9.59 against 9.29 ms); refused with the paged caches ("paged", "bf16": ``moec.passes.pdl.PAGED_REASON``).

    Returns
    -------
    Path of the artifact directory.
    """
    from ..passes.pipeline import moec_pipeline

    tgt = make_target(target, arch)
    tuning = None
    if not _until_phase1:
        from ..schedules.database import TunedSchedules, resolve_tuning_db

        db_dir = resolve_tuning_db(tuning_db, tgt)
        tuning = TunedSchedules(db_dir, tgt) if db_dir is not None else None
    if not isinstance(fuse_router_norm, bool):
        raise MoecError(f"fuse_router_norm must be True or False, got {fuse_router_norm!r}")
    if not isinstance(grouped_experts, bool):
        raise MoecError(f"grouped_experts must be True or False, got {grouped_experts!r}")
    if not isinstance(dense_gemm, bool):
        raise MoecError(f"dense_gemm must be True or False, got {dense_gemm!r}")
    if not isinstance(rms_norm, bool):
        raise MoecError(f"rms_norm must be True or False, got {rms_norm!r}")
    if expert_weights not in (None, "bf16", "fp8"):
        raise MoecError(f"expert weights must be bf16 or fp8, got {expert_weights!r}")
    if prefill_gemm not in ("auto", "streamed", "tiled"):
        raise MoecError(f"prefill GEMMs must be 'auto', 'streamed' or 'tiled', got {prefill_gemm!r}")
    if expert_weights is not None and not grouped_experts:
        raise MoecError("--expert-weights needs the grouped experts (drop --no-grouped-experts)")
    if not isinstance(pdl, bool):
        raise MoecError(f"pdl must be True or False, got {pdl!r}")
    tir_pipeline = "default"
    if pdl:
        from ..passes.pdl import tir_pipeline as pdl_pipeline

        tir_pipeline = pdl_pipeline(tgt)
    graph_bounds = _graph_bounds(cuda_graph, tgt, expert_slots is not None or gpu_memory_budget is not None)
    if gpu_memory_budget is not None and (not isinstance(gpu_memory_budget, int) or isinstance(gpu_memory_budget, bool)
                                          or gpu_memory_budget < 1):
        raise MoecError(f"the device memory budget must be a positive number of bytes, got {gpu_memory_budget!r}")
    if gpu_memory_budget is not None and not grouped_experts:
        raise MoecError("a device memory budget offloads the grouped experts (drop --no-grouped-experts)")
    if grouped_experts:
        from ..passes.grouped_experts import check_offload_options

        check_offload_options(expert_slots, gpu_memory_budget)
    if expert_slots is not None and not grouped_experts:
        raise MoecError("offloaded experts (expert slots) need the grouped experts (drop --no-grouped-experts)")
    if expert_slots is not None and graph_bounds is not None:
        raise MoecError("offloaded experts call the runtime between kernels, which CUDA graphs cannot replay: "
                        "drop --cuda-graph or the expert slots")
    t0 = time.perf_counter()
    imported = model if isinstance(model, ImportedModel) else import_model(model, example_inputs)
    _log(progress, f"imported {imported.source_name} ({imported.source_kind}, {len(imported.weights)} weights) in {time.perf_counter() - t0:.1f}s")
    if kv_cache_dtype not in (None, "float32", "float16", "bfloat16"):
        raise MoecError(f"bad KV cache dtype {kv_cache_dtype!r}: expected float32, float16 or bfloat16")
    if kv_cache not in ("paged", "bf16", "fp8", "tiered"):
        raise MoecError(f"unknown KV cache {kv_cache!r}: expected paged, bf16, fp8 or tiered")
    if pdl and kv_cache in ("paged", "bf16"):
        from ..passes.pdl import PAGED_REASON

        raise MoecError(f"--pdl with the {kv_cache} KV cache: {PAGED_REASON}")
    if cascade_groups is None and cascade_keep is not None:
        raise MoecError("cascade keep needs cascade groups (--cascade-groups G)")
    offloading = expert_slots is not None or gpu_memory_budget is not None
    if calibration is not None and cascade_groups is None and not offloading:
        raise MoecError("a calibration needs cascade groups (--cascade-groups G) or offloaded experts "
                        "(--expert-slots / --gpu-memory-budget: its prefetch predictors)")
    tiered = None
    if kv_cache == "bf16":
        kv_cache_dtype = "bfloat16"
    elif kv_cache in ("fp8", "tiered"):
        from dataclasses import replace

        from ..passes.tiered_kv_attention import TieredOptions

        if kv_cache_dtype is not None:
            raise MoecError(f"--kv-cache-dtype applies to the paged cache, not to the {kv_cache} cache")
        tiered = replace(tiered_options or TieredOptions(), mode=kv_cache)
        if kv_cache == "fp8":
            tiered = replace(tiered, tier1_fraction=1.0)
    # recognise the MoE structure up front: unsupported models fail here with a clear message
    from ..passes.paged_kv_attention import _bind_batch_to_one
    from .moe_structure import analyze

    bound_main = _bind_batch_to_one(imported.main, imported.num_inputs)
    structure = analyze(bound_main, imported.num_inputs, imported.source_name).find_windows(
        bound_main, imported.num_inputs, imported.source_name)
    windows = [layer.attention.sliding_window for layer in structure.layers]
    tiered_doc = None
    if tiered is not None:
        from ..passes.tiered_kv_attention import check_supported, decode_form, prefill_mma_dtype

        check_supported(structure, tiered)
        kind = "cuda" if tgt.kind.name == "cuda" else "llvm"
        mma = prefill_mma_dtype(structure, tiered, kind)
        tiered_doc = {**tiered.to_dict(), "prefill_form": f"tensor cores ({mma} operands)" if mma else
                      "tiled float32" if tgt.kind.name == "cuda" else "llvm", "decode_form": decode_form(structure, tiered, kind)[0]}
    cascade = calib = None
    if calibration is not None:
        from .calibrate import load_calibration

        calib = load_calibration(calibration)
        calib.check_model(structure, bound_main, imported.num_inputs, dict(zip(imported.weight_names(), imported.weights)),
                          imported.source_name)
        prefetch = calib.prefetch_inputs() if offloading else None  # (refused here if the calibration has none)
    if cascade_groups is not None:
        from ..passes.cascade_gating import CascadeGating, check_cascade, default_keep

        weights = dict(zip(imported.weight_names(), imported.weights))
        given_groups = given_coarse = None
        if calib is not None:
            given_groups, given_coarse = calib.cascade_inputs(cascade_groups)
        if cascade_keep is None and isinstance(cascade_groups, int) and not isinstance(cascade_groups, bool):
            cascade_keep = calib.default_keep(cascade_groups) if calib is not None else default_keep(structure, cascade_groups)
        check_cascade(structure, cascade_groups, cascade_keep, imported.source_name)
        cascade = CascadeGating(imported.num_inputs, cascade_groups, cascade_keep, source=imported.source_name,
                                weights=weights, groups=given_groups, coarse=given_coarse,
                                calibration=calib.manifest() if calib is not None else None)
    fuse = None
    if fuse_router_norm:
        from ..passes.fuse_router_norm import FuseRouterIntoNorm

        fuse = FuseRouterIntoNorm(tgt, imported.source_name)
    grouped = None
    if grouped_experts:
        from ..passes.grouped_experts import InsertGroupedExperts

        grouped = InsertGroupedExperts(tgt, imported.source_name, expert_weights,
                                       dict(zip(imported.weight_names(), imported.weights)) if expert_weights else None,
                                       expert_slots=expert_slots,
                                       memory_budget=None if gpu_memory_budget is None else
                                       (gpu_memory_budget, sum(int(w.nbytes) for w in imported.weights)),
                                       prefill_tiled=prefill_gemm == "tiled", fp8_compute=fp8_compute)
    dense = None
    if dense_gemm:
        from ..passes.dense_gemm import InsertDenseGEMM

        dense = InsertDenseGEMM(tgt, imported.source_name, prefill_tiled=prefill_gemm != "streamed")
    norms = None
    if rms_norm:
        from ..passes.rms_norm import InsertRMSNorm

        norms = InsertRMSNorm(tgt, imported.source_name)
    rope_norm = None
    if norms is not None:
        from ..passes.fuse_rope_norm import FuseRoPEIntoNorm

        rope_norm = FuseRoPEIntoNorm(norms, tgt, imported.source_name)
    combine_norm = None
    if norms is not None and grouped is not None:
        from ..passes.fuse_combine_norm import FuseCombineIntoNorm

        combine_norm = FuseCombineIntoNorm(norms, grouped, tgt, imported.source_name)
    pipeline, insert = moec_pipeline(imported.num_inputs, tgt, imported.source_name, debug_dump, kv_cache_dtype, tiered,
                                     cascade, fuse_router_norm=fuse, grouped_experts=grouped, tuning=tuning,
                                     phases=1 if _until_phase1 else 4, dense_gemm=dense, cuda_graph=graph_bounds,
                                     rms_norm=norms, combine_norm=combine_norm, rope_norm=rope_norm)
    if _until_phase1:  # moec tune: the entries after phase 1, before any lowering
        with tgt:
            return pipeline(imported.mod), pipeline.entries, tgt
    t1 = time.perf_counter()
    try:
        executable = tvm.compile(imported.mod, target=tgt, relax_pipeline=pipeline, tir_pipeline=tir_pipeline)
    except MoecError:
        raise
    except Exception as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, MoecError):
            raise cause from None
        if grouped is not None and grouped.error is not None:  # a refusal inside the pipeline, as the pass made it
            raise grouped.error from None
        msg = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        raise MoecError(f"{imported.source_name}: compiling for {tgt.kind.name} failed inside TVM's lowering "
                        f"({type(exc).__name__}: {msg[-1] if msg else 'no message'}): the model uses an op or form that "
                        "moec's passes and TVM's legalization do not handle") from exc
    # with cascade gating, phase 1 re-analyses the rewritten main; the model's own routers are the cascade pass's view
    structure = insert.structure if cascade is None else cascade.structure
    for layer, window in zip(structure.layers, windows):  # (the passes' re-analysis does not read the masks)
        layer.attention.sliding_window = window
    _log(progress, f"built for {tgt.kind.name}{' ' + tgt.arch if tgt.kind.name == 'cuda' else ''} in {time.perf_counter() - t1:.1f}s: {structure.num_layers} layers, {len(structure.moe_layers)} MoE")
    if grouped is not None:
        _warn_unreplaced_experts(grouped.manifest(), len(structure.moe_layers), imported.source_name)
    weight_names, weight_arrays = imported.weight_names(), imported.weights
    offloaded = {}
    if grouped is not None:  # expert weights converted to bf16 / fp8 (and their scales) take their places
        weight_names, weight_arrays = grouped.converted_weights(weight_names, weight_arrays)
        # offloaded experts: stored apart (the runtime keeps them in host memory); the pools are not stored
        weight_names, weight_arrays, offloaded = grouped.offloaded_weights(weight_names, weight_arrays)
    attn = structure.layers[0].attention
    _check_disk_space(output_dir, sum(int(w.nbytes) for w in weight_arrays if w is not None)
                      + sum(int(w.nbytes) for w in offloaded.values()))
    with atomic_directory(output_dir) as tmp:
        cuda_kernels = _compile_cuda_kernels(executable, tgt, tmp, progress) if tgt.kind.name == "cuda" else []
        executable.export_library(str(tmp / LIBRARY))
        from safetensors.numpy import save_file

        stored = {f"{i:05d}:{name}": np.ascontiguousarray(w) for i, (name, w) in enumerate(zip(weight_names, weight_arrays))
                  if w is not None}
        stored.update({f"{OFFLOADED_PREFIX}{name}": np.ascontiguousarray(w) for name, w in offloaded.items()})
        if offloaded and calib is not None:  # the calibrated prefetch predictors, per MoE layer index
            for li, (pw, pb) in prefetch.items():
                stored[f"{PREFETCH_PREFIX}{li}.weight"] = np.ascontiguousarray(pw, np.float32)
                stored[f"{PREFETCH_PREFIX}{li}.bias"] = np.ascontiguousarray(pb, np.float32)
        save_file(stored, str(tmp / WEIGHTS))
        if calibration is not None:  # the calibration it was built with (hashed with the other files)
            (tmp / "cascade_calibration.json").write_bytes((Path(calibration) / "calibration.json").read_bytes())
        manifest = {
            "moec_version": __version__,
            "tvm_version": tvm.__version__,
            "built_on": platform.platform(),
            "target": {"kind": tgt.kind.name, "arch": tgt.arch if tgt.kind.name == "cuda" else None, "export": _jsonable(tgt.export())},
            "source": {"kind": imported.source_kind, "name": imported.source_name, "sha256": imported.source_hash},
            "model": {
                "num_layers": structure.num_layers, "num_heads": attn.num_heads, "num_kv_heads": attn.num_kv_heads,
                "head_dim": attn.head_dim, "vocab_size": structure.vocab_size, "hidden_size": structure.hidden_size,
                "dtype": structure.dtype, "kv_cache_dtype": (kv_cache_dtype or structure.dtype) if tiered is None else kv_cache,
                "max_context": structure.max_context,
            },
            "structure": structure.to_dict(),
            "passes": ["CascadeGating"] * (cascade is not None)
            + ["InsertPagedKVAttention" if tiered is None else "InsertTieredKVAttention"]
            + ["FuseRouterIntoNorm"] * (fuse is not None) + ["InsertRMSNorm", "FuseRoPEIntoNorm"] * (norms is not None)
            + ["InsertGroupedExperts"] * (grouped is not None) + ["FuseCombineIntoNorm"] * (combine_norm is not None)
            + ["InsertDenseGEMM"] * (dense is not None) + ["FuseSoftmaxTopK", "AddGreedySampler", "LegalizeOps", "FuseOps",
               "FuseTIR", "schedules.rules"] + ["PrepareDecodeGraph", "RewriteDecodeGraph"] * (graph_bounds is not None),
            "options": {"kv_cache": "paged" if tiered is None else kv_cache,
                        "kv_cache_dtype": (kv_cache_dtype or structure.dtype) if tiered is None else None,
                        "tiered": tiered_doc,
                        "cascade": cascade.manifest() if cascade is not None else None,
                        "prefetch": {"calibration": calib.manifest(), "layers": sorted(prefetch),
                                     "check": calib.meta["prefetch"]["layers"]} if offloaded and calib is not None else None,
                        "fuse_router_norm": fuse.manifest() if fuse is not None else None,
                        "grouped_experts": grouped.manifest() if grouped is not None else None,
                        "dense_gemm": dense.manifest() if dense is not None else None,
                        "rms_norm": norms.manifest() if norms is not None else None,
                        "combine_norm": combine_norm.manifest() if combine_norm is not None else None,
                        "rope_norm": rope_norm.manifest() if rope_norm is not None else None,
                        "prefill_gemm": prefill_gemm,
                        "cuda_graph": _graph_manifest(graph_bounds, tiered, pipeline.graph),
                        "pdl": pdl,
                        "debug_dump": str(debug_dump) if debug_dump else None},
            "tuning": tuning.manifest() if tuning is not None else {"database": None, "applied": 0},
            "schedules": pipeline.schedules.sources,
            "entry_functions": _entry_doc(tiered, graph_bounds is not None, pipeline.graph is not None and pipeline.graph.greedy),
            "cuda_kernels": cuda_kernels,
            "token_input_dtype": str(imported.main.params[0].ty.dtype),
            "weights": weight_names,
        }
        write_manifest(tmp, manifest)
    _log(progress, f"wrote {output_dir} in {time.perf_counter() - t0:.1f}s total")
    return Path(output_dir)


def _check_disk_space(output_dir, weight_bytes: int) -> None:
    """Refuse before writing when the artifact's weights (plus 1% and 64 MB for the library) cannot fit on the
    output directory's file system: a full disk would otherwise fail the build after its compile, minutes in."""
    import shutil

    parent = Path(output_dir).absolute()
    while not parent.exists():
        parent = parent.parent
    need = int(weight_bytes * 1.01) + (64 << 20)
    free = shutil.disk_usage(parent).free
    if free < need:
        raise MoecError(f"not enough disk space for the artifact {output_dir}: its weights need about {need / 1e9:.2f} GB, "
                        f"{parent} has {free / 1e9:.2f} GB free")


def _warn_unreplaced_experts(manifest: dict, moe_layers: int, source: str) -> None:
    """Warn when an entry keeps recognised MoE layers in the imported form: that form gathers a weight matrix per
    routed token (T x top-k x 3 x D x I elements a layer), slow at decode and out of memory for long prefills."""
    import warnings

    for entry, n in manifest["replaced"].items():
        if n < moe_layers:
            why = "; ".join(manifest["skipped"].get(entry, [])[:3]) or "no reason recorded"
            warnings.warn(f"{source}: {entry}: {moe_layers - n} of {moe_layers} MoE layers are not on the grouped expert "
                          f"kernels and gather one weight matrix per routed token ({why})", UnreplacedExperts, stacklevel=3)


class UnreplacedExperts(UserWarning):
    """Recognised MoE layers left in the imported (per-token weight gather) form."""


def graphs_by_default(target_kind: str, offloading: bool) -> bool:
    """``cuda_graph="auto"``: CUDA graphs for the CUDA target unless the experts are offloaded (the runtime's residency
    calls sit between the kernels, and a graph cannot replay them)."""
    return target_kind == "cuda" and not offloading


def _graph_bounds(cuda_graph, tgt, offloading: bool):
    """The ``GraphBounds`` of the ``cuda_graph`` option (None when off)."""
    from ..passes.cuda_graph import GraphBounds

    if isinstance(cuda_graph, str) and cuda_graph == "auto":
        return GraphBounds() if graphs_by_default(tgt.kind.name, offloading) else None
    if cuda_graph is False or cuda_graph is None:
        return None
    if cuda_graph is True:
        cuda_graph = GraphBounds()
    if not isinstance(cuda_graph, GraphBounds):
        raise MoecError(f"cuda_graph must be True, False or a GraphBounds, got {cuda_graph!r}")
    return cuda_graph  # (moec_pipeline refuses it for a target other than CUDA)


def _graph_manifest(bounds, tiered, rewrite) -> dict | None:
    if bounds is None:
        return None
    from ..passes.cuda_graph import GRAPH_ENTRY, GREEDY_ENTRY, table_widths

    doc = {"entry": GRAPH_ENTRY, "greedy_entry": GREEDY_ENTRY if rewrite.greedy else None, "bounds": bounds.to_dict(),
           "decode_step": rewrite.summary}
    if tiered is not None:
        w1, w2 = table_widths(bounds, tiered.t1_page, tiered.t2_page)
        doc["max_table_widths"] = {"t1": w1, "t2": w2}
    return doc


def _entry_doc(tiered, graph: bool = False, greedy: bool = False) -> dict:
    doc = _entry_doc_plain(tiered)
    if graph:
        doc["decode_graph"] = ("decode with its kernel launches as CUDA graphs (same arguments and results), for steps within "
                               "options.cuda_graph.bounds; the tiered pools must be the same tensors on every call")
    if graph and greedy:
        doc["decode_graph_greedy"] = ("decode_graph returning argmax(logits) (tokens[1,b] of the token dtype) in place of the "
                                      "logits, the argmax captured with the step's kernels")
    return doc


def _entry_doc_plain(tiered) -> dict:
    if tiered is None:
        return {
            "prefill": "prefill(input_ids[1,N] int64, logit_pos[b] int32, kv_cache, *weights) -> logits[1,b,V]",
            "decode": "decode(input_ids[1,b] int64, kv_cache, *weights) -> logits[1,b,V]",
            "create_kv_cache": "create_kv_cache(max_batch, max_total_len, prefill_chunk, page_size) -> kv_cache",
            "argmax": "argmax(logits[1,b,V]) -> tokens[1,b] of the token dtype (greedy, on the device)",
        }
    cache = "q_pos[N], slots[N], q_row[N], q_t1[N], q_indptr[B+1], t1_table[B,M1], t2_table[B,M2], t2_np[B], *pools"
    doc = {
        "prefill": f"prefill(input_ids[1,N], logit_pos[b] int32, {cache}, *weights) -> (logits[1,b,V], *pools)",
        "decode": f"decode(input_ids[1,N], {cache}, *weights) -> (logits[1,N,V], *pools)",
        "argmax": "argmax(logits[1,N,V]) -> tokens[1,N] of the token dtype (greedy, on the device)",
    }
    if tiered.mode == "tiered":
        doc["rerank"] = "rerank(t1_table[B,M1], t1_len[B], length[B], demote[B], new_t2[B,MN], *pools) -> pools"
    return doc


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)
