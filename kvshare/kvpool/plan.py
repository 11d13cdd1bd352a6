"""What a pool load or store copies: plain functions of pages, block tables and the layout.

No daemon, no transfer, no engine: the connector asks the pool, plans here, then starts
the copies the plan lists. A sliding-window model's sequence has a sliding table parallel
to its block table (None where it holds no sliding block: outside its window); a page's
global part goes to the blocks, its sliding part to the sliding blocks. Invariants a plan
keeps:
- a load never writes the blocks the engine already had (before `local_tokens`); it
  fills the sliding part of exactly the chunks with sliding blocks past the local
  prefix (the window before the resume point), into every one of them, and brings only
  the global layers of the others;
- a store copies only chunks whose sliding blocks are all present (every layer's KV)
  and each page's parent is the previous chunk's key (the chain seed for chunk 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvshare.kvpool.client import PageRef
from kvshare.kvpool.layout import PageLayout
from kvshare.kvpool.page import HEADER_BYTES
from kvshare.kvpool.transfer import PageCopy


@dataclass(frozen=True)
class LoadPlan:
    copies: tuple[PageCopy, ...]
    pages: tuple[PageRef, ...]  # the pages copied, one per copy
    segments: tuple[int, ...]  # checksummed segments copied per page
    held: tuple[int, ...]  # blocks written: held by the connector until the copy completed
    sliding_held: tuple[int, ...]  # sliding blocks written, held likewise
    resume_chunks: int  # the restored prefix ends after this many chunks
    hit_tokens: int  # tokens restored past the local prefix

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.copies)


def plan_load(
    pages: Sequence[PageRef],
    local_tokens: int,
    block_table: Sequence[int],
    layout: PageLayout,
    sliding_table: Sequence[int | None] = (),
) -> LoadPlan:
    """Copy pages[j] (chunk j) into its blocks of `block_table`, for the chunks past
    `local_tokens` (the GPU-local prefix, which may end inside a chunk); a sliding-window
    model's sliding part into the sliding blocks of `sliding_table` past local_tokens
    (within a chunk they are a suffix of its blocks)."""
    chunk, bpp = layout.chunk_tokens, layout.blocks_per_page
    resume = len(pages) * chunk
    copies, copied, segments, held, sliding_held = [], [], [], [], []
    # The loop runs per page of a restore before its first copy (512 pages at 131k
    # tokens): one PageCopy per page, the layout's sizes read once.
    whole = layout.num_segments == 1
    global_bytes, payload_bytes, block_size = (
        layout.global_bytes,
        layout.payload_bytes,
        layout.block_size,
    )
    num_segments = {n: len(layout.segments(n)) for n in (global_bytes, payload_bytes)}
    for j in range(local_tokens // chunk, len(pages)):
        page = pages[j]
        blocks = tuple(block_table[j * bpp : (j + 1) * bpp])
        first = max(0, (local_tokens - j * chunk) // block_size)
        nbytes, ids, sliding_first = global_bytes, (), 0
        if whole:
            nbytes = payload_bytes
        else:
            sliding = tuple(sliding_table[j * bpp : (j + 1) * bpp])
            present = [i for i in range(first, len(sliding)) if sliding[i] is not None]
            if present:
                if present != list(range(present[0], bpp)):
                    raise ValueError(f"chunk {j}: sliding blocks {sliding} are not a suffix")
                # Entries before sliding_first are never copied: any block id stands in.
                ids = tuple(blocks[i] if b is None else b for i, b in enumerate(sliding))
                nbytes, sliding_first = payload_bytes, present[0]
                sliding_held += [ids[i] for i in present]
        copy = PageCopy(
            page.offset + HEADER_BYTES, nbytes, blocks, page.key, first, ids, sliding_first
        )
        copies.append(copy)
        copied.append(page)
        segments.append(num_segments[nbytes])
        held += blocks[first:]
    return LoadPlan(
        tuple(copies),
        tuple(copied),
        tuple(segments),
        tuple(held),
        tuple(sliding_held),
        len(pages),
        resume - local_tokens,
    )


def prefetch_copies(pages: Sequence[PageRef], layout: PageLayout) -> list[PageCopy]:
    """The copies a load of `pages` starts with, as far as a prefetch reads them (arena
    offset and bytes; the blocks are not known yet): each page's global layers. A
    sliding-window model's load copies whole pages in its window: there the load's
    copies differ, and it copies them itself."""
    nbytes = layout.global_bytes
    return [PageCopy(page.offset + HEADER_BYTES, nbytes, (), page.key) for page in pages]


def storable_chunks(
    first: int,
    end: int,
    layout: PageLayout,
    sliding_table: Sequence[int | None] = (),
) -> list[int]:
    """The chunks in [first, end) whose every layer is present: all of them without
    sliding-window layers, else those whose sliding blocks are all in `sliding_table`."""
    if layout.num_segments == 1:
        return list(range(first, end))
    bpp = layout.blocks_per_page
    return [
        j
        for j in range(first, min(end, len(sliding_table) // bpp))
        if None not in sliding_table[j * bpp : (j + 1) * bpp]
    ]


@dataclass(frozen=True)
class StorePlan:
    copies: tuple[PageCopy, ...]
    pages: tuple[PageRef, ...]  # the reserved pages, one per copy
    parents: tuple[bytes, ...]  # each page's parent key (its header's chain link)
    held: tuple[int, ...]  # blocks read: held by the connector until the copy completed
    sliding_held: tuple[int, ...]  # sliding blocks read, held likewise


def plan_store(
    chunks: Sequence[int],
    keys: Sequence[bytes],
    reserved: Mapping[bytes, PageRef],
    block_table: Sequence[int],
    layout: PageLayout,
    chain_seed: bytes,
    sliding_table: Sequence[int | None] = (),
) -> StorePlan:
    """Copy each chunk of `chunks` (storable_chunks) that got a reserved page (others are
    present already or were dropped); `keys[j]` is chunk j's key."""
    bpp = layout.blocks_per_page
    copies, pages, parents, held, sliding_held = [], [], [], [], []
    for j in chunks:
        page = reserved.get(keys[j])
        if page is None:
            continue
        blocks = tuple(block_table[j * bpp : (j + 1) * bpp])
        sliding: tuple[int, ...] = ()
        if layout.num_segments == 2:
            sliding = tuple(b for b in sliding_table[j * bpp : (j + 1) * bpp] if b is not None)
            assert len(sliding) == bpp, "storable_chunks: every sliding block present"
        offset = page.offset + HEADER_BYTES
        copies.append(PageCopy(offset, layout.payload_bytes, blocks, page.key, 0, sliding))
        pages.append(page)
        parents.append(keys[j - 1] if j else chain_seed)
        held += blocks
        sliding_held += sliding
    return StorePlan(tuple(copies), tuple(pages), tuple(parents), tuple(held), tuple(sliding_held))
