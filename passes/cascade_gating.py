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

Group-limited routers (DeepSeek-V2/V3: ``n_group`` contiguous groups of the scores, ``topk_group``
kept by the model's own group scores, then a masked top-k) are lowered exactly, with the model's own
groups and group scores as the coarse stage (``G = n_group``, ``g = topk_group``)::

    chosen = topk(group_scores, g).indices                  # T, g     the model's group top-k, reused
    cand   = chosen * n + arange(n)                         # T, C     the kept groups' experts
    vals, j = topk(take_along(choice, cand), K);  ids = cand[j]   # T, K

where ``choice`` is the unmasked tensor the model masks (scores, or scores + bias). The mask becomes
dead code. The original top-k of the masked scores equals this wherever the kept experts' choice
scores exceed the dropped ones' fill value (0 for both forms recognised: ``choice * float(score >=
kth best)`` and ``where(not scatter(group ids), 0, choice)``), i.e. always for unbiased sigmoid or
softmax scores and for DeepSeek-V3's biased ones while score + bias > 0; exact ties between group
scores aside (the threshold form then keeps every tied group).

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
from ..compiler.graph import LAYOUT_OPS, DataflowGraph, const_scalar, dtype_of, shape_of
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
            if (num_groups, keep) != (r.n_group, r.topk_group):
                raise MoecError(f"{where}: the router is group-limited ({r.topk_group} of {r.n_group} groups kept, as "
                                f"trained): its exact cascade uses its own groups, --cascade-groups {r.n_group} "
                                f"--cascade-keep {r.topk_group} (got {num_groups} / {keep})")
            continue
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


def default_keep(structure: MoEStructure, num_groups: int) -> int:
    """The groups kept when not given (and no calibration chose): a group-limited router's own ``topk_group``,
    else all G, the exact routing. Data-free groups are not faithful with fewer: on the trained tiny model
    (bench/results/cascade_fidelity_cpu_tiny.json) G = 4, g = 2 lost 10% perplexity, g = 3 2.4%."""
    grouped = {layer.router.topk_group for layer in structure.moe_layers if layer.router.n_group > 1}
    return grouped.pop() if len(grouped) == 1 else num_groups


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
class GroupLimitedSpec:
    """A group-limited router's own cascade: ``num_groups`` contiguous groups of ``size`` experts, ``keep`` kept."""

    num_groups: int
    size: int
    keep: int

    @property
    def groups(self) -> np.ndarray:
        return np.arange(self.num_groups * self.size, dtype=np.int64).reshape(self.num_groups, self.size)


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


def emit_group_limited(bb: relax.BlockBuilder, choice: relax.Expr, chosen: relax.Expr, spec: GroupLimitedSpec, top_k: int,
                       index_dtype: str = "int64") -> CascadeOutputs:
    """Emit the exact top-k of a group-limited router over its kept groups' experts only.

    ``choice [T, E]`` is the unmasked tensor the model chooses by (scores, or scores + bias) and
    ``chosen [T, g]`` the model's own group top-k indices (see the module docstring).
    """
    # T tokens, E experts, G groups, n per group, g kept, C = g*n candidates, K active
    t = shape_of(choice)[0]
    n, g = spec.size, spec.keep
    emit = bb.emit
    chosen = chosen if dtype_of(chosen) == "int64" else emit(relax.op.astype(chosen, "int64"))
    first = emit(relax.op.multiply(emit(relax.op.expand_dims(chosen, [2])), relax.const(n, "int64")))  # T, g, 1
    cand = emit(relax.op.reshape(emit(relax.op.add(first, relax.op.arange(0, n, 1, "int64"))), [t, g * n]))  # T, C
    vals = emit(relax.op.gather_elements(choice, cand, axis=1))  # T, C
    best = emit(relax.op.topk(vals, k=top_k, axis=-1, ret_type="both", largest=True, dtype="int64"))
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


_ZERO_FILL = ("relax.zeros", "relax.zeros_like")
_ONE_FILL = ("relax.ones", "relax.ones_like")


class _GroupLimitedRouter:
    """The anchors of a group-limited router: the unmasked choice tensor, the group top-k, the masked top-k.

    Recognised by structure: the expert top-k reads ``multiply(choice, mask)`` or ``where(cond, fill,
    choice)`` (either order), where only the mask side depends on the group top-k, the fill is the
    constant 0, and the mask, followed back through layout ops and negations, is either
    ``score >= kth best group score`` or ``scatter(zeros, group top-k indices, ones)``, broadcast from
    [T, G] over [T, G, n] to the E experts (contiguous groups).
    """

    def __init__(self, g: DataflowGraph, layer: LayerInfo, where: str) -> None:
        r = layer.router
        self.layer, self.info, self.where = layer.index, r, where
        self.g = g
        tk, gtk = g.call(r.topk_var), r.group_topk_var
        if int(tk.attrs.axis) not in (-1, len(shape_of(tk.args[0])) - 1) or not bool(tk.attrs.largest):
            raise MoecError(f"{where}: the router top-k must select the largest scores along the last axis")
        self.ret_type, self.index_dtype = str(tk.attrs.ret_type), str(tk.attrs.dtype)
        e, big_g = r.num_experts, r.n_group
        n = e // big_g
        self.group_topk = gtk
        gcall = g.call(gtk)
        self.group_scores, self.group_ret = gcall.args[0], str(gcall.attrs.ret_type)
        if shape_of(self.group_scores) is None or shape_of(self.group_scores)[-1] != big_g or int(gcall.attrs.axis) not in (
                -1, len(shape_of(self.group_scores)) - 1) or not bool(gcall.attrs.largest):
            raise MoecError(f"{where}: the group top-k must select the largest of the {big_g} group scores (last axis)")
        masked = g.strip(tk.args[0])
        depends = lambda v: isinstance(v, relax.Var) and gtk in g.ancestors(v, stop=lambda u: u.same_as(gtk))  # noqa: E731
        op, args = g.op(masked), list(g.call(masked).args) if g.call(masked) is not None else []
        if op == "relax.multiply" and len(args) == 2 and depends(args[0]) != depends(args[1]):
            mask, choice = (args[0], args[1]) if depends(args[0]) else (args[1], args[0])
            need, fill = True, 0.0  # 1.0 at kept experts
        elif op == "relax.where" and depends(args[0]) and not depends(args[1]) and not depends(args[2]):
            cond, a, b = args
            if self._scalar(a) is not None:
                mask, fill, choice, need = cond, self._scalar(a), b, False  # where(dropped, fill, choice)
            elif self._scalar(b) is not None:
                mask, fill, choice, need = cond, self._scalar(b), a, True  # where(kept, choice, fill)
            else:
                raise MoecError(f"{where}: the group mask selects between two tensors, expected a constant fill")
        else:
            raise MoecError(f"{where}: group-limited router: the expert top-k reads {op or 'a tuple'} ({masked.name}); "
                            "expected the scores masked by the kept groups (multiply by a mask, or where)")
        if fill != 0.0:
            raise MoecError(f"{where}: group-limited router: dropped experts are filled with {fill}, expected 0")
        if shape_of(choice) is None or shape_of(choice)[-1] != e or len(shape_of(choice)) != 2:
            raise MoecError(f"{where}: group-limited router: the masked scores must be [T, {e}]")
        if r.linear_var not in g.ancestors(choice, stop=lambda u: u.same_as(r.linear_var)):
            raise MoecError(f"{where}: group-limited router: the masked scores do not come from the router matmul")
        self.choice = choice
        if self._kept(mask, big_g, n) != need:
            raise MoecError(f"{where}: group-limited router: the mask keeps the dropped groups' experts (inverted mask)")
        if not self._contiguous(self.group_scores, big_g, n, r.linear_var):
            raise MoecError(f"{where}: group-limited router: the group scores are not formed over contiguous groups "
                            f"of {n} experts ([T, {big_g}, {n}] view of the scores)")

    def _kept(self, expr, big_g: int, n: int) -> bool:
        """True if ``expr`` is nonzero exactly at the kept groups' experts, False if at the dropped ones."""
        g, flip, expanded = self.g, False, False
        while True:
            op = g.op(expr)
            shp = shape_of(expr)
            if op == "relax.reshape" and shp is not None and shp[-1] == big_g * n:
                src = shape_of(g.call(expr).args[0])
                expanded = expanded or (src is not None and tuple(src[-2:]) == (big_g, n))
            if op in LAYOUT_OPS:
                expr = g.call(expr).args[0]
            elif op in ("relax.logical_not", "relax.bitwise_not"):
                flip, expr = not flip, g.call(expr).args[0]
            else:
                break
        if not expanded:
            raise MoecError(f"{self.where}: group-limited router: the mask is not broadcast from [T, {big_g}] over "
                            f"contiguous groups of {n} experts")
        call = g.call(expr)
        if g.op(expr) in ("relax.greater_equal", "relax.greater") and self._same(call.args[0], self.group_scores) \
                and self._kth_value(call.args[1]):
            return not flip
        if g.op(expr) == "relax.scatter_elements" and self._is_group_indices(call.args[1]) \
                and self._filled(call.args[0], 0.0) and self._filled(call.args[2], 1.0):
            return not flip
        raise MoecError(f"{self.where}: group-limited router: cannot read the group mask ({g.op(expr) or expr}): expected "
                        "group scores >= the k-th best, or a scatter of the group top-k indices")

    def _scalar(self, expr) -> float | None:
        """The value of a scalar constant, maybe bound to a variable first."""
        base = self.g.strip(expr)
        return const_scalar(self.g.value.get(base, base) if isinstance(base, relax.Var) else base)

    def _same(self, a, b) -> bool:
        return self.g.strip(a).same_as(self.g.strip(b))

    def _kth_value(self, expr) -> bool:
        """``expr`` is the k-th (last) value of the group top-k: a slice of its values at k - 1."""
        g = self.g
        expr = g.strip(expr)
        if g.op(expr) != "relax.strided_slice":
            return False
        call = g.call(expr)
        item = g.value.get(g.strip(call.args[0]))
        k = int(g.call(self.group_topk).attrs.k)
        axes, begin = ([int(getattr(f, "value", f)) for f in a.fields] for a in call.args[1:3])
        rank = len(shape_of(expr))
        return (isinstance(item, relax.TupleGetItem) and item.index == 0 and item.tuple_value.same_as(self.group_topk)
                and len(begin) == 1 and axes[0] in (-1, rank - 1) and begin[0] in (k - 1, -1))

    def _is_group_indices(self, expr) -> bool:
        item = self.g.value.get(self.g.strip(expr))
        return isinstance(item, relax.TupleGetItem) and item.index == 1 and item.tuple_value.same_as(self.group_topk)

    def _filled(self, expr, value: float) -> bool:
        """``expr`` holds ``value`` everywhere: a constant, its broadcast, or zeros/ones/full(_like)."""
        g = self.g
        base = g.strip(expr)
        if self._scalar(base) is not None:
            return self._scalar(base) == value
        if isinstance(base, tvm.ir.GenericConst):
            return bool(np.all(base.data.numpy() == value))
        op = g.op(base)
        if op in _ZERO_FILL + _ONE_FILL:
            return (op in _ONE_FILL) == (value == 1.0)
        if op in ("relax.full", "relax.full_like"):
            return self._scalar(g.call(base).args[1]) == value
        return False

    def _contiguous(self, scores, big_g: int, n: int, stop) -> bool:
        """The group scores come from a [.., G, n] reshape of the [.., E] scores."""
        g = self.g
        for v in g.ancestors(scores, stop=lambda u: u.same_as(stop)):
            if g.op(v) == "relax.reshape":
                out, src = shape_of(v), shape_of(g.call(v).args[0])
                if out is not None and src is not None and tuple(out[-2:]) == (big_g, n) and src[-1] == big_g * n:
                    return True
        return False


@relax.expr_functor.mutator
class _CascadeGatingRewriter(relax.PyExprMutator):
    def __init__(self, mod, routers: dict, specs: dict) -> None:
        super().__init__(mod)
        self.by_topk = {r.info.topk_var: r for r in routers.values()}
        flat = [r for r in routers.values() if isinstance(r, _Router)]
        self.gathers = {gv: r for r in flat for gv in r.gathers}
        self.shapes = {sv: r for r in flat for sv in r.shapes}
        self.specs = specs
        self.outputs: dict = {}

    def visit_var_binding_(self, binding) -> None:
        var = binding.var
        # the original binding is kept (dead after the remap) for phase 1's structure analysis
        super().visit_var_binding_(binding)
        if var in self.by_topk and isinstance(self.by_topk[var], _GroupLimitedRouter):
            r = self.by_topk[var]
            bb = self.builder_
            gtk = self.visit_expr(r.group_topk)
            if r.group_ret == "values":  # the same top-k again, for its indices
                k = int(r.g.call(r.group_topk).attrs.k)
                gtk = bb.emit(relax.op.topk(self.visit_expr(r.group_scores), k=k, axis=-1, ret_type="indices", dtype="int64"))
            chosen = gtk if r.group_ret in ("indices", "values") else bb.emit(relax.TupleGetItem(gtk, 1))  # T, g
            out = emit_group_limited(bb, self.visit_expr(r.choice), chosen, self.specs[r.layer], r.info.top_k, r.index_dtype)
            self.outputs[r.layer] = out
            new = {"both": lambda: bb.emit(relax.Tuple([out.values, out.ids])), "values": lambda: out.values,
                   "indices": lambda: out.ids}[r.ret_type]()
            self.set_var_remap(var, new)
        elif var in self.by_topk:
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
    calibration : dict, optional
        Where given groups and coarse routers came from (``compiler.calibrate``), for the manifest.
    """

    def __init__(self, num_inputs: int, num_groups: int, keep: int, groups: dict | None = None,
                 coarse: dict | None = None, weights: dict | None = None, source: str = "model",
                 calibration: dict | None = None) -> None:
        self.num_inputs, self.num_groups, self.keep = num_inputs, num_groups, keep
        self.calibration = calibration
        self.groups, self.coarse, self.weights, self.source = dict(groups or {}), dict(coarse or {}), weights, source
        self.structure: MoEStructure | None = None
        self.specs: dict[int, CascadeSpec | GroupLimitedSpec] = {}
        self.outputs: dict[int, CascadeOutputs] = {}

    def resolve(self, structure: MoEStructure) -> dict[int, CascadeSpec]:
        """Per MoE layer, the groups and coarse router (given, or data-free from ``weights``)."""
        check_cascade(structure, self.num_groups, self.keep, self.source)
        specs = {}
        for layer in structure.moe_layers:
            r = layer.router
            where = f"{self.source}: layer {layer.index} (router {r.weight})"
            if r.n_group > 1:  # exact: the model's own groups and group scores
                if layer.index in self.groups or layer.index in self.coarse:
                    raise MoecError(f"{where}: the router is group-limited: its own groups are used, not given ones")
                specs[layer.index] = GroupLimitedSpec(r.n_group, r.num_experts // r.n_group, r.topk_group)
                continue
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
        routers = {layer.index: (_GroupLimitedRouter if layer.router.n_group > 1 else _Router)(
                   g, layer, f"{self.source}: layer {layer.index} (router {layer.router.weight})")
                   for layer in structure.moe_layers}
        rewriter = _CascadeGatingRewriter(mod, routers, self.specs)
        new_func = rewriter.visit_expr(func)
        self.outputs = rewriter.outputs  # per layer, the new routing tensors (vars of the new main)
        out = mod.clone() if hasattr(mod, "clone") else tvm.IRModule(dict(mod.functions))
        out["main"] = new_func
        return out

    def manifest(self) -> dict:
        """The settings and groups, for the artifact manifest."""
        def how(i, spec):
            if isinstance(spec, GroupLimitedSpec):
                return "exact: the group-limited router's own group scores"
            if i in self.coarse:
                return "calibrated (least squares of group log-sum-exp on recorded router inputs)" if self.calibration else "given"
            return "data-free (Gaussian least squares of group log-sum-exp)"

        return {
            "num_groups": self.num_groups, "keep": self.keep,
            "coarse": {str(i): how(i, s) for i, s in self.specs.items()},
            "groups": {str(i): s.groups.tolist() for i, s in self.specs.items()},
            "calibration": self.calibration,
        }


__all__ = ["CascadeGating", "CascadeSpec", "GroupLimitedSpec", "check_cascade", "data_free_groups", "default_keep",
           "emit_cascade", "emit_group_limited", "fit_coarse"]
