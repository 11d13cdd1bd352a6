"""Load/store planning and restore verification, without a daemon or a transfer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvshare.kvpool.client import PageRef
from kvshare.kvpool.layout import CHECKSUM_BYTES, LAYOUT_VERSION, PageLayout
from kvshare.kvpool.page import HEADER_BYTES, PageHeader
from kvshare.kvpool.plan import plan_load, plan_store, storable_chunks
from kvshare.kvpool.verify import header_matches, mismatched_pages

# 2 blocks per page; 3 cache slots, the first 2 global, 128 bytes each
LAYOUT = PageLayout(
    chunk_tokens=32,
    block_size=16,
    num_slots=3,
    num_global_slots=2,
    slot_bytes=128,
    dtype=torch.float32,
)


def page(j: int, checksum: bytes = b"") -> PageRef:
    return PageRef(bytes([j]) * 16, 4096 * (j + 1), LAYOUT.payload_bytes, checksum)


def test_a_load_copies_only_the_chunks_past_the_local_prefix() -> None:
    pages = [page(j) for j in range(4)]
    table = list(range(100, 110))
    sliding = list(range(200, 210))  # every sliding block present: whole pages
    plan = plan_load(pages, 40, table, LAYOUT, sliding)  # 40: inside chunk 1
    assert [c.key for c in plan.copies] == [pages[1].key, pages[2].key, pages[3].key]
    assert plan.copies[0].blocks == (102, 103) and plan.copies[0].first_block == 0  # 40 // 16 - 2
    assert plan.copies[0].sliding_blocks == (202, 203) and plan.copies[0].sliding_first == 0
    assert plan.copies[0].offset == pages[1].offset + HEADER_BYTES
    assert plan.held == (102, 103, 104, 105, 106, 107)  # block 101 (the local prefix's) untouched
    assert plan.sliding_held == (202, 203, 204, 205, 206, 207) and plan.segments == (2, 2, 2)
    assert (plan.resume_chunks, plan.hit_tokens) == (4, 128 - 40)
    assert plan.nbytes == 3 * LAYOUT.payload_bytes


def test_a_load_keeps_the_first_block_a_partial_chunk_already_has() -> None:
    plan = plan_load([page(0), page(1)], 16, [7, 8, 9, 10], LAYOUT, [17, 18, 19, 20])
    assert plan.copies[0].first_block == 1 and plan.held == (8, 9, 10)
    assert plan.copies[0].sliding_first == 1 and plan.sliding_held == (18, 19, 20)


def test_chunks_without_sliding_blocks_bring_only_global_layers() -> None:
    pages = [page(j) for j in range(4)]
    # Resume 128, window 40: queries read keys from 89 on (block 5); block 4 is kept too.
    sliding = [None] * 4 + [14, 15, 16, 17]
    plan = plan_load(pages, 0, list(range(8)), LAYOUT, sliding)
    assert [c.nbytes for c in plan.copies] == [LAYOUT.global_bytes] * 2 + [LAYOUT.payload_bytes] * 2
    assert plan.sliding_held == (14, 15, 16, 17)
    assert plan.segments == (1, 1, 2, 2)
    # A chunk with some sliding blocks gets its sliding part, from its first one.
    plan = plan_load(pages, 0, list(range(8)), LAYOUT, [None] * 5 + [15, 16, 17])
    assert [c.nbytes for c in plan.copies][2:] == [LAYOUT.payload_bytes] * 2
    assert plan.copies[2].sliding_first == 1 and plan.sliding_held == (15, 16, 17)
    with pytest.raises(ValueError, match="not a suffix"):
        plan_load(pages, 0, list(range(8)), LAYOUT, [None] * 4 + [14, None, 16, 17])


def test_a_store_copies_complete_reserved_chunks_chained_to_their_parents() -> None:
    keys = [bytes([j]) * 16 for j in range(4)]
    table = list(range(8))
    sliding = [10, 11, 12, None, 14, 15, 16, 17]
    chunks = storable_chunks(0, 4, LAYOUT, sliding)
    assert chunks == [0, 2, 3]  # chunk 1 (blocks 2, 3) lacks a sliding block
    assert storable_chunks(0, 4, LAYOUT, []) == []  # no sliding blocks at all
    reserved = {keys[0]: page(0), keys[3]: page(3)}  # chunk 2 is in the pool already
    plan = plan_store(chunks, keys, reserved, table, LAYOUT, b"seed", sliding)
    assert [p.key for p in plan.pages] == [keys[0], keys[3]]
    assert plan.parents == (b"seed", keys[2])
    assert plan.held == (0, 1, 6, 7) and plan.sliding_held == (10, 11, 16, 17)
    assert all(c.nbytes == LAYOUT.payload_bytes and c.first_block == 0 for c in plan.copies)


def test_a_layout_without_sliding_layers_copies_whole_pages() -> None:
    dense = PageLayout(32, 16, 2, 2, 128, torch.float32)
    plan = plan_load([page(0), page(1)], 0, [1, 2, 3, 4], dense)
    assert [c.nbytes for c in plan.copies] == [dense.payload_bytes] * 2
    assert plan.sliding_held == () and storable_chunks(0, 2, dense) == [0, 1]


def test_a_header_matches_only_the_page_the_daemon_vouched_for() -> None:
    sums = b"\x01" * CHECKSUM_BYTES * 2
    ref = page(1, sums)
    header = PageHeader(LAYOUT_VERSION, ref.key, b"\0" * 16, ref.payload_bytes, sums).pack()
    assert header_matches(header, ref, ref.payload_bytes)
    assert not header_matches(header, page(2, sums), ref.payload_bytes)  # another page's slot
    assert not header_matches(header, ref, ref.payload_bytes - 1)
    assert not header_matches(header, page(1, b"\x02" * CHECKSUM_BYTES * 2), ref.payload_bytes)
    torn = bytearray(header)
    torn[HEADER_BYTES // 2] ^= 0xFF
    assert not header_matches(bytes(torn), ref, ref.payload_bytes)  # CRC catches it


def test_checksums_compare_only_the_segments_copied() -> None:
    first, second = b"\x01" * CHECKSUM_BYTES, b"\x02" * CHECKSUM_BYTES
    ref = page(0, first + second)

    def bad(copied: list[bytes], segments: int, checksum: bytes | None = None) -> bool:
        row = np.frombuffer(b"".join(copied), dtype=np.uint8)[None, :]
        pages = [ref if checksum is None else page(0, checksum)]
        return mismatched_pages(pages, row, [segments]) == [0]

    assert not bad([first, second], 2)
    assert not bad([first, b"\x09" * CHECKSUM_BYTES], 1)  # global layers only
    assert bad([first, b"\x03" * CHECKSUM_BYTES], 2)
    assert bad([b"\x03" + first[1:], second], 1)  # one byte of the first segment
    assert bad([first, second], 2, checksum=first)  # the daemon holds one segment only
    assert bad([first], 2)  # fewer segments copied than checked


def test_checksums_are_compared_page_by_page() -> None:
    """Of 1,023 pages, exactly the ones whose copied checksums differ are named."""
    rng = np.random.default_rng(0)
    sums = rng.integers(0, 256, size=(1023, 2 * CHECKSUM_BYTES), dtype=np.uint8)
    pages = [page(i % 256, row.tobytes()) for i, row in enumerate(sums)]
    copied = sums.copy()
    copied[[5, 700], [3, 2 * CHECKSUM_BYTES - 1]] ^= 1
    assert mismatched_pages(pages, copied, [2] * len(pages)) == [5, 700]
    assert mismatched_pages(pages, copied, [1] * len(pages)) == [5]  # 700's is in segment 2
    assert mismatched_pages([], copied[:0], []) == []
