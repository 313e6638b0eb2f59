"""Re-rank of the tiered KV cache (TIR): demote the least important tier-1 tokens into 2-bit pages.

Runs every N decode steps, once per layer, for the sequences whose plan (``runtime.kv_cache.
TieredPageTables.plan_rerank``) demotes ``demote[b]`` tokens (a multiple of the tier-2 page) and
keeps ``keep[b] = t1_len[b] - demote[b]``. For every sequence b and KV head:

1. score each tier-1 token: ``mass / (H(L) - H(pos))`` with ``H`` the harmonic number and L the
   sequence length, i.e. the attention it received over what uniform attention would have given it
   over the same queries; attention sinks (``pos < sink``) and the recent window
   (``pos >= L - recent``) score +inf;
2. rank the tokens by score (ties by slot): the ``demote[b]`` lowest are demoted. Ranking is by
   counting (each token counts the tokens below it), which a thread per token does in parallel;
   ``order[:, :, :M]`` lists the demoted slots in ascending slot order (for the compaction) and
   ``order[:, :, M:]`` in ascending position order (M = M1 * PS1);
3. quantize the demoted tokens, in position order, into the new tier-2 pages ``new_t2[b, :]``
   (keys: statistics per channel over the page, values per token; 2-bit codes on the uniform grid of ``kv_quant``). ``fit="moments"``
   takes mu and sigma as the mean and standard deviation; ``fit="lloyd"`` then refits them
   ``LLOYD_ITERS`` times by least squares to the levels of the current codes, as
   ``runtime.kv_quant.q2_quantize`` does (the squared-error-optimal affine fit; same format);
4. compact tier 1: the m-th kept token in slots ``>= keep`` moves into the m-th demoted slot, which
   is below ``keep`` (as many holes lie below ``keep`` as kept tokens above it; sources and
   destinations are disjoint, so the moves are independent).

The same TIR serves both targets: five launches a layer (scores, ranks, order, packing, compaction), each a
loop over "threads" bound to ``threadIdx.x`` on CUDA and serial on llvm. Launches talk through global
workspaces: ``score`` float32, ``rank``, ``order`` and ``posw`` (each slot's position) int32, each
[B, Hkv, M1 * PS1] (``order`` twice that).

Buffers (layout of ``moec.runtime.kv_cache``): the tier-1 pool (k, v, ks, vs, pos, mass), the tier-2
pool (k, v, kmu, ksig, vmu, vsig, pos), t1_table [B, M1], t1_len / length / demote [B] int32,
new_t2 [B, M2n] int32, and the workspaces.
"""

from __future__ import annotations

try:
    from tvm.script import tirx as T
except ImportError:  # runtime-only TVM (the GPU bench): WORKSPACES, workspaces and call_rerank still work
    T = None

from ...runtime.kv_quant import FITS, Q2_THRESHOLDS
from . import memoized
from .tiered_decode import _fp8_to_f32, q2_value

EULER_GAMMA = 0.5772156649015329


def harmonic(n):
    """H(n) ~ ln n + gamma + 1/(2n) - 1/(12 n^2) + 1/(120 n^4) (n >= 1; exact to 3e-3 at n = 1)."""
    return T.log(n) + T.float32(EULER_GAMMA) + T.float32(0.5) / n - T.float32(1.0 / 12) / (n * n) + \
        T.float32(1.0 / 120) / (n * n * n * n)


def harmonic_np(n):
    import numpy as np

    n = np.asarray(n, np.float32)
    return (np.log(n) + np.float32(EULER_GAMMA) + np.float32(0.5) / n - np.float32(1.0 / 12) / (n * n)
            + np.float32(1.0 / 120) / (n * n * n * n)).astype(np.float32)


def _q2_code(z):
    t0, t1, t2 = (float(x) for x in Q2_THRESHOLDS)
    return T.Cast("uint32", T.if_then_else(z < T.float32(t0), 0, T.if_then_else(z < T.float32(t1), 1, T.if_then_else(z < T.float32(t2), 2, 3))))


IMPORTANCE = ("mass", "keynorm", "random")
LLOYD_ITERS = 3  # kv_quant.q2_quantize's default


if T is not None:  # (the kernels need the compiler; the bench on the GPU machine imports the rest)

    @T.macro
    def _moments(out, i0, i1, n, s1, s2):
        """``out[i0]``, ``out[i1]`` = (mean, standard deviation) of ``n`` (float32) values from their sum ``s1`` and sum
        of squares ``s2``, each rounded to float16 (as stored), the deviation at least 2^-24."""
        out[i0] = T.Cast("float32", T.Cast("float16", s1 / n))
        out[i1] = T.Cast("float32", T.Cast("float16", T.max(T.sqrt(T.max(s2 / n - (s1 / n) * (s1 / n), T.float32(0))),
                                                             T.float32(2.0**-24))))

    @T.macro
    def _refit(out, i0, i1, n, sl, sll, sxl, sx):
        """One least-squares refit of (mu, sigma) = ``out[i0]``, ``out[i1]`` (float16-rounded float32) to the grid levels
        l of the current codes of ``n`` (float32) values x, from the sums of l, l^2, x l and x; kept where the levels
        do not vary."""
        lm: T.let[T.float32] = sl / n
        xm: T.let[T.float32] = sx / n
        var: T.let[T.float32] = sll / n - lm * lm
        if var > T.float32(1e-12):
            sg: T.let[T.float32] = T.max((sxl / n - xm * lm) / var, T.float32(2.0**-24))
            out[i0] = T.Cast("float32", T.Cast("float16", xm - sg * lm))
            out[i1] = T.Cast("float32", T.Cast("float16", sg))

    @T.macro
    def _lloyd(stat, acc, n, values):
        """Refit ``stat`` = (mu, sigma) of ``n`` values ``LLOYD_ITERS`` times (``_refit``). ``values(j)`` is the j-th
        value; ``acc[0]`` holds their sum. Uses ``acc[1:5]``."""
        for _ in T.serial(LLOYD_ITERS):
            acc[1] = T.float32(0)
            acc[2] = T.float32(0)
            acc[3] = T.float32(0)
            for j in T.serial(n):
                acc[4] = q2_value(_q2_code((values(j) - stat[0]) / stat[1]))
                acc[1] += acc[4]
                acc[2] += acc[4] * acc[4]
                acc[3] += values(j) * acc[4]
            _refit(stat, 0, 1, T.float32(n), acc[1], acc[2], acc[3], acc[0])


def _hash_score(p, layer, h):
    """A pseudo-random score in [0, 1) from (position, layer, head): the "random" importance baseline."""
    x = T.Cast("uint32", p) * T.uint32(2654435761) + T.Cast("uint32", layer) * T.uint32(40503) + T.Cast("uint32", h) * T.uint32(9973)
    x = (x ^ (x >> T.uint32(15))) * T.uint32(2246822519)
    x = x ^ (x >> T.uint32(13))
    return T.Cast("float32", x >> T.uint32(8)) * T.float32(2.0**-24)


PHASES = ("score", "rank", "order", "pack", "compact")
RERANK_KERNELS = tuple(f"tiered_rerank_{p}" for p in PHASES)  # the re-rank's launches a layer, in call order


@memoized
def make_tiered_rerank(num_kv_heads: int, head_dim: int, t1_page: int = 16, t2_page: int = 128, sink: int = 4,
                       recent: int = 64, target: str = "llvm", importance: str = "mass", fit: str = "moments",
                       threads: int = 512, stage_bytes: int = 40960) -> dict:
    """The re-rank's PrimFuncs for ``target`` "llvm" or "cuda", by name (``RERANK_KERNELS``, in call order).

    ``importance`` "mass" is the score above; "keynorm" is the squared L2 norm of the token's key as
    cached (FP8 code times scale): large keys dominate the logits of every query, and their 2-bit
    error with them; "random" is a hash of (position, layer, head), the same-budget random-choice
    baseline the quality table compares against. ``fit`` is the 2-bit statistics fit (step 3).

    The steps run as five launches with one signature, so that each gets the parallelism it can use:

    - ``tiered_rerank_score``, ``_rank``, ``_order`` (steps 1-2): a block per (sequence, KV head, ``threads``
      tier-1 slots) of ``threads`` threads (at least ``head_dim``), a thread per slot: its score (and position,
      into ``posw``), then its rank by counting the slots below it, then, for a demoted slot, its place in the
      two orders by counting. Ranking and ordering are quadratic in the tier-1 tokens, and after a 2048-token
      prefill chunk one sequence gives only as many (sequence, KV head) pairs as KV heads, so the slots are
      spread over blocks too; blocks past a row's tier-1 length exit. On CUDA the counted values (scores; ranks
      and positions) pass through shared memory ``threads`` at a time, each a broadcast read for the block.
    - ``tiered_rerank_pack`` (step 3): a block per (sequence, KV head, new tier-2 page), ``max(head_dim,
      t2_page)`` threads (at most 1024): a prefill chunk demotes a dozen pages a sequence, each packed by a
      block of its own instead of one after another. A block whose page index is past ``demote[b] / t2_page``
      exits. Each page's source rows (FP8 keys, then values) are staged in shared memory when they fit in
      ``stage_bytes`` (PS2 x (head_dim + 4) bytes and the rows' scales): the statistics' passes (moments, then
      the least-squares refits) and the codes read them there. A staged page takes 4 threads a statistics group
      (a key channel, a value token; up to 1024 threads), each summing every 4th member, the partial sums
      combined through shared memory after each pass, and its codes a (token, code byte) a thread: the H100
      spent 0.41 ms a layer packing a chunk's 13 pages with a thread a group summing all 128 members serially, 5
      passes each. Larger pages gather every element through the slot order and the page table from global
      memory once per pass.
    - ``tiered_rerank_compact`` (step 4): a block per (sequence, KV head). It runs after every page has read
      its source rows, since the kept tokens move into demoted slots. A moved token's key and value rows are
      copied 16 bytes an access, each row's loads all issued before its stores (the H100 took 2.9 ms for this
      launch at 128 sequences with byte-serial copies); the pack launch stages its rows 4 bytes a load, unrolled.

    Launches are ordered on the stream, which is the barrier between steps across blocks.
    """
    if fit not in FITS:
        raise ValueError(f"unknown 2-bit fit {fit!r}: expected one of {', '.join(FITS)}")
    lloyd = fit == "lloyd"
    if importance not in IMPORTANCE:
        raise ValueError(f"unknown importance {importance!r}: expected one of {', '.join(IMPORTANCE)}")
    rand, keynorm = importance == "random", importance == "keynorm"
    HKV, D, PS1, PS2, D4 = num_kv_heads, head_dim, t1_page, t2_page, head_dim // 4
    NT = max(int(threads), D)
    gpu = target == "cuda"
    if NT % 32 or NT > 1024:
        raise ValueError(f"re-rank threads must be a multiple of 32 up to 1024, got {NT}")
    if PS2 % D:
        raise ValueError(f"the tier-2 page ({PS2}) must be a multiple of head_dim ({D})")
    INF = 3.0e38
    RB = D + 4  # staged row stride in bytes: 4-byte words at an odd stride, so a thread per row hits distinct banks
    staged = PS2 * RB + 8 * PS2 + 8 * D <= stage_bytes
    SROWS = PS2 if staged else 1
    SCOPE = "shared" if gpu else "global"
    GW = max(D, PS2)  # groups of a page's statistics: D channels (keys) or PS2 tokens (values)
    # threads a group, each summing every SPL-th member: 4 where they divide both member counts and fit 1024 threads
    SPL = max(s for s in (4, 2, 1) if D % s == 0 and PS2 % s == 0 and s * GW <= 1024) if staged else 1
    NP = min(SPL * GW, 1024)  # the pack launch's threads

    def ngroups(kv):  # statistics groups of keys (kv 0: channels) or values (1: tokens)
        return T.if_then_else(kv == 0, D, PS2)

    def nmembers(kv):  # the members each group's statistics run over
        return T.if_then_else(kv == 0, PS2, D)
    CW = 16 if D % 16 == 0 else 4 if D % 4 == 0 else 1  # bytes a compaction copy moves at once (16: one 128-bit access)

    def build(phase):
        pack_phase, slot_phase = phase == "pack", phase in ("score", "rank", "order")
        NB = NP if pack_phase else NT

        def threads():
            return T.thread_binding(NB, thread="threadIdx.x") if gpu else T.serial(NB)

        def third(extent):  # the third grid axis: a new tier-2 page (pack) or NT tier-1 slots (score, rank, order)
            return T.thread_binding(extent, thread="blockIdx.z") if gpu else T.serial(extent)

        @T.prim_func(s_tir=True)
        def tiered_rerank(t1k_h: T.handle, t1v_h: T.handle, t1ks_h: T.handle, t1vs_h: T.handle, t1pos_h: T.handle,
                          mass_h: T.handle, t2k_h: T.handle, t2v_h: T.handle, t2kmu_h: T.handle, t2ksig_h: T.handle,
                          t2vmu_h: T.handle, t2vsig_h: T.handle, t2pos_h: T.handle, t1tab_h: T.handle, t1len_h: T.handle,
                          len_h: T.handle, dem_h: T.handle, new_h: T.handle, score_h: T.handle, rank_h: T.handle,
                          order_h: T.handle, posw_h: T.handle, layer: T.int32):
            T.func_attr({"tirx.is_scheduled": True})
            NL, B, P1, P2, M1, MN = T.int64(), T.int32(), T.int64(), T.int64(), T.int32(), T.int32()
            t1_k = T.match_buffer(t1k_h, (NL, P1, HKV, PS1, D), "uint8")
            t1_v = T.match_buffer(t1v_h, (NL, P1, HKV, PS1, D), "uint8")
            t1_ks = T.match_buffer(t1ks_h, (NL, P1, HKV, PS1), "float16")
            t1_vs = T.match_buffer(t1vs_h, (NL, P1, HKV, PS1), "float16")
            t1_pos = T.match_buffer(t1pos_h, (NL, P1, HKV, PS1), "int32")
            t1_mass = T.match_buffer(mass_h, (NL, P1, HKV, PS1), "float32")
            t2_k = T.match_buffer(t2k_h, (NL, P2, HKV, PS2, D4), "uint8")
            t2_v = T.match_buffer(t2v_h, (NL, P2, HKV, PS2, D4), "uint8")
            t2_kmu = T.match_buffer(t2kmu_h, (NL, P2, HKV, D), "float16")
            t2_ksig = T.match_buffer(t2ksig_h, (NL, P2, HKV, D), "float16")
            t2_vmu = T.match_buffer(t2vmu_h, (NL, P2, HKV, PS2), "float16")
            t2_vsig = T.match_buffer(t2vsig_h, (NL, P2, HKV, PS2), "float16")
            t2_pos = T.match_buffer(t2pos_h, (NL, P2, HKV, PS2), "int32")
            t1_table = T.match_buffer(t1tab_h, (B, M1), "int32")
            t1_len = T.match_buffer(t1len_h, (B,), "int32")
            length = T.match_buffer(len_h, (B,), "int32")
            demote = T.match_buffer(dem_h, (B,), "int32")
            new_t2 = T.match_buffer(new_h, (B, MN), "int32")
            score = T.match_buffer(score_h, (B, HKV, M1 * PS1), "float32")
            rank = T.match_buffer(rank_h, (B, HKV, M1 * PS1), "int32")
            order = T.match_buffer(order_h, (B, HKV, 2 * M1 * PS1), "int32")
            posw = T.match_buffer(posw_h, (B, HKV, M1 * PS1), "int32")

            for b in T.thread_binding(B, thread="blockIdx.x") if gpu else T.serial(B):
                for h in T.thread_binding(HKV, thread="blockIdx.y") if gpu else T.serial(HKV):
                    for pi in third(MN) if pack_phase else third(T.ceildiv(M1 * PS1, NT)) if slot_phase else T.serial(1):
                        with T.sblock("rerank"):
                            T.reads()
                            T.writes()
                            cnt = T.sblock_alloc_buffer((1,), "int32", scope="local")
                            n1: T.let[T.int32] = t1_len[b]
                            nd: T.let[T.int32] = demote[b]
                            keep: T.let[T.int32] = n1 - nd
                            if phase == "score":
                                # 1. scores (sinks and the recent window: +inf), and each slot's position
                                acc = T.sblock_alloc_buffer((2,), "float32", scope="local")
                                hl: T.let[T.float32] = harmonic(T.Cast("float32", length[b]))
                                for tx in threads():
                                    i: T.let[T.int32] = pi * NT + tx
                                    if i < n1:
                                        pg: T.let[T.int32] = t1_table[b, i // PS1]
                                        p: T.let[T.int32] = t1_pos[layer, pg, h, i % PS1]
                                        posw[b, h, i] = p
                                        if keynorm:
                                            acc[0] = T.float32(0)
                                            for d in T.serial(D):
                                                acc[1] = _fp8_to_f32(t1_k[layer, pg, h, i % PS1, d])
                                                acc[0] += acc[1] * acc[1]
                                        score[b, h, i] = T.if_then_else(
                                            (p < sink) | (p >= length[b] - recent), T.float32(INF),
                                            _hash_score(p, layer, h) if rand else
                                            acc[0] * T.Cast("float32", t1_ks[layer, pg, h, i % PS1]) * T.Cast(
                                                "float32", t1_ks[layer, pg, h, i % PS1]) if keynorm else
                                            t1_mass[layer, pg, h, i % PS1] / T.max(
                                                hl - harmonic(T.Cast("float32", p + 1)) + T.float32(1.0) / T.Cast("float32", p + 1),
                                                T.float32(1e-12)))
                            elif phase == "rank" and gpu:
                                # 2. rank by counting (ties by slot); the row's scores pass through shared memory NT at
                                # a time, each read by the whole block (a broadcast) instead of by every thread from L1
                                sc_sh = T.sblock_alloc_buffer((NT,), "float32", scope="shared")
                                for tx in threads():
                                    i: T.let[T.int32] = pi * NT + tx
                                    mine: T.let[T.float32] = score[b, h, T.min(i, T.max(n1 - 1, 0))]
                                    cnt[0] = 0
                                    for jc in T.serial(T.ceildiv(n1, NT)):
                                        T.tvm_storage_sync("shared")
                                        if jc * NT + tx < n1:
                                            sc_sh[tx] = score[b, h, jc * NT + tx]
                                        T.tvm_storage_sync("shared")
                                        if i < n1:
                                            for jj in T.serial(T.min(NT, n1 - jc * NT)):
                                                cnt[0] += T.Cast("int32", (sc_sh[jj] < mine) | ((sc_sh[jj] == mine) & (jc * NT + jj < i)))
                                    if i < n1:
                                        rank[b, h, i] = cnt[0]
                            elif phase == "rank":
                                for tx in threads():
                                    i: T.let[T.int32] = pi * NT + tx
                                    if i < n1:
                                        cnt[0] = 0
                                        for j in T.serial(n1):
                                            cnt[0] += T.Cast("int32", (score[b, h, j] < score[b, h, i]) |
                                                             ((score[b, h, j] == score[b, h, i]) & (j < i)))
                                        rank[b, h, i] = cnt[0]
                            elif phase == "order" and gpu:
                                # the demoted slots, ascending, then the same by position; ranks and positions staged
                                # NT at a time as for the ranks
                                rk_sh = T.sblock_alloc_buffer((NT,), "int32", scope="shared")
                                pw_sh = T.sblock_alloc_buffer((NT,), "int32", scope="shared")
                                cnt2 = T.sblock_alloc_buffer((1,), "int32", scope="local")
                                for tx in threads():
                                    i: T.let[T.int32] = pi * NT + tx
                                    dem: T.let[T.bool] = (i < n1) & (rank[b, h, T.min(i, T.max(n1 - 1, 0))] < nd)
                                    mypos: T.let[T.int32] = posw[b, h, T.min(i, T.max(n1 - 1, 0))]
                                    cnt[0] = 0
                                    cnt2[0] = 0
                                    for jc in T.serial(T.ceildiv(n1, NT)):
                                        T.tvm_storage_sync("shared")
                                        if jc * NT + tx < n1:
                                            rk_sh[tx] = rank[b, h, jc * NT + tx]
                                            pw_sh[tx] = posw[b, h, jc * NT + tx]
                                        T.tvm_storage_sync("shared")
                                        if dem:
                                            for jj in T.serial(T.min(NT, n1 - jc * NT)):
                                                cnt[0] += T.Cast("int32", (rk_sh[jj] < nd) & (jc * NT + jj < i))
                                                cnt2[0] += T.Cast("int32", (rk_sh[jj] < nd) & (pw_sh[jj] < mypos))
                                    if dem:
                                        order[b, h, cnt[0]] = i
                                        order[b, h, M1 * PS1 + cnt2[0]] = i
                            elif phase == "order":
                                for tx in threads():
                                    i: T.let[T.int32] = pi * NT + tx
                                    if i < n1:
                                        if rank[b, h, i] < nd:
                                            cnt[0] = 0
                                            for j in T.serial(i):
                                                cnt[0] += T.Cast("int32", rank[b, h, j] < nd)
                                            order[b, h, cnt[0]] = i
                                            cnt[0] = 0
                                            for j in T.serial(n1):
                                                cnt[0] += T.Cast("int32", (rank[b, h, j] < nd) & (posw[b, h, j] < posw[b, h, i]))
                                            order[b, h, M1 * PS1 + cnt[0]] = i
                            elif pack_phase:
                                # 3. new tier-2 page pi of sequence b: its tokens are order[M1 * PS1 + pi * PS2 + r]
                                acc = T.sblock_alloc_buffer((5,), "float32", scope="local")
                                stat = T.sblock_alloc_buffer((2,), "float32", scope="local")
                                row = T.sblock_alloc_buffer((D,), "float32", scope="local")
                                row_s = T.sblock_alloc_buffer((SROWS * RB,), "uint8", scope=SCOPE)  # the page's FP8 rows
                                loc_s = T.sblock_alloc_buffer((2 * SROWS,), "int32", scope=SCOPE)  # their tier-1 page, slot
                                sc_s = T.sblock_alloc_buffer((2 * SROWS,), "float32", scope=SCOPE)  # their key, value scales
                                st_s = T.sblock_alloc_buffer((2 * GW,), "float32", scope=SCOPE)  # mu, sigma per group
                                part_s = T.sblock_alloc_buffer((4 * SPL * GW,), "float32", scope=SCOPE)  # partial sums
                                if pi < nd // PS2:
                                    page: T.let[T.int32] = new_t2[b, pi]
                                    if staged:
                                        # the rows staged in shared memory (coalesced 4-byte loads; rows padded to RB
                                        # bytes, so a thread per token reads distinct banks): keys, then values
                                        for tx in threads():
                                            for rr in T.serial(T.ceildiv(PS2, NP)):
                                                r: T.let[T.int32] = rr * NP + tx
                                                if r < PS2:
                                                    src: T.let[T.int32] = order[b, h, M1 * PS1 + pi * PS2 + r]
                                                    pg: T.let[T.int32] = t1_table[b, src // PS1]
                                                    loc_s[r] = pg
                                                    loc_s[PS2 + r] = src % PS1
                                                    sc_s[r] = T.Cast("float32", t1_ks[layer, pg, h, src % PS1])
                                                    sc_s[PS2 + r] = T.Cast("float32", t1_vs[layer, pg, h, src % PS1])
                                                    t2_pos[layer, page, h, r] = t1_pos[layer, pg, h, src % PS1]
                                        for kv in T.unroll(2):  # 0: keys (statistics per channel over the tokens), 1: values (per token)
                                            if gpu:
                                                T.tvm_storage_sync("shared")
                                            for tx in threads():  # unrolled: each thread's 4-byte loads all in flight
                                                for it in T.unroll(T.ceildiv(PS2 * D4, NP)):
                                                    e: T.let[T.int32] = it * NP + tx
                                                    if e < PS2 * D4:
                                                        if kv == 0:
                                                            row_s[T.ramp((e // D4) * RB + (e % D4) * 4, 1, 4)] = t1_k[
                                                                layer, loc_s[e // D4], h, loc_s[PS2 + e // D4], T.ramp((e % D4) * 4, 1, 4)]
                                                        else:
                                                            row_s[T.ramp((e // D4) * RB + (e % D4) * 4, 1, 4)] = t1_v[
                                                                layer, loc_s[e // D4], h, loc_s[PS2 + e // D4], T.ramp((e % D4) * 4, 1, 4)]
                                            # statistics of NG groups (keys: channels; values: tokens) over NM members each, SPL threads a group, each
                                            # summing every SPL-th member; the partial sums meet in shared memory (moments, then each refit)
                                            for ps in T.serial(1 + LLOYD_ITERS if lloyd else 1):
                                                if gpu:
                                                    T.tvm_storage_sync("shared")
                                                for tx in threads():
                                                    if tx < SPL * ngroups(kv):
                                                        g: T.let[T.int32] = tx % ngroups(kv)
                                                        for a in T.unroll(4):
                                                            acc[a] = T.float32(0)
                                                        for mm in T.serial(nmembers(kv) // SPL):
                                                            m: T.let[T.int32] = mm * SPL + tx // ngroups(kv)
                                                            x: T.let[T.float32] = T.if_then_else(  # (kv is unrolled: one branch is left)
                                                                kv == 0, _fp8_to_f32(row_s[m * RB + g]) * sc_s[m], _fp8_to_f32(row_s[g * RB + m]) * sc_s[PS2 + g])
                                                            if ps == 0:
                                                                acc[0] += x
                                                                acc[1] += x * x
                                                            else:
                                                                acc[4] = q2_value(_q2_code((x - st_s[g]) / st_s[GW + g]))
                                                                acc[0] += acc[4]
                                                                acc[1] += acc[4] * acc[4]
                                                                acc[2] += x * acc[4]
                                                                acc[3] += x
                                                        for a in T.unroll(4):
                                                            part_s[(a * SPL + tx // ngroups(kv)) * GW + g] = acc[a]
                                                if gpu:
                                                    T.tvm_storage_sync("shared")
                                                for tx in threads():
                                                    if tx < ngroups(kv):
                                                        for a in T.unroll(4):
                                                            acc[a] = T.float32(0)
                                                            for q in T.unroll(SPL):
                                                                acc[a] += part_s[(a * SPL + q) * GW + tx]
                                                        nm: T.let[T.float32] = T.Cast("float32", nmembers(kv))
                                                        if ps == 0:
                                                            _moments(st_s, tx, GW + tx, nm, acc[0], acc[1])
                                                        else:  # a refit to the levels of the current codes
                                                            _refit(st_s, tx, GW + tx, nm, acc[0], acc[1], acc[2], acc[3])
                                            if gpu:
                                                T.tvm_storage_sync("shared")
                                            # the statistics out, then the codes: a (token, code byte) per thread
                                            for tx in threads():
                                                if tx < ngroups(kv):
                                                    if kv == 0:
                                                        t2_kmu[layer, page, h, tx] = T.Cast("float16", st_s[tx])
                                                        t2_ksig[layer, page, h, tx] = T.Cast("float16", st_s[GW + tx])
                                                    else:
                                                        t2_vmu[layer, page, h, tx] = T.Cast("float16", st_s[tx])
                                                        t2_vsig[layer, page, h, tx] = T.Cast("float16", st_s[GW + tx])
                                                for it in T.serial(T.ceildiv(PS2 * D4, NP)):
                                                    e: T.let[T.int32] = it * NP + tx
                                                    if e < PS2 * D4:
                                                        cnt[0] = 0
                                                        for c in T.unroll(4):
                                                            if kv == 0:
                                                                cnt[0] = cnt[0] | T.Cast("int32", _q2_code(
                                                                    (_fp8_to_f32(row_s[(e // D4) * RB + (e % D4) * 4 + c]) * sc_s[e // D4] - st_s[(e % D4) * 4 + c])
                                                                    / st_s[GW + (e % D4) * 4 + c]) << T.Cast("uint32", c * 2))
                                                            else:
                                                                cnt[0] = cnt[0] | T.Cast("int32", _q2_code(
                                                                    (_fp8_to_f32(row_s[(e // D4) * RB + (e % D4) * 4 + c]) * sc_s[PS2 + e // D4] - st_s[e // D4])
                                                                    / st_s[GW + e // D4]) << T.Cast("uint32", c * 2))
                                                        if kv == 0:
                                                            t2_k[layer, page, h, e // D4, e % D4] = T.Cast("uint8", cnt[0])
                                                        else:
                                                            t2_v[layer, page, h, e // D4, e % D4] = T.Cast("uint8", cnt[0])
                                    else:
                                        # the page too large to stage: key statistics a thread per channel, every element
                                        # gathered through the slot order and the page table
                                        for tx in threads():
                                            if tx < D:
                                                acc[0] = T.float32(0)
                                                acc[1] = T.float32(0)
                                                for r in T.serial(PS2):
                                                    src: T.let[T.int32] = order[b, h, M1 * PS1 + pi * PS2 + r]
                                                    x: T.let[T.float32] = _fp8_to_f32(t1_k[layer, t1_table[b, src // PS1], h, src % PS1, tx]) * \
                                                        T.Cast("float32", t1_ks[layer, t1_table[b, src // PS1], h, src % PS1])
                                                    acc[0] += x
                                                    acc[1] += x * x
                                                _moments(stat, 0, 1, T.float32(PS2), acc[0], acc[1])
                                                if lloyd:
                                                    _lloyd(stat, acc, PS2, lambda r: _fp8_to_f32(
                                                        t1_k[layer, t1_table[b, order[b, h, M1 * PS1 + pi * PS2 + r] // PS1], h,
                                                             order[b, h, M1 * PS1 + pi * PS2 + r] % PS1, tx]) * T.Cast("float32", t1_ks[
                                                                 layer, t1_table[b, order[b, h, M1 * PS1 + pi * PS2 + r] // PS1], h,
                                                                 order[b, h, M1 * PS1 + pi * PS2 + r] % PS1]))
                                                t2_kmu[layer, page, h, tx] = T.Cast("float16", stat[0])
                                                t2_ksig[layer, page, h, tx] = T.Cast("float16", stat[1])
                                        if gpu:
                                            T.tvm_storage_sync("shared")
                                        # codes: a token per thread (keys against the page statistics, values per token)
                                        for tx in threads():
                                            for rr in T.serial(T.ceildiv(PS2, NP)):
                                                r: T.let[T.int32] = rr * NP + tx
                                                if r < PS2:
                                                    src2: T.let[T.int32] = order[b, h, M1 * PS1 + pi * PS2 + r]
                                                    pg2: T.let[T.int32] = t1_table[b, src2 // PS1]
                                                    sl2: T.let[T.int32] = src2 % PS1
                                                    t2_pos[layer, page, h, r] = t1_pos[layer, pg2, h, sl2]
                                                    for cc in T.serial(D4):
                                                        cnt[0] = 0
                                                        for e in T.unroll(4):
                                                            cnt[0] = cnt[0] | T.Cast("int32", _q2_code(
                                                                (_fp8_to_f32(t1_k[layer, pg2, h, sl2, cc * 4 + e]) * T.Cast("float32", t1_ks[layer, pg2, h, sl2])
                                                                 - T.Cast("float32", t2_kmu[layer, page, h, cc * 4 + e])) /
                                                                T.Cast("float32", t2_ksig[layer, page, h, cc * 4 + e])) << T.Cast("uint32", e * 2))
                                                        t2_k[layer, page, h, r, cc] = T.Cast("uint8", cnt[0])
                                                    acc[0] = T.float32(0)
                                                    acc[1] = T.float32(0)
                                                    for d in T.serial(D):
                                                        row[d] = _fp8_to_f32(t1_v[layer, pg2, h, sl2, d]) * T.Cast("float32", t1_vs[layer, pg2, h, sl2])
                                                        acc[0] += row[d]
                                                        acc[1] += row[d] * row[d]
                                                    _moments(stat, 0, 1, T.float32(D), acc[0], acc[1])
                                                    if lloyd:
                                                        _lloyd(stat, acc, D, lambda d: row[d])
                                                    t2_vmu[layer, page, h, r] = T.Cast("float16", stat[0])
                                                    t2_vsig[layer, page, h, r] = T.Cast("float16", stat[1])
                                                    for cc in T.serial(D4):
                                                        cnt[0] = 0
                                                        for e in T.unroll(4):
                                                            cnt[0] = cnt[0] | T.Cast("int32", _q2_code((row[cc * 4 + e] - stat[0]) / stat[1])
                                                                                     << T.Cast("uint32", e * 2))
                                                        t2_v[layer, page, h, r, cc] = T.Cast("uint8", cnt[0])
                            else:
                                # 4. compaction: the m-th kept token at slot >= keep fills the m-th demoted slot (< keep)
                                kr = T.sblock_alloc_buffer((D,), "uint8", scope="local")  # a moved token's key (then value)
                                for tx in threads():
                                    for c in T.serial(T.ceildiv(nd, NT)):
                                        i: T.let[T.int32] = keep + c * NT + tx
                                        if i < n1:
                                            if rank[b, h, i] >= nd:
                                                cnt[0] = 0
                                                for j in T.serial(keep, i):
                                                    cnt[0] += T.Cast("int32", rank[b, h, j] >= nd)
                                                dst: T.let[T.int32] = order[b, h, cnt[0]]
                                                ps: T.let[T.int32] = t1_table[b, i // PS1]
                                                pd: T.let[T.int32] = t1_table[b, dst // PS1]
                                                # the key's bytes CW at a time, all loads then the stores; then the value's
                                                for d in T.unroll(D // CW):
                                                    kr[T.ramp(d * CW, 1, CW)] = t1_k[layer, ps, h, i % PS1, T.ramp(d * CW, 1, CW)]
                                                for d in T.unroll(D // CW):
                                                    t1_k[layer, pd, h, dst % PS1, T.ramp(d * CW, 1, CW)] = kr[T.ramp(d * CW, 1, CW)]
                                                for d in T.unroll(D // CW):
                                                    kr[T.ramp(d * CW, 1, CW)] = t1_v[layer, ps, h, i % PS1, T.ramp(d * CW, 1, CW)]
                                                for d in T.unroll(D // CW):
                                                    t1_v[layer, pd, h, dst % PS1, T.ramp(d * CW, 1, CW)] = kr[T.ramp(d * CW, 1, CW)]
                                                t1_ks[layer, pd, h, dst % PS1] = t1_ks[layer, ps, h, i % PS1]
                                                t1_vs[layer, pd, h, dst % PS1] = t1_vs[layer, ps, h, i % PS1]
                                                t1_pos[layer, pd, h, dst % PS1] = t1_pos[layer, ps, h, i % PS1]
                                                t1_mass[layer, pd, h, dst % PS1] = t1_mass[layer, ps, h, i % PS1]

        return tiered_rerank.with_attr("global_symbol", f"tiered_rerank_{phase}")

    return {f"tiered_rerank_{p}": build(p) for p in PHASES}


WORKSPACES = (("score", 1, "float32"), ("rank", 1, "int32"), ("order", 2, "int32"), ("posw", 1, "int32"))


def workspaces(rows: int, num_kv_heads: int, t1_slots: int):
    """The re-rank's workspaces as zeroed NumPy arrays ([rows, Hkv, f * t1_slots] each), in argument order."""
    import numpy as np

    return [np.zeros((rows, num_kv_heads, f * t1_slots), dt) for _, f, dt in WORKSPACES]


def call_rerank(lookup, args, layer, names=RERANK_KERNELS) -> None:
    """Run a compiled re-rank's launches (``names``, in call order) for one layer: ``lookup(name)`` gives each
    packed function."""
    for name in names:
        lookup(name)(*args, layer)
