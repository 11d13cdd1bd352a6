"""The daemon's pool switch: disabled, every client misses and stores nothing."""

from __future__ import annotations

import pytest

from kvshare.kvpool.client import PoolClient, PoolError
from tests.kvpool.pool_fixture import PoolFactory

PAYLOAD = 8192


def test_a_disabled_pool_misses_and_stores_nothing_for_every_client() -> None:
    pools = PoolFactory()
    try:
        address = pools.start().address
        writer, reader = PoolClient(address), PoolClient(address)
        stored = [bytes([1]) * 16]
        pages = writer.reserve(stored, PAYLOAD).pages
        writer.commit(stored, [b"c"], [p.offset for p in pages])
        hit = reader.lookup(stored)
        assert len(hit.pages) == 1
        reader.release(hit.lease)

        writer.set_enabled(False)
        assert reader.stats()["enabled"] is False
        assert reader.lookup(stored).pages == ()
        skipped = reader.reserve([bytes([2]) * 16], PAYLOAD)
        assert (skipped.pages, skipped.dropped) == ((), 0)
        with pytest.raises(PoolError, match="enabled"):
            reader._request({"op": "set_enabled", "enabled": 1})

        reader.set_enabled(True)
        assert len(writer.lookup(stored).pages) == 1
        writer.close()
        reader.close()
    finally:
        pools.close()
