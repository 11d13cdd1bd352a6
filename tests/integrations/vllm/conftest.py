"""vLLM CPU replica processes with the kvshare connector on one pool, started once for the
package (an engine start costs 25-70 s on 2 cores): two of a tiny Llama, and two of a tiny
hybrid Qwen3-Next (one of them the test-only broken variant that restores KV without the
recurrent state), each with the connector, and one of each model without it. All start
together. Skipped without vLLM."""

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

from tests.integrations.vllm.tiny_models import write_tiny_llama, write_tiny_qwen3_next
from tests.kvpool.pool_fixture import MIB, PoolFactory, child_env

HERE = Path(__file__).resolve().parent
READY_TIMEOUT_S = 400.0
ANSWER_TIMEOUT_S = 120.0


class Replica:
    """A replica.py process: `ask` sends one request and waits for its answer line."""

    def __init__(
        self, name: str, model_dir: Path, pool: str, log_path: Path, options: dict | None = None
    ) -> None:
        self.name = name
        self.log_path = log_path
        env = dict(child_env(), VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1")
        if options and options.get("kv_cache_from_config"):
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the config's 256 MiB, not 1 GiB
        else:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "replica.py"),
                str(model_dir),
                pool,
                json.dumps(options or {}),
            ],
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

    def reset_prefix_cache(self) -> None:
        """Drop the engine's own prefix cache: the next hit can only come from the pool."""
        self.process.stdin.write(json.dumps({"reset_prefix_cache": True}) + "\n")
        self.process.stdin.flush()
        assert self._read_line(ANSWER_TIMEOUT_S) == {"reset": True}

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def end_input(self) -> None:
        """No more requests: the process shuts its engine down and exits."""
        if self.process.poll() is None and not self.process.stdin.closed:
            self.process.stdin.close()

    def close(self) -> None:
        if self.process.poll() is None:
            self.end_input()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


# vLLM CPU's Gated DeltaNet kernel takes bfloat16 activations only
# (vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py, cpu_gdn_attention_core).
HYBRID_DTYPE = "bfloat16"


class VLLMCluster:
    """Llama replicas A and B on `pool`; hybrid replicas H and X on `hybrid_pool` (its own,
    so that the Llama tests' clears and daemon stop leave it alone). X restores KV without
    the state (the connector's `faults`: skip_state_restore). N (Llama) and G (hybrid) run
    without the connector: plain vLLM, the reference a user compares a restored answer
    with."""

    def __init__(self, folder: Path) -> None:
        self.pools = PoolFactory()
        self.pool = self.pools.start(self.pools.config(size_bytes=64 * MIB, slab_bytes=MIB))
        self.address = "unix:" + self.pool.config.socket_path
        self.hybrid_pool = self.pools.start(self.pools.config(size_bytes=64 * MIB, slab_bytes=MIB))
        self.hybrid_address = "unix:" + self.hybrid_pool.config.socket_path
        llama = write_tiny_llama(folder / "tiny-llama")
        qwen3_next = write_tiny_qwen3_next(folder / "tiny-qwen3-next")
        hybrid = {"dtype": HYBRID_DTYPE, "kv_cache_from_config": True}
        broken = {**hybrid, "extra": {"faults": {"skip_state_restore": True}}}
        self.a = Replica("A", llama, self.address, folder / "a.log")
        self.b = Replica("B", llama, self.address, folder / "b.log")
        self.h = Replica("H", qwen3_next, self.hybrid_address, folder / "h.log", hybrid)
        self.x = Replica("X", qwen3_next, self.hybrid_address, folder / "x.log", broken)
        self.n = Replica("N", llama, "none", folder / "n.log")
        self.g = Replica("G", qwen3_next, "none", folder / "g.log", hybrid)
        self.replicas = (self.a, self.b, self.h, self.x, self.n, self.g)

    def close(self) -> None:
        for replica in self.replicas:  # all stop at once, then each is waited for
            replica.end_input()
        for replica in self.replicas:
            replica.close()
        self.pools.close()


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMCluster]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cluster = VLLMCluster(tmp_path_factory.mktemp("vllm"))
    try:
        for replica in cluster.replicas:
            replica.wait_ready()
        yield cluster
    finally:
        cluster.close()
