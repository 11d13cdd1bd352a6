"""A prefix longer than the pool, stored step by step by a chunked prefill, keeps its head.

Each step of a chunked prefill stores that step's chunks, and a commit makes its pages the
most recent. A prefix longer than the pool then evicted its own head to store its tail,
and a tail without its head restores nothing (measured on the H200: two gemma3-27b
replicas, a 130,816-token prefix of 66 GB against a 40 GiB pool, 0 pool-hit tokens). Each
store now tells the pool which chain it extends, so the pool keeps the head and drops what
does not fit: the next replica restores as much of the prefix as the pool holds.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvshare import LLM, SamplingParams
from kvshare.kvpool.connector import PoolConnector
from kvshare.kvpool.launch import PoolProcess
from kvshare.kvpool.page import slot_bytes_for
from tests.kvpool.pool_fixture import MIB, PoolFactory

CHUNK = 32
SLAB = 2 * MIB
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture
def pool() -> Iterator[PoolProcess]:
    factory = PoolFactory()
    yield factory.start(factory.config(size_bytes=SLAB, slab_bytes=SLAB))
    factory.close()


def replica(pool: PoolProcess) -> LLM:
    return LLM(
        "shape:tiny-llama",
        dtype="float32",
        kv_pool=pool.address,
        chunk_tokens=CHUNK,
        kv_cache_memory=16 * MIB,
        max_num_batched_tokens=2 * CHUNK,  # a few chunks per step: stored step by step
    )


def connector_of(llm: LLM) -> PoolConnector:
    connector = llm.engine.connector
    assert isinstance(connector, PoolConnector)
    return connector


def test_a_prefix_longer_than_the_pool_keeps_its_head(pool: PoolProcess) -> None:
    writer = replica(pool)
    layout = connector_of(writer).layout
    assert layout is not None
    fits = SLAB // slot_bytes_for(layout.payload_bytes)  # pages the pool holds
    rng = random.Random(11)
    prompt = [rng.randrange(3, 500) for _ in range(2 * fits * CHUNK + 10)]

    writer.generate([prompt], GREEDY)
    connector_of(writer).wait_idle()
    reader = replica(pool)
    restored = reader.generate([prompt], GREEDY)[0]

    # The pool is full of the prompt's first chunks; the rest was dropped, not the head.
    assert restored.pool_hit_tokens == fits * CHUNK
    assert connector_of(writer).counters["store_dropped_pages"] == 2 * fits - fits
