"""SimplifyPower: IR before/after and numerics (negative bases included) on llvm."""

import numpy as np
import pytest
import tvm
from tvm import relax

from moec.passes.simplify_power import SimplifyPower


def _module(exponent):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((3, 5), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.power(x, relax.const(exponent, "float32")))
        bb.emit_func_output(y)
    return bb.get()


def _ops(mod):
    names = []
    relax.analysis.post_order_visit(mod["main"].body, lambda e: names.append(e.op.name) if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return names


@pytest.mark.parametrize("exponent,expected_op", [(2.0, "relax.multiply"), (3.0, "relax.multiply"), (0.5, "relax.sqrt"), (-0.5, "relax.rsqrt"), (-1.0, "relax.divide")])
def test_rewrites_and_matches_numpy(exponent, expected_op):
    before = _module(exponent)
    assert "relax.power" in _ops(before)
    after = SimplifyPower()(before)
    ops = _ops(after)
    assert "relax.power" not in ops and expected_op in ops
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5)).astype("float32")
    if exponent in (0.5, -0.5):
        x = np.abs(x) + 0.1
    ex = tvm.compile(after, target=tvm.target.Target({"kind": "llvm"}))
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(got, np.power(x, exponent), rtol=1e-5)


def test_other_exponents_untouched():
    before = _module(2.7)
    assert "relax.power" in _ops(SimplifyPower()(before))
