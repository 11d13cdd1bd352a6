"""Runs the model for one scheduled step: builds inputs, owns the paged KV cache."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from kvshare.engine import kv_fp8
from kvshare.engine.attention import (
    AttentionBackend,
    PagedAttention,
    SDPABackend,
    StepInputs,
    StepMeta,
    VarlenBackend,
)
from kvshare.engine.config import EngineConfig
from kvshare.engine.connector import KVCacheLayout, SlotFences
from kvshare.engine.cuda_graphs import StepGraphs
from kvshare.engine.memory import (
    DeviceMemoryPlan,
    KVCacheSplit,
    graph_batch,
    longest_context,
    plan_device_memory,
    short_step_batch,
    split_kv_cache,
)
from kvshare.engine.recurrent_state import RecurrentStates
from kvshare.engine.scheduler import ScheduledChunk
from kvshare.models.loader import LoadedModel
from kvshare.uploads import host_to_device

_CPU_KV_CACHE_BYTES = 1 << 30
_log = logging.getLogger(__name__)


def context_length(asked: int | None, model_context: int, cache_tokens: int) -> int:
    """The longest prompt + output served: `asked` (--max-model-len) when the model and
    the KV cache both allow it, else a ValueError that says which does not; unasked, the
    model's context capped at what the cache holds (a sequence that outgrew the whole
    cache would be preempted and readmitted forever; the engine stops it with "length"
    instead). A limit asked for is never cut silently: requests would be refused for a
    context the operator was told they had."""
    if asked is None:
        return min(model_context, cache_tokens)
    if asked > model_context:
        raise ValueError(
            f"--max-model-len {asked} is longer than the model's context "
            f"({model_context} tokens); lower it"
        )
    if asked > cache_tokens:
        raise ValueError(
            f"--max-model-len {asked} does not fit the KV cache, which holds {cache_tokens} "
            "tokens: give the cache more memory (--kv-cache-memory or "
            "--gpu-memory-fraction) or lower --max-model-len"
        )
    return asked


class ModelRunner:
    """`staging_bytes(kv bytes per token)`: the device memory the connector will allocate
    when it binds to this cache (its staging buffers); counted in the memory budget.
    `chunk_tokens`: the connector's chunk, when there is one (sizes the sliding blocks)."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        staging_bytes: Callable[[int], int] | None = None,
        chunk_tokens: int | None = None,
    ) -> None:
        self.model = loaded.model
        self.model_config = loaded.config
        self.config = config
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.backend = self._choose_backend()
        self.memory: DeviceMemoryPlan | None = None  # CUDA: the budget the caches were sized by
        self.layout = self._allocate_kv_cache(staging_bytes, chunk_tokens)
        # Where a step waits for pool loads into its cache slots (shared with the connector).
        self.fences = SlotFences()
        # Each cache tensor's last block is outside its block manager: padding rows of
        # captured decode graphs write there (and out-of-window sliding entries point there).
        self.num_blocks = self.layout.kv.shape[2] - 1
        sliding_kv = self.layout.sliding_kv
        self.num_sliding_blocks = 0 if sliding_kv is None else sliding_kv.shape[2] - 1
        self.states: RecurrentStates | None = None
        if loaded.config.linear_layers:
            self.states = RecurrentStates(
                loaded.config,
                config.max_num_seqs,
                config.num_state_snapshots,
                self.dtype,
                self.device,
            )
        self.graphs: StepGraphs | None = None
        self.max_model_len = context_length(
            config.max_model_len,
            loaded.config.max_position_embeddings,
            self.num_blocks * config.block_size,
        )
        if self._captures_graphs():
            self.graphs = StepGraphs(
                self.model,
                self.layout,
                self.backend,
                max_batch=graph_batch(self.model_config, config),
                max_blocks_per_seq=-(-self.max_model_len // config.block_size),
                states=self.states,
                short_batch=short_step_batch(config),
            )
        if self.memory is not None:
            _log.info(
                "device memory: budget %s; %.2f GiB allocated after start",
                self.memory.describe(),
                torch.cuda.memory_allocated(self.device) / (1 << 30),
            )

    def _captures_graphs(self) -> bool:
        return self.config.cuda_graphs and isinstance(self.backend, VarlenBackend)

    def _choose_backend(self) -> AttentionBackend:
        name = self.config.attention_backend
        fast_ok = self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16)
        if name == "varlen" and not fast_ok:
            raise ValueError("the varlen backend needs CUDA and bfloat16/float16")
        if name == "varlen" or (name == "auto" and fast_ok):
            return VarlenBackend(longest_context(self.model_config, self.config))
        return SDPABackend()

    @property
    def kv_row_bytes(self) -> int:
        """Cache bytes of one token's K (or V) for one KV head."""
        return kv_fp8.row_bytes(self.model_config.head_dim, self.dtype, self.config.kv_cache_dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.model_config
        return len(c.attention_layers) * 2 * c.num_kv_heads * self.kv_row_bytes

    def _kv_split(
        self, staging_bytes: Callable[[int], int] | None, chunk_tokens: int | None
    ) -> KVCacheSplit:
        """CUDA: the KV cache the memory plan leaves (ValueError when the plan does not
        fit); elsewhere kv_cache_memory or 1 GiB, split the same way."""
        if self.device.type != "cuda":
            budget = self.config.kv_cache_memory or _CPU_KV_CACHE_BYTES
            return split_kv_cache(
                self.model_config, self.config, budget, self.kv_row_bytes, chunk_tokens
            )
        # This engine's own tensors: other engines of the process are in free_bytes.
        weights = sum(
            t.numel() * t.element_size()
            for t in (*self.model.parameters(), *self.model.buffers())
            if t.device == self.device
        )
        free, total = torch.cuda.mem_get_info(self.device)
        self.memory = plan_device_memory(
            self.model_config,
            self.config,
            total,
            weights_bytes=weights,
            staging_bytes=staging_bytes(self.kv_bytes_per_token) if staging_bytes else 0,
            cuda_graphs=self._captures_graphs(),
            free_bytes=free,
            chunk_tokens=chunk_tokens,
        )
        assert self.memory.split is not None
        return self.memory.split

    def _allocate_kv_cache(
        self, staging_bytes: Callable[[int], int] | None, chunk_tokens: int | None
    ) -> KVCacheLayout:
        split = self._kv_split(staging_bytes, chunk_tokens)
        if split.num_blocks < 3 or 0 < split.num_sliding_blocks < 3:
            raise ValueError(
                f"no room for a KV cache: {split.num_blocks} blocks for the global layers, "
                f"{split.num_sliding_blocks} for the sliding-window layers"
            )
        return KVCacheLayout.allocate(
            self.model_config,
            split.num_blocks,
            self.config.block_size,
            self.dtype,
            self.device,
            split.num_sliding_blocks,
            kv_cache_dtype=self.config.kv_cache_dtype,
        )

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """Run one step; return float32 logits for the chunks that sample, in order."""
        step = self._inputs(chunks)
        ends = np.cumsum(step.q_lens)
        sample_rows = [int(end) - 1 for c, end in zip(chunks, ends) if c.samples]
        # A load in groups of layers leaves fences: each layer waits for its own group only
        # (eagerly, or before the captured segment that holds it).
        if self.graphs is not None and self.graphs.shape_for(step.q_lens):
            hidden = self.graphs.run(step, self.fences)
        else:
            hidden = self._forward(step)
        self.fences.drain()  # slots this step did not touch: the next user must not race
        if not sample_rows:
            return None
        if len(sample_rows) == len(step.input_ids):  # decode: every row samples
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(
            hidden[host_to_device(np.asarray(sample_rows), self.device)]
        )

    def _inputs(self, chunks: list[ScheduledChunk]) -> StepInputs:
        q_lens = tuple(c.num_new_tokens for c in chunks)
        starts = [c.seq.num_computed_tokens for c in chunks]
        input_ids = np.concatenate(
            [
                np.asarray(c.seq.token_ids[a : a + n], dtype=np.int64)
                for c, a, n in zip(chunks, starts, q_lens)
            ]
        )
        state_slots = None
        if self.states is not None:
            state_slots = np.asarray([c.seq.state_slot for c in chunks], dtype=np.int64)
        return StepInputs(
            q_lens,
            input_ids,
            np.concatenate([np.arange(a, a + n) for a, n in zip(starts, q_lens)]),
            tuple(a + n for a, n in zip(starts, q_lens)),
            [c.seq.block_table_array() for c in chunks],
            None
            if self.layout.sliding_kv is None
            else [tuple(c.seq.sliding_table) for c in chunks],
            state_slots,
        )

    def _forward(self, step: StepInputs) -> torch.Tensor:
        """The step run eagerly, layer by layer (pool loads waited for per cache slot)."""
        bs = self.config.block_size
        meta = StepMeta(step.q_lens, step.context_lens, tuple(step.block_tables), bs, self.device)
        sliding_meta = None
        if step.sliding_tables is not None:
            sliding_meta = StepMeta(
                step.q_lens, step.context_lens, tuple(step.sliding_tables), bs, self.device
            )
        state_slots = None
        if step.state_slots is not None:
            state_slots = host_to_device(step.state_slots, self.device)
        ctx = PagedAttention(
            self.layout, meta, self.backend, self.states, state_slots, sliding_meta, self.fences
        )
        return self.model(
            host_to_device(step.input_ids, self.device),
            host_to_device(step.positions, self.device),
            ctx,
        )
