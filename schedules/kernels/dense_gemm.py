"""Dense GEMM of a linear layer (TIR): ``y[M, N] = x[M, K] @ W[N, K]^T``, the weight stored [out, in].

Legend: M tokens (dynamic), N output features, K input features. ``x`` and ``W`` of one 16-bit float dtype
(bfloat16 or float16), products accumulated in float32, ``y`` stored in ``out_dtype`` (float32 as the
imported graph's ``matmul(..., out_dtype="float32")``, or the activations' dtype).

Forms (``target``): "llvm", serial loops (CPU builds and CI); "cuda", tensor cores (``mma.sync``
m16n8k16, the same lane layout as ``grouped_experts``' mma forms): a grid of (token passes, row blocks).
Block (p, b) computes tokens [p TOK, p TOK + TOK) (TOK = 8 NT) against rows [b R, b R + R) of W (R = NW
warps x RT tiles of 16 rows). Each k-step of 64 lane l (g = l // 4, q = l % 4) loads 16 contiguous
elements of rows r + g and r + g + 8 (two 16-byte loads; a row's 64 elements are one 128-byte line across
its 4 lanes) and the same 16 of token g of each 8-token tile; the four mma of the step read them as
k = 16 q + 4 s + (0..3), one permutation of k for both operands. The token pass is the grid's fastest
axis, so the blocks that share a weight slice run together and all but the first read it from L2: at
decode sizes (M <= TOK) the weight is streamed from HBM once per step. Nothing is padded: M is dynamic,
token tiles past M are skipped (warp-uniform), rows past N are not read. Compiled models (``compiled_spec``) take
the cp.async form with ldmatrix fragments (``DenseSpec.ldmatrix``, ``_ldsm_pipe_mainloop``): the same tiles and
grid, the stages' chunks swizzled for ldmatrix and the k16 steps in natural order, every token tile multiplied.
The wgmma form (``DenseSpec.wgmma``, ``_wgmma_grid``; sm_90a targets) issues one asynchronous warpgroup instruction
per 64 rows x up to 128 tokens x 16 k from stages in the same swizzle (the 128-byte swizzle wgmma's descriptors
name), where mma.sync issues one per 16 x 8 x 16.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

try:
    from tvm.script import tirx as T
except ImportError:  # runtime-only TVM
    T = None

from ...compiler.errors import MoecError
from ..cuda_prelude import WGMMA_N
from .grouped_experts import (_MMA_TYPE, _mma, DYN_SMEM_LIMIT, MMA_K, SMEM_LIMIT, TILE_K, TILE_PAD, TILE_ROWS, TILE_STAGES, TILE_TOKENS, _mma_mainloop,
                              _mma_pipe_mainloop, _tile_mainloop, check_dyn_shared, check_tile, tile_buffer, tile_copy_row, tile_scope)

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class DenseSpec:
    """One linear layer's shapes and dtypes (one kernel per distinct spec)."""

    out_features: int  # N
    in_features: int  # K
    x_dtype: str = "bfloat16"
    w_dtype: str = "bfloat16"
    out_dtype: str = "float32"
    warps: int = 4  # NW
    row_tiles: int = 1  # RT: 16-row tiles per warp
    n_tiles: int = 4  # NT: 8-token tiles per block
    stages: int = 0  # 0: operands loaded into registers; 2..8: cp.async stages through shared memory (as fit)
    l2_prefetch: int = 256  # cp.async stages: the L2::<n>B prefetch hint of the weight copies (0 none, 64, 128, 256)
    dyn_shared: int = 0  # cp.async stages: 0, static shared memory (at most SMEM_LIMIT bytes); else the stages live in
    #                      dynamic shared memory of at most this many bytes (sm_90: up to grouped_experts.DYN_SMEM_LIMIT), for more in flight
    k_groups: int = 1  # cp.async stages: G groups of NW warps a block, each over K / G of the k range (its own stages),
    #                    their sums added through shared memory at the end: G times the warps on the same tiles, a
    #                    G times shorter chain of k-steps (decode batches give few blocks: 128 tokens x 2048 rows is 128)
    k_splits: int = 1  # cp.async stages: KS blocks over K / KS of the k range each (grid axis z), each storing its float32
    #                    sums to a workspace [M, KS, N]; a second kernel adds the KS sums in split order into y. More
    #                    blocks on the same tiles, so a block may take more tokens (n_tiles up to 16: the weight read
    #                    once at 128 tokens) and more rows while the grid still fills the GPU. Slower than one split
    #                    at every decode size on the H100 (bench/results/dense_gemm_splitk_h100_d8e80a5.json): compiled
    #                    models keep one
    ldmatrix: bool = False  # cp.async stages: fragments by ldmatrix from chunk-swizzled stages (``_ldsm_pipe_mainloop``)
    #                        instead of each lane's 16-byte loads, whose weight fragments ptxas assembled with register
    #                        moves (sm_90: 44 moves in a k-step's 137 instructions at 32-token passes)
    frag_ahead: bool = False  # ldmatrix: the next k-step's fragments loaded under this step's mma (two fragment buffers)
    wgmma: bool = False  # warpgroup tensor cores (sm_90a, ``_wgmma_grid``): one warpgroup a block (warps 4), RT tiles of 64
    #                      rows, 8 NT tokens (32, 64 or 128) as the instruction's n, both operands from cp.async stages in
    #                      the 128-byte swizzle of dynamic shared memory (``dyn_shared``); mma.sync issues one instruction
    #                      per 16 x 8 x 16, wgmma one per 64 x 8 NT x 16, asynchronously
    wgmma_ahead: bool = False  # wgmma: a k-step's wgmma left in flight through the next step's wait and barrier (waited
    #                            for one step later; its stage refilled one step later: S - 2 steps of copies ahead)

    def check(self) -> None:
        for what in ("out_features", "in_features", "warps", "row_tiles", "n_tiles"):
            v = getattr(self, what)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise MoecError(f"dense_gemm: {what} must be a positive integer, got {v!r}")
        for what in ("x_dtype", "w_dtype", "out_dtype"):
            if getattr(self, what) not in DTYPES:
                raise MoecError(f"dense_gemm: {what} must be one of {', '.join(DTYPES)}, got {getattr(self, what)!r}")
        if self.n_tiles > (16 if self.stages else 8) or self.row_tiles > 4:
            raise MoecError(f"dense_gemm: at most 8 token tiles (16 with cp.async stages) and 4 row tiles (registers), got "
                            f"{self.n_tiles}, {self.row_tiles}")
        if not isinstance(self.stages, int) or isinstance(self.stages, bool) or self.stages == 1 or not 0 <= self.stages <= 16:
            raise MoecError(f"dense_gemm: stages must be 0 (register loads) or 2..16, got {self.stages!r}")
        check_dyn_shared(self.dyn_shared, "dense_gemm")
        if self.k_groups not in K_GROUPS:
            raise MoecError(f"dense_gemm: k_groups must be one of {', '.join(map(str, K_GROUPS))}, got {self.k_groups!r}")
        if self.k_groups > 1:
            if not self.stages:
                raise MoecError("dense_gemm: k_groups > 1 needs cp.async stages (stages >= 2)")
            if 32 * self.warps * self.k_groups > 1024:
                raise MoecError(f"dense_gemm: {self.warps} warps x {self.k_groups} k groups exceed 1024 threads a block")
            if reduce_bytes(self) > SMEM_LIMIT:
                raise MoecError(f"dense_gemm: the k groups' sums ({reduce_bytes(self)} bytes) exceed {SMEM_LIMIT} bytes of "
                                "static shared memory; use fewer k groups or token tiles")
        if self.k_splits not in K_SPLITS:
            raise MoecError(f"dense_gemm: k_splits must be one of {', '.join(map(str, K_SPLITS))}, got {self.k_splits!r}")
        if self.k_splits > 1 and not self.stages:
            raise MoecError("dense_gemm: k_splits > 1 needs cp.async stages (stages >= 2)")
        if self.l2_prefetch not in (0, 64, 128, 256):
            raise MoecError(f"dense_gemm: l2_prefetch must be 0, 64, 128 or 256, got {self.l2_prefetch!r}")
        if not isinstance(self.ldmatrix, bool):
            raise MoecError(f"dense_gemm: ldmatrix must be True or False, got {self.ldmatrix!r}")
        if self.ldmatrix and (not self.stages or self.k_groups > 1):
            raise MoecError("dense_gemm: ldmatrix fragments need cp.async stages (stages >= 2) and one k group")
        if not isinstance(self.frag_ahead, bool):
            raise MoecError(f"dense_gemm: frag_ahead must be True or False, got {self.frag_ahead!r}")
        if self.frag_ahead and not self.ldmatrix:
            raise MoecError("dense_gemm: frag_ahead loads ldmatrix fragments a k-step ahead: it needs ldmatrix=True")
        if not isinstance(self.wgmma, bool):
            raise MoecError(f"dense_gemm: wgmma must be True or False, got {self.wgmma!r}")
        if self.wgmma:
            if self.warps != 4 or self.row_tiles not in (1, 2) or 8 * self.n_tiles not in WGMMA_N:
                raise MoecError(f"dense_gemm: the wgmma form takes one warpgroup (warps 4, got {self.warps}), 1 or 2 row tiles "
                                f"of 64 (got {self.row_tiles}) and {', '.join(str(n // 8) for n in WGMMA_N)} token tiles "
                                f"(got {self.n_tiles})")
            if self.ldmatrix or self.frag_ahead or self.k_groups > 1 or not self.stages or not self.dyn_shared:
                raise MoecError("dense_gemm: the wgmma form takes cp.async stages in dynamic shared memory (stages >= 2, "
                                "dyn_shared), one k group and no ldmatrix fragments")
        if not isinstance(self.wgmma_ahead, bool) or (self.wgmma_ahead and (not self.wgmma or self.stages < 3)):
            raise MoecError(f"dense_gemm: wgmma_ahead keeps a wgmma k-step in flight: it needs the wgmma form and 3 or more "
                            f"stages, got {self.wgmma_ahead!r}")
        if self.stages and pipe_stages(self)[0] < 2:
            raise MoecError(f"dense_gemm: two cp.async stages ({2 * pipe_stages(self)[1]} bytes) exceed {shared_limit(self)} bytes "
                            "of shared memory; use fewer warps, row tiles or token tiles")

    def to_dict(self) -> dict:
        return asdict(self)


K_GROUPS = (1, 2, 4, 8)
K_SPLITS = (1, 2, 4, 8, 16)
WG_K = MMA_K  # k a wgmma stage: one 128-byte row of 16-bit elements (the swizzle's width)
WG_ALIGN = 1024  # bytes of the wgmma form's buffer kept to align its stages to the swizzle's 1024-byte groups


def reduce_bytes(spec: DenseSpec) -> int:
    """Static shared memory of the k groups' sums: groups 1..G-1's float32 accumulators, G - 1 x 32 NW x 4 RT NT."""
    return (spec.k_groups - 1) * 32 * spec.warps * 4 * spec.row_tiles * spec.n_tiles * 4


def eligible(spec: DenseSpec) -> str | None:
    """None if the kernel takes ``spec``, else why not (the tensor-core form's conditions, on every target)."""
    if spec.w_dtype not in _MMA_TYPE:
        return f"weight dtype {spec.w_dtype} (tensor cores take bfloat16 or float16)"
    if spec.x_dtype != spec.w_dtype:
        return f"activations {spec.x_dtype} and weight {spec.w_dtype} differ in dtype"
    if spec.in_features % MMA_K:
        return f"{spec.in_features} input features are not a multiple of {MMA_K}"
    if spec.in_features % (MMA_K * spec.k_groups * spec.k_splits):
        split = f"{spec.k_splits} k splits x " if spec.k_splits > 1 else ""
        return f"{spec.in_features} input features do not split into {split}{spec.k_groups} k groups of multiples of {MMA_K}"
    if spec.out_features % 16:
        return f"{spec.out_features} output features are not a multiple of 16"
    return None


# Compiled models' kernel shape (H200, bench/results/dense_gemm_stages.json): four cp.async stages beat the
# register form at every size (2048 x 2048 at 128 tokens: 12.1 against 18.5 us; 4096 x 4096: 30.0 against
# 46.8); 8-token-tile blocks of 64 tokens win for LM heads at decode batches (50304 x 2048 at 128 tokens:
# 118 against 153 us) while 32-token blocks keep the projections fastest up to 128 tokens.
COMPILED_STAGES = 4
WIDE_OUT_FEATURES = 16384  # from here on (LM heads) blocks take 8 token tiles
COMPILED_LDMATRIX = True  # fragments by ldmatrix (``DenseSpec.ldmatrix``): faster at every 128-token shape on an H100
#                           (bench/results/dense_gemm_ldmatrix_h100_a116b95.json)


def wgmma_arch(arch: str | None) -> bool:
    """Whether a CUDA target of this ``arch`` compiles linear layers to the wgmma form (sm_90a: Hopper's warpgroup
    instructions are in its architecture-specific set only)."""
    return arch == "sm_90a"


# The wgmma form on an H100 (bench/results/dense_gemm_wgmma_h100_358531a.json and dense_gemm_wgmma_ahead_h100_823374b.json,
# cold, us): at 128 tokens 32-token passes beat the mma.sync form on every projection, best with 8 stages and each
# step's wgmma left in flight where the blocks of a 128-token step fit at two an SM (OLMoE 2048 x 2048: 8.6 against
# 11.3, cuBLAS 7.9; Mixtral 4096 x 4096: 22.7 against 29.2), with 6 stages where they do not (the q/k/v in one launch,
# 384 blocks: 16.5 against 22.1); 128-token passes the LM head (98 against 175; cuBLAS 85) and, with the wgmma in
# flight, every layer at 2048 tokens (OLMoE 41.7 against 108.5 and the prefill's tiled form's ~76; q/k/v 135.5 against
# 306.4); k splits (a float32 workspace and a second kernel) lost everywhere but one
WG_DECODE = {"wgmma": True, "stages": 6, "n_tiles": 4}
WG_DECODE_FEW = {"wgmma": True, "stages": 8, "n_tiles": 4, "wgmma_ahead": True}  # 96 KB a block: two an SM
WG_FEW_BLOCKS = 2 * 132  # blocks of a 128-token step (4 passes x N / 64) that take WG_DECODE_FEW (an H100 / H200: 132 SMs)
WG_WIDE = {"wgmma": True, "stages": 4, "n_tiles": 16}  # LM heads (from WIDE_OUT_FEATURES)
WG_PREFILL = {"wgmma": True, "stages": 4, "n_tiles": 16, "wgmma_ahead": True}  # the prefill's layers


def compiled_spec(out_features: int, in_features: int, x_dtype: str = "bfloat16", w_dtype: str = "bfloat16",
                  out_dtype: str = "float32", wgmma: bool = False, prefill: bool = False) -> DenseSpec:
    """The spec compiled models use for a linear layer of these shapes and dtypes (see the tables above); ``wgmma``
    (sm_90a targets): the wgmma form, 32-token passes of 64-row blocks (8 stages, each step's wgmma in flight, where
    a 128-token step's blocks fit two an SM), 128-token passes for LM heads and in the prefill entry (``prefill``)."""
    if wgmma:
        kw = WG_PREFILL if prefill else WG_WIDE if out_features >= WIDE_OUT_FEATURES else WG_DECODE_FEW if (
            4 * -(-out_features // 64) <= WG_FEW_BLOCKS) else WG_DECODE
        return DenseSpec(out_features=out_features, in_features=in_features, x_dtype=x_dtype, w_dtype=w_dtype,
                         out_dtype=out_dtype, dyn_shared=DYN_SMEM_LIMIT, **kw)
    return DenseSpec(out_features=out_features, in_features=in_features, x_dtype=x_dtype, w_dtype=w_dtype,
                     out_dtype=out_dtype, stages=COMPILED_STAGES, n_tiles=8 if out_features >= WIDE_OUT_FEATURES else 4,
                     ldmatrix=COMPILED_LDMATRIX)


def shared_limit(spec: DenseSpec) -> int:
    """Bytes of shared memory the cp.async stages may take: ``spec.dyn_shared`` (dynamic) or ``SMEM_LIMIT`` (static)."""
    return spec.dyn_shared or SMEM_LIMIT


def pipe_stages(spec: DenseSpec) -> tuple[int, int]:
    """``(stages, shared bytes per stage)`` of the cp.async form: at most ``spec.stages``, as many as fit in
    ``shared_limit(spec)`` (0: the register form). A stage is one k-step of 64 of each k group: each warp's RT
    tiles of 16 rows x 128 bytes and the pass's 8 NT token rows x 128 bytes."""
    if spec.wgmma:  # RT x 64 weight rows and 8 NT token rows of 128 bytes; 1 KB of the buffer kept for its alignment
        per_stage = (spec.row_tiles * 64 + 8 * spec.n_tiles) * WG_K * 2
        n = min(spec.stages, (min(spec.dyn_shared, DYN_SMEM_LIMIT) - WG_ALIGN) // per_stage)
        return (n if n >= 2 else 0), per_stage
    per_stage = (spec.warps * spec.row_tiles * 16 * MMA_K * 2 + 8 * spec.n_tiles * MMA_K * 2) * spec.k_groups
    if not spec.stages:
        return 0, per_stage
    # the k groups' sums take static shared memory beside the stages (a block's static and dynamic together: at most
    # DYN_SMEM_LIMIT)
    room = SMEM_LIMIT - reduce_bytes(spec) if not spec.dyn_shared else min(spec.dyn_shared, DYN_SMEM_LIMIT - reduce_bytes(spec))
    n = min(spec.stages, room // per_stage)
    return (n if n >= 2 else 0), per_stage


def launch_config(spec: DenseSpec) -> dict:
    rows = spec.warps * spec.row_tiles * 16
    if spec.wgmma:
        st, per = pipe_stages(spec)
        rows = 64 * spec.row_tiles
        blocks = ("ceil(M / %d)" % (8 * spec.n_tiles), -(-spec.out_features // rows)) + ((spec.k_splits,) if spec.k_splits > 1 else ())
        return {"form": f"wgmma m64n{8 * spec.n_tiles}k16 (sm_90a), cp.async stages in dynamic shared memory"
                        + (f", {spec.k_splits} k splits summed by a second kernel" if spec.k_splits > 1 else ""),
                "stages": st, "shared_bytes": st * per + WG_ALIGN, "blocks": blocks, "threads": 128, "rows_per_block": rows,
                "tokens_per_block": 8 * spec.n_tiles, "steps": spec.in_features // WG_K // spec.k_splits, "k_groups": 1,
                "k_splits": spec.k_splits}
    if spec.stages:
        st, per = pipe_stages(spec)
        form = "mma.sync m16n8k16, cp.async stages" + (" in dynamic shared memory" if spec.dyn_shared else "")
        if spec.ldmatrix:
            form += ", ldmatrix fragments" + (" a k-step ahead" if spec.frag_ahead else "")
        if spec.k_groups > 1:
            form += f", {spec.k_groups} k groups"
        blocks = ("ceil(M / %d)" % (8 * spec.n_tiles), -(-spec.out_features // rows))
        if spec.k_splits > 1:
            form += f", {spec.k_splits} k splits summed by a second kernel ({SPLIT_THREADS} threads a block, 4 outputs a thread)"
            blocks += (spec.k_splits,)
        return {"form": form, "stages": st, "shared_bytes": st * per + reduce_bytes(spec), "blocks": blocks,
                "threads": 32 * spec.warps * spec.k_groups, "rows_per_block": rows, "tokens_per_block": 8 * spec.n_tiles,
                "steps": spec.in_features // MMA_K // spec.k_groups // spec.k_splits, "k_groups": spec.k_groups,
                "k_splits": spec.k_splits}
    return {"form": "mma.sync m16n8k16", "blocks": ("ceil(M / %d)" % (8 * spec.n_tiles), -(-spec.out_features // rows)),
            "threads": 32 * spec.warps, "rows_per_block": rows, "tokens_per_block": 8 * spec.n_tiles,
            "steps": spec.in_features // MMA_K}


SPLIT_THREADS = 256  # threads a block of the k splits' sum


def _attrs(name: str = "dense_gemm") -> dict:
    return {"tirx.is_scheduled": True, "global_symbol": name, "tirx.noalias": True}


def _ldsm_pipe_mainloop(l2_prefetch: int, tiles: int, nt: int, steps: int, stages: int, nw: int, xl: int,
                        ahead: bool = False):
    """The k loop of the cp.async form with ldmatrix fragments (``DenseSpec.ldmatrix``), as a TIR macro
    ``mainloop(sb, af, bf, acc, tx, g, q, tile_row, tile_ok, w_at, x_ok, x_at, ab)``.

    Tiles, accumulators (``acc[(t nt + n) 4 + c]``: row ``tile_row(t) + g + 8 (c // 2)``, token ``n 8 + 2 q + c % 2``),
    copies and barriers are ``_mma_pipe_mainloop``'s; what changes is where a k-step's 64 elements of a row sit and how
    the fragments are read. ``sb`` is one buffer: the stages' weight rows ([stage][warp][tile][row 16][8 chunks][8]),
    then their token rows ([stage][token 8 nt][8 chunks][8]); chunk c of row r (elements 8 c .. 8 c + 7 of the
    k-step) sits at position ``c ^ (r % 8)``, so the eight rows of an ldmatrix matrix hit eight distinct 16-byte bank
    groups. Lane (g, q) copies chunks 4 c + q of its warp's rows g and g + 8 (c = 0, 1: 4 lanes, 64 contiguous bytes
    of a row); thread tx the token chunks tx, tx + 32 nw, ... (row ``(j 32 nw + tx) // 8``, chunk ``tx % 8``).

    The k16 step s of a k-step takes chunks 2 s and 2 s + 1, in order, for both operands: one ldmatrix x4 a tile
    (matrices: rows 0-7 and 8-15 of chunk 2 s, then of chunk 2 s + 1) gives its weight fragment a0..a3 in the mma's
    register order, one x4 a token tile and two k16 steps (matrices: its 8 token rows at chunks 4 h .. 4 h + 3) its
    b0, b1 of steps 2 h and 2 h + 1, with no register moves between loads and mma. Every token tile is multiplied,
    with no branch between the loads and the mma (k16 steps outermost, so that consecutive mma add into different
    accumulators): the columns of tokens past ``nv`` read stale shared memory and are never stored.

    ``ahead`` (``DenseSpec.frag_ahead``): two fragment buffers; k-step kc + 1's fragments are loaded while k-step kc's
    mma run, so the mma do not wait on the ldmatrix of their own step. The refill of a step moves ahead of its wait
    and barrier (the stage it overwrites was read two steps before), so as many copy groups stay in flight."""
    cpw = "cp.async.cg.shared.global" + (f".L2::{l2_prefetch}B" if l2_prefetch else "")
    cpx = "cp.async.cg.shared.global"
    WST = nw * tiles * 1024  # elements of a stage's weight rows
    XO = stages * WST  # the token stages' first element
    TOK = nt * 8

    def wpos(st, warp, t, row, ch):  # first element of chunk ch of row ``row`` (0..15) of the warp's tile t, stage st
        return (((st * nw + warp) * tiles + t) * 16 + row) * 64 + T.bitwise_xor(ch, row % 8) * 8

    def xpos(st, tok, ch):  # first element of chunk ch of token row ``tok`` (0 .. TOK - 1), stage st
        return XO + (st * TOK + tok) * 64 + T.bitwise_xor(ch, tok % 8) * 8

    @T.macro
    def issue(sb, st, kc, tx, g, q, tile_row, tile_ok, w_at, x_ok, x_at):
        for t in T.unroll(tiles):
            if tile_ok(t):
                for rh in T.unroll(2):
                    for c in T.unroll(2):
                        T.evaluate(T.ptx[cpw](T.address_of(sb[wpos(st, tx // 32, t, g + 8 * rh, 4 * c + q)]),
                                              T.address_of(w_at(tile_row(t) + 8 * rh + g, kc * 64 + c * 32 + q * 8)), 16))
        for j in T.unroll(xl):
            if TOK * 8 % (32 * nw) == 0 or j * 32 * nw + tx < TOK * 8:
                if x_ok(j):
                    T.evaluate(T.ptx[cpx](T.address_of(sb[xpos(st, (j * 32 * nw + tx) // 8, tx % 8)]),
                                          T.address_of(x_at(j, kc * 64 + tx % 8 * 8)), 16))

    AF, BF = tiles * 32, nt * 16  # elements of one k-step's weight and token fragments (``ahead``: two of each)

    @T.macro
    def load(sb, af, bf, st, buf, tx, tile_ok):  # the fragments of the k-step in stage st into fragment buffer buf
        lane: T.let[T.int32] = tx % 32
        for t in T.unroll(tiles):
            if tile_ok(t):
                for s in T.unroll(4):
                    T.evaluate(T.ptx_legacy.ldmatrix(False, 4, ".b16", af.data, buf * AF + (t * 4 + s) * 8, T.address_of(
                        sb[wpos(st, tx // 32, t, lane % 8 + (lane // 8) % 2 * 8, 2 * s + lane // 16)]), 0, dtype=af.dtype))
        for n in T.unroll(nt):
            for h in T.unroll(2):
                T.evaluate(T.ptx_legacy.ldmatrix(False, 4, ".b16", bf.data, buf * BF + n * 16 + h * 8, T.address_of(
                    sb[xpos(st, n * 8 + lane % 8, 4 * h + lane // 8)]), 0, dtype=bf.dtype))

    @T.macro
    def multiply(af, bf, acc, buf, tile_ok, ab):
        for s in T.unroll(4):  # (k16 steps outside: consecutive mma add into different accumulators)
            for t in T.unroll(tiles):
                if tile_ok(t):
                    for n in T.unroll(nt):
                        T.evaluate(_mma(af, buf * AF + (t * 4 + s) * 8, bf, buf * BF + n * 16 + 4 * s, acc, (t * nt + n) * 4, ab))

    @T.macro
    def refill(sb, kc, tx, g, q, tile_row, tile_ok, w_at, x_ok, x_at):
        if kc + stages - 1 < steps:
            issue(sb, (kc + stages - 1) % stages, kc + stages - 1, tx, g, q, tile_row, tile_ok, w_at, x_ok, x_at)
        T.evaluate(T.ptx["cp.async.commit_group"]())

    @T.macro
    def mainloop(sb, af, bf, acc, tx, g, q, tile_row, tile_ok, w_at, x_ok, x_at, ab):
        for i in T.unroll(tiles * 4 * nt):
            acc[i] = T.float32(0)
        T.tvm_storage_sync("shared")  # the previous pass's last steps are read: its stages may be refilled
        for s0 in T.unroll(stages - 1):
            if s0 < steps:
                issue(sb, s0, s0, tx, g, q, tile_row, tile_ok, w_at, x_ok, x_at)
            T.evaluate(T.ptx["cp.async.commit_group"]())
        if ahead:
            # step 0's fragments before the loop. At step kc: refill the stage step kc - 1 read (its ldmatrix ran at step
            # kc - 2, before every warp passed step kc - 1's barrier), wait for the groups up to kc + 1 (S - 2 younger
            # pending, as without ``ahead``), one barrier, then step kc + 1's fragments into the other buffer, issued
            # ahead of step kc's mma so that their loads run under them
            T.evaluate(T.ptx["cp.async.wait_group"](stages - 2))
            T.tvm_storage_sync("shared")
            load(sb, af, bf, 0, 0, tx, tile_ok)
            for k2 in T.serial((steps + 1) // 2):  # two k-steps a round: the buffers' roles are constants
                for par in T.unroll(2):
                    if k2 * 2 + par < steps:
                        refill(sb, k2 * 2 + par, tx, g, q, tile_row, tile_ok, w_at, x_ok, x_at)
                        T.evaluate(T.ptx["cp.async.wait_group"](stages - 2))
                        T.tvm_storage_sync("shared")
                        if k2 * 2 + par + 1 < steps:
                            load(sb, af, bf, (k2 * 2 + par + 1) % stages, 1 - par, tx, tile_ok)
                        multiply(af, bf, acc, par, tile_ok, ab)
        else:
            for kc in T.serial(steps):
                T.evaluate(T.ptx["cp.async.wait_group"](stages - 2))
                T.tvm_storage_sync("shared")
                refill(sb, kc, tx, g, q, tile_row, tile_ok, w_at, x_ok, x_at)
                load(sb, af, bf, kc % stages, 0, tx, tile_ok)
                multiply(af, bf, acc, 0, tile_ok, ab)

    return mainloop


def make_dense(spec: DenseSpec, target: str = "llvm", parts: tuple[int, ...] | None = None):
    """``dense_gemm(x [M, K], w [N, K], y [M, N])``.

    ``parts`` (2 or 3 output widths summing to ``spec.out_features``): the linear layers of one input in one launch,
    ``dense_gemm2(x, w1, w2, y1, y2)`` / ``dense_gemm3(x, w1, w2, w3, y1, y2, y3)`` with ``w_i [N_i, K]`` and
    ``y_i [M, N_i]`` (a model's q, k and v projections). The grid's row blocks run over the weights one after the
    other (each block's rows lie in one weight: blocks start at multiples of its rows within each weight), and
    every block computes exactly what the one-weight kernel's block of those rows does.

    ``spec.k_splits`` KS > 1: one more argument, last, ``sums [M, KS, N]`` float32 (a workspace, every element
    written before it is read): split s stores the sums over its k range [s K / KS, (s + 1) K / KS) there (the
    outputs' columns side by side with ``parts``), then a second kernel adds them in split order into the outputs.
    The llvm form computes the same sums in the same order."""
    spec.check()
    why = eligible(spec)
    if why is not None:
        raise MoecError(f"dense_gemm: {why}")
    if target not in ("llvm", "cuda"):
        raise MoecError(f"dense_gemm: target must be 'llvm' or 'cuda', got {target!r}")
    outs = (spec.out_features,) if parts is None else tuple(parts)
    if not 1 <= len(outs) <= 3 or sum(outs) != spec.out_features or any(
            not isinstance(n, int) or n < 16 or n % 16 for n in outs):
        raise MoecError(f"dense_gemm: parts {parts!r} must be 1 to 3 multiples of 16 summing to {spec.out_features}")
    K, odt = spec.in_features, spec.out_dtype
    P, KSP = len(outs), spec.k_splits
    N1, N2, N3 = (outs + (16, 16))[:3]  # (the widths past P are placeholders no code reads)
    if target == "llvm":
        return _dense_llvm(spec, outs)
    sum_out = _split_sum(outs, odt, KSP) if KSP > 1 else None  # (grid calls it only with k splits)
    if spec.wgmma:
        return _wrap(spec, outs, _wgmma_grid(spec, outs, sum_out))

    NW, RT, NT = spec.warps, spec.row_tiles, spec.n_tiles
    TOK, ROWS, KC = 8 * NT, NW * RT * 16, K // MMA_K
    NB1, NB2, NB3 = (-(-N1 // ROWS), -(-N2 // ROWS), -(-N3 // ROWS))
    NBY = sum((NB1, NB2, NB3)[:P])
    wdt, ab = spec.w_dtype, _MMA_TYPE[spec.w_dtype]
    # ``spec.stages``: the operands staged through shared memory by cp.async, up to S k-steps in flight per block
    # (``_mma_pipe_mainloop``, the grouped expert kernels' loop), so a block keeps S - 1 steps of its weight rows
    # on the way without holding them in registers; thread tx copies the token chunks tx, tx + 32 NW, ... (row
    # ``chunk // 8`` of the pass). Tiles, grid and epilogue are the register form's.
    S = pipe_stages(spec)[0]
    XL = -(-(TOK * 8) // (32 * NW))  # token chunks each thread copies per step (staged form)
    # ``spec.k_groups`` G: warps NW g .. NW (g + 1) - 1 run the k-steps [g KC / G, (g + 1) KC / G) of the split's
    # range, each group with its own token stages; groups 1..G-1 leave their sums in ``red`` for group 0 to add and store
    G = spec.k_groups
    KS, KO = K // KSP, K // KSP // G  # input features of a split and of a group
    KG = KC // KSP // G  # k-steps of a group
    A = RT * 4 * NT  # accumulators a thread
    LDSM = spec.ldmatrix
    if LDSM:
        mainloop = _ldsm_pipe_mainloop(spec.l2_prefetch, RT, NT, KG, S, NW, XL, spec.frag_ahead)
    else:
        mainloop = _mma_pipe_mainloop(spec.l2_prefetch, G, S * NW * G * RT * 1024) if S else _mma_mainloop()
    XB = 16 if S and not LDSM else NT * 16  # the staged form reads one token tile at a time from shared memory
    FB = 2 if spec.frag_ahead else 1  # fragment buffers (frag_ahead: this k-step's and the next's)
    # the cp.async stages (a one-element placeholder in the register form); past 48 KB in dynamic shared memory
    SSC = ("shared.dyn" if spec.dyn_shared else "shared") if S else "local"
    SW = S * NW * RT * 1024 if S else 1  # [stage][warp][tile][rh][c][lane][8]
    SX = S * TOK * 64 if S else 1  # [stage][token][chunk (swizzled)][8]
    if LDSM:  # one buffer (ldmatrix addresses it by element): the weight stages, then the token stages
        SW, SX = S * (NW * RT * 1024 + TOK * 64), 1
    if G > 1:  # one buffer: the weight stages of all warps, then each group's token stages (two buffers of the k-group
        #        form in dynamic shared memory were laid over each other by TVM's merge of dynamic shared allocations)
        SW, SX = S * NW * G * RT * 1024 + G * S * TOK * 64, 1
    RED, RSC = ((G - 1) * A * 32 * NW, "shared") if G > 1 else (1, "local")  # [group - 1][accumulator][thread of the group]

    def grp(tx):  # the thread's k group
        return tx // (32 * NW)

    def tl(tx):  # the thread's index within its k group
        return tx if G == 1 else tx % (32 * NW)

    def kofs(k, tx, sp):  # input feature k of the thread's group in split sp
        return (k if G == 1 else grp(tx) * KO + k) if KSP == 1 else sp * KS + (k if G == 1 else grp(tx) * KO + k)

    @T.macro
    def store(y, n_out, rb, p0, nv, g, q, acc, sp, sums, col):
        for r in T.unroll(RT):
            if rb + r * 16 < n_out:
                for n in T.unroll(NT):
                    for c in T.unroll(4):  # c: (row g | g + 8) = c // 2, token 2 q + c % 2 of the tile
                        if n * 8 + 2 * q + c % 2 < nv:
                            if KSP == 1:
                                y[p0 + n * 8 + 2 * q + c % 2, rb + r * 16 + g + 8 * (c // 2)] = T.Cast(odt, acc[(r * NT + n) * 4 + c])
                            else:
                                sums[p0 + n * 8 + 2 * q + c % 2, sp, col + rb + r * 16 + g + 8 * (c // 2)] = acc[(r * NT + n) * 4 + c]

    @T.macro
    def part(x, w, y, n_out, bbl, pb, tx, wa, af, xb, xf, acc, ws, xs, red, sp, sums, col):
        # the block's rows [bbl ROWS, bbl ROWS + ROWS) of w [n_out, K] against the pass's tokens, into y (or split sp's
        # sums of them, columns from col)
        lane: T.let[T.int32] = tx % 32
        g: T.let[T.int32] = lane // 4
        q: T.let[T.int32] = lane % 4
        rb: T.let[T.int32] = bbl * ROWS + (tl(tx) // 32) * (RT * 16)
        p0: T.let[T.int32] = T.Cast("int32", pb) * TOK
        nv: T.let[T.int32] = T.Cast("int32", x.shape[0]) - p0
        if LDSM:
            mainloop(ws, af, xf, acc, tx, g, q, lambda t: rb + t * 16, lambda t: rb + t * 16 < n_out,
                     lambda row, k: w[row, kofs(k, tx, sp)], lambda j: (j * 32 * NW + tx) // 8 < nv,
                     lambda j, k: x[p0 + (j * 32 * NW + tx) // 8, kofs(k, tx, sp)], ab)
        elif S > 0:
            mainloop(ws, ws if G > 1 else xs, wa, af, xb, xf, acc, tx, g, q, nv, RT, NT, KG, S, NW * G, XL,
                     lambda t: rb + t * 16, lambda t: rb + t * 16 < n_out, lambda row, k: w[row, kofs(k, tx, sp)],
                     lambda j: (j * 32 * NW + tl(tx)) // 8 < nv, lambda j, k: x[p0 + (j * 32 * NW + tl(tx)) // 8, kofs(k, tx, sp)], ab)
        else:
            mainloop(wa, af, xb, xf, acc, g, q, nv, RT, NT, KC, lambda t: rb + t * 16, lambda t: rb + t * 16 < n_out,
                     lambda row, k: w[row, k], lambda n: n * 8 + g < nv, lambda n, k: x[p0 + n * 8 + g, k], ab)
        if G > 1:
            if grp(tx) > 0:
                for i in T.unroll(A):
                    red[((grp(tx) - 1) * A + i) * 32 * NW + tl(tx)] = acc[i]
            T.tvm_storage_sync("shared")
            if grp(tx) == 0:
                for j in T.unroll(G - 1):
                    for i in T.unroll(A):
                        acc[i] = acc[i] + red[(j * A + i) * 32 * NW + tx]
                store(y, n_out, rb, p0, nv, g, q, acc, sp, sums, col)
        else:
            store(y, n_out, rb, p0, nv, g, q, acc, sp, sums, col)

    @T.macro
    def block(x, pb, bb, tx, sp, sums, w1, y1, w2, y2, w3, y3):
        # block (pb, bb[, sp]): its row block's weight (block-uniform: each block's rows lie in one weight)
        with T.sblock("dense"):
            T.reads()
            T.writes()
            wa = T.sblock_alloc_buffer((RT * 32,), wdt, scope="local")  # [r][row g|g+8][16]
            af = T.sblock_alloc_buffer((FB * RT * 32,), wdt, scope="local")  # [buffer][r][step][8]
            xb = T.sblock_alloc_buffer((XB,), wdt, scope="local")  # [tile][16]
            xf = T.sblock_alloc_buffer((FB * XB,), wdt, scope="local")  # its mma operand copy (scalar-typed; ldmatrix: [buffer][n][16])
            acc = T.sblock_alloc_buffer((RT * 4 * NT,), "float32", scope="local")  # [r][tile][4]
            ws = T.sblock_alloc_buffer((SW,), wdt, scope=SSC)  # [stage][warp][tile][rh][c][lane][8]
            xs = T.sblock_alloc_buffer((SX,), wdt, scope=SSC)  # [stage][token][chunk (swizzled)][8]
            red = T.sblock_alloc_buffer((RED,), "float32", scope=RSC)  # the k groups' sums (G > 1)
            if P == 1:
                part(x, w1, y1, N1, bb, pb, tx, wa, af, xb, xf, acc, ws, xs, red, sp, sums, 0)
            elif P == 2:
                if bb < NB1:
                    part(x, w1, y1, N1, bb, pb, tx, wa, af, xb, xf, acc, ws, xs, red, sp, sums, 0)
                else:
                    part(x, w2, y2, N2, bb - NB1, pb, tx, wa, af, xb, xf, acc, ws, xs, red, sp, sums, N1)
            else:
                if bb < NB1:
                    part(x, w1, y1, N1, bb, pb, tx, wa, af, xb, xf, acc, ws, xs, red, sp, sums, 0)
                elif bb < NB1 + NB2:
                    part(x, w2, y2, N2, bb - NB1, pb, tx, wa, af, xb, xf, acc, ws, xs, red, sp, sums, N1)
                else:
                    part(x, w3, y3, N3, bb - NB1 - NB2, pb, tx, wa, af, xb, xf, acc, ws, xs, red, sp, sums, N1 + N2)

    @T.macro
    def grid(x, sums, w1, y1, w2, y2, w3, y3):
        for pb in T.thread_binding((x.shape[0] + TOK - 1) // TOK, thread="blockIdx.x"):
            for bb in T.thread_binding(NBY, thread="blockIdx.y"):
                if KSP == 1:
                    for tx in T.thread_binding(32 * NW * G, thread="threadIdx.x"):
                        block(x, pb, bb, tx, 0, sums, w1, y1, w2, y2, w3, y3)
                else:
                    for sp in T.thread_binding(KSP, thread="blockIdx.z"):
                        for tx in T.thread_binding(32 * NW * G, thread="threadIdx.x"):
                            block(x, pb, bb, tx, sp, sums, w1, y1, w2, y2, w3, y3)
        if KSP > 1:
            sum_out(sums, y1, y2, y3)

    return _wrap(spec, outs, grid)


def _wgmma_grid(spec: DenseSpec, outs: tuple[int, ...], sum_out):
    """The wgmma form's grid (``DenseSpec.wgmma``), as a TIR macro ``grid(x, sums, w1, y1, w2, y2, w3, y3)``.

    Block (pass p, row block b[, split sp]), 128 threads (one warpgroup): tokens [p TOK, p TOK + TOK) (TOK = 8 NT)
    against weight rows [b R, b R + R) (R = 64 RT; each block's rows lie in one of the ``parts``), over the split's k
    range in k-steps of 64. A stage holds the step's RT tiles of 64 weight rows, then its TOK token rows, each row
    128 bytes in the 128-byte swizzle (16-byte chunk c of row r at c ^ (r % 8)); thread tx copies chunks tx, tx + 128,
    ... of the weight rows and of the token rows (cp.async, 16 bytes; rows past the weight's or the tokens' end are not
    copied: their stale products land in rows and columns never stored). Step kc: wait for its copies, make them
    visible to the async proxy, one barrier (every thread's copies of the stage are in, and step kc - 1's wgmma, waited
    for at its end, no longer read the stage refilled next), issue step kc + S - 1's copies, then 4 k16 wgmma
    m64n(TOK)k16 a row tile (A: the tile's rows, B: the tokens, both K-major, descriptors advanced 32 bytes a k16),
    committed and waited for. ``wgmma_ahead``: a step's wgmma are waited for at the end of the next step (wait_group
    1), so they run through that step's copy wait and barrier; copies go S - 2 steps ahead, so that the stage a step
    refills is the one step kc - 2 read, whose wgmma every warp has waited for before the barrier. The accumulators: ``acc[r TOK / 2 + 4 i + c]`` is weight row r 64 + 16 warp + g + 8 (c // 2)
    and token 8 i + 2 q + c % 2 (lane 4 g + q), stored as ``store`` of the mma.sync forms does (``y``, or the split's
    ``sums``)."""
    from ..cuda_prelude import FENCE_ASYNC_SMEM, SMEM_U32, WG_COMMIT, WG_DESC, WG_FENCE, WG_WAIT0, WG_WAIT1, register, wgmma_name

    register()
    K, odt, wdt = spec.in_features, spec.out_dtype, spec.w_dtype
    P, KSP = len(outs), spec.k_splits
    N1, N2, N3 = (outs + (16, 16))[:3]
    RT, NT = spec.row_tiles, spec.n_tiles
    TOK, ROWS = 8 * NT, 64 * RT
    NB1, NB2, NB3 = (-(-N1 // ROWS), -(-N2 // ROWS), -(-N3 // ROWS))
    NBY = sum((NB1, NB2, NB3)[:P])
    S = pipe_stages(spec)[0]
    AHEAD = bool(spec.wgmma_ahead)
    AH = 1 if AHEAD else 0  # k-steps whose wgmma stay in flight past the step (their stages refilled one later)
    KS = K // KSP  # input features of a split
    STEPS = KS // WG_K
    STG = (ROWS + TOK) * WG_K  # elements of a stage
    XO = ROWS * WG_K  # the token rows' first element in a stage
    WL, XL = ROWS * 8 // 128, TOK * 8 // 128  # 16-byte chunks a thread copies per stage: weight rows, token rows
    NH = TOK // 2  # accumulators a row tile
    MMA = wgmma_name(wdt, TOK)
    cpw = "cp.async.cg.shared.global" + (f".L2::{spec.l2_prefetch}B" if spec.l2_prefetch else "")
    cpx = "cp.async.cg.shared.global"

    def pos(base, st, row, ch):  # first element of chunk ch of a stage's row (weight rows 0 .. ROWS - 1, then tokens)
        return base + st * STG + row * WG_K + T.bitwise_xor(ch, row % 8) * 8

    @T.macro
    def issue(sb, base, st, kc, tx, w, n_out, rb, x, p0, nv, sp):
        for j in T.unroll(WL):
            if rb + (j * 128 + tx) // 8 < n_out:
                T.evaluate(T.ptx[cpw](T.address_of(sb[pos(base, st, (j * 128 + tx) // 8, tx % 8)]),
                                      T.address_of(w[rb + (j * 128 + tx) // 8, sp * KS + kc * WG_K + tx % 8 * 8]), 16))
        for j in T.unroll(XL):
            if (j * 128 + tx) // 8 < nv:
                T.evaluate(T.ptx[cpx](T.address_of(sb[pos(base, st, ROWS + (j * 128 + tx) // 8, tx % 8)]),
                                      T.address_of(x[p0 + (j * 128 + tx) // 8, sp * KS + kc * WG_K + tx % 8 * 8]), 16))

    @T.macro
    def part(x, w, y, n_out, bbl, pb, tx, sb, acc, sp, sums, col):
        lane: T.let[T.int32] = tx % 32
        g: T.let[T.int32] = lane // 4
        q: T.let[T.int32] = lane % 4
        rb: T.let[T.int32] = bbl * ROWS
        p0: T.let[T.int32] = T.Cast("int32", pb) * TOK
        nv: T.let[T.int32] = T.Cast("int32", x.shape[0]) - p0
        # the stages start at the buffer's first 1024-byte boundary (the swizzle repeats every 1024 bytes of address)
        base: T.let[T.int32] = T.Cast("int32", (T.uint32(WG_ALIGN) - (T.call_pure_extern("uint32", SMEM_U32, T.address_of(sb[0]))
                                                                         & T.uint32(WG_ALIGN - 1))) & T.uint32(WG_ALIGN - 1)) // 2
        for i in T.unroll(RT * NH):
            acc[i] = T.float32(0)
        for s0 in T.unroll(S - 1 - AH):
            if s0 < STEPS:
                issue(sb, base, s0, s0, tx, w, n_out, rb, x, p0, nv, sp)
            T.evaluate(T.ptx["cp.async.commit_group"]())
        for kc in T.serial(STEPS):
            T.evaluate(T.ptx["cp.async.wait_group"](S - 2 - AH))
            T.evaluate(T.call_extern("void", FENCE_ASYNC_SMEM))
            T.tvm_storage_sync("shared")
            if kc + S - 1 - AH < STEPS:
                issue(sb, base, (kc + S - 1 - AH) % S, kc + S - 1 - AH, tx, w, n_out, rb, x, p0, nv, sp)
            T.evaluate(T.ptx["cp.async.commit_group"]())
            T.evaluate(T.call_extern("void", WG_FENCE))
            for s in T.unroll(4):
                for r in T.unroll(RT):
                    T.evaluate(T.call_extern(
                        "void", MMA, T.address_of(acc[r * NH]),
                        T.call_pure_extern("uint64", WG_DESC, T.address_of(sb[pos(base, kc % S, r * 64, 0) + s * 16])),
                        T.call_pure_extern("uint64", WG_DESC, T.address_of(sb[pos(base, kc % S, ROWS, 0) + s * 16]))))
            T.evaluate(T.call_extern("void", WG_COMMIT))
            T.evaluate(T.call_extern("void", WG_WAIT1 if AHEAD else WG_WAIT0))
        if AHEAD:
            T.evaluate(T.call_extern("void", WG_WAIT0))
        for r in T.unroll(RT):
            for i in T.unroll(NT):
                for c in T.unroll(4):  # c: (row g | g + 8) = c // 2, token 2 q + c % 2 of the 8-token column group i
                    if rb + r * 64 + (tx // 32) * 16 + g + 8 * (c // 2) < n_out and i * 8 + 2 * q + c % 2 < nv:
                        if KSP == 1:
                            y[p0 + i * 8 + 2 * q + c % 2, rb + r * 64 + (tx // 32) * 16 + g + 8 * (c // 2)] = T.Cast(
                                odt, acc[r * NH + 4 * i + c])
                        else:
                            sums[p0 + i * 8 + 2 * q + c % 2, sp, col + rb + r * 64 + (tx // 32) * 16 + g + 8 * (c // 2)] = \
                                acc[r * NH + 4 * i + c]

    @T.macro
    def block(x, pb, bb, tx, sp, sums, w1, y1, w2, y2, w3, y3):
        with T.sblock("dense_wgmma"):
            T.reads()
            T.writes()
            sb = T.sblock_alloc_buffer((S * STG + WG_ALIGN // 2,), wdt, scope="shared.dyn")  # [stage][rows, tokens][64]
            acc = T.sblock_alloc_buffer((RT * NH,), "float32", scope="local")  # [row tile][i][4]
            if P == 1:
                part(x, w1, y1, N1, bb, pb, tx, sb, acc, sp, sums, 0)
            elif P == 2:
                if bb < NB1:
                    part(x, w1, y1, N1, bb, pb, tx, sb, acc, sp, sums, 0)
                else:
                    part(x, w2, y2, N2, bb - NB1, pb, tx, sb, acc, sp, sums, N1)
            else:
                if bb < NB1:
                    part(x, w1, y1, N1, bb, pb, tx, sb, acc, sp, sums, 0)
                elif bb < NB1 + NB2:
                    part(x, w2, y2, N2, bb - NB1, pb, tx, sb, acc, sp, sums, N1)
                else:
                    part(x, w3, y3, N3, bb - NB1 - NB2, pb, tx, sb, acc, sp, sums, N1 + N2)

    @T.macro
    def grid(x, sums, w1, y1, w2, y2, w3, y3):
        for pb in T.thread_binding((x.shape[0] + TOK - 1) // TOK, thread="blockIdx.x"):
            for bb in T.thread_binding(NBY, thread="blockIdx.y"):
                if KSP == 1:
                    for tx in T.thread_binding(128, thread="threadIdx.x"):
                        block(x, pb, bb, tx, 0, sums, w1, y1, w2, y2, w3, y3)
                else:
                    for sp in T.thread_binding(KSP, thread="blockIdx.z"):
                        for tx in T.thread_binding(128, thread="threadIdx.x"):
                            block(x, pb, bb, tx, sp, sums, w1, y1, w2, y2, w3, y3)
        if KSP > 1:
            sum_out(sums, y1, y2, y3)

    return grid


def _wrap(spec: DenseSpec, outs: tuple[int, ...], body):
    """The PrimFunc around ``body(x, sums, w1, y1, w2, y2, w3, y3)`` (a TIR macro; the weights and outputs past
    ``len(outs)`` repeat the first): ``dense_gemm(x, w, y[, sums])``, ``dense_gemm2(x, w1, w2, y1, y2[, sums])`` or
    ``dense_gemm3(x, w1, w2, w3, y1, y2, y3[, sums])``, M dynamic; ``sums [M, KS, N]`` only with k splits."""
    N, K, odt, wdt, KSP, P = spec.out_features, spec.in_features, spec.out_dtype, spec.w_dtype, spec.k_splits, len(outs)
    N1, N2, N3 = (outs + (16, 16))[:3]

    if P == 1:
        @T.prim_func(s_tir=True)
        def dense_gemm(x_h: T.handle, w_h: T.handle, y_h: T.handle, s_h: T.handle):
            T.func_attr(_attrs())
            M = T.int64()
            x = T.match_buffer(x_h, (M, K), spec.x_dtype)
            w = T.match_buffer(w_h, (N, K), wdt)
            y = T.match_buffer(y_h, (M, N), odt)
            sums = T.match_buffer(s_h, (M, KSP, N), "float32")
            body(x, sums, w, y, w, y, w, y)
        f = dense_gemm
    elif P == 2:
        @T.prim_func(s_tir=True)
        def dense_gemm2(x_h: T.handle, w1_h: T.handle, w2_h: T.handle, y1_h: T.handle, y2_h: T.handle, s_h: T.handle):
            T.func_attr(_attrs("dense_gemm2"))
            M = T.int64()
            x = T.match_buffer(x_h, (M, K), spec.x_dtype)
            w1 = T.match_buffer(w1_h, (N1, K), wdt)
            w2 = T.match_buffer(w2_h, (N2, K), wdt)
            y1 = T.match_buffer(y1_h, (M, N1), odt)
            y2 = T.match_buffer(y2_h, (M, N2), odt)
            sums = T.match_buffer(s_h, (M, KSP, N), "float32")
            body(x, sums, w1, y1, w2, y2, w1, y1)
        f = dense_gemm2
    else:
        @T.prim_func(s_tir=True)
        def dense_gemm3(x_h: T.handle, w1_h: T.handle, w2_h: T.handle, w3_h: T.handle, y1_h: T.handle, y2_h: T.handle,
                        y3_h: T.handle, s_h: T.handle):
            T.func_attr(_attrs("dense_gemm3"))
            M = T.int64()
            x = T.match_buffer(x_h, (M, K), spec.x_dtype)
            w1 = T.match_buffer(w1_h, (N1, K), wdt)
            w2 = T.match_buffer(w2_h, (N2, K), wdt)
            w3 = T.match_buffer(w3_h, (N3, K), wdt)
            y1 = T.match_buffer(y1_h, (M, N1), odt)
            y2 = T.match_buffer(y2_h, (M, N2), odt)
            y3 = T.match_buffer(y3_h, (M, N3), odt)
            sums = T.match_buffer(s_h, (M, KSP, N), "float32")
            body(x, sums, w1, y1, w2, y2, w3, y3)
        f = dense_gemm3
    return _signature(f, KSP)


def _signature(f, k_splits: int):
    """``f`` as callers see it: without its last parameter (the splits' sums) when there is one split."""
    if k_splits > 1:
        return f
    from tvm import tirx

    return tirx.PrimFunc(list(f.params[:-1]), f.body, f.ret_type, f.attrs)


def _split_sum(outs: tuple[int, ...], odt: str, k_splits: int):
    """The k splits' second kernel (CUDA), as a TIR macro ``sum_out(sums, y1, y2, y3)``: thread i of the grid takes
    the 4 columns from 4 (i % (N / 4)) of row i // (N / 4) (N = sum(outs); the outputs' widths are multiples of 16,
    so a thread's columns lie in one output), adds ``sums[row, 0..KS-1]`` there in split order (16-byte loads) and stores
    them, rounded to the outputs' dtype, into that output."""
    P, NTOT, KSP = len(outs), sum(outs), k_splits
    N1, N2 = (outs + (16, 16))[:2]
    Q = NTOT // 4  # threads a row

    @T.macro
    def put(y, row, col, acc4):
        for v in T.unroll(4):
            y[row, col + v] = T.Cast(odt, acc4[v])

    @T.macro
    def sum_out(sums, y1, y2, y3):
        for bx in T.thread_binding((sums.shape[0] * Q + SPLIT_THREADS - 1) // SPLIT_THREADS, thread="blockIdx.x"):
            for tx in T.thread_binding(SPLIT_THREADS, thread="threadIdx.x"):
                with T.sblock("split_sum"):
                    T.reads()
                    T.writes()
                    acc4 = T.sblock_alloc_buffer((4,), "float32", scope="local")
                    i: T.let[T.int64] = bx * SPLIT_THREADS + T.Cast("int64", tx)
                    row: T.let[T.int64] = i // Q
                    col: T.let[T.int64] = i % Q * 4
                    if row < sums.shape[0]:
                        for v in T.vectorized(4):
                            acc4[v] = sums[row, 0, col + v]
                        for s in T.unroll(KSP - 1):
                            for v in T.vectorized(4):
                                acc4[v] = acc4[v] + sums[row, s + 1, col + v]
                        if P == 1:
                            put(y1, row, col, acc4)
                        elif P == 2:
                            if col < N1:
                                put(y1, row, col, acc4)
                            else:
                                put(y2, row, col - N1, acc4)
                        else:
                            if col < N1:
                                put(y1, row, col, acc4)
                            elif col < N1 + N2:
                                put(y2, row, col - N1, acc4)
                            else:
                                put(y3, row, col - N1 - N2, acc4)

    return sum_out


def _dense_llvm(spec: DenseSpec, outs: tuple[int, ...]):
    """The serial form (CPU builds and CI) of ``dense_gemm`` / ``dense_gemm2`` / ``dense_gemm3``: each output a loop
    over (token, feature) with its float32 sum over k; with k splits, each split's sum into ``sums`` and their sum in
    split order, as the CUDA form adds them."""
    K, odt, KSP, P = spec.in_features, spec.out_dtype, spec.k_splits, len(outs)
    KS = K // KSP
    N1, N2, N3 = (outs + (16, 16))[:3]

    @T.macro
    def one(x, w, y, n_out, sums, col):
        for m in T.serial(x.shape[0]):
            for n in T.serial(n_out):
                with T.sblock("dense"):
                    T.reads()
                    T.writes()
                    acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    if KSP == 1:
                        acc[0] = T.float32(0)
                        for k in T.serial(K):
                            acc[0] = acc[0] + T.Cast("float32", x[m, k]) * T.Cast("float32", w[n, k])
                        y[m, n] = T.Cast(odt, acc[0])
                    else:
                        for s in T.serial(KSP):
                            acc[0] = T.float32(0)
                            for k in T.serial(KS):
                                acc[0] = acc[0] + T.Cast("float32", x[m, s * KS + k]) * T.Cast("float32", w[n, s * KS + k])
                            sums[m, s, col + n] = acc[0]
                        acc[0] = sums[m, 0, col + n]
                        for s in T.serial(KSP - 1):
                            acc[0] = acc[0] + sums[m, s + 1, col + n]
                        y[m, n] = T.Cast(odt, acc[0])

    @T.macro
    def body(x, sums, w1, y1, w2, y2, w3, y3):
        one(x, w1, y1, N1, sums, 0)
        if P > 1:
            one(x, w2, y2, N2, sums, N1)
        if P > 2:
            one(x, w3, y3, N3, sums, N1 + N2)

    return _wrap(spec, outs, body)


def reference(x, w, out_dtype="float32"):
    """NumPy: float32 products and sums of the 16-bit inputs, stored in ``out_dtype``."""
    import numpy as np

    return (np.asarray(x, np.float32) @ np.asarray(w, np.float32).T).astype(out_dtype)


__all__ = ["DenseSpec", "eligible", "launch_config", "make_dense", "make_dense_tiled", "reference", "tiled_eligible"]


# A block-tiled form for prefill-sized token counts: a block of 8 warps computes 128 tokens x 128 output features, its
# operands staged through shared memory by cp.async ``tile_k`` k at a time in a ring of ``stages``
# (``grouped_experts._tile_mainloop``, the expert GEMMs' tiled forms' loop), so each weight element read into shared memory serves 128 tokens and each token
# element 128 features (the per-warp form streams a weight row per warp, 64 tokens a pass). Warp (wm, wn) of the
# 2 x 4 grid owns tokens 64 wm .. + 63 and features 32 wn .. + 31: 4 x 4 m16n8 tiles, 32 mma a k-step, fragments by
# ldmatrix (the weight's rows, k contiguous as stored, are the B operand). Tokens past M copy row M - 1, never stored.


def tiled_eligible(out_features: int, in_features: int, dtype: str, tile_k: int = TILE_K) -> str | None:
    """Why the block-tiled form (k ``tile_k`` a stage) cannot take this layer, or None."""
    if dtype not in _MMA_TYPE:
        return f"operand dtype {dtype} is not bfloat16 or float16"
    if out_features % TILE_ROWS or in_features % tile_k:
        return f"features {out_features} x {in_features} are not multiples of {TILE_ROWS} x {tile_k}"
    return None


def make_dense_tiled(out_features: int, in_features: int, dtype: str = "bfloat16", out_dtype: str = "float32",
                     tile_k: int = TILE_K, stages: int = TILE_STAGES):
    """``dense_gemm_tiled(x [M, K], w [N, K], y [M, N])`` on CUDA: the block-tiled form above (M dynamic), k
    ``tile_k`` a cp.async stage in a ring of ``stages`` (in dynamic shared memory past 48 KB)."""
    check_tile(tile_k, stages, "dense_gemm (tiled)")
    why = tiled_eligible(out_features, in_features, dtype, tile_k)
    if why is not None:
        raise MoecError(f"dense_gemm (tiled): {why}")
    if out_dtype not in DTYPES:
        raise MoecError(f"dense_gemm (tiled): out_dtype must be one of {', '.join(DTYPES)}, got {out_dtype!r}")
    N, K = out_features, in_features
    SC = tile_scope(tile_k, stages)
    tiles = _tile_mainloop(dtype, K // tile_k, lambda wn, ni: wn * 32 + ni * 8, tile_k, stages)

    @T.prim_func(s_tir=True)
    def dense_gemm_tiled(x_h: T.handle, w_h: T.handle, y_h: T.handle):
        T.func_attr(_attrs("dense_gemm_tiled"))
        M = T.int64()
        x = T.match_buffer(x_h, (M, K), dtype)
        w = T.match_buffer(w_h, (N, K), dtype)
        y = T.match_buffer(y_h, (M, N), out_dtype)
        for bm in T.thread_binding((M + TILE_TOKENS - 1) // TILE_TOKENS, thread="blockIdx.x"):
            for bn in T.thread_binding(N // TILE_ROWS, thread="blockIdx.y"):
                for tx in T.thread_binding(256, thread="threadIdx.x"):
                    with T.sblock("dense_tiled"):
                        T.reads()
                        T.writes()
                        xs = T.sblock_alloc_buffer((tile_buffer(tile_k, stages),), dtype, scope=SC)  # token, then weight stages
                        af = T.sblock_alloc_buffer((32,), dtype, scope="local")  # [mi][8]: one k16's A fragments
                        bf = T.sblock_alloc_buffer((32,), dtype, scope="local")  # [ni][k16 0, 1][4]
                        acc = T.sblock_alloc_buffer((64,), "float32", scope="local")  # [mi][ni][4]
                        m0: T.let[T.int32] = T.Cast("int32", bm) * TILE_TOKENS
                        n0: T.let[T.int32] = bn * TILE_ROWS
                        mi32: T.let[T.int32] = T.Cast("int32", M)
                        ln: T.let[T.int32] = tx % 32
                        tiles(xs, xs, af, bf, acc, tx, lambda j, k: x[T.min(m0 + tile_copy_row(j, tx, tile_k), mi32 - 1), k],
                              lambda r, k: w[n0 + r, k])
                        for mi in T.unroll(4):
                            for ni in T.unroll(4):
                                for c in T.unroll(4):  # c: token row g + 8 (c // 2), feature 2 q + c % 2 of the tile
                                    if m0 + (tx // 128) * 64 + mi * 16 + ln // 4 + 8 * (c // 2) < mi32:
                                        y[m0 + (tx // 128) * 64 + mi * 16 + ln // 4 + 8 * (c // 2), n0 + ((tx // 32) % 4) * 32 + ni * 8
                                          + 2 * (ln % 4) + c % 2] = T.Cast(out_dtype, acc[(mi * 4 + ni) * 4 + c])

    return dense_gemm_tiled
