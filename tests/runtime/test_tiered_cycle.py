"""Page tables and the tiered kernels together (llvm): append, decode and re-rank over many steps."""

import numpy as np
import tvm

from moec.runtime import kv_quant as q
from moec.runtime.kv_cache import TieredPageTables
from moec.schedules.kernels.tiered_append import make_tiered_append
from moec.schedules.kernels.tiered_decode import decode_workspaces, make_tiered_decode
from moec.schedules.kernels.tiered_rerank import call_rerank, make_tiered_rerank, workspaces

H, HKV, D, PS1, PS2, SINK, RECENT = 4, 2, 32, 16, 32, 2, 8
P1, P2 = 40, 24


def _build(name, func):
    return tvm.compile(tvm.IRModule({name: func}), target="llvm")[name]


def _dequantized(pools, tables, b, h):
    """Positions and dequantized K, V of every cached token of sequence b, head h, read from the pools."""
    pos, ks, vs = [], [], []
    for i in range(tables["t1_len"][b]):
        pg, sl = tables["t1_table"][b, i // PS1], i % PS1
        pos.append(pools["t1_pos"][pg, h, sl])
        ks.append(q.fp8_dequantize(pools["t1_k"][pg, h, sl], pools["t1_ks"][pg, h, sl]))
        vs.append(q.fp8_dequantize(pools["t1_v"][pg, h, sl], pools["t1_vs"][pg, h, sl]))
    for pi in range(tables["t2_np"][b]):
        pg = tables["t2_table"][b, pi]
        pos.extend(pools["t2_pos"][pg, h])
        ks.append(q.q2_dequantize(pools["t2_k"][pg, h][None], pools["t2_kmu"][pg, h][None], pools["t2_ksig"][pg, h][None], axis=-2)[0])
        vs.append(q.q2_dequantize(pools["t2_v"][pg, h][None], pools["t2_vmu"][pg, h][None], pools["t2_vsig"][pg, h][None], axis=-1)[0])
    k = np.concatenate([np.atleast_2d(x) for x in ks])
    v = np.concatenate([np.atleast_2d(x) for x in vs])
    return np.array(pos), k, v


def test_append_decode_rerank_cycle():
    rng = np.random.default_rng(0)
    append = _build("tiered_append", make_tiered_append(HKV, D, PS1))
    decode = _build("tiered_decode", make_tiered_decode(H, HKV, D, PS1, PS2))
    rerank_mod = tvm.compile(tvm.IRModule(make_tiered_rerank(HKV, D, PS1, PS2, SINK, RECENT)), target="llvm")

    def rerank(*args):
        call_rerank(rerank_mod.__getitem__, args[:-1], args[-1])
    pt = TieredPageTables(P1, P2, PS1, PS2, max_sequences=2, tier1_fraction=0.25, sink=SINK, recent=RECENT)
    pools = {
        "t1_k": np.zeros((P1, HKV, PS1, D), np.uint8), "t1_v": np.zeros((P1, HKV, PS1, D), np.uint8),
        "t1_ks": np.zeros((P1, HKV, PS1), np.float16), "t1_vs": np.zeros((P1, HKV, PS1), np.float16),
        "t1_pos": np.zeros((P1, HKV, PS1), np.int32), "t1_mass": np.zeros((P1, HKV, PS1), np.float32),
        "t2_k": np.zeros((P2, HKV, PS2, D // 4), np.uint8), "t2_v": np.zeros((P2, HKV, PS2, D // 4), np.uint8),
        "t2_kmu": np.zeros((P2, HKV, D), np.float16), "t2_ksig": np.ones((P2, HKV, D), np.float16),
        "t2_vmu": np.zeros((P2, HKV, PS2), np.float16), "t2_vsig": np.ones((P2, HKV, PS2), np.float16),
        "t2_pos": np.zeros((P2, HKV, PS2), np.int32),
    }
    dev = tvm.cpu()
    dp = {k: tvm.runtime.tensor(v[None], dev) for k, v in pools.items()}  # one layer
    seqs = [pt.add_sequence(), pt.add_sequence()]

    def put(slot, n):  # append n random tokens to one sequence
        start = pt.seqs[slot].length
        pt.append({slot: n})
        k = rng.standard_normal((n, HKV, D)).astype(np.float32)
        v = rng.standard_normal((n, HKV, D)).astype(np.float32)
        args = [k, v, pt.append_slots(slot, n), np.arange(start, start + n, dtype=np.int32)]
        append(*[tvm.runtime.tensor(a, dev) for a in args],
               *[dp[x] for x in ("t1_k", "t1_v", "t1_ks", "t1_vs", "t1_pos", "t1_mass")], 0)

    put(seqs[0], 70)
    put(seqs[1], 40)
    reranks = 0
    for step in range(60):
        for s in seqs:
            put(s, 1)
        tab = pt.tables(seqs)
        qv = rng.standard_normal((2, H, D)).astype(np.float32)
        out = np.zeros((2, H, D), np.float32)
        ws = [tvm.runtime.tensor(np.zeros(shape, dtype), dev) for shape, dtype in
              decode_workspaces(2, H, HKV, tab["t1_table"].shape[1], PS1, tab["t2_table"].shape[1], PS2, D)]
        targs = [tvm.runtime.tensor(a, dev) for a in (tab["t1_table"], tab["t1_len"], tab["t2_table"], tab["t2_np"])]
        o = tvm.runtime.tensor(out, dev)
        decode(tvm.runtime.tensor(qv, dev), *[dp[x] for x in ("t1_k", "t1_v", "t1_ks", "t1_vs", "t2_k", "t2_v", "t2_kmu",
                                                               "t2_ksig", "t2_vmu", "t2_vsig")],
               *targs, o, dp["t1_mass"], *ws, 0, D**-0.5)
        host = {k: v.numpy()[0] for k, v in dp.items()}
        for b in range(2):  # the output is attention over exactly what the pools hold
            for h in range(HKV):
                pos, k, v = _dequantized(host, tab, b, h)
                assert sorted(pos.tolist()) == list(range(tab["length"][b]))  # every token once, none lost
                assert set(range(SINK)) | set(range(tab["length"][b] - RECENT, tab["length"][b])) <= \
                    set(pos[: tab["t1_len"][b]].tolist())  # sinks and recent window in tier 1
                for g in range(H // HKV):
                    hq = h * (H // HKV) + g
                    sc = k @ qv[b, hq] * D**-0.5
                    p = np.exp(sc - sc.max())
                    np.testing.assert_allclose(o.numpy()[b, hq], (p / p.sum()) @ v, rtol=1e-4, atol=1e-5)
        if step % 4 == 3:  # re-rank: tables before the plan, then the kernel
            plans = {s: pt.plan_rerank(s) for s in seqs}
            demote = np.array([plans[s].demote for s in seqs], np.int32)
            if demote.any():
                reranks += 1
                width = max([len(plans[s].new_t2_pages) for s in seqs] + [1])
                new = np.zeros((2, width), np.int32)
                for i, s in enumerate(seqs):
                    new[i, : len(plans[s].new_t2_pages)] = plans[s].new_t2_pages
                m = tab["t1_table"].shape[1] * PS1
                rerank(*[dp[x] for x in ("t1_k", "t1_v", "t1_ks", "t1_vs", "t1_pos", "t1_mass", "t2_k", "t2_v", "t2_kmu",
                                         "t2_ksig", "t2_vmu", "t2_vsig", "t2_pos")],
                       *[tvm.runtime.tensor(a, dev) for a in (tab["t1_table"], tab["t1_len"], tab["length"], demote, new,
                                                               *workspaces(2, HKV, m))], 0)
            pt.check()
    assert reranks >= 3 and all(len(pt.seqs[s].t2_pages) > 0 for s in seqs)
