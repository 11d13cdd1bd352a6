"""The remote tier's logic against an in-memory store (no Mooncake needed): publish after
commit without delaying it, fetch a lookup's missing tail and verify it, a slow store is a
bounded wait, bad configuration is a clear error; and `kvshare up --remote` reaches the pool."""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest

from kvshare.kvpool.client import PoolClient
from kvshare.kvpool.daemon import PoolDaemon
from kvshare.kvpool.launch import pool_command
from kvshare.kvpool.layout import LAYOUT_VERSION, checksum_constants, payload_checksum
from kvshare.kvpool.page import HEADER_BYTES, PageHeader
from kvshare.kvpool.remote import RemoteCache, RemoteConfig, RemoteTier, remote_name
from kvshare.serve.launcher import UpConfig
from tests.kvpool.pool_fixture import MIB, PoolFactory

PAYLOAD = 64 * 1024
SHAPE = {"payload_bytes": PAYLOAD, "segment_ends": [PAYLOAD]}
SEED = bytes(16)


class MemoryTier(RemoteTier):
    """Objects in a dict; `delay_s` makes every call slow."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.delay_s = 0.0

    def start(self) -> None:
        pass

    def register(self, address: int, nbytes: int) -> None:
        pass

    def exists(self, names: Sequence[str]) -> list[bool]:
        time.sleep(self.delay_s)
        return [n in self.objects for n in names]

    def put_from(
        self, names: Sequence[str], addresses: Sequence[int], sizes: Sequence[int]
    ) -> list[bool]:
        time.sleep(self.delay_s)
        for name, address, size in zip(names, addresses, sizes):
            self.objects.setdefault(name, ctypes.string_at(address, size))
        return [True] * len(names)

    def get_into(
        self, names: Sequence[str], addresses: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        time.sleep(self.delay_s)
        copied = []
        for name, address, size in zip(names, addresses, sizes):
            data = self.objects.get(name, b"")
            ctypes.memmove(address, data, min(size, len(data)))
            copied.append(len(data) if data else -704)
        return copied

    def remove(self, name: str) -> None:
        self.objects.pop(name, None)

    def close(self) -> None:
        pass


class InProcessPool:
    """A daemon with a remote tier over `tier`, on a thread of this process."""

    def __init__(self, factory: PoolFactory, tier: RemoteTier, timeout_s: float = 0.5) -> None:
        config = factory.config(size_bytes=4 * MIB, slab_bytes=MIB)
        remote = RemoteConfig("mooncake://127.0.0.1:1", fetch_timeout_s=timeout_s)
        self.daemon = PoolDaemon(config)
        self.daemon.remote = RemoteCache(remote, self.daemon.index, tier)
        self.address = f"unix:{config.socket_path}"
        self._loop: asyncio.AbstractEventLoop | None = None
        ready = threading.Event()

        def on_ready() -> None:
            self._loop = asyncio.get_running_loop()
            ready.set()

        self._thread = threading.Thread(
            target=lambda: asyncio.run(self.daemon.serve(on_ready, handle_signals=False)),
            daemon=True,
        )
        self._thread.start()
        assert ready.wait(10)
        deadline = time.monotonic() + 10
        while not self.remote_stats()["ready"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    def remote_stats(self) -> dict:
        client = PoolClient(self.address)
        try:
            return client.stats()["remote"]
        finally:
            client.close()

    def close(self) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self.daemon.stop)
        self._thread.join(10)


@pytest.fixture
def factory() -> Iterator[PoolFactory]:
    made = PoolFactory()
    yield made
    made.close()


def chain(count: int, start: int = 1) -> list[bytes]:
    return [n.to_bytes(16, "big") for n in range(start, start + count)]


def page_bytes(key: bytes, parent: bytes) -> bytes:
    """A valid page of `key`: header and payload with its checksum."""
    payload = np.random.default_rng(int.from_bytes(key, "big")).bytes(PAYLOAD)
    words = np.frombuffer(payload, dtype="<u8")
    checksum = payload_checksum(words, checksum_constants(key)).astype("<u8").tobytes()
    header = PageHeader(LAYOUT_VERSION, key, parent, PAYLOAD, checksum)
    return header.pack() + payload


def commit_pages(client: PoolClient, keys: list[bytes], parent: bytes = SEED) -> None:
    reservation = client.reserve(keys, PAYLOAD)
    checksums = []
    for page in reservation.pages:
        data = page_bytes(page.key, parent)
        client.arena.view(page.offset, len(data))[:] = data
        checksums.append(PageHeader.unpack(data).checksum)
        parent = page.key
    client.commit(keys, checksums, [p.offset for p in reservation.pages])


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_committed_pages_are_published_whole_without_delaying_the_commit(
    factory: PoolFactory,
) -> None:
    tier = MemoryTier()
    tier.delay_s = 1.0
    pool = InProcessPool(factory, tier)
    client = PoolClient(pool.address)
    try:
        keys = chain(3)
        started = time.monotonic()
        commit_pages(client, keys)
        assert time.monotonic() - started < 0.5  # the store takes 2 s: never waited for
        wait_until(lambda: len(tier.objects) == 3)
        parents = [SEED, *keys[:-1]]
        for key, parent in zip(keys, parents):
            assert tier.objects[remote_name(key)] == page_bytes(key, parent)
        assert client.stats()["lookups"] == 0  # the publisher's own reads are not counted
    finally:
        client.close()
        pool.close()


def test_a_lookup_fetches_verifies_and_commits_the_remote_continuation(
    factory: PoolFactory,
) -> None:
    tier = MemoryTier()
    keys = chain(4)
    parents = [SEED, *keys[:-1]]
    for key, parent in zip(keys, parents):
        tier.objects[remote_name(key)] = page_bytes(key, parent)
    broken = bytearray(page_bytes(keys[3], keys[2]))
    broken[HEADER_BYTES + 5] ^= 1
    tier.objects[remote_name(keys[3])] = bytes(broken)
    pool = InProcessPool(factory, tier)
    client = PoolClient(pool.address)
    try:
        commit_pages(client, keys[:1])  # the first chunk is local
        result = client.lookup(keys, page=SHAPE)
        assert [p.key for p in result.pages] == keys[:3] and result.remote_pages == 2
        for page, parent in zip(result.pages, parents):
            assert bytes(client.arena.view(page.offset, HEADER_BYTES + PAYLOAD)) == page_bytes(
                page.key, parent
            )
        stats = pool.remote_stats()
        assert (stats["fetch_hit_pages"], stats["fetch_corrupt_pages"]) == (2, 1)
        # Removed (in the background: the lookup's answer does not wait for it), so a good
        # copy can come.
        wait_until(lambda: remote_name(keys[3]) not in tier.objects)
        assert client.lookup(keys, page=SHAPE).remote_pages == 0  # local from now on
    finally:
        client.close()
        pool.close()


def test_a_slow_store_is_a_bounded_wait_and_the_pool_keeps_serving(
    factory: PoolFactory,
) -> None:
    tier = MemoryTier()
    keys = chain(2)
    tier.objects[remote_name(keys[0])] = page_bytes(keys[0], SEED)
    tier.delay_s = 3.0
    pool = InProcessPool(factory, tier, timeout_s=0.5)
    client, other = PoolClient(pool.address), PoolClient(pool.address)
    try:
        answered: list[float] = []
        waiter = threading.Thread(target=lambda: answered.append(lookup_seconds(client, keys)))
        waiter.start()
        time.sleep(0.1)
        started = time.monotonic()
        other.stats()  # the event loop answers others while the fetch waits
        assert time.monotonic() - started < 0.3
        waiter.join(10)
        assert answered and answered[0] < 2.0  # a miss after 0.5 s, not after the store's 3 s
        assert pool.remote_stats()["fetch_timeouts"] == 1
        assert lookup_seconds(other, keys) < 0.3  # backing off: not asked again for now
        assert pool.remote_stats()["fetch_skipped_down"] == 1
    finally:
        client.close()
        other.close()
        pool.close()


def lookup_seconds(client: PoolClient, keys: list[bytes]) -> float:
    started = time.monotonic()
    assert client.lookup(keys, page=SHAPE).pages == ()
    return time.monotonic() - started


@pytest.mark.parametrize(
    "url", ["redis://h:1", "mooncake://h", "mooncake://:5", "mooncake://h:5/x", "h:5"]
)
def test_a_bad_remote_url_is_a_clear_error(url: str) -> None:
    with pytest.raises(ValueError, match="mooncake://HOST:PORT"):
        RemoteConfig(url)


def test_kvshare_up_passes_the_remote_tier_to_its_pool() -> None:
    config = UpConfig.from_args(
        ["--remote", "mooncake://10.0.0.5:50051", "--remote-local-hostname", "10.0.0.7"]
    )
    assert config.pool_remote is not None
    assert config.pool_remote.master == ("10.0.0.5", 50051)
    assert config.pool_remote.local_hostname == "10.0.0.7"
    assert UpConfig.from_args([]).pool_remote is None
    factory = PoolFactory()
    try:
        pool = dataclasses.replace(factory.config(), remote=config.pool_remote)
        command = pool_command(pool)
        assert command[command.index("--remote") + 1] == "mooncake://10.0.0.5:50051"
        assert command[command.index("--remote-local-hostname") + 1] == "10.0.0.7"
    finally:
        factory.close()
