"""A hybrid model's pool needs two slabs: its KV pages and its state pages differ in size,
a slab holds one size, and a restore needs both. With one slab each store evicts the other
size, so nothing is ever restored; the replica says so when it connects."""

from __future__ import annotations

import logging

import pytest

from kvshare.llm import LLM
from tests.kvpool.pool_fixture import MIB, PoolFactory

WARNING = "stores pages of two sizes (KV chunks and recurrent states) that then evict each other"


def warnings_at_start(
    pools: PoolFactory, caplog: pytest.LogCaptureFixture, model: str, slabs: int
) -> list[str]:
    pool = pools.start(pools.config(size_bytes=slabs * 4 * MIB, slab_bytes=4 * MIB))
    with caplog.at_level(logging.WARNING, logger="kvshare.kvpool.connector"):
        LLM(model, dtype="float32", kv_pool=pool.address, kv_cache_memory=4 * MIB)
    return [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]


def test_a_hybrid_model_on_a_pool_of_one_slab_is_told_at_start(
    pools: PoolFactory, caplog: pytest.LogCaptureFixture
) -> None:
    (line,) = warnings_at_start(pools, caplog, "shape:tiny-qwen3.5", slabs=1)
    assert "has 1 slab of 4 MiB" in line and "at least two slabs" in line


@pytest.mark.parametrize(("model", "slabs"), [("shape:tiny-qwen3.5", 2), ("shape:tiny-llama", 1)])
def test_two_slabs_or_one_page_size_need_no_warning(
    pools: PoolFactory, caplog: pytest.LogCaptureFixture, model: str, slabs: int
) -> None:
    assert warnings_at_start(pools, caplog, model, slabs) == []
