"""Attention of ragged query tokens over the tiered KV cache (TIR): the prefill path, and decode in general form.

A forward of N query tokens (the tokens of several sequences laid out ragged, each already appended
to tier 1 by ``tiered_append``) attends over the cache of its own sequence: query n belongs to table
row ``q_row[n]`` and sees that row's tier-2 pages and the first ``q_t1[n]`` of its tier-1 tokens.
New tokens are appended at the end of tier 1 in position order, so for query j of a chunk that
prefix is exactly "everything cached before the chunk, plus chunk tokens 0..j": causal masking
without comparing positions. A decode step is the case of one query per row with ``q_t1 = t1_len``.

Two kernels, both for llvm (serial loops, what CI runs) and CUDA:

``tiered_attention``: for each query token and query head, an online softmax over the visible tokens
(FP8 tier 1 and 2-bit tier 2, dequantized in registers as in ``tiered_decode``) writes ``out[n, h]``
and the row statistics ``stats[n, h] = (max, sum)`` of its base-2 logits. CUDA: a block per query
token, a thread per query head.

``tiered_mass``: the importance update. Every visible tier-1 token gets the attention probability it
received from each query, summed over queries and over the query heads of its KV head (column sums
of the attention matrix), added to ``t1_mass``. It recomputes each score and normalises it with the
row statistics, so each token is owned by one thread and no atomics are needed. CUDA: a block per
(row, KV head, chunk of 128 tier-1 tokens), a thread per token; the queries of row b are the
contiguous range ``q_indptr[b] .. q_indptr[b + 1]``.

Buffers (layout of ``moec.runtime.kv_cache``, pools with a leading layer axis):
  q float32 [N, H, Dh]; out float32 [N, H, Dh]; stats float32 [N, H, 2]
  tier-1/tier-2 pools as in ``tiered_decode``; t1_table int32 [B, M1], t2_table [B, M2], t2_np [B]
  q_row, q_t1 int32 [N]; q_indptr int32 [B + 1]; t1_mass float32 [L, P1, Hkv, PS1]
"""

from __future__ import annotations

from tvm.script import tirx as T

from .tiered_decode import LOG2E, _fp8_to_f32, _nf2_level

MASS_CHUNK = 128


def make_tiered_attention(num_heads: int, num_kv_heads: int, head_dim: int, t1_page: int = 16, t2_page: int = 128,
                          target: str = "llvm"):
    """The attention PrimFunc (outputs ``out`` and ``stats``) for ``target`` "llvm" or "cuda"."""
    H, HKV, D, PS1, PS2 = num_heads, num_kv_heads, head_dim, t1_page, t2_page
    G, D4 = H // HKV, head_dim // 4
    gpu = target == "cuda"

    @T.prim_func(s_tir=True)
    def tiered_attention(q_h: T.handle, t1k_h: T.handle, t1v_h: T.handle, t1ks_h: T.handle, t1vs_h: T.handle,
                         t2k_h: T.handle, t2v_h: T.handle, t2kmu_h: T.handle, t2ksig_h: T.handle, t2vmu_h: T.handle,
                         t2vsig_h: T.handle, t1tab_h: T.handle, t2tab_h: T.handle, t2np_h: T.handle, qrow_h: T.handle,
                         qt1_h: T.handle, out_h: T.handle, stats_h: T.handle, layer: T.int32, sm_scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "tiered_attention"})
        NL, N, B, P1, P2, M1, M2 = T.int32(), T.int32(), T.int32(), T.int32(), T.int32(), T.int32(), T.int32()
        q = T.match_buffer(q_h, (N, H, D), "float32")
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
        t2_table = T.match_buffer(t2tab_h, (B, M2), "int32")
        t2_np = T.match_buffer(t2np_h, (B,), "int32")
        q_row = T.match_buffer(qrow_h, (N,), "int32")
        q_t1 = T.match_buffer(qt1_h, (N,), "int32")
        out = T.match_buffer(out_h, (N, H, D), "float32")
        stats = T.match_buffer(stats_h, (N, H, 2), "float32")

        for n in T.thread_binding(N, thread="blockIdx.x") if gpu else T.serial(N):
            for h in T.thread_binding(H, thread="threadIdx.x") if gpu else T.serial(H):
                with T.sblock("attn"):
                    T.reads()
                    T.writes()
                    acc = T.sblock_alloc_buffer((D,), "float32", scope="local")
                    ml = T.sblock_alloc_buffer((3,), "float32", scope="local")  # running max, sum, score
                    b: T.let[T.int32] = q_row[n]
                    hk: T.let[T.int32] = h // G
                    ml[0] = T.float32(-1e30)
                    ml[1] = T.float32(0)
                    for d in T.serial(D):
                        acc[d] = T.float32(0)
                    for i in T.serial(q_t1[n]):
                        page: T.let[T.int32] = t1_table[b, i // PS1]
                        slot: T.let[T.int32] = i % PS1
                        ml[2] = T.float32(0)
                        for d in T.serial(D):
                            ml[2] += q[n, h, d] * _fp8_to_f32(t1_k[layer, page, hk, slot, d])
                        ml[2] = ml[2] * T.Cast("float32", t1_ks[layer, page, hk, slot]) * sm_scale * T.float32(LOG2E)
                        new_m: T.let[T.float32] = T.max(ml[0], ml[2])
                        alpha: T.let[T.float32] = T.exp2(ml[0] - new_m)
                        p: T.let[T.float32] = T.exp2(ml[2] - new_m)
                        ml[1] = ml[1] * alpha + p
                        vs: T.let[T.float32] = T.Cast("float32", t1_vs[layer, page, hk, slot])
                        for d in T.serial(D):
                            acc[d] = acc[d] * alpha + p * (_fp8_to_f32(t1_v[layer, page, hk, slot, d]) * vs)
                        ml[0] = new_m
                    for pi in T.serial(t2_np[b]):
                        page2: T.let[T.int32] = t2_table[b, pi]
                        for j in T.serial(PS2):
                            ml[2] = T.float32(0)
                            for d in T.serial(D):
                                ml[2] += q[n, h, d] * (T.Cast("float32", t2_kmu[layer, page2, hk, d]) + T.Cast(
                                    "float32", t2_ksig[layer, page2, hk, d]) * _nf2_level(t2_k[layer, page2, hk, j, d // 4], d))
                            ml[2] = ml[2] * sm_scale * T.float32(LOG2E)
                            new_m2: T.let[T.float32] = T.max(ml[0], ml[2])
                            alpha2: T.let[T.float32] = T.exp2(ml[0] - new_m2)
                            p2: T.let[T.float32] = T.exp2(ml[2] - new_m2)
                            ml[1] = ml[1] * alpha2 + p2
                            vmu: T.let[T.float32] = T.Cast("float32", t2_vmu[layer, page2, hk, j])
                            vsig: T.let[T.float32] = T.Cast("float32", t2_vsig[layer, page2, hk, j])
                            for d in T.serial(D):
                                acc[d] = acc[d] * alpha2 + p2 * (vmu + vsig * _nf2_level(t2_v[layer, page2, hk, j, d // 4], d))
                            ml[0] = new_m2
                    for d in T.serial(D):
                        out[n, h, d] = T.if_then_else(ml[1] > T.float32(0), acc[d] / ml[1], T.float32(0))
                    stats[n, h, 0] = ml[0]
                    stats[n, h, 1] = ml[1]

    return tiered_attention


def make_tiered_mass(num_heads: int, num_kv_heads: int, head_dim: int, t1_page: int = 16, target: str = "llvm"):
    """The importance (column-sum) PrimFunc for ``target`` "llvm" or "cuda"."""
    H, HKV, D, PS1, C = num_heads, num_kv_heads, head_dim, t1_page, MASS_CHUNK
    G = H // HKV
    gpu = target == "cuda"

    @T.prim_func(s_tir=True)
    def tiered_mass(q_h: T.handle, t1k_h: T.handle, t1ks_h: T.handle, t1tab_h: T.handle, qt1_h: T.handle,
                    indptr_h: T.handle, stats_h: T.handle, mass_h: T.handle, layer: T.int32, sm_scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "tiered_mass"})
        NL, N, B, B1, P1, M1 = T.int32(), T.int32(), T.int32(), T.int32(), T.int32(), T.int32()
        q = T.match_buffer(q_h, (N, H, D), "float32")
        t1_k = T.match_buffer(t1k_h, (NL, P1, HKV, PS1, D), "uint8")
        t1_ks = T.match_buffer(t1ks_h, (NL, P1, HKV, PS1), "float16")
        t1_table = T.match_buffer(t1tab_h, (B, M1), "int32")
        q_t1 = T.match_buffer(qt1_h, (N,), "int32")
        q_indptr = T.match_buffer(indptr_h, (B1,), "int32")
        stats = T.match_buffer(stats_h, (N, H, 2), "float32")
        t1_mass = T.match_buffer(mass_h, (NL, P1, HKV, PS1), "float32")

        for b in T.thread_binding(B1 - 1, thread="blockIdx.x") if gpu else T.serial(B1 - 1):
            for hk in T.thread_binding(HKV, thread="blockIdx.y") if gpu else T.serial(HKV):
                for c in T.thread_binding(T.ceildiv(M1 * PS1, C), thread="blockIdx.z") if gpu else T.serial(T.ceildiv(M1 * PS1, C)):
                    for tx in T.thread_binding(C, thread="threadIdx.x") if gpu else T.serial(C):
                        with T.sblock("mass"):
                            T.reads()
                            T.writes()
                            acc = T.sblock_alloc_buffer((2,), "float32", scope="local")  # mass, score
                            i: T.let[T.int32] = c * C + tx
                            page: T.let[T.int32] = t1_table[b, T.min(i, M1 * PS1 - 1) // PS1]
                            slot: T.let[T.int32] = i % PS1
                            acc[0] = T.float32(0)
                            for n in T.serial(q_indptr[b], q_indptr[b + 1]):
                                if i < q_t1[n]:
                                    for g in T.serial(G):
                                        acc[1] = T.float32(0)
                                        for d in T.serial(D):
                                            acc[1] += q[n, hk * G + g, d] * _fp8_to_f32(t1_k[layer, page, hk, slot, d])
                                        acc[1] = acc[1] * T.Cast("float32", t1_ks[layer, page, hk, slot]) * sm_scale * T.float32(LOG2E)
                                        acc[0] += T.exp2(acc[1] - stats[n, hk * G + g, 0]) / stats[n, hk * G + g, 1]
                            if (q_indptr[b + 1] > q_indptr[b]) & (i < q_t1[T.max(q_indptr[b + 1] - 1, 0)]):
                                t1_mass[layer, page, hk, slot] += acc[0]

    return tiered_mass
