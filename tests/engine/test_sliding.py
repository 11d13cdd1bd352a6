"""Sliding-window layers hold only their window: outputs equal a full-length cache.

The reference is the dense test context (every layer keeps every key, unpaged). The
engine runs tiny-gemma3 (window 64, blocks of 16) with prompts of several windows, in
steps of 48 tokens, and is compared token by token (greedy) and by log-probabilities:
long prompts, decode past the window, GPU prefix hits with and without the window's
sliding blocks still cached, preemption, and the count of sliding blocks a sequence
holds. Pool restores are covered by tests/kvpool/test_cross_process.py.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvshare import LLM, SamplingParams
from kvshare.engine.block_manager import block_hashes
from kvshare.engine.llm_engine import LLMEngine
from kvshare.engine.memory import sliding_block_bounds
from tests.models.dense_context import DenseContext, greedy

WINDOW, BS, STEP = 64, 16, 48
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)


def make_llm(**options: object) -> LLM:
    config = {"max_num_batched_tokens": STEP, "max_model_len": 1024} | options
    return LLM("shape:tiny-gemma3", dtype="float32", weights_seed=7, **config)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm()


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def reference(llm: LLM, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Greedy tokens and the first token's log-probability with a full-length cache."""
    ctx = DenseContext(llm.loaded.config, torch.float32)
    last, tokens = greedy(llm.loaded.model, ctx, prompt, n, pieces=[STEP] * (len(prompt) // STEP))
    return tokens, torch.log_softmax(last.float(), -1)[tokens[0]].item()


def assert_matches_reference(llm: LLM, prompt: list[int], out: object) -> None:
    tokens, logprob = reference(llm, prompt, len(out.token_ids))  # type: ignore[attr-defined]
    assert list(out.token_ids) == tokens  # type: ignore[attr-defined]
    assert out.logprobs[0] == pytest.approx(logprob, abs=1e-4)  # type: ignore[attr-defined]


def held_bound(num_new_tokens: int) -> int:
    """Sliding blocks a sequence may hold in a step of n tokens (engine.sliding)."""
    return math.ceil((WINDOW - 1 + num_new_tokens) / BS) + 1


def held_sliding_blocks(engine: LLMEngine) -> int:
    assert engine.sliding is not None
    return sum(r > 0 for r in engine.sliding.blocks.ref_count)


def test_long_prompt_and_decode_past_the_window_equal_a_full_length_cache(llm: LLM) -> None:
    prompt = prompt_of(1, 300)  # 4.7 windows, 7 steps of prefill; 80 tokens of decode
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True, logprobs=1)
    out = llm.generate([prompt], params)[0]
    assert out.computed_tokens == 300
    assert_matches_reference(llm, prompt, out)


def test_a_sequence_holds_only_its_window_and_step_of_sliding_blocks(llm: LLM) -> None:
    engine = llm.engine
    engine.reset_prefix_cache()
    engine.add_request("long", prompt_of(2, 400), GREEDY)
    most = 0
    while engine.has_unfinished():
        running = list(engine.scheduler.running)
        engine.step()
        if running and not running[0].is_finished:
            seq = running[0]
            assert engine.sliding is not None
            held = engine.sliding.num_held(seq.sliding_table)
            assert held <= held_bound(STEP), (seq.num_computed_tokens, held)
            assert held_sliding_blocks(engine) <= held_bound(STEP)
            most = max(most, held)
            # The global table keeps the whole context.
            assert len(seq.block_table) == -(-seq.num_computed_tokens // BS)
    assert 0 < most <= held_bound(STEP) < 400 // BS


def test_gpu_prefix_hit_uses_the_cached_window(llm: LLM) -> None:
    llm.engine.reset_prefix_cache()
    shared = prompt_of(3, 200)
    llm.generate([shared + prompt_of(4, 9)], GREEDY)
    prompt = shared + prompt_of(5, 23)
    out = llm.generate([prompt], GREEDY)[0]
    assert out.gpu_hit_tokens == 192  # whole blocks of the shared prefix
    assert_matches_reference(llm, prompt, out)


def test_a_prefix_whose_window_was_evicted_is_not_a_hit() -> None:
    """Few sliding blocks, many global ones: another request reuses every sliding block
    of the first one's window while its global blocks stay cached. The second request
    must not resume where its window is gone."""
    llm = make_llm(max_num_seqs=1)
    engine = llm.engine
    assert engine.sliding is not None
    sliding_blocks = engine.sliding.blocks.num_blocks
    assert sliding_blocks == sliding_block_bounds(llm.loaded.config, llm.config, None)[1]
    assert engine.blocks.num_blocks > 3 * sliding_blocks
    shared = prompt_of(6, 200)
    llm.generate([shared + prompt_of(7, 9)], GREEDY)
    llm.generate([prompt_of(8, 300)], GREEDY)  # cycles through every sliding block
    prompt = shared + prompt_of(9, 23)
    # The global blocks of the shared prefix are still cached; their window is not.
    assert len(engine.blocks.match_prefix(block_hashes(prompt, BS))) == 200 // BS
    out = llm.generate([prompt], GREEDY)[0]
    assert out.gpu_hit_tokens < 192
    assert_matches_reference(llm, prompt, out)


def test_preempted_sequences_recompute_to_the_same_tokens() -> None:
    """Sliding blocks for one sequence's window and step and a little more: four
    sequences contend for them, the later ones are preempted and recomputed."""
    llm = make_llm(max_num_seqs=4, kv_cache_memory=500 << 10)
    engine = llm.engine
    assert engine.sliding is not None
    fewest = sliding_block_bounds(llm.loaded.config, llm.config, None)[0]
    assert fewest <= engine.sliding.blocks.num_blocks < 2 * fewest
    prompts = [prompt_of(10 + i, 150 + 10 * i) for i in range(4)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    preemptions, outs = 0, {}
    while engine.has_unfinished():
        preemptions = max([preemptions] + [r.seq.num_preemptions for r in engine.requests.values()])
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert preemptions > 0
    for i, prompt in enumerate(prompts):
        assert_matches_reference(llm, prompt, outs[str(i)])
