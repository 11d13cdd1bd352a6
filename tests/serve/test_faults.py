"""Faults under `kvshare up`: a replica killed under load, the pool daemon stopped and
started again. Nothing hangs, nothing answers wrong, and each fault is repaired after."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from kvshare.serve.launcher import Cluster
from tests.serve.conftest import MODEL, unique_text

REQUEST_TIMEOUT = httpx.Timeout(120.0, connect=10.0)


def complete(
    url: str, prompt: str, replica: int | None = None, max_tokens: int = 12
) -> dict[str, Any]:
    headers = {} if replica is None else {"x-kvshare-replica": str(replica)}
    resp = httpx.post(
        url + "/v1/completions",
        headers=headers,
        timeout=REQUEST_TIMEOUT,
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def replica_health(cluster: Cluster) -> list[bool]:
    return [r["healthy"] for r in httpx.get(cluster.url + "/admin/replicas").json()]


def router_retries(cluster: Cluster) -> float:
    text = httpx.get(cluster.url + "/metrics").text
    return float(
        next(
            line.split()[-1]
            for line in text.splitlines()
            if line.startswith("kvshare_router_retries_total")
        )
    )


def wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.2)


async def _request(client: httpx.AsyncClient, i: int, stream: bool) -> str:
    """'ok', or what went wrong; a request never takes longer than REQUEST_TIMEOUT."""
    body = {
        "model": MODEL,
        "prompt": f"Request {i}: tell me about rivers and",
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return f"HTTP {resp.status_code}"
            text = "".join([line async for line in resp.aiter_lines()])
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}"
    if not stream:
        return "ok" if json.loads(text)["usage"]["completion_tokens"] == 24 else "short answer"
    return "ok" if text.endswith("data: [DONE]") else "stream ended with an error event"


async def _kill_under_load(cluster: Cluster) -> list[tuple[bool, str]]:
    async with httpx.AsyncClient(base_url=cluster.url, timeout=REQUEST_TIMEOUT) as client:
        kinds = [i % 2 == 0 for i in range(10)]  # half streamed, half not
        tasks = [asyncio.create_task(_request(client, i, s)) for i, s in enumerate(kinds)]

        async def busy_on_replica1() -> bool:
            replicas = (await client.get("/admin/replicas")).json()
            return replicas[1]["in_flight"] >= 2

        deadline = time.monotonic() + 60
        while not await busy_on_replica1():
            assert time.monotonic() < deadline, "replica 1 never got requests"
            await asyncio.sleep(0.05)
        await asyncio.to_thread(cluster.kill_replica, 1)
        results = await asyncio.wait_for(asyncio.gather(*tasks), REQUEST_TIMEOUT.read + 30)
        return list(zip(kinds, results))


def test_killing_a_replica_under_load(cluster: Cluster) -> None:
    prompt = "Describe a quiet harbor at dawn."
    reference = complete(cluster.replica_urls[1], prompt)["choices"][0]["text"]
    retries = router_retries(cluster)
    try:
        results = asyncio.run(_kill_under_load(cluster))
        # Not yet answering when the replica died: retried on the survivor, so complete.
        assert all(outcome == "ok" for streamed, outcome in results if not streamed), results
        # Streams cut mid-way end cleanly with an error event; none hangs (we got here).
        assert all(
            outcome in ("ok", "stream ended with an error event")
            for streamed, outcome in results
            if streamed
        ), results
        # Every request replica 1 held (at least 2) was either retried or cut mid-stream.
        cut = sum(outcome != "ok" for _, outcome in results)
        assert router_retries(cluster) - retries + cut >= 2
        assert replica_health(cluster) == [True, False]
        for i in range(4):
            resp = httpx.post(
                cluster.url + "/v1/completions",
                timeout=REQUEST_TIMEOUT,
                json={"model": MODEL, "prompt": f"After the fault {i}", "max_tokens": 4},
            )
            assert resp.status_code == 200 and resp.headers["x-kvshare-replica"] == "0"
        metrics = httpx.get(cluster.url + "/metrics").text
        assert 'kvshare_router_replica_failures_total{replica="1"}' in metrics
    finally:
        cluster.start_replica(1)
    wait_until(lambda: replica_health(cluster) == [True, True], 20, "the router readmits replica 1")
    assert complete(cluster.url, prompt, replica=1)["choices"][0]["text"] == reference


def test_pool_down_means_recompute_and_a_restarted_pool_is_picked_up(cluster: Cluster) -> None:
    prompt = unique_text(520)
    cluster.stop_pool()
    try:
        first = complete(cluster.url, prompt, replica=0)
        second = complete(cluster.url, prompt, replica=1)
        assert second["usage"]["kv"]["pool_hit_tokens"] == 0
        assert second["usage"]["kv"]["computed_tokens"] == second["usage"]["prompt_tokens"]
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        stats = httpx.get(cluster.replica_urls[0] + "/admin/stats", timeout=30).json()
        assert stats["pool"] is None and stats["kv_pool"]["pool_errors"] > 0
    finally:
        cluster.start_pool()
    # The replicas reconnect on their own (at most one retry interval later).
    for _ in range(5):
        again = unique_text(520)
        stored = complete(cluster.url, again, replica=0)
        loaded = complete(cluster.url, again, replica=1)
        if loaded["usage"]["kv"]["pool_hit_tokens"]:
            break
        time.sleep(1.0)
    n = loaded["usage"]["prompt_tokens"]
    assert loaded["usage"]["kv"]["pool_hit_tokens"] == (n - 1) // 256 * 256
    assert loaded["choices"][0]["text"] == stored["choices"][0]["text"]
