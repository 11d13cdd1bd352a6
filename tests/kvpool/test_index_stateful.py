"""Stateful property test of PoolIndex against an executable model.

The model predicts every outcome exactly - which keys a reserve gets, skips, drops, and
which page each eviction takes (per-class LRU) - so a wrong victim, a reused slot, a
pinned page evicted, or a visible reservation all fail a step. Two page classes share
two slabs, so slabs move between classes as they empty. Pages invalidated under a lease
leave the index at once and keep their slot until their last pin goes. Each connection may
hold at most QUOTA bytes of slots (reserved, or pinned by its leases), which cuts reserves
and lookups.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
)

from kvshare.kvpool.arena import ArenaGeometry
from kvshare.kvpool.index import PageState, PoolIndex, PoolRequestError
from kvshare.kvpool.page import slot_bytes_for

SLAB = 32768
PAYLOADS = (4096, 3 * 4096 + 1)  # slots of 8 KiB (4 per slab) and 20 KiB (1 per slab)
SLOTS = tuple(slot_bytes_for(p) for p in PAYLOADS)
GEOMETRY = ArenaGeometry(2 * SLAB + 8192, SLAB)  # 2 slabs and an unused tail
CONNS = (1, 2, 3)
KEYS = [bytes([n]) * 16 for n in range(24)]
QUOTA = 40960  # 5 small slots or 2 large ones: less than the 2 slabs


class IndexMachine(RuleBasedStateMachine):
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.index = PoolIndex(GEOMETRY, max_client_bytes=QUOTA)
        self.offset: dict[bytes, int] = {}  # every live page
        self.slot: dict[bytes, int] = {}
        self.payload: dict[bytes, int] = {}
        self.checksum: dict[bytes, bytes] = {}
        self.owner: dict[bytes, int] = {}  # reserved pages only
        self.committed: set[bytes] = set()
        self.pins: Counter[bytes] = Counter()
        # Evictable pages (committed, no pins) per slot size, least recent first.
        self.lru: dict[int, OrderedDict[bytes, None]] = {slot: OrderedDict() for slot in SLOTS}
        self.live_leases: dict[int, tuple[int, list[bytes], list[int]]] = {}
        # Invalidated pages still pinned: slot offset -> [slot bytes, pins].
        self.invalid: dict[int, list[int]] = {}

    # -- model helpers --------------------------------------------------------------

    def taken(self) -> dict[int, int]:
        """Every slot in use, live or invalidated: offset -> slot bytes."""
        return {
            **{self.offset[k]: self.slot[k] for k in self.offset},
            **{offset: slot for offset, (slot, _) in self.invalid.items()},
        }

    def has_room(self, slot: int) -> bool:
        """A class has a free slot in its slabs, or a free slab exists (empty slabs
        go back to the arena at once)."""
        taken = self.taken()
        in_class = [offset for offset, size in taken.items() if size == slot]
        class_slabs = {offset // SLAB for offset in in_class}
        used_slabs = {offset // SLAB for offset in taken}
        per_slab = SLAB // slot
        return len(in_class) < len(class_slabs) * per_slab or len(used_slabs) < GEOMETRY.slab_count

    def forget(self, key: bytes) -> None:
        for table in (self.offset, self.slot, self.payload, self.checksum, self.owner):
            table.pop(key, None)
        self.committed.discard(key)

    def unpin(self, run: list[bytes]) -> None:
        for key in reversed(run):
            self.pins[key] -= 1
            if self.pins[key] == 0:
                self.lru[self.slot[key]][key] = None

    def unpin_lease(self, run: list[bytes], offsets: list[int]) -> None:
        for key, offset in reversed(list(zip(run, offsets, strict=True))):
            if offset in self.invalid:
                self.invalid[offset][1] -= 1
                if self.invalid[offset][1] == 0:
                    del self.invalid[offset]  # the slot is free again
            else:
                self.unpin([key])

    def pin(self, run: list[bytes]) -> None:
        for key in run:
            if self.pins[key] == 0:
                del self.lru[self.slot[key]][key]
            self.pins[key] += 1

    def held(self, conn: int) -> int:
        reserved = sum(self.slot[k] for k, owner in self.owner.items() if owner == conn)
        # By offset: a leased page that was invalidated has left the index, not the lease.
        taken = self.taken()
        leased = sum(
            taken[offset]
            for holder, _, offsets in self.live_leases.values()
            if holder == conn
            for offset in offsets
        )
        return reserved + leased

    def candidates(self) -> list[bytes]:
        return sorted(self.offset) + KEYS[:2]

    # -- rules ---------------------------------------------------------------------

    @rule(
        conn=st.sampled_from(CONNS),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=8),
        payload=st.sampled_from(PAYLOADS),
        extends=st.lists(st.sampled_from(KEYS), max_size=6),
    )
    def reserve(self, conn: int, keys: list[bytes], payload: int, extends: list[bytes]) -> None:
        slot = slot_bytes_for(payload)
        distinct = list(dict.fromkeys(keys))
        present = [k for k in distinct if k in self.offset]
        missing = [k for k in distinct if k not in self.offset]
        # The chain it extends (keys not asked for), head first, then the present keys:
        # committed ones are held while it evicts and end most recent, head last.
        prefix = [k for k in dict.fromkeys(extends) if k not in distinct]
        held = [k for k in prefix + present if k in self.committed]
        reserved, got_present, dropped = self.index.reserve(conn, keys, payload, extends)
        assert got_present == present
        self.pin(held)
        placed = iter(reserved)
        count = 0
        for key in missing:
            if self.held(conn) + slot > QUOTA:
                break
            # Evict this class's LRU page; with none, the largest evictable class's
            # (ties: the larger slot), one page at a time until a slot or slab frees.
            while not self.has_room(slot):
                victim_slot = slot if self.lru[slot] else self.largest_evictable_slot()
                if victim_slot is None:
                    break
                victim = next(iter(self.lru[victim_slot]))
                del self.lru[victim_slot][victim]
                self.forget(victim)
            if not self.has_room(slot):
                break
            got_key, offset = next(placed)
            assert got_key == key
            assert offset not in self.taken(), "slot handed out twice"
            self.offset[key], self.slot[key], self.payload[key] = offset, slot, payload
            self.owner[key] = conn
            count += 1
        assert next(placed, None) is None
        assert dropped == len(missing) - count
        self.unpin(held)

    def largest_evictable_slot(self) -> int | None:
        candidates = [slot for slot, lru in self.lru.items() if lru]
        return max(candidates, key=lambda slot: (len(self.lru[slot]), slot)) if candidates else None

    @rule(conn=st.sampled_from(CONNS), data=st.data(), with_offsets=st.booleans())
    def commit(self, conn: int, data: st.DataObject, with_offsets: bool) -> None:
        own = sorted(k for k, owner in self.owner.items() if owner == conn)
        if not own:
            return
        keys = data.draw(st.lists(st.sampled_from(own), min_size=1, unique=True))
        checksums = [b"c" + key[:1] * n for n, key in enumerate(keys)]
        offsets = [self.offset[k] for k in keys] if with_offsets else None
        self.index.commit(conn, keys, checksums, offsets)
        for key, checksum in reversed(list(zip(keys, checksums, strict=True))):
            del self.owner[key]
            self.committed.add(key)
            self.checksum[key] = checksum
            self.lru[self.slot[key]][key] = None

    @rule(conn=st.sampled_from(CONNS), data=st.data())
    def commit_not_own(self, conn: int, data: st.DataObject) -> None:
        """Committing a key this connection did not reserve fails and changes nothing."""
        foreign = [k for k in KEYS if self.owner.get(k) != conn]
        keys = data.draw(st.lists(st.sampled_from(foreign), min_size=1, max_size=3))
        with pytest.raises(PoolRequestError):
            self.index.commit(conn, keys, [b""] * len(keys))

    @rule(conn=st.sampled_from(CONNS), data=st.data())
    def commit_wrong_offset(self, conn: int, data: st.DataObject) -> None:
        own = sorted(k for k, owner in self.owner.items() if owner == conn)
        if not own:
            return
        key = data.draw(st.sampled_from(own))
        with pytest.raises(PoolRequestError):
            self.index.commit(conn, [key], [b""], [self.offset[key] + 4096])

    @rule(conn=st.sampled_from(CONNS), data=st.data())
    def abort(self, conn: int, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(self.candidates()), max_size=4))
        mine = {k for k in keys if self.owner.get(k) == conn}
        assert self.index.abort(conn, keys) == len(mine)
        for key in mine:
            self.forget(key)

    @rule(target=leases, conn=st.sampled_from(CONNS), data=st.data())
    def lookup(self, conn: int, data: st.DataObject) -> object:
        runs = st.lists(
            st.sampled_from(sorted(self.committed) or KEYS[:1]), min_size=1, unique=True
        )
        anything = st.lists(st.sampled_from(self.candidates()), min_size=1, max_size=6)
        keys = data.draw(st.one_of(runs, anything))
        run: list[bytes] = []
        room = QUOTA - self.held(conn)
        for key in keys:
            if key not in self.committed or self.slot[key] > room:
                break
            room -= self.slot[key]
            run.append(key)
        lease, pages = self.index.lookup(conn, keys)
        expected = [(k, self.offset[k], self.payload[k], self.checksum[k]) for k in run]
        assert pages == expected
        if not run:
            assert lease == 0
            return multiple()
        assert lease not in self.live_leases
        self.pin(run)
        self.live_leases[lease] = (conn, run, [page[1] for page in pages])
        return lease

    @rule(lease=consumes(leases))
    def release(self, lease: int) -> None:
        if lease in self.live_leases:
            conn, run, offsets = self.live_leases.pop(lease)
            self.index.release(conn, lease)
            self.unpin_lease(run, offsets)
        else:  # died with a disconnect
            with pytest.raises(PoolRequestError):
                self.index.release(CONNS[0], lease)

    @rule(lease=leases, conn=st.sampled_from(CONNS))
    def release_by_another_connection(self, lease: int, conn: int) -> None:
        holder = self.live_leases[lease][0] if lease in self.live_leases else None
        if conn == holder:
            return
        with pytest.raises(PoolRequestError):
            self.index.release(conn, lease)

    @rule(lease=leases, conn=st.sampled_from(CONNS), data=st.data())
    def invalidate(self, lease: int, conn: int, data: st.DataObject) -> None:
        """A reader drops pages it found corrupt; only its own lease's pages go."""
        holder = self.live_leases[lease][0] if lease in self.live_leases else None
        if conn != holder:
            with pytest.raises(PoolRequestError):
                self.index.invalidate(conn, lease, KEYS[:1])
            return
        _, run, offsets = self.live_leases[lease]
        keys = data.draw(st.lists(st.sampled_from(run + self.candidates()), max_size=4))
        doomed = {
            k: o for k, o in zip(run, offsets, strict=True) if k in keys and self.offset.get(k) == o
        }
        assert self.index.invalidate(conn, lease, keys) == len(doomed)
        for key, offset in doomed.items():
            self.invalid[offset] = [self.slot[key], self.pins.pop(key)]
            self.forget(key)

    @rule(conn=st.sampled_from(CONNS))
    def disconnect(self, conn: int) -> None:
        self.index.disconnect(conn)
        for lease in sorted(lease for lease, held in self.live_leases.items() if held[0] == conn):
            _, run, offsets = self.live_leases.pop(lease)
            self.unpin_lease(run, offsets)
        for key in [k for k, owner in self.owner.items() if owner == conn]:
            self.forget(key)

    @rule()
    def clear(self) -> None:
        evictable = [key for lru in self.lru.values() for key in lru]
        assert self.index.clear() == len(evictable)
        for lru in self.lru.values():
            lru.clear()
        for key in evictable:
            self.forget(key)

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def pages_match_the_model(self) -> None:
        entries = {entry.key: entry for entry in self.index.pages()}
        assert set(entries) == set(self.offset)
        for key, entry in entries.items():
            assert entry.offset == self.offset[key]
            assert entry.slot_bytes == self.slot[key]
            assert entry.pins == self.pins[key]
            if key in self.committed:
                assert (entry.state, entry.owner) == (PageState.COMMITTED, None)
            else:
                assert (entry.state, entry.owner) == (PageState.RESERVED, self.owner[key])

    @invariant()
    def slots_are_disjoint_aligned_and_inside_one_slab_per_class(self) -> None:
        spans = sorted(self.taken().items())
        for (offset, slot), (next_offset, _) in itertools.pairwise(spans):
            assert offset + slot <= next_offset, "two live pages overlap"
        slab_class: dict[int, int] = {}
        for offset, slot in spans:
            slab = offset // SLAB
            assert slab < GEOMETRY.slab_count
            assert (offset - slab * SLAB) % slot == 0 and offset + slot <= (slab + 1) * SLAB
            assert slab_class.setdefault(slab, slot) == slot, "a slab serves two classes"

    @invariant()
    def counts_add_up(self) -> None:
        stats = self.index.stats()
        slabs = 0
        for klass in stats["classes"]:
            assert (
                klass["free"] + klass["reserved"] + klass["committed"] + klass["invalid"]
                == klass["pages"]
            )
            assert klass["pages"] == klass["slabs"] * klass["slots_per_slab"]
            assert klass["free"] >= 0
            slabs += klass["slabs"]
        assert slabs + stats["free_slabs"] == GEOMETRY.slab_count
        slot_bytes = sum(klass["pages"] * klass["slot_bytes"] for klass in stats["classes"])
        assert slot_bytes <= GEOMETRY.slab_count * SLAB <= stats["arena_bytes"]
        assert stats["committed"] == len(self.committed)
        assert stats["reserved"] == len(self.owner)
        assert stats["invalid"] == len(self.invalid)
        assert stats["pinned"] == sum(1 for n in self.pins.values() if n > 0) + len(self.invalid)
        assert stats["leases"] == len(self.live_leases)

    @invariant()
    def no_connection_holds_more_than_its_quota(self) -> None:
        for conn in CONNS:
            assert self.index.held_bytes(conn) == self.held(conn) <= QUOTA

    @invariant()
    def leased_pages_stay_put(self) -> None:
        """A page under a live lease is committed at the offset the lookup returned (or
        invalidated, out of the index, its slot still taken)."""
        entries = {entry.key: entry for entry in self.index.pages()}
        for _, run, offsets in self.live_leases.values():
            for key, offset in zip(run, offsets, strict=True):
                if offset in self.invalid:
                    assert key not in entries or entries[key].offset != offset
                    continue
                entry = entries[key]
                assert (entry.state, entry.offset) == (PageState.COMMITTED, offset)
                assert entry.pins > 0


IndexMachine.TestCase.settings = settings(max_examples=250, stateful_step_count=40, deadline=None)
TestIndexMachine = IndexMachine.TestCase
