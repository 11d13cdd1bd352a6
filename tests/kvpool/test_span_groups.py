"""A load's pages that lie in adjacent arena slots come in one copy per group (a span):
the grouping covers every copy once, in order, never spans more than the staging buffer
or a gap larger than a header, and the rows read out of the span are exactly the bytes
the per-page copies read."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.engine.connector import KVCacheLayout
from kvshare.kvpool.layout import PageLayout
from kvshare.kvpool.page import HEADER_BYTES, PAGE_ALIGN, slot_bytes_for
from kvshare.kvpool.transfer import PageCopy, SpanGroup, fill_span, span_groups
from kvshare.kvpool.transfer_cpu import ThreadTransfer
from kvshare.models.presets import shape_preset
from tests.kvpool.page_copies import whole_page_copies

PAYLOAD = 3 * PAGE_ALIGN  # a page's full payload (8-byte words, as the kernels read)
SLOT = slot_bytes_for(PAYLOAD)
GAP = HEADER_BYTES + PAGE_ALIGN


def copy_of(slot: int, nbytes: int = PAYLOAD) -> PageCopy:
    return PageCopy(slot * SLOT + HEADER_BYTES, nbytes, (slot,), slot.to_bytes(16, "little"))


def random_arena(slots: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (slots * SLOT,), dtype=torch.uint8, generator=generator)


def check_rows(copies: list[PageCopy], groups: list[SpanGroup], staging: int, seed: int) -> None:
    """Every group's rows, read out of its span, are its pages' bytes, page by page."""
    arena = random_arena(max(c.offset for c in copies) // SLOT + 1, seed)
    assert [i for g in groups for i in g.pages] == list(range(len(copies)))
    for group in groups:
        assert len(group.pages) == 1 or group.span <= staging
        buffer = torch.zeros(max(staging, group.span), dtype=torch.uint8)
        rows = fill_span(buffer, arena, group)
        assert rows.shape == (len(group.pages), group.nbytes)
        for row, i in zip(rows, group.pages):
            c = copies[i]
            assert c.nbytes == group.nbytes
            assert torch.equal(row, arena[c.offset : c.offset + c.nbytes]), (group, i)


def test_adjacent_pages_share_a_copy_and_the_rest_stand_alone() -> None:
    """Adjacent slots 0-9 (split by max_pages, the last group shorter), a page out of
    order, a gap of one slot, a global-only copy (its unread part is not a header), then
    a run cut by the staging buffer."""
    copies = [copy_of(s) for s in range(10)]
    copies += [copy_of(30), copy_of(12), copy_of(14), copy_of(15, PAYLOAD - PAGE_ALIGN)]
    copies += [copy_of(s) for s in range(20, 26)]
    staging = 4 * SLOT
    groups = span_groups(copies, staging, GAP, max_pages=4)
    assert [len(g.pages) for g in groups] == [4, 4, 2, 1, 1, 1, 1, 4, 2]
    assert all(g.stride == SLOT for g in groups if len(g.pages) > 1)
    check_rows(copies, groups, staging, seed=1)
    # A staging buffer one byte short of four pages' span holds three.
    span4 = 3 * SLOT + PAYLOAD
    assert [len(g.pages) for g in span_groups(copies[:4], span4 - 1, GAP)] == [3, 1]
    assert [len(g.pages) for g in span_groups(copies[:4], span4, GAP)] == [4]


def test_pages_further_apart_than_a_header_are_copied_alone() -> None:
    copies = [copy_of(0, PAYLOAD - 2 * PAGE_ALIGN), copy_of(1, PAYLOAD - 2 * PAGE_ALIGN)]
    assert SLOT - copies[0].nbytes > GAP
    assert [len(g.pages) for g in span_groups(copies, 8 * SLOT, GAP)] == [1, 1]


@settings(max_examples=100, deadline=None)
@given(
    slots=st.lists(st.integers(0, 40), min_size=1, max_size=30),
    short=st.lists(st.booleans(), min_size=30, max_size=30),
    staging_pages=st.integers(1, 9),
    max_pages=st.integers(1, 9),
    seed=st.integers(0, 1000),
)
def test_span_groups_read_exactly_the_per_page_bytes(
    slots: list[int], short: list[bool], staging_pages: int, max_pages: int, seed: int
) -> None:
    # Runs of adjacent slots are likely: each slot is, half the time, the previous one + 1.
    for i in range(1, len(slots)):
        if short[i]:
            slots[i] = slots[i - 1] + 1
    copies = [copy_of(s, PAYLOAD - PAGE_ALIGN if s % 7 == 3 else PAYLOAD) for s in slots]
    staging = staging_pages * SLOT
    groups = span_groups(copies, staging, GAP, max_pages)
    check_rows(copies, groups, staging, seed)
    for g in groups:
        assert len(g.pages) <= max_pages and g.stride - g.nbytes <= GAP
    # Maximal: a group ends only where the next copy cannot join it.
    for g, nxt in pairwise(groups):
        c = copies[nxt.pages.start]
        first = copies[g.pages.start]
        joins = (
            c.nbytes == g.nbytes
            and c.offset == first.offset + len(g.pages) * g.stride
            and (len(g.pages) > 1 or 0 <= c.offset - first.offset - first.nbytes <= GAP)
        )
        assert not joins or len(g.pages) == max_pages or g.span + g.stride > staging


@pytest.mark.cuda
@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-gemma3"])
def test_cuda_load_of_spans_restores_the_per_page_bytes(shape: str) -> None:
    """CudaTransfer (span copies) restores the same cache bytes and checksums as the CPU
    transfer (one page at a time) from the same arena: adjacent pages, a page out of
    order, a gap, runs split at max_pages."""
    from kvshare.kvpool.transfer_cuda import CudaTransfer

    caches = {
        d: KVCacheLayout.allocate(shape_preset(shape), 64, 16, torch.bfloat16, torch.device(d))
        for d in ("cpu", "cuda")
    }
    layout = PageLayout.of(caches["cpu"], 32)
    slot = slot_bytes_for(layout.payload_bytes)
    slots = [*range(0, 12), 20, 14, 15, 16, *range(30, 40)]
    arena = torch.randint(0, 256, ((max(slots) + 1) * slot,), dtype=torch.uint8)
    # Whole pages of random bytes are not valid bf16 KV everywhere: compare bytes only.
    copies = whole_page_copies(layout, slots)
    cpu = ThreadTransfer(caches["cpu"].kv, layout, sliding_kv=caches["cpu"].sliding_kv)
    cpu.set_arena(arena)
    gpu = CudaTransfer(caches["cuda"].kv, layout, sliding_kv=caches["cuda"].sliding_kv)
    gpu.set_arena(arena.pin_memory())
    expected, got = cpu.load(copies), gpu.load(copies)
    expected.wait()
    got.wait()
    assert got.checksums() == expected.checksums()
    for name in ("kv", "sliding_kv"):
        want = getattr(caches["cpu"], name)
        if want is not None:
            have = getattr(caches["cuda"], name).cpu()
            assert torch.equal(have.view(torch.uint8), want.view(torch.uint8)), name
