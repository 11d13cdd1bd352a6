"""Fault checks: a client killed mid-store leaves nothing visible; clients survive a daemon restart.

`run_killed_writer_check`: a child process reserves pages, writes half of each, and is
SIGKILLed before it commits. None of its keys may be returned by a lookup afterwards, and
its reservations must be gone (the daemon aborts them on disconnect). The broken variant
commits before writing: then the half-written pages are visible, and the check fails.

`run_restart_check`: with a pool this process started, stop the daemon under a client,
check that lookups and stores degrade to misses/skips without raising, start it again,
and check that the client reconnects, remaps the new arena and stores/restores again.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import torch

from kvshare.kvpool.client import PoolClient, PoolUnavailable
from kvshare.kvpool.connector import ConnectorOptions
from kvshare.kvpool.page import HEADER_BYTES
from kvshare.validate.capacity import PoolNeed, kv_page_bytes
from kvshare.validate.harness import ConnectorHarness
from kvshare.validate.result import CheckResult

_PAYLOAD = 1 << 20
_RESTART_SHAPE = "tiny-llama"
_RESTART_CHUNK_TOKENS = 256


def pool_needs(dtype: torch.dtype, pages: int = 8) -> list[PoolNeed]:
    """The killed writer's reservations (never evictable), and one two-chunk restore prefix."""
    return [PoolNeed(_PAYLOAD, pages),
            PoolNeed(kv_page_bytes(_RESTART_SHAPE, dtype, _RESTART_CHUNK_TOKENS), 2)]


def _writer(pool: str, keys: list[bytes], commit_early: bool) -> None:
    client = PoolClient(pool)
    client.connect()
    reservation = client.reserve(keys, _PAYLOAD)
    if commit_early:
        client.commit([p.key for p in reservation.pages], [b"early"] * len(reservation.pages))
    for page in reservation.pages:
        client.arena.view(page.offset + HEADER_BYTES, _PAYLOAD // 2)[:] = b"\xab" * (_PAYLOAD // 2)
    print(len(reservation.pages), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def run_killed_writer_check(pool: str, *, pages: int = 8, commit_early: bool = False) -> CheckResult:
    result = CheckResult("faults.killed_writer")
    keys = [os.urandom(16) for _ in range(pages)]
    args = [sys.executable, "-m", "kvshare.validate.faults", "--pool", pool,
            "--keys", ",".join(k.hex() for k in keys)]
    if commit_early:
        args.append("--commit-early")
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    reserved = int(done.stdout.strip() or 0)
    result.expect(done.returncode == -signal.SIGKILL, f"writer exited with {done.returncode}, not SIGKILL")
    result.expect(reserved == pages, f"writer reserved {reserved} of {pages} pages")
    client = PoolClient(pool)
    visible = 0
    for key in keys:
        found = client.lookup([key])
        client.release(found.lease)
        visible += len(found.pages)
    result.expect(visible == 0, f"{visible} half-written pages became visible")
    stats = client.stats()
    client.close()
    result.counts = {"pages_written_half": reserved, "visible_after_kill": visible,
                     "reserved_after_kill": int(stats["reserved"])}
    return result


def run_restart_check(address: str, stop: Callable[[], object], start: Callable[[], object], *,
                      shape: str = _RESTART_SHAPE, device: str = "cpu",
                      dtype: torch.dtype = torch.float32) -> CheckResult:
    """`stop`/`start` stop and restart the daemon serving `address` (same paths)."""
    result = CheckResult("faults.daemon_restart")
    options = ConnectorOptions(chunk_tokens=_RESTART_CHUNK_TOKENS)
    harness = ConnectorHarness(address, shape, device, dtype, 2 * _RESTART_CHUNK_TOKENS // 16 + 1, uuid.uuid4().hex, options)
    harness.store_pattern(0, 2)
    hit, ok, blocks = harness.restore(0, 2, poison=-1.0)
    harness.cache.blocks.release(blocks)
    result.expect(hit == 512 and ok, "no restore before the restart")
    generation = harness.connector.client.generation
    stop()
    try:
        hit, ok, blocks = harness.restore(0, 2, poison=-1.0)
        harness.cache.blocks.release(blocks)
        harness.store_pattern(1, 2)
        result.expect(hit == 0, "a restore succeeded with the daemon down")
    except PoolUnavailable as exc:
        result.fail(f"the connector raised with the daemon down: {exc}")
    errors_while_down = harness.connector.stats().get("pool_errors", 0)
    result.expect(errors_while_down > 0, "pool errors were not counted while the daemon was down")
    start()
    time.sleep(harness.connector.client.retry_interval + 0.1)
    harness.store_pattern(2, 2)
    hit, ok, blocks = harness.restore(2, 2, poison=-1.0)
    harness.cache.blocks.release(blocks)
    result.expect(hit == 512 and ok, "no store/restore after the daemon came back")
    result.expect(harness.connector.client.generation != generation, "the client did not see the new daemon run")
    result.counts = {"errors_while_down": errors_while_down,
                     "restored_after_restart_tokens": hit}
    harness.connector.close()
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--pool", required=True)
    parser.add_argument("--keys", required=True)
    parser.add_argument("--commit-early", action="store_true")
    cli = parser.parse_args()
    _writer(cli.pool, [bytes.fromhex(k) for k in cli.keys.split(",")], cli.commit_early)
