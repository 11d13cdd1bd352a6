"""A text that extends one encoded before reuses its ids up to a safe cut, and gets the ids of
the whole; only within one scope (a tenant's cache salt), in bounded memory."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshare.models import encoded_prefixes, text_pieces
from kvshare.models.encoded_prefixes import EncodedPrefixes
from kvshare.models.tokenizer import Tokenizer

FRAGMENTS = [
    " ", "  ", "\t", "\n", " \n", "\u00a0", "\x1c", "a", "word", "Café", "中文", "😀", "1", "42",
    "'s", "don't", ".", ",", "<|im_start|>", "<|im_end|>", "\u0301",
]  # fmt: skip
pieces = st.lists(st.sampled_from(FRAGMENTS), max_size=25).map("".join)


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sizes that let texts of tens of characters be kept, probed and cut several times."""
    monkeypatch.setattr(encoded_prefixes, "MIN_CHARS", 8)
    monkeypatch.setattr(encoded_prefixes, "PROBE_CHARS", 4)
    monkeypatch.setattr(text_pieces, "PIECE_CHARS", 16)
    monkeypatch.setattr(text_pieces, "SEARCH_CHARS", 24)


# The fixture's sizes hold for every example.
@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    base=pieces,
    turns=st.lists(st.tuples(st.floats(0, 1), pieces), min_size=1, max_size=6),
)
def test_every_text_gets_the_ids_of_the_whole(
    smollm2_tokenizer: Tokenizer, small: None, base: str, turns: list[tuple[float, str]]
) -> None:
    """Each text keeps a part of the last one (all of it: a chat's next turn; some of it: an
    edit; none: a new conversation) and goes on, so kept prefixes meet texts that go on after
    them with a space, and with anything else."""
    tokenizer = Tokenizer(smollm2_tokenizer.backend)
    assert tokenizer.prefixes is not None
    text = "Start " + base
    for kept, more in turns:
        text = text[: round(kept * len(text))] + more
        whole = tokenizer.backend.encode(text, add_special_tokens=False).ids
        assert tokenizer.encode(text, scope="s") == whole, repr(text)


def test_a_chats_next_turn_encodes_only_what_is_new(
    smollm2_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = Tokenizer(smollm2_tokenizer.backend, chat_template=smollm2_tokenizer.chat_template)
    assert tokenizer.prefixes is not None
    document = " ".join(f"line {i}: the river crossed the valley." for i in range(2000))
    turn1 = [{"role": "user", "content": f"Read this. {document} What is line 7?"}]
    turn2 = [*turn1, {"role": "assistant", "content": "The river."}]
    turn2.append({"role": "user", "content": "And line 8?"})
    encoded: list[int] = []
    encode_cut = text_pieces.encode_cut

    def counted(backend: object, text: str, cuts: list[int]) -> list[list[int]]:
        encoded.append(len(text))
        return encode_cut(backend, text, cuts)  # type: ignore[arg-type]

    monkeypatch.setattr("kvshare.models.tokenizer.encode_cut", counted)
    for turn in (turn1, turn2):
        text = tokenizer.apply_chat_template(turn)
        assert tokenizer.encode_chat(turn, scope="") == tokenizer.backend.encode(text).ids
    assert tokenizer.prefixes.hits == 1
    assert encoded[0] > 80_000 and encoded[1] < 200  # the second turn: its new text alone
    tokenizer.encode_chat(turn2, scope="another tenant")  # the whole text again
    assert tokenizer.prefixes.hits == 1 and encoded[2] == len(tokenizer.apply_chat_template(turn2))


def test_no_text_finds_another_scopes_prefix(smollm2_tokenizer: Tokenizer) -> None:
    tokenizer = Tokenizer(smollm2_tokenizer.backend)
    assert tokenizer.prefixes is not None
    text = "the river crossed the valley " * 1000
    tokenizer.encode(text, scope="a")
    tokenizer.encode(text + " and on", scope="b")
    assert tokenizer.prefixes.hits == 0
    tokenizer.encode(text + " and on", scope="a")
    assert tokenizer.prefixes.hits == 1
    tokenizer.encode(text + " and on")  # no scope: neither kept nor looked up
    assert tokenizer.prefixes.hits == 1


def test_memory_stays_bounded_the_least_recent_going_first(small: None) -> None:
    prefixes = EncodedPrefixes(max_bytes=3 * (18 + 4 * 5))
    texts = [f"{i:02d} the river flows" for i in range(5)]  # 18 characters, 5 ids each
    for text in texts:
        prefixes.keep(text, [1, 2, 3, 4, 5], "s")
        assert prefixes.bytes <= prefixes.max_bytes
    assert prefixes.longest(texts[0] + " on", "s") == (0, [])  # dropped
    assert prefixes.longest(texts[2] + " on", "s") == (18, [1, 2, 3, 4, 5])
    prefixes.keep("05 the river flows", [1] * 5, "s")  # drops 03, not 02 (used lately)
    assert prefixes.longest(texts[2] + " on", "s")[0] == 18
    assert prefixes.longest(texts[3] + " on", "s") == (0, [])
    prefixes.keep("x" * 200, [1], "s")  # larger than the whole: not kept, nothing dropped
    assert prefixes.longest(texts[4] + " on", "s")[0] == 18
    with pytest.raises(ValueError, match="max_bytes"):
        EncodedPrefixes(max_bytes=-1)


def test_a_prefix_is_not_taken_where_the_text_goes_on_without_a_space(
    smollm2_tokenizer: Tokenizer, small: None
) -> None:
    tokenizer = Tokenizer(smollm2_tokenizer.backend)
    assert tokenizer.prefixes is not None
    tokenizer.encode("Start the river", scope="s")  # keeps "Start the"
    for text in ("Start there", "Start the river runs"):
        whole = tokenizer.backend.encode(text, add_special_tokens=False).ids
        assert tokenizer.encode(text, scope="s") == whole
    assert tokenizer.prefixes.hits == 1  # the second only
