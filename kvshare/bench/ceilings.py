"""Physical ceilings measured in the same run as what is compared with them."""

from __future__ import annotations

import time

import torch


def median_seconds(fn: object, repeats: int) -> float:
    """Median seconds of fn() over repeats, after one warm-up (CUDA synchronized)."""
    fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def pcie_bandwidth(nbytes: int = 4 << 30, repeats: int = 5) -> dict[str, float]:
    """Pinned host <-> GPU memcpy, one large copy each way (GB/s, 1e9 bytes)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = median_seconds(lambda: dev.copy_(host, non_blocking=True), repeats)
    d2h = median_seconds(lambda: host.copy_(dev, non_blocking=True), repeats)
    return {"h2d_GBps": nbytes / h2d / 1e9, "d2h_GBps": nbytes / d2h / 1e9}


def hbm_bandwidth(nbytes: int = 4 << 30, repeats: int = 10) -> float:
    """Device-to-device copy, bytes read + written (GB/s)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    seconds = median_seconds(lambda: b.copy_(a), repeats)
    return 2 * nbytes / seconds / 1e9
