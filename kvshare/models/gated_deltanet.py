"""Gated DeltaNet, the linear-attention layer of Qwen3.5: torch reference and module.

Per value head the layer keeps a state S [Dk, Dv] and, for each token,
    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
with q, k l2-normalized (q also scaled by Dk^-0.5), beta = sigmoid(b) and
g = -exp(A_log) softplus(a + dt_bias) <= 0, so the state decays and the delta rule only
writes what S does not already predict. Before that, q, k and v pass a causal depthwise
conv (kernel K) whose last K-1 inputs are the second piece of per-sequence state.

Tokens arrive packed: the T tokens of a step are the new tokens of several sequences
(`seq_lens`), each with its own state. The reference math here runs in float32 and matches
HF's torch reference; on CUDA the module calls the Triton kernels of `gdn_triton` instead.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvshare.models.attention import RecurrentStateContext
from kvshare.models.config import ModelConfig
from kvshare.models.layers import DerivedTensor

if TYPE_CHECKING:
    from kvshare.models.gdn_triton import PrefillTables

DEFAULT_CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (HF's and FLA's l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, Hk, Dk] -> float32 [T, Hv, Dk]: normalized, q scaled, key head h // (Hv/Hk) per value head h."""
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    repeat = num_v_heads // k.shape[1]
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    return q * q.shape[-1] ** -0.5, k


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. q, k [..., L, Dk] (prepared), v [..., L, Dv], g, beta [..., L],
    state [..., Dk, Dv]; float32. Returns (o [..., L, Dv], final state)."""
    out = torch.empty_like(v)
    for t in range(v.shape[-2]):
        state = state * g[..., t, None, None].exp()
        predicted = (k[..., t, :, None] * state).sum(-2)
        delta = (v[..., t, :] - predicted) * beta[..., t, None]
        state = state + k[..., t, :, None] * delta[..., None, :]
        out[..., t, :] = (q[..., t, :, None] * state).sum(-2)
    return out, state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as `recurrent_gated_delta_rule`, a chunk of tokens at a time.

    Within a chunk, with gamma_t the cumulative log decay since the chunk start, the state
    after token t is exp(gamma_t) S0 + sum_{s<=t} exp(gamma_t - gamma_s) k_s u_s^T, where the
    corrections u solve the unit lower-triangular system (I + A) u = beta v - beta exp(gamma) K S0,
    A[t, s] = beta_t exp(gamma_t - gamma_s) k_t.k_s (s < t): a few matmuls per chunk, and a
    sequential loop only over chunks.
    """
    length = v.shape[-2]
    pad = -length % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))  # g = 0, beta = 0: padding leaves S as is
    lead = v.shape[:-2]
    q, k, v = (x.reshape(*lead, -1, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(*lead, -1, chunk), beta.reshape(*lead, -1, chunk)
    gamma = g.cumsum(-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).triu(1)
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = torch.eye(chunk, device=v.device) + (k_beta @ k.transpose(-1, -2) * decay).tril(-1)
    u_values = torch.linalg.solve_triangular(
        system, v * beta[..., None], upper=False, unitriangular=True
    )
    u_keys = torch.linalg.solve_triangular(
        system, k_beta * gamma.exp()[..., None], upper=False, unitriangular=True
    )
    scores = q @ k.transpose(-1, -2) * decay
    q_decayed = q * gamma.exp()[..., None]
    last = gamma[..., -1:]
    k_to_end = k * (last - gamma).exp()[..., None]
    out = torch.empty_like(v)
    for c in range(v.shape[-3]):
        u = u_values[..., c, :, :] - u_keys[..., c, :, :] @ state
        out[..., c, :, :] = q_decayed[..., c, :, :] @ state + scores[..., c, :, :] @ u
        state = state * last[..., c, :, None].exp() + k_to_end[..., c, :, :].transpose(-1, -2) @ u
    return out.reshape(*lead, -1, v.shape[-1])[..., :length, :], state


def gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    seq_lens: tuple[int, ...],
    *,
    chunked: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences. q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv] float32;
    state [B, Hv, Dk, Dv] float32. Returns (o [T, Hv, Dv] float32, final state [B, Hv, Dk, Dv]).

    `chunked` picks the form; by default chunked for segments longer than one token (as HF).
    """
    q, k = prepare_qk(q, k, v.shape[1])
    v = v.float()
    if chunked is None and is_decode(seq_lens):
        # One token per sequence: one vectorized step for all of them.
        o, final = recurrent_gated_delta_rule(*(x.unsqueeze(2) for x in (q, k, v, g, beta)), state)
        return o.squeeze(2), final
    outs, finals = [], []
    for i, segment in enumerate(_segments(seq_lens)):
        args = [x[segment].transpose(0, 1) for x in (q, k, v, g, beta)]
        use_chunks = chunked if chunked is not None else segment.stop - segment.start > 1
        form = chunk_gated_delta_rule if use_chunks else recurrent_gated_delta_rule
        o, final = form(*args, state[i].float())
        outs.append(o.transpose(0, 1))
        finals.append(final)
    return torch.cat(outs), torch.stack(finals)


def is_decode(seq_lens: tuple[int, ...]) -> bool:
    """Every sequence brings one token: the fast paths need no per-step index tensors."""
    return all(n == 1 for n in seq_lens)


def _segments(seq_lens: tuple[int, ...]) -> list[slice]:
    bounds = itertools.accumulate(seq_lens, initial=0)
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    seq_lens: tuple[int, ...],
    tables: PrefillTables | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel for prefill steps on CUDA or given the step's `tables` (which only
    it reads), the torch reference otherwise."""
    if tables is not None or (x.is_cuda and not is_decode(seq_lens)):
        from kvshare.models import gdn_triton

        return gdn_triton.causal_conv1d(x, weight, conv_state, seq_lens, tables)
    return causal_conv1d_reference(x, weight, conv_state, seq_lens)


def causal_conv1d_reference(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, seq_lens: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(depthwise causal conv) of packed sequences, each continuing from its conv state.

    x [T, C]; weight [C, K]; conv_state [B, C, K-1] (the sequence's last K-1 inputs, oldest
    first). Returns (out [T, C], new conv_state [B, C, K-1]) in x's dtype. A segment shorter
    than K-1 keeps part of the old state in the new one.
    """
    if is_decode(seq_lens):  # no index tensors built from seq_lens: CUDA-graph safe
        window = torch.cat((conv_state, x[:, :, None]), dim=-1)
        out = F.silu((window * weight).sum(-1))
        return out, window[:, :, 1:]
    width = weight.shape[1] - 1
    lens = torch.tensor(seq_lens, device=x.device)
    seq_of_token = torch.repeat_interleave(torch.arange(len(seq_lens), device=x.device), lens)
    # One buffer [C, T + B(K-1)] holding, per sequence, its state then its new inputs.
    x_cols = torch.arange(x.shape[0], device=x.device) + width * (seq_of_token + 1)
    ends = torch.cumsum(lens, 0) + width * torch.arange(1, len(seq_lens) + 1, device=x.device)
    state_cols = (ends - lens - width)[:, None] + torch.arange(width, device=x.device)
    buffer = x.new_empty(x.shape[1], x.shape[0] + width * len(seq_lens))
    buffer[:, state_cols.flatten()] = conv_state.transpose(0, 1).reshape(x.shape[1], -1)
    buffer[:, x_cols] = x.t()
    # Output column j of the valid conv sees buffer columns j .. j+K-1.
    conv = F.conv1d(buffer[None], weight[:, None, :], groups=x.shape[1])[0]
    out = F.silu(conv[:, x_cols - width]).t().contiguous()
    new_cols = (ends - width)[:, None] + torch.arange(width, device=x.device)
    return out, buffer[:, new_cols].transpose(0, 1).contiguous()


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    seq_lens: tuple[int, ...],
    tables: PrefillTables | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernels on CUDA or given `tables`, the torch reference elsewhere (same
    contract)."""
    if tables is not None or q.is_cuda:
        from kvshare.models import gdn_triton

        return gdn_triton.gated_delta_rule(q, k, v, g, beta, state, seq_lens, tables)
    return gated_delta_rule_reference(q, k, v, g, beta, state, seq_lens)


class RMSNormGated(nn.Module):
    """w * rmsnorm(x) * silu(gate), HF's op order; w scales directly (not 1 + w)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            # One fused norm (float32 inside, w applied before its one rounding) and three
            # kernels for the gate, where HF's op sequence below (the CPU path, the parity
            # reference) launches twelve: a step of a few tokens is bound by launches.
            normed = F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)
            return (normed * F.silu(gate.float())).to(x.dtype)
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention mixer. HF's in_proj_qkv/z/b/a are fused into `in_proj`."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_v_heads = config.linear_num_value_heads
        self.key_head_dim = config.linear_key_head_dim
        self.value_head_dim = config.linear_value_head_dim
        self.qkv_sizes = (config.linear_key_dim, config.linear_key_dim, config.linear_value_dim)
        conv_dim = config.linear_conv_dim
        self.split_sizes = (conv_dim, config.linear_value_dim, self.num_v_heads, self.num_v_heads)
        self.in_proj = nn.Linear(config.hidden_size, sum(self.split_sizes), bias=False)
        # Only its weight [conv_dim, 1, K] is used (HF's parameter name and shape).
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, config.linear_conv_kernel_dim, groups=conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = RMSNormGated(self.value_head_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(config.linear_value_dim, config.hidden_size, bias=False)
        self._decay_rate = DerivedTensor()  # -exp(A_log), float32
        self._dt_bias = DerivedTensor()  # dt_bias, float32

    def forward(self, x: torch.Tensor, ctx: RecurrentStateContext) -> torch.Tensor:
        tokens = x.shape[0]
        mixed, z, b, a = self.in_proj(x).split(self.split_sizes, dim=-1)
        conv_state, state = ctx.load_state(self.layer)
        weight = self.conv1d.weight[:, 0]
        tables = ctx.prefill_tables(weight.shape[1] - 1)
        mixed, conv_state = causal_conv1d(mixed, weight, conv_state, ctx.seq_lens, tables)
        q, k, v = mixed.split(self.qkv_sizes, dim=-1)
        q = q.view(tokens, -1, self.key_head_dim)
        k = k.view(tokens, -1, self.key_head_dim)
        v = v.view(tokens, -1, self.value_head_dim)
        beta = b.float().sigmoid()
        decay_rate = self._decay_rate.get((self.A_log,), lambda: -self.A_log.float().exp())
        dt_bias = self._dt_bias.get((self.dt_bias,), self.dt_bias.float)
        g = decay_rate * F.softplus(a.float() + dt_bias)
        out, state = gated_delta_rule(q, k, v, g, beta, state, ctx.seq_lens, tables)
        ctx.save_state(self.layer, conv_state, state)
        out = self.norm(out.to(x.dtype), z.reshape(tokens, -1, self.value_head_dim))
        return self.out_proj(out.reshape(tokens, -1))
