"""Token positions to cache slots: `attention.token_slots`, which the eager step metadata
and the captured graphs' inputs share."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvshare.engine.attention import StepMeta, token_slots


@given(
    st.integers(1, 64).flatmap(
        lambda blocks: st.tuples(
            st.permutations(list(range(100, 100 + blocks))),
            st.sampled_from([1, 4, 16]),
            st.integers(0, 10_000),
            st.integers(0, 10_000),
        )
    )
)
def test_slots_of_any_run_of_positions_are_its_blocks_offsets(case: tuple) -> None:
    """Any contiguous run of positions, starting mid-table or at its end, maps to the
    blocks holding it (only those are read)."""
    table, block_size, a, b = case
    tokens = len(table) * block_size
    start, stop = sorted((a % tokens, b % tokens + 1))
    positions = np.arange(start, max(stop, start + 1))
    got = token_slots(table, positions, block_size)
    want = [table[p // block_size] * block_size + p % block_size for p in positions]
    assert got.tolist() == want


def test_a_steps_slot_mapping_and_keys_are_its_sequences_positions() -> None:
    """Sequence 0 brings positions 3-4 (block 7, then block 3), sequence 1 position 8
    (its third block, 6); the keys are every position up to each context length."""
    meta = StepMeta((2, 1), (5, 9), ((7, 3), (1, 2, 6)), 4, torch.device("cpu"))
    assert meta.slot_mapping.tolist() == [31, 12, 24]
    keys = meta.key_range(None)
    assert keys.slots.tolist() == [28, 29, 30, 31, 12, 4, 5, 6, 7, 8, 9, 10, 11, 24]
    assert keys.lens == (5, 9)
