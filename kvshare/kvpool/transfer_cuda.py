"""`CudaTransfer`: the `Transfer` of a CUDA cache.

It copies whole pages (MiBs: the PCIe ceiling needs large copies) between the registered arena and a GPU staging buffer, and scatters/gathers between the staging
buffer and the scattered blocks on the GPU. Two staging buffers per direction and two
streams per direction (copy engine, SMs) let group i+1's copies overlap group i's scatter.
A prefetch (a load's first fills, before the load is planned) fills the store's two
buffers too while no store needs them.
A group is a run of pages of one size checksummed and scattered/gathered together: at 16
MiB pages, issuing checksum kernels page by page took the host longer than the copy took
the PCIe link, and index_copy_ over a cache of more than 2**31 elements is split into
32 launches per page, which block the host once the stream's queue fills. The scatter and
gather are one Triton launch per group with 64-bit offsets (block_copy.py), driven by a
table of (page, block) pairs uploaded once per load or store; so is the checksum
(checksum_kernel.py), keyed per page by constants uploaded with the pairs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvshare.engine.memory import STAGING_BUFFERS, staging_buffer_bytes
from kvshare.kvpool.faults import FaultInjection, breaks, injected_delay
from kvshare.kvpool.layout import PageLayout, checksum_constants_table
from kvshare.kvpool.page import HEADER_BYTES, PAGE_ALIGN
from kvshare.kvpool.strided_copy import MAX_PITCH, StridedCopy, StridedCopyError
from kvshare.kvpool.transfer import (
    LayerGroups,
    PageCopy,
    Prefetch,
    SpanGroup,
    Transfer,
    TransferJob,
    copied_segments,
    fill_span,
    page_groups,
    span_groups,
    staged_rows,
    strided_groups,
)

if TYPE_CHECKING:
    from kvshare.kvpool.block_copy import BlockCopy


_log = logging.getLogger(__name__)

# Layer groups of a load whose wait the host does (event.synchronize before the step's layers
# that read them are launched) instead of the compute stream (cudaStreamWaitEvent). Measured
# on an H100 (fp8 hit at 131,072 tokens, 2026-12-06): once the step is launched the load's
# host-to-device copies run at ~49.5 GB/s against 55.2 before (with the later waits as spinning
# kernels instead, no stream blocked, the same drop: the launch, not the wait, sets it), so
# holding the step back until the first group, half the bytes, is in keeps that half at the
# full rate (time to first token, median of 6: 91.9 ms against 93.8). Later groups keep
# GPU-side waits: done by the host, each left the compute stream idle while the host woke
# and launched the next layers (every group by the host: 96.9 ms against 93.2).
HOST_WAITED_GROUPS = 1

# Staging fills a prefetch issues: a load's first copies, started while the request's body
# is still being read (a prompt head's hint) and while the connector asks the pool for the
# rest of the restore and plans it. The two load buffers first, then the two store buffers
# (no device memory of its own; a store before the load takes them back). Two fills (~5 ms
# of copies at 128 MiB each) covered an engine's lookup and plan, not a served request's
# parse before them: the copy engine then sat idle for a few ms of the hit.
PREFETCH_FILLS = 4

# A load's pages in adjacent arena slots share one host->device copy when at most a page
# header and its padding lie between them (copied for nothing: 8 KiB per 16 MiB page),
# at most _SPAN_PAGES pages a copy.
MAX_SPAN_GAP = HEADER_BYTES + PAGE_ALIGN
_SPAN_PAGES = 8


@dataclass(frozen=True)
class _LoadTables:
    """What a load's scatter reads on the device, uploaded once per load."""

    pairs: Callable[[range], torch.Tensor]
    sliding_pairs: Callable[[range], torch.Tensor] | None
    constants: torch.Tensor
    sums: torch.Tensor


# A staging buffer: (direction, index) in CudaTransfer.staging.
_Buffer = tuple[str, int]
# A fill a prefetch issued: its group, the rows the fill left, and the buffer holding them.
_Fill = tuple[SpanGroup, torch.Tensor, _Buffer]


@dataclass(frozen=True)
class _StagedFills(Prefetch):
    """A prefetch: the first fills of a load's first slot range (None: whole pages), in
    order, in the buffers _prefetch_buffers names."""

    slots: range | None
    fills: tuple[_Fill, ...]


class _CudaJob(TransferJob):
    def __init__(
        self,
        num_pages: int,
        num_segments: int,
        event: torch.cuda.Event,
        host_checksums: torch.Tensor,
        always_done: bool,
    ) -> None:
        super().__init__(num_pages, num_segments, always_done)
        self.event = event
        self.host_checksums = host_checksums

    def _completed(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()

    def _checksum_array(self) -> np.ndarray:
        return self.host_checksums.numpy()


class CudaTransfer(Transfer):
    def __init__(
        self,
        kv: torch.Tensor,
        layout: PageLayout,
        faults: FaultInjection | None = None,
        sliding_kv: torch.Tensor | None = None,
        layer_groups: LayerGroups | None = None,
    ) -> None:
        super().__init__(kv, layout, faults, sliding_kv, layer_groups)
        self.device = kv.device
        # Cycles at 1.5 GHz: the delay lasts the asked time x 1.5 GHz / the SM clock (~0.75x
        # at an H100's or H200's ~2 GHz); it widens a race window, its length is not exact.
        self.delay_cycles = int(injected_delay(faults) * 1.5e9)
        self.streams = {
            name: torch.cuda.Stream(self.device)
            # load_raw: a hybrid model's state row, copied beside a load's pages (its first
            # linear-attention layer needs it long before the last attention layer's KV).
            for name in ("load_copy", "load_scatter", "store_gather", "store_copy", "load_raw")
        }
        nbytes = self.staging_bytes = staging_buffer_bytes(layout.payload_bytes)
        self.staging = {
            d: [
                torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                for _ in range(STAGING_BUFFERS // 2)
            ]
            for d in ("load", "store")
        }
        # filled[d][b]: staging buffer b holds data; free[d][b]: its consumer is done with it.
        self.filled = {d: [torch.cuda.Event() for _ in range(2)] for d in ("load", "store")}
        self.free = {d: [torch.cuda.Event() for _ in range(2)] for d in ("load", "store")}
        from kvshare.kvpool.block_copy import BlockCopy  # triton: only where CUDA is
        from kvshare.kvpool.checksum_kernel import checksum_rows

        self.blocks: BlockCopy = BlockCopy(kv, layout.blocks_per_page)
        self.sliding_blocks: BlockCopy | None = None
        if sliding_kv is not None:
            self.sliding_blocks = BlockCopy(sliding_kv, layout.blocks_per_page)
        self.checksum_rows = checksum_rows
        # None: one host copy per page's part of a layer group (strided_copy.py).
        self.strided_copy = StridedCopy.find()
        if self.strided_copy is None and self.layer_groups is not None:
            self.layer_groups = self.layer_groups.for_row_copies()
        self.host_waited_groups = HOST_WAITED_GROUPS
        # The latest prefetch while the staging holds its fills and the arena it read is
        # mapped (None once a load ran or the arena changed; a store takes back the fills
        # in its buffers).
        self._prefetch: _StagedFills | None = None
        self._prefetch_kept = 0  # its leading fills still in their buffers
        self.prefetch_fills = PREFETCH_FILLS
        self.prefetched_fills_used = 0  # fills loads took from prefetches (tests read it)

    def warm_up(self, raw_bytes: Sequence[int] = ()) -> None:
        """Compile the scatter, gather and checksum kernels for this layout now: Triton
        compiles a kernel at its first launch, and on the H200 a replica's first restore
        took 1.74 s where the next took 0.35 s (gemma3-27b, 130,816 tokens). Each runs once
        against each cache's last block, which no sequence owns: gathered into a staging
        row and scattered back, so every block keeps its bytes."""
        layout, bpp = self.layout, self.layout.blocks_per_page
        row = self.staging["load"][0][: layout.payload_bytes].zero_().view(1, -1)
        sums = torch.zeros((1, 2, 2), dtype=torch.int64, device=self.device)
        constants = torch.zeros((1, 4), dtype=torch.int64, device=self.device)
        self._checksum_group(row, constants, sums)
        parts = [(self.blocks, self.kv, row[:, : layout.global_bytes])]
        if self.sliding_blocks is not None and self.sliding_kv is not None:
            parts.append((self.sliding_blocks, self.sliding_kv, row[:, layout.global_bytes :]))
        for copier, cache, part in parts:
            trash = cache.shape[2] - 1
            pairs = torch.tensor(
                [[0, j, trash] for j in range(bpp)], dtype=torch.int64, device=self.device
            )
            copier(part, pairs, 0, False)  # gather (stores), then scatter back (loads)
            copier(part, pairs, 0, True)
        staging = self.staging["load"][0]
        for nbytes in raw_bytes:  # rows past the staging size compile the same kernel
            raw = staging[: min(nbytes, staging.numel())].view(1, -1)
            self.checksum_rows(raw, constants, sums, raw.shape[1])
        torch.cuda.synchronize(self.device)

    def _pipeline(
        self,
        direction: str,
        groups: Sequence[SpanGroup],
        first: torch.cuda.Stream,
        fill: Callable[[torch.Tensor, SpanGroup], torch.Tensor],
        second: torch.cuda.Stream,
        drain: Callable[[torch.Tensor, range], None],
        before_first_drain: Callable[[], None] | None = None,
        staged: Sequence[_Fill] = (),
    ) -> None:
        """Each page group through the direction's two staging buffers: rows = fill(buffer,
        group) on `first` once `second` is done with the buffer, then drain(rows,
        group.pages) on `second` once `first` filled it. Rows are the group's pages, one
        row of bytes each, in the buffer. A group's drain is issued after the next group's
        fill, and before_first_drain() (work the first drain needs that must not delay the
        first copies) runs once both buffers' fills are issued: its host time then hides
        behind two copies, not one (with one, the copy engine sat idle ~2.8 ms of a 131k
        fp8 hit on an H100 while the host built the tables). Fill k + 2 is issued after
        drain k, so its wait sees drain k's record of the buffer's `free` event.

        `staged`: fills a prefetch issued, in order (a load's only); each leading one that
        is this pipeline's group k is taken as group k's fill, in whichever buffer holds it
        (its `filled` record is the prefetch's). The pipeline's own fill k goes to its
        direction's buffer k % 2 all the same: the group that used that buffer last is k - 2
        or earlier, whose drain is issued by then. A fill not taken is overwritten by the
        group's own (a load buffer's, later on the same stream) or left to the next store
        (a store buffer's, which waits for the prefetch's copy: see store)."""
        taken = 0
        while taken < min(len(staged), len(groups)) and staged[taken][0] == groups[taken]:
            taken += 1
        self.prefetched_fills_used += taken
        issued: list[tuple[torch.Tensor, range, _Buffer]] = []  # filled, drain not yet issued
        before = [before_first_drain] if before_first_drain is not None else []

        def drain_oldest() -> None:
            while before:
                before.pop()()
            rows, pages, (d, b) = issued.pop(0)
            second.wait_event(self.filled[d][b])
            with torch.cuda.stream(second):
                drain(rows, pages)
                self.free[d][b].record(second)

        for k, group in enumerate(groups):
            if k < taken:
                issued.append((staged[k][1], group.pages, staged[k][2]))
            else:
                b = k % 2
                first.wait_event(self.free[direction][b])
                with torch.cuda.stream(first):
                    rows = fill(self.staging[direction][b], group)
                    self.filled[direction][b].record(first)
                issued.append((rows, group.pages, (direction, b)))
            if k >= 1:
                drain_oldest()
        while issued:
            drain_oldest()

    def _upload(self, table: np.ndarray, stream: torch.cuda.Stream) -> torch.Tensor:
        """A host table on the device, through one pinned, asynchronous copy on `stream`."""
        with torch.cuda.stream(stream):
            return torch.from_numpy(table).pin_memory().to(self.device, non_blocking=True)

    def _constants(self, keys: Sequence[bytes], stream: torch.cuda.Stream) -> torch.Tensor:
        """Each key's checksum constants (int64 [len(keys), 4]) on the device."""
        return self._upload(checksum_constants_table(keys).view(np.int64), stream)

    def _checksum_group(
        self, rows: torch.Tensor, constants: torch.Tensor, sums: torch.Tensor
    ) -> None:
        self.checksum_rows(rows, constants, sums, min(self.layout.global_bytes, rows.shape[1]))

    def _pairs(
        self, copies: Sequence[PageCopy], stream: torch.cuda.Stream, sliding: bool = False
    ) -> Callable[[range], torch.Tensor]:
        """The (page, j, block) pairs of every copy, uploaded once on `stream`: of the
        global blocks, or of the sliding blocks (none for a copy of the global part only);
        returns the device pairs of a group (a slice: no GPU work)."""
        if sliding:
            bpp, split = self.layout.blocks_per_page, self.layout.global_bytes
            whole = [c.nbytes > split for c in copies]
            table, offsets = self.blocks.pairs(
                [c.sliding_blocks if w else c.blocks for c, w in zip(copies, whole)],
                [c.sliding_first if w else bpp for c, w in zip(copies, whole)],
            )
        else:
            table, offsets = self.blocks.pairs(
                [c.blocks for c in copies], [c.first_block for c in copies]
            )
        pairs = self._upload(table, stream)
        return lambda group: pairs[offsets[group.start] : offsets[group.stop]]

    def _copy_blocks(
        self,
        rows: torch.Tensor,
        group: range,
        pairs: Callable[[range], torch.Tensor],
        sliding_pairs: Callable[[range], torch.Tensor] | None,
        to_cache: bool,
    ) -> None:
        """Scatter (to_cache) or gather a group's page rows: the global part of each row
        with the cache, the sliding part (rows past global_bytes) with the sliding cache."""
        split = self.layout.global_bytes
        self.blocks(rows[:, :split], pairs(group), group.start, to_cache)
        if rows.shape[1] > split:
            assert self.sliding_blocks is not None and sliding_pairs is not None
            self.sliding_blocks(rows[:, split:], sliding_pairs(group), group.start, to_cache)

    def _sliding_pairs(
        self, copies: Sequence[PageCopy], stream: torch.cuda.Stream
    ) -> Callable[[range], torch.Tensor] | None:
        if not any(c.nbytes > self.layout.global_bytes for c in copies):
            return None
        return self._pairs(copies, stream, sliding=True)

    def _after_compute(self, stream: torch.cuda.Stream) -> None:
        """Order `stream`'s writes into a load's target after the compute stream's work
        issued so far: the target's earlier writers (zeroing a fresh state slot, the last
        step of the blocks' previous owner) must not land on top of the restored bytes."""
        if breaks(self.faults, "load_target"):
            return
        issued = torch.cuda.Event()
        issued.record(torch.cuda.current_stream(self.device))
        stream.wait_event(issued)

    def _start_load(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The load's (copy, scatter) streams, ordered as a load must be (and delayed when
        a fault asks)."""
        copy_s, scatter_s = self.streams["load_copy"], self.streams["load_scatter"]
        self._after_compute(scatter_s)
        self._injected_delay(copy_s)
        return copy_s, scatter_s

    def _injected_delay(self, stream: torch.cuda.Stream) -> None:
        if self.delay_cycles:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(self.delay_cycles)

    def _staged(self, prefetch: Prefetch | None, slots: range | None) -> Sequence[_Fill]:
        """The fills of `prefetch` a load whose first slot range is `slots` may take: only
        those of the latest prefetch still in their buffers (no load ran since, and none a
        store took back)."""
        latest, self._prefetch = self._prefetch, None
        if prefetch is None or prefetch is not latest or latest.slots != slots:
            return ()
        return latest.fills[: self._prefetch_kept]

    def set_arena(self, arena: torch.Tensor, region_bytes: int | None = None) -> None:
        """A new arena (a daemon restart maps a new one): a prefetch read the old one."""
        self._prefetch = None
        super().set_arena(arena, region_bytes)

    def prefetch_pages(self, restored: int | None = None) -> int:
        """The pages of `prefetch_fills` staging fills of a load of global layers, plus
        one: a group that reaches a prefetch's last page may go on in the load, so the
        prefetch leaves it to the load. For a load of `restored` pages, as many whole
        fills as leave it a page more (0 when not even one does: a head lookup that
        prefetches nothing would only cost its round trip)."""
        nbytes = self.layout.global_bytes
        ranges = self.slot_ranges([PageCopy(0, nbytes, (), b"")])
        if len(ranges) == 1:
            rows = min(_SPAN_PAGES, self.staging_bytes // nbytes)
        else:
            rows = self.staging_bytes // (len(ranges[0]) * self.layout.slot_bytes)
        rows = max(1, rows)
        fills = min(self.prefetch_fills, len(self._prefetch_buffers()))
        if restored is not None:
            fills = min(fills, (restored - 2) // rows)
        return fills * rows + 1 if fills > 0 else 0

    def _prefetch_buffers(self) -> list[_Buffer]:
        """Where a prefetch's fills go, in order: the load buffers, then the store's."""
        return [(d, b) for d in ("load", "store") for b in range(len(self.staging[d]))]

    def prefetch(self, copies: Sequence[PageCopy]) -> Prefetch | None:
        """Up to `prefetch_fills` staging buffers (_prefetch_buffers) filled with the
        first groups of a load of `copies`, on the load's copy stream (each fill after
        its buffer's last drain)."""
        self._prefetch = None
        if self.arena is None:
            return None
        slots, groups = self._first_fills(copies)
        buffers = self._prefetch_buffers()[: self.prefetch_fills]
        # Such a group may hold more pages in the load (the prefetch saw only these).
        groups = [g for g in groups[: len(buffers)] if g.pages.stop < len(copies)]
        if not groups:
            return None
        copy_s = self.streams["load_copy"]
        self._injected_delay(copy_s)
        fill = self._fill(copies, slots)
        fills = []
        for group, (d, b) in zip(groups, buffers):
            copy_s.wait_event(self.free[d][b])
            with torch.cuda.stream(copy_s):
                fills.append((group, fill(self.staging[d][b], group), (d, b)))
                self.filled[d][b].record(copy_s)
        self._prefetch = _StagedFills(slots, tuple(fills))
        self._prefetch_kept = len(fills)
        return self._prefetch

    def _take_back_store_buffers(self, stream: torch.cuda.Stream) -> None:
        """Before a store fills its buffers on `stream`: it waits for any prefetch's copies
        into them, taken by a load or not, which would otherwise land on the store's rows
        (each buffer's `filled` was last recorded by such a copy or by a fill on `stream`
        itself); and the latest prefetch gives up its fills there (its load copies those
        groups itself)."""
        for event in self.filled["store"]:
            stream.wait_event(event)
        if self._prefetch is not None:
            in_load_buffers = sum(d == "load" for _, _, (d, _) in self._prefetch.fills)
            self._prefetch_kept = min(self._prefetch_kept, in_load_buffers)

    def _first_fills(self, copies: Sequence[PageCopy]) -> tuple[range | None, list[SpanGroup]]:
        """The first slot range of a load of `copies` (None: whole pages, one range) and the
        groups of its fills."""
        ranges = self.slot_ranges(copies)
        if len(ranges) == 1:
            return None, span_groups(copies, self.staging_bytes, MAX_SPAN_GAP, _SPAN_PAGES)
        return ranges[0], self._slot_groups(copies, ranges[0])

    def _slot_groups(self, copies: Sequence[PageCopy], slots: range) -> list[SpanGroup]:
        width = len(slots) * self.layout.slot_bytes
        first_byte = slots.start * self.layout.slot_bytes
        return strided_groups(
            copies, first_byte, width, self.staging_bytes // width, MAX_PITCH, self.region_bytes
        )

    def _fill(
        self, copies: Sequence[PageCopy], slots: range | None
    ) -> Callable[[torch.Tensor, SpanGroup], torch.Tensor]:
        """What fills a staging buffer with a group of `copies`: their whole span (slots
        None), or each page's part of `slots`, one strided copy (else one per page)."""
        assert self.arena is not None
        arena = self.arena
        if slots is None:
            return lambda buffer, group: fill_span(buffer, arena, group)
        width = len(slots) * self.layout.slot_bytes
        first_byte = slots.start * self.layout.slot_bytes

        def fill(buffer: torch.Tensor, group: SpanGroup) -> torch.Tensor:
            if self.strided_copy is not None:
                src = arena.data_ptr() + group.offset
                try:
                    return self.strided_copy(buffer, src, group.stride, width, len(group.pages))
                except StridedCopyError as exc:  # the same bytes, one copy per row
                    _log.warning("%s; copying the rows one by one", exc)
            for row, i in enumerate(group.pages):
                start = copies[i].offset + first_byte
                buffer[row * width : (row + 1) * width].copy_(
                    arena[start : start + width], non_blocking=True
                )
            return buffer[: len(group.pages) * width].view(-1, width)

        return fill

    def _load_tables(self, copies: Sequence[PageCopy], stream: torch.cuda.Stream) -> _LoadTables:
        pairs = self._pairs(copies, stream)
        sliding_pairs = self._sliding_pairs(copies, stream)
        constants = self._constants([c.key for c in copies], stream)
        with torch.cuda.stream(stream):
            sums = torch.zeros((len(copies), 2, 2), dtype=torch.int64, device=self.device)
        return _LoadTables(pairs, sliding_pairs, constants, sums)

    def load(self, copies: Sequence[PageCopy], prefetch: Prefetch | None = None) -> TransferJob:
        """Pages of adjacent arena slots come in one copy per group (span_groups), and the
        first two copies are issued before the tables the scatter needs are built: until
        the first copy starts, the host's time is the hit's time to first token (which is
        why a prefetch may have issued them before the load was planned)."""
        ranges = self.slot_ranges(copies)
        staged = self._staged(prefetch, ranges[0] if len(ranges) > 1 else None)
        if len(ranges) > 1:
            return self._load_by_layers(copies, ranges, staged)
        assert self.arena is not None
        copy_s, scatter_s = self._start_load()
        tables: list[_LoadTables] = []

        def upload_tables() -> None:
            tables.append(self._load_tables(copies, scatter_s))

        def drain(rows: torch.Tensor, group: range) -> None:
            t = tables[0]
            self._checksum_group(
                rows, t.constants[group.start : group.stop], t.sums[group.start : group.stop]
            )
            self._copy_blocks(rows, group, t.pairs, t.sliding_pairs, to_cache=True)

        groups = span_groups(copies, self.staging_bytes, MAX_SPAN_GAP, _SPAN_PAGES)
        fill = self._fill(copies, None)
        self._pipeline("load", groups, copy_s, fill, scatter_s, drain, upload_tables, staged)
        if not tables:  # no copies
            upload_tables()
        return self._finish(
            copies, tables[0].sums, scatter_s, always_done=breaks(self.faults, "load")
        )

    def _load_by_layers(
        self,
        copies: Sequence[PageCopy],
        ranges: Sequence[range],
        staged: Sequence[_Fill],
    ) -> TransferJob:
        """A load of global layers only, one group of slots after the other: every page's
        part of a group is copied (a host copy per page: the parts are not adjacent in the
        arena), checksummed at its place in the page and scattered before the next group
        starts, and an event after each group's last scatter is that group's wait: by the
        host for the first `host_waited_groups` groups, by the compute stream after them."""
        assert self.arena is not None
        _, scatter_s = self._start_load()
        tables: list[_LoadTables] = []

        def upload_tables() -> None:
            tables.append(self._load_tables(copies, scatter_s))

        waits: list[tuple[range, Callable[[], None]]] = []
        for k, slots in enumerate(ranges):
            self._load_slots(copies, slots, tables, upload_tables, staged if k == 0 else ())
            done = torch.cuda.Event()
            done.record(scatter_s)
            host = k < self.host_waited_groups
            waits.append((slots, done.synchronize if host else self._waiter(done)))
        job = self._finish(
            copies, tables[0].sums, scatter_s, always_done=breaks(self.faults, "load")
        )
        job.slot_waits = waits
        return job

    def _load_slots(
        self,
        copies: Sequence[PageCopy],
        slots: range,
        tables: list[_LoadTables],
        upload_tables: Callable[[], None],
        staged: Sequence[_Fill],
    ) -> None:
        first_byte = slots.start * self.layout.slot_bytes

        def drain(rows: torch.Tensor, group: range) -> None:
            t = tables[0]
            part = slice(group.start, group.stop)
            self.checksum_rows(
                rows, t.constants[part], t.sums[part], self.layout.global_bytes, first_byte
            )
            self.blocks(rows, t.pairs(group), group.start, True, slots.start)

        before_first_drain = None if tables else upload_tables
        self._pipeline(
            "load",
            self._slot_groups(copies, slots),
            self.streams["load_copy"],
            self._fill(copies, slots),
            self.streams["load_scatter"],
            drain,
            before_first_drain,
            staged,
        )

    def _waiter(self, event: torch.cuda.Event) -> Callable[[], None]:
        """Makes the stream current when it is called wait for `event`."""
        return lambda: torch.cuda.current_stream(self.device).wait_event(event)

    def store(
        self, copies: Sequence[PageCopy], ready: threading.Event | None = None
    ) -> TransferJob:
        assert self.arena is not None
        gather_s, copy_s = self.streams["store_gather"], self.streams["store_copy"]
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        if not breaks(self.faults, "store"):
            gather_s.wait_event(produced)
        self._take_back_store_buffers(gather_s)
        pairs = self._pairs(copies, gather_s)
        sliding_pairs = self._sliding_pairs(copies, gather_s)
        constants = self._constants([c.key for c in copies], gather_s)
        with torch.cuda.stream(gather_s):
            sums = torch.zeros((len(copies), 2, 2), dtype=torch.int64, device=self.device)

        def fill(buffer: torch.Tensor, group: SpanGroup) -> torch.Tensor:
            rows = staged_rows(buffer, group)
            pages = group.pages
            self._copy_blocks(rows, pages, pairs, sliding_pairs, to_cache=False)
            self._checksum_group(
                rows, constants[pages.start : pages.stop], sums[pages.start : pages.stop]
            )
            return rows

        def drain(rows: torch.Tensor, group: range) -> None:
            for row, i in zip(rows, group):
                c = copies[i]
                self.arena[c.offset : c.offset + c.nbytes].copy_(row, non_blocking=True)

        # Stores copy page by page: a span would write over the headers between pages.
        groups = [
            SpanGroup(g, copies[g.start].offset, copies[g.start].nbytes, copies[g.start].nbytes)
            for g in page_groups(copies, self.staging_bytes)
        ]
        self._pipeline("store", groups, gather_s, fill, copy_s, drain)
        copy_s.wait_stream(gather_s)
        return self._finish(copies, sums, copy_s, always_done=False)

    def _raw_checksum(
        self, row: torch.Tensor, key: bytes, stream: torch.cuda.Stream
    ) -> torch.Tensor:
        """Enqueue a row's checksum, one segment, on `stream`; returns its sums."""
        constants = self._constants([key], stream)
        with torch.cuda.stream(stream):
            sums = torch.zeros((1, 2, 2), dtype=torch.int64, device=self.device)
            self.checksum_rows(row.view(1, -1), constants, sums, row.numel())
        return sums

    def load_raw(self, offset: int, row: torch.Tensor, key: bytes) -> TransferJob:
        assert self.arena is not None
        stream = self.streams["load_raw"]
        self._after_compute(stream)
        with torch.cuda.stream(stream):
            row.copy_(self.arena[offset : offset + row.numel()], non_blocking=True)
        sums = self._raw_checksum(row, key, stream)
        return self._job(sums, stream, 1, 1, always_done=breaks(self.faults, "load"))

    def store_raw(
        self, offset: int, row: torch.Tensor, key: bytes, ready: threading.Event | None = None
    ) -> TransferJob:
        assert self.arena is not None
        stream = self.streams["store_copy"]
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        if not breaks(self.faults, "store"):
            stream.wait_event(produced)
        sums = self._raw_checksum(row, key, stream)
        with torch.cuda.stream(stream):
            self.arena[offset : offset + row.numel()].copy_(row, non_blocking=True)
        return self._job(sums, stream, 1, 1, always_done=False)

    def _finish(
        self,
        copies: Sequence[PageCopy],
        sums: torch.Tensor,
        stream: torch.cuda.Stream,
        always_done: bool,
    ) -> TransferJob:
        return self._job(
            sums, stream, len(copies), copied_segments(self.layout, copies), always_done
        )

    def _job(
        self,
        sums: torch.Tensor,
        stream: torch.cuda.Stream,
        num_pages: int,
        num_segments: int,
        always_done: bool,
    ) -> TransferJob:
        host = torch.empty(sums.shape, dtype=torch.int64, pin_memory=True)
        event = torch.cuda.Event()
        with torch.cuda.stream(stream):
            host.copy_(sums, non_blocking=True)
            event.record(stream)
        # A store's sums live on its gather stream and are read here on its copy stream:
        # without this the caching allocator hands their memory to the next allocation on
        # the gather stream (the next store's sums, zeroed at once) before this copy ran,
        # and the commit records a checksum its page does not have.
        sums.record_stream(stream)
        return _CudaJob(num_pages, num_segments, event, host, always_done)

    def _wait_whole(self, job: TransferJob) -> None:
        assert isinstance(job, _CudaJob)
        self._waiter(job.event)()

    def synchronize(self) -> None:
        for stream in self.streams.values():
            stream.synchronize()
