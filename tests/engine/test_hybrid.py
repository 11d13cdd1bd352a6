"""The engine runs the Qwen3.5 hybrid (Gated DeltaNet + gated attention) like HF does.

Logits and 32 greedy tokens match HF transformers on the same weights (float32, CPU) for
one prompt, a batch of different lengths, a prompt longer than the prefill chunk, and a
prompt whose prefix resumes from a GPU-local state snapshot; prefill steps end on the
snapshot boundaries; a prefix without a snapshot at its end is never reused; a request
sharing a running request's prefix waits for a snapshot there instead of computing it.
"""

from __future__ import annotations

import random

import pytest

from kvshare import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy, hf_last_logits, hf_model_for
from tests.engine.test_parity import engine_last_logits, rel_error

GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.fixture(scope="module")
def hybrid() -> tuple[LLM, object]:
    llm = LLM(
        "shape:tiny-qwen3.5",
        dtype="float32",
        max_num_batched_tokens=48,
        weights_seed=5,
        snapshot_interval_tokens=64,
    )
    return llm, hf_model_for(llm.loaded.model)


def test_hybrid_logits_match_hf(hybrid: tuple[LLM, object]) -> None:
    llm, hf = hybrid
    for n in (1, 40, 130):
        seq_prompt = prompt(n, n)
        assert rel_error(engine_last_logits(llm, seq_prompt), hf_last_logits(hf, seq_prompt)) < 1e-4


def test_hybrid_greedy_single_batch_and_chunked(hybrid: tuple[LLM, object]) -> None:
    llm, hf = hybrid
    prompts = [prompt(2, 150), prompt(3, 7), prompt(4, 61)]
    assert len(prompts[0]) > llm.config.max_num_batched_tokens
    for p, out in zip(prompts, llm.generate(prompts, GREEDY_32)):
        assert list(out.token_ids) == hf_greedy(hf, p, 32)


def test_hybrid_resumes_from_a_state_snapshot(hybrid: tuple[LLM, object]) -> None:
    llm, hf = hybrid
    shared = prompt(5, 300)
    llm.generate([shared + prompt(6, 5)], GREEDY_32)
    follow_up = shared + prompt(7, 20)
    out = llm.generate([follow_up], GREEDY_32)[0]
    # Snapshot boundaries are 256-token chunk boundaries: the shared 300 tokens hold one,
    # snapshotted while the first request was prefilled.
    assert out.gpu_hit_tokens == 256
    assert list(out.token_ids) == hf_greedy(hf, follow_up, 32)


def test_no_reuse_without_a_snapshot(hybrid: tuple[LLM, object]) -> None:
    llm, _ = hybrid
    llm.engine.reset_prefix_cache()
    shared = prompt(8, 200)  # under one chunk: no boundary, no snapshot
    llm.generate([shared + prompt(9, 3)], GREEDY_32)
    out = llm.generate([shared + prompt(10, 3)], GREEDY_32)[0]
    assert out.gpu_hit_tokens == 0


def test_a_request_waits_for_the_snapshot_a_running_request_is_told_to_take(
    hybrid: tuple[LLM, object],
) -> None:
    """b shares a's first 300 tokens and arrives with it. a's own snapshots are at its last
    chunk boundary (512) only; b waits while a computes the shared part, a is told to
    snapshot at 256 (the last chunk boundary b shares), and b resumes there: the shared
    prefix is computed once, and both answer as HF does."""
    _, hf = hybrid
    llm = LLM("shape:tiny-qwen3.5", dtype="float32", max_num_batched_tokens=48, weights_seed=5)
    shared = prompt(11, 300)
    a, b = shared + prompt(12, 300), shared + prompt(13, 30)
    outs = llm.generate([a, b], GREEDY_32)
    assert (outs[0].gpu_hit_tokens, outs[0].computed_tokens) == (0, len(a))
    assert (outs[1].gpu_hit_tokens, outs[1].computed_tokens) == (256, len(b) - 256)
    assert llm.engine.scheduler.counters["local_waits"] == 1
    for p, out in zip((a, b), outs):
        assert list(out.token_ids) == hf_greedy(hf, p, 32)


@pytest.mark.cuda
def test_a_resumed_step_is_queued_without_waiting_for_the_device() -> None:
    """After a pool restore the step's stream waits for the copy, and the host must queue
    the whole step meanwhile: no call in the forward pass may synchronize (a linear layer
    that did would hold the host until the copy ended and then issue the rest behind the
    GPU). A resume from a GPU-local snapshot stands in for the restore, a sleep on the
    stream for the copy; the step still computes what it computed synchronously."""
    import torch

    llm = LLM(
        "shape:tiny-qwen3.5",
        device="cuda",
        dtype="bfloat16",
        kv_cache_memory=64 << 20,
        weights_seed=5,
        snapshot_interval_tokens=64,
    )
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    context = prompt(11, 256)
    llm.generate(context + prompt(12, 8), greedy)
    (expected,) = llm.generate(context + prompt(13, 32), greedy)
    assert expected.gpu_hit_tokens == 256
    runner = llm.engine.runner
    execute, busy = runner.execute, []

    def queued_behind_a_busy_stream(chunks: list) -> object:
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU cycles ahead of the step
        torch.cuda.set_sync_debug_mode("error")
        try:
            return execute(chunks)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            busy.append(not torch.cuda.current_stream().query())

    runner.execute = queued_behind_a_busy_stream
    (resumed,) = llm.generate(context + prompt(13, 32), greedy)
    assert resumed.gpu_hit_tokens == 256 and resumed.token_ids == expected.token_ids
    assert busy and all(busy), busy
