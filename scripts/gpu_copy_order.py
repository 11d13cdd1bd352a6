"""Two facts a load in groups of layers depends on, measured on the GPU.

    PYTHONPATH=$PWD python3 scripts/gpu_copy_order.py --out $OUT

1. A strided host->device copy (kvshare.kvpool.strided_copy: every page's part of a layer
   group in one call) against one copy per part and against contiguous copies of the same
   bytes, for parts of 1, 2 and 4 MiB of 16 MiB pages: GB/s and the host's time to issue.
2. While a long load runs on its own stream, when does a step's small upload on the
   compute stream complete? kvshare.uploads.host_to_device at several sizes (pageable up
   to INLINE_BYTES, pinned above), and a pinned upload of 32 KiB (what it replaced).

3. Which strided copies does CUDA refuse from an arena registered slab by slab (as a
   replica registers the pool's)? Rows inside one slab, rows whose pitch runs past the
   slab's end after the last row, rows in two slabs, wide rows.

Prints three tables; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvshare.kvpool.host_memory import mapped_in_slabs
from kvshare.kvpool.strided_copy import StridedCopy, StridedCopyError
from kvshare.uploads import INLINE_BYTES, host_to_device

MIB = 1 << 20
PAGE = 16 * MIB
STAGING = 256 * MIB


def timed(fn: Callable[[], object], repeats: int = 5) -> tuple[float, float]:
    """Median (device seconds, host seconds to issue) of fn."""
    fn()
    torch.cuda.synchronize()
    dev, host = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        end.record()
        end.synchronize()
        dev.append(start.elapsed_time(end) / 1e3)
    return statistics.median(dev), statistics.median(host)


def copy_rates(copy: StridedCopy, host: torch.Tensor, part: int) -> list[dict]:
    pages = host.numel() // PAGE
    dev = torch.empty(2 * STAGING, dtype=torch.uint8, device="cuda")
    per_fill, nbytes = STAGING // part, pages * part

    def contiguous() -> None:
        for k in range(0, nbytes, STAGING):
            b, n = (k // STAGING) % 2, min(STAGING, nbytes - k)
            dev[b * STAGING : b * STAGING + n].copy_(host[k : k + n], non_blocking=True)

    def strided() -> None:
        for k in range(0, pages, per_fill):
            rows = min(per_fill, pages - k)
            b = (k // per_fill) % 2
            copy(dev[b * STAGING :], host[k * PAGE :].data_ptr(), PAGE, part, rows)

    def per_part() -> None:
        for i in range(pages):
            at = ((i // per_fill) % 2) * STAGING + (i % per_fill) * part
            dev[at : at + part].copy_(host[i * PAGE : i * PAGE + part], non_blocking=True)

    rows = []
    for name, fn in (("contiguous", contiguous), ("strided", strided), ("per part", per_part)):
        seconds, issue = timed(fn)
        rows.append(
            {
                "copy": name,
                "part_bytes": part,
                "bytes": nbytes,
                "seconds": seconds,
                "issue_s": issue,
                "gb_per_s": nbytes / seconds / 1e9,
            }
        )
    return rows


def upload_under_load(host: torch.Tensor, nbytes: int, pinned: bool, busy: bool = False) -> dict:
    """ms until an upload of `nbytes` on the compute stream completed, issued ~1 ms after
    a load of `host` started on another stream, and ms until the load completed; `busy`:
    the compute stream runs a ~1 ms kernel when the upload is issued."""
    dev = torch.empty(STAGING, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    array = np.arange(nbytes // 4, dtype=np.int32)

    def upload() -> torch.Tensor:
        if pinned:
            return torch.from_numpy(array).pin_memory().to("cuda", non_blocking=True)
        return host_to_device(array, torch.device("cuda"))

    upload()
    torch.cuda.synchronize()
    start, loaded, uploaded = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    with torch.cuda.stream(side):
        start.record()
        for k in range(0, host.numel(), STAGING):
            dev.copy_(host[k : k + STAGING], non_blocking=True)
        loaded.record()
    time.sleep(0.001)
    if busy:
        torch.cuda._sleep(2_000_000)
    t0 = time.perf_counter()
    out = upload()
    issue = time.perf_counter() - t0
    uploaded.record()
    torch.cuda.synchronize()
    return {
        "upload_bytes": nbytes,
        "how": (
            "pinned" if pinned else "pageable" if nbytes <= INLINE_BYTES else "pinned (kvshare)"
        )
        + (", busy" if busy else ""),
        "ok": torch.equal(out.cpu(), torch.from_numpy(array)),
        "issue_ms": issue * 1e3,
        "upload_done_ms": start.elapsed_time(uploaded),
        "load_done_ms": start.elapsed_time(loaded),
    }


def refusals(copy: StridedCopy) -> list[dict]:
    """Strided copies from three 64 MiB slabs of one mapping, each registered on its own:
    which the runtime refuses, and that the accepted ones bring the right bytes."""
    cases = [  # (what, first byte, pitch, width, rows)
        ("inside one slab", 0, 8 * MIB, 4 * MIB, 8),
        ("pitch past the slab after the last row", 2 * MIB, 8 * MIB, 4 * MIB, 8),
        ("rows in two slabs", 60 * MIB, 8 * MIB, 4 * MIB, 2),
        ("9 MiB rows inside one slab", 0, 16 * MIB, 9 * MIB, 3),
        ("4 MiB + 4 KiB rows inside one slab", 0, 8 * MIB, 4 * MIB + 4096, 4),
    ]
    dest = torch.empty(STAGING, dtype=torch.uint8, device="cuda")
    out = []
    with mapped_in_slabs(3, 64 * MIB) as host:
        host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8))
        for what, first, pitch, width, rows in cases:
            try:
                got = copy(dest, host.data_ptr() + first, pitch, width, rows)
                torch.cuda.synchronize()
                expected = torch.stack(
                    [host[first + r * pitch : first + r * pitch + width] for r in range(rows)]
                )
                result = "ok" if torch.equal(got.cpu(), expected) else "WRONG BYTES"
            except StridedCopyError as exc:
                result = f"refused: {exc}"
            case = dict(case=what, first=first, pitch=pitch, width=width, rows=rows)
            out.append({**case, "result": result})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pages", type=int, default=256)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    copy = StridedCopy.find()
    assert copy is not None, "no CUDA runtime library found in the process"
    host = torch.empty(args.pages * PAGE, dtype=torch.uint8).pin_memory()
    host.view(torch.int64)[::512].fill_(7)
    # Correct first: the strided copy brings each page's part.
    probe = torch.zeros(STAGING, dtype=torch.uint8, device="cuda")
    rows = copy(probe, host.data_ptr() + MIB, PAGE, 2 * MIB, 64)
    assert torch.equal(rows.cpu(), host.view(-1, PAGE)[:64, MIB : 3 * MIB])
    rates = [r for part in (MIB, 2 * MIB, 4 * MIB) for r in copy_rates(copy, host, part)]
    uploads = [upload_under_load(host, 32 << 10, pinned=True)]
    uploads += [
        upload_under_load(host, n, pinned=False) for n in (32 << 10, INLINE_BYTES, 256 << 10)
    ]
    uploads.append(upload_under_load(host, 32 << 10, pinned=False, busy=True))
    refused = refusals(copy)
    print("copy        part MiB     GB      ms   GB/s  host ms")
    for r in rates:
        print(
            f"{r['copy']:11} {r['part_bytes'] / MIB:8.0f} {r['bytes'] / 1e9:6.2f} "
            f"{r['seconds'] * 1e3:7.1f} {r['gb_per_s']:6.1f} {r['issue_s'] * 1e3:8.2f}"
        )
    print("upload KiB  how               ok    host ms  upload done ms  load done ms")
    for r in uploads:
        print(
            f"{r['upload_bytes'] >> 10:10d}  {r['how']:17} {r['ok']!s:5} {r['issue_ms']:8.2f} "
            f"{r['upload_done_ms']:15.2f} {r['load_done_ms']:13.2f}"
        )
    print("strided copy from slabs registered one by one          result")
    for r in refused:
        print(f"{r['case']:54} {r['result']}")
    out = {"rates": rates, "uploads": uploads, "refusals": refused}
    (args.out / "copy_order.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
