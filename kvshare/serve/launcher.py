"""`kvshare up`: the pool daemon, N replicas and the router as child processes of one host.

    with Cluster(UpConfig(replicas=2)) as cluster:
        cluster.url             # the router
        cluster.replica_urls    # replica i at port + 1 + i
        cluster.kill_replica(1); cluster.start_replica(1)
        cluster.stop_pool(); cluster.start_pool()

Every child's output lines are copied to one log, prefixed with its name ([pool],
[replica0], [router]); the launcher's own lines are [up]. Start-up waits for the pool's
ready line and for each server's /health. `supervise()` (what `kvshare up` runs) restarts a
replica that exits, with backoff (RestartPolicy), while the router's health checks keep
traffic off it; it returns when the pool or the router exits, or every replica is given up.
Keys reach the replicas and the router in their environment, never their command line.
Shutdown sends SIGTERM to all (the daemon then removes its socket and arena), SIGKILL
after a grace period, and removes whatever a killed daemon left behind. Children get
SIGTERM if the launching thread dies (Linux), so none outlives a crashed launcher.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TextIO

from kvshare.engine.cli import add_model_arguments, engine_argv
from kvshare.integrations.cli import vllm_serve_argv
from kvshare.kvpool.arena import DEFAULT_SLAB_BYTES
from kvshare.kvpool.cli import READY_PREFIX, add_remote_arguments, remote_config
from kvshare.kvpool.launch import PoolProcessConfig, pool_command
from kvshare.kvpool.ownership import clean_folder
from kvshare.kvpool.page import PAGE_ALIGN
from kvshare.kvpool.paths import SHM_DIR, default_pool_paths
from kvshare.kvpool.remote import RemoteConfig
from kvshare.ports import free_ports
from kvshare.serve.auth import (
    ADMIN_KEY_ENV,
    API_KEY_ENV,
    AccessKeys,
    access_keys,
    add_key_arguments,
)
from kvshare.serve.policies import POLICIES
from kvshare.sizes import parse_size
from kvshare.spec import DEFAULT_CHUNK_TOKENS

GIB = 1 << 30
_STOP_GRACE_S = 15.0
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RestartPolicy:
    """How a replica that exits is restarted: after `first_delay_s`, doubling with each
    crash in a row up to `max_delay_s`. An exit within `fast_crash_s` of the start is a
    crash in a row; after `max_fast_crashes` of them the replica stays down (0: never restart)."""

    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    fast_crash_s: float = 60.0
    max_fast_crashes: int = 5

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s or self.fast_crash_s <= 0:
            raise ValueError("restart delays must satisfy 0 < first <= max, and fast_crash_s > 0")
        if self.max_fast_crashes < 0:
            raise ValueError(f"max_fast_crashes must be >= 0, got {self.max_fast_crashes}")

    def delay(self, crashes_in_a_row: int) -> float:
        return min(self.max_delay_s, self.first_delay_s * 2.0 ** max(0, crashes_in_a_row - 1))


@dataclass
class ReplicaRestarts:
    """One replica's restart bookkeeping; `due_at` is set while it waits to restart."""

    policy: RestartPolicy
    started_at: float
    fast_crashes: int = 0
    due_at: float | None = None
    given_up: bool = False

    def exited(self, now: float) -> None:
        """Record an exit noticed at `now`: schedule the restart, or give up."""
        fast = now - self.started_at < self.policy.fast_crash_s
        self.fast_crashes = self.fast_crashes + 1 if fast else 0
        if self.policy.max_fast_crashes == 0 or self.fast_crashes >= self.policy.max_fast_crashes:
            self.given_up = True
        else:
            self.due_at = now + self.policy.delay(self.fast_crashes)

    def restarted(self, now: float) -> None:
        self.started_at, self.due_at = now, None


@dataclass(frozen=True)
class UpConfig:
    replicas: int = 2
    model: str = "smollm2-135m"
    device: str = "cpu"
    engine_args: tuple[str, ...] = ()  # more `kvshare serve` flags, e.g. ("--dtype", "float32")
    gpu_memory_fraction: float | None = None  # per replica; default on CUDA: 0.9 / replicas
    pool_size: int = 2 * GIB
    pool_preallocate: bool = False
    # Share of the pool one replica may hold reserved or pinned: a hit on a prefix larger
    # than this share is cut to it.
    pool_max_client_fraction: float = 0.5
    pool_remote: RemoteConfig | None = None  # the pool's tier shared with other hosts
    kv_pool: bool = True
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    # The replicas' KV block, in tokens: the router's routing-key block must be the same, or
    # the replicas' cache events name blocks the router does not know (and are ignored).
    block_tokens: int = 16
    host: str = "127.0.0.1"
    port: int = 8080  # the router; replica i at port + 1 + i. 0: any free ports
    policy: str = "cache-aware"
    router_args: tuple[str, ...] = ()
    api_key: str | None = None
    admin_key: str | None = None
    restart: RestartPolicy = RestartPolicy()
    ready_timeout: float = 300.0
    engine: str = "kvshare"  # or "vllm": replicas are `vllm serve` with kvshare's connector
    vllm_bin: str = "vllm"
    vllm_args: tuple[str, ...] = ()  # more `vllm serve` flags

    def __post_init__(self) -> None:
        AccessKeys(self.api_key, self.admin_key)  # checks both keys
        if self.engine not in ("kvshare", "vllm"):
            raise ValueError(f"engine must be kvshare or vllm, got {self.engine!r}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.gpu_memory_fraction is not None and not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(
                f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}"
            )
        if self.pool_size < PAGE_ALIGN:
            raise ValueError(f"pool_size must be at least {PAGE_ALIGN} bytes")
        if not 0.0 < self.pool_max_client_fraction <= 1.0:
            raise ValueError(
                f"pool_max_client_fraction must be in (0, 1], got {self.pool_max_client_fraction}"
            )
        if not (self.port == 0 or 1 <= self.port <= 65535 - self.replicas):
            raise ValueError(f"port must be 0 or leave room for {self.replicas} replica ports")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        if self.ready_timeout <= 0 or self.chunk_tokens < 1 or self.block_tokens < 1:
            raise ValueError("ready_timeout, chunk_tokens and block_tokens must be positive")

    @classmethod
    def from_args(cls, argv: Sequence[str]) -> UpConfig:
        """What `kvshare up ARGV` runs: its own parser, defaults and checks."""
        parser = argparse.ArgumentParser(prog="kvshare up")
        add_up_arguments(parser)
        return up_config(parser.parse_args(list(argv)))

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def replica_gpu_fraction(self) -> float | None:
        if not self.on_gpu:
            return None
        return self.gpu_memory_fraction or round(0.9 / self.replicas, 3)

    @property
    def slab_bytes(self) -> int:
        """1 GiB slabs, or one slab for a smaller pool."""
        return min(DEFAULT_SLAB_BYTES, self.pool_size // PAGE_ALIGN * PAGE_ALIGN)


def add_up_arguments(up: argparse.ArgumentParser) -> None:
    """The flags of `kvshare up`; `up_config` reads them."""
    add_model_arguments(up)
    up.set_defaults(gpu_memory_fraction=None)  # per replica; default 0.9 / replicas on CUDA
    up.add_argument("--replicas", type=int, default=2, help="replicas (engine processes) to start")
    up.add_argument("--pool-size", default="2GiB", help="shared pool arena size")
    up.add_argument(
        "--pool-preallocate",
        action="store_true",
        help="allocate the pool arena at start (reserves the memory; faster CUDA registration)",
    )
    up.add_argument(
        "--pool-max-client-fraction",
        type=float,
        default=UpConfig.pool_max_client_fraction,
        help="share of the pool one replica may hold reserved or pinned (default 0.5): a "
        "pool hit on a longer prefix is cut to it; raise it when one prefix's pages "
        "fill most of the pool",
    )
    up.add_argument("--no-kv-pool", action="store_true", help="replicas without the shared pool")
    up.add_argument(
        "--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS, help="tokens per pool page"
    )
    up.add_argument("--host", default="127.0.0.1", help="address the router and replicas bind")
    up.add_argument(
        "--port",
        type=int,
        default=8080,
        help="router port; replicas take the next ones (0: any free ports)",
    )
    up.add_argument(
        "--policy", default="cache-aware", choices=POLICIES, help="the router's replica choice"
    )
    up.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more `kvshare router` flag, repeatable; write it with '=': "
        "--router-arg=--queued-work-weight=0",
    )
    up.add_argument(
        "--replica-restarts",
        type=int,
        default=5,
        metavar="N",
        help="restart a replica that exits, with backoff; after N exits in a row each "
        "within 60 s of its start it stays down (0: never restart; default: 5)",
    )
    up.add_argument(
        "--cache-salt-required",
        action="store_true",
        help="passed to every replica: refuse /v1 requests without a cache_salt",
    )
    up.add_argument(
        "--engine",
        default="kvshare",
        choices=("kvshare", "vllm"),
        help="replicas: kvshare's engine, or `vllm serve` with kvshare's KV connector "
        "(--model is then an HF folder, e.g. from `kvshare export-hf`)",
    )
    up.add_argument(
        "--vllm-bin",
        default="vllm",
        help="the vllm executable, or the Python of vLLM's venv (--engine vllm)",
    )
    up.add_argument(
        "--vllm-args", default="", help="more `vllm serve` flags, one string (--engine vllm)"
    )
    add_key_arguments(up)
    add_remote_arguments(up)


def up_config(args: argparse.Namespace) -> UpConfig:
    """The UpConfig of parsed `add_up_arguments` flags (ValueError if they are invalid)."""
    keys = access_keys(args)
    fraction = args.gpu_memory_fraction
    # The launcher gives each replica its device and GPU share; the other engine flags pass through.
    engine = engine_argv(
        argparse.Namespace(**vars(args) | {"gpu_memory_fraction": 0.9}),
        exclude=("device", "gpu_memory_fraction"),
    )
    salt = ("--cache-salt-required",) if args.cache_salt_required else ()
    # vLLM replicas keep vLLM's own block (16 by default), not kvshare's --block-size.
    block_tokens = args.block_size if args.engine == "kvshare" else UpConfig.block_tokens
    return UpConfig(
        replicas=args.replicas,
        model=args.model,
        device=args.device,
        engine_args=engine + salt,
        gpu_memory_fraction=fraction,
        pool_size=parse_size(args.pool_size),
        pool_preallocate=args.pool_preallocate,
        pool_max_client_fraction=args.pool_max_client_fraction,
        pool_remote=remote_config(args),
        kv_pool=not args.no_kv_pool,
        chunk_tokens=args.chunk_tokens,
        block_tokens=block_tokens,
        host=args.host,
        port=args.port,
        policy=args.policy,
        router_args=tuple(args.router_arg),
        api_key=keys.api_key,
        admin_key=keys.admin_key,
        restart=RestartPolicy(max_fast_crashes=args.replica_restarts),
        # A vLLM engine start takes minutes on a busy CPU host.
        ready_timeout=900.0 if args.engine == "vllm" else UpConfig.ready_timeout,
        engine=args.engine,
        vllm_bin=args.vllm_bin,
        vllm_args=tuple(shlex.split(args.vllm_args)),
    )


class _PrefixedLog:
    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def write(self, name: str, line: str) -> None:
        with self._lock, contextlib.suppress(ValueError, OSError):  # a closed log stays quiet
            self._stream.write(f"[{name}] {line}\n")
            self._stream.flush()


def _parent_death_signal() -> Callable[[], None] | None:
    """A pre-exec hook asking Linux to SIGTERM the child when its parent thread dies.
    libc is loaded here, before fork: the hook only makes the system call."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return hook


class _Child:
    """One child process; its stdout and stderr go, line by line, to the prefixed log.

    With `own_group` (replicas) it leads a process group of its own and every signal goes
    to the whole group: what it started (vLLM's engine process and workers) stops with it
    instead of being orphaned. The pool and the router stay in the launcher's group.
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        log: _PrefixedLog,
        ready_prefix: str | None = None,
        own_group: bool = False,
    ) -> None:
        self.name = name
        self.own_group = own_group
        self.argv = argv
        self._env = env
        self._log = log
        self._ready_prefix = ready_prefix
        self.ready = threading.Event()  # set on the ready line, when there is one
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self._process: subprocess.Popen[bytes] | None = None
        self._pump: threading.Thread | None = None

    def start(self) -> None:
        self._process = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self._env,
            preexec_fn=_parent_death_signal(),
            start_new_session=self.own_group,
        )
        self._pump = threading.Thread(
            target=self._copy_output, name=f"log-{self.name}", daemon=True
        )
        self._pump.start()

    def _copy_output(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for raw in iter(self._process.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.tail.append(line)
            self._log.write(self.name, line)
            if self._ready_prefix and line.startswith(self._ready_prefix):
                self.ready.set()
        self._process.stdout.close()

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def signal(self, sig: int) -> None:
        """Send `sig` to the child, or to its process group (also after the child itself
        exited: what it started may still run)."""
        if self._process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.own_group:
                os.killpg(self._process.pid, sig)
            elif self.alive:
                self._process.send_signal(sig)

    def _group_alive(self) -> bool:
        """Whether a process of the child's own group still runs (False without one)."""
        if not self.own_group or self._process is None:
            return False
        try:
            os.killpg(self._process.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def wait(self, timeout: float) -> None:
        """Wait for the child (and the rest of its own group) to exit; SIGKILL after
        `timeout`. Output is drained either way."""
        if self._process is None:
            return
        deadline = time.monotonic() + timeout
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self._process.wait()
        while self._group_alive():
            if time.monotonic() > deadline:
                self.signal(signal.SIGKILL)
                break
            time.sleep(0.05)
        if self._pump is not None:
            self._pump.join(5.0)

    def stop(self) -> None:
        self.signal(signal.SIGTERM)
        self.wait(_STOP_GRACE_S)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait(_STOP_GRACE_S)

    @property
    def exit_code(self) -> int | None:
        return self._process.poll() if self._process is not None else None

    def describe_exit(self) -> str:
        code = self.exit_code
        tail = "\n".join(self.tail) or "(no output)"
        return f"{self.name} exited with status {code}; its last output:\n{tail}"


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


class Cluster:
    def __init__(self, config: UpConfig, log: TextIO | None = None) -> None:
        self.config = config
        self._log = _PrefixedLog(log or sys.stderr)
        # The per-user runtime folder (0700, created by the daemon): there the daemon
        # publishes the pool's address, and the next start removes what a killed one left.
        self._dir = default_pool_paths().runtime_dir
        self.socket_path = os.path.join(self._dir, f"up-{uuid.uuid4().hex[:12]}.sock")
        arena_dir = SHM_DIR if os.path.isdir(SHM_DIR) else self._dir
        self.arena_path = os.path.join(arena_dir, f"kvshare-up-{uuid.uuid4().hex[:12]}.arena")
        n = config.replicas
        ports = (
            free_ports(n + 1, config.host)
            if config.port == 0
            else [config.port + i for i in range(n + 1)]
        )
        self.url = f"http://{config.host}:{ports[0]}"
        self.replica_urls = [f"http://{config.host}:{p}" for p in ports[1:]]
        self._pool: _Child | None = None
        self._replicas: list[_Child | None] = [None] * n
        self._restarts = [ReplicaRestarts(config.restart, 0.0) for _ in range(n)]
        self._router: _Child | None = None

    @property
    def pool_address(self) -> str:
        return f"unix:{self.socket_path}"

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Pool, then every replica (loading in parallel), then the router; each ready."""
        if self.config.kv_pool:
            self.start_pool()
        for i in range(self.config.replicas):
            self._spawn_replica(i)
        for i, child in enumerate(self._replicas):
            assert child is not None
            self._wait_healthy(child, self.replica_urls[i])
        self._router = self._spawn("router", self._router_argv(), self._server_env(self._env()))
        self._wait_healthy(self._router, self.url)

    def stop(self) -> None:
        """SIGTERM everyone at once, wait, then remove the pool's files if they are left."""
        children = [c for c in (self._router, *self._replicas, self._pool) if c is not None]
        for child in children:
            child.signal(signal.SIGTERM)
        for child in children:
            child.wait(_STOP_GRACE_S)
        if self._pool is not None:  # a killed daemon's files; nothing if it stopped cleanly
            clean_folder(self._dir)
            with contextlib.suppress(OSError):
                os.rmdir(self._dir)  # only if nothing else is in it

    def children(self) -> dict[str, int]:
        """Name -> pid of every running child."""
        return {
            c.name: c.pid
            for c in (self._pool, *self._replicas, self._router)
            if c is not None and c.alive
        }

    def supervise(self, poll_s: float = 0.5) -> str:
        """Restart replicas that exit (RestartPolicy) until the pool or the router exits, or
        every replica is given up; return how it ended (for `kvshare up`). While it runs it
        owns the replicas: kill_replica and start_replica are for clusters not supervised."""
        while True:
            for child in (self._pool, self._router):
                if child is not None and not child.alive:
                    return child.describe_exit()
            for i in range(self.config.replicas):
                self._supervise_replica(i, time.monotonic())
            if all(r.given_up for r in self._restarts):
                return "every replica was given up"
            time.sleep(poll_s)

    def _supervise_replica(self, i: int, now: float) -> None:
        child, restarts = self._replicas[i], self._restarts[i]
        if child is None or child.alive or restarts.given_up:
            return
        if restarts.due_at is None:  # a new exit
            child.stop()  # what it started goes too (a vLLM server's engine process)
            restarts.exited(now)
            crashes = f"{restarts.fast_crashes} fast exit(s) in a row"
            if restarts.given_up:
                self._log.write(
                    "up",
                    f"{child.describe_exit()}\nreplica{i} is not restarted again "
                    f"({crashes}); the other replicas keep serving",
                )
            else:
                self._log.write(
                    "up",
                    f"replica{i} exited with status {child.exit_code} ({crashes}); "
                    f"restarting it in {restarts.due_at - now:.1f} s",
                )
        elif now >= restarts.due_at:
            self._log.write("up", f"restarting replica{i}")
            self._spawn_replica(i)

    # ------------------------------------------------------------ faults (tests, bench)

    def kill_replica(self, i: int) -> None:
        child = self._replicas[i]
        if child is not None:
            child.kill()

    def start_replica(self, i: int) -> None:
        """(Re)start replica i on its port and wait until it is healthy."""
        child = self._replicas[i]
        if child is not None and child.alive:
            raise RuntimeError(f"replica{i} is running")
        self._wait_healthy(self._spawn_replica(i), self.replica_urls[i])

    def stop_pool(self) -> None:
        if self._pool is not None:
            self._pool.stop()

    def pool_config(self) -> PoolProcessConfig:
        """The pool daemon this cluster starts."""
        return PoolProcessConfig(
            size_bytes=self.config.pool_size,
            socket_path=self.socket_path,
            arena_path=self.arena_path,
            slab_bytes=self.config.slab_bytes,
            preallocate=self.config.pool_preallocate,
            max_client_fraction=self.config.pool_max_client_fraction,
            runtime_dir=self._dir,
            remote=self.config.pool_remote,
            ready_timeout=self.config.ready_timeout,
        )

    def start_pool(self) -> None:
        if self._pool is not None and self._pool.alive:
            raise RuntimeError("the pool daemon is running")
        pool = self.pool_config()
        self._pool = self._spawn("pool", pool_command(pool), self._env(), ready_prefix=READY_PREFIX)
        deadline = time.monotonic() + self.config.ready_timeout
        while not self._pool.ready.wait(0.1):
            if not self._pool.alive or time.monotonic() > deadline:
                raise RuntimeError(f"the pool daemon did not start: {self._pool.describe_exit()}")

    # ------------------------------------------------------------ internals

    def _spawn(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        ready_prefix: str | None = None,
        own_group: bool = False,
    ) -> _Child:
        child = _Child(name, argv, env, self._log, ready_prefix, own_group)
        child.start()
        return child

    def _spawn_replica(self, i: int) -> _Child:
        child = self._spawn(
            f"replica{i}",
            self._replica_argv(i),
            self._server_env(self._replica_env()),
            own_group=True,
        )
        self._replicas[i] = child
        self._restarts[i].restarted(time.monotonic())
        return child

    def _server_env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with this cluster's keys (a server reads them from there: see kvshare.serve.auth)."""
        return env | AccessKeys(self.config.api_key, self.config.admin_key).environment()

    def _wait_healthy(self, child: _Child, url: str) -> None:
        deadline = time.monotonic() + self.config.ready_timeout
        while not _healthy(url):
            if not child.alive:
                raise RuntimeError(child.describe_exit())
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{child.name} not healthy at {url} within {self.config.ready_timeout} s"
                )
            time.sleep(0.25)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for name in (API_KEY_ENV, ADMIN_KEY_ENV):  # only the servers get keys (_server_env)
            env.pop(name, None)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        return env

    def _replica_env(self) -> dict[str, str]:
        env = self._env()
        if self.config.engine == "vllm":
            # Loopback for vLLM's internal queues; no hub; POST /reset_prefix_cache served
            # (the router's prefix-cache reset of vLLM replicas).
            env |= {"VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"}
            if self.config.api_key is not None:
                # vLLM's own --api-key, through its environment (not the command line): it
                # then guards its /v1 with the key the router checks, and the router
                # forwards the client's Authorization header.
                env["VLLM_API_KEY"] = self.config.api_key
        if not self.config.on_gpu:  # replicas share the cores instead of each taking all
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.config.replicas))
        return env

    def _replica_argv(self, i: int) -> list[str]:
        c = self.config
        port = self.replica_urls[i].rsplit(":", 1)[1]
        if c.engine == "vllm":
            pool = self.pool_address if c.kv_pool else None
            return vllm_serve_argv(
                c.vllm_bin, c.model, c.host, port, pool, c.chunk_tokens, c.vllm_args
            )
        argv = [
            sys.executable,
            "-m",
            "kvshare",
            "serve",
            "--model",
            c.model,
            "--device",
            c.device,
            "--host",
            c.host,
            "--port",
            port,
            "--chunk-tokens",
            str(c.chunk_tokens),
        ]
        argv += ["--kv-pool", self.pool_address] if c.kv_pool else ["--no-kv-pool"]
        if c.replica_gpu_fraction is not None:
            argv += ["--gpu-memory-fraction", str(c.replica_gpu_fraction)]
        return argv + list(c.engine_args)

    def _router_argv(self) -> list[str]:
        c = self.config
        port = self.url.rsplit(":", 1)[1]
        argv = [
            sys.executable,
            "-m",
            "kvshare",
            "router",
            "--host",
            c.host,
            "--port",
            port,
            "--policy",
            c.policy,
            "--model",
            c.model,
            "--chunk-tokens",
            str(c.chunk_tokens),
            "--block-tokens",
            str(c.block_tokens),
        ]
        if not c.kv_pool:  # nothing is shared: only GPU-local hits count
            argv += ["--pool-credit", "0"]
        if c.engine == "vllm":  # the router does the admin calls vLLM does not serve
            argv += ["--engine", "vllm"]
            argv += ["--kv-pool", self.pool_address] if c.kv_pool else []
        for url in self.replica_urls:
            argv += ["--replica", url]
        return argv + list(c.router_args)
