"""Loads in groups of layers: which loads are split and how, the fences the compute side
runs before each slot, and an engine that computes its first layers while the last are
still copied answering exactly as without the pool (its broken variant does not)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare import LLM, SamplingParams
from kvshare.engine.config import CUDA_LAYER_GROUPS, EngineConfig
from kvshare.engine.connector import KVCacheLayout, SlotFences
from kvshare.kvpool.connector import PoolConnector
from kvshare.kvpool.faults import FaultInjection
from kvshare.kvpool.launch import PoolProcess
from kvshare.kvpool.layout import PageLayout
from kvshare.kvpool.transfer import LayerGroups, PageCopy
from kvshare.kvpool.transfer_cpu import ThreadTransfer
from kvshare.models.presets import shape_preset
from tests.kvpool.pool_fixture import MIB, PoolFactory

CHUNK = 32


def _layout(global_slots: int, slot_mib: float, sliding: bool = False) -> PageLayout:
    slot_bytes = int(slot_mib * MIB)
    return PageLayout(
        chunk_tokens=256,
        block_size=16,
        num_slots=global_slots + (4 if sliding else 0),
        num_global_slots=global_slots,
        slot_bytes=slot_bytes,
        dtype=torch.bfloat16,
    )


def _ranges(*sizes: int) -> list[range]:
    bounds = itertools.accumulate(sizes, initial=0)
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def _copies(layout: PageLayout, nbytes: int, pages: int = 3) -> list[PageCopy]:
    return [PageCopy(i * nbytes, nbytes, (), bytes(16)) for i in range(pages)]


@pytest.mark.parametrize(
    "global_slots, slot_mib, sliding, groups, expected",
    [
        # qwen3.5-27b, bf16: 16 layers of 1 MiB per page -> halving down to one slot
        (16, 1.0, False, LayerGroups(), _ranges(8, 4, 2, 1, 1)),
        # the same in fp8 (half the bytes, plus scales): one slot (0.52 MiB) is a group too
        (16, 0.516, False, LayerGroups(), _ranges(8, 4, 2, 1, 1)),
        # a part under the minimum takes two slots
        (16, 0.45, False, LayerGroups(), _ranges(8, 4, 2, 2)),
        # capped: the first group takes the rest
        (16, 1.0, False, LayerGroups(max_groups=4), _ranges(12, 2, 1, 1)),
        # 4 MiB parts at least: 4 slots of bf16
        (16, 1.0, False, LayerGroups(min_bytes=4 * MIB), _ranges(8, 4, 4)),
        # even groups
        (16, 1.0, False, LayerGroups(max_groups=4, shrinking=False), _ranges(4, 4, 4, 4)),
        (10, 1.0, False, LayerGroups(min_bytes=1, max_groups=3, shrinking=False), _ranges(3, 3, 4)),
        # a page under twice the minimum comes whole
        (16, 0.05, False, LayerGroups(), _ranges(16)),
        # uneven: every slot once, in order, the first group the largest
        (10, 1.0, False, LayerGroups(min_bytes=1, max_groups=3), _ranges(8, 1, 1)),
        (11, 1.0, False, LayerGroups(min_bytes=1), _ranges(7, 2, 1, 1)),
        (3, 1.0, False, LayerGroups(min_bytes=1), _ranges(1, 1, 1)),
        # never more groups than slots
        (2, 8.0, False, LayerGroups(min_bytes=1), _ranges(1, 1)),
    ],
)
def test_layer_groups_split_global_only_loads(
    global_slots: int,
    slot_mib: float,
    sliding: bool,
    groups: LayerGroups,
    expected: list[range],
) -> None:
    layout = _layout(global_slots, slot_mib, sliding)
    assert groups.ranges(layout, _copies(layout, layout.global_bytes)) == expected


@settings(max_examples=300, deadline=None)
@given(
    slots=st.integers(1, 80),
    slot_kib=st.integers(64, 4096),
    min_kib=st.integers(1, 8192),
    max_groups=st.integers(1, 12),
    shrinking=st.booleans(),
)
def test_groups_cover_every_slot_once_in_order_within_their_bounds(
    slots: int, slot_kib: int, min_kib: int, max_groups: int, shrinking: bool
) -> None:
    """Any layout and setting: the groups tile the global slots in order, there are at most
    `max_groups`, each part of a page reaches `min_bytes` (or the load comes whole), and
    shrinking groups never grow toward the end, the first the largest."""
    layout = _layout(slots, slot_kib / 1024)
    groups = LayerGroups(min_kib * 1024, max_groups, shrinking)
    ranges = groups.ranges(layout, _copies(layout, layout.global_bytes))
    assert [r.start for r in ranges] == [0, *(r.stop for r in ranges[:-1])]
    assert ranges[-1].stop == slots and all(len(r) > 0 for r in ranges)
    assert len(ranges) <= max_groups
    if len(ranges) > 1:
        assert all(len(r) * layout.slot_bytes >= groups.min_bytes for r in ranges)
    sizes = [len(r) for r in ranges]
    if shrinking:
        assert sizes == sorted(sizes, reverse=True)
    else:
        assert max(sizes) - min(sizes) <= 1


def test_groups_copied_page_by_page_keep_parts_of_4_mib() -> None:
    """Without the runtime's strided copy each page's part is a host copy of its own: bf16
    qwen3.5-27b pages come in 8, 4 and 4 layers (1 MiB parts would be 5 groups)."""
    layout = _layout(16, 1.0)
    copies = _copies(layout, layout.global_bytes)
    assert LayerGroups().ranges(layout, copies) == _ranges(8, 4, 2, 1, 1)
    assert LayerGroups().for_row_copies().ranges(layout, copies) == _ranges(8, 4, 4)
    assert LayerGroups(min_bytes=8 * MIB).for_row_copies().min_bytes == 8 * MIB


def test_loads_with_sliding_layers_or_partial_pages_come_whole() -> None:
    groups = LayerGroups(min_bytes=1)
    sliding = _layout(8, 1.0, sliding=True)
    assert groups.ranges(sliding, _copies(sliding, sliding.global_bytes)) == [range(8)]
    plain = _layout(8, 1.0)
    odd = [*_copies(plain, plain.global_bytes), PageCopy(0, plain.slot_bytes, (), bytes(16))]
    assert groups.ranges(plain, odd) == [range(8)]
    assert groups.ranges(plain, []) == [range(8)]
    with pytest.raises(ValueError):
        LayerGroups(min_bytes=0)


def test_fences_run_each_wait_once_right_before_its_slots() -> None:
    ran: list[str] = []
    fences = SlotFences()
    fences.add(0, 2, lambda: ran.append("a"))
    fences.add(2, 4, lambda: ran.append("b"))
    fences.add(4, 6, lambda: ran.append("c"))
    fences.before(1)
    assert ran == ["a"] and len(fences) == 2
    fences.before(0)  # already waited for
    fences.before(3)
    assert ran == ["a", "b"]
    fences.drain()
    assert ran == ["a", "b", "c"] and len(fences) == 0
    fences.before(5)
    assert ran == ["a", "b", "c"]


def test_a_grouped_cpu_load_brings_the_same_bytes_and_checksums_as_a_whole_one() -> None:
    """Five attention layers: groups of 3, 1 and 1 slots, every byte where a whole load
    puts it."""
    tiny = shape_preset("tiny-llama")
    five = dataclasses.replace(tiny, num_layers=5, layer_kinds=("full",) * 5)
    cache = KVCacheLayout.allocate(five, 8, 16, torch.float32, torch.device("cpu"))
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(4)))
    layout = PageLayout.of(cache, CHUNK)
    whole = ThreadTransfer(cache.kv, layout)
    grouped = ThreadTransfer(cache.kv, layout, layer_groups=LayerGroups(min_bytes=1))
    arena = torch.zeros(2 * layout.payload_bytes, dtype=torch.uint8)
    for transfer in (whole, grouped):
        transfer.set_arena(arena)
    key = bytes(range(16))
    whole.store([PageCopy(0, layout.payload_bytes, (5, 2), key)]).wait()
    loads = [
        transfer.load([PageCopy(0, layout.payload_bytes, blocks, key)])
        for transfer, blocks in ((whole, (1, 3)), (grouped, (4, 6)))
    ]
    for transfer in (whole, grouped):
        transfer.synchronize()
    assert [slots for slots, _ in loads[1].slot_waits] == [range(0, 3), range(3, 4), range(4, 5)]
    assert loads[0].slot_waits == []
    assert loads[0].checksums() == loads[1].checksums()
    assert torch.equal(cache.kv[:, :, [4, 6]], cache.kv[:, :, [5, 2]])
    assert torch.equal(cache.kv[:, :, [1, 3]], cache.kv[:, :, [5, 2]])


@pytest.fixture
def pool() -> Iterator[PoolProcess]:
    factory = PoolFactory()
    yield factory.start(factory.config(size_bytes=64 * MIB, slab_bytes=16 * MIB))
    factory.close()


def _replica(
    pool: PoolProcess | None, faults: FaultInjection | None = None, device: str = "cpu"
) -> LLM:
    """tiny-qwen3.5 with restores in groups of one layer: float32 on the CPU, bfloat16 on
    CUDA (the dtype whose steps replay captured graphs)."""
    llm = LLM(
        "shape:tiny-qwen3.5",
        dtype="float32" if device == "cpu" else "bfloat16",
        device=device,
        kv_pool=None if pool is None else pool.address,
        chunk_tokens=CHUNK,
        max_num_batched_tokens=4 * CHUNK,
        kv_pool_faults=faults,
        **({"kv_cache_memory": 64 * MIB} if device == "cuda" else {}),
    )
    connector = llm.engine.connector
    if connector is not None:
        assert isinstance(connector, PoolConnector) and connector.transfer is not None
        connector.transfer.layer_groups = LayerGroups(min_bytes=1)  # 2 groups of 1 layer
    return llm


GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)


@pytest.mark.parametrize("broken", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_replica_computing_behind_a_grouped_restore_answers_as_without_the_pool(
    pool: PoolProcess, broken: bool, device: str
) -> None:
    """A hybrid model restored layer group by layer group (its state first), the copies
    held back 0.3 s: each attention layer waits for its own group, and the answer is the
    reference answer. Broken ("load_slots": the layers do not wait) it is not. On the CPU
    (float32) the reference is the answer without the pool; on CUDA, where the step after
    the restore (5 new tokens) replays captured segments in bfloat16, whose rounding
    follows a step's shape, it is the same restore with the copies not held back."""
    prompt = [(7 * i) % 400 + 3 for i in range(6 * CHUNK + 5)]
    writer = _replica(pool, device=device)
    writer.generate([prompt[: 6 * CHUNK + 1]], GREEDY)
    writer.engine.connector.wait_idle()  # type: ignore[union-attr]
    reference = _replica(None if device == "cpu" else pool, device=device)
    reference_out = reference.generate([prompt], GREEDY)[0]
    if device != "cpu":
        assert reference_out.pool_hit_tokens == 6 * CHUNK
    faults = FaultInjection(load_delay=0.3, break_order="load_slots" if broken else "")
    replica = _replica(pool, faults, device)
    graphs = replica.engine.runner.graphs
    assert (graphs is not None) == (device == "cuda")
    if graphs is not None:
        assert graphs.shape_for((5,)) in graphs.segmented
    out = replica.generate([prompt], GREEDY)[0]
    assert out.pool_hit_tokens == 6 * CHUNK
    same = out.token_ids == reference_out.token_ids and torch.allclose(
        torch.tensor(out.logprobs), torch.tensor(reference_out.logprobs), atol=1e-4
    )
    assert same is not broken


@pytest.mark.parametrize(
    ("flag", "expected"), [(0, None), (1, None), (3, LayerGroups(max_groups=3))]
)
def test_the_engine_flag_sets_how_restores_are_grouped(
    pool: PoolProcess, flag: int, expected: LayerGroups | None
) -> None:
    llm = LLM("shape:tiny-qwen3.5", kv_pool=pool.address, pool_load_layer_groups=flag)
    connector = llm.engine.connector
    assert isinstance(connector, PoolConnector) and connector.transfer is not None
    assert connector.transfer.layer_groups == expected


def test_restores_come_in_groups_by_default_on_cuda_only() -> None:
    """Auto (the default): groups where the copy engine overlaps the compute, whole pages
    on the CPU, whose copies run on the cores that compute."""
    assert EngineConfig().pool_load_layer_groups == 0
    assert EngineConfig(device="cpu").resolved_pool_load_layer_groups == 1
    assert EngineConfig(device="cuda:1").resolved_pool_load_layer_groups == CUDA_LAYER_GROUPS > 1
    assert (
        EngineConfig(device="cuda", pool_load_layer_groups=1).resolved_pool_load_layer_groups == 1
    )
