"""A read-only view of a Relax function's dataflow for structural matching.

Bindings are indexed by variable; helpers walk producers through layout-only ops
(reshape, permute_dims, broadcast_to, expand_dims, squeeze, astype) so that matching does
not depend on how a particular exporter shuffled axes.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import tvm
from tvm import relax
from tvm.ir.prim.expr import IntImm

from .errors import MoecError

LAYOUT_OPS = frozenset(
    {"relax.reshape", "relax.permute_dims", "relax.broadcast_to", "relax.expand_dims", "relax.squeeze", "relax.astype"}
)


def op_name(expr) -> str | None:
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return None


def const_scalar(expr) -> float | None:
    """The value of a scalar (or one-element) constant, else None."""
    if isinstance(expr, tvm.ir.GenericConst):
        arr = expr.value.numpy()
        if arr.size == 1:
            return float(arr.reshape(-1)[0])
    return None


class DataflowGraph:
    """Bindings of ``func`` by variable, with users and binding order."""

    def __init__(self, func: relax.Function, num_inputs: int) -> None:
        self.func = func
        self.inputs = list(func.params)[:num_inputs]
        self.weights = list(func.params)[num_inputs:]
        self.weight_set = set(self.weights)
        self.value: dict[relax.Var, relax.Expr] = {}
        self.order: dict[relax.Var, int] = {}
        self.users: dict[relax.Var, list[relax.Var]] = defaultdict(list)
        self.bindings: list[relax.VarBinding] = []
        for block in func.body.blocks:
            for binding in block.bindings:
                if not isinstance(binding, relax.VarBinding):
                    continue
                self.order[binding.var] = len(self.bindings)
                self.bindings.append(binding)
                self.value[binding.var] = binding.value
                for arg in self._var_args(binding.value):
                    self.users[arg].append(binding.var)

    @staticmethod
    def _var_args(value) -> list[relax.Var]:
        out = []
        if isinstance(value, relax.Call):
            items = list(value.args)
        elif isinstance(value, relax.Tuple):
            items = list(value.fields)
        elif isinstance(value, relax.TupleGetItem):
            items = [value.tuple_value]
        else:
            items = []
        for item in items:
            if isinstance(item, relax.Var):
                out.append(item)
            elif isinstance(item, relax.Tuple):
                out.extend(f for f in item.fields if isinstance(f, relax.Var))
        return out

    # ---------------------------------------------------------------- queries
    def op(self, var) -> str | None:
        return op_name(self.value.get(var))

    def call(self, var) -> relax.Call | None:
        v = self.value.get(var)
        return v if isinstance(v, relax.Call) else None

    def calls_of(self, name: str) -> list[relax.Var]:
        return [b.var for b in self.bindings if op_name(b.value) == name]

    def alias(self, expr):
        """``expr`` followed through alias bindings (``y = x``) to the variable that holds the value."""
        while isinstance(expr, relax.Var) and isinstance(self.value.get(expr), relax.Var):
            expr = self.value[expr]
        return expr

    def strip(self, expr, ops=LAYOUT_OPS):
        """Follow producers through ``ops`` (first argument) and return the first other expr."""
        while isinstance(expr, relax.Var):
            value = self.value.get(expr)
            if isinstance(value, relax.Var):  # alias binding (e.g. the dataflow output)
                expr = value
            elif self.op(expr) in ops:
                expr = value.args[0]
            else:
                break
        return expr

    def weight_of(self, expr) -> relax.Var | None:
        base = self.strip(expr)
        return base if base in self.weight_set else None

    def weight_index(self, weight: relax.Var) -> int:
        return self.weights.index(weight)

    def descendants_ops(self, var, max_depth: int = 8) -> set[str]:
        seen, frontier, ops = {var}, [var], set()
        for _ in range(max_depth):
            nxt = []
            for v in frontier:
                for u in self.users.get(v, []):
                    if u not in seen:
                        seen.add(u)
                        ops.add(self.op(u) or type(self.value[u]).__name__)
                        nxt.append(u)
            frontier = nxt
        return ops

    def ancestors(self, var, stop=lambda v: False) -> set:
        seen, stack = set(), [var]
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if stop(v) or v not in self.value:
                continue
            stack.extend(self._var_args(self.value[v]))
        return seen



def shape_of(expr) -> tuple | None:
    """Shape of a tensor-typed expr: ints for static dims, PrimExprs for symbolic ones."""
    shape = getattr(getattr(expr, "ty", None), "shape", None)
    if shape is None:
        return None
    dims = shape.values if hasattr(shape, "values") else shape
    return tuple(int(d.value) if isinstance(d, IntImm) else d for d in dims)


def prod(dims):
    """Product of dims, static (int) or symbolic (PrimExpr): an int when all are static."""
    out = 1
    for d in dims:
        out = out * d
    return out


def dtype_of(expr) -> str | None:
    dtype = getattr(getattr(expr, "ty", None), "dtype", None)
    return str(dtype) if dtype is not None else None


def is_static(dim) -> bool:
    return isinstance(dim, (int, np.integer))


def same_dim(a, b) -> bool:
    """Two dims equal: static ones (ints or IntImms) by value, symbolic ones structurally; a static dim never
    equals a symbolic one (a plain bool, never a TIR comparison)."""
    a, b = (int(d.value) if isinstance(d, IntImm) else d for d in (a, b))
    if is_static(a) or is_static(b):
        return is_static(a) and is_static(b) and bool(a == b)
    import tvm_ffi

    return bool(tvm_ffi.structural_equal(a, b))


def same_shape(a, b) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(same_dim(x, y) for x, y in zip(a, b))


def materialize(rewriter, g, position: int, expr):
    """``expr`` (static: weights, constants, layout ops, bound anywhere in ``g``'s function) usable at binding
    ``position`` of the ``rewriter`` (a ``PyExprMutator``): visited if bound before it, else its computation is
    emitted again here."""
    if not isinstance(expr, relax.Var) or expr not in g.value or g.order[expr] < position:
        return rewriter.visit_expr(expr)
    value = g.value[expr]
    if isinstance(value, relax.Var):
        return materialize(rewriter, g, position, value)
    args = [materialize(rewriter, g, position, a) for a in value.args]
    return rewriter.builder_.emit(relax.Call(value.op, args, value.attrs, value.ty_args))


def num_input_entries(mod, pass_name: str, source: str = "model") -> list:
    """``(GlobalVar, Function)`` of every Relax function with a ``num_input`` attribute (model inputs
    first, then the weights), by name; a ``MoecError`` naming ``pass_name`` if there is none."""
    entries = [(gv, f) for gv, f in mod.functions_items() if isinstance(f, relax.Function) and f.attrs is not None
               and "num_input" in f.attrs]
    if not entries:
        raise MoecError(f"{source}: {pass_name} rewrites functions with a num_input attribute (model inputs first, "
                        "then the weights), such as the entries InsertPagedKVAttention / InsertTieredKVAttention "
                        "build; the module has none")
    return sorted(entries, key=lambda e: e[0].name_hint)


OPAQUE = 8  # OpPatternKind kOpaque: FuseOps leaves a hand-written kernel alone


class KernelCache:
    """Hand-written PrimFuncs added to a module once per key, marked opaque to FuseOps, across the entries a
    pass rewrites one BlockBuilder at a time. ``make(key)`` builds the PrimFunc, ``name(key)`` its name hint;
    ``names`` (a dict the pass may own) maps each key to the name the module gave it."""

    def __init__(self, make, name, names: dict | None = None) -> None:
        self.make, self.name = make, name
        self.gvars: dict = {}
        self.names = {} if names is None else names

    def get(self, builder, key):
        if key not in self.gvars:
            prim = self.make(key).without_attr("global_symbol").with_attr("op_pattern", OPAQUE)
            self.gvars[key] = builder.add_func(prim, self.name(key))
            self.names[key] = self.gvars[key].name_hint
        return self.gvars[key]
