"""The cache-aware router against real replicas (tiny random model, in-process): its view
of each replica's GPU cache follows what the replica reports, so a reset or an eviction
the router never saw stops being credited; a block start through the router (pool clear,
cache reset) is in its view before the call returns, so nothing learned afterwards is wiped
by a later health check."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from kvshare import LLM
from kvshare.engine.block_manager import block_hashes
from kvshare.engine.llm_engine import LLMEngine
from kvshare.serve.policies import DEFAULT_POOL_CREDIT, CacheAware, Load, RouteRequest
from kvshare.serve.router import Router
from kvshare.serve.server import SERVER_KEY, ServeConfig, build_app
from tests.kvpool.pool_fixture import MIB, PoolFactory
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


@pytest.fixture(scope="module")
def pooled_replicas() -> Iterator[list[str]]:
    """Two replicas on one pool of 28 pages (4 slabs of 1 MiB, 7 tiny-llama pages each)."""
    factory = PoolFactory()
    servers = []
    try:
        pool = factory.start(factory.config(size_bytes=4 * MIB, slab_bytes=MIB))
        for _ in range(2):
            llm = LLM(
                "shape:tiny-llama",
                kv_cache_memory=4 << 20,
                max_num_batched_tokens=512,
                kv_pool=pool.address,
                require_kv_pool=True,
            )
            servers.append(BackgroundServer(build_app(llm.engine, ServeConfig("tiny"))))
        yield [server.url for server in servers]
    finally:
        for server in servers:
            server.close()
        factory.close()


def ids(seed: int) -> list[int]:
    return [(seed * 7919 + i) % 250 + 3 for i in range(PROMPT_TOKENS)]


def route(seed: int) -> RouteRequest:
    return RouteRequest(prefix=tuple(block_hashes(ids(seed), 16)), block_tokens=16)


def ask(client: httpx.Client, router: Router, seed: int) -> int:
    """Send prompt `seed` through the router; the replica that served it. Returns once the
    router is done with the request: it records a prompt's prefix after the answer's first
    bytes are on their way, so the client can hold the whole answer before the policy knows
    the prompt (a test that then read the policy failed about one run in six)."""
    resp = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": ids(seed), "max_tokens": 2}
    )
    assert resp.status_code == 200, resp.text
    deadline = time.monotonic() + 5
    while any(replica.in_flight for replica in router.replicas):
        assert time.monotonic() < deadline, "the router never finished the request"
        time.sleep(0.005)
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
        served = ask(client, router, seed=1)
        check_all(router)
        assert policy.gpu_tokens(route(1), served) == PROMPT_TOKENS
        # Reset behind the router's back: not through its /admin/all fan-out.
        httpx.post(urls[served] + "/admin/reset_prefix_cache").raise_for_status()
        check_all(router)
        assert policy.gpu_tokens(route(1), served) == 0


def test_the_router_learns_each_replicas_step_and_short_work_limit(
    replicas: list[tuple[BackgroundServer, LLMEngine]],
) -> None:
    """Replicas of 512-token steps: a request with at most 32 tokens past its cached prefix
    joins the next step, so it waits for at most 512 of the 640 tokens queued there."""
    urls = [server.url for server, _ in replicas]
    events = httpx.get(urls[0] + "/admin/cache_events").json()
    assert (events["step_tokens"], events["short_work_tokens"]) == (512, 32)
    with routed(urls, policy="cache-aware", health_interval=600.0) as (client, router):
        policy = router.policy
        assert isinstance(policy, CacheAware)
        served = ask(client, router, seed=30)
        others = [route(31), route(32)]  # sent to `served`, not answered yet: 640 tokens
        for request in others:
            policy.started(request, served)
        check_all(router)
        assert policy.queued_tokens(route(30), served) == 512
        assert policy.queued_tokens(route(33), served) == 640  # 320 to compute: long work
        for request in others:
            policy.ended(request, served)
        assert policy.queued_tokens(route(33), served) == 0


def test_the_router_learns_an_eviction(
    replicas: list[tuple[BackgroundServer, LLMEngine]],
) -> None:
    urls = [server.url for server, _ in replicas]
    with routed(urls, policy="cache-aware", health_interval=600.0) as (client, router):
        policy = router.policy
        assert isinstance(policy, CacheAware)
        served = ask(client, router, seed=2)
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


POOLED_TOKENS = PROMPT_TOKENS // 256 * 256  # the pool restores whole 256-token chunks


def block_start(client: httpx.Client) -> None:
    """What the bench does at each block start, through the router."""
    for call, body in (
        ("kv_pool", {"enabled": True}),
        ("clear_pool", {}),
        ("reset_prefix_cache", {}),
    ):
        client.post(f"/admin/all/{call}", json=body).raise_for_status()


def test_a_block_start_is_not_heard_again_at_the_next_health_check(
    pooled_replicas: list[str],
) -> None:
    with routed(pooled_replicas, policy="cache-aware", health_interval=600.0) as (client, router):
        policy = router.policy
        assert isinstance(policy, CacheAware)
        ask(client, router, seed=10)
        check_all(router)  # the router knows the pool's clear count and each cache generation
        block_start(client)
        served = ask(client, router, seed=11)
        check_all(router)  # the first health check of the block
        # It once saw the clear count changed and the generation new only here, and forgot
        # the pool prefix of every request the block had sent so far.
        assert policy.pool_tokens(route(11)) == POOLED_TOKENS
        assert policy.gpu_tokens(route(11), served) == PROMPT_TOKENS


def test_an_emptied_pool_is_still_credited_up_to_its_capacity(
    pooled_replicas: list[str],
) -> None:
    with routed(pooled_replicas, policy="cache-aware", health_interval=600.0) as (client, router):
        policy = router.policy
        assert isinstance(policy, CacheAware)
        ask(client, router, seed=20)
        pool = httpx.get(pooled_replicas[0] + "/admin/cache_events").json()["pool"]
        assert pool["pages"] == 28  # 4 MiB in slots of 128 KiB and a header
        block_start(client)
        check_all(router)  # the pool is empty: its slabs were given back
        after = httpx.get(pooled_replicas[0] + "/admin/cache_events").json()["pool"]
        assert after["pages"] == pool["pages"]  # the daemon's own count reads 0 here
        ask(client, router, seed=21)
        # The bound is what the arena holds (28 pages of 16 blocks), not the slabs in use
        # (none after the clear), which once made every prompt fall out of the pool view.
        assert policy.pool_tokens(route(21)) == POOLED_TOKENS


def test_a_pool_switched_through_the_router_changes_the_credit_before_the_call_returns(
    pooled_replicas: list[str],
) -> None:
    with routed(pooled_replicas, policy="cache-aware", health_interval=600.0) as (client, router):
        policy = router.policy
        assert isinstance(policy, CacheAware)
        credit = policy.score(route(30), Load(0), POOLED_TOKENS)
        assert credit == pytest.approx(DEFAULT_POOL_CREDIT * POOLED_TOKENS)
        client.post("/admin/all/kv_pool", json={"enabled": False}).raise_for_status()
        try:
            # An OFF block's first requests: a replica off the pool restores nothing.
            assert policy.score(route(30), Load(0), POOLED_TOKENS) == 0.0
        finally:
            client.post("/admin/all/kv_pool", json={"enabled": True}).raise_for_status()
        assert policy.score(route(30), Load(0), POOLED_TOKENS) == credit


def test_a_requests_queued_work_counts_until_its_answer_begins(
    replicas: list[tuple[BackgroundServer, LLMEngine]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The router tells the policy when a replica's answer begins (its prefill is over),
    between the send and the end, so the replica stops counting as busy with its prompt."""
    urls = [server.url for server, _ in replicas]
    with routed(urls, policy="cache-aware", health_interval=600.0) as (client, router):
        policy = router.policy
        assert isinstance(policy, CacheAware)
        calls: list[tuple[str, int]] = []
        for name in ("started", "answered", "ended"):
            method = getattr(policy, name)

            def recorded(request: RouteRequest, replica: int, name=name, method=method) -> None:
                # The queued work the replica holds as each call arrives.
                calls.append((name, policy.queued_tokens(route(99), replica)))
                method(request, replica)

            monkeypatch.setattr(policy, name, recorded)
        ask(client, router, seed=40)
        # The router ends the request after the client has its last byte: wait for it.
        deadline = time.monotonic() + 10.0
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        # Sent: nothing queued yet; answered: the whole prompt still queued; then none.
        assert calls == [("started", 0), ("answered", PROMPT_TOKENS), ("ended", 0)]
