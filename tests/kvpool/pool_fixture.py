"""Start real pool daemons for tests, on short private paths, and clean up after them."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

from kvshare import LLM
from kvshare.kvpool.connector import PoolConnector
from kvshare.kvpool.launch import PoolProcess, PoolProcessConfig
from kvshare.kvpool.paths import SHM_DIR

MIB = 1024 * 1024
# The folder that holds the `kvshare` package, for child processes that import it.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class PoolFactory:
    """Starts daemons; `close` stops every one still running and removes their files.

    Sockets live in a fresh folder under /tmp: pytest's tmp_path can exceed the
    107-byte limit of a Unix socket path.
    """

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="kvp-")
        # The daemons' runtime folder (published address, dead daemons' leftovers);
        # XDG_RUNTIME_DIR=folder makes it the clients' default too.
        self.runtime_dir = os.path.join(self.folder, "kvshare")
        self._processes: list[PoolProcess] = []
        self._arenas: list[str] = []

    def config(
        self, size_bytes: int = 4 * MIB, slab_bytes: int = MIB, max_client_fraction: float = 1.0
    ) -> PoolProcessConfig:
        arena_dir = SHM_DIR if os.path.isdir(SHM_DIR) else self.folder
        arena_path = os.path.join(arena_dir, f"kvshare-test-{uuid.uuid4().hex}.arena")
        self._arenas.append(arena_path)
        return PoolProcessConfig(
            size_bytes=size_bytes,
            slab_bytes=slab_bytes,
            socket_path=os.path.join(self.runtime_dir, f"{uuid.uuid4().hex[:8]}.sock"),
            arena_path=arena_path,
            max_client_fraction=max_client_fraction,
            runtime_dir=self.runtime_dir,
        )

    def start(self, config: PoolProcessConfig | None = None) -> PoolProcess:
        process = PoolProcess(config or self.config())
        process.start()
        self._processes.append(process)
        return process

    def close(self) -> None:
        for process in self._processes:
            process.stop()
        for path in self._arenas:
            if os.path.exists(path):
                os.unlink(path)
        shutil.rmtree(self.folder, ignore_errors=True)


def child_env() -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p),
    )


def hybrid_replica(pool: PoolProcess, device: str = "cpu") -> tuple[LLM, PoolConnector]:
    """A tiny-qwen3.5 engine (hybrid: KV and recurrent state) on `pool`, float32."""
    llm = LLM(
        "shape:tiny-qwen3.5",
        device=device,
        dtype="float32",
        kv_pool=pool.address,
        kv_cache_memory=8 << 20,
        max_num_batched_tokens=512,
    )
    connector = llm.engine.connector
    assert isinstance(connector, PoolConnector)
    return llm, connector
