"""Measure the pool daemon: lookup round-trip latency and lookup throughput.

    python -m kvshare.bench.pool_daemon [--keys 1024] [--clients 1 2 4] [--seconds 2]

Starts a private daemon, commits `--keys` chunk keys, then (1) times single lookups of
all of them from one client (the release after each is not timed), and (2) runs N
client processes that loop lookup + release for `--seconds`, for each N in `--clients`.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

from kvshare.kvpool.client import PoolClient
from kvshare.kvpool.launch import PoolProcess, PoolProcessConfig
from kvshare.kvpool.paths import SHM_DIR

PAYLOAD_BYTES = 4096


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvshare.bench.pool_daemon")
    parser.add_argument("--keys", type=int, default=1024, help="keys per lookup")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2], help="client counts")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per throughput run")
    parser.add_argument("--latency-samples", type=int, default=500)
    args = parser.parse_args(argv)

    keys = [i.to_bytes(16, "little") for i in range(args.keys)]
    shm = SHM_DIR if os.path.isdir(SHM_DIR) else None
    with tempfile.TemporaryDirectory(dir=shm) as folder:
        config = PoolProcessConfig(
            size_bytes=64 * 1024 * 1024 + args.keys * 2 * PAYLOAD_BYTES,
            socket_path=os.path.join(folder, "pool.sock"),
            arena_path=os.path.join(folder, "pool.arena"),
            slab_bytes=64 * 1024 * 1024,
        )
        with PoolProcess(config) as pool:
            client = PoolClient(pool.address)
            reservation = client.reserve(keys, PAYLOAD_BYTES)
            client.commit([page.key for page in reservation.pages], [b""] * len(reservation.pages))
            median, p99 = _lookup_latency(client, keys, args.latency_samples)
            print(
                f"lookup of {args.keys} keys, one round trip: median {median * 1e3:.3f} ms, "
                f"p99 {p99 * 1e3:.3f} ms"
            )
            client.close()
            for clients in args.clients:
                lookups = _lookup_throughput(pool.address, keys, clients, args.seconds)
                rate = lookups / args.seconds
                print(
                    f"{clients} client(s): {rate:,.0f} lookups/s (lookup + release), "
                    f"{rate * args.keys:,.0f} keys/s"
                )
    return 0


def _lookup_latency(client: PoolClient, keys: list[bytes], samples: int) -> tuple[float, float]:
    times: list[float] = []
    for _ in range(samples):
        start = time.perf_counter()
        result = client.lookup(keys)
        times.append(time.perf_counter() - start)
        if len(result.pages) != len(keys):
            raise RuntimeError(f"lookup hit {len(result.pages)} of {len(keys)} keys")
        client.release(result.lease)
    times.sort()
    return statistics.median(times), times[int(0.99 * (len(times) - 1))]


def _lookup_throughput(address: str, keys: list[bytes], clients: int, seconds: float) -> int:
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(clients, mp_context=context) as executor:
        start_at = time.time() + 1.0  # every worker starts together, after spawning
        futures = [
            executor.submit(_lookup_loop, address, keys, start_at, seconds) for _ in range(clients)
        ]
        return sum(future.result() for future in futures)


def _lookup_loop(address: str, keys: list[bytes], start_at: float, seconds: float) -> int:
    client = PoolClient(address)
    client.connect()
    time.sleep(max(0.0, start_at - time.time()))
    deadline = time.perf_counter() + seconds
    lookups = 0
    while time.perf_counter() < deadline:
        client.release(client.lookup(keys).lease)
        lookups += 1
    client.close()
    return lookups


if __name__ == "__main__":
    raise SystemExit(main())
