"""The page slot format, shared by the daemon (which hands out slots) and the connector
(which writes and reads them).

A slot is `[header: HEADER_BYTES][payload, padded to a multiple of PAGE_ALIGN]`, and
slots start at PAGE_ALIGN-aligned arena offsets, so the payload of every page is
page-aligned for host registration and DMA.

Header encoding (big-endian), zero-padded, then a CRC-32 of everything before it in its
last 4 bytes (HEADER_BYTES in all):
    magic 8s | layout_version u32 | key 16s | parent_key 16s | payload_bytes u64 |
    checksum_len u16 | checksum (checksum_len bytes) | zeros | crc32 u32
The CRC sits at a fixed place and covers every other byte of the header, padding
included, so any single flipped bit anywhere in a header fails `unpack`.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from kvshare.kvpool.keys import KEY_BYTES

HEADER_BYTES = 4096
PAGE_ALIGN = 4096
PAGE_MAGIC = b"KVSPAGE2"
MAX_CHECKSUM_BYTES = 1024

_FIXED = struct.Struct(">8sI16s16sQH")
_CRC = struct.Struct(">I")
_CRC_AT = HEADER_BYTES - _CRC.size


class PageFormatError(ValueError):
    """A buffer does not hold a valid page header (short, bad magic, bad lengths)."""


def slot_bytes_for(payload_bytes: int) -> int:
    """Return the slot size of a page whose payload is `payload_bytes` (> 0)."""
    if payload_bytes <= 0:
        raise ValueError(f"payload_bytes must be > 0, got {payload_bytes}")
    padded = -(-payload_bytes // PAGE_ALIGN) * PAGE_ALIGN
    return HEADER_BYTES + padded


@dataclass(frozen=True)
class PageHeader:
    """The header at the start of every page slot.

    `checksum` is opaque to the pool (up to MAX_CHECKSUM_BYTES); the connector may
    store several 16-byte segment checksums in it.
    """

    layout_version: int
    key: bytes
    parent_key: bytes
    payload_bytes: int
    checksum: bytes
    magic: bytes = PAGE_MAGIC

    def __post_init__(self) -> None:
        if self.magic != PAGE_MAGIC:
            raise PageFormatError(f"bad page magic {self.magic!r}, expected {PAGE_MAGIC!r}")
        if not 0 <= self.layout_version < 2**32:
            raise PageFormatError(f"layout_version out of range: {self.layout_version}")
        for name in ("key", "parent_key"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != KEY_BYTES:
                raise PageFormatError(f"{name} must be {KEY_BYTES} bytes, got {value!r}")
        if not 0 <= self.payload_bytes < 2**64:
            raise PageFormatError(f"payload_bytes out of range: {self.payload_bytes}")
        if not isinstance(self.checksum, bytes) or len(self.checksum) > MAX_CHECKSUM_BYTES:
            raise PageFormatError(
                f"checksum must be bytes of at most {MAX_CHECKSUM_BYTES}, got {self.checksum!r}"
            )

    def pack(self) -> bytes:
        """Return exactly HEADER_BYTES bytes: the encoding, zero-padded, and its CRC."""
        fixed = _FIXED.pack(
            self.magic,
            self.layout_version,
            self.key,
            self.parent_key,
            self.payload_bytes,
            len(self.checksum),
        )
        encoded = fixed + self.checksum
        covered = encoded + bytes(_CRC_AT - len(encoded))
        return covered + _CRC.pack(zlib.crc32(covered))

    @classmethod
    def unpack(cls, buffer: bytes | bytearray | memoryview) -> PageHeader:
        """Decode a header from the start of `buffer`; raise PageFormatError if invalid."""
        view = memoryview(buffer).cast("B")
        if len(view) < HEADER_BYTES:
            raise PageFormatError(f"buffer of {len(view)} bytes is shorter than a page header")
        magic, layout_version, key, parent_key, payload_bytes, checksum_len = _FIXED.unpack_from(
            view
        )
        if magic != PAGE_MAGIC:
            raise PageFormatError(f"bad page magic {magic!r}, expected {PAGE_MAGIC!r}")
        (crc,) = _CRC.unpack_from(view, _CRC_AT)
        if crc != zlib.crc32(view[:_CRC_AT]):
            raise PageFormatError("page header CRC mismatch: the header is corrupt")
        end = _FIXED.size + checksum_len
        if checksum_len > MAX_CHECKSUM_BYTES or end > _CRC_AT:
            raise PageFormatError(f"checksum length {checksum_len} does not fit the header")
        return cls(
            layout_version=layout_version,
            key=key,
            parent_key=parent_key,
            payload_bytes=payload_bytes,
            checksum=bytes(view[_FIXED.size : end]),
        )
