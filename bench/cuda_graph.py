"""Decode steps with and without CUDA graphs on the GPU: one artifact, two engines, the same tokens.

  python bench/cuda_graph.py prepare DIR                               # here: tiny model for sm_90, --cuda-graph
  python3 bench/cuda_graph.py run DIR --json OUT --commit SHA          # GPU machine, runtime-only TVM
  python3 bench/cuda_graph.py run DIR --olmoe-layers 2 --json OUT ...  # also the OLMoE-1B-7B shape (compiler staged)

``prepare`` compiles the built-in ``tiny`` model (ONNX) for sm_90 with ``cuda_graph=True`` and the paged,
fp8 and tiered caches. ``run`` loads each artifact twice, ``cuda_graph=True`` and ``cuda_graph=False``
(the artifact's plain ``decode``: the same kernels), prefills the same prompts into both and runs the
decode steps in lockstep, both engines fed the graph engine's greedy tokens. Per step it records
each engine's time (the step up to logits on the device, device synchronised) and the largest logit
difference; the checks are that every graph-engine step ran through the graphs and that the logits
agree (max abs difference <= 1e-3 of the logit scale; greedy agreement is recorded). Midway it
releases some streams, so that a second batch size is captured and replayed too. After the timed
steps, one step per engine runs under ``Engine.kernel_profile`` to count the VM's calls (kernel
launches and builtins) that remain on the host.

With ``--olmoe-layers L`` the OLMoE-1B-7B shape (HF class, seeded random weights, bfloat16) at L
layers is also exported and compiled on the GPU machine (needs the staged compiler: ``install.sh full``)
with the tiered cache and graph bounds of ``--streams`` x ``--context``, and measured the same way
at that many streams (prompts of ``--context`` minus the steps).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

TINY_CACHES = ("paged", "fp8", "tiered")
STEPS = 48
DROP_AT = 24  # step at which the last DROP streams are released (a second batch size is captured)
DROP = 3
REL_TOL = 1e-3


def prepare(out: Path, caches=TINY_CACHES, cuda_graph: bool = True) -> None:
    """The built-in ``tiny`` model (ONNX) compiled for sm_90 into ``out/tiny-<cache>`` for each of ``caches``."""
    import moec
    from moec.models import build_reference, get_config
    from moec.models.export import save_onnx

    out.mkdir(parents=True, exist_ok=True)
    cfg = get_config("tiny")
    onnx_path = out / "tiny.onnx"
    save_onnx(build_reference(cfg), cfg.vocab_size, onnx_path)
    for cache in caches:
        moec.compile(onnx_path, out / f"tiny-{cache}", target="cuda", arch="sm_90", kv_cache=cache, cuda_graph=cuda_graph,
                     progress=True)
    onnx_path.unlink()


def _profile_step(engine, seqs, tokens) -> dict:
    with engine.kernel_profile() as acc:
        engine._decode_step(seqs, tokens, on_device=True)
        engine.device.sync()
    builtins = {k: n for k, (n, _) in acc.items() if k.startswith("vm.builtin.")}
    kernels = {k: n for k, (n, _) in acc.items() if not k.startswith("vm.builtin.")}
    return {"vm_calls": sum(n for n, _ in acc.values()), "kernel_calls": sum(kernels.values()),
            "builtin_calls": sum(builtins.values()), "builtins": dict(sorted(builtins.items(), key=lambda kv: -kv[1])),
            "kernel_calls_by_name": kernels}  # device kernels and the VM's host shape functions


def measure(art: Path, prompts: list[list[int]], steps: int, drop_at: int | None, max_batch: int, max_total: int) -> dict:
    """Both engines over ``art``; see the module docstring."""
    import moec

    engines = {"graph": moec.load(art, device="cuda", cuda_graph=True, max_batch=max_batch, max_total_tokens=max_total),
               "plain": moec.load(art, device="cuda", cuda_graph=False, max_batch=max_batch, max_total_tokens=max_total)}
    seqs, first = {}, {}
    for name, e in engines.items():
        seqs[name], first[name] = e.prefill(prompts)
    nxt = first["graph"].argmax(-1)
    times = {name: [] for name in engines}
    max_err, scale, agree, rows, exact = 0.0, 0.0, 0, 0, 0
    batches = []
    for step in range(steps):
        if drop_at is not None and step == drop_at:
            for name, e in engines.items():
                for s in seqs[name][-DROP:]:
                    e.release(s)
                seqs[name] = seqs[name][:-DROP]
            nxt = nxt[:-DROP]
        batches.append(len(nxt))
        logits = {}
        for name, e in engines.items():
            e.device.sync()
            t = time.perf_counter()
            out = e._decode_step(seqs[name], [int(x) for x in nxt], on_device=True)
            e.device.sync()
            times[name].append(time.perf_counter() - t)
            logits[name] = out.numpy()[0]
        g, p = logits["graph"], logits["plain"]
        max_err = max(max_err, float(np.abs(g - p).max()))
        scale = max(scale, float(np.abs(p).max()))
        agree += int((g.argmax(-1) == p.argmax(-1)).sum())
        exact += int(np.array_equal(g, p))
        rows += len(g)
        nxt = g.argmax(-1)
    profiles = {name: _profile_step(e, seqs[name], [int(x) for x in nxt]) for name, e in engines.items()}
    graph_steps = engines["graph"].graph_steps
    ms = {name: 1e3 * np.asarray(t) for name, t in times.items()}
    # the first step of each batch size captures (two runs of the captured region, then instantiation): apart
    capture = [i for i in range(steps) if i == 0 or batches[i] != batches[i - 1]]
    steady = [i for i in range(steps) if i not in capture]
    res = {
        "artifact": art.name, "kv_cache": engines["graph"].kv_cache, "streams": batches[0], "batch_sizes": sorted(set(batches)),
        "steps": steps, "graph_steps": graph_steps, "graph_steps_expected": steps + 1,
        "step_ms_median": {n: float(np.median(m[steady])) for n, m in ms.items()},
        "step_ms_p90": {n: float(np.percentile(m[steady], 90)) for n, m in ms.items()},
        "capture_steps_ms": {n: [float(m[i]) for i in capture] for n, m in ms.items()},
        "speedup_median": float(np.median(ms["plain"][steady]) / np.median(ms["graph"][steady])),
        "step_ms": {n: [round(float(x), 4) for x in m] for n, m in ms.items()},
        "max_abs_logit_diff": max_err, "logit_scale": scale, "bitwise_equal_steps": f"{exact}/{steps}",
        "greedy_agreement": f"{agree}/{rows}", "profile_one_step": profiles,
        "cuda_graph_manifest": engines["graph"].manifest["options"]["cuda_graph"],
    }
    res["passed"] = bool(graph_steps == steps + 1 and max_err <= REL_TOL * max(scale, 1e-6))
    for e in engines.values():
        del e
    return res


def _olmoe_artifact(work: Path, layers: int, streams: int, context: int) -> Path:
    import moec
    from moec.compiler.serve_bench import build_hf
    from moec.models.export import save_pt2
    from moec.passes.cuda_graph import GraphBounds

    art = work / f"olmoe-{layers}l-tiered"
    if (art / "manifest.json").exists():
        return art
    work.mkdir(parents=True, exist_ok=True)
    model = build_hf("olmoe-1b-7b", "bfloat16", "cpu", 0, layers)
    pt2 = work / "model.pt2"
    save_pt2(model, model.config.vocab_size, pt2, max_seq=context + 8)
    del model
    t = time.perf_counter()
    moec.compile(pt2, art, target="cuda", arch="sm_90", kv_cache="tiered",
                 cuda_graph=GraphBounds(max_batch=streams, max_context=context), progress=True)
    print(f"[cuda_graph] compiled OLMoE {layers}l in {time.perf_counter() - t:.0f}s", flush=True)
    return art


def run(root: Path, json_out: Path | None, commit: str, olmoe_layers: int | None, streams: int, context: int,
        olmoe_steps: int, work: Path) -> int:
    import torch

    results = []
    rng = np.random.default_rng(0)
    tiny_prompts = [list(rng.integers(3, 256, n)) for n in (300, 170, 45, 260, 9, 130, 210, 400)]  # tier-2 pages, re-ranks
    for cache in TINY_CACHES:
        art = root / f"tiny-{cache}"
        if not art.is_dir():
            continue
        r = measure(art, tiny_prompts, STEPS, DROP_AT, max_batch=16, max_total=8192)
        results.append({"model": "tiny", **r})
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("step_ms", "cuda_graph_manifest")}), flush=True)
    if olmoe_layers:
        art = _olmoe_artifact(work, olmoe_layers, streams, context)
        prompts = [list(p) for p in rng.integers(3, 50304, (streams, context - olmoe_steps - 1))]
        r = measure(art, prompts, olmoe_steps, None, max_batch=streams, max_total=streams * (context + 16))
        results.append({"model": f"olmoe-1b-7b-{olmoe_layers}l", **r})
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("step_ms", "cuda_graph_manifest")}), flush=True)
    doc = {
        "benchmark": "cuda_graph",
        "command": "here: python bench/cuda_graph.py prepare .devcarry/cg; there (carry .devcarry/base, .devcarry/cg): "
                   "source bench/device_env.sh && python3 bench/cuda_graph.py run .devcarry/cg --json $OUT/cuda_graph.json "
                   f"--commit {commit}" + (f" --olmoe-layers {olmoe_layers} --streams {streams} --context {context}"
                                           if olmoe_layers else ""),
        "argv": sys.argv[1:],
        "git_commit": commit,
        "device": torch.cuda.get_device_name(0),
        "tvm_runtime_only": os.environ.get("TVM_USE_RUNTIME_LIB") == "1",
        "python": platform.python_version(),
        "check": f"every graph-engine step through decode_graph; max abs logit difference <= {REL_TOL} x logit scale",
        "results": results,
    }
    if json_out:
        json_out.write_text(json.dumps(doc, indent=2))
    return 0 if results and all(r["passed"] for r in results) else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=["prepare", "run"])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--olmoe-layers", type=int, default=None, help="also the OLMoE-1B-7B shape at this many layers")
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--olmoe-steps", type=int, default=32)
    ap.add_argument("--work", type=Path, default=Path("/tmp/moec-cuda-graph"))
    args = ap.parse_args()
    if args.step == "prepare":
        prepare(args.dir)
        return 0
    commit = args.commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    return run(args.dir, args.json, commit, args.olmoe_layers, args.streams, args.context, args.olmoe_steps, args.work)


if __name__ == "__main__":
    sys.exit(main())
