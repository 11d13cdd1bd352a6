"""The engine's only view of an external KV store (the shared pool): `KVConnector`.

Ordering contract between engine and connector (docs/architecture.md, "Ordering rules"):
- `match` reports how many tokens beyond the GPU-local prefix the store can restore and
  keeps them pinned until `load` or `cancel`; or asks the engine to wait (`PoolMatch.wait`):
  then nothing is pinned, the request stays unadmitted and `match` is called again later.
- `load` writes only into the blocks it is given for the matched range, which the engine
  allocated fresh for this request (never blocks shared with another request). Work the
  engine issues on the current (compute) stream after `load` returns sees the restored
  bytes of a cache slot once the engine has called `cache.fences.before(slot)` (the
  model's layers do, each right before it touches its slot; the runner drains the rest
  at the step's end): a load may bring the layers in groups, so that the first layers
  compute while the last are still copied. The bytes are verified only by
  `finish_load`: the engine keeps nothing computed from them (tokens, KV, registrations,
  stores) until it returned True.
- `store` copies full chunks whose KV was produced by work already issued on the current
  (compute) stream; the connector orders its copies after that work itself.
- The connector holds its own references on every block it copies from or into until
  the copy has completed, so the engine may free or preempt a request at any time.
- Connector failures (store down, corrupt page) are never raised to the engine: a match
  of 0 tokens, a load that reports False (recompute), a store that is skipped.
- `cache_salt` (None or a non-empty string, the same in every call for one request) seeds
  the request's keys: requests with different salts, or with and without one, share no
  stored chunk; no salt keys exactly as the store's own namespace does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvshare.engine.block_manager import BlockManager
from kvshare.engine.config import KVCacheDtype
from kvshare.engine.kv_fp8 import packed_head_bytes
from kvshare.engine.recurrent_state import RecurrentStates
from kvshare.engine.sliding import SlidingBlocks
from kvshare.models.config import ModelConfig


@dataclass(frozen=True)
class KVCacheLayout:
    """The engine's paged KV cache: the global (full-attention) layers in `kv` [global
    slots, 2, num_blocks, block_size, Hkv, D], indexed by a sequence's block table, and the
    sliding-window layers in `sliding_kv` [sliding slots, 2, num_sliding_blocks, ...]
    (None without such layers), indexed by its sliding table, which holds real blocks
    only for the window (engine.sliding). Each tensor's last block is outside its block
    manager: graph padding rows write there, and sliding-table entries out of the window
    point there (masked, so finite garbage is harmless).

    Both tensors are in the model's dtype, or with kv_cache_dtype "fp8" uint8 with D + 4
    bytes per token and KV head (D e4m3 values and a float32 scale, each block laid out as
    its values then its scales: kv_fp8.PackedBlocks): bytes per token halve, and
    everything that copies blocks or pages copies the scales with them.

    Cache slots are numbered global layers first, then sliding-window layers, so a page's
    global part is one contiguous prefix of it. `layer_slot[i]` is the slot of model layer i.
    """

    kv: torch.Tensor
    block_size: int
    layer_slot: tuple[int, ...]
    num_global_slots: int
    sliding_window: int | None
    sliding_kv: torch.Tensor | None = None
    kv_cache_dtype: KVCacheDtype = "auto"

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_sliding_blocks: int | None = None,
        *,
        kv_cache_dtype: KVCacheDtype = "auto",
    ) -> KVCacheLayout:
        """One slot per attention layer (linear-attention layers keep state, not KV);
        `num_sliding_blocks` (default num_blocks) sizes the sliding-window layers' tensor."""
        global_layers = [i for i, k in enumerate(config.layer_kinds) if k == "full"]
        sliding_layers = [i for i, k in enumerate(config.layer_kinds) if k == "sliding"]
        slot_of = {layer: slot for slot, layer in enumerate(global_layers + sliding_layers)}

        # Zero-filled: blocks a window never reads may be left unwritten by a pool restore,
        # and masked garbage must stay finite (0 x NaN is NaN in the value product).
        row, stored = config.head_dim, dtype
        if kv_cache_dtype == "fp8":
            row, stored = packed_head_bytes(config.head_dim), torch.uint8

        def cache(num_slots: int, blocks: int) -> torch.Tensor:
            shape = (num_slots, 2, blocks, block_size, config.num_kv_heads, row)
            return torch.zeros(shape, dtype=stored, device=device)

        sliding_blocks = num_blocks if num_sliding_blocks is None else num_sliding_blocks
        return cls(
            kv=cache(len(global_layers), num_blocks),
            block_size=block_size,
            layer_slot=tuple(slot_of.get(i, -1) for i in range(config.num_layers)),
            num_global_slots=len(global_layers),
            sliding_window=config.sliding_window,
            sliding_kv=cache(len(sliding_layers), sliding_blocks) if sliding_layers else None,
            kv_cache_dtype=kv_cache_dtype,
        )

    @property
    def num_slots(self) -> int:
        sliding = 0 if self.sliding_kv is None else self.sliding_kv.shape[0]
        return self.num_global_slots + sliding

    @property
    def bytes_per_token_per_slot(self) -> int:
        return 2 * self.kv.shape[4] * self.kv.shape[5] * self.kv.element_size()

    def slot_cache(self, slot: int) -> tuple[torch.Tensor, bool]:
        """Cache slot `slot` as [2, blocks, block_size, Hkv, D], and whether it slides."""
        if slot < self.num_global_slots:
            return self.kv[slot], False
        assert self.sliding_kv is not None
        return self.sliding_kv[slot - self.num_global_slots], True


class SlotFences:
    """Waits that loads still owe the compute side, per range of cache slots.

    A connector adds `wait` for slots [first, stop) instead of ordering the whole step
    after its load; `before(slot)` runs (and forgets) every pending wait covering `slot`,
    `drain()` all of them. A wait makes the current stream (CUDA) or the calling thread
    (CPU) wait for the copies of its slots. Invariant: the compute side reads or writes a
    cache slot only after `before(slot)` or `drain()` since the last load was started,
    so a slot is never touched while a copy into it may still run. Running a wait twice
    is harmless; forgetting one is the bug the byte checks catch (fault "load_slots").
    """

    def __init__(self) -> None:
        self._pending: list[tuple[int, int, Callable[[], None]]] = []

    def add(self, first: int, stop: int, wait: Callable[[], None]) -> None:
        self._pending.append((first, stop, wait))

    def before(self, slot: int) -> None:
        if not self._pending:
            return
        due = [p for p in self._pending if p[0] <= slot < p[1]]
        if due:
            self._pending = [p for p in self._pending if not p[0] <= slot < p[1]]
            for _, _, wait in due:
                wait()

    def drain(self) -> None:
        pending, self._pending = self._pending, []
        for _, _, wait in pending:
            wait()

    def __len__(self) -> int:
        return len(self._pending)


@dataclass
class PagedKVCache:
    layout: KVCacheLayout
    blocks: BlockManager
    states: RecurrentStates | None = None  # hybrid models: per-sequence linear-attention state
    sliding: SlidingBlocks | None = None  # sliding-window layers: their blocks of the window
    # Shared with the model runner: where the step waits for a load's slots (see SlotFences).
    fences: SlotFences = field(default_factory=SlotFences)


@dataclass(frozen=True)
class PoolMatch:
    """`num_tokens` past the local prefix can be restored; the range ends on a chunk boundary.

    `wait`: chunks past that range are being produced elsewhere and the connector judges
    waiting for them cheaper than computing them; nothing is pinned (num_tokens is 0) and
    the engine should leave the request unadmitted and ask again at a later step.
    `remote_tokens`: how many of num_tokens the store fetched from another host for this
    match."""

    num_tokens: int = 0
    wait: bool = field(default=False, kw_only=True)
    remote_tokens: int = field(default=0, kw_only=True)


class KVStoreUnavailable(Exception):
    """An admin call (`clear_pool`) could not reach the connector's store."""


class KVConnector(ABC):
    """The methods above `set_enabled` are the engine's; `device_bytes` is the engine's at
    start; the hint methods, `wait_idle`, `close` and the pool admin calls are the serving
    layer's (the hints through the engine), with defaults for a connector that has no
    separate store (nothing to start ahead, no device buffers, nothing in flight, nothing to
    clear, no store statistics)."""

    chunk_tokens: int

    @abstractmethod
    def bind(self, cache: PagedKVCache) -> None:
        """Attach to the engine's cache; called once before any other method."""

    @abstractmethod
    def match(
        self,
        request_id: str,
        token_ids: Sequence[int] | np.ndarray,
        num_local_tokens: int,
        *,
        cache_salt: str | None = None,
        snapshot_tokens: Sequence[int] = (),
    ) -> PoolMatch:
        """Pin the longest restorable run past num_local_tokens (never the last token).
        The engine passes token_ids as an int32 array and, for hybrid models, the token
        counts at which the request will snapshot its state if it computes up to them (the
        connector may announce those snapshots to other replicas, which then wait for them)."""

    @abstractmethod
    def load(
        self,
        request_id: str,
        block_table: Sequence[int],
        state_slot: int | None = None,
        sliding_table: Sequence[int] = (),
    ) -> bool:
        """Start restoring the matched range into block_table (the request's whole table),
        its sliding-window layers into the real entries of sliding_table (sliding-window
        models: every real entry in the range is filled) and, for hybrid models, the state
        at the range's end into state_slot; order the current stream after the copies.
        False: nothing was started (compute the range)."""

    @abstractmethod
    def finish_load(self, request_id: str) -> bool:
        """Wait for the request's load, verify it and let go of its pool pages. True: the
        restored range is exact and the pages were held until now; False: either is not
        (e.g. the pool lost the pin meanwhile), and what was computed from it is void."""

    @abstractmethod
    def cancel(self, request_id: str) -> None:
        """Drop a match that will not be loaded."""

    @abstractmethod
    def store(
        self,
        request_id: str,
        token_ids: Sequence[int],
        block_table: Sequence[int],
        num_computed_tokens: int,
        *,
        cache_salt: str | None = None,
        sliding_table: Sequence[int] = (),
    ) -> None:
        """Store the full chunks of token_ids[:num_computed_tokens] not stored yet (of a
        sliding-window model, those whose sliding_table entries are all real)."""

    @abstractmethod
    def store_state(
        self,
        request_id: str,
        token_ids: Sequence[int],
        boundary: int,
        snapshot_slot: int,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Store the recurrent-state snapshot (an immutable snapshot slot) taken after
        token_ids[:boundary], a chunk boundary (hybrid models)."""

    @abstractmethod
    def poll(self) -> None:
        """Commit the stores whose copies completed (never blocks)."""

    @abstractmethod
    def forget(self, request_id: str) -> None:
        """The request left the engine: end its load if one is unfinished (unverified:
        nothing of it is kept); its stores in flight still complete normally."""

    @abstractmethod
    def set_enabled(self, enabled: bool) -> None:
        """Switch lookups and stores on or off at run time (benchmark blocks)."""

    @property
    @abstractmethod
    def enabled(self) -> bool: ...

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters: hit/miss tokens, bytes loaded/stored, checksum failures, skipped stores."""

    def device_bytes(self, kv_bytes_per_token: int) -> int:
        """Device memory `bind` will allocate for a CUDA cache of `kv_bytes_per_token` (every
        attention layer): the engine counts it in its memory budget before allocating."""
        return 0  # no device buffers by default

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """The engine computed num_tokens prompt tokens in one step of `seconds`: the
        connector's measure of this engine's prefill speed (it decides waits with it)."""
        return None  # no waits to decide by default

    def hint_tokens(self) -> int:
        """How many of a prompt's first tokens `hint` needs (0: hints do nothing)."""
        return 0

    def hint(self, token_ids: np.ndarray, cache_salt: str | None = None) -> bool:
        """A prompt's first tokens (hint_tokens of them or more), known before the rest of
        its request has been read: start what the request's match would start first (its
        restore's first copies), so that it runs while the request is read. The next match
        takes it when its restore begins with these tokens' chunks; that match, any other,
        the next hint or drop_hint lets go of it. True: copies were started."""
        return False  # nothing to start ahead by default

    def drop_hint(self) -> None:
        """Let go of the hint no match took (its request never came)."""
        return None

    @property
    def holds_hint(self) -> bool:
        """A hint is held: no match took or dropped it yet."""
        return False

    def wait_idle(self) -> None:
        """Block until every store in flight has completed and been committed (an idle
        engine, tests, shutdown); loads are finished by their requests."""
        return None  # nothing in flight by default

    def close(self) -> None:
        """Finish copies in flight and let go of the store (replica shutdown)."""
        return None  # nothing to let go of by default

    def pool_stats(self) -> dict[str, object] | None:
        """The store's own statistics (shared by every replica); None when there is no
        separate store or it cannot be reached right now (never raises)."""
        return None

    def clear_pool(self) -> int:
        """Drop every page of the store; returns how many. KVStoreUnavailable when the
        store cannot be reached."""
        return 0
