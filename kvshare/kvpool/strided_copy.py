"""One host->device copy of many equally spaced rows: cudaMemcpy2DAsync.

A load in groups of layers copies every page's part of a group, a few MiB at the same
place in each 16 MiB page. As one copy per part the host spent 85 ms issuing the 2,048
copies of a 131,072-token load on the H200 (the whole load moves in 160 ms); one strided
copy per staging buffer's worth of pages moves the same bytes at the same rate (54.0 GB/s
for 4 MiB rows, 54.7 contiguous) for 0.3 ms of host time per GiB. torch does not expose
it, so it is called from the CUDA runtime library torch itself loaded.

The runtime refuses (cudaErrorInvalidValue) a strided copy whose rows lie in two separately
registered host ranges, even when each row lies inside one: measured on the H200
(scripts/gpu_copy_order.py), where rows in one registered range passed, also when the pitch
ran past its end after the last row. A replica registers the pool's arena slab by slab,
so a group of rows never leaves its first row's slab (transfer.strided_groups).
A refused copy raises StridedCopyError after clearing the runtime's last error: left set,
torch's next kernel launch reports it as its own failure (on the H200 a refused copy made
the next step's embedding fail with "invalid argument" and every request with it).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

_HOST_TO_DEVICE = 1  # cudaMemcpyKind
# The largest source pitch a strided copy is given: CUDA refuses a pitch past the device's
# cudaDevAttrMaxPitch (2**31 - 1 on current GPUs); pages further apart are copied alone.
MAX_PITCH = (1 << 31) - 1


class StridedCopyError(RuntimeError):
    """The runtime refused a strided copy; nothing was issued and no error is left set."""


class StridedCopy:
    """`copy(dest, src_ptr, src_pitch, width, rows)`: rows of `width` bytes, `src_pitch`
    apart from host address src_ptr (pinned or registered memory), packed into the front of
    the CUDA tensor `dest`, on the current stream; asynchronous like a non_blocking copy."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.cudaMemcpy2DAsync
        fn.restype = ctypes.c_int
        # Every argument typed, the stream too: ctypes passes an untyped int as a C int,
        # which would cut a stream's 64-bit handle to its low 32 bits.
        size, pointer = ctypes.c_size_t, ctypes.c_void_p
        fn.argtypes = (pointer, size, pointer, size, size, size, ctypes.c_int, pointer)
        self._copy = fn
        self._clear_error = library.cudaGetLastError
        self._clear_error.restype = ctypes.c_int
        self._clear_error.argtypes = ()

    @classmethod
    def find(cls) -> StridedCopy | None:
        """The CUDA runtime library mapped into this process (torch's), or None: torch
        built without a shared one, or no CUDA here."""
        if not torch.cuda.is_available():
            return None
        torch.cuda.init()
        maps = Path("/proc/self/maps")
        if not maps.exists():
            return None
        for line in maps.read_text().splitlines():
            path = line.split()[-1]
            if "/libcudart.so" in path:
                return cls(ctypes.CDLL(path))
        return None

    def __call__(
        self, dest: torch.Tensor, src_ptr: int, src_pitch: int, width: int, rows: int
    ) -> torch.Tensor:
        assert dest.is_cuda and dest.dtype == torch.uint8 and dest.numel() >= width * rows
        stream = torch.cuda.current_stream(dest.device).cuda_stream
        self.issue(dest.data_ptr(), src_ptr, src_pitch if rows > 1 else width, width, rows, stream)
        return dest[: width * rows].view(rows, width)

    def issue(
        self, dest_ptr: int, src_ptr: int, src_pitch: int, width: int, rows: int, stream: int
    ) -> None:
        """The runtime call itself, on the stream whose handle is `stream`."""
        err = self._copy(dest_ptr, width, src_ptr, src_pitch, width, rows, _HOST_TO_DEVICE, stream)
        if err:
            self._clear_error()
            raise StridedCopyError(
                f"cudaMemcpy2DAsync of {rows} rows of {width} bytes, {src_pitch} apart from "
                f"host {src_ptr:#x}, failed with CUDA error {err}"
            )
