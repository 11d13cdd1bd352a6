"""Paged attention in Triton (split-K "flash decoding") for decode and short causal chunks.

One program per (sequence x query block, KV head, split) walks its share of the keys its
queries see straight out of the paged cache (no gather); a second kernel merges the splits
with their log-sum-exp. The program's query tile holds (new token, group head) pairs, so
all query heads of a KV head's group, and all of a sequence's few new tokens, share each
key/value load: the keys are read once per query block, which is what the decode floor
(bytes / HBM bandwidth) assumes, and splitting the context keeps a lone long sequence
(e.g. 32 new tokens after a 128k-token prefix restore) from running on a few SMs.

Decode (one token per sequence, `paged_decode_attention`) takes a constexpr path with no
query offsets and no causal mask; its grid depends only on (batch, heads, splits), so the
launch is CUDA-graph safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvshare.engine import kv_fp8
from kvshare.engine.memory import PAGED_TILE_ROWS

TILE = 64  # keys per loop iteration of a decode program (split_tile for several tokens)
MAX_QUERY = (
    64  # most new tokens per sequence the paged path serves; longer chunks go to varlen flash
)
# An fp8 cache's keys and values meet the query in float16 dots (below, in the kernel);
# False: in the query's dtype.
FP8_DOT_F16 = True


@triton.jit
def _split_kernel(
    Q,
    K,
    V,
    K_SCALE,
    V_SCALE,
    TABLES,
    CTX,
    CU_Q,
    ACC,
    MAX,
    SUM,
    scale,
    window,
    table_stride,
    num_splits,
    q_blocks,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    VARLEN: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_F16: tl.constexpr,
):
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if VARLEN:
        seq = tl.program_id(0) // q_blocks
        row0 = (tl.program_id(0) % q_blocks) * ROWS  # first (token, head) row of this program
        ctx = tl.load(CTX + seq)
        q_start = tl.load(CU_Q + seq)
        q_len = tl.load(CU_Q + seq + 1) - q_start
        n_rows = q_len * GROUP
        if row0 >= n_rows:  # a query block past this sequence's tokens (max_q sized the grid)
            return
        # The new tokens are the last q_len keys: token t sits at position ctx - q_len + t.
        first = ctx - q_len + row0 // GROUP
        last = ctx - q_len + (tl.minimum(row0 + ROWS, n_rows) - 1) // GROUP
    else:  # decode: token `seq` is sequence `seq`'s only query, at position ctx - 1
        seq = tl.program_id(0)
        row0 = 0
        ctx = tl.load(CTX + seq)
        q_start = seq
        q_len = 1
        n_rows = GROUP
        first = ctx - 1
        last = ctx - 1
    # Keys any row of the block sees: [first - window + 1, last]; the splits share them.
    start = 0
    if window > 0:
        start = tl.maximum(first - window + 1, 0)
    per_split = tl.cdiv(tl.cdiv(last + 1 - start, num_splits), TILE) * TILE
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, last + 1)

    r = row0 + tl.arange(0, ROWS)
    tok = r // GROUP
    row_ok = r < n_rows
    d = tl.arange(0, HEAD_DIM)
    # Row of (token, query head) in the packed [tokens, heads] layout of Q and the output.
    # Decode's rows are its group's heads, contiguous: written so, sm_90 register use stays
    # the old decode kernel's (the // and % form costs up to 50 more at head dim 256).
    if VARLEN:
        out_row = (q_start + tok) * (NUM_KV_HEADS * GROUP) + kv_head * GROUP + r % GROUP
    else:
        out_row = q_start * (NUM_KV_HEADS * GROUP) + kv_head * GROUP + r
    out_row = out_row.to(tl.int64)
    q = tl.load(Q + out_row[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0.0)
    dot_dtype = Q.dtype.element_ty
    if KV_FP8 and FP8_F16 and Q.dtype.element_ty != tl.float32:
        # e4m3 -> float16 is one conversion, -> bfloat16 three (through float32): with
        # every key and value converted in every program, they set the kernel's time. A
        # bfloat16 query is exact in float16 up to its range, which it is clamped to (a
        # float32 query, on the CPU, keeps float32).
        dot_dtype = tl.float16
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(dot_dtype)
    q_pos = ctx - q_len + tok
    q_lo = tl.where(window > 0, q_pos - window + 1, 0)  # the engine's window: key > pos - W

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for t in range(lo, hi, TILE):
        pos = t + tl.arange(0, TILE)
        valid = pos < hi
        block = tl.load(TABLES + seq * table_stride + pos // BLOCK_SIZE, mask=valid, other=0)
        block = block.to(tl.int64)  # int64: caches pass 2**31 elements
        if KV_FP8:
            # A packed block is its values [Hkv, BLOCK_SIZE, D] then its float32 scales
            # [Hkv, BLOCK_SIZE] (kv_fp8.PackedBlocks): value rows D bytes apart, 16-byte
            # aligned for D % 16 == 0, so the tile comes in 16-byte copies.
            head_slot = kv_head * BLOCK_SIZE + pos % BLOCK_SIZE
            offs = (block * BLOCK_BYTES + head_slot * HEAD_DIM)[:, None] + d[None, :]
            scale_at = block * (BLOCK_BYTES // 4) + VALUE_BYTES // 4 + head_slot
        else:
            kv_row = (block * BLOCK_SIZE + pos % BLOCK_SIZE) * NUM_KV_HEADS + kv_head
            offs = kv_row[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(K + offs, mask=valid[:, None], other=0)
        v = tl.load(V + offs, mask=valid[:, None], other=0)
        if KV_FP8:
            # e4m3 -> the dot's dtype is exact; each key's scale multiplies its score
            # column, each value's its column of p (below).
            k = k.to(tl.float8e4nv, bitcast=True).to(dot_dtype)
            v = v.to(tl.float8e4nv, bitcast=True).to(dot_dtype)
            k_scale = tl.load(K_SCALE + scale_at, mask=valid, other=0.0)
            v_scale = tl.load(V_SCALE + scale_at, mask=valid, other=0.0)
            scores = tl.dot(q, tl.trans(k)).to(tl.float32) * (k_scale[None, :] * scale)
        else:
            scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        if VARLEN:  # per-row causal and window bounds; decode's single row is covered by [lo, hi)
            seen = (
                valid[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] >= q_lo[:, None])
            )
        else:
            seen = valid[None, :]
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row may see no key of this tile yet (causal/window): keep exp() off -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_FP8:
            # p x v_scale relative to the tile's largest scale, so that it stays in [0, 1]
            # (no fp16 underflow) and the dot's result is scaled back in float32.
            v_top = tl.max(v_scale, 0)
            v_top = tl.where(v_top > 0, v_top, 1.0)
            pv = p * (v_scale / v_top)[None, :]
            acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v).to(tl.float32) * v_top
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new

    row = out_row * num_splits + split
    tl.store(MAX + row, m_i, mask=row_ok)
    tl.store(SUM + row, l_i, mask=row_ok)
    tl.store(ACC + row[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _merge_kernel(
    ACC,
    MAX,
    SUM,
    OUT,
    CU_Q,
    num_splits,
    batch,
    num_heads,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    VARLEN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # (query token, query head)
    d = tl.arange(0, HEAD_DIM)
    if VARLEN:  # noqa: SIM102 (a constexpr branch: CU_Q holds batch + 1 entries only then)
        # Rows past the step's last token (a captured graph's padding) have no split
        # written: zeros, never whatever their buffers held.
        if row >= tl.load(CU_Q + batch).to(tl.int64) * num_heads:
            tl.store(OUT + row * HEAD_DIM + d, tl.zeros([HEAD_DIM], OUT.dtype.element_ty))
            return
    s = tl.arange(0, SPLITS_PAD)
    valid = s < num_splits
    m = tl.load(MAX + row * num_splits + s, mask=valid, other=float("-inf"))
    l_s = tl.load(SUM + row * num_splits + s, mask=valid, other=0.0)
    acc = tl.load(
        ACC + (row * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    # Every query sees at least its own key, so some split has m > -inf.
    m_max = tl.max(m, 0)
    w = tl.where(valid & (m > float("-inf")), tl.exp(m - m_max), 0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(OUT + row * HEAD_DIM + d, out.to(OUT.dtype.element_ty))


@dataclass(frozen=True)
class SplitTile:
    """What one split program holds: `keys` per loop iteration, `rows` query rows (token x
    group head; more tokens take more query blocks), run by `warps` warps."""

    keys: int
    rows: int
    warps: int

    def __post_init__(self) -> None:
        for size in (self.keys, self.rows, self.warps):
            if size < 1 or size & (size - 1):
                raise ValueError(f"a split tile's sizes are powers of two: {self}")
        if self.rows < 16 or self.keys < 16:
            raise ValueError(f"tl.dot needs 16 rows and keys at least: {self}")


def split_tile(group: int, max_q: int, head_dim: int, fp8: bool, query_bytes: int) -> SplitTile:
    """The tile of a step of at most max_q new tokens per sequence, queries of
    `query_bytes` (2: bfloat16/float16; 4: float32, whose tiles keep the smaller sizes).

    Decode keeps the group's rows (padded for tl.dot's M >= 16), 64 keys and 4 warps. For
    several tokens the best tile differs by cache, measured at shape:qwen3.5-27b's attention
    (group 6, head dim 256) for 32 new tokens over 131,072 keys in 16-token blocks on an H100
    (ms per layer, docs/results/2026-12-06-h100-split-tiles.md): an fp8 cache 0.935 with 128
    keys x 64 rows x 4 warps, 1.461 with the 64 x 64 x 8 both caches had (the 128-key tile
    at 8 warps took 1.8); bf16 0.557 with 64 keys x 128 rows x 8 warps, 0.794. A 16-bit tile
    takes 8 warps once its fp32 accumulator passes 32 KB (128 registers a thread at 4)."""
    if max_q == 1:
        return SplitTile(TILE, max(16, triton.next_power_of_2(group)), 4)
    fp8 = fp8 and query_bytes == 2
    if query_bytes > 2:
        most_rows = min(PAGED_TILE_ROWS.values())
    else:
        most_rows = PAGED_TILE_ROWS["fp8" if fp8 else "auto"]
    keys = 128 if fp8 else TILE
    rows = max(16, triton.next_power_of_2(min(most_rows, max_q * group)))
    warps = 4 if fp8 or rows * head_dim <= 64 * 128 else 8
    return SplitTile(keys, rows, warps)


def num_splits_for(batch: int, num_kv_heads: int, max_context: int, keys: int = TILE) -> int:
    """Enough programs to fill the GPU (~4 waves of 132 SMs), never splits under a tile of
    `keys`. `batch` counts (sequence, query block) programs per KV head."""
    want = max(1, (4 * 132) // max(1, batch * num_kv_heads))
    return max(1, min(want, triton.cdiv(max_context, keys), 64))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None,
    cu_seqlens_q: torch.Tensor | None = None,
    max_q: int = 1,
    num_splits: int | None = None,
    max_context: int | None = None,
    tile: SplitTile | None = None,
) -> torch.Tensor:
    """Causal attention of a step's new tokens over the paged cache, keys read in place.

    q [T, Hq, D], sequence i's tokens at rows cu_seqlens_q[i]:cu_seqlens_q[i + 1] (None:
    one token per sequence, T = B; rows past cu_seqlens_q[B] are padding and come out
    zero), the last of its context_lens[i] keys, already in the cache [slots, Hkv, D] (or
    packed fp8: bytes of [slots, Hkv, D + 4] in block planes, kv_fp8.PackedBlocks); max_q
    >= every sequence's token count (<= MAX_QUERY) sizes the grid; max_context (host int,
    default the tables' width) sizes the splits; `tile` (default split_tile's) the
    programs. Returns [T, Hq, D].
    """
    assert 1 <= max_q <= MAX_QUERY and (cu_seqlens_q is not None or max_q == 1)
    num_tokens, num_heads, head_dim = q.shape
    batch = context_lens.shape[0]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    fp8 = kv_fp8.is_packed(k_cache)
    # A packed cache's scales are float32 words of the same bytes (kv_fp8.PackedBlocks).
    k_scales, v_scales = (
        (k_cache.view(torch.float32), v_cache.view(torch.float32)) if fp8 else (q, q)
    )
    value_bytes, block_bytes = (
        kv_fp8.plane_bytes(block_size, num_kv_heads, head_dim) if fp8 else (0, 0)
    )
    tile = tile or split_tile(group, max_q, head_dim, fp8, q.element_size())
    q_blocks = triton.cdiv(max_q * group, tile.rows)
    if num_splits is None:
        keys = max_context or block_tables.shape[1] * block_size
        if window:  # a sequence's queries see at most window + max_q - 1 keys
            keys = min(keys, window + max_q - 1)
        num_splits = num_splits_for(batch * q_blocks, num_kv_heads, keys, tile.keys)
    n = num_tokens * num_heads * num_splits
    acc = torch.empty((n, head_dim), dtype=torch.float32, device=q.device)
    m = torch.empty(n, dtype=torch.float32, device=q.device)
    s = torch.empty(n, dtype=torch.float32, device=q.device)
    _split_kernel[(batch * q_blocks, num_kv_heads, num_splits)](
        q.contiguous(),
        k_cache,
        v_cache,
        k_scales,  # unread unless fp8
        v_scales,
        block_tables,
        context_lens,
        context_lens if cu_seqlens_q is None else cu_seqlens_q,  # unread when not VARLEN
        acc,
        m,
        s,
        scale,
        window or 0,
        block_tables.stride(0),
        num_splits,
        q_blocks,
        GROUP=group,
        ROWS=tile.rows,
        HEAD_DIM=head_dim,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_SIZE=block_size,
        TILE=tile.keys,
        VARLEN=cu_seqlens_q is not None,
        BLOCK_BYTES=block_bytes,
        VALUE_BYTES=value_bytes,
        KV_FP8=fp8,
        FP8_F16=FP8_DOT_F16,
        num_warps=tile.warps,
    )
    out = torch.empty_like(q)
    _merge_kernel[(num_tokens * num_heads,)](
        acc,
        m,
        s,
        out,
        context_lens if cu_seqlens_q is None else cu_seqlens_q,  # unread when not VARLEN
        num_splits,
        batch,
        num_heads,
        HEAD_DIM=head_dim,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        VARLEN=cu_seqlens_q is not None,
    )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] (one query per sequence); caches [slots, Hkv, D]; returns [B, Hq, D]."""
    return paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        block_size,
        scale,
        window,
        num_splits=num_splits,
    )
