"""A strided copy (the fill of a restore in groups of layers) brings exactly each page's
part of a group, and nothing past it."""

from __future__ import annotations

import pytest
import torch

from kvshare.kvpool.strided_copy import StridedCopy

MIB = 1 << 20


def test_no_cuda_no_strided_copy() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    assert StridedCopy.find() is None


@pytest.mark.cuda
def test_a_strided_copy_brings_each_pages_part_of_a_group() -> None:
    copy = StridedCopy.find()
    assert copy is not None, "torch's CUDA runtime library was not found in the process"
    pages, page, part, first = 12, 3 * MIB, MIB, MIB // 2
    host = torch.randint(0, 256, (pages * page,), dtype=torch.uint8).pin_memory()
    dest = torch.zeros(pages * part + 7, dtype=torch.uint8, device="cuda")
    rows = copy(dest, host.data_ptr() + first, page, part, pages)
    expected = host.view(pages, page)[:, first : first + part]
    assert torch.equal(rows.cpu(), expected)
    assert not dest[pages * part :].any()  # nothing past the rows written
