"""Grouped expert GEMM kernels (schedules/kernels/grouped_experts.py): llvm forms against NumPy (random ids with
empty experts, T = 1 and 37, K = 2/4/8, bf16 weights), the CUDA forms built for sm_90 (nvcc), and on a GPU
(marker ``gpu``) the CUDA forms against NumPy."""

import re
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
import tvm

from moec.compiler.errors import MoecError
from moec.compiler.targets import make_target
from moec.schedules.kernels.grouped_experts import (GroupedExpertsSpec, launch_config, make_grouped_experts, reference,
                                                    reference_route)

from moec_testing import require_cuda

LLVM = tvm.target.Target({"kind": "llvm"})
NP = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
_BUILT = {}


def _build(spec, target="llvm"):
    key = (spec, target)
    if key not in _BUILT:
        tgt = LLVM if target == "llvm" else make_target("cuda", "sm_90")
        _BUILT[key] = tvm.compile(tvm.IRModule(make_grouped_experts(spec, target)), target=tgt)
    return _BUILT[key]


def _ids(rng, t, k, e, used):
    """[T, K] distinct expert ids per token, drawn from ``used`` experts only (the others get no token)."""
    return np.stack([rng.choice(used, k, replace=False) for _ in range(t)])


def _run(ex, spec, x, w1, w2, ids, rw, dev=None):
    dev = dev or tvm.cpu()
    tt = lambda a: tvm.runtime.tensor(a, dev)  # noqa: E731
    t, k = ids.shape
    offsets, order = tt(np.full(spec.experts + 1, -7, np.int32)), tt(np.full(t * k, -7, np.int32))
    h = tt(np.zeros((t * k, spec.inter), NP[spec.h_dtype]))
    y = tt(np.full((t * k, spec.hidden), np.nan, np.float32))
    out = tt(np.zeros((t, spec.hidden), NP[spec.out_dtype]))
    ids_t = tt(ids.astype(spec.ids_dtype))
    ex["moe_route_prep"](ids_t, offsets, order)
    ex["moe_gate_up"](tt(x), tt(w1), offsets, order, h)
    ex["moe_down"](h, tt(w2), offsets, order, tt(rw), y)
    ex["moe_combine"](y, ids_t, out)
    return offsets.numpy(), order.numpy(), h.numpy().astype(np.float32), out.numpy().astype(np.float32)


def _data(spec, t, seed):
    rng = np.random.default_rng(seed)
    e, d, i, k = spec.experts, spec.hidden, spec.inter, spec.top_k
    used = rng.choice(e, max(k, e // 2), replace=False)  # about half the experts get no token at all
    ids = _ids(rng, t, k, e, used)
    x = rng.standard_normal((t, d)).astype(NP[spec.x_dtype])
    w1 = (rng.standard_normal((e, 2 * i, d)) * d**-0.5).astype(NP[spec.w_dtype])
    w2 = (rng.standard_normal((e, d, i)) * i**-0.5).astype(NP[spec.w_dtype])
    rw = rng.uniform(0.1, 1.0, (t, k)).astype(NP[spec.rw_dtype])
    return x, w1, w2, ids, rw


def _check(spec, got, x, w1, w2, ids, rw, tol):
    offsets, order, h, out = got
    want_off, want_order = reference_route(ids, spec.experts)
    np.testing.assert_array_equal(offsets, want_off)
    np.testing.assert_array_equal(order, want_order)  # stable: slots of an expert in slot order
    assert (np.diff(offsets) == 0).any()  # some experts had no token
    want_h, want_out = reference(x, w1, w2, ids, rw, spec.gate_first, NP[spec.h_dtype])
    np.testing.assert_allclose(h, want_h[order], rtol=tol, atol=tol)
    np.testing.assert_allclose(out, want_out, rtol=tol, atol=tol)


@pytest.mark.parametrize("k,e,gate_first", [(2, 8, True), (4, 16, False), (8, 32, True)])
def test_llvm_fp32_matches_numpy(k, e, gate_first):
    spec = GroupedExpertsSpec(hidden=48, inter=24, experts=e, top_k=k, gate_first=gate_first)
    ex = _build(spec)
    for t in (1, 37):  # one build, any token count
        data = _data(spec, t, seed=t * 10 + k)
        _check(spec, _run(ex, spec, *data), *data, tol=2e-5)


def test_llvm_bf16_weights_and_int32_ids():
    spec = GroupedExpertsSpec(hidden=64, inter=40, experts=8, top_k=2, x_dtype="bfloat16", w_dtype="bfloat16",
                              h_dtype="bfloat16", rw_dtype="bfloat16", out_dtype="float32", ids_dtype="int32")
    data = _data(spec, 37, seed=3)
    # h is rounded to bf16 (as the imported graph stores it): one bf16 step of h
    _check(spec, _run(_build(spec), spec, *data), *data, tol=2e-2)


def test_negative_and_out_of_range_ids():
    """Negative ids wrap (numpy / ONNX semantics); ids outside [0, E) after that belong to no expert and add 0."""
    spec = GroupedExpertsSpec(hidden=16, inter=8, experts=4, top_k=2)
    x, w1, w2, _, rw = _data(spec, 3, seed=1)
    ids = np.array([[-1, 0], [2, 9], [1, -5]], np.int64)  # -1 -> 3; 9 and -5 are out of range
    offsets, order, h, out = _run(_build(spec), spec, x, w1, w2, ids, rw)
    np.testing.assert_array_equal(offsets, [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(order[:4], [1, 4, 2, 0])  # the 2 invalid slots have no place
    safe = np.array([[3, 0], [2, 0], [1, 0]])
    keep = np.array([[1, 1], [1, 0], [1, 0]], np.float32)
    _, want = reference(x, w1, w2, safe, rw * keep)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


def test_refusals():
    with pytest.raises(MoecError, match="w_dtype must be one of"):
        make_grouped_experts(GroupedExpertsSpec(16, 8, 4, 2, w_dtype="int8"))
    with pytest.raises(MoecError, match="ids_dtype"):
        make_grouped_experts(GroupedExpertsSpec(16, 8, 4, 2, ids_dtype="float32"))
    with pytest.raises(MoecError, match="top-5 of 4"):
        make_grouped_experts(GroupedExpertsSpec(16, 8, 4, 5))
    with pytest.raises(MoecError, match="target must be"):
        make_grouped_experts(GroupedExpertsSpec(16, 8, 4, 2), "rocm")
    # the block-tiled forms: 16-bit weights on tensor cores, the expert width a multiple of 64, the hidden size of 128
    bf16 = {k: "bfloat16" for k in ("x_dtype", "w_dtype", "h_dtype")}
    with pytest.raises(MoecError, match="tiled needs 16-bit weights"):
        make_grouped_experts(GroupedExpertsSpec(256, 128, 4, 2, **bf16, w_format="fp8", tiled=True), "cuda")
    with pytest.raises(MoecError, match="hidden size of 128"):
        make_grouped_experts(GroupedExpertsSpec(192, 128, 4, 2, **bf16, tiled=True), "cuda")
    with pytest.raises(MoecError, match="tiled needs the mma form"):
        make_grouped_experts(GroupedExpertsSpec(256, 128, 4, 2, x_dtype="float32", w_dtype="bfloat16", tiled=True), "cuda")


# ---------------------------------------------------------------------------- CUDA forms (build only here)

OLMOE = GroupedExpertsSpec(hidden=2048, inter=1024, experts=64, top_k=8, **{k: "bfloat16" for k in (
    "x_dtype", "w_dtype", "h_dtype", "rw_dtype", "out_dtype")})


def _kernel_bodies(src):
    """Each kernel's definition in the CUDA source, by name."""
    starts = [(m.start(), m.group(2)) for m in re.finditer(r'extern "C" __global__ void __launch_bounds__\((\d+(?:, \d+)?)\) (\w+)\(', src)]
    return {name: src[a:(starts[i + 1][0] if i + 1 < len(starts) else len(src))] for i, (a, name) in enumerate(starts)}


def test_cuda_forms_build_for_sm90():
    from tvm.support import nvcc

    from moec.compiler.build import _cuda_modules

    import dataclasses

    default = launch_config(OLMOE)  # the cp.async form: 4 warps x 1 row tile, as many stages (of 4) as fit in 48 KB
    assert default["gate_up"]["form"] == default["down"]["form"] == "mma.sync m16n8k16, cp.async stages"
    assert default["gate_up"]["row_tiles"] == 1 and default["gate_up"]["stages"] == 2 and default["down"]["stages"] == 4
    cfg = launch_config(dataclasses.replace(OLMOE, stages=0))
    # the register form: 4 warps x 2 row tiles of 16 rows per block, 32 tokens (4 tiles of 8) per weight pass, k steps of 64
    assert cfg["gate_up"] == {"form": "mma.sync m16n8k16", "blocks": (8, 64), "threads": 128, "row_tiles": 2, "n_tiles": 4,
                              "tokens_per_pass": 32, "steps": 32}
    assert cfg["down"]["blocks"] == (16, 64) and cfg["down"]["steps"] == 16
    src = _cuda_modules(_build(dataclasses.replace(OLMOE, stages=0), "cuda").mod)[0].inspect_source("cuda")
    kernels = dict((n, int(b)) for b, n in re.findall(r'extern "C" __global__ void __launch_bounds__\((\d+)\) (\w+)\(', src))
    assert kernels == {"moe_route_prep_kernel": 1024, "moe_gate_up_kernel": 128, "moe_down_kernel": 128, "moe_combine_kernel": 256}
    bodies = _kernel_bodies(src)
    for name in ("moe_gate_up_kernel", "moe_down_kernel"):
        b = bodies[name]
        assert "uint4" in b and "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in b  # 16-byte loads, tensor cores
    # 2 row tiles x (gate, up) x 4 token tiles x 4 k steps; down: 2 x 4 x 4 (unrolled, each guarded by its tile's tokens)
    assert bodies["moe_gate_up_kernel"].count("mma.sync") == 64 and bodies["moe_down_kernel"].count("mma.sync") == 32
    # the operands mma reads are 16-bit arrays (a uint4-typed array would scale the fragment offsets by 16 bytes)
    assert not re.search(r"uint4 \w+_ptr\[", src) and re.findall(r"\(unsigned \*\)\((\w+)_ptr \+", src)
    assert "__match_any_sync" in src and "__popc" in src and "atomicAdd" not in src  # deterministic, no atomics
    with make_target("cuda", "sm_90"):
        assert len(nvcc.compile_cuda(src, target_format="fatbin", arch="sm_90", compiler="nvcc")) > 0


def test_cuda_warp_form_where_no_tensor_cores():
    """float32 weights, FP8 weights, a reduction that is not a multiple of 64 or ``tensor_cores=False`` keep the
    warp-per-row form (16-byte loads, shuffle reductions); Mixtral's shape takes 8 token tiles per pass."""
    from moec.compiler.build import _cuda_modules
    from moec.schedules.kernels.grouped_experts import mma_eligible, mma_tiles

    bf = {k: "bfloat16" for k in ("x_dtype", "w_dtype", "h_dtype", "rw_dtype", "out_dtype")}
    assert mma_eligible(OLMOE, "gate_up") and mma_eligible(OLMOE, "down")
    assert not mma_eligible(GroupedExpertsSpec(2048, 1024, 64, 8), "gate_up")  # float32
    assert not mma_eligible(GroupedExpertsSpec(2048, 1024, 64, 8, **{**bf, "x_dtype": "float32"}), "gate_up")
    assert not mma_eligible(GroupedExpertsSpec(2048 + 32, 1024, 64, 8, **bf), "gate_up")
    assert mma_eligible(GroupedExpertsSpec(2048 + 32, 1024, 64, 8, **bf), "down")  # its reduction is I
    assert mma_eligible(GroupedExpertsSpec(2048, 1024, 64, 8, **bf, w_format="fp8"), "down")  # widened in registers
    assert not mma_eligible(GroupedExpertsSpec(2048, 1024, 64, 8, w_format="fp8"), "down")  # float32 activations
    assert mma_tiles(GroupedExpertsSpec(4096, 14336, 8, 2, **bf)) == (8, 1, 1)
    assert mma_tiles(GroupedExpertsSpec(7168, 2048, 256, 8, **bf)) == (1, 1, 1)  # cp.async stages: one row tile
    assert mma_tiles(GroupedExpertsSpec(7168, 2048, 256, 8, **bf, stages=0)) == (1, 2, 2)
    with pytest.raises(MoecError, match="n_tiles"):
        GroupedExpertsSpec(64, 32, 8, 2, n_tiles=9).check()
    # row_tiles: one 16-row tile per warp doubles the blocks of OLMoE's gate_up (8 -> 16 per expert)
    assert mma_tiles(GroupedExpertsSpec(2048, 1024, 64, 8, **bf, row_tiles=1)) == (4, 1, 1)
    assert launch_config(GroupedExpertsSpec(2048, 1024, 64, 8, **bf, stages=0))["gate_up"]["blocks"] == (8, 64)
    assert launch_config(GroupedExpertsSpec(2048, 1024, 64, 8, **bf, row_tiles=1))["gate_up"]["blocks"] == (16, 64)
    with pytest.raises(MoecError, match="row_tiles"):
        GroupedExpertsSpec(64, 32, 8, 2, row_tiles=3).check()
    off = GroupedExpertsSpec(2048, 1024, 64, 8, **bf, tensor_cores=False)
    assert launch_config(off)["gate_up"]["form"] == "warp per row" and launch_config(off)["gate_up"]["blocks"] == (256, 64)
    src = _cuda_modules(_build(off, "cuda").mod)[0].inspect_source("cuda")
    for name in ("moe_gate_up_kernel", "moe_down_kernel"):
        b = _kernel_bodies(src)[name]
        assert "uint4" in b and "__shfl_xor_sync" in b and "mma.sync" not in b


def test_cuda_pipe_form_builds_for_sm90():
    """``stages``: the mma forms with their operands staged through shared memory by cp.async, as many stages as
    fit in 48 KB per block (OLMoE, 4 warps x 1 row tile: gate_up's stage is 16 KB of weights + 4 KB of tokens)."""
    from dataclasses import replace

    from tvm.support import nvcc

    from moec.compiler.build import _cuda_modules

    spec = replace(OLMOE, stages=4, row_tiles=1)
    cfg = launch_config(spec)
    assert cfg["gate_up"]["stages"] == 2 and cfg["gate_up"]["shared_bytes"] == 40960 and cfg["gate_up"]["blocks"] == (16, 64)
    assert cfg["down"]["stages"] == 4 and cfg["down"]["shared_bytes"] == 49152 and cfg["down"]["blocks"] == (32, 64)
    assert "stages" not in launch_config(replace(OLMOE, stages=0))["gate_up"]  # stages=0: register loads
    src = _cuda_modules(_build(spec, "cuda").mod)[0].inspect_source("cuda")
    bodies = _kernel_bodies(src)
    for name in ("moe_gate_up_kernel", "moe_down_kernel"):
        b = bodies[name]
        assert "cp.async.cg.shared.global" in src and "cp_async_wait_group" in b and "__syncthreads" in b
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in b
    # (gate, up) x 4 token tiles x 4 k steps; down: 4 x 4
    assert bodies["moe_gate_up_kernel"].count("mma.sync") == 32 and bodies["moe_down_kernel"].count("mma.sync") == 16
    with make_target("cuda", "sm_90"):
        assert len(nvcc.compile_cuda(src, target_format="fatbin", arch="sm_90", compiler="nvcc")) > 0
    # with the L2 prefetch hint
    src = _cuda_modules(_build(replace(spec, warps=2, l2_prefetch=256), "cuda").mod)[0].inspect_source("cuda")
    assert "cp.async.cg.shared.global.L2::256B" in src
    with make_target("cuda", "sm_90"):
        assert len(nvcc.compile_cuda(src, target_format="fatbin", arch="sm_90", compiler="nvcc")) > 0


def test_fp8_slot_forms_build_for_sm90():
    """FP8 weights read from a pool of expert slots (offloaded FP8 experts): the bf16 model's tensor-core form
    (codes widened in registers) and a float32 model's warp form compile for sm_90."""
    from dataclasses import replace

    from moec.compiler.build import _cuda_modules

    for spec in (replace(OLMOE, w_format="fp8", slots=96), GroupedExpertsSpec(256, 128, 16, 4, w_format="fp8", slots=20)):
        src = _cuda_modules(_build(spec, "cuda").mod)[0].inspect_source("cuda")
        body = _kernel_bodies(src)["moe_gate_up_kernel"]
        assert ("mma.sync" in body) == (spec.x_dtype == "bfloat16"), spec
        assert "offsets_ptr[" in body and "s_ptr[" in body  # the residency table and the scales


def test_pipe_refusals():
    from dataclasses import replace

    from moec.schedules.kernels.grouped_experts import check_supported

    for bad in ({"stages": 1}, {"stages": 9}, {"stages": True}):
        with pytest.raises(MoecError, match="stages"):
            replace(OLMOE, **bad).check()
    with pytest.raises(MoecError, match="l2_prefetch"):
        replace(OLMOE, l2_prefetch=32).check()
    # 8 warps x 2 row tiles of gate and up: 64 KB of weights per stage
    with pytest.raises(MoecError, match="exceed 49152 bytes"):
        check_supported(replace(OLMOE, stages=2, warps=8, row_tiles=2), "cuda")
    check_supported(replace(OLMOE, stages=2, warps=8, row_tiles=2), "llvm")  # the llvm form has no stages


@pytest.mark.gpu
@pytest.mark.parametrize("tensor_cores", [True, False])
@pytest.mark.parametrize("t", [1, 37, 128, 300])
def test_cuda_matches_numpy_on_gpu(t, tensor_cores):
    require_cuda()
    # 300 tokens: 75 slots per expert on average, two passes of 64 (the mma form's 8 tiles) for most experts
    spec = GroupedExpertsSpec(hidden=256, inter=128, experts=16, top_k=4, **{k: "bfloat16" for k in (
        "x_dtype", "w_dtype", "h_dtype", "rw_dtype")}, out_dtype="float32", tensor_cores=tensor_cores)
    data = _data(spec, t, seed=t)
    _check(spec, _run(_build(spec, "cuda"), spec, *data, dev=tvm.cuda()), *data, tol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("launch", [{"stages": 4, "row_tiles": 1}, {"stages": 4, "row_tiles": 1, "n_tiles": 2, "pass_blocks": True},
                                    {"stages": 4, "warps": 2, "row_tiles": 1, "l2_prefetch": 256},
                                    {"stages": 3, "warps": 3, "row_tiles": 1}, {"stages": 8, "warps": 1, "row_tiles": 1}])
@pytest.mark.parametrize("t", [1, 37, 300])
def test_cuda_pipe_form_matches_numpy_on_gpu(t, launch):
    """The cp.async forms; 3 warps: row blocks past the rows, token chunks that do not divide the threads; 300 tokens:
    several passes per expert (the stages are refilled between passes)."""
    require_cuda()
    spec = GroupedExpertsSpec(hidden=256, inter=128, experts=16, top_k=4, **{k: "bfloat16" for k in (
        "x_dtype", "w_dtype", "h_dtype", "rw_dtype")}, out_dtype="float32", **launch)
    data = _data(spec, t, seed=t)
    _check(spec, _run(_build(spec, "cuda"), spec, *data, dev=tvm.cuda()), *data, tol=3e-2)


# ---------------------------------------------------------------------------- FP8 e4m3 weights, per-output-channel scales


def _run_fp8(ex, spec, x, c1, s1, c2, s2, ids, rw, dev=None):
    dev = dev or tvm.cpu()
    tt = lambda a: tvm.runtime.tensor(a, dev)  # noqa: E731
    t, k = ids.shape
    offsets, order = tt(np.zeros(spec.experts + 1, np.int32)), tt(np.zeros(t * k, np.int32))
    h = tt(np.zeros((t * k, spec.inter), NP[spec.h_dtype]))
    y = tt(np.zeros((t * k, spec.hidden), np.float32))
    out = tt(np.zeros((t, spec.hidden), NP[spec.out_dtype]))
    ids_t = tt(ids.astype(spec.ids_dtype))
    ex["moe_route_prep"](ids_t, offsets, order)
    ex["moe_gate_up"](tt(x), tt(c1), tt(s1), offsets, order, h)
    ex["moe_down"](h, tt(c2), tt(s2), offsets, order, tt(rw), y)
    ex["moe_combine"](y, ids_t, out)
    return offsets.numpy(), order.numpy(), h.numpy().astype(np.float32), out.numpy().astype(np.float32)


@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
def test_llvm_fp8_weights_match_numpy(x_dtype):
    from moec.schedules.kernels.grouped_experts import dequantize_fp8, quantize_fp8

    spec = GroupedExpertsSpec(hidden=64, inter=24, experts=8, top_k=4, x_dtype=x_dtype, h_dtype=x_dtype, w_format="fp8")
    x, w1, w2, ids, rw = _data(spec, 37, seed=5)
    (c1, s1), (c2, s2) = quantize_fp8(w1), quantize_fp8(w2)
    assert c1.dtype == np.uint8 and s1.shape == (8, 48) and s2.shape == (8, 64)
    d1, d2 = dequantize_fp8(c1, s1), dequantize_fp8(c2, s2)
    assert np.abs(d1 - w1).max() <= np.abs(w1).max() / 16  # e4m3: 3 mantissa bits
    got = _run_fp8(_build(spec), spec, x, c1, s1, c2, s2, ids, rw)
    # against the dequantized weights: the kernel's integer e4m3 decode is exact, scales factor out of the sums
    _check(spec, got, x, d1, d2, ids, rw, tol=2e-5 if x_dtype == "float32" else 2e-2)


def test_cuda_fp8_builds_for_sm90():
    import dataclasses

    from tvm.support import nvcc

    from moec.compiler.build import _cuda_modules

    spec = GroupedExpertsSpec(hidden=2048, inter=1024, experts=64, top_k=8, x_dtype="bfloat16", h_dtype="bfloat16",
                              rw_dtype="bfloat16", out_dtype="bfloat16", w_format="fp8")
    # tensor cores, cp.async stages of e4m3 bytes (16 a lane and row), widened two at a time (the prelude's helper,
    # whose prmt is inline PTX: nvcc compiles it below)
    cfg = launch_config(spec)
    assert cfg["gate_up"]["form"] == cfg["down"]["form"] == "mma.sync m16n8k16, cp.async stages, e4m3 weights widened in registers"
    assert cfg["gate_up"]["stages"] == 4 and cfg["gate_up"]["row_tiles"] == 1
    assert cfg["gate_up"]["shared_bytes"] == 4 * (4 * 2 * 16 * 64 + 4 * 8 * 64 * 2)  # 8 KB of weights, 4 KB of tokens
    src = _cuda_modules(_build(spec, "cuda").mod)[0].inspect_source("cuda")
    for name in ("moe_gate_up_kernel", "moe_down_kernel"):
        b = _kernel_bodies(src)[name]
        assert "moec_e4m3x2_bf16s_lo(" in b and "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in b and "cp_async" in b
    # register loads (stages 0): 8 e4m3 bytes a load per row
    reg = dataclasses.replace(spec, stages=0)
    cfg = launch_config(reg)
    assert cfg["gate_up"]["form"] == cfg["down"]["form"] == "mma.sync m16n8k16, e4m3 weights widened in registers"
    assert "stages" not in cfg["gate_up"] and cfg["gate_up"]["row_tiles"] == 2
    rsrc = _cuda_modules(_build(reg, "cuda").mod)[0].inspect_source("cuda")
    for name in ("moe_gate_up_kernel", "moe_down_kernel"):
        b = _kernel_bodies(rsrc)[name]
        assert "uint2" in b and "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in b and "cp_async" not in b
    with make_target("cuda", "sm_90"):
        for s in (src, rsrc):
            assert len(nvcc.compile_cuda(s, target_format="fatbin", arch="sm_90", compiler="nvcc")) > 0
    # the warp-per-row form stays where asked for
    src = _cuda_modules(_build(dataclasses.replace(spec, tensor_cores=False), "cuda").mod)[0].inspect_source("cuda")
    assert "mma.sync" not in _kernel_bodies(src)["moe_gate_up_kernel"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fp8_widening_is_exact(dtype):
    """Every finite e4m3 byte widened by bit placement (``_fp8_widen``) is its value times 2^-120 (bfloat16) or
    2^-8 (float16), subnormals included: the epilogues' factor restores it exactly."""
    from tvm.script import tirx as T

    from moec.schedules.kernels.grouped_experts import _FP8_WIDEN, _fp8_widen

    @T.prim_func(s_tir=True)
    def widen(a: T.Buffer((256,), "uint8"), b: T.Buffer((256,), dtype)):
        for i in range(256):
            with T.sblock("w"):
                vi = T.axis.spatial(256, i)
                b[vi] = _fp8_widen(a[vi], dtype)

    f = tvm.compile(tvm.IRModule({"widen": widen}), target=LLVM)
    codes = np.arange(256, dtype=np.uint8)
    out = tvm.runtime.tensor(np.zeros(256, NP[dtype]))
    f(tvm.runtime.tensor(codes), out)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    got = out.numpy().astype(np.float64) * _FP8_WIDEN[dtype][1]
    finite = np.isfinite(want)
    assert finite.sum() == 254  # 0x7F and 0xFF are the NaNs (quantize_fp8 never writes them)
    np.testing.assert_array_equal(got[finite], want[finite])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fp8_pair_widening_matches_the_bytes(dtype):
    """``_fp8_widen_pair`` (the cp.async forms' widening, two bytes of a word at a time) puts every pair of e4m3
    bytes, from either half of a word, into a fragment register as their values over ``_FP8_PAIR_FACTOR`` (the
    epilogues' factor), exactly, subnormals and signed zeros included: all 65,536 pairs, on the CUDA emulation
    (its ``prmt`` replicates signs as the device's does; float16 is the device's conversion instruction). The
    bfloat16 bits also equal ``_fp8_widen``'s (the register form's)."""
    from cuda_emu import EmulatedKernel
    from tvm.script import tirx as T

    from moec.compiler.build import _cuda_modules
    from moec.schedules.kernels.grouped_experts import _FP8_PAIR_FACTOR, _FP8_WIDEN, _fp8_widen_pair

    @T.prim_func(s_tir=True)
    def widen_pairs(a: T.Buffer((65536,), "uint32"), b: T.Buffer((131072,), "uint32")):
        T.func_attr({"global_symbol": "widen_pairs", "tirx.noalias": True})
        for bx in T.thread_binding(256, thread="blockIdx.x"):
            for tx in T.thread_binding(256, thread="threadIdx.x"):
                with T.sblock("w"):
                    b[(bx * 256 + tx) * 2] = _fp8_widen_pair(a[bx * 256 + tx], 0, dtype)
                    b[(bx * 256 + tx) * 2 + 1] = _fp8_widen_pair(a[bx * 256 + tx], 1, dtype)

    src = _cuda_modules(tvm.compile(tvm.IRModule({"widen_pairs": widen_pairs}), target=make_target("cuda", "sm_90")).mod)[0]
    lo = np.arange(65536, dtype=np.uint32)  # bytes 0, 1 = the pair; bytes 2, 3 = the pair with its bytes swapped
    words = lo | (((lo >> 8) | ((lo & 0xFF) << 8)) << 16)
    out = np.zeros(131072, np.uint32)
    EmulatedKernel(src.inspect_source("cuda"), "widen_pairs_kernel")((256, 1, 1), 256, a=words, b=out)

    def values(halves):  # 16-bit patterns -> float64 values times the factor
        return (halves.astype(np.uint16).view(NP[dtype]).astype(np.float64)) * _FP8_PAIR_FACTOR[dtype]

    def want(byte):
        return byte.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)

    b0, b1 = lo & 0xFF, lo >> 8
    finite = np.isfinite(want(b0)) & np.isfinite(want(b1))
    assert finite.sum() == 254 * 254
    for reg, first, second in ((out[0::2], b0, b1), (out[1::2], b1, b0)):
        lo_h, hi_h = values(reg & 0xFFFF), values(reg >> 16)
        np.testing.assert_array_equal(lo_h[finite], want(first)[finite])
        np.testing.assert_array_equal(hi_h[finite], want(second)[finite])
        np.testing.assert_array_equal(np.signbit(lo_h[finite]), np.signbit(want(first)[finite]))  # -0 stays -0
    if dtype == "bfloat16":  # the register form's bits (``_fp8_widen``), NaN bytes included
        def one(byte):
            return ((byte & 0x80) << 8) | ((byte & 0x7F) << _FP8_WIDEN[dtype][0])

        np.testing.assert_array_equal(out[0::2], one(b0) | (one(b1) << 16))
        np.testing.assert_array_equal(out[1::2], one(b1) | (one(b0) << 16))


def test_fp8_tile_layout():
    """``tile_fp8`` puts each 16-row tile's k-steps of 64 columns one after another (1 KB each, row after row) and
    ``untile_fp8`` undoes it; ``w_tiles`` is refused outside the CUDA cp.async FP8 forms and for shapes whose
    reductions are not whole k-steps."""
    from moec.schedules.kernels.grouped_experts import check_supported, tile_fp8, untile_fp8

    codes = np.random.default_rng(0).integers(0, 256, (2, 32, 128), dtype=np.uint8)
    t = tile_fp8(codes)
    assert t.shape == codes.shape and t.dtype == np.uint8
    flat = t.reshape(2, -1)
    for e, r, k in [(0, 0, 0), (1, 17, 5), (0, 31, 127), (1, 15, 64), (0, 16, 63)]:
        pos = (r // 16) * 16 * 128 + (k // 64) * 1024 + (r % 16) * 64 + k % 64
        assert flat[e, pos] == codes[e, r, k]
    np.testing.assert_array_equal(untile_fp8(t), codes)
    fp8 = GroupedExpertsSpec(hidden=128, inter=64, experts=4, top_k=2, x_dtype="bfloat16", h_dtype="bfloat16",
                             w_format="fp8", w_tiles=True)
    check_supported(fp8, "cuda")
    for bad in ({"stages": 0}, {"w_format": "float", "w_dtype": "bfloat16"}, {"tensor_cores": False}):
        with pytest.raises(MoecError, match="w_tiles"):
            replace(fp8, **bad).check()
    with pytest.raises(MoecError, match="w_tiles"):
        check_supported(fp8, "llvm")
    with pytest.raises(MoecError, match="w_tiles"):
        check_supported(replace(fp8, inter=96), "cuda")  # down's reduction: 96, not whole k-steps of 64
    for bad in ({"min_blocks": 17}, {"min_blocks": True}, {"min_blocks": 2, "stages": 0, "w_tiles": False}):
        with pytest.raises(MoecError, match="min_blocks"):
            replace(fp8, **bad).check()


def test_int64_weight_indexing(monkeypatch):
    """Stacked weights of 2^31 elements or more (e.g. 256 experts x 4096 x 7168) are indexed in int64: forced
    here on small shapes, the llvm forms still match NumPy (float and FP8), the CUDA form's offsets are 64-bit."""
    from moec.compiler.build import _cuda_modules
    from moec.schedules.kernels import grouped_experts as ge

    monkeypatch.setattr(ge, "INT64_INDEX_ELEMENTS", 1)
    spec = GroupedExpertsSpec(hidden=32, inter=16, experts=8, top_k=2, token_tile=4)
    prim = ge.make_gate_up(spec)
    assert "w: T.Buffer((T.int64(8), T.int64(32), T.int64(32))" in prim.script()
    ex = tvm.compile(tvm.IRModule(make_grouped_experts(spec)), target=LLVM)
    data = _data(spec, 9, seed=2)
    _check(spec, _run(ex, spec, *data), *data, tol=2e-5)
    monkeypatch.undo()  # a DeepSeek-V3-sized layer (256 x 4096 x 7168 gate/up weights): 64-bit offsets on CUDA
    big = GroupedExpertsSpec(hidden=7168, inter=2048, experts=256, top_k=8, x_dtype="bfloat16", w_dtype="bfloat16",
                             h_dtype="bfloat16", stages=0)
    src = _cuda_modules(tvm.compile(tvm.IRModule({"g": ge.make_gate_up(big, "cuda")}), target=make_target("cuda", "sm_90")).mod)[0]
    assert "w_ptr + ((((((((int64_t)((int)blockIdx.y)) * (int64_t)29360128)" in src.inspect_source("cuda")
    from dataclasses import replace

    pipe = _cuda_modules(tvm.compile(tvm.IRModule({"g": ge.make_gate_up(replace(big, stages=4), "cuda")}),
                                      target=make_target("cuda", "sm_90")).mod)[0]
    assert "((int64_t)((int)blockIdx.y)) * (int64_t)29360128" in pipe.inspect_source("cuda")  # the cp.async form too


# ---------------------------------------------------------------------------- slot pool (offloaded experts)


def _pool(rng, spec, w, fill, used):
    """Stacked per-expert weights ``w`` [E, ...] placed in a pool of ``spec.slots`` slots at random distinct slots
    (the experts in ``used`` only: the others are not resident); every other slot holds ``fill``, so a read of a
    wrong slot shows in the output. Returns (pool, slot_of [E] int32, non-residents at a slot far out of range)."""
    pool = np.full((spec.slots,) + w.shape[1:], fill, w.dtype)
    slot_of = np.full(spec.experts, 10**6, np.int32)
    slot_of[used] = rng.choice(spec.slots, len(used), replace=False)
    pool[slot_of[used]] = w[used]
    return pool, slot_of


def _run_slots(ex, spec, x, w1, w2, slot_of, ids, rw, scales=None, dev=None):
    """route_prep as usual, then the GEMMs read offsets [2E + 1]: its bounds and the residency table."""
    dev = dev or tvm.cpu()
    tt = lambda a: tvm.runtime.tensor(a, dev)  # noqa: E731
    t, k = ids.shape
    offsets, order = tt(np.zeros(spec.experts + 1, np.int32)), tt(np.zeros(t * k, np.int32))
    ids_t = tt(ids.astype(spec.ids_dtype))
    ex["moe_route_prep"](ids_t, offsets, order)
    full = tt(np.concatenate([offsets.numpy(), slot_of]))
    h = tt(np.zeros((t * k, spec.inter), NP[spec.h_dtype]))
    y = tt(np.zeros((t * k, spec.hidden), np.float32))
    out = tt(np.zeros((t, spec.hidden), NP[spec.out_dtype]))
    s1, s2 = ([tt(scales[0])], [tt(scales[1])]) if scales is not None else ([], [])
    ex["moe_gate_up"](tt(x), tt(w1), *s1, full, order, h)
    ex["moe_down"](h, tt(w2), *s2, full, order, tt(rw), y)
    ex["moe_combine"](y, ids_t, out)
    return offsets.numpy(), order.numpy(), h.numpy().astype(np.float32), out.numpy().astype(np.float32)


@pytest.mark.parametrize("slots", [5, 11])  # fewer slots than the 8 experts (only the routed ones resident), and more
def test_llvm_slot_pool_matches_numpy(slots):
    """``slots``: the expert weights are a pool of slots and a table names each expert's; same numbers as the
    stacked weights, and only the routed experts' slots are read (the rest hold NaN)."""
    spec = GroupedExpertsSpec(hidden=48, inter=24, experts=8, top_k=2, slots=slots)
    rng = np.random.default_rng(slots)
    x, w1, w2, _, rw = _data(spec, 13, seed=slots)
    used = rng.choice(8, 4, replace=False)
    ids = _ids(rng, 13, 2, 8, used)
    p1, slot_of = _pool(rng, spec, w1, np.nan, used)
    p2 = np.full((slots,) + w2.shape[1:], np.nan, w2.dtype)
    p2[slot_of[used]] = w2[used]
    ex = _build(spec)
    prim = tvm.IRModule(make_grouped_experts(spec))["gate_up"]
    assert f"w: T.Buffer(({slots}, 48, 48)" in prim.script() and "offsets: T.Buffer((17,), \"int32\")" in prim.script()
    got = _run_slots(ex, spec, x, p1, p2, slot_of, ids, rw)
    _check(spec, got, x, w1, w2, ids, rw, tol=2e-5)


def test_llvm_slot_pool_fp8():
    from dataclasses import replace

    from moec.schedules.kernels.grouped_experts import dequantize_fp8, quantize_fp8

    spec = GroupedExpertsSpec(hidden=64, inter=24, experts=8, top_k=4, w_format="fp8", slots=6)
    rng = np.random.default_rng(4)
    x, w1, w2, _, rw = _data(spec, 9, seed=4)
    used = rng.choice(8, 5, replace=False)
    ids = _ids(rng, 9, 4, 8, used)
    (c1, s1), (c2, s2) = quantize_fp8(w1), quantize_fp8(w2)
    pc1, slot_of = _pool(rng, spec, c1, 0x7F, used)  # 0x7F: the e4m3 NaN
    pc2 = np.full((6,) + c2.shape[1:], 0x7F, np.uint8)
    ps1, ps2 = np.full((6, 48), np.nan, np.float32), np.full((6, 64), np.nan, np.float32)
    pc2[slot_of[used]], ps1[slot_of[used]], ps2[slot_of[used]] = c2[used], s1[used], s2[used]
    got = _run_slots(_build(spec), spec, x, pc1, pc2, slot_of, ids, rw, scales=(ps1, ps2))
    _check(spec, got, x, dequantize_fp8(c1, s1), dequantize_fp8(c2, s2), ids, rw, tol=2e-5)
    with pytest.raises(MoecError, match="slots must be"):
        replace(spec, slots=-1).check()


@pytest.mark.parametrize("launch", [{}, {"stages": 0}, {"w_format": "fp8"}])
def test_cuda_slot_pool_builds_for_sm90(launch):
    """The CUDA forms (cp.async, register mma, FP8 warp) read each expert's slot once per block, from
    ``offsets[E + 1 + e]``, and index the pool with it."""
    from dataclasses import replace

    from tvm.support import nvcc

    from moec.compiler.build import _cuda_modules

    spec = replace(OLMOE, slots=24, **launch)
    src = _cuda_modules(_build(spec, "cuda").mod)[0].inspect_source("cuda")
    bodies = _kernel_bodies(src)
    for name in ("moe_gate_up_kernel", "moe_down_kernel"):
        assert "int we = offsets_ptr[(((int)blockIdx.y) + 65)];" in bodies[name], name
        assert re.search(r"w_ptr\[\(*\(?we \*", bodies[name]) or "(we *" in bodies[name], name
    with make_target("cuda", "sm_90"):
        assert len(nvcc.compile_cuda(src, target_format="fatbin", arch="sm_90", compiler="nvcc")) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("launch", [{}, {"stages": 0}, {"tensor_cores": False}])
def test_cuda_slot_pool_matches_numpy_on_gpu(launch):
    from dataclasses import replace

    require_cuda()
    spec = replace(GroupedExpertsSpec(hidden=256, inter=128, experts=16, top_k=4, **{k: "bfloat16" for k in (
        "x_dtype", "w_dtype", "h_dtype", "rw_dtype")}, out_dtype="float32", slots=10), **launch)
    rng = np.random.default_rng(7)
    x, w1, w2, _, rw = _data(spec, 37, seed=7)
    used = rng.choice(16, 8, replace=False)
    ids = _ids(rng, 37, 4, 16, used)
    p1, slot_of = _pool(rng, spec, w1, np.nan, used)
    p2 = np.full((10,) + w2.shape[1:], np.nan, w2.dtype)
    p2[slot_of[used]] = w2[used]
    got = _run_slots(_build(spec, "cuda"), spec, x, p1, p2, slot_of, ids, rw, dev=tvm.cuda())
    _check(spec, got, x, w1, w2, ids, rw, tol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("launch", [{"tensor_cores": True}, {"tensor_cores": True, "stages": 0},
                                    {"tensor_cores": True, "pass_blocks": True, "n_tiles": 2}, {"tensor_cores": False}])
@pytest.mark.parametrize("t", [1, 37, 300])
def test_cuda_fp8_matches_numpy_on_gpu(t, launch):
    """FP8 weights on the GPU: the tensor-core forms (cp.async stages, by default, or register loads; the bytes
    widened in registers), a block per pass, and the warp-per-row form, against the dequantized weights; 300
    tokens: several weight passes per expert."""
    from moec.schedules.kernels.grouped_experts import dequantize_fp8, quantize_fp8

    require_cuda()
    spec = GroupedExpertsSpec(hidden=256, inter=128, experts=16, top_k=4, x_dtype="bfloat16", h_dtype="bfloat16",
                              rw_dtype="bfloat16", out_dtype="float32", w_format="fp8", **launch)
    x, w1, w2, ids, rw = _data(spec, t, seed=t)
    (c1, s1), (c2, s2) = quantize_fp8(w1), quantize_fp8(w2)
    got = _run_fp8(_build(spec, "cuda"), spec, x, c1, s1, c2, s2, ids, rw, dev=tvm.cuda())
    _check(spec, got, x, dequantize_fp8(c1, s1), dequantize_fp8(c2, s2), ids, rw, tol=3e-2)


@pytest.mark.parametrize("t,launch", [(37, {"stages": 0}), (300, {"stages": 0}), (300, {"stages": 4, "row_tiles": 1}),
                                      (300, {"stages": 4, "row_tiles": 1, "n_tiles": 2, "pass_blocks": True}),
                                      (37, {"stages": 3, "warps": 3, "row_tiles": 1, "pass_blocks": True}),
                                      (300, {"stages": 6, "row_tiles": 1, "dyn_shared": 6 * 24576}),
                                      (37, {"tiled": True}), (700, {"tiled": True}), (300, {"tiled": True, "tile_stages": 2}),
                                      (300, {"tiled": True, "tile_stages": 5}), (700, {"tiled": True, "tile_k": 64, "tile_stages": 4}),
                                      (300, {"stages": 4, "row_tiles": 1, "interleave": True}),
                                      (37, {"stages": 3, "warps": 3, "row_tiles": 1, "n_tiles": 5, "interleave": True})])
def test_mma_forms_emulated(t, launch):
    """The mma.sync kernels on the CPU emulation of tests/cuda_emu.py. The register form and the cp.async form (4
    stages) matched numpy on the H200 (``test_cuda_matches_numpy_on_gpu``, ``test_cuda_pipe_form_matches_numpy_on_gpu``):
    a check of the emulator's mma fragments, which the kernels not yet run on a GPU are tested with; then the
    cp.async form with a block per pass (``pass_blocks``, the prefill entry's): 2 token tiles make several passes
    per expert, 3 warps leave row blocks past the rows; and 6 stages in dynamic shared memory (``dyn_shared``: a stage
    of gate_up is 24 KB here, so static shared memory holds 2). The block-tiled forms (``tiled``) with rings of 2 to 5
    stages of k 32 or 64 (past 48 KB in dynamic shared memory; down's 2 k-steps of 64 fewer than 4 stages), over
    experts with one token tile (300 tokens) and with two (700: the next tile's first stages refill a ring the last
    tile's steps read)."""
    from cuda_emu import EmulatedKernel

    from moec.compiler.build import _cuda_modules

    spec = GroupedExpertsSpec(hidden=256, inter=128, experts=16, top_k=4, **{k: "bfloat16" for k in (
        "x_dtype", "w_dtype", "h_dtype", "rw_dtype")}, out_dtype="float32", **launch)
    src = _cuda_modules(_build(spec, "cuda").mod)[0].inspect_source("cuda")
    assert "mma.sync" in src
    cfg = launch_config(spec)
    if spec.tiled:
        assert ("extern __shared__" in src) == (cfg["gate_up"]["shared_bytes"] > 49152) and "dynamic" not in cfg["gate_up"]["form"] \
            or cfg["gate_up"]["shared_bytes"] > 49152
        assert cfg["gate_up"]["stages"] == spec.tile_stages and cfg["down"]["steps"] == spec.inter // spec.tile_k
    if spec.dyn_shared:
        assert "extern __shared__" in src and cfg["gate_up"]["stages"] == 6 and cfg["down"]["stages"] == 6
        assert cfg["gate_up"]["shared_bytes"] == 6 * 24576 and "dynamic" in cfg["gate_up"]["form"]
        assert launch_config(replace(spec, dyn_shared=0))["gate_up"]["stages"] == 2  # 48 KB: two stages of 24 KB
        with pytest.raises(MoecError, match="dyn_shared must be"):
            replace(spec, dyn_shared=4096).check()
    k = {name: EmulatedKernel(src, f"moe_{name}_kernel") for name in ("route_prep", "gate_up", "down", "combine")}
    x, w1, w2, ids, rw = _data(spec, t, seed=t)
    offsets, order = np.zeros(spec.experts + 1, np.int32), np.zeros(t * 4, np.int32)
    h = np.zeros((t * 4, spec.inter), ml_dtypes.bfloat16)
    y = np.zeros((t * 4, spec.hidden), np.float32)
    out = np.zeros((t, spec.hidden), np.float32)
    ids = ids.astype(np.int64)
    def grid(c):
        if "grid" in c:  # a block per pass: ceil(T / tokens per pass) x (row tiles x experts)
            return (-(-t // c["tokens_per_pass"]), c["grid"][1], 1)
        return (c["blocks"][0] if c["blocks"][0] != "T" else t, c["blocks"][1], 1)

    # (the generated route_prep takes the slot count T * K as a hoisted scalar, combine the token count as N; the
    # pass-block forms' grids depend on the token count, so they take it too)
    extra = {"N": t} if spec.pass_blocks else {}
    k["route_prep"](grid(cfg["route_prep"]), cfg["route_prep"]["threads"], ids=ids, offsets=offsets, order=order, cse_v1=t * 4)
    k["gate_up"](grid(cfg["gate_up"]), cfg["gate_up"]["threads"], x=x, w=w1, offsets=offsets, order=order, h=h, **extra)
    k["down"](grid(cfg["down"]), cfg["down"]["threads"], h=h, w=w2, offsets=offsets, order=order, rw=rw, y=y, **extra)
    k["combine"](grid(cfg["combine"]), cfg["combine"]["threads"], y=y, ids=ids, out=out, N=t)
    _check(spec, (offsets, order, h.astype(np.float32), out), x, w1, w2, ids, rw, tol=3e-2)


@pytest.mark.parametrize("experts,k,t,ids_dtype", [(8, 2, 1, "int64"), (64, 8, 37, "int64"), (100, 3, 700, "int32"),
                                                  (512, 4, 50, "int64")])
def test_route_prep_cuda_emulated(experts, k, t, ids_dtype):
    """route_prep's CUDA form on the emulator against the stable counting sort: warps owning contiguous chunks of
    slots, the lanes of one expert found by a match and counted by the lowest of them, a partial last chunk, experts
    not a multiple of 32 and more than 159 (fewer warps: ``prep_warps``), negative ids that wrap and ids that belong
    to no expert."""
    from cuda_emu import EmulatedKernel

    from moec.compiler.build import _cuda_modules
    from moec.schedules.kernels.grouped_experts import prep_warps

    spec = GroupedExpertsSpec(hidden=64, inter=64, experts=experts, top_k=k, ids_dtype=ids_dtype)
    src = _cuda_modules(_build(spec, "cuda").mod)[0].inspect_source("cuda")
    kern = EmulatedKernel(src, "moe_route_prep_kernel")
    rng = np.random.default_rng(experts + t)
    ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(t)]).astype(ids_dtype)
    ids.reshape(-1)[rng.choice(t * k, max(1, t * k // 10), replace=False)] = rng.choice([-1, -experts, experts, 3 * experts + 1])
    offsets, order = np.full(experts + 1, -7, np.int32), np.full(t * k, -7, np.int32)
    scalar = {p: t * k for _, p in kern.params if p.startswith("cse_v")}  # the slot count, hoisted by TVM
    kern((1, 1, 1), 32 * prep_warps(experts), ids=ids, offsets=offsets, order=order, N=t, **scalar)
    want_off, want_order = reference_route(ids, experts)
    np.testing.assert_array_equal(offsets, want_off)
    np.testing.assert_array_equal(order[: want_off[-1]], want_order)
    assert prep_warps(experts) == (32 if experts <= 159 else 40960 // (8 * (experts + 1)))
    with pytest.raises(MoecError, match="exceed the 2048 whose counts"):
        _build(GroupedExpertsSpec(hidden=64, inter=64, experts=2049, top_k=k), "cuda")


@pytest.mark.parametrize("act,t,launch", [("bfloat16", 37, {"stages": 0}), ("bfloat16", 300, {}),
                                          ("bfloat16", 300, {"n_tiles": 2, "pass_blocks": True}),
                                          ("float16", 37, {"warps": 3, "pass_blocks": True}),
                                          ("bfloat16", 300, {"stages": 6, "dyn_shared": 6 * 16384}),
                                          ("bfloat16", 300, {"slots": 20}), ("bfloat16", 300, {"interleave": True}),
                                          ("float16", 300, {"interleave": True, "n_tiles": 3, "warps": 3}),
                                          ("bfloat16", 37, {"interleave": True, "n_tiles": 8, "pass_blocks": True}),
                                          ("bfloat16", 300, {"w_tiles": True}),
                                          ("float16", 37, {"w_tiles": True, "n_tiles": 2, "pass_blocks": True, "warps": 3}),
                                          ("bfloat16", 300, {"w_tiles": True, "slots": 20}),
                                          ("bfloat16", 300, {"w_tiles": True, "row_tiles": 2}),
                                          ("bfloat16", 300, {"min_blocks": 6, "stages": 3})])
def test_fp8_mma_forms_emulated(act, t, launch):
    """FP8 e4m3 weights on tensor cores, on the CPU emulation: the register form (``stages`` 0, matched numpy on the
    H200) and the cp.async forms, whose lanes copy 16 weight bytes each and widen them two at a time
    (``_fp8_widen_pair``) into the register form's fragments: several passes an expert (300 tokens), a block per pass
    with 2 token tiles, 3 warps with float16 activations (the widening's other shift), 6 stages in dynamic shared
    memory, and a pool of 20 slots read through the residency table (offloaded experts; the pool's other slots hold
    NaN codes and scales); with ``interleave`` (the mma k16 step by k16 step over every token tile, specialised on
    the pass's token tiles with tokens: 1 to NT of them, NT 3, 4 and 8); with ``w_tiles`` (the codes stored
    tile-major by ``tile_fp8``: plain, a block per pass with 3 warps and float16, a pool of slots). The stage of an
    FP8 gate_up holds half the weight bytes of a 16-bit one."""
    from cuda_emu import EmulatedKernel

    from moec.compiler.build import _cuda_modules
    from moec.schedules.kernels.grouped_experts import dequantize_fp8, mma_stages, mma_tiles, quantize_fp8, tile_fp8

    spec = GroupedExpertsSpec(hidden=256, inter=128, experts=16, top_k=4, x_dtype=act, h_dtype=act, rw_dtype=act,
                              out_dtype="float32", w_format="fp8", **launch)
    bf = replace(spec, w_format="float", w_dtype=act, slots=0)
    nt, rt, _ = mma_tiles(spec)
    if spec.stages:  # a stage: the warps' weight tiles (64 bytes a row) and the pass's tokens
        assert mma_stages(spec, "gate_up")[1] == spec.warps * 2 * rt * 16 * 64 + 8 * nt * 64 * 2
        assert mma_stages(spec, "gate_up")[1] < mma_stages(bf, "gate_up")[1]
    src = _cuda_modules(_build(spec, "cuda").mod)[0].inspect_source("cuda")
    for name in ("gate_up", "down"):  # launch bounds where asked for (registers capped; the sums the same)
        assert (f"__launch_bounds__({32 * spec.warps}, {spec.min_blocks}) moe_{name}_kernel" in src) == bool(spec.min_blocks)
    for name in ("gate_up", "down"):  # launch bounds where asked for (registers capped; the sums the same)
        assert (f"__launch_bounds__({32 * spec.warps}, {spec.min_blocks}) moe_{name}_kernel" in src) == bool(spec.min_blocks)
    body = _kernel_bodies(src)["moe_gate_up_kernel"]
    assert "mma.sync" in src and ("moec_e4m3x2_" in body) == bool(spec.stages)
    assert ("moec_e4m3x2_bf16s_lo(" in body) == (bool(spec.stages) and act == "bfloat16")
    assert ("cp_async" in src) == bool(spec.stages)
    cfg = launch_config(spec)
    assert "e4m3" in cfg["gate_up"]["form"] and ("cp.async" in cfg["down"]["form"]) == bool(spec.stages)
    k = {name: EmulatedKernel(src, f"moe_{name}_kernel") for name in ("route_prep", "gate_up", "down", "combine")}
    x, w1, w2, ids, rw = _data(bf, t, seed=t + 1)
    (c1, s1), (c2, s2) = quantize_fp8(w1.astype(np.float32)), quantize_fp8(w2.astype(np.float32))
    t1, t2 = (tile_fp8(c1), tile_fp8(c2)) if spec.w_tiles else (c1, c2)  # the codes as the kernels read them
    k1, k2, q1, q2 = t1, t2, s1, s2  # what the kernels read: stacked, or the slots of a pool
    offsets, order = np.zeros(spec.experts + 1, np.int32), np.zeros(t * 4, np.int32)
    h = np.zeros((t * 4, spec.inter), NP[act])
    y = np.zeros((t * 4, spec.hidden), np.float32)
    out = np.zeros((t, spec.hidden), np.float32)
    ids = ids.astype(np.int64)

    def grid(c):
        if "grid" in c:
            return (-(-t // c["tokens_per_pass"]), c["grid"][1], 1)
        return (c["blocks"][0] if c["blocks"][0] != "T" else t, c["blocks"][1], 1)

    extra = {"N": t} if spec.pass_blocks else {}
    k["route_prep"](grid(cfg["route_prep"]), cfg["route_prep"]["threads"], ids=ids, offsets=offsets, order=order, cse_v1=t * 4)
    table = offsets
    if spec.slots:  # the experts at random slots of the pool, the table after the bounds
        slot_of = np.random.default_rng(t).choice(spec.slots, spec.experts, replace=False).astype(np.int32)
        k1, k2 = (np.full((spec.slots,) + c.shape[1:], 0x7F, np.uint8) for c in (c1, c2))  # 0x7F: an e4m3 NaN
        q1, q2 = (np.full((spec.slots,) + q.shape[1:], np.nan, np.float32) for q in (s1, s2))
        k1[slot_of], k2[slot_of], q1[slot_of], q2[slot_of] = t1, t2, s1, s2
        table = np.concatenate([offsets, slot_of])
    k["gate_up"](grid(cfg["gate_up"]), cfg["gate_up"]["threads"], x=x, w=k1, s1=q1, offsets=table, order=order, h=h, **extra)
    k["down"](grid(cfg["down"]), cfg["down"]["threads"], h=h, w=k2, s2=q2, offsets=table, order=order, rw=rw, y=y, **extra)
    k["combine"](grid(cfg["combine"]), cfg["combine"]["threads"], y=y, ids=ids, out=out, N=t)
    _check(spec, (offsets, order, h.astype(np.float32), out), x, dequantize_fp8(c1, s1), dequantize_fp8(c2, s2), ids, rw,
           tol=3e-2)
