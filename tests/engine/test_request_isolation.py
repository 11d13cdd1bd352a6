"""One request's failure ends that request only: a row of logits that cannot be sampled
(NaN or inf, e.g. from an extreme temperature) fails its request, and the rest of the batch
finishes with exactly the tokens it produces without the fault."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvshare.engine.config import EngineConfig
from kvshare.engine.llm_engine import LLMEngine, RequestOutput
from kvshare.engine.sampling_params import SamplingParams
from kvshare.models.loader import load_model

VICTIM = "victim"
REQUESTS = {
    "greedy": (list(range(3, 40)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)),
    "seeded": (
        list(range(50, 70)),
        SamplingParams(
            max_tokens=8, temperature=0.9, seed=7, ignore_eos=True, logprobs=True, top_logprobs=3
        ),
    ),
    "top_p": (
        list(range(80, 95)),
        SamplingParams(max_tokens=8, top_p=0.5, seed=3, ignore_eos=True),
    ),
}


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    loaded = load_model("shape:tiny-llama", dtype="float32", seed=5)
    return LLMEngine(loaded, EngineConfig(kv_cache_memory=1 << 20, max_num_batched_tokens=64))


def run(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, RequestOutput]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done: dict[str, RequestOutput] = {}
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished():
            return done
    raise AssertionError("did not finish")


def poison(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, value: float, after_tokens: int
) -> None:
    """The victim's row of logits becomes `value` once it has generated `after_tokens`."""
    real = engine.runner.execute

    def execute(chunks: list[Any]) -> Any:
        logits = real(chunks).clone()
        for row, chunk in enumerate(c for c in chunks if c.samples):
            if chunk.seq.request_id == VICTIM and chunk.seq.num_output_tokens >= after_tokens:
                logits[row] = value
        return logits

    monkeypatch.setattr(engine.runner, "execute", execute)


@pytest.mark.parametrize(
    ("value", "temperature"), [(float("nan"), 1.0), (float("nan"), 0.0), (float("inf"), 0.7)]
)
def test_a_request_whose_logits_cannot_be_sampled_fails_alone(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, value: float, temperature: float
) -> None:
    reference = run(engine, REQUESTS)
    victim = (
        list(range(100, 130)),
        SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True),
    )
    poison(engine, monkeypatch, value, after_tokens=2)
    outputs = run(engine, {**REQUESTS, VICTIM: victim})
    failed = outputs.pop(VICTIM)
    assert failed.finish_reason == "error" and "cannot be sampled" in (failed.error or "")
    assert len(failed.token_ids) == 2  # what it produced before the fault stays reported
    for rid, out in outputs.items():
        assert out.error is None and out.finish_reason == "length", rid
        assert out.token_ids == reference[rid].token_ids, rid
    top = outputs["seeded"].top_logprobs
    assert len(top) == 8 and all(len(step) == 3 for step in top)
    assert engine.blocks.usage == 0.0  # the failed request's blocks were freed too


def test_a_failing_append_ends_only_its_request(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = run(engine, REQUESTS)
    real = engine._append_token

    def append(req: Any, token: int, now: float) -> RequestOutput:
        if req.seq.request_id == VICTIM and req.seq.num_output_tokens == 1:
            raise RuntimeError("injected fault")
        return real(req, token, now)

    monkeypatch.setattr(engine, "_append_token", append)
    victim = (list(range(100, 130)), SamplingParams(max_tokens=8, ignore_eos=True))
    outputs = run(engine, {**REQUESTS, VICTIM: victim})
    failed = outputs.pop(VICTIM)
    assert failed.finish_reason == "error" and "injected fault" in (failed.error or "")
    assert {rid: out.token_ids for rid, out in outputs.items()} == {
        rid: out.token_ids for rid, out in reference.items()
    }


def test_logprobs_come_from_the_raw_distribution(engine: LLMEngine) -> None:
    params = SamplingParams(
        max_tokens=4, temperature=0.5, seed=1, ignore_eos=True, logprobs=True, top_logprobs=5
    )
    out = run(engine, {"lp": (list(range(3, 20)), params)})["lp"]
    assert len(out.logprobs) == len(out.top_logprobs) == 4
    for token, logprob, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True) and len(top) == 5
        assert logprob <= values[0] + 1e-6
        if token in dict(top):
            assert dict(top)[token] == pytest.approx(logprob, abs=1e-5)
    # Raw distribution: the probabilities of the whole vocabulary sum to 1, so the top ones
    # hold at most that (they would sum higher after temperature 0.5 sharpened them).
    assert all(
        sum(torch.tensor([v for _, v in top]).exp().tolist()) <= 1 + 1e-5
        for top in out.top_logprobs
    )
