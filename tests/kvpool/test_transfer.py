"""The CPU transfer checksums each segment of a page where it lies in the page, and the
grouping of a load or store covers every copy once, in order, one page size per group. On
CUDA a state load lands after the compute stream's earlier writes to its slot, and a load
reuses its staging buffers only after their drains read them."""

from __future__ import annotations

import gc
import time
import weakref
from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvshare.engine.connector import KVCacheLayout
from kvshare.kvpool.arena import ArenaGeometry
from kvshare.kvpool.faults import FaultInjection
from kvshare.kvpool.index import PoolIndex
from kvshare.kvpool.layout import PageLayout, checksum_constants, payload_checksum, payload_words
from kvshare.kvpool.transfer import LayerGroups, PageCopy, page_groups, strided_groups
from kvshare.kvpool.transfer_cpu import ThreadTransfer
from kvshare.models.presets import shape_preset
from tests.kvpool.page_copies import cuda_and_cpu_transfers, same_cache_bytes


@given(
    st.lists(st.sampled_from([64, 128, 4096]), max_size=40),
    st.integers(4096, 40000),
    st.integers(1, 9),
)
def test_page_groups_cover_every_copy_in_order(
    sizes: list[int], staging: int, max_pages: int
) -> None:
    copies = [
        PageCopy(offset=i * 8192, nbytes=n, blocks=(i,), key=bytes(16)) for i, n in enumerate(sizes)
    ]
    groups = page_groups(copies, staging, max_pages)
    assert [i for g in groups for i in g] == list(range(len(copies)))
    for g in groups:
        size = copies[g.start].nbytes
        assert 1 <= len(g) <= max_pages and len(g) * size <= staging
        assert all(copies[i].nbytes == size for i in g)
    # Maximal runs: a group ends only when full, at a size change or at the end.
    for g, nxt in pairwise(groups):
        size = copies[g.start].nbytes
        assert (
            len(g) == max_pages or (len(g) + 1) * size > staging or copies[nxt.start].nbytes != size
        )


@given(
    st.lists(st.sampled_from([0, 1, 2, 5]), min_size=1, max_size=40),
    st.integers(0, 3),
    st.integers(1, 4),
    st.integers(1, 9),
    st.sampled_from([8, 16, 1 << 20]),
    st.sampled_from([8, 24, 64, 1 << 20]),
)
def test_strided_groups_read_each_copys_part_once_in_order(
    slot_steps: list[int],
    first: int,
    width: int,
    max_pages: int,
    max_stride: int,
    region: int,
) -> None:
    """Pages sit in arena slots of 8 bytes (a gap of 0 slots repeats a page, as a load
    of the same page twice would; a small max_stride stands for the pitch limit of a
    strided copy; the arena is registered in regions of `region` bytes, as a pool's
    slabs are); each group's strided read (rows of `width` bytes, `stride` apart from
    `offset`) gives every copy's bytes [first, first + width), and a group's rows lie
    inside one region (CUDA refused a strided copy whose rows were in two slabs of an
    arena registered slab by slab on the H200)."""
    slots = np.cumsum(slot_steps)
    arena = np.arange(8 * (int(slots[-1]) + 2), dtype=np.int64)
    copies = [PageCopy(8 * int(s), 8, (), bytes(16)) for s in slots]
    groups = strided_groups(copies, first, width, max_pages, max_stride, region)
    assert [i for g in groups for i in g.pages] == list(range(len(copies)))
    read = []
    for g in groups:
        assert 1 <= len(g.pages) <= max_pages and g.nbytes == width
        assert width <= g.stride <= max_stride or len(g.pages) == 1
        assert g.offset == copies[g.pages.start].offset + first
        if len(g.pages) > 1:
            last_byte = g.offset + (len(g.pages) - 1) * g.stride + width - 1
            assert g.offset // region == last_byte // region
        read += [arena[g.offset + r * g.stride :][:width] for r in range(len(g.pages))]
    expected = [arena[c.offset + first :][:width] for c in copies]
    assert all(np.array_equal(a, b) for a, b in zip(read, expected, strict=True))
    # Maximal runs: a group ends when full, at the end, where the stride changes, where
    # one more row would leave the region, or (a group of one) where the next page is
    # too close or too far for a strided copy.
    for g, nxt in pairwise(groups):
        gap = copies[nxt.pages.start].offset - copies[g.pages.stop - 1].offset
        stride = g.stride if len(g.pages) > 1 else gap
        assert (
            len(g.pages) == max_pages
            or gap != g.stride
            or (len(g.pages) == 1 and not width <= gap <= max_stride)
            or (g.offset % region) + len(g.pages) * stride + width > region
        )


def test_cpu_transfer_checksums_each_segment_at_its_place_in_the_page() -> None:
    """A store checksums both segments of a page under its key, each word at its index in
    the page; a load of the whole page, or of its global prefix, gives the same bits."""
    cache = KVCacheLayout.allocate(
        shape_preset("tiny-gemma3"), 8, 16, torch.float32, torch.device("cpu")
    )
    generator = torch.Generator().manual_seed(2)
    assert cache.sliding_kv is not None
    for kv in (cache.kv, cache.sliding_kv):
        kv.copy_(torch.randn(kv.shape, generator=generator))
    layout = PageLayout.of(cache, 32)
    transfer = ThreadTransfer(cache.kv, layout, sliding_kv=cache.sliding_kv)
    transfer.set_arena(torch.zeros(layout.payload_bytes, dtype=torch.uint8))
    key = bytes(range(16))
    stored = transfer.store([PageCopy(0, layout.payload_bytes, (5, 2), key, 0, (3, 6))])
    stored.wait()
    words, constants, split = (
        payload_words(transfer.arena),
        checksum_constants(key),
        layout.global_bytes // 8,
    )
    expected = [
        payload_checksum(words[:split], constants).tobytes(),
        payload_checksum(words[split:], constants, split).tobytes(),
    ]
    assert stored.checksums() == [expected]
    whole = transfer.load([PageCopy(0, layout.payload_bytes, (1, 3), key, 0, (0, 7))])
    prefix = transfer.load([PageCopy(0, layout.global_bytes, (4, 6), key)])
    other_key = transfer.load([PageCopy(0, layout.payload_bytes, (1, 3), bytes(16), 0, (0, 7))])
    transfer.synchronize()
    # The global part went to the blocks, the sliding part to the sliding blocks.
    assert torch.equal(cache.kv[:, :, [1, 3]], cache.kv[:, :, [5, 2]])
    assert torch.equal(cache.sliding_kv[:, :, [0, 7]], cache.sliding_kv[:, :, [3, 6]])
    assert whole.checksums() == [expected]
    assert prefix.checksums() == [expected[:1]]
    assert other_key.checksums()[0][0] != expected[0] and other_key.checksums()[0][1] != expected[1]


def test_a_dropped_cpu_transfer_frees_its_cache_and_ends_its_worker() -> None:
    """Its worker thread must not keep it (and so the engine's KV cache, 1 GiB on a CPU by
    default) alive once nothing else refers to it: an engine dropped by its user, or each
    test's engine in a long suite, would hold its memory until the process exits."""
    cache = KVCacheLayout.allocate(
        shape_preset("tiny-llama"), 8, 16, torch.float32, torch.device("cpu")
    )
    transfer = ThreadTransfer(cache.kv, PageLayout.of(cache, 32))
    transfer.set_arena(torch.zeros(PageLayout.of(cache, 32).payload_bytes, dtype=torch.uint8))
    transfer.store([PageCopy(0, transfer.layout.payload_bytes, (5, 2), bytes(16))]).wait()
    kv, worker = weakref.ref(cache.kv), transfer.worker
    del cache, transfer
    gc.collect()
    assert kv() is None
    worker.join(timeout=10)
    assert not worker.is_alive()


def test_cpu_store_of_a_global_only_page_writes_only_that_page() -> None:
    """A page that holds the first slots only gets exactly those bytes; the arena bytes
    after it (the next page) stay as they were."""
    cache = KVCacheLayout.allocate(
        shape_preset("tiny-gemma3"), 8, 16, torch.float32, torch.device("cpu")
    )
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(1)))
    layout = PageLayout.of(cache, 32)
    transfer = ThreadTransfer(cache.kv, layout)
    nbytes = layout.global_bytes
    arena = torch.full((2 * layout.payload_bytes,), 0x5A, dtype=torch.uint8)
    transfer.set_arena(arena)
    transfer.store([PageCopy(offset=0, nbytes=nbytes, blocks=(5, 2), key=bytes(16))]).wait()
    assert 0 < nbytes < layout.payload_bytes
    assert bool((arena[nbytes:] == 0x5A).all())
    expected = cache.kv[: layout.num_global_slots][:, :, [5, 2]]
    assert torch.equal(transfer.page_view(arena, nbytes), expected)


@pytest.mark.cuda
@pytest.mark.parametrize("broken", [False, True])
def test_cuda_state_load_lands_after_the_compute_streams_earlier_writes(broken: bool) -> None:
    """A hybrid restore loads the recurrent state into a fresh slot, which the compute
    stream zeroes first (RecurrentStates.allocate). The load stream must wait for that: in
    the broken variant the zeroing, held back by a GPU sleep, wipes the restored state."""
    from kvshare.kvpool.transfer_cuda import CudaTransfer

    device = torch.device("cuda")
    cache = KVCacheLayout.allocate(shape_preset("tiny-llama"), 8, 16, torch.float32, device)
    faults = FaultInjection(break_order="load_target") if broken else None
    transfer = CudaTransfer(cache.kv, PageLayout.of(cache, 32), faults)
    nbytes = 64 << 20
    arena = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).pin_memory()
    transfer.set_arena(arena)
    row = torch.empty(nbytes, dtype=torch.uint8, device=device)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(0.05 * 1.5e9))
    row.zero_()
    transfer.consume(transfer.load_raw(0, row, bytes(16)))
    torch.cuda.synchronize()
    assert torch.equal(row.cpu(), arena) is not broken


@pytest.mark.cuda
def test_cuda_back_to_back_stores_each_commit_the_checksums_of_their_bytes() -> None:
    """A loaded replica stores every step, store after store. Each store's sums are made on
    its gather stream and copied to the host on its copy stream, behind its page's
    device->host copy (37 MiB pages here): the next store must not take their memory
    before that copy ran. Every store's checksum equals the checksum of the bytes it wrote."""
    from kvshare.kvpool.transfer_cuda import CudaTransfer

    device = torch.device("cuda")
    pages, chunk = 12, 256
    cache = KVCacheLayout.allocate(
        shape_preset("qwen3-8b"), pages * chunk // 16 + 1, 16, torch.bfloat16, device
    )
    cache.kv.copy_(torch.randn(cache.kv.shape, device=device, dtype=torch.bfloat16))
    layout = PageLayout.of(cache, chunk)
    size = layout.payload_bytes
    transfer = CudaTransfer(cache.kv, layout)
    transfer.set_arena(torch.zeros(pages * size, dtype=torch.uint8).pin_memory())
    per_page = chunk // 16
    keys = [bytes([i]) * 16 for i in range(pages)]
    torch.cuda.synchronize()
    jobs = [
        transfer.store(
            [PageCopy(i * size, size, tuple(range(i * per_page, (i + 1) * per_page)), keys[i])]
        )
        for i in range(pages)
    ]
    transfer.synchronize()
    assert transfer.arena is not None
    for i, job in enumerate(jobs):
        words = payload_words(transfer.arena[i * size : (i + 1) * size])
        assert (
            job.checksums()[0][0] == payload_checksum(words, checksum_constants(keys[i])).tobytes()
        )


@pytest.mark.cuda
@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-gemma3"])
def test_cuda_warm_up_writes_only_the_blocks_no_sequence_owns(shape: str) -> None:
    """The connector compiles its kernels when it binds, gathering each cache's last
    block (outside the block manager) and scattering it back: no block changes."""
    from kvshare.kvpool.transfer_cuda import CudaTransfer

    device = torch.device("cuda")
    cache = KVCacheLayout.allocate(shape_preset(shape), 8, 16, torch.bfloat16, device)
    tensors = [cache.kv] + ([] if cache.sliding_kv is None else [cache.sliding_kv])
    for kv in tensors:
        kv.copy_(torch.randn(kv.shape, device=device))
    before = [kv.clone() for kv in tensors]
    CudaTransfer(cache.kv, PageLayout.of(cache, 32), sliding_kv=cache.sliding_kv).warm_up(
        (3 << 20,)
    )
    for kv, old in zip(tensors, before):
        assert torch.equal(kv, old)


def test_a_prefix_stored_beside_states_is_read_in_groups_inside_one_slab_each() -> None:
    """How a strided copy came to span two slabs on the H200: a hybrid model's store puts
    its recurrent state in a slab of its own, so the prefix's KV slabs are not adjacent;
    where a group (7 rows a staging fill here, 31 there) starts at a slab's last page, it
    and the first page of the next KV slab are two evenly spaced rows (a pitch of about
    a slab). Read as a replica registers the arena (slab by slab), no group leaves its
    slab; read as one region, one does (what CUDA refused)."""
    slab, kv_payload = 1 << 20, 120 << 10
    index = PoolIndex(ArenaGeometry(8 * slab, slab))
    offsets: list[int] = []
    for step in range(6):
        keys = [bytes([step, i]) + bytes(14) for i in range(4)]
        offsets += [offset for _, offset in index.reserve(1, keys, kv_payload)[0]]
        index.reserve(1, [bytes([step, 99]) + bytes(14)], 200 << 10)  # the step's state
    copies = [PageCopy(offset, kv_payload, (), bytes(16)) for offset in offsets]

    def spanned_slabs(region: int) -> list[tuple[int, int]]:
        groups = strided_groups(copies, 40 << 10, 40 << 10, 7, (1 << 31) - 1, region)
        last_bytes = [g.offset + (len(g.pages) - 1) * g.stride + g.nbytes - 1 for g in groups]
        return [(g.offset // slab, end // slab) for g, end in zip(groups, last_bytes, strict=True)]

    assert all(first == last for first, last in spanned_slabs(slab))
    assert any(first != last for first, last in spanned_slabs(8 * slab))


@pytest.mark.cuda
@pytest.mark.parametrize("grouped", [False, True])
def test_cuda_load_through_one_page_staging_buffers_with_slow_drains_brings_every_byte(
    grouped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load runs its pages through two staging buffers: fill k + 2 may only overwrite a
    buffer once drain k has read it, and the drains are issued one fill behind. With one
    page a buffer and every drain held back by a GPU sleep, a fill that does not wait
    overwrites a page before its drain: the cache and the checksums then differ from the
    CPU transfer's load of the same arena (whole pages, and in groups of layers)."""
    from kvshare.kvpool import transfer_cuda

    monkeypatch.setattr(transfer_cuda, "staging_buffer_bytes", lambda page_bytes: page_bytes)
    pages = 9
    groups = LayerGroups(min_bytes=1, max_groups=3) if grouped else None
    caches, gpu, cpu, copies = cuda_and_cpu_transfers(pages, groups)
    checksum_rows = gpu.checksum_rows

    def slow_checksum_rows(*args: object) -> None:
        torch.cuda._sleep(int(0.002 * 1.5e9))  # on the drain's stream, before it reads
        checksum_rows(*args)

    gpu.checksum_rows = slow_checksum_rows
    assert len(gpu.slot_ranges(copies)) == (3 if grouped else 1)
    loaded, expected = gpu.load(copies), cpu.load(copies)
    loaded.wait()
    expected.wait()
    assert same_cache_bytes(caches, pages)
    assert loaded.checksums() == expected.checksums()


@pytest.mark.cuda
def test_a_grouped_cuda_load_holds_the_host_for_its_first_group_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first layer group's wait is the host's (once the step is launched the load's
    copies ran ~10% slower on an H100): calling it returns only once that group is in,
    while a later group's wait returns at once and orders the stream. Each group's drains
    are held back 50 ms on the GPU; the bytes still match the CPU load."""
    pages, held_s = 4, 0.05
    caches, gpu, cpu, copies = cuda_and_cpu_transfers(pages, LayerGroups(min_bytes=1, max_groups=3))
    gpu.warm_up()
    scatter = type(gpu.blocks).__call__

    def held_scatter(self: object, *args: object, **kwargs: object) -> None:
        torch.cuda._sleep(int(held_s * 2.5e9))  # at least held_s below 2.5 GHz
        scatter(self, *args, **kwargs)

    monkeypatch.setattr(type(gpu.blocks), "__call__", held_scatter)
    job, expected = gpu.load(copies), cpu.load(copies)
    assert len(job.slot_waits) == 3
    seconds = []
    for _, wait in job.slot_waits:
        start = time.perf_counter()
        wait()
        seconds.append(time.perf_counter() - start)
    assert seconds[0] >= held_s, seconds  # the first group's drains were all waited for
    assert max(seconds[1:]) < held_s / 5, seconds  # the others: queued on the stream
    gpu_bytes = caches[0].kv[:, :, : 2 * pages].view(torch.int16).cpu()  # after the waits
    expected.wait()
    job.wait()
    assert torch.equal(gpu_bytes, caches[1].kv[:, :, : 2 * pages].view(torch.int16))
    assert job.checksums() == expected.checksums()
