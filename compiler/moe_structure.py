"""MoE-structure analysis of an imported Relax forward graph.

Recognises by structure (op patterns and tensor shapes, never parameter names), per decoder layer:
the attention (Q/K/V tensors, heads, head dim, softmax scale), the RMSNorms, the router (scoring
function, top-k, renormalisation, group-limited routing), the routed experts' stacked weights and the
shared experts. Also the token embedding, the rotary-position source and the LM head.

Assumptions, each checked with a clear error when violated: causal self-attention as
``softmax(Q @ K^T * scale + mask) @ V`` with the head dim last; a router as a linear layer
followed by top-k over its scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax

from .errors import UnsupportedModel
from .graph import LAYOUT_OPS, DataflowGraph, const_scalar, dtype_of, is_static, same_dim, shape_of


@dataclass
class NormInfo:
    weight: str
    eps: float
    role: str = ""  # attention | mlp | qk | final
    out_var: relax.Var | None = field(default=None, repr=False, compare=False)

    def to_dict(self):
        return {"weight": self.weight, "eps": self.eps, "role": self.role}


@dataclass
class AttentionInfo:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sm_scale: float
    projections: list[str]
    qk_norm: bool = False
    # graph anchors used by the rewriting passes (not serialised)
    q: relax.Var | None = field(default=None, repr=False, compare=False)
    k: relax.Var | None = field(default=None, repr=False, compare=False)
    v: relax.Var | None = field(default=None, repr=False, compare=False)
    q_layout: str = "bhsd"
    k_layout: str = "bhsd"
    v_layout: str = "bhsd"
    out: relax.Var | None = field(default=None, repr=False, compare=False)
    softmax: relax.Var | None = field(default=None, repr=False, compare=False)
    masks: list = field(default_factory=list, repr=False, compare=False)  # what the scores add (masks, biases)
    sliding_window: int | None = None  # keys a query sees (compiler.attention_mask.find_windows); None: causal

    def to_dict(self):
        return {
            "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "sm_scale": self.sm_scale, "projections": self.projections, "qk_norm": self.qk_norm,
            "sliding_window": self.sliding_window,
        }


@dataclass
class RouterInfo:
    weight: str
    num_experts: int
    top_k: int
    score: str  # softmax | sigmoid | none
    renormalize: bool
    n_group: int = 1
    topk_group: int = 1
    group_score: str | None = None  # group-limited: max | top2_sum | sum | other (how a group's score is formed)
    bias: str | None = None  # weight added to the scores before choosing (DeepSeek-V3 e_score_correction_bias)
    topk_var: relax.Var | None = field(default=None, repr=False, compare=False)
    linear_var: relax.Var | None = field(default=None, repr=False, compare=False)
    group_topk_var: relax.Var | None = field(default=None, repr=False, compare=False)  # top-k over the [T, G] group scores

    def to_dict(self):
        return {
            "weight": self.weight, "num_experts": self.num_experts, "top_k": self.top_k, "score": self.score,
            "renormalize": self.renormalize, "n_group": self.n_group, "topk_group": self.topk_group,
            "group_score": self.group_score, "bias": self.bias,
        }


@dataclass
class LayerInfo:
    index: int
    attention: AttentionInfo
    norms: list[NormInfo] = field(default_factory=list)
    router: RouterInfo | None = None
    experts: dict[str, list[int]] = field(default_factory=dict)  # weight name -> shape
    shared_experts: dict[str, list[int]] = field(default_factory=dict)
    shared_expert_gate: str | None = None
    dense_mlp: dict[str, list[int]] = field(default_factory=dict)

    def to_dict(self):
        return {
            "index": self.index, "attention": self.attention.to_dict(), "norms": [n.to_dict() for n in self.norms],
            "router": self.router.to_dict() if self.router else None, "experts": self.experts,
            "shared_experts": self.shared_experts, "shared_expert_gate": self.shared_expert_gate,
            "dense_mlp": self.dense_mlp,
        }


@dataclass
class MoEStructure:
    layers: list[LayerInfo]
    vocab_size: int
    hidden_size: int
    dtype: str
    embedding: str
    lm_head: str | None
    final_norm: NormInfo | None
    token_input: relax.Var = field(repr=False, compare=False)
    seq_dim: object = field(repr=False, compare=False)
    batch_dim: object = field(repr=False, compare=False)
    position_sources: list[relax.Var] = field(default_factory=list, repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def moe_layers(self) -> list[LayerInfo]:
        return [layer for layer in self.layers if layer.router is not None]

    @property
    def max_context(self) -> int | None:
        """Tokens a sequence may hold: the smallest sliding window of its layers (past it the paged attention,
        which attends over whole sequences, would differ from the model); None without sliding windows."""
        return min((a.sliding_window for a in (layer.attention for layer in self.layers) if a.sliding_window), default=None)

    def find_windows(self, func: relax.Function, num_inputs: int, source: str = "model") -> "MoEStructure":
        """Each attention's sliding window from its mask (``compiler.attention_mask``; refuses masks that are
        neither causal nor sliding windows); returns self."""
        from .attention_mask import find_windows

        find_windows(func, num_inputs, [layer.attention for layer in self.layers], source)
        return self

    def to_dict(self):
        return {
            "num_layers": self.num_layers, "num_moe_layers": len(self.moe_layers), "vocab_size": self.vocab_size,
            "max_context": self.max_context,
            "hidden_size": self.hidden_size, "dtype": self.dtype, "embedding": self.embedding, "lm_head": self.lm_head,
            "final_norm": self.final_norm.to_dict() if self.final_norm else None,
            "layers": [layer.to_dict() for layer in self.layers],
        }

    def table(self) -> str:
        head = f"{'layer':>5}  {'attention (H/Hkv x Dh, scale)':<30} {'norms':<22} {'router':<46} {'experts':<24} shared"
        rows = [head, "-" * len(head)]
        for layer in self.layers:
            a = layer.attention
            attn = f"{a.num_heads}/{a.num_kv_heads} x {a.head_dim}, {a.sm_scale:.4g}" + (" qk-norm" if a.qk_norm else "") + (
                f" window {a.sliding_window}" if a.sliding_window else "")
            norms = ",".join(n.role for n in layer.norms)
            if layer.router:
                r = layer.router
                router = f"{r.score} top-{r.top_k}/{r.num_experts}" + (" renorm" if r.renormalize else "")
                if r.n_group > 1:
                    router += f" groups {r.topk_group}/{r.n_group}" + (f" {r.group_score}" if r.group_score != "max" else "")
                if r.bias:
                    router += " +bias"
                experts = " ".join("x".join(map(str, s)) for s in layer.experts.values())
            else:
                router, experts = "(dense mlp)", " ".join("x".join(map(str, s)) for s in layer.dense_mlp.values())
            shared = " ".join("x".join(map(str, s)) for s in layer.shared_experts.values()) or "-"
            if layer.shared_expert_gate:
                shared += " +gate"
            rows.append(f"{layer.index:>5}  {attn:<30} {norms:<22} {router:<46} {experts:<24} {shared}")
        rows.append(f"embedding {self.embedding} ({self.vocab_size} x {self.hidden_size}), lm_head {self.lm_head}, dtype {self.dtype}")
        return "\n".join(rows)


class _Analyzer:
    def __init__(self, func: relax.Function, num_inputs: int, source: str) -> None:
        self.g = DataflowGraph(func, num_inputs)
        self.source = source

    def fail(self, msg: str):
        raise UnsupportedModel(f"{self.source}: {msg}")

    # ------------------------------------------------------------ primitives
    def linear_weight(self, var) -> relax.Var | None:
        """If ``var`` is matmul(x, W) (W a 2-D weight, maybe transposed), return W."""
        if self.g.op(var) != "relax.matmul":
            return None
        w = self.g.weight_of(self.g.value[var].args[1])
        if w is not None and len(shape_of(w) or ()) == 2:
            return w
        return None

    def walk_scaled(self, expr):
        """Walk back through layout ops and scalar multiplies; return [(var, scale_after)]."""
        chain, scale = [], 1.0
        while isinstance(expr, relax.Var):
            chain.append((expr, scale))
            op = self.g.op(expr)
            call = self.g.call(expr)
            if op in LAYOUT_OPS:
                expr = call.args[0]
            elif op in ("relax.multiply", "relax.divide"):
                a, b = call.args
                c = const_scalar(b) if const_scalar(b) is not None else (const_scalar(a) if op == "relax.multiply" else None)
                if c is None:
                    break
                scale *= c if op == "relax.multiply" else 1.0 / c
                expr = a if const_scalar(b) is not None else b
            else:
                break
        return chain

    def head_tensor(self, operand, head_dim: int, seq, what: str, anchor):
        """The furthest-upstream rank-4 [B,H,S,Dh] / [B,S,H,Dh] tensor feeding ``operand`` with fewest heads."""
        best = None
        for var, scale in self.walk_scaled(operand):
            shp = shape_of(var)
            if not shp or len(shp) != 4 or shp[3] != head_dim:
                continue
            if same_dim(shp[2], seq):
                layout, heads = "bhsd", shp[1]
            elif same_dim(shp[1], seq):
                layout, heads = "bshd", shp[2]
            else:
                continue
            if not is_static(heads):
                continue
            if best is None or heads <= best[1]:
                best = (var, heads, layout, scale)
        if best is None:
            self.fail(f"attention at {anchor.name}: cannot find the {what} heads tensor ([B,H,S,Dh] with head dim last)")
        return best

    # ------------------------------------------------------------ components
    def find_norms(self) -> list[NormInfo]:
        norms = []
        g = self.g
        recips = [(v, g.call(v).args[0]) for v in g.calls_of("relax.rsqrt")]
        for v in g.calls_of("relax.sqrt"):
            for u in g.users.get(v, []):
                call = g.call(u)
                if g.op(u) == "relax.divide" and call.args[1].same_as(v) and const_scalar(call.args[0]) == 1.0:
                    recips.append((u, g.call(v).args[0]))
                elif g.op(u) == "relax.divide" and call.args[1].same_as(v):  # x / sqrt(.) is already x * rsqrt
                    for u2 in g.users.get(u, []):
                        w = next((g.weight_of(a) for a in g.call(u2).args if g.weight_of(a) is not None), None) if g.op(u2) == "relax.multiply" else None
                        if w is not None and len(shape_of(w)) == 1:
                            norms.append(NormInfo(weight=w.name, eps=float(self._eps(g.call(v).args[0])), out_var=u2))
        for var, inner in recips:
            # rsqrt(mean(x^2) + eps) -> x * r -> w * (x * r)
            eps = self._eps(inner)
            for u in g.users.get(var, []):
                if g.op(u) != "relax.multiply":
                    continue
                after = list(g.users.get(u, []))  # (half-precision models cast x * r back before the weight)
                after += [c for a in after if g.op(a) == "relax.astype" for c in g.users.get(a, [])]
                for u2 in after:
                    if g.op(u2) == "relax.multiply":
                        w = next((g.weight_of(a) for a in g.call(u2).args if g.weight_of(a) is not None), None)
                        if w is not None and len(shape_of(w)) == 1:
                            norms.append(NormInfo(weight=w.name, eps=float(eps), out_var=u2))
        for var in g.calls_of("relax.nn.rms_norm"):
            call = g.call(var)
            w = g.weight_of(call.args[1])
            if w is not None:
                norms.append(NormInfo(weight=w.name, eps=float(call.attrs.epsilon), out_var=var))
        return sorted(norms, key=lambda n: g.order[n.out_var])

    def _eps(self, inner) -> float:
        g = self.g
        if g.op(inner) == "relax.add":
            a, b = g.call(inner).args
            return const_scalar(b) if const_scalar(b) is not None else (const_scalar(a) or 0.0)
        return 0.0

    def find_attention(self, sm) -> AttentionInfo | None:
        g = self.g
        # softmax input: [layout] [scale] [+ mask] [scale] matmul(A, B)
        x, scale, masks = g.value[sm].args[0], 1.0, []
        while isinstance(x, relax.Var):
            op, call = g.op(x), g.call(x)
            if op in LAYOUT_OPS:
                x = call.args[0]
            elif op in ("relax.multiply", "relax.divide") and const_scalar(call.args[1]) is not None:
                c = const_scalar(call.args[1])
                scale *= c if op == "relax.multiply" else 1.0 / c
                x = call.args[0]
            elif op == "relax.add":
                a, b = call.args
                x, other = (a, b) if self._has_matmul_upstream(a) else (b, a)
                masks.append(other)
            else:
                break
        if g.op(x) != "relax.matmul":
            return None
        qa, kb = g.call(x).args
        if g.weight_of(qa) is not None or g.weight_of(kb) is not None:
            return None  # a router or other linear, not attention
        head_dim = shape_of(qa)[-1]
        # P @ V: the first matmul downstream of softmax that takes it (or a masked copy) as first operand
        out = None
        frontier, seen = [sm], {sm}
        for _ in range(10):
            nxt = []
            for v in frontier:
                for u in g.users.get(v, []):
                    if u in seen:
                        continue
                    seen.add(u)
                    if g.op(u) == "relax.matmul" and g.call(u).args[0] in seen | {v}:
                        out = u if out is None else out
                    nxt.append(u)
            frontier = nxt
            if out is not None:
                break
        if out is None:
            self.fail(f"attention at {sm.name}: softmax output does not reach a matmul with V")
        seq = self.seq
        q, hq, ql, qs = self.head_tensor(qa, head_dim, seq, "query", sm)
        k, hk, kl, ks = self.head_tensor(kb, head_dim, seq, "key", sm) if not self._kt_layout(kb) else (None,) * 4
        if k is None:
            k, hk, kl, ks = self._key_tensor(kb, head_dim, seq, sm)
        v, hv, vl, _ = self.head_tensor(g.call(out).args[1], head_dim, seq, "value", sm)
        if hk != hv or hq % hk:
            self.fail(f"attention at {sm.name}: inconsistent heads (q {hq}, k {hk}, v {hv})")
        return AttentionInfo(
            num_heads=int(hq), num_kv_heads=int(hk), head_dim=int(head_dim), sm_scale=float(scale * qs * ks),
            projections=[], q=q, k=k, v=v, q_layout=ql, k_layout=kl, v_layout=vl, out=out, softmax=sm, masks=masks,
        )

    def _kt_layout(self, kb) -> bool:
        return True  # keys reach the matmul transposed ([.., Dh, S]); handled by _key_tensor

    def _key_tensor(self, kb, head_dim, seq, sm):
        best = None
        for var, scale in self.walk_scaled(kb):
            shp = shape_of(var)
            if not shp or len(shp) != 4:
                continue
            for layout, (hpos, spos, dpos) in {"bhsd": (1, 2, 3), "bshd": (2, 1, 3)}.items():
                if shp[dpos] == head_dim and same_dim(shp[spos], seq) and is_static(shp[hpos]):
                    if best is None or shp[hpos] <= best[1]:
                        best = (var, shp[hpos], layout, scale)
        if best is None:
            self.fail(f"attention at {sm.name}: cannot find the key heads tensor ([B,H,S,Dh] with head dim last)")
        return best

    def _sink_concat(self, sm) -> bool:
        """Whether softmax ``sm``'s input is, up to subtractions and scaling, a concat along the last axis of
        attention scores (a matmul upstream) and something else."""
        g = self.g
        x = g.value[sm].args[0]
        for _ in range(6):
            if not isinstance(x, relax.Var):
                return False
            op, call = g.op(x), g.call(x)
            if op == "relax.concat":
                parts = call.args[0] if isinstance(call.args[0], relax.Tuple) else g.value.get(call.args[0])
                parts = parts.fields if isinstance(parts, relax.Tuple) else []
                return len(parts) > 1 and any(self._has_matmul_upstream(p) for p in parts)
            if op in ("relax.subtract", "relax.add", "relax.multiply", "relax.divide") or op in LAYOUT_OPS:
                x = call.args[0]
            else:
                return False
        return False

    def _has_matmul_upstream(self, expr, depth: int = 6) -> bool:
        g = self.g
        for _ in range(depth):
            if not isinstance(expr, relax.Var) or expr not in g.value:
                return False
            op = g.op(expr)
            if op == "relax.matmul":
                return True
            call = g.call(expr)
            if call is None or not call.args:
                return False
            expr = call.args[0]
        return False

    def find_router(self, tk) -> RouterInfo | None:
        g = self.g
        call = g.call(tk)
        scores_in = call.args[0]
        num_experts = shape_of(scores_in)[-1]
        k = int(call.attrs.k)
        if not is_static(num_experts) or num_experts < 2:
            return None
        # walk ancestors (bounded) for the nearest linear producing E outputs
        anc = sorted(g.ancestors(tk, stop=lambda v: g.op(v) == "relax.matmul"), key=lambda v: -g.order.get(v, -1))
        linear, score, group_topk = None, "none", None
        for v in anc:
            op = g.op(v)
            if op == "relax.matmul":
                w = self.linear_weight(v)
                if w is not None and num_experts in shape_of(w):
                    linear = linear or (v, w)
            elif op == "relax.nn.softmax" and score == "none":
                score = "softmax"
            elif op == "relax.sigmoid" and score == "none":
                score = "sigmoid"
            elif op == "relax.topk" and not v.same_as(tk) and group_topk is None:
                group_topk = v  # the nearest: a DeepSeek-V3 group score takes a top-2 within each group before it
        if linear is None:
            return None
        lin_var, w = linear
        if score == "none":  # softmax may follow top-k (over the selected logits)
            ops = g.descendants_ops(tk, 4)
            score = "softmax_topk" if "relax.nn.softmax" in ops else "none"
        renorm = False
        for v in g.users.get(tk, []):
            if "relax.divide" in g.descendants_ops(v, 4) and "relax.sum" in g.descendants_ops(v, 3):
                renorm = True
        if score == "softmax":
            # scores gathered by the top-k indices and divided by their sum
            for u in g.users.get(tk, []):
                for u2 in g.users.get(u, []):
                    if g.op(u2) in ("relax.gather_elements", "relax.take") and "relax.divide" in g.descendants_ops(u2, 3):
                        renorm = True
        n_group = topk_group = 1
        group_score = None
        if group_topk is not None:
            gshape = shape_of(g.call(group_topk).args[0])
            n_group, topk_group = int(gshape[-1]), int(g.call(group_topk).attrs.k)
            group_score = self._group_score(g.call(group_topk).args[0])
        return RouterInfo(
            weight=w.name, num_experts=int(num_experts), top_k=k, score=score, renormalize=renorm,
            n_group=n_group, topk_group=topk_group, group_score=group_score, bias=self._choice_bias(lin_var, tk, int(num_experts)),
            topk_var=tk, linear_var=lin_var, group_topk_var=group_topk,
        )

    def _group_score(self, expr) -> str:
        """How group scores [T, G] come from the [T, G, n] grouped scores: max, sum of the top 2, or sum."""
        g = self.g
        v = g.strip(expr)
        if g.op(v) == "relax.max":
            return "max"
        if g.op(v) == "relax.sum":
            inner = g.strip(g.call(v).args[0])
            item = g.value.get(inner)
            if isinstance(item, relax.TupleGetItem) and item.index == 0 and g.op(item.tuple_value) == "relax.topk":
                return f"top{int(g.call(item.tuple_value).attrs.k)}_sum"
            return "sum"
        return "other"

    def _choice_bias(self, lin_var, tk, num_experts: int) -> str | None:
        """A 1-D weight of E elements added to the scores on the way from the router matmul to the top-k."""
        g = self.g
        path = g.ancestors(tk, stop=lambda v: v.same_as(lin_var))
        for v in sorted(path, key=lambda v: g.order.get(v, -1)):
            if g.op(v) == "relax.add" and lin_var in g.ancestors(v, stop=lambda u: u.same_as(lin_var)):
                for a in g.call(v).args:
                    w = g.weight_of(a)
                    if w is not None and shape_of(w) == (num_experts,):
                        return w.name
        return None

    def assemble_layers(self, attentions, routers, norms) -> list[LayerInfo]:
        g = self.g
        weight_shapes = {w.name: list(shape_of(w)) for w in g.weights}
        outs = [g.order[a.out] for a in attentions]
        # each layer's attention part starts at its first Q/K/V projection
        starts = []
        for i, a in enumerate(attentions):
            lo = outs[i - 1] if i else -1
            is_mm = lambda v: g.op(v) == "relax.matmul"  # noqa: E731
            anc = g.ancestors(a.q, stop=is_mm) | g.ancestors(a.k, stop=is_mm) | g.ancestors(a.v, stop=is_mm)
            orders = [g.order[v] for v in anc if v in g.order and g.order[v] > lo and self.linear_weight(v) is not None]
            if not orders:
                self.fail(f"attention at {a.softmax.name}: no Q/K/V projection (linear layer) found")
            starts.append(min(orders))
        ends = starts[1:] + [len(g.bindings)]
        layers = []
        for i, a in enumerate(attentions):
            layer = LayerInfo(index=i, attention=a)
            attn_lo, mlp_lo, mlp_hi = starts[i], outs[i], ends[i]
            a.projections = []
            mlp_linears = []
            for b in g.bindings[attn_lo:mlp_hi]:
                w = self.linear_weight(b.var)
                if w is None:
                    continue
                is_mm = lambda v: g.op(v) == "relax.matmul" and not v.same_as(b.var)  # noqa: E731
                if g.order[b.var] < mlp_lo or (not a.projections[3:] and a.out in g.ancestors(b.var, stop=is_mm)):
                    if w.name not in a.projections:
                        a.projections.append(w.name)
                elif all(not w.same_as(x) for _, x in mlp_linears):
                    mlp_linears.append((b.var, w))
            for r in routers:
                if mlp_lo < g.order[r.topk_var] < mlp_hi:
                    layer.router = r
            if layer.router:
                r = layer.router
                for b in g.bindings[mlp_lo:mlp_hi]:
                    call = g.call(b.var)
                    for arg in call.args if call is not None else ():
                        w = g.weight_of(arg) if isinstance(arg, relax.Var) else None
                        if w is not None and len(shape_of(w)) == 3 and shape_of(w)[0] == r.num_experts:
                            layer.experts.setdefault(w.name, weight_shapes[w.name])
                if not layer.experts:
                    self.fail(f"layer {i}: router {r.weight} found but no stacked expert weights [E, ., .] follow it")
                for v, w in mlp_linears:
                    if w.name == r.weight or (i + 1 == len(attentions) and shape_of(w)[0] == self.vocab or shape_of(w)[-1] == self.vocab):
                        continue
                    if 1 in shape_of(w):
                        layer.shared_expert_gate = w.name
                    else:
                        layer.shared_experts[w.name] = weight_shapes[w.name]
            else:
                layer.dense_mlp = {w.name: weight_shapes[w.name] for v, w in mlp_linears if self.vocab not in shape_of(w)}
            prev_out = outs[i - 1] if i else -1
            mlp_anchor = layer.router.linear_var if layer.router else (mlp_linears[0][0] if mlp_linears else None)
            for n in norms:
                o = g.order[n.out_var]
                if n.role:
                    continue
                if prev_out < o < attn_lo:
                    n.role = "attention"
                elif attn_lo <= o < mlp_lo:
                    n.role = "qk"
                    a.qk_norm = True
                elif mlp_lo < o < mlp_hi and mlp_anchor is not None and n.out_var in g.ancestors(mlp_anchor):
                    n.role = "mlp"
                else:
                    continue
                layer.norms.append(n)
            layers.append(layer)
        return layers

    # ------------------------------------------------------------ driver
    def run(self) -> MoEStructure:
        g = self.g
        if not g.inputs:
            self.fail("the graph has no inputs")
        tok = g.inputs[0]
        tshape = shape_of(tok)
        if tshape is None or len(tshape) != 2 or not (dtype_of(tok) or "").startswith("int"):
            self.fail(f"first input {tok.name} must be integer token ids [batch, seq], got {tshape} {dtype_of(tok)}")
        self.batch, self.seq = tshape
        if is_static(self.seq):
            self.fail(f"input {tok.name} has a static sequence length {self.seq}: export with a dynamic sequence axis")
        # embedding
        embedding = None
        for var in g.calls_of("relax.take"):
            w = g.weight_of(g.call(var).args[0])
            if w is not None and len(shape_of(w)) == 2 and tok in g.ancestors(var):
                embedding = w
                break
        if embedding is None:
            self.fail(f"no token embedding (take of a [vocab, hidden] weight by {tok.name}) found")
        vocab, hidden = shape_of(embedding)
        self.vocab = vocab

        attentions = [a for a in (self.find_attention(sm) for sm in g.calls_of("relax.nn.softmax")) if a]
        if not attentions:
            sink = next((sm for sm in g.calls_of("relax.nn.softmax") if self._sink_concat(sm)), None)
            if sink is not None:
                self.fail(f"the attention at {sink.name} concatenates extra logits to its scores before the softmax "
                          "(attention sinks: a learned logit per head that takes part of the probability): not supported")
            self.fail("no self-attention (softmax(Q @ K^T) @ V) found")
        routers = [r for r in (self.find_router(tk) for tk in g.calls_of("relax.topk")) if r]
        # a group-limited router shows two top-k ops; keep the expert-level one
        group_topks = {id(r) for r in routers for o in routers if o is not r and o.linear_var.same_as(r.linear_var) and g.order[r.topk_var] < g.order[o.topk_var]}
        routers = [r for r in routers if id(r) not in group_topks]
        if not routers:
            self.fail("no MoE router found (no top-k over a linear layer's expert scores; routers that choose by "
                      "max / argmax passes, such as PhiMoE's sparsemixer in ONNX, are not recognised): dense models are "
                      "not supported")
        norms = self.find_norms()
        layers = self.assemble_layers(attentions, routers, norms)
        placed = {id(layer.router) for layer in layers if layer.router is not None}
        for r in routers:
            if id(r) not in placed:  # e.g. a hybrid model's convolution or linear-attention layer with experts
                self.fail(f"router {r.weight} (top-{r.top_k} over {r.num_experts} experts) lies outside every decoder "
                          "layer with self-attention: layers with another token mixer (convolution, linear or "
                          "state-space attention) are not supported")
        # LM head: the output's linear
        out = g.func.body.body
        if isinstance(out, relax.Var) and isinstance(g.value.get(out), relax.Tuple):
            out = g.value[out]
        if isinstance(out, relax.Tuple):
            out = out.fields[0]
        self.output = out
        lm = self.g.strip(out)
        lm_w = self.linear_weight(lm) if isinstance(lm, relax.Var) else None
        tail = [n for n in norms if not n.role]
        final_norm = tail[-1] if tail else None
        if final_norm:
            final_norm.role = "final"
        # rotary position sources: aranges upstream of cos/sin whose length follows the input (the sequence's
        # positions). A static-length arange there is part of the frequencies (``inv_freq`` computed in the
        # forward) or of a table indexed by positions, not a position source.
        pos = []
        others = [x for x in g.inputs if x is not tok]
        for var in g.calls_of("relax.cos") + g.calls_of("relax.sin"):
            anc = g.ancestors(var)
            from_input = next((x for x in others if x in anc), None)
            if from_input is not None:
                self.fail(f"the rotary embedding's positions at {var.name} are computed from the input {from_input.name} "
                          "(e.g. a cumulative sum of the attention mask): moec gives each token its position in its "
                          "sequence itself and needs the export's positions as an arange of the sequence length")
            for v in anc:
                length = (shape_of(v) or (None,))[0] if g.op(v) == "relax.arange" else None
                if length is not None and not is_static(length) and v not in pos:
                    pos.append(v)
        # a table looked up by the sequence's positions (a learned absolute position embedding) would see each
        # chunk's positions from 0 in the cached forward: refused
        for var in g.calls_of("relax.take"):
            table, idx = g.call(var).args[:2]
            w = g.weight_of(table)
            if w is embedding or not isinstance(idx, relax.Var) or (w is None and not isinstance(table, tvm.ir.GenericConst)):
                continue
            anc = g.ancestors(idx)
            if tok not in anc and any(g.op(v) == "relax.arange" and not is_static((shape_of(v) or (1,))[0]) for v in anc):
                what = f"the weight {w.name}" if w is not None else "a constant table"
                self.fail(f"{what} is looked up by the sequence's positions at {var.name} (a learned absolute position "
                          "embedding, or rotary tables precomputed for every position): not supported; rotary "
                          "embeddings computed from the positions are")
        return MoEStructure(
            layers=layers, vocab_size=int(vocab), hidden_size=int(hidden), dtype=dtype_of(embedding),
            embedding=embedding.name, lm_head=lm_w.name if lm_w is not None else None, final_norm=final_norm,
            token_input=tok, seq_dim=self.seq, batch_dim=self.batch, position_sources=pos,
        )


def analyze(func: relax.Function, num_inputs: int, source: str = "model") -> MoEStructure:
    """Recognise the MoE decoder structure of ``func`` (inputs first, then weights)."""
    return _Analyzer(func, num_inputs, source).run()
