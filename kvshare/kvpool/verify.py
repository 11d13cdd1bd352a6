"""Is a restored page the page the daemon vouched for? Header and checksum comparisons.

A restore is kept only when three things agree: the daemon's record of the page (key and
checksum, pinned under the lease), the header in the arena slot, and the checksums of the
bytes actually copied. These functions compare; the connector decides what follows.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def checksums_match(page: PageRef, copied: Sequence[bytes], num_segments: int) -> bool:
    """The first `num_segments` segment checksums of the copied bytes equal the daemon's."""
    expected = [
        page.checksum[i * CHECKSUM_BYTES : (i + 1) * CHECKSUM_BYTES] for i in range(num_segments)
    ]
    return list(copied[:num_segments]) == expected
