"""The Triton paged-decode kernel equals SDPA over the same paged cache.

Without a GPU it runs in Triton's interpreter (TRITON_INTERPRET=1 must be set before triton
is imported: hence a subprocess); the GPU run checks it compiled (scripts/gpu_foundation.py).
Cases: GQA groups of 1, 2, 3 and 6; sliding windows shorter and longer than the context;
contexts of 1 token and not multiples of the block or tile; one split and several.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CASES = [  # (heads, kv heads, head dim, window, splits, contexts)
    (4, 4, 32, None, 1, [1, 17, 64]),
    (6, 2, 32, None, 3, [5, 200, 129]),
    (9, 3, 64, 20, 2, [37, 15, 300]),
    (12, 2, 16, 1000, 4, [70, 1, 260]),
]

_SCRIPT = """
import json, sys
import torch
from kvshare.engine.attention import SDPABackend, StepMeta
from kvshare.engine.paged_decode import paged_decode_attention
errors = []
for heads, kv_heads, dim, window, splits, contexts in json.loads(sys.argv[1]):
    gen = torch.Generator().manual_seed(heads * 31 + dim)
    bs, blocks = 16, 64
    k = torch.randn(blocks * bs, kv_heads, dim, generator=gen)
    v = torch.randn(blocks * bs, kv_heads, dim, generator=gen)
    order = torch.randperm(blocks, generator=gen).tolist()
    tables, at = [], 0
    for c in contexts:
        n = -(-c // bs)
        tables.append(tuple(order[at:at + n]))
        at += n
    q = torch.randn(len(contexts), heads, dim, generator=gen)
    meta = StepMeta(q_lens=(1,) * len(contexts), ctx_lens=tuple(contexts), block_tables=tuple(tables),
                    block_size=bs, device=torch.device("cpu"))
    ref = SDPABackend().attend(q, k, v, meta, dim ** -0.5, window)
    t, c = meta.paged()
    out = paged_decode_attention(q, k, v, t, c, bs, dim ** -0.5, window, num_splits=splits)
    errors.append(((out - ref).norm() / ref.norm()).item())
print(json.dumps(errors))
"""


def test_paged_decode_matches_sdpa_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(CASES)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    errors = json.loads(result.stdout)
    assert all(e < 1e-5 for e in errors), list(zip(CASES, errors))
