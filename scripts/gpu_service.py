"""GPU session for issues 5 and 6: `kvshare validate` on CUDA, and the 27B cross-replica bench.

python3 scripts/gpu_service.py validate --out $OUT
python3 scripts/gpu_service.py bench27b --out $OUT [--lengths 32768,130816] [--per-block 8]

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
    done = subprocess.run(kvshare("validate", "bytes", "corruption", "faults", "pool-fill",
                                  "--device", "cuda", "--trials", "10", "--pool-size", "4GiB",
                                  "--json", str(out / "validate_cuda.json")),
                          env=env(), cwd=REPO, timeout=300)
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


def bench27b(out: Path, lengths: str, per_block: int, pool_size: str) -> int:
    import torch

    from kvshare.bench.ceilings import pcie_bandwidth

    ceiling = pcie_bandwidth()
    torch.cuda.empty_cache()
    (out / "ceiling.json").write_text(json.dumps(ceiling))
    print("ceiling", ceiling, flush=True)
    max_len = max(int(x) for x in lengths.split(",")) + 256
    log = (out / "cluster.log").open("w")
    up = subprocess.Popen(
        kvshare("up", "--replicas", "1", "--model", "shape:gemma3-27b", "--device", "cuda",
                "--gpu-memory-fraction", "0.96", "--max-num-batched-tokens", "16384",
                "--max-num-seqs", "8", "--max-model-len", str(min(max_len, 131072)),
                "--pool-size", pool_size, "--pool-preallocate", "--port", "8180"),
        env=env(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        url = "http://127.0.0.1:8180"
        start = time.monotonic()
        while time.monotonic() - start < 240:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if up.poll() is not None:
                raise RuntimeError("kvshare up exited")
            time.sleep(1)
        print(f"cluster ready in {time.monotonic() - start:.0f} s", flush=True)
        print(f"arena registered after {wait_registered('http://127.0.0.1:8181', 240):.0f} s more", flush=True)
        done = subprocess.run(
            kvshare("bench", "cross-replica", "--target", url, "--lengths", lengths,
                    "--requests-per-block", str(per_block), "--replica-a", "0", "--replica-b", "0",
                    "--shared-context", "--question-tokens", "32", "--output-tokens", "8",
                    "--settle-timeout", "30", "--json", str(out / "bench27b.json"),
                    "--markdown", str(out / "bench27b.md"), "--plot", str(out / "bench27b.png")),
            env=env(), cwd=REPO, timeout=560)
        return done.returncode
    finally:
        os.killpg(up.pid, signal.SIGINT)
        up.wait(timeout=60)
        log.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("validate", "bench27b"))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--lengths", default="32768,130816")
    parser.add_argument("--per-block", type=int, default=8)
    parser.add_argument("--pool-size", default="88GiB")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "validate":
        return validate(args.out)
    return bench27b(args.out, args.lengths, args.per_block, args.pool_size)


if __name__ == "__main__":
    sys.exit(main())
