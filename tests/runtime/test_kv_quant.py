"""Tier formats of the KV cache: round-trip error bounds, packing layout, byte budget."""

import ml_dtypes
import numpy as np
import pytest

from moec.runtime import kv_quant as q


def test_fp8_round_trip_error_bound():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4, 128)).astype(np.float32) * rng.uniform(0.01, 50, (64, 4, 1)).astype(np.float32)
    codes, scale = q.fp8_quantize(x)
    assert codes.dtype == np.uint8 and codes.shape == x.shape and scale.shape == x.shape[:-1] and scale.dtype == np.float16
    y = q.fp8_dequantize(codes, scale)
    s = scale.astype(np.float32)[..., None]
    # e4m3: 3 mantissa bits -> half-ulp relative error 2^-4 for normals; subnormal step 2^-9 (times the scale)
    assert np.all(np.abs(y - x) <= np.maximum(np.abs(x) * 2**-4, s * 2**-10) * 1.0001 + 1e-12)
    # the scale maps each vector's max to the top of the e4m3 range (no overflow, no NaN)
    assert np.isfinite(y).all() and np.abs(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)).max() <= 448


def test_pack2_layout():
    codes = np.array([[1, 2, 3, 0, 3, 3, 3, 3]], np.uint8)
    packed = q.pack2(codes)
    assert packed.tolist() == [[1 | 2 << 2 | 3 << 4, 255]]  # channel 4j+i in bits 2i..2i+1 of byte j
    rng = np.random.default_rng(1)
    c = rng.integers(0, 4, (3, 5, 64)).astype(np.uint8)
    assert np.array_equal(q.unpack2(q.pack2(c)), c)


def test_q2_is_the_nearest_level_and_gaussian_mse():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 128, 128)).astype(np.float32) * 3 + 1
    packed, mu, sigma = q.q2_quantize(x, axis=-2)
    assert packed.shape == (8, 128, 32) and mu.shape == (8, 128) and sigma.shape == (8, 128)
    z = (x - mu.astype(np.float32)[:, None]) / sigma.astype(np.float32)[:, None]
    nearest = np.abs(z[..., None] - q.Q2_LEVELS).argmin(-1)
    assert np.array_equal(q.unpack2(packed), nearest)
    y = q.q2_dequantize(packed, mu, sigma, axis=-2)
    assert ((y - x) ** 2).mean() / x.var() < 0.125  # the uniform 4-level quantizer of a Gaussian: 0.1188


def test_keys_per_channel_keep_outlier_channels():
    rng = np.random.default_rng(3)
    k = rng.standard_normal((2, 128, 64)).astype(np.float32)
    k[:, :, 5] = k[:, :, 5] * 40 + 100  # an outlier channel
    y = q.q2_dequantize(*q.quantize_keys_2bit(k), axis=-2)
    rel = ((y - k) ** 2).mean(axis=1) / k.var(axis=1)  # per head and channel
    assert rel.max() < 0.2
    v = rng.standard_normal((2, 128, 64)).astype(np.float32) * rng.uniform(0.1, 10, (2, 128, 1)).astype(np.float32)
    yv = q.q2_dequantize(*q.quantize_values_2bit(v), axis=-1)
    assert (((yv - v) ** 2).mean(-1) / v.var(-1)).max() < 0.25  # per token


def test_bytes_per_element_budget():
    b = q.bytes_per_element(0.15, head_dim=128, page_tokens=128)
    assert b["blend"] <= 0.4 and b["tier1"] == pytest.approx(1 + 2 / 128)
    assert b["bf16"] / b["blend"] > 5


def test_lloyd_fit_lowers_the_2bit_error_of_heavy_tails():
    rng = np.random.default_rng(5)
    x = rng.standard_t(3, size=(8, 128, 64)).astype(np.float32)
    for axis in (-2, -1):
        err = {}
        for fit in q.FITS:
            y = q.q2_dequantize(*q.q2_quantize(x, axis, fit=fit), axis=axis)
            err[fit] = float(((y - x) ** 2).mean())
        assert err["lloyd"] < 0.9 * err["moments"], err
    a = q.q2_quantize(x, -1, fit="lloyd", iters=0)  # no refits: the moments format
    b = q.q2_quantize(x, -1)
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    with pytest.raises(ValueError, match="unknown 2-bit fit"):
        q.q2_quantize(x, -1, fit="kmeans")
