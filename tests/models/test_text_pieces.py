"""A long text encoded in pieces gives the ids of the whole, for every tokenizer we cut."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer

from kvshare.models import text_pieces
from kvshare.models.text_pieces import cut_points, encode_in_pieces, last_cut, splits_safely
from kvshare.models.tokenizer import Tokenizer

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


def _byte_level(use_regex: bool) -> dict[str, Any]:
    return {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": use_regex,
    }


def _split_then_bytes(pattern: str) -> dict[str, Any]:
    split = {
        "type": "Split",
        "pattern": {"Regex": pattern},
        "behavior": "Isolated",
        "invert": False,
    }
    return {"type": "Sequence", "pretokenizers": [split, _byte_level(use_regex=False)]}


# The pre-tokenizers of the family we cut: SmolLM2's own (digits, then GPT-2's regex), GPT-2's,
# Qwen 2's and Llama 3's; each over SmolLM2's vocabulary and merges.
PRE_TOKENIZERS = {
    "smollm2": None,
    "gpt2": _byte_level(use_regex=True),
    "qwen2": _split_then_bytes(QWEN2_SPLIT),
    "llama3": _split_then_bytes(LLAMA3_SPLIT),
}
NFC = {"type": "NFC"}  # Qwen 2's normalizer

# Pieces every tokenizer treats on its own: whitespace runs of each kind and CJK marks after
# letters, numbers or other marks (the cuts' hard cases), letters of several scripts, digits,
# contractions, punctuation, added tokens, and characters whitespace to Python but not to
# the tokenizers' regexes (U+001C-U+001F).
FRAGMENTS = [
    " ", "\u2009", "  ", "\t", "\n", "\r\n", " \n", "\u00a0", "\u3000", "\u2028", "\x1c",
    "\x1f", "a", "word", "Café", "naïve", "e\u0301", "\u0301", "\u0308\u0323", "\u212b",
    "\u1e0b\u0323", "中文", "日本語", "한국어", "😀", "👨‍👩‍👧", "1", "42", "2024", "½", "Ⅷ",
    "'s", "'ll", "I'm", "don't", ".", ",", "...", "$", "(", ")", "-", "#", "_", "<|im_start|>",
    "<|im_end|>", "<|endoftext|>", "<|im_startx|>", "，", "。", "、", "！", "？", "；", "：",
    "」", "你好", "世界", "一二三",
]  # fmt: skip
texts = st.lists(st.sampled_from(FRAGMENTS), max_size=60).map("".join)


def _backend_with(base: BackendTokenizer, **changes: Any) -> BackendTokenizer:
    spec = json.loads(base.to_str())
    for key, value in changes.items():
        if value is not None:
            spec[key] = value
    return BackendTokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module")
def backends(smollm2_tokenizer: Tokenizer) -> dict[str, BackendTokenizer]:
    base = smollm2_tokenizer.backend
    out = {name: _backend_with(base, pre_tokenizer=p) for name, p in PRE_TOKENIZERS.items()}
    out["qwen2-nfc"] = _backend_with(out["qwen2"], normalizer=NFC)
    return out


@pytest.fixture(scope="module")
def bos_eos_backend(smollm2_tokenizer: Tokenizer) -> BackendTokenizer:
    """SmolLM2's tokenizer putting <|im_start|> before a sequence and <|im_end|> after it."""
    processor = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "<|im_end|>", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            name: {
                "id": name,
                "ids": [smollm2_tokenizer.backend.token_to_id(name)],
                "tokens": [name],
            }
            for name in ("<|im_start|>", "<|im_end|>")
        },
    }
    return _backend_with(smollm2_tokenizer.backend, post_processor=processor)


@pytest.mark.parametrize("name", [*PRE_TOKENIZERS, "qwen2-nfc"])
@settings(max_examples=300, deadline=None)
@given(text=texts, pieces=st.integers(2, 12))
def test_pieces_give_the_ids_of_the_whole(
    backends: dict[str, BackendTokenizer], name: str, text: str, pieces: int
) -> None:
    backend = backends[name]
    assert splits_safely(backend)
    whole = backend.encode(text, add_special_tokens=False).ids
    assert encode_in_pieces(backend, text, pieces, add_special_tokens=False) == whole


@settings(max_examples=100, deadline=None)
@given(text=texts, pieces=st.integers(2, 12))
def test_special_tokens_go_around_the_whole(
    bos_eos_backend: BackendTokenizer, text: str, pieces: int
) -> None:
    whole = bos_eos_backend.encode(text, add_special_tokens=True).ids
    assert encode_in_pieces(bos_eos_backend, text, pieces, add_special_tokens=True) == whole


def test_a_cut_comes_before_a_space_after_a_non_space() -> None:
    text = "one  two\tthree \nfour five"
    cuts = cut_points(text, len(text))
    assert cuts == [i for i in range(1, len(text)) if text[i] == " " and not text[i - 1].isspace()]
    assert cuts == [3, 14, 20]
    assert cut_points("中文" * 100, 8) == []  # no space: one piece
    assert cut_points("x" * 10_000 + " y", 2) == []  # none within SEARCH_CHARS of the half
    assert last_cut(text, 0) == 20 and last_cut(text, 20) is None
    assert last_cut("a  ", 0) == 1 and last_cut(" " * 9, 0) is None
    assert last_cut("a b" + "c" * text_pieces.SEARCH_CHARS, 0) is None  # too far back
    chinese = "中文分词，你好世界！一二三。_，。，x"
    marks = [i for i, c in enumerate(chinese) if c in text_pieces.CJK_MARKS]
    # Before a mark after a letter or number; never after "_" or another mark.
    assert cut_points(chinese, len(chinese)) == [m for m in marks if chinese[m - 1].isalnum()]
    assert cut_points(chinese, len(chinese)) == [4, 9, 13]
    assert last_cut(chinese, 0) == 13


def test_a_long_text_is_cut_into_one_piece_per_core(
    smollm2_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = " ".join(f"word{i} and, more: text" for i in range(6000))
    monkeypatch.setattr(text_pieces.os, "sched_getaffinity", lambda pid: set(range(4)))
    assert text_pieces.piece_count(len(text)) == 4
    assert text_pieces.piece_count(text_pieces.PIECE_CHARS * 2 - 1) == 1
    assert len(cut_points(text, 4)) == 3
    encoded = _spy(monkeypatch, "encode_in_pieces")
    ids = smollm2_tokenizer.encode(text)
    assert encoded == [4]
    assert ids == smollm2_tokenizer.backend.encode(text, add_special_tokens=False).ids
    messages = [{"role": "user", "content": text}]
    rendered = smollm2_tokenizer.apply_chat_template(messages)
    assert smollm2_tokenizer.encode_chat(messages) == smollm2_tokenizer.backend.encode(rendered).ids
    assert encoded == [4, 4]


def _spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Records the piece count of each call of kvshare.models.tokenizer's `name`."""
    import kvshare.models.tokenizer as module

    calls: list[int] = []
    real: Callable[..., list[int]] = getattr(module, name)

    def spy(backend: BackendTokenizer, text: str, pieces: int, add: bool) -> list[int]:
        calls.append(pieces)
        return real(backend, text, pieces, add)

    monkeypatch.setattr(module, name, spy)
    return calls


def _normalized(spec: dict[str, Any]) -> None:
    spec["normalizer"] = {"type": "NFKC"}  # not NFC: not checked, so never cut


def _metaspace(spec: dict[str, Any]) -> None:
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"}


def _unchecked_regex(spec: dict[str, Any]) -> None:
    spec["pre_tokenizer"] = _split_then_bytes(r"\s+|\S+")


def _prefix_space(spec: dict[str, Any]) -> None:
    spec["pre_tokenizer"] = {**_byte_level(use_regex=True), "add_prefix_space": True}


def _added_token_with_space(spec: dict[str, Any]) -> None:
    token = {**spec["added_tokens"][1], "id": len(spec["model"]["vocab"]), "content": "<| x |>"}
    spec["added_tokens"].append(token)


def _added_token_stripping(spec: dict[str, Any]) -> None:
    spec["added_tokens"][1]["lstrip"] = True


def _added_token_with_a_cjk_mark(spec: dict[str, Any]) -> None:
    token = {**spec["added_tokens"][1], "id": len(spec["model"]["vocab"]), "content": "<|一，|>"}
    spec["added_tokens"].append(token)


@pytest.mark.parametrize(
    "change",
    [
        _normalized,
        _metaspace,
        _unchecked_regex,
        _prefix_space,
        _added_token_with_space,
        _added_token_stripping,
        _added_token_with_a_cjk_mark,
    ],
)
def test_other_tokenizers_are_never_cut(
    smollm2_tokenizer: Tokenizer,
    monkeypatch: pytest.MonkeyPatch,
    change: Callable[[dict[str, Any]], None],
) -> None:
    spec = json.loads(smollm2_tokenizer.backend.to_str())
    change(spec)
    backend = BackendTokenizer.from_str(json.dumps(spec))
    assert not splits_safely(backend)
    encoded = _spy(monkeypatch, "encode_in_pieces")
    Tokenizer(backend).encode("some words " * 20_000)
    assert encoded == []
