"""A captured decode or short prefill step computes what the eager step computes.

The graph path's own code (static buffers, padding rows into the trash block, a hybrid
model's static state slots and prefill tables, its step metadata and the paged kernels)
runs here without the capture: in Triton's interpreter on the CPU (TRITON_INTERPRET=1 must
be set before triton is imported: hence a subprocess). The GPU run (scripts/gpu_foundation.py,
section graphs) and the CUDA tests below replay real graphs.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvshare import LLM
from kvshare.engine.connector import KVCacheLayout, SlotFences
from kvshare.engine.cuda_graphs import (
    StepGraphs,
    graph_buckets,
    graph_shape,
    layer_segments,
    short_shapes,
)
from kvshare.engine.model_runner import ModelRunner
from kvshare.engine.sampling_params import SamplingParams
from kvshare.engine.scheduler import ScheduledChunk
from kvshare.models.attention import AttentionContext
from kvshare.models.decoder import CausalLM


class EagerGraphs(StepGraphs):
    """StepGraphs whose "replay" runs the captured functions eagerly (no CUDA needed): a
    short prefill step in its segments of layers, one after another."""

    def _capture_all(self, backend: Any) -> None:
        self.backend = backend

    def _replay(self, shape: tuple[int, int], fences: SlotFences) -> torch.Tensor:
        fences.drain()
        with torch.inference_mode():
            input_ids, positions, ctx = self._args(shape, self.backend)
            if shape not in self.short:
                return self.model(input_ids, positions, ctx)
            return forward_in_segments(self.model, self.layout, input_ids, positions, ctx)


def forward_in_segments(
    model: CausalLM,
    layout: KVCacheLayout,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    ctx: AttentionContext,
) -> torch.Tensor:
    """The model's forward run segment by segment, as a short step's graphs replay it."""
    hidden, rope = model.embed(input_ids, positions)
    for layers in layer_segments(layout, model.config.num_layers):
        hidden = model.forward_layers(hidden, rope, ctx, layers)
    return hidden


def compare(runner: ModelRunner, chunks: list[ScheduledChunk]) -> list[float]:
    """[relative error of the logits, largest relative error of a layer's new recurrent
    states (0 without)]: the graph path against the same step run eagerly, both from the
    same states."""
    states = runner.states  # a hybrid step advances its states: both runs start from these
    before = None if states is None else states.rows.clone()
    graphs, runner.graphs = runner.graphs, None
    eager = runner.execute(chunks)
    assert eager is not None
    if states is not None and before is not None:
        after, real = states.rows.clone(), [c.seq.state_slot for c in chunks]
        states.rows.copy_(before)
    runner.graphs = graphs
    graph = runner.execute(chunks)
    assert graph is not None
    state_error = 0.0
    if states is not None:
        new, expected = states.rows[real], after[real]
        for layer in range(len(states.layers)):  # the float32 recurrent parts, as floats
            base = layer * (states.conv_bytes + states.rec_bytes) + states.conv_bytes
            got = new[:, base : base + states.rec_bytes].view(torch.float32)
            want = expected[:, base : base + states.rec_bytes].view(torch.float32)
            state_error = max(state_error, ((got - want).norm() / want.norm()).item())
    return [((graph - eager).norm() / eager.norm()).item(), state_error]


def _prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 3 * j) % 200 + 10 for j in range(n)]


def graph_errors(make: Callable[..., tuple[Any, ModelRunner]]) -> dict[str, list[float]]:
    """The graph path against eager for: a decode step of 3 sequences (bucket 4 with one
    padding row; a hybrid model's own bucket of 3); a prompt's last 24 tokens after 126
    in the cache (short shape (1, 32), 8 padding rows); the same beside a decode (short
    shape (2, 32), the decode's row through the prefill kernels). `make(**engine args)`
    returns (engine, runner) with graphs."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine, runner = make()
    for i, n in enumerate((5, 70, 150)):  # 150 > tiny-gemma3's window of 64
        engine.add_request(str(i), _prompt(i, n), params)
    engine.step()  # prefill: every sequence has its first token
    chunks = engine.scheduler.schedule()
    assert [c.num_new_tokens for c in chunks] == [1, 1, 1]
    errors = {"decode": compare(runner, chunks)}
    del engine, runner, chunks  # one engine at a time
    engine, runner = make(max_num_batched_tokens=128)
    for i, n in enumerate((5, 70)):
        engine.add_request(str(i), _prompt(i, n), params)
    engine.step()
    engine.add_request("2", _prompt(2, 150), params)
    engine.step()  # two decodes, and the first 126 tokens of the new prompt
    chunks = engine.scheduler.schedule()
    assert [c.num_new_tokens for c in chunks] == [1, 1, 24], chunks
    errors["short"] = compare(runner, chunks[2:])
    errors["short_and_decode"] = compare(runner, [chunks[0], chunks[2]])
    return errors


_SCRIPT = """
import json, sys
from kvshare import LLM
from kvshare.engine.attention import VarlenBackend
from tests.engine.test_cuda_graphs import EagerGraphs, graph_errors


def make(model):
    def engine_for(**kwargs):
        llm = LLM(model, dtype="float32", max_num_seqs=8, weights_seed=5, **kwargs)
        runner = llm.engine.runner
        if runner.states is not None:  # the sequences' slots are then not the static 0, 1, 2
            runner.states.allocate()
        runner.graphs = EagerGraphs(runner.model, runner.layout, VarlenBackend(8192),
                                    max_batch=8, max_blocks_per_seq=32, states=runner.states,
                                    short_batch=2)
        return llm.engine, runner
    return engine_for


print(json.dumps({model: graph_errors(make(model)) for model in sys.argv[1:]}))
"""


def test_graph_steps_equal_eager_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _SCRIPT,
            "shape:tiny-llama",
            "shape:tiny-gemma3",
            "shape:tiny-qwen3.5",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    errors = json.loads(result.stdout)
    assert all(
        logits < 1e-5 and states < 1e-5
        for steps in errors.values()
        for logits, states in steps.values()
    ), errors


@pytest.mark.parametrize(
    ("q_lens", "hybrid", "shape"),
    [
        ((1,), False, (1, 1)),
        ((1, 1, 1), False, (4, 4)),  # one padding row
        ((1, 1, 1), True, (3, 3)),  # a hybrid model's exact batch
        ((1,) * 9, True, None),  # past the captured hybrid batches (8 here)
        ((24,), False, (1, 32)),  # a question after a cached prefix: 8 padding rows
        ((1, 24), True, (2, 32)),  # beside a decode
        ((64,), False, (1, 64)),
        ((65,), False, None),  # past the paged kernel's MAX_QUERY: varlen, eagerly
        ((40, 40), False, None),  # more rows than any captured short step
        ((2, 2, 2), False, None),  # three sequences: no short shape
    ],
)
def test_a_step_replays_in_the_smallest_captured_shape_that_holds_it(
    q_lens: tuple[int, ...], hybrid: bool, shape: tuple[int, int] | None
) -> None:
    buckets = graph_buckets(8, exact=hybrid)
    assert graph_shape(q_lens, buckets, short_shapes(2)) == shape


def test_the_short_step_limit_is_the_paged_kernels() -> None:
    pytest.importorskip("triton")
    from kvshare.engine import cuda_graphs, paged_decode

    assert cuda_graphs.MAX_QUERY == paged_decode.MAX_QUERY


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_the_graph_budget_holds_the_paged_kernels_tiles(kv_cache_dtype: str) -> None:
    """memory.graph_bytes counts split buffers of PAGED_TILE_ROWS query rows a program: no
    tile the kernel picks for a captured short step has more (16-bit queries, any group
    and head dim of the presets)."""
    pytest.importorskip("triton")
    from kvshare.engine import memory, paged_decode

    rows = max(
        paged_decode.split_tile(group, tokens, head_dim, kv_cache_dtype == "fp8", 2).rows
        for group in (1, 2, 4, 6, 8, 16)
        for tokens in (1, *memory.SHORT_STEP_TOKENS)
        for head_dim in (64, 128, 256)
    )
    assert rows == memory.PAGED_TILE_ROWS[kv_cache_dtype]


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["shape:tiny-llama", "shape:tiny-gemma3", "shape:tiny-qwen3.5"])
def test_replayed_steps_equal_the_eager_ones_on_the_gpu(model: str) -> None:
    """Real capture and replay, the hybrid model's linear-attention layers included: the
    steps of `graph_errors` give the logits and new recurrent states of the eager steps."""

    def engine_for(**kwargs: Any) -> tuple[Any, ModelRunner]:
        gc.collect()  # the previous engine's cache goes first
        llm = LLM(
            model,
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=8,
            weights_seed=5,
            kv_cache_memory=256 << 20,
            **kwargs,
        )
        assert llm.engine.runner.graphs is not None
        return llm.engine, llm.engine.runner

    errors = graph_errors(engine_for)
    assert all(logits < 1e-2 and states < 1e-2 for logits, states in errors.values()), errors
