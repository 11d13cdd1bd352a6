"""What a pool page holds, and its checksum.

A page holds one chunk (chunk_tokens tokens) of every layer the model needs to resume:
`[cache slot][K|V][token][kv_head][head_dim]`, cache slots in the engine's order (global
layers first, then sliding-window layers). So the global layers are one contiguous
prefix of the page: a restore outside the sliding window copies just that prefix.

Each part (global, sliding) has its own 16-byte checksum so that a partial restore can
be verified. The checksum is exact integer arithmetic over the bytes viewed as int64
words (sum, and position-weighted sum, modulo 2**64): the same function gives the same
bits on the CPU and on CUDA, is cheap on the GPU (no host pass over MiBs), and any
single flipped bit changes the plain sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvshare.engine.connector import KVCacheLayout

# Bump when the byte layout of pages changes: it is part of the pool namespace.
LAYOUT_VERSION = 1
CHECKSUM_BYTES = 16


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


def word_weights(num_words: int, device: torch.device) -> torch.Tensor:
    return torch.arange(1, num_words + 1, dtype=torch.int64, device=device)


def checksum_rows_into(rows: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
    """Write [sum, weighted sum] of each row's int64 words into out (int64 [rows, 2], same
    device). Sums wrap modulo 2**64, so a row's checksum is the same however rows are batched.

    Enqueued on the current stream; nothing waits for it on the host.
    """
    words = rows.view(torch.int64)
    out.copy_(torch.stack((words.sum(1), (words * weights[: words.shape[1]]).sum(1)), 1))


def checksum_into(data: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
    """checksum_rows_into for one contiguous byte range; out is int64 [2]."""
    checksum_rows_into(data.view(1, -1), weights, out.view(1, 2))


def checksum_to_bytes(values: np.ndarray) -> bytes:
    """int64 [2] -> 16 bytes (little-endian), the form stored in headers and the index."""
    return np.asarray(values, dtype="<i8").tobytes()
