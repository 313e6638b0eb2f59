"""Greedy sampling on the device (TIR): the argmax of each row of the logits, after the LM head.

``argmax_rows(logits[1, N, V], tokens[1, N] int32 | int64)``: for each of the N rows, the index of its
largest value, the first such index on ties (as ``numpy.argmax``). A decode step then copies N token
ids to the host instead of N x V logits, and no host work scales with the vocabulary.

CUDA: a block per row of ``THREADS`` threads; each thread scans a strided slice of the row (the
block's loads are coalesced; eight of a thread's loads are issued before they are compared, in order, so a block
has that many in flight: at a decode step's 128 rows, one block an SM, the loads' latency bounds the scan), then
the (value, index) pairs are reduced inside each warp with shuffles and across warps through shared memory. llvm: a serial scan per row (what CI runs).
NaN rows are not special-cased (a NaN never compares greater, so it is skipped).
"""

from __future__ import annotations

from tvm.script import tirx as T

from . import memoized

THREADS = 1024


@memoized
def make_argmax(vocab: int, dtype: str = "float32", target: str = "llvm", out_dtype: str = "int32", loads: int = 8):
    """The ``argmax_rows`` PrimFunc over rows of ``vocab`` values of ``dtype`` for ``target``, token ids of
    ``out_dtype`` ("int32" or "int64"); CUDA: ``loads`` of a thread issued before they are compared (1: one at a
    time, the form before 1375756, kept for bench/argmax.py)."""
    V = int(vocab)
    if V < 1:
        raise ValueError(f"argmax over an empty vocabulary ({V})")
    if out_dtype not in ("int32", "int64"):
        raise ValueError(f"argmax token ids are int32 or int64, not {out_dtype}")
    if target != "cuda":
        return _make_llvm(V, dtype, out_dtype)
    if not isinstance(loads, int) or not 1 <= loads <= 16:
        raise ValueError(f"argmax loads a thread in flight must be 1..16, not {loads!r}")
    NT = min(THREADS, max(32, 1 << (V - 1).bit_length()))
    return _make_cuda(V, dtype, NT, out_dtype, loads)


def _f32(v):
    return T.Cast("float32", v)


def _make_llvm(V: int, dtype: str, out_dtype: str):
    @T.prim_func(s_tir=True)
    def argmax_rows(x_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "argmax_rows"})
        N = T.int32()
        x = T.match_buffer(x_h, (1, N, V), dtype)
        out = T.match_buffer(out_h, (1, N), out_dtype)
        for r in T.serial(N):
            with T.sblock("argmax"):
                T.reads()
                T.writes()
                bv = T.sblock_alloc_buffer((1,), "float32", scope="local")
                bi = T.sblock_alloc_buffer((1,), "int32", scope="local")
                bv[0] = _f32(x[0, r, 0])
                bi[0] = 0
                for j in T.serial(1, V):
                    if _f32(x[0, r, j]) > bv[0]:
                        bv[0] = _f32(x[0, r, j])
                        bi[0] = j
                out[0, r] = T.Cast(out_dtype, bi[0])

    return argmax_rows


def _make_cuda(V: int, dtype: str, NT: int, out_dtype: str, loads: int):
    NW = NT // 32
    IT = -(-V // NT)
    UNROLL = min(loads, IT)  # a thread's loads issued together: one row a block (128 rows at the headline) needs them
    WR = max(1, (NW - 1).bit_length())  # shuffle rounds over the warps' partial results

    def shfl(v, o):
        return T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), v, o, 32, 32)

    @T.macro
    def take_better(bv, bi, ov, oi):
        if ov > bv[0] or (ov == bv[0] and oi < bi[0]):
            bv[0] = ov
            bi[0] = oi

    @T.prim_func(s_tir=True)
    def argmax_rows(x_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "argmax_rows"})
        N = T.int32()
        x = T.match_buffer(x_h, (1, N, V), dtype)
        out = T.match_buffer(out_h, (1, N), out_dtype)
        for r in T.thread_binding(N, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("argmax"):
                    T.reads()
                    T.writes()
                    sv = T.sblock_alloc_buffer((NW,), "float32", scope="shared")
                    si = T.sblock_alloc_buffer((NW,), "int32", scope="shared")
                    bv = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    bi = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    ov = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    oi = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    xv = T.sblock_alloc_buffer((UNROLL,), "float32", scope="local")
                    lane: T.let[T.int32] = tx % 32
                    warp: T.let[T.int32] = tx // 32
                    bv[0] = T.float32("-inf")
                    bi[0] = V  # no index yet: loses every tie against a real one
                    for i0 in T.serial((IT + UNROLL - 1) // UNROLL):  # UNROLL loads in flight, then compared in order
                        for u in T.unroll(UNROLL):
                            if (i0 * UNROLL + u) * NT + tx < V:
                                xv[u] = _f32(x[0, r, (i0 * UNROLL + u) * NT + tx])
                        for u in T.unroll(UNROLL):
                            if (i0 * UNROLL + u) * NT + tx < V:
                                if xv[u] > bv[0]:
                                    bv[0] = xv[u]
                                    bi[0] = (i0 * UNROLL + u) * NT + tx
                    for k in T.unroll(5):
                        ov[0] = shfl(bv[0], T.shift_right(16, k))
                        oi[0] = shfl(bi[0], T.shift_right(16, k))
                        take_better(bv, bi, ov[0], oi[0])
                    if lane == 0:
                        sv[warp] = bv[0]
                        si[warp] = bi[0]
                    T.tvm_storage_sync("shared")
                    if warp == 0:
                        if lane < NW:
                            bv[0] = sv[lane]
                            bi[0] = si[lane]
                        else:
                            bv[0] = T.float32("-inf")
                            bi[0] = V
                        for k in T.unroll(WR):
                            ov[0] = shfl(bv[0], T.shift_left(1, k))
                            oi[0] = shfl(bi[0], T.shift_left(1, k))
                            take_better(bv, bi, ov[0], oi[0])
                        if lane == 0:
                            out[0, r] = T.Cast(out_dtype, T.if_then_else(bi[0] < V, bi[0], 0))  # an all -inf / NaN row: token 0

    return argmax_rows
