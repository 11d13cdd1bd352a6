"""Run a Mooncake master on this host, for checks, benchmarks and tests of the remote tier.

A production cluster runs its master as a service; this starts one child process bound to
one address (loopback by default), without etcd (clients handshake peer to peer) and with
its HTTP metadata server off, and waits until its /health answers.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from types import TracebackType

from kvshare.ports import free_port

_READY_TIMEOUT_S = 15.0


def master_binary() -> str | None:
    """The `mooncake_master` next to this Python (a venv's bin), else on PATH; None if absent."""
    beside = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return beside if os.access(beside, os.X_OK) else shutil.which("mooncake_master")


def mooncake_missing() -> str | None:
    """Why the remote tier cannot run here (a sentence), or None when it can."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as error:
        return f"Mooncake is not installed (pip install 'kvshare[mooncake]'): {error}"
    if master_binary() is None:
        return "mooncake_master is not on PATH"
    return None


class MooncakeMaster:
    """A master child process: `start()` returns once /health answers; `stop()` ends it;
    `kill()` simulates a crash. `url` is what `kvshare pool --remote` takes."""

    def __init__(self, host: str = "127.0.0.1", log_path: str | None = None) -> None:
        self.host = host
        self.rpc_port = free_port(host)
        self.metrics_port = free_port(host)
        self._log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mooncake://{self.host}:{self.rpc_port}"

    def start(self) -> None:
        binary = master_binary()
        if binary is None:
            raise RuntimeError("mooncake_master is not on PATH (pip install 'kvshare[mooncake]')")
        command = [
            binary,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            "--enable_http_metadata_server=false",
        ]
        log = open(self._log_path or os.devnull, "ab")  # noqa: SIM115 - the child keeps it
        try:
            self._process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR")),
            )
        finally:
            log.close()
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not self.healthy():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"mooncake master on {self.host}:{self.rpc_port} did not start")
            time.sleep(0.05)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(
                f"http://{self.host}:{self.metrics_port}/health", timeout=1.0
            ) as answer:
                return answer.status == 200
        except OSError:
            return False

    def stop(self, timeout: float = 10.0) -> None:
        process = self._process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def __enter__(self) -> MooncakeMaster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
