"""BlockManager: reference counts, the LRU free list, prefix-cache hashes, sliding windows.

A hypothesis state machine drives random allocate / match+acquire / register / forget /
release / mark_incomplete / reset sequences against a plain model of what the manager must hold,
and checks the invariants after every step. Example tests pin the single behaviours.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvshare.engine.block_manager import (
    MAX_CACHE_SALT_CHARS,
    ROOT_HASH,
    BlockManager,
    block_hashes,
    check_cache_salt,
    salted_root,
)
from kvshare.engine.sampling_params import SamplingParams
from kvshare.engine.sequence import Sequence

BS = 4  # tokens per block


def tokens_of(pattern: list[int], tail: int = 0) -> list[int]:
    """Full blocks whose content is one of a few values (so prefixes collide), plus a tail."""
    out = [t for p in pattern for t in [p] * BS]
    return out + [99] * tail


@dataclass
class Handle:
    """One holder of references: a sequence's block table (tokens None: raw allocation)."""

    blocks: list[int]
    tokens: list[int] | None


class BlockManagerMachine(RuleBasedStateMachine):
    NUM_BLOCKS = 10
    WINDOW: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(self.NUM_BLOCKS, BS, sliding_window=self.WINDOW)
        self.handles: list[Handle] = []
        # The model: LRU order of free blocks, hashes, completeness.
        self.free_order: list[int] = list(range(self.NUM_BLOCKS))
        self.hash_of: dict[int, bytes] = {}
        self.complete = [True] * self.NUM_BLOCKS

    # ---- helpers -------------------------------------------------------------------------
    def model_refs(self) -> list[int]:
        refs = [0] * self.NUM_BLOCKS
        for h in self.handles:
            for b in h.blocks:
                refs[b] += 1
        return refs

    def expected_match(self, hashes: list[bytes]) -> list[int]:
        owner = {h: b for b, h in self.hash_of.items()}
        chain = []
        for h in hashes:
            if h not in owner:
                break
            chain.append(owner[h])
        if self.WINDOW is None:
            return chain
        n = -(-self.WINDOW // BS)
        for length in range(len(chain), 0, -1):
            if all(self.complete[b] for b in chain[max(0, length - n) : length]):
                return chain[:length]
        return []

    def take_fresh(self, n: int) -> list[int]:
        fresh = self.bm.allocate(n)
        # LRU: the least recently freed blocks come out first, in that order.
        assert fresh == self.free_order[:n]
        del self.free_order[:n]
        held = {b for h in self.handles for b in h.blocks}
        for b in fresh:
            assert b not in held, f"block {b} handed out while another allocation holds it"
            assert self.bm.ref_count[b] == 1
            assert self.bm.block_hash[b] is None
            assert self.bm.complete[b]
            self.hash_of.pop(b, None)
            self.complete[b] = True
        return fresh

    # ---- rules ---------------------------------------------------------------------------
    @rule(n=st.integers(1, 4))
    def allocate_raw(self, n: int) -> None:
        if n > len(self.free_order):
            with pytest.raises(RuntimeError):
                self.bm.allocate(n)
            return
        self.handles.append(Handle(self.take_fresh(n), None))

    @rule(pattern=st.lists(st.integers(0, 2), max_size=6), tail=st.integers(0, BS - 1))
    def admit(self, pattern: list[int], tail: int) -> None:
        """What the scheduler does: match the prefix, acquire it, allocate the rest."""
        tokens = tokens_of(pattern, tail)
        hashes = block_hashes(tokens, BS)
        matched = self.bm.match_prefix(hashes)
        assert matched == self.expected_match(hashes)
        if self.WINDOW is not None and matched:
            # The next query reads keys back to position end - window + 1: all complete.
            end = len(matched) * BS
            first = max(0, end - self.WINDOW + 1) // BS
            assert all(self.bm.complete[b] for b in matched[first:])
        need = self.bm.blocks_needed(len(tokens)) - len(matched)
        reviving = [b for b in matched if self.bm.ref_count[b] == 0]
        if need > len(self.free_order) - len(reviving):
            return
        self.bm.acquire(matched)
        for b in reviving:
            self.free_order.remove(b)
            assert b not in self.bm.free
        self.handles.append(Handle(matched + self.take_fresh(need), tokens))

    def sequence(self, i: int) -> tuple[Handle, list[bytes]] | None:
        """The i-th (mod) holder that is a sequence, and its block hashes; None if none is."""
        seqs = [h for h in self.handles if h.tokens is not None]
        if not seqs:
            return None
        h = seqs[i % len(seqs)]
        assert h.tokens is not None
        return h, block_hashes(h.tokens, BS)

    @rule(i=st.integers(0, 100))
    def register(self, i: int) -> None:
        if (picked := self.sequence(i)) is None:
            return
        h, hashes = picked
        self.bm.register(h.blocks, hashes)
        owner = {hh: b for b, hh in self.hash_of.items()}
        for b, hh in zip(h.blocks, hashes):
            if hh not in owner and b not in self.hash_of:
                self.hash_of[b] = hh
                owner[hh] = b

    @rule(i=st.integers(0, 100))
    def forget(self, i: int) -> None:
        """A failed restore takes back its sequence's hashes (those its blocks own)."""
        if (picked := self.sequence(i)) is None:
            return
        h, hashes = picked
        self.bm.forget(h.blocks, hashes)
        for b, hh in zip(h.blocks, hashes):
            if self.hash_of.get(b) == hh:
                del self.hash_of[b]

    @rule(i=st.integers(0, 100))
    def release(self, i: int) -> None:
        if not self.handles:
            return
        h = self.handles.pop(i % len(self.handles))
        self.bm.release(h.blocks)
        refs = self.model_refs()
        for b in reversed(h.blocks):  # the tail of a table is freed (and reused) first
            if refs[b] == 0 and b not in self.free_order:
                self.free_order.append(b)

    @rule(i=st.integers(0, 100), j=st.integers(0, 100))
    def mark_incomplete(self, i: int, j: int) -> None:
        if not self.handles:
            return
        h = self.handles[i % len(self.handles)]
        if not h.blocks:
            return
        b = h.blocks[j % len(h.blocks)]
        self.bm.mark_incomplete([b])
        self.complete[b] = False

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.bm.reset_prefix_cache() == len(self.hash_of)
        self.hash_of.clear()

    # ---- invariants ----------------------------------------------------------------------
    @invariant()
    def ref_counts_match_holders(self) -> None:
        assert all(r >= 0 for r in self.bm.ref_count)
        assert self.bm.ref_count == self.model_refs()

    @invariant()
    def free_list_is_exactly_the_unreferenced_blocks_in_lru_order(self) -> None:
        assert set(self.bm.free) == {b for b, r in enumerate(self.bm.ref_count) if r == 0}
        assert list(self.bm.free) == self.free_order
        assert self.bm.num_free_blocks == len(self.free_order)

    @invariant()
    def hash_maps_agree(self) -> None:
        by_block = {b: h for b, h in enumerate(self.bm.block_hash) if h is not None}
        assert by_block == self.hash_of
        assert self.bm.hash_to_block == {h: b for b, h in by_block.items()}

    @invariant()
    def completeness_matches(self) -> None:
        assert self.bm.complete == self.complete


class SlidingWindowMachine(BlockManagerMachine):
    WINDOW = 6  # 2 blocks of 4


_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = _SETTINGS
TestSlidingWindowStateful = SlidingWindowMachine.TestCase
TestSlidingWindowStateful.settings = _SETTINGS


# ---- examples --------------------------------------------------------------------------


def admit(bm: BlockManager, tokens: list[int]) -> list[int]:
    hashes = block_hashes(tokens, BS)
    cached = bm.match_prefix(hashes)
    bm.acquire(cached)
    table = cached + bm.allocate(bm.blocks_needed(len(tokens)) - len(cached))
    bm.register(table, hashes)
    return table


def test_fresh_blocks_are_unshared_and_unhashed() -> None:
    bm = BlockManager(4, BS)
    a = bm.allocate(2)
    b = bm.allocate(2)
    assert not set(a) & set(b)
    assert all(bm.ref_count[x] == 1 and bm.block_hash[x] is None for x in a + b)
    with pytest.raises(RuntimeError, match="asked for 1 blocks, 0 free"):
        bm.allocate(1)


def test_release_frees_and_double_release_raises() -> None:
    bm = BlockManager(3, BS)
    table = bm.allocate(3)
    bm.release(table)
    assert bm.num_free_blocks == 3 and bm.usage == 0.0
    with pytest.raises(RuntimeError, match="released more often"):
        bm.release(table[:1])


def test_released_cached_prefix_is_matched_and_revived() -> None:
    bm = BlockManager(8, BS)
    tokens = tokens_of([0, 1, 2], tail=1)
    first = admit(bm, tokens)
    bm.release(first)
    assert bm.num_free_blocks == 8
    hashes = block_hashes(tokens, BS)
    assert bm.match_prefix(hashes) == first[:3]  # the partial tail block is not cached
    second = admit(bm, tokens)
    assert second[:3] == first[:3]
    assert all(bm.ref_count[b] == 1 and b not in bm.free for b in second)


def test_shared_prefix_is_reference_counted() -> None:
    bm = BlockManager(8, BS)
    a = admit(bm, tokens_of([0, 1]))
    b = admit(bm, tokens_of([0, 1, 2]))
    assert b[:2] == a and [bm.ref_count[x] for x in a] == [2, 2]
    bm.release(a)
    assert [bm.ref_count[x] for x in a] == [1, 1] and not set(a) & set(bm.free)


def test_least_recently_freed_block_is_reused_first() -> None:
    bm = BlockManager(4, BS)
    blocks = bm.allocate(4)
    for b in (blocks[2], blocks[0], blocks[3], blocks[1]):
        bm.release([b])
    assert bm.allocate(4) == [blocks[2], blocks[0], blocks[3], blocks[1]]


def test_release_frees_a_table_tail_first() -> None:
    bm = BlockManager(3, BS)
    table = bm.allocate(3)
    bm.release(table)
    assert bm.allocate(1) == [table[-1]]


def test_reuse_evicts_the_hash_of_a_cached_block() -> None:
    bm = BlockManager(2, BS)
    tokens = tokens_of([0, 1])
    table = admit(bm, tokens)
    bm.release(table)
    bm.allocate(1)  # reuses table[1] (freed first), which drops its hash
    assert bm.match_prefix(block_hashes(tokens, BS)) == table[:1]
    assert len(bm.hash_to_block) == 1


def test_register_keeps_the_first_owner_of_a_hash() -> None:
    bm = BlockManager(4, BS)
    hashes = block_hashes(tokens_of([0]), BS)
    a, b = bm.allocate(1), bm.allocate(1)
    bm.register(a, hashes)
    bm.register(b, hashes)
    assert bm.hash_to_block == {hashes[0]: a[0]} and bm.block_hash[b[0]] is None


def test_forget_takes_back_only_what_register_made_findable() -> None:
    """A failed restore's blocks lose their hashes (and the router hears of it); a hash
    another block owns, and the blocks' other cached neighbours, stay."""
    bm = BlockManager(6, BS)
    hashes = block_hashes(tokens_of([0, 1, 2]), BS)
    owner = bm.allocate(1)
    bm.register(owner, hashes[:1])
    restored = bm.allocate(3)
    bm.register(restored, hashes)  # hashes[0] keeps its owner
    before = bm.events.last
    bm.forget(restored, hashes)
    assert bm.hash_to_block == {hashes[0]: owner[0]}
    assert [bm.block_hash[b] for b in restored] == [None, None, None]
    change = bm.events.since(bm.events.generation, before, lambda: ())
    assert change.removed == tuple(hashes[1:]) and change.stored == ()
    bm.release(restored)
    assert bm.match_prefix(hashes) == owner


def test_reset_prefix_cache_forgets_every_hash() -> None:
    bm = BlockManager(4, BS)
    table = admit(bm, tokens_of([0, 1, 2]))
    bm.release(table)
    assert bm.reset_prefix_cache() == 3
    assert bm.match_prefix(block_hashes(tokens_of([0, 1, 2]), BS)) == []
    assert bm.num_free_blocks == 4


def test_prefix_caching_disabled_never_matches() -> None:
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    table = admit(bm, tokens_of([0, 1]))
    assert bm.hash_to_block == {}
    bm.release(table)
    assert bm.match_prefix(block_hashes(tokens_of([0, 1]), BS)) == []


def test_match_never_ends_on_an_incomplete_block_inside_the_window() -> None:
    bm = BlockManager(8, BS, sliding_window=2 * BS)  # the window spans the last 2 blocks
    tokens = tokens_of([0, 1, 2, 0, 1])
    table = admit(bm, tokens)
    hashes = block_hashes(tokens, BS)
    bm.mark_incomplete([table[1]])  # e.g. restored from the pool without sliding layers
    assert not bm.all_complete(table)
    # A prefix of L blocks is read back over blocks L-2 and L-1: L = 2 or 3 would read block 1.
    assert bm.match_prefix(hashes) == table
    assert bm.match_prefix(hashes[:4]) == table[:4]
    assert bm.match_prefix(hashes[:3]) == table[:1]
    bm.mark_incomplete([table[4]])
    assert bm.match_prefix(hashes) == table[:4]
    # Without a window, completeness does not matter.
    full = BlockManager(8, BS)
    t2 = admit(full, tokens)
    full.mark_incomplete(t2)
    assert full.match_prefix(hashes) == t2


def test_block_hashes_chain_over_the_whole_prefix() -> None:
    a = block_hashes(tokens_of([0, 1]), BS)
    b = block_hashes(tokens_of([2, 1]), BS)
    assert len(a) == 2 and a[1] != b[1]  # same block content, different prefix
    assert block_hashes(tokens_of([0, 1], tail=3), BS) == a
    assert block_hashes(tokens_of([0, 1]), BS, start=1, parent=a[0]) == a[1:]


def _reference_hashes(ids: list[int], start: int, parent: bytes) -> list[bytes]:
    """The chain's definition: xxh3-128 of the parent and the block as little-endian int32."""
    out = []
    for b in range(start, len(ids) // BS):
        parent = xxhash.xxh3_128_digest(
            parent + struct.pack(f"<{BS}i", *ids[b * BS : (b + 1) * BS])
        )
        out.append(parent)
    return out


def test_block_hashes_agree_whatever_holds_the_ids() -> None:
    """A list or tuple (converted by fromiter), an int32 or int64 array (a sequence's
    prompt array), from any start block: the same chain; an id beyond int32 still raises."""
    rng = random.Random(3)
    tokens = [rng.randrange(0, 2**31) for _ in range(10 * BS + 3)]
    for start, parent in ((0, ROOT_HASH), (3, b"p" * 16)):
        expected = _reference_hashes(tokens, start, parent)
        assert block_hashes(tokens, BS, start, parent) == expected
        assert block_hashes(tuple(tokens), BS, start, parent) == expected
        for dtype in (np.int32, np.int64):
            assert block_hashes(np.asarray(tokens, dtype=dtype), BS, start, parent) == expected
    with pytest.raises(OverflowError):
        block_hashes([2**31] * BS, BS)


def test_a_sequence_hashes_its_prompt_from_its_array_and_its_outputs_from_its_list() -> None:
    rng = random.Random(4)
    tokens = [rng.randrange(0, 1000) for _ in range(9 * BS + 2)]
    seq = Sequence("r", tokens[: 5 * BS + 1], SamplingParams())
    seq.update_block_hashes(BS)
    for token in tokens[5 * BS + 1 :]:  # decode past the prompt
        seq.token_ids.append(token)
        seq.update_block_hashes(BS)
    assert seq.block_hashes == _reference_hashes(tokens, 0, ROOT_HASH)
    assert seq.token_array().dtype == np.int32 and seq.token_array().tolist() == tokens
    with pytest.raises(ValueError, match="prompt_array"):
        Sequence("r", [1, 2, 3], SamplingParams(), prompt_array=np.asarray([1, 2], np.int32))


def test_invalid_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        BlockManager(0, BS)


def test_unsalted_block_hashes_are_unchanged() -> None:
    """Regression guard: no salt keeps the chain (and the GPU cache hits) of before salts."""
    assert salted_root(ROOT_HASH, None) == ROOT_HASH
    pinned = ["25226e89f2d42d7f63949948c272071e", "bdcc1f30fbbcecc1291ca3d9235ed25c"]
    assert [h.hex() for h in block_hashes(list(range(8)), BS)] == pinned
    seq = Sequence("r", list(range(9)), SamplingParams())
    seq.update_block_hashes(BS)
    assert [h.hex() for h in seq.block_hashes] == pinned


def test_salted_sequences_share_no_block_with_other_salts() -> None:
    tokens = tokens_of([0, 1, 2], tail=1)
    chains = []
    for salt in (None, "tenant-a", "tenant-b"):
        seq = Sequence("r", list(tokens), SamplingParams(), cache_salt=salt)
        seq.update_block_hashes(BS)
        chains.append(seq.block_hashes)
    assert all(len(chain) == 3 for chain in chains)
    every_hash = [h for chain in chains for h in chain]
    assert len(set(every_hash)) == len(every_hash)
    # A manager holding tenant-a's blocks matches them for tenant-a only.
    bm = BlockManager(8, BS)
    table = bm.allocate(3)
    bm.register(table, chains[1])
    assert bm.match_prefix(chains[1]) == table
    assert bm.match_prefix(chains[0]) == [] and bm.match_prefix(chains[2]) == []


@pytest.mark.parametrize(
    ("salt", "says"),
    [
        ("", "non-empty"),
        (5, "must be a string"),
        (["a"], "must be a string"),
        ("x" * (MAX_CACHE_SALT_CHARS + 1), "at most"),
        ("\ud800", "lone surrogate"),
    ],
)
def test_malformed_cache_salts_are_refused(salt: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        check_cache_salt(salt)
    assert check_cache_salt("x" * MAX_CACHE_SALT_CHARS) == "x" * MAX_CACHE_SALT_CHARS
