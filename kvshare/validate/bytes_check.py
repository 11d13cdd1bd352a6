"""The byte test: store and load through the real pool across two processes, compare every byte.

A storing process and a loading process (both `python -m kvshare.validate.bytes_check`)
take trials from the parent over stdin. Per trial:
- store side: poison the chunk's blocks, then write a deterministic pattern into them
  on the compute stream *after an imposed delay* (`torch.cuda._sleep`; on the CPU a
  producer thread that sleeps), and store the chunks through the connector;
- load side: poison fresh blocks, restore the prefix through the connector with the
  load stream delayed the same way, then read the blocks on the compute stream and
  compare them with the pattern, byte for byte, on every cache slot the restore covers
  (sliding-window slots only inside the window, as the engine restores them).

With the right ordering no byte differs. With `break_order` (test-only) one stream
dependency is removed, and the delay makes the stale/poisoned bytes show.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from kvshare.kvpool.connector import ConnectorOptions
from kvshare.kvpool.faults import BREAK_ORDERS, FaultInjection
from kvshare.kvpool.transfer import LayerGroups
from kvshare.models.loader import parse_dtype
from kvshare.spec import DEFAULT_CHUNK_TOKENS
from kvshare.validate.capacity import PoolNeed, kv_page_bytes
from kvshare.validate.harness import ConnectorHarness

_POISON_STORE = 3.0  # what a stored block holds before the producer writes it
_POISON_LOAD = -5.0  # what a restore target holds before the load writes it


@dataclass(frozen=True)
class BytesCheckConfig:
    pool: str
    shape: str = "tiny-gemma3"
    device: str = "cpu"
    dtype: str = "auto"
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    block_size: int = 16
    num_chunks: int = 6
    trials: int = 20
    delay: float = 0.05
    break_order: str = ""
    # The loading side's LayerGroups.min_bytes (None: loads come whole, the connector's
    # default); the checks run both.
    layer_group_bytes: int | None = None
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        if self.num_chunks < 1 or self.trials < 1:
            raise ValueError("num_chunks and trials must be >= 1")
        if self.chunk_tokens % self.block_size:
            raise ValueError("chunk_tokens must be a multiple of block_size")
        if self.break_order not in ("", *BREAK_ORDERS):
            raise ValueError(f"unknown break_order {self.break_order!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return parse_dtype(self.dtype)


@dataclass
class TrialResult:
    trial: int
    hit_tokens: int
    compared_bytes: int
    mismatched_bytes: int
    load_ok: bool
    seconds: float

    @property
    def passed(self) -> bool:
        return self.load_ok and self.mismatched_bytes == 0 and self.compared_bytes > 0


def pool_needs(config: BytesCheckConfig) -> list[PoolNeed]:
    """A trial's chunks stay resident from its store to its restore (earlier trials may go)."""
    return [
        PoolNeed(
            kv_page_bytes(config.shape, config.torch_dtype, config.chunk_tokens), config.num_chunks
        )
    ]


def _harness(config: BytesCheckConfig, role: str) -> ConnectorHarness:
    num_blocks = config.num_chunks * config.chunk_tokens // config.block_size + 1
    broken_side = "store" if config.break_order == "store" else "load"
    load_delay = 0.0
    if role == "load" and config.break_order != "load_target":
        # On CUDA the restore's poison fill waits behind `delay` on the compute stream
        # (run_load): the copy waits longer, so a consumer that does not wait reads poison.
        load_delay = config.delay * (2 if config.device.startswith("cuda") else 1)
    faults = FaultInjection(
        break_order=config.break_order if broken_side == role else "",  # type: ignore[arg-type]
        load_delay=load_delay,
    )
    return ConnectorHarness(
        config.pool,
        config.shape,
        config.device,
        config.torch_dtype,
        num_blocks,
        config.run_id,
        ConnectorOptions(
            chunk_tokens=config.chunk_tokens,
            layer_groups=None
            if config.layer_group_bytes is None
            else LayerGroups(min_bytes=config.layer_group_bytes),
        ),
        config.block_size,
        faults=faults,
    )


def run_store(config: BytesCheckConfig, trial: int, side: ConnectorHarness) -> dict:
    blocks = side.cache.blocks.allocate(
        side.cache.blocks.blocks_needed(config.num_chunks * config.chunk_tokens)
    )
    side.fill(blocks, _POISON_STORE)
    if side.device.type == "cuda":
        torch.cuda.synchronize()
    pattern = side.pattern(trial, len(blocks))
    ready = None
    if side.device.type == "cuda":
        side.write(blocks, pattern, config.delay)
    else:
        ready = threading.Event()

        def produce() -> None:
            time.sleep(config.delay)
            side.write(blocks, pattern)
            ready.set()

        threading.Thread(target=produce, daemon=True).start()
    tokens = side.tokens(trial, config.num_chunks)
    request = f"store-{trial}"
    side.connector.store(
        request,
        tokens,
        blocks,
        len(tokens) - 1,
        ready=ready,
        sliding_table=side.sliding_table(blocks),
    )
    side.connector.wait_idle()
    side.connector.forget(request)
    side.cache.blocks.release(blocks)
    return {"trial": trial, "stored": side.connector.counters["stored_pages"]}


def run_load(config: BytesCheckConfig, trial: int, side: ConnectorHarness) -> TrialResult:
    start = time.monotonic()
    fill_delay = config.delay if side.device.type == "cuda" else 0.0
    hit, ok, blocks, got = side.restore_and_read(trial, config.num_chunks, _POISON_LOAD, fill_delay)
    compared, mismatched = 0, 0
    if got is not None:
        compared, mismatched = _compare(side, got, side.pattern(trial, len(blocks)), hit)
    side.cache.blocks.release(blocks)
    return TrialResult(trial, hit, compared, mismatched, ok, time.monotonic() - start)


def _compare(
    side: ConnectorHarness, got: torch.Tensor, expected: torch.Tensor, hit: int
) -> tuple[int, int]:
    """Bytes compared and bytes differing, over the slots the restore must have written."""
    if hit == 0:
        return 0, 0
    item = got.element_size()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[item]
    full_from_block = side.restored_from_block(hit)
    num_global = side.cache.layout.num_global_slots
    hit_blocks = hit // side.block_size
    diff = got.view(as_int)[:, :, :hit_blocks] != expected.view(as_int)[:, :, :hit_blocks]
    # Sliding slots of chunks restored global-only are not restored: exclude them.
    counted = torch.ones_like(diff)
    counted[num_global:, :, :full_from_block] = False
    compared = int(counted.sum()) * item
    mismatched = int((diff & counted).sum()) * item
    return compared, mismatched


# --------------------------------------------------------------------------- processes


def _worker(role: str, config: BytesCheckConfig) -> None:
    """Serve trials from stdin, one JSON line out per trial."""
    side = _harness(config, role)
    # One untimed trial first: lazy CUDA initialization (allocations, pinned buffers)
    # synchronizes the device and would hide a missing wait in the first trial. The store
    # worker is ready before the load worker starts, so trial -1 is in the pool by then.
    if role == "store":
        run_store(config, -1, side)
    else:
        run_load(config, -1, side)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        trial = int(line)
        if role == "store":
            print(json.dumps(run_store(config, trial, side)), flush=True)
        else:
            print(json.dumps(asdict(run_load(config, trial, side))), flush=True)


def _spawn(role: str, config: BytesCheckConfig) -> subprocess.Popen[str]:
    args = [
        sys.executable,
        "-m",
        "kvshare.validate.bytes_check",
        "--role",
        role,
        "--config",
        json.dumps(asdict(config)),
    ]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    _read_json(proc)
    return proc


def _read_json(proc: subprocess.Popen[str]) -> dict:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"bytes-check worker exited with status {proc.wait()}")
    return json.loads(line)


def run_bytes_check(config: BytesCheckConfig, progress: object = None) -> list[TrialResult]:
    """Run config.trials store/load trials across two fresh processes."""
    store, load = _spawn("store", config), _spawn("load", config)
    results = []
    try:
        for trial in range(config.trials):
            for proc in (store, load):
                assert proc.stdin is not None
                proc.stdin.write(f"{trial}\n")
                proc.stdin.flush()
                reply = _read_json(proc)
            results.append(TrialResult(**reply))
            if callable(progress):
                progress(results[-1])
    finally:
        for proc in (store, load):
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=60)
    return results


def summarize(results: list[TrialResult]) -> dict:
    return {
        "trials": len(results),
        "failed_trials": sum(not r.passed for r in results),
        "compared_bytes": sum(r.compared_bytes for r in results),
        "mismatched_bytes": sum(r.mismatched_bytes for r in results),
        "restored_tokens": sum(r.hit_tokens for r in results),
        "median_seconds": float(np.median([r.seconds for r in results])) if results else 0.0,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=("store", "load"), required=True)
    parser.add_argument("--config", required=True)
    cli = parser.parse_args()
    _worker(cli.role, BytesCheckConfig(**json.loads(cli.config)))
