"""The keyed page checksum: its definition, what it catches that the old one did not, and
that every single flipped bit of a stored page (header or payload) fails its restore.

The old checksum (layout version 1) was [sum, position-weighted sum] of the payload's
64-bit words modulo 2**64; `old_checksum` below is that function, kept here only to show
that the crafted rewrites really did pass it.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.kvpool.connector import ConnectorOptions
from kvshare.kvpool.launch import PoolProcess
from kvshare.kvpool.layout import FMIX64_M1, FMIX64_M2, checksum_constants, payload_checksum
from kvshare.kvpool.page import HEADER_BYTES
from kvshare.validate.harness import ConnectorHarness
from tests.kvpool.pool_fixture import MIB, PoolFactory

WRAP = 1 << 64
KEY = bytes(range(16))


def old_checksum(words: np.ndarray) -> tuple[int, int]:
    values = [int(w) for w in words]
    return sum(values) % WRAP, sum((i + 1) * w for i, w in enumerate(values)) % WRAP


def fmix64(x: int) -> int:
    x ^= x >> 33
    x = x * FMIX64_M1 % WRAP
    x ^= x >> 33
    x = x * FMIX64_M2 % WRAP
    return x ^ (x >> 33)


def page_words(seed: int, n: int = 512) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, WRAP, n, dtype=np.uint64)


def test_checksum_is_the_documented_function_of_key_words_and_position() -> None:
    words = page_words(1, 300)
    k0, k1, k2, k3 = (int(k) for k in checksum_constants(KEY))
    assert k1 % 2 == 1 and k3 % 2 == 1
    first = 77  # a segment that starts at word 77 of its page
    lane_a = (
        sum(fmix64(((int(w) ^ k0) + (first + i) * k1) % WRAP) for i, w in enumerate(words)) % WRAP
    )
    lane_b = (
        sum(fmix64(((int(w) ^ k2) + (first + i) * k3) % WRAP) for i, w in enumerate(words)) % WRAP
    )
    assert payload_checksum(words, checksum_constants(KEY), first).tolist() == [lane_a, lane_b]


def test_cpu_checksum_over_many_chunks_wraps_like_python_ints() -> None:
    """Past the CPU path's chunk of 2**16 words, all-ones words (sums far past 2**64)."""
    words = np.full((1 << 16) + 5, WRAP - 1, dtype=np.uint64)
    k0, k1, _, _ = (int(k) for k in checksum_constants(KEY))
    lane_a = sum(fmix64(((WRAP - 1 ^ k0) + i * k1) % WRAP) for i in range(len(words))) % WRAP
    assert int(payload_checksum(words, checksum_constants(KEY))[0]) == lane_a


def plus_minus_rewrite(words: np.ndarray, i: int, d: int) -> np.ndarray:
    """+d on word i, -2d on word i+1, +d on word i+2: both old sums stay the same."""
    out = words.copy()
    for j, factor in ((i, 1), (i + 1, -2), (i + 2, 1)):
        out[j] = np.uint64((int(out[j]) + factor * d) % WRAP)
    return out


def crafted_pair_swaps(words: np.ndarray, i: int, j: int) -> tuple[np.ndarray, np.ndarray]:
    """A page whose words i, i+1 hold (x, y) and words j, j+1 hold (y, x), and the same
    page with both pairs swapped: the plain sum stays, the weighted sum moves by
    (x - y) + (y - x)."""
    page = words.copy()
    page[j], page[j + 1] = page[i + 1], page[i]
    swapped = page.copy()
    swapped[[i, i + 1, j, j + 1]] = page[[i + 1, i, j + 1, j]]
    return page, swapped


@given(st.integers(0, 509), st.integers(1, WRAP - 1), st.integers(0, 2**32))
def test_plus_minus_rewrite_passes_the_old_checksum_and_fails_the_new(
    i: int, d: int, seed: int
) -> None:
    words = page_words(seed)
    rewritten = plus_minus_rewrite(words, i, d)
    assert not np.array_equal(rewritten, words)
    assert old_checksum(rewritten) == old_checksum(words)
    constants = checksum_constants(KEY)
    assert not np.array_equal(
        payload_checksum(rewritten, constants), payload_checksum(words, constants)
    )


@given(st.integers(0, 200), st.integers(300, 510), st.integers(0, 2**32))
def test_crafted_word_swaps_pass_the_old_checksum_and_fail_the_new(
    i: int, j: int, seed: int
) -> None:
    words, swapped = crafted_pair_swaps(page_words(seed), i, j)
    assert not np.array_equal(swapped, words)
    assert old_checksum(swapped) == old_checksum(words)
    constants = checksum_constants(KEY)
    assert not np.array_equal(
        payload_checksum(swapped, constants), payload_checksum(words, constants)
    )


def test_same_bytes_under_another_key_or_position_checksum_differently() -> None:
    """A page copied into the wrong slot, or a segment read at the wrong offset, fails."""
    words = page_words(5)
    here = payload_checksum(words, checksum_constants(KEY))
    assert not np.array_equal(here, payload_checksum(words, checksum_constants(bytes(16))))
    assert not np.array_equal(here, payload_checksum(words, checksum_constants(KEY), first_word=1))
    # Zero pages (never written) do not checksum to zero.
    assert payload_checksum(np.zeros(64, dtype=np.uint64), checksum_constants(KEY)).all()


# ----------------------------------------------------------------------------- whole pages


@pytest.fixture(scope="module")
def pool() -> Iterator[PoolProcess]:
    factory = PoolFactory()
    yield factory.start(factory.config(size_bytes=64 * MIB, slab_bytes=4 * MIB))
    factory.close()


@pytest.fixture(scope="module")
def harness(pool: PoolProcess) -> Iterator[ConnectorHarness]:
    # tiny-gemma3 at 32-token chunks: 48 KiB pages, and a 64-token window, so a one-chunk
    # restore reads the whole page (both checksummed segments).
    options = ConnectorOptions(chunk_tokens=32)
    made = ConnectorHarness(
        pool.address, "tiny-gemma3", "cpu", torch.float32, 16, uuid.uuid4().hex, options
    )
    yield made
    made.connector.close()


@pytest.fixture(scope="module")
def trials() -> Iterator[int]:
    return itertools.count()


def flip_and_restore(
    harness: ConnectorHarness, trial: int, where: int, bit: int
) -> tuple[int, bool]:
    """Store trial's page, flip one bit at byte `where` of its slot, restore it."""
    key = harness.store_pattern(trial, 1)[0]
    client = harness.connector.client
    found = client.lookup([key])
    client.release(found.lease)
    assert found.pages, "the page was not committed"
    view = client.arena.view(found.pages[0].offset + where, 1)
    view[0] ^= 1 << bit
    hit, ok, blocks = harness.restore(trial, 1, poison=-3.0)
    harness.cache.blocks.release(blocks)
    return hit, ok


def test_an_intact_page_restores(harness: ConnectorHarness, trials: Iterator[int]) -> None:
    trial = next(trials)
    harness.store_pattern(trial, 1)
    hit, ok, blocks = harness.restore(trial, 1, poison=-3.0)
    harness.cache.blocks.release(blocks)
    assert hit == 32 and ok


@settings(max_examples=60, deadline=None)
@given(where=st.data(), bit=st.integers(0, 7))
def test_any_flipped_bit_of_header_or_payload_fails_the_restore(
    harness: ConnectorHarness, trials: Iterator[int], where: st.DataObject, bit: int
) -> None:
    payload = harness.connector.layout.payload_bytes if harness.connector.layout else 0
    at = where.draw(
        st.one_of(
            st.integers(0, HEADER_BYTES - 1), st.integers(HEADER_BYTES, HEADER_BYTES + payload - 1)
        ),
        label="byte",
    )
    failures = harness.connector.counters["load_failures"]
    hit, ok = flip_and_restore(harness, next(trials), at, bit)
    assert hit == 32 and not ok
    assert harness.connector.counters["load_failures"] == failures + 1
