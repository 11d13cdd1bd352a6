"""Pool pages of a vLLM KV cache: whole blocks, copied byte for byte (no vLLM import here).

A KV page holds one chunk (`blocks_per_page` blocks) of every attention layer, in the order
of vLLM's KV cache groups: `[layer][block of the chunk][the block's bytes as vLLM lays them out]`.
A state page (hybrid models) holds one block of every recurrent-state (Mamba/GDN) layer: in
vLLM's prefix-caching "align" mode the state block at position p of a request's row is the
state after exactly (p + 1) x block_size tokens. Each layer reads the block ids of its own KV
cache group (ids are only meaningful within a group).
The bytes of a block are whatever the attention backend keeps there (vLLM CPU transposes K
inside each block), so a page is only meaningful to an engine of the same layout: the layout
(backend, block shape, dtype, layer names) is digested into the pool namespace, and only
whole blocks are copied, never token rows.

The checksum is the pool's page checksum (kvshare.kvpool.layout: keyed by the page key,
16 bytes); `PAGE_LAYOUT_VERSION` goes into each header and the namespace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvshare.kvpool.client import PageRef
from kvshare.kvpool.layout import checksum_constants, payload_checksum, payload_words
from kvshare.kvpool.page import HEADER_BYTES, PageFormatError, PageHeader

# Bump when the byte order of a vLLM page changes.
PAGE_LAYOUT_VERSION = 1


@dataclass(frozen=True)
class CacheLayer:
    """One layer's cache tensor: blocks are indexed along `block_dim`; `group` is the index,
    among the block-id lists a page is copied with, of the list this layer's blocks are in."""

    name: str
    tensor: torch.Tensor
    block_dim: int
    group: int = 0

    @property
    def block_bytes(self) -> int:
        return self.tensor.select(self.block_dim, 0).numel() * self.tensor.element_size()


def cache_layer(name: str, tensor: torch.Tensor, num_blocks: int, group: int = 0) -> CacheLayer:
    """The layer's block dimension: the first of size `num_blocks` (0 for vLLM CPU's
    [blocks, heads, block_size, 2 * head_size]; 1 for a [2, blocks, ...] K/V split)."""
    for dim, size in enumerate(tensor.shape):
        if size == num_blocks:
            return CacheLayer(name, tensor, dim, group)
    raise ValueError(
        f"KV cache of layer {name} has shape {tuple(tensor.shape)}: no dimension of "
        f"{num_blocks} blocks"
    )


@dataclass(frozen=True)
class PageGeometry:
    layers: tuple[CacheLayer, ...]
    blocks_per_page: int

    def __post_init__(self) -> None:
        if not self.layers or self.blocks_per_page < 1:
            raise ValueError("a page needs at least one layer and one block")
        if self.payload_bytes % 8:
            raise ValueError(f"page payload of {self.payload_bytes} bytes is not 8-byte aligned")

    @property
    def payload_bytes(self) -> int:
        return self.blocks_per_page * sum(layer.block_bytes for layer in self.layers)

    def gather(self, blocks: Sequence[Sequence[int]], out: torch.Tensor) -> None:
        """Copy the blocks of one page, every layer, into `out` (uint8 [payload_bytes]);
        `blocks[g]` are the page's block ids in the layers of group g."""
        indexes = [_index(group, self.blocks_per_page) for group in blocks]
        offset = 0
        for layer in self.layers:
            index = indexes[layer.group]
            part = layer.tensor.index_select(layer.block_dim, index.to(layer.tensor.device))
            nbytes = part.numel() * part.element_size()
            out[offset : offset + nbytes].copy_(part.reshape(-1).view(torch.uint8))
            offset += nbytes

    def scatter(self, payload: torch.Tensor, blocks: Sequence[Sequence[int]], first: int) -> None:
        """Write the blocks `blocks[g][first:]` of one page from `payload` (a verified copy);
        blocks before `first` belong to the engine's own prefix and are left alone."""
        indexes = [_index(group, self.blocks_per_page) for group in blocks]
        offset = 0
        for layer in self.layers:
            index = indexes[layer.group]
            shape = list(layer.tensor.shape)
            shape[layer.block_dim] = self.blocks_per_page
            nbytes = self.blocks_per_page * layer.block_bytes
            part = payload[offset : offset + nbytes].view(layer.tensor.dtype).view(shape)
            offset += nbytes
            keep = torch.arange(first, self.blocks_per_page)
            layer.tensor.index_copy_(
                layer.block_dim,
                index[first:].to(layer.tensor.device),
                part.index_select(layer.block_dim, keep).to(layer.tensor.device),
            )


def _index(blocks: Sequence[int], blocks_per_page: int) -> torch.Tensor:
    if len(blocks) != blocks_per_page:
        raise ValueError(f"a page has {blocks_per_page} blocks per layer, got {len(blocks)}")
    return torch.tensor(list(blocks), dtype=torch.long)


def page_checksum(payload: torch.Tensor, key: bytes) -> bytes:
    """The pool's 16-byte keyed checksum of a page payload (uint8, contiguous, on the CPU)."""
    lanes = payload_checksum(payload_words(payload), checksum_constants(key))
    return lanes.astype("<u8").tobytes()


def page_header(key: bytes, parent: bytes, payload_bytes: int, checksum: bytes) -> bytes:
    return PageHeader(PAGE_LAYOUT_VERSION, key, parent, payload_bytes, checksum).pack()


def verify_page(arena: torch.Tensor, page: PageRef, payload_bytes: int) -> torch.Tensor | None:
    """A private copy of the page's payload when the slot's header, the daemon's record and
    the copied bytes' checksum all agree; None otherwise (the page must not be used)."""
    if page.payload_bytes != payload_bytes:
        return None
    header_bytes = arena[page.offset : page.offset + HEADER_BYTES].numpy().tobytes()
    try:
        header = PageHeader.unpack(header_bytes)
    except PageFormatError:
        return None
    if (
        header.key != page.key
        or header.layout_version != PAGE_LAYOUT_VERSION
        or header.payload_bytes != payload_bytes
        or header.checksum != page.checksum
    ):
        return None
    start = page.offset + HEADER_BYTES
    payload = arena[start : start + payload_bytes].clone()
    if page_checksum(payload, page.key) != page.checksum:
        return None
    return payload
