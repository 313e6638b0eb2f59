"""The prefill entries' LM head on the requested positions only (passes/logit_positions.py): the gather moved up
the token-wise chain that ends in the logits, in the IR of real exports, and the same numbers as gathering after."""

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.script import relax as R

from moec.compiler.graph import shape_of
from moec.passes.logit_positions import logits_at_positions
from moec.passes.paged_kv_attention import InsertPagedKVAttention
from moec.passes.tiered_kv_attention import InsertTieredKVAttention, TieredOptions


def _calls(func, name):
    found = []
    relax.analysis.post_order_visit(func.body, lambda e: found.append(e) if isinstance(e, relax.Call) and isinstance(
        e.op, tvm.ir.Op) and e.op.name == name else None)
    return found


@pytest.mark.parametrize("name,kind,cache", [("tiny", "pt2", "paged"), ("tiny", "pt2", "tiered"), ("hf-olmoe", "onnx", "tiered"),
                                             ("hf-mixtral", "onnx", "paged")])
def test_prefill_lm_head_runs_on_logit_pos_rows(zoo, name, kind, cache):
    imported = zoo.imported(name, kind)
    target = tvm.target.Target({"kind": "llvm"})
    insert = InsertTieredKVAttention(imported.num_inputs, target, TieredOptions(), name) if cache == "tiered" else \
        InsertPagedKVAttention(imported.num_inputs, target, name)
    mod = relax.transform.DeadCodeElimination(["prefill", "decode"])(insert(imported.mod))
    pos = [p for p in mod["prefill"].params if p.name == "logit_pos"][0]
    rows = shape_of(pos)[0]
    heads = [c for c in _calls(mod["prefill"], "relax.matmul") if any(
        isinstance(d, tirx.Var) and d.same_as(rows) for d in shape_of(c))]
    assert len(heads) == 1  # the LM head, and only it, on the requested rows
    takes = _calls(mod["prefill"], "relax.take")
    assert [t for t in takes if t.args[1].same_as(pos)], "the gather by logit_pos"
    for t in takes:  # and nothing gathers from a [1, N, vocab] tensor any more
        if t.args[1].same_as(pos):
            assert int(shape_of(t.args[0])[-1]) != int(shape_of(heads[0])[-1])


def _forward(softcap: bool):
    """A toy prefill tail: final norm, LM head (with a reshape to 2-D and back, as torch.export leaves it), then an
    optional logit soft cap (divide, tanh, multiply by constants)."""
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((1, n, 8), "float32"))
    g = relax.Var("g", relax.TensorType((8,), "float32"))
    w = relax.Var("w", relax.TensorType((8, 16), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, g, w]):
        with bb.dataflow():
            r = bb.emit(relax.op.rsqrt(relax.op.add(relax.op.mean(relax.op.multiply(x, x), axis=[-1], keepdims=True),
                                                    relax.const(1e-5, "float32"))))
            h = bb.emit(relax.op.multiply(g, bb.emit(relax.op.multiply(x, r))))
            h2 = bb.emit(relax.op.reshape(h, [n, 8]))
            lg = bb.emit(relax.op.reshape(bb.emit(relax.op.matmul(h2, w)), [1, n, 16]))
            if softcap:
                lg = bb.emit(relax.op.multiply(relax.op.tanh(relax.op.divide(lg, relax.const(3.0, "float32"))),
                                               relax.const(3.0, "float32")))
            out = bb.emit_output(lg)
        bb.emit_func_output(out)
    return bb.get()["main"], n


@pytest.mark.parametrize("softcap", [False, True])
def test_moved_gather_gives_the_same_logits(softcap):
    func, n = _forward(softcap)
    b = tirx.Var("b", "int64")
    pos = relax.Var("logit_pos", relax.TensorType((b,), "int32"))
    moved = logits_at_positions(func.body, pos, n)
    assert moved is not None
    ops = [bd.value.op.name for bd in moved.blocks[-1].bindings[-(8 if softcap else 5):]]
    # gathered before the norm weight, the LM head and the soft cap
    assert ops == ["relax.take", "relax.multiply", "relax.reshape", "relax.matmul", "relax.reshape"] + (
        ["relax.divide", "relax.tanh", "relax.multiply"] if softcap else [])
    take = relax.BlockBuilder().normalize(relax.op.take(func.body.body, pos, axis=1))
    out = relax.Var("logits", take.ty)
    gathered = relax.SeqExpr(list(func.body.blocks) + [relax.BindingBlock([relax.VarBinding(out, take)])], out)
    mod = tvm.IRModule({name: relax.utils.copy_with_new_vars(relax.Function(list(func.params) + [pos], body, ret_ty=body.body.ty))
                        for name, body in (("after", gathered), ("before", moved))})  # the gather after the forward, or moved
    ex = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((1, 11, 8)).astype(np.float32), rng.standard_normal(8).astype(np.float32),
            rng.standard_normal((8, 16)).astype(np.float32), np.array([10, 0, 4], np.int32)]
    want = vm["after"](*[tvm.runtime.tensor(a) for a in args]).numpy()
    got = vm["before"](*[tvm.runtime.tensor(a) for a in args]).numpy()
    assert got.shape == (1, 3, 16)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_token_mixing_tail_is_left_alone():
    """A softmax over the token axis after the LM head mixes tokens: nothing moves (the caller gathers after)."""
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((1, n, 16), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.softmax(x, axis=1))
        bb.emit_func_output(out)
    pos = relax.Var("logit_pos", relax.TensorType((tirx.Var("b", "int64"),), "int32"))
    assert logits_at_positions(bb.get()["main"].body, pos, n) is None
