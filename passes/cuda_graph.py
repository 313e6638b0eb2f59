"""CUDA graphs for the decode step: a ``decode_graph`` entry whose kernel launches replay as CUDA graphs.

A decode step of a many-layer model launches hundreds of small kernels, and the Relax VM makes a few
builtin calls (shapes, allocations, reshapes) around each; once the kernels are fast, that host work
sets the step time. TVM's ``relax.transform.RewriteCUDAGraph`` lifts runs of kernel launches whose
buffers all sit at fixed addresses into functions that ``vm.builtin.cuda_graph.run_or_capture``
captures once per key (the index of the region and the values of the symbolic sizes it uses) and
replays afterwards. Two passes prepare ``decode`` for it and apply it to a copy, so that the
artifact keeps the plain ``decode`` (steps beyond the declared bounds, and runs with graphs off):

``PrepareDecodeGraph`` (start of phase 4: scheduled PrimFuncs, entries in dataflow form, CUDA target)
  adds ``decode_graph(<decode's parameters>)``, a copy of ``decode`` with
  * (tiered cache) a staging kernel, ``stage_decode_inputs``: one launch copies the step's inputs
    (token ids, positions, slots, page tables) into buffers of the function's own memory, and every
    use reads the copies, so that the layers' kernels touch only fixed addresses;
  * ``tir_var_upper_bound``: the step's symbolic sizes bounded by the declared ``GraphBounds``
    (tokens and rows by ``max_batch``, page-table widths by ``max_context``), so that
    ``StaticPlanBlockMemory`` gives every intermediate a storage of constant size;
  * ``relax.rewrite_cuda_graph.capture_symbolic_vars``: those sizes may vary; each distinct set of
    values is captured as its own graph.

With the greedy sampler's ``argmax`` entry in the module it also adds ``decode_graph_greedy``, the same
copy with the argmax kernel applied to the logits, returning each row's greedy token ``[1, N]`` (the
token dtype) in place of the logits: a greedy step then copies no logits out of the graphs' memory
(the returned logits are a new tensor every step, a copy of 128 x 50,304 float32 at the headline
point) and makes no second VM call for the argmax.

``RewriteDecodeGraph`` (right after ``StaticPlanBlockMemory``) runs ``RewriteCUDAGraph`` on
``decode_graph`` (and ``decode_graph_greedy``) alone, the tiered cache's pools counted as fixed, like
the weights: the engine creates them once and passes the same tensors on every step. Guarantees
after: each graph entry gets its planned storages from ``vm.builtin.cuda_graph.get_cached_alloc``
(the function ``cuda_graph_alloc``, run once; ``RewriteCUDAGraph`` merges the two entries' storages
into one set, since they never run at the same time) and runs each captured region,
``<entry>_cuda_graph_capture*``, through ``vm.builtin.cuda_graph.run_or_capture``; ``decode`` and the
other entries are unchanged.

What stays outside the graphs: the staging kernel (its inputs are new tensors every step), the
kernel writing the returned logits or tokens (a new tensor every step: outputs are never planned), and with
TVM's paged cache each layer's attention (``vm.builtin.attention_kv_cache_*`` packed functions of
the cache object, which the rewrite never captures) and the first kernel reading the cache's query
positions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

from ..compiler.errors import MoecError

GRAPH_ENTRY = "decode_graph"
GREEDY_ENTRY = "decode_graph_greedy"
CAPTURE_PREFIX = GRAPH_ENTRY + "_cuda_graph_capture"
ALLOC_FUNC = "cuda_graph_alloc"
STAGE_KERNEL = "stage_decode_inputs"
RUN_OR_CAPTURE = "vm.builtin.cuda_graph.run_or_capture"
GET_CACHED_ALLOC = "vm.builtin.cuda_graph.get_cached_alloc"
# the tiered decode's per-step inputs, in signature order (input_ids, then tiered_kv_attention.CACHE_ARGS)
TIERED_STEP_INPUTS = ("input_ids", "q_pos", "slots", "q_row", "q_t1", "q_indptr", "t1_table", "t2_table", "t2_np")
_THREADS = 256


@dataclass(frozen=True)
class GraphBounds:
    """The largest decode step the graphs serve; memory is planned for it.

    ``max_batch``: streams decoded in one step; ``max_context``: tokens of one stream (it bounds the
    tiered cache's page-table widths). The runtime runs a step beyond either with the plain ``decode``.
    """

    max_batch: int = 128
    max_context: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_context"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise MoecError(f"CUDA graph bound {name} must be a positive integer, got {v!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def table_widths(bounds: GraphBounds, t1_page: int, t2_page: int) -> tuple[int, int]:
    """Upper bounds of the tiered page tables' widths: tier-1 and tier-2 pages of one stream."""
    return max(1, -(-bounds.max_context // t1_page)), max(1, bounds.max_context // t2_page)


def _stage_kernel():
    """``stage_decode_inputs(<the 9 step inputs>, <9 outputs of the same shapes>)``: one CUDA launch, one
    thread per element of the largest input, copies every tiered decode step input."""
    NT = _THREADS

    @T.prim_func
    def stage_decode_inputs(a_ids: T.handle, a_pos: T.handle, a_slots: T.handle, a_row: T.handle, a_t1: T.handle,
                            a_indptr: T.handle, a_t1t: T.handle, a_t2t: T.handle, a_t2np: T.handle,
                            b_ids: T.handle, b_pos: T.handle, b_slots: T.handle, b_row: T.handle, b_t1: T.handle,
                            b_indptr: T.handle, b_t1t: T.handle, b_t2t: T.handle, b_t2np: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        seq = T.int64()
        rows = T.int64()
        w1 = T.int64()
        w2 = T.int64()
        ids = T.match_buffer(a_ids, (1, seq), "int64")
        pos = T.match_buffer(a_pos, (seq,), "int32")
        slots = T.match_buffer(a_slots, (seq,), "int32")
        row = T.match_buffer(a_row, (seq,), "int32")
        t1 = T.match_buffer(a_t1, (seq,), "int32")
        indptr = T.match_buffer(a_indptr, (rows + 1,), "int32")
        t1t = T.match_buffer(a_t1t, (rows, w1), "int32")
        t2t = T.match_buffer(a_t2t, (rows, w2), "int32")
        t2np = T.match_buffer(a_t2np, (rows,), "int32")
        ids_o = T.match_buffer(b_ids, (1, seq), "int64")
        pos_o = T.match_buffer(b_pos, (seq,), "int32")
        slots_o = T.match_buffer(b_slots, (seq,), "int32")
        row_o = T.match_buffer(b_row, (seq,), "int32")
        t1_o = T.match_buffer(b_t1, (seq,), "int32")
        indptr_o = T.match_buffer(b_indptr, (rows + 1,), "int32")
        t1t_o = T.match_buffer(b_t1t, (rows, w1), "int32")
        t2t_o = T.match_buffer(b_t2t, (rows, w2), "int32")
        t2np_o = T.match_buffer(b_t2np, (rows,), "int32")
        for bx in T.thread_binding(T.ceildiv(T.max(T.max(seq, rows + 1), T.max(rows * w1, rows * w2)), NT), thread="blockIdx.x"):
            for tx in T.thread_binding(T.int64(NT), thread="threadIdx.x"):
                i = bx * NT + tx
                if i < seq:
                    ids_o[0, i] = ids[0, i]
                    pos_o[i] = pos[i]
                    slots_o[i] = slots[i]
                    row_o[i] = row[i]
                    t1_o[i] = t1[i]
                if i < rows + 1:
                    indptr_o[i] = indptr[i]
                if i < rows:
                    t2np_o[i] = t2np[i]
                if i < rows * w1:
                    t1t_o[i // w1, i % w1] = t1t[i // w1, i % w1]
                if i < rows * w2:
                    t2t_o[i // w2, i % w2] = t2t[i // w2, i % w2]

    return stage_decode_inputs


def _dim(param: relax.Var, axis: int, source: str) -> tirx.Var:
    shape = param.ty.shape.values if isinstance(param.ty, relax.TensorType) and param.ty.shape is not None else None
    if shape is None or len(shape) <= axis or not isinstance(shape[axis], tirx.Var):
        raise MoecError(f"{source}: CUDA graphs: decode parameter {param.name} has no symbolic size on axis {axis} ({param.ty})")
    return shape[axis]


def _step_layout(decode: relax.Function, tiered: bool, bounds: GraphBounds, pages, source: str):
    """(per-step parameters, {size var name: upper bound}) of ``decode``."""
    params = list(decode.params)
    num_input = int(decode.attrs["num_input"])
    if not tiered:
        step = params[:num_input]  # input_ids, kv_cache
        return step, {_dim(params[0], 1, source).name: bounds.max_batch}
    names = [p.name for p in params[: len(TIERED_STEP_INPUTS)]]
    if tuple(names) != TIERED_STEP_INPUTS:
        raise MoecError(f"{source}: CUDA graphs: unexpected tiered decode parameters {names}, expected {list(TIERED_STEP_INPUTS)}")
    by = dict(zip(names, params))
    w1, w2 = table_widths(bounds, *pages)
    upper = {_dim(by["input_ids"], 1, source).name: bounds.max_batch, _dim(by["t2_np"], 0, source).name: bounds.max_batch,
             _dim(by["t1_table"], 1, source).name: w1, _dim(by["t2_table"], 1, source).name: w2}
    return params[: len(TIERED_STEP_INPUTS)], upper


@tvm.transform.module_pass(opt_level=0, name="PrepareDecodeGraph")
class PrepareDecodeGraph:
    """Add ``decode_graph``: ``decode`` with staged inputs and bounded sizes (see the module docstring).

    ``tiered_pages`` = (t1_page, t2_page) for the tiered cache's decode, None for TVM's paged cache.
    """

    def __init__(self, bounds: GraphBounds, tiered_pages: tuple[int, int] | None, source: str = "model") -> None:
        self.bounds, self.pages, self.source = bounds, tiered_pages, source

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        names = [gv.name_hint for gv in mod.get_global_vars()]
        if "decode" not in names:
            raise MoecError(f"{self.source}: CUDA graphs need the decode entry")
        if GRAPH_ENTRY in names:
            raise MoecError(f"{self.source}: the module already has {GRAPH_ENTRY}")
        tiered = self.pages is not None
        func = relax.utils.copy_with_new_vars(mod["decode"])
        step, upper = _step_layout(func, tiered, self.bounds, self.pages, self.source)
        attrs = {k: v for k, v in func.attrs.items() if k != "global_symbol"} if func.attrs is not None else {}
        attrs["tir_var_upper_bound"] = {k: tirx.IntImm("int64", v) for k, v in upper.items()}
        attrs["relax.rewrite_cuda_graph.capture_symbolic_vars"] = sorted(upper)
        bb = relax.BlockBuilder(mod)
        if tiered:
            stage = bb.add_func(_stage_kernel(), STAGE_KERNEL)
            fresh = [relax.Var(p.name, p.ty) for p in step]
            copies = relax.Var("staged", relax.TupleType([p.ty for p in step]))
            bindings = [relax.VarBinding(copies, relax.call_tir(stage, relax.Tuple(fresh), out_ty=[p.ty for p in step]))]
            staged = []
            for i, p in enumerate(step):
                v = relax.Var(f"{p.name}_staged", p.ty)
                bindings.append(relax.VarBinding(v, relax.TupleGetItem(copies, i)))
                staged.append(v)
            inner = func.bind_params(dict(zip(step, staged)))  # decode's body reads the copies
            body = relax.SeqExpr([relax.BindingBlock(bindings)] + list(inner.body.blocks), inner.body.body)
            func = relax.Function(fresh + list(inner.params), body, inner.ret_ty, inner.is_pure)
        argmax = _argmax_kernel(mod)
        if argmax is not None:
            if GREEDY_ENTRY in names:
                raise MoecError(f"{self.source}: the module already has {GREEDY_ENTRY}")
            greedy = _greedy(relax.utils.copy_with_new_vars(func), *argmax, self.source)
            bb.add_func(_bind_returned_tuple(greedy).with_attrs(attrs), GREEDY_ENTRY)
        bb.add_func(_bind_returned_tuple(func).with_attrs(attrs), GRAPH_ENTRY)
        return relax.transform.Normalize()(bb.get())


def _bind_returned_tuple(func: relax.Function) -> relax.Function:
    """Bind a returned tuple to a variable: RewriteCUDAGraph exports a lifted value only when a binding outside its
    region uses it, so the updated pools (aliases made inside a region) would be left undefined in a bare return."""
    if not isinstance(func.body.body, relax.Tuple):
        return func
    out = relax.Var("outputs", func.body.body.ty)
    body = relax.SeqExpr(list(func.body.blocks) + [relax.BindingBlock([relax.VarBinding(out, func.body.body)])], out)
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)


def _argmax_kernel(mod: tvm.IRModule):
    """(kernel GlobalVar, token dtype) of the greedy sampler's ``argmax`` entry (its one ``call_tir``), or None."""
    from .device_sampling import ENTRY

    if ENTRY not in [gv.name_hint for gv in mod.get_global_vars()]:
        return None
    calls = []
    relax.analysis.post_order_visit(mod[ENTRY].body, lambda e: calls.append(e) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.call_tir" else None)
    if len(calls) != 1:
        return None
    return calls[0].args[0], calls[0].ty.dtype


def _greedy(func: relax.Function, kernel: relax.GlobalVar, dtype: str, source: str) -> relax.Function:
    """``func`` (a copy of ``decode``) returning each row's greedy token ``[1, N]`` in place of its logits ``[1, N, V]``."""
    ret = func.body.body
    rest = list(ret.fields[1:]) if isinstance(ret, relax.Tuple) else []
    logits = ret.fields[0] if isinstance(ret, relax.Tuple) else ret
    shape = logits.ty.shape.values if isinstance(logits.ty, relax.TensorType) and logits.ty.shape is not None else None
    if shape is None or len(shape) != 3:
        raise MoecError(f"{source}: CUDA graphs: decode returns {logits.ty}, not logits [1, N, V]")
    tokens = relax.Var("greedy_tokens", relax.TensorType((1, shape[1]), dtype))
    call = relax.call_tir(kernel, [logits], out_ty=relax.TensorType((1, shape[1]), dtype))
    out = relax.Tuple([tokens] + rest) if rest else tokens
    ret_ty = relax.TupleType([tokens.ty] + [f.ty for f in rest]) if rest else tokens.ty
    body = relax.SeqExpr(list(func.body.blocks) + [relax.BindingBlock([relax.VarBinding(tokens, call)])], out)
    return relax.Function(func.params, body, ret_ty, func.is_pure, func.attrs)


@tvm.transform.module_pass(opt_level=0, name="RewriteDecodeGraph")
class RewriteDecodeGraph:
    """``relax.transform.RewriteCUDAGraph`` on ``decode_graph`` (and ``decode_graph_greedy``) alone, the tiered pools
    counted as fixed."""

    def __init__(self, tiered: bool) -> None:
        self.tiered = tiered
        self.summary = None  # graph_summary of the final module (pipeline.py records it at the end of phase 4)
        self.greedy = False  # whether the final module has decode_graph_greedy

    def record(self, mod: tvm.IRModule) -> None:
        self.summary = graph_summary(mod)
        self.greedy = GREEDY_ENTRY in [gv.name_hint for gv in mod.get_global_vars()]

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        entries = [gv for gv in mod.get_global_vars() if gv.name_hint in (GRAPH_ENTRY, GREEDY_ENTRY)]
        num_input = {gv: mod[gv].attrs["num_input"] for gv in entries}
        others = {g: f for g, f in mod.functions_items() if isinstance(f, relax.Function) and g not in num_input}
        sub = tvm.IRModule({g: f for g, f in mod.functions_items() if g in num_input or not isinstance(f, relax.Function)},
                           attrs=mod.attrs)
        for gv in entries:
            # parameters from index num_input on are fixed for the rewrite (same tensors every call): the weights,
            # and the tiered cache's pools (the engine's, created once); the step inputs before them are not
            fixed_from = len(TIERED_STEP_INPUTS) if self.tiered else int(num_input[gv])
            sub[gv] = _isolate_branches(mod[gv]).with_attr("num_input", fixed_from)
        with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": True}):
            out = relax.transform.RewriteCUDAGraph()(sub)
        for gv in entries:
            out[gv] = out[gv].with_attr("num_input", num_input[gv])
        for g, f in others.items():
            out[g] = f
        return out


def _isolate_branches(func: relax.Function) -> relax.Function:
    """Each ``R.If`` binding (tuned kernels' dispatch) in a block of its own: the rewrite grows a region within a block
    and would otherwise carry it over the branch, launching later kernels before the branch's ones (whose storage the
    planner may have given to them)."""
    blocks = []
    for block in func.body.blocks:
        run = []
        for b in block.bindings:
            if isinstance(b, relax.VarBinding) and isinstance(b.value, relax.If):
                blocks += [relax.BindingBlock(run)] * bool(run) + [relax.BindingBlock([b])]
                run = []
            else:
                run.append(b)
        if run or not block.bindings:
            blocks.append(type(block)(run))
    body = relax.SeqExpr(blocks, func.body.body)
    relax.expr._update_type(body, func.body.ty)  # not normalized: the normalizer would merge the blocks again
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)


def graph_summary(mod: tvm.IRModule) -> dict:
    """Kernel launches of one ``decode_graph`` call inside captured regions and outside them, by kernel name.

    Counts the calls of device PrimFuncs in ``decode_graph`` and in the capture function of each of its
    ``run_or_capture`` calls (each runs once per step; identical regions share one lifted function):
    ``{"captured_regions", "capture_functions", "inside", "outside", "inside_kernels", "outside_kernels",
    "outside_builtins", "planned_bytes"}``.
    """
    prims = {gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)
             and not (f.attrs is not None and f.attrs.get("tirx.is_host_func", False))}  # not the VM's host shape functions

    def calls(func):
        found = []

        def visit(e):
            if isinstance(e, relax.Call):
                if isinstance(e.op, relax.GlobalVar) and e.op.name_hint in prims:
                    found.append(("kernel", e.op.name_hint))
                elif isinstance(e.op, relax.ExternFunc):
                    found.append(("builtin", str(e.op.global_symbol)))
                elif isinstance(e.op, tvm.ir.Op) and e.op.name in ("relax.call_builtin_with_ctx", "relax.call_packed"):
                    first = e.args[0]
                    if isinstance(first, relax.ExternFunc):
                        found.append(("builtin", str(first.global_symbol)))
                        if str(first.global_symbol) == RUN_OR_CAPTURE:
                            found.append(("region", e.args[1].fields[0].name_hint))

        relax.analysis.post_order_visit(func.body, visit)
        return found

    outer = calls(mod[GRAPH_ENTRY])
    regions = [name for kind, name in outer if kind == "region"]
    inside = [name for r in regions for kind, name in calls(mod[r]) if kind == "kernel"]
    outside = [name for kind, name in outer if kind == "kernel"]
    builtins = [name for kind, name in outer if kind == "builtin"]
    count = lambda xs: {k: xs.count(k) for k in sorted(set(xs))}  # noqa: E731
    planned = 0  # bytes of the storages the graphs use (allocated once, held while the engine lives)
    if any(gv.name_hint == ALLOC_FUNC for gv in mod.get_global_vars()):
        def storage(e):
            nonlocal planned
            if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name in ("relax.vm.alloc_storage",
                                                                                          "relax.memory.alloc_storage"):
                planned += int(e.args[0].values[0])

        relax.analysis.post_order_visit(mod[ALLOC_FUNC].body, storage)
    return {"captured_regions": len(regions), "capture_functions": len(set(regions)), "inside": len(inside), "outside": len(outside),
            "inside_kernels": count(inside), "outside_kernels": count(outside), "outside_builtins": count(builtins),
            "planned_bytes": planned}


__all__ = ["GraphBounds", "PrepareDecodeGraph", "RewriteDecodeGraph", "GRAPH_ENTRY", "GREEDY_ENTRY", "graph_summary", "table_widths"]
