"""Helpers shared by the tests (importable as ``moec_testing``)."""

from __future__ import annotations

import numpy as np
import torch

# (name, factory) for every test model; HF families use their own transformers classes
ATOL = 2e-4  # fp32 logits, compiled (llvm) vs torch / onnxruntime


def make_model(name: str):
    from moec.models import build_reference, get_config
    from moec.models.hf import tiny_hf_model

    if name.startswith("hf-"):
        m = tiny_hf_model(name[3:])
        return m, m.config.vocab_size
    cfg = get_config(name)
    return build_reference(cfg), cfg.vocab_size


def torch_last_logits(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens), dtype=torch.long))
    out = out.logits if hasattr(out, "logits") else out
    return out[0, -1].numpy()


def ort_last_logits(session, tokens: list[int]) -> np.ndarray:
    ids = np.asarray([tokens], dtype=np.int64)
    return session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0][0, -1]


class ModelZoo:
    """Exports and compiles lazily, caching per (model, path).

    ``shared``: a directory that every process of the run sees (pytest-xdist's workers): the exports and artifacts
    go there, each made once for the run by the first process to ask (a file lock; the others wait for it), since
    the models are seeded and every process builds the same ones. Without it, ``root`` (this process's) holds them.
    """

    def __init__(self, root, shared=None) -> None:
        self.root = root
        self.shared = shared
        self.models = {}
        self.imports = {}
        self.artifacts = {}

    def model(self, name):
        if name not in self.models:
            self.models[name] = make_model(name)
        return self.models[name]

    def _once(self, target):
        """A lock held while ``target`` is made (``shared`` only: within one process nothing races)."""
        import contextlib

        if self.shared is None:
            return contextlib.nullcontext()
        from filelock import FileLock

        return FileLock(str(target) + ".lock")

    def source(self, name, path):
        import os

        from moec.models.export import save_onnx, save_pt2

        f = (self.shared or self.root) / f"{name}.{path}"
        if not f.exists():
            with self._once(f):
                if not f.exists():  # written under a private name, then renamed: the file is whole once it exists
                    model, vocab = self.model(name)
                    tmp = self.root / "partial"
                    tmp.mkdir(exist_ok=True)
                    os.replace((save_onnx if path == "onnx" else save_pt2)(model, vocab, tmp / f.name), f)
        return f

    def imported(self, name, path):
        """``import_model`` of the export, once per session: ``moec.compile`` takes it as it takes the file (a .pt2
        import, torch's decompositions, is most of a tiny model's build)."""
        from moec.compiler.importers import import_model

        key = (name, path)
        if key not in self.imports:
            self.imports[key] = import_model(self.source(name, path))
        return self.imports[key]

    def artifact(self, name, path):
        import moec

        key = (name, path)
        if key not in self.artifacts:
            out = (self.shared or self.root) / f"art-{name}-{path}"
            with self._once(out):
                if not (out / "manifest.json").exists():  # (moec.compile writes the directory atomically)
                    moec.compile(self.imported(name, path), out, target="llvm")
            self.artifacts[key] = out
        return self.artifacts[key]


def prefill_and_decode(artifact, prompts=((5, 6, 7, 8, 9, 10, 11), (12, 13, 14)), steps=3):
    """Greedy prefill then ``steps`` decode steps of a compiled artifact: (stacked logits, token histories)."""
    import moec

    engine = moec.load(artifact)
    seqs, logits = engine.prefill([list(p) for p in prompts])
    out, histories = [logits], [list(p) for p in prompts]
    for _ in range(steps):
        nxt = logits.argmax(-1)
        for h, t in zip(histories, nxt):
            h.append(int(t))
        logits = engine.decode(seqs, nxt)
        out.append(logits)
    return np.stack(out), histories


def require_cuda() -> None:
    """Skip the calling test unless TVM sees a CUDA device (loads TVM's CUDA runtime first)."""
    import pytest
    import tvm

    from moec.runtime.engine import _load_cuda_runtime

    try:
        _load_cuda_runtime()
    except OSError:  # no CUDA driver here
        pytest.skip("no CUDA device")
    if not tvm.cuda(0).exist:
        pytest.skip("no CUDA device")
