"""The GPU prefix cache's event log: a reader that applies what it is told ends with the
cache's own set of hashes, whatever happened in between (stores, evictions, resets, a
log that overflowed)."""

from __future__ import annotations

import random

from kvshare.engine.block_manager import BlockManager, block_hashes
from kvshare.engine.cache_events import CacheEventLog


class Reader:
    """What the router does with the answers."""

    def __init__(self) -> None:
        self.generation = -1
        self.after = 0
        self.hashes: set[bytes] = set()
        self.snapshots = 0

    def read(self, blocks: BlockManager) -> None:
        events = blocks.events.since(self.generation, self.after, lambda: blocks.hash_to_block)
        if events.snapshot:
            self.hashes.clear()
            self.snapshots += 1
        self.hashes -= set(events.removed)
        self.hashes |= set(events.stored)
        self.generation, self.after = events.generation, events.last


def fill(blocks: BlockManager, seed: int, num_blocks: int) -> None:
    ids = [seed * 1000 + i for i in range(num_blocks * blocks.block_size)]
    table = blocks.allocate(num_blocks)
    blocks.register(table, block_hashes(ids, blocks.block_size))
    blocks.release(table)


def test_a_reader_follows_stores_evictions_and_resets() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4)
    reader = Reader()
    reader.read(blocks)  # first read: a snapshot of nothing
    rng = random.Random(0)
    for step in range(200):
        action = rng.random()
        if action < 0.05:
            blocks.reset_prefix_cache()
        else:
            fill(blocks, rng.randrange(6), rng.randrange(1, 5))  # reuses evict older hashes
        if rng.random() < 0.3:
            reader.read(blocks)
            assert reader.hashes == set(blocks.hash_to_block), step
    assert reader.snapshots > 1  # resets were seen as such


def test_a_reader_that_fell_behind_gets_a_snapshot() -> None:
    blocks = BlockManager(num_blocks=2, block_size=4)  # keeps 8 events
    reader = Reader()
    reader.read(blocks)
    for seed in range(10):  # 10 stores, 8 evictions: more than the log keeps
        fill(blocks, seed, 1)
    reader.read(blocks)
    assert reader.snapshots == 2
    assert reader.hashes == set(blocks.hash_to_block)


def test_an_answer_nets_out_a_hash_stored_then_evicted() -> None:
    log = CacheEventLog(16)
    log.stored_many([b"a", b"b"])
    log.removed(b"a")
    events = log.since(0, 0, lambda: ())
    assert (events.snapshot, events.stored, events.removed, events.last) == (
        False,
        (b"b",),
        (b"a",),
        3,
    )
    assert log.since(0, 3, lambda: ()).stored == ()
