"""Checksums computed a group of pages at a time equal those of one page at a time, and the
grouping of a load or store covers every copy once, in order, one page size per group."""

from __future__ import annotations

from itertools import pairwise

import torch
from hypothesis import given
from hypothesis import strategies as st

from kvshare.kvpool.layout import checksum_into, checksum_rows_into, word_weights
from kvshare.kvpool.transfer import PageCopy, page_groups


@given(st.lists(st.sampled_from([64, 128, 4096]), max_size=40), st.integers(4096, 40000), st.integers(1, 9))
def test_page_groups_cover_every_copy_in_order(sizes: list[int], staging: int, max_pages: int) -> None:
    copies = [PageCopy(offset=i * 8192, nbytes=n, blocks=(i,)) for i, n in enumerate(sizes)]
    groups = page_groups(copies, staging, max_pages)
    assert [i for g in groups for i in g] == list(range(len(copies)))
    for g in groups:
        size = copies[g.start].nbytes
        assert 1 <= len(g) <= max_pages and len(g) * size <= staging
        assert all(copies[i].nbytes == size for i in g)
    # Maximal runs: a group ends only when full, at a size change or at the end.
    for g, nxt in pairwise(groups):
        size = copies[g.start].nbytes
        assert len(g) == max_pages or (len(g) + 1) * size > staging or copies[nxt.start].nbytes != size


def test_row_checksums_equal_single_checksums_and_wrap() -> None:
    gen = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 256, (5, 4096), dtype=torch.uint8, generator=gen)
    rows[2] = 255  # every word -1: weighted sums reach past 2**63 and must wrap alike
    weights = word_weights(4096 // 8, torch.device("cpu"))
    grouped = torch.zeros(5, 2, 2, dtype=torch.int64)
    checksum_rows_into(rows[:, 1024:], weights, grouped[:, 1])  # a segment, as a strided view
    for i in range(5):
        single = torch.zeros(2, dtype=torch.int64)
        checksum_into(rows[i, 1024:].clone(), weights, single)
        assert torch.equal(grouped[i, 1], single)
        words = rows[i, 1024:].view(torch.int64).tolist()
        wrap = (1 << 64)
        expect = [sum(words) % wrap, sum(w * (j + 1) for j, w in enumerate(words)) % wrap]
        assert [v % wrap for v in single.tolist()] == expect
    assert torch.count_nonzero(grouped[:, 0]) == 0
    flipped = rows.clone()
    flipped[3, 2000] ^= 1
    again = torch.zeros(5, 2, dtype=torch.int64)
    checksum_rows_into(flipped[:, 1024:], weights, again)
    assert torch.equal(again[[0, 1, 2, 4]], grouped[[0, 1, 2, 4], 1])
    assert not torch.equal(again[3], grouped[3, 1])


def test_cpu_store_of_a_global_only_page_writes_only_that_page() -> None:
    """A page that holds the first slots only gets exactly those bytes; the arena bytes
    after it (the next page) stay as they were."""
    from kvshare.engine.connector import KVCacheLayout
    from kvshare.kvpool.layout import PageLayout
    from kvshare.kvpool.transfer import ThreadTransfer
    from kvshare.models.presets import shape_preset

    cache = KVCacheLayout.allocate(shape_preset("tiny-gemma3"), 8, 16, torch.float32, torch.device("cpu"))
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(1)))
    layout = PageLayout.of(cache, 32)
    transfer = ThreadTransfer(cache.kv, layout)
    nbytes = layout.global_bytes
    arena = torch.full((2 * layout.payload_bytes,), 0x5A, dtype=torch.uint8)
    transfer.set_arena(arena)
    transfer.store([PageCopy(offset=0, nbytes=nbytes, blocks=(5, 2))]).wait()
    assert 0 < nbytes < layout.payload_bytes
    assert bool((arena[nbytes:] == 0x5A).all())
    expected = cache.kv[:layout.num_global_slots][:, :, [5, 2]]
    assert torch.equal(transfer.page_view(arena, nbytes), expected)
