"""Paged KV blocks: reference counts, a free list in LRU order, and GPU-local prefix caching.

A full block is identified by a chained hash over the token ids of every block up to and
including it, so equal hashes mean equal prefixes. Freed blocks keep their hash until the
block is reused, so a later request can still hit them (least recently freed goes first).

A block is *complete* when every layer's KV is in it. Blocks restored from the pool with
only the global layers (sliding-window layers are restored only near the resume point)
are incomplete: a prefix hit may cover them, but must not end where a sliding window
would read them.

A request's `cache_salt` (a tenant's secret) moves its chain to a root of its own, so
requests with different salts, or with and without one, never share a block: a tenant
cannot learn from hit counts or timing what another tenant's prompts were.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import xxhash

from kvshare.engine.cache_events import CacheEventLog

ROOT_HASH = b"kvshare-block-root"
# Cache events kept per block: a router polling every second misses none unless the whole
# cache turns over several times between two polls (then it gets a snapshot).
EVENTS_PER_BLOCK = 4
MAX_CACHE_SALT_CHARS = 1024
# Domain separation: a salted root is hashed from an input that starts with this, which
# no block hash's input does (those start with ROOT_HASH or another hash).
_SALT_DOMAIN = b"kvshare.cache_salt.v1:"


def check_cache_salt(cache_salt: object) -> str | None:
    """`cache_salt` as a request may carry it: None, or a non-empty string of at most
    MAX_CACHE_SALT_CHARS characters that encodes as UTF-8; ValueError otherwise."""
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    if not cache_salt:
        raise ValueError("cache_salt must be a non-empty string (leave it out for no salt)")
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(
            f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters, got {len(cache_salt)}"
        )
    try:
        cache_salt.encode()
    except UnicodeEncodeError:
        raise ValueError("cache_salt must be valid Unicode text (no lone surrogates)") from None
    return cache_salt


def salted_root(root: bytes, cache_salt: str | None) -> bytes:
    """The parent of a chain's first hash: `root` itself without a salt (the keys of
    unsalted requests never change), else a digest of root and salt."""
    if cache_salt is None:
        return root
    return xxhash.xxh3_128_digest(_SALT_DOMAIN + root + b"\0" + cache_salt.encode())


def block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    start: int = 0,
    parent: bytes = ROOT_HASH,
) -> list[bytes]:
    """Chained hashes of the full blocks of token_ids (int32 bytes) from block `start` on."""
    # Only the blocks hashed are converted, and sliced as bytes: a decode step that fills a
    # block of a 130k-token sequence must not convert the whole sequence again. A list is
    # converted by fromiter (2x faster than asarray, the same int32 values and errors).
    end = len(token_ids) // block_size * block_size
    ids = token_ids[start * block_size : end]
    if isinstance(ids, np.ndarray):
        data = ids.astype(np.int32, copy=False).tobytes()
    else:
        data = np.fromiter(ids, dtype=np.int32, count=len(ids)).tobytes()
    step = block_size * 4
    out = []
    for i in range(0, len(data), step):
        parent = xxhash.xxh3_128_digest(parent + data[i : i + step])
        out.append(parent)
    return out


def prompt_block_hashes(
    token_ids: Sequence[int] | np.ndarray, block_size: int, cache_salt: str | None
) -> list[bytes]:
    """The hashes the prefix cache knows a prompt's full blocks by: chained from the root
    of its salt (a sequence computes the same ones as its tokens come)."""
    return block_hashes(token_ids, block_size, parent=salted_root(ROOT_HASH, cache_salt))


class BlockManager:
    """Owns block ids 0..num_blocks-1. Not thread-safe: the engine loop is its only user."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        sliding_window: int | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.complete = [True] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        # Free blocks, least recently freed first. Cached ones stay findable by hash.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.events = CacheEventLog(EVENTS_PER_BLOCK * num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Cached blocks holding the longest usable prefix whose block hashes are `hashes`.

        Usable: every block in the sliding window before the prefix's end is complete.
        Does not take references; call `acquire` on the result.
        """
        if not self.enable_prefix_caching:
            return []
        matched = []
        for h in hashes:
            block = self.hash_to_block.get(h)
            if block is None:
                break
            matched.append(block)
        while matched and not self._window_complete(matched):
            matched.pop()
        return matched

    def _window_complete(self, blocks: list[int]) -> bool:
        if self.sliding_window is None:
            return True
        n = self.blocks_needed(self.sliding_window)
        return all(self.complete[b] for b in blocks[-n:])

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks (reviving free ones)."""
        # Per block, before a pool restore's copies are issued (8k blocks at 131k tokens),
        # as in allocate: the loop reads the lists through locals.
        ref_count, free = self.ref_count, self.free
        for b in blocks:
            if ref_count[b] == 0:
                del free[b]
            ref_count[b] += 1

    def allocate(self, n: int) -> list[int]:
        """n fresh, unshared blocks: the n least recently freed. Caller checks
        num_free_blocks first."""
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free)} free")
        # Per block, before a pool restore's copies are issued (8k blocks at 131k tokens):
        # the blocks are taken in one pass and the loop reads the lists through locals.
        out = list(itertools.islice(self.free, n))
        free, block_hash = self.free, self.block_hash
        ref_count, complete = self.ref_count, self.complete
        for b in out:
            del free[b]
            if (h := block_hash[b]) is not None:
                del self.hash_to_block[h]
                block_hash[b] = None
                self.events.removed(h)
            ref_count[b] = 1
            complete[b] = True
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block; blocks reaching zero become free (hash kept).

        Released in reverse so that a sequence's tail blocks are reused before its head,
        which is the part other requests are most likely to share.
        """
        # A restore's own references on its blocks (16k at 261,888 tokens) are dropped
        # after its copies, before the first token: the loop reads the lists through locals.
        ref_count, free = self.ref_count, self.free
        for b in reversed(blocks):
            held = ref_count[b]
            if held <= 0:
                raise RuntimeError(f"block {b} released more often than acquired")
            ref_count[b] = held - 1
            if held == 1:
                free[b] = None

    def register(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Make full, computed blocks findable by their chained hashes.

        A hash already owned by another block keeps its owner (both hold the same bytes).
        """
        if not self.enable_prefix_caching:
            return
        # 16k blocks at once after a 261,888-token restore: the loop reads through locals
        # and the events are logged in one call.
        hash_to_block, block_hash = self.hash_to_block, self.block_hash
        new = []
        for b, h in zip(blocks, hashes):
            if h not in hash_to_block and block_hash[b] is None:
                hash_to_block[h] = b
                block_hash[b] = h
                new.append(h)
        self.events.stored_many(new)

    def forget(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Undo `register(blocks, hashes)` for the pairs it made findable: their bytes turned
        out wrong (a restore that failed verification). A hash owned by another block
        stays."""
        for b, h in zip(blocks, hashes):
            if self.block_hash[b] == h and self.hash_to_block.get(h) == b:
                del self.hash_to_block[h]
                self.block_hash[b] = None
                self.events.removed(h)

    def mark_incomplete(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.complete[b] = False

    def mark_complete(self, blocks: Sequence[int]) -> None:
        """The engine will recompute these blocks, every layer of them (a failed restore)."""
        for b in blocks:
            self.complete[b] = True

    def all_complete(self, blocks: Sequence[int]) -> bool:
        return all(self.complete[b] for b in blocks)

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (admin reset). Returns how many blocks were cached."""
        n = len(self.hash_to_block)
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks
        self.events.reset()
        return n
