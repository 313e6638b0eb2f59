"""CascadeGating: IR before/after, the router semantics against NumPy/torch, g = G exact end to end, options."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import moec
from moec.compiler.errors import MoecError
from moec.compiler.importers import import_model
from moec.compiler.moe_structure import analyze
from moec.compiler.probe import probe
from moec.models import get_config
from moec.models.cascade import cascade_route, flat_topk
from moec.passes.cascade_gating import (CascadeGating, CascadeSpec, check_cascade, data_free_groups, emit_cascade,
                                        fit_coarse)
from moec.passes.legalize_topk import legalize_topk
from moec.passes.paged_kv_attention import InsertPagedKVAttention

from moec_testing import ATOL, ort_last_logits, torch_last_logits

E, G, D, K = 8, 4, 64, 2  # tiny: experts, groups, hidden, active


def _calls(func, op):
    found = []
    relax.analysis.post_order_visit(func.body, lambda e: found.append(e) if isinstance(e, relax.Call) and isinstance(
        e.op, tvm.ir.Op) and e.op.name == op else None)
    return found


def _last(call):
    dim = call.ty.shape[-1]
    return int(dim) if isinstance(dim, tvm.tirx.IntImm) else None


def _router_weights(func):
    return [p for p in func.params if "router" in p.name]


@pytest.fixture(scope="module")
def imported(zoo):
    return zoo.imported("tiny", "pt2")


def _cascade(imported, keep, **kw):
    weights = dict(zip(imported.weight_names(), imported.weights))
    return CascadeGating(imported.num_inputs, G, keep, weights=weights, source="tiny", **kw)


# ---------------------------------------------------------------------------- IR


def test_ir_before_has_full_router_matmuls(imported):
    main = imported.mod["main"]
    routers = _router_weights(main)
    assert len(routers) == 2
    full = [c for c in _calls(main, "relax.matmul") if _last(c) == E]
    assert len(full) == 2 and len(_calls(main, "relax.topk")) == 2


@pytest.mark.parametrize("keep", [G, 2])
def test_ir_after(imported, keep):
    cascade = _cascade(imported, keep)
    after = cascade(imported.mod)
    main = relax.analysis.remove_all_unused(after["main"])
    routers = set(_router_weights(main))
    # no full [T, E] router matmul left on the live path; G coarse logits per layer instead
    assert not [c for c in _calls(main, "relax.matmul") if _last(c) == E]
    coarse = [c for c in _calls(main, "relax.matmul") if _last(c) == G]
    assert len(coarse) == 2 and all(isinstance(c.args[1], relax.Var) for c in coarse)
    # the fine router reads only the candidates' rows: a take of the router weight by [T, g*E/G] expert ids
    takes = [c for c in _calls(main, "relax.take") if c.args[0] in routers]
    assert len(takes) == 2
    assert all(int(t.args[1].ty.shape[-1]) == keep * E // G and _last(t) == D for t in takes)
    topks = _calls(main, "relax.topk")
    assert sorted(int(t.attrs.k) for t in topks) == sorted([G if keep < G else keep] * 2 + [K] * 2)
    # the original router ops are dead code: phase 1 still recognises the model, then they are gone
    insert = InsertPagedKVAttention(imported.num_inputs, tvm.target.Target({"kind": "llvm"}), "tiny")
    entries = relax.transform.DeadCodeElimination(["prefill", "decode", "create_kv_cache"])(insert(after))
    assert [layer.router.num_experts for layer in insert.structure.moe_layers] == [E, E]
    for name in ("prefill", "decode"):
        f = entries[name]
        assert not [c for c in _calls(f, "relax.matmul") if _last(c) == E]
        assert len([c for c in _calls(f, "relax.take") if c.args[0] in set(_router_weights(f))]) == 2
        assert len([c for c in _calls(f, "relax.matmul") if _last(c) == G]) == 2
    assert cascade.manifest()["groups"]["0"] == cascade.specs[0].groups.tolist()


def test_ir_onnx_negative_index_normalisation(zoo):
    imp = import_model(zoo.source("tiny", "onnx"))
    main = relax.analysis.remove_all_unused(_cascade(imp, 2)(imp.mod)["main"])
    assert not [c for c in _calls(main, "relax.matmul") if _last(c) == E]
    assert not [c for c in _calls(main, "relax.nn.softmax") if _last(c) == E]
    assert not [c for c in _calls(main, "relax.shape_of") if c.args[0].ty.shape is not None
                and len(c.args[0].ty.shape) == 2 and isinstance(c.args[0].ty.shape[-1], tvm.tirx.IntImm)
                and int(c.args[0].ty.shape[-1]) == E]  # the scores' shape is a shape expression now


# ---------------------------------------------------------------------------- router semantics


def _router_fn(spec, score, t=48):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((t, D), "float32"))
    w = relax.Var("w", relax.TensorType((E, D), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            o = emit_cascade(bb, x, w, spec, K, score)
            out = bb.emit_output(relax.Tuple([o.values, o.ids, o.chosen, o.candidates]))
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps({"relax.topk": legalize_topk})(bb.get())
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return lambda xs, ws: [a.numpy() for a in vm["main"](tvm.runtime.tensor(xs), tvm.runtime.tensor(ws))]


@pytest.fixture(scope="module")
def router_case(zoo):
    """Layer 0's router weight and the hidden states that reach it, from the torch model."""
    model, _ = zoo.model("tiny")
    router = model.layers[0].moe.router
    seen = []
    hook = router.register_forward_hook(lambda m, i, o: seen.append((i[0].detach().numpy(), [a.detach().numpy() for a in o])))
    with torch.no_grad():
        model(torch.arange(48).reshape(1, 48) * 5 % 256)
    hook.remove()
    x, (ref_w, ref_ids) = seen[0]
    w = router.weight.detach().numpy()
    norm = model.layers[0].post_attention_norm.weight.detach().numpy()
    groups = np.asarray(data_free_groups(w, G))
    cr, b = fit_coarse(w, groups, norm)
    return x, w, ref_w, ref_ids, groups, cr, b


def _softmax(z):
    z = np.exp(z - z.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def test_all_groups_kept_equals_flat_router(router_case):
    x, w, ref_w, ref_ids, groups, cr, b = router_case
    vals, ids, chosen, cand = _router_fn(CascadeSpec(groups, cr, b, keep=G), "softmax")(x, w)
    assert (np.sort(chosen, 1) == np.arange(G)).all() and (np.sort(cand, 1) == np.arange(E)).all()
    np.testing.assert_array_equal(ids, ref_ids)  # same experts, same order (best first)
    np.testing.assert_allclose(vals / vals.sum(-1, keepdims=True), ref_w, atol=1e-6)  # the model renormalises
    np.testing.assert_allclose(vals, np.take_along_axis(_softmax(x @ w.T), ref_ids, 1), atol=1e-6)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_kept_groups_bound_the_routing(router_case, score):
    x, w, ref_w, ref_ids, groups, cr, b = router_case
    keep = 2
    vals, ids, chosen, cand = _router_fn(CascadeSpec(groups, cr, b, keep=keep), score)(x, w)
    coarse = x @ cr.T + b  # T, G
    np.testing.assert_array_equal(np.sort(chosen, 1), np.sort(np.argsort(-coarse, 1, kind="stable")[:, :keep], 1))
    np.testing.assert_array_equal(cand, groups[chosen].reshape(len(x), -1))
    # every chosen expert lies in a chosen group
    group_of = np.empty(E, np.int64)
    group_of[groups.reshape(-1)] = np.repeat(np.arange(G), E // G)
    assert all(set(group_of[ids[t]]) <= set(chosen[t]) for t in range(len(x)))
    logits = x @ w.T  # T, E
    flat_ids = np.argsort(-logits, 1, kind="stable")[:, :K]
    inside = np.array([set(flat_ids[t]) <= set(cand[t]) for t in range(len(x))])
    assert 0 < inside.sum() < len(x), "g < G should change some tokens' routing, not all"
    np.testing.assert_array_equal(ids[inside], flat_ids[inside])
    if score == "softmax":
        # the documented weights: exp over the candidates plus the dropped groups' coarse estimates
        dropped = np.sort(coarse, 1)[:, : G - keep]
        z = np.concatenate([np.take_along_axis(logits, cand, 1), dropped], 1)
        p = _softmax(z)[:, : cand.shape[1]]
        np.testing.assert_allclose(vals, np.take_along_axis(p, np.argsort(-p, 1, kind="stable")[:, :K], 1), atol=1e-6)
        # renormalised over the top-k: the original weights wherever the true top-k was among the candidates
        np.testing.assert_allclose((vals / vals.sum(-1, keepdims=True))[inside], ref_w[inside], atol=1e-6)
    else:
        np.testing.assert_allclose(vals, 1 / (1 + np.exp(-np.take_along_axis(logits, ids, 1))), atol=1e-6)


@pytest.mark.parametrize("score,keep", [("softmax", 2), ("sigmoid", 2), ("softmax", 1), ("softmax", G)])
def test_torch_reference_routes_like_the_pass(router_case, score, keep):
    """``models.cascade.cascade_route`` (what calibration and the fidelity bench route with) is what the pass emits."""
    x, w, ref_w, ref_ids, groups, cr, b = router_case
    spec = CascadeSpec(groups, cr.astype(np.float32), b.astype(np.float32), keep=keep)
    vals, ids, _, _ = _router_fn(spec, score)(x, w)
    with torch.no_grad():
        tv, ti = cascade_route(torch.from_numpy(x), torch.from_numpy(w), spec, K, score)
    np.testing.assert_array_equal(ti.numpy(), ids)
    np.testing.assert_allclose(tv.numpy(), vals, atol=1e-6)
    if keep == G:  # all groups kept: the flat router's experts, in its order
        np.testing.assert_array_equal(ti.numpy(), ref_ids)
        np.testing.assert_array_equal(ti.numpy(), flat_topk(torch.from_numpy(x), torch.from_numpy(w), K).numpy())


def test_data_free_groups_and_coarse_router():
    rng = np.random.default_rng(1)
    centers = rng.standard_normal((4, 32))
    planted = rng.permutation(16).reshape(4, 4)  # expert ids of each planted cluster
    w = np.empty((16, 32))
    for c, members in enumerate(planted):
        w[members] = centers[c] + 0.2 * rng.standard_normal((4, 32))
    groups = data_free_groups(w, 4)
    assert groups == data_free_groups(w, 4)  # deterministic
    assert sorted(map(sorted, groups)) == sorted(sorted(m.tolist()) for m in planted)
    assert sorted(len(g) for g in data_free_groups(rng.standard_normal((16, 32)), 4)) == [4] * 4  # balanced
    cr, b = fit_coarse(w, groups)
    x = np.random.default_rng(7).standard_normal((2000, 32))  # held-out draws
    lse = np.stack([np.log(np.exp(x @ w[g].T).sum(1)) for g in groups], 1)
    err = ((x @ cr.T + b - lse) ** 2).mean()
    assert err < 0.2 * ((lse - lse.mean(0)) ** 2).mean()  # explains most of the variance
    assert (np.argmax(x @ cr.T + b, 1) == np.argmax(lse, 1)).mean() > 0.8


# ---------------------------------------------------------------------------- checks and options


def test_refusals(imported, zoo):
    s = analyze(imported.main, imported.num_inputs, "tiny")
    with pytest.raises(MoecError, match="layer 0 .*8 experts do not split into 3"):
        check_cascade(s, 3, 1, "tiny")
    with pytest.raises(MoecError, match=r"keep must be an integer in \[1, 4\]"):
        check_cascade(s, 4, 5)
    with pytest.raises(MoecError, match="groups must be an integer >= 2"):
        check_cascade(s, 1, 1)
    with pytest.raises(MoecError, match="layer 0 .*fewer than top-2"):
        check_cascade(s, 8, 1)
    with pytest.raises(MoecError, match="layer 0 .*partition the experts"):
        _cascade(imported, 2, groups={0: [[0, 1], [1, 2], [3, 4], [5, 6]]}).resolve(s)
    imp = zoo.imported("tiny-shared-grouped", "pt2")
    grouped = analyze(imp.main, imp.num_inputs, "g")
    check_cascade(grouped, 4, 2, "g")  # its own groups: the exact lowering
    for groups, keep in [(4, 1), (2, 1)]:
        with pytest.raises(MoecError, match="layer 0 .*group-limited .*--cascade-groups 4 --cascade-keep 2"):
            check_cascade(grouped, groups, keep, "g")


def test_compile_all_groups_kept_matches_torch(zoo, tmp_path):
    model, _ = zoo.model("tiny")
    out = moec.compile(zoo.imported("tiny", "pt2"), tmp_path / "art", target="llvm", cascade_groups=G, cascade_keep=G)
    manifest = json.loads((out / "manifest.json").read_text())
    cascade = manifest["options"]["cascade"]
    assert cascade["num_groups"] == G and cascade["keep"] == G and manifest["passes"][0] == "CascadeGating"
    assert all(sorted(sum(grp, [])) == list(range(E)) for grp in cascade["groups"].values())
    assert manifest["structure"]["layers"][0]["router"]["renormalize"] is True
    engine = moec.load(out)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    seqs, logits = engine.prefill(prompts)
    histories = [list(p) for p in prompts]
    for step in range(3):
        for i, h in enumerate(histories):
            np.testing.assert_allclose(logits[i], torch_last_logits(model, h), atol=ATOL, rtol=1e-4, err_msg=f"step {step}")
        nxt = logits.argmax(-1)
        for h, t in zip(histories, nxt):
            h.append(int(t))
        logits = engine.decode(seqs, nxt)


@pytest.mark.parametrize("args,message", [(["--cascade-groups", "3"], "layer 0"),
                                          (["--cascade-groups", "4", "--cascade-keep", "5"], "cascade keep"),
                                          (["--cascade-keep", "2"], "needs cascade groups")])
def test_cli_bad_cascade_options(zoo, tmp_path, args, message):
    out_dir = tmp_path / "art"
    res = subprocess.run([sys.executable, "-m", "moec.compiler.cli", "compile", str(zoo.source("tiny", "onnx")), "-o",
                          str(out_dir), *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("moec: error:") and message in last and "Traceback" not in res.stderr
    assert not out_dir.exists()


def test_cli_help_documents_cascade():
    res = subprocess.run([sys.executable, "-m", "moec.compiler.cli", "compile", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "--cascade-groups" in res.stdout and "--cascade-keep" in res.stdout


def test_compile_with_tiered_cache(zoo, tmp_path):
    out = moec.compile(zoo.imported("tiny", "pt2"), tmp_path / "art", target="llvm", kv_cache="tiered", cascade_groups=G,
                       cascade_keep=2)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["passes"][:2] == ["CascadeGating", "InsertTieredKVAttention"]
    assert manifest["options"]["cascade"]["keep"] == 2 and manifest["options"]["kv_cache"] == "tiered"
    generated = moec.load(out).generate([[5, 6, 7, 8], [1, 2]], 3)
    assert [len(g) for g in generated] == [3, 3]


# ---------------------------------------------------------------------------- group-limited routers: exact lowering

GROUPED = [("tiny-deepseek", "onnx"), ("tiny-deepseek", "pt2"), ("tiny-shared-grouped", "pt2")]


def _router_outputs(model, ids):
    """Per layer, the torch router's top-k ids and the choice scores it selected them by (scores + bias)."""
    seen = []

    def hook(router, args, out):
        scores = torch.sigmoid(args[0] @ router.weight.T) if router.cfg.router_score == "sigmoid" else torch.softmax(
            args[0] @ router.weight.T, -1)
        choice = scores if router.bias is None else scores + router.bias
        seen.append((out[1].numpy(), choice.gather(1, out[1]).numpy()))

    hooks = [layer.moe.router.register_forward_hook(hook) for layer in model.layers]
    with torch.no_grad():
        model(torch.from_numpy(ids), torch.ones_like(torch.from_numpy(ids)))
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("name,form", GROUPED)
def test_group_limited_exact_topk(zoo, name, form):
    cfg = get_config(name)
    model, _ = zoo.model(name)
    imp = zoo.imported(name, form)
    cascade = CascadeGating(imp.num_inputs, cfg.n_group, cfg.topk_group, source=name)  # its own groups: no weights needed
    main = cascade(imp.mod)["main"]
    live = relax.analysis.remove_all_unused(main)
    cand = cfg.topk_group * cfg.num_experts // cfg.n_group
    topks = _calls(live, "relax.topk")
    assert len([t for t in topks if int(t.attrs.k) == cfg.top_k and _last(t.args[0]) == cand]) >= 2
    assert all(_last(cascade.outputs[i].candidates) == cand for i in (0, 1))
    assert not [t for t in topks if _last(t.args[0]) == cfg.num_experts]  # no top-k over all experts: the kept groups' only
    assert not _calls(live, "relax.scatter_elements") and not _calls(live, "relax.greater_equal")  # the mask is dead code
    outs = [cascade.outputs[i] for i in sorted(cascade.outputs)]
    ids = np.random.default_rng(5).integers(0, 256, (2, 48))
    got = probe(main, [o.ids for o in outs] + [o.values for o in outs])([ids, np.ones_like(ids)][: imp.num_inputs],
                                                                         imp.weights)
    for layer, (ref_ids, ref_vals) in enumerate(_router_outputs(model, ids)):
        np.testing.assert_array_equal(np.sort(got[layer], 1), np.sort(ref_ids, 1))  # the same expert sets, every token
        np.testing.assert_allclose(np.sort(got[2 + layer], 1), np.sort(ref_vals, 1), atol=1e-6)
    manifest = cascade.manifest()
    assert manifest["groups"]["0"] == np.arange(cfg.num_experts).reshape(cfg.n_group, -1).tolist()
    assert manifest["coarse"]["1"].startswith("exact")


def test_compile_group_limited_matches_onnxruntime(zoo, tmp_path):
    import onnxruntime as ort

    src = zoo.source("tiny-deepseek", "onnx")
    out = moec.compile(src, tmp_path / "art", target="llvm", cascade_groups=8)  # keeps the router's own 3 groups
    cascade = json.loads((out / "manifest.json").read_text())["options"]["cascade"]
    assert cascade["keep"] == 3 and all(v.startswith("exact") for v in cascade["coarse"].values())
    session = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    model, _ = zoo.model("tiny-deepseek")
    engine = moec.load(out)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 40, 41], [12, 13, 14]]
    seqs, logits = engine.prefill(prompts)
    histories = [list(p) for p in prompts]
    for step in range(3):
        for i, h in enumerate(histories):
            np.testing.assert_allclose(logits[i], ort_last_logits(session, h), atol=ATOL, rtol=1e-4, err_msg=f"step {step}")
            np.testing.assert_allclose(logits[i], torch_last_logits(model, h), atol=ATOL, rtol=1e-4, err_msg=f"step {step}")
        nxt = logits.argmax(-1)
        for h, t in zip(histories, nxt):
            h.append(int(t))
        logits = engine.decode(seqs, nxt)
    with pytest.raises(MoecError, match=r"group-limited .*--cascade-groups 8 --cascade-keep 3 \(got 4 / 3\)"):
        moec.compile(src, tmp_path / "bad", target="llvm", cascade_groups=4)
    assert not (tmp_path / "bad").exists()
