"""Server-Timing: a generate response says where its time to first output went, in the
replica and in the router, and the phases add up to what each hop measured."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvshare import LLM
from kvshare.engine.llm_engine import LLMEngine, RequestOutput
from kvshare.serve.router import ROUTER_KEY, RouterConfig, build_router_app
from kvshare.serve.routing_keys import RoutingKeys
from kvshare.serve.server import ServeConfig, build_app
from kvshare.serve.server_timing import HEADER, PhaseClock, median_phases, parse_server_timing
from tests.serve.inprocess import BackgroundServer, wait_checked

PROMPT = list(range(3, 51))
REPLICA_PHASES = ["read", "parse", "prompt", "queue", "engine", "deliver"]
ROUTER_PHASES = ["router-read", "router-route", "router-upstream"]
SLOW_STEP_S = 0.15
# From a hop's last phase to its response headers: a few lines of code (a loaded CI
# machine may stall them).
HEADER_GAP_MS = 25.0


def test_laps_add_up_to_the_total() -> None:
    clock = PhaseClock()
    time.sleep(0.01)
    clock.lap("a")
    clock.until("b", clock.start - 1.0)  # a time before the last lap: a phase of 0
    time.sleep(0.01)
    clock.lap("c")
    phases = parse_server_timing([clock.header()])
    assert list(phases) == ["a", "b", "c", "total"]
    assert phases["a"] >= 10.0 and phases["b"] == 0.0 and phases["c"] >= 10.0
    parts = phases["a"] + phases["b"] + phases["c"]
    assert parts <= phases["total"] < parts + 5.0  # the total runs until the header is made


def test_parse_reads_every_header_and_skips_what_it_cannot() -> None:
    values = [
        'read;dur=1.5, parse;desc="JSON";dur=2, nodur;desc=x',
        "read;dur=9, total ; dur = 3.25, bad entry;dur=1, x;dur=abc, y;dur=1.2.3",
    ]
    assert parse_server_timing(values) == {"read": 1.5, "parse": 2.0, "total": 3.25}


class SlowSteps:
    """An engine whose steps each take SLOW_STEP_S longer: the time must show as `engine`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.step = engine.step

    def __call__(self) -> list[RequestOutput]:
        time.sleep(SLOW_STEP_S)
        return self.step()


@pytest.fixture(scope="module")
def replica() -> Iterator[BackgroundServer]:
    llm = LLM("shape:tiny-llama", kv_cache_memory=16 << 20, max_num_batched_tokens=256)
    engine = llm.engine
    engine.step = SlowSteps(engine)  # type: ignore[method-assign]
    server = BackgroundServer(build_app(engine, ServeConfig("tiny")))
    yield server
    server.close()


def generate(url: str, **fields: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **fields}
    response = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response


def check_phases(phases: dict[str, float], names: list[str], total: str) -> None:
    """`names` in order, none missing, adding up to the hop's `total` but for the code
    between its last phase and its headers."""
    assert [p for p in phases if p in names] == names
    parts = sum(phases[p] for p in names)
    assert parts <= phases[total] + 0.01 and phases[total] < parts + HEADER_GAP_MS


def check_replica_phases(phases: dict[str, float], elapsed_ms: float, stream: bool) -> None:
    check_phases(phases, REPLICA_PHASES + ([] if stream else ["answer"]), "total")
    assert phases["total"] <= elapsed_ms
    # The slow step lies in the engine's phase, not in the HTTP side's.
    assert phases["engine"] >= 1e3 * SLOW_STEP_S
    assert phases["read"] + phases["parse"] + phases["prompt"] < 1e3 * SLOW_STEP_S
    if not stream:  # the second token's step comes after the first output
        assert phases["answer"] >= 1e3 * SLOW_STEP_S


@pytest.mark.parametrize("stream", [True, False])
def test_a_replica_times_its_phases(replica: BackgroundServer, stream: bool) -> None:
    start = time.perf_counter()
    response = generate(replica.url, stream=stream)
    elapsed_ms = 1e3 * (time.perf_counter() - start)
    phases = parse_server_timing(response.headers.get_list(HEADER))
    check_replica_phases(phases, elapsed_ms, stream)


def test_the_router_adds_its_phases_to_the_replicas(replica: BackgroundServer) -> None:
    config = RouterConfig((replica.url,), "cache-aware", health_interval=0.2, health_timeout=1.0)
    app = build_router_app(config, RoutingKeys(None, 16))
    router = BackgroundServer(app)
    try:
        wait_checked(app[ROUTER_KEY])  # then the router sends the replica packed bodies
        start = time.perf_counter()
        response = generate(router.url, stream=True)
        elapsed_ms = 1e3 * (time.perf_counter() - start)
    finally:
        router.close()
    phases = parse_server_timing(response.headers.get_list(HEADER))
    check_replica_phases(phases, elapsed_ms, stream=True)
    check_phases(phases, ROUTER_PHASES, "router-total")
    # The replica's time is inside the router's wait for it, which is inside the router's.
    assert phases["total"] <= phases["router-upstream"] <= phases["router-total"] <= elapsed_ms


def test_median_phases_keeps_first_seen_order_and_skips_absent_phases() -> None:
    timings = [{"read": 1.0, "engine": 10.0}, {"read": 3.0, "parse": 5.0}, {"read": 2.0}]
    medians = median_phases(timings)
    assert list(medians) == ["read", "engine", "parse"]
    assert medians == {"read": 2.0, "engine": 10.0, "parse": 5.0}
