"""Routed-expert layer on the GPU: moec's grouped expert GEMMs against PyTorch (HF's loop over experts, eager and
torch.compile), with achieved bandwidth on the active experts' weight bytes against a device copy.

  python bench/grouped_experts.py prepare .devcarry/ge                        # here: sm_90 fatbins, no GPU
  python3 bench/grouped_experts.py run .devcarry/ge --json OUT --commit SHA    # GPU machine, runtime-only TVM
  python bench/grouped_experts.py run .devcarry/ge --device cpu --small        # here: llvm build, a dry run

Shapes (bf16 weights and activations, float32 routing weights): OLMoE (E 64, top-8, d 2048, I 1024) and
Mixtral (E 8, top-2, d 4096, I 14336); ``--small`` adds / runs only a small one (E 8, top-2, d 256, I 128).
Decode batches of 1, 16, 64 and 128 tokens with random top-k ids (distinct per token) and softmax weights.
One build per shape serves every batch (T dynamic). The TVM function ``experts(x, ids, rw, w1, w2)`` is
the four kernels exactly as ``InsertGroupedExperts`` emits them (route_prep, gate_up + SwiGLU, down x
routing weight, combine), lowered by phases 2-4 of the "moec" pipeline: on CUDA gate_up and down run on
tensor cores (mma.sync); ``experts_warp`` is the same with ``tensor_cores=False`` (the warp-per-row form);
``experts_fp8`` the same with FP8 e4m3 weights and per-output-channel scales (``--expert-weights fp8``;
bandwidth on its own bytes, half); ``experts_slots`` the default form reading a pool of E expert slots through
a residency table (``slots``, the offloaded-experts form), the experts at permuted slots.

Correctness: the TVM output against a float32 PyTorch reference of the same function (h rounded to bf16
as the kernel stores it), relative to the output's scale. Timings: TVM through the VM's
``time_evaluator`` (host-timed back-to-back calls: launch overhead counts, as in a decode step); torch with
CUDA events around back-to-back calls; medians of repeats. On CUDA also ``cold_us``: the default form and the
forms that differ from it in shared memory, each call after a 256 MB write, each kernel's own time from the device
trace (route_prep, gate_up, down, combine and their total). Bandwidth: the bytes of the active experts'
weights (distinct experts hit x 3 D I x 2 bytes) over the time, against ``copy_`` of a 1 GiB buffer
(read + write counted, as device-to-device copy bandwidth is usually quoted).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = {"olmoe": (64, 8, 2048, 1024), "mixtral": (8, 2, 4096, 14336)}  # E, K, D, I
SMALL = {"small": (8, 2, 256, 128)}
BATCHES = (1, 16, 64, 128)
DTYPE = "bfloat16"


def _spec(e: int, k: int, d: int, i: int, w_format: str = "float", tensor_cores: bool = True, **launch):
    from moec.schedules.kernels.grouped_experts import GroupedExpertsSpec

    return GroupedExpertsSpec(hidden=d, inter=i, experts=e, top_k=k, w_dtype=DTYPE, rw_dtype="float32", out_dtype=DTYPE,
                              ids_dtype="int64", w_format=w_format, tensor_cores=tensor_cores,
                              **{"x_dtype": DTYPE, "h_dtype": DTYPE, **launch})


def _funcs(only=None, kind: str = "cuda") -> dict:
    """function name -> (weight format, tensor cores, launch overrides); ``only``: the variants to build (of VARIANTS
    and FP8_VARIANTS; None: all), beside the functions of FUNCS and the slot-pool form, which are always built."""
    out = {name: (fmt, tc, {}) for name, (fmt, tc) in FUNCS.items()}
    out.update({f"experts_{v}": ("float", True, kw) for v, kw in VARIANTS.items() if only is None or v in only})
    out.update({f"experts_{v}": ("fp8", True, kw) for v, kw in FP8_VARIANTS.items() if (only is None or v in only)
                and (kind == "cuda" or not kw.get("w_tiles"))})  # (tile-major codes: CUDA forms only)
    out[SLOTS_FUNC] = ("float", True, {})
    return out


# the offloaded experts' form (``slots``): the default kernels reading a pool of E slots through a residency table
SLOTS_FUNC = "experts_slots"
# function -> (weight format, tensor cores): the default build, FP8 weights, and the warp-per-row form
FUNCS = {"experts": ("float", True), "experts_fp8": ("fp8", True), "experts_warp": ("float", False)}
# the default bf16 mma form with other launch shapes, checked and timed alike (``moec_grouped_<name>``): more
# blocks in flight (one 16-row tile per warp), and warps per block; ``pipe_*``: the cp.async form (``stages``: the
# weights and tokens of up to that many k-steps staged through shared memory, as many as fit in 48 KB per block;
# ``launch_config`` in index.json says how many each kernel got), ``_pf``: with the L2::256B prefetch hint
# the default is the cp.async form (4 stages, L2 prefetch 256, row_tiles 1, 4 warps); "regs" is the register-load
# form that was the default before it
VARIANTS = {"regs": {"stages": 0, "l2_prefetch": 0}, "rt1": {"stages": 0, "l2_prefetch": 0, "row_tiles": 1},
            "w8_rt1": {"stages": 0, "l2_prefetch": 0, "warps": 8, "row_tiles": 1},
            "w2_rt1": {"stages": 0, "l2_prefetch": 0, "warps": 2, "row_tiles": 1},
            "pipe_w4": {"stages": 4, "row_tiles": 1, "l2_prefetch": 0}, "pipe_w2": {"stages": 4, "warps": 2, "row_tiles": 1, "l2_prefetch": 0},
            "pipe_w1": {"stages": 8, "warps": 1, "row_tiles": 1, "l2_prefetch": 0},
            "pipe_w2_pf": {"stages": 4, "warps": 2, "row_tiles": 1, "l2_prefetch": 256},
            # the prefill entry's forms (prefill_spec): 64 tokens per weight pass, and a block per pass; run --batches 2048
            "nt8": {"n_tiles": 8}, "nt8_pb": {"n_tiles": 8, "pass_blocks": True},
            # two 16-row tiles a warp (the token operand reused twice): with 4 warps in registers (two stages of gate_up
            # would need 80 KB), with 2 warps staged
            "nt8_rt2_regs": {"n_tiles": 8, "row_tiles": 2, "stages": 0},
            "nt8_pb_w2_rt2": {"n_tiles": 8, "pass_blocks": True, "row_tiles": 2, "warps": 2},
            # block-tiled (``tiled``): 128 tokens x 128 weight rows a block, both operands in shared memory (prefill), at
            # its default ring (3 stages of k 32) and at S stages of k K (``tiled_k<K>s<S>``; dynamic shared memory past 48 KB)
            "tiled": {"tiled": True}, "tiled_k32s2": {"tiled": True, "tile_k": 32, "tile_stages": 2},
            "tiled_k32s4": {"tiled": True, "tile_k": 32, "tile_stages": 4},
            "tiled_k64s3": {"tiled": True, "tile_k": 64, "tile_stages": 3},
            "tiled_k64s4": {"tiled": True, "tile_k": 64, "tile_stages": 4},
            # more cp.async stages in dynamic shared memory (``dyn_shared``): a decode stage of gate_up is 20 KB (OLMoE) or
            # 24 KB (Mixtral), so 48 KB of static shared memory holds only 2 of them (down's: 12 and 16 KB, 3 and 3)
            "pipe_s3d": {"stages": 3, "dyn_shared": 3 * 24576}, "pipe_s4d": {"stages": 4, "dyn_shared": 4 * 24576},
            "pipe_s6d": {"stages": 6, "dyn_shared": 6 * 24576}}
# FP8 e4m3 weights (``experts_fp8`` is the default: the cp.async stages of bytes, 4 stages in 48 KB) with other launch
# shapes: the register-load form (the default before 12ec812), the prefill entry's block per pass, 3 stages; then the
# shapes that might lift its read rate at decode sizes (77% of the copy rate on the H100 where bf16 reads at 92%):
# 2 warps a block (twice the blocks, each with 4 or 6 stages), 8 warps, 8 stages in dynamic shared memory, no L2
# prefetch hint, a block per weight pass at the decode tiling
F16 = {"x_dtype": "float16", "h_dtype": "float16"}
FP8_VARIANTS = {"fp8_regs": {"stages": 0, "l2_prefetch": 0}, "fp8_s3": {"stages": 3},
                "fp8_nt8_pb": {"n_tiles": 8, "pass_blocks": True},
                "fp8_w2": {"warps": 2}, "fp8_w2_s6": {"warps": 2, "stages": 6}, "fp8_w8": {"warps": 8},
                "fp8_s8d": {"stages": 8, "dyn_shared": 8 * 16384}, "fp8_pf0": {"l2_prefetch": 0},
                "fp8_pb": {"pass_blocks": True},
                # the mma k16 step by k16 step over every token tile (``interleave``), and the mma in float16 (the
                # activations and h in float16: the e4m3 pairs widened by one conversion instruction, not three integer
                # operations); the float16 forms take x in float16 (cast before the timed call, not counted)
                "fp8_i": {"interleave": True}, "fp8_f16": F16, "fp8_f16_i": {**F16, "interleave": True},
                "fp8_f16_i_s6d": {**F16, "interleave": True, "stages": 6, "dyn_shared": 6 * 16384},
                # the codes stored tile-major (``w_tiles``, ``tile_fp8``: a warp's k-step one contiguous KB, its k loop
                # one stream, where the row-major codes give 64 bytes from each of 16 rows); codes permuted before the call
                "fp8_wt": {"w_tiles": True}, "fp8_f16_wt": {**F16, "w_tiles": True},
                "fp8_wt_pf128": {"w_tiles": True, "l2_prefetch": 128}, "fp8_wt_s6d": {"w_tiles": True, "stages": 6,
                                                                                   "dyn_shared": 6 * 16384},
                # two 16-row tiles a warp (twice a block's weight bytes a k-step, each token operand used twice; an FP8
                # block's k loop then as long as a bf16 one's), row-major and tile-major; gate_up's stage is then 20 KB
                "fp8_rt2": {"row_tiles": 2}, "fp8_wt_rt2": {"w_tiles": True, "row_tiles": 2},
                "fp8_wt_rt2_s4d": {"w_tiles": True, "row_tiles": 2, "stages": 4, "dyn_shared": 4 * 20480},
                # more blocks an SM (ncu: 4 blocks of 4 warps in every FP8 form, limited by registers and shared memory):
                # launch bounds of 5 or 6 blocks, 3 stages so that 6 gate_up blocks fit in shared memory
                "fp8_mb5": {"min_blocks": 5}, "fp8_mb6_s3": {"min_blocks": 6, "stages": 3},
                "fp8_wt_mb6_s3": {"w_tiles": True, "min_blocks": 6, "stages": 3}}
# timed cold too (each call after a 256 MB write; every kernel's own time from the device trace): the default and the
# forms that differ from it in shared memory, and the FP8 forms (on their own inputs)
COLD = ("experts", "experts_pipe_s3d", "experts_pipe_s4d", "experts_pipe_s6d")
COLD_FP8 = ("experts_fp8", *(f"experts_{v}" for v in FP8_VARIANTS if v != "fp8_nt8_pb"))  # (nt8_pb: the prefill form)


def build_module(shape, kind: str, only=None):
    """``experts(x [T, D], ids [T, K], rw [T, K], w1 [E, 2I, D], w2 [E, D, I]) -> out [T, D]`` (bf16 weights) and
    ``experts_fp8(x, ids, rw, c1, s1 [E, 2I], c2, s2 [E, D])`` (e4m3 bytes + per-output-channel scales)."""
    import tvm
    from tvm import relax

    from moec.schedules.kernels.grouped_experts import KERNELS

    e, k, d, i = shape
    bb = relax.BlockBuilder()
    for fname, (fmt, tc, launch) in _funcs(only, kind).items():
        slots = fname == SLOTS_FUNC  # then also slot_of [E] int32: the residency table, after route_prep's bounds
        spec = _spec(*shape, w_format=fmt, tensor_cores=tc, **launch, **({"slots": e} if slots else {}))
        gv = {n: bb.add_func(make(spec, kind).without_attr("global_symbol").with_attr("op_pattern", 8), f"moe_{n}_{fname}")
              for n, make in KERNELS.items()}
        t = tvm.tirx.Var("t", "int64")
        x = relax.Var("x", relax.TensorType((t, d), spec.x_dtype))
        ids = relax.Var("ids", relax.TensorType((t, k), "int64"))
        rw = relax.Var("rw", relax.TensorType((t, k), "float32"))
        wdt = "uint8" if fmt == "fp8" else DTYPE
        w1 = [relax.Var("w1", relax.TensorType((e, 2 * i, d), wdt))]
        w2 = [relax.Var("w2", relax.TensorType((e, d, i), wdt))]
        if fmt == "fp8":
            w1.append(relax.Var("s1", relax.TensorType((e, 2 * i), "float32")))
            w2.append(relax.Var("s2", relax.TensorType((e, d), "float32")))
        slot_of = [relax.Var("slot_of", relax.TensorType((e,), "int32"))] if slots else []
        with bb.function(fname, [x, ids, rw, *w1, *w2, *slot_of]):
            with bb.dataflow():
                prep = bb.emit(relax.call_tir(gv["route_prep"], [ids], out_ty=[relax.TensorType([e + 1], "int32"),
                                                                              relax.TensorType([t * k], "int32")]))
                off, order = bb.emit(relax.TupleGetItem(prep, 0)), bb.emit(relax.TupleGetItem(prep, 1))
                if slots:
                    off = bb.emit(relax.op.concat([off, *slot_of], axis=0))
                h = bb.emit(relax.call_tir(gv["gate_up"], [x, *w1, off, order], out_ty=relax.TensorType([t * k, i], spec.h_dtype)))
                y = bb.emit(relax.call_tir(gv["down"], [h, *w2, off, order, rw], out_ty=relax.TensorType([t * k, d], "float32")))
                out = bb.emit_output(relax.call_tir(gv["combine"], [y, ids], out_ty=relax.TensorType([t, d], DTYPE)))
            bb.emit_func_output(out)
    return bb.get()


def compile_module(shape, target, only=None):
    import tvm

    from moec.passes.pipeline import lowering_pipeline

    kind = "cuda" if target.kind.name == "cuda" else "llvm"
    return tvm.compile(build_module(shape, kind, only), target=target,
                       relax_pipeline=lowering_pipeline(target, list(_funcs(only, kind))))


def prepare(out: Path, small: bool, only=None, shapes=None) -> None:
    from moec.compiler.artifact import atomic_directory
    from moec.compiler.build import _compile_cuda_kernels
    from moec.compiler.targets import make_target
    from moec.schedules.kernels.grouped_experts import launch_config

    target = make_target("cuda", "sm_90")
    with atomic_directory(out) as tmp:
        index = {}
        for name, shape in {**SHAPES, **(SMALL if small else {})}.items():
            if shapes and name not in shapes:
                continue
            ex = compile_module(shape, target, only)
            sub = tmp / name
            sub.mkdir()
            kernels = _compile_cuda_kernels(ex, target, sub, progress=True)
            ex.export_library(str(sub / "lib.so"))
            funcs = _funcs(only)

            def configs(table, **fmt):  # the launch shapes of the built variants of ``table``
                return {v: {"spec": kw, **{k: launch_config(_spec(*shape, **fmt, **kw))[k] for k in ("gate_up", "down")}}
                        for v, kw in table.items() if f"experts_{v}" in funcs}

            index[name] = {"shape": dict(zip("EKDI", shape)), "cuda_kernels": kernels,
                           "launch_config": launch_config(_spec(*shape)), "functions": list(funcs),
                           "variants": configs(VARIANTS),
                           "fp8_variants": configs({"fp8": {}, **FP8_VARIANTS}, w_format="fp8")}
            print(json.dumps({name: index[name]["launch_config"]}), flush=True)
        (tmp / "index.json").write_text(json.dumps(index, indent=2))


# ---------------------------------------------------------------------------- run


def _vm(root: Path, name: str, shape, device: str):
    import tvm
    from tvm.runtime.vm import VirtualMachine

    if device == "cpu":
        return VirtualMachine(compile_module(shape, tvm.target.Target({"kind": "llvm"})), tvm.cpu(0)), tvm.cpu(0)
    from moec.runtime.engine import _load_cuda_runtime, _register_fatbins

    _load_cuda_runtime()
    index = json.loads((root / "index.json").read_text())
    _register_fatbins(root / name, index[name])
    dev = tvm.cuda(0)
    return VirtualMachine(tvm.runtime.load_module(str(root / name / "lib.so")), dev), dev


def _inputs(shape, t: int, device: str, seed: int):
    import torch

    e, k, d, i = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g)
    w1 = torch.randn(e, 2 * i, d, generator=g) * d**-0.5
    w2 = torch.randn(e, d, i, generator=g) * i**-0.5
    logits = torch.randn(t, e, generator=g)
    rw, ids = torch.softmax(logits, -1).topk(k, -1)
    dev = "cuda" if device == "cuda" else "cpu"
    return {"x": x.to(dev, torch.bfloat16), "ids": ids.to(dev), "rw": rw.to(dev), "w1": w1.to(dev, torch.bfloat16),
            "w2": w2.to(dev, torch.bfloat16)}


def quantize_fp8_torch(w):
    """(e4m3 bytes uint8, float32 scales per output channel) of [E, R, C] weights, on their device (as
    ``schedules.kernels.grouped_experts.quantize_fp8``: scale = max|row| / 448, round to nearest even)."""
    import torch

    wf = w.float()
    scale = (wf.abs().amax(-1) / 448.0).clamp_min(2.0**-24)
    codes = (wf / scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scale


def fp8_arguments(inp, args):
    """``(args_of, (c1, s1, c2, s2))``: the FP8 codes and scales of ``inp``'s weights, and ``args_of(variant)``, the
    arguments of FP8 form ``variant`` (``fp8`` or a key of FP8_VARIANTS): x in float16 for the float16 forms, the codes
    tile-major for ``w_tiles`` (each kind built once)."""
    import tvm

    (c1, s1), (c2, s2) = quantize_fp8_torch(inp["w1"]), quantize_fp8_torch(inp["w2"])
    built = {}

    def args_of(v):
        kw = FP8_VARIANTS.get(v, {})
        key = (kw.get("x_dtype") == "float16", bool(kw.get("w_tiles")))
        if key not in built:
            x = inp["x"].half() if key[0] else inp["x"]
            k1, k2 = (tile_fp8_torch(c1), tile_fp8_torch(c2)) if key[1] else (c1, c2)
            built[key] = [tvm.runtime.from_dlpack(x.contiguous())] + list(args[1:3]) + [
                tvm.runtime.from_dlpack(a.contiguous()) for a in (k1, s1, k2, s2)]
        return built[key]
    return args_of, (c1, s1, c2, s2)


def tile_fp8_torch(codes):
    """``schedules.kernels.grouped_experts.tile_fp8`` on a device tensor: each 16-row tile's k-steps of 64 in turn."""
    e, r, k = codes.shape
    return codes.reshape(e, r // 16, 16, k // 64, 64).permute(0, 1, 3, 2, 4).contiguous().reshape(e, r, k)


def dequantize_fp8_torch(codes, scale):
    import torch

    return codes.view(torch.float8_e4m3fn).float() * scale[..., None]


def hf_experts(x, ids, rw, w1, w2):
    """HF transformers' eager MoE experts: a loop over the experts that were hit, tokens gathered per expert."""
    import torch
    from torch.nn import functional as F

    out = torch.zeros_like(x)
    mask = F.one_hot(ids, w1.shape[0]).permute(2, 1, 0)  # E, K, T
    for e in (mask.sum(dim=(-1, -2)) > 0).nonzero()[:, 0].tolist():
        k_idx, t_idx = torch.where(mask[e])
        gate, up = F.linear(x[t_idx], w1[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * rw[t_idx, k_idx, None]
        out.index_add_(0, t_idx, y.to(out.dtype))
    return out


def reference(x, ids, rw, w1, w2):
    """float32 math over the bf16 inputs; h rounded to bf16 (as the kernel stores it), out not rounded."""
    import torch
    from torch.nn import functional as F

    t, k = ids.shape
    xs = x.float().repeat_interleave(k, 0)  # S, D
    flat = ids.reshape(-1)
    out = torch.zeros(t * k, x.shape[1], dtype=torch.float32, device=x.device)
    for e in flat.unique().tolist():
        sel = (flat == e).nonzero()[:, 0]
        gate, up = (xs[sel] @ w1[e].float().T).chunk(2, -1)
        h = (F.silu(gate) * up).to(torch.bfloat16).float()
        out[sel] = (h @ w2[e].float().T) * rw.reshape(-1)[sel, None].float()
    return out.view(t, k, -1).sum(1)


def _tvm_in(inp: dict):
    import tvm

    return [tvm.runtime.from_dlpack(inp[n].contiguous()) for n in ("x", "ids", "rw", "w1", "w2")]


def _torch_ms(fn, args, device: str, number: int, repeat: int) -> float:
    import torch

    fn(*args)
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(number):
                fn(*args)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / number)
        else:
            t0 = time.perf_counter()
            for _ in range(number):
                fn(*args)
            times.append((time.perf_counter() - t0) * 1e3 / number)
    return float(np.median(times))


COLD_REPS = 15
FLUSH_BYTES = 256 << 20  # written between calls: more than the L2 (50 MB) several times over


TLB_PAGE = 2 << 20  # the GPU's large pages: a byte written in each of many moves the address translations elsewhere


def cold_kernels_us(calls: dict, reps: int = COLD_REPS, tlb_bytes: int = 0) -> dict:
    """Per call of ``calls`` (name -> function of no arguments), each made right after a ``FLUSH_BYTES`` write so that
    its weights come from HBM as in a model's step: ``{kernel name: us, ..., "total": us}``, medians over ``reps`` of
    the kernels' own times (the CUPTI trace, ``moec.compiler.serve_bench.device_events``). ``tlb_bytes`` > 0: before
    the flush, also one byte written in every 2 MB page of a buffer of that size, as a decode step touches tens of GB
    between two launches of a kernel (its weights' address translations gone too, not only their L2 lines)."""
    import torch

    from moec.compiler.serve_bench import device_events

    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    pages = None
    if tlb_bytes:
        big = torch.zeros(tlb_bytes // TLB_PAGE * TLB_PAGE, dtype=torch.uint8, device="cuda")
        pages = big.view(-1, TLB_PAGE)[:, 0]  # a strided view: one byte a page
    names = list(calls)

    def go():
        for _ in range(reps):
            for n in names:
                if pages is not None:
                    pages.add_(1)
                flush.zero_()
                calls[n]()

    if pages is not None:
        pages.add_(1)  # (first launches are not traced)
    flush.zero_()
    _, events = device_events(go)
    if events is None:
        raise RuntimeError("cold timing: the device activity tracer could not start")
    return cold_segments(events, names, reps, pages is not None)


def cold_segments(events: list, names: list, reps: int, touched: bool = False) -> dict:
    """``cold_kernels_us``'s reading of the trace: the kernels in launch order; with ``touched`` the first is the page
    writes, dropped wherever its name recurs; the next is the flush, whose name marks each call's start. Per name of
    ``names`` (called in that order, ``reps`` rounds): its kernels' median times and the median of their total."""
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: float(e["ts"]))
    if touched:
        touch = kernels[0]["name"]
        kernels = [e for e in kernels if e["name"] != touch]
    fill = kernels[0]["name"]  # the first traced kernel is a flush: every kernel of its name marks a call's start
    segments, cur = [], None
    for e in kernels:
        if e["name"] == fill:
            cur = []
            segments.append(cur)
        else:
            cur.append((e["name"], float(e["dur"])))
    if len(segments) != reps * len(names) or any(not seg for seg in segments):
        raise RuntimeError(f"cold timing: {len(segments)} traced calls for {reps} x {len(names)} ({names})")
    out = {}
    for i, n in enumerate(names):
        runs = [segments[r * len(names) + i] for r in range(reps)]
        row = {}
        for j, (kname, _) in enumerate(runs[0]):
            row[kname] = float(np.median([run[j][1] for run in runs if len(run) == len(runs[0])]))
        row["total"] = float(np.median([sum(d for _, d in run) for run in runs]))
        out[n] = row
    return out


def copy_bandwidth(device: str) -> float:
    """GB/s of ``dst.copy_(src)`` (bytes read + written), 1 GiB on the GPU, 64 MiB on the CPU."""
    import torch

    n = (1 << 30) if device == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device="cuda" if device == "cuda" else "cpu")
    dst = torch.empty_like(src)
    ms = _torch_ms(lambda: dst.copy_(src), (), device, 20 if device == "cuda" else 3, 5)
    return 2 * n / ms / 1e6


def run_shape(vm, dev, name: str, shape, t: int, device: str, number: int, repeat: int, compiled, funcs=None) -> dict:
    """One shape at ``t`` tokens; ``funcs``: the module's functions (None: all of ``_funcs()``)."""
    import torch

    e, k, d, i = shape
    inp = _inputs(shape, t, device, seed=t)
    args = _tvm_in(inp)
    out = torch.from_dlpack(vm["experts"](*args)).float()
    ref = reference(**inp)
    scale = float(ref.abs().max()) or 1.0
    err = float((out - ref).abs().max()) / scale
    hf = hf_experts(**inp).float()
    row = {"shape": name, "E": e, "K": k, "D": d, "I": i, "tokens": t, "max_rel_error_vs_fp32": err,
           "max_rel_error_hf_vs_fp32": float((hf - ref).abs().max()) / scale, "passed": err < 2e-2}
    active = int(inp["ids"].unique().numel())
    row["active_experts"] = active
    row["active_weight_bytes"] = active * 3 * d * i * 2
    vm.save_function("experts", "experts_timed", *args)
    res = vm.time_evaluator("experts_timed", dev, number=number, repeat=repeat)()
    ms = {"moec_grouped": float(np.median(np.asarray(res.results))) * 1e3}
    # the warp-per-row form (no tensor cores) on the same inputs
    out_w = torch.from_dlpack(vm["experts_warp"](*args)).float()
    row["warp_form_max_rel_error_vs_fp32"] = float((out_w - ref).abs().max()) / scale
    row["passed"] = row["passed"] and row["warp_form_max_rel_error_vs_fp32"] < 2e-2
    vm.save_function("experts_warp", "experts_warp_timed", *args)
    res = vm.time_evaluator("experts_warp_timed", dev, number=number, repeat=repeat)()
    ms["moec_grouped_warp_form"] = float(np.median(np.asarray(res.results))) * 1e3
    funcs = set(funcs or _funcs())
    for v in VARIANTS:  # other launch shapes of the default form, on the same inputs
        if f"experts_{v}" not in funcs:
            continue
        out_v = torch.from_dlpack(vm[f"experts_{v}"](*args)).float()
        row[f"{v}_max_rel_error_vs_fp32"] = float((out_v - ref).abs().max()) / scale
        row["passed"] = row["passed"] and row[f"{v}_max_rel_error_vs_fp32"] < 2e-2
        vm.save_function(f"experts_{v}", f"experts_{v}_timed", *args)
        res = vm.time_evaluator(f"experts_{v}_timed", dev, number=number, repeat=repeat)()
        ms[f"moec_grouped_{v}"] = float(np.median(np.asarray(res.results))) * 1e3
    # the slot-pool form (offloaded experts): the experts at permuted slots of a pool, read through the table
    perm = torch.randperm(e, generator=torch.Generator().manual_seed(t)).to(inp["w1"].device)
    p1, p2 = torch.empty_like(inp["w1"]), torch.empty_like(inp["w2"])
    p1[perm], p2[perm] = inp["w1"], inp["w2"]
    import tvm

    args_s = args[:3] + [tvm.runtime.from_dlpack(a.contiguous()) for a in (p1, p2, perm.to(torch.int32))]
    out_s = torch.from_dlpack(vm[SLOTS_FUNC](*args_s)).float()
    row["slots_max_rel_error_vs_fp32"] = float((out_s - ref).abs().max()) / scale
    row["passed"] = row["passed"] and row["slots_max_rel_error_vs_fp32"] < 2e-2
    vm.save_function(SLOTS_FUNC, "experts_slots_timed", *args_s)
    res = vm.time_evaluator("experts_slots_timed", dev, number=number, repeat=repeat)()
    ms["moec_grouped_slots"] = float(np.median(np.asarray(res.results))) * 1e3
    del p1, p2, args_s
    # FP8 e4m3 weights: against the reference over the dequantized weights
    fp8_args, (c1, s1, c2, s2) = fp8_arguments(inp, args)

    ref8 = reference(inp["x"], inp["ids"], inp["rw"], dequantize_fp8_torch(c1, s1), dequantize_fp8_torch(c2, s2))
    row["active_weight_bytes_fp8"] = active * 3 * d * i
    for v in ("fp8", *FP8_VARIANTS):  # the default FP8 form, then its other launch shapes
        if f"experts_{v}" not in funcs:
            continue
        out8 = torch.from_dlpack(vm[f"experts_{v}"](*fp8_args(v))).float()
        row[f"{v}_max_rel_error_vs_dequantized"] = float((out8 - ref8).abs().max()) / (float(ref8.abs().max()) or 1.0)
        row[f"{v}_max_rel_error_vs_bf16_fp32"] = float((out8 - ref).abs().max()) / scale
        row["passed"] = row["passed"] and row[f"{v}_max_rel_error_vs_dequantized"] < 2e-2
        vm.save_function(f"experts_{v}", f"experts_{v}_timed", *fp8_args(v))
        res = vm.time_evaluator(f"experts_{v}_timed", dev, number=number, repeat=repeat)()
        ms[f"moec_grouped_{v}"] = float(np.median(np.asarray(res.results))) * 1e3
    tin = [inp[n] for n in ("x", "ids", "rw", "w1", "w2")]
    ms["torch_hf_loop"] = _torch_ms(hf_experts, tin, device, max(1, number // 10), repeat)
    if compiled is not None:
        try:
            ms["torch_compile_hf_loop"] = _torch_ms(compiled, tin, device, max(1, number // 10), repeat)
        except Exception as exc:  # noqa: BLE001 - report, keep the other numbers
            row["torch_compile_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    if device == "cuda":  # each call's kernels cold (weights from HBM), one by one
        row["cold_us"] = cold_kernels_us({**{f: (lambda fn=vm[f]: fn(*args)) for f in COLD if f in funcs},
                                          **{f: (lambda fn=vm[f], a=fp8_args(f[len("experts_"):]): fn(*a))
                                             for f in COLD_FP8 if f in funcs}})
        row["cold_GBps_active_weights"] = {f: row["active_weight_bytes_fp8" if "fp8" in f else "active_weight_bytes"]
                                           / v["total"] / 1e3 for f, v in row["cold_us"].items()}
    row["ms"] = ms
    row["GBps_active_weights"] = {k_: (row["active_weight_bytes_fp8"] if "fp8" in k_ else row["active_weight_bytes"]) / v / 1e6
                                  for k_, v in ms.items()}
    print(json.dumps(row), flush=True)
    return row


def profile(root: Path, name: str, t: int, launches: int, func: str = "experts") -> None:
    """Call ``func`` (the default form, or another built function: FP8 ones on FP8 codes of the same weights, float16
    forms on x in float16) ``launches`` times at ``t`` tokens of shape ``name`` (for a profiler such as ncu to wrap)."""
    shape = SHAPES[name]
    vm, dev = _vm(root, name, shape, "cuda")
    inp = _inputs(shape, t, "cuda", seed=t)
    args = _tvm_in(inp)
    if "fp8" in func:
        args = fp8_arguments(inp, args)[0](func[len("experts_"):])
    for _ in range(launches):
        vm[func](*args)
    dev.sync()


def _device_name(device: str) -> str:
    if device == "cpu":
        return platform.processor() or platform.machine()
    import torch

    return torch.cuda.get_device_name(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("step", choices=["prepare", "run", "profile"])
    ap.add_argument("dir", type=Path, help="prepared kernels (prepare writes it; run --device cuda reads it)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--commit", default="unknown", help="git commit of the tree the kernels were built from")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: the llvm build compiled in this process (needs the compiler), a dry run")
    ap.add_argument("--small", action="store_true", help="prepare: also the small shape; run: only the small shape")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--shape", default="olmoe", help="profile: the shape to call")
    ap.add_argument("--func", default="experts", help="profile: the function to call (experts_fp8, experts_fp8_f16, ...)")
    ap.add_argument("--launches", type=int, default=2, help="profile: calls at the first of --batches")
    ap.add_argument("--variants", nargs="+", help="prepare: build only these of the launch-shape variants (VARIANTS, "
                    "FP8_VARIANTS; the default, FP8, warp and slot-pool forms are always built)")
    ap.add_argument("--shapes", nargs="+", help=f"prepare / run: only these shapes (of {', '.join(SHAPES)})")
    args = ap.parse_args()
    if args.variants:
        unknown = set(args.variants) - set(VARIANTS) - set(FP8_VARIANTS)
        if unknown:
            ap.error(f"unknown variants: {', '.join(sorted(unknown))}")
    if args.step == "prepare":
        prepare(args.dir, args.small, args.variants, args.shapes)
        return 0
    if args.step == "profile":
        profile(args.dir, args.shape, args.batches[0], args.launches, args.func)
        return 0
    import torch

    shapes = SMALL if args.small else {k: v for k, v in SHAPES.items() if not args.shapes or k in args.shapes}
    doc = {"benchmark": "grouped_experts", "command": " ".join(["python3"] + sys.argv), "git_commit": args.commit,
           "python": platform.python_version(), "torch": torch.__version__,
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": _device_name(args.device),
           "dtype": DTYPE, "timing": "ms per call of one MoE layer's routed experts; medians of repeats"}
    if args.device == "cuda":
        doc["prepared"] = {k: {kk: vv for kk, vv in v.items() if kk != "cuda_kernels"}
                           for k, v in json.loads((args.dir / "index.json").read_text()).items()}
    doc["copy_GBps"] = copy_bandwidth(args.device)
    print(json.dumps({"copy_GBps": doc["copy_GBps"]}), flush=True)
    number, repeat = (50, 5) if args.device == "cuda" else (2, 3)
    compiled = None if args.no_compile else torch.compile(hf_experts, dynamic=True)
    doc["rows"] = []
    for name, shape in shapes.items():
        vm, dev = _vm(args.dir, name, shape, args.device)
        funcs = (json.loads((args.dir / "index.json").read_text())[name].get("functions")
                 if args.device == "cuda" else list(_funcs(kind="llvm")))  # (indexes before 12ec812: every function)
        for t in args.batches:
            doc["rows"].append(run_shape(vm, dev, name, shape, t, args.device, number, repeat, compiled, funcs))
            for r in doc["rows"][-1:]:
                r["fraction_of_copy"] = {k: v / doc["copy_GBps"] for k, v in r["GBps_active_weights"].items()}
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(doc, indent=2))
    return 0 if all(r["passed"] for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
