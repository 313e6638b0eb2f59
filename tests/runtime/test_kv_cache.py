"""Tiered cache page accounting: random join/leave, exhaustion, re-rank budget."""

import copy

import numpy as np
import pytest

from moec.compiler.errors import MoecError
from moec.runtime.kv_cache import CacheExhausted, TieredPageTables


def test_random_join_leave_never_leaks_or_double_owns():
    rng = np.random.default_rng(0)
    t = TieredPageTables(t1_pages=300, t2_pages=60, t1_page=16, t2_page=32, max_sequences=12, recent=16)
    refused = 0
    for step in range(3000):
        op = rng.random()
        live = list(t.seqs)
        try:
            if op < 0.1 or not live:
                t.add_sequence()
            elif op < 0.2:
                t.remove_sequence(int(rng.choice(live)))
            elif op < 0.85:
                picked = rng.choice(live, size=min(len(live), int(rng.integers(1, 5))), replace=False)
                t.append({int(s): int(rng.integers(1, 40)) for s in picked})
            else:
                t.plan_rerank(int(rng.choice(live)))
        except CacheExhausted:
            refused += 1
        t.check()
    assert refused > 0  # the pools were pushed to their limits
    for s in list(t.seqs):
        t.remove_sequence(s)
    t.check()
    assert t.t1.free == 300 and t.t2.free == 60 and not t.t1.owner and not t.t2.owner


def test_refused_append_changes_nothing():
    t = TieredPageTables(t1_pages=4, t2_pages=4, t1_page=16, t2_page=32)
    a, b = t.add_sequence(), t.add_sequence()
    t.append({a: 40})
    before = copy.deepcopy((t.seqs, t.t1.owner, t.t1.free))
    with pytest.raises(CacheExhausted, match="tier-1"):
        t.append({a: 10, b: 20})  # a needs 0 more pages, b 2: 2 > 1 free
    assert (t.seqs, t.t1.owner, t.t1.free) == before
    with pytest.raises(MoecError, match="unknown sequence"):
        t.append({99: 1})


def test_too_many_sequences_is_a_clear_error():
    t = TieredPageTables(t1_pages=4, t2_pages=4, max_sequences=2)
    t.add_sequence(), t.add_sequence()
    with pytest.raises(CacheExhausted, match="at most 2 sequences"):
        t.add_sequence()


def test_rerank_keeps_the_budget_in_whole_tier2_pages():
    t = TieredPageTables(t1_pages=400, t2_pages=100, t1_page=16, t2_page=128, tier1_fraction=0.15, sink=4, recent=64)
    s = t.add_sequence()
    t.append({s: 4096})
    plan = t.plan_rerank(s)
    seq = t.seqs[s]
    budget = t.budget(4096)
    assert budget == 614 and seq.t1_len >= budget and seq.t1_len - budget < 128
    assert plan.demote % 128 == 0 and plan.demote + plan.keep == 4096 and len(plan.new_t2_pages) == plan.demote // 128
    assert len(seq.t1_pages) == -(-seq.t1_len // 16) and len(plan.freed_t1_pages) == 256 - len(seq.t1_pages)
    t.check()
    # a few decode steps later nothing moves until a whole tier-2 page of excess exists
    t.append({s: 16})
    assert t.plan_rerank(s).demote == 0
    # short sequences keep everything: sinks and the recent window are always tier 1
    s2 = t.add_sequence()
    t.append({s2: 60})
    assert t.plan_rerank(s2).demote == 0 and t.seqs[s2].t1_len == 60
    t.check()


def test_cached_page_arrays_equal_a_fresh_rebuild():
    """``tables()`` reuses per-sequence page arrays and its last dense tables: after random appends, re-ranks, joins
    and leaves its tables equal ones rebuilt from the page lists (and ``append_slots`` and ``last_slots`` agree with
    them)."""
    import numpy as np

    from moec.runtime.kv_cache import CacheExhausted, TieredPageTables

    def fresh(pt, slots):
        seqs = [pt.seqs[s] for s in slots]
        m1 = max([len(q.t1_pages) for q in seqs] + [1])
        m2 = max([len(q.t2_pages) for q in seqs] + [1])
        t1 = np.zeros((len(seqs), m1), np.int32)
        t2 = np.zeros((len(seqs), m2), np.int32)
        for i, q in enumerate(seqs):
            t1[i, : len(q.t1_pages)] = q.t1_pages
            t2[i, : len(q.t2_pages)] = q.t2_pages
        return t1, t2

    rng = np.random.default_rng(0)
    pt = TieredPageTables(60, 40, 8, 16, max_sequences=6, tier1_fraction=0.2, sink=2, recent=6)
    live, checked, incremental = [], 0, 0
    for step in range(600):
        op = rng.random()
        if op < 0.08 and len(live) < 6:
            live.append(pt.add_sequence())
        elif op < 0.12 and live:
            pt.remove_sequence(live.pop(int(rng.integers(len(live)))))
        elif live:
            slots = [s for s in live if rng.random() < 0.7] or live[:1]
            counts = {s: int(rng.integers(1, 20)) if rng.random() < 0.2 else 1 for s in slots}
            try:
                pt.append(counts)
            except CacheExhausted:
                pt.remove_sequence(live.pop(0))
                continue
            for s in slots:
                pages = pt.seqs[s].t1_pages
                idx = np.arange(pt.seqs[s].t1_len - counts[s], pt.seqs[s].t1_len)
                want = [pages[i // 8] * 8 + i % 8 for i in idx]
                assert pt.append_slots(s, counts[s]).tolist() == want
            if step % 5 == 0:
                for s in live:
                    try:
                        pt.plan_rerank(s)
                    except CacheExhausted:
                        pass
        if live:
            order = list(rng.permutation(live)) if rng.random() < 0.3 else list(live)  # mostly the last call's rows
            incremental += pt._dense is not None and pt._dense[0] == tuple(order)
            tab = pt.tables(order)
            t1, t2 = fresh(pt, order)
            # a decode step's append slots, all rows at once, agree with append_slots per sequence
            if all(pt.seqs[s].t1_len > 0 for s in order):
                assert pt.last_slots(tab["t1_table"], tab["t1_len"]).tolist() == [int(pt.append_slots(s, 1)[0]) for s in order]
            np.testing.assert_array_equal(tab["t1_table"], t1)
            np.testing.assert_array_equal(tab["t2_table"], t2)
            assert tab["t2_np"].tolist() == [len(pt.seqs[s].t2_pages) for s in order]
            checked += 1
        pt.check()
    assert checked > 400 and pt._arrays and incremental > 100  # the caches were in use
