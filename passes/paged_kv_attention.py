"""InsertPagedKVAttention: turn a whole-sequence forward into decode-ready entry points.

Expects ``main(input_ids[B,S], [attention_mask[B,S]], *weights) -> logits[B,S,V]`` (a user's
single-forward export) whose MoE structure ``compiler.moe_structure.analyze`` recognises.

Guarantees after: the module holds
  * ``prefill(input_ids[1,N], logit_pos[b], kv_cache, *weights) -> logits[1,b,V]``
  * ``decode(input_ids[1,b], kv_cache, *weights) -> logits[1,b,V]``
  * ``create_kv_cache(max_batch, max_total_len, prefill_chunk, page_size) -> kv_cache``
where the N (resp. b) tokens of a batch of sequences are laid out ragged along axis 1 and the KV cache
object knows each sequence's length (the runtime calls ``begin_forward`` before each entry call).
Each recognised attention ``softmax(Q K^T * s + mask) V`` is replaced by paged attention over the cache
(K and V appended to it), and every rotary position source (``arange(S)``) by the cache's query
positions, so RoPE sees absolute positions. The causal/padding mask computation becomes dead code.
The original ``main`` is removed.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from ..compiler.errors import MoecError
from ..compiler.graph import dtype_of, shape_of
from ..compiler.moe_structure import MoEStructure, analyze
from .logit_positions import logits_at_positions

ATTN_FUNC = "vm.builtin.attention_kv_cache_attention_with_fused_qkv"
POS_FUNC = "vm.builtin.attention_kv_cache_get_query_positions"


class EntryRewriter:
    """What the KV-cache passes share when they rewrite ``main`` into an entry function (a mixin of a
    ``relax.PyExprMutator``): extra inputs replaced on the first binding, Q/K/V in ragged [N, H, Dh]
    form, and dispatch of each recognised attention and position source to ``_attention`` and
    ``_positions``, which the cache's rewriter provides (its ``visit_var_binding_`` calls
    ``_entry_binding``; the mutator base must come first for ``relax.expr_functor.mutator``)."""

    def _init_entry(self, structure: MoEStructure, n_tokens, extra_inputs) -> None:
        self.s = structure
        self.n = n_tokens
        self.extra_inputs = extra_inputs  # original non-token inputs -> replacement builder
        self.attn = {layer.attention.out: (i, layer.attention) for i, layer in enumerate(structure.layers)}
        self.pos = set(structure.position_sources)
        self._prologue_done = False

    def _emit(self, expr):
        return self.builder_.emit(expr)

    def _prologue(self) -> None:
        for var, make in self.extra_inputs.items():
            value = make()
            self.set_var_remap(var, value if isinstance(value, relax.Var) else self._emit(value))
        self._prologue_done = True

    def _heads(self, var, layout: str, heads: int, head_dim: int, dtype: str | None = None):
        x = self.visit_expr(var)
        if layout == "bhsd":
            x = self._emit(relax.op.permute_dims(x, [0, 2, 1, 3]))
        if dtype is not None and dtype_of(x) != dtype:  # before the reshape: fused into the producer's kernel
            x = self._emit(relax.op.astype(x, dtype))    # (RoPE's), where after it the cast is a kernel of its own
        return self._emit(relax.op.reshape(x, [self.n, heads, head_dim]))  # N, H, Dh

    def _heads_out(self, out, var):
        """``out[N, H, Dh]`` back to the shape and dtype of the attention output ``var``."""
        if dtype_of(out) != dtype_of(var):
            out = self._emit(relax.op.astype(out, dtype_of(var)))
        shape = list(shape_of(var))
        if len(shape) == 4:  # [1, H, N, Dh]: as a permute of [1, N, H, Dh], which the model's own transpose back
            # to [1, N, H, Dh] cancels (SimplifyLayout)
            out = self._emit(relax.op.reshape(out, [shape[0], shape[2], shape[1], shape[3]]))
            return self._emit(relax.op.permute_dims(out, [0, 2, 1, 3]))
        out = self._emit(relax.op.permute_dims(out, [1, 0, 2]))  # H, N, Dh (heads-first like P @ V)
        return self._emit(relax.op.reshape(out, shape))

    def _entry_binding(self, binding) -> bool:
        """Rewrite ``binding`` if it is an attention output or a position source (True if it was)."""
        if not self._prologue_done:
            self._prologue()
        var = binding.var
        if var in self.attn:
            layer_id, a = self.attn[var]
            self.set_var_remap(var, self._attention(layer_id, a, var))
            return True
        if var in self.pos:
            pos = self._emit(relax.op.astype(self._positions(), dtype_of(var)))
            self.set_var_remap(var, self._emit(relax.op.reshape(pos, list(shape_of(var)))))
            return True
        return False


@relax.expr_functor.mutator
class _PagedKVAttentionRewriter(relax.PyExprMutator, EntryRewriter):
    def __init__(self, mod, structure: MoEStructure, cache: relax.Var, n_tokens, extra_inputs, kv_dtype: str | None = None) -> None:
        super().__init__(mod)
        self._init_entry(structure, n_tokens, extra_inputs)
        self.kv_dtype = kv_dtype
        self.cache = cache

    def _attention(self, layer_id: int, a, var) -> relax.Expr:
        # q, k and v in the cache's dtype (an export may leave one of them in float32, e.g. after a q/k norm)
        dtype = self.kv_dtype or dtype_of(var)
        q = self._heads(a.q, a.q_layout, a.num_heads, a.head_dim, dtype)
        k = self._heads(a.k, a.k_layout, a.num_kv_heads, a.head_dim, dtype)
        v = self._heads(a.v, a.v_layout, a.num_kv_heads, a.head_dim, dtype)
        qkv = self._emit(relax.op.concat([q, k, v], axis=1))  # N, H + 2 Hkv, Dh
        out = self._emit(
            relax.call_dps_packed(
                ATTN_FUNC,
                [self.cache, relax.prim_value(layer_id), relax.prim_value(float(a.sm_scale)), qkv],
                out_ty=relax.TensorType((self.n, a.num_heads, a.head_dim), dtype),
            )
        )  # N, H, Dh
        return self._heads_out(out, var)

    def _positions(self) -> relax.Expr:
        return self._emit(relax.call_pure_packed(POS_FUNC, self.cache, ty_args=relax.TensorType((self.n,), "int32")))

    def visit_var_binding_(self, binding) -> None:
        if not self._entry_binding(binding):
            super().visit_var_binding_(binding)


def _bind_batch_to_one(func: relax.Function, num_inputs: int) -> relax.Function:
    batch = shape_of(func.params[0])[0]
    if isinstance(batch, tirx.Var):
        func = func.bind_symbolic_vars({batch: 1})
    return func


def entry_inputs(func: relax.Function, num_inputs: int):
    """``(ids, weights, n, extra, fresh)`` of the batch-1 forward ``func``: the token input and the
    weights, the token count N, the replacement of every other input (an attention mask becomes ones:
    every cached token is visible) and the fresh parameter vars each entry function defines."""
    params = list(func.params)
    ids, inputs, weights = params[0], params[1:num_inputs], params[num_inputs:]
    n = shape_of(ids)[1]
    extra = {}
    for inp in inputs:
        shp, dt = shape_of(inp), dtype_of(inp)
        if shp is None or len(shp) != 2:
            raise MoecError(f"unsupported extra model input {inp.name} of shape {shp}: only an attention mask [B,S] is supported")
        extra[inp] = (lambda dt=dt: relax.op.ones(relax.ShapeExpr([1, n]), dt))
    fresh = {p: relax.Var(p.name, p.ty) for p in [ids] + weights}
    for old, new in fresh.items():
        extra[old] = (lambda new=new: new)
    return ids, weights, n, extra, fresh


def build_entry(func: relax.Function, num_inputs: int, structure: MoEStructure, with_logit_pos: bool, kv_dtype: str | None = None) -> relax.Function:
    """One entry function (prefill or decode) from the batch-1 forward ``func``."""
    ids, weights, n, extra, fresh = entry_inputs(func, num_inputs)
    cache = relax.Var("kv_cache", relax.ObjectType())
    rewriter = _PagedKVAttentionRewriter(tvm.IRModule({"main": func}), structure, cache, n, extra, kv_dtype)
    body = rewriter.visit_expr(func.body)
    ids, weights = fresh[ids], [fresh[w] for w in weights]
    new_params = [ids]
    logit_pos = None
    if with_logit_pos:
        b = tirx.Var("num_seq", "int64")
        logit_pos = relax.Var("logit_pos", relax.TensorType((b,), "int32"))
        new_params.append(logit_pos)
    new_params += [cache] + weights
    # the body returns logits (maybe in a 1-tuple); gather the requested positions for prefill
    bb = relax.BlockBuilder()
    fname = "prefill" if with_logit_pos else "decode"
    with bb.function(fname, new_params, attrs={"num_input": len(new_params) - len(weights)}):
        at = None if logit_pos is None else logits_at_positions(body, logit_pos, n)  # the LM head on those rows only
        result = bb.emit(body if at is None else at)
        if isinstance(result.ty, relax.TupleType):
            result = bb.emit(relax.TupleGetItem(result, 0))
        if logit_pos is not None and at is None:
            result = bb.emit(relax.op.take(result, logit_pos, axis=1))
        bb.emit_func_output(result)
    # entries share untouched bindings with ``func``; give each its own variables
    return relax.utils.copy_with_new_vars(bb.get()[fname])


def build_create_kv_cache(structure: MoEStructure, dtype: str, target: tvm.target.Target) -> relax.Function:
    from tvm.relax.frontend.nn.llm.kv_cache import RopeMode, TIRPagedKVCache

    heads = {(layer.attention.num_heads, layer.attention.num_kv_heads, layer.attention.head_dim) for layer in structure.layers}
    if len(heads) != 1:
        raise ValueError(f"layers differ in attention heads {sorted(heads)}: one KV cache shape per model is supported")
    (h, hkv, hd), = heads
    names = ["max_batch_size", "max_total_seq_len", "prefill_chunk_size", "page_size"]
    tvars = [tirx.Var(nm, "int64") for nm in names]
    params = [relax.Var(nm + "_", relax.ShapeType([v])) for nm, v in zip(names, tvars)]
    bb = relax.BlockBuilder()
    with bb.function("create_kv_cache", params):
        cache = TIRPagedKVCache(
            attn_kind="mha", max_batch_size=tvars[0], max_total_seq_len=tvars[1], prefill_chunk_size=tvars[2],
            page_size=tvars[3], support_sliding_window=0, layer_partition=relax.ShapeExpr([0, structure.num_layers]),
            num_hidden_layers=structure.num_layers, num_attention_heads=h, num_key_value_heads=hkv, qk_head_dim=hd,
            v_head_dim=hd, mla_original_qk_head_dim=0, mla_original_v_head_dim=0, rope_mode=RopeMode.NONE,
            rope_scale=1, rope_theta=10000, rope_scaling={}, rope_ext_factors=relax.prim_value(0), rotary_dim=hd,
            enable_disaggregation=False, dtype=dtype, target=target,
        )
        bb.emit_func_output(cache._expr)
    return bb.get()


@tvm.transform.module_pass(opt_level=0, name="InsertPagedKVAttention")
class InsertPagedKVAttention:
    """Replace ``main`` with paged-KV ``prefill``/``decode`` entries and ``create_kv_cache``."""

    def __init__(self, num_inputs: int, target: tvm.target.Target, source: str = "model", kv_dtype: str | None = None) -> None:
        self.num_inputs = num_inputs
        self.kv_dtype = kv_dtype
        self.target = target
        self.source = source
        self.structure: MoEStructure | None = None

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        func = _bind_batch_to_one(mod["main"], self.num_inputs)
        structure = analyze(func, self.num_inputs, self.source)
        self.structure = structure
        kv_dtype = self.kv_dtype or structure.dtype
        out = build_create_kv_cache(structure, kv_dtype, self.target)  # keeps its kernels' GlobalVars
        for with_pos in (True, False):
            out["prefill" if with_pos else "decode"] = build_entry(func, self.num_inputs, structure, with_pos, kv_dtype)
        return keep_helpers(mod, out)


def keep_helpers(mod: tvm.IRModule, out: tvm.IRModule) -> tvm.IRModule:
    """``out`` with the imported module's other functions (TIR the frontend emitted, e.g. the ONNX importer's
    ``maximum`` for a clamp), which the entries built from ``main`` still call."""
    for gv, f in mod.functions_items():
        if gv.name_hint != "main" and gv.name_hint not in [g.name_hint for g in out.get_global_vars()]:
            out[gv] = f
    return out
