"""`kvshare validate`: the operator's correctness proof for a shared-KV deployment.

kvshare validate [bytes pool-fill corruption faults regression cross-host | all] [--pool unix:PATH]
                 [--target URL | --up "ARGS"] [--device cpu|cuda] [--json FILE]

Pool checks run against --pool, or against the cluster's pool with --up, or against a
fresh pool started for the run. `pool-fill` empties the pool it checks: run it only on a
pool no replica is serving from. Exit status 0 only when every selected check passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvshare.kvpool.faults import BREAK_ORDERS

if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from kvshare.kvpool.faults import FaultInjection
    from kvshare.validate.bytes_check import BytesCheckConfig
    from kvshare.validate.capacity import PoolNeed
    from kvshare.validate.result import CheckResult

# Regression runs before faults: the daemon restart in faults disturbs a serving cluster.
# cross-host starts its own Mooncake master and two pools (and skips without Mooncake).
CHECKS = ("bytes", "pool-fill", "corruption", "regression", "faults", "cross-host")
_OWN_POOLS = ("regression", "cross-host")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "validate", help="prove shared KV is byte-exact and answers are unchanged"
    )
    parser.add_argument(
        "checks", nargs="*", default=["all"], help=f"any of {', '.join(CHECKS)}, or all"
    )
    parser.add_argument(
        "--pool", default=None, help="unix:PATH of a running pool (default: start one)"
    )
    parser.add_argument(
        "--pool-size",
        default="2GiB",
        help="least size of a pool started here (grown to what the checks keep)",
    )
    parser.add_argument("--target", default=None, help="router URL for the regression check")
    parser.add_argument(
        "--up", default=None, help='start `kvshare up` with these args, e.g. "--replicas 2"'
    )
    parser.add_argument(
        "--device", default="cpu", help="cpu or cuda[:N]: where the checks' KV caches live"
    )
    parser.add_argument(
        "--shape", default=None, help="page layout of bytes/corruption (a shape preset)"
    )
    parser.add_argument(
        "--trials", type=int, default=20, help="store/restore trials of the bytes check"
    )
    parser.add_argument(
        "--num-chunks", type=int, default=6, help="pool pages per bytes-check trial"
    )
    parser.add_argument("--json", default=None, help="write every check's counts here")
    # Test-only: remove one stream dependency / ignore checksums / keep a restore whose lease
    # was lost, to prove the checks catch it.
    parser.add_argument(
        "--unsafe-break-stream-order", choices=BREAK_ORDERS, default="", help=argparse.SUPPRESS
    )
    parser.add_argument("--unsafe-skip-checksums", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--unsafe-keep-lost-lease-restores", action="store_true", help=argparse.SUPPRESS
    )
    parser.set_defaults(func=_validate)


@dataclass
class _Pool:
    address: str
    stop: Callable[[], object] | None = None
    start: Callable[[], object] | None = None


@contextlib.contextmanager
def _environment(
    args: argparse.Namespace, wanted: list[str]
) -> Iterator[tuple[_Pool | None, str | None]]:
    """The pool and the router URL the checks run against, started here when not given.

    A pool started here is sized to hold what the largest check keeps at once (at least
    --pool-size), so that no check finds its own pages evicted.
    """
    from kvshare.kvpool.launch import PoolProcess, PoolProcessConfig
    from kvshare.kvpool.paths import SHM_DIR
    from kvshare.sizes import parse_size
    from kvshare.validate.capacity import pool_geometry

    with contextlib.ExitStack() as stack:
        target = args.target
        pool: _Pool | None = _Pool(args.pool) if args.pool else None
        if args.up is not None or ("regression" in wanted and target is None):
            from kvshare.bench.cluster import up_config
            from kvshare.preflight import check_up
            from kvshare.serve.launcher import Cluster

            # Free ports unless ARGS names --port: a fixed port may be taken on this host.
            config = up_config(args.up or "")
            check_up(config)
            cluster = stack.enter_context(Cluster(config))
            target = cluster.url
            pool = pool or _Pool(cluster.pool_address, cluster.stop_pool, cluster.start_pool)
        if pool is None and any(c not in _OWN_POOLS for c in wanted):
            needs = [need for name in wanted for need in _pool_needs(name, args)]
            size, slab = pool_geometry(needs, parse_size(args.pool_size))
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvs-validate-"))
            process = PoolProcess(
                PoolProcessConfig(
                    size_bytes=size,
                    socket_path=f"{folder}/pool.sock",
                    arena_path=f"{SHM_DIR}/kvshare-validate-{uuid.uuid4().hex[:12]}.arena",
                    slab_bytes=slab,
                    # The checks are this pool's only clients, one at a time, each sized for the
                    # whole pool: no other client needs protecting from them.
                    max_client_fraction=1.0,
                )
            )
            stack.enter_context(process)
            pool = _Pool(process.address, process.stop, process.start)
        yield pool, target


def _injected_faults(args: argparse.Namespace) -> FaultInjection | None:
    """The faults the hidden --unsafe-* flags inject into the checks' connectors (None: none).
    The bytes check takes its broken order from the same flag, per role (store or load)."""
    from kvshare.kvpool.faults import FaultInjection, injected

    return injected(
        FaultInjection(
            skip_checksums=args.unsafe_skip_checksums,
            keep_lost_lease_restores=args.unsafe_keep_lost_lease_restores,
        )
    )


def _shape_and_dtype(args: argparse.Namespace) -> tuple[str, torch.dtype]:
    import torch

    cuda = args.device.startswith("cuda")
    return args.shape or (
        "gemma3-27b" if cuda else "tiny-gemma3"
    ), torch.bfloat16 if cuda else torch.float32


def _bytes_config(args: argparse.Namespace, pool: str) -> BytesCheckConfig:
    from kvshare.validate.bytes_check import BytesCheckConfig

    return BytesCheckConfig(
        pool=pool,
        shape=_shape_and_dtype(args)[0],
        device=args.device,
        trials=args.trials,
        num_chunks=args.num_chunks,
        break_order=args.unsafe_break_stream_order,
    )


def _pool_needs(name: str, args: argparse.Namespace) -> list[PoolNeed]:
    from kvshare.validate import bytes_check, corruption, faults, pool_fill

    shape, dtype = _shape_and_dtype(args)
    if name == "bytes":
        return bytes_check.pool_needs(_bytes_config(args, ""))
    if name == "corruption":
        return corruption.pool_needs(shape, dtype)
    if name == "pool-fill":
        return pool_fill.pool_needs()
    if name == "faults":
        return faults.pool_needs(dtype)
    return []


def _refusal(name: str, args: argparse.Namespace, pool: _Pool | None) -> str | None:
    """Why the pool cannot hold what check `name` keeps at once (None: it can)."""
    from kvshare.kvpool.client import PoolClient
    from kvshare.validate.capacity import shortfall

    needs = _pool_needs(name, args)
    if pool is None or not needs:
        return None
    client = PoolClient(pool.address)
    try:
        stats = client.stats()
    finally:
        client.close()
    return next((why for need in needs if (why := shortfall(need, stats))), None)


def _run_check(name: str, args: argparse.Namespace, pool: _Pool | None, target: str | None) -> list:
    from kvshare.validate.bytes_check import run_bytes_check, summarize
    from kvshare.validate.corruption import run_corruption_check
    from kvshare.validate.faults import (
        run_killed_writer_check,
        run_lease_loss_check,
        run_restart_check,
    )
    from kvshare.validate.pool_fill import run_pool_fill_check
    from kvshare.validate.regression import run_regression_check
    from kvshare.validate.result import CheckResult

    shape, dtype = _shape_and_dtype(args)
    if name == "cross-host":
        from kvshare.validate.cross_host import CrossHostConfig, run_cross_host_check

        return run_cross_host_check(CrossHostConfig(device=args.device))
    if name == "regression":
        return (
            [run_regression_check(target)]
            if target
            else [CheckResult("regression", skipped="no router")]
        )
    if pool is None:
        raise ValueError(f"the {name} check needs a pool")
    if name == "bytes":
        summary = summarize(run_bytes_check(_bytes_config(args, pool.address)))
        result = CheckResult("bytes", counts=summary)
        result.expect(
            summary["failed_trials"] == 0,
            f"{summary['failed_trials']} of {summary['trials']} trials failed",
        )
        return [result]
    if name == "corruption":
        return [
            run_corruption_check(
                pool.address,
                shape=shape,
                device=args.device,
                dtype=dtype,
                faults=_injected_faults(args),
            )
        ]
    if name == "pool-fill":
        return [run_pool_fill_check(pool.address)]
    results = [run_killed_writer_check(pool.address)]
    if pool.stop is None or pool.start is None:
        for check in ("faults.daemon_restart", "faults.lease_loss"):
            results.append(CheckResult(check, skipped="the pool was not started by this run"))
    else:
        results.append(
            run_restart_check(pool.address, pool.stop, pool.start, device=args.device, dtype=dtype)
        )
        results.append(
            run_lease_loss_check(
                pool.address,
                pool.stop,
                pool.start,
                device=args.device,
                faults=_injected_faults(args),
            )
        )
    return results


def _checked(
    name: str, args: argparse.Namespace, pool: _Pool | None, target: str | None, refused: set[str]
) -> list[CheckResult]:
    """Check `name`'s results; a check that cannot run is a failed check, not a crash."""
    from kvshare.validate.result import CheckResult

    try:
        if why := _refusal(name, args, pool):
            refused.add(name)
            return [CheckResult(name, skipped=f"not run: {why}")]
        return _run_check(name, args, pool, target)
    except Exception as exc:
        failed = CheckResult(name)
        failed.fail(f"{type(exc).__name__}: {exc}")
        return [failed]


def _validate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvshare.preflight import check_device

    wanted = list(CHECKS) if "all" in args.checks else [c for c in CHECKS if c in args.checks]
    wanted += [c for c in args.checks if c not in CHECKS and c != "all"]
    unknown = [c for c in wanted if c not in CHECKS]
    console = Console(soft_wrap=True)  # whole lines when piped, where the width is a guess
    if unknown:
        console.print(
            f"[red]unknown check(s): {', '.join(unknown)}[/red]; choose from {', '.join(CHECKS)}"
        )
        return 2
    try:
        check_device(args.device)
        return _run_checks(args, wanted, console)
    except ValueError as exc:  # a device, or a cluster (--up), this machine does not have
        console.print(f"kvshare validate: {exc}", markup=False, highlight=False)
        return 2


def _run_checks(args: argparse.Namespace, wanted: list[str], console: Console) -> int:
    from kvshare.tables import Table, print_table

    # Piped or logged, a spinner shows nothing: one line per check start and end instead.
    lines = not console.is_terminal
    results, seconds, refused = [], {}, set()
    with _environment(args, wanted) as (pool, target):
        for name in wanted:
            start = time.monotonic()
            if lines:
                console.print(f"validate {name}: started", highlight=False)
            with console.status(f"validate {name} ...") if not lines else contextlib.nullcontext():
                outcome = _checked(name, args, pool, target, refused)
            for result in outcome:
                results.append(result)
                seconds[result.name] = time.monotonic() - start
                if lines:
                    console.print(
                        f"validate {result.name}: {result.as_dict()['status']} "
                        f"({seconds[result.name]:.1f} s)",
                        highlight=False,
                    )
    rows = tuple(
        (
            r.name,
            r.as_dict()["status"],
            ", ".join(f"{k}={v}" for k, v in r.counts.items()) or r.skipped,
            f"{seconds[r.name]:.1f}",
        )
        for r in results
    )
    print_table(console, Table("kvshare validate", ("check", "status", "counts", "seconds"), rows))
    for r in results:
        for failure in r.failures:
            console.print(f"[red]{r.name}:[/red] {failure}", highlight=False)
        if r.name in refused:
            console.print(f"[yellow]{r.name}:[/yellow] {r.skipped}", highlight=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": args.device,
                    "checks": [r.as_dict() for r in results],
                    "seconds": seconds,
                },
                f,
                indent=1,
            )
    if any(not r.passed for r in results):
        return 1
    # A check refused for want of pool space proved nothing: not a pass.
    return 2 if refused else 0
