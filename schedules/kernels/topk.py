"""A warp's top-k over one row (TIR macro): the selection of the top-k kernels' CUDA form and of ``norm_router``'s top-k.

Lane l holds entries l, l + 32, ... of the row (``vals`` [C], float32, sign-adjusted so that larger is better, -3e38
past the row's n entries). With ``softmax`` the row's max and sum of exponentials are reduced first (xor shuffles).
Then k passes: each lane offers its best entry not yet taken (the lower index first), the warp reduces (value,
index) by xor shuffles, the larger value winning and on a tie the lower index (as a stable sort would), lane 0
writes the winner (its index, and its value or softmax probability ``exp(v - max) / sum``), and the owning lane marks
it taken (a bit per held entry).
"""

from __future__ import annotations

try:
    from tvm.script import tirx as T
except ImportError:  # runtime-only TVM
    T = None

NEG = -3.0e38


def warp_select(n: int, k: int, index_dtype: str, values_dtype: str | None, softmax: bool, largest: bool = True):
    """The macro ``select(vals, taken, stat, bv, bi, ov, oi, lane, idx, val, r)``: row ``r`` of ``idx`` [R, k] (and
    ``val`` [R, k] unless ``values_dtype`` is None) from the warp's ``vals`` [ceil(n / 32)] float32 registers; ``taken``
    [1] int32, ``stat`` [2] float32, ``bv`` / ``ov`` [1] float32 and ``bi`` / ``oi`` [1] int32 are the lane's scratch."""
    C = -(-n // 32)
    if C > 31:
        raise ValueError(f"topk over {n} entries: the warp form holds at most 992 per row")
    sign = T.float32(1.0 if largest else -1.0)

    def shfl(v, o):
        return T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), v, o, 32, 32)

    @T.macro
    def select(vals, taken, stat, bv, bi, ov, oi, lane, idx, val, r):
        if softmax:
            stat[0] = T.float32(NEG)
            for c in T.unroll(C):
                stat[0] = T.max(stat[0], vals[c])
            for o in T.unroll(5):
                stat[0] = T.max(stat[0], shfl(stat[0], 16 >> o))
            stat[1] = T.float32(0)
            for c in T.unroll(C):
                if c * 32 + lane < n:
                    stat[1] = stat[1] + T.exp(vals[c] - stat[0])
            for o in T.unroll(5):
                stat[1] = stat[1] + shfl(stat[1], 16 >> o)
        taken[0] = 0
        for p in T.serial(k):
            bv[0] = T.float32(NEG)
            bi[0] = n
            for c in T.unroll(C):  # the lane's best untaken entry (lower index first)
                if c * 32 + lane < n and (taken[0] >> c) & 1 == 0:
                    if bi[0] == n or vals[c] > bv[0]:
                        bv[0] = vals[c]
                        bi[0] = c * 32 + lane
            for o in T.unroll(5):
                ov[0] = shfl(bv[0], 16 >> o)
                oi[0] = shfl(bi[0], 16 >> o)
                if oi[0] < n and (bi[0] == n or ov[0] > bv[0] or (ov[0] == bv[0] and oi[0] < bi[0])):
                    bv[0] = ov[0]
                    bi[0] = oi[0]
            if lane == 0:
                idx[r, p] = T.Cast(index_dtype, bi[0])
                if values_dtype is not None:
                    if softmax:
                        val[r, p] = T.Cast(values_dtype, T.exp(bv[0] - stat[0]) / stat[1])
                    else:
                        val[r, p] = T.Cast(values_dtype, bv[0] * sign)
            if bi[0] % 32 == lane:
                taken[0] = taken[0] | (1 << (bi[0] // 32))

    return select


__all__ = ["NEG", "warp_select"]
