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

The KV cache of a sliding-window model is two tensors (`split_kv_cache`): the global
layers' blocks, which bound the context a sequence reaches, and the sliding layers'
blocks, of which each sequence holds only its window and the step it computes
(kvshare.engine.sliding). The global part is sized for `max_model_len` first; the
sliding part gets the rest, between one sequence's window + step and every sequence's
window + one step.
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
# Tokens of a packed fp8 cache dequantized at a time: the float32 products of one chunk are
# the only float32 temporaries of reading a packed cache (kvshare.engine.kv_fp8.GatherBuffers).
DEQUANT_CHUNK_TOKENS = 8192
ATTENTION_CONTEXT = "attention context"


def kv_row_bytes(model: ModelConfig, config: EngineConfig) -> int:
    """Cache bytes of one token's K (or V) for one KV head: head_dim elements of the model's
    dtype, or with fp8 head_dim e4m3 bytes and their float32 scale (kvshare.engine.kv_fp8)."""
    if config.kv_cache_dtype == "fp8":
        return packed_head_bytes(model.head_dim)
    return model.head_dim * item_bytes(config.resolved_dtype)


FP8_SCALE_BYTES = 4  # one float32 scale per token and KV head of a packed fp8 cache


def packed_head_bytes(head_dim: int) -> int:
    """Bytes of a packed fp8 cache per token and KV head (kvshare.engine.kv_fp8): head_dim
    e4m3 values and a float32 scale, which must sit on a 4-byte boundary."""
    if head_dim % FP8_SCALE_BYTES:
        raise ValueError(f"fp8 KV needs a head dim divisible by 4, got {head_dim}")
    return head_dim + FP8_SCALE_BYTES


def longest_context(model: ModelConfig, config: EngineConfig) -> int:
    """The most keys one sequence's attention reads: max_model_len, or the model's context."""
    return config.max_model_len or model.max_position_embeddings


def attention_context_bytes(model: ModelConfig, config: EngineConfig) -> int:
    """The buffers attention gathers one layer's keys into (kvshare.engine.kv_fp8.GatherBuffers,
    sized for the longest context): K and V in the compute dtype, and with fp8 one chunk of
    e4m3 values, their scales and their float32 products."""
    tokens = longest_context(model, config)
    heads, dim = model.num_kv_heads, model.head_dim
    gathered = 2 * tokens * heads * dim * item_bytes(config.resolved_dtype)
    if config.kv_cache_dtype != "fp8":
        return gathered
    chunk = min(DEQUANT_CHUNK_TOKENS, tokens)
    return gathered + chunk * heads * (packed_head_bytes(dim) + 4 * dim)


def kv_bytes_per_token(model: ModelConfig, config: EngineConfig) -> int:
    """Cache bytes of one token over every attention layer, K and V."""
    return len(model.attention_layers) * 2 * model.num_kv_heads * kv_row_bytes(model, config)


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
class KVCacheSplit:
    """A KV budget cut into the global layers' blocks and the sliding-window layers'
    blocks (0 without such layers); each count includes its tensor's extra last block
    (graph padding, out-of-window entries), which the block managers do not hand out."""

    num_blocks: int
    num_sliding_blocks: int
    block_size: int

    @property
    def context_tokens(self) -> int:
        """The most tokens one sequence's block table reaches."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def sliding_tokens(self) -> int:
        return max(self.num_sliding_blocks - 1, 0) * self.block_size


def kv_bytes_per_block(model: ModelConfig, block_size: int, row_bytes: int) -> tuple[int, int]:
    """Bytes of one block of (the global layers, the sliding-window layers), with rows of
    `row_bytes` (kv_row_bytes)."""
    per_layer = 2 * model.num_kv_heads * row_bytes * block_size
    sliding = sum(kind == "sliding" for kind in model.layer_kinds)
    return (len(model.attention_layers) - sliding) * per_layer, sliding * per_layer


def sliding_block_bounds(
    model: ModelConfig, config: EngineConfig, chunk_tokens: int | None
) -> tuple[int, int]:
    """(fewest, most) sliding blocks the engine can use: one sequence with a whole step,
    and every sequence (`max_num_seqs`) its window with the step's tokens once. A
    sequence in a step of n tokens holds ceil((held - 1 + n) / block_size) + 1 blocks,
    held = max(window, chunk_tokens) (engine.sliding)."""
    assert model.sliding_window is not None
    bs, step = config.block_size, config.max_num_batched_tokens
    held = max(model.sliding_window, chunk_tokens or 0)
    fewest = -(-(held - 1 + step) // bs) + 1
    most = config.max_num_seqs * (-(-(held - 1) // bs) + 2) + -(-step // bs)
    return fewest, most


def split_kv_cache(
    model: ModelConfig,
    config: EngineConfig,
    kv_bytes: int,
    row_bytes: int,
    chunk_tokens: int | None = None,
) -> KVCacheSplit:
    """Cut `kv_bytes` of KV cache (rows of `row_bytes`, kv_row_bytes): the global part holds
    max_model_len first; the sliding part gets the rest, clamped to sliding_block_bounds;
    the global part takes what the sliding part leaves."""
    bs = config.block_size
    global_block, sliding_block = kv_bytes_per_block(model, bs, row_bytes)
    if not sliding_block:
        return KVCacheSplit(kv_bytes // global_block, 0, bs)
    fewest, most = sliding_block_bounds(model, config, chunk_tokens)
    max_len = longest_context(model, config)
    context_blocks = -(-max_len // bs) + 1
    left = (kv_bytes - context_blocks * global_block) // sliding_block - 1  # - the null block
    sliding = max(fewest, min(most, left)) + 1
    return KVCacheSplit(max((kv_bytes - sliding * sliding_block) // global_block, 0), sliding, bs)


@dataclass(frozen=True)
class DeviceMemoryPlan:
    """Where `limit` bytes go: `parts` (name, bytes) in the order the engine allocates
    them, then the KV cache, `kv_bytes`. Invariant: sum(parts) + kv_bytes <= limit."""

    device_bytes: int
    fraction: float
    parts: tuple[tuple[str, int], ...]
    kv_bytes: int
    split: KVCacheSplit | None = None  # the KV cache's blocks (None: not planned yet)

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
        kv = f"KV cache {format_size(self.kv_bytes)}"
        if self.split is not None:
            kv += f" ({self.split.context_tokens} tokens of context"
            if self.split.num_sliding_blocks:
                kv += f", sliding windows {self.split.sliding_tokens} tokens"
            kv += ")"
        return (
            f"{format_size(self.limit)} ({self.fraction:g} of {format_size(self.device_bytes)}): "
            f"{items}, {kv}"
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


# A hybrid model's decode steps are captured once per batch size (no padding rows:
# cuda_graphs.py), so only up to this many sequences; larger steps run eagerly.
HYBRID_GRAPH_MAX_BATCH = 16
# Short prefill steps captured as graphs (cuda_graphs.py): their token rows, and up to
# this many sequences (each at most paged_decode.MAX_QUERY = 64 new tokens).
SHORT_STEP_TOKENS = (16, 32, 64)
SHORT_STEP_MAX_BATCH = 2
# The paged attention kernel's split buffers (paged_decode.py): about 4 waves of 132
# programs, each holding up to its tile's query rows of float32 partial sums and two
# scalars. The most rows a tile takes, by KV cache (paged_decode.split_tile reads them;
# float32 queries take the smaller).
PAGED_TILE_ROWS = {"auto": 128, "fp8": 64}
PAGED_SPLIT_PROGRAMS = 4 * 132


def graph_batch(model: ModelConfig, config: EngineConfig) -> int:
    """The largest decode step captured as a graph."""
    if model.linear_layers:
        return min(config.max_num_seqs, HYBRID_GRAPH_MAX_BATCH)
    return config.max_num_seqs


def short_step_batch(config: EngineConfig) -> int:
    """The most sequences of a short prefill step captured as a graph."""
    return min(config.max_num_seqs, SHORT_STEP_MAX_BATCH)


def graph_bytes(model: ModelConfig, config: EngineConfig, max_blocks_per_seq: int) -> int:
    """Captured graphs: one memory pool sized by the largest step (decode batch or short
    prefill rows; the others reuse it) with the attention's split buffers, plus the static
    inputs and block tables (and the sliding tables of a sliding-window model), plus the
    hidden states between the segments of each short prefill step (kept by the pool)."""
    batch = graph_batch(model, config)
    rows = max(batch, SHORT_STEP_TOKENS[-1])
    seqs = max(batch, short_step_batch(config))
    tables = (4 if model.sliding_window else 2) * seqs * max_blocks_per_seq * 4
    split_rows = PAGED_SPLIT_PROGRAMS * PAGED_TILE_ROWS[config.kv_cache_dtype]
    splits = split_rows * (model.head_dim + 2) * 4
    global_layers = model.layer_kinds.count("full")
    short_rows = short_step_batch(config) * sum(SHORT_STEP_TOKENS)  # at most, over the shapes
    segments = short_rows * global_layers * model.hidden_size * item_bytes(config.resolved_dtype)
    return (
        activation_bytes(model, config, rows) + splits + tables + segments + GRAPH_POOL_SLACK_BYTES
    )


def plan_device_memory(
    model: ModelConfig,
    config: EngineConfig,
    device_bytes: int,
    weights_bytes: int,
    staging_bytes: int = 0,
    cuda_graphs: bool = False,
    free_bytes: int | None = None,
    chunk_tokens: int | None = None,
) -> DeviceMemoryPlan:
    """The budget of one engine on a device of `device_bytes`; ValueError naming every
    part when they do not fit `config.gpu_memory_fraction` of it.

    `weights_bytes`: what the loaded model holds (measured, or estimated by preflight);
    `staging_bytes`: the connector's device buffers; `cuda_graphs`: decode graphs will be
    captured. With `config.kv_cache_memory` the KV cache has that size and must fit too;
    otherwise it takes what is left and must hold at least one step's tokens.
    `free_bytes` (at start, the weights loaded): the device memory free now; the KV cache
    and the parts still to allocate must fit in it too (other processes, or other engines
    of this one, hold the rest). `chunk_tokens`: the pool's chunk, when there is a pool
    (a sliding-window model keeps the chunk not yet stored).
    """
    item = item_bytes(config.resolved_dtype)
    max_len = longest_context(model, config)
    states = model.state_bytes_per_sequence(item)
    parts = (
        ("weights", weights_bytes),
        ("CUDA runtime", CUDA_RUNTIME_BYTES),
        ("activations", activation_bytes(model, config, config.max_num_batched_tokens)),
        (ATTENTION_CONTEXT, attention_context_bytes(model, config)),
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
    row_bytes = kv_row_bytes(model, config)
    global_block, sliding_block = kv_bytes_per_block(model, config.block_size, row_bytes)
    minimum = config.max_num_batched_tokens * global_block // config.block_size
    if sliding_block:  # and one sequence's window + step of the sliding layers
        minimum += (sliding_block_bounds(model, config, chunk_tokens)[0] + 1) * sliding_block
    minimum = config.kv_cache_memory or minimum
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
            "or lower --max-num-seqs, --max-num-batched-tokens or --max-model-len (the "
            f"{ATTENTION_CONTEXT} is one layer's K and V of {max_len} tokens, in "
            f"{config.resolved_dtype}"
            + (" with a chunk of fp8 dequantizing" if config.kv_cache_dtype == "fp8" else "")
            + ")"
        )
    kv_bytes = config.kv_cache_memory or left
    return DeviceMemoryPlan(
        device_bytes,
        config.gpu_memory_fraction,
        parts,
        kv_bytes,
        split_kv_cache(model, config, kv_bytes, row_bytes, chunk_tokens),
    )
