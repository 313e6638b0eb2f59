"""Per-stream token sampling on the host: greedy, temperature, top-k and top-p, seeded per request.

Each stream owns a ``numpy.random.Generator`` and draws exactly one uniform number per sampled token
(greedy draws none), so a stream's tokens depend only on its own logits and seed, not on which other
streams share its batch.

Sampling runs on the host from the ``[B, V]`` logits the engine returns; that is fine for the tiny
models and CPU, but the next step is device-side sampling (top-k/top-p and the draw in a kernel
after the LM head) so that decode copies ``B`` token ids back instead of ``B x V`` floats.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..compiler.errors import MoecError


@dataclass(frozen=True)
class SamplingParams:
    """How a stream picks its next token.

    temperature : 0 means greedy (argmax); otherwise logits are divided by it before the softmax.
    top_k : keep only the ``top_k`` most likely tokens (0: no limit).
    top_p : keep the smallest set of most likely tokens whose probability reaches ``top_p`` (1: no limit).
    seed : seed of the stream's generator (``None``: fresh OS entropy, not reproducible).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise MoecError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise MoecError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise MoecError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class Sampler:
    """One stream's sampler: its parameters and its own random generator."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        """Next token from one row of logits ``[V]``."""
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
        z = np.asarray(logits, np.float64) / p.temperature
        k = z.shape[0] if p.top_k == 0 else min(p.top_k, z.shape[0])
        if k < z.shape[0]:
            cand = np.argpartition(-z, k - 1)[:k]
        else:
            cand = np.arange(z.shape[0])
        # most likely first; ties broken by token id, so the order is a function of the logits only
        cand = cand[np.lexsort((cand, -z[cand]))]
        w = np.exp(z[cand] - z[cand[0]])
        probs = w / w.sum()
        if p.top_p < 1:
            cum = np.cumsum(probs)
            keep = int(np.searchsorted(cum, p.top_p, side="left")) + 1  # smallest prefix reaching top_p
            cand, probs = cand[:keep], probs[:keep] / cum[min(keep, len(cum)) - 1]
        u = self.rng.random()
        i = int(np.searchsorted(np.cumsum(probs), u, side="right"))
        return int(cand[min(i, len(cand) - 1)])
