"""`kvshare bench WORKLOAD` (blocked OFF/ON benchmark of a cluster) and `kvshare demo`."""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from kvshare.bench.design import DEFAULT_DESIGN, Design

if TYPE_CHECKING:
    from collections.abc import Iterator

    from kvshare.bench.records import BenchRun
    from kvshare.bench.runner import Workload


DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32)  # kvshare bench concurrency


def _design(text: str) -> Design:
    try:
        return Design.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"expected integers joined by ',', got {text!r}"
        ) from error


def _size_list(text: str) -> tuple[int, ...]:
    from kvshare.sizes import parse_size

    try:
        return tuple(parse_size(part) for part in text.split(","))
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"expected sizes joined by ',' (e.g. 64MiB,256MiB), got {text!r}"
        ) from error


def _common(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--target", metavar="URL", help="router URL of a running cluster")
    target.add_argument(
        "--up",
        metavar="ARGS",
        help="start a cluster with these `kvshare up` arguments and benchmark it "
        '(--up="" for the default; write --up="--flag" when ARGS starts with -)',
    )
    parser.add_argument(
        "--model",
        help="model spec whose tokenizer builds the prompts "
        "(default: the model id the server lists)",
    )
    parser.add_argument(
        "--design",
        type=_design,
        default=Design.parse(DEFAULT_DESIGN),
        help=f"blocks in order, OFF or ON joined by '-' (default {DEFAULT_DESIGN})",
    )
    parser.add_argument("--seed", type=int, default=0, help="prompts, request order and bootstrap")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    parser.add_argument(
        "--settle-timeout",
        type=float,
        default=10.0,
        help="longest wait, before a follow-up, for the pool's stores to commit",
    )
    parser.add_argument(
        "--warmup-tokens",
        type=int,
        default=1024,
        help="before block 0, one request of this many tokens per replica and, when the "
        "design switches the pool on, the same prompt restored on the next replica; reported "
        "apart and never pooled: they take the one-time costs (kernel compilation, a first "
        "restore) out of the blocks (0: none)",
    )
    parser.add_argument("--json", type=Path, help="write every request's timings and usage here")
    parser.add_argument("--markdown", type=Path, help="write a Markdown summary here")
    parser.add_argument("--plot", type=Path, help="write a PNG plot here")
    parser.set_defaults(func=run_bench_command)


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="benchmark a cluster with the KV pool off and on (blocked design)",
        description="Run a workload in blocks (default OFF-ON-ON-OFF). At each block start the "
        "pool is switched on or off on every replica and cleared, and every GPU-local "
        "prefix cache is reset.",
    )
    workloads = bench.add_subparsers(dest="workload", required=True, metavar="WORKLOAD")

    cross = workloads.add_parser(
        "cross-replica", help="prefill on replica 0, measure the follow-up on 1"
    )
    _common(cross)
    cross.add_argument(
        "--lengths", type=_int_list, default=(1024, 2048, 4096), help="context tokens"
    )
    cross.add_argument("--requests-per-block", type=int, default=8, help="follow-ups per length")
    cross.add_argument(
        "--question-tokens", type=int, default=32, help="tokens of each follow-up question"
    )
    cross.add_argument("--output-tokens", type=int, default=8, help="tokens each request generates")
    cross.add_argument(
        "--replica-a", type=int, default=0, help="replica A, which prefills the context"
    )
    cross.add_argument(
        "--replica-b",
        type=int,
        default=1,
        help="replica B, which is measured (may equal A: caches are reset between)",
    )
    cross.add_argument(
        "--shared-context",
        action="store_true",
        help="one context per length per block, prefilled once; each follow-up asks its own question",
    )
    cross.set_defaults(make_workload=_cross_replica)

    sessions = workloads.add_parser(
        "sessions", help="multi-turn sessions that resend their history"
    )
    _common(sessions)
    sessions.add_argument("--sessions", type=int, default=4, help="per placement per block")
    sessions.add_argument("--turns", type=int, default=6, help="turns per session")
    sessions.add_argument(
        "--context", type=int, default=4096, help="tokens of the first turn's document"
    )
    sessions.add_argument(
        "--question-tokens", type=int, default=32, help="tokens of each turn's question"
    )
    sessions.add_argument(
        "--output-tokens", type=int, default=32, help="tokens each turn generates"
    )
    sessions.add_argument(
        "--placement",
        choices=("alternate", "fixed", "both"),
        default="both",
        help="turns alternate between replicas, stay on one, or both kinds of session",
    )
    sessions.set_defaults(make_workload=_sessions)

    shared = workloads.add_parser(
        "shared-prefix", help="concurrent users over a few shared documents"
    )
    _common(shared)
    _shared_prefix_arguments(shared)
    shared.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    shared.set_defaults(make_workload=_shared_prefix)

    sweep = workloads.add_parser(
        "concurrency",
        help="shared-prefix swept over concurrency and pool size, each point a blocked run",
        description="Run shared-prefix at each concurrency (and, with --up, on a cluster per "
        "pool size), each point a whole blocked OFF/ON run; report p50/p99 TTFT, throughput, "
        "computed/ideal and the pool hit rate per point and condition (table, JSON, PNG).",
    )
    _common(sweep)
    _shared_prefix_arguments(sweep)
    sweep.add_argument(
        "--concurrency",
        type=_int_list,
        default=DEFAULT_CONCURRENCY,
        help="requests in flight at once, one point each "
        f"(default {','.join(map(str, DEFAULT_CONCURRENCY))})",
    )
    sweep.add_argument(
        "--pool-sizes",
        type=_size_list,
        help="with --up: one cluster per pool size (e.g. 256MiB,1GiB; below the working set "
        "to measure eviction); default: the --up pool",
    )
    sweep.set_defaults(func=run_sweep_command)
    from kvshare.bench.cross_host import register as register_cross_host

    register_cross_host(workloads)

    demo = subparsers.add_parser(
        "demo", help="start the default cluster and show what the shared pool does (minutes, CPU)"
    )
    demo.add_argument(
        "--out", type=Path, default=Path("kvshare-demo"), help="folder for the results"
    )
    demo.add_argument(
        "--up", metavar="ARGS", default="", help="`kvshare up` arguments (default: none)"
    )
    demo.add_argument("--seed", type=int, default=0, help="prompts and request order")
    demo.set_defaults(func=run_demo_command)


def _shared_prefix_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--documents", type=int, default=4, help="shared documents per block")
    parser.add_argument("--users", type=int, default=64, help="questions per block, one per user")
    parser.add_argument("--doc-tokens", type=int, default=4096, help="tokens per document")
    parser.add_argument("--question-tokens", type=int, default=32, help="tokens of each question")
    parser.add_argument(
        "--output-tokens", type=int, default=16, help="tokens each answer generates"
    )


def _cross_replica(args: argparse.Namespace) -> Workload:
    from kvshare.bench.cross_replica import CrossReplica

    return CrossReplica(
        args.lengths,
        args.requests_per_block,
        args.question_tokens,
        args.output_tokens,
        args.replica_a,
        args.replica_b,
        args.shared_context,
    )


def _sessions(args: argparse.Namespace) -> Workload:
    from kvshare.bench.sessions import PLACEMENTS, Sessions

    placements = PLACEMENTS if args.placement == "both" else (args.placement,)
    return Sessions(
        args.sessions,
        args.context,
        args.turns,
        args.question_tokens,
        args.output_tokens,
        placements,
    )


def _shared_prefix(args: argparse.Namespace) -> Workload:
    from kvshare.bench.shared_prefix import SharedPrefix

    return SharedPrefix(
        args.documents,
        args.users,
        args.concurrency,
        args.doc_tokens,
        args.question_tokens,
        args.output_tokens,
    )


def run_bench_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from kvshare.bench.cluster import cluster_target, up_config
    from kvshare.bench.driver import BENCH_ERRORS, BenchOptions, Outputs, report, run_with_progress
    from kvshare.bench.stats import BootstrapSpec
    from kvshare.preflight import check_up

    console = Console()
    # The cluster's output is kept only when the run fails, where the error message points to it.
    log_dir = Path(tempfile.mkdtemp(prefix="kvshare-bench-")) if args.up is not None else None
    log = (log_dir or Path(tempfile.gettempdir())) / "up.log"
    try:
        workload = args.make_workload(args)
        spec = BootstrapSpec(args.resamples, seed=args.seed)
        command = shlex.join(["kvshare", *sys.argv[1:]])
        if args.up is not None:
            check_up(up_config(args.up))  # before announcing a cluster that cannot start
            console.print(
                f"starting the cluster (kvshare up {escape(args.up)}); its output goes to {log}",
                soft_wrap=True,
            )
        with cluster_target(args.target, args.up, log) as target:
            options = BenchOptions(
                args.design,
                args.seed,
                spec,
                args.model or target.model,
                args.timeout,
                command,
                args.settle_timeout,
                args.warmup_tokens,
            )
            run = run_with_progress(workload, target.url, options, console)
        report(run, options, Outputs(args.json, args.markdown, args.plot), console)
    except BENCH_ERRORS as error:
        console.print(
            f"[red]kvshare bench:[/red] {escape(str(error))}" + _log_note(log_dir, log),
            soft_wrap=True,
        )
        return 2 if isinstance(error, ValueError) else 1
    except RuntimeError as error:  # the cluster did not start (kvshare.serve.launcher)
        console.print(
            f"[red]kvshare bench:[/red] {escape(str(error))}" + _log_note(log_dir, log),
            soft_wrap=True,
        )
        return 1
    if log_dir is not None:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def run_sweep_command(args: argparse.Namespace) -> int:
    from contextlib import contextmanager

    from rich.console import Console
    from rich.markup import escape

    from kvshare.bench.cluster import cluster_target, up_config
    from kvshare.bench.driver import (
        BENCH_ERRORS,
        BenchOptions,
        Outputs,
        report_sweep,
        run_with_progress,
    )
    from kvshare.bench.shared_prefix import SharedPrefix
    from kvshare.bench.stats import BootstrapSpec
    from kvshare.bench.sweep import run_sweep, write_sweep_json
    from kvshare.preflight import check_up

    console = Console()
    log_dir = Path(tempfile.mkdtemp(prefix="kvshare-bench-")) if args.up is not None else None
    log = (log_dir or Path(tempfile.gettempdir())) / "up.log"
    command = shlex.join(["kvshare", *sys.argv[1:]])
    spec = BootstrapSpec(args.resamples, seed=args.seed)
    model: list[str | None] = [args.model]

    def up_args(pool_size: int | None) -> str | None:
        if args.up is None or pool_size is None:
            return args.up
        return f"{args.up} --pool-size {pool_size}"  # the last --pool-size wins

    @contextmanager
    def open_cluster(pool_size: int | None) -> Iterator[str]:
        up = up_args(pool_size)
        if up is not None:
            check_up(up_config(up))
            console.print(
                f"starting the cluster (kvshare up {escape(up)}); its output goes to {log}",
                soft_wrap=True,
            )
        with cluster_target(args.target, up, log) as target:
            model[0] = model[0] or target.model
            yield target.url

    def run_point(workload: SharedPrefix, url: str, warm_up: bool) -> BenchRun:
        options = BenchOptions(
            args.design,
            args.seed,
            spec,
            model[0],
            args.timeout,
            command,
            args.settle_timeout,
            args.warmup_tokens if warm_up else 0,
        )
        return run_with_progress(workload, url, options, console)

    try:
        if args.pool_sizes and args.up is None:
            raise ValueError("--pool-sizes needs --up: the bench cannot resize a running pool")
        # With --up the pool size is always known: the --up one when no --pool-sizes.
        pool_sizes = args.pool_sizes or (
            (up_config(args.up).pool_size,) if args.up is not None else (None,)
        )
        workload = SharedPrefix(  # each point replaces the concurrency
            args.documents,
            args.users,
            args.concurrency[0],
            args.doc_tokens,
            args.question_tokens,
            args.output_tokens,
        )
        # The JSON is rewritten after each point: a sweep stopped midway keeps its points.
        sweep = run_sweep(
            workload,
            args.concurrency,
            pool_sizes,
            open_cluster,
            run_point,
            (lambda partial: write_sweep_json(args.json, partial, spec)) if args.json else None,
        )
        report_sweep(sweep, spec, command, Outputs(args.json, args.markdown, args.plot), console)
    except (*BENCH_ERRORS, RuntimeError) as error:  # RuntimeError: a cluster did not start
        console.print(
            f"[red]kvshare bench:[/red] {escape(str(error))}" + _log_note(log_dir, log),
            soft_wrap=True,
        )
        return 2 if isinstance(error, ValueError) else 1
    if log_dir is not None:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def _log_note(log_dir: Path | None, log: Path) -> str:
    """Where the failed run's cluster output is kept (none: the cluster never started)."""
    if log_dir is None:
        return ""
    if log.exists():
        return f"\n(cluster output kept in {log})"
    shutil.rmtree(log_dir, ignore_errors=True)
    return ""


def run_demo_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvshare.bench.demo import run_demo
    from kvshare.bench.driver import BENCH_ERRORS

    console = Console()
    try:
        run_demo(args.out, args.up, args.seed, console)
    except (*BENCH_ERRORS, RuntimeError) as error:  # RuntimeError: the cluster did not start
        console.print(f"[red]kvshare demo:[/red] {error}")
        return 1
    return 0
