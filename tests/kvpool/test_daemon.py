"""The daemon and client together: real processes, a real socket, a real mapped arena."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import stat
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import xxhash

from kvshare.kvpool.arena import Arena
from kvshare.kvpool.client import PageRef, PoolClient, PoolError, PoolUnavailable
from kvshare.kvpool.page import HEADER_BYTES, PageHeader, slot_bytes_for
from kvshare.kvpool.protocol import LENGTH, decode_body, encode_frame
from tests.kvpool.pool_fixture import MIB, PoolFactory, child_env

PAYLOAD = 8192
SLOT = slot_bytes_for(PAYLOAD)  # 12 KiB: 85 slots per 1 MiB slab
PARENT = bytes(16)


@pytest.fixture
def connect() -> Iterator[Callable[..., PoolClient]]:
    clients: list[PoolClient] = []

    def make(address: str, **options: float) -> PoolClient:
        client = PoolClient(address, **options)
        client.connect()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def keys(start: int, count: int) -> list[bytes]:
    return [n.to_bytes(16, "big") for n in range(start, start + count)]


def page_content(key: bytes) -> tuple[bytes, bytes]:
    """A unique payload per key, and its checksum."""
    payload = np.random.default_rng(int.from_bytes(key, "big")).bytes(PAYLOAD)
    return payload, xxhash.xxh3_128_digest(payload)


def write_page(arena: Arena, page: PageRef) -> bytes:
    payload, checksum = page_content(page.key)
    header = PageHeader(1, page.key, PARENT, PAYLOAD, checksum)
    arena.view(page.offset, HEADER_BYTES)[:] = header.pack()
    arena.view(page.offset + HEADER_BYTES, PAYLOAD)[:] = payload
    return checksum


def verify_page(arena: Arena, page: PageRef) -> None:
    payload, checksum = page_content(page.key)
    assert page.checksum == checksum
    header = PageHeader.unpack(arena.view(page.offset, HEADER_BYTES))
    assert header == PageHeader(1, page.key, PARENT, PAYLOAD, checksum)
    assert bytes(arena.view(page.offset + HEADER_BYTES, PAYLOAD)) == payload


def store(client: PoolClient, stored: list[bytes]) -> list[PageRef]:
    reservation = client.reserve(stored, PAYLOAD)
    checksums = [write_page(client.arena, page) for page in reservation.pages]
    client.commit(
        [p.key for p in reservation.pages], checksums, [p.offset for p in reservation.pages]
    )
    return list(reservation.pages)


def verify_all(client: PoolClient, candidates: list[bytes]) -> int:
    """Look up each candidate alone; verify every byte of each hit. Returns the hits."""
    hits = 0
    for key in candidates:
        result = client.lookup([key])
        for page in result.pages:
            verify_page(client.arena, page)
            hits += 1
        client.release(result.lease)
    return hits


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_full_pool_every_byte_through_many_eviction_cycles(
    pools: PoolFactory, connect: Callable[..., PoolClient]
) -> None:
    """Fill every slot, verify every byte, cycle eviction, and end with every slab free."""
    pool = pools.start(pools.config(size_bytes=3 * MIB + MIB // 2, slab_bytes=MIB))
    client = connect(pool.address)
    total = 3 * (MIB // SLOT)
    first = store(client, keys(0, total + 40))  # 40 more than fit: dropped, no error
    assert len(first) == total
    offsets = sorted(page.offset for page in first)
    assert len(set(offsets)) == total and offsets[-1] + SLOT <= 3 * MIB
    stats = client.stats()
    assert (stats["pages"], stats["free"], stats["committed"]) == (total, 0, total)
    assert stats["dropped_keys"] == 40
    assert stats["pages"] * SLOT <= stats["arena_bytes"] == client.arena.size_bytes
    assert verify_all(client, keys(0, total + 40)) == total

    stored = total + 40
    for _ in range(6):
        fresh = keys(stored, 100)
        stored += 100
        assert len(store(client, fresh)) == 100  # each one evicts an older page
        assert verify_all(client, keys(0, stored)) == total
    stats = client.stats()
    assert stats["evictions"] == 600 and stats["committed"] == total

    assert client.clear() == total
    stats = client.stats()
    assert (stats["committed"], stats["reserved"], stats["pages"]) == (0, 0, 0)
    assert stats["free_slabs"] == stats["slab_count"] == 3


def test_a_writer_killed_before_commit_never_exposes_its_page(
    pools: PoolFactory, connect: Callable[..., PoolClient]
) -> None:
    """docs/architecture.md F5: reserve -> write -> (killed) -> the key is never returned."""
    pool = pools.start()
    key = keys(7, 1)[0]
    writer = (
        "import os, signal, sys\n"
        "from kvshare.kvpool.client import PoolClient\n"
        "client = PoolClient(sys.argv[1]); client.connect()\n"
        "page = client.reserve([bytes.fromhex(sys.argv[2])], 8192).pages[0]\n"
        "client.arena.view(page.offset, 4096 + 8192)[:] = bytes([0xEE]) * (4096 + 8192)\n"
        "print(page.offset, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", writer, pool.address, key.hex()],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=30,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert int(result.stdout) >= 0
    reader = connect(pool.address)
    assert reader.lookup([key]).pages == ()
    wait_for(lambda: reader.stats()["reserved"] == 0)
    assert reader.lookup([key]).pages == ()
    reservation = reader.reserve([key], PAYLOAD)
    assert [page.key for page in reservation.pages] == [key] and reservation.present == ()


def test_a_store_that_fails_in_process_is_aborted_and_invisible(
    pools: PoolFactory, connect: Callable[..., PoolClient]
) -> None:
    pool = pools.start()
    client = connect(pool.address)
    stored = keys(0, 3)
    reservation = client.reserve(stored, PAYLOAD)
    try:
        write_page(client.arena, reservation.pages[0])
        raise RuntimeError("copy failed")
    except RuntimeError:
        assert client.abort(stored) == 3
    assert client.lookup(stored).pages == ()
    assert client.stats()["reserved"] == 0


def test_a_pool_full_of_pinned_pages_drops_stores_without_error(
    pools: PoolFactory, connect: Callable[..., PoolClient]
) -> None:
    """docs/architecture.md F11: allocation failure is a counted skip, never an error or a reused slot."""
    pool = pools.start(pools.config(size_bytes=2 * MIB, slab_bytes=MIB))
    reader, writer = connect(pool.address), connect(pool.address)
    total = 2 * (MIB // SLOT)
    store(writer, keys(0, total))
    lease = reader.lookup(keys(0, total))
    assert len(lease.pages) == total
    reservation = writer.reserve(keys(1000, 50), PAYLOAD)
    assert (reservation.pages, reservation.present, reservation.dropped) == ((), (), 50)
    for page in lease.pages:
        verify_page(reader.arena, page)
    assert reader.release(lease.lease) is True
    assert len(store(writer, keys(1000, 50))) == 50
    assert writer.stats()["evictions"] == 50


def test_disconnect_drops_leases_and_reservations(
    pools: PoolFactory, connect: Callable[..., PoolClient]
) -> None:
    pool = pools.start()
    owner, observer = connect(pool.address), connect(pool.address)
    store(owner, keys(0, 10))
    owner.lookup(keys(0, 10))
    owner.reserve(keys(100, 5), PAYLOAD)
    stats = observer.stats()
    assert (stats["pinned"], stats["leases"], stats["reserved"]) == (10, 1, 5)
    owner.close()
    wait_for(lambda: observer.stats()["leases"] == 0)
    stats = observer.stats()
    assert (stats["pinned"], stats["reserved"], stats["committed"]) == (0, 0, 10)
    assert observer.clear() == 10


def test_daemon_restart_fails_fast_then_reconnects_to_the_new_generation(
    pools: PoolFactory, connect: Callable[..., PoolClient]
) -> None:
    config = pools.config()
    pool = pools.start(config)
    client = connect(pool.address, timeout=2.0, retry_interval=1.5)
    remapped: list[Arena] = []
    client.on_remap(remapped.append)
    first_generation = client.generation
    store(client, keys(0, 4))
    lease = client.lookup(keys(0, 4)).lease
    pool.stop()
    assert not os.path.exists(config.socket_path) and not os.path.exists(config.arena_path)

    start = time.monotonic()
    with pytest.raises(PoolUnavailable):  # the link is dead
        client.lookup(keys(0, 4))
    assert not client.connected
    with pytest.raises(PoolUnavailable):  # the next call tries to reconnect: refused
        client.lookup(keys(0, 4))
    attempt = time.monotonic()
    assert attempt - start < 0.25

    pools.start(config)
    assert time.monotonic() - attempt < 1.5, "daemon restart too slow for this test"
    with pytest.raises(PoolUnavailable):  # within retry_interval: no attempt at all
        client.lookup(keys(0, 4))
    time.sleep(max(0.0, attempt + 1.5 - time.monotonic()))
    assert client.lookup(keys(0, 4)).pages == ()  # a new, empty pool
    assert client.generation != first_generation
    assert remapped == [client.arena]
    assert client.release(lease) is False  # that lease died with the old daemon
    assert len(store(client, keys(0, 4))) == 4
    assert verify_all(client, keys(0, 4)) == 4


def test_daemon_killed_leaves_files_that_a_restart_replaces(
    pools: PoolFactory, connect: Callable[..., PoolClient]
) -> None:
    config = pools.config()
    pool = pools.start(config)
    pool.kill()
    assert os.path.exists(config.socket_path) and os.path.exists(config.arena_path)
    pools.start(config)
    client = connect(f"unix:{config.socket_path}")
    assert len(store(client, keys(0, 2))) == 2


def test_a_hung_daemon_never_blocks_a_client_past_its_timeout(
    pools: PoolFactory, connect: Callable[..., PoolClient]
) -> None:
    pool = pools.start()
    client = connect(pool.address, timeout=0.4, retry_interval=0.0)
    os.kill(pool.pid, signal.SIGSTOP)
    try:
        for _ in range(2):  # an exchange on the live link, then a reconnect attempt
            start = time.monotonic()
            with pytest.raises(PoolUnavailable):
                client.stats()
            assert time.monotonic() - start < 1.0
    finally:
        os.kill(pool.pid, signal.SIGCONT)
    assert client.stats()["connections"] >= 1


def test_a_closed_client_stays_closed_until_connect(
    pools: PoolFactory, connect: Callable[..., PoolClient]
) -> None:
    pool = pools.start()
    client = connect(pool.address, retry_interval=0.0)
    client.close()
    with pytest.raises(PoolUnavailable):
        client.stats()
    client.connect()
    assert client.stats()["connections"] >= 1


def test_no_daemon_at_all_is_pool_unavailable(pools: PoolFactory) -> None:
    client = PoolClient(os.path.join(pools.folder, "missing.sock"), timeout=0.5)
    start = time.monotonic()
    with pytest.raises(PoolUnavailable):
        client.connect()
    with pytest.raises(PoolUnavailable):
        client.lookup(keys(0, 1))
    with pytest.raises(PoolUnavailable):
        _ = client.arena
    assert time.monotonic() - start < 1.0


def _raw_exchange(sock: socket.socket, message: dict) -> dict:
    sock.sendall(encode_frame(message))
    return _raw_read(sock)


def _raw_read(sock: socket.socket) -> dict:
    header = sock.recv(LENGTH.size, socket.MSG_WAITALL)
    (length,) = LENGTH.unpack(header)
    return decode_body(sock.recv(length, socket.MSG_WAITALL))


def _raw_socket(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    sock.connect(path)
    return sock


@pytest.mark.parametrize(
    "message",
    [
        {"op": "fly", "id": 1},
        {"id": 2},
        {"op": "lookup", "id": 3},
        {"op": "lookup", "id": 4, "keys": [b"short"]},
        {"op": "lookup", "id": 5, "keys": ["text key 16 char"]},
        {"op": "reserve", "id": 6, "keys": [bytes(16)], "payload_bytes": "8192"},
        {"op": "reserve", "id": 7, "keys": [bytes(16)], "payload_bytes": 0},
        {"op": "reserve", "id": 8, "keys": [bytes(16)], "payload_bytes": 1 << 40},
        {"op": "commit", "id": 9, "keys": [bytes(16)], "checksums": [b""]},
        {"op": "commit", "id": 10, "keys": [bytes(16)], "checksums": "x"},
        {"op": "release", "id": 11, "lease": 12345},
        {"op": "release", "id": 12, "lease": True},
        {"op": "reserve", "id": 13, "keys": [bytes(16)], "payload_bytes": 8, "extends": [b"s"]},
        {"op": "reserve", "id": 14, "keys": [bytes(16)], "payload_bytes": 8, "extends": b"k"},
    ],
)
def test_a_malformed_request_gets_an_error_and_the_connection_lives(
    pools: PoolFactory, message: dict
) -> None:
    pool = pools.start()
    with _raw_socket(pool.config.socket_path) as sock:
        response = _raw_exchange(sock, message)
        assert response["ok"] is False and response["id"] == message.get("id")
        assert isinstance(response["error"], str) and response["error"]
        assert _raw_exchange(sock, {"op": "hello", "id": 99})["ok"] is True


def test_a_non_map_frame_gets_an_error_and_the_connection_lives(pools: PoolFactory) -> None:
    pool = pools.start()
    with _raw_socket(pool.config.socket_path) as sock:
        body = b"\x93\x01\x02\x03"  # msgpack [1, 2, 3]
        sock.sendall(LENGTH.pack(len(body)) + body)
        assert _raw_read(sock)["ok"] is False
        assert _raw_exchange(sock, {"op": "hello", "id": 1})["ok"] is True


@pytest.mark.parametrize(
    "frame",
    [
        LENGTH.pack(0xFFFFFFFF) + b"x",  # over the frame limit
        LENGTH.pack(1) + b"\xc1",  # not msgpack
    ],
)
def test_an_unparseable_frame_closes_only_that_connection(
    pools: PoolFactory, connect: Callable[..., PoolClient], frame: bytes
) -> None:
    pool = pools.start()
    bystander = connect(pool.address)
    store(bystander, keys(0, 2))
    lease = bystander.lookup(keys(0, 2))
    with _raw_socket(pool.config.socket_path) as sock:
        sock.sendall(frame)
        assert sock.recv(1) == b""  # the daemon closed this connection
    assert len(bystander.lookup(keys(0, 2)).pages) == 2
    assert bystander.stats()["leases"] == 2  # the bystander's lease survived
    assert bystander.release(lease.lease) is True


def test_contract_violations_raise_pool_error_not_unavailable(
    pools: PoolFactory, connect: Callable[..., PoolClient]
) -> None:
    pool = pools.start()
    client = connect(pool.address)
    with pytest.raises(PoolError):
        client.commit(keys(0, 1), [b""])
    with pytest.raises(PoolError):
        client.reserve(keys(0, 1), 8 * MIB)
    assert client.connected
    assert client.release(0) is False  # "nothing hit" lease


def test_socket_and_arena_are_owner_only_and_removed_on_sigint(pools: PoolFactory) -> None:
    config = pools.config()
    pool = pools.start(config)
    assert stat.S_IMODE(os.stat(config.socket_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(config.arena_path).st_mode) == 0o600
    assert os.stat(config.arena_path).st_size == config.size_bytes
    os.kill(pool.pid, signal.SIGINT)
    assert pool.wait(timeout=10) == 0
    assert not os.path.exists(config.socket_path)
    assert not os.path.exists(config.arena_path)


def test_a_client_that_never_reads_does_not_hold_up_shutdown(pools: PoolFactory) -> None:
    pool = pools.start()
    with _raw_socket(pool.config.socket_path) as sock:
        sock.setblocking(False)
        frame = encode_frame({"op": "stats", "id": 1})
        with pytest.raises(BlockingIOError):  # until both socket buffers are full
            for _ in range(1_000_000):
                sock.send(frame)
        time.sleep(0.2)
        start = time.monotonic()
        assert pool.stop(timeout=5.0) == 0
        assert time.monotonic() - start < 3.0


def test_lookup_of_1024_keys_is_one_fast_round_trip(
    pools: PoolFactory, connect: Callable[..., PoolClient]
) -> None:
    pool = pools.start(pools.config(size_bytes=16 * MIB, slab_bytes=16 * MIB))
    client = connect(pool.address)
    chain = keys(0, 1024)
    reservation = client.reserve(chain, 4096)
    client.commit(chain, [b"c" * 16] * 1024)
    assert len(reservation.pages) == 1024
    timings = []
    for _ in range(200):
        start = time.perf_counter()
        result = client.lookup(chain)
        timings.append(time.perf_counter() - start)
        assert len(result.pages) == 1024
        client.release(result.lease)
    median = statistics.median(timings)
    print(f"lookup of 1,024 keys: median {median * 1e3:.3f} ms over {len(timings)} round trips")
    assert client.stats()["lookups"] == 200
    assert median < 0.005


def test_one_client_reserves_and_pins_at_most_its_share(
    pools: PoolFactory, connect: Callable[..., PoolClient]
) -> None:
    """One greedy client cannot take the pool: past half of it, its reserves come back
    short and its lookups shorter (counted, never errors); the other client still stores."""
    pool = pools.start(pools.config(max_client_fraction=0.5))
    greedy, other = connect(pool.address), connect(pool.address)
    total = 4 * (MIB // SLOT)
    share = (2 * MIB) // SLOT
    reservation = greedy.reserve(keys(0, total), PAYLOAD)
    assert (len(reservation.pages), reservation.dropped) == (share, total - share)
    assert greedy.stats()["quota_dropped_keys"] == total - share
    greedy.abort([p.key for p in reservation.pages])
    assert len(store(greedy, keys(0, total))) == share  # committed pages are no one's
    assert len(store(other, keys(total, total))) == share
    held = greedy.lookup(keys(0, share))
    assert len(held.pages) == share
    assert greedy.lookup(keys(total, share)).pages == ()  # no room left in its share
    assert greedy.reserve(keys(5000, 1), PAYLOAD).dropped == 1
    assert greedy.stats()["quota_cut_keys"] == share
    # The other client's share is untouched: it stores, evicting its own unpinned pages.
    assert len(store(other, keys(2 * total, share))) == share
    for page in held.pages:
        verify_page(greedy.arena, page)
    assert greedy.release(held.lease) is True
    assert len(greedy.lookup(keys(0, share)).pages) == share


def test_connections_past_max_clients_are_refused_as_pool_down(
    pools: PoolFactory, connect: Callable[..., PoolClient]
) -> None:
    pool = pools.start(dataclasses.replace(pools.config(), max_clients=2))
    first, second = connect(pool.address), connect(pool.address)
    third = PoolClient(pool.address, retry_interval=0.0)
    with pytest.raises(PoolUnavailable, match="at most 2 clients"):
        third.connect()
    with pytest.raises(PoolUnavailable):
        third.lookup(keys(0, 1))
    assert first.stats()["refused_connections"] == 2
    second.close()
    wait_for(lambda: first.stats()["connections"] == 1)
    assert third.lookup(keys(0, 1)).pages == ()
    third.close()


def _foreign_owner(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `path` look owned by another user: chown as root, else pretend to be another."""
    if os.getuid() == 0:
        os.chown(path, 65534, 65534)
    else:
        monkeypatch.setattr(os, "getuid", lambda: 65534)


def test_a_client_refuses_a_socket_of_another_user(
    pools: PoolFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pool = pools.start()
    _foreign_owner(pool.config.socket_path, monkeypatch)
    client = PoolClient(pool.address)
    with pytest.raises(PoolUnavailable, match="not a socket of this user"):
        client.connect()
    assert not client.connected
    assert "refusing the pool" in caplog.text


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the arena to another user")
def test_a_client_refuses_to_map_an_arena_of_another_user(
    pools: PoolFactory, caplog: pytest.LogCaptureFixture
) -> None:
    pool = pools.start()
    os.chown(pool.config.arena_path, 65534, 65534)
    client = PoolClient(pool.address)
    with pytest.raises(PoolUnavailable, match=r"untrusted.*owned by uid 65534"):
        client.connect()
    assert not client.connected
    assert "refusing the pool" in caplog.text
