"""Paged decode attention in Triton (split-K "flash decoding").

One program per (sequence, KV head, split) walks its share of the sequence's context
straight out of the paged cache (no gather), computing all query heads of the KV head's
group at once; a second kernel merges the splits with their log-sum-exp. Reads each
key/value byte once, which is what the decode floor (bytes / HBM bandwidth) assumes.
The grid depends only on (batch, heads, splits), so the launch is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 64  # keys per loop iteration


@triton.jit
def _split_kernel(
    Q, K, V, TABLES, CTX, ACC, MAX, SUM,
    scale, window, table_stride, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(CTX + seq)
    start = 0
    if window > 0:
        start = tl.maximum(ctx - window, 0)
    per_split = tl.cdiv(tl.cdiv(ctx - start, num_splits), TILE) * TILE
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, ctx)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    q_heads = kv_head * GROUP + g
    q_mask = g < GROUP
    q = tl.load(Q + (seq * NUM_KV_HEADS * GROUP + q_heads)[:, None] * HEAD_DIM + d[None, :],
                mask=q_mask[:, None], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for t in range(lo, hi, TILE):
        pos = t + tl.arange(0, TILE)
        valid = pos < hi
        block = tl.load(TABLES + seq * table_stride + pos // BLOCK_SIZE, mask=valid, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        offs = (slot * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(K + offs, mask=valid[:, None], other=0.0)
        v = tl.load(V + offs, mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new

    row = (seq * NUM_KV_HEADS * GROUP + q_heads) * num_splits + split
    tl.store(MAX + row, m_i, mask=q_mask)
    tl.store(SUM + row, l_i, mask=q_mask)
    tl.store(ACC + row[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask[:, None])


@triton.jit
def _merge_kernel(ACC, MAX, SUM, OUT, num_splits,
                  HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr):
    row = tl.program_id(0)  # (sequence, query head)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    valid = s < num_splits
    m = tl.load(MAX + row * num_splits + s, mask=valid, other=float("-inf"))
    l_s = tl.load(SUM + row * num_splits + s, mask=valid, other=0.0)
    acc = tl.load(ACC + (row * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
                  mask=valid[:, None], other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(valid & (m > float("-inf")), tl.exp(m - m_max), 0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(OUT + row * HEAD_DIM + d, out.to(OUT.dtype.element_ty))


def num_splits_for(batch: int, num_kv_heads: int, max_context: int) -> int:
    """Enough programs to fill the GPU (~4 waves of 132 SMs), never splits under a tile."""
    want = max(1, (4 * 132) // max(1, batch * num_kv_heads))
    return max(1, min(want, triton.cdiv(max_context, TILE), 64))


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
    scale: float, window: int | None, num_splits: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] (one query per sequence); caches [slots, Hkv, D]; returns [B, Hq, D]."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if num_splits is None:
        width = block_tables.shape[1] * block_size
        num_splits = num_splits_for(batch, num_kv_heads, min(width, window or width))
    rows = batch * num_heads * num_splits
    acc = torch.empty((rows, head_dim), dtype=torch.float32, device=q.device)
    m = torch.empty(rows, dtype=torch.float32, device=q.device)
    s = torch.empty(rows, dtype=torch.float32, device=q.device)
    _split_kernel[(batch, num_kv_heads, num_splits)](
        q.contiguous(), k_cache, v_cache, block_tables, context_lens, acc, m, s,
        scale, window or 0, block_tables.stride(0), num_splits,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        NUM_KV_HEADS=num_kv_heads, BLOCK_SIZE=block_size, TILE=TILE,
    )
    out = torch.empty_like(q)
    _merge_kernel[(batch * num_heads,)](
        acc, m, s, out, num_splits, HEAD_DIM=head_dim,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
    )
    return out
