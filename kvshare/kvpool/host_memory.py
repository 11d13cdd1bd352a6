"""Registering the mapped arena with CUDA (cudaHostRegister), slab by slab, off the request path.

Unregistered mapped memory copies at ~5 GB/s; registered at the PCIe ceiling (~55 GB/s).
Registration costs ~1.1 s per 8 GiB, so a background thread registers one slab at a time
and copies run (correctly, only slower) from slabs not registered yet.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvshare.kvpool.arena import Arena

_log = logging.getLogger(__name__)


class HostRegistration:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._ranges: list[tuple[int, int]] = []  # (pointer, bytes) registered
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._arena: torch.Tensor | None = None

    @property
    def registered_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self._ranges)

    def register(self, arena: Arena) -> None:
        """Start registering `arena`'s slabs in the background."""
        geometry = arena.geometry
        self.register_slabs(arena.as_tensor(), geometry.slab_bytes, geometry.slab_count)

    def register_slabs(self, host: torch.Tensor, slab_bytes: int, slab_count: int) -> None:
        """Start registering `slab_count` slabs of `slab_bytes` from the start of `host`
        in the background, each on its own."""
        self.unregister()
        self._stop.clear()
        self._arena = host  # keeps the mapping alive while registered
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
                    "cudaHostRegister failed (%s): copies from this slab stay slow", status
                )
                continue
            with self._lock:
                self._ranges.append((ptr, nbytes))

    def unregister(self) -> None:
        """Stop registering and unregister everything (before the mapping goes away)."""
        self._stop.set()
        self.wait()
        cudart = torch.cuda.cudart()
        with self._lock:
            for ptr, _ in self._ranges:
                cudart.cudaHostUnregister(ptr)
            self._ranges.clear()
        self._arena = None


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
