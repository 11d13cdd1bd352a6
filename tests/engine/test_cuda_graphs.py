"""A captured decode step computes what the eager step computes.

The graph path's own code (static buffers, padding rows into the trash block, a hybrid
model's static state slots, its step metadata and the paged-decode kernel) runs here
without the capture: in Triton's interpreter on the CPU (TRITON_INTERPRET=1 must be set
before triton is imported: hence a subprocess). The GPU run (scripts/gpu_foundation.py,
section graphs) and the CUDA test below replay real graphs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_SCRIPT = """
import json, sys
import torch
from kvshare import LLM
from kvshare.engine.attention import VarlenBackend
from kvshare.engine.cuda_graphs import DecodeGraphs
from kvshare.engine.sampling_params import SamplingParams


class EagerGraphs(DecodeGraphs):
    '''DecodeGraphs whose "replay" runs the captured function eagerly.'''

    def _capture_all(self, backend):
        self.backend = backend

    def _replay(self, batch):
        with torch.inference_mode():
            return self.model(*self._args(batch, self.backend))


out = {}
for model in sys.argv[1:]:
    llm = LLM(model, dtype="float32", max_num_seqs=8, weights_seed=5)
    engine, runner = llm.engine, llm.engine.runner
    if runner.states is not None:  # the sequences' slots are then not the static list's 0, 1, 2
        runner.states.allocate()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((5, 70, 150)):  # 150 > tiny-gemma3's window of 64
        engine.add_request(str(i), [(7 * i + 3 * j) % 200 + 10 for j in range(n)], params)
    engine.step()  # prefill: every sequence has its first token
    chunks = engine.scheduler.schedule()
    assert len(chunks) == 3 and all(c.num_new_tokens == 1 for c in chunks)
    states = runner.states  # a hybrid step advances its states: both runs start from these
    before = None if states is None else states.rows.clone()
    eager = runner.execute(chunks)
    state_error = 0.0
    if states is not None:
        after, real = states.rows.clone(), [c.seq.state_slot for c in chunks]
        states.rows.copy_(before)
    runner.graphs = EagerGraphs(runner.model, runner.layout, VarlenBackend(8192),
                                max_batch=8, max_blocks_per_seq=32, states=states)
    graph = runner.execute(chunks)  # bucket 4 (one padding row into the trash block); hybrid: 3
    if states is not None:  # the sequences' new states, as the eager step wrote them
        new, expected = states.rows[real].view(torch.float32), after[real].view(torch.float32)
        state_error = ((new - expected).norm() / expected.norm()).item()
    out[model] = [((graph - eager).norm() / eager.norm()).item(), state_error]
print(json.dumps(out))
"""


def test_graph_decode_step_equals_eager_in_the_interpreter() -> None:
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
    assert all(logits < 1e-5 and states < 1e-5 for logits, states in errors.values()), errors


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["shape:tiny-llama", "shape:tiny-qwen3.5"])
def test_a_replayed_decode_step_equals_the_eager_one_on_the_gpu(model: str) -> None:
    """Real capture and replay (the hybrid model's linear-attention layers included): a
    decode step of 3 sequences (bucket 4 with one padding row; the hybrid model's own
    bucket of 3) gives the logits and, for the hybrid model, the new recurrent states of
    the same step run eagerly."""
    import torch

    from kvshare import LLM
    from kvshare.engine.sampling_params import SamplingParams

    llm = LLM(model, device="cuda", dtype="bfloat16", max_num_seqs=8, weights_seed=5)
    engine, runner = llm.engine, llm.engine.runner
    assert runner.graphs is not None
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((5, 70, 150)):
        engine.add_request(str(i), [(7 * i + 3 * j) % 200 + 10 for j in range(n)], params)
    engine.step()
    chunks = engine.scheduler.schedule()
    assert len(chunks) == 3 and all(c.num_new_tokens == 1 for c in chunks)
    states = runner.states
    before = None if states is None else states.rows.clone()
    graphs, runner.graphs = runner.graphs, None
    eager = runner.execute(chunks)
    assert eager is not None
    if states is not None and before is not None:
        after, real = states.rows.clone(), [c.seq.state_slot for c in chunks]
        states.rows.copy_(before)
    runner.graphs = graphs
    replayed = runner.execute(chunks)
    assert replayed is not None
    assert ((replayed - eager).norm() / eager.norm()).item() < 1e-2
    if states is not None:
        new, expected = states.rows[real], after[real]
        conv_bytes = states.conv_bytes  # compare the float32 recurrent parts as floats
        for layer in range(len(states.layers)):
            base = layer * (states.conv_bytes + states.rec_bytes) + conv_bytes
            got = new[:, base : base + states.rec_bytes].view(torch.float32)
            want = expected[:, base : base + states.rec_bytes].view(torch.float32)
            assert ((got - want).norm() / want.norm()).item() < 1e-2, layer
