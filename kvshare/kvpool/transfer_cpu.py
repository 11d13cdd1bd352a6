"""`ThreadTransfer`: the `Transfer` of a CPU cache. One worker thread runs jobs in order,
reading/writing the arena directly; a store waits for its fence (the compute that wrote
its blocks) and a job is done only when its copies are."""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvshare.kvpool.faults import FaultInjection, breaks, injected_delay
from kvshare.kvpool.layout import PageLayout, checksum_constants, payload_checksum, payload_words
from kvshare.kvpool.transfer import (
    LayerGroups,
    PageCopy,
    Prefetch,
    Transfer,
    TransferJob,
    copied_segments,
)

_log = logging.getLogger(__name__)


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


def _run_jobs(jobs: queue.SimpleQueue[Callable[[], None] | None]) -> None:
    """Run jobs in order until None comes. A job is dropped once run: while the worker
    waits for the next, nothing it ran may keep its transfer alive."""
    while (job := jobs.get()) is not None:
        job()
        job = None


class ThreadTransfer(Transfer):
    """CPU: one worker thread runs jobs in order, reading/writing the arena directly."""

    def __init__(
        self,
        kv: torch.Tensor,
        layout: PageLayout,
        faults: FaultInjection | None = None,
        sliding_kv: torch.Tensor | None = None,
        layer_groups: LayerGroups | None = None,
    ) -> None:
        super().__init__(kv, layout, faults, sliding_kv, layer_groups)
        self.delay_seconds = injected_delay(faults)
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        # The worker holds the queue, never this object: a thread running a bound method
        # kept every transfer, and the engine's KV cache with it (1 GiB on a CPU), alive
        # for the life of the process after its engine was dropped. It ends when this
        # object is collected.
        self.worker = threading.Thread(
            target=_run_jobs, args=(self.jobs,), name="kvshare-transfer", daemon=True
        )
        self.worker.start()
        weakref.finalize(self, self.jobs.put, None)

    def page_view(self, data: torch.Tensor, nbytes: int) -> torch.Tensor:
        """Bytes of a page as [slots, K|V, blocks, block_size, kv_heads, head_dim]."""
        kv = self.kv
        slots = nbytes // self.layout.slot_bytes
        return (
            data[:nbytes].view(kv.dtype).view(slots, 2, self.layout.blocks_per_page, *kv.shape[3:])
        )

    def _page(self, c: PageCopy) -> torch.Tensor:
        assert self.arena is not None
        return self.arena[c.offset : c.offset + c.nbytes]

    def _parts(
        self, data: torch.Tensor, c: PageCopy
    ) -> list[tuple[torch.Tensor, torch.Tensor, tuple[int, ...], int]]:
        """(cache, page view, blocks, first block) of each part of the page a copy moves:
        the global slots, then the sliding-window slots when the copy holds them."""
        split = min(c.nbytes, self.layout.global_bytes)
        glob = self.page_view(data, split)
        parts = [(self.kv[: glob.shape[0]], glob, c.blocks, c.first_block)]
        if c.nbytes > split:
            assert self.sliding_kv is not None and len(c.sliding_blocks) == len(c.blocks)
            sliding = self.page_view(data[split:], c.nbytes - split)
            parts.append((self.sliding_kv, sliding, c.sliding_blocks, c.sliding_first))
        return parts

    def _checksums(self, job: _ThreadJob, i: int, data: torch.Tensor, key: bytes) -> None:
        constants, words = checksum_constants(key), payload_words(data)
        for s, (lo, hi) in enumerate(self.layout.segments(data.numel())):
            job.sums[i, s] = payload_checksum(words[lo // 8 : hi // 8], constants, lo // 8).view(
                np.int64
            )

    def _submit(
        self, job: _ThreadJob, work: Callable[[], None], ready: threading.Event | None = None
    ) -> None:
        """Run work() on the worker after `ready` (unless store ordering is broken); a
        failure marks the job failed and never kills the worker."""

        def run() -> None:
            try:
                if ready is not None and not breaks(self.faults, "store"):
                    ready.wait()
                work()
            except Exception:
                _log.exception("pool copy failed")
                job.failed = True
            finally:
                job.finished.set()

        self.jobs.put(run)

    def load(self, copies: Sequence[PageCopy], prefetch: Prefetch | None = None) -> TransferJob:
        """Whole pages, or (LayerGroups) every page's part of one group of global slots
        after the other, each group's event set once its copies are in the cache."""
        job = _ThreadJob(
            len(copies), copied_segments(self.layout, copies), breaks(self.faults, "load")
        )
        ranges = self.slot_ranges(copies)
        copied = [threading.Event() for _ in ranges]

        def work() -> None:
            try:
                if self.delay_seconds:
                    time.sleep(self.delay_seconds)
                for slots, event in zip(ranges, copied):
                    for c in copies:
                        self._copy_in(c, slots if len(ranges) > 1 else None)
                    event.set()
                for i, c in enumerate(copies):
                    self._checksums(job, i, self._page(c), c.key)
            finally:  # a failed copy releases its waiters too: job.failed voids the restore
                for event in copied:
                    event.set()

        if len(ranges) > 1:
            job.slot_waits = [(slots, event.wait) for slots, event in zip(ranges, copied)]
        self._submit(job, work)
        return job

    def _copy_in(self, c: PageCopy, slots: range | None) -> None:
        """A page into its blocks: every part of it, or only the global `slots`."""
        for cache, view, blocks, first in self._parts(self._page(c), c):
            if slots is not None:
                cache, view = cache[slots.start : slots.stop], view[slots.start : slots.stop]
            idx = torch.tensor(blocks[first:], dtype=torch.int64)
            cache.index_copy_(2, idx, view[:, :, first:])

    def store(
        self, copies: Sequence[PageCopy], ready: threading.Event | None = None
    ) -> TransferJob:
        job = _ThreadJob(len(copies), copied_segments(self.layout, copies), False)

        def work() -> None:
            for i, c in enumerate(copies):
                data = self._page(c)
                # Only the page's slots: index_select resizes `out` to its input's slots.
                for cache, view, blocks, _ in self._parts(data, c):
                    torch.index_select(cache, 2, torch.tensor(blocks, dtype=torch.int64), out=view)
                self._checksums(job, i, data, c.key)

        self._submit(job, work, ready)
        return job

    def _raw_checksum(self, job: _ThreadJob, data: torch.Tensor, key: bytes) -> None:
        job.sums[0, 0] = payload_checksum(payload_words(data), checksum_constants(key)).view(
            np.int64
        )

    def load_raw(self, offset: int, row: torch.Tensor, key: bytes) -> TransferJob:
        job = _ThreadJob(1, 1, breaks(self.faults, "load"))
        page = self._page(PageCopy(offset, row.numel(), (), key))

        def work() -> None:
            if self.delay_seconds:
                time.sleep(self.delay_seconds)
            self._raw_checksum(job, row.copy_(page), key)

        self._submit(job, work)
        return job

    def store_raw(
        self, offset: int, row: torch.Tensor, key: bytes, ready: threading.Event | None = None
    ) -> TransferJob:
        job = _ThreadJob(1, 1, False)
        page = self._page(PageCopy(offset, row.numel(), (), key))
        self._submit(job, lambda: self._raw_checksum(job, page.copy_(row), key), ready)
        return job

    def _wait_whole(self, job: TransferJob) -> None:
        """The CPU has no stream to order: the engine thread waits for the worker here."""
        job.wait()

    def synchronize(self) -> None:
        barrier = threading.Event()
        self.jobs.put(barrier.set)
        barrier.wait()
