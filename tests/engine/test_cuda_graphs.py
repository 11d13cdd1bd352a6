"""A captured decode step computes what the eager step computes.

The graph path's own code (static buffers, padding rows into the trash block, its step
metadata and the paged-decode kernel) runs here without the capture: in Triton's
interpreter on the CPU (TRITON_INTERPRET=1 must be set before triton is imported: hence a
subprocess). The GPU run (scripts/gpu_foundation.py, section graphs) replays real graphs.
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
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((5, 70, 150)):  # 150 > tiny-gemma3's window of 64
        engine.add_request(str(i), [(7 * i + 3 * j) % 200 + 10 for j in range(n)], params)
    engine.step()  # prefill: every sequence has its first token
    chunks = engine.scheduler.schedule()
    assert len(chunks) == 3 and all(c.num_new_tokens == 1 for c in chunks)
    eager = runner.execute(chunks)
    runner.graphs = EagerGraphs(runner.model, runner.layout, VarlenBackend(8192),
                                max_batch=8, max_blocks_per_seq=32)
    graph = runner.execute(chunks)  # bucket 4: one padding row into the trash block
    out[model] = ((graph - eager).norm() / eager.norm()).item()
print(json.dumps(out))
"""


def test_graph_decode_step_equals_eager_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, "shape:tiny-llama", "shape:tiny-gemma3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    errors = json.loads(result.stdout)
    assert all(e < 1e-5 for e in errors.values()), errors
