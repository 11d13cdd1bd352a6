"""A long text encoded in pieces at once, cut where a byte-level BPE's ids do not depend on it.

A byte-level BPE tokenizer of GPT-2's family (GPT-2, SmolLM2, Llama 3, Qwen 2) cuts text into
pre-tokens with a regex, then merges bytes inside each pre-token only. In each of the
regexes it uses, whitespace stands only at the start of a match or inside a run of
whitespace, and no match goes on from a letter or number to a punctuation mark. So a
pre-token always starts at a space right after a non-whitespace character, and at a CJK
punctuation mark (，。、！？；：) right after a letter or number (what cuts Chinese or
Japanese text, which has no spaces); the text cut right before either encodes, piece by
piece, to the ids of the whole. Added tokens (`<|im_start|>`) are matched before the regex
runs; one holding no whitespace and none of those marks never spans such a cut.

`splits_safely` says whether a `tokenizers.Tokenizer` is of that family (no normalizer but
NFC, a known pre-tokenizer, a BPE model, added tokens without whitespace, those marks or
stripping, as its tokenizer.json would write them); only those are cut. `encode_in_pieces` encodes the pieces
with `encode_batch`, which runs them on the `tokenizers` thread pool (one `encode` holds the
GIL: Python threads do not help). Measured on a 2-core VM: 128,510 ids of English text in
191 ms whole, 100-123 ms in 2-8 pieces; the work divides by the cores.
"""

from __future__ import annotations

import itertools
import json
import os
import re

from tokenizers import Encoding
from tokenizers import Tokenizer as BackendTokenizer

# A text is cut into pieces of at least this many characters (~4,000 tokens of English).
PIECE_CHARS = 16 << 10
# How far past an even cut a safe cut is looked for; where there is none, no cut is made.
SEARCH_CHARS = 4 << 10
# Where to cut: before a space (U+0020) right after a non-whitespace character, or before a
# CJK punctuation mark right after a letter or number. Python's \s holds every Unicode
# White_Space character the tokenizers' regexes mean by \s, and a few more (U+001C-U+001F);
# its [^\W_] is str.isalnum(), letters and numbers only (\p{L}, \p{N}): so it never finds
# a cut those regexes would not. The marks compose with nothing under NFC.
CJK_MARKS = "，。、！？；："
_CUT = re.compile(rf"(?<=\S) |(?<=[^\W_])[{CJK_MARKS}]")

# The pre-tokenizer regexes of Llama 3's and Qwen 2's tokenizer.json (a Split before a
# ByteLevel that runs no regex of its own).
_SPLIT_REGEXES = frozenset(
    {
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
)


def splits_safely(backend: BackendTokenizer) -> bool:
    """Whether `backend` encodes a text cut where `_CUT` finds to the same ids, piece by
    piece, as the whole (see the module's note)."""
    if not _cut_keeps_normal_form(backend) or type(backend.model).__name__ != "BPE":
        return False
    if backend.model.dropout:
        return False
    if any(
        token.lstrip or token.rstrip or any(c.isspace() or c in CJK_MARKS for c in token.content)
        for token in backend.get_added_tokens_decoder().values()
    ):
        return False
    if backend.pre_tokenizer is None:
        return False
    return _known_pre_tokenizer(json.loads(backend.pre_tokenizer.__getstate__()))


def _cut_keeps_normal_form(backend: BackendTokenizer) -> bool:
    """No normalizer, or NFC (Qwen 2's): a space is a starter that composes with nothing,
    so NFC changes nothing across it."""
    normalizer = backend.normalizer
    return normalizer is None or json.loads(normalizer.__getstate__()) == {"type": "NFC"}


def _known_pre_tokenizer(spec: dict[str, object]) -> bool:
    if _byte_level(spec, use_regex=True):  # GPT-2's regex
        return True
    steps = spec.get("pretokenizers") if spec.get("type") == "Sequence" else None
    if not isinstance(steps, list) or len(steps) != 2:
        return False
    first, second = steps
    if first.get("type") == "Digits":  # SmolLM2, StarCoder: digits split off first
        return _byte_level(second, use_regex=True)
    pattern = first.get("pattern")
    return (
        first.get("type") == "Split"
        and isinstance(pattern, dict)
        and pattern.get("Regex") in _SPLIT_REGEXES
        and first.get("behavior") == "Isolated"
        and not first.get("invert")
        and _byte_level(second, use_regex=False)
    )


def _byte_level(spec: dict[str, object], use_regex: bool) -> bool:
    return (
        spec.get("type") == "ByteLevel"
        and spec.get("use_regex", True) == use_regex
        and not spec.get("add_prefix_space")
    )


def piece_count(num_chars: int) -> int:
    """How many pieces to encode a text of `num_chars` characters in: one per core this
    process may run on, each at least PIECE_CHARS."""
    return max(1, min(len(os.sched_getaffinity(0)), num_chars // PIECE_CHARS))


def cut_points(text: str, pieces: int) -> list[int]:
    """Where to cut `text` into about `pieces` pieces: for each even cut, the first safe
    position within SEARCH_CHARS after it (none there: that cut is left out)."""
    cuts: list[int] = []
    for j in range(1, pieces):
        start = max(len(text) * j // pieces, cuts[-1] + 1 if cuts else 1)
        found = _CUT.search(text, start, min(len(text), start + SEARCH_CHARS))
        if found is not None:
            cuts.append(found.start())
    return cuts


def last_cut(text: str, after: int) -> int | None:
    """The last safe cut in `text` past position `after`, looked for in its last
    SEARCH_CHARS (None: none there)."""
    starts = [m.start() for m in _CUT.finditer(text, max(after + 1, len(text) - SEARCH_CHARS))]
    return starts[-1] if starts else None


def encode_cut(backend: BackendTokenizer, text: str, cuts: list[int]) -> list[list[int]]:
    """The ids of each piece of `text` cut at `cuts` (ascending safe cuts), encoded at once,
    without the post-processor's special tokens: together the ids of the whole."""
    return [encoding.ids for encoding in _encodings(backend, text, cuts)]


def encode_in_pieces(
    backend: BackendTokenizer, text: str, pieces: int, add_special_tokens: bool
) -> list[int]:
    """The ids of `text` (as `backend.encode` gives them), its pieces encoded at once.
    Only for a backend that `splits_safely`."""
    encodings = _encodings(backend, text, cut_points(text, pieces))
    if add_special_tokens:  # the BOS/EOS the post-processor puts around the whole
        whole = Encoding.merge(encodings, growing_offsets=True)
        return backend.post_process(whole, None, True).ids
    return [token_id for encoding in encodings for token_id in encoding.ids]


def _encodings(backend: BackendTokenizer, text: str, cuts: list[int]) -> list[Encoding]:
    bounds = [0, *cuts, len(text)]
    parts = [text[a:b] for a, b in itertools.pairwise(bounds)]
    return backend.encode_batch(parts, add_special_tokens=False)
