"""CascadeGating: a coarse router over G expert groups, then a fine router over the kept groups only.

Expects ``main(input_ids[B,S], [attention_mask], *weights)`` (before phase 1) whose MoE structure
``compiler.moe_structure.analyze`` recognises, with flat routers ``matmul(x, W^T) -> softmax|sigmoid
-> topk`` (W [E, D] a weight parameter, or W^T [D, E]); the score tensor may also be read by gathers at
the top-k indices (``gather_elements(scores, topk_indices)``, with or without ONNX's negative-index
normalisation, whose ``shape_of(scores)`` becomes a shape expression), e.g. for renormalisation,
which follows downstream unchanged.

Guarantees after: each such router of a layer with a grouping is computed as (legend: T tokens,
D hidden, E experts, G groups, n = E/G experts per group, g groups kept, C = g*n candidates,
K active experts)::

    coarse = x @ Cr^T + b                                   # T, G     Cr [G, D], b [G]: new constants
    chosen = topk(coarse, g).indices                        # T, g     (topk of all G when g < G, softmax)
    cand   = take(groups, chosen)                           # T, C     global expert ids, groups [G, n]
    fine   = sum(take(W, cand) * x, -1)                     # T, C     only the candidates' router rows
    p      = softmax([fine, coarse of the G-g dropped groups])[:C]   (softmax routers)
             sigmoid(fine)                                            (sigmoid routers)
    vals, j = topk(p, K);  ids = cand[j]                    # T, K

and the original top-k's (values, indices) become (vals, ids); gathers of the full score tensor at
the top-k indices become ``vals``. Everything downstream (renormalisation, experts) is unchanged.

Weighting, exactly: sigmoid scores are per expert, so the candidates' scores are the original ones.
For softmax, the denominator is the sum of exp over the candidates' fine logits plus exp of each
dropped group's coarse logit, the coarse router's estimate of that group's log-sum-exp. With g = G
nothing is dropped: the denominator is the full softmax's, so weights and top-k set equal the
original's up to float rounding. With g < G and renormalisation over the top-k (Mixtral style) the
denominator cancels: the weights are exactly the original's whenever the original top-k lies among
the candidates. Without renormalisation (OLMoE style) the weights are the original's up to the
coarse estimate of the dropped groups' mass.

The original router bindings stay in ``main`` as dead code: phase 1 re-runs the structure analysis,
which recognises routers by their full ``[E, D]`` matmul; the dead-code elimination after phase 1
removes them, so ``prefill`` and ``decode`` compute the cascade only.

Groups and coarse router without calibration data (``data_free_groups``, ``fit_coarse``): balanced
k-means of the router's rows by cosine (experts whose rows point alike win the same tokens), and per
group the least-squares fit ``lse(x W_g^T) ~ x c_g + b_g`` over Gaussian hidden states
``x ~ N(0, diag(norm_weight^2))`` (the RMSNorm output with unit RMS): by Stein's lemma that fit is
``c_g = E[softmax(x W_g^T)] W_g`` (softmax-weighted mean of the group's rows), ``b_g = E[lse]``,
estimated by Monte Carlo with a fixed seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from ..compiler.errors import MoecError
from ..compiler.graph import DataflowGraph, dtype_of, shape_of
from ..compiler.moe_structure import LayerInfo, MoEStructure, analyze

# ---------------------------------------------------------------------------- options and checks


def check_cascade(structure: MoEStructure, num_groups: int, keep: int, source: str = "model") -> None:
    """Raise ``MoecError`` (naming the layer) unless every MoE layer's router can be cascaded."""
    if not isinstance(num_groups, (int, np.integer)) or isinstance(num_groups, bool) or num_groups < 2:
        raise MoecError(f"cascade groups must be an integer >= 2, got {num_groups!r}")
    if not isinstance(keep, (int, np.integer)) or isinstance(keep, bool) or not 1 <= keep <= num_groups:
        raise MoecError(f"cascade keep must be an integer in [1, {num_groups}] (groups kept of {num_groups}), got {keep!r}")
    for layer in structure.moe_layers:
        r = layer.router
        where = f"{source}: layer {layer.index} (router {r.weight})"
        if r.num_experts % num_groups:
            raise MoecError(f"{where}: {r.num_experts} experts do not split into {num_groups} equal groups")
        if r.score not in ("softmax", "sigmoid"):
            raise MoecError(f"{where}: cascade gating needs softmax or sigmoid scores before the top-k, got {r.score!r}")
        if r.n_group > 1:
            raise MoecError(f"{where}: the router is group-limited (n_group {r.n_group}, topk_group {r.topk_group}); "
                            "cascade gating applies to flat routers")
        if r.top_k > keep * (r.num_experts // num_groups):
            raise MoecError(f"{where}: keeping {keep} of {num_groups} groups leaves {keep * r.num_experts // num_groups} "
                            f"candidate experts, fewer than top-{r.top_k}")


def _check_groups(groups, num_experts: int, num_groups: int, where: str) -> np.ndarray:
    arr = np.asarray(groups, dtype=np.int64) if len(groups) else np.zeros((0, 0), np.int64)
    if arr.ndim != 2 or arr.shape != (num_groups, num_experts // num_groups):
        raise MoecError(f"{where}: groups must be {num_groups} lists of {num_experts // num_groups} expert ids, "
                        f"got shape {list(arr.shape)}")
    if sorted(arr.reshape(-1).tolist()) != list(range(num_experts)):
        raise MoecError(f"{where}: groups must partition the experts 0..{num_experts - 1}, each expert in exactly one group")
    return arr


# ---------------------------------------------------------------------------- data-free grouping


def data_free_groups(router_weight: np.ndarray, num_groups: int, iters: int = 25) -> list[list[int]]:
    """Balanced k-means (cosine) of the router rows into ``num_groups`` groups of equal size.

    Deterministic: centroids start from farthest-point seeding at the largest-norm row; each step
    assigns (expert, group) pairs greedily by similarity under the capacity E/G. Groups are returned
    sorted (each by expert id, then by first expert).
    """
    w = np.asarray(router_weight, dtype=np.float64)
    e = w.shape[0]
    if e % num_groups:
        raise MoecError(f"{e} experts do not split into {num_groups} equal groups")
    cap = e // num_groups
    u = w / np.maximum(np.linalg.norm(w, axis=1, keepdims=True), 1e-12)
    seeds = [int(np.argmax(np.linalg.norm(w, axis=1)))]
    while len(seeds) < num_groups:
        sim = (u @ u[seeds].T).max(axis=1)
        sim[seeds] = np.inf
        seeds.append(int(np.argmin(sim)))
    cent = u[seeds]
    assign = None
    for _ in range(iters):
        sim = u @ cent.T  # E, G
        order = np.lexsort((np.arange(e * num_groups), -sim.reshape(-1)))  # best pairs first, stable
        new = -np.ones(e, dtype=np.int64)
        fill = np.zeros(num_groups, dtype=np.int64)
        for flat in order:
            i, gi = divmod(int(flat), num_groups)
            if new[i] < 0 and fill[gi] < cap:
                new[i], fill[gi] = gi, fill[gi] + 1
        if assign is not None and np.array_equal(new, assign):
            break
        assign = new
        cent = np.stack([u[assign == gi].mean(axis=0) for gi in range(num_groups)])
        cent /= np.maximum(np.linalg.norm(cent, axis=1, keepdims=True), 1e-12)
    groups = [sorted(int(i) for i in np.flatnonzero(assign == gi)) for gi in range(num_groups)]
    return sorted(groups)


def fit_coarse(router_weight: np.ndarray, groups, norm_weight: np.ndarray | None = None, samples: int = 4096,
               seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Coarse router ``(Cr [G, D], b [G])`` with ``x @ Cr^T + b ~ logsumexp(x @ W_g^T)`` per group.

    The least-squares fit over ``x ~ N(0, diag(norm_weight^2))`` (unit-RMS hidden states scaled by
    the RMSNorm weight before the router; identity scale if not given). By Stein's lemma the
    population fit is ``Cr_g = E[softmax(x W_g^T)] W_g``, ``b_g = E[logsumexp(x W_g^T)]``, estimated
    here from ``samples`` draws with a fixed seed.
    """
    w = np.asarray(router_weight, dtype=np.float64)
    d = w.shape[1]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, d))
    if norm_weight is not None:
        x = x * np.asarray(norm_weight, dtype=np.float64).reshape(1, d)
    rows, bias = [], []
    for grp in np.asarray(groups, dtype=np.int64):
        logits = x @ w[grp].T  # N, n
        m = logits.max(axis=1, keepdims=True)
        ex = np.exp(logits - m)
        lse = (m[:, 0] + np.log(ex.sum(axis=1)))  # N
        prob = ex / ex.sum(axis=1, keepdims=True)  # N, n
        rows.append(prob.mean(axis=0) @ w[grp])
        bias.append(lse.mean())
    return np.stack(rows), np.asarray(bias)


# ---------------------------------------------------------------------------- the rewrite


@dataclass
class CascadeSpec:
    """The per-layer cascade: groups [G, n] (expert ids), coarse router Cr [G, D] and bias b [G]."""

    groups: np.ndarray
    coarse: np.ndarray
    bias: np.ndarray
    keep: int

    @property
    def num_groups(self) -> int:
        return int(self.groups.shape[0])


@dataclass
class CascadeOutputs:
    values: relax.Expr  # T, K   scores of the chosen experts
    ids: relax.Expr  # T, K      global expert ids
    chosen: relax.Expr  # T, g   chosen group indices
    candidates: relax.Expr  # T, C   candidate expert ids


def emit_cascade(bb: relax.BlockBuilder, x: relax.Expr, rows: relax.Expr, spec: CascadeSpec, top_k: int, score: str,
                 index_dtype: str = "int64") -> CascadeOutputs:
    """Emit the cascade router for ``x [T, D]`` and router rows ``rows [E, D]`` (see the module docstring)."""
    # T tokens, D hidden, E experts, G groups, n per group, g kept, C = g*n candidates, K active
    dtype = dtype_of(x)
    t, d = shape_of(x)
    big_g, n = spec.groups.shape
    g = spec.keep
    c = g * n
    emit = bb.emit
    def const(arr):  # float32 constants cast in Relax (numpy has no bfloat16); FoldConstant folds the cast
        c = relax.const(np.ascontiguousarray(arr, dtype=np.float32), "float32")
        return c if dtype == "float32" else emit(relax.op.astype(c, dtype))

    cr = const(spec.coarse)  # G, D
    coarse = emit(relax.op.matmul(x, emit(relax.op.permute_dims(cr, [1, 0])), out_dtype=dtype))  # T, G
    if np.any(spec.bias):
        coarse = emit(relax.op.add(coarse, const(spec.bias)))  # T, G
    need_dropped = score == "softmax" and g < big_g
    ranked = emit(relax.op.topk(coarse, k=big_g if need_dropped else g, axis=-1, ret_type="both", largest=True, dtype="int64"))
    chosen = emit(relax.TupleGetItem(ranked, 1))  # T, g (or G, best first)
    if need_dropped:
        dropped = emit(relax.op.strided_slice(emit(relax.TupleGetItem(ranked, 0)), [1], [g], [big_g]))  # T, G-g
        chosen = emit(relax.op.strided_slice(chosen, [1], [0], [g]))  # T, g
    groups = relax.const(np.ascontiguousarray(spec.groups.astype(np.int64)), "int64")  # G, n
    cand = emit(relax.op.reshape(emit(relax.op.take(groups, chosen, axis=0)), [t, c]))  # T, C
    # a gather and a row-wise dot product (not a matmul: FuseOps folds the take and the multiply into
    # the reduction, so the candidates' rows are read once and never materialised)
    sel = emit(relax.op.take(rows, cand, axis=0))  # T, C, D: only the candidates' router rows
    fine = emit(relax.op.sum(emit(relax.op.multiply(sel, emit(relax.op.reshape(x, [t, 1, d])))), axis=[-1]))  # T, C
    if score == "softmax":
        if need_dropped:
            z = emit(relax.op.concat([fine, dropped], axis=1))  # T, C + G - g
            p = emit(relax.op.strided_slice(emit(relax.op.nn.softmax(z, axis=-1)), [1], [0], [c]))  # T, C
        else:
            p = emit(relax.op.nn.softmax(fine, axis=-1))  # T, C
    elif score == "sigmoid":
        p = emit(relax.op.sigmoid(fine))  # T, C
    else:
        raise MoecError(f"cascade gating needs softmax or sigmoid scores, got {score!r}")
    best = emit(relax.op.topk(p, k=top_k, axis=-1, ret_type="both", largest=True, dtype="int64"))
    values = emit(relax.TupleGetItem(best, 0))  # T, K
    ids = emit(relax.op.gather_elements(cand, emit(relax.TupleGetItem(best, 1)), axis=1))  # T, K global ids
    if index_dtype != "int64":
        ids = emit(relax.op.astype(ids, index_dtype))
    return CascadeOutputs(values=values, ids=ids, chosen=chosen, candidates=cand)


class _Router:
    """The graph anchors of one router: input x, rows W [E, D] (or W^T), scores, top-k, gathers."""

    def __init__(self, g: DataflowGraph, layer: LayerInfo, where: str) -> None:
        r = layer.router
        self.layer, self.info = layer.index, r
        tk = g.call(r.topk_var)
        if int(tk.attrs.axis) not in (-1, len(shape_of(tk.args[0])) - 1) or not bool(tk.attrs.largest):
            raise MoecError(f"{where}: the router top-k must select the largest scores along the last axis")
        self.ret_type, self.index_dtype = str(tk.attrs.ret_type), str(tk.attrs.dtype)
        self.scores = g.strip(tk.args[0])
        if g.op(self.scores) not in ("relax.nn.softmax", "relax.sigmoid") or not g.strip(g.call(self.scores).args[0]).same_as(r.linear_var):
            raise MoecError(f"{where}: expected matmul -> {r.score} -> top-k with only layout ops between them")
        if g.op(self.scores) == "relax.nn.softmax" and int(g.call(self.scores).attrs.axis) not in (-1, len(shape_of(self.scores)) - 1):
            raise MoecError(f"{where}: the router softmax must run over the experts (last axis)")
        x, rhs = g.call(r.linear_var).args
        self.x = x
        w = g.weight_of(rhs)
        wshape = shape_of(w)
        e, d = r.num_experts, shape_of(x)[-1]
        if g.op(rhs) == "relax.permute_dims" and g.call(rhs).args[0].same_as(w) and wshape == (e, d):
            self.rows, self.transposed = w, False
        elif rhs.same_as(w) and wshape == (d, e):
            self.rows, self.transposed = w, True
        else:
            raise MoecError(f"{where}: the router weight must reach the matmul as W^T (W [E, D]) or as a [D, E] weight")
        # users of the scores: the path to the top-k, and gathers at the top-k indices
        self.gathers, self.shapes = [], []
        path = set(g.ancestors(r.topk_var, stop=lambda v: v.same_as(self.scores)))
        for u in g.users.get(self.scores, []):
            if u in path:
                continue
            call = g.call(u)
            if g.op(u) == "relax.gather_elements" and self._is_topk_indices(g, call.args[1]):
                self.gathers.append(u)
            elif g.op(u) == "relax.shape_of":  # ONNX: the expert count for negative-index normalisation
                self.shapes.append(u)
            else:
                raise MoecError(f"{where}: the router scores feed {g.op(u) or 'a tuple'} ({u.name}) besides the top-k; "
                                "cascade gating supports gathers of the scores at the top-k indices only")
        for u in g.users.get(r.linear_var, []):
            if not u.same_as(self.scores) and u not in path:
                raise MoecError(f"{where}: the router logits feed {g.op(u)} ({u.name}) besides the scores")

    def _is_topk_indices(self, g: DataflowGraph, expr) -> bool:
        """``expr`` is the top-k indices, maybe cast or normalised ``where(i < 0, i + E, i)``."""
        expr = g.strip(expr, frozenset({"relax.astype"}))
        v = g.value.get(expr)
        if isinstance(v, relax.TupleGetItem):
            return v.index == 1 and v.tuple_value.same_as(self.info.topk_var)
        if g.op(expr) == "relax.where":
            cond, shifted, plain = g.call(expr).args
            return (self._is_topk_indices(g, plain) and g.op(shifted) == "relax.add"
                    and self._is_topk_indices(g, g.call(shifted).args[0]) and g.op(cond) == "relax.less"
                    and self._is_topk_indices(g, g.call(cond).args[0]))
        return False


@relax.expr_functor.mutator
class _CascadeGatingRewriter(relax.PyExprMutator):
    def __init__(self, mod, routers: dict, specs: dict) -> None:
        super().__init__(mod)
        self.by_topk = {r.info.topk_var: r for r in routers.values()}
        self.gathers = {gv: r for r in routers.values() for gv in r.gathers}
        self.shapes = {sv: r for r in routers.values() for sv in r.shapes}
        self.specs = specs
        self.outputs: dict = {}

    def visit_var_binding_(self, binding) -> None:
        var = binding.var
        # the original binding is kept (dead after the remap) for phase 1's structure analysis
        super().visit_var_binding_(binding)
        if var in self.by_topk:
            r = self.by_topk[var]
            bb = self.builder_
            x = self.visit_expr(r.x)  # ..., D
            shp = shape_of(x)
            x2 = x if len(shp) == 2 else bb.emit(relax.op.reshape(x, [-1, shp[-1]]))  # T, D
            rows = self.visit_expr(r.rows)
            if r.transposed:
                rows = bb.emit(relax.op.permute_dims(rows, [1, 0]))  # E, D
            out = emit_cascade(bb, x2, rows, self.specs[r.layer], r.info.top_k, r.info.score, r.index_dtype)
            lead = list(shape_of(r.scores))[:-1]  # the original top-k's leading axes
            k = r.info.top_k
            if len(lead) != 1:
                out.values = bb.emit(relax.op.reshape(out.values, lead + [k]))
                out.ids = bb.emit(relax.op.reshape(out.ids, lead + [k]))
            self.outputs[r.layer] = out
            new = {"both": lambda: bb.emit(relax.Tuple([out.values, out.ids])), "values": lambda: out.values,
                   "indices": lambda: out.ids}[r.ret_type]()
            self.set_var_remap(var, new)
        elif var in self.gathers:
            self.set_var_remap(var, self.outputs[self.gathers[var].layer].values)
        elif var in self.shapes:  # the scores' shape is known statically (up to the token count)
            self.set_var_remap(var, self.builder_.emit(relax.ShapeExpr(list(shape_of(self.shapes[var].scores)))))


@tvm.transform.module_pass(opt_level=0, name="CascadeGating")
class CascadeGating:
    """Rewrite each flat router of ``main`` into a coarse group router and a fine router over the kept groups.

    Parameters
    ----------
    num_inputs : int
        Leading non-weight parameters of ``main`` (token ids, attention mask).
    num_groups : int
        G, the number of equal-size expert groups (must divide every MoE layer's expert count).
    keep : int
        g, the groups kept per token (1 <= g <= G); g = G reproduces the original routing.
    groups : dict[int, list[list[int]]], optional
        Per layer index, G lists of E/G expert ids. Missing layers are grouped data-free.
    coarse : dict[int, np.ndarray | tuple[np.ndarray, np.ndarray]], optional
        Per layer index, the coarse router [G, D] (rows in the order of the groups), optionally with a
        bias [G]. Missing layers get ``fit_coarse``.
    weights : dict[str, np.ndarray], optional
        Weight values by parameter name: needed for the data-free groups and coarse routers.
    """

    def __init__(self, num_inputs: int, num_groups: int, keep: int, groups: dict | None = None,
                 coarse: dict | None = None, weights: dict | None = None, source: str = "model") -> None:
        self.num_inputs, self.num_groups, self.keep = num_inputs, num_groups, keep
        self.groups, self.coarse, self.weights, self.source = dict(groups or {}), dict(coarse or {}), weights, source
        self.structure: MoEStructure | None = None
        self.specs: dict[int, CascadeSpec] = {}

    def resolve(self, structure: MoEStructure) -> dict[int, CascadeSpec]:
        """Per MoE layer, the groups and coarse router (given, or data-free from ``weights``)."""
        check_cascade(structure, self.num_groups, self.keep, self.source)
        specs = {}
        for layer in structure.moe_layers:
            r = layer.router
            where = f"{self.source}: layer {layer.index} (router {r.weight})"
            need = layer.index not in self.groups or layer.index not in self.coarse
            if need and (self.weights is None or r.weight not in self.weights):
                raise MoecError(f"{where}: no groups/coarse router given and no router weights to derive them from")
            w = np.asarray(self.weights[r.weight]) if need else None
            if w is not None and w.shape != (r.num_experts, structure.hidden_size):
                w = w.T  # stored as W^T [D, E]
            grp = self.groups.get(layer.index)
            grp = _check_groups(grp if grp is not None else data_free_groups(w, self.num_groups), r.num_experts,
                                self.num_groups, where)
            if layer.index in self.coarse:
                given = self.coarse[layer.index]
                cr, b = given if isinstance(given, tuple) else (given, np.zeros(self.num_groups))
                cr, b = np.asarray(cr), np.asarray(b).reshape(-1)
                if cr.shape != (self.num_groups, structure.hidden_size) or b.shape != (self.num_groups,):
                    raise MoecError(f"{where}: coarse router must be [{self.num_groups}, {structure.hidden_size}] "
                                    f"(bias [{self.num_groups}]), got {list(cr.shape)} / {list(b.shape)}")
            else:
                norm = next((nm for nm in layer.norms if nm.role == "mlp"), None)
                nw = self.weights.get(norm.weight) if norm is not None else None
                cr, b = fit_coarse(w, grp, None if nw is None else np.asarray(nw).reshape(-1))
            specs[layer.index] = CascadeSpec(groups=grp, coarse=cr, bias=b, keep=self.keep)
        return specs

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        func = mod["main"]
        structure = analyze(func, self.num_inputs, self.source)
        self.structure = structure
        self.specs = self.resolve(structure)
        g = DataflowGraph(func, self.num_inputs)
        routers = {layer.index: _Router(g, layer, f"{self.source}: layer {layer.index} (router {layer.router.weight})")
                   for layer in structure.moe_layers}
        rewriter = _CascadeGatingRewriter(mod, routers, self.specs)
        new_func = rewriter.visit_expr(func)
        out = mod.clone() if hasattr(mod, "clone") else tvm.IRModule(dict(mod.functions))
        out["main"] = new_func
        return out

    def manifest(self) -> dict:
        """The settings and groups, for the artifact manifest."""
        return {
            "num_groups": self.num_groups, "keep": self.keep,
            "coarse": {str(i): ("given" if i in self.coarse else "data-free (Gaussian least squares of group log-sum-exp)")
                       for i in self.specs},
            "groups": {str(i): s.groups.tolist() for i, s in self.specs.items()},
        }


__all__ = ["CascadeGating", "CascadeSpec", "check_cascade", "data_free_groups", "emit_cascade", "fit_coarse"]
