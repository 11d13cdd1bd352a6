"""Synthetic prompts of an exact token count, for the served model's tokenizer.

Text is built from a word list with a seeded RNG and then adjusted by tokens until
`len(encode(text)) == n` exactly: the decoded prefix of n token ids can re-encode to a different
count (a cut inside a merge), so the cut moves until the re-encoded count is right. A model with
no tokenizer (`shape:` random weights) gets token-id prompts instead.

Every prompt is a pure function of its RNG, and callers seed the RNG with the prompt's identity
(seed, block, request, ...), so contexts are unique per (block, request) and reproducible.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvshare.models.tokenizer import Tokenizer
from kvshare.spec import SHAPE_PREFIX

# A follow-up question starts on a new paragraph. A byte-level BPE never merges a word with the
# newlines after it, so `context + QUESTION_SEPARATOR + question` begins with the context's ids
# and the context's pool chunks match.
QUESTION_SEPARATOR = "\n\n"

Prompt = str | list[int]

_WORDS: tuple[str, ...] = tuple(
    """the of and to in is was for on that with as by at from his her they this which
    river mountain city village harbor market bridge garden library museum station forest
    island valley castle temple tower window street field ocean desert meadow canyon
    engineer farmer teacher doctor sailor painter writer merchant captain student builder
    traveled measured painted visited described gathered repaired carried followed noticed
    discovered remembered explained collected finished started opened returned wrote
    ancient quiet bright narrow heavy gentle northern southern golden silver wooden careful
    morning evening winter summer autumn spring season harvest journey letter report story
    water stone iron copper glass paper bread honey salt wine coffee cotton timber grain
    seven twelve hundred thousand several many few every each another other second third
    slowly quickly often rarely nearly almost always never later early together again
    because although while before after during between without within across toward
    machine signal engine circuit network memory pattern number record system method theory
    question answer problem result reason example history culture language science music""".split()
)


@dataclass(frozen=True)
class PromptModel:
    """What the bench needs of the served model: its tokenizer, or only its vocabulary size."""

    spec: str
    tokenizer: Tokenizer | None
    vocab_size: int

    def __post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and self.tokenizer.chat_template is not None

    def prompt(self, num_tokens: int, rng: random.Random) -> Prompt:
        """Exactly `num_tokens` tokens: text with a tokenizer, token ids without one."""
        if self.tokenizer is None:
            return [rng.randrange(self.vocab_size) for _ in range(num_tokens)]
        return exact_text(self.tokenizer, num_tokens, rng)

    def follow_up(self, context: Prompt, question: Prompt) -> Prompt:
        if isinstance(context, str) and isinstance(question, str):
            return context + QUESTION_SEPARATOR + question
        if isinstance(context, list) and isinstance(question, list):
            return context + question
        raise TypeError("context and question must both be text or both be token ids")


def prompt_rng(seed: int, *labels: object) -> random.Random:
    """An RNG named by `labels`: same labels, same stream; different labels, unrelated streams."""
    return random.Random("/".join(map(str, (seed, *labels))))  # str seeds are hashed with SHA-512


def words(rng: random.Random, count: int) -> str:
    """`count` words in sentences of 6-17 words, each capitalized and ended with a period."""
    out: list[str] = []
    while len(out) < count:
        sentence = [rng.choice(_WORDS) for _ in range(min(rng.randint(6, 17), count - len(out)))]
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += "."
        out.extend(sentence)
    return " ".join(out)


def exact_text(
    tokenizer: Tokenizer, num_tokens: int, rng: random.Random, max_draws: int = 16
) -> str:
    """Text that `tokenizer.encode` turns into exactly `num_tokens` ids.

    The text is cut after `keep` of its ids, for `keep` near `num_tokens`, until the cut text
    re-encodes to exactly `num_tokens`. If no cut nearby does, the words after an earlier point
    are drawn again, which changes what surrounds the cut.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    text = ""
    for _ in range(max_draws):
        ids = tokenizer.encode(text)
        while len(ids) < num_tokens + _CUT_REACH:
            text = " ".join(
                filter(None, (text, words(rng, max(num_tokens + _CUT_REACH - len(ids), 4))))
            )
            ids = tokenizer.encode(text)
        for keep in _cuts_near(num_tokens):
            candidate = tokenizer.decode(ids[:keep])
            if len(tokenizer.encode(candidate)) == num_tokens:
                return candidate
        text = tokenizer.decode(ids[: max(0, num_tokens - 4 * _CUT_REACH)])
    raise RuntimeError(
        f"could not build a text of exactly {num_tokens} tokens in {max_draws} draws"
    )


_CUT_REACH = 8  # how far from the target a cut is tried (a re-encode differs by a token or two)


def _cuts_near(target: int) -> list[int]:
    """target, target-1, target+1, target-2, ...: never below 0."""
    cuts = [target + sign * d for d in range(_CUT_REACH + 1) for sign in (-1, 1)]
    return [c for c in dict.fromkeys(cuts) if c >= 0]


def load_prompt_model(spec: str) -> PromptModel:
    """The tokenizer (or vocabulary size) of a model spec, without loading any weights."""
    if spec.startswith(SHAPE_PREFIX):
        from kvshare.models.presets import shape_preset

        return PromptModel(spec, None, shape_preset(spec[len(SHAPE_PREFIX) :]).vocab_size)
    from kvshare.models.loader import load_tokenizer  # here: the loader imports torch

    tokenizer = load_tokenizer(spec)
    if tokenizer is None:
        raise ValueError(
            f"{spec} has no tokenizer (neither a .gguf file nor a directory with tokenizer.json)"
        )
    return PromptModel(spec, tokenizer, tokenizer.vocab_size)
