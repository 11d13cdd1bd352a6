"""Full-pool check: every page handed out once, written, read back, evicted, reused.

Against a pool nobody else is using (it clears the pool first): reserve every page of
one page size, write a pattern unique to each page (header + payload), commit, and read
every byte back; then cycle: reserve as many new pages again (forcing LRU eviction of
the old ones), write, verify the new ones and every surviving old one; finally clear and
check the free count is back to the total. Also checks the arena's accounting: its size
is exactly the configured size and pages x slot size fit inside it.

Overlapping slots (a page handed out twice) show as a pattern overwritten by another page.
"""

from __future__ import annotations

import os

import numpy as np

from kvshare.kvpool.client import PageRef, PoolClient
from kvshare.kvpool.page import HEADER_BYTES, PageHeader, slot_bytes_for
from kvshare.validate.capacity import PoolNeed
from kvshare.validate.result import CheckResult

PAGE_BYTES = 1 << 20


def pool_needs(payload_bytes: int = PAGE_BYTES) -> list[PoolNeed]:
    """It fills whatever pool it is given; one page is the least that shows anything."""
    return [PoolNeed(payload_bytes, 1)]


def _pattern(key: bytes, nbytes: int) -> np.ndarray:
    """nbytes of a pattern that differs for every key and every 8-byte word."""
    seed = np.frombuffer(key[:8], dtype="<u8")[0]
    words = np.arange(nbytes // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + seed
    return words.view(np.uint8)


def _write(client: PoolClient, page: PageRef, payload: int) -> None:
    header = PageHeader(0, page.key, bytes(16), payload, b"pool-fill")
    client.arena.view(page.offset, HEADER_BYTES)[:] = header.pack()
    np.frombuffer(client.arena.view(page.offset + HEADER_BYTES, payload), dtype=np.uint8)[:] = (
        _pattern(page.key, payload)
    )


def _intact(client: PoolClient, page: PageRef, payload: int) -> bool:
    header = PageHeader.unpack(bytes(client.arena.view(page.offset, HEADER_BYTES)))
    body = np.frombuffer(client.arena.view(page.offset + HEADER_BYTES, payload), dtype=np.uint8)
    return header.key == page.key and np.array_equal(body, _pattern(page.key, payload))


def _fill(client: PoolClient, count: int, payload: int, result: CheckResult) -> list[PageRef]:
    """Store `count` new pages, in as many reservations as it takes: the daemon lets one
    connection hold only its share of the pool reserved, and committed pages are no
    one's. Stops early when a reservation gets nothing."""
    pages: list[PageRef] = []
    while len(pages) < count:
        keys = [os.urandom(16) for _ in range(count - len(pages))]
        batch = list(client.reserve(keys, payload).pages)
        if not batch:
            break
        for page in batch:
            _write(client, page, payload)
        client.commit([p.key for p in batch], [b"fill"] * len(batch), [p.offset for p in batch])
        pages += batch
    offsets = [p.offset for p in pages]
    result.expect(len(set(offsets)) == len(offsets), "a slot was handed out twice in one fill")
    return pages


def _present(client: PoolClient, key: bytes) -> bool:
    hit = client.lookup([key])
    client.release(hit.lease)
    return bool(hit.pages)


def _verify(client: PoolClient, pages: list[PageRef], payload: int, result: CheckResult) -> int:
    """Verify pages that are still in the pool; returns how many were found."""
    found = 0
    for page in pages:
        hit = client.lookup([page.key])
        if hit.pages:
            found += 1
            result.expect(hit.pages[0].offset == page.offset, "a committed page moved")
            if not _intact(client, page, payload):
                result.fail(f"page at offset {page.offset} does not hold its own pattern")
        client.release(hit.lease)
    return found


def run_pool_fill_check(
    pool: str, *, payload_bytes: int = PAGE_BYTES, cycles: int = 4
) -> CheckResult:
    result = CheckResult("pool-fill")
    client = PoolClient(pool)
    client.connect()
    client.clear()
    stats = client.stats()
    slot = slot_bytes_for(payload_bytes)
    per_slab = stats["slab_bytes"] // slot
    total = stats["slab_count"] * per_slab
    result.expect(
        client.arena.size_bytes == stats["arena_bytes"],
        f"arena file is {client.arena.size_bytes} bytes, configured {stats['arena_bytes']}",
    )
    result.expect(total * slot <= stats["arena_bytes"], "pages x slot size exceed the arena")
    pages = _fill(client, total, payload_bytes, result)
    result.expect(len(pages) == total, f"reserved {len(pages)} of {total} pages")
    verified = _verify(client, pages, payload_bytes, result)
    result.expect(verified == len(pages), f"{len(pages) - verified} committed pages not found")
    evicted_before = client.stats().get("evictions", 0)
    for _ in range(cycles):
        fresh = _fill(client, total // 2, payload_bytes, result)
        verified += _verify(client, fresh, payload_bytes, result)
        survivors = _verify(client, pages, payload_bytes, result)
        result.expect(
            survivors >= len(pages) - len(fresh), "more old pages evicted than new pages needed"
        )
        pages = [p for p in pages if _present(client, p.key)] + fresh
    evictions = client.stats().get("evictions", 0) - evicted_before
    client.clear()
    end = client.stats()
    free = (
        sum(c["free"] for c in end["classes"] if c["slot_bytes"] == slot)
        + end["free_slabs"] * per_slab
    )
    result.expect(free == total, f"after clear {free} of {total} pages are free")
    result.counts = {
        "pages": total,
        "page_bytes": payload_bytes,
        "cycles": cycles,
        "verified_pages": verified,
        "verified_bytes": verified * payload_bytes,
        "evictions": evictions,
        "arena_bytes": stats["arena_bytes"],
    }
    client.close()
    return result
