"""The pool index: the daemon's single authority over which key lives in which slot.

Pure Python, no I/O: it needs the arena's geometry, never its mapping.

Slots. The arena's slabs are handed on demand to page classes (one per slot size)
and carved into `slab_bytes // slot_bytes` slots. A slot is free, or holds a page
that is RESERVED (owned by the connection that reserved it, invisible to lookups,
docs/architecture.md F5) or COMMITTED (visible). A slab whose slots are all free goes straight
back to the arena's free-slab list, so any class can take it next.

Leases. `lookup` pins the pages it returns under a lease that lives until its
connection releases it or disconnects - never a timeout (docs/architecture.md F10, F14).

Eviction. Each class keeps an LRU of its COMMITTED pages with no pins; pinned and
reserved pages are never in it, so eviction can never take them. A page enters the
LRU as most recent when it becomes evictable: at commit, and when its last pin goes
(pins come from leases, and from a reserve that finds the key present, for the
duration of that reserve). Within one request the keys are touched last to first, so
a chain's first chunk ends most recent and eviction takes the tails of prefixes
before their heads (a tail is useless without its head). A prefix stored over several
steps names, in each reserve, the chain it extends: those pages are held like present ones
and touched head last, so a prefix longer than the pool keeps its head and drops its
tail. Every per-key operation is O(1) (docs/architecture.md F13).

Invalidation. A reader that finds a page corrupt (its checksum or header disagrees)
tells the index, under the lease it read the page with; the key leaves the index at
once, so no later lookup returns it and a reserve of the key gets a fresh slot. The
slot itself stays taken (INVALID) until its last pin goes, so a page another lease
still reads is never reused under it.

Full pool. `reserve` takes a slot from, in order: the class's free slots, a free
slab, the class's least recently used evictable page. When none is left, the
remaining keys are dropped and counted, never an error and never a wait (docs/architecture.md F11).

Per-connection quota. With `max_client_bytes`, the slots one connection holds -
reserved by it, or pinned by its leases (a slot counts once per lease) - never exceed
that many bytes, so no single client can reserve or pin the whole pool and leave the
others nothing but evictions. Over the quota, `reserve` drops the remaining keys and
`lookup` returns a shorter run; both are counted, neither is an error.

Claims. A connection about to compute chunks the pool lacks may claim their keys: a
claim says "in progress here", takes no slot and is never visible as a page. It ends
when any connection commits the key, when its connection reserves the key (the page, if
reserved, is in progress itself), aborts it or unclaims it, and when its connection
drops. `in_progress` tells another connection how many keys after its committed run are
being produced elsewhere (claimed, or reserved and not yet committed) and how long their
producer has been idle (no claim, reserve or commit since), so that it can wait for them instead
of computing them again. For a model that resumes only at a state snapshot, the count ends
at the last chunk whose state page is committed or being produced too: a waiter resumes
there or nowhere, so a producer claims the state keys of the snapshots it will store. A
connection holds at most MAX_CLAIMS_PER_CONN claims.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvshare.kvpool.arena import ArenaGeometry
from kvshare.kvpool.page import MAX_CHECKSUM_BYTES, slot_bytes_for

# What lookup returns per page: (key, slot offset, payload bytes, checksum).
PageTuple = tuple[bytes, int, int, bytes]


# Claims one connection may hold at once (a 128k-token prompt in 16-token chunks is 8k).
MAX_CLAIMS_PER_CONN = 65536

# Monotonic counters in stats(), in the order tools print them.
COUNTERS = (
    "lookups",
    "hit_keys",
    "miss_keys",
    "evictions",
    "reserved_keys",
    "dropped_keys",
    "committed_keys",
    "aborted_keys",
    "cleared_keys",
    "invalidated_keys",
    "quota_dropped_keys",
    "quota_cut_keys",
    "claimed_keys",
    "in_progress_answers",
)


class PoolRequestError(ValueError):
    """A request that breaks the index's contract (unknown lease, commit of a key this
    connection did not reserve, ...). Raised before any state changes."""


class PageState(enum.Enum):
    RESERVED = "reserved"
    COMMITTED = "committed"
    INVALID = "invalid"  # out of the index, its slot freed at its last unpin


_RESERVED = PageState.RESERVED
_COMMITTED = PageState.COMMITTED
_INVALID = PageState.INVALID


@dataclass(frozen=True)
class PageEntry:
    """A read-only description of one live page, for checkers and tests."""

    key: bytes
    offset: int
    slot_bytes: int
    payload_bytes: int
    state: PageState
    pins: int
    owner: int | None


class _PageClass:
    """All slabs of one slot size, and the LRU of their evictable pages."""

    __slots__ = (
        "committed",
        "invalid",
        "lru",
        "pinned",
        "reserved",
        "slabs",
        "slot_bytes",
        "slots_per_slab",
        "with_room",
    )

    def __init__(self, slot_bytes: int, slab_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.slots_per_slab = slab_bytes // slot_bytes
        self.slabs: dict[int, _Slab] = {}
        # Stack of slabs that may have a free slot; stale entries (full or retired
        # slabs) are dropped when met, so each slab is listed at most once.
        self.with_room: list[_Slab] = []
        self.lru: OrderedDict[bytes, _Page] = OrderedDict()
        self.reserved = 0
        self.committed = 0
        self.invalid = 0
        self.pinned = 0


class _Slab:
    """One assignment of an arena slab to a class; hands out its slots.

    Slots are carved lazily (`carved` counts slots ever handed out), so taking a slab
    is O(1) whatever its slot count.
    """

    __slots__ = (
        "capacity",
        "carved",
        "free",
        "index",
        "listed",
        "live",
        "offset",
        "page_class",
        "retired",
    )

    def __init__(self, index: int, offset: int, page_class: _PageClass) -> None:
        self.index = index
        self.offset = offset
        self.page_class = page_class
        self.capacity = page_class.slots_per_slab
        self.carved = 0
        self.free: list[int] = []
        self.live = 0
        self.listed = False
        self.retired = False

    def take(self) -> int:
        if self.free:
            offset = self.free.pop()
        else:
            offset = self.offset + self.carved * self.page_class.slot_bytes
            self.carved += 1
        self.live += 1
        return offset

    def give(self, offset: int) -> None:
        self.free.append(offset)
        self.live -= 1


class _Page:
    __slots__ = (
        "checksum",
        "key",
        "offset",
        "owner",
        "page_class",
        "payload_bytes",
        "pins",
        "slab",
        "state",
    )

    def __init__(
        self, key: bytes, slab: _Slab, offset: int, payload_bytes: int, owner: int
    ) -> None:
        self.key = key
        self.slab = slab
        self.page_class = slab.page_class
        self.offset = offset
        self.payload_bytes = payload_bytes
        self.state = _RESERVED
        self.owner: int | None = owner
        self.pins = 0
        self.checksum = b""


class _Lease:
    __slots__ = ("conn", "nbytes", "pages")

    def __init__(self, conn: int, pages: list[_Page]) -> None:
        self.conn = conn
        self.pages = pages
        self.nbytes = _slot_bytes_of(pages)


class PoolIndex:
    """Key -> page metadata, slot allocation, LRU eviction and leases for one arena.

    Connections are opaque ints chosen by the caller. Not thread-safe: the daemon calls
    it from one event loop thread only. `max_client_bytes` (None: no limit) caps the
    slot bytes each connection holds through reservations and leases. `clock` (seconds,
    monotonic) dates claims and commits.
    """

    def __init__(
        self,
        geometry: ArenaGeometry,
        max_client_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_client_bytes is not None and max_client_bytes <= 0:
            raise ValueError(f"max_client_bytes must be > 0, got {max_client_bytes}")
        self.geometry = geometry
        self.max_client_bytes = max_client_bytes
        # Popped from the end: slab 0 is handed out first.
        self._free_slabs: list[int] = list(range(geometry.slab_count - 1, -1, -1))
        self._classes: dict[int, _PageClass] = {}
        self._pages: dict[bytes, _Page] = {}
        self._leases: dict[int, _Lease] = {}
        self._conn_leases: dict[int, set[int]] = {}
        self._conn_reservations: dict[int, dict[bytes, _Page]] = {}
        # Invariant: per connection, the slot bytes of its reservations plus those of
        # its leases' pages (absent = 0).
        self._conn_bytes: dict[int, int] = {}
        self._next_lease = 1
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._clock = clock
        # key -> (claiming connection, when claimed); per connection, its claimed keys.
        self._claims: dict[bytes, tuple[int, float]] = {}
        self._conn_claims: dict[int, set[bytes]] = {}
        # When each connection last claimed, reserved or committed: a producer's sign of life.
        self._last_progress: dict[int, float] = {}

    # -- lookups and leases -------------------------------------------------------

    def lookup(
        self,
        conn: int,
        keys: Sequence[bytes],
        states: Sequence[tuple[int, bytes]] | None = None,
        *,
        counted: bool = True,
    ) -> tuple[int, list[PageTuple]]:
        """Pin the longest run of COMMITTED pages from keys[0] under a new lease.

        With `states` ([(chunk index, state key)], for models whose resumable prefixes
        need a recurrent-state snapshot), the run is cut back to the longest one that ends
        right after a chunk i with a committed state key, and that state page is appended
        to the result (a prefix without its state is useless). Returns (lease, pages);
        (0, []) when nothing usable hits. `counted=False` (the daemon's own reads, such as
        publishing to a remote tier) leaves the lookup and hit counters alone.
        """
        pages = self._pages
        run: list[_Page] = []
        for key in keys:
            page = pages.get(key)
            if page is None or page.state is not _COMMITTED:
                break
            run.append(page)
        if states is not None:
            run = self._cut_at_state(run, states)
        allowed = self._quota_left(conn)
        if allowed is not None and _slot_bytes_of(run) > allowed:
            fitted = self._fit_run(run, states, allowed)
            self._counters["quota_cut_keys"] += len(run) - len(fitted)
            run = fitted
        if counted:
            counters = self._counters
            counters["lookups"] += 1
            counters["hit_keys"] += len(run)
            counters["miss_keys"] += max(0, len(keys) - len(run))
        if not run:
            return 0, []
        for page in run:
            self._pin(page)
        lease = self._next_lease
        self._next_lease += 1
        held = self._leases[lease] = _Lease(conn, run)
        self._conn_leases.setdefault(conn, set()).add(lease)
        self._add_conn_bytes(conn, held.nbytes)
        return lease, [(p.key, p.offset, p.payload_bytes, p.checksum) for p in run]

    def committed_run(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from keys[0], are COMMITTED; pins and counts nothing."""
        run = 0
        for key in keys:
            page = self._pages.get(key)
            if page is None or page.state is not _COMMITTED:
                break
            run += 1
        return run

    def _cut_at_state(self, run: list[_Page], states: Sequence[tuple[int, bytes]]) -> list[_Page]:
        """run[:i + 1] + [state page] for the largest i with a committed state, else []."""
        for index, key in sorted(states, reverse=True):
            if index >= len(run):
                continue
            page = self._pages.get(key)
            if page is not None and page.state is _COMMITTED:
                return [*run[: index + 1], page]
        return []

    def _fit_run(
        self, run: list[_Page], states: Sequence[tuple[int, bytes]] | None, allowed: int
    ) -> list[_Page]:
        """The longest part of `run` within `allowed` bytes: a prefix, or with `states` a
        shorter prefix that still ends after a chunk with a state page, plus that page."""
        if states is None:
            fitted: list[_Page] = []
            total = 0
            for page in run:
                total += page.page_class.slot_bytes
                if total > allowed:
                    break
                fitted.append(page)
            return fitted
        # run is run[:i + 1] + [state page]: retry with the chunks before i only.
        while run and _slot_bytes_of(run) > allowed:
            run = self._cut_at_state(run[: len(run) - 2], states)
        return run

    def release(self, conn: int, lease: int) -> None:
        """Unpin the pages of `lease`, which `conn` must hold."""
        held = self._leases.get(lease)
        if held is None or held.conn != conn:
            raise PoolRequestError(f"unknown lease {lease}")
        del self._leases[lease]
        self._conn_leases[conn].discard(lease)
        self._add_conn_bytes(conn, -held.nbytes)
        self._unpin_all(held.pages)

    def invalidate(self, conn: int, lease: int, keys: Sequence[bytes]) -> int:
        """Drop from the index the pages of `lease` (which `conn` must hold) whose key is in
        `keys`: their reader found them corrupt. Each slot is freed at its last unpin.
        Returns how many pages were dropped (a key the lease does not hold is ignored)."""
        held = self._leases.get(lease)
        if held is None or held.conn != conn:
            raise PoolRequestError(f"unknown lease {lease}")
        wanted = set(keys)
        dropped = 0
        for page in held.pages:
            if page.key in wanted and self._pages.get(page.key) is page:
                del self._pages[page.key]
                page.state = _INVALID
                page.page_class.committed -= 1
                page.page_class.invalid += 1
                dropped += 1
        self._counters["invalidated_keys"] += dropped
        return dropped

    # -- claims -----------------------------------------------------------------------

    def claim(self, conn: int, keys: Sequence[bytes]) -> int:
        """Claim for `conn` the keys that no page holds and no other connection claims
        (its own claims are renewed). Returns how many keys `conn` claims among them."""
        now = self._clock()
        mine = self._conn_claims.setdefault(conn, set())
        claimed = 0
        for key in keys:
            if key in self._pages:
                continue
            holder = self._claims.get(key)
            if holder is not None and holder[0] != conn:
                continue
            if holder is None:
                if len(mine) >= MAX_CLAIMS_PER_CONN:
                    break
                mine.add(key)
                self._counters["claimed_keys"] += 1
            self._claims[key] = (conn, now)
            claimed += 1
        if not mine:
            del self._conn_claims[conn]
        if claimed:
            self._last_progress[conn] = now
        return claimed

    def unclaim(self, conn: int, keys: Sequence[bytes]) -> int:
        """Drop the claims of `conn` among `keys` (others are ignored); returns how many."""
        mine = self._conn_claims.get(conn)
        if not mine:
            return 0
        dropped = 0
        for key in keys:
            if key in mine:
                mine.discard(key)
                del self._claims[key]
                dropped += 1
        if not mine:
            del self._conn_claims[conn]
        return dropped

    def in_progress(
        self,
        conn: int,
        keys: Sequence[bytes],
        states: Sequence[tuple[int, bytes]] | None = None,
    ) -> tuple[int, float]:
        """After the leading COMMITTED run of `keys`: how many keys in a row another
        connection is producing (claimed, or reserved and not committed), and the seconds
        since the producer of the first of them last claimed, reserved or committed.
        (0, 0.0) when the first key after the run is not in progress elsewhere.

        With `states` (as in `lookup`) the run is the resumable one `lookup` answers (cut
        at a committed state), and the count ends after the last chunk i whose keys up to
        i and whose state key are each committed or produced elsewhere."""
        if states is not None:
            return self._resumable_in_progress(conn, keys, states)
        pages = self._pages
        start = 0
        while start < len(keys):
            page = pages.get(keys[start])
            if page is None or page.state is not _COMMITTED:
                break
            start += 1
        count = 0
        producer: int | None = None
        for key in keys[start:]:
            owner = self._producer(key)
            if owner is None or owner == conn:
                break
            if producer is None:
                producer = owner
            count += 1
        if producer is None:
            return 0, 0.0
        self._counters["in_progress_answers"] += 1
        idle = self._clock() - self._last_progress.get(producer, float("-inf"))
        return count, max(0.0, idle)

    def _resumable_in_progress(
        self, conn: int, keys: Sequence[bytes], states: Sequence[tuple[int, bytes]]
    ) -> tuple[int, float]:
        committed = self._cut_at_state(
            [self._pages[k] for k in keys[: self.committed_run(keys)]], states
        )
        start = len(committed) - 1 if committed else 0  # the KV chunks lookup answers
        state_at = dict(states)
        end, producer = start, None
        first: int | None = None  # the producer of the first key in progress past start
        # keys[:start] are committed (available, no producer): the scan starts at start, so
        # a lookup that hits a whole long prompt does not walk it again here.
        for i in range(start, len(keys)):
            available, owner = self._availability(conn, keys[i])
            if not available:
                break
            if first is None:
                first = owner
            state = state_at.get(i)
            if state is None:
                continue
            available, owner = self._availability(conn, state)
            if available:
                end, producer = i + 1, first if first is not None else owner
        if end == start or producer is None:
            return 0, 0.0
        self._counters["in_progress_answers"] += 1
        idle = self._clock() - self._last_progress.get(producer, float("-inf"))
        return end - start, max(0.0, idle)

    def _availability(self, conn: int, key: bytes) -> tuple[bool, int | None]:
        """(committed or produced by a connection other than `conn`, that producer)."""
        page = self._pages.get(key)
        if page is not None and page.state is _COMMITTED:
            return True, None
        owner = self._producer(key)
        return owner is not None and owner != conn, owner

    def _producer(self, key: bytes) -> int | None:
        """The connection producing `key` now: its reserver, else its claimer."""
        page = self._pages.get(key)
        if page is not None:
            return page.owner if page.state is _RESERVED else None
        claim = self._claims.get(key)
        return claim[0] if claim is not None else None

    # -- stores ---------------------------------------------------------------------

    def reserve(
        self,
        conn: int,
        keys: Sequence[bytes],
        payload_bytes: int,
        extends: Sequence[bytes] = (),
    ) -> tuple[list[tuple[bytes, int]], list[bytes], int]:
        """Reserve a slot for each key not yet in the pool, in order.

        Duplicate keys count once. Returns (reserved [(key, offset)], present keys,
        dropped count); len(reserved) + len(present) + dropped == number of distinct keys.

        `extends` are the keys of the chain before `keys`, head first, when a store
        continues a prefix stored in earlier steps (a chunked prefill stores each step's
        chunks). Their committed pages are treated like present ones: never evicted by this
        reserve, and most recent after it, head last. Without that, each step's commit is
        more recent than the last and a prefix longer than the pool evicts its own head,
        which leaves nothing restorable; with it, a full pool keeps the head and drops the
        tail.
        """
        slot_bytes = slot_bytes_for(payload_bytes)
        if slot_bytes > self.geometry.slab_bytes:
            raise PoolRequestError(
                f"a page of {payload_bytes} payload bytes needs a {slot_bytes}-byte slot, "
                f"larger than a slab ({self.geometry.slab_bytes} bytes)"
            )
        # A reserved page is in progress itself; a present or dropped key is not anyone's.
        if conn in self._conn_claims:
            self.unclaim(conn, keys)
        present, missing = self._split_present(keys)
        asked = set(keys)
        prefix = [self._pages.get(key) for key in dict.fromkeys(extends) if key not in asked]
        page_class = self._classes.get(slot_bytes)
        if page_class is None:
            page_class = self._classes[slot_bytes] = _PageClass(
                slot_bytes, self.geometry.slab_bytes
            )
        # The present pages are pinned while this reserve evicts, so it never evicts
        # the prefix it extends; unpinning them afterwards also marks them recent.
        held = [p for p in (*prefix, *present) if p is not None and p.state is _COMMITTED]
        for page in held:
            self._pin(page)
        pending = self._conn_reservations.setdefault(conn, {})
        reserved: list[tuple[bytes, int]] = []
        allowed = self._quota_left(conn)
        fit = len(missing) if allowed is None else min(len(missing), allowed // slot_bytes)
        self._counters["quota_dropped_keys"] += len(missing) - fit
        for key in missing[:fit]:
            slot = self._allocate(page_class)
            if slot is None:
                break
            slab, offset = slot
            page = _Page(key, slab, offset, payload_bytes, conn)
            self._pages[key] = page
            pending[key] = page
            page_class.reserved += 1
            reserved.append((key, offset))
        self._unpin_all(held)
        self._add_conn_bytes(conn, len(reserved) * slot_bytes)
        if reserved:
            self._last_progress[conn] = self._clock()
        dropped = len(missing) - len(reserved)
        self._counters["reserved_keys"] += len(reserved)
        self._counters["dropped_keys"] += dropped
        return reserved, [page.key for page in present], dropped

    def commit(
        self,
        conn: int,
        keys: Sequence[bytes],
        checksums: Sequence[bytes],
        offsets: Sequence[int] | None = None,
    ) -> None:
        """Make pages that `conn` reserved visible, all or none.

        With `offsets`, each key's reserved slot must be at that offset: a writer whose
        reservation was lost and re-made elsewhere cannot commit a slot it did not write.
        """
        if len(checksums) != len(keys) or (offsets is not None and len(offsets) != len(keys)):
            raise PoolRequestError("commit needs one checksum (and offset, if given) per key")
        pending = self._conn_reservations.get(conn, {})
        pages: list[_Page] = []
        seen: set[bytes] = set()
        for i, key in enumerate(keys):
            page = pending.get(key)
            if page is None or key in seen:
                raise PoolRequestError(f"key {_hex(key)} is not reserved by this connection")
            if offsets is not None and offsets[i] != page.offset:
                raise PoolRequestError(
                    f"key {_hex(key)} is reserved at offset {page.offset}, not {offsets[i]}"
                )
            checksum = checksums[i]
            if not isinstance(checksum, bytes) or len(checksum) > MAX_CHECKSUM_BYTES:
                raise PoolRequestError(f"checksum must be bytes of at most {MAX_CHECKSUM_BYTES}")
            seen.add(key)
            pages.append(page)
        claims = self._claims
        for page, checksum in zip(reversed(pages), reversed(checksums), strict=True):
            if claims:
                self._drop_claim(page.key)
            del pending[page.key]
            page.state = _COMMITTED
            page.owner = None
            page.checksum = checksum
            page.page_class.reserved -= 1
            page.page_class.committed += 1
            page.page_class.lru[page.key] = page
        self._add_conn_bytes(conn, -_slot_bytes_of(pages))
        self._counters["committed_keys"] += len(pages)
        if pages:
            self._last_progress[conn] = self._clock()

    def _drop_claim(self, key: bytes) -> None:
        holder = self._claims.pop(key, None)
        if holder is not None:
            mine = self._conn_claims[holder[0]]
            mine.discard(key)
            if not mine:
                del self._conn_claims[holder[0]]

    def abort(self, conn: int, keys: Sequence[bytes]) -> int:
        """Free the reservations (and drop the claims) of `conn` among `keys`; others are
        ignored. Returns how many reservations were freed."""
        self.unclaim(conn, keys)
        pending = self._conn_reservations.get(conn)
        if not pending:
            return 0
        aborted = 0
        for key in keys:
            page = pending.pop(key, None)
            if page is not None:
                self._add_conn_bytes(conn, -page.page_class.slot_bytes)
                self._free_reserved(page)
                aborted += 1
        self._counters["aborted_keys"] += aborted
        return aborted

    def disconnect(self, conn: int) -> None:
        """Drop every lease of `conn` (unpin), abort every reservation and drop every
        claim of `conn`: whoever waits for what it was producing stops waiting at once."""
        for key in self._conn_claims.pop(conn, ()):
            del self._claims[key]
        self._last_progress.pop(conn, None)
        for lease in sorted(self._conn_leases.pop(conn, ())):
            self._unpin_all(self._leases.pop(lease).pages)
        pending = self._conn_reservations.pop(conn, {})
        for page in pending.values():
            self._free_reserved(page)
        self._conn_bytes.pop(conn, None)
        self._counters["aborted_keys"] += len(pending)

    def clear(self) -> int:
        """Free every COMMITTED page with no pins; returns how many were freed."""
        cleared = 0
        for page_class in self._classes.values():
            while page_class.lru:
                self._free_committed(page_class.lru.popitem(last=False)[1])
                cleared += 1
        self._counters["cleared_keys"] += cleared
        return cleared

    # -- introspection ----------------------------------------------------------------

    def held_bytes(self, conn: int) -> int:
        """Slot bytes `conn` holds now: its reservations plus its leases' pages."""
        return self._conn_bytes.get(conn, 0)

    def pages(self) -> Iterator[PageEntry]:
        """The pages in the index (INVALID pages have left it)."""
        for page in self._pages.values():
            yield PageEntry(
                page.key,
                page.offset,
                page.page_class.slot_bytes,
                page.payload_bytes,
                page.state,
                page.pins,
                page.owner,
            )

    def stats(self) -> dict:
        """Counters and occupancy; per class, free + reserved + committed + invalid == pages."""
        classes = []
        for slot_bytes, page_class in sorted(self._classes.items()):
            total = len(page_class.slabs) * page_class.slots_per_slab
            live = page_class.reserved + page_class.committed + page_class.invalid
            classes.append(
                {
                    "slot_bytes": slot_bytes,
                    "slots_per_slab": page_class.slots_per_slab,
                    "slabs": len(page_class.slabs),
                    "pages": total,
                    "free": total - live,
                    "reserved": page_class.reserved,
                    "committed": page_class.committed,
                    "invalid": page_class.invalid,
                    "pinned": page_class.pinned,
                }
            )
        return {
            "arena_bytes": self.geometry.size_bytes,
            "slab_bytes": self.geometry.slab_bytes,
            "slab_count": self.geometry.slab_count,
            "free_slabs": len(self._free_slabs),
            "unused_bytes": self.geometry.unused_bytes,
            "classes": classes,
            "pages": sum(c["pages"] for c in classes),
            "free": sum(c["free"] for c in classes),
            "reserved": sum(c["reserved"] for c in classes),
            "committed": sum(c["committed"] for c in classes),
            "invalid": sum(c["invalid"] for c in classes),
            "pinned": sum(c["pinned"] for c in classes),
            "leases": len(self._leases),
            "claims": len(self._claims),
            "max_client_bytes": self.max_client_bytes,
            **self._counters,
        }

    # -- internals ----------------------------------------------------------------------

    def _quota_left(self, conn: int) -> int | None:
        """Bytes `conn` may still take; None without a quota."""
        if self.max_client_bytes is None:
            return None
        return max(0, self.max_client_bytes - self._conn_bytes.get(conn, 0))

    def _add_conn_bytes(self, conn: int, delta: int) -> None:
        total = self._conn_bytes.get(conn, 0) + delta
        if total:
            self._conn_bytes[conn] = total
        else:
            self._conn_bytes.pop(conn, None)

    def _split_present(self, keys: Sequence[bytes]) -> tuple[list[_Page], list[bytes]]:
        """Split distinct keys into pages already in the pool and keys that are not."""
        seen: set[bytes] = set()
        present: list[_Page] = []
        missing: list[bytes] = []
        for key in keys:
            if key in seen:
                continue
            seen.add(key)
            page = self._pages.get(key)
            if page is None:
                missing.append(key)
            else:
                present.append(page)
        return present, missing

    def _allocate(self, page_class: _PageClass) -> tuple[_Slab, int] | None:
        """Take a free slot of `page_class`, evicting if needed; None when the class is
        full of pinned or reserved pages and no slab is free."""
        while True:
            stack = page_class.with_room
            while stack:
                slab = stack[-1]
                if not slab.retired and slab.live < slab.capacity:
                    return slab, slab.take()
                stack.pop()
                slab.listed = False
            if self._free_slabs:
                index = self._free_slabs.pop()
                slab = _Slab(index, self.geometry.slab_offset(index), page_class)
                page_class.slabs[index] = slab
                slab.listed = True
                stack.append(slab)
                continue
            # Evict this class's least recently used page: that frees a slot (or, if it
            # was its slab's last page, a slab). With nothing evictable here, evict from
            # the class with the most evictable pages until one of its slabs is empty,
            # so that a page size new to a full pool is not starved by another's.
            victim = page_class if page_class.lru else self._largest_evictable_class()
            if victim is None:
                return None
            self._free_committed(victim.lru.popitem(last=False)[1])
            self._counters["evictions"] += 1

    def _largest_evictable_class(self) -> _PageClass | None:
        classes = [c for c in self._classes.values() if c.lru]
        return max(classes, key=lambda c: (len(c.lru), c.slot_bytes)) if classes else None

    def _pin(self, page: _Page) -> None:
        if page.pins == 0:
            del page.page_class.lru[page.key]
            page.page_class.pinned += 1
        page.pins += 1

    def _unpin_all(self, pages: list[_Page]) -> None:
        # Last to first: the run's first page ends most recently used.
        for page in reversed(pages):
            page.pins -= 1
            if page.pins == 0:
                page.page_class.pinned -= 1
                if page.state is _INVALID:
                    page.page_class.invalid -= 1
                    self._free_slot(page)
                else:
                    page.page_class.lru[page.key] = page

    def _free_reserved(self, page: _Page) -> None:
        page.page_class.reserved -= 1
        del self._pages[page.key]
        self._free_slot(page)

    def _free_committed(self, page: _Page) -> None:
        """Free a COMMITTED page already removed from its class's LRU."""
        page.page_class.committed -= 1
        del self._pages[page.key]
        self._free_slot(page)

    def _free_slot(self, page: _Page) -> None:
        """Give back the slot of a page already out of the index."""
        slab = page.slab
        slab.give(page.offset)
        if slab.live == 0:
            slab.retired = True
            del page.page_class.slabs[slab.index]
            self._free_slabs.append(slab.index)
        elif not slab.listed:
            slab.listed = True
            page.page_class.with_room.append(slab)


def _slot_bytes_of(pages: list[_Page]) -> int:
    return sum(page.page_class.slot_bytes for page in pages)


def _hex(key: bytes) -> str:
    return key.hex() if isinstance(key, bytes) else repr(key)
