"""The PyTorch tiered-KV reference decoder: exact in full mode, policy invariants per tier."""

import numpy as np
import pytest
import torch

from moec.models import get_config
from moec.models.kv_reference import TierPolicy, TieredDecoder, _LayerCache, tier_fraction
from moec.models.train import init_model


@pytest.fixture(scope="module")
def setup():
    model = init_model(get_config("text-tiny"), seed=0).eval()
    rng = np.random.default_rng(0)
    return model, rng.integers(0, 256, (2, 200))


def test_full_mode_equals_the_model(setup):
    model, w = setup
    logits = TieredDecoder(model, TierPolicy(mode="full")).run(w, 120)
    with torch.no_grad():
        ref = model(torch.from_numpy(w[:, :-1]))[:, 119:].numpy()
    np.testing.assert_allclose(logits, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["tiered", "tiered-random"])
def test_tiered_policy_invariants(setup, mode):
    model, w = setup
    policy = TierPolicy(mode=mode, tier1_fraction=0.15, sink=4, recent=16, rerank_every=8, page_tokens=16)
    dec = TieredDecoder(model, policy)
    dec.run(w, 120)
    for c in dec.caches:
        n = c.len
        tier = c.tier[:, :, :n]
        assert (tier > 0).all()
        assert (tier[:, :, :4] == 1).all()  # attention sinks
        # the recent window as of the last re-rank (every 8 steps) is tier 1
        last = 120 + ((n - 120) // 8) * 8
        assert (tier[:, :, last - 16:] == 1).all()
        ones = (tier == 1).sum(-1)
        budget = max(int(0.15 * n), 20)
        assert (ones < budget + 16 + 8 + 1).all()  # < one tier-2 page over, plus steps since the re-rank
        assert ((tier == 2).sum(-1) % 16 == 0).all()  # whole tier-2 pages
    assert 0.1 < tier_fraction(dec.caches) < 0.5


def test_importance_and_random_choose_differently(setup):
    model, w = setup
    kw = dict(tier1_fraction=0.15, sink=4, recent=16, rerank_every=8, page_tokens=16)
    a, b = TieredDecoder(model, TierPolicy("tiered", **kw)), TieredDecoder(model, TierPolicy("tiered-random", **kw))
    a.run(w, 120), b.run(w, 120)
    assert not np.array_equal(a.caches[0].tier, b.caches[0].tier)


def test_rerank_demotes_the_least_important():
    policy = TierPolicy("tiered", tier1_fraction=0.25, sink=2, recent=4, page_tokens=8, score="uniform")
    c = _LayerCache(1, 1, 64, 8, policy)
    rng = np.random.default_rng(0)
    c.append(rng.standard_normal((1, 1, 64, 8)).astype(np.float32), rng.standard_normal((1, 1, 64, 8)).astype(np.float32))
    visible = np.linspace(0.05, 0.9, 64)  # uniform-attention shares are mostly below 1
    score = rng.random(64)
    c.mass[0, 0] = torch.from_numpy(score * visible)
    c.rerank(visible, rng)
    tier = c.tier[0, 0]
    # budget 16: sinks 0-1 and window 60-63 stay; of the 58 others, 48 (6 whole pages) are demoted
    assert (tier[:2] == 1).all() and (tier[60:] == 1).all() and (tier == 2).sum() == 48
    others = np.arange(2, 60)
    kept = others[tier[others] == 1]
    assert set(kept) == set(others[np.argsort(-score[others])[:10]])
    # demoted values are 2-bit reconstructions, kept ones FP8
    kd, k = c.kd.numpy(), c.k.numpy()
    assert not np.allclose(kd[0, 0, tier == 2], k[0, 0, tier == 2], atol=1e-2)
    assert np.allclose(kd[0, 0, tier == 1], k[0, 0, tier == 1], rtol=0.07, atol=1e-2)


def test_2bit_mode_quantizes_nearly_everything(setup):
    model, w = setup
    dec = TieredDecoder(model, TierPolicy.named("2bit", page_tokens=16, rerank_every=8))
    dec.run(w, 120)
    assert tier_fraction(dec.caches) < 0.2
    with pytest.raises(ValueError, match="unknown KV policy"):
        TierPolicy(mode="int3")


def test_keynorm_score_keeps_the_largest_keys():
    policy = TierPolicy("tiered", tier1_fraction=0.25, sink=2, recent=4, page_tokens=8)
    assert policy.score == "keynorm"  # the tiered default
    c = _LayerCache(1, 1, 64, 8, policy)
    rng = np.random.default_rng(1)
    k = rng.standard_normal((1, 1, 64, 8)).astype(np.float32)
    k *= rng.uniform(0.2, 3.0, (1, 1, 64, 1)).astype(np.float32)  # spread of key norms
    c.append(k, rng.standard_normal((1, 1, 64, 8)).astype(np.float32))
    c.mass[0, 0] = torch.from_numpy(np.linalg.norm(k[0, 0], axis=-1)[::-1].copy())  # attention mass would choose otherwise
    c.rerank(np.ones(64), rng)
    tier, others = c.tier[0, 0], np.arange(2, 60)
    kept = others[tier[others] == 1]
    norms = np.linalg.norm(k[0, 0], axis=-1)
    assert set(kept) == set(others[np.argsort(-norms[others])[:10]])


def test_attention_state_accumulates_per_query():
    policy = TierPolicy("tiered", decay=0.5, score="ema")
    c = _LayerCache(1, 1, 8, 4, policy)
    c.len = 3
    ps = np.zeros((1, 1, 2, 3))
    ps[0, 0, 0] = [1.0, 0.0, 0.0]  # first query: all on token 0
    ps[0, 0, 1] = [0.25, 0.25, 0.5]
    c.accumulate(ps)
    np.testing.assert_allclose(c.mass[0, 0, :3], [1.25, 0.25, 0.5])
    np.testing.assert_allclose(c.ema[0, 0, :3], [0.5 + 0.25, 0.25, 0.5])  # the older query halved
    np.testing.assert_allclose(c.maxp[0, 0, :3], [1.0, 0.25, 0.5])
    np.testing.assert_allclose(c.importance(np.ones(8))[0, 0], [0.75, 0.25, 0.5])
    steps = TierPolicy("tiered", score="steps*mass")
    c.policy = steps
    np.testing.assert_allclose(c.importance(np.ones(8))[0, 0], [1.25 / 3 * 1.25, 0.25 / 2 * 0.25, 0.5 * 0.5])
    c.rerank(np.ones(8), np.random.default_rng(0))
    assert (c.since == 0).all() and c.mass[0, 0, 0] == 1.25  # "since" restarts at a re-rank
    with pytest.raises(ValueError, match="unknown importance score"):
        TierPolicy(score="mass*bogus")


def test_prefill_reads_the_cached_values(setup):
    model, w = setup
    full = TieredDecoder(model, TierPolicy(mode="full")).run(w, 120)
    fp8 = TieredDecoder(model, TierPolicy(mode="fp8")).run(w, 120)
    # the first prediction comes from the prefill: it sees FP8 K/V, so it differs from float32
    assert not np.allclose(fp8[:, 0], full[:, 0], atol=1e-5)
    np.testing.assert_allclose(fp8[:, 0], full[:, 0], atol=0.2)


def test_fp8_roundtrip_matches_kv_quant_bit_for_bit():
    from moec.models.kv_reference import fp8_roundtrip
    from moec.runtime import kv_quant as q

    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4000, 64)) * rng.uniform(1e-3, 300, (4000, 1))).astype(np.float32)
    x[:10] = 0  # the minimum scale
    want = q.fp8_dequantize(*q.fp8_quantize(x))
    got = fp8_roundtrip(torch.from_numpy(x)).numpy()
    assert np.array_equal(got, want)


@pytest.mark.parametrize("demote", ["k", "v"])
def test_demotion_ablation_quantizes_one_side_only(demote):
    from moec.models.kv_reference import fp8_roundtrip

    policy = TierPolicy("tiered", tier1_fraction=0.25, sink=2, recent=4, page_tokens=8, demote=demote)
    c = _LayerCache(1, 1, 64, 8, policy)
    rng = np.random.default_rng(2)
    k, v = (rng.standard_normal((1, 1, 64, 8)).astype(np.float32) for _ in range(2))
    c.append(k, v)
    c.rerank(np.ones(64), rng)
    two = c.tier[0, 0] == 2
    assert two.sum() == 48
    fp8k, fp8v = fp8_roundtrip(torch.from_numpy(k)).numpy(), fp8_roundtrip(torch.from_numpy(v)).numpy()
    kept, changed = (fp8v, fp8k) if demote == "k" else (fp8k, fp8v)
    now_kept, now_changed = (c.vd, c.kd) if demote == "k" else (c.kd, c.vd)
    assert np.array_equal(now_kept.numpy()[0, 0, two], kept[0, 0, two])
    assert not np.allclose(now_changed.numpy()[0, 0, two], changed[0, 0, two], atol=1e-2)
    with pytest.raises(ValueError, match="demote"):
        TierPolicy(demote="q")


def test_rotation_is_orthogonal_and_changes_only_the_2bit_tokens():
    from moec.models.kv_reference import orthogonal_rotation

    for dim in (64, 48):
        r = orthogonal_rotation(dim)
        np.testing.assert_allclose(r @ r.T, np.eye(dim), atol=1e-5)
        assert np.abs(r).max() < 0.5  # every channel spread over many
    rng = np.random.default_rng(4)
    k, v = (rng.standard_normal((1, 1, 64, 8)).astype(np.float32) for _ in range(2))
    k[..., 0] *= 20  # an outlier channel
    caches = {}
    for rotate in ("", "kv"):
        c = _LayerCache(1, 1, 64, 8, TierPolicy("tiered", tier1_fraction=0.25, sink=2, recent=4, page_tokens=8, rotate=rotate))
        c.append(k, v)
        c.rerank(np.ones(64), np.random.default_rng(0))
        caches[rotate] = c
    two = caches[""].tier[0, 0] == 2
    assert np.array_equal(two, caches["kv"].tier[0, 0] == 2)
    a, b = caches[""].kd.numpy()[0, 0], caches["kv"].kd.numpy()[0, 0]
    assert np.array_equal(a[~two], b[~two]) and not np.allclose(a[two], b[two])
    with pytest.raises(ValueError, match="rotate"):
        TierPolicy(rotate="q")
