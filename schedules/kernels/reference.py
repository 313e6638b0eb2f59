"""NumPy references for the tiered-KV kernels: fill pools from float K/V, attend over dequantized values."""

from __future__ import annotations

import numpy as np

from ...runtime import kv_quant as q

POOL_ORDER = ("t1_k", "t1_v", "t1_ks", "t1_vs", "t2_k", "t2_v", "t2_kmu", "t2_ksig", "t2_vmu", "t2_vsig")
TABLE_ORDER = ("t1_table", "t1_len", "t2_table", "t2_np")


LAYERS, LAYER = 2, 1  # the tests' pools hold two layers; kernels run on layer 1 (layer 0 must stay untouched)


def layered(arr: np.ndarray, rng: np.random.Generator | None = None, layers: int = LAYERS, layer: int = LAYER) -> np.ndarray:
    """``arr`` as layer ``layer`` of a ``[layers, ...]`` pool whose other layers hold noise."""
    rng = rng or np.random.default_rng(1234)
    out = np.empty((layers,) + arr.shape, arr.dtype)
    for i in range(layers):
        if arr.dtype == np.uint8:
            out[i] = rng.integers(0, 256, arr.shape, dtype=np.uint8)
        elif arr.dtype.kind == "i":
            out[i] = rng.integers(0, 50, arr.shape).astype(arr.dtype)
        else:
            out[i] = rng.uniform(0.5, 1.5, arr.shape).astype(arr.dtype)
    out[layer] = arr
    return out


def empty_pools(p1: int, p2: int, hkv: int, d: int, ps1: int, ps2: int) -> dict[str, np.ndarray]:
    return {
        "t1_k": np.zeros((p1, hkv, ps1, d), np.uint8), "t1_v": np.zeros((p1, hkv, ps1, d), np.uint8),
        "t1_ks": np.ones((p1, hkv, ps1), np.float16), "t1_vs": np.ones((p1, hkv, ps1), np.float16),
        "t2_k": np.zeros((p2, hkv, ps2, d // 4), np.uint8), "t2_v": np.zeros((p2, hkv, ps2, d // 4), np.uint8),
        "t2_kmu": np.zeros((p2, hkv, d), np.float16), "t2_ksig": np.ones((p2, hkv, d), np.float16),
        "t2_vmu": np.zeros((p2, hkv, ps2), np.float16), "t2_vsig": np.ones((p2, hkv, ps2), np.float16),
    }


def fill_pools(kv: list[tuple[np.ndarray, np.ndarray]], t1_lens: list[int], p1: int, p2: int, ps1: int, ps2: int,
               rng: np.random.Generator):
    """Quantize each sequence's ``(K, V)`` (``[Hkv, n, D]``): its first ``t1_lens[s]`` tokens into tier-1
    pages, the rest (a whole number of tier-2 pages) into tier-2 pages, on randomly chosen page ids.

    Returns ``(pools, tables, dequantized [(K, V)], tier-1 (page, slot) per token)``.
    """
    hkv, _, d = kv[0][0].shape
    pools = empty_pools(p1, p2, hkv, d, ps1, ps2)
    t2_pages = [(k.shape[1] - n1) // ps2 for (k, _), n1 in zip(kv, t1_lens)]
    if any((k.shape[1] - n1) % ps2 for (k, _), n1 in zip(kv, t1_lens)):
        raise ValueError("tier-2 tokens must fill whole pages")
    b = len(kv)
    t1_table = np.zeros((b, max(max(-(-n // ps1) for n in t1_lens), 1)), np.int32)
    t2_table = np.zeros((b, max(max(t2_pages), 1)), np.int32)
    free1, free2 = list(rng.permutation(p1)), list(rng.permutation(p2))
    deq, slots_all = [], []
    for s, ((k, v), n1, n2) in enumerate(zip(kv, t1_lens, t2_pages)):
        kd, vd = np.zeros_like(k), np.zeros_like(v)
        slots = []
        for i in range(-(-n1 // ps1)):
            t1_table[s, i] = free1.pop()
        for i in range(n1):
            page, slot = t1_table[s, i // ps1], i % ps1
            for arr, sc, src, dst in (("t1_k", "t1_ks", k, kd), ("t1_v", "t1_vs", v, vd)):
                codes, scale = q.fp8_quantize(src[:, i])
                pools[arr][page, :, slot], pools[sc][page, :, slot] = codes, scale
                dst[:, i] = q.fp8_dequantize(codes, scale)
            slots.append((page, slot))
        for pi in range(n2):
            page = t2_table[s, pi] = free2.pop()
            sl = slice(n1 + pi * ps2, n1 + (pi + 1) * ps2)
            packed, mu, sig = q.quantize_keys_2bit(k[:, sl])
            pools["t2_k"][page], pools["t2_kmu"][page], pools["t2_ksig"][page] = packed, mu, sig
            kd[:, sl] = q.q2_dequantize(packed, mu, sig, axis=-2)
            packed, mu, sig = q.quantize_values_2bit(v[:, sl])
            pools["t2_v"][page], pools["t2_vmu"][page], pools["t2_vsig"][page] = packed, mu, sig
            vd[:, sl] = q.q2_dequantize(packed, mu, sig, axis=-1)
        deq.append((kd, vd))
        slots_all.append(slots)
    tables = {"t1_table": t1_table, "t1_len": np.array(t1_lens, np.int32), "t2_table": t2_table,
              "t2_np": np.array(t2_pages, np.int32)}
    return pools, tables, deq, slots_all


def attention(qv: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Single-token attention of ``q[H, D]`` over ``k, v[Hkv, n, D]``: ``(out[H, D], probs[H, n])``."""
    g = qv.shape[0] // k.shape[0]
    kk, vv = np.repeat(k, g, 0), np.repeat(v, g, 0)
    s = np.einsum("hd,hnd->hn", qv.astype(np.float64), kk) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hn,hnd->hd", p, vv).astype(np.float32), p


def expected_mass(mass0: np.ndarray, qv: np.ndarray, deq, slots_all, scale: float) -> np.ndarray:
    """``t1_mass`` after one decode step: each tier-1 token's probability summed over its KV head's query heads."""
    mass = mass0.astype(np.float64).copy()
    for s, ((kd, vd), slots) in enumerate(zip(deq, slots_all)):
        _, p = attention(qv[s], kd, vd, scale)
        hkv = kd.shape[0]
        per_kv = p.reshape(hkv, -1, p.shape[-1]).sum(1)
        for i, (page, slot) in enumerate(slots):
            mass[page, :, slot] += per_kv[:, i]
    return mass.astype(np.float32)


def rerank_reference(pools: dict, tables: dict, length: np.ndarray, demote: np.ndarray, new_t2: np.ndarray,
                     sink: int, recent: int, importance: str = "mass", fit: str = "moments") -> dict:
    """What ``tiered_rerank`` does, in NumPy (float32 scores, slot-order ties): returns new pools."""
    from .tiered_rerank import harmonic_np

    out = {k: v.copy() for k, v in pools.items()}
    ps1, ps2 = pools["t1_k"].shape[2], pools["t2_k"].shape[2]
    hkv = pools["t1_k"].shape[1]
    for b in range(len(length)):
        n1, nd = int(tables["t1_len"][b]), int(demote[b])
        keep = n1 - nd
        pages = tables["t1_table"][b]
        loc = [(pages[i // ps1], i % ps1) for i in range(n1)]
        for h in range(hkv):
            pos = np.array([pools["t1_pos"][pg, h, sl] for pg, sl in loc], np.int64)
            mass = np.array([pools["t1_mass"][pg, h, sl] for pg, sl in loc], np.float32)
            uniform = harmonic_np(np.float32(length[b])) - harmonic_np(pos + 1) + (np.float32(1) / (pos + 1)).astype(np.float32)
            score = mass / np.maximum(uniform, np.float32(1e-12))
            if importance == "keynorm":
                score = np.array([(q.fp8_dequantize(pools["t1_k"][pg, h, sl], pools["t1_ks"][pg, h, sl]) ** 2).sum()
                                  for pg, sl in loc], np.float32)
            score[(pos < sink) | (pos >= length[b] - recent)] = np.float32(3.0e38)
            order = np.lexsort((np.arange(n1), score))  # by score, then slot
            dem = np.sort(order[:nd])
            by_pos = dem[np.argsort(pos[dem], kind="stable")]  # pages are filled in position order
            for pi in range(nd // ps2):
                page2 = new_t2[b, pi]
                idx = by_pos[pi * ps2:(pi + 1) * ps2]
                k = np.stack([q.fp8_dequantize(pools["t1_k"][loc[i][0], h, loc[i][1]], pools["t1_ks"][loc[i][0], h, loc[i][1]]) for i in idx])
                v = np.stack([q.fp8_dequantize(pools["t1_v"][loc[i][0], h, loc[i][1]], pools["t1_vs"][loc[i][0], h, loc[i][1]]) for i in idx])
                out["t2_k"][page2, h], out["t2_kmu"][page2, h], out["t2_ksig"][page2, h] = q.q2_quantize(k, axis=-2, fit=fit)
                out["t2_v"][page2, h], out["t2_vmu"][page2, h], out["t2_vsig"][page2, h] = q.q2_quantize(v, axis=-1, fit=fit)
                out["t2_pos"][page2, h] = pos[idx]
            holes = [i for i in dem if i < keep]
            movers = [i for i in range(keep, n1) if i not in set(dem)]
            for dst, src in zip(holes, movers):
                (pd, sd), (ps_, ss) = loc[dst], loc[src]
                for name in ("t1_k", "t1_v", "t1_ks", "t1_vs", "t1_pos", "t1_mass"):
                    out[name][pd, h, sd] = pools[name][ps_, h, ss]
    return out
