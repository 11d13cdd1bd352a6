"""aiohttp pieces shared by the replica server and the router: error middleware,
strict JSON bodies, and Server-Sent Events."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from aiohttp import web

from kvshare.serve.errors import APIError, bad_request
from kvshare.serve.packed_request import CONTENT_TYPE as PACKED_TYPE
from kvshare.serve.packed_request import unpack_request
from kvshare.serve.server_timing import PhaseClock

_log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Bodies above this are parsed on a worker thread: an 8 MiB JSON takes tens of milliseconds.
PARSE_ON_LOOP_BYTES = 64 << 10
# A \uXXXX escape of a UTF-16 surrogate: the only way a JSON text decoded from UTF-8 can
# give Python a lone surrogate, which no tokenizer or encoder accepts.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
# Bodies from this size on read a top-level "prompt" of plain token ids straight into an
# array: json.loads makes one Python int per id (10 ms for 131k ids on an H200's host,
# twice per request: router and replica), numpy parses the same text 5-10x faster.
TOKEN_ARRAY_BYTES = 64 << 10
TOKEN_ARRAY_KEY = "prompt"
_ID_LIMIT = 10**9  # ids of more digits take the general parser (and its errors)
_DIGIT_POWERS = tuple(10**k for k in range(1, 9))  # an id below 10**9 has at most 9 digits
_NOT_SPACE = re.compile(r"[^ \t\n\r]")


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


def _has_lone_surrogate(body: object) -> bool:
    stack = [body]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def array_threads() -> int:
    """Threads for reading a long token array: one for every 4 cores this process may run
    on, at most 4. Measured on a 16-core GPU host, 131,072 ids: 6.7 ms on one thread, 4.5
    on 2, 3.3 on 4; on a 2-core VM, 2 threads ran at 0.82x the speed of one, so below 8
    cores it stays one."""
    return min(4, max(1, len(os.sched_getaffinity(0)) // 4))


class ArrayReader:
    """Reads a long token array in pieces on a pool of threads: numpy parses text and
    compares bytes with the GIL released, so the pieces run at once. Pieces of at least
    `piece_bytes`, at most one a thread; one thread reads inline. The replica's and the
    router's apps each own one (close() at cleanup)."""

    def __init__(self, threads: int | None = None, piece_bytes: int = 128 << 10) -> None:
        threads = array_threads() if threads is None else threads
        if threads < 1 or piece_bytes < 1:
            raise ValueError("an ArrayReader needs threads >= 1 and piece_bytes >= 1")
        self.threads = threads
        self.piece_bytes = piece_bytes
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="token-array")

    def pieces(self, nbytes: int) -> int:
        return max(1, min(self.threads, nbytes // self.piece_bytes))

    def read(self, pieces: list[bytes]) -> list[np.ndarray | None]:
        return list(self._pool.map(_read_ids, pieces))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def token_array(
    data: bytes, start: int, reader: ArrayReader | None = None
) -> tuple[np.ndarray, int] | None:
    """The JSON array at data[start] ("[") as int64 and the index after its "]", when it
    is a non-empty flat list of integers in [0, 10**9) written as JSON writes them; None
    for anything else, which the general parser then reads (with its errors). A long array
    is read in pieces cut at commas on `reader`'s threads.

    Exact, not a guess: the array holds only digits, commas and JSON whitespace (so its
    first "]" ends it) and every piece passes _read_ids, so the whole does: each piece has
    one comma fewer than ids and the pieces are joined by one comma each."""
    stop = data.find(b"]", start)
    if stop < 0:
        return None
    inner = data[start + 1 : stop]
    pieces = _cut_at_commas(inner, reader.pieces(len(inner)) if reader else 1)
    read = reader.read(pieces) if reader and len(pieces) > 1 else [_read_ids(inner)]
    arrays = [ids for ids in read if ids is not None]
    if len(arrays) != len(read):
        return None
    return (arrays[0] if len(arrays) == 1 else np.concatenate(arrays)), stop + 1


def _cut_at_commas(text: bytes, pieces: int) -> list[bytes]:
    """text cut into at most `pieces` parts of about equal size at commas, the commas
    dropped (a comma between two ids: any other makes a part that _read_ids refuses)."""
    cuts: list[int] = []
    for k in range(1, pieces):
        at = text.find(b",", max(len(text) * k // pieces, cuts[-1] + 1 if cuts else 0))
        if at < 0:
            break
        cuts.append(at)
    starts = [0, *(at + 1 for at in cuts)]
    return [text[a:b] for a, b in zip(starts, [*cuts, len(text)])]


def _read_ids(text: bytes) -> np.ndarray | None:
    """The ids of text (between brackets, or a piece of that cut at a comma) when it is a
    non-empty list of integers in [0, 10**9) written as JSON writes them, else None.

    Exact: text holds only digits, commas and JSON whitespace, numpy reads every id, there
    is one comma fewer than ids, and the digits numpy read are all the digits there are (no
    leading zeros, no empty items)."""
    digits, commas, spaces = _character_counts(text)
    if digits == 0 or digits + commas + spaces != len(text):
        return None
    try:
        ids = np.fromstring(text, dtype=np.int64, sep=",")  # raises on a malformed list
    except ValueError:
        return None
    if len(ids) != commas + 1 or ids.max() >= _ID_LIMIT:
        return None
    read = len(ids) + sum(int(np.count_nonzero(ids >= power)) for power in _DIGIT_POWERS)
    return ids if read == digits else None


def _character_counts(text: bytes) -> tuple[int, int, int]:
    """How many of text's bytes are ASCII digits, commas and JSON whitespace. numpy
    compares every byte with a constant at once: five such passes over a 1 MB array
    take a third of the time of bytes.translate and count."""
    codes = np.frombuffer(text, dtype=np.uint8)

    def count(mask: np.ndarray) -> int:
        return int(np.count_nonzero(mask))

    digits = count(codes <= ord("9")) - count(codes < ord("0"))
    spaces = count(codes == ord(" "))
    if count(codes < ord(" ")):  # control characters, of which JSON allows \t, \n and \r
        spaces += sum(count(codes == ord(c)) for c in "\t\n\r")
    return digits, count(codes == ord(",")), spaces


def _skip_space(text: str, i: int) -> int:
    match = _NOT_SPACE.search(text, i)
    return len(text) if match is None else match.start()


# Where a body's text holds the token arrays read by token_array: [start, end) spans.
ArraySpans = list[tuple[int, int]]


def _object_with_token_array(
    text: str, data: bytes | None, reader: ArrayReader | None
) -> tuple[dict[str, Any], ArraySpans] | None:
    """json.loads(text) for a JSON object, with its top-level `prompt` of token ids read
    by token_array from `data` (text's bytes when they index like text: ASCII; None: no
    fast read) as an int64 array instead of a list, and the spans of text read so; None
    when the text is anything else or anything is off (the general parser then reads it
    and names the error). Keys and every other value go through json's own scanner,
    duplicate keys included."""
    i = _skip_space(text, 0)
    if not text.startswith("{", i):
        return None
    body: dict[str, Any] = {}
    arrays: ArraySpans = []
    i = _skip_space(text, i + 1)
    if text.startswith("}", i):
        return (body, arrays) if _skip_space(text, i + 1) == len(text) else None
    while True:
        if not text.startswith('"', i):
            return None
        key, i = json.decoder.scanstring(text, i + 1)
        i = _skip_space(text, i)
        if not text.startswith(":", i):
            return None
        i = _skip_space(text, i + 1)
        fast = None
        if data is not None and key == TOKEN_ARRAY_KEY and text.startswith("[", i):
            fast = token_array(data, i, reader)
        if fast is None:
            value, i = _DECODER.scan_once(text, i)
        else:
            arrays.append((i, fast[1]))
            value, i = fast
        body[key] = value
        i = _skip_space(text, i)
        if text.startswith("}", i):
            return (body, arrays) if _skip_space(text, i + 1) == len(text) else None
        if not text.startswith(",", i):
            return None
        i = _skip_space(text, i + 1)


def parse_json_object(raw: bytes, reader: ArrayReader | None = None) -> dict[str, Any]:
    """A request body as a JSON object; APIError 400 for invalid UTF-8, malformed JSON (NaN
    included), nesting too deep for the parser, a lone UTF-16 surrogate in a string, or a
    non-object. In a body of TOKEN_ARRAY_BYTES or more, a top-level `prompt` that is a list
    of token ids comes back as an int64 numpy array (see token_array; `reader`: read in
    pieces on its threads)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8: {exc}") from None
    if len(raw) >= TOKEN_ARRAY_BYTES:
        try:
            ascii_raw = raw if len(raw) == len(text) else None
            fast = _object_with_token_array(text, ascii_raw, reader)
        except (ValueError, RecursionError, StopIteration):
            fast = None
        if fast is not None:
            body, arrays = fast
            return _checked(body, arrays, text)
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, not {type(body).__name__}")
    return _checked(body, [], text)


def _checked(body: dict[str, Any], arrays: ArraySpans, text: str) -> dict[str, Any]:
    """`body`, unless a string of it holds a lone surrogate. Only a \\u escape gives one,
    and it is looked for outside the token arrays (`arrays`: digits, commas and spaces,
    bounded by brackets, which no escape can reach into)."""
    if _escape_outside(text, arrays) and _has_lone_surrogate(body):
        raise bad_request(
            "request body holds a string with a lone UTF-16 surrogate (e.g. "
            "\\ud800): strings must be valid Unicode"
        )
    return body


def _escape_outside(text: str, arrays: ArraySpans) -> bool:
    """Whether text outside `arrays` holds a \\u escape of a UTF-16 surrogate."""
    start = 0
    for end, after in [*arrays, (len(text), len(text))]:
        if _SURROGATE_ESCAPE.search(text, start, end):
            return True
        start = after
    return False


async def read_json_object(
    request: web.Request,
    *,
    allow_empty: bool = False,
    clock: PhaseClock | None = None,
    reader: ArrayReader | None = None,
) -> dict[str, Any]:
    """The body as a JSON object (see parse_json_object; its token array on `reader`), or a
    request the router packed (kvshare.serve.packed_request); 415 for another content type,
    413 over the app's size limit. A large JSON body is parsed off the event loop. `clock`
    gets the phases `read` and `parse`."""
    raw = await request.read()
    if clock is not None:
        clock.lap("read")
    if not raw and allow_empty:
        return {}
    if request.content_type == PACKED_TYPE:
        body = unpack_request(raw)
    elif request.content_type != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {request.content_type!r}")
    elif len(raw) > PARSE_ON_LOOP_BYTES:
        body = await asyncio.to_thread(parse_json_object, raw, reader)
    else:
        body = parse_json_object(raw)
    if clock is not None:
        clock.lap("parse")
    return body


SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def sse_event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
