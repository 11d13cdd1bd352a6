"""What a pool page holds, and its checksum.

A page holds one chunk (chunk_tokens tokens) of every layer the model needs to resume:
`[cache slot][K|V][token][kv_head][head_dim]`, cache slots in the engine's order (global
layers first, then sliding-window layers). So the global layers are one contiguous
prefix of the page: a restore outside the sliding window copies just that prefix.

Each part (global, sliding) has its own 16-byte checksum so that a partial restore can
be verified. The checksum is keyed by the page's key: four 64-bit constants k0..k3 come
from a keyed hash of the key, and over the payload viewed as little-endian 64-bit words
w at word index i (counted from the start of the payload, so a part's checksum also
binds where it lies)

    lane a = sum of fmix64((w ^ k0) + i * k1),  lane b = sum of fmix64((w ^ k2) + i * k3)

modulo 2**64, fmix64 being MurmurHash3's finalizer. Why this shape:
- fmix64 is a bijection: changing any one word (any flipped bit) always changes both lanes;
- it is nonlinear, so rewrites that keep linear sums (+d, -2d, +d on three neighbours,
  pairs of words swapped) change it: without the constants, a multi-word change keeps
  both 64-bit lanes only by chance;
- the same bytes under another key (a page copied to the wrong slot, a stale slot)
  checksum differently;
- sums modulo 2**64 do not depend on the order of the words, so the GPU reduces them in
  parallel (checksum_kernel.py) to the same bits as payload_checksum here.
It is not a MAC: someone who can read a page's key can compute its constants and forge
a collision (fmix64 is invertible). It guards against bugs and corruption, not a hostile
writer of the arena.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvshare.engine.connector import KVCacheLayout

# Bump when the byte layout of pages changes: it is part of the pool namespace.
LAYOUT_VERSION = 2
CHECKSUM_BYTES = 16

FMIX64_M1 = 0xFF51AFD7ED558CCD
FMIX64_M2 = 0xC4CEB9FE1A85EC53
_CONSTANTS_PERSON = b"kvshare.page.v2"
_CPU_CHUNK_WORDS = 1 << 16  # bounds the temporaries of a CPU checksum (512 KiB each)


@dataclass(frozen=True)
class PageLayout:
    chunk_tokens: int
    block_size: int
    num_slots: int
    num_global_slots: int
    slot_bytes: int  # bytes of one cache slot (layer) of one chunk: K and V
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.chunk_tokens % self.block_size:
            raise ValueError(
                f"chunk_tokens ({self.chunk_tokens}) must be a multiple of the block size ({self.block_size})"
            )
        if self.payload_bytes % 8:
            raise ValueError("page payload must be a multiple of 8 bytes")

    @classmethod
    def of(cls, cache: KVCacheLayout, chunk_tokens: int) -> PageLayout:
        return cls(
            chunk_tokens=chunk_tokens,
            block_size=cache.block_size,
            num_slots=cache.num_slots,
            num_global_slots=cache.num_global_slots,
            slot_bytes=cache.bytes_per_token_per_slot * chunk_tokens,
            dtype=cache.kv.dtype,
        )

    @property
    def blocks_per_page(self) -> int:
        return self.chunk_tokens // self.block_size

    @property
    def payload_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def global_bytes(self) -> int:
        """Bytes of the global-layer prefix (the whole page when no layer slides)."""
        if self.num_global_slots == self.num_slots:
            return self.payload_bytes
        return self.num_global_slots * self.slot_bytes

    @property
    def num_segments(self) -> int:
        return 1 if self.global_bytes == self.payload_bytes else 2

    def segments(self, nbytes: int) -> list[tuple[int, int]]:
        """(start, stop) byte ranges with their own checksum inside the first nbytes."""
        bounds = [(0, self.global_bytes), (self.global_bytes, self.payload_bytes)]
        return [(a, b) for a, b in bounds[: self.num_segments] if b <= nbytes]


def checksum_constants(key: bytes) -> np.ndarray:
    """The page checksum's constants k0..k3 (uint64 [4]) for a page key; k1 and k3, the
    position multipliers, are odd so that distinct word indices give distinct offsets."""
    return checksum_constants_table([key])[0]


def checksum_constants_table(keys: Sequence[bytes]) -> np.ndarray:
    """checksum_constants of every key, uint64 [len(keys), 4], in one array: a restore
    builds this table for every page on the host while its first copies run (512 pages of
    a 131k-token hit took ~3 ms one key at a time on a 2-core machine)."""
    digests = b"".join(
        hashlib.blake2b(key, digest_size=32, person=_CONSTANTS_PERSON).digest() for key in keys
    )
    constants = np.frombuffer(digests, dtype="<u8").astype(np.uint64).reshape(len(keys), 4)
    constants[:, [1, 3]] |= np.uint64(1)
    return constants


def _fmix64(x: np.ndarray, scratch: np.ndarray) -> None:
    """MurmurHash3's 64-bit finalizer, in place (uint64 arithmetic wraps)."""
    for multiplier in (FMIX64_M1, FMIX64_M2):
        np.right_shift(x, 33, out=scratch)
        x ^= scratch
        x *= np.uint64(multiplier)
    np.right_shift(x, 33, out=scratch)
    x ^= scratch


def payload_checksum(words: np.ndarray, constants: np.ndarray, first_word: int = 0) -> np.ndarray:
    """[lane a, lane b] (uint64 [2]) of `words` (uint64 [n], word `first_word` of its page
    onwards) under `constants` (checksum_constants). The GPU computes the same bits."""
    lanes, chunk_lanes = np.zeros(2, dtype=np.uint64), np.empty(2, dtype=np.uint64)
    n = min(len(words), _CPU_CHUNK_WORDS)
    index, mixed, scratch = (np.empty(n, dtype=np.uint64) for _ in range(3))
    for start in range(0, len(words), _CPU_CHUNK_WORDS):
        chunk = words[start : start + _CPU_CHUNK_WORDS]
        m = len(chunk)
        index[:m] = np.arange(first_word + start, first_word + start + m, dtype=np.uint64)
        for lane, (k_xor, k_mul) in enumerate(
            ((constants[0], constants[1]), (constants[2], constants[3]))
        ):
            np.bitwise_xor(chunk, k_xor, out=mixed[:m])
            np.multiply(index[:m], k_mul, out=scratch[:m])
            mixed[:m] += scratch[:m]
            _fmix64(mixed[:m], scratch[:m])
            chunk_lanes[lane] = mixed[:m].sum(dtype=np.uint64)
        lanes += chunk_lanes  # array arithmetic: wraps without an overflow warning
    return lanes


def payload_words(data: torch.Tensor) -> np.ndarray:
    """A contiguous CPU byte tensor (a multiple of 8 bytes) as little-endian uint64 words,
    without a copy."""
    return data.numpy().view("<u8")
