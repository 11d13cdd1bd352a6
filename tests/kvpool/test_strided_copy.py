"""A strided copy (the fill of a restore in groups of layers) brings exactly each page's
part of a group, and nothing past it."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from kvshare.kvpool.strided_copy import StridedCopy

MIB = 1 << 20


def test_no_cuda_no_strided_copy() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    assert StridedCopy.find() is None


def stand_in_copy(runtime: Callable[..., int]) -> StridedCopy:
    """A StridedCopy whose cudaMemcpy2DAsync is a bare C function pointer (no argument
    types of its own, as ctypes.CDLL gives it) to the Python `runtime`."""
    signature = ctypes.CFUNCTYPE(
        ctypes.c_int, *[ctypes.c_uint64] * 6, ctypes.c_int, ctypes.c_uint64
    )
    callback = signature(runtime)
    bare = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.cast(callback, ctypes.c_void_p).value)
    # The namespace keeps the callback alive as long as the copy that calls it.
    return StridedCopy(SimpleNamespace(cudaMemcpy2DAsync=bare, callback=callback))


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


def test_a_runtime_error_is_raised_with_its_code() -> None:
    copy = stand_in_copy(lambda *args: 400)
    with pytest.raises(RuntimeError, match="CUDA error 400"):
        copy.issue(1, 2, 3, 3, 1, 4)


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
