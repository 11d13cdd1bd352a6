"""KVShareConnector in real vLLM CPU engines: replica B restores what replica A stored.

Order matters inside this module (one cluster for all): the daemon-down case runs last.
A's answer to a prompt it computed itself (a pool miss: nothing restored) is the
reference B's restored answer must equal, and so is the answer of N, vLLM without the
connector.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvshare.integrations.vllm_pages import PAGE_LAYOUT_VERSION
from kvshare.kvpool.client import PoolClient
from kvshare.kvpool.page import HEADER_BYTES, PAGE_ALIGN, PAGE_MAGIC, PageHeader
from tests.integrations.vllm.conftest import VLLMCluster
from tests.integrations.vllm.tiny_models import VOCAB

CHUNK = 256
PROMPT_TOKENS = 1100  # 4 whole chunks (1,024 tokens) before the last token


def prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def pages_in_arena(client: PoolClient) -> dict[bytes, tuple[int, PageHeader]]:
    """key -> (slot offset, header) of every vLLM page the arena holds."""
    arena = client.arena.as_tensor()
    found = {}
    for offset in range(0, arena.numel() - HEADER_BYTES, PAGE_ALIGN):
        if bytes(arena[offset : offset + 8].numpy()) != PAGE_MAGIC:
            continue
        header = PageHeader.unpack(arena[offset : offset + HEADER_BYTES].numpy().tobytes())
        if header.layout_version == PAGE_LAYOUT_VERSION:
            found[header.key] = (offset, header)
    return found


def chain_of(pages: dict[bytes, tuple[int, PageHeader]], new: set[bytes]) -> list[bytes]:
    """The keys of `new` in chain order (each page's parent is the previous one)."""
    parents = {pages[k][1].parent_key: k for k in new}
    first = next(k for k in new if pages[k][1].parent_key not in new)
    chain = [first]
    while chain[-1] in parents:
        chain.append(parents[chain[-1]])
    return chain


def connected_client(address: str) -> Iterator[PoolClient]:
    """A fixture's client of the pool at `address`, closed after the test."""
    client = PoolClient(address)
    client.connect()
    yield client
    client.close()


@pytest.fixture
def pool_client(cluster: VLLMCluster) -> Iterator[PoolClient]:
    yield from connected_client(cluster.address)


def pinned_pages(client: PoolClient) -> int:
    return sum(page_class["pinned"] for page_class in client.stats()["classes"])


def test_b_restores_a_prefix_that_a_computed_and_answers_like_a(
    cluster: VLLMCluster, pool_client: PoolClient
) -> None:
    tokens = prompt(1)
    reference = cluster.a.ask(tokens)
    assert reference["cached"] == 0
    restored = cluster.b.ask(tokens)
    assert restored["cached"] >= 4 * CHUNK
    plain = cluster.n.ask(tokens)  # vLLM without the connector
    for expected in (reference, plain):
        assert restored["tokens"] == expected["tokens"]
        assert restored["logprobs"] == pytest.approx(expected["logprobs"], abs=1e-4)
    # Every lease of the restore (the scheduler's and the worker's) was released.
    assert pinned_pages(pool_client) == 0


def test_the_daemons_switch_turns_the_pool_off_for_vllm_replicas(
    cluster: VLLMCluster, pool_client: PoolClient
) -> None:
    stored, offered = prompt(5), prompt(6)
    cluster.a.ask(stored)
    pool_client.set_enabled(False)
    try:
        assert cluster.b.ask(stored)["cached"] == 0  # lookups miss
        cluster.a.ask(offered)  # its store is skipped
    finally:
        pool_client.set_enabled(True)
    assert cluster.b.ask(offered)["cached"] == 0
    back_on = prompt(7)
    cluster.a.ask(back_on)
    assert cluster.b.ask(back_on)["cached"] >= 4 * CHUNK


def test_a_corrupt_page_is_not_used_and_b_recomputes_from_it(
    cluster: VLLMCluster, pool_client: PoolClient
) -> None:
    tokens = prompt(2)
    before = set(pages_in_arena(pool_client))
    reference = cluster.a.ask(tokens)
    pages = pages_in_arena(pool_client)
    chain = chain_of(pages, set(pages) - before)
    assert len(chain) == 4
    offset, header = pages[chain[1]]
    arena = pool_client.arena.as_tensor()
    arena[offset + HEADER_BYTES + header.payload_bytes // 2] ^= 0x40  # one flipped byte
    answer = cluster.b.ask(tokens)
    # Chunk 0 restored, chunk 1 refused: B computed everything from it on (vLLM's
    # num_cached_tokens keeps the count it first scheduled with, so the log tells).
    assert answer["tokens"] == reference["tokens"]
    log = cluster.b.log()
    assert f"page of chunk 1 (key {chain[1].hex()}) failed verification" in log
    assert "1 of 4 chunks restored" in log
    assert "Recovered from KV load failure" in log


def test_a_full_pool_skips_stores_and_b_still_answers(
    cluster: VLLMCluster, pool_client: PoolClient
) -> None:
    pool_client.clear()
    filler = [bytes([i]) * 16 for i in range(1, 200)]
    reservation = pool_client.reserve(filler, 500_000)
    assert reservation.dropped > 0
    try:
        tokens = prompt(3)
        reference = cluster.a.ask(tokens)
        answer = cluster.b.ask(tokens)
    finally:
        pool_client.abort(filler)
    assert answer["cached"] == 0
    assert answer["tokens"] == reference["tokens"]
    assert "pool full" in cluster.a.log()


def test_with_the_daemon_down_b_recomputes_and_answers(cluster: VLLMCluster) -> None:
    tokens = prompt(4)
    reference = cluster.a.ask(tokens)
    cluster.pool.stop()
    answer = cluster.b.ask(tokens)
    assert answer["cached"] == 0
    assert answer["tokens"] == reference["tokens"]
    assert "recomputing without the pool" in cluster.b.log()
