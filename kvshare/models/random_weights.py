"""Deterministic random weights: a pure function of (parameter name, seed, dtype).

Values come from a counter-based hash (splitmix64) evaluated with integer tensor ops on
the target device, so a 27B model is generated in place on the GPU, and CPU and CUDA
produce bit-identical weights: two replicas with the same seed hold the same model.
"""

from __future__ import annotations

import math

import torch
import xxhash
from torch import nn

_SLICE = 1 << 24  # elements hashed per step; bounds the int64 temporaries to 128 MiB


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(counter: torch.Tensor) -> torch.Tensor:
    # int64 products wrap modulo 2**64 on CPU and CUDA alike, as splitmix64 needs.
    z = counter * _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MUL1
    z = (z ^ _shift_right(z, 27)) * _MUL2
    return z ^ _shift_right(z, 31)


def fill_uniform_(tensor: torch.Tensor, key: int, low: float, high: float) -> None:
    """Fill `tensor` in place with values uniform in [low, high) from the hash stream `key`."""
    flat = tensor.view(-1)
    for start in range(0, flat.numel(), _SLICE):
        stop = min(start + _SLICE, flat.numel())
        counter = torch.arange(start, stop, dtype=torch.int64, device=tensor.device) + key
        unit = _shift_right(_splitmix64(counter), 40).float() * (1.0 / (1 << 24))
        flat[start:stop] = (unit * (high - low) + low).to(tensor.dtype)


def _parameter_key(seed: int, name: str) -> int:
    return _signed(xxhash.xxh3_64_intdigest(f"kvshare-random:{seed}:{name}".encode()))


def fill_random_weights_(
    model: nn.Module, seed: int, *, unit_offset_norms: bool, std: float = 0.02
) -> None:
    """Initialize every parameter of `model` from (name, seed); norms near identity."""
    bound = std * math.sqrt(3.0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            low, high = _value_range(name, param, unit_offset_norms, bound)
            fill_uniform_(param, _parameter_key(seed, name), low, high)


def _value_range(
    name: str, param: torch.Tensor, unit_offset_norms: bool, bound: float
) -> tuple[float, float]:
    if name.endswith("linear_attn.norm.weight"):
        return 0.9, 1.1  # the gated norm scales by w, whatever the other norms do
    if name.endswith("norm.weight"):
        # Llama scales by w, Gemma and Qwen3.5 by (1 + w): both start near identity.
        center = 0.0 if unit_offset_norms else 1.0
        return center - 0.1, center + 0.1
    # Gated DeltaNet, in HF's init ranges: decay rates A = exp(A_log) in [0.01, 16] (from
    # near-perfect memory to forgetting within a token), dt_bias around HF's 1, and the conv
    # in torch's default range 1/sqrt(kernel), so that its outputs are not vanishingly small.
    if name.endswith("A_log"):
        return math.log(0.01), math.log(16.0)
    if name.endswith("dt_bias"):
        return 0.5, 1.5
    if name.endswith("conv1d.weight"):
        limit = param.shape[-1] ** -0.5
        return -limit, limit
    return -bound, bound
