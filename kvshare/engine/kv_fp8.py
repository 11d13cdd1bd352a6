"""fp8 KV: e4m3 values with one float32 scale per token and KV head, packed in bytes.

A packed cache row (one token, one KV head) is `head_dim` float8_e4m3fn bytes followed by
the 4 bytes of its float32 scale, in one uint8 tensor whose last dim is head_dim + 4. So
blocks, pool pages, transfers and checksums stay plain byte copies of the cache, and the
scales travel with their values wherever the bytes go.

The scale is amax(|x|) x (1/448) over the row: a token's stored bytes are a pure function of
its own K/V values (no calibration state, nothing shared between tokens), so a prefix
restored from the pool is byte-identical to the same prefix recomputed by the same model,
and every token uses e4m3's whole range.
"""

from __future__ import annotations

import torch

from kvshare.engine.config import KVCacheDtype
from kvshare.engine.memory import FP8_SCALE_BYTES as SCALE_BYTES
from kvshare.engine.memory import packed_head_bytes

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
_INV_FP8_MAX = 1.0 / FP8_MAX
_TINY = torch.finfo(torch.float32).tiny  # the scale of an all-zero row: keeps 0 / scale finite


def row_bytes(head_dim: int, model_dtype: torch.dtype, kv_cache_dtype: KVCacheDtype) -> int:
    """Bytes the cache stores per token, KV head and K or V."""
    if kv_cache_dtype == "fp8":
        return packed_head_bytes(head_dim)
    return head_dim * torch.empty((), dtype=model_dtype).element_size()


def is_packed(cache: torch.Tensor) -> bool:
    """Whether a cache tensor holds packed fp8 rows (no model computes in uint8)."""
    return cache.dtype == torch.uint8


def to_compute(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows gathered for attention, in the compute dtype (dequantized if packed)."""
    return dequantize(rows, dtype) if is_packed(rows) else rows.to(dtype)


def kv_format(model_dtype: torch.dtype, kv_cache_dtype: KVCacheDtype) -> str:
    """The name of what the cache stores, for the pool namespace: the model dtype, or the
    packed fp8 format together with the dtype its values were computed in (the same fp8
    bytes follow only from the same K/V values)."""
    compute = str(model_dtype).removeprefix("torch.")
    if kv_cache_dtype == "auto":
        return compute
    if kv_cache_dtype == "fp8":
        return f"float8_e4m3fn+float32_scale_per_token_kv_head/{compute}"
    raise ValueError(f"unknown kv cache dtype {kv_cache_dtype!r}")


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> packed uint8 [..., D + 4]."""
    head_dim = x.shape[-1]
    packed = torch.empty(
        (*x.shape[:-1], packed_head_bytes(head_dim)), dtype=torch.uint8, device=x.device
    )
    x32 = x.float()
    # A product, not `amax / 448`: CUDA divides a tensor by a scalar as a product with the
    # scalar's reciprocal, the CPU truly divides, and the scales must be the same bits.
    scale = (x32.abs().amax(-1, keepdim=True) * _INV_FP8_MAX).clamp_min(_TINY)
    # x / scale can round just past 448; e4m3fn has no infinity and casts overflow to NaN.
    packed[..., :head_dim] = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    packed[..., head_dim:] = scale.view(torch.uint8)
    return packed


def values(packed: torch.Tensor) -> torch.Tensor:
    """The e4m3 values of packed rows [..., D + 4], as a float8 view [..., D] (no copy)."""
    return packed[..., : packed.shape[-1] - SCALE_BYTES].view(FP8)


def scales(packed: torch.Tensor) -> torch.Tensor:
    """The scales of packed rows [..., D + 4], as a float32 view [..., 1] (no copy)."""
    return packed[..., packed.shape[-1] - SCALE_BYTES :].view(torch.float32)


def dequantize(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed rows [..., D + 4] -> [..., D] in `dtype` (values x scale, in float32)."""
    return (values(packed).float() * scales(packed)).to(dtype)
