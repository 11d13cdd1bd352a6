"""Run an aiohttp app on a background thread's event loop, for tests with a sync client."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from kvshare.serve.router import Router


class BackgroundServer:
    """Serves `app` on 127.0.0.1 (`port`, or a free one) until `close()`; handlers are cancelled when
    their client disconnects, as under `kvshare serve` (unless `handler_cancellation` is
    False: aiohttp's default)."""

    def __init__(
        self, app: web.Application, port: int = 0, handler_cancellation: bool = True
    ) -> None:
        self._app = app
        self._port = port
        self._handler_cancellation = handler_cancellation
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.url = ""
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(60) or self._error is not None:
            raise RuntimeError(f"test server did not start: {self._error}")

    def _run(self) -> None:
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    async def _serve(self) -> None:
        runner = web.AppRunner(
            self._app, handler_cancellation=self._handler_cancellation, access_log=None
        )
        try:
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", self._port)
            await site.start()
            port = runner.addresses[0][1]
            self.url = f"http://127.0.0.1:{port}"
            self._stop = asyncio.Event()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


def stand_in_replica(
    completions: Callable[[web.Request], Awaitable[web.StreamResponse]],
    health: dict[str, Any] | None = None,
) -> BackgroundServer:
    """A replica stand-in for router tests: GET /health answers `health` (by default an
    instance id), POST /v1/completions and /v1/chat/completions run `completions`."""

    async def answer_health(request: web.Request) -> web.Response:
        return web.json_response({"instance": "a"} if health is None else health)

    app = web.Application()
    app.router.add_get("/health", answer_health)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    return BackgroundServer(app)


def wait_checked(router: Router, timeout: float = 10.0) -> None:
    """Until a health check of every replica has passed (the router then knows what each
    said of itself)."""
    deadline = time.monotonic() + timeout
    while not all(replica.answered for replica in router.replicas):
        assert time.monotonic() < deadline, "the router's health checks never passed"
        time.sleep(0.02)
