"""A fake kvshare cluster: a router and N replicas behind one aiohttp app, for bench tests.

It implements the HTTP API the bench codes against (streamed completions and chat with usage,
replica pinning, the admin endpoints) and a toy cache model: a prompt is its whitespace-split
words (or its token ids); every chunk-aligned prefix a replica prefills goes into that
replica's GPU cache and, when the pool is on, into the shared pool, where it is reserved for
`commit_delay_s` before lookups see it (as a real store commits after its copy). The time to
the first content chunk grows with the tokens that hit neither, so the pool visibly helps.

Every admin call and request is appended to `events`, in arrival order, for the tests to check.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

CHUNK = 4  # tokens per pool chunk
CHUNK_BYTES = 1000
MODEL_ID = "smollm2-135m"


@dataclass(frozen=True)
class Event:
    kind: str  # "admin" or "request"
    replica: int
    path: str
    body: dict[str, Any]  # admin: the JSON body; request: summary fields
    pinned: bool = False  # request: the router was told the replica
    via_router: bool = False  # admin: sent to the router's /admin/all/<action>


@dataclass
class FakeCluster:
    replicas: int = 2
    first_content_delay_s: float = 0.03  # after the empty first chunk
    per_token_s: float = 2e-4  # per computed (not cached) prompt token
    fail_admin: str | None = None  # this admin action answers HTTP 502
    refuse_pool_on: bool = False  # kv_pool {"enabled": true} answers HTTP 502
    commit_delay_s: float = 0.05  # a stored prefix is reserved this long, then committed
    ignore_pins: bool = False  # a broken router: x-kvshare-replica is not obeyed
    events: list[Event] = field(default_factory=list)
    pool: dict[tuple[Any, ...], float] = field(default_factory=dict)  # prefix -> visible from
    max_in_flight: int = 0
    switches: tuple[bool, ...] = ()  # each replica's pool switch at start; (): all on
    _in_flight: int = 0
    _next: int = 0

    def __post_init__(self) -> None:
        self.enabled = list(self.switches or (True,) * self.replicas)
        self.gpu: list[set[tuple[Any, ...]]] = [set() for _ in range(self.replicas)]
        self.loaded = [0] * self.replicas
        self.stored = [0] * self.replicas

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/admin/replicas", self._replicas)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/r{replica}/admin/{action}", self._admin)
        app.router.add_post("/admin/all/{action}", self._admin_all)
        app.router.add_get("/r{replica}/admin/stats", self._stats)
        app.router.add_get("/admin/all/stats", self._all_stats)
        return app

    def requests(self) -> list[Event]:
        return [e for e in self.events if e.kind == "request"]

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]})

    async def _replicas(self, request: web.Request) -> web.Response:
        origin = str(request.url.origin())
        return web.json_response(
            [
                {"url": f"{origin}/r{i}", "healthy": True, "in_flight": 0}
                for i in range(self.replicas)
            ]
        )

    async def _admin(self, request: web.Request) -> web.Response:
        replica, action = int(request.match_info["replica"]), request.match_info["action"]
        body = await request.json() if request.can_read_body else {}
        self._apply(replica, action, body, via_router=False)
        return web.json_response({"ok": True})

    async def _admin_all(self, request: web.Request) -> web.Response:
        action = request.match_info["action"]
        body = await request.json() if request.can_read_body else {}
        for replica in range(self.replicas):
            self._apply(replica, action, body, via_router=True)
        return web.json_response(
            {"replicas": [{"index": i, "status": 200} for i in range(self.replicas)]}
        )

    def _apply(self, replica: int, action: str, body: dict[str, Any], via_router: bool) -> None:
        self.events.append(Event("admin", replica, action, body, via_router=via_router))
        if action == self.fail_admin or (
            self.refuse_pool_on and action == "kv_pool" and body["enabled"]
        ):
            raise web.HTTPBadGateway(text="injected failure")
        if action == "kv_pool":
            self.enabled[replica] = bool(body["enabled"])
        elif action == "clear_pool":
            self.pool.clear()
        elif action == "reset_prefix_cache":
            self.gpu[replica].clear()
        else:
            raise web.HTTPNotFound()

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self._stats_of(int(request.match_info["replica"])))

    async def _all_stats(self, request: web.Request) -> web.Response:
        answers = [
            {"index": i, "status": 200, "body": self._stats_of(i)} for i in range(self.replicas)
        ]
        return web.json_response({"replicas": answers})

    def _stats_of(self, i: int) -> dict[str, Any]:
        kv_pool = {
            "loaded_bytes": self.loaded[i],
            "stored_bytes": self.stored[i],
            "hit_tokens": 0,
            "miss_tokens": 0,
        }
        now = time.monotonic()
        pool = {"reserved": sum(visible > now for visible in self.pool.values())}
        engine = {"replica": i, "kv_pool_enabled": self.enabled[i]}
        return {"engine": engine, "kv_pool": kv_pool, "pool": pool}

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["prompt"]
        tokens = tuple(prompt) if isinstance(prompt, list) else tuple(prompt.split())
        return await self._serve(request, body, tokens, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        words = [w for m in body["messages"] for w in [f"<{m['role']}>", *m["content"].split()]]
        return await self._serve(request, body, tuple(words), chat=True)

    def _pick(self, request: web.Request) -> tuple[int, bool]:
        if "x-kvshare-replica" in request.headers and not self.ignore_pins:
            return int(request.headers["x-kvshare-replica"]), True
        self._next = (self._next + 1) % self.replicas
        return self._next, False

    @staticmethod
    def _prefixes(tokens: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        return [tokens[:n] for n in range(CHUNK, len(tokens) + 1, CHUNK)]

    def _lookup(self, replica: int, tokens: tuple[Any, ...]) -> dict[str, int]:
        prefixes = self._prefixes(tokens)
        gpu = max((len(p) for p in prefixes if p in self.gpu[replica]), default=0)
        pool = 0
        if self.enabled[replica]:
            now = time.monotonic()
            pool = max((len(p) for p in prefixes if self.pool.get(p, now + 1) <= now), default=0)
            pool = max(0, pool - gpu)
            self.loaded[replica] += pool // CHUNK * CHUNK_BYTES
        return {
            "gpu_hit_tokens": gpu,
            "pool_hit_tokens": pool,
            "computed_tokens": len(tokens) - gpu - pool,
        }

    def _store(self, replica: int, tokens: tuple[Any, ...]) -> None:
        """After the prefill: into the GPU cache, and reserved in the pool until committed."""
        prefixes = self._prefixes(tokens)
        self.gpu[replica].update(prefixes)
        if self.enabled[replica]:
            new = [p for p in prefixes if p not in self.pool]
            self.stored[replica] += len(new) * CHUNK_BYTES
            self.pool.update(dict.fromkeys(new, time.monotonic() + self.commit_delay_s))

    async def _serve(
        self, request: web.Request, body: dict[str, Any], tokens: tuple[Any, ...], chat: bool
    ) -> web.StreamResponse:
        replica, pinned = self._pick(request)
        summary = {
            "tokens": tokens,
            "max_tokens": body["max_tokens"],
            "chat": chat,
            "session": request.headers.get("x-session-id"),
        }
        self.events.append(Event("request", replica, request.path, summary, pinned))
        kv = self._lookup(replica, tokens)
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            delay_s = self.first_content_delay_s + kv["computed_tokens"] * self.per_token_s
            resp = web.StreamResponse(
                headers={
                    "content-type": "text/event-stream",
                    "x-kvshare-replica": str(replica),
                    # What the delay stands for, as a replica reports it.
                    "server-timing": f"engine;dur={1e3 * delay_s:.3f}",
                }
            )
            await resp.prepare(request)
            await _send(resp, _chunk(chat, "", None))  # role-only: not content
            await asyncio.sleep(delay_s)
            self._store(replica, tokens)
            n = body["max_tokens"]
            for k in range(n):
                await _send(resp, _chunk(chat, f" w{replica}x{k}", 1000 + k))
                await asyncio.sleep(0.001)
            cached = kv["gpu_hit_tokens"] + kv["pool_hit_tokens"]
            usage = {
                "prompt_tokens": len(tokens),
                "completion_tokens": n,
                "total_tokens": len(tokens) + n,
                "prompt_tokens_details": {"cached_tokens": cached},
                "kv": kv,
            }
            await _send(resp, {"choices": [], "usage": usage})
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self._in_flight -= 1


def _chunk(chat: bool, text: str, token_id: int | None) -> dict[str, Any]:
    ids = [] if token_id is None else [token_id]
    choice = (
        {"index": 0, "delta": {"role": "assistant", "content": text}}
        if chat
        else {"index": 0, "text": text}
    )
    return {"choices": [{**choice, "token_ids": ids, "finish_reason": None}]}


async def _send(resp: web.StreamResponse, payload: dict[str, Any]) -> None:
    await resp.write(f"data: {json.dumps(payload)}\n\n".encode())


@dataclass
class RunningFake:
    cluster: FakeCluster
    url: str


def serve_in_thread(cluster: FakeCluster) -> Iterator[RunningFake]:
    """Run the fake on its own event loop in a thread (the bench runs asyncio.run itself)."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(cluster.app())

    async def start() -> int:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    try:
        yield RunningFake(cluster, f"http://127.0.0.1:{port}")
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
