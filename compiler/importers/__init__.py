"""Model importers: ONNX files and PyTorch programs to a Relax IRModule with detached weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tvm

from ..artifact import sha256_file as file_sha256  # noqa: F401 - re-exported for the importers


@dataclass
class ImportedModel:
    """A whole-sequence forward ``main(input_ids, [attention_mask], *weights) -> logits`` in Relax.

    ``weights`` holds the detached parameters in the order of ``main``'s trailing params.
    """

    mod: tvm.IRModule
    weights: list[np.ndarray]
    source_kind: str  # "onnx" | "torch"
    source_name: str
    source_hash: str
    num_inputs: int
    meta: dict = field(default_factory=dict)

    @property
    def main(self) -> "tvm.relax.Function":
        return self.mod["main"]

    def weight_names(self) -> list[str]:
        return [p.name for p in list(self.main.params)[self.num_inputs:]]


def bind_scalar_weights(mod: tvm.IRModule, weights: list[np.ndarray], num_inputs: int) -> tuple[tvm.IRModule, list[np.ndarray]]:
    """Fold one-element weights (exporter constants such as the softmax scale) into the graph."""
    from tvm import relax

    func = mod["main"]
    params = list(func.params)[num_inputs:]
    binds = {p: relax.const(w.reshape(w.shape), str(w.dtype)) for p, w in zip(params, weights) if w.size <= 1}
    if not binds:
        return mod, weights
    keep = [w for p, w in zip(params, weights) if p not in binds]
    out = tvm.IRModule({"main": func.bind_params(binds)})
    for gv, f in mod.functions_items():  # the frontend's other functions (e.g. TIR the ONNX importer emitted)
        if gv.name_hint != "main":
            out[gv] = f
    return out, keep


def import_model(source, example_inputs=None) -> ImportedModel:
    """Import an ONNX path, a ``.pt2`` path, an ``ExportedProgram`` or an ``nn.Module``."""
    from . import onnx as onnx_importer
    from . import torch as torch_importer

    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.suffix == ".onnx":
            return onnx_importer.import_onnx(path)
        if path.suffix in (".pt2", ".pt"):
            return torch_importer.import_pt2(path)
        from ..errors import ImportFailure

        raise ImportFailure(f"{path}: unknown model format (expected .onnx or .pt2)")
    return torch_importer.import_torch(source, example_inputs)
