"""Engine configuration, checked at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

AttentionBackendName = Literal["auto", "sdpa", "varlen"]


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model.

    KV cache size: `kv_cache_memory` bytes when given; otherwise on CUDA the cache takes
    what is left of `gpu_memory_fraction` of the device after weights and an activation
    reserve, and on the CPU 1 GiB. `gpu_memory_fraction` lets several replicas share
    one GPU.
    """

    device: str = "cpu"
    dtype: str = "auto"
    block_size: int = 16
    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 64
    max_model_len: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_fraction: float = 0.9
    enable_prefix_caching: bool = True
    attention_backend: AttentionBackendName = "auto"
    cuda_graphs: bool = True
    seed: int = 0
    # Hybrid (linear-attention) models: recurrent-state snapshots kept on the device for
    # prefix reuse, and how often a long prefill leaves one (besides its last chunk boundary).
    num_state_snapshots: int = 8
    snapshot_interval_tokens: int = 16384

    def __post_init__(self) -> None:
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least one block")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if not 0.05 <= self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction must be in [0.05, 1], got {self.gpu_memory_fraction}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive")
        if self.num_state_snapshots < 0 or self.snapshot_interval_tokens < self.block_size:
            raise ValueError("num_state_snapshots must be >= 0 and snapshot_interval_tokens >= block_size")
        if self.attention_backend not in ("auto", "sdpa", "varlen"):
            raise ValueError(f"unknown attention backend {self.attention_backend!r}")

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"
