"""A step's small host arrays (token ids, block tables, lengths) onto the GPU, never
behind a pool load's copies, and never making the host wait for the device.

A pinned asynchronous copy goes to the copy engine, which runs host-to-device copies in
the order they were issued: measured on the H200, a 32 KiB block table issued on the
compute stream 1 ms into a 79 ms pool load completed with the load, at 79 ms, so the
step's first attention layer waited for the last of the prefix's layers even when the
load came in groups of layers. The same upload from pageable memory completed at 1.8 ms,
outside the copy engine's queue (how the driver moves a small pageable source is its own
business; that it does not wait is what was measured). So arrays
of at most INLINE_BYTES come from pageable memory; larger ones through pinned memory.
That holds for a stream with nothing queued: behind a running kernel the same pageable
32 KiB upload completed with the load (78.6 ms), so a step uploads its inputs before its
first wait for a load's layers. Either way the call returns at once
(torch.tensor(..., device="cuda") would synchronize the host with the stream, which may
be waiting for the load). CUDA allows a pageable copy to synchronize with its stream; that
a small one does not, even behind a stream waiting for a load, is what
tests/test_uploads.py checks on a GPU (passed on the H200).
"""

from __future__ import annotations

import numpy as np
import torch

# The largest upload made from pageable memory: a 261,888-token context's block table (64
# KiB); 32 and 64 KiB completed 1.3 ms into a 77 ms load on the H200
# (scripts/gpu_copy_order.py, tests/test_uploads.py).
INLINE_BYTES = 64 << 10


def _source(tensor: torch.Tensor, to_cuda: bool) -> torch.Tensor:
    """`tensor` as the source of an asynchronous copy: pinned only when large and bound
    for the GPU."""
    if to_cuda and tensor.numel() * tensor.element_size() > INLINE_BYTES:
        return tensor.pin_memory()
    return tensor


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` (on the CPU: the array itself, as a tensor)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return tensor
    return _source(tensor, True).to(device, non_blocking=True)


def copy_into(dest: torch.Tensor, array: np.ndarray) -> None:
    """Copy a host array of dest's shape into `dest` (a static buffer a captured graph
    reads), converted to dest's dtype."""
    src = torch.from_numpy(np.ascontiguousarray(array)).to(dest.dtype)
    dest.copy_(_source(src, dest.is_cuda), non_blocking=True)
