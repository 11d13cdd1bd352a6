"""The serving processes' C heap keeps what a request freed for the next one."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from kvshare.serve.c_heap import keep_freed_heap

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="mallopt's settings are glibc's",
)

# Page faults per round of four 1 MiB arrays made and dropped on a thread, after warm-up
# rounds, in a fresh interpreter with or without keep_freed_heap.
_FAULTS = """
import json, resource, sys, threading
import numpy as np
from kvshare.serve.c_heap import keep_freed_heap
took = keep_freed_heap() if sys.argv[1] == "keep" else None
faults = []

def rounds():
    for _ in range(5):
        arrays = [np.ones(1 << 17) for _ in range(4)]
        del arrays
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(20):
        arrays = [np.ones(1 << 17) for _ in range(4)]
        del arrays
    faults.append((resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / 20)

worker = threading.Thread(target=rounds)
worker.start()
worker.join()
print(json.dumps({"took": took, "faults": faults[0]}))
"""


def _faults_per_round(mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_request_sized_buffer_reuses_the_pages_the_last_one_freed() -> None:
    default, kept = _faults_per_round("default"), _faults_per_round("keep")
    # 1 MiB is 256 pages: by default each array is mapped and faulted in afresh.
    assert default["faults"] >= 256, default
    assert kept["took"] is True
    assert kept["faults"] < 16, kept


def test_setting_it_twice_is_harmless() -> None:
    assert keep_freed_heap() is True
    assert keep_freed_heap() is True
