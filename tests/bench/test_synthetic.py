"""Synthetic prompts: exact token counts with the SmolLM2 tokenizer, unique and reproducible."""

from __future__ import annotations

import random

import pytest

from kvshare.bench.synthetic import PromptModel, exact_text, load_prompt_model, prompt_rng
from kvshare.models.tokenizer import Tokenizer

LENGTHS = [0, 1, 2, 3, 7, 31, 255, 256, 257, 511, 1000, 1024, 4095, 4096, 8193]


@pytest.mark.parametrize("length", LENGTHS)
def test_text_has_exactly_the_requested_token_count(smollm2: PromptModel, length: int) -> None:
    assert smollm2.tokenizer is not None
    for request in range(4):
        text = smollm2.prompt(length, prompt_rng(0, "t", length, request))
        assert isinstance(text, str)
        assert len(smollm2.tokenizer.encode(text)) == length
        assert (
            len(smollm2.tokenizer.encode(smollm2.tokenizer.decode(smollm2.tokenizer.encode(text))))
            == length
        )


class _TrailingSpaceTokenizer:
    """One id per character, except that a trailing space is dropped: a cut just after a space
    re-encodes one short, and a target at a space has no exact cut at all."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text.removesuffix(" ")]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


@pytest.mark.parametrize("length", range(0, 120))
def test_exact_count_when_cuts_re_encode_differently(length: int) -> None:
    tok = _TrailingSpaceTokenizer()
    text = exact_text(tok, length, prompt_rng(0, "fake", length))  # type: ignore[arg-type]
    assert len(tok.encode(text)) == length


def test_follow_up_keeps_the_context_ids_as_its_prefix(smollm2: PromptModel) -> None:
    tok = smollm2.tokenizer
    assert tok is not None
    for seed in range(30):
        rng = prompt_rng(seed, "follow")
        context, question = smollm2.prompt(300 + seed, rng), smollm2.prompt(20, rng)
        assert tok.encode(smollm2.follow_up(context, question))[: 300 + seed] == tok.encode(context)


def test_prompts_are_reproducible_and_unique_per_label(smollm2: PromptModel) -> None:
    a = smollm2.prompt(500, prompt_rng(0, "x", 0, 1))
    assert a == smollm2.prompt(500, prompt_rng(0, "x", 0, 1))
    others = {
        smollm2.prompt(500, prompt_rng(*labels))
        for labels in [(1, "x", 0, 1), (0, "x", 1, 1), (0, "x", 0, 2)]
    }
    assert a not in others and len(others) == 3


def test_models_without_a_tokenizer_get_token_ids() -> None:
    model = load_prompt_model("shape:tiny-llama")
    assert model.tokenizer is None and model.vocab_size == 512 and not model.has_chat_template
    ids = model.prompt(100, random.Random(0))
    assert isinstance(ids, list) and len(ids) == 100 and all(0 <= t < 512 for t in ids)
    assert model.follow_up(ids, [1, 2]) == [*ids, 1, 2]
    with pytest.raises(TypeError):
        model.follow_up(ids, "text")


def test_smollm2_has_a_chat_template_and_unknown_models_are_refused(smollm2: PromptModel) -> None:
    assert smollm2.has_chat_template and smollm2.vocab_size > 40000
    with pytest.raises(FileNotFoundError):
        load_prompt_model("no-such-model")
    with pytest.raises(ValueError, match="num_tokens"):
        exact_text(Tokenizer.__new__(Tokenizer), -1, random.Random(0))
