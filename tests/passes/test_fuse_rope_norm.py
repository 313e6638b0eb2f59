"""FuseRoPEIntoNorm and the ``rms_norm`` kernel's rotary embedding: the kernel's forms against NumPy (llvm; CUDA on the
CPU emulator) and PyTorch, the IR before / after on hand-built entries, the forms left alone, and the fused entry's
results against the unfused one's bit for bit. (A compiled OLMoE-shaped model with the fusion on and off:
tests/passes/test_fuse_combine_norm.py.)"""

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from moec.compiler.errors import MoecError
from moec.compiler.targets import make_target
from moec.passes.fuse_rope_norm import FuseRoPEIntoNorm
from moec.passes.rms_norm import InsertRMSNorm
from moec.passes.simplify_power import SimplifyPower
from moec.schedules.kernels.rms_norm import RMSNormSpec, launch_config, make_rms_norm, reference, rope_reference

LLVM = tvm.target.Target({"kind": "llvm"})
BF = ml_dtypes.bfloat16
NP = {"float32": np.float32, "float16": np.float16, "bfloat16": BF}
SPECS = [RMSNormSpec(256, 1e-6, "float32", "bfloat16", "bfloat16", pair=True, rope=32, rope_token=256, rope_out="float32"),
         RMSNormSpec(32, 1e-6, "bfloat16", "bfloat16", "bfloat16", rope=32, rope_token=128),  # per head: 4 rows a token
         RMSNormSpec(128, 1e-5, "float32", "float32", "float32", pair=True, rope=64, rope_token=128),
         # Qwen3-MoE-like per-head norms, 4 query heads and 2 KV heads a token: rows (8, 4) are 2 tokens for either
         RMSNormSpec(32, 1e-6, "bfloat16", "bfloat16", "bfloat16", pair=True, rope=32, rope_token=128, rope_token2=64)]
IDS = ["olmoe-like-pair", "per-head-bf16", "fp32-pair", "per-head-gqa-pair"]


def _tokens(spec, i):
    return spec.rope_token2 or spec.rope_token if i else spec.rope_token


def _inputs(spec, seed=0):
    rng = np.random.default_rng(seed)
    rows = (8, 4) if spec.rope_token2 else (5, 3)
    xs = [(rng.standard_normal((n, spec.hidden)) * 3).astype(NP[spec.x_dtype]) for n in rows]
    ws = [rng.uniform(0.5, 1.5, spec.hidden).astype(NP[spec.weight_dtype]) for _ in rows]
    tokens = max(-(-n * spec.hidden // _tokens(spec, i)) for i, n in enumerate(rows))
    ang = rng.uniform(0, 6.3, (tokens, spec.rope))
    return xs, ws, np.cos(ang).astype(NP[spec.y_dtype]), np.sin(ang).astype(NP[spec.y_dtype])


def _want(spec, i, x, w, cs, sn, per_op):
    y = reference(x, w, spec.eps, NP[spec.y_dtype])
    return rope_reference(y, cs, sn, spec.rope, _tokens(spec, i), NP[spec.out_dtype], per_op=per_op).astype(np.float32)


def _compare(got, want, spec):
    if spec.y_dtype == "float32":  # (float32: the compiler may contract a product and the sum into one FMA)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_llvm_form_matches_numpy(spec):
    """The llvm form: y rounded as the norm stores it, the rotation in float32, rounded once (TVM's llvm code for the
    unfused graph computes the fused rotation kernel so)."""
    ex = tvm.compile(tvm.IRModule({"rms_norm": make_rms_norm(spec, "llvm")}), target=LLVM)
    xs, ws, cs, sn = _inputs(spec)
    n = 2 if spec.pair else 1
    ys = [tvm.runtime.tensor(np.zeros(x.shape, NP[spec.out_dtype])) for x in xs[:n]]
    ins = [xs[0], ws[0], xs[1], ws[1], cs, sn] if spec.pair else [xs[0], ws[0], cs, sn]
    ex["rms_norm"](*[tvm.runtime.tensor(t) for t in ins], *ys)
    for i in range(n):
        _compare(ys[i].numpy().astype(np.float32), _want(spec, i, xs[i], ws[i], cs, sn, per_op=False), spec)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_cuda_form_emulated(spec):
    """The CUDA form's generated code on the CPU emulator: each 16-bit product and the sum rounded (as PyTorch does,
    below), bit for bit; rows of a pair past the shorter norm's end skipped."""
    from cuda_emu import EmulatedKernel

    src = tvm.compile(tvm.IRModule({"rms_norm": make_rms_norm(spec, "cuda")}), target=make_target("cuda")).mod.imports[0].inspect_source()
    kern = EmulatedKernel(src, "rms_norm_kernel")
    cfg = launch_config(spec)
    assert (spec.rope // 2) % cfg["vec"] == 0
    bits = lambda t: t.view(np.uint16) if t.dtype == BF else t  # noqa: E731
    xs, ws, cs, sn = _inputs(spec, seed=1)
    ys = [np.zeros(x.shape, NP[spec.out_dtype]) for x in xs]
    if spec.pair:
        kern((-(-max(len(x) for x in xs) // cfg["rows_per_block"]), 2, 1), cfg["threads"], x1=bits(xs[0]), w1=bits(ws[0]),
             x2=bits(xs[1]), w2=bits(ws[1]), cs=bits(cs), sn=bits(sn), y1=bits(ys[0]), y2=bits(ys[1]), N1=len(xs[0]), N2=len(xs[1]))
    else:
        kern((-(-len(xs[0]) // cfg["rows_per_block"]), 1, 1), cfg["threads"], x=bits(xs[0]), w=bits(ws[0]), cs=bits(cs),
             sn=bits(sn), y=bits(ys[0]), N=len(xs[0]))
    for i in range(2 if spec.pair else 1):
        _compare(ys[i].astype(np.float32), _want(spec, i, xs[i], ws[i], cs, sn, per_op=True), spec)


def test_per_op_reference_is_pytorchs_rotation():
    """The CUDA form's rounding (``per_op``) is PyTorch's: HF's rotate-half rotation computed in bfloat16."""
    rng = np.random.default_rng(3)
    y = rng.standard_normal((6, 4 * 32)).astype(BF)
    ang = rng.uniform(0, 6.3, (6, 32))
    cs, sn = np.cos(ang).astype(BF), np.sin(ang).astype(BF)
    t = torch.from_numpy(y.astype(np.float32)).to(torch.bfloat16).view(1, 6, 4, 32).transpose(1, 2)
    c, s = (torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)[None, None] for a in (cs, sn))
    rot = torch.cat((-t[..., 16:], t[..., :16]), dim=-1)
    want = (t * c + rot * s).transpose(1, 2).float().reshape(6, 128).numpy()
    np.testing.assert_array_equal(rope_reference(y, cs, sn, 32, 128, np.float32, per_op=True), want)


def test_kernel_refusals():
    base = RMSNormSpec(64, 1e-5, "bfloat16", "bfloat16", "bfloat16")
    with pytest.raises(MoecError, match="without a residual add"):
        make_rms_norm(replace(base, residual=True, rope=16, rope_token=64))
    with pytest.raises(MoecError, match="even head size dividing the row"):
        make_rms_norm(replace(base, rope=15, rope_token=60))
    with pytest.raises(MoecError, match="even head size dividing the row"):
        make_rms_norm(replace(base, rope=48, rope_token=96))
    with pytest.raises(MoecError, match="rope_token must be a positive multiple"):
        make_rms_norm(replace(base, rope=16, rope_token=40))
    with pytest.raises(MoecError, match="float32 or bfloat16"):
        make_rms_norm(RMSNormSpec(64, 1e-5, "float16", "float16", "float16", rope=16, rope_token=64))
    with pytest.raises(MoecError, match="second norm's of a pair"):
        make_rms_norm(replace(base, rope=16, rope_token=64, rope_token2=32))
    with pytest.raises(MoecError, match="exceed 40960 bytes of shared memory"):
        make_rms_norm(RMSNormSpec(16384, 1e-5, "bfloat16", "bfloat16", "bfloat16", rope=128, rope_token=16384), "cuda")
    make_rms_norm(RMSNormSpec(16384, 1e-5, "bfloat16", "bfloat16", "bfloat16", rope=128, rope_token=16384))  # (llvm: no limit)
    with pytest.raises(MoecError, match="rope_out"):
        make_rms_norm(replace(base, rope=16, rope_token=64, rope_out="int8"))


# ---------------------------------------------------------------- the pass on hand-built entries

def _entry(form="pair", heads=4, dh=16, out_cast=True):
    """``decode(x1, x2, cos, sin, w1, w2)``: HF-form RMSNorms of the queries and keys (bfloat16 rows of heads x dh), each
    reshaped to heads, moved to [1, H, n, dh], rotated (rotate half) with cos / sin [1, 1, n, dh], moved back and cast to
    float32. ``form``: "pair" (both rotated), "single" (only the first norm and rotation), "read-elsewhere" (the
    queries' norm is returned too), "interleaved" (another rotation: the halves swapped without the negation),
    "no-permute" (rotated as [1, n, H, dh] with tables [1, n, 1, dh])."""
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    d = heads * dh
    xs = [relax.Var(f"x{i}", relax.TensorType([n, d], "bfloat16")) for i in (1, 2)]
    permute = form != "no-permute"
    tshape = [1, 1, n, dh] if permute else [1, n, 1, dh]
    cs, sn = (relax.Var(name, relax.TensorType(tshape, "bfloat16")) for name in ("cos", "sin"))
    ws = [relax.Var(f"w{i}", relax.TensorType([d], "bfloat16")) for i in (1, 2)]
    emit = bb.emit
    with bb.function("decode", [*xs, cs, sn, *ws], attrs={"num_input": 4}):
        with bb.dataflow():
            outs = []
            for x, w in list(zip(xs, ws))[: 1 if form == "single" else 2]:
                xx = emit(relax.op.astype(x, "float32"))
                ms = emit(relax.op.mean(emit(relax.op.power(xx, relax.const(2.0, "float32"))), axis=[-1], keepdims=True))
                r = emit(relax.op.rsqrt(emit(relax.op.add(ms, relax.const(1e-5, "float32")))))
                y = emit(relax.op.multiply(w, emit(relax.op.astype(emit(relax.op.multiply(xx, r)), "bfloat16"))))
                t = emit(relax.op.reshape(y, [1, n, heads, dh]))
                if permute:
                    t = emit(relax.op.permute_dims(t, [0, 2, 1, 3]))
                lo = emit(relax.op.strided_slice(t, [3], [0], [dh // 2], [1]))
                hi = emit(relax.op.strided_slice(t, [3], [dh // 2], [2 ** 63 - 1], [1]))
                first = hi if form == "interleaved" else emit(relax.op.negative(hi))
                rot = emit(relax.op.concat([first, lo], axis=-1))
                u = emit(relax.op.add(emit(relax.op.multiply(t, cs)), emit(relax.op.multiply(rot, sn))))
                if permute:
                    u = emit(relax.op.permute_dims(u, [0, 2, 1, 3]))
                if out_cast:
                    u = emit(relax.op.astype(u, "float32"))
                outs.append(emit(relax.op.reshape(u, [n, heads, dh])))
                if form == "read-elsewhere" and x is xs[0]:
                    outs.append(y)
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def _passes(mod, target=LLVM, rope=True):
    norms = InsertRMSNorm(target)
    fuse = FuseRoPEIntoNorm(norms, target)
    seq = [SimplifyPower(), norms] + [fuse] * rope + [relax.transform.DeadCodeElimination(["decode"])]
    return fuse, tvm.transform.Sequential(seq)(mod)


def _ops(func):
    """The ops ``func`` calls, each ``call_tir`` as its callee's name."""
    found = []
    relax.analysis.post_order_visit(func.body, lambda e: found.append(e) if isinstance(e, relax.Call) else None)
    return [c.args[0].name_hint if c.op.name == "relax.call_tir" else c.op.name for c in found]


def _run(mod, args):
    ex = tvm.compile(mod, target=LLVM)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return [o.numpy() for o in vm["decode"](*[tvm.runtime.tensor(a) for a in args])]


def _args(n=7, heads=4, dh=16, permute=True, seed=0):
    rng = np.random.default_rng(seed)
    xs = [(rng.standard_normal((n, heads * dh)) * 2).astype(BF) for _ in (1, 2)]
    ang = rng.uniform(0, 6.3, (n, dh))
    shape = (1, 1, n, dh) if permute else (1, n, 1, dh)
    cs, sn = (f(ang).astype(BF).reshape(shape) for f in (np.cos, np.sin))
    ws = [rng.uniform(0.5, 1.5, heads * dh).astype(BF) for _ in (1, 2)]
    return [*xs, cs, sn, *ws]


@pytest.mark.parametrize("form", ["pair", "single", "no-permute"])
def test_ir_before_after_and_numerics(form):
    """The rotations leave the IR (no slices, negations, concats, permutes or casts: one ``rms_norm`` call with the
    tables, its outputs reshaped to the rotation's), and the entry computes the llvm form's NumPy reference (the norm
    rounded to bfloat16, the rotation in float32) bit for bit; the unfused entry's results are within its roundings.
    (In the pair, the queries' result is reshaped before the keys' rotation: that reshape moves after the kernel.)"""
    before = _entry(form)
    fuse, after = _passes(before)
    ops = _ops(after["decode"])
    assert [o for o in ops if not o.startswith("relax.")] == list(fuse.manifest()["kernels"])  # one call
    for gone in ("relax.strided_slice", "relax.negative", "relax.concat", "relax.permute_dims", "relax.astype", "relax.add"):
        assert gone not in ops, gone
    rotated = 1 if form == "single" else 2
    assert fuse.fused == {"decode": rotated}
    (spec,) = fuse.manifest()["kernels"].values()
    assert (spec["rope"], spec["rope_token"], spec["rope_out"], spec["pair"]) == (16, 64, "float32", form != "single")
    args = _args(permute=form != "no-permute")
    got, unfused = _run(after, args), _run(_passes(before, rope=False)[1], args)
    assert len(got) == rotated == len(unfused)
    cs, sn = (a.reshape(-1, 16) for a in args[2:4])
    for i, g in enumerate(got):
        y = reference(args[i], args[4 + i], float(np.float32(1e-5)), BF)
        want = rope_reference(y, cs, sn, 16, 64, np.float32, per_op=False).reshape(-1, 4, 16)
        assert g.shape == want.shape and g.dtype == np.float32
        np.testing.assert_array_equal(g, want)
        np.testing.assert_allclose(g, unfused[i], rtol=1e-2, atol=1e-2)


def test_fused_entry_against_torch():
    """The fused entry against PyTorch (HF's norm and rotation in bfloat16): within bfloat16 rounding."""
    fuse, after = _passes(_entry("pair"))
    args = _args()
    got = _run(after, args)
    x1, x2, cs, sn, w1, w2 = (torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16) for a in args)
    for x, w, g in ((x1, w1, got[0]), (x2, w2, got[1])):
        xf = x.float()
        y = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
        t = y.view(1, -1, 4, 16).transpose(1, 2)
        u = t * cs + torch.cat((-t[..., 8:], t[..., :8]), -1) * sn
        want = u.transpose(1, 2).float().reshape(-1, 4, 16).numpy()
        np.testing.assert_allclose(g, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("form", ["read-elsewhere", "interleaved"])
def test_other_forms_stay(form):
    """A norm read outside its rotation (the pair needs both rotated) and a rotation of another form are left alone."""
    fuse, after = _passes(_entry(form))
    assert fuse.fused == {"decode": 0} and not fuse.manifest()["kernels"]
    ops = _ops(after["decode"])
    assert "relax.concat" in ops and "relax.strided_slice" in ops


def test_cuda_target_builds_the_cuda_form():
    """For a CUDA target the pass adds the CUDA form (thread-bound, the rotation's partner through shared memory)."""
    target = make_target("cuda")
    with target:
        fuse, after = _passes(_entry("pair"), target=target)
    assert fuse.fused == {"decode": 2}
    (name,) = fuse.manifest()["kernels"]
    src = after[name].script()
    assert "blockIdx.y" in src and 'scope="shared"' in src


def test_refuses_a_non_target():
    with pytest.raises(MoecError, match="needs a tvm.target.Target"):
        FuseRoPEIntoNorm(InsertRMSNorm(LLVM), "llvm")
