"""Expert cache residency and eviction (runtime/expert_cache.py) and expert prediction on the trained tiny model."""

import numpy as np
import pytest
import torch

from moec.compiler.errors import MoecError
from moec.runtime.expert_cache import ExpertCache, simulate


def test_lru_eviction_pins_and_prefetch():
    c = ExpertCache(4)
    hits, stalls = c.require(0, [1, 2])
    assert hits == [] and [e for e, _ in stalls] == [1, 2]
    assert c.prefetch(1, [5, 6]) and (1, 5) in c and (1, 6) in c  # two free slots
    c.release(0)
    # layer 1 routes to 5 and 7: 5 was prefetched (a hit), 7 must evict the LRU unpinned, unpending expert: (0, 1)
    hits, stalls = c.require(1, [5, 7])
    assert hits == [5] and [e for e, _ in stalls] == [7]
    assert (0, 1) not in c and (0, 2) in c and c.stats.evictions == 1
    assert c.stats.prefetch_used == 1 and c.stats.prefetched == 2  # 6 was prefetched for nothing
    # the prefetch for layer 2 evicts the LRU experts not pinned: (0, 2), then the unused prefetch (1, 6)
    c.prefetch(2, [0, 3])
    assert set(c.resident) == {(1, 5), (1, 7), (2, 0), (2, 3)} and c.stats.evictions == 3
    # now every slot is pinned (layer 1 computing) or pending (layer 2's predictions): a further prefetch is dropped
    assert c.prefetch(2, [9]) == [] and c.stats.prefetch_dropped == 1 and (2, 9) not in c
    c.release(1)
    assert c.prefetch(2, [9]) and (1, 5) not in c  # layer 1 done: its LRU expert can go
    c.check()
    with pytest.raises(MoecError, match="cannot hold layer 3's 5 routed experts"):
        ExpertCache(4).require(3, range(5))
    with pytest.raises(MoecError, match="at least one slot"):
        ExpertCache(0)


def test_cycle_policy_keeps_what_comes_next():
    """A decode step visits the layers in order. One expert a layer, step after step, with a cache one slot short of
    them: LRU always evicts the expert the next layer needs (no hit at all); the cycle policy evicts the one whose
    layer comes round last, about one miss in three accesses (Belady's optimum for this cycle: one in N - 1)."""
    routed = [[[0], [1], [2], [3]] for _ in range(20)]
    lru, cyc = simulate(routed, None, 3, "lru"), simulate(routed, None, 3, "cycle")
    assert lru["hits"] == 0 and lru["stalls"] == 80
    assert cyc["stalls"] == 29 and cyc["hits"] == 51
    c = ExpertCache(2, layers=3, policy="cycle")
    for layer, expert in ((0, 7), (2, 8), (1, 9), (2, 8)):  # (1, 9) evicts (0, 7); (2, 8) is then a hit
        c.require(layer, [expert])
        c.release(layer)
    assert (0, 7) not in c and c.stats.hits == 1
    c.require(0, [7])  # LRU would evict (1, 9); from layer 0, layer 2 comes round after layer 1: (2, 8) goes
    assert (2, 8) not in c and (1, 9) in c
    with pytest.raises(MoecError, match="'cycle' with the number of layers"):
        ExpertCache(4, policy="cycle")


def test_slots_are_reused_and_consistent():
    rng = np.random.default_rng(0)
    c = ExpertCache(6)
    for step in range(200):
        layer = step % 4
        c.require(layer, rng.choice(16, 2, replace=False))
        c.prefetch((layer + 1) % 4, rng.choice(16, 3, replace=False))
        c.release(layer)
        c.check()
        assert len(c.resident) <= 6
    s = c.stats
    assert s.hits + s.stalls == 400 and s.copies == s.stalls + s.prefetched


def test_perfect_prediction_removes_stalls_past_the_first_layer():
    rng = np.random.default_rng(1)
    routed = [[list(rng.choice(32, 4, replace=False)) for _ in range(4)] for _ in range(50)]
    on_demand = simulate(routed, None, capacity=8)
    perfect = simulate(routed, [[None] + steps[1:] for steps in routed], capacity=8)
    assert on_demand["stalls"] > 0 and on_demand["prefetched"] == 0
    # with a perfect predictor only layer 0 (nothing predicts it) can stall
    assert perfect["stalls"] <= sum(len(s[0]) for s in routed) < on_demand["stalls"]
    assert perfect["prefetch_used"] == perfect["prefetched"]  # a perfect prediction is always used


def test_prediction_recall_on_trained_tiny(trained_tiny):
    from moec.models.corpus import load_corpus  # noqa: F401
    from moec.models.expert_prediction import batch_recall, evaluate_prediction, predict, recall, routing_trace
    from moec.models.train import corpus_of, load_trained

    model, meta = load_trained(trained_tiny)
    corpus = corpus_of(meta)
    held = corpus.tokens("heldout")
    doc = evaluate_prediction(model, held, context=128, max_tokens=2048, calibration_tokens=corpus.tokens("train")[:4096],
                              extras=(0, 2), streams=(1, 4))
    k, e = doc["top_k"], doc["num_experts"]
    rows = {(r["source"], r["corrected"], r["extra"]): r for r in doc["rows"]}
    assert doc["tokens"] == 2048 and len(doc["rows"]) == 2 * 2 * 2  # one layer pair on tiny
    # better than guessing; predicting more experts never lowers recall; extra = E - k predicts everything
    for src in ("post_attention", "layer_output"):
        assert rows[(src, False, 0)]["recall"] > doc["random_recall"]["0"]
        assert rows[(src, False, 2)]["recall"] >= rows[(src, False, 0)]["recall"]
    # recall against a brute-force count
    x = torch.from_numpy(np.asarray(held[:256], dtype=np.int64).reshape(2, 128))
    trace = routing_trace(model, x)
    pred = predict(model, trace, 1, "layer_output")
    want = np.mean([len(set(p.tolist()) & set(r.tolist())) / k for p, r in zip(pred, trace.routed[1])])
    assert recall(pred, trace.routed[1]) == pytest.approx(want)
    everything = predict(model, trace, 1, "post_attention", extra=e - k)
    assert recall(everything, trace.routed[1]) == 1.0
    b = batch_recall(everything, trace.routed[1], 4, e)
    assert b["recall"] == 1.0 and b["predicted_per_step"] == e
    with pytest.raises(ValueError, match="needs a previous layer"):
        predict(model, trace, 0)


def test_prefetch_gate_weighs_precision_against_copy_time():
    """A prediction is copied ahead when p * min(overlap, copy) >= (1 - p) * copy time: with a 7 ms copy and 1 ms of
    compute to hide it behind, only predictions right more than 7 / 8 of the time pass; with a 0.5 ms copy, a third
    will do (the gain is capped at the copy: 0.5 ms, not the 1 ms of compute)."""
    from moec.runtime.expert_cache import PrefetchGate

    rng = np.random.default_rng(0)
    gate = PrefetchGate(copy_s=7e-3, ranks=2, decay=0.99)
    assert gate.admit(0) and gate.admit(1) and gate.overlap() is None  # nothing timed yet: copy ahead
    gate.time_layer(1e-3)
    for _ in range(2000):  # rank 0 right 95% of the time, rank 1 69%
        gate.observe({0: 0, 1: 1}, [e for e, p in ((0, 0.95), (1, 0.69)) if rng.random() < p])
    p = gate.precision()
    assert abs(p[0] - 0.95) < 0.05 and abs(p[1] - 0.69) < 0.08
    assert gate.admit(0) and not gate.admit(1) and not gate.admit(5)  # ranks past the last share its estimate
    gate.copy_s = 0.5e-3
    assert gate.admit(0) and gate.admit(1)
    gate.time_layer(1e-4)  # the overlap is a moving average: 0.8 x 1 ms + 0.2 x 0.1 ms
    assert abs(gate.overlap() - 0.82e-3) < 1e-9
    # the counts decay: a predictor that turns bad is noticed
    for _ in range(500):
        gate.observe({0: 0}, [])
    assert gate.precision()[0] < 0.05 and not gate.admit(0)


def test_prefetch_gate_overlap_per_rows_and_eviction_cost():
    """The overlap is kept per number of rows: a prefill chunk's long layers (what made an H100 run copy every
    prediction ahead of 1 ms decode layers, at 7 ms a copy) do not stand for a decode step's once one is timed. A
    prefetch that must evict also pays q copies, q the chance the evicted expert comes back within a cycle."""
    from moec.runtime.expert_cache import PrefetchGate

    gate = PrefetchGate(copy_s=7e-3, ranks=1)
    for _ in range(100):
        gate.observe({0: 0}, [0] if _ % 50 else [])  # right 98% of the time
    gate.time_layer(60e-3, rows=496)  # a prefill chunk's layer
    assert gate.overlap(16) == 60e-3 and gate.admit(0, rows=16)  # only prefill timed: its estimate stands in
    gate.time_layer(1.2e-3, rows=16)
    assert gate.overlap(16) == 1.2e-3 and gate.overlap(12) == 1.2e-3 and gate.overlap(400) == 60e-3
    # 0.98 x 1.2 ms = 1.18 ms against 0.02 x 7 ms = 0.14 ms: a free slot admits it, an eviction that comes back
    # a third of the time (2.3 ms more) does not
    assert gate.admit(0, rows=16, evict_reuse=0.0) and not gate.admit(0, rows=16, evict_reuse=1 / 3)
    assert gate.admit(0, rows=496, evict_reuse=1 / 3)  # a prefill layer hides the copy whole


def test_eviction_reuse_estimate():
    """``eviction_reuse``: evicted experts loaded again within one cycle of the layers count as reused, those not
    loaded again within it as not; a cache that holds a layer's experts while the cycle wants them all back reuses
    every eviction, one whose evicted experts never return none."""
    from moec.runtime.expert_cache import ExpertCache

    cache = ExpertCache(4, layers=2, policy="cycle", decay=0.9)
    assert cache.eviction_reuse() == 0.5 and cache.free_slots == 4
    for _ in range(30):  # two layers of 4 experts each through 4 slots: every eviction comes back next step
        for layer in range(2):
            cache.require(layer, range(4))
            cache.release(layer)
    assert cache.eviction_reuse() > 0.95 and cache.free_slots == 0
    cache = ExpertCache(4, layers=2, policy="cycle", decay=0.9)
    for step in range(30):  # fresh experts every step: nothing evicted returns
        for layer in range(2):
            cache.require(layer, [100 * step + layer * 4 + i for i in range(2)])
            cache.release(layer)
    assert cache.eviction_reuse() < 0.05
