"""ONNX -> Relax, with fixes for symbolic shapes that TVM's ONNX frontend loses.

Exports with dynamic batch/sequence axes compute ``Range(0, Shape(x)[1])`` for positions and reshape
scalar shape values to 1-D; the stock converters turn these into fresh, unrelated shape variables or
fail. The two converters below keep the sequence length symbolic so later passes can rewrite the graph.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import onnx
import tvm
from tvm import relax

from ..errors import ImportFailure
from . import ImportedModel, bind_scalar_weights, file_sha256


def _scalar(value):
    if isinstance(value, tvm.ir.GenericConst) and value.value.numpy().size == 1:
        return value.value.numpy().item()
    return value


@contextlib.contextmanager
def _symbolic_shape_converters():
    from tvm.relax.frontend.onnx import onnx_frontend as of

    orig_range = of.Range._impl_v12.__func__
    orig_reshape = of.Reshape._impl_v13.__func__

    def range_v12(cls, bb, inputs, attr, params):
        start, limit, delta = (_scalar(of.get_constant(x, params)) for x in inputs)
        if isinstance(start, int) and isinstance(delta, int) and tvm.ir.is_prim_expr(limit):
            return relax.op.arange(start, limit, delta, "int64")  # length stays `limit`, not a new var
        return orig_range(cls, bb, inputs, attr, params)

    def reshape_v13(cls, bb, inputs, attr, params):
        data = inputs[0]
        if tvm.ir.is_prim_expr(data):  # a scalar shape value reshaped to [1] for a shape Concat
            shape = _scalar(of.get_constant(inputs[1], params))
            if shape in (1, -1):
                return relax.ShapeExpr([data])
        return orig_reshape(cls, bb, inputs, attr, params)

    orig_expand = of.Expand._impl_v13.__func__

    def expand_v13(cls, bb, inputs, attr, params):
        data, shape = inputs[0], of.get_constant(inputs[1], params)
        data_shape = getattr(getattr(data, "ty", None), "shape", None)
        if isinstance(shape, tvm.ir.GenericConst) and data_shape is not None:
            # numpy broadcasting against a constant shape keeps symbolic input dims where the target says 1
            target = [int(x) for x in shape.value.numpy().reshape(-1)]
            dims = list(data_shape.values)
            rank = max(len(dims), len(target))
            dims = [1] * (rank - len(dims)) + dims
            target = [1] * (rank - len(target)) + target
            out = [d if t == 1 else t for d, t in zip(dims, target)]
            if len(out) != len(data_shape.values):
                data = bb.normalize(relax.op.reshape(data, dims))
            return relax.op.broadcast_to(data, out)
        return orig_expand(cls, bb, inputs, attr, params)

    orig_topk = of.TopK._impl_v11.__func__

    def topk_v11(cls, bb, inputs, attr, params):
        # sorted=0 (DeepSeek-V3's routers) leaves the order unspecified: the sorted result is a valid one
        return orig_topk(cls, bb, inputs, {**attr, "sorted": 1}, params)

    orig_clip = of.Clip._impl_v13.__func__

    def clip_v13(cls, bb, inputs, attr, params):
        # relax maximum / minimum instead of the stock converter's TE functions, whose fixed buffers do not
        # survive the entries' specialisation (batch bound to 1) and are opaque to the passes
        out = inputs[0]
        for bound, op, for_min in ((inputs[1] if len(inputs) > 1 else None, relax.op.maximum, True),
                                   (inputs[2] if len(inputs) > 2 else None, relax.op.minimum, False)):
            if bound is not None:
                out = bb.normalize(op(out, cls._sanitize_nan_clip_bound(bb, bound, for_min=for_min)))
        return out

    of.Range._impl_v12 = classmethod(range_v12)
    of.Reshape._impl_v13 = classmethod(reshape_v13)
    of.Expand._impl_v13 = classmethod(expand_v13)
    of.TopK._impl_v11 = classmethod(topk_v11)
    of.Clip._impl_v13 = classmethod(clip_v13)
    try:
        yield
    finally:
        of.Range._impl_v12 = classmethod(orig_range)
        of.Reshape._impl_v13 = classmethod(orig_reshape)
        of.Expand._impl_v13 = classmethod(orig_expand)
        of.TopK._impl_v11 = classmethod(orig_topk)
        of.Clip._impl_v13 = classmethod(orig_clip)


def _supported_ops(opset: int) -> set[str]:
    from tvm.relax.frontend.onnx import onnx_frontend as of

    return set(of._get_convert_map().keys())


def load_onnx(path: Path) -> onnx.ModelProto:
    if not path.exists():
        raise ImportFailure(f"{path}: no such file")
    try:
        model = onnx.load(str(path), load_external_data=True)
    except Exception as exc:  # protobuf DecodeError, missing external data, ...
        raise ImportFailure(f"{path}: not a readable ONNX model (truncated or corrupt?): {type(exc).__name__}: {exc}") from None
    if not model.graph.node:
        raise ImportFailure(f"{path}: the ONNX graph has no nodes")
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ImportFailure(f"{path}: invalid ONNX model: {str(exc).splitlines()[0]}") from None
    return model


def import_onnx(path: str | Path) -> ImportedModel:
    """Import an ONNX file (external data next to it is loaded) into Relax."""
    from tvm.relax.frontend import detach_params
    from tvm.relax.frontend.onnx import from_onnx

    path = Path(path)
    model = load_onnx(path)
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=18)
    supported = _supported_ops(opset)
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in supported:
            raise ImportFailure(
                f"{path}: node {node.name or '<unnamed>'!r} uses op {node.domain + '::' if node.domain else ''}{node.op_type}, "
                "which moec cannot import"
            )
    initializers = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    try:
        with _symbolic_shape_converters():
            mod = from_onnx(model, keep_params_in_input=True)
    except Exception as exc:
        msg = str(exc).strip().splitlines()
        raise ImportFailure(f"{path}: ONNX to Relax conversion failed: {msg[-1] if msg else type(exc).__name__}") from None
    mod, params = detach_params(mod)
    weights = [p.numpy() for p in params.get("main", [])]
    mod, weights = bind_scalar_weights(mod, weights, len(inputs))
    return ImportedModel(
        mod=mod, weights=weights, source_kind="onnx", source_name=str(path), source_hash=file_sha256(path),
        num_inputs=len(inputs), meta={"opset": opset, "inputs": [i.name for i in inputs]},
    )
