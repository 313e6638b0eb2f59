"""Number formats of the tiered KV cache, in NumPy: the reference every kernel is checked against.

Tier 1 — FP8 e4m3 with one scale per (token, KV head):
    scale = max(|x|) / 448 over the head's Dh channels (float16, at least 2^-24);
    code  = e4m3(x / scale), stored as its byte (uint8).
    Bytes per element: 1 + 2 / Dh.

Tier 2 — 2-bit codes on a uniform grid with per-block mean and standard deviation:
    levels = (-3, -1, +1, +3) * 255 / 512 = (-1.494, -0.498, +0.498, +1.494) (the uniform 4-level quantizer
    of a unit Gaussian, step 0.996 against the optimal 0.9957; decision thresholds -0.996, 0, +0.996);
    x ≈ mu + sigma * levels[code]. A uniform grid makes the level an affine function of the code's
    2-bit integer, which the CUDA decode kernel dequantizes with one logic op and one FMA (see
    ``schedules.kernels.tiered_decode``); its squared error on a Gaussian is 1% above the non-uniform
    Lloyd-Max levels (+-0.4528, +-1.5104) after the least-squares fit below.
    Keys are quantized per channel (mu, sigma over the tokens of one tier-2 page, for each KV head and
    channel: outlier channels keep their own range, as KIVI found); values per token (mu, sigma over
    the Dh channels of one token and KV head). mu and sigma are float16.
    Codes are packed 4 per byte along the channel axis, channel 4j + i in bits 2i..2i+1 of byte j.
    Bytes per element: 0.25 + (keys) 4 / page_tokens + (values) 4 / Dh, halved between K and V.

Quantization works on float32 and returns NumPy arrays; ``*_dequantize`` returns float32.
"""

from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0
Q2_STEP = 255 / 256  # exact in float32, as are the levels and thresholds below
Q2_LEVELS = np.array([-1.5, -0.5, 0.5, 1.5], dtype=np.float32) * np.float32(Q2_STEP)
Q2_THRESHOLDS = np.array([-1.0, 0.0, 1.0], dtype=np.float32) * np.float32(Q2_STEP)
_MIN_SCALE = np.float32(2.0**-24)


def _e4m3():
    import ml_dtypes

    return ml_dtypes.float8_e4m3fn


def fp8_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x[..., Dh]`` -> ``(codes uint8 [..., Dh], scale float16 [...])``, one scale per vector."""
    x = np.asarray(x, dtype=np.float32)
    scale = np.maximum(np.abs(x).max(-1) / E4M3_MAX, _MIN_SCALE).astype(np.float16)
    codes = (x / scale.astype(np.float32)[..., None]).astype(_e4m3()).view(np.uint8)
    return codes, scale


def fp8_dequantize(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return codes.view(_e4m3()).astype(np.float32) * scale.astype(np.float32)[..., None]


def pack2(codes: np.ndarray) -> np.ndarray:
    """2-bit codes ``[..., D]`` (D divisible by 4) -> bytes ``[..., D/4]``."""
    c = codes.astype(np.uint8).reshape(*codes.shape[:-1], -1, 4)
    return (c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)).astype(np.uint8)


def unpack2(packed: np.ndarray) -> np.ndarray:
    p = packed[..., None] >> np.array([0, 2, 4, 6], dtype=np.uint8)
    return (p & 3).reshape(*packed.shape[:-1], -1)


def _q2_codes(z: np.ndarray) -> np.ndarray:
    return np.searchsorted(Q2_THRESHOLDS, z, side="right").astype(np.uint8)


FITS = ("moments", "lloyd")


def q2_quantize(x: np.ndarray, axis: int, fit: str = "moments",
                 iters: int = 3) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """2-bit codes of ``x[..., T, Dh]`` with mu/sigma over ``axis`` (-2: per channel, -1: per token).

    Returns ``(packed uint8 [..., T, Dh/4], mu float16, sigma float16)`` where mu/sigma have ``axis``
    reduced away. ``fit="moments"`` (the cache's format today) takes mu and sigma as the block's mean
    and standard deviation, optimal for Gaussian data. ``fit="lloyd"`` then alternates ``iters`` times
    between coding with (mu, sigma) and refitting (mu, sigma) by least squares to the codes' levels,
    the squared-error-optimal affine fit of the grid for the block's own distribution (the
    dequantization is unchanged, so only the quantizer differs).
    """
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % 4:
        raise ValueError(f"2-bit packing needs Dh divisible by 4, got {x.shape[-1]}")
    if fit not in FITS:
        raise ValueError(f"unknown 2-bit fit {fit!r}; known: {', '.join(FITS)}")
    mu = x.mean(axis=axis).astype(np.float16)
    sigma = np.maximum(x.std(axis=axis), _MIN_SCALE).astype(np.float16)

    def codes(mu, sigma):
        z = (x - np.expand_dims(mu.astype(np.float32), axis)) / np.expand_dims(sigma.astype(np.float32), axis)
        return _q2_codes(z)

    c = codes(mu, sigma)
    for _ in range(iters if fit == "lloyd" else 0):
        lv = Q2_LEVELS[c].astype(np.float64)
        lm, xm = lv.mean(axis=axis, keepdims=True), x.mean(axis=axis, keepdims=True, dtype=np.float64)
        var = ((lv - lm) ** 2).mean(axis=axis)
        cov = ((lv - lm) * (x - xm)).mean(axis=axis)
        ok = var > 1e-12  # a block whose codes are all equal keeps its moments
        s = np.where(ok, cov / np.where(ok, var, 1.0), sigma.astype(np.float64))
        s = np.maximum(s, float(_MIN_SCALE))
        m = np.where(ok, np.squeeze(xm - np.expand_dims(s, axis) * lm, axis), mu.astype(np.float64))
        mu, sigma = m.astype(np.float16), s.astype(np.float16)
        c = codes(mu, sigma)
    return pack2(c), mu, sigma


def q2_dequantize(packed: np.ndarray, mu: np.ndarray, sigma: np.ndarray, axis: int) -> np.ndarray:
    z = Q2_LEVELS[unpack2(packed)]
    return np.expand_dims(mu.astype(np.float32), axis) + np.expand_dims(sigma.astype(np.float32), axis) * z


def quantize_keys_2bit(k: np.ndarray, fit: str = "moments"):
    """Keys of one tier-2 page ``[Hkv, T, Dh]``: per-channel statistics over the T tokens."""
    return q2_quantize(k, axis=-2, fit=fit)


def quantize_values_2bit(v: np.ndarray, fit: str = "moments"):
    """Values ``[Hkv, T, Dh]``: per-token statistics over the Dh channels."""
    return q2_quantize(v, axis=-1, fit=fit)


def bytes_per_element(tier1_fraction: float, head_dim: int, page_tokens: int) -> dict:
    """Bytes per cached K/V element of each tier and of the blend (codes plus scales)."""
    t1 = 1.0 + 2.0 / head_dim
    t2 = 0.25 + 0.5 * (4.0 / page_tokens + 4.0 / head_dim)
    return {"tier1": t1, "tier2": t2, "blend": tier1_fraction * t1 + (1 - tier1_fraction) * t2, "bf16": 2.0}
