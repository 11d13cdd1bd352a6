"""Parity with HF transformers on the same weights (float32, CPU).

Last-token logits within 1e-4 relative error, and 32 greedy tokens identical, for: one
prompt, a batch of prompts of different lengths, a prompt longer than the prefill chunk,
and a prompt whose prefix is already in the GPU-local prefix cache.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvshare import LLM, SamplingParams
from kvshare.engine.scheduler import ScheduledChunk
from kvshare.engine.sequence import Sequence
from tests.engine.hf_reference import hf_greedy, hf_last_logits, hf_model_for

GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
FAMILIES = ["shape:tiny-llama", "shape:tiny-qwen3", "shape:tiny-gemma3"]


def engine_last_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Last-token logits through the engine's runner and paged cache (one prefill; hybrid
    models get a fresh recurrent-state slot)."""
    engine, states = llm.engine, llm.engine.runner.states
    seq = Sequence("logits-probe", list(prompt), SamplingParams())
    seq.block_table = engine.blocks.allocate(engine.blocks.blocks_needed(len(prompt)))
    seq.state_slot = states.allocate() if states is not None else None
    if engine.sliding is not None:
        engine.sliding.extend(seq.sliding_table, len(seq.block_table), 0)
    try:
        logits = engine.runner.execute([ScheduledChunk(seq, len(prompt))])
    finally:
        engine.blocks.release(seq.block_table)
        if engine.sliding is not None:
            engine.sliding.release(seq.sliding_table)
        if states is not None:
            states.release(seq.state_slot)
    assert logits is not None
    return logits[0]


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request: pytest.FixtureRequest) -> tuple[LLM, object]:
    llm = LLM(request.param, dtype="float32", max_num_batched_tokens=48, weights_seed=7)
    return llm, hf_model_for(llm.loaded.model)


def test_tiny_gemma3_window_is_shorter_than_the_prompts() -> None:
    from kvshare.models.presets import shape_preset

    assert shape_preset("tiny-gemma3").sliding_window == 64  # prompts below reach 150 tokens


def test_last_token_logits_match(tiny: tuple[LLM, object]) -> None:
    llm, hf = tiny
    rng = random.Random(1)
    for n in (1, 17, 150):
        prompt = random_prompt(rng, n, llm.loaded.config.vocab_size)
        assert rel_error(engine_last_logits(llm, prompt), hf_last_logits(hf, prompt)) < 1e-4


def test_greedy_single_prompt_longer_than_the_prefill_chunk(tiny: tuple[LLM, object]) -> None:
    llm, hf = tiny
    prompt = random_prompt(random.Random(2), 150, llm.loaded.config.vocab_size)
    assert len(prompt) > llm.config.max_num_batched_tokens
    out = llm.generate([prompt], GREEDY_32)[0]
    assert list(out.token_ids) == hf_greedy(hf, prompt, 32)


def test_greedy_batch_of_different_lengths(tiny: tuple[LLM, object]) -> None:
    llm, hf = tiny
    rng = random.Random(3)
    prompts = [random_prompt(rng, n, llm.loaded.config.vocab_size) for n in (5, 33, 70, 101)]
    outs = llm.generate(prompts, GREEDY_32)
    for prompt, out in zip(prompts, outs):
        assert list(out.token_ids) == hf_greedy(hf, prompt, 32)


def test_greedy_with_prefix_in_gpu_local_cache(tiny: tuple[LLM, object]) -> None:
    llm, hf = tiny
    rng = random.Random(4)
    vocab = llm.loaded.config.vocab_size
    shared = random_prompt(rng, 96, vocab)
    llm.generate([shared + random_prompt(rng, 9, vocab)], GREEDY_32)
    prompt = shared + random_prompt(rng, 23, vocab)
    out = llm.generate([prompt], GREEDY_32)[0]
    assert out.gpu_hit_tokens == 96
    assert out.computed_tokens == len(prompt) - 96
    assert list(out.token_ids) == hf_greedy(hf, prompt, 32)


@pytest.fixture(scope="module")
def smollm2() -> tuple[LLM, object]:
    llm = LLM("smollm2-135m", dtype="float32", max_num_batched_tokens=32)
    return llm, hf_model_for(llm.loaded.model)


def test_smollm2_real_weights_match_hf(smollm2: tuple[LLM, object]) -> None:
    llm, hf = smollm2
    tok = llm.tokenizer
    chat = tok.encode_chat([{"role": "user", "content": "Name three colors of the rainbow."}])
    assert len(chat) > llm.config.max_num_batched_tokens
    assert rel_error(engine_last_logits(llm, chat), hf_last_logits(hf, chat)) < 1e-4
    prompts = [
        chat,
        tok.encode("The quick brown fox"),
        tok.encode_chat([{"role": "user", "content": "Hi"}]),
    ]
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY_32)):
        assert list(out.token_ids) == hf_greedy(hf, prompt, 32)
    # The chat prefix (system prompt) is now in the GPU-local cache.
    again = tok.encode_chat([{"role": "user", "content": "Name three animals."}])
    out = llm.generate([again], GREEDY_32)[0]
    assert out.gpu_hit_tokens > 0
    assert list(out.token_ids) == hf_greedy(hf, again, 32)


def test_smollm2_answers_a_chat_prompt_in_english(smollm2: tuple[LLM, object]) -> None:
    llm, _ = smollm2
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=48, temperature=0.0),
    )
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
