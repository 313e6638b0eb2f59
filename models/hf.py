"""Tiny random configs of HF transformers' own MoE classes (Mixtral, OLMoE, Qwen2-MoE) for tests.

The experts implementation is ``batched_mm``: HF's default ``grouped_mm`` uses a custom op that no
exporter understands, and ``eager`` loops over ``nonzero`` (data-dependent, not exportable).
"""

from __future__ import annotations

import torch

HF_FAMILIES = ("olmoe", "mixtral", "qwen2_moe")


def tiny_hf_model(family: str, attn_implementation: str = "eager", seed: int = 0) -> torch.nn.Module:
    import transformers as tf

    common = dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, experts_implementation="batched_mm", attn_implementation=attn_implementation,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    if family == "olmoe":
        cfg = tf.OlmoeConfig(intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, **common)
        cls = tf.OlmoeForCausalLM
    elif family == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **common)
        cls = tf.MixtralForCausalLM
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(
            intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], **common,
        )
        cls = tf.Qwen2MoeForCausalLM
    else:
        raise KeyError(f"unknown HF MoE family {family!r}; known: {', '.join(HF_FAMILIES)}")
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # random norm weights so that a misplaced norm shows in numerics
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
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
