"""Tiered decode attention kernel (llvm build) against NumPy over the same dequantized values."""

import numpy as np
import pytest
import tvm

from moec.runtime import kv_quant as q
from moec.schedules.kernels.tiered_decode import make_tiered_decode

H, HKV, D, PS1, PS2 = 4, 2, 32, 16, 32
P1, P2 = 20, 10


def _build_case(seed, t1_lens, t2_pages):
    rng = np.random.default_rng(seed)
    b = len(t1_lens)
    pools = {
        "t1_k": np.zeros((P1, HKV, PS1, D), np.uint8), "t1_v": np.zeros((P1, HKV, PS1, D), np.uint8),
        "t1_ks": np.ones((P1, HKV, PS1), np.float16), "t1_vs": np.ones((P1, HKV, PS1), np.float16),
        "t2_k": np.zeros((P2, HKV, PS2, D // 4), np.uint8), "t2_v": np.zeros((P2, HKV, PS2, D // 4), np.uint8),
        "t2_kmu": np.zeros((P2, HKV, D), np.float16), "t2_ksig": np.ones((P2, HKV, D), np.float16),
        "t2_vmu": np.zeros((P2, HKV, PS2), np.float16), "t2_vsig": np.ones((P2, HKV, PS2), np.float16),
    }
    m1 = max(-(-n // PS1) for n in t1_lens) or 1
    m2 = max(t2_pages) or 1
    t1_table = np.zeros((b, m1), np.int32)
    t2_table = np.zeros((b, m2), np.int32)
    free1, free2 = list(rng.permutation(P1)), list(rng.permutation(P2))
    seqs = []  # per sequence: (original K, V, dequantized K, V [Hkv, n, D], tier-1 slot locations)
    for s, (n1, n2) in enumerate(zip(t1_lens, t2_pages)):
        n = n1 + n2 * PS2
        k = rng.standard_normal((HKV, n, D)).astype(np.float32) * 2
        k[:, :, 3] += 6  # an outlier channel
        v = rng.standard_normal((HKV, n, D)).astype(np.float32)
        kd, vd = np.zeros_like(k), np.zeros_like(v)
        slots = []
        for i in range(-(-n1 // PS1)):
            t1_table[s, i] = free1.pop()
        for i in range(n1):
            page, slot = t1_table[s, i // PS1], i % PS1
            for arr, sc, src, dst in (("t1_k", "t1_ks", k, kd), ("t1_v", "t1_vs", v, vd)):
                codes, scale = q.fp8_quantize(src[:, i])
                pools[arr][page, :, slot], pools[sc][page, :, slot] = codes, scale
                dst[:, i] = q.fp8_dequantize(codes, scale)
            slots.append((page, slot))
        for pi in range(n2):
            page = t2_table[s, pi] = free2.pop()
            sl = slice(n1 + pi * PS2, n1 + (pi + 1) * PS2)
            packed, mu, sig = q.quantize_keys_2bit(k[:, sl])
            pools["t2_k"][page], pools["t2_kmu"][page], pools["t2_ksig"][page] = packed, mu, sig
            kd[:, sl] = q.nf2_dequantize(packed, mu, sig, axis=-2)
            packed, mu, sig = q.quantize_values_2bit(v[:, sl])
            pools["t2_v"][page], pools["t2_vmu"][page], pools["t2_vsig"][page] = packed, mu, sig
            vd[:, sl] = q.nf2_dequantize(packed, mu, sig, axis=-1)
        seqs.append((k, v, kd, vd, slots))
    qv = rng.standard_normal((b, H, D)).astype(np.float32)
    tables = dict(t1_table=t1_table, t1_len=np.array(t1_lens, np.int32), t2_table=t2_table, t2_np=np.array(t2_pages, np.int32))
    return qv, pools, tables, seqs, m1


def _attend(qv, k, v, scale):
    g = H // HKV
    kk, vv = np.repeat(k, g, 0), np.repeat(v, g, 0)  # H, n, D
    s = np.einsum("hd,hnd->hn", qv, kk) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hn,hnd->hd", p, vv), p


@pytest.fixture(scope="module")
def kernel():
    return tvm.compile(tvm.IRModule({"tiered_decode": make_tiered_decode(H, HKV, D, PS1, PS2)}), target="llvm")


@pytest.mark.parametrize("seed,t1_lens,t2_pages", [(0, [37, 5, 16], [2, 1, 0]), (1, [64, 1], [0, 3])])
def test_against_numpy_over_dequantized_values(kernel, seed, t1_lens, t2_pages):
    qv, pools, tables, seqs, m1 = _build_case(seed, t1_lens, t2_pages)
    scale = D**-0.5
    dev = tvm.cpu()
    mass0 = np.random.default_rng(9).random((P1, HKV, PS1)).astype(np.float32)
    args = [qv] + [pools[k] for k in ("t1_k", "t1_v", "t1_ks", "t1_vs", "t2_k", "t2_v", "t2_kmu", "t2_ksig", "t2_vmu", "t2_vsig")]
    args += [tables[k] for k in ("t1_table", "t1_len", "t2_table", "t2_np")]
    out = np.zeros((len(t1_lens), H, D), np.float32)
    scores = np.zeros((len(t1_lens), H, m1 * PS1), np.float32)
    tv = [tvm.runtime.tensor(a, dev) for a in args + [out, mass0.copy(), scores]]
    kernel["tiered_decode"](*tv, scale)
    got_out, got_mass = tv[-3].numpy(), tv[-2].numpy()
    want_mass = mass0.copy()
    for s, (k, v, kd, vd, slots) in enumerate(seqs):
        ref, p = _attend(qv[s], kd, vd, scale)
        np.testing.assert_allclose(got_out[s], ref, rtol=1e-5, atol=1e-5)  # same dequantized values: tight
        exact, _ = _attend(qv[s], k, v, scale)
        # against the unquantized cache (relative L2): FP8 alone within 8%; with 2-bit pages on random
        # data, closer than attention that ignores the keys (uniform weights) would be
        rel = np.linalg.norm(got_out[s] - exact) / np.linalg.norm(exact)
        uniform = np.repeat(v, H // HKV, 0).mean(1)
        assert rel < (0.08 if t2_pages[s] == 0 else np.linalg.norm(uniform - exact) / np.linalg.norm(exact)), rel
        per_kv = p.reshape(HKV, H // HKV, -1).sum(1)  # Hkv, n
        for i, (page, slot) in enumerate(slots):
            want_mass[page, :, slot] += per_kv[:, i]
    np.testing.assert_allclose(got_mass, want_mass, rtol=1e-5, atol=1e-6)


def test_fp8_decode_matches_ml_dtypes(kernel):
    # every e4m3 byte (but NaN) through the kernel's integer decoding: one token per page slot
    import ml_dtypes

    codes = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    n = codes.size
    got = []
    for start in range(0, n, P1):
        chunk = codes[start:start + P1]
        m = chunk.size
        v = np.zeros((P1, HKV, PS1, D), np.uint8)
        v[np.arange(m), :, 0, 0] = chunk[:, None]
        args = [np.zeros((m, H, D), np.float32), np.zeros((P1, HKV, PS1, D), np.uint8), v,
                np.ones((P1, HKV, PS1), np.float16), np.ones((P1, HKV, PS1), np.float16),
                np.zeros((P2, HKV, PS2, D // 4), np.uint8), np.zeros((P2, HKV, PS2, D // 4), np.uint8),
                np.zeros((P2, HKV, D), np.float16), np.ones((P2, HKV, D), np.float16),
                np.zeros((P2, HKV, PS2), np.float16), np.ones((P2, HKV, PS2), np.float16),
                np.arange(m, dtype=np.int32)[:, None], np.ones(m, np.int32), np.zeros((m, 1), np.int32), np.zeros(m, np.int32),
                np.zeros((m, H, D), np.float32), np.zeros((P1, HKV, PS1), np.float32), np.zeros((m, H, PS1), np.float32)]
        tv = [tvm.runtime.tensor(a, tvm.cpu()) for a in args]
        kernel["tiered_decode"](*tv, 1.0)
        got.append(tv[-3].numpy()[:, 0, 0])  # one token: the output is its value
    np.testing.assert_array_equal(np.concatenate(got), want)
