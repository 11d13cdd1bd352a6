"""One decoder-only transformer covering Llama, Qwen3 and Gemma 3.

The families differ only in details the config names: q/k norms (Qwen3, Gemma 3),
Gemma's (1 + w) norms in float32, sandwich norms around attention and MLP, scaled
embeddings, GELU, per-layer sliding windows and per-kind rotary embeddings.
Parameter names follow HF checkpoints except for the fused `qkv_proj` and
`gate_up_proj`, which `PACKED_PARAMETERS` maps.
"""

from __future__ import annotations

import torch
from torch import nn

from kvshare.models.attention import AttentionContext
from kvshare.models.config import ModelConfig
from kvshare.models.layers import GatedMLP, RMSNorm, SelfAttention, rope_cos_sin, rope_inv_freq

# HF parameter name fragment -> (fused parameter name fragment, shard index).
PACKED_PARAMETERS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        gemma = config.uses_gemma_norms
        eps = config.rms_norm_eps
        self.kind = config.layer_kinds[layer]
        self.self_attn = SelfAttention(config, layer)
        self.mlp = GatedMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, gemma)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, gemma)
        # Gemma normalizes the outputs of attention and MLP too ("sandwich" norms); there
        # post_attention_layernorm is the attention output's norm, elsewhere the MLP input's.
        self.sandwich = gemma
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, gemma)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, gemma)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        ctx: AttentionContext,
    ) -> torch.Tensor:
        cos, sin = rope[self.kind]
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, ctx)
        if self.sandwich:
            hidden = hidden + self.post_attention_layernorm(attn)
            return hidden + self.post_feedforward_layernorm(
                self.mlp(self.pre_feedforward_layernorm(hidden))
            )
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.uses_gemma_norms)


class CausalLM(nn.Module):
    """forward(input_ids [T], positions [T], ctx) -> hidden [T, H]; logits on request."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def rope_tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin per layer kind, computed once per forward and shared by all layers."""
        tables = {}
        for kind in set(self.config.layer_kinds):
            layer = self.config.layer_kinds.index(kind)
            inv_freq = rope_inv_freq(self.config.rope_of(layer), self.config.head_dim, positions.device)
            tables[kind] = rope_cos_sin(positions, inv_freq, dtype)
        return tables

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        embed = self.model.embed_tokens
        hidden = embed(input_ids)
        if self.config.uses_gemma_norms:
            # HF multiplies by sqrt(hidden) rounded to the weights' dtype.
            hidden = hidden * torch.tensor(self.config.hidden_size**0.5, dtype=embed.weight.dtype)
        rope = self.rope_tables(positions, hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(hidden, rope, ctx)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()
