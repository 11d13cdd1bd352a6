"""A step while a restore in groups of layers is still copied: each layer waits for its own
group only. Eagerly the attention layer runs its slot's wait; a captured short prefill
step replays segments of layers, running before each segment the waits of the slots its
layers touch; a decode step (one graph) waits for everything first."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from kvshare import LLM, SamplingParams
from kvshare.engine.attention import StepInputs
from kvshare.engine.connector import SlotFences
from kvshare.engine.cuda_graphs import StepGraphs, _Segment, _SegmentedStep, layer_segments
from kvshare.engine.model_runner import ModelRunner
from tests.engine.test_cuda_graphs import forward_in_segments


class RecordingGraphs:
    """Stands in for StepGraphs: every step has a shape; a replay runs the wait of slot 0
    only and returns zeros."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.pending_at_replay: list[int] = []

    def shape_for(self, q_lens: tuple[int, ...]) -> tuple[int, int]:
        return len(q_lens), sum(q_lens)

    def run(self, step: StepInputs, fences: SlotFences) -> torch.Tensor:
        self.pending_at_replay.append(len(fences))
        fences.before(0)
        hidden = self.runner.model.config.hidden_size
        return torch.zeros(len(step.input_ids), hidden, dtype=self.runner.dtype)


def test_a_replayed_step_gets_the_pending_waits_and_none_outlive_it() -> None:
    llm = LLM("shape:tiny-llama")
    engine, runner = llm.engine, llm.engine.runner
    graphs = RecordingGraphs(runner)
    runner.graphs = graphs  # type: ignore[assignment]
    waited: list[int] = []
    last_slot = runner.layout.num_slots - 1
    runner.fences.add(0, 1, lambda: waited.append(0))
    runner.fences.add(last_slot, last_slot + 1, lambda: waited.append(last_slot))
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=1, temperature=0.0))
    runner.execute(engine.scheduler.schedule())
    assert graphs.pending_at_replay == [2]  # the replay, not the runner, ran slot 0's wait
    assert waited == [0, last_slot] and not runner.fences


class LoggedGraph:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def replay(self) -> None:
        self.log.append(self.name)


def _graphs_with_logged_segments(model: str, log: list[str]) -> tuple[StepGraphs, list[range]]:
    """A StepGraphs whose short shape (1, 32) is the model's segments, each replay logged
    (no capture: only the replay order is under test), and a decode graph for (1, 1)."""
    runner = LLM(model).engine.runner
    segments = layer_segments(runner.layout, runner.model.config.num_layers)
    slot_of = runner.layout.layer_slot
    graphs = object.__new__(StepGraphs)
    out = torch.zeros(1)
    graphs.segmented = {
        (1, 32): _SegmentedStep(
            [
                _Segment(
                    LoggedGraph(f"segment {i}", log),  # type: ignore[arg-type]
                    tuple(slot_of[j] for j in layers if slot_of[j] >= 0),
                    out,
                )
                for i, layers in enumerate(segments)
            ],
            {},
        )
    }
    graphs.graphs = {(1, 1): (LoggedGraph("decode", log), out)}  # type: ignore[dict-item]
    return graphs, segments


def test_each_segment_replays_after_the_waits_of_its_own_slots_only() -> None:
    log: list[str] = []
    graphs, segments = _graphs_with_logged_segments("shape:tiny-qwen3.5", log)
    assert len(segments) > 2
    fences = SlotFences()
    for slot in range(2):  # tiny-qwen3.5: two attention layers, a load in two groups
        fences.add(slot, slot + 1, lambda slot=slot: log.append(f"wait {slot}"))
    graphs._replay((1, 32), fences)
    # Segment 0 holds linear-attention layers only; each later one starts at an attention
    # layer: its slot's copies are waited for right before it, not before the step.
    assert log[:4] == ["segment 0", "wait 0", "segment 1", "wait 1"], log
    assert log[4:] == [f"segment {i}" for i in range(2, len(segments))]
    assert not fences
    log.clear()
    fences.add(0, 2, lambda: log.append("wait all"))
    graphs._replay((1, 1), fences)
    assert log == ["wait all", "decode"]


@pytest.mark.parametrize("model", ["shape:tiny-llama", "shape:tiny-gemma3", "shape:tiny-qwen3.5"])
def test_the_segments_partition_the_layers_each_starting_at_a_global_layer(model: str) -> None:
    runner = LLM(model).engine.runner
    layout, config = runner.layout, runner.model.config
    segments = layer_segments(layout, config.num_layers)
    assert [i for layers in segments for i in layers] == list(range(config.num_layers))
    global_layers = [
        i for i, slot in enumerate(layout.layer_slot) if 0 <= slot < layout.num_global_slots
    ]
    assert [layers.start for layers in segments] == sorted({0, *global_layers})


def _first_step_logits(model: str, segmented: bool) -> torch.Tensor:
    llm = LLM(model, dtype="float32", weights_seed=3)
    runner = llm.engine.runner
    if segmented:
        lm = runner.model
        lm.forward = partial(forward_in_segments, lm, runner.layout)  # type: ignore[method-assign]
    prompt = [(5 * j) % 90 + 7 for j in range(40)]
    llm.engine.add_request("a", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    logits = runner.execute(llm.engine.scheduler.schedule())
    assert logits is not None
    return logits


@pytest.mark.parametrize("model", ["shape:tiny-llama", "shape:tiny-gemma3", "shape:tiny-qwen3.5"])
def test_the_segments_run_in_order_compute_the_forward(model: str) -> None:
    assert torch.equal(_first_step_logits(model, False), _first_step_logits(model, True))
