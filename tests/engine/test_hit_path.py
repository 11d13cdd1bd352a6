"""The host's work on a long prompt, done once and out of the device's way: the prompt is
converted to int32 once (validation, block hashes and pool keys read that array; its list
of Python ints is built by the step that computes it, not before), and a step registers
its blocks and builds its outputs' prompt tuple before sampling waits for the device."""

from __future__ import annotations

import numpy as np
import pytest

import kvshare.engine.llm_engine as llm_engine
from kvshare.engine.config import EngineConfig
from kvshare.engine.llm_engine import LLMEngine
from kvshare.engine.sampling_params import SamplingParams
from kvshare.engine.sequence import Sequence
from kvshare.models.loader import load_model

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    loaded = load_model("shape:tiny-llama", dtype="float32", seed=5)
    return LLMEngine(loaded, EngineConfig(kv_cache_memory=1 << 20, max_num_batched_tokens=64))


def run(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[int, ...]:
    """The request's tokens, from a cold GPU-local cache."""
    engine.reset_prefix_cache()
    engine.add_request(request_id, prompt, GREEDY)
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            last = out
    assert last is not None and last.finished
    return last.token_ids


@pytest.mark.parametrize("bad", [[1, -1], [1, 512], [3, 2**31], [2**40, 5], [2**70]])
def test_prompts_outside_the_vocabulary_are_refused(engine: LLMEngine, bad: list[int]) -> None:
    """ids beyond int32 or int64 included: a ValueError (the server's 400), nothing queued."""
    assert engine.loaded.config.vocab_size == 512
    with pytest.raises(ValueError, match=r"must be in \[0, 512\)"):
        engine.add_request("bad", bad, GREEDY)
    assert "bad" not in engine.requests and not engine.has_unfinished()


def test_the_prompt_array_is_the_prompt(engine: LLMEngine) -> None:
    prompt = list(range(3, 40))
    engine.add_request("array", prompt, GREEDY)
    seq = engine.requests["array"].seq
    assert seq.prompt_array is not None and seq.prompt_array.dtype == np.int32
    assert seq.token_array().tolist() == prompt
    engine.abort("array")


def test_blocks_are_registered_before_sampling_waits_for_the_step(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host's bookkeeping of a step (registering the blocks of a long restored prefix)
    runs while the device computes it, not after sampling has waited for it."""
    prompt = list(range(100, 140))
    expected = run(engine, "reference", prompt)
    sample, registered = llm_engine.sample, []

    def recording(*args: object, **kwargs: object) -> list[int | None]:
        registered.append(engine.requests["ordered"].seq.num_registered_blocks)
        return sample(*args, **kwargs)

    monkeypatch.setattr(llm_engine, "sample", recording)
    assert run(engine, "ordered", prompt) == expected
    # The prompt's full blocks, before the first sample.
    assert registered[0] == len(prompt) // engine.config.block_size > 0


def test_the_prompt_tuple_is_built_before_sampling_waits_for_the_step(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = list(range(200, 240))
    expected = run(engine, "reference", prompt)
    sample, built = llm_engine.sample, []

    def recording(*args: object, **kwargs: object) -> list[int | None]:
        built.append(engine.requests["tuple"].prompt)
        return sample(*args, **kwargs)

    monkeypatch.setattr(llm_engine, "sample", recording)
    engine.reset_prefix_cache()
    engine.add_request("tuple", prompt, GREEDY)
    outputs = [out for _ in range(3) for out in engine.step()]
    assert built[0] == tuple(prompt)
    assert all(out.prompt_token_ids == tuple(prompt) for out in outputs)
    assert outputs[-1].finished and outputs[-1].token_ids == expected


def test_a_sequence_of_its_prompt_array_alone_is_the_sequence_of_its_list() -> None:
    """The engine's sequences get the prompt's array only; their token ids, counts, block
    hashes and appended tokens are those of a sequence given the list."""
    prompt = list(range(7, 47))
    from_list = Sequence("list", list(prompt), GREEDY)
    from_array = Sequence("array", None, GREEDY, prompt_array=np.asarray(prompt, np.int32))
    for seq in (from_list, from_array):
        assert (seq.num_prompt_tokens, seq.num_tokens, seq.output_token_ids) == (40, 40, [])
        assert seq.token_array().tolist() == prompt
        seq.update_block_hashes(16)
    assert from_array.block_hashes == from_list.block_hashes and len(from_list.block_hashes) == 2
    assert from_array.token_ids == from_list.token_ids == prompt
    from_array.token_ids.append(3)
    assert (from_array.num_tokens, from_array.output_token_ids) == (41, [3])
    assert from_array.token_array().tolist() == [*prompt, 3]
    with pytest.raises(ValueError, match="needs its prompt"):
        Sequence("none", None, GREEDY)
