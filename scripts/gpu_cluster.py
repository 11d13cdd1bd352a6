"""What the GPU session scripts share: the `kvshare` command, its environment, and a
`kvshare up` cluster started on CUDA with its arena registered before any timing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvshare.serve.server_timing import median_phases

REPO = Path(__file__).resolve().parents[1]


def kvshare(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvshare", *args]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


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


def start_cluster(out: Path, port: int, device: str, *up_args: str) -> subprocess.Popen:
    """`kvshare up` on `port` with its log in out/cluster-PORT.log; returns once the router answers
    and, on CUDA, every replica has registered the whole pool arena."""
    log = (out / f"cluster-{port}.log").open("w")
    up = subprocess.Popen(
        kvshare("up", "--device", device, "--pool-preallocate", "--port", str(port), *up_args),
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
    if device != "cuda":
        return up
    for replica in httpx.get(f"{url}/admin/replicas", timeout=10).json():
        print(
            f"arena registered after {wait_registered(replica['url'], 240):.0f} s more", flush=True
        )
    return up


def stop_cluster(up: subprocess.Popen) -> None:
    os.killpg(up.pid, signal.SIGINT)
    up.wait(timeout=60)


def gpu_memory_by_process() -> dict[str, int]:
    """MiB of GPU memory per process id, as nvidia-smi reports it ({} without nvidia-smi:
    the CPU dry runs of the scripts)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    done = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    rows = (line.split(",") for line in done.stdout.splitlines() if line.strip())
    return {pid.strip(): int(mib) for pid, mib in rows}


# What cross_replica_bench adds to a context: its question, then the tokens it generates.
QUESTION_TOKENS, OUTPUT_TOKENS = 32, 8


def cross_replica_bench(
    port: int,
    length: int,
    per_block: int,
    out: Path,
    name: str,
    timeout: float,
    *extra: str,
    replica_b: int = 1,
) -> subprocess.CompletedProcess:
    """The blocked cross-replica bench A=0 -> B=`replica_b` on one shared context per block
    (B=0: one replica, its GPU cache reset between prefill and follow-up), its report in
    out/NAME.json and out/NAME.md (`extra`: more bench flags)."""
    return subprocess.run(
        kvshare(
            "bench",
            "cross-replica",
            "--target",
            f"http://127.0.0.1:{port}",
            "--lengths",
            str(length),
            "--requests-per-block",
            str(per_block),
            "--replica-a",
            "0",
            "--replica-b",
            str(replica_b),
            "--shared-context",
            "--question-tokens",
            str(QUESTION_TOKENS),
            "--output-tokens",
            str(OUTPUT_TOKENS),
            "--settle-timeout",
            "60",
            "--json",
            str(out / f"{name}.json"),
            "--markdown",
            str(out / f"{name}.md"),
            *extra,
        ),
        env=env(),
        cwd=REPO,
        timeout=max(1.0, timeout),
    )


def hit_medians(report_path: Path) -> dict:
    """ON/OFF medians, block medians and the bytes the follow-ups loaded per hit, from a
    cross-replica bench report (only follow-ups load)."""
    report = json.loads(report_path.read_text())
    (comparison,) = report["comparisons"]
    on_blocks = [b["summary"] for b in report["blocks"] if b["condition"] == "ON"]
    hits = [r for r in report["requests"] if r["condition"] == "ON" and r["role"] == "measure"]
    return {
        "off_s": comparison["off"]["value"],
        "on_s": comparison["on"]["value"],
        "on_interval_s": [comparison["on"]["low"], comparison["on"]["high"]],
        "block_medians_s": comparison["block_medians"],
        "bytes_per_hit": sum(b["loaded_bytes"] for b in on_blocks) / max(1, len(hits)),
        "on_timing_ms": on_timing(hits),
    }


def on_timing(requests: list[dict]) -> dict[str, float]:
    """The medians of `requests`' (bench records') client TTFT and Server-Timing phases."""
    ttfts = [{"client TTFT": 1e3 * r["ttft_s"]} for r in requests if r["ttft_s"] is not None]
    return median_phases([*ttfts, *(r.get("server_timing") or {} for r in requests)])
