"""InsertGroupedExperts: IR before/after (the torch.export take form and the ONNX gather_nd form), numerics of
the rewritten IR, forms that stay unchanged (and why), compiled models with vs without the pass (reference tiny
prefill + decode, HF OLMoE against torch), the CUDA build's kernels, options and refusals."""

import json
import re

import numpy as np
import pytest
import tvm
from tvm import relax

import moec
from moec.compiler.errors import MoecError
from moec.compiler.targets import make_target
from moec.passes.grouped_experts import InsertGroupedExperts
from moec.passes.legalize_topk import legalize_topk

from moec_testing import ATOL, torch_last_logits
from moec_testing import prefill_and_decode as _run

LLVM = tvm.target.Target({"kind": "llvm"})
E, K, D, I = 8, 2, 16, 12  # experts, top-k, hidden, expert width


def _calls(func, name):
    found = []
    relax.analysis.post_order_visit(func.body, lambda e: found.append(e) if isinstance(e, relax.Call) and isinstance(
        e.op, tvm.ir.Op) and e.op.name == name else None)
    return found


def _entry(form="take", activation="silu_mul", weight_first=False, gate_second=False, permuted_weights=False):
    """``decode(x [T, D], router, w1, w2)`` with router top-k and gathered experts as an exporter writes them."""
    bb = relax.BlockBuilder()
    t = tvm.tirx.Var("t", "int64")
    x = relax.Var("x", relax.TensorType([t, D], "float32"))
    r = relax.Var("router", relax.TensorType([E, D], "float32"))
    w1 = relax.Var("w1", relax.TensorType([E, 2 * I, D], "float32"))
    w2 = relax.Var("w2", relax.TensorType([E, D, I], "float32"))
    with bb.function("decode", [x, r, w1, w2], attrs={"num_input": 1}):
        with bb.dataflow():
            emit = bb.emit
            logits = emit(relax.op.matmul(x, emit(relax.op.permute_dims(r, [1, 0]))))
            top = emit(relax.op.topk(emit(relax.op.nn.softmax(logits, -1)), k=K, axis=-1, ret_type="both", largest=True,
                                     dtype="int64"))
            vals, ids = emit(relax.TupleGetItem(top, 0)), emit(relax.TupleGetItem(top, 1))
            flat = emit(relax.op.reshape(ids, [t * K]))
            if form == "take":
                def gather(w):
                    return emit(relax.op.take(w, flat, axis=0, mode="fast"))
            else:  # ONNX: negative indices wrapped, then gather_nd
                col = emit(relax.op.expand_dims(flat, [1]))
                wrapped = emit(relax.op.where(emit(relax.op.less(col, relax.const(0, "int64"))),
                                              emit(relax.op.add(col, relax.const(E, "int64"))), col))

                def gather(w):
                    return emit(relax.op.gather_nd(w, wrapped))
            xs = emit(relax.op.broadcast_to(emit(relax.op.expand_dims(x, [1])), [t, K, D]))
            xcol = emit(relax.op.reshape(xs, [t * K, D, 1]))
            gu = emit(relax.op.squeeze(emit(relax.op.matmul(gather(w1), xcol)), [-1]))
            halves = emit(relax.op.split(gu, 2, axis=-1))
            g, u = emit(relax.TupleGetItem(halves, 0)), emit(relax.TupleGetItem(halves, 1))
            if gate_second:
                g, u = u, g
            if activation == "silu_mul":
                act = emit(relax.op.multiply(g, emit(relax.op.sigmoid(g))))
            elif activation == "silu":
                act = emit(relax.op.nn.silu(g))
            else:
                act = emit(relax.op.nn.gelu(g))
            h = emit(relax.op.multiply(act, u))
            if permuted_weights:  # slot order k * T + t: not the slots' t * K + k
                vals = emit(relax.op.permute_dims(vals, [1, 0]))
            rcol = emit(relax.op.reshape(vals, [t * K, 1]))
            if weight_first:  # routing weight on h, before the down projection: not the form matched
                h = emit(relax.op.multiply(h, rcol))
            y = emit(relax.op.squeeze(emit(relax.op.matmul(gather(w2), emit(relax.op.expand_dims(h, [-1])))), [-1]))
            if not weight_first:
                y = emit(relax.op.multiply(y, rcol))
            out = emit(relax.op.sum(emit(relax.op.reshape(y, [t, K, D])), axis=[1]))
            res = bb.emit_output(relax.op.add(out, x))
        bb.emit_func_output(res)
    return bb.get()


def _run_ir(mod, tokens=(1, 6)):
    """decode's outputs for random inputs of each token count (one build)."""
    vm = relax.VirtualMachine(tvm.compile(relax.transform.LegalizeOps({"relax.topk": legalize_topk})(mod), target=LLVM), tvm.cpu())
    outs = []
    for t in tokens:
        rng = np.random.default_rng(t)
        args = [rng.standard_normal((t, D)), rng.standard_normal((E, D)), rng.standard_normal((E, 2 * I, D)) * 0.3,
                rng.standard_normal((E, D, I)) * 0.3]
        outs.append(vm["decode"](*[tvm.runtime.tensor(a.astype("float32")) for a in args]).numpy())
    return outs


def _apply(mod, target=LLVM):
    p = InsertGroupedExperts(target)
    return p, relax.transform.DeadCodeElimination(["decode"])(p(mod))


@pytest.mark.parametrize("kw", [{}, {"form": "gather_nd"}, {"activation": "silu"}, {"gate_second": True}],
                         ids=["take", "onnx-gather_nd", "nn.silu", "gate-second-half"])
def test_ir_before_after_and_numerics(kw):
    before = _entry(**kw)
    assert len(_calls(before["decode"], "relax.matmul")) == 3
    p, after = _apply(before)
    assert p.replaced == {"decode": 1} and p.skipped == {"decode": []}
    f = after["decode"]
    names = [c.args[0].name_hint for c in _calls(f, "relax.call_tir")]
    assert names == ["moe_route_prep", "moe_gate_up", "moe_down", "moe_combine"]
    assert len(_calls(f, "relax.matmul")) == 1  # the router only: the gathered expert matmuls are gone
    assert not _calls(f, "relax.take") and not _calls(f, "relax.gather_nd")
    (spec,) = {s for s, _ in p.kernels}
    assert (spec.experts, spec.top_k, spec.hidden, spec.inter, spec.gate_first) == (E, K, D, I, not kw.get("gate_second"))
    for got, want in zip(_run_ir(after), _run_ir(before)):  # T = 1 and 6
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw,why", [({"activation": "gelu"}, "no silu\\(gate\\) \\* up"),
                                    ({"weight_first": True}, "expected one relax.expand_dims"),
                                    ({"permuted_weights": True}, "do not come from a \\[T, K\\] tensor")],
                         ids=["gelu", "weight-before-down", "permuted-routing-weights"])
def test_ir_other_forms_stay_and_say_why(kw, why):
    before = _entry(**kw)
    p, after = _apply(before)
    assert p.replaced == {"decode": 0}
    assert re.search(why, " ".join(p.skipped["decode"])), p.skipped
    assert any("no gathered expert matmuls recognised" in s for s in p.skipped["decode"])  # the router's line
    tvm.ir.assert_structural_equal(after, relax.transform.DeadCodeElimination(["decode"])(before))
    assert p.manifest()["skipped"]["decode"] == p.skipped["decode"]


def test_refusals(zoo):
    with pytest.raises(MoecError, match="num_input"):
        InsertGroupedExperts(LLVM).transform_module(tvm.IRModule({"decode": _entry()["decode"].without_attr("num_input")}), None)
    with pytest.raises(MoecError, match="tvm.target.Target"):
        InsertGroupedExperts("llvm")
    with pytest.raises(MoecError, match="grouped_experts must be True or False"):
        moec.compile(zoo.source("tiny", "pt2"), "/nonexistent/never-written", grouped_experts="yes")


# ---------------------------------------------------------------------------- compiled models




def test_compiled_with_equals_without(zoo, tmp_path):
    grouped = zoo.artifact("tiny", "pt2")  # the default build groups the experts
    plain = moec.compile(zoo.source("tiny", "pt2"), tmp_path / "plain", target="llvm", grouped_experts=False)
    mg, mp = (json.loads((a / "manifest.json").read_text()) for a in (grouped, plain))
    opt = mg["options"]["grouped_experts"]
    assert opt["replaced"] == {"decode": 2, "prefill": 2} and opt["skipped"] == {} and "InsertGroupedExperts" in mg["passes"]
    assert opt["kernels"][0]["spec"]["experts"] == 8 and opt["kernels"][0]["spec"]["top_k"] == 2
    assert mp["options"]["grouped_experts"] is None and "InsertGroupedExperts" not in mp["passes"]
    (lg, hist), (lp, _) = _run(grouped), _run(plain)  # prefill, then 3 decode steps
    np.testing.assert_allclose(lg, lp, rtol=1e-5, atol=1e-5)
    model, _ = zoo.model("tiny")
    np.testing.assert_allclose(lg[-1][0], torch_last_logits(model, hist[0]), atol=ATOL, rtol=1e-4)


def test_hf_olmoe_matches_torch(zoo, tmp_path):
    art = moec.compile(zoo.source("hf-olmoe", "pt2"), tmp_path / "olmoe", target="llvm")
    opt = json.loads((art / "manifest.json").read_text())["options"]["grouped_experts"]
    assert opt["replaced"] == {"decode": 2, "prefill": 2} and opt["skipped"] == {}
    logits, hist = _run(art)
    model, _ = zoo.model("hf-olmoe")
    for i in range(2):
        np.testing.assert_allclose(logits[-1][i], torch_last_logits(model, hist[i]), atol=ATOL, rtol=1e-4)


def test_cuda_build_calls_the_kernels(zoo):
    """The tiny model for sm_90 (no GPU needed): decode and prefill call the four grouped kernels per MoE layer."""
    from moec.compiler.build import _cuda_modules
    from moec.compiler.importers import import_model
    from moec.passes.pipeline import moec_pipeline

    imported = import_model(zoo.source("tiny", "pt2"))
    target = make_target("cuda", "sm_90")
    pipe, _ = moec_pipeline(imported.num_inputs, target, "tiny", grouped_experts=InsertGroupedExperts(target))
    ex = tvm.compile(imported.mod, target=target, relax_pipeline=pipe)
    src = "".join(m.inspect_source("cuda") for m in _cuda_modules(ex.mod))
    for k in ("moe_route_prep_kernel", "moe_gate_up_kernel", "moe_down_kernel", "moe_combine_kernel"):
        assert re.search(rf"__global__ void __launch_bounds__\(\d+\) {k}\(", src)
    text = ex.as_text()
    for entry in ("decode", "prefill"):
        body = text[text.index(f"@{entry}:"):].split("\n\n")[0]
        calls = re.findall(r"call\s+(moe_\w+)\s+in:", body)
        assert calls == ["moe_route_prep", "moe_gate_up", "moe_down", "moe_combine"] * 2, calls


# ---------------------------------------------------------------------------- expert weights as bf16 / FP8


def _weights(seed=0):
    rng = np.random.default_rng(seed)
    return {"router": rng.standard_normal((E, D)).astype("float32"),
            "w1": (rng.standard_normal((E, 2 * I, D)) * 0.3).astype("float32"),
            "w2": (rng.standard_normal((E, D, I)) * 0.3).astype("float32")}


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_ir_converted_expert_weights(fmt):
    import ml_dtypes

    from moec.schedules.kernels.grouped_experts import dequantize_fp8, quantize_fp8

    before, w = _entry(), _weights()
    p = InsertGroupedExperts(LLVM, expert_weights=fmt, weights=w)
    after = relax.transform.DeadCodeElimination(["decode"])(p(before))
    names, arrays = p.converted_weights(list(w), list(w.values()))
    params = [q.name for q in after["decode"].params]
    if fmt == "bf16":
        assert names == ["router", "w1", "w2"] and arrays[1].dtype == ml_dtypes.bfloat16
        assert [str(q.ty.dtype) for q in after["decode"].params] == ["float32", "float32", "bfloat16", "bfloat16"]
        ref = {"w1": arrays[1].astype("float32"), "w2": arrays[2].astype("float32")}
    else:
        assert names == ["router", "w1", "w2", "w1.fp8_scale", "w2.fp8_scale"] and params == ["x"] + names
        assert arrays[1].dtype == np.uint8 and arrays[3].shape == (E, 2 * I) and arrays[4].shape == (E, D)
        ref = {"w1": dequantize_fp8(*quantize_fp8(w["w1"])), "w2": dequantize_fp8(*quantize_fp8(w["w2"]))}
    assert p.manifest()["expert_weights"] == fmt and set(p.manifest()["converted"]) == {"w1", "w2"}
    x = np.random.default_rng(1).standard_normal((6, D)).astype("float32")
    lower = lambda m: relax.VirtualMachine(tvm.compile(relax.transform.LegalizeOps({"relax.topk": legalize_topk})(m),  # noqa: E731
                                                       target=LLVM), tvm.cpu())
    got = lower(after)["decode"](*[tvm.runtime.tensor(a) for a in [x, *arrays]]).numpy()
    want = lower(before)["decode"](*[tvm.runtime.tensor(a) for a in [x, w["router"], ref["w1"], ref["w2"]]]).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # exactly the converted weights' function


def test_compiled_fp8_expert_weights(zoo, tmp_path):
    from safetensors.numpy import load_file

    art = moec.compile(zoo.source("tiny", "pt2"), tmp_path / "fp8", target="llvm", expert_weights="fp8")
    m = json.loads((art / "manifest.json").read_text())
    conv = m["options"]["grouped_experts"]["converted"]
    assert len(conv) == 4 and all(c["dtype"] == "uint8" for c in conv.values())
    assert m["weights"][-4:] == [conv[n]["scale"] for n in m["weights"] if n in conv]  # after all weights, in their order
    stored = load_file(str(art / "weights.safetensors"))
    assert sum(v.dtype == np.uint8 for v in stored.values()) == 4
    toks = [[3, 4], [100, 7], [9, 9]]  # teacher-forced decode: the same history for both builds

    def run(a):
        engine = moec.load(a)
        seqs, logits = engine.prefill([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]])
        return np.stack([logits] + [engine.decode(seqs, np.array(t)) for t in toks])

    got, want = run(art), run(zoo.artifact("tiny", "pt2"))
    err = np.abs(got - want).max() / np.abs(want).max()
    assert 1e-4 < err < 0.05, err  # e4m3 weights (3 mantissa bits): a few percent, never exact
    with pytest.raises(MoecError, match="needs the grouped experts"):
        moec.compile(zoo.source("tiny", "pt2"), tmp_path / "x", expert_weights="fp8", grouped_experts=False)
    with pytest.raises(MoecError, match="bf16 or fp8"):
        moec.compile(zoo.source("tiny", "pt2"), tmp_path / "x", expert_weights="int4")
