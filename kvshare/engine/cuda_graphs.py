"""Decode steps and short prefill steps replayed from captured CUDA graphs.

A step of a few tokens launches thousands of small kernels (tens per layer); launched one
by one from Python, the launches, not the bytes, set the step time. Each shape's step is
captured once and replayed with new inputs copied into static buffers. Two kinds of shape:

- decode steps (one new token per sequence), one graph per batch-size bucket;
- short prefill steps (every sequence at most `paged_decode.MAX_QUERY` new tokens, some
  more than one: the question after a restored or cached prefix), one graph per (sequences,
  token rows) with the rows in SHORT_STEP_TOKENS. The sequences' own lengths, positions and
  context lengths are inputs of the replay: the paged attention kernel and the
  linear-attention kernels read them from the device (`gdn_triton.PrefillTables`).

A short prefill step is captured in segments of consecutive layers, a new one starting at
each global attention layer, and replayed one segment after another. A pool restore in
groups of layers (kvshare.kvpool.transfer.LayerGroups) leaves a wait per group of cache
slots (SlotFences); before each segment the replay runs the waits of the slots its layers
touch, so the first layers compute while the last ones are still copied, and the step
costs a replay per segment, not the thousands of launches of the eager step (~3,300 for a
Qwen3.5-27B step, ~70 ms of an H100 host's time). A decode step, one graph, waits for
every pending load before its replay.

Padding rows (decode rows past the real batch, prefill rows past the step's tokens) write
their K/V into a trash block outside the block manager's range (each cache tensor's last
block), never into a real block. Padded decode rows attend over the trash block; padded
prefill rows belong to no sequence, and the attention and linear-attention kernels write
zeros for them. A sliding-window model's sliding layers read the sliding tables through a
second set of static slots and tables (the sequences' context lengths are shared). A
hybrid model's linear-attention layers read and write the sequences' state slots through
a static slot list, so its graphs never pad sequences: its decode steps are captured for
every batch size up to `max_batch` (a padding row would need a state slot no sequence
holds: for qwen3.5-27b one more 147 MiB slot, which pushes two fp8 replicas at 0.48 of an
H200 below a 262,144-token context).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvshare.engine.attention import AttentionBackend, PagedAttention, StepInputs, padded_tables
from kvshare.engine.connector import KVCacheLayout, SlotFences
from kvshare.engine.memory import SHORT_STEP_TOKENS
from kvshare.engine.recurrent_state import RecurrentStates
from kvshare.models.decoder import CausalLM
from kvshare.uploads import copy_into

if TYPE_CHECKING:
    from kvshare.models.gdn_triton import PrefillTables

# Most new tokens of a sequence in a short prefill step: what the paged attention kernel
# serves (paged_decode.MAX_QUERY, which imports Triton; a test checks they agree).
MAX_QUERY = 64


@dataclass
class GraphStepMeta:
    """The part of StepMeta the paged paths read, backed by static device buffers."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    block_size: int
    q_lens: tuple[int, ...]  # the captured shape's (the replayed step's are on the device)
    cu_seqlens_q: torch.Tensor
    max_context: int  # the tables' width in tokens: sizes the attention's splits

    @property
    def decode_only(self) -> bool:
        return self.max_q == 1

    @property
    def max_q(self) -> int:
        """Most new tokens a sequence of this shape can have (sizes the attention's grid)."""
        return 1 if all(n == 1 for n in self.q_lens) else min(MAX_QUERY, sum(self.q_lens))

    def paged(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.block_tables, self.context_lens


def graph_buckets(max_batch: int, exact: bool = False) -> list[int]:
    """Decode batch sizes captured: every size up to max_batch (`exact`), or 1, 2, 4, 8,
    then steps of 8 up to 32 and doubling, and max_batch; a step runs in the smallest one
    that holds it."""
    if exact:
        return list(range(1, max_batch + 1))
    buckets = [1, 2, 4, 8]
    while buckets[-1] < max_batch:
        buckets.append(buckets[-1] + 8 if buckets[-1] < 32 else buckets[-1] * 2)
    return [b for b in buckets if b < max_batch] + [max_batch]


def short_shapes(max_batch: int) -> list[tuple[int, int]]:
    """(sequences, token rows) of the captured short prefill steps: every sequence count up
    to max_batch, with rows in SHORT_STEP_TOKENS that can hold more than one token per
    sequence and no more than MAX_QUERY each."""
    return [
        (b, t) for b in range(1, max_batch + 1) for t in SHORT_STEP_TOKENS if b < t <= MAX_QUERY * b
    ]


def graph_shape(
    q_lens: tuple[int, ...], buckets: list[int], short: list[tuple[int, int]]
) -> tuple[int, int] | None:
    """The (sequences, token rows) a step of these new-token counts replays in: a decode
    step the smallest bucket that holds its batch (padding rows), a short prefill step the
    fewest rows of its own sequence count; None: the step runs eagerly."""
    batch, tokens = len(q_lens), sum(q_lens)
    if tokens == batch:
        return next(((b, b) for b in buckets if b >= batch), None)
    if max(q_lens) > MAX_QUERY:
        return None
    return next(((b, t) for b, t in short if b == batch and t >= tokens), None)


def _even_split(tokens: int, batch: int) -> tuple[int, ...]:
    """A representative shape for capture: `tokens` spread over `batch` sequences."""
    return tuple(tokens // batch + (i < tokens % batch) for i in range(batch))


def layer_segments(layout: KVCacheLayout, num_layers: int) -> list[range]:
    """The layers of each captured segment of a short prefill step: a new segment starts
    at every global attention layer (the slots a load in groups of layers waits for)."""
    starts = [
        layer
        for layer, slot in enumerate(layout.layer_slot)
        if layer > 0 and 0 <= slot < layout.num_global_slots
    ]
    bounds = [0, *starts, num_layers]
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


@dataclass
class _Segment:
    """One captured run of layers: before its replay, the pending waits of `slots` run."""

    graph: torch.cuda.CUDAGraph
    slots: tuple[int, ...]
    # The segment's result, in the graph pool: the next segment's graph reads it, so it
    # must stay allocated as long as that graph exists.
    output: torch.Tensor


@dataclass
class _SegmentedStep:
    segments: list[_Segment]
    # Computed by the first segment, read by the attention layers of every segment.
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Tables:
    """Static slots and block tables of one cache tensor; padding points at `trash_block`."""

    slots: torch.Tensor
    tables: torch.Tensor
    trash_block: int
    trash_slot: int

    @classmethod
    def allocate(
        cls,
        trash_block: int,
        block_size: int,
        rows: int,
        seqs: int,
        width: int,
        device: torch.device,
    ) -> _Tables:
        trash_slot = trash_block * block_size
        return cls(
            torch.full((rows,), trash_slot, dtype=torch.int64, device=device),
            torch.full((seqs, width), trash_block, dtype=torch.int32, device=device),
            trash_block,
            trash_slot,
        )


class StepGraphs:
    """Captured decode steps of up to `max_batch` sequences and short prefill steps of up
    to `short_batch` sequences (0: none)."""

    def __init__(
        self,
        model: CausalLM,
        layout: KVCacheLayout,
        backend: AttentionBackend,
        max_batch: int,
        max_blocks_per_seq: int,
        states: RecurrentStates | None = None,
        short_batch: int = 0,
    ) -> None:
        self.model = model
        self.layout = layout
        self.states = states
        self.block_size = layout.block_size
        self.max_context = max_blocks_per_seq * self.block_size
        self.buckets = graph_buckets(max_batch, exact=states is not None)
        self.short = short_shapes(short_batch)
        rows = max([max_batch, *(t for _, t in self.short)])
        seqs = max(max_batch, short_batch)
        device = layout.kv.device
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        shape = (self.block_size, rows, seqs, max_blocks_per_seq, device)
        self.global_tables = _Tables.allocate(layout.kv.shape[2] - 1, *shape)
        self.sliding_tables: _Tables | None = None
        if layout.sliding_kv is not None:
            self.sliding_tables = _Tables.allocate(layout.sliding_kv.shape[2] - 1, *shape)
        self.context_lens = torch.ones(seqs, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.zeros(seqs + 1, dtype=torch.int32, device=device)
        self.state_slots: torch.Tensor | None = None
        if states is not None:
            # Distinct slots: what the capture writes there is gone when a sequence gets one
            # (allocation zeroes it), and no sequence exists yet.
            self.state_slots = torch.arange(seqs, dtype=torch.int64, device=device)
        self.prefill: dict[tuple[int, int], PrefillTables] = {}
        if model.config.linear_layers:
            from kvshare.models.gdn_triton import PrefillTables

            width = model.config.linear_conv_kernel_dim - 1
            for b, t in self.short:
                self.prefill[(b, t)] = PrefillTables(_even_split(t, b), width, device, rows=t)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.segmented: dict[tuple[int, int], _SegmentedStep] = {}
        self._capture_all(backend)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def shapes(self) -> list[tuple[int, int]]:
        """Every captured (sequences, token rows), largest first."""
        decode = [(b, b) for b in self.buckets]
        return sorted([*decode, *self.short], key=lambda s: (s[1], s[0]), reverse=True)

    def shape_for(self, q_lens: tuple[int, ...]) -> tuple[int, int] | None:
        """The captured shape a step of these new-token counts replays in, or None."""
        return graph_shape(q_lens, self.buckets, self.short)

    def _capture_all(self, backend: AttentionBackend) -> None:
        pool = torch.cuda.graph_pool_handle()
        for shape in self.shapes():  # largest first: smaller ones reuse its memory
            args = self._args(shape, backend)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.inference_mode():
                self.model(*args)  # warm-up: lazy initialization must not happen in capture
            torch.cuda.current_stream().wait_stream(side)
            if shape in self.short:
                self.segmented[shape] = self._capture_segments(args, pool)
                continue
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
                hidden = self.model(*args)
            self.graphs[shape] = (graph, hidden)

    def _capture_segments(
        self, args: tuple[torch.Tensor, torch.Tensor, PagedAttention], pool: tuple[int, int]
    ) -> _SegmentedStep:
        input_ids, positions, ctx = args
        slot_of = self.layout.layer_slot
        segments: list[_Segment] = []
        for layers in layer_segments(self.layout, self.model.config.num_layers):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
                if not segments:
                    hidden, rope = self.model.embed(input_ids, positions)
                else:
                    hidden = segments[-1].output
                hidden = self.model.forward_layers(hidden, rope, ctx, layers)
            slots = tuple(slot_of[i] for i in layers if slot_of[i] >= 0)
            segments.append(_Segment(graph, slots, hidden))
        return _SegmentedStep(segments, rope)

    def _args(
        self, shape: tuple[int, int], backend: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor, PagedAttention]:
        """The model's inputs for a step of this shape: views of the static buffers."""
        batch, tokens = shape
        q_lens = (1,) * batch if batch == tokens else _even_split(tokens, batch)

        def meta(static: _Tables) -> GraphStepMeta:
            return GraphStepMeta(
                static.slots[:tokens],
                static.tables[:batch],
                self.context_lens[:batch],
                self.block_size,
                q_lens,
                self.cu_seqlens_q[: batch + 1],
                self.max_context,
            )

        sliding = None if self.sliding_tables is None else meta(self.sliding_tables)
        ctx = PagedAttention(
            self.layout,
            meta(self.global_tables),  # type: ignore[arg-type]
            backend,
            self.states,
            None if self.state_slots is None else self.state_slots[:batch],
            sliding_meta=sliding,  # type: ignore[arg-type]
            prefill=self.prefill.get(shape),
        )
        return self.input_ids[:tokens], self.positions[:tokens], ctx

    def _replay(self, shape: tuple[int, int], fences: SlotFences) -> torch.Tensor:
        step = self.segmented.get(shape)
        if step is None:
            fences.drain()
            graph, hidden = self.graphs[shape]
            graph.replay()
            return hidden
        for segment in step.segments:
            for slot in segment.slots:
                fences.before(slot)
            segment.graph.replay()
        return step.segments[-1].output

    def run(self, step: StepInputs, fences: SlotFences) -> torch.Tensor:
        """The step's hidden states, one row per new token (ValueError: no captured shape
        holds it). The pending waits in `fences` of the slots the step touches run before
        the layers that touch them (a short prefill step), or all before the replay (a
        decode step)."""
        shape = self.shape_for(step.q_lens)
        if shape is None:
            raise ValueError(f"no captured graph for a step of {step.q_lens} new tokens")
        batch, rows = shape
        n, pad_rows = len(step.input_ids), rows - len(step.input_ids)
        copy_into(self.input_ids[:rows], np.pad(step.input_ids, (0, pad_rows)))
        copy_into(self.positions[:rows], np.pad(step.positions, (0, pad_rows)))
        pad_seqs = batch - len(step.q_lens)
        copy_into(
            self.context_lens[:batch], np.pad(step.context_lens, (0, pad_seqs), constant_values=1)
        )
        self._upload_tables(self.global_tables, shape, step, step.block_tables)
        if self.sliding_tables is not None:
            assert step.sliding_tables is not None, (
                "a sliding-window model's step needs its sliding tables"
            )
            self._upload_tables(self.sliding_tables, shape, step, step.sliding_tables)
        if self.state_slots is not None:
            assert step.state_slots is not None and pad_seqs == 0, "a hybrid step: its own slots"
            copy_into(self.state_slots[:batch], step.state_slots)
        if batch != rows:
            copy_into(self.cu_seqlens_q[: batch + 1], np.cumsum((0, *step.q_lens)))
            if shape in self.prefill:
                self.prefill[shape].upload(step.q_lens)
        return self._replay(shape, fences)[:n]

    def _upload_tables(
        self,
        static: _Tables,
        shape: tuple[int, int],
        step: StepInputs,
        block_tables: Sequence[Sequence[int] | np.ndarray],
    ) -> None:
        """One cache's slots of the step's new tokens and its block tables, padding rows
        and sequences pointing at the trash block."""
        batch, rows = shape
        slots = step.slots(block_tables, self.block_size)
        pad = rows - len(slots)
        copy_into(static.slots[:rows], np.pad(slots, (0, pad), constant_values=static.trash_slot))
        tables = padded_tables(block_tables, batch, static.trash_block)
        copy_into(static.tables[:batch, : tables.shape[1]], tables)
