"""A pool hit's host work before its load is issued reads the prompt's int32 array only:
the list of the prompt's ids as Python ints (~2 ms at 131k tokens, and as much again in
the garbage collector) is built afterwards, by the step that computes the new tokens,
and the answer is the one computed without the pool."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvshare import LLM, SamplingParams
from kvshare.engine.sequence import Sequence
from kvshare.kvpool.connector import PoolConnector
from kvshare.kvpool.launch import PoolProcess
from kvshare.kvpool.transfer import PageCopy, Prefetch, TransferJob
from tests.kvpool.pool_fixture import PoolFactory

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = [random.Random(5).randrange(3, 512) for _ in range(700)]  # 2 full chunks + a tail


@pytest.fixture
def pool() -> Iterator[PoolProcess]:
    factory = PoolFactory()
    yield factory.start(factory.config(size_bytes=256 << 20, slab_bytes=64 << 20))
    factory.close()


def test_a_pool_hit_builds_its_prompt_list_after_its_load_is_issued(
    pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM("shape:tiny-qwen3", dtype="float32", kv_pool=pool.address, weights_seed=7)
    connector = llm.engine.connector
    assert isinstance(connector, PoolConnector) and connector.transfer is not None
    connector.set_enabled(False)
    reference = llm.generate([PROMPT], GREEDY)[0]
    connector.set_enabled(True)
    llm.engine.reset_prefix_cache()
    llm.generate([PROMPT], GREEDY)  # stores the prompt's full chunks
    connector.wait_idle()
    llm.engine.reset_prefix_cache()

    events: list[str] = []
    token_ids, load = Sequence.token_ids, connector.transfer.load

    def reading_token_ids(seq: Sequence) -> list[int]:
        events.append("token_ids")
        return token_ids.fget(seq)

    def loading(copies: list[PageCopy], prefetch: Prefetch | None = None) -> TransferJob:
        events.append("load")
        return load(copies, prefetch)

    monkeypatch.setattr(Sequence, "token_ids", property(reading_token_ids))
    monkeypatch.setattr(connector.transfer, "load", loading)
    hit = llm.generate([PROMPT], GREEDY)[0]
    assert hit.pool_hit_tokens == 2 * connector.chunk_tokens
    assert events[0] == "load" and "token_ids" in events
    assert hit.token_ids == reference.token_ids and hit.prompt_token_ids == tuple(PROMPT)
