"""InsertTieredKVAttention: decode-ready entry points over the tiered (FP8 + 2-bit) KV cache.

Expects what ``InsertPagedKVAttention`` expects (``main(input_ids[B,S], [attention_mask], *weights)``
whose MoE structure ``compiler.moe_structure.analyze`` recognises) and replaces it with:

  * ``prefill(input_ids[1,N], logit_pos[b], <cache arguments>, *weights) -> (logits[1,b,V], *pools)``
  * ``decode(input_ids[1,N], <cache arguments>, *weights) -> (logits[1,N,V], *pools)``
  * ``rerank(t1_table[B,M1], t1_len[B], length[B], demote[B], new_t2[B,MN], *pools) -> pools``
    (mode "tiered" only)

with ``<cache arguments>`` = ``q_pos[N], slots[N], q_row[N], q_t1[N], q_indptr[B+1], t1_table[B,M1],
t2_table[B,M2], t2_np[B], *pools``: the N tokens of a forward (ragged over B sequences, ``q_row``
giving each token's table row) with their absolute positions and tier-1 slots, the page tables of
the B sequences and the 13 pool tensors of ``moec.runtime.kv_cache.POOLS`` (leading layer axis),
which the entries update in place (and return, so that no update is dead code). The runtime
(``moec.runtime.engine``) owns pools and tables.

Each recognised attention ``softmax(Q K^T * s + mask) V`` of layer l becomes:
  1. ``tiered_append``: the new K and V are quantized to FP8 into their tier-1 slots of layer l;
  2. prefill: ``tiered_attention``: each query attends over its sequence's tier-2 pages and its
     visible tier-1 prefix ``q_t1`` (new tokens go to the end of tier 1 in order, so the prefix is the
     causal mask), then ``tiered_mass``: the tier-1 tokens' attention probabilities (column sums over
     the queries and the query heads of each KV head) are added to the importance ``t1_mass``;
     decode (one token per row, rows = tokens, ``q_t1`` = each row's tier-1 length): the split
     decode kernel ``tiered_decode``, which does both.
Every rotary position source becomes ``q_pos``. ``rerank`` runs ``tiered_rerank`` on every layer.
Mode "fp8" is the same cache with a 100% tier-1 budget and no ``rerank`` (the comparison point).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import tvm
from tvm import relax, tirx

from ..compiler.errors import MoecError
from ..compiler.graph import DataflowGraph, dtype_of
from ..compiler.moe_structure import MoEStructure, analyze
from ..runtime.kv_cache import POOLS, pool_specs
from .paged_kv_attention import EntryRewriter, _bind_batch_to_one, entry_inputs, keep_helpers
from .logit_positions import logits_at_positions
from .simplify_layout import EXACT_IN  # (the round trips it cancels)

CACHE_ARGS = ("q_pos", "slots", "q_row", "q_t1", "q_indptr", "t1_table", "t2_table", "t2_np")
RERANK_ARGS = ("t1_table", "t1_len", "length", "demote", "new_t2")


@dataclass(frozen=True)
class TieredOptions:
    """Compile-time parameters of the tiered cache (stored in the artifact's manifest)."""

    mode: str = "tiered"  # "tiered" or "fp8"
    t1_page: int = 16
    t2_page: int = 128
    sink: int = 4
    recent: int = 64
    tier1_fraction: float = 0.15
    rerank_every: int = 16
    importance: str = "mass"  # "mass": attention received over the uniform share; "keynorm": |k|; "random": baseline
    # "split": tiered_decode (flash-decoding splits) in the CUDA form measured faster for the model's heads (tensor
    # cores from 4 query heads per KV head, paired with one, else half2: ``schedules.kernels.tiered_decode.decode_form``);
    # "split-half2": the 2-bit codes summed in float16 pairs; "split-fields": in float32 (the form before 449cc97);
    # "split-mma": both tiers on tensor cores (mma.sync, head_dim 128); "split-paired": the half2 form with tier 1 in
    # float16 pairs too and, with one query head per KV head, one reduce-scatter of a tile's scores; on llvm all five
    # are one kernel; "ragged": the
    # prefill kernels
    decode_kernel: str = "split"
    t2_fit: str = "lloyd"  # 2-bit statistics at a demotion: "lloyd" (least-squares refit) or "moments" (mean, std)
    # CUDA prefill attention and importance sums: "tensor-cores" (mma.sync with the model's 16-bit dtype as operands),
    # "tiled" (float32 dot products), "auto" (tensor cores for bfloat16 / float16 models, else tiled)
    prefill_kernel: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in ("tiered", "fp8"):
            raise MoecError(f"unknown tiered KV mode {self.mode!r}: expected 'tiered' or 'fp8'")
        if not 0 <= self.tier1_fraction <= 1:
            raise MoecError("tier-1 fraction must be in [0, 1]")
        from ..schedules.kernels.tiered_decode import DECODE_KERNELS

        if self.decode_kernel not in (*DECODE_KERNELS, "ragged"):
            raise MoecError(f"unknown decode kernel {self.decode_kernel!r}: expected {', '.join(DECODE_KERNELS)} or ragged")
        if self.prefill_kernel not in ("auto", "tensor-cores", "tiled"):
            raise MoecError(f"unknown prefill kernel {self.prefill_kernel!r}: expected auto, tensor-cores or tiled")
        if self.t2_fit not in ("lloyd", "moments"):
            raise MoecError(f"unknown 2-bit fit {self.t2_fit!r}: expected lloyd or moments")
        if self.importance not in ("mass", "keynorm", "random"):
            raise MoecError(f"unknown importance {self.importance!r}: expected mass, keynorm or random")
        if self.rerank_every < 1 or self.t1_page < 1 or self.t2_page < 1 or self.sink < 0 or self.recent < 0:
            raise MoecError("tiered KV cache: pages and re-rank interval must be positive, sink and recent window >= 0")

    def to_dict(self) -> dict:
        return asdict(self)


def _i32(x: int):
    return relax.prim_value(tirx.IntImm("int32", int(x)))


def _uninitialized(shape, dtype: str) -> relax.Expr:
    """A tensor allocated without a fill, for a buffer the kernel writes in full before anything reads it (the decode
    output and its workspaces: their zero fills were four kernels and 14 us a step at 128 x 4096 on an H100)."""
    return relax.op.builtin.alloc_tensor(relax.ShapeExpr(shape), dtype, 0)


def check_supported(structure: MoEStructure, opts: TieredOptions) -> tuple[int, int, int]:
    """``(heads, kv heads, head dim)`` if the tiered cache can serve this model, else a ``MoecError``."""
    heads = {(la.attention.num_heads, la.attention.num_kv_heads, la.attention.head_dim) for la in structure.layers}
    if len(heads) != 1:
        raise MoecError(f"layers differ in attention heads {sorted(heads)}: one KV cache shape per model is supported")
    (h, hkv, d), = heads
    if d % 4:
        raise MoecError(f"tiered KV cache needs a head dimension divisible by 4 (2-bit packing), got {d}")
    if opts.mode == "tiered" and opts.t2_page % d:
        raise MoecError(f"tiered KV cache: the tier-2 page ({opts.t2_page} tokens) must be a multiple of the head dimension ({d})")
    return h, hkv, d


def prefill_mma_dtype(structure: MoEStructure, opts: TieredOptions, kind: str) -> str | None:
    """The operand dtype of the tensor-core prefill kernels, or None for the tiled float32 ones (``opts.prefill_kernel``;
    "tensor-cores" on a model or target they cannot serve is refused)."""
    from ..schedules.kernels.tiered_attention import mma_supported

    if opts.prefill_kernel == "tiled":
        return None
    h, hkv, d = check_supported(structure, opts)
    why = "the target is not CUDA" if kind != "cuda" else mma_supported(h, hkv, d, structure.dtype)
    if why is None:
        return structure.dtype
    if opts.prefill_kernel == "tensor-cores":
        raise MoecError(f"tiered KV cache: --prefill-kernel tensor-cores cannot serve this model: {why}")
    return None


DECODE_FORMS = {"half2": "split, 2-bit sums in float16 pairs", "fields": "split, 2-bit sums in float32",
                "mma": "split, both tiers on tensor cores (mma.sync over float16)",
                "paired": "split, both tiers' sums in float16 pairs"}


def decode_form(structure: MoEStructure, opts: TieredOptions, kind: str) -> tuple[str, str | None]:
    """(the decode attention's form for the manifest, the CUDA kernel form or None) for ``opts.decode_kernel`` on
    ``kind`` ("cuda" or "llvm"); "split-mma" on heads the tensor-core form cannot take is refused, naming the reason."""
    from ..schedules.kernels import tiered_decode as td

    if opts.decode_kernel == "ragged":
        return "the prefill kernels", None
    if kind != "cuda":
        return "split (llvm)", None
    h, hkv, d = check_supported(structure, opts)
    if opts.decode_kernel == "split-mma" and (why := td.t2_mma_unsupported(h, hkv, d, opts.t2_page)) is not None:
        raise MoecError(f"tiered KV cache: --decode-kernel split-mma: the tensor-core tier 2 cannot serve this model: {why}; "
                        "use --decode-kernel split")
    form = td.decode_form(h, hkv, d, opts.t2_page, opts.decode_kernel)
    return DECODE_FORMS[form], form


_LAYOUT_OPS = ("relax.reshape", "relax.permute_dims")


def narrowed_dtype(g: DataflowGraph, var: relax.Var) -> str | None:
    """The 16-bit dtype the float32 ``var`` is cast to before any arithmetic (its one use, through reshapes and
    permutes, an ``astype`` to it), or None."""
    if dtype_of(var) not in EXACT_IN:
        return None
    x = var
    while len(g.users.get(x, [])) == 1:
        x = g.users[x][0]
        if g.op(x) == "relax.astype":
            return dtype_of(x) if dtype_of(x) in EXACT_IN[dtype_of(var)] else None
        if g.op(x) not in _LAYOUT_OPS:
            return None
    return None


def decode_out_dtype(g: DataflowGraph, structure: MoEStructure) -> str:
    """The dtype the decode kernel writes its output in: float32, or the 16-bit dtype every layer's attention output
    is narrowed to anyway (the kernel rounds once, where the cast after it did; ``_heads_out`` widens the result
    back to float32, which SimplifyLayout then cancels against the model's cast)."""
    dts = {narrowed_dtype(g, layer.attention.out) for layer in structure.layers}
    return dts.pop() if len(dts) == 1 and None not in dts else "float32"


class _Kernels:
    """The tiered kernels of one head configuration, added to the module being built."""

    def __init__(self, bb: relax.BlockBuilder, structure: MoEStructure, opts: TieredOptions, target: tvm.target.Target,
                 graph: DataflowGraph) -> None:
        from ..schedules.kernels.tiered_append import make_tiered_append
        from ..schedules.kernels.tiered_attention import make_tiered_attention, make_tiered_mass
        from ..schedules.kernels.tiered_rerank import make_tiered_rerank

        self.h, self.hkv, self.d = check_supported(structure, opts)
        kind = "cuda" if target.kind.name == "cuda" else "llvm"
        h, hkv, d = self.h, self.hkv, self.d
        self.append = bb.add_func(make_tiered_append(hkv, d, opts.t1_page, target=kind), "tiered_append")
        self.mma_dtype = prefill_mma_dtype(structure, opts, kind)
        self.attention = bb.add_func(make_tiered_attention(h, hkv, d, opts.t1_page, opts.t2_page, target=kind,
                                                           mma_dtype=self.mma_dtype), "tiered_attention")
        self.mass = bb.add_func(make_tiered_mass(h, hkv, d, opts.t1_page, target=kind, mma_dtype=self.mma_dtype), "tiered_mass")
        from ..schedules.kernels.tiered_decode import make_tiered_decode, make_tiered_decode_for_models

        form = decode_form(structure, opts, kind)[1]  # (refuses split-mma where it cannot serve)
        self.t2_mma = form == "mma"
        # the decode kernel writes the attention output in the model's dtype (no cast kernel after it)
        self.decode_out_dtype = decode_out_dtype(graph, structure)
        decode = make_tiered_decode_for_models(h, hkv, d, opts.t1_page, opts.t2_page, fields=form == "fields",
                                               t2_mma=self.t2_mma, paired=form == "paired", out_dtype=self.decode_out_dtype) \
            if kind == "cuda" else make_tiered_decode(h, hkv, d, opts.t1_page, opts.t2_page, out_dtype=self.decode_out_dtype)
        self.split_decode = opts.decode_kernel != "ragged"
        if self.split_decode:
            self.decode = bb.add_func(decode, "tiered_decode")
        self.rerank = None
        if opts.mode == "tiered":
            funcs = make_tiered_rerank(hkv, d, opts.t1_page, opts.t2_page, opts.sink, opts.recent, target=kind,
                                       importance=opts.importance, fit=opts.t2_fit)
            self.rerank = [bb.add_func(f, name) for name, f in funcs.items()]  # the launches, in call order


class _Sig:
    """Symbolic sizes and the relax parameter variables of one entry function."""

    def __init__(self, structure: MoEStructure, k: _Kernels, opts: TieredOptions, n) -> None:
        self.n = n
        self.b = tirx.Var("num_rows", "int64")
        self.m1, self.m2 = tirx.Var("t1_width", "int64"), tirx.Var("t2_width", "int64")
        self.p1, self.p2 = tirx.Var("t1_pages", "int64"), tirx.Var("t2_pages", "int64")
        specs = pool_specs(structure.num_layers, self.p1, self.p2, k.hkv, k.d, opts.t1_page, opts.t2_page)
        self.pool_types = {name: relax.TensorType(shape, dt) for name, (shape, dt) in specs.items()}
        i32 = lambda *s: relax.TensorType(s, "int32")  # noqa: E731
        self.cache_types = {"q_pos": i32(n), "slots": i32(n), "q_row": i32(n), "q_t1": i32(n), "q_indptr": i32(self.b + 1),
                            "t1_table": i32(self.b, self.m1), "t2_table": i32(self.b, self.m2), "t2_np": i32(self.b)}
        self.cache = {name: relax.Var(name, ty) for name, ty in self.cache_types.items()}
        self.pools = {name: relax.Var(name, self.pool_types[name]) for name in POOLS}


@relax.expr_functor.mutator
class _TieredRewriter(relax.PyExprMutator, EntryRewriter):
    def __init__(self, mod, structure: MoEStructure, kernels: _Kernels, sig: _Sig, extra_inputs, decode: bool) -> None:
        super().__init__(mod)
        self._init_entry(structure, sig.n, extra_inputs)
        self.decode = decode
        self.split_decode = kernels.split_decode
        self.k, self.sig = kernels, sig
        self.pools = dict(sig.pools)  # current value of each pool (threaded through the in-place calls)
        self._decode_ws = None  # the decode kernel's workspaces, made at the first layer (same shapes in every layer)

    def _positions(self) -> relax.Expr:
        return self.sig.cache["q_pos"]

    def visit_var_binding_(self, binding) -> None:
        if not self._entry_binding(binding):
            super().visit_var_binding_(binding)

    def _attention(self, layer_id: int, a, var) -> relax.Expr:
        sig, k, p = self.sig, self.k, self.pools
        c = sig.cache
        q = self._heads(a.q, a.q_layout, a.num_heads, a.head_dim, "float32")
        kk = self._heads(a.k, a.k_layout, a.num_kv_heads, a.head_dim, "float32")
        vv = self._heads(a.v, a.v_layout, a.num_kv_heads, a.head_dim, "float32")
        t1 = ("t1_k", "t1_v", "t1_ks", "t1_vs", "t1_pos", "t1_mass")
        appended = self._emit(relax.call_tir_inplace(
            k.append, [kk, vv, c["slots"], c["q_pos"]] + [p[x] for x in t1] + [_i32(layer_id)],
            inplace_indices=list(range(4, 10)), out_ty=[sig.pool_types[x] for x in t1]))
        for i, x in enumerate(t1):
            p[x] = self._emit(relax.TupleGetItem(appended, i))
        n, h, d = sig.n, a.num_heads, a.head_dim
        scale = relax.prim_value(tirx.FloatImm("float32", float(a.sm_scale)))
        if self.decode and self.split_decode:
            out0 = self._emit(_uninitialized([n, h, d], k.decode_out_dtype))  # (every element written)
            out = self._decode_attention(layer_id, q, out0, scale, n, h, d)
        else:
            out0 = self._emit(relax.op.zeros(relax.ShapeExpr([n, h, d]), "float32"))
            out = self._prefill_attention(layer_id, q, out0, scale, n, h, d)
        return self._heads_out(out, var)

    def _decode_attention(self, layer_id, q, out0, scale, n, h, d):
        """One token per row (``q_t1`` is each row's tier-1 length): ``tiered_decode``, which also
        accumulates the importance."""
        sig, k, p, c = self.sig, self.k, self.pools, self.sig.cache
        ps1 = sig.pool_types["t1_k"].shape[3]
        from ..schedules.kernels.tiered_decode import split_count

        splits = split_count(n * k.hkv, k.h // k.hkv, k.t2_mma, vmax=tirx.max, vmin=tirx.min)  # as decode_splits
        if self._decode_ws is None:  # scratch the kernel writes before it reads (no fill): one set serves every layer
            self._decode_ws = [self._emit(_uninitialized(shape, "float32"))
                               for shape in ([n, h, sig.m1 * ps1], [n, h, splits, d], [n, h, splits, 2])]
        ws = self._decode_ws
        pools_read = [p[x] for x in ("t1_k", "t1_v", "t1_ks", "t1_vs", "t2_k", "t2_v", "t2_kmu", "t2_ksig", "t2_vmu", "t2_vsig")]
        res = self._emit(relax.call_tir_inplace(
            k.decode, [q] + pools_read + [c["t1_table"], c["q_t1"], c["t2_table"], c["t2_np"], out0, p["t1_mass"]] + ws +
            [_i32(layer_id), scale],
            inplace_indices=[15, 16], out_ty=[relax.TensorType((n, h, d), k.decode_out_dtype), sig.pool_types["t1_mass"]]))
        p["t1_mass"] = self._emit(relax.TupleGetItem(res, 1))
        return self._emit(relax.TupleGetItem(res, 0))

    def _prefill_attention(self, layer_id, q, out0, scale, n, h, d):
        sig, k, p, c = self.sig, self.k, self.pools, self.sig.cache
        stats0 = self._emit(relax.op.zeros(relax.ShapeExpr([n, h, 2]), "float32"))
        pools_read = [p[x] for x in ("t1_k", "t1_v", "t1_ks", "t1_vs", "t2_k", "t2_v", "t2_kmu", "t2_ksig", "t2_vmu", "t2_vsig")]
        res = self._emit(relax.call_tir_inplace(
            k.attention, [q] + pools_read + [c["t1_table"], c["t2_table"], c["t2_np"], c["q_row"], c["q_t1"], c["q_indptr"],
                                             out0, stats0, _i32(layer_id), scale],
            inplace_indices=[17, 18], out_ty=[relax.TensorType((n, h, d), "float32"), relax.TensorType((n, h, 2), "float32")]))
        out = self._emit(relax.TupleGetItem(res, 0))
        stats = self._emit(relax.TupleGetItem(res, 1))
        p["t1_mass"] = self._emit(relax.call_tir_inplace(
            k.mass, [q, p["t1_k"], p["t1_ks"], c["t1_table"], c["q_t1"], c["q_indptr"], stats, p["t1_mass"], _i32(layer_id), scale],
            inplace_indices=[7], out_ty=sig.pool_types["t1_mass"]))
        return out


def build_entry(func: relax.Function, num_inputs: int, structure: MoEStructure, kernels: _Kernels, opts: TieredOptions,
                with_logit_pos: bool, bb: relax.BlockBuilder) -> None:
    ids, weights, n, extra, fresh = entry_inputs(func, num_inputs)
    sig = _Sig(structure, kernels, opts, n)
    rewriter = _TieredRewriter(tvm.IRModule({"main": func}), structure, kernels, sig, extra, decode=not with_logit_pos)
    body = rewriter.visit_expr(func.body)
    logit_pos = None
    new_params = [fresh[ids]]
    if with_logit_pos:
        logit_pos = relax.Var("logit_pos", relax.TensorType((tirx.Var("num_seq", "int64"),), "int32"))
        new_params.append(logit_pos)
    new_params += list(sig.cache.values()) + list(sig.pools.values()) + [fresh[w] for w in weights]
    fname = "prefill" if with_logit_pos else "decode"
    inner = relax.BlockBuilder()
    with inner.function(fname, new_params, attrs={"num_input": len(new_params) - len(weights)}):
        at = None if logit_pos is None else logits_at_positions(body, logit_pos, n)  # the LM head on those rows only
        result = inner.emit(body if at is None else at)
        if isinstance(result.ty, relax.TupleType):
            result = inner.emit(relax.TupleGetItem(result, 0))
        if logit_pos is not None and at is None:
            result = inner.emit(relax.op.take(result, logit_pos, axis=1))
        # the updated pools (aliases of the arguments) are outputs too, so no in-place update is dead code
        inner.emit_func_output(relax.Tuple([result] + [rewriter.pools[x] for x in POOLS]))
    bb.add_func(relax.utils.copy_with_new_vars(inner.get()[fname]), fname)


def build_rerank(structure: MoEStructure, kernels: _Kernels, opts: TieredOptions, bb: relax.BlockBuilder) -> None:
    sig = _Sig(structure, kernels, opts, tirx.Var("unused", "int64"))
    b, m1, mn = sig.b, sig.m1, tirx.Var("new_width", "int64")
    types = {"t1_table": relax.TensorType((b, m1), "int32"), "t1_len": relax.TensorType((b,), "int32"),
             "length": relax.TensorType((b,), "int32"), "demote": relax.TensorType((b,), "int32"),
             "new_t2": relax.TensorType((b, mn), "int32")}
    args = {name: relax.Var(name, types[name]) for name in RERANK_ARGS}
    pools = dict(sig.pools)
    with bb.function("rerank", list(args.values()) + list(pools.values())):
        cur = list(pools.values())
        from ..schedules.kernels.tiered_rerank import WORKSPACES

        ws = [bb.emit(relax.op.zeros(relax.ShapeExpr([b, kernels.hkv, f * m1 * opts.t1_page]), dt))
              for _, f, dt in WORKSPACES]  # score, rank, order, posw (tiered_rerank_*)
        for layer in range(structure.num_layers):
            for kernel in kernels.rerank:
                res = bb.emit(relax.call_tir_inplace(
                    kernel, cur + [args[x] for x in RERANK_ARGS] + ws + [_i32(layer)],
                    inplace_indices=list(range(len(POOLS))), out_ty=[sig.pool_types[x] for x in POOLS]))
                cur = [bb.emit(relax.TupleGetItem(res, i)) for i in range(len(POOLS))]
        bb.emit_func_output(relax.Tuple(cur))


@tvm.transform.module_pass(opt_level=0, name="InsertTieredKVAttention")
class InsertTieredKVAttention:
    """Replace ``main`` with tiered-KV ``prefill``/``decode`` entries (and ``rerank`` in mode "tiered")."""

    def __init__(self, num_inputs: int, target: tvm.target.Target, options: TieredOptions, source: str = "model") -> None:
        self.num_inputs, self.target, self.options, self.source = num_inputs, target, options, source
        self.structure: MoEStructure | None = None

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        func = _bind_batch_to_one(mod["main"], self.num_inputs)
        structure = analyze(func, self.num_inputs, self.source)
        self.structure = structure
        bb = relax.BlockBuilder()
        kernels = _Kernels(bb, structure, self.options, self.target, DataflowGraph(func, self.num_inputs))
        for with_pos in (True, False):
            build_entry(func, self.num_inputs, structure, kernels, self.options, with_pos, bb)
        if self.options.mode == "tiered":
            build_rerank(structure, kernels, self.options, bb)
        return keep_helpers(mod, bb.get())
