"""`kvshare bench cross-host`: what a hit from another host's pool costs, on this machine.

Two hosts as in `kvshare validate cross-host` (two pool daemons, each its own process and
Mooncake client, a master on loopback). Per prompt length: replica A (host A) prefills;
then the same prompt's first token on
- replica B on host B: restored from the remote tier (Mooncake get + verify + local commit),
- a second replica on host A: restored from host A's own pool,
- a replica without any pool: computed.
Then the remote tier's throughput per page size: pages committed on host A, published, and
fetched by one lookup on host B (its daemon's copy and verify seconds reported apart),
beside a raw loopback TCP socket between two processes in the same run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import socket
import time
from datetime import datetime, timezone
from typing import Any

import numpy as np

from kvshare.engine.sampling_params import SamplingParams
from kvshare.kvpool.client import PoolClient
from kvshare.kvpool.layout import LAYOUT_VERSION, checksum_constants, payload_checksum
from kvshare.kvpool.mooncake_master import mooncake_missing
from kvshare.kvpool.page import HEADER_BYTES, PageHeader
from kvshare.validate.cross_host import CrossHostConfig, TwoHosts, prompt_tokens

_FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)
_MIB = 1 << 20


def register(workloads: argparse._SubParsersAction) -> None:
    parser = workloads.add_parser(
        "cross-host",
        help="a prefix hit from another host's pool (Mooncake) vs a local hit vs compute",
    )
    parser.add_argument("--model", default="shape:tiny-llama", help="model of the replicas")
    parser.add_argument(
        "--lengths", default="1024,4096", help="prompt tokens, comma-separated (default 1024,4096)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="prompts per length")
    parser.add_argument(
        "--page-mib",
        default="0.25,1,4,16",
        help="page sizes (MiB) of the throughput measurement (default 0.25,1,4,16)",
    )
    parser.add_argument(
        "--fetch-mib", type=int, default=64, help="MiB fetched per page size (default 64)"
    )
    parser.add_argument("--json", default=None, help="write the results here")
    parser.set_defaults(func=run_cross_host_command)


def run_cross_host_command(args: argparse.Namespace) -> int:
    if why := mooncake_missing():
        print(f"kvshare bench cross-host: {why}")
        return 2
    lengths = [int(x) for x in args.lengths.split(",")]
    pages = [int(float(x) * _MIB) // 8 * 8 for x in args.page_mib.split(",")]
    results = run_cross_host_bench(args.model, lengths, args.repeats, pages, args.fetch_mib * _MIB)
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def run_cross_host_bench(
    model: str, lengths: list[int], repeats: int, page_sizes: list[int], fetch_bytes: int
) -> dict[str, Any]:
    biggest = max(page_sizes) + HEADER_BYTES
    pool = max(2 * fetch_bytes, 64 * _MIB)
    config = CrossHostConfig(
        model=model,
        pool_bytes=pool,
        slab_bytes=max(16 * _MIB, -(-biggest // _MIB) * _MIB),
        segment_bytes=2 * pool,
        fetch_timeout_s=30.0,  # measure the whole fetch, however long it takes here
    )
    with TwoHosts(config) as hosts:
        hits = _first_tokens(hosts, lengths, repeats)
        fetches = [
            _fetch(hosts, size, max(1, fetch_bytes // size), i) for i, size in enumerate(page_sizes)
        ]
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()}, {multiprocessing.cpu_count()} CPUs",
        "model": model,
        "first_token": hits,
        "fetch": fetches,
        "raw_loopback_socket_gbps": round(_socket_gbps(fetch_bytes), 3),
    }


def _first_tokens(hosts: TwoHosts, lengths: list[int], repeats: int) -> list[dict[str, Any]]:
    on_a, on_b, local, alone = (hosts.replica(h) for h in (0, 1, 0, None))
    rows = []
    for length in lengths:
        for repeat in range(repeats):
            tokens = prompt_tokens(1000 * length + repeat, length)
            published = hosts.stats(0)["remote"]["published_pages"]
            on_a.generate([tokens], _FIRST_TOKEN)
            on_a.engine.connector.wait_idle()  # its stores committed
            chunks = (length - 1) // hosts.config.chunk_tokens
            hosts.wait_for(0, "published_pages", published + chunks)
            row: dict[str, Any] = {"prompt_tokens": length}
            for name, llm in (("remote", on_b), ("local_pool", local), ("computed", alone)):
                started = time.perf_counter()
                out = llm.generate([tokens], _FIRST_TOKEN)[0]
                row[f"{name}_s"] = round(time.perf_counter() - started, 4)
                row[f"{name}_pool_hit_tokens"] = out.pool_hit_tokens
                row[f"{name}_remote_hit_tokens"] = out.pool_remote_hit_tokens
            rows.append(row)
    return rows


def _fetch(hosts: TwoHosts, payload: int, count: int, salt: int) -> dict[str, Any]:
    """Commit `count` pages of `payload` bytes on host A, wait until published, fetch them all
    with one lookup on host B."""
    keys = [(salt << 64 | i + 1).to_bytes(16, "big") for i in range(count)]
    writer = PoolClient(hosts.pools[0].address)
    published = hosts.stats(0)["remote"]["published_pages"]
    reservation = writer.reserve(keys, payload)
    checksums, parent = [], bytes(16)
    data = np.random.default_rng(salt).bytes(payload)
    for page in reservation.pages:
        checksum = payload_checksum(np.frombuffer(data, "<u8"), checksum_constants(page.key))
        header = PageHeader(
            LAYOUT_VERSION, page.key, parent, payload, checksum.astype("<u8").tobytes()
        )
        writer.arena.view(page.offset, HEADER_BYTES)[:] = header.pack()
        writer.arena.view(page.offset + HEADER_BYTES, payload)[:] = data
        checksums.append(header.checksum)
        parent = page.key
    writer.commit(keys, checksums, [p.offset for p in reservation.pages])
    writer.close()
    hosts.wait_for(0, "published_pages", published + count)
    reader = PoolClient(hosts.pools[1].address, timeout=60.0)
    before = hosts.stats(1)["remote"]
    started = time.perf_counter()
    result = reader.lookup(keys, page={"payload_bytes": payload, "segment_ends": [payload]})
    seconds = time.perf_counter() - started
    reader.release(result.lease)
    reader.close()
    after = hosts.stats(1)["remote"]
    moved = count * (HEADER_BYTES + payload)
    copy_seconds = after["fetch_copy_seconds"] - before["fetch_copy_seconds"]
    verify_seconds = after["fetch_verify_seconds"] - before["fetch_verify_seconds"]
    return {
        "page_bytes": HEADER_BYTES + payload,
        "pages": count,
        "fetched_pages": result.remote_pages,
        "lookup_s": round(seconds, 4),
        "copy_s": round(copy_seconds, 4),
        "verify_s": round(verify_seconds, 4),
        "copy_gbps": round(moved / copy_seconds / 1e9, 3) if copy_seconds else None,
        "lookup_gbps": round(moved / seconds / 1e9, 3),
    }


def _socket_gbps(nbytes: int) -> float:
    """Bytes per second through a loopback TCP connection to a child process."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    child = multiprocessing.get_context("spawn").Process(target=_send, args=(port, nbytes))
    child.start()
    connection, _ = listener.accept()
    buffer = bytearray(_MIB)
    received = 0
    started = time.perf_counter()
    while received < nbytes:
        got = connection.recv_into(buffer)
        if not got:
            break
        received += got
    seconds = time.perf_counter() - started
    connection.close()
    listener.close()
    child.join(30)
    return received / seconds / 1e9


def _send(port: int, nbytes: int) -> None:
    chunk = bytes(_MIB)
    with socket.create_connection(("127.0.0.1", port)) as sender:
        for _ in range(nbytes // _MIB):
            sender.sendall(chunk)
