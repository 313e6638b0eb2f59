"""ViewOutputReshape: an entry's output reshape becomes a view (IR before / after, numerics, the compiled decode)."""

import numpy as np
import tvm
from tvm import relax

from moec.passes.output_views import ViewOutputReshape


def _module():
    """``f(x [n, 8]) -> (reshape(x + 1, [1, n, 8]), reshape(x * 2, [n, 2, 4]) + 3)``: one output reshape, one inner
    reshape, one non-reshape output, after legalization (every op a ``call_tir``)."""
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n, 8], "float32"))
    with bb.function("f", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.add(x, relax.const(1.0, "float32")))
            out = bb.emit_output(relax.op.reshape(a, [1, n, 8]))
            b = bb.emit(relax.op.multiply(x, relax.const(2.0, "float32")))
            c = bb.emit(relax.op.reshape(b, [n, 2, 4]))
            other = bb.emit_output(relax.op.add(c, relax.const(3.0, "float32")))
        bb.emit_func_output(relax.Tuple([out, other]))
    mod = relax.transform.LegalizeOps()(bb.get())
    return relax.transform.RewriteDataflowReshape()(mod)


def _calls(func):
    found = []
    relax.analysis.post_order_visit(func.body, lambda e: found.append(
        e.args[0].name_hint if e.op.name == "relax.call_tir" else e.op.name) if isinstance(e, relax.Call) and isinstance(
        e.op, tvm.ir.Op) else None)
    return found


def test_ir_before_after():
    before = _module()
    # TVM's pass made the inner reshape a view and left the output's a kernel
    assert _calls(before["f"]) == ["add", "reshape", "multiply", "relax.reshape", "add1"]
    p = ViewOutputReshape()
    after = p(before)
    assert p.rewritten == 1
    assert _calls(after["f"]) == ["add", "relax.reshape", "multiply", "relax.reshape", "add1"]
    names = {gv.name_hint for gv in after.get_global_vars()}
    assert "reshape" not in names and {"add", "multiply", "add1"} <= names  # the unused reshape kernel is gone
    tvm.ir.assert_structural_equal(after["f"].ret_ty, before["f"].ret_ty)
    again = ViewOutputReshape()
    assert again(after).same_as(after) and again.rewritten == 0  # nothing left to rewrite: the module unchanged


def test_reshape_of_a_parameter_stays_a_copy():
    """An output reshape of what the block did not make itself (a parameter) is left alone: a view would alias the
    caller's tensor."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([4, 8], "float32"))
    with bb.function("g", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.reshape(x, [1, 4, 8]))
        bb.emit_func_output(out)
    mod = relax.transform.RewriteDataflowReshape()(relax.transform.LegalizeOps()(bb.get()))
    assert _calls(mod["g"]) == ["reshape"]
    p = ViewOutputReshape()
    assert p(mod).same_as(mod) and p.rewritten == 0


def test_numerics_after_the_pipeline():
    """The rewritten module through the rest of the VM lowering gives the values of the original on the CPU."""
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    outs = []
    for mod in (_module(), ViewOutputReshape()(_module())):
        ex = tvm.compile(mod, target="llvm")
        vm = relax.VirtualMachine(ex, tvm.cpu())
        got = vm["f"](tvm.runtime.tensor(x, tvm.cpu()))
        outs.append([got[0].numpy(), got[1].numpy()])
    np.testing.assert_array_equal(outs[1][0], (x + 1).reshape(1, 5, 8))
    np.testing.assert_array_equal(outs[1][1], (x * 2).reshape(5, 2, 4) + 3)
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


def test_compiled_decode_has_no_logits_copy(zoo, tmp_path):
    """In a compiled model (the tiny reference MoE, tiered cache) no entry ends in a reshape kernel: the logits
    are the LM head's own output, viewed as [1, T, V]."""
    import moec

    dump = tmp_path / "dump"
    moec.compile(zoo.source("tiny", "pt2"), tmp_path / "art", target="llvm", kv_cache="tiered", debug_dump=dump)
    vm_ir = (dump / "phase4_vm.py").read_text()
    for entry in ("decode", "prefill"):
        body = vm_ir.split(f"    def {entry}(", 1)[1].split("    @R.function", 1)[0]
        ret = body[body.rindex("return"):]
        logits = ret.split("(", 1)[1].split(",", 1)[0].strip()
        line = next(ln for ln in body.splitlines() if ln.strip().startswith(f"{logits}:"))
        assert "vm.builtin.reshape" in line, (entry, line)
