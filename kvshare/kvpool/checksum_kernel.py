"""The page checksum (layout.py) on the GPU: one Triton launch per page group.

Each program mixes one tile of one page row's words and adds its partial lane sums to the
page's sums with 64-bit atomics. Addition modulo 2**64 is associative and commutative,
so the result is the same bits as layout.payload_checksum however the tiles are split or
ordered. A row holds the first nbytes of its page's payload: words before `split` are
segment 0 (the global layers), the rest segment 1, each word at its index in the page.

The work per word (two fmix64, about 60 integer instructions) is far below the PCIe
copy's pace: the kernel runs on the scatter stream while the next group is copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvshare.kvpool.layout import FMIX64_M1, FMIX64_M2


@triton.jit
def _fmix64(x, M1: tl.constexpr, M2: tl.constexpr):
    x ^= x >> 33
    x *= M1
    x ^= x >> 33
    x *= M2
    x ^= x >> 33
    return x


@triton.jit
def _checksum_kernel(
    ROWS,
    CONSTANTS,
    SUMS,
    row_stride,
    num_words,
    first_word,
    split,
    TILE: tl.constexpr,
    BLOCK: tl.constexpr,
    M1: tl.constexpr,
    M2: tl.constexpr,
):
    # Program (page, tile). ROWS: int64 words; CONSTANTS: int64 [pages, 4] (k0..k3 as
    # bits); SUMS: int64 [pages, 2 segments, 2 lanes], added to.
    page = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1).to(tl.int64)
    k0 = tl.load(CONSTANTS + page * 4).to(tl.uint64, bitcast=True)
    k1 = tl.load(CONSTANTS + page * 4 + 1).to(tl.uint64, bitcast=True)
    k2 = tl.load(CONSTANTS + page * 4 + 2).to(tl.uint64, bitcast=True)
    k3 = tl.load(CONSTANTS + page * 4 + 3).to(tl.uint64, bitcast=True)
    a0 = tl.zeros([BLOCK], dtype=tl.uint64)
    b0 = tl.zeros([BLOCK], dtype=tl.uint64)
    a1 = tl.zeros([BLOCK], dtype=tl.uint64)
    b1 = tl.zeros([BLOCK], dtype=tl.uint64)
    row = ROWS + page * row_stride
    for start in range(0, TILE, BLOCK):
        idx = tile * TILE + start + tl.arange(0, BLOCK)
        valid = idx < num_words
        w = tl.load(row + idx, mask=valid, other=0).to(tl.uint64, bitcast=True)
        i = (idx + first_word).to(tl.uint64)
        a = tl.where(valid, _fmix64((w ^ k0) + i * k1, M1, M2), 0)
        b = tl.where(valid, _fmix64((w ^ k2) + i * k3, M1, M2), 0)
        second = idx + first_word >= split
        a0 += tl.where(second, 0, a)
        b0 += tl.where(second, 0, b)
        a1 += tl.where(second, a, 0)
        b1 += tl.where(second, b, 0)
    out = SUMS + page * 4
    tl.atomic_add(out, tl.sum(a0).to(tl.int64, bitcast=True))
    tl.atomic_add(out + 1, tl.sum(b0).to(tl.int64, bitcast=True))
    tl.atomic_add(out + 2, tl.sum(a1).to(tl.int64, bitcast=True))
    tl.atomic_add(out + 3, tl.sum(b1).to(tl.int64, bitcast=True))


def checksum_rows(
    rows: torch.Tensor,
    constants: torch.Tensor,
    sums: torch.Tensor,
    split_bytes: int,
    first_byte: int = 0,
    block_words: int = 1024,
    tile_blocks: int = 16,
) -> None:
    """Add the checksums of uint8 rows [pages, nbytes] (row stride a multiple of 8 bytes)
    to `sums` (int64 [pages, 2, 2], zeroed by the caller): each row holds its page's
    payload bytes [first_byte, first_byte + nbytes); segment 0 is payload bytes
    [0, split_bytes), segment 1 the rest. Rows of the other parts of the same pages,
    added to the same sums, complete the pages' checksums. `constants` is int64 [pages,
    4], one page's checksum_constants per row. One launch on the current stream; a
    program covers tile_blocks iterations of block_words words (a power of two)."""
    pages, nbytes = rows.shape
    assert rows.dtype == torch.uint8 and nbytes % 8 == 0 and split_bytes % 8 == 0
    assert first_byte % 8 == 0
    assert (
        constants.shape == (pages, 4)
        and constants.dtype == torch.int64
        and constants.is_contiguous()
    )
    assert sums.shape == (pages, 2, 2) and sums.dtype == torch.int64 and sums.is_contiguous()
    if not pages or not nbytes:
        return
    words = rows.view(torch.int64)
    num_words = nbytes // 8
    block = min(block_words, triton.next_power_of_2(num_words))
    tile = block * min(tile_blocks, triton.cdiv(num_words, block))
    _checksum_kernel[(pages, triton.cdiv(num_words, tile))](
        words,
        constants,
        sums,
        words.stride(0),
        num_words,
        first_byte // 8,
        split_bytes // 8,
        TILE=tile,
        BLOCK=block,
        M1=FMIX64_M1,
        M2=FMIX64_M2,
    )
