"""Configuration of the reference decoder-only MoE language model."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing configuration of a decoder-only MoE model.

    The fields cover the families moec targets: Mixtral (flat softmax top-k with
    renormalisation), OLMoE (softmax top-k without renormalisation, QK-norm),
    Qwen2-MoE (shared expert with a sigmoid gate) and DeepSeek-V2/V3 style
    group-limited routing (``n_group`` / ``topk_group``; ``group_score`` "max" as in V2, "top2_sum"
    with the score-correction bias ``router_bias`` as in V3).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # per routed expert
    num_layers: int
    num_heads: int
    num_kv_heads: int
    num_experts: int
    top_k: int
    head_dim: int | None = None
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to one
    router_score: str = "softmax"  # "softmax" or "sigmoid"
    n_group: int = 1  # group-limited routing: number of expert groups
    topk_group: int = 1  # group-limited routing: groups kept per token
    group_score: str = "max"  # group-limited routing: "max" (DeepSeek-V2) or "top2_sum" (DeepSeek-V3) of a group's scores
    router_bias: bool = False  # DeepSeek-V3 e_score_correction_bias: added to the scores to choose experts, not to weight them
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(linear(x)) scales the shared expert
    qk_norm: bool = False  # OLMoE: RMSNorm over the full q and k projections
    attention_bias: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads and self.head_dim is None:
            raise ValueError("hidden_size must be divisible by num_heads when head_dim is not given")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError("top_k must be in [1, num_experts]")
        if self.router_score not in ("softmax", "sigmoid"):
            raise ValueError(f"router_score must be 'softmax' or 'sigmoid', got {self.router_score!r}")
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError("n_group must divide num_experts and 1 <= topk_group <= n_group")
        if self.group_score not in ("max", "top2_sum"):
            raise ValueError(f"group_score must be 'max' or 'top2_sum', got {self.group_score!r}")
        if self.group_score == "top2_sum" and self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError("group_score 'top2_sum' needs at least two experts per group")

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MoEConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown MoEConfig fields: {sorted(unknown)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def num_parameters(self) -> int:
        d, i, e, hd = self.hidden_size, self.intermediate_size, self.num_experts, self.dim_head
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        experts = e * 3 * d * i + d * e
        shared = 3 * d * self.shared_expert_intermediate_size
        per_layer = attn + experts + shared + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + d
