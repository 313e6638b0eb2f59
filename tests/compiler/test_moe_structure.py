import pytest

from moec.compiler.importers import import_model
from moec.compiler.moe_structure import analyze

# (model, expected per-layer facts) -- recognised by structure, never by parameter names
EXPECT = {
    "tiny": dict(heads=(4, 2, 16), score="softmax", k=2, e=8, renorm=True, groups=1, shared=0, gate=False, qk=False),
    "tiny-shared-grouped": dict(heads=(4, 2, 16), score="softmax", k=2, e=8, renorm=False, groups=4, shared=3, gate=True, qk=False,
                                kept=2, group_score="max", bias=False),
    # DeepSeek-V3 routing: a top-2 inside each group before the group top-k, a score-correction bias
    "tiny-deepseek": dict(heads=(4, 2, 16), score="sigmoid", k=4, e=32, renorm=True, groups=8, shared=3, gate=False, qk=False,
                          kept=3, group_score="top2_sum", bias=True),
    "hf-olmoe": dict(heads=(4, 2, 16), score="softmax", k=2, e=8, renorm=False, groups=1, shared=0, gate=False, qk=True),
    "hf-mixtral": dict(heads=(4, 2, 16), score="softmax", k=2, e=4, renorm=True, groups=1, shared=0, gate=False, qk=False),
    "hf-qwen2_moe": dict(heads=(4, 2, 16), score="softmax", k=2, e=8, renorm=False, groups=1, shared=3, gate=True, qk=False),
}


@pytest.mark.parametrize("path", ["onnx", "pt2"])
@pytest.mark.parametrize("name", list(EXPECT))
def test_structure(zoo, name, path):
    imported = zoo.imported(name, path)  # (the session's import: test_engine compiles the same ones)
    s = analyze(imported.main, imported.num_inputs, name)
    e = EXPECT[name]
    assert s.num_layers == 2 and len(s.moe_layers) == 2
    assert s.lm_head is not None and s.final_norm is not None
    assert s.position_sources, "rotary position source not found"
    for layer in s.layers:
        a, r = layer.attention, layer.router
        assert (a.num_heads, a.num_kv_heads, a.head_dim) == e["heads"]
        assert a.sm_scale == pytest.approx(16**-0.5, rel=1e-5)
        assert a.qk_norm == e["qk"]
        assert len(a.projections) == 4
        assert (r.score, r.top_k, r.num_experts, r.renormalize, r.n_group) == (e["score"], e["k"], e["e"], e["renorm"], e["groups"])
        if "kept" in e:
            assert (r.topk_group, r.group_score, r.bias is not None) == (e["kept"], e["group_score"], e["bias"])
        assert len(layer.experts) == 2
        assert all(shape[0] == e["e"] for shape in layer.experts.values())
        assert len(layer.shared_experts) == e["shared"]
        assert (layer.shared_expert_gate is not None) == e["gate"]
        roles = [n.role for n in layer.norms]
        assert roles.count("attention") == 1 and roles.count("mlp") == 1
        assert roles.count("qk") == (2 if e["qk"] else 0)
    table = s.table()
    assert f"top-{e['k']}" in table and str(s.vocab_size) in table
    d = s.to_dict()
    assert d["num_moe_layers"] == 2 and d["layers"][0]["router"]["top_k"] == e["k"]


@pytest.mark.parametrize("shape,qk", [("tiny-mixtral", 0), ("tiny-olmoe", 2)])
def test_half_precision_norms(tmp_path, shape, qk):
    """HF RMSNorms in bfloat16 cast ``x * rsqrt(.)`` back to bfloat16 before the weight multiply: still recognised,
    with their roles (the expert prefetch's norm ratio reads the mlp norm's weight)."""
    from moec.compiler.serve_bench import build_hf
    from moec.models.export import save_pt2

    model = build_hf(shape, "bfloat16", "cpu", 0, 2)
    path = tmp_path / "m.pt2"
    save_pt2(model, model.config.vocab_size, path, max_seq=64)
    imported = import_model(path)
    s = analyze(imported.main, imported.num_inputs, shape)
    assert s.final_norm is not None
    for layer in s.layers:
        roles = [n.role for n in layer.norms]
        assert roles.count("attention") == 1 and roles.count("mlp") == 1 and roles.count("qk") == qk, roles
