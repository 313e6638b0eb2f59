"""FuseCombineIntoNorm and the ``rms_norm`` kernel with ``combine``: NumPy numerics (llvm, and the CUDA form on the
CPU emulation of its generated code), refusals, and a combine read by something else left alone; with the other
launch-saving decode fusions (InsertRMSNorm's Q/K pairs, the tiered decode writing the model's dtype), the IR of a
compiled model and its logits bit for bit against the build without them."""

import json
import re

import ml_dtypes
import numpy as np
import pytest
import tvm

import moec
from moec.compiler.errors import MoecError
from moec.compiler.targets import make_target
from moec.schedules.kernels.rms_norm import RMSNormSpec, combine_sum, launch_config, make_rms_norm, reference, residual_sum

from moec_testing import prefill_and_decode

NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
SPECS = [RMSNormSpec(2048, 1e-6, "float32", "bfloat16", "bfloat16", residual=True, combine=8, experts=64),
         RMSNormSpec(2048, 1e-6, "bfloat16", "bfloat16", "bfloat16", residual=True, combine=8, experts=64, ids_dtype="int32"),
         RMSNormSpec(100, 1e-5, "float32", "float32", "float32", residual=True, combine=2, experts=4)]
IDS = ["f32-stream-2048-top8", "bf16-stream-2048-top8-int32", "f32-100-top2"]


def _args(spec, n, seed):
    rng = np.random.default_rng(seed)
    k, d = spec.combine, spec.hidden
    a = (rng.standard_normal((n, d)) * 4).astype(NP[spec.x_dtype])
    s = rng.standard_normal((n * k, d)).astype(np.float32)
    ids = rng.integers(0, spec.experts, (n, k)).astype(spec.ids_dtype)
    if n > 3:  # out of range (left out), a negative id wrapping into range (kept), too negative (left out)
        ids[1, k - 1], ids[2, 0], ids[3, k // 2] = spec.experts, -1, -spec.experts - 3
    w = rng.uniform(0.5, 1.5, d).astype(NP[spec.weight_dtype])
    return a, s, ids, w


def _check(spec, run):
    for n in (1, 6):
        a, s, ids, w = _args(spec, n, n)
        x, y = run(a, s, ids, w)
        want_x = residual_sum(a, combine_sum(s, ids, spec.experts, NP[spec.x_dtype]))
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(want_x, np.float32))  # as the unfused pair
        tol = 1e-5 if spec.y_dtype == "float32" else 1e-2
        np.testing.assert_allclose(np.asarray(y, np.float32), reference(want_x, w, spec.eps, NP[spec.y_dtype]).astype(np.float32),
                                   rtol=tol, atol=tol)


def test_combine_sum_rounds_and_skips_like_the_combine_kernel():
    """The NumPy reference itself: slots out of range left out, negative ids wrapped, the sum rounded once."""
    s = np.arange(12, dtype=np.float32).reshape(3, 4) + 0.5  # 1 token x 3 slots, D = 4
    got = combine_sum(s, np.array([[0, 7, -1]]), 4, np.float32)
    np.testing.assert_array_equal(got, [s[0] + s[2]])


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_kernel_matches_numpy(spec):
    ex = tvm.compile(tvm.IRModule({"rms_norm": make_rms_norm(spec, "llvm")}), target="llvm")

    def run(a, s, ids, w):
        x = tvm.runtime.tensor(np.zeros(a.shape, NP[spec.x_dtype]))
        y = tvm.runtime.tensor(np.zeros(a.shape, NP[spec.y_dtype]))
        ex["rms_norm"](*[tvm.runtime.tensor(t) for t in (a, s, ids, w)], x, y)
        return x.numpy(), y.numpy()

    _check(spec, run)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_cuda_form_emulated(spec):
    """The CUDA form's generated code on the CPU emulation (tests/cuda_emu.py), bit for bit as the llvm form: a bfloat16
    residual stream rounds the sum as the combine kernel stored it (TVM folds a plain cast pair away)."""
    from cuda_emu import EmulatedKernel

    src = tvm.compile(tvm.IRModule({"rms_norm": make_rms_norm(spec, "cuda")}), target=make_target("cuda")).mod.imports[0].inspect_source()
    kern = EmulatedKernel(src, "rms_norm_kernel")
    cfg = launch_config(spec)
    bits = lambda t: t.view(np.uint16) if t.dtype == ml_dtypes.bfloat16 else t  # noqa: E731

    def run(a, s, ids, w):
        x, y = np.zeros(a.shape, NP[spec.x_dtype]), np.zeros(a.shape, NP[spec.y_dtype])
        kern((-(-a.shape[0] // cfg["rows_per_block"]), 1, 1), cfg["threads"], a=bits(a), s=s, ids=ids, w=bits(w), x=bits(x),
             y=bits(y), N=a.shape[0])
        return x, y

    _check(spec, run)


def test_refusals():
    with pytest.raises(MoecError, match="combine must be a positive slot count with residual"):
        make_rms_norm(RMSNormSpec(64, 1e-5, combine=2, experts=4))
    with pytest.raises(MoecError, match="needs at least that many experts"):
        make_rms_norm(RMSNormSpec(64, 1e-5, residual=True, combine=8, experts=4))
    with pytest.raises(MoecError, match="float32 or bfloat16 residual stream"):
        make_rms_norm(RMSNormSpec(64, 1e-5, "float16", "float16", "float16", residual=True, combine=2, experts=4))
    with pytest.raises(MoecError, match="ids_dtype"):
        make_rms_norm(RMSNormSpec(64, 1e-5, residual=True, combine=2, experts=4, ids_dtype="int8"))


@tvm.transform.module_pass(opt_level=0, name="FuseCombineIntoNorm")
class _Unfused:
    def __init__(self, *args) -> None:
        pass

    def transform_module(self, mod, _ctx):
        return mod

    def manifest(self):
        return None


def test_decode_fusions_equal_the_unfused_build(tmp_path, monkeypatch):
    """A two-layer bfloat16 OLMoE-shaped model (float32 residual stream, Q- and K-norms of one width) with the tiered
    cache, built with the launch-saving fusions and without them:

    - FuseCombineIntoNorm: both layers' combines in the norms after them in decode (layer 1's input norm, the final
      norm), layer 0's in prefill (the final norm there reads the logit positions' rows only);
    - InsertRMSNorm's pairs: each layer's Q- and K-norms one launch, in decode and prefill;
    - FuseRoPEIntoNorm: the rotation of the queries and keys computed in that launch (the llvm form: in float32 after
      the norm's rounding, as the unfused rotation kernel computes it there);
    - the tiered decode kernel writes bfloat16 (the dtype the model narrows the attention output to), and no cast
      kernel follows it;

    and the logits of a prefill and four greedy decode steps equal the unfused build's bit for bit."""
    import moec.passes.fuse_combine_norm as fcn
    import moec.passes.fuse_rope_norm as frn
    import moec.passes.rms_norm as rn
    import moec.passes.tiered_kv_attention as tka
    from moec.compiler.serve_bench import build_hf

    model = build_hf("tiny-olmoe", dtype="bfloat16")
    cfg = model.config
    logits, decode_ir = [], []
    for fuse in (True, False):
        if not fuse:
            monkeypatch.setattr(fcn, "FuseCombineIntoNorm", _Unfused)
            monkeypatch.setattr(rn, "_pairs", lambda g, found: {})
            monkeypatch.setattr(frn._Finder, "found", lambda self, form: ({}, []))
            monkeypatch.setattr(tka, "decode_out_dtype", lambda graph, structure: "float32")
        art = moec.compile(model, tmp_path / str(fuse), kv_cache="tiered", tuning_db=None, debug_dump=tmp_path / f"ir{fuse}")
        src = (tmp_path / f"ir{fuse}" / "phase2_fused.py").read_text()
        dec = src[src.index("def decode("):]
        decode_ir.append(dec[:dec.find("@R.function") if "@R.function" in dec else None])
        if fuse:
            doc = json.loads((art / "manifest.json").read_text())
            assert "FuseCombineIntoNorm" in doc["passes"]
            assert doc["options"]["combine_norm"]["fused"] == {"decode": 2, "prefill": 1}
            (spec,) = doc["options"]["combine_norm"]["kernels"].values()
            assert (spec["combine"], spec["experts"], spec["x_dtype"]) == (cfg.num_experts_per_tok, cfg.num_experts, "float32")
            assert doc["options"]["rms_norm"]["paired"] == {"decode": 2, "prefill": 2}
            assert doc["options"]["rope_norm"]["fused"] == {"decode": 4, "prefill": 4}  # (queries and keys, 2 layers)
            (rope,) = doc["options"]["rope_norm"]["kernels"].values()
            assert (rope["pair"], rope["rope"], rope["rope_token"]) == (True, cfg.hidden_size // cfg.num_attention_heads, cfg.hidden_size)
        logits.append(prefill_and_decode(art, ([1, 5, 7, 9, 11, 3], [4, 4, 2]), 4)[0])
    fused, plain = decode_ir
    combines = [len(re.findall(r"cls\.moe_combine\b", d)) for d in decode_ir]
    assert combines == [0, 2]
    attn_dtype = [re.search(r'dtype="(\w+)"', next(ln for ln in d.splitlines() if "cls.tiered_decode," in ln)).group(1)
                  for d in decode_ir]  # the kernel's first output, the attention
    assert attn_dtype == ["bfloat16", "float32"]
    # per layer: the combine, the second norm, the two rotations and the cast after the attention (reshapes are views)
    launches = [len(re.findall(r"R\.call_tir(?:_inplace)?\(cls\.(?!reshape)", d)) for d in decode_ir]
    assert launches[1] - launches[0] == 5 * 2
    np.testing.assert_array_equal(logits[0], logits[1])


def test_a_combine_read_elsewhere_stays(zoo):
    """Qwen2-MoE adds its shared expert to the routed experts' combine before the residual add: nothing is fused,
    and the model compiles as before (its numerics: tests/compiler/test_hf_families.py)."""
    art = zoo.artifact("hf-qwen2_moe", "onnx")  # (test_engine's: its logits against onnxruntime there)
    doc = json.loads((art / "manifest.json").read_text())["options"]
    assert doc["grouped_experts"]["replaced"]["decode"] > 0
    assert doc["combine_norm"]["fused"] == {"decode": 0, "prefill": 0}
