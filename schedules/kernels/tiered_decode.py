"""Batched single-token decode attention over the tiered KV cache (TIR), with importance accumulation.

One call per layer. For every sequence b and query head h (KV head ``h // (H / Hkv)``) it runs an
online softmax over the sequence's tier-1 tokens (FP8 e4m3 bytes times a per-token scale) and then
its tier-2 pages (2-bit NF2 codes: keys ``mu + sigma * level`` per channel, values per token), all
dequantized in registers, and writes ``out[b, h, :]``. It also adds each tier-1 token's final
attention probability, summed over the query heads of its KV head, to ``t1_mass`` (the importance
the re-rank reads); the scores of pass one are kept in ``scores`` (a workspace) for that.

Buffers (layout of ``moec.runtime.kv_cache``; B sequences, P1/P2 pages per pool, M1/M2 table width):
  q        float32 [B, H, Dh]
  t1_k/v   uint8   [P1, Hkv, PS1, Dh]        t1_ks/vs  float16 [P1, Hkv, PS1]
  t2_k/v   uint8   [P2, Hkv, PS2, Dh/4]      t2_kmu/ksig float16 [P2, Hkv, Dh], t2_vmu/vsig [P2, Hkv, PS2]
  t1_table int32   [B, M1], t1_len int32 [B] (tokens), t2_table int32 [B, M2], t2_pages int32 [B]
  out      float32 [B, H, Dh]                t1_mass float32 [P1, Hkv, PS1] (accumulated in place)
  scores   float32 [B, H, M1 * PS1]          workspace

FP8 bytes are decoded with integer arithmetic (sign, 4-bit exponent, 3-bit mantissa; subnormals
``m * 2^-9``) rather than a cast: TVM's llvm fp8 cast is wrong, and the same code runs on both targets.
``make_tiered_decode(..., target="llvm")`` is the serial CPU form the tests run in CI.
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

from ...runtime.kv_quant import NF2_LEVELS

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


def _nf2_level(packed, d):
    code = (T.Cast("uint32", packed) >> T.Cast("uint32", (d % 4) * 2)) & T.uint32(3)
    lv = [float(x) for x in NF2_LEVELS]
    return T.if_then_else(code == T.uint32(0), T.float32(lv[0]), T.if_then_else(
        code == T.uint32(1), T.float32(lv[1]), T.if_then_else(code == T.uint32(2), T.float32(lv[2]), T.float32(lv[3]))))


def make_tiered_decode(num_heads: int, num_kv_heads: int, head_dim: int, t1_page: int = 16, t2_page: int = 128,
                       target: str = "llvm"):
    """The decode attention PrimFunc for one head configuration (``target``: "llvm")."""
    if target != "llvm":
        raise NotImplementedError("the CUDA schedule of the tiered decode kernel is not built yet")
    H, HKV, D, PS1, PS2 = num_heads, num_kv_heads, head_dim, t1_page, t2_page
    G = H // HKV
    D4 = D // 4

    @T.prim_func(s_tir=True)
    def tiered_decode(q_h: T.handle, t1k_h: T.handle, t1v_h: T.handle, t1ks_h: T.handle, t1vs_h: T.handle,
                      t2k_h: T.handle, t2v_h: T.handle, t2kmu_h: T.handle, t2ksig_h: T.handle, t2vmu_h: T.handle,
                      t2vsig_h: T.handle, t1tab_h: T.handle, t1len_h: T.handle, t2tab_h: T.handle, t2np_h: T.handle,
                      out_h: T.handle, mass_h: T.handle, scores_h: T.handle, layer: T.int32, sm_scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "tiered_decode"})
        NL, B, P1, P2, M1, M2 = T.int32(), T.int32(), T.int32(), T.int32(), T.int32(), T.int32()
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
        out = T.match_buffer(out_h, (B, H, D), "float32")
        t1_mass = T.match_buffer(mass_h, (NL, P1, HKV, PS1), "float32")
        scores = T.match_buffer(scores_h, (B, H, M1 * PS1), "float32")

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
                                    _nf2_level(t2_k[layer, page2, hk, j, d // 4], d)
                            s_val[0] = T.float32(0)
                            for d in T.serial(D):
                                s_val[0] += q[b, h, d] * kv[d]
                            s_val[0] = s_val[0] * sm_scale * T.float32(LOG2E)
                            new_m[0] = T.max(m_val[h], s_val[0])
                            l_val[h] = l_val[h] * T.exp2(m_val[h] - new_m[0]) + T.exp2(s_val[0] - new_m[0])
                            for d in T.serial(D):
                                acc[d] = acc[d] * T.exp2(m_val[h] - new_m[0]) + T.exp2(s_val[0] - new_m[0]) * (
                                    T.Cast("float32", t2_vmu[layer, page2, hk, j]) + T.Cast("float32", t2_vsig[layer, page2, hk, j]) *
                                    _nf2_level(t2_v[layer, page2, hk, j, d // 4], d))
                            m_val[h] = new_m[0]
                    for d in T.serial(D):
                        out[b, h, d] = T.if_then_else(l_val[h] > T.float32(0), acc[d] / l_val[h], T.float32(0))
                # importance: each tier-1 token's probability, summed over the query heads of its KV head
                for h in T.serial(H):
                    for i in T.serial(t1_len[b]):
                        t1_mass[layer, t1_table[b, i // PS1], h // G, i % PS1] += T.exp2(scores[b, h, i] - m_val[h]) / l_val[h]

    return tiered_decode


def make_tiered_decode_cuda(num_heads: int, num_kv_heads: int, head_dim: int, t1_page: int = 16, t2_page: int = 128):
    """CUDA form: one thread block per (sequence, KV head), ``head_dim`` threads.

    Scoring gives each thread one token of a chunk of ``head_dim`` tokens (it reads the token's whole
    FP8 row, or its packed 2-bit row, and dots it with q from shared memory); a block-wide max/sum
    updates the online softmax; accumulation gives each thread one output channel and walks the
    chunk's tokens, reading a row of V bytes that the block loads in one coalesced transaction. All
    query heads of the KV head are handled by the same block, so the importance sum over them needs
    no atomics.
    """
    H, HKV, D, PS1, PS2 = num_heads, num_kv_heads, head_dim, t1_page, t2_page
    G = H // HKV
    D4 = D // 4
    NT = D
    if NT & (NT - 1) or NT < 32 or PS2 % NT:
        raise ValueError(f"CUDA tiered decode needs a power-of-two head_dim >= 32 dividing the tier-2 page, got {D}, {PS2}")
    LOGNT = NT.bit_length() - 1
    NEG = -1e30

    @T.macro
    def online_update(tx, s_loc, red, m_loc, l_loc, p_sh, acc, tmp):
        # block-wide online-softmax step for one chunk of NT scores per query head; every thread
        # keeps the running max and sum in registers (they are block-wide reductions, equal in all)
        for g in T.serial(G):
            red[tx] = s_loc[g]
            T.tvm_storage_sync("shared")
            for r in T.serial(LOGNT):
                tmp[0] = T.max(red[tx], red[T.min(tx + T.shift_right(NT, r + 1), NT - 1)])
                T.tvm_storage_sync("shared")
                red[tx] = T.if_then_else(tx < T.shift_right(NT, r + 1), tmp[0], red[tx])
                T.tvm_storage_sync("shared")
            tmp[0] = T.max(m_loc[g], red[0])  # the new running max
            T.tvm_storage_sync("shared")
            p_sh[g, tx] = T.exp2(s_loc[g] - tmp[0])
            red[tx] = p_sh[g, tx]
            acc[g] = acc[g] * T.exp2(m_loc[g] - tmp[0])
            l_loc[g] = l_loc[g] * T.exp2(m_loc[g] - tmp[0])
            m_loc[g] = tmp[0]
            T.tvm_storage_sync("shared")
            for r in T.serial(LOGNT):
                tmp[0] = red[tx] + red[T.min(tx + T.shift_right(NT, r + 1), NT - 1)]
                T.tvm_storage_sync("shared")
                red[tx] = T.if_then_else(tx < T.shift_right(NT, r + 1), tmp[0], red[tx])
                T.tvm_storage_sync("shared")
            l_loc[g] = l_loc[g] + red[0]
            T.tvm_storage_sync("shared")

    @T.prim_func(s_tir=True)
    def tiered_decode(q_h: T.handle, t1k_h: T.handle, t1v_h: T.handle, t1ks_h: T.handle, t1vs_h: T.handle,
                      t2k_h: T.handle, t2v_h: T.handle, t2kmu_h: T.handle, t2ksig_h: T.handle, t2vmu_h: T.handle,
                      t2vsig_h: T.handle, t1tab_h: T.handle, t1len_h: T.handle, t2tab_h: T.handle, t2np_h: T.handle,
                      out_h: T.handle, mass_h: T.handle, scores_h: T.handle, layer: T.int32, sm_scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "tiered_decode"})
        NL, B, P1, P2, M1, M2 = T.int32(), T.int32(), T.int32(), T.int32(), T.int32(), T.int32()
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
        out = T.match_buffer(out_h, (B, H, D), "float32")
        t1_mass = T.match_buffer(mass_h, (NL, P1, HKV, PS1), "float32")
        scores = T.match_buffer(scores_h, (B, H, M1 * PS1), "float32")

        for b in T.thread_binding(B, thread="blockIdx.x"):
            for hk in T.thread_binding(HKV, thread="blockIdx.y"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    with T.sblock("attn"):
                        T.reads()
                        T.writes()
                        q_sh = T.sblock_alloc_buffer((G, D), "float32", scope="shared")
                        p_sh = T.sblock_alloc_buffer((G, NT), "float32", scope="shared")
                        red = T.sblock_alloc_buffer((NT,), "float32", scope="shared")
                        m_loc = T.sblock_alloc_buffer((G,), "float32", scope="local")
                        l_loc = T.sblock_alloc_buffer((G,), "float32", scope="local")
                        kmu_sh = T.sblock_alloc_buffer((D,), "float32", scope="shared")
                        ksig_sh = T.sblock_alloc_buffer((D,), "float32", scope="shared")
                        vmu_sh = T.sblock_alloc_buffer((NT,), "float32", scope="shared")
                        vsig_sh = T.sblock_alloc_buffer((NT,), "float32", scope="shared")
                        row_sh = T.sblock_alloc_buffer((NT,), "int32", scope="shared")
                        acc = T.sblock_alloc_buffer((G,), "float32", scope="local")
                        s_loc = T.sblock_alloc_buffer((G,), "float32", scope="local")
                        kd = T.sblock_alloc_buffer((D,), "float32", scope="local")
                        mtot = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        tmp = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        n1: T.let[T.int32] = t1_len[b]

                        for g in T.serial(G):
                            q_sh[g, tx] = q[b, hk * G + g, tx]
                            acc[g] = T.float32(0)
                            m_loc[g] = T.float32(NEG)
                            l_loc[g] = T.float32(0)
                        T.tvm_storage_sync("shared")

                        # ---- tier 1: chunks of NT FP8 tokens
                        for c in T.serial(T.ceildiv(n1, NT)):
                            i: T.let[T.int32] = c * NT + tx
                            page: T.let[T.int32] = T.if_then_else(i < n1, t1_table[b, T.min(i, n1 - 1) // PS1], 0)
                            slot: T.let[T.int32] = i % PS1
                            row_sh[tx] = page * PS1 + slot
                            for d in T.serial(D):
                                kd[d] = _fp8_to_f32(t1_k[layer, page, hk, slot, d])
                            for g in T.serial(G):
                                s_loc[g] = T.float32(0)
                                for d in T.serial(D):
                                    s_loc[g] += q_sh[g, d] * kd[d]
                                s_loc[g] = T.if_then_else(
                                    i < n1, s_loc[g] * T.Cast("float32", t1_ks[layer, page, hk, slot]) * sm_scale * T.float32(LOG2E),
                                    T.float32(NEG))
                                if i < n1:
                                    scores[b, hk * G + g, i] = s_loc[g]
                            online_update(tx, s_loc, red, m_loc, l_loc, p_sh, acc, tmp)
                            for j in T.serial(T.min(NT, n1 - c * NT)):
                                r: T.let[T.int32] = row_sh[j]
                                v: T.let[T.float32] = _fp8_to_f32(t1_v[layer, r // PS1, hk, r % PS1, tx]) * \
                                    T.Cast("float32", t1_vs[layer, r // PS1, hk, r % PS1])
                                for g in T.serial(G):
                                    acc[g] += p_sh[g, j] * v
                            T.tvm_storage_sync("shared")

                        # ---- tier 2: full 2-bit pages, chunks of NT tokens
                        for pi in T.serial(t2_np[b]):
                            page2: T.let[T.int32] = t2_table[b, pi]
                            kmu_sh[tx] = T.Cast("float32", t2_kmu[layer, page2, hk, tx])
                            ksig_sh[tx] = T.Cast("float32", t2_ksig[layer, page2, hk, tx])
                            T.tvm_storage_sync("shared")
                            for sc in T.serial(PS2 // NT):
                                j2: T.let[T.int32] = sc * NT + tx
                                for d in T.serial(D):
                                    kd[d] = kmu_sh[d] + ksig_sh[d] * _nf2_level(t2_k[layer, page2, hk, j2, d // 4], d)
                                for g in T.serial(G):
                                    s_loc[g] = T.float32(0)
                                    for d in T.serial(D):
                                        s_loc[g] += q_sh[g, d] * kd[d]
                                    s_loc[g] = s_loc[g] * sm_scale * T.float32(LOG2E)
                                vmu_sh[tx] = T.Cast("float32", t2_vmu[layer, page2, hk, j2])
                                vsig_sh[tx] = T.Cast("float32", t2_vsig[layer, page2, hk, j2])
                                online_update(tx, s_loc, red, m_loc, l_loc, p_sh, acc, tmp)
                                for j in T.serial(NT):
                                    v2: T.let[T.float32] = vmu_sh[j] + vsig_sh[j] * _nf2_level(t2_v[layer, page2, hk, sc * NT + j, tx // 4], tx)
                                    for g in T.serial(G):
                                        acc[g] += p_sh[g, j] * v2
                                T.tvm_storage_sync("shared")

                        for g in T.serial(G):
                            out[b, hk * G + g, tx] = T.if_then_else(l_loc[g] > T.float32(0), acc[g] / l_loc[g], T.float32(0))
                        # ---- importance of the tier-1 tokens, summed over this KV head's query heads
                        for c2 in T.serial(T.ceildiv(n1, NT)):
                            i2: T.let[T.int32] = T.min(c2 * NT + tx, n1 - 1)
                            mtot[0] = T.float32(0)
                            for g in T.serial(G):
                                mtot[0] += T.exp2(scores[b, hk * G + g, i2] - m_loc[g]) / l_loc[g]
                            if c2 * NT + tx < n1:
                                t1_mass[layer, t1_table[b, i2 // PS1], hk, i2 % PS1] += mtot[0]

    return tiered_decode

