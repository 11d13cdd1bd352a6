"""Page copies and transfers for transfer tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pytest
import torch

from kvshare.engine.connector import KVCacheLayout
from kvshare.kvpool.faults import FaultInjection
from kvshare.kvpool.layout import PageLayout
from kvshare.kvpool.page import HEADER_BYTES, slot_bytes_for
from kvshare.kvpool.transfer import LayerGroups, PageCopy
from kvshare.kvpool.transfer_cpu import ThreadTransfer
from kvshare.models.presets import shape_preset

if TYPE_CHECKING:
    from kvshare.kvpool.transfer_cuda import CudaTransfer


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


def cuda_and_cpu_transfers(
    pages: int, layer_groups: LayerGroups | None, faults: FaultInjection | None = None
) -> tuple[list[KVCacheLayout], CudaTransfer, ThreadTransfer, list[PageCopy]]:
    """A CUDA transfer (with `faults`) and a CPU one over caches of one shape (CUDA first),
    their arenas the same random bytes, and a copy of each of the arena's `pages` pages
    into two blocks; skips where grouped loads would not copy strided."""
    from kvshare.kvpool import transfer_cuda

    caches = [
        KVCacheLayout.allocate(shape_preset("qwen3-8b"), 2 * pages + 1, 16, torch.bfloat16, d)
        for d in (torch.device("cuda"), torch.device("cpu"))
    ]
    layout = PageLayout.of(caches[0], 32)
    gpu = transfer_cuda.CudaTransfer(caches[0].kv, layout, faults, layer_groups=layer_groups)
    if layer_groups is not None and gpu.strided_copy is None:
        pytest.skip("no strided host copy in this CUDA runtime: groups of 4 MiB parts")
    cpu = ThreadTransfer(caches[1].kv, layout)
    arena = torch.randint(0, 256, (pages * layout.payload_bytes,), dtype=torch.uint8)
    gpu.set_arena(arena.pin_memory())
    cpu.set_arena(arena)
    copies = [
        PageCopy(
            i * layout.payload_bytes,
            layout.payload_bytes,
            (2 * i, 2 * i + 1),
            i.to_bytes(16, "little"),
        )
        for i in range(pages)
    ]
    return caches, gpu, cpu, copies


def same_cache_bytes(caches: list[KVCacheLayout], pages: int) -> bool:
    """Whether the CUDA and CPU caches of cuda_and_cpu_transfers hold the same bytes in
    the pages' blocks (bytes: random bits hold NaNs)."""
    gpu_bytes, cpu_bytes = (c.kv[:, :, : 2 * pages].view(torch.int16) for c in caches)
    return torch.equal(gpu_bytes.cpu(), cpu_bytes)
