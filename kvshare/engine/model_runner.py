"""Runs the model for one scheduled step: builds inputs, owns the paged KV cache."""

from __future__ import annotations

import numpy as np
import torch

from kvshare.engine.attention import (
    AttentionBackend,
    PagedAttention,
    SDPABackend,
    StepMeta,
    VarlenBackend,
)
from kvshare.engine.config import EngineConfig
from kvshare.engine.connector import KVCacheLayout
from kvshare.engine.scheduler import ScheduledChunk
from kvshare.models.loader import LoadedModel

_CPU_KV_CACHE_BYTES = 1 << 30


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.model = loaded.model
        self.model_config = loaded.config
        self.config = config
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.backend = self._choose_backend()
        self.layout = self._allocate_kv_cache()

    @property
    def num_blocks(self) -> int:
        return self.layout.kv.shape[2]

    def _choose_backend(self) -> AttentionBackend:
        name = self.config.attention_backend
        fast_ok = self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16)
        if name == "varlen" and not fast_ok:
            raise ValueError("the varlen backend needs CUDA and bfloat16/float16")
        if name == "varlen" or (name == "auto" and fast_ok):
            return VarlenBackend()
        return SDPABackend()

    def _kv_bytes_per_block(self) -> int:
        c = self.model_config
        item = torch.empty((), dtype=self.dtype).element_size()
        return c.num_layers * 2 * self.config.block_size * c.num_kv_heads * c.head_dim * item

    def _kv_budget(self) -> int:
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        if self.device.type != "cuda":
            return _CPU_KV_CACHE_BYTES
        total = torch.cuda.get_device_properties(self.device).total_memory
        used = torch.cuda.memory_allocated(self.device)
        return int(total * self.config.gpu_memory_fraction) - used - self._activation_reserve()

    def _activation_reserve(self) -> int:
        """Peak activations of one step of max_num_batched_tokens, with a safety margin."""
        c = self.model_config
        tokens = self.config.max_num_batched_tokens
        item = torch.empty((), dtype=self.dtype).element_size()
        per_token = (6 * c.hidden_size + 3 * c.intermediate_size
                     + 4 * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim) * item
        logits = self.config.max_num_seqs * c.vocab_size * 4 * 3
        return tokens * per_token + logits + (2 << 30)

    def _allocate_kv_cache(self) -> KVCacheLayout:
        c = self.model_config
        num_blocks = self._kv_budget() // self._kv_bytes_per_block()
        if num_blocks < 2:
            raise ValueError(
                f"no room for a KV cache: {self._kv_budget()} bytes available, "
                f"{self._kv_bytes_per_block()} per block"
            )
        global_layers = [i for i, k in enumerate(c.layer_kinds) if k == "full"]
        sliding_layers = [i for i, k in enumerate(c.layer_kinds) if k == "sliding"]
        slot_of = {layer: slot for slot, layer in enumerate(global_layers + sliding_layers)}
        # Zero-filled: blocks a window never reads may be left unwritten by a pool restore,
        # and masked garbage must stay finite (0 x NaN is NaN in the value product).
        kv = torch.zeros(
            (c.num_layers, 2, num_blocks, self.config.block_size, c.num_kv_heads, c.head_dim),
            dtype=self.dtype, device=self.device,
        )
        return KVCacheLayout(
            kv=kv, block_size=self.config.block_size,
            layer_slot=tuple(slot_of[i] for i in range(c.num_layers)),
            num_global_slots=len(global_layers), sliding_window=c.sliding_window,
        )

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """Run one step; return float32 logits for the chunks that sample, in order."""
        ids, positions, sample_rows = [], [], []
        row = 0
        for chunk in chunks:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            ids.append(np.asarray(seq.token_ids[start:start + chunk.num_new_tokens], dtype=np.int64))
            positions.append(np.arange(start, start + chunk.num_new_tokens, dtype=np.int64))
            row += chunk.num_new_tokens
            if chunk.samples:
                sample_rows.append(row - 1)
        meta = StepMeta(
            q_lens=tuple(c.num_new_tokens for c in chunks),
            ctx_lens=tuple(c.seq.num_computed_tokens + c.num_new_tokens for c in chunks),
            block_tables=tuple(tuple(c.seq.block_table) for c in chunks),
            block_size=self.config.block_size, device=self.device,
        )
        input_ids = self._to_device(np.concatenate(ids))
        pos = self._to_device(np.concatenate(positions))
        ctx = PagedAttention(self.layout.kv, self.layout.layer_slot, meta, self.backend)
        hidden = self.model(input_ids, pos, ctx)
        if not sample_rows:
            return None
        return self.model.compute_logits(hidden[self._to_device(np.asarray(sample_rows))])

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor
