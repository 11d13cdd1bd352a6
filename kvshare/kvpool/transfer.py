"""Moving pages between the arena and the engine's paged KV cache, in order.

`CudaTransfer` copies whole pages (MiBs: the PCIe ceiling needs large copies) between
the registered arena and a GPU staging buffer, and scatters/gathers between the staging
buffer and the scattered blocks on the GPU. Two staging buffers per direction and two
streams per direction (copy engine, SMs) let group i+1's copies overlap group i's scatter.
A group is a run of pages of one size checksummed and scattered/gathered together: at 16
MiB pages, issuing checksum kernels page by page took the host longer than the copy took
the PCIe link, and index_copy_ over a cache of more than 2**31 elements is split into
32 launches per page, which block the host once the stream's queue fills. The scatter and
gather are one Triton launch per group with 64-bit offsets (block_copy.py), driven by a
table of (page, block) pairs uploaded once per load or store; so is the checksum
(checksum_kernel.py), keyed per page by constants uploaded with the pairs.

`ThreadTransfer` (CPU) does the same work on a worker thread, straight from/into the
arena.

Ordering (ARCHITECTURE.md): a store waits for the compute work that produced its blocks
(an event recorded on the compute stream, or a fence on the CPU); a load is done only
when its last scatter has completed, and the compute stream waits on it before reading.
`break_order` removes one of these waits: it exists only so that tests can show that the
byte checks catch a missing dependency. Never set it in production.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from kvshare.kvpool.layout import PageLayout, checksum_constants, payload_checksum, payload_words

if TYPE_CHECKING:
    from kvshare.kvpool.block_copy import BlockCopy

BreakOrder = Literal["", "store", "load"]
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PageCopy:
    """One page <-> one chunk's blocks. The first `nbytes` of the payload (at arena byte
    `offset`) cover the first nbytes / slot_bytes cache slots. `key` is the page's key,
    which keys its checksum. A load leaves the blocks before `first_block` untouched (the
    engine already has them)."""

    offset: int
    nbytes: int
    blocks: tuple[int, ...]
    key: bytes
    first_block: int = 0


class TransferJob(ABC):
    """`always_done` is the broken load ordering (test-only): done() without waiting."""

    def __init__(self, num_pages: int, num_segments: int, always_done: bool) -> None:
        self.num_pages = num_pages
        self.num_segments = num_segments
        self.always_done = always_done
        self.failed = False  # set when a copy raised: nothing it touched may be trusted

    def done(self) -> bool:
        """True once every copy of the job has completed (never blocks)."""
        return self.always_done or self._completed()

    @abstractmethod
    def _completed(self) -> bool: ...

    @abstractmethod
    def wait(self) -> None: ...

    @abstractmethod
    def _checksum_array(self) -> np.ndarray: ...

    def checksums(self) -> list[list[bytes]]:
        """Per page, the 16-byte checksum of each segment copied. Valid once done()."""
        values = self._checksum_array().astype("<i8")
        return [[values[p, s].tobytes() for s in range(self.num_segments)] for p in range(self.num_pages)]


class Transfer(ABC):
    def __init__(self, kv: torch.Tensor, layout: PageLayout, break_order: BreakOrder = "") -> None:
        self.kv = kv
        self.layout = layout
        self.break_order = break_order
        self.arena: torch.Tensor | None = None

    def set_arena(self, arena: torch.Tensor) -> None:
        self.arena = arena

    @abstractmethod
    def load(self, copies: Sequence[PageCopy]) -> TransferJob: ...

    @abstractmethod
    def store(self, copies: Sequence[PageCopy], ready: threading.Event | None = None) -> TransferJob: ...

    @abstractmethod
    def load_raw(self, offset: int, row: torch.Tensor, key: bytes) -> TransferJob:
        """Copy the payload of page `key` at arena byte `offset` into a contiguous uint8
        row (a recurrent-state slot), one checksummed segment."""

    @abstractmethod
    def store_raw(self, offset: int, row: torch.Tensor, key: bytes,
                  ready: threading.Event | None = None) -> TransferJob:
        """Copy a contiguous uint8 row into the payload of page `key` at `offset`, after
        the compute work already issued (or `ready`), one checksummed segment."""

    @abstractmethod
    def consume(self, job: TransferJob) -> None:
        """Order the compute work issued from now on after the load's copies."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for every enqueued copy."""


def page_groups(copies: Sequence[PageCopy], staging_bytes: int, max_pages: int = 8) -> list[range]:
    """Runs of consecutive copies of one size, in order: as many as fit `staging_bytes`
    (at least one), at most max_pages."""
    groups, start = [], 0
    for i in range(1, len(copies) + 1):
        size = copies[start].nbytes
        if (i == len(copies) or copies[i].nbytes != size or i - start == max_pages
                or (i - start + 1) * size > staging_bytes):
            groups.append(range(start, i))
            start = i
    return groups


def _num_segments(layout: PageLayout, copies: Sequence[PageCopy]) -> int:
    return max(len(layout.segments(c.nbytes)) for c in copies)


# --------------------------------------------------------------------------- CUDA


class _CudaJob(TransferJob):
    def __init__(self, num_pages: int, num_segments: int, event: torch.cuda.Event,
                 host_checksums: torch.Tensor, always_done: bool) -> None:
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
    def __init__(self, kv: torch.Tensor, layout: PageLayout, break_order: BreakOrder = "",
                 load_delay_cycles: int = 0) -> None:
        super().__init__(kv, layout, break_order)
        self.device = kv.device
        self.load_delay_cycles = load_delay_cycles
        self.streams = {name: torch.cuda.Stream(self.device) for name in
                        ("load_copy", "load_scatter", "store_gather", "store_copy")}
        # A staging buffer holds one whole page, or several (128 MiB): loads of global layers
        # only copy a part of each page, so more of them fit.
        nbytes = self.staging_bytes = max(layout.payload_bytes, 128 << 20)
        self.staging = {d: [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
                        for d in ("load", "store")}
        # filled[d][b]: staging buffer b holds data; free[d][b]: its consumer is done with it.
        self.filled = {d: [torch.cuda.Event() for _ in range(2)] for d in ("load", "store")}
        self.free = {d: [torch.cuda.Event() for _ in range(2)] for d in ("load", "store")}
        from kvshare.kvpool.block_copy import BlockCopy  # triton: only where CUDA is
        from kvshare.kvpool.checksum_kernel import checksum_rows

        self.blocks: BlockCopy = BlockCopy(kv, layout.blocks_per_page)
        self.checksum_rows = checksum_rows

    def _pipeline(self, direction: str, copies: Sequence[PageCopy],
                  first: torch.cuda.Stream, fill: Callable[[torch.Tensor, range], None],
                  second: torch.cuda.Stream, drain: Callable[[torch.Tensor, range], None]) -> None:
        """Each page group through the direction's two staging buffers: fill(rows, group) on
        `first` once `second` is done with the buffer, then drain(rows, group) on `second`
        once `first` filled it. Rows are the buffer as one row of bytes per page."""
        for k, group in enumerate(page_groups(copies, self.staging_bytes)):
            b = k % 2
            nbytes = copies[group.start].nbytes
            rows = self.staging[direction][b][:len(group) * nbytes].view(len(group), nbytes)
            first.wait_event(self.free[direction][b])
            with torch.cuda.stream(first):
                fill(rows, group)
                self.filled[direction][b].record(first)
            second.wait_event(self.filled[direction][b])
            with torch.cuda.stream(second):
                drain(rows, group)
                self.free[direction][b].record(second)

    def _upload(self, table: np.ndarray, stream: torch.cuda.Stream) -> torch.Tensor:
        """A host table on the device, through one pinned, asynchronous copy on `stream`."""
        with torch.cuda.stream(stream):
            return torch.from_numpy(table).pin_memory().to(self.device, non_blocking=True)

    def _constants(self, keys: Sequence[bytes], stream: torch.cuda.Stream) -> torch.Tensor:
        """Each key's checksum constants (int64 [len(keys), 4]) on the device."""
        return self._upload(np.stack([checksum_constants(k) for k in keys]).view(np.int64), stream)

    def _checksum_group(self, rows: torch.Tensor, constants: torch.Tensor, sums: torch.Tensor) -> None:
        self.checksum_rows(rows, constants, sums, min(self.layout.global_bytes, rows.shape[1]))

    def _pairs(self, copies: Sequence[PageCopy],
               stream: torch.cuda.Stream) -> Callable[[range], torch.Tensor]:
        """The (page, j, block) pairs of every copy, uploaded once on `stream`; returns the
        device pairs of a group (a slice: no GPU work)."""
        table, offsets = self.blocks.pairs([c.blocks for c in copies], [c.first_block for c in copies])
        pairs = self._upload(table, stream)
        return lambda group: pairs[offsets[group.start]:offsets[group.stop]]

    def load(self, copies: Sequence[PageCopy]) -> TransferJob:
        assert self.arena is not None
        copy_s, scatter_s = self.streams["load_copy"], self.streams["load_scatter"]
        pairs = self._pairs(copies, scatter_s)
        constants = self._constants([c.key for c in copies], scatter_s)
        with torch.cuda.stream(scatter_s):
            sums = torch.zeros((len(copies), 2, 2), dtype=torch.int64, device=self.device)
        if self.load_delay_cycles:
            with torch.cuda.stream(copy_s):
                torch.cuda._sleep(self.load_delay_cycles)

        def fill(rows: torch.Tensor, group: range) -> None:
            for row, i in zip(rows, group):
                c = copies[i]
                row.copy_(self.arena[c.offset:c.offset + c.nbytes], non_blocking=True)

        def drain(rows: torch.Tensor, group: range) -> None:
            self._checksum_group(rows, constants[group.start:group.stop], sums[group.start:group.stop])
            self.blocks(rows, pairs(group), group.start, to_cache=True)

        self._pipeline("load", copies, copy_s, fill, scatter_s, drain)
        return self._finish(copies, sums, scatter_s, always_done=self.break_order == "load")

    def store(self, copies: Sequence[PageCopy], ready: threading.Event | None = None) -> TransferJob:
        assert self.arena is not None
        gather_s, copy_s = self.streams["store_gather"], self.streams["store_copy"]
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        if self.break_order != "store":
            gather_s.wait_event(produced)
        pairs = self._pairs(copies, gather_s)
        constants = self._constants([c.key for c in copies], gather_s)
        with torch.cuda.stream(gather_s):
            sums = torch.zeros((len(copies), 2, 2), dtype=torch.int64, device=self.device)

        def fill(rows: torch.Tensor, group: range) -> None:
            self.blocks(rows, pairs(group), group.start, to_cache=False)
            self._checksum_group(rows, constants[group.start:group.stop], sums[group.start:group.stop])

        def drain(rows: torch.Tensor, group: range) -> None:
            for row, i in zip(rows, group):
                c = copies[i]
                self.arena[c.offset:c.offset + c.nbytes].copy_(row, non_blocking=True)

        self._pipeline("store", copies, gather_s, fill, copy_s, drain)
        copy_s.wait_stream(gather_s)
        return self._finish(copies, sums, copy_s, always_done=False)

    def _raw_checksum(self, row: torch.Tensor, key: bytes, stream: torch.cuda.Stream) -> torch.Tensor:
        """Enqueue a row's checksum, one segment, on `stream`; returns its sums."""
        constants = self._constants([key], stream)
        with torch.cuda.stream(stream):
            sums = torch.zeros((1, 2, 2), dtype=torch.int64, device=self.device)
            self.checksum_rows(row.view(1, -1), constants, sums, row.numel())
        return sums

    def load_raw(self, offset: int, row: torch.Tensor, key: bytes) -> TransferJob:
        assert self.arena is not None
        stream = self.streams["load_copy"]
        with torch.cuda.stream(stream):
            row.copy_(self.arena[offset:offset + row.numel()], non_blocking=True)
        sums = self._raw_checksum(row, key, stream)
        return self._job(sums, stream, 1, 1, always_done=self.break_order == "load")

    def store_raw(self, offset: int, row: torch.Tensor, key: bytes,
                  ready: threading.Event | None = None) -> TransferJob:
        assert self.arena is not None
        stream = self.streams["store_copy"]
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        if self.break_order != "store":
            stream.wait_event(produced)
        sums = self._raw_checksum(row, key, stream)
        with torch.cuda.stream(stream):
            self.arena[offset:offset + row.numel()].copy_(row, non_blocking=True)
        return self._job(sums, stream, 1, 1, always_done=False)

    def _finish(self, copies: Sequence[PageCopy], sums: torch.Tensor, stream: torch.cuda.Stream,
                always_done: bool) -> TransferJob:
        return self._job(sums, stream, len(copies), _num_segments(self.layout, copies), always_done)

    def _job(self, sums: torch.Tensor, stream: torch.cuda.Stream, num_pages: int, num_segments: int,
             always_done: bool) -> TransferJob:
        host = torch.empty(sums.shape, dtype=torch.int64, pin_memory=True)
        event = torch.cuda.Event()
        with torch.cuda.stream(stream):
            host.copy_(sums, non_blocking=True)
            event.record(stream)
        return _CudaJob(num_pages, num_segments, event, host, always_done)

    def consume(self, job: TransferJob) -> None:
        if self.break_order != "load":
            assert isinstance(job, _CudaJob)
            torch.cuda.current_stream(self.device).wait_event(job.event)

    def synchronize(self) -> None:
        for stream in self.streams.values():
            stream.synchronize()


# --------------------------------------------------------------------------- CPU


class _ThreadJob(TransferJob):
    def __init__(self, num_pages: int, num_segments: int, always_done: bool) -> None:
        super().__init__(num_pages, num_segments, always_done)
        self.finished = threading.Event()
        self.sums = np.zeros((num_pages, 2, 2), dtype=np.int64)

    def _completed(self) -> bool:
        return self.finished.is_set()

    def wait(self) -> None:
        self.finished.wait()

    def _checksum_array(self) -> np.ndarray:
        return self.sums


class ThreadTransfer(Transfer):
    """CPU: one worker thread runs jobs in order, reading/writing the arena directly."""

    def __init__(self, kv: torch.Tensor, layout: PageLayout, break_order: BreakOrder = "",
                 load_delay_seconds: float = 0.0) -> None:
        super().__init__(kv, layout, break_order)
        self.load_delay_seconds = load_delay_seconds
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.worker = threading.Thread(target=self._run, name="kvshare-transfer", daemon=True)
        self.worker.start()

    def _run(self) -> None:
        while True:
            self.jobs.get()()

    def page_view(self, data: torch.Tensor, nbytes: int) -> torch.Tensor:
        """Bytes of a page as [slots, K|V, blocks, block_size, kv_heads, head_dim]."""
        kv = self.kv
        slots = nbytes // self.layout.slot_bytes
        return data[:nbytes].view(kv.dtype).view(slots, 2, self.layout.blocks_per_page, *kv.shape[3:])

    def _page(self, c: PageCopy) -> torch.Tensor:
        assert self.arena is not None
        return self.arena[c.offset:c.offset + c.nbytes]

    def _checksums(self, job: _ThreadJob, i: int, data: torch.Tensor, key: bytes) -> None:
        constants, words = checksum_constants(key), payload_words(data)
        for s, (lo, hi) in enumerate(self.layout.segments(data.numel())):
            job.sums[i, s] = payload_checksum(words[lo // 8:hi // 8], constants, lo // 8).view(np.int64)

    def _submit(self, job: _ThreadJob, work: Callable[[], None], ready: threading.Event | None = None) -> None:
        """Run work() on the worker after `ready` (unless store ordering is broken); a
        failure marks the job failed and never kills the worker."""

        def run() -> None:
            try:
                if ready is not None and self.break_order != "store":
                    ready.wait()
                work()
            except Exception:
                _log.exception("pool copy failed")
                job.failed = True
            finally:
                job.finished.set()

        self.jobs.put(run)

    def load(self, copies: Sequence[PageCopy]) -> TransferJob:
        job = _ThreadJob(len(copies), _num_segments(self.layout, copies), self.break_order == "load")

        def work() -> None:
            if self.load_delay_seconds:
                time.sleep(self.load_delay_seconds)
            for i, c in enumerate(copies):
                data = self._page(c)
                self._checksums(job, i, data, c.key)
                view = self.page_view(data, c.nbytes)
                idx = torch.tensor(c.blocks[c.first_block:], dtype=torch.int64)
                self.kv[:view.shape[0]].index_copy_(2, idx, view[:, :, c.first_block:])

        self._submit(job, work)
        return job

    def store(self, copies: Sequence[PageCopy], ready: threading.Event | None = None) -> TransferJob:
        job = _ThreadJob(len(copies), _num_segments(self.layout, copies), False)

        def work() -> None:
            for i, c in enumerate(copies):
                data = self._page(c)
                # Only the page's slots: index_select resizes `out` to its input's slots.
                view = self.page_view(data, c.nbytes)
                torch.index_select(self.kv[:view.shape[0]], 2, torch.tensor(c.blocks, dtype=torch.int64),
                                   out=view)
                self._checksums(job, i, data, c.key)

        self._submit(job, work, ready)
        return job

    def _raw_checksum(self, job: _ThreadJob, data: torch.Tensor, key: bytes) -> None:
        job.sums[0, 0] = payload_checksum(payload_words(data), checksum_constants(key)).view(np.int64)

    def load_raw(self, offset: int, row: torch.Tensor, key: bytes) -> TransferJob:
        job = _ThreadJob(1, 1, self.break_order == "load")
        page = self._page(PageCopy(offset, row.numel(), (), key))

        def work() -> None:
            if self.load_delay_seconds:
                time.sleep(self.load_delay_seconds)
            self._raw_checksum(job, row.copy_(page), key)

        self._submit(job, work)
        return job

    def store_raw(self, offset: int, row: torch.Tensor, key: bytes,
                  ready: threading.Event | None = None) -> TransferJob:
        job = _ThreadJob(1, 1, False)
        page = self._page(PageCopy(offset, row.numel(), (), key))
        self._submit(job, lambda: self._raw_checksum(job, page.copy_(row), key), ready)
        return job

    def consume(self, job: TransferJob) -> None:
        """The CPU has no stream to order: the engine thread waits for the worker here."""
        if self.break_order != "load":
            job.wait()

    def synchronize(self) -> None:
        barrier = threading.Event()
        self.jobs.put(barrier.set)
        barrier.wait()
