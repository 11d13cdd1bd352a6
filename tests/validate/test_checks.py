"""Each validation check passes on a healthy pool and fails on its broken variant."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvshare.kvpool import index as pool_index
from kvshare.kvpool.daemon import PoolConfig, PoolDaemon
from kvshare.kvpool.faults import FaultInjection
from kvshare.kvpool.launch import PoolProcess
from kvshare.validate.corruption import run_corruption_check
from kvshare.validate.faults import run_killed_writer_check, run_lease_loss_check, run_restart_check
from kvshare.validate.pool_fill import run_pool_fill_check
from tests.kvpool.pool_fixture import MIB, PoolFactory


def small_pool(pools: PoolFactory) -> PoolProcess:
    return pools.start(pools.config(size_bytes=64 * MIB, slab_bytes=8 * MIB))


def test_corruption_detected_on_every_page(pools: PoolFactory) -> None:
    result = run_corruption_check(small_pool(pools).address, pages=8)
    assert result.passed, result.failures
    assert result.counts["detected"] == 8
    assert result.counts["payload_flips"] == 6 and result.counts["header_flips"] == 2


def test_corruption_check_fails_when_checksums_are_skipped(pools: PoolFactory) -> None:
    result = run_corruption_check(
        small_pool(pools).address, pages=8, faults=FaultInjection(skip_checksums=True)
    )
    assert not result.passed
    assert result.counts["served_corrupt"] == 8


def test_killed_writer_leaves_nothing_visible(pools: PoolFactory) -> None:
    result = run_killed_writer_check(small_pool(pools).address, pages=6)
    assert result.passed, result.failures
    assert result.counts["reserved_after_kill"] == 0


def test_killed_writer_check_fails_when_pages_commit_before_writing(pools: PoolFactory) -> None:
    result = run_killed_writer_check(small_pool(pools).address, pages=6, commit_early=True)
    assert not result.passed
    assert result.counts["visible_after_kill"] == 6


def test_clients_recover_from_a_daemon_restart(pools: PoolFactory) -> None:
    pool = small_pool(pools)
    result = run_restart_check(pool.address, pool.stop, pool.start)
    assert result.passed, result.failures


def test_pool_fill_accounts_for_every_page(pools: PoolFactory) -> None:
    result = run_pool_fill_check(small_pool(pools).address, payload_bytes=MIB // 2, cycles=3)
    assert result.passed, result.failures
    assert result.counts["pages"] == 8 * ((8 * MIB) // (MIB // 2 + 4096))
    assert result.counts["evictions"] > 0


def test_pool_fill_catches_a_slot_handed_out_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-process daemon whose allocator hands one slot out twice: pool-fill must fail."""
    real_allocate = pool_index.PoolIndex._allocate
    handed: list[tuple] = []

    def allocate_twice(self: pool_index.PoolIndex, page_class: object) -> object:
        if len(handed) == 3:
            return handed[0]
        slot = real_allocate(self, page_class)
        handed.append(slot)
        return slot

    monkeypatch.setattr(pool_index.PoolIndex, "_allocate", allocate_twice)
    folder = PoolFactory()
    config = folder.config(size_bytes=16 * MIB, slab_bytes=4 * MIB)
    daemon = PoolDaemon(
        PoolConfig(
            size_bytes=config.size_bytes,
            socket_path=config.socket_path,
            arena_path=config.arena_path,
            slab_bytes=config.slab_bytes,
        )
    )
    ready = threading.Event()
    loops: list[asyncio.AbstractEventLoop] = []

    def on_ready() -> None:
        loops.append(asyncio.get_running_loop())
        ready.set()

    thread = threading.Thread(
        target=lambda: asyncio.run(daemon.serve(on_ready, handle_signals=False))
    )
    thread.start()
    try:
        assert ready.wait(10)
        result = run_pool_fill_check(f"unix:{config.socket_path}", payload_bytes=MIB // 2, cycles=1)
    finally:
        # stop() sets an asyncio.Event: from this thread it must go through the loop, or
        # an idle loop never wakes to see it (and the thread outlives the test run).
        if loops:
            loops[0].call_soon_threadsafe(daemon.stop)
        thread.join(10)
        folder.close()
    assert not result.passed
    assert any("pattern" in f or "twice" in f for f in result.failures), result.failures


def test_a_restore_whose_lease_died_with_the_daemon_is_caught_when_kept(pools: PoolFactory) -> None:
    pool = small_pool(pools)
    result = run_lease_loss_check(pool.address, pool.stop, pool.start)
    assert result.passed, result.failures
    assert result.counts["lost_leases"] == 1 and result.counts["load_failures"] == 1
    broken = run_lease_loss_check(
        pool.address, pool.stop, pool.start, faults=FaultInjection(keep_lost_lease_restores=True)
    )
    assert not broken.passed
    # A kept restore never stores its chunks to the new pool (they count as restored), and
    # its global-only chunks have no sliding blocks, so no GPU hit or store ever uses them.
    assert any(
        "discarded restore" in failure or "did not restore from the new pool" in failure
        for failure in broken.failures
    ), broken.failures
