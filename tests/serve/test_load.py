"""A bounded load test: tens of concurrent streaming chat sessions through the router for
twenty seconds, with zero errors, and no open-file or memory growth in any child afterwards."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field

import httpx
import pytest

from kvshare.serve.launcher import Cluster
from tests.serve.conftest import MODEL

SESSIONS = 24
# Twenty seconds are about 200 turns on two cores, each opening and closing a stream on
# the router and a replica: a descriptor leaked per request or per session shows many times
# over FD_SLACK. The RSS bound catches a leak of about 1 MiB a turn (a minute's 600 turns
# caught a third of that); a smaller leak needs a longer run than the suite can afford.
LOAD_SECONDS = 20.0
WARMUP_SECONDS = 5.0
FD_SLACK = 4  # a few descriptors may come and go (log files, an idle connection)
RSS_GROWTH_LIMIT = 200 << 20


@dataclass
class Tally:
    completed: int = 0
    errors: list[str] = field(default_factory=list)
    served_by: set[str] = field(default_factory=set)


async def _turn(
    client: httpx.AsyncClient, session: str, messages: list[dict[str, str]], tally: Tally
) -> str | None:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers={"x-session-id": session}
        ) as resp:
            if resp.status_code != 200:
                tally.errors.append(f"{session}: HTTP {resp.status_code}")
                return None
            tally.served_by.add(resp.headers["x-kvshare-replica"])
            events = [line[6:] async for line in resp.aiter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as exc:
        tally.errors.append(f"{session}: {type(exc).__name__}: {exc}")
        return None
    chunks = [json.loads(e) for e in events[:-1]]
    if events[-1:] != ["[DONE]"] or chunks[-1].get("usage") is None:
        tally.errors.append(f"{session}: incomplete stream {events[-2:]}")
        return None
    tally.completed += 1
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


async def _session(client: httpx.AsyncClient, index: int, deadline: float, tally: Tally) -> None:
    messages: list[dict[str, str]] = []
    turn = 0
    while time.monotonic() < deadline:
        if len(messages) >= 6:  # a new conversation every three turns
            messages = []
        turn += 1
        messages.append(
            {"role": "user", "content": f"Session {index}, question {turn}: name a color."}
        )
        answer = await _turn(client, f"load-{index}", messages, tally)
        messages.append({"role": "assistant", "content": answer or ""})


async def _run(url: str, sessions: int, seconds: float) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(
        base_url=url, timeout=httpx.Timeout(120.0, connect=10.0)
    ) as client:
        await asyncio.wait_for(
            asyncio.gather(*(_session(client, i, deadline, tally) for i in range(sessions))),
            seconds + 180,
        )
    return tally


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def wait_idle(cluster: Cluster) -> None:
    deadline = time.monotonic() + 60
    while True:
        engines = [
            httpx.get(url + "/admin/stats", timeout=30).json()["engine"]
            for url in cluster.replica_urls
        ]
        routed = httpx.get(cluster.url + "/admin/replicas").json()
        if all(e["running"] == e["waiting"] == 0 for e in engines) and not any(
            r["in_flight"] for r in routed
        ):
            return
        assert time.monotonic() < deadline, f"still busy: {engines} {routed}"
        time.sleep(0.2)


@pytest.mark.slow
def test_concurrent_streaming_sessions_under_load(cluster: Cluster) -> None:
    children = cluster.children()
    assert set(children) == {"pool", "replica0", "replica1", "router"}
    # Warm up at full concurrency, so lazily grown buffers and pools are in the baseline.
    warmup = asyncio.run(_run(cluster.url, SESSIONS, WARMUP_SECONDS))
    assert warmup.errors == []
    wait_idle(cluster)
    files = {name: open_files(pid) for name, pid in children.items()}
    rss = {name: rss_bytes(pid) for name, pid in children.items()}

    tally = asyncio.run(_run(cluster.url, SESSIONS, LOAD_SECONDS))
    assert tally.errors == [], tally.errors[:5]
    assert tally.completed >= 2 * SESSIONS
    assert tally.served_by == {"0", "1"}
    wait_idle(cluster)
    assert cluster.children() == children  # nobody crashed or restarted

    # Idle keep-alive connections close within their timeout; leaked descriptors never do.
    deadline = time.monotonic() + 30
    while any(open_files(pid) > files[name] + FD_SLACK for name, pid in children.items()):
        assert time.monotonic() < deadline, {
            name: (files[name], open_files(pid)) for name, pid in children.items()
        }
        time.sleep(0.5)
    for name, pid in children.items():
        grown = rss_bytes(pid) - rss[name]
        assert grown < RSS_GROWTH_LIMIT, f"{name} grew by {grown >> 20} MiB"
