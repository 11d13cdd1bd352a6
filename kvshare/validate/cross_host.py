"""The cross-host check: two hosts share prefixes through the pool's remote tier (Mooncake).

On one machine, "two hosts" are two pool daemons with their own arenas and sockets, each
its own process and its own Mooncake client, and one replica on each; a Mooncake master is
started on loopback for the run. The check (`kvshare validate cross-host`):
- bytes: a prefix computed on host A is served on host B from the remote tier; B's pages
  are byte for byte A's pages, and B's greedy answer equals a replica's without any pool;
- corrupt: a remote page overwritten with wrong bytes is detected by B's daemon, counted,
  never served, and the request recomputed (same answer);
- master killed: requests on both hosts still succeed with the same answers, and lookups
  come back within the bounded wait;
- master down at start: both daemons start at once and serve their own pools.

`TwoHosts` is also what `kvshare bench cross-host` measures. `python -m
kvshare.validate.cross_host corrupt URL NAME OFFSET` overwrites one remote object (from a
process of its own: two Mooncake clients in one process copy memory directly).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from types import TracebackType

from kvshare.engine.sampling_params import SamplingParams
from kvshare.kvpool.client import PoolClient
from kvshare.kvpool.keys import chunk_keys
from kvshare.kvpool.launch import PoolProcess, PoolProcessConfig
from kvshare.kvpool.mooncake_master import MooncakeMaster, mooncake_missing
from kvshare.kvpool.page import HEADER_BYTES
from kvshare.kvpool.paths import SHM_DIR
from kvshare.kvpool.remote import RemoteConfig, parse_remote_url, remote_name
from kvshare.llm import LLM
from kvshare.ports import free_port
from kvshare.validate.result import CheckResult

_GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
_WAIT_S = 30.0


@dataclass(frozen=True)
class CrossHostConfig:
    model: str = "shape:tiny-llama"
    device: str = "cpu"
    dtype: str = "float32"
    chunk_tokens: int = 256
    pool_bytes: int = 64 << 20
    slab_bytes: int = 16 << 20
    segment_bytes: int = 128 << 20  # what each host lends to the cluster-wide store
    fetch_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1 or self.pool_bytes < self.slab_bytes:
            raise ValueError("chunk_tokens must be >= 1 and the pool at least one slab")


class TwoHosts:
    """A Mooncake master on loopback and two pool daemons using it as their remote tier
    (`master_url` None: a master that is not there). Use as a context manager."""

    def __init__(self, config: CrossHostConfig, master: bool = True) -> None:
        self.config = config
        self.master = MooncakeMaster() if master else None
        self.url = self.master.url if self.master else f"mooncake://127.0.0.1:{free_port()}"
        self.pools: list[PoolProcess] = []
        self._stack = contextlib.ExitStack()
        self.start_seconds = 0.0

    def __enter__(self) -> TwoHosts:
        try:
            if self.master is not None:
                self._stack.enter_context(self.master)
            folder = self._stack.enter_context(tempfile.TemporaryDirectory(prefix="kvs-xhost-"))
            started = time.monotonic()
            for host in ("a", "b"):
                pool = PoolProcess(self._pool_config(folder, host))
                pool.start()
                self._stack.callback(pool.stop)
                self.pools.append(pool)
            self.start_seconds = time.monotonic() - started
            if self.master is not None:
                for index in range(2):
                    self.wait_for(index, "ready", 1)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for pool in self.pools:  # together: each takes a moment to leave the store
            with contextlib.suppress(ProcessLookupError, RuntimeError):
                os.kill(pool.pid, 15)
        self._stack.close()

    def _pool_config(self, folder: str, host: str) -> PoolProcessConfig:
        remote = RemoteConfig(
            self.url,
            local_hostname="127.0.0.1",
            segment_bytes=self.config.segment_bytes,
            fetch_timeout_s=self.config.fetch_timeout_s,
        )
        return PoolProcessConfig(
            size_bytes=self.config.pool_bytes,
            slab_bytes=self.config.slab_bytes,
            socket_path=f"{folder}/{host}.sock",
            arena_path=f"{SHM_DIR}/kvshare-xhost-{uuid.uuid4().hex[:12]}.arena",
            max_client_fraction=1.0,
            remote=remote,
        )

    def replica(self, host: int | None) -> LLM:
        """A replica on host `host`'s pool (None: without any pool)."""
        return LLM(
            self.config.model,
            device=self.config.device,
            dtype=self.config.dtype,
            kv_pool=self.pools[host].address if host is not None else None,
            chunk_tokens=self.config.chunk_tokens,
        )

    def stats(self, host: int) -> dict:
        client = PoolClient(self.pools[host].address)
        try:
            return client.stats()
        finally:
            client.close()

    def wait_for(self, host: int, counter: str, at_least: float) -> dict:
        deadline = time.monotonic() + _WAIT_S
        while (stats := self.stats(host)["remote"])[counter] < at_least:
            if time.monotonic() > deadline:
                raise TimeoutError(f"host {host}: {counter} stayed below {at_least}: {stats}")
            time.sleep(0.05)
        return stats


def prompt_tokens(seed: int, length: int, vocab: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def corrupt_remote_object(url: str, name: str, offset: int) -> int:
    """Flip the byte at `offset` of remote object `name`; 0 when done. Run it in a process
    of its own (`python -m kvshare.validate.cross_host corrupt ...`)."""
    from mooncake.store import MooncakeDistributedStore

    host, port = parse_remote_url(url)
    store = MooncakeDistributedStore()
    config = {
        "local_hostname": "127.0.0.1",
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "master_server_addr": f"{host}:{port}",
        "global_segment_size": 0,
        "local_buffer_size": 16 << 20,
    }
    if store.setup(config) != 0:
        return 1
    data = bytearray(store.get(name))
    if len(data) <= offset:
        return 2
    data[offset] ^= 0xFF
    return 0 if store.upsert(name, bytes(data)) == 0 else 3


def corrupt_in_child(url: str, name: str, offset: int) -> int:
    return subprocess.run(
        [sys.executable, "-m", "kvshare.validate.cross_host", "corrupt", url, name, str(offset)],
        env=_child_env(),
        timeout=60,
    ).returncode


def _child_env() -> dict[str, str]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))
    )


def run_cross_host_check(config: CrossHostConfig | None = None) -> list[CheckResult]:
    config = config or CrossHostConfig()
    names = ("bytes", "corrupt", "master_killed", "master_down")
    if why := mooncake_missing():
        return [CheckResult(f"cross_host.{n}", skipped=why) for n in names]
    results = []
    with TwoHosts(config) as hosts:
        on_a, on_b, alone = hosts.replica(0), hosts.replica(1), hosts.replica(None)
        results.append(_guarded("bytes", lambda r: _bytes(hosts, on_a, on_b, alone, r)))
        results.append(_guarded("corrupt", lambda r: _corrupt(hosts, on_a, on_b, alone, r)))
        results.append(_guarded("master_killed", lambda r: _killed(hosts, on_a, on_b, alone, r)))
    results.append(_guarded("master_down", lambda r: _down(config, r)))
    return results


def _guarded(name: str, run) -> CheckResult:  # type: ignore[no-untyped-def]
    result = CheckResult(f"cross_host.{name}")
    try:
        run(result)
    except Exception as exc:
        result.fail(f"{type(exc).__name__}: {exc}")
    return result


def _chunked_prompt(hosts: TwoHosts, seed: int, chunks: int = 5) -> list[int]:
    return prompt_tokens(seed, chunks * hosts.config.chunk_tokens + 20)


def _bytes(hosts: TwoHosts, on_a: LLM, on_b: LLM, alone: LLM, result: CheckResult) -> None:
    tokens = _chunked_prompt(hosts, seed=11)
    published = hosts.stats(0)["remote"]["published_pages"]
    on_a.generate([tokens], _GREEDY)
    hosts.wait_for(0, "published_pages", published + 5)
    served = on_b.generate([tokens], _GREEDY)[0]
    expected = alone.generate([tokens], _GREEDY)[0]
    result.counts["remote_hit_tokens"] = served.pool_remote_hit_tokens
    result.expect(served.pool_remote_hit_tokens >= 1024, "host B restored < 1024 tokens remotely")
    result.expect(served.token_ids == expected.token_ids, "host B's answer differs from no pool")
    keys = chunk_keys(on_a.engine.connector.namespace, tokens)
    pages = [_page_bytes(hosts.pools[i].address, keys) for i in range(2)]
    result.counts["pages_compared"] = len(pages[1])
    result.expect(len(pages[1]) == len(keys), "host B's pool lacks pages of the prefix")
    result.expect(pages[0] == pages[1], "host B's pages differ from host A's")


def _page_bytes(address: str, keys: list[bytes]) -> list[bytes]:
    client = PoolClient(address)
    try:
        found = client.lookup(keys)
        copies = [
            bytes(client.arena.view(p.offset, HEADER_BYTES + p.payload_bytes)) for p in found.pages
        ]
        client.release(found.lease)
        return copies
    finally:
        client.close()


def _corrupt(hosts: TwoHosts, on_a: LLM, on_b: LLM, alone: LLM, result: CheckResult) -> None:
    tokens = _chunked_prompt(hosts, seed=12)
    published = hosts.stats(0)["remote"]["published_pages"]
    on_a.generate([tokens], _GREEDY)
    hosts.wait_for(0, "published_pages", published + 5)
    first = chunk_keys(on_a.engine.connector.namespace, tokens)[0]
    status = corrupt_in_child(hosts.url, remote_name(first), HEADER_BYTES + 1000)
    result.expect(status == 0, f"could not overwrite the remote page (status {status})")
    before = hosts.stats(1)["remote"]["fetch_corrupt_pages"]
    served = on_b.generate([tokens], _GREEDY)[0]
    detected = hosts.stats(1)["remote"]["fetch_corrupt_pages"] - before
    result.counts["detected"] = detected
    result.expect(detected == 1, f"{detected} corrupt remote pages detected, expected 1")
    result.expect(served.pool_hit_tokens == 0, "a prefix behind a corrupt page was served")
    expected = alone.generate([tokens], _GREEDY)[0]
    result.expect(served.token_ids == expected.token_ids, "the recomputed answer differs")


def _killed(hosts: TwoHosts, on_a: LLM, on_b: LLM, alone: LLM, result: CheckResult) -> None:
    assert hosts.master is not None
    hosts.master.kill()
    client = PoolClient(hosts.pools[1].address)
    shape = {"payload_bytes": 8192, "segment_ends": [8192]}
    slowest = 0.0
    for _ in range(3):
        started = time.monotonic()
        client.lookup([os.urandom(16) for _ in range(4)], page=shape)
        slowest = max(slowest, time.monotonic() - started)
    client.close()
    result.counts["slowest_lookup_s"] = round(slowest, 2)
    result.expect(slowest < 2.5, f"a lookup took {slowest:.1f} s with the master gone")
    tokens = _chunked_prompt(hosts, seed=13)
    expected = alone.generate([tokens], _GREEDY)[0].token_ids
    for llm in (on_a, on_b):
        result.expect(llm.generate([tokens], _GREEDY)[0].token_ids == expected, "answer differs")
    again = on_b.generate([tokens], _GREEDY)[0]
    result.expect(again.gpu_hit_tokens + again.pool_hit_tokens >= 1024, "no reuse on host B")


def _down(config: CrossHostConfig, result: CheckResult) -> None:
    with TwoHosts(dataclasses.replace(config), master=False) as hosts:
        result.counts["start_s"] = round(hosts.start_seconds, 2)
        result.expect(hosts.start_seconds < 10, f"two daemons took {hosts.start_seconds:.1f} s")
        on_a = hosts.replica(0)
        tokens = _chunked_prompt(hosts, seed=14)
        on_a.generate([tokens], _GREEDY)
        stats = hosts.stats(0)
        result.expect(stats["committed_keys"] >= 5, "host A's local pool stored nothing")
        result.expect(not stats["remote"]["ready"], "the remote tier says ready without a master")


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "corrupt":
        return corrupt_remote_object(argv[1], argv[2], int(argv[3]))
    print("usage: python -m kvshare.validate.cross_host corrupt URL NAME OFFSET", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
