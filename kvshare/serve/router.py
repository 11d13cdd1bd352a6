"""`kvshare router`: the OpenAI API in front of N replicas.

- Each /v1/ request goes to the replica its policy picks, or to the one named by the
  `x-kvshare-replica: <index>` header. The response carries `x-kvshare-replica` (who
  served it) and `x-kvshare-routing-tokens` (the prompt's token count as the router keyed
  it; 0 when it did not tokenize).
- A replica that cannot be reached, or drops the connection before its response headers,
  leaves rotation at once and the request is retried on another one (never for a pinned
  request). After the first byte nothing is retried: a broken stream ends with an SSE
  error event.
- Periodic GET /health puts replicas back; a replica whose instance id changed (a restart)
  starts with an empty cache index. With a cache-aware policy each check also reads the
  replica's GET /admin/cache_events (what its GPU prefix cache stored and evicted since the
  last read, a snapshot after a reset, whether it uses the pool, the pool's size and clear
  count) and hands it to the policy, so the router's view follows the replica's cache.
- Responses are relayed chunk by chunk as they arrive (SSE is never buffered), with the
  router's phases added to the replica's `Server-Timing` (kvshare.serve.server_timing).
- GET /admin/replicas lists the replicas; /admin/all/<call> carries out one of the
  replicas' admin calls on every replica and returns their answers: forwarded to a kvshare
  replica's /admin/<call> with the router's admin credential, or, for `vllm serve`
  replicas (`engine` "vllm"), done at the shared pool daemon and vLLM's own prefix-cache
  reset (kvshare.serve.replica_admin). Nothing else is forwarded.
- A /v1 path with a dot segment or an encoded separator is refused: the client side of
  the proxy would resolve `/v1/..%2Fadmin` into a replica's /admin.
- Keys and the loopback rule for /admin without one: kvshare.serve.auth.
- Bodies are held in memory (a failed send is retried with them; a pinned request's,
  never retried, goes on to its replica as it arrives and is kept for the prefix record):
  one is at most `max_body_bytes` (413 above), and all held together at most
  `max_buffered_bytes`; a request that finds no room waits up to `body_wait_timeout`
  seconds, then gets a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvshare.serve.auth import AccessKeys, access_middleware
from kvshare.serve.errors import APIError, bad_request
from kvshare.serve.http import (
    TOKEN_ARRAY_BYTES,
    ArrayReader,
    error_middleware,
    parse_json_object,
    sse_event,
)
from kvshare.serve.metrics import CONTENT_TYPE, RouterMetrics
from kvshare.serve.packed_request import CONTENT_TYPE as PACKED_TYPE
from kvshare.serve.packed_request import pack_request
from kvshare.serve.policies import (
    POLICIES,
    CacheUpdate,
    PolicyConfig,
    RouteRequest,
    StepShape,
    make_policy,
)
from kvshare.serve.replica_admin import ENGINES, KVShareReplicaAdmin, replica_admin
from kvshare.serve.routing_keys import Prefix, RoutingKeys
from kvshare.serve.server_timing import HEADER as TIMING_HEADER
from kvshare.serve.server_timing import PhaseClock
from kvshare.version import __version__

_log = logging.getLogger(__name__)

REPLICA_HEADER = "x-kvshare-replica"
ROUTING_TOKENS_HEADER = "x-kvshare-routing-tokens"
SESSION_HEADER = "x-session-id"
# Per-connection headers (RFC 9110 section 7.6.1), plus those aiohttp sets itself.
_NOT_FORWARDED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
# The replica's admin endpoints (kvshare.serve.server.build_app) and their methods: the
# only calls /admin/all/<call> forwards to kvshare replicas.
ADMIN_CALLS = KVShareReplicaAdmin.calls
_ENCODED_SEPARATORS = ("%2f", "%5c")
# Admin calls after which the router reads every replica's cache events before answering.
_CALLS_THAT_CHANGE_CACHES = frozenset({"reset_prefix_cache", "kv_pool", "clear_pool"})


@dataclass(frozen=True)
class RouterConfig:
    replicas: tuple[str, ...]
    policy: str = "cache-aware"
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    block_tokens: int = 16  # routing-key block: the engine's block size
    health_interval: float = 1.0
    health_timeout: float = 5.0
    # Failed health checks in a row that take a replica out of rotation: one check can fail
    # while the whole host stalls for a moment, and a replica marked down for nothing turns
    # every request of that interval into a 503. A failed request still removes it at once.
    health_failures_to_leave: int = 2
    connect_timeout: float = 5.0
    max_body_bytes: int = 64 << 20
    api_key: str | None = None
    admin_key: str | None = None
    max_buffered_bytes: int = 512 << 20
    body_wait_timeout: float = 10.0
    engine: str = "kvshare"  # what the replicas run: "kvshare", or "vllm" (`vllm serve`)
    kv_pool: str | None = None  # vllm: the pool daemon the replicas share (None: no pool)

    def __post_init__(self) -> None:
        AccessKeys(self.api_key, self.admin_key)  # checks both keys
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if not self.replicas:
            raise ValueError("a router needs at least one --replica URL")
        for url in self.replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica URL must start with http:// or https://, got {url!r}")
        object.__setattr__(self, "replicas", tuple(url.rstrip("/") for url in self.replicas))
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        if min(self.health_interval, self.health_timeout, self.connect_timeout) <= 0:
            raise ValueError("health_interval, health_timeout and connect_timeout must be > 0")
        if self.health_failures_to_leave < 1:
            raise ValueError("health_failures_to_leave must be >= 1")
        if self.block_tokens < 1 or self.max_body_bytes < 1024:
            raise ValueError("block_tokens must be >= 1 and max_body_bytes >= 1024")
        if self.max_buffered_bytes < self.max_body_bytes:
            raise ValueError(
                f"max_buffered_bytes ({self.max_buffered_bytes}) must be >= "
                f"max_body_bytes ({self.max_body_bytes})"
            )
        if self.body_wait_timeout < 0:
            raise ValueError("body_wait_timeout must be >= 0")


@dataclass(frozen=True)
class Parsed:
    """What the router read from a request body: the prompt's routing prefix, and the body
    packed for replicas that take it (None: forward it as received)."""

    prefix: Prefix = field(default_factory=Prefix)
    packed: bytes | None = None
    # The digest of the tokenizer whose ids `packed` carries: only a replica of that
    # tokenizer gets it ("": it carries none).
    tokenizer: str = ""

    def packed_for(self, replica: Replica) -> bytes | None:
        if not replica.takes_packed or self.tokenizer not in ("", replica.tokenizer):
            return None
        return self.packed

    def sent_as(self, packed: bytes | None) -> str:
        """What a replica sent `packed` gets, as the router's metrics name it."""
        if packed is None:
            return "as received"
        return "packed with the router's ids" if self.tokenizer else "packed"


class StreamedBody:
    """A request body passed on as it arrives (chunks(), once) and kept: `received` is the
    whole of it once the last byte came in (b"" after answered() if it had not: an answer
    that came before the body was all sent has nothing to record); `broken`, what broke the
    client's side off before that (a client's failure, not the replica's)."""

    def __init__(self, request: web.Request) -> None:
        self._content = request.content
        self.received: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.broken: BaseException | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        parts = []
        try:
            async for chunk in self._content.iter_any():
                parts.append(chunk)
                yield chunk
        except Exception as exc:
            self.broken = exc
            raise
        if not self.received.done():
            self.received.set_result(b"".join(parts))

    def answered(self) -> None:
        """The replica answered: a replica reads the whole body first, so its last chunk
        went out before; one that answered early (an error) leaves nothing to wait for."""
        if not self.received.done():
            self.received.set_result(b"")


class BodyBudget:
    """Bytes of request bodies held at once; touched on the event loop only."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._freed = asyncio.Condition()

    async def acquire(self, size: int, timeout: float) -> bool:
        """Reserve `size` bytes (<= limit), waiting up to `timeout` s; False if no room came."""
        async with self._freed:
            try:
                await asyncio.wait_for(
                    self._freed.wait_for(lambda: self.held + size <= self.limit), timeout
                )
            except asyncio.TimeoutError:
                return False
            self.held += size
            return True

    async def release(self, size: int) -> None:
        async with self._freed:
            self.held -= size
            self._freed.notify_all()


@dataclass
class Replica:
    """Router-side state of one replica; touched on the event loop only."""

    index: int
    url: str
    healthy: bool = True  # optimistic until the first health check says otherwise
    in_flight: int = 0
    instance: str | None = None
    answered: bool = False  # a health check has passed
    failed_checks: int = 0  # health checks failed in a row
    # Position in the replica's cache event log (kvshare.engine.cache_events); None: unknown,
    # the next read is a snapshot.
    cache_generation: int | None = None
    cache_last: int = 0
    # One read of the event log at a time: an answer applied after a later one would roll
    # the position back, and the next read would wipe what the policy learned since.
    cache_read: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Its /health lists the packed request type (kvshare.serve.packed_request) and names
    # its tokenizer's digest ("": none).
    takes_packed: bool = False
    tokenizer: str = ""

    def describe(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
        }


class Router:
    def __init__(self, config: RouterConfig, keys: RoutingKeys) -> None:
        self.config = config
        self.keys = keys
        self.replicas = [Replica(i, url) for i, url in enumerate(config.replicas)]
        self.policy = make_policy(config.policy, len(self.replicas), config.policy_config)
        self.metrics = RouterMetrics()
        prefixes = keys.tokenizer.prefixes if keys.tokenizer is not None else None
        if prefixes is not None:
            self.metrics.kept_prefix_hits.set_function(lambda: prefixes.hits)
        # What the fan-out sends replicas: in `kvshare up` they hold the router's keys.
        self.admin_credential = AccessKeys(config.api_key, config.admin_key).admin_credential
        self.bodies = BodyBudget(config.max_buffered_bytes)
        self.arrays = ArrayReader()  # a long prompt's ids, parsed in pieces
        self.admin = replica_admin(config.engine, config.kv_pool)
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._pool_cleared_keys: int | None = None  # the pool's clear count, last seen
        self._block_size_warned = False

    async def start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout),
            auto_decompress=False,  # bytes pass through as the replica sent them
            connector=aiohttp.TCPConnector(limit=0),
        )
        await self._check_all()
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self, app: web.Application) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self._session is not None:
            await self._session.close()
        await self.admin.close()
        self.arrays.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "router not started"
        return self._session

    # ------------------------------------------------------------ health

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            await self._check_all()

    async def _check_all(self) -> None:
        await asyncio.gather(*(self._check(r) for r in self.replicas))

    async def _check(self, replica: Replica) -> None:
        info: Any = None
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
            async with self.session.get(replica.url + "/health", timeout=timeout) as resp:
                if resp.status == 200:
                    # `vllm serve` answers an empty body: healthy, with no instance id.
                    info = await resp.json(content_type=None) or {}
        except (*_UPSTREAM_ERRORS, ValueError):
            info = None
        healthy = isinstance(info, dict)
        if healthy and info.get("instance") != replica.instance:
            if replica.instance is not None:  # restarted: its GPU cache is empty
                self.policy.forget_replica(replica.index)
            replica.instance = info.get("instance")
            replica.cache_generation = None
        if healthy:
            types = info.get("request_types")
            replica.takes_packed = isinstance(types, list) and PACKED_TYPE in types
            tokenizer = info.get("tokenizer")
            replica.tokenizer = tokenizer if isinstance(tokenizer, str) else ""
        if healthy and self.policy.uses_prefix and self.admin.cache_events:
            await self._read_cache_events(replica)
        replica.failed_checks = 0 if healthy else replica.failed_checks + 1
        replica.answered = replica.answered or healthy
        # A replica that never answered leaves at its first failed check.
        if (
            healthy
            or not replica.answered
            or replica.failed_checks >= self.config.health_failures_to_leave
        ):
            self._set_health(replica, healthy)

    async def _read_cache_events(self, replica: Replica) -> None:
        """Hand the policy what the replica's caches did since the last read. A replica that
        cannot answer keeps the policy's prediction (from the prompts it was sent)."""
        async with replica.cache_read:
            await self._read_cache_events_locked(replica)

    async def _read_cache_events_locked(self, replica: Replica) -> None:
        query = {"after": str(replica.cache_last)}
        if replica.cache_generation is not None:
            query["generation"] = str(replica.cache_generation)
        headers = {}
        if self.admin_credential is not None:
            headers["Authorization"] = f"Bearer {self.admin_credential}"
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
            async with self.session.get(
                replica.url + "/admin/cache_events", params=query, headers=headers, timeout=timeout
            ) as resp:
                if resp.status != 200:
                    _log.debug("replica %d: cache events answered %d", replica.index, resp.status)
                    return
                answer = await resp.json(content_type=None)
            update = self._cache_update(answer)
        except (*_UPSTREAM_ERRORS, ValueError, KeyError, TypeError) as exc:
            _log.debug("replica %d: no cache events: %s", replica.index, exc)
            return
        if update is None:
            return
        self.policy.observe(replica.index, update)
        replica.cache_generation = answer["generation"]
        replica.cache_last = answer["last"]
        self.metrics.cache_events.labels(str(replica.index)).inc(
            len(update.stored) + len(update.removed)
        )

    def _cache_update(self, answer: Any) -> CacheUpdate | None:
        """The policy's view of one answer; None when its blocks are not the router's."""
        block_size = int(answer["block_size"])
        if block_size != self.keys.block_tokens:
            if self._block_size_warned:
                return None
            self._block_size_warned = True
            _log.warning(
                "a replica's GPU blocks hold %d tokens, the router's %d (--block-tokens): "
                "its cache events do not name the router's blocks and are ignored",
                block_size,
                self.keys.block_tokens,
            )
            return None
        pool = answer.get("pool")
        pool_blocks, cleared = None, False
        if isinstance(pool, dict):
            if pool["pages"] is not None:  # None: unknown until a page was stored
                pool_blocks = int(pool["pages"]) * int(pool["chunk_tokens"]) // block_size
            cleared_keys = int(pool["cleared_keys"])
            # A larger count: cleared; a smaller one: the daemon restarted, empty.
            known = self._pool_cleared_keys
            cleared = known is not None and cleared_keys != known
            self._pool_cleared_keys = cleared_keys
        return CacheUpdate(
            snapshot=bool(answer["snapshot"]),
            stored=tuple(bytes.fromhex(h) for h in answer["stored"]),
            removed=tuple(bytes.fromhex(h) for h in answer["removed"]),
            uses_pool=bool(answer["kv_pool_enabled"]) and isinstance(pool, dict),
            pool_blocks=pool_blocks,
            pool_cleared=cleared,
            step=None
            if answer.get("step_tokens") is None
            else StepShape(int(answer["step_tokens"]), int(answer["short_work_tokens"])),
        )

    def _set_health(self, replica: Replica, healthy: bool, reason: str = "") -> None:
        if healthy != replica.healthy:
            _log.warning(
                "replica %d (%s) %s%s",
                replica.index,
                replica.url,
                "is back in rotation" if healthy else "left rotation",
                reason,
            )
        replica.healthy = healthy
        self.metrics.healthy.labels(str(replica.index)).set(float(healthy))

    # ------------------------------------------------------------ proxy

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        clock = PhaseClock()
        _check_path(request)
        size = self._body_size(request)
        if not await self.bodies.acquire(size, self.config.body_wait_timeout):
            raise APIError(
                503,
                f"the router holds {self.bodies.held} bytes of request bodies "
                f"(limit {self.config.max_buffered_bytes}, --max-buffered-bytes); "
                f"retry later",
            )
        try:
            return await self._proxy(request, clock)
        finally:
            await self.bodies.release(size)

    def _body_size(self, request: web.Request) -> int:
        """The bytes a body will hold: its Content-Length, or the most a chunked one may."""
        length, limit = request.content_length, self.config.max_body_bytes
        if length is not None and length > limit:
            raise APIError(
                413,
                f"request body too large: {length} bytes; this router accepts "
                f"at most {limit} (--max-body-bytes)",
            )
        return limit if length is None else length

    async def _proxy(self, request: web.Request, clock: PhaseClock) -> web.StreamResponse:
        pinned = self._pinned(request)
        if pinned is not None and request.content_length and request.method == "POST":
            return await self._proxy_streamed(request, pinned, clock)
        return await self._proxy_buffered(request, pinned, clock)

    async def _proxy_buffered(
        self, request: web.Request, pinned: int | None, clock: PhaseClock
    ) -> web.StreamResponse:
        body = await request.read()
        clock.lap("router-read")
        # Parsing, hashing and packing 131,072 token ids take ~4.5 ms on a 2-core machine
        # (16-token blocks ~6 ms): a request is routed once they are done.
        hashing = asyncio.ensure_future(self._parsed(request, body, waited=pinned is None))
        try:
            if pinned is None:
                await hashing
            return await self._forward(request, body, pinned, hashing, clock)
        finally:
            hashing.cancel()  # still running only if the request failed before it finished

    async def _proxy_streamed(
        self, request: web.Request, pinned: int, clock: PhaseClock
    ) -> web.StreamResponse:
        """A pinned request needs its prefix only to record where it went: its body goes
        on to the replica as it arrives (the replica's read overlaps the client's send),
        and is hashed once it is all in, while the replica works."""
        body = StreamedBody(request)
        clock.lap("router-read")  # the headers: the body is the replica's read
        hashing = asyncio.ensure_future(self._parsed_when_in(request, body))
        try:
            return await self._forward(request, body, pinned, hashing, clock)
        finally:
            hashing.cancel()

    async def _parsed_when_in(self, request: web.Request, body: StreamedBody) -> Parsed:
        return await self._parsed(request, await body.received, waited=False)

    async def _forward(
        self,
        request: web.Request,
        body: bytes | StreamedBody,
        pinned: int | None,
        hashing: asyncio.Future[Parsed],
        clock: PhaseClock,
    ) -> web.StreamResponse:
        """Send to the chosen (or pinned) replica, retrying unpinned requests elsewhere."""
        session = request.headers.get(SESSION_HEADER)
        # The policy picks by prefix (hashed already); a pinned replica is not picked, and
        # its body went before it was parsed.
        parsed = hashing.result() if pinned is None else Parsed()
        route = self._route(session, parsed.prefix)
        tried: set[int] = set()
        while True:
            replica = self._pick(route, pinned, tried)
            replica.in_flight += 1
            self.metrics.in_flight.labels(str(replica.index)).set(replica.in_flight)
            self.policy.started(route, replica.index)
            if not tried:  # a retry's pick is part of its wait for a replica
                clock.lap("router-route")
            try:
                try:
                    packed = parsed.packed_for(replica)
                    self.metrics.bodies.labels(parsed.sent_as(packed)).inc()
                    upstream = await self._send(replica, request, body, packed)
                except _UPSTREAM_ERRORS as exc:
                    if isinstance(body, StreamedBody) and body.broken is not None:
                        raise bad_request(f"request body broke off: {body.broken}") from None
                    tried.add(replica.index)
                    self._failed(replica, exc)
                    if pinned is not None:
                        raise APIError(
                            502,
                            f"replica {replica.index} ({replica.url}) failed: "
                            f"{exc or type(exc).__name__}",
                        ) from None
                    self.metrics.retries.inc()
                    continue
                clock.lap("router-upstream")
                if isinstance(body, StreamedBody):
                    body.answered()
                # A kvshare replica sends its headers with its first output (streamed) or its
                # whole answer: either way the prefill is over.
                self.policy.answered(route, replica.index)
                prefix = await self._finished(hashing, upstream)
                policy = "pinned" if pinned is not None else self.policy.name
                self.metrics.decisions.labels(policy, str(replica.index)).inc()
                # Recording a long prefix takes milliseconds (8k hashes at 130k tokens):
                # after the first chunk is on its way, not in the client's wait for it.
                record = functools.partial(
                    self.policy.record, self._route(session, prefix), replica.index
                )
                return await self._relay(request, replica, upstream, prefix, clock, record)
            finally:
                self.policy.ended(route, replica.index)
                replica.in_flight -= 1
                self.metrics.in_flight.labels(str(replica.index)).set(replica.in_flight)

    def _route(self, session: str | None, prefix: Prefix) -> RouteRequest:
        return RouteRequest(session, prefix.hashes, self.keys.block_tokens)

    def _pinned(self, request: web.Request) -> int | None:
        value = request.headers.get(REPLICA_HEADER)
        if value is None:
            return None
        if not value.strip().isdigit() or int(value) >= len(self.replicas):
            raise bad_request(
                f"{REPLICA_HEADER} must be a replica index in [0, "
                f"{len(self.replicas) - 1}], got {value!r}"
            )
        return int(value)

    async def _parsed(self, request: web.Request, body: bytes, waited: bool) -> Parsed:
        """The body's prefix, and, when `waited` (the request is forwarded once this is
        done) and a replica takes it, the body packed. A long token array is read on the
        reader's threads only when waited for; else (forwarded already, its prefix needed
        only when the answer comes) on one thread, leaving the cores to the replica's read
        of the same body."""
        if not self.policy.uses_prefix or request.method != "POST" or not body:
            return Parsed()
        pack = waited and any(r.takes_packed for r in self.replicas)
        reader = self.arrays if waited else None
        # Parsing and tokenizing a long prompt take milliseconds: off the event loop.
        return await asyncio.to_thread(self._parse, request.path, body, pack, reader)

    def _parse(self, path: str, body: bytes, pack: bool, reader: ArrayReader | None) -> Parsed:
        try:
            parsed = parse_json_object(body, reader)
        except APIError:
            return Parsed()  # the replica answers the 400
        prefix, tokenized = self.keys.prompt_of(path, parsed)
        if not pack:
            return Parsed(prefix)
        if tokenized is not None and len(body) >= TOKEN_ARRAY_BYTES:
            digest = self.keys.tokenizer_digest
            return Parsed(prefix, pack_request(parsed, tokenized, digest), digest)
        return Parsed(prefix, pack_request(parsed))

    @staticmethod
    async def _finished(
        hashing: asyncio.Future[Parsed], upstream: aiohttp.ClientResponse
    ) -> Prefix:
        """The prefix, once hashed; a failure or cancellation meanwhile closes `upstream`
        (which makes the replica abort the request)."""
        try:
            return (await hashing).prefix
        except BaseException:
            upstream.close()
            raise

    def _pick(self, route: RouteRequest, pinned: int | None, tried: set[int]) -> Replica:
        if pinned is not None:
            return self.replicas[pinned]
        candidates = [r for r in self.replicas if r.healthy and r.index not in tried]
        if not candidates:
            raise APIError(503, "no healthy replica" + (" left to retry on" if tried else ""))
        return self.replicas[self.policy.choose(route, candidates)]

    async def _send(
        self,
        replica: Replica,
        request: web.Request,
        body: bytes | StreamedBody,
        packed: bytes | None,
    ) -> aiohttp.ClientResponse:
        """Forward the request with its body as received (or as it arrives), or `packed`
        in its place."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        data: bytes | AsyncIterator[bytes] | None
        if isinstance(body, StreamedBody):
            # The length the client announced: the server reads exactly that many bytes.
            headers["Content-Length"] = str(request.content_length)
            data = body.chunks()
        else:
            data = (body if packed is None else packed) or None
        if packed is not None:
            headers = {k: v for k, v in headers.items() if k.lower() != "content-type"}
            headers["Content-Type"] = PACKED_TYPE
        return await self.session.request(
            request.method,
            replica.url + request.rel_url.path_qs,
            data=data,
            headers=headers,
            allow_redirects=False,
        )

    def _failed(self, replica: Replica, exc: BaseException) -> None:
        self.metrics.failures.labels(str(replica.index)).inc()
        self._set_health(replica, False, f": {type(exc).__name__}: {exc}")

    async def _relay(
        self,
        request: web.Request,
        replica: Replica,
        upstream: aiohttp.ClientResponse,
        prefix: Prefix,
        clock: PhaseClock,
        relayed: Callable[[], None],
    ) -> web.StreamResponse:
        """Stream the upstream response to the client; `relayed` is called once, after
        the first chunk is written (or when the relay ends without one)."""
        complete = False
        outcome = str(upstream.status)
        recorded = False
        try:
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in _NOT_FORWARDED - {"content-length"}:
                    resp.headers.add(name, value)
            resp.headers[REPLICA_HEADER] = str(replica.index)
            resp.headers[ROUTING_TOKENS_HEADER] = str(prefix.num_tokens)
            resp.headers.add(TIMING_HEADER, clock.header("router-total"))
            await resp.prepare(request)
            while True:
                try:
                    chunk = await upstream.content.readany()
                except _UPSTREAM_ERRORS as exc:
                    await self._broken_stream(resp, replica, upstream, exc)
                    break
                if not chunk:
                    complete = True
                    break
                await resp.write(chunk)  # a client that left raises here: upstream closes below
                if not recorded:
                    relayed()
                    recorded = True
            with contextlib.suppress(ConnectionResetError):
                await resp.write_eof()  # a client that closed after the last byte has it all
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            outcome = "499"  # the client went away before the end
            raise
        finally:
            if not recorded:
                relayed()
            self.metrics.requests.labels(str(replica.index), outcome).inc()
            if complete:
                upstream.release()
            else:  # closing the connection makes the replica abort the request
                upstream.close()

    async def _broken_stream(
        self,
        resp: web.StreamResponse,
        replica: Replica,
        upstream: aiohttp.ClientResponse,
        exc: BaseException,
    ) -> None:
        self._failed(replica, exc)
        if upstream.content_type == "text/event-stream":
            error = APIError(
                502, f"replica {replica.index} failed mid-stream: {type(exc).__name__}"
            )
            await resp.write(sse_event(error.body()))

    # ------------------------------------------------------------ router endpoints

    async def health(self, request: web.Request) -> web.Response:
        healthy = sum(r.healthy for r in self.replicas)
        return web.json_response(
            {
                "status": "ok" if healthy else "no healthy replica",
                "healthy_replicas": healthy,
                "replicas": len(self.replicas),
            },
            status=200 if healthy else 503,
        )

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def list_replicas(self, request: web.Request) -> web.Response:
        return web.json_response([r.describe() for r in self.replicas])

    async def admin_all(self, request: web.Request) -> web.Response:
        """Carry out /admin/all/<call> on every replica, concurrently."""
        call = request.match_info["call"]
        calls = self.admin.calls
        if call not in calls:
            raise APIError(
                404,
                f"unknown admin call {call!r}; /admin/all/ on {self.config.engine} replicas "
                f"offers only {', '.join(sorted(calls))}",
            )
        if request.method != calls[call]:
            raise APIError(405, f"/admin/all/{call} takes {calls[call]}, not {request.method}")
        body = await request.read()
        answers = await asyncio.gather(
            *(self._admin_one(r, request, call, body) for r in self.replicas)
        )
        ok = all(a["status"] is not None and a["status"] < 400 for a in answers)
        if ok and call == "reset_prefix_cache":
            for replica in self.replicas:
                self.policy.forget_replica(replica.index)
        if ok and call == "clear_pool":
            self.policy.forget_pool()
        if (
            ok
            and call in _CALLS_THAT_CHANGE_CACHES
            and self.policy.uses_prefix
            and self.admin.cache_events
        ):
            # Read the replicas' new state before answering: the caller (a bench block start)
            # sends its next requests at once, and a reset or clear first heard of at the next
            # health check would wipe what the router learned from them meanwhile.
            await asyncio.gather(*(self._read_cache_events(r) for r in self.replicas if r.healthy))
        return web.json_response({"replicas": answers}, status=200 if ok else 502)

    async def _admin_one(
        self, replica: Replica, request: web.Request, call: str, body: bytes
    ) -> dict[str, Any]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        credential = self.admin_credential
        if credential is not None:  # replicas check their own key: send it, not the client's
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            headers["Authorization"] = f"Bearer {credential}"
        answer = await self.admin.call(self.session, replica.url, call, body, headers)
        return {"index": replica.index, "url": replica.url} | answer


def _check_path(request: web.Request) -> None:
    """400 for a path that would name another endpoint once the proxy resolves it."""
    raw = request.raw_path.split("?", 1)[0].lower()
    segments = request.path.split("/")
    if any(s in (".", "..") for s in segments) or any(e in raw for e in _ENCODED_SEPARATORS):
        raise bad_request(
            f"path {request.raw_path.split('?', 1)[0]!r} has a dot segment or an encoded separator"
        )


ROUTER_KEY = web.AppKey("kvshare_router", Router)


def build_router_app(config: RouterConfig, keys: RoutingKeys) -> web.Application:
    router = Router(config, keys)
    access = access_middleware(AccessKeys(config.api_key, config.admin_key))
    app = web.Application(
        client_max_size=config.max_body_bytes, middlewares=[error_middleware, access]
    )
    app[ROUTER_KEY] = router
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics_text)
    app.router.add_get("/version", router.version)
    app.router.add_get("/admin/replicas", router.list_replicas)
    app.router.add_route("*", "/admin/all/{call:.+}", router.admin_all)
    app.router.add_route("*", "/v1/{path:.*}", router.proxy)
    return app
