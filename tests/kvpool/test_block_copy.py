"""The block-copy kernel moves exactly what index_copy_ (load) and index_select (store) move.

The kernel runs in Triton's interpreter on the CPU (TRITON_INTERPRET=1 must be set before
triton is imported: hence a subprocess), on tiny caches: bf16 and float32, int64 and int32
words, chunks that take several masked loop iterations, first_block > 0 (and a page with
nothing left to load), global-only pages, rows of one later slot (a load in groups of
layers), several pages per group, shuffled block ids. Broken variants (block id off by
one, wrong cache stride, the rows' first slot ignored) must fail the same comparisons.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_SCRIPT = """
import json
import numpy as np
import torch
from kvshare.kvpool.block_copy import BlockCopy

NUM_SLOTS, NUM_BLOCKS, BPP = 3, 16, 3
SHAPES = {  # name: (dtype, block_size, kv_heads, head_dim, block_words)
    "bf16-int64": (torch.bfloat16, 2, 3, 4, 4),     # 48-byte chunks: 6 words, 2 iterations
    "f32-int64": (torch.float32, 2, 3, 4, 8),       # 96-byte chunks: 12 words, 2 iterations
    "bf16-int32": (torch.bfloat16, 2, 1, 3, 1024),  # 12-byte chunks: 3 int32 words
}
FIRSTS = [0, 1, 2, 3]  # first_block per page of a load; page 3 has nothing left to load
GROUPS = [range(0, 3), range(3, 4)]


class OffByOne(BlockCopy):
    def pairs(self, blocks, first_blocks):
        table, offsets = super().pairs(blocks, first_blocks)
        table[:, 2] = (table[:, 2] + 1) % NUM_BLOCKS
        return table, offsets


class SlotIgnored(BlockCopy):
    def __call__(self, rows, pairs, first_page, to_cache, first_slot=0):
        super().__call__(rows, pairs, first_page, to_cache, 0)


def wrong_stride(kv, bpp, block_words):
    copier = BlockCopy(kv, bpp, block_words)
    copier.num_blocks -= 1
    return copier


def as_bytes(t):
    return t.reshape(-1).view(torch.uint8)


def case(make, shape, direction, slots, first_slot, seed):
    dtype, bs, heads, dim, block_words = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    kv0 = torch.randn(NUM_SLOTS, 2, NUM_BLOCKS, bs, heads, dim, generator=gen).to(dtype)
    nbytes = slots * 2 * BPP * bs * heads * dim * kv0.element_size()
    pages = len(FIRSTS)
    # The staging buffer is larger than the pages: bytes past them must stay as they are.
    buf0 = torch.randint(0, 256, (pages * nbytes + 64,), dtype=torch.uint8, generator=gen)
    order = np.random.default_rng(seed).permutation(NUM_BLOCKS)[: pages * BPP]
    blocks = [tuple(int(b) for b in order[i * BPP:(i + 1) * BPP]) for i in range(pages)]
    firsts = FIRSTS if direction == "load" else [0] * pages

    kv_ref, buf_ref = kv0.clone(), buf0.clone()
    rows_ref = buf_ref[: pages * nbytes].view(pages, nbytes)
    part = kv_ref[first_slot : first_slot + slots]
    for i, (b, f) in enumerate(zip(blocks, firsts)):
        view = rows_ref[i].view(dtype).view(slots, 2, BPP, bs, heads, dim)
        if direction == "load":
            part.index_copy_(2, torch.tensor(b[f:], dtype=torch.int64), view[:, :, f:])
        else:
            torch.index_select(part, 2, torch.tensor(b, dtype=torch.int64), out=view)

    kv, buf = kv0.clone(), buf0.clone()
    rows = buf[: pages * nbytes].view(pages, nbytes)
    copier = make(kv, BPP, block_words)
    table, offsets = copier.pairs(blocks, firsts)
    pairs = torch.from_numpy(table)
    for g in GROUPS:
        copier(rows[g.start:g.stop], pairs[offsets[g.start]:offsets[g.stop]], g.start,
               direction == "load", first_slot)
    return torch.equal(as_bytes(kv), as_bytes(kv_ref)) and torch.equal(buf, buf_ref)


CASES = [(shape, direction, slots, first) for shape in SHAPES for direction in ("load", "store")
         for slots, first in ((NUM_SLOTS, 0), (1, 0), (1, 2))]
out = {}
for name, make in (("kernel", BlockCopy), ("off_by_one", OffByOne), ("wrong_stride", wrong_stride),
                   ("slot_ignored", SlotIgnored)):
    out[name] = {"/".join(map(str, c)): case(make, *c, seed=k) for k, c in enumerate(CASES)}
print(json.dumps(out))
"""


def test_block_copy_equals_index_copy_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert len(out["kernel"]) == 18 and all(out["kernel"].values()), out["kernel"]
    # Teeth: each broken variant is caught by every case it can be seen in.
    assert not any(out["off_by_one"].values()), out["off_by_one"]
    assert not any(out["wrong_stride"].values()), out["wrong_stride"]
    later_slot = {name for name in out["slot_ignored"] if name.endswith("/1/2")}
    assert {name for name, ok in out["slot_ignored"].items() if not ok} == later_slot


def _compiled_variants(kernel: object) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    return sum(len(cache[0]) for cache in caches.values())


@pytest.mark.cuda
def test_a_pairs_slice_at_any_page_runs_the_kernel_already_compiled() -> None:
    """With one block a page (blocks as long as the pool's chunks), a load's groups slice
    the pairs table at any page; at an odd page the slice starts 24 bytes past 16-byte
    alignment. The kernel compiled for an aligned slice (the warm-up's) must serve it: a
    compile there is paid inside a hit (on an H100 the first 131,072-token hit with
    256-token blocks took 268 ms where the next took 95)."""
    import torch

    from kvshare.kvpool.block_copy import BlockCopy, _copy_blocks_kernel

    kv = torch.zeros((2, 2, 8, 16, 2, 8), dtype=torch.bfloat16, device="cuda")
    copier = BlockCopy(kv, 1)
    table, _ = copier.pairs([[5], [2], [7], [1]], [0, 0, 0, 0])
    pairs = torch.from_numpy(table).cuda()
    rows = torch.arange(4 * copier.slot_bytes * 2, device="cuda").to(torch.uint8).view(4, -1)
    copier(rows[0:2], pairs[0:2], 0, True)
    torch.cuda.synchronize()
    compiled = _compiled_variants(_copy_blocks_kernel)
    copier(rows[1:3], pairs[1:3], 1, True)  # pairs start 24 bytes in
    torch.cuda.synchronize()
    assert pairs[1:3].data_ptr() % 16 != 0
    assert _compiled_variants(_copy_blocks_kernel) == compiled
    for page, block in ((0, 5), (1, 2), (2, 7)):  # each page's row landed in its block
        words = kv[:, :, block].reshape(-1).view(torch.uint8)
        assert torch.equal(words, rows[page])
