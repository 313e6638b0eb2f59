"""Tiered-KV decode attention on the GPU: correctness against NumPy, time and bandwidth against bf16 SDPA.

  python bench/tiered_decode.py prepare DIR                   # here: compile the kernels for sm_90 (fatbins)
  python3 bench/tiered_decode.py run DIR --json OUT --commit SHA   # GPU machine, runtime-only TVM
  ncu ... python3 bench/tiered_decode.py profile DIR --variant V      # GPU machine: launches of one form, for a profiler

Correctness: random K/V quantized into both tiers (NumPy formats), one decode step, output and
importance mass against ``moec.schedules.kernels.reference`` over the same dequantized values.
Speed: OLMoE-1B-7B attention shape (16 heads, 16 KV heads, Dh 128) and Mixtral shape (32/8 heads),
128 sequences of 4096 cached tokens (640 tier-1 tokens, 27 tier-2 pages of 128), one layer. The
bytes the kernel must read are counted from the formats; the same step over a bf16 cache through
``torch.nn.functional.scaled_dot_product_attention`` runs in the same process, and so does a
device-to-device copy for the bandwidth ceiling.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = {  # name: heads, kv heads, head dim, tier-1 page, tier-2 page
    "check": (4, 2, 32, 16, 32),
    "olmoe": (16, 16, 128, 16, 128),
    "mixtral": (32, 8, 128, 16, 128),
}
STREAMS, CONTEXT, T1_TOKENS = 128, 4096, 640
# checked and timed too (earlier variant sets, the per-bit, register-base and fields forms: the commits of
# bench/results/tiered_decode_h200_*.json): the compiled models' form (half2: pairs of codes as float16 halves, one
# fma.rn.f16x2 per pair; keys and a tile's value sums in float16, so checked to 5e-3 / 1e-3 rather than float32's
# 1e-4 / 1e-5) and the tensor-core tier 2 (``t2_mma``: mma.sync over the codes as float16 1024 + c 2^p, float32
# sums; tier 1 and tier 2 in splits of their own, so it gets ``decode_splits(..., t2_mma=True)`` workspaces), also with
# each tile's code words loaded during the previous tile (``t2_prefetch``), and with tier 1 on tensor cores too
# (``t1_mma``, ``-mma2``: FP8 widened to float16 pairs, the queries as a float16 high and low part), and with q' kept
# in registers for the whole split instead of read again for each page (``t2_keep_q``, ``-q``)
VARIANTS = {"olmoe-half2-pipe4": ("olmoe", {"half2": True, "stages": 4}),
            # tier 1 in float16 pairs too (``t1_half2``: FP8 widened to pairs, 16 paired FMAs a token and lane)
            "olmoe-half2-pipe4-t1h2": ("olmoe", {"half2": True, "stages": 4, "t1_half2": True}),
            # one reduce-scatter of a tile's scores (``scatter_scores``), alone and with tier 1 in pairs
            "olmoe-half2-pipe4-scat": ("olmoe", {"half2": True, "stages": 4, "scatter_scores": True}),
            "olmoe-half2-pipe4-t1h2-scat": ("olmoe", {"half2": True, "stages": 4, "t1_half2": True, "scatter_scores": True}),
            "olmoe-half2-pipe4-t1h2-scat-mb20": ("olmoe", {"half2": True, "stages": 4, "t1_half2": True, "scatter_scores": True,
                                                           "min_blocks": 20}),  # 126 registers unbounded; 20 warps: 102
            # more bytes in flight a warp (6 and 8 tile stages) with the fewer registers of the scattered scores: whether
            # the H200, which ran the 4-stage form no faster than the H100, is bound by the bytes a warp keeps in flight
            "olmoe-half2-pipe6-t1h2-scat": ("olmoe", {"half2": True, "stages": 6, "t1_half2": True, "scatter_scores": True}),
            "olmoe-half2-pipe8-t1h2-scat": ("olmoe", {"half2": True, "stages": 8, "t1_half2": True, "scatter_scores": True}),
            # launch bounds (``min_blocks``: warps an SM; ptxas -v for sm_90 in the comments): 145 registers and 11.8 KB
            # of stages take 13 warps an SM; a register cap takes more (the other caps and stage counts, and earlier
            # mma variants: bench/results/tiered_decode_h100_c23b99a.json, prepared at 6b90584)
            "olmoe-half2-pipe4-mb16": ("olmoe", {"half2": True, "stages": 4, "min_blocks": 16}),  # 118 regs, 17 warps
            "olmoe-half2-pipe4-t1h2-mb16": ("olmoe", {"half2": True, "stages": 4, "t1_half2": True, "min_blocks": 16}),
            "olmoe-mma2-pf": ("olmoe", {"t2_mma": True, "t1_mma": True, "t2_prefetch": True}),
            "mixtral-half2-pipe4": ("mixtral", {"half2": True, "stages": 4}),
            "mixtral-half2-pipe4-t1h2": ("mixtral", {"half2": True, "stages": 4, "t1_half2": True}),
            "mixtral-mma2-pf": ("mixtral", {"t2_mma": True, "t1_mma": True, "t2_prefetch": True}),
            # q' kept in registers (the compiled models' tensor-core form), and with half (``t1_quarters`` 2) or three
            # quarters of the splits on tier 1: tier 1 is about 40% of the bytes at 15% of the tokens, one split of three
            "mixtral-mma2-pf-q": ("mixtral", {"t2_mma": True, "t1_mma": True, "t2_prefetch": True, "t2_keep_q": True}),
            "mixtral-mma2-pf-q-t1x2": ("mixtral", {"t2_mma": True, "t1_mma": True, "t2_prefetch": True, "t2_keep_q": True,
                                                   "t1_quarters": 2}),
            "mixtral-mma2-pf-q-t1x3": ("mixtral", {"t2_mma": True, "t1_mma": True, "t2_prefetch": True, "t2_keep_q": True,
                                                   "t1_quarters": 3}),
            # no merge kernel: the last split warp of each (sequence, KV head) merges (``merge_in_split``), on the
            # compiled OLMoE form and on the default half2 forms
            "olmoe-half2-pipe4-t1h2-scat-fm": ("olmoe", {"half2": True, "stages": 4, "t1_half2": True, "scatter_scores": True,
                                                         "merge_in_split": True}),
            "olmoe-half2-pipe4-fm": ("olmoe", {"half2": True, "stages": 4, "merge_in_split": True}),
            "mixtral-mma2-pf-q-fm": ("mixtral", {"t2_mma": True, "t1_mma": True, "t2_prefetch": True, "t2_keep_q": True,
                                                 "merge_in_split": True}),
            # tier 2 on tensor cores with its 16-token tiles staged through shared memory (``stages``: a cp.async
            # ring, several tiles in flight a warp instead of one a tile ahead in registers), the magic operand in a
            # register (one LOP3 a pair); for one query head per KV head with tier 1 in float16 pairs on CUDA cores or
            # on tensor cores, on a quarter or half of the splits (tier 1 is about 40% of the bytes)
            "olmoe-mma-s4-q-t1h2": ("olmoe", {"t2_mma": True, "stages": 4, "t2_keep_q": True, "t1_half2": True}),
            "olmoe-mma-s4-q-t1h2-t1x2": ("olmoe", {"t2_mma": True, "stages": 4, "t2_keep_q": True, "t1_half2": True,
                                                   "t1_quarters": 2}),
            "olmoe-mma-s6-q-t1h2-t1x2": ("olmoe", {"t2_mma": True, "stages": 6, "t2_keep_q": True, "t1_half2": True,
                                                   "t1_quarters": 2}),
            "olmoe-mma-s4-q-t1h2-t1x2-up": ("olmoe", {"t2_mma": True, "stages": 4, "t2_keep_q": True, "t1_half2": True,
                                                      "t1_quarters": 2, "unroll_page": True}),
            # the same with launch bounds (``min_blocks``: ptxas -v for sm_90): 150 registers unbounded, 13 warps an SM
            # (14.8% warps active on the H100 at 85b7b8c); 16 blocks an SM bound it to 127 without spills
            "olmoe-mma-s4-q-t1h2-mb16": ("olmoe", {"t2_mma": True, "stages": 4, "t2_keep_q": True, "t1_half2": True,
                                                   "min_blocks": 16}),
            "olmoe-mma-s4-q-t1h2-up-mb16": ("olmoe", {"t2_mma": True, "stages": 4, "t2_keep_q": True, "t1_half2": True,
                                                      "unroll_page": True, "min_blocks": 16}),
            "olmoe-mma-s6-q-t1h2-up-mb16": ("olmoe", {"t2_mma": True, "stages": 6, "t2_keep_q": True, "t1_half2": True,
                                                      "unroll_page": True, "min_blocks": 16}),
            "olmoe-mma2-s4-q": ("olmoe", {"t2_mma": True, "t1_mma": True, "stages": 4, "t2_keep_q": True}),
            "olmoe-mma2-s4-q-t1x2": ("olmoe", {"t2_mma": True, "t1_mma": True, "stages": 4, "t2_keep_q": True,
                                               "t1_quarters": 2}),
            "olmoe-mma2-pf-q": ("olmoe", {"t2_mma": True, "t1_mma": True, "t2_prefetch": True, "t2_keep_q": True}),
            "mixtral-mma2-s4-q": ("mixtral", {"t2_mma": True, "t1_mma": True, "stages": 4, "t2_keep_q": True}),
            "mixtral-mma2-s4-q-up": ("mixtral", {"t2_mma": True, "t1_mma": True, "stages": 4, "t2_keep_q": True,
                                                 "unroll_page": True}),
            "mixtral-mma2-s4-q-up-mb14": ("mixtral", {"t2_mma": True, "t1_mma": True, "stages": 4, "t2_keep_q": True,
                                                      "unroll_page": True, "min_blocks": 14}),  # 161 registers unbounded
            "mixtral-mma2-s4-q-t1x2": ("mixtral", {"t2_mma": True, "t1_mma": True, "stages": 4, "t2_keep_q": True,
                                                   "t1_quarters": 2}),
            # the compiled OLMoE form with its page's 4 tiles unrolled (constant stage slots and row offsets)
            "olmoe-half2-pipe4-t1h2-scat-up": ("olmoe", {"half2": True, "stages": 4, "t1_half2": True, "scatter_scores": True,
                                                         "unroll_page": True}),
            "check-half2": ("check", {"half2": True}),
            "check-half2-t1h2": ("check", {"half2": True, "t1_half2": True}),
            "check-half2-pipe3": ("check", {"half2": True, "stages": 3})}
MMA_SPLITS = (2, 3, 4, 5, 6, 8)  # the tensor-core variants are also timed at these splits (tier 1: t1_quarters / 4 of them)
OTHER_SPLITS = (2, 4)  # and the others at these
HALF2_TOL = (5e-3, 1e-3)  # output, importance mass (absolute): float16 sums of the tier-2 codes
LAYERS, LAYER = 2, 1  # pools hold two layers; the kernel runs on layer 1 (the layer offset is exercised)


def prepare(out: Path) -> None:
    import tvm

    from moec.compiler.artifact import atomic_directory
    from moec.compiler.build import _compile_cuda_kernels
    from moec.compiler.targets import make_target
    from moec.schedules.kernels.tiered_decode import make_tiered_decode_cuda

    target = make_target("cuda", "sm_90")
    with atomic_directory(out) as tmp:
        index = {}
        builds = {name: (shape, {}) for name, shape in SHAPES.items()}
        builds.update({name: (SHAPES[base], kw) for name, (base, kw) in VARIANTS.items()})
        for name, ((h, hkv, d, ps1, ps2), kw) in builds.items():
            ex = tvm.compile(tvm.IRModule({"tiered_decode": make_tiered_decode_cuda(h, hkv, d, ps1, ps2, **kw)}), target=target)
            sub = tmp / name
            sub.mkdir()
            kernels = _compile_cuda_kernels(ex, target, sub, progress=True)
            ex.export_library(str(sub / "lib.so"))
            index[name] = {"cuda_kernels": kernels}
        from moec.schedules.kernels.tiered_append import make_tiered_append

        ex = tvm.compile(tvm.IRModule({"tiered_append": make_tiered_append(16, 128, 16, target="cuda")}), target=target)
        sub = tmp / "append"
        sub.mkdir()
        index["append"] = {"cuda_kernels": _compile_cuda_kernels(ex, target, sub, progress=True)}
        ex.export_library(str(sub / "lib.so"))
        (tmp / "index.json").write_text(json.dumps(index, indent=2))


def _load(root: Path, name: str, device: str):
    import tvm

    if device == "cpu":
        from moec.schedules.kernels.tiered_decode import make_tiered_decode

        return tvm.compile(tvm.IRModule({"tiered_decode": make_tiered_decode(*SHAPES[name.split("-")[0]])}), target="llvm")
    from moec.runtime.engine import _load_cuda_runtime, _register_fatbins

    _load_cuda_runtime()
    index = json.loads((root / "index.json").read_text())
    _register_fatbins(root / name, index[name])
    return tvm.runtime.load_module(str(root / name / "lib.so"))


def check_append(root: Path, device: str) -> dict:
    import tvm

    from moec.runtime import kv_quant as q

    hkv, d, ps1, p1, n = 16, 128, 16, 64, 300
    if device == "cpu":
        from moec.schedules.kernels.tiered_append import make_tiered_append

        mod = tvm.compile(tvm.IRModule({"tiered_append": make_tiered_append(hkv, d, ps1)}), target="llvm")
        dev = tvm.cpu(0)
    else:
        from moec.runtime.engine import _load_cuda_runtime, _register_fatbins

        _load_cuda_runtime()
        _register_fatbins(root / "append", json.loads((root / "index.json").read_text())["append"])
        mod, dev = tvm.runtime.load_module(str(root / "append" / "lib.so")), tvm.cuda(0)
    rng = np.random.default_rng(5)
    k = (rng.standard_normal((n, hkv, d)) * rng.uniform(1e-3, 50, (n, hkv, 1))).astype(np.float32)
    v = (rng.standard_normal((n, hkv, d)) * rng.uniform(1e-3, 50, (n, hkv, 1))).astype(np.float32)
    slots = rng.permutation(p1 * ps1)[:n].astype(np.int32)
    host = [k, v, slots, np.arange(n, dtype=np.int32), np.zeros((p1, hkv, ps1, d), np.uint8), np.zeros((p1, hkv, ps1, d), np.uint8),
            np.zeros((p1, hkv, ps1), np.float16), np.zeros((p1, hkv, ps1), np.float16), np.zeros((p1, hkv, ps1), np.int32),
            np.ones((p1, hkv, ps1), np.float32)]
    host[4:] = [np.concatenate([np.zeros_like(a)[None]] * LAYER + [a[None]]) for a in host[4:]]  # layer axis
    tv = [tvm.runtime.tensor(a, dev) for a in host]
    mod["tiered_append"](*tv, LAYER)
    page, slot = slots // ps1, slots % ps1
    wk, wks = q.fp8_quantize(k)
    same = bool((tv[4].numpy()[LAYER][page, :, slot] == wk).all() and (tv[6].numpy()[LAYER][page, :, slot] == wks).all())
    result = {"kernel": "tiered_append", "tokens": n, "bytes_identical_to_reference": same, "passed": same}
    print(json.dumps(result), flush=True)
    return result


def _case(name: str, batch: int, t1: int, t2_pages: int, seed: int):
    from moec.schedules.kernels import reference as ref

    h, hkv, d, ps1, ps2 = SHAPES[name]
    rng = np.random.default_rng(seed)
    kv = [(rng.standard_normal((hkv, t1 + t2_pages * ps2, d)).astype(np.float32),
           rng.standard_normal((hkv, t1 + t2_pages * ps2, d)).astype(np.float32)) for _ in range(batch)]
    p1, p2 = batch * (-(-t1 // ps1)) + 3, batch * t2_pages + 3
    pools, tables, deq, slots = ref.fill_pools(kv, [t1] * batch, p1, p2, ps1, ps2, rng)
    qv = rng.standard_normal((batch, h, d)).astype(np.float32)
    return qv, pools, tables, deq, slots


def _mma(name: str) -> bool:
    return name in VARIANTS and bool(VARIANTS[name][1].get("t2_mma"))


def _fused(name: str) -> bool:
    """Whether the variant merges in its split kernel (``merge_in_split``: ``part_ml`` has the counters' row)."""
    return name in VARIANTS and bool(VARIANTS[name][1].get("merge_in_split"))


def _args(tvm, dev, qv, pools, tables, mass0, splits=None, t2_mma=False, fused=False):
    """Kernel arguments: pools and mass as given (layer axis first), then ``decode_workspaces``."""
    from moec.schedules.kernels import reference as ref
    from moec.schedules.kernels.tiered_decode import decode_workspaces

    b, h, d = qv.shape
    m1, m2 = tables["t1_table"].shape[1], tables["t2_table"].shape[1]
    ps1, hkv, ps2 = pools["t1_k"].shape[-2], pools["t1_k"].shape[-3], pools["t2_k"].shape[-2]
    host = [qv] + [pools[k] for k in ref.POOL_ORDER] + [tables[k] for k in ref.TABLE_ORDER]
    host += [np.zeros((b, h, d), np.float32), mass0]
    host += [np.zeros(shape, dtype) for shape, dtype in decode_workspaces(b, h, hkv, m1, ps1, m2, ps2, d, splits, t2_mma, fused)]
    return [tvm.runtime.tensor(a, dev) for a in host]


def check(root: Path, device: str) -> list[dict]:
    import tvm

    from moec.schedules.kernels import reference as ref

    dev = tvm.cuda(0) if device == "cuda" else tvm.cpu(0)
    results = []
    cases = [("check", 3, 37, 2), ("check", 2, 0, 3), ("olmoe", 2, 640, 3), ("mixtral", 2, 100, 2)]
    if device == "cuda":
        cases += [(var, 2, 640 if base == "olmoe" else 100, 3) for var, (base, _) in VARIANTS.items()]
        # staged forms: no tier-2 pages (a partial tier-1 tile, most splits without tier-1 tiles); no tier-1 tokens
        cases += [c for var, (_, kw) in VARIANTS.items() if kw.get("stages") or kw.get("t2_mma") for c in ((var, 3, 37, 0), (var, 2, 0, 5))]
    for name, batch, t1, t2 in cases:
        shape = VARIANTS[name][0] if name in VARIANTS else name
        qv, pools, tables, deq, slots = _case(shape, batch, t1, t2, seed=len(results))
        h, hkv, d, ps1, ps2 = SHAPES[shape]
        scale = d**-0.5
        mass0 = np.random.default_rng(9).random(pools["t1_k"].shape[:3]).astype(np.float32)
        lpools = {k: ref.layered(v, layers=LAYERS, layer=LAYER) for k, v in pools.items()}
        lmass = ref.layered(mass0, layers=LAYERS, layer=LAYER)
        mod = _load(root, name, device)
        for splits in (None, 3):
            args = _args(tvm, dev, qv, lpools, tables, lmass, splits, _mma(name), _fused(name))
            mod["tiered_decode"](*args, LAYER, scale)
            out, mass = args[15].numpy(), args[16].numpy()
            counters_zero = not _fused(name) or not args[19].numpy()[:, :, -1].any()  # (merge_in_split: reset)
            want = np.stack([ref.attention(qv[s], *deq[s], scale)[0] for s in range(batch)])
            want_mass = ref.expected_mass(mass0, qv, deq, slots, scale)
            err, merr = float(np.abs(out - want).max()), float(np.abs(mass[LAYER] - want_mass).max())
            untouched = bool((mass[:LAYER] == lmass[:LAYER]).all())
            tol = HALF2_TOL if name in VARIANTS and (VARIANTS[name][1].get("half2") or _mma(name)) else (1e-4, 1e-5)
            results.append({"shape": name, "batch": batch, "tier1_tokens": t1, "tier2_pages": t2,
                            "splits": int(args[18].shape[2]), "max_abs_out_error": err, "max_abs_mass_error": merr,
                            "tolerance": list(tol), "other_layers_untouched": untouched, "counters_zero": counters_zero,
                            "passed": err < tol[0] and merr < tol[1] and untouched and counters_zero})
            print(json.dumps(results[-1]), flush=True)
    return results


def _time(fn, args, extra, dev) -> float:
    for _ in range(3):
        fn(*args, *extra)
    dev.sync()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(20):
            fn(*args, *extra)
        dev.sync()
        runs.append((time.perf_counter() - t0) / 20)
    return float(np.median(runs)) * 1e3  # host-timed, launches back to back (includes launch overhead)


def _speed_inputs(name: str):
    """The timed point's inputs for shape ``name``: queries, pools (layer axis first) and page tables."""
    h, hkv, d, ps1, ps2 = SHAPES[name]
    b, t2p = STREAMS, (CONTEXT - T1_TOKENS) // ps2
    p1, p2 = b * (T1_TOKENS // ps1), b * t2p
    rng = np.random.default_rng(0)
    codes = lambda shape: (rng.integers(0, 0x77, size=shape, dtype=np.uint8) | (rng.integers(0, 2, size=shape, dtype=np.uint8) << 7))  # noqa: E731
    pools = {
        "t1_k": codes((p1, hkv, ps1, d)), "t1_v": codes((p1, hkv, ps1, d)),
        "t1_ks": np.full((p1, hkv, ps1), 0.01, np.float16), "t1_vs": np.full((p1, hkv, ps1), 0.01, np.float16),
        "t2_k": rng.integers(0, 256, (p2, hkv, ps2, d // 4), dtype=np.uint8), "t2_v": rng.integers(0, 256, (p2, hkv, ps2, d // 4), dtype=np.uint8),
        "t2_kmu": np.zeros((p2, hkv, d), np.float16), "t2_ksig": np.full((p2, hkv, d), 0.5, np.float16),
        "t2_vmu": np.zeros((p2, hkv, ps2), np.float16), "t2_vsig": np.full((p2, hkv, ps2), 0.5, np.float16),
    }
    for k, v in pools.items():  # [LAYERS, ...] pools, the data in layer LAYER (other layers zero)
        lv = np.zeros((LAYERS,) + v.shape, v.dtype)
        lv[LAYER] = v
        pools[k] = lv
    perm1, perm2 = rng.permutation(p1).astype(np.int32), rng.permutation(p2).astype(np.int32)
    tables = {"t1_table": perm1.reshape(b, -1), "t1_len": np.full(b, T1_TOKENS, np.int32),
              "t2_table": perm2.reshape(b, -1), "t2_np": np.full(b, t2p, np.int32)}
    qv = rng.standard_normal((b, h, d)).astype(np.float32)
    return qv, pools, tables, np.zeros((LAYERS, p1, hkv, ps1), np.float32)


def profile(root: Path, variant: str, launches: int) -> None:
    """Launch one form ``launches`` times at its shape's timed point (for a profiler such as ncu to wrap)."""
    import tvm

    name = VARIANTS[variant][0] if variant in VARIANTS else variant
    d = SHAPES[name][2]
    fn = _load(root, variant, "cuda")["tiered_decode"]  # (first: it loads TVM's CUDA runtime)
    dev = tvm.cuda(0)
    args = _args(tvm, dev, *_speed_inputs(name), t2_mma=_mma(variant), fused=_fused(variant))
    for _ in range(launches):
        fn(*args, LAYER, d**-0.5)
    dev.sync()


def speed(root: Path, name: str, variants: tuple[str, ...] = (), sweep: tuple[int, ...] = (1, 2, 4)) -> dict:
    import torch
    import tvm

    from moec.schedules.kernels.tiered_decode import decode_workspaces

    h, hkv, d, ps1, ps2 = SHAPES[name]
    b, t2p = STREAMS, (CONTEXT - T1_TOKENS) // ps2
    p1, p2 = b * (T1_TOKENS // ps1), b * t2p
    qv, pools, tables, mass0 = _speed_inputs(name)
    dev = tvm.cuda(0)
    args = _args(tvm, dev, qv, pools, tables, mass0)
    splits = int(args[18].shape[2])
    fn = _load(root, name, "cuda")["tiered_decode"]
    ms = _time(fn, args, (LAYER, d**-0.5), dev)
    sweep_ms = {}
    for sp in sweep:
        wargs = args[:17] + [tvm.runtime.tensor(np.zeros(shape, dtype), dev)
                             for shape, dtype in decode_workspaces(b, h, hkv, T1_TOKENS // ps1, ps1, t2p, ps2, d, sp)]
        sweep_ms[str(sp)] = _time(fn, wargs, (LAYER, d**-0.5), dev)
    variant_ms = {}
    for var in variants:
        vfn = _load(root, var, "cuda")["tiered_decode"]
        # the default split count (the tensor-core variants: one more, their own workspaces), then other counts: a
        # sequence in S splits is S warps, whose waves over the SMs differ
        for sp in (None,) + (MMA_SPLITS if _mma(var) else OTHER_SPLITS):
            wargs = args[:17] + [tvm.runtime.tensor(np.zeros(shape, dtype), dev) for shape, dtype in decode_workspaces(
                b, h, hkv, T1_TOKENS // ps1, ps1, t2p, ps2, d, sp, t2_mma=_mma(var), merge_in_split=_fused(var))]
            variant_ms[var if sp is None else f"{var}@{sp}"] = _time(vfn, wargs, (LAYER, d**-0.5), dev)
    t1_bytes = b * hkv * T1_TOKENS * (2 * d + 2 * 2 + 4 + 4 * 2)  # K, V bytes; 2 scales; table; mass read+write
    t2_bytes = b * hkv * t2p * (2 * ps2 * d // 4 + 2 * 2 * d + 2 * 2 * ps2)  # codes; key mu/sigma; value mu/sigma
    q_out = b * h * d * 4 * 2 + b * h * T1_TOKENS * 4 * 2  # q, out, scores written and read
    q_out += b * h * splits * (d + 2) * 4 * 2  # split partials written and read
    total = t1_bytes + t2_bytes + q_out
    # bf16 baseline: the same step over a bf16 cache, torch SDPA
    qt = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16)
    kt = torch.randn(b, hkv, CONTEXT, d, device="cuda", dtype=torch.bfloat16)
    vt = torch.randn_like(kt)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=hkv != h)  # noqa: E731
    bf16_ms = _torch_ms(sdpa)
    big = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(big)
    copy_ms = _torch_ms(lambda: dst.copy_(big))
    copy_bw = 2 * big.numel() / copy_ms / 1e6  # GB/s (bytes read + written per ms)
    bf16_bytes = 2 * b * hkv * CONTEXT * d * 2
    return {
        "shape": name, "heads": h, "kv_heads": hkv, "head_dim": d, "streams": b, "context": CONTEXT,
        "tier1_tokens": T1_TOKENS, "tier2_pages": t2p, "tier2_page_tokens": ps2,
        "tiered_ms": ms, "tiered_bytes": total, "tiered_bytes_per_element": total / (2 * b * hkv * CONTEXT * d),
        "tiered_bandwidth_GBps": total / ms / 1e6, "bf16_sdpa_ms": bf16_ms, "bf16_bytes": bf16_bytes,
        "bf16_bandwidth_GBps": bf16_bytes / bf16_ms / 1e6, "copy_bandwidth_GBps": copy_bw,
        "tiered_fraction_of_copy_bandwidth": total / ms / 1e6 / copy_bw, "speedup_vs_bf16": bf16_ms / ms,
        "splits": splits, "tiered_ms_by_splits": sweep_ms, "variants_ms": variant_ms,
    }


def _torch_ms(fn, iters: int = 20) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return float(np.median(times))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=["prepare", "run", "profile"])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--variant", default="olmoe-half2-pipe4", help="profile: the form to launch (a shape or a variant)")
    ap.add_argument("--launches", type=int, default=2, help="profile: launches of it")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: correctness only, llvm kernels")
    ap.add_argument("--only", help="prepare: build only these variants (comma-separated; run times what was built)")
    args = ap.parse_args()
    if args.step == "prepare" and args.only:
        unknown = set(args.only.split(",")) - set(VARIANTS)
        if unknown:
            raise SystemExit(f"unknown variants: {', '.join(sorted(unknown))}")
    if args.step == "prepare" or args.device == "cpu":
        keep = set(args.only.split(",")) if args.only else set(VARIANTS)
    else:
        keep = set(json.loads((args.dir / "index.json").read_text()))
    for v in [v for v in VARIANTS if v not in keep]:
        del VARIANTS[v]
    if args.step == "prepare":
        prepare(args.dir)
        return 0
    if args.step == "profile":
        profile(args.dir, args.variant, args.launches)
        return 0
    doc = {"benchmark": "tiered_decode", "command": " ".join(["python3"] + sys.argv), "git_commit": args.commit,
           "python": platform.python_version(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    doc["correctness"] = check(args.dir, args.device) + [check_append(args.dir, args.device)]
    if args.device == "cuda":
        import torch

        doc["device"] = torch.cuda.get_device_name(0)
        doc["speed"] = []
        for name in ("olmoe", "mixtral"):
            doc["speed"].append(speed(args.dir, name, tuple(v for v, (base, _) in VARIANTS.items() if base == name)))
            print(json.dumps(doc["speed"][-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))
    return 0 if all(r["passed"] for r in doc["correctness"]) else 1


if __name__ == "__main__":
    sys.exit(main())
