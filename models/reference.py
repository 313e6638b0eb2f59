"""The reference decoder-only MoE language model in PyTorch.

Written with plain tensor ops (no fused custom kernels) so that both ``torch.export``
and the ONNX exporter see every operation, as they would in a user's own export.

Legend for shape comments: B batch, S sequence, T tokens (B*S), D hidden, H query heads,
Hkv key/value heads, Dh head dim, E experts, K active experts, G groups, I expert width, V vocab.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .config import MoEConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # S, Dh/2
        emb = torch.cat((freqs, freqs), dim=-1)  # S, Dh
        return emb.cos(), emb.sin()


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.dim_head
        self.cfg = cfg
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.num_heads * hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.num_kv_heads * hd, cfg.rms_norm_eps)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Projections after QK-norm and RoPE: q [B, H, S, Dh], k and v [B, Hkv, S, Dh]."""
        cfg = self.cfg
        b, s, _ = x.shape
        hd, h, hkv = cfg.dim_head, cfg.num_heads, cfg.num_kv_heads
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, h, hd).transpose(1, 2)  # B, H, S, Dh
        k = k.view(b, s, hkv, hd).transpose(1, 2)  # B, Hkv, S, Dh
        v = v.view(b, s, hkv, hd).transpose(1, 2)  # B, Hkv, S, Dh
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, s, _ = x.shape
        hd, h, hkv = cfg.dim_head, cfg.num_heads, cfg.num_kv_heads
        q, k, v = self.qkv(x, cos, sin)
        rep = h // hkv
        k = k[:, :, None].expand(b, hkv, rep, s, hd).reshape(b, h, s, hd)
        v = v[:, :, None].expand(b, hkv, rep, s, hd).reshape(b, h, s, hd)
        if mask is None:  # training kernels: causal, no padding (same function, fused kernel)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hd**-0.5)
            return self.o_proj(out.transpose(1, 2).reshape(b, s, h * hd))
        scores = torch.matmul(q, k.transpose(2, 3)) * (hd**-0.5) + mask  # B, H, S, S
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v)  # B, H, S, Dh
        out = out.transpose(1, 2).reshape(b, s, h * hd)
        return self.o_proj(out)


class Router(nn.Module):
    """Linear -> softmax|sigmoid -> (group-limited) top-k -> optional renormalisation.

    Group-limited routing splits the E experts into ``n_group`` contiguous groups and keeps each
    token's ``topk_group`` best groups before the top-k: by the group's best score (``group_score``
    "max", DeepSeek-V2, masking by a threshold and a multiply) or by the sum of its two best scores
    after the score-correction bias (``"top2_sum"``, DeepSeek-V3, masking by a scatter of the group
    indices and ``masked_fill(0)``, as in its reference implementation). The bias only chooses:
    the weights are the unbiased scores.
    """

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        nn.init.normal_(self.weight, std=0.02)
        self.bias = nn.Parameter(torch.zeros(cfg.num_experts)) if cfg.router_bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        logits = F.linear(x, self.weight)  # T, E
        scores = torch.softmax(logits, dim=-1) if cfg.router_score == "softmax" else torch.sigmoid(logits)
        choice = scores if self.bias is None else scores + self.bias  # T, E
        if cfg.n_group > 1 and cfg.group_score == "top2_sum":
            t, n = choice.shape[0], cfg.num_experts // cfg.n_group
            group_scores = choice.view(t, cfg.n_group, n).topk(2, dim=-1).values.sum(dim=-1)  # T, G
            group_idx = torch.topk(group_scores, cfg.topk_group, dim=-1, sorted=False).indices  # T, g
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)  # T, G
            score_mask = group_mask[:, :, None].expand(t, cfg.n_group, n).reshape(t, -1)  # T, E
            choice = choice.masked_fill(~score_mask.bool(), 0.0)  # T, E
        elif cfg.n_group > 1:
            t = choice.shape[0]
            group_scores = choice.view(t, cfg.n_group, -1).amax(dim=-1)  # T, G
            kth = torch.topk(group_scores, cfg.topk_group, dim=-1).values[:, -1:]  # T, 1
            keep = (group_scores >= kth).to(scores.dtype)  # T, G
            keep = keep[:, :, None].expand(t, cfg.n_group, cfg.num_experts // cfg.n_group).reshape(t, -1)
            choice = choice * keep  # T, E (experts of dropped groups score 0)
        _, idx = torch.topk(choice, cfg.top_k, dim=-1)  # T, K
        weights = torch.gather(scores, 1, idx)  # T, K
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, idx


class Experts(nn.Module):
    """E SwiGLU experts with stacked weights.

    ``forward`` gathers each token's K experts' weights (plain ops every exporter sees);
    ``grouped=True`` computes the same function with tokens sorted by expert, one matmul per
    expert, which is what training uses (the gathered weights of a large batch do not fit).
    """

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        e, d, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, d) * d**-0.5)  # E, 2I, D
        self.down_proj = nn.Parameter(torch.randn(e, d, i) * i**-0.5)  # E, D, I
        self.grouped = False

    def _forward_grouped(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        t, d = x.shape
        k = idx.shape[1]
        flat = idx.reshape(-1)  # T*K
        order = torch.argsort(flat, stable=True)  # T*K, grouped by expert
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()  # E
        xs = x[order // k]  # T*K, D (sorted)
        outs = []
        for e, part in enumerate(torch.split(xs, counts)):
            if part.shape[0]:
                gate, up = (part @ self.gate_up_proj[e].t()).chunk(2, dim=-1)  # n, I
                outs.append((F.silu(gate) * up) @ self.down_proj[e].t())  # n, D
        cat = torch.cat(outs)  # (bf16 under autocast)
        ys = torch.empty(t * k, d, dtype=cat.dtype, device=x.device)
        ys[order] = cat
        ys = ys * weights.reshape(-1, 1)
        return ys.view(t, k, d).sum(dim=1)  # T, D

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if self.grouped:
            return self._forward_grouped(x, weights, idx)
        t, d = x.shape
        k = idx.shape[1]
        flat_idx = idx.reshape(-1)  # T*K
        xk = x[:, None, :].expand(t, k, d).reshape(t * k, d, 1)  # T*K, D, 1
        gate_up = torch.bmm(self.gate_up_proj[flat_idx], xk).squeeze(-1)  # T*K, 2I
        gate, up = gate_up.chunk(2, dim=-1)  # T*K, I
        h = F.silu(gate) * up
        out = torch.bmm(self.down_proj[flat_idx], h[:, :, None]).squeeze(-1)  # T*K, D
        out = out * weights.reshape(-1, 1)
        return out.view(t, k, d).sum(dim=1)  # T, D


class SwiGLU(nn.Module):
    def __init__(self, d: int, i: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = SwiGLU(cfg.hidden_size, cfg.shared_expert_intermediate_size) if cfg.shared_expert_intermediate_size else None
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if cfg.shared_expert_gate and self.shared_expert else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        flat = x.reshape(-1, d)  # T, D
        weights, idx = self.router(flat)
        out = self.experts(flat, weights, idx)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view(b, s, d)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.moe = MoEBlock(cfg)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.input_norm(x), cos, sin, mask)
        return x + self.moe(self.post_attention_norm(x))


class MoEForCausalLM(nn.Module):
    """Decoder-only MoE LM: ``forward(input_ids[B,S], attention_mask[B,S]) -> logits[B,S,V]``."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        nn.init.normal_(self.embed_tokens.weight, std=1.0)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.dim_head, cfg.rope_theta)
        self.training_kernels = False

    def use_training_kernels(self, enabled: bool = True) -> "MoEForCausalLM":
        """Fused attention (SDPA, causal, no padding mask) and expert-grouped MoE: the same
        function at training batch sizes. Exports must keep them off (the default)."""
        self.training_kernels = enabled
        for mod in self.modules():
            if isinstance(mod, Experts):
                mod.grouped = enabled
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s = input_ids.shape
        x = self.embed_tokens(input_ids)  # B, S, D
        positions = torch.arange(s, device=input_ids.device)
        cos, sin = self.rotary(positions)  # S, Dh
        if self.training_kernels:
            if attention_mask is not None and not bool(attention_mask.all()):
                raise ValueError("training kernels support no padding: pass attention_mask=None or all ones")
            for layer in self.layers:
                x = layer(x, cos, sin, None)
            return self.lm_head(self.norm(x))
        causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()  # S, S
        allowed = causal[None, None]
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, None, :].bool()  # B, 1, S, S
        mask = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill(~allowed, torch.finfo(x.dtype).min)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.lm_head(self.norm(x))


def build_reference(cfg: MoEConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> MoEForCausalLM:
    """Build the reference model with deterministic random weights."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = MoEForCausalLM(cfg)
        # norms start away from one so that a wrongly mapped norm weight shows in numerics
        with torch.no_grad():
            for mod in model.modules():
                if isinstance(mod, RMSNorm):
                    mod.weight.uniform_(0.5, 1.5)
                if isinstance(mod, Router) and mod.bias is not None:  # a bias that matters, as a trained one does
                    mod.bias.uniform_(-0.1, 0.1)
    finally:
        torch.random.set_rng_state(gen_state)
    return model.to(dtype).eval()
