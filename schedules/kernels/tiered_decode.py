"""Batched single-token decode attention over the tiered KV cache (TIR), with importance accumulation.

One call per layer. For every sequence b and query head h (KV head ``h // (H / Hkv)``) it runs an
online softmax over the sequence's tier-1 tokens (FP8 e4m3 bytes times a per-token scale) and then
its tier-2 pages (2-bit codes on a uniform grid: keys ``mu + sigma * level`` per channel, values per token), all
dequantized in registers, and writes ``out[b, h, :]``. It also adds each tier-1 token's final
attention probability, summed over the query heads of its KV head, to ``t1_mass`` (the importance
the re-rank reads); the scores of pass one are kept in ``scores`` (a workspace) for that.
Workspaces (``decode_workspaces`` gives their shapes, the same for both forms): ``scores``, and the
CUDA form's per-split partial results ``part_acc`` / ``part_ml`` (the llvm form leaves them alone).

Buffers (layout of ``moec.runtime.kv_cache``; B sequences, P1/P2 pages per pool, M1/M2 table width):
  q        float32 [B, H, Dh]
  t1_k/v   uint8   [P1, Hkv, PS1, Dh]        t1_ks/vs  float16 [P1, Hkv, PS1]
  t2_k/v   uint8   [P2, Hkv, PS2, Dh/4]      t2_kmu/ksig float16 [P2, Hkv, Dh], t2_vmu/vsig [P2, Hkv, PS2]
  t1_table int32   [B, M1], t1_len int32 [B] (tokens), t2_table int32 [B, M2], t2_pages int32 [B]
  out      float32 [B, H, Dh]                t1_mass float32 [P1, Hkv, PS1] (accumulated in place)
  scores   float32 [B, H, M1 * PS1]          workspace; part_acc float32 [B, H, S, Dh], part_ml [B, H, S, 2]

FP8 bytes are decoded with integer arithmetic (sign, 4-bit exponent, 3-bit mantissa; subnormals
``m * 2^-9``) rather than a cast: TVM's llvm fp8 cast is wrong, and the same code runs on both targets.
``make_tiered_decode(..., target="llvm")`` is the serial CPU form the tests run in CI.
"""

from __future__ import annotations

import math

try:
    from tvm.script import tirx as T
except ImportError:  # runtime-only TVM (the GPU bench): decode_splits / decode_workspaces still work
    T = None

from ...runtime.kv_quant import Q2_LEVELS

LOG2E = math.log2(math.e)


def _fp8_to_f32(byte):
    bits = T.Cast("uint32", byte)
    exp = (bits >> T.uint32(3)) & T.uint32(15)
    man = bits & T.uint32(7)
    mag = T.if_then_else(
        exp == T.uint32(0),
        T.Cast("float32", man) * T.float32(2.0**-9),
        T.reinterpret("float32", ((exp + T.uint32(120)) << T.uint32(23)) | (man << T.uint32(20))),
    )
    return T.if_then_else((bits & T.uint32(128)) != T.uint32(0), -mag, mag)


def q2_value(code):
    """The grid level of a 2-bit ``code`` (uint32), as float32."""
    lv = [float(x) for x in Q2_LEVELS]
    return T.if_then_else(code == T.uint32(0), T.float32(lv[0]), T.if_then_else(
        code == T.uint32(1), T.float32(lv[1]), T.if_then_else(code == T.uint32(2), T.float32(lv[2]), T.float32(lv[3]))))


def _q2_level(packed, d):
    return q2_value((T.Cast("uint32", packed) >> T.Cast("uint32", (d % 4) * 2)) & T.uint32(3))


OUT_DTYPES = ("float32", "float16", "bfloat16")


def _check_out_dtype(out_dtype: str) -> None:
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"tiered decode: out_dtype must be one of {', '.join(OUT_DTYPES)}, got {out_dtype!r}")


def make_tiered_decode(num_heads: int, num_kv_heads: int, head_dim: int, t1_page: int = 16, t2_page: int = 128,
                       target: str = "llvm", out_dtype: str = "float32"):
    """The decode attention PrimFunc for one head configuration (``target``: "llvm"); ``out`` in ``out_dtype``
    (float32, or the model's 16-bit dtype: rounded once, as a cast after a float32 output would)."""
    _check_out_dtype(out_dtype)
    if target != "llvm":
        raise NotImplementedError("the CUDA schedule of the tiered decode kernel is not built yet")
    H, HKV, D, PS1, PS2 = num_heads, num_kv_heads, head_dim, t1_page, t2_page
    G = H // HKV
    D4 = D // 4

    @T.prim_func(s_tir=True)
    def tiered_decode(q_h: T.handle, t1k_h: T.handle, t1v_h: T.handle, t1ks_h: T.handle, t1vs_h: T.handle,
                      t2k_h: T.handle, t2v_h: T.handle, t2kmu_h: T.handle, t2ksig_h: T.handle, t2vmu_h: T.handle,
                      t2vsig_h: T.handle, t1tab_h: T.handle, t1len_h: T.handle, t2tab_h: T.handle, t2np_h: T.handle,
                      out_h: T.handle, mass_h: T.handle, scores_h: T.handle, pacc_h: T.handle, pml_h: T.handle,
                      layer: T.int32, sm_scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "tiered_decode"})
        NL, B, P1, P2, M1, M2, S = T.int64(), T.int32(), T.int64(), T.int64(), T.int32(), T.int32(), T.int32()
        q = T.match_buffer(q_h, (B, H, D), "float32")
        t1_k = T.match_buffer(t1k_h, (NL, P1, HKV, PS1, D), "uint8")
        t1_v = T.match_buffer(t1v_h, (NL, P1, HKV, PS1, D), "uint8")
        t1_ks = T.match_buffer(t1ks_h, (NL, P1, HKV, PS1), "float16")
        t1_vs = T.match_buffer(t1vs_h, (NL, P1, HKV, PS1), "float16")
        t2_k = T.match_buffer(t2k_h, (NL, P2, HKV, PS2, D4), "uint8")
        t2_v = T.match_buffer(t2v_h, (NL, P2, HKV, PS2, D4), "uint8")
        t2_kmu = T.match_buffer(t2kmu_h, (NL, P2, HKV, D), "float16")
        t2_ksig = T.match_buffer(t2ksig_h, (NL, P2, HKV, D), "float16")
        t2_vmu = T.match_buffer(t2vmu_h, (NL, P2, HKV, PS2), "float16")
        t2_vsig = T.match_buffer(t2vsig_h, (NL, P2, HKV, PS2), "float16")
        t1_table = T.match_buffer(t1tab_h, (B, M1), "int32")
        t1_len = T.match_buffer(t1len_h, (B,), "int32")
        t2_table = T.match_buffer(t2tab_h, (B, M2), "int32")
        t2_np = T.match_buffer(t2np_h, (B,), "int32")
        out = T.match_buffer(out_h, (B, H, D), out_dtype)
        t1_mass = T.match_buffer(mass_h, (NL, P1, HKV, PS1), "float32")
        scores = T.match_buffer(scores_h, (B, H, M1 * PS1), "float32")
        T.match_buffer(pacc_h, (B, H, S, D), "float32")  # split partials: used by the CUDA form only
        T.match_buffer(pml_h, (B, H, S, 2), "float32")

        for b in T.serial(B):
            with T.sblock("attn"):
                acc = T.sblock_alloc_buffer((D,), "float32")
                kv = T.sblock_alloc_buffer((D,), "float32")
                m_val = T.sblock_alloc_buffer((H,), "float32")
                l_val = T.sblock_alloc_buffer((H,), "float32")
                s_val = T.sblock_alloc_buffer((1,), "float32")
                new_m = T.sblock_alloc_buffer((1,), "float32")
                for h in T.serial(H):
                    hk: T.let[T.int32] = h // G
                    m_val[h] = T.float32(-1e30)
                    l_val[h] = T.float32(0)
                    for d in T.serial(D):
                        acc[d] = T.float32(0)
                    # tier 1: FP8 tokens, compacted at the front of the sequence's tier-1 pages
                    for i in T.serial(t1_len[b]):
                        page: T.let[T.int32] = t1_table[b, i // PS1]
                        slot: T.let[T.int32] = i % PS1
                        s_val[0] = T.float32(0)
                        for d in T.serial(D):
                            s_val[0] += q[b, h, d] * _fp8_to_f32(t1_k[layer, page, hk, slot, d])
                        s_val[0] = s_val[0] * T.Cast("float32", t1_ks[layer, page, hk, slot]) * sm_scale * T.float32(LOG2E)
                        scores[b, h, i] = s_val[0]
                        new_m[0] = T.max(m_val[h], s_val[0])
                        l_val[h] = l_val[h] * T.exp2(m_val[h] - new_m[0]) + T.exp2(s_val[0] - new_m[0])
                        for d in T.serial(D):
                            acc[d] = acc[d] * T.exp2(m_val[h] - new_m[0]) + T.exp2(s_val[0] - new_m[0]) * (
                                _fp8_to_f32(t1_v[layer, page, hk, slot, d]) * T.Cast("float32", t1_vs[layer, page, hk, slot]))
                        m_val[h] = new_m[0]
                    # tier 2: full 2-bit pages
                    for pi in T.serial(t2_np[b]):
                        page2: T.let[T.int32] = t2_table[b, pi]
                        for j in T.serial(PS2):
                            for d in T.serial(D):
                                kv[d] = T.Cast("float32", t2_kmu[layer, page2, hk, d]) + T.Cast("float32", t2_ksig[layer, page2, hk, d]) * \
                                    _q2_level(t2_k[layer, page2, hk, j, d // 4], d)
                            s_val[0] = T.float32(0)
                            for d in T.serial(D):
                                s_val[0] += q[b, h, d] * kv[d]
                            s_val[0] = s_val[0] * sm_scale * T.float32(LOG2E)
                            new_m[0] = T.max(m_val[h], s_val[0])
                            l_val[h] = l_val[h] * T.exp2(m_val[h] - new_m[0]) + T.exp2(s_val[0] - new_m[0])
                            for d in T.serial(D):
                                acc[d] = acc[d] * T.exp2(m_val[h] - new_m[0]) + T.exp2(s_val[0] - new_m[0]) * (
                                    T.Cast("float32", t2_vmu[layer, page2, hk, j]) + T.Cast("float32", t2_vsig[layer, page2, hk, j]) *
                                    _q2_level(t2_v[layer, page2, hk, j, d // 4], d))
                            m_val[h] = new_m[0]
                    for d in T.serial(D):
                        out[b, h, d] = T.Cast(out_dtype, T.if_then_else(l_val[h] > T.float32(0), acc[d] / l_val[h], T.float32(0)))
                # importance: each tier-1 token's probability, summed over the query heads of its KV head
                for h in T.serial(H):
                    for i in T.serial(t1_len[b]):
                        t1_mass[layer, t1_table[b, i // PS1], h // G, i % PS1] += T.exp2(scores[b, h, i] - m_val[h]) / l_val[h]

    return tiered_decode



def t2_mma_unsupported(num_heads: int, num_kv_heads: int, head_dim: int, t2_page: int) -> str | None:
    """Why the tensor-core tier 2 (``make_tiered_decode_cuda(t2_mma=True)``) cannot serve these heads, or None."""
    g = num_heads // num_kv_heads
    if head_dim != 128:
        return f"head_dim {head_dim} (it needs 128)"
    if g > 8:
        return f"{g} query heads per KV head (it takes at most 8)"
    if t2_page % 64:
        return f"tier-2 pages of {t2_page} tokens (it needs a multiple of 64)"
    if uniform_grid() is None:
        return "2-bit levels that are not evenly spaced"
    return None


DECODE_KERNELS = ("split", "split-half2", "split-fields", "split-mma", "split-paired")
MMA_MIN_GROUP = 4  # "split" takes the tensor-core form from this many query heads per KV head


def decode_form(num_heads: int, num_kv_heads: int, head_dim: int, t2_page: int, kernel: str = "split") -> str:
    """The CUDA decode form of ``kernel`` (one of DECODE_KERNELS) for these heads: "half2", "fields", "mma" or "paired".

    "split" picks the faster measured form: on the H100 at 128 x 4096 (bench/results/tiered_decode_h100_mma.json), the
    tensor-core form took Mixtral's layer (4 query heads per KV head) in 0.316 ms against the half2 form's 0.450, and
    OLMoE's (one) in 0.451 against 0.344, each at its best split count: tensor cores from MMA_MIN_GROUP query heads
    per KV head where the form serves the heads, half2 below (2 and 3 are not measured). With one query head per KV
    head, the paired form (both tiers in float16 pairs, one reduce-scatter of a tile's scores): on the H200
    (bench/results/tiered_decode_h200_d9f0206.json) OLMoE's layer took 0.271 ms against the half2 form's 0.284 at
    4 splits (ncu: 259 against 275 us, 12% fewer instructions), on the H100, bound by DRAM there, 0.344 against 0.341."""
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"unknown split decode kernel {kernel!r}; expected one of {DECODE_KERNELS}")
    if kernel == "split":
        g = num_heads // num_kv_heads
        mma = g >= MMA_MIN_GROUP and t2_mma_unsupported(num_heads, num_kv_heads, head_dim, t2_page) is None
        return "mma" if mma else "paired" if g == 1 else "half2"
    return {"split-half2": "half2", "split-fields": "fields", "split-mma": "mma", "split-paired": "paired"}[kernel]


def make_tiered_decode_for_models(num_heads: int, num_kv_heads: int, head_dim: int, t1_page: int = 16,
                                  t2_page: int = 128, fields: bool = False, t2_mma: bool = False, paired: bool = False,
                                  out_dtype: str = "float32"):
    """The CUDA form compiled models use, the fastest measured on the H200 at 128 x 4096 (all checked
    against NumPy there; bench/results/tiered_decode_h200_fields.json): 2-bit fields (one LOP3 and one
    FFMA a code), bases in registers, tier-2 tiles staged in 4 cp.async stages. OLMoE (one query head
    per KV head) 0.371 ms a layer against 0.526 for the per-bit form with split value sums; Mixtral (4
    query heads per KV head) 0.454 against 0.574 for the per-bit form with bases in registers.

    Since 449cc97 the default is the half2 form (``make_tiered_decode_cuda(half2=True)``, 4 stages): the tier-2
    codes in pairs of float16 halves, checked against NumPy on the H200 (output error at most 4.5e-4) and faster:
    OLMoE 0.320 ms a layer, Mixtral 0.447 (bench/results/tiered_decode_h200_half2.json). ``fields`` (the
    ``split-fields`` decode kernel) keeps the float32 fields form above. ``t2_mma`` (the ``split-mma`` decode
    kernel) takes tier 2 on tensor cores (``make_tiered_decode_cuda(t2_mma=True)``), and tier 1 too where its pages
    are of 16 tokens (``t1_mma``), which needs ``decode_splits(..., t2_mma=True)`` splits; with q' kept
    in registers for the whole split (``t2_keep_q``: 162 registers at Mixtral's shape, no spills), timed on the H100
    at 0.281 ms a layer against 0.317 at Mixtral's shape (bench/results/tiered_decode_h100_c23b99a.json; 0.285
    against 0.318 in tiered_decode_h100_d47e776.json). ``paired`` (the
    ``split-paired`` decode kernel) is the half2 form with tier 1 in float16 pairs too (``t1_half2``) and, with one
    query head per KV head and as many tokens a tile's group as lanes a token, one reduce-scatter of a tile's scores
    (``scatter_scores``)."""
    if paired:
        g, lpt = num_heads // num_kv_heads, head_dim // 16
        scatter = g == 1 and min(8, t1_page, t2_page // (32 // lpt)) == lpt  # (the tile's KSTEP for one query head)
        return make_tiered_decode_cuda(num_heads, num_kv_heads, head_dim, t1_page, t2_page, stages=4, half2=True,
                                       t1_half2=True, scatter_scores=scatter, out_dtype=out_dtype)
    if t2_mma:  # (tier 1 on tensor cores too where its pages are of 16 tokens; each tile's words loaded a tile ahead)
        return make_tiered_decode_cuda(num_heads, num_kv_heads, head_dim, t1_page, t2_page, t2_mma=True,
                                       t1_mma=t1_page == 16, t2_prefetch=True, t2_keep_q=True, out_dtype=out_dtype)
    if not fields:
        return make_tiered_decode_cuda(num_heads, num_kv_heads, head_dim, t1_page, t2_page, stages=4, half2=True,
                                       out_dtype=out_dtype)
    return make_tiered_decode_cuda(num_heads, num_kv_heads, head_dim, t1_page, t2_page, stages=4, reg_bases=True,
                                   fields=True, out_dtype=out_dtype)


# ---------------------------------------------------------------------------------------------------
# CUDA form
#
# 2-bit codes are decoded without integer-to-float conversions. Per bit (any symmetric grid): a code's
# two bits b0, b1 are each masked, in place, into a float32 bit pattern with a fixed base (one LOP3
# each), so that f = Y + b (X - Y) exactly; the level is affine in the bits (lev = -L1 + (L1 - L0) b0
# + (L1 + L0) b1), hence affine in (f0, f1). Bit positions from 20 up keep (X - Y) / X well away from
# the float32 rounding; codes below are shifted up by 12 or 24 (two shifts per 16 codes).
# Per field (``fields``, the uniform grid of ``kv_quant``): the code's two bits are masked together into
# the mantissa of 1.0 at bits p, p + 1, so f = 1 + c 2^(p - 23) for the code's integer c, and the level
# lo + step c is affine in f: one LOP3 and one FMA a code. Fields sit at p = 14 .. 20 (four codes per
# shifted copy of the word: w << 14, w << 6, w >> 2, w >> 10), where f's informative part is at least
# 2^-9 of f. Per code position the constants differ, and are folded at compile time.


def _bit_float(k: int) -> tuple[int, float, float]:
    """(base bits, value with bit k clear, value with bit k set) of the float built as base | bit k."""
    import struct

    if 19 <= k <= 22:
        base = 0x3F800000
    elif 23 <= k <= 29:
        base = (127 - (1 << (k - 23))) << 23
    elif k == 30:
        base = 1 << 23
    elif k == 31:
        base = 0x3F800000
    else:
        raise ValueError(k)
    assert not base & (1 << k)
    f = lambda bits: struct.unpack("<f", struct.pack("<I", bits))[0]  # noqa: E731
    return base, f(base), f(base | (1 << k))


def _code_plan():
    """For each of the 16 codes of a uint32 word: (source word 0/1/2 = w, w << 12, w << 24; bit of b0)."""
    plan = []
    for i in range(16):
        if i >= 10:
            plan.append((0, 2 * i))
        elif i >= 4:
            plan.append((1, 2 * i + 12))
        else:
            plan.append((2, 2 * i + 24))
    return plan


def _code_consts():
    """Per code position: (src, mask0, base0, mask1, base1, c0, c1, cc) with lev = cc + c0 f0 + c1 f1."""
    l0, l1 = float(Q2_LEVELS[2]), float(Q2_LEVELS[3])
    out = []
    for src, p in _code_plan():
        b0, y0, x0 = _bit_float(p)
        b1, y1, x1 = _bit_float(p + 1)
        c0, c1 = (l1 - l0) / (x0 - y0), (l1 + l0) / (x1 - y1)
        out.append((src, 1 << p, b0, 1 << (p + 1), b1, c0, c1, -l1 - c0 * y0 - c1 * y1))
    return out


FIELD_SHIFTS = (14, 6, -2, -10)  # codes 4 j .. 4 j + 3 of a word sit at bits 14 .. 21 of w shifted by FIELD_SHIFTS[j]


def uniform_grid() -> tuple[float, float] | None:
    """(lowest level, step) when the 2-bit levels are evenly spaced (the ``fields`` form needs it), else None."""
    import numpy as np

    lv = np.asarray(Q2_LEVELS, np.float64)
    d = np.diff(lv)
    return (float(lv[0]), float(d[0])) if np.allclose(d, d[0], rtol=1e-6, atol=0) else None


def _field_consts():
    """Per code position i: (source j, mask, c1, cc) with level = cc + c1 f, f the field's bit-float."""
    grid = uniform_grid()
    if grid is None:
        raise ValueError("the fields form of the tiered decode needs evenly spaced 2-bit levels")
    lo, step = grid
    out = []
    for i in range(16):
        p = 2 * i + FIELD_SHIFTS[i // 4]
        assert 14 <= p <= 20
        c1 = step * 2.0 ** (23 - p)  # f = 1 + c 2^(p - 23): level = lo + step c = lo - c1 + c1 f
        out.append((i // 4, 3 << p, c1, lo - c1))
    return out


# Half pairs (``half2``, the uniform grid): code j and code j + 8 of a word sit 16 bits apart, so one AND
# leaves both as the low and high half of a uint32; with exponent and sign bits zero each half is the
# subnormal c 2^(p - 24) of its code c at mantissa bit p. Codes 0 .. 4 are at p = 0 .. 8 of the word
# itself, codes 5 .. 7 at p = 0 .. 4 of the word shifted right by H2_SHIFT: one shift a word. A pair
# is then one fma.rn.f16x2 against q (keys) or p (values) scaled so that products and sums stay in the
# float16 range (see make_tiered_decode_cuda).
H2_SHIFT = 10
H2_KEY_EXP = 14  # keys: q' = (q sigma / max |q sigma|) 2^(H2_KEY_EXP - p), products u c 2^(H2_KEY_EXP - 24)
H2_VALUE_MAX = 2.0**14  # values: p' = p / max(p over the lane's tile) H2_VALUE_MAX


def _half2_consts() -> list[tuple[int, int, int]]:
    """Per pair j = 0 .. 7 (codes j and j + 8): (source 0 = w / 1 = w >> H2_SHIFT, mask, bit position p)."""
    out = []
    for j in range(8):
        src, p = (0, 2 * j) if j <= 4 else (1, 2 * j - H2_SHIFT)
        out.append((src, (3 << p) | (3 << (p + 16)), p))
    return out


# Tensor-core tier 2 (``t2_mma``, the uniform grid): the pair (j, j + 8) of a word is masked, as for ``half2``, but
# into the mantissa of the float16 1024.0 (0x6400), so each half is the normal number 1024 + c 2^p for its code c
# at mantissa bit p (tensor cores get no subnormal operands). p is kept at 4 .. 8, where the offset 1024 is at most
# 64 times the code's weight: pairs 0 .. 2 come from w << 4, 3 .. 4 from w itself, 5 .. 7 from w >> 6 (two shifts a
# word, then one LOP3 a pair). The offsets are subtracted in float32 (keys: the same mma on an all-1024 operand
# gives them; values: 1024 times the sum of the probabilities fed to the mma).
MMA_MAGIC = 0x64006400
MMA_SRC = (0, 0, 0, 1, 1, 2, 2, 2)  # pair j's copy of the word: w << 4, w, w >> 6
MMA_POS = (4, 6, 8, 6, 8, 4, 6, 8)  # pair j's mantissa bit p in that copy
MMA_VALUE_MAX = 2.0**10  # values: p' = p sigma VS with VS = MMA_VALUE_MAX / (the page's largest sigma)


def mma_pair_np(w, j):
    """NumPy model of ``t2_mma``'s pair j of uint32 words ``w``: (low half, high half) as float16 values."""
    import numpy as np

    w = np.asarray(w, np.uint32)
    x = {0: w << np.uint32(4), 1: w, 2: w >> np.uint32(6)}[MMA_SRC[j]]
    p = MMA_POS[j]
    u = (x & np.uint32((3 << p) | (3 << (p + 16)))) | np.uint32(MMA_MAGIC)
    return (u & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16), (u >> np.uint32(16)).astype(np.uint16).view(np.float16)


def _tab(i, values, dtype):
    """values[i] for an unrolled loop index i (a chain the simplifier folds once i is a constant)."""
    mk = {"uint32": T.uint32, "int32": T.int32, "float32": T.float32}[dtype]
    e = mk(values[-1])
    for j in range(len(values) - 2, -1, -1):
        e = T.if_then_else(i == j, mk(values[j]), e)
    return e


# One-warp blocks the split kernel aims for, over (query heads per KV head) for the tensor-core form and over its
# square for the others: a warp's work grows with its query heads, and fewer, longer warps did better for more of
# them. On the H100 (132 SMs, as the H200) at 128 x 4096 (bench/results/tiered_decode_h100_mma.json): the half2 form
# at OLMoE's 2048 (sequence, KV head) pairs took 0.391 / 0.355 / 0.344 ms in 1 / 2 / 4 splits, at Mixtral's 1024
# (4 query heads per KV head) 0.450 / 0.477 / 0.496; the tensor-core form was fastest at 5 splits for OLMoE, 3 for
# Mixtral. (The H200 at 0f6e297: Mixtral 0.62 ms in one split, 0.68 in two.)
SPLIT_WARPS = 8192


def split_warps(group: int, t2_mma: bool) -> int:
    """The warps ``decode_splits`` aims for with ``group`` query heads per KV head."""
    return SPLIT_WARPS // (group if t2_mma else group * group)


def split_count(pairs, group: int, t2_mma: bool, units=None, vmax=max, vmin=min):
    """The split count for ``pairs`` (sequence, KV head) pairs: ints here, or TIR expressions with ``vmax`` /
    ``vmin`` = ``tirx.max`` / ``tirx.min`` (the graph's workspaces). ``units`` caps it (more splits than tiles of
    work idle); with ``t2_mma`` one more, since tier 1 and tier 2 then never share a split."""
    s = vmin(8, (split_warps(group, t2_mma) + pairs - 1) // pairs)
    s = vmax(1, s if units is None else vmin(s, units))
    return s + 1 if t2_mma else s


def decode_splits(batch: int, num_kv_heads: int, m1: int, t1_page: int, m2: int, t2_mma: bool = False,
                  group: int = 1) -> int:
    """How many blocks (splits of the sequence) work on one (sequence, KV head) in the CUDA form, with ``group``
    query heads per KV head (``split_count``)."""
    units = max(1, m2 + (m1 * t1_page + 31) // 32)  # tier-2 pages plus tier-1 tiles
    return split_count(max(1, batch * num_kv_heads), group, t2_mma, units)


def decode_workspaces(batch: int, num_heads: int, num_kv_heads: int, m1: int, t1_page: int, m2: int, t2_page: int,
                      head_dim: int = 128, splits: int | None = None, t2_mma: bool = False,
                      merge_in_split: bool = False) -> list[tuple[tuple[int, ...], str]]:
    """Shapes and dtypes of the workspaces ``tiered_decode`` takes after ``t1_mass``, in argument order.

    ``scores`` [B, H, M1 * PS1] (tier-1 scores kept for the importance pass), ``part_acc``
    [B, H, S, Dh] and ``part_ml`` [B, H, S, 2] (the CUDA form's per-split unnormalised output and its
    running max and sum; S splits of the sequence, from ``decode_splits`` unless given); with
    ``merge_in_split`` ``part_ml`` has a row S more, the splits' arrival counters (zero, as every workspace is).
    """
    s = splits or decode_splits(batch, num_kv_heads, m1, t1_page, m2, t2_mma, num_heads // num_kv_heads)
    return [((batch, num_heads, m1 * t1_page), "float32"), ((batch, num_heads, s, head_dim), "float32"),
            ((batch, num_heads, s + int(merge_in_split), 2), "float32")]


def make_tiered_decode_cuda(num_heads: int, num_kv_heads: int, head_dim: int, t1_page: int = 16, t2_page: int = 128,
                            bitsplit_keys: bool | None = None, kstep: int | None = None, stages: int = 0,
                            t1_stages: int = 0, reg_bases: bool = False, split_values: bool = False, fields: bool = False,
                            half2: bool = False, t2_mma: bool = False, t2_prefetch: bool = False, t1_mma: bool = False,
                            t2_keep_q: bool = False, min_blocks: int = 0, t1_half2: bool = False,
                            scatter_scores: bool = False, out_dtype: str = "float32", t1_quarters: int = 1,
                            merge_in_split: bool = False, unroll_page: bool = False):
    """CUDA form: flash-decoding over warps, then a merge kernel that also accumulates the importance.

    Kernel 1: one warp (block) per (sequence, KV head, split). Lane l owns channels 16 (l % LPT) ..
    +15 (LPT = Dh / 16 lanes per token) of token group l // LPT; a tile of the warp is TPS = 32 / LPT
    groups of KSTEP consecutive tokens. A lane reads a token's 16 channels in one load (uint4 of FP8
    bytes, uint32 of 2-bit codes), dots them with q (tier 2: q * sigma, with q . mu per page), and
    the partial scores are summed over the LPT lanes by xor shuffles. The online softmax is per tile
    (max over the warp by shuffles, rescale only when the max grows); each lane accumulates its 16
    channels over its token group, and the groups are summed once at the end. The split's tier-1
    tiles and tier-2 pages are every S-th of the sequence's. Writes (acc, m, l) per split and the
    tier-1 scores. Kernel 2: one block per (sequence, KV head) merges the splits into ``out`` (of
    ``out_dtype``: float32, or the model's 16-bit dtype, so that no cast kernel follows) and adds each
    tier-1 token's probability (summed over the KV head's query heads) to ``t1_mass``.

    ``stages`` 0 loads the tier-2 codes straight into registers, tile by tile; ``stages`` S > 1 stages
    each tier-2 tile through shared memory with ``cp.async`` (16-byte copies, one commit group per
    tile) in a ring of S tiles per warp: tile t + S - 1 is issued before tile t is computed, so a warp
    keeps up to S - 1 tiles of bytes in flight whatever its register budget. A stage holds the tile's
    K and V codes (each token group's rows padded so that the lanes' 4-byte reads hit 32 distinct
    banks), its value mu / sigma and, for a page's first tile, the page's key sigma / mu.
    ``t1_stages`` does the same for the tier-1 tiles (FP8 K / V bytes and both scales; each lane
    copies exactly the 16-byte rows it reads). Both rings share one shared buffer. The math is the
    register form's, operation for operation: only where the operands come from changes.

    The tier-2 loop is bound by instruction issue (on the H200, 4 stages in flight bought 6%), so two
    options cut instructions per 2-bit code. ``reg_bases`` keeps the bit-float bases in registers: a
    constant base with a constant mask made ptxas emit two LOP3 per bit, a base it cannot fold (the
    constant OR'ed with ``layer >> 31``, which is zero) lets one LOP3 do mask and OR. ``split_values``
    accumulates the values as the keys are scored: ``acc += p c0 f0 + p c1 f1 + p cc`` keeps the sums of
    ``p f0`` and ``p f1`` per channel and ``p`` per head, and applies the per-channel constants once
    after the loop (two FFMA per code instead of three; 16 more registers per query head).

    ``fields`` (needs the uniform grid of ``kv_quant``) decodes a code's two bits together: one LOP3 and one
    FFMA a code for the keys (q * sigma * c1 per channel and page, the offsets folded into q . mu) and for the
    values. The value sums are kept in the bit-float domain over the tier-2 pages: after the tier-1 tiles
    each channel's sum is divided by its c1, the tier-2 tokens add ``p f`` (and ``p`` to a per-head sum),
    and after the loop ``acc = c1 acc + cc sum(p)``: no registers beyond the plain form's. The field's offset
    (f ~ 1) costs float32 precision there: ``c1 acc`` and ``cc sum(p)`` are each about c1 sum(p) (c1 = 2^3 .. 2^9)
    and cancel, so the output is exact to a few ulp of that, about 2^-14 of its scale (the H200 check: output errors up to 9e-5, against 1e-7 per bit),
    far below the bfloat16 the attention output feeds.

    ``t2_mma`` takes tier 2 on tensor cores (``mma.sync`` m16n8k16 over the codes as float16 1024 + c 2^p, the
    scores and the values each 8 mma a 16-token tile; see MMA_POS), in splits of its own: a quarter of the splits
    (at least one) keep tier 1, the others take the pages (``decode_splits(..., t2_mma=True)``). Options of it:
    ``t1_mma`` (tier 1 on tensor cores too, a 16-token page a tile), ``t2_prefetch`` (each tile's words loaded
    during the previous tile), ``t2_keep_q`` (q' kept in registers for the whole split), ``t1_quarters`` (the quarters
    of the splits, 1 to 3, that take tier 1: at 15% of the tokens in FP8 and 85% in 2-bit codes, tier 1 is about 40%
    of the bytes). On the H100 it was 30%
    faster than half2 with 4 query heads per KV head and 30% slower with one (bench/results/tiered_decode_h100_mma.json;
    ``decode_form`` chooses). ``stages`` S > 1 with ``t2_mma`` stages its 16-token tiles through shared memory instead
    (a ring of S tiles a warp, as the CUDA-core form's: each lane copies 16 bytes of the tile's K rows and of its V
    rows, four lanes its value mu / sigma; rows padded to W2 * 4 + 16 bytes so the fragments' reads hit distinct banks):
    the register prefetch keeps one 1 KB tile in flight a warp, too few bytes for the DRAM's latency at one query head
    per KV head. (ptxas for sm_90 at OLMoE's shape, with ``unroll_page``: 2,568 instructions a 128-token page, 272 of
    them in the rarely taken rescale branches, against the paired form's 2,512 with 80 there.)

    ``t1_half2`` takes the tier-1 sums in float16 pairs too (registers, not ``t1_stages``): each 16-byte row of FP8 is
    widened to eight float16 pairs (``cvt.rn.f16x2.e4m3x2``, exact), the key scores are eight ``fma.rn.f16x2`` a token
    in two chains of four (fewer roundings a sum) against the lane's q scaled into [-1, 1] (its largest magnitude applied after, in float32), and the values are
    summed per tile in float16 pairs against p / max(p of the lane's tile), then into ``acc`` in float32: per token and
    lane 16 paired FMAs instead of 32 float32 FMAs and 32 half-to-float conversions. The products of FP8 values (at
    most 448) by factors in [-1, 1], summed over 8 pairs or 8 tokens, stay far inside the float16 range; float16's
    rounding (2^-11) is far below the FP8 values' own (2^-4).

    ``scatter_scores`` (one query head per KV head, as many tokens a lane's group takes a tile as lanes a token, OLMoE's
    8) ends a tile's scores with one reduce-scatter over the token's lanes instead of a sum per token: in log2(LPT)
    rounds each lane sends half of its partial sums and keeps the other half, so that lane c ends with the whole score
    of its group's token c (7 shuffles and adds for 8 tokens instead of 24 each). The online softmax then runs on
    that one score per lane (the tile max over the warp, one exp2 a lane rather than one a token), and the lanes of a
    group fetch the tile's probabilities back with one shuffle each. The probability sums then differ by lane and
    are summed over all 32 lanes at the end.

    ``merge_in_split`` drops kernel 2: each split warp, once its partial result is written, counts itself in (a
    ``__threadfence`` then an ``atomicAdd`` on its (sequence, KV head)'s counter), and the last of the S to arrive
    merges the splits and adds the importance as kernel 2's block would, with its 32 lanes, then zeroes the counter
    for the next call. The counters live in ``part_ml``'s row S (``part_ml`` is [B, H, S + 1, 2]; counter of (b, hk)
    at [b, hk G, S, 0], zero on entry as the workspaces are: ``decode_workspaces(..., merge_in_split=True)``). One
    launch a layer less, and the merges of the pairs done early overlap the splits still streaming; but slower on the
    H100 (bench/results/tiered_decode_fm_h100_151bbbe.json: OLMoE 0.349 against 0.330 ms a layer), so not compiled in.

    ``unroll_page`` (with ``stages``) unrolls the loop over a tier-2 page's tiles: with a stage count that divides the
    tiles a page (OLMoE's 4 tiles of 32 tokens on CUDA cores, 8 of 16 on tensor cores) each tile's stage slot and row
    offsets are constants, which drops most of the address arithmetic of the copies and the reads (ptxas for sm_90,
    the paired form: 2,512 instructions a page against 2,721), at the page's tiles times the loop's code.

    ``min_blocks`` > 0 declares the split kernel's launch bounds with that many blocks (warps) per SM, which
    caps its registers at 65536 / (32 min_blocks): the half2 form at OLMoE's shape takes 145 registers, so 13
    warps an SM (a 20% occupancy) hold every tile in flight; 16 blocks bound it to 117 without spills.
    """
    H, HKV, D, PS1, PS2 = num_heads, num_kv_heads, head_dim, t1_page, t2_page
    MINB = min_blocks
    if not isinstance(MINB, int) or isinstance(MINB, bool) or not 0 <= MINB <= 32:
        raise ValueError(f"CUDA tiered decode: min_blocks must be 0 (no bound) or 1..32 blocks an SM, got {MINB!r}")
    G = H // HKV
    D4 = D // 4
    if D % 16 or 32 % (D // 16):
        raise ValueError(f"CUDA tiered decode needs head_dim = 16 * a divisor of 32, got {D}")
    LPT = D // 16  # lanes per token
    TPS = 32 // LPT  # token groups per warp
    KSTEP = min(kstep or (8 if G == 1 else 4), PS1, PS2 // TPS)
    if KSTEP < 2 or PS1 % KSTEP or PS2 % (TPS * KSTEP):  # (vector loads of a step's scales: 2 tokens or more)
        raise ValueError(f"CUDA tiered decode: pages ({PS1}, {PS2}) do not fit tiles of {TPS} x {KSTEP} tokens")
    TILE = TPS * KSTEP
    W2 = D4 // 4  # uint32 words of a tier-2 row (= LPT)
    BITSPLIT = (G == 1) if bitsplit_keys is None else bitsplit_keys
    REG, VSPLIT, FIELDS, HALF2, MMA = bool(reg_bases), bool(split_values), bool(fields), bool(half2), bool(t2_mma)
    PF, T1MMA, KQ, T1H2 = bool(t2_prefetch), bool(t1_mma), bool(t2_keep_q), bool(t1_half2)
    SCAT = bool(scatter_scores)
    UNROLL_PAGE = bool(unroll_page)
    if UNROLL_PAGE and not stages:
        raise ValueError("CUDA tiered decode: unroll_page unrolls the staged tier-2 loop (stages > 0)")
    if SCAT and (G != 1 or KSTEP != LPT or MMA or T1MMA or VSPLIT):
        raise ValueError(f"CUDA tiered decode: scatter_scores takes one query head per KV head (got {G}) and as many tokens "
                         f"a tile's group as lanes a token (KSTEP {KSTEP}, {LPT} lanes), not the tensor-core or split-value forms")
    if T1H2 and (T1MMA or t1_stages):
        raise ValueError("CUDA tiered decode: t1_half2 takes tier 1 straight into registers on CUDA cores "
                         "(not with t1_mma or t1_stages)")
    if (PF or T1MMA or KQ or t1_quarters != 1) and not MMA:
        raise ValueError("CUDA tiered decode: t2_prefetch, t1_mma, t2_keep_q and t1_quarters are options of the tensor-core "
                         "tier 2 (t2_mma)")
    if t1_quarters not in (1, 2, 3):
        raise ValueError(f"CUDA tiered decode: t1_quarters must be 1, 2 or 3, got {t1_quarters!r}")
    if T1MMA and (PS1 != 16 or t1_stages):
        raise ValueError(f"the tensor-core tier 1 of the tiered decode takes tier-1 pages of 16 tokens (got {PS1}) "
                         "straight into registers (t1_stages 0)")
    if FIELDS + VSPLIT + HALF2 + MMA > 1:
        raise ValueError("CUDA tiered decode: fields, split_values, half2 and t2_mma are forms of the tier-2 sums; pick one")
    if MMA:
        if D != 128 or G > 8 or PS2 % 64 or uniform_grid() is None:
            raise ValueError(f"the tensor-core tier 2 of the tiered decode needs head_dim 128 (got {D}), at most 8 query "
                             f"heads per KV head (got {G}), tier-2 pages of a multiple of 64 tokens (got {PS2}) and "
                             "evenly spaced 2-bit levels")
        if stages and t2_prefetch:
            raise ValueError("CUDA tiered decode: the tensor-core tier 2 stages its tiles (stages > 0) or loads each a "
                             "tile ahead into registers (t2_prefetch), not both")
    NEG = -1e30
    consts = _code_consts()
    SRC = [c[0] for c in consts]
    M0, B0, M1c, B1, C0, C1, CC = ([c[j] for c in consts] for j in range(1, 8))
    BASES = sorted(set(B0) | set(B1))  # the distinct bit-float bases (reg_bases: one register each)

    BI0, BI1 = [BASES.index(v) for v in B0], [BASES.index(v) for v in B1]
    if FIELDS:
        fc = _field_consts()
        FSRC, FMASK, FC1, FCC = ([c[j] for c in fc] for j in range(4))
        BASES = [0x3F800000]  # every field sits in the mantissa of 1.0
    if HALF2:
        grid = uniform_grid()
        if grid is None:
            raise ValueError("the half2 form of the tiered decode needs evenly spaced 2-bit levels")
        LO, STEP = grid
        HSRC, HMASK, HPOS = ([c[j] for c in _half2_consts()] for j in range(3))
        KMUL = [2.0 ** (H2_KEY_EXP - p_) for p_ in HPOS]  # q' = u KMUL[j]
        VMUL = [STEP * 2.0 ** (24 - p_) / H2_VALUE_MAX for p_ in HPOS]  # step sum(p c) = vacc max(p) VMUL[j]

        def hx(w, j):  # pair j of word w (codes j, j + 8) as two subnormal halves
            return T.if_then_else(_tab(j, HSRC, "int32") == 0, w, w >> T.uint32(H2_SHIFT)) & _tab(j, HMASK, "uint32")
    if HALF2 or MMA or T1H2:  # float16 pairs in uint32 registers, through schedules/cuda_prelude.py's helpers
        from ..cuda_prelude import E4M3_HI, E4M3_LO, H2_HI, H2_LO, HFMA2, PACK_H2, register

        register()  # the generated source gets the helpers' definitions

        def hfma2(a, b, c):
            return T.call_pure_extern("uint32", HFMA2, a, b, c)

        def pack_h2(lo, hi):
            return T.call_pure_extern("uint32", PACK_H2, lo, hi)

        def h2lo(a):
            return T.call_pure_extern("float32", H2_LO, a)

        def h2hi(a):
            return T.call_pure_extern("float32", H2_HI, a)

        def e4m3_lo(w):  # FP8 bytes 0, 1 of word w (channels 4 i, 4 i + 1 of its row) as two float16 halves
            return T.call_pure_extern("uint32", E4M3_LO, w)

        def e4m3_hi(w):  # bytes 2, 3 (channels 4 i + 2, 4 i + 3)
            return T.call_pure_extern("uint32", E4M3_HI, w)
    _check_out_dtype(out_dtype)
    NT2 = min(D, 128)  # threads of the merge kernel
    FUSE = bool(merge_in_split)
    NTF = min(D, 32)  # merge_in_split: the lanes of the last split warp that merge
    MU = 8  # rounds of its tier-1 loop unrolled (8: up to 1024 tier-1 tokens a sequence in one round of loads)
    S2, S1 = stages, t1_stages
    for name, st_ in (("stages", S2), ("t1_stages", S1)):
        if st_ and not 2 <= st_ <= 8:
            raise ValueError(f"CUDA tiered decode: {name} must be 0 or 2..8, got {st_}")
    NSUB = PS2 // TILE  # tiles of a tier-2 page
    # tier-2 stage: [K codes: TPS groups of KSTEP rows, group stride GS2 bytes][V codes][vmu: TILE][vsig: TILE]
    # [ksig: D][kmu: D] (float16); lane (tg, cw) reads word tg GS2 / 4 + k W2 + cw of K and of V
    GB2 = KSTEP * D4
    GS2 = GB2
    if S2:
        if GB2 % 16 or TILE % 8 or D % 8:
            raise ValueError(f"CUDA tiered decode: stages need 16-byte token groups (KSTEP {KSTEP} x {D4} bytes)")
        for pad in range(0, 129, 16):  # the smallest padding that spreads the 32 lanes' words over 32 banks
            if len({(tg_ * (GB2 + pad) // 4 + cw_) % 32 for tg_ in range(TPS) for cw_ in range(LPT)}) == 32:
                GS2 = GB2 + pad
                break
    OFF_V2, OFF_VMU = TPS * GS2, 2 * TPS * GS2
    OFF_VSIG, OFF_KSIG = OFF_VMU + 2 * TILE, OFF_VMU + 4 * TILE
    STG2 = OFF_KSIG + 4 * D
    # tensor-core tier 2 with stages: a stage is one 16-token tile, [K codes: 16 rows][V codes: 16 rows][vmu: 16]
    # [vsig: 16] (float16); a row's W2 words padded to MRS bytes, so that the lanes' fragment reads (keys: 8 bytes of
    # rows 2 gi, 2 gi + 1 at word 2 ti; values: rows 2 ti (+ 1, + 8, + 9) at word gi) fall on distinct banks
    MRS = W2 * 4 + 16
    MOFF_V, MOFF_MU = 16 * MRS, 32 * MRS
    MOFF_SIG = MOFF_MU + 32
    if MMA and S2:
        STG2 = MOFF_SIG + 32
    CPG2 = GB2 // 16  # 16-byte chunks of a token group (tier 2)
    NCH2 = TPS * CPG2  # chunks of a tile's K codes (and of its V codes)
    NV2 = TILE * 2 // 16  # chunks of a tile's vmu (and of its vsig)
    NKS = D // 8  # chunks of a page's ksig (and of its kmu)
    # tier-1 stage: [K bytes: TILE x D][V bytes][ks: TILE][vs: TILE] (float16)
    STG1 = -(-(2 * TILE * D + 4 * TILE) // 16) * 16
    if S1 and (2 * KSTEP) not in (4, 8, 16):
        raise ValueError(f"CUDA tiered decode: t1_stages need KSTEP 2, 4 or 8 (got {KSTEP})")
    CP1 = "cp.async.cg.shared.global" if KSTEP == 8 else "cp.async.ca.shared.global"  # the scales' copies
    CPG = "cp.async.cg.shared.global"
    SHB = max(S1 * STG1, S2 * STG2, 16)  # bytes of the shared stages (both rings, one buffer)
    if SHB > 48 * 1024:
        raise ValueError(f"CUDA tiered decode: {SHB} bytes of shared stages exceed 48 KB")

    def xs(w, i):  # the shifted word holding code i
        src = _tab(i, SRC, "uint32")
        return T.if_then_else(src == T.uint32(0), w, T.if_then_else(src == T.uint32(1), w << T.uint32(12), w << T.uint32(24)))

    def f0(x, i, bk):
        base = bk[_tab(i, BI0, "int32")] if REG else _tab(i, B0, "uint32")
        return T.reinterpret("float32", (x & _tab(i, M0, "uint32")) | base)

    def f1(x, i, bk):
        base = bk[_tab(i, BI1, "int32")] if REG else _tab(i, B1, "uint32")
        return T.reinterpret("float32", (x & _tab(i, M1c, "uint32")) | base)

    def xf(w, i):  # the shifted copy of word w whose bits 14 .. 21 hold code i's field
        src = _tab(i, FSRC, "uint32")
        sh = [T.uint32(abs(v)) for v in FIELD_SHIFTS]
        return T.if_then_else(src == T.uint32(0), w << sh[0], T.if_then_else(
            src == T.uint32(1), w << sh[1], T.if_then_else(src == T.uint32(2), w >> sh[2], w >> sh[3])))

    def ff(x, i, bk):  # the field's bit-float 1 + c 2^(p - 23)
        base = bk[0] if REG else T.uint32(BASES[0])
        return T.reinterpret("float32", (x & _tab(i, FMASK, "uint32")) | base)

    def lev(x, i, bk):
        return _tab(i, CC, "float32") + _tab(i, C0, "float32") * f0(x, i, bk) + _tab(i, C1, "float32") * f1(x, i, bk)

    def shfl(v, o):
        return T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), v, o, 32, 32)

    @T.macro
    def lane_sum(buf, idx):  # sum over the LPT lanes of a token group
        for r in T.unroll(LPT.bit_length() - 1):
            buf[idx] = buf[idx] + shfl(buf[idx], T.shift_left(1, r))

    @T.macro
    def max_recip(vals, base, n, out, g, top, absolute):
        # out[g] = the largest of vals[base .. base + n - 1] (magnitudes when absolute); out[G + g] = top / out[g], or 0
        out[g] = T.abs(vals[base]) if absolute else vals[base]
        for i in T.unroll(n - 1):
            out[g] = T.max(out[g], T.abs(vals[base + i + 1]) if absolute else vals[base + i + 1])
        out[G + g] = T.if_then_else(out[g] > T.float32(0), T.float32(top) / out[g], T.float32(0))

    @T.macro
    def scatter_sum(s_l, cw, mt):  # reduce-scatter of s_l[0 .. LPT - 1] over the token's lanes: s_l[0] = token cw's sum
        for r in T.unroll(LPT.bit_length() - 1):
            for i in T.unroll(LPT // 2):
                if i < (LPT >> (r + 1)):  # (constant once unrolled)
                    # lanes with the round's bit keep the upper half, the others the lower; each sends what it drops
                    mt[0] = T.if_then_else((cw & (LPT >> (r + 1))) != 0, s_l[i], s_l[i + (LPT >> (r + 1))])
                    s_l[i] = T.if_then_else((cw & (LPT >> (r + 1))) != 0, s_l[i + (LPT >> (r + 1))], s_l[i]) + \
                        shfl(mt[0], LPT >> (r + 1))

    @T.macro
    def softmax_own(s_l, m_l, l_l, acc, pmu, p_l, mt, ps, lane):
        # online softmax over one tile with each lane's own token score s_l[0] (one query head): the warp-wide tile
        # max rescales the state when it grows; p of the lane's token, then the group's KSTEP probabilities by shuffles
        mt[0] = s_l[0]
        for r in T.unroll(5):
            mt[0] = T.max(mt[0], shfl(mt[0], T.shift_left(1, r)))
        if mt[0] > m_l[0]:
            mt[1] = T.exp2(m_l[0] - mt[0])
            l_l[0] = l_l[0] * mt[1]
            pmu[0] = pmu[0] * mt[1]
            for i in T.unroll(16):
                acc[i] = acc[i] * mt[1]
            ps[0] = ps[0] * mt[1]
            m_l[0] = mt[0]
        mt[1] = T.exp2(s_l[0] - m_l[0])
        l_l[0] = l_l[0] + mt[1]
        for k in T.unroll(KSTEP):
            p_l[k] = T.tvm_warp_shuffle(T.uint32(0xFFFFFFFF), mt[1], (lane - lane % LPT) + k, 32, 32)

    @T.macro
    def softmax_tile(s_l, m_l, l_l, acc, pmu, p_l, mt, a0, a1, ps):
        # online softmax over one tile: s_l[g * KSTEP + k] (log2 domain) -> p_l; the warp-wide tile max
        # rescales the running state only when it grows (a warp-uniform branch)
        for g in T.unroll(G):
            mt[0] = s_l[g * KSTEP]
            for k in T.unroll(KSTEP - 1):
                mt[0] = T.max(mt[0], s_l[g * KSTEP + k + 1])
            for r in T.unroll(TPS.bit_length() - 1):
                mt[0] = T.max(mt[0], shfl(mt[0], T.shift_left(LPT, r)))
            if mt[0] > m_l[g]:
                mt[1] = T.exp2(m_l[g] - mt[0])
                l_l[g] = l_l[g] * mt[1]
                pmu[g] = pmu[g] * mt[1]
                for i in T.unroll(16):
                    acc[g * 16 + i] = acc[g * 16 + i] * mt[1]
                if VSPLIT or FIELDS or HALF2:
                    ps[g] = ps[g] * mt[1]
                if VSPLIT:
                    for i in T.unroll(16):
                        a0[g * 16 + i] = a0[g * 16 + i] * mt[1]
                        a1[g * 16 + i] = a1[g * 16 + i] * mt[1]
                m_l[g] = mt[0]
            for k in T.unroll(KSTEP):
                p_l[g * KSTEP + k] = T.exp2(s_l[g * KSTEP + k] - m_l[g])
                l_l[g] = l_l[g] + p_l[g * KSTEP + k]

    def cp(dst, src, nbytes=16):
        return T.evaluate(T.ptx[CPG if nbytes == 16 else CP1](T.address_of(dst), T.address_of(src), nbytes))

    @T.macro
    def issue2(tt, slot, b, sp, S, hk, lane, layer, P2, pg2, sh, t2_table, t2_k32, t2_v32, t2_vmu1, t2_vsig1, t2_ksig1, t2_kmu1):
        # tier-2 tile tt of this split (page tt // NSUB of the split, rows (tt % NSUB) TILE ..) into stage slot;
        # the page is looked up at its first tile (tiles are issued in order) and kept in pg2
        if tt % NSUB == 0:
            pg2[0] = t2_table[b, sp + (tt // NSUB) * S]
        for j in T.unroll(-(-NCH2 // 32)):
            if NCH2 % 32 == 0 or j * 32 + lane < NCH2:
                cp(sh[(slot * STG2 + (j * 32 + lane) // CPG2 * GS2 + (j * 32 + lane) % CPG2 * 16) // 4],
                   t2_k32[(((layer * P2 + pg2[0]) * HKV + hk) * PS2 + tt % NSUB * TILE) * W2 + (j * 32 + lane) * 4])
                cp(sh[(slot * STG2 + OFF_V2 + (j * 32 + lane) // CPG2 * GS2 + (j * 32 + lane) % CPG2 * 16) // 4],
                   t2_v32[(((layer * P2 + pg2[0]) * HKV + hk) * PS2 + tt % NSUB * TILE) * W2 + (j * 32 + lane) * 4])
        for j in T.unroll(-(-2 * NV2 // 32)):
            if j * 32 + lane < NV2:
                cp(sh[(slot * STG2 + OFF_VMU + (j * 32 + lane) * 16) // 4],
                   t2_vmu1[((layer * P2 + pg2[0]) * HKV + hk) * PS2 + tt % NSUB * TILE + (j * 32 + lane) * 8])
            elif j * 32 + lane < 2 * NV2:
                cp(sh[(slot * STG2 + OFF_VSIG + (j * 32 + lane - NV2) * 16) // 4],
                   t2_vsig1[((layer * P2 + pg2[0]) * HKV + hk) * PS2 + tt % NSUB * TILE + (j * 32 + lane - NV2) * 8])
        if tt % NSUB == 0:
            for j in T.unroll(-(-2 * NKS // 32)):
                if j * 32 + lane < NKS:
                    cp(sh[(slot * STG2 + OFF_KSIG + (j * 32 + lane) * 16) // 4],
                       t2_ksig1[((layer * P2 + pg2[0]) * HKV + hk) * D + (j * 32 + lane) * 8])
                elif j * 32 + lane < 2 * NKS:
                    cp(sh[(slot * STG2 + OFF_KSIG + (j * 32 + lane) * 16) // 4],
                       t2_kmu1[((layer * P2 + pg2[0]) * HKV + hk) * D + (j * 32 + lane - NKS) * 8])

    @T.macro
    def issue1(it_, slot, b, sp, S, hk, tg, cw, layer, P1, n1, sh8, sh16, t1_table, t1_k8, t1_v8, t1_ks1, t1_vs1):
        # tier-1 tile it_ of this split into stage slot: each lane copies the 16-byte rows it reads (the same
        # page, clamped to the last token's, as the register form); lanes cw 0 and 1 the group's scales
        tok1: T.let[T.int32] = (sp + it_ * S) * TILE + tg * KSTEP
        pg1: T.let[T.int32] = t1_table[b, T.min(tok1, n1 - 1) // PS1]
        for k in T.unroll(KSTEP):
            cp(sh8[slot * STG1 + (tg * KSTEP + k) * D + cw * 16],
               t1_k8[(((layer * P1 + pg1) * HKV + hk) * PS1 + tok1 % PS1 + k) * D + cw * 16])
            cp(sh8[slot * STG1 + TILE * D + (tg * KSTEP + k) * D + cw * 16],
               t1_v8[(((layer * P1 + pg1) * HKV + hk) * PS1 + tok1 % PS1 + k) * D + cw * 16])
        if cw == 0:
            cp(sh16[(slot * STG1 + 2 * TILE * D) // 2 + tg * KSTEP],
               t1_ks1[((layer * P1 + pg1) * HKV + hk) * PS1 + tok1 % PS1], 2 * KSTEP)
        if cw == 1 % LPT:
            cp(sh16[(slot * STG1 + 2 * TILE * D + 2 * TILE) // 2 + tg * KSTEP],
               t1_vs1[((layer * P1 + pg1) * HKV + hk) * PS1 + tok1 % PS1], 2 * KSTEP)

    def sync_warp():
        return T.evaluate(T.call_extern("void", "__syncwarp"))

    @T.macro
    def t1_tile_math(tok0, n1, b, hk, cw, qv, k8, v8, kf, sc16, vs16, s_l, p_l, acc, m_l, l_l, pmu, mt, scores, a0, a1, ps,
                     k8w, v8w, qh, ksc, vr, vacc, hxb, lane):
        # one tier-1 tile (bytes in k8 / v8, scales in sc16 / vs16, first token of the lane's group tok0)
        for k in T.unroll(KSTEP):
            if T1H2:  # eight pairs: q' (in [-1, 1]) against the widened FP8 pairs, then max |q| in float32
                for g in T.unroll(G):
                    for c in T.unroll(2):  # two chains of four pairs (fewer float16 roundings a sum)
                        hxb[c] = hfma2(qh[g * 8 + 4 * c], e4m3_lo(k8w[k * 4 + 2 * c]), T.uint32(0))
                        hxb[c] = hfma2(qh[g * 8 + 4 * c + 1], e4m3_hi(k8w[k * 4 + 2 * c]), hxb[c])
                        hxb[c] = hfma2(qh[g * 8 + 4 * c + 2], e4m3_lo(k8w[k * 4 + 2 * c + 1]), hxb[c])
                        hxb[c] = hfma2(qh[g * 8 + 4 * c + 3], e4m3_hi(k8w[k * 4 + 2 * c + 1]), hxb[c])
                    s_l[g * KSTEP + k] = ksc[g] * ((h2lo(hxb[0]) + h2hi(hxb[0])) + (h2lo(hxb[1]) + h2hi(hxb[1])))
                    if not SCAT:
                        lane_sum(s_l, g * KSTEP + k)
            else:
                for j in T.unroll(4):
                    kf[T.ramp(j * 4, 1, 4)] = T.Cast("float16x4", k8[T.ramp(k * 16 + j * 4, 1, 4)])
                for g in T.unroll(G):
                    s_l[g * KSTEP + k] = T.float32(0)
                    for i in T.unroll(16):
                        s_l[g * KSTEP + k] = s_l[g * KSTEP + k] + qv[g * 16 + i] * T.Cast("float32", kf[i])
                    if not SCAT:
                        lane_sum(s_l, g * KSTEP + k)
            if SCAT:  # the token's scale on the partial sums (the lane holds every token's), the sum after the loop
                s_l[k] = s_l[k] * T.Cast("float32", sc16[k])
            else:
                for g in T.unroll(G):
                    s_l[g * KSTEP + k] = T.if_then_else(
                        tok0 + k < n1, s_l[g * KSTEP + k] * T.Cast("float32", sc16[k]), T.float32(NEG))
                    if tok0 + k < n1 and cw == k % LPT:
                        scores[b, hk * G + g, tok0 + k] = s_l[g * KSTEP + k]
        if SCAT:  # lane cw: its group's token cw
            scatter_sum(s_l, cw, mt)
            s_l[0] = T.if_then_else(tok0 + cw < n1, s_l[0], T.float32(NEG))
            if tok0 + cw < n1:
                scores[b, hk, tok0 + cw] = s_l[0]
            softmax_own(s_l, m_l, l_l, acc, pmu, p_l, mt, ps, lane)
        else:
            softmax_tile(s_l, m_l, l_l, acc, pmu, p_l, mt, a0, a1, ps)
        if T1H2:  # per query head: p' = p vs / max(p vs of the lane's tile) as halves; the tile's sums in float16 pairs
            for g in T.unroll(G):
                for k in T.unroll(KSTEP):
                    p_l[g * KSTEP + k] = p_l[g * KSTEP + k] * T.Cast("float32", vs16[k])
                max_recip(p_l, g * KSTEP, KSTEP, vr, g, 1.0, False)
                for j in T.unroll(8):
                    vacc[g * 8 + j] = T.uint32(0)
            for k in T.unroll(KSTEP):
                for g in T.unroll(G):
                    hxb[8] = pack_h2(p_l[g * KSTEP + k] * vr[G + g], p_l[g * KSTEP + k] * vr[G + g])
                    for j in T.unroll(4):
                        vacc[g * 8 + 2 * j] = hfma2(hxb[8], e4m3_lo(v8w[k * 4 + j]), vacc[g * 8 + 2 * j])
                        vacc[g * 8 + 2 * j + 1] = hfma2(hxb[8], e4m3_hi(v8w[k * 4 + j]), vacc[g * 8 + 2 * j + 1])
            for g in T.unroll(G):
                for j in T.unroll(8):
                    acc[g * 16 + 2 * j] = acc[g * 16 + 2 * j] + h2lo(vacc[g * 8 + j]) * vr[g]
                    acc[g * 16 + 2 * j + 1] = acc[g * 16 + 2 * j + 1] + h2hi(vacc[g * 8 + j]) * vr[g]
        else:
            for k in T.unroll(KSTEP):
                for j in T.unroll(4):
                    kf[T.ramp(j * 4, 1, 4)] = T.Cast("float16x4", v8[T.ramp(k * 16 + j * 4, 1, 4)])
                for g in T.unroll(G):
                    p_l[g * KSTEP + k] = p_l[g * KSTEP + k] * T.Cast("float32", vs16[k])
                    for i in T.unroll(16):
                        acc[g * 16 + i] = acc[g * 16 + i] + p_l[g * KSTEP + k] * T.Cast("float32", kf[i])

    @T.macro
    def t2_page_setup(b, hk, cw, q, sm_scale, h16, h16b, ck, qs, qs2, qh, ksc):
        # per tier-2 page: q * key sigma (qs, qs2) and q . key mu (ck), from h16 = ksig, h16b = kmu
        for g in T.unroll(G):
            ck[g] = T.float32(0)
            for i in T.unroll(16):
                # q again from memory (cached): keeps qv out of registers in this loop
                ck[g] = ck[g] + q[b, hk * G + g, cw * 16 + i] * sm_scale * T.float32(LOG2E) * T.Cast("float32", h16b[i])
                qs[g * 16 + i] = q[b, hk * G + g, cw * 16 + i] * sm_scale * T.float32(LOG2E) * T.Cast("float32", h16[i])
                if FIELDS:
                    ck[g] = ck[g] + qs[g * 16 + i] * _tab(i, FCC, "float32")
                    qs[g * 16 + i] = qs[g * 16 + i] * _tab(i, FC1, "float32")
                elif HALF2:
                    ck[g] = ck[g] + qs[g * 16 + i] * T.float32(LO)
                elif BITSPLIT:
                    ck[g] = ck[g] + qs[g * 16 + i] * _tab(i, CC, "float32")
                    qs2[g * 16 + i] = qs[g * 16 + i] * _tab(i, C1, "float32")
                    qs[g * 16 + i] = qs[g * 16 + i] * _tab(i, C0, "float32")
            if HALF2:  # u = q sigma / max |q sigma| in [-1, 1]; q' = u KMUL per pair, as halves
                max_recip(qs, g * 16, 16, ksc, g, 1.0, True)
                for j in T.unroll(8):
                    qh[g * 8 + j] = pack_h2(qs[g * 16 + j] * ksc[G + g] * _tab(j, KMUL, "float32"),
                                            qs[g * 16 + j + 8] * ksc[G + g] * _tab(j, KMUL, "float32"))
                # the pairs' products are u c 2^(H2_KEY_EXP - 24): score = ck + step max|q sigma| 2^(24 - H2_KEY_EXP) sum
                ksc[g] = ksc[g] * T.float32(STEP * 2.0 ** (24 - H2_KEY_EXP))

    @T.macro
    def t2_tile_math(ck, qs, qs2, kw, vw, sc16, vs16, lv, s_l, p_l, acc, m_l, l_l, pmu, mt, bk, a0, a1, ps, qh, ksc, vr, vacc, hxb,
                     cw, lane):
        # one tier-2 tile (codes in kw / vw, value mu / sigma in sc16 / vs16)
        for k in T.unroll(KSTEP):
            for g in T.unroll(G):
                s_l[g * KSTEP + k] = ck[g]
            if HALF2:  # 8 pairs of codes: one AND and one fma.rn.f16x2 each (the pairs shared by the query heads)
                for j in T.unroll(8):
                    hxb[j] = hx(kw[k], j)
                for g in T.unroll(G):
                    hxb[8] = hfma2(qh[g * 8], hxb[0], T.uint32(0))
                    for j in T.unroll(7):
                        hxb[8] = hfma2(qh[g * 8 + j + 1], hxb[j + 1], hxb[8])
                    s_l[g * KSTEP + k] = s_l[g * KSTEP + k] + ksc[g] * (h2lo(hxb[8]) + h2hi(hxb[8]))
            elif FIELDS:
                for i in T.unroll(16):
                    for g in T.unroll(G):
                        s_l[g * KSTEP + k] = s_l[g * KSTEP + k] + qs[g * 16 + i] * ff(xf(kw[k], i), i, bk)
            elif BITSPLIT:
                for i in T.unroll(16):
                    for g in T.unroll(G):
                        s_l[g * KSTEP + k] = s_l[g * KSTEP + k] + qs[g * 16 + i] * f0(xs(kw[k], i), i, bk) + \
                            qs2[g * 16 + i] * f1(xs(kw[k], i), i, bk)
            else:
                for i in T.unroll(16):
                    lv[i] = lev(xs(kw[k], i), i, bk)
                    for g in T.unroll(G):
                        s_l[g * KSTEP + k] = s_l[g * KSTEP + k] + qs[g * 16 + i] * lv[i]
            if not SCAT:
                for g in T.unroll(G):
                    lane_sum(s_l, g * KSTEP + k)
        if SCAT:
            scatter_sum(s_l, cw, mt)
            softmax_own(s_l, m_l, l_l, acc, pmu, p_l, mt, ps, lane)
        else:
            softmax_tile(s_l, m_l, l_l, acc, pmu, p_l, mt, a0, a1, ps)
        if HALF2:
            # per query head: p' = p / max(p of the lane's tile) 2^14 as halves; per pair, sums of p' c 2^(p - 24)
            # in float16 over the tile, then into acc (level domain: step sum(p c); lo sum(p) after the loop)
            for g in T.unroll(G):
                for k in T.unroll(KSTEP):
                    pmu[g] = pmu[g] + p_l[g * KSTEP + k] * T.Cast("float32", sc16[k])
                    p_l[g * KSTEP + k] = p_l[g * KSTEP + k] * T.Cast("float32", vs16[k])
                    ps[g] = ps[g] + p_l[g * KSTEP + k]
                max_recip(p_l, g * KSTEP, KSTEP, vr, g, H2_VALUE_MAX, False)
                for j in T.unroll(8):
                    vacc[g * 8 + j] = T.uint32(0)
            for k in T.unroll(KSTEP):
                for j in T.unroll(8):
                    hxb[j] = hx(vw[k], j)
                for g in T.unroll(G):
                    hxb[8] = pack_h2(p_l[g * KSTEP + k] * vr[G + g], p_l[g * KSTEP + k] * vr[G + g])
                    for j in T.unroll(8):
                        vacc[g * 8 + j] = hfma2(hxb[8], hxb[j], vacc[g * 8 + j])
            for g in T.unroll(G):
                for j in T.unroll(8):
                    acc[g * 16 + j] = acc[g * 16 + j] + h2lo(vacc[g * 8 + j]) * (vr[g] * _tab(j, VMUL, "float32"))
                    acc[g * 16 + j + 8] = acc[g * 16 + j + 8] + h2hi(vacc[g * 8 + j]) * (vr[g] * _tab(j, VMUL, "float32"))
        else:
            for k in T.unroll(KSTEP):
                if not VSPLIT and not FIELDS:
                    for i in T.unroll(16):
                        lv[i] = lev(xs(vw[k], i), i, bk)
                for g in T.unroll(G):
                    pmu[g] = pmu[g] + p_l[g * KSTEP + k] * T.Cast("float32", sc16[k])
                    p_l[g * KSTEP + k] = p_l[g * KSTEP + k] * T.Cast("float32", vs16[k])
                    if FIELDS:  # sums of p f and p in the bit-float domain; the level constants are applied after the loop
                        ps[g] = ps[g] + p_l[g * KSTEP + k]
                        for i in T.unroll(16):
                            acc[g * 16 + i] = acc[g * 16 + i] + p_l[g * KSTEP + k] * ff(xf(vw[k], i), i, bk)
                    elif VSPLIT:  # sums of p f0, p f1 and p; the level constants are applied after the loop
                        ps[g] = ps[g] + p_l[g * KSTEP + k]
                        for i in T.unroll(16):
                            a0[g * 16 + i] = a0[g * 16 + i] + p_l[g * KSTEP + k] * f0(xs(vw[k], i), i, bk)
                            a1[g * 16 + i] = a1[g * 16 + i] + p_l[g * KSTEP + k] * f1(xs(vw[k], i), i, bk)
                    else:
                        for i in T.unroll(16):
                            acc[g * 16 + i] = acc[g * 16 + i] + p_l[g * KSTEP + k] * lv[i]

    def t1_splits(S):  # with t2_mma, t1_quarters quarters of the splits (at least one, at most S - 1) take tier 1, the
        #                rest tier 2
        return T.max(1, T.min(S - 1, S * t1_quarters // 4)) if MMA else S

    if MMA:
        from ..cuda_prelude import E4M3_HI as _E4H, E4M3_LO as _E4L
        from .grouped_experts import _mma

        MLO, MSTEP = uniform_grid()
        MMASK = [(3 << p_) | (3 << (p_ + 16)) for p_ in MMA_POS]
        MKMUL = [MSTEP * 2.0 ** -p_ for p_ in MMA_POS]  # keys: w = u step / 2^p (u = q sigma / max |q sigma|)
        MVDIV = [2.0 ** -p_ for p_ in MMA_POS]  # values: m-tile mt's sums carry 2^p of its codes
        NTT = PS2 // 16  # 16-token tiles of a page
        NVS = PS2 // 64  # uint32 pairs of sigma each lane reads for the page's largest

        def mpair(w, j, mag):  # pair j of word w as two float16 1024 + c 2^p (mag[0]: MMA_MAGIC in a register, which
            #                    lets one LOP3 do the AND and the OR: with both constants ptxas emitted two)
            src = _tab(j, MMA_SRC, "int32")
            x = T.if_then_else(src == 0, w << T.uint32(4), T.if_then_else(src == 1, w, w >> T.uint32(6)))
            return (x & _tab(j, MMASK, "uint32")) | mag[0]

        def shfl_idx(v, src):
            return T.tvm_warp_shuffle(T.uint32(0xFFFFFFFF), v, src, 32, 32)

        def qload(q, b, hk, gi, c, sm_scale):  # q' (log2 domain) of head gi (0 for the lanes past the group), channel c
            return T.if_then_else(gi < G, q[b, hk * G + T.min(gi, G - 1), c], T.float32(0)) * sm_scale * T.float32(LOG2E)

        def qprime(qr, q, b, hk, gi, ti, x, sm_scale):  # the same for channel 32 ti + x
            return qr[x] if KQ else qload(q, b, hk, gi, 32 * ti + x, sm_scale)  # (KQ: kept in registers for the split)

        @T.macro
        def mma_load(kw, vw, vv, pbase, tt, gi, ti, t2_k32, t2_v32, t2_vmu32, t2_vsig32):
            # tile tt's words: keys' words 2 ti, 2 ti + 1 of tokens 2 gi, 2 gi + 1 (8-byte loads); values' word gi of
            # tokens 2 ti, 2 ti + 1, 2 ti + 8, 2 ti + 9; value mu and sigma of tokens 2 gi, 2 gi + 1 (as half pairs)
            rk: T.let[T.int64] = (pbase * PS2 + tt * 16 + 2 * gi) * W2 + 2 * ti
            kw[T.ramp(0, 1, 2)] = t2_k32[T.ramp(rk, 1, 2)]
            kw[T.ramp(2, 1, 2)] = t2_k32[T.ramp(rk + W2, 1, 2)]
            for r in T.unroll(4):
                vw[r] = t2_v32[(pbase * PS2 + tt * 16 + 2 * ti + r % 2 + 8 * (r // 2)) * W2 + gi]
            vv[0] = t2_vmu32[(pbase * PS2 + tt * 16 + 2 * gi) // 2]
            vv[1] = t2_vsig32[(pbase * PS2 + tt * 16 + 2 * gi) // 2]

        @T.macro
        def mma_issue(u, slot, b, hk, sp2, S2n, lane, layer, P2, mpg, sh, t2_table, t2_k32, t2_v32, t2_vmu1, t2_vsig1):
            # (stages) tile u of this split's tier-2 tiles (page u // NTT, its tokens (u % NTT) 16 ..) into stage slot:
            # lane l copies 16 bytes of the K rows and of the V rows (row l // 2, half l % 2), lanes 0 .. 3 the tile's
            # value mu and sigma; the page is looked up at its first tile (tiles are issued in order) and kept in mpg
            if u % NTT == 0:
                mpg[0] = t2_table[b, sp2 + (u // NTT) * S2n]
            cp(sh[(slot * STG2 + lane // 2 * MRS + lane % 2 * 16) // 4],
               t2_k32[(((layer * P2 + mpg[0]) * HKV + hk) * PS2 + u % NTT * 16 + lane // 2) * W2 + lane % 2 * 4])
            cp(sh[(slot * STG2 + MOFF_V + lane // 2 * MRS + lane % 2 * 16) // 4],
               t2_v32[(((layer * P2 + mpg[0]) * HKV + hk) * PS2 + u % NTT * 16 + lane // 2) * W2 + lane % 2 * 4])
            if lane < 2:
                cp(sh[(slot * STG2 + MOFF_MU + lane * 16) // 4],
                   t2_vmu1[((layer * P2 + mpg[0]) * HKV + hk) * PS2 + u % NTT * 16 + lane * 8])
            elif lane < 4:
                cp(sh[(slot * STG2 + MOFF_SIG + (lane - 2) * 16) // 4],
                   t2_vsig1[((layer * P2 + mpg[0]) * HKV + hk) * PS2 + u % NTT * 16 + (lane - 2) * 8])

        @T.macro
        def mma_load_staged(kw, vw, vv, slot, gi, ti, sh):
            # mma_load's words from stage slot
            kw[T.ramp(0, 1, 2)] = sh[T.ramp((slot * STG2 + 2 * gi * MRS) // 4 + 2 * ti, 1, 2)]
            kw[T.ramp(2, 1, 2)] = sh[T.ramp((slot * STG2 + (2 * gi + 1) * MRS) // 4 + 2 * ti, 1, 2)]
            for r in T.unroll(4):
                vw[r] = sh[(slot * STG2 + MOFF_V + (2 * ti + r % 2 + 8 * (r // 2)) * MRS) // 4 + gi]
            vv[0] = sh[(slot * STG2 + MOFF_MU) // 4 + gi]
            vv[1] = sh[(slot * STG2 + MOFF_SIG) // 4 + gi]

        @T.macro
        def mma_value_scale(st, tf, dacc):
            # tf[0]: the next tile's or page's largest value sigma (warp-uniform). VS (st[14]) = MMA_VALUE_MAX / it at
            # the first; later, a new VS and the sums fed with the old one (dacc, st[6:8]) rescaled when p sigma VS
            # could pass 16 MMA_VALUE_MAX (float16 holds 65504)
            tf[1] = T.if_then_else(tf[0] > T.float32(0), T.float32(MMA_VALUE_MAX) / tf[0], T.float32(1))
            if st[14] == T.float32(0):
                st[14] = tf[1]
            elif tf[0] * st[14] > T.float32(16 * MMA_VALUE_MAX):
                tf[2] = tf[1] / st[14]
                for i in T.unroll(32):
                    dacc[i] = dacc[i] * tf[2]
                for e in T.unroll(2):
                    st[6 + e] = st[6 + e] * tf[2]
                st[14] = tf[1]

        @T.macro
        def mma_probs(sc, st, tf, dacc, xv, pv, bf, vsig, gi, ti):
            # scores sc[r * 2 + e] (token 2 gi + r, head 2 ti + e; log2 domain) -> probabilities in sc, the online
            # softmax state st (max, sum of p, sum of p mu, sum of p' per head) and dacc rescaled when a head's max
            # grows; p' = p sigma VS (sigma of the two tokens, a half pair ``vsig``) moved into the values' B operand bf
            # ---- online softmax per head over the tile (rows: xor over gi)
            for e in T.unroll(2):
                tf[e] = T.max(sc[e], sc[2 + e])
                for r in T.unroll(3):
                    tf[e] = T.max(tf[e], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), tf[e], T.shift_left(4, r), 32, 32))
                tf[e] = T.max(tf[e], st[e])
            if T.call_extern("uint32", "__ballot_sync", T.uint32(0xFFFFFFFF),
                             (tf[0] > st[0]) or (tf[1] > st[1])) != T.uint32(0):
                for e in T.unroll(2):
                    tf[2 + e] = T.exp2(st[e] - tf[e])
                    st[e] = tf[e]
                    st[2 + e] = st[2 + e] * tf[2 + e]
                    st[4 + e] = st[4 + e] * tf[2 + e]
                    st[6 + e] = st[6 + e] * tf[2 + e]
                for i in T.unroll(32):
                    dacc[i] = dacc[i] * tf[2 + i % 2]
            for i in T.unroll(4):
                sc[i] = T.exp2(sc[i] - st[i % 2])
                st[2 + i % 2] = st[2 + i % 2] + sc[i]
            for e in T.unroll(2):  # p' = p sigma VS of tokens 2 gi, 2 gi + 1 as halves
                xv[e] = pack_h2(sc[e] * h2lo(vsig) * st[14], sc[2 + e] * h2hi(vsig) * st[14])
                st[6 + e] = st[6 + e] + h2lo(xv[e]) + h2hi(xv[e])
            # ---- values: B = p' of tokens 2 ti, 2 ti + 1 (b0, b1), 2 ti + 8, 2 ti + 9 (b2, b3) for head gi, from
            # lanes (ti, gi / 2) and (ti + 4, gi / 2), which hold them as (token 2 g', 2 g' + 1) of head 2 t' + e
            if G == 1:
                bf[0] = shfl_idx(xv[0], 4 * ti + gi // 2)
                bf[1] = shfl_idx(xv[0], 4 * ti + 16 + gi // 2)
            else:
                pv[0] = shfl_idx(xv[0], 4 * ti + gi // 2)
                pv[1] = shfl_idx(xv[1], 4 * ti + gi // 2)
                pv[2] = shfl_idx(xv[0], 4 * ti + 16 + gi // 2)
                pv[3] = shfl_idx(xv[1], 4 * ti + 16 + gi // 2)
                bf[0] = T.if_then_else(gi % 2 == 0, pv[0], pv[1])
                bf[1] = T.if_then_else(gi % 2 == 0, pv[2], pv[3])

        @T.macro
        def t1_mma_split(b, hk, sp, sp1, S1n, lane, layer, P1, n1, sm_scale, q, t1_table, t1_k32, t1_v32, t1_ks32, t1_vs32,
                         scores, part_acc, part_ml, qhi, qlo, af, afh, bf, bfh, sc, dacc, st, tf, kq, vq, vv, pv, xv):
            # Tier 1 on tensor cores, a 16-token page a tile (FP8 e4m3 widened exactly to float16 pairs). Lane (gi, ti):
            # the keys' A rows gi / gi + 8 are the page's tokens 2 gi / 2 gi + 1, k-step m takes channels 32 ti + 4 m
            # .. + 3 (one word of the row); B = q' log2(e) / sqrt(d) as a float16 high and low part (two mma). Scores
            # times the token's key scale; the values' A rows gi / gi + 8 of m-tile mt are channels 16 gi + 2 mt / + 1,
            # k the tokens; B = p times the value scale (mma_probs). Writes the tier-1 scores for the importance.
            gi: T.let[T.int32] = lane // 4
            ti: T.let[T.int32] = lane % 4
            for i in T.unroll(32):
                dacc[i] = T.float32(0)
            for e in T.unroll(2):
                st[e] = T.if_then_else(2 * ti + e < G, T.float32(NEG), T.float32(0))
                st[2 + e] = T.float32(0)
                st[4 + e] = T.float32(0)
                st[6 + e] = T.float32(0)
            st[14] = T.float32(0)
            for m in T.unroll(8):  # head gi's q', channels 32 ti + 4 m .. + 3, split high + low
                for j in T.unroll(4):
                    tf[j] = qload(q, b, hk, gi, 32 * ti + 4 * m + j, sm_scale)
                for h2 in T.unroll(2):
                    qhi[2 * m + h2] = pack_h2(tf[2 * h2], tf[2 * h2 + 1])
                    qlo[2 * m + h2] = pack_h2(tf[2 * h2] - h2lo(qhi[2 * m + h2]), tf[2 * h2 + 1] - h2hi(qhi[2 * m + h2]))
            nt1m: T.let[T.int32] = (T.ceildiv(n1, PS1) - sp1 + S1n - 1) // S1n
            for it in T.serial(nt1m):
                tile: T.let[T.int32] = sp1 + it * S1n
                pbase: T.let[T.int64] = T.Cast("int64", (layer * P1 + t1_table[b, tile]) * HKV + hk)
                for r in T.unroll(2):  # keys: tokens 2 gi + r, bytes 32 ti .. + 31
                    kq[T.ramp(r * 8, 1, 4)] = t1_k32[T.ramp((pbase * PS1 + 2 * gi + r) * (D // 4) + 8 * ti, 1, 4)]
                    kq[T.ramp(r * 8 + 4, 1, 4)] = t1_k32[T.ramp((pbase * PS1 + 2 * gi + r) * (D // 4) + 8 * ti + 4, 1, 4)]
                for r in T.unroll(4):  # values: tokens 2 ti, 2 ti + 1, 2 ti + 8, 2 ti + 9, bytes 16 gi .. + 15
                    vq[T.ramp(r * 4, 1, 4)] = t1_v32[T.ramp((pbase * PS1 + 2 * ti + r % 2 + 8 * (r // 2)) * (D // 4) + 4 * gi, 1, 4)]
                vv[0] = t1_ks32[(pbase * PS1 + 2 * gi) // 2]
                vv[1] = t1_vs32[(pbase * PS1 + 2 * gi) // 2]
                # the values' scale from the page's largest value scale (tokens 2 gi, 2 gi + 1 here; xor over gi)
                tf[0] = T.max(h2lo(vv[1]), h2hi(vv[1]))
                for r in T.unroll(3):
                    tf[0] = T.max(tf[0], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), tf[0], T.shift_left(4, r), 32, 32))
                mma_value_scale(st, tf, dacc)
                for i in T.unroll(4):
                    sc[i] = T.float32(0)
                for m in T.unroll(8):
                    af[0] = T.call_pure_extern("uint32", _E4L, kq[m // 4 * 4 + m % 4])
                    af[1] = T.call_pure_extern("uint32", _E4L, kq[8 + m // 4 * 4 + m % 4])
                    af[2] = T.call_pure_extern("uint32", _E4H, kq[m // 4 * 4 + m % 4])
                    af[3] = T.call_pure_extern("uint32", _E4H, kq[8 + m // 4 * 4 + m % 4])
                    bf[0] = qhi[2 * m]
                    bf[1] = qhi[2 * m + 1]
                    T.evaluate(_mma(afh, 0, bfh, 0, sc, 0, "fp16"))
                    bf[0] = qlo[2 * m]
                    bf[1] = qlo[2 * m + 1]
                    T.evaluate(_mma(afh, 0, bfh, 0, sc, 0, "fp16"))
                for i in T.unroll(4):  # sc[r * 2 + e]: token 2 gi + r, head 2 ti + e
                    sc[i] = T.if_then_else(2 * ti + i % 2 < G and tile * PS1 + 2 * gi + i // 2 < n1,
                                           sc[i] * T.if_then_else(i < 2, h2lo(vv[0]), h2hi(vv[0])), T.float32(NEG))
                    if 2 * ti + i % 2 < G and tile * PS1 + 2 * gi + i // 2 < n1:
                        scores[b, hk * G + 2 * ti + i % 2, tile * PS1 + 2 * gi + i // 2] = sc[i]
                mma_probs(sc, st, tf, dacc, xv, pv, bf, vv[1], gi, ti)
                for mt in T.unroll(8):  # bytes 2 mt, 2 mt + 1 of two tokens' words, paired: (tok a, tok b) per channel
                    for r in T.unroll(2):
                        pv[r] = T.call_pure_extern("uint32", "__byte_perm", vq[8 * r + mt // 2], vq[8 * r + 4 + mt // 2],
                                                   _tab(mt % 2, [0x5140, 0x7362], "uint32"))
                    af[0] = T.call_pure_extern("uint32", _E4L, pv[0])
                    af[1] = T.call_pure_extern("uint32", _E4H, pv[0])
                    af[2] = T.call_pure_extern("uint32", _E4L, pv[1])
                    af[3] = T.call_pure_extern("uint32", _E4H, pv[1])
                    T.evaluate(_mma(afh, 0, bfh, 0, dacc, mt * 4, "fp16"))
            for e in T.unroll(2):  # sums over the rows (xor over gi)
                for r in T.unroll(3):
                    st[2 + e] = st[2 + e] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), st[2 + e], T.shift_left(4, r), 32, 32)
            tf[6] = T.if_then_else(st[14] > T.float32(0), T.float32(1) / st[14], T.float32(0))
            for mt in T.unroll(8):
                for i in T.unroll(4):  # channel 16 gi + 2 mt + i // 2, head 2 ti + i % 2
                    if 2 * ti + i % 2 < G:
                        part_acc[b, hk * G + 2 * ti + i % 2, sp, 16 * gi + 2 * mt + i // 2] = dacc[mt * 4 + i] * tf[6]
            for e in T.unroll(2):
                if gi == 0 and 2 * ti + e < G:
                    part_ml[b, hk * G + 2 * ti + e, sp, 0] = st[e]
                    part_ml[b, hk * G + 2 * ti + e, sp, 1] = st[2 + e]

        @T.macro
        def t2_mma_split(b, hk, sp, sp2, S2n, lane, layer, P2, n2, sm_scale, q, t2_table, t2_k32, t2_v32, t2_vmu32, t2_vsig32,
                         t2_ksig1, t2_kmu1, part_acc, part_ml, wb, af, afh, bf, bfh, sc, dacc, st, tf, uu, kh, kw, vw, vv, pv, xv,
                         kwn, vwn, vvn, qr, sh, mpg, t2_vmu1, t2_vsig1, mag):
            # lane (gi, ti): keys' A rows gi / gi + 8 are the tile's tokens 2 gi / 2 gi + 1, their k the channels of
            # words 2 ti, 2 ti + 1; the scores' columns (and the values' D columns) are query heads 2 ti, 2 ti + 1.
            gi: T.let[T.int32] = lane // 4
            ti: T.let[T.int32] = lane % 4
            mag[0] = T.uint32(MMA_MAGIC) | (T.Cast("uint32", layer) >> T.uint32(31))  # (layer >= 0: the OR adds nothing)
            for i in T.unroll(32):
                dacc[i] = T.float32(0)
            for e in T.unroll(2):
                st[e] = T.if_then_else(2 * ti + e < G, T.float32(NEG), T.float32(0))  # running max (log2)
                st[2 + e] = T.float32(0)  # sum of p
                st[4 + e] = T.float32(0)  # sum of p value-mu
                st[6 + e] = T.float32(0)  # sum of p' as fed to the values' mma
            st[14] = T.float32(0)  # VS, the values' scale (0: no page yet)
            if KQ:  # q' of head gi, channels 32 ti .., once for every page
                for x in T.unroll(32):
                    qr[x] = qload(q, b, hk, gi, 32 * ti + x, sm_scale)
            np2: T.let[T.int32] = (n2 - sp2 + S2n - 1) // S2n
            if S2 > 0:  # prologue: tiles 0 .. S2 - 2 in flight (empty groups past the end)
                for s0 in T.unroll(S2 - 1):
                    if s0 < np2 * NTT:
                        mma_issue(s0, s0, b, hk, sp2, S2n, lane, layer, P2, mpg, sh, t2_table, t2_k32, t2_v32, t2_vmu1,
                                  t2_vsig1)
                    T.evaluate(T.ptx["cp.async.commit_group"]())
            for ip in T.serial(np2):
                pbase: T.let[T.int64] = T.Cast("int64", (layer * P2 + t2_table[b, sp2 + ip * S2n]) * HKV + hk)
                # ---- the values' scale: VS = MMA_VALUE_MAX / (the page's largest sigma), rescaled only when needed
                tf[0] = T.float32(0)
                for j in T.unroll(NVS):
                    vv[0] = t2_vsig32[(pbase * PS2 + NVS * 2 * lane + 2 * j) // 2]
                    tf[0] = T.max(tf[0], T.max(h2lo(vv[0]), h2hi(vv[0])))
                for r in T.unroll(5):
                    tf[0] = T.max(tf[0], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), tf[0], T.shift_left(1, r), 32, 32))
                mma_value_scale(st, tf, dacc)
                # ---- keys: w = q' sigma step / (M 2^p) per channel (head gi, channels 32 ti ..), M = max |q' sigma|
                for j in T.unroll(4):
                    kh[T.ramp(j * 8, 1, 8)] = t2_ksig1[T.ramp(pbase * D + 32 * ti + j * 8, 1, 8)]
                    kh[T.ramp(32 + j * 8, 1, 8)] = t2_kmu1[T.ramp(pbase * D + 32 * ti + j * 8, 1, 8)]
                tf[3] = T.float32(0)  # q' . mu + lo sum(q' sigma)
                tf[4] = T.float32(0)  # max |q' sigma|
                for x in T.unroll(32):
                    uu[x] = qprime(qr, q, b, hk, gi, ti, x, sm_scale)
                    tf[3] = tf[3] + uu[x] * T.Cast("float32", kh[32 + x])
                    uu[x] = uu[x] * T.Cast("float32", kh[x])
                    tf[3] = tf[3] + T.float32(MLO) * uu[x]
                    tf[4] = T.max(tf[4], T.abs(uu[x]))
                for r in T.unroll(2):
                    tf[3] = tf[3] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), tf[3], T.shift_left(1, r), 32, 32)
                    tf[4] = T.max(tf[4], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), tf[4], T.shift_left(1, r), 32, 32))
                tf[5] = T.if_then_else(tf[4] > T.float32(0), T.float32(1) / tf[4], T.float32(0))
                for m in T.unroll(8):  # k-step m: channels 32 ti + m, + 8 (b0, b1) and 32 ti + 16 + m, + 8 (b2, b3)
                    wb[2 * m] = pack_h2(uu[m] * tf[5] * _tab(m, MKMUL, "float32"), uu[m + 8] * tf[5] * _tab(m, MKMUL, "float32"))
                    wb[2 * m + 1] = pack_h2(uu[16 + m] * tf[5] * _tab(m, MKMUL, "float32"), uu[24 + m] * tf[5] * _tab(m, MKMUL, "float32"))
                # the offsets' share, sum(w) 1024 per head, from the same products: the mma on an all-1024 operand
                for i in T.unroll(4):
                    af[i] = T.uint32(MMA_MAGIC)
                    sc[i] = T.float32(0)
                for m in T.unroll(8):
                    bf[0] = wb[2 * m]
                    bf[1] = wb[2 * m + 1]
                    T.evaluate(_mma(afh, 0, bfh, 0, sc, 0, "fp16"))
                for e in T.unroll(2):  # heads 2 ti + e: offsets' share, constant part and scale of the scores
                    st[12 + e] = sc[e]
                    st[8 + e] = shfl_idx(tf[3], 4 * (2 * ti + e))
                    st[10 + e] = shfl_idx(tf[4], 4 * (2 * ti + e))
                if PF:
                    mma_load(kwn, vwn, vvn, pbase, 0, gi, ti, t2_k32, t2_v32, t2_vmu32, t2_vsig32)
                for tt in (T.unroll(NTT) if UNROLL_PAGE else T.serial(NTT)):
                    if PF:  # this tile's words were loaded during the last; the next tile's are loaded now
                        for i in T.unroll(4):
                            kw[i] = kwn[i]
                            vw[i] = vwn[i]
                        for i in T.unroll(2):
                            vv[i] = vvn[i]
                        if tt + 1 < NTT:
                            mma_load(kwn, vwn, vvn, pbase, tt + 1, gi, ti, t2_k32, t2_v32, t2_vmu32, t2_vsig32)
                    elif S2 > 0:  # tile ip NTT + tt has landed; every lane has read the last, whose slot is refilled
                        T.evaluate(T.ptx["cp.async.wait_group"](max(S2 - 2, 0)))
                        sync_warp()
                        if ip * NTT + tt + S2 - 1 < np2 * NTT:
                            mma_issue(ip * NTT + tt + S2 - 1, (ip * NTT + tt + S2 - 1) % S2, b, hk, sp2, S2n, lane, layer, P2,
                                      mpg, sh, t2_table, t2_k32, t2_v32, t2_vmu1, t2_vsig1)
                        T.evaluate(T.ptx["cp.async.commit_group"]())
                        mma_load_staged(kw, vw, vv, (ip * NTT + tt) % S2, gi, ti, sh)
                    else:
                        mma_load(kw, vw, vv, pbase, tt, gi, ti, t2_k32, t2_v32, t2_vmu32, t2_vsig32)
                    # ---- scores: A = codes of tokens 2 gi, 2 gi + 1 (rows gi, gi + 8), B = w, C starts at -offsets
                    for i in T.unroll(4):
                        sc[i] = -st[12 + i % 2]
                    for m in T.unroll(8):
                        af[0] = mpair(kw[0], m, mag)
                        af[1] = mpair(kw[2], m, mag)
                        af[2] = mpair(kw[1], m, mag)
                        af[3] = mpair(kw[3], m, mag)
                        bf[0] = wb[2 * m]
                        bf[1] = wb[2 * m + 1]
                        T.evaluate(_mma(afh, 0, bfh, 0, sc, 0, "fp16"))
                    # sc[r * 2 + e]: token 2 gi + r, head 2 ti + e (log2 domain)
                    for i in T.unroll(4):
                        sc[i] = T.if_then_else(2 * ti + i % 2 < G, st[8 + i % 2] + st[10 + i % 2] * sc[i], T.float32(NEG))
                    mma_probs(sc, st, tf, dacc, xv, pv, bf, vv[1], gi, ti)
                    for e in T.unroll(2):  # value mu of tokens 2 gi, 2 gi + 1
                        st[4 + e] = st[4 + e] + sc[e] * h2lo(vv[0]) + sc[2 + e] * h2hi(vv[0])
                    # A = codes^T: m-tile mt's rows gi / gi + 8 are channels 16 gi + mt / + 8 (word gi's pair mt)
                    pv[0] = T.call_pure_extern("uint32", "__byte_perm", vw[0], vw[1], T.uint32(0x5410))
                    pv[1] = T.call_pure_extern("uint32", "__byte_perm", vw[0], vw[1], T.uint32(0x7632))
                    pv[2] = T.call_pure_extern("uint32", "__byte_perm", vw[2], vw[3], T.uint32(0x5410))
                    pv[3] = T.call_pure_extern("uint32", "__byte_perm", vw[2], vw[3], T.uint32(0x7632))
                    for mt in T.unroll(8):
                        for r in T.unroll(4):
                            af[r] = mpair(pv[r], mt, mag)
                        T.evaluate(_mma(afh, 0, bfh, 0, dacc, mt * 4, "fp16"))
            # ---- this split's partial result: sums over the rows (xor over gi), then per channel and head
            for e in T.unroll(2):
                for k in T.unroll(3):
                    for r in T.unroll(3):
                        st[2 + 2 * k + e] = st[2 + 2 * k + e] + T.tvm_warp_shuffle_xor(
                            T.uint32(0xFFFFFFFF), st[2 + 2 * k + e], T.shift_left(4, r), 32, 32)
            tf[6] = T.if_then_else(st[14] > T.float32(0), T.float32(1) / st[14], T.float32(0))
            for mt in T.unroll(8):
                for i in T.unroll(4):  # channel 16 gi + mt + 8 (i // 2), head 2 ti + i % 2
                    if 2 * ti + i % 2 < G:
                        part_acc[b, hk * G + 2 * ti + i % 2, sp, 16 * gi + mt + 8 * (i // 2)] = st[4 + i % 2] + tf[6] * (
                            T.float32(MLO) * st[6 + i % 2] + T.float32(MSTEP) * _tab(mt, MVDIV, "float32") * (
                                dacc[mt * 4 + i] - T.float32(1024) * st[6 + i % 2]))
            for e in T.unroll(2):
                if gi == 0 and 2 * ti + e < G:
                    part_ml[b, hk * G + 2 * ti + e, sp, 0] = st[e]
                    part_ml[b, hk * G + 2 * ti + e, sp, 1] = st[2 + e]


    @T.macro
    def merge_pair(b, hk, tx, NT, S, part_ml, part_acc, out, scores, t1_len, t1_table, t1_mass, layer, mg, linv, lg, o, mtot):
        # thread tx of NT: the splits of (b, hk) into out (channels tx, tx + NT, ...), then the importance of the
        # tier-1 tokens tx, tx + NT, ...
        n1m: T.let[T.int32] = t1_len[b]
        for g in T.serial(G):
            mg[g] = T.float32(NEG)
            for s in T.serial(S):
                mg[g] = T.max(mg[g], part_ml[b, hk * G + g, s, 0])
            lg[0] = T.float32(0)
            for j in T.unroll(D // NT):
                o[j] = T.float32(0)
            for s in T.serial(S):
                lg[0] = lg[0] + part_ml[b, hk * G + g, s, 1] * T.exp2(part_ml[b, hk * G + g, s, 0] - mg[g])
                for j in T.unroll(D // NT):
                    o[j] = o[j] + part_acc[b, hk * G + g, s, j * NT + tx] * T.exp2(part_ml[b, hk * G + g, s, 0] - mg[g])
            linv[g] = T.if_then_else(lg[0] > T.float32(0), T.float32(1) / lg[0], T.float32(0))
            for j in T.unroll(D // NT):
                out[b, hk * G + g, j * NT + tx] = T.Cast(out_dtype, o[j] * linv[g])
        # the tier-1 tokens NT at a time, MU rounds unrolled: their loads (score, page, mass) issue together instead
        # of one dependent round after another
        for c0 in T.serial(T.ceildiv(n1m, NT * MU)):
            for u in T.unroll(MU):
                if (c0 * MU + u) * NT + tx < n1m:
                    mtot[0] = T.float32(0)
                    for g in T.serial(G):
                        mtot[0] = mtot[0] + T.exp2(scores[b, hk * G + g, (c0 * MU + u) * NT + tx] - mg[g]) * linv[g]
                    t1_mass[layer, t1_table[b, ((c0 * MU + u) * NT + tx) // PS1], hk, ((c0 * MU + u) * NT + tx) % PS1] += mtot[0]

    @T.prim_func(s_tir=True)
    def tiered_decode(q_h: T.handle, t1k_h: T.handle, t1v_h: T.handle, t1ks_h: T.handle, t1vs_h: T.handle,
                      t2k_h: T.handle, t2v_h: T.handle, t2kmu_h: T.handle, t2ksig_h: T.handle, t2vmu_h: T.handle,
                      t2vsig_h: T.handle, t1tab_h: T.handle, t1len_h: T.handle, t2tab_h: T.handle, t2np_h: T.handle,
                      out_h: T.handle, mass_h: T.handle, scores_h: T.handle, pacc_h: T.handle, pml_h: T.handle,
                      layer: T.int32, sm_scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "tiered_decode"})
        NL, B, P1, P2, M1, M2, S = T.int64(), T.int32(), T.int64(), T.int64(), T.int32(), T.int32(), T.int32()
        q = T.match_buffer(q_h, (B, H, D), "float32")
        t1_k = T.match_buffer(t1k_h, (NL, P1, HKV, PS1, D), "uint8")
        t1_v = T.match_buffer(t1v_h, (NL, P1, HKV, PS1, D), "uint8")
        t1_ks = T.match_buffer(t1ks_h, (NL, P1, HKV, PS1), "float16")
        t1_vs = T.match_buffer(t1vs_h, (NL, P1, HKV, PS1), "float16")
        t2_k = T.match_buffer(t2k_h, (NL, P2, HKV, PS2, D4), "uint8")
        t2_v = T.match_buffer(t2v_h, (NL, P2, HKV, PS2, D4), "uint8")
        t2_kmu = T.match_buffer(t2kmu_h, (NL, P2, HKV, D), "float16")
        t2_ksig = T.match_buffer(t2ksig_h, (NL, P2, HKV, D), "float16")
        t2_vmu = T.match_buffer(t2vmu_h, (NL, P2, HKV, PS2), "float16")
        t2_vsig = T.match_buffer(t2vsig_h, (NL, P2, HKV, PS2), "float16")
        t1_table = T.match_buffer(t1tab_h, (B, M1), "int32")
        t1_len = T.match_buffer(t1len_h, (B,), "int32")
        t2_table = T.match_buffer(t2tab_h, (B, M2), "int32")
        t2_np = T.match_buffer(t2np_h, (B,), "int32")
        out = T.match_buffer(out_h, (B, H, D), out_dtype)
        t1_mass = T.match_buffer(mass_h, (NL, P1, HKV, PS1), "float32")
        scores = T.match_buffer(scores_h, (B, H, M1 * PS1), "float32")
        part_acc = T.match_buffer(pacc_h, (B, H, S, D), "float32")
        part_ml = T.match_buffer(pml_h, (B, H, S + int(FUSE), 2), "float32")  # (merge_in_split: row S, the counters)
        t1_k8 = T.decl_buffer((NL * P1 * HKV * PS1 * D,), "float8_e4m3fn", data=t1_k.data)
        t1_v8 = T.decl_buffer((NL * P1 * HKV * PS1 * D,), "float8_e4m3fn", data=t1_v.data)
        t1_ks1 = T.decl_buffer((NL * P1 * HKV * PS1,), "float16", data=t1_ks.data)
        t1_vs1 = T.decl_buffer((NL * P1 * HKV * PS1,), "float16", data=t1_vs.data)
        t2_k32 = T.decl_buffer((NL * P2 * HKV * PS2 * W2,), "uint32", data=t2_k.data)
        t2_v32 = T.decl_buffer((NL * P2 * HKV * PS2 * W2,), "uint32", data=t2_v.data)
        t2_vmu1 = T.decl_buffer((NL * P2 * HKV * PS2,), "float16", data=t2_vmu.data)
        t2_vsig1 = T.decl_buffer((NL * P2 * HKV * PS2,), "float16", data=t2_vsig.data)
        t2_ksig1 = T.decl_buffer((NL * P2 * HKV * D,), "float16", data=t2_ksig.data)
        t2_kmu1 = T.decl_buffer((NL * P2 * HKV * D,), "float16", data=t2_kmu.data)
        t2_vmu32 = T.decl_buffer((NL * P2 * HKV * PS2 // 2,), "uint32", data=t2_vmu.data)
        t2_vsig32 = T.decl_buffer((NL * P2 * HKV * PS2 // 2,), "uint32", data=t2_vsig.data)
        t1_k32 = T.decl_buffer((NL * P1 * HKV * PS1 * D // 4,), "uint32", data=t1_k.data)
        t1_v32 = T.decl_buffer((NL * P1 * HKV * PS1 * D // 4,), "uint32", data=t1_v.data)
        t1_ks32 = T.decl_buffer((NL * P1 * HKV * PS1 // 2,), "uint32", data=t1_ks.data)
        t1_vs32 = T.decl_buffer((NL * P1 * HKV * PS1 // 2,), "uint32", data=t1_vs.data)
        if MMA:
            assert S >= 2, "tiered_decode (tensor-core tier 2) needs at least 2 splits: decode_splits(..., t2_mma=True)"

        for bs in T.thread_binding(B * S, thread="blockIdx.x"):
            for hk in T.thread_binding(HKV, thread="blockIdx.y"):
                for lane in T.thread_binding(32, thread="threadIdx.x"):
                    with T.sblock("attn"):
                        T.reads()
                        T.writes()
                        qv = T.sblock_alloc_buffer((G * 16,), "float32", scope="local")
                        qs = T.sblock_alloc_buffer((G * 16,), "float32", scope="local")
                        ck = T.sblock_alloc_buffer((G,), "float32", scope="local")
                        acc = T.sblock_alloc_buffer((G * 16,), "float32", scope="local")
                        m_l = T.sblock_alloc_buffer((G,), "float32", scope="local")
                        l_l = T.sblock_alloc_buffer((G,), "float32", scope="local")
                        pmu = T.sblock_alloc_buffer((G,), "float32", scope="local")
                        s_l = T.sblock_alloc_buffer((G * KSTEP,), "float32", scope="local")
                        p_l = T.sblock_alloc_buffer((G * KSTEP,), "float32", scope="local")
                        mt = T.sblock_alloc_buffer((2,), "float32", scope="local")
                        qs2 = T.sblock_alloc_buffer((G * 16,), "float32", scope="local")
                        kw = T.sblock_alloc_buffer((KSTEP,), "uint32", scope="local")
                        vw = T.sblock_alloc_buffer((KSTEP,), "uint32", scope="local")
                        sc16 = T.sblock_alloc_buffer((KSTEP,), "float16", scope="local")
                        vs16 = T.sblock_alloc_buffer((KSTEP,), "float16", scope="local")
                        h16 = T.sblock_alloc_buffer((16,), "float16", scope="local")
                        h16b = T.sblock_alloc_buffer((16,), "float16", scope="local")
                        k8 = T.sblock_alloc_buffer((KSTEP * 16,), "float8_e4m3fn", scope="local")
                        v8 = T.sblock_alloc_buffer((KSTEP * 16,), "float8_e4m3fn", scope="local")
                        kf = T.sblock_alloc_buffer((16,), "float16", scope="local")
                        # t1_half2: the tier-1 rows loaded as words (an alias of k8 / v8 would put them on the stack)
                        k8w = T.sblock_alloc_buffer((KSTEP * 4 if T1H2 else 1,), "uint32", scope="local")
                        v8w = T.sblock_alloc_buffer((KSTEP * 4 if T1H2 else 1,), "uint32", scope="local")
                        lv = T.sblock_alloc_buffer((16,), "float32", scope="local")
                        bk = T.sblock_alloc_buffer((len(BASES),), "uint32", scope="local")
                        a0 = T.sblock_alloc_buffer((G * 16,), "float32", scope="local")
                        a1 = T.sblock_alloc_buffer((G * 16,), "float32", scope="local")
                        ps = T.sblock_alloc_buffer((G,), "float32", scope="local")
                        qh = T.sblock_alloc_buffer((G * 8,), "uint32", scope="local")
                        ksc = T.sblock_alloc_buffer((2 * G,), "float32", scope="local")
                        vr = T.sblock_alloc_buffer((2 * G,), "float32", scope="local")
                        vacc = T.sblock_alloc_buffer((G * 8,), "uint32", scope="local")
                        hxb = T.sblock_alloc_buffer((9,), "uint32", scope="local")
                        if MMA:
                            mwb = T.sblock_alloc_buffer((16,), "uint32", scope="local")  # B fragments of the keys' w
                            maf = T.sblock_alloc_buffer((4,), "uint32", scope="local")
                            mafh = T.decl_buffer((8,), "float16", data=maf.data, scope="local")
                            mbf = T.sblock_alloc_buffer((2,), "uint32", scope="local")
                            mbfh = T.decl_buffer((4,), "float16", data=mbf.data, scope="local")
                            msc = T.sblock_alloc_buffer((4,), "float32", scope="local")
                            mdacc = T.sblock_alloc_buffer((32,), "float32", scope="local")
                            mst = T.sblock_alloc_buffer((16,), "float32", scope="local")
                            mtf = T.sblock_alloc_buffer((8,), "float32", scope="local")
                            muu = T.sblock_alloc_buffer((32,), "float32", scope="local")
                            mkh = T.sblock_alloc_buffer((64,), "float16", scope="local")
                            mmag = T.sblock_alloc_buffer((1,), "uint32", scope="local")
                            mkw = T.sblock_alloc_buffer((4,), "uint32", scope="local")
                            mvw = T.sblock_alloc_buffer((4,), "uint32", scope="local")
                            mvv = T.sblock_alloc_buffer((2,), "uint32", scope="local")
                            mpv = T.sblock_alloc_buffer((4,), "uint32", scope="local")
                            mxv = T.sblock_alloc_buffer((2,), "uint32", scope="local")
                            mkwn = T.sblock_alloc_buffer((4,), "uint32", scope="local")  # the next tile's words (t2_prefetch)
                            mvwn = T.sblock_alloc_buffer((4,), "uint32", scope="local")
                            mvvn = T.sblock_alloc_buffer((2,), "uint32", scope="local")
                            mqr = T.sblock_alloc_buffer((32,), "float32", scope="local")  # t2_keep_q: q' of the lane's channels
                            mqhi = T.sblock_alloc_buffer((16,), "uint32", scope="local")  # t1_mma: q' as float16 high / low
                            mqlo = T.sblock_alloc_buffer((16,), "uint32", scope="local")
                            mkq = T.sblock_alloc_buffer((16,), "uint32", scope="local")
                            mvq = T.sblock_alloc_buffer((16,), "uint32", scope="local")
                        if S1 + S2 > 0:
                            pg2 = T.sblock_alloc_buffer((1,), "int32", scope="local")
                            sh = T.sblock_alloc_buffer((SHB // 4,), "uint32", scope="shared")  # the cp.async stages
                            sh16 = T.decl_buffer((SHB // 2,), "float16", data=sh.data, scope="shared")
                            sh8 = T.decl_buffer((SHB,), "float8_e4m3fn", data=sh.data, scope="shared")
                        if FUSE:  # the merge's registers (the last split warp of a pair merges it)
                            fmg = T.sblock_alloc_buffer((G,), "float32", scope="local")
                            flinv = T.sblock_alloc_buffer((G,), "float32", scope="local")
                            flg = T.sblock_alloc_buffer((1,), "float32", scope="local")
                            fo = T.sblock_alloc_buffer((D // NTF,), "float32", scope="local")
                            fmtot = T.sblock_alloc_buffer((1,), "float32", scope="local")
                            farr = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        b: T.let[T.int32] = bs // S
                        sp: T.let[T.int32] = bs % S
                        ST1: T.let[T.int32] = t1_splits(S)  # splits on tier 1 (all of them but with t2_mma)
                        tg: T.let[T.int32] = lane // LPT
                        cw: T.let[T.int32] = lane % LPT
                        n1: T.let[T.int32] = t1_len[b]
                        n2: T.let[T.int32] = t2_np[b]
                        if MINB > 0:  # the split kernel's __launch_bounds__(32, MINB) (the attribute marks its kernel)
                            with T.attr(T.int32(0), "tirx.launch_bounds_min_blocks_per_sm", MINB):
                                pmu[0] = T.float32(0)
                        for g in T.unroll(G):
                            for i in T.unroll(16):
                                qv[g * 16 + i] = q[b, hk * G + g, cw * 16 + i] * sm_scale * T.float32(LOG2E)
                                acc[g * 16 + i] = T.float32(0)
                            m_l[g] = T.float32(NEG)
                            l_l[g] = T.float32(0)
                            pmu[g] = T.float32(0)
                            if VSPLIT or FIELDS or HALF2:
                                ps[g] = T.float32(0)
                            if VSPLIT:
                                for i in T.unroll(16):
                                    a0[g * 16 + i] = T.float32(0)
                                    a1[g * 16 + i] = T.float32(0)
                        if REG:  # bases ptxas cannot fold into the masks (layer >= 0: the OR adds nothing)
                            for j in T.unroll(len(BASES)):
                                bk[j] = _tab(j, BASES, "uint32") | (T.Cast("uint32", layer) >> T.uint32(31))

                        if T1H2:  # tier 1's q' in pairs of halves: q / max |q| of the lane's channels (ksc: max |q|)
                            for g in T.unroll(G):
                                max_recip(qv, g * 16, 16, ksc, g, 1.0, True)
                                for j in T.unroll(8):
                                    qh[g * 8 + j] = pack_h2(qv[g * 16 + 2 * j] * ksc[G + g], qv[g * 16 + 2 * j + 1] * ksc[G + g])
                        if not T1MMA:
                            # ---- tier 1: tiles of TILE FP8 tokens, every S-th
                            nt1: T.let[T.int32] = T.if_then_else(sp < ST1, (T.ceildiv(n1, TILE) - sp + ST1 - 1) // ST1, 0)
                            if S1 > 0:
                                for s0 in T.unroll(S1 - 1):  # prologue: tiles 0 .. S1 - 2 in flight (empty groups past the end)
                                    if s0 < nt1:
                                        issue1(s0, s0, b, sp, ST1, hk, tg, cw, layer, P1, n1, sh8, sh16, t1_table, t1_k8, t1_v8, t1_ks1, t1_vs1)
                                    T.evaluate(T.ptx["cp.async.commit_group"]())
                            for it in T.serial(nt1):
                                tok0: T.let[T.int32] = (sp + it * ST1) * TILE + tg * KSTEP
                                if S1 > 0:
                                    # tile it's group has landed (S1 - 2 younger ones may be pending); after the warp
                                    # barrier every lane has read tile it - 1, whose slot tile it + S1 - 1 refills
                                    T.evaluate(T.ptx["cp.async.wait_group"](max(S1 - 2, 0)))
                                    sync_warp()
                                    if it + S1 - 1 < nt1:
                                        issue1(it + S1 - 1, (it + S1 - 1) % S1,
                                               b, sp, ST1, hk, tg, cw, layer, P1, n1, sh8, sh16, t1_table, t1_k8, t1_v8, t1_ks1, t1_vs1)
                                    T.evaluate(T.ptx["cp.async.commit_group"]())
                                    for k in T.unroll(KSTEP):
                                        k8[T.ramp(k * 16, 1, 16)] = sh8[T.ramp(it % S1 * STG1 + (tg * KSTEP + k) * D + cw * 16, 1, 16)]
                                        v8[T.ramp(k * 16, 1, 16)] = sh8[T.ramp(
                                            it % S1 * STG1 + TILE * D + (tg * KSTEP + k) * D + cw * 16, 1, 16)]
                                    for k in T.unroll(KSTEP):
                                        sc16[k] = sh16[(it % S1 * STG1 + 2 * TILE * D) // 2 + tg * KSTEP + k]
                                        vs16[k] = sh16[(it % S1 * STG1 + 2 * TILE * D + 2 * TILE) // 2 + tg * KSTEP + k]
                                else:
                                    page: T.let[T.int32] = t1_table[b, T.min(tok0, n1 - 1) // PS1]
                                    row0: T.let[T.int64] = ((layer * P1 + page) * HKV + hk) * PS1 + tok0 % PS1
                                    for k in T.unroll(KSTEP):
                                        if T1H2:
                                            k8w[T.ramp(k * 4, 1, 4)] = t1_k32[T.ramp(((row0 + k) * D + cw * 16) // 4, 1, 4)]
                                            v8w[T.ramp(k * 4, 1, 4)] = t1_v32[T.ramp(((row0 + k) * D + cw * 16) // 4, 1, 4)]
                                        else:
                                            k8[T.ramp(k * 16, 1, 16)] = t1_k8[T.ramp((row0 + k) * D + cw * 16, 1, 16)]
                                            v8[T.ramp(k * 16, 1, 16)] = t1_v8[T.ramp((row0 + k) * D + cw * 16, 1, 16)]
                                    for k in T.unroll(KSTEP):
                                        sc16[k] = t1_ks1[row0 + k]
                                        vs16[k] = t1_vs1[row0 + k]
                                t1_tile_math(tok0, n1, b, hk, cw, qv, k8, v8, kf, sc16, vs16, s_l, p_l, acc, m_l, l_l, pmu, mt, scores, a0, a1, ps,
                                             k8w, v8w, qh, ksc, vr, vacc, hxb, lane)

                        if FIELDS:  # the value sums move to the bit-float domain of the tier-2 fields
                            for g in T.unroll(G):
                                for i in T.unroll(16):
                                    acc[g * 16 + i] = acc[g * 16 + i] * _tab(i, [1.0 / c for c in FC1], "float32")
                        if not MMA:
                            # ---- tier 2: 2-bit pages, every S-th
                            np2: T.let[T.int32] = (n2 - sp + S - 1) // S
                            if S2 > 0:
                                sync_warp()  # every lane is past the tier-1 ring's reads: the buffer may be refilled
                                for s0 in T.unroll(S2 - 1):  # prologue: tiles 0 .. S2 - 2 in flight (empty groups past the end)
                                    if s0 < np2 * NSUB:
                                        issue2(s0, s0, b, sp, S, hk, lane, layer, P2, pg2, sh, t2_table, t2_k32, t2_v32, t2_vmu1,
                                               t2_vsig1, t2_ksig1, t2_kmu1)
                                    T.evaluate(T.ptx["cp.async.commit_group"]())
                                for ip in T.serial(np2):
                                    for st in (T.unroll(NSUB) if UNROLL_PAGE else T.serial(NSUB)):
                                        # as tier 1: tile ip NSUB + st has landed, tile ip NSUB + st - 1 is read by all
                                        T.evaluate(T.ptx["cp.async.wait_group"](max(S2 - 2, 0)))
                                        sync_warp()
                                        if ip * NSUB + st + S2 - 1 < np2 * NSUB:
                                            issue2(ip * NSUB + st + S2 - 1, (ip * NSUB + st + S2 - 1) % S2,
                                                   b, sp, S, hk, lane, layer, P2, pg2, sh, t2_table, t2_k32, t2_v32, t2_vmu1, t2_vsig1,
                                                   t2_ksig1, t2_kmu1)
                                        T.evaluate(T.ptx["cp.async.commit_group"]())
                                        if st == 0:  # the page's key sigma / mu came with its first tile
                                            for j in T.unroll(2):
                                                h16[T.ramp(j * 8, 1, 8)] = sh16[T.ramp(
                                                    ((ip * NSUB + st) % S2 * STG2 + OFF_KSIG) // 2 + cw * 16 + j * 8, 1, 8)]
                                                h16b[T.ramp(j * 8, 1, 8)] = sh16[T.ramp(
                                                    ((ip * NSUB + st) % S2 * STG2 + OFF_KSIG + 2 * D) // 2 + cw * 16 + j * 8, 1, 8)]
                                            t2_page_setup(b, hk, cw, q, sm_scale, h16, h16b, ck, qs, qs2, qh, ksc)
                                        for k in T.unroll(KSTEP):
                                            kw[k] = sh[((ip * NSUB + st) % S2 * STG2 + tg * GS2) // 4 + k * W2 + cw]
                                            vw[k] = sh[((ip * NSUB + st) % S2 * STG2 + OFF_V2 + tg * GS2) // 4 + k * W2 + cw]
                                        sc16[T.ramp(0, 1, KSTEP)] = sh16[T.ramp(
                                            ((ip * NSUB + st) % S2 * STG2 + OFF_VMU) // 2 + tg * KSTEP, 1, KSTEP)]
                                        vs16[T.ramp(0, 1, KSTEP)] = sh16[T.ramp(
                                            ((ip * NSUB + st) % S2 * STG2 + OFF_VSIG) // 2 + tg * KSTEP, 1, KSTEP)]
                                        t2_tile_math(ck, qs, qs2, kw, vw, sc16, vs16, lv, s_l, p_l, acc, m_l, l_l, pmu, mt, bk, a0, a1, ps, qh, ksc, vr, vacc, hxb,
                                                     cw, lane)
                            else:
                                for ip in T.serial(np2):
                                    page2: T.let[T.int32] = t2_table[b, sp + ip * S]
                                    for j in T.unroll(2):
                                        h16[T.ramp(j * 8, 1, 8)] = t2_ksig[layer, page2, hk, T.ramp(cw * 16 + j * 8, 1, 8)]
                                        h16b[T.ramp(j * 8, 1, 8)] = t2_kmu[layer, page2, hk, T.ramp(cw * 16 + j * 8, 1, 8)]
                                    t2_page_setup(b, hk, cw, q, sm_scale, h16, h16b, ck, qs, qs2, qh, ksc)
                                    for st in T.serial(NSUB):
                                        r0: T.let[T.int32] = st * TILE + tg * KSTEP
                                        wrow: T.let[T.int64] = (((layer * P2 + page2) * HKV + hk) * PS2 + r0) * W2 + cw
                                        for k in T.unroll(KSTEP):
                                            kw[k] = t2_k32[wrow + k * W2]
                                            vw[k] = t2_v32[wrow + k * W2]
                                        sc16[T.ramp(0, 1, KSTEP)] = t2_vmu[layer, page2, hk, T.ramp(r0, 1, KSTEP)]
                                        vs16[T.ramp(0, 1, KSTEP)] = t2_vsig[layer, page2, hk, T.ramp(r0, 1, KSTEP)]
                                        t2_tile_math(ck, qs, qs2, kw, vw, sc16, vs16, lv, s_l, p_l, acc, m_l, l_l, pmu, mt, bk, a0, a1, ps, qh, ksc, vr, vacc, hxb,
                                                     cw, lane)

                        if HALF2:  # the levels' offset, once: acc += lo sum(p) over the tier-2 tokens
                            for g in T.unroll(G):
                                for i in T.unroll(16):
                                    acc[g * 16 + i] = acc[g * 16 + i] + T.float32(LO) * ps[g]
                        if FIELDS:  # back from the bit-float domain: acc = c1 acc + cc sum(p), once
                            for g in T.unroll(G):
                                for i in T.unroll(16):
                                    acc[g * 16 + i] = acc[g * 16 + i] * _tab(i, FC1, "float32") + _tab(i, FCC, "float32") * ps[g]
                        if VSPLIT:  # the per-channel constants of the split value sums, once
                            for g in T.unroll(G):
                                for i in T.unroll(16):
                                    acc[g * 16 + i] = acc[g * 16 + i] + _tab(i, CC, "float32") * ps[g] + \
                                        _tab(i, C0, "float32") * a0[g * 16 + i] + _tab(i, C1, "float32") * a1[g * 16 + i]
                        if sp < ST1 and not T1MMA:  # (every split but the tensor-core ones)
                            # ---- sum the token groups, write this split's partial result
                            if SCAT:  # each lane's probability sum is its own tokens': first over the token's lanes
                                for r in T.unroll(LPT.bit_length() - 1):
                                    l_l[0] = l_l[0] + shfl(l_l[0], T.shift_left(1, r))
                            for g in T.unroll(G):
                                for r in T.unroll(TPS.bit_length() - 1):
                                    l_l[g] = l_l[g] + shfl(l_l[g], T.shift_left(LPT, r))
                                    pmu[g] = pmu[g] + shfl(pmu[g], T.shift_left(LPT, r))
                                    for i in T.unroll(16):
                                        acc[g * 16 + i] = acc[g * 16 + i] + shfl(acc[g * 16 + i], T.shift_left(LPT, r))
                                if tg == 0:
                                    for i in T.unroll(16):
                                        part_acc[b, hk * G + g, sp, cw * 16 + i] = acc[g * 16 + i] + pmu[g]
                                if lane == 0:
                                    part_ml[b, hk * G + g, sp, 0] = m_l[g]
                                    part_ml[b, hk * G + g, sp, 1] = l_l[g]
                        if T1MMA:
                            if sp < ST1:  # tier 1 on tensor cores: pages sp, sp + ST1, ...
                                t1_mma_split(b, hk, sp, sp, ST1, lane, layer, P1, n1, sm_scale, q, t1_table, t1_k32, t1_v32, t1_ks32, t1_vs32,
                                             scores, part_acc, part_ml, mqhi, mqlo, maf, mafh, mbf, mbfh, msc, mdacc, mst, mtf, mkq, mvq, mvv,
                                             mpv, mxv)
                        if MMA:
                            if sp >= ST1:  # tier 2 on tensor cores: pages sp - ST1, + (S - ST1), ... (stages: in sh)
                                t2_mma_split(b, hk, sp, sp - ST1, S - ST1, lane, layer, P2, n2, sm_scale, q, t2_table, t2_k32, t2_v32, t2_vmu32,
                                             t2_vsig32, t2_ksig1, t2_kmu1, part_acc, part_ml, mwb, maf, mafh, mbf, mbfh, msc, mdacc, mst, mtf,
                                             muu, mkh, mkw, mvw, mvv, mpv, mxv, mkwn, mvwn, mvvn, mqr, sh if S1 + S2 > 0 else None,
                                             pg2 if S1 + S2 > 0 else None, t2_vmu1, t2_vsig1, mmag)
                        if FUSE:
                            # this split's writes, then its arrival; the last of the pair's S merges (the threadfence
                            # reduction pattern: fence, count, and the last to count reads the others' writes)
                            T.evaluate(T.call_extern("void", "__threadfence"))
                            sync_warp()
                            farr[0] = T.float32(0)
                            if lane == 0:
                                farr[0] = T.call_extern("float32", "atomicAdd", T.address_of(part_ml[b, hk * G, S, 0]),
                                                        T.float32(1))
                            farr[0] = T.tvm_warp_shuffle(T.uint32(0xFFFFFFFF), farr[0], 0, 32, 32)
                            if farr[0] == T.Cast("float32", S - 1):
                                T.evaluate(T.call_extern("void", "__threadfence"))
                                if lane < NTF:
                                    merge_pair(b, hk, lane, NTF, S, part_ml, part_acc, out, scores, t1_len, t1_table, t1_mass,
                                               layer, fmg, flinv, flg, fo, fmtot)
                                if lane == 0:  # zero again for the next call (the workspaces serve every layer)
                                    part_ml[b, hk * G, S, 0] = T.float32(0)

        # ---- merge the splits; importance of the tier-1 tokens (merge_in_split: in the split kernel's last warps)
        if not FUSE:
            for b in T.thread_binding(B, thread="blockIdx.x"):
                for hk in T.thread_binding(HKV, thread="blockIdx.y"):
                    for tx in T.thread_binding(NT2, thread="threadIdx.x"):
                        with T.sblock("merge"):
                            T.reads()
                            T.writes()
                            mg = T.sblock_alloc_buffer((G,), "float32", scope="local")
                            linv = T.sblock_alloc_buffer((G,), "float32", scope="local")
                            lg = T.sblock_alloc_buffer((1,), "float32", scope="local")
                            o = T.sblock_alloc_buffer((D // NT2,), "float32", scope="local")
                            mtot = T.sblock_alloc_buffer((1,), "float32", scope="local")
                            merge_pair(b, hk, tx, NT2, S, part_ml, part_acc, out, scores, t1_len, t1_table, t1_mass, layer,
                                       mg, linv, lg, o, mtot)

    return tiered_decode
