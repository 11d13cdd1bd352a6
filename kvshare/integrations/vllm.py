"""kvshare's pool as a vLLM v1 KV connector: `KVShareConnector`.

    LLM(model, kv_transfer_config=KVTransferConfig(
        kv_connector="KVShareConnector", kv_connector_module_path="kvshare.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"kv_pool": "unix:/path/pool.sock", "chunk_tokens": 256}))

The scheduler side computes the chunk keys of a prompt (namespace + the request's
`cache_salt`), asks the daemon once per request for the longest committed run (pinned
under a lease, cached until the load is dispatched) and tells the workers which whole
blocks to load and which chunks to store. The worker side copies whole blocks between
vLLM's KV cache and the arena, synchronously:
- load (`start_load_kv`, before the forward pass): the worker pins the pages under its own
  lease, copies each page out of the arena, and writes it into vLLM's blocks only when the
  header, the daemon's checksum and the checksum of the copied bytes agree; the lease is
  released after that. A page that is missing or does not verify is never used: its
  blocks and every later block of that load are reported through
  `get_block_ids_with_load_errors`, and vLLM (kv_load_failure_policy "recompute")
  recomputes from there. A corrupt page is also invalidated at the daemon.
- store (`wait_for_save`, after the forward pass that completed the chunk): reserve, copy
  the blocks, write header and checksum, commit; only committed pages are visible.
Blocks of the engine's own prefix cache (before the local hit) are never written.
Any pool trouble (no daemon, another user's socket, a full pool, a daemon restart) is a
miss or a skipped store with a log line; the connector never raises into vLLM.

Hybrid models (Gated DeltaNet / Mamba layers + attention, e.g. Qwen3-Next) need vLLM's
prefix caching ("align" mode: the state block at position p of a request's row holds the
state after exactly (p + 1) x block_size tokens). A prefix is usable only up to a chunk
boundary that has every KV chunk AND a state page (the recurrent state after exactly that
many tokens, key `state_key(chunk key)`): the lookup asks the daemon for exactly that, and
restoring KV without its state would give wrong output. A state page is stored when a
forward pass ends on a chunk boundary (vLLM ends a prefill step on the prompt's last block
boundary, so `chunk_tokens` defaults to the block size for hybrid models). Hybrid loads
are asynchronous in vLLM's sense (the request waits one step in WAITING_FOR_REMOTE_KVS):
vLLM copies the state of the hit's last block into the running block before the forward
pass, before a synchronous load would run, and it maps load failures to requests only per
request (`failed_recving`) when there are several KV cache groups, since block ids are
only unique within a group. A failed hybrid load is recomputed from token 0.
Limits: tensor parallel size 1; KV cache groups of full attention and of Mamba-type state
only (sliding-window or chunked-local attention groups: run vLLM with
--disable-hybrid-kv-cache-manager to get one group, or the connector stays off).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvshare.integrations.vllm_pages import (
    PAGE_LAYOUT_VERSION,
    PageGeometry,
    cache_layer,
    page_checksum,
    page_header,
    verify_page,
)
from kvshare.kvpool.client import LookupResult, PageRef, PoolClient, PoolError, PoolUnavailable
from kvshare.kvpool.connector import state_key
from kvshare.kvpool.faults import faults_from_config
from kvshare.kvpool.keys import Namespace, chain_seed, chunk_keys
from kvshare.kvpool.page import HEADER_BYTES
from kvshare.kvpool.paths import default_pool_address

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under vLLM's logger, so these lines appear in its log with its format.
log = logging.getLogger("vllm.kvshare")
_POOL_ERRORS = (PoolUnavailable, PoolError)
# Restore a hybrid prefix's KV but not its recurrent state.
_HONOURED_FAULTS = frozenset({"skip_state_restore"})
_T = TypeVar("_T")
# vLLM's placeholder block id (BlockPool.null_block): a position of a row with no block.
_NULL_BLOCK = 0


@dataclass(frozen=True)
class CacheGroups:
    """vLLM's KV cache groups by what their blocks hold: per-token attention KV (`kv`) or
    a recurrent state per block boundary (`state`, Mamba-type layers). Indexes into
    `kv_cache_config.kv_cache_groups`."""

    kv: tuple[int, ...]
    state: tuple[int, ...]

    @property
    def hybrid(self) -> bool:
        return bool(self.state)


@dataclass(frozen=True)
class LoadSpec:
    """Load chunks [0, len(keys)) of a request; blocks before `first_block` are the engine's.

    `block_ids[g]`: the hit's blocks in KV group g (CacheGroups.kv order). `state_blocks[g]`:
    the block of state group g that must hold the state after the hit (hybrid models;
    empty otherwise), the last page of the lookup."""

    request_id: str
    keys: list[bytes]
    block_ids: tuple[list[int], ...]
    first_block: int
    state_blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class StoreSpec:
    """Store chunks `chunks` of a request, complete after this step's forward pass; with
    `state_chunk`, also the state after that chunk, which this step's forward pass ends on,
    from the blocks `state_blocks` (one per state group)."""

    request_id: str
    chunks: list[int]
    keys: list[bytes]  # every key of the prompt, from chunk 0
    block_ids: tuple[list[int], ...]  # per KV group
    seed: bytes  # the parent of chunk 0
    state_chunk: int | None = None
    state_blocks: tuple[int, ...] = ()


@dataclass
class KVShareMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)


@dataclass
class KVShareWorkerMetadata(KVConnectorWorkerMetadata):
    """Requests whose load the workers finished this step (copied, verified, unpinned)."""

    loaded: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVShareWorkerMetadata)
        return KVShareWorkerMetadata(self.loaded | other.loaded)


@dataclass
class _Tracked:
    """A running request as the scheduler side sees it. `block_ids[g]`: its row in KV
    cache group g (every group, vLLM's order), position-indexed."""

    keys: list[bytes]
    seed: bytes
    prompt_tokens: int
    block_ids: list[list[int]] = field(default_factory=list)
    stored_chunks: int = 0


@dataclass
class _Match:
    lease: int
    chunks: int


class KVShareConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.block_size = vllm_config.cache_config.block_size
        self.groups, self.usable = cache_groups(vllm_config, kv_cache_config)
        default_chunk = self.block_size if self.groups.hybrid else max(256, self.block_size)
        self.chunk_tokens = int(extra.get("chunk_tokens", default_chunk))
        if self.chunk_tokens % self.block_size:
            raise ValueError(
                f"kvshare: chunk_tokens ({self.chunk_tokens}) must be a multiple of vLLM's "
                f"block size ({self.block_size})"
            )
        self.blocks_per_chunk = self.chunk_tokens // self.block_size
        # Test only (None in production): the broken variants the tests show are caught.
        self.faults = faults_from_config(extra.get("faults"), _HONOURED_FAULTS)
        if self.faults is not None:
            log.warning("kvshare: fault injection %s: restored prefixes are WRONG", self.faults)
        self.address = str(extra.get("kv_pool") or default_pool_address())
        self.namespace = vllm_namespace(vllm_config, kv_cache_config, self.chunk_tokens)
        if self.usable:
            log.warning("kvshare connector disabled: %s", self.usable)
        self.client = PoolClient(self.address, timeout=2.0, retry_interval=2.0)
        self._pool_down: str | None = None
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._matches: dict[str, _Match] = {}
        self._pending_loads: dict[str, LoadSpec] = {}
        self._dispatched: dict[str, int] = {}  # request id -> lease, until its load is done
        # worker side
        self._geometry: PageGeometry | None = None
        self._state_geometry: PageGeometry | None = None
        self._load_errors: set[int] = set()
        self._loaded: set[str] = set()
        self._failed_loads: set[str] = set()
        self.counters = {
            "load_chunks": 0,
            "load_states": 0,
            "load_failures": 0,
            "stored": 0,
            "stored_states": 0,
            "store_skipped": 0,
        }
        # The namespace names what a page's bytes depend on: replicas that log different
        # namespaces never share pages, whatever pool they use (the reason for no hits).
        log.info(
            "kvshare connector (%s) on %s: chunk %d tokens, block %d%s, namespace %s (%s, KV %s)",
            role.name.lower(),
            self.address,
            self.chunk_tokens,
            self.block_size,
            ", hybrid (KV + state pages)" if self.groups.hybrid else "",
            self.namespace.digest().hex()[:16],
            self.namespace.architecture,
            self.namespace.kv_dtype,
        )

    # -- pool trouble -----------------------------------------------------------------

    def _pool_failed(self, op: str, error: Exception) -> None:
        """One log line when the pool becomes unusable (a wrong address, the daemon down),
        not one per request: while it stays down the client's reconnect attempts answer
        with other messages, none of them news."""
        if self._pool_down is None:
            log.warning(
                "kvshare pool at %s: %s failed (%s: %s): recomputing without the pool until "
                "it is reachable",
                self.address,
                op,
                type(error).__name__,
                error,
            )
        self._pool_down = f"{type(error).__name__}: {error}"

    def _pool_ok(self) -> None:
        if self._pool_down is not None:
            log.warning("kvshare pool at %s is reachable again", self.address)
            self._pool_down = None

    # -- scheduler side -----------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if self.usable:
            return 0, False
        match = self._matches.get(request.request_id)
        if match is None:
            match = self._lookup(request)
            self._matches[request.request_id] = match
        new_tokens = max(0, match.chunks * self.chunk_tokens - num_computed_tokens)
        return new_tokens, self.groups.hybrid and new_tokens > 0

    def _lookup(self, request: Request) -> _Match:
        tracked = self._track(request)
        # vLLM computes at least the prompt's last token: a hit never covers it.
        usable = (tracked.prompt_tokens - 1) // self.chunk_tokens
        if usable == 0:
            return _Match(0, 0)
        keys = tracked.keys[:usable]
        states = [(j, state_key(key)) for j, key in enumerate(keys)] if self.groups.hybrid else None
        try:
            result = self.client.lookup(keys, states)
        except _POOL_ERRORS as error:
            self._pool_failed("lookup", error)
            return _Match(0, 0)
        self._pool_ok()
        # With states, the run ends after a chunk that has a state page, that page last.
        chunks = len(result.pages) - 1 if self.groups.hybrid and result.pages else len(result.pages)
        return _Match(result.lease, chunks)

    def _track(self, request: Request) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            prompt = list(request.prompt_token_ids or [])
            salt = request.cache_salt or None
            tracked = _Tracked(
                keys=chunk_keys(self.namespace, prompt, salt),
                seed=chain_seed(self.namespace, salt),
                prompt_tokens=len(prompt),
            )
            self._tracked[request.request_id] = tracked
        return tracked

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens == 0:
            return
        match = self._matches[request.request_id]
        tracked = self._tracked[request.request_id]
        hit_tokens = match.chunks * self.chunk_tokens
        hit_blocks = hit_tokens // self.block_size
        rows = blocks.get_block_ids()
        self._pending_loads[request.request_id] = LoadSpec(
            request.request_id,
            tracked.keys[: match.chunks],
            tuple(list(rows[g][:hit_blocks]) for g in self.groups.kv),
            (hit_tokens - num_external_tokens) // self.block_size,
            tuple(rows[g][hit_blocks - 1] for g in self.groups.state),
        )
        # Chunks restored from the pool are there already.
        tracked.stored_chunks = match.chunks

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVShareMetadata(loads=list(self._pending_loads.values()))
        for request_id in self._pending_loads:
            match = self._matches.pop(request_id, None)
            if match is not None and match.lease:
                self._dispatched[request_id] = match.lease
        self._pending_loads.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = [list(row) for row in new.block_ids]
            self._add_store(
                meta, new.req_id, tracked, new.num_computed_tokens + scheduled[new.req_id]
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if request_id in cached.resumed_req_ids:
                tracked.block_ids = [list(row) for row in new_blocks] if new_blocks else []
            elif new_blocks:
                if not tracked.block_ids:
                    tracked.block_ids = [[] for _ in new_blocks]
                for row, added in zip(tracked.block_ids, new_blocks, strict=True):
                    row.extend(added)
            end = cached.num_computed_tokens[i] + scheduled.get(request_id, 0)
            self._add_store(meta, request_id, tracked, end)
        return meta

    def _add_store(
        self, meta: KVShareMetadata, request_id: str, tracked: _Tracked, end: int
    ) -> None:
        """Chunks of the prompt that this step completes (the blocks hold every token),
        and for hybrid models the state at `end` when this step ends on a chunk boundary
        (the state is only observable between forward passes)."""
        if not tracked.block_ids:
            return
        kv_rows = [tracked.block_ids[g] for g in self.groups.kv]
        complete = min(end, tracked.prompt_tokens) // self.chunk_tokens
        complete = min(complete, min(len(row) for row in kv_rows) // self.blocks_per_chunk)
        if complete <= tracked.stored_chunks:
            return
        state_blocks = (
            self._state_blocks_at(tracked, end) if end == complete * self.chunk_tokens else ()
        )
        chunks = list(range(tracked.stored_chunks, complete))
        tracked.stored_chunks = complete
        meta.stores.append(
            StoreSpec(
                request_id,
                chunks,
                tracked.keys,
                tuple(list(row) for row in kv_rows),
                tracked.seed,
                complete - 1 if state_blocks else None,
                state_blocks,
            )
        )

    def _state_blocks_at(self, tracked: _Tracked, tokens: int) -> tuple[int, ...]:
        """The blocks (one per state group) that hold the state after `tokens` tokens
        (a multiple of the block size) at the end of this step; () for models without
        state or when a group has no block there."""
        if not self.groups.hybrid:
            return ()
        at = tokens // self.block_size - 1
        rows = [tracked.block_ids[g] for g in self.groups.state]
        if not all(at < len(row) and row[at] != _NULL_BLOCK for row in rows):
            return ()
        return tuple(row[at] for row in rows)

    def update_connector_output(self, connector_output: Any) -> None:
        # The workers pin what they copy under their own lease: this one only kept the
        # pages from eviction until the load was done.
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVShareWorkerMetadata):
            self._release([self._dispatched.pop(r) for r in meta.loaded if r in self._dispatched])

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def _finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Stores and loads are done within their step: nothing holds the blocks."""
        match = self._matches.pop(request.request_id, None)
        leases = [match.lease] if match is not None and match.lease else []
        dispatched = self._dispatched.pop(request.request_id, None)
        self._release(leases + ([dispatched] if dispatched else []))
        self._tracked.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        return False, None

    def _release(self, leases: list[int]) -> None:
        for lease in leases:
            try:
                self.client.release(lease)
            except _POOL_ERRORS as error:
                self._pool_failed("release", error)

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.usable:
            return
        self._geometry = self._page_geometry(kv_caches, self.groups.kv, self.blocks_per_chunk)
        if self.groups.hybrid:
            self._state_geometry = self._page_geometry(kv_caches, self.groups.state, 1)
        log.info(
            "kvshare: %d layers, %d bytes per page, layout %s%s",
            len(self._geometry.layers),
            self._geometry.payload_bytes,
            [tuple(layer.tensor.shape) for layer in self._geometry.layers[:1]],
            f"; state pages of {self._state_geometry.payload_bytes} bytes "
            f"({len(self._state_geometry.layers)} tensors)"
            if self._state_geometry is not None
            else "",
        )

    def _page_geometry(
        self, kv_caches: dict[str, Any], group_ids: tuple[int, ...], blocks_per_page: int
    ) -> PageGeometry:
        """The layers of `group_ids`, each reading the block ids of its group (a layer
        whose cache is a list of tensors, such as conv + SSM state, gives one per tensor)."""
        num_blocks = self._kv_cache_config.num_blocks
        groups = self._kv_cache_config.kv_cache_groups
        layers = []
        for index, group_id in enumerate(group_ids):
            for name in groups[group_id].layer_names:
                cache = kv_caches[name]
                tensors = cache if isinstance(cache, (list, tuple)) else [cache]
                layers += [cache_layer(name, t, num_blocks, index) for t in tensors]
        return PageGeometry(tuple(layers), blocks_per_page)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVShareMetadata)
        for load in meta.loads:
            if self.groups.hybrid:
                self._load_hybrid(load)
            else:
                self._load(load)

    def _load(self, load: LoadSpec) -> None:
        geometry = self._geometry
        restored = None
        if geometry is not None:
            restored = self._under_lease(
                load.keys, None, lambda r: self._restore(load, r, geometry)
            )
        good = restored or 0  # a failed pool: nothing restored
        self._loaded.add(load.request_id)
        self.counters["load_chunks"] += good
        bpp = self.blocks_per_chunk
        (blocks,) = load.block_ids  # one KV cache group: its ids identify blocks
        failed = blocks[max(load.first_block, good * bpp) :]
        if failed:
            self.counters["load_failures"] += 1
            log.warning(
                "kvshare: request %s: %d of %d chunks restored; recomputing %d blocks",
                load.request_id,
                good,
                len(load.keys),
                len(failed),
            )
            self._load_errors.update(failed)

    def _load_hybrid(self, load: LoadSpec) -> None:
        """Every KV chunk and the state after the last, or nothing: the request is then
        reported in `failed_recving` and vLLM recomputes it (block ids would not say which
        request failed: they repeat across KV cache groups)."""
        restored = False
        if self._geometry is not None and self._state_geometry is not None:
            states = [(len(load.keys) - 1, state_key(load.keys[-1]))]
            restored = self._under_lease(
                load.keys, states, lambda r: self._restore_hybrid(load, r.pages, r.lease)
            )
        self._loaded.add(load.request_id)
        if restored:
            self.counters["load_chunks"] += len(load.keys)
            self.counters["load_states"] += 1
            return
        self.counters["load_failures"] += 1
        self._failed_loads.add(load.request_id)
        log.warning(
            "kvshare: request %s: the %d chunks and their state were not restored; "
            "recomputing the request",
            load.request_id,
            len(load.keys),
        )

    def _under_lease(
        self,
        keys: list[bytes],
        states: list[tuple[int, bytes]] | None,
        use: Callable[[LookupResult], _T],
    ) -> _T | None:
        """`use` of the pages the worker pinned under its own lease, released after it;
        None when the pool failed (logged)."""
        lease = 0
        try:
            result = self.client.lookup(keys, states)
            lease = result.lease
            return use(result)
        except _POOL_ERRORS as error:
            self._pool_failed("load", error)
            return None
        finally:
            if lease:
                self._release([lease])

    def _restore(self, load: LoadSpec, result: LookupResult, geometry: PageGeometry) -> int:
        """Write the verified pages of a load in order, up to the first that fails; returns
        how many chunks are in place (the engine's own count as in place)."""
        bpp = self.blocks_per_chunk
        arena = self.client.arena.as_tensor()
        good = 0
        for j, page in enumerate(result.pages):
            if (j + 1) * bpp <= load.first_block:  # all the engine's own blocks
                good += 1
                continue
            payload = verify_page(arena, page, geometry.payload_bytes)
            if payload is None:
                self._corrupt(result.lease, page.key, load.request_id, j)
                break
            first = max(0, load.first_block - j * bpp)
            geometry.scatter(payload, _chunk_blocks(load.block_ids, j, bpp), first)
            good += 1
        return good

    def _restore_hybrid(self, load: LoadSpec, pages: tuple[PageRef, ...], lease: int) -> bool:
        """Verify every page first, then write: a failed load leaves the blocks unwritten."""
        geometry, state_geometry = self._geometry, self._state_geometry
        assert geometry is not None and state_geometry is not None
        if len(pages) != len(load.keys) + 1 or _NULL_BLOCK in load.state_blocks:
            return False  # evicted since the scheduler's lookup; no block for the state
        arena = self.client.arena.as_tensor()
        payloads = []
        for j, page in enumerate(pages):
            expected = state_geometry if j == len(load.keys) else geometry
            payload = verify_page(arena, page, expected.payload_bytes)
            if payload is None:
                self._corrupt(lease, page.key, load.request_id, j)
                return False
            payloads.append(payload)
        bpp = self.blocks_per_chunk
        for j, payload in enumerate(payloads[:-1]):
            if (j + 1) * bpp <= load.first_block:  # all the engine's own blocks
                continue
            first = max(0, load.first_block - j * bpp)
            geometry.scatter(payload, _chunk_blocks(load.block_ids, j, bpp), first)
        if self.faults is None or not self.faults.skip_state_restore:
            state_geometry.scatter(payloads[-1], [[b] for b in load.state_blocks], 0)
        return True

    def _corrupt(self, lease: int, key: bytes, request_id: str, chunk: int) -> None:
        log.error(
            "kvshare: request %s: page of chunk %d (key %s) failed verification (header or "
            "checksum): not used, invalidated at the daemon",
            request_id,
            chunk,
            key.hex(),
        )
        try:
            self.client.invalidate(lease, [key])
        except _POOL_ERRORS as error:
            self._pool_failed("invalidate", error)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._loaded:
            return None
        meta, self._loaded = KVShareWorkerMetadata(self._loaded), set()
        return meta

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Hybrid loads finish within the step that runs them (copies are synchronous);
        vLLM only waits for them across a step. A failed one is also finished."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        loaded = (
            {load.request_id for load in meta.loads}
            if self.groups.hybrid and isinstance(meta, KVShareMetadata)
            else set()
        )
        failed, self._failed_loads = self._failed_loads, set()
        return KVConnectorTransferResults(finished_recving=loaded, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVShareMetadata)
        if self._geometry is None:
            return
        for store in meta.stores:
            self._store(store, self._geometry)
            if store.state_chunk is not None and self._state_geometry is not None:
                self._store_state(store, self._state_geometry)

    def _store(self, store: StoreSpec, geometry: PageGeometry) -> None:
        bpp = self.blocks_per_chunk
        keys = [store.keys[j] for j in store.chunks]
        chunk_of = {store.keys[j]: j for j in store.chunks}
        self._write_pages(
            store.request_id,
            keys,
            geometry,
            lambda key: _chunk_blocks(store.block_ids, chunk_of[key], bpp),
            lambda key: store.keys[chunk_of[key] - 1] if chunk_of[key] else store.seed,
            extends=store.keys[: store.chunks[0]] if store.chunks else (),
        )

    def _store_state(self, store: StoreSpec, geometry: PageGeometry) -> None:
        """The state after chunk `state_chunk`, keyed by that chunk's key; its parent is
        the chunk, so the page's header names what it belongs to."""
        assert store.state_chunk is not None
        chunk_key = store.keys[store.state_chunk]
        stored = self._write_pages(
            store.request_id,
            [state_key(chunk_key)],
            geometry,
            lambda key: [[b] for b in store.state_blocks],
            lambda key: chunk_key,
        )
        self.counters["stored_states"] += stored

    def _write_pages(
        self,
        request_id: str,
        keys: list[bytes],
        geometry: PageGeometry,
        blocks_of: Any,
        parent_of: Any,
        extends: Sequence[bytes] = (),
    ) -> int:
        """Reserve, copy, write header and checksum, commit; returns how many committed.
        `extends`: the chain's keys before `keys`, kept from eviction by this reserve."""
        try:
            reservation = self.client.reserve(keys, geometry.payload_bytes, extends)
        except _POOL_ERRORS as error:
            self._pool_failed("reserve", error)
            return 0
        if reservation.dropped:
            self.counters["store_skipped"] += reservation.dropped
            log.warning(
                "kvshare: pool full: %d of %d pages of request %s not stored",
                reservation.dropped,
                len(keys),
                request_id,
            )
        reserved = [page.key for page in reservation.pages]
        try:
            arena = self.client.arena.as_tensor()
            checksums = []
            for page in reservation.pages:
                start = page.offset + HEADER_BYTES
                payload = arena[start : start + geometry.payload_bytes]
                geometry.gather(blocks_of(page.key), payload)
                checksum = page_checksum(payload, page.key)
                header = page_header(
                    page.key, parent_of(page.key), geometry.payload_bytes, checksum
                )
                arena[page.offset : page.offset + HEADER_BYTES].copy_(
                    torch.frombuffer(bytearray(header), dtype=torch.uint8)
                )
                checksums.append(checksum)
            if reserved:
                self.client.commit(reserved, checksums, [p.offset for p in reservation.pages])
            self.counters["stored"] += len(reserved)
            self._pool_ok()
            return len(reserved)
        except _POOL_ERRORS as error:
            self._pool_failed("store", error)
            self._abort(reserved)
            return 0

    def _abort(self, keys: list[bytes]) -> None:
        if not keys:
            return
        try:
            self.client.abort(keys)
        except _POOL_ERRORS as error:
            self._pool_failed("abort", error)

    def shutdown(self) -> None:
        self.client.close()


def _chunk_blocks(block_ids: tuple[list[int], ...], chunk: int, bpp: int) -> list[list[int]]:
    """The blocks of chunk `chunk` in each group's row."""
    return [row[chunk * bpp : (chunk + 1) * bpp] for row in block_ids]


def vllm_namespace(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, chunk_tokens: int
) -> Namespace:
    """Everything that changes the bytes of a vLLM page: the model (its HF config, its
    weights' name and revision), the KV dtype and the cache layout (vLLM version,
    platform, each group's spec and layer names, the block size)."""
    import vllm
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    hf_config = model.hf_config.to_json_string(use_diff=False)
    groups = [
        (type(g.kv_cache_spec).__name__, repr(g.kv_cache_spec), list(g.layer_names))
        for g in kv_cache_config.kv_cache_groups
    ]
    layout = repr(
        (
            vllm.__version__,
            current_platform.device_type,
            kv_cache_config.kv_cache_layout,
            vllm_config.cache_config.block_size,
            groups,
        )
    )
    return Namespace(
        architecture="vllm:" + ",".join(model.architectures or ["unknown"]),
        config_digest=_digest(hf_config),
        weights_digest=f"{model.model}@{model.revision or ''}:{_digest(model.model)}",
        kv_dtype=str(vllm_config.cache_config.cache_dtype) + "/" + str(model.dtype),
        layout_version=PAGE_LAYOUT_VERSION,
        chunk_tokens=chunk_tokens,
        cache_salt="vllm-layout:" + _digest(layout),
    )


def cache_groups(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[CacheGroups, str]:
    """The engine's KV cache groups by role, and why the connector cannot serve this
    engine ("" when it can)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    kv: list[int] = []
    state: list[int] = []
    reason = ""
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            state.append(index)
            if spec.mamba_cache_mode != "align" or spec.num_speculative_blocks:
                reason = (
                    "hybrid models need vLLM's prefix caching of recurrent states "
                    f"(mamba_cache_mode 'align', no speculative blocks; got "
                    f"{spec.mamba_cache_mode!r}, {spec.num_speculative_blocks})"
                )
        elif (
            type(spec) is FullAttentionSpec
            and spec.sliding_window is None
            and spec.attention_chunk_size is None
        ):
            kv.append(index)
        else:
            reason = (
                f"KV cache group {index} is {type(spec).__name__}, which the connector does "
                "not copy yet (run vLLM with --disable-hybrid-kv-cache-manager to get a "
                "single group)"
            )
    if not kv and not reason:
        reason = "no full-attention KV cache group"
    if vllm_config.parallel_config.tensor_parallel_size != 1:
        reason = "tensor parallel size > 1 is not supported yet"
    return CacheGroups(tuple(kv), tuple(state)), reason


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
