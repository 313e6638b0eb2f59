"""PyTorch (``nn.Module`` + example inputs, ``ExportedProgram`` or a ``.pt2`` file) -> Relax."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from ..errors import ImportFailure
from . import ImportedModel, bind_scalar_weights, file_sha256


def _amax(node, importer):
    from tvm import relax

    x = importer.env[node.args[0]]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", [])
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    axis = [dim] if isinstance(dim, int) else (list(dim) or None)
    return importer.block_builder.emit(relax.op.max(x, axis=axis, keepdims=keepdim))


def _topk(node, importer):
    """``topk`` also with ``sorted=False`` (DeepSeek-V3's routers): any order is a valid result, so the sorted one is."""
    from tvm import relax

    args = importer.retrieve_args(node)
    k = args[1] if len(args) > 1 else node.kwargs.get("k", 1)
    dim = args[2] if len(args) > 2 else node.kwargs.get("dim", -1)
    largest = args[3] if len(args) > 3 else node.kwargs.get("largest", True)
    return importer.block_builder.emit(relax.op.topk(args[0], k=k, axis=dim, largest=largest, ret_type="both", dtype="int64"))


def _int_clamp(name: str):
    """``clamp`` / ``clamp_min`` / ``clamp_max`` of an integer tensor by numbers (positions clamped at 0): the stock
    converter emits ``clip`` with an infinite open bound, whose legalization cannot cast infinity to an integer; two
    comparisons by integer constants do the same. Float tensors, and tensor bounds, take the stock converter."""

    def convert(node, importer):
        from tvm import relax

        args = importer.retrieve_args(node)
        x = args[0]
        dtype = str(x.ty.dtype) if hasattr(x.ty, "dtype") else ""
        lo = args[1] if len(args) > 1 else node.kwargs.get("min")
        hi = args[2] if len(args) > 2 else node.kwargs.get("max")
        if name == "clamp_max":
            lo, hi = None, lo
        elif name == "clamp_min":
            hi = None
        numbers = all(b is None or isinstance(b, (int, float)) and not isinstance(b, bool) for b in (lo, hi))
        if not dtype.startswith(("int", "uint")) or not numbers:
            return getattr(importer, f"_{name}")(node)
        import math

        if lo is not None and math.isfinite(lo):
            x = importer.block_builder.emit(relax.op.maximum(x, relax.const(math.ceil(lo), dtype)))
        if hi is not None and math.isfinite(hi):
            x = importer.block_builder.emit(relax.op.minimum(x, relax.const(math.floor(hi), dtype)))
        return x

    return convert


# ops the stock frontend lacks that MoE routers use (group scores in group-limited routing, unsorted top-k), and
# integer clamps it legalizes through an infinite bound
EXTRA_CONVERTERS = {"amax.default": _amax, "topk.default": _topk, "clamp.default": _int_clamp("clamp"),
                    "clamp_min.default": _int_clamp("clamp_min"), "clamp_max.default": _int_clamp("clamp_max")}


def _host_array(value: torch.Tensor):
    """A weight as a NumPy array on the host, sharing the tensor's memory where it can; bfloat16 as ``ml_dtypes``
    (through an int16 view: DLPack export of bfloat16, and ``Tensor.numpy()`` of it, vary between torch builds)."""
    import ml_dtypes

    t = value.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    t = t.cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _storage_key(value: torch.Tensor):
    """What makes two weights the same tensor (tied weights: one storage seen under several names)."""
    if value.layout != torch.strided or value.device.type == "meta":
        return None
    return (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), tuple(value.stride()), value.dtype)


def _importer(param_keys: set):
    """TVM's importer with the weight conversion replaced. Buffers and constants (bound into the graph) become
    TVM host tensors of their values. Parameters (kept as inputs) become empty TVM tensors of their shape and
    dtype, which is all the importer reads of them, with the host array behind each in ``sources`` (by handle):
    a model's weights are not copied into TVM memory and back."""
    import tvm
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    converted, sources = {}, {}  # storage key -> TVM tensor (a tied weight is converted once); handle -> array

    def convert(value: torch.Tensor):
        key = _storage_key(value)
        if key is not None and key in converted:
            return converted[key]
        arr = _host_array(value)
        if key is not None and key in param_keys:
            out = tvm.runtime.empty(arr.shape, str(arr.dtype))
            sources[out.__chandle__()] = arr
        else:
            out = tvm.runtime.tensor(arr)
        if key is not None:
            converted[key] = out
        return out

    class Importer(ExportedProgramImporter):
        _convert_pytorch_tensor_to_tvm = staticmethod(convert)
        node = None  # the node being converted (for messages)

        def create_convert_map(self):
            def track(fn):
                def converter(node, *args):
                    self.node = node
                    return fn(node, *args)
                return converter
            return {k: track(fn) for k, fn in super().create_convert_map().items()}

    return Importer(), sources


def _node_where(node) -> str:
    """`` at node 'name' (op, file:line of the model's source)`` for messages, or ''."""
    if node is None:
        return ""
    import re

    lines = re.findall(r'File "([^"]+)", line (\d+)', (node.meta or {}).get("stack_trace") or "")
    src = f", {Path(lines[-1][0]).name}:{lines[-1][1]}" if lines else ""
    target = getattr(node.target, "__name__", str(node.target))
    return f" at node {node.name!r} ({target}{src})"


def merge_tied_weights(mod, params: list, num_inputs: int):
    """One parameter per distinct weight: ``main``'s parameters whose host tensors are the same object (tied
    weights, e.g. an LM head sharing the embedding, or layers sharing one layer's weights) become one."""
    func = mod["main"]
    first, binds, keep = {}, {}, []
    for var, t in zip(list(func.params)[num_inputs:], params):
        handle = t.__chandle__()
        if handle in first:
            binds[var] = first[handle]
        else:
            first[handle] = var
            keep.append(t)
    if not binds:
        return mod, params
    import tvm

    return tvm.IRModule({"main": func.bind_params(binds)}), keep


def _check_ops(ep: torch.export.ExportedProgram, name: str) -> None:
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    convert_map = dict(ExportedProgramImporter().create_convert_map(), **EXTRA_CONVERTERS)
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        key = target.__name__ if hasattr(target, "__name__") else str(target)
        if key not in convert_map:
            raise ImportFailure(f"{name}: node {node.name!r} uses op {key}, which moec cannot import")


def import_exported_program(ep: torch.export.ExportedProgram, name: str = "<ExportedProgram>", source_hash: str | None = None) -> ImportedModel:
    from tvm.relax.frontend import detach_params

    ep = ep.run_decompositions()
    _check_ops(ep, name)
    user_inputs = [s for s in ep.graph_signature.input_specs if s.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    importer, sources = _importer({_storage_key(p) for _, p in ep.named_parameters()} - {None}
                                  - {_storage_key(b) for _, b in ep.named_buffers()})
    try:  # TVM's from_exported_program with the weights converted by _importer's (decomposed above)
        mod = importer.from_exported_program(ep, True, True, False, EXTRA_CONVERTERS)  # keep params as inputs, unwrap
    except Exception as exc:
        msg = str(exc).strip().splitlines()
        raise ImportFailure(f"{name}: torch.export to Relax conversion failed{_node_where(importer.node)}: "
                            f"{msg[-1] if msg else type(exc).__name__}") from None
    mod, params = detach_params(mod)
    mod, main_params = merge_tied_weights(mod, list(params.get("main", [])), len(user_inputs))
    weights = [sources[p.__chandle__()] if p.__chandle__() in sources else p.numpy() for p in main_params]
    mod, weights = bind_scalar_weights(mod, weights, len(user_inputs))
    if source_hash is None:
        h = hashlib.sha256()
        for w in weights:
            h.update(np.ascontiguousarray(w).reshape(-1).view(np.uint8).data)  # the bytes, not a copy of them
        h.update(str(ep.graph).encode())
        source_hash = h.hexdigest()
    return ImportedModel(
        mod=mod, weights=weights, source_kind="torch", source_name=name, source_hash=source_hash,
        num_inputs=len(user_inputs), meta={"inputs": [s.arg.name for s in user_inputs]},
    )


def import_pt2(path: str | Path) -> ImportedModel:
    path = Path(path)
    if not path.exists():
        raise ImportFailure(f"{path}: no such file")
    try:
        ep = torch.export.load(str(path))
    except Exception as exc:
        raise ImportFailure(f"{path}: not a readable torch.export (.pt2) file (truncated or corrupt?): {type(exc).__name__}") from None
    return import_exported_program(ep, str(path), file_sha256(path))


def import_torch(model, example_inputs=None) -> ImportedModel:
    """Import an ``ExportedProgram``, or export ``model(input_ids, attention_mask)`` with dynamic axes first."""
    if isinstance(model, torch.export.ExportedProgram):
        return import_exported_program(model)
    if not isinstance(model, torch.nn.Module):
        raise ImportFailure(f"cannot import an object of type {type(model).__name__}: expected an nn.Module or ExportedProgram")
    from ...models.export import dynamic_shapes_for, to_exported_program

    if example_inputs is not None:
        inputs = tuple(example_inputs)
        if len(inputs) not in (1, 2):
            raise ImportFailure("example_inputs must be (input_ids,) or (input_ids, attention_mask)")
        try:
            with torch.no_grad():
                ep = torch.export.export(model.eval(), inputs, dynamic_shapes=dynamic_shapes_for(len(inputs)))
        except Exception as exc:
            raise _export_failure(model, exc) from None
        return import_exported_program(ep, type(model).__name__)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        raise ImportFailure("nn.Module import needs example_inputs (input_ids[, attention_mask]) or model.config.vocab_size")
    try:
        ep = to_exported_program(model, vocab)
    except Exception as exc:
        raise _export_failure(model, exc) from None
    return import_exported_program(ep, type(model).__name__)


def _export_failure(model, exc: Exception) -> ImportFailure:
    """torch.export's refusal as one message: its first line, the model's source line it names, and for
    data-dependent control flow (HF's per-expert loops over ``nonzero()``) what to change."""
    import re

    text = str(exc)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    where = re.findall(r'File "([^"]+)", line (\d+), in (\w+)\n\s*(.+)', text)
    at = f" at {Path(where[-1][0]).name}:{where[-1][1]} ({where[-1][3].strip()})" if where else ""
    hint = ""
    if "data-dependent" in text or "GuardOnDataDependent" in type(exc).__name__:
        hint = (": the forward branches on tensor values (e.g. a loop over the experts that received tokens); for HF "
                "models pass experts_implementation=\"batched_mm\" where the family supports it (the default grouped_mm "
                "and eager forms are not exportable)")
    return ImportFailure(f"torch.export of {type(model).__name__} with dynamic batch/sequence axes failed{at}: "
                         f"{lines[0] if lines else type(exc).__name__}{hint}")
