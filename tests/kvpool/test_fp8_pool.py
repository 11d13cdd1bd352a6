"""fp8 KV through the pool: pages carry the e4m3 bytes with their scales, a restore answers
as the recompute does, and fp8 and model-dtype replicas never share a page (the KV format
is part of the key namespace)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvshare import LLM, SamplingParams
from kvshare.engine.connector import KVCacheLayout
from kvshare.kvpool.launch import PoolProcess
from kvshare.kvpool.layout import PageLayout
from tests.kvpool.pool_fixture import PoolFactory
from tests.kvpool.test_cross_process import finish_engine, random_tokens, run_engine, start_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def pool() -> Iterator[PoolProcess]:
    factory = PoolFactory()
    yield factory.start(factory.config(size_bytes=256 << 20, slab_bytes=16 << 20))
    factory.close()


@pytest.fixture(scope="module")
def replicas(pool: PoolProcess) -> tuple[LLM, LLM]:
    """Two SmolLM2 replicas on one pool, both computing in float32 (the CPU's default): one
    keeps fp8 KV. No GPU-local prefix cache, so a replica's repeated prompt shows its own
    pool hits. (In bfloat16 the first answer token is a near tie, "The" -1.76 / "L" -2.01
    in log-probability, that fp8 KV tips either way: that measures SmolLM2, not the KV.)"""
    options = dict(
        dtype="float32",
        kv_pool=pool.address,
        require_kv_pool=True,
        chunk_tokens=16,
        kv_cache_memory=64 << 20,
        enable_prefix_caching=False,
    )
    return (
        LLM("smollm2-135m", kv_cache_dtype="fp8", **options),  # type: ignore[arg-type]
        LLM("smollm2-135m", **options),  # type: ignore[arg-type]
    )


def _stored(llm: LLM) -> tuple[int, int]:
    connector = llm.engine.connector
    assert connector is not None
    connector.wait_idle()
    stats = connector.stats()
    return stats.get("stored_pages", 0), stats.get("stored_bytes", 0)


def _ask(llm: LLM, question: str) -> tuple[str, int]:
    out = llm.chat([{"role": "user", "content": question}], GREEDY)
    return out.text, out.pool_hit_tokens


def _bfloat16_page_bytes(llm: LLM) -> int:
    """What a bfloat16 replica of this model stores per page (the same layout code)."""
    cache = KVCacheLayout.allocate(llm.loaded.config, 1, 16, torch.bfloat16, torch.device("cpu"))
    return PageLayout.of(cache, 16).payload_bytes


def test_an_fp8_replica_answers_paris_in_pages_of_at_most_055x_bfloat16s(
    replicas: tuple[LLM, LLM],
) -> None:
    fp8, exact = replicas
    text, _ = _ask(fp8, "What is the capital of France?")
    assert "Paris" in text
    pages, nbytes = _stored(fp8)
    assert pages > 0
    _ask(exact, "What is the capital of Italy?")
    exact_pages, exact_bytes = _stored(exact)
    assert exact_bytes / exact_pages == 2 * _bfloat16_page_bytes(exact)  # float32 pages
    ratio = (nbytes / pages) / _bfloat16_page_bytes(exact)
    assert ratio <= 0.55, ratio  # 68 bytes a row against 128 at head dim 64: 0.53


def test_fp8_and_model_dtype_replicas_get_no_hits_from_each_other(
    replicas: tuple[LLM, LLM],
) -> None:
    fp8, exact = replicas
    for first, second in ((fp8, exact), (exact, fp8)):
        # Plain text, not chat: the chat template's system prompt is in the pool already.
        river = "Egypt" if first is fp8 else "Brazil"
        text = f"Rivers of {river}, a short list for travellers. The longest river in {river} is"
        first.generate(text, GREEDY)
        _stored(first)  # committed before the other replica looks
        assert second.generate(text, GREEDY)[0].pool_hit_tokens == 0
        # The pages are there, and usable by a replica of the same format: a repeat hits.
        assert first.generate(text, GREEDY)[0].pool_hit_tokens > 0
    for llm in replicas:
        stats = llm.engine.connector.stats()  # type: ignore[union-attr]
        assert stats.get("checksum_failures", 0) == stats.get("header_failures", 0) == 0


@pytest.fixture(scope="module")
def big_pool() -> Iterator[PoolProcess]:
    factory = PoolFactory()
    yield factory.start(factory.config(size_bytes=1 << 30, slab_bytes=128 << 20))
    factory.close()


@pytest.mark.parametrize(
    "model, chunk, context",
    [
        ("shape:tiny-gemma3", 32, 301),  # window 64: earlier chunks restore global layers only
        ("shape:tiny-qwen3.5", 256, 600),  # hybrid: fp8 KV + the state in its own dtype
    ],
)
def test_a_fresh_process_restores_fp8_kv_as_its_recompute(
    big_pool: PoolProcess, tmp_path: Path, model: str, chunk: int, context: int
) -> None:
    prefix = random_tokens(context, context, 512)
    follow_up = prefix + random_tokens(context + 1, 29, 512)
    fp8 = ("--kv-cache-dtype", "fp8")
    reference = start_engine(tmp_path, model, [follow_up], None, chunk, "0", *fp8)
    run_engine(tmp_path, model, [prefix], big_pool.address, chunk, "1", *fp8)
    restored = run_engine(tmp_path, model, [follow_up], big_pool.address, chunk, "2", *fp8)
    without = finish_engine(reference)
    out, reference = restored["outputs"][0], without["outputs"][0]
    assert out["pool_hit"] == (context // chunk) * chunk
    assert out["token_ids"] == reference["token_ids"]
    assert max(abs(a - b) for a, b in zip(out["logprobs"], reference["logprobs"])) < 1e-4
    assert restored["stats"].get("checksum_failures", 0) == 0
