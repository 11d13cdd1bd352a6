"""Sequence.block_table_array: the block table as int32, converted incrementally. After
every kind of change the scheduler makes (extend in place, replace on admission, empty on
release) it equals the table; an extension of the same list converts only the new blocks
(the array's memory is reused)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.engine.sampling_params import SamplingParams
from kvshare.engine.sequence import Sequence

OPS = st.lists(
    st.tuples(st.sampled_from(["extend", "replace", "release", "read"]), st.integers(0, 40)),
    max_size=30,
)


def sequence() -> Sequence:
    return Sequence("s", [1, 2, 3], SamplingParams())


@settings(max_examples=300, deadline=None)
@given(OPS, st.randoms(use_true_random=False))
def test_the_array_is_the_table_after_any_change(ops: list[tuple[str, int]], rng) -> None:
    seq = sequence()
    for op, n in ops:
        if op == "extend":
            seq.block_table += [rng.randrange(1 << 20) for _ in range(n)]
        elif op == "replace":  # admission: a new list, maybe as long as the old one
            seq.block_table = [rng.randrange(1 << 20) for _ in range(n)]
        elif op == "release":
            seq.block_table = []
        array = seq.block_table_array()
        assert array.dtype == np.int32 and array.tolist() == seq.block_table


def test_an_extension_converts_only_the_new_blocks() -> None:
    seq = sequence()
    seq.block_table += list(range(100))
    first = seq.block_table_array()
    seq.block_table += [7]
    second = seq.block_table_array()
    assert np.shares_memory(first, second) and second.tolist() == [*range(100), 7]
    seq.block_table = [5, *seq.block_table[1:]]  # admission: a new list, converted whole
    assert seq.block_table_array().tolist() == seq.block_table
