"""One device-memory budget per engine, computed before anything past the weights is allocated.

`gpu_memory_fraction` of the device is the limit for everything the engine's process
holds on the GPU: the weights, the CUDA runtime (context, library workspaces, kernel
images, allocator slack), the activations of the largest step, the recurrent-state slots
and snapshots of hybrid models, the captured decode graphs, the pool connector's staging
buffers, and the KV cache, which gets what is left. `plan_device_memory` is a pure
function of the model's shape and the engine's options, so the engine (at start, with
the weights it measured) and the preflight check (before loading, from a shape preset)
compute the same budget, and a budget that cannot fit is refused with every part named.
Estimates are upper bounds of the tensors the engine allocates; the runtime and slack
terms are the margin for what torch does not report.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshare.engine.config import EngineConfig
from kvshare.models.config import ModelConfig
from kvshare.sizes import format_size

GIB = 1 << 30
CUDA_RUNTIME_BYTES = 2 * GIB  # context, cuBLAS/Triton workspaces and kernels, allocator slack
GRAPH_POOL_SLACK_BYTES = 64 << 20
# Per step, beside the per-token terms: cuBLAS workspaces, masks and sampler buffers that
# the caching allocator serves (a tiny Gemma 3 step on the H200 took 29 MiB more than the
# per-token terms alone).
STEP_SLACK_BYTES = 128 << 20
ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
STAGING_BUFFERS = 4  # the pool connector's CUDA transfer: two per direction


def kv_bytes_per_token(model: ModelConfig, config: EngineConfig) -> int:
    """Cache bytes of one token over every attention layer, K and V. fp8 rows are e4m3
    values plus one float32 scale per KV head (the packed row of kvshare.engine.kv_fp8)."""
    if config.kv_cache_dtype == "fp8":
        row = model.head_dim + 4
    else:
        row = model.head_dim * item_bytes(config.resolved_dtype)
    return len(model.attention_layers) * 2 * model.num_kv_heads * row


def item_bytes(dtype: str) -> int:
    """Bytes per element of a resolved dtype name ("bfloat16", ...)."""
    if dtype not in ITEM_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(ITEM_BYTES)}")
    return ITEM_BYTES[dtype]


def staging_buffer_bytes(page_bytes: int) -> int:
    """One staging buffer of the pool's CUDA transfer: one whole page, or several (128 MiB):
    loads of global layers only copy a part of each page, so more of them fit."""
    return max(page_bytes, 128 << 20)


def staging_bytes(page_bytes: int) -> int:
    """Device memory the pool's CUDA transfer allocates for pages of `page_bytes` (the
    per-copy tables and checksums are KiBs)."""
    return STAGING_BUFFERS * staging_buffer_bytes(page_bytes)


@dataclass(frozen=True)
class DeviceMemoryPlan:
    """Where `limit` bytes go: `parts` (name, bytes) in the order the engine allocates
    them, then the KV cache, `kv_bytes`. Invariant: sum(parts) + kv_bytes <= limit."""

    device_bytes: int
    fraction: float
    parts: tuple[tuple[str, int], ...]
    kv_bytes: int

    @property
    def limit(self) -> int:
        return int(self.device_bytes * self.fraction)

    @property
    def fixed_bytes(self) -> int:
        return sum(n for _, n in self.parts)

    def part(self, name: str) -> int:
        return dict(self.parts).get(name, 0)

    def describe(self) -> str:
        """One line: the limit and every part with its size."""
        items = ", ".join(f"{name} {format_size(n)}" for name, n in self.parts if n)
        return (
            f"{format_size(self.limit)} ({self.fraction:g} of {format_size(self.device_bytes)}): "
            f"{items}, KV cache {format_size(self.kv_bytes)}"
        )


def activation_bytes(model: ModelConfig, config: EngineConfig, tokens: int) -> int:
    """Peak activations of one step of `tokens` tokens: the widest per-token intermediates
    (attention, MLP, linear-attention float32 buffers), the float32 logits of the sampled
    rows, and the state slots a hybrid step gathers and writes back per layer."""
    item = item_bytes(config.resolved_dtype)
    per_token = (
        6 * model.hidden_size
        + 3 * model.intermediate_size
        + 4 * (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    ) * item
    states = 0
    if model.linear_layers:
        heads, dk, dv = model.recurrent_state_shape
        per_token += 4 * (3 * heads * max(dk, dv) + 2 * model.linear_conv_dim)
        per_layer_state = model.state_bytes_per_sequence(item) // len(model.linear_layers)
        states = 3 * min(tokens, config.max_num_seqs) * per_layer_state
    logits = min(tokens, config.max_num_seqs) * model.vocab_size * 4 * 3
    return tokens * per_token + logits + states + STEP_SLACK_BYTES


def graph_bytes(model: ModelConfig, config: EngineConfig, max_blocks_per_seq: int) -> int:
    """Captured decode graphs: one memory pool sized by the largest batch's step (the
    smaller buckets reuse it), plus the static inputs and block tables."""
    batch = config.max_num_seqs
    tables = 2 * batch * max_blocks_per_seq * 4
    return activation_bytes(model, config, batch) + tables + GRAPH_POOL_SLACK_BYTES


def plan_device_memory(
    model: ModelConfig,
    config: EngineConfig,
    device_bytes: int,
    weights_bytes: int,
    staging_bytes: int = 0,
    cuda_graphs: bool = False,
    free_bytes: int | None = None,
) -> DeviceMemoryPlan:
    """The budget of one engine on a device of `device_bytes`; ValueError naming every
    part when they do not fit `config.gpu_memory_fraction` of it.

    `weights_bytes`: what the loaded model holds (measured, or estimated by preflight);
    `staging_bytes`: the connector's device buffers; `cuda_graphs`: decode graphs will be
    captured. With `config.kv_cache_memory` the KV cache has that size and must fit too;
    otherwise it takes what is left and must hold at least one step's tokens.
    `free_bytes` (at start, the weights loaded): the device memory free now; the KV cache
    and the parts still to allocate must fit in it too (other processes, or other engines
    of this one, hold the rest).
    """
    item = item_bytes(config.resolved_dtype)
    max_len = config.max_model_len or model.max_position_embeddings
    states = model.state_bytes_per_sequence(item)
    parts = (
        ("weights", weights_bytes),
        ("CUDA runtime", CUDA_RUNTIME_BYTES),
        ("activations", activation_bytes(model, config, config.max_num_batched_tokens)),
        ("recurrent-state slots", config.max_num_seqs * states),
        ("state snapshots", config.num_state_snapshots * states if states else 0),
        (
            "CUDA graphs",
            graph_bytes(model, config, -(-max_len // config.block_size)) if cuda_graphs else 0,
        ),
        ("pool staging", staging_bytes),
    )
    plan = DeviceMemoryPlan(device_bytes, config.gpu_memory_fraction, parts, 0)
    left = plan.limit - plan.fixed_bytes
    if free_bytes is not None:
        allocated = {"weights", "CUDA runtime"}
        left = min(left, free_bytes - sum(n for name, n in parts if name not in allocated))
    minimum = config.kv_cache_memory or config.max_num_batched_tokens * kv_bytes_per_token(
        model, config
    )
    if left < minimum:
        what = (
            f"the KV cache of {format_size(minimum)} (--kv-cache-memory)"
            if config.kv_cache_memory
            else f"a KV cache for one step ({config.max_num_batched_tokens} tokens, "
            f"{format_size(minimum)})"
        )
        raise ValueError(
            f"the engine does not fit --gpu-memory-fraction {config.gpu_memory_fraction:g} of "
            f"{format_size(device_bytes)} ({format_size(plan.limit)}"
            + ("" if free_bytes is None else f"; {format_size(free_bytes)} free now")
            + "): "
            + ", ".join(f"{name} {format_size(n)}" for name, n in parts if n)
            + f" leave {format_size(max(left, 0))}, not enough for {what}; raise the fraction, "
            "or lower --max-num-seqs, --max-num-batched-tokens or --max-model-len"
        )
    return DeviceMemoryPlan(
        device_bytes, config.gpu_memory_fraction, parts, config.kv_cache_memory or left
    )
