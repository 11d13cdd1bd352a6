"""`kvshare up`: its configuration, that it stops cleanly (no shared memory, socket or
process left) on SIGTERM and when the router dies, that it restarts a replica that dies,
and that its keys work end to end without showing in any command line. A tiny random
model keeps this quick."""

from __future__ import annotations

import ast
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvshare.engine.config import EngineConfig
from kvshare.kvpool.launch import pool_command
from kvshare.serve import collector, launcher
from kvshare.serve.auth import ADMIN_KEY_ENV, API_KEY_ENV
from kvshare.serve.launcher import Cluster, ReplicaRestarts, RestartPolicy, UpConfig

TINY = (
    "--model",
    "shape:tiny-llama",
    "--replicas",
    "1",
    "--pool-size",
    "64MiB",
    "--kv-cache-memory",
    "16MiB",
)


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
    process = subprocess.Popen(
        [sys.executable, "-m", "kvshare", "up", *TINY, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        if line.startswith("kvshare up: router"):
            break
    return process, "".join(lines)


def test_up_config_from_args_matches_the_command() -> None:
    default = UpConfig.from_args([])
    assert (default.replicas, default.model, default.device, default.port) == (
        2,
        "smollm2-135m",
        "cpu",
        8080,
    )
    assert default.pool_size == 2 << 30 and default.policy == "cache-aware" and default.kv_pool
    assert default.replica_gpu_fraction is None  # the CPU has no fraction to split
    gpu = UpConfig.from_args(
        [
            "--device",
            "cuda",
            "--replicas",
            "2",
            "--kv-cache-memory",
            "1GiB",
            "--no-kv-pool",
            "--port",
            "0",
        ]
    )
    assert gpu.replica_gpu_fraction == 0.45 and not gpu.kv_pool and gpu.port == 0
    assert EngineConfig.from_argv(gpu.engine_args).kv_cache_memory == 1 << 30
    engine = EngineConfig.from_argv(
        UpConfig.from_args(
            ["--block-size", "32", "--no-cuda-graphs", "--no-enable-prefix-caching"]
        ).engine_args
    )
    assert (engine.block_size, engine.cuda_graphs, engine.enable_prefix_caching) == (
        32,
        False,
        False,
    )
    assert (
        UpConfig.from_args(
            ["--gpu-memory-fraction", "0.3", "--device", "cuda"]
        ).replica_gpu_fraction
        == 0.3
    )
    assert UpConfig(pool_size=256 << 20).slab_bytes == 256 << 20
    weights = ["--router-arg=--queued-work-weight=0", "--router-arg=--load-penalty-tokens=32"]
    assert UpConfig.from_args(weights).router_args == (
        "--queued-work-weight=0",
        "--load-penalty-tokens=32",
    )
    pool = Cluster(UpConfig.from_args(["--pool-max-client-fraction", "0.9"])).pool_config()
    assert pool.max_client_fraction == 0.9
    assert pool_command(pool)[pool_command(pool).index("--max-client-fraction") + 1] == "0.9"
    assert Cluster(UpConfig()).pool_config().max_client_fraction == 0.5
    for bad in (
        dict(pool_max_client_fraction=0.0),
        dict(pool_max_client_fraction=1.5),
        dict(replicas=0),
        dict(policy="random"),
        dict(device="tpu"),
        dict(port=70000),
        dict(gpu_memory_fraction=1.5),
        dict(block_tokens=0),
    ):
        with pytest.raises(ValueError):
            UpConfig(**bad)  # type: ignore[arg-type]


def test_the_router_keys_prompts_by_the_replicas_kv_block() -> None:
    """`--block-size 256` reaches the replicas and the router's --block-tokens alike: with
    the router at 16 (as on the H200 on 2026-12-06) every cache event of a replica names
    blocks the router cannot match, and the cache-aware policy loses what they say."""

    def value(argv: list[str], flag: str) -> str:
        return argv[argv.index(flag) + 1]

    def blocks(args: list[str]) -> tuple[str, str]:
        cluster = Cluster(UpConfig.from_args([*args, "--port", "0"]))
        replica, router = cluster._replica_argv(0), cluster._router_argv()
        return value(replica, "--block-size"), value(router, "--block-tokens")

    assert blocks([]) == ("16", "16")
    assert blocks(["--block-size", "256"]) == ("256", "256")


def _imported_modules(path: str) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    tree = ast.parse(Path(path).read_text())
    names = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    return names | {
        a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names
    }


def test_the_launcher_does_not_import_the_cli_that_imports_it() -> None:
    assert "kvshare.serve.cli" not in _imported_modules(launcher.__file__)


def test_invalid_up_arguments_exit_with_status_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvshare", "up", "--replicas", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
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
        resp = httpx.post(
            router[1] + "/v1/completions",
            timeout=60,
            json={"model": "shape:tiny-llama", "prompt": [5, 6, 7], "max_tokens": 2},
        )
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
    result = subprocess.run(
        [sys.executable, "-m", "kvshare", "pool", "--cleanup"],
        capture_output=True,
        text=True,
        timeout=60,
    )
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
        ended = cluster.supervise(poll_s=0.1)
        assert "router exited with status -9" in ended and time.monotonic() - started < 5
        arena = cluster.arena_path
    assert not os.path.exists(arena)
    for pid in children.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert "[replica0] kvshare serve: shape:tiny-llama ready" in log.getvalue()


def _metric(text: str, name: str) -> float:
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert len(values) == 1, f"{name} not in the metrics page"
    return values[0]


def test_replica_and_router_freeze_what_they_started_with(runtime: str) -> None:
    # A full collection walks every object not frozen: in a tiny CPU replica ~320,000
    # objects, 53-69 ms with the GIL held in the middle of a request. Both
    # servers freeze what they built to start and raise the young collections' threshold
    # (kvshare.serve.collector); their metrics say so, and that a full collection still
    # runs (over what requests create). They unfreeze to exit: Triton's bindings report
    # frozen objects as leaked.
    log = io.StringIO()
    with Cluster(UpConfig.from_args([*TINY, "--port", "0"]), log=log) as cluster:
        for url in (cluster.replica_urls[0], cluster.url):
            page = httpx.get(url + "/metrics").text
            assert _metric(page, "kvshare_gc_frozen_objects") > 50_000, url
            assert _metric(page, "kvshare_gc_young_threshold") == collector.YOUNG_OBJECTS, url
            assert _metric(page, 'python_gc_collections_total{generation="2"}') >= 0
    assert "exited" not in log.getvalue() and "leaked" not in log.getvalue()


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_stopping_a_vllm_replica_stops_what_it_started(tmp_path: Path) -> None:
    # `vllm serve` runs its engine in processes of its own: stopping the replica must not
    # leave them running (holding their memory and cores). This fake starts one and waits.
    fake_vllm = tmp_path / "vllm"
    fake_vllm.write_text(
        f"#!{sys.executable}\n"
        "import subprocess, time\n"
        "engine = subprocess.Popen(['sleep', '120'])\n"
        "print('engine', engine.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    fake_vllm.chmod(0o755)
    flags = ["--engine", "vllm", "--model", "/m", "--no-kv-pool", "--port", "0"]
    config = UpConfig.from_args([*flags, "--vllm-bin", str(fake_vllm)])
    log = io.StringIO()
    cluster = Cluster(config, log=log)
    try:
        cluster._spawn_replica(0)
        deadline = time.monotonic() + 30
        while not (found := re.search(r"\[replica0\] engine (\d+)", log.getvalue())):
            assert time.monotonic() < deadline, log.getvalue()
            time.sleep(0.05)
        engine = int(found.group(1))
        assert _running(engine)
    finally:
        cluster.stop()
    deadline = time.monotonic() + 10
    while _running(engine) and time.monotonic() < deadline:
        time.sleep(0.05)
    running = _running(engine)
    if running:
        os.kill(engine, signal.SIGKILL)
    assert not running, "the replica's engine process outlived it"


def test_restarts_back_off_and_give_up_after_fast_crashes_in_a_row() -> None:
    policy = RestartPolicy(
        first_delay_s=1.0, max_delay_s=5.0, fast_crash_s=60.0, max_fast_crashes=4
    )
    restarts = ReplicaRestarts(policy, started_at=0.0)
    now, delays = 0.0, []
    for _ in range(3):
        now += 10.0  # each run dies 10 s after its start: a fast crash
        restarts.exited(now)
        assert restarts.due_at is not None and not restarts.given_up
        delays.append(restarts.due_at - now)
        now = restarts.due_at
        restarts.restarted(now)
    assert delays == [1.0, 2.0, 4.0]
    restarts.exited(now + 500.0)  # a long run: the count starts over
    assert restarts.fast_crashes == 0 and restarts.due_at == now + 501.0
    restarts.restarted(now + 501.0)
    for _ in range(4):
        restarts.exited(restarts.started_at + 1.0)
        if restarts.due_at is not None:
            restarts.restarted(restarts.due_at)
    assert restarts.given_up and restarts.fast_crashes == 4
    never = ReplicaRestarts(RestartPolicy(max_fast_crashes=0), started_at=0.0)
    never.exited(1000.0)
    assert never.given_up
    assert UpConfig.from_args(["--replica-restarts", "2"]).restart.max_fast_crashes == 2
    with pytest.raises(ValueError):
        RestartPolicy(first_delay_s=10.0, max_delay_s=1.0)


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@pytest.mark.skipif(
    not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"),
    reason="needs /proc/PID/task/PID/children",
)
def test_kvshare_up_with_keys_restarts_a_killed_replica(tmp_path: Path) -> None:
    api_key, admin_key = "api-7f3c9e", "admin-41b8d2"
    admin_file = tmp_path / "admin.key"
    admin_file.write_text(admin_key + "\n")
    env = dict(os.environ, **{API_KEY_ENV: api_key})
    env.pop(ADMIN_KEY_ENV, None)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvshare",
            "up",
            *TINY,
            "--replicas",
            "2",
            "--port",
            "0",
            "--admin-key-file",
            str(admin_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if line.startswith("kvshare up: router"):
                started.set()

    threading.Thread(target=read, daemon=True).start()
    api, admin = {"Authorization": f"Bearer {api_key}"}, {"Authorization": f"Bearer {admin_key}"}
    body = {"model": "shape:tiny-llama", "prompt": [5, 6, 7], "max_tokens": 2}
    try:
        assert started.wait(180), "".join(lines)
        found = re.search(r"router (http://\S+); replicas (\S+), (\S+);", "".join(lines))
        assert found, "".join(lines)
        router, replicas = found[1], [found[2], found[3]]
        children = _children(process.pid)
        assert len(children) == 4  # pool, 2 replicas, router
        for pid in children:
            assert api_key not in _cmdline(pid) and admin_key not in _cmdline(pid)
        with httpx.Client(timeout=60) as client:
            assert client.post(router + "/v1/completions", json=body).status_code == 401
            assert (
                client.post(router + "/v1/completions", json=body, headers=api).status_code == 200
            )
            assert client.post(replicas[1] + "/v1/completions", json=body).status_code == 401
            assert client.get(replicas[1] + "/admin/stats", headers=api).status_code == 401
            assert client.post(router + "/admin/all/clear_pool", headers=api).status_code == 401
            cleared = client.post(router + "/admin/all/clear_pool", headers=admin)
            assert cleared.status_code == 200, cleared.text

            port = replicas[1].rsplit(":", 1)[1]
            victim = next(p for p in children if f"--port {port} " in _cmdline(p))
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + 120
            while True:  # every request succeeds, on replica 0 until replica 1 is back
                resp = client.post(router + "/v1/completions", json=body, headers=api)
                assert resp.status_code == 200, resp.text
                revived = [p for p in _children(process.pid) if f"--port {port} " in _cmdline(p)]
                if (
                    revived
                    and client.post(
                        router + "/v1/completions",
                        json=body,
                        headers={**api, "x-kvshare-replica": "1"},
                    ).status_code
                    == 200
                ):
                    break
                assert time.monotonic() < deadline, "".join(lines[-30:])
                time.sleep(0.2)
            assert revived != [victim]
        assert any("replica1 exited with status -9" in line for line in lines), "".join(lines)
        assert process.poll() is None  # the cluster kept running throughout
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
