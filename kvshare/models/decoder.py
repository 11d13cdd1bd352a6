"""One decoder-only model covering Llama, Qwen3, Gemma 3 and the Qwen3.5 hybrid.

The families differ only in details the config names: q/k norms (Qwen3, Gemma 3, Qwen3.5),
(1 + w) norms in float32 (Gemma 3, Qwen3.5), Gemma's sandwich norms around attention and
MLP and scaled embeddings, GELU, per-layer sliding windows and per-kind rotary embeddings,
partial rotary and gated attention output (Qwen3.5), and the token mixer of each layer:
attention, or Gated DeltaNet for Qwen3.5's "linear" layers.
Parameter names follow HF checkpoints except for the fused `qkv_proj`, `gate_up_proj` and
`in_proj`, which `PACKED_PARAMETERS` maps.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from kvshare.models.attention import AttentionContext, RecurrentStateContext
from kvshare.models.config import ModelConfig
from kvshare.models.gated_deltanet import GatedDeltaNet
from kvshare.models.layers import GatedMLP, RMSNorm, SelfAttention, rope_cos_sin, rope_inv_freq

# HF parameter name fragment -> (fused parameter name fragment, shard index).
PACKED_PARAMETERS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "in_proj_qkv": ("in_proj", 0),
    "in_proj_z": ("in_proj", 1),
    "in_proj_b": ("in_proj", 2),
    "in_proj_a": ("in_proj", 3),
}


def packed_shard_sizes(config: ModelConfig, fused: str) -> tuple[int, ...]:
    """Rows of each HF tensor inside the fused parameter `fused`, in shard order."""
    if fused == "qkv_proj":
        kv = config.num_kv_heads * config.head_dim
        return config.q_proj_size, kv, kv
    if fused == "gate_up_proj":
        return config.intermediate_size, config.intermediate_size
    if fused == "in_proj":
        heads = config.linear_num_value_heads
        return config.linear_conv_dim, config.linear_value_dim, heads, heads
    raise ValueError(f"{fused!r} is not a fused parameter")


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        offset = config.unit_offset_norms
        eps = config.rms_norm_eps
        self.kind = config.layer_kinds[layer]
        # The token mixer: attention over the KV cache, or Gated DeltaNet over recurrent state.
        if self.kind == "linear":
            self.linear_attn = GatedDeltaNet(config, layer)
        else:
            self.self_attn = SelfAttention(config, layer)
        self.mlp = GatedMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, offset)
        # Gemma normalizes the outputs of attention and MLP too ("sandwich" norms); there
        # post_attention_layernorm is the attention output's norm, elsewhere the MLP input's.
        self.sandwich = config.uses_gemma_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        ctx: AttentionContext,
    ) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        if self.kind == "linear":
            attn = self.linear_attn(normed, cast(RecurrentStateContext, ctx))
        else:
            cos, sin = rope[self.kind]
            attn = self.self_attn(normed, cos, sin, ctx)
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
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.unit_offset_norms)


class CausalLM(nn.Module):
    """forward(input_ids [T], positions [T], ctx) -> hidden [T, H]; logits on request.

    A hybrid model (with linear layers) needs a ctx that is also a RecurrentStateContext.
    """

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
        """cos/sin per attention layer kind, computed once per forward and shared by all layers."""
        tables = {}
        for kind in set(self.config.layer_kinds) - {"linear"}:
            layer = self.config.layer_kinds.index(kind)
            inv_freq = rope_inv_freq(
                self.config.rope_of(layer), self.config.rotary_dim, positions.device
            )
            tables[kind] = rope_cos_sin(positions, inv_freq, dtype)
        return tables

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        hidden, rope = self.embed(input_ids, positions)
        return self.forward_layers(hidden, rope, ctx, range(self.config.num_layers))

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """The first layer's input and the step's rotary tables (forward's first part)."""
        embed = self.model.embed_tokens
        hidden = embed(input_ids)
        if self.config.uses_gemma_norms:
            # HF multiplies by sqrt(hidden) rounded to the weights' dtype.
            hidden = hidden * torch.tensor(self.config.hidden_size**0.5, dtype=embed.weight.dtype)
        return hidden, self.rope_tables(positions, hidden.dtype)

    def forward_layers(
        self,
        hidden: torch.Tensor,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        ctx: AttentionContext,
        layers: range,
    ) -> torch.Tensor:
        """Run `layers` in order; a range that ends at the last layer also applies the final
        norm, so consecutive ranges from layer 0 to the end compose to forward()."""
        for i in layers:
            hidden = self.model.layers[i](hidden, rope, ctx)
        if layers.stop == self.config.num_layers:
            hidden = self.model.norm(hidden)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()
