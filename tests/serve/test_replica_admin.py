"""/admin/all/<call> on `vllm serve` replicas (fakes, no vLLM): the pool calls go to the
pool daemon the replicas share, the prefix-cache reset to vLLM's /reset_prefix_cache."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
from aiohttp import web

from kvshare.kvpool.client import PoolClient
from kvshare.serve.replica_admin import pool_switch, pool_switch_calls
from kvshare.serve.router import RouterConfig, build_router_app
from kvshare.serve.routing_keys import RoutingKeys
from tests.kvpool.pool_fixture import PoolFactory
from tests.serve.inprocess import BackgroundServer

PAYLOAD = 8192


@dataclass
class FakeVLLM:
    """What `vllm serve` offers the router: /health and, in dev mode, /reset_prefix_cache,
    which refuses (success false) while blocks are held: here its first `held` times."""

    dev_mode: bool = True
    held: int = 1
    resets: list[bool] = field(default_factory=list)

    def app(self) -> web.Application:
        async def health(request: web.Request) -> web.Response:
            return web.Response()

        async def reset(request: web.Request) -> web.Response:
            success = len(self.resets) >= self.held
            self.resets.append(success)
            return web.json_response({"success": success})

        app = web.Application()
        app.router.add_get("/health", health)
        if self.dev_mode:
            app.router.add_post("/reset_prefix_cache", reset)
        return app


@contextlib.contextmanager
def vllm_cluster(fakes: list[FakeVLLM], kv_pool: str | None) -> Iterator[httpx.Client]:
    servers = [BackgroundServer(fake.app()) for fake in fakes]
    config = RouterConfig(
        tuple(s.url for s in servers), "round-robin", engine="vllm", kv_pool=kv_pool
    )
    router = BackgroundServer(build_router_app(config, RoutingKeys(None, 16)))
    try:
        with httpx.Client(base_url=router.url, timeout=30) as client:
            yield client
    finally:
        for server in (router, *servers):
            server.close()


def test_vllm_replicas_switch_clear_and_read_the_shared_pool_and_reset_through_vllm() -> None:
    pools = PoolFactory()
    try:
        address = pools.start(pools.config()).address
        pool = PoolClient(address)
        fakes = [FakeVLLM(), FakeVLLM()]
        with vllm_cluster(fakes, address) as client:
            assert client.post("/admin/all/kv_pool", json={"enabled": False}).status_code == 200
            assert pool.stats()["enabled"] is False
            assert client.post("/admin/all/kv_pool", json={"enabled": True}).status_code == 200
            assert pool.stats()["enabled"] is True

            stored = [bytes([1]) * 16]
            pages = pool.reserve(stored, PAYLOAD).pages
            pool.commit(stored, [b"c"], [p.offset for p in pages])
            stats = client.get("/admin/all/stats").json()["replicas"]
            assert [s["body"]["pool"]["committed"] for s in stats] == [1, 1]
            assert all(s["body"]["kv_pool"] is None for s in stats)
            # The switch a bench reads before it runs is the shared daemon's.
            assert [pool_switch(s["body"]) for s in stats] == [True, True]
            client.post("/admin/all/kv_pool", json={"enabled": False})
            stats = client.get("/admin/all/stats").json()["replicas"]
            assert [pool_switch(s["body"]) for s in stats] == [False, False]
            client.post("/admin/all/kv_pool", json={"enabled": True})
            cleared = client.post("/admin/all/clear_pool").json()["replicas"]
            assert sum(c["body"]["cleared"] for c in cleared) == 1
            assert pool.lookup(stored).pages == ()

            # The first reset finds blocks held and is asked again.
            reset = client.post("/admin/all/reset_prefix_cache")
            assert reset.status_code == 200
            assert [fake.resets for fake in fakes] == [[False, True], [False, True]]

            bad = client.post("/admin/all/kv_pool", json={"enabled": "yes"})
            assert bad.status_code == 502 and bad.json()["replicas"][0]["status"] == 400
            # vLLM replicas keep no cache event log: the call is not offered.
            assert client.get("/admin/all/cache_events").status_code == 404
        pool.close()
    finally:
        pools.close()


def test_a_vllm_replica_is_healthy_and_without_dev_mode_or_pool_gets_a_clear_answer() -> None:
    with vllm_cluster([FakeVLLM(dev_mode=False)], None) as client:
        # vLLM's /health answers 200 with an empty body.
        assert [r["healthy"] for r in client.get("/admin/replicas").json()] == [True]
        reset = client.post("/admin/all/reset_prefix_cache")
        assert reset.status_code == 502
        assert "VLLM_SERVER_DEV_MODE=1" in reset.json()["replicas"][0]["body"]["error"]
        switch = client.post("/admin/all/kv_pool", json={"enabled": False})
        assert "without a pool" in switch.json()["replicas"][0]["body"]["error"]


def test_pool_switches_are_read_from_either_engine_and_set_back_with_the_fewest_calls() -> None:
    kvshare_on = {"engine": {"kv_pool_enabled": True}, "pool": {"enabled": False}}
    assert pool_switch(kvshare_on) is True  # the replica's own switch, not the daemon's
    assert pool_switch({"kv_pool": None, "pool": {"enabled": False}}) is False  # vLLM
    assert pool_switch({"engine": {"running": 0}, "pool": None}) is None
    assert pool_switch_calls([True, True]) == [(None, True)]
    assert pool_switch_calls([False, False, False]) == [(None, False)]
    assert pool_switch_calls([False, True]) == [(0, False), (1, True)]
    assert pool_switch_calls([True, None]) == [(0, True)]  # unknown: left as it is
    assert pool_switch_calls([None, None]) == pool_switch_calls([]) == []
