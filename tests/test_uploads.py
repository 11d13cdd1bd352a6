"""A step's small uploads do not queue behind a pool load's copies on the copy engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvshare.uploads import INLINE_BYTES, copy_into, host_to_device

MIB = 1 << 20


def test_uploads_on_the_cpu_are_the_arrays_converted_to_the_destination() -> None:
    array = np.arange(10, dtype=np.int64)
    assert torch.equal(host_to_device(array, torch.device("cpu")), torch.arange(10))
    dest = torch.zeros(10, dtype=torch.int32)
    copy_into(dest, array)
    assert dest.dtype == torch.int32 and torch.equal(dest, torch.arange(10, dtype=torch.int32))


def _load_then_upload(nbytes: int) -> tuple[float, float]:
    """(ms until a `nbytes` upload on the current stream completed, ms until the 2 GiB
    pinned load issued 1 ms before it on another stream completed)."""
    host = torch.empty(2 << 30, dtype=torch.uint8).pin_memory()
    dev = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    array = np.arange(nbytes // 4, dtype=np.int32)
    host_to_device(array, torch.device("cuda"))
    torch.cuda.synchronize()
    start, loaded, uploaded = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    with torch.cuda.stream(side):
        start.record()
        for k in range(0, host.numel(), dev.numel()):
            dev.copy_(host[k : k + dev.numel()], non_blocking=True)
        loaded.record()
    torch.cuda._sleep(1_500_000)  # ~1 ms: the load is running when the upload is issued
    out = host_to_device(array, torch.device("cuda"))
    uploaded.record()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), torch.from_numpy(array))
    return start.elapsed_time(uploaded), start.elapsed_time(loaded)


@pytest.mark.cuda
def test_a_steps_upload_completes_while_a_load_still_copies() -> None:
    """A 32 KiB block table and a table at the inline limit complete long before a
    40 ms load ends (a pinned upload completes with the load: the broken variant)."""
    for nbytes in (32 << 10, INLINE_BYTES):
        upload_ms, load_ms = _load_then_upload(nbytes)
        assert load_ms > 20 and upload_ms < load_ms / 4, (nbytes, upload_ms, load_ms)
