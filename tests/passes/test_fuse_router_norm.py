"""FuseRouterIntoNorm: the kernel against NumPy, IR before/after, compiled models fused vs unfused (flat and
cascade), kernel launches of the CUDA build (sm_90, no GPU needed), options and refusals."""

import collections
import json
import re

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax

import moec
from moec.compiler.errors import MoecError
from moec.compiler.targets import make_target
from moec.passes.fuse_router_norm import FuseRouterIntoNorm
from moec.schedules.kernels.norm_router import NormRouterSpec, launch_config, make_norm_router, reference, reference_topk

from moec_testing import ATOL, torch_last_logits
from moec_testing import prefill_and_decode as _run

LLVM = tvm.target.Target({"kind": "llvm"})
NP = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
D, E = 64, 8  # tiny: hidden, experts


def _calls(func, op):
    found = []
    relax.analysis.post_order_visit(func.body, lambda e: found.append(e) if isinstance(e, relax.Call) and isinstance(
        e.op, tvm.ir.Op) and e.op.name == op else None)
    return found


def _tir_calls(func):
    return [c for c in _calls(func, "relax.call_tir")]


# ---------------------------------------------------------------------------- the kernel


def _kernel_args(spec, t, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((t, spec.hidden)) * rng.uniform(0.1, 20, (t, 1))).astype(NP[spec.x_dtype])
    w = rng.uniform(0.5, 1.5, spec.hidden).astype(NP[spec.weight_dtype])
    shape = (spec.outputs, spec.hidden) if spec.rows_layout == "ed" else (spec.hidden, spec.outputs)
    rows = (rng.standard_normal(shape) * 0.1).astype(NP[spec.rows_dtype])
    bias = rng.standard_normal(spec.outputs).astype(NP[spec.bias_dtype]) if spec.bias_dtype else None
    return x, w, rows, bias


@pytest.mark.parametrize("spec", [
    NormRouterSpec(64, 8, 1e-5),
    NormRouterSpec(100, 6, 1e-6, bias_dtype="float32", rows_layout="de"),
    NormRouterSpec(96, 4, 1e-5, *["bfloat16"] * 4, "float32", bias_dtype="float32"),
    NormRouterSpec(72, 5, 1e-5, *["float16"] * 5, bias_dtype="float16"),
], ids=["fp32", "fp32-bias-transposed", "bf16-fp32-logits", "fp16-bias"])
def test_kernel_matches_numpy(spec):
    ex = tvm.compile(tvm.IRModule({"norm_router": make_norm_router(spec, "llvm")}), target=LLVM)
    for t in (1, 7):  # one compiled kernel, any token count
        x, w, rows, bias = _kernel_args(spec, t, seed=t)
        y = np.zeros((t, spec.hidden), NP[spec.y_dtype])
        logits = np.zeros((t, spec.outputs), NP[spec.logits_dtype])
        args = [tvm.runtime.tensor(a) for a in [x, w, rows] + ([bias] if bias is not None else []) + [y, logits]]
        ex["norm_router"](*args)
        want_y, want_l = reference(x, w, rows, bias, spec.eps, NP[spec.y_dtype], NP[spec.logits_dtype], spec.rows_layout)
        got_y, got_l = args[-2].numpy().astype(np.float32), args[-1].numpy().astype(np.float32)
        # float32: summation order only; 16-bit outputs: at most one rounding step apart
        tol = 1e-5 if spec.y_dtype == "float32" else 1e-2
        np.testing.assert_allclose(got_y, want_y.astype(np.float32), rtol=tol, atol=tol)
        np.testing.assert_allclose(got_l, want_l.astype(np.float32), rtol=tol, atol=tol * 10)
        xf = x.astype(np.float64)  # and the definition itself, in float64
        yd = w.astype(np.float64) * xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + spec.eps)
        np.testing.assert_allclose(got_y, yd, rtol=2e-2 if spec.y_dtype != "float32" else 1e-5, atol=1e-5)


def test_cuda_form_one_kernel_and_nvcc():
    from tvm.support import nvcc

    spec = NormRouterSpec(2048, 64, 1e-5, *["bfloat16"] * 5)
    cfg = launch_config(spec)
    assert cfg == {"threads": 256, "warps": 8, "blocks_per_row": 8, "vec": 8, "rows_vec": 8, "iters": 1, "rows_iters": 8,
                   "shared_bytes": 2048 * 2 + 8 * 4}
    target = make_target("cuda", "sm_90")
    ex = tvm.compile(tvm.IRModule({"norm_router": make_norm_router(spec, "cuda")}), target=target)
    from moec.compiler.build import _cuda_modules

    src = _cuda_modules(ex.mod)[0].inspect_source("cuda")
    kernels = set(re.findall(r'extern "C" __global__ void __launch_bounds__\((\d+)\) (\w+)\(', src))
    assert kernels == {("256", "norm_router_kernel")}
    assert "__shfl_xor_sync" in src and "__syncthreads" in src and "uint4" in src  # shuffles, shared row, 16-byte loads
    with target:
        assert len(nvcc.compile_cuda(src, target_format="fatbin", arch="sm_90", compiler="nvcc")) > 0


@pytest.mark.parametrize("spec,tokens", [
    (NormRouterSpec(256, 12, 1e-5, *["bfloat16"] * 4, "float32", bias_dtype="float32"), 8),
    (NormRouterSpec(256, 12, 1e-5, *["bfloat16"] * 4, "float32", bias_dtype="float32"), 0),
    (NormRouterSpec(200, 6, 1e-6, rows_layout="de"), 3),
    (NormRouterSpec(256, 10, 1e-5, *["bfloat16"] * 5, residual=True), 5),
    (NormRouterSpec(256, 10, 1e-5, *["bfloat16"] * 5, residual=True), 0),
    (NormRouterSpec(200, 6, 1e-6, rows_layout="de"), 0),
    (NormRouterSpec(4096, 6, 1e-6), 0),  # a lane's router share past ROW_REGS: loaded after the normalised row
], ids=["bf16-bias-tokens8", "bf16-bias-per-token", "fp32-transposed-tokens3", "bf16-residual-tokens5",
        "bf16-residual-per-token", "fp32-transposed-per-token", "fp32-wide-per-token"])
def test_cuda_forms_emulated(spec, tokens):
    """The CUDA forms on the CPU emulation of their generated code (tests/cuda_emu.py), against NumPy: the per-token
    form (a block per token and logit group) and the multi-token form of prefill chunks (``tokens`` rows a block,
    ``prefill_spec``), with a partial last block (11 and 21 rows), experts not a multiple of the 8 warps, rows not a
    multiple of the lanes' chunks, the router transposed, and the residual add."""
    from dataclasses import replace

    from cuda_emu import EmulatedKernel

    from moec.compiler.build import _cuda_modules

    spec = replace(spec, tokens=tokens)
    src = _cuda_modules(tvm.compile(tvm.IRModule({"norm_router": make_norm_router(spec, "cuda")}),
                                    target=make_target("cuda", "sm_90")).mod)[0].inspect_source("cuda")
    kern = EmulatedKernel(src, "norm_router_kernel")
    cfg = launch_config(spec)
    rng = np.random.default_rng(tokens)
    for t in (11, 21):
        x, w, rows, bias = _kernel_args(spec, t, seed=t)
        y = np.full((t, spec.hidden), np.nan, NP[spec.y_dtype])
        logits = np.full((t, spec.outputs), np.nan, NP[spec.logits_dtype])
        args = {"w": w, "rows": rows, "y": y, "logits": logits, "N": t}
        if bias is not None:
            args["bias"] = bias
        if spec.residual:
            ra = (rng.standard_normal((t, spec.hidden)) * 3).astype(NP[spec.x_dtype])
            rb = rng.standard_normal((t, spec.hidden)).astype(NP[spec.x_dtype])
            x = (ra.astype(np.float32) + rb.astype(np.float32)).astype(NP[spec.x_dtype])
            args.update(ra=ra, rb=rb, x=np.zeros_like(x))
        else:
            args["x"] = x
        grid = (-(-t // tokens), 1, 1) if tokens else (t, cfg["blocks_per_row"], 1)
        kern(grid, cfg["threads"], **{k: (v.view(np.uint16) if isinstance(v, np.ndarray) and v.dtype == ml_dtypes.bfloat16 else v)
                                      for k, v in args.items()})
        if spec.residual:
            np.testing.assert_array_equal(args["x"], x)
        want_y, want_l = reference(x, w, rows, bias, spec.eps, NP[spec.y_dtype], NP[spec.logits_dtype], spec.rows_layout)
        tol = 1e-5 if spec.y_dtype == "float32" else 1e-2
        np.testing.assert_allclose(y.astype(np.float32), want_y.astype(np.float32), rtol=tol, atol=tol)
        np.testing.assert_allclose(logits.astype(np.float32), want_l.astype(np.float32), rtol=tol, atol=tol * 10)


def test_prefill_spec_rows_a_block():
    from moec.schedules.kernels.norm_router import prefill_spec

    assert prefill_spec(NormRouterSpec(2048, 64, 1e-5, *["bfloat16"] * 5)).tokens == 8  # OLMoE: 8 rows of 4 KB
    assert prefill_spec(NormRouterSpec(4096, 16, 1e-5, *["bfloat16"] * 5)).tokens == 4  # 4 rows of 8 KB
    assert prefill_spec(NormRouterSpec(4096, 16, 1e-5)).tokens == 2  # float32 rows
    mixtral = NormRouterSpec(4096, 8, 1e-5, *["bfloat16"] * 5)
    assert prefill_spec(mixtral) == mixtral  # 8 experts: one block a token already reads the row once
    wide = NormRouterSpec(16384, 64, 1e-5)
    assert prefill_spec(wide) == wide  # a 64 KB row: the per-token form
    cfg = launch_config(prefill_spec(NormRouterSpec(2048, 64, 1e-5, *["bfloat16"] * 5)))
    assert cfg["threads"] == 256 and cfg["tokens_per_block"] == 8 and cfg["shared_bytes"] == 8 * 2048 * 2
    with pytest.raises(MoecError, match="tokens must be 0"):
        NormRouterSpec(64, 8, 1e-5, tokens=17).check()


def test_kernel_refusals():
    with pytest.raises(MoecError, match="x_dtype must be one of"):
        make_norm_router(NormRouterSpec(64, 8, 1e-5, x_dtype="int8"))
    with pytest.raises(MoecError, match="rows layout"):
        make_norm_router(NormRouterSpec(64, 8, 1e-5, rows_layout="ee"))
    with pytest.raises(MoecError, match="positive integers"):
        make_norm_router(NormRouterSpec(0, 8, 1e-5))
    with pytest.raises(MoecError, match="target must be"):
        make_norm_router(NormRouterSpec(64, 8, 1e-5), target="rocm")
    with pytest.raises(MoecError, match="shared memory"):
        make_norm_router(NormRouterSpec(16384, 8, 1e-5), target="cuda")  # a float32 row of 64 KiB


# ---------------------------------------------------------------------------- IR before / after


def _entry(x_shape=("n", None), norm="rsqrt", bias=False, rows_layout="ed", mean_axis=-1, router=True, weight_input=False,
           const_rows=False, dtype="float32", cast=False, d=D):
    """``decode(x, [w], *weights)``: RMSNorm, router matmul (+ bias), softmax, top-k; returns (h, values, ids)."""
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    shape = [n if s == "n" else (d if s is None else s) for s in x_shape]
    x = relax.Var("x", relax.TensorType(shape, dtype))
    w = relax.Var("w", relax.TensorType((d,), dtype))
    rows_shape = (E, d) if rows_layout == "ed" else (d, E)
    r = relax.Var("router", relax.TensorType(rows_shape, dtype))
    params = [x, w, r] if weight_input or not const_rows else [x, w]
    rng = np.random.default_rng(0)
    with bb.function("decode", params, attrs={"num_input": 2 if weight_input else 1}):
        with bb.dataflow():
            emit = bb.emit
            xx = emit(relax.op.astype(x, "float32")) if cast else x  # HF style: the norm in float32, cast back
            cdt = "float32" if cast else dtype
            sq = emit(relax.op.power(xx, relax.const(2.0, cdt))) if norm == "power" else emit(relax.op.multiply(xx, xx))
            ms = emit(relax.op.mean(sq, axis=[mean_axis], keepdims=True))
            s = emit(relax.op.add(ms, relax.const(1e-5, cdt)))
            if norm == "div":
                n_ = emit(relax.op.divide(xx, emit(relax.op.sqrt(s))))
            else:
                n_ = emit(relax.op.multiply(xx, emit(relax.op.rsqrt(s))))
            if cast:
                n_ = emit(relax.op.astype(n_, dtype))
            h = emit(relax.op.multiply(w, n_))
            flat = emit(relax.op.reshape(h, [-1, d])) if len(shape) == 3 else h
            rows = relax.const(rng.standard_normal(rows_shape).astype("float32")) if const_rows else r
            if const_rows and dtype != "float32":  # as CascadeGating emits them: float32 constants cast in Relax,
                rows = emit(relax.op.astype(rows, dtype))  # bound after the norm (the pass re-emits them before)
            rhs = emit(relax.op.permute_dims(rows, [1, 0])) if rows_layout == "ed" else rows
            logits = emit(relax.op.matmul(flat, rhs, out_dtype=dtype))
            if bias:
                b = relax.const(rng.standard_normal(E).astype("float32"))
                logits = emit(relax.op.add(logits, b if dtype == "float32" else emit(relax.op.astype(b, dtype))))
            if router:
                top = emit(relax.op.topk(emit(relax.op.nn.softmax(logits, axis=-1)), k=2, axis=-1, ret_type="both",
                                         largest=True, dtype="int64"))
                out = bb.emit_output(relax.Tuple([h, emit(relax.TupleGetItem(top, 0)), emit(relax.TupleGetItem(top, 1))]))
            else:
                out = bb.emit_output(relax.Tuple([h, logits]))
        bb.emit_func_output(out)
    return bb.get()


def test_ir_prefill_entry_takes_multi_token_form(monkeypatch):
    # on CUDA, with more experts than the per-token form's warps, the prefill entry's kernel is the multi-token form
    # (norm_router_t<rows>), decode's the per-token one; on llvm both are the serial form
    import sys

    monkeypatch.setattr(sys.modules[__name__], "E", 16)
    one = _entry()["decode"]
    mod = tvm.IRModule({"decode": one, "prefill": one.with_attr("global_symbol", "prefill")})
    for target, want in ((make_target("cuda", "sm_90"), {"decode": "norm_router", "prefill": "norm_router_t8"}),
                         (LLVM, {"decode": "norm_router", "prefill": "norm_router"})):
        p = FuseRouterIntoNorm(target)
        after = p(mod)
        got = {entry: [c.args[0].name_hint for c in _tir_calls(after[entry])] for entry in ("decode", "prefill")}
        assert got == {k: [v] for k, v in want.items()}, got
        assert sorted(spec.tokens for spec in p.kernels) == ([0, 8] if target.kind.name == "cuda" else [0])


def _fuse(mod, target=LLVM):
    p = FuseRouterIntoNorm(target)
    out = relax.transform.DeadCodeElimination(["decode"])(p(mod))
    return p, out


def _expected(before, spec):
    """What the pass guarantees, built by hand: one norm_router call, its outputs consumed downstream."""
    f = before["decode"]
    x, w, r = f.params
    bb = relax.BlockBuilder()
    gv = bb.add_func(make_norm_router(spec, "llvm").without_attr("global_symbol").with_attr("op_pattern", 8), "norm_router")
    n = x.ty.shape[0]
    with bb.function("decode", [x, w, r], attrs={"num_input": 1}):
        with bb.dataflow():
            out = bb.emit(relax.call_tir(gv, [x, w, r], out_ty=[relax.TensorType([n, D], "float32"),
                                                                relax.TensorType([n, E], "float32")]))
            h, logits = bb.emit(relax.TupleGetItem(out, 0)), bb.emit(relax.TupleGetItem(out, 1))
            top = bb.emit(relax.op.topk(bb.emit(relax.op.nn.softmax(logits, axis=-1)), k=2, axis=-1, ret_type="both",
                                        largest=True, dtype="int64"))
            res = bb.emit_output(relax.Tuple([h, bb.emit(relax.TupleGetItem(top, 0)), bb.emit(relax.TupleGetItem(top, 1))]))
        bb.emit_func_output(res)
    return bb.get()


def test_ir_before_after():
    before = _entry()
    assert len(_calls(before["decode"], "relax.matmul")) == 1 and len(_calls(before["decode"], "relax.rsqrt")) == 1
    p, after = _fuse(before)
    assert p.fused == {"decode": 1}
    spec = NormRouterSpec(D, E, float(np.float32(1e-5)))
    tvm.ir.assert_structural_equal(after, _expected(before, spec), map_free_vars=True)
    assert p.manifest()["kernels"] == {"norm_router": {**spec.__dict__}}


@pytest.mark.parametrize("kw", [dict(norm="power"), dict(norm="div"), dict(x_shape=(1, "n", None)), dict(bias=True, const_rows=True),
                                dict(rows_layout="de"), dict(dtype="float16", cast=True, norm="power"),
                                dict(dtype="float16", bias=True, const_rows=True)],
                         ids=["power", "x-over-sqrt", "3d", "coarse-const-bias", "rows-de", "fp16-hf-casts", "fp16-coarse-cast-consts"])
def test_ir_forms_fuse_and_compute_the_same(kw):
    before = _entry(**kw)
    p, after = _fuse(before)
    assert p.fused == {"decode": 1}
    f = after["decode"]
    assert not _calls(f, "relax.matmul") and not _calls(f, "relax.mean")  # norm and router computed by the kernel only
    (call,) = _tir_calls(f)
    assert call.args[0].name_hint == "norm_router" and len(call.ty.fields) == 2
    if kw.get("bias"):
        assert len(call.args[1].fields) == 4  # x, w, rows, bias
    # compiled before and after: the same outputs
    shape = [5 if s == "n" else (D if s is None else s) for s in (kw.get("x_shape") or ("n", None))]
    rng = np.random.default_rng(1)
    dt = kw.get("dtype", "float32")
    ins = [(rng.standard_normal(shape) * 3).astype(dt), rng.uniform(0.5, 1.5, D).astype(dt)]
    if not kw.get("const_rows"):
        ins.append(rng.standard_normal((E, D) if kw.get("rows_layout", "ed") == "ed" else (D, E)).astype(dt))
    outs = []
    for mod in (before, after):
        mod = relax.transform.LegalizeOps({"relax.topk": __import__("moec.passes.legalize_topk", fromlist=["x"]).legalize_topk})(mod)
        vm = relax.VirtualMachine(tvm.compile(mod, target=LLVM), tvm.cpu())
        outs.append([a.numpy() for a in vm["decode"](*[tvm.runtime.tensor(a) for a in ins])])
    tol = 1e-5 if dt == "float32" else 2e-2  # 16-bit: the unfused matmul also accumulates in float16
    for a, b in zip(*outs):
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("kw", [dict(mean_axis=0), dict(router=False), dict(weight_input=True)],
                         ids=["mean-over-tokens", "no-topk", "norm-weight-is-an-input"])
def test_ir_not_a_norm_router_stays(kw):
    before = _entry(**kw)
    p, after = _fuse(before)
    assert p.fused == {"decode": 0}
    tvm.ir.assert_structural_equal(after, relax.transform.DeadCodeElimination(["decode"])(before))


def test_cuda_row_too_wide_for_shared_memory_is_skipped():
    p, after = _fuse(_entry(d=16384), make_target("cuda", "sm_90"))  # a float32 row of 64 KiB
    assert p.fused == {"decode": 0} and "shared memory" in p.skipped["decode"][0]
    assert _calls(after["decode"], "relax.matmul") and not _tir_calls(after["decode"])
    p, _ = _fuse(_entry(d=2048), make_target("cuda", "sm_90"))
    assert p.fused == {"decode": 1} and p.manifest()["skipped"] == {}


def test_refusals(zoo):
    with pytest.raises(MoecError, match="functions with a num_input attribute"):
        FuseRouterIntoNorm(LLVM).transform_module(tvm.IRModule({"decode": _entry()["decode"].without_attr("num_input")}), None)
    with pytest.raises(MoecError, match="needs a tvm.target.Target"):
        FuseRouterIntoNorm("llvm")
    with pytest.raises(MoecError, match="fuse_router_norm must be True or False"):
        moec.compile(zoo.source("tiny", "pt2"), "/nonexistent/never-written", fuse_router_norm="yes")


# ---------------------------------------------------------------------------- compiled models




def test_compiled_fused_equals_unfused(zoo, tmp_path):
    fused = zoo.artifact("tiny", "pt2")  # the default build fuses
    unfused = moec.compile(zoo.imported("tiny", "pt2"), tmp_path / "unfused", target="llvm", fuse_router_norm=False)
    mf, mu = (json.loads((a / "manifest.json").read_text()) for a in (fused, unfused))
    assert mf["options"]["fuse_router_norm"]["fused"] == {"decode": 2, "prefill": 2} and "FuseRouterIntoNorm" in mf["passes"]
    assert mu["options"]["fuse_router_norm"] is None and "FuseRouterIntoNorm" not in mu["passes"]
    (lf, hist), (lu, _) = _run(fused), _run(unfused)
    np.testing.assert_allclose(lf, lu, rtol=1e-5, atol=1e-5)
    model, _ = zoo.model("tiny")
    np.testing.assert_allclose(lf[-1][0], torch_last_logits(model, hist[0]), atol=ATOL, rtol=1e-4)


def test_compiled_fused_equals_unfused_with_cascade(zoo, tmp_path):
    arts = {fuse: moec.compile(zoo.imported("tiny", "pt2"), tmp_path / f"c{fuse}", target="llvm", cascade_groups=4, cascade_keep=2,
                               fuse_router_norm=fuse) for fuse in (True, False)}
    m = json.loads((arts[True] / "manifest.json").read_text())["options"]["fuse_router_norm"]
    assert m["fused"] == {"decode": 2, "prefill": 2}
    (spec,) = m["kernels"].values()
    assert spec["outputs"] == 4 and spec["bias_dtype"] == "float32"  # the coarse router: G logits plus a bias
    np.testing.assert_allclose(_run(arts[True])[0], _run(arts[False])[0], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- kernel launches on CUDA (sm_90)


@tvm.instrument.pass_instrument
class _Scheduled:
    """Keeps the module after phase 3 (the schedules): the PrimFuncs behind the VM's kernel calls."""

    def __init__(self):
        self.mod = None

    def run_after_pass(self, mod, info):
        if info.name == "ApplySchedules":
            self.mod = mod


def _decode_launches(imported, fuse: bool, cascade: bool) -> tuple[collections.Counter, dict]:
    """Kernel launches of one ``decode`` call of the CUDA build, per PrimFunc (keyed by its body).

    The VM's calls in ``decode`` that name a PrimFunc, each counted as the number of ``__global__``
    kernels that PrimFunc compiled to (``<name>_kernel``, ``<name>_kernel_1``, ...).
    """
    import tvm_ffi

    from moec.compiler.build import _cuda_modules
    from moec.passes.cascade_gating import CascadeGating
    from moec.passes.pipeline import moec_pipeline

    target = make_target("cuda", "sm_90")
    cas = CascadeGating(imported.num_inputs, 4, 2, weights=dict(zip(imported.weight_names(), imported.weights))) if cascade else None
    pipe, _ = moec_pipeline(imported.num_inputs, target, "tiny", cascade=cas,
                            fuse_router_norm=FuseRouterIntoNorm(target) if fuse else None)
    keep = _Scheduled()
    with tvm.transform.PassContext(instruments=[keep]):
        ex = tvm.compile(imported.mod, target=target, relax_pipeline=pipe)
    src = "".join(m.inspect_source("cuda") for m in _cuda_modules(ex.mod))
    per_func = collections.Counter(re.sub(r"_kernel(_\d+)?$", "", k)
                                   for k in set(re.findall(r'extern "C" __global__ void __launch_bounds__\(\d+\) (\w+)\(', src)))
    text = ex.as_text()
    decode = text[text.index("@decode:"):].split("\n\n")[0]
    key = {gv.name_hint: tvm_ffi.structural_hash(f.without_attr("global_symbol"))
           for gv, f in keep.mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    launches, names = collections.Counter(), {}
    for call in re.finditer(r"call\s+(\S+)\s+in:", decode):
        name = call.group(1)
        if name in per_func:
            launches[key[name]] += per_func[name]
            names[key[name]] = name
    return launches, names, text


@pytest.fixture(scope="module")
def imported(zoo):
    return zoo.imported("tiny", "pt2")


@pytest.mark.parametrize("cascade", [False, True], ids=["flat", "cascade"])
def test_cuda_decode_one_launch_for_norm_and_router(imported, cascade):
    """Everything but the norm + router region is the same in both builds: the launches only one build has
    are that region's. Unfused, each layer's norm and (coarse) router take >= 2 launches; fused, exactly one."""
    (unfused, un, _), (fused, fn, text) = _decode_launches(imported, False, cascade), _decode_launches(imported, True, cascade)
    # the prefill entry's kernels are the multi-token form (prefill_spec: a row of 64 float32 is one warp's, so the
    # per-token form spreads a token's 8 logits, or 4 coarse ones, over as many blocks), 8 rows a block
    prefill = text[text.index("@prefill:"):].split("\n\n")[0]
    assert re.findall(r"call\s+(norm_router\w*)\s+in:", prefill) == ["norm_router_t8"] * 2
    only_unfused, only_fused = unfused - fused, fused - unfused
    layers = 2
    assert {fn[k] for k in only_fused} == {"norm_router"} and sum(only_fused.values()) == layers  # one launch per layer
    assert sum(only_unfused.values()) >= 2 * layers and all(v % layers == 0 for v in only_unfused.values()), \
        {un[k]: v for k, v in only_unfused.items()}
    assert sum(unfused.values()) - sum(fused.values()) == sum(only_unfused.values()) - layers


# ---------------------------------------------------------------------------- options


def test_cli_flag(monkeypatch, tmp_path):
    from moec.compiler import build, cli

    seen = {}
    monkeypatch.setattr(build, "compile", lambda *a, **kw: seen.update(kw))
    for flag, want in (([], True), (["--no-fuse-router-norm"], False), (["--fuse-router-norm"], True)):
        assert cli.main(["compile", "model.onnx", "-o", str(tmp_path / "a"), *flag]) == 0
        assert seen["fuse_router_norm"] is want
    assert "--fuse-router-norm" in cli.build_parser()._subparsers._group_actions[0].choices["compile"].format_help()


# ---------------------------------------------------------------------------- GPU


def _cuda_device() -> bool:
    from moec.runtime.engine import _load_cuda_runtime

    try:
        _load_cuda_runtime()
    except OSError:  # no CUDA driver here
        return False
    return tvm.cuda(0).exist


@pytest.mark.gpu
def test_gpu_kernel_and_model(zoo, tmp_path):
    if not _cuda_device():
        pytest.skip("no CUDA device")
    arts = {fuse: moec.compile(zoo.imported("tiny", "pt2"), tmp_path / f"g{fuse}", target="cuda", fuse_router_norm=fuse)
            for fuse in (True, False)}
    got = {}
    for fuse, art in arts.items():
        engine = moec.load(art, device="cuda")
        seqs, logits = engine.prefill([[5, 6, 7, 8, 9], [1, 2]])
        got[fuse] = [logits, engine.decode(seqs, logits.argmax(-1))]
    for a, b in zip(got[True], got[False]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------- with the residual add before the norm


@pytest.mark.parametrize("spec", [NormRouterSpec(64, 8, 1e-5, residual=True),
                                  NormRouterSpec(96, 4, 1e-5, *["bfloat16"] * 4, "float32", bias_dtype="float32", residual=True)],
                         ids=["fp32", "bf16-bias"])
def test_residual_kernel_matches_numpy(spec):
    """x = ra + rb written out (rounded as stored) and normalised, the router reading the normalised row."""
    ex = tvm.compile(tvm.IRModule({"norm_router": make_norm_router(spec, "llvm")}), target=LLVM)
    rng = np.random.default_rng(7)
    for t in (1, 5):
        _, w, rows, bias = _kernel_args(spec, t, seed=t)
        ra = (rng.standard_normal((t, spec.hidden)) * 3).astype(NP[spec.x_dtype])
        rb = rng.standard_normal((t, spec.hidden)).astype(NP[spec.x_dtype])
        outs = [np.zeros((t, spec.hidden), NP[spec.x_dtype]), np.zeros((t, spec.hidden), NP[spec.y_dtype]),
                np.zeros((t, spec.outputs), NP[spec.logits_dtype])]
        args = [tvm.runtime.tensor(a) for a in [ra, rb, w, rows] + ([bias] if bias is not None else []) + outs]
        ex["norm_router"](*args)
        x = (ra.astype(np.float32) + rb.astype(np.float32)).astype(NP[spec.x_dtype])
        np.testing.assert_array_equal(args[-3].numpy(), x)
        want_y, want_l = reference(x, w, rows, bias, spec.eps, NP[spec.y_dtype], NP[spec.logits_dtype], spec.rows_layout)
        tol = 1e-5 if spec.y_dtype == "float32" else 1e-2
        np.testing.assert_allclose(args[-2].numpy().astype(np.float32), want_y.astype(np.float32), rtol=tol, atol=tol)
        np.testing.assert_allclose(args[-1].numpy().astype(np.float32), want_l.astype(np.float32), rtol=tol, atol=tol * 10)


def test_residual_cuda_form_builds():
    from tvm.support import nvcc

    from moec.compiler.build import _cuda_modules

    target = make_target("cuda", "sm_90")
    spec = NormRouterSpec(2048, 64, 1e-5, *["bfloat16"] * 5, residual=True)
    src = _cuda_modules(tvm.compile(tvm.IRModule({"norm_router": make_norm_router(spec, "cuda")}), target=target).mod)[0].inspect_source("cuda")
    assert "ra_ptr" in src and "rb_ptr" in src and src.count("uint4") >= 5
    with target:
        assert len(nvcc.compile_cuda(src, target_format="fatbin", arch="sm_90", compiler="nvcc")) > 0


def test_ir_residual_add_fused(tmp_path):
    """``h = r + u`` before the norm (the residual stream, used again after): the add, the norm and the router are
    one kernel; values as before."""
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    r = relax.Var("r", relax.TensorType([n, D], "float32"))
    u = relax.Var("u", relax.TensorType([n, D], "float32"))
    w = relax.Var("w", relax.TensorType((D,), "float32"))
    rt = relax.Var("router", relax.TensorType((E, D), "float32"))
    with bb.function("decode", [r, u, w, rt], attrs={"num_input": 2}):
        with bb.dataflow():
            emit = bb.emit
            h = emit(relax.op.add(r, u))
            ms = emit(relax.op.mean(emit(relax.op.multiply(h, h)), axis=[-1], keepdims=True))
            o = emit(relax.op.multiply(w, emit(relax.op.multiply(h, emit(relax.op.rsqrt(emit(relax.op.add(ms, relax.const(1e-5, "float32")))))))))
            logits = emit(relax.op.matmul(o, emit(relax.op.permute_dims(rt, [1, 0]))))
            top = emit(relax.op.topk(emit(relax.op.nn.softmax(logits, axis=-1)), k=2, axis=-1, ret_type="both", largest=True, dtype="int64"))
            out = bb.emit_output(relax.Tuple([emit(relax.op.add(h, o)), emit(relax.TupleGetItem(top, 0)), emit(relax.TupleGetItem(top, 1))]))
        bb.emit_func_output(out)
    before = bb.get()
    p, after = _fuse(before)
    ops = [c.op.name for c in _calls(after["decode"], "relax.call_tir")]
    assert p.fused == {"decode": 1} and len(ops) == 1
    assert len(_calls(after["decode"], "relax.add")) == 1  # only the later use of the residual
    rng = np.random.default_rng(8)
    args = [rng.standard_normal((5, D)).astype(np.float32) for _ in range(2)] + [rng.uniform(0.5, 1.5, D).astype(np.float32),
                                                                                (rng.standard_normal((E, D)) * 0.1).astype(np.float32)]
    outs = []
    for mod in (before, after):
        mod = relax.transform.LegalizeOps({"relax.topk": __import__("moec.passes.legalize_topk", fromlist=["x"]).legalize_topk})(mod)
        vm = relax.VirtualMachine(tvm.compile(mod, target=LLVM), tvm.cpu())
        outs.append([t.numpy() for t in vm["decode"](*[tvm.runtime.tensor(a) for a in args])])
    np.testing.assert_allclose(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(outs[1][2], outs[0][2])


# ---------------------------------------------------------------------------- the top-k form (router + topk_softmax)

TOPK_SPECS = [
    (NormRouterSpec(64, 8, 1e-5, topk=2), 1),
    (NormRouterSpec(256, 40, 1e-5, *["bfloat16"] * 5, residual=True, topk=4, values_dtype="bfloat16"), 1),
    (NormRouterSpec(256, 12, 1e-5, *["bfloat16"] * 4, "float32", topk=3, index_dtype="int32"), 3),
    (NormRouterSpec(200, 6, 1e-6, rows_layout="de", residual=True, topk=6), 2),
]
TOPK_IDS = ["fp32-k2", "bf16-residual-40x4", "bf16-int32-tokens3", "transposed-residual-all"]


def _topk_inputs(spec, t, seed):
    rng = np.random.default_rng(seed)
    x, w, rows, _ = _kernel_args(spec, t, seed=seed)
    if spec.residual:
        ra = (rng.standard_normal((t, spec.hidden)) * 3).astype(NP[spec.x_dtype])
        rb = rng.standard_normal((t, spec.hidden)).astype(NP[spec.x_dtype])
        x = (ra.astype(np.float32) + rb.astype(np.float32)).astype(NP[spec.x_dtype])
        return {"ra": ra, "rb": rb, "w": w, "rows": rows}, x
    return {"x": x, "w": w, "rows": rows}, x


def _check_topk(spec, x, w, rows, got_x, y, idx, val):
    want_y, want_l = reference(x, w, rows, None, spec.eps, NP[spec.y_dtype], NP[spec.logits_dtype], spec.rows_layout)
    want_i, want_v = reference_topk(want_l, spec.topk)
    tol = 1e-5 if spec.y_dtype == "float32" else 1e-2
    if got_x is not None:
        np.testing.assert_array_equal(got_x, x)
    np.testing.assert_allclose(y.astype(np.float32), want_y.astype(np.float32), rtol=tol, atol=tol)
    np.testing.assert_array_equal(idx, want_i)
    np.testing.assert_allclose(val.astype(np.float32), want_v, rtol=1e-2 if spec.values_dtype != "float32" else 1e-5, atol=1e-6)


@pytest.mark.parametrize("spec,tokens", TOPK_SPECS, ids=TOPK_IDS)
def test_topk_form_matches_numpy(spec, tokens):
    """The norm + router + softmax top-k in one kernel (llvm form): the normalised rows as the plain kernel's, the
    indices and softmax values of ``topk_softmax`` over the logits as stored; no logits written."""
    ex = tvm.compile(tvm.IRModule({"norm_router": make_norm_router(spec, "llvm")}), target=LLVM)
    for t in (1, 7):
        ins, x = _topk_inputs(spec, t, seed=t)
        outs = ([np.zeros((t, spec.hidden), NP[spec.x_dtype])] if spec.residual else []) + [
            np.zeros((t, spec.hidden), NP[spec.y_dtype]), np.zeros((t, spec.topk), spec.index_dtype),
            np.zeros((t, spec.topk), NP[spec.values_dtype])]
        args = [tvm.runtime.tensor(a) for a in list(ins.values()) + outs]
        ex["norm_router"](*args)
        got = [a.numpy() for a in args[len(ins):]]
        _check_topk(spec, x, ins["w"], ins["rows"], got[0] if spec.residual else None, *got[-3:])


@pytest.mark.parametrize("spec,tokens", TOPK_SPECS, ids=TOPK_IDS)
def test_topk_cuda_form_emulated(spec, tokens):
    """The CUDA top-k form (the multi-token kernel, ``tokens`` rows a block; a warp per row selects K of the block's
    logits in shared memory) on the CPU emulation of its generated code, against NumPy, with a partial last block."""
    from dataclasses import replace

    from cuda_emu import EmulatedKernel

    from moec.compiler.build import _cuda_modules

    spec = replace(spec, tokens=tokens)
    src = _cuda_modules(tvm.compile(tvm.IRModule({"norm_router": make_norm_router(spec, "cuda")}),
                                    target=make_target("cuda", "sm_90")).mod)[0].inspect_source("cuda")
    kern = EmulatedKernel(src, "norm_router_kernel")
    cfg = launch_config(spec)
    assert cfg["shared_bytes"] == tokens * spec.hidden * NP[spec.y_dtype](0).itemsize + tokens * spec.outputs * 4
    for t in (5, 11):
        ins, x = _topk_inputs(spec, t, seed=t)
        y = np.full((t, spec.hidden), np.nan, NP[spec.y_dtype])
        idx = np.full((t, spec.topk), -7, spec.index_dtype)
        val = np.full((t, spec.topk), np.nan, NP[spec.values_dtype])
        args = {**ins, "y": y, "idx": idx, "val": val, "N": t}
        if spec.residual:
            args["x"] = np.zeros_like(x)
        kern((-(-t // tokens), 1, 1), cfg["threads"],
             **{k: (v.view(np.uint16) if isinstance(v, np.ndarray) and v.dtype == ml_dtypes.bfloat16 else v) for k, v in args.items()})
        _check_topk(spec, x, ins["w"], ins["rows"], args["x"] if spec.residual else None, y, idx, val)


def test_topk_form_refusals():
    with pytest.raises(MoecError, match="topk must be"):
        NormRouterSpec(64, 8, 1e-5, topk=9).check()
    with pytest.raises(MoecError, match="no router bias"):
        NormRouterSpec(64, 8, 1e-5, bias_dtype="float32", topk=2).check()
    with pytest.raises(MoecError, match="exceeds the 992"):
        NormRouterSpec(64, 1000, 1e-5, topk=2).check()
    with pytest.raises(MoecError, match="multi-token one on CUDA"):
        make_norm_router(NormRouterSpec(64, 8, 1e-5, topk=2), "cuda")


def _phase1(imported, target, topk: bool):
    """Phase 1 of the default pipeline with the norm + router fusion, the top-k joining it (``topk``) or not."""
    from moec.passes import pipeline as pl

    fuse = FuseRouterIntoNorm(target)
    if not topk:  # the same pipeline with FuseTopKIntoRouterNorm a no-op
        orig = pl.FuseTopKIntoRouterNorm
        pl.FuseTopKIntoRouterNorm = lambda *a, **k: tvm.transform.module_pass(lambda m, _c: m, opt_level=0, name="noop")
    try:
        pipe, _ = pl.moec_pipeline(imported.num_inputs, target, "hf-olmoe", fuse_router_norm=fuse, phases=1)
        with target:
            return pipe(imported.mod), fuse
    finally:
        if not topk:
            pl.FuseTopKIntoRouterNorm = orig


@pytest.mark.parametrize("target", ["cuda"])  # (the llvm build: test_compiled_topk_fused_equals_unfused's manifest)
def test_ir_topk_joins_the_norm_router(zoo, target):
    """An OLMoE router (softmax, top-k of the probabilities, no renormalisation: ``FuseSoftmaxTopK``'s topk_softmax):
    before, each layer's norm_router writes logits that a topk_softmax kernel reads; after, in the prefill entry (the
    multi-token form, 8 rows a block) one norm_router_topk call a layer gives the indices and values; the decode entry
    (the per-token form on CUDA) keeps the pair, each skip saying why."""
    from moec.passes.fuse_router_norm import PER_TOKEN_REASON

    imported = zoo.imported("hf-olmoe", "pt2")
    tgt = LLVM if target == "llvm" else make_target("cuda", "sm_90")
    (before, _), (after, fuse) = _phase1(imported, tgt, False), _phase1(imported, tgt, True)
    layers = 2
    assert fuse.topk_fused == {"decode": 0, "prefill": layers} and not fuse.topk_skipped["prefill"]
    assert len(fuse.topk_skipped["decode"]) == layers and all(PER_TOKEN_REASON in r for r in fuse.topk_skipped["decode"])
    names = {entry: ([c.args[0].name_hint for c in _tir_calls(before[entry])],
                     [c.args[0].name_hint for c in _tir_calls(after[entry])]) for entry in ("decode", "prefill")}
    assert names["decode"][0] == names["decode"][1] and names["decode"][1].count("topk_softmax") == layers
    names_b, names_a = names["prefill"]
    assert names_b.count("topk_softmax") == layers and "topk_softmax" not in names_a
    fused = [c for c in _tir_calls(after["prefill"]) if c.args[0].name_hint.startswith("norm_router_topk")]
    assert len(fused) == layers and not [n for n in names_a if n.startswith("norm_router") and "topk" not in n]
    # the other kernels are the same, call for call
    rest = lambda names: [n for n in names if not n.startswith(("norm_router", "topk_softmax"))]  # noqa: E731
    assert rest(names_a) == rest(names_b)
    for c in fused:
        spec = next(s for s, n in fuse.kernels.items() if n == c.args[0].name_hint)
        assert (spec.outputs, spec.topk, spec.index_dtype, spec.residual, spec.tokens) == (8, 2, "int64", True, 8)
        assert [f.dtype for f in c.ty.fields] == ["float32", "float32", "int64", "float32"]  # x, y, idx, val: no logits
    assert fuse.manifest()["topk_fused"] == {"decode": 0, "prefill": layers}


def test_compiled_topk_fused_matches_torch(zoo):
    """hf-olmoe compiled by default (norm + router + top-k in one kernel a layer, both entries) against torch: prefill
    and three decode steps (the build without the router fusion: test_compiled_fused_equals_unfused's form)."""
    fused = zoo.artifact("hf-olmoe", "pt2")  # the default build (test_engine's)
    mf = json.loads((fused / "manifest.json").read_text())["options"]["fuse_router_norm"]
    assert mf["topk_fused"] == {"decode": 2, "prefill": 2} and not mf["topk_skipped"]
    assert [spec["topk"] for name, spec in mf["kernels"].items() if name.startswith("norm_router_topk")] == [2]
    lf, hist = _run(fused)
    model, _ = zoo.model("hf-olmoe")
    for i in range(2):
        np.testing.assert_allclose(lf[-1][i], torch_last_logits(model, hist[i]), atol=ATOL, rtol=1e-4)
