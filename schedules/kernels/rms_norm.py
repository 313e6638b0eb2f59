"""RMSNorm in one kernel (TIR): ``y = w * (x * rsqrt(mean(x^2) + eps))`` over the last axis.

For each of N rows (legend: N rows, D the normalised axis)::

    r    = rsqrt(sum_d x[n, d]^2 / D + eps)                  # float32
    y[n] = cast(y_dtype, w * (x[n] * r))                     # N, D

Everything is computed in float32 and rounded once. Exported RMSNorms leave three kernels after
TVM's operator fusion (the upcast, the square, and the mean with the rest: the upcast input feeds both
the reduction and the final multiply, so it fuses into neither), each a pass over the row in float32;
this is one pass over the row in its own dtype. The unfused graph may round ``x * r`` to the input
dtype before multiplying by ``w`` (HF's ``w * h.to(dtype)``), so results equal it up to one rounding.

Buffers: x [N, D] (x_dtype), w [D] (weight_dtype), then the output y [N, D] (y_dtype). N is dynamic. With
``residual`` (the add before the norm in the residual stream): a, b [N, D], w, then the outputs x = a + b
(x_dtype, rounded as the unfused add stores it; the norm reads it so) and y. With ``combine`` K as well, b is the
routed experts' combine, computed here: the buffers are a [N, D], s [N K, D] (float32: each token's K weighted
expert outputs, slot by slot), ids [N, K] (the slots' expert ids; a slot whose id is out of range of the
``experts`` is left out), w, then x and y; b = sum over the valid slots in slot order, rounded to x_dtype, as the
grouped experts' ``combine`` kernel stores it (so x equals the unfused pair's bit for bit).

With ``rope`` Dh (no residual), y is rotated before it is written (the rotary embedding after a model's Q- / K-norm,
rotate-half form: element j < Dh / 2 of a head pairs with j + Dh / 2): ``o = y cos + rotate_half(y) sin`` with the
tables cos, sin [tokens, Dh] in y_dtype, row n's element d belonging to token (n D + d) // ``rope_token``. The CUDA
form rounds each product and the sum to y_dtype, as PyTorch's rotation does; the llvm form computes the rotation in
float32 and rounds once, as TVM's llvm code for the unfused graph does.

Forms (``target``): "llvm", serial loops for CPU builds and CI; "cuda": a row per group of RT threads
(RT = the 16-byte chunks of a row rounded up to whole warps, at most 256), RB = 128 / RT rows per block
when a row needs fewer than 128 threads (per-head norms: a warp per row, 4 rows a block). Each thread
loads its chunks once into registers, with the weight's chunks (and the rotation's tables) in the same round of
loads, before any barrier; the sum of squares is reduced by warp shuffles (then through shared memory across the
row's warps), and each thread writes its chunks normalised.
With ``rope`` the normalised rows go through shared memory (one barrier), where each thread reads its chunks'
partners.
"""

from __future__ import annotations

from dataclasses import dataclass

try:
    from tvm.script import tirx as T
except ImportError:  # runtime-only TVM
    T = None

from ...compiler.errors import MoecError
from . import memoized

DTYPES = ("float32", "float16", "bfloat16")
_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_BLOCK_THREADS = 128  # rows share a block until it has this many threads
_ROPE_SHARED = 40960  # bytes of a block's normalised rows with rope (the static limit is 48 KB; the sums take some)


@dataclass(frozen=True)
class RMSNormSpec:
    """What one ``rms_norm`` kernel computes (one kernel per distinct spec)."""

    hidden: int  # D
    eps: float
    x_dtype: str = "float32"
    weight_dtype: str = "float32"
    y_dtype: str = "float32"
    residual: bool = False  # x = a + b (both x_dtype) computed here and written out too (the residual stream)
    combine: int = 0  # K > 0 (with residual): b is the sum of the K valid slots of s [N K, D] (the experts' combine)
    experts: int = 0  # E: with combine, the range of valid expert ids
    ids_dtype: str = "int64"  # with combine, the expert ids' dtype
    pair: bool = False  # two norms of this spec in one launch (x1, w1, x2, w2 -> y1, y2; each its own rows)
    rope: int = 0  # Dh > 0: rotary embedding (rotate-half form) over heads of Dh elements applied to y, cos / sin given
    rope_token: int = 0  # with rope, the elements of one token (its heads x Dh): row n's element d is token (n D + d) // this
    rope_token2: int = 0  # with rope and pair, the second norm's (grouped KV heads: fewer heads a token); 0: rope_token
    rope_out: str = ""  # with rope, the output's dtype (the rotated values are computed in y_dtype; "" = y_dtype)

    @property
    def out_dtype(self) -> str:
        """The dtype of what the kernel writes for y (the rotated values with ``rope``)."""
        return (self.rope_out or self.y_dtype) if self.rope else self.y_dtype

    def check(self) -> None:
        if not isinstance(self.hidden, int) or self.hidden < 1:
            raise MoecError(f"rms_norm: the normalised axis must be a positive integer, got {self.hidden!r}")
        for what in ("x_dtype", "weight_dtype", "y_dtype"):
            if getattr(self, what) not in DTYPES:
                raise MoecError(f"rms_norm: {what} must be one of {', '.join(DTYPES)}, got {getattr(self, what)!r}")
        if not self.eps >= 0:
            raise MoecError(f"rms_norm: eps must be >= 0, got {self.eps}")
        if self.pair and self.residual:
            raise MoecError("rms_norm: a pair of norms takes no residual add")
        if self.combine:
            if not self.residual or not isinstance(self.combine, int) or self.combine < 1:
                raise MoecError(f"rms_norm: combine must be a positive slot count with residual, got {self.combine!r}")
            if not isinstance(self.experts, int) or self.experts < self.combine:
                raise MoecError(f"rms_norm: combine of top-{self.combine} needs at least that many experts, got {self.experts!r}")
            if self.ids_dtype not in ("int32", "int64"):
                raise MoecError(f"rms_norm: ids_dtype must be int32 or int64, got {self.ids_dtype!r}")
            if self.x_dtype not in ("float32", "bfloat16"):
                raise MoecError(f"rms_norm: combine needs a float32 or bfloat16 residual stream, got {self.x_dtype}")
        if self.rope:
            dh, tok = self.rope, self.rope_token
            if self.residual:
                raise MoecError("rms_norm: rope is applied to a norm without a residual add")
            if not isinstance(dh, int) or dh < 2 or dh % 2 or self.hidden % dh:
                raise MoecError(f"rms_norm: rope needs an even head size dividing the row ({self.hidden}), got {dh!r}")
            for t in (tok,) + ((self.rope_token2,) if self.rope_token2 else ()):
                if not isinstance(t, int) or t < dh or t % dh:
                    raise MoecError(f"rms_norm: rope_token must be a positive multiple of the head size {dh}, got {t!r}")
            if self.rope_token2 and not self.pair:
                raise MoecError("rms_norm: rope_token2 is the second norm's of a pair")
            if self.y_dtype not in ("float32", "bfloat16"):
                raise MoecError(f"rms_norm: rope is computed in float32 or bfloat16, got {self.y_dtype}")
            if self.out_dtype not in DTYPES:
                raise MoecError(f"rms_norm: rope_out must be one of {', '.join(DTYPES)}, got {self.rope_out!r}")


def launch_config(spec: RMSNormSpec) -> dict:
    """The CUDA form's launch shape: threads per row, rows per block, vector width, chunks per thread."""
    dts = (spec.x_dtype, spec.weight_dtype, spec.y_dtype, spec.out_dtype) + (("float32",) if spec.combine else ())
    vec = 16 // max(_BYTES[dt] for dt in dts)
    while spec.hidden % vec or (spec.rope and (spec.rope // 2) % vec):  # (a chunk lies in one half of a head)
        vec //= 2
    chunks = spec.hidden // vec
    row_threads = min(256, 32 * -(-chunks // 32))
    rows = max(1, _BLOCK_THREADS // row_threads)
    return {"vec": vec, "row_threads": row_threads, "row_warps": row_threads // 32, "rows_per_block": rows,
            "threads": row_threads * rows, "iters": -(-chunks // row_threads)}


def check_supported(spec: RMSNormSpec, target: str = "llvm") -> None:
    """Raise ``MoecError`` unless ``make_rms_norm(spec, target)`` can build the kernel."""
    spec.check()
    if target not in ("llvm", "cuda"):
        raise MoecError(f"rms_norm: target must be 'llvm' or 'cuda', got {target!r}")
    if target == "cuda" and spec.rope and 4 * spec.hidden * launch_config(spec)["rows_per_block"] > _ROPE_SHARED:
        raise MoecError(f"rms_norm: rope's rows of {spec.hidden} float32 values exceed {_ROPE_SHARED} bytes of shared memory")


@memoized
def make_rms_norm(spec: RMSNormSpec, target: str = "llvm"):
    """The ``rms_norm`` PrimFunc for ``spec`` (``target``: "llvm" or "cuda")."""
    check_supported(spec, target)
    return (_make_cuda if target == "cuda" else _make_llvm)(spec)


def _f32(v):
    return T.Cast("float32", v)


def _rounded(v, dtype: str):
    """float32 ``v`` rounded to ``dtype`` (float32 or bfloat16) and back, as a store to memory and a load round it,
    through its bits: TVM's bfloat16 legalization folds ``float32(bfloat16(v))`` back to ``v``. Round to nearest
    even; a NaN stays a NaN."""
    if dtype == "float32":
        return v
    u = T.reinterpret("uint32", v)
    r = T.bitwise_and(u + T.uint32(0x7FFF) + T.bitwise_and(T.shift_right(u, T.uint32(16)), T.uint32(1)), T.uint32(0xFFFF0000))
    nan = T.bitwise_and(u, T.uint32(0x7FFFFFFF)) > T.uint32(0x7F800000)
    return T.reinterpret("float32", T.if_then_else(nan, T.bitwise_or(T.bitwise_and(u, T.uint32(0xFFFF0000)), T.uint32(0x00400000)), r))


def _rope(y, rot, c, s, dtype: str):
    """One rotated value ``y c + rot s`` with each product and the sum rounded to ``dtype`` (float32 or bfloat16), as
    PyTorch rounds each operation of the rotation."""
    return _rounded(_rounded(y * c, dtype) + _rounded(rot * s, dtype), dtype)


def _valid(ids, n, k, E):
    """Slot k of row n holds an expert id in range (negative ids wrap, as numpy / ONNX index)."""
    from .grouped_experts import _in_range, _norm_id

    return _in_range(_norm_id(ids[n, k], E), E)


def _make_llvm(spec: RMSNormSpec):
    D, eps = spec.hidden, float(spec.eps)

    K, E = spec.combine, spec.experts
    DH, HT, HT2 = spec.rope, spec.rope_token, spec.rope_token2 or spec.rope_token
    H2, YB = DH // 2, D if DH else 1

    @T.macro
    def body(a, b, ids, w, cs, sn, x, y, N, HT):
        for n in T.serial(N):
            with T.sblock("rms_norm"):
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((2,), "float32", scope="local")
                cb = T.sblock_alloc_buffer((1,), "float32", scope="local")
                yb = T.sblock_alloc_buffer((YB,), "float32", scope="local")  # (the normalised row, for rope)
                if K > 0:  # b: the valid slots' sum in slot order, rounded as the combine kernel stores it
                    for d in T.serial(D):
                        cb[0] = T.float32(0)
                        for k in T.serial(K):
                            if _valid(ids, n, k, E):
                                cb[0] = cb[0] + b[n * K + k, d]
                        x[n, d] = T.Cast(spec.x_dtype, _f32(a[n, d]) + _rounded(cb[0], spec.x_dtype))
                elif spec.residual:  # the sum, rounded to its dtype as stored
                    for d in T.serial(D):
                        x[n, d] = T.Cast(spec.x_dtype, _f32(a[n, d]) + _f32(b[n, d]))
                acc[0] = T.float32(0)
                for d in T.serial(D):
                    acc[0] = acc[0] + _f32(x[n, d]) * _f32(x[n, d])
                acc[1] = T.rsqrt(acc[0] / T.float32(D) + T.float32(eps))
                if DH > 0:  # y rounded as the norm stores it, then rotated in float32, rounded once (as TVM's llvm code does)
                    for d in T.serial(D):
                        yb[d] = _rounded(_f32(w[d]) * (_f32(x[n, d]) * acc[1]), spec.y_dtype)
                    for d in T.serial(D):
                        y[n, d] = T.Cast(spec.out_dtype, yb[d] * _f32(cs[(n * D + d) // HT, d % DH]) + T.if_then_else(
                            d % DH < H2, T.float32(-1) * yb[d + H2], yb[d - H2]) * _f32(sn[(n * D + d) // HT, d % DH]))
                else:
                    for d in T.serial(D):
                        y[n, d] = T.Cast(spec.y_dtype, _f32(w[d]) * (_f32(x[n, d]) * acc[1]))

    @T.macro
    def pair(x1, w1, y1, N1, x2, w2, y2, N2, cs, sn):
        body(x1, x1, x1, w1, cs, sn, x1, y1, N1, HT)
        body(x2, x2, x2, w2, cs, sn, x2, y2, N2, HT2)

    return _signature(spec, body, pair)


def _make_cuda(spec: RMSNormSpec):
    D, eps = spec.hidden, float(spec.eps)
    cfg = launch_config(spec)
    VEC, RT, RW, RB, NT, IT = (cfg[k] for k in ("vec", "row_threads", "row_warps", "rows_per_block", "threads", "iters"))
    full = D % (RT * VEC) == 0  # every thread of a row has IT whole chunks (no bounds checks)

    def shfl(v, o):
        return T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), v, o, 32, 32)

    @T.macro
    def warp_sum(buf, idx):
        for r in T.unroll(5):
            buf[idx] = buf[idx] + shfl(buf[idx], T.shift_right(16, r))

    K, E = spec.combine, spec.experts
    CV = VEC if K else 1  # (the combine's buffers)
    DH, HT, HT2 = spec.rope, spec.rope_token, spec.rope_token2 or spec.rope_token
    H2, YS, RV = DH // 2, RB * D if DH else 1, VEC if DH else 1  # (rope's buffers)

    @T.macro
    def rows(a, b, ids, w, cs, sn, x, y, N, bx, tx, HT):  # block bx's RB rows
        with T.sblock("rms_norm"):
            T.reads()
            T.writes()
            red = T.sblock_alloc_buffer((RB * RW,), "float32", scope="shared")
            xl = T.sblock_alloc_buffer((IT * VEC,), spec.x_dtype, scope="local")
            bl = T.sblock_alloc_buffer((VEC,), spec.x_dtype, scope="local")
            cb = T.sblock_alloc_buffer((CV,), "float32", scope="local")  # the combine's sums
            sv = T.sblock_alloc_buffer((CV,), "float32", scope="local")  # one slot's chunk
            wl = T.sblock_alloc_buffer((IT * VEC,), spec.weight_dtype, scope="local")  # (loaded with x: one round trip)
            yl = T.sblock_alloc_buffer((VEC,), spec.y_dtype, scope="local")
            acc = T.sblock_alloc_buffer((2,), "float32", scope="local")
            ys = T.sblock_alloc_buffer((YS,), "float32", scope="shared")  # (rope: the rows normalised)
            cl = T.sblock_alloc_buffer((IT * RV,), spec.y_dtype, scope="local")
            sl = T.sblock_alloc_buffer((IT * RV,), spec.y_dtype, scope="local")
            ol = T.sblock_alloc_buffer((RV,), spec.out_dtype, scope="local")
            n: T.let[T.int64] = bx * RB + tx // RT
            rt: T.let[T.int32] = tx % RT  # this thread's place in its row
            # ---- the row's chunks, once, into registers, with the weight's (and the rotation's tables'): every global
            # load of the kernel issued before its barriers; the sum of squares
            acc[0] = T.float32(0)
            for i in T.unroll(IT):
                if n < N and (full or (i * RT + rt) * VEC < D):
                    for v in T.vectorized(VEC):
                        wl[i * VEC + v] = w[(i * RT + rt) * VEC + v]
                    if DH > 0:
                        tok0: T.let[T.int64] = (n * D + T.Cast("int64", (i * RT + rt) * VEC)) // HT
                        jc: T.let[T.int64] = T.Cast("int64", (i * RT + rt) * VEC) % DH
                        for v in T.vectorized(VEC):
                            cl[i * VEC + v] = cs[tok0, jc + v]
                        for v in T.vectorized(VEC):
                            sl[i * VEC + v] = sn[tok0, jc + v]
                    if spec.residual:  # x = a + b, rounded as stored, written out
                        for v in T.vectorized(VEC):
                            xl[i * VEC + v] = a[n, (i * RT + rt) * VEC + v]
                        if K > 0:  # b: the valid slots' sum in slot order, rounded as the combine stores it
                            for v in T.unroll(VEC):
                                cb[v] = T.float32(0)
                            for k in T.unroll(K):
                                if _valid(ids, n, k, E):
                                    for v in T.vectorized(VEC):
                                        sv[v] = b[n * K + k, (i * RT + rt) * VEC + v]
                                    for v in T.unroll(VEC):
                                        cb[v] = cb[v] + sv[v]
                            for v in T.unroll(VEC):  # (exact: the rounded value is a bfloat16)
                                bl[v] = T.Cast(spec.x_dtype, _rounded(cb[v], spec.x_dtype))
                        else:
                            for v in T.vectorized(VEC):
                                bl[v] = b[n, (i * RT + rt) * VEC + v]
                        for v in T.unroll(VEC):
                            xl[i * VEC + v] = T.Cast(spec.x_dtype, _f32(xl[i * VEC + v]) + _f32(bl[v]))
                        for v in T.vectorized(VEC):
                            x[n, (i * RT + rt) * VEC + v] = xl[i * VEC + v]
                    else:
                        for v in T.vectorized(VEC):
                            xl[i * VEC + v] = x[n, (i * RT + rt) * VEC + v]
                    for v in T.unroll(VEC):
                        acc[0] = acc[0] + _f32(xl[i * VEC + v]) * _f32(xl[i * VEC + v])
            warp_sum(acc, 0)
            if RW > 1:  # across the row's warps (every thread reaches the barrier)
                if tx % 32 == 0:
                    red[tx // 32] = acc[0]
                T.tvm_storage_sync("shared")
                acc[0] = T.float32(0)
                for k in T.unroll(RW):
                    acc[0] = acc[0] + red[(tx // RT) * RW + k]
            acc[1] = T.rsqrt(acc[0] / T.float32(D) + T.float32(eps))
            # ---- normalise and write
            if DH > 0:  # the row normalised (rounded as stored) into shared memory, then each chunk rotated against its partner
                for i in T.unroll(IT):
                    if n < N and (full or (i * RT + rt) * VEC < D):
                        for v in T.unroll(VEC):
                            ys[(tx // RT) * D + (i * RT + rt) * VEC + v] = _rounded(
                                _f32(wl[i * VEC + v]) * (_f32(xl[i * VEC + v]) * acc[1]), spec.y_dtype)
                T.tvm_storage_sync("shared")
                for i in T.unroll(IT):
                    if n < N and (full or (i * RT + rt) * VEC < D):
                        d0: T.let[T.int64] = T.Cast("int64", (i * RT + rt) * VEC)
                        j0: T.let[T.int64] = d0 % DH  # (the chunk lies in one half of its head)
                        for v in T.unroll(VEC):
                            ol[v] = T.Cast(spec.out_dtype, _rope(
                                ys[(tx // RT) * D + d0 + v], T.if_then_else(
                                    j0 < H2, T.float32(-1) * ys[(tx // RT) * D + d0 + H2 + v], ys[(tx // RT) * D + d0 - H2 + v]),
                                _f32(cl[i * VEC + v]), _f32(sl[i * VEC + v]), spec.y_dtype))
                        for v in T.vectorized(VEC):
                            y[n, d0 + v] = ol[v]
            else:
                for i in T.unroll(IT):
                    if n < N and (full or (i * RT + rt) * VEC < D):
                        for v in T.unroll(VEC):
                            yl[v] = T.Cast(spec.y_dtype, _f32(wl[i * VEC + v]) * (_f32(xl[i * VEC + v]) * acc[1]))
                        for v in T.vectorized(VEC):
                            y[n, (i * RT + rt) * VEC + v] = yl[v]

    @T.macro
    def body(a, b, ids, w, cs, sn, x, y, N, HT):
        for bx in T.thread_binding((N + RB - 1) // RB, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                rows(a, b, ids, w, cs, sn, x, y, N, bx, tx, HT)

    @T.macro
    def pair(x1, w1, y1, N1, x2, w2, y2, N2, cs, sn):  # two norms of one spec in one launch: blockIdx.y picks the norm
        for which in T.thread_binding(2, thread="blockIdx.y"):
            for bx in T.thread_binding((T.max(N1, N2) + RB - 1) // RB, thread="blockIdx.x"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    if which == 0:  # block-uniform (rows past a norm's N are skipped)
                        rows(x1, x1, x1, w1, cs, sn, x1, y1, N1, bx, tx, HT)
                    else:
                        rows(x2, x2, x2, w2, cs, sn, x2, y2, N2, bx, tx, HT2)

    return _signature(spec, body, pair)


def _signature(spec: RMSNormSpec, body, pair):
    """The PrimFunc around ``body``: (x, w, y), with ``residual`` (a, b, w, x, y), with ``combine`` too
    (a, s, ids, w, x, y); with ``pair`` two norms (x1, w1, x2, w2, y1, y2; ``pair``'s body); with ``rope`` the tables
    cos and sin [M, Dh] (y_dtype, M the tokens) follow the weights (x, w, cos, sin, y; x1, w1, x2, w2, cos, sin, y1,
    y2). N dynamic."""
    D, DH, HT = spec.hidden, spec.rope, spec.rope_token
    attrs = {"tirx.is_scheduled": True, "global_symbol": "rms_norm", "tirx.noalias": True}

    if spec.pair and DH:
        @T.prim_func(s_tir=True)
        def rms_norm_rope_pair(x1_h: T.handle, w1_h: T.handle, x2_h: T.handle, w2_h: T.handle, c_h: T.handle, s_h: T.handle,
                               y1_h: T.handle, y2_h: T.handle):
            T.func_attr(attrs)
            N1, N2, M = T.int64(), T.int64(), T.int64()
            x1 = T.match_buffer(x1_h, (N1, D), spec.x_dtype)
            w1 = T.match_buffer(w1_h, (D,), spec.weight_dtype)
            x2 = T.match_buffer(x2_h, (N2, D), spec.x_dtype)
            w2 = T.match_buffer(w2_h, (D,), spec.weight_dtype)
            cs = T.match_buffer(c_h, (M, DH), spec.y_dtype)
            sn = T.match_buffer(s_h, (M, DH), spec.y_dtype)
            y1 = T.match_buffer(y1_h, (N1, D), spec.out_dtype)
            y2 = T.match_buffer(y2_h, (N2, D), spec.out_dtype)
            pair(x1, w1, y1, N1, x2, w2, y2, N2, cs, sn)

        return rms_norm_rope_pair

    if spec.pair:
        @T.prim_func(s_tir=True)
        def rms_norm_pair(x1_h: T.handle, w1_h: T.handle, x2_h: T.handle, w2_h: T.handle, y1_h: T.handle, y2_h: T.handle):
            T.func_attr(attrs)
            N1, N2 = T.int64(), T.int64()
            x1 = T.match_buffer(x1_h, (N1, D), spec.x_dtype)
            w1 = T.match_buffer(w1_h, (D,), spec.weight_dtype)
            x2 = T.match_buffer(x2_h, (N2, D), spec.x_dtype)
            w2 = T.match_buffer(w2_h, (D,), spec.weight_dtype)
            y1 = T.match_buffer(y1_h, (N1, D), spec.y_dtype)
            y2 = T.match_buffer(y2_h, (N2, D), spec.y_dtype)
            pair(x1, w1, y1, N1, x2, w2, y2, N2, x1, x1)  # (no rope: the tables are never read)

        return rms_norm_pair

    if spec.combine:
        K = spec.combine

        @T.prim_func(s_tir=True)
        def combine_add_rms_norm(a_h: T.handle, s_h: T.handle, ids_h: T.handle, w_h: T.handle, x_h: T.handle, y_h: T.handle):
            T.func_attr(attrs)
            N = T.int64()
            a = T.match_buffer(a_h, (N, D), spec.x_dtype)
            s = T.match_buffer(s_h, (N * K, D), "float32")
            ids = T.match_buffer(ids_h, (N, K), spec.ids_dtype)
            w = T.match_buffer(w_h, (D,), spec.weight_dtype)
            x = T.match_buffer(x_h, (N, D), spec.x_dtype)
            y = T.match_buffer(y_h, (N, D), spec.y_dtype)
            body(a, s, ids, w, a, a, x, y, N, 1)

        return combine_add_rms_norm

    if spec.residual:
        @T.prim_func(s_tir=True)
        def add_rms_norm(a_h: T.handle, b_h: T.handle, w_h: T.handle, x_h: T.handle, y_h: T.handle):
            T.func_attr(attrs)
            N = T.int64()
            a = T.match_buffer(a_h, (N, D), spec.x_dtype)
            b = T.match_buffer(b_h, (N, D), spec.x_dtype)
            w = T.match_buffer(w_h, (D,), spec.weight_dtype)
            x = T.match_buffer(x_h, (N, D), spec.x_dtype)
            y = T.match_buffer(y_h, (N, D), spec.y_dtype)
            body(a, b, a, w, a, a, x, y, N, 1)  # (no ids, no rope tables: never read)

        return add_rms_norm

    if DH:
        @T.prim_func(s_tir=True)
        def rms_norm_rope(x_h: T.handle, w_h: T.handle, c_h: T.handle, s_h: T.handle, y_h: T.handle):
            T.func_attr(attrs)
            N, M = T.int64(), T.int64()
            x = T.match_buffer(x_h, (N, D), spec.x_dtype)
            w = T.match_buffer(w_h, (D,), spec.weight_dtype)
            cs = T.match_buffer(c_h, (M, DH), spec.y_dtype)
            sn = T.match_buffer(s_h, (M, DH), spec.y_dtype)
            y = T.match_buffer(y_h, (N, D), spec.out_dtype)
            body(x, x, x, w, cs, sn, x, y, N, HT)

        return rms_norm_rope

    @T.prim_func(s_tir=True)
    def rms_norm(x_h: T.handle, w_h: T.handle, y_h: T.handle):
        T.func_attr(attrs)
        N = T.int64()
        x = T.match_buffer(x_h, (N, D), spec.x_dtype)
        w = T.match_buffer(w_h, (D,), spec.weight_dtype)
        y = T.match_buffer(y_h, (N, D), spec.y_dtype)
        body(x, x, x, w, x, x, x, y, N, 1)  # no residual, no rope: a, b, ids and the tables are never read

    return rms_norm


def reference(x, w, eps: float, y_dtype=None):
    """NumPy reference of the kernel (float32 math, one rounding to ``y_dtype``). With a residual, ``x`` is the
    sum ``a + b`` as stored (``residual_sum``)."""
    import numpy as np

    xf = np.asarray(x, np.float32)
    r = 1.0 / np.sqrt((xf * xf).sum(-1, keepdims=True, dtype=np.float32) / np.float32(xf.shape[-1]) + np.float32(eps))
    return (np.asarray(w, np.float32) * (xf * r)).astype(y_dtype or x.dtype)


def residual_sum(a, b):
    """NumPy: the residual kernel's ``x = a + b`` (float32 sum rounded to a's dtype)."""
    import numpy as np

    return (np.asarray(a, np.float32) + np.asarray(b, np.float32)).astype(a.dtype)


def combine_sum(s, ids, experts: int, dtype):
    """NumPy: the combine's ``b`` (each row's valid slots of ``s`` [N K, D] summed in slot order in float32,
    rounded to ``dtype``)."""
    import numpy as np

    n, k = ids.shape
    e = np.where(ids < 0, ids + experts, ids)
    valid = (e >= 0) & (e < experts)
    acc = np.zeros((n, s.shape[1]), np.float32)
    for j in range(k):  # slot order, as the kernels add
        acc = np.where(valid[:, j:j + 1], acc + s.reshape(n, k, -1)[:, j].astype(np.float32), acc)
    return acc.astype(dtype)


def rope_reference(y, cos, sin, head: int, token: int, out_dtype, per_op: bool = True):
    """NumPy: the rotary embedding (rotate-half form) of the normalised rows ``y`` [N, D] (float32 or bfloat16), heads of
    ``head`` elements, ``token`` elements a token (row n's element d is token (n D + d) // token); ``cos`` / ``sin``
    [tokens, head] of y's dtype. ``per_op``: each product and the sum rounded to y's dtype (the CUDA form, PyTorch);
    else computed in float32 and rounded once to ``out_dtype`` (the llvm form, as TVM's llvm code computes it)."""
    import numpy as np

    n, d = y.shape
    yf = np.asarray(y, np.float32).reshape(-1, head)
    h = head // 2
    rot = np.concatenate([-yf[:, h:], yf[:, :h]], axis=1)
    tok = (np.arange(n * d) // token).reshape(-1, head)[:, 0]
    c, s = (np.asarray(t, np.float32)[tok] for t in (cos, sin))
    if per_op:
        r = lambda v: v.astype(y.dtype).astype(np.float32)  # noqa: E731
        out = r(r(yf * c) + r(rot * s))
    else:
        out = yf * c + rot * s
    return out.reshape(n, d).astype(out_dtype)


__all__ = ["RMSNormSpec", "check_supported", "combine_sum", "launch_config", "make_rms_norm", "reference", "residual_sum",
           "rope_reference"]
