"""What the GPU prefix cache gained and lost, for a reader outside the engine (the router).

The block manager reports each block hash it makes findable (stored) and each one it drops
when the block is reused (removed); an admin reset starts a new *generation*. Events are
numbered and the last `capacity` of them are kept. A reader remembers the generation and the
number of the last event it applied, and asks for what came after: it gets the net change
per hash since then, or, when its generation is old or the events it missed were dropped, a
snapshot of every cached hash (it must then forget what it knew). Either way the reader's
set ends equal to the cache's set at the time of the answer.

Not thread-safe: the engine thread is its only user (readers go through that thread).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheEvents:
    generation: int
    last: int  # number of the last event covered; pass it back as `after`
    snapshot: bool  # True: `stored` is the whole cache and the reader starts from nothing
    stored: tuple[bytes, ...]
    removed: tuple[bytes, ...]


class CacheEventLog:
    """Events are kept as two deques, the hashes and whether each was stored, rather than
    one tuple per event: registering a 261,888-token restore logs 16,368 events, and as
    tuples they were as many container allocations, which set off 23 young collections of
    Python's collector inside that request."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.generation = 0
        self.last = 0  # numbers run on across generations; the newest kept event's
        self._hashes: deque[bytes] = deque(maxlen=capacity)
        self._stored: deque[bool] = deque(maxlen=capacity)

    def stored_many(self, block_hashes: Sequence[bytes]) -> None:
        self.last += len(block_hashes)
        self._hashes.extend(block_hashes)
        self._stored.extend(itertools.repeat(True, len(block_hashes)))

    def removed(self, block_hash: bytes) -> None:
        self.last += 1
        self._hashes.append(block_hash)
        self._stored.append(False)

    def reset(self) -> None:
        self.generation += 1
        self._hashes.clear()
        self._stored.clear()

    def since(
        self, generation: int, after: int, cached: Callable[[], Iterable[bytes]]
    ) -> CacheEvents:
        """The change since event `after` of `generation`; `cached` lists every cached hash
        (called only for a snapshot)."""
        first_kept = self.last - len(self._hashes) + 1
        # Events after `after` are all here iff none between `after` and the first kept one
        # was dropped.
        if generation != self.generation or after > self.last or after + 1 < first_kept:
            return CacheEvents(self.generation, self.last, True, tuple(cached()), ())
        new = self.last - after  # the newest events; a poll reads only what came since
        hashes = list(itertools.islice(reversed(self._hashes), new))
        stored = list(itertools.islice(reversed(self._stored), new))
        latest: dict[bytes, bool] = {}
        for block_hash, was_stored in zip(reversed(hashes), reversed(stored)):
            latest.pop(block_hash, None)  # re-insert: the order of the last event
            latest[block_hash] = was_stored
        return CacheEvents(
            self.generation,
            self.last,
            False,
            tuple(h for h, was_stored in latest.items() if was_stored),
            tuple(h for h, was_stored in latest.items() if not was_stored),
        )
