"""What a pool load or store copies: plain functions of pages, block tables and the layout.

No daemon, no transfer, no engine: the connector asks the pool, plans here, then starts
the copies the plan lists. Invariants a plan keeps:
- a load never writes the blocks the engine already had (before `local_tokens`), and
  pages whose sliding-window layers no query past the restore reads bring only their
  global layers (their blocks are listed as `incomplete`);
- a store copies only chunks whose blocks are all complete (every layer's KV present)
  and each page's parent is the previous chunk's key (the chain seed for chunk 0).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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
    incomplete: tuple[int, ...]  # blocks that get only their global layers
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
    sliding_window: int | None,
) -> LoadPlan:
    """Copy pages[j] (chunk j) into its blocks of `block_table`, for the chunks past
    `local_tokens` (the GPU-local prefix, which may end inside a chunk)."""
    chunk, bpp = layout.chunk_tokens, layout.blocks_per_page
    resume = len(pages) * chunk
    # Queries from `resume` on read sliding-window keys from resume - window + 1 on.
    full_from = 0 if sliding_window is None else max(0, resume - sliding_window + 1) // chunk
    copies, copied, segments, held, incomplete = [], [], [], [], []
    for j in range(local_tokens // chunk, len(pages)):
        page = pages[j]
        nbytes = layout.payload_bytes if j >= full_from else layout.global_bytes
        blocks = tuple(block_table[j * bpp : (j + 1) * bpp])
        first = max(0, (local_tokens - j * chunk) // layout.block_size)
        copies.append(PageCopy(page.offset + HEADER_BYTES, nbytes, blocks, page.key, first))
        copied.append(page)
        segments.append(len(layout.segments(nbytes)))
        held += blocks[first:]
        if nbytes < layout.payload_bytes:
            incomplete += blocks[first:]
    return LoadPlan(
        tuple(copies),
        tuple(copied),
        tuple(segments),
        tuple(held),
        tuple(incomplete),
        len(pages),
        resume - local_tokens,
    )


def storable_chunks(
    first: int,
    end: int,
    block_table: Sequence[int],
    blocks_per_page: int,
    all_complete: Callable[[Sequence[int]], bool],
) -> list[int]:
    """The chunks in [first, end) whose blocks are all complete."""
    bpp = blocks_per_page
    return [j for j in range(first, end) if all_complete(block_table[j * bpp : (j + 1) * bpp])]


@dataclass(frozen=True)
class StorePlan:
    copies: tuple[PageCopy, ...]
    pages: tuple[PageRef, ...]  # the reserved pages, one per copy
    parents: tuple[bytes, ...]  # each page's parent key (its header's chain link)
    held: tuple[int, ...]  # blocks read: held by the connector until the copy completed


def plan_store(
    chunks: Sequence[int],
    keys: Sequence[bytes],
    reserved: Mapping[bytes, PageRef],
    block_table: Sequence[int],
    layout: PageLayout,
    chain_seed: bytes,
) -> StorePlan:
    """Copy each chunk of `chunks` that got a reserved page (others are present already or
    were dropped); `keys[j]` is chunk j's key."""
    bpp = layout.blocks_per_page
    copies, pages, parents, held = [], [], [], []
    for j in chunks:
        page = reserved.get(keys[j])
        if page is None:
            continue
        blocks = tuple(block_table[j * bpp : (j + 1) * bpp])
        copies.append(PageCopy(page.offset + HEADER_BYTES, layout.payload_bytes, blocks, page.key))
        pages.append(page)
        parents.append(keys[j - 1] if j else chain_seed)
        held += blocks
    return StorePlan(tuple(copies), tuple(pages), tuple(parents), tuple(held))
