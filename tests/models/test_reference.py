import pytest
import torch

from moec.models import MODEL_CONFIGS, MoEConfig, build_reference, get_config
from moec.models.reference import Router


def test_registry_has_named_shapes():
    for name in ("tiny", "olmoe-1b-7b", "mixtral-8x7b", "qwen2-moe-a2.7b"):
        assert name in MODEL_CONFIGS
    olmoe = get_config("olmoe-1b-7b")
    assert (olmoe.num_experts, olmoe.top_k, olmoe.num_layers, olmoe.hidden_size) == (64, 8, 16, 2048)
    with pytest.raises(KeyError, match="unknown model config"):
        get_config("nope")


def test_config_validation_and_roundtrip():
    cfg = get_config("tiny-shared-grouped")
    assert MoEConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError):
        MoEConfig(vocab_size=8, hidden_size=8, intermediate_size=4, num_layers=1, num_heads=2, num_kv_heads=2, num_experts=4, top_k=5)
    with pytest.raises(ValueError):
        MoEConfig(vocab_size=8, hidden_size=8, intermediate_size=4, num_layers=1, num_heads=2, num_kv_heads=2, num_experts=6, top_k=2, n_group=4)


@pytest.mark.parametrize("name", ["tiny", "tiny-shared-grouped"])
def test_forward_shape_and_causality(name):
    cfg = get_config(name)
    model = build_reference(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        full = model(ids, torch.ones_like(ids))
        prefix = model(ids[:, :5])
    assert full.shape == (2, 9, cfg.vocab_size)
    torch.testing.assert_close(full[:, :5], prefix, atol=1e-5, rtol=1e-5)  # causal: the future does not leak


def test_router_renormalisation_and_groups():
    cfg = get_config("tiny")
    r = Router(cfg)
    w, idx = r(torch.randn(5, cfg.hidden_size))
    torch.testing.assert_close(w.sum(-1), torch.ones(5))
    grouped = get_config("tiny-shared-grouped")
    r = Router(grouped)
    x = torch.randn(64, grouped.hidden_size)
    _, idx = r(x)
    per_group = grouped.num_experts // grouped.n_group
    groups_used = (idx // per_group)
    for row in groups_used:
        assert len(set(row.tolist())) <= grouped.topk_group
