"""What a replica reports as its pool's capacity for KV pages (the router's bound on what
the pool still holds): the slots its slabs of the smallest page size have, plus what its
free slabs would have. Slabs carved for a hybrid model's larger state pages hold no KV
page until a clear gives them back."""

from __future__ import annotations

from kvshare.kvpool.arena import ArenaGeometry
from kvshare.kvpool.index import PoolIndex
from kvshare.kvpool.page import slot_bytes_for
from kvshare.serve.server import pool_capacity_pages

SLAB = 1 << 20
KV_PAYLOAD = 100_000  # ~10 slots a slab
STATE_PAYLOAD = 400_000  # ~2 slots a slab


def store(index: PoolIndex, prefix: str, count: int, payload: int) -> None:
    keys = [f"{prefix}{i}".encode().ljust(16, b".") for i in range(count)]
    reserved, _, _ = index.reserve(1, keys, payload)
    index.commit(1, [k for k, _ in reserved], [bytes(16)] * len(reserved))


def test_slabs_holding_state_pages_are_not_kv_capacity() -> None:
    index = PoolIndex(ArenaGeometry(8 * SLAB, SLAB))
    assert pool_capacity_pages(index.stats()) is None  # nothing stored: no page size yet
    per_slab = SLAB // slot_bytes_for(KV_PAYLOAD)
    store(index, "kv", 3, KV_PAYLOAD)
    assert pool_capacity_pages(index.stats()) == 8 * per_slab  # one KV slab, 7 free
    store(index, "state", 5, STATE_PAYLOAD)  # 3 slabs of state pages
    assert pool_capacity_pages(index.stats()) == 5 * per_slab
    index.clear()  # every slab free again
    assert pool_capacity_pages(index.stats()) == 8 * per_slab
