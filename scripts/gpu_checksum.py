"""Page checksum on the GPU: a restore's copy with on-GPU verification vs the raw copy.

python3 scripts/gpu_checksum.py --out $OUT [--shape gemma3-27b] [--tokens 131072] [--repeats 3]
python3 scripts/gpu_checksum.py --out /tmp/x --smoke   # CPU: tiny shape, checks only

Pages of the shape's layout (gemma3-27b: 124 MiB per 256-token chunk, 512 pages at 128k
tokens) are stored from a random paged KV cache into a pinned host arena through the
real transfer (CudaTransfer.store), then:

checks (first: timings of a wrong checksum are worth nothing)
- the GPU checksums of two pages equal the CPU's (layout.payload_checksum), bit for bit;
- a load of every page verifies (its checksums equal the store's);
- one flipped bit in the global part of one page, one in the sliding part of another, and
  a +d/-2d/+d rewrite of three words of a third fail exactly those pages' segments, and
  the pages verify again once restored;
timings (median of --repeats, GB/s of 1e9 bytes)
- raw: pinned host->GPU copies of every page, page by page into two staging buffers;
- load: CudaTransfer.load of every page (copy, checksum, scatter into the paged cache,
  the checksums compared on the host), as the connector issues a restore;
- load_unverified: the same without the checksum kernel (what the checksum costs);
- the same three for the global-layer prefixes only (what most pages of a long restore
  copy), and the checksum kernel alone over one staged page;
- load / raw, the target being >= 0.95.
Writes gpu_checksum.json under --out and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvshare.engine.connector import KVCacheLayout
from kvshare.kvpool.layout import (
    PageLayout,
    checksum_constants,
    payload_checksum,
    payload_words,
)
from kvshare.kvpool.transfer import PageCopy, Transfer
from kvshare.kvpool.transfer_cpu import ThreadTransfer
from kvshare.kvpool.transfer_cuda import CudaTransfer
from kvshare.models.presets import shape_preset

TARGET_RATIO = 0.95
REGISTER_BYTES = 8 << 30  # cudaHostRegister the arena in pieces of this size


class Setup:
    """A random paged KV cache, its pages in a host arena, and the transfer between them."""

    def __init__(self, shape: str, tokens: int, chunk_tokens: int, device: torch.device) -> None:
        config = shape_preset(shape)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        block_size = 16
        self.num_pages = tokens // chunk_tokens
        cache = KVCacheLayout.allocate(
            config, self.num_pages * chunk_tokens // block_size, block_size, dtype, device
        )
        for slot in range(cache.num_slots):
            cache.kv[slot].normal_()
        self.device = device
        self.layout = PageLayout.of(cache, chunk_tokens)
        self.arena = torch.empty(self.num_pages * self.layout.payload_bytes, dtype=torch.uint8)
        self.registered: list[int] = []
        if device.type == "cuda":
            # Whole pages per registered piece: one copy must not span two registrations.
            piece = max(1, REGISTER_BYTES // self.layout.payload_bytes) * self.layout.payload_bytes
            cudart = torch.cuda.cudart()
            for start in range(0, self.arena.numel(), piece):
                ptr = self.arena.data_ptr() + start
                status = cudart.cudaHostRegister(ptr, min(piece, self.arena.numel() - start), 0)
                assert int(status) == 0, f"cudaHostRegister failed: {status}"
                self.registered.append(ptr)
        self.transfer: Transfer = (
            CudaTransfer(cache.kv, self.layout)
            if device.type == "cuda"
            else ThreadTransfer(cache.kv, self.layout)
        )
        self.transfer.set_arena(self.arena)
        bpp = self.layout.blocks_per_page
        self.keys = [p.to_bytes(8, "little") + b"gpu-csum" for p in range(self.num_pages)]
        self.blocks = [tuple(range(p * bpp, (p + 1) * bpp)) for p in range(self.num_pages)]

    def copies(self, nbytes: int) -> list[PageCopy]:
        return [
            PageCopy(p * self.layout.payload_bytes, nbytes, self.blocks[p], self.keys[p])
            for p in range(self.num_pages)
        ]

    def page(self, p: int) -> torch.Tensor:
        return self.arena[p * self.layout.payload_bytes : (p + 1) * self.layout.payload_bytes]

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.transfer.synchronize()

    def close(self) -> None:
        self.sync()
        cudart = torch.cuda.cudart() if self.registered else None
        for ptr in self.registered:
            cudart.cudaHostUnregister(ptr)  # type: ignore[union-attr]


def cpu_checksums(setup: Setup, p: int) -> list[bytes]:
    words, constants = payload_words(setup.page(p)), checksum_constants(setup.keys[p])
    return [
        payload_checksum(words[lo // 8 : hi // 8], constants, lo // 8).tobytes()
        for lo, hi in setup.layout.segments(setup.layout.payload_bytes)
    ]


def load_checksums(setup: Setup, nbytes: int) -> list[list[bytes]]:
    job = setup.transfer.load(setup.copies(nbytes))
    job.wait()
    assert not job.failed
    return job.checksums()


def flip_bit(setup: Setup, p: int, byte: int, bit: int) -> None:
    setup.page(p)[byte] ^= 1 << bit


def rewrite(setup: Setup, p: int, word: int, d: int, sign: int) -> None:
    """+d, -2d, +d on three words from `word` (sign -1 undoes it); modulo 2**64."""
    words = payload_words(setup.page(p))
    for j, factor in enumerate((1, -2, 1)):
        words[word + j] = np.uint64((int(words[word + j]) + sign * factor * d) % (1 << 64))


def checks(setup: Setup) -> dict:
    layout = setup.layout
    store = setup.transfer.store(setup.copies(layout.payload_bytes))
    store.wait()
    setup.sync()
    stored = store.checksums()
    out: dict[str, object] = {
        "pages": setup.num_pages,
        "page_bytes": layout.payload_bytes,
        "global_bytes": layout.global_bytes,
        "segments": layout.num_segments,
    }
    last = setup.num_pages - 1
    out["device_equals_cpu"] = all(stored[p] == cpu_checksums(setup, p) for p in (0, last))
    out["load_verifies"] = load_checksums(setup, layout.payload_bytes) == stored
    rng = np.random.default_rng(0)
    corrupt = {0: (int(rng.integers(layout.global_bytes)), 3)}  # page: (byte, bit)
    if layout.num_segments == 2:
        corrupt[last] = (int(rng.integers(layout.global_bytes, layout.payload_bytes)), 6)
    for p, (byte, bit) in corrupt.items():
        flip_bit(setup, p, byte, bit)
    crafted, word = setup.num_pages // 2, 1000
    rewrite(setup, crafted, word, 0x1234_5678_9ABC_DEF1, 1)
    got = load_checksums(setup, layout.payload_bytes)
    failed = {
        (p, s)
        for p in range(setup.num_pages)
        for s in range(layout.num_segments)
        if got[p][s] != stored[p][s]
    }
    expected = {(p, 0 if byte < layout.global_bytes else 1) for p, (byte, _) in corrupt.items()}
    expected.add((crafted, 0 if layout.global_bytes > 8 * (word + 2) else 1))
    out["corrupt_segments_failed"] = sorted(failed)
    out["exactly_corrupt_fail"] = failed == expected
    for p, (byte, bit) in corrupt.items():
        flip_bit(setup, p, byte, bit)
    rewrite(setup, crafted, word, 0x1234_5678_9ABC_DEF1, -1)
    out["restored_pages_verify"] = load_checksums(setup, layout.payload_bytes) == stored
    out["passed"] = all(
        out[k]
        for k in (
            "device_equals_cpu",
            "load_verifies",
            "exactly_corrupt_fail",
            "restored_pages_verify",
        )
    )
    out["stored_checksums"] = stored  # for the timed loads' comparison; dropped from the JSON
    return out


def timed(setup: Setup, fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of fn() over repeats, after one warm-up, the device synchronized."""
    fn()
    setup.sync()
    times = []
    for _ in range(repeats):
        setup.sync()
        start = time.perf_counter()
        fn()
        setup.sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def raw_copy(setup: Setup, nbytes: int) -> Callable[[], None]:
    """Every page's first nbytes, host -> device, page by page, into two staging buffers."""
    staging = [torch.empty(nbytes, dtype=torch.uint8, device=setup.device) for _ in range(2)]
    stream = torch.cuda.Stream(setup.device) if setup.device.type == "cuda" else None

    def run() -> None:
        for p in range(setup.num_pages):
            src = setup.page(p)[:nbytes]
            if stream is None:
                staging[p % 2].copy_(src)
            else:
                with torch.cuda.stream(stream):
                    staging[p % 2].copy_(src, non_blocking=True)
        if stream is not None:
            stream.synchronize()

    return run


def verified_load(setup: Setup, nbytes: int, stored: list[list[bytes]]) -> Callable[[], None]:
    n = len(setup.layout.segments(nbytes))

    def run() -> None:
        got = load_checksums(setup, nbytes)
        assert all(g[:n] == s[:n] for g, s in zip(got, stored, strict=True)), "a good page failed"

    return run


def timings(setup: Setup, stored: list[list[bytes]], repeats: int) -> dict:
    layout, out = setup.layout, {}
    sizes = {"full": layout.payload_bytes}
    if layout.num_segments == 2:
        sizes["global"] = layout.global_bytes
    for name, nbytes in sizes.items():
        total = setup.num_pages * nbytes
        res: dict[str, float] = {"bytes": total}
        res["raw_s"] = timed(setup, raw_copy(setup, nbytes), repeats)
        res["load_s"] = timed(setup, verified_load(setup, nbytes, stored), repeats)
        if isinstance(setup.transfer, CudaTransfer):
            kernel = setup.transfer.checksum_rows
            setup.transfer.checksum_rows = lambda *args, **kwargs: None
            try:
                res["load_unverified_s"] = timed(
                    setup, partial(load_checksums, setup, nbytes), repeats
                )
            finally:
                setup.transfer.checksum_rows = kernel
        for key in [k for k in res if k.endswith("_s")]:
            res[key.removesuffix("_s") + "_GBps"] = total / res[key] / 1e9
        res["load_over_raw"] = res["load_GBps"] / res["raw_GBps"]
        out[name] = res
        print(name, res, flush=True)
    if isinstance(setup.transfer, CudaTransfer):
        out["kernel_alone_GBps"] = kernel_alone(setup, repeats)
    out["target_ratio"] = TARGET_RATIO
    out["meets_target"] = out["full"]["load_over_raw"] >= TARGET_RATIO
    return out


def kernel_alone(setup: Setup, repeats: int) -> float:
    """The checksum kernel over one staged full page, device memory only (GB/s)."""
    from kvshare.kvpool.checksum_kernel import checksum_rows

    nbytes = setup.layout.payload_bytes
    row = setup.page(0).to(setup.device).view(1, nbytes)
    constants = torch.from_numpy(checksum_constants(setup.keys[0]).view(np.int64)[None]).to(
        setup.device
    )
    sums = torch.zeros(1, 2, 2, dtype=torch.int64, device=setup.device)
    seconds = timed(
        setup, lambda: checksum_rows(row, constants, sums, setup.layout.global_bytes), repeats
    )
    return nbytes / seconds / 1e9


def table(results: dict) -> str:
    lines = [f"{'pages':<8} {'raw GB/s':>9} {'load GB/s':>10} {'unverified':>11} {'load/raw':>9}"]
    for name in ("full", "global"):
        res = results.get("timings", {}).get(name)
        if res:
            lines.append(
                f"{name:<8} {res['raw_GBps']:>9.2f} {res['load_GBps']:>10.2f} "
                f"{res.get('load_unverified_GBps', float('nan')):>11.2f} {res['load_over_raw']:>9.3f}"
            )
    t = results.get("timings", {})
    if "kernel_alone_GBps" in t:
        lines.append(f"checksum kernel alone over one page: {t['kernel_alone_GBps']:.0f} GB/s")
    c = results.get("checks", {})
    lines.append(
        f"checks passed: {c.get('passed')}   load/raw >= {TARGET_RATIO}: {t.get('meets_target')}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="gemma3-27b")
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, tiny-gemma3, 2048 tokens: the script's logic only",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        device, args.shape, args.tokens = torch.device("cpu"), "tiny-gemma3", 2048
    else:
        device = torch.device("cuda")
    results: dict[str, object] = {
        "shape": args.shape,
        "tokens": args.tokens,
        "chunk_tokens": args.chunk_tokens,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    start = time.perf_counter()
    setup = Setup(args.shape, args.tokens, args.chunk_tokens, device)
    results["setup_s"] = time.perf_counter() - start
    try:
        checked = checks(setup)
        stored = checked.pop("stored_checksums")
        results["checks"] = checked
        print("checks", checked, flush=True)
        if checked["passed"]:
            results["timings"] = timings(setup, stored, args.repeats)  # type: ignore[arg-type]
    except Exception as exc:
        traceback.print_exc()
        results["error"] = repr(exc)
    finally:
        setup.close()
    (out / "gpu_checksum.json").write_text(json.dumps(results, indent=1, default=str))
    print(table(results))


if __name__ == "__main__":
    main()
