"""vLLM pages without vLLM: whole-block gather/scatter and the checks before a page is used."""

from __future__ import annotations

import pytest
import torch

from kvshare.integrations.vllm_pages import (
    PAGE_LAYOUT_VERSION,
    PageGeometry,
    cache_layer,
    page_checksum,
    verify_page,
)
from kvshare.kvpool.client import PageRef
from kvshare.kvpool.page import HEADER_BYTES, PageHeader

NUM_BLOCKS = 9


def caches(seed: int) -> list[torch.Tensor]:
    """vLLM CPU's [blocks, heads, block_size, 2 * head_size] and a [2, blocks, ...] split."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(NUM_BLOCKS, 2, 4, 8, generator=generator),
        torch.randn(2, NUM_BLOCKS, 4, 2, 8, generator=generator),
    ]


def geometry_of(tensors: list[torch.Tensor]) -> PageGeometry:
    layers = tuple(cache_layer(f"l{i}", t, NUM_BLOCKS) for i, t in enumerate(tensors))
    return PageGeometry(layers, blocks_per_page=2)


def test_a_page_carries_whole_blocks_and_skips_the_engines_own() -> None:
    source, target = caches(0), [torch.zeros_like(t) for t in caches(0)]
    geometry = geometry_of(source)
    payload = torch.empty(geometry.payload_bytes, dtype=torch.uint8)
    geometry.gather([[3, 7]], payload)
    geometry_of(target).scatter(payload, [[1, 2]], first=1)
    assert torch.equal(target[0][2], source[0][7]) and torch.equal(target[1][:, 2], source[1][:, 7])
    # Block 1 is before `first`: the engine's prefix-cache block, never written.
    assert not target[0][1].any() and not target[1][:, 1].any()
    assert not target[0][3:].any()


def test_each_layer_copies_the_blocks_of_its_own_kv_cache_group() -> None:
    """Block ids name a block only within a group: layer l0 is in group 0, l1 in group 1."""
    source, target = caches(1), [torch.zeros_like(t) for t in caches(1)]

    def grouped(tensors: list[torch.Tensor]) -> PageGeometry:
        layers = tuple(cache_layer(f"l{i}", t, NUM_BLOCKS, group=i) for i, t in enumerate(tensors))
        return PageGeometry(layers, blocks_per_page=2)

    payload = torch.empty(grouped(source).payload_bytes, dtype=torch.uint8)
    grouped(source).gather([[3, 7], [5, 6]], payload)
    grouped(target).scatter(payload, [[1, 2], [1, 2]], first=0)
    assert torch.equal(target[0][1:3], source[0][[3, 7]])
    assert torch.equal(target[1][:, 1:3], source[1][:, [5, 6]])


def test_a_cache_without_a_block_dimension_is_refused() -> None:
    with pytest.raises(ValueError, match="no dimension of 9 blocks"):
        cache_layer("l", torch.zeros(4, 4), NUM_BLOCKS)


def stored_page(key: bytes = b"k" * 16, layout: int = PAGE_LAYOUT_VERSION):
    payload = torch.arange(4096, dtype=torch.int64).view(torch.uint8)[:8192].clone()
    checksum = page_checksum(payload, key)
    arena = torch.zeros(HEADER_BYTES + payload.numel(), dtype=torch.uint8)
    header = PageHeader(layout, key, b"p" * 16, payload.numel(), checksum).pack()
    arena[:HEADER_BYTES] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    arena[HEADER_BYTES:] = payload
    return arena, PageRef(key, 0, payload.numel(), checksum), payload


def test_a_verified_page_is_a_private_copy_of_its_bytes() -> None:
    arena, page, payload = stored_page()
    copy = verify_page(arena, page, payload.numel())
    assert copy is not None and torch.equal(copy, payload)
    arena[HEADER_BYTES:] = 0
    assert torch.equal(copy, payload)


@pytest.mark.parametrize("flip_at", [HEADER_BYTES, HEADER_BYTES + 5000, 40])
def test_one_flipped_byte_in_payload_or_header_is_refused(flip_at: int) -> None:
    arena, page, payload = stored_page()
    arena[flip_at] ^= 0x01
    assert verify_page(arena, page, payload.numel()) is None


def test_a_page_of_another_layout_key_size_or_record_is_refused() -> None:
    arena, page, payload = stored_page(layout=PAGE_LAYOUT_VERSION + 1)
    assert verify_page(arena, page, payload.numel()) is None
    arena, page, payload = stored_page()
    assert verify_page(arena, page._replace(key=b"x" * 16), payload.numel()) is None
    assert verify_page(arena, page, payload.numel() - 8) is None
    assert verify_page(arena, page._replace(checksum=bytes(16)), payload.numel()) is None
