"""Corruption check: flipped bits in committed pages are detected (a miss, counted), never served.

Each page is the only chunk of its own prefix, so every flip is checked on its own. Most
flips land in the payload (caught by the payload checksum); every fourth lands in the
page header (caught by the header check). One page stays intact: it must still restore,
so the check cannot pass by failing every load.
"""

from __future__ import annotations

import random
import uuid

import torch

from kvshare.kvpool.connector import ConnectorOptions
from kvshare.kvpool.faults import FaultInjection
from kvshare.kvpool.page import HEADER_BYTES
from kvshare.spec import DEFAULT_CHUNK_TOKENS
from kvshare.validate.capacity import PoolNeed, kv_page_bytes
from kvshare.validate.harness import ConnectorHarness
from kvshare.validate.result import CheckResult


def pool_needs(shape: str, dtype: torch.dtype, pages: int = 16) -> list[PoolNeed]:
    """Every corrupted page and the control page stay resident until restored."""
    return [PoolNeed(kv_page_bytes(shape, dtype, DEFAULT_CHUNK_TOKENS), pages + 1)]


def run_corruption_check(
    pool: str,
    *,
    shape: str = "tiny-gemma3",
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    pages: int = 16,
    seed: int = 0,
    faults: FaultInjection | None = None,
) -> CheckResult:
    """`faults` with skip_checksums is the broken variant (checksums ignored): the check must fail."""
    result = CheckResult("corruption")
    chunk = DEFAULT_CHUNK_TOKENS
    options = ConnectorOptions(chunk_tokens=chunk)
    harness = ConnectorHarness(
        pool, shape, device, dtype, chunk // 16 + 1, uuid.uuid4().hex, options, faults=faults
    )
    client = harness.connector.client
    rng = random.Random(seed)
    payload = harness.connector.layout.payload_bytes if harness.connector.layout else 0
    flipped = {"payload": 0, "header": 0}
    evictions_before = client.stats().get("evictions", 0)
    for trial in range(pages + 1):
        key = harness.store_pattern(trial, 1)[0]
        if trial == pages:
            break  # the intact control page
        found = client.lookup([key])
        client.release(found.lease)
        if not found.pages:
            result.fail(f"page {trial} was not committed")
            continue
        in_header = trial % 4 == 3
        # Header flips hit the key (bytes 12-27) or the checksum (54-69), which a reader
        # always compares with the daemon's record.
        header_at = rng.choice((rng.randrange(12, 28), rng.randrange(54, 70)))
        where = header_at if in_header else HEADER_BYTES + rng.randrange(payload)
        view = client.arena.view(found.pages[0].offset + where, 1)
        view[0] ^= 1 << rng.randrange(8)
        flipped["header" if in_header else "payload"] += 1
    before = harness.connector.stats()
    served = 0
    for trial in range(pages):
        hit, ok, blocks = harness.restore(trial, 1, poison=-3.0)
        harness.cache.blocks.release(blocks)
        if hit == 0 and client.stats().get("evictions", 0) > evictions_before:
            harness.connector.close()
            # The pool made room for other pages: a fact about its size, not a fault.
            return CheckResult(
                "corruption",
                skipped=(
                    f"inconclusive: the pool evicted page {trial} before it was checked (it holds fewer "
                    f"than the {pool_needs(shape, dtype, pages)[0].describe()} this check keeps)"
                ),
            )
        result.expect(
            hit > 0,
            f"page {trial}: corrupted page not found by lookup (should be found, then rejected)",
        )
        if ok:
            served += 1
            result.fail(f"page {trial}: a corrupted page was restored as valid")
    hit, ok, blocks = harness.restore(pages, 1, poison=-3.0)
    harness.cache.blocks.release(blocks)
    result.expect(hit > 0 and ok, "the intact control page did not restore")
    after = harness.connector.stats()
    detected = after.get("load_failures", 0) - before.get("load_failures", 0)
    result.expect(
        detected == pages, f"{detected} of {pages} corrupted pages counted as load failures"
    )
    result.counts = {
        "pages": pages,
        "payload_flips": flipped["payload"],
        "header_flips": flipped["header"],
        "detected": detected,
        "served_corrupt": served,
        "checksum_failures": after.get("checksum_failures", 0),
        "header_failures": after.get("header_failures", 0),
    }
    harness.connector.close()
    return result
