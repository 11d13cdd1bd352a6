"""Moving pages between the arena and the engine's paged KV cache, in order: the interface.

`CudaTransfer` (transfer_cuda.py) copies through GPU staging buffers on their own streams;
`ThreadTransfer` (transfer_cpu.py) copies on a worker thread, straight from/into the arena.

Ordering: a store waits for the compute work that produced its blocks
(an event recorded on the compute stream, or a fence on the CPU); a load is done only
when its last scatter has completed, and the compute stream waits on it before reading.
A load of global layers only may come in groups of layers (`LayerGroups`; the engine flag
--pool-load-layer-groups, by default up to 8 on CUDA and whole pages on the CPU): it then
hands the compute side one wait per group (`SlotFences`) instead of one for the whole load,
and a step's first layers compute while its last layers are still copied (eagerly, or in
captured segments of layers: kvshare.engine.cuda_graphs). It pays when each staging
fill is one strided copy (kvshare.kvpool.strided_copy: as one host copy per page's part,
2,048 copies at 131k tokens took ~85 ms of host time) and the step's small uploads stay
off the copy engine's queue (kvshare.uploads). On the H200 a 131,072-token hit of
shape:qwen3.5-27b then took 179 ms in 4 groups against 211 ms whole (bf16; fp8 102
against 141 ms; docs/results/2026-12-05-h200-session.md).
An injected `FaultInjection` (kvshare.kvpool.faults, checks and tests only) may remove one of
these waits, so that the byte checks can show they catch a missing dependency.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kvshare.engine.connector import SlotFences
from kvshare.kvpool.faults import FaultInjection, breaks
from kvshare.kvpool.layout import CHECKSUM_BYTES, PageLayout

_log = logging.getLogger(__name__)


class PageCopy(NamedTuple):
    """One page <-> one chunk's blocks. The first `nbytes` of the payload (at arena byte
    `offset`) cover the first nbytes / slot_bytes cache slots. `key` is the page's key,
    which keys its checksum. A load leaves the blocks before `first_block` untouched (the
    engine already has them). A copy past the global part (nbytes > global_bytes) moves
    the sliding-window slots between the page and `sliding_blocks` of the sliding cache,
    from `sliding_first` on.

    A NamedTuple rather than a frozen dataclass (immutable either way): a load plans one
    per page before its first copy is issued, 512 at 131k tokens, and a frozen dataclass
    costs ~0.6 us more each (0.3 ms per load)."""

    offset: int
    nbytes: int
    blocks: tuple[int, ...]
    key: bytes
    first_block: int = 0
    sliding_blocks: tuple[int, ...] = ()
    sliding_first: int = 0


# A strided copy of 1 MiB rows ran at 54.7 GB/s on the H200, contiguous copies at 55.0
# (scripts/gpu_copy_order.py). Parts of 512 KiB let an fp8 page of shape:qwen3.5-27b (0.52
# MiB a slot) end in one-slot groups as bf16 pages do: a 131k-token fp8 hit then took 106.8
# ms instead of 109.1 (medians of 6 alternated hits on an H100, 2026-12-06). One host copy
# per page's part (where the CUDA runtime's strided copy is not found) needs 4 MiB: smaller
# copies ran below the PCIe rate, and 2,048 of them took ~85 ms of host time.
_MIN_GROUP_BYTES = 1 << 19
ROW_COPY_MIN_BYTES = 4 << 20


@dataclass(frozen=True)
class LayerGroups:
    """How a load of global layers is split into groups of consecutive cache slots, each
    copied for every page before the next group starts: at most `max_groups`, each group's
    part of a page at least `min_bytes`.

    The groups shrink toward the end (`shrinking`; else they are even): the last group's
    layers compute after the whole load has arrived, so its size is the load's tail; every
    earlier group computes while the groups after it copy, which takes longer as long as a
    slot's compute is faster than its copy (on the H200 at 131k tokens ~2 ms against ~5-10
    ms). From the end: the smallest group that meets `min_bytes`, the same again, then
    twice the one before, the first group taking the rest (16 slots: 8, 4, 2, 1, 1)."""

    min_bytes: int = _MIN_GROUP_BYTES
    max_groups: int = 8
    shrinking: bool = True

    def __post_init__(self) -> None:
        if self.min_bytes < 1 or self.max_groups < 1:
            raise ValueError("min_bytes and max_groups must be >= 1")

    @classmethod
    def at_most(
        cls, max_groups: int, min_bytes: int = _MIN_GROUP_BYTES, shrinking: bool = True
    ) -> LayerGroups | None:
        """Loads in at most `max_groups` groups; None for 1: whole."""
        return cls(min_bytes, max_groups, shrinking) if max_groups > 1 else None

    def for_row_copies(self) -> LayerGroups:
        """These groups for a transfer that copies each page's part alone: parts of at
        least ROW_COPY_MIN_BYTES."""
        return dataclasses.replace(self, min_bytes=max(self.min_bytes, ROW_COPY_MIN_BYTES))

    def ranges(self, layout: PageLayout, copies: Sequence[PageCopy]) -> list[range]:
        """Slot ranges of a load, in copy order. One range (the whole copy) unless there
        are copies, every one of the global layers only, and the model has no
        sliding-window layers."""
        slots = layout.num_global_slots
        whole = layout.num_segments != 1 or any(c.nbytes != layout.global_bytes for c in copies)
        smallest = -(-self.min_bytes // layout.slot_bytes)  # slots in a group, at least
        most = min(self.max_groups, slots // smallest)
        if whole or not copies or most <= 1:
            return [range(slots)]
        if self.shrinking:
            sizes = _shrinking_sizes(slots, smallest, most)
        else:
            sizes = [slots * (g + 1) // most - slots * g // most for g in range(most)]
        bounds = list(itertools.accumulate(sizes, initial=0))
        return [range(a, b) for a, b in itertools.pairwise(bounds)]


def _shrinking_sizes(slots: int, smallest: int, most: int) -> list[int]:
    """Group sizes, first to last: from the end `smallest`, `smallest`, then doubling, for
    at most `most` groups, while the first group (the rest) stays the largest."""
    tail: list[int] = []
    left = slots
    while len(tail) < most - 1:
        size = smallest << max(0, len(tail) - 1)
        if left - size < size:
            break
        tail.append(size)
        left -= size
    return [left, *reversed(tail)]


class TransferJob(ABC):
    """`always_done` is the injected broken load ordering: done() without waiting.
    `slot_waits` (loads): per range of cache slots, what makes the compute side wait for
    that range's copies, in copy order (empty when the load came whole: the compute side
    then waits for all of it)."""

    def __init__(self, num_pages: int, num_segments: int, always_done: bool) -> None:
        self.num_pages = num_pages
        self.num_segments = num_segments
        self.always_done = always_done
        self.failed = False  # set when a copy raised: nothing it touched may be trusted
        self.slot_waits: list[tuple[range, Callable[[], None]]] = []

    def done(self) -> bool:
        """True once every copy of the job has completed (never blocks)."""
        return self.always_done or self._completed()

    @abstractmethod
    def _completed(self) -> bool: ...

    @abstractmethod
    def wait(self) -> None: ...

    @abstractmethod
    def _checksum_array(self) -> np.ndarray: ...

    def checksum_bytes(self) -> np.ndarray:
        """uint8 [pages, segments x 16]: each page's segment checksums, one after the other
        (what `checksums` splits). Valid once done()."""
        values = self._checksum_array().astype("<i8")[:, : self.num_segments]
        return np.ascontiguousarray(values).view(np.uint8).reshape(self.num_pages, -1)

    def checksums(self) -> list[list[bytes]]:
        """Per page, the 16-byte checksum of each segment copied. Valid once done()."""
        rows = self.checksum_bytes()
        step = CHECKSUM_BYTES
        return [
            [row[s * step : (s + 1) * step].tobytes() for s in range(self.num_segments)]
            for row in rows
        ]


class Prefetch:
    """The first copies of a load, issued ahead of it by `Transfer.prefetch` while the
    caller still asks the pool for the rest. Opaque outside the transfer that made it."""


class Transfer(ABC):
    def __init__(
        self,
        kv: torch.Tensor,
        layout: PageLayout,
        faults: FaultInjection | None = None,
        sliding_kv: torch.Tensor | None = None,
        layer_groups: LayerGroups | None = None,
    ) -> None:
        """`kv`: the global slots' cache; `sliding_kv`: the sliding-window slots' cache
        (KVCacheLayout), None without such layers; `layer_groups`: how loads are split
        into groups of layers (None: every load comes whole)."""
        self.kv = kv
        self.sliding_kv = sliding_kv
        self.layout = layout
        self.faults = faults  # None: no fault (production)
        self.layer_groups = layer_groups
        self.arena: torch.Tensor | None = None
        self.region_bytes = 0

    def slot_ranges(self, copies: Sequence[PageCopy]) -> list[range]:
        """The groups of slots a load of `copies` brings in turn (one: the whole load)."""
        if self.layer_groups is None:
            return [range(self.layout.num_global_slots)]
        return self.layer_groups.ranges(self.layout, copies)

    def set_arena(self, arena: torch.Tensor, region_bytes: int | None = None) -> None:
        """`arena`: the pool's mapped bytes; `region_bytes`: the size of the pieces it is
        registered with CUDA in, from its start (its slabs; None: one piece)."""
        self.arena = arena
        self.region_bytes = region_bytes or arena.numel()

    @abstractmethod
    def load(self, copies: Sequence[PageCopy], prefetch: Prefetch | None = None) -> TransferJob:
        """Copy pages into their blocks. `prefetch` (from `prefetch`) may have brought the
        first of them already: the load uses its copies only where they are the load's
        own (the same pages, from the same arena bytes) and nothing of this transfer's
        staging was used since; it copies again whatever it does not use."""

    def prefetch_pages(self, restored: int | None = None) -> int:
        """How many of a load's first pages a prefetch can use (0: none; this transfer
        copies straight into the blocks); for a load of `restored` pages, fewer than
        that (a prefetch leaves a load's last page to the load)."""
        return 0

    def prefetch(self, copies: Sequence[PageCopy]) -> Prefetch | None:
        """Start copying the first pages of a load of `copies` (each copy's offset and
        nbytes only: the blocks are not known yet) before the load itself, to be passed
        to that load; None when nothing was started. A page must stay pinned from here
        until the load that takes its copy completed; a page the load does not copy may
        be released at once (a copy the load does not take is never read)."""
        return None

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
    def _wait_whole(self, job: TransferJob) -> None:
        """Order the compute work issued from now on after all of the load's copies."""

    def consume(self, job: TransferJob, fences: SlotFences | None = None) -> None:
        """Order compute after the load's copies: with `fences`, each slot range's wait
        is left there (the compute side runs it before touching those slots); without,
        the work issued from now on waits for the whole load."""
        if breaks(self.faults, "load") or breaks(self.faults, "load_slots"):
            return
        if fences is None or not job.slot_waits:
            self._wait_whole(job)
            return
        for slots, wait in job.slot_waits:
            fences.add(slots.start, slots.stop, wait)

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for every enqueued copy."""


def page_groups(
    copies: Sequence[PageCopy], staging_bytes: int, max_pages: int = 8, nbytes: int | None = None
) -> list[range]:
    """Runs of consecutive copies of one size, in order: as many as fit `staging_bytes`
    (at least one), at most max_pages; with `nbytes`, each copy counts that many bytes."""
    groups, start = [], 0
    for i in range(1, len(copies) + 1):
        size = copies[start].nbytes if nbytes is None else nbytes
        if (
            i == len(copies)
            or (nbytes is None and copies[i].nbytes != size)
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


def strided_groups(
    copies: Sequence[PageCopy],
    first_byte: int,
    width: int,
    max_pages: int,
    max_stride: int,
    region_bytes: int,
) -> list[SpanGroup]:
    """Bytes [first_byte, first_byte + width) of every copy's payload, in order, as runs
    of at most max_pages copies whose offsets advance by one stride of at most max_stride:
    a strided copy (width-byte rows `stride` apart in the arena) brings each run. The
    arena is registered with CUDA in regions of `region_bytes` from its start (slabs), and
    a run's rows lie inside one region: a strided copy whose rows span two registrations
    is refused."""
    groups: list[SpanGroup] = []
    start = 0
    while start < len(copies):
        offset = copies[start].offset + first_byte
        region_end = (offset // region_bytes + 1) * region_bytes
        stop = start + 1
        stride = copies[stop].offset - copies[start].offset if stop < len(copies) else width
        while (
            width <= stride <= max_stride  # rows may not overlap; the copy's pitch limit
            and stop < len(copies)
            and stop - start < max_pages
            and copies[stop].offset == copies[start].offset + (stop - start) * stride
            and offset + (stop - start) * stride + width <= region_end
        ):
            stop += 1
        if stop - start == 1:
            stride = width
        groups.append(SpanGroup(range(start, stop), offset, width, stride))
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
