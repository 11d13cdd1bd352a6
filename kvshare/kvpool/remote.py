"""The pool's second tier: pages shared between hosts through a remote store (Mooncake Store).

One daemon per host keeps its arena and index; `RemoteCache` sits behind that index:
- publish: pages committed by this host's replicas are copied to the remote store in the
  background (header included, so the page checksum verifies them on any host), only those
  the store does not have yet. A commit never waits for it.
- fetch: a lookup whose run ends locally asks the store for the continuation of its chain,
  copies the hits straight into slots reserved in the arena, verifies header and checksum,
  and commits them; the lookup that follows sees ordinary pool pages.

Invariants:
- The event loop never calls the store: every store call runs on a worker thread, and the
  loop waits for a fetch at most `fetch_timeout_s` (then answers from the local pool).
- A slot the store writes into (fetch) or reads from (publish) stays reserved or pinned
  until that call has returned, whatever the loop gave up waiting for meanwhile.
- A fetched page is committed only if its header names the key, the payload size and the
  chain parent the lookup expects and its payload checksum verifies; anything else is
  aborted, counted and logged, and its remote copy removed (best effort) so a good one can
  be published again.
- Every failure of the store (down at start, gone mid-run, slow, corrupt) is a local-only
  lookup, a log line and a counter; never an error answered to a client.

`mooncake` is imported only when a `MooncakeTier` starts, so the pool runs without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import queue
import socket
import threading
import time
import urllib.parse
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvshare.kvpool.arena import Arena
from kvshare.kvpool.index import PoolIndex, PoolRequestError
from kvshare.kvpool.keys import KEY_BYTES
from kvshare.kvpool.page import HEADER_BYTES, PageFormatError, PageHeader

log = logging.getLogger(__name__)

T = TypeVar("T")

# The index connections of the daemon's own readers and writers (clients count from 1).
FETCH_CONN = 0
PUBLISH_CONN = -1
# Remote object names: the chunk key (which hashes the namespace in) under the page format.
_NAME_PREFIX = "kvshare/page2/"
_PUBLISH_QUEUE_KEYS = 8192  # keys waiting to be published; more are dropped and counted
_PUBLISH_BATCH_KEYS = 64
UNREPORTED_KEYS = 1 << 16  # fetched pages remembered until a lookup answers with them
_RETRY_START_S = 10.0  # a store unreachable at start is tried again this often
_PROBE_TIMEOUT_S = 1.0
# After a failed call the store is left alone this long: lookups do not wait on it and
# commits are not published meanwhile (a store whose master died fails each call slowly).
_BACKOFF_S = 5.0

COUNTERS = (
    "fetch_lookups",
    "fetch_hit_pages",
    "fetch_hit_bytes",
    "fetch_miss_pages",
    "fetch_corrupt_pages",
    "fetch_lost_pages",
    "fetch_failures",
    "fetch_timeouts",
    "fetch_skipped_busy",
    "fetch_skipped_down",
    "fetch_dropped_pages",
    "published_pages",
    "published_bytes",
    "publish_present_pages",
    "publish_failures",
    "publish_dropped_pages",
    "start_failures",
    "fetch_copy_seconds",  # in the store's get (for the hit-latency model)
    "fetch_verify_seconds",  # checking fetched pages' headers and checksums
)


class RemoteTierError(Exception):
    """The remote store failed a call or cannot be reached."""


class RemoteTier(ABC):
    """A store of named byte objects shared between hosts.

    Contract: every method blocks and is called from a worker thread, never from an event
    loop; calls may come from two threads at once (fetch and publish). A failure of the
    whole call raises RemoteTierError; per-object results are in the return values.
    Objects are immutable once put: a put of an existing name leaves it as it is.
    """

    @abstractmethod
    def start(self) -> None:
        """Connect; RemoteTierError if the store cannot be reached."""

    @abstractmethod
    def register(self, address: int, nbytes: int) -> None:
        """Make [address, address + nbytes) usable by `put_from` and `get_into`."""

    @abstractmethod
    def exists(self, names: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def put_from(
        self, names: Sequence[str], addresses: Sequence[int], sizes: Sequence[int]
    ) -> list[bool]:
        """Store each object from registered memory; per object whether it is stored."""

    @abstractmethod
    def get_into(
        self, names: Sequence[str], addresses: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """Copy each object into registered memory; per object its byte count, < 0 if failed."""

    @abstractmethod
    def remove(self, name: str) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


@dataclass(frozen=True)
class RemoteConfig:
    """`url`: mooncake://HOST:PORT, the Mooncake master's RPC address. `local_hostname`: the
    address other hosts reach this one at (None: the address of the route to the master).
    `segment_bytes`: memory this host lends to the cluster-wide store. `fetch_timeout_s`:
    how long a lookup waits for the remote tier before it answers from the local pool."""

    url: str
    local_hostname: str | None = None
    segment_bytes: int = 1 << 30
    fetch_timeout_s: float = 1.0
    max_pending_fetches: int = 4

    def __post_init__(self) -> None:
        parse_remote_url(self.url)
        if self.segment_bytes <= 0:
            raise ValueError(f"remote segment size must be > 0, got {self.segment_bytes}")
        if not 0 < self.fetch_timeout_s <= 30:
            raise ValueError(
                f"remote fetch timeout must be in (0, 30] s, got {self.fetch_timeout_s}"
            )
        if self.max_pending_fetches < 1:
            raise ValueError(f"max_pending_fetches must be >= 1, got {self.max_pending_fetches}")

    @property
    def master(self) -> tuple[str, int]:
        return parse_remote_url(self.url)


def parse_remote_url(url: str) -> tuple[str, int]:
    """(host, port) of mooncake://HOST:PORT; ValueError for anything else."""
    parsed = urllib.parse.urlsplit(url)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme != "mooncake" or not parsed.hostname or port is None or parsed.path:
        raise ValueError(f"remote tier must be mooncake://HOST:PORT, got {url!r}")
    return parsed.hostname, port


def remote_name(key: bytes) -> str:
    return _NAME_PREFIX + key.hex()


def route_address(host: str, port: int) -> str:
    """This host's address on the route to host:port (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


class MooncakeTier(RemoteTier):
    """Mooncake Store over TCP, with P2P handshakes (no etcd): a client of the master at
    `config.url` that lends `config.segment_bytes` of memory to the cluster."""

    def __init__(self, config: RemoteConfig) -> None:
        self.config = config
        self._store: Any = None
        self._closed = False

    def start(self) -> None:
        host, port = self.config.master
        # setup() waits about 90 s for a master that does not answer: probe it first.
        try:
            socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S).close()
        except OSError as error:
            raise RemoteTierError(f"mooncake master {host}:{port} unreachable: {error}") from None
        # Mooncake logs every connection at INFO to stderr; its errors are enough here.
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as error:
            raise RemoteTierError(
                f"the remote tier needs Mooncake (pip install 'kvshare[mooncake]'): {error}"
            ) from None
        store = MooncakeDistributedStore()
        local = self.config.local_hostname or route_address(host, port)
        status = store.setup(
            {
                "local_hostname": local,
                "metadata_server": "P2PHANDSHAKE",
                "protocol": "tcp",
                "master_server_addr": f"{host}:{port}",
                "global_segment_size": self.config.segment_bytes,
                "local_buffer_size": 0,
            }
        )
        if status != 0:
            raise RemoteTierError(f"mooncake setup with master {host}:{port} failed ({status})")
        self._store = store

    def register(self, address: int, nbytes: int) -> None:
        status = self._require().register_buffer(address, nbytes)
        if status != 0:
            raise RemoteTierError(f"mooncake register_buffer failed ({status})")

    def exists(self, names: Sequence[str]) -> list[bool]:
        answers = self._require().batch_is_exist(list(names))
        if any(a < 0 for a in answers):
            raise RemoteTierError(f"mooncake batch_is_exist failed ({min(answers)})")
        return [a == 1 for a in answers]

    def put_from(
        self, names: Sequence[str], addresses: Sequence[int], sizes: Sequence[int]
    ) -> list[bool]:
        results = self._require().batch_put_from(list(names), list(addresses), list(sizes))
        return [r == 0 for r in results]

    def get_into(
        self, names: Sequence[str], addresses: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        return list(self._require().batch_get_into(list(names), list(addresses), list(sizes)))

    def remove(self, name: str) -> None:
        self._require().remove(name, True)

    def close(self) -> None:
        # The store object is kept: its destructor can hold the GIL for seconds while it
        # retries a master that is gone (the daemon's process exits without running it).
        if self._store is not None and not self._closed:
            self._closed = True
            self._store.close()

    def _require(self) -> Any:
        if self._store is None or self._closed:
            raise RemoteTierError("mooncake store is not connected")
        return self._store


class _Worker:
    """One daemon thread running blocking calls in order; results come back to the loop.
    A daemon thread: a store call that never returns cannot hold up the process's exit."""

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.pending = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], T]) -> asyncio.Future[T]:
        future: asyncio.Future[T] = self._loop.create_future()
        self.pending += 1

        def settle(result: T | None, error: BaseException | None) -> None:
            self.pending -= 1
            if future.cancelled():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)  # type: ignore[arg-type]

        def run() -> None:
            try:
                result, error = call(), None
            except BaseException as exc:
                result, error = None, exc
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(settle, result, error)

        self._calls.put(run)
        return future

    def stop(self) -> None:
        self._calls.put(None)

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            call()


@dataclass(frozen=True)
class PageShape:
    """What a lookup tells the daemon about the pages it wants: payload bytes and the end of
    each checksummed segment (the page's checksum is one 16-byte value per segment)."""

    payload_bytes: int
    segment_ends: tuple[int, ...]

    @classmethod
    def of(cls, field: Any) -> PageShape:
        if not isinstance(field, dict):
            raise ValueError("field 'page' must be a map")
        payload, ends = field.get("payload_bytes"), field.get("segment_ends")
        if type(payload) is not int or payload <= 0 or payload % 8:
            raise ValueError("page payload_bytes must be a positive multiple of 8")
        if (
            not isinstance(ends, list)
            or not 1 <= len(ends) <= 2
            or any(type(e) is not int or e % 8 for e in ends)
            or ends != sorted(set(ends))
            or ends[-1] != payload
            or ends[0] <= 0
        ):
            raise ValueError(
                "page segment_ends must be 1 or 2 increasing ends, the last the payload"
            )
        return cls(payload, tuple(ends))


def verify_page(
    page: memoryview, key: bytes, parent: bytes | None, shape: PageShape
) -> bytes | None:
    """The page's checksum if `page` (header + payload) is the page of `key` - header,
    chain parent (when known), size and payload checksum agree - else None."""
    from kvshare.kvpool.layout import LAYOUT_VERSION, checksum_constants, payload_checksum

    try:
        header = PageHeader.unpack(page[:HEADER_BYTES])
    except PageFormatError:
        return None
    if (
        header.key != key
        or (parent is not None and header.parent_key != parent)
        or header.payload_bytes != shape.payload_bytes
        or header.layout_version != LAYOUT_VERSION
        or len(header.checksum) != 16 * len(shape.segment_ends)
    ):
        return None
    import numpy as np

    words = np.frombuffer(page[HEADER_BYTES : HEADER_BYTES + shape.payload_bytes], dtype="<u8")
    constants = checksum_constants(key)
    start = 0
    computed = b""
    for end in shape.segment_ends:
        lanes = payload_checksum(words[start // 8 : end // 8], constants, start // 8)
        computed += lanes.astype("<u8").tobytes()
        start = end
    return header.checksum if computed == header.checksum else None


class RemoteCache:
    """The daemon's remote tier: publishes committed pages, fetches a lookup's missing tail.

    The daemon calls `start` once its arena exists, `before` ahead of each request and
    `after` with its response, and `close` at shutdown; all on the event loop thread."""

    def __init__(self, config: RemoteConfig, index: PoolIndex, tier: RemoteTier) -> None:
        self.config = config
        self.index = index
        self.tier = tier
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self.ready = False
        self._arena_base = 0
        self._arena_view: memoryview | None = None
        self._fetcher: _Worker | None = None
        self._publisher: _Worker | None = None
        self._publish_queue: deque[bytes] = deque()
        self._publish_wakeup = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = threading.Event()
        self._down_until = 0.0
        self._unreported: OrderedDict[bytes, None] = OrderedDict()

    # -- life cycle --------------------------------------------------------------------

    def start(self, arena: Arena) -> None:
        """Connect in the background (the pool serves local-only until then) and start
        publishing. The arena stays mapped while this object holds it."""
        loop = asyncio.get_running_loop()
        self._arena_view = arena.view(0, arena.size_bytes)
        self._arena_base = ctypes.addressof(ctypes.c_char.from_buffer(self._arena_view))
        self._fetcher = _Worker("kvshare-remote-fetch", loop)
        self._publisher = _Worker("kvshare-remote-publish", loop)
        self._spawn(self._connect(arena.size_bytes))
        self._spawn(self._publish_loop())

    async def _connect(self, arena_bytes: int) -> None:
        assert self._fetcher is not None
        while not self._closed.is_set():
            try:
                await self._fetcher.submit(self._start_tier(arena_bytes))
            except RemoteTierError as error:
                self.counters["start_failures"] += 1
                log.warning(
                    "remote tier %s not available (%s): serving from the local pool only, "
                    "retrying in %.0f s",
                    self.config.url,
                    error,
                    _RETRY_START_S,
                )
                await asyncio.sleep(_RETRY_START_S)
                continue
            self.ready = True
            log.info("remote tier %s connected", self.config.url)
            return

    def _start_tier(self, arena_bytes: int) -> Callable[[], None]:
        def start() -> None:
            self.tier.start()
            self.tier.register(self._arena_base, arena_bytes)
            # The page checksum's code imports torch: pay for it here, not in a lookup.
            import kvshare.kvpool.layout  # noqa: F401

        return start

    def close(self) -> None:
        """Stop publishing and fetching. The store is not told: its client's disconnect can
        hold the GIL for seconds when the master is gone, so the daemon's process ends
        without it and the master drops this host when its heartbeats stop."""
        self._closed.set()
        self.ready = False
        for task in self._tasks:
            task.cancel()
        for worker in (self._fetcher, self._publisher):
            if worker is not None:
                worker.stop()

    def stats(self) -> dict[str, Any]:
        return {"url": self.config.url, "ready": self.ready, **self.counters}

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the daemon's hooks ------------------------------------------------------------

    async def before(self, request: Any) -> None:
        """Ahead of a lookup that says its page shape: fetch the remote continuation of its
        local run, waiting for it at most the fetch timeout; never raises."""
        if not self.ready or not isinstance(request, dict) or request.get("op") != "lookup":
            return
        if "page" not in request or "states" in request:
            return
        try:
            shape = PageShape.of(request["page"])
            keys = request.get("keys")
            if not isinstance(keys, list) or not all(
                type(k) is bytes and len(k) == KEY_BYTES for k in keys
            ):
                return
        except ValueError:
            return  # the lookup itself answers the malformed request
        local = self.index.committed_run(keys)
        if local == len(keys):
            return
        assert self._fetcher is not None
        if self._down():
            self.counters["fetch_skipped_down"] += 1
            return
        if self._fetcher.pending >= self.config.max_pending_fetches:
            self.counters["fetch_skipped_busy"] += 1
            return
        self.counters["fetch_lookups"] += 1
        task = asyncio.get_running_loop().create_task(self._fetch(keys, local, shape))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            await asyncio.wait_for(asyncio.shield(task), self.config.fetch_timeout_s)
        except TimeoutError:
            self.counters["fetch_timeouts"] += 1
            self._back_off()
            log.warning(
                "remote tier %s: no answer within %.1f s, the lookup is served from the local "
                "pool (the fetch finishes in the background)",
                self.config.url,
                self.config.fetch_timeout_s,
            )
            return

    def after(self, request: Any, response: dict[str, Any]) -> None:
        """After a request was answered: publish what a commit made visible; tell a lookup
        how many of its pages came from the remote tier (a page fetched in the background,
        after the lookup that asked for it was answered, counts in the next that gets it)."""
        if not response.get("ok") or not isinstance(request, dict):
            return
        # A head lookup's pages are reported to the full lookup that follows it.
        if request.get("op") == "lookup" and "pages" in response and not request.get("head"):
            reported = [page[0] for page in response["pages"] if page[0] in self._unreported]
            for key in reported:
                del self._unreported[key]
            response["remote"] = len(reported)
        elif request.get("op") == "commit" and not self._closed.is_set():
            self._enqueue_publish(request["keys"])

    # -- fetch ---------------------------------------------------------------------------

    async def _fetch(self, keys: list[bytes], local: int, shape: PageShape) -> None:
        assert self._fetcher is not None
        tail = keys[local:]
        names = [remote_name(k) for k in tail]
        try:
            found = await self._fetcher.submit(lambda: self.tier.exists(names))
        except RemoteTierError as error:
            self._fetch_failed(error)
            return
        run = next((i for i, hit in enumerate(found) if not hit), len(found))
        self.counters["fetch_miss_pages"] += len(tail) - run
        if run == 0:
            return
        # The local run is the chain this fetch extends: never evicted for its tail.
        reserved, _, dropped = self.index.reserve(
            FETCH_CONN, tail[:run], shape.payload_bytes, keys[:local]
        )
        self.counters["fetch_dropped_pages"] += dropped
        if not reserved:
            return
        size = HEADER_BYTES + shape.payload_bytes
        addresses = [self._arena_base + offset for _, offset in reserved]
        parents = {k: (keys[i - 1] if i > 0 else None) for i, k in enumerate(keys)}
        reserved_keys = [k for k, _ in reserved]
        reserved_names = [remote_name(k) for k in reserved_keys]
        started = time.perf_counter()
        try:
            copied = await self._fetcher.submit(
                lambda: self.tier.get_into(reserved_names, addresses, [size] * len(reserved))
            )
            verifying = time.perf_counter()
            self.counters["fetch_copy_seconds"] += verifying - started
            checksums = await self._fetcher.submit(
                lambda: [
                    self._verified(k, parents[k], offset, shape) if n == size else None
                    for (k, offset), n in zip(reserved, copied)
                ]
            )
        except RemoteTierError as error:
            self.index.abort(FETCH_CONN, reserved_keys)
            self._fetch_failed(error)
            return
        except BaseException:
            self.index.abort(FETCH_CONN, reserved_keys)
            raise
        self.counters["fetch_verify_seconds"] += time.perf_counter() - verifying
        good = [(k, o, c) for (k, o), c in zip(reserved, checksums) if c is not None]
        bad = [k for (k, _), c in zip(reserved, checksums) if c is None]
        lost = sum(1 for n, c in zip(copied, checksums) if c is None and n < 0)
        if bad:
            self.index.abort(FETCH_CONN, bad)
            self.counters["fetch_lost_pages"] += lost
            self.counters["fetch_corrupt_pages"] += len(bad) - lost
            log.warning(
                "remote tier %s: of %d fetched page(s), %d could not be read (their holder "
                "is gone?) and %d failed their header or checksum (first key %s): not "
                "used, removed from the remote store",
                self.config.url,
                len(reserved),
                lost,
                len(bad) - lost,
                bad[0].hex(),
            )
            names = [remote_name(key) for key in bad]
            self._fetcher.submit(lambda: self._remove_quietly(names))
        if good:
            try:
                self.index.commit(
                    FETCH_CONN,
                    [k for k, _, _ in good],
                    [c for _, _, c in good],
                    [o for _, o, _ in good],
                )
            except PoolRequestError:
                log.exception("remote tier: committing fetched pages failed")
                self.index.abort(FETCH_CONN, [k for k, _, _ in good])
                return
            self.counters["fetch_hit_pages"] += len(good)
            self.counters["fetch_hit_bytes"] += len(good) * size
            log.debug(
                "remote tier: fetched %d page(s) in %.1f ms",
                len(good),
                1e3 * (time.perf_counter() - started),
            )
            self._remember_fetched([k for k, _, _ in good])

    def _remember_fetched(self, keys: list[bytes]) -> None:
        """Fetched pages not yet in a lookup's answer; the oldest are forgotten past a bound
        (a page nobody asks for again was counted as fetched, never as a remote hit)."""
        for key in keys:
            self._unreported[key] = None
        while len(self._unreported) > UNREPORTED_KEYS:
            self._unreported.popitem(last=False)

    def _verified(
        self, key: bytes, parent: bytes | None, offset: int, shape: PageShape
    ) -> bytes | None:
        assert self._arena_view is not None
        return verify_page(
            self._arena_view[offset : offset + HEADER_BYTES + shape.payload_bytes],
            key,
            parent,
            shape,
        )

    def _remove_quietly(self, names: list[str]) -> None:
        for name in names:
            with contextlib.suppress(Exception):
                self.tier.remove(name)

    def _fetch_failed(self, error: Exception) -> None:
        self.counters["fetch_failures"] += 1
        self._back_off()
        log.warning(
            "remote tier %s failed (%s): the lookup is served from the local pool; "
            "not asked again for %.0f s",
            self.config.url,
            error,
            _BACKOFF_S,
        )

    def _back_off(self) -> None:
        self._down_until = time.monotonic() + _BACKOFF_S

    def _down(self) -> bool:
        return time.monotonic() < self._down_until

    # -- publish ---------------------------------------------------------------------------

    def _enqueue_publish(self, keys: list[bytes]) -> None:
        room = _PUBLISH_QUEUE_KEYS - len(self._publish_queue)
        if not self.ready or self._down() or room < len(keys):
            self.counters["publish_dropped_pages"] += len(keys)
            return
        self._publish_queue.extend(keys)
        self._publish_wakeup.set()

    async def _publish_loop(self) -> None:
        while True:
            await self._publish_wakeup.wait()
            self._publish_wakeup.clear()
            while self._publish_queue:
                batch = [
                    self._publish_queue.popleft()
                    for _ in range(min(_PUBLISH_BATCH_KEYS, len(self._publish_queue)))
                ]
                await self._publish(batch)

    async def _publish(self, keys: list[bytes]) -> None:
        """Pin the pages that are still committed, put those the store lacks, unpin."""
        assert self._publisher is not None
        pages = []
        leases = []
        for key in keys:
            lease, found = self.index.lookup(PUBLISH_CONN, [key], counted=False)
            if lease:
                leases.append(lease)
                pages.extend(found)
        self.counters["publish_dropped_pages"] += len(keys) - len(pages)
        try:
            if pages:
                await self._put_missing(pages)
        finally:
            for lease in leases:
                self.index.release(PUBLISH_CONN, lease)

    async def _put_missing(self, pages: list[tuple[bytes, int, int, bytes]]) -> None:
        assert self._publisher is not None
        names = [remote_name(key) for key, _, _, _ in pages]
        try:
            present = await self._publisher.submit(lambda: self.tier.exists(names))
            todo = [(n, p) for n, p, there in zip(names, pages, present) if not there]
            self.counters["publish_present_pages"] += len(pages) - len(todo)
            if not todo:
                return
            sizes = [HEADER_BYTES + p[2] for _, p in todo]
            stored = await self._publisher.submit(
                lambda: self.tier.put_from(
                    [n for n, _ in todo], [self._arena_base + p[1] for _, p in todo], sizes
                )
            )
        except RemoteTierError as error:
            self.counters["publish_failures"] += 1
            self._back_off()
            log.warning("remote tier %s: publishing failed (%s)", self.config.url, error)
            return
        self.counters["published_pages"] += sum(stored)
        self.counters["published_bytes"] += sum(n for n, ok in zip(sizes, stored) if ok)
        if not all(stored):
            self.counters["publish_failures"] += 1
            log.warning(
                "remote tier %s: %d of %d page(s) not published",
                self.config.url,
                len(stored) - sum(stored),
                len(stored),
            )
