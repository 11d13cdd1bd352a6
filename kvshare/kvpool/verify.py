"""Is a restored page the page the daemon vouched for? Header and checksum comparisons.

A restore is kept only when three things agree: the daemon's record of the page (key and
checksum, pinned under the lease), the header in the arena slot, and the checksums of the
bytes actually copied. These functions compare; the connector decides what follows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvshare.kvpool.client import PageRef
from kvshare.kvpool.layout import CHECKSUM_BYTES, LAYOUT_VERSION
from kvshare.kvpool.page import PageFormatError, PageHeader


def header_matches(header_bytes: bytes, page: PageRef, payload_bytes: int) -> bool:
    """The slot's header names the page the daemon says: key, size, layout and checksum."""
    try:
        header = PageHeader.unpack(header_bytes)
    except (PageFormatError, ValueError):
        return False
    return (
        header.key == page.key
        and header.payload_bytes == payload_bytes
        and header.layout_version == LAYOUT_VERSION
        and header.checksum == page.checksum
    )


def mismatched_pages(
    pages: Sequence[PageRef], copied: np.ndarray, segments: Sequence[int]
) -> list[int]:
    """Indices of the pages whose copied bytes disagree with the daemon's checksums: the
    first `segments[i]` 16-byte segment checksums of page i, `copied[i]` (uint8, one row
    per page, segment after segment) against `pages[i].checksum`. One comparison over
    every page: a 261,888-token restore checks 1,023 pages after its last copy, before
    its first token, and a loop over them took 2.4 ms."""
    if not len(pages):
        return []
    width = copied.shape[1]
    want = np.frombuffer(
        b"".join(p.checksum[:width].ljust(width, b"\0") for p in pages), dtype=np.uint8
    ).reshape(len(pages), width)
    wanted = np.asarray(segments)[:, None] * CHECKSUM_BYTES
    differs = ((copied != want) & (np.arange(width) < wanted)).any(axis=1)
    short = np.array([len(p.checksum) for p in pages]) < wanted[:, 0]
    return np.flatnonzero(differs | short | (wanted[:, 0] > width)).tolist()
