"""`kvshare up`: its configuration, and that it stops cleanly (no shared memory, socket or
process left) on SIGTERM and when a child dies. A tiny random model keeps this quick."""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import pytest

from kvshare.serve.launcher import Cluster, UpConfig

TINY = ("--model", "shape:tiny-llama", "--replicas", "1", "--pool-size", "64MiB",
        "--kv-cache-memory", "16MiB")


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A private XDG_RUNTIME_DIR for this test and the processes it starts; the pool's
    runtime folder is `<it>/kvshare`."""
    folder = tempfile.mkdtemp(prefix="kvup-")
    monkeypatch.setenv("XDG_RUNTIME_DIR", folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _start_up() -> tuple[subprocess.Popen[str], str]:
    """`kvshare up` in its own process group; returns it and its output up to ready."""
    process = subprocess.Popen([sys.executable, "-m", "kvshare", "up", *TINY, "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    lines = []
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        if line.startswith("kvshare up: router"):
            break
    return process, "".join(lines)


def test_up_config_from_args_matches_the_command() -> None:
    default = UpConfig.from_args([])
    assert (default.replicas, default.model, default.device, default.port) == (2, "smollm2-135m", "cpu", 8080)
    assert default.pool_size == 2 << 30 and default.policy == "cache-aware" and default.kv_pool
    assert default.replica_gpu_fraction is None  # the CPU has no fraction to split
    gpu = UpConfig.from_args(["--device", "cuda", "--replicas", "2", "--kv-cache-memory", "1GiB",
                              "--no-kv-pool", "--port", "0"])
    assert gpu.replica_gpu_fraction == 0.45 and not gpu.kv_pool and gpu.port == 0
    assert "--kv-cache-memory" in gpu.engine_args and "1GiB" in gpu.engine_args
    assert UpConfig.from_args(["--gpu-memory-fraction", "0.3", "--device", "cuda"]).replica_gpu_fraction == 0.3
    assert UpConfig(pool_size=256 << 20).slab_bytes == 256 << 20
    for bad in (dict(replicas=0), dict(policy="random"), dict(device="tpu"), dict(port=70000),
                dict(gpu_memory_fraction=1.5)):
        with pytest.raises(ValueError):
            UpConfig(**bad)  # type: ignore[arg-type]


def test_invalid_up_arguments_exit_with_status_2() -> None:
    result = subprocess.run([sys.executable, "-m", "kvshare", "up", "--replicas", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "replicas must be >= 1" in result.stderr


def test_kvshare_up_stops_cleanly_on_sigterm(runtime: str) -> None:
    process, output = _start_up()
    try:
        router = re.search(r"router (http://\S+);", output)
        arena = re.search(r"arena=(\S+)", output)
        socket_path = re.search(r"socket=(\S+)", output)
        assert router and arena and socket_path, output
        assert os.path.exists(arena[1]) and os.path.exists(socket_path[1])
        assert os.path.dirname(socket_path[1]) == os.path.join(runtime, "kvshare")
        assert f"pool unix:{socket_path[1]}" in output
        with open(os.path.join(runtime, "kvshare", "pool.address")) as address:
            assert address.read().strip() == f"unix:{socket_path[1]}"
        resp = httpx.post(router[1] + "/v1/completions", timeout=60,
                          json={"model": "shape:tiny-llama", "prompt": [5, 6, 7], "max_tokens": 2})
        assert resp.status_code == 200
        process.send_signal(signal.SIGTERM)
        rest = process.communicate(timeout=60)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, rest
    assert not os.path.exists(arena[1]) and not os.path.exists(os.path.dirname(socket_path[1]))
    with pytest.raises(httpx.ConnectError):
        httpx.get(router[1] + "/health")


def test_kill_9_of_kvshare_up_leaves_files_that_cleanup_removes(runtime: str) -> None:
    process, output = _start_up()
    try:
        arena = re.search(r"arena=(\S+)", output)
        socket_path = re.search(r"socket=(\S+)", output)
        assert arena and socket_path, output
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate(timeout=60)
    leftovers = [arena[1], socket_path[1], socket_path[1] + ".lock"]
    assert all(os.path.exists(path) for path in leftovers)
    result = subprocess.run([sys.executable, "-m", "kvshare", "pool", "--cleanup"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for path in leftovers:
        assert f"removed {path}" in result.stdout and not os.path.exists(path)
    assert os.listdir(os.path.join(runtime, "kvshare")) == []


def test_cluster_notices_a_dead_child(runtime: str) -> None:
    log = io.StringIO()
    with Cluster(UpConfig.from_args([*TINY, "--port", "0"]), log=log) as cluster:
        children = cluster.children()
        assert set(children) == {"pool", "replica0", "router"}
        os.kill(children["router"], signal.SIGKILL)
        started = time.monotonic()
        ended = cluster.wait_any_exit(poll_s=0.1)
        assert "router exited with status -9" in ended and time.monotonic() - started < 5
        arena = cluster.arena_path
    assert not os.path.exists(arena)
    for pid in children.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert "[replica0] kvshare serve: shape:tiny-llama ready" in log.getvalue()
