"""Copying cache blocks between page rows of a staging buffer and the paged KV cache.

The cache is [slots, K|V, blocks, block_size, kv_heads, head_dim] and a page row holds
[slots', K|V, blocks_per_page, block_size, kv_heads, head_dim] (slots' <= slots: a
"global-only" page holds the first slots only). One block of one (slot, K|V), a "chunk",
is contiguous on both sides, so a copy is a list of (page, j, block) pairs times every
chunk index slot * 2 + kv.

Why a kernel: index_copy_/index_select over a cache of more than 2**31 elements is split
by PyTorch into dozens of launches per page, and the launches block the host once the
stream's queue fills behind the PCIe copies. This is one launch per page group, with
64-bit offsets, copying words (int64, or int32 when a chunk isn't a multiple of 8 bytes)
so that any dtype works.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch
import triton
import triton.language as tl


# A load's page groups slice the pairs table at any page: with one block a page, a slice at
# an odd page starts 24 bytes past 16-byte alignment, and Triton, which specializes pointers
# on alignment, compiled a second kernel there inside the first such hit (268 ms against 95
# for a 131,072-token hit on an H100). PAIRS is read as scalars: alignment buys nothing.
@triton.jit(
    do_not_specialize=["first_page", "first_chunk"], do_not_specialize_on_alignment=["PAIRS"]
)
def _copy_blocks_kernel(
    KV,
    ROWS,
    PAIRS,
    first_page,
    first_chunk,
    row_stride,
    num_blocks,
    BLOCKS_PER_PAGE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    TO_CACHE: tl.constexpr,
):
    # One program: chunk (slot * 2 + kv) of one pair, CHUNK words; the rows start at cache
    # chunk first_chunk. Offsets are int64 from the start: the cache has more than 2**31
    # elements.
    pair = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    page = tl.load(PAIRS + pair * 3)
    j = tl.load(PAIRS + pair * 3 + 1)
    block = tl.load(PAIRS + pair * 3 + 2)
    cache = KV + ((chunk + first_chunk) * num_blocks + block) * CHUNK
    row = ROWS + (page - first_page) * row_stride + (chunk * BLOCKS_PER_PAGE + j) * CHUNK
    for start in range(0, CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < CHUNK
        if TO_CACHE:
            tl.store(cache + offs, tl.load(row + offs, mask=mask), mask=mask)
        else:
            tl.store(row + offs, tl.load(cache + offs, mask=mask), mask=mask)


class BlockCopy:
    """Block copies between page rows and one contiguous paged cache `kv`. Block ids are
    not checked on the device: they must be < kv.shape[2], as for index_copy_."""

    def __init__(self, kv: torch.Tensor, blocks_per_page: int, block_words: int = 1024) -> None:
        assert kv.is_contiguous() and kv.dim() == 6 and kv.shape[1] == 2
        chunk_bytes = math.prod(kv.shape[3:]) * kv.element_size()
        assert chunk_bytes % 4 == 0, (
            f"a block chunk ({chunk_bytes} bytes) must be whole 32-bit words"
        )
        self.word = torch.int64 if chunk_bytes % 8 == 0 else torch.int32
        self.kv_words = kv.view(-1).view(torch.uint8).view(self.word)
        self.num_slots, _, self.num_blocks = kv.shape[:3]
        self.blocks_per_page = blocks_per_page
        self.chunk_words = chunk_bytes // self.kv_words.element_size()
        self.slot_bytes = 2 * blocks_per_page * chunk_bytes
        self.block_words = min(block_words, triton.next_power_of_2(self.chunk_words))

    def pairs(
        self, blocks: Sequence[Sequence[int]], first_blocks: Sequence[int]
    ) -> tuple[np.ndarray, list[int]]:
        """(page, j, block) for every page and j in range(first_block, blocks_per_page), as
        int64 [n, 3] in page order, and offsets: page p's pairs are offsets[p]:offsets[p + 1]."""
        pages, bpp = len(blocks), self.blocks_per_page
        sizes = np.fromiter(map(len, blocks), np.int64, pages)
        assert (sizes == bpp).all(), "a page holds blocks_per_page blocks"
        ids = np.fromiter(chain.from_iterable(blocks), np.int64, pages * bpp).reshape(pages, bpp)
        firsts = np.asarray(first_blocks, dtype=np.int64).reshape(pages)
        keep = np.arange(bpp) >= firsts[:, None]
        page, j = np.nonzero(keep)
        table = np.empty((len(page), 3), dtype=np.int64)
        table[:, 0], table[:, 1], table[:, 2] = page, j, ids[keep]
        offsets = np.zeros(pages + 1, dtype=np.int64)
        np.cumsum(bpp - np.minimum(firsts, bpp), out=offsets[1:])
        return table, offsets.tolist()

    def __call__(
        self,
        rows: torch.Tensor,
        pairs: torch.Tensor,
        first_page: int,
        to_cache: bool,
        first_slot: int = 0,
    ) -> None:
        """Copy the chunks of every pair (a slice of a `pairs` table) between row
        rows[page - first_page] of uint8 rows [pages, nbytes] and the cache: into the cache
        when to_cache, else out of it. One launch on the current stream; every row holds
        nbytes // slot_bytes cache slots from `first_slot` on."""
        slots, rest = divmod(rows.shape[1], self.slot_bytes)
        assert rest == 0 and first_slot + slots <= self.num_slots and rows.dtype == torch.uint8
        assert pairs.dtype == torch.int64 and pairs.is_contiguous()
        if not len(pairs) or not slots:
            return
        words = rows.view(self.word)
        _copy_blocks_kernel[(len(pairs), 2 * slots)](
            self.kv_words,
            words,
            pairs,
            first_page,
            2 * first_slot,
            words.stride(0),
            self.num_blocks,
            BLOCKS_PER_PAGE=self.blocks_per_page,
            CHUNK=self.chunk_words,
            BLOCK=self.block_words,
            TO_CACHE=to_cache,
        )
