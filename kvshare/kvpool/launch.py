"""Run a pool daemon as a child process and wait until it serves.

For launchers (`kvshare up`), tests and benchmarks: the child is
`python -m kvshare.kvpool.cli pool ...`, ready when it prints its ready line.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from types import TracebackType

from kvshare.kvpool.cli import READY_PREFIX
from kvshare.kvpool.daemon import PoolConfig
from kvshare.kvpool.remote import RemoteConfig


@dataclass(frozen=True)
class PoolProcessConfig(PoolConfig):
    """The daemon's own configuration (checked the same way), and how to run its process."""

    log_level: str = "WARNING"
    ready_timeout: float = 30.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ready_timeout <= 0:
            raise ValueError(f"ready_timeout must be > 0, got {self.ready_timeout}")


def pool_command(config: PoolProcessConfig) -> list[str]:
    """The daemon's command line; it prints a line starting with READY_PREFIX once it serves."""
    return [
        sys.executable,
        "-m",
        "kvshare.kvpool.cli",
        "pool",
        "--size",
        str(config.size_bytes),
        "--slab-size",
        str(config.slab_bytes),
        *(["--preallocate"] if config.preallocate else []),
        "--socket",
        config.socket_path,
        "--arena",
        config.arena_path,
        "--log-level",
        config.log_level,
        "--max-client-fraction",
        repr(config.max_client_fraction),
        "--max-clients",
        str(config.max_clients),
        *(["--runtime-dir", config.runtime_dir] if config.runtime_dir else ["--no-runtime-dir"]),
        *(remote_arguments(config.remote) if config.remote is not None else []),
    ]


def remote_arguments(remote: RemoteConfig) -> list[str]:
    """`kvshare pool`'s flags for `remote`."""
    return [
        "--remote",
        remote.url,
        *(["--remote-local-hostname", remote.local_hostname] if remote.local_hostname else []),
        "--remote-segment-size",
        str(remote.segment_bytes),
        "--remote-timeout",
        repr(remote.fetch_timeout_s),
    ]


class PoolProcess:
    """A daemon child process. `start()` returns once it serves; `stop()` shuts it down
    cleanly (SIGTERM: socket and arena removed); `kill()` simulates a crash (SIGKILL:
    both are left behind, as after a real crash)."""

    def __init__(self, config: PoolProcessConfig) -> None:
        self.config = config
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"unix:{self.config.socket_path}"

    @property
    def pid(self) -> int:
        return self._require_process().pid

    def start(self) -> None:
        """Start the child and wait for its ready line; RuntimeError if it never comes."""
        if self._process is not None and self._process.poll() is None:
            raise RuntimeError("pool process is already running")
        self._process = subprocess.Popen(
            pool_command(self.config), stdout=subprocess.PIPE, env=_child_env()
        )
        try:
            self._wait_ready(self._process)
        except BaseException:
            self.kill()
            raise

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait; SIGKILL if it does not exit within `timeout`. Returns its status."""
        process = self._require_process()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return self._finish(process)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the child to exit (subprocess.TimeoutExpired after `timeout`)."""
        process = self._require_process()
        process.wait(timeout)
        return self._finish(process)

    def kill(self) -> int:
        process = self._require_process()
        if process.poll() is None:
            process.kill()
            process.wait()
        return self._finish(process)

    def __enter__(self) -> PoolProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._process is not None:
            self.stop()

    def _wait_ready(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        deadline = time.monotonic() + self.config.ready_timeout
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            output = b""
            while b"\n" not in output:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    raise RuntimeError(
                        f"pool daemon not ready within {self.config.ready_timeout} s"
                    )
                chunk = os.read(process.stdout.fileno(), 4096)
                if not chunk:
                    raise RuntimeError(f"pool daemon exited with status {process.wait()}")
                output += chunk
        if not output.startswith(READY_PREFIX.encode()):
            raise RuntimeError(f"unexpected pool daemon output: {output!r}")

    def _finish(self, process: subprocess.Popen[bytes]) -> int:
        if process.stdout is not None:
            process.stdout.close()
        return process.returncode

    def _require_process(self) -> subprocess.Popen[bytes]:
        if self._process is None:
            raise RuntimeError("pool process was never started")
        return self._process


def _child_env() -> dict[str, str]:
    """This environment, with the folder holding the `kvshare` package importable."""
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env
