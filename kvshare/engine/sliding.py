"""The sliding-window layers' blocks: a sequence holds only its window of them.

A sliding-window layer's query at position p reads the keys of (p - window, p]. A
sequence's sliding table runs parallel to its block table: entry i is a block of the
sliding tensor while a step may read it or a store may copy it, else `null` (the
tensor's last block, outside this manager). Before a step from position s the entries
below `keep_from(s)` are let go:
- the window of the step's first query starts at s - window + 1;
- with a pool (`chunk_tokens`), the chunk holding s is not complete yet, and its page
  needs every layer: its blocks stay until the step that completes it has issued its
  store (a store takes its own references on the blocks it copies).
So in a step of n tokens a sequence holds at most
ceil((max(window, chunk_tokens) - 1 + n) / block_size) + 1 sliding blocks.

Invariant: a sliding table is null entries followed by real ones, and every position a
step reads through a sliding layer (from s - window + 1 on) has a real entry.

Sliding blocks are prefix-cached under the same chained block hashes as the global ones:
one let go stays findable until it is reused. A prefix is resumable at r only if the
blocks of the window before r are cached: the sliding KV of earlier positions cannot be
recomputed from the global layers alone, since each sliding layer's input depends on
the window of the layer below, back to the first token.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvshare.engine.block_manager import BlockManager


class SlidingBlocks:
    """Blocks 0..num_blocks-1 of the sliding tensor; `null` (= num_blocks) is its last block.
    Not thread-safe: the engine loop is its only user."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        window: int,
        chunk_tokens: int | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        if window < 1:
            raise ValueError(f"the sliding window must be positive, got {window}")
        self.blocks = BlockManager(
            num_blocks, block_size, enable_prefix_caching=enable_prefix_caching
        )
        self.block_size = block_size
        self.window = window
        self.chunk_tokens = chunk_tokens
        self.null = num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    def window_from(self, position: int) -> int:
        """The first block a query at `position` reads."""
        return max(0, position - self.window + 1) // self.block_size

    def keep_from(self, position: int) -> int:
        """The first table entry a step from `position` keeps: its window, and with a pool
        the chunk not yet complete."""
        start = max(0, position - self.window + 1)
        if self.chunk_tokens is not None:
            start = min(start, position // self.chunk_tokens * self.chunk_tokens)
        return start // self.block_size

    def needed(self, table_len: int, new_len: int, position: int) -> int:
        """Fresh blocks `extend` takes to grow a table to new_len entries from `position`."""
        return max(0, new_len - max(table_len, self.keep_from(position)))

    def extend(self, table: list[int], new_len: int, position: int) -> None:
        """Grow `table` to new_len entries for a step from `position`: null below its
        keep_from, fresh blocks from there. The caller checked `needed` against free blocks."""
        keep = min(self.keep_from(position), new_len)
        if len(table) < keep:
            table += [self.null] * (keep - len(table))
        if len(table) < new_len:
            table += self.blocks.allocate(new_len - len(table))

    def trim(self, table: list[int], position: int) -> None:
        """Let go of the entries below keep_from(position)."""
        i = min(self.keep_from(position), len(table)) - 1
        dropped = []
        while i >= 0 and table[i] != self.null:  # the real entries are a suffix
            dropped.append(table[i])
            table[i] = self.null
            i -= 1
        self.blocks.release(dropped[::-1])

    def match(self, hashes: Sequence[bytes]) -> tuple[int, list[int]]:
        """The longest prefix of `hashes` (a cached global prefix) whose window is cached:
        its length m in blocks and the first m table entries (null below the window).
        Takes no references: `acquire` the result."""
        if not self.blocks.enable_prefix_caching:
            return 0, []
        cached = self.blocks.hash_to_block
        m = len(hashes)
        while m > 0:
            lo = self.window_from(m * self.block_size)
            missing = next((i for i in range(m - 1, lo - 1, -1) if hashes[i] not in cached), None)
            if missing is None:
                return m, [self.null] * lo + [cached[h] for h in hashes[lo:m]]
            m = missing  # a shorter prefix past `missing` would still read it
        return 0, []

    def real(self, table: Sequence[int]) -> list[int]:
        return [b for b in table if b != self.null]

    def num_free_among(self, table: Sequence[int]) -> int:
        """Entries of `table` that are free blocks (cached, not referenced)."""
        return sum(self.blocks.ref_count[b] == 0 for b in self.real(table))

    def acquire(self, table: Sequence[int]) -> None:
        self.blocks.acquire(self.real(table))

    def release(self, table: Sequence[int]) -> None:
        self.blocks.release(self.real(table))

    def register(self, table: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Make computed entries findable by their block hashes (null entries are skipped)."""
        self.blocks.register(*self._held(table, hashes))

    def forget(self, table: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Undo `register(table, hashes)` (BlockManager.forget)."""
        self.blocks.forget(*self._held(table, hashes))

    def _held(self, table: Sequence[int], hashes: Sequence[bytes]) -> tuple[list[int], list[bytes]]:
        pairs = [(b, h) for b, h in zip(table, hashes) if b != self.null]
        return [b for b, _ in pairs], [h for _, h in pairs]

    def num_held(self, table: Sequence[int]) -> int:
        return len(self.real(table))

    def reset_prefix_cache(self) -> int:
        return self.blocks.reset_prefix_cache()
