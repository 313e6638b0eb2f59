"""SimplifyLayout: permutes composed (through reshapes that add leading unit axes or keep the shape),
identities dropped; the values unchanged."""

import numpy as np
import pytest
import tvm
from tvm import relax

from moec.passes.simplify_layout import SimplifyLayout


def _ops(mod):
    found = []
    relax.analysis.post_order_visit(mod["f"].body, lambda e: found.append(e.op.name) if isinstance(e, relax.Call) and isinstance(
        e.op, tvm.ir.Op) else None)
    return found


def _heads_back():
    """The attention output as the passes hand it back ([N, H, D] -> [H, N, D] -> [1, H, N, D]) and the model's own
    transpose back to tokens first ([1, N, H, D] -> [1, N, H * D])."""
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n, 4, 16], "float32"))
    with bb.function("f", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.permute_dims(x, [1, 0, 2]))
            b = bb.emit(relax.op.reshape(a, [4, n, 16]))
            c = bb.emit(relax.op.reshape(b, [1, 4, n, 16]))
            d = bb.emit(relax.op.permute_dims(c, [0, 2, 1, 3]))
            o = bb.emit_output(bb.emit(relax.op.reshape(d, [1, n, 64])))
        bb.emit_func_output(o)
    return bb.get()


def _two_permutes(p, q):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([2, 3, 5], "float32"))
    with bb.function("f", [x]):
        with bb.dataflow():
            o = bb.emit_output(bb.emit(relax.op.permute_dims(bb.emit(relax.op.permute_dims(x, p)), q)))
        bb.emit_func_output(o)
    return bb.get()


def _run(mod, x):
    mod = relax.transform.DeadCodeElimination(["f"])(mod)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return vm["f"](tvm.runtime.tensor(x)).numpy()


def test_heads_back_is_a_reshape():
    before = _heads_back()
    after = relax.transform.DeadCodeElimination(["f"])(SimplifyLayout()(before))
    assert _ops(before).count("relax.permute_dims") == 2 and "relax.permute_dims" not in _ops(after)
    x = np.random.default_rng(0).standard_normal((5, 4, 16)).astype(np.float32)
    np.testing.assert_array_equal(_run(after, x), _run(before, x))


@pytest.mark.parametrize("p,q,left", [([1, 0, 2], [1, 0, 2], 0), ([2, 0, 1], [1, 2, 0], 0), ([1, 2, 0], [0, 2, 1], 1)])
def test_permutes_compose(p, q, left):
    before = _two_permutes(p, q)
    after = relax.transform.DeadCodeElimination(["f"])(SimplifyLayout()(before))
    assert _ops(after).count("relax.permute_dims") == left
    x = np.random.default_rng(1).standard_normal((2, 3, 5)).astype(np.float32)
    np.testing.assert_array_equal(_run(after, x), _run(before, x))


def test_unit_axis_not_leading_stays():
    """A reshape that adds a unit axis elsewhere, or a permute that moves the unit axis: left alone."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([3, 4], "float32"))
    with bb.function("f", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.permute_dims(x, [1, 0]))
            c = bb.emit(relax.op.reshape(a, [1, 4, 3]))
            o = bb.emit_output(bb.emit(relax.op.permute_dims(c, [1, 0, 2])))  # moves the unit axis
        bb.emit_func_output(o)
    before = bb.get()
    after = relax.transform.DeadCodeElimination(["f"])(SimplifyLayout()(before))
    assert _ops(after).count("relax.permute_dims") == 2
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(_run(after, x), _run(before, x))


def test_through_a_cast_and_an_identity_broadcast():
    """The OLMoE export's form: [H, N, D] -> reshape [1, H, N, D] -> cast -> transpose back -> reshape ->
    broadcast_to its own shape: one cast and reshapes remain, no permute or broadcast."""
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n, 4, 16], "float32"))
    with bb.function("f", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.permute_dims(x, [1, 0, 2]))
            c = bb.emit(relax.op.reshape(a, [1, 4, n, 16]))
            h = bb.emit(relax.op.astype(c, "float16"))
            d = bb.emit(relax.op.permute_dims(h, [0, 2, 1, 3]))
            r = bb.emit(relax.op.reshape(d, [1, n, 64]))
            o = bb.emit_output(bb.emit(relax.op.broadcast_to(r, [1, n, 64])))
        bb.emit_func_output(o)
    before = bb.get()
    after = relax.transform.DeadCodeElimination(["f"])(SimplifyLayout()(before))
    ops = _ops(after)
    assert "relax.permute_dims" not in ops and "relax.broadcast_to" not in ops and ops.count("relax.astype") == 1
    x = np.random.default_rng(2).standard_normal((3, 4, 16)).astype(np.float32)
    np.testing.assert_array_equal(_run(after, x), _run(before, x))


def _round_trip(inner: str, outer: str, layout: bool = True):
    """``x`` (float16 / bfloat16 / float32) cast to ``inner``, laid out as the attention passes hand an output back,
    then cast to ``outer``."""
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n, 4, 16], "bfloat16" if inner == "float32" else "float32"))
    with bb.function("f", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.astype(x, inner))
            if layout:
                y = bb.emit(relax.op.reshape(bb.emit(relax.op.permute_dims(y, [1, 0, 2])), [1, 4, n, 16]))
                y = bb.emit(relax.op.reshape(bb.emit(relax.op.permute_dims(y, [0, 2, 1, 3])), [1, n, 64]))
            o = bb.emit_output(bb.emit(relax.op.astype(y, outer)))
        bb.emit_func_output(o)
    return bb.get()


@pytest.mark.parametrize("layout", [True, False])
def test_exact_cast_round_trip_is_dropped(layout):
    """bfloat16 -> float32 -> (reshapes, permutes) -> bfloat16: no cast left, the same values (float32 holds every
    bfloat16)."""
    before = _round_trip("float32", "bfloat16", layout)
    after = relax.transform.DeadCodeElimination(["f"])(SimplifyLayout()(before))
    assert _ops(before).count("relax.astype") == 2 and "relax.astype" not in _ops(after)
    assert "relax.permute_dims" not in _ops(after)
    xs = np.random.default_rng(4).standard_normal((3, 4, 16)).astype(np.float32)
    xb = _cast_module("bfloat16")(tvm.runtime.tensor(xs))  # bfloat16 input, made by a cast module
    run = lambda mod: relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())["f"](xb)  # noqa: E731
    np.testing.assert_array_equal(_as_f32(run(after)), _as_f32(run(before)))


def _cast_module(dtype):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([3, 4, 16], "float32"))
    with bb.function("f", [x]):
        with bb.dataflow():
            o = bb.emit_output(bb.emit(relax.op.astype(x, dtype)))
        bb.emit_func_output(o)
    return relax.VirtualMachine(tvm.compile(bb.get(), target="llvm"), tvm.cpu())["f"]


def _as_f32(t):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(list(t.shape), str(t.dtype)))
    with bb.function("f", [x]):
        with bb.dataflow():
            o = bb.emit_output(bb.emit(relax.op.astype(x, "float32")))
        bb.emit_func_output(o)
    return relax.VirtualMachine(tvm.compile(bb.get(), target="llvm"), tvm.cpu())["f"](t).numpy()


@pytest.mark.parametrize("inner,outer", [("bfloat16", "float32"), ("float16", "float32")])
def test_lossy_cast_round_trip_stays(inner, outer):
    """float32 -> bfloat16 / float16 -> float32 rounds: both casts stay."""
    after = relax.transform.DeadCodeElimination(["f"])(SimplifyLayout()(_round_trip(inner, outer)))
    assert _ops(after).count("relax.astype") == 2


def test_widening_to_another_dtype_stays():
    """bfloat16 -> float32 -> float16 is not a round trip: one cast at least stays."""
    after = relax.transform.DeadCodeElimination(["f"])(SimplifyLayout()(_round_trip("float32", "float16")))
    assert "relax.astype" in _ops(after)
