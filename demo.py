"""The main job on a built-in model: export, compile, load, generate, print timings."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np


def run_demo(model: str = "tiny", output: str = "artifacts/demo", target: str = "llvm", arch: str | None = None,
             device: str = "cpu", batch: int = 4, new_tokens: int = 32) -> int:
    from .compiler.build import compile as moec_compile
    from .models import build_reference, get_config
    from .models.export import save_onnx
    from .runtime.engine import load

    cfg = get_config(model)
    t0 = time.perf_counter()
    ref = build_reference(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = save_onnx(ref, cfg.vocab_size, Path(tmp) / f"{model}.onnx")
        t_export = time.perf_counter() - t0
        print(f"[demo] exported reference '{model}' ({cfg.num_parameters() / 1e6:.2f}M params) to ONNX in {t_export:.1f}s")
        t1 = time.perf_counter()
        moec_compile(onnx_path, output, target=target, arch=arch, progress=True)
        t_compile = time.perf_counter() - t1
    t2 = time.perf_counter()
    engine = load(output, device=device)
    t_load = time.perf_counter() - t2
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, cfg.vocab_size, size=8 + 4 * i)) for i in range(batch)]
    t3 = time.perf_counter()
    seq_ids, logits = engine.prefill(prompts)
    t_prefill = time.perf_counter() - t3
    tokens = logits.argmax(-1)
    step_times = []
    for _ in range(new_tokens - 1):
        s = time.perf_counter()
        logits = engine.decode(seq_ids, tokens)
        step_times.append(time.perf_counter() - s)
        tokens = logits.argmax(-1)
    for s in seq_ids:
        engine.release(s)
    steps = np.array(step_times) * 1e3
    print(f"[demo] compile {t_compile:.1f}s, load {t_load * 1e3:.0f} ms, prefill {batch} prompts {t_prefill * 1e3:.1f} ms")
    print(f"[demo] decode batch {batch}: {len(steps)} steps, median {np.median(steps):.2f} ms/step, "
          f"{batch / np.median(steps) * 1e3:.0f} tokens/s on {device}")
    check = engine.generate(prompts[:1], 8)
    print(f"[demo] greedy continuation of prompt 0: {check[0]}")
    return 0
