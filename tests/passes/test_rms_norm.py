"""InsertRMSNorm and the ``rms_norm`` kernel: NumPy numerics (llvm; CUDA on a GPU), the CUDA form's launch,
the IR before / after, forms left alone, and compiled models against torch with the pass on and off."""

import json
import re

import ml_dtypes
import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import moec
from moec.compiler.errors import MoecError
from moec.compiler.targets import make_target
from moec.passes.rms_norm import InsertRMSNorm
from moec.schedules.kernels.rms_norm import RMSNormSpec, launch_config, make_rms_norm, reference, residual_sum

from moec_testing import require_cuda

LLVM = tvm.target.Target({"kind": "llvm"})
NP = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
SPECS = [RMSNormSpec(64, 1e-5), RMSNormSpec(2048, 1e-6, "bfloat16", "bfloat16", "bfloat16"),
         RMSNormSpec(100, 1e-5, "float16", "float16", "float16"), RMSNormSpec(128, 1e-5, "float32", "bfloat16", "bfloat16"),
         RMSNormSpec(5120, 1e-5, "bfloat16", "float32", "bfloat16")]
IDS = ["fp32", "bf16-2048", "fp16-100", "f32-in-bf16-out", "bf16-5120"]


def _args(spec, n, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, spec.hidden)) * rng.uniform(0.1, 20, (n, 1))).astype(NP[spec.x_dtype])
    w = rng.uniform(0.5, 1.5, spec.hidden).astype(NP[spec.weight_dtype])
    return x, w


def _check(spec, run):
    for n in (1, 7, 130):  # one kernel, any row count (130: rows past the last full block of 4)
        x, w = _args(spec, n, seed=n)
        y = run(x, w, np.zeros((n, spec.hidden), NP[spec.y_dtype])).astype(np.float32)
        want = reference(x, w, spec.eps, NP[spec.y_dtype]).astype(np.float32)
        tol = 1e-5 if spec.y_dtype == "float32" else 1e-2  # 16-bit outputs: at most one rounding step apart
        np.testing.assert_allclose(y, want, rtol=tol, atol=tol)
        xf = x.astype(np.float64)  # and the definition itself, in float64
        yd = w.astype(np.float64) * xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + spec.eps)
        np.testing.assert_allclose(y, yd, rtol=2e-2 if spec.y_dtype != "float32" else 1e-5, atol=1e-5)


def _runner(ex, dev):
    def run(x, w, y):
        out = tvm.runtime.tensor(y, dev)
        ex["rms_norm"](tvm.runtime.tensor(x, dev), tvm.runtime.tensor(w, dev), out)
        return out.numpy()
    return run


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_kernel_matches_numpy(spec):
    _check(spec, _runner(tvm.compile(tvm.IRModule({"rms_norm": make_rms_norm(spec, "llvm")}), target=LLVM), tvm.cpu()))


def test_cuda_form_launch_and_nvcc():
    from tvm.support import nvcc

    from moec.compiler.build import _cuda_modules

    target = make_target("cuda", "sm_90")
    cases = {  # (spec, launch bounds, a barrier across the row's warps, 16-byte loads of x)
        SPECS[1]: ("256", True, True),  # 2048 bf16: 256 chunks of 8, a block per row
        RMSNormSpec(128, 1e-5, "bfloat16", "bfloat16", "bfloat16"): ("128", False, True),  # a warp per row, 4 rows a block
        RMSNormSpec(5120, 1e-5, "bfloat16", "bfloat16", "bfloat16"): ("256", True, True),  # 640 chunks: 3 a thread, the last partial
        SPECS[4]: ("256", True, False),  # float32 weights: 4 elements a chunk (8 bytes of x), 1280 chunks, 5 a thread
    }
    assert launch_config(SPECS[4])["iters"] == 5 and launch_config(SPECS[1])["rows_per_block"] == 1
    assert launch_config(RMSNormSpec(5120, 1e-5, "bfloat16", "bfloat16", "bfloat16"))["iters"] == 3
    assert launch_config(RMSNormSpec(128, 1e-5, "bfloat16", "bfloat16", "bfloat16"))["rows_per_block"] == 4
    for spec, (bounds, barrier, wide) in cases.items():
        ex = tvm.compile(tvm.IRModule({"rms_norm": make_rms_norm(spec, "cuda")}), target=target)
        src = _cuda_modules(ex.mod)[0].inspect_source("cuda")
        assert set(re.findall(r'__launch_bounds__\((\d+)\) (\w+)\(', src)) == {(bounds, "rms_norm_kernel")}
        assert "__shfl_xor_sync" in src and ("__syncthreads" in src) == barrier and ("uint4" in src) == wide
        with target:
            assert len(nvcc.compile_cuda(src, target_format="fatbin", arch="sm_90", compiler="nvcc")) > 0


RESIDUAL = [RMSNormSpec(2048, 1e-6, "bfloat16", "bfloat16", "bfloat16", residual=True),
            RMSNormSpec(100, 1e-5, "float32", "float32", "float32", residual=True)]


def _check_residual(spec, run):
    rng = np.random.default_rng(4)
    for n in (1, 9):
        a = (rng.standard_normal((n, spec.hidden)) * 4).astype(NP[spec.x_dtype])
        b = rng.standard_normal((n, spec.hidden)).astype(NP[spec.x_dtype])
        w = rng.uniform(0.5, 1.5, spec.hidden).astype(NP[spec.weight_dtype])
        x, y = run(a, b, w)
        want_x = residual_sum(a, b)
        np.testing.assert_array_equal(x, want_x)  # the sum as the unfused add stores it
        tol = 1e-5 if spec.y_dtype == "float32" else 1e-2
        np.testing.assert_allclose(y.astype(np.float32), reference(want_x, w, spec.eps, NP[spec.y_dtype]).astype(np.float32),
                                   rtol=tol, atol=tol)


def _residual_runner(ex, spec, dev):
    def run(a, b, w):
        x = tvm.runtime.tensor(np.zeros(a.shape, NP[spec.x_dtype]), dev)
        y = tvm.runtime.tensor(np.zeros(a.shape, NP[spec.y_dtype]), dev)
        ex["rms_norm"](*[tvm.runtime.tensor(t, dev) for t in (a, b, w)], x, y)
        return x.numpy(), y.numpy()
    return run


@pytest.mark.parametrize("spec", RESIDUAL, ids=["bf16-2048", "fp32-100"])
def test_residual_kernel_matches_numpy(spec):
    """With the residual add: x = a + b written out (rounded as stored) and normalised."""
    ex = tvm.compile(tvm.IRModule({"rms_norm": make_rms_norm(spec, "llvm")}), target=LLVM)
    _check_residual(spec, _residual_runner(ex, spec, tvm.cpu()))


def test_residual_cuda_form_builds():
    from tvm.support import nvcc

    from moec.compiler.build import _cuda_modules

    target = make_target("cuda", "sm_90")
    ex = tvm.compile(tvm.IRModule({"rms_norm": make_rms_norm(RESIDUAL[0], "cuda")}), target=target)
    src = _cuda_modules(ex.mod)[0].inspect_source("cuda")
    assert re.findall(r'__launch_bounds__\((\d+)\) (\w+)\(', src) == [("256", "rms_norm_kernel")] * 2  # decl + def
    assert src.count("uint4") >= 4  # a, b, w loaded and x stored 16 bytes at a time
    with target:
        assert len(nvcc.compile_cuda(src, target_format="fatbin", arch="sm_90", compiler="nvcc")) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("spec", RESIDUAL, ids=["bf16-2048", "fp32-100"])
def test_residual_cuda_kernel_matches_numpy_on_gpu(spec):
    require_cuda()
    ex = tvm.compile(tvm.IRModule({"rms_norm": make_rms_norm(spec, "cuda")}), target=make_target("cuda", "sm_90"))
    _check_residual(spec, _residual_runner(ex, spec, tvm.cuda()))


def test_kernel_refusals():
    with pytest.raises(MoecError, match="x_dtype must be one of"):
        make_rms_norm(RMSNormSpec(64, 1e-5, x_dtype="int8"))
    with pytest.raises(MoecError, match="positive integer"):
        make_rms_norm(RMSNormSpec(0, 1e-5))
    with pytest.raises(MoecError, match="eps must be"):
        make_rms_norm(RMSNormSpec(64, -1.0))
    with pytest.raises(MoecError, match="target must be"):
        make_rms_norm(RMSNormSpec(64, 1e-5), target="rocm")


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_cuda_kernel_matches_numpy_on_gpu(spec):
    require_cuda()
    ex = tvm.compile(tvm.IRModule({"rms_norm": make_rms_norm(spec, "cuda")}), target=make_target("cuda", "sm_90"))
    _check(spec, _runner(ex, tvm.cuda()))


# ---------------------------------------------------------------------------- IR before / after


def _entry(shape=("n", 64), dtype="bfloat16", mean_axis=-1, weight_shape=None, hf_casts=True):
    """``decode(x, w)``: an RMSNorm (HF's form: float32 inside, the normalised row cast back before ``w *``)
    followed by a tanh, so no router reads it."""
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    shp = [n if s == "n" else s for s in shape]
    x = relax.Var("x", relax.TensorType(shp, dtype))
    w = relax.Var("w", relax.TensorType(weight_shape or (shape[-1],), dtype))
    with bb.function("decode", [x, w], attrs={"num_input": 1}):
        with bb.dataflow():
            emit = bb.emit
            xx = emit(relax.op.astype(x, "float32")) if hf_casts else x
            cdt = "float32" if hf_casts else dtype
            ms = emit(relax.op.mean(emit(relax.op.power(xx, relax.const(2.0, cdt))), axis=[mean_axis], keepdims=True))
            r = emit(relax.op.rsqrt(emit(relax.op.add(ms, relax.const(1e-5, cdt)))))
            nx = emit(relax.op.multiply(xx, r))
            if hf_casts:
                nx = emit(relax.op.astype(nx, dtype))
            h = emit(relax.op.multiply(w, nx))
            out = bb.emit_output(emit(relax.op.tanh(h)))
        bb.emit_func_output(out)
    return bb.get()


def _insert(mod, target=LLVM):
    from moec.passes.simplify_power import SimplifyPower

    p = InsertRMSNorm(target)
    return p, relax.transform.DeadCodeElimination(["decode"])(p(SimplifyPower()(mod)))


def _calls(func):
    found = []
    relax.analysis.post_order_visit(func.body, lambda e: found.append(e) if isinstance(e, relax.Call) and isinstance(
        e.op, tvm.ir.Op) else None)
    return found


def _expected(before, spec, shape):
    """What the pass guarantees, built by hand: the norm is one rms_norm call over [N, D] rows."""
    x, w = before["decode"].params
    bb = relax.BlockBuilder()
    gv = bb.add_func(make_rms_norm(spec, "llvm").without_attr("global_symbol").with_attr("op_pattern", 8), "rms_norm")
    n = x.ty.shape[0]
    rows = n * shape[1] if len(shape) == 3 else n
    with bb.function("decode", [x, w], attrs={"num_input": 1}):
        with bb.dataflow():
            xr = bb.emit(relax.op.reshape(x, [rows, spec.hidden])) if len(shape) == 3 else x
            y = bb.emit(relax.call_tir(gv, [xr, w], out_ty=relax.TensorType([rows, spec.hidden], spec.y_dtype)))
            if len(shape) == 3:
                y = bb.emit(relax.op.reshape(y, [n, shape[1], spec.hidden]))
            out = bb.emit_output(bb.emit(relax.op.tanh(y)))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("shape", [("n", 64), ("n", 4, 32)], ids=["rows", "per-head"])
def test_ir_before_after(shape):
    before = _entry(shape)
    ops = [c.op.name for c in _calls(before["decode"])]
    assert ops.count("relax.astype") == 2 and "relax.mean" in ops and "relax.rsqrt" in ops
    p, after = _insert(before)
    assert p.replaced == {"decode": 1} and not p.skipped["decode"]
    spec = RMSNormSpec(shape[-1], float(np.float32(1e-5)), "bfloat16", "bfloat16", "bfloat16")
    tvm.ir.assert_structural_equal(after, _expected(before, spec, shape), map_free_vars=True)
    assert p.manifest()["kernels"] == {"rms_norm": {**spec.__dict__}}


def test_ir_residual_add_is_computed_in_the_kernel():
    """``h = r + u`` feeding the norm and used again (the residual stream): one kernel writes both."""
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    r = relax.Var("r", relax.TensorType([n, 64], "bfloat16"))
    u = relax.Var("u", relax.TensorType([n, 64], "bfloat16"))
    w = relax.Var("w", relax.TensorType((64,), "bfloat16"))
    with bb.function("decode", [r, u, w], attrs={"num_input": 2}):
        with bb.dataflow():
            emit = bb.emit
            h = emit(relax.op.add(r, u))
            xx = emit(relax.op.astype(h, "float32"))
            ms = emit(relax.op.mean(emit(relax.op.multiply(xx, xx)), axis=[-1], keepdims=True))
            nx = emit(relax.op.astype(emit(relax.op.multiply(xx, emit(relax.op.rsqrt(emit(relax.op.add(ms, relax.const(1e-5, "float32"))))))), "bfloat16"))
            o = emit(relax.op.multiply(w, nx))
            out = bb.emit_output(emit(relax.op.add(h, emit(relax.op.tanh(o)))))  # h used again
        bb.emit_func_output(out)
    before = bb.get()
    p = InsertRMSNorm(LLVM)
    after = relax.transform.DeadCodeElimination(["decode"])(p(before))
    ops = [c.op.name for c in _calls(after["decode"])]
    assert p.residual == {"decode": 1} and ops.count("relax.call_tir") == 1 and ops.count("relax.add") == 1  # the last add
    rng = np.random.default_rng(5)
    args = [rng.standard_normal((6, 64)).astype(ml_dtypes.bfloat16) for _ in range(2)] + [rng.uniform(0.5, 1.5, 64).astype(ml_dtypes.bfloat16)]
    outs = []
    for mod in (before, after):
        vm = relax.VirtualMachine(tvm.compile(mod, target=LLVM), tvm.cpu())
        outs.append(vm["decode"](*[tvm.runtime.tensor(a) for a in args]).numpy().astype(np.float32))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-2, atol=1e-2)  # one rounding of w * x * r apart


@pytest.mark.parametrize("kw", [dict(mean_axis=0, shape=(8, 64)), dict(weight_shape=(1, 64))], ids=["mean-over-rows", "weight-2d"])
def test_not_an_rms_norm_stays(kw):
    before = _entry(**kw)
    p, after = _insert(before)
    assert p.replaced == {"decode": 0}
    assert any(c.op.name == "relax.rsqrt" for c in _calls(after["decode"]))


def test_ir_forms_compute_the_same():
    """Without casts (float32 throughout), per-head: the rewritten function computes the original's values."""
    for kw in (dict(dtype="float32", hf_casts=False), dict(shape=("n", 4, 32), dtype="float32")):
        before = _entry(**kw)
        _, after = _insert(before)
        shape = [5 if s == "n" else s for s in kw.get("shape", ("n", 64))]
        rng = np.random.default_rng(0)
        x, w = rng.standard_normal(shape).astype(np.float32), rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32)
        outs = []
        for mod in (before, after):
            ex = tvm.compile(mod, target=LLVM)
            vm = relax.VirtualMachine(ex, tvm.cpu())
            outs.append(vm["decode"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy())
        np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- compiled models


def test_compiled_equals_unfused_and_torch(zoo, tmp_path):
    """HF OLMoE (input norms, QK-norms over the whole projection, the final norm) with the pass on and off: the
    same greedy tokens, logits within float32 rounding of each other and of torch. (Per-head QK-norms:
    Qwen3-MoE in tests/compiler/test_hf_families.py, with the pass on.)"""
    from moec_testing import ATOL, prefill_and_decode, torch_last_logits

    model, _ = zoo.model("hf-olmoe")  # tiny_hf_model("olmoe")
    on = zoo.artifact("hf-olmoe", "pt2")  # the default build (test_engine's)
    off = moec.compile(zoo.imported("hf-olmoe", "pt2"), tmp_path / "off", target="llvm", rms_norm=False)
    import json

    doc = json.loads((on / "manifest.json").read_text())["options"]["rms_norm"]
    # per entry: 2 layers x (input norm [+ q and k norms]) + the final norm; the routers' norms are fused with them
    assert doc["replaced"]["decode"] == 2 * 3 + 1
    assert doc["with_residual_add"]["decode"] == 2  # layer 1's input norm and the final norm: after a residual add
    assert json.loads((off / "manifest.json").read_text())["options"]["rms_norm"] is None
    prompts = [[5, 9, 2, 7, 1, 3, 8], [4, 4, 11, 6, 2, 9, 1, 12, 3, 5, 10]]
    got, hist = prefill_and_decode(on, prompts, 3)
    want, want_hist = prefill_and_decode(off, prompts, 3)
    assert hist == want_hist
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    for i in range(len(got)):  # call i's logits are those of each history's first len(prompt) + i tokens
        for b, p in enumerate(prompts):
            np.testing.assert_allclose(got[i][b], torch_last_logits(model, hist[b][:len(p) + i]), rtol=ATOL, atol=ATOL)
    with pytest.raises(MoecError, match="rms_norm must be True or False"):
        moec.compile(model, tmp_path / "bad", target="llvm", rms_norm="yes")


# ---------------------------------------------------------------------------- two norms in one launch


PAIRS = [RMSNormSpec(2048, 1e-6, "float32", "bfloat16", "bfloat16", pair=True),  # OLMoE's Q- and K-norms
         RMSNormSpec(128, 1e-6, "bfloat16", "bfloat16", "bfloat16", pair=True)]  # per head: a warp a row


@pytest.mark.parametrize("spec", PAIRS, ids=["f32-2048", "bf16-per-head"])
def test_pair_kernel_matches_numpy_and_the_single_kernel(spec):
    """``pair``: x1 [N1, D] and x2 [N2, D] (their own weights) in one launch, each as the one-norm kernel computes it:
    llvm against NumPy; the CUDA form on the CPU emulation bit for bit against the emulated one-norm kernel (N1 != N2:
    per-head norms of 4 query and 2 KV heads)."""
    from dataclasses import replace

    from cuda_emu import EmulatedKernel

    rng = np.random.default_rng(7)
    n1, n2 = 12, 6
    x1, x2 = (rng.standard_normal((n, spec.hidden)).astype(NP[spec.x_dtype]) * s for n, s in ((n1, 1), (n2, 3)))
    w1, w2 = (rng.uniform(0.5, 1.5, spec.hidden).astype(NP[spec.weight_dtype]) for _ in range(2))
    ex = tvm.compile(tvm.IRModule({"rms_norm": make_rms_norm(spec, "llvm")}), target=LLVM)
    y1, y2 = (tvm.runtime.tensor(np.zeros((n, spec.hidden), NP[spec.y_dtype])) for n in (n1, n2))
    ex["rms_norm"](*[tvm.runtime.tensor(t) for t in (x1, w1, x2, w2)], y1, y2)
    for y, x, w in ((y1, x1, w1), (y2, x2, w2)):
        np.testing.assert_allclose(y.numpy().astype(np.float32), reference(x, w, spec.eps, NP[spec.y_dtype]).astype(np.float32),
                                   rtol=1e-2, atol=1e-2)
    bits = lambda t: t.view(np.uint16) if t.dtype != np.float32 else t  # noqa: E731
    cfg = launch_config(spec)
    src = lambda s: tvm.compile(tvm.IRModule({"rms_norm": make_rms_norm(s, "cuda")}), target=make_target("cuda")).mod.imports[0].inspect_source()  # noqa: E731
    pair, one = EmulatedKernel(src(spec), "rms_norm_kernel"), EmulatedKernel(src(replace(spec, pair=False)), "rms_norm_kernel")
    got = [np.zeros((n, spec.hidden), NP[spec.y_dtype]) for n in (n1, n2)]
    pair((-(-max(n1, n2) // cfg["rows_per_block"]), 2, 1), cfg["threads"], x1=bits(x1), w1=bits(w1), x2=bits(x2), w2=bits(w2),
         y1=bits(got[0]), y2=bits(got[1]), N1=n1, N2=n2)
    for g, x, w in zip(got, (x1, x2), (w1, w2)):
        want = np.zeros_like(g)
        one((-(-x.shape[0] // cfg["rows_per_block"]), 1, 1), cfg["threads"], x=bits(x), w=bits(w), y=bits(want), N=x.shape[0])
        np.testing.assert_array_equal(bits(g), bits(want))


def test_pair_refuses_a_residual():
    with pytest.raises(MoecError, match="pair of norms takes no residual"):
        make_rms_norm(RMSNormSpec(64, 1e-5, residual=True, pair=True))


def test_norms_of_two_widths_stay_two_launches(zoo):
    """HF OLMoE's tiny test model groups its KV heads: its Q- and K-norms differ in width and keep a launch each (the
    pair and its numerics, on a model whose two norms share a width: tests/passes/test_fuse_combine_norm.py)."""
    doc = json.loads((zoo.artifact("hf-olmoe", "pt2") / "manifest.json").read_text())["options"]["rms_norm"]
    assert doc["paired"] == {"decode": 0, "prefill": 0} and doc["replaced"]["decode"] == 7
