"""AddGreedySampler: the ``argmax`` entry (IR before/after) and greedy tokens on the device equal to the
argmax of the logits the engine returns (compiled tiny model, llvm)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import moec
from moec.compiler.errors import MoecError
from moec.compiler.targets import make_target
from moec.passes.device_sampling import ENTRY, AddGreedySampler

LLVM = make_target("llvm")


def _phase1(zoo, **kw):
    mod, entries, _ = moec.compile(zoo.source("tiny", "onnx"), None, target="llvm", _until_phase1=True, **kw)
    return mod, entries


def test_ir_before_and_after(zoo):
    mod, entries = _phase1(zoo)
    assert ENTRY in entries and ENTRY in [gv.name_hint for gv in mod.get_global_vars()]
    before = tvm.IRModule({gv: f for gv, f in mod.functions_items() if gv.name_hint not in (ENTRY, "argmax_rows")})
    assert ENTRY not in [gv.name_hint for gv in before.get_global_vars()]
    with LLVM:
        after = AddGreedySampler(LLVM, "tiny")(before)
    func = after[ENTRY]
    (logits,) = func.params
    vocab = int(before["decode"].ret_ty.shape.values[2])
    from moec.compiler.graph import shape_of

    assert shape_of(logits)[0] == 1 and shape_of(logits)[2] == vocab
    calls = [b.value for blk in func.body.blocks for b in blk.bindings]
    assert len(calls) == 1 and calls[0].op.name == "relax.call_tir"
    kernel = after[calls[0].args[0]]
    assert isinstance(kernel, tvm.tirx.PrimFunc) and calls[0].args[0].name_hint == "argmax_rows"
    # the token ids of the decode's dtype (int64 from the exporters), so a step's tokens feed the next step
    assert func.ret_ty.dtype == before["decode"].params[0].ty.dtype == "int64" and len(func.ret_ty.shape.values) == 2
    assert "float32" in kernel.script() and "argmax" in kernel.script()
    # the other entries are untouched
    for name in ("prefill", "decode"):
        tvm.ir.assert_structural_equal(after[name], before[name])


def test_needs_a_decode_entry():
    x = relax.Var("x", relax.TensorType((1, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        bb.emit_func_output(x)
    with pytest.raises((MoecError, RuntimeError), match="m.onnx: AddGreedySampler needs the decode entry"):
        AddGreedySampler(LLVM, "m.onnx")(bb.get())


def test_greedy_on_device_equals_host_argmax(zoo):
    art = zoo.artifact("tiny", "onnx")
    a, b = moec.load(art), moec.load(art)
    assert "argmax" in a.manifest["entry_functions"] and a._argmax is not None
    prompts = [[5, 6, 7, 8, 9], [12, 13, 14], [1]]
    sa, la = a.prefill(prompts)
    sb, lb = b.prefill(prompts)
    nxt_a = nxt_b = la.argmax(-1)
    for _ in range(4):
        logits = a.decode(sa, list(nxt_a))
        got = b.decode_greedy(sb, list(nxt_b))
        assert got.dtype == np.int64 and got.shape == (3,)
        np.testing.assert_array_equal(got, logits.argmax(-1))
        nxt_a, nxt_b = logits.argmax(-1), got
