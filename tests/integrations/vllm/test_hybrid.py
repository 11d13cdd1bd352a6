"""KVShareConnector with a hybrid model (Gated DeltaNet + attention: a tiny Qwen3-Next) in
real vLLM CPU engines. H is a correct replica; X restores the KV of a prefix but not its
recurrent state (the connector's test-only switch), the failure that gives plausible
garbage. Both store correctly, on their own pool.

References: a replica's answer to a prompt it computed itself (a pool miss), and G's, the
same model in vLLM without the connector. vLLM's prefix caching ("align" mode) ends the
prefill step on the prompt's last block boundary (1,024 of 1,100 tokens) with or without a
hit, so a restored answer computes exactly the same last 76 tokens from the same bytes,
and must match within 1e-5. The models run in bfloat16: vLLM CPU's Gated DeltaNet kernel
takes no other dtype.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvshare.kvpool.client import PoolClient
from kvshare.kvpool.connector import state_key
from kvshare.kvpool.page import HEADER_BYTES
from tests.integrations.vllm.conftest import VLLMCluster
from tests.integrations.vllm.test_connector import (
    CHUNK,
    chain_of,
    connected_client,
    pages_in_arena,
    prompt,
)

RESTORED = 4 * CHUNK  # 1,024 of the 1,100 prompt tokens: 4 chunks + the state after them
TOLERANCE = 1e-5  # logprobs of a restored answer against the computed one


@pytest.fixture
def hybrid_client(cluster: VLLMCluster) -> Iterator[PoolClient]:
    yield from connected_client(cluster.hybrid_address)


def max_difference(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def assert_answers_like_computed(
    cluster: VLLMCluster, tokens: list[int], restored: dict, reference: dict
) -> None:
    """`restored` equals `reference` (a replica's own pool miss) and G's answer (vLLM
    without the connector): same tokens, logprobs within TOLERANCE."""
    plain = cluster.g.ask(tokens)
    for expected in (reference, plain):
        assert restored["tokens"] == expected["tokens"]
        assert max_difference(restored["logprobs"], expected["logprobs"]) <= TOLERANCE


def stored_prefix(client: PoolClient, before: set[bytes]) -> tuple[list[bytes], bytes]:
    """The chunk keys a prompt stored (in order) and the key of its state page."""
    pages = pages_in_arena(client)
    new = set(pages) - before
    states = {
        k for k in new if pages[k][1].parent_key in new and k == state_key(pages[k][1].parent_key)
    }
    chain = chain_of(pages, new - states)
    (state,) = states
    return chain, state


def test_a_restored_hybrid_prefix_answers_like_the_computed_one(
    cluster: VLLMCluster, hybrid_client: PoolClient
) -> None:
    tokens = prompt(11)
    before = set(pages_in_arena(hybrid_client))
    reference = cluster.h.ask(tokens)
    assert reference["cached"] == 0
    chain, state = stored_prefix(hybrid_client, before)
    assert len(chain) == 4 and state == state_key(chain[-1])
    # Only the pool can serve the prefix now.
    cluster.h.reset_prefix_cache()
    restored = cluster.h.ask(tokens)
    assert restored["cached"] == RESTORED
    assert_answers_like_computed(cluster, tokens, restored, reference)
    assert sum(c["pinned"] for c in hybrid_client.stats()["classes"]) == 0


def test_another_replica_restores_the_prefix_and_the_state_it_stored(
    cluster: VLLMCluster,
) -> None:
    tokens = prompt(12)
    reference = cluster.x.ask(tokens)  # X computes (a miss) and stores correctly
    assert reference["cached"] == 0
    restored = cluster.h.ask(tokens)
    assert restored["cached"] == RESTORED
    assert_answers_like_computed(cluster, tokens, restored, reference)


def test_restoring_the_kv_without_the_state_is_caught(cluster: VLLMCluster) -> None:
    tokens = prompt(13)
    reference = cluster.h.ask(tokens)
    broken = cluster.x.ask(tokens)
    assert broken["cached"] == RESTORED  # X did restore the KV from the pool
    # Beyond the tolerance the restore tests hold answers to, so they would catch it (the
    # tiny random model's logits are nearly flat: 1e-4 to 4e-3 apart were measured).
    assert max_difference(broken["logprobs"], reference["logprobs"]) > TOLERANCE


def test_a_corrupt_state_page_fails_only_that_request_and_it_is_recomputed(
    cluster: VLLMCluster, hybrid_client: PoolClient
) -> None:
    tokens = prompt(14)
    before = set(pages_in_arena(hybrid_client))
    reference = cluster.x.ask(tokens)
    _, state = stored_prefix(hybrid_client, before)
    offset, header = pages_in_arena(hybrid_client)[state]
    arena = hybrid_client.arena.as_tensor()
    arena[offset + HEADER_BYTES + header.payload_bytes // 3] ^= 0x08  # one flipped bit
    answer = cluster.h.ask(tokens)
    # Reported per request (failed_recving): vLLM cannot map block ids to requests when
    # there are several KV cache groups, and raises if a connector reports them.
    assert answer["tokens"] == reference["tokens"]
    assert max_difference(answer["logprobs"], reference["logprobs"]) <= TOLERANCE
    log = cluster.h.log()
    assert f"page of chunk 4 (key {state.hex()}) failed verification" in log
    assert "the 4 chunks and their state were not restored; recomputing the request" in log
    # The engine goes on: the next restore works.
    again = prompt(15)
    first = cluster.x.ask(again)
    assert cluster.h.ask(again)["logprobs"] == pytest.approx(first["logprobs"], abs=TOLERANCE)
