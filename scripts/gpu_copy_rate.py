"""What sets the host-to-GPU copy rate of a pool restore, measured on the GPU.

    PYTHONPATH=$PWD python3 scripts/gpu_copy_rate.py --out $OUT [--only load,source,beside]

A restore's copies ran at ~55 GB/s for the first ~15 ms of a hit and at ~51 GB/s after
(H100, 2026-12-06; docs/results/2026-12-06-h100-block-size.md). Three suspects, each
against raw pinned memcpy in the same process:

1. `load`: 2 GiB in 128 MiB copies with the GPU idle, beside a device-to-device copy loop,
   beside bf16 GEMMs of a 32-token step's shape; on one copy stream and on two.
2. `source`: 128 MiB copies from each GiB of 16 GiB of torch's pinned memory and of a
   /dev/shm mapping registered in 1 GiB slabs (kvshare.kvpool.host_memory, as a replica
   registers the pool's arena); flat, and strided as a grouped restore issues them.
3. `beside`: 24 copies of 128 MiB on one stream, each timed by events; after the 7th is
   issued, on another stream: nothing, a step's small pageable uploads, a 154 MB device
   copy (a restored recurrent state), the same uploads from pinned memory, a few kernels,
   17 replays of a captured graph (a step's segments), 32 tokens through 8.6 GB of the 27B
   shape's weight matrices (a step's linear layers), or the small arrays read by a
   kernel straight from pinned memory (no copy engine); or nothing, with the host thread
   asleep instead of spinning in the wait (all its copies then run beside a sleeping
   host: compare them with those of `none`); or, from about the 7th copy on, the default
   stream or another one blocked in a wait for the copies' end, as a step waits for its
   next group of layers, a step's graph replays queued behind it. Rates before and after,
   per interlude.

4. `pipeline`: a restore's copies without the engine: kvshare's CudaTransfer loads
   shape:qwen3.5-27b's fp8 KV of 131,072 tokens (512 pages, 256-token blocks) in layer
   groups from an arena registered in 1 GiB slabs, traced; each copy's rate and how much of
   it ran beside a kernel other than the restore's own (hit_path_profile.copy_rates).

5. `step`: the engine's real step beside the copies (beside_step): a shape:qwen3.5-27b
   engine runs a 32-token request to its first token ~10 ms into 24 copies of 128 MiB, from
   torch's pinned memory, from a mapping registered in slabs, and strided from it; rates
   before and after the step starts, against trials with nothing beside the copies.

6. `pipeline-step`: the two together (pipeline_beside_step): the restore pipeline of 4.
   with the step of 5. started ~10 ms after the load, against the pipeline alone,
   alternated. On an H100 the copies beside the step's kernels ran ~51 GB/s against ~55
   alone, in a hit as here (docs/results/2026-12-07-h100-copies-beside-step.md).

Prints a table per part; writes gpu_copy_rate.json (and the pipelines' traces).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import mmap
import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl
from hit_path_profile import copy_rates

from kvshare.bench.ceilings import median_seconds
from kvshare.kvpool.host_memory import HostRegistration
from kvshare.kvpool.strided_copy import StridedCopy
from kvshare.kvpool.transfer import PageCopy
from kvshare.kvpool.transfer_cuda import CudaTransfer

GIB = 1 << 30
CHUNK = 128 << 20
# The small uploads of a step after a restore, as a trace showed them (int64 elements).
STEP_UPLOADS = (32, 32, 1, 32, 512, 1, 1, 34, 9)


@triton.jit
def _read_host(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


def gbps(nbytes: int, fn: Callable[[], object]) -> float:
    return nbytes / median_seconds(fn, 5) / 1e9


def beside_load(device: torch.device) -> dict[str, float]:
    host = torch.empty(2 * GIB, dtype=torch.uint8, pin_memory=True)
    host.fill_(7)
    dst = torch.empty_like(host, device=device)
    a, b = torch.empty_like(dst), torch.empty_like(dst)
    w = torch.randn(5120, 17408, device=device, dtype=torch.bfloat16)
    x = torch.randn(32, 5120, device=device, dtype=torch.bfloat16)
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]
    load_stream = torch.cuda.Stream(device)

    def load(kind: str) -> None:
        with torch.cuda.stream(load_stream):
            for _ in range(60):  # outlasts the copies
                if kind == "device copy":
                    b.copy_(a)
                elif kind == "gemm":
                    for _ in range(16):
                        x @ w

    def copies(n_streams: int) -> float:
        """GB/s of the copies alone, from events on the copy streams (the load beside them
        runs longer)."""
        used = streams[:n_streams]
        start = torch.cuda.Event(enable_timing=True)
        ends = [torch.cuda.Event(enable_timing=True) for _ in used]
        start.record(used[0])
        for stream in used[1:]:
            stream.wait_event(start)
        for i in range(host.numel() // CHUNK):
            with torch.cuda.stream(used[i % n_streams]):
                part = slice(i * CHUNK, (i + 1) * CHUNK)
                dst[part].copy_(host[part], non_blocking=True)
        for stream, end in zip(used, ends):
            end.record(stream)
        torch.cuda.synchronize()
        return host.numel() / max(start.elapsed_time(end) for end in ends) / 1e6

    rows = {}
    for kind in ("idle", "device copy", "gemm"):
        for n_streams in (1, 2):
            rates = []
            for _ in range(7):
                torch.cuda.synchronize()
                if kind != "idle":
                    load(kind)
                rates.append(copies(n_streams))
            rows[f"{kind}, {n_streams} stream(s)"] = statistics.median(rates[1:])
    assert torch.equal(dst[:: 1 << 20].cpu(), host[:: 1 << 20])
    return rows


def by_source(device: torch.device, gib: int = 16) -> dict[str, float]:
    dst = torch.empty(GIB, dtype=torch.uint8, device=device)
    pinned = torch.empty(gib * GIB, dtype=torch.uint8, pin_memory=True)
    pinned.numpy()[::4096] = 1
    path = f"/dev/shm/kvshare-copy-rate-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, gib * GIB)
        mapping = mmap.mmap(fd, gib * GIB)
    finally:
        os.close(fd)
        os.unlink(path)
    np.frombuffer(mapping, dtype=np.uint8)[::4096] = 1  # every page touched
    shm = torch.frombuffer(mapping, dtype=torch.uint8)
    registration = HostRegistration(device)
    registration.register_slabs(shm, GIB, gib)
    registration.wait()
    strided = StridedCopy.find()
    width, pitch, rows = 4_259_840, 8_519_680, 120  # a grouped restore's rows, in one slab
    out = {}
    try:
        assert registration.registered_bytes == gib * GIB, "cudaHostRegister refused a slab"
        for name, host in (("pinned", pinned), ("registered /dev/shm", shm)):
            slabs = [host[g * GIB : g * GIB + CHUNK] for g in range(gib)]
            flat = [gbps(CHUNK, lambda s=s: dst[:CHUNK].copy_(s, True)) for s in slabs]
            out[f"{name}, flat: min"], out[f"{name}, flat: max"] = min(flat), max(flat)
            if strided is not None:
                starts = [host.data_ptr() + g * GIB for g in range(gib)]
                rates = [
                    gbps(width * rows, lambda p=p: strided(dst, p, pitch, width, rows))
                    for p in starts
                ]
                out[f"{name}, strided: min"], out[f"{name}, strided: max"] = min(rates), max(rates)
    finally:
        registration.unregister()
    return out


def beside_copies(device: torch.device, n: int = 24, at: int = 6) -> dict[str, list[float]]:
    host = torch.empty(n * CHUNK, dtype=torch.uint8, pin_memory=True)
    host.numpy()[::4096] = 3
    dst = torch.empty(n * CHUNK, dtype=torch.uint8, device=device)
    a = torch.empty(154 << 20, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    small = [np.arange(k, dtype=np.int64) for k in STEP_UPLOADS]
    pinned_small = [torch.from_numpy(s).pin_memory() for s in small]
    device_small = [torch.empty(len(s), dtype=torch.int64, device=device) for s in small]
    copies, side = torch.cuda.Stream(device), torch.cuda.Stream(device)
    # A step's linear layers: 32 tokens through 48 weight matrices of the 27B shape (8.6 GB
    # read once, ~3 ms), where the stand-ins above touch a few hundred MB.
    x = torch.randn(32, 5120, device=device, dtype=torch.bfloat16)
    weights = [torch.empty(5120, 17408, device=device, dtype=torch.bfloat16) for _ in range(48)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        b.add_(1)  # warm the kernel outside the capture
        with torch.cuda.graph(graph, stream=side):
            for _ in range(8):
                b.add_(1)

    def interlude(kind: str) -> None:
        with torch.cuda.stream(side):
            if kind == "pageable uploads":
                for s in small:
                    torch.from_numpy(s).to(device, non_blocking=True)
            elif kind == "pinned uploads":
                for s in small:
                    torch.from_numpy(s).pin_memory().to(device, non_blocking=True)
            elif kind == "device copy":
                b.copy_(a)
            elif kind == "kernels":
                for _ in range(20):
                    b.add_(1)
            elif kind == "graph replays":
                for _ in range(17):
                    graph.replay()
            elif kind == "weight sweep":
                for w in weights:
                    x @ w
            elif kind == "kernel reads pinned":
                for src, out in zip(pinned_small, device_small):
                    block = triton.next_power_of_2(max(16, src.numel()))
                    _read_host[(1,)](src, out, src.numel(), BLOCK=block)

    def run(kind: str) -> list[float]:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        events[0].record(copies)
        for i in range(n):
            with torch.cuda.stream(copies):
                part = slice(i * CHUNK, (i + 1) * CHUNK)
                dst[part].copy_(host[part], non_blocking=True)
            events[i + 1].record(copies)
            if i == at:
                interlude(kind)
        if kind == "host asleep":
            time.sleep(n * CHUNK / 40e9)  # past the copies' end: the wait does not spin
        elif kind.endswith("stream waits"):
            # As a step waits for its next group of layers: from about the 7th copy on, a
            # stream sits in a wait for the copies' end (a GPU sleep until then), a step's
            # segments queued behind it.
            waiter = torch.cuda.default_stream(device) if kind.startswith("default") else side
            with torch.cuda.stream(waiter):
                torch.cuda._sleep(int(at * CHUNK / 55e9 * 1.5e9))
                waiter.wait_event(events[n])
                for _ in range(17):
                    graph.replay()
        torch.cuda.synchronize()
        return [CHUNK / events[i].elapsed_time(events[i + 1]) / 1e6 for i in range(n)]

    kinds = ["none", "pageable uploads", "device copy", "pinned uploads", "kernels"]
    kinds += ["graph replays", "weight sweep", "host asleep"]
    kinds += ["default stream waits", "side stream waits"]
    try:
        interlude("kernel reads pinned")
        torch.cuda.synchronize()
        if all(torch.equal(o.cpu(), s) for s, o in zip(pinned_small, device_small)):
            kinds.append("kernel reads pinned")
    except Exception as exc:  # Triton may refuse a host pointer: then that row is missing
        print(f"a kernel reading pinned memory was refused: {type(exc).__name__}: {exc}")
    rows = {}
    for kind in [*kinds, "none", "pageable uploads"]:  # again: does anything persist?
        per_copy = [statistics.median(c) for c in zip(*[run(kind) for _ in range(4)][1:])]
        before, after = statistics.median(per_copy[1:at]), statistics.median(per_copy[at + 2 :])
        rows.setdefault(kind, []).extend([before, after])
    assert torch.equal(dst[:: 1 << 20].cpu(), host[:: 1 << 20])
    return rows


def step_engine() -> Callable[[], float]:
    """One shape:qwen3.5-27b engine (random bf16 weights, fp8 KV, no pool), warm; returns a
    function that runs a 32-token request through it to its first token (GEMMs over the
    27B weights, DeltaNet, attention) and gives the milliseconds it took."""
    from kvshare import LLM
    from kvshare.bench.engine_perf import random_prompt
    from kvshare.engine.sampling_params import SamplingParams

    llm = LLM(
        "shape:qwen3.5-27b",
        device="cuda",
        dtype="bfloat16",
        block_size=256,
        max_num_batched_tokens=8192,
        max_num_seqs=1,
        max_model_len=16384,
        gpu_memory_fraction=0.9,
        kv_cache_dtype="fp8",
        kv_cache_memory=2 << 30,
    )
    engine, vocab = llm.engine, llm.loaded.config.vocab_size
    requests = itertools.count()

    def first_token_ms() -> float:
        """Not bench.engine_perf.first_token: that synchronizes the device first, which
        would wait for the copies beside the request."""
        k = next(requests)
        start = time.perf_counter()
        engine.add_request(
            f"r{k}", random_prompt(32, vocab, k), SamplingParams(max_tokens=1, temperature=0.0)
        )
        while engine.has_unfinished():
            engine.step()
        return (time.perf_counter() - start) * 1e3

    for _ in range(3):
        first_token_ms()  # compiles and captures before anything is timed
    return first_token_ms


def beside_step(device: torch.device, n: int = 24, trials: int = 3) -> dict[str, list[dict]]:
    """The engine's real step beside the copies (step_engine). Per trial, n copies of 128
    MiB on a side stream, each timed by events; ~10 ms after they were issued, either
    nothing or the step's 32-token request. From torch's pinned memory, a /dev/shm-like
    mapping registered in 1 GiB slabs, and strided copies (15 rows of 4.26 MB, 8.5 MB apart)
    from that mapping."""
    from kvshare.kvpool.host_memory import mapped_in_slabs

    first_token_ms = step_engine()
    dst = torch.empty(n * CHUNK, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)
    strided = StridedCopy.find()
    width, pitch, rows = 4_259_840, 8_519_680, 15

    def trial(host: torch.Tensor, source: str, step: bool) -> dict:
        torch.cuda.synchronize()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        mark = torch.cuda.Event(enable_timing=True)
        events[0].record(side)
        for i in range(n):
            with torch.cuda.stream(side):
                if source == "strided":
                    src = host.data_ptr() + (i // 8) * GIB + (i % 8) * rows * pitch
                    strided(dst[i * CHUNK :], src, pitch, width, rows)
                else:
                    dst[i * CHUNK : (i + 1) * CHUNK].copy_(host[i * CHUNK : (i + 1) * CHUNK], True)
            events[i + 1].record(side)
        time.sleep(0.010)
        mark.record(torch.cuda.current_stream(device))
        step_ms = first_token_ms() if step else 0.0
        torch.cuda.synchronize()
        at = events[0].elapsed_time(mark)
        nbytes = width * rows if source == "strided" else CHUNK
        rates = [nbytes / events[i].elapsed_time(events[i + 1]) / 1e6 for i in range(n)]
        ends = [events[0].elapsed_time(events[i + 1]) for i in range(n)]
        return {
            "step": step,
            "mark_ms": at,
            "step_ms": step_ms,
            "before": statistics.median(r for r, e in zip(rates, ends) if e <= at),
            "after": statistics.median(r for r, e in zip(rates, ends) if e > at + 5),
            "rates": rates,
        }

    pinned = torch.empty(n * CHUNK, dtype=torch.uint8, pin_memory=True)
    pinned.numpy()[::4096] = 5
    out: dict[str, list[dict]] = {}
    with mapped_in_slabs(-(-n * CHUNK // GIB), GIB) as registered:
        registered.numpy()[::4096] = 5
        sources = {"pinned": pinned, "registered": registered}
        if strided is not None:
            sources["strided"] = registered
        for source, host in sources.items():
            out[source] = [trial(host, source, step) for _ in range(trials) for step in (0, 1)]
    return out


@contextlib.contextmanager
def restore_pipeline(
    device: torch.device, tokens: int = 131072
) -> Iterator[tuple[CudaTransfer, list[PageCopy], int]]:
    """kvshare's CudaTransfer for shape:qwen3.5-27b's fp8 KV of `tokens` tokens (256-token
    blocks, layer groups as the engine sets them on CUDA) over an arena registered in 1 GiB
    slabs, warm; yields it with the copies of a whole restore and their bytes."""
    from kvshare.engine.connector import KVCacheLayout
    from kvshare.kvpool.host_memory import mapped_in_slabs
    from kvshare.kvpool.layout import PageLayout
    from kvshare.kvpool.page import HEADER_BYTES, slot_bytes_for
    from kvshare.kvpool.transfer import LayerGroups
    from kvshare.models.presets import shape_preset

    chunk = 256
    pages = tokens // chunk
    cache = KVCacheLayout.allocate(
        shape_preset("qwen3.5-27b"), pages, chunk, torch.bfloat16, device, kv_cache_dtype="fp8"
    )
    layout = PageLayout.of(cache, chunk)
    slot = slot_bytes_for(layout.payload_bytes)
    per_slab = GIB // slot  # a page never leaves its slab, as in the pool's arena
    slabs = -(-pages // per_slab)
    copies = [
        PageCopy(
            (j // per_slab) * GIB + (j % per_slab) * slot + HEADER_BYTES,
            layout.payload_bytes,
            (j,),
            j.to_bytes(16, "little"),
            0,
            (),
        )
        for j in range(pages)
    ]
    transfer = CudaTransfer(cache.kv, layout, layer_groups=LayerGroups())
    transfer.warm_up()
    with mapped_in_slabs(slabs, GIB) as arena:
        transfer.set_arena(arena, GIB)
        for _ in range(2):
            transfer.load(copies).wait()
        yield transfer, copies, pages * layout.payload_bytes


def traced_load(
    transfer: CudaTransfer,
    copies: list[PageCopy],
    nbytes: int,
    trace_path: Path,
    beside: Callable[[], float] | None = None,
) -> dict[str, object]:
    """One whole restore through `transfer`, traced to trace_path; ~10 ms after the load
    is issued (a hit launches its step once the first layer group is in) the host runs
    beside() if given, its milliseconds kept. The load's rate and each copy's."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as trace:
        start = time.perf_counter()
        job = transfer.load(copies)
        time.sleep(max(0.0, 0.010 - (time.perf_counter() - start)))
        beside_ms = beside() if beside is not None else 0.0
        job.wait()
        seconds = time.perf_counter() - start
    trace.export_chrome_trace(str(trace_path))
    return {
        "bytes": nbytes,
        "load_gbps": nbytes / seconds / 1e9,
        "beside_ms": beside_ms,
        **copy_rates(trace_path),
    }


def pipeline(device: torch.device, out: Path) -> dict[str, object]:
    with restore_pipeline(device) as (transfer, copies, nbytes):
        return traced_load(transfer, copies, nbytes, out / "pipeline.trace.json")


def pipeline_beside_step(device: torch.device, out: Path, trials: int = 3) -> list[dict]:
    """The restore pipeline (restore_pipeline) with the engine's real step (step_engine)
    started ~10 ms after the load, against the pipeline alone, alternated; each load
    traced. The step here reads none of the restored KV and waits for none of its events:
    a drop in the copies' rate with it puts the cause in the pipeline and the step
    together, none in the hit's waits."""
    first_token_ms = step_engine()
    with restore_pipeline(device) as (transfer, copies, nbytes):
        return [
            {"step": step}
            | traced_load(
                transfer,
                copies,
                nbytes,
                out / f"pipeline-step{int(step)}-{t}.trace.json",
                first_token_ms if step else None,
            )
            for t in range(trials)
            for step in (False, True)
        ]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", default="load,source,beside,step,pipeline,pipeline-step")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", torch.cuda.current_device())
    parts = set(args.only.split(","))
    result: dict[str, object] = {"device": torch.cuda.get_device_name(device)}
    if "load" in parts:
        result["load"] = load = beside_load(device)
        print("| copies beside | GB/s |\n| --- | --- |")
        for name, rate in load.items():
            print(f"| {name} | {rate:.2f} |")
    if "source" in parts:
        result["source"] = source = by_source(device)
        print("| source | GB/s |\n| --- | --- |")
        for name, rate in source.items():
            print(f"| {name} | {rate:.2f} |")
    if "beside" in parts:
        result["beside"] = beside = beside_copies(device)
        print("| after the 7th copy, beside | before | after | after / before |")
        print("| --- | --- | --- | --- |")
        for name, rates in beside.items():
            for before, after in zip(rates[::2], rates[1::2]):
                print(f"| {name} | {before:.2f} | {after:.2f} | {after / before:.3f} |")
    if "step" in parts:
        result["step"] = stepped = beside_step(device)
        print("| source | beside | before | after |\n| --- | --- | --- | --- |")
        for source, trials in stepped.items():
            for t in trials:
                beside = f"a step ({t['step_ms']:.1f} ms)" if t["step"] else "nothing"
                print(f"| {source} | {beside} | {t['before']:.2f} | {t['after']:.2f} |")
    if "pipeline" in parts:
        result["pipeline"] = piped = pipeline(device, args.out)
        print(f"pipeline: {piped['bytes'] / 1e9:.2f} GB, {piped['load_gbps']:.2f} GB/s whole")
    if "pipeline-step" in parts:
        result["pipeline_step"] = runs = pipeline_beside_step(device, args.out)
        print("| beside the pipeline | load GB/s | copies alone | beside the step |")
        print("| --- | --- | --- | --- |")
        for r in runs:
            beside = f"a step ({r['beside_ms']:.1f} ms)" if r["step"] else "nothing"
            print(
                f"| {beside} | {r['load_gbps']:.2f} | {r.get('alone_gbps') or 0:.2f} "
                f"| {r.get('beside_step_gbps') or 0:.2f} |"
            )
    (args.out / "gpu_copy_rate.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
