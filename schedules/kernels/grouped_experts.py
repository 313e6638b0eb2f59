"""Grouped expert GEMMs of an MoE layer (TIR): routing prep, gate_up + SwiGLU, down + routing weight, combine.

Legend: T tokens, K active experts per token, S = T * K token-slots (slot ``s = t * K + k``), E experts,
D hidden, I expert width. Per layer::

    offsets, order = route_prep(ids)              # ids [T, K] -> offsets [E + 1] int32, order [S] int32
                                                  # order: the slots grouped by expert (counting sort, stable),
                                                  # expert e's slots are order[offsets[e] : offsets[e + 1]]
    h[p]  = silu(x[t] @ Wg[e]^T) * (x[t] @ Wu[e]^T)   # p in expert e's range, s = order[p], t = s // K
                                                  # W1 [E, 2I, D]: Wg its rows [0, I) (or [I, 2I), ``gate_first``)
    y[s]  = rw[s] * (h[p] @ W2[e]^T)              # W2 [E, D, I]; rw [T, K] the routing weights; y float32 [S, D]
    out[t] = sum_k y[t * K + k]                   # in slot order k = 0..K-1 (deterministic, no float atomics)

Offloaded experts (``slots`` = S): W1, W2 (and FP8 scales) are a pool of S expert slots [S, ...], fewer than E
when the experts do not all fit; the GEMMs then take ``offsets`` [2E + 1], route_prep's bounds followed by each
expert's slot (the expert cache's residency table, concatenated by the graph), read once per block. Only the
routed experts' entries are read; the others may name any slot or none.

FP8 weights (``w_format="fp8"``): W1 and W2 as e4m3 bytes (uint8) with one float32 scale per output
channel, s1 [E, 2I] and s2 [E, D] (``quantize_fp8``); the bytes are decoded in registers with integer
arithmetic (TVM's llvm fp8 cast is wrong, so both forms decode the same way) and each dot product is
multiplied by its row's scale once, after the reduction. Half the weight bytes of bf16.

All products accumulate in float32; ``h`` is stored in ``h_dtype`` (the model's activation dtype, as the
imported graph rounds its SwiGLU output), ``y`` in float32 and ``out`` in ``out_dtype``. Slots whose
expert id is outside [0, E) (after the numpy/ONNX wrap of negative ids) belong to no expert and add 0.

Forms (``target``): "llvm", serial loops (CPU builds and CI); "cuda":

  * route_prep: one block of 32 warps (fewer for experts past 159, ``prep_warps``; at most PREP_MAX_EXPERTS). Warp
    w owns a contiguous chunk of the S slots and reads it 32 at a time; the lanes holding one expert find each
    other (``__match_any_sync``) and the lowest of them adds their number to the warp's count of the expert in
    shared memory ([warp][E + 1]: the lanes with nothing to add write column E, so every lane makes the same
    shared accesses and the barriers TVM places stay out of branches). Then a thread per expert totals the warps'
    counts, the offsets are the exclusive prefix of the totals, and each warp's places of the expert start at the
    offset plus the earlier warps' counts. A second read of the chunk places each slot at its expert's next place
    plus the lanes below it with the same expert, and the lowest of them moves the place on. The same stable order
    as the llvm form; no atomics; one match a 32 slots (before, a ballot per expert: 64 for OLMoE).
  * gate_up / down: a grid of (output tiles, E) blocks of NW warps; the block of (tile, e) reads
    ``offsets[e], offsets[e + 1]`` and exits at once if the expert has no token (its weights are never
    read). Warp w owns one output column (gate and up rows j and I + j; or a row d of W2). Its tokens go
    in tiles of TB: the weight row is streamed once per tile with 16-byte vector loads (8 bf16 per lane),
    each lane accumulates TB (x2 for gate/up) float32 partial dot products, then warp shuffles reduce them
    and lane 0 writes the tile's outputs. With up to TB (16) tokens per expert, as at decode batch sizes
    (OLMoE at 128 tokens: 16 slots per expert on average), each weight byte of an active expert is read
    once; more tokens re-read the row once per tile (from L2 when it still holds it). The grid depends on E
    and the weight shapes only, not
    on T: nothing is padded to the worst case, token counts are dynamic.
  * gate_up / down with 16-bit weights (``mma_eligible``): tensor cores (mma.sync m16n8k16, ``_make_gate_up_mma``),
    operands loaded straight into registers; or, with ``stages`` >= 2, staged through shared memory by
    ``cp.async`` with up to ``stages`` k-steps in flight per block (``_mma_pipe_mainloop``, ``mma_stages``: as
    many as fit in 48 KB), the tokens of a pass copied once per block.
  * gate_up / down with ``spec.tiled`` (16-bit weights): block-tiled for prefill chunks (``_make_tiled``), a block
    of 8 warps per (128 weight rows, expert) looping over the expert's tokens 128 at a time, both operands staged
    through shared memory and read by ldmatrix, so a weight tile serves 128 tokens and a token row 128 rows.
  * combine: one block per token, threads over D.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

try:
    from tvm.script import tirx as T
except ImportError:  # runtime-only TVM (the GPU bench): the spec and launch_config still work
    T = None

from ...compiler.errors import MoecError

DTYPES = ("float32", "float16", "bfloat16")
ID_DTYPES = ("int32", "int64")
_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
PREP_WARPS = 32
PREP_SHARED = 40960  # bytes of the per-warp expert counts and places of route_prep's CUDA form
PREP_MAX_EXPERTS = 2048  # route_prep's CUDA form: its one block's shared memory holds the counts of this many


def prep_warps(experts: int) -> int:
    """Warps of route_prep's CUDA form: 32, fewer where their [warps, E + 1] int32 counts and places (two arrays)
    would not fit PREP_SHARED."""
    return max(1, min(PREP_WARPS, PREP_SHARED // (8 * (experts + 1))))


# the block-tiled forms' shapes (``_tile_mainloop``)
TILE_TOKENS, TILE_ROWS, TILE_PAD = 128, 128, 8
TILE_KS = (32, 64)  # k a stage (tile_k): 4 or 8 chunks of 16 bytes a row
TILE_K, TILE_STAGES = 32, 3  # the defaults (GroupedExpertsSpec.tile_k / tile_stages, dense_gemm.make_dense_tiled)
TILE_MAX_STAGES = 6


@dataclass(frozen=True)
class GroupedExpertsSpec:
    """One MoE layer's routed experts (one set of kernels per distinct spec)."""

    hidden: int  # D
    inter: int  # I
    experts: int  # E
    top_k: int  # K
    x_dtype: str = "float32"  # hidden state [T, D]
    w_dtype: str = "float32"  # W1 [E, 2I, D] and W2 [E, D, I]
    h_dtype: str = "float32"  # SwiGLU output [S, I]
    rw_dtype: str = "float32"  # routing weights [S]
    out_dtype: str = "float32"  # combined output [T, D]
    ids_dtype: str = "int64"
    gate_first: bool = True  # W1 rows [0, I) are the gate (silu) half
    w_format: str = "float"  # "float": W1, W2 of w_dtype; "fp8": e4m3 bytes (uint8) + float32 scales per output channel
    token_tile: int = 16  # TB: tokens of an expert per weight pass (CUDA form)
    warps: int = 4  # NW: warps per block of the GEMMs (CUDA form)
    tensor_cores: bool = True  # CUDA: mma.sync forms of gate_up / down where ``mma_eligible`` (else the warp-per-row form)
    n_tiles: int = 0  # NT: 8-token tiles of an expert per weight pass of the mma forms (0: from E and K, ``mma_tiles``)
    row_tiles: int = 0  # RT: 16-row tiles per warp of the mma forms, 1 or 2 (0: from NT, ``mma_tiles``)
    stages: int = 4  # mma forms: 0 loads into registers; 2..8 at most that many cp.async stages through shared memory
    l2_prefetch: int = 256  # cp.async stages: the L2::<n>B prefetch hint of the weight copies (0 none, 64, 128, 256)
    slots: int = 0  # 0: W1, W2 stacked per expert [E, ...]; S: a pool of S expert slots [S, ...] (offloaded experts):
    #                 the GEMMs then take offsets [2E + 1], the bounds and then each expert's slot (``_weight_slot``)
    pass_blocks: bool = False  # cp.async forms: a block per weight pass (grid x: passes, y: row tiles x experts) instead
    #                 of a block looping over an expert's passes (``_pass_grid``)
    dyn_shared: int = 0  # cp.async forms: 0, the stages in static shared memory (SMEM_LIMIT); else in dynamic shared
    #                 memory of at most this many bytes (up to DYN_SMEM_LIMIT): more stages for gate_up, whose stage is 20 KB
    w_tiles: bool = False  # FP8 weights, cp.async forms: stored tile-major (``tile_fp8``): a warp's k-step of a 16-row
    #                 tile is 1 KB of contiguous bytes, its k loop one contiguous stream (rows: 64 bytes from 16 places)
    min_blocks: int = 0  # cp.async forms: 0, or __launch_bounds__ of gate_up and down declaring that many blocks an SM
    #                 (registers capped at 65536 / (32 warps min_blocks))
    interleave: bool = False  # cp.async forms: a k-step's mma k16 step by k16 step over every (row tile, token tile),
    #                 not a token tile's four at a time (``_mma_pipe_mainloop``)
    tiled: bool = False  # 16-bit weights on tensor cores: block-tiled gate_up and down (``_make_tiled``: 128 tokens x
    #                 128 output rows a tile, both operands through shared memory, ldmatrix), for prefill-sized chunks
    tile_k: int = TILE_K  # tiled: k a cp.async stage (32 or 64)
    tile_stages: int = TILE_STAGES  # tiled: stages in the ring (2..TILE_MAX_STAGES; dynamic shared memory past 48 KB)

    def check(self) -> None:
        if not isinstance(self.slots, int) or isinstance(self.slots, bool) or self.slots < 0:
            raise MoecError(f"grouped_experts: slots must be 0 (weights per expert) or a positive slot count, got {self.slots!r}")
        if not isinstance(self.n_tiles, int) or isinstance(self.n_tiles, bool) or not 0 <= self.n_tiles <= 8:
            raise MoecError(f"grouped_experts: n_tiles must be an integer in 0..8, got {self.n_tiles!r}")
        if self.row_tiles not in (0, 1, 2) or isinstance(self.row_tiles, bool):
            raise MoecError(f"grouped_experts: row_tiles must be 0 (automatic), 1 or 2, got {self.row_tiles!r}")
        if not isinstance(self.stages, int) or isinstance(self.stages, bool) or self.stages == 1 or not 0 <= self.stages <= 8:
            raise MoecError(f"grouped_experts: stages must be 0 (register loads) or 2..8, got {self.stages!r}")
        check_dyn_shared(self.dyn_shared, "grouped_experts")
        if not isinstance(self.pass_blocks, bool):
            raise MoecError(f"grouped_experts: pass_blocks must be a bool, got {self.pass_blocks!r}")
        if not isinstance(self.w_tiles, bool):
            raise MoecError(f"grouped_experts: w_tiles must be a bool, got {self.w_tiles!r}")
        if self.w_tiles and not (self.w_format == "fp8" and self.tensor_cores and self.stages and not self.tiled):
            raise MoecError("grouped_experts: w_tiles (tile-major FP8 weights) needs FP8 weights in the cp.async forms "
                            "(w_format fp8, tensor_cores, stages >= 2)")
        if not isinstance(self.min_blocks, int) or isinstance(self.min_blocks, bool) or not 0 <= self.min_blocks <= 16:
            raise MoecError(f"grouped_experts: min_blocks must be 0 (no bound) or 1..16 blocks an SM, got {self.min_blocks!r}")
        if self.min_blocks and not (self.tensor_cores and self.stages and not self.tiled):
            raise MoecError("grouped_experts: min_blocks applies to the cp.async forms (tensor_cores, stages >= 2)")
        if not isinstance(self.interleave, bool):
            raise MoecError(f"grouped_experts: interleave must be a bool, got {self.interleave!r}")
        if not isinstance(self.tiled, bool):
            raise MoecError(f"grouped_experts: tiled must be a bool, got {self.tiled!r}")
        if self.tiled and (self.w_format != "float" or not self.tensor_cores):
            raise MoecError("grouped_experts: tiled needs 16-bit weights on tensor cores (w_format float, tensor_cores)")
        check_tile(self.tile_k, self.tile_stages, "grouped_experts")
        if self.pass_blocks and not (self.stages and self.tensor_cores):
            raise MoecError("grouped_experts: pass_blocks needs the cp.async forms (tensor cores, stages >= 2)")
        if self.l2_prefetch not in (0, 64, 128, 256) or isinstance(self.l2_prefetch, bool):
            raise MoecError(f"grouped_experts: l2_prefetch must be 0, 64, 128 or 256, got {self.l2_prefetch!r}")
        for what in ("hidden", "inter", "experts", "top_k", "token_tile", "warps"):
            v = getattr(self, what)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise MoecError(f"grouped_experts: {what} must be a positive integer, got {v!r}")
        for what in ("x_dtype", "w_dtype", "h_dtype", "rw_dtype", "out_dtype"):
            if getattr(self, what) not in DTYPES:
                raise MoecError(f"grouped_experts: {what} must be one of {', '.join(DTYPES)}, got {getattr(self, what)!r}")
        if self.w_format not in ("float", "fp8"):
            raise MoecError(f"grouped_experts: w_format must be 'float' or 'fp8', got {self.w_format!r}")
        if self.ids_dtype not in ID_DTYPES:
            raise MoecError(f"grouped_experts: ids_dtype must be int32 or int64, got {self.ids_dtype!r}")
        if self.top_k > self.experts:
            raise MoecError(f"grouped_experts: top-{self.top_k} of {self.experts} experts")

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def _vec(n: int, *dtypes: str) -> int:
    """Elements per 16-byte access (of the widest dtype), halved until it divides n."""
    v = 16 // max(_BYTES[dt] for dt in dtypes)
    while n % v:
        v //= 2
    return v


def launch_config(spec: GroupedExpertsSpec) -> dict:
    """CUDA launch shapes: blocks (x, y) and threads of each kernel, vector widths, token tile."""
    nw = spec.warps
    wdt = "bfloat16" if spec.w_format == "fp8" else spec.w_dtype  # fp8: as many bytes as the activations' elements
    vec_gu = _vec(spec.hidden, wdt, spec.x_dtype)
    vec_dn = _vec(spec.inter, wdt, spec.h_dtype)
    cvec = _vec(spec.hidden, "float32", spec.out_dtype)
    cthreads = min(256, max(32, 32 * -(-(spec.hidden // cvec) // 32)))
    return {
        "route_prep": {"blocks": (1, 1), "threads": 32 * prep_warps(spec.experts)},
        "gate_up": _mma_launch(spec, "gate_up") if mma_eligible(spec, "gate_up") else {
            "form": "warp per row", "blocks": (-(-spec.inter // nw), spec.experts), "threads": 32 * nw, "vec": vec_gu,
            "iters": -(-spec.hidden // (32 * vec_gu)), "token_tile": spec.token_tile},
        "down": _mma_launch(spec, "down") if mma_eligible(spec, "down") else {
            "form": "warp per row", "blocks": (-(-spec.hidden // nw), spec.experts), "threads": 32 * nw, "vec": vec_dn,
            "iters": -(-spec.inter // (32 * vec_dn)), "token_tile": spec.token_tile},
        "combine": {"blocks": ("T", 1), "threads": cthreads, "vec": cvec, "iters": -(-spec.hidden // (cthreads * cvec))},
    }


def _warp_launch(spec: GroupedExpertsSpec) -> dict:
    """``launch_config`` of the warp-per-row forms (the llvm forms and CUDA without tensor cores)."""
    from dataclasses import replace

    return launch_config(replace(spec, tensor_cores=False))


def check_supported(spec: GroupedExpertsSpec, target: str = "llvm") -> None:
    """Raise ``MoecError`` unless the kernels of ``spec`` can be built for ``target``."""
    spec.check()
    if target not in ("llvm", "cuda"):
        raise MoecError(f"grouped_experts: target must be 'llvm' or 'cuda', got {target!r}")
    if target == "cuda" and spec.experts > PREP_MAX_EXPERTS:
        raise MoecError(f"grouped_experts: {spec.experts} experts exceed the {PREP_MAX_EXPERTS} whose counts the route_prep "
                        "kernel's shared memory holds")
    if spec.w_tiles and (target != "cuda" or not (mma_eligible(spec, "gate_up") and mma_eligible(spec, "down"))):
        raise MoecError("grouped_experts: w_tiles (tile-major FP8 weights) needs the CUDA tensor-core forms of both "
                        "kernels (rows a multiple of 16, reductions of 64)")
    if target == "cuda" and spec.tiled and (why := tiled_unsupported(spec)) is not None:
        raise MoecError(f"grouped_experts: tiled needs {why}")
    if target == "cuda" and _staged(spec) and not spec.tiled:
        for kernel in ("gate_up", "down"):
            if mma_eligible(spec, kernel) and mma_stages(spec, kernel)[0] < 2:
                raise MoecError(f"grouped_experts: two cp.async stages of {kernel} ({2 * mma_stages(spec, kernel)[1]} bytes) "
                                f"exceed {spec.dyn_shared or SMEM_LIMIT} bytes of shared memory: fewer warps, row_tiles or n_tiles")


def _f32(v):
    return T.Cast("float32", v)


def _norm_id(v, E):
    """An expert id as int32 with numpy/ONNX wrap of negative ids (out of range stays out of range)."""
    i = T.Cast("int32", v)
    return T.if_then_else(i < 0, i + E, i)


INT64_INDEX_ELEMENTS = 2**31  # stacked weights with at least this many elements are indexed in int64


def _windex(shape):
    """The weight buffer's shape, and how to index its expert axis: int64 where a flat index can pass 2^31."""
    e, r, c = shape
    if e * r * c < INT64_INDEX_ELEMENTS:
        return shape, lambda i: i
    return (T.int64(e), T.int64(r), T.int64(c)), lambda i: T.Cast("int64", i)


def _offsets_len(spec) -> int:
    """Entries of the ``offsets`` the GEMMs read: E + 1 bounds, then (``spec.slots``) each expert's weight slot."""
    return spec.experts + 1 + (spec.experts if spec.slots else 0)


def _weight_slot(spec, offsets, e):
    """Where expert ``e``'s weights sit on the stacked axis: ``e``, or with ``spec.slots`` the slot that the
    entry ``offsets[E + 1 + e]`` names (the expert cache's residency table, concatenated after the bounds)."""
    return offsets[spec.experts + 1 + e] if spec.slots else e


def _in_range(e, E):
    return T.And(e >= 0, e < E)


def _attrs(name: str) -> dict:
    return {"tirx.is_scheduled": True, "global_symbol": name, "tirx.noalias": True}


# ---------------------------------------------------------------------------- route_prep


def make_route_prep(spec: GroupedExpertsSpec, target: str = "llvm"):
    """``route_prep(ids [T, K], offsets [E + 1] int32, order [T * K] int32)``."""
    check_supported(spec, target)
    E, K = spec.experts, spec.top_k
    attrs = _attrs("moe_route_prep")

    if target == "llvm":
        @T.prim_func(s_tir=True)
        def moe_route_prep(ids_h: T.handle, off_h: T.handle, order_h: T.handle):
            T.func_attr(attrs)
            N = T.int64()
            ids = T.match_buffer(ids_h, (N, K), spec.ids_dtype)
            offsets = T.match_buffer(off_h, (E + 1,), "int32")
            order = T.match_buffer(order_h, (N * K,), "int32")
            with T.sblock("route_prep"):
                T.reads()
                T.writes()
                cur = T.sblock_alloc_buffer((E,), "int32")
                for e in T.serial(E + 1):
                    offsets[e] = 0
                for s in T.serial(N * K):
                    e: T.let[T.int32] = _norm_id(ids[s // K, s % K], E)
                    if _in_range(e, E):
                        offsets[e + 1] = offsets[e + 1] + 1
                for e in T.serial(E):
                    offsets[e + 1] = offsets[e + 1] + offsets[e]
                    cur[e] = offsets[e]
                for s in T.serial(N * K):
                    e2: T.let[T.int32] = _norm_id(ids[s // K, s % K], E)
                    if _in_range(e2, E):
                        order[cur[e2]] = T.Cast("int32", s)
                        cur[e2] = cur[e2] + 1

        return moe_route_prep

    NWP = prep_warps(E)
    EPW = -(-E // 32)  # 32-column strips of a warp's [E + 1] row (each lane zeroes its column of each)

    def match(v):
        return T.call_extern("uint32", "__match_any_sync", T.uint32(0xFFFFFFFF), v)

    def popc(m):
        return T.call_extern("int32", "__popc", m)

    def below(lane):  # the lanes under ``lane``
        return (T.uint32(1) << T.Cast("uint32", lane)) - T.uint32(1)

    def lead_at(e, mask, lane, warp):
        """The warp's [E + 1] column this lane updates: its expert's if it is the lowest lane holding it, else E."""
        lead = T.And(_in_range(e, E), (T.Cast("uint32", mask) & below(lane)) == T.uint32(0))
        return T.if_then_else(lead, warp * (E + 1) + T.max(e, 0), warp * (E + 1) + E)

    @T.prim_func(s_tir=True)
    def moe_route_prep(ids_h: T.handle, off_h: T.handle, order_h: T.handle):
        T.func_attr(attrs)
        N = T.int64()
        ids = T.match_buffer(ids_h, (N, K), spec.ids_dtype)
        offsets = T.match_buffer(off_h, (E + 1,), "int32")
        order = T.match_buffer(order_h, (N * K,), "int32")
        for bx in T.thread_binding(1, thread="blockIdx.x"):
            for tx in T.thread_binding(32 * NWP, thread="threadIdx.x"):
                with T.sblock("route_prep"):
                    T.reads()
                    T.writes()
                    # [warp][expert + 1]: each warp's count, then next place, of each expert; column E takes the
                    # lanes with nothing to add (so every lane runs the same shared accesses: no branch to sync inside)
                    hist = T.sblock_alloc_buffer((NWP * (E + 1),), "int32", scope="shared")
                    place = T.sblock_alloc_buffer((NWP * (E + 1),), "int32", scope="shared")  # (next places, alike)
                    tot = T.sblock_alloc_buffer((E,), "int32", scope="shared")  # slots of each expert
                    loc = T.sblock_alloc_buffer((5,), "int32", scope="local")
                    lane: T.let[T.int32] = tx % 32
                    warp: T.let[T.int32] = tx // 32
                    S: T.let[T.int32] = T.Cast("int32", N * K)
                    CH: T.let[T.int32] = ((S + NWP - 1) // NWP + 31) // 32 * 32  # slots per warp: a contiguous chunk
                    for j in T.serial(EPW + 1):
                        if j * 32 + lane <= E:
                            hist[warp * (E + 1) + j * 32 + lane] = 0
                    # ---- counts per warp: 32 slots at a time; the lanes holding one expert find each other (match), and
                    # the lowest of them adds their number to the warp's count of it
                    for c in T.serial(CH // 32):
                        s = warp * CH + c * 32 + lane
                        loc[0] = T.if_then_else(s < S, _norm_id(ids[T.min(s, S - 1) // K, T.min(s, S - 1) % K], E), -1)
                        loc[1] = T.Cast("int32", match(loc[0]))
                        loc[4] = lead_at(loc[0], loc[1], lane, warp)
                        hist[loc[4]] = hist[loc[4]] + popc(T.Cast("uint32", loc[1]))
                    T.tvm_storage_sync("shared")
                    # ---- offsets: a thread per expert totals its warps' counts, then sums the totals before it; each
                    # warp's count becomes where its slots of that expert start (stable: warps hold ascending slots)
                    for i in T.serial((E + 32 * NWP - 1) // (32 * NWP)):
                        e: T.let[T.int32] = i * 32 * NWP + tx
                        if e < E:
                            loc[2] = 0
                            for w in T.serial(NWP):
                                loc[2] = loc[2] + hist[w * (E + 1) + e]
                            tot[e] = loc[2]
                    T.tvm_storage_sync("shared")
                    for i in T.serial((E + 32 * NWP - 1) // (32 * NWP)):
                        e2: T.let[T.int32] = i * 32 * NWP + tx
                        if e2 < E:
                            loc[2] = 0
                            for q in T.serial(e2):
                                loc[2] = loc[2] + tot[q]
                            offsets[e2] = loc[2]
                            if e2 == E - 1:
                                offsets[E] = loc[2] + tot[e2]
                            for w in T.serial(NWP):  # warp w's slots of the expert start after the earlier warps'
                                place[w * (E + 1) + e2] = loc[2]
                                loc[2] = loc[2] + hist[w * (E + 1) + e2]
                    T.tvm_storage_sync("shared")
                    # ---- the order: a slot goes to its expert's next place in the warp plus the lanes below it with the
                    # expert; then the lowest of those lanes moves the place on by their number
                    for c in T.serial(CH // 32):
                        s2 = warp * CH + c * 32 + lane
                        loc[0] = T.if_then_else(s2 < S, _norm_id(ids[T.min(s2, S - 1) // K, T.min(s2, S - 1) % K], E), -1)
                        loc[1] = T.Cast("int32", match(loc[0]))
                        loc[2] = place[warp * (E + 1) + T.if_then_else(_in_range(loc[0], E), loc[0], E)]
                        if _in_range(loc[0], E):
                            order[loc[2] + popc(T.Cast("uint32", loc[1]) & below(lane))] = s2
                        loc[4] = lead_at(loc[0], loc[1], lane, warp)
                        place[loc[4]] = loc[2] + popc(T.Cast("uint32", loc[1]))

    return moe_route_prep


# ---------------------------------------------------------------------------- tensor-core (mma.sync) forms

MMA_K = 64  # reduction elements a warp takes per step: 4 mma.sync m16n8k16, 16 contiguous elements per lane
_MMA_TYPE = {"bfloat16": "bf16", "float16": "fp16"}


def mma_eligible(spec: GroupedExpertsSpec, kernel: str) -> bool:
    """Whether the CUDA ``kernel`` ("gate_up" or "down") of ``spec`` has an mma.sync form: 16-bit float
    weights with activations of the same dtype, the reduction a multiple of 64 and the rows of 16."""
    act, rows, red = (spec.x_dtype, spec.inter, spec.hidden) if kernel == "gate_up" else (spec.h_dtype, spec.hidden, spec.inter)
    if not spec.tensor_cores or red % MMA_K or rows % 16:
        return False
    if spec.w_format == "fp8":  # e4m3 bytes widened in registers to the activations' 16-bit type
        return act in _MMA_TYPE
    return spec.w_dtype in _MMA_TYPE and act == spec.w_dtype


def _staged(spec: GroupedExpertsSpec) -> bool:
    """Whether the mma forms stage their operands through shared memory (``stages``; 16-bit or FP8 weights)."""
    return bool(spec.stages)


# e4m3 byte -> the 16-bit float whose bits hold its sign, exponent and mantissa in place: exact, with the value
# scaled by 2^-120 (bfloat16, 8 exponent bits) or 2^-8 (float16, 5); the epilogues multiply it back
_FP8_WIDEN = {"bfloat16": (4, 2.0**120), "float16": (7, 2.0**8)}


def _fp8_widen(byte, dtype: str):
    shift = _FP8_WIDEN[dtype][0]
    b = T.Cast("uint32", byte)
    return T.reinterpret(dtype, T.Cast("uint16", ((b & T.uint32(0x80)) << T.uint32(8)) | ((b & T.uint32(0x7F)) << T.uint32(shift))))


# The cp.async forms widen two bytes a register (``_fp8_widen_pair``): to bfloat16 as ``_fp8_widen``'s bits (2^-120
# times the value), to float16 by the conversion instruction (the value itself); the epilogues multiply this back
_FP8_PAIR_FACTOR = {"bfloat16": 2.0**120, "float16": 1.0}


def _register_prelude() -> None:
    from ..cuda_prelude import register

    register()


def _fp8_widen_pair(word, half: int, dtype: str):
    """Two e4m3 bytes of a uint32 ``word`` (bytes 0, 1 for ``half`` 0, bytes 2, 3 for 1) widened into the two 16-bit
    halves of a uint32 (the lower byte in the lower half: an mma fragment register), ``_FP8_PAIR_FACTOR[dtype]``
    times smaller than their values. float16: ``cvt.rn.f16x2.e4m3x2``, one instruction (sm_89 or newer). bfloat16
    (no conversion before sm_100): ``_fp8_widen``'s bits, a byte permute that also replicates each byte's sign over
    the high byte of its half, a shift and a mask: three instructions for two elements (``cuda_prelude``)."""
    from ..cuda_prelude import E4M3_BFS_HI, E4M3_BFS_LO, E4M3_HI, E4M3_LO

    fn = {"bfloat16": (E4M3_BFS_LO, E4M3_BFS_HI), "float16": (E4M3_LO, E4M3_HI)}[dtype][half]
    return T.call_pure_extern("uint32", fn, word)


def mma_tiles(spec: GroupedExpertsSpec) -> tuple[int, int, int]:
    """``(NT, RT of gate_up, RT of down)``: 8-token tiles per weight pass, 16-row tiles per warp.

    NT (``spec.n_tiles``, or by default the power of two that covers twice the mean tokens per expert at
    128 tokens, ``2 * 128 * K / E``: 4 for OLMoE, 8 for Mixtral) bounds how often an expert's weights are
    streamed: once per NT * 8 of its tokens. RT (``spec.row_tiles``; by default 1 with cp.async stages, else 2
    up to NT 4 and 1 above) trades registers and blocks in flight against reuse of the token operand.

    The defaults (4 cp.async stages, L2 prefetch hint 256 B, RT 1, 4 warps) were the fastest launch shapes on the
    H200 at 128 decode tokens (``bench/results/grouped_experts_h200_pipe.json``): OLMoE's layer 0.23 ms (82% of
    the copy bandwidth; the register form 0.33 ms), Mixtral's 0.77 ms (86%; 1.06 ms)."""
    nt = spec.n_tiles
    if nt == 0:
        want, nt = 2 * 128 * spec.top_k / spec.experts, 1
        while nt < 8 and nt * 8 < want:
            nt *= 2
    rt = spec.row_tiles or (1 if _staged(spec) else 2 if nt <= 4 else 1)
    return nt, rt, rt


PREFILL_TILES = 8  # NT of the prefill entry's mma forms: 64 tokens per weight pass


def tiled_unsupported(spec: GroupedExpertsSpec) -> str | None:
    """What the block-tiled forms (``tiled``) need on CUDA that ``spec`` lacks (completing "tiled needs ..."), or None."""
    if spec.w_format != "float" or not spec.tensor_cores:
        return "16-bit weights on tensor cores (w_format float, tensor_cores)"
    for kernel in ("gate_up", "down"):
        if not mma_eligible(spec, kernel):
            return f"the mma form of {kernel} (16-bit weights and activations of one dtype)"
    if spec.inter % (TILE_ROWS // 2) or spec.hidden % TILE_ROWS or spec.hidden % spec.tile_k or spec.inter % spec.tile_k:
        return (f"the expert width a multiple of {max(TILE_ROWS // 2, spec.tile_k)} and the hidden size of {TILE_ROWS} "
                f"(got {spec.inter}, {spec.hidden})")
    return None


def prefill_spec(spec: GroupedExpertsSpec, tiled: bool = False) -> GroupedExpertsSpec:
    """The spec of the prefill entry's kernels. A prefill chunk routes hundreds of tokens to every expert (2048
    tokens: 256 per OLMoE expert), and each pass of NT * 8 tokens streams the expert's weights again, from
    HBM once they no longer fit the L2 (a layer's are 10x its size). The widest token tile (8 tiles of 8) halves
    the passes of the decode default (NT 4 for OLMoE), and so the weight bytes; decode keeps its own kernels.
    The cp.async forms also take a block per pass (``pass_blocks``): an expert's passes then run side by side on
    different SMs, reading its weight tiles at about the same time, so from the L2 after the first.
    An explicit ``n_tiles`` is kept, and specs without an mma form are returned as they are (one kernel set).
    ``tiled``: the block-tiled forms instead (128 tokens x 128 rows a block, ``tiled_unsupported``), where they serve."""
    if not (mma_eligible(spec, "gate_up") or mma_eligible(spec, "down")):
        return spec
    if tiled and tiled_unsupported(spec) is None:
        return replace(spec, tiled=True)
    out = spec if spec.n_tiles or mma_tiles(spec)[0] >= PREFILL_TILES else replace(spec, n_tiles=PREFILL_TILES)
    return replace(out, pass_blocks=True) if _staged(out) else out


SMEM_LIMIT = 49152  # bytes of static shared memory per block (the moec CUDA target's max_shared_memory_per_block)
DYN_SMEM_LIMIT = 232448  # bytes of dynamic shared memory a block may take on sm_90 (227 KB)


def check_dyn_shared(value, kernel: str) -> None:
    """A ``dyn_shared`` option (cp.async stages in dynamic shared memory): 0, or more than static shared memory holds
    and at most ``DYN_SMEM_LIMIT`` bytes."""
    if not isinstance(value, int) or isinstance(value, bool) or not (value == 0 or SMEM_LIMIT < value <= DYN_SMEM_LIMIT):
        raise MoecError(f"{kernel}: dyn_shared must be 0 (static shared memory) or {SMEM_LIMIT + 1}..{DYN_SMEM_LIMIT} "
                        f"bytes, got {value!r}")


def mma_stages(spec: GroupedExpertsSpec, kernel: str) -> tuple[int, int]:
    """``(stages, shared bytes per stage)`` of the cp.async form of ``kernel``: at most ``spec.stages``, as many as fit
    in ``SMEM_LIMIT`` (0 stages: the register form, or fewer than 2 fit). A stage is one k-step of 64: each warp's
    weight tiles (2 RT for gate_up's gate and up halves, RT for down; 16 rows x 128 bytes each, 64 for FP8) and the pass's
    tokens (8 NT rows x 128 bytes), shared by the block's warps."""
    nt, rt_gu, rt_dn = mma_tiles(spec)
    tiles = 2 * rt_gu if kernel == "gate_up" else rt_dn
    wbytes = 1 if spec.w_format == "fp8" else 2  # e4m3 bytes stay bytes in shared memory
    per_stage = spec.warps * tiles * 16 * MMA_K * wbytes + 8 * nt * MMA_K * 2
    if not _staged(spec):
        return 0, per_stage
    n = min(spec.stages, (spec.dyn_shared or SMEM_LIMIT) // per_stage)
    return (n if n >= 2 else 0), per_stage


def _stage_scope(spec: GroupedExpertsSpec) -> str:
    """Where the cp.async forms keep their stages: dynamic shared memory past 48 KB (``dyn_shared``), else static."""
    return "shared.dyn" if spec.dyn_shared else "shared"


def _mma_launch(spec: GroupedExpertsSpec, kernel: str) -> dict:
    if spec.tiled:
        rows = spec.inter // (TILE_ROWS // 2) if kernel == "gate_up" else spec.hidden // TILE_ROWS
        return {"form": "mma.sync m16n8k16, 128 x 128 block tiles, cp.async stages"
                + (" in dynamic shared memory" if tile_scope(spec.tile_k, spec.tile_stages) == "shared.dyn" else ""),
                "blocks": (rows, spec.experts), "threads": 256, "tokens_per_pass": TILE_TOKENS,
                "steps": (spec.hidden if kernel == "gate_up" else spec.inter) // spec.tile_k, "tile_k": spec.tile_k,
                "stages": spec.tile_stages, "shared_bytes": tile_shared_bytes(spec.tile_k, spec.tile_stages)}
    nt, rt_gu, rt_dn = mma_tiles(spec)
    rt, rows, red = (rt_gu, spec.inter, spec.hidden) if kernel == "gate_up" else (rt_dn, spec.hidden, spec.inter)
    per_block = spec.warps * rt * 16
    cfg = {"form": "mma.sync m16n8k16", "blocks": (-(-rows // per_block), spec.experts), "threads": 32 * spec.warps,
           "row_tiles": rt, "n_tiles": nt, "tokens_per_pass": 8 * nt, "steps": red // MMA_K}
    if _staged(spec):
        st, per_stage = mma_stages(spec, kernel)
        cfg.update({"form": "mma.sync m16n8k16, cp.async stages" + (" in dynamic shared memory" if spec.dyn_shared else ""),
                    "stages": st, "shared_bytes": st * per_stage})
    if spec.w_format == "fp8":
        cfg["form"] += ", e4m3 weights widened in registers"
    if _staged(spec) and spec.pass_blocks:  # (blocks[0] stays the row tiles: the grid is passes x (row tiles x experts))
        cfg.update({"form": cfg["form"] + ", a block per pass", "grid": (f"ceil(T / {8 * nt})", cfg["blocks"][0] * spec.experts)})
    return cfg


def _pass_grid(spec: GroupedExpertsSpec, nbx: int, tok: int):
    """``(grid x extent, grid y extent, expert, row tile, first pass, end pass)`` of the cp.async forms, as functions of
    the token count ``n`` and the block indices: a block per (row tile, expert) looping over the expert's passes,
    or with ``pass_blocks`` a block per (pass, row tile, expert), passes on grid x (an expert has at most ``n``
    tokens: blocks past its passes exit at once)."""
    if not spec.pass_blocks:
        return (lambda n: nbx, lambda: spec.experts, lambda bx, by: by, lambda bx, by: bx, lambda bx: 0,
                lambda bx, npass: npass)
    return (lambda n: T.Cast("int32", (n + tok - 1) // tok), lambda: nbx * spec.experts, lambda bx, by: by // nbx,
            lambda bx, by: by % nbx, lambda bx: bx, lambda bx, npass: T.min(bx + 1, npass))


F16_MAX = 65504.0


def _h_store(spec: GroupedExpertsSpec, v):
    """A float32 SwiGLU value as h: FP8 weights multiplied in float16 (a bfloat16 model's, see
    ``passes.grouped_experts``) keep h within float16's range (past +-65504 saturated, not infinite)."""
    if spec.w_format == "fp8" and spec.h_dtype == "float16":
        v = T.max(T.min(v, T.float32(F16_MAX)), T.float32(-F16_MAX))
    return T.Cast(spec.h_dtype, v)


def _rows_ok(check, rows: int, tiles_per_block: int):
    """A form's ``tile_ok``: ``check`` (row tile t of the warp in range), or statically true where the blocks' row
    tiles (``tiles_per_block`` of 16 rows) cover the rows exactly."""
    return (lambda t: True) if rows % (16 * tiles_per_block) == 0 else check


def _mma(a, a_off, b, b_off, c, c_off, ab: str):
    return T.ptx_legacy.mma("m16n8k16", "row", "col", ab, ab, "fp32", a.data, a_off, b.data, b_off, c.data, c_off, False,
                            dtype="float32")


def _mma_mainloop(widen=None):
    """The k loop of the mma forms (gate_up, down and ``dense_gemm``), as a TIR macro.

    ``tiles`` tiles of 16 weight rows per warp (tile t's first row ``tile_row(t)``, read if ``tile_ok(t)``), NT
    token tiles of 8, ``steps`` k-steps of 64. Each step lane (g, q) loads 16 contiguous elements at 16 q of rows
    ``tile_row(t) + g`` and ``+ g + 8`` (``w_at(row, k)``) and of token g of each tile n with tokens (n * 8 < nv;
    ``x_at(n, k)`` where ``x_ok(n)``, else zeros), then issues the four m16n8k16 of each (tile, token tile): the
    fragments read k = 16 q + 4 s + (0..3) at step s for both operands. ``acc[(t * NT + n) * 4 + c]`` holds the
    float32 result of row ``tile_row(t) + g + 8 (c // 2)`` and token ``n * 8 + 2 q + c % 2``. ``widen``: the
    weight elements are loaded as they are stored (``wa``: e4m3 bytes) and widened to the mma type on the way to
    the fragments (``af``)."""
    conv = widen or (lambda v: v)

    @T.macro
    def mainloop(wa, af, xb, xf, acc, g, q, nv, tiles, nt, steps, tile_row, tile_ok, w_at, x_ok, x_at, ab):
        for i in T.unroll(tiles * 4 * nt):
            acc[i] = T.float32(0)
        for kc in T.serial(steps):
            for t in T.unroll(tiles):
                if tile_ok(t):
                    for rh in T.unroll(2):
                        for c in T.unroll(2):
                            for v in T.vectorized(8):
                                wa[(t * 2 + rh) * 16 + c * 8 + v] = w_at(tile_row(t) + rh * 8 + g, kc * 64 + q * 16 + c * 8 + v)
            for n in T.unroll(nt):
                if n * 8 < nv:
                    for c in T.unroll(2):
                        if x_ok(n):
                            for v in T.vectorized(8):
                                xb[n * 16 + c * 8 + v] = x_at(n, kc * 64 + q * 16 + c * 8 + v)
                        else:
                            for v in T.vectorized(8):
                                xb[n * 16 + c * 8 + v] = T.Cast(xb.dtype, 0)
            for i in T.unroll(nt * 16):  # the vector loads may type xb as uint4: mma reads a 16-bit copy
                xf[i] = xb[i]
            for t in T.unroll(tiles):
                for st in T.unroll(4):
                    for a in T.unroll(8):  # (row g | g + 8) = (a // 2) % 2, k = 4 st + 2 (a // 4) + a % 2
                        af[(t * 4 + st) * 8 + a] = conv(wa[(t * 2 + (a // 2) % 2) * 16 + 4 * st + 2 * (a // 4) + a % 2])
            for t in T.unroll(tiles):
                if tile_ok(t):
                    for n in T.unroll(nt):
                        if n * 8 < nv:
                            for st in T.unroll(4):
                                T.evaluate(_mma(af, (t * 4 + st) * 8, xf, n * 16 + 4 * st, acc, (t * nt + n) * 4, ab))

    return mainloop


def _mma_pipe_mainloop(l2_prefetch: int = 0, k_groups: int = 1, x_base: int = 0, widen_to: str | None = None,
                       interleave: bool = False):
    """The k loop of the cp.async forms of gate_up and down (``spec.stages``), as a TIR macro.

    Same tiles, fragments and k permutation as ``_mma_mainloop``, but each k-step's operands go through shared
    memory, ``S`` steps in flight: step kc's copies are issued S - 1 steps before its mma (``cp.async``, 16 bytes
    each, commit / wait groups), so a block keeps up to S - 1 steps of weights on the way without holding them
    in registers. Lane (g, q) copies, for each of its warp's tiles t and halves rh (rows g, g + 8) and c, the 8
    elements at k = 64 kc + 32 c + 8 q (8 lanes cover 8 rows x 64 contiguous bytes, full 32-byte sectors) into
    its own slots ``ws[stage][warp][t][rh][c][lane]``; it alone reads them back (16-byte loads, lanes
    contiguous: no bank conflicts) into ``wa[(2 t + rh) 16 + 8 c + (0..7)]``, exactly where ``_mma_mainloop``
    puts k = 16 q + 8 c + (0..7): only the global k of a fragment slot changes, for both operands alike. The
    pass's 8 NT token rows are copied once per block (thread tx: 16-byte chunks tx, tx + 32 NW, ...; loader
    chunk j of ``x_at(j, k)``, its row ``(j 32 NW + tx) // 8``, skipped unless ``x_ok(j)``) into
    ``xs[stage][row][8 chunks of 8]``, the two 64-byte halves of odd rows swapped (the 8 lanes of a 16-byte
    load phase read rows g, g + 1: disjoint banks). One ``__syncthreads`` per step: after step kc's group
    has landed (``cp.async.wait_group S - 2``) and before step kc + S - 1's copies overwrite the stage that
    step kc - 1 read. Tokens of a tile past ``nv`` read stale shared memory: their mma columns are never
    stored. Rows of tiles with ``not tile_ok(t)`` are neither copied nor multiplied.

    ``k_groups`` G > 1 (``dense_gemm``'s k split within a block): ``nw`` counts the block's warps, G groups of
    ``nw // G`` that each run this loop over their own k range (the caller's ``w_at`` / ``x_at`` add the group's k
    offset and ``x_ok`` / ``x_at`` number chunks by the thread's index within its group). Weight slots are the
    warp's own as before; each group copies its token rows into its own ``xs`` region (``stages * tok * 64``
    elements, group ``tx // (32 nw / G)``, from element ``x_base`` on: the caller may pass one buffer as ``ws`` and
    ``xs``), the chunks numbered within the group. All groups take the same number of steps, so the block's barriers
    stay uniform.

    ``widen_to`` (FP8 weights, the activations' 16-bit type): ``ws``, ``wa`` and ``af`` are uint32 words. A row's
    64 bytes of a step are 4 lanes' 16-byte copies, lane (g, q) copying k = 64 kc + 16 q (+ 0..15) of rows g and
    g + 8 into ``ws[stage][warp][t][rh][lane][4 words]`` and reading them back into ``wa[(2 t + rh) 4 + (0..3)]``:
    slot s holds k = 16 q + s, the register form's permutation (``_mma_mainloop``). Each fragment register is two
    bytes widened in place (``_fp8_widen_pair``: register 2 h + rh of step st is half h of word st of row rh). The
    token chunks 2 q and 2 q + 1 of a row (k = 16 q + 0..15) are then the lane's; in ``xs`` odd rows swap
    neighbouring chunks (position ``ch ^ 1``), so a load phase's rows g, g + 1 again fall on disjoint banks.

    ``interleave``: a step first reads every token tile's operand (``xb`` / ``xf`` hold NT tiles of 16), then
    issues its mma k16 step by k16 step, each over every (row tile, token tile), so consecutive mma add into
    different accumulators instead of one tile's chain of four; the mma loop is specialised on the pass's token
    tiles with tokens (``ceil(nv / 8)``, at most NT), so no branch sits between them."""
    cpw = "cp.async.cg.shared.global" + (f".L2::{l2_prefetch}B" if l2_prefetch else "")
    cpx = "cp.async.cg.shared.global"
    assert isinstance(k_groups, int) and k_groups >= 1, f"k_groups {k_groups!r}"
    fp8 = widen_to is not None
    assert not (fp8 and k_groups > 1), "FP8 weights with k groups"
    AW = 4 if fp8 else 8  # a fragment's (16 x 16 weights) elements of af per lane: 4 words or 8 halves

    def xpos(row, ch):  # the 16-byte position of chunk ch (0..7) of token row ``row`` in xs
        return ch - ch % 2 + (ch + row) % 2 if fp8 else ((ch // 4 + row) % 2) * 4 + ch % 4

    def xread(g, q, c):  # the position of the c-th (0, 1) chunk lane (g, q) reads of row g
        return 2 * q + (c + g) % 2 if fp8 else (c + g) % 2 * 4 + q

    WC, WE = (1, 4) if fp8 else (2, 8)  # a lane's 16-byte copies per row and step; their elements (words or halves)

    @T.macro
    def issue_w(ws, st, kc, tx, g, q, tiles, nw, tile_row, tile_ok, w_at):
        for t in T.unroll(tiles):
            if tile_ok(t):
                for rh in T.unroll(2):
                    for c in T.unroll(WC):
                        T.evaluate(T.ptx[cpw](
                            T.address_of(ws[((((st * nw + tx // 32) * tiles + t) * 2 + rh) * WC + c) * 32 * WE + (tx % 32) * WE]),
                            T.address_of(w_at(tile_row(t) + rh * 8 + g, kc * 64 + c * 32 + q * (16 // WC))), 16))

    @T.macro
    def fragments16(wa, af, tiles):
        for t in T.unroll(tiles):
            for st in T.unroll(4):
                for a in T.unroll(8):  # (row g | g + 8) = (a // 2) % 2, k slot 4 st + 2 (a // 4) + a % 2
                    af[(t * 4 + st) * 8 + a] = wa[(t * 2 + (a // 2) % 2) * 16 + 4 * st + 2 * (a // 4) + a % 2]

    @T.macro
    def fragments8(wa, af, tiles):
        for t in T.unroll(tiles):
            for st in T.unroll(4):
                for rh in T.unroll(2):  # register 2 h + rh: row g | g + 8 = rh, k slots 4 st + 2 h + (0, 1)
                    af[(t * 4 + st) * 4 + rh] = _fp8_widen_pair(wa[(t * 2 + rh) * 4 + st], 0, widen_to)
                    af[(t * 4 + st) * 4 + 2 + rh] = _fp8_widen_pair(wa[(t * 2 + rh) * 4 + st], 1, widen_to)

    fragments = fragments8 if fp8 else fragments16

    @T.macro
    def read_w(ws, wa, af, stg, tx, tiles, nw, tile_ok):
        for t in T.unroll(tiles):
            if tile_ok(t):
                for rh in T.unroll(2):
                    for c in T.unroll(WC):
                        for v in T.vectorized(WE):
                            wa[(t * 2 + rh) * WC * WE + c * WE + v] = ws[
                                ((((stg * nw + tx // 32) * tiles + t) * 2 + rh) * WC + c) * 32 * WE + (tx % 32) * WE + v]
        fragments(wa, af, tiles)

    def xt_of(tx, nw):  # the thread's index within its group
        return tx if k_groups == 1 else tx % (32 * (nw // k_groups))

    def xn_of(nw):  # the warps of a group
        return nw // k_groups

    def xoff(idx, tx, nw, tok, stages):  # idx in the group's own token stages
        return idx if k_groups == 1 else idx + x_base + (tx // (32 * (nw // k_groups))) * (stages * tok * 64)

    @T.macro
    def issue(ws, xs, st, kc, tx, g, q, tiles, tok, nw, xl, tile_row, tile_ok, w_at, x_ok, x_at, stages):
        issue_w(ws, st, kc, tx, g, q, tiles, nw, tile_row, tile_ok, w_at)
        for j in T.unroll(xl):
            if (tok * 8) % (32 * xn_of(nw)) == 0 or j * 32 * xn_of(nw) + xt_of(tx, nw) < tok * 8:
                if x_ok(j):
                    T.evaluate(T.ptx[cpx](
                        T.address_of(xs[xoff(((st * tok + (j * 32 * xn_of(nw) + xt_of(tx, nw)) // 8) * 8
                                              + xpos((j * 32 * xn_of(nw) + xt_of(tx, nw)) // 8, xt_of(tx, nw) % 8)) * 8,
                                             tx, nw, tok, stages)]),
                        T.address_of(x_at(j, kc * 64 + (xt_of(tx, nw) % 8) * 8)), 16))

    @T.macro
    def x_frag(xs, xb, xf, n, o, tx, g, q, nt, stages, nw, kc):  # token tile n's operand of step kc into xf[o: o + 16]
        for c in T.unroll(2):
            for v in T.vectorized(8):
                xb[o + c * 8 + v] = xs[xoff((((kc % stages) * nt * 8 + n * 8 + g) * 8 + xread(g, q, c)) * 8 + v, tx, nw,
                                            nt * 8, stages)]
        for i in T.unroll(16):
            xf[o + i] = xb[o + i]

    @T.macro
    def mma_by_tile(xs, xb, xf, af, acc, tx, g, q, nv, tiles, nt, stages, nw, tile_ok, kc, ab):
        for n in T.unroll(nt):
            if n * 8 < nv:
                x_frag(xs, xb, xf, n, 0, tx, g, q, nt, stages, nw, kc)
                for t in T.unroll(tiles):
                    if tile_ok(t):
                        for st in T.unroll(4):
                            T.evaluate(_mma(af, (t * 4 + st) * AW, xf, 4 * st, acc, (t * nt + n) * 4, ab))

    def mma_k16(m: int):  # the step's mma over m token tiles: k16 steps outermost, every (row tile, token tile) inside
        @T.macro
        def run(xf, af, acc, nv, tiles, nt, tile_ok, ab):  # (nv: the signature of ``upto``'s)
            for st in T.unroll(4):
                for t in T.unroll(tiles):
                    if tile_ok(t):
                        for n in T.unroll(m):
                            T.evaluate(_mma(af, (t * 4 + st) * AW, xf, n * 16 + 4 * st, acc, (t * nt + n) * 4, ab))
        return run

    def upto(m: int):  # the pass's token tiles with tokens, ceil(nv / 8) capped at m, told apart from m down to 1
        if m == 1:
            return mma_k16(1)
        top, below = mma_k16(m), upto(m - 1)

        @T.macro
        def run(xf, af, acc, nv, tiles, nt, tile_ok, ab):
            if nv > (m - 1) * 8:
                top(xf, af, acc, nv, tiles, nt, tile_ok, ab)
            else:
                below(xf, af, acc, nv, tiles, nt, tile_ok, ab)
        return run

    by_count = [None] + [upto(m) for m in range(1, 9)]

    @T.macro
    def mma_interleaved(xs, xb, xf, af, acc, tx, g, q, nv, tiles, nt, stages, nw, tile_ok, kc, ab):
        for n in T.unroll(nt):
            if n * 8 < nv:
                x_frag(xs, xb, xf, n, n * 16, tx, g, q, nt, stages, nw, kc)
        by_count[nt](xf, af, acc, nv, tiles, nt, tile_ok, ab)

    @T.macro
    def mainloop(ws, xs, wa, af, xb, xf, acc, tx, g, q, nv, tiles, nt, steps, stages, nw, xl, tile_row, tile_ok, w_at, x_ok,
                 x_at, ab):
        for i in T.unroll(tiles * 4 * nt):
            acc[i] = T.float32(0)
        T.tvm_storage_sync("shared")  # the previous pass's last steps are read: its stages may be refilled
        for s0 in T.unroll(stages - 1):
            if s0 < steps:
                issue(ws, xs, s0, s0, tx, g, q, tiles, nt * 8, nw, xl, tile_row, tile_ok, w_at, x_ok, x_at, stages)
            T.evaluate(T.ptx["cp.async.commit_group"]())
        for kc in T.serial(steps):
            T.evaluate(T.ptx["cp.async.wait_group"](stages - 2))
            T.tvm_storage_sync("shared")
            if kc + stages - 1 < steps:
                issue(ws, xs, (kc + stages - 1) % stages, kc + stages - 1, tx, g, q, tiles, nt * 8, nw, xl, tile_row, tile_ok,
                      w_at, x_ok, x_at, stages)
            T.evaluate(T.ptx["cp.async.commit_group"]())
            read_w(ws, wa, af, kc % stages, tx, tiles, nw, tile_ok)
            if interleave:
                mma_interleaved(xs, xb, xf, af, acc, tx, g, q, nv, tiles, nt, stages, nw, tile_ok, kc, ab)
            else:
                mma_by_tile(xs, xb, xf, af, acc, tx, g, q, nv, tiles, nt, stages, nw, tile_ok, kc, ab)

    return mainloop


def _gate_up_func(spec: GroupedExpertsSpec, wshape, wdt: str, body):
    """``moe_gate_up(x, w1, [s1,] offsets, order, h)`` around a form's ``body(x, w, s1, offsets, order, h)`` macro
    (FP8 weights take their scales; otherwise the body never reads that argument)."""
    D, I, E, K = spec.hidden, spec.inter, spec.experts, spec.top_k
    attrs = _attrs("moe_gate_up")
    if spec.w_format == "fp8":
        @T.prim_func(s_tir=True)
        def moe_gate_up(x_h: T.handle, w_h: T.handle, s_h: T.handle, off_h: T.handle, order_h: T.handle, h_h: T.handle):
            T.func_attr(attrs)
            N = T.int64()
            x = T.match_buffer(x_h, (N, D), spec.x_dtype)
            w = T.match_buffer(w_h, wshape, wdt)
            s1 = T.match_buffer(s_h, (spec.slots or E, 2 * I), "float32")
            offsets = T.match_buffer(off_h, (_offsets_len(spec),), "int32")
            order = T.match_buffer(order_h, (N * K,), "int32")
            h = T.match_buffer(h_h, (N * K, I), spec.h_dtype)
            body(x, w, s1, offsets, order, h)
    else:
        @T.prim_func(s_tir=True)
        def moe_gate_up(x_h: T.handle, w_h: T.handle, off_h: T.handle, order_h: T.handle, h_h: T.handle):
            T.func_attr(attrs)
            N = T.int64()
            x = T.match_buffer(x_h, (N, D), spec.x_dtype)
            w = T.match_buffer(w_h, wshape, wdt)
            offsets = T.match_buffer(off_h, (_offsets_len(spec),), "int32")
            order = T.match_buffer(order_h, (N * K,), "int32")
            h = T.match_buffer(h_h, (N * K, I), spec.h_dtype)
            body(x, w, w, offsets, order, h)  # no scales: the body never reads them
    return moe_gate_up


def _down_func(spec: GroupedExpertsSpec, wshape, wdt: str, body):
    """``moe_down(h, w2, [s2,] offsets, order, rw, y)`` around a form's ``body(h, w, s2, offsets, order, rw, y)``."""
    D, I, E, K = spec.hidden, spec.inter, spec.experts, spec.top_k
    attrs = _attrs("moe_down")
    if spec.w_format == "fp8":
        @T.prim_func(s_tir=True)
        def moe_down(h_h: T.handle, w_h: T.handle, s_h: T.handle, off_h: T.handle, order_h: T.handle, rw_h: T.handle,
                     y_h: T.handle):
            T.func_attr(attrs)
            N = T.int64()
            h = T.match_buffer(h_h, (N * K, I), spec.h_dtype)
            w = T.match_buffer(w_h, wshape, wdt)
            s2 = T.match_buffer(s_h, (spec.slots or E, D), "float32")
            offsets = T.match_buffer(off_h, (_offsets_len(spec),), "int32")
            order = T.match_buffer(order_h, (N * K,), "int32")
            rw = T.match_buffer(rw_h, (N, K), spec.rw_dtype)
            y = T.match_buffer(y_h, (N * K, D), "float32")
            body(h, w, s2, offsets, order, rw, y)
    else:
        @T.prim_func(s_tir=True)
        def moe_down(h_h: T.handle, w_h: T.handle, off_h: T.handle, order_h: T.handle, rw_h: T.handle, y_h: T.handle):
            T.func_attr(attrs)
            N = T.int64()
            h = T.match_buffer(h_h, (N * K, I), spec.h_dtype)
            w = T.match_buffer(w_h, wshape, wdt)
            offsets = T.match_buffer(off_h, (_offsets_len(spec),), "int32")
            order = T.match_buffer(order_h, (N * K,), "int32")
            rw = T.match_buffer(rw_h, (N, K), spec.rw_dtype)
            y = T.match_buffer(y_h, (N * K, D), "float32")
            body(h, w, w, offsets, order, rw, y)  # no scales: the body never reads them
    return moe_down


def _mma_weight_form(spec: GroupedExpertsSpec, act: str):
    """(stored weight dtype, mma operand dtype, mma type, widening or None, epilogue factor) of the mma forms."""
    if spec.w_format == "fp8":
        return "uint8", act, _MMA_TYPE[act], lambda v: _fp8_widen(v, act), _FP8_WIDEN[act][1]
    return spec.w_dtype, spec.w_dtype, _MMA_TYPE[spec.w_dtype], None, 1.0


def _make_gate_up_mma(spec: GroupedExpertsSpec):
    """gate_up on tensor cores. Warp w of block (jb, e) owns RT tiles of 16 rows j of the gate and the up
    halves; an expert's tokens go NT * 8 at a time (one weight pass each). Each k-step of 64 lane l
    (g = l // 4, q = l % 4) loads 16 contiguous elements of rows j0 + g and j0 + g + 8 at 16 q (two 16-byte
    loads; a row's 64 elements are one 128-byte line across its 4 lanes) and the same 16 of token g of each
    tile; the four m16n8k16 of the step take them as k = 16 q + 4 s + (0..3) for step s (fragment positions
    2q, 2q + 1, 2q + 8, 2q + 9), the same permutation of k for both operands, so the sum is unchanged.
    Accumulators float32; SwiGLU in the epilogue where the gate and up results of a (row, token) meet in
    one lane. FP8 weights: the 16 bytes of a lane are one 8-byte load per row, widened in registers
    (``_fp8_widen``) into the activations' type; the epilogue multiplies each row by its scale (and the
    widening's power of two) before the SwiGLU."""
    if spec.tiled:
        return _make_tiled(spec, "gate_up")
    if _staged(spec):
        return _make_gate_up_pipe(spec)
    D, I, E, K = spec.hidden, spec.inter, spec.experts, spec.top_k
    g0, u0 = (0, I) if spec.gate_first else (I, 0)
    wshape, ei = _windex((spec.slots or E, 2 * I, D))
    NT, RT, _ = mma_tiles(spec)
    cfg = _mma_launch(spec, "gate_up")
    NW, NBX, KC, TOK = spec.warps, cfg["blocks"][0], cfg["steps"], 8 * NT
    wdt, odt, ab, widen, f = _mma_weight_form(spec, spec.x_dtype)
    fp8 = spec.w_format == "fp8"
    mainloop = _mma_mainloop(widen)

    def swiglu(gv, uv):
        return _h_store(spec, gv / (T.float32(1) + T.exp(-gv)) * uv)

    def scale(s1, we, row):
        return s1[we, row] * T.float32(f) if fp8 else T.float32(1)

    @T.macro
    def body(x, w, s1, offsets, order, h):
        for e in T.thread_binding(E, thread="blockIdx.y"):
            for jb in T.thread_binding(NBX, thread="blockIdx.x"):
                for tx in T.thread_binding(32 * NW, thread="threadIdx.x"):
                    with T.sblock("gate_up"):
                        T.reads()
                        T.writes()
                        wa = T.sblock_alloc_buffer((RT * 64,), wdt, scope="local")  # [r][gate|up][row g|g+8][16]
                        af = T.sblock_alloc_buffer((RT * 64,), odt, scope="local")  # [r][gate|up][step][8]
                        xb = T.sblock_alloc_buffer((NT * 16,), odt, scope="local")  # [tile][16]
                        xf = T.sblock_alloc_buffer((NT * 16,), odt, scope="local")  # its mma operand copy (scalar-typed)
                        acc = T.sblock_alloc_buffer((RT * 8 * NT,), "float32", scope="local")  # [r][gate|up][tile][4]
                        tok = T.sblock_alloc_buffer((NT,), "int32", scope="local")
                        lane: T.let[T.int32] = tx % 32
                        g: T.let[T.int32] = lane // 4
                        q: T.let[T.int32] = lane % 4
                        rb: T.let[T.int32] = jb * (NW * RT * 16) + (tx // 32) * (RT * 16)
                        lo: T.let[T.int32] = offsets[e]
                        cnt: T.let[T.int32] = offsets[e + 1] - lo
                        we: T.let[T.int32] = _weight_slot(spec, offsets, e)
                        for ps in T.serial((cnt + TOK - 1) // TOK):
                            nv: T.let[T.int32] = cnt - ps * TOK
                            for n in T.unroll(NT):
                                tok[n] = T.if_then_else(n * 8 + g < nv, order[T.min(lo + ps * TOK + n * 8 + g, lo + cnt - 1)] // K, -1)
                            mainloop(wa, af, xb, xf, acc, g, q, nv, 2 * RT, NT, KC,
                                     lambda t: g0 + (t % 2) * (u0 - g0) + rb + (t // 2) * 16,  # tile t: row tile t // 2, gate | up
                                     _rows_ok(lambda t: rb + (t // 2) * 16 < I, I, spec.warps * RT), lambda row, k: w[ei(we), row, k],
                                     lambda n: tok[n] >= 0, lambda n, k: x[tok[n], k], ab)
                            for r in T.unroll(RT):
                                if rb + r * 16 < I:
                                    for n in T.unroll(NT):
                                        for c in T.unroll(4):  # c: (row g | g + 8) = c // 2, token 2 q + c % 2 of the tile
                                            if n * 8 + 2 * q + c % 2 < nv:
                                                h[lo + ps * TOK + n * 8 + 2 * q + c % 2, rb + r * 16 + g + 8 * (c // 2)] = swiglu(
                                                    acc[((r * 2) * NT + n) * 4 + c] * scale(s1, we, g0 + rb + r * 16 + g + 8 * (c // 2)),
                                                    acc[((r * 2 + 1) * NT + n) * 4 + c] * scale(s1, we, u0 + rb + r * 16 + g + 8 * (c // 2)))

    return _gate_up_func(spec, wshape, wdt, body)


def _make_down_mma(spec: GroupedExpertsSpec):
    """down on tensor cores, as ``_make_gate_up_mma`` with the rows d of W2 and the SwiGLU rows h of the
    expert's tokens (contiguous in expert order) as the token operand; the epilogue scales each slot's
    row by its routing weight (and FP8 weights' rows by their scales) and writes it at the slot's place."""
    if spec.tiled:
        return _make_tiled(spec, "down")
    if _staged(spec):
        return _make_down_pipe(spec)
    D, I, E, K = spec.hidden, spec.inter, spec.experts, spec.top_k
    wshape, ei = _windex((spec.slots or E, D, I))
    NT, _, RT = mma_tiles(spec)
    cfg = _mma_launch(spec, "down")
    NW, NBX, KC, TOK = spec.warps, cfg["blocks"][0], cfg["steps"], 8 * NT
    wdt, odt, ab, widen, f = _mma_weight_form(spec, spec.h_dtype)
    fp8 = spec.w_format == "fp8"
    mainloop = _mma_mainloop(widen)

    def scale(s2, we, d):
        return s2[we, d] * T.float32(f) if fp8 else T.float32(1)

    @T.macro
    def body(h, w, s2, offsets, order, rw, y):
        for e in T.thread_binding(E, thread="blockIdx.y"):
            for db in T.thread_binding(NBX, thread="blockIdx.x"):
                for tx in T.thread_binding(32 * NW, thread="threadIdx.x"):
                    with T.sblock("down"):
                        T.reads()
                        T.writes()
                        wa = T.sblock_alloc_buffer((RT * 32,), wdt, scope="local")  # [r][row g|g+8][16]
                        af = T.sblock_alloc_buffer((RT * 32,), odt, scope="local")  # [r][step][8]
                        hb = T.sblock_alloc_buffer((NT * 16,), odt, scope="local")  # [tile][16]
                        xf = T.sblock_alloc_buffer((NT * 16,), odt, scope="local")  # its mma operand copy (scalar-typed)
                        acc = T.sblock_alloc_buffer((RT * 4 * NT,), "float32", scope="local")  # [r][tile][4]
                        lane: T.let[T.int32] = tx % 32
                        g: T.let[T.int32] = lane // 4
                        q: T.let[T.int32] = lane % 4
                        rb: T.let[T.int32] = db * (NW * RT * 16) + (tx // 32) * (RT * 16)
                        lo: T.let[T.int32] = offsets[e]
                        cnt: T.let[T.int32] = offsets[e + 1] - lo
                        we: T.let[T.int32] = _weight_slot(spec, offsets, e)
                        for ps in T.serial((cnt + TOK - 1) // TOK):
                            nv: T.let[T.int32] = cnt - ps * TOK
                            mainloop(wa, af, hb, xf, acc, g, q, nv, RT, NT, KC, lambda t: rb + t * 16, lambda t: rb + t * 16 < D,
                                     lambda row, k: w[ei(we), row, k], lambda n: n * 8 + g < nv,
                                     lambda n, k: h[lo + ps * TOK + n * 8 + g, k], ab)
                            for r in T.unroll(RT):
                                if rb + r * 16 < D:
                                    for n in T.unroll(NT):
                                        for c in T.unroll(4):
                                            if n * 8 + 2 * q + c % 2 < nv:
                                                y[order[lo + ps * TOK + n * 8 + 2 * q + c % 2], rb + r * 16 + g + 8 * (c // 2)] = (
                                                    acc[(r * NT + n) * 4 + c] * scale(s2, we, rb + r * 16 + g + 8 * (c // 2)) * _f32(
                                                        rw[order[lo + ps * TOK + n * 8 + 2 * q + c % 2] // K,
                                                           order[lo + ps * TOK + n * 8 + 2 * q + c % 2] % K]))

    return _down_func(spec, wshape, wdt, body)


def _make_gate_up_pipe(spec: GroupedExpertsSpec):
    """gate_up on tensor cores with the weight and token operands staged through shared memory by cp.async
    (``_mma_pipe_mainloop``, ``mma_stages``); tiles, passes and epilogue as ``_make_gate_up_mma``."""
    D, I, E, K = spec.hidden, spec.inter, spec.experts, spec.top_k
    g0, u0 = (0, I) if spec.gate_first else (I, 0)
    wshape, ei = _windex((spec.slots or E, 2 * I, D))
    NT, RT, _ = mma_tiles(spec)
    cfg = _mma_launch(spec, "gate_up")
    NW, NBX, KC, TOK, S = spec.warps, cfg["blocks"][0], cfg["steps"], 8 * NT, cfg["stages"]
    SSC = _stage_scope(spec)
    XL = -(-(TOK * 8) // (32 * NW))  # token chunks each thread copies per step
    wdt, odt, ab, _, f = _mma_weight_form(spec, spec.x_dtype)
    fp8 = spec.w_format == "fp8"
    if fp8:  # pairs widened by the prelude's helpers (``_fp8_widen_pair``)
        f = _FP8_PAIR_FACTOR[odt]
        _register_prelude()
    sdt, WT, AW = ("uint32", 256, 4) if fp8 else (wdt, 1024, 8)  # shared / register weight type; a tile's elements a stage
    mainloop = _mma_pipe_mainloop(spec.l2_prefetch, widen_to=odt if fp8 else None, interleave=spec.interleave)
    XF = 16 * (NT if spec.interleave else 1)  # token operands held a step
    gx, gy, e_of, jb_of, ps_lo, ps_hi = _pass_grid(spec, NBX, TOK)

    def swiglu(gv, uv):
        return _h_store(spec, gv / (T.float32(1) + T.exp(-gv)) * uv)

    def scale(s1, we, row):
        return s1[we, row] * T.float32(f) if fp8 else T.float32(1)

    @T.macro
    def body(x, w, s1, offsets, order, h):
        for by in T.thread_binding(gy(), thread="blockIdx.y"):
            for bx in T.thread_binding(gx(x.shape[0]), thread="blockIdx.x"):
                for tx in T.thread_binding(32 * NW, thread="threadIdx.x"):
                    with T.sblock("gate_up"):
                        T.reads()
                        T.writes()
                        ws = T.sblock_alloc_buffer((S * NW * 2 * RT * WT,), sdt, scope=SSC)  # [stage][warp][tile][rh]([c])[lane][..]
                        xs = T.sblock_alloc_buffer((S * TOK * 64,), odt, scope=SSC)  # [stage][token][chunk (swizzled)][8]
                        wa = T.sblock_alloc_buffer((RT * WT // 16,), sdt, scope="local")
                        af = T.sblock_alloc_buffer((RT * 8 * AW,), sdt, scope="local")
                        xb = T.sblock_alloc_buffer((XF,), odt, scope="local")
                        xf = T.sblock_alloc_buffer((XF,), odt, scope="local")
                        acc = T.sblock_alloc_buffer((RT * 8 * NT,), "float32", scope="local")  # [r][gate|up][tile][4]
                        ltok = T.sblock_alloc_buffer((XL,), "int32", scope="local")  # tokens of the chunks this thread copies
                        e: T.let[T.int32] = e_of(bx, by)
                        lane: T.let[T.int32] = tx % 32
                        g: T.let[T.int32] = lane // 4
                        q: T.let[T.int32] = lane % 4
                        rb: T.let[T.int32] = jb_of(bx, by) * (NW * RT * 16) + (tx // 32) * (RT * 16)
                        lo: T.let[T.int32] = offsets[e]
                        cnt: T.let[T.int32] = offsets[e + 1] - lo
                        we: T.let[T.int32] = _weight_slot(spec, offsets, e)
                        if spec.min_blocks > 0:  # __launch_bounds__(threads, min_blocks): registers capped for that many blocks
                            with T.attr(T.int32(0), "tirx.launch_bounds_min_blocks_per_sm", spec.min_blocks):
                                acc[0] = T.float32(0)
                        for ps in T.serial(ps_lo(bx), ps_hi(bx, (cnt + TOK - 1) // TOK)):
                            nv: T.let[T.int32] = cnt - ps * TOK
                            for j in T.unroll(XL):
                                ltok[j] = T.if_then_else((j * 32 * NW + tx) // 8 < nv,
                                                         order[T.min(lo + ps * TOK + (j * 32 * NW + tx) // 8, lo + cnt - 1)] // K, -1)
                            mainloop(ws, xs, wa, af, xb, xf, acc, tx, g, q, nv, 2 * RT, NT, KC, S, NW, XL,
                                     lambda t: g0 + (t % 2) * (u0 - g0) + rb + (t // 2) * 16,  # tile t: row tile t // 2, gate | up
                                     _rows_ok(lambda t: rb + (t // 2) * 16 < I, I, spec.warps * RT), _w_reader(spec, w, ei, we, D),
                                     lambda j: ltok[j] >= 0, lambda j, k: x[ltok[j], k], ab)
                            for r in T.unroll(RT):
                                if rb + r * 16 < I:
                                    for n in T.unroll(NT):
                                        for c in T.unroll(4):  # c: (row g | g + 8) = c // 2, token 2 q + c % 2 of the tile
                                            if n * 8 + 2 * q + c % 2 < nv:
                                                h[lo + ps * TOK + n * 8 + 2 * q + c % 2, rb + r * 16 + g + 8 * (c // 2)] = swiglu(
                                                    acc[((r * 2) * NT + n) * 4 + c] * scale(s1, we, g0 + rb + r * 16 + g + 8 * (c // 2)),
                                                    acc[((r * 2 + 1) * NT + n) * 4 + c] * scale(s1, we, u0 + rb + r * 16 + g + 8 * (c // 2)))

    return _gate_up_func(spec, wshape, wdt, body)


def _make_down_pipe(spec: GroupedExpertsSpec):
    """down on tensor cores with cp.async stages (``_mma_pipe_mainloop``); epilogue as ``_make_down_mma``."""
    D, I, E, K = spec.hidden, spec.inter, spec.experts, spec.top_k
    wshape, ei = _windex((spec.slots or E, D, I))
    NT, _, RT = mma_tiles(spec)
    cfg = _mma_launch(spec, "down")
    NW, NBX, KC, TOK, S = spec.warps, cfg["blocks"][0], cfg["steps"], 8 * NT, cfg["stages"]
    SSC = _stage_scope(spec)
    wdt, odt, ab, _, f = _mma_weight_form(spec, spec.h_dtype)
    fp8 = spec.w_format == "fp8"
    if fp8:  # pairs widened by the prelude's helpers (``_fp8_widen_pair``)
        f = _FP8_PAIR_FACTOR[odt]
        _register_prelude()
    sdt, WT, AW = ("uint32", 256, 4) if fp8 else (wdt, 1024, 8)
    mainloop = _mma_pipe_mainloop(spec.l2_prefetch, widen_to=odt if fp8 else None, interleave=spec.interleave)
    XF = 16 * (NT if spec.interleave else 1)  # token operands held a step
    gx, gy, e_of, jb_of, ps_lo, ps_hi = _pass_grid(spec, NBX, TOK)

    def scale(s2, we, d):
        return s2[we, d] * T.float32(f) if fp8 else T.float32(1)

    @T.macro
    def body(h, w, s2, offsets, order, rw, y):
        for by in T.thread_binding(gy(), thread="blockIdx.y"):
            for bx in T.thread_binding(gx(rw.shape[0]), thread="blockIdx.x"):
                for tx in T.thread_binding(32 * NW, thread="threadIdx.x"):
                    with T.sblock("down"):
                        T.reads()
                        T.writes()
                        ws = T.sblock_alloc_buffer((S * NW * RT * WT,), sdt, scope=SSC)  # [stage][warp][tile][rh]([c])[lane][..]
                        xs = T.sblock_alloc_buffer((S * TOK * 64,), odt, scope=SSC)  # [stage][token][chunk (swizzled)][8]
                        wa = T.sblock_alloc_buffer((RT * WT // 32,), sdt, scope="local")
                        af = T.sblock_alloc_buffer((RT * 4 * AW,), sdt, scope="local")
                        xb = T.sblock_alloc_buffer((XF,), odt, scope="local")
                        xf = T.sblock_alloc_buffer((XF,), odt, scope="local")
                        acc = T.sblock_alloc_buffer((RT * 4 * NT,), "float32", scope="local")  # [r][tile][4]
                        e: T.let[T.int32] = e_of(bx, by)
                        lane: T.let[T.int32] = tx % 32
                        g: T.let[T.int32] = lane // 4
                        q: T.let[T.int32] = lane % 4
                        rb: T.let[T.int32] = jb_of(bx, by) * (NW * RT * 16) + (tx // 32) * (RT * 16)
                        lo: T.let[T.int32] = offsets[e]
                        cnt: T.let[T.int32] = offsets[e + 1] - lo
                        we: T.let[T.int32] = _weight_slot(spec, offsets, e)
                        if spec.min_blocks > 0:  # __launch_bounds__(threads, min_blocks): registers capped for that many blocks
                            with T.attr(T.int32(0), "tirx.launch_bounds_min_blocks_per_sm", spec.min_blocks):
                                acc[0] = T.float32(0)
                        for ps in T.serial(ps_lo(bx), ps_hi(bx, (cnt + TOK - 1) // TOK)):
                            nv: T.let[T.int32] = cnt - ps * TOK
                            mainloop(ws, xs, wa, af, xb, xf, acc, tx, g, q, nv, RT, NT, KC, S, NW, -(-(TOK * 8) // (32 * NW)), lambda t: rb + t * 16,
                                     _rows_ok(lambda t: rb + t * 16 < D, D, spec.warps * RT), _w_reader(spec, w, ei, we, I),
                                     lambda j: (j * 32 * NW + tx) // 8 < nv,
                                     lambda j, k: h[lo + ps * TOK + (j * 32 * NW + tx) // 8, k], ab)
                            for r in T.unroll(RT):
                                if rb + r * 16 < D:
                                    for n in T.unroll(NT):
                                        for c in T.unroll(4):
                                            if n * 8 + 2 * q + c % 2 < nv:
                                                y[order[lo + ps * TOK + n * 8 + 2 * q + c % 2], rb + r * 16 + g + 8 * (c // 2)] = (
                                                    acc[(r * NT + n) * 4 + c] * scale(s2, we, rb + r * 16 + g + 8 * (c // 2)) * _f32(
                                                        rw[order[lo + ps * TOK + n * 8 + 2 * q + c % 2] // K,
                                                           order[lo + ps * TOK + n * 8 + 2 * q + c % 2] % K]))

    return _down_func(spec, wshape, wdt, body)


# Block-tiled forms (``spec.tiled``): a block of 8 warps per (row block, expert) loops over the expert's tokens 128
# at a time; each tile is 128 tokens x 128 weight rows, both operands staged through shared memory by cp.async
# ``tile_k`` k at a time in a ring of ``tile_stages`` stages (rows padded by 8 elements, so that ldmatrix's eight
# rows hit distinct banks), fragments by ldmatrix. Warp (wm, wn) of the 2 x 4 grid owns tokens 64 wm .. + 63 and 32
# weight rows: 4 x 4 m16n8 tiles, 16 mma a k16. gate_up's tile is 64 gate rows and the same 64 up rows (warp wn: its
# 16 gate rows as n-tiles 0, 1 and their up rows as 2, 3), so SwiGLU meets both in one lane; its token rows are
# gathered through ``order``. down reads the expert's rows of h in place and writes each slot's row scaled by its
# routing weight. Each weight tile is read once per 128 of the expert's tokens (the pipe forms: once per 64, by one
# warp), each token row once per 128 rows.
# (TILE_TOKENS, TILE_ROWS, TILE_PAD, TILE_KS, TILE_K, TILE_STAGES, TILE_MAX_STAGES: at the top of the file)


def tile_shared_bytes(tile_k: int, stages: int) -> int:
    """Shared memory of the block-tiled forms' stages: both operands' 128 rows of ``tile_k`` (+ pad) 16-bit elements."""
    return stages * 2 * 128 * (tile_k + TILE_PAD) * 2


def tile_scope(tile_k: int, stages: int) -> str:
    """Where the stages live: static shared memory up to SMEM_LIMIT, dynamic past it."""
    return "shared.dyn" if tile_shared_bytes(tile_k, stages) > SMEM_LIMIT else "shared"


def check_tile(tile_k, stages, kernel: str) -> None:
    """Raise ``MoecError`` unless (``tile_k``, ``stages``) is a shape of the block-tiled forms."""
    if tile_k not in TILE_KS or isinstance(tile_k, bool):
        raise MoecError(f"{kernel}: tile_k must be one of {', '.join(map(str, TILE_KS))}, got {tile_k!r}")
    if not isinstance(stages, int) or isinstance(stages, bool) or not 2 <= stages <= TILE_MAX_STAGES:
        raise MoecError(f"{kernel}: tile_stages must be an integer in 2..{TILE_MAX_STAGES}, got {stages!r}")
    if tile_shared_bytes(tile_k, stages) > DYN_SMEM_LIMIT:
        raise MoecError(f"{kernel}: {stages} stages of k {tile_k} take {tile_shared_bytes(tile_k, stages)} bytes of shared "
                        f"memory, more than the {DYN_SMEM_LIMIT} a block may have")


def tile_buffer(tile_k: int, stages: int) -> int:
    """Elements of the block-tiled forms' one shared buffer (token stages, then weight stages)."""
    return stages * (TILE_TOKENS + TILE_ROWS) * (tile_k + TILE_PAD)


def tile_copies(tile_k: int) -> int:
    """16-byte copies a thread makes of each operand per stage (its chunks j = 0 .. n - 1, ``tile_copy_row``)."""
    return TILE_ROWS * (tile_k // 8) // 256


def tile_copy_row(j, tx, tile_k: int):
    """The tile row whose chunk thread ``tx`` copies as its j-th (its column chunk is ``tx % (tile_k // 8)``)."""
    return (j * 256 + tx) // (tile_k // 8)


def _tile_mainloop(dtype: str, steps: int, b_row, tile_k: int = TILE_K, stages: int = TILE_STAGES):
    """The k loop of the block-tiled forms (``_make_tiled``, ``dense_gemm.make_dense_tiled``), as a TIR macro
    ``tiles(xs, ws, af, bf, acc, tx, tok_at, w_at)``: acc [mi][ni][4] (float32) <- the 128 x 128 tile's products over
    ``steps`` k-steps of ``tile_k``. ``tok_at(j, k)`` is element k of the token row that thread tx copies as its
    chunk j (``tile_copy_row(j, tx, tile_k)``), ``w_at(r, k)`` element k of the weight row of tile row r, ``b_row(wn, ni)``
    the tile row of warp wn's n-tile ni. ``xs`` and ``ws`` are one buffer of ``tile_buffer`` elements (pass it twice):
    ``stages`` x 128 token rows of ``tile_k + TILE_PAD``, then as many weight rows. (One buffer, addressed by element
    in ldmatrix: TVM's merge of dynamic shared buffers does not follow a buffer's data pointer into ldmatrix.)

    Steps 0 .. S - 2 are in flight before the loop (S stages, one commit group a step, empty ones past the last
    step). At step kc every thread waits for its group kc (at most S - 2 younger ones pending), one barrier makes
    the whole stage visible, and step kc + S - 1 is issued into the stage of step kc - 1, which every warp has read
    since it passed that barrier; then the step's mma run: S - 1 steps stay in flight under the math, with one
    barrier a step. The loop starts with a barrier too, since a block calls it once per token tile and the prologue
    overwrites stages the previous call's last steps read."""
    check_tile(tile_k, stages, "tiled GEMM")
    if steps < 1:
        raise MoecError(f"tiled GEMM: the reduction needs at least one step of {tile_k}, got {steps}")
    TK, ST, ab = tile_k, stages, _MMA_TYPE[dtype]
    RS, CH, NJ = TK + TILE_PAD, TK // 8, tile_copies(TK)
    PRO = min(ST - 1, steps)  # steps issued before the loop; the other S - 1 - PRO prologue groups are empty
    WO = ST * TILE_TOKENS * RS  # the weight rows' place in the one shared buffer (``tile_buffer``)
    cp = "cp.async.cg.shared.global"

    @T.macro
    def issue(xs, ws, st, kc, tx, tok_at, w_at):
        for j in T.unroll(NJ):  # 128 token rows and 128 weight rows of TK elements: CH chunks of 16 bytes a row
            T.evaluate(T.ptx[cp](T.address_of(xs[(st * TILE_TOKENS + tile_copy_row(j, tx, TK)) * RS + tx % CH * 8]),
                                 T.address_of(tok_at(j, kc * TK + tx % CH * 8)), 16))
            T.evaluate(T.ptx[cp](T.address_of(ws[WO + (st * TILE_ROWS + tile_copy_row(j, tx, TK)) * RS + tx % CH * 8]),
                                 T.address_of(w_at(tile_copy_row(j, tx, TK), kc * TK + tx % CH * 8)), 16))

    @T.macro
    def tiles(xs, ws, af, bf, acc, tx, tok_at, w_at):
        ln: T.let[T.int32] = tx % 32
        wm: T.let[T.int32] = tx // 128
        wn: T.let[T.int32] = (tx // 32) % 4
        for i in T.unroll(64):
            acc[i] = T.float32(0)
        T.tvm_storage_sync("shared")  # (every warp is done with the previous tile's stages)
        for s0 in T.unroll(PRO):
            issue(xs, ws, s0, s0, tx, tok_at, w_at)
            T.evaluate(T.ptx["cp.async.commit_group"]())
        for _s0 in T.unroll(ST - 1 - PRO):
            T.evaluate(T.ptx["cp.async.commit_group"]())
        for kc in T.serial(steps):
            T.evaluate(T.ptx["cp.async.wait_group"](ST - 2))
            T.tvm_storage_sync("shared")
            if kc + (ST - 1) < steps:
                issue(xs, ws, (kc + (ST - 1)) % ST, kc + (ST - 1), tx, tok_at, w_at)
            T.evaluate(T.ptx["cp.async.commit_group"]())
            for kh in T.unroll(TK // 32):
                for ni in T.unroll(4):  # both k16 steps of n-tile ni: matrix m at rows + lane % 8, columns 16 (m // 2) + 8 (m % 2)
                    T.evaluate(T.ptx_legacy.ldmatrix(False, 4, ".b16", bf.data, ni * 8, T.address_of(ws[WO + ((kc % ST) * TILE_ROWS + b_row(wn, ni)
                                                     + ln % 8) * RS + kh * 32 + (ln // 16) * 16 + (ln // 8) % 2 * 8]), 0, dtype=dtype))
                for kk in T.unroll(2):
                    for mi in T.unroll(4):  # token rows + lane % 16, columns 16 kk + 8 (lane // 16)
                        T.evaluate(T.ptx_legacy.ldmatrix(False, 4, ".b16", af.data, mi * 8, T.address_of(xs[((kc % ST) * TILE_TOKENS + wm * 64
                                                         + mi * 16 + ln % 16) * RS + kh * 32 + kk * 16 + (ln // 16) * 8]), 0, dtype=dtype))
                    for mi in T.unroll(4):
                        for ni in T.unroll(4):
                            T.evaluate(_mma(af, mi * 8, bf, ni * 8 + kk * 4, acc, (mi * 4 + ni) * 4, ab))

    return tiles


def _make_tiled(spec: GroupedExpertsSpec, kernel: str):
    D, I, E, K = spec.hidden, spec.inter, spec.experts, spec.top_k
    gate_up = kernel == "gate_up"
    wdt = spec.w_dtype
    wshape, ei = _windex((spec.slots or E, 2 * I, D) if gate_up else (spec.slots or E, D, I))
    TK, ST = spec.tile_k, spec.tile_stages
    KC = (D if gate_up else I) // TK
    NJ, SC = tile_copies(TK), tile_scope(TK, ST)
    g0, u0 = (0, I) if spec.gate_first else (I, 0)

    def swiglu(gv, uv):
        return T.Cast(spec.h_dtype, gv / (T.float32(1) + T.exp(-gv)) * uv)

    def w_row(rb, r):  # gate_up's weight row of tile row r: 64 gate rows, then their up rows
        return T.if_then_else(r < 64, g0 + rb * 64 + r, u0 + rb * 64 + r - 64)

    def b_row(wn, ni):  # the tile row of warp wn's n-tile ni
        return ((ni // 2) * 64 + wn * 16 + (ni % 2) * 8) if gate_up else wn * 32 + ni * 8

    tiles = _tile_mainloop(wdt, KC, b_row, TK, ST)
    RS = TK + TILE_PAD

    @T.macro
    def body_gate_up(x, w, s1, offsets, order, h):
        for e in T.thread_binding(E, thread="blockIdx.y"):
            for rb in T.thread_binding(I // 64, thread="blockIdx.x"):
                for tx in T.thread_binding(256, thread="threadIdx.x"):
                    with T.sblock("gate_up_tiled"):
                        T.reads()
                        T.writes()
                        xs = T.sblock_alloc_buffer((tile_buffer(TK, ST),), wdt, scope=SC)  # token stages, then weight stages
                        af = T.sblock_alloc_buffer((32,), wdt, scope="local")
                        bf = T.sblock_alloc_buffer((32,), wdt, scope="local")
                        acc = T.sblock_alloc_buffer((64,), "float32", scope="local")
                        ltok = T.sblock_alloc_buffer((NJ,), "int32", scope="local")  # the token rows this thread copies
                        lo: T.let[T.int32] = offsets[e]
                        cnt: T.let[T.int32] = offsets[e + 1] - lo
                        we: T.let[T.int32] = _weight_slot(spec, offsets, e)
                        ln: T.let[T.int32] = tx % 32
                        for tb in T.serial((cnt + TILE_TOKENS - 1) // TILE_TOKENS):
                            for j in T.unroll(NJ):  # (rows past the expert's tokens copy its last one, never stored)
                                ltok[j] = order[lo + T.min(tb * TILE_TOKENS + tile_copy_row(j, tx, TK), cnt - 1)] // K
                            tiles(xs, xs, af, bf, acc, tx, lambda j, k: x[ltok[j], k],
                                  lambda r, k: w[ei(we), w_row(rb, r), k])
                            for mi in T.unroll(4):
                                for ni in T.unroll(2):
                                    for c in T.unroll(4):  # c: token row g + 8 (c // 2), column 2 q + c % 2 of the n-tile
                                        if tb * TILE_TOKENS + (tx // 128) * 64 + mi * 16 + ln // 4 + 8 * (c // 2) < cnt:
                                            h[lo + tb * TILE_TOKENS + (tx // 128) * 64 + mi * 16 + ln // 4 + 8 * (c // 2),
                                              rb * 64 + ((tx // 32) % 4) * 16 + ni * 8 + 2 * (ln % 4) + c % 2] = swiglu(
                                                acc[(mi * 4 + ni) * 4 + c], acc[(mi * 4 + ni + 2) * 4 + c])

    @T.macro
    def body_down(h, w, s2, offsets, order, rw, y):
        for e in T.thread_binding(E, thread="blockIdx.y"):
            for rb in T.thread_binding(D // TILE_ROWS, thread="blockIdx.x"):
                for tx in T.thread_binding(256, thread="threadIdx.x"):
                    with T.sblock("down_tiled"):
                        T.reads()
                        T.writes()
                        xs = T.sblock_alloc_buffer((tile_buffer(TK, ST),), wdt, scope=SC)  # token stages, then weight stages
                        af = T.sblock_alloc_buffer((32,), wdt, scope="local")
                        bf = T.sblock_alloc_buffer((32,), wdt, scope="local")
                        acc = T.sblock_alloc_buffer((64,), "float32", scope="local")
                        lo: T.let[T.int32] = offsets[e]
                        cnt: T.let[T.int32] = offsets[e + 1] - lo
                        we: T.let[T.int32] = _weight_slot(spec, offsets, e)
                        ln: T.let[T.int32] = tx % 32
                        for tb in T.serial((cnt + TILE_TOKENS - 1) // TILE_TOKENS):
                            tiles(xs, xs, af, bf, acc, tx, lambda j, k: h[lo + T.min(tb * TILE_TOKENS + tile_copy_row(j, tx, TK), cnt - 1), k],
                                  lambda r, k: w[ei(we), rb * TILE_ROWS + r, k])
                            for mi in T.unroll(4):
                                for ni in T.unroll(4):
                                    for c in T.unroll(4):
                                        if tb * TILE_TOKENS + (tx // 128) * 64 + mi * 16 + ln // 4 + 8 * (c // 2) < cnt:
                                            sl: T.let[T.int32] = order[lo + tb * TILE_TOKENS + (tx // 128) * 64 + mi * 16 + ln // 4
                                                                       + 8 * (c // 2)]
                                            y[sl, rb * TILE_ROWS + ((tx // 32) % 4) * 32 + ni * 8 + 2 * (ln % 4) + c % 2] = (
                                                acc[(mi * 4 + ni) * 4 + c] * _f32(rw[sl // K, sl % K]))

    if gate_up:
        return _gate_up_func(spec, wshape, wdt, body_gate_up)
    return _down_func(spec, wshape, wdt, body_down)


# ---------------------------------------------------------------------------- gate_up (+ SwiGLU) and down


def _shfl(v, o):
    return T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), v, o, 32, 32)


def _wval(spec: GroupedExpertsSpec, v):
    """A weight element as float32: the float itself, or the e4m3 byte decoded (integer arithmetic)."""
    if spec.w_format == "fp8":
        from .tiered_decode import _fp8_to_f32

        return _fp8_to_f32(v)
    return _f32(v)


def make_gate_up(spec: GroupedExpertsSpec, target: str = "llvm"):
    """``gate_up(x [T, D], w1 [E, 2I, D], [s1 [E, 2I],] offsets [E + 1], order [T * K], h [T * K, I])``.

    h in expert order; ``s1`` (FP8 weights only) the per-output-channel scales."""
    check_supported(spec, target)
    if target == "cuda" and mma_eligible(spec, "gate_up"):
        return _make_gate_up_mma(spec)
    D, I, E, K = spec.hidden, spec.inter, spec.experts, spec.top_k
    g0, u0 = (0, I) if spec.gate_first else (I, 0)
    fp8 = spec.w_format == "fp8"
    wshape, ei = _windex((spec.slots or E, 2 * I, D))

    def swiglu(g, u):
        return T.Cast(spec.h_dtype, g / (T.float32(1) + T.exp(-g)) * u)

    def scale(s1, e, row):
        return s1[e, row] if fp8 else T.float32(1)

    @T.macro
    def body_llvm(x, w, s1, offsets, order, h):
        for e in T.serial(E):
            for i in T.serial(offsets[e + 1] - offsets[e]):
                for j in T.serial(I):
                    with T.sblock("gate_up"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((2,), "float32", scope="local")
                        p: T.let[T.int32] = offsets[e] + i
                        we: T.let[T.int32] = _weight_slot(spec, offsets, e)
                        t: T.let[T.int32] = order[p] // K
                        acc[0] = T.float32(0)
                        acc[1] = T.float32(0)
                        for d in T.serial(D):
                            acc[0] = acc[0] + _f32(x[t, d]) * _wval(spec, w[ei(we), g0 + j, d])
                            acc[1] = acc[1] + _f32(x[t, d]) * _wval(spec, w[ei(we), u0 + j, d])
                        h[p, j] = swiglu(acc[0] * scale(s1, we, g0 + j), acc[1] * scale(s1, we, u0 + j))

    cfg = _warp_launch(spec)["gate_up"]
    NW, VEC, IT, TB, NBX = spec.warps, cfg["vec"], cfg["iters"], spec.token_tile, cfg["blocks"][0]
    full = D % (32 * VEC) == 0

    @T.macro
    def body_cuda(x, w, s1, offsets, order, h):
        for e in T.thread_binding(E, thread="blockIdx.y"):
            for jb in T.thread_binding(NBX, thread="blockIdx.x"):
                for tx in T.thread_binding(32 * NW, thread="threadIdx.x"):
                    with T.sblock("gate_up"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((2 * TB,), "float32", scope="local")
                        tok = T.sblock_alloc_buffer((TB,), "int32", scope="local")
                        wg = T.sblock_alloc_buffer((VEC,), w.dtype, scope="local")
                        wu = T.sblock_alloc_buffer((VEC,), w.dtype, scope="local")
                        xv = T.sblock_alloc_buffer((VEC,), spec.x_dtype, scope="local")
                        lane: T.let[T.int32] = tx % 32
                        j: T.let[T.int32] = jb * NW + tx // 32
                        lo: T.let[T.int32] = offsets[e]
                        cnt: T.let[T.int32] = offsets[e + 1] - lo
                        we: T.let[T.int32] = _weight_slot(spec, offsets, e)
                        if j < I:
                            for g in T.serial((cnt + TB - 1) // TB):
                                for b in T.unroll(TB):
                                    acc[b] = T.float32(0)
                                    acc[TB + b] = T.float32(0)
                                    tok[b] = T.if_then_else(g * TB + b < cnt, order[T.min(lo + g * TB + b, lo + cnt - 1)] // K, -1)
                                for it in T.serial(IT):
                                    if full or (it * 32 + lane) * VEC < D:
                                        for v in T.vectorized(VEC):
                                            wg[v] = w[ei(we), g0 + j, (it * 32 + lane) * VEC + v]
                                        for v in T.vectorized(VEC):
                                            wu[v] = w[ei(we), u0 + j, (it * 32 + lane) * VEC + v]
                                        for b in T.unroll(TB):
                                            if tok[b] >= 0:
                                                for v in T.vectorized(VEC):
                                                    xv[v] = x[tok[b], (it * 32 + lane) * VEC + v]
                                                for v in T.unroll(VEC):
                                                    acc[b] = acc[b] + _f32(xv[v]) * _wval(spec, wg[v])
                                                    acc[TB + b] = acc[TB + b] + _f32(xv[v]) * _wval(spec, wu[v])
                                for b in T.unroll(2 * TB):
                                    for r in T.unroll(5):
                                        acc[b] = acc[b] + _shfl(acc[b], T.shift_right(16, r))
                                if lane == 0:
                                    for b in T.unroll(TB):
                                        if tok[b] >= 0:
                                            h[lo + g * TB + b, j] = swiglu(acc[b] * scale(s1, we, g0 + j), acc[TB + b] * scale(s1, we, u0 + j))

    body = body_cuda if target == "cuda" else body_llvm
    return _gate_up_func(spec, wshape, "uint8" if fp8 else spec.w_dtype, body)


def make_down(spec: GroupedExpertsSpec, target: str = "llvm"):
    """``down(h [T * K, I], w2 [E, D, I], [s2 [E, D],] offsets, order, rw [T, K], y [T * K, D] float32)``: y per slot."""
    check_supported(spec, target)
    if target == "cuda" and mma_eligible(spec, "down"):
        return _make_down_mma(spec)
    D, I, E, K = spec.hidden, spec.inter, spec.experts, spec.top_k
    fp8 = spec.w_format == "fp8"
    wshape, ei = _windex((spec.slots or E, D, I))

    def scale(s2, e, d):
        return s2[e, d] if fp8 else T.float32(1)

    @T.macro
    def body_llvm(h, w, s2, offsets, order, rw, y):
        for e in T.serial(E):
            for i in T.serial(offsets[e + 1] - offsets[e]):
                for d in T.serial(D):
                    with T.sblock("down"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        p: T.let[T.int32] = offsets[e] + i
                        we: T.let[T.int32] = _weight_slot(spec, offsets, e)
                        acc[0] = T.float32(0)
                        for c in T.serial(I):
                            acc[0] = acc[0] + _f32(h[p, c]) * _wval(spec, w[ei(we), d, c])
                        y[order[p], d] = acc[0] * scale(s2, we, d) * _f32(rw[order[p] // K, order[p] % K])

    cfg = _warp_launch(spec)["down"]
    NW, VEC, IT, TB, NBX = spec.warps, cfg["vec"], cfg["iters"], spec.token_tile, cfg["blocks"][0]
    full = I % (32 * VEC) == 0

    @T.macro
    def body_cuda(h, w, s2, offsets, order, rw, y):
        for e in T.thread_binding(E, thread="blockIdx.y"):
            for db in T.thread_binding(NBX, thread="blockIdx.x"):
                for tx in T.thread_binding(32 * NW, thread="threadIdx.x"):
                    with T.sblock("down"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((TB,), "float32", scope="local")
                        wv = T.sblock_alloc_buffer((VEC,), w.dtype, scope="local")
                        hv = T.sblock_alloc_buffer((VEC,), spec.h_dtype, scope="local")
                        lane: T.let[T.int32] = tx % 32
                        d: T.let[T.int32] = db * NW + tx // 32
                        lo: T.let[T.int32] = offsets[e]
                        cnt: T.let[T.int32] = offsets[e + 1] - lo
                        we: T.let[T.int32] = _weight_slot(spec, offsets, e)
                        if d < D:
                            for g in T.serial((cnt + TB - 1) // TB):
                                for b in T.unroll(TB):
                                    acc[b] = T.float32(0)
                                for it in T.serial(IT):
                                    if full or (it * 32 + lane) * VEC < I:
                                        for v in T.vectorized(VEC):
                                            wv[v] = w[ei(we), d, (it * 32 + lane) * VEC + v]
                                        for b in T.unroll(TB):
                                            if g * TB + b < cnt:
                                                for v in T.vectorized(VEC):
                                                    hv[v] = h[lo + g * TB + b, (it * 32 + lane) * VEC + v]
                                                for v in T.unroll(VEC):
                                                    acc[b] = acc[b] + _f32(hv[v]) * _wval(spec, wv[v])
                                for b in T.unroll(TB):
                                    for r in T.unroll(5):
                                        acc[b] = acc[b] + _shfl(acc[b], T.shift_right(16, r))
                                if lane == 0:
                                    for b in T.unroll(TB):
                                        if g * TB + b < cnt:
                                            y[order[lo + g * TB + b], d] = acc[b] * scale(s2, we, d) * _f32(
                                                rw[order[lo + g * TB + b] // K, order[lo + g * TB + b] % K])

    body = body_cuda if target == "cuda" else body_llvm
    return _down_func(spec, wshape, "uint8" if fp8 else spec.w_dtype, body)


# ---------------------------------------------------------------------------- combine


def make_combine(spec: GroupedExpertsSpec, target: str = "llvm"):
    """``combine(y [T * K, D] float32, ids [T, K], out [T, D])``: out[t] = sum_k y[t * K + k] (valid ids only)."""
    check_supported(spec, target)
    D, E, K = spec.hidden, spec.experts, spec.top_k
    attrs = _attrs("moe_combine")

    def valid(ids, t, k):
        return _in_range(_norm_id(ids[t, k], E), E)

    if target == "llvm":
        @T.prim_func(s_tir=True)
        def moe_combine(y_h: T.handle, ids_h: T.handle, out_h: T.handle):
            T.func_attr(attrs)
            N = T.int64()
            y = T.match_buffer(y_h, (N * K, D), "float32")
            ids = T.match_buffer(ids_h, (N, K), spec.ids_dtype)
            out = T.match_buffer(out_h, (N, D), spec.out_dtype)
            for t in T.serial(N):
                for d in T.serial(D):
                    with T.sblock("combine"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        acc[0] = T.float32(0)
                        for k in T.serial(K):
                            if valid(ids, t, k):
                                acc[0] = acc[0] + y[t * K + k, d]
                        out[t, d] = T.Cast(spec.out_dtype, acc[0])

        return moe_combine

    cfg = launch_config(spec)["combine"]
    NT, VEC, IT = cfg["threads"], cfg["vec"], cfg["iters"]
    full = D % (NT * VEC) == 0

    @T.prim_func(s_tir=True)
    def moe_combine(y_h: T.handle, ids_h: T.handle, out_h: T.handle):
        T.func_attr(attrs)
        N = T.int64()
        y = T.match_buffer(y_h, (N * K, D), "float32")
        ids = T.match_buffer(ids_h, (N, K), spec.ids_dtype)
        out = T.match_buffer(out_h, (N, D), spec.out_dtype)
        for t in T.thread_binding(N, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("combine"):
                    T.reads()
                    T.writes()
                    acc = T.sblock_alloc_buffer((VEC,), "float32", scope="local")
                    yv = T.sblock_alloc_buffer((VEC,), "float32", scope="local")
                    ov = T.sblock_alloc_buffer((VEC,), spec.out_dtype, scope="local")
                    for it in T.unroll(IT):
                        if full or (it * NT + tx) * VEC < D:
                            for v in T.unroll(VEC):
                                acc[v] = T.float32(0)
                            for k in T.unroll(K):
                                if valid(ids, t, k):
                                    for v in T.vectorized(VEC):
                                        yv[v] = y[t * K + k, (it * NT + tx) * VEC + v]
                                    for v in T.unroll(VEC):
                                        acc[v] = acc[v] + yv[v]
                            for v in T.unroll(VEC):
                                ov[v] = T.Cast(spec.out_dtype, acc[v])
                            for v in T.vectorized(VEC):
                                out[t, (it * NT + tx) * VEC + v] = ov[v]

    return moe_combine


KERNELS = {"route_prep": make_route_prep, "gate_up": make_gate_up, "down": make_down, "combine": make_combine}


def make_grouped_experts(spec: GroupedExpertsSpec, target: str = "llvm") -> dict:
    """The four PrimFuncs of ``spec`` by name (route_prep, gate_up, down, combine)."""
    return {name: make(spec, target) for name, make in KERNELS.items()}


# ---------------------------------------------------------------------------- NumPy reference


def quantize_fp8(w):
    """Stacked weights [E, R, C] -> (e4m3 bytes uint8 [E, R, C], float32 scales [E, R]): one scale per output
    channel (row), ``scale = max|row| / 448``, codes rounded to nearest even (``ml_dtypes``)."""
    import ml_dtypes
    import numpy as np

    wf = np.asarray(w, np.float32)
    scale = np.maximum(np.abs(wf).max(-1) / np.float32(448.0), np.float32(2.0**-24)).astype(np.float32)
    codes = np.clip(wf / scale[..., None], -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return codes, scale


W_TILE_ROWS, W_TILE_K = 16, MMA_K  # ``w_tiles``: a tile's rows, and the k of one of its contiguous k-steps


def tile_fp8(codes):
    """FP8 codes [E, R, C] (R a multiple of 16, C of 64) in ``w_tiles`` order, same shape: each 16-row tile's bytes
    k-step by k-step (64 columns of its 16 rows, row after row), so the tile's k loop reads one contiguous stream."""
    import numpy as np

    c = np.asarray(codes)
    e, r, k = c.shape
    return np.ascontiguousarray(c.reshape(e, r // W_TILE_ROWS, W_TILE_ROWS, k // W_TILE_K, W_TILE_K)
                                .transpose(0, 1, 3, 2, 4).reshape(e, r, k))


def untile_fp8(tiled):
    """The inverse of ``tile_fp8``."""
    import numpy as np

    c = np.asarray(tiled)
    e, r, k = c.shape
    return np.ascontiguousarray(c.reshape(e, r // W_TILE_ROWS, k // W_TILE_K, W_TILE_ROWS, W_TILE_K)
                                .transpose(0, 1, 3, 2, 4).reshape(e, r, k))


def _w_reader(spec: GroupedExpertsSpec, w, ei, we, red: int):
    """``w_at(row, k)`` of the cp.async forms: element (row, k) of expert slot ``we``, where ``tile_fp8`` put it
    with ``w_tiles`` (the tile's rows of the 3-D buffer, at k-step ``k // 64``'s 1 KB, row ``row % 16``'s 64 bytes)."""
    if not spec.w_tiles:
        return lambda row, k: w[ei(we), row, k]

    def at(row, k):
        within = (k // W_TILE_K) * (W_TILE_ROWS * W_TILE_K) + (row % W_TILE_ROWS) * W_TILE_K + k % W_TILE_K
        return w[ei(we), (row // W_TILE_ROWS) * W_TILE_ROWS + within // red, within % red]
    return at


def dequantize_fp8(codes, scales):
    """float32 [E, R, C] weights that ``quantize_fp8`` codes stand for."""
    import ml_dtypes
    import numpy as np

    return np.asarray(codes).view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.asarray(scales, np.float32)[..., None]



def reference_route(ids, num_experts: int):
    """``(offsets, order)`` as the kernels define them (stable counting sort of the slots by expert)."""
    import numpy as np

    flat = np.asarray(ids).reshape(-1).astype(np.int64)
    flat = np.where(flat < 0, flat + num_experts, flat)
    valid = (flat >= 0) & (flat < num_experts)
    counts = np.bincount(flat[valid], minlength=num_experts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    order = np.argsort(np.where(valid, flat, num_experts), kind="stable")[: int(valid.sum())].astype(np.int32)
    return offsets, order


def reference(x, w1, w2, ids, rw, gate_first: bool = True, h_dtype=None):
    """NumPy float32 reference of the whole layer: ``(h per slot [S, I], out [T, D])``."""
    import numpy as np

    xf, w1f, w2f = (np.asarray(a, np.float32) for a in (x, w1, w2))
    t, k = np.asarray(ids).shape
    e_all, two_i, _ = w1f.shape
    i = two_i // 2
    flat = np.asarray(ids).reshape(-1).astype(np.int64)
    flat = np.where(flat < 0, flat + e_all, flat)
    valid = (flat >= 0) & (flat < e_all)
    safe = np.where(valid, flat, 0)
    xs = np.repeat(xf, k, axis=0)  # S, D
    gu = np.einsum("sd,snd->sn", xs, w1f[safe])  # S, 2I
    g, u = (gu[:, :i], gu[:, i:]) if gate_first else (gu[:, i:], gu[:, :i])
    h = g / (1 + np.exp(-g)) * u
    if h_dtype is not None:
        h = h.astype(h_dtype).astype(np.float32)
    y = np.einsum("si,sdi->sd", h, w2f[safe]) * np.asarray(rw, np.float32).reshape(-1, 1)
    y = np.where(valid[:, None], y, 0)
    return h, y.reshape(t, k, -1).sum(1)


__all__ = ["GroupedExpertsSpec", "KERNELS", "check_supported", "dequantize_fp8", "launch_config", "make_combine",
           "make_down", "make_gate_up", "make_grouped_experts", "make_route_prep", "quantize_fp8", "reference",
           "reference_route", "tile_fp8", "untile_fp8"]
