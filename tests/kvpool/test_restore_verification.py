"""A pool restore is used before it is verified, and discarded when verification fails.

The engine computes a restored request's new tokens in its admission step, ordered after
the copies but before the host has compared checksums (scheduler.py). These tests corrupt
a committed page and check that the answer is still the recomputed one: the restore is
thrown away with the step computed from it, nothing of it is registered or emitted, and
no block is leaked. With verification switched off (an injected `FaultInjection(skip_checksums=True)`) the same
corruption changes the answer, which shows the page really was read. A page found corrupt
leaves the pool at its first detection, so no other reader meets it again.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvshare import LLM, SamplingParams
from kvshare.engine.llm_engine import RequestOutput
from kvshare.kvpool.client import PoolClient
from kvshare.kvpool.connector import PoolConnector
from kvshare.kvpool.faults import FaultInjection
from kvshare.kvpool.keys import chunk_keys
from kvshare.kvpool.launch import PoolProcess
from kvshare.kvpool.page import HEADER_BYTES
from tests.kvpool.pool_fixture import PoolFactory

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
PROMPT = [random.Random(11).randrange(3, 512) for _ in range(700)]  # 2 full chunks + a tail


@pytest.fixture(scope="module")
def pool() -> Iterator[PoolProcess]:
    factory = PoolFactory()
    yield factory.start(factory.config(size_bytes=256 << 20, slab_bytes=64 << 20))
    factory.close()


@pytest.fixture(scope="module")
def llm(pool: PoolProcess) -> LLM:
    return LLM("shape:tiny-qwen3", dtype="float32", kv_pool=pool.address, weights_seed=7)


def connector_of(llm: LLM) -> PoolConnector:
    connector = llm.engine.connector
    assert isinstance(connector, PoolConnector)
    return connector


def answer(llm: LLM, params: SamplingParams = GREEDY) -> RequestOutput:
    """The prompt's answer with an empty GPU-local cache: only the pool can help."""
    llm.engine.reset_prefix_cache()
    out = llm.generate([PROMPT], params)[0]
    connector_of(llm).wait_idle()
    return out


def corrupt_chunk(connector: PoolConnector, chunk: int, fill: bytes = b"\x7f") -> None:
    """Overwrite 64 payload bytes of a committed page with `fill` (0x7f: large finite floats)."""
    keys = chunk_keys(connector.namespace, PROMPT)
    found = connector.client.lookup(keys[: chunk + 1])
    assert len(found.pages) == chunk + 1, "the prompt's chunks are not all in the pool"
    page = found.pages[chunk]
    connector.client.arena.view(page.offset + HEADER_BYTES + 4096, 64)[:] = fill * 64
    connector.client.release(found.lease)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> RequestOutput:
    connector = connector_of(llm)
    connector.set_enabled(False)
    out = answer(llm)
    connector.set_enabled(True)
    answer(llm)  # stores the prompt's full chunks
    return out


def test_a_prompts_chunks_are_in_the_pool_when_generate_returns(llm: LLM) -> None:
    """With one output token the prefill step is the last: no later step commits the stores
    it issued, so generate itself must, as a server does when it goes idle."""
    prompt = [random.Random(12).randrange(3, 512) for _ in range(600)]
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    connector = connector_of(llm)
    keys = chunk_keys(connector.namespace, prompt)
    found = connector.client.lookup(keys)
    connector.client.release(found.lease)
    assert len(keys) == 2 and len(found.pages) == 2


def test_a_verified_restore_gives_the_recomputed_answer(llm: LLM, reference: RequestOutput) -> None:
    out = answer(llm)
    assert out.pool_hit_tokens == 512
    assert out.token_ids == reference.token_ids


def test_a_corrupt_restore_is_discarded_and_recomputed(llm: LLM, reference: RequestOutput) -> None:
    connector = connector_of(llm)
    blocks = llm.engine.blocks
    failures = connector.counters["checksum_failures"]
    corrupt_chunk(connector, 1)
    out = answer(llm)
    assert connector.counters["checksum_failures"] == failures + 1
    assert out.token_ids == reference.token_ids
    assert out.pool_hit_tokens == 0 and out.computed_tokens == len(PROMPT)
    assert not llm.engine.has_unfinished()
    assert blocks.num_free_blocks == blocks.num_blocks  # the discarded restore leaked nothing


def test_unverified_the_corrupt_page_would_change_the_answer(
    llm: LLM, reference: RequestOutput
) -> None:
    connector = connector_of(llm)
    corrupt_chunk(connector, 1)
    faults = connector.faults
    connector.faults = FaultInjection(skip_checksums=True)
    try:
        out = answer(llm)
    finally:
        connector.faults = faults
    assert out.pool_hit_tokens == 512
    assert out.token_ids != reference.token_ids


def test_a_restore_whose_verification_raises_leaves_nothing_findable(
    llm: LLM, reference: RequestOutput, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step registers a restore's blocks before it verifies them; when verifying
    raises, the step fails and none of those blocks' hashes stay in the prefix cache."""
    connector = connector_of(llm)
    engine = llm.engine

    def broken(request_id: str) -> bool:
        raise RuntimeError("verification broke")

    engine.reset_prefix_cache()
    monkeypatch.setattr(connector, "finish_load", broken)
    engine.add_request("broken-verify", PROMPT, GREEDY)
    with pytest.raises(RuntimeError, match="verification broke"):
        while engine.has_unfinished():
            engine.step()
    monkeypatch.undo()
    assert engine.blocks.hash_to_block == {}
    assert engine.abort("broken-verify")  # as the server's engine thread does after a failed step
    assert [out.request_id for out in engine.step()] == ["broken-verify"]
    assert answer(llm).token_ids == reference.token_ids


@pytest.mark.parametrize("fill", [b"\x00", b"\x7f"], ids=["zeros", "huge"])
def test_a_failed_restore_draws_no_sample(llm: LLM, reference: RequestOutput, fill: bytes) -> None:
    """A seeded request whose restore fails samples as if the pool had never been there.
    Zeros give finite logits (a draw would be spent); huge values give NaN logits, which
    the sampler must never see."""
    connector = connector_of(llm)
    connector.set_enabled(False)
    expected = answer(llm, SEEDED)
    connector.set_enabled(True)
    failures = connector.counters["load_failures"]
    corrupt_chunk(connector, 1, fill)
    out = answer(llm, SEEDED)
    assert connector.counters["load_failures"] == failures + 1
    assert out.token_ids == expected.token_ids


def test_a_corrupt_page_leaves_the_pool_at_its_first_detection(
    llm: LLM, reference: RequestOutput, pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    connector = connector_of(llm)
    failures = connector.counters["checksum_failures"]
    corrupt_chunk(connector, 1)
    monkeypatch.setattr(
        connector, "store", lambda *args, **kwargs: None
    )  # the recompute stores nothing
    assert answer(llm).pool_hit_tokens == 0
    other = PoolClient(pool.address)  # another replica's client
    found = other.lookup(chunk_keys(connector.namespace, PROMPT))
    other.release(found.lease)
    other.close()
    assert len(found.pages) == 1, "the corrupt page is still served to other readers"
    assert connector.counters["invalidated_pages"] >= 1
    monkeypatch.undo()
    assert (
        answer(llm).pool_hit_tokens == 256
    )  # chunk 0 restores; chunk 1 is computed and stored again
    again = answer(llm)
    assert again.pool_hit_tokens == 512 and again.token_ids == reference.token_ids
    assert connector.counters["checksum_failures"] == failures + 1


def test_a_load_that_fails_after_issuing_copies_ends_them_before_recomputing(
    llm: LLM, reference: RequestOutput, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transfer.load raising after it issued copies (on CUDA: a later group's copy failing
    to start) is a miss, and the copies already issued must end before the request's
    blocks are recomputed: a late one (here 0.3 s late, from a corrupt page) would land on
    the recomputed bytes, which the GPU-local cache then serves to the next request."""
    connector = connector_of(llm)
    corrupt_chunk(connector, 0)
    transfer = connector.transfer
    issue = transfer.load

    def issue_then_fail(copies: list, prefetch: object = None) -> object:
        issue(copies, prefetch)
        raise RuntimeError("injected: a copy failed to start")

    monkeypatch.setattr(transfer, "load", issue_then_fail)
    monkeypatch.setattr(transfer, "delay_seconds", 0.3)
    failures = connector.counters["load_failures"]
    out = answer(llm)
    assert connector.counters["load_failures"] == failures + 1
    assert out.pool_hit_tokens == 0 and out.token_ids == reference.token_ids
    monkeypatch.undo()
    transfer.synchronize()  # whatever was still queued has landed now
    connector.set_enabled(False)
    try:
        again = llm.generate([PROMPT], GREEDY)[0]  # from the GPU-local cache
    finally:
        connector.set_enabled(True)
    assert again.gpu_hit_tokens > 0
    assert again.token_ids == reference.token_ids
