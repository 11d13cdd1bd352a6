"""The engine connector of the shared pool: restore prefixes from pages, store new chunks.

Implements `kvshare.engine.connector.KVConnector` over a `PoolClient` (control, one round
trip per lookup/reserve/commit) and a `Transfer` (bytes: CUDA streams or a CPU thread).
What each load and store copies is planned in plan.py; restored pages are checked by verify.py.

Invariants:
- Only committed pages are read, under a lease that lives until the copy completed and
  its checksums were compared; the daemon's checksum, the page header and the bytes copied
  must all agree, otherwise `finish_load` says False (the engine discards what it computed
  from the restore and recomputes) and the failure is counted. A page found corrupt is
  invalidated at the daemon at once: no reader on any replica is served it again.
- A restore whose lease was lost before its release (daemon crash or restart, broken
  link) is a failed restore as well: the pages may have been reused meanwhile.
  `finish_load` gives that final verdict; the lost lease is logged and counted.
- A store reserves pages, copies after the compute work that wrote the blocks, writes
  each header, and commits only then; a failed copy aborts its reservations.
- Blocks being copied, sliding-window blocks included, hold an extra reference until the
  copy completed.
- Any pool trouble is a miss or a skipped store, never an exception to the engine.
- A lookup claims the chunks this replica will compute (the daemon tells other replicas
  they are in progress here); a request that leaves before storing them unclaims them.
  A lookup that finds chunks in progress elsewhere may make its request wait (unpinned,
  unadmitted, asked again at later steps) under the rules of waiting.py; one wait per
  request. A hybrid model resumes only at a state snapshot: its lookups also claim the
  state pages of the snapshots the request will take, and wait only for chunks that end
  at a state page committed or in progress.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvshare.engine.config import KVCacheDtype
from kvshare.engine.connector import KVConnector, KVStoreUnavailable, PagedKVCache, PoolMatch
from kvshare.engine.kv_fp8 import kv_format
from kvshare.engine.memory import staging_bytes
from kvshare.kvpool.client import LookupResult, PageRef, PoolClient, PoolError, PoolUnavailable
from kvshare.kvpool.faults import FaultInjection
from kvshare.kvpool.host_memory import HostRegistration
from kvshare.kvpool.keys import Namespace, chain_seed, chunk_keys
from kvshare.kvpool.layout import LAYOUT_VERSION, PageLayout
from kvshare.kvpool.page import HEADER_BYTES, PageHeader
from kvshare.kvpool.plan import plan_load, plan_store, prefetch_copies, storable_chunks
from kvshare.kvpool.transfer import LayerGroups, Prefetch, Transfer, TransferJob
from kvshare.kvpool.transfer_cpu import ThreadTransfer
from kvshare.kvpool.transfer_cuda import CudaTransfer
from kvshare.kvpool.verify import header_matches, mismatched_pages
from kvshare.kvpool.waiting import PrefillSpeed, WaitOptions, wait_budget, worth_waiting
from kvshare.models.loader import LoadedModel
from kvshare.sizes import format_size
from kvshare.spec import DEFAULT_CHUNK_TOKENS

_log = logging.getLogger(__name__)
_POOL_ERRORS = (PoolUnavailable, PoolError)
_STATE_DOMAIN = b"kvshare.kvpool.state.v1"


def state_key(chunk_key: bytes) -> bytes:
    """The key of the recurrent-state snapshot taken right after the chunk `chunk_key`."""
    return xxhash.xxh3_128_digest(_STATE_DOMAIN + chunk_key)


@dataclass(frozen=True)
class ConnectorOptions:
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    register_host_memory: bool = True
    wait: WaitOptions = field(default_factory=WaitOptions)
    # Loads of global layers in groups of layers, so that a step computes its first layers
    # while the last are still copied (transfer.py says why it is off by default); None:
    # every load comes whole.
    layer_groups: LayerGroups | None = None

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be positive, got {self.chunk_tokens}")


@dataclass
class _Match:
    lease: int
    pages: tuple[PageRef, ...]  # KV pages from chunk 0
    local_tokens: int
    state: PageRef | None = None  # hybrid models: the state after the last KV page
    remote_tokens: int = 0  # of the restorable tokens, fetched from another host's pool
    prefetch: Prefetch | None = None  # the load's first copies, started during the match


@dataclass
class _Load:
    request_id: str
    job: TransferJob
    lease: int
    pages: Sequence[PageRef]
    segments: Sequence[int]  # checksummed segments copied per page
    nbytes: int
    resume_chunks: int  # the restored prefix ends after this many chunks
    hit_tokens: int  # tokens restored past the GPU-local prefix
    held: Sequence[int]
    sliding_held: Sequence[int]
    state_job: TransferJob | None = None
    state_page: PageRef | None = None
    remote_tokens: int = 0

    def wait(self) -> None:
        """Until every copy completed; returns at once for an injected broken ordering,
        whose jobs say done without waiting."""
        for job in (self.job, self.state_job):
            if job is not None and not job.done():
                job.wait()

    @property
    def failed(self) -> bool:
        return self.job.failed or (self.state_job is not None and self.state_job.failed)


@dataclass
class _Store:
    job: TransferJob
    pages: Sequence[PageRef]
    parents: Sequence[bytes]
    held: Sequence[int]  # KV blocks held until the copy completed
    payload_bytes: int
    snapshot_slot: int | None = None  # a state snapshot slot pinned until then
    sliding_held: Sequence[int] = ()  # sliding-window blocks held until then


@dataclass
class _Wait:
    """A request waiting for chunks another client is producing."""

    started: float
    budget_s: float
    next_ask: float


@dataclass
class _Request:
    keys: list[bytes] = field(default_factory=list)
    stored_chunks: int = 0  # chunks below this are in the pool or were tried
    match: _Match | None = None
    claimed: int = 0  # keys[:claimed] went to the daemon with a claim
    claimed_states: set[bytes] = field(default_factory=set)  # state keys claimed, not reserved
    wait: _Wait | None = None
    waited: bool = False  # a wait ended: the request does not wait again
    remote_keys: set[bytes] = field(default_factory=set)  # fetched from another host for it
    # A match of it was cancelled (no room for its blocks): its later asks prefetch nothing,
    # since each would fill the staging for nothing while it stays unadmitted.
    cancelled: bool = False


@dataclass(frozen=True)
class _Hint:
    """A prompt head's prefetch, started before its request reached the engine."""

    keys: list[bytes]  # of the head's chunks, from chunk 0
    lease: int  # pins the pages the prefetch reads (0: none)
    prefetch: Prefetch | None


class PoolConnector(KVConnector):
    """`faults` (checks and tests only; None in production) breaks a guarantee on purpose."""

    def __init__(
        self,
        client: PoolClient,
        namespace: Namespace,
        options: ConnectorOptions | None = None,
        faults: FaultInjection | None = None,
    ) -> None:
        self.client = client
        self.faults = faults
        self.namespace = namespace
        self.options = options or ConnectorOptions(chunk_tokens=namespace.chunk_tokens)
        if self.options.chunk_tokens != namespace.chunk_tokens:
            raise ValueError("the namespace and the options disagree on chunk_tokens")
        self.chunk_tokens = namespace.chunk_tokens
        self.counters: Counter[str] = Counter()
        self.speed = PrefillSpeed()
        self._enabled = True
        self._requests: dict[str, _Request] = {}
        self._loads: dict[str, _Load] = {}  # started, not yet finished, by request id
        self._stores: list[_Store] = []
        self._generation = b""
        self._hint: _Hint | None = None  # at most one: the latest prompt head's
        self._lock = threading.Lock()  # guards arena adoption against the remap callback
        self.cache: PagedKVCache | None = None
        self.layout: PageLayout | None = None
        self.transfer: Transfer | None = None
        self.registration: HostRegistration | None = None
        # Why the connection made at bind failed (None: it succeeded). The connector keeps
        # working without the pool and reconnects on later requests; the caller decides
        # how loudly to say so (kvshare.llm).
        self.bind_failure: str | None = None

    @classmethod
    def for_model(
        cls,
        address: str,
        loaded: LoadedModel,
        *,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        cache_salt: str = "",
        faults: FaultInjection | None = None,
        kv_cache_dtype: KVCacheDtype = "auto",
        layer_groups: LayerGroups | None = None,
    ) -> PoolConnector:
        """The connector of `loaded` with an engine whose cache stores kv_cache_dtype
        (EngineConfig.kv_cache_dtype): fp8 and model-dtype caches never share a page."""
        dtype = next(loaded.model.parameters()).dtype
        namespace = Namespace(
            architecture=loaded.config.architecture,
            config_digest=loaded.config.digest(),
            weights_digest=loaded.weights_id,
            kv_dtype=kv_format(dtype, kv_cache_dtype),
            layout_version=LAYOUT_VERSION,
            chunk_tokens=chunk_tokens,
            cache_salt=cache_salt,
        )
        options = ConnectorOptions(chunk_tokens=chunk_tokens, layer_groups=layer_groups)
        return cls(PoolClient(address), namespace, options, faults)

    # ------------------------------------------------------------------ set-up

    def bind(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.layout = PageLayout.of(cache.layout, self.chunk_tokens)
        kv, sliding_kv = cache.layout.kv, cache.layout.sliding_kv
        opts = self.options
        if kv.device.type == "cuda":
            cuda = CudaTransfer(kv, self.layout, self.faults, sliding_kv, opts.layer_groups)
            cuda.warm_up(() if cache.states is None else (cache.states.rows[0].numel(),))
            self.transfer = cuda
            if opts.register_host_memory:
                self.registration = HostRegistration(kv.device)
        else:
            self.transfer = ThreadTransfer(
                kv, self.layout, self.faults, sliding_kv, opts.layer_groups
            )
        self.client.on_remap(self._on_remap)
        try:
            self.client.connect()
            self._adopt_arena()
        except _POOL_ERRORS as exc:
            self.bind_failure = _reason(exc)

    def _adopt_arena(self) -> None:
        """Point the transfer at the client's current arena (after connect or restart)."""
        with self._lock:
            if self.client.generation == self._generation or not self.client.connected:
                return
            arena = self.client.arena
            assert self.transfer is not None
            self.transfer.set_arena(arena.as_tensor(), arena.geometry.slab_bytes)
            if self.registration is not None:
                self.registration.register(arena)
            self._generation = self.client.generation
            self._check_slabs(arena.geometry.slab_count, arena.geometry.slab_bytes)

    def _check_slabs(self, slab_count: int, slab_bytes: int) -> None:
        """A slab holds pages of one size. A hybrid model stores two sizes (KV chunks and
        recurrent states) and a restore needs both; in a pool of one slab each store evicts
        the other size's pages, so nothing would ever be restored, silently."""
        if self.cache is None or self.cache.states is None or slab_count >= 2:
            return
        _log.warning(
            "the pool at %s has %d slab of %s, and this hybrid model stores pages of two "
            "sizes (KV chunks and recurrent states) that then evict each other: no restore "
            "will find both. Give the pool at least two slabs (kvshare up: --pool-size of 2 "
            "GiB or more; kvshare pool: a --slab-size of half the --size or less)",
            self.client.socket_path,
            slab_count,
            format_size(slab_bytes),
        )

    def _on_remap(self, arena: object) -> None:
        """The daemon restarted: finish copies over the old arena before letting it go."""
        assert self.transfer is not None
        self.transfer.synchronize()
        if self.registration is not None:
            self.registration.unregister()
        self._generation = b""

    def device_bytes(self, kv_bytes_per_token: int) -> int:
        return staging_bytes(kv_bytes_per_token * self.chunk_tokens)

    @property
    def enabled(self) -> bool:
        return self._enabled

    def set_enabled(self, enabled: bool) -> None:
        self._enabled = enabled

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        if self.registration is not None:
            out["registered_bytes"] = self.registration.registered_bytes
        return out

    def pool_stats(self) -> dict[str, object] | None:
        try:
            return self.client.stats()
        except _POOL_ERRORS:
            return None  # down or restarting: reported as absent, never an error

    def clear_pool(self) -> int:
        try:
            return self.client.clear()
        except _POOL_ERRORS as exc:
            raise KVStoreUnavailable(str(exc)) from None

    def _usable(self) -> bool:
        return self._enabled and self.transfer is not None

    # ------------------------------------------------------------------ lookup and load

    def _keys(
        self,
        req: _Request,
        token_ids: Sequence[int] | np.ndarray,
        num_chunks: int,
        cache_salt: str | None,
    ) -> list[bytes]:
        known, chunk = len(req.keys), self.chunk_tokens
        if known < num_chunks:
            req.keys += chunk_keys(
                self.namespace,
                token_ids[known * chunk : num_chunks * chunk],
                cache_salt,
                previous=req.keys[-1] if known else None,
            )
        return req.keys[:num_chunks]

    def match(
        self,
        request_id: str,
        token_ids: Sequence[int] | np.ndarray,
        num_local_tokens: int,
        *,
        cache_salt: str | None = None,
        snapshot_tokens: Sequence[int] = (),
    ) -> PoolMatch:
        req = self._requests.setdefault(request_id, _Request())
        usable_chunks = (len(token_ids) - 1) // self.chunk_tokens
        if not self._usable() or usable_chunks * self.chunk_tokens <= num_local_tokens:
            return PoolMatch(0)
        now = time.monotonic()
        if req.wait is not None and now < req.wait.next_ask:
            return PoolMatch(0, wait=True)
        head_lease, prefetch = self._prefetch_head(
            req, token_ids, num_local_tokens, usable_chunks, cache_salt
        )
        keys = self._keys(req, token_ids, usable_chunks, cache_salt)
        states = self.cache.states if self.cache is not None else None
        try:
            if states is None:
                result = self.client.lookup(
                    keys, page=self._page_shape(), claim=True, release=head_lease
                )
            else:
                snapshots = {
                    state_key(keys[b // self.chunk_tokens - 1])
                    for b in snapshot_tokens
                    if num_local_tokens < b <= len(keys) * self.chunk_tokens
                    and b % self.chunk_tokens == 0
                }
                result = self.client.lookup(
                    keys,
                    [(i, state_key(k)) for i, k in enumerate(keys)],
                    claim=True,
                    claim_states=sorted(snapshots),
                    release=head_lease,
                )
                req.claimed_states |= snapshots
            req.claimed = max(req.claimed, len(keys))
            self._adopt_arena()
        except _POOL_ERRORS as exc:
            self._count_error("lookup", exc)
            self._end_wait(req, now, gave_up=True)
            if head_lease:  # still held unless the link broke (the daemon dropped it then)
                with contextlib.suppress(*_POOL_ERRORS):
                    self.client.release(head_lease)
            return PoolMatch(0)
        self.counters["lookups"] += 1
        pages, state = result.pages, None
        if states is not None and pages:
            pages, state = pages[:-1], pages[-1]  # the KV run, then its end's state page
        if self._waits(req, result, len(pages), num_local_tokens, now):
            self._release(result.lease)
            return PoolMatch(0, wait=True)
        self._end_wait(req, now, gave_up=result.in_progress > 0)
        hit_tokens = len(pages) * self.chunk_tokens
        wanted = usable_chunks * self.chunk_tokens - num_local_tokens
        if hit_tokens <= num_local_tokens:
            self._release(result.lease)
            self.counters["miss_tokens"] += wanted
            return PoolMatch(0)
        pool_tokens = hit_tokens - num_local_tokens
        # The remote pages are the run's tail; a later lookup of the same request (after
        # a cancel) finds them local, so the request remembers which they were.
        req.remote_keys.update(p.key for p in pages[len(pages) - result.remote_pages :])
        local_chunks = num_local_tokens // self.chunk_tokens
        remote_tokens = self.chunk_tokens * sum(
            p.key in req.remote_keys for p in pages[local_chunks:]
        )
        req.match = _Match(result.lease, pages, num_local_tokens, state, remote_tokens, prefetch)
        self.counters["miss_tokens"] += wanted - pool_tokens
        return PoolMatch(pool_tokens, remote_tokens=remote_tokens)

    def hint_tokens(self) -> int:
        ahead = self.transfer.prefetch_pages() if self.transfer is not None else 0
        return ahead * self.chunk_tokens

    def hint(self, token_ids: np.ndarray, cache_salt: str | None = None) -> bool:
        self.drop_hint()
        wanted = self.hint_tokens()
        if not self._usable() or not wanted or len(token_ids) < wanted:
            return False
        keys = chunk_keys(self.namespace, token_ids[:wanted], cache_salt)
        lease, prefetch = self._start_prefetch(keys)
        if lease:
            self._hint = _Hint(keys, lease, prefetch)
            self.counters["hints"] += 1
        return prefetch is not None

    def drop_hint(self) -> None:
        hint, self._hint = self._hint, None
        if hint is not None:
            self._release(hint.lease)

    @property
    def holds_hint(self) -> bool:
        return self._hint is not None

    def _prefetch_head(
        self,
        req: _Request,
        token_ids: Sequence[int] | np.ndarray,
        num_local_tokens: int,
        usable_chunks: int,
        cache_salt: str | None,
    ) -> tuple[int, Prefetch | None]:
        """Start the copies of a long restore's first pages before the full lookup is
        asked and the load planned: the keys of the chunks past the local prefix that a
        prefetch can use, looked up alone (a short round trip, pinning what it finds), and
        their pages handed to the transfer. The host's work before the rest of the copies
        (the other keys, the full lookup, the plan) then runs beside these. Returns the
        head lookup's lease (0: none), which the full lookup releases, and the prefetch.

        A hint whose keys are exactly those (its prompt head is this request's, nothing of
        it local) already did all that: it is taken as this request's. Any other hint is
        dropped, so that none outlives the next match."""
        assert self.transfer is not None and self.layout is not None
        hint, self._hint = self._hint, None
        first = num_local_tokens // self.chunk_tokens
        ahead = self.transfer.prefetch_pages(usable_chunks - first)
        # A request asking again while it waits for chunks produced elsewhere likely waits
        # on, and its prefetch would take the PCIe link from the copies of others.
        keys: list[bytes] = []
        if ahead and req.wait is None and not req.cancelled:
            keys = self._keys(req, token_ids, first + ahead, cache_salt)[first:]
        if hint is not None:
            if keys and hint.keys == keys:
                self.counters["hints_taken"] += 1
                return hint.lease, hint.prefetch
            self._release(hint.lease)
        return self._start_prefetch(keys) if keys else (0, None)

    def _start_prefetch(self, keys: list[bytes]) -> tuple[int, Prefetch | None]:
        """Look up `keys` alone (a head lookup: pins, counts in no statistic) and hand the
        pages found to the transfer's prefetch; the lease (0: none) and the prefetch."""
        assert self.transfer is not None and self.layout is not None
        try:
            result = self.client.lookup(keys, head=True)
            self._adopt_arena()
        except _POOL_ERRORS:
            return 0, None  # the full lookup meets the same trouble, and counts it
        if not result.pages:
            return result.lease, None
        try:
            prefetch = self.transfer.prefetch(prefetch_copies(result.pages, self.layout))
        except Exception:  # a broken copy costs the prefetch, never the engine
            _log.exception("pool prefetch failed to start")
            return result.lease, None
        self.counters["prefetches"] += prefetch is not None
        return result.lease, prefetch

    def _page_shape(self) -> dict[str, object] | None:
        """What a daemon with a remote tier needs to fetch this model's pages."""
        if self.layout is None:
            return None
        payload = self.layout.payload_bytes
        return {
            "payload_bytes": payload,
            "segment_ends": [end for _, end in self.layout.segments(payload)],
        }

    def _waits(
        self,
        req: _Request,
        result: LookupResult,
        num_kv_pages: int,
        num_local_tokens: int,
        now: float,
    ) -> bool:
        """Whether req waits (again) for the chunks the lookup found in progress elsewhere
        past its `num_kv_pages` committed ones: only those past its local prefix count
        (waiting.py decides)."""
        if req.waited:
            return False
        committed = num_kv_pages * self.chunk_tokens
        end = committed + result.in_progress * self.chunk_tokens
        pending = end - max(committed, num_local_tokens)
        options = self.options.wait
        if req.wait is None:
            budget = wait_budget(pending, self.speed, options)
            if not worth_waiting(pending, result.idle_s, 0.0, budget, options):
                return False
            req.wait = _Wait(now, budget, now)
            self.counters["wait_requests"] += 1
        elif not worth_waiting(
            pending, result.idle_s, now - req.wait.started, req.wait.budget_s, options
        ):
            return False
        req.wait.next_ask = now + options.recheck_s
        return True

    def _end_wait(self, req: _Request, now: float, gave_up: bool) -> None:
        """The request stops waiting: counted, and it never waits again."""
        if req.wait is None:
            return
        self.counters["wait_ms"] += round((now - req.wait.started) * 1000)
        if gave_up:  # the producer stalled, the budget ran out, or the pool failed
            self.counters["wait_gave_up"] += 1
        req.wait = None
        req.waited = True

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        self.speed.observe(num_tokens, seconds)

    def cancel(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None and req.match is not None:
            self._release(req.match.lease)
            req.match = None
            req.cancelled = True

    def load(
        self,
        request_id: str,
        block_table: Sequence[int],
        state_slot: int | None = None,
        sliding_table: Sequence[int] = (),
    ) -> bool:
        assert self.cache is not None and self.layout is not None and self.transfer is not None
        req = self._requests[request_id]
        match, req.match = req.match, None
        assert match is not None, "load() without a match"
        plan = plan_load(
            match.pages,
            match.local_tokens,
            block_table,
            self.layout,
            self._sliding_entries(sliding_table),
        )
        self.cache.blocks.acquire(plan.held)
        self._sliding_refs(plan.sliding_held, acquire=True)
        pending = _Load(
            request_id,
            None,
            match.lease,
            plan.pages,
            plan.segments,
            plan.nbytes,
            plan.resume_chunks,
            plan.hit_tokens,
            plan.held,
            plan.sliding_held,
            remote_tokens=min(match.remote_tokens, plan.hit_tokens),
        )
        try:
            # The state first: the step's first linear-attention layer needs it, while the
            # KV of its last attention layers may still be on its way (LayerGroups).
            if match.state is not None and not (self.faults and self.faults.skip_state_restore):
                assert self.cache.states is not None and state_slot is not None
                pending.state_page = match.state
                pending.nbytes += match.state.payload_bytes
                pending.state_job = self.transfer.load_raw(
                    match.state.offset + HEADER_BYTES,
                    self.cache.states.rows[state_slot],
                    match.state.key,
                )
            pending.job = self.transfer.load(list(plan.copies), match.prefetch)
        except Exception:  # a broken copy is a miss, never an engine crash
            _log.exception("pool load failed to start")
            # Copies it issued before failing may still run, and no job tracks them: they
            # must end before the blocks are recomputed (or released) and the lease goes.
            self.transfer.synchronize()
            self._end_load(pending, ok=False)
            return False
        for job in (pending.job, pending.state_job):
            if job is not None:
                self.transfer.consume(job, self.cache.fences)
        self._loads[request_id] = pending
        return True

    def finish_load(self, request_id: str) -> bool:
        load = self._loads.pop(request_id, None)
        if load is None:
            return False
        bad_headers = self._bad_headers(load)
        load.wait()
        self.counters["header_failures"] += len(bad_headers)
        corrupt = {p.key for p in bad_headers}
        if not load.failed:  # a failed copy's checksums say nothing about the pages
            corrupt |= {p.key for p in self._checksum_mismatches(load)}
        keep_corrupt = self.faults is not None and self.faults.skip_checksums
        if corrupt and not keep_corrupt:
            self._invalidate(load.lease, sorted(corrupt))
        ok = not load.failed and (not corrupt or keep_corrupt)
        final = self._end_load(load, ok)
        return ok if self.faults is not None and self.faults.keep_lost_lease_restores else final

    def _bad_headers(self, load: _Load) -> list[PageRef]:
        """The load's pages whose slot headers do not name them. Read after the step that
        needs the pages was issued and before the wait for their copies (the lease keeps
        the slots from changing meanwhile): at 1,023 pages the reads take 5-10 ms of the
        host, which the step's first kernel would otherwise wait for."""
        assert self.layout is not None
        bad = [p for p in load.pages if not self._header_ok(p, self.layout.payload_bytes)]
        state = load.state_page
        if state is not None and not self._header_ok(state, state.payload_bytes):
            bad.append(state)
        return bad

    def _header_ok(self, page: PageRef, payload_bytes: int) -> bool:
        """The slot still holds the page the daemon says: key, size and checksum agree."""
        try:
            header = bytes(self.client.arena.view(page.offset, HEADER_BYTES))
        except (PoolUnavailable, ValueError):
            return False
        return header_matches(header, page, payload_bytes)

    def _end_load(self, load: _Load, ok: bool) -> bool:
        """Release the load's lease and settle its blocks; returns the final verdict: True
        only when the restore was good AND its lease held until now."""
        assert self.cache is not None
        released = self._release(load.lease)
        ok = ok and released
        if ok:
            self.counters["hit_tokens"] += load.hit_tokens
            self.counters["remote_hit_tokens"] += load.remote_tokens
            self.counters["loaded_pages"] += len(load.pages)
            self.counters["loaded_bytes"] += load.nbytes
            req = self._requests.get(load.request_id)
            if req is not None:  # the restored chunks are in the pool already
                req.stored_chunks = max(req.stored_chunks, load.resume_chunks)
        else:
            self.counters["load_failures"] += 1
        self.cache.blocks.release(load.held)
        self._sliding_refs(load.sliding_held, acquire=False)
        return ok

    def _sliding_entries(self, sliding_table: Sequence[int]) -> list[int | None]:
        """A sequence's sliding table for plan.py: None where it holds no sliding block."""
        sliding = self.cache.sliding if self.cache is not None else None
        if sliding is None:
            return []
        return [None if b == sliding.null else b for b in sliding_table]

    def _sliding_refs(self, blocks: Sequence[int], acquire: bool) -> None:
        """Take or drop the connector's references on sliding-window blocks it copies."""
        sliding = self.cache.sliding if self.cache is not None else None
        if sliding is None or not blocks:
            return
        if acquire:
            sliding.blocks.acquire(blocks)
        else:
            sliding.blocks.release(blocks)

    def _release(self, lease: int) -> bool:
        """Unpin a lease; False (logged and counted) when it was lost before this call."""
        if not lease:
            return True
        try:
            released = self.client.release(lease)
        except _POOL_ERRORS as exc:
            self._count_error("release", exc)
            return False
        if not released:
            self.counters["lost_leases"] += 1
            self._count_error(
                "release",
                PoolUnavailable(
                    f"lease {lease} was lost before its release (daemon restarted or the link broke)"
                ),
            )
        return released

    def _invalidate(self, lease: int, keys: list[bytes]) -> None:
        """Have the daemon drop pages found corrupt, so that no reader meets them again."""
        try:
            self.counters["invalidated_pages"] += self.client.invalidate(lease, keys)
        except _POOL_ERRORS as exc:
            self._count_error("invalidate", exc)

    # ------------------------------------------------------------------ store

    def store(
        self,
        request_id: str,
        token_ids: Sequence[int],
        block_table: Sequence[int],
        num_computed_tokens: int,
        ready: threading.Event | None = None,
        *,
        cache_salt: str | None = None,
        sliding_table: Sequence[int] = (),
    ) -> None:
        req = self._requests.setdefault(request_id, _Request())
        full = num_computed_tokens // self.chunk_tokens
        if not self._usable() or full <= req.stored_chunks:
            return
        assert self.cache is not None and self.layout is not None and self.transfer is not None
        keys = self._keys(req, token_ids, full, cache_salt)
        sliding = self._sliding_entries(sliding_table)
        chunks = storable_chunks(req.stored_chunks, full, self.layout, sliding)
        req.stored_chunks = full
        if not chunks:
            return
        try:
            reservation = self.client.reserve(
                [keys[j] for j in chunks], self.layout.payload_bytes, extends=keys[: chunks[0]]
            )
            self._adopt_arena()
        except _POOL_ERRORS as exc:
            self._count_error("reserve", exc)
            return
        self.counters["store_dedup_pages"] += len(reservation.present)
        self.counters["store_dropped_pages"] += reservation.dropped
        plan = plan_store(
            chunks,
            keys,
            {page.key: page for page in reservation.pages},
            block_table,
            self.layout,
            chain_seed(self.namespace, cache_salt),
            sliding,
        )
        if not plan.copies:
            return
        self.cache.blocks.acquire(plan.held)
        self._sliding_refs(plan.sliding_held, acquire=True)
        try:
            job = self.transfer.store(list(plan.copies), ready)
        except Exception:  # a failed store is skipped, never an engine crash
            _log.exception("pool store failed to start")
            self.cache.blocks.release(plan.held)
            self._sliding_refs(plan.sliding_held, acquire=False)
            self._abort([p.key for p in plan.pages])
            return
        self._stores.append(
            _Store(
                job,
                plan.pages,
                plan.parents,
                plan.held,
                self.layout.payload_bytes,
                sliding_held=plan.sliding_held,
            )
        )

    def store_state(
        self,
        request_id: str,
        token_ids: Sequence[int],
        boundary: int,
        snapshot_slot: int,
        *,
        cache_salt: str | None = None,
    ) -> None:
        if not self._usable() or boundary % self.chunk_tokens or boundary == 0:
            return
        assert (
            self.cache is not None and self.cache.states is not None and self.transfer is not None
        )
        req = self._requests.setdefault(request_id, _Request())
        chunk = self._keys(req, token_ids, boundary // self.chunk_tokens, cache_salt)[-1]
        row = self.cache.states.rows[snapshot_slot]
        req.claimed_states.discard(state_key(chunk))  # reserve ends the claim
        try:
            reservation = self.client.reserve([state_key(chunk)], row.numel())
            self._adopt_arena()
        except _POOL_ERRORS as exc:
            self._count_error("reserve", exc)
            return
        if not reservation.pages:
            self.counters["store_dropped_pages"] += reservation.dropped
            return
        page = reservation.pages[0]
        self.cache.states.pin(snapshot_slot)  # immutable until the copy completed
        try:
            job = self.transfer.store_raw(page.offset + HEADER_BYTES, row, page.key)
        except Exception:  # a failed store is skipped, never an engine crash
            _log.exception("pool state store failed to start")
            self.cache.states.unpin(snapshot_slot)
            self._abort([page.key])
            return
        self._stores.append(_Store(job, [page], [chunk], [], row.numel(), snapshot_slot))
        self.counters["stored_state_pages"] += 1

    def _finish_store(self, store: _Store) -> None:
        assert self.cache is not None and self.layout is not None
        keys = [p.key for p in store.pages]
        if store.job.failed:
            self._abort(keys)
        else:
            checksums = [row.tobytes() for row in store.job.checksum_bytes()]
            try:
                for page, parent, checksum in zip(store.pages, store.parents, checksums):
                    header = PageHeader(
                        LAYOUT_VERSION, page.key, parent, store.payload_bytes, checksum
                    )
                    self.client.arena.view(page.offset, HEADER_BYTES)[:] = header.pack()
                self.client.commit(keys, checksums, [p.offset for p in store.pages])
                self.counters["stored_pages"] += len(keys)
                self.counters["stored_bytes"] += len(keys) * store.payload_bytes
            except _POOL_ERRORS as exc:
                self._count_error("commit", exc)
        self.cache.blocks.release(store.held)
        self._sliding_refs(store.sliding_held, acquire=False)
        if store.snapshot_slot is not None and self.cache.states is not None:
            self.cache.states.unpin(store.snapshot_slot)

    def _abort(self, keys: list[bytes]) -> None:
        try:
            self.client.abort(keys)
        except _POOL_ERRORS as exc:
            self._count_error("abort", exc)

    # ------------------------------------------------------------------ progress

    def poll(self) -> None:
        for store in [x for x in self._stores if x.job.done()]:
            self._stores.remove(store)
            self._finish_store(store)

    def _checksum_mismatches(self, load: _Load) -> list[PageRef]:
        """The pages whose copied bytes disagree with the checksum the daemon holds."""
        checks = [(load.pages, load.job, load.segments)]
        if load.state_job is not None and load.state_page is not None:
            checks.append(([load.state_page], load.state_job, [1]))
        bad = [
            pages[i]
            for pages, job, segments in checks
            for i in mismatched_pages(pages, job.checksum_bytes(), segments)
        ]
        self.counters["checksum_failures"] += len(bad)
        return bad

    def forget(self, request_id: str) -> None:
        load = self._loads.pop(request_id, None)
        if load is not None:  # its blocks are being let go: the copy must be over first
            load.wait()
            self._end_load(load, ok=False)
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        if req.match is not None:
            self._release(req.match.lease)
        self._end_wait(req, time.monotonic(), gave_up=False)
        unstored = req.keys[: req.claimed] if req.claimed > req.stored_chunks else []
        self._unclaim([*unstored, *sorted(req.claimed_states)])

    def _unclaim(self, keys: list[bytes]) -> None:
        """Claims this replica will not honour: whoever waits for them stops at once.
        (Chunks that reached `reserve` lost their claim there.)"""
        if not keys:
            return
        try:
            self.client.unclaim(keys)
        except _POOL_ERRORS as exc:
            self._count_error("unclaim", exc)

    def wait_idle(self) -> None:
        """Block until every store in flight has completed and been committed (tests,
        shutdown); loads are finished by their requests."""
        if self.transfer is not None:
            self.transfer.synchronize()
        self.poll()

    def close(self) -> None:
        """Finish copies in flight, unregister host memory, disconnect."""
        self.wait_idle()
        if self.registration is not None:
            self.registration.unregister()
        self.client.close()

    def _count_error(self, op: str, exc: Exception) -> None:
        self.counters["pool_errors"] += 1
        _log.warning("pool %s failed: %s", op, exc)


def _reason(exc: Exception) -> str:
    """The root cause of a pool failure in a few words ("No such file or directory")."""
    cause = exc.__cause__
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror
    return str(cause or exc)
