"""`kvshare pool` (run the daemon) and `kvshare pool-stats` (show its counters).

Also runnable alone, without the other subcommands: `python -m kvshare.kvpool.cli pool ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from kvshare.sizes import format_size, parse_size

if TYPE_CHECKING:
    from kvshare.kvpool.remote import RemoteConfig

READY_PREFIX = "kvshare pool ready:"

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def register(subparsers: argparse._SubParsersAction) -> None:
    pool = subparsers.add_parser(
        "pool",
        help="run the shared KV pool daemon",
        description="Create the shared arena and serve the pool index on a Unix socket "
        "until SIGINT/SIGTERM; both are removed at exit. The address is printed and "
        "published in the per-user runtime folder, where clients given none find it.",
    )
    pool.add_argument("--size", help="arena size, e.g. 4GiB, 512MiB, 10GB (required to serve)")
    pool.add_argument("--socket", help="socket path (default: per-user runtime folder)")
    pool.add_argument("--arena", help="arena file (default: /dev/shm/kvshare-<uid>-<random>.arena)")
    pool.add_argument("--slab-size", default="1GiB", help="slab size (default: 1GiB)")
    pool.add_argument(
        "--preallocate",
        action="store_true",
        help="allocate the whole arena at start (reserves the memory; faster CUDA registration)",
    )
    pool.add_argument(
        "--max-client-fraction",
        type=float,
        default=0.5,
        help="share of the pool one client may hold reserved or pinned (default: 0.5)",
    )
    pool.add_argument(
        "--max-clients",
        type=int,
        default=64,
        help="connections served at once; more are refused (default: 64)",
    )
    pool.add_argument(
        "--runtime-dir",
        help="per-user folder for the published address and dead daemons' "
        "leftovers (default: $XDG_RUNTIME_DIR/kvshare or /tmp/kvshare-<uid>)",
    )
    pool.add_argument(
        "--no-runtime-dir",
        action="store_true",
        help="neither publish the address nor clean the runtime folder",
    )
    pool.add_argument(
        "--cleanup",
        action="store_true",
        help="remove the socket, arena and lock file of dead daemons (in the "
        "runtime folder, or --socket's) and exit; live daemons are left alone",
    )
    pool.add_argument(
        "--log-level", default="INFO", choices=_LOG_LEVELS, help="daemon log verbosity"
    )
    add_remote_arguments(pool)
    pool.set_defaults(func=run_pool)

    stats = subparsers.add_parser("pool-stats", help="show the pool daemon's counters")
    stats.add_argument(
        "--socket",
        help="socket path (default: the address the running daemon "
        "published in the per-user runtime folder)",
    )
    stats.add_argument("--json", action="store_true", help="print JSON instead of tables")
    stats.set_defaults(func=show_stats)


def add_remote_arguments(parser: argparse.ArgumentParser) -> None:
    """The remote tier's flags (`kvshare pool`, passed through by `kvshare up`)."""
    parser.add_argument(
        "--remote",
        metavar="mooncake://HOST:PORT",
        help="share pages with other hosts through Mooncake Store: its master's RPC "
        "address (needs `pip install 'kvshare[mooncake]'`; default: this host only)",
    )
    parser.add_argument(
        "--remote-local-hostname",
        help="the address other hosts reach this one at (default: this host's address "
        "on the route to the master)",
    )
    parser.add_argument(
        "--remote-segment-size",
        default="1GiB",
        help="memory this host lends to the cluster-wide store (default: 1GiB)",
    )
    parser.add_argument(
        "--remote-timeout",
        type=float,
        default=1.0,
        help="seconds a lookup waits for the remote tier before it answers from this "
        "host's pool (default: 1.0)",
    )


def remote_config(args: argparse.Namespace) -> RemoteConfig | None:
    """The remote tier's configuration from `add_remote_arguments`' flags (ValueError)."""
    from kvshare.kvpool.remote import RemoteConfig

    if args.remote is None:
        return None
    return RemoteConfig(
        url=args.remote,
        local_hostname=args.remote_local_hostname,
        segment_bytes=parse_size(args.remote_segment_size),
        fetch_timeout_s=args.remote_timeout,
    )


def run_pool(args: argparse.Namespace) -> int:
    from kvshare.kvpool.daemon import PoolConfig, PoolDaemon
    from kvshare.kvpool.paths import default_pool_paths

    defaults = default_pool_paths()
    runtime_dir = None if args.no_runtime_dir else args.runtime_dir or defaults.runtime_dir
    if args.cleanup:
        return _cleanup(args.socket, runtime_dir)
    try:
        if args.size is None:
            raise ValueError("--size is required to serve")
        config = PoolConfig(
            size_bytes=parse_size(args.size),
            slab_bytes=parse_size(args.slab_size),
            preallocate=args.preallocate,
            socket_path=args.socket
            or os.path.join(runtime_dir or defaults.runtime_dir, "pool.sock"),
            arena_path=args.arena or defaults.arena_path,
            max_client_fraction=args.max_client_fraction,
            max_clients=args.max_clients,
            runtime_dir=runtime_dir,
            remote=remote_config(args),
        )
    except ValueError as error:
        print(f"kvshare pool: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    daemon = PoolDaemon(config)

    def announce() -> None:
        geometry = daemon.index.geometry
        print(
            f"{READY_PREFIX} address=unix:{config.socket_path} "
            f"socket={config.socket_path} arena={config.arena_path} "
            f"size={format_size(config.size_bytes)} slabs={geometry.slab_count}x"
            f"{format_size(config.slab_bytes)}",
            flush=True,
        )

    try:
        asyncio.run(daemon.serve(on_ready=announce))
    except (ValueError, OSError) as error:
        print(f"kvshare pool: {error}", file=sys.stderr)
        return 1
    if daemon.remote is not None:
        # The socket and arena are gone and the store was left (or given up on): the
        # store client's destructors would hold the exit for as long as they retry a
        # master that is gone.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(0)
    return 0


def _cleanup(socket_path: str | None, runtime_dir: str | None) -> int:
    """`kvshare pool --cleanup`: remove dead daemons' files; 1 if `socket_path` is live."""
    from kvshare.kvpool.ownership import clean_folder

    folders = [os.path.dirname(os.path.abspath(socket_path))] if socket_path else []
    folders += [runtime_dir] if runtime_dir and runtime_dir not in folders else []
    status = 0
    for folder in folders:
        report = clean_folder(folder)
        for path in report.removed:
            print(f"kvshare pool: removed {path}")
        for record in report.live:
            print(
                f"kvshare pool: left alone the live daemon (pid {record.pid}) at "
                f"{record.socket_path}, arena {record.arena_path}"
            )
            if record.socket_path == socket_path:
                print(
                    f"kvshare pool: {socket_path} belongs to a live daemon (pid "
                    f"{record.pid}): refusing to clean it",
                    file=sys.stderr,
                )
                status = 1
        if not report.removed:
            print(f"kvshare pool: nothing to clean in {folder}")
    return status


def show_stats(args: argparse.Namespace) -> int:
    from kvshare.kvpool.client import PoolClient, PoolUnavailable
    from kvshare.kvpool.paths import default_pool_address

    client = PoolClient(args.socket or default_pool_address())
    try:
        stats = client.stats()
    except PoolUnavailable as error:
        print(f"kvshare pool-stats: {error}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
    else:
        _print_stats_tables(stats)
    return 0


def _print_stats_tables(stats: dict[str, Any]) -> None:
    from rich.console import Console

    from kvshare.kvpool.index import COUNTERS
    from kvshare.tables import Table, print_table

    summary = [
        ("arena", f"{stats['arena_path']} ({format_size(stats['arena_bytes'])})"),
        (
            "slabs free / total",
            f"{stats['free_slabs']} / {stats['slab_count']} x {format_size(stats['slab_bytes'])}",
        ),
    ]
    occupancy = (
        "pages",
        "free",
        "reserved",
        "committed",
        "invalid",
        "pinned",
        "leases",
        "connections",
        "refused_connections",
    )
    summary += [(name.replace("_", " "), f"{stats[name]:,}") for name in (*occupancy, *COUNTERS)]
    columns = ("slabs", "pages", "free", "reserved", "committed", "pinned")
    classes = [
        (format_size(c["slot_bytes"]), *(f"{c[name]:,}" for name in columns))
        for c in stats["classes"]
    ]
    console = Console()
    print_table(console, Table("kvshare pool", ("counter", "value"), tuple(summary)))
    print_table(console, Table("page classes", ("slot", *columns), tuple(classes)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvshare.kvpool.cli")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
