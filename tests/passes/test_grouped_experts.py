"""InsertGroupedExperts: IR before/after (the torch.export take form, the ONNX gather_nd form and the bfloat16
torch.export form with its casts), numerics of the rewritten IR, forms that stay unchanged (and why), compiled
models with vs without the pass (reference tiny prefill + decode, HF OLMoE against torch, in float32 and in
bfloat16), the CUDA build's kernels, options and refusals."""

import json
import re
from dataclasses import replace

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


BF16_ULP = 2.0**-8  # bfloat16 round-to-nearest: relative error at most 2^-8 (8 significant bits)


def _entry_bf16(round_silu=True, round_h=False, round_w2=False, clamp=None, clamp_form="clip"):
    """``decode(x, router, w1, w2)``, all bfloat16, in the form of the phase-1 IR of HF OLMoE exported in bfloat16 with
    torch.export (TVM's importer gives every matmul a float32 result): float32 halves, silu(g) rounded to bfloat16
    through a cast round trip (``round_silu``), float32 h (``round_h``: rounded to bfloat16 before the down
    projection), the gathered down weight cast to float32 (``round_w2``: cast to float16 first, a rounding), and the
    routing weights rounded to bfloat16 and cast back."""
    bf, f32 = "bfloat16", "float32"
    bb = relax.BlockBuilder()
    t = tvm.tirx.Var("t", "int64")
    x = relax.Var("x", relax.TensorType([t, D], bf))
    r = relax.Var("router", relax.TensorType([E, D], bf))
    w1 = relax.Var("w1", relax.TensorType([E, 2 * I, D], bf))
    w2 = relax.Var("w2", relax.TensorType([E, D, I], bf))
    with bb.function("decode", [x, r, w1, w2], attrs={"num_input": 1}):
        with bb.dataflow():
            emit = bb.emit
            logits = emit(relax.op.matmul(x, emit(relax.op.permute_dims(r, [1, 0])), out_dtype=f32))
            top = emit(relax.op.topk(emit(relax.op.nn.softmax(logits, -1)), k=K, axis=-1, ret_type="both", largest=True,
                                     dtype="int64"))
            vals, ids = emit(relax.TupleGetItem(top, 0)), emit(relax.TupleGetItem(top, 1))
            vals = emit(relax.op.astype(vals, bf))  # routing weights in the hidden dtype
            xs = emit(relax.op.broadcast_to(emit(relax.op.expand_dims(x, [1])), [t, K, D]))
            xs = emit(relax.op.reshape(xs, [t * K, D]))
            rflat, flat = emit(relax.op.reshape(vals, [t * K])), emit(relax.op.reshape(ids, [t * K]))
            if clamp is not None and clamp_form == "clip":  # transformers 5.17's batched_mm clamps the ids to the expert range
                flat = emit(relax.op.clip(flat, *clamp))
            elif clamp is not None:  # the same clamp as moec's torch importer gives it (integer maximum, then minimum)
                flat = emit(relax.op.maximum(flat, relax.const(clamp[0], "int64")))
                flat = emit(relax.op.minimum(flat, relax.const(clamp[1], "int64")))
            gu = emit(relax.op.squeeze(emit(relax.op.matmul(emit(relax.op.take(w1, flat, axis=0, mode="fast")),
                                                           emit(relax.op.expand_dims(xs, [-1])), out_dtype=f32)), [-1]))
            halves = emit(relax.op.split(gu, 2, axis=-1))
            g, u = emit(relax.TupleGetItem(halves, 0)), emit(relax.TupleGetItem(halves, 1))
            a = emit(relax.op.astype(g, f32))
            act = emit(relax.op.multiply(a, emit(relax.op.sigmoid(a))))
            if round_silu:
                act = emit(relax.op.astype(emit(relax.op.astype(act, bf)), f32))
            h = emit(relax.op.multiply(act, u))
            if round_h:
                h = emit(relax.op.astype(h, bf))
            hcol = emit(relax.op.expand_dims(h, [-1]))
            if round_h:
                hcol = emit(relax.op.astype(hcol, f32))
            w2g = emit(relax.op.take(w2, flat, axis=0, mode="fast"))
            if round_w2:
                w2g = emit(relax.op.astype(w2g, "float16"))
            y = emit(relax.op.matmul(emit(relax.op.astype(w2g, f32)), hcol, out_dtype=f32))
            y = emit(relax.op.squeeze(y, [-1]))
            y = emit(relax.op.multiply(y, emit(relax.op.astype(emit(relax.op.expand_dims(rflat, [-1])), f32))))
            out = emit(relax.op.sum(emit(relax.op.reshape(y, [t, K, D])), axis=[1]))
            res = bb.emit_output(relax.op.add(out, emit(relax.op.astype(x, f32))))
        bb.emit_func_output(res)
    return bb.get()


def _bf16_inputs(t):
    import ml_dtypes

    rng = np.random.default_rng(t)
    args = [rng.standard_normal((t, D)), rng.standard_normal((E, D)), rng.standard_normal((E, 2 * I, D)) * D**-0.5,
            rng.standard_normal((E, D, I)) * I**-0.5]
    return [a.astype(ml_dtypes.bfloat16) for a in args]


def _silu_rounding_bound(x, router, w1, w2):
    """Elementwise bound on |out(silu(g) rounded to bf16) - out(silu(g) in float32)|:
    sum_k rw * |W2| @ (2^-8 |silu(g) u|)."""
    import ml_dtypes

    x, router, w1, w2 = (a.astype(np.float64) for a in (x, router, w1, w2))
    logits = x @ router.T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, -1, kind="stable")[:, :K]
    rw = np.take_along_axis(p, ids, -1).astype(ml_dtypes.bfloat16).astype(np.float64)
    bound = np.zeros((x.shape[0], D))
    for t in range(x.shape[0]):
        for k in range(K):
            gu = w1[ids[t, k]] @ x[t]
            g, u = gu[:I], gu[I:]
            bound[t] += rw[t, k] * (np.abs(w2[ids[t, k]]) @ (BF16_ULP * np.abs(g / (1 + np.exp(-g)) * u)))
    return bound


def test_ir_bf16_torch_export_form():
    """The bfloat16 torch.export form (float32 halves, silu(g) rounded to bfloat16 and cast back, gathered down
    weight cast to float32, routing weights rounded to bfloat16): matched, with silu(g) kept in float32."""
    before = _entry_bf16()
    p, after = _apply(before)
    assert p.replaced == {"decode": 1} and p.skipped == {"decode": []}
    f = after["decode"]
    assert [c.args[0].name_hint for c in _calls(f, "relax.call_tir")] == ["moe_route_prep", "moe_gate_up", "moe_down",
                                                                          "moe_combine"]
    assert len(_calls(f, "relax.matmul")) == 1 and not _calls(f, "relax.take")  # the router only
    assert not _calls(f, "relax.sigmoid")
    (spec,) = {s for s, _ in p.kernels}
    assert (spec.x_dtype, spec.w_dtype, spec.h_dtype, spec.rw_dtype, spec.out_dtype) == (
        "bfloat16", "bfloat16", "float32", "bfloat16", "float32")
    (note,) = p.rounding["decode"]
    assert re.fullmatch(r"expert matmul \w+: silu\(gate\) rounded to bfloat16 by the graph, "
                        r"kept in float32 by the kernels", note), note
    assert p.manifest()["rounding"] == p.rounding
    # the down kernel reads the routing weights after their rounding to bfloat16 (the graph's values exactly)
    down = [c for c in _calls(f, "relax.call_tir") if c.args[0].name_hint == "moe_down"][0]
    assert str(down.args[1].fields[-1].ty.dtype) == "bfloat16"
    # numerics (tvm.compile's default pipeline keeps the graph's bfloat16 round trip): the rewritten IR computes the
    # graph without that rounding (float32 accumulation), and differs from the graph within the rounding's bound
    unrounded = _entry_bf16(round_silu=False)
    lower = relax.transform.LegalizeOps({"relax.topk": legalize_topk})
    vms = {k: relax.VirtualMachine(tvm.compile(lower(m), target=LLVM), tvm.cpu())
           for k, m in (("after", after), ("before", before), ("unrounded", unrounded))}
    for t in (1, 6):
        args = _bf16_inputs(t)
        got, want, exact = (vms[k]["decode"](*[tvm.runtime.tensor(a) for a in args]).numpy()
                            for k in ("after", "before", "unrounded"))
        np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)
        diff, bound = np.abs(got - want), _silu_rounding_bound(*args)
        assert (diff <= bound + 1e-5).all(), (diff - bound).max()
        if t == 6:
            assert diff.max() > 1e-4  # the graph really rounds silu(g) there: the bound is not vacuous


@pytest.mark.parametrize("form", ["clip", "minmax"])
def test_ir_bf16_form_with_clamped_ids(form):
    """transformers 5.17 clamps the top-k ids to [0, E - 1] before gathering the weights (a no-op on top-k ids):
    matched through the clamp (``clip``, or the integer maximum and minimum moec's torch importer emits for it), with
    the same numerics as the unclamped form. A clamp that can change an id (a narrower range) is not looked through,
    and the layer is skipped with the reason."""
    clamped = _entry_bf16(clamp=(0, E - 1), clamp_form=form)
    p, after = _apply(clamped)
    assert p.replaced == {"decode": 1} and not _calls(after["decode"], "relax.take")
    for op in ("relax.clip", "relax.maximum", "relax.minimum"):  # the clamp went with the gathers it fed
        assert not _calls(after["decode"], op)
    _, plain = _apply(_entry_bf16())
    lower = relax.transform.LegalizeOps({"relax.topk": legalize_topk})
    vms = [relax.VirtualMachine(tvm.compile(lower(m), target=LLVM), tvm.cpu()) for m in (after, plain)]
    args = [tvm.runtime.tensor(a) for a in _bf16_inputs(5)]
    np.testing.assert_array_equal(vms[0]["decode"](*args).numpy(), vms[1]["decode"](*args).numpy())
    narrow, _ = _apply(_entry_bf16(clamp=(0, E - 2), clamp_form=form))
    assert narrow.replaced == {"decode": 0}
    assert any("top-k expert ids" in why for why in narrow.skipped["decode"]), narrow.skipped


def test_cuda_bf16_form_stores_h_in_bf16_for_tensor_cores(monkeypatch):
    """On CUDA the same form's h is stored as bfloat16 when that lets the down projection run on tensor cores (its
    operand type), and the manifest lists that rounding next to the graph's; llvm keeps float32 h (above), and so
    does CUDA where the shapes take no tensor cores (I = 12)."""
    import sys

    from moec.schedules.kernels.grouped_experts import mma_eligible

    cuda = make_target("cuda", "sm_90")
    p, _ = _apply(_entry_bf16(), cuda)
    assert {s.h_dtype for s, _ in p.kernels} == {"float32"} and len(p.rounding["decode"]) == 1
    monkeypatch.setattr(sys.modules[__name__], "D", 64)
    monkeypatch.setattr(sys.modules[__name__], "I", 64)
    p, after = _apply(_entry_bf16(), cuda)
    assert p.replaced == {"decode": 1}
    (spec,) = {s for s, _ in p.kernels}
    assert spec.h_dtype == "bfloat16" and mma_eligible(spec, "gate_up") and mma_eligible(spec, "down")
    notes = p.rounding["decode"]
    assert len(notes) == 2 and "silu(gate) rounded to bfloat16 by the graph" in notes[0]
    assert re.fullmatch(r"expert matmul \w+: h rounded to bfloat16 by the kernels for the tensor-core down projection "
                        r"\(the graph keeps it in float32\)", notes[1]), notes[1]
    gate_up = [c for c in _calls(after["decode"], "relax.call_tir") if c.args[0].name_hint == "moe_gate_up"][0]
    assert str(gate_up.ty.dtype) == "bfloat16"


def test_ir_bf16_rounded_h_and_weights():
    """h rounded to bfloat16 on its way to the down projection: stored as bfloat16 by the gate_up kernel (kept
    exactly, not listed as a rounding); a rounding cast of a gathered weight: not matched (the kernels read the
    weights as they are)."""
    p, after = _apply(_entry_bf16(round_h=True))
    assert p.replaced == {"decode": 1}
    (spec,) = {s for s, _ in p.kernels}
    assert spec.h_dtype == "bfloat16"
    assert [r.split(": ", 1)[1] for r in p.rounding["decode"]] == ["silu(gate) rounded to bfloat16 by the graph, kept "
                                                                   "in float32 by the kernels"]
    assert len(_calls(after["decode"], "relax.matmul")) == 1
    before = _entry_bf16(round_w2=True)
    p, after = _apply(before)
    assert p.replaced == {"decode": 0}
    assert re.search("not a gathered \\[E, D, I\\] weight", " ".join(p.skipped["decode"])), p.skipped
    tvm.ir.assert_structural_equal(after, relax.transform.DeadCodeElimination(["decode"])(before))


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
    plain = moec.compile(zoo.imported("tiny", "pt2"), tmp_path / "plain", target="llvm", grouped_experts=False)
    mg, mp = (json.loads((a / "manifest.json").read_text()) for a in (grouped, plain))
    opt = mg["options"]["grouped_experts"]
    assert opt["replaced"] == {"decode": 2, "prefill": 2} and opt["skipped"] == {} and "InsertGroupedExperts" in mg["passes"]
    assert opt["kernels"][0]["spec"]["experts"] == 8 and opt["kernels"][0]["spec"]["top_k"] == 2
    assert mp["options"]["grouped_experts"] is None and "InsertGroupedExperts" not in mp["passes"]
    (lg, hist), (lp, _) = _run(grouped), _run(plain)  # prefill, then 3 decode steps
    np.testing.assert_allclose(lg, lp, rtol=1e-5, atol=1e-5)
    model, _ = zoo.model("tiny")
    np.testing.assert_allclose(lg[-1][0], torch_last_logits(model, hist[0]), atol=ATOL, rtol=1e-4)


def test_hf_olmoe_matches_torch(zoo):
    art = zoo.artifact("hf-olmoe", "pt2")  # the default build (test_engine's)
    opt = json.loads((art / "manifest.json").read_text())["options"]["grouped_experts"]
    assert opt["replaced"] == {"decode": 2, "prefill": 2} and opt["skipped"] == {}
    logits, hist = _run(art)
    model, _ = zoo.model("hf-olmoe")
    for i in range(2):
        np.testing.assert_allclose(logits[-1][i], torch_last_logits(model, hist[i]), atol=ATOL, rtol=1e-4)


@pytest.fixture(scope="module")
def olmoe_bf16(tmp_path_factory):
    """The benchmark's tiny-olmoe (HF OLMoE, sdpa attention) in bfloat16, exported with torch.export and imported:
    ``(bf16 model, the same weights in float32, imported)``. Weights rescaled (std 1/sqrt(fan-in) for the experts,
    norms in [0.5, 1.5], sharp routers) so that the experts' output is of the size of the residual stream (with the
    0.02 init it is 2.5% of it, and differences of the experts would barely reach the logits)."""
    import copy

    import torch

    from moec.compiler import serve_bench as sb
    from moec.compiler.importers import import_model
    from moec.models.export import save_pt2

    model = sb.build_hf("tiny-olmoe", "float32", "cpu")
    cfg, gen = model.config, torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "norm" in name:
                prm.uniform_(0.5, 1.5, generator=gen)
            elif "gate_up_proj" in name:
                prm.normal_(0, cfg.hidden_size**-0.5, generator=gen)
            elif "down_proj" in name:
                prm.normal_(0, cfg.intermediate_size**-0.5, generator=gen)
            elif "mlp.gate" in name:
                prm.normal_(0, 1.0, generator=gen)
    bf16 = model.to(torch.bfloat16)
    path = tmp_path_factory.mktemp("olmoe_bf16") / "model.pt2"
    save_pt2(bf16, cfg.vocab_size, path, max_seq=64)
    return bf16, copy.deepcopy(bf16).float(), import_model(path)


def test_hf_olmoe_bf16_phase1_ir(olmoe_bf16, tmp_path):
    """The exported bfloat16 OLMoE after phase 1: without the pass, per entry two MoE layers of gathered expert
    matmuls (take of the stacked weights); with it, the grouped kernels per layer (the combine in the norm after it
    where FuseCombineIntoNorm moves it) and no gather of expert weights."""
    _, _, imported = olmoe_bf16
    experts = {n for n, w in zip(imported.weight_names(), imported.weights) if w.ndim == 3}  # the stacked experts
    assert len(experts) == 4  # gate_up and down of 2 layers

    def gathered(func):  # the expert weights that a take / gather_nd of func reads
        return {c.args[0].name for op in ("relax.take", "relax.gather_nd") for c in _calls(func, op)
                if isinstance(c.args[0], relax.Var)} & experts

    plain, entries, _ = moec.compile(imported, tmp_path / "p", target="llvm", grouped_experts=False, _until_phase1=True)
    grouped, _, _ = moec.compile(imported, tmp_path / "g", target="llvm", _until_phase1=True)
    for entry in ("decode", "prefill"):
        assert entry in entries
        assert gathered(plain[entry]) == experts
        assert not [c for c in _calls(plain[entry], "relax.call_tir") if c.args[0].name_hint.startswith("moe_")]
        assert not gathered(grouped[entry])
        calls = [n for n in (c.args[0].name_hint for c in _calls(grouped[entry], "relax.call_tir")) if n.startswith("moe_")]
        assert [n for n in calls if n != "moe_combine"] == ["moe_route_prep", "moe_gate_up", "moe_down"] * 2, calls
        # the combines the norm after them computes (FuseCombineIntoNorm): both in decode; in prefill layer 0's, as the
        # final norm reads the logit positions' rows only
        assert calls.count("moe_combine") == {"decode": 0, "prefill": 1}[entry], calls


def test_hf_olmoe_bf16_matches_unfused_and_torch(olmoe_bf16, tmp_path):
    """The compiled bfloat16 OLMoE (llvm, paged cache) with vs without the grouped experts, and against torch.

    Tolerances: with vs without the pass, 1e-5 of the logits' range: on llvm TVM's BF16ComputeLegalize keeps the
    bfloat16 round trip of silu(g) inside the unfused build's fused SwiGLU kernel in float32, so both builds compute
    silu(g) * u in float32 and differ by float32 reassociation only (measured: 0). Against torch, 5% of the logits'
    range (measured 2.3% for bfloat16 torch, 1.5% for float32 torch with the same weights): the compiled graph rounds
    activations to bfloat16 where the export casts them between kernels (norm outputs, embeddings, rotary tables;
    2^-8 each) and keeps the matmul outputs in float32, bfloat16 torch rounds those too. That bound is loose (a 10%
    error of the experts' output moves these logits by ~3%), so grouped must also be as far from torch as unfused
    (to 1e-5 of the logits' range)."""
    import torch

    bf16, f32, imported = olmoe_bf16
    grouped = moec.compile(imported, tmp_path / "grouped", target="llvm")
    plain = moec.compile(imported, tmp_path / "plain", target="llvm", grouped_experts=False)
    opt = json.loads((grouped / "manifest.json").read_text())["options"]["grouped_experts"]
    assert opt["replaced"] == {"decode": 2, "prefill": 2} and opt["skipped"] == {}
    assert all(len(v) == 2 and all("silu(gate) rounded to bfloat16" in r for r in v) for v in opt["rounding"].values())
    (spec,) = [k["spec"] for k in opt["kernels"]]
    assert (spec["x_dtype"], spec["w_dtype"], spec["h_dtype"], spec["rw_dtype"]) == ("bfloat16", "bfloat16", "float32",
                                                                                     "bfloat16")
    (lg, hist), (lp, hist_p) = _run(grouped), _run(plain)  # prefill, then 3 greedy decode steps
    assert hist == hist_p
    scale = np.abs(lp).max()
    np.testing.assert_allclose(lg, lp, rtol=0, atol=1e-5 * scale)
    for model in (bf16, f32):
        for i in range(2):
            with torch.no_grad():
                want = model(input_ids=torch.tensor([hist[i]])).logits[0, -1].float().numpy()
            err_g, err_p = np.abs(lg[-1][i] - want).max(), np.abs(lp[-1][i] - want).max()
            assert err_g <= 0.05 * np.abs(want).max(), (model.dtype, i, err_g)
            assert abs(err_g - err_p) <= 1e-5 * scale, (model.dtype, i, err_g, err_p)


def test_cuda_build_calls_the_kernels(zoo):
    """The tiny model for sm_90 (no GPU needed): decode and prefill call the four grouped kernels per MoE layer."""
    from moec.compiler.build import _cuda_modules
    from moec.passes.pipeline import moec_pipeline

    imported = zoo.imported("tiny", "pt2")
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


@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
def test_cuda_fp8_experts_float16_compute(monkeypatch, compute):
    """CUDA, FP8 expert weights of a bfloat16 model: with ``fp8_compute="float16"`` the layer's input reaches gate_up
    saturated into float16's range and cast (clip + astype, one elementwise kernel after fusion), both kernels take
    float16 activations and h, and the manifest and ``rounding`` say so; with bfloat16 (the default) x goes in as it
    is. (The kernels' float16 form on the CUDA emulation: tests/schedules/test_grouped_experts.py; the model on the
    GPU: bench/e2e_cuda.py.)"""
    import sys

    from moec.passes import grouped_experts as pge

    monkeypatch.setattr(sys.modules[__name__], "D", 64)
    monkeypatch.setattr(sys.modules[__name__], "I", 64)
    assert pge.FP8_COMPUTE == "bfloat16"
    cuda = make_target("cuda", "sm_90")
    w = {n: a.astype("float32") for n, a in _weights().items()}
    p = InsertGroupedExperts(cuda, expert_weights="fp8", weights=w, fp8_compute=None if compute == "bfloat16" else compute)
    after = relax.transform.DeadCodeElimination(["decode"])(p(_entry_bf16()))
    assert p.replaced == {"decode": 1} and p.manifest()["fp8_compute"] == compute
    (spec,) = {s for s, name in p.kernels if name == "gate_up"}
    assert spec.w_format == "fp8" and spec.x_dtype == spec.h_dtype == compute
    gate_up = [c for c in _calls(after["decode"], "relax.call_tir") if c.args[0].name_hint == "moe_gate_up"][0]
    x_in = gate_up.args[1].fields[0]
    assert str(x_in.ty.dtype) == compute and str(gate_up.ty.dtype) == compute
    casts = _calls(after["decode"], "relax.astype")
    clips = [c for c in _calls(after["decode"], "relax.clip")]
    notes = p.rounding["decode"]
    if compute == "float16":
        assert any(str(c.ty.dtype) == "float16" for c in casts) and len(clips) == 1
        assert float(clips[0].args[1].value) == -65504.0 and float(clips[0].args[2].value) == 65504.0
        assert any("x rounded to float16" in n for n in notes) and any("h held in float16" in n for n in notes)
        assert not any("h rounded to bfloat16 by the kernels" in n for n in notes)
    else:
        assert not clips and not any("to float16" in n or "in float16" in n for n in notes)
    with pytest.raises(MoecError, match="bfloat16 or float16"):
        InsertGroupedExperts(cuda, expert_weights="fp8", weights=w, fp8_compute="float32")


@pytest.mark.parametrize("tiles", [False, True])
def test_cuda_fp8_experts_tile_major(monkeypatch, tiles):
    """CUDA, FP8 expert weights with ``FP8_W_TILES``: the stored codes are ``tile_fp8`` of the quantized weights (each
    16-row tile's k-steps as contiguous KB), the kernels' spec reads them so (``w_tiles``) and the manifest records the
    layout; without it, or on llvm, the codes stay row-major. (The tile-major kernels on the CUDA emulation:
    tests/schedules/test_grouped_experts.py; on the GPU: bench/grouped_experts.py, bench/e2e_cuda.py.)"""
    import sys

    from moec.passes import grouped_experts as pge
    from moec.schedules.kernels.grouped_experts import quantize_fp8, untile_fp8

    monkeypatch.setattr(sys.modules[__name__], "D", 128)  # (two k-steps of 64 a row: tile-major differs)
    monkeypatch.setattr(sys.modules[__name__], "I", 128)
    monkeypatch.setattr(pge, "FP8_W_TILES", tiles)
    w = {n: a.astype("float32") for n, a in _weights().items()}
    for target in (make_target("cuda", "sm_90"), LLVM):
        p = InsertGroupedExperts(target, expert_weights="fp8", weights=w)
        p(_entry_bf16())
        on = tiles and target.kind.name == "cuda"
        names, arrays = p.converted_weights(list(w), list(w.values()))
        for n in ("w1", "w2"):
            codes = quantize_fp8(w[n])[0]
            got = arrays[names.index(n)]
            np.testing.assert_array_equal(untile_fp8(got) if on else got, codes)
            assert on == (not np.array_equal(got, codes))  # (random codes: the permutation moves bytes)
            assert p.manifest()["converted"][n]["layout"] == ("tiles" if on else "rows")
        assert {s.w_tiles for s, _ in p.kernels if s.w_format == "fp8"} == {on}


def test_compiled_fp8_expert_weights(zoo, tmp_path):
    from safetensors.numpy import load_file

    art = moec.compile(zoo.imported("tiny", "pt2"), tmp_path / "fp8", target="llvm", expert_weights="fp8")
    m = json.loads((art / "manifest.json").read_text())
    conv = m["options"]["grouped_experts"]["converted"]
    assert len(conv) == 4 and all(c["dtype"] == "uint8" for c in conv.values())
    # the kernels' spec: FP8 weights, the tensor-core form on CUDA (checked on the H200)
    specs = [k["spec"] for k in m["options"]["grouped_experts"]["kernels"]]
    assert specs and all(sp["w_format"] == "fp8" and sp["tensor_cores"] is True for sp in specs)
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


def test_compile_warns_when_moe_layers_stay_in_the_gather_form():
    from moec.compiler.build import UnreplacedExperts, _warn_unreplaced_experts

    manifest = {"replaced": {"decode": 16, "prefill": 0}, "skipped": {"prefill": ["expert matmul lv9: the gather index "
                                                                                "does not come from [T, K] top-k expert ids"]}}
    with pytest.warns(UnreplacedExperts, match=r"m\.pt2: prefill: 16 of 16 MoE layers .* top-k expert ids"):
        _warn_unreplaced_experts(manifest, 16, "m.pt2")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_unreplaced_experts({"replaced": {"decode": 16, "prefill": 16}, "skipped": {}}, 16, "m.pt2")


@pytest.mark.parametrize("prefill_tiled", [False, True])
def test_prefill_entry_takes_wider_token_tiles(tmp_path, prefill_tiled):
    """A bfloat16 model with 32 experts (decode's automatic tiles: 2 of 8 tokens) for sm_90: prefill's expert GEMMs
    are kernels of their own with 8 token tiles per weight pass (``prefill_spec``), or block-tiled with
    ``prefill_tiled``; decode keeps its tiles, and route_prep / combine serve both."""
    import torch
    import transformers as tf

    from moec.compiler.importers import import_model
    from moec.models.export import save_pt2
    from moec.passes.pipeline import moec_pipeline
    from moec.schedules.kernels.grouped_experts import (PREFILL_TILES, GroupedExpertsSpec, launch_config, mma_tiles,
                                                        prefill_spec)

    cfg = tf.OlmoeConfig(vocab_size=256, hidden_size=128, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=4, num_experts=32, num_experts_per_tok=2, max_position_embeddings=256,
                         experts_implementation="batched_mm", pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = tf.OlmoeForCausalLM(cfg).to(torch.bfloat16).eval()
    save_pt2(model, 256, tmp_path / "m.pt2", max_seq=64)
    imported = import_model(tmp_path / "m.pt2")
    target = make_target("cuda", "sm_90")
    g = InsertGroupedExperts(target, prefill_tiled=prefill_tiled)
    if prefill_tiled:  # the entries after phase 1 (the kernels chosen; lowering them is the other case's)
        pipe, _ = moec_pipeline(imported.num_inputs, target, "olmoe32", grouped_experts=g, phases=1)
        mod = pipe(imported.mod)
        calls = {entry: [c.args[0].name_hint for c in _calls(mod[entry], "relax.call_tir") if c.args[0].name_hint.startswith("moe_")]
                 for entry in ("decode", "prefill")}
    else:
        pipe, _ = moec_pipeline(imported.num_inputs, target, "olmoe32", grouped_experts=g)
        text = tvm.compile(imported.mod, target=target, relax_pipeline=pipe).as_text()
        calls = {}
        for entry in ("decode", "prefill"):
            body = text[text.index(f"@{entry}:"):].split("\n\n")[0]
            calls[entry] = re.findall(r"call\s+(moe_\w+)\s+in:", body)
    assert calls["decode"] == ["moe_route_prep", "moe_gate_up", "moe_down", "moe_combine"], calls
    if prefill_tiled:
        assert calls["prefill"] == ["moe_route_prep", "moe_gate_up_tiled", "moe_down_tiled", "moe_combine"], calls
        spec = next(s for s, n in g.kernels if n == "gate_up" and s.tiled)
        assert launch_config(spec)["gate_up"]["blocks"] == (1, 32) and launch_config(spec)["gate_up"]["stages"] == 3
        assert prefill_spec(replace(spec, tiled=False, inter=96), tiled=True).tiled is False  # 96 rows: not a tile's 64
        return
    assert calls["prefill"] == ["moe_route_prep", f"moe_gate_up_nt{PREFILL_TILES}_pb", f"moe_down_nt{PREFILL_TILES}_pb", "moe_combine"]
    spec = next(s for s, n in g.kernels if n == "gate_up" and s.n_tiles == 0 and not s.tiled)
    assert mma_tiles(spec)[0] == 2 and launch_config(prefill_spec(spec))["gate_up"]["tokens_per_pass"] == 64
    assert launch_config(prefill_spec(spec))["gate_up"]["grid"] == ("ceil(T / 64)", 32)  # a block per pass (1 row tile x 32)
    assert prefill_spec(replace(spec, n_tiles=4)).n_tiles == 4  # an explicit tiling is kept
    assert not prefill_spec(replace(spec, stages=0)).pass_blocks  # the register form loops over its passes
    f32 = GroupedExpertsSpec(hidden=256, inter=128, experts=16, top_k=4)  # no mma form: one kernel set
    assert prefill_spec(f32) is f32
