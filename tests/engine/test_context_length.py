"""--max-model-len is served as asked or refused at start, never cut silently."""

from __future__ import annotations

import pytest

from kvshare.engine.model_runner import context_length
from kvshare.llm import LLM


def test_unasked_the_context_is_the_models_capped_at_the_cache() -> None:
    assert context_length(None, 8192, 100_000) == 8192
    assert context_length(None, 131072, 4096) == 4096


def test_an_asked_context_is_served_or_refused_with_the_limit_it_passes() -> None:
    assert context_length(4096, 8192, 4096) == 4096
    with pytest.raises(ValueError, match=r"longer than the model's context \(8192 tokens\)"):
        context_length(8193, 8192, 100_000)
    with pytest.raises(ValueError, match=r"KV cache, which holds 4080 tokens.*--kv-cache-memory"):
        context_length(4096, 8192, 4080)


def test_an_engine_refuses_a_context_its_model_or_cache_cannot_hold() -> None:
    with pytest.raises(ValueError, match="longer than the model's context"):
        LLM(model="shape:tiny-qwen3.5", device="cpu", max_model_len=9000)
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        LLM(model="shape:tiny-qwen3.5", device="cpu", max_model_len=4096, kv_cache_memory=1 << 20)
    llm = LLM(model="shape:tiny-qwen3.5", device="cpu", max_model_len=2048)
    assert llm.engine.max_model_len == 2048
