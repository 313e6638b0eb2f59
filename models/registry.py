"""Named model configurations (a registry, not an if-chain)."""

from __future__ import annotations

from .config import MoEConfig

MODEL_CONFIGS: dict[str, MoEConfig] = {}


def register(name: str, config: MoEConfig) -> MoEConfig:
    if name in MODEL_CONFIGS:
        raise ValueError(f"model config {name!r} is already registered")
    MODEL_CONFIGS[name] = config
    return config


def get_config(name: str) -> MoEConfig:
    try:
        return MODEL_CONFIGS[name]
    except KeyError:
        raise KeyError(f"unknown model config {name!r}; known: {', '.join(sorted(MODEL_CONFIGS))}") from None


# CI-sized: compiles and runs on a 2-core CPU in seconds.
register(
    "tiny",
    MoEConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_layers=2, num_heads=4,
        num_kv_heads=2, num_experts=8, top_k=2, norm_topk_prob=True, max_position_embeddings=1024,
    ),
)
# tiny with a shared expert (Qwen2-MoE style) and group-limited routing (DeepSeek-V3 style).
register(
    "tiny-shared-grouped",
    MoEConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_layers=2, num_heads=4,
        num_kv_heads=2, num_experts=8, top_k=2, norm_topk_prob=False, n_group=4, topk_group=2,
        shared_expert_intermediate_size=48, shared_expert_gate=True, max_position_embeddings=1024,
    ),
)
# DeepSeek-V3 routing at tiny size: sigmoid scores with a score-correction bias, 32 experts in 8 groups, the best
# 3 groups by the sum of their two best biased scores kept, then top-4 among their 12 experts; a shared expert.
register(
    "tiny-deepseek",
    MoEConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_layers=2, num_heads=4,
        num_kv_heads=2, num_experts=32, top_k=4, norm_topk_prob=True, router_score="sigmoid", n_group=8,
        topk_group=3, group_score="top2_sum", router_bias=True, shared_expert_intermediate_size=64,
        max_position_embeddings=1024,
    ),
)
# OLMoE-1B-7B shape: 64 experts, top-8, 16 layers, d=2048, QK-norm, no renormalisation.
register(
    "olmoe-1b-7b",
    MoEConfig(
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_layers=16, num_heads=16,
        num_kv_heads=16, num_experts=64, top_k=8, norm_topk_prob=False, qk_norm=True,
        rope_theta=10000.0, max_position_embeddings=4096,
    ),
)
# Mixtral-8x7B shape.
register(
    "mixtral-8x7b",
    MoEConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, num_experts=8, top_k=2, norm_topk_prob=True, rope_theta=1e6,
        max_position_embeddings=32768,
    ),
)
# Qwen1.5-MoE-A2.7B (Qwen2-MoE) shape: 60 experts top-4, shared expert with a sigmoid gate.
register(
    "qwen2-moe-a2.7b",
    MoEConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=1408, num_layers=24, num_heads=16,
        num_kv_heads=16, num_experts=60, top_k=4, norm_topk_prob=False, attention_bias=True,
        shared_expert_intermediate_size=5632, shared_expert_gate=True, rope_theta=1e6,
        rms_norm_eps=1e-6, max_position_embeddings=8192,
    ),
)
# Reference models trained on real text (``moec train-reference``): flat softmax top-k with renormalisation
# (Mixtral-style). text-tiny trains on a 2-core CPU in minutes on the byte-level corpus; text-small (48M
# parameters, 32 experts top-4) on the GPU on a 4096-token BPE corpus.
register(
    "text-tiny",
    MoEConfig(
        vocab_size=256, hidden_size=128, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, num_experts=8, top_k=2, norm_topk_prob=True, max_position_embeddings=2048,
    ),
)
register(
    "text-small",
    MoEConfig(
        vocab_size=4096, hidden_size=384, intermediate_size=192, num_layers=6, num_heads=6,
        num_kv_heads=2, num_experts=32, top_k=4, norm_topk_prob=True, max_position_embeddings=8192,
    ),
)
