"""The replica server reaches its connector only through the KVConnector interface.

A connector that is not the pool's (a vLLM-side or cross-host store later) gets the same
admin endpoints and idle flush as the pool connector: /admin/stats shows its store's
statistics, /admin/clear_pool clears it (503 when unreachable), an idle engine flushes it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import httpx
import pytest

from kvshare.engine.connector import KVConnector, KVStoreUnavailable, PagedKVCache, PoolMatch
from kvshare.llm import LLM
from kvshare.serve.server import ServeConfig, build_app
from tests.serve.inprocess import BackgroundServer


class RecordingConnector(KVConnector):
    """Restores nothing, stores nothing; records the serving layer's calls."""

    chunk_tokens = 16

    def __init__(self) -> None:
        self.idle_flushes = 0
        self.reachable = True
        self.pages = 7
        self._enabled = True

    def bind(self, cache: PagedKVCache) -> None:
        pass

    def match(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_local_tokens: int,
        *,
        cache_salt: str | None = None,
        snapshot_tokens: Sequence[int] = (),
    ) -> PoolMatch:
        return PoolMatch(0)

    def load(
        self,
        request_id: str,
        block_table: Sequence[int],
        state_slot: int | None = None,
        sliding_table: Sequence[int] = (),
    ) -> bool:
        return False

    def finish_load(self, request_id: str) -> bool:
        return False

    def cancel(self, request_id: str) -> None:
        pass

    def store(
        self,
        request_id: str,
        token_ids: Sequence[int],
        block_table: Sequence[int],
        num_computed_tokens: int,
        *,
        cache_salt: str | None = None,
        sliding_table: Sequence[int] = (),
    ) -> None:
        pass

    def store_state(
        self,
        request_id: str,
        token_ids: Sequence[int],
        boundary: int,
        snapshot_slot: int,
        *,
        cache_salt: str | None = None,
    ) -> None:
        pass

    def poll(self) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass

    def set_enabled(self, enabled: bool) -> None:
        self._enabled = enabled

    @property
    def enabled(self) -> bool:
        return self._enabled

    def stats(self) -> dict[str, int]:
        return {"hit_tokens": 0}

    def wait_idle(self) -> None:
        self.idle_flushes += 1

    def pool_stats(self) -> dict[str, object] | None:
        return {"pages": self.pages} if self.reachable else None

    def clear_pool(self) -> int:
        if not self.reachable:
            raise KVStoreUnavailable("the store is down")
        cleared, self.pages = self.pages, 0
        return cleared


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[httpx.Client, RecordingConnector]]:
    connector = RecordingConnector()
    llm = LLM(
        "shape:tiny-llama", kv_pool=connector, kv_cache_memory=16 << 20, max_num_batched_tokens=256
    )
    server = BackgroundServer(build_app(llm.engine, ServeConfig("tiny")))
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client, connector
    server.close()


def test_stats_and_clear_reach_any_connectors_store(
    served: tuple[httpx.Client, RecordingConnector],
) -> None:
    client, connector = served
    connector.reachable, connector.pages = True, 7
    assert client.get("/admin/stats").json()["pool"] == {"pages": 7}
    assert client.post("/admin/clear_pool").json() == {"cleared": 7}
    assert client.get("/admin/stats").json()["pool"] == {"pages": 0}


def test_an_unreachable_store_is_absent_from_stats_and_a_503_to_clear(
    served: tuple[httpx.Client, RecordingConnector],
) -> None:
    client, connector = served
    connector.reachable = False
    try:
        assert client.get("/admin/stats").json()["pool"] is None
        response = client.post("/admin/clear_pool")
        assert response.status_code == 503 and "the store is down" in response.text
    finally:
        connector.reachable = True


def test_an_idle_engine_flushes_the_connector(
    served: tuple[httpx.Client, RecordingConnector],
) -> None:
    client, connector = served
    before = connector.idle_flushes
    response = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
    )
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 30
    while connector.idle_flushes == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert connector.idle_flushes > before
