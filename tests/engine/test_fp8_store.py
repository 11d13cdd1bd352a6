"""The fp8 store kernel writes exactly the bytes of the torch path (kv_fp8.PackedBlocks.store).

A CUDA replica quantizes new keys and values with one Triton kernel, a CPU replica with
torch; pool pages of the two are shared, so the bytes must be the same. Without a GPU the
kernel runs in Triton's interpreter (a subprocess: TRITON_INTERPRET is read when triton is
imported). Inputs: rows of random magnitudes over six decades, and rows that put every e4m3
value, every midpoint between two neighbours (the ties, which go to the even one) and the
floats just beside each midpoint at a scale of exactly 1, with zeros, negative zeros and
values under e4m3's smallest subnormal; slots in every block, in random order.
"""

from __future__ import annotations

import pytest
import torch

from kvshare.engine import kv_fp8
from tests.engine.test_paged_decode import interpret

CASES = [  # (kv heads, head dim, block size, dtype)
    (1, 16, 16, "float32"),
    (3, 32, 16, "bfloat16"),
    (4, 256, 32, "bfloat16"),  # shape:qwen3.5-27b's attention layers
]


def e4m3_grid() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours and the floats just
    beside them, both signs, zeros and tiny values: all within +-448."""
    values = torch.arange(256, dtype=torch.uint8).view(kv_fp8.FP8).float()
    values = values[torch.isfinite(values)].unique()
    mids = (values[1:] + values[:-1]) / 2
    up, down = torch.tensor(1e30), torch.tensor(-1e30)
    points = torch.cat(
        [values, mids, mids.nextafter(up), mids.nextafter(down), torch.tensor([-0.0, 1e-30])]
    )
    points = torch.cat([points, -points])
    return points[points.abs() <= kv_fp8.FP8_MAX]


def case_inputs(
    heads: int, dim: int, block_size: int, dtype: str
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(x [T, heads, dim], slots [T], cache slots) for one case, on the CPU."""
    gen = torch.Generator().manual_seed(heads * 1000 + dim)
    random_rows = torch.randn(48, heads, dim, generator=gen)
    random_rows *= 10 ** (6 * torch.rand(48, heads, 1, generator=gen) - 3)
    grid = e4m3_grid()
    per_row = dim - 1  # the last column holds 448: every grid row's scale is exactly 1
    rows = -(-len(grid) // per_row)
    padded = torch.zeros(rows * per_row)
    padded[: len(grid)] = grid
    grid_rows = torch.cat([padded.view(rows, per_row), torch.full((rows, 1), 448.0)], dim=1)
    grid_rows = torch.cat([grid_rows, torch.zeros(-rows % heads, dim)])
    x = torch.cat([random_rows, grid_rows.view(-1, heads, dim), torch.zeros(2, heads, dim)])
    x = x.to(getattr(torch, dtype))
    slots_total = -(-len(x) // block_size) * block_size + block_size
    slots = torch.randperm(slots_total, generator=gen)[: len(x)]
    return x, slots, slots_total


def stored_by_torch(
    x: torch.Tensor, slots: torch.Tensor, total: int, block_size: int
) -> torch.Tensor:
    cache = torch.zeros(total, x.shape[1], x.shape[2] + 4, dtype=torch.uint8)
    kv_fp8.PackedBlocks.of(cache, block_size).store(slots, x)
    return cache


_SCRIPT = """
import json, sys
import torch
from kvshare.engine import fp8_store
from tests.engine.test_fp8_store import case_inputs, stored_by_torch
mismatches = []
for heads, dim, block_size, dtype in json.loads(sys.argv[1]):
    x, slots, total = case_inputs(heads, dim, block_size, dtype)
    want = stored_by_torch(x, slots, total, block_size)
    got = torch.zeros_like(want)
    fp8_store.store(got, slots, x, block_size)
    mismatches.append(int((got != want).sum()))
print(json.dumps(mismatches))
"""


def test_the_grid_holds_ties_that_round_both_ways() -> None:
    """Midpoints between e4m3 neighbours go to the even one: down for some, up for others,
    so a kernel that breaks ties one fixed way fails on the grid."""
    values = torch.arange(128, dtype=torch.uint8).view(kv_fp8.FP8).float()
    values = values[torch.isfinite(values)]
    mids = (values[1:] + values[:-1]) / 2
    assert torch.isin(mids, e4m3_grid()).all()
    cast = mids.to(kv_fp8.FP8).float()
    assert (cast == values[:-1]).any() and (cast == values[1:]).any()


def test_the_kernel_writes_the_torch_bytes_in_the_interpreter() -> None:
    mismatches = interpret(_SCRIPT, CASES)
    assert mismatches == [0] * len(CASES), list(zip(CASES, mismatches))


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}-{c[3]}" for c in CASES])
def test_the_kernel_writes_the_torch_bytes_on_cuda(case: tuple) -> None:
    from kvshare.engine import fp8_store

    heads, dim, block_size, dtype = case
    x, slots, total = case_inputs(heads, dim, block_size, dtype)
    want = stored_by_torch(x, slots, total, block_size)
    got = torch.zeros_like(want, device="cuda")
    fp8_store.store(got, slots.cuda(), x.cuda(), block_size)
    assert int((got.cpu() != want).sum()) == 0


def test_shapes_it_cannot_store_are_refused() -> None:
    pytest.importorskip("triton")
    from kvshare.engine import fp8_store

    cache = torch.zeros(32, 2, 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="cannot store"):
        fp8_store.store(cache, torch.arange(4), torch.zeros(4, 2, 32), 16)  # head dim 16
    with pytest.raises(ValueError, match="cannot store"):
        fp8_store.store(cache, torch.arange(4), torch.zeros(4, 16, 2).transpose(1, 2), 16)
