"""Tiny random configs of HF transformers' own MoE classes for tests (``HF_FAMILIES``: OLMoE, Mixtral, Qwen2-MoE,
Qwen3-MoE, GLM-4-MoE, Granite-MoE, PhiMoE).

The experts implementation is ``batched_mm``: HF's default ``grouped_mm`` uses a custom op that no
exporter understands, and ``eager`` loops over ``nonzero`` (data-dependent, not exportable).
"""

from __future__ import annotations

import torch

_COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# family -> (config class, model class, config arguments beyond _COMMON); every layer an MoE layer
_CONFIGS = {
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                                      norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])),
    # per-head QK-norms
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], head_dim=16)),
    # sigmoid scores with a correction bias, group-limited, shared experts, scaled weights, QK-norms
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=0, head_dim=16, use_qk_norm=True, routed_scaling_factor=2.5)),
    # embedding, residual, attention and logits multipliers
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, embedding_multiplier=12.0, logits_scaling=8.0,
        residual_multiplier=0.22, attention_multiplier=0.0625)),
    # rotary frequencies computed in the forward (a static arange upstream of cos/sin), biases, LayerNorm
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, attention_bias=True, lm_head_bias=True)),
}
HF_FAMILIES = tuple(_CONFIGS)


def tiny_hf_model(family: str, attn_implementation: str = "eager", seed: int = 0) -> torch.nn.Module:
    """A tiny random model of HF transformers' class for ``family`` (2 layers, hidden 64, every layer MoE), eval
    mode. Norm weights and routing biases are random, so that a misplaced norm or bias shows in numerics."""
    import transformers as tf

    if family not in _CONFIGS:
        raise KeyError(f"unknown HF MoE family {family!r}; known: {', '.join(HF_FAMILIES)}")
    cfg_name, cls_name, kw = _CONFIGS[family]
    cfg = getattr(tf, cfg_name)(**_COMMON, **kw, experts_implementation="batched_mm", attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    model = getattr(tf, cls_name)(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "norm" in name and "bias" not in name:
                p.uniform_(0.5, 1.5)
            elif "correction_bias" in name:  # zero at init: make it choose
                p.copy_(torch.empty(p.shape).uniform_(-0.1, 0.1, generator=g).to(p.dtype))
    return model


def tie_layers(model: torch.nn.Module) -> torch.nn.Module:
    """Make every decoder layer use the first layer's parameters (in place; returns ``model``).

    For speed runs of shapes whose weights do not fit the machine: each layer still reads its weights
    from device memory every step (a layer's weights are far larger than any cache), while the host,
    the disk and the artifact hold one layer's. The importer keeps one parameter per distinct tensor.
    """
    layers = model.model.layers
    first = dict(layers[0].named_parameters())
    for layer in layers[1:]:
        for name, p in list(layer.named_parameters()):
            *path, leaf = name.split(".")
            owner = layer
            for part in path:
                owner = getattr(owner, part)
            if name not in first or first[name].shape != p.shape:
                raise ValueError(f"layer parameters differ from layer 0's at {name}: cannot tie")
            setattr(owner, leaf, first[name])
    return model
