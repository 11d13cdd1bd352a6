"""A long restore's first copies start before its full lookup: the connector looks up the
first chunks past the local prefix alone (a head lookup), hands their pages to the
transfer, and the full lookup releases the head's lease in the same step as it pins its
own. The load takes the prefetched staging fills only where they are its own."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch

from kvshare import LLM, SamplingParams
from kvshare.engine.connector import KVCacheLayout
from kvshare.engine.llm_engine import RequestOutput
from kvshare.kvpool.client import LookupResult, PoolClient, PoolError
from kvshare.kvpool.connector import PoolConnector
from kvshare.kvpool.faults import FaultInjection
from kvshare.kvpool.transfer import LayerGroups, PageCopy, Prefetch, TransferJob
from kvshare.kvpool.transfer_cpu import ThreadTransfer
from kvshare.kvpool.waiting import WaitOptions
from tests.kvpool.page_copies import cuda_and_cpu_transfers, same_cache_bytes
from tests.kvpool.pool_fixture import MIB, PoolFactory
from tests.kvpool.test_daemon import keys, store
from tests.kvpool.test_waiting import CHUNK, DOCUMENT, connector_of, step_until_finished
from tests.kvpool.test_waiting import GREEDY as WAIT_GREEDY
from tests.kvpool.test_waiting import PROMPT as WAITED_PROMPT
from tests.kvpool.test_waiting import replica as waiting_replica

if TYPE_CHECKING:
    from kvshare.kvpool.transfer_cuda import CudaTransfer

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = [random.Random(9).randrange(3, 512) for _ in range(1100)]  # 4 full chunks + a tail


@pytest.fixture
def client(pools: PoolFactory) -> Iterator[PoolClient]:
    pool = pools.start(pools.config(max_client_fraction=0.5))
    connected = PoolClient(pool.address)
    connected.connect()
    yield connected
    connected.close()


# -- the daemon's side ------------------------------------------------------------------


def test_a_head_lookup_pins_its_run_and_counts_in_no_statistic(client: PoolClient) -> None:
    store(client, keys(0, 6))
    before = client.stats()
    head = client.lookup(keys(0, 3) + keys(100, 1), head=True)
    assert [p.key for p in head.pages] == keys(0, 3) and head.lease
    after = client.stats()
    assert after["leases"] == before["leases"] + 1 and after["pinned"] == 3
    counted = ("lookups", "hit_keys", "miss_keys", "claimed_keys", "in_progress_answers")
    assert {k: after[k] for k in counted} == {k: before[k] for k in counted}
    full = client.lookup(keys(0, 6), claim=True, release=head.lease)
    assert len(full.pages) == 6
    stats = client.stats()
    assert (stats["leases"], stats["pinned"], stats["lookups"]) == (1, 6, before["lookups"] + 1)
    assert client.release(head.lease) is False  # the full lookup released it
    assert client.release(full.lease) is True


def test_the_head_lease_goes_before_the_full_lookup_pins_so_a_client_at_its_share_gets_the_run(
    client: PoolClient,
) -> None:
    """A client's pinned bytes are capped at its share (half the pool here). With the
    share's worth of pages stored, a full lookup that released its head's lease after
    pinning would count the head's pages twice and come back cut."""
    store(client, keys(0, 1))
    slot_bytes = client.stats()["classes"][0]["slot_bytes"]
    share = (2 * MIB) // slot_bytes
    store(client, keys(1, share - 1))
    head = client.lookup(keys(0, 20), head=True)
    assert len(head.pages) == 20
    full = client.lookup(keys(0, share), release=head.lease)
    assert len(full.pages) == share
    assert client.stats()["quota_cut_keys"] == 0


def test_a_head_lookup_takes_keys_only_and_an_unknown_release_pins_nothing(
    client: PoolClient,
) -> None:
    store(client, keys(0, 2))
    for extra in ({"states": [[0, keys(50, 1)[0]]]}, {"claim": True}, {"page": {}}):
        with pytest.raises(PoolError, match="head lookup takes keys only"):
            client._request({"op": "lookup", "keys": keys(0, 2), "head": True, **extra})
    with pytest.raises(PoolError, match="unknown lease 999"):
        client._request({"op": "lookup", "keys": keys(0, 2), "release": 999})
    assert client.stats()["leases"] == 0
    # A lease the client no longer holds (lost with a dropped link) is not sent.
    assert len(client.lookup(keys(0, 2), release=999).pages) == 2


# -- the connector's side (a CPU engine; its transfer stands in for a prefetching one) -----


def _record_prefetches(
    connector: PoolConnector, monkeypatch: pytest.MonkeyPatch, ahead: int
) -> list[tuple[str, object]]:
    """The transfer prefetches `ahead` pages (a marker object: the CPU transfer copies
    straight into the blocks); returns the events: each lookup, prefetch and load."""
    transfer, client = connector.transfer, connector.client
    assert isinstance(transfer, ThreadTransfer)
    events: list[tuple[str, object]] = []
    lookup, load = client.lookup, transfer.load

    def recording_lookup(*args: Any, **kwargs: Any) -> LookupResult:
        if not kwargs.get("head"):
            events.append(("lookup", kwargs.get("release")))
            return lookup(*args, **kwargs)
        result = lookup(*args, **kwargs)
        events.append(("head lookup", result.lease))
        return result

    def recording_prefetch(copies: list[PageCopy]) -> Prefetch:
        events.append(("prefetch", list(copies)))
        return Prefetch()

    def recording_load(copies: list[PageCopy], prefetch: Prefetch | None = None) -> TransferJob:
        events.append(("load", (list(copies), prefetch)))
        return load(copies, prefetch)

    monkeypatch.setattr(client, "lookup", recording_lookup)
    monkeypatch.setattr(
        transfer,
        "prefetch_pages",
        lambda restored=None: ahead if restored is None or restored > ahead else 0,
    )
    monkeypatch.setattr(transfer, "prefetch", recording_prefetch)
    monkeypatch.setattr(transfer, "load", recording_load)
    return events


def _stored_replica(
    pools: PoolFactory, model: str = "shape:tiny-qwen3"
) -> tuple[LLM, PoolConnector, RequestOutput]:
    """A replica on a fresh pool, its answer without the pool, then the prompt stored and
    the GPU cache emptied: the next request for it is a pool hit."""
    pool = pools.start(pools.config(size_bytes=256 * MIB, slab_bytes=64 * MIB))
    llm = LLM(model, dtype="float32", kv_pool=pool.address, weights_seed=7)
    connector = llm.engine.connector
    assert isinstance(connector, PoolConnector)
    connector.set_enabled(False)
    reference = llm.generate([PROMPT], GREEDY)[0]
    connector.set_enabled(True)
    llm.engine.reset_prefix_cache()
    llm.generate([PROMPT], GREEDY)
    connector.wait_idle()
    llm.engine.reset_prefix_cache()
    return llm, connector, reference


def _prefetching_replica(
    pools: PoolFactory,
    monkeypatch: pytest.MonkeyPatch,
    ahead: int,
    model: str = "shape:tiny-qwen3",
    salts: tuple[str, ...] = (),
) -> tuple[LLM, PoolConnector, RequestOutput, list[tuple[str, object]]]:
    """_stored_replica (the prompt stored under each of `salts` too), then its transfer
    prefetching `ahead` pages: the replica, its connector, its answer without the pool and
    the recorded events (_record_prefetches)."""
    llm, connector, reference = _stored_replica(pools, model)
    for salt in salts:
        llm.generate([PROMPT], GREEDY, cache_salt=salt)
        connector.wait_idle()
        llm.engine.reset_prefix_cache()
    return llm, connector, reference, _record_prefetches(connector, monkeypatch, ahead)


@pytest.mark.parametrize("model", ["shape:tiny-qwen3", "shape:tiny-qwen3.5"])
def test_a_long_restore_hands_its_first_pages_to_the_transfer_before_the_full_lookup(
    pools: PoolFactory, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm, connector, reference, events = _prefetching_replica(pools, monkeypatch, 2, model)
    lookups_before = connector.client.stats()["lookups"]
    hit = llm.generate([PROMPT], GREEDY)[0]

    assert hit.token_ids == reference.token_ids
    assert hit.pool_hit_tokens == 4 * connector.chunk_tokens
    names = [name for name, _ in events]
    assert names == ["head lookup", "prefetch", "lookup", "load"]
    head_copies = events[1][1]
    load_copies, prefetch = events[3][1]
    assert isinstance(prefetch, Prefetch)  # the load got the match's prefetch
    assert [(c.offset, c.nbytes, c.key) for c in head_copies] == [
        (c.offset, c.nbytes, c.key) for c in load_copies[:2]
    ]
    assert events[2][1] == events[0][1] != 0  # the full lookup released the head's lease
    assert connector.counters["prefetches"] == 1
    stats = connector.client.stats()
    assert stats["leases"] == 0 and stats["pinned"] == 0
    assert stats["lookups"] == lookups_before + 1  # the head lookup counts in no statistic


def test_a_restore_no_longer_than_the_prefetch_makes_no_head_lookup(
    pools: PoolFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm, connector, _, events = _prefetching_replica(pools, monkeypatch, 4)
    assert llm.generate([PROMPT], GREEDY)[0].pool_hit_tokens == 4 * connector.chunk_tokens
    assert [name for name, _ in events] == ["lookup", "load"]
    assert events[1][1][1] is None


def test_a_full_lookup_that_fails_releases_the_head_lease_and_the_prompt_is_computed(
    pools: PoolFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm, connector, reference, events = _prefetching_replica(pools, monkeypatch, 2)
    lookup = connector.client.lookup

    def failing_full_lookup(*args: Any, **kwargs: Any) -> LookupResult:
        if not kwargs.get("head"):
            raise PoolError("lookup: injected")
        return lookup(*args, **kwargs)

    monkeypatch.setattr(connector.client, "lookup", failing_full_lookup)
    hit = llm.generate([PROMPT], GREEDY)[0]
    assert hit.token_ids == reference.token_ids and hit.pool_hit_tokens == 0
    assert [name for name, _ in events] == ["head lookup", "prefetch"]
    assert connector.client.stats()["leases"] == 0


# -- hints: a prompt's head before its request reached the engine --------------------------


def test_a_hinted_head_is_the_restores_prefetch_and_its_match_makes_no_head_lookup(
    pools: PoolFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm, connector, reference, events = _prefetching_replica(pools, monkeypatch, 2)
    engine = llm.engine
    assert engine.hint_tokens == 2 * connector.chunk_tokens
    assert engine.hint_prompt_head(np.array(PROMPT[: engine.hint_tokens], dtype=np.int32))
    assert [name for name, _ in events] == ["head lookup", "prefetch"]
    assert connector.client.stats()["leases"] == 1  # the hint pins what it prefetches

    hit = llm.generate([PROMPT], GREEDY)[0]
    assert hit.token_ids == reference.token_ids
    assert hit.pool_hit_tokens == 4 * connector.chunk_tokens
    assert [name for name, _ in events] == ["head lookup", "prefetch", "lookup", "load"]
    assert events[2][1] == events[0][1] != 0  # the full lookup released the hint's lease
    assert events[3][1][1] is not None  # the load got the hint's prefetch
    assert (connector.counters["hints"], connector.counters["hints_taken"]) == (1, 1)
    stats = connector.client.stats()
    assert stats["leases"] == 0 and stats["pinned"] == 0


def test_a_hint_for_another_prompt_or_salt_is_dropped_by_the_next_match(
    pools: PoolFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm, connector, reference, events = _prefetching_replica(pools, monkeypatch, 2)
    head = np.array(PROMPT, dtype=np.int32)
    assert llm.engine.hint_prompt_head(head)
    salted = llm.generate([PROMPT], GREEDY, cache_salt="tenant-b")[0]
    assert salted.token_ids == reference.token_ids and salted.pool_hit_tokens == 0
    hint_lease = events[0][1]
    # Its match dropped the hint, looked its own head up (nothing stored under that salt).
    assert [name for name, _ in events[2:4]] == ["head lookup", "lookup"]
    assert connector.counters["hints_taken"] == 0
    assert connector.client.release(hint_lease) is False  # released by that match
    assert connector.client.stats()["leases"] == 0

    other = [t + 1 for t in PROMPT]
    assert not llm.engine.hint_prompt_head(np.array(other, dtype=np.int32))  # nothing stored
    assert connector.client.stats()["leases"] == 0


def test_no_hint_where_the_gpu_holds_the_head_or_the_engine_is_busy(
    pools: PoolFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm, connector, _, events = _prefetching_replica(pools, monkeypatch, 2)
    engine = llm.engine
    head = np.array(PROMPT, dtype=np.int32)
    engine.add_request("busy", [5, 6, 7], GREEDY)
    assert not engine.hint_prompt_head(head)
    engine.abort("busy")
    engine.step()
    llm.generate([PROMPT], GREEDY)  # a pool hit: now the GPU cache holds the prompt
    events.clear()
    assert not engine.hint_prompt_head(head)
    assert events == [] and connector.counters["hints"] == 0
    for wrong in (np.array([-1, 2], dtype=np.int32), np.array([], dtype=np.int32)):
        assert not engine.hint_prompt_head(wrong)
    assert not engine.hint_prompt_head(head, cache_salt="")  # a salt the engine refuses
    connector.set_enabled(False)
    engine.reset_prefix_cache()
    assert not engine.hint_prompt_head(head)
    assert events == [] and connector.client.stats()["leases"] == 0


def test_drop_hint_releases_a_hint_no_request_took(
    pools: PoolFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm, connector, _, _ = _prefetching_replica(pools, monkeypatch, 2)
    assert llm.engine.hint_prompt_head(np.array(PROMPT, dtype=np.int32))
    assert connector.client.stats()["leases"] == 1 and llm.engine.holds_hint
    llm.engine.drop_hint()
    assert connector.client.stats()["leases"] == 0 and not llm.engine.holds_hint
    llm.engine.drop_hint()  # nothing held: nothing to do


# -- the CUDA transfer ----------------------------------------------------------------------


def _one_page_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvshare.kvpool import transfer_cuda

    monkeypatch.setattr(transfer_cuda, "staging_buffer_bytes", lambda page_bytes: page_bytes)


def _assert_loads_as_on_the_cpu(
    caches: list[KVCacheLayout],
    gpu: CudaTransfer,
    cpu: ThreadTransfer,
    copies: list[PageCopy],
    prefetch: Prefetch | None,
) -> None:
    """The CUDA load of `copies` given `prefetch` brings the CPU load's bytes and sums."""
    loaded, expected = gpu.load(copies, prefetch), cpu.load(copies)
    loaded.wait()
    expected.wait()
    assert same_cache_bytes(caches, len(copies))
    assert loaded.checksums() == expected.checksums()


def _head(copies: list[PageCopy], count: int) -> list[PageCopy]:
    return [c._replace(blocks=()) for c in copies[:count]]


@pytest.mark.cuda
@pytest.mark.parametrize("grouped", [False, True])
def test_cuda_load_takes_its_prefetched_fills_and_brings_every_byte(
    grouped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every copy held back 20 ms on the GPU: the load's drains of the prefetched fills
    must wait for them as for its own. The cache and the checksums are the CPU load's."""
    _one_page_staging(monkeypatch)
    from kvshare.kvpool.transfer_cuda import _StagedFills

    pages = 20
    groups = LayerGroups(min_bytes=1, max_groups=3) if grouped else None
    caches, gpu, cpu, copies = cuda_and_cpu_transfers(
        pages, groups, FaultInjection(load_delay=0.02)
    )
    ahead = gpu.prefetch_pages(pages)
    assert 5 <= ahead < pages
    prefetch = gpu.prefetch(_head(copies, ahead))
    assert isinstance(prefetch, _StagedFills)
    assert [d for _, _, (d, _) in prefetch.fills] == ["load", "load", "store", "store"]
    _assert_loads_as_on_the_cpu(caches, gpu, cpu, copies, prefetch)
    assert gpu.prefetched_fills_used == 4


@pytest.mark.cuda
def test_cuda_prefetch_pages_leave_a_load_its_last_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """One page a fill (whole pages): four fills and a page, or as many whole fills as
    leave a load of `restored` pages a page more; none where not one does."""
    _one_page_staging(monkeypatch)
    _, gpu, _, _ = cuda_and_cpu_transfers(4, None)
    assert gpu.prefetch_pages() == 5
    assert [gpu.prefetch_pages(n) for n in (2, 3, 4, 5, 6, 7, 100)] == [0, 2, 3, 4, 5, 5, 5]
    gpu.prefetch_fills = 0
    assert gpu.prefetch_pages() == gpu.prefetch_pages(100) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("delayed", [False, True])
def test_a_store_after_a_prefetch_takes_back_the_store_buffers(
    delayed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefetch's last two fills lie in the store's staging buffers. A store issued before
    the load needs those buffers: its gather waits for the prefetch's copies into them
    (`delayed`: held back 20 ms on the GPU, while the store's own copy to the arena waits
    behind ~40 ms of sleep, so a gather that did not wait would be overwritten in
    between), and the load copies those two groups itself. The stored page and the
    loaded cache are the CPU transfer's."""
    from kvshare.kvpool.transfer_cuda import _StagedFills

    _one_page_staging(monkeypatch)
    pages = 9
    faults = FaultInjection(load_delay=0.02) if delayed else None
    caches, gpu, cpu, copies = cuda_and_cpu_transfers(pages, None, faults)
    prefetch = gpu.prefetch(_head(copies, gpu.prefetch_pages(8)))
    assert isinstance(prefetch, _StagedFills) and len(prefetch.fills) == 4
    stored = copies[8:]  # blocks 16 and 17, loaded by none of the copies below
    noise = torch.randint(-(2**15), 2**15, caches[1].kv[:, :, 16:18].shape, dtype=torch.int16)
    for cache in caches:
        cache.kv[:, :, 16:18].view(torch.int16).copy_(noise)
    if delayed:
        with torch.cuda.stream(gpu.streams["store_copy"]):
            torch.cuda._sleep(2 * gpu.delay_cycles)
    gpu_store, cpu_store = gpu.store(stored), cpu.store(stored)
    gpu_store.wait()
    cpu_store.wait()
    page = slice(stored[0].offset, stored[0].offset + stored[0].nbytes)
    assert gpu.arena is not None and cpu.arena is not None
    assert torch.equal(gpu.arena[page], cpu.arena[page])
    assert gpu_store.checksums() == cpu_store.checksums()
    _assert_loads_as_on_the_cpu(caches, gpu, cpu, copies[:8], prefetch)
    assert gpu.prefetched_fills_used == 2


@pytest.mark.cuda
@pytest.mark.parametrize("grouped", [False, True])
def test_cuda_load_after_another_load_copies_its_pages_again(
    grouped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefetch whose staging buffers another load used since is stale: its load copies
    every page itself (taking the buffers as they are would scatter the other load's
    pages into its blocks)."""
    _one_page_staging(monkeypatch)
    pages = 7
    groups = LayerGroups(min_bytes=1, max_groups=3) if grouped else None
    caches, gpu, cpu, copies = cuda_and_cpu_transfers(pages, groups)
    prefetch = gpu.prefetch(_head(copies, 3))
    assert prefetch is not None
    later = [c._replace(blocks=(2 * pages - 2, 2 * pages - 1)) for c in reversed(copies[3:5])]
    gpu.load(later).wait()
    _assert_loads_as_on_the_cpu(caches, gpu, cpu, copies, prefetch)
    assert gpu.prefetched_fills_used == 0


@pytest.mark.cuda
def test_cuda_load_of_other_pages_than_prefetched_copies_them_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pool's run turned out other than the head's (a page gone between the lookups):
    a prefetched group that is not the load's is filled again."""
    _one_page_staging(monkeypatch)
    pages = 7
    caches, gpu, cpu, copies = cuda_and_cpu_transfers(pages, None)
    prefetch = gpu.prefetch(_head(copies[1:], 3))
    _assert_loads_as_on_the_cpu(caches, gpu, cpu, copies, prefetch)
    assert gpu.prefetched_fills_used == 0


def test_a_request_waiting_for_chunks_computed_elsewhere_prefetches_once(
    pools: PoolFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replica R waits for replica W's chunks and asks the pool again step after step:
    only its first ask makes a head lookup (a waiter likely waits on, and its prefetch
    would take the PCIe link from the restores of others); it still restores them."""
    pool = pools.start(pools.config(size_bytes=32 * MIB, slab_bytes=4 * MIB))
    wait = WaitOptions(max_wait_s=30.0, stall_s=30.0)
    writer = waiting_replica(pool, wait, batch_tokens=CHUNK)
    reader = waiting_replica(pool, wait)
    events = _record_prefetches(connector_of(reader), monkeypatch, ahead=2)
    writer.add_request("w", WAITED_PROMPT, WAIT_GREEDY)
    writer.step()  # admitted: its lookup claimed every chunk, and it computed the first
    reader.add_request("r", [*DOCUMENT, 7, 8, 9], WAIT_GREEDY)
    done = step_until_finished((writer, reader), 2)
    assert done["r"].pool_hit_tokens == len(DOCUMENT)
    names = [name for name, _ in events]
    assert names.count("head lookup") == 1 and names.count("lookup") > 2, names


def test_a_request_whose_match_was_cancelled_asks_again_without_a_prefetch(
    pools: PoolFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler cancels a match when the request's blocks do not fit, and asks again
    at later steps: those asks prefetch nothing (each would copy for nothing)."""
    _, connector, _, events = _prefetching_replica(pools, monkeypatch, 2)
    hit_tokens = 4 * connector.chunk_tokens
    assert connector.match("r", PROMPT, 0).num_tokens == hit_tokens
    connector.cancel("r")
    assert connector.match("r", PROMPT, 0).num_tokens == hit_tokens
    connector.cancel("r")
    connector.forget("r")
    assert [name for name, _ in events] == ["head lookup", "prefetch", "lookup", "lookup"]
    assert connector.client.stats()["leases"] == 0


def test_a_prefetch_that_raises_costs_the_prefetch_only(
    pools: PoolFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm, connector, reference, events = _prefetching_replica(pools, monkeypatch, 2)

    def failing_prefetch(copies: list[PageCopy]) -> Prefetch:
        raise RuntimeError("injected: a copy failed to start")

    monkeypatch.setattr(connector.transfer, "prefetch", failing_prefetch)
    hit = llm.generate([PROMPT], GREEDY)[0]
    assert hit.token_ids == reference.token_ids
    assert hit.pool_hit_tokens == 4 * connector.chunk_tokens
    assert [name for name, _ in events] == ["head lookup", "lookup", "load"]
    assert events[2][1][1] is None and connector.counters["prefetches"] == 0
    assert connector.client.stats()["leases"] == 0
