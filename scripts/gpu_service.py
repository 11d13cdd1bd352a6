"""GPU session for issues 5 and 6: `kvshare validate` on CUDA, and the 27B cross-replica bench.

python3 scripts/gpu_service.py validate --out $OUT
python3 scripts/gpu_service.py bench27b --out $OUT [--lengths 32768,130816] [--per-block 8]
python3 scripts/gpu_service.py two-replicas --out $OUT [--sessions 2] [--context 32768]
python3 scripts/gpu_service.py sessions --out $OUT [--sessions 2] [--context 32768]

`validate` runs `kvshare validate all` on CUDA against two float32 replicas of `kvshare up`;
`sessions` starts two replicas of shape:qwen3-8b on the one GPU (0.45 of its memory each)
and the pool, and runs the blocked six-turn sessions benchmark (alternate vs fixed
placement); `two-replicas` runs both.

`bench27b` starts `kvshare up` with one replica of shape:gemma3-27b (two 54 GB replicas and
a 128k-token KV cache do not fit one H200), waits until the pool arena is registered with
CUDA, measures the raw pinned host->GPU memcpy in the same run, and runs the blocked
OFF-ON-ON-OFF cross-replica benchmark with A = B = replica 0 (GPU-local caches reset
between prefill and follow-up, so only the pool can help).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def kvshare(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvshare", *args]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def validate(out: Path) -> int:
    """`kvshare validate all` on CUDA against two float32 gemma3-1b replicas of `kvshare up`
    (pages of 13.6 MiB; the bytes and corruption checks use the gemma3-27b page layout,
    124 MiB). Token-identical answers need float32: in bf16 a near-tied greedy token flips
    with the batch shape of the recomputed suffix even when the restored bytes are exact."""
    up = (
        "--replicas 2 --model shape:gemma3-1b --dtype float32 --device cuda --gpu-memory-fraction 0.3 "
        "--pool-size 8GiB --pool-preallocate"
    )
    done = subprocess.run(
        kvshare(
            "validate",
            "all",
            "--device",
            "cuda",
            "--up",
            up,
            "--trials",
            "10",
            "--json",
            str(out / "validate_all_cuda.json"),
        ),
        env=env(),
        cwd=REPO,
        timeout=540,
    )
    return done.returncode


def wait_registered(url: str, timeout: float) -> float:
    """Seconds until the replica's pool connector has registered the whole arena."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            stats = httpx.get(f"{url}/admin/stats", timeout=10).json()
            pool = stats.get("pool") or {}
            registered = (stats.get("kv_pool") or {}).get("registered_bytes", 0)
            if pool and registered >= pool["slab_count"] * pool["slab_bytes"]:
                return time.monotonic() - start
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(1)
    raise TimeoutError("the pool arena was not registered in time")


def start_cluster(out: Path, port: int, *up_args: str) -> subprocess.Popen:
    """`kvshare up` on `port` with its log in out/cluster-PORT.log; returns once the router answers
    and every replica has registered the whole pool arena with CUDA."""
    log = (out / f"cluster-{port}.log").open("w")
    up = subprocess.Popen(
        kvshare("up", "--device", "cuda", "--pool-preallocate", "--port", str(port), *up_args),
        env=env(),
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    while time.monotonic() - start < 300:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if up.poll() is not None:
            raise RuntimeError("kvshare up exited")
        time.sleep(1)
    print(f"cluster ready in {time.monotonic() - start:.0f} s", flush=True)
    for replica in httpx.get(f"{url}/admin/replicas", timeout=10).json():
        print(
            f"arena registered after {wait_registered(replica['url'], 240):.0f} s more", flush=True
        )
    return up


def stop_cluster(up: subprocess.Popen) -> None:
    os.killpg(up.pid, signal.SIGINT)
    up.wait(timeout=60)


def bench27b(out: Path, lengths: str, per_block: int, pool_size: str) -> int:
    deadline = time.monotonic() + 570  # the device call's limit is 600 s
    import torch

    from kvshare.bench.ceilings import pcie_bandwidth

    ceiling = pcie_bandwidth()
    torch.cuda.empty_cache()
    (out / "ceiling.json").write_text(json.dumps(ceiling))
    print("ceiling", ceiling, flush=True)
    max_len = max(int(x) for x in lengths.split(",")) + 256
    up = start_cluster(
        out,
        8180,
        "--replicas",
        "1",
        "--model",
        "shape:gemma3-27b",
        "--gpu-memory-fraction",
        "0.96",
        "--max-num-batched-tokens",
        "16384",
        "--max-num-seqs",
        "8",
        "--max-model-len",
        str(min(max_len, 131072)),
        "--pool-size",
        pool_size,
    )
    failed = 0
    try:
        for length in lengths.split(
            ","
        ):  # one run per length: a late timeout keeps earlier results
            name = f"bench27b_{length}"
            try:
                done = subprocess.run(
                    kvshare(
                        "bench",
                        "cross-replica",
                        "--target",
                        "http://127.0.0.1:8180",
                        "--lengths",
                        length,
                        "--requests-per-block",
                        str(per_block),
                        "--replica-a",
                        "0",
                        "--replica-b",
                        "0",
                        "--shared-context",
                        "--question-tokens",
                        "32",
                        "--output-tokens",
                        "8",
                        "--settle-timeout",
                        "30",
                        "--json",
                        str(out / f"{name}.json"),
                        "--markdown",
                        str(out / f"{name}.md"),
                        "--plot",
                        str(out / f"{name}.png"),
                    ),
                    env=env(),
                    cwd=REPO,
                    timeout=max(1.0, deadline - time.monotonic()),
                )
                failed += done.returncode != 0
            except subprocess.TimeoutExpired:
                print(f"{name}: out of time", flush=True)
                failed += 1
        return failed
    finally:
        stop_cluster(up)


def two_replicas(out: Path, sessions: int, context: int, pool_size: str) -> int:
    return validate(out) or sessions_bench(out, sessions, context, pool_size)


def sessions_bench(out: Path, sessions: int, context: int, pool_size: str) -> int:
    """The blocked six-turn sessions bench on two qwen3-8b replicas sharing the GPU."""
    up = start_cluster(
        out,
        8280,
        "--replicas",
        "2",
        "--model",
        "shape:qwen3-8b",
        "--gpu-memory-fraction",
        "0.45",
        "--max-num-batched-tokens",
        "16384",
        "--max-num-seqs",
        "16",
        "--max-model-len",
        str(context + 8192),
        "--pool-size",
        pool_size,
    )
    try:
        benched = subprocess.run(
            kvshare(
                "bench",
                "sessions",
                "--target",
                "http://127.0.0.1:8280",
                "--sessions",
                str(sessions),
                "--turns",
                "6",
                "--context",
                str(context),
                "--question-tokens",
                "64",
                "--output-tokens",
                "32",
                "--placement",
                "both",
                "--settle-timeout",
                "30",
                "--json",
                str(out / "sessions.json"),
                "--markdown",
                str(out / "sessions.md"),
                "--plot",
                str(out / "sessions.png"),
            ),
            env=env(),
            cwd=REPO,
            timeout=400,
        )
    finally:
        stop_cluster(up)
    return benched.returncode


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("validate", "bench27b", "two-replicas", "sessions"))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--lengths", default="32768,130816")
    parser.add_argument("--per-block", type=int, default=8)
    parser.add_argument("--pool-size", default="88GiB")
    parser.add_argument(
        "--sessions", type=int, default=2, help="two-replicas: per placement per block"
    )
    parser.add_argument(
        "--context", type=int, default=32768, help="two-replicas: first turn's tokens"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "validate":
        return validate(args.out)
    if args.what == "two-replicas":
        return two_replicas(args.out, args.sessions, args.context, args.pool_size)
    if args.what == "sessions":
        return sessions_bench(args.out, args.sessions, args.context, args.pool_size)
    return bench27b(args.out, args.lengths, args.per_block, args.pool_size)


if __name__ == "__main__":
    sys.exit(main())
