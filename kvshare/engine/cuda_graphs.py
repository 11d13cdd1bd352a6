"""Decode steps replayed from captured CUDA graphs.

A decode step launches thousands of small kernels (tens per layer); launched one by one
from Python, the launches, not the bytes, set the step time. Each batch-size bucket's
step is captured once and replayed with new inputs copied into static buffers.

Rows past the real batch (padding up to the bucket) write their K/V into a trash block
outside the block manager's range (each cache tensor's last block) and attend over it:
finite garbage in rows nobody reads, never a write into a real block. A sliding-window
model's sliding layers read the sliding tables through a second set of static slots and
tables (the sequences' context lengths are shared). A hybrid model's linear-attention
layers read and write the sequences' state slots through a static slot list, and its
steps are captured for every batch size up to `max_batch`, so that no row is padding: a
padding row would need a state slot no sequence holds (for qwen3.5-27b one more 147 MiB
slot, which pushes two fp8 replicas at 0.48 of an H200 below a 262,144-token context).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvshare.engine.attention import AttentionBackend, PagedAttention
from kvshare.engine.connector import KVCacheLayout
from kvshare.engine.recurrent_state import RecurrentStates
from kvshare.models.decoder import CausalLM


@dataclass
class GraphStepMeta:
    """The part of StepMeta the decode path reads, backed by static device buffers."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    block_size: int
    q_lens: tuple[int, ...]  # one new token per row: what linear-attention layers read
    decode_only: bool = True

    def paged(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.block_tables, self.context_lens


def graph_buckets(max_batch: int, exact: bool = False) -> list[int]:
    """Batch sizes captured: every size up to max_batch (`exact`), or 1, 2, 4, 8, then
    steps of 8 up to 32 and doubling, and max_batch; a step runs in the smallest one that
    holds it."""
    if exact:
        return list(range(1, max_batch + 1))
    buckets = [1, 2, 4, 8]
    while buckets[-1] < max_batch:
        buckets.append(buckets[-1] + 8 if buckets[-1] < 32 else buckets[-1] * 2)
    return [b for b in buckets if b < max_batch] + [max_batch]


@dataclass
class _Tables:
    """Static slots and block tables of one cache tensor; padding points at `trash_block`."""

    slots: torch.Tensor
    tables: torch.Tensor
    trash_block: int
    trash_slot: int

    @classmethod
    def allocate(
        cls, trash_block: int, block_size: int, max_batch: int, width: int, device: torch.device
    ) -> _Tables:
        trash_slot = trash_block * block_size
        return cls(
            torch.full((max_batch,), trash_slot, dtype=torch.int64, device=device),
            torch.full((max_batch, width), trash_block, dtype=torch.int32, device=device),
            trash_block,
            trash_slot,
        )


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        layout: KVCacheLayout,
        backend: AttentionBackend,
        max_batch: int,
        max_blocks_per_seq: int,
        states: RecurrentStates | None = None,
    ) -> None:
        self.model = model
        self.layout = layout
        self.states = states
        self.block_size = layout.block_size
        device = layout.kv.device
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        shape = (self.block_size, max_batch, max_blocks_per_seq, device)
        self.global_tables = _Tables.allocate(layout.kv.shape[2] - 1, *shape)
        self.sliding_tables: _Tables | None = None
        if layout.sliding_kv is not None:
            self.sliding_tables = _Tables.allocate(layout.sliding_kv.shape[2] - 1, *shape)
        self.context_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.state_slots: torch.Tensor | None = None
        if states is not None:
            # Distinct slots: what the capture writes there is gone when a sequence gets one
            # (allocation zeroes it), and no sequence exists yet.
            self.state_slots = torch.arange(max_batch, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.buckets = graph_buckets(max_batch, exact=states is not None)
        self._capture_all(backend)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _capture_all(self, backend: AttentionBackend) -> None:
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.buckets):  # largest first: smaller ones reuse its memory
            args = self._args(batch, backend)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.inference_mode():
                self.model(*args)  # warm-up: lazy initialization must not happen in capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
                hidden = self.model(*args)
            self.graphs[batch] = (graph, hidden)

    def _args(
        self, batch: int, backend: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor, PagedAttention]:
        """The model's inputs for a `batch`-row step: views of the static buffers."""

        def meta(static: _Tables) -> GraphStepMeta:
            return GraphStepMeta(
                static.slots[:batch],
                static.tables[:batch],
                self.context_lens[:batch],
                self.block_size,
                (1,) * batch,
            )

        sliding = None if self.sliding_tables is None else meta(self.sliding_tables)
        ctx = PagedAttention(
            self.layout,
            meta(self.global_tables),  # type: ignore[arg-type]
            backend,
            self.states,
            None if self.state_slots is None else self.state_slots[:batch],
            sliding_meta=sliding,  # type: ignore[arg-type]
        )
        return self.input_ids[:batch], self.positions[:batch], ctx

    def _replay(self, batch: int) -> torch.Tensor:
        graph, hidden = self.graphs[batch]
        graph.replay()
        return hidden

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        block_tables: list[tuple[int, ...]],
        context_lens: np.ndarray,
        sliding: tuple[np.ndarray, list[tuple[int, ...]]] | None = None,
        state_slots: np.ndarray | None = None,
    ) -> torch.Tensor:
        """One decode step of len(input_ids) sequences; returns their hidden states.
        `sliding`: the sliding layers' (slots, tables), for a sliding-window model;
        `state_slots`: the sequences' recurrent-state slots, for a hybrid model."""
        n = len(input_ids)
        batch = next(b for b in self.buckets if b >= n)
        pad = batch - n
        self._upload(self.input_ids[:batch], np.pad(input_ids, (0, pad)))
        self._upload(self.positions[:batch], np.pad(positions, (0, pad)))
        self._upload(self.context_lens[:batch], np.pad(context_lens, (0, pad), constant_values=1))
        self._upload_tables(self.global_tables, batch, slots, block_tables)
        if self.sliding_tables is not None:
            assert sliding is not None, "a sliding-window model's step needs its sliding tables"
            self._upload_tables(self.sliding_tables, batch, *sliding)
        if self.state_slots is not None:
            assert state_slots is not None and pad == 0, "a hybrid step: its own state slots"
            self._upload(self.state_slots[:batch], state_slots)
        return self._replay(batch)[:n]

    def _upload_tables(
        self,
        static: _Tables,
        batch: int,
        slots: np.ndarray,
        block_tables: list[tuple[int, ...]],
    ) -> None:
        width = max(len(t) for t in block_tables)
        tables = np.full((batch, width), static.trash_block, dtype=np.int32)
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = table
        pad = batch - len(slots)
        self._upload(
            static.slots[:batch], np.pad(slots, (0, pad), constant_values=static.trash_slot)
        )
        self._upload(static.tables[:batch, :width], tables)

    @staticmethod
    def _upload(dest: torch.Tensor, array: np.ndarray) -> None:
        src = torch.from_numpy(
            np.ascontiguousarray(array).astype(np.int64 if dest.dtype == torch.int64 else np.int32)
        )
        dest.copy_(src.pin_memory() if dest.is_cuda else src, non_blocking=True)
