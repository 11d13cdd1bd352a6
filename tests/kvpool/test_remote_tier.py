"""The remote tier across two hosts: two daemons with separate arenas and sockets (each its
own process), a replica on each, and a Mooncake master on loopback started here.

Runs only where Mooncake is installed (`kvshare[mooncake]`); skips otherwise. The tests
share one master and run in file order: the last one kills that master.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import time
from collections.abc import Iterator

import pytest

from kvshare import LLM
from kvshare.engine.sampling_params import SamplingParams
from kvshare.kvpool.client import PoolClient
from kvshare.kvpool.keys import chunk_keys
from kvshare.kvpool.launch import PoolProcess
from kvshare.kvpool.mooncake_master import MooncakeMaster, mooncake_missing
from kvshare.kvpool.page import HEADER_BYTES
from kvshare.kvpool.remote import RemoteConfig, remote_name
from kvshare.ports import free_port
from kvshare.validate.cross_host import corrupt_in_child
from tests.kvpool.pool_fixture import MIB, PoolFactory

pytestmark = pytest.mark.skipif(mooncake_missing() is not None, reason=str(mooncake_missing()))

MODEL = "shape:tiny-llama"
CHUNK = 256
PROMPT_TOKENS = 5 * CHUNK + 20  # five whole chunks: 1,280 tokens a pool can serve
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
READY_S = 30.0


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(PROMPT_TOKENS)]


def remote_stats(pool: PoolProcess) -> dict:
    client = PoolClient(pool.address)
    try:
        return client.stats()["remote"]
    finally:
        client.close()


def wait_for(pool: PoolProcess, counter: str, at_least: int) -> dict:
    deadline = time.monotonic() + READY_S
    while (stats := remote_stats(pool))[counter] < at_least:
        assert time.monotonic() < deadline, f"{counter} stayed below {at_least}: {stats}"
        time.sleep(0.05)
    return stats


def start_host(factory: PoolFactory, url: str) -> PoolProcess:
    config = factory.config(size_bytes=16 * MIB, slab_bytes=4 * MIB)
    remote = RemoteConfig(url, local_hostname="127.0.0.1", segment_bytes=32 * MIB)
    return factory.start(dataclasses.replace(config, remote=remote))


def stop_together(factory: PoolFactory, pools: list[PoolProcess]) -> None:
    """Signal every daemon first, then wait: each takes a second or two to leave the store."""
    for pool in pools:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pool.pid, signal.SIGTERM)
    factory.close()


def replica(pool: PoolProcess | None) -> LLM:
    return LLM(MODEL, dtype="float32", kv_pool=pool.address if pool else None, chunk_tokens=CHUNK)


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    with MooncakeMaster() as running:
        yield running


@pytest.fixture(scope="module")
def hosts(master: MooncakeMaster) -> Iterator[tuple[PoolProcess, PoolProcess]]:
    factory = PoolFactory()
    pools: list[PoolProcess] = []
    try:
        pools += [start_host(factory, master.url), start_host(factory, master.url)]
        for pool in pools:
            wait_for(pool, "ready", 1)
        yield pools[0], pools[1]
    finally:
        stop_together(factory, pools)


@pytest.fixture(scope="module")
def replicas(hosts: tuple[PoolProcess, PoolProcess]) -> tuple[LLM, LLM, LLM]:
    """Replica A on host A's pool, replica B on host B's, and one without any pool."""
    a, b = hosts
    return replica(a), replica(b), replica(None)


def test_a_prefix_computed_on_host_a_is_served_on_host_b_from_the_remote_tier(
    hosts: tuple[PoolProcess, PoolProcess], replicas: tuple[LLM, LLM, LLM]
) -> None:
    pool_a, pool_b = hosts
    on_a, on_b, alone = replicas
    tokens = prompt(1)
    first = on_a.generate([tokens], GREEDY)[0]
    assert first.pool_hit_tokens == 0
    wait_for(pool_a, "published_pages", 5)

    served = on_b.generate([tokens], GREEDY)[0]
    assert served.pool_hit_tokens >= 1024
    assert served.pool_remote_hit_tokens == served.pool_hit_tokens
    assert served.token_ids == alone.generate([tokens], GREEDY)[0].token_ids
    stats = remote_stats(pool_b)
    assert stats["fetch_hit_pages"] >= 5 and stats["fetch_hit_bytes"] > 0
    assert on_b.engine.connector.counters["remote_hit_tokens"] >= 1024


def test_a_corrupt_remote_page_is_detected_counted_and_recomputed(
    master: MooncakeMaster, hosts: tuple[PoolProcess, PoolProcess], replicas: tuple[LLM, LLM, LLM]
) -> None:
    pool_a, pool_b = hosts
    on_a, on_b, alone = replicas
    tokens = prompt(2)
    on_a.generate([tokens], GREEDY)
    published = remote_stats(pool_a)["published_pages"]
    wait_for(pool_a, "published_pages", published)
    first_key = chunk_keys(on_a.engine.connector.namespace, tokens[:CHUNK])[0]
    assert corrupt_in_child(master.url, remote_name(first_key), HEADER_BYTES + 1000) == 0
    before = remote_stats(pool_b)["fetch_corrupt_pages"]
    failures = on_b.engine.connector.counters["load_failures"]

    served = on_b.generate([tokens], GREEDY)[0]
    assert remote_stats(pool_b)["fetch_corrupt_pages"] == before + 1  # detected and counted
    assert served.pool_hit_tokens == 0  # never served: the chain breaks at its first page
    assert on_b.engine.connector.counters["load_failures"] == failures  # not even tentatively
    assert served.token_ids == alone.generate([tokens], GREEDY)[0].token_ids


def test_a_master_down_at_start_leaves_both_hosts_local_only_without_delaying_them() -> None:
    factory = PoolFactory()
    pools: list[PoolProcess] = []
    try:
        url = f"mooncake://127.0.0.1:{free_port()}"  # nothing listens there
        started = time.monotonic()
        pools += [start_host(factory, url), start_host(factory, url)]
        host_a, host_b = pools
        assert time.monotonic() - started < 10.0  # two daemons, a loaded 2-core machine
        on_a, on_b, tokens = replica(host_a), replica(host_b), prompt(3)
        answer_a = on_a.generate([tokens], GREEDY)[0]
        answer_b = on_b.generate([tokens], GREEDY)[0]
        assert answer_a.token_ids == answer_b.token_ids
        assert answer_b.pool_hit_tokens == 0
        for pool in (host_a, host_b):
            stats = remote_stats(pool)
            assert not stats["ready"] and stats["start_failures"] >= 1
        client = PoolClient(host_a.address)
        assert client.stats()["committed_keys"] >= 5  # the local pool works
        assert len(client.lookup(chunk_keys(on_a.engine.connector.namespace, tokens)).pages) == 5
        client.close()
    finally:
        stop_together(factory, pools)


def test_requests_still_succeed_after_the_master_is_killed(
    master: MooncakeMaster, hosts: tuple[PoolProcess, PoolProcess], replicas: tuple[LLM, LLM, LLM]
) -> None:
    _, pool_b = hosts
    on_a, on_b, alone = replicas
    master.kill()
    client = PoolClient(pool_b.address)
    shape = {"payload_bytes": 8192, "segment_ends": [8192]}
    for _ in range(3):  # each a miss within the bounded wait, never an error
        started = time.monotonic()
        assert client.lookup([os.urandom(16) for _ in range(4)], page=shape).pages == ()
        assert time.monotonic() - started < 2.5  # the wait is 1 s; a dead master's call ~4 s
    client.close()
    for seed in (4, 5):
        tokens = prompt(seed)
        started = time.monotonic()
        answers = [llm.generate([tokens], GREEDY)[0] for llm in (on_a, on_b)]
        assert time.monotonic() - started < 20.0
        expected = alone.generate([tokens], GREEDY)[0].token_ids
        assert all(a.token_ids == expected for a in answers)
    stats = remote_stats(pool_b)
    assert stats["fetch_failures"] + stats["fetch_timeouts"] >= 1
    assert stats["fetch_skipped_down"] >= 1  # then left alone for a while
    again = on_a.generate([prompt(4)], GREEDY)[0]  # both daemons still serve their pools
    assert again.gpu_hit_tokens + again.pool_hit_tokens >= 1024
