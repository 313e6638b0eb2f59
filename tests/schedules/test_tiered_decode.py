"""Tiered decode attention kernel (llvm build) against NumPy over the same dequantized values."""

import re

import numpy as np
import pytest
import tvm

from moec.schedules.kernels import reference as ref
from moec.schedules.kernels.tiered_decode import decode_workspaces, make_tiered_decode

H, HKV, D, PS1, PS2 = 4, 2, 32, 16, 32
P1, P2 = 20, 10


def _build_case(seed, t1_lens, t2_pages):
    rng = np.random.default_rng(seed)
    kv = []
    for n1, n2 in zip(t1_lens, t2_pages):
        n = n1 + n2 * PS2
        k = rng.standard_normal((HKV, n, D)).astype(np.float32) * 2
        k[:, :, 3] += 6  # an outlier channel
        kv.append((k, rng.standard_normal((HKV, n, D)).astype(np.float32)))
    pools, tables, deq, slots = ref.fill_pools(kv, t1_lens, P1, P2, PS1, PS2, rng)
    qv = rng.standard_normal((len(t1_lens), H, D)).astype(np.float32)
    return qv, kv, pools, tables, deq, slots


@pytest.fixture(scope="module")
def kernel():
    return tvm.compile(tvm.IRModule({"tiered_decode": make_tiered_decode(H, HKV, D, PS1, PS2)}), target="llvm")


@pytest.mark.parametrize("seed,t1_lens,t2_pages", [(0, [37, 5, 16], [2, 1, 0]), (1, [64, 1], [0, 3])])
def test_against_numpy_over_dequantized_values(kernel, seed, t1_lens, t2_pages):
    qv, kv, pools, tables, deq, slots = _build_case(seed, t1_lens, t2_pages)
    scale = D**-0.5
    dev = tvm.cpu()
    mass0 = np.random.default_rng(9).random((P1, HKV, PS1)).astype(np.float32)
    m1, m2 = tables["t1_table"].shape[1], tables["t2_table"].shape[1]
    lp = {k: ref.layered(pools[k]) for k in ref.POOL_ORDER}
    args = [qv] + [lp[k] for k in ref.POOL_ORDER] + [tables[k] for k in ref.TABLE_ORDER]
    # (NaN: compiled models allocate the output and the workspaces without a fill; the kernel writes before it reads)
    out = np.full((len(t1_lens), H, D), np.nan, np.float32)
    ws = [np.full(shape, np.nan, dtype) for shape, dtype in decode_workspaces(len(t1_lens), H, HKV, m1, PS1, m2, PS2, D)]
    lmass = ref.layered(mass0)
    tv = [tvm.runtime.tensor(a, dev) for a in args + [out, lmass.copy()] + ws]
    kernel["tiered_decode"](*tv, ref.LAYER, scale)
    got_out, got_mass = tv[15].numpy(), tv[16].numpy()
    np.testing.assert_array_equal(got_mass[0], lmass[0])  # other layers untouched
    got_mass = got_mass[ref.LAYER]
    for s, ((k, v), (kd, vd)) in enumerate(zip(kv, deq)):
        want, _ = ref.attention(qv[s], kd, vd, scale)
        np.testing.assert_allclose(got_out[s], want, rtol=1e-5, atol=1e-5)  # same dequantized values: tight
        exact, _ = ref.attention(qv[s], k, v, scale)
        # against the unquantized cache (relative L2): FP8 alone within 8%; with 2-bit pages on random
        # data, closer than attention that ignores the keys (uniform weights) would be
        rel = np.linalg.norm(got_out[s] - exact) / np.linalg.norm(exact)
        uniform = np.repeat(v, H // HKV, 0).mean(1)
        assert rel < (0.08 if t2_pages[s] == 0 else np.linalg.norm(uniform - exact) / np.linalg.norm(exact)), rel
    np.testing.assert_allclose(got_mass, ref.expected_mass(mass0, qv, deq, slots, scale), rtol=1e-5, atol=1e-6)


def test_fp8_decode_matches_ml_dtypes(kernel):
    # every e4m3 byte (but NaN) through the kernel's integer decoding: one token per page slot
    import ml_dtypes

    codes = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    n = codes.size
    got = []
    for start in range(0, n, P1):
        chunk = codes[start:start + P1]
        m = chunk.size
        v = np.zeros((P1, HKV, PS1, D), np.uint8)
        v[np.arange(m), :, 0, 0] = chunk[:, None]
        args = [np.zeros((m, H, D), np.float32), np.zeros((P1, HKV, PS1, D), np.uint8), v,
                np.ones((P1, HKV, PS1), np.float16), np.ones((P1, HKV, PS1), np.float16),
                np.zeros((P2, HKV, PS2, D // 4), np.uint8), np.zeros((P2, HKV, PS2, D // 4), np.uint8),
                np.zeros((P2, HKV, D), np.float16), np.ones((P2, HKV, D), np.float16),
                np.zeros((P2, HKV, PS2), np.float16), np.ones((P2, HKV, PS2), np.float16),
                np.arange(m, dtype=np.int32)[:, None], np.ones(m, np.int32), np.zeros((m, 1), np.int32), np.zeros(m, np.int32),
                np.zeros((m, H, D), np.float32), np.zeros((P1, HKV, PS1), np.float32)]
        args += [np.zeros(shape, dtype) for shape, dtype in decode_workspaces(m, H, HKV, 1, PS1, 1, PS2, D)]
        args[1:11] = [a[None] for a in args[1:11]]  # one layer
        args[16] = args[16][None]
        tv = [tvm.runtime.tensor(a, tvm.cpu()) for a in args]
        kernel["tiered_decode"](*tv, 0, 1.0)
        got.append(tv[15].numpy()[:, 0, 0])  # one token: the output is its value
    np.testing.assert_array_equal(np.concatenate(got), want)


@pytest.mark.parametrize("shape", [(4, 2, 32, 16, 32), (16, 16, 128, 16, 128), (32, 8, 128, 16, 128)])
def test_cuda_form_compiles(shape):
    from moec.compiler.targets import make_target
    from moec.schedules.kernels.tiered_decode import make_tiered_decode_cuda

    ex = tvm.compile(tvm.IRModule({"tiered_decode": make_tiered_decode_cuda(*shape)}), target=make_target("cuda"))
    src = ex.mod.imports[0].inspect_source()
    # the split kernel (warp shuffles, vector loads) and the merge / importance kernel
    assert "__shfl_xor_sync" in src and "uint4" in src and "tiered_decode_kernel_1" in src


def test_workspaces_and_splits():
    from moec.schedules.kernels.tiered_decode import decode_splits

    ws = decode_workspaces(3, 16, 16, 40, 16, 27, 128)
    assert [dt for _, dt in ws] == ["float32"] * 3
    s = decode_splits(3, 16, 40, 16, 27)
    assert ws == [((3, 16, 640), "float32"), ((3, 16, s, 128), "float32"), ((3, 16, s, 2), "float32")]
    assert s == 8  # few sequences: the sequence is split over several blocks (at most 8)
    assert decode_splits(1, 2, 1, 16, 0) == 1  # never more splits than tiles of work
    # the headline's 128 x 16 (sequence, KV head) pairs in 4 splits, Mixtral's 128 x 8 with 4 query heads per KV head
    # in 1 (the fastest measured on the H100); the tensor-core form keeps tier 1 and tier 2 in splits of their own
    assert decode_splits(128, 16, 40, 16, 27) == 4 and decode_splits(128, 8, 40, 16, 27, group=4) == 1
    assert decode_splits(128, 16, 40, 16, 27, t2_mma=True) == 5 and decode_splits(128, 8, 40, 16, 27, True, 4) == 3
    assert decode_workspaces(3, 16, 16, 40, 16, 27, 128, t2_mma=True)[1] == ((3, 16, s + 1, 128), "float32")
    assert decode_workspaces(128, 32, 8, 40, 16, 27, 128)[1] == ((128, 32, 1, 128), "float32")  # (group from the heads)


def test_split_kernel_picks_the_measured_form():
    from moec.schedules.kernels.tiered_decode import decode_form

    assert decode_form(16, 16, 128, 128) == "paired"  # OLMoE: one query head per KV head
    assert decode_form(32, 8, 128, 128) == "mma"  # Mixtral: 4
    assert decode_form(32, 8, 64, 128) == "half2"  # the tensor-core form needs head_dim 128
    assert decode_form(16, 8, 128, 128) == "half2"  # 2 query heads per KV head
    assert decode_form(16, 16, 128, 128, "split-mma") == "mma" and decode_form(32, 8, 128, 128, "split-half2") == "half2"
    assert decode_form(16, 16, 128, 128, "split-paired") == "paired"
    with pytest.raises(ValueError, match="unknown split decode kernel"):
        decode_form(16, 16, 128, 128, "ragged")


@pytest.mark.parametrize("shape", [(16, 16, 128, 16, 128), (32, 8, 128, 16, 128)])
def test_cuda_staged_form_compiles_with_64_bit_pool_offsets(shape):
    # the cp.async form (tier-2 and tier-1 tiles staged through shared memory) builds for sm_90, and every
    # access of a pool (its own pointer or a typed view, e.g. t2_k32, t2_vmu1) is indexed in 64 bits

    from moec.compiler.targets import make_target
    from moec.runtime.kv_cache import POOLS
    from moec.schedules.kernels.tiered_decode import make_tiered_decode_cuda

    fn = make_tiered_decode_cuda(*shape, stages=4, t1_stages=2)
    src = tvm.compile(tvm.IRModule({"tiered_decode": fn}), target=make_target("cuda", "sm_90")).mod.imports[0].inspect_source()
    assert "cp.async.cg.shared.global" in src and "cp.async.commit_group" in src and "cp.async.wait_group 2" in src
    assert "__syncwarp()" in src and "__shared__" in src and "tiered_decode_kernel_1" in src
    pointers = set(re.findall(r"\b(\w+)\[", src))
    seen = set()
    for pool in POOLS:
        for ptr in sorted(p for p in pointers if p == f"{pool}_ptr" or re.fullmatch(rf"{pool}\d+_ptr|{pool}\d+", p)):
            for m in re.finditer(re.escape(ptr) + r"\[", src):
                depth, i = 1, m.end()
                while depth:
                    depth += {"[": 1, "]": -1}.get(src[i], 0)
                    i += 1
                assert "int64_t" in src[m.end():i - 1], f"{ptr}[{src[m.end():i - 1]}] is indexed in 32 bits"
                seen.add(pool)
    # every pool the staged loops copy from is seen
    assert {"t1_k", "t1_v", "t1_ks", "t1_vs", "t2_k", "t2_v", "t2_kmu", "t2_ksig", "t2_vmu", "t2_vsig"} <= seen, seen


def test_cuda_staged_form_rejects_bad_stages():
    from moec.schedules.kernels.tiered_decode import make_tiered_decode_cuda

    with pytest.raises(ValueError, match="stages"):
        make_tiered_decode_cuda(16, 16, 128, stages=1)
    with pytest.raises(ValueError, match="48 KB"):
        make_tiered_decode_cuda(16, 16, 128, t1_stages=6)  # 6 tier-1 tiles of 8 KB


def test_bit_float_decoding_of_2bit_codes_is_exact():
    # what the CUDA form computes per 2-bit code, emulated in NumPy: the code's two bits masked into float32
    # bit patterns f0, f1 (from the word, or the word shifted by 12 or 24), then lev = cc + c0 f0 + c1 f1
    from moec.runtime.kv_quant import Q2_LEVELS
    from moec.schedules.kernels.tiered_decode import _code_consts

    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32)
    shifted = [words, words << np.uint32(12), words << np.uint32(24)]
    for i, (src, m0, b0, m1, b1, c0, c1, cc) in enumerate(_code_consts()):
        x = shifted[src]
        f0 = ((x & np.uint32(m0)) | np.uint32(b0)).view(np.float32).astype(np.float64)
        f1 = ((x & np.uint32(m1)) | np.uint32(b1)).view(np.float32).astype(np.float64)
        code = (words >> np.uint32(2 * i)) & np.uint32(3)
        np.testing.assert_allclose(cc + c0 * f0 + c1 * f1, Q2_LEVELS[code], rtol=0, atol=1e-5)
        # split_values: summing p f0 and p f1 first and applying the constants after is the same sum
        p = rng.random(words.size)
        np.testing.assert_allclose(cc * p.sum() + c0 * (p * f0).sum() + c1 * (p * f1).sum(),
                                   (p * Q2_LEVELS[code]).sum(), rtol=1e-9, atol=1e-6)


def test_field_decoding_of_2bit_codes_is_exact():
    # the fields form per 2-bit code, emulated in NumPy: code i's two bits masked together into the mantissa
    # of 1.0 from the word shifted by FIELD_SHIFTS[i // 4], then lev = cc + c1 f; and the value sums kept in
    # the field domain over tier 2 (divided by c1 after tier 1, mapped back once) give the same output
    from moec.runtime.kv_quant import Q2_LEVELS
    from moec.schedules.kernels.tiered_decode import FIELD_SHIFTS, _field_consts

    rng = np.random.default_rng(1)
    words = rng.integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32)
    shifted = [words << np.uint32(s) if s >= 0 else words >> np.uint32(-s) for s in FIELD_SHIFTS]
    for i, (src, mask, c1, cc) in enumerate(_field_consts()):
        f = ((shifted[src] & np.uint32(mask)) | np.uint32(0x3F800000)).view(np.float32)
        code = (words >> np.uint32(2 * i)) & np.uint32(3)
        lev = np.float32(cc) + np.float32(c1) * f  # the kernel's float32 FFMA (rounded once more here)
        np.testing.assert_allclose(lev, Q2_LEVELS[code], rtol=0, atol=2e-6)
        p, a_t1 = rng.random(words.size).astype(np.float32), np.float32(rng.standard_normal())
        acc = np.float32(a_t1 * np.float32(1 / c1))
        acc = np.float32(acc + (p * f).sum(dtype=np.float32))
        out = np.float32(acc * np.float32(c1) + np.float32(cc) * p.sum(dtype=np.float32))
        # the field domain's offset (f ~ 1) costs float32 precision: c1 acc and cc sum(p) are each about
        # c1 sum(p) (c1 = 2^3 .. 2^9) and cancel, so the error is a few ulp of c1 sum(p) (here up to 0.06 on
        # 4096 tokens; the H200 check saw output errors up to 9e-5, against 1e-7 for the per-bit forms)
        want = a_t1 + (p.astype(np.float64) * Q2_LEVELS[code]).sum()
        assert abs(float(out) - want) <= 4 * 2.0**-23 * c1 * float(p.sum()) + 1e-4


def test_fields_need_the_uniform_grid(monkeypatch):
    from moec.schedules.kernels import tiered_decode as td

    with pytest.raises(ValueError, match="pick one"):
        td.make_tiered_decode_cuda(16, 16, 128, fields=True, split_values=True)
    monkeypatch.setattr(td, "Q2_LEVELS", np.array([-1.5104, -0.4528, 0.4528, 1.5104], np.float32))  # Lloyd-Max
    assert td.uniform_grid() is None
    with pytest.raises(ValueError, match="evenly spaced"):
        td.make_tiered_decode_cuda(16, 16, 128, fields=True)


@pytest.mark.parametrize("shape", [(16, 16, 128, 16, 128)])
def test_cuda_register_bases_and_split_values(shape):
    # reg_bases: the bit-float bases are values ptxas cannot fold (OR'ed with layer >> 31); split_values: the
    # value sums of p f0 and p f1 per channel and of p per head, folded into the output once

    from moec.compiler.targets import make_target
    from moec.schedules.kernels.tiered_decode import make_tiered_decode_cuda

    def src(**kw):
        fn = make_tiered_decode_cuda(*shape, **kw)
        return tvm.compile(tvm.IRModule({"tiered_decode": fn}), target=make_target("cuda", "sm_90")).mod.imports[0].inspect_source()

    plain, reg = src(), src(reg_bases=True, split_values=True, stages=4)
    bases = re.findall(r"bk\w*\[(\d+)\] = \(\(uint\)(\d+) \| \(\(\(uint\)layer\) >> \(uint\)31\)\)", reg)
    assert len(bases) == 9 and not re.search(r"\bbk\w*\[", plain)  # one register per distinct base
    assert 1065353216 in {int(v) for _, v in bases}  # 1.0f, the base of the low exponent bits
    assert reg.count("__shfl_xor_sync") == plain.count("__shfl_xor_sync")  # the same reductions


def test_models_get_the_fastest_measured_form():
    from moec.compiler.targets import make_target
    from moec.schedules.kernels.tiered_decode import make_tiered_decode_for_models

    def src(*shape, **kw):
        fn = make_tiered_decode_for_models(*shape, **kw)
        return tvm.compile(tvm.IRModule({"tiered_decode": fn}), target=make_target("cuda", "sm_90")).mod.imports[0].inspect_source()

    base_reg = r"\(\(uint\)\d+ \| \(\(\(uint\)layer\) >> \(uint\)31\)\)"
    # both: the half2 form (code pairs as float16 halves, fma.rn.f16x2), 4 stages (two younger tiles may be pending)
    for src_ in (src(16, 16, 128, 16, 128), src(32, 8, 128, 16, 128)):  # OLMoE, Mixtral
        assert "cp.async.wait_group 2" in src_ and "fma.rn.f16x2" in src_ and not re.findall(base_reg, src_)
    # fields=True: the float32 fields form (one base, 1.0f, in a register), also 4 stages
    old = src(16, 16, 128, 16, 128, fields=True)
    assert "cp.async.wait_group 2" in old and "fma.rn.f16x2" not in old
    assert re.findall(base_reg, old) == ["((uint)1065353216 | (((uint)layer) >> (uint)31))"]
    assert "cp.async.wait_group 2" in src(4, 4, 32, 16, 32)  # 2-token steps of 8 bytes a token: 16-byte groups
    with pytest.raises(ValueError, match="do not fit tiles"):  # head dim 16: a warp's tile would be one-token steps
        make_tiered_decode_for_models(2, 2, 16, 16, 32)


def _f16_fma(a, b, c):
    """float16 a * b + c rounded once (fma.rn.f16x2 on one half)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float16)


def _h2_halves(words, j):
    from moec.schedules.kernels.tiered_decode import H2_SHIFT, _half2_consts

    src, mask, _ = _half2_consts()[j]
    x = (words if src == 0 else words >> np.uint32(H2_SHIFT)) & np.uint32(mask)
    return (x & 0xFFFF).astype(np.uint16).view(np.float16), (x >> 16).astype(np.uint16).view(np.float16)


def test_half2_decoding_of_2bit_codes():
    # the half2 form per pair of codes (j, j + 8), emulated in NumPy: one AND of the word (or of the word shifted
    # by H2_SHIFT) leaves both codes as subnormal float16 halves c 2^(p - 24), exactly; the keys' dot products
    # (q sigma scaled to [-1, 1] 2^(14 - p), 8 fma.rn.f16x2 a token) and a tile's value sums (p scaled to the
    # tile's max 2^14) stay within 0.5% of the exact sums, far below the 2-bit codes' own error
    from moec.schedules.kernels.tiered_decode import H2_KEY_EXP, H2_VALUE_MAX, _half2_consts, uniform_grid

    lo_level, step = uniform_grid()
    pos = [p for _, _, p in _half2_consts()]
    rng = np.random.default_rng(2)
    words = rng.integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32)
    code = [(words >> np.uint32(2 * i)) & np.uint32(3) for i in range(16)]
    for j in range(8):
        lo, hi = _h2_halves(words, j)
        np.testing.assert_array_equal(lo.astype(np.float64), code[j] * 2.0 ** (pos[j] - 24))
        np.testing.assert_array_equal(hi.astype(np.float64), code[j + 8] * 2.0 ** (pos[j] - 24))
    worst_key = worst_value = 0.0
    for t in range(0, 512, 8):  # 64 tiles of 8 tokens, each with its own q sigma and p
        w = words[t:t + 8]
        a = rng.standard_normal(16) * rng.uniform(0.01, 3) * np.where(rng.random(16) < 0.1, 6, 1)  # q sigma, outliers
        top = np.abs(a).max()
        qh = [[np.array([a[j + 8 * h] / top * 2.0 ** (H2_KEY_EXP - pos[j])], np.float32).astype(np.float16) for j in range(8)]
              for h in (0, 1)]
        acc = [np.zeros(w.size, np.float16), np.zeros(w.size, np.float16)]
        for j in range(8):
            for h, half in enumerate(_h2_halves(w, j)):
                acc[h] = _f16_fma(qh[h][j], half, acc[h])
        got = step * top * 2.0 ** (24 - H2_KEY_EXP) * (acc[0].astype(np.float32) + acc[1].astype(np.float32))
        want = step * sum(a[i] * ((w >> np.uint32(2 * i)) & 3) for i in range(16))
        worst_key = max(worst_key, float(np.abs(got - want).max() / (step * np.abs(a).sum())))
        p = np.exp2(-rng.exponential(3, w.size)) * rng.uniform(0.05, 5, w.size)  # softmax weights times value sigma
        ph = (p * (H2_VALUE_MAX / p.max())).astype(np.float32).astype(np.float16)
        for j in range(8):
            vacc = [np.zeros(1, np.float16), np.zeros(1, np.float16)]
            for k in range(w.size):
                for h, half in enumerate(_h2_halves(w[k:k + 1], j)):
                    vacc[h] = _f16_fma(ph[k:k + 1], half, vacc[h])
            for h in (0, 1):
                got = float(vacc[h][0]) * p.max() * step * 2.0 ** (24 - pos[j]) / H2_VALUE_MAX
                want = step * float((p * ((w >> np.uint32(2 * (j + 8 * h))) & 3)).sum())
                worst_value = max(worst_value, abs(got - want) / (3 * step * p.sum()))
    assert worst_key < 5e-3 and worst_value < 5e-3, (worst_key, worst_value)
    assert lo_level == pytest.approx(-3 * step / 2)  # the levels lo + step c, c = 0 .. 3, are symmetric


@pytest.mark.parametrize("shape", [(16, 16, 128, 16, 128), (32, 8, 128, 16, 128)])
def test_cuda_half2_form_compiles(shape):
    # the half2 form: the helpers' PTX is put at the top of the source, each token's 16 codes take 8 fma.rn.f16x2
    # per query head for the keys and 8 for the values; it excludes the other tier-2 forms
    from moec.compiler.targets import make_target
    from moec.schedules.kernels.tiered_decode import make_tiered_decode_cuda

    g = shape[0] // shape[1]
    fn = make_tiered_decode_cuda(*shape, half2=True, stages=4)
    ex = tvm.compile(tvm.IRModule({"tiered_decode": fn}), target=make_target("cuda", "sm_90"))
    src = ex.mod.imports[0].inspect_source()
    assert src.startswith("#ifndef MOEC_CUDA_PRELUDE") and "fma.rn.f16x2" in src
    kstep = 8 if g == 1 else 4
    assert src.count("moec_hfma2(") - 1 == 2 * kstep * 8 * g  # keys and values, every unrolled token of a tile
    assert "cp.async.wait_group 2" in src
    with pytest.raises(ValueError, match="pick one"):
        make_tiered_decode_cuda(*shape, half2=True, fields=True)


def test_cuda_launch_bounds_cap_the_split_kernel():
    # min_blocks: __launch_bounds__(32, n) on the split kernel only (the merge kernel keeps its plain bound); 0 none
    import re

    from moec.compiler.targets import make_target
    from moec.schedules.kernels.tiered_decode import make_tiered_decode_cuda

    def bounds(**kw):
        fn = make_tiered_decode_cuda(16, 16, 128, 16, 128, half2=True, **kw)
        src = tvm.compile(tvm.IRModule({"tiered_decode": fn}), target=make_target("cuda", "sm_90")).mod.imports[0].inspect_source()
        return sorted(set(re.findall(r"__launch_bounds__\(([^)]*)\) (tiered_decode_kernel\w*)\(", src)))

    assert bounds(stages=3, min_blocks=20) == [("128", "tiered_decode_kernel_1"), ("32, 20", "tiered_decode_kernel")]
    assert bounds(stages=4) == [("128", "tiered_decode_kernel_1"), ("32", "tiered_decode_kernel")]
    for bad in (-1, 33, 2.0, True):
        with pytest.raises(ValueError, match="min_blocks"):
            make_tiered_decode_cuda(16, 16, 128, 16, 128, half2=True, min_blocks=bad)


def test_cuda_prelude_only_where_called():
    from moec.schedules.cuda_prelude import HFMA2, PRELUDE, add_prelude

    plain = "extern \"C\" __global__ void k() {}"
    assert add_prelude(plain) == plain
    called = f"__global__ void k(unsigned int* a) {{ a[0] = {HFMA2}(a[0], a[1], a[2]); }}"
    assert add_prelude(called) == PRELUDE + called
    assert add_prelude(add_prelude(called)) == PRELUDE + called  # once


@pytest.mark.gpu
@pytest.mark.parametrize("form,tol", [({"half2": True}, (5e-3, 1e-3)), ({"half2": True, "stages": 4}, (5e-3, 1e-3)),
                                      ({"fields": True, "reg_bases": True, "stages": 4}, (2e-4, 1e-5)),
                                      ({"t2_mma": True}, (3e-3, 1e-3))])
@pytest.mark.parametrize("shape,t1_lens,t2_pages", [((4, 2, 32, 16, 32), [37, 5, 16], [2, 1, 0]),
                                                    ((16, 16, 128, 16, 128), [70, 0], [3, 2]),
                                                    ((32, 8, 128, 16, 128), [33, 16], [2, 3])])
def test_cuda_tier2_forms_match_numpy_on_gpu(form, tol, shape, t1_lens, t2_pages):
    """The CUDA forms against NumPy over the same dequantized values: the half2 form (float16 sums of the 2-bit
    codes, hence its tolerance) and the fields form (its field offset costs float32 bits: 1.1e-4 seen on the H200
    at the Mixtral shape); output and importance mass, other layers untouched, with the default splits and with 3."""
    from moec.compiler.targets import make_target
    from moec.schedules.kernels.tiered_decode import make_tiered_decode_cuda
    from moec_testing import require_cuda

    require_cuda()
    h, hkv, d, ps1, ps2 = shape
    if form.get("t2_mma") and d != 128:
        pytest.skip("the tensor-core tier 2 needs head_dim 128")
    rng = np.random.default_rng(sum(t1_lens))
    kv = [(rng.standard_normal((hkv, n1 + n2 * ps2, d)).astype(np.float32) * 2,
           rng.standard_normal((hkv, n1 + n2 * ps2, d)).astype(np.float32)) for n1, n2 in zip(t1_lens, t2_pages)]
    p1, p2 = sum(-(-n // ps1) for n in t1_lens) + 3, sum(t2_pages) + 3
    pools, tables, deq, slots = ref.fill_pools(kv, t1_lens, p1, p2, ps1, ps2, rng)
    qv = rng.standard_normal((len(t1_lens), h, d)).astype(np.float32)
    scale = d**-0.5
    f = tvm.compile(tvm.IRModule({"tiered_decode": make_tiered_decode_cuda(*shape, **form)}), target=make_target("cuda"))
    dev = tvm.cuda()
    mass0 = rng.random(pools["t1_k"].shape[:3]).astype(np.float32)
    m1, m2 = tables["t1_table"].shape[1], tables["t2_table"].shape[1]
    want = np.stack([ref.attention(qv[s], *deq[s], scale)[0] for s in range(len(t1_lens))])
    want_mass = ref.expected_mass(mass0, qv, deq, slots, scale)
    for splits in (None, 3):
        host = [qv] + [ref.layered(pools[k]) for k in ref.POOL_ORDER] + [tables[k] for k in ref.TABLE_ORDER]
        host += [np.zeros((len(t1_lens), h, d), np.float32), ref.layered(mass0)]
        host += [np.zeros(s_, dt) for s_, dt in decode_workspaces(len(t1_lens), h, hkv, m1, ps1, m2, ps2, d, splits,
                                                                   bool(form.get("t2_mma")))]
        tv = [tvm.runtime.tensor(a, dev) for a in host]
        f["tiered_decode"](*tv, ref.LAYER, scale)
        out, mass = tv[15].numpy(), tv[16].numpy()
        np.testing.assert_array_equal(mass[0], ref.layered(mass0)[0])
        assert np.abs(out - want).max() < tol[0], (splits, np.abs(out - want).max())
        assert np.abs(mass[ref.LAYER] - want_mass).max() < tol[1], (splits, np.abs(mass[ref.LAYER] - want_mass).max())


def _emulated_decode(form, shape, t1_lens, t2_pages, splits, t2_mma=False, qscale=1.0):
    """One decode step of the CUDA form ``form`` run on the CPU emulation of its generated code (tests/cuda_emu.py)
    against NumPy over the same dequantized values: (max output error, max importance-mass error). With
    ``merge_in_split`` in ``form`` only the split kernel runs (its last warp of each pair merges), and its arrival
    counters must be zero again after it."""
    from cuda_emu import EmulatedKernel

    from moec.compiler.targets import make_target
    from moec.schedules.kernels.tiered_decode import make_tiered_decode_cuda

    h, hkv, d, ps1, ps2 = shape
    rng = np.random.default_rng(sum(t1_lens))
    kv = [(rng.standard_normal((hkv, n1 + n2 * ps2, d)).astype(np.float32) * 2,
           rng.standard_normal((hkv, n1 + n2 * ps2, d)).astype(np.float32)) for n1, n2 in zip(t1_lens, t2_pages)]
    pools, tables, deq, slots = ref.fill_pools(kv, t1_lens, sum(-(-n // ps1) for n in t1_lens) + 3, sum(t2_pages) + 3,
                                               ps1, ps2, rng)
    qv = (rng.standard_normal((len(t1_lens), h, d)) * qscale).astype(np.float32)
    scale = d**-0.5
    with tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}):  # (no host-computed kernel parameters)
        src = tvm.compile(tvm.IRModule({"tiered_decode": make_tiered_decode_cuda(*shape, **form)}),
                          target=make_target("cuda")).mod.imports[0].inspect_source()
    fused = bool(form.get("merge_in_split"))
    split_k = EmulatedKernel(src, "tiered_decode_kernel")
    merge_k = None if fused else EmulatedKernel(src, "tiered_decode_kernel_1")
    assert fused == ("tiered_decode_kernel_1" not in src)  # one kernel when the split warps merge
    b, (m1, m2) = len(t1_lens), (tables["t1_table"].shape[1], tables["t2_table"].shape[1])
    lp = {k: np.ascontiguousarray(ref.layered(pools[k])) for k in ref.POOL_ORDER}
    mass0 = rng.random(pools["t1_k"].shape[:3]).astype(np.float32)
    # the output and the workspaces start as NaN (compiled models allocate them without a fill): every split writes
    # its partials and every score the merge reads before anything reads them; only merge_in_split's counters start 0
    out, mass = np.full((b, h, d), np.nan, np.float32), np.ascontiguousarray(ref.layered(mass0))
    ws = [np.full(s_, np.nan, dt) for s_, dt in decode_workspaces(b, h, hkv, m1, ps1, m2, ps2, d, splits, t2_mma, fused)]
    if fused:
        ws[2][:, :, -1] = 0
    args = dict(q=qv, t1_k8=lp["t1_k"], t1_v8=lp["t1_v"], t1_k32=lp["t1_k"].view(np.uint32), t1_v32=lp["t1_v"].view(np.uint32), t1_ks32=lp["t1_ks"].view(np.uint32), t1_vs32=lp["t1_vs"].view(np.uint32), t1_ks1=lp["t1_ks"], t1_vs1=lp["t1_vs"], t2_k32=lp["t2_k"].view(np.uint32),
                t2_v32=lp["t2_v"].view(np.uint32), t2_kmu1=lp["t2_kmu"], t2_ksig1=lp["t2_ksig"], t2_vmu1=lp["t2_vmu"],
                t2_vsig1=lp["t2_vsig"], t2_vmu32=lp["t2_vmu"].view(np.uint32), t2_vsig32=lp["t2_vsig"].view(np.uint32),
                scores=ws[0], part_acc=ws[1], part_ml=ws[2], out=out, t1_mass=mass, B=b, M1=m1, M2=m2, P1=lp["t1_k"].shape[1],
                P2=lp["t2_k"].shape[1], S=ws[1].shape[2], layer=ref.LAYER, sm_scale=scale, **tables)
    pick = lambda k: {n.removesuffix("_ptr"): args[n.removesuffix("_ptr")] for _, n in k.params}  # noqa: E731
    split_k((b * ws[1].shape[2], hkv, 1), 32, **pick(split_k))
    if fused:
        assert not ws[2][:, :, -1].any()  # every pair's counter back to zero
    else:
        merge_k((b, hkv, 1), min(d, 128), **pick(merge_k))
    np.testing.assert_array_equal(mass[0], ref.layered(mass0)[0])  # other layers untouched
    want = np.stack([ref.attention(qv[s], *deq[s], scale)[0] for s in range(b)])
    return float(np.abs(out - want).max()), float(np.abs(mass[ref.LAYER] - ref.expected_mass(mass0, qv, deq, slots, scale)).max())


def test_half2_form_emulated():
    """The compiled models' form (half2, 4 stages; matched NumPy on the H200 within 5e-3 / 1e-3) on the emulator: a
    check of the emulation of its FP8 tier-1 loads, float16-pair helpers and cp.async ring."""
    err, merr = _emulated_decode({"half2": True, "stages": 4}, (32, 8, 128, 16, 128), [33, 16], [2, 3], None)
    assert err < 5e-3 and merr < 1e-3, (err, merr)


def test_merge_long_tier1_emulated():
    """The merge kernel's tier-1 importance loop (NT2 tokens a round, 4 rounds unrolled) over more tier-1 tokens than
    one unrolled sweep holds: 300 tokens at head_dim 32 are 3 sweeps of 4 x 32, the last one partial."""
    err, merr = _emulated_decode({"half2": True, "stages": 4}, (4, 2, 32, 16, 32), [300, 45], [2, 1], None)
    assert err < 5e-3 and merr < 1e-3, (err, merr)


def test_half2_form_with_launch_bounds_emulated():
    """The launch-bounded half2 variants timed on the GPU (3 stages, 20 blocks an SM) compute what the default does."""
    err, merr = _emulated_decode({"half2": True, "stages": 3, "min_blocks": 20}, (16, 16, 128, 16, 128), [70, 0], [3, 2], 3)
    assert err < 5e-3 and merr < 1e-3, (err, merr)


@pytest.mark.parametrize("shape,t1_lens,t2_pages,splits,qscale", [
    ((16, 16, 128, 16, 128), [70, 33], [3, 2], 3, 1.0),  # OLMoE's heads, partial tier-1 tiles, three splits
    ((32, 8, 128, 16, 128), [100, 16], [1, 3], None, 2.0)])  # Mixtral's (4 query heads per KV head), peakier queries
def test_half2_tier1_emulated(shape, t1_lens, t2_pages, splits, qscale):
    """``t1_half2``: tier 1's sums in float16 pairs (FP8 widened exactly, q / max |q| and p / max p of the tile as
    halves) against NumPy, next to the float32 tier 1 on the same inputs."""
    err, merr = _emulated_decode({"half2": True, "stages": 4, "t1_half2": True}, shape, t1_lens, t2_pages, splits,
                                 qscale=qscale)
    base, bmerr = _emulated_decode({"half2": True, "stages": 4}, shape, t1_lens, t2_pages, splits, qscale=qscale)
    # the output as the float32 tier 1 gives it; the mass (from the scores, float16 sums of two chains of four pairs)
    # within twice the float32 tier 1's error (1.5e-4 -> 1.5e-4 at qscale 1, 7e-4 -> 1.2e-3 at 2 on the emulator)
    assert err < base + 1e-4 and merr < max(2 * bmerr, 5e-4), (err, base, merr, bmerr)


@pytest.mark.parametrize("extra", [{}, {"t1_half2": True}])
def test_scatter_scores_emulated(extra):
    """``scatter_scores`` (one reduce-scatter a tile, the softmax on each lane's own token) computes what the sum per
    token does: the same errors against NumPy, to float32 rounding, on OLMoE's heads with partial tiles and splits."""
    shape, t1_lens, t2_pages = (16, 16, 128, 16, 128), [70, 33], [3, 2]
    got = _emulated_decode({"half2": True, "stages": 4, "scatter_scores": True, **extra}, shape, t1_lens, t2_pages, 3)
    want = _emulated_decode({"half2": True, "stages": 4, **extra}, shape, t1_lens, t2_pages, 3)
    assert got[0] < 5e-3 and got[1] < 1e-3, got
    assert abs(got[0] - want[0]) < 1e-5 and abs(got[1] - want[1]) < 1e-5, (got, want)


def test_unrolled_page_emulated():
    """``unroll_page`` (the page's tiles unrolled: constant stage slots and row offsets) does the same operations in the
    same order: the same output and importance as the rolled loop, to the bit, on the compiled OLMoE form with pages of
    4 tiles on 4 stages and, for the ring's slots not lining up with the page's tiles, on 3 stages."""
    shape, t1_lens, t2_pages = (16, 16, 128, 16, 128), [70, 33], [3, 2]
    for stages in (4, 3):
        form = {"half2": True, "stages": stages, "t1_half2": True, "scatter_scores": True}
        got = _emulated_decode({**form, "unroll_page": True}, shape, t1_lens, t2_pages, 3)
        want = _emulated_decode(form, shape, t1_lens, t2_pages, 3)
        assert got[0] < 5e-3 and got[1] < 1e-3 and got == want, (stages, got, want)
    from moec.schedules.kernels.tiered_decode import make_tiered_decode_cuda

    for extra in ({"half2": True}, {"t2_mma": True}):
        with pytest.raises(ValueError, match="unroll_page"):
            make_tiered_decode_cuda(16, 16, 128, unroll_page=True, **extra)


def test_scatter_scores_refuses_grouped_heads():
    from moec.schedules.kernels.tiered_decode import make_tiered_decode_cuda

    with pytest.raises(ValueError, match="scatter_scores takes one query head per KV head"):
        make_tiered_decode_cuda(32, 8, 128, half2=True, stages=4, scatter_scores=True)


def test_half2_tier1_refuses_staged_or_tensor_core_tier1():
    from moec.schedules.kernels.tiered_decode import make_tiered_decode_cuda

    for extra in ({"t1_stages": 2}, {"t2_mma": True, "t1_mma": True}):
        with pytest.raises(ValueError, match="t1_half2"):
            make_tiered_decode_cuda(16, 16, 128, t1_half2=True, **extra)


PF, T1 = {"t2_prefetch": True}, {"t1_mma": True}


@pytest.mark.parametrize("extra,shape,t1_lens,t2_pages,splits,qscale", [
    ({}, (16, 16, 128, 16, 128), [70, 0], [3, 2], None, 1.0),  # OLMoE's heads; a sequence with tier 2 only
    ({}, (32, 8, 128, 16, 128), [33, 16], [2, 3], 2, 2.0),  # Mixtral's (4 query heads per KV head), the fewest splits
    # tier 1 on tensor cores too, each tile's words loaded during the last, q' kept in registers; many splits
    ({**T1, **PF, "t2_keep_q": True}, (32, 8, 128, 16, 128), [100, 0], [1, 3], 9, 1.0),
    # the same with half the splits on tier 1 (t1_quarters 2: 2 of the 4 splits)
    ({**T1, **PF, "t2_keep_q": True, "t1_quarters": 2}, (32, 8, 128, 16, 128), [100, 40], [2, 3], 4, 1.0),
    # no tier-2 page (the tier-2 splits write empty partials), tier 1 on tensor cores with partial last pages
    (T1, (16, 16, 128, 16, 128), [37, 5], [0, 0], 3, 2.0),
    # tier 2's tiles staged through shared memory (a ring of 4 / 3): pages of 8 tiles, the ring across page ends and
    # past the last tile; OLMoE's heads with tier 1 in float16 pairs on CUDA cores, Mixtral's with tier 1 on tensor cores
    ({"stages": 4, "t2_keep_q": True, "t1_half2": True}, (16, 16, 128, 16, 128), [70, 16], [3, 2], 3, 1.0),
    ({**T1, "stages": 3, "t2_keep_q": True, "t1_quarters": 2}, (32, 8, 128, 16, 128), [100, 40], [2, 3], 4, 2.0),
    # the page's 8 tiles unrolled (constant slots of a ring of 4 / offsets of a ring of 3)
    ({"stages": 4, "t2_keep_q": True, "t1_half2": True, "unroll_page": True}, (16, 16, 128, 16, 128), [70, 16], [3, 2], 3, 1.0),
    ({**T1, "stages": 3, "t2_keep_q": True, "unroll_page": True}, (32, 8, 128, 16, 128), [33, 16], [2, 3], 3, 1.0)])
def test_tensor_core_decode_emulated(extra, shape, t1_lens, t2_pages, splits, qscale):
    """``t2_mma``: tier 2 on tensor cores (keys: codes x q sigma; values: codes^T x p sigma, the 2-bit codes as
    float16 1024 + c 2^p), tier 1 in splits of its own; ``t1_mma``: tier 1 too (FP8 widened to float16 pairs,
    q' as a high and a low float16 part). On the emulator against NumPy. Their sums are float32, so they are closer
    than the half2 form, whose tolerance (5e-3 output, 1e-3 mass) they are held to (peakier queries, qscale 2, give
    the half2 form 6e-3 on these inputs, this one 2e-3)."""
    err, merr = _emulated_decode({"t2_mma": True, **extra}, shape, t1_lens, t2_pages, splits, t2_mma=True, qscale=qscale)
    assert err < 3e-3 and merr < 1e-3, (err, merr)


def test_tensor_core_tier2_operands():
    # each pair of a word as two float16 1024 + c 2^p with p in 4 .. 8, one AND-OR of the word or a shifted copy
    from moec.schedules.kernels.tiered_decode import MMA_POS, mma_pair_np

    w = np.random.default_rng(0).integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
    for j in range(8):
        lo, hi = mma_pair_np(w, j)
        assert 4 <= MMA_POS[j] <= 8
        np.testing.assert_array_equal(lo.astype(np.float64), 1024 + ((w >> np.uint32(2 * j)) & 3) * 2.0 ** MMA_POS[j])
        np.testing.assert_array_equal(hi.astype(np.float64), 1024 + ((w >> np.uint32(2 * j + 16)) & 3) * 2.0 ** MMA_POS[j])


def test_tensor_core_tier2_compiles_and_refuses():
    from moec.compiler.targets import make_target
    from moec.schedules.kernels.tiered_decode import make_tiered_decode_cuda, make_tiered_decode_for_models, t2_mma_unsupported

    fn = make_tiered_decode_for_models(32, 8, 128, 16, 128, t2_mma=True)
    src = tvm.compile(tvm.IRModule({"tiered_decode": fn}), target=make_target("cuda", "sm_90")).mod.imports[0].inspect_source()
    # tier 2: per page 8 mma for the keys' offsets, per 16-token tile 8 for the scores and 8 for the values
    # and tier 1's: per 16-token page 16 for the scores (q' in a high and a low float16 part), 8 for the values
    assert src.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") == 48 and "cvt.rn.f16x2.e4m3x2" in src
    assert src.count("moec_hfma2(") == 1 and src.count("moec_pack_h2(") > 1  # (the prelude's definition): no half2 sums
    assert "__byte_perm" in src and "__ballot_sync" in src
    assert "tensor-core tier 2" in fn.script()  # the host's check of the split count
    assert t2_mma_unsupported(16, 16, 128, 128) is None
    assert "head_dim 64" in t2_mma_unsupported(16, 16, 64, 128) and "16 query heads" in t2_mma_unsupported(32, 2, 128, 128)
    with pytest.raises(ValueError, match="head_dim 128"):
        make_tiered_decode_cuda(4, 2, 32, 16, 32, t2_mma=True)
    with pytest.raises(ValueError, match="pick one"):
        make_tiered_decode_cuda(16, 16, 128, t2_mma=True, half2=True)
    with pytest.raises(ValueError, match="not both"):
        make_tiered_decode_cuda(16, 16, 128, t2_mma=True, stages=4, t2_prefetch=True)
    # staged: one cp.async ring of 16-token tiles (4 chunks a lane a tile: K and V rows, lanes 0 .. 3 value mu / sigma)
    src = tvm.compile(tvm.IRModule({"tiered_decode": make_tiered_decode_cuda(16, 16, 128, t2_mma=True, stages=4)}),
                      target=make_target("cuda", "sm_90")).mod.imports[0].inspect_source()
    assert "cp_async_wait_group_async_wait_group_2" in src and "__shared__" in src
    with pytest.raises(ValueError, match="t2_prefetch, t1_mma, t2_keep_q and t1_quarters are options"):
        make_tiered_decode_cuda(16, 16, 128, half2=True, t2_prefetch=True)
    with pytest.raises(ValueError, match="t1_quarters are options"):
        make_tiered_decode_cuda(16, 16, 128, half2=True, t1_quarters=2)
    with pytest.raises(ValueError, match="t1_quarters must be 1, 2 or 3"):
        make_tiered_decode_cuda(32, 8, 128, t2_mma=True, t1_quarters=4)
    with pytest.raises(ValueError, match="tier-1 pages of 16 tokens"):
        make_tiered_decode_cuda(16, 16, 128, 32, 128, t2_mma=True, t1_mma=True)


@pytest.mark.parametrize("form,shape,t1_lens,t2_pages,splits", [
    ({"half2": True, "stages": 4, "t1_half2": True, "scatter_scores": True}, (16, 16, 128, 16, 128), [70, 33], [3, 2], 3),
    # 2 query heads per KV head, 32-channel heads (a channel a lane), 300 tier-1 tokens (the merge loop's 2 sweeps)
    ({"half2": True, "stages": 4}, (4, 2, 32, 16, 32), [300, 45], [2, 1], 2),
], ids=["olmoe-paired-scat", "long-tier1-dh32-g2"])
def test_merge_in_split_emulated(form, shape, t1_lens, t2_pages, splits):
    """``merge_in_split``: no merge kernel; the last split warp of each (sequence, KV head) merges and adds the
    importance: the same output and mass as the two kernels, to float32 rounding (its 32 lanes sum in another order)."""
    got = _emulated_decode({**form, "merge_in_split": True}, shape, t1_lens, t2_pages, splits)
    want = _emulated_decode(form, shape, t1_lens, t2_pages, splits)
    assert got[0] < 5e-3 and got[1] < 1e-3, got
    assert abs(got[0] - want[0]) < 1e-5 and abs(got[1] - want[1]) < 1e-5, (got, want)
