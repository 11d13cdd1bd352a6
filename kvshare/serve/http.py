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
from dataclasses import dataclass
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
_JSON_SPACE = " \t\n\r"
_NOT_SPACE = re.compile(f"[^{_JSON_SPACE}]")


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

    def read(
        self, data: bytes, spans: list[tuple[int, int]]
    ) -> Callable[[], list[np.ndarray | None]]:
        """Starts _read_ids of each data[a:b], each on a thread (a piece's copy out of
        `data`, with the GIL held, overlaps the pieces before it being parsed); the
        returned function waits for them and gives their results in order."""
        futures = [self._pool.submit(_read_span, data, a, b) for a, b in spans]
        return lambda: [future.result() for future in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class PromptHead:
    """Who wants a long token array's first `ids` ids before the rest is read: `send(ids,
    body)` is called once with them (and the whole body, for the caller to find other
    fields in), on the thread that reads the array, while the rest is read on the reader's
    threads. The ids are unchecked: the array may still be refused, and send must not
    raise (a failure is logged, never the request's)."""

    ids: int
    send: Callable[[np.ndarray, bytes], None]


# Bytes of text the head piece holds per id it is meant to hold: an id below 10**6 (every
# vocabulary's), its comma and one space (json.dumps' default separator) take at most 8.
_HEAD_BYTES_PER_ID = 8


def token_array(
    data: bytes,
    start: int,
    reader: ArrayReader | None = None,
    head: PromptHead | None = None,
) -> tuple[np.ndarray, int] | None:
    """The JSON array at data[start] ("[") as int32 and the index after its "]", when it
    is a non-empty flat list of integers in [0, 10**9) written as JSON writes them; None
    for anything else, which the general parser then reads (with its errors). A long array
    is read in pieces cut at commas on `reader`'s threads; with `head`, an array of more
    than twice its ids' text has its first ids read first, by this thread, and sent.

    Exact, not a guess: the array holds only digits, commas and JSON whitespace (so its
    first "]" ends it) and every piece passes _read_ids, so the whole does: each piece has
    one comma fewer than ids and the pieces are joined by one comma each.

    Each piece is copied out of `data` once, by the thread that reads it, and comes back
    as int32, the engine's dtype: a 131k-id body is ~1 MB of text and 0.5 MB of ids, and
    every fresh megabyte a request allocates costs page faults (0.3-0.5 ms on a 2-vCPU
    machine) on the way to its first token."""
    stop = data.find(b"]", start)
    if stop < 0:
        return None
    first, head_span = start + 1, None
    if head is not None and stop - first > 2 * head.ids * _HEAD_BYTES_PER_ID:
        cut = data.find(b",", first + head.ids * _HEAD_BYTES_PER_ID, stop)
        if cut > 0:
            first, head_span = cut + 1, (first, cut)
    spans = _cut_at_commas(data, first, stop, reader.pieces(stop - first) if reader else 1)
    rest = reader.read(data, spans) if reader is not None and len(spans) > 1 else None
    read: list[np.ndarray | None] = []
    if head is not None and head_span is not None:
        read.append(_read_span(data, *head_span))
        if read[0] is not None:
            _send_head(head, read[0], data)
    read += rest() if rest is not None else [_read_span(data, *spans[0])]
    arrays = [ids for ids in read if ids is not None]
    if len(arrays) != len(read):
        return None
    return (arrays[0] if len(arrays) == 1 else np.concatenate(arrays)), stop + 1


def _send_head(head: PromptHead, ids: np.ndarray, data: bytes) -> None:
    try:
        head.send(ids, data)
    except Exception:  # a head's receiver only speeds a request up: it never fails one
        _log.exception("sending a prompt's first ids failed")


def _cut_at_commas(data: bytes, start: int, stop: int, pieces: int) -> list[tuple[int, int]]:
    """data[start:stop] cut into at most `pieces` spans of about equal size at commas, the
    commas left out (a comma between two ids: any other makes a span that _read_ids
    refuses)."""
    size = stop - start
    cuts: list[int] = []
    for k in range(1, pieces):
        at = data.find(b",", max(start + size * k // pieces, cuts[-1] + 1 if cuts else 0), stop)
        if at < 0:
            break
        cuts.append(at)
    return list(zip([start, *(at + 1 for at in cuts)], [*cuts, stop]))


def _read_span(data: bytes, start: int, stop: int) -> np.ndarray | None:
    return _read_ids(data[start:stop])


def _read_ids(text: bytes) -> np.ndarray | None:
    """The ids of text (between brackets, or a piece of that cut at a comma) as int32 when
    it is a non-empty list of integers in [0, 10**9) written as JSON writes them, else None.

    Exact: text holds only digits, commas and JSON whitespace, numpy reads every id, there
    is one comma fewer than ids, and the digits of the ids numpy read are all the digits
    there are. An id numpy reads wrong has fewer digits than its text: a leading zero
    (read as the number without it), or a number past int32 (ten digits or more), which
    wraps to a negative one (counted as one digit) or to one of at most ten digits, and
    ten-digit ids are refused by their value; no id is read with more digits than its
    text, so the totals agree only when every id was read right."""
    digits, commas, spaces = _character_counts(text)
    if digits == 0 or digits + commas + spaces != len(text):
        return None
    try:
        ids = np.fromstring(text, dtype=np.int32, sep=",")  # raises on a malformed list
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


# A top-level "prompt" of token ids as clients write it: the key, JSON whitespace, a colon,
# whitespace, the array's "[" (the match's last byte). A match elsewhere (a nested object's
# key) is found out by the walk over the rest of the body.
_PROMPT_ARRAY = re.compile(f'"{TOKEN_ARRAY_KEY}"[{_JSON_SPACE}]*:[{_JSON_SPACE}]*\\['.encode())
# Stands for the token array in the text the rest of the body is walked in.
_ARRAY_STAND_IN = "0"


def _object_around_token_array(
    raw: bytes, reader: ArrayReader | None, head: PromptHead | None
) -> tuple[dict[str, Any], str] | None:
    """json.loads(raw) for a JSON object whose top-level `prompt` is the first array
    _PROMPT_ARRAY finds and token_array reads (as an int32 array instead of a list), and
    the text the rest was read from; None when the body is anything else or anything is
    off (the general parser then reads it and names the error).

    Only the bytes around the array are decoded: they are walked as one text with the
    array replaced by a one-character stand-in, keys and every other value through json's
    own scanner, duplicate keys included. Exact: when the walk meets the top-level
    `prompt` key with its value at the stand-in, the body reads as that text does with
    the array in the stand-in's place (the array is digits, commas and whitespace up to
    its first "]", and UTF-8 cannot run across its ASCII ends)."""
    match = _PROMPT_ARRAY.search(raw)
    if match is None:
        return None
    read = token_array(raw, match.end() - 1, reader, head)
    if read is None:
        return None
    ids, end = read
    try:
        head, tail = raw[: match.end() - 1].decode("utf-8"), raw[end:].decode("utf-8")
    except UnicodeDecodeError:
        return None
    text = head + _ARRAY_STAND_IN + tail
    body = _object_with_value_at(text, len(head), ids)
    return None if body is None else (body, text)


def _object_with_value_at(text: str, at: int, value: object) -> dict[str, Any] | None:
    """The JSON object of text with `value` as its top-level `prompt` read at text[at]
    (the stand-in); None when text is not a JSON object or its walk never reads that
    member."""
    i = _skip_space(text, 0)
    if not text.startswith("{", i):
        return None
    body: dict[str, Any] = {}
    found = False
    i = _skip_space(text, i + 1)
    if text.startswith("}", i):
        return None
    while True:
        if not text.startswith('"', i):
            return None
        key, i = json.decoder.scanstring(text, i + 1)
        i = _skip_space(text, i)
        if not text.startswith(":", i):
            return None
        i = _skip_space(text, i + 1)
        if i == at and key == TOKEN_ARRAY_KEY:
            body[key], i, found = value, at + len(_ARRAY_STAND_IN), True
        else:
            body[key], i = _DECODER.scan_once(text, i)
        i = _skip_space(text, i)
        if text.startswith("}", i):
            return body if found and _skip_space(text, i + 1) == len(text) else None
        if not text.startswith(",", i):
            return None
        i = _skip_space(text, i + 1)


def parse_json_object(
    raw: bytes, reader: ArrayReader | None = None, head: PromptHead | None = None
) -> dict[str, Any]:
    """A request body as a JSON object; APIError 400 for invalid UTF-8, malformed JSON (NaN
    included), nesting too deep for the parser, a lone UTF-16 surrogate in a string, or a
    non-object. In a body of TOKEN_ARRAY_BYTES or more, a top-level `prompt` that is a list
    of token ids comes back as an int32 numpy array (see token_array; `reader`: read in
    pieces on its threads; `head`: gets the first ids first)."""
    if len(raw) >= TOKEN_ARRAY_BYTES:
        try:
            fast = _object_around_token_array(raw, reader, head)
        except (ValueError, RecursionError, StopIteration):
            fast = None
        if fast is not None:
            return _checked(*fast)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8: {exc}") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, not {type(body).__name__}")
    return _checked(body, text)


def _checked(body: dict[str, Any], text: str) -> dict[str, Any]:
    """`body`, unless a string of it holds a lone surrogate. Only a \\u escape in `text`
    (the body's, the token array left out) gives one."""
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(body):
        raise bad_request(
            "request body holds a string with a lone UTF-16 surrogate (e.g. "
            "\\ud800): strings must be valid Unicode"
        )
    return body


async def read_json_object(
    request: web.Request,
    *,
    allow_empty: bool = False,
    clock: PhaseClock | None = None,
    reader: ArrayReader | None = None,
    head: PromptHead | None = None,
) -> dict[str, Any]:
    """The body as a JSON object (see parse_json_object; its token array on `reader`, its
    first ids to `head`), or a
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
        body = await asyncio.to_thread(parse_json_object, raw, reader, head)
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
