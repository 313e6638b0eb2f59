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


# ---------------------------------------------------------------------------- FuseSoftmaxTopK (routers)


def _router_module(shape=("n", 3, 16), k=4, dtype="bfloat16", upcast=True, extra_user=False, axis=-1, largest=True):
    """``decode(x)``: ``topk(softmax(astype(x, float32)))`` as HF routers export it."""
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n if s == "n" else s for s in shape], dtype))
    with bb.function("decode", [x], attrs={"num_input": 1}):
        with bb.dataflow():
            a = bb.emit(relax.op.astype(x, "float32")) if upcast else x
            s = bb.emit(relax.op.nn.softmax(a, axis=axis))
            top = bb.emit(relax.op.topk(s, k=k, axis=axis, ret_type="both", largest=largest, dtype="int64"))
            outs = [bb.emit(relax.TupleGetItem(top, 0)), bb.emit(relax.TupleGetItem(top, 1))]
            if extra_user:
                outs.append(bb.emit(relax.op.sum(s, axis=[-1])))
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def _fuse_topk(mod, target="llvm"):
    from moec.compiler.targets import make_target
    from moec.passes.legalize_topk import FuseSoftmaxTopK

    p = FuseSoftmaxTopK(make_target(target, "sm_90" if target == "cuda" else None))
    return p, relax.transform.DeadCodeElimination(["decode"])(p(mod))


def _ops(func):
    found = []
    relax.analysis.post_order_visit(func.body, lambda e: found.append(e.op.name) if isinstance(e, relax.Call) and isinstance(
        e.op, tvm.ir.Op) else None)
    return found


def test_softmax_topk_ir_before_after():
    before = _router_module()
    assert {"relax.astype", "relax.nn.softmax", "relax.topk"} <= set(_ops(before["decode"]))
    p, after = _fuse_topk(before)
    ops = _ops(after["decode"])
    assert p.fused == {"decode": 1} and ops.count("relax.call_tir") == 1
    assert not {"relax.astype", "relax.nn.softmax", "relax.topk"} & set(ops)
    gv = [g for g in after.get_global_vars() if g.name_hint.startswith("topk_softmax")]
    prim = after[gv[0]]
    assert 'x: T.Buffer((rows, 16), "bfloat16")' in prim.script()  # reads x as stored
    assert 'val: T.Buffer((rows, 4), "float32")' in prim.script()


@pytest.mark.parametrize("kw", [dict(extra_user=True), dict(axis=1), dict(largest=False)], ids=["softmax-used-elsewhere", "other-axis", "smallest"])
def test_softmax_topk_other_forms_stay(kw):
    p, after = _fuse_topk(_router_module(**kw))
    assert p.fused == {"decode": 0} and "relax.topk" in _ops(after["decode"])


@pytest.mark.parametrize("dtype,upcast", [("bfloat16", True), ("float32", False)])
def test_softmax_topk_matches_numpy(dtype, upcast):
    """Fused and unfused (softmax, then the top-k legalization) against NumPy, with tied logits."""
    import ml_dtypes

    mod = _router_module(dtype=dtype, upcast=upcast)
    _, fused = _fuse_topk(mod)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 3, 16)).astype(np.float32)
    x[0, 0, :] = 0.5  # a row of ties: the lower indices win
    x[1, 2, 3] = x[1, 2, 7] = 4.0
    x = x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
    xf = x.astype(np.float32)
    e = np.exp(xf - xf.max(-1, keepdims=True))
    probs = e / e.sum(-1, keepdims=True)
    order = np.argsort(-xf, axis=-1, kind="stable")[..., :4]
    for m in (mod, fused):
        ex = tvm.compile(relax.transform.LegalizeOps({"relax.topk": legalize_topk})(m), target=tvm.target.Target({"kind": "llvm"}))
        vals, idx = relax.VirtualMachine(ex, tvm.cpu())["decode"](tvm.runtime.tensor(x))
        np.testing.assert_array_equal(idx.numpy(), order)
        np.testing.assert_allclose(vals.numpy(), np.take_along_axis(probs, order, -1), rtol=1e-6, atol=1e-7)


def test_softmax_topk_cuda_form_builds():
    import re

    from moec.compiler.build import _cuda_modules
    from moec.compiler.targets import make_target
    from moec.passes.legalize_topk import topk_select_func

    prim = topk_select_func(64, 8, "bfloat16", "int64", True, gpu=True, values_dtype="float32", softmax=True)
    ex = tvm.compile(tvm.IRModule({"topk_softmax": prim.with_attr("global_symbol", "topk_softmax")}), target=make_target("cuda", "sm_90"))
    src = _cuda_modules(ex.mod)[0].inspect_source("cuda")
    assert "__expf" in src or "expf" in src
    assert src.count("__shfl_xor_sync") >= 3 * 5 and set(re.findall(r"__launch_bounds__\((\d+)\)", src)) == {"128"}
    with pytest.raises(ValueError, match="k largest, with values"):
        topk_select_func(64, 8, "float32", "int64", False, gpu=True, values_dtype="float32", softmax=True)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,rows", [(64, 8, 128), (8, 2, 1), (60, 4, 301), (160, 6, 37)])
def test_softmax_topk_cuda_matches_numpy(n, k, rows):
    import ml_dtypes

    from moec.compiler.targets import make_target
    from moec.passes.legalize_topk import topk_select_func

    from moec_testing import require_cuda

    require_cuda()
    dev = tvm.cuda(0)
    prim = topk_select_func(n, k, "bfloat16", "int64", True, gpu=True, values_dtype="float32", softmax=True)
    ex = tvm.compile(tvm.IRModule({"topk_softmax": prim.with_attr("global_symbol", "topk_softmax")}), target=make_target("cuda", "sm_90"))
    rng = np.random.default_rng(n + rows)
    x = (rng.standard_normal((rows, n)) * 3).astype(ml_dtypes.bfloat16)
    x[0, :] = 1.0
    idx, val = tvm.runtime.tensor(np.zeros((rows, k), np.int64), dev), tvm.runtime.tensor(np.zeros((rows, k), np.float32), dev)
    ex["topk_softmax"](tvm.runtime.tensor(x, dev), idx, val)
    xf = x.astype(np.float32)
    e = np.exp(xf - xf.max(-1, keepdims=True))
    order = np.argsort(-xf, axis=-1, kind="stable")[:, :k]
    np.testing.assert_array_equal(idx.numpy(), order)
    np.testing.assert_allclose(val.numpy(), np.take_along_axis(e / e.sum(-1, keepdims=True), order, -1), rtol=1e-5, atol=1e-7)


def test_softmax_topk_values_written_in_the_dtype_they_are_cast_to():
    """HF routers cast the chosen weights to the model's dtype before the experts: the kernel writes them so."""
    import ml_dtypes

    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n, 16], "bfloat16"))
    with bb.function("decode", [x], attrs={"num_input": 1}):
        with bb.dataflow():
            s = bb.emit(relax.op.nn.softmax(bb.emit(relax.op.astype(x, "float32")), axis=-1))
            top = bb.emit(relax.op.topk(s, k=4, axis=-1, ret_type="both", largest=True, dtype="int64"))
            w = bb.emit(relax.op.astype(bb.emit(relax.TupleGetItem(top, 0)), "bfloat16"))
            out = bb.emit_output(relax.Tuple([w, bb.emit(relax.TupleGetItem(top, 1))]))
        bb.emit_func_output(out)
    before = bb.get()
    _, after = _fuse_topk(before)
    assert _ops(after["decode"]) == ["relax.call_tir"]  # no cast left
    prim = after[[g for g in after.get_global_vars() if g.name_hint.startswith("topk_softmax")][0]]
    assert 'val: T.Buffer((rows, 4), "bfloat16")' in prim.script()
    xv = (np.random.default_rng(6).standard_normal((7, 16)) * 2).astype(ml_dtypes.bfloat16)
    outs = []
    for m in (before, after):
        ex = tvm.compile(relax.transform.LegalizeOps({"relax.topk": legalize_topk})(m), target=tvm.target.Target({"kind": "llvm"}))
        outs.append([t.numpy() for t in relax.VirtualMachine(ex, tvm.cpu())["decode"](tvm.runtime.tensor(xv))])
    np.testing.assert_array_equal(outs[1][1], outs[0][1])
    np.testing.assert_array_equal(outs[1][0].astype(np.float32), outs[0][0].astype(np.float32))
