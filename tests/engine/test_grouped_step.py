"""A step while a restore in groups of layers is still copied runs eagerly, each attention
layer waiting for its own group; a captured graph would wait for the whole load (it cannot
wait per layer). Without pending waits the step replays its graph."""

from __future__ import annotations

import torch

from kvshare import LLM, SamplingParams
from kvshare.engine.attention import StepInputs
from kvshare.engine.model_runner import ModelRunner


class RecordingGraphs:
    """Stands in for StepGraphs: every step has a shape; a replay runs the step eagerly."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.replays = 0

    def shape_for(self, q_lens: tuple[int, ...]) -> tuple[int, int]:
        return len(q_lens), sum(q_lens)

    def run(self, step: StepInputs) -> torch.Tensor:
        self.replays += 1
        return self.runner._forward(step)


def test_a_step_with_pending_layer_waits_runs_eagerly_and_runs_them() -> None:
    llm = LLM("shape:tiny-llama")
    engine, runner = llm.engine, llm.engine.runner
    graphs = RecordingGraphs(runner)
    runner.graphs = graphs  # type: ignore[assignment]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine.add_request("a", list(range(3, 40)), params)
    runner.execute(engine.scheduler.schedule())
    assert graphs.replays == 1
    waited: list[int] = []
    last_slot = runner.layout.num_slots - 1
    runner.fences.add(0, 1, lambda: waited.append(0))
    runner.fences.add(last_slot, last_slot + 1, lambda: waited.append(last_slot))
    engine.add_request("b", list(range(5, 50)), params)
    runner.execute([c for c in engine.scheduler.schedule() if c.seq.request_id == "b"])
    assert graphs.replays == 1  # eager
    assert sorted(waited) == [0, last_slot] and not runner.fences
