"""Linear layers on the GPU: moec's dense_gemm (tensor cores, weight as stored [N, K]) against torch's
``F.linear`` (cuBLAS), with achieved bandwidth on the weight bytes against a device copy.

  python bench/dense_gemm.py prepare .devcarry/dg                        # here: sm_90 fatbins, no GPU
  python3 bench/dense_gemm.py run .devcarry/dg --json OUT --commit SHA    # GPU machine, runtime-only TVM

Shapes (bf16): the OLMoE-1B-7B attention projection (2048 x 2048) and LM head (50304 x 2048), Mixtral's
projection (4096 x 4096) and LM head (32000 x 4096); tokens M of 1, 16, 64, 128 (decode batches) and 4096
(a prefill chunk). Output float32, as the imported graphs' ``matmul(..., out_dtype="float32")``.
The q, k and v projections of one input (OLMoE 3 x 2048, Mixtral 4096 + 2 x 1024) also run as one
``dense_gemm_x3`` launch against three one-weight launches (``olmoe_qkv``, ``mixtral_qkv``).
Correctness: against float32 torch over the same bf16 inputs, relative to the output's scale. Timing:
the VM's ``time_evaluator`` for TVM, CUDA events for torch; medians of repeats (``ms``: a warm loop, where a
weight of up to ~40 MB stays in the L2). On CUDA also ``cold_us``: each call right after a 256 MB write, its
kernels' own time from the device trace, as a model's step meets them (weights from HBM).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grouped_experts import _device_name, _torch_ms, cold_kernels_us, copy_bandwidth  # noqa: E402

DYN = 232448  # grouped_experts.DYN_SMEM_LIMIT: the stages take what they ask, up to sm_90's 227 KB a block
SHAPES = {"olmoe_proj": (2048, 2048), "olmoe_lm_head": (50304, 2048), "mixtral_proj": (4096, 4096),
          "mixtral_lm_head": (32000, 4096)}  # N, K
TOKENS = (1, 16, 64, 128, 4096)
# the launch forms timed beside the default (register loads): cp.async stages (``DenseSpec.stages``), with
# fewer warps a block (more blocks at decode sizes), or 64-token passes (the weight read once per 64 tokens)
# _s4nt2 / _s4nt1: 16- and 8-token passes, twice and four times the warps of the compiled 32 at decode batches (a
# 2048 x 2048 projection at 128 tokens is 512 warps with 32-token passes: about 4 an SM to keep loads in flight)
# _tiled: the block-tiled prefill form (``make_dense_tiled``: 128 x 128 tiles, shared-memory operands, ldmatrix), at its
# default ring (3 stages of k 32), _tiled_k<K>s<S>: S stages of k K (past 48 KB in dynamic shared memory); on the CPU
# dry run their place takes the llvm form of the default spec
# _s8d, _s12d, _s16d: 8 to 16 stages in dynamic shared memory (96 to 192 KB a block), so a block keeps more of its
# weight rows in flight (a 2048-deep projection is 32 k-steps: 4 stages leave a block waiting on memory latency when
# the weights come from HBM, as in a model's step, rather than from the L2, as in a warm loop); _s8dnt8: 8 stages of
# 64-token passes (the weight read twice at 128 tokens instead of four times)
WG = {"wgmma": True, "ldmatrix": False, "dyn_shared": DYN}  # the wgmma forms' common fields (ldmatrix off: the q/k/v forms
#                                                          replace fields of the compiled spec, which has it on)
VARIANTS = {"": {"stages": 0}, "_s4": {"stages": 4}, "_s4w2": {"stages": 4, "warps": 2}, "_s4nt8": {"stages": 4, "n_tiles": 8},
            "_s4nt2": {"stages": 4, "n_tiles": 2}, "_s4nt1": {"stages": 4, "n_tiles": 1}, "_tiled": {"tiled": True},
            "_tiled_k32s2": {"tiled": True, "tile_k": 32, "stages": 2}, "_tiled_k32s4": {"tiled": True, "tile_k": 32, "stages": 4},
            "_tiled_k64s3": {"tiled": True, "tile_k": 64, "stages": 3}, "_tiled_k64s4": {"tiled": True, "tile_k": 64, "stages": 4},
            "_s8d": {"stages": 8, "dyn_shared": 8 * 12288}, "_s12d": {"stages": 12, "dyn_shared": 12 * 12288},
            "_s16d": {"stages": 16, "dyn_shared": 16 * 12288}, "_s8dnt8": {"stages": 8, "n_tiles": 8, "dyn_shared": 8 * 16384},
            # k groups (``DenseSpec.k_groups``): G groups of warps a block over their own k ranges, summed at the end;
            # the stages in dynamic shared memory (as many as asked, up to 227 KB with the sums)
            "_s4g2": {"stages": 4, "k_groups": 2, "dyn_shared": DYN}, "_s4g4": {"stages": 4, "k_groups": 4, "dyn_shared": DYN},
            "_s2g4": {"stages": 2, "k_groups": 4, "dyn_shared": DYN}, "_s3g4": {"stages": 3, "k_groups": 4, "dyn_shared": DYN},
            "_s4w2g2": {"stages": 4, "warps": 2, "k_groups": 2, "dyn_shared": DYN},
            "_s4w2g4": {"stages": 4, "warps": 2, "k_groups": 4, "dyn_shared": DYN},
            "_s3w1g8": {"stages": 3, "warps": 1, "k_groups": 8, "dyn_shared": DYN},
            "_s4nt2g4": {"stages": 4, "n_tiles": 2, "k_groups": 4, "dyn_shared": DYN},
            "_s4nt8g2": {"stages": 4, "n_tiles": 8, "k_groups": 2, "dyn_shared": DYN},
            # fewer, larger blocks at decode batches: every block reads its pass's tokens (M x K) from the L2, so with
            # 64-row blocks a 128-token step reads the tokens N / 64 times (an LM head: 400 MB of L2 traffic against
            # 206 MB of weights); 8 warps (128 rows) halve that, 128-token passes read each weight row once
            "_s4w8d": {"stages": 4, "warps": 8, "dyn_shared": DYN}, "_s4w8nt8d": {"stages": 4, "warps": 8, "n_tiles": 8, "dyn_shared": DYN},
            "_s4nt16d": {"stages": 4, "n_tiles": 16, "dyn_shared": DYN},
            "_s4w8nt16d": {"stages": 3, "warps": 8, "n_tiles": 16, "dyn_shared": DYN},
            # k splits across blocks (``DenseSpec.k_splits``: each split's float32 sums to a workspace, a second kernel
            # adds them): blocks of 128 tokens (the weight read once) and 64 or 128 rows, so a 128-token step reads
            # the tokens from the L2 N / 64 or N / 128 times instead of the weight 4 times and the tokens N / 64
            # times, while the splits keep 128-256 blocks on the GPU
            "_k2nt8d": {"stages": 4, "n_tiles": 8, "k_splits": 2, "dyn_shared": DYN},
            "_k4nt16d": {"stages": 4, "n_tiles": 16, "k_splits": 4, "dyn_shared": DYN},
            "_k8nt16d": {"stages": 4, "n_tiles": 16, "k_splits": 8, "dyn_shared": DYN},
            "_k8w8nt16d": {"stages": 4, "warps": 8, "n_tiles": 16, "k_splits": 8, "dyn_shared": DYN},
            "_k2w2nt16d": {"stages": 4, "warps": 2, "n_tiles": 16, "k_splits": 2, "dyn_shared": DYN},
            # k splits and k groups together: fewer L2 bytes (128-token or 64-token passes) and several warps a scheduler
            # (ncu of the compiled form at 128 tokens: one warp a scheduler, an instruction every 4.2 cycles)
            "_k4nt16g2": {"stages": 4, "n_tiles": 16, "k_splits": 4, "k_groups": 2, "dyn_shared": DYN},
            "_k2nt8g2": {"stages": 4, "n_tiles": 8, "k_splits": 2, "k_groups": 2, "dyn_shared": DYN},
            "_k2nt8g4": {"stages": 3, "n_tiles": 8, "k_splits": 2, "k_groups": 4, "dyn_shared": DYN},
            "_k4w2nt16g4": {"stages": 3, "warps": 2, "n_tiles": 16, "k_splits": 4, "k_groups": 4, "dyn_shared": DYN},
            # ldmatrix fragments (``DenseSpec.ldmatrix``): no register moves between the fragment loads and the mma (ptxas
            # for sm_90 at 32-token passes: 92 instructions a k-step against 137, 44 of them moves); at the compiled
            # shape, 64-token passes (the LM heads'), 2-warp blocks and 3, 6 or 8 stages
            "_s4l": {"stages": 4, "ldmatrix": True}, "_s4lnt8": {"stages": 4, "n_tiles": 8, "ldmatrix": True},
            "_s4lw2": {"stages": 4, "warps": 2, "ldmatrix": True}, "_s3l": {"stages": 3, "ldmatrix": True},
            "_s6dl": {"stages": 6, "dyn_shared": 6 * 12288, "ldmatrix": True},
            "_s8dl": {"stages": 8, "dyn_shared": 8 * 12288, "ldmatrix": True},
            # the next k-step's fragments loaded under this step's mma (``DenseSpec.frag_ahead``; ncu of `_s4l` at 128
            # tokens on the H100: 1.4 cycles an instruction waiting on shared-memory results, 1.1 on the copies)
            "_s4la": {"stages": 4, "ldmatrix": True, "frag_ahead": True},
            "_s6dla": {"stages": 6, "dyn_shared": 6 * 12288, "ldmatrix": True, "frag_ahead": True},
            "_s4lnt8a": {"stages": 4, "n_tiles": 8, "ldmatrix": True, "frag_ahead": True},
            # warpgroup tensor cores (``DenseSpec.wgmma``, sm_90a: the directory's fatbins are built for sm_90a when one is
            # asked for): one wgmma m64n(8 NT)k16 per 64 rows x 8 NT tokens x 16 k, asynchronous, operands from 128-byte
            # swizzled stages; _wg<T>: T-token passes; r2: 128-row blocks (the tokens read from the L2 half as often);
            # k<S>: S k splits (a 2048-row projection at 128 tokens is 32 blocks of 64 rows: splits fill the GPU); s<N>: stages
            "_wg128": {**WG, "stages": 4, "n_tiles": 16},
            "_wg128k2": {**WG, "stages": 4, "n_tiles": 16, "k_splits": 2},
            "_wg128k4": {**WG, "stages": 4, "n_tiles": 16, "k_splits": 4},
            "_wg128k4s6": {**WG, "stages": 6, "n_tiles": 16, "k_splits": 4},
            "_wg128r2k4": {**WG, "stages": 4, "n_tiles": 16, "row_tiles": 2, "k_splits": 4},
            "_wg128r2k8": {**WG, "stages": 4, "n_tiles": 16, "row_tiles": 2, "k_splits": 8},
            "_wg64k2": {**WG, "stages": 4, "n_tiles": 8, "k_splits": 2},
            "_wg32": {**WG, "stages": 6, "n_tiles": 4},
            "_wg32k2": {**WG, "stages": 6, "n_tiles": 4, "k_splits": 2},
            # a: each k-step's wgmma left in flight through the next step's wait and barrier (``wgmma_ahead``)
            "_wg32a": {**WG, "stages": 6, "n_tiles": 4, "wgmma_ahead": True},
            "_wg32s8a": {**WG, "stages": 8, "n_tiles": 4, "wgmma_ahead": True},
            "_wg64a": {**WG, "stages": 6, "n_tiles": 8, "wgmma_ahead": True},
            "_wg128a": {**WG, "stages": 4, "n_tiles": 16, "wgmma_ahead": True},
            "_wg128s6a": {**WG, "stages": 6, "n_tiles": 16, "wgmma_ahead": True}}
QKV_FORMS = {"merged_s8d": {"stages": 8, "dyn_shared": 8 * 12288}, "merged_s12d": {"stages": 12, "dyn_shared": 12 * 12288},
             "merged_s4g2": VARIANTS["_s4g2"], "merged_s4g4": VARIANTS["_s4g4"], "merged_s3g4": VARIANTS["_s3g4"],
             "merged_s4w2g4": VARIANTS["_s4w2g4"], "merged_s4nt2g4": VARIANTS["_s4nt2g4"],
             "merged_s4w8d": VARIANTS["_s4w8d"], "merged_s4w8nt8d": VARIANTS["_s4w8nt8d"], "merged_s4nt16d": VARIANTS["_s4nt16d"],
             "merged_k2nt16d": {"stages": 4, "n_tiles": 16, "k_splits": 2, "dyn_shared": DYN},
             "merged_k4nt16d": VARIANTS["_k4nt16d"], "merged_k4w8nt16d": {"stages": 4, "warps": 8, "n_tiles": 16, "k_splits": 4,
                                                                           "dyn_shared": DYN},
             "merged_k8w8nt16d": VARIANTS["_k8w8nt16d"], "merged_k2nt16g2": {"stages": 4, "n_tiles": 16, "k_splits": 2,
                                                                            "k_groups": 2, "dyn_shared": DYN},
             "merged_k2nt8g2": VARIANTS["_k2nt8g2"], "merged_k2nt8g4": VARIANTS["_k2nt8g4"],
             # the one-launch q/k/v at 128 tokens is 384 blocks of 32-token passes (6144 rows / 64 x 4 passes), three a
             # multiprocessor, where a 2048-row projection has one: 64-token passes (192 blocks) read the weight from
             # the L2 twice instead of four times; 2-warp blocks or 16-token passes put more blocks on each
             "merged_s4nt8": VARIANTS["_s4nt8"], "merged_s4w2": VARIANTS["_s4w2"], "merged_s4nt2": VARIANTS["_s4nt2"],
             "merged_s4w2nt8": {"stages": 4, "warps": 2, "n_tiles": 8},
             "merged_s4l": VARIANTS["_s4l"], "merged_s4lnt8": VARIANTS["_s4lnt8"], "merged_s4lw2": VARIANTS["_s4lw2"],
             "merged_s6dl": VARIANTS["_s6dl"], "merged_s4la": VARIANTS["_s4la"], "merged_s6dla": VARIANTS["_s6dla"],
             # wgmma (see VARIANTS): 6144 rows are 96 blocks of 64 at 128 tokens
             "merged_wg128": VARIANTS["_wg128"], "merged_wg128k2": VARIANTS["_wg128k2"], "merged_wg128r2k2": {
                 **WG, "stages": 4, "n_tiles": 16, "row_tiles": 2, "k_splits": 2},
             "merged_wg128r2k4": VARIANTS["_wg128r2k4"], "merged_wg64": {**WG, "stages": 4, "n_tiles": 8},
             "merged_wg32": VARIANTS["_wg32"], "merged_wg32a": VARIANTS["_wg32a"], "merged_wg32s8a": VARIANTS["_wg32s8a"],
             "merged_wg64a": VARIANTS["_wg64a"], "merged_wg128a": VARIANTS["_wg128a"]}
QKV_ALL = ("merged", "separate") + tuple(QKV_FORMS)
# q, k and v of one input: one dense_gemm_x3 launch (InsertDenseGEMM's merge) against three launches of the
# compiled models' one-weight kernel, both in the compiled spec (``compiled_spec``)
QKV = {"olmoe_qkv": ((2048, 2048, 2048), 2048), "mixtral_qkv": ((4096, 1024, 1024), 4096)}  # parts, K


def select(variants: str | None) -> None:
    """Keep only the named launch forms (comma-separated suffixes, ``base`` for the register form, ``_s4`` for the
    cp.async form compiled models took before 574bfaf, ``_s4l`` for theirs since; q/k/v forms ``merged`` (the compiled
    one-launch form), ``separate``, ``merged_*``): fewer kernels to build. ``prepare`` records the
    choice in the directory's index.json and ``run`` times what was built."""
    global QKV_ALL
    if not variants:
        return
    names = {("" if v == "base" else v) for v in variants.split(",")}
    unknown = names - set(VARIANTS) - set(QKV_ALL)
    if unknown:
        raise SystemExit(f"unknown forms: {', '.join(sorted(unknown))}")
    for v in [v for v in VARIANTS if v not in names]:
        del VARIANTS[v]
    for f in [f for f in QKV_FORMS if f not in names]:
        del QKV_FORMS[f]
    QKV_ALL = tuple(f for f in QKV_ALL if f in names)


def build_module(kind: str):
    """``<shape>(x [M, K] bf16, w [N, K] bf16) -> y [M, N] float32`` per shape."""
    import tvm
    from tvm import relax

    from moec.schedules.kernels.dense_gemm import DenseSpec, compiled_spec, make_dense, make_dense_tiled

    bb = relax.BlockBuilder()
    for name, (n, k) in SHAPES.items():
        for suffix, kw in VARIANTS.items():
            if kw.get("tiled"):
                ring = {a: kw[a] for a in ("tile_k", "stages") if a in kw}
                prim = make_dense_tiled(n, k, **ring) if kind == "cuda" else make_dense(DenseSpec(out_features=n, in_features=k), kind)
            else:
                prim = make_dense(DenseSpec(out_features=n, in_features=k, **kw), kind)
            prim = prim.without_attr("global_symbol").with_attr("op_pattern", 8)
            gv = bb.add_func(prim, f"dense_{name}{suffix}")
            m = tvm.tirx.Var("m", "int64")
            x = relax.Var("x", relax.TensorType((m, k), "bfloat16"))
            w = relax.Var("w", relax.TensorType((n, k), "bfloat16"))
            splits = kw.get("k_splits", 1) if not kw.get("tiled") else 1
            with bb.function(name + suffix, [x, w]):
                with bb.dataflow():
                    if splits > 1:  # (the splits' sums: a workspace output)
                        y = bb.emit(relax.call_tir(gv, [x, w], out_ty=[relax.TensorType([m, n], "float32"),
                                                                       relax.TensorType([m, splits, n], "float32")]))
                        y = bb.emit(relax.TupleGetItem(y, 0))
                    else:
                        y = bb.emit(relax.call_tir(gv, [x, w], out_ty=relax.TensorType([m, n], "float32")))
                    y = bb.emit_output(y)
                bb.emit_func_output(y)
    for name, (parts, k) in QKV.items():
        multi = make_dense(compiled_spec(sum(parts), k), kind, parts).without_attr("global_symbol").with_attr("op_pattern", 8)
        gms = {"merged": bb.add_func(multi, f"dense_{name}_x3")}
        for form, kw in QKV_FORMS.items():
            spec = replace(compiled_spec(sum(parts), k), **(kw if kind == "cuda" else {}))
            gms[form] = bb.add_func(make_dense(spec, kind, parts).without_attr("global_symbol").with_attr("op_pattern", 8),
                                    f"dense_{name}_x3_{form}")
        singles = [bb.add_func(make_dense(compiled_spec(n, k), kind).without_attr("global_symbol").with_attr("op_pattern", 8),
                               f"dense_{name}_{i}") for i, n in enumerate(parts)]
        m = tvm.tirx.Var("m", "int64")
        for form in QKV_ALL:
            x = relax.Var("x", relax.TensorType((m, k), "bfloat16"))
            ws = [relax.Var(f"w{i}", relax.TensorType((n, k), "bfloat16")) for i, n in enumerate(parts)]
            with bb.function(f"{name}_{form}", [x] + ws):
                with bb.dataflow():
                    splits = QKV_FORMS.get(form, {}).get("k_splits", 1) if kind == "cuda" else 1
                    if form != "separate":
                        y = bb.emit(relax.call_tir(gms[form], [x] + ws, out_ty=[relax.TensorType([m, n], "float32") for n in parts] + (
                            [relax.TensorType([m, splits, sum(parts)], "float32")] if splits > 1 else [])))
                        if splits > 1:
                            y = bb.emit(relax.Tuple([bb.emit(relax.TupleGetItem(y, i)) for i in range(len(parts))]))
                    else:
                        y = relax.Tuple([bb.emit(relax.call_tir(g1, [x, w1], out_ty=relax.TensorType([m, n], "float32")))
                                         for g1, w1, n in zip(singles, ws, parts)])
                    y = bb.emit_output(y)
                bb.emit_func_output(y)
    return bb.get()


def compile_module(target):
    import tvm

    from moec.passes.pipeline import lowering_pipeline

    kind = "cuda" if target.kind.name == "cuda" else "llvm"
    names = [n + s for n in SHAPES for s in VARIANTS] + [f"{n}_{f}" for n in QKV for f in QKV_ALL]
    return tvm.compile(build_module(kind), target=target, relax_pipeline=lowering_pipeline(target, names))


def prepare(out: Path, variants: str | None = None) -> None:
    from moec.compiler.artifact import atomic_directory
    from moec.compiler.build import _compile_cuda_kernels
    from moec.compiler.targets import make_target

    wgmma = any(kw.get("wgmma") for kw in list(VARIANTS.values()) + [QKV_FORMS[f] for f in QKV_ALL if f in QKV_FORMS])
    target = make_target("cuda", "sm_90a" if wgmma else "sm_90")  # (wgmma: sm_90a only)
    with atomic_directory(out) as tmp:
        ex = compile_module(target)
        kernels = _compile_cuda_kernels(ex, target, tmp, progress=True)
        ex.export_library(str(tmp / "lib.so"))
        (tmp / "index.json").write_text(json.dumps({"cuda_kernels": kernels, "variants": variants}, indent=2))


def _vm(root: Path, device: str):
    import tvm
    from tvm.runtime.vm import VirtualMachine

    if device == "cpu":
        return VirtualMachine(compile_module(tvm.target.Target({"kind": "llvm"})), tvm.cpu(0)), tvm.cpu(0)
    from moec.runtime.engine import _load_cuda_runtime, _register_fatbins

    _load_cuda_runtime()
    _register_fatbins(root, json.loads((root / "index.json").read_text()))
    return VirtualMachine(tvm.runtime.load_module(str(root / "lib.so")), tvm.cuda(0)), tvm.cuda(0)


def cold_us(calls: dict, tlb_bytes: int = 0) -> dict:
    """Device time (us) of each call in ``calls`` (name -> function of no arguments), each made right after a 256 MB
    write, so its weights come from HBM as in a model's step rather than from the L2 as in a warm loop: the sum of
    its kernels' own times (the device trace), median over repeats (``grouped_experts.cold_kernels_us``); with
    ``tlb_bytes``, after a byte written in each 2 MB page of that many bytes too."""
    return {n: v["total"] for n, v in cold_kernels_us(calls, tlb_bytes=tlb_bytes).items()}


def run_point(vm, dev, name: str, m: int, device: str, number: int, repeat: int, tlb_bytes: int = 0) -> dict:
    import torch
    import tvm
    from torch.nn import functional as F

    n, k = SHAPES[name]
    g = torch.Generator().manual_seed(m)
    tdev = "cuda" if device == "cuda" else "cpu"
    x = torch.randn(m, k, generator=g).to(tdev, torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(tdev, torch.bfloat16)
    args = [tvm.runtime.from_dlpack(x), tvm.runtime.from_dlpack(w)]
    ref = x.float() @ w.float().T
    ms, errs = {}, {}
    for suffix in VARIANTS:
        out = torch.from_dlpack(vm[name + suffix](*args))
        errs["moec_dense_gemm" + suffix] = float((out - ref).abs().max()) / (float(ref.abs().max()) or 1.0)
        vm.save_function(name + suffix, f"{name}{suffix}_timed", *args)
        res = vm.time_evaluator(f"{name}{suffix}_timed", dev, number=number, repeat=repeat)()
        ms["moec_dense_gemm" + suffix] = float(np.median(np.asarray(res.results))) * 1e3
    ms["torch_linear"] = _torch_ms(lambda a, b: F.linear(a, b), (x, w), device, number, repeat)
    cold = None
    if device == "cuda":
        cold = {"moec_dense_gemm" + sx: (lambda f=vm[name + sx]: f(*args)) for sx in VARIANTS}
        cold["torch_linear"] = lambda: F.linear(x, w)
        cold_tlb = cold_us(cold, tlb_bytes) if tlb_bytes else None  # (--tlb-gb)
        cold = cold_us(cold)
    err = max(errs.values())
    wbytes = n * k * 2
    row = {"shape": name, "N": n, "K": k, "tokens": m, "max_rel_error_vs_fp32": err, "errors": errs, "passed": err < 1e-2, "ms": ms,
           "weight_bytes": wbytes, "GBps_weights": {s: wbytes / v / 1e6 for s, v in ms.items()},
           "TFLOPs": {s: 2 * m * n * k / v / 1e9 for s, v in ms.items()}}
    if cold:
        row["cold_us"] = cold
        row["cold_GBps_weights"] = {s: wbytes / v / 1e3 for s, v in cold.items()}
        if cold_tlb:
            row["cold_tlb_us"] = cold_tlb
    print(json.dumps(row), flush=True)
    return row


def run_qkv(vm, dev, name: str, m: int, device: str, number: int, repeat: int, tlb_bytes: int = 0) -> dict:
    import torch
    import tvm

    parts, k = QKV[name]
    g = torch.Generator().manual_seed(m)
    tdev = "cuda" if device == "cuda" else "cpu"
    x = torch.randn(m, k, generator=g).to(tdev, torch.bfloat16)
    ws = [(torch.randn(n, k, generator=g) * k**-0.5).to(tdev, torch.bfloat16) for n in parts]
    args = [tvm.runtime.from_dlpack(t) for t in [x] + ws]
    refs = [x.float() @ w.float().T for w in ws]
    ms, errs = {}, {}
    for form in QKV_ALL:
        outs = vm[f"{name}_{form}"](*args)
        errs[form] = max(float((torch.from_dlpack(o) - r).abs().max()) / (float(r.abs().max()) or 1.0) for o, r in zip(outs, refs))
        vm.save_function(f"{name}_{form}", f"{name}_{form}_timed", *args)
        res = vm.time_evaluator(f"{name}_{form}_timed", dev, number=number, repeat=repeat)()
        ms[form] = float(np.median(np.asarray(res.results))) * 1e3
    wbytes = sum(parts) * k * 2
    row = {"shape": name, "parts": list(parts), "K": k, "tokens": m, "errors": errs, "passed": max(errs.values()) < 1e-2,
           "ms": ms, "weight_bytes": wbytes, "GBps_weights": {f: wbytes / v / 1e6 for f, v in ms.items()},
           "merged_speedup": ms["separate"] / ms["merged"] if "separate" in ms and "merged" in ms else None}
    if device == "cuda":
        calls = {f: (lambda fn=vm[f"{name}_{f}"]: fn(*args)) for f in QKV_ALL}
        row["cold_us"] = cold_us(calls)
        if tlb_bytes:  # (--tlb-gb)
            row["cold_tlb_us"] = cold_us(calls, tlb_bytes)
        row["cold_GBps_weights"] = {f: wbytes / v / 1e3 for f, v in row["cold_us"].items()}
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("step", choices=["prepare", "run"])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--commit", default="unknown", help="git commit of the tree the kernels were built from")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--shapes", default=",".join(list(SHAPES) + list(QKV)))
    ap.add_argument("--variants", help="prepare: only these launch forms (comma-separated, see select())")
    ap.add_argument("--tlb-gb", type=float, default=0.0,
                    help="run (CUDA): also time each form cold after a byte written in every 2 MB page of a buffer of "
                         "this many GB (cold_tlb_us: whether address translations, not only L2 lines, cost the step)")
    args = ap.parse_args()
    if args.step == "prepare":
        select(args.variants)
        for table in (SHAPES, QKV):  # only the shapes asked for are built
            for name in [n for n in table if n not in args.shapes.split(",")]:
                del table[name]
        prepare(args.dir, args.variants)
        return 0
    if args.device == "cuda":
        select(json.loads((args.dir / "index.json").read_text()).get("variants"))
    else:
        select(args.variants)
    import torch

    doc = {"benchmark": "dense_gemm", "command": " ".join(["python3"] + sys.argv), "git_commit": args.commit,
           "python": platform.python_version(), "torch": torch.__version__,
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": _device_name(args.device),
           "timing": "ms per call; medians of repeats", "tlb_gb": args.tlb_gb}
    doc["copy_GBps"] = copy_bandwidth(args.device)
    vm, dev = _vm(args.dir, args.device)
    number, repeat = (20, 5) if args.device == "cuda" else (1, 2)
    doc["rows"] = []
    for name in args.shapes.split(","):
        for m in args.tokens:
            r = (run_qkv if name in QKV else run_point)(vm, dev, name, m, args.device, number, repeat,
                                                        int(args.tlb_gb * (1 << 30)))
            r["fraction_of_copy"] = {s: v / doc["copy_GBps"] for s, v in r["GBps_weights"].items()}
            doc["rows"].append(r)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(doc, indent=2))
    return 0 if all(r["passed"] for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
