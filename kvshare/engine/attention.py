"""Attention over the paged KV cache: per-step metadata and the backends.

`StepMeta` describes one step's batch (queries per sequence, keys per sequence, block
tables). `PagedAttention` implements the models' `AttentionContext`: it writes the new
keys/values into their slots and asks a backend for the attention output.

Backends:
- `SDPABackend`: per-sequence torch SDPA with an explicit mask. Any device, any dtype;
  it is the reference the others are tested against.
- `VarlenBackend` (CUDA, bf16/fp16): gathers each sequence's keys into one packed batch
  and runs torch's varlen flash attention, causal aligned bottom-right with an optional
  sliding window. Steps whose sequences all have at most MAX_QUERY new tokens (decode
  included) use the paged Triton kernel when it is available.
Every backend reads a packed fp8 cache (kv_fp8.py) as well: the gathering ones gather and
dequantize through kv_fp8.GatherBuffers a chunk at a time, the paged kernel dequantizes in
its loop. A gather never holds more than the longest context's keys (the memory plan's
attention context): VarlenBackend splits a step whose sequences' keys add up to more.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from kvshare.engine import kv_fp8
from kvshare.engine.connector import KVCacheLayout, SlotFences
from kvshare.engine.memory import DEQUANT_CHUNK_TOKENS
from kvshare.engine.recurrent_state import RecurrentStates
from kvshare.uploads import host_to_device

if TYPE_CHECKING:
    from kvshare.models.gdn_triton import PrefillTables


@dataclass(frozen=True)
class KeyRange:
    """The keys one window setting reads: flat slot ids per sequence, packed."""

    slots: torch.Tensor  # [sum of lens] int64, on the cache's device
    cu_seqlens: torch.Tensor  # [B + 1] int32
    starts: tuple[int, ...]  # first key position of each sequence
    lens: tuple[int, ...]
    max_len: int


@dataclass(frozen=True)
class StepInputs:
    """One step's host inputs, built once for the eager path and the graph path:
    `q_lens[i]` new tokens of sequence i, packed in `input_ids` and `positions`;
    `context_lens[i]` its keys after the step; `block_tables[i]` its table (int32,
    Sequence.block_table_array); `sliding_tables`: the sliding layers' tables, for a
    sliding-window model; `state_slots`: the recurrent-state slots, for a hybrid model."""

    q_lens: tuple[int, ...]
    input_ids: np.ndarray
    positions: np.ndarray
    context_lens: tuple[int, ...]
    block_tables: list[np.ndarray]
    sliding_tables: list[tuple[int, ...]] | None = None
    state_slots: np.ndarray | None = None

    def slots(self, tables: Sequence[Sequence[int] | np.ndarray], block_size: int) -> np.ndarray:
        """The cache slots of the new tokens, packed, through `tables` (one per sequence)."""
        bounds = np.cumsum((0, *self.q_lens))
        return np.concatenate(
            [
                token_slots(t, self.positions[a:b], block_size)
                for t, a, b in zip(tables, bounds, bounds[1:])
            ]
        )


def padded_tables(tables: Sequence[Sequence[int] | np.ndarray], rows: int, fill: int) -> np.ndarray:
    """Block tables as one int32 [rows, longest table] array, `fill` past each table's end
    and in rows past the last table."""
    out = np.full((rows, max(len(t) for t in tables)), fill, dtype=np.int32)
    for i, table in enumerate(tables):
        out[i, : len(table)] = table
    return out


@dataclass
class StepMeta:
    """One step's batch. Sequence i has q_lens[i] new tokens at positions
    [ctx_lens[i] - q_lens[i], ctx_lens[i]) and reads keys up to ctx_lens[i]."""

    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    block_tables: tuple[Sequence[int] | np.ndarray, ...]  # int32 arrays or tuples of ints
    block_size: int
    device: torch.device
    slot_mapping: torch.Tensor = field(init=False)
    cu_seqlens_q: torch.Tensor = field(init=False)
    _key_ranges: dict[int | None, KeyRange] = field(default_factory=dict, init=False)
    _paged: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        slots = [
            self._slots(i, c - q, c) for i, (q, c) in enumerate(zip(self.q_lens, self.ctx_lens))
        ]
        self.slot_mapping = host_to_device(np.concatenate(slots), self.device)
        self.cu_seqlens_q = host_to_device(
            np.cumsum((0, *self.q_lens), dtype=np.int32), self.device
        )

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def max_q(self) -> int:
        return max(self.q_lens)

    @property
    def decode_only(self) -> bool:
        return self.max_q == 1

    @property
    def max_context(self) -> int:
        return max(self.ctx_lens)

    def _slots(self, seq: int, start: int, stop: int) -> np.ndarray:
        positions = np.arange(start, stop, dtype=np.int64)
        return token_slots(self.block_tables[seq], positions, self.block_size)

    def key_range(self, window: int | None) -> KeyRange:
        """Keys each query batch reads: all earlier keys, or the last `window` before each query."""
        if window not in self._key_ranges:
            starts = tuple(
                0 if window is None else max(0, c - q - window + 1)
                for q, c in zip(self.q_lens, self.ctx_lens)
            )
            lens = tuple(c - s for s, c in zip(starts, self.ctx_lens))
            slots = np.concatenate(
                [self._slots(i, s, c) for i, (s, c) in enumerate(zip(starts, self.ctx_lens))]
            )
            self._key_ranges[window] = KeyRange(
                slots=host_to_device(slots, self.device),
                cu_seqlens=host_to_device(np.cumsum((0, *lens), dtype=np.int32), self.device),
                starts=starts,
                lens=lens,
                max_len=max(lens),
            )
        return self._key_ranges[window]

    def paged(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_tables [B, max_blocks] int32, context lengths [B] int32) for paged kernels."""
        if self._paged is None:
            tables = padded_tables(self.block_tables, self.num_seqs, 0)
            self._paged = (
                host_to_device(tables, self.device),
                host_to_device(np.asarray(self.ctx_lens, dtype=np.int32), self.device),
            )
        return self._paged


def token_slots(
    table: Sequence[int] | np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """The cache slots (block * block_size + offset) of a sequence's token positions, in
    ascending order. Only the blocks they touch are read: a decode step's one position
    must not convert a 128k-token context's whole table."""
    if len(positions) == 0:
        return positions.astype(np.int64)
    first = int(positions[0]) // block_size
    blocks = np.asarray(table[first : int(positions[-1]) // block_size + 1], dtype=np.int64)
    return blocks[positions // block_size - first] * block_size + positions % block_size


class AttentionBackend(ABC):
    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: StepMeta,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """q [T, Hq, D]; caches [num_blocks * block_size, Hkv, D] already hold this step's
        keys, in the compute dtype or packed fp8 (bytes of [.., Hkv, D + 4], in block planes:
        kv_fp8.PackedBlocks)."""


class SDPABackend(AttentionBackend):
    """`dequant_chunk_tokens`: tokens of a packed cache dequantized at a time."""

    def __init__(self, dequant_chunk_tokens: int = DEQUANT_CHUNK_TOKENS) -> None:
        self.dequant_chunk_tokens = dequant_chunk_tokens

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: StepMeta,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        keys = meta.key_range(window)
        buffers = kv_fp8.GatherBuffers.allocate(
            keys.max_len, k_cache, q.dtype, self.dequant_chunk_tokens
        )
        out = torch.empty_like(q)
        q_start = 0
        k_start = 0
        for i in range(meta.num_seqs):
            n, m = meta.q_lens[i], keys.lens[i]
            idx = keys.slots[k_start : k_start + m]
            qi = q[q_start : q_start + n].transpose(0, 1)[None]
            ki = buffers.gather(k_cache, idx, buffers.keys, meta.block_size).transpose(0, 1)[None]
            vi = buffers.gather(v_cache, idx, buffers.values, meta.block_size).transpose(0, 1)[None]
            mask = _causal_mask(meta.ctx_lens[i], n, keys.starts[i], m, window, q.device)
            o = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True
            )
            out[q_start : q_start + n] = o[0].transpose(0, 1)
            q_start += n
            k_start += m
        return out


def _causal_mask(
    ctx: int, n: int, key_start: int, m: int, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Query j sits at position ctx - n + j; key i at key_start + i."""
    if n == 1 and (window is None or m <= window):
        return None
    q_pos = torch.arange(ctx - n, ctx, device=device)[:, None]
    k_pos = torch.arange(key_start, key_start + m, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


class VarlenBackend(AttentionBackend):
    """CUDA steps: the paged Triton kernel when every sequence has at most MAX_QUERY new
    tokens (decode, short follow-ups after a long restored prefix), else varlen flash.

    Flash's grid is (query blocks x heads): a few new tokens over a long context leave most
    SMs idle, each CTA streaming the whole context, after a gather of every key; the paged
    kernel reads the keys in place and splits the context over the SMs.

    Varlen steps gather keys into buffers of `max_context_tokens` (the longest context the
    engine admits), allocated at the first such step and kept: a step whose sequences'
    keys add up to more runs as several varlen calls over consecutive sequences.
    `dequant_chunk_tokens`: tokens of a packed cache dequantized at a time."""

    def __init__(
        self,
        max_context_tokens: int,
        paged_decode: bool = True,
        dequant_chunk_tokens: int = DEQUANT_CHUNK_TOKENS,
    ) -> None:
        from torch.nn.attention.varlen import varlen_attn

        if max_context_tokens < 1:
            raise ValueError(f"max_context_tokens must be >= 1, got {max_context_tokens}")
        self.max_context_tokens = max_context_tokens
        self.dequant_chunk_tokens = dequant_chunk_tokens
        self._buffers: kv_fp8.GatherBuffers | None = None
        self._varlen_attn = varlen_attn
        self._paged: ModuleType | None = None  # the paged kernels; None: varlen for every step
        if paged_decode:
            from kvshare.engine import paged_decode as paged

            self._paged = paged

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: StepMeta,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        paged = self._paged
        # The paged paths read only decode_only/paged()/block_size and, for several tokens
        # per sequence, cu_seqlens_q/max_q/max_context: a captured graph's step
        # (cuda_graphs.GraphStepMeta) has nothing else, and its splits must depend only on
        # static shapes (the tables' width), not on this step's context lengths.
        if paged is not None and meta.decode_only:
            tables, ctx = meta.paged()
            return paged.paged_decode_attention(
                q, k_cache, v_cache, tables, ctx, meta.block_size, scale, window
            )
        if paged is not None and meta.max_q <= paged.MAX_QUERY:
            tables, ctx = meta.paged()
            return paged.paged_attention(
                q,
                k_cache,
                v_cache,
                tables,
                ctx,
                meta.block_size,
                scale,
                window,
                cu_seqlens_q=meta.cu_seqlens_q,
                max_q=meta.max_q,
                max_context=meta.max_context,
            )
        keys = meta.key_range(window)
        buffers = self._gather_buffers(k_cache, q.dtype)
        window_size = (-1 if window is None else window - 1, 0)
        groups = gather_groups(keys.lens, self.max_context_tokens)
        if len(groups) == 1:  # the whole step in one call (its cu_seqlens as they are)
            k = buffers.gather(k_cache, keys.slots, buffers.keys, meta.block_size)
            v = buffers.gather(v_cache, keys.slots, buffers.values, meta.block_size)
            return self._varlen_attn(
                q,
                k,
                v,
                meta.cu_seqlens_q,
                keys.cu_seqlens,
                meta.max_q,
                keys.max_len,
                scale=scale,
                window_size=window_size,
            )
        out = torch.empty_like(q)
        for first, stop in groups:
            q_at, q_end = sum(meta.q_lens[:first]), sum(meta.q_lens[:stop])
            k_at, k_end = sum(keys.lens[:first]), sum(keys.lens[:stop])
            slots = keys.slots[k_at:k_end]
            out[q_at:q_end] = self._varlen_attn(
                q[q_at:q_end],
                buffers.gather(k_cache, slots, buffers.keys, meta.block_size),
                buffers.gather(v_cache, slots, buffers.values, meta.block_size),
                meta.cu_seqlens_q[first : stop + 1] - q_at,
                keys.cu_seqlens[first : stop + 1] - k_at,
                max(meta.q_lens[first:stop]),
                max(keys.lens[first:stop]),
                scale=scale,
                window_size=window_size,
            )
        return out

    def _gather_buffers(self, cache: torch.Tensor, dtype: torch.dtype) -> kv_fp8.GatherBuffers:
        """This backend's buffers, allocated for the first cache rows and dtype it reads (an
        engine's layers all share them)."""
        if self._buffers is None or not self._buffers.fits(cache, dtype):
            self._buffers = None  # the old buffers go before the new ones are allocated
            self._buffers = kv_fp8.GatherBuffers.allocate(
                self.max_context_tokens, cache, dtype, self.dequant_chunk_tokens
            )
        return self._buffers


def gather_groups(lens: tuple[int, ...], max_tokens: int) -> list[tuple[int, int]]:
    """Runs [first, stop) of consecutive sequences whose keys (`lens`) add up to at most
    `max_tokens`, in order; ValueError for a sequence longer than that on its own."""
    groups: list[tuple[int, int]] = []
    first, total = 0, 0
    for i, n in enumerate(lens):
        if n > max_tokens:
            raise ValueError(f"a sequence reads {n} keys, more than the {max_tokens} gathered")
        if total + n > max_tokens:
            groups.append((first, i))
            first, total = i, 0
        total += n
    groups.append((first, len(lens)))
    return groups


def store_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, block_size: int) -> None:
    """New keys or values x [T, Hkv, D] into `slots` of `cache` (quantized into its block
    planes if it is packed fp8, kv_fp8.PackedBlocks)."""
    if not kv_fp8.is_packed(cache):
        cache.index_copy_(0, slots, x.to(cache.dtype))
    elif cache.is_cuda:
        from kvshare.engine import fp8_store  # Triton: CUDA only

        fp8_store.store(cache, slots, x, block_size)
    else:
        kv_fp8.PackedBlocks.of(cache, block_size).store(slots, x)


class PagedAttention:
    """The models' AttentionContext over the engine's paged cache for one step; for hybrid
    models also their RecurrentStateContext over the sequences' state slots. Global layers
    go through `meta` (the block tables), sliding-window layers through `sliding_meta` (the
    same step over the sliding tables; required when the layout has sliding layers)."""

    def __init__(
        self,
        layout: KVCacheLayout,
        meta: StepMeta,
        backend: AttentionBackend,
        states: RecurrentStates | None = None,
        state_slots: torch.Tensor | None = None,
        sliding_meta: StepMeta | None = None,
        fences: SlotFences | None = None,
        prefill: PrefillTables | None = None,
    ) -> None:
        self.layout = layout
        self._prefill = prefill
        self.fences = fences
        self.meta = meta
        self.sliding_meta = sliding_meta
        self.backend = backend
        self.states = states
        self.state_slots = state_slots

    @property
    def seq_lens(self) -> tuple[int, ...]:
        """New tokens per sequence (read by linear-attention layers)."""
        return self.meta.q_lens

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        slot = self.layout.layer_slot[layer]
        if self.fences is not None:
            self.fences.before(slot)
        cache, sliding = self.layout.slot_cache(slot)
        meta = self.sliding_meta if sliding else self.meta
        assert meta is not None, "a sliding-window layer needs the step's sliding tables"
        k_cache = cache[0].flatten(0, 1)
        v_cache = cache[1].flatten(0, 1)
        store_rows(k_cache, meta.slot_mapping, k, meta.block_size)
        store_rows(v_cache, meta.slot_mapping, v, meta.block_size)
        return self.backend.attend(q, k_cache, v_cache, meta, scale, window)

    def prefill_tables(self, conv_width: int) -> PrefillTables | None:
        """Given (a captured graph's static tables), or built at the first linear-attention
        layer of a CUDA prefill step and kept for the others."""
        if self._prefill is None and self.layout.kv.is_cuda and not self.meta.decode_only:
            from kvshare.models.gdn_triton import PrefillTables

            self._prefill = PrefillTables(self.meta.q_lens, conv_width, self.layout.kv.device)
        return self._prefill

    def load_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.states is not None and self.state_slots is not None
        return self.states.load(layer, self.state_slots)

    def save_state(
        self, layer: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor
    ) -> None:
        assert self.states is not None and self.state_slots is not None
        self.states.save(layer, self.state_slots, conv_state, recurrent_state)
