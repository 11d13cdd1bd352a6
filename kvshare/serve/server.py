"""`kvshare serve`: one engine behind an OpenAI-compatible HTTP API (aiohttp).

Endpoints: POST /v1/completions, POST /v1/chat/completions (both stream with SSE),
GET /v1/models, GET /health, GET /version, GET /metrics, and the admin calls the benchmark drives:
POST /admin/reset_prefix_cache, POST /admin/kv_pool {"enabled": bool},
POST /admin/clear_pool, GET /admin/stats, and GET /admin/cache_events (the router
polls it). Who may call which: kvshare.serve.auth.

With `cache_salt_required` every generate request must carry a `cache_salt`: in a server
shared by tenants, an unsalted request would share prefix cache with every other
unsalted one, and hit counts and timing would tell one tenant what another sent.

The handlers never touch the engine: they send commands to the engine thread. A request
whose client goes away (the handler is cancelled, or a streamed write fails) is aborted,
which frees its blocks. Run the app with `handler_cancellation=True` so that a
disconnect during a non-streamed request cancels its handler.

Parsing a body and tokenizing its prompt run on a worker thread: an 8 MiB prompt takes
seconds to tokenize, and the event loop must keep answering /health meanwhile. A long
prompt of token ids has its first ids sent to the engine thread as soon as they are read
(a hint, kvshare.serve.http.PromptHead): a restore's first copies then run while the rest
of the body is parsed (~3 ms of 131,072 ids on a GPU host's 4 threads).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web

from kvshare.engine.connector import KVStoreUnavailable
from kvshare.engine.llm_engine import LLMEngine, RequestOutput
from kvshare.serve.auth import AccessKeys, access_middleware
from kvshare.serve.engine_thread import EngineFailure, EngineThread, snapshot_of
from kvshare.serve.errors import APIError, bad_request
from kvshare.serve.http import (
    SSE_HEADERS,
    ArrayReader,
    Handler,
    PromptHead,
    error_middleware,
    read_json_object,
    sse_event,
)
from kvshare.serve.metrics import CONTENT_TYPE, ServerMetrics
from kvshare.serve.packed_request import CONTENT_TYPE as PACKED_TYPE
from kvshare.serve.protocol import GenerateRequest, ModelInfo, ResponseFormat, parse_generate
from kvshare.serve.server_timing import HEADER as TIMING_HEADER
from kvshare.serve.server_timing import PhaseClock
from kvshare.version import __version__

DEFAULT_MAX_BODY_BYTES = 8 << 20
# A body's cache_salt as a plain JSON string (no escapes), found without parsing the body.
_PLAIN_CACHE_SALT = re.compile(rb'"cache_salt"[ \t\n\r]*:[ \t\n\r]*"([^"\\]*)"')


@dataclass(frozen=True)
class ServeConfig:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    admin_key: str | None = None  # /admin/* needs it when set; see kvshare.serve.auth
    cache_salt_required: bool = False  # refuse /v1 generate requests without a cache_salt

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        AccessKeys(self.api_key, self.admin_key)  # checks both keys
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")


class _Progress:
    """One request's progress: latency metrics per output, and whether it finished."""

    def __init__(self, metrics: ServerMetrics, received: float) -> None:
        self.metrics = metrics
        self.received = received
        self.last = received
        self.first_token = True
        self.finished = False

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        vllm = self.metrics.vllm
        if out.new_token_ids:
            (self.metrics.ttft if self.first_token else self.metrics.itl).observe(now - self.last)
            if self.first_token:  # the prompt is computed (or found): vLLM counts it here
                vllm.ttft.observe(now - self.received)
                vllm.prompt_tokens.inc(len(out.prompt_token_ids))
                vllm.prefix_cache_queries.inc(len(out.prompt_token_ids))
                vllm.prefix_cache_hits.inc(out.cached_tokens)
            vllm.generation_tokens.inc(len(out.new_token_ids))
            self.first_token, self.last = False, now
        if out.finished:
            vllm.e2e.observe(now - self.received)
            self.finished = True
            self.metrics.finished.labels(out.finish_reason or "unknown").inc()
            for source, n in (
                ("gpu_hit", out.gpu_hit_tokens),
                ("pool_hit", out.pool_hit_tokens),
                ("computed", out.computed_tokens),
            ):
                self.metrics.prompt_tokens.labels(source).inc(n)


class _Choices:
    """The n engine requests of one API request (its choices), read as one stream of
    (choice index, output); the first failure of any choice fails the request."""

    def __init__(
        self,
        thread: EngineThread,
        metrics: ServerMetrics,
        request_id: str,
        req: GenerateRequest,
        received: float,
    ) -> None:
        self._thread = thread
        ids = [request_id] if req.n == 1 else [f"{request_id}-{i}" for i in range(req.n)]
        self._index = {request_id: i for i, request_id in enumerate(ids)}
        self._progress = [_Progress(metrics, received) for _ in ids]
        self._metrics = metrics
        self._outputs: list[RequestOutput | None] = [None] * req.n
        self._stream = thread.submit_group(
            [(rid, req.prompt_token_ids, req.choice_params(i)) for i, rid in enumerate(ids)],
            req.cache_salt,
        )

    @property
    def latest(self) -> list[RequestOutput]:
        """Each choice's last output; complete once every choice has produced one."""
        return [out for out in self._outputs if out is not None]

    @property
    def all_finished(self) -> bool:
        return all(p.finished for p in self._progress)

    async def next(self) -> tuple[int, RequestOutput]:
        try:
            out = await self._stream.get()
        except EngineFailure as exc:
            if not exc.user_error:
                self._metrics.finished.labels("error").inc()
            raise APIError(400 if exc.user_error else 500, str(exc)) from None
        index = self._index[out.request_id]
        self._progress[index].observe(out)
        self._outputs[index] = out
        return index, out

    def abort_unfinished(self) -> None:
        for request_id, index in self._index.items():
            if not self._progress[index].finished:
                self._thread.abort(request_id)


def _engine_phases(clock: PhaseClock, first: RequestOutput) -> None:
    """The first output's way through the engine thread, on the clock: waiting for the
    thread, the engine until the first token (none when the request failed first), and
    the hand-back to the event loop."""
    clock.until("queue", first.arrival_time)
    if first.first_token_time is not None:
        clock.until("engine", first.first_token_time)
    clock.lap("deliver")


class ReplicaServer:
    def __init__(self, engine: LLMEngine, config: ServeConfig) -> None:
        self.engine = engine
        self.config = config
        self.model = ModelInfo(
            config.served_model_name,
            engine.tokenizer,
            engine.max_model_len,
            engine.loaded.config.vocab_size,
            engine.config.resolved_dtype,
        )
        self.thread = EngineThread(engine)
        self.arrays = ArrayReader()  # a long prompt's ids, parsed in pieces
        hint_tokens = engine.hint_tokens  # read before the engine thread owns the engine
        self.head = PromptHead(hint_tokens, self._send_head) if hint_tokens else None
        self.metrics = ServerMetrics(lambda: self.thread.snapshot, config.served_model_name)
        self.instance = uuid.uuid4().hex  # changes on restart: the router drops its cache index
        # Names the tokenizer to the router, which then sends the ids it made of a long text
        # prompt (kvshare.serve.packed_request).
        self.tokenizer_digest = engine.tokenizer.digest if engine.tokenizer is not None else ""
        self.created = int(time.time())

    async def start(self, app: web.Application) -> None:
        self.thread.start(asyncio.get_running_loop())

    async def stop(self, app: web.Application) -> None:
        await asyncio.to_thread(self.thread.stop)
        self.arrays.close()

    def _send_head(self, ids: np.ndarray, body: bytes) -> None:
        """A long prompt's first ids to the engine (PromptHead.send), with the body's
        cache_salt: the hint's pool keys must be the request's. A salt not written as one
        plain string (escaped, or several) makes no hint, as does none where one is
        required; a wrong one costs a lookup that finds nothing."""
        if b'"cache_salt"' not in body:
            if not self.config.cache_salt_required:
                self.thread.hint(ids)
            return
        salts = _PLAIN_CACHE_SALT.findall(body)
        if len(salts) == 1:
            self.thread.hint(ids, salts[0].decode(errors="replace"))

    @web.middleware
    async def count_requests(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"
        try:
            response = await handler(request)
        except asyncio.CancelledError:
            self.metrics.requests.labels(endpoint, "499").inc()  # the client went away
            raise
        self.metrics.requests.labels(endpoint, str(response.status)).inc()
        return response

    # ------------------------------------------------------------ public endpoints

    async def health(self, request: web.Request) -> web.Response:
        alive = self.thread.alive
        return web.json_response(
            {
                "status": "ok" if alive else "engine thread is not running",
                "model": self.model.name,
                "instance": self.instance,
                # What generate requests may be sent as: the router packs for such a replica.
                "request_types": ["application/json", PACKED_TYPE],
                "tokenizer": self.tokenizer_digest,
            },
            status=200 if alive else 503,
        )

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        tokenizer = self.model.tokenizer
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model.name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "kvshare",
                        "max_model_len": self.model.max_model_len,
                        # Clients of a tokenizer-less model (shape:NAME) must send token ids below vocab_size.
                        "vocab_size": self.model.vocab_size,
                        "dtype": self.model.dtype,
                        "tokenizer": tokenizer is not None,
                        "chat_template": tokenizer is not None
                        and tokenizer.chat_template is not None,
                    }
                ],
            }
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        received = time.monotonic()
        clock = PhaseClock(received)
        body = await read_json_object(request, clock=clock, reader=self.arrays, head=self.head)
        if self.config.cache_salt_required and body.get("cache_salt") is None:
            raise bad_request(
                "this server requires a cache_salt on every request: a non-empty "
                "string, secret to your tenant, that isolates its prefix cache",
                "cache_salt",
            )
        if not chat and isinstance(body.get("prompt"), np.ndarray):
            # Token ids the body parser already read into an array: checked in well under a
            # millisecond at 261,888 ids, less than the hop to a worker thread and back.
            req = parse_generate(body, chat, self.model)
        else:  # text to tokenize, a chat to template: off the event loop
            req = await asyncio.to_thread(parse_generate, body, chat, self.model)
        clock.lap("prompt")
        if not self.thread.alive:
            raise APIError(503, "the engine thread is not running")
        fmt = ResponseFormat(
            chat,
            f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            self.model.name,
            int(time.time()),
            self.model.tokenizer,
            req.logprobs,
        )
        choices = _Choices(self.thread, self.metrics, fmt.request_id, req, received)
        try:
            # The first output comes before any byte is sent: an engine failure is a 500.
            first = await choices.next()
            _engine_phases(clock, first[1])
            if req.stream:
                return await self._stream(request, req, fmt, choices, first, clock)
            while not choices.all_finished:
                await choices.next()
            clock.lap("answer")
            return web.json_response(
                fmt.full(choices.latest), headers={TIMING_HEADER: clock.header()}
            )
        finally:
            choices.abort_unfinished()  # cancelled (client gone), write failed, or failed

    async def _stream(
        self,
        request: web.Request,
        req: GenerateRequest,
        fmt: ResponseFormat,
        choices: _Choices,
        first: tuple[int, RequestOutput],
        clock: PhaseClock,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**SSE_HEADERS, TIMING_HEADER: clock.header()})
        await resp.prepare(request)
        if fmt.chat:
            for index in range(req.n):
                await resp.write(sse_event(fmt.role_chunk(index, req.include_usage)))
        streamed_text = [0] * req.n  # characters per choice: completions' text_offset
        index, out = first
        while True:
            if out.new_text or out.new_token_ids or out.finished:
                chunk = fmt.chunk(index, out, streamed_text[index], req.include_usage)
                streamed_text[index] += len(out.new_text)
                await resp.write(sse_event(chunk))
            if choices.all_finished:
                break
            try:
                index, out = await choices.next()
            except APIError as exc:  # headers are sent: the error goes into the stream
                await resp.write(sse_event(exc.body()))
                await resp.write_eof()
                return resp
        if req.include_usage:
            await resp.write(sse_event(fmt.usage_chunk(choices.latest)))
        await resp.write(sse_event("[DONE]"))
        await resp.write_eof()
        return resp

    # ------------------------------------------------------------ admin

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        await read_json_object(request, allow_empty=True)
        reset = await self.thread.call(lambda engine: engine.reset_prefix_cache())
        return web.json_response({"reset_blocks": reset})

    async def set_kv_pool(self, request: web.Request) -> web.Response:
        enabled = (await read_json_object(request)).get("enabled")
        if not isinstance(enabled, bool):
            raise bad_request("enabled must be true or false", "enabled")
        connector = self.engine.connector
        if connector is None:
            if enabled:
                raise APIError(
                    409, "this replica runs without a KV pool (--no-kv-pool)", param="enabled"
                )
            return web.json_response({"enabled": False})

        def switch(engine: LLMEngine) -> bool:
            connector.set_enabled(enabled)
            return connector.enabled

        return web.json_response({"enabled": await self.thread.call(switch)})

    async def clear_pool(self, request: web.Request) -> web.Response:
        await read_json_object(request, allow_empty=True)
        connector = self.engine.connector
        if connector is None:
            return web.json_response({"cleared": 0})
        try:  # on the engine thread: the client and its reconnects belong to the connector
            cleared = await self.thread.call(lambda engine: connector.clear_pool())
        except KVStoreUnavailable as exc:
            raise APIError(503, f"the KV pool is unavailable: {exc}") from None
        return web.json_response({"cleared": cleared})

    async def stats(self, request: web.Request) -> web.Response:
        def collect(engine: LLMEngine) -> dict[str, Any]:
            snap = snapshot_of(engine)
            daemon = engine.connector.pool_stats() if engine.connector is not None else None
            return {
                "engine": {
                    "running": snap.running,
                    "waiting": snap.waiting,
                    "gpu_cache_usage": snap.gpu_cache_usage,
                    "num_blocks": snap.num_blocks,
                    "kv_pool_enabled": snap.pool_enabled,
                    "local_waits": (snap.waits or {}).get("local_waits", 0),
                    "pool_waits": (snap.waits or {}).get("pool_waits", 0),
                },
                "kv_pool": snap.kv_pool,
                "pool": daemon,
            }

        return web.json_response(await self.thread.call(collect))

    async def cache_events(self, request: web.Request) -> web.Response:
        """What the GPU prefix cache stored and evicted since `after` of `generation`
        (kvshare.engine.cache_events), whether this replica uses the pool, and the pool's
        size and clear count: what the router needs to score replicas by the truth."""
        # No generation (a reader that knows nothing yet): a snapshot.
        generation = _query_int(request, "generation", -1)
        after = _query_int(request, "after", 0)

        def collect(engine: LLMEngine) -> dict[str, Any]:
            blocks, connector = engine.blocks, engine.connector
            events = blocks.events.since(generation, after, lambda: blocks.hash_to_block)
            daemon = connector.pool_stats() if connector is not None else None
            return {
                "instance": self.instance,
                "block_size": blocks.block_size,
                "generation": events.generation,
                "last": events.last,
                "snapshot": events.snapshot,
                "stored": [h.hex() for h in events.stored],
                "removed": [h.hex() for h in events.removed],
                "kv_pool_enabled": connector is not None and connector.enabled,
                # A request with at most short_work_tokens to compute past its GPU-cached
                # prefix joins the next step (of up to step_tokens) ahead of long prefills.
                "step_tokens": engine.scheduler.config.max_num_batched_tokens,
                "short_work_tokens": engine.scheduler.short_work_tokens,
                "pool": None
                if daemon is None or connector is None
                else {
                    "pages": pool_capacity_pages(daemon),
                    "cleared_keys": daemon.get("cleared_keys", 0),
                    "chunk_tokens": connector.chunk_tokens,
                },
            }

        return web.json_response(await self.thread.call(collect))


def pool_capacity_pages(daemon: dict[str, Any]) -> int | None:
    """Pages of the smallest size stored (KV pages) the arena can hold now: those its slabs
    of that size have, plus what its free slabs would. Slabs carved for larger pages (a
    hybrid model's state pages) are not counted: they hold no KV page until a clear gives
    them back, and counting them had the router credit a pool 4 GiB of which a quarter
    held states with documents it had already evicted. None before any page was stored.
    Not the daemon's own `pages` either: a clear gives every slab back, and that count
    then reads 0 for an emptied pool of any size."""
    classes = daemon.get("classes") or ()
    if not classes or "free_slabs" not in daemon:
        return None
    smallest = min(classes, key=lambda c: int(c["slot_bytes"]))
    return int(smallest["pages"]) + int(daemon["free_slabs"]) * int(smallest["slots_per_slab"])


def _query_int(request: web.Request, name: str, default: int) -> int:
    value = request.query.get(name)
    if value is None:
        return default
    if not value.isdigit():
        raise bad_request(f"{name} must be a non-negative integer, got {value!r}", name)
    return int(value)


SERVER_KEY = web.AppKey("kvshare_replica_server", ReplicaServer)


def build_app(engine: LLMEngine, config: ServeConfig) -> web.Application:
    """The replica's aiohttp app; the engine thread runs from startup to cleanup."""
    server = ReplicaServer(engine, config)
    middlewares = [
        server.count_requests,
        error_middleware,
        access_middleware(AccessKeys(config.api_key, config.admin_key)),
    ]
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    app[SERVER_KEY] = server
    app.on_startup.append(server.start)
    app.on_cleanup.append(server.stop)
    app.router.add_get("/health", server.health)
    app.router.add_get("/version", server.version)
    app.router.add_get("/metrics", server.metrics_text)
    app.router.add_get("/v1/models", server.models)
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.chat_completions)
    app.router.add_post("/admin/reset_prefix_cache", server.reset_prefix_cache)
    app.router.add_post("/admin/kv_pool", server.set_kv_pool)
    app.router.add_post("/admin/clear_pool", server.clear_pool)
    app.router.add_get("/admin/stats", server.stats)
    app.router.add_get("/admin/cache_events", server.cache_events)
    return app
