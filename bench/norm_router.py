"""RMSNorm + router per layer on the GPU: unfused (as the pipeline compiles it) against the fused norm_router kernel.

  python bench/norm_router.py prepare .devcarry/nr                   # here: compile for sm_90 (fatbins), no GPU
  python3 bench/norm_router.py run .devcarry/nr --json OUT --commit SHA   # GPU machine, runtime-only TVM
  python bench/norm_router.py run .devcarry/nr --device cpu           # here: the llvm build, correctness + timings

Shapes (bf16, eps 1e-5): OLMoE (d 2048, E 64) and Mixtral (d 4096, E 8), token batches 1, 16, 128 and 2048 (a
prefill chunk; T dynamic: one build serves every batch). Per shape one module with five functions, lowered by
phases 2-4 of the "moec" pipeline (``passes.pipeline.lowering_pipeline``: LegalizeOps, FuseOps, dlight
rules, VM lowering) exactly as a model's entries are:

  norm             y = RMSNorm(x)                                          the floor: the norm alone
  unfused          y, x W^T         (W [E, D] a weight: transposed every call, as in the entries)
  fused            norm_router(x, w, W)                                    one launch
  unfused_cascade  y, x Cr^T + b    (Cr^T [D, G], b [G], G = 8: the cascade's coarse router, constants
                                     in a model, inputs here; the matmul and the bias add fuse)
  fused_cascade    norm_router(x, w, Cr, b)
  fused_tokens     norm_router(x, w, W) in the multi-token form the prefill entry takes (``norm_router.prefill_spec``:
                   several rows a block, each router row read once for all of them)

Correctness (both devices): the fused outputs against NumPy (float32 math over the bf16 inputs, the
router over the bf16-rounded normalised row) and against the unfused build. Timings: the VM's
``time_evaluator`` (host-timed back-to-back calls of one function, so launch overhead counts, as in a
decode step), the median of repeats. Launches per function are counted from the CUDA build (the VM's
kernel calls times the ``__global__`` kernels of each PrimFunc) at prepare time.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = {"olmoe": (2048, 64), "mixtral": (4096, 8)}  # hidden, experts
GROUPS = 8  # coarse router of the cascade
BATCHES = (1, 16, 128, 2048)
DTYPE = "bfloat16"
EPS = 1e-5
FUNCS = ("norm", "unfused", "fused", "unfused_cascade", "fused_cascade", "fused_tokens")


def _specs(d: int, e: int):
    from moec.schedules.kernels.norm_router import NormRouterSpec

    flat = NormRouterSpec(d, e, EPS, DTYPE, DTYPE, DTYPE, DTYPE, DTYPE)
    coarse = NormRouterSpec(d, GROUPS, EPS, DTYPE, DTYPE, DTYPE, DTYPE, DTYPE, bias_dtype=DTYPE)
    return flat, coarse


def build_module(d: int, e: int, kind: str):
    """The five functions for hidden size ``d`` and ``e`` experts; ``kind`` picks the kernel form."""
    import tvm
    from tvm import relax

    from moec.schedules.kernels.norm_router import make_norm_router, prefill_spec

    flat, coarse = _specs(d, e)
    tokens = prefill_spec(flat) if kind == "cuda" else flat  # (llvm: one form; its place takes the same kernel)
    bb = relax.BlockBuilder()
    gv = {s: bb.add_func(make_norm_router(s, kind).without_attr("global_symbol").with_attr("op_pattern", 8), f"norm_router_{n}")
          for n, s in (("flat", flat), ("coarse", coarse), ("tokens", tokens)) if n != "tokens" or s != flat}
    t = tvm.tirx.Var("t", "int64")
    ty = lambda *shape: relax.TensorType(shape, DTYPE)  # noqa: E731

    def rms_norm(x, w):  # the graph of an imported RMSNorm after SimplifyPower
        sq = bb.emit(relax.op.multiply(x, x))
        ms = bb.emit(relax.op.mean(sq, axis=[-1], keepdims=True))
        r = bb.emit(relax.op.rsqrt(bb.emit(relax.op.add(ms, relax.const(EPS, DTYPE)))))
        return bb.emit(relax.op.multiply(w, bb.emit(relax.op.multiply(x, r))))

    def function(name, extra, body):
        x, w = relax.Var("x", ty(t, d)), relax.Var("w", ty(d))
        with bb.function(name, [x, w] + extra):
            with bb.dataflow():
                out = bb.emit_output(body(x, w, *extra))
            bb.emit_func_output(out)

    def fused(spec):
        def body(x, w, *rest):
            res = bb.emit(relax.call_tir(gv[spec], [x, w, *rest], out_ty=[ty(t, d), relax.TensorType((t, spec.outputs), DTYPE)]))
            return relax.Tuple([bb.emit(relax.TupleGetItem(res, 0)), bb.emit(relax.TupleGetItem(res, 1))])
        return body

    function("norm", [], lambda x, w: rms_norm(x, w))

    def unfused(x, w, router):
        y = rms_norm(x, w)
        return relax.Tuple([y, bb.emit(relax.op.matmul(y, bb.emit(relax.op.permute_dims(router, [1, 0])), out_dtype=DTYPE))])

    function("unfused", [relax.Var("router", ty(e, d))], unfused)
    function("fused", [relax.Var("router", ty(e, d))], fused(flat))

    def unfused_cascade(x, w, cr_t, b):
        y = rms_norm(x, w)
        return relax.Tuple([y, bb.emit(relax.op.add(bb.emit(relax.op.matmul(y, cr_t, out_dtype=DTYPE)), b))])

    function("unfused_cascade", [relax.Var("coarse_t", ty(d, GROUPS)), relax.Var("bias", ty(GROUPS))], unfused_cascade)
    function("fused_cascade", [relax.Var("coarse", ty(GROUPS, d)), relax.Var("bias", ty(GROUPS))], fused(coarse))
    function("fused_tokens", [relax.Var("router", ty(e, d))], fused(tokens))
    return bb.get()


def compile_module(d: int, e: int, target):
    import tvm

    from moec.passes.pipeline import lowering_pipeline

    kind = "cuda" if target.kind.name == "cuda" else "llvm"
    return tvm.compile(build_module(d, e, kind), target=target, relax_pipeline=lowering_pipeline(target, list(FUNCS)))


def launches(executable) -> dict[str, int]:
    """Kernel launches of one call of each function in a CUDA build."""
    from moec.compiler.build import _cuda_modules

    src = "".join(m.inspect_source("cuda") for m in _cuda_modules(executable.mod))
    per_func: dict[str, int] = {}
    for k in set(re.findall(r'extern "C" __global__ void __launch_bounds__\(\d+\) (\w+)\(', src)):
        base = re.sub(r"_kernel(_\d+)?$", "", k)
        per_func[base] = per_func.get(base, 0) + 1
    text = executable.as_text()
    out = {}
    for name in FUNCS:
        body = text[text.index(f"@{name}:"):].split("\n\n")[0]
        out[name] = sum(per_func.get(m.group(1), 0) for m in re.finditer(r"call\s+(\S+)\s+in:", body))
    return out


def prepare(out: Path) -> None:
    from moec.compiler.artifact import atomic_directory
    from moec.compiler.build import _compile_cuda_kernels
    from moec.compiler.targets import make_target
    from moec.schedules.kernels.norm_router import launch_config, prefill_spec

    target = make_target("cuda", "sm_90")
    with atomic_directory(out) as tmp:
        index = {}
        for name, (d, e) in SHAPES.items():
            ex = compile_module(d, e, target)
            sub = tmp / name
            sub.mkdir()
            kernels = _compile_cuda_kernels(ex, target, sub, progress=True)
            ex.export_library(str(sub / "lib.so"))
            flat, coarse = _specs(d, e)
            index[name] = {"hidden": d, "experts": e, "groups": GROUPS, "dtype": DTYPE, "cuda_kernels": kernels,
                           "launches": launches(ex), "launch_config": {"fused": launch_config(flat),
                                                                        "fused_cascade": launch_config(coarse),
                                                                        "fused_tokens": launch_config(prefill_spec(flat))}}
            print(json.dumps({k: v for k, v in index[name].items() if k != "cuda_kernels"}), flush=True)
        (tmp / "index.json").write_text(json.dumps(index, indent=2))


# ---------------------------------------------------------------------------- run (runtime-only TVM on the GPU)


def _vm(root: Path, name: str, device: str):
    import tvm
    from tvm.runtime.vm import VirtualMachine

    if device == "cpu":
        d, e = SHAPES[name]
        dev = tvm.cpu(0)
        return VirtualMachine(compile_module(d, e, tvm.target.Target({"kind": "llvm"})), dev), dev
    from moec.runtime.engine import _load_cuda_runtime, _register_fatbins

    _load_cuda_runtime()
    index = json.loads((root / "index.json").read_text())
    _register_fatbins(root / name, index[name])
    dev = tvm.cuda(0)
    return VirtualMachine(tvm.runtime.load_module(str(root / name / "lib.so")), dev), dev


def bf16_round(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), still as float32 (NumPy only)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return u.view(np.float32)


def _to_device(a: np.ndarray, dev):
    """A bfloat16 tensor on ``dev`` holding the (bf16-exact) float32 values ``a`` (no ml_dtypes needed)."""
    import tvm

    bits = (np.ascontiguousarray(a, np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    return tvm.runtime.tensor(bits, dev)._create_view(a.shape, DTYPE)


def _to_host(t) -> np.ndarray:
    bits = t._create_view(tuple(t.shape), "uint16").numpy()
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _inputs(d: int, e: int, t: int, seed: int) -> dict:
    """Random inputs, float32 arrays of bf16-exact values."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, d)) * rng.uniform(0.2, 5.0, (t, 1))
    coarse = rng.standard_normal((GROUPS, d)) * 0.02
    host = {"x": x, "w": rng.uniform(0.5, 1.5, d), "router": rng.standard_normal((e, d)) * 0.02, "coarse": coarse,
            "coarse_t": coarse.T, "bias": rng.standard_normal(GROUPS)}
    return {k: bf16_round(v) for k, v in host.items()}


def reference(x, w, rows, bias):
    """float32 math; the router reads the normalised row rounded to bf16, as the kernel does."""
    r = 1.0 / np.sqrt((x * x).sum(-1, keepdims=True, dtype=np.float32) / np.float32(x.shape[-1]) + np.float32(EPS))
    y = bf16_round(w * (x * r))
    logits = y @ rows.T + (bias if bias is not None else 0)
    return y, logits.astype(np.float32)


def _args(name: str, host: dict) -> list:
    return {"norm": ["x", "w"], "unfused": ["x", "w", "router"], "fused": ["x", "w", "router"],
            "unfused_cascade": ["x", "w", "coarse_t", "bias"], "fused_cascade": ["x", "w", "coarse", "bias"],
            "fused_tokens": ["x", "w", "router"]}[name]


def check(vm, dev, name: str, t: int) -> dict:
    """Fused outputs against NumPy and against the unfused build, for ``t`` tokens."""
    d, e = SHAPES[name]
    host = _inputs(d, e, t, seed=t)
    dev_in = {k: _to_device(v, dev) for k, v in host.items()}

    def run(f):
        out = vm[f](*[dev_in[a] for a in _args(f, host)])
        return [_to_host(o) for o in (out if f != "norm" else [out])]

    row = {"shape": name, "tokens": t}
    ok = True
    for fused, unfused, rows, bias in (("fused", "unfused", "router", None), ("fused_cascade", "unfused_cascade", "coarse", "bias"),
                                       ("fused_tokens", "unfused", "router", None)):
        (fy, fl), (uy, ul) = run(fused), run(unfused)
        ry, rl = reference(host["x"], host["w"], host[rows], host[bias] if bias else None)
        scale = float(np.abs(rl).max()) or 1.0
        err_y, err_l = float(np.abs(fy - ry).max()), float(np.abs(fl - rl).max()) / scale
        # y: at most one bf16 rounding step from the reference (2^-7 relative); logits (rounded to bf16,
        # 8 bits of mantissa, float32 sums in another order) within 1% of their scale
        passed = bool(np.all(np.abs(fy - ry) <= 2.0 ** -7 * np.abs(ry) + 1e-6)) and err_l < 1e-2
        ok &= passed
        row[fused] = {"max_abs_y_error": err_y, "max_rel_logit_error": err_l,
                      "vs_unfused_max_abs_y": float(np.abs(fy - uy).max()),
                      "vs_unfused_max_rel_logit": float(np.abs(fl - ul).max()) / scale, "passed": passed}
    (ny,) = run("norm")
    row["unfused_norm_vs_reference_max_abs_y"] = float(np.abs(ny - reference(host["x"], host["w"], host["router"], None)[0]).max())
    row["passed"] = bool(ok)
    print(json.dumps(row), flush=True)
    return row


def speed(vm, dev, name: str, t: int, number: int, repeat: int) -> dict:
    d, e = SHAPES[name]
    host = _inputs(d, e, t, seed=100 + t)
    dev_in = {k: _to_device(v, dev) for k, v in host.items()}
    ms = {}
    for f in FUNCS:
        vm.save_function(f, f"{f}_timed", *[dev_in[a] for a in _args(f, host)])
        res = vm.time_evaluator(f"{f}_timed", dev, number=number, repeat=repeat)()
        ms[f] = float(np.median(np.asarray(res.results))) * 1e3
    fused_bytes = 2 * (2 * t * d + d + e * d + t * e)  # x read, w, router rows, y written, logits (bf16)
    row = {"shape": name, "hidden": d, "experts": e, "groups": GROUPS, "tokens": t, "ms": ms,
           "speedup_flat": ms["unfused"] / ms["fused"], "speedup_cascade": ms["unfused_cascade"] / ms["fused_cascade"],
           "tokens_over_fused": ms["fused_tokens"] / ms["fused"],
           "fused_over_norm_floor": ms["fused"] / ms["norm"], "fused_bytes": fused_bytes,
           "fused_bandwidth_GBps": fused_bytes / ms["fused"] / 1e6}
    print(json.dumps(row), flush=True)
    return row


def _device_name(device: str) -> str:
    if device == "cpu":
        return platform.processor() or platform.machine()
    try:
        import torch

        return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - torch is optional there
        import tvm

        return str(tvm.cuda(0).device_name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("step", choices=["prepare", "run"])
    ap.add_argument("dir", type=Path, help="prepared kernels (prepare writes it; run --device cuda reads it)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--commit", default="unknown", help="git commit of the tree the kernels were built from")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: the llvm build compiled in this process (needs the compiler), a dry run")
    args = ap.parse_args()
    if args.step == "prepare":
        prepare(args.dir)
        return 0
    doc = {"benchmark": "norm_router", "command": " ".join(["python3"] + sys.argv), "git_commit": args.commit,
           "python": platform.python_version(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "device": _device_name(args.device), "dtype": DTYPE, "eps": EPS, "timing": "VM time_evaluator, median of repeats, ms per call (one layer)"}
    if args.device == "cuda":
        doc["prepared"] = json.loads((args.dir / "index.json").read_text())
        for v in doc["prepared"].values():
            v.pop("cuda_kernels", None)
    number, repeat = (200, 7) if args.device == "cuda" else (3, 3)
    doc["correctness"], doc["speed"] = [], []
    for name in SHAPES:
        vm, dev = _vm(args.dir, name, args.device)
        for t in BATCHES:
            doc["correctness"].append(check(vm, dev, name, t))
        for t in BATCHES:
            doc["speed"].append(speed(vm, dev, name, t, number, repeat))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2))
    return 0 if all(r["passed"] for r in doc["correctness"]) else 1


if __name__ == "__main__":
    sys.exit(main())
