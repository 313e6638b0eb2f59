"""legalize_topk: IR (no extern sort call remains) and numerics against NumPy, ties included."""

import numpy as np
import pytest
import tvm
from tvm import relax

from moec.passes.legalize_topk import legalize_topk


def _module(shape, k, axis, largest, ret_type):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        out = bb.emit(relax.op.topk(x, k=k, axis=axis, ret_type=ret_type, largest=largest, dtype="int64"))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod, x):
    target = tvm.target.Target({"kind": "llvm"})
    lowered = relax.transform.LegalizeOps({"relax.topk": legalize_topk})(mod)
    text = lowered.script()
    assert "contrib.sort" not in text and "R.topk" not in text
    ex = tvm.compile(lowered, target=target)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x))


@pytest.mark.parametrize("largest", [True, False])
def test_rows_with_ties(largest):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 5, size=(6, 9)).astype("float32")  # many ties
    out = _run(_module((6, 9), 3, -1, largest, "both"), x)
    vals, idx = out[0].numpy(), out[1].numpy()
    order = np.argsort(-x if largest else x, axis=-1, kind="stable")[:, :3]
    np.testing.assert_array_equal(idx, order)
    np.testing.assert_array_equal(vals, np.take_along_axis(x, order, -1))


def test_other_axis_and_ret_types():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 7, 3)).astype("float32")
    idx = _run(_module((4, 7, 3), 2, 1, True, "indices"), x).numpy()
    np.testing.assert_array_equal(idx, np.argsort(-x, axis=1, kind="stable")[:, :2, :])
    vals = _run(_module((4, 7, 3), 2, 1, True, "values"), x).numpy()
    np.testing.assert_allclose(vals, -np.sort(-x, axis=1)[:, :2, :])
