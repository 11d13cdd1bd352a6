"""Sampler: greedy, temperature, top-k, top-p, per-request seeds; SamplingParams checks."""

from __future__ import annotations

import pytest
import torch

from kvshare.engine.config import EngineConfig
from kvshare.engine.llm_engine import LLMEngine
from kvshare.engine.sampler import sample
from kvshare.engine.sampling_params import SamplingParams
from kvshare.models.loader import load_model


def draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    """n samples of one distribution (one row per sample, one shared generator)."""
    gen = torch.Generator().manual_seed(seed)
    return sample(logits.expand(n, -1).contiguous(), [params] * n, [None] * n, gen)


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:
    return torch.randn(8, 300, generator=torch.Generator().manual_seed(0))


def test_greedy_is_argmax(logits: torch.Tensor) -> None:
    params = [SamplingParams(temperature=0.0)] * len(logits)
    out = sample(logits, params, [None] * len(logits), torch.Generator().manual_seed(1))
    assert out == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 7.0, 100.0])
def test_top_k_1_is_greedy_at_any_temperature(logits: torch.Tensor, temperature: float) -> None:
    for row in logits:
        assert set(draw(row, SamplingParams(temperature=temperature, top_k=1), 20)) == {
            int(row.argmax())
        }


@pytest.mark.parametrize("temperature", [1.0, 100.0])
def test_tiny_top_p_is_greedy(logits: torch.Tensor, temperature: float) -> None:
    for row in logits:
        assert set(draw(row, SamplingParams(temperature=temperature, top_p=1e-6), 20)) == {
            int(row.argmax())
        }


def test_rows_that_cannot_be_sampled_are_none_and_the_others_are_drawn(
    logits: torch.Tensor,
) -> None:
    broken = logits.clone()
    broken[1] = float("nan")
    broken[3, 7] = float("inf")
    broken[5] = float("-inf")
    params = [
        SamplingParams(seed=1),
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=1e-30),
        SamplingParams(top_k=3),
    ]
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    out = sample(broken[:6], params, gens, torch.Generator().manual_seed(0))
    assert out[1] is None and out[3] is None and out[5] is None
    assert out[2] == int(logits[2].argmax()) and out[4] == int(logits[4].argmax())
    assert out[0] is not None


def test_smallest_top_p_keeps_the_top_token_at_the_lowest_temperature(logits: torch.Tensor) -> None:
    for row in logits:
        params = SamplingParams(temperature=1e-5, top_p=1.2e-38)
        assert set(draw(row, params, 5)) == {int(row.argmax())}


def test_top_k_keeps_exactly_the_k_largest() -> None:
    # Nearly flat, so every kept id is drawn often and a leak would show.
    row = torch.linspace(0.0, 0.5, 50)[
        torch.randperm(50, generator=torch.Generator().manual_seed(2))
    ]
    top5 = set(row.topk(5).indices.tolist())
    assert set(draw(row, SamplingParams(top_k=5), 600)) == top5
    # top_k 0 and -1 disable the filter: ids outside the top 5 appear.
    for k in (0, -1):
        assert not set(draw(row, SamplingParams(top_k=k), 600)) <= top5


def test_top_p_keeps_the_smallest_nucleus() -> None:
    row = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert set(draw(row, SamplingParams(top_p=0.7), 500)) == {0, 1}
    assert set(draw(row, SamplingParams(top_p=0.9), 500)) == {0, 1, 2}
    assert set(draw(row, SamplingParams(top_p=1.0), 2000)) == {0, 1, 2, 3}
    # Combined with top-k: the stricter one wins.
    assert set(draw(row, SamplingParams(top_p=0.9, top_k=2), 500)) == {0, 1}


def test_temperature_sharpens_and_flattens() -> None:
    row = torch.tensor([2.0, 1.0, 0.0])
    cold = draw(row, SamplingParams(temperature=0.05), 300)
    hot = draw(row, SamplingParams(temperature=50.0), 300)
    assert cold.count(0) == 300
    assert min(hot.count(i) for i in range(3)) > 60  # ~100 each


def test_seeded_row_ignores_its_neighbours(logits: torch.Tensor) -> None:
    p = SamplingParams(seed=11)
    alone = sample(
        logits[:1], [p], [torch.Generator().manual_seed(11)], torch.Generator().manual_seed(0)
    )
    batched = sample(
        logits,
        [p] + [SamplingParams()] * 7,
        [torch.Generator().manual_seed(11)] + [None] * 7,
        torch.Generator().manual_seed(5),
    )
    assert batched[0] == alone[0]


# ---- per-request seeds through the engine ----------------------------------------------


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    loaded = load_model("shape:tiny-llama", dtype="float32", seed=5)
    return LLMEngine(loaded, EngineConfig(kv_cache_memory=1 << 20, max_num_batched_tokens=64))


def generate(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, tuple[int, ...]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        if not engine.has_unfinished():
            return done
    raise AssertionError("did not finish")


def test_seeded_request_is_the_same_alone_or_batched(engine: LLMEngine) -> None:
    prompt = list(range(3, 23))
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = generate(engine, {"a": (prompt, params)})["a"]
    batched = generate(
        engine,
        {
            "x": (
                list(range(40, 90)),
                SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True),
            ),
            "a": (prompt, params),
            "y": (
                list(range(7, 12)),
                SamplingParams(max_tokens=5, temperature=0.8, seed=9, ignore_eos=True),
            ),
            "z": (
                list(range(100, 130)),
                SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True),
            ),
        },
    )["a"]
    assert batched == alone
    assert len(set(alone)) > 1  # really sampled, not a constant


def test_different_seeds_give_different_tokens(engine: LLMEngine) -> None:
    prompt = list(range(3, 23))
    outs = generate(
        engine,
        {
            f"s{seed}": (prompt, SamplingParams(max_tokens=16, seed=seed, ignore_eos=True))
            for seed in (1, 2, 3)
        },
    )
    assert len(set(outs.values())) == 3


def test_unseeded_requests_draw_from_the_engine_generator(engine: LLMEngine) -> None:
    prompt = list(range(3, 23))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    outs = generate(engine, {"u1": (prompt, params), "u2": (prompt, params)})
    assert outs["u1"] != outs["u2"]


# ---- SamplingParams validation ---------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"max_tokens": -3}, "max_tokens must be an integer >= 1"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer >= 1"),
        ({"temperature": -0.1}, "temperature must be in"),
        ({"temperature": float("nan")}, "temperature must be in"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.01}, r"top_p must be in \(0, 1\]"),
        ({"temperature": 1e-300}, r"temperature must be 0 \(greedy\) or at least 1e-05"),
        ({"temperature": 1e-6}, r"temperature must be 0 \(greedy\) or at least 1e-05"),
        ({"top_p": 1e-46}, "top_p must be at least 1.18e-38"),
        ({"top_logprobs": 21}, r"top_logprobs must be in \[0, 20\]"),
        ({"top_k": -2}, "top_k must be"),
        ({"stop": ""}, "stop strings must be non-empty"),
        ({"stop": ["ok", ""]}, "stop strings must be non-empty"),
    ],
)
def test_invalid_sampling_params_raise(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_sampling_params_normalize() -> None:
    p = SamplingParams(stop="END", stop_token_ids=[5, 6])  # type: ignore[arg-type]
    assert p.stop == ("END",) and p.stop_token_ids == (5, 6)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")  # type: ignore[arg-type]
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams().greedy
