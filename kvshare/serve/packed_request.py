"""A request body the router has parsed, packed for its replica: msgpack, with a prompt of
token ids as little-endian int32 bytes.

A cache-aware router parses every prompt to hash it. When the prompt is a list of token
ids (kvshare.serve.http reads it into an array), the router forwards the parsed body packed
instead of the JSON text, so the replica reads the ids with one np.frombuffer instead of
parsing ~1 MB of digits again (5-7 ms at 131k ids on a 2-vCPU machine).

A long text prompt or chat messages the router tokenized travel with their ids: the packed body
holds the JSON body's fields and, beside them, the ids (TOKENIZED_KEY, int32 bytes) and the
digest of the tokenizer and chat template that made them (TOKENIZER_KEY). The router sends
such a body only to a replica whose GET /health names the same digest, and a replica uses
the ids only when the digest is its own tokenizer's (else it tokenizes, as for JSON):
tokenizing a 131k-token prompt a second time cost as much as a pool hit. Any other body, and
any body for a replica that does not say it accepts this type (its GET /health lists
`request_types`), goes as received.

The replica accepts this type from anyone: it is the same request in another encoding,
decoded into what parse_json_object would give (JSON's own types, string keys, finite
floats; the prompt an int32 array) and checked by the same code after that. Ids sent
beside a prompt are what a token-id prompt would be: checked against the vocabulary alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from kvshare.serve.errors import bad_request

CONTENT_TYPE = "application/vnd.kvshare.request+msgpack"
PROMPT_KEY = "prompt"
TOKENIZED_KEY = "kvshare_prompt_ids"
TOKENIZER_KEY = "kvshare_tokenizer"
_ID_KEYS = (PROMPT_KEY, TOKENIZED_KEY)  # int32 bytes on the wire, arrays once unpacked
_ID = np.dtype("<i4")
_ID_LIMIT = 2**31


def pack_request(
    body: dict[str, Any], tokenized: Sequence[int] | None = None, tokenizer: str = ""
) -> bytes | None:
    """`body` (parsed) packed: its prompt as int32 bytes when it is an array, else the ids
    `tokenized` that the tokenizer of digest `tokenizer` made of its text prompt or chat
    messages, beside them. None when there are no such ids, an id does not fit int32, or a
    value does not fit msgpack (an integer past 64 bits): such a body is forwarded as
    received."""
    prompt = body.get(PROMPT_KEY)
    if isinstance(prompt, np.ndarray):
        key, ids, extra = PROMPT_KEY, prompt, {}
    elif tokenized is not None and tokenizer:
        key, ids, extra = TOKENIZED_KEY, np.asarray(tokenized), {TOKENIZER_KEY: tokenizer}
    else:
        return None
    if ids.ndim != 1 or not len(ids) or ids.min() < 0 or ids.max() >= _ID_LIMIT:
        return None
    try:
        return msgpack.packb({**body, **extra, key: ids.astype(_ID, copy=False).tobytes()})
    except (OverflowError, TypeError, ValueError):
        return None


def unpack_request(raw: bytes) -> dict[str, Any]:
    """The body a packed request stands for, as parse_json_object gives it; APIError 400
    for anything else: not msgpack, not a map, a non-string key, a value JSON cannot hold
    (bytes, extension types, NaN or infinity), a prompt that is not whole int32 ids."""
    try:
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for malformed input
        reason = f"{type(exc).__name__}: {exc}".rstrip(": ")
        raise bad_request(f"request body is not valid {CONTENT_TYPE}: {reason}") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a map, not {type(body).__name__}")
    for key in _ID_KEYS:
        ids = body.get(key)
        if isinstance(ids, bytes):
            if not ids or len(ids) % _ID.itemsize:
                raise bad_request(f"a packed {key} is whole int32 token ids: {len(ids)} bytes")
            body[key] = np.frombuffer(ids, dtype=_ID).astype(np.int32)
    _check_json_values(
        [v for k, v in body.items() if k not in _ID_KEYS or not isinstance(v, np.ndarray)]
    )
    return body


def _check_json_values(values: list[Any]) -> None:
    stack = list(values)
    while stack:
        item = stack.pop()
        if item is None or isinstance(item, (bool, int, str)):
            continue
        if isinstance(item, float):
            if not math.isfinite(item):
                raise bad_request(f"{item} is not valid JSON")
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if not all(isinstance(key, str) for key in item):
                raise bad_request("object keys must be strings")
            stack.extend(item.values())
        else:
            raise bad_request(f"a packed request holds a {type(item).__name__}, which JSON cannot")
