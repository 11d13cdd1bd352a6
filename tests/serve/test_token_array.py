"""A long prompt of token ids is read from the request body straight into an array, and
that read is exact: it gives what json.loads gives (as an array), and every text it is
not sure of goes to json.loads, with json.loads' errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.serve.errors import APIError
from kvshare.serve.http import (
    TOKEN_ARRAY_BYTES,
    ArrayReader,
    PromptHead,
    _cut_at_commas,
    parse_json_object,
    token_array,
)
from kvshare.serve.protocol import ModelInfo, parse_generate
from kvshare.serve.routing_keys import RoutingKeys

# Pads a body past TOKEN_ARRAY_BYTES, where the array read is used.
PAD = "x" * TOKEN_ARRAY_BYTES


def plain(body: dict[str, Any]) -> dict[str, Any]:
    """The body with an array prompt as the list json.loads gives."""
    prompt = body.get("prompt")
    if isinstance(prompt, np.ndarray):
        assert prompt.dtype == np.int32
        return {**body, "prompt": prompt.tolist()}
    return body


SPACE = st.sampled_from(["", " ", "\n", "\t ", "\r\n  "])


@pytest.fixture(scope="module")
def pieces() -> Iterator[ArrayReader]:
    """A reader that cuts any array of two ids or more: pieces of 1 byte at least, 3 threads."""
    reader = ArrayReader(threads=3, piece_bytes=1)
    yield reader
    reader.close()


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(0, 10**9 - 1), min_size=1, max_size=40),
    spaces=st.lists(SPACE, min_size=3, max_size=3),
    first=st.booleans(),
)
def test_a_list_of_ids_reads_as_json_loads_reads_it(
    ids: list[int], spaces: list[str], first: bool, pieces: ArrayReader
) -> None:
    a, b, c = spaces
    array = "[" + a + (b + "," + c).join(map(str, ids)) + b + "]"
    members = [f'"prompt"{a}:{c}{array}', '"model": "m"', f'"pad": "{PAD}"']
    text = "{" + a + (",".join(members if first else members[::-1])) + c + "}"
    parsed = parse_json_object(text.encode())
    assert isinstance(parsed["prompt"], np.ndarray)
    assert plain(parsed) == json.loads(text)
    found = token_array(array.encode(), 0)
    assert found is not None and found[0].tolist() == ids and found[1] == len(array)
    in_pieces = token_array(array.encode(), 0, pieces)
    assert in_pieces is not None and in_pieces[0].tolist() == ids
    assert plain(parse_json_object(text.encode(), pieces)) == json.loads(text)


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(0, 10**9 - 1), min_size=1, max_size=120),
    wide=st.booleans(),
    space=SPACE,
    head_ids=st.integers(1, 6),
    threaded=st.booleans(),
)
def test_a_head_gets_the_arrays_first_ids_once_and_the_array_reads_whole(
    ids: list[int],
    wide: bool,
    space: str,
    head_ids: int,
    threaded: bool,
    pieces: ArrayReader,
) -> None:
    """The head is the array's first ids, sent once, only for an array of more than twice
    its text with a comma past it; at least `ids` of them for ids below 10**6 written with
    at most one space; and the array still reads as the list (the pieces after the head
    join exactly)."""
    values = ids if wide else [i % 10**6 for i in ids]
    array = "[" + ("," + space).join(map(str, values)) + "]"
    sent: list[tuple[list[int], bytes]] = []
    head = PromptHead(head_ids, lambda got, body: sent.append((got.tolist(), body)))
    data = array.encode()
    found = token_array(data, 0, pieces if threaded else None, head)
    assert found is not None and found[0].tolist() == values and found[1] == len(array)
    if len(array) - 2 <= 2 * head_ids * 8 or array.find(",", 1 + head_ids * 8) < 0:
        assert sent == []
        return
    assert len(sent) == 1
    first, body = sent[0]
    assert body is data and first == values[: len(first)] and len(first) < len(values)
    if not wide and len(space) <= 1:
        assert len(first) >= head_ids


def test_a_head_that_raises_costs_the_head_only(
    pieces: ArrayReader, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(ids: np.ndarray, body: bytes) -> None:
        raise RuntimeError("injected")

    ids = list(range(5000))
    text = json.dumps({"model": "m", "prompt": ids, "pad": PAD})
    parsed = parse_json_object(text.encode(), pieces, PromptHead(100, broken))
    assert parsed["prompt"].tolist() == ids
    assert "sending a prompt's first ids failed" in caplog.text


@given(
    text=st.text(alphabet="0123 ,]", max_size=30),
    parts=st.integers(1, 5),
    around=st.tuples(st.text(alphabet="1,[", max_size=3), st.text(alphabet="1,]", max_size=3)),
)
def test_pieces_are_cut_at_commas_and_join_back(
    text: str, parts: int, around: tuple[str, str]
) -> None:
    before, after = around
    data = (before + text + after).encode()
    spans = _cut_at_commas(data, len(before), len(before) + len(text), parts)
    assert b",".join(data[a:b] for a, b in spans) == text.encode()
    assert 1 <= len(spans) <= parts


# Arrays token_array must leave to json.loads: invalid JSON, or values that are not
# plain ids (the general path gives the list, or its error).
NOT_READ = [
    "[]",
    "[ ]",
    "[01, 2]",  # leading zero: invalid JSON
    "[1, 00]",
    "[1,,2]",
    "[1, 2,]",
    "[,1]",
    "[1 2]",
    "[-1, 2]",
    "[1.0, 2]",
    "[1e3, 2]",
    "[1000000000, 2]",  # 10 digits
    "[2147483648, 2]",  # past int32: read as -2147483648
    "[4294967297, 2]",  # read as 1
    "[1, 3000000000]",
    "[99999999999999999999999, 1]",
    "[1, [2]]",
    '[1, "2"]',
    "[1, true]",
    "[1, null]",
    "[1,\v2]",  # not JSON whitespace
    "[1, 2",
    "[+1, 2]",  # numpy would read a sign
    "[1_0, 2]",
    "[0x1F, 2]",
    "[1, 2x]",
]


@pytest.mark.parametrize("array", NOT_READ)
def test_anything_else_is_left_to_json_loads(array: str, pieces: ArrayReader) -> None:
    assert token_array(array.encode(), 0) is None
    assert token_array(array.encode(), 0, pieces) is None
    text = '{"model": "m", "pad": "' + PAD + '", "prompt": ' + array + "}"
    try:
        expected = json.loads(text)
    except ValueError:
        with pytest.raises(APIError, match="not valid JSON"):
            parse_json_object(text.encode())
        return
    parsed = parse_json_object(text.encode())
    assert not isinstance(parsed["prompt"], np.ndarray) and parsed == expected


@pytest.mark.parametrize(
    "text",
    [
        '{"prompt": [1, 2], "prompt": "x", "pad": "P"}',  # duplicate keys: the last wins
        '{"prompt": "x", "pad": "P", "prompt": [3, 4]}',
        '{"pad": "P", "a": {"prompt": [1, 2]}, "prompt": [5]}',  # only the top level's
        '{"pad": "P ] \\"prompt\\": [7]", "prompt": [8]}',
        '  {"pad": "P", "prompt": [9]}  \n',
        '{"pad": "P", "prompt": [1], "é": "non-ASCII body"}',
        '{"é": "P", "prompt": [1, 2], "prompt": [3]}',  # the second array: json's list
        '{"pad": "P", "prompt": [1, 2, 3] }',
    ],
)
def test_objects_read_as_json_loads_reads_them(text: str) -> None:
    text = text.replace('"P', '"' + PAD)
    assert plain(parse_json_object(text.encode())) == json.loads(text)


IDS = st.lists(st.integers(0, 10**9 - 1), min_size=1, max_size=8)
# Values that look like a prompt array to a byte search: arrays of ids, nested objects
# with a "prompt" array, strings holding '"prompt": [' (escaped quotes), non-ASCII text.
VALUES = st.recursive(
    st.one_of(
        IDS,
        st.text(alphabet='ab"\\[],: é\u2028', max_size=12),
        st.just('"prompt": [1, 2]'),
        st.integers(-5, 5),
        st.none(),
    ),
    lambda inner: st.dictionaries(st.sampled_from(["prompt", 'a"prompt']), inner, max_size=2),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(
    members=st.lists(st.tuples(st.sampled_from(["prompt", "a", 'a"prompt']), VALUES), max_size=4),
    spaces=st.lists(SPACE, min_size=2, max_size=2),
)
def test_any_object_reads_as_json_loads_reads_it(
    members: list[tuple[str, object]], spaces: list[str]
) -> None:
    """Whatever surrounds, precedes or repeats the top-level prompt (duplicate keys: the
    last wins; a key ending in an escaped '"prompt'), the body reads as json.loads reads it."""
    a, b = spaces
    parts = [f"{json.dumps(key)}{a}:{b}{json.dumps(value)}" for key, value in members]
    text = "{" + ",".join([*parts, f'"pad": "{PAD}"']) + "}"
    parsed = parse_json_object(text.encode())
    assert plain(parsed) == json.loads(text)


@pytest.mark.parametrize(
    "text",
    [
        '{"pad": "P", "prompt": [1]} x',  # extra data
        '{"pad": "P", "prompt": [1],}',
        '{"pad": "P" "prompt": [1]}',
        '{"pad": "P", "prompt" [1]}',
        '{"pad": "P", "prompt": [1], "t": NaN}',
        '["P", [1, 2]]',
    ],
)
def test_malformed_bodies_keep_their_400(text: str) -> None:
    with pytest.raises(APIError) as caught:
        parse_json_object(text.replace('"P', '"' + PAD).encode())
    assert caught.value.status == 400


@pytest.mark.parametrize("where", ["before", "after"])
def test_invalid_utf8_beside_a_token_array_is_a_400(where: str) -> None:
    members = [b'"s": "\xff"', b'"prompt": [1, 2]', ('"pad": "' + PAD + '"').encode()]
    raw = b"{" + b", ".join(members if where == "before" else members[::-1]) + b"}"
    with pytest.raises(APIError, match="not valid UTF-8") as caught:
        parse_json_object(raw)
    assert caught.value.status == 400


def test_the_replica_and_the_router_read_the_array_as_the_list() -> None:
    """Same prompt ids, vocabulary check and routing keys from an array as from a list."""
    ids = np.random.default_rng(0).integers(0, 999, 40_000).tolist()
    ids[123] = 999
    raw = json.dumps({"model": "m", "prompt": ids, "max_tokens": 2}).encode()
    assert len(raw) >= TOKEN_ARRAY_BYTES
    fast = parse_json_object(raw)
    slow = json.loads(raw)
    assert isinstance(fast["prompt"], np.ndarray) and isinstance(slow["prompt"], list)
    model = ModelInfo("m", None, 50_000, 1000, "float32")
    a, b = parse_generate(fast, False, model), parse_generate(slow, False, model)
    assert a.prompt_token_ids.dtype == np.int32 and a.prompt_token_ids.tolist() == ids
    assert np.array_equal(a.prompt_token_ids, b.prompt_token_ids)
    keys = RoutingKeys(None, 16)
    assert keys.prefix_of("/v1/completions", fast) == keys.prefix_of("/v1/completions", slow)
    small = ModelInfo("m", None, 50_000, 999, "float32")  # id 999 is out of its vocabulary
    with pytest.raises(APIError, match=r"must be in \[0, 999\)"):
        parse_generate(fast, False, small)


@pytest.mark.parametrize(
    "members",
    [
        ['"s": "\\ud800"', '"prompt": IDS'],  # an escape just before the array
        ['"prompt":IDS', '"s":"\\udfff"'],  # just after it
        ['"prompt": "x"', '"prompt": IDS', '"s": "x\\uDBFFy"'],  # after a key met twice
    ],
)
def test_a_lone_surrogate_beside_a_token_array_is_still_a_400(members: list[str]) -> None:
    ids = json.dumps(list(range(20_000)))
    text = "{" + ", ".join([*members, '"model": "m"']).replace("IDS", ids) + "}"
    assert len(text) >= TOKEN_ARRAY_BYTES
    with pytest.raises(APIError, match="lone UTF-16 surrogate") as caught:
        parse_json_object(text.encode())
    assert caught.value.status == 400
    paired = text.replace("\\ud800", "\\ud83d\\ude00").replace("\\udfff", "\\ud83d\\ude00")
    paired = paired.replace("\\uDBFF", "\\ud83d\\ude00")
    parsed = parse_json_object(paired.encode())
    assert isinstance(parsed["prompt"], np.ndarray) and plain(parsed) == json.loads(paired)


def test_a_lone_surrogate_after_two_token_arrays_is_still_a_400() -> None:
    """Two top-level arrays: the first is read as an array, the second (the one json.loads
    keeps) by json's scanner; the escape after both is still found."""
    ids = json.dumps(list(range(20_000)))
    text = f'{{"prompt": {ids}, "prompt": {ids}, "s": "x\\uDBFFy", "model": "m"}}'
    with pytest.raises(APIError, match="lone UTF-16 surrogate") as caught:
        parse_json_object(text.encode())
    assert caught.value.status == 400
    paired = text.replace("\\uDBFF", "\\ud83d\\ude00")
    assert plain(parse_json_object(paired.encode())) == json.loads(paired)


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (7, 1), (8, 2), (16, 4), (64, 4)])
def test_a_reader_takes_a_thread_for_every_four_cores_up_to_four(
    monkeypatch: pytest.MonkeyPatch, cores: int, threads: int
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    reader = ArrayReader()
    try:
        assert reader.threads == threads
        assert reader.pieces(10 << 20) == threads
    finally:
        reader.close()
