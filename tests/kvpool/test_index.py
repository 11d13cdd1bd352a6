from __future__ import annotations

import time

import pytest

from kvshare.kvpool.arena import ArenaGeometry
from kvshare.kvpool.index import PageState, PoolIndex, PoolRequestError
from kvshare.kvpool.page import slot_bytes_for

PAYLOAD = 4096
SLOT = slot_bytes_for(PAYLOAD)  # 8 KiB
SLAB = 4 * SLOT
A, B = 1, 2  # connections


def keys(*numbers: int) -> list[bytes]:
    return [n.to_bytes(16, "big") for n in numbers]


def make_index(slabs: int = 2, extra_bytes: int = 0) -> PoolIndex:
    return PoolIndex(ArenaGeometry(slabs * SLAB + extra_bytes, SLAB))


def store(index: PoolIndex, stored: list[bytes], conn: int = A) -> list[int]:
    reserved, _, dropped = index.reserve(conn, stored, PAYLOAD)
    assert dropped == 0 and [key for key, _ in reserved] == stored
    index.commit(conn, stored, [b"sum:" + key[-2:] for key in stored])
    return [offset for _, offset in reserved]


def live_keys(index: PoolIndex) -> set[bytes]:
    return {entry.key for entry in index.pages()}


def test_lookup_returns_the_longest_committed_run_from_the_first_key() -> None:
    index = make_index()
    offsets = store(index, keys(1, 2, 3))
    lease, pages = index.lookup(B, keys(1, 2, 3, 4))
    assert lease > 0
    assert pages == [
        (k, o, PAYLOAD, b"sum:" + k[-2:]) for k, o in zip(keys(1, 2, 3), offsets, strict=True)
    ]
    assert index.lookup(B, keys(9, 1, 2)) == (0, [])
    _, pages = index.lookup(B, keys(1, 9, 2))
    assert [page[0] for page in pages] == keys(1)
    stats = index.stats()
    assert (stats["lookups"], stats["hit_keys"], stats["miss_keys"]) == (3, 4, 6)


def test_reserved_pages_are_invisible_until_commit() -> None:
    """docs/architecture.md F5: a page being written must never be returned by a lookup."""
    index = make_index()
    store(index, keys(1))
    index.reserve(A, keys(2, 3), PAYLOAD)
    _, pages = index.lookup(B, keys(1, 2, 3))
    assert [page[0] for page in pages] == keys(1)
    assert index.lookup(B, keys(2)) == (0, [])
    index.commit(A, keys(2, 3), [b"", b""])
    _, pages = index.lookup(B, keys(1, 2, 3))
    assert [page[0] for page in pages] == keys(1, 2, 3)


def test_reserve_skips_present_keys_and_counts_duplicates_once() -> None:
    index = make_index()
    store(index, keys(1))
    index.reserve(B, keys(2), PAYLOAD)
    reserved, present, dropped = index.reserve(A, keys(1, 2, 3, 3, 4), PAYLOAD)
    assert [key for key, _ in reserved] == keys(3, 4)
    assert present == keys(1, 2)
    assert dropped == 0


def test_only_the_reserving_connection_can_commit_and_commit_is_all_or_nothing() -> None:
    index = make_index()
    index.reserve(A, keys(1, 2), PAYLOAD)
    index.reserve(B, keys(3), PAYLOAD)
    with pytest.raises(PoolRequestError):
        index.commit(B, keys(1), [b""])
    with pytest.raises(PoolRequestError):
        index.commit(A, keys(1, 3), [b"", b""])  # key 3 belongs to B: nothing commits
    with pytest.raises(PoolRequestError):
        index.commit(A, keys(1, 1), [b"", b""])
    with pytest.raises(PoolRequestError):
        index.commit(A, keys(1), [b"", b""])
    assert index.lookup(A, keys(1)) == (0, [])
    index.commit(A, keys(1, 2), [b"x", b"y"])
    assert [page[3] for page in index.lookup(A, keys(1, 2))[1]] == [b"x", b"y"]


def test_commit_with_offsets_checks_the_slot_that_was_written() -> None:
    index = make_index()
    ((_, offset),) = index.reserve(A, keys(1), PAYLOAD)[0]
    with pytest.raises(PoolRequestError):
        index.commit(A, keys(1), [b""], offsets=[offset + SLOT])
    index.commit(A, keys(1), [b""], offsets=[offset])
    assert index.lookup(A, keys(1))[1][0][1] == offset


def test_abort_frees_only_own_reservations() -> None:
    index = make_index()
    index.reserve(A, keys(1, 2), PAYLOAD)
    index.reserve(B, keys(3), PAYLOAD)
    assert index.abort(A, keys(1, 3, 9)) == 1
    assert live_keys(index) == set(keys(2, 3))
    assert index.stats()["reserved"] == 2


def test_eviction_takes_the_least_recently_used_and_chain_tails_first() -> None:
    index = make_index(slabs=1)  # 4 slots
    store(index, keys(1, 2))
    store(index, keys(3, 4))
    # Within one commit, the first key of the run ends most recent: order 2, 1, 4, 3.
    index.reserve(A, keys(5), PAYLOAD)
    assert live_keys(index) == set(keys(1, 3, 4, 5))
    lease, _ = index.lookup(B, keys(1))
    index.release(B, lease)  # 1 becomes most recent: order 4, 3, 1
    index.reserve(A, keys(6, 7), PAYLOAD)
    assert live_keys(index) == set(keys(1, 5, 6, 7))
    assert index.stats()["evictions"] == 3


def test_released_run_is_touched_so_its_first_key_is_most_recent() -> None:
    index = make_index(slabs=1)
    store(index, keys(1))
    store(index, keys(2, 3, 4))  # order: 1, 4, 3, 2
    lease, _ = index.lookup(B, keys(2, 3))
    index.release(B, lease)  # order: 1, 4, 3, 2 -> 1, 4, then 3, 2 again
    lease, _ = index.lookup(B, keys(3, 4))
    index.release(B, lease)  # order: 1, 2, 4, 3
    for evicted, new_key in [(1, 10), (2, 11), (4, 12)]:
        index.reserve(A, keys(new_key), PAYLOAD)
        assert keys(evicted)[0] not in live_keys(index)


def test_reserve_never_evicts_the_present_prefix_it_extends() -> None:
    index = make_index(slabs=1)
    store(index, keys(1, 2, 3, 4))
    reserved, present, dropped = index.reserve(A, keys(1, 2, 3, 4, 5, 6), PAYLOAD)
    assert present == keys(1, 2, 3, 4)
    assert reserved == [] and dropped == 2
    assert live_keys(index) == set(keys(1, 2, 3, 4))
    # The present prefix is now recent: an unrelated store evicts from its tail.
    store(index, keys(7))
    assert live_keys(index) == set(keys(1, 2, 3, 7))


@pytest.mark.parametrize("told", [True, False])
def test_a_chain_stored_step_by_step_keeps_its_head_when_each_reserve_names_it(
    told: bool,
) -> None:
    """A chunked prefill stores its chunks one step at a time; a reserve that names the
    chain it extends never evicts that chain and leaves its head most recent. Untold, the
    pool takes the chain's head, the oldest commit, and keeps a tail nobody can restore."""
    index = make_index(slabs=1)  # 4 slots
    store(index, keys(1, 2))  # the chain's first step
    store(index, keys(9))  # another prefix, more recent than the chain
    for step, new_key in enumerate((3, 4)):
        chain = keys(1, 2, 3)[: 2 + step]
        _, _, dropped = index.reserve(A, keys(new_key), PAYLOAD, chain if told else ())
        assert dropped == 0
        index.commit(A, keys(new_key), [b"s"])
    if told:
        assert live_keys(index) == set(keys(1, 2, 3, 4))  # the other prefix went
        # The pool is full of the chain: its next chunk is dropped, its head kept.
        assert index.reserve(A, keys(5), PAYLOAD, keys(1, 2, 3, 4))[2] == 1
        assert index.committed_run(keys(1, 2, 3, 4)) == 4
    else:
        assert live_keys(index) == set(keys(1, 3, 4, 9))  # 2 went: the chain is cut
        assert index.committed_run(keys(1, 2, 3, 4)) == 1


def test_pinned_and_reserved_pages_are_never_evicted_and_a_full_pool_drops() -> None:
    """docs/architecture.md F10, F11: reserve returns fewer pages, never an error, never a reused slot."""
    index = make_index(slabs=1)
    offsets = store(index, keys(1, 2, 3))
    lease, _ = index.lookup(B, keys(1, 2, 3))
    index.reserve(A, keys(4), PAYLOAD)
    reserved, present, dropped = index.reserve(A, keys(5, 6, 7), PAYLOAD)
    assert (reserved, present, dropped) == ([], [], 3)
    assert index.stats()["dropped_keys"] == 3
    assert sorted(entry.offset for entry in index.pages() if entry.key in keys(1, 2, 3)) == offsets
    index.release(B, lease)
    _, _, dropped = index.reserve(A, keys(5), PAYLOAD)
    assert dropped == 0
    assert live_keys(index) == set(keys(1, 2, 4, 5))  # the run's tail (3) went first


def test_a_lease_lives_until_released_whatever_happens_meanwhile() -> None:
    """docs/architecture.md F14: no timeout; only release or disconnect ends a lease."""
    index = make_index(slabs=1)
    offsets = store(index, keys(1, 2))
    lease, _ = index.lookup(B, keys(1, 2))
    for round_ in range(50):
        new = keys(1000 + 2 * round_, 1001 + 2 * round_)
        index.reserve(A, new, PAYLOAD)
        index.commit(A, new, [b"", b""])
        live_offsets = sorted(entry.offset for entry in index.pages())
        assert len(set(live_offsets)) == 4 and live_offsets[-1] + SLOT <= SLAB
        index.clear()
    assert [entry.offset for entry in index.pages() if entry.key in keys(1, 2)] == offsets
    index.release(B, lease)
    assert index.clear() == 2


def test_release_rejects_unknown_or_foreign_leases() -> None:
    index = make_index()
    store(index, keys(1))
    lease, _ = index.lookup(A, keys(1))
    with pytest.raises(PoolRequestError):
        index.release(B, lease)
    with pytest.raises(PoolRequestError):
        index.release(A, lease + 1)
    index.release(A, lease)
    with pytest.raises(PoolRequestError):
        index.release(A, lease)


def test_disconnect_drops_leases_and_reservations() -> None:
    index = make_index()
    store(index, keys(1, 2))
    index.lookup(B, keys(1, 2))
    index.lookup(B, keys(1))
    index.reserve(B, keys(3, 4), PAYLOAD)
    stats = index.stats()
    assert (stats["pinned"], stats["reserved"], stats["leases"]) == (2, 2, 2)
    index.disconnect(B)
    stats = index.stats()
    assert (stats["pinned"], stats["reserved"], stats["leases"]) == (0, 0, 0)
    assert live_keys(index) == set(keys(1, 2))
    assert index.clear() == 2


def test_an_invalidated_page_leaves_the_index_and_its_slot_waits_for_its_last_pin() -> None:
    """A reader that found a page corrupt drops it at once for everyone; a lease that still
    reads the slot keeps it from being reused until that lease goes."""
    index = make_index(slabs=1)
    offsets = store(index, keys(1, 2))
    reader, _ = index.lookup(A, keys(1, 2))
    index.lookup(B, keys(1, 2))  # a second reader pins the same pages
    with pytest.raises(PoolRequestError):
        index.invalidate(B, reader, keys(2))  # only the lease's own connection
    assert index.invalidate(A, reader, keys(2, 9)) == 1  # a key the lease does not hold is ignored
    assert index.invalidate(A, reader, keys(2)) == 0  # already gone
    assert live_keys(index) == set(keys(1))
    assert [page[0] for page in index.lookup(B, keys(1, 2))[1]] == keys(1)
    reserved, _, _ = index.reserve(B, keys(2), PAYLOAD)
    assert reserved[0][1] not in offsets  # the pinned slot is not handed out again
    assert (index.stats()["invalid"], index.stats()["pinned"]) == (1, 2)
    index.release(A, reader)
    assert index.stats()["invalid"] == 1  # the other lease still pins it
    index.disconnect(B)
    stats = index.stats()
    assert (stats["invalid"], stats["pinned"], stats["invalidated_keys"]) == (0, 0, 1)
    assert stats["free"] == stats["pages"] - 1  # only key 1 is left
    reserved, _, dropped = index.reserve(
        A, keys(3, 4, 5), PAYLOAD
    )  # the 3 other slots, no eviction
    assert dropped == 0 and offsets[1] in {offset for _, offset in reserved}
    assert live_keys(index) == set(keys(1, 3, 4, 5))


def test_clear_keeps_pinned_and_reserved_pages() -> None:
    index = make_index()
    store(index, keys(1, 2, 3))
    index.lookup(B, keys(1))
    index.reserve(A, keys(4), PAYLOAD)
    assert index.clear() == 2
    states = {entry.key: (entry.state, entry.pins) for entry in index.pages()}
    assert states == {keys(1)[0]: (PageState.COMMITTED, 1), keys(4)[0]: (PageState.RESERVED, 0)}


def test_free_slabs_move_between_page_classes() -> None:
    index = make_index(slabs=2, extra_bytes=SLOT)
    big_payload = SLAB - 4096  # one slot per slab
    store(index, keys(*range(8)))  # fills both slabs with small pages
    # No free slab: the big class evicts small pages until one of their slabs is empty.
    reserved, _, dropped = index.reserve(A, keys(100), big_payload)
    assert dropped == 0 and index.stats()["committed"] == 4
    index.abort(A, keys(100))
    index.clear()
    stats = index.stats()
    assert (stats["free_slabs"], stats["pages"]) == (2, 0)
    reserved, _, dropped = index.reserve(A, keys(100, 101, 102), big_payload)
    assert sorted(offset for _, offset in reserved) == [0, SLAB] and dropped == 1
    assert stats["unused_bytes"] == SLOT


def test_page_larger_than_a_slab_is_a_request_error() -> None:
    index = make_index()
    with pytest.raises(PoolRequestError):
        index.reserve(A, keys(1), SLAB)
    with pytest.raises(ValueError):
        index.reserve(A, keys(1), 0)


def test_stats_accounting_adds_up() -> None:
    index = make_index(slabs=3, extra_bytes=100)
    offsets = store(index, keys(1, 2, 3, 4, 5))
    offsets += [offset for _, offset in index.reserve(A, keys(6, 7), PAYLOAD)[0]]
    assert len(set(offsets)) == 7 and all(offset % SLOT == 0 for offset in offsets)
    index.lookup(B, keys(1, 2))
    stats = index.stats()
    (klass,) = stats["classes"]
    assert klass["slot_bytes"] == SLOT and klass["slabs"] == 2 and klass["pages"] == 8
    assert klass["free"] + klass["reserved"] + klass["committed"] == klass["pages"]
    assert (klass["free"], klass["reserved"], klass["committed"], klass["pinned"]) == (1, 2, 5, 2)
    assert stats["free_slabs"] + klass["slabs"] == stats["slab_count"] == 3
    assert stats["pages"] * SLOT <= stats["arena_bytes"]


def test_a_million_pages_evict_at_over_100k_per_second() -> None:
    """docs/architecture.md F13: every per-key operation is O(1), so eviction stays fast at 1M pages.

    Timed in this thread's CPU time, not wall time: other processes on a loaded machine stretch
    the wall clock (a 2-core box at load 8 measured 45k/s wall, 180k/s CPU), while an O(n)
    eviction at a million pages is thousands of times slower in either."""
    pages, batch = 1_000_000, 1000
    index = PoolIndex(ArenaGeometry(pages * SLOT, 1000 * SLOT))  # virtual: never mapped
    all_keys = [n.to_bytes(16, "little") for n in range(pages + 200_000)]
    checksums = [b""] * batch
    for start in range(0, pages, batch):
        chunk = all_keys[start : start + batch]
        index.reserve(A, chunk, PAYLOAD)
        index.commit(A, chunk, checksums)
    assert index.stats()["committed"] == pages
    begin = time.thread_time()
    for start in range(pages, pages + 200_000, batch):
        chunk = all_keys[start : start + batch]
        index.reserve(A, chunk, PAYLOAD)
        index.commit(A, chunk, checksums)
    elapsed = time.thread_time() - begin
    stats = index.stats()
    assert stats["evictions"] == 200_000 and stats["committed"] == pages
    rate = 200_000 / elapsed
    print(f"index: {rate:,.0f} evictions/s of CPU (reserve + evict + commit) at {pages:,} pages")
    assert rate > 100_000


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_claim_is_in_progress_for_others_until_its_commit() -> None:
    """Claims say who produces which keys: another connection sees them in progress after
    its committed run, with the producer's idle time; the claimer itself does not."""
    clock = FakeClock()
    index = PoolIndex(ArenaGeometry(2 * SLAB, SLAB), clock=clock)
    store(index, keys(1))
    assert index.claim(A, keys(1, 2, 3, 4)) == 3  # key 1 is committed: not claimable
    assert index.claim(B, keys(3, 4, 5)) == 1  # 3 and 4 are A's: B gets 5 only
    clock.now += 2.5
    assert index.in_progress(B, keys(1, 2, 3, 4, 5)) == (3, 2.5)  # 2-4 by A, then 5 is B's
    assert index.in_progress(A, keys(1, 2, 3)) == (0, 0.0)  # its own claims
    store(index, keys(2))  # committing renews A's sign of life and ends the claim
    assert index.in_progress(B, keys(1, 2, 3, 4)) == (2, 0.0)
    reserved, _, _ = index.reserve(A, keys(3), PAYLOAD)  # a reserved page is in progress too
    assert [key for key, _ in reserved] == keys(3)
    clock.now += 1.0
    assert index.in_progress(B, keys(1, 2, 3, 4)) == (2, 1.0)
    index.commit(A, keys(3), [b"sum"])
    assert index.in_progress(B, keys(1, 2, 3, 4)) == (1, 0.0)
    stats = index.stats()
    assert (stats["claims"], stats["claimed_keys"]) == (2, 4)  # A's key 4, B's key 5


def test_with_states_in_progress_ends_at_the_last_state_in_progress() -> None:
    """A hybrid waiter resumes only after a chunk with a state page: what it may wait for
    ends at the last chunk whose state key is claimed or committed too, counted from the
    resumable run lookup answers."""
    clock = FakeClock()
    index = PoolIndex(ArenaGeometry(4 * SLAB, SLAB), clock=clock)
    ks, ss = keys(*range(1, 9)), keys(*range(101, 109))
    states = list(enumerate(ss))
    index.claim(A, [*ks, ss[3], ss[7]])  # A will snapshot after chunks 3 and 7
    assert index.in_progress(B, ks, states) == (8, 0.0)
    assert index.in_progress(A, ks, states) == (0, 0.0)  # its own claims
    index.unclaim(A, [ss[7]])
    assert index.in_progress(B, ks, states) == (4, 0.0)  # resumable only after chunk 3
    assert index.in_progress(B, ks) == (8, 0.0)  # without states every chunk counts
    store(index, ks[:5])
    store(index, [ss[3]])
    assert index.lookup(B, ks, states)[1][-1][0] == ss[3]
    assert index.in_progress(B, ks, states) == (0, 0.0)  # nothing resumable past chunk 3
    index.claim(A, [ss[7]])
    clock.now += 1.5
    assert index.in_progress(B, ks, states) == (4, 1.5)  # chunks 4-7, A idle since its claim
    index.unclaim(A, ks[6:7])  # a gap: chunk 6 is nobody's
    assert index.in_progress(B, ks, states) == (0, 0.0)


def test_unclaim_abort_and_disconnect_end_claims_at_once() -> None:
    index = PoolIndex(ArenaGeometry(2 * SLAB, SLAB), clock=FakeClock())
    index.claim(A, keys(1, 2, 3))
    assert index.unclaim(A, keys(1, 9)) == 1
    assert index.unclaim(B, keys(2)) == 0  # not B's
    assert index.in_progress(B, keys(1, 2, 3)) == (0, 0.0)  # key 1 is nobody's now
    assert index.in_progress(B, keys(2, 3)) == (2, 0.0)
    index.abort(A, keys(2))  # a producer that gives a key up unclaims it
    assert index.in_progress(B, keys(2, 3)) == (0, 0.0)
    assert index.in_progress(B, keys(3)) == (1, 0.0)
    index.reserve(A, keys(4), PAYLOAD)
    index.disconnect(A)  # a dead producer: claims and reservations end together
    assert index.in_progress(B, keys(3)) == (0, 0.0)
    assert index.in_progress(B, keys(4)) == (0, 0.0)
    assert index.stats()["claims"] == 0
    assert index.claim(B, keys(3, 4)) == 2  # free to be claimed again


def test_claims_per_connection_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvshare.kvpool.index.MAX_CLAIMS_PER_CONN", 3)
    index = PoolIndex(ArenaGeometry(2 * SLAB, SLAB), clock=FakeClock())
    assert index.claim(A, keys(1, 2, 3, 4, 5)) == 3
    assert index.claim(A, keys(1, 2, 3)) == 3  # renewing its own claims is always allowed
    assert index.in_progress(B, keys(1, 2, 3, 4)) == (3, 0.0)
