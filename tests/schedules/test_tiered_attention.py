"""Ragged-query attention over the tiered cache (prefill path) and its importance column sums (llvm)."""

import numpy as np
import pytest
import tvm

from moec.compiler.targets import make_target
from moec.schedules.kernels import reference as ref
from moec.schedules.kernels.tiered_attention import make_tiered_attention, make_tiered_mass

from moec_testing import require_cuda

H, HKV, D, PS1, PS2 = 4, 2, 32, 16, 32
P1, P2 = 24, 10


@pytest.fixture(scope="module")
def kernels():
    mod = tvm.IRModule({"tiered_attention": make_tiered_attention(H, HKV, D, PS1, PS2),
                        "tiered_mass": make_tiered_mass(H, HKV, D, PS1)})
    return tvm.compile(mod, target="llvm")


def _case(seed, t1_lens, t2_pages, new):
    """Rows whose tier 1 ends with ``new[b]`` chunk tokens; a query for each chunk token."""
    rng = np.random.default_rng(seed)
    kv = []
    for n1, n2 in zip(t1_lens, t2_pages):
        k = rng.standard_normal((HKV, n1 + n2 * PS2, D)).astype(np.float32) * 2
        kv.append((k, rng.standard_normal(k.shape).astype(np.float32)))
    pools, tables, deq, slots = ref.fill_pools(kv, t1_lens, P1, P2, PS1, PS2, rng)
    q_row, q_t1 = [], []
    for b, (n1, m) in enumerate(zip(t1_lens, new)):
        q_row += [b] * m
        q_t1 += list(range(n1 - m + 1, n1 + 1))
    qv = rng.standard_normal((len(q_row), H, D)).astype(np.float32)
    indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    return qv, pools, tables, deq, slots, np.array(q_row, np.int32), np.array(q_t1, np.int32), indptr


CASES = [(0, [37, 20, 16], [2, 0, 1], [5, 20, 1]), (1, [64], [3], [33])]
# the CUDA forms' tiles: rows with more queries than a query tile (32) and more tier-1 tokens than a key tile (32)
GPU_CASES = CASES + [(2, [150, 3, 97], [4, 1, 0], [70, 3, 97]), (3, [40, 200], [0, 2], [1, 130])]


@pytest.mark.parametrize("seed,t1_lens,t2_pages,new", CASES)
def test_attention_and_mass_against_numpy(kernels, seed, t1_lens, t2_pages, new):
    _check(kernels, tvm.cpu(), seed, t1_lens, t2_pages, new)


@pytest.fixture(scope="module")
def cuda_kernels():
    require_cuda()
    mod = tvm.IRModule({"tiered_attention": make_tiered_attention(H, HKV, D, PS1, PS2, target="cuda"),
                        "tiered_mass": make_tiered_mass(H, HKV, D, PS1, target="cuda")})
    return tvm.compile(mod, target=make_target("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("seed,t1_lens,t2_pages,new", GPU_CASES)
def test_cuda_attention_and_mass_against_numpy(cuda_kernels, seed, t1_lens, t2_pages, new):
    _check(cuda_kernels, tvm.cuda(), seed, t1_lens, t2_pages, new, tol=1e-4)


def _check(kernels, dev, seed, t1_lens, t2_pages, new, tol=1e-5):
    qv, pools, tables, deq, slots, q_row, q_t1, indptr = _case(seed, t1_lens, t2_pages, new)
    scale = D**-0.5
    lp = {k: ref.layered(pools[k]) for k in ref.POOL_ORDER}
    n = len(q_row)
    out = tvm.runtime.tensor(np.zeros((n, H, D), np.float32), dev)
    stats = tvm.runtime.tensor(np.zeros((n, H, 2), np.float32), dev)
    t = lambda a: tvm.runtime.tensor(a, dev)  # noqa: E731
    kernels["tiered_attention"](t(qv), *[t(lp[k]) for k in ref.POOL_ORDER], t(tables["t1_table"]), t(tables["t2_table"]),
                                t(tables["t2_np"]), t(q_row), t(q_t1), t(indptr), out, stats, ref.LAYER, scale)
    mass0 = ref.layered(np.random.default_rng(5).random((P1, HKV, PS1)).astype(np.float32))
    mass = t(mass0.copy())
    kernels["tiered_mass"](t(qv), t(lp["t1_k"]), t(lp["t1_ks"]), t(tables["t1_table"]), t(q_t1), t(indptr), stats, mass,
                           ref.LAYER, scale)
    want_mass = mass0[ref.LAYER].astype(np.float64)
    for j in range(n):
        b = q_row[j]
        kd, vd = deq[b]
        n1 = t1_lens[b]
        vis = np.r_[0:q_t1[j], n1:kd.shape[1]]
        want, p = ref.attention(qv[j], kd[:, vis], vd[:, vis], scale)
        np.testing.assert_allclose(out.numpy()[j], want, rtol=tol, atol=tol)
        per_kv = p.reshape(HKV, -1, p.shape[-1]).sum(1)
        for col in range(q_t1[j]):
            pg, sl = slots[b][col]
            want_mass[pg, :, sl] += per_kv[:, col]
    got = mass.numpy()
    np.testing.assert_array_equal(got[0], mass0[0])
    np.testing.assert_allclose(got[ref.LAYER], want_mass, rtol=tol, atol=tol / 10)
    # every query's probabilities sum to one: the stats describe the same softmax the output used
    assert np.isfinite(stats.numpy()).all() and (stats.numpy()[..., 1] >= 1 - 1e-6).all()


def test_cuda_forms_compile():
    mod = tvm.IRModule({"tiered_attention": make_tiered_attention(16, 16, 128, 16, 128, target="cuda"),
                        "tiered_mass": make_tiered_mass(16, 16, 128, 16, target="cuda")})
    src = tvm.compile(mod, target=make_target("cuda")).mod.imports[0].inspect_source()
    import re

    # tiled: 128 threads (32 queries / tier-1 tokens x 4 per head dim) with the key / query tiles in shared memory
    assert set(re.findall(r"__launch_bounds__\((\d+)\) (\w+)_kernel\(", src)) == {("128", "tiered_attention"), ("128", "tiered_mass")}
    assert "__shared__ alignas(64) float ks_s" in src and "__shared__ alignas(64) float qs_s" in src
    assert "__shfl_xor_sync" in src and "atomicAdd" not in src
