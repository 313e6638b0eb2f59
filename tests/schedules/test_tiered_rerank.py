"""Re-rank kernel (llvm build) against the NumPy reference: selection, 2-bit pages, tier-1 compaction."""

import numpy as np
import pytest
import tvm

from moec.schedules.kernels import reference as ref
from moec.schedules.kernels.tiered_rerank import RERANK_KERNELS, call_rerank, make_tiered_rerank, workspaces

HKV, D, PS1, PS2, SINK, RECENT = 2, 32, 16, 32, 2, 8
P1, P2 = 16, 8


def _case(seed):
    rng = np.random.default_rng(seed)
    n1s, old_t2, demote = [90, 70], [2, 0], np.array([64, 32], np.int32)
    kv = [(rng.standard_normal((HKV, n, D)).astype(np.float32) * 3, rng.standard_normal((HKV, n, D)).astype(np.float32)) for n in n1s]
    pools, tables, _, _ = ref.fill_pools(kv, n1s, P1, P2, PS1, PS2, rng)
    length = np.array([n + t * PS2 for n, t in zip(n1s, old_t2)], np.int32)
    pools["t1_pos"] = np.full((P1, HKV, PS1), -1, np.int32)
    pools["t1_mass"] = np.zeros((P1, HKV, PS1), np.float32)
    pools["t2_pos"] = np.full((P2, HKV, PS2), -1, np.int32)
    for b, n in enumerate(n1s):
        for h in range(HKV):
            middle = rng.choice(np.arange(SINK, length[b] - RECENT), size=n - SINK - RECENT, replace=False)
            pos = rng.permutation(np.concatenate([np.arange(SINK), middle, np.arange(length[b] - RECENT, length[b])]))
            for i in range(n):
                pg, sl = tables["t1_table"][b, i // PS1], i % PS1
                pools["t1_pos"][pg, h, sl] = pos[i]
                pools["t1_mass"][pg, h, sl] = rng.uniform(0.01, 2.0)
    free2 = [p for p in range(P2) if p not in set(tables["t2_table"][0, :old_t2[0]])]
    new_t2 = np.array([free2[:2], free2[2:4]], np.int32)
    return pools, tables, length, demote, new_t2


# threads: 512 runs every new page's key statistics side by side (16 pages of D channels); 32 runs them one page
# after another (the loop over a thread's pages), 64 two at a time
# stage 0: the form that gathers step 3's rows from global memory (pages too large to stage in shared memory)
@pytest.fixture(scope="module", params=[("mass", "moments", 512), ("keynorm", "moments", 512), ("mass", "lloyd", 512),
                                        ("mass", "lloyd", 32), ("mass", "moments", 64), ("mass", "lloyd", 512, 0),
                                        ("mass", "moments", 32, 0)])
def kernel(request):
    importance, fit, threads, *stage = request.param
    funcs = make_tiered_rerank(HKV, D, PS1, PS2, SINK, RECENT, importance=importance, fit=fit, threads=threads,
                               **({"stage_bytes": stage[0]} if stage else {}))
    return tvm.compile(tvm.IRModule(funcs), target="llvm"), request.param[:2]


ORDER = ("t1_k", "t1_v", "t1_ks", "t1_vs", "t1_pos", "t1_mass", "t2_k", "t2_v", "t2_kmu", "t2_ksig", "t2_vmu", "t2_vsig", "t2_pos")


@pytest.mark.parametrize("seed", [0, 1])
def test_rerank_matches_reference(kernel, seed):
    kernel, (importance, fit) = kernel

    def run(host):
        tv = [tvm.runtime.tensor(a, tvm.cpu()) for a in host]
        call_rerank(kernel.__getitem__, tv, ref.LAYER)
        return [t.numpy() for t in tv]

    _check(run, seed, importance, fit)


@pytest.mark.parametrize("fit,threads", [("lloyd", 512), ("moments", 64)])
def test_cuda_form_emulated(fit, threads):
    """The CUDA form (shared-memory staging and barriers; the ranking and the compaction a block per sequence and
    KV head, the packing a block per new page too) run on the CPU emulation of the generated code (tests/cuda_emu.py)."""
    from cuda_emu import EmulatedKernel

    from moec.compiler.targets import make_target

    funcs = make_tiered_rerank(HKV, D, PS1, PS2, SINK, RECENT, target="cuda", fit=fit, threads=threads)
    src = tvm.compile(tvm.IRModule(funcs), target=make_target("cuda")).mod.imports[0].inspect_source()
    kerns = [EmulatedKernel(src, f"{name}_kernel") for name in RERANK_KERNELS]
    import re

    # the packing's block: 4 threads a statistics group (channel or token) when the page is staged
    pack_threads = int(re.search(r"__launch_bounds__\((\d+)\) tiered_rerank_pack_kernel\(", src).group(1))
    assert pack_threads == 4 * max(D, PS2)
    names = ORDER + ("t1_table", "t1_len", "length", "demote", "new_t2", "score", "rank", "order", "posw")

    def run(host):
        host = [np.ascontiguousarray(a) for a in host]
        m1, mn = host[len(ORDER)].shape[1], host[len(ORDER) + 4].shape[1]
        nt, slots = max(threads, D), -(-m1 * PS1 // max(threads, D))  # the slot launches' third axis: NT slots a block
        grids = {"score": slots, "rank": slots, "order": slots, "pack": mn, "compact": 1}
        for kern, name in zip(kerns, RERANK_KERNELS):
            phase = name.rsplit("_", 1)[1]
            grid, block = (2, HKV, grids[phase]), pack_threads if phase == "pack" else nt
            kern(grid, block, **dict(zip(names, host)), layer=ref.LAYER, B=2, M1=m1, MN=mn, P1=P1, P2=P2)
        return host

    _check(run, 0, "mass", fit)


def _check(run, seed, importance, fit):
    pools, tables, length, demote, new_t2 = _case(seed)
    want = ref.rerank_reference(pools, tables, length, demote, new_t2, SINK, RECENT, importance, fit)
    if fit == "lloyd":  # the refit statistics differ from the moments (so the comparison below can tell)
        other = ref.rerank_reference(pools, tables, length, demote, new_t2, SINK, RECENT, importance)
        pg = new_t2[0, 0]
        assert np.abs(other["t2_ksig"][pg].astype(np.float32) / want["t2_ksig"][pg].astype(np.float32) - 1).max() > 0.01
    m1 = tables["t1_table"].shape[1]
    host = [ref.layered(pools[k]) for k in ORDER] + [tables["t1_table"], tables["t1_len"], length, demote, new_t2,
                                                     *workspaces(2, HKV, m1 * PS1)]
    out = run([a.copy() for a in host])
    got = {k: out[i] for i, k in enumerate(ORDER)}
    for i, k in enumerate(ORDER):
        np.testing.assert_array_equal(got[k][0], host[i][0], err_msg=f"{k}: another layer changed")
    got = {k: v[ref.LAYER] for k, v in got.items()}
    for b in range(2):
        keep = int(tables["t1_len"][b] - demote[b])
        loc = [(tables["t1_table"][b, i // PS1], i % PS1) for i in range(keep)]
        for name in ("t1_k", "t1_v", "t1_ks", "t1_vs", "t1_pos", "t1_mass"):  # compacted tier 1: exact copies
            g = np.stack([got[name][pg, :, sl] for pg, sl in loc])
            w = np.stack([want[name][pg, :, sl] for pg, sl in loc])
            np.testing.assert_array_equal(g, w, err_msg=f"{name} seq {b}")
        for pg in new_t2[b, : demote[b] // PS2]:
            np.testing.assert_array_equal(got["t2_pos"][pg], want["t2_pos"][pg])
            for name in ("t2_kmu", "t2_ksig", "t2_vmu", "t2_vsig"):
                np.testing.assert_allclose(got[name][pg].astype(np.float32), want[name][pg].astype(np.float32), rtol=2e-3, atol=1e-4)
            for name in ("t2_k", "t2_v"):  # codes: a flip needs a value within float rounding of a threshold
                assert (got[name][pg] != want[name][pg]).mean() < 0.01, name
    # sinks and the recent window stayed in tier 1, and tier 1 holds exactly the kept tokens
    for b in range(2):
        keep = int(tables["t1_len"][b] - demote[b])
        for h in range(HKV):
            kept = {int(got["t1_pos"][tables["t1_table"][b, i // PS1], h, i % PS1]) for i in range(keep)}
            assert set(range(SINK)) <= kept and set(range(length[b] - RECENT, length[b])) <= kept
            moved = {int(p) for pg in new_t2[b, : demote[b] // PS2] for p in got["t2_pos"][pg, h]}
            assert not kept & moved and len(kept) + len(moved) == tables["t1_len"][b]


def test_cuda_form_compiles():
    from moec.compiler.targets import make_target

    for fit in ("moments", "lloyd"):
        ex = tvm.compile(tvm.IRModule(make_tiered_rerank(16, 128, 16, 128, 4, 64, target="cuda", fit=fit)),
                         target=make_target("cuda"))
        assert "__syncthreads" in ex.mod.imports[0].inspect_source()


def test_rerank_bench_inputs_and_calls_on_cpu(monkeypatch):
    """bench/tiered_rerank.py's inputs (argument order, workspaces) run through the llvm build's five launches on a
    small shape: every row demotes its pages, tier 1 stays a permutation of its positions, and the bench's check
    passes against itself."""
    import importlib.util
    from pathlib import Path

    from moec.runtime.kv_cache import POOLS

    path = Path(__file__).resolve().parents[2] / "bench" / "tiered_rerank.py"
    spec = importlib.util.spec_from_file_location("moec_bench_tiered_rerank", path)
    tr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tr)
    for name, value in (("HKV", HKV), ("D", D), ("PS1", PS1), ("PS2", PS2), ("SINK", SINK), ("RECENT", RECENT)):
        monkeypatch.setattr(tr, name, value)
    mod = tvm.compile(tvm.IRModule(make_tiered_rerank(HKV, D, PS1, PS2, SINK, RECENT, fit="lloyd")), target="llvm")
    host = tr._inputs(3, np.random.default_rng(0), context=400, t1=96, pages=2)
    assert len(host) == len(POOLS) + 5 + 4 and len(tr._inputs(1, np.random.default_rng(0), 400, 96, 1, posw=False)) == len(host) - 1
    args = [tvm.runtime.tensor(a) for a in host]
    call_rerank(mod.__getitem__, args, 0)
    out = {n: args[i].numpy() for i, n in enumerate(POOLS)}
    assert tr._check(out, out)["passed"]
    keep = 96 - 2 * PS2
    for b in range(3):
        for h in range(HKV):
            kept = out["t1_pos"][0, host[len(POOLS)][b], h].reshape(-1)[:keep]
            moved = out["t2_pos"][0, host[len(POOLS) + 4][b], h].reshape(-1)
            before = host[POOLS.index("t1_pos")][0, host[len(POOLS)][b], h].reshape(-1)
            assert sorted(kept.tolist() + moved.tolist()) == sorted(before.tolist())


def test_bench_side_imports_without_the_script_layer():
    # the GPU machine's runtime-only TVM has no working tvm.script: the kernels' modules must still give the
    # bench their workspaces, launch names and shapes (a failed import there cost a device run)
    import subprocess
    import sys

    code = ("import sys; sys.modules['tvm.script'] = None\n"
            "from moec.schedules.kernels import grouped_experts, tiered_decode, tiered_rerank\n"
            "assert tiered_rerank.T is None and tiered_decode.T is None and grouped_experts.T is None\n"
            "assert [w.shape for w in tiered_rerank.workspaces(2, 3, 4)] == [(2, 3, 4), (2, 3, 4), (2, 3, 8), (2, 3, 4)]\n"
            "assert len(tiered_rerank.RERANK_KERNELS) == 5 and tiered_decode.decode_splits(4, 2, 3, 16, 2) >= 1\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_kernel_factories_parse_once_per_arguments():
    """The re-rank's kernels (most of a small model's TVMScript parsing) are built once a process for the same
    arguments: the same functions come back in a fresh dict, other arguments give other functions, and an argument
    that cannot be hashed builds afresh."""
    from moec.schedules.kernels import memoized

    a = make_tiered_rerank(2, 16, 16, 32, 4, 8)
    b = make_tiered_rerank(2, 16, 16, 32, 4, 8)
    assert a is not b and a.keys() == b.keys() and all(a[k].same_as(b[k]) for k in a)
    a.clear()  # the caller's copy: the memo keeps its own
    assert make_tiered_rerank(2, 16, 16, 32, 4, 8).keys() == b.keys()
    c = make_tiered_rerank(2, 16, 16, 32, 4, 8, fit="lloyd")
    assert not any(c[k].same_as(b[k]) for k in b)
    calls = []
    f = memoized(lambda *args, **kw: calls.append(args) or len(calls))
    assert f(1, x=2) == f(1, x=2) == 1 and f(2) == 2 and f([1]) == 3 and f([1]) == 4
    f.cache_clear()
    assert f(1, x=2) == 5
    import moec.schedules.kernels as kernels

    g = memoized(lambda n: calls.append(n) or len(calls))
    first = [g(n) for n in range(kernels.MEMO_SIZE)]
    assert g(0) == first[0]  # 0 is now the most recently used
    g(-1)  # one past the bound: 1, the least recently used, goes
    assert g(0) == first[0] and g(2) == first[2] and g(1) != first[1]
