"""A connector over a private paged KV cache with a model's layout, and no model.

The validation checks drive the real pool connector and daemon with deterministic KV
patterns instead of a model's activations, so every byte has a known expected value.
The sliding-window layers' tensor is as large as the global one and a block's sliding
block has the same id, so a block's every slot reads and writes as one
([slots, K|V, blocks, ...], global slots first, as in a page).
"""

from __future__ import annotations

import torch

from kvshare.engine.block_manager import BlockManager
from kvshare.engine.connector import KVCacheLayout, PagedKVCache
from kvshare.engine.sliding import SlidingBlocks
from kvshare.kvpool.client import PoolClient
from kvshare.kvpool.connector import ConnectorOptions, PoolConnector
from kvshare.kvpool.faults import FaultInjection
from kvshare.kvpool.keys import Namespace, chunk_keys
from kvshare.kvpool.layout import LAYOUT_VERSION
from kvshare.models.presets import shape_preset
from kvshare.models.random_weights import fill_uniform_


class ConnectorHarness:
    def __init__(
        self,
        pool: str,
        shape: str,
        device: str,
        dtype: torch.dtype,
        num_blocks: int,
        run_id: str,
        options: ConnectorOptions,
        block_size: int = 16,
        *,
        faults: FaultInjection | None = None,
    ) -> None:
        self.model = shape_preset(shape)
        self.device = torch.device(device)
        self.chunk_tokens = options.chunk_tokens
        layout = KVCacheLayout.allocate(
            self.model, num_blocks, block_size, dtype, self.device, num_blocks + 1
        )
        sliding = None
        if self.model.sliding_window is not None:
            sliding = SlidingBlocks(
                num_blocks, block_size, self.model.sliding_window, options.chunk_tokens
            )
        self.cache = PagedKVCache(layout, BlockManager(num_blocks, block_size), sliding=sliding)
        namespace = Namespace(
            architecture=self.model.architecture,
            config_digest=self.model.digest(),
            weights_digest=f"validate:{run_id}",
            kv_dtype=str(dtype),
            layout_version=LAYOUT_VERSION,
            chunk_tokens=options.chunk_tokens,
        )
        self.connector = PoolConnector(PoolClient(pool), namespace, options, faults)
        self.connector.bind(self.cache)
        if self.connector.registration is not None:
            self.connector.registration.wait()

    @property
    def num_slots(self) -> int:
        return self.cache.layout.num_slots

    def _caches(self) -> list[torch.Tensor]:
        layout = self.cache.layout
        return [layout.kv] + ([] if layout.sliding_kv is None else [layout.sliding_kv])

    def write(self, blocks: list[int], values: torch.Tensor, delay: float = 0.0) -> None:
        """Write `values` ([slots, 2, len(blocks), block_size, Hkv, D]) into every slot of `blocks`; with
        `delay` on CUDA, behind that much GPU sleep on the current stream (see `fill`)."""
        idx = torch.tensor(blocks, device=self.device)
        if delay and self.device.type == "cuda":
            torch.cuda._sleep(int(delay * 1.5e9))
        split = self.cache.layout.num_global_slots
        for kv, part in zip(self._caches(), (values[:split], values[split:])):
            kv.index_copy_(2, idx, part)

    def fill(self, blocks: list[int], value: float, delay: float = 0.0) -> None:
        """Fill `blocks` with `value`; on CUDA with `delay`, queued behind that much GPU
        sleep on the current stream and not waited for (the index is uploaded first: a
        pageable upload behind the sleep would hold the host until it ended)."""
        idx = torch.tensor(blocks, device=self.device)
        if delay and self.device.type == "cuda":
            torch.cuda._sleep(int(delay * 1.5e9))
        for kv in self._caches():
            kv.index_fill_(2, idx, value)

    def sliding_table(self, blocks: list[int], from_block: int = 0) -> list[int]:
        """The sliding table of `blocks` for the connector: the same ids from `from_block`
        on, null before (none without sliding layers)."""
        sliding = self.cache.sliding
        if sliding is None:
            return []
        return [sliding.null if i < from_block else b for i, b in enumerate(blocks)]

    def restored_from_block(self, hit: int) -> int:
        """The first block whose sliding slots a restore of `hit` tokens fills: chunks
        inside the window before the resume point, whole."""
        window = self.model.sliding_window
        if window is None:
            return 0
        return max(0, hit - window + 1) // self.chunk_tokens * self.chunk_tokens // self.block_size

    @property
    def block_size(self) -> int:
        return self.cache.layout.block_size

    def tokens(self, trial: int, num_chunks: int) -> list[int]:
        """A prompt of num_chunks full chunks (+1 token), unique per trial."""
        n = num_chunks * self.chunk_tokens + 1
        return [(trial * 7919 + i * 31) % 30000 + 1 for i in range(n)]

    def pattern(self, trial: int, blocks: int) -> torch.Tensor:
        """The expected KV of `blocks` blocks of trial `trial` (every slot, K and V)."""
        kv = self.cache.layout.kv
        shape = (self.num_slots, 2, blocks, *kv.shape[3:])
        out = torch.empty(shape, dtype=kv.dtype, device=self.device)
        fill_uniform_(out, key=trial * 1_000_003 + 17, low=-4.0, high=4.0)
        return out

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def store_pattern(self, trial: int, num_chunks: int) -> list[bytes]:
        """Store trial's pattern as a prefix of num_chunks chunks; returns the chunk keys."""
        blocks = self.cache.blocks.allocate(
            self.cache.blocks.blocks_needed(num_chunks * self.chunk_tokens)
        )
        self.write(blocks, self.pattern(trial, len(blocks)))
        tokens = self.tokens(trial, num_chunks)
        request = f"store-{trial}"
        self.connector.store(
            request, tokens, blocks, len(tokens) - 1, sliding_table=self.sliding_table(blocks)
        )
        self.connector.wait_idle()
        self.connector.forget(request)
        self.cache.blocks.release(blocks)
        return chunk_keys(self.connector.namespace, tokens)

    def restore(
        self, trial: int, num_chunks: int, poison: float, fill_delay: float = 0.0
    ) -> tuple[int, bool, list[int]]:
        """Restore trial's prefix into fresh, poisoned blocks: (hit tokens, ok, blocks).

        With `fill_delay` (CUDA) the poison fill is queued on the compute stream behind
        that much GPU sleep and not waited for: the blocks' earlier writer is still
        running when the load starts, and the load must land after it.
        The caller releases the blocks (cache.blocks.release) after reading them.
        """
        hit, ok, blocks, _ = self._restore(trial, num_chunks, poison, fill_delay, read=False)
        return hit, ok, blocks

    def restore_and_read(
        self, trial: int, num_chunks: int, poison: float, fill_delay: float = 0.0
    ) -> tuple[int, bool, list[int], torch.Tensor | None]:
        """`restore`, with the restored blocks read the engine's way: right after the load
        started and before it is verified, on the compute stream, slot by slot, each after
        the cache's fence for it ([slots, 2, len(blocks), block_size, Hkv, D]; None
        without a hit)."""
        return self._restore(trial, num_chunks, poison, fill_delay, read=True)

    def _restore(
        self, trial: int, num_chunks: int, poison: float, fill_delay: float, read: bool
    ) -> tuple[int, bool, list[int], torch.Tensor | None]:
        tokens = self.tokens(trial, num_chunks)
        blocks = self.cache.blocks.allocate(
            self.cache.blocks.blocks_needed(num_chunks * self.chunk_tokens)
        )
        # Uploaded before the load: an upload behind the fences' waits would hold the host.
        idx = torch.tensor(blocks, device=self.device)
        self.fill(blocks, poison, fill_delay)
        if not fill_delay:
            self.sync()
        request = f"load-{trial}"
        hit = self.connector.match(request, tokens, 0).num_tokens
        ok, got = False, None
        sliding = self.sliding_table(blocks, self.restored_from_block(hit))
        if hit and self.connector.load(request, blocks, sliding_table=sliding):
            if read:
                got = self._read_through_fences(idx)
            ok = self.connector.finish_load(request)
        self.connector.forget(request)
        return hit, ok, blocks, got

    def _read_through_fences(self, idx: torch.Tensor) -> torch.Tensor:
        layout = self.cache.layout
        slots = []
        for slot in range(layout.num_slots):
            self.cache.fences.before(slot)
            cache, _ = layout.slot_cache(slot)
            slots.append(cache.index_select(1, idx))
        self.cache.fences.drain()
        return torch.stack(slots)
