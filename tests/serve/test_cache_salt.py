"""Tenant isolation by `cache_salt`: two in-process replicas of a tiny random model share
one pool daemon, behind the router. A prompt's KV is reused, on the GPU and through the
pool, only by requests with the same salt (or, without a salt, by other unsalted ones);
any other request computes it all, so hit counts and timing tell nothing about it."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvshare import LLM
from kvshare.serve.launcher import up_config
from kvshare.serve.router import REPLICA_HEADER, RouterConfig, build_router_app
from kvshare.serve.routing_keys import RoutingKeys
from kvshare.serve.server import ServeConfig, build_app
from tests.kvpool.pool_fixture import PoolFactory
from tests.serve.inprocess import BackgroundServer

MODEL = "tiny"
PROMPT_TOKENS = 600  # 2 pool chunks of 256 tokens, then a tail
_prompts = random.Random(13)


def fresh_prompt() -> list[int]:
    """Token ids no other request sent: no cache holds any of their prefix yet."""
    return [_prompts.randrange(3, 512) for _ in range(PROMPT_TOKENS)]


@dataclass
class Tenancy:
    replicas: list[BackgroundServer]
    router: BackgroundServer
    client: httpx.Client

    def send(self, replica: int, prompt: list[int], salt: str | None) -> dict[str, int]:
        """usage.kv of a completion pinned through the router to `replica`, once that
        replica's pool stores of it are committed (the next request may rely on them)."""
        before = self.stored_pages(replica)
        body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        resp = self.client.post(
            f"{self.router.url}/v1/completions", json=body, headers={REPLICA_HEADER: str(replica)}
        )
        assert resp.status_code == 200, resp.text
        kv = resp.json()["usage"]["kv"]
        if kv["computed_tokens"] >= 2 * 256:  # it computed (so stores) both chunks itself
            self.wait_stored(replica, before + 2)
        return kv

    def stored_pages(self, replica: int) -> int:
        stats = self.client.get(f"{self.replicas[replica].url}/admin/stats").json()
        return stats["kv_pool"].get("stored_pages", 0)

    def wait_stored(self, replica: int, pages: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.stored_pages(replica) < pages:
            assert time.monotonic() < deadline, f"replica {replica} never committed its pages"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def tenancy() -> Iterator[Tenancy]:
    pools = PoolFactory()
    pool = pools.start(pools.config(size_bytes=32 << 20, slab_bytes=4 << 20))
    servers: list[BackgroundServer] = []
    try:
        for _ in range(2):
            llm = LLM(
                "shape:tiny-llama",
                kv_pool=pool.address,
                kv_cache_memory=16 << 20,
                max_num_batched_tokens=1024,
            )
            servers.append(BackgroundServer(build_app(llm.engine, ServeConfig(MODEL))))
        config = RouterConfig(tuple(s.url for s in servers), "cache-aware", health_interval=30.0)
        router = BackgroundServer(build_router_app(config, RoutingKeys(None, 16)))
        with httpx.Client(timeout=60) as client:
            yield Tenancy(servers, router, client)
        router.close()
    finally:
        for server in servers:
            server.close()
        pools.close()


def test_the_same_salt_hits_and_other_salts_share_nothing(tenancy: Tenancy) -> None:
    prompt = fresh_prompt()
    assert tenancy.send(0, prompt, "tenant-a")["computed_tokens"] == PROMPT_TOKENS
    # The same tenant: its own GPU blocks on replica 0.
    again = tenancy.send(0, prompt, "tenant-a")
    assert again["gpu_hit_tokens"] > 0 and again["pool_hit_tokens"] == 0
    # Other tenants on replica 0, whose GPU cache and the pool hold tenant-a's prefix.
    for salt in ("tenant-b", None):
        other = tenancy.send(0, prompt, salt)
        assert (other["gpu_hit_tokens"], other["pool_hit_tokens"]) == (0, 0), salt
    # Replica 1 never saw the prompt: tenant-a restores it from the pool, a new tenant
    # (the pool now holds it under three chains, none of them its own) computes it.
    assert tenancy.send(1, prompt, "tenant-c") == {
        "gpu_hit_tokens": 0,
        "pool_hit_tokens": 0,
        "pool_remote_hit_tokens": 0,
        "computed_tokens": PROMPT_TOKENS,
    }
    moved = tenancy.send(1, prompt, "tenant-a")
    assert moved["pool_hit_tokens"] == 512 and moved["gpu_hit_tokens"] == 0


def test_unsalted_requests_share_nothing_with_salted_ones(tenancy: Tenancy) -> None:
    prompt = fresh_prompt()
    assert tenancy.send(0, prompt, None)["computed_tokens"] == PROMPT_TOKENS
    # A salted request on replica 0 (GPU and pool hold the prompt unsalted) and one of
    # another tenant on replica 1 (only the pool holds it).
    for replica, salt in ((0, "tenant-a"), (1, "tenant-b")):
        salted = tenancy.send(replica, prompt, salt)
        assert (salted["gpu_hit_tokens"], salted["pool_hit_tokens"]) == (0, 0), replica
    # Unsalted requests still share as before salts existed (GPU, then pool).
    assert tenancy.send(0, prompt, None)["gpu_hit_tokens"] > 0
    assert tenancy.send(1, prompt, None)["pool_hit_tokens"] == 512


MALFORMED = [5, True, ["tenant-a"], {"id": "a"}, "", "x" * 1025]


@pytest.mark.parametrize("salt", MALFORMED, ids=["int", "bool", "list", "object", "empty", "huge"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("via", ["replica", "router"])
def test_a_malformed_salt_is_a_400(tenancy: Tenancy, salt: object, path: str, via: str) -> None:
    url = tenancy.replicas[0].url if via == "replica" else tenancy.router.url
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1, "cache_salt": salt}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = [5, 6, 7]
    resp = tenancy.client.post(url + path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "cache_salt" and "cache_salt" in error["message"]


@pytest.fixture(scope="module")
def salt_required() -> Iterator[str]:
    llm = LLM("shape:tiny-llama", kv_cache_memory=8 << 20, max_num_batched_tokens=256)
    server = BackgroundServer(build_app(llm.engine, ServeConfig(MODEL, cache_salt_required=True)))
    yield server.url
    server.close()


def test_cache_salt_required_refuses_unsalted_requests(salt_required: str) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1}
    with httpx.Client(base_url=salt_required, timeout=60) as client:
        for unsalted in (body, {**body, "cache_salt": None}):
            resp = client.post("/v1/completions", json=unsalted)
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["param"] == "cache_salt" and "requires a cache_salt" in error["message"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        assert (
            client.post("/v1/chat/completions", json=chat).json()["error"]["param"] == "cache_salt"
        )
        done = client.post("/v1/completions", json={**body, "cache_salt": "tenant-a"})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 1
        assert client.get("/v1/models").status_code == 200  # no prompt, no salt needed


def test_kvshare_up_passes_cache_salt_required_to_every_replica() -> None:
    import argparse

    from kvshare.serve.launcher import add_up_arguments

    parser = argparse.ArgumentParser()
    add_up_arguments(parser)
    assert (
        "--cache-salt-required"
        in up_config(parser.parse_args(["--cache-salt-required"])).engine_args
    )
    assert "--cache-salt-required" not in up_config(parser.parse_args([])).engine_args
