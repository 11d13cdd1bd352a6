"""The device-memory budget: every part a replica allocates is inside gpu_memory_fraction.

CPU tests of the arithmetic (`plan_device_memory`, and preflight's plan for a shape
preset); the parts are checked against what the engine's allocations hold
(RecurrentStates on the CPU); CUDA tests check that an engine started on the GPU
allocates no more than its plan.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvshare.engine.config import EngineConfig
from kvshare.engine.memory import (
    CUDA_RUNTIME_BYTES,
    DEQUANT_CHUNK_TOKENS,
    attention_context_bytes,
    kv_bytes_per_block,
    plan_device_memory,
    sliding_block_bounds,
    split_kv_cache,
    staging_bytes,
)
from kvshare.engine.recurrent_state import RecurrentStates
from kvshare.models.presets import SHAPE_PRESETS
from kvshare.preflight import device_plan

GIB = 1 << 30
H200 = 139 * GIB
QWEN35 = SHAPE_PRESETS["qwen3.5-27b"]


def bench_engine(**overrides: object) -> EngineConfig:
    """The H200 bench's replica: two per GPU, 8 sequences each."""
    options: dict[str, object] = {
        "device": "cuda",
        "gpu_memory_fraction": 0.48,
        "max_num_seqs": 8,
    }
    return EngineConfig(**(options | overrides))  # type: ignore[arg-type]


def test_qwen3_5_27b_at_0_48_of_an_h200_fits_and_names_every_part() -> None:
    plan = device_plan("shape:qwen3.5-27b", bench_engine(), H200, pool_chunk_tokens=256)
    assert plan is not None
    state = QWEN35.state_bytes_per_sequence(2)
    assert plan.part("weights") == QWEN35.num_parameters() * 2
    assert plan.part("recurrent-state slots") == 8 * state
    assert plan.part("state snapshots") == 8 * state  # num_state_snapshots
    page = len(QWEN35.attention_layers) * QWEN35.kv_bytes_per_token_per_layer * 2 * 256
    assert plan.part("pool staging") == staging_bytes(page) == 4 * (128 << 20)
    assert plan.part("activations") > 0 and plan.part("CUDA runtime") == CUDA_RUNTIME_BYTES
    assert 0 < plan.part("CUDA graphs") < (1 << 30)  # decode steps of 1 to 8 sequences
    assert plan.fixed_bytes + plan.kv_bytes == plan.limit == int(H200 * 0.48)
    # Two replicas' limits fit the device, and what is left for KV holds the bench's 128k.
    assert 2 * plan.limit <= H200
    kv_per_token = len(QWEN35.attention_layers) * QWEN35.kv_bytes_per_token_per_layer * 2
    assert plan.kv_bytes // kv_per_token >= 131072
    text = plan.describe()
    for name in ("weights", "recurrent-state slots", "state snapshots", "pool staging"):
        assert name in text


def test_a_fraction_too_small_fails_naming_the_parts_and_their_sizes() -> None:
    with pytest.raises(ValueError) as caught:
        device_plan(
            "shape:qwen3.5-27b", bench_engine(gpu_memory_fraction=0.38), H200, pool_chunk_tokens=256
        )
    message = str(caught.value)
    assert "--gpu-memory-fraction 0.38 of 139 GiB" in message
    for part in (
        "weights 50.10 GiB",
        "recurrent-state slots 1.15 GiB",
        "state snapshots 1.15 GiB",
        "pool staging 512 MiB",
        "activations",
        "CUDA runtime 2 GiB",
    ):
        assert part in message, message
    assert "KV cache for one step (4096 tokens" in message


def test_the_attention_context_is_one_layers_keys_of_max_model_len() -> None:
    """K and V of the longest context in bfloat16 (4 KV heads x 256 for qwen3.5-27b), and
    with fp8 one dequantizing chunk: packed rows (256 + 4 bytes) and float32 products."""
    weights = QWEN35.num_parameters() * 2
    plans = {}
    for kv in ("auto", "fp8"):
        for tokens in (4096, 32768, 262144):
            engine = bench_engine(max_model_len=tokens, kv_cache_dtype=kv)
            plan = plan_device_memory(QWEN35, engine, H200, weights)
            gathered = 2 * tokens * 4 * 256 * 2
            scratch = min(tokens, DEQUANT_CHUNK_TOKENS) * 4 * (260 + 4 * 256) if kv == "fp8" else 0
            assert plan.part("attention context") == gathered + scratch, (kv, tokens)
            assert attention_context_bytes(QWEN35, engine) == gathered + scratch
            plans[kv, tokens] = plan
    assert DEQUANT_CHUNK_TOKENS == 8192
    assert plans["fp8", 262144].part("attention context") == (1 << 30) + 42_074_112  # + 40.1 MiB
    # The KV cache gives up what the longer context's gather takes (nothing else changed).
    for kv in ("auto", "fp8"):
        short, long = plans[kv, 32768], plans[kv, 262144]
        grown = long.part("attention context") - short.part("attention context")
        assert grown == 2 * (262144 - 32768) * 4 * 256 * 2
        assert short.kv_bytes - long.kv_bytes == grown
    assert "attention context 1.04 GiB" in plans["fp8", 262144].describe()


def test_a_budget_without_the_longest_contexts_attention_fails_naming_it() -> None:
    """A 10 GiB KV cache fits beside the gather of a 32k context, not of 256k: start fails
    with every part named, the attention context among them."""
    weights = QWEN35.num_parameters() * 2
    engine = bench_engine(kv_cache_dtype="fp8", kv_cache_memory=10 * GIB)
    plan = plan_device_memory(QWEN35, replace(engine, max_model_len=32768), H200, weights)
    assert plan.kv_bytes == 10 * GIB
    with pytest.raises(ValueError) as caught:
        plan_device_memory(QWEN35, replace(engine, max_model_len=262144), H200, weights)
    message = str(caught.value)
    assert "attention context 1.04 GiB" in message and "weights 50.10 GiB" in message
    assert "the KV cache of 10 GiB (--kv-cache-memory)" in message
    assert "one layer's K and V of 262144 tokens, in bfloat16 with a chunk of fp8" in message


def test_two_qwen3_5_27b_fp8_replicas_with_256k_contexts_fit_an_h200() -> None:
    """The 256k fp8 run: two replicas at 0.48 of 139.8 GiB, 8,192-token steps, 8 sequences,
    max_model_len 262,144 (no pool: its staging would leave 258,160 tokens). Every part,
    the attention context included, fits the limit and the KV cache holds the context."""
    h200 = int(139.8 * GIB)
    engine = bench_engine(kv_cache_dtype="fp8", max_model_len=262144, max_num_batched_tokens=8192)
    plan = device_plan("shape:qwen3.5-27b", engine, h200)
    assert plan is not None and plan.split is not None
    assert 2 * plan.limit <= h200 and plan.fixed_bytes + plan.kv_bytes == plan.limit
    assert plan.part("attention context") == attention_context_bytes(QWEN35, engine)
    assert plan.split.context_tokens >= 262144
    # With the measured 50.3 GiB of weights it still does.
    measured = plan_device_memory(QWEN35, engine, h200, int(50.3 * GIB))
    assert measured.split is not None and measured.split.context_tokens >= 262144


def test_states_count_per_sequence_slot_and_per_snapshot() -> None:
    """The plan's state parts are exactly the bytes RecurrentStates allocates."""
    tiny = SHAPE_PRESETS["tiny-qwen3.5"]
    config = EngineConfig(device="cuda", max_num_seqs=5, num_state_snapshots=3, dtype="float32")
    plan = plan_device_memory(tiny, config, 8 * GIB, weights_bytes=1 << 20)
    states = RecurrentStates(tiny, 5, 3, torch.float32, torch.device("cpu"))
    assert plan.part("recurrent-state slots") + plan.part("state snapshots") == (
        states.rows.numel() * states.rows.element_size()
    )


def test_a_given_kv_cache_must_fit_beside_the_other_parts() -> None:
    config = bench_engine(kv_cache_memory=20 * GIB)
    with pytest.raises(ValueError, match=r"the KV cache of 20 GiB \(--kv-cache-memory\)"):
        plan_device_memory(QWEN35, config, H200, weights_bytes=QWEN35.num_parameters() * 2)
    plan = plan_device_memory(
        QWEN35, bench_engine(kv_cache_memory=4 * GIB), H200, QWEN35.num_parameters() * 2
    )
    assert plan.kv_bytes == 4 * GIB and plan.fixed_bytes + plan.kv_bytes <= plan.limit


def test_the_kv_cache_fits_what_is_free_now() -> None:
    """Another engine of the process (or another process) holds memory: the KV cache
    shrinks to what is free beside the parts still to allocate, or start fails."""
    weights = QWEN35.num_parameters() * 2
    alone = plan_device_memory(QWEN35, bench_engine(), H200, weights)
    later = alone.fixed_bytes - weights - CUDA_RUNTIME_BYTES
    squeezed = plan_device_memory(QWEN35, bench_engine(), H200, weights, free_bytes=later + 3 * GIB)
    assert squeezed.kv_bytes == 3 * GIB < alone.kv_bytes
    with pytest.raises(ValueError, match=r"1 GiB free now"):
        plan_device_memory(QWEN35, bench_engine(), H200, weights, free_bytes=1 * GIB)


def test_graphs_and_staging_are_charged_when_present() -> None:
    gemma = SHAPE_PRESETS["gemma3-27b"]
    weights = gemma.num_parameters() * 2
    bare = plan_device_memory(gemma, bench_engine(), H200, weights)
    full = plan_device_memory(
        gemma, bench_engine(), H200, weights, staging_bytes=512 << 20, cuda_graphs=True
    )
    assert full.part("CUDA graphs") > 0
    assert bare.kv_bytes - full.kv_bytes == full.part("CUDA graphs") + (512 << 20)


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["shape:tiny-qwen3.5", "shape:tiny-gemma3"])
def test_an_engine_on_the_gpu_allocates_within_its_plan(model: str) -> None:
    from kvshare import LLM, SamplingParams

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    llm = LLM(model, device="cuda", gpu_memory_fraction=0.1, max_num_seqs=4)
    plan = llm.engine.runner.memory
    assert plan is not None
    llm.generate([[5] * 300], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    used = torch.cuda.max_memory_allocated() - before
    assert used <= plan.limit - plan.part("CUDA runtime"), (used, plan.describe())


def up(*flags: str) -> object:
    from kvshare.serve.launcher import UpConfig

    return UpConfig.from_args(
        ["--model", "shape:qwen3.5-27b", "--device", "cuda", "--replicas", "2", *flags]
    )


@pytest.fixture
def fake_h200(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU machine that preflight sees as one idle H200."""
    from types import SimpleNamespace

    from kvshare import preflight

    monkeypatch.setattr(preflight, "check_device", lambda device: None)
    monkeypatch.setattr(preflight, "available_bytes", lambda device: H200 - GIB)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=H200)
    )


def test_kvshare_up_checks_each_replicas_whole_budget(fake_h200: None) -> None:
    from kvshare.preflight import check_up

    check_up(up("--gpu-memory-fraction", "0.48", "--max-num-seqs", "8"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"recurrent-state slots 9\.18 GiB.*not enough"):
        check_up(up("--gpu-memory-fraction", "0.40"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"takes 2 x 83\.40 GiB"):
        check_up(up("--gpu-memory-fraction", "0.6"))  # type: ignore[arg-type]


def test_two_gemma3_27b_replicas_with_130k_contexts_fit_an_h200() -> None:
    """The sliding-window layers (52 of 62) count their window + step per sequence, not
    the context: the KV cache of one replica at 0.49 holds a 130,816-token context with
    every global layer and the sliding layers' windows; a full-length cache would not.
    (At 0.48 the 1 GiB attention context leaves 129,776 tokens.)"""
    gemma = SHAPE_PRESETS["gemma3-27b"]
    h200 = int(139.8 * GIB)
    engine = bench_engine(max_model_len=131072, gpu_memory_fraction=0.49)
    plan = device_plan("shape:gemma3-27b", engine, h200, pool_chunk_tokens=256)
    assert plan is not None and plan.split is not None
    assert 2 * plan.limit <= h200
    assert plan.fixed_bytes + plan.kv_bytes == plan.limit
    split = plan.split
    assert split.context_tokens >= 131072 > 130816
    global_block, sliding_block = kv_bytes_per_block(gemma, 16, 2 * gemma.head_dim)
    assert (
        split.num_blocks * global_block + split.num_sliding_blocks * sliding_block <= plan.kv_bytes
    )
    fewest, most = sliding_block_bounds(gemma, engine, 256)
    assert fewest == -(-(1024 - 1 + 4096) // 16) + 1  # one sequence's window + a 4,096-token step
    assert fewest < split.num_sliding_blocks <= most + 1
    full_length = 130816 * len(gemma.attention_layers) * gemma.kv_bytes_per_token_per_layer * 2
    assert full_length > 4 * plan.kv_bytes  # 61.9 GiB: what every layer at full length needs
    assert f"{split.context_tokens} tokens of context, sliding windows" in plan.describe()


def test_the_cpu_cache_is_split_as_planned() -> None:
    """The engine allocates the split the plan computes (CPU: the given KV size)."""
    from kvshare import LLM

    llm = LLM(
        "shape:tiny-gemma3",
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=48,
        kv_cache_memory=1 << 20,
    )
    layout = llm.engine.runner.layout
    assert layout.sliding_kv is not None
    split = split_kv_cache(
        SHAPE_PRESETS["tiny-gemma3"], llm.config, 1 << 20, llm.engine.runner.kv_row_bytes
    )
    assert (layout.kv.shape[2], layout.sliding_kv.shape[2]) == (
        split.num_blocks,
        split.num_sliding_blocks,
    )
    assert split.context_tokens >= 512
    assert layout.kv.shape[0] == 1 and layout.sliding_kv.shape[0] == 5
    total = layout.kv.numel() + layout.sliding_kv.numel()
    assert total * 4 <= 1 << 20
