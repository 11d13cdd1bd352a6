"""The cache-aware router against real replicas (tiny random model, in-process): its view
of each replica's GPU cache follows what the replica reports, so a reset or an eviction
the router never saw stops being credited."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from kvshare import LLM
from kvshare.engine.block_manager import block_hashes
from kvshare.engine.llm_engine import LLMEngine
from kvshare.serve.policies import CacheAware, RouteRequest
from kvshare.serve.router import Router
from kvshare.serve.server import SERVER_KEY, ServeConfig, build_app
from tests.serve.inprocess import BackgroundServer
from tests.serve.test_router import routed, router_loop

PROMPT_TOKENS = 320  # 20 full blocks


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[tuple[BackgroundServer, LLMEngine]]]:
    servers = []
    for _ in range(2):
        llm = LLM("shape:tiny-llama", kv_cache_memory=4 << 20, max_num_batched_tokens=512)
        app = build_app(llm.engine, ServeConfig("tiny"))
        servers.append((BackgroundServer(app), app[SERVER_KEY].engine))
    yield servers
    for server, _ in servers:
        server.close()


def ids(seed: int) -> list[int]:
    return [(seed * 7919 + i) % 250 + 3 for i in range(PROMPT_TOKENS)]


def route(seed: int) -> RouteRequest:
    return RouteRequest(prefix=tuple(block_hashes(ids(seed), 16)), block_tokens=16)


def ask(client: httpx.Client, seed: int) -> int:
    """Send prompt `seed` through the router; the replica that served it."""
    resp = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": ids(seed), "max_tokens": 2}
    )
    assert resp.status_code == 200, resp.text
    return int(resp.headers["x-kvshare-replica"])


def check_all(router: Router) -> None:
    """One health round (which reads the replicas' cache events), on the router's loop."""
    asyncio.run_coroutine_threadsafe(router._check_all(), router_loop(router)).result(30)


def test_the_router_learns_a_reset_sent_straight_to_a_replica(
    replicas: list[tuple[BackgroundServer, LLMEngine]],
) -> None:
    urls = [server.url for server, _ in replicas]
    with routed(urls, policy="cache-aware", health_interval=600.0) as (client, router):
        policy = router.policy
        assert isinstance(policy, CacheAware)
        served = ask(client, seed=1)
        check_all(router)
        assert policy.gpu_tokens(route(1), served) == PROMPT_TOKENS
        # Reset behind the router's back: not through its /admin/all fan-out.
        httpx.post(urls[served] + "/admin/reset_prefix_cache").raise_for_status()
        check_all(router)
        assert policy.gpu_tokens(route(1), served) == 0


def test_the_router_learns_an_eviction(
    replicas: list[tuple[BackgroundServer, LLMEngine]],
) -> None:
    urls = [server.url for server, _ in replicas]
    with routed(urls, policy="cache-aware", health_interval=600.0) as (client, router):
        policy = router.policy
        assert isinstance(policy, CacheAware)
        served = ask(client, seed=2)
        engine = replicas[served][1]
        first = route(2).prefix
        # Other prompts, pinned to the same replica, until its cache has reused the blocks.
        seed = 100
        while engine.blocks.match_prefix(first):
            resp = client.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": ids(seed), "max_tokens": 2},
                headers={"x-kvshare-replica": str(served)},
            )
            assert resp.status_code == 200, resp.text
            seed += 1
            assert seed < 200, "the replica's cache never evicted the first prompt"
        check_all(router)
        assert policy.gpu_tokens(route(2), served) < PROMPT_TOKENS
