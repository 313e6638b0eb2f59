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


def _cuda_module(n, k, largest, dtype="float32"):
    from moec.passes.legalize_topk import topk_select_func

    return tvm.IRModule({"topk_select": topk_select_func(n, k, dtype, "int64", largest, gpu=True).with_attr("global_symbol", "topk_select")})


def test_cuda_warp_form_builds():
    """The CUDA form (a warp per row, shuffle argmax) compiles for sm_90 with one kernel of 4 x 32 threads."""
    import re

    from moec.compiler.build import _cuda_modules
    from moec.compiler.targets import make_target

    ex = tvm.compile(_cuda_module(64, 8, True, "bfloat16"), target=make_target("cuda", "sm_90"))
    src = _cuda_modules(ex.mod)[0].inspect_source("cuda")
    assert "__shfl_xor_sync" in src
    assert set(re.findall(r"__launch_bounds__\((\d+)\)", src)) == {"128"}
    with pytest.raises(ValueError, match="992"):
        _cuda_module(2000, 8, True)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,largest,rows", [(64, 8, True, 128), (9, 3, True, 6), (9, 3, False, 6), (160, 6, True, 37),
                                               (8, 2, True, 1), (60, 4, False, 301)])
def test_cuda_warp_form_matches_numpy(n, k, largest, rows):
    from moec.compiler.targets import make_target

    from moec_testing import require_cuda

    require_cuda()
    dev = tvm.cuda(0)
    rng = np.random.default_rng(n * k + rows)
    x = rng.integers(0, 5, size=(rows, n)).astype("float32") if n < 20 else rng.standard_normal((rows, n)).astype("float32")
    x[0, :] = 1.0  # a row of ties
    ex = tvm.compile(_cuda_module(n, k, largest), target=make_target("cuda", "sm_90"))
    out = tvm.runtime.tensor(np.full((rows, k), -7, np.int64), dev)
    ex["topk_select"](tvm.runtime.tensor(x, dev), out)
    order = np.argsort(-x if largest else x, axis=-1, kind="stable")[:, :k]
    np.testing.assert_array_equal(out.numpy(), order)
