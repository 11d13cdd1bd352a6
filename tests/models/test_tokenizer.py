"""Tokenizer parity with Hugging Face for SmolLM2, built from the GGUF alone.

Two references, because transformers alone is not a faithful one here:

* transformers' GGUF tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) has no entry
  for llama.cpp's "smollm" pre-tokenizer and falls back to plain GPT-2 byte-level splitting. The
  real SmolLM2 tokenizer.json splits every digit off first (`SMOLLM2_PRE_TOKENIZER` below), and
  llama.cpp's "smollm" does the same. So we compare against transformers' tokenizer with its
  pre-tokenizer replaced by the tokenizer.json one: vocabulary, merges, special tokens and
  decoder still come from transformers' own reading of the file.
* an independent pure-Python port of llama.cpp's algorithm for "smollm" (regex split `\\p{N}`,
  then the GPT-2 regex, then rank-ordered BPE merges), which shares no code with `tokenizers`.

Unpatched transformers must still agree wherever the digit split changes no ids.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import regex
from tokenizers import Tokenizer as BackendTokenizer

from kvshare.models.tokenizer import IncrementalDetokenizer, Tokenizer

# The "pre_tokenizer" of HuggingFaceTB/SmolLM2-135M(-Instruct)'s tokenizer.json.
SMOLLM2_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}

CORPUS = [
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\n\nclass Foo:\n\tpass\n",
    "    if x == 12345:\n        y = 3.14 * 2e10 - 0x1F  # 007\n",
    "a  1  22   333\n 4\t5",
    "price: $1,000,000.99 (approx. 10%) on 2024-01-31",
    "1234567890" * 3,
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines\r\nand\n\n\nblank lines\n",
    "Café naïve résumé façade — “quotes” and ‘single’",
    "中文分词测试，你好世界！",
    "日本語のテキスト and 한국어 텍스트",
    "emoji: 😀👍🏽🇺🇸 ❤️ family 👨‍👩‍👧",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "special<|endoftext|>glued<repo_name>tokens<file_sep>",
    "<|im_start|> spaced <|im_end|>",
    "not special: <|im_startx|> <im_end> <|im_end",
    "mixed ½ ² ① Ⅷ ١٢٣ numerals",
    "https://example.com/path?q=1&r=2#frag",
    "",
    " ",
    "\n",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3.5 + 10? Answer with 中文 😀"},
    ],
    [
        {"role": "user", "content": "code:\n```py\nprint(123)\n```"},
        {"role": "assistant", "content": "It prints 123."},
    ],
]

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


@pytest.fixture(scope="module")
def hf_reference(hf_gguf_tokenizer: Any) -> BackendTokenizer:
    """transformers' GGUF tokenizer with SmolLM2's tokenizer.json pre-tokenizer put back."""
    spec = json.loads(hf_gguf_tokenizer.backend_tokenizer.to_str())
    spec["pre_tokenizer"] = SMOLLM2_PRE_TOKENIZER
    return BackendTokenizer.from_str(json.dumps(spec))


class LlamaCppSmolLM:
    """llama.cpp's "smollm" tokenization in plain Python, as an independent reference."""

    def __init__(
        self, tokens: Sequence[str], merges: Sequence[str], specials: Sequence[str]
    ) -> None:
        self.ids = {token: index for index, token in enumerate(tokens)}
        self.ranks = {tuple(merge.split(" ")): rank for rank, merge in enumerate(merges)}
        self.byte_chars = _gpt2_byte_chars()
        self.special_split = "(" + "|".join(regex.escape(s) for s in specials) + ")"

    def encode(self, text: str, digits_first: bool = True) -> list[int]:
        ids: list[int] = []
        for index, part in enumerate(regex.split(self.special_split, text)):
            if index % 2:  # a special token
                ids.append(self.ids[part])
                continue
            pieces = _split([part], r"\p{N}") if digits_first else [part]
            for piece in _split(pieces, GPT2_SPLIT):
                ids += [self.ids[t] for t in self._bpe(piece)]
        return ids

    def _bpe(self, piece: str) -> list[str]:
        # HF's BPE without an unk token drops a byte whose symbol is not in the vocabulary.
        parts = [c for c in (self.byte_chars[b] for b in piece.encode()) if c in self.ids]
        while len(parts) > 1:
            rank, at = min(
                (self.ranks.get(pair, len(self.ranks)), i)
                for i, pair in enumerate(itertools.pairwise(parts))
            )
            if rank == len(self.ranks):
                break
            parts[at : at + 2] = [parts[at] + parts[at + 1]]
        return parts


def _split(pieces: list[str], pattern: str) -> list[str]:
    # Like llama.cpp's unicode_regex_split: matches and the stretches between them both stay pieces.
    out: list[str] = []
    for piece in pieces:
        start = 0
        for match in regex.finditer(pattern, piece):
            out += [piece[start : match.start()]] if match.start() > start else []
            out.append(match.group())
            start = match.end()
        out += [piece[start:]] if start < len(piece) else []
    return out


def _gpt2_byte_chars() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}


@pytest.fixture(scope="module")
def llama_cpp_reference(smollm2_path: Path) -> LlamaCppSmolLM:
    import gguf

    fields = gguf.GGUFReader(smollm2_path).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    specials = [token for token, kind in zip(tokens, types, strict=True) if kind == 3]
    return LlamaCppSmolLM(tokens, fields["tokenizer.ggml.merges"].contents(), specials)


@pytest.mark.parametrize("text", CORPUS)
def test_ids_match_hf_tokenizer_json(
    smollm2_tokenizer: Tokenizer, hf_reference: BackendTokenizer, text: str
) -> None:
    assert smollm2_tokenizer.encode(text) == hf_reference.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("text", CORPUS)
def test_ids_match_llama_cpp_algorithm(
    smollm2_tokenizer: Tokenizer, llama_cpp_reference: LlamaCppSmolLM, text: str
) -> None:
    assert smollm2_tokenizer.encode(text) == llama_cpp_reference.encode(text)


def test_ids_match_unpatched_transformers_where_digit_split_is_moot(
    smollm2_tokenizer: Tokenizer, hf_gguf_tokenizer: Any, llama_cpp_reference: LlamaCppSmolLM
) -> None:
    moot = [
        t
        for t in CORPUS
        if llama_cpp_reference.encode(t) == llama_cpp_reference.encode(t, digits_first=False)
    ]
    # The corpus exercises the difference (so the patched reference matters) on whitespace runs
    # before digits and on non-ASCII numerals.
    assert {t for t in CORPUS if t not in moot} == {
        "a  1  22   333\n 4\t5",
        "mixed ½ ² ① Ⅷ ١٢٣ numerals",
    }
    for text in moot:
        assert smollm2_tokenizer.encode(text) == hf_gguf_tokenizer.encode(
            text, add_special_tokens=False
        ), text


def test_digit_split_pinned(smollm2_tokenizer: Tokenizer) -> None:
    # "a  1": the digit is split off first, so the two spaces stay one pre-token (ĠĠ = 256).
    # Plain GPT-2 splitting would give a|Ġ|Ġ|1 = [81, 216, 216, 33].
    assert smollm2_tokenizer.encode("a  1") == [81, 256, 33]
    assert smollm2_tokenizer.encode("12345") == [33, 34, 35, 36, 37]


@pytest.mark.parametrize("text", CORPUS)
def test_decode_round_trip_and_matches_hf(
    smollm2_tokenizer: Tokenizer, hf_reference: BackendTokenizer, text: str
) -> None:
    ids = smollm2_tokenizer.encode(text)
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == text
    for skip in (True, False):
        assert smollm2_tokenizer.decode(ids, skip_special_tokens=skip) == hf_reference.decode(
            ids, skip_special_tokens=skip
        )


def test_bytes_missing_from_vocabulary_are_dropped_like_hf(
    smollm2_tokenizer: Tokenizer, hf_reference: BackendTokenizer
) -> None:
    # SmolLM2's vocabulary has no symbol for byte 0x04; HF's BPE (no unk token) drops it.
    text = "a\x04b and \x06"
    assert smollm2_tokenizer.encode(text) == hf_reference.encode(text, add_special_tokens=False).ids
    assert smollm2_tokenizer.decode(smollm2_tokenizer.encode(text)) == "ab and "


def test_special_ids_and_vocab(smollm2_tokenizer: Tokenizer) -> None:
    assert smollm2_tokenizer.vocab_size == 49152
    assert smollm2_tokenizer.bos_token_id == 1  # <|im_start|>
    # SmolLM2-Instruct stops at <|im_end|>, which is also the GGUF's eos.
    assert smollm2_tokenizer.eos_token_ids == frozenset({2})
    assert smollm2_tokenizer.encode("<|im_end|><|endoftext|>") == [2, 0]
    # add_bos_token is false in the file (as in HF's tokenizer_config): nothing is added.
    assert smollm2_tokenizer.encode("hi", add_special_tokens=True) == smollm2_tokenizer.encode("hi")


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    smollm2_tokenizer: Tokenizer,
    hf_gguf_tokenizer: Any,
    hf_reference: BackendTokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
) -> None:
    expected = hf_gguf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt) == expected
    ids = smollm2_tokenizer.encode_chat(messages, add_generation_prompt)
    assert ids == hf_reference.encode(expected, add_special_tokens=False).ids
    assert ids[0] == 1 and ids.count(2) == len(messages) + (messages[0]["role"] != "system")


def test_chat_template_default_system_prompt(smollm2_tokenizer: Tokenizer) -> None:
    text = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"content": "x"}], r"messages\[0\] needs a non-empty string 'role'"),
        ([{"role": "user", "content": "x"}, {"role": "", "content": "y"}], r"messages\[1\] needs"),
        ([{"role": "user"}], r"messages\[0\]\['content'\] must be a string"),
        ([{"role": "user", "content": 5}], r"'content'\] must be a string"),
    ],
)
def test_bad_messages_raise_value_error(
    smollm2_tokenizer: Tokenizer, messages: Any, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        smollm2_tokenizer.apply_chat_template(messages)


def _write_hf_dir(
    path: Path,
    tokenizer: Tokenizer,
    config: dict[str, Any],
    generation: dict[str, Any] | None = None,
) -> Path:
    path.mkdir()
    tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def test_from_hf_dir(smollm2_tokenizer: Tokenizer, tmp_path: Path) -> None:
    template = smollm2_tokenizer.chat_template
    config = {
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|endoftext|>",
        "chat_template": template,
    }
    loaded = Tokenizer.from_hf_dir(_write_hf_dir(tmp_path / "a", smollm2_tokenizer, config))
    for text in CORPUS:
        assert loaded.encode(text) == smollm2_tokenizer.encode(text)
    assert loaded.bos_token_id == 1
    # eos <|endoftext|> plus <|im_end|>, which the chat template closes every turn with.
    assert loaded.eos_token_ids == frozenset({0, 2})
    assert loaded.encode_chat(CONVERSATIONS[1]) == smollm2_tokenizer.encode_chat(CONVERSATIONS[1])

    no_template = dict(config, chat_template=None)
    loaded = Tokenizer.from_hf_dir(
        _write_hf_dir(tmp_path / "b", smollm2_tokenizer, no_template, {"eos_token_id": [5, 7]})
    )
    assert loaded.eos_token_ids == frozenset({0, 5, 7})
    with pytest.raises(ValueError, match="no chat template"):
        loaded.apply_chat_template(CONVERSATIONS[0])

    named = dict(
        config,
        chat_template=[
            {"name": "tool_use", "template": "x"},
            {"name": "default", "template": "{{ 'D' }}"},
        ],
    )
    loaded = Tokenizer.from_hf_dir(
        _write_hf_dir(tmp_path / "c", smollm2_tokenizer, named, {"eos_token_id": 2})
    )
    assert loaded.apply_chat_template(CONVERSATIONS[0]) == "D"
    assert loaded.eos_token_ids == frozenset({0, 2})
    (tmp_path / "c" / "chat_template.jinja").write_text("{{ 'J' + bos_token + eos_token }}")
    assert (
        Tokenizer.from_hf_dir(tmp_path / "c").apply_chat_template(CONVERSATIONS[0])
        == "J<|im_start|><|endoftext|>"
    )


def test_template_raise_exception_becomes_value_error(smollm2_tokenizer: Tokenizer) -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok"
    tokenizer = Tokenizer(smollm2_tokenizer.backend, chat_template=template)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="first message must be from the user"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_has_hf_helpers(smollm2_tokenizer: Tokenizer) -> None:
    template = "{{ messages[0] | tojson }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}|{{ m.role }}{% endfor %}"
    tokenizer = Tokenizer(smollm2_tokenizer.backend, chat_template=template)
    messages = [{"role": "user", "content": "é<b>"}, {"role": "assistant", "content": "y"}]
    # transformers' tojson: no HTML escaping, no ASCII escaping.
    assert tokenizer.apply_chat_template(messages) == '{"role": "user", "content": "é<b>"}|user'


def test_unsupported_gguf_tokenizers_are_refused(smollm2_tokenizer: Tokenizer) -> None:
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
    }
    with pytest.raises(ValueError, match="pre-tokenizer 'qwen2'"):
        Tokenizer.from_gguf_metadata(metadata)
    with pytest.raises(ValueError, match="tokenizer model 'llama'"):
        Tokenizer.from_gguf_metadata(dict(metadata, **{"tokenizer.ggml.model": "llama"}))
    small = Tokenizer.from_gguf_metadata(dict(metadata, **{"tokenizer.ggml.pre": "gpt-2"}))
    assert small.encode("ab a") == [2, 0]  # " a" has no token: Ġ is not in this vocabulary


def _stream(
    tokenizer: Tokenizer, ids: Sequence[int], skip_special_tokens: bool = True
) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    return [detokenizer.feed(token_id) for token_id in ids] + [detokenizer.flush()]


def test_incremental_detokenizer_holds_split_characters(smollm2_tokenizer: Tokenizer) -> None:
    text = "Héllo 中文 and emoji 😀👍🏽 done. «ok» 12,5 €"
    ids = smollm2_tokenizer.encode(text)
    partial = [
        i for i, token_id in enumerate(ids) if "\ufffd" in smollm2_tokenizer.decode([token_id])
    ]
    assert partial, "the text must contain characters whose bytes span several tokens"
    pieces = _stream(smollm2_tokenizer, ids)
    assert "".join(pieces) == text == smollm2_tokenizer.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)
    assert pieces[partial[0]] == ""  # held until the character is complete
    assert (
        sum(1 for piece in pieces if piece) > len(text.split()) // 2
    )  # text streams out as it goes


def test_incremental_detokenizer_flush_emits_incomplete_tail(smollm2_tokenizer: Tokenizer) -> None:
    ids = smollm2_tokenizer.encode("ok 😀")
    detokenizer = IncrementalDetokenizer(smollm2_tokenizer)
    streamed = "".join(detokenizer.feed(token_id) for token_id in ids[:-1])
    tail = detokenizer.flush()
    assert streamed + tail == smollm2_tokenizer.decode(ids[:-1])
    assert tail.endswith("\ufffd")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenizer_concatenation_equals_decode(
    smollm2_tokenizer: Tokenizer, skip_special_tokens: bool
) -> None:
    chat = smollm2_tokenizer.encode_chat(CONVERSATIONS[1], add_generation_prompt=False)
    assert "".join(
        _stream(smollm2_tokenizer, chat, skip_special_tokens)
    ) == smollm2_tokenizer.decode(chat, skip_special_tokens)
    # Arbitrary id sequences, half of them tokens that are not whole UTF-8 characters on their
    # own (so characters get split, completed, or left invalid), special tokens included.
    vocab = range(smollm2_tokenizer.vocab_size)
    partial = [i for i in vocab if "\ufffd" in smollm2_tokenizer.decode([i])]
    assert len(partial) > 100
    rng = random.Random(0)
    for _ in range(200):
        length = rng.randrange(1, 30)
        ids = [
            rng.choice(partial) if rng.random() < 0.5 else rng.choice(vocab) for _ in range(length)
        ]
        expected = smollm2_tokenizer.decode(ids, skip_special_tokens)
        assert "".join(_stream(smollm2_tokenizer, ids, skip_special_tokens)) == expected, ids


def test_gguf_add_bos_flag() -> None:
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": ["a", "b", "ab", "<s>"],
        "tokenizer.ggml.token_type": [1, 1, 1, 3],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": 3,
        "tokenizer.ggml.add_bos_token": True,
    }
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    assert tokenizer.encode("ab", add_special_tokens=True) == [3, 2]
    assert tokenizer.encode("ab") == [2]
    assert tokenizer.bos_token_id == 3 and tokenizer.eos_token_ids == frozenset()
