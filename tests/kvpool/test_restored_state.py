"""A hybrid model's state restored from the pool stays on the GPU as a snapshot.

A hybrid model resumes a cached prefix only where it has the recurrent state of that
boundary. A restore brings the state into the sequence's slot, and the sequence's step
moves it on at once; unless it is copied aside first, the replica then holds the prefix's
KV blocks but no state to resume from, and the next request with that prefix loads it
from the pool again, or recomputes it when the pool has evicted the page (on the H200,
with a pool smaller than the working set, a 16k-token document restored at 15.1 s was
recomputed in full at 18.7 s on the same replica). The copy is kept only once the restore
is verified: a restore that fails verification is recomputed, and the recompute's own
state must be the one the boundary keeps. On CUDA the copy aside must also come after
the state's copy from the pool on the device (the load orders the compute stream after
it): the `cuda` cases check that the kept state is the restored one there too.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvshare import LLM, SamplingParams
from kvshare.engine.llm_engine import RequestOutput
from kvshare.kvpool.connector import PoolConnector, state_key
from kvshare.kvpool.keys import chunk_keys
from kvshare.kvpool.launch import PoolProcess
from kvshare.kvpool.page import HEADER_BYTES
from tests.kvpool.pool_fixture import PoolFactory, hybrid_replica

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
PREFIX = [random.Random(31).randrange(3, 512) for _ in range(600)]  # 2 chunks of 256 + 88


def question(seed: int) -> list[int]:
    return PREFIX + [random.Random(seed).randrange(3, 512) for _ in range(20)]


@pytest.fixture
def pool() -> Iterator[PoolProcess]:
    factory = PoolFactory()
    yield factory.start(factory.config(size_bytes=64 << 20, slab_bytes=4 << 20))
    factory.close()


def ask(llm: LLM, prompt: list[int]) -> RequestOutput:
    out = llm.generate([prompt], PARAMS)[0]
    connector = llm.engine.connector
    assert isinstance(connector, PoolConnector)
    connector.wait_idle()
    return out


def resumed_without_pool(llm: LLM, connector: PoolConnector, prompt: list[int]) -> RequestOutput:
    """The answer to `prompt` resumed from the GPU snapshot the replica took when it
    computed the prefix itself, the pool off: the same computation as a resume from a
    restored state, so on any device the answers must agree."""
    connector.set_enabled(False)
    llm.engine.reset_prefix_cache()
    ask(llm, question(0))
    out = ask(llm, prompt)
    assert out.gpu_hit_tokens == 512
    llm.engine.reset_prefix_cache()
    connector.set_enabled(True)
    return out


def stored_prefix(pool: PoolProcess, device: str) -> tuple[LLM, PoolConnector, RequestOutput]:
    """A hybrid replica that has computed the prefix and stored it in the pool (its state
    at 512 tokens too), and the reference answer to question(2)."""
    llm, connector = hybrid_replica(pool, device)
    reference = resumed_without_pool(llm, connector, question(2))
    ask(llm, question(0))
    return llm, connector, reference


def assert_same_answer(out: RequestOutput, reference: RequestOutput) -> None:
    assert out.token_ids == reference.token_ids
    assert max(abs(a - b) for a, b in zip(out.logprobs, reference.logprobs)) < 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_the_next_request_after_a_restore_resumes_on_the_gpu(
    pool: PoolProcess, device: str
) -> None:
    llm, connector, reference = stored_prefix(pool, device)
    llm.engine.reset_prefix_cache()  # the replica of another conversation: only the pool
    restored = ask(llm, question(1))
    assert restored.pool_hit_tokens == 512 and restored.gpu_hit_tokens == 0
    connector.set_enabled(False)  # the pool evicted the prefix meanwhile
    again = ask(llm, question(2))
    assert again.gpu_hit_tokens == 512 and again.pool_hit_tokens == 0
    assert_same_answer(again, reference)
    connector.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_restore_that_fails_verification_leaves_the_recomputed_state(
    pool: PoolProcess, device: str
) -> None:
    llm, connector, reference = stored_prefix(pool, device)
    keys = chunk_keys(connector.namespace, PREFIX)
    found = connector.client.lookup(keys[:2], states=[(1, state_key(keys[1]))])
    assert len(found.pages) == 3, "the prefix's chunks and its state page are not all stored"
    state_page = found.pages[-1]
    middle = HEADER_BYTES + state_page.payload_bytes // 2
    connector.client.arena.view(state_page.offset + middle, 64)[:] = b"\x7f" * 64
    connector.client.release(found.lease)
    llm.engine.reset_prefix_cache()
    recomputed = ask(llm, question(1))  # the restore fails its checksum: recomputed
    assert recomputed.pool_hit_tokens == 0
    connector.set_enabled(False)
    again = ask(llm, question(2))
    assert again.gpu_hit_tokens == 512
    assert_same_answer(again, reference)
    connector.close()
