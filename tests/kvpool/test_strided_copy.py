"""A strided copy (the fill of a restore in groups of layers) brings exactly each page's
part of a group, and nothing past it."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from kvshare.engine.connector import KVCacheLayout
from kvshare.kvpool.host_memory import mapped_in_slabs
from kvshare.kvpool.layout import PageLayout
from kvshare.kvpool.page import slot_bytes_for
from kvshare.kvpool.strided_copy import StridedCopy, StridedCopyError
from kvshare.kvpool.transfer import LayerGroups
from kvshare.kvpool.transfer_cpu import ThreadTransfer
from kvshare.models.presets import shape_preset
from tests.kvpool.page_copies import whole_page_copies

MIB = 1 << 20


def test_no_cuda_no_strided_copy() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    assert StridedCopy.find() is None


def stand_in_copy(
    runtime: Callable[..., int], last_error: Callable[[], int] = lambda: 0
) -> StridedCopy:
    """A StridedCopy whose cudaMemcpy2DAsync and cudaGetLastError are bare C function
    pointers (no argument types of their own, as ctypes.CDLL gives them) to the Python
    `runtime` and `last_error`."""
    signature = ctypes.CFUNCTYPE(
        ctypes.c_int, *[ctypes.c_uint64] * 6, ctypes.c_int, ctypes.c_uint64
    )
    callbacks = (signature(runtime), ctypes.CFUNCTYPE(ctypes.c_int)(last_error))

    def bare(callback: object) -> object:
        return ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.cast(callback, ctypes.c_void_p).value)

    # The namespace keeps the callbacks alive as long as the copy that calls them.
    return StridedCopy(
        SimpleNamespace(
            cudaMemcpy2DAsync=bare(callbacks[0]),
            cudaGetLastError=bare(callbacks[1]),
            callbacks=callbacks,
        )
    )


def test_every_argument_reaches_the_runtime_whole() -> None:
    """Pointers, sizes and the stream's handle reach cudaMemcpy2DAsync as 64-bit values:
    an argument ctypes was not told the type of goes as a C int, and a side stream's
    handle would lose its high bits."""
    received = []

    def runtime(*args: int) -> int:
        received.append(args)
        return 0

    copy = stand_in_copy(runtime)
    dest, src, stream = 0x7F12_3456_7000, 0x7E00_0000_1000, 0x55D4_C3A0_B2C0
    copy.issue(dest, src, 16 * MIB, 4 * MIB, 256, stream)
    assert received == [(dest, 4 * MIB, src, 16 * MIB, 4 * MIB, 256, 1, stream)]


def test_a_refused_copy_raises_and_leaves_no_error_for_torch() -> None:
    """The runtime's error is raised with the copy's shape, and cleared: torch reports a
    last error left set as the failure of its next kernel launch (on the H200 a refused
    copy failed the next step and every request in it)."""
    cleared = []
    copy = stand_in_copy(lambda *args: 1, lambda: cleared.append(1) or 0)
    with pytest.raises(StridedCopyError, match=r"3 rows of 4 bytes, 8 apart .* CUDA error 1"):
        copy.issue(1, 2, 8, 4, 3, 5)
    assert cleared == [1]
    copy = stand_in_copy(lambda *args: 0, lambda: cleared.append(2) or 0)
    copy.issue(1, 2, 8, 4, 3, 5)
    assert cleared == [1]  # a copy that was issued touches nothing else


@pytest.mark.cuda
def test_a_strided_copy_brings_each_pages_part_of_a_group() -> None:
    copy = StridedCopy.find()
    assert copy is not None, "torch's CUDA runtime library was not found in the process"
    pages, page, part, first = 12, 3 * MIB, MIB, MIB // 2
    host = torch.randint(0, 256, (pages * page,), dtype=torch.uint8).pin_memory()
    dest = torch.zeros(pages * part + 7, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()  # as in a load: not the default stream, whose handle is 0
    with torch.cuda.stream(side):
        rows = copy(dest, host.data_ptr() + first, page, part, pages)
    side.synchronize()
    expected = host.view(pages, page)[:, first : first + part]
    assert torch.equal(rows.cpu(), expected)
    assert not dest[pages * part :].any()  # nothing past the rows written


@pytest.mark.cuda
@pytest.mark.parametrize("slabs_known", [True, False])
def test_a_grouped_load_from_an_arena_registered_slab_by_slab_brings_every_byte(
    slabs_known: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """An arena registered in two slabs, as a replica registers the pool's. With the slab
    size known no strided copy spans both; without it the runtime refuses the one that
    does and the load copies those rows one by one. The same bytes and checksums as the
    CPU transfer's either way, and torch's next kernel runs (no error left behind)."""
    from kvshare.kvpool.transfer_cuda import CudaTransfer

    caches = {
        d: KVCacheLayout.allocate(shape_preset("tiny-llama"), 64, 16, torch.float32, device)
        for d, device in (("cpu", torch.device("cpu")), ("cuda", torch.device("cuda")))
    }
    layout = PageLayout.of(caches["cpu"], 32)
    slot = slot_bytes_for(layout.payload_bytes)
    slab = 4 * slot
    copies = whole_page_copies(layout, range(8))
    cpu = ThreadTransfer(caches["cpu"].kv, layout)
    gpu = CudaTransfer(caches["cuda"].kv, layout, layer_groups=LayerGroups(min_bytes=1))
    with mapped_in_slabs(2, slab) as arena:
        arena.copy_(torch.randint(0, 256, arena.shape, dtype=torch.uint8))
        cpu.set_arena(arena)
        gpu.set_arena(arena, slab if slabs_known else None)
        with caplog.at_level(logging.WARNING, "kvshare.kvpool.transfer_cuda"):
            expected, got = cpu.load(copies), gpu.load(copies)
            expected.wait()
            got.wait()
    assert len(got.slot_waits) > 1, "the load did not come in groups"
    refused = [r for r in caplog.records if "one by one" in r.getMessage()]
    assert bool(refused) is not slabs_known
    assert got.checksums() == expected.checksums()
    have = caches["cuda"].kv.cpu().view(torch.uint8)
    assert torch.equal(have, caches["cpu"].kv.view(torch.uint8))
    assert (torch.ones(4, device="cuda") * 2).sum().item() == 8
