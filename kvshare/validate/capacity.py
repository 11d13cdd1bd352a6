"""How much pool a check needs: the pages it must keep resident at once, by page size.

A check that finds its own pages evicted would report the pool as broken when the pool
is only small. So each check states its need up front: the CLI sizes a pool it starts
from the needs, and refuses a check that a given pool cannot hold.

The daemon hands whole slabs to one page size, each cut into `slab_bytes // slot_bytes`
slots (`kvshare.kvpool.index`), so the need is counted in slabs, not bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvshare.kvpool.page import PAGE_ALIGN, slot_bytes_for
from kvshare.models.presets import shape_preset
from kvshare.sizes import format_size

MIB = 1 << 20
DEFAULT_SLAB_BYTES = 256 * MIB  # of a pool `kvshare validate` starts


@dataclass(frozen=True)
class PoolNeed:
    """`pages` pages of `payload_bytes` each that must be resident in the pool together."""

    payload_bytes: int
    pages: int

    def __post_init__(self) -> None:
        if self.payload_bytes <= 0 or self.pages <= 0:
            raise ValueError("payload_bytes and pages must be > 0")

    @property
    def slot_bytes(self) -> int:
        return slot_bytes_for(self.payload_bytes)

    def pages_held(self, size_bytes: int, slab_bytes: int) -> int:
        """How many of these pages a pool of this geometry holds at once."""
        if self.slot_bytes > slab_bytes:
            return 0
        return (size_bytes // slab_bytes) * (slab_bytes // self.slot_bytes)

    def describe(self) -> str:
        return f"{self.pages} pages of {format_size(self.payload_bytes)}"


def kv_page_bytes(shape: str, dtype: torch.dtype, chunk_tokens: int) -> int:
    """Payload of one pool page (one chunk of every attention layer) of a shape preset."""
    model = shape_preset(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return (
        len(model.attention_layers) * chunk_tokens * model.kv_bytes_per_token_per_layer * itemsize
    )


def pool_geometry(needs: Iterable[PoolNeed], at_least_bytes: int) -> tuple[int, int]:
    """(size_bytes, slab_bytes) of a pool of at least `at_least_bytes` that holds each need.

    Checks run one after another and the daemon evicts across page sizes, so the pool
    holds the largest need, not the sum.
    """
    needs = list(needs)
    largest_slot = max((n.slot_bytes for n in needs), default=PAGE_ALIGN)
    slab = max(min(at_least_bytes, DEFAULT_SLAB_BYTES), _round_up(largest_slot, MIB))
    slabs = max((-(-n.pages // (slab // n.slot_bytes)) for n in needs), default=1)
    return max(_round_up(at_least_bytes, slab), slabs * slab), slab


def shortfall(need: PoolNeed, stats: dict) -> str | None:
    """Why a running pool (its `stats()`) cannot hold `need`, or None when it can."""
    held = need.pages_held(int(stats["arena_bytes"]), int(stats["slab_bytes"]))
    # A check is one client of the pool: the daemon's per-client quota caps it too.
    limit = stats.get("max_client_bytes")
    quota = held if limit is None else int(limit) // need.slot_bytes
    if min(held, quota) >= need.pages:
        return None
    slab = int(stats["slab_bytes"])
    pool = f"the pool ({format_size(int(stats['arena_bytes']))} in slabs of {format_size(slab)})"
    if need.slot_bytes > slab:
        return (
            f"{pool} cannot hold a page of {format_size(need.payload_bytes)}: its slabs are smaller"
        )
    if quota < held:
        return (
            f"{pool} lets one client hold {quota} of the {need.describe()} this check keeps "
            f"at once (--max-client-fraction)"
        )
    size = -(-need.pages // (slab // need.slot_bytes)) * slab
    return (
        f"{pool} holds {held} of the {need.describe()} this check keeps at once; "
        f"it needs a pool of at least {format_size(size)}"
    )


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step
