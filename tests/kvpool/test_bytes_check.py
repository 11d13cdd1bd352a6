"""The byte test across two processes catches a missing ordering dependency every trial.

CPU: the producer is a delayed thread (store) and the load worker is delayed (load).
The CUDA variant (GPU machine) imposes torch.cuda._sleep on the producing stream, and on
the compute stream before it poisons a restore's target blocks (the load must land after).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshare.kvpool.client import PoolClient
from kvshare.kvpool.launch import PoolProcess
from kvshare.validate.bytes_check import BytesCheckConfig, run_bytes_check, summarize
from tests.kvpool.pool_fixture import PoolFactory


@pytest.fixture(scope="module")
def pool() -> Iterator[PoolProcess]:
    factory = PoolFactory()
    config = factory.config(size_bytes=2 << 30, slab_bytes=256 << 20)
    process = factory.start(config)
    yield process
    process.stop()
    assert not Path(config.arena_path).exists()  # the daemon removed its arena itself
    factory.close()


def _check(pool: PoolProcess, device: str, trials: int, **overrides: object) -> dict:
    client = PoolClient(pool.address)
    client.clear()  # each check starts with every slab free for its page size
    client.close()
    config = BytesCheckConfig(pool=pool.address, device=device, trials=trials, **overrides)  # type: ignore[arg-type]
    return summarize(run_bytes_check(config))


# tiny-llama with layer groups of 1 byte: its loads come in 2 groups of layers (one slot
# each), read slot by slot behind the fences as the engine's layers read them.
@pytest.mark.parametrize(
    "shape, num_chunks, group_bytes",
    [("tiny-gemma3", 6, None), ("tiny-llama", 3, None), ("tiny-llama", 3, 1)],
)
def test_cpu_bytes_exact_with_delayed_producers(
    pool: PoolProcess, shape: str, num_chunks: int, group_bytes: int | None
) -> None:
    summary = _check(
        pool,
        "cpu",
        4,
        shape=shape,
        num_chunks=num_chunks,
        delay=0.05,
        layer_group_bytes=group_bytes,
    )
    assert summary["failed_trials"] == 0, summary
    assert summary["mismatched_bytes"] == 0
    assert summary["compared_bytes"] > 0


@pytest.mark.parametrize(
    "broken, shape, group_bytes",
    [
        ("store", "tiny-gemma3", None),
        ("load", "tiny-gemma3", None),
        ("load_slots", "tiny-gemma3", None),
        ("load_slots", "tiny-llama", 1),
    ],
)
def test_cpu_broken_ordering_is_caught_every_trial(
    pool: PoolProcess, broken: str, shape: str, group_bytes: int | None
) -> None:
    summary = _check(
        pool,
        "cpu",
        3,
        delay=0.2,
        break_order=broken,
        shape=shape,
        num_chunks=3,
        layer_group_bytes=group_bytes,
    )
    assert summary["failed_trials"] == summary["trials"] == 3, summary


CUDA_TRIALS = int(os.environ.get("KVSHARE_GPU_BYTE_TRIALS", "20"))


# qwen3-8b's pages (36 MiB) in groups of layers come as 4 groups of 9 layers.
@pytest.mark.cuda
@pytest.mark.parametrize(
    "shape, group_bytes", [("gemma3-27b", None), ("qwen3-8b", None), ("qwen3-8b", 4 << 20)]
)
def test_cuda_bytes_exact_with_sleep_on_producing_stream(
    pool: PoolProcess, shape: str, group_bytes: int | None
) -> None:
    summary = _check(
        pool,
        "cuda",
        CUDA_TRIALS,
        shape=shape,
        num_chunks=2,
        delay=0.05,
        layer_group_bytes=group_bytes,
    )
    assert summary["failed_trials"] == 0, summary
    assert summary["mismatched_bytes"] == 0


@pytest.mark.cuda
@pytest.mark.parametrize("broken", ["store", "load", "load_target", "load_slots"])
@pytest.mark.parametrize("group_bytes", [None, 4 << 20])
def test_cuda_broken_stream_wait_is_caught_every_trial(
    pool: PoolProcess, broken: str, group_bytes: int | None
) -> None:
    summary = _check(
        pool,
        "cuda",
        CUDA_TRIALS,
        shape="qwen3-8b",
        num_chunks=2,
        delay=0.05,
        break_order=broken,
        layer_group_bytes=group_bytes,
    )
    assert summary["failed_trials"] == summary["trials"] == CUDA_TRIALS, summary
