"""aiohttp pieces shared by the replica server and the router: error middleware,
strict JSON bodies, and Server-Sent Events."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from kvshare.serve.errors import APIError, bad_request

_log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes an OpenAI-style JSON error; nothing escapes to aiohttp's HTML."""
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response()
    except web.HTTPRequestEntityTooLarge as exc:  # its text names the limit
        return APIError(413, f"request body too large: {exc.text}").response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return APIError(exc.status, f"{request.method} {request.path}: {exc.reason}").response()
    except ConnectionResetError:
        raise  # the client is gone: there is nobody to answer
    except Exception:
        _log.exception("unhandled error in %s %s", request.method, request.path)
        return APIError(500, "internal server error").response()


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


async def read_json_object(request: web.Request, *, allow_empty: bool = False) -> dict[str, Any]:
    """The body as a JSON object: 415 for another content type, 413 over the app's size
    limit, 400 for invalid UTF-8, malformed JSON (NaN included) or a non-object."""
    raw = await request.read()
    if not raw and allow_empty:
        return {}
    if request.content_type != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {request.content_type!r}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8: {exc}") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, not {type(body).__name__}")
    return body


SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


def sse_event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
