"""Wire format between pool clients and the daemon.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack, which
must decode to a map. Requests are `{"op": str, "id": int, ...}`; responses are
`{"id": int, "ok": True, ...}` or `{"id": int, "ok": False, "error": str}`. Keys and
checksums travel as msgpack bin (Python bytes).
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

# 2: lookups take `head` and `release` (a daemon of 1 would ignore `release`, and the head
# lookup's pages would stay pinned until the connection closed).
PROTOCOL_VERSION = 2
MAX_FRAME_BYTES = 64 * 1024 * 1024
LENGTH = struct.Struct(">I")


class ProtocolError(Exception):
    """A frame or message that does not follow the wire format."""


def encode_frame(message: dict[str, Any]) -> bytes:
    """Return `message` as one frame; raise ProtocolError if it exceeds MAX_FRAME_BYTES."""
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return LENGTH.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """Return the body length that a 4-byte frame header announces, checked against the limit."""
    (length,) = LENGTH.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return length


def decode_body(body: bytes) -> Any:
    """Decode a frame body; raise ProtocolError unless it is exactly one msgpack object.

    A body that decodes but is not a map is well framed: the caller decides (the daemon
    answers it with an error and keeps the connection).
    """
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise ProtocolError(f"frame body is not valid msgpack: {error!r}") from error
