"""Ragged-query attention over the tiered cache (prefill path) and its importance column sums (llvm)."""

import functools

import ml_dtypes
import numpy as np
import pytest
import tvm

from moec.compiler.targets import make_target
from moec.schedules.kernels import reference as ref
from moec.schedules.kernels.tiered_attention import (ATTENTION_WARPS, KT, MASS_MMA_KT, MASS_MMA_WARPS, QT,
                                                     make_tiered_attention, make_tiered_mass)

from moec_testing import require_cuda

H, HKV, D, PS1, PS2 = 4, 2, 32, 16, 32
P1, P2 = 24, 10


@pytest.fixture(scope="module")
def kernels():
    mod = tvm.IRModule({"tiered_attention": make_tiered_attention(H, HKV, D, PS1, PS2),
                        "tiered_mass": make_tiered_mass(H, HKV, D, PS1)})
    return tvm.compile(mod, target="llvm")


def _case(seed, t1_lens, t2_pages, new, heads=(H, HKV, D)):
    """Rows whose tier 1 ends with ``new[b]`` chunk tokens; a query for each chunk token."""
    h, hkv, d = heads
    rng = np.random.default_rng(seed)
    kv = []
    for n1, n2 in zip(t1_lens, t2_pages):
        k = rng.standard_normal((hkv, n1 + n2 * PS2, d)).astype(np.float32) * 2
        kv.append((k, rng.standard_normal(k.shape).astype(np.float32)))
    pools, tables, deq, slots = ref.fill_pools(kv, t1_lens, P1, P2, PS1, PS2, rng)
    q_row, q_t1 = [], []
    for b, (n1, m) in enumerate(zip(t1_lens, new)):
        q_row += [b] * m
        q_t1 += list(range(n1 - m + 1, n1 + 1))
    qv = rng.standard_normal((len(q_row), h, d)).astype(np.float32)
    indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    return qv, pools, tables, deq, slots, np.array(q_row, np.int32), np.array(q_t1, np.int32), indptr


CASES = [(0, [37, 20, 16], [2, 0, 1], [5, 20, 1]), (1, [64], [3], [33])]
# the CUDA forms' tiles: rows with more queries than a query tile (32) and more tier-1 tokens than a key tile (32)
GPU_CASES = CASES + [(2, [150, 3, 97], [4, 1, 0], [70, 3, 97]), (3, [40, 200], [0, 2], [1, 130])]


@pytest.mark.parametrize("seed,t1_lens,t2_pages,new", CASES)
def test_attention_and_mass_against_numpy(kernels, seed, t1_lens, t2_pages, new):
    _check(kernels, tvm.cpu(), seed, t1_lens, t2_pages, new)


@pytest.fixture(scope="module")
def cuda_kernels():
    require_cuda()
    mod = tvm.IRModule({"tiered_attention": make_tiered_attention(H, HKV, D, PS1, PS2, target="cuda"),
                        "tiered_mass": make_tiered_mass(H, HKV, D, PS1, target="cuda")})
    return tvm.compile(mod, target=make_target("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("seed,t1_lens,t2_pages,new", GPU_CASES)
def test_cuda_attention_and_mass_against_numpy(cuda_kernels, seed, t1_lens, t2_pages, new):
    _check(cuda_kernels, tvm.cuda(), seed, t1_lens, t2_pages, new, tol=1e-4)


@functools.lru_cache(maxsize=None)
def _emulated_kernels(heads, mma_dtype=None, warps=ATTENTION_WARPS):
    """The CUDA forms of ``heads`` (the tensor-core ones with ``mma_dtype``, attention blocks of ``warps`` warps), run
    on the CPU by tests/cuda_emu.py."""
    from cuda_emu import EmulatedKernel

    h, hkv, d = heads
    mod = tvm.IRModule({"tiered_attention": make_tiered_attention(h, hkv, d, PS1, PS2, target="cuda", mma_dtype=mma_dtype,
                                                                  mma_warps=warps if mma_dtype else None),
                        "tiered_mass": make_tiered_mass(h, hkv, d, PS1, target="cuda", mma_dtype=mma_dtype)})
    src = tvm.compile(mod, target=make_target("cuda")).mod.imports[0].inspect_source()
    if mma_dtype is None:
        att = lambda n, b: (b, -(-n // QT), h)  # noqa: E731
        mass = lambda n, b: (b, -(-(P1 * PS1) // KT), hkv)  # noqa: E731  (the table width: P1 pages)
        threads = (128, 128)
    else:
        att = lambda n, b: (b, -(-n // (16 * warps // (h // hkv))), hkv)  # noqa: E731
        mass = lambda n, b: (b, -(-(P1 * PS1) // MASS_MMA_KT), hkv)  # noqa: E731
        threads = (32 * warps, 32 * MASS_MMA_WARPS)
    return {"tiered_attention": (EmulatedKernel(src, "tiered_attention_kernel"), att, threads[0]),
            "tiered_mass": (EmulatedKernel(src, "tiered_mass_kernel"), mass, threads[1])}


@pytest.mark.parametrize("seed,t1_lens,t2_pages,new", GPU_CASES[:3])
def test_cuda_tiled_forms_emulated(seed, t1_lens, t2_pages, new):
    """The float32 tiled CUDA forms (measured on the H200 against numpy at 1e-4) give the same on the emulator:
    a check of the emulation itself."""
    _check(_emulated_kernels((H, HKV, D)), "emulated", seed, t1_lens, t2_pages, new, tol=1e-4)


# (heads, kv heads, head dim): the tests' GQA shape, OLMoE's (no GQA) and Mixtral's (4 query heads per KV head)
MMA_HEADS = [(H, HKV, D), (2, 2, 128), (8, 2, 128)]


@pytest.mark.parametrize("heads,dtype,case", [(h, "bfloat16", c) for h in MMA_HEADS for c in (0, 3)] + [(MMA_HEADS[2], "float16", 2)]
                         + [((4, 2, 48), "bfloat16", 0)])  # head dim 48: an odd number of k-steps (ldmatrix.x2)
def test_tensor_core_forms_emulated(heads, dtype, case):
    """The mma.sync forms on the emulator, against numpy in float64 on queries of the operand type. Their error is
    the rounding of the probabilities (and of the tier-2 entries) to the 16-bit type: at most 1.5e-2 on outputs of
    unit scale in bfloat16 (8 significant bits), 4x less in float16. Cases: three rows with tier-2 pages and short
    chunks; two rows whose chunks span several query and key tiles."""
    seed, t1_lens, t2_pages, new = GPU_CASES[case]
    tol = 1.5e-2 if dtype == "bfloat16" else 4e-3
    _check(_emulated_kernels(heads, dtype), "emulated", seed, t1_lens, t2_pages, new, tol=tol, heads=heads,
           q_round=ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16, mass_tol=tol)


@pytest.mark.parametrize("heads,case", [(MMA_HEADS[1], 3), (MMA_HEADS[2], 0)])
def test_tensor_core_attention_in_4_warp_blocks_emulated(heads, case):
    """Attention blocks of 4 warps (64 rows; the default is 8: a key tile dequantized once for twice the queries)."""
    seed, t1_lens, t2_pages, new = GPU_CASES[case]
    _check(_emulated_kernels(heads, "bfloat16", warps=4), "emulated", seed, t1_lens, t2_pages, new, tol=1.5e-2, heads=heads,
           q_round=ml_dtypes.bfloat16, mass_tol=1.5e-2)


def test_tensor_core_attention_launch_shapes():
    import re

    def bounds(**kw):
        mod = tvm.IRModule({"tiered_attention": make_tiered_attention(16, 16, 128, 16, 128, target="cuda", mma_dtype="bfloat16", **kw)})
        src = tvm.compile(mod, target=make_target("cuda")).mod.imports[0].inspect_source()
        return re.findall(r"__launch_bounds__\(([^)]*)\) tiered_attention_kernel\(", src)[0]

    assert bounds() == "256" and bounds(mma_warps=4) == "128" and bounds(mma_warps=4, mma_min_blocks=3) == "128, 3"
    with pytest.raises(ValueError, match="4 or 8"):
        make_tiered_attention(16, 16, 128, 16, 128, target="cuda", mma_dtype="bfloat16", mma_warps=2)
    with pytest.raises(ValueError, match="min_blocks"):
        make_tiered_attention(16, 16, 128, 16, 128, target="cuda", mma_dtype="bfloat16", mma_min_blocks=-1)


def test_prefill_bench_fp8_pair_check_emulated():
    """bench/tiered_prefill.py's GPU check of the pair conversions, on the emulator (the GPU runs the PTX; the
    emulator its C++ stand-ins), and that the check fails on a wrong value."""
    import importlib.util
    from pathlib import Path

    from cuda_emu import EmulatedKernel

    path = Path(__file__).resolve().parents[2] / "bench" / "tiered_prefill.py"
    spec = importlib.util.spec_from_file_location("moec_bench_tiered_prefill_pairs", path)
    tp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tp)
    src = tvm.compile(tvm.IRModule({"fp8_pairs": tp.fp8_pairs_kernel()}), target=make_target("cuda")).mod.imports[0].inspect_source()
    out = np.zeros((4, 64), np.uint32)
    EmulatedKernel(src, "fp8_pairs_kernel")((1, 1, 1), 64, codes=np.arange(256, dtype=np.uint8).view(np.uint32).copy(), out=out)
    assert tp.compare_fp8_pairs(out)["passed"]
    out[0, 5] ^= 1 << 4  # one bfloat16 off by an ulp
    res = tp.compare_fp8_pairs(out)
    assert not res["passed"] and res["bfloat16"]["mismatches"] == 1 and res["float16"]["exact"]


def test_fp8_pairs_to_bfloat16_exactly():
    # the prelude's e4m3 -> bfloat16 pair conversion, in NumPy: each byte's low 7 bits shifted under bfloat16's
    # exponent and mantissa, times 2^120 (one bfloat16 FMA, exact: a product of a 4-bit mantissa and a power of
    # two), the sign put back; every non-NaN code gives its e4m3 value, subnormals included
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint32)
    mag = ((codes & 0x7F) << 4).astype(np.uint16)
    as_bf16 = np.frombuffer(mag.tobytes(), ml_dtypes.bfloat16).astype(np.float64)
    got = as_bf16 * 2.0**120 * np.where(codes & 0x80, -1.0, 1.0)
    want = codes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    np.testing.assert_array_equal(got, want)
    assert (got.astype(ml_dtypes.bfloat16).astype(np.float64) == got).all()  # the products are bfloat16 values


@pytest.fixture(scope="module")
def cuda_mma_kernels():
    require_cuda()
    out = {}
    for heads in MMA_HEADS:
        h, hkv, d = heads
        mod = tvm.IRModule({"tiered_attention": make_tiered_attention(h, hkv, d, PS1, PS2, target="cuda", mma_dtype="bfloat16"),
                            "tiered_mass": make_tiered_mass(h, hkv, d, PS1, target="cuda", mma_dtype="bfloat16")})
        out[heads] = tvm.compile(mod, target=make_target("cuda"))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("heads", MMA_HEADS)
@pytest.mark.parametrize("seed,t1_lens,t2_pages,new", GPU_CASES)
def test_cuda_tensor_core_forms_against_numpy(cuda_mma_kernels, heads, seed, t1_lens, t2_pages, new):
    _check(cuda_mma_kernels[heads], tvm.cuda(), seed, t1_lens, t2_pages, new, tol=1.5e-2, heads=heads,
           q_round=ml_dtypes.bfloat16, mass_tol=1.5e-2)


def test_tensor_core_forms_compile():
    import re

    mod = tvm.IRModule({"tiered_attention": make_tiered_attention(16, 16, 128, 16, 128, target="cuda", mma_dtype="bfloat16"),
                        "tiered_mass": make_tiered_mass(16, 16, 128, 16, target="cuda", mma_dtype="bfloat16")})
    src = tvm.compile(mod, target=make_target("cuda")).mod.imports[0].inspect_source()
    assert set(re.findall(r"__launch_bounds__\((\d+)\) (\w+)_kernel\(", src)) == {("256", "tiered_attention"), ("256", "tiered_mass")}
    # QK (8 key tiles x 8 k-steps) and PV (4 k-steps x 16 dim tiles) of a key tile; the mass kernel's K Q^T (8 x 8)
    assert src.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 128 + 64
    assert "__shared__ alignas(64) nv_bfloat16 k_s" in src and "atomicAdd" not in src
    with pytest.raises(ValueError, match="operand dtype float32"):
        make_tiered_attention(16, 16, 128, 16, 128, target="cuda", mma_dtype="float32")
    with pytest.raises(ValueError, match="do not divide"):
        make_tiered_mass(48, 1, 128, 16, target="cuda", mma_dtype="bfloat16")  # 48 heads per KV head
    with pytest.raises(ValueError, match="CUDA only"):
        make_tiered_attention(16, 16, 128, 16, 128, mma_dtype="bfloat16")


def _check(kernels, dev, seed, t1_lens, t2_pages, new, tol=1e-5, heads=(H, HKV, D), q_round=None, mass_tol=None):
    h, hkv, d = heads
    qv, pools, tables, deq, slots, q_row, q_t1, indptr = _case(seed, t1_lens, t2_pages, new, heads)
    if q_round is not None:  # queries as a 16-bit model computes them (the tensor-core forms' operand type)
        qv = qv.astype(q_round).astype(np.float32)
    scale = d**-0.5
    lp = {k: ref.layered(pools[k]) for k in ref.POOL_ORDER}
    n = len(q_row)
    mass0 = ref.layered(np.random.default_rng(5).random((P1, hkv, PS1)).astype(np.float32))
    if dev == "emulated":  # the generated CUDA code run on the CPU (tests/cuda_emu.py): kernels maps name -> (kernel, grid)
        out, stats, mass = np.zeros((n, h, d), np.float32), np.zeros((n, h, 2), np.float32), mass0.copy()
        common = dict(q=qv, q_indptr=indptr, q_t1=q_t1, q_row=q_row, t1_table=tables["t1_table"], B=len(t1_lens),
                      M1=tables["t1_table"].shape[1], N=n, P1=lp["t1_k"].shape[1], layer=ref.LAYER, sm_scale=scale)
        kern, grid, threads = kernels["tiered_attention"]
        kern(grid(n, len(t1_lens)), threads, out=out, stats=stats, **{k: lp[k] for k in ref.POOL_ORDER}, **common,
             t2_table=tables["t2_table"], t2_np=tables["t2_np"], M2=tables["t2_table"].shape[1], P2=lp["t2_k"].shape[1])
        kern, grid, threads = kernels["tiered_mass"]
        kern(grid(n, len(t1_lens)), threads, stats=stats, t1_mass=mass, t1_k=lp["t1_k"], t1_ks=lp["t1_ks"], B1=len(t1_lens) + 1,
             **common)
        got, got_out, got_stats = mass, out, stats
    else:
        out = tvm.runtime.tensor(np.zeros((n, h, d), np.float32), dev)
        stats = tvm.runtime.tensor(np.zeros((n, h, 2), np.float32), dev)
        t = lambda a: tvm.runtime.tensor(a, dev)  # noqa: E731
        kernels["tiered_attention"](t(qv), *[t(lp[k]) for k in ref.POOL_ORDER], t(tables["t1_table"]), t(tables["t2_table"]),
                                    t(tables["t2_np"]), t(q_row), t(q_t1), t(indptr), out, stats, ref.LAYER, scale)
        mass = t(mass0.copy())
        kernels["tiered_mass"](t(qv), t(lp["t1_k"]), t(lp["t1_ks"]), t(tables["t1_table"]), t(q_t1), t(indptr), stats, mass,
                               ref.LAYER, scale)
        got, got_out, got_stats = mass.numpy(), out.numpy(), stats.numpy()
    want_mass = mass0[ref.LAYER].astype(np.float64)
    for j in range(n):
        b = q_row[j]
        kd, vd = deq[b]
        n1 = t1_lens[b]
        vis = np.r_[0:q_t1[j], n1:kd.shape[1]]
        want, p = ref.attention(qv[j], kd[:, vis], vd[:, vis], scale)
        np.testing.assert_allclose(got_out[j], want, rtol=tol, atol=tol)
        per_kv = p.reshape(hkv, -1, p.shape[-1]).sum(1)
        for col in range(q_t1[j]):
            pg, sl = slots[b][col]
            want_mass[pg, :, sl] += per_kv[:, col]
    np.testing.assert_array_equal(got[0], mass0[0])
    mass_tol = mass_tol or tol
    np.testing.assert_allclose(got[ref.LAYER], want_mass, rtol=mass_tol, atol=mass_tol / 10)
    # every query's probabilities sum to one: the stats describe the same softmax the output used
    assert np.isfinite(got_stats).all() and (got_stats[..., 1] >= 1 - 1e-6).all()


def test_cuda_forms_compile():
    mod = tvm.IRModule({"tiered_attention": make_tiered_attention(16, 16, 128, 16, 128, target="cuda"),
                        "tiered_mass": make_tiered_mass(16, 16, 128, 16, target="cuda")})
    src = tvm.compile(mod, target=make_target("cuda")).mod.imports[0].inspect_source()
    import re

    # tiled: 128 threads (32 queries / tier-1 tokens x 4 per head dim) with the key / query tiles in shared memory
    assert set(re.findall(r"__launch_bounds__\((\d+)\) (\w+)_kernel\(", src)) == {("128", "tiered_attention"), ("128", "tiered_mass")}
    assert "__shared__ alignas(64) float ks_s" in src and "__shared__ alignas(64) float qs_s" in src
    assert "__shfl_xor_sync" in src and "atomicAdd" not in src


def test_prefill_bench_inputs_and_calls_on_cpu(monkeypatch):
    """bench/tiered_prefill.py's inputs and kernel calls (argument order, workspaces) with the llvm forms on a small
    shape: finite outputs, softmax sums of at least one, and every query's whole probability on its tier-1 tokens
    in a case without tier 2 (the importance sums add up to queries x heads)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "tiered_prefill.py"
    spec = importlib.util.spec_from_file_location("moec_bench_tiered_prefill", path)
    tp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tp)
    monkeypatch.setattr(tp, "SHAPES", {"small": (H, HKV, D)})
    monkeypatch.setattr(tp, "CASES", {"first": (0, 0, 40), "second": (20, 2, 30)})
    mod = tvm.compile(tvm.IRModule({"tiered_attention": make_tiered_attention(H, HKV, D, tp.PS1, tp.PS2),
                                    "tiered_mass": make_tiered_mass(H, HKV, D, tp.PS1)}), target="llvm")
    for case, (_, pages2, new) in tp.CASES.items():
        res, ms = tp._run_form(mod, tvm.cpu(), tp._inputs("small", case, np.random.default_rng(0)), "small", 1)
        assert np.isfinite(res["out"]).all() and (res["stats"][..., 1] >= 1 - 1e-6).all() and set(ms) == {"tiered_attention", "tiered_mass"}
        total = res["mass"].sum()
        assert total == pytest.approx(new * H, rel=1e-4) if pages2 == 0 else 0 < total < new * H
