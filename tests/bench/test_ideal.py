"""computed/ideal: the ideal count is each group's first prompt whole, then new tokens plus at
most one partial pool chunk per request; records feed it in the order they were sent."""

from __future__ import annotations

import pytest

from kvshare.bench.client import StreamResult
from kvshare.bench.ideal import PromptShare, computed_over_ideal, ideal_computed_tokens
from kvshare.bench.records import MEASURE, RequestRecord, Tag
from kvshare.bench.summary import computed_tokens, prompt_shares


def test_each_group_is_computed_once_then_only_new_tokens_and_a_partial_chunk() -> None:
    # Two documents of 2,100 tokens (8 whole 256-token chunks + 52), questions of 32.
    requests = [
        PromptShare("doc0", 2132),
        PromptShare("doc1", 2132),
        PromptShare("doc0", 2132, 2100),
        PromptShare("doc1", 2132, 2100),
        PromptShare("doc0", 2132, 2100),
    ]
    assert ideal_computed_tokens(requests, 256) == 2 * 2132 + 3 * (32 + 52)
    # A request that shares nothing is computed whole, however many come.
    assert ideal_computed_tokens([PromptShare(None, 100)] * 3, 256) == 300
    # A prefix of whole chunks leaves no partial chunk.
    assert ideal_computed_tokens([PromptShare("s", 512), PromptShare("s", 600, 512)], 256) == 600
    assert computed_over_ideal(900, 600) == 1.5
    assert computed_over_ideal(5, 0) is None
    with pytest.raises(ValueError):
        PromptShare("s", 10, 11)


def record(
    start: float, group: str, prompt: int, computed: int, shared: int | None
) -> RequestRecord:
    usage = {"prompt_tokens": prompt, "kv": {"computed_tokens": computed}}
    result = StreamResult(0.1, 0.2, "", (), usage, "0", 1)
    tag = Tag("s", None, MEASURE, f"{group}@{start}", group=group, shared_tokens=shared)
    return RequestRecord(0, "ON", tag, None, start, result)


def test_records_share_with_the_earlier_request_of_their_group_in_send_order() -> None:
    # A session (shared_tokens None: each turn resends the last prompt), listed out of order.
    turns = [record(2.0, "s", 700, 188, None), record(1.0, "s", 300, 300, None)]
    assert prompt_shares(turns) == [PromptShare("s", 300, 0), PromptShare("s", 700, 300)]
    assert computed_tokens(turns) == 488
    # ideal: 300 + (400 + 300 % 256): the run computed 488, ratio 488 / 744.
    assert ideal_computed_tokens(prompt_shares(turns), 256) == 744
