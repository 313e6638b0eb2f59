"""Quantize-and-append of new K/V into tier-1 (FP8) slots of the tiered KV cache (TIR).

For each of N new tokens (the tokens of one forward, all sequences laid out ragged) and each KV head:
scale = max|x| / 448 (float16, at least 2^-24), code = e4m3(x / scale) with round-to-nearest-even,
written to ``t1_k/t1_v[layer, page, head, slot, :]`` with ``slot_of[n] = page * PS1 + slot`` (the runtime's
page tables give it); the token's position goes to ``t1_pos`` and its importance ``t1_mass`` restarts
at 0. The e4m3 encoding is integer arithmetic on the float's bits (TVM's llvm fp8 cast is wrong), so
the llvm and CUDA builds produce the same bytes as ``ml_dtypes.float8_e4m3fn``.

CUDA: a block per token, a warp per KV head (``_append_cuda``). Buffers: k_new, v_new float32 [N, Hkv, Dh]; slot_of, pos int32 [N]; t1_k, t1_v uint8 [P1, Hkv, PS1, Dh];
t1_ks, t1_vs float16 [P1, Hkv, PS1]; t1_pos int32 [P1, Hkv, PS1]; t1_mass float32 [P1, Hkv, PS1].
"""

from __future__ import annotations

from tvm.script import tirx as T

from . import memoized
from .grouped_experts import _shfl


def _e4m3_byte(x):
    """e4m3 byte of a float32 already scaled into [-448, 448] (round to nearest even)."""
    a = T.abs(x)
    bits = T.reinterpret("uint32", a)
    e = T.Cast("int32", (bits >> T.uint32(23)) & T.uint32(255)) - 127  # floor(log2 a) for normal a
    # subnormals of e4m3: a < 2^-6 -> m = rne(a * 2^9), m in 0..8 (8 is the smallest normal, code 8)
    sub = T.Cast("uint32", T.nearbyint(a * T.float32(512.0)))
    # normals: mantissa m = rne((a / 2^e - 1) * 8); a carry to 8 bumps the exponent
    frac = T.reinterpret("float32", (bits & T.uint32(0x007FFFFF)) | T.uint32(0x3F800000))  # a / 2^e in [1, 2)
    m = T.Cast("int32", T.nearbyint((frac - T.float32(1.0)) * T.float32(8.0)))
    normal = T.Cast("uint32", T.min((e + 7) * 8 + m, 126))  # (e + 7) << 3 | m, carry included; clamp at 448
    mag = T.if_then_else(a < T.float32(2.0**-6), sub, normal)
    return T.Cast("uint8", mag | ((T.reinterpret("uint32", x) >> T.uint32(24)) & T.uint32(128)))  # sign bit (-0 too)


def _signature(HKV: int, D: int, PS1: int, body):
    """``tiered_append(k_new, v_new, slot_of, pos, t1_k, t1_v, t1_ks, t1_vs, t1_pos, t1_mass, layer)`` around a form's
    ``body`` macro (the buffers in that order, then the layer)."""

    @T.prim_func(s_tir=True)
    def tiered_append(k_h: T.handle, v_h: T.handle, slot_h: T.handle, pos_h: T.handle, t1k_h: T.handle,
                      t1v_h: T.handle, t1ks_h: T.handle, t1vs_h: T.handle, t1pos_h: T.handle, mass_h: T.handle, layer: T.int32):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "tiered_append"})
        NL, N, P1 = T.int64(), T.int32(), T.int64()
        k_new = T.match_buffer(k_h, (N, HKV, D), "float32")
        v_new = T.match_buffer(v_h, (N, HKV, D), "float32")
        slot_of = T.match_buffer(slot_h, (N,), "int32")
        pos = T.match_buffer(pos_h, (N,), "int32")
        t1_k = T.match_buffer(t1k_h, (NL, P1, HKV, PS1, D), "uint8")
        t1_v = T.match_buffer(t1v_h, (NL, P1, HKV, PS1, D), "uint8")
        t1_ks = T.match_buffer(t1ks_h, (NL, P1, HKV, PS1), "float16")
        t1_vs = T.match_buffer(t1vs_h, (NL, P1, HKV, PS1), "float16")
        t1_pos = T.match_buffer(t1pos_h, (NL, P1, HKV, PS1), "int32")
        t1_mass = T.match_buffer(mass_h, (NL, P1, HKV, PS1), "float32")
        body(k_new, v_new, slot_of, pos, t1_k, t1_v, t1_ks, t1_vs, t1_pos, t1_mass, layer)

    return tiered_append


@memoized
def make_tiered_append(num_kv_heads: int, head_dim: int, t1_page: int = 16, target: str = "llvm"):
    """The append PrimFunc (``target``: "llvm" serial, or "cuda": ``_append_cuda``)."""
    HKV, D, PS1 = num_kv_heads, head_dim, t1_page
    if target == "cuda":
        return _append_cuda(HKV, D, PS1)

    @T.macro
    def body(k_new, v_new, slot_of, pos, t1_k, t1_v, t1_ks, t1_vs, t1_pos, t1_mass, layer):
        for n in T.serial(k_new.shape[0]):
            for h in T.serial(HKV):
                with T.sblock("append"):
                    T.reads()
                    T.writes()
                    amax = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    sc = T.sblock_alloc_buffer((2,), "float16", scope="local")
                    page: T.let[T.int32] = slot_of[n] // PS1
                    slot: T.let[T.int32] = slot_of[n] % PS1
                    amax[0] = T.float32(0)
                    amax[1] = T.float32(0)
                    for d in T.serial(D):
                        amax[0] = T.max(amax[0], T.abs(k_new[n, h, d]))
                        amax[1] = T.max(amax[1], T.abs(v_new[n, h, d]))
                    sc[0] = T.Cast("float16", T.max(amax[0] / T.float32(448.0), T.float32(2.0**-24)))
                    sc[1] = T.Cast("float16", T.max(amax[1] / T.float32(448.0), T.float32(2.0**-24)))
                    for d in T.serial(D):
                        t1_k[layer, page, h, slot, d] = _e4m3_byte(k_new[n, h, d] / T.Cast("float32", sc[0]))
                        t1_v[layer, page, h, slot, d] = _e4m3_byte(v_new[n, h, d] / T.Cast("float32", sc[1]))
                    t1_ks[layer, page, h, slot] = sc[0]
                    t1_vs[layer, page, h, slot] = sc[1]
                    t1_pos[layer, page, h, slot] = pos[n]
                    t1_mass[layer, page, h, slot] = T.float32(0)

    return _signature(HKV, D, PS1, body)


def _append_cuda(HKV: int, D: int, PS1: int):
    """CUDA form: a block per token, a warp per KV head (up to 32 warps; more heads loop). Lane l holds channels
    VPL l .. VPL l + VPL - 1 (VPL = ceil(Dh / 32): one 16-byte load of 4 floats at Dh 128), the row's max is
    reduced by xor shuffles, and the lane writes its channels' codes. Before, a thread per head walked its row
    alone: 16 threads a token, each row read with a 512-byte stride between the threads."""
    VPL = -(-D // 32)
    W = min(HKV, 32)  # warps per block
    HL = -(-HKV // W)  # heads each warp takes
    vec = D % (32 * VPL) == 0 and VPL in (2, 4)  # whole vector loads per lane

    @T.macro
    def body(k_new, v_new, slot_of, pos, t1_k, t1_v, t1_ks, t1_vs, t1_pos, t1_mass, layer):
        for n in T.thread_binding(k_new.shape[0], thread="blockIdx.x"):
            for tx in T.thread_binding(32 * W, thread="threadIdx.x"):
                with T.sblock("append"):
                    T.reads()
                    T.writes()
                    kx = T.sblock_alloc_buffer((VPL,), "float32", scope="local")
                    vx = T.sblock_alloc_buffer((VPL,), "float32", scope="local")
                    amax = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    sc = T.sblock_alloc_buffer((2,), "float16", scope="local")
                    lane: T.let[T.int32] = tx % 32
                    page: T.let[T.int32] = slot_of[n] // PS1
                    slot: T.let[T.int32] = slot_of[n] % PS1
                    for hl in T.serial(HL):
                        h: T.let[T.int32] = hl * W + tx // 32
                        if h < HKV:  # (warp-uniform)
                            for i in T.vectorized(VPL) if vec else T.unroll(VPL):
                                kx[i] = T.if_then_else(lane * VPL + i < D, k_new[n, h, T.min(lane * VPL + i, D - 1)], T.float32(0))
                            for i in T.vectorized(VPL) if vec else T.unroll(VPL):
                                vx[i] = T.if_then_else(lane * VPL + i < D, v_new[n, h, T.min(lane * VPL + i, D - 1)], T.float32(0))
                            amax[0] = T.float32(0)
                            amax[1] = T.float32(0)
                            for i in T.unroll(VPL):
                                amax[0] = T.max(amax[0], T.abs(kx[i]))
                                amax[1] = T.max(amax[1], T.abs(vx[i]))
                            for r in T.unroll(5):
                                amax[0] = T.max(amax[0], _shfl(amax[0], T.shift_left(1, r)))
                                amax[1] = T.max(amax[1], _shfl(amax[1], T.shift_left(1, r)))
                            sc[0] = T.Cast("float16", T.max(amax[0] / T.float32(448.0), T.float32(2.0**-24)))
                            sc[1] = T.Cast("float16", T.max(amax[1] / T.float32(448.0), T.float32(2.0**-24)))
                            for i in T.unroll(VPL):
                                if lane * VPL + i < D:
                                    t1_k[layer, page, h, slot, lane * VPL + i] = _e4m3_byte(kx[i] / T.Cast("float32", sc[0]))
                                    t1_v[layer, page, h, slot, lane * VPL + i] = _e4m3_byte(vx[i] / T.Cast("float32", sc[1]))
                            if lane == 0:
                                t1_ks[layer, page, h, slot] = sc[0]
                                t1_vs[layer, page, h, slot] = sc[1]
                                t1_pos[layer, page, h, slot] = pos[n]
                                t1_mass[layer, page, h, slot] = T.float32(0)

    return _signature(HKV, D, PS1, body)
