"""The Triton paged kernel (decode, and chunks of a few tokens) equals SDPA over the same cache.

Without a GPU it runs in Triton's interpreter (TRITON_INTERPRET=1 must be set before triton
is imported: hence a subprocess); the GPU run checks it compiled (scripts/gpu_foundation.py).
Cases: GQA groups of 1, 2, 3 and 6; sliding windows shorter and longer than the context;
contexts of 1 token and not multiples of the block or tile; one split and several; then
chunks of 1-32 new tokens per sequence against a float32 SDPA with an explicit causal mask,
whose off-by-one variants must fail, and VarlenBackend's choice between paged and varlen.
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


def interpret(script: str, cases: list, *args: str) -> object:
    """Run script in Triton's interpreter (set before triton is imported: a subprocess),
    with the JSON of `cases` and `args` as its arguments."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_paged_decode_matches_sdpa_in_the_interpreter() -> None:
    errors = interpret(_SCRIPT, CASES)
    assert all(e < 1e-5 for e in errors), list(zip(CASES, errors))


# Several new tokens per sequence (the follow-up chunk after a restored prefix): causal,
# bottom-right aligned, with the engine's sliding window, through the same kernel.
CHUNK_CASES = [  # (heads, kv heads, head dim, window, splits, [(new tokens, context)])
    (4, 4, 32, None, 1, [(1, 45), (3, 70), (17, 17), (32, 100)]),
    (4, 2, 16, 24, 3, [(1, 130), (3, 29), (17, 200), (32, 77)]),
    (8, 2, 32, None, 4, [(32, 250), (17, 90), (1, 33), (3, 3)]),  # 2 query blocks of 64 rows
    (6, 2, 32, 40, None, [(5, 300), (1, 41), (32, 95)]),  # group 3, splits chosen by the host
    (8, 2, 16, 50, 2, [(32, 180), (3, 61), (1, 17)]),
    (4, 2, 32, 20, 2, [(1, 50), (1, 7)]),  # decode through the query-offset path
]

_CHUNK_SCRIPT = """
import json, sys
import torch
import torch.nn.functional as F
from kvshare.engine.attention import SDPABackend, StepMeta, VarlenBackend
from kvshare.engine.paged_decode import MAX_QUERY, paged_attention


def reference(q, k, v, meta, window, scale, shift=0):
    '''float32 SDPA with an explicit mask; query t of a sequence at ctx - q_len + t + shift.'''
    out, at = [], 0
    for table, n, c in zip(meta.block_tables, meta.q_lens, meta.ctx_lens):
        pos = torch.arange(c)
        slots = torch.tensor(table)[pos // meta.block_size] * meta.block_size + pos % meta.block_size
        q_pos = torch.arange(c - n, c)[:, None] + shift
        allowed = pos[None, :] <= q_pos
        if window is not None:
            allowed &= pos[None, :] > q_pos - window
        out.append(F.scaled_dot_product_attention(
            q[at:at + n].transpose(0, 1)[None], k[slots].transpose(0, 1)[None],
            v[slots].transpose(0, 1)[None], attn_mask=allowed, scale=scale, enable_gqa=True,
        )[0].transpose(0, 1))
        at += n
    return torch.cat(out)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def setup(heads, kv_heads, dim, seqs, seed):
    gen = torch.Generator().manual_seed(seed)
    bs, blocks = 16, 64
    k = torch.randn(blocks * bs, kv_heads, dim, generator=gen)
    v = torch.randn(blocks * bs, kv_heads, dim, generator=gen)
    order = torch.randperm(blocks, generator=gen).tolist()  # scrambled block tables
    tables, at = [], 0
    for _, c in seqs:
        n = -(-c // bs)
        tables.append(tuple(order[at:at + n]))
        at += n
    q = torch.randn(sum(n for n, _ in seqs), heads, dim, generator=gen)
    meta = StepMeta(q_lens=tuple(n for n, _ in seqs), ctx_lens=tuple(c for _, c in seqs),
                    block_tables=tuple(tables), block_size=bs, device=torch.device("cpu"))
    return q, k, v, meta


result = {"kernel": [], "engine": [], "teeth": []}
for heads, kv_heads, dim, window, splits, seqs in json.loads(sys.argv[1]):
    q, k, v, meta = setup(heads, kv_heads, dim, seqs, heads * 31 + dim)
    scale = dim ** -0.5
    t, c = meta.paged()
    out = paged_attention(q, k, v, t, c, meta.block_size, scale, window,
                          cu_seqlens_q=meta.cu_seqlens_q, max_q=meta.max_q, num_splits=splits)
    ref = reference(q, k, v, meta, window, scale)
    result["kernel"].append(rel(out, ref))
    result["engine"].append(rel(ref, SDPABackend().attend(q, k, v, meta, scale, window)))
    # Teeth: a query position off by one either way, or a window one key too wide, must show.
    wrong = [reference(q, k, v, meta, window, scale, shift) for shift in (-1, 1)]
    if window is not None:
        wrong.append(reference(q, k, v, meta, window + 1, scale))
    result["teeth"].append([rel(out, w) for w in wrong])

# The backend's routing: chunks up to MAX_QUERY tokens take the paged kernel, longer ones varlen.
backend, calls = VarlenBackend(4096), []
backend._varlen_attn = lambda q, *args, **kwargs: calls.append(q.shape[0]) or torch.zeros_like(q)
q, k, v, meta = setup(4, 2, 16, [(3, 40), (MAX_QUERY, 90), (1, 20)], 7)
result["routed_paged"] = rel(backend.attend(q, k, v, meta, 0.25, 30), reference(q, k, v, meta, 30, 0.25))
q, k, v, meta = setup(4, 2, 16, [(3, 40), (MAX_QUERY + 1, 90)], 8)
backend.attend(q, k, v, meta, 0.25, None)
result["varlen_calls"] = calls
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def chunk_results() -> dict:
    return interpret(_CHUNK_SCRIPT, CHUNK_CASES)  # type: ignore[return-value]


def test_paged_chunks_match_masked_sdpa_in_the_interpreter(chunk_results: dict) -> None:
    assert all(e < 1e-5 for e in chunk_results["kernel"]), list(
        zip(CHUNK_CASES, chunk_results["kernel"])
    )
    # The explicit-mask reference is the engine's convention (SDPABackend's _causal_mask).
    assert all(e < 1e-5 for e in chunk_results["engine"]), chunk_results["engine"]


def test_an_off_by_one_mask_fails_the_comparison(chunk_results: dict) -> None:
    for case, errors in zip(CHUNK_CASES, chunk_results["teeth"]):
        multi_token = max(n for n, _ in case[5]) > 1  # a lone query sees no future key to add
        checked = errors if multi_token else errors[:1] + errors[2:]
        assert all(not e < 1e-2 for e in checked), (case, errors)  # NaN (no key seen) fails too


def test_varlen_backend_routes_short_chunks_to_the_paged_kernel(chunk_results: dict) -> None:
    assert chunk_results["routed_paged"] < 1e-5
    from kvshare.engine.paged_decode import MAX_QUERY

    assert chunk_results["varlen_calls"] == [3 + MAX_QUERY + 1]  # only the long chunk's step


def test_a_lone_long_follow_up_fills_about_four_waves() -> None:
    """32 new tokens of a 16-KV-head, group-2 model (gemma3-27b's global layers): one query
    block of 64 rows per KV head, the context split into 33: 528 programs = 4 x 132 SMs."""
    pytest.importorskip("triton")
    from kvshare.engine.paged_decode import num_splits_for, split_tile

    assert split_tile(2, 32, 128, fp8=False, query_bytes=2).rows == 64
    for context in (32_768, 130_848, 262_144):
        assert num_splits_for(1, 16, context) * 16 == 528


def test_split_tiles_follow_the_cache_and_the_query() -> None:
    """Decode: the group's rows (at least 16), 64 keys, 4 warps. Several tokens: an fp8
    cache read by 16-bit queries takes 128 keys x 64 rows x 4 warps, a 16-bit cache 128
    rows (8 warps past a 32 KB accumulator), float32 queries the 64 x 64 tile."""
    pytest.importorskip("triton")
    from kvshare.engine.paged_decode import SplitTile, split_tile

    assert split_tile(6, 1, 256, fp8=True, query_bytes=2) == SplitTile(64, 16, 4)
    assert split_tile(32, 1, 128, fp8=False, query_bytes=2) == SplitTile(64, 32, 4)
    assert split_tile(6, 32, 256, fp8=True, query_bytes=2) == SplitTile(128, 64, 4)
    assert split_tile(6, 32, 256, fp8=False, query_bytes=2) == SplitTile(64, 128, 8)
    assert split_tile(2, 4, 128, fp8=False, query_bytes=2) == SplitTile(64, 16, 4)
    assert split_tile(6, 32, 256, fp8=True, query_bytes=4) == SplitTile(64, 64, 8)
    assert split_tile(4, 32, 64, fp8=False, query_bytes=4) == SplitTile(64, 64, 4)
    with pytest.raises(ValueError, match="powers of two"):
        SplitTile(96, 64, 4)
    with pytest.raises(ValueError, match="16 rows"):
        SplitTile(64, 8, 4)
