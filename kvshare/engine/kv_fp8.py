"""fp8 KV: e4m3 values with one float32 scale per token and KV head, in a byte cache.

A packed cache is one uint8 tensor of the same size as [slots, Hkv, D + 4] (D e4m3 bytes
and a 4-byte float32 scale per token and KV head), so blocks, pool pages, transfers and
checksums stay plain byte copies of the cache and the scales travel with their values
wherever a block goes. Inside each block the bytes are two planes (`PackedBlocks`): first
the block's values, head-major [Hkv, block_size, D], then its scales [Hkv, block_size].
Every value row then starts on a D-byte boundary: with D a multiple of 16 the paged
kernel brings a tile with 16-byte copies (token-major rows of D + 4 bytes are only 4-byte
aligned, and Triton then copies them 4 bytes at a time).

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
INV_FP8_MAX = 1.0 / FP8_MAX
TINY_SCALE = torch.finfo(torch.float32).tiny  # an all-zero row's scale: 0 / scale stays finite


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
    packed fp8 format (with its block layout) together with the dtype its values were
    computed in (the same fp8 bytes follow only from the same K/V values)."""
    compute = str(model_dtype).removeprefix("torch.")
    if kv_cache_dtype == "auto":
        return compute
    if kv_cache_dtype == "fp8":
        return f"float8_e4m3fn+float32_scale_per_token_kv_head,block_planes/{compute}"
    raise ValueError(f"unknown kv cache dtype {kv_cache_dtype!r}")


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (e4m3 values [..., D], float32 scales [...])."""
    x32 = x.float()
    # A product, not `amax / 448`: CUDA divides a tensor by a scalar as a product with the
    # scalar's reciprocal, the CPU truly divides, and the scales must be the same bits.
    scale = (x32.abs().amax(-1, keepdim=True) * INV_FP8_MAX).clamp_min(TINY_SCALE)
    # x / scale can round just past 448; e4m3fn has no infinity and casts overflow to NaN.
    values = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values, scale.squeeze(-1)


def dequantize(
    values: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype,
    chunk_tokens: int = DEQUANT_CHUNK_TOKENS,
) -> torch.Tensor:
    """values [T, ..., D] e4m3 and scales [T, ...] -> [T, ..., D] in `dtype` (values x
    scale, in float32), `chunk_tokens` of dim 0 at a time."""
    out = torch.empty(values.shape, dtype=dtype, device=values.device)
    products = torch.empty(
        (min(chunk_tokens, len(values)), *out.shape[1:]), dtype=torch.float32, device=out.device
    )
    for start in range(0, len(values), chunk_tokens):
        stop = start + chunk_tokens
        _dequantize_chunk(values[start:stop], scales[start:stop], out[start:stop], products)
    return out


def head_dim_of(cache: torch.Tensor) -> int:
    """The head dim of a cache in the compute dtype, or of a packed one."""
    return cache.shape[-1] - SCALE_BYTES if is_packed(cache) else cache.shape[-1]


def _dequantize_chunk(
    values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, products: torch.Tensor
) -> None:
    """out = values x scales, computed in `products` (float32, at least as many rows) and
    rounded to out's dtype: the same operations, so the same bits, as
    `(values.float() * scales[..., None]).to(dtype)` on a whole tensor."""
    products = products[: len(values)]
    products.copy_(values)
    products.mul_(scales[..., None])
    out.copy_(products)


def plane_bytes(block_size: int, kv_heads: int, head_dim: int) -> tuple[int, int]:
    """Bytes of a packed block's value plane and of the whole block (values, then scales)."""
    values = block_size * kv_heads * head_dim
    return values, values + block_size * kv_heads * SCALE_BYTES


@dataclass(frozen=True)
class PackedBlocks:
    """One layer's K (or V) packed cache seen through its two planes per block.

    `values` [blocks, block_size, Hkv, D] (e4m3) and `scales` [blocks, block_size, Hkv]
    (float32) are strided views of the cache's bytes, indexed by (block, offset), a
    slot's `divmod(slot, block_size)`; in memory a block is its values head-major, then
    its scales head-major (module docstring).
    """

    values: torch.Tensor
    scales: torch.Tensor
    block_size: int

    @classmethod
    def of(cls, cache: torch.Tensor, block_size: int) -> PackedBlocks:
        """The planes of `cache`, uint8 of [slots, Hkv, D + 4] bytes (or [blocks,
        block_size, Hkv, D + 4]), contiguous, slots a multiple of `block_size`."""
        if not is_packed(cache) or not cache.is_contiguous():
            raise ValueError(f"not a contiguous packed cache: {cache.dtype}, {cache.shape}")
        heads, dim = cache.shape[-2], head_dim_of(cache)
        plane, block_bytes = plane_bytes(block_size, heads, dim)
        if cache.numel() % block_bytes:
            raise ValueError(f"{cache.numel()} cache bytes are not whole blocks of {block_bytes}")
        blocks = cache.reshape(-1, block_bytes)
        values = blocks[:, :plane].view(FP8).unflatten(1, (heads, block_size, dim))
        scales = blocks[:, plane:].view(torch.float32).unflatten(1, (heads, block_size))
        return cls(values.transpose(1, 2), scales.transpose(1, 2), block_size)

    def _index(self, slots: torch.Tensor) -> list[torch.Tensor]:
        return [slots // self.block_size, slots % self.block_size]

    def store(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize x [T, Hkv, D] into `slots` [T]."""
        values, scales = quantize(x)
        at = self._index(slots)
        # Moved as bytes, as every other copy of the cache: nothing here depends on a
        # device's float8 kernels.
        self.values.view(torch.uint8).index_put_(at, values.view(torch.uint8))
        self.scales.index_put_(at, scales)

    def read(
        self,
        slots: torch.Tensor,
        values: torch.Tensor | None = None,
        scales: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The values [T, Hkv, D] and scales [T, Hkv] of `slots` [T], into the given
        tensors (uint8 and float32 of those shapes) or new ones."""
        at = self._index(slots)
        if values is None:
            values = self.values.view(torch.uint8)[tuple(at)]
        else:
            torch.ops.aten.index.Tensor_out(self.values.view(torch.uint8), at, out=values)
        if scales is None:
            scales = self.scales[tuple(at)]
        else:
            torch.ops.aten.index.Tensor_out(self.scales, at, out=scales)
        return values.view(FP8), scales


def packed_cache(rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """A new packed cache holding rows [slots, Hkv, D] quantized (slots whole blocks): what
    storing them one step at a time writes."""
    cache = torch.empty(
        (*rows.shape[:-1], packed_head_bytes(rows.shape[-1])), dtype=torch.uint8, device=rows.device
    )
    PackedBlocks.of(cache, block_size).store(torch.arange(len(rows), device=rows.device), rows)
    return cache


@dataclass(frozen=True)
class GatherBuffers:
    """What attention gathers one layer's cache rows into: keys and values in the compute
    dtype for up to `tokens` tokens and, for a packed cache, one chunk of e4m3 values, of
    their scales and of their float32 products (reading a packed cache allocates nothing
    else but each chunk's block and offset indices). Allocated once per backend, their
    size does not follow the context from step to step, so the CUDA caching allocator
    keeps no ever-larger blocks (kvshare.engine.memory counts them as the attention
    context)."""

    keys: torch.Tensor  # [tokens, Hkv, D] in the compute dtype
    values: torch.Tensor
    chunk_values: torch.Tensor | None  # [chunk, Hkv, D] uint8; None for a compute-dtype cache
    chunk_scales: torch.Tensor | None  # [chunk, Hkv] float32
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
        chunk_values = chunk_scales = products = None
        if is_packed(cache):
            chunk = (min(chunk_tokens, tokens), *shape[1:])
            chunk_values = torch.empty(chunk, dtype=torch.uint8, device=dev)
            chunk_scales = torch.empty(chunk[:-1], dtype=torch.float32, device=dev)
            products = torch.empty(chunk, dtype=torch.float32, device=dev)
        return cls(
            torch.empty(shape, dtype=dtype, device=dev),
            torch.empty(shape, dtype=dtype, device=dev),
            chunk_values,
            chunk_scales,
            products,
        )

    def fits(self, cache: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether these buffers take rows of `cache` in `dtype`."""
        return (
            self.keys.dtype == dtype
            and self.keys.device == cache.device
            and self.keys.shape[1:] == (*cache.shape[1:-1], head_dim_of(cache))
            and (self.chunk_values is not None) == is_packed(cache)
        )

    def gather(
        self, cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """Rows `slots` of `cache` (blocks of `block_size` slots) into the first len(slots)
        rows of `out` (self.keys or self.values), in its dtype; a packed cache is
        dequantized a chunk at a time."""
        n = len(slots)
        if n > len(out):
            raise ValueError(f"gathering {n} keys into buffers of {len(out)}")
        out = out[:n]
        if self.chunk_values is None:
            if cache.dtype == out.dtype:
                return torch.index_select(cache, 0, slots, out=out)
            return out.copy_(cache.index_select(0, slots))
        assert self.chunk_scales is not None and self.products is not None
        blocks = PackedBlocks.of(cache, block_size)
        chunk = len(self.chunk_values)
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            values, scales = blocks.read(
                slots[start:stop],
                self.chunk_values[: stop - start],
                self.chunk_scales[: stop - start],
            )
            _dequantize_chunk(values, scales, out[start:stop], self.products)
        return out
