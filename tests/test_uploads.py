"""A step's small uploads do not queue behind a pool load's copies on the copy engine."""

from __future__ import annotations

import time

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


def _start_load(side: torch.cuda.Stream) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """A 2 GiB pinned host->device load on `side`, issued at once: (its start, its end),
    timing events recorded on `side`."""
    host = torch.empty(2 << 30, dtype=torch.uint8).pin_memory()
    dev = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    start, loaded = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    with torch.cuda.stream(side):
        start.record()
        for k in range(0, host.numel(), dev.numel()):
            dev.copy_(host[k : k + dev.numel()], non_blocking=True)
        loaded.record()
    return start, loaded


def _load_then_upload(nbytes: int) -> tuple[float, float]:
    """(ms until a `nbytes` upload on the current, idle stream completed, ms until the
    2 GiB pinned load issued 1 ms before it on another stream completed). The stream is
    idle as a step's is when the engine uploads its inputs (before any wait for a load's
    layers): behind a running kernel the same pageable upload completed with the load on
    the H200, so uploads come first in a step."""
    array = np.arange(nbytes // 4, dtype=np.int32)
    host_to_device(array, torch.device("cuda"))
    start, loaded = _start_load(torch.cuda.Stream())
    uploaded = torch.cuda.Event(enable_timing=True)
    time.sleep(0.001)  # the load is running when the upload is issued
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


@pytest.mark.cuda
def test_an_upload_behind_a_stream_waiting_for_a_load_returns_at_once() -> None:
    """The hit path: the compute stream waits for a whole load, then the step's inputs go
    up. The host must return from each upload at once and go on issuing the step while the
    load copies; a copy that synchronized with the stream would hold it for the whole load."""
    static = torch.zeros(INLINE_BYTES // 4, dtype=torch.int32, device="cuda")
    arrays = [np.arange(n // 4, dtype=np.int32) for n in (32 << 10, INLINE_BYTES)]
    host_to_device(arrays[0], torch.device("cuda"))  # allocator warm
    _, loaded = _start_load(torch.cuda.Stream())
    torch.cuda.current_stream().wait_event(loaded)
    start = time.perf_counter()
    outs = [host_to_device(a, torch.device("cuda")) for a in arrays]
    copy_into(static, arrays[1])
    host_ms = (time.perf_counter() - start) * 1e3
    still_loading = not loaded.query()
    torch.cuda.synchronize()
    assert still_loading, "the load ended before the uploads were issued: nothing was measured"
    assert host_ms < 5, f"three uploads held the host {host_ms:.1f} ms behind a waiting stream"
    for out, array in zip([*outs, static], [*arrays, arrays[1]]):
        assert torch.equal(out.cpu(), torch.from_numpy(array))
