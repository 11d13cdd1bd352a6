"""Registering the mapped arena with CUDA (cudaHostRegister), slab by slab, off the request path.

Unregistered mapped memory copies at ~5 GB/s; registered at the PCIe ceiling (~55 GB/s).
Registration costs ~1.1 s per 8 GiB, so a background thread registers one slab at a time
and copies run (correctly, only slower) from slabs not registered yet.
"""

from __future__ import annotations

import logging
import mmap
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvshare.kvpool.arena import Arena

_log = logging.getLogger(__name__)


class _Registered:
    """The ranges registered over one mapping, and that mapping's tensor: it keeps the
    mapping alive until they are unregistered.

    Invariant: a range is unregistered before its mapping can go away. A registration
    outlives munmap in the driver, which then refuses to register whatever is mapped at
    those addresses next ("already registered") and copies from there read the old,
    still pinned pages: a later arena mapped at the same address would be restored from
    a dead one's bytes."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []  # (pointer, bytes)
        self.host: torch.Tensor | None = None
        self.lock = threading.Lock()

    def release(self, device: torch.device, synchronize: bool) -> None:
        """Unregister every range, then let the mapping go. `synchronize`: first wait for
        the device's copies, which may still read these pages (an owner dropped without
        closing did not wait for them)."""
        with self.lock:
            ranges, self.ranges = self.ranges, []
        if ranges:
            if synchronize and torch.cuda.is_initialized():
                torch.cuda.synchronize(device)
            cudart = torch.cuda.cudart()
            for ptr, _ in ranges:
                cudart.cudaHostUnregister(ptr)
        self.host = None


class HostRegistration:
    """Registers a mapping slab by slab on a background thread; `unregister` undoes it, and
    so does the collection of a HostRegistration that was never told to (see _Registered)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._registered = _Registered()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The finalizer holds the state, not self: it runs once self is collected.
        collected = weakref.finalize(self, self._registered.release, device, True)
        collected.atexit = False  # at exit the process's end unpins everything

    @property
    def registered_bytes(self) -> int:
        with self._registered.lock:
            return sum(n for _, n in self._registered.ranges)

    def register(self, arena: Arena) -> None:
        """Start registering `arena`'s slabs in the background."""
        geometry = arena.geometry
        self.register_slabs(arena.as_tensor(), geometry.slab_bytes, geometry.slab_count)

    def register_slabs(self, host: torch.Tensor, slab_bytes: int, slab_count: int) -> None:
        """Start registering `slab_count` slabs of `slab_bytes` from the start of `host`
        in the background, each on its own."""
        self.unregister()
        self._stop.clear()
        self._registered.host = host
        base = host.data_ptr()
        slabs = [(base + i * slab_bytes, slab_bytes) for i in range(slab_count)]
        self._thread = threading.Thread(
            target=self._register_all, args=(slabs,), name="kvshare-host-register", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _register_all(self, slabs: list[tuple[int, int]]) -> None:
        torch.cuda.set_device(self.device)
        cudart = torch.cuda.cudart()
        for ptr, nbytes in slabs:
            if self._stop.is_set():
                return
            status = cudart.cudaHostRegister(ptr, nbytes, 0)
            if int(status) != 0:
                _log.warning(
                    "cudaHostRegister failed (CUDA error %d): copies from this slab stay slow",
                    int(status),
                )
                continue
            with self._registered.lock:
                self._registered.ranges.append((ptr, nbytes))

    def unregister(self) -> None:
        """Stop registering and unregister everything (before the mapping goes away); the
        caller has waited for the copies from it."""
        self._stop.set()
        self.wait()
        self._registered.release(self.device, synchronize=False)


@contextmanager
def mapped_in_slabs(slabs: int, slab_bytes: int) -> Iterator[torch.Tensor]:
    """Anonymous host memory of `slabs` x `slab_bytes`, registered with CUDA one slab at a
    time as a replica registers a pool's arena, unregistered on exit: what the checks and
    measurements of copies from such an arena copy from (CUDA refuses a strided copy
    whose rows lie in two registrations)."""
    host = torch.frombuffer(mmap.mmap(-1, slabs * slab_bytes), dtype=torch.uint8)
    registration = HostRegistration(torch.device("cuda", torch.cuda.current_device()))
    registration.register_slabs(host, slab_bytes, slabs)
    registration.wait()
    try:
        if registration.registered_bytes != host.numel():
            raise RuntimeError("cudaHostRegister refused a slab (see the log)")
        yield host
    finally:
        registration.unregister()
