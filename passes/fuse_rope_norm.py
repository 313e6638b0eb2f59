"""FuseRoPEIntoNorm: the rotary embedding of queries and keys computed in the RMSNorm kernel before it.

Expects entry functions after ``InsertRMSNorm`` (phase 1). Models with Q- and K-norms (OLMoE, Qwen3-MoE) normalise the
projected queries and keys and then rotate them; after InsertRMSNorm the norms are one ``rms_norm`` kernel (a pair
of them in one launch where they share a spec) and the rotation is a chain of layout and elementwise ops that TVM's
fusion turns into one kernel per tensor. Matched by structure (legend: y the norm's [N, D] output, Dh the head
size, h = Dh / 2, C / S the cos and sin tables broadcast over the heads)::

    t = reshape(y, [B, S, H, Dh]), optionally permute_dims(.., [0, 2, 1, 3]) to [B, H, S, Dh]
    r = concat([-t[..., h:], t[..., :h]], -1)                     # rotate half
    u = t * C + r * S                                             # (either operand order)
    o = u, permuted back when t was, optionally cast               # [B, S, H, Dh]

Each such ``o`` is computed by the norm's kernel itself (``rms_norm`` with ``rope``: the tables as [tokens, Dh]
inputs, ``schedules.kernels.rms_norm``); a pair is fused where both of its norms are rotated with the same tables
(per-head norms with grouped KV heads: the keys have fewer heads a token, ``rope_token2``).

Why: at decode batch sizes each kernel of a layer is a launch of a few microseconds, most of it latency; the
rotation's two kernels (queries, keys) read back what the norm had just written. Two launches a layer less.

Guarantees after: every user of ``o`` reads the fused kernel's output reshaped to ``o``'s shape. The llvm form equals
the unfused graph's llvm code bit for bit (the rotation in float32 after the norm's rounding, rounded once). The CUDA
form rounds each 16-bit product and the sum as PyTorch's rotation does; TVM's unfused CUDA kernel computes the same
operations in bfloat16 but leaves nvcc free to contract a product and the sum into one FMA, so on the GPU the two
can differ by one 16-bit rounding (the fused form is PyTorch's). The kernel runs where the last rotation's sum was
bound (ONNX exports compute the tables after the norm); bindings that read the first rotation before then follow it.
The unfused bindings are left out (each was read only inside the matched chain). Norms whose output is read
elsewhere, rotations of another form (interleaved pairs, a rotated part of the head), tables that are not
[tokens, Dh] of the norm's dtype, and 16-bit float norms other than bfloat16 stay as they were.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import tvm
from tvm import relax
from tvm.ir.prim.expr import IntImm

from ..compiler.errors import MoecError
from ..compiler.graph import DataflowGraph, KernelCache, dtype_of, is_static, num_input_entries, op_name, same_dim, shape_of
from ..schedules.kernels.rms_norm import check_supported, make_rms_norm
from .simplify_layout import _axes

_SWAP = [0, 2, 1, 3]


@dataclass(frozen=True)
class _Rope:
    """One matched rotation: ``final`` (the var its users read), the tables, and the kernel's rope fields."""

    final: relax.Var
    cos: relax.Expr  # broadcast over the heads; read as [tokens, Dh]
    sin: relax.Expr
    tokens: object  # the tables' rows (M)
    head: int  # Dh
    token: int  # H Dh: the elements of one token
    out_dtype: str
    chain: frozenset  # the bindings the fused kernel replaces (read only inside the chain)
    at: int  # the binding order of the rotation's sum (the tables and the norm's inputs are bound before it)


def _ints(expr) -> list[int] | None:
    if isinstance(expr, relax.Tuple) and all(isinstance(f, IntImm) for f in expr.fields):
        return [int(f.value) for f in expr.fields]
    return None


class _Finder:
    """The fusable norm calls of one entry: ``{call var: (spec, [rope per output], [output vars])}``."""

    def __init__(self, func: relax.Function, norm_specs: dict) -> None:
        self.g = DataflowGraph(func, int(func.attrs["num_input"]))
        self.norm_specs = norm_specs

    def _only_user(self, var):
        users = self.g.users.get(var, [])
        return users[0] if len(users) == 1 else None

    def _slice(self, var, t, dh: int) -> str | None:
        """"lo" / "hi" when ``var`` is t's first / second half along its last axis, else None."""
        value = self.g.value.get(var)
        if op_name(value) != "relax.strided_slice" or value.args[0] != t:
            return None
        axes, begin, end, strides = (_ints(a) for a in value.args[1:5])
        if None in (axes, begin, end, strides) or axes not in ([3], [-1]) or strides != [1]:
            return None
        h = dh // 2
        if begin == [0] and end == [h]:
            return "lo"
        if begin == [h] and end[0] >= dh:
            return "hi"
        return None

    def _table(self, expr, t, permuted: bool, dtype: str):
        """The rows of ``expr`` as a [tokens, Dh] table when it broadcasts over t's heads, else None."""
        shape = shape_of(expr)
        if shape is None or len(shape) > 4 or dtype_of(expr) != dtype:
            return None
        shape = [1] * (4 - len(shape)) + list(shape)
        tshape = shape_of(t)
        tok_ax, head_ax = (2, 1) if permuted else (1, 2)
        if not (same_dim(shape[3], tshape[3]) and same_dim(shape[head_ax], 1) and same_dim(shape[tok_ax], tshape[tok_ax])):
            return None
        if same_dim(shape[0], 1):  # (one table for every sequence of a batch is not one row a token)
            return shape[tok_ax] if same_dim(tshape[0], 1) else None
        return shape[0] * shape[tok_ax] if same_dim(shape[0], tshape[0]) else None

    def rope_of(self, y, spec):
        """The rotation of norm output ``y`` ([N, D] of ``spec``), or None."""
        g, chain = self.g, [y]
        x = y
        while (u := self._only_user(x)) is not None and g.op(u) == "relax.reshape":
            chain.append(u)
            x = u
        r4 = x
        shape = shape_of(r4)
        if len(chain) == 1 or shape is None or len(shape) != 4 or not is_static(shape[3]) or not is_static(shape[2]):
            return None
        dh, heads = int(shape[3]), int(shape[2])
        if dh % 2 or spec.hidden % dh:
            return None
        t, permuted = r4, False
        u = self._only_user(r4)
        if u is not None and g.op(u) == "relax.permute_dims" and _axes(g.value[u], 4) == _SWAP:
            t, permuted = u, True
            chain.append(u)
        users = g.users.get(t, [])
        if len(users) != 3:
            return None
        halves = {self._slice(v, t, dh): v for v in users}
        halves.pop(None, None)
        muls = [v for v in users if g.op(v) == "relax.multiply"]
        if set(halves) != {"lo", "hi"} or len(muls) != 1:
            return None
        lo, hi, mul_c = halves["lo"], halves["hi"], muls[0]
        neg = self._only_user(hi)
        if neg is None or g.op(neg) != "relax.negative":
            return None
        cat = self._only_user(neg)
        if cat is None or cat != self._only_user(lo) or g.op(cat) != "relax.concat" or int(g.value[cat].attrs.axis) not in (-1, 3):
            return None
        if list(g.value[cat].args[0].fields) != [neg, lo]:
            return None
        mul_s = self._only_user(cat)
        if mul_s is None or g.op(mul_s) != "relax.multiply":
            return None
        add = self._only_user(mul_c)
        if add is None or add != self._only_user(mul_s) or g.op(add) != "relax.add":
            return None
        if set(g.value[add].args) != {mul_c, mul_s}:
            return None
        other = lambda m, mine: next((a for a in g.value[m].args if a != mine), None)  # noqa: E731
        cos, sin = other(mul_c, t), other(mul_s, cat)
        rows = [self._table(e, t, permuted, spec.y_dtype) for e in (cos, sin)]
        if None in rows or not same_dim(rows[0], rows[1]):
            return None
        chain += [lo, hi, mul_c, neg, cat, mul_s, add]
        final = add
        if permuted:
            u = self._only_user(final)
            if u is None or g.op(u) != "relax.permute_dims" or _axes(g.value[u], 4) != _SWAP:
                return None
            chain.append(u)
            final = u
        u = self._only_user(final)
        if u is not None and g.op(u) == "relax.astype":
            chain.append(u)
            final = u
        chain.remove(final)
        return _Rope(final, cos, sin, rows[0], dh, heads * dh, dtype_of(final), frozenset(chain), g.order[add])

    def _read_before(self, ropes, at: int) -> set:
        """The bindings before ``at`` that read a rotation's result, directly or through each other."""
        early, stack = set(), [r.final for r in ropes]
        while stack:
            for u in self.g.users.get(stack.pop(), []):
                if self.g.order[u] < at and u not in early:
                    early.add(u)
                    stack.append(u)
        return early

    def found(self, form: str) -> tuple[dict, list[str]]:
        """``{norm call var: (fused spec, rotations, the norm's outputs, the binding the kernel runs at)}`` and why
        matched norms were left."""
        out, skipped, windows = {}, [], []
        for var, value in self.g.value.items():
            if op_name(value) != "relax.call_tir":
                continue
            spec = self.norm_specs.get(value.args[0].name_hint)
            if spec is None or spec.residual or spec.rope:
                continue
            outs = [var]
            if spec.pair:  # its two outputs, each read once (through TupleGetItem 0 and 1)
                items = self.g.users.get(var, [])
                if len(items) != 2 or any(not isinstance(self.g.value[o], relax.TupleGetItem) for o in items):
                    continue
                outs = sorted(items, key=lambda o: int(self.g.value[o].index))
                if [int(self.g.value[o].index) for o in outs] != [0, 1]:
                    continue
            ropes = [self.rope_of(o, spec) for o in outs]
            if None in ropes:
                continue
            r0 = ropes[0]
            if any(r.cos != r0.cos or r.sin != r0.sin or r.out_dtype != r0.out_dtype or r.head != r0.head for r in ropes):
                skipped.append(f"{var.name}: the pair's rotations differ (tables, head size or dtype)")
                continue
            second = ropes[-1].token if ropes[-1].token != r0.token else 0  # (grouped KV heads: fewer a token)
            fused = replace(spec, rope=r0.head, rope_token=r0.token, rope_token2=second, rope_out=r0.out_dtype)
            try:
                check_supported(fused, form)
            except MoecError as exc:
                skipped.append(f"{var.name}: {exc}")
                continue
            at = max(r.at for r in ropes)  # the kernel runs at the last rotation's sum: everything it reads is bound
            early = self._read_before(ropes, at)  # what reads a rotation before then moves after it (the rewrite)
            first = min(self.g.order[r.final] for r in ropes)
            if early and early & self.g.ancestors(self.g.bindings[at].var, stop=lambda v: self.g.order.get(v, -1) < first):
                skipped.append(f"{var.name}: the last rotation is computed from the first")
                continue
            if any(lo <= at and first <= hi for lo, hi in windows):  # (one kernel's deferral at a time)
                skipped.append(f"{var.name}: its rotations interleave with another norm's")
                continue
            windows.append((first, at))
            out[var] = (fused, ropes, outs, at)
        return out, skipped


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    """Leaves out each matched norm and its rotations' bindings and emits the fused kernel at the last rotation's sum
    (the norm's output was read only there); what reads a rotation's result before then is emitted after it, in its
    order (``_Finder.found`` checked that the last rotation is not computed from any of it)."""

    def __init__(self, mod, graph, found: dict, kernel) -> None:
        super().__init__(mod)
        self.g, self.kernel = graph, kernel
        self.skip, self.at, self.made_at = set(), {}, {}
        self.pending, self.deferred = set(), []  # rotations not emitted yet, and what read them before their kernel
        for var, (fused, ropes, outs, at) in found.items():
            at_var = self.g.bindings[at].var
            self.skip.update(outs)
            self.skip.update(v for r in ropes for v in r.chain)
            self.skip.update(r.final for r in ropes)
            self.at[at_var] = (var, fused, ropes, outs)
            self.made_at.update({r.final: at_var for r in ropes})

    def visit_var_binding_(self, binding) -> None:
        var = binding.var
        if var in self.at:  # the kernel, then what waited for it (windows never overlap: nothing else waits)
            self._fuse(*self.at.pop(var))
            self.pending.clear()
            deferred, self.deferred = self.deferred, []
            for b in deferred:
                super().visit_var_binding_(b)
        if var in self.skip:
            if self.made_at.get(var) in self.at:  # a rotation bound before its kernel runs
                self.pending.add(var)
            return
        if self.pending and any(v in self.pending for v in relax.analysis.free_vars(binding.value)):
            self.pending.add(var)
            self.deferred.append(binding)
            return
        super().visit_var_binding_(binding)

    def _fuse(self, norm, fused, ropes, outs) -> None:
        r0 = ropes[0]
        cs, sn = (self.builder_.emit(relax.op.reshape(self.visit_expr(t), [r0.tokens, r0.head])) for t in (r0.cos, r0.sin))
        args = [self.visit_expr(a) for a in self.g.value[norm].args[1].fields]
        pair = len(args) == 4  # (x1, w1, x2, w2) or (x, w)
        out_ty = [relax.TensorType([shape_of(o)[0], fused.hidden], fused.out_dtype) for o in outs]
        new = self.builder_.emit(relax.call_tir(self.kernel(fused), args + [cs, sn], out_ty=out_ty if pair else out_ty[0]))
        for i, r in enumerate(ropes):
            y = self.builder_.emit(relax.TupleGetItem(new, i)) if pair else new
            self.set_var_remap(r.final, self.builder_.emit(relax.op.reshape(y, shape_of(r.final))))


@tvm.transform.module_pass(opt_level=0, name="FuseRoPEIntoNorm")
class FuseRoPEIntoNorm:
    """Fuse the rotary embedding after each Q- / K-norm (or pair of them) into the norm's kernel.

    Parameters
    ----------
    norms : moec.passes.rms_norm.InsertRMSNorm
        The pass that made the norm kernels (its ``kernels``: spec -> function name).
    target : tvm.target.Target
    source : str
        Model name for messages.
    """

    def __init__(self, norms, target: tvm.target.Target, source: str = "model") -> None:
        if not isinstance(target, tvm.target.Target):
            raise MoecError(f"FuseRoPEIntoNorm needs a tvm.target.Target, got {type(target).__name__}")
        self.norms, self.target, self.source = norms, target, source
        self.fused: dict[str, int] = {}
        self.skipped: dict[str, list[str]] = {}
        self.kernels: dict = {}

    def manifest(self) -> dict:
        return {"fused": dict(self.fused), "skipped": {k: v for k, v in self.skipped.items() if v},
                "kernels": {name: asdict(spec) for spec, name in self.kernels.items()}}

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        form = "cuda" if self.target.kind.name == "cuda" else "llvm"
        norm_specs = {name: spec for spec, name in self.norms.kernels.items()}
        kernels = KernelCache(lambda spec: make_rms_norm(spec, form), lambda spec: "rms_norm", self.kernels)
        out = mod
        for gv, func in num_input_entries(mod, "FuseRoPEIntoNorm", self.source):
            finder = _Finder(func, norm_specs)
            found, skipped = finder.found(form)
            self.fused[gv.name_hint] = sum(len(outs) for _, _, outs, _ in found.values())
            self.skipped[gv.name_hint] = skipped
            if not found:
                continue
            rewriter = _Rewriter(out, finder.g, found, None)
            rewriter.kernel = lambda spec, b=rewriter.builder_: kernels.get(b, spec)
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
            out = rewriter.builder_.get()
        return out


__all__ = ["FuseRoPEIntoNorm"]
