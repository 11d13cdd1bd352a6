"""Text <-> token ids for kvshare: a `tokenizers` BPE plus the model's chat template.

A tokenizer comes either from a Hugging Face model directory (`Tokenizer.from_hf_dir`) or from the
`tokenizer.*` metadata of a GGUF file (`Tokenizer.from_gguf_metadata`), so a GGUF alone is enough
to serve a model. Both produce the ids the Hugging Face tokenizer of the model produces.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from kvshare.models.encoded_prefixes import EncodedPrefixes
from kvshare.models.text_pieces import (
    cut_points,
    encode_cut,
    encode_in_pieces,
    last_cut,
    piece_count,
    splits_safely,
)

# llama.cpp's `enum llama_token_type` values that matter here.
TOKEN_TYPE_CONTROL = 3  # special tokens: <|im_start|>, <|endoftext|>, ...
TOKEN_TYPE_USER_DEFINED = 4  # added but not special: matched whole in text, kept by decode

# Tokens that close a chat turn. A model that ends its turns with one of these stops generating
# there, even when its tokenizer's `eos_token` is the end-of-document token.
TURN_END_TOKENS: tuple[str, ...] = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<end_of_turn>",
    "<|end|>",
)

# What a byte-level decode yields for bytes that do not (yet) form a whole UTF-8 character.
REPLACEMENT_CHAR = "\ufffd"


def _byte_level() -> pre_tokenizers.PreTokenizer:
    # GPT-2's split regex, then bytes -> printable characters.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _digits_then_byte_level() -> pre_tokenizers.PreTokenizer:
    # Every digit is a pre-token of its own before GPT-2's regex runs. This is the pre_tokenizer of
    # SmolLM2's (and StarCoder's) tokenizer.json, and llama.cpp's "smollm" split: `\p{N}`, then the
    # GPT-2 regex on each stretch between digits. Without the digit step "a  1" comes out as
    # a|Ġ|Ġ|1 instead of a|ĠĠ|1: the whitespace run before a digit is cut differently.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


# llama.cpp's `tokenizer.ggml.pre` -> the pre-tokenizer of the tokenizer.json the vocabulary was
# trained with. A name missing here is refused: a wrong split silently changes ids.
GGUF_PRE_TOKENIZERS: Mapping[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "gpt-2": _byte_level,
    "smollm": _digits_then_byte_level,
    "starcoder": _digits_then_byte_level,
}


class Tokenizer:
    """A `tokenizers.Tokenizer` with the special ids and chat template of one model."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        self._cuts_safely = splits_safely(backend)  # long texts are encoded in pieces at once
        # The ids of long texts encoded lately, up to a safe cut: a text extending one (the
        # next turn of a chat) encodes only the rest.
        self.prefixes = EncodedPrefixes() if self._cuts_safely else None
        self._chat_template = chat_template
        self._bos_token_id = self._token_id(bos_token) if bos_token is not None else None
        eos_ids = [*extra_eos_token_ids, *self._turn_end_ids(chat_template)]
        if eos_token is not None:
            eos_ids.append(self._token_id(eos_token))
        self._eos_token_ids = frozenset(eos_ids)
        # The strings HF passes a chat template (its `special_tokens_map`); unset ones stay undefined.
        self._template_tokens = {
            name: token
            for name, token in (("bos_token", bos_token), ("eos_token", eos_token))
            if token is not None
        }
        self._template = _compile_chat_template(chat_template) if chat_template else None

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json` and, if present, `generation_config.json`."""
        path = Path(path)
        config = _read_json(path / "tokenizer_config.json")
        # generation_config.json gives one id or a list of them.
        generation_eos = _read_json(path / "generation_config.json").get("eos_token_id", [])
        extra_eos = [generation_eos] if isinstance(generation_eos, int) else generation_eos
        return cls(
            BackendTokenizer.from_file(str(path / "tokenizer.json")),
            chat_template=_hf_chat_template(path, config),
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            extra_eos_token_ids=extra_eos,
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from a GGUF's key/value metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"unsupported GGUF tokenizer model {kind!r}: only byte-level BPE ('gpt2') is supported"
            )
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        bos, eos = (_gguf_special_token(metadata, tokens, name) for name in ("bos", "eos"))
        backend = _gguf_backend(
            tokens,
            merges=metadata["tokenizer.ggml.merges"],
            token_types=metadata.get("tokenizer.ggml.token_type", ()),
            pre=metadata.get("tokenizer.ggml.pre"),
        )
        backend.post_processor = _add_special_tokens_processor(
            bos if metadata.get("tokenizer.ggml.add_bos_token", False) else None,
            eos if metadata.get("tokenizer.ggml.add_eos_token", False) else None,
            backend,
        )
        return cls(
            backend,
            chat_template=metadata.get("tokenizer.chat_template"),
            bos_token=bos,
            eos_token=eos,
            # llama.cpp's explicit end-of-turn / end-of-message ids, when the file has them.
            extra_eos_token_ids=[
                metadata[key]
                for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                if key in metadata
            ],
        )

    @property
    def backend(self) -> BackendTokenizer:
        """The wrapped `tokenizers.Tokenizer` (token <-> id lookups, saving as tokenizer.json)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: the eos token and the chat template's turn-end token."""
        return self._eos_token_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @cached_property
    def digest(self) -> str:
        """Names what this tokenizer makes of a prompt: its tokenizer.json, chat template and
        template tokens. Two tokenizers of one digest give any text or messages the same ids."""
        parts = (
            self._backend.to_str(),
            self._chat_template or "",
            json.dumps(self._template_tokens),
        )
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]

    def encode(
        self, text: str, add_special_tokens: bool = False, scope: str | None = None
    ) -> list[int]:
        """Special tokens written in `text` always become their ids; `add_special_tokens`
        only adds the BOS/EOS the model's tokenizer puts around a sequence. Given a `scope`
        (a request's cache salt, "" for none), a long text reuses the ids of a text of that
        scope it extends, and is kept for the texts that will extend it."""
        if (
            scope is not None
            and self.prefixes is not None
            and not add_special_tokens
            and self.prefixes.takes(text)
        ):
            return self._encode_extending(text, scope, self.prefixes)
        pieces = piece_count(len(text)) if self._cuts_safely else 1
        if pieces > 1:
            return encode_in_pieces(self._backend, text, pieces, add_special_tokens)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def _encode_extending(self, text: str, scope: str, prefixes: EncodedPrefixes) -> list[int]:
        """The ids of `text`: a kept prefix's, then the rest's, encoded in pieces cut as in
        `encode` and once more at the last safe cut near the end, up to which it is kept."""
        start, ids = prefixes.longest(text, scope)
        rest = text[start:]
        cuts = [start + c for c in cut_points(rest, piece_count(len(rest)))]
        tail = last_cut(text, cuts[-1] if cuts else start)
        if tail is not None:
            cuts.append(tail)
        pieces = encode_cut(self._backend, rest, [c - start for c in cuts])
        for piece in pieces[:-1]:
            ids += piece
        if cuts:
            prefixes.keep(text[: cuts[-1]], ids, scope)
        return ids + pieces[-1]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render `messages` ({"role": str, "content": str} dicts) the way HF's tokenizer does."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        _check_messages(messages)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self._template_tokens,
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"the chat template rejected the messages: {error}") from error

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        scope: str | None = None,
    ) -> list[int]:
        # The template writes every special token itself, so none are added around it (as in HF).
        text = self.apply_chat_template(messages, add_generation_prompt)
        return self.encode(text, scope=scope)

    def _token_id(self, token: str) -> int:
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"special token {token!r} is not in the vocabulary")
        return token_id

    def _turn_end_ids(self, chat_template: str | None) -> list[int]:
        return [
            token_id
            for token in TURN_END_TOKENS
            if chat_template
            and token in chat_template
            and (token_id := self._backend.token_to_id(token)) is not None
        ]


class IncrementalDetokenizer:
    """Turn a stream of token ids into a stream of text pieces.

    Invariant: the concatenation of every `feed` result and the final `flush` equals
    `tokenizer.decode(all ids fed)`. While the decoded tail ends in U+FFFD (a character whose UTF-8
    bytes are split across tokens) it is held back, so a piece never carries a broken character
    that a later token completes.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        # ids[:read] are emitted. ids[prefix:read] are decoded again as context, because a
        # decoder may render a token differently at the start of a sequence.
        self._prefix_offset = 0
        self._read_offset = 0

    def feed(self, token_id: int) -> str:
        """Add one token; return the text it completes (often "", never a partial character)."""
        self._ids.append(token_id)
        prefix_text, text = self._window_texts()
        if len(text) <= len(prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(prefix_text, text)

    def flush(self) -> str:
        """Return whatever is held back, incomplete characters included (as U+FFFD)."""
        return self._emit(*self._window_texts())

    def _window_texts(self) -> tuple[str, str]:
        prefix = self._ids[self._prefix_offset : self._read_offset]
        window = self._ids[self._prefix_offset :]
        decode = self._tokenizer.decode
        return decode(prefix, self._skip_special_tokens), decode(window, self._skip_special_tokens)

    def _emit(self, prefix_text: str, text: str) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(prefix_text) :]


def _gguf_backend(
    tokens: list[str], merges: Sequence[str], token_types: Sequence[int], pre: str | None
) -> BackendTokenizer:
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r}; supported: {sorted(GGUF_PRE_TOKENIZERS)}"
        )
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("the GGUF vocabulary lists a token twice")
    # As in the HF tokenizer.json: no unk token, so a byte missing from the vocabulary is dropped.
    backend = BackendTokenizer(
        models.BPE(
            vocab=vocab,
            merges=[tuple(merge.split(" ")) for merge in merges],
            unk_token=None,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=False,
        )
    )
    backend.pre_tokenizer = GGUF_PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, token_types, strict=False))
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in typed
            if kind == TOKEN_TYPE_CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in typed
            if kind == TOKEN_TYPE_USER_DEFINED
        ]
    )
    return backend


def _gguf_special_token(metadata: Mapping[str, Any], tokens: list[str], name: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{name}_token_id")
    return None if token_id is None else tokens[token_id]


def _add_special_tokens_processor(
    bos: str | None, eos: str | None, backend: BackendTokenizer
) -> processors.PostProcessor | None:
    """What `encode(..., add_special_tokens=True)` puts around the text, per the GGUF's flags."""
    if bos is None and eos is None:
        return None
    specials = [token for token in (bos, eos) if token is not None]
    return processors.TemplateProcessing(
        single=([bos] if bos else []) + ["$A"] + ([eos] if eos else []),
        special_tokens=[(token, backend.token_to_id(token)) for token in specials],
    )


def _compile_chat_template(source: str) -> jinja2.Template:
    # The environment transformers renders chat templates in; templates rely on its settings.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be a dict, not {type(message).__name__}")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise ValueError(f"messages[{index}] needs a non-empty string 'role'")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{index}]['content'] must be a string")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _hf_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    # Newer checkpoints keep the template in its own file, which then wins (as in transformers).
    template_file = path / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = {entry["name"]: entry["template"] for entry in template}.get("default")
    return template


def _token_content(token: str | Mapping[str, Any] | None) -> str | None:
    # tokenizer_config.json writes a special token either as its text or as a serialized AddedToken.
    return token["content"] if isinstance(token, Mapping) else token
