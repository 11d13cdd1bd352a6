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
Limits: one KV cache group (attention-only models), tensor parallel size 1.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvshare.integrations.vllm_pages import (
    PAGE_LAYOUT_VERSION,
    PageGeometry,
    cache_layer,
    page_checksum,
    page_header,
    verify_page,
)
from kvshare.kvpool.client import PoolClient, PoolError, PoolUnavailable
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


@dataclass(frozen=True)
class LoadSpec:
    """Load chunks [0, len(keys)) of a request; blocks before `first_block` are the engine's."""

    request_id: str
    keys: list[bytes]
    block_ids: list[int]
    first_block: int


@dataclass(frozen=True)
class StoreSpec:
    """Store chunks `chunks` of a request, complete after this step's forward pass."""

    request_id: str
    chunks: list[int]
    keys: list[bytes]  # every key of the prompt, from chunk 0
    block_ids: list[int]
    seed: bytes  # the parent of chunk 0


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
    """A running request as the scheduler side sees it."""

    keys: list[bytes]
    seed: bytes
    prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    stored_chunks: int = 0


@dataclass
class _Match:
    lease: int
    chunks: int


class KVShareConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_tokens = int(extra.get("chunk_tokens", max(256, self.block_size)))
        if self.chunk_tokens % self.block_size:
            raise ValueError(
                f"kvshare: chunk_tokens ({self.chunk_tokens}) must be a multiple of vLLM's "
                f"block size ({self.block_size})"
            )
        self.address = str(extra.get("kv_pool") or default_pool_address())
        self.namespace = vllm_namespace(vllm_config, kv_cache_config, self.chunk_tokens)
        self.usable = _usable_reason(vllm_config, kv_cache_config)
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
        self._load_errors: set[int] = set()
        self._loaded: set[str] = set()
        self.counters = {"load_chunks": 0, "load_failures": 0, "stored": 0, "store_skipped": 0}
        log.info(
            "kvshare connector (%s) on %s: chunk %d tokens, block %d",
            role.name.lower(),
            self.address,
            self.chunk_tokens,
            self.block_size,
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
        hit_tokens = match.chunks * self.chunk_tokens
        return max(0, hit_tokens - num_computed_tokens), False

    def _lookup(self, request: Request) -> _Match:
        tracked = self._track(request)
        # vLLM computes at least the prompt's last token: a hit never covers it.
        usable = (tracked.prompt_tokens - 1) // self.chunk_tokens
        if usable == 0:
            return _Match(0, 0)
        try:
            result = self.client.lookup(tracked.keys[:usable])
        except _POOL_ERRORS as error:
            self._pool_failed("lookup", error)
            return _Match(0, 0)
        self._pool_ok()
        return _Match(result.lease, len(result.pages))

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
        local_tokens = hit_tokens - num_external_tokens
        self._pending_loads[request.request_id] = LoadSpec(
            request.request_id,
            tracked.keys[: match.chunks],
            list(blocks.get_block_ids()[0][: hit_tokens // self.block_size]),
            local_tokens // self.block_size,
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
            tracked.block_ids = list(new.block_ids[0])
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
                tracked.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                tracked.block_ids.extend(new_blocks[0])
            end = cached.num_computed_tokens[i] + scheduled.get(request_id, 0)
            self._add_store(meta, request_id, tracked, end)
        return meta

    def _add_store(
        self, meta: KVShareMetadata, request_id: str, tracked: _Tracked, end: int
    ) -> None:
        """Chunks of the prompt that this step completes (the blocks hold every token)."""
        complete = min(end, tracked.prompt_tokens) // self.chunk_tokens
        complete = min(complete, len(tracked.block_ids) * self.block_size // self.chunk_tokens)
        if complete <= tracked.stored_chunks:
            return
        chunks = list(range(tracked.stored_chunks, complete))
        tracked.stored_chunks = complete
        meta.stores.append(
            StoreSpec(request_id, chunks, tracked.keys, list(tracked.block_ids), tracked.seed)
        )

    def update_connector_output(self, connector_output: Any) -> None:
        # The workers pin what they copy under their own lease: this one only kept the
        # pages from eviction until the load was done.
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVShareWorkerMetadata):
            self._release([self._dispatched.pop(r) for r in meta.loaded if r in self._dispatched])

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
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
        num_blocks = self._kv_cache_config.num_blocks
        names = self._kv_cache_config.kv_cache_groups[0].layer_names
        layers = tuple(cache_layer(name, kv_caches[name], num_blocks) for name in names)
        self._geometry = PageGeometry(layers, self.chunk_tokens // self.block_size)
        log.info(
            "kvshare: %d layers, %d bytes per page, layout %s",
            len(layers),
            self._geometry.payload_bytes,
            [tuple(layer.tensor.shape) for layer in layers[:1]],
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVShareMetadata)
        for load in meta.loads:
            self._load(load)

    def _load(self, load: LoadSpec) -> None:
        geometry = self._geometry
        bpp = self.chunk_tokens // self.block_size
        good = 0
        lease = 0
        if geometry is not None:
            try:
                result = self.client.lookup(load.keys)
                lease = result.lease
                arena = self.client.arena.as_tensor()
                for j, page in enumerate(result.pages):
                    if (j + 1) * bpp <= load.first_block:  # all the engine's own blocks
                        good += 1
                        continue
                    payload = verify_page(arena, page, geometry.payload_bytes)
                    if payload is None:
                        self._corrupt(lease, page.key, load.request_id, j)
                        break
                    first = max(0, load.first_block - j * bpp)
                    geometry.scatter(payload, load.block_ids[j * bpp : (j + 1) * bpp], first)
                    good += 1
            except _POOL_ERRORS as error:
                self._pool_failed("load", error)
            finally:
                if lease:
                    self._release([lease])
        self._loaded.add(load.request_id)
        self.counters["load_chunks"] += good
        failed = load.block_ids[max(load.first_block, good * bpp) :]
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

    def _store(self, store: StoreSpec, geometry: PageGeometry) -> None:
        bpp = self.chunk_tokens // self.block_size
        keys = [store.keys[j] for j in store.chunks]
        try:
            reservation = self.client.reserve(keys, geometry.payload_bytes)
        except _POOL_ERRORS as error:
            self._pool_failed("reserve", error)
            return
        if reservation.dropped:
            self.counters["store_skipped"] += reservation.dropped
            log.warning(
                "kvshare: pool full: %d of %d chunks of request %s not stored",
                reservation.dropped,
                len(keys),
                store.request_id,
            )
        chunk_of = {store.keys[j]: j for j in store.chunks}
        reserved = [page.key for page in reservation.pages]
        try:
            arena = self.client.arena.as_tensor()
            checksums = []
            for page in reservation.pages:
                j = chunk_of[page.key]
                start = page.offset + HEADER_BYTES
                payload = arena[start : start + geometry.payload_bytes]
                geometry.gather(store.block_ids[j * bpp : (j + 1) * bpp], payload)
                checksum = page_checksum(payload, page.key)
                parent = store.keys[j - 1] if j else store.seed
                header = page_header(page.key, parent, geometry.payload_bytes, checksum)
                arena[page.offset : page.offset + HEADER_BYTES].copy_(
                    torch.frombuffer(bytearray(header), dtype=torch.uint8)
                )
                checksums.append(checksum)
            if reserved:
                self.client.commit(reserved, checksums, [p.offset for p in reservation.pages])
            self.counters["stored"] += len(reserved)
            self._pool_ok()
        except _POOL_ERRORS as error:
            self._pool_failed("store", error)
            self._abort(reserved)

    def _abort(self, keys: list[bytes]) -> None:
        if not keys:
            return
        try:
            self.client.abort(keys)
        except _POOL_ERRORS as error:
            self._pool_failed("abort", error)

    def shutdown(self) -> None:
        self.client.close()


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


def _usable_reason(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str:
    """Why the connector cannot serve this engine ("" when it can)."""
    if len(kv_cache_config.kv_cache_groups) != 1:
        return "models with several KV cache groups (hybrid, sliding window) are not supported yet"
    if vllm_config.parallel_config.tensor_parallel_size != 1:
        return "tensor parallel size > 1 is not supported yet"
    return ""


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
