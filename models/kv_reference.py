"""Tiered-KV decode of the reference model in PyTorch: the quality reference for the tiered cache.

The reference model is decoded token by token over an explicit KV cache whose entries are replaced by
their dequantized values according to a ``TierPolicy`` (formats from ``moec.runtime.kv_quant``), so
the perplexity cost of a cache policy can be measured on the model trained on real text, and the
compiled kernels can be checked against the same dequantized values.

Per layer, KV head and token the cache keeps a tier: 1 (FP8 e4m3, per-token scale) or 2 (2-bit uniform grid;
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
  * a token's importance is set by ``TierPolicy.score`` (default ``"keynorm"``): the L2 norm over
    the Dh channels of its key as cached in tier 1 (FP8-dequantized, after RoPE; RoPE keeps the
    norm), so the tokens with the smallest keys are demoted first. On the trained ``tiny`` model the
    2-bit key error, not the value error, is nearly all of the 2-bit loss, and it is spread over all
    demoted tokens (in layer 0 the 12% of tokens with the largest 2-bit key error hold 21% of it); large-norm
    keys take the largest absolute errors, and keeping them in FP8 beat random choice (and every
    attention-mass score) consistently, by about 0.1-0.2% perplexity. The key norm needs no
    accumulated state. The attention-mass scores remain selectable: the decode (and prefill)
    attention accumulates, per layer, KV head and token, the attention probability summed over the
    query heads of the KV head: ``mass`` (all queries), ``ema`` (decayed by ``decay`` per query),
    ``max`` (largest over queries) and ``since`` (since the last re-rank); ``uniform`` is mass over
    the uniform-attention share (sum of 1/length over the queries that saw the token), ``steps``
    mass over the number of queries that saw it (length - position); ``keyz`` and ``keyerr`` are the
    key's squared z-distance and 2-bit error with per-channel statistics over the whole cache.
    Factors multiply: ``"steps*keynorm"``.

Prefill, like decode, attends over the K/V as cached (``full``: float32; ``bf16``: rounded to
bfloat16; the other modes: FP8), as the compiled prefill does: a prompt token's 2-bit demotion only
affects later reads, since prefill ends before the first re-rank.

Promotion from tier 2 back to tier 1 is not done: the 2-bit codes are all that is kept of a
demoted token, so "promoting" it would spend FP8 bytes on the same 2-bit-accurate values. What a
later re-rank can change is which tier-1 tokens are demoted.

Modes: ``full`` (the model's float32 values), ``bf16`` (every entry rounded to bfloat16, the baseline
cache), ``fp8`` (every entry FP8), ``2bit`` (budget 0, no sink or window: each token is FP8 until the
next re-rank, then 2-bit), ``tiered`` (the policy above) and ``tiered-random`` (the same budget,
sink and window, with random scores instead of importance: seeded by ``seed``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..runtime import kv_quant as q
from .reference import Experts

MODES = ("full", "bf16", "fp8", "2bit", "tiered", "tiered-random")
SCORES = ("uniform", "steps", "mass", "ema", "max", "since", "keynorm", "keyz", "keyerr")


@dataclass(frozen=True)
class TierPolicy:
    mode: str = "tiered"
    tier1_fraction: float = 0.15
    sink: int = 4
    recent: int = 64
    rerank_every: int = 16
    page_tokens: int = 128
    seed: int = 0
    score: str = "keynorm"  # importance of the tiered mode: one of SCORES, or a product "a*b"
    decay: float = 0.97  # per-query decay of the "ema" score
    demote: str = "kv"  # what a demotion quantizes to 2-bit: "kv", or "k" / "v" alone (an ablation; the other stays FP8)
    fit: str = "lloyd"  # 2-bit mu/sigma: "lloyd" (the compiled default) or "moments" (kv_quant.q2_quantize)
    rotate: str = ""  # "k", "v" or "kv": quantize those in a rotated basis (orthogonal_rotation), "" none

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown KV policy mode {self.mode!r}; known: {', '.join(MODES)}")
        if not 0 <= self.tier1_fraction <= 1:
            raise ValueError("tier1_fraction must be in [0, 1]")
        if self.fit not in q.FITS:
            raise ValueError(f"unknown 2-bit fit {self.fit!r}; known: {', '.join(q.FITS)}")
        if self.rotate not in ("", "k", "v", "kv"):
            raise ValueError(f"rotate must be '', 'k', 'v' or 'kv', got {self.rotate!r}")
        if self.demote not in ("kv", "k", "v"):
            raise ValueError(f"demote must be 'kv', 'k' or 'v', got {self.demote!r}")
        if not set(self.score.split("*")) <= set(SCORES):
            raise ValueError(f"unknown importance score {self.score!r}; known: {', '.join(SCORES)}")

    @classmethod
    def named(cls, mode: str, **kw) -> "TierPolicy":
        base = cls(mode=mode, **kw)
        if mode == "2bit":
            return replace(base, tier1_fraction=0.0, sink=0, recent=0)
        return base


def orthogonal_rotation(dim: int, seed: int = 0) -> np.ndarray:
    """A fixed orthogonal ``[dim, dim]`` matrix that spreads every channel over all of them.

    Randomised Hadamard ``diag(signs) H / sqrt(dim)`` when ``dim`` is a power of two (applied in a
    kernel as a fast transform of q and of the output), else a seeded random orthogonal matrix. A
    block quantized as ``x R`` and dequantized times ``R^T`` sees outlier channels spread out, so its
    per-token statistics fit the grid's Gaussian-optimal step better; ``q . k = (q R) . (k R)``.
    """
    rng = np.random.default_rng(seed)
    if dim & (dim - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < dim:
            h = np.block([[h, h], [h, -h]])
        return (rng.choice([-1.0, 1.0], dim)[:, None] * h / math.sqrt(dim)).astype(np.float32)
    qm, r = np.linalg.qr(rng.standard_normal((dim, dim)))
    return (qm * np.sign(np.diag(r))).astype(np.float32)


def fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """``kv_quant.fp8_dequantize(*kv_quant.fp8_quantize(x))`` on ``x``'s device, bit for bit.

    (The per-vector scale is rounded to float16, so ``x / scale`` may exceed 448 by a float16 ulp;
    both casts round that to 448, far from the 464 where they would disagree.)
    """
    x = x.float()
    scale = torch.clamp_min(x.abs().amax(-1) / q.E4M3_MAX, float(q._MIN_SCALE)).half().float()[..., None]
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


class _LayerCache:
    """One layer's cache for B sequences: true and dequantized K/V, tiers and importance.

    K/V and the importance state are torch tensors on ``device`` (the model's), so decoding at long
    contexts runs on the GPU; the tiers (read only at re-ranks) are a NumPy array. Quantization goes
    through ``moec.runtime.kv_quant`` (NumPy), on the few entries appended or demoted at a time.
    """

    def __init__(self, b: int, hkv: int, cap: int, dh: int, policy: TierPolicy, device="cpu") -> None:
        self.policy = policy
        self.device = torch.device(device)
        f32 = dict(dtype=torch.float32, device=self.device)
        f64 = dict(dtype=torch.float64, device=self.device)
        self.k = torch.zeros((b, hkv, cap, dh), **f32)  # true values (after RoPE)
        self.v = torch.zeros((b, hkv, cap, dh), **f32)
        self.kd = torch.zeros_like(self.k)  # what attention reads
        self.vd = torch.zeros_like(self.v)
        self.tier = np.zeros((b, hkv, cap), np.int8)  # 1 or 2 (0: empty)
        self.mass = torch.zeros((b, hkv, cap), **f64)  # attention mass received
        self.ema = torch.zeros((b, hkv, cap), **f64)  # mass decayed by ``decay`` per query
        self.maxp = torch.zeros((b, hkv, cap), **f64)  # largest probability of one query
        self.since = torch.zeros((b, hkv, cap), **f64)  # mass since the last re-rank
        self.len = 0
        self.rot = orthogonal_rotation(dh) if policy.rotate else None  # applied on the host, to demoted pages

    def _t(self, a) -> torch.Tensor:
        return torch.as_tensor(a, device=self.device)

    def accumulate(self, ps: torch.Tensor) -> None:
        """Per-query attention probabilities ``[B, Hkv, S, n]`` (summed over query heads)."""
        ps = self._t(ps).double()
        n, s = ps.shape[-1], ps.shape[2]
        d = self.policy.decay
        w = d ** torch.arange(s - 1, -1, -1, dtype=torch.float64, device=self.device)  # the last query weighs 1
        total = ps.sum(2)
        self.mass[:, :, :n] += total
        self.since[:, :, :n] += total
        self.ema[:, :, :n] = self.ema[:, :, :n] * d**s + torch.einsum("bhsn,s->bhn", ps, w)
        torch.maximum(self.maxp[:, :, :n], ps.amax(2), out=self.maxp[:, :, :n])

    def importance(self, visible: np.ndarray) -> np.ndarray:
        """``[B, Hkv, n]`` importance of every cached token, from the accumulated state."""
        out = None
        for kind in self.policy.score.split("*"):
            f = self._factor(kind, visible)
            out = f if out is None else out * f
        return out.cpu().numpy()

    def _factor(self, kind: str, visible: np.ndarray) -> torch.Tensor:
        n = self.len
        if kind == "uniform":
            return self.mass[:, :, :n] / self._t(np.maximum(visible[:n], 1e-12))
        if kind == "steps":  # queries that could see the token: n - position
            return self.mass[:, :, :n] / (n - torch.arange(n, dtype=torch.float64, device=self.device))
        if kind == "keynorm":
            return torch.linalg.vector_norm(self.kd[:, :, :n], dim=-1).double()
        if kind in ("keyz", "keyerr"):  # per-channel statistics over all cached tokens
            k = self.kd[:, :, :n].double()
            mu, sd = k.mean(2, keepdim=True), k.std(2, keepdim=True, correction=0).clamp_min(1e-12)
            z = (k - mu) / sd
            if kind == "keyz":  # squared distance from the per-channel mean, in channel standard deviations
                return (z**2).sum(-1)
            th = self._t(q.Q2_THRESHOLDS.astype(np.float64))  # 2-bit key error
            zq = self._t(q.Q2_LEVELS.astype(np.float64))[torch.searchsorted(th, z.contiguous(), right=True)]
            return (((z - zq) * sd) ** 2).sum(-1)
        return {"mass": self.mass, "ema": self.ema, "max": self.maxp, "since": self.since}[kind][:, :, :n].clone()

    def _entry(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mode = self.policy.mode
        if mode == "full":
            return k, v
        if mode == "bf16":
            return k.bfloat16().float(), v.bfloat16().float()
        return fp8_roundtrip(k), fp8_roundtrip(v)

    def append(self, k, v) -> None:
        """Append ``[B, Hkv, S, Dh]`` new entries (tier 1 until the next re-rank)."""
        k, v = self._t(k).float(), self._t(v).float()
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
        if p.mode == "tiered-random":
            score = rng.random(self.tier[:, :, :n].shape)
        else:
            score = self.importance(visible)
        self.since.zero_()
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
        """Quantize the tokens ``idx`` (whole pages, position order) of sequence i, head h to 2-bit."""
        pages = torch.as_tensor(idx.reshape(-1, self.policy.page_tokens), device=self.device)
        kd = self.kd[i, h][pages].cpu().numpy()  # P, T, Dh: from the FP8 values the cache holds
        vd = self.vd[i, h][pages].cpu().numpy()
        p = self.policy
        if "k" in p.demote:
            self.kd[i, h, pages] = self._roundtrip2(kd, "k", lambda a: q.quantize_keys_2bit(a, p.fit), -2)
        if "v" in p.demote:
            self.vd[i, h, pages] = self._roundtrip2(vd, "v", lambda a: q.quantize_values_2bit(a, p.fit), -1)
        self.tier[i, h, idx] = 2

    def _roundtrip2(self, x: np.ndarray, side: str, quantize, axis: int) -> torch.Tensor:
        """2-bit round trip of pages ``x [P, T, Dh]``, in the rotated basis when the policy says so."""
        rot = self.rot if side in self.policy.rotate else None
        y = q.q2_dequantize(*quantize(x if rot is None else x @ rot), axis=axis)
        return self._t(y if rot is None else y @ rot.T)


class TieredDecoder:
    """Prefill then teacher-forced decode of ``MoEForCausalLM`` over a policy-quantized KV cache.

    Runs on the device the model's parameters are on (CPU, or CUDA for 4096-token contexts).
    """

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
        dev = next(self.model.parameters()).device
        b, length = windows.shape
        h, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.dim_head
        rep = h // hkv
        scale = dh**-0.5
        rng = np.random.default_rng(p.seed)
        caches = [_LayerCache(b, hkv, length, dh, p, dev) for _ in self.model.layers]
        visible = np.zeros(length, np.float64)
        ids = torch.from_numpy(windows).to(dev)

        def attend(layer_i, qv, causal):
            c = caches[layer_i]
            n, s = c.len, qv.shape[2]
            qg = qv.view(b, hkv, rep, s, dh)  # query heads grouped by their KV head
            scores = qg @ c.kd[:, :, None, :n].transpose(-1, -2) * scale  # B, Hkv, rep, S, n
            if causal is not None:
                scores = scores + causal
            probs = torch.softmax(scores, -1)
            c.accumulate(probs.sum(2))
            return (probs @ c.vd[:, :, None, :n]).view(b, h, s, dh)  # B, H, S, Dh

        def forward(tokens, start):
            s = tokens.shape[1]
            for m in experts:  # prefill: grouped by expert (the same function, no gathered weights)
                m.grouped = s > 1
            pos = torch.arange(start, start + s, device=dev)
            causal = None
            if s > 1:
                causal = torch.full((s, s), float("-inf"), device=dev).triu(1)
            x = self.model.embed_tokens(tokens)
            for li, layer in enumerate(self.model.layers):
                hn = layer.input_norm(x)
                qv, kv, vv = self._qkv(layer, hn, pos)
                caches[li].append(kv, vv)
                # prefill too attends over the values as cached (FP8, or bf16-rounded), as the
                # compiled prefill does
                o = attend(li, qv, causal)
                o = o.transpose(1, 2).reshape(b, s, h * dh)
                x = x + layer.attn.o_proj(o)
                x = x + layer.moe(layer.post_attention_norm(x))
            return self.model.lm_head(self.model.norm(x[:, -1:]))  # B, 1, V

        experts = [m for m in self.model.modules() if isinstance(m, Experts)]
        grouped = [m.grouped for m in experts]
        try:
            return self._decode(forward, ids, n_prefill, caches, visible, rng)
        finally:
            for m, g in zip(experts, grouped):
                m.grouped = g

    def _decode(self, forward, ids, n_prefill, caches, visible, rng) -> np.ndarray:
        p, length = self.policy, ids.shape[1]
        out_logits = []
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
        return torch.cat(out_logits, 1).float().cpu().numpy()


def tier_fraction(caches) -> float:
    """Share of cached (layer, head, token) entries in tier 1."""
    ones = sum(int((c.tier[:, :, :c.len] == 1).sum()) for c in caches)
    total = sum(c.tier[:, :, :c.len].size for c in caches)
    return ones / total


class KVPolicySubject:
    """A harness subject (``moec.models.evaluate``): decode-path scores under a KV policy."""

    kind = "torch-kv-reference"
    mode = "decode"

    def __init__(self, model, policy: TierPolicy, batch_size: int = 8, device: str = "cpu") -> None:
        self.model, self.policy, self.batch_size = model, policy, batch_size
        self.device = torch.device(device)
        self.name = f"kv:{policy.mode}"
        self.tier1_share: list[float] = []

    def score(self, tokens: np.ndarray, starts: list[int], context: int, stride: int):
        import time

        from .evaluate import Scores, _nll_and_argmax

        nll, arg = [], []
        model = self.model.to(self.device)
        t0 = time.perf_counter()
        for i in range(0, len(starts), self.batch_size):
            w = np.stack([tokens[s:s + context] for s in starts[i:i + self.batch_size]])  # B, L
            dec = TieredDecoder(model, self.policy)
            logits = dec.run(w, context - stride)  # B, stride, V
            self.tier1_share.append(tier_fraction(dec.caches))
            a, b = _nll_and_argmax(logits, w[:, context - stride:])
            nll.append(a.reshape(-1))
            arg.append(b.reshape(-1))
        self.nll = np.concatenate(nll)  # per scored target, for paired comparisons of policies
        return Scores(self.nll, np.concatenate(arg), None, None, time.perf_counter() - t0,
                      "routing is not recorded by the KV reference decoder")
