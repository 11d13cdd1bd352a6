"""Building blocks shared by the decoder families: norms, rotary embedding, MLP, attention."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvshare.models.attention import AttentionContext
from kvshare.models.config import ModelConfig, RopeConfig


class DerivedTensor:
    """A tensor computed from parameters once instead of in every forward. A step of a few
    tokens run eagerly (more sequences than a captured short step holds) is bound by the
    host's kernel launches, and each use saves one or more; a captured graph holds fewer
    kernels. Recomputed whenever a source differs from the last computation
    (another tensor, storage or in-place version), so loading or moving weights is seen. A
    captured CUDA graph keeps reading the value it was captured with: an engine's weights do
    not change while it runs."""

    def __init__(self) -> None:
        self._key: tuple[tuple[int, int, int], ...] = ()
        self._value: torch.Tensor | None = None

    def get(
        self, sources: tuple[torch.Tensor, ...], compute: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        key = tuple((id(s), s.data_ptr(), s._version) for s in sources)
        if self._value is None or key != self._key:
            # A plain tensor without history, also when first asked inside inference mode:
            # a later forward that records autograd may use it.
            with torch.inference_mode(False), torch.no_grad():
                self._value = compute()
            self._key = key
        return self._value


class RMSNorm(nn.Module):
    """RMSNorm in float32. Llama/Qwen3 scale by w after casting back; Gemma 3 and Qwen3.5 by
    (1 + w) before (`unit_offset`)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.empty(dim))
        self._scale = DerivedTensor()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            # One fused kernel (fp32 inside) instead of ~8 passes over the activations;
            # the CPU path below is HF's exact op sequence (the parity reference).
            weight = (
                self._scale.get((self.weight,), lambda: 1.0 + self.weight)
                if self.unit_offset
                else self.weight
            )
            return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int, device: torch.device) -> torch.Tensor:
    """Inverse frequencies in float32, computed exactly as HF computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv = 1.0 / (rope.theta**exponents)
    if rope.scaling == "linear":
        return inv / rope.factor
    if rope.scaling == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, D] for the given positions (HF's cat(freqs, freqs) layout)."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, R] rotate the first R <= D dims (partial rotary), the rest pass."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gelu = config.hidden_act == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)


class SelfAttention(nn.Module):
    """Projections, optional q/k norms, rotary embedding; the context does the attention.

    With an output gate (Qwen3.5), q_proj yields [query | gate] per head and the attention
    output is multiplied by sigmoid(gate) before o_proj.
    """

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attn_scale
        self.window = config.window_of(layer)
        self.output_gate = config.attn_output_gate
        kv_size = config.num_kv_heads * config.head_dim
        self.split_sizes = (config.q_proj_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(
            config.hidden_size, sum(self.split_sizes), bias=config.attention_bias
        )
        self.o_proj = nn.Linear(
            config.num_heads * config.head_dim, config.hidden_size, bias=config.attention_bias
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.unit_offset_norms)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.unit_offset_norms)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        gate = None
        if self.output_gate:
            q, gate = q.view(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        out = ctx.attend(self.layer, q, k, v, scale=self.scale, window=self.window)
        out = out.reshape(-1, self.num_heads * self.head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(out.shape))
        return self.o_proj(out)
