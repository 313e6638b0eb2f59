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
they are, and ``skipped`` says why for those with a transposed weight.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.sym.analyzer import Analyzer

from ..compiler.errors import MoecError
from ..compiler.graph import DataflowGraph, KernelCache, dtype_of, num_input_entries, prod, shape_of
from ..schedules.kernels.dense_gemm import DenseSpec, compiled_spec, eligible, make_dense



def _match(g: DataflowGraph, mv):
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
    spec = compiled_spec(int(n), int(k), x_dtype=dtype_of(x), w_dtype=dtype_of(w), out_dtype=dtype_of(mv))
    why = eligible(spec)
    if why is not None or spec.out_dtype not in ("float32", "float16", "bfloat16"):
        return None, f"matmul {mv.name} (weight {w.name}): {why or 'output dtype ' + spec.out_dtype}"
    return (x, w, spec), None


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod, matches: dict, kernel) -> None:
        super().__init__(mod)
        self.matches = matches  # matmul var -> (x, W, spec)
        self.kernel = kernel

    def visit_var_binding_(self, binding) -> None:
        m = self.matches.get(binding.var)
        if m is None:
            super().visit_var_binding_(binding)
            return
        x, w, spec = m
        bb = self.builder_
        xs = shape_of(x)
        rows = prod(xs[:-1])
        rows = rows if isinstance(rows, int) else Analyzer().simplify(rows)
        x2 = self.visit_expr(x)
        if len(xs) != 2:
            x2 = bb.emit(relax.op.reshape(x2, [rows, spec.in_features]))
        y = bb.emit(relax.call_tir(self.kernel(spec), [x2, self.visit_expr(w)],
                                   out_ty=relax.TensorType([rows, spec.out_features], spec.out_dtype)))
        if len(xs) != 2:
            y = bb.emit(relax.op.reshape(y, list(xs[:-1]) + [spec.out_features]))
        self.set_var_remap(binding.var, y)


@tvm.transform.module_pass(opt_level=0, name="InsertDenseGEMM")
class InsertDenseGEMM:
    """Replace each linear layer (matmul against a transposed 16-bit weight) with the ``dense_gemm`` kernel.

    Parameters
    ----------
    target : tvm.target.Target
        Picks the kernel form: tensor cores for ``cuda`` targets, the serial llvm form otherwise.
    source : str
        Model name for messages.
    """

    def __init__(self, target: tvm.target.Target, source: str = "model") -> None:
        if not isinstance(target, tvm.target.Target):
            raise MoecError(f"InsertDenseGEMM needs a tvm.target.Target, got {type(target).__name__}")
        self.target, self.source = target, source
        self.replaced: dict[str, int] = {}
        self.skipped: dict[str, list[str]] = {}
        self.kernels: dict[DenseSpec, str] = {}

    def manifest(self) -> dict:
        return {"replaced": dict(self.replaced), "skipped": {k: list(v) for k, v in self.skipped.items()},
                "kernels": sorted(set(self.kernels.values()))}

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        form = "cuda" if self.target.kind.name == "cuda" else "llvm"
        kernels = KernelCache(lambda spec: make_dense(spec, form), lambda spec: "dense_gemm", self.kernels)
        out = mod
        for gv, func in num_input_entries(mod, "InsertDenseGEMM", self.source):
            g = DataflowGraph(func, int(func.attrs["num_input"]))
            matches, skipped = {}, []
            for mv in g.calls_of("relax.matmul"):
                match, why = _match(g, mv)
                if match is not None:
                    matches[mv] = match
                elif why is not None:
                    skipped.append(why)
            self.replaced[gv.name_hint] = len(matches)
            self.skipped[gv.name_hint] = skipped
            if not matches:
                continue
            rewriter = _Rewriter(out, matches, None)
            rewriter.kernel = lambda spec, b=rewriter.builder_: kernels.get(b, spec)
            new_func = rewriter.visit_expr(func)
            rewriter.builder_.update_func(gv, new_func)
            out = rewriter.builder_.get()
        return out


__all__ = ["InsertDenseGEMM"]
