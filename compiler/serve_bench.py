"""``moec bench``: decode latency of moec and of HF transformers side by side, on the same weights.

  moec bench --shape olmoe-1b-7b --streams 1,16,64,128 --contexts 512,1024,2048,4096
             --systems moec-bf16,moec-fp8,moec-tiered,hf-compile --device cuda --json OUT.json --plot OUT.png

For a named model shape (HF transformers' own class with seeded random weights: speed does not depend
on the values), every system decodes the same random prompts at each grid point (streams S x context
C): a prefill of ``C - steps`` tokens per stream, then ``steps`` greedy decode steps that end at
context C. Per point it records TPOT (median and p99 over the timed steps), TTFT (the batch's
prefill), decode tokens/s (S / median TPOT), device memory in use, KV-cache bytes per token of
context and the bandwidth floor. A moec system's first decode step is not timed (the first call of each kernel
loads it; HF's compiled system has its warm-up steps too), and ``step_ms`` keeps every timed step. moec's timed
steps run pipelined (``Engine.decode_greedy_steps``: each step
enqueued before the previous step's tokens are read back, so the host's work overlaps the device's); with
``--sync-steps`` each step ends with its tokens on the host before the next begins (``decode_greedy``). A moec
system that prefilled also records its timed steps' greedy tokens (``tokens_sha256``) and the share equal to the
first such system's at the point (``tokens_vs``: offloaded experts must agree fully with resident ones). Systems:

  moec-paged | moec-bf16 | moec-fp8 | moec-tiered   the model exported with torch.export and compiled by
                                                    moec with that KV cache (artifacts kept in --work)
                                                    (on CUDA with CUDA graphs, moec compile's default there, bounded
                                                    by the grid's largest streams and context; not with offloaded
                                                    experts)
  moec-<cache>-nograph                              the same with ``--no-cuda-graph``: every kernel launched per step
  moec-<cache>-graph                                the same as moec-<cache> (the graphs, now the default)
  moec-<cache>-fp8experts                           the routed experts' weights in FP8 e4m3 with per-channel
                                                    scales (``--expert-weights fp8``); its floor counts those bytes
  moec-<cache>[-fp8experts]-pdl                     the same built with ``--pdl`` (CUDA: programmatic dependent
                                                    launch of every kernel; fp8 and tiered caches)
  moec-<cache>-offload[-fp8]                        experts offloaded into ``--expert-slots`` device slots,
  moec-<cache>-prefetch[-fp8]                       loaded on demand, or also prefetched; -fp8: stored and
                                                    copied as FP8 codes and scales (``--expert-weights fp8``)
  hf-eager                                          HF forward with a StaticCache, HF's default experts
                                                    implementation (grouped_mm where torch has it), the
                                                    prefill in chunks of 512 positions
  hf-compile                                        the same forward under torch.compile (CUDA graphs
                                                    on the GPU: mode "reduce-overhead"), after warm-up

The floor is the time to read, at the copy bandwidth measured in this run, what one decode step
must read: the non-expert weights, the experts that S tokens activate under uniform routing
(``E (1 - (1 - k/E)^S)`` per layer; routing of random weights is close to uniform), and the KV cache
(S x C tokens at the system's bytes per token). Copy bandwidth counts bytes read plus bytes written.

A system that fails at a point (out of memory, cache exhausted) records the error for that point and
the run goes on; one that cannot be built records why (a compile that leaves MoE layers off the grouped expert
kernels is refused: ``UnreplacedExperts``). The JSON holds the command, git commit and device; the plot shows TPOT against
context, one line per system and stream count.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from .errors import MoecError

SHAPES = {
    # HF OlmoeConfig of OLMoE-1B-7B: 64 experts top-8, 16 layers, d 2048, 16 heads (no GQA), Dh 128
    "olmoe-1b-7b": ("olmoe", dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                                  num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                                  max_position_embeddings=4352, norm_topk_prob=False)),
    # HF MixtralConfig of Mixtral-8x7B: 8 experts top-2, 32 layers, d 4096, 32 heads over 8 KV heads, Dh 128.
    # Its 93 GB of bf16 weights do not fit the GPU machine's disk or host memory: run it with --tie-layers
    "mixtral-8x7b": ("mixtral", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                                     num_experts_per_tok=2, max_position_embeddings=4352, rope_theta=1e6)),
    # small shapes for trying the harness on a CPU
    "tiny-olmoe": ("olmoe", dict(vocab_size=512, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                                 max_position_embeddings=1024, norm_topk_prob=False)),
    "tiny-mixtral": ("mixtral", dict(vocab_size=512, hidden_size=128, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=1024)),
}
_PAGE = 16  # the engine's KV page: each stream holds whole pages
OFFLOAD_SUFFIXES = ("-offload", "-prefetch", "-offload-fp8", "-prefetch-fp8")


def _offloaded(name: str) -> bool:
    return name.endswith(OFFLOAD_SUFFIXES)


def _prefetched(name: str) -> bool:
    return name.endswith(("-prefetch", "-prefetch-fp8"))


def _fp8_experts(name: str) -> bool:
    """Whether a moec system stores the experts as FP8 (resident or offloaded)."""
    return name.removesuffix("-wgmma").removesuffix("-pdl").endswith(("-fp8experts", "-offload-fp8", "-prefetch-fp8"))


SYSTEMS = ("moec-paged", "moec-bf16", "moec-fp8", "moec-tiered", "moec-paged-graph", "moec-bf16-graph", "moec-fp8-graph",
           "moec-tiered-graph", "moec-paged-nograph", "moec-bf16-nograph", "moec-fp8-nograph", "moec-tiered-nograph",
           "moec-tiered-fields", "moec-tiered-half2", "moec-tiered-mma", "moec-tiered-paired", "hf-eager", "hf-compile") + tuple(
    f"moec-{c}-{m}{x}" for c in ("paged", "bf16", "fp8", "tiered") for m in ("offload", "prefetch") for x in ("", "-fp8")) + tuple(
    f"moec-{c}-fp8experts" for c in ("paged", "bf16", "fp8", "tiered")) + tuple(
    f"moec-{c}-{p}" for c in ("paged", "bf16", "fp8", "tiered") for p in ("ptiled", "pstreamed")) + tuple(
    f"moec-{c}{x}-pdl" for c in ("fp8", "tiered") for x in ("", "-fp8experts")) + tuple(
    f"moec-{c}{x}-wgmma" for c in ("bf16", "fp8", "tiered") for x in ("", "-fp8experts"))
# moec-<cache>[-fp8experts]-wgmma: the same compiled for sm_90a (--arch sm_90a), whose linear layers take the wgmma form
# moec-<cache>[-fp8experts]-pdl: the same built with --pdl (every kernel launched with programmatic dependent launch;
# the fp8 and tiered caches only: compile refuses it with TVM's paged cache)
# moec-<cache>-ptiled / -pstreamed: the prefill entry's expert and dense GEMMs both block-tiled / both streamed
# (--prefill-gemm tiled / streamed; the default, auto, tiles the dense projections only)
# moec-<cache>-fp8experts: the routed experts' weights stored as FP8 e4m3 with per-channel scales (--expert-weights fp8;
# not the headline's bf16 weights: a step then reads half the expert bytes, and its floor counts them so)
# moec-<cache>-offload: experts offloaded into --expert-slots device slots, loaded when each layer's router has
# chosen; -prefetch: the same artifact with the next layer's predicted experts loaded ahead; -offload-fp8 / -prefetch-fp8:
# the same with the experts stored and copied as FP8 (--expert-weights fp8: half the bytes); moec-tiered-fields: the
# tiered cache with the decode kernel's 2-bit sums in float32 (--decode-kernel split-fields, the form before the half2 one);
# moec-tiered-half2 / -mma: the decode kernel in the half2 form / on tensor cores (--decode-kernel split-half2 /
# split-mma), whatever the model's heads (moec-tiered takes the form measured faster for them); moec-tiered-paired: both
# tiers' sums in float16 pairs (--decode-kernel split-paired)


def build_hf(shape: str, dtype: str = "float32", device: str = "cpu", seed: int = 0, layers: int | None = None,
             tie_layers: bool = False):
    """The HF model of ``shape`` with seeded random weights, on ``device`` in ``dtype`` (``layers``: that many
    decoder layers instead of the shape's, for a per-layer split at a fraction of the time).

    ``tie_layers``: every decoder layer uses the first layer's weights (``moec.models.hf.tie_layers``), and
    only that layer is ever materialized. A step still reads every layer's weights from device memory
    (a layer's weights are far larger than the GPU's cache), so decode speed is that of the full model,
    while host memory, disk and the artifact hold one layer's weights."""
    import torch
    import transformers as tf

    if shape not in SHAPES:
        raise MoecError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
    family, kw = SHAPES[shape]
    if layers is not None:
        if not isinstance(layers, int) or layers < 1:
            raise MoecError(f"--layers must be a positive integer, got {layers!r}")
        kw = {**kw, "num_hidden_layers": layers}
    cls, cfg_cls = {"olmoe": (tf.OlmoeForCausalLM, tf.OlmoeConfig), "mixtral": (tf.MixtralForCausalLM, tf.MixtralConfig)}[family]
    num_layers = kw["num_hidden_layers"]
    if tie_layers:  # build one layer, then add the others as views of it (their own modules: layer_idx differs)
        kw = {**kw, "num_hidden_layers": 1}
    cfg = cfg_cls(**kw, experts_implementation="batched_mm", attn_implementation="sdpa", pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(cfg)
    model = model.to(getattr(torch, dtype)).eval()
    if tie_layers and num_layers > 1:
        from ..models.hf import tie_layers as tie

        first = model.model.layers[0]
        cfg.num_hidden_layers = num_layers
        if isinstance(getattr(cfg, "layer_types", None), list):
            cfg.layer_types = cfg.layer_types[:1] * num_layers
        with torch.device("meta"):  # parameters replaced by layer 0's below: nothing is allocated
            extra = [type(first)(cfg, layer_idx=i) for i in range(1, num_layers)]
        model.model.layers.extend(extra)
        tie(model)
    return model


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth in bytes/s (read + write), best of several copies."""
    import torch

    n = nbytes // 2 if device == "cuda" else min(nbytes, 1 << 28) // 2
    src = torch.empty(n // 2, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(8):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * src.element_size() / best


def _memory(device: str) -> int | None:
    if device == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info()
        return int(total - free)
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001
        return None


def weight_bytes(model) -> tuple[int, int, int]:
    """(non-expert bytes, bytes of one layer's one expert, experts per layer)."""
    expert = other = 0
    num_experts = model.config.num_experts
    layers = model.config.num_hidden_layers
    for name, p in model.named_parameters(remove_duplicate=False):  # tied layers: each layer reads its copy
        nbytes = p.numel() * p.element_size()
        if ".experts." in name:
            expert += nbytes
        else:
            other += nbytes
    return other, expert // (layers * num_experts), num_experts


def floor_ms(model, streams: int, context: int, kv_bytes_per_token: float, bandwidth: float, fp8_experts: bool = False) -> float:
    cfg = model.config
    other, one_expert, e = weight_bytes(model)
    if fp8_experts:  # e4m3 codes of W1 and W2, and a float32 scale per output channel (2 I + D)
        one_expert = 3 * cfg.hidden_size * cfg.intermediate_size + 4 * (2 * cfg.intermediate_size + cfg.hidden_size)
    k = cfg.num_experts_per_tok
    active = e * (1 - (1 - k / e) ** streams)
    step = other + cfg.num_hidden_layers * active * one_expert + streams * context * kv_bytes_per_token
    return 1e3 * step / bandwidth


def _kv_elements(cfg) -> int:
    """K and V elements per token of context, all layers."""
    dh = cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * dh


# ------------------------------------------------------------------ systems


def _share_weights(art: Path, work: Path) -> None:
    """Hard-link ``art``'s weights file to an identical one (same SHA-256 in the manifests) of another
    artifact in ``work``: the cache kinds share the model's weights, which need not be on disk twice."""
    import os

    from .artifact import MANIFEST, WEIGHTS

    digest = json.loads((art / MANIFEST).read_text())["files"][WEIGHTS]
    for other in sorted(work.glob("art-*")):
        if other == art or not (other / MANIFEST).exists() or (other / WEIGHTS).samefile(art / WEIGHTS):
            continue
        if json.loads((other / MANIFEST).read_text())["files"].get(WEIGHTS) == digest:
            tmp = art / (WEIGHTS + ".link")
            os.link(other / WEIGHTS, tmp)
            os.replace(tmp, art / WEIGHTS)
            return


def summarize_profile(acc: dict, wall_s: float, step_s: float | None, top: int = 30) -> dict:
    """A profiled step (``Engine.kernel_profile``) as the JSON keeps it: the ``top`` VM calls by time (kernels,
    and ``vm.builtin`` functions, which include the paged cache's attention), the rest summed, and the host
    share of an unprofiled step: its median time less all calls' time (approximate: the per-call
    synchronisation adds to the calls' times)."""
    calls = sorted(((k, n, t) for k, (n, t) in acc.items()), key=lambda r: -r[2])
    total = sum(t for _, _, t in calls)
    out = {"profiled_step_ms": 1e3 * wall_s, "calls_ms": 1e3 * total,
           "kernels_ms": 1e3 * sum(t for k, _, t in calls if not k.startswith("vm.builtin.")),
           "kernel_launches": sum(n for k, n, _ in calls if not k.startswith("vm.builtin.")),
           "top": [{"name": k, "calls": n, "ms": 1e3 * t, "share": t / total if total else 0.0} for k, n, t in calls[:top]],
           "rest_ms": 1e3 * sum(t for _, _, t in calls[top:])}
    if step_s is not None:
        out["host_ms_estimate"] = max(0.0, 1e3 * (step_s - total))
    return out


def _profiled_steps(profile: bool, device: str) -> int:
    """Untimed decode steps that --profile adds to each point: one with every VM call timed alone and, on CUDA,
    one under the device tracer (``trace_device``)."""
    return (2 if device == "cuda" else 1) if profile else 0


def summarize_trace(events: list, top: int = 30) -> dict:
    """A device activity trace of one step (Chrome trace events as ``torch.profiler`` exports them: ``cat``
    "kernel", "gpu_memcpy" or "gpu_memset", ``ts`` and ``dur`` in microseconds) as the JSON keeps it. Unlike
    ``summarize_profile`` nothing is synchronised between calls, so these are the kernels' own times as a timed
    step runs them: ``kernels_ms`` their sum, ``span_ms`` from the first activity's start to the last one's end,
    ``busy_ms`` the union of all activities in it and ``idle_ms`` the rest of the span (the device waiting for
    launches or the host), ``top`` the kernels by summed time. ``gaps`` splits the idle time: ``count``,
    ``median_us`` and ``p90_us`` of the gaps between consecutive busy stretches and the ``largest`` ones with the
    activities either side (``after``, ``before``), so the gaps a launch leaves inside a graph can be told from the
    host's waits between calls."""
    acts = [(e["name"], e["cat"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not any(a[1] == "kernel" for a in acts):
        raise MoecError("the device trace holds no kernel: the activity tracer did not see this process's launches")
    acts.sort(key=lambda a: a[2])
    busy, cur_s, cur_e, last = 0.0, acts[0][2], acts[0][3], acts[0][0]
    gaps = []  # (idle us, the activity ending the busy stretch before, the one starting the next)
    for name, _, s, e in acts[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, last, name))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
        if e >= cur_e:
            last = name
    busy += cur_e - cur_s
    sizes = np.array([g[0] for g in gaps])
    span = max(a[3] for a in acts) - acts[0][2]
    by = {}
    for name, cat, s, e in acts:
        if cat == "kernel":
            n, t = by.get(name, (0, 0.0))
            by[name] = (n + 1, t + e - s)
    kernels = sum(t for _, t in by.values())
    rows = sorted(by.items(), key=lambda kv: -kv[1][1])
    return {"kernels_ms": kernels / 1e3, "kernel_launches": sum(n for n, _ in by.values()),
            "copies_ms": sum(e - s for _, c, s, e in acts if c != "kernel") / 1e3,
            "copies": sum(1 for a in acts if a[1] != "kernel"),
            "span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3,
            "top": [{"name": k, "calls": n, "ms": t / 1e3, "us_per_call": t / n, "share": t / kernels if kernels else 0.0}
                    for k, (n, t) in rows[:top]],
            "rest_ms": sum(t for _, (_, t) in rows[top:]) / 1e3,
            "gaps": {"count": len(gaps), "median_us": float(np.median(sizes)) if gaps else 0.0,
                     "p90_us": float(np.percentile(sizes, 90)) if gaps else 0.0,
                     "largest": [{"us": us, "after": a, "before": b} for us, a, b in sorted(gaps, key=lambda g: -g[0])[:8]]}}


def device_events(fn) -> tuple:
    """``fn()`` once under the CUDA activity tracer (CUPTI through ``torch.profiler``, which records every kernel
    the process launches, TVM's included); returns ``(fn's result, the trace's Chrome events)``, or ``(fn's result,
    None)`` when the tracer cannot start (CUPTI taken by another profiler, say): ``fn`` then runs untraced."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    prof = profile(activities=[ProfilerActivity.CUDA])
    try:
        prof.start()
    except Exception:  # noqa: BLE001 - any failure to start the tracer leaves the run untraced, not failed
        return fn(), None
    try:
        out = fn()
        torch.cuda.synchronize()
    finally:
        prof.stop()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        return out, json.loads(path.read_text()).get("traceEvents", [])


def trace_device(fn):
    """``fn()`` once under the device tracer (``device_events``); returns ``(fn's result, summarize_trace(...))``, the
    summary ``{"error": ...}`` where the tracer could not start or saw no kernel (the point is not failed for it)."""
    out, events = device_events(fn)
    if events is None:
        return out, {"error": "the device activity tracer could not start"}
    try:
        return out, summarize_trace(events)
    except MoecError as exc:
        return out, {"error": str(exc)}


class _Moec:
    def __init__(self, kind: str, model, source, work: Path, device: str, max_streams: int, max_tokens: int,
                 profile: bool = False, max_context: int | None = None, synthetic_kv: bool = False,
                 expert_slots: int | None = None, pipelined: bool = True, prefill_chunk: int | None = None,
                 prefetch_gate: bool | None = None) -> None:
        import moec

        self.pipelined = pipelined
        self.kind = kind
        self.device = device
        self.profile = profile
        self.synthetic_kv = synthetic_kv
        cache = kind.split("-")[1]
        arch = "sm_90a" if kind.endswith("-wgmma") else None
        kind = kind.removesuffix("-wgmma")
        pdl = kind.endswith("-pdl")
        kind = kind.removesuffix("-pdl")
        offload = _offloaded(kind)  # (run_bench refuses them without expert_slots)
        from ..passes.cuda_graph import GraphBounds
        from .build import graphs_by_default

        graph = False  # as moec compile's default (graphs on CUDA unless the experts are offloaded), or -nograph
        if graphs_by_default(device, offload) and not kind.endswith("-nograph"):
            graph = GraphBounds(max_batch=max_streams, max_context=max_context or max_tokens)
        fp8_experts = _fp8_experts(kind)
        from ..schedules.kernels.tiered_decode import DECODE_KERNELS

        decode_kernel = f"split-{kind.rsplit('-', 1)[-1]}"  # moec-tiered-<form>: --decode-kernel split-<form>
        decode_kernel = decode_kernel if decode_kernel in DECODE_KERNELS else None
        prefill_gemm = next((g for g in ("tiled", "streamed") if kind.endswith(f"-p{g}")), "auto")
        tag = (f"-slots{expert_slots}" if offload else f"-{decode_kernel}" if decode_kernel else "") + (
            "-nograph" if kind.endswith("-nograph") else "") + (
            ("-fp8" if offload else "-fp8experts") if fp8_experts else "") + (f"-p{prefill_gemm}" if prefill_gemm != "auto" else "") + (
            "-pdl" if pdl else "") + ("-wgmma" if arch else "")
        art = work / f"art-{cache}{tag}-{device}"
        if not (art / "manifest.json").exists():
            tiered = None
            if decode_kernel:
                from ..passes.tiered_kv_attention import TieredOptions

                tiered = TieredOptions(mode=cache, decode_kernel=decode_kernel)
            from .build import UnreplacedExperts

            # a layer left in the gather form is a recognition failure, not a speed to report: its per-token weight
            # gathers take the prefill out of memory minutes later; the system is refused here with the reason
            with warnings.catch_warnings():
                warnings.simplefilter("error", UnreplacedExperts)
                moec.compile(source() if callable(source) else source, art, target="cuda" if device == "cuda" else "llvm",
                             arch=arch if device == "cuda" else None, kv_cache=cache, progress=True, cuda_graph=graph,
                             expert_slots=expert_slots if offload else None, expert_weights="fp8" if fp8_experts else None,
                             tiered_options=tiered, prefill_gemm=prefill_gemm, pdl=pdl)
            if not offload:
                _share_weights(art, work)
        extra = {"expert_prefetch": 0 if _prefetched(kind) else None, "expert_prefetch_gate": prefetch_gate} if offload else {}
        if prefill_chunk is not None:
            extra["prefill_chunk"] = prefill_chunk
        self.engine = moec.load(art, device=device, max_batch=max_streams, max_total_tokens=max_tokens, **extra)
        self.cfg = model.config
        self.cache = cache

    def kv_bytes_per_token(self) -> float:
        from ..runtime.kv_quant import bytes_per_element

        e = self.engine
        dh = self.cfg.hidden_size // self.cfg.num_attention_heads
        if e.tiered is None:
            dtype = e.manifest["options"]["kv_cache_dtype"]
            per = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
        elif e.tiered.mode == "fp8":
            per = bytes_per_element(1.0, dh, e.tiered.opts["t2_page"])["tier1"]
        else:
            t = e.tiered.tables
            t1 = sum(s.t1_len for s in t.seqs.values())
            total = sum(s.length for s in t.seqs.values())
            per = bytes_per_element(t1 / max(total, 1), dh, e.tiered.opts["t2_page"])["blend"]
        return per * _kv_elements(self.cfg)

    def run(self, prompts: np.ndarray, steps: int) -> dict:
        e = self.engine
        if e.experts is not None:  # counts per point
            e.experts.reset_counts()
        prefill_calls = None
        if self.synthetic_kv:  # caches filled with random entries: the decode steps read what they would after prefill
            self.phase = f"synthetic KV fill of {len(prompts)} x {prompts.shape[1]} tokens"
            seqs, ttft = e.fill_synthetic([prompts.shape[1]] * len(prompts)), None
            nxt = prompts[:, -1]
        else:
            self.phase = f"prefill of {len(prompts)} x {prompts.shape[1]} tokens"
            t = time.perf_counter()
            seqs, logits = e.prefill([list(p) for p in prompts])
            ttft = time.perf_counter() - t
            if e.experts is not None:  # where the prefill's host time went between the residency calls
                prefill_calls = e.experts.timeline(t)
            nxt = logits.argmax(-1)
        prefill_host = {k: round(v * 1e3, 3) for k, v in e.experts.host_s.items()} if e.experts is not None else None
        try:
            # one untimed step first: the first call of each kernel loads it and the VM's first allocations are
            # made, which would otherwise be the point's slowest step (HF's compiled system warms up likewise)
            self.phase = "warm-up decode step"
            nxt = e.decode_greedy(seqs, list(nxt))
            copied = e.experts.copy_bytes if e.experts is not None else 0  # after the prefill and the warm-up
            times = []
            # untimed: the warm-up step and, with --profile, a step with every call timed alone and (CUDA) a traced one
            timed = steps - 1 - _profiled_steps(self.profile, self.device)
            self.phase = "decode steps"
            t = time.perf_counter()
            tokens = []
            if self.pipelined:  # each interval between two steps' tokens reaching the host
                for nxt in e.decode_greedy_steps(seqs, list(nxt), timed):
                    now = time.perf_counter()
                    times.append(now - t)
                    t = now
                    tokens.append(nxt)
            else:
                for i in range(timed):  # greedy on the device: the step ends with b token ids on the host
                    self.phase = f"decode step {i}"
                    t = time.perf_counter()
                    nxt = e.decode_greedy(seqs, list(nxt))
                    times.append(time.perf_counter() - t)
                    tokens.append(nxt)
            copied = (e.experts.copy_bytes - copied) if e.experts is not None else 0  # the timed steps' copies
            profile = None
            if self.profile:  # the last step, untimed, with every VM call timed alone
                self.phase = f"profiled decode step {timed}"
                t = time.perf_counter()
                with e.kernel_profile() as acc:
                    nxt = e.decode_greedy(seqs, list(nxt))
                profile = summarize_profile(acc, time.perf_counter() - t, np.median(times) if times else None)
                if self.device == "cuda":  # one more step, unsynchronised as the timed ones, under the device tracer
                    self.phase = f"traced decode step {timed + 1}"
                    nxt, profile["trace"] = trace_device(lambda: e.decode_greedy(seqs, list(nxt)))
            kv = self.kv_bytes_per_token()
        finally:
            for s in seqs:
                e.release(s)
        if self.profile:  # one prefill chunk of a fresh stream (the batch's pages are free again), profiled alike
            self.phase = "profiled prefill chunk"
            n = min(prompts.shape[1], e.prefill_chunk)
            t = time.perf_counter()
            with e.kernel_profile() as acc:
                (seq,), _ = e.prefill([list(prompts[0][:n])])
            profile["prefill_chunk"] = {"tokens": n, **summarize_profile(acc, time.perf_counter() - t, None)}
            e.release(seq)
            if self.device == "cuda":
                self.phase = "traced prefill chunk"
                ((seq,), _), profile["prefill_chunk"]["trace"] = trace_device(lambda: e.prefill([list(prompts[0][:n])]))
                e.release(seq)
        out = {"ttft_s": ttft, "step_s": times, "kv_bytes_per_token": kv, "profile": profile,
               "tokens": np.stack(tokens) if tokens and not self.synthetic_kv else None,
               # decode steps run through the CUDA graphs so far in this engine, and of them with the argmax captured
               "graph_steps": e.graph_steps, "greedy_graph_steps": e.greedy_graph_steps}
        if e.experts is not None:  # offloaded experts: what the point's calls copied (prefill included), the host to
            # device rate of the timed decode steps' copies over their time, and the copy rate measured on its own
            x = e.experts
            out["experts"] = {**x.counts(), "prefill_host_ms": prefill_host,
                              "prefill_calls_ms": prefill_calls, "decode_copy_bytes": copied,
                              "decode_copy_gbps": copied / sum(times) / 1e9 if times else None,
                              "copy_gbps": x.copy_bandwidth() / 1e9}
        return out


class _HF:
    """HF transformers as people run it: its default experts implementation (``grouped_mm`` where torch has
    it), a StaticCache, prefill in chunks of positions with only the last token's logits."""

    PREFILL_CHUNK = 512  # positions per prefill forward (all streams at once)
    synthetic_kv = False  # always prefills

    def __init__(self, kind: str, model, device: str) -> None:
        import torch

        self.kind, self.model, self.device = kind, model, device
        self.experts = "batched_mm"
        try:  # the export needs batched_mm (gathered weights); the baseline runs HF's default
            model.set_experts_implementation("grouped_mm")
            self.experts = "grouped_mm"
        except Exception:  # noqa: BLE001 - older transformers / torch without grouped_mm: keep batched_mm
            pass
        import inspect

        # the cache argument's name differs between transformers releases; an unknown keyword would be swallowed
        # by **kwargs and every step would attend to its own tokens only
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        if self.cache_kw not in params:
            raise MoecError(f"{type(model).__name__}.forward takes neither cache nor past_key_values")
        self.forward = model.forward
        if kind == "hf-compile":
            self.forward = torch.compile(model.forward, mode="reduce-overhead" if device == "cuda" else "default",
                                         dynamic=False)

    def run(self, prompts: np.ndarray, steps: int) -> dict:
        import torch
        from transformers import StaticCache

        cuda = self.device == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        b, n = prompts.shape
        cache = StaticCache(config=self.model.config, max_cache_len=n + steps + 2)
        ids = torch.from_numpy(prompts).to(self.device)
        with torch.no_grad():
            sync()
            t = time.perf_counter()
            for c0 in range(0, n, self.PREFILL_CHUNK):
                c1 = min(n, c0 + self.PREFILL_CHUNK)
                out = self.model(input_ids=ids[:, c0:c1], cache_position=torch.arange(c0, c1, device=self.device),
                                 use_cache=True, logits_to_keep=1, **{self.cache_kw: cache})
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            sync()
            ttft = time.perf_counter() - t
            if int(cache.get_seq_length()) != n:
                raise MoecError(f"HF's StaticCache holds {int(cache.get_seq_length())} tokens after a {n}-token prefill")
            times = []
            warm = 2 if self.kind == "hf-compile" else 0  # compilation and CUDA-graph capture, not timed
            for i in range(steps + warm):
                pos = torch.tensor([n + max(0, i - warm)], device=self.device)
                t = time.perf_counter()
                out = self.forward(input_ids=nxt, cache_position=pos, use_cache=True, **{self.cache_kw: cache})
                nxt = out.logits[:, -1].argmax(-1, keepdim=True).clone()
                sync()
                if i >= warm:
                    times.append(time.perf_counter() - t)
        itemsize = next(self.model.parameters()).element_size()
        return {"ttft_s": ttft, "step_s": times, "kv_bytes_per_token": itemsize * _kv_elements(self.model.config)}


# ------------------------------------------------------------------ driver


def run_bench(shape: str, streams: list[int], contexts: list[int], systems: list[str], device: str = "cpu",
              dtype: str = "float32", steps: int = 16, work: str | Path = "/tmp/moec-bench", seed: int = 0,
              progress: bool = True, checkpoint=None, profile: bool = False, layers: int | None = None,
              tie_layers: bool = False, synthetic_kv: bool = False, expert_slots: int | None = None,
              pipelined: bool = True, prefill_chunk: int | None = None, prefetch_gate: bool | None = None) -> dict:
    """Run the grid for every system; returns the result document (see the module docstring).

    ``synthetic_kv``: the tiered and FP8 systems skip prefill and decode over caches filled with random entries
    (``Engine.fill_synthetic``; their TTFT is then not measured); the other systems prefill as usual.

    ``prefill_chunk``: the moec engines' prompt tokens per prefill call (default: the engine's, 2048); prompts are
    packed into calls of that many tokens, so a larger chunk prefills several streams' prompts per call.

    ``prefetch_gate``: the -prefetch systems' ``PrefetchGate`` (None: the engine's default, on where copies are
    asynchronous; False: every predicted expert copied ahead).

    ``checkpoint(doc)``, when given, is called after every grid point and every system built, so a run
    stopped from outside still leaves what it measured."""
    checkpoint = checkpoint or (lambda _doc: None)
    import torch

    for s in systems:
        if s not in SYSTEMS:
            raise MoecError(f"unknown system {s!r}; known: {', '.join(SYSTEMS)}")
        if _offloaded(s) and expert_slots is None:
            raise MoecError(f"{s}: give --expert-slots (the device slots of the offloaded experts)")
    if device == "cuda" and not torch.cuda.is_available():
        raise MoecError("--device cuda: no CUDA device is visible to torch")
    if steps < 2 + _profiled_steps(profile, device):
        raise MoecError(f"--steps must be at least {2 + _profiled_steps(profile, device)}: one untimed warm-up step, "
                        f"{'one profiled step, ' if profile else ''}{'one traced step, ' if _profiled_steps(profile, device) > 1 else ''}"
                        "and one timed step or more")
    if min(contexts) <= steps:
        raise MoecError(f"every context must exceed the decode steps ({steps})")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise MoecError(f"--prefill-chunk must be positive, not {prefill_chunk}")
    work = Path(work) / (f"{shape}{'' if layers is None else f'-{layers}l'}{'-tied' if tie_layers else ''}-{dtype}")
    work.mkdir(parents=True, exist_ok=True)  # (the naming of bench/tune_decode.py)
    model = build_hf(shape, dtype, device, seed, layers, tie_layers)
    bw = copy_bandwidth(device)
    doc = {"shape": shape, "config": {k: getattr(model.config, k, None) for k in SHAPES[shape][1]}, "dtype": dtype, "device_kind": device,
           "grid": {"streams": streams, "contexts": contexts}, "decode_steps": steps, "tied_layers": tie_layers,
           "synthetic_kv": synthetic_kv, "expert_slots": expert_slots, "step_loop": "pipelined" if pipelined else "sync",
           "prefill_chunk": prefill_chunk, "prefetch_gate": prefetch_gate,
           "copy_bandwidth_GBps": bw / 1e9, "systems": {}}
    rng = np.random.default_rng(seed)
    prompts = {(s, c): rng.integers(3, model.config.vocab_size, (s, c - steps)) for s in streams for c in contexts}
    def to_host():
        # HF's systems have run by now, and the floors only need the parameter sizes: the weights go to the host
        # (which the export reads too) and free the device for moec's engines, whose memory the points record
        if next(model.parameters()).device.type != "cpu":
            model.to("cpu")
            torch.cuda.empty_cache()

    @functools.cache
    def source():  # exported and imported once, for every moec system whose artifact is not in --work yet
        from ..models.export import save_pt2
        from .importers import import_model

        pt2 = work / "model.pt2"
        to_host()
        if not pt2.exists():
            save_pt2(model, model.config.vocab_size, pt2, max_seq=max(contexts) + 8)
        return import_model(pt2)

    first_tokens = {}  # (streams, context) -> (system, its tokens): the first moec system that prefilled
    # HF first: its StaticCache is freed (torch) before moec's engines take the device memory
    for name in sorted(systems, key=lambda s: not s.startswith("hf-")):
        runs = doc["systems"][name] = {"points": []}
        try:
            if name.startswith("moec-"):
                to_host()  # (also when the artifact is already in --work and nothing is exported)
                system = _Moec(name, model, source, work, device, max(streams), max(streams) * _PAGE * -(-max(contexts) // _PAGE),
                               profile=profile, max_context=max(contexts),
                               synthetic_kv=synthetic_kv and name.split("-")[1] in ("tiered", "fp8"),
                               expert_slots=expert_slots, pipelined=pipelined, prefill_chunk=prefill_chunk,
                               prefetch_gate=prefetch_gate)
                runs["kv_fill"] = "synthetic" if system.synthetic_kv else "prefill"
            else:
                system = _HF(name, model, device)
                runs["experts_implementation"] = system.experts
        except Exception as exc:  # noqa: BLE001 - a system that cannot be built is reported, the others run
            runs["error"] = f"{type(exc).__name__}: {exc}"
            if progress:
                print(f"[bench] {name} was not built: {runs['error']}", file=sys.stderr, flush=True)
            checkpoint(doc)
            continue
        checkpoint(doc)
        for s in streams:
            for c in contexts:
                point = {"streams": s, "context": c}
                before = _memory(device)
                if progress:
                    fill = "synthetic KV of" if system.synthetic_kv else "prefill"
                    print(f"[bench] {name} streams {s} context {c}: {fill} {s} x {c - steps} tokens, then {steps} "
                          "decode steps", flush=True)
                try:
                    r = system.run(prompts[(s, c)], steps)
                except Exception as exc:  # noqa: BLE001
                    point["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    point["failed_in"] = getattr(system, "phase", None)
                    point["memory_bytes_at_error"] = _memory(device)
                    point["memory_bytes_before"] = before
                    if progress:
                        print(f"[bench] {name} streams {s} context {c} failed: {point['error']}", file=sys.stderr, flush=True)
                    runs["points"].append(point)
                    checkpoint(doc)
                    continue
                ms = 1e3 * np.asarray(r["step_s"])
                point.update({
                    "tpot_ms_median": float(np.median(ms)), "tpot_ms_p99": float(np.percentile(ms, 99)),
                    "ttft_ms": None if r["ttft_s"] is None else 1e3 * r["ttft_s"], "decode_tokens_per_s": s / (np.median(ms) / 1e3),
                    "step_ms": [round(float(x), 4) for x in ms],
                    "memory_bytes": _memory(device), "memory_bytes_before": before,
                    "kv_bytes_per_token": r["kv_bytes_per_token"],
                    "floor_ms": floor_ms(model, s, c, r["kv_bytes_per_token"], bw, _fp8_experts(name)),
                })
                if r.get("profile"):
                    point["profile"] = r["profile"]
                if r.get("experts"):
                    point["experts"] = r["experts"]
                if "graph_steps" in r:
                    point["graph_steps"] = {"all": r["graph_steps"], "greedy": r["greedy_graph_steps"]}
                if r.get("tokens") is not None:  # greedy tokens of the timed steps, against the first moec system's
                    toks = np.asarray(r["tokens"], np.int64)
                    point["tokens_sha256"] = hashlib.sha256(toks.tobytes()).hexdigest()
                    ref = first_tokens.setdefault((s, c), (name, toks))
                    if ref[0] != name and ref[1].shape == toks.shape:
                        point["tokens_vs"] = {"system": ref[0], "agree": float(np.mean(ref[1] == toks))}
                runs["points"].append(point)
                checkpoint(doc)
                if progress:
                    ttft = "not measured (synthetic KV)" if point["ttft_ms"] is None else f"{point['ttft_ms']:.1f} ms"
                    print(f"[bench] {name} streams {s} context {c}: TPOT {point['tpot_ms_median']:.2f} ms "
                          f"(p99 {point['tpot_ms_p99']:.2f}, floor {point['floor_ms']:.2f}), TTFT {ttft}", flush=True)
        if name.startswith("hf-") and system.experts != "batched_mm":
            model.set_experts_implementation("batched_mm")  # the form the moec export reads
        del system
        if name == "hf-compile":
            torch._dynamo.reset()  # drops the compiled graphs and their CUDA-graph memory pools
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return doc


def plot(doc: dict, path: str | Path) -> None:
    """TPOT against context: one line per system and stream count (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    styles = ["-", "--", ":", "-."]
    for ci, (name, runs) in enumerate(doc["systems"].items()):
        for si, s in enumerate(doc["grid"]["streams"]):
            pts = [p for p in runs["points"] if p["streams"] == s and "tpot_ms_median" in p]
            if pts:
                ax.plot([p["context"] for p in pts], [p["tpot_ms_median"] for p in pts], styles[si % len(styles)],
                        color=f"C{ci}", marker="o", label=f"{name}, {s} streams")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("TPOT, median (ms)")
    ax.set_title(f"{doc['shape']} ({doc['dtype']}) on {doc.get('device', doc['device_kind'])}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


MERGE_AGREE = ("shape", "dtype", "device_kind", "device", "tied_layers", "decode_steps")  # what merged runs share


def merge(paths: list) -> dict:
    """One result document from several ``moec bench`` JSON files of the same shape, dtype, device and decode steps
    (e.g. one system per device call): the systems side by side, each with the index of its ``merged_from`` entry
    (file, command, commit, copy bandwidth of that run), the grid the union of theirs. A system measured in two
    files (a run stopped before a system measured a point does not count), a file that is not a bench result, or
    runs that differ in what ``MERGE_AGREE`` names are refused."""
    if len(paths) < 2:
        raise MoecError("bench-merge needs two or more result files")
    docs = []
    for p in paths:
        try:
            d = json.loads(Path(p).read_text())
        except (OSError, ValueError) as exc:
            raise MoecError(f"{p}: cannot read a bench result ({str(exc).splitlines()[0]})") from None
        if not isinstance(d, dict) or d.get("benchmark") != "serve" or not isinstance(d.get("systems"), dict):
            raise MoecError(f"{p}: not a `moec bench` result (benchmark 'serve' with systems)")
        docs.append(d)
    for d in docs:
        d.setdefault("tied_layers", False)  # (results from before --tie-layers)
    base = docs[0]
    for p, d in zip(paths[1:], docs[1:]):
        for k in MERGE_AGREE:
            if d.get(k) != base.get(k):
                raise MoecError(f"{p}: {k} {d.get(k)!r} differs from {paths[0]}'s {base.get(k)!r}")
    systems, sources, where = {}, [], {}
    for i, (p, d) in enumerate(zip(paths, docs)):
        sources.append({"file": str(p), "command": d.get("command"), "git_commit": d.get("git_commit"),
                        "copy_bandwidth_GBps": d.get("copy_bandwidth_GBps"), "synthetic_kv": d.get("synthetic_kv"),
                        "complete": d.get("complete"), "systems": list(d["systems"])})
        for name, runs in d["systems"].items():
            measured = any("tpot_ms_median" in pt for pt in runs.get("points", []))
            if name in systems:
                if not measured:  # a run stopped before this system measured anything: the other run's stands
                    continue
                if any("tpot_ms_median" in pt for pt in systems[name].get("points", [])):
                    raise MoecError(f"{p}: system {name} is also measured in {where[name]}")
            systems[name], where[name] = {**runs, "merged_from": i}, p
    grid = {k: sorted({v for d in docs for v in d.get("grid", {}).get(k, [])}) for k in ("streams", "contexts")}
    return {"benchmark": "serve", "merged_from": sources,
            **{k: base.get(k) for k in ("shape", "config", "dtype", "device_kind", "device", "decode_steps", "tied_layers")},
            "grid": grid, "systems": systems, "complete": all(bool(d.get("complete")) for d in docs)}


def main_merge(args) -> int:
    doc = merge(args.files)
    doc["command"] = " ".join(["moec"] + list(getattr(args, "argv", sys.argv[1:])))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(out)
    if args.plot:
        plot(doc, args.plot)
    return 0


def _versions() -> dict:
    """The versions a result depends on: the export's (torch, transformers) and the runtime's (TVM), and Python."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "apache-tvm-ffi"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    import tvm  # (staged on the GPU machine as files, not a package pip knows)

    out["tvm"] = tvm.__version__
    return out


def main(args) -> int:
    import torch

    streams = [int(x) for x in args.streams.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    commit = args.commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                           cwd=Path(__file__).resolve().parent).stdout.strip()
    if args.device == "cuda" and torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    else:
        device = platform.processor() or platform.machine()
    head = {"benchmark": "serve", "command": " ".join(["moec"] + list(getattr(args, "argv", sys.argv[1:]))),
            "git_commit": commit, "device": device, "versions": _versions()}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(doc, complete=False):
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps({**head, **doc, "complete": complete}, indent=2))
        tmp.replace(out)

    doc = run_bench(args.shape, streams, contexts, args.systems.split(","), args.device, args.dtype, args.steps, args.work,
                    checkpoint=write, profile=getattr(args, "profile", False),
                    layers=getattr(args, "layers", None), tie_layers=getattr(args, "tie_layers", False),
                    synthetic_kv=getattr(args, "synthetic_kv", False), expert_slots=getattr(args, "expert_slots", None),
                    pipelined=not getattr(args, "sync_steps", False), prefill_chunk=getattr(args, "prefill_chunk", None),
                    prefetch_gate={"auto": None, "off": False}[getattr(args, "prefetch_gate", "auto")])
    write(doc, complete=True)
    if args.plot:
        plot({**head, **doc}, args.plot)
    failed = [n for n, r in doc["systems"].items() if r.get("error") or any("error" in p for p in r["points"])]
    if failed:  # the JSON keeps what did run; the exit status says that something did not
        print(f"[bench] failed: {', '.join(failed)} (errors in {out})", file=sys.stderr)
        return 1
    return 0
