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

from . import memoized
from .grouped_experts import _MMA_TYPE, _mma, _shfl
from .tiered_decode import LOG2E, _fp8_to_f32, _q2_level

MASS_CHUNK = 128


def _attention_signature(H: int, HKV: int, D: int, PS1: int, PS2: int, body):
    """``tiered_attention(q, <the ten pools read>, t1_table, t2_table, t2_np, q_row, q_t1, q_indptr, out, stats, layer,
    sm_scale)`` around a form's ``body`` macro, which takes the buffers in that order, then ``layer``, ``sm_scale``
    and the sizes N (queries), B (table rows), M1 and M2 (table widths)."""
    D4 = D // 4

    @T.prim_func(s_tir=True)
    def tiered_attention(q_h: T.handle, t1k_h: T.handle, t1v_h: T.handle, t1ks_h: T.handle, t1vs_h: T.handle,
                         t2k_h: T.handle, t2v_h: T.handle, t2kmu_h: T.handle, t2ksig_h: T.handle, t2vmu_h: T.handle,
                         t2vsig_h: T.handle, t1tab_h: T.handle, t2tab_h: T.handle, t2np_h: T.handle, qrow_h: T.handle,
                         qt1_h: T.handle, indptr_h: T.handle, out_h: T.handle, stats_h: T.handle, layer: T.int32,
                         sm_scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "tiered_attention"})
        NL, N, B, P1, P2, M1, M2 = T.int64(), T.int32(), T.int32(), T.int64(), T.int64(), T.int32(), T.int32()
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
        q_indptr = T.match_buffer(indptr_h, (B + 1,), "int32")
        out = T.match_buffer(out_h, (N, H, D), "float32")
        stats = T.match_buffer(stats_h, (N, H, 2), "float32")
        body(q, t1_k, t1_v, t1_ks, t1_vs, t2_k, t2_v, t2_kmu, t2_ksig, t2_vmu, t2_vsig, t1_table, t2_table, t2_np, q_row, q_t1,
             q_indptr, out, stats, layer, sm_scale, N, B, M1, M2)

    return tiered_attention


def _mass_signature(H: int, HKV: int, D: int, PS1: int, body):
    """``tiered_mass(q, t1_k, t1_ks, t1_table, q_t1, q_indptr, stats, t1_mass, layer, sm_scale)`` around a form's
    ``body`` macro, which takes them in that order, then the sizes N (queries), B1 (rows + 1) and M1."""

    @T.prim_func(s_tir=True)
    def tiered_mass(q_h: T.handle, t1k_h: T.handle, t1ks_h: T.handle, t1tab_h: T.handle, qt1_h: T.handle,
                    indptr_h: T.handle, stats_h: T.handle, mass_h: T.handle, layer: T.int32, sm_scale: T.float32):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "tiered_mass"})
        NL, N, B, B1, P1, M1 = T.int64(), T.int32(), T.int32(), T.int32(), T.int64(), T.int32()
        q = T.match_buffer(q_h, (N, H, D), "float32")
        t1_k = T.match_buffer(t1k_h, (NL, P1, HKV, PS1, D), "uint8")
        t1_ks = T.match_buffer(t1ks_h, (NL, P1, HKV, PS1), "float16")
        t1_table = T.match_buffer(t1tab_h, (B, M1), "int32")
        q_t1 = T.match_buffer(qt1_h, (N,), "int32")
        q_indptr = T.match_buffer(indptr_h, (B1,), "int32")
        stats = T.match_buffer(stats_h, (N, H, 2), "float32")
        t1_mass = T.match_buffer(mass_h, (NL, P1, HKV, PS1), "float32")
        body(q, t1_k, t1_ks, t1_table, q_t1, q_indptr, stats, t1_mass, layer, sm_scale, N, B1, M1)

    return tiered_mass


@memoized
def make_tiered_attention(num_heads: int, num_kv_heads: int, head_dim: int, t1_page: int = 16, t2_page: int = 128,
                          target: str = "llvm", mma_dtype: str | None = None, mma_warps: int | None = None,
                          mma_min_blocks: int = 0):
    """The attention PrimFunc (outputs ``out`` and ``stats``) for ``target`` "llvm" or "cuda". ``mma_dtype``
    ("bfloat16" or "float16", CUDA only): the tensor-core form with operands of that type (``mma_supported``), in
    blocks of ``mma_warps`` warps of 16 (query, head) rows (4 or 8; default ATTENTION_WARPS). A block dequantizes each key
    tile once for its rows: 8 warps halve that work per query and double the registers and rows in flight.
    ``mma_min_blocks`` > 0 declares launch bounds of that many blocks an SM (the 4-warp form takes 186 registers: 2
    blocks, 8 warps an SM; 3 blocks cap it at 168, which was slower on the H100)."""
    if target == "cuda":
        if mma_dtype is not None:
            return _attention_mma(num_heads, num_kv_heads, head_dim, t1_page, t2_page, mma_dtype, mma_warps or ATTENTION_WARPS,
                                  mma_min_blocks)
        return _attention_cuda(num_heads, num_kv_heads, head_dim, t1_page, t2_page)
    if mma_dtype is not None:
        raise ValueError("tiered attention: the tensor-core form is CUDA only")
    H, HKV, D, PS1, PS2 = num_heads, num_kv_heads, head_dim, t1_page, t2_page
    G, D4 = H // HKV, head_dim // 4

    @T.macro
    def body(q, t1_k, t1_v, t1_ks, t1_vs, t2_k, t2_v, t2_kmu, t2_ksig, t2_vmu, t2_vsig, t1_table, t2_table, t2_np, q_row, q_t1,
             q_indptr, out, stats, layer, sm_scale, N, B, M1, M2):

        for n in T.serial(N):
            for h in T.serial(H):
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
                                    "float32", t2_ksig[layer, page2, hk, d]) * _q2_level(t2_k[layer, page2, hk, j, d // 4], d))
                            ml[2] = ml[2] * sm_scale * T.float32(LOG2E)
                            new_m2: T.let[T.float32] = T.max(ml[0], ml[2])
                            alpha2: T.let[T.float32] = T.exp2(ml[0] - new_m2)
                            p2: T.let[T.float32] = T.exp2(ml[2] - new_m2)
                            ml[1] = ml[1] * alpha2 + p2
                            vmu: T.let[T.float32] = T.Cast("float32", t2_vmu[layer, page2, hk, j])
                            vsig: T.let[T.float32] = T.Cast("float32", t2_vsig[layer, page2, hk, j])
                            for d in T.serial(D):
                                acc[d] = acc[d] * alpha2 + p2 * (vmu + vsig * _q2_level(t2_v[layer, page2, hk, j, d // 4], d))
                            ml[0] = new_m2
                    for d in T.serial(D):
                        out[n, h, d] = T.if_then_else(ml[1] > T.float32(0), acc[d] / ml[1], T.float32(0))
                    stats[n, h, 0] = ml[0]
                    stats[n, h, 1] = ml[1]

    return _attention_signature(H, HKV, D, PS1, PS2, body)


@memoized
def make_tiered_mass(num_heads: int, num_kv_heads: int, head_dim: int, t1_page: int = 16, target: str = "llvm",
                     mma_dtype: str | None = None):
    """The importance (column-sum) PrimFunc for ``target`` "llvm" or "cuda" (``mma_dtype``: as ``make_tiered_attention``)."""
    if target == "cuda":
        if mma_dtype is not None:
            return _mass_mma(num_heads, num_kv_heads, head_dim, t1_page, mma_dtype)
        return _mass_cuda(num_heads, num_kv_heads, head_dim, t1_page)
    if mma_dtype is not None:
        raise ValueError("tiered mass: the tensor-core form is CUDA only")
    H, HKV, D, PS1, C = num_heads, num_kv_heads, head_dim, t1_page, MASS_CHUNK
    G = H // HKV

    @T.macro
    def body(q, t1_k, t1_ks, t1_table, q_t1, q_indptr, stats, t1_mass, layer, sm_scale, N, B1, M1):

        for b in T.serial(B1 - 1):
            for hk in T.serial(HKV):
                for c in T.serial(T.ceildiv(M1 * PS1, C)):
                    for tx in T.serial(C):
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

    return _mass_signature(H, HKV, D, PS1, body)


# ---------------------------------------------------------------------------- CUDA: tiled forms
#
# Attention: a block per (table row b, tile of QT consecutive queries of that row, query head h), DG threads
# per query, each owning D / DG dims in float4 groups (thread dg: groups dg, dg + DG, ...: the DG threads of a
# query read one contiguous 16 * DG bytes of a shared-memory row, the queries of a warp the same bytes).
# The row's keys stream through shared memory KT tokens at a time, dequantized once there for all QT
# queries: first its tier-2 pages, then its tier-1 tokens up to the tile's longest visible prefix. Scores
# are summed across the DG threads with shuffles; an online softmax per tile of keys.
#
# Mass: a block per (row b, tile of KT tier-1 tokens, KV head), DG threads per token holding the token's
# dequantized key in registers; the row's queries stream through shared memory QT at a time per query head
# of the KV head, with their (max, sum) statistics. Each token's thread group sums its probabilities; no
# atomics (each token is owned by one group).

QT, KT, DG = 32, 32, 4


def cuda_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> str | None:
    """Why the tiled CUDA forms cannot take these heads, or None."""
    if head_dim % (4 * DG):
        return f"head dim {head_dim} is not a multiple of {4 * DG}"
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads do not split into {num_kv_heads} KV heads"
    return None


def _check_cuda(num_heads, num_kv_heads, head_dim):
    why = cuda_supported(num_heads, num_kv_heads, head_dim)
    if why is not None:
        raise ValueError(f"tiered attention (CUDA): {why}")


def _attention_cuda(num_heads: int, num_kv_heads: int, head_dim: int, t1_page: int, t2_page: int):
    _check_cuda(num_heads, num_kv_heads, head_dim)
    H, HKV, D, PS1, PS2 = num_heads, num_kv_heads, head_dim, t1_page, t2_page
    G, D4 = H // HKV, head_dim // 4
    NT = QT * DG
    DPT = D // DG  # dims per thread
    NG = DPT // 4  # float4 groups per thread
    LD = KT * D // NT  # elements of a K (and of a V) tile each thread dequantizes
    T2T = -(-PS2 // KT)  # key tiles per tier-2 page
    RED = (DG - 1).bit_length()

    @T.macro
    def body(q, t1_k, t1_v, t1_ks, t1_vs, t2_k, t2_v, t2_kmu, t2_ksig, t2_vmu, t2_vsig, t1_table, t2_table, t2_np, q_row, q_t1,
             q_indptr, out, stats, layer, sm_scale, N, B, M1, M2):

        for b in T.thread_binding(B, thread="blockIdx.x"):
            for qt in T.thread_binding(T.ceildiv(N, QT), thread="blockIdx.y"):
                for h in T.thread_binding(H, thread="blockIdx.z"):
                    for tx in T.thread_binding(NT, thread="threadIdx.x"):
                        with T.sblock("attn"):
                            T.reads()
                            T.writes()
                            ks_s = T.sblock_alloc_buffer((KT, D), "float32", scope="shared")
                            vs_s = T.sblock_alloc_buffer((KT, D), "float32", scope="shared")
                            vis_s = T.sblock_alloc_buffer((QT,), "int32", scope="shared")
                            qr = T.sblock_alloc_buffer((DPT,), "float32", scope="local")
                            acc = T.sblock_alloc_buffer((DPT,), "float32", scope="local")
                            sc = T.sblock_alloc_buffer((KT,), "float32", scope="local")
                            kv4 = T.sblock_alloc_buffer((4,), "float32", scope="local")
                            ml = T.sblock_alloc_buffer((4,), "float32", scope="local")  # max, sum, tile max, tile sum
                            ext = T.sblock_alloc_buffer((1,), "int32", scope="local")  # the tile's longest tier-1 prefix
                            q0: T.let[T.int32] = q_indptr[b] + qt * QT
                            end: T.let[T.int32] = q_indptr[b + 1]
                            hk: T.let[T.int32] = h // G
                            qi: T.let[T.int32] = tx // DG
                            dg: T.let[T.int32] = tx % DG
                            n: T.let[T.int32] = T.min(q0 + qi, N - 1)
                            live: T.let[T.bool] = q0 + qi < end
                            if q0 < end:
                                if tx < QT:
                                    vis_s[tx] = T.if_then_else(q0 + tx < end, q_t1[T.min(q0 + tx, N - 1)], 0)
                                for g in T.unroll(NG):
                                    for v in T.vectorized(4):
                                        qr[g * 4 + v] = q[n, h, (dg + DG * g) * 4 + v] * sm_scale * T.float32(LOG2E)
                                for i in T.unroll(DPT):
                                    acc[i] = T.float32(0)
                                ml[0] = T.float32(-1e30)
                                ml[1] = T.float32(0)
                                T.tvm_storage_sync("shared")
                                ext[0] = 0
                                for i in T.serial(QT):
                                    ext[0] = T.max(ext[0], vis_s[i])
                                my_t1: T.let[T.int32] = T.if_then_else(live, q_t1[n], 0)
                                # tiles of keys: the row's tier-2 pages (every query sees all), then its tier-1 tokens
                                for kt in T.serial(t2_np[b] * T2T + T.ceildiv(ext[0], KT)):
                                    is2: T.let[T.bool] = kt < t2_np[b] * T2T
                                    j0: T.let[T.int32] = T.if_then_else(is2, (kt % T2T) * KT, (kt - t2_np[b] * T2T) * KT)
                                    pg2: T.let[T.int32] = t2_table[b, T.min(kt // T2T, M2 - 1)]
                                    T.tvm_storage_sync("shared")
                                    for r in T.serial(LD):
                                        e: T.let[T.int32] = r * NT + tx
                                        j: T.let[T.int32] = e // D
                                        d: T.let[T.int32] = e % D
                                        if is2:
                                            if j0 + j < PS2:
                                                ks_s[j, d] = T.Cast("float32", t2_kmu[layer, pg2, hk, d]) + T.Cast(
                                                    "float32", t2_ksig[layer, pg2, hk, d]) * _q2_level(t2_k[layer, pg2, hk, j0 + j, d // 4], d)
                                                vs_s[j, d] = T.Cast("float32", t2_vmu[layer, pg2, hk, j0 + j]) + T.Cast(
                                                    "float32", t2_vsig[layer, pg2, hk, j0 + j]) * _q2_level(t2_v[layer, pg2, hk, j0 + j, d // 4], d)
                                            else:
                                                ks_s[j, d] = T.float32(0)
                                                vs_s[j, d] = T.float32(0)
                                        else:
                                            tok: T.let[T.int32] = T.min(j0 + j, M1 * PS1 - 1)
                                            pg1: T.let[T.int32] = t1_table[b, tok // PS1]
                                            sl: T.let[T.int32] = tok % PS1
                                            ks_s[j, d] = _fp8_to_f32(t1_k[layer, pg1, hk, sl, d]) * T.Cast("float32", t1_ks[layer, pg1, hk, sl])
                                            vs_s[j, d] = _fp8_to_f32(t1_v[layer, pg1, hk, sl, d]) * T.Cast("float32", t1_vs[layer, pg1, hk, sl])
                                    T.tvm_storage_sync("shared")
                                    ml[2] = T.float32(-1e30)
                                    for j in T.unroll(KT):
                                        sc[j] = T.float32(0)
                                        for g in T.unroll(NG):
                                            for v in T.vectorized(4):
                                                kv4[v] = ks_s[j, (dg + DG * g) * 4 + v]
                                            for v in T.unroll(4):
                                                sc[j] = sc[j] + qr[g * 4 + v] * kv4[v]
                                        for rr in T.unroll(RED):
                                            sc[j] = sc[j] + _shfl(sc[j], T.shift_left(1, rr))
                                        ok: T.let[T.bool] = T.if_then_else(is2, j0 + j < PS2, j0 + j < my_t1)
                                        sc[j] = T.if_then_else(ok, sc[j], T.float32(-3e38))
                                        ml[2] = T.max(ml[2], sc[j])
                                    new_m: T.let[T.float32] = T.max(ml[0], ml[2])
                                    alpha: T.let[T.float32] = T.exp2(ml[0] - new_m)
                                    ml[1] = ml[1] * alpha
                                    for i in T.unroll(DPT):
                                        acc[i] = acc[i] * alpha
                                    for j in T.unroll(KT):
                                        p: T.let[T.float32] = T.if_then_else(sc[j] > T.float32(-1e38), T.exp2(sc[j] - new_m), T.float32(0))
                                        ml[1] = ml[1] + p
                                        for g in T.unroll(NG):
                                            for v in T.vectorized(4):
                                                kv4[v] = vs_s[j, (dg + DG * g) * 4 + v]
                                            for v in T.unroll(4):
                                                acc[g * 4 + v] = acc[g * 4 + v] + p * kv4[v]
                                    ml[0] = new_m
                                if live:
                                    for g in T.unroll(NG):
                                        for v in T.vectorized(4):
                                            out[n, h, (dg + DG * g) * 4 + v] = T.if_then_else(
                                                ml[1] > T.float32(0), acc[g * 4 + v] / ml[1], T.float32(0))
                                    if dg == 0:
                                        stats[n, h, 0] = ml[0]
                                        stats[n, h, 1] = ml[1]

    return _attention_signature(H, HKV, D, PS1, PS2, body)


def _mass_cuda(num_heads: int, num_kv_heads: int, head_dim: int, t1_page: int):
    _check_cuda(num_heads, num_kv_heads, head_dim)
    H, HKV, D, PS1 = num_heads, num_kv_heads, head_dim, t1_page
    G = H // HKV
    NT = KT * DG
    DPT = D // DG
    NG = DPT // 4
    LQ = QT * D // NT  # query elements each thread loads per tile
    RED = (DG - 1).bit_length()

    @T.macro
    def body(q, t1_k, t1_ks, t1_table, q_t1, q_indptr, stats, t1_mass, layer, sm_scale, N, B1, M1):

        for b in T.thread_binding(B1 - 1, thread="blockIdx.x"):
            for c in T.thread_binding(T.ceildiv(M1 * PS1, KT), thread="blockIdx.y"):
                for hk in T.thread_binding(HKV, thread="blockIdx.z"):
                    for tx in T.thread_binding(NT, thread="threadIdx.x"):
                        with T.sblock("mass"):
                            T.reads()
                            T.writes()
                            qs_s = T.sblock_alloc_buffer((QT, D), "float32", scope="shared")
                            st_s = T.sblock_alloc_buffer((QT, 2), "float32", scope="shared")
                            vis_s = T.sblock_alloc_buffer((QT,), "int32", scope="shared")
                            kr = T.sblock_alloc_buffer((DPT,), "float32", scope="local")
                            q4 = T.sblock_alloc_buffer((4,), "float32", scope="local")
                            acc = T.sblock_alloc_buffer((2,), "float32", scope="local")  # mass, score
                            q_lo: T.let[T.int32] = q_indptr[b]
                            q_hi: T.let[T.int32] = q_indptr[b + 1]
                            ext: T.let[T.int32] = T.if_then_else(q_hi > q_lo, q_t1[T.max(q_hi - 1, 0)], 0)
                            kj: T.let[T.int32] = tx // DG
                            dg: T.let[T.int32] = tx % DG
                            i: T.let[T.int32] = c * KT + kj
                            tok: T.let[T.int32] = T.min(i, M1 * PS1 - 1)
                            page: T.let[T.int32] = t1_table[b, tok // PS1]
                            slot: T.let[T.int32] = tok % PS1
                            if c * KT < ext:
                                kscale: T.let[T.float32] = T.Cast("float32", t1_ks[layer, page, hk, slot]) * sm_scale * T.float32(LOG2E)
                                for g in T.unroll(NG):
                                    for v in T.unroll(4):
                                        kr[g * 4 + v] = _fp8_to_f32(t1_k[layer, page, hk, slot, (dg + DG * g) * 4 + v]) * kscale
                                acc[0] = T.float32(0)
                                for gh in T.serial(G):
                                    for t in T.serial(T.ceildiv(q_hi - q_lo, QT)):
                                        T.tvm_storage_sync("shared")
                                        for r in T.serial(LQ):
                                            e: T.let[T.int32] = r * NT + tx
                                            qn: T.let[T.int32] = T.min(q_lo + t * QT + e // D, N - 1)
                                            qs_s[e // D, e % D] = q[qn, hk * G + gh, e % D]
                                        if tx < QT:
                                            qn2: T.let[T.int32] = q_lo + t * QT + tx
                                            vis_s[tx] = T.if_then_else(qn2 < q_hi, q_t1[T.min(qn2, N - 1)], 0)
                                            st_s[tx, 0] = stats[T.min(qn2, N - 1), hk * G + gh, 0]
                                            st_s[tx, 1] = stats[T.min(qn2, N - 1), hk * G + gh, 1]
                                        T.tvm_storage_sync("shared")
                                        for qj in T.unroll(QT):
                                            acc[1] = T.float32(0)
                                            for g in T.unroll(NG):
                                                for v in T.vectorized(4):
                                                    q4[v] = qs_s[qj, (dg + DG * g) * 4 + v]
                                                for v in T.unroll(4):
                                                    acc[1] = acc[1] + kr[g * 4 + v] * q4[v]
                                            for rr in T.unroll(RED):
                                                acc[1] = acc[1] + _shfl(acc[1], T.shift_left(1, rr))
                                            acc[1] = T.exp2(acc[1] - st_s[qj, 0]) / st_s[qj, 1]
                                            q4[0] = T.Cast("float32", vis_s[qj])  # the query's visible prefix (exact below 2^24)
                                            acc[0] = acc[0] + T.if_then_else(T.Cast("float32", i) < q4[0], acc[1], T.float32(0))
                                if dg == 0 and i < ext:
                                    t1_mass[layer, page, hk, slot] += acc[0]

    return _mass_signature(H, HKV, D, PS1, body)


# ---------------------------------------------------------------------------- CUDA: tensor-core forms
#
# The prefill of one 2048-token chunk spent most of its attention time in the tiled forms' float32 dot
# products (shared-memory bound: one shared load per multiply-add). These forms run the products on tensor
# cores (mma.sync m16n8k16, float32 accumulators) with 16-bit operands: the model's own activation dtype,
# bfloat16 or float16. Tier-1 codes widen to it exactly (e4m3 values are 16-bit floats); their per-token
# scales are applied in float32, to the scores (keys) and to the probabilities (values). Tier-2 entries are
# dequantized in float32 and rounded once to the 16-bit type; queries are rounded too (exact when the model
# computed them in that type). Probabilities enter the value product rounded to it, while the softmax
# sums, the statistics and the output stay float32.
#
# Attention: a block per (table row b, tile of MMA_ROWS / G consecutive queries of that row, KV head), 4 warps.
# The block's MMA_ROWS rows are (query, query head of the KV head) pairs, query-major, so a GQA model
# dequantizes each key once for its G heads. Warp w owns rows 16 w .. 16 w + 15 and keeps their query
# fragments in registers. Keys stream through shared memory MMA_KT at a time (tier-2 pages, then tier-1
# tokens up to the block's longest visible prefix), dequantized by the whole block; each warp computes its
# 16 x MMA_KT scores (S = Q K^T), masks them (tier-1 token j is visible to a query with j < q_t1), takes
# the online softmax in registers (row maxima across the 4 lanes of a row by shuffles), and adds P V with
# the score accumulators reused as the A operand (an m16n8 accumulator pair is an m16k16 operand).
# A tile's dequantization is unrolled, so each thread's loads (a tier-1 key's 4 codes and its value's in one
# 32-bit load each; a tier-2 group's 4 means and 4 deviations in one 8-byte load each) are all in flight at
# once: as a serial loop, the H100 profile of a 4080-token chunk put the kernel at about 20 TFLOP/s, each
# thread's 16 groups waiting on a dependent table lookup and byte loads in turn. The B fragments come from
# shared memory by ldmatrix: K's as stored (.x4: two k-steps of an n-tile a load), V's transposed (.x4.trans:
# two n-tiles of a k-step), where scalar 16-bit loads took four instructions a fragment; the padded rows keep
# the eight row addresses of each matrix on distinct banks.
#
# Mass: a block per (row b, tile of 128 tier-1 tokens, KV head), 8 warps; warp w owns 16 tokens and
# keeps their raw key fragments in registers. The row's (query, head) rows stream through shared memory
# MMA_ROWS at a time with their statistics; each warp computes the transposed scores (K Q^T), turns them
# into probabilities with each row's (max, sum) and sums them per token in registers. Tiles whose queries
# see none of the block's tokens are skipped. No atomics: a token is owned by one warp. The query rows are staged
# 4 elements per load, all of a thread's loads of a tile unrolled, and their fragments read by ldmatrix.

MMA_WARPS = 4
MMA_ROWS = 16 * MMA_WARPS  # (query, head) rows per block of the importance kernel's staged tiles
# the attention's blocks: 8 warps, 128 rows, so each key tile is dequantized once for twice the queries. On the H100
# (bench/results/tiered_prefill_h100_5611a6e.json, 2048-token chunks) against 4 warps: OLMoE 0.894 against 1.050 ms
# for a second chunk (tier 2 to widen), 0.322 against 0.270 for a first; Mixtral 1.514 against 1.861 and 0.468
# against 0.421. A prompt of two chunks or more gains (8% and 13% at 4080 tokens).
ATTENTION_WARPS = 8
MMA_KT = 64  # keys per shared-memory tile
# the importance kernel: 8 warps of 16 tokens, so each query row staged in shared memory serves 128 tokens (every
# block reads all of its row's queries: twice the tokens a block halves that traffic, 2 GB a layer at a 4080-token
# chunk with 64)
MASS_MMA_WARPS = 8
MASS_MMA_KT = 16 * MASS_MMA_WARPS
MMA_PAD = 8  # 16-bit elements of padding per shared row: the fragment loads hit 32 distinct banks


def mma_supported(num_heads: int, num_kv_heads: int, head_dim: int, dtype: str, warps: int = ATTENTION_WARPS) -> str | None:
    """Why the tensor-core forms (attention blocks of ``warps`` warps) cannot take these heads and operand dtype, or None."""
    if dtype not in _MMA_TYPE:
        return f"operand dtype {dtype} is not bfloat16 or float16"
    if head_dim % 16:
        return f"head dim {head_dim} is not a multiple of 16"
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads do not split into {num_kv_heads} KV heads"
    if warps not in (4, 8) or isinstance(warps, bool):
        return f"attention blocks of {warps!r} warps (4 or 8)"
    for rows in (16 * warps, MMA_ROWS):  # the attention's blocks, the importance kernel's staged tiles
        if rows % (num_heads // num_kv_heads):
            return f"{num_heads // num_kv_heads} query heads per KV head do not divide a block's {rows} rows"
    return None


def _check_mma(num_heads, num_kv_heads, head_dim, dtype, warps=ATTENTION_WARPS):
    why = mma_supported(num_heads, num_kv_heads, head_dim, dtype, warps)
    if why is not None:
        raise ValueError(f"tiered attention (tensor cores): {why}")


def _row_tile_mma(KS: int, RS: int, dtype: str, ab: str):
    """A macro: ``acc[nt * 4 ..]`` += A (fragments ``a``, KS k-steps of 16) times the transpose of the 8 shared-memory
    rows ``nt * 8 ..`` of ``smem`` (stride RS elements). The B fragments come by ldmatrix into ``b`` (8 elements):
    one .x4 for k-steps 2 k2 and 2 k2 + 1 (lanes 8 m .. 8 m + 7 address matrix m: rows nt * 8 + lane % 8, columns
    16 (2 k2 + m // 2) + 8 (m % 2)), and an .x2 for an odd last k-step (head dim 16 x odd)."""

    @T.macro
    def row_tile_mma(a, b, smem, nt, ln, acc):
        for k2 in T.unroll(KS // 2):
            T.evaluate(T.ptx_legacy.ldmatrix(False, 4, ".b16", b.data, 0, smem.data, (nt * 8 + ln % 8) * RS
                                             + (2 * k2 + ln // 16) * 16 + (ln // 8) % 2 * 8, dtype=dtype))
            T.evaluate(_mma(a, 2 * k2 * 8, b, 0, acc, nt * 4, ab))
            T.evaluate(_mma(a, (2 * k2 + 1) * 8, b, 4, acc, nt * 4, ab))
        if KS % 2 == 1:
            T.evaluate(T.ptx_legacy.ldmatrix(False, 2, ".b16", b.data, 0, smem.data, (nt * 8 + ln % 8) * RS
                                             + (KS - 1) * 16 + (ln // 8) % 2 * 8, dtype=dtype))
            T.evaluate(_mma(a, (KS - 1) * 8, b, 0, acc, nt * 4, ab))

    return row_tile_mma


def _attention_mma(num_heads: int, num_kv_heads: int, head_dim: int, t1_page: int, t2_page: int, dtype: str,
                   warps: int = ATTENTION_WARPS, min_blocks: int = 0):
    _check_mma(num_heads, num_kv_heads, head_dim, dtype, warps)
    if not isinstance(min_blocks, int) or isinstance(min_blocks, bool) or not 0 <= min_blocks <= 16:
        raise ValueError(f"tiered attention (tensor cores): min_blocks must be 0 (no bound) or 1..16 blocks an SM, got {min_blocks!r}")
    MINB = min_blocks
    H, HKV, D, PS1, PS2 = num_heads, num_kv_heads, head_dim, t1_page, t2_page
    G, D4, ab = H // HKV, head_dim // 4, _MMA_TYPE[dtype]
    NT, KTM, RS = 32 * warps, MMA_KT, head_dim + MMA_PAD
    QB = 16 * warps // G  # queries per block
    # a 4-element group dequantized as two 16-bit pairs and stored with one 8-byte access: FP8 pairs by the
    # prelude's exact conversions (bfloat16: integer spread and one fma.rn.bf16x2; float16: cvt.rn.f16x2.e4m3x2),
    # tier-2 levels computed in float32 and rounded in pairs
    from ..cuda_prelude import E4M3_BF_HI, E4M3_BF_LO, E4M3_HI, E4M3_LO, PACK_BF2, PACK_H2, ST_B32X2, register

    register()
    E_LO, E_HI, PACK = (E4M3_BF_LO, E4M3_BF_HI, PACK_BF2) if dtype == "bfloat16" else (E4M3_LO, E4M3_HI, PACK_H2)

    def pair(name, *args):
        return T.call_pure_extern("uint32", name, *args)

    def store4(smem, at, w):  # the group's two pairs w[0], w[1] at element ``at`` (a multiple of 4) of ``smem``
        return T.call_extern("void", ST_B32X2, T.address_of(smem[at]), w[0], w[1])
    KS, NS, PK, ND = D // 16, KTM // 8, KTM // 16, D // 8  # QK k-steps, score n-tiles, PV k-steps, output n-tiles
    LG = -(-KTM * D4 // NT)  # 4-element groups of a K (and of a V) tile each thread dequantizes
    T2T = -(-PS2 // KTM)  # key tiles per tier-2 page
    row_tile_mma = _row_tile_mma(KS, RS, dtype, ab)

    @T.macro
    def body(q, t1_k, t1_v, t1_ks, t1_vs, t2_k, t2_v, t2_kmu, t2_ksig, t2_vmu, t2_vsig, t1_table, t2_table, t2_np, q_row, q_t1,
             q_indptr, out, stats, layer, sm_scale, N, B, M1, M2):

        for b in T.thread_binding(B, thread="blockIdx.x"):
            for qt in T.thread_binding(T.ceildiv(N, QB), thread="blockIdx.y"):
                for hk in T.thread_binding(HKV, thread="blockIdx.z"):
                    for tx in T.thread_binding(NT, thread="threadIdx.x"):
                        with T.sblock("attn"):
                            T.reads()
                            T.writes()
                            k_s = T.sblock_alloc_buffer((KTM * RS,), dtype, scope="shared")  # [key][dim]
                            v_s = T.sblock_alloc_buffer((KTM * RS,), dtype, scope="shared")  # [key][dim]
                            sc_s = T.sblock_alloc_buffer((2 * KTM,), "float32", scope="shared")  # key, value scales
                            vis_s = T.sblock_alloc_buffer((QB,), "int32", scope="shared")
                            kq = T.sblock_alloc_buffer((2,), "uint32", scope="local")  # a group's key, value pairs
                            vq = T.sblock_alloc_buffer((2,), "uint32", scope="local")
                            lf = T.sblock_alloc_buffer((8,), "float32", scope="local")  # a tier-2 group's values
                            qa = T.sblock_alloc_buffer((KS * 8,), dtype, scope="local")  # A fragments of Q
                            kb = T.sblock_alloc_buffer((8,), dtype, scope="local")  # two B fragments of K^T
                            pa = T.sblock_alloc_buffer((8,), dtype, scope="local")  # an A fragment of P
                            vb = T.sblock_alloc_buffer((8,), dtype, scope="local")  # two B fragments of V
                            sacc = T.sblock_alloc_buffer((NS * 4,), "float32", scope="local")
                            oacc = T.sblock_alloc_buffer((ND * 4,), "float32", scope="local")
                            ml = T.sblock_alloc_buffer((6,), "float32", scope="local")  # max, sum (rows g, g + 8), tile max
                            al = T.sblock_alloc_buffer((2,), "float32", scope="local")
                            kh = T.sblock_alloc_buffer((LG * 8,), "float16", scope="local")  # tier-2 key mu, sigma per group
                            ext = T.sblock_alloc_buffer((1,), "int32", scope="local")
                            q0: T.let[T.int32] = q_indptr[b] + qt * QB
                            end: T.let[T.int32] = q_indptr[b + 1]
                            w: T.let[T.int32] = tx // 32
                            g: T.let[T.int32] = (tx % 32) // 4
                            qq: T.let[T.int32] = tx % 4
                            ln: T.let[T.int32] = tx % 32  # lane: with ldmatrix, lanes 8 m .. 8 m + 7 address matrix m's rows
                            if MINB > 0:  # __launch_bounds__(threads, MINB): registers capped for MINB blocks an SM
                                with T.attr(T.int32(0), "tirx.launch_bounds_min_blocks_per_sm", MINB):
                                    ext[0] = 0
                            if q0 < end:
                                if tx < QB:
                                    vis_s[tx] = T.if_then_else(q0 + tx < end, q_t1[T.min(q0 + tx, N - 1)], 0)
                                for ks in T.unroll(KS):  # a: row g + 8 ((a // 2) % 2), dim 16 ks + 2 qq + 8 (a // 4) + a % 2
                                    for a in T.unroll(8):
                                        qa[ks * 8 + a] = T.Cast(dtype, T.if_then_else(
                                            q0 + (w * 16 + g + 8 * ((a // 2) % 2)) // G < end,
                                            q[T.min(q0 + (w * 16 + g + 8 * ((a // 2) % 2)) // G, N - 1),
                                              hk * G + (w * 16 + g + 8 * ((a // 2) % 2)) % G, ks * 16 + 2 * qq + 8 * (a // 4) + a % 2],
                                            T.float32(0)))
                                for i in T.unroll(ND * 4):
                                    oacc[i] = T.float32(0)
                                ml[0] = T.float32(-1e30)
                                ml[1] = T.float32(-1e30)
                                ml[2] = T.float32(0)
                                ml[3] = T.float32(0)
                                T.tvm_storage_sync("shared")
                                ext[0] = 0
                                for i in T.unroll(QB):
                                    ext[0] = T.max(ext[0], vis_s[i])
                                vis0: T.let[T.int32] = vis_s[(w * 16 + g) // G]
                                vis1: T.let[T.int32] = vis_s[(w * 16 + g + 8) // G]
                                for kt in T.serial(t2_np[b] * T2T + T.ceildiv(ext[0], KTM)):
                                    is2: T.let[T.bool] = kt < t2_np[b] * T2T
                                    j0: T.let[T.int32] = T.if_then_else(is2, (kt % T2T) * KTM, (kt - t2_np[b] * T2T) * KTM)
                                    pg2: T.let[T.int32] = t2_table[b, T.min(kt // T2T, M2 - 1)]
                                    T.tvm_storage_sync("shared")
                                    for r in T.unroll(LG):  # group e: key e // D4, dims 4 (e % D4) .. + 3
                                        e: T.let[T.int32] = r * NT + tx
                                        j: T.let[T.int32] = e // D4
                                        c4: T.let[T.int32] = e % D4
                                        if j < KTM:
                                            if is2:
                                                if j0 + j < PS2:
                                                    kh[T.ramp(r * 8, 1, 4)] = t2_kmu[layer, pg2, hk, T.ramp(c4 * 4, 1, 4)]
                                                    kh[T.ramp(r * 8 + 4, 1, 4)] = t2_ksig[layer, pg2, hk, T.ramp(c4 * 4, 1, 4)]
                                                    for i in T.unroll(4):
                                                        lf[i] = T.Cast("float32", kh[r * 8 + i]) + T.Cast(
                                                            "float32", kh[r * 8 + 4 + i]) * _q2_level(t2_k[layer, pg2, hk, j0 + j, c4], i)
                                                        lf[4 + i] = T.Cast("float32", t2_vmu[layer, pg2, hk, j0 + j]) + T.Cast(
                                                            "float32", t2_vsig[layer, pg2, hk, j0 + j]) * _q2_level(
                                                            t2_v[layer, pg2, hk, j0 + j, c4], i)
                                                    for h2 in T.unroll(2):
                                                        kq[h2] = pair(PACK, lf[2 * h2], lf[2 * h2 + 1])
                                                        vq[h2] = pair(PACK, lf[4 + 2 * h2], lf[4 + 2 * h2 + 1])
                                                else:
                                                    for h2 in T.unroll(2):
                                                        kq[h2] = T.uint32(0)
                                                        vq[h2] = T.uint32(0)
                                                T.evaluate(store4(k_s, j * RS + c4 * 4, kq))
                                                T.evaluate(store4(v_s, j * RS + c4 * 4, vq))
                                                if c4 == 0:
                                                    sc_s[j] = sm_scale * T.float32(LOG2E)
                                                    sc_s[KTM + j] = T.float32(1)
                                            else:
                                                tok: T.let[T.int32] = T.min(j0 + j, M1 * PS1 - 1)
                                                pg1: T.let[T.int32] = t1_table[b, tok // PS1]
                                                sl: T.let[T.int32] = tok % PS1
                                                # a key's 4 codes and a value's in one 32-bit load each, widened in pairs
                                                wk: T.let[T.uint32] = T.reinterpret("uint32", t1_k[layer, pg1, hk, sl, T.ramp(c4 * 4, 1, 4)])
                                                wv: T.let[T.uint32] = T.reinterpret("uint32", t1_v[layer, pg1, hk, sl, T.ramp(c4 * 4, 1, 4)])
                                                kq[0] = pair(E_LO, wk)
                                                kq[1] = pair(E_HI, wk)
                                                vq[0] = pair(E_LO, wv)
                                                vq[1] = pair(E_HI, wv)
                                                T.evaluate(store4(k_s, j * RS + c4 * 4, kq))
                                                T.evaluate(store4(v_s, j * RS + c4 * 4, vq))
                                                if c4 == 0:
                                                    sc_s[j] = T.Cast("float32", t1_ks[layer, pg1, hk, sl]) * sm_scale * T.float32(LOG2E)
                                                    sc_s[KTM + j] = T.Cast("float32", t1_vs[layer, pg1, hk, sl])
                                    T.tvm_storage_sync("shared")
                                    # S = Q K^T: sacc[nt * 4 + c] is row g + 8 (c // 2), key nt * 8 + 2 qq + c % 2
                                    for i in T.unroll(NS * 4):
                                        sacc[i] = T.float32(0)
                                    for nt in T.unroll(NS):
                                        row_tile_mma(qa, kb, k_s, nt, ln, sacc)
                                    ml[4] = T.float32(-3e38)
                                    ml[5] = T.float32(-3e38)
                                    for nt in T.unroll(NS):
                                        for c in T.unroll(4):
                                            sacc[nt * 4 + c] = T.if_then_else(
                                                T.if_then_else(is2, j0 + nt * 8 + 2 * qq + c % 2 < PS2,
                                                               j0 + nt * 8 + 2 * qq + c % 2 < T.if_then_else(c < 2, vis0, vis1)),
                                                sacc[nt * 4 + c] * sc_s[nt * 8 + 2 * qq + c % 2], T.float32(-3e38))
                                            ml[4 + c // 2] = T.max(ml[4 + c // 2], sacc[nt * 4 + c])
                                    for rr in T.unroll(2):
                                        for hh in T.unroll(2):
                                            ml[4 + hh] = T.max(ml[4 + hh], _shfl(ml[4 + hh], T.shift_left(1, rr)))
                                    for hh in T.unroll(2):  # al[hh]: the rescale factor of row g + 8 hh
                                        ml[4 + hh] = T.max(ml[hh], ml[4 + hh])
                                        al[hh] = T.exp2(ml[hh] - ml[4 + hh])
                                        ml[2 + hh] = ml[2 + hh] * al[hh]
                                        ml[hh] = ml[4 + hh]
                                    for i in T.unroll(ND * 4):
                                        oacc[i] = oacc[i] * al[(i % 4) // 2]
                                    for s2 in T.unroll(PK):
                                        for a in T.unroll(8):  # a: score tile 2 s2 + a // 4, accumulator a % 4
                                            sacc[(2 * s2 + a // 4) * 4 + a % 4] = T.if_then_else(
                                                sacc[(2 * s2 + a // 4) * 4 + a % 4] > T.float32(-1e38),
                                                T.exp2(sacc[(2 * s2 + a // 4) * 4 + a % 4] - ml[(a % 4) // 2]), T.float32(0))
                                            ml[2 + (a % 4) // 2] = ml[2 + (a % 4) // 2] + sacc[(2 * s2 + a // 4) * 4 + a % 4]
                                            pa[a] = T.Cast(dtype, T.if_then_else(  # (a masked key's scale may be any bits)
                                                sacc[(2 * s2 + a // 4) * 4 + a % 4] > T.float32(0), sacc[(2 * s2 + a // 4) * 4 + a % 4] * sc_s[
                                                    KTM + s2 * 16 + 8 * (a // 4) + 2 * qq + a % 2], T.float32(0)))
                                        for d2 in T.unroll(ND // 2):  # one ldmatrix.x4.trans: the B fragments of dims 16 d2 .. + 15
                                            T.evaluate(T.ptx_legacy.ldmatrix(True, 4, ".b16", vb.data, 0, v_s.data, (s2 * 16 + (ln // 8) % 2 * 8
                                                                             + ln % 8) * RS + (2 * d2 + ln // 16) * 8, dtype=dtype))
                                            T.evaluate(_mma(pa, 0, vb, 0, oacc, 2 * d2 * 4, ab))
                                            T.evaluate(_mma(pa, 0, vb, 4, oacc, (2 * d2 + 1) * 4, ab))
                                for rr in T.unroll(2):
                                    for hh in T.unroll(2):
                                        ml[2 + hh] = ml[2 + hh] + _shfl(ml[2 + hh], T.shift_left(1, rr))
                                for hh in T.unroll(2):
                                    if q0 + (w * 16 + g + 8 * hh) // G < end:
                                        for dn in T.unroll(ND):
                                            for c in T.unroll(2):
                                                out[q0 + (w * 16 + g + 8 * hh) // G, hk * G + (w * 16 + g + 8 * hh) % G,
                                                    dn * 8 + 2 * qq + c] = T.if_then_else(
                                                    ml[2 + hh] > T.float32(0), oacc[dn * 4 + hh * 2 + c] / ml[2 + hh], T.float32(0))
                                        if qq == 0:
                                            stats[q0 + (w * 16 + g + 8 * hh) // G, hk * G + (w * 16 + g + 8 * hh) % G, 0] = ml[hh]
                                            stats[q0 + (w * 16 + g + 8 * hh) // G, hk * G + (w * 16 + g + 8 * hh) % G, 1] = ml[2 + hh]

    return _attention_signature(H, HKV, D, PS1, PS2, body)


def _mass_mma(num_heads: int, num_kv_heads: int, head_dim: int, t1_page: int, dtype: str):
    _check_mma(num_heads, num_kv_heads, head_dim, dtype)
    H, HKV, D, PS1 = num_heads, num_kv_heads, head_dim, t1_page
    G, ab = H // HKV, _MMA_TYPE[dtype]
    NT, KTM, RS, R = 32 * MASS_MMA_WARPS, MASS_MMA_KT, head_dim + MMA_PAD, MMA_ROWS
    QB = R // G  # queries per tile of rows
    KS, NS = D // 16, R // 8  # k-steps, n-tiles of rows
    row_tile_mma = _row_tile_mma(KS, RS, dtype, ab)
    D4 = D // 4
    LQ4 = -(-R * D4 // NT)  # 4-element query groups each thread stages per tile

    @T.macro
    def body(q, t1_k, t1_ks, t1_table, q_t1, q_indptr, stats, t1_mass, layer, sm_scale, N, B1, M1):

        for b in T.thread_binding(B1 - 1, thread="blockIdx.x"):
            for c in T.thread_binding(T.ceildiv(M1 * PS1, KTM), thread="blockIdx.y"):
                for hk in T.thread_binding(HKV, thread="blockIdx.z"):
                    for tx in T.thread_binding(NT, thread="threadIdx.x"):
                        with T.sblock("mass"):
                            T.reads()
                            T.writes()
                            q_s = T.sblock_alloc_buffer((R * RS,), dtype, scope="shared")  # [row][dim]
                            st_s = T.sblock_alloc_buffer((2 * R,), "float32", scope="shared")  # max, sum of each row
                            vis_s = T.sblock_alloc_buffer((R,), "int32", scope="shared")
                            ka = T.sblock_alloc_buffer((KS * 8,), dtype, scope="local")  # A fragments of the raw keys
                            qb = T.sblock_alloc_buffer((8,), dtype, scope="local")  # two B fragments of Q^T
                            sacc = T.sblock_alloc_buffer((NS * 4,), "float32", scope="local")
                            acc = T.sblock_alloc_buffer((2,), "float32", scope="local")  # mass of tokens g, g + 8
                            kscale = T.sblock_alloc_buffer((2,), "float32", scope="local")
                            ext = T.sblock_alloc_buffer((1,), "int32", scope="local")  # the tile's longest visible prefix
                            qv = T.sblock_alloc_buffer((LQ4 * 4,), "float32", scope="local")  # staged query elements
                            q_lo: T.let[T.int32] = q_indptr[b]
                            q_hi: T.let[T.int32] = q_indptr[b + 1]
                            last: T.let[T.int32] = T.if_then_else(q_hi > q_lo, q_t1[T.max(q_hi - 1, 0)], 0)
                            w: T.let[T.int32] = tx // 32
                            g: T.let[T.int32] = (tx % 32) // 4
                            qq: T.let[T.int32] = tx % 4
                            ln: T.let[T.int32] = tx % 32
                            i0: T.let[T.int32] = c * KTM + w * 16  # the warp's first token
                            if c * KTM < last:
                                for a in T.unroll(8):  # a: token i0 + g + 8 ((a // 2) % 2), dim 16 ks + 2 qq + 8 (a // 4) + a % 2
                                    for ks in T.unroll(KS):
                                        ka[ks * 8 + a] = T.Cast(dtype, _fp8_to_f32(t1_k[
                                            layer, t1_table[b, T.min(i0 + g + 8 * ((a // 2) % 2), M1 * PS1 - 1) // PS1], hk,
                                            (i0 + g + 8 * ((a // 2) % 2)) % PS1, ks * 16 + 2 * qq + 8 * (a // 4) + a % 2]))
                                for hh in T.unroll(2):
                                    kscale[hh] = T.Cast("float32", t1_ks[
                                        layer, t1_table[b, T.min(i0 + g + 8 * hh, M1 * PS1 - 1) // PS1], hk,
                                        (i0 + g + 8 * hh) % PS1]) * sm_scale * T.float32(LOG2E)
                                    acc[hh] = T.float32(0)
                                for t in T.serial(T.ceildiv((q_hi - q_lo) * G, R)):
                                    T.tvm_storage_sync("shared")
                                    for r in T.unroll(LQ4):  # 4 dims of a row per load, all of a thread's loads in flight
                                        e: T.let[T.int32] = r * NT + tx
                                        if e < R * D4:
                                            qn: T.let[T.int32] = T.min(q_lo + (t * R + e // D4) // G, N - 1)
                                            qv[T.ramp(r * 4, 1, 4)] = q[qn, hk * G + (t * R + e // D4) % G, T.ramp((e % D4) * 4, 1, 4)]
                                    for r in T.unroll(LQ4):
                                        e: T.let[T.int32] = r * NT + tx
                                        if e < R * D4:
                                            for i in T.unroll(4):
                                                q_s[(e // D4) * RS + (e % D4) * 4 + i] = T.Cast(dtype, qv[r * 4 + i])
                                    if tx < R:
                                        qn2: T.let[T.int32] = q_lo + (t * R + tx) // G
                                        vis_s[tx] = T.if_then_else(qn2 < q_hi, q_t1[T.min(qn2, N - 1)], 0)
                                        st_s[tx] = stats[T.min(qn2, N - 1), hk * G + (t * R + tx) % G, 0]
                                        st_s[R + tx] = stats[T.min(qn2, N - 1), hk * G + (t * R + tx) % G, 1]
                                    T.tvm_storage_sync("shared")
                                    ext[0] = 0
                                    for i in T.unroll(R):
                                        ext[0] = T.max(ext[0], vis_s[i])
                                    if c * KTM < ext[0]:  # some query of the tile sees a token of the block
                                        for i in T.unroll(NS * 4):
                                            sacc[i] = T.float32(0)
                                        for nt in T.unroll(NS):  # sacc[nt * 4 + cc]: token g + 8 (cc // 2), row nt * 8 + 2 qq + cc % 2
                                            row_tile_mma(ka, qb, q_s, nt, ln, sacc)
                                        for nt in T.unroll(NS):
                                            for cc in T.unroll(4):
                                                acc[cc // 2] = acc[cc // 2] + T.if_then_else(
                                                    (i0 + g + 8 * (cc // 2) < vis_s[nt * 8 + 2 * qq + cc % 2])
                                                    & (st_s[R + nt * 8 + 2 * qq + cc % 2] > T.float32(0)),
                                                    T.exp2(sacc[nt * 4 + cc] * kscale[cc // 2] - st_s[nt * 8 + 2 * qq + cc % 2])
                                                    / st_s[R + nt * 8 + 2 * qq + cc % 2], T.float32(0))
                                for rr in T.unroll(2):
                                    for hh in T.unroll(2):
                                        acc[hh] = acc[hh] + _shfl(acc[hh], T.shift_left(1, rr))
                                for hh in T.unroll(2):
                                    if (qq == 0) & (i0 + g + 8 * hh < last):
                                        t1_mass[layer, t1_table[b, (i0 + g + 8 * hh) // PS1], hk, (i0 + g + 8 * hh) % PS1] += acc[hh]

    return _mass_signature(H, HKV, D, PS1, body)
