"""fp8 KV: e4m3 values with one float32 scale per token and KV head, packed in bytes.

A packed cache row (one token, one KV head) is `head_dim` float8_e4m3fn bytes followed by
the 4 bytes of its float32 scale, in one uint8 tensor whose last dim is head_dim + 4. So
blocks, pool pages, transfers and checksums stay plain byte copies of the cache, and the
scales travel with their values wherever the bytes go.

The scale is amax(|x|) x (1/448) over the row: a token's stored bytes are a pure function of
its own K/V values (no calibration state, nothing shared between tokens), so a prefix
restored from the pool is byte-identical to the same prefix recomputed by the same model,
and every token uses e4m3's whole range.

Reading rows back (values x scale in float32, rounded to the compute dtype) goes a chunk
of tokens at a time: a long context's float32 products would be twice its keys in bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshare.engine.config import KVCacheDtype
from kvshare.engine.memory import DEQUANT_CHUNK_TOKENS, packed_head_bytes
from kvshare.engine.memory import FP8_SCALE_BYTES as SCALE_BYTES

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


def dequantize(
    packed: torch.Tensor, dtype: torch.dtype, chunk_tokens: int = DEQUANT_CHUNK_TOKENS
) -> torch.Tensor:
    """Packed rows [T, ..., D + 4] -> [T, ..., D] in `dtype` (values x scale, in float32),
    `chunk_tokens` of dim 0 at a time."""
    out = torch.empty((*packed.shape[:-1], head_dim_of(packed)), dtype=dtype, device=packed.device)
    products = torch.empty(
        (min(chunk_tokens, len(packed)), *out.shape[1:]), dtype=torch.float32, device=out.device
    )
    for start in range(0, len(packed), chunk_tokens):
        stop = start + chunk_tokens
        _dequantize_chunk(packed[start:stop], out[start:stop], products)
    return out


def head_dim_of(cache: torch.Tensor) -> int:
    """The head dim of rows of a cache in the compute dtype, or of packed rows."""
    return cache.shape[-1] - SCALE_BYTES if is_packed(cache) else cache.shape[-1]


def _dequantize_chunk(packed: torch.Tensor, out: torch.Tensor, products: torch.Tensor) -> None:
    """out = packed rows' values x scale, computed in `products` (float32, at least as many
    rows) and rounded to out's dtype: the same operations, so the same bits, as
    `(values.float() * scales).to(dtype)` on a whole tensor."""
    products = products[: len(packed)]
    products.copy_(values(packed))
    products.mul_(scales(packed))
    out.copy_(products)


@dataclass(frozen=True)
class GatherBuffers:
    """What attention gathers one layer's cache rows into: keys and values in the compute
    dtype for up to `tokens` tokens and, for a packed cache, one chunk of packed rows and
    of their float32 products (reading a packed cache allocates nothing else). Allocated
    once per backend, their size does not follow the context from step to step, so the
    CUDA caching allocator keeps no ever-larger blocks (kvshare.engine.memory counts them
    as the attention context)."""

    keys: torch.Tensor  # [tokens, Hkv, D] in the compute dtype
    values: torch.Tensor
    packed: torch.Tensor | None  # [chunk, Hkv, D + 4] uint8; None for a cache in the compute dtype
    products: torch.Tensor | None  # [chunk, Hkv, D] float32

    @classmethod
    def allocate(
        cls,
        tokens: int,
        cache: torch.Tensor,
        dtype: torch.dtype,
        chunk_tokens: int = DEQUANT_CHUNK_TOKENS,
    ) -> GatherBuffers:
        """Buffers for gathering up to `tokens` rows of `cache` [slots, Hkv, row] in `dtype`."""
        if tokens < 1 or chunk_tokens < 1:
            raise ValueError(f"gather buffers need tokens, chunk >= 1: {tokens}, {chunk_tokens}")
        heads, dev = cache.shape[1:-1], cache.device
        shape = (tokens, *heads, head_dim_of(cache))
        packed = products = None
        if is_packed(cache):
            chunk = min(chunk_tokens, tokens)
            packed = torch.empty((chunk, *cache.shape[1:]), dtype=torch.uint8, device=dev)
            products = torch.empty((chunk, *shape[1:]), dtype=torch.float32, device=dev)
        return cls(
            torch.empty(shape, dtype=dtype, device=dev),
            torch.empty(shape, dtype=dtype, device=dev),
            packed,
            products,
        )

    def fits(self, cache: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether these buffers take rows of `cache` in `dtype`."""
        return (
            self.keys.dtype == dtype
            and self.keys.device == cache.device
            and self.keys.shape[1:] == (*cache.shape[1:-1], head_dim_of(cache))
            and (self.packed is not None) == is_packed(cache)
        )

    def gather(self, cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Rows `slots` of `cache` into the first len(slots) rows of `out` (self.keys or
        self.values), in its dtype; a packed cache is dequantized a chunk at a time."""
        n = len(slots)
        if n > len(out):
            raise ValueError(f"gathering {n} keys into buffers of {len(out)}")
        out = out[:n]
        if self.packed is None:
            if cache.dtype == out.dtype:
                return torch.index_select(cache, 0, slots, out=out)
            return out.copy_(cache.index_select(0, slots))
        assert self.products is not None
        chunk = len(self.packed)
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            rows = torch.index_select(cache, 0, slots[start:stop], out=self.packed[: stop - start])
            _dequantize_chunk(rows, out[start:stop], self.products)
        return out
