"""Tiered-KV decode of the reference model in PyTorch: the quality reference for the tiered cache.

The reference model is decoded token by token over an explicit KV cache whose entries are replaced by
their dequantized values according to a ``TierPolicy`` (formats from ``moec.runtime.kv_quant``), so
the perplexity cost of a cache policy can be measured on the model trained on real text, and the
compiled kernels can be checked against the same dequantized values.

Per layer, KV head and token the cache keeps a tier: 1 (FP8 e4m3, per-token scale) or 2 (2-bit NF2;
keys per channel over a tier-2 page, values per token). The policy, applied after prefill and then
every ``rerank_every`` decode steps:

  * attention-sink tokens (the first ``sink``) and the ``recent`` newest tokens are always tier 1;
  * new tokens enter tier 1 and stay there until the next re-rank;
  * at a re-rank, the tier-1 tokens outside sink and recent window compete for what the budget
    leaves (``floor(tier1_fraction * length)`` tier-1 tokens in all, sink and window included); the
    least important of the excess are quantized to 2-bit in whole tier-2 pages of ``page_tokens``
    tokens (position order within a page), so every tier-2 page is full and its per-channel key
    statistics cover ``page_tokens`` tokens; fewer than ``page_tokens`` excess tokens wait in tier 1
    for a later re-rank (the budget is exceeded by less than one tier-2 page per sequence);
  * a token's importance is the attention probability it has received (summed over the query heads
    of its KV head, over prefill queries and decode steps) divided by what uniform attention would
    have given it over the same queries (the sum of 1/context-length over every query that could see
    it). Early tokens are not favoured for having been visible longer, nor for having been seen by
    the short-context queries at the start of a prefill. In decode this is the mass normalised by the
    steps the token has been visible, each step weighted by 1/length.

Promotion from tier 2 back to tier 1 is not done: the 2-bit codes are all that is kept of a
demoted token, so "promoting" it would spend FP8 bytes on the same 2-bit-accurate values. What a
later re-rank can change is which tier-1 tokens are demoted.

Modes: ``full`` (the model's float32 values), ``bf16`` (every entry rounded to bfloat16, the baseline
cache), ``fp8`` (every entry FP8), ``2bit`` (budget 0, no sink or window: each token is FP8 until the
next re-rank, then 2-bit), ``tiered`` (the policy above) and ``tiered-random`` (the same budget,
sink and window, with random scores instead of importance).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..runtime import kv_quant as q

MODES = ("full", "bf16", "fp8", "2bit", "tiered", "tiered-random")


@dataclass(frozen=True)
class TierPolicy:
    mode: str = "tiered"
    tier1_fraction: float = 0.15
    sink: int = 4
    recent: int = 64
    rerank_every: int = 16
    page_tokens: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown KV policy mode {self.mode!r}; known: {', '.join(MODES)}")
        if not 0 <= self.tier1_fraction <= 1:
            raise ValueError("tier1_fraction must be in [0, 1]")

    @classmethod
    def named(cls, mode: str, **kw) -> "TierPolicy":
        base = cls(mode=mode, **kw)
        if mode == "2bit":
            return replace(base, tier1_fraction=0.0, sink=0, recent=0)
        return base


class _LayerCache:
    """One layer's cache for B sequences: true and dequantized K/V, tiers and importance."""

    def __init__(self, b: int, hkv: int, cap: int, dh: int, policy: TierPolicy) -> None:
        self.policy = policy
        self.k = np.zeros((b, hkv, cap, dh), np.float32)  # true values (after RoPE)
        self.v = np.zeros((b, hkv, cap, dh), np.float32)
        self.kd = np.zeros_like(self.k)  # what attention reads
        self.vd = np.zeros_like(self.v)
        self.tier = np.zeros((b, hkv, cap), np.int8)  # 1 or 2 (0: empty)
        self.mass = np.zeros((b, hkv, cap), np.float64)
        self.len = 0

    def _entry(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mode = self.policy.mode
        if mode == "full":
            return k, v
        if mode == "bf16":
            rnd = lambda a: torch.from_numpy(a).to(torch.bfloat16).float().numpy()  # noqa: E731
            return rnd(k), rnd(v)
        return q.fp8_dequantize(*q.fp8_quantize(k)), q.fp8_dequantize(*q.fp8_quantize(v))

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """Append ``[B, Hkv, S, Dh]`` new entries (tier 1 until the next re-rank)."""
        s = k.shape[2]
        sl = slice(self.len, self.len + s)
        self.k[:, :, sl], self.v[:, :, sl] = k, v
        self.kd[:, :, sl], self.vd[:, :, sl] = self._entry(k, v)
        self.tier[:, :, sl] = 1
        self.len += s

    def rerank(self, visible: np.ndarray, rng: np.random.Generator) -> None:
        p = self.policy
        if p.mode in ("full", "bf16", "fp8"):
            return
        n = self.len
        protected = np.zeros(n, bool)
        protected[: min(p.sink, n)] = True
        if p.recent:
            protected[max(0, n - p.recent):] = True
        budget = max(int(math.floor(p.tier1_fraction * n)), int(protected.sum()))
        score = self.mass[:, :, :n] / np.maximum(visible[None, None, :n], 1e-12)
        if p.mode == "tiered-random":
            score = rng.random(score.shape)
        b, hkv = self.tier.shape[:2]
        for i in range(b):
            for h in range(hkv):
                tier = self.tier[i, h, :n]
                keep_slots = budget - int((protected & (tier == 1)).sum())
                cand = np.flatnonzero((tier == 1) & ~protected)
                over = cand.size - max(keep_slots, 0)
                pages = over // p.page_tokens  # demote whole tier-2 pages only
                if pages <= 0:
                    continue
                order = cand[np.argsort(score[i, h, cand], kind="stable")]  # least important first
                self._demote(i, h, np.sort(order[: pages * p.page_tokens]))

    def _demote(self, i: int, h: int, idx: np.ndarray) -> None:
        for start in range(0, idx.size, self.policy.page_tokens):
            page = idx[start:start + self.policy.page_tokens]
            kq = q.quantize_keys_2bit(self.k[i, h, page][None])
            vq = q.quantize_values_2bit(self.v[i, h, page][None])
            self.kd[i, h, page] = q.nf2_dequantize(*kq, axis=-2)[0]
            self.vd[i, h, page] = q.nf2_dequantize(*vq, axis=-1)[0]
            self.tier[i, h, page] = 2


class TieredDecoder:
    """Prefill then teacher-forced decode of ``MoEForCausalLM`` over a policy-quantized KV cache."""

    def __init__(self, model, policy: TierPolicy) -> None:
        self.model = model.eval()
        self.policy = policy
        self.cfg = model.config

    def _qkv(self, layer, x: torch.Tensor, pos: torch.Tensor):
        cos, sin = self.model.rotary(pos)
        return layer.attn.qkv(x, cos, sin)

    @torch.no_grad()
    def run(self, windows: np.ndarray, n_prefill: int) -> np.ndarray:
        """Logits predicting tokens ``n_prefill .. L-1`` of each window: ``[B, L - n_prefill, V]``."""
        cfg, p = self.cfg, self.policy
        b, length = windows.shape
        h, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.dim_head
        rep = h // hkv
        scale = dh**-0.5
        rng = np.random.default_rng(p.seed)
        caches = [_LayerCache(b, hkv, length, dh, p) for _ in self.model.layers]
        visible = np.zeros(length, np.float64)
        ids = torch.from_numpy(windows)
        out_logits = []

        def attend(layer_i, qv, causal):
            c = caches[layer_i]
            n = c.len
            kd = torch.from_numpy(c.kd[:, :, :n]).repeat_interleave(rep, 1)  # B, H, n, Dh
            vd = torch.from_numpy(c.vd[:, :, :n]).repeat_interleave(rep, 1)
            scores = qv @ kd.transpose(2, 3) * scale  # B, H, S, n
            if causal is not None:
                scores = scores + causal
            probs = torch.softmax(scores, -1)
            c.mass[:, :, :n] += probs.sum(2).view(b, hkv, rep, n).sum(2).double().numpy()
            return probs @ vd  # B, H, S, Dh

        def forward(tokens, start):
            s = tokens.shape[1]
            pos = torch.arange(start, start + s)
            causal = None
            if s > 1:
                causal = torch.full((s, s), float("-inf")).triu(1)[None, None]
            x = self.model.embed_tokens(tokens)
            for li, layer in enumerate(self.model.layers):
                hn = layer.input_norm(x)
                qv, kv, vv = self._qkv(layer, hn, pos)
                caches[li].append(kv.numpy(), vv.numpy())
                if s > 1:  # prefill attends over the fresh values (quantization affects later reads)
                    c = caches[li]
                    kd_keep, vd_keep = c.kd[:, :, start:start + s].copy(), c.vd[:, :, start:start + s].copy()
                    c.kd[:, :, start:start + s], c.vd[:, :, start:start + s] = kv.numpy(), vv.numpy()
                    o = attend(li, qv, causal)
                    c.kd[:, :, start:start + s], c.vd[:, :, start:start + s] = kd_keep, vd_keep
                else:
                    o = attend(li, qv, None)
                o = o.transpose(1, 2).reshape(b, s, h * dh)
                x = x + layer.attn.o_proj(o)
                x = x + layer.moe(layer.post_attention_norm(x))
            return self.model.lm_head(self.model.norm(x[:, -1:]))  # B, 1, V

        first = forward(ids[:, :n_prefill], 0)
        # uniform-attention share: prefill query i spreads 1/(i+1) over each token it sees
        visible[:n_prefill] = np.cumsum((1.0 / np.arange(1, n_prefill + 1))[::-1])[::-1]
        for c in caches:
            c.rerank(visible, rng)
        out_logits.append(first)
        for step, t in enumerate(range(n_prefill, length - 1)):
            out_logits.append(forward(ids[:, t:t + 1], t))
            visible[:t + 1] += 1.0 / (t + 1)
            if (step + 1) % p.rerank_every == 0:
                for c in caches:
                    c.rerank(visible, rng)
        self.caches, self.visible = caches, visible
        return torch.cat(out_logits, 1).float().numpy()


def tier_fraction(caches) -> float:
    """Share of cached (layer, head, token) entries in tier 1."""
    ones = sum(int((c.tier[:, :, :c.len] == 1).sum()) for c in caches)
    total = sum(c.tier[:, :, :c.len].size for c in caches)
    return ones / total


class KVPolicySubject:
    """A harness subject (``moec.models.evaluate``): decode-path scores under a KV policy."""

    kind = "torch-kv-reference"
    mode = "decode"

    def __init__(self, model, policy: TierPolicy, batch_size: int = 8) -> None:
        self.model, self.policy, self.batch_size = model, policy, batch_size
        self.name = f"kv:{policy.mode}"
        self.tier1_share: list[float] = []

    def score(self, tokens: np.ndarray, starts: list[int], context: int, stride: int):
        import time

        from .evaluate import Scores, _nll_and_argmax

        nll, arg = [], []
        t0 = time.perf_counter()
        for i in range(0, len(starts), self.batch_size):
            w = np.stack([tokens[s:s + context] for s in starts[i:i + self.batch_size]])  # B, L
            dec = TieredDecoder(self.model, self.policy)
            logits = dec.run(w, context - stride)  # B, stride, V
            self.tier1_share.append(tier_fraction(dec.caches))
            a, b = _nll_and_argmax(logits, w[:, context - stride:])
            nll.append(a.reshape(-1))
            arg.append(b.reshape(-1))
        return Scores(np.concatenate(nll), np.concatenate(arg), None, None, time.perf_counter() - t0,
                      "routing is not recorded by the KV reference decoder")
