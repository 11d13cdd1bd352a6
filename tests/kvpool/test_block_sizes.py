"""A pool restore answers as a recompute at every KV block size up to the pool's chunk.

The engine's blocks and the pool's chunks are independent sizes: a chunk of 256 tokens is
16 blocks of 16, or one block of 256. A long-context replica may take large blocks, which
cut the host's per-block work (hashing, allocating, registering, releasing) of a 131k-token
restore 16-fold; the restore must then still bring every byte of every block it covers.
A plan that shifts the blocks by one fails here at every size; one that swaps whole chunks
would not (the new tokens' attention does not see the order of the prefix's keys), which
only a comparison of the blocks' bytes catches (kvshare.validate).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvshare import LLM, SamplingParams
from kvshare.engine.llm_engine import RequestOutput
from kvshare.kvpool.connector import PoolConnector
from kvshare.kvpool.launch import PoolProcess
from tests.kvpool.pool_fixture import PoolFactory

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)
PROMPT = [random.Random(5).randrange(3, 512) for _ in range(1040)]  # 4 chunks of 256 + 16


@pytest.fixture
def pool() -> Iterator[PoolProcess]:
    factory = PoolFactory()
    yield factory.start(factory.config(size_bytes=64 << 20, slab_bytes=4 << 20))
    factory.close()


def ask(llm: LLM, connector: PoolConnector) -> RequestOutput:
    out = llm.generate([PROMPT], PARAMS)[0]
    connector.wait_idle()
    return out


@pytest.mark.parametrize("model", ["shape:tiny-qwen3.5", "shape:tiny-llama"])
@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_a_restore_at_each_block_size_answers_as_the_recompute(
    pool: PoolProcess, model: str, block_size: int
) -> None:
    llm = LLM(
        model,
        device="cpu",
        dtype="float32",
        kv_pool=pool.address,
        kv_cache_memory=16 << 20,
        max_num_batched_tokens=512,
        block_size=block_size,
    )
    connector = llm.engine.connector
    assert isinstance(connector, PoolConnector)
    computed = ask(llm, connector)  # stores the prefix's chunks (and the state) in the pool
    assert computed.pool_hit_tokens == 0
    llm.engine.reset_prefix_cache()  # another replica's view: the prefix is in the pool only
    restored = ask(llm, connector)
    assert restored.pool_hit_tokens == 1024 and restored.gpu_hit_tokens == 0
    assert restored.token_ids == computed.token_ids
    assert max(abs(a - b) for a, b in zip(restored.logprobs, computed.logprobs)) < 1e-3
    connector.close()
