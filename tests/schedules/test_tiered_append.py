"""Quantize-and-append kernel: bytes identical to the NumPy/ml_dtypes tier-1 format, slots and positions."""

import ml_dtypes
import numpy as np
import pytest
import tvm

from moec.compiler.targets import make_target
from moec.runtime import kv_quant as q
from moec.schedules.kernels import reference as ref
from moec.schedules.kernels.tiered_append import make_tiered_append

HKV, D, PS1, P1 = 2, 32, 16, 8


@pytest.fixture(scope="module")
def kernel():
    return tvm.compile(tvm.IRModule({"tiered_append": make_tiered_append(HKV, D, PS1)}), target="llvm")


def _run(kernel, k, v, slots, pos):
    dev = tvm.cpu()
    bufs = [np.zeros((P1, HKV, PS1, D), np.uint8), np.zeros((P1, HKV, PS1, D), np.uint8),
            np.zeros((P1, HKV, PS1), np.float16), np.zeros((P1, HKV, PS1), np.float16),
            np.full((P1, HKV, PS1), -1, np.int32), np.full((P1, HKV, PS1), 7.0, np.float32)]
    bufs = [ref.layered(b) for b in bufs]
    tv = [tvm.runtime.tensor(a, dev) for a in [k, v, slots, pos] + bufs]
    kernel["tiered_append"](*tv, ref.LAYER)
    got = [t.numpy() for t in tv[4:]]
    for g, b in zip(got, bufs):
        np.testing.assert_array_equal(g[0], b[0])  # other layers untouched
    return [g[ref.LAYER] for g in got]


def test_bytes_match_the_reference_format(kernel):
    rng = np.random.default_rng(0)
    n = 40
    k = (rng.standard_normal((n, HKV, D)) * rng.uniform(1e-3, 100, (n, HKV, 1))).astype(np.float32)
    v = (rng.standard_normal((n, HKV, D)) * rng.uniform(1e-3, 100, (n, HKV, 1))).astype(np.float32)
    k[3] = 0.0  # an all-zero token: smallest scale, zero codes
    slots = rng.permutation(P1 * PS1)[:n].astype(np.int32)
    pos = np.arange(100, 100 + n, dtype=np.int32)
    t1k, t1v, ks, vs, tpos, mass = _run(kernel, k, v, slots, pos)
    page, slot = slots // PS1, slots % PS1
    for src, codes, scales in ((k, t1k, ks), (v, t1v, vs)):
        want_codes, want_scale = q.fp8_quantize(src)
        np.testing.assert_array_equal(scales[page, :, slot], want_scale)
        np.testing.assert_array_equal(codes[page, :, slot], want_codes)
    np.testing.assert_array_equal(tpos[page, :, slot], np.repeat(pos[:, None], HKV, 1))
    assert (mass[page, :, slot] == 0).all()
    untouched = np.ones(P1 * PS1, bool)
    untouched[slots] = False
    assert (tpos.transpose(0, 2, 1).reshape(-1, HKV)[untouched] == -1).all()


def test_e4m3_rounding_on_every_boundary(kernel):
    # all e4m3 values, the midpoints between neighbours (ties to even) and points just off them
    vals = np.array(sorted({float(x) for x in np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
                            if np.isfinite(x) and x >= 0}), np.float32)
    mids = (vals[1:] + vals[:-1]) / 2
    xs = np.concatenate([vals, mids, np.nextafter(mids, 0), np.nextafter(mids, 1000)]).astype(np.float32)
    xs = np.concatenate([xs, -xs])
    per = D - 1  # the last channel pins every token's scale to exactly 1
    n = -(-xs.size // per)
    x = np.zeros((n * per,), np.float32)
    x[: xs.size] = xs
    k = np.full((n, HKV, D), 448.0, np.float32)
    k[:, :, :per] = x.reshape(n, 1, per)
    got = []
    for start in range(0, n, P1 * PS1):
        chunk = k[start:start + P1 * PS1]
        m = chunk.shape[0]
        t1k = _run(kernel, chunk, chunk, np.arange(m, dtype=np.int32), np.zeros(m, np.int32))[0]
        got.append(t1k.transpose(0, 2, 1, 3).reshape(-1, HKV, D)[:m])
    got = np.concatenate(got)[:, 0, :per].reshape(-1)[: xs.size]
    want = xs.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(got, want)


def test_cuda_form_compiles():
    mod = tvm.compile(tvm.IRModule({"tiered_append": make_tiered_append(16, 128, 16, target="cuda")}), target=make_target("cuda"))
    assert "tiered_append" in mod.mod.imports[0].inspect_source()


@pytest.mark.parametrize("hkv,d", [(2, 32), (16, 128), (3, 96), (40, 64)])
def test_cuda_form_emulated(hkv, d):
    """The CUDA form (a warp per token and KV head, the row's max by shuffles; 40 heads: warps take two) on the
    CPU emulation of its generated code (tests/cuda_emu.py): the reference format's bytes, an all-zero row's too."""
    from cuda_emu import EmulatedKernel

    src = tvm.compile(tvm.IRModule({"tiered_append": make_tiered_append(hkv, d, PS1, target="cuda")}),
                      target=make_target("cuda")).mod.imports[0].inspect_source()
    kern = EmulatedKernel(src, "tiered_append_kernel")
    rng = np.random.default_rng(d + hkv)
    n = 21
    k = (rng.standard_normal((n, hkv, d)) * rng.uniform(1e-3, 100, (n, hkv, 1))).astype(np.float32)
    v = (rng.standard_normal((n, hkv, d)) * rng.uniform(1e-3, 100, (n, hkv, 1))).astype(np.float32)
    k[2] = 0.0
    slots = rng.permutation(P1 * PS1)[:n].astype(np.int32)
    pos = np.arange(7, 7 + n, dtype=np.int32)
    bufs = {"t1_k": np.zeros((P1, hkv, PS1, d), np.uint8), "t1_v": np.zeros((P1, hkv, PS1, d), np.uint8),
            "t1_ks": np.zeros((P1, hkv, PS1), np.float16), "t1_vs": np.zeros((P1, hkv, PS1), np.float16),
            "t1_pos": np.full((P1, hkv, PS1), -1, np.int32), "t1_mass": np.full((P1, hkv, PS1), 7.0, np.float32)}
    bufs = {name: np.ascontiguousarray(ref.layered(b)) for name, b in bufs.items()}
    before = {name: b.copy() for name, b in bufs.items()}
    kern((n, 1, 1), 32 * min(hkv, 32), k_new=k, v_new=v, slot_of=slots, pos=pos, **bufs, N=n, P1=P1, layer=ref.LAYER)
    page, slot = slots // PS1, slots % PS1
    got = {name: b[ref.LAYER] for name, b in bufs.items()}
    for src_, codes, scales in ((k, "t1_k", "t1_ks"), (v, "t1_v", "t1_vs")):
        want_codes, want_scale = q.fp8_quantize(src_)
        np.testing.assert_array_equal(got[scales][page, :, slot], want_scale)
        np.testing.assert_array_equal(got[codes][page, :, slot], want_codes)
    np.testing.assert_array_equal(got["t1_pos"][page, :, slot], np.repeat(pos[:, None], hkv, 1))
    assert (got["t1_mass"][page, :, slot] == 0).all()
    for name, b in bufs.items():
        np.testing.assert_array_equal(b[0], before[name][0])  # another layer untouched
