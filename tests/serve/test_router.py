"""The router in-process against fake replicas (no models): retries, pinning, unbuffered
streaming, disconnect propagation, health, admin fan-out."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest
from aiohttp import web

import kvshare
from kvshare.engine.block_manager import block_hashes
from kvshare.ports import free_port
from kvshare.serve.http import ArrayReader
from kvshare.serve.policies import CacheAware, RouteRequest
from kvshare.serve.prompts import TokenIds
from kvshare.serve.router import ROUTER_KEY, Router, RouterConfig, build_router_app
from kvshare.serve.routing_keys import Prefix, RoutingKeys
from tests.serve.inprocess import BackgroundServer, stand_in_replica

STREAM_GAP_S = 0.4


@dataclass
class FakeState:
    name: str
    admin_calls: list[str] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)


def fake_replica(state: FakeState) -> web.Application:
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "instance": state.name})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"served_by": state.name, "prompt": body.get("prompt")})
        if body.get("linger_after_done"):  # [DONE], then the end of the response a while later
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: [DONE]\n\n")
            await asyncio.sleep(body["linger_after_done"])
            return resp
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(body.get("chunks", 3)):
                await resp.write(f"data: {json.dumps({'i': i})}\n\n".encode())
                await asyncio.sleep(STREAM_GAP_S)
        except asyncio.CancelledError:
            state.cancelled.set()
            raise
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def admin(request: web.Request) -> web.Response:
        state.admin_calls.append(f"{request.method} {request.path}")
        return web.json_response({"replica": state.name})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    app.router.add_route("*", "/admin/{tail:.*}", admin)
    return app


@dataclass
class Fakes:
    states: list[FakeState]
    servers: list[BackgroundServer]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]


@pytest.fixture
def fakes() -> Iterator[Fakes]:
    states = [FakeState("a"), FakeState("b")]
    fakes = Fakes(states, [BackgroundServer(fake_replica(s)) for s in states])
    yield fakes
    for server in fakes.servers:
        server.close()


@contextlib.contextmanager
def routed(
    urls: list[str], policy: str = "round-robin", health_interval: float = 0.2, **limits: Any
) -> Iterator[tuple[httpx.Client, Router]]:
    """A router over `urls` and a client of it."""
    config = RouterConfig(
        tuple(urls), policy, health_interval=health_interval, health_timeout=1.0, **limits
    )
    app = build_router_app(config, RoutingKeys(None, 16))
    server = BackgroundServer(app)
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            yield client, app[ROUTER_KEY]
    finally:
        server.close()


def post(
    client: httpx.Client, headers: dict[str, str] | None = None, **body: object
) -> httpx.Response:
    return client.post(
        "/v1/completions", json={"model": "m", "prompt": "hi", **body}, headers=headers
    )


def test_a_dead_replica_leaves_rotation_and_requests_are_retried(fakes: Fakes) -> None:
    # Health checks too rare to notice: only the failed request takes replica 0 out.
    with routed(fakes.urls, health_interval=60.0) as (client, _):
        assert [r["healthy"] for r in client.get("/admin/replicas").json()] == [True, True]
        fakes.servers[0].close()
        answers = [post(client) for _ in range(4)]
        assert [r.status_code for r in answers] == [200] * 4
        assert {r.json()["served_by"] for r in answers} == {"b"}
        assert {r.headers["x-kvshare-replica"] for r in answers} == {"1"}
        assert [r["healthy"] for r in client.get("/admin/replicas").json()] == [False, True]
        pinned = post(client, headers={"x-kvshare-replica": "0"})
        assert pinned.status_code == 502 and "replica 0" in pinned.json()["error"]["message"]
        assert post(client, headers={"x-kvshare-replica": "7"}).status_code == 400
        metrics = client.get("/metrics").text
        assert 'kvshare_router_replica_failures_total{replica="0"} 2.0' in metrics
        assert "kvshare_router_retries_total 1.0" in metrics  # the first request only


def test_a_replica_comes_back_when_healthy(fakes: Fakes) -> None:
    port = free_port()
    with routed([f"http://127.0.0.1:{port}", fakes.urls[1]]) as (client, _):
        assert not client.get("/admin/replicas").json()[0]["healthy"]
        assert {post(client).json()["served_by"] for _ in range(2)} == {"b"}
        revived = BackgroundServer(fake_replica(FakeState("revived")), port=port)
        try:
            deadline = time.monotonic() + 5
            while not client.get("/admin/replicas").json()[0]["healthy"]:
                assert time.monotonic() < deadline, "the health check never readmitted it"
                time.sleep(0.1)
            assert {post(client).json()["served_by"] for _ in range(4)} == {"revived", "b"}
        finally:
            revived.close()


def test_streams_pass_through_chunk_by_chunk(fakes: Fakes) -> None:
    with routed(fakes.urls[:1]) as (client, _):
        start = time.monotonic()
        body = {"model": "m", "prompt": "x", "stream": True, "chunks": 3}
        with client.stream("POST", "/v1/completions", json=body) as resp:
            arrivals = [
                time.monotonic() - start for line in resp.iter_lines() if line.startswith("data:")
            ]
    assert len(arrivals) == 4  # 3 chunks and [DONE]
    # The first chunk arrives before the replica has even produced the second one.
    assert arrivals[0] < STREAM_GAP_S * 0.9 and arrivals[-1] > 2 * STREAM_GAP_S


def test_a_client_that_leaves_cancels_the_replica_request(fakes: Fakes) -> None:
    with routed(fakes.urls[:1]) as (client, router):
        body = {"model": "m", "prompt": "x", "stream": True, "chunks": 50}
        with client.stream("POST", "/v1/completions", json=body) as resp:
            next(resp.iter_lines())
        assert fakes.states[0].cancelled.wait(5), "the replica never saw the disconnect"
        deadline = time.monotonic() + 5
        while router.replicas[0].in_flight:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_admin_all_fans_out_to_every_replica(fakes: Fakes) -> None:
    with routed(fakes.urls, policy="cache-aware") as (client, _):
        reset = client.post("/admin/all/reset_prefix_cache", json={})
        assert reset.status_code == 200
        assert [a["body"] for a in reset.json()["replicas"]] == [{"replica": "a"}, {"replica": "b"}]
        assert client.get("/admin/all/stats").status_code == 200
    # The router's own reads of the replicas' cache events are not the fan-out's.
    calls = [
        [c for c in state.admin_calls if c != "GET /admin/cache_events"] for state in fakes.states
    ]
    assert calls[0] == calls[1] == ["POST /admin/reset_prefix_cache", "GET /admin/stats"]


def test_no_healthy_replica_is_a_503() -> None:
    with routed([f"http://127.0.0.1:{free_port()}"]) as (client, _):
        first = post(client)
        assert first.status_code == 503
        assert first.json()["error"]["type"] == "server_error"
        assert client.get("/health").status_code == 503


class GatedKeys(RoutingKeys):
    """Routing keys that notice whether the replica had the request before hashing ended."""

    def __init__(self, received: threading.Event) -> None:
        super().__init__(None, 16)
        self.received = received
        self.forwarded_first: list[bool] = []

    def prompt_of(self, path: str, body: object) -> tuple[Prefix, TokenIds | None]:
        self.forwarded_first.append(self.received.wait(5))
        return super().prompt_of(path, body)


def test_a_pinned_request_is_forwarded_while_its_prompt_is_hashed() -> None:
    received = threading.Event()

    async def completions(request: web.Request) -> web.Response:
        received.set()
        return web.json_response({"served_by": "a"})

    replica = stand_in_replica(completions)
    keys = GatedKeys(received)
    app = build_router_app(RouterConfig((replica.url,), "cache-aware"), keys)
    router = BackgroundServer(app)
    ids = list(range(64))
    try:
        with httpx.Client(base_url=router.url, timeout=10) as client:
            resp = client.post(
                "/v1/completions",
                json={"model": "m", "prompt": ids},
                headers={"x-kvshare-replica": "0"},
            )
    finally:
        router.close()
        replica.close()
    assert resp.status_code == 200 and keys.forwarded_first == [True]
    assert resp.headers["x-kvshare-routing-tokens"] == "64"
    # The prefix, hashed meanwhile, is recorded as the pinned replica's.
    route = RouteRequest(prefix=tuple(block_hashes(ids, 16)))
    policy = app[ROUTER_KEY].policy
    assert isinstance(policy, CacheAware) and policy.gpu_tokens(route, 0) == 64


class CountingReader(ArrayReader):
    """An ArrayReader that counts the bodies it reads in pieces."""

    def __init__(self) -> None:
        super().__init__(threads=2, piece_bytes=1024)
        self.reads = 0

    def read(self, data: bytes, spans: list[tuple[int, int]]) -> list[np.ndarray | None]:
        self.reads += 1
        return super().read(data, spans)


def test_a_pinned_prompt_is_read_on_one_thread_and_a_routed_one_on_the_readers() -> None:
    """A routed request waits for its prompt's hashes: its token array is read on the
    router's threads. A pinned one is on its way already: its array is read on one thread,
    leaving the cores to the replica's read of the same body (beside a second 4-thread
    read, the replica's took 1.5x as long on a 16-core GPU host), and still hashed."""

    async def completions(request: web.Request) -> web.Response:
        return web.json_response({"served_by": "a"})

    replica = stand_in_replica(completions)
    app = build_router_app(RouterConfig((replica.url,), "cache-aware"), RoutingKeys(None, 16))
    router = app[ROUTER_KEY]
    router.arrays.close()
    router.arrays = reader = CountingReader()
    server = BackgroundServer(app)
    ids = list(range(20_000))  # a body past TOKEN_ARRAY_BYTES, in pieces of 1 KiB and more
    reads = []
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            for headers in ({"x-kvshare-replica": "0"}, {}):
                resp = client.post(
                    "/v1/completions", json={"model": "m", "prompt": ids}, headers=headers
                )
                assert resp.status_code == 200
                assert resp.headers["x-kvshare-routing-tokens"] == str(len(ids))
                reads.append(reader.reads)
    finally:
        server.close()
        replica.close()
    assert reads == [0, 1]


def test_a_pinned_body_reaches_the_replica_while_the_client_still_sends_it() -> None:
    """The replica reads a pinned request's body as the client sends it, byte for byte,
    and the router still records the prefix: the client sends the rest of its body only
    once the replica has the first part (a router that waits for the whole body first
    makes it wait out its 5 s)."""
    ids = list(range(4096))
    raw = json.dumps({"model": "m", "prompt": ids}).encode()
    first_part = threading.Event()
    received: list[bytes] = []

    async def completions(request: web.Request) -> web.Response:
        parts = [await request.content.readany()]
        first_part.set()
        parts.append(await request.content.read())
        received.append(b"".join(parts))
        return web.json_response({"served_by": "a"})

    def client_body() -> Iterator[bytes]:
        yield raw[:1000]
        first_part.wait(5)
        yield raw[1000:]

    replica = stand_in_replica(completions)
    app = build_router_app(RouterConfig((replica.url,), "cache-aware"), RoutingKeys(None, 16))
    router = BackgroundServer(app)
    try:
        with httpx.Client(base_url=router.url, timeout=10) as client:
            started = time.monotonic()
            resp = client.post(
                "/v1/completions",
                content=client_body(),
                headers={
                    "x-kvshare-replica": "0",
                    "Content-Type": "application/json",
                    "Content-Length": str(len(raw)),
                },
            )
            took = time.monotonic() - started
    finally:
        router.close()
        replica.close()
    assert resp.status_code == 200, resp.text
    assert took < 4.0 and received == [raw]
    route = RouteRequest(prefix=tuple(block_hashes(ids, 16)))
    policy = app[ROUTER_KEY].policy
    assert isinstance(policy, CacheAware) and policy.gpu_tokens(route, 0) == 4096


@pytest.mark.parametrize("handler_cancellation", [True, False])
def test_a_client_that_breaks_off_its_body_leaves_the_replica_in_rotation(
    handler_cancellation: bool,
) -> None:
    """The client's failure is not the replica's: its body broke off mid-way, the replica
    saw an incomplete request, and the router keeps it healthy and serving, whether the
    router's handler is cancelled as the client leaves (as `kvshare router` runs) or
    finds the broken body in its send to the replica (as aiohttp runs by default)."""
    seen: list[str] = []

    async def completions(request: web.Request) -> web.Response:
        try:
            await request.read()
        except BaseException as exc:  # the router's side of the body broke off
            seen.append(type(exc).__name__)
            raise
        seen.append("whole")
        return web.json_response({"served_by": "a"})

    replica = stand_in_replica(completions)
    app = build_router_app(RouterConfig((replica.url,), "cache-aware"), RoutingKeys(None, 16))
    router = BackgroundServer(app, handler_cancellation=handler_cancellation)
    host, port = router.url.removeprefix("http://").split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nx-kvshare-replica: 0\r\n"
                b"Content-Length: 100000\r\n\r\n" + b'{"model": "m", "prompt": [1, 2, '
            )
            time.sleep(0.3)  # the replica reads the part that came
            assert not seen
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen and seen != ["whole"], seen
        time.sleep(0.3)  # the router's side of the request unwinds
        router_state = app[ROUTER_KEY]
        assert router_state.replicas[0].healthy
        with httpx.Client(base_url=router.url, timeout=10) as client:
            resp = post(client, headers={"x-kvshare-replica": "0"})
        assert resp.status_code == 200 and seen[-1] == "whole"
        assert router_state.replicas[0].healthy
    finally:
        router.close()
        replica.close()


@pytest.mark.parametrize("client_stays", [True, False])
def test_a_placement_is_recorded_after_the_first_chunk_and_even_if_the_client_left(
    client_stays: bool,
) -> None:
    """Recording a long prefix takes milliseconds: the router relays the first chunk
    before it, and a client gone before that chunk does not lose the record (the replica
    computed the prefix all the same)."""
    first_chunk = threading.Event()

    async def completions(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        while not first_chunk.is_set():
            await asyncio.sleep(0.01)
        with contextlib.suppress(ConnectionResetError):
            await resp.write(b"data: {}\n\n")
            await resp.write(b"data: [DONE]\n\n")
        return resp

    replica = stand_in_replica(completions)
    app = build_router_app(RouterConfig((replica.url,), "cache-aware"), RoutingKeys(None, 16))
    router = BackgroundServer(app)
    ids = list(range(64))
    route = RouteRequest(prefix=tuple(block_hashes(ids, 16)))
    policy = app[ROUTER_KEY].policy
    assert isinstance(policy, CacheAware)

    def recorded() -> int:
        deadline = time.monotonic() + 5
        while policy.gpu_tokens(route, 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        return policy.gpu_tokens(route, 0)

    try:
        with httpx.Client(base_url=router.url, timeout=10) as client:
            body = {"model": "m", "prompt": ids, "stream": True}
            pinned = {"x-kvshare-replica": "0"}  # a pinned request is not in flight by prefix
            with client.stream("POST", "/v1/completions", json=body, headers=pinned) as resp:
                assert resp.status_code == 200
                time.sleep(0.2)  # the router holds the upstream headers, not the first chunk
                assert policy.gpu_tokens(route, 0) == 0
                if client_stays:
                    first_chunk.set()
                    assert next(resp.iter_lines()) == "data: {}"
        first_chunk.set()
        assert recorded() == 64
    finally:
        router.close()
        replica.close()


def test_an_oversized_body_is_a_413_naming_the_limit(fakes: Fakes) -> None:
    with routed(fakes.urls[:1], max_body_bytes=4096, max_buffered_bytes=8192) as (client, _):
        resp = post(client, prompt="x" * 5000)
        assert resp.status_code == 413
        assert "at most 4096 (--max-body-bytes)" in resp.json()["error"]["message"]
        chunked = client.post(
            "/v1/completions",
            content=iter([b'{"prompt": "', b"x" * 5000, b'"}']),
            headers={"content-type": "application/json"},
        )
        assert chunked.status_code == 413 and "too large" in chunked.json()["error"]["message"]
        assert post(client).status_code == 200
        assert client.get("/version").json() == {"version": kvshare.__version__}


def test_bodies_held_at_once_are_capped(fakes: Fakes) -> None:
    limits = {"max_body_bytes": 1024, "max_buffered_bytes": 1024, "body_wait_timeout": 0.2}
    with routed(fakes.urls[:1], **limits) as (client, router):
        body = {"model": "m", "prompt": "x" * 800, "stream": True, "chunks": 4}
        with client.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()  # referenced: a collected generator closes the stream
            next(lines)  # the first body is held while its answer streams
            refused = post(client, prompt="y" * 300)
            assert refused.status_code == 503
            assert "--max-buffered-bytes" in refused.json()["error"]["message"]
        deadline = time.monotonic() + 5
        while router.bodies.held:
            assert time.monotonic() < deadline, "the body was never released"
            time.sleep(0.05)
        assert post(client, prompt="y" * 300).status_code == 200


def test_a_client_that_closes_after_done_is_counted_without_an_error(
    fakes: Fakes, caplog: pytest.LogCaptureFixture
) -> None:
    with routed(fakes.urls[:1]) as (client, router):
        host, port = client.base_url.host, client.base_url.port
        body = json.dumps({"model": "m", "prompt": "x", "stream": True, "linger_after_done": 0.3})
        request = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n{body}"
        )
        with socket.create_connection((host, port)) as sock:
            sock.sendall(request.encode())
            received = b""
            while b"[DONE]" not in received:
                received += sock.recv(4096)
        deadline = time.monotonic() + 5
        while "kvshare_router_requests_total{" not in client.get("/metrics").text:
            assert time.monotonic() < deadline, "the request was never counted"
            time.sleep(0.05)
        assert router.replicas[0].in_flight == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_one_failed_health_check_does_not_take_a_replica_out() -> None:
    """A host that stalls through one check must not turn every request of an interval into
    a 503: a replica that answered before leaves at the second failed check in a row."""
    failing = threading.Event()

    async def health(request: web.Request) -> web.Response:
        if failing.is_set():
            return web.json_response({"error": "stalled"}, status=503)
        return web.json_response({"status": "ok", "instance": "flaky"})

    app = web.Application()
    app.router.add_get("/health", health)
    server = BackgroundServer(app)
    try:
        with routed([server.url], health_interval=60.0) as (client, router):
            replica = router.replicas[0]
            check = router._check  # one health round, driven by the test, on the router's loop

            def one_check() -> bool:
                asyncio.run_coroutine_threadsafe(check(replica), router_loop(router)).result(5)
                return client.get("/admin/replicas").json()[0]["healthy"]

            failing.set()
            assert one_check() is True  # one failed check: still in rotation
            failing.clear()
            assert one_check() is True  # a good one resets the count
            failing.set()
            assert [one_check(), one_check()] == [True, False]  # two in a row: out
    finally:
        server.close()


def router_loop(router: Router) -> asyncio.AbstractEventLoop:
    assert router._health_task is not None
    return router._health_task.get_loop()
