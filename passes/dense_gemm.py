"""InsertDenseGEMM: linear layers against a weight stored [out, in] become ``dense_gemm`` kernels.

Expects entry functions (attribute ``num_input``: leading non-weight parameters, then the weights),
after the other phase-1 passes. In each entry it matches, by structure only, the form exports of
``nn.Linear`` take (torch.export: ``permute_dims(W)`` then ``matmul``)::

    wt = permute_dims(W, axes=[1, 0])            # W [N, K] a weight parameter
         (then broadcast_to([1, ..., K, N]) as a batched matmul's operand, or not)
    y  = matmul(x, wt, out_dtype=...)            # x [..., K] -> y [..., N]

with ``x`` and ``W`` of one 16-bit float dtype and the shapes ``schedules.kernels.dense_gemm.eligible``
takes (K a multiple of 64, N of 16). Guarantees after: each match is ``reshape(call_tir(dense_gemm,
[reshape(x, [M, K]), W]), [..., N])``; the transpose of the weight, which the imported graph would run on
every call, is gone (dead-code elimination), and the kernel reads W in its stored layout once per step
(CUDA: tensor cores). Results equal the matmul's up to the order of float32 sums. Other matmuls stay as
they are, and ``skipped`` says why for those with a transposed weight. With ``merge`` (the default), matches
that read the same input in one block (q, k and v) become one ``call_tir(dense_gemm_xN, [x, W1, .., WN])``
with N outputs (at most 3 a launch), emitted where the first of them was.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.sym.analyzer import Analyzer

from ..compiler.errors import MoecError
from ..compiler.graph import DataflowGraph, KernelCache, dtype_of, num_input_entries, prod, same_shape, shape_of
from ..schedules.kernels.dense_gemm import (WIDE_OUT_FEATURES, DenseSpec, compiled_spec, eligible, make_dense, make_dense_tiled,
                                            tiled_eligible, wgmma_arch)



def _match(g: DataflowGraph, mv, wgmma: bool = False, prefill: bool = False):
    """``((x, W, spec), None)`` for a linear layer the kernel takes; ``(None, why not)`` for one it does not;
    ``(None, None)`` for a matmul of another form."""
    call = g.call(mv)
    x, wt = (g.alias(a) for a in call.args)
    while g.op(wt) == "relax.broadcast_to" and all(d == 1 for d in shape_of(wt)[:-2]):  # a bmm's [1, K, N]
        wt = g.alias(g.call(wt).args[0])
    if g.op(wt) != "relax.permute_dims":
        return None, None  # not a linear layer's form: nothing to report
    pc = g.call(wt)
    w = g.alias(pc.args[0])
    if w not in g.weight_set:
        return None, None
    axes = pc.attrs.axes
    ws, xs = shape_of(w), shape_of(x)
    if ws is None or len(ws) != 2 or (axes is not None and [int(a) for a in axes] != [1, 0]):
        return None, f"matmul {mv.name}: weight {w.name} is not a 2-D matrix transposed [1, 0]"
    n, k = ws
    if xs is None or len(xs) < 2 or xs[-1] != k:
        return None, f"matmul {mv.name}: input {shape_of(x)} does not end in the weight's {k} input features"
    spec = compiled_spec(int(n), int(k), x_dtype=dtype_of(x), w_dtype=dtype_of(w), out_dtype=dtype_of(mv), wgmma=wgmma,
                         prefill=prefill)
    why = eligible(spec)
    if why is not None or spec.out_dtype not in ("float32", "float16", "bfloat16"):
        return None, f"matmul {mv.name} (weight {w.name}): {why or 'output dtype ' + spec.out_dtype}"
    return (x, w, spec), None


MAX_MERGED = 3  # linear layers of one input per launch (dense_gemm_x2 / _x3)


def _groups(g: DataflowGraph, matches: dict) -> list[list]:
    """Matched matmuls that read the same input with one (K, dtypes) in one binding block, in binding order,
    cut into runs of at most ``MAX_MERGED`` (a model's q, k and v projections: one run of three)."""
    block_of = {b.var: i for i, block in enumerate(g.func.body.blocks) for b in block.bindings}
    by_key: dict = {}
    for mv in sorted(matches, key=lambda v: g.order[v]):
        x, _, spec = matches[mv]
        base = x  # exports reshape the input once per linear layer: the same value if the same base and shape
        while g.op(base) == "relax.reshape":
            base = g.alias(g.call(base).args[0])
        key = (base, block_of.get(mv), spec.in_features, spec.x_dtype, spec.w_dtype, spec.out_dtype)
        runs = by_key.setdefault(key, [])
        run = next((r for r in runs if same_shape(shape_of(matches[r[0]][0]), shape_of(x))), None)
        if run is None:
            runs.append([mv])
        else:
            run.append(mv)
    by_key = {(k, i): run for k, runs in by_key.items() for i, run in enumerate(runs)}
    out = []
    for mvs in by_key.values():
        out += [mvs[i:i + MAX_MERGED] for i in range(0, len(mvs), MAX_MERGED) if len(mvs[i:i + MAX_MERGED]) > 1]
    return out


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod, matches: dict, kernel, groups: list | None = None, wgmma: bool = False,
                 prefill: bool = False) -> None:
        super().__init__(mod)
        self.wgmma, self.prefill = wgmma, prefill
        self.matches = matches  # matmul var -> (x, W, spec)
        self.kernel = kernel  # (spec, parts or None, tiled) -> kernel GlobalVar
        self.first = {mvs[0]: mvs for mvs in groups or []}  # a merged run, emitted at its first matmul
        self.merged = {mv for mvs in groups or [] for mv in mvs[1:]}  # the others: their values come from the run
        self.tiled: set = set()  # matmul vars taking the block-tiled kernel (the prefill's, ``prefill_tiled``)

    def _rows(self, x, k):
        xs = shape_of(x)
        rows = prod(xs[:-1])
        rows = rows if isinstance(rows, int) else Analyzer().simplify(rows)
        x2 = self.visit_expr(x)
        if len(xs) != 2:
            x2 = self.builder_.emit(relax.op.reshape(x2, [rows, k]))
        return xs, rows, x2

    def _unflatten(self, y, xs, n):
        return self.builder_.emit(relax.op.reshape(y, list(xs[:-1]) + [n])) if len(xs) != 2 else y

    def visit_var_binding_(self, binding) -> None:
        if binding.var in self.merged:
            return  # computed by its run's kernel (var remapped there)
        m = self.matches.get(binding.var)
        if m is None:
            super().visit_var_binding_(binding)
            return
        x, w, spec = m
        bb = self.builder_
        xs, rows, x2 = self._rows(x, spec.in_features)
        if binding.var in self.first:
            run = self.first[binding.var]
            specs = [self.matches[mv][2] for mv in run]
            parts = tuple(sp.out_features for sp in specs)
            total = compiled_spec(sum(parts), spec.in_features, spec.x_dtype, spec.w_dtype, spec.out_dtype, self.wgmma, self.prefill)
            ys = bb.emit(relax.call_tir(self.kernel(total, parts, False), [x2] + [self.visit_expr(self.matches[mv][1]) for mv in run],
                                        out_ty=[relax.TensorType([rows, n], spec.out_dtype) for n in parts]))
            for i, (mv, n) in enumerate(zip(run, parts)):
                self.set_var_remap(mv, self._unflatten(bb.emit(relax.TupleGetItem(ys, i)), xs, n))
            return
        y = bb.emit(relax.call_tir(self.kernel(spec, None, binding.var in self.tiled), [x2, self.visit_expr(w)],
                                   out_ty=relax.TensorType([rows, spec.out_features], spec.out_dtype)))
        self.set_var_remap(binding.var, self._unflatten(y, xs, spec.out_features))


def _tiled_ok(spec: DenseSpec) -> bool:
    """Whether the prefill entry takes the block-tiled form for this layer (``InsertDenseGEMM(prefill_tiled=True)``)."""
    return spec.out_features < WIDE_OUT_FEATURES and tiled_eligible(spec.out_features, spec.in_features, spec.x_dtype) is None


def _make(key, form: str):
    spec, parts, tiled = key
    if tiled:
        return make_dense_tiled(spec.out_features, spec.in_features, spec.x_dtype, spec.out_dtype)
    return make_dense(spec, form, parts)


def _name(key) -> str:
    spec, parts, tiled = key
    return "dense_gemm_tiled" if tiled else "dense_gemm" if parts is None else f"dense_gemm_x{len(parts)}"


@tvm.transform.module_pass(opt_level=0, name="InsertDenseGEMM")
class InsertDenseGEMM:
    """Replace each linear layer (matmul against a transposed 16-bit weight) with the ``dense_gemm`` kernel.

    Parameters
    ----------
    target : tvm.target.Target
        Picks the kernel form: tensor cores for ``cuda`` targets, the serial llvm form otherwise.
    source : str
        Model name for messages.
    merge : bool
        Linear layers that read the same input (q, k and v; a dense MLP's gate and up) share one launch,
        ``dense_gemm_x2`` / ``dense_gemm_x3``, up to three at a time; the results are the separate kernels'
        bit for bit (each block runs the one-weight kernel's code on its rows). Default True.
    prefill_tiled : bool
        CUDA: in the prefill entry, each linear layer the block-tiled form takes (``tiled_eligible``; not LM heads,
        from WIDE_OUT_FEATURES outputs, which a prefill runs on a few gathered rows) becomes
        ``dense_gemm_tiled`` (128 tokens x 128 features a block, both operands in shared memory), one launch a
        layer (no merge); results equal up to the order of float32 sums.

    An sm_90a target (``--arch sm_90a``) takes the wgmma form (``DenseSpec.wgmma``: Hopper's warpgroup tensor-core
    instructions, in sm_90a's architecture-specific set only) for every linear layer, the prefill's too (faster than
    the tiled form there): ``compiled_spec(..., wgmma=True)`` gives its passes (one k split: the kernels' splits lost).
    """

    def __init__(self, target: tvm.target.Target, source: str = "model", merge: bool = True,
                 prefill_tiled: bool = False) -> None:
        if not isinstance(target, tvm.target.Target):
            raise MoecError(f"InsertDenseGEMM needs a tvm.target.Target, got {type(target).__name__}")
        self.target, self.source, self.merge = target, source, bool(merge)
        self.prefill_tiled = bool(prefill_tiled)
        self.tiled: dict[str, int] = {}
        self.replaced: dict[str, int] = {}
        self.merged: dict[str, list[int]] = {}
        self.skipped: dict[str, list[str]] = {}
        self.kernels: dict[tuple, str] = {}

    def manifest(self) -> dict:
        return {"replaced": dict(self.replaced), "merged": {k: list(v) for k, v in self.merged.items()},
                "tiled": dict(self.tiled),
                "skipped": {k: list(v) for k, v in self.skipped.items()}, "kernels": sorted(set(self.kernels.values()))}

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        form = "cuda" if self.target.kind.name == "cuda" else "llvm"
        wgmma = form == "cuda" and wgmma_arch(str(self.target.arch))
        kernels = KernelCache(lambda key: _make(key, form), _name, self.kernels)
        out = mod
        for gv, func in num_input_entries(mod, "InsertDenseGEMM", self.source):
            g = DataflowGraph(func, int(func.attrs["num_input"]))
            matches, skipped = {}, []
            for mv in g.calls_of("relax.matmul"):
                match, why = _match(g, mv, wgmma, gv.name_hint == "prefill")
                if match is not None:
                    matches[mv] = match
                elif why is not None:
                    skipped.append(why)
            self.replaced[gv.name_hint] = len(matches)
            self.skipped[gv.name_hint] = skipped
            if not matches:
                continue
            tiled = set()
            if form == "cuda" and self.prefill_tiled and gv.name_hint == "prefill" and not wgmma:
                tiled = {mv for mv, (_, _, sp) in matches.items() if _tiled_ok(sp)}
                self.tiled[gv.name_hint] = len(tiled)
            groups = _groups(g, {mv: m for mv, m in matches.items() if mv not in tiled}) if self.merge else []
            self.merged[gv.name_hint] = [len(run) for run in groups]
            rewriter = _Rewriter(out, matches, None, groups, wgmma, gv.name_hint == "prefill")
            rewriter.kernel = lambda spec, parts, tiled, b=rewriter.builder_: kernels.get(b, (spec, parts, tiled))
            rewriter.tiled = tiled
            new_func = rewriter.visit_expr(func)
            rewriter.builder_.update_func(gv, new_func)
            out = rewriter.builder_.get()
        return out


__all__ = ["InsertDenseGEMM"]
