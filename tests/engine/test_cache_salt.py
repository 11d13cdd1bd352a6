"""The offline API's `cache_salt`: `LLM.generate(..., cache_salt=...)` reuses the GPU-local
prefix cache (KV blocks, and the recurrent-state snapshots of a hybrid model) only within
one salt, and a salt never changes the answer."""

from __future__ import annotations

import random

import pytest

from kvshare import LLM, SamplingParams
from tests.kvpool.pool_fixture import PoolFactory, hybrid_replica

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("model", ["shape:tiny-llama", "shape:tiny-qwen3.5"])
def test_generate_shares_the_gpu_cache_within_a_salt_only(model: str) -> None:
    llm = LLM(model, dtype="float32", kv_cache_memory=8 << 20, max_num_batched_tokens=512)
    prompt = [random.Random(3).randrange(3, 512) for _ in range(300)]
    first = llm.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    assert first.gpu_hit_tokens == 0
    again = llm.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    assert again.gpu_hit_tokens > 0
    for salt in ("tenant-b", None):
        other = llm.generate([prompt], GREEDY, cache_salt=salt)[0]
        assert other.gpu_hit_tokens == 0, salt
        assert other.token_ids == first.token_ids == again.token_ids


@pytest.mark.parametrize("salt", ["", 7, "x" * 1025])
def test_a_malformed_salt_queues_nothing(salt: object) -> None:
    llm = LLM("shape:tiny-llama", kv_cache_memory=4 << 20)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([[5, 6, 7], [8, 9]], GREEDY, cache_salt=salt)  # type: ignore[arg-type]
    assert not llm.engine.has_unfinished()


def test_a_hybrid_models_pool_restore_keeps_to_its_salt() -> None:
    """KV pages and recurrent-state pages are both keyed under the request's salt: the same
    salt restores (which needs the state page too), another salt finds nothing."""
    pools = PoolFactory()
    try:
        pool = pools.start(pools.config(size_bytes=32 << 20, slab_bytes=4 << 20))
        llm, connector = hybrid_replica(pool)
        prompt = [random.Random(5).randrange(3, 512) for _ in range(300)]

        def pool_hit(salt: str | None) -> int:
            llm.engine.reset_prefix_cache()  # only the pool can help
            out = llm.generate([prompt], GREEDY, cache_salt=salt)[0]
            connector.wait_idle()
            return out.pool_hit_tokens

        assert pool_hit("tenant-a") == 0
        assert pool_hit("tenant-a") == 256
        assert pool_hit("tenant-b") == 0 and pool_hit(None) == 0
        connector.close()
    finally:
        pools.close()
