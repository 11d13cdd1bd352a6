"""Moving pages between the arena and the engine's paged KV cache, in order: the interface.

`CudaTransfer` (transfer_cuda.py) copies through GPU staging buffers on their own streams;
`ThreadTransfer` (transfer_cpu.py) copies on a worker thread, straight from/into the arena.

Ordering: a store waits for the compute work that produced its blocks
(an event recorded on the compute stream, or a fence on the CPU); a load is done only
when its last scatter has completed, and the compute stream waits on it before reading.
An injected `FaultInjection` (kvshare.kvpool.faults, checks and tests only) may remove one of
these waits, so that the byte checks can show they catch a missing dependency.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvshare.kvpool.faults import FaultInjection
from kvshare.kvpool.layout import PageLayout

if TYPE_CHECKING:
    pass

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PageCopy:
    """One page <-> one chunk's blocks. The first `nbytes` of the payload (at arena byte
    `offset`) cover the first nbytes / slot_bytes cache slots. `key` is the page's key,
    which keys its checksum. A load leaves the blocks before `first_block` untouched (the
    engine already has them). A copy past the global part (nbytes > global_bytes) moves
    the sliding-window slots between the page and `sliding_blocks` of the sliding cache,
    from `sliding_first` on."""

    offset: int
    nbytes: int
    blocks: tuple[int, ...]
    key: bytes
    first_block: int = 0
    sliding_blocks: tuple[int, ...] = ()
    sliding_first: int = 0


class TransferJob(ABC):
    """`always_done` is the injected broken load ordering: done() without waiting."""

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
        return [
            [values[p, s].tobytes() for s in range(self.num_segments)]
            for p in range(self.num_pages)
        ]


class Transfer(ABC):
    def __init__(
        self,
        kv: torch.Tensor,
        layout: PageLayout,
        faults: FaultInjection | None = None,
        sliding_kv: torch.Tensor | None = None,
    ) -> None:
        """`kv`: the global slots' cache; `sliding_kv`: the sliding-window slots' cache
        (KVCacheLayout), None without such layers."""
        self.kv = kv
        self.sliding_kv = sliding_kv
        self.layout = layout
        self.faults = faults  # None: no fault (production)
        self.arena: torch.Tensor | None = None

    def set_arena(self, arena: torch.Tensor) -> None:
        self.arena = arena

    @abstractmethod
    def load(self, copies: Sequence[PageCopy]) -> TransferJob: ...

    @abstractmethod
    def store(
        self, copies: Sequence[PageCopy], ready: threading.Event | None = None
    ) -> TransferJob: ...

    @abstractmethod
    def load_raw(self, offset: int, row: torch.Tensor, key: bytes) -> TransferJob:
        """Copy the payload of page `key` at arena byte `offset` into a contiguous uint8
        row (a recurrent-state slot), one checksummed segment."""

    @abstractmethod
    def store_raw(
        self, offset: int, row: torch.Tensor, key: bytes, ready: threading.Event | None = None
    ) -> TransferJob:
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
        if (
            i == len(copies)
            or copies[i].nbytes != size
            or i - start == max_pages
            or (i - start + 1) * size > staging_bytes
        ):
            groups.append(range(start, i))
            start = i
    return groups


@dataclass(frozen=True)
class SpanGroup:
    """Copies `pages` (indices of a load's copies) of `nbytes` each, whose arena bytes
    start `stride` apart from `offset` on: one host->device copy of `span` bytes brings
    them all, and page i's bytes are then at (i - pages.start) * stride in that copy."""

    pages: range
    offset: int
    nbytes: int
    stride: int

    @property
    def span(self) -> int:
        return (len(self.pages) - 1) * self.stride + self.nbytes


def span_groups(
    copies: Sequence[PageCopy], staging_bytes: int, max_gap: int, max_pages: int = 8
) -> list[SpanGroup]:
    """The copies of a load in order, as runs that one copy each can bring: copies of one
    size, `stride` apart in the arena where stride - nbytes (the bytes between two copies,
    copied for nothing) is at most max_gap, whose span fits `staging_bytes` (a copy too
    large for it is a group of its own), at most max_pages. A copy whose neighbours are
    not so placed is a group of one."""
    groups: list[SpanGroup] = []
    start = 0
    while start < len(copies):
        first = copies[start]
        stop, stride = start + 1, first.nbytes
        if stop < len(copies):
            stride = copies[stop].offset - first.offset
        if not 0 <= stride - first.nbytes <= max_gap:
            stride = first.nbytes
        while (
            stop < len(copies)
            and stop - start < max_pages
            and copies[stop].nbytes == first.nbytes
            and copies[stop].offset == first.offset + (stop - start) * stride
            and (stop - start) * stride + first.nbytes <= staging_bytes
        ):
            stop += 1
        groups.append(SpanGroup(range(start, stop), first.offset, first.nbytes, stride))
        start = stop
    return groups


def fill_span(buffer: torch.Tensor, arena: torch.Tensor, group: SpanGroup) -> torch.Tensor:
    """Copy a group's span of the arena into the front of `buffer` (uint8; asynchronous
    on a CUDA buffer); returns the group's page rows, a [pages, nbytes] view of `buffer`."""
    buffer[: group.span].copy_(arena[group.offset : group.offset + group.span], non_blocking=True)
    return staged_rows(buffer, group)


def staged_rows(buffer: torch.Tensor, group: SpanGroup) -> torch.Tensor:
    """The page rows of a group whose span sits at the front of `buffer`."""
    return buffer.as_strided((len(group.pages), group.nbytes), (group.stride, 1))


def copied_segments(layout: PageLayout, copies: Sequence[PageCopy]) -> int:
    """Checksummed segments per page of a job: those of its largest copy."""
    return max(len(layout.segments(c.nbytes)) for c in copies)
