"""Export helpers: a model with ``forward(input_ids, attention_mask)`` to ONNX or ``torch.export``.

Both exports carry dynamic batch and sequence axes, the way users export their own models.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import nn

# ONNX protobufs are limited to 2 GB: larger models keep their weights in an external data file.
_EXTERNAL_DATA_BYTES = 1 << 30


class LogitsOnly(nn.Module):
    """Wraps a causal LM (reference or HF transformers) to return only the logits tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        params = inspect.signature(model.forward).parameters
        self._takes_use_cache = "use_cache" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        kwargs = {"use_cache": False} if self._takes_use_cache else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        return out.logits if hasattr(out, "logits") else out


def example_inputs(vocab_size: int, batch: int = 2, seq: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=gen)
    return ids, torch.ones_like(ids)


def _dynamic_shapes(max_seq: int):
    batch = torch.export.Dim("batch", min=1, max=1024)
    seq = torch.export.Dim("seq", min=2, max=max(max_seq, 3))
    return {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}


def dynamic_shapes_for(num_inputs: int, max_seq: int = 4096) -> tuple:
    """Positional dynamic shapes for a module called as ``forward(input_ids[, attention_mask])``."""
    batch = torch.export.Dim("batch", min=1, max=1024)
    seq = torch.export.Dim("seq", min=2, max=max(max_seq, 3))
    return tuple({0: batch, 1: seq} for _ in range(num_inputs))


def _hinted_shapes(max_seq: int):
    """The same axes as dimension hints (ranges, no names): guards torch adds while tracing are kept as
    guards instead of failing the export."""
    batch = torch.export.Dim.DYNAMIC(min=1, max=1024)
    seq = torch.export.Dim.DYNAMIC(min=2, max=max(max_seq, 3))
    return {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}


def to_exported_program(model: nn.Module, vocab_size: int, max_seq: int = 4096) -> torch.export.ExportedProgram:
    """``torch.export`` of ``model`` with dynamic batch and sequence axes.

    Named dimensions first; where torch's tracing adds a guard on them that its solver cannot prove over the
    whole range (torch 2.11 with Mixtral at 4104 positions: ``min(128 s, 512 s) == 128 s``, true for every
    s >= 0), the export is retried with range hints, which keep such guards instead of refusing them."""
    wrapped = LogitsOnly(model).eval()
    with torch.no_grad():
        try:
            return torch.export.export(wrapped, example_inputs(vocab_size), dynamic_shapes=_dynamic_shapes(max_seq))
        except torch._dynamo.exc.UserError as exc:
            if "Constraints violated" not in str(exc):
                raise
        return torch.export.export(wrapped, example_inputs(vocab_size), dynamic_shapes=_hinted_shapes(max_seq))


def save_pt2(model: nn.Module, vocab_size: int, path: str | Path, max_seq: int = 4096) -> Path:
    path = Path(path)
    torch.export.save(to_exported_program(model, vocab_size, max_seq), str(path))
    return path


def save_onnx(model: nn.Module, vocab_size: int, path: str | Path, max_seq: int = 4096, dynamic: bool = True) -> Path:
    """Export to ONNX with the dynamo exporter (external data for models over 1 GiB)."""
    path = Path(path)
    wrapped = LogitsOnly(model).eval()
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with torch.no_grad():
        program = torch.onnx.export(
            wrapped,
            example_inputs(vocab_size),
            dynamo=True,
            input_names=["input_ids", "attention_mask"],
            output_names=["logits"],
            dynamic_shapes=_dynamic_shapes(max_seq) if dynamic else None,
            optimize=True,
            verbose=False,
        )
    program.save(str(path), external_data=n_bytes > _EXTERNAL_DATA_BYTES)
    return path
