"""RMSNorm and the router matmul in one kernel (TIR): ``y = w * (x * rsqrt(mean(x^2) + eps))``, ``logits = y @ R^T (+ b)``.

For each of T token rows (legend: T tokens, D hidden, E router outputs: experts, or groups of the
cascade's coarse router)::

    r      = rsqrt(sum_d x[t, d]^2 / D + eps)                 # float32
    y[t]   = cast(y_dtype, w * (x[t] * r))                    # T, D   the normalised hidden state
    logits = cast(l_dtype, f32(y[t]) @ f32(R)^T + f32(b))     # T, E   R [E, D] (or R^T [D, E]), b [E]

Everything is computed in float32; the router reads the normalised row *as stored* (rounded to
``y_dtype``), so the logits are those of the unfused graph's matmul over the same hidden state, up to
float rounding (summation order; the unfused graph may also accumulate in a lower precision).

Buffers: x [T, D] (x_dtype), w [D], rows [E, D] ("ed") or [D, E] ("de"), bias [E] (optional), then the
outputs y [T, D] (y_dtype) and logits [T, E] (l_dtype). T is dynamic. With ``residual`` (the residual add before
the norm): ra, rb [T, D] in place of x, and x = ra + rb (rounded as the unfused add stores it) an output before y.

Forms (``target``): "llvm", serial loops for CPU builds and CI; "cuda", one launch for the whole
norm + router: a grid of T x NB blocks of NW warps. Every block of row t loads the row once into
registers (VEC-wide loads of 16 bytes), reduces the sum of squares (warp shuffles, then one value per
warp through shared memory), normalises its elements into shared memory (as ``y_dtype``) and writes
its share (1/NB) of ``y``; then each warp computes one logit ``e = block * NW + warp``: lanes read the
router row with 16-byte loads, dot it with the shared row and reduce by shuffles. NB = ceil(E / NW), so a single
token still spreads its E dot products over NB thread blocks. The norm's weight and the warp's router row (up to
ROW_REGS bytes a lane) are loaded into registers with the row, so the kernel's global loads issue before its first
barrier instead of in three dependent rounds.

With ``tokens`` TB > 0 (the prefill entry's form, ``prefill_spec``) a block of 8 warps takes TB rows instead: warp
w normalises rows w, w + 8, ... into shared memory (and y), then computes the logits of experts w, w + 8, ...
for all TB rows at once: each router row is read once per TB tokens (per token, the other form reads the router's
E rows and its own row NB times over, from the L2: at a prefill chunk of 2048 tokens that traffic, not the bytes
of x, bounds the kernel).

With ``topk`` K (the router's softmax top-k, as ``topk_softmax`` computes it: ``FuseTopKIntoRouterNorm``) the kernel
writes each row's K indices [T, K] and softmax values [T, K] in place of the logits: the logits, rounded to
``logits_dtype`` as the unfused pair stores them, stay in shared memory (CUDA) or registers (llvm), and K passes take
the largest not yet taken (the lower index on a tie), its value ``exp(l - max) / sum exp(logits - max)`` in float32.
On CUDA this is the multi-token form (``tokens`` >= 1; the decode entry's a token a block), after whose logits a warp
per row holds E / 32 logits a lane and selects by shuffles; no router bias, E at most 992.
"""

from __future__ import annotations

from dataclasses import dataclass

try:
    from tvm.script import tirx as T
except ImportError:  # runtime-only TVM (the GPU bench): launch_config still works
    T = None

from ...compiler.errors import MoecError
from . import memoized
from .topk import NEG, warp_select

DTYPES = ("float32", "float16", "bfloat16")
_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
MAX_SHARED = 48 * 1024  # static shared memory of one block
TOKENS_MAX = 16  # rows a block of the multi-token form (registers: one float32 sum per row and lane)
TOKEN_WARPS = 8  # warps a block of the multi-token form
TOPK_MAX_OUTPUTS = 992  # the top-k form: a warp selects over a row's logits, at most 31 a lane
ROW_REGS = 256  # bytes of its router row a lane of the per-token form loads before the first barrier (64 registers;
#                 a longer share is loaded after the normalised row, as it is read)


@dataclass(frozen=True)
class NormRouterSpec:
    """What one ``norm_router`` kernel computes (one kernel per distinct spec)."""

    hidden: int  # D
    outputs: int  # E (router logits)
    eps: float
    x_dtype: str = "float32"
    weight_dtype: str = "float32"
    rows_dtype: str = "float32"
    y_dtype: str = "float32"
    logits_dtype: str = "float32"
    bias_dtype: str | None = None  # None: no bias
    rows_layout: str = "ed"  # "ed": rows [E, D]; "de": rows given transposed, [D, E]
    residual: bool = False  # x = ra + rb (both x_dtype) computed here and written out too (the residual stream)
    tokens: int = 0  # CUDA: 0, a block per (token, logit group); TB > 0, a block per TB tokens (prefill chunks)
    topk: int = 0  # K > 0: each row's top-K of softmax(logits) (indices, values) written instead of the logits
    index_dtype: str = "int64"  # with topk: the indices' dtype
    values_dtype: str = "float32"  # with topk: the softmax values' dtype

    def check(self) -> None:
        if not isinstance(self.hidden, int) or not isinstance(self.outputs, int) or self.hidden < 1 or self.outputs < 1:
            raise MoecError(f"norm_router: hidden size and outputs must be positive integers, got {self.hidden}, {self.outputs}")
        for what in ("x_dtype", "weight_dtype", "rows_dtype", "y_dtype", "logits_dtype", "bias_dtype"):
            dt = getattr(self, what)
            if (dt is not None or what != "bias_dtype") and dt not in DTYPES:
                raise MoecError(f"norm_router: {what} must be one of {', '.join(DTYPES)}, got {dt!r}")
        if self.rows_layout not in ("ed", "de"):
            raise MoecError(f"norm_router: rows layout must be 'ed' ([E, D]) or 'de' ([D, E]), got {self.rows_layout!r}")
        if not self.eps >= 0:
            raise MoecError(f"norm_router: eps must be >= 0, got {self.eps}")
        if not isinstance(self.tokens, int) or isinstance(self.tokens, bool) or not 0 <= self.tokens <= TOKENS_MAX:
            raise MoecError(f"norm_router: tokens must be 0 (a block per token) or 1..{TOKENS_MAX} tokens a block, got {self.tokens!r}")
        if self.topk:
            if not isinstance(self.topk, int) or isinstance(self.topk, bool) or not 1 <= self.topk <= self.outputs:
                raise MoecError(f"norm_router: topk must be 1..{self.outputs} (the outputs), got {self.topk!r}")
            if self.outputs > TOPK_MAX_OUTPUTS:
                raise MoecError(f"norm_router: the top-k of {self.outputs} outputs exceeds the {TOPK_MAX_OUTPUTS} a warp holds")
            if self.bias_dtype is not None:
                raise MoecError("norm_router: the top-k form takes no router bias")
            if self.index_dtype not in ("int32", "int64") or self.values_dtype not in DTYPES:
                raise MoecError(f"norm_router: top-k indices int32 / int64 and values one of {', '.join(DTYPES)}, got "
                                f"{self.index_dtype!r}, {self.values_dtype!r}")


def _vec(d: int, *dtypes: str) -> int:
    """Elements per 16-byte access (of the widest dtype), reduced until it divides D."""
    v = 16 // max(_BYTES[dt] for dt in dtypes)
    while d % v:
        v //= 2
    return v


def prefill_spec(spec: NormRouterSpec) -> NormRouterSpec:
    """The spec of the prefill entry's kernel: where the per-token form splits a token's logits over several blocks
    (more outputs than its warps, each block then reading the row again), the multi-token form with as many rows a
    block as 32 KB of shared memory hold (at most 8: 8 for OLMoE's 2048 bf16); else ``spec``. On the H100
    (bench/results/norm_router_tokens_h100_18e0209.json, 2048 tokens) OLMoE's (64 experts) took 38.5 against 64.6 us,
    Mixtral's (8 experts, one block a token) 22.7 against 19.1."""
    from dataclasses import replace

    if spec.outputs <= launch_config(spec)["warps"]:
        return spec
    tb = min(8, (32 * 1024) // (spec.hidden * _BYTES[spec.y_dtype]))
    return replace(spec, tokens=tb) if tb >= 1 else spec


def launch_config(spec: NormRouterSpec) -> dict:
    """The CUDA form's launch shape: threads per block, warps, logit blocks per row, vector width."""
    if spec.tokens:
        vec = _vec(spec.hidden, spec.x_dtype, spec.weight_dtype, spec.y_dtype)
        rvec = _vec(spec.hidden, spec.rows_dtype, spec.y_dtype) if spec.rows_layout == "ed" else 1
        return {"threads": 32 * TOKEN_WARPS, "warps": TOKEN_WARPS, "tokens_per_block": spec.tokens, "blocks": "ceil(T / tokens)",
                "vec": vec, "rows_vec": rvec, "iters": -(-spec.hidden // (32 * vec)), "rows_iters": -(-spec.hidden // (32 * rvec)),
                "shared_bytes": spec.tokens * spec.hidden * _BYTES[spec.y_dtype] + (spec.tokens * spec.outputs * 4 if spec.topk else 0)}
    vec = _vec(spec.hidden, spec.x_dtype, spec.weight_dtype, spec.y_dtype)
    chunks = -(-spec.hidden // vec)  # 16-byte chunks of a row
    threads = min(256, max(32, 32 * -(-chunks // 32)))
    warps = threads // 32
    rvec = _vec(spec.hidden, spec.rows_dtype, spec.y_dtype) if spec.rows_layout == "ed" else 1
    return {"threads": threads, "warps": warps, "blocks_per_row": -(-spec.outputs // warps), "vec": vec, "rows_vec": rvec,
            "iters": -(-chunks // threads), "rows_iters": -(-spec.hidden // (32 * rvec)),
            "shared_bytes": spec.hidden * _BYTES[spec.y_dtype] + warps * 4}


def check_supported(spec: NormRouterSpec, target: str = "llvm") -> None:
    """Raise ``MoecError`` unless ``make_norm_router(spec, target)`` can build the kernel."""
    spec.check()
    if target not in ("llvm", "cuda"):
        raise MoecError(f"norm_router: target must be 'llvm' or 'cuda', got {target!r}")
    if target == "cuda" and spec.topk and not spec.tokens:
        raise MoecError("norm_router: the top-k form is the multi-token one on CUDA (tokens >= 1)")
    if target == "cuda" and launch_config(spec)["shared_bytes"] > MAX_SHARED:
        raise MoecError(f"norm_router: a normalised row of {spec.hidden} {spec.y_dtype} needs "
                        f"{launch_config(spec)['shared_bytes']} bytes of shared memory, more than {MAX_SHARED}")


@memoized
def make_norm_router(spec: NormRouterSpec, target: str = "llvm"):
    """The ``norm_router`` PrimFunc for ``spec`` (``target``: "llvm" or "cuda"; ``tokens`` is a CUDA launch shape)."""
    check_supported(spec, target)
    if target != "cuda":
        return _make_llvm(spec)
    return _make_cuda_tokens(spec) if spec.tokens else _make_cuda(spec)


def _f32(v):
    return T.Cast("float32", v)


def _make_llvm(spec: NormRouterSpec):
    D, E, eps = spec.hidden, spec.outputs, float(spec.eps)
    has_bias, ed = spec.bias_dtype is not None, spec.rows_layout == "ed"

    def row(rows, e, d):
        return rows[e, d] if ed else rows[d, e]

    TOPK = spec.topk > 0
    select = _select_topk(spec)

    @T.macro
    def body(ra, rb, x, w, rows, bias, y, logits, idx, val, N):
        for t in T.serial(N):
            with T.sblock("norm_router"):
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((2,), "float32", scope="local")
                yv = T.sblock_alloc_buffer((D,), "float32", scope="local")
                lg = T.sblock_alloc_buffer((E if TOPK else 1,), "float32", scope="local")  # top-k: the row's logits as stored
                sel = T.sblock_alloc_buffer((4,), "float32", scope="local")  # top-k: max, sum of exp, best value, its index
                tk = T.sblock_alloc_buffer((E if TOPK else 1,), "int32", scope="local")  # top-k: taken
                if spec.residual:  # the sum, rounded to its dtype as stored
                    for d in T.serial(D):
                        x[t, d] = T.Cast(spec.x_dtype, _f32(ra[t, d]) + _f32(rb[t, d]))
                acc[0] = T.float32(0)
                for d in T.serial(D):
                    acc[0] = acc[0] + _f32(x[t, d]) * _f32(x[t, d])
                acc[1] = T.rsqrt(acc[0] / T.float32(D) + T.float32(eps))
                for d in T.serial(D):
                    y[t, d] = T.Cast(spec.y_dtype, _f32(w[d]) * (_f32(x[t, d]) * acc[1]))
                    yv[d] = _f32(y[t, d])
                for e in T.serial(E):
                    acc[0] = T.float32(0)
                    for d in T.serial(D):
                        acc[0] = acc[0] + yv[d] * _f32(row(rows, e, d))
                    if has_bias:
                        acc[0] = acc[0] + _f32(bias[e])
                    if TOPK:
                        lg[e] = _f32(T.Cast(spec.logits_dtype, acc[0]))
                    else:
                        logits[t, e] = T.Cast(spec.logits_dtype, acc[0])
                if TOPK:
                    select(lg, tk, idx, val, t, sel)

    return _signature(spec, body)


def _select_topk(spec: NormRouterSpec):
    """A TIR macro ``select(lg, tk, idx, val, t, sel)`` (serial; tk [E] int32 scratch): row t's top-K of ``softmax(lg)`` over lg [E] float32, as
    ``topk_softmax`` selects them: K passes, each the largest value not taken (the lower index on a tie), its softmax
    ``exp(v - max) / sum exp(lg - max)`` in float32."""
    E, K = spec.outputs, spec.topk

    @T.macro
    def select(lg, tk, idx, val, t, sel):
        for e in T.serial(E):
            tk[e] = 0
        sel[0] = T.float32(-3.0e38)
        for e in T.serial(E):
            sel[0] = T.max(sel[0], lg[e])
        sel[1] = T.float32(0)
        for e in T.serial(E):
            sel[1] = sel[1] + T.exp(lg[e] - sel[0])
        for p in T.serial(K):
            sel[3] = T.float32(-1)
            for e in T.serial(E):
                if tk[e] == 0 and (sel[3] < T.float32(0) or lg[e] > sel[2]):
                    sel[2] = lg[e]
                    sel[3] = T.Cast("float32", e)
            idx[t, p] = T.Cast(spec.index_dtype, T.Cast("int32", sel[3]))
            val[t, p] = T.Cast(spec.values_dtype, T.exp(sel[2] - sel[0]) / sel[1])
            tk[T.Cast("int32", sel[3])] = 1

    return select


def _router_row(ed: bool, rvec: int):
    """A TIR macro ``router_row(rows, rl, o, e, d0)``: rl[o .. o + rvec - 1] = router row e's elements d0 .. d0 + rvec - 1
    (16-byte loads of rows [E, D]; element loads of rows given as [D, E])."""

    @T.macro
    def router_row(rows, rl, o, e, d0):
        if ed:
            for v in T.vectorized(rvec):
                rl[o + v] = rows[e, d0 + v]
        else:
            for v in T.unroll(rvec):
                rl[o + v] = rows[d0 + v, e]

    return router_row


def _make_cuda(spec: NormRouterSpec):
    D, E, eps = spec.hidden, spec.outputs, float(spec.eps)
    has_bias, ed = spec.bias_dtype is not None, spec.rows_layout == "ed"
    cfg = launch_config(spec)
    NT, NW, NB, VEC, RVEC, IT, RIT = (cfg[k] for k in ("threads", "warps", "blocks_per_row", "vec", "rows_vec", "iters", "rows_iters"))
    full = D % (NT * VEC) == 0  # every thread has IT whole chunks (no bounds checks)
    rfull = D % (32 * RVEC) == 0
    PRE = RIT * RVEC * _BYTES[spec.rows_dtype] <= ROW_REGS  # the warp's router row loaded with the row (see ROW_REGS)
    router_row = _router_row(ed, RVEC)

    def shfl(v, o):
        return T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), v, o, 32, 32)

    @T.macro
    def warp_sum(buf, idx):
        for r in T.unroll(5):
            buf[idx] = buf[idx] + shfl(buf[idx], T.shift_right(16, r))

    @T.macro
    def body(ra, rb, x, w, rows, bias, y, logits, idx, val, N):  # (idx, val: the top-k form's, not this one's)
        for t in T.thread_binding(N, thread="blockIdx.x"):
            for b in T.thread_binding(NB, thread="blockIdx.y"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    with T.sblock("norm_router"):
                        T.reads()
                        T.writes()
                        ys = T.sblock_alloc_buffer((D,), spec.y_dtype, scope="shared")
                        red = T.sblock_alloc_buffer((NW,), "float32", scope="shared")
                        xl = T.sblock_alloc_buffer((IT * VEC,), spec.x_dtype, scope="local")
                        bl = T.sblock_alloc_buffer((VEC,), spec.x_dtype, scope="local")
                        wl = T.sblock_alloc_buffer((IT * VEC,), spec.weight_dtype, scope="local")
                        yl = T.sblock_alloc_buffer((VEC,), spec.y_dtype, scope="local")
                        rl = T.sblock_alloc_buffer((RIT * RVEC if PRE else RVEC,), spec.rows_dtype, scope="local")
                        sl = T.sblock_alloc_buffer((RVEC,), spec.y_dtype, scope="local")
                        acc = T.sblock_alloc_buffer((2,), "float32", scope="local")
                        lane: T.let[T.int32] = tx % 32
                        warp: T.let[T.int32] = tx // 32
                        # ---- the norm's weight and the warp's router row into registers with the row: every global
                        # load of the kernel in one round, before its barriers
                        for i in T.unroll(IT):
                            if full or (i * NT + tx) * VEC < D:
                                for v in T.vectorized(VEC):
                                    wl[i * VEC + v] = w[(i * NT + tx) * VEC + v]
                        if PRE and b * NW + warp < E:
                            for i in T.unroll(RIT):
                                if rfull or (i * 32 + lane) * RVEC < D:
                                    router_row(rows, rl, i * RVEC, b * NW + warp, (i * 32 + lane) * RVEC)
                        # ---- the row, once, into registers; the sum of squares
                        acc[0] = T.float32(0)
                        for i in T.unroll(IT):
                            if full or (i * NT + tx) * VEC < D:
                                if spec.residual:  # x = ra + rb, rounded as stored; this block's share written out
                                    for v in T.vectorized(VEC):
                                        xl[i * VEC + v] = ra[t, (i * NT + tx) * VEC + v]
                                    for v in T.vectorized(VEC):
                                        bl[v] = rb[t, (i * NT + tx) * VEC + v]
                                    for v in T.unroll(VEC):
                                        xl[i * VEC + v] = T.Cast(spec.x_dtype, _f32(xl[i * VEC + v]) + _f32(bl[v]))
                                    if (i * NT + tx) % NB == b:
                                        for v in T.vectorized(VEC):
                                            x[t, (i * NT + tx) * VEC + v] = xl[i * VEC + v]
                                else:
                                    for v in T.vectorized(VEC):
                                        xl[i * VEC + v] = x[t, (i * NT + tx) * VEC + v]
                                for v in T.unroll(VEC):
                                    acc[0] = acc[0] + _f32(xl[i * VEC + v]) * _f32(xl[i * VEC + v])
                        warp_sum(acc, 0)
                        if lane == 0:
                            red[warp] = acc[0]
                        T.tvm_storage_sync("shared")
                        acc[0] = T.float32(0)
                        for k in T.unroll(NW):
                            acc[0] = acc[0] + red[k]
                        acc[1] = T.rsqrt(acc[0] / T.float32(D) + T.float32(eps))
                        # ---- normalise: the row to shared memory (as stored), this block's share to y
                        for i in T.unroll(IT):
                            if full or (i * NT + tx) * VEC < D:
                                for v in T.unroll(VEC):
                                    yl[v] = T.Cast(spec.y_dtype, _f32(wl[i * VEC + v]) * (_f32(xl[i * VEC + v]) * acc[1]))
                                for v in T.vectorized(VEC):
                                    ys[(i * NT + tx) * VEC + v] = yl[v]
                                if (i * NT + tx) % NB == b:
                                    for v in T.vectorized(VEC):
                                        y[t, (i * NT + tx) * VEC + v] = yl[v]
                        T.tvm_storage_sync("shared")
                        # ---- one logit per warp
                        if b * NW + warp < E:
                            acc[0] = T.float32(0)
                            for i in T.unroll(RIT):
                                if rfull or (i * 32 + lane) * RVEC < D:
                                    if not PRE:
                                        router_row(rows, rl, 0, b * NW + warp, (i * 32 + lane) * RVEC)
                                    for v in T.vectorized(RVEC):
                                        sl[v] = ys[(i * 32 + lane) * RVEC + v]
                                    for v in T.unroll(RVEC):
                                        acc[0] = acc[0] + _f32(sl[v]) * _f32(rl[(i if PRE else 0) * RVEC + v])
                            warp_sum(acc, 0)
                            if lane == 0:
                                if has_bias:
                                    logits[t, b * NW + warp] = T.Cast(spec.logits_dtype, acc[0] + _f32(bias[b * NW + warp]))
                                else:
                                    logits[t, b * NW + warp] = T.Cast(spec.logits_dtype, acc[0])

    return _signature(spec, body)


def _make_cuda_tokens(spec: NormRouterSpec):
    """The multi-token CUDA form (``spec.tokens`` rows a block; see the module's docstring)."""
    D, E, eps, TB = spec.hidden, spec.outputs, float(spec.eps), spec.tokens
    has_bias, ed = spec.bias_dtype is not None, spec.rows_layout == "ed"
    cfg = launch_config(spec)
    NW, VEC, RVEC, IT, RIT = (cfg[k] for k in ("warps", "vec", "rows_vec", "iters", "rows_iters"))
    full = D % (32 * VEC) == 0  # every lane has IT whole chunks of a row
    rfull = D % (32 * RVEC) == 0
    RPW = -(-TB // NW)  # rows a warp normalises
    router_row = _router_row(ed, RVEC)
    TOPK = spec.topk > 0
    C = -(-E // 32)  # top-k: logits a lane holds
    if TOPK:
        select = warp_select(E, spec.topk, spec.index_dtype, spec.values_dtype, softmax=True)

    def shfl(v, o):
        return T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), v, o, 32, 32)

    @T.macro
    def body(ra, rb, x, w, rows, bias, y, logits, idx, val, N):
        for blk in T.thread_binding((N + TB - 1) // TB, thread="blockIdx.x"):
            for tx in T.thread_binding(32 * NW, thread="threadIdx.x"):
                with T.sblock("norm_router_tokens"):
                    T.reads()
                    T.writes()
                    ys = T.sblock_alloc_buffer((TB * D,), spec.y_dtype, scope="shared")
                    ls = T.sblock_alloc_buffer((TB * E if TOPK else 1,), "float32", scope="shared")  # top-k: logits as stored
                    vals = T.sblock_alloc_buffer((C,), "float32", scope="local")  # top-k: the warp's row, C a lane
                    taken = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    stat = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    bv = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    bi = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    ov = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    oi = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    xl = T.sblock_alloc_buffer((IT * VEC,), spec.x_dtype, scope="local")
                    bl = T.sblock_alloc_buffer((VEC,), spec.x_dtype, scope="local")
                    wl = T.sblock_alloc_buffer((VEC,), spec.weight_dtype, scope="local")
                    yl = T.sblock_alloc_buffer((VEC,), spec.y_dtype, scope="local")
                    rl = T.sblock_alloc_buffer((RVEC,), spec.rows_dtype, scope="local")
                    sl = T.sblock_alloc_buffer((RVEC,), spec.y_dtype, scope="local")
                    acc = T.sblock_alloc_buffer((TB,), "float32", scope="local")
                    rs = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    lane: T.let[T.int32] = tx % 32
                    warp: T.let[T.int32] = tx // 32
                    t0: T.let[T.int32] = T.Cast("int32", blk) * TB
                    n32: T.let[T.int32] = T.Cast("int32", N)
                    # ---- each warp normalises its rows: into shared memory and y (x too with the residual add)
                    for j in T.unroll(RPW):
                        if j * NW + warp < TB and t0 + j * NW + warp < n32:
                            acc[0] = T.float32(0)
                            for i in T.unroll(IT):
                                if full or (i * 32 + lane) * VEC < D:
                                    if spec.residual:
                                        for v in T.vectorized(VEC):
                                            xl[i * VEC + v] = ra[t0 + j * NW + warp, (i * 32 + lane) * VEC + v]
                                        for v in T.vectorized(VEC):
                                            bl[v] = rb[t0 + j * NW + warp, (i * 32 + lane) * VEC + v]
                                        for v in T.unroll(VEC):
                                            xl[i * VEC + v] = T.Cast(spec.x_dtype, _f32(xl[i * VEC + v]) + _f32(bl[v]))
                                        for v in T.vectorized(VEC):
                                            x[t0 + j * NW + warp, (i * 32 + lane) * VEC + v] = xl[i * VEC + v]
                                    else:
                                        for v in T.vectorized(VEC):
                                            xl[i * VEC + v] = x[t0 + j * NW + warp, (i * 32 + lane) * VEC + v]
                                    for v in T.unroll(VEC):
                                        acc[0] = acc[0] + _f32(xl[i * VEC + v]) * _f32(xl[i * VEC + v])
                            for r in T.unroll(5):
                                acc[0] = acc[0] + shfl(acc[0], T.shift_right(16, r))
                            rs[0] = T.rsqrt(acc[0] / T.float32(D) + T.float32(eps))
                            for i in T.unroll(IT):
                                if full or (i * 32 + lane) * VEC < D:
                                    for v in T.vectorized(VEC):
                                        wl[v] = w[(i * 32 + lane) * VEC + v]
                                    for v in T.unroll(VEC):
                                        yl[v] = T.Cast(spec.y_dtype, _f32(wl[v]) * (_f32(xl[i * VEC + v]) * rs[0]))
                                    for v in T.vectorized(VEC):
                                        ys[(j * NW + warp) * D + (i * 32 + lane) * VEC + v] = yl[v]
                                    for v in T.vectorized(VEC):
                                        y[t0 + j * NW + warp, (i * 32 + lane) * VEC + v] = yl[v]
                    T.tvm_storage_sync("shared")
                    # ---- each warp: the logits of experts warp, warp + NW, ... for all TB rows
                    for e0 in T.serial((E + NW - 1) // NW):
                        if e0 * NW + warp < E:
                            for k in T.unroll(TB):
                                acc[k] = T.float32(0)
                            for i in T.unroll(RIT):
                                if rfull or (i * 32 + lane) * RVEC < D:
                                    router_row(rows, rl, 0, e0 * NW + warp, (i * 32 + lane) * RVEC)
                                    for k in T.unroll(TB):
                                        for v in T.vectorized(RVEC):
                                            sl[v] = ys[k * D + (i * 32 + lane) * RVEC + v]
                                        for v in T.unroll(RVEC):
                                            acc[k] = acc[k] + _f32(sl[v]) * _f32(rl[v])
                            for k in T.unroll(TB):
                                for r in T.unroll(5):
                                    acc[k] = acc[k] + shfl(acc[k], T.shift_right(16, r))
                            if lane == 0:
                                for k in T.unroll(TB):
                                    if t0 + k < n32:
                                        if TOPK:  # (no bias: check)
                                            ls[k * E + e0 * NW + warp] = _f32(T.Cast(spec.logits_dtype, acc[k]))
                                        elif has_bias:
                                            logits[t0 + k, e0 * NW + warp] = T.Cast(spec.logits_dtype, acc[k] + _f32(bias[e0 * NW + warp]))
                                        else:
                                            logits[t0 + k, e0 * NW + warp] = T.Cast(spec.logits_dtype, acc[k])
                    if TOPK:
                        # ---- the top-k of each row's softmax: warp w selects rows w, w + NW, ... (as topk_softmax's warp
                        # form: lane l holds logits l, l + 32, ...; K passes of a warp argmax, the lower index on a tie)
                        T.tvm_storage_sync("shared")
                        for j in T.unroll(RPW):
                            if j * NW + warp < TB and t0 + j * NW + warp < n32:
                                for c in T.unroll(C):
                                    vals[c] = T.if_then_else(c * 32 + lane < E, ls[(j * NW + warp) * E + T.min(c * 32 + lane, E - 1)],
                                                             T.float32(NEG))
                                select(vals, taken, stat, bv, bi, ov, oi, lane, idx, val, t0 + j * NW + warp)

    return _signature(spec, body)


def _signature(spec: NormRouterSpec, body):
    """The PrimFunc around ``body``: (x, w, rows, [bias], y, logits), or with ``residual`` (ra, rb, w, rows, [bias],
    x, y, logits); with ``topk`` K, (idx [T, K], val [T, K]) in place of the logits (no bias); T dynamic."""
    D, E = spec.hidden, spec.outputs
    rows_shape = (E, D) if spec.rows_layout == "ed" else (D, E)
    attrs = {"tirx.is_scheduled": True, "global_symbol": "norm_router", "tirx.noalias": True}
    bias_dtype = spec.bias_dtype or spec.logits_dtype  # (no bias: the body never reads it)
    K = spec.topk
    if K and spec.residual:
        @T.prim_func(s_tir=True)
        def norm_router(ra_h: T.handle, rb_h: T.handle, w_h: T.handle, rows_h: T.handle, x_h: T.handle, y_h: T.handle,
                        idx_h: T.handle, val_h: T.handle):
            T.func_attr(attrs)
            N = T.int64()
            ra = T.match_buffer(ra_h, (N, D), spec.x_dtype)
            rb = T.match_buffer(rb_h, (N, D), spec.x_dtype)
            w = T.match_buffer(w_h, (D,), spec.weight_dtype)
            rows = T.match_buffer(rows_h, rows_shape, spec.rows_dtype)
            x = T.match_buffer(x_h, (N, D), spec.x_dtype)
            y = T.match_buffer(y_h, (N, D), spec.y_dtype)
            idx = T.match_buffer(idx_h, (N, K), spec.index_dtype)
            val = T.match_buffer(val_h, (N, K), spec.values_dtype)
            body(ra, rb, x, w, rows, val, y, val, idx, val, N)  # no bias, no logits: never read or written
    elif K:
        @T.prim_func(s_tir=True)
        def norm_router(x_h: T.handle, w_h: T.handle, rows_h: T.handle, y_h: T.handle, idx_h: T.handle, val_h: T.handle):
            T.func_attr(attrs)
            N = T.int64()
            x = T.match_buffer(x_h, (N, D), spec.x_dtype)
            w = T.match_buffer(w_h, (D,), spec.weight_dtype)
            rows = T.match_buffer(rows_h, rows_shape, spec.rows_dtype)
            y = T.match_buffer(y_h, (N, D), spec.y_dtype)
            idx = T.match_buffer(idx_h, (N, K), spec.index_dtype)
            val = T.match_buffer(val_h, (N, K), spec.values_dtype)
            body(x, x, x, w, rows, val, y, val, idx, val, N)  # no residual, bias or logits
    elif spec.residual and spec.bias_dtype is not None:
        @T.prim_func(s_tir=True)
        def norm_router(ra_h: T.handle, rb_h: T.handle, w_h: T.handle, rows_h: T.handle, bias_h: T.handle, x_h: T.handle,
                        y_h: T.handle, logits_h: T.handle):
            T.func_attr(attrs)
            N = T.int64()
            ra = T.match_buffer(ra_h, (N, D), spec.x_dtype)
            rb = T.match_buffer(rb_h, (N, D), spec.x_dtype)
            w = T.match_buffer(w_h, (D,), spec.weight_dtype)
            rows = T.match_buffer(rows_h, rows_shape, spec.rows_dtype)
            bias = T.match_buffer(bias_h, (E,), bias_dtype)
            x = T.match_buffer(x_h, (N, D), spec.x_dtype)
            y = T.match_buffer(y_h, (N, D), spec.y_dtype)
            logits = T.match_buffer(logits_h, (N, E), spec.logits_dtype)
            body(ra, rb, x, w, rows, bias, y, logits, logits, logits, N)
    elif spec.residual:
        @T.prim_func(s_tir=True)
        def norm_router(ra_h: T.handle, rb_h: T.handle, w_h: T.handle, rows_h: T.handle, x_h: T.handle, y_h: T.handle,
                        logits_h: T.handle):
            T.func_attr(attrs)
            N = T.int64()
            ra = T.match_buffer(ra_h, (N, D), spec.x_dtype)
            rb = T.match_buffer(rb_h, (N, D), spec.x_dtype)
            w = T.match_buffer(w_h, (D,), spec.weight_dtype)
            rows = T.match_buffer(rows_h, rows_shape, spec.rows_dtype)
            x = T.match_buffer(x_h, (N, D), spec.x_dtype)
            y = T.match_buffer(y_h, (N, D), spec.y_dtype)
            logits = T.match_buffer(logits_h, (N, E), spec.logits_dtype)
            body(ra, rb, x, w, rows, logits, y, logits, logits, logits, N)  # no bias: never read
    elif spec.bias_dtype is not None:
        @T.prim_func(s_tir=True)
        def norm_router(x_h: T.handle, w_h: T.handle, rows_h: T.handle, bias_h: T.handle, y_h: T.handle, logits_h: T.handle):
            T.func_attr(attrs)
            N = T.int64()
            x = T.match_buffer(x_h, (N, D), spec.x_dtype)
            w = T.match_buffer(w_h, (D,), spec.weight_dtype)
            rows = T.match_buffer(rows_h, rows_shape, spec.rows_dtype)
            bias = T.match_buffer(bias_h, (E,), bias_dtype)
            y = T.match_buffer(y_h, (N, D), spec.y_dtype)
            logits = T.match_buffer(logits_h, (N, E), spec.logits_dtype)
            body(x, x, x, w, rows, bias, y, logits, logits, logits, N)  # no residual: ra, rb never read
    else:
        @T.prim_func(s_tir=True)
        def norm_router(x_h: T.handle, w_h: T.handle, rows_h: T.handle, y_h: T.handle, logits_h: T.handle):
            T.func_attr(attrs)
            N = T.int64()
            x = T.match_buffer(x_h, (N, D), spec.x_dtype)
            w = T.match_buffer(w_h, (D,), spec.weight_dtype)
            rows = T.match_buffer(rows_h, rows_shape, spec.rows_dtype)
            y = T.match_buffer(y_h, (N, D), spec.y_dtype)
            logits = T.match_buffer(logits_h, (N, E), spec.logits_dtype)
            body(x, x, x, w, rows, x, y, logits, logits, logits, N)  # no residual, no bias: never read
    return norm_router


def reference(x, w, rows, bias, eps: float, y_dtype=None, logits_dtype=None, rows_layout: str = "ed"):
    """NumPy reference of the kernel (float32 math, ``y`` rounded to ``y_dtype`` before the router)."""
    import numpy as np

    xf = np.asarray(x, np.float32)
    r = 1.0 / np.sqrt((xf * xf).sum(-1, keepdims=True, dtype=np.float32) / np.float32(xf.shape[-1]) + np.float32(eps))
    y = (np.asarray(w, np.float32) * (xf * r)).astype(y_dtype or x.dtype)
    rf = np.asarray(rows, np.float32)
    logits = y.astype(np.float32) @ (rf.T if rows_layout == "ed" else rf)
    if bias is not None:
        logits = logits + np.asarray(bias, np.float32)
    return y, logits.astype(logits_dtype or np.float32)


def reference_topk(logits, k: int):
    """NumPy reference of the top-k form: each row's k largest logits (the lower index first on a tie; stable) and
    their softmax over the row, in float32 from the logits as stored."""
    import numpy as np

    lf = np.asarray(logits, np.float32)
    idx = np.argsort(-lf, axis=-1, kind="stable")[:, :k]
    p = np.exp(lf - lf.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return idx, np.take_along_axis(p, idx, -1)


__all__ = ["NormRouterSpec", "check_supported", "launch_config", "make_norm_router", "prefill_spec", "reference",
           "reference_topk"]
