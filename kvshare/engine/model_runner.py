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
    StepMeta,
    VarlenBackend,
    host_to_device,
)
from kvshare.engine.config import EngineConfig
from kvshare.engine.connector import KVCacheLayout
from kvshare.engine.cuda_graphs import DecodeGraphs
from kvshare.engine.memory import DeviceMemoryPlan, plan_device_memory
from kvshare.engine.recurrent_state import RecurrentStates
from kvshare.engine.scheduler import ScheduledChunk
from kvshare.models.loader import LoadedModel

_CPU_KV_CACHE_BYTES = 1 << 30
_log = logging.getLogger(__name__)


class ModelRunner:
    """`staging_bytes(kv bytes per token)`: the device memory the connector will allocate
    when it binds to this cache (its staging buffers); counted in the memory budget."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        staging_bytes: Callable[[int], int] | None = None,
    ) -> None:
        self.model = loaded.model
        self.model_config = loaded.config
        self.config = config
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.backend = self._choose_backend()
        self.memory: DeviceMemoryPlan | None = None  # CUDA: the budget the caches were sized by
        self.layout = self._allocate_kv_cache(staging_bytes)
        # The cache's last block is outside the block manager: padding rows of captured
        # decode graphs write there.
        self.num_blocks = self.layout.kv.shape[2] - 1
        self.states: RecurrentStates | None = None
        if loaded.config.linear_layers:
            self.states = RecurrentStates(
                loaded.config,
                config.max_num_seqs,
                config.num_state_snapshots,
                self.dtype,
                self.device,
            )
        self.graphs: DecodeGraphs | None = None
        # Hybrid decode steps are not captured: their state slots are not static buffers yet.
        # Capped at what the KV cache holds: a sequence that outgrew the whole cache would
        # be preempted and readmitted forever (the engine stops it with "length" instead).
        self.max_model_len = min(
            config.max_model_len or loaded.config.max_position_embeddings,
            loaded.config.max_position_embeddings,
            self.num_blocks * config.block_size,
        )
        if self._captures_graphs():
            self.graphs = DecodeGraphs(
                self.model,
                self.layout,
                self.backend,
                trash_block=self.num_blocks,
                max_batch=config.max_num_seqs,
                max_blocks_per_seq=-(-self.max_model_len // config.block_size),
            )
        if self.memory is not None:
            _log.info(
                "device memory: budget %s; %.2f GiB allocated after start",
                self.memory.describe(),
                torch.cuda.memory_allocated(self.device) / (1 << 30),
            )

    def _captures_graphs(self) -> bool:
        return (
            self.config.cuda_graphs
            and isinstance(self.backend, VarlenBackend)
            and not self.model_config.linear_layers
        )

    def _choose_backend(self) -> AttentionBackend:
        name = self.config.attention_backend
        fast_ok = self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16)
        if name == "varlen" and not fast_ok:
            raise ValueError("the varlen backend needs CUDA and bfloat16/float16")
        if name == "varlen" or (name == "auto" and fast_ok):
            return VarlenBackend()
        return SDPABackend()

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.model_config
        row = kv_fp8.row_bytes(c.head_dim, self.dtype, self.config.kv_cache_dtype)
        return len(c.attention_layers) * 2 * c.num_kv_heads * row

    def _kv_budget(self, staging_bytes: Callable[[int], int] | None) -> int:
        """CUDA: what the memory plan leaves for the KV cache (ValueError when the plan does
        not fit); elsewhere kv_cache_memory or 1 GiB."""
        if self.device.type != "cuda":
            return self.config.kv_cache_memory or _CPU_KV_CACHE_BYTES
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
        )
        return self.memory.kv_bytes

    def _allocate_kv_cache(self, staging_bytes: Callable[[int], int] | None) -> KVCacheLayout:
        c = self.model_config
        budget = self._kv_budget(staging_bytes)
        per_block = self.kv_bytes_per_token * self.config.block_size
        num_blocks = budget // per_block
        if num_blocks < 3:
            raise ValueError(
                f"no room for a KV cache: {budget} bytes available, {per_block} per block"
            )
        return KVCacheLayout.allocate(
            c,
            num_blocks,
            self.config.block_size,
            self.dtype,
            self.device,
            self.config.kv_cache_dtype,
        )

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """Run one step; return float32 logits for the chunks that sample, in order."""
        if (
            self.graphs is not None
            and len(chunks) <= self.graphs.max_batch
            and all(c.num_new_tokens == 1 for c in chunks)
        ):
            return self._execute_graph(chunks)
        ids, positions, sample_rows = [], [], []
        row = 0
        for chunk in chunks:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            ids.append(
                np.asarray(seq.token_ids[start : start + chunk.num_new_tokens], dtype=np.int64)
            )
            positions.append(np.arange(start, start + chunk.num_new_tokens, dtype=np.int64))
            row += chunk.num_new_tokens
            if chunk.samples:
                sample_rows.append(row - 1)
        meta = StepMeta(
            q_lens=tuple(c.num_new_tokens for c in chunks),
            ctx_lens=tuple(c.seq.num_computed_tokens + c.num_new_tokens for c in chunks),
            block_tables=tuple(tuple(c.seq.block_table) for c in chunks),
            block_size=self.config.block_size,
            device=self.device,
        )
        input_ids = host_to_device(np.concatenate(ids), self.device)
        pos = host_to_device(np.concatenate(positions), self.device)
        state_slots = None
        if self.states is not None:
            state_slots = host_to_device(
                np.asarray([c.seq.state_slot for c in chunks], dtype=np.int64), self.device
            )
        ctx = PagedAttention(
            self.layout.kv, self.layout.layer_slot, meta, self.backend, self.states, state_slots
        )
        hidden = self.model(input_ids, pos, ctx)
        if not sample_rows:
            return None
        return self.model.compute_logits(
            hidden[host_to_device(np.asarray(sample_rows), self.device)]
        )

    def _execute_graph(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """A decode step (one new token per sequence, every one samples) from a graph."""
        assert self.graphs is not None
        bs = self.config.block_size
        positions = np.asarray([c.seq.num_computed_tokens for c in chunks], dtype=np.int64)
        tables = [tuple(c.seq.block_table) for c in chunks]
        slots = np.asarray(
            [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)], dtype=np.int64
        )
        ids = np.asarray([c.seq.token_ids[p] for c, p in zip(chunks, positions)], dtype=np.int64)
        hidden = self.graphs.run(ids, positions, slots, tables, positions + 1)
        return self.model.compute_logits(hidden)
