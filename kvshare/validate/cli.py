"""`kvshare validate`: the operator's correctness proof for a shared-KV deployment.

kvshare validate [bytes pool-fill corruption faults regression | all] [--pool unix:PATH]
                 [--target URL | --up "ARGS"] [--device cpu|cuda] [--json FILE]

Pool checks run against --pool, or against the cluster's pool with --up, or against a
fresh pool started for the run. `pool-fill` empties the pool it checks: run it only on a
pool no replica is serving from. Exit status 0 only when every selected check passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

# Regression runs before faults: the daemon restart in faults disturbs a serving cluster.
CHECKS = ("bytes", "pool-fill", "corruption", "regression", "faults")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("validate", help="prove shared KV is byte-exact and answers are unchanged")
    parser.add_argument("checks", nargs="*", default=["all"], help=f"any of {', '.join(CHECKS)}, or all")
    parser.add_argument("--pool", default=None, help="unix:PATH of a running pool (default: start one)")
    parser.add_argument("--pool-size", default="2GiB")
    parser.add_argument("--target", default=None, help="router URL for the regression check")
    parser.add_argument("--up", default=None, help='start `kvshare up` with these args, e.g. "--replicas 2"')
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default=None, help="page layout of bytes/corruption (a shape preset)")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--num-chunks", type=int, default=6)
    parser.add_argument("--json", default=None, help="write every check's counts here")
    # Test-only: remove one stream dependency / ignore checksums / keep a restore whose lease
    # was lost, to prove the checks catch it.
    parser.add_argument("--unsafe-break-stream-order", choices=("store", "load"), default="",
                        help=argparse.SUPPRESS)
    parser.add_argument("--unsafe-skip-checksums", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--unsafe-keep-lost-lease-restores", action="store_true", help=argparse.SUPPRESS)
    parser.set_defaults(func=_validate)


@dataclass
class _Pool:
    address: str
    stop: Callable[[], object] | None = None
    start: Callable[[], object] | None = None


@contextlib.contextmanager
def _environment(args: argparse.Namespace, wanted: list[str]) -> Iterator[tuple[_Pool | None, str | None]]:
    """The pool and the router URL the checks run against, started here when not given."""
    from kvshare.kvpool.launch import PoolProcess, PoolProcessConfig
    from kvshare.kvpool.paths import SHM_DIR
    from kvshare.sizes import parse_size

    with contextlib.ExitStack() as stack:
        target = args.target
        pool: _Pool | None = _Pool(args.pool) if args.pool else None
        if args.up is not None or ("regression" in wanted and target is None):
            from kvshare.serve.launcher import Cluster, UpConfig

            cluster = stack.enter_context(Cluster(UpConfig.from_args(shlex.split(args.up or ""))))
            target = cluster.url
            pool = pool or _Pool(cluster.pool_address, cluster.stop_pool, cluster.start_pool)
        if pool is None and any(c != "regression" for c in wanted):
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvs-validate-"))
            process = PoolProcess(PoolProcessConfig(
                size_bytes=parse_size(args.pool_size), socket_path=f"{folder}/pool.sock",
                arena_path=f"{SHM_DIR}/kvshare-validate-{uuid.uuid4().hex[:12]}.arena",
                slab_bytes=min(parse_size(args.pool_size), 256 << 20)))
            stack.enter_context(process)
            pool = _Pool(process.address, process.stop, process.start)
        yield pool, target


def _run_check(name: str, args: argparse.Namespace, pool: _Pool | None, target: str | None) -> list:
    import torch

    from kvshare.validate.bytes_check import BytesCheckConfig, run_bytes_check, summarize
    from kvshare.validate.corruption import run_corruption_check
    from kvshare.validate.faults import (
        run_killed_writer_check,
        run_lease_loss_check,
        run_restart_check,
    )
    from kvshare.validate.pool_fill import run_pool_fill_check
    from kvshare.validate.regression import run_regression_check
    from kvshare.validate.result import CheckResult

    cuda = args.device.startswith("cuda")
    shape = args.shape or ("gemma3-27b" if cuda else "tiny-gemma3")
    dtype = torch.bfloat16 if cuda else torch.float32
    assert pool is not None or name == "regression"
    if name == "bytes":
        config = BytesCheckConfig(pool=pool.address, shape=shape, device=args.device, trials=args.trials,
                                  num_chunks=args.num_chunks, break_order=args.unsafe_break_stream_order)
        summary = summarize(run_bytes_check(config))
        result = CheckResult("bytes", counts=summary)
        result.expect(summary["failed_trials"] == 0, f"{summary['failed_trials']} of {summary['trials']} trials failed")
        return [result]
    if name == "corruption":
        return [run_corruption_check(pool.address, shape=shape, device=args.device, dtype=dtype,
                                     verify=not args.unsafe_skip_checksums)]
    if name == "pool-fill":
        return [run_pool_fill_check(pool.address)]
    if name == "faults":
        results = [run_killed_writer_check(pool.address)]
        if pool.stop is None or pool.start is None:
            for check in ("faults.daemon_restart", "faults.lease_loss"):
                results.append(CheckResult(check, skipped="the pool was not started by this run"))
        else:
            results.append(run_restart_check(pool.address, pool.stop, pool.start, device=args.device,
                                             dtype=dtype))
            results.append(run_lease_loss_check(pool.address, pool.stop, pool.start, device=args.device,
                                                keep_lost_lease_restores=args.unsafe_keep_lost_lease_restores))
        return results
    return [run_regression_check(target)] if target else [CheckResult("regression", skipped="no router")]


def _validate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvshare.validate.result import CheckResult

    wanted = list(CHECKS) if "all" in args.checks else [c for c in CHECKS if c in args.checks]
    wanted += [c for c in args.checks if c not in CHECKS and c != "all"]
    unknown = [c for c in wanted if c not in CHECKS]
    console = Console()
    if unknown:
        console.print(f"[red]unknown check(s): {', '.join(unknown)}[/red]; choose from {', '.join(CHECKS)}")
        return 2
    results, seconds = [], {}
    with _environment(args, wanted) as (pool, target):
        for name in wanted:
            start = time.monotonic()
            with console.status(f"validate {name} ..."):
                try:
                    outcome = _run_check(name, args, pool, target)
                except Exception as exc:  # a check that cannot run is a failed check, not a crash
                    failed = CheckResult(name)
                    failed.fail(f"{type(exc).__name__}: {exc}")
                    outcome = [failed]
                for result in outcome:
                    results.append(result)
                    seconds[result.name] = time.monotonic() - start
    table = Table(title="kvshare validate")
    for column in ("check", "status", "counts", "seconds"):
        table.add_column(column)
    for r in results:
        status = r.as_dict()["status"]
        color = {"passed": "green", "failed": "red", "skipped": "yellow"}[status]
        counts = ", ".join(f"{k}={v}" for k, v in r.counts.items())
        table.add_row(r.name, f"[{color}]{status}[/{color}]", counts or r.skipped, f"{seconds[r.name]:.1f}")
    console.print(table)
    for r in results:
        for failure in r.failures:
            console.print(f"[red]{r.name}:[/red] {failure}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "checks": [r.as_dict() for r in results],
                       "seconds": seconds}, f, indent=1)
    failed = [r for r in results if not r.passed]
    return 1 if failed else 0
