"""Two vLLM CPU replica processes with the kvshare connector and one pool, started once
for the module (an engine start costs 25-70 s on 2 cores). Skipped without vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm builds its venv)")

from tests.integrations.vllm.tiny_models import write_tiny_llama
from tests.kvpool.pool_fixture import MIB, PoolFactory, child_env

HERE = Path(__file__).resolve().parent
READY_TIMEOUT_S = 400.0
ANSWER_TIMEOUT_S = 120.0


class Replica:
    """A replica.py process: `ask` sends one request and waits for its answer line."""

    def __init__(self, name: str, model_dir: Path, pool: str, log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        env = dict(child_env(), VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / "replica.py"), str(model_dir), pool],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )

    def _read_line(self, timeout: float) -> dict:
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self.process.stdout.readline()))
        reader.start()
        reader.join(timeout)
        if not result or not result[0]:
            raise AssertionError(f"{self.name} gave no answer; its log:\n{self.log()[-4000:]}")
        return json.loads(result[0])

    def wait_ready(self) -> None:
        assert self._read_line(READY_TIMEOUT_S) == {"ready": True}

    def ask(self, tokens: list[int], max_tokens: int = 8, salt: str | None = None) -> dict:
        request = {"tokens": tokens, "max_tokens": max_tokens, "salt": salt}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read_line(ANSWER_TIMEOUT_S)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


class VLLMCluster:
    def __init__(self, folder: Path) -> None:
        self.pools = PoolFactory()
        self.pool = self.pools.start(self.pools.config(size_bytes=64 * MIB, slab_bytes=MIB))
        self.address = "unix:" + self.pool.config.socket_path
        model_dir = write_tiny_llama(folder / "tiny-llama")
        self.a = Replica("A", model_dir, self.address, folder / "a.log")
        self.b = Replica("B", model_dir, self.address, folder / "b.log")

    def close(self) -> None:
        for replica in (self.a, self.b):
            replica.close()
        self.pools.close()


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMCluster]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cluster = VLLMCluster(tmp_path_factory.mktemp("vllm"))
    try:
        cluster.a.wait_ready()
        cluster.b.wait_ready()
        yield cluster
    finally:
        cluster.close()
