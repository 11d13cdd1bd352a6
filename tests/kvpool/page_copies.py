"""Whole-page copies for transfer tests."""

from __future__ import annotations

from collections.abc import Sequence

from kvshare.kvpool.layout import PageLayout
from kvshare.kvpool.page import HEADER_BYTES, slot_bytes_for
from kvshare.kvpool.transfer import PageCopy


def whole_page_copies(layout: PageLayout, slots: Sequence[int]) -> list[PageCopy]:
    """Copies of the pages in arena slots `slots`, each keyed by its slot, the j-th into
    the j-th page's worth of cache blocks (its sliding segment too, where there is one)."""
    slot, per_page = slot_bytes_for(layout.payload_bytes), layout.blocks_per_page
    copies = []
    for j, s in enumerate(slots):
        blocks = tuple(range(j * per_page, (j + 1) * per_page))
        sliding = blocks if layout.num_segments == 2 else ()
        copies.append(
            PageCopy(
                s * slot + HEADER_BYTES,
                layout.payload_bytes,
                blocks,
                s.to_bytes(16, "little"),
                0,
                sliding,
            )
        )
    return copies
