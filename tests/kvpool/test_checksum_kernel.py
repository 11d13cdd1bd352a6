"""The GPU checksum kernel gives the CPU checksum's bits (pages are written on one device
and verified on another).

The kernel runs in Triton's interpreter on the CPU (TRITON_INTERPRET=1 must be set before
triton is imported: hence a subprocess): several pages per launch, rows that take several
tiles (atomics from many programs), a segment split inside a tile, rows as a strided view,
a row shorter than one block, all-ones words (sums far past 2**64), a page checksummed in
two parts added to the same sums (a load in groups of layers). Broken variants (another
page's constants, the split one word off, a part's place in the page dropped) must fail
the same comparisons.
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
from kvshare.kvpool.checksum_kernel import checksum_rows
from kvshare.kvpool.layout import checksum_constants, payload_checksum

BLOCK_WORDS, TILE_BLOCKS = 64, 4  # small tiles: rows of a few thousand words take several
CASES = {  # name: (pages, words per row, split word, row stride in words)
    "tiles": (3, 1500, 345, 1503),
    "one-segment": (2, 700, 700, 700),
    "short": (2, 3, 1, 3),
    "all-ones": (1, 1000, 300, 1000),
    "two-parts": (2, 1500, 1500, 1503),  # checksummed as words [0, 700) then [700, 1500)
}
CUT = 700


def case(name, variant):
    pages, words, split, stride = CASES[name]
    rng = np.random.default_rng(len(name))
    if name == "all-ones":
        buf = np.full(pages * stride, 2**64 - 1, dtype=np.uint64)
    else:
        buf = rng.integers(0, 2**64, pages * stride, dtype=np.uint64)
    rows = torch.from_numpy(buf.view(np.uint8)).view(pages, stride * 8)[:, :words * 8]
    keys = [bytes([p]) * 16 for p in range(pages)]
    constants = np.stack([checksum_constants(k) for k in keys])
    if variant == "other-constants":
        constants = np.roll(constants, 1, axis=0) if pages > 1 else checksum_constants(b"x" * 16)[None]
    sums = torch.zeros(pages, 2, 2, dtype=torch.int64)
    split_words = split + 1 if variant == "split-off-by-one" else split
    consts = torch.from_numpy(constants.view(np.int64))
    if name == "two-parts":
        place = 0 if variant == "part-place-dropped" else CUT * 8
        checksum_rows(rows[:, : CUT * 8], consts, sums, split_words * 8, 0, BLOCK_WORDS, TILE_BLOCKS)
        checksum_rows(rows[:, CUT * 8 :], consts, sums, split_words * 8, place, BLOCK_WORDS,
                      TILE_BLOCKS)
    else:
        checksum_rows(rows, consts, sums, split_words * 8, 0, BLOCK_WORDS, TILE_BLOCKS)
    got = sums.numpy().view(np.uint64)
    for p in range(pages):
        w = buf[p * stride:p * stride + words]
        c = checksum_constants(keys[p])
        want = [payload_checksum(w[:split], c, 0), payload_checksum(w[split:], c, split)]
        if not all(np.array_equal(got[p, s], want[s]) for s in range(2)):
            return False
    return True


VARIANTS = ("kernel", "other-constants", "split-off-by-one", "part-place-dropped")
print(json.dumps({v: {n: case(n, v) for n in CASES} for v in VARIANTS}))
"""


def test_checksum_kernel_equals_the_cpu_checksum_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert all(out["kernel"].values()), out["kernel"]
    assert not any(out["other-constants"].values()), out["other-constants"]
    # A one-segment row has no second segment for the split to move into.
    assert out["split-off-by-one"] == {
        "tiles": False,
        "one-segment": True,
        "short": False,
        "all-ones": False,
        "two-parts": True,  # one segment too
    }
    assert [n for n, ok in out["part-place-dropped"].items() if not ok] == ["two-parts"]
