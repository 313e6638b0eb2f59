"""PrepareDecodeGraph + RewriteDecodeGraph: the decode step's kernels inside captured regions (IR, CPU only),
the plain entries untouched, the llvm build unaffected; the runtime's table padding."""

import re

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import relax as R

from moec.compiler.errors import MoecError
from moec.compiler.importers import import_model
from moec.compiler.targets import make_target
from moec.passes.cuda_graph import (ALLOC_FUNC, CAPTURE_PREFIX, GET_CACHED_ALLOC, GRAPH_ENTRY, GREEDY_ENTRY, RUN_OR_CAPTURE,
                                    STAGE_KERNEL,
                                    GraphBounds, graph_summary, table_widths)
from moec.passes.dense_gemm import InsertDenseGEMM
from moec.passes.fuse_router_norm import FuseRouterIntoNorm
from moec.passes.grouped_experts import InsertGroupedExperts
from moec.passes.pipeline import moec_pipeline
from moec.passes.tiered_kv_attention import TieredOptions

BOUNDS = GraphBounds(max_batch=8, max_context=512)


def _lower(imported, kv_cache: str, cuda_graph):
    """Phases 1-4 of the default pipeline for sm_90 (no code generation): the module the VM is built from."""
    tgt = make_target("cuda", "sm_90")
    tiered = TieredOptions() if kv_cache == "tiered" else None
    pipeline, _ = moec_pipeline(imported.num_inputs, tgt, "tiny", tiered=tiered, fuse_router_norm=FuseRouterIntoNorm(tgt, "tiny"),
                                grouped_experts=InsertGroupedExperts(tgt, "tiny", None, None), dense_gemm=InsertDenseGEMM(tgt, "tiny"),
                                cuda_graph=cuda_graph)
    with tgt:
        return pipeline(imported.mod), pipeline


def _alpha(script: str) -> str:
    """``script`` with every name replaced by the order of its first appearance: equal for functions that are equal up
    to a consistent renaming (the VM numbers variables and its host shape functions module-wide)."""
    seen = {}
    return re.sub(r"\b[A-Za-z_]\w*\b", lambda m: seen.setdefault(m.group(0), f"n{len(seen)}"), script)


def _kernel_calls(mod, name):
    prims = {gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)
             and not (f.attrs is not None and f.attrs.get("tirx.is_host_func", False))}
    found = []
    relax.analysis.post_order_visit(mod[name].body, lambda e: found.append(e.op.name_hint) if isinstance(e, relax.Call)
                                    and isinstance(e.op, relax.GlobalVar) and e.op.name_hint in prims else None)
    return found


@pytest.fixture(scope="module")
def tiny_onnx(zoo):
    return import_model(zoo.source("tiny", "onnx"))


@pytest.fixture(scope="module")
def tiered(tiny_onnx):
    return {"graph": _lower(tiny_onnx, "tiered", BOUNDS), "plain": _lower(tiny_onnx, "tiered", None)}


def test_tiered_decode_is_one_captured_region(tiered):
    mod, pipeline = tiered["graph"]
    names = {gv.name_hint for gv in mod.get_global_vars()}
    captures = sorted(n for n in names if n.startswith(CAPTURE_PREFIX))
    assert {GRAPH_ENTRY, ALLOC_FUNC, STAGE_KERNEL, "decode", "prefill", "rerank", "argmax"} <= names
    assert len(captures) == 1
    s = graph_summary(mod)
    assert s == pipeline.graph.summary  # what the manifest records
    plain = _kernel_calls(mod, "decode")
    inside = _kernel_calls(mod, captures[0])
    outside = _kernel_calls(mod, GRAPH_ENTRY)
    # every kernel of the plain step but the one writing the returned logits runs in the graph; outside: the staging copy
    assert len(outside) == 2 and STAGE_KERNEL in outside
    assert sorted(inside + [k for k in outside if k != STAGE_KERNEL]) == sorted(plain)
    assert inside.count("tiered_decode") == 2 and inside.count("tiered_append") == 2  # both layers' attention
    assert s["inside"] == len(inside) and s["outside"] == 2 and s["captured_regions"] == 1
    # the graphs are replayed through the VM's CUDA-graph builtins, their storage fetched once
    assert s["outside_builtins"][RUN_OR_CAPTURE] == 1
    assert s["outside_builtins"][GET_CACHED_ALLOC] == 1
    assert s["planned_bytes"] > 0


def test_greedy_graph_returns_tokens_not_logits(tiered):
    """``decode_graph_greedy``: the graph entry with the argmax captured too; it returns the tokens (as ``argmax`` does),
    so no logits are copied out of the graphs' memory, and shares ``decode_graph``'s planned storages."""
    mod, _ = tiered["graph"]
    names = {gv.name_hint for gv in mod.get_global_vars()}
    captures = sorted(n for n in names if n.startswith(GREEDY_ENTRY + "_cuda_graph_capture"))
    assert len(captures) == 1 and not any(c.startswith(CAPTURE_PREFIX) for c in captures)
    graph_inside = _kernel_calls(mod, next(n for n in names if n.startswith(CAPTURE_PREFIX)))
    inside, outside = _kernel_calls(mod, captures[0]), _kernel_calls(mod, GREEDY_ENTRY)
    # the decode graph's kernels, then the argmax writing the returned tokens (outside: outputs are never planned),
    # and no copy of the logits: the kernel that writes them into decode_graph's returned tensor is not there
    assert outside == [STAGE_KERNEL, "argmax_rows"]
    logits_writer = [k for k in _kernel_calls(mod, GRAPH_ENTRY) if k != STAGE_KERNEL]
    assert len(logits_writer) == 1 and sorted(inside) == sorted(graph_inside + logits_writer)
    ret = mod[GREEDY_ENTRY].ret_ty
    tokens = ret.fields[0] if isinstance(ret, relax.TupleType) else ret
    argmax_ret = mod["argmax"].ret_ty
    assert tokens.dtype == argmax_ret.dtype == "int64" and len(tokens.shape.values) == 2
    assert len(ret.fields) == len(mod[GRAPH_ENTRY].ret_ty.fields)  # the same updated pools after the tokens
    # one storage allocation function for both entries, each fetching it once
    assert sum(n == ALLOC_FUNC for n in names) == 1
    for entry in (GRAPH_ENTRY, GREEDY_ENTRY):
        calls = []
        relax.analysis.post_order_visit(mod[entry].body, lambda e: calls.append(str(e.args[0].global_symbol)) if isinstance(e, relax.Call)
                                        and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.call_builtin_with_ctx" else None)
        assert calls.count(GET_CACHED_ALLOC) == 1 and calls.count(RUN_OR_CAPTURE) == 1, entry


def test_tiered_graph_memory_is_planned_for_the_bounds(tiered):
    mod, _ = tiered["graph"]
    attrs = mod[GRAPH_ENTRY].attrs
    w1, w2 = table_widths(BOUNDS, 16, 128)
    assert {k: int(v) for k, v in attrs["tir_var_upper_bound"].items()} == {"seq": 8, "num_rows": 8, "t1_width": w1, "t2_width": w2}
    assert sorted(attrs["relax.rewrite_cuda_graph.capture_symbolic_vars"]) == ["num_rows", "seq", "t1_width", "t2_width"]
    assert int(attrs["num_input"]) == int(mod["decode"].attrs["num_input"])  # restored after the rewrite
    sizes = []
    relax.analysis.post_order_visit(mod[ALLOC_FUNC].body, lambda e: sizes.append(e.args[0]) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.vm.alloc_storage" else None)
    assert sizes and all(isinstance(v, tvm.tirx.IntImm) for s in sizes for v in s.values)  # constant sizes only
    # the staged tier-1 table has its own storage of max_batch x t1 width int32s (the scores workspace is bigger)
    assert 8 * w1 * 4 in [int(s.values[0]) for s in sizes]
    # nothing of decode_graph is allocated at a symbolic size
    dynamic = []
    relax.analysis.post_order_visit(mod[GRAPH_ENTRY].body, lambda e: dynamic.append(e) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.vm.alloc_storage" else None)
    assert len(dynamic) == 1  # the returned logits only: outputs are never planned


def test_plain_entries_unchanged(tiered):
    graph, _ = tiered["graph"]
    plain, _ = tiered["plain"]
    for name in ("decode", "prefill", "rerank", "argmax"):
        assert _alpha(graph[name].script()) == _alpha(plain[name].script()), name
    names = {gv.name_hint for gv in plain.get_global_vars()}
    assert GRAPH_ENTRY not in names and GREEDY_ENTRY not in names and ALLOC_FUNC not in names
    assert not any(n.startswith(CAPTURE_PREFIX) for n in names)


def test_paged_decode_splits_at_the_cache_attention(tiny_onnx):
    mod, pipeline = _lower(tiny_onnx, "paged", BOUNDS)
    s = pipeline.graph.summary
    layers = 2
    # TVM's paged cache attends in packed functions of the cache object, which are not captured: a region per gap
    assert s["captured_regions"] == layers + 1
    assert s["outside_builtins"]["vm.builtin.attention_kv_cache_attention_with_fused_qkv"] == layers
    assert s["outside_builtins"][RUN_OR_CAPTURE] == layers + 1
    assert s["inside"] > 10 * s["outside"]
    assert STAGE_KERNEL not in {gv.name_hint for gv in mod.get_global_vars()}  # the paged step needs no staging
    both = dict(s["inside_kernels"])
    for k, n in s["outside_kernels"].items():
        both[k] = both.get(k, 0) + n
    plain = _kernel_calls(mod, "decode")
    assert both == {k: plain.count(k) for k in set(plain)}  # the same launches, split between graphs and host


def test_llvm_refuses_cuda_graph_and_is_unaffected(zoo, tmp_path):
    import moec

    with pytest.raises(MoecError, match="need --target cuda"):
        moec.compile(zoo.source("tiny", "onnx"), tmp_path / "x", target="llvm", cuda_graph=True)
    assert not (tmp_path / "x").exists()
    art = zoo.artifact("tiny", "onnx")  # the default llvm build
    engine = moec.load(art)
    assert engine.manifest["options"]["cuda_graph"] is None and "decode_graph" not in engine.manifest["entry_functions"]
    assert engine._decode_graph is None
    with pytest.raises(MoecError, match="no CUDA graphs"):
        moec.load(art, cuda_graph=True)
    seqs, logits = engine.prefill([[5, 6, 7], [8, 9]])
    assert engine.decode(seqs, logits.argmax(-1)).shape == (2, logits.shape[1]) and engine.graph_steps == 0


def test_bounds_validated():
    with pytest.raises(MoecError):
        GraphBounds(max_batch=0)
    with pytest.raises(MoecError):
        GraphBounds(max_context=True)
    assert table_widths(GraphBounds(4, 4096), 16, 128) == (256, 32)
    assert table_widths(GraphBounds(4, 100), 16, 128) == (7, 1)


def test_table_padding():
    from moec.runtime.engine import _pad_width

    t = np.arange(6, dtype=np.int32).reshape(2, 3) + 1
    p = _pad_width(t, 256)
    assert p.shape == (2, 4) and (p[:, :3] == t).all() and (p[:, 3] == 0).all()
    assert _pad_width(t, 3) is t  # capped at the bound
    assert _pad_width(np.ones((1, 1), np.int32), 8).shape == (1, 1)
    assert _pad_width(np.ones((3, 5), np.int32), 32).shape == (3, 8)
    assert _pad_width(np.ones((3, 17), np.int32), 20).shape == (3, 20)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["paged", "tiered"])
def test_graph_decode_matches_plain_on_the_gpu(zoo, tmp_path, cache):
    """The graphs replay the plain decode's kernels: the same logits, step after step, across a batch-size change."""
    import moec

    art = moec.compile(zoo.source("tiny", "onnx"), tmp_path / "art", target="cuda", kv_cache=cache, cuda_graph=BOUNDS)
    graph, plain = moec.load(art, device="cuda"), moec.load(art, device="cuda", cuda_graph=False)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 256, n)) for n in (300, 40, 170, 9, 260)]  # tier-2 pages and re-ranks for tiered
    sg, lg = graph.prefill(prompts)
    sp, lp = plain.prefill(prompts)
    nxt = lg.argmax(-1)
    for step in range(24):
        if step == 12:  # fewer streams: another graph is captured
            for e, seqs in ((graph, sg), (plain, sp)):
                e.release(seqs.pop())
            nxt = nxt[:-1]
        lg, lp = graph.decode(sg, nxt), plain.decode(sp, nxt)
        np.testing.assert_allclose(lg, lp, rtol=0, atol=1e-5 * float(np.abs(lp).max()))
        nxt = lg.argmax(-1)
    assert graph.graph_steps == 24 and plain.graph_steps == 0


def test_branches_end_regions():
    """A tuned kernel's ``R.If`` dispatch sits in a block of its own, so no captured region spans it."""
    from moec.passes.cuda_graph import _isolate_branches

    @R.function(pure=False)
    def f(x: R.Tensor((4,), "float32"), c: R.Tensor((), "bool")):
        y = R.add(x, x)
        if c:
            z = R.multiply(y, y)
        else:
            z = y
        w = R.add(z, x)
        return w

    g = _isolate_branches(f)
    kinds = [["if" if isinstance(b.value, relax.If) else "op" for b in block.bindings] for block in g.body.blocks]
    assert ["if"] in kinds and all(k == ["if"] or "if" not in k for k in kinds)
    assert sum(kinds, []) == sum([["if" if isinstance(b.value, relax.If) else "op" for b in block.bindings]
                                  for block in f.body.blocks], [])  # same bindings, same order


def test_graphs_by_default_on_cuda():
    """``cuda_graph="auto"`` (moec.compile's default) and the CLI without --[no-]cuda-graph: graphs for the CUDA target,
    none for the CPU or where the experts are offloaded (the runtime's residency calls sit between the kernels)."""
    import argparse

    from moec.compiler.build import _graph_bounds
    from moec.compiler.cli import _graph_bounds as cli_bounds
    from moec.compiler.targets import make_target

    cuda, cpu = make_target("cuda"), make_target("llvm")
    assert _graph_bounds("auto", cuda, False) == GraphBounds()
    assert _graph_bounds("auto", cuda, True) is None and _graph_bounds("auto", cpu, False) is None
    assert _graph_bounds(False, cuda, False) is None and _graph_bounds(True, cuda, False) == GraphBounds()
    with pytest.raises(MoecError, match="cuda_graph must be"):
        _graph_bounds("on", cuda, False)

    def args(**kw):
        base = dict(cuda_graph=None, target="cuda", expert_slots=None, gpu_memory_budget=None, graph_max_batch=64,
                    graph_max_context=2048)
        return argparse.Namespace(**{**base, **kw})

    assert cli_bounds(args()) == GraphBounds(64, 2048)
    assert cli_bounds(args(target="llvm")) is False and cli_bounds(args(expert_slots=8)) is False
    assert cli_bounds(args(gpu_memory_budget=1 << 30)) is False and cli_bounds(args(cuda_graph=False)) is False
    assert cli_bounds(args(cuda_graph=True, expert_slots=8)) == GraphBounds(64, 2048)  # refused later by compile
