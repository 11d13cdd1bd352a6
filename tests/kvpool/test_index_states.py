"""Lookups for hybrid models: a prefix is usable only up to a chunk with a state snapshot."""

from __future__ import annotations

import random

from kvshare.kvpool.arena import ArenaGeometry
from kvshare.kvpool.index import PoolIndex
from tests.kvpool.test_index import PAYLOAD, SLAB, SLOT, A, B, keys, make_index, store


def test_run_is_cut_back_to_the_last_chunk_with_a_state() -> None:
    index = make_index()
    chunks = keys(1, 2, 3, 4, 5)
    snapshot_after_1, snapshot_after_4 = keys(101, 104)
    store(index, chunks)
    store(index, [snapshot_after_1])
    lease, pages = index.lookup(A, chunks, [(1, snapshot_after_1), (4, snapshot_after_4)])
    assert [p[0] for p in pages] == [*chunks[:2], snapshot_after_1]
    index.release(A, lease)
    store(index, [snapshot_after_4])
    lease, pages = index.lookup(A, chunks, [(1, snapshot_after_1), (4, snapshot_after_4)])
    assert [p[0] for p in pages] == [*chunks, snapshot_after_4]
    index.release(A, lease)


def test_a_state_past_the_kv_run_or_no_state_at_all_is_no_hit() -> None:
    index = make_index()
    chunks = keys(1, 2, 3)
    snapshot_after_2 = keys(102)[0]
    store(index, chunks[:2])  # chunk 2 is missing
    store(index, [snapshot_after_2])
    assert index.lookup(A, chunks, [(2, snapshot_after_2)]) == (0, [])
    assert index.lookup(A, chunks, []) == (0, [])


def test_state_pages_are_pinned_with_the_run() -> None:
    index = make_index()
    chunks = keys(1, 2)
    snapshot = keys(102)[0]
    store(index, [*chunks, snapshot])
    lease, _ = index.lookup(A, chunks, [(1, snapshot)])
    assert index.clear() == 0  # everything pinned: nothing can be dropped
    index.release(A, lease)
    assert index.clear() == 3


def test_a_new_page_size_evicts_another_class_when_no_slab_is_free() -> None:
    from kvshare.kvpool.page import slot_bytes_for
    from tests.kvpool.test_index import PAYLOAD, SLAB

    index = make_index(slabs=2)
    old = keys(*range(1, 9))  # 8 pages of the small class fill both slabs
    store(index, old)
    assert index.stats()["free_slabs"] == 0
    big = 2 * PAYLOAD  # another class: 2 slots of it per slab
    assert slot_bytes_for(big) <= SLAB
    reserved, _, dropped = index.reserve(A, keys(100), big)
    assert dropped == 0 and len(reserved) == 1
    survivors = {entry.key for entry in index.pages()} & set(old)
    assert len(survivors) == 4  # exactly one slab's worth of the old class was evicted
    # Pinned pages are never taken: with the survivors pinned, the big class can only
    # reuse its own slab (evicting its own committed page), never theirs.
    lease, _ = index.lookup(A, sorted(survivors))
    index.commit(A, keys(100), [b"x"])
    more, _, dropped = index.reserve(A, keys(101, 102, 103), big)
    assert len(more) == 2 and dropped == 1
    assert survivors <= {entry.key for entry in index.pages()}
    index.release(A, lease)


def test_over_its_quota_a_lookup_ends_at_an_earlier_state_that_fits() -> None:
    index = PoolIndex(ArenaGeometry(4 * SLAB, SLAB), max_client_bytes=5 * SLOT)
    chunks = keys(1, 2, 3, 4, 5)
    snapshot_after_1, snapshot_after_4 = keys(101, 104)
    store(index, chunks[:3], conn=B)
    store(index, [*chunks[3:], snapshot_after_1, snapshot_after_4], conn=B)
    states = [(1, snapshot_after_1), (4, snapshot_after_4)]
    lease, pages = index.lookup(A, chunks, states)  # 6 pages > 5: back to the first state
    assert [p[0] for p in pages] == [*chunks[:2], snapshot_after_1]
    assert index.held_bytes(A) == 3 * SLOT
    assert index.lookup(A, chunks, states) == (0, [])  # 2 slots left: no run with a state fits
    assert index.stats()["quota_cut_keys"] == 3 + 6
    index.release(A, lease)
    assert index.held_bytes(A) == 0


def _in_progress_by_definition(chunks: list[str], snapshots: list[str]) -> int:
    """How many chunks past the resumable committed run another connection produces, by
    the definition: the run ends after the last chunk of the committed run whose state is
    committed (0: none); from the first chunk on, every chunk up to a gap is available
    (committed or in progress elsewhere), and the count ends after the last chunk at or
    past the run's end whose state is available too."""
    run = next((i for i, status in enumerate(chunks) if status != "committed"), len(chunks))
    start = next((i + 1 for i in reversed(range(run)) if snapshots[i] == "committed"), 0)
    end = start
    for i, status in enumerate(chunks):
        if status == "absent":
            break
        if i >= start and snapshots[i] != "absent":
            end = i + 1
    return end - start


def test_in_progress_with_states_agrees_with_its_definition() -> None:
    """Random mixes of committed, claimed, reserved and absent chunks and states: the
    index's count (which scans from the end of the resumable run) is the definition's
    (which scans from the first chunk)."""
    rng = random.Random(7)
    for _ in range(300):
        index = PoolIndex(ArenaGeometry(8 * SLAB, SLAB), clock=lambda: 100.0)
        ks, ss = keys(*range(1, 9)), keys(*range(101, 109))
        chunks = [rng.choice(("committed", "claimed", "reserved", "absent")) for _ in ks]
        snapshots = [rng.choice(("committed", "claimed", "absent")) for _ in ss]
        for key, status in zip([*ks, *ss], [*chunks, *snapshots]):
            if status == "committed":
                store(index, [key])
            elif status == "claimed":
                index.claim(A, [key])
            elif status == "reserved":
                index.reserve(A, [key], PAYLOAD)
        expected = _in_progress_by_definition(chunks, snapshots)
        assert index.in_progress(B, ks, list(enumerate(ss))) == (expected, 0.0), (
            chunks,
            snapshots,
        )
