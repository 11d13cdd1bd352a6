"""The GPU session scripts start: they import and parse their flags on a machine without a
GPU (a script that fails there fails on the lent GPU too, and costs its device time), and
the engine-only hit profile runs its layer-group comparison on the CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARIES = {"gpu_cluster.py"}  # imported by the others, no command line of its own
SCRIPTS = sorted(p.name for p in (REPO / "scripts").glob("*.py") if p.name not in LIBRARIES)


def run_script(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / name), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_imports_and_parses_its_flags(name: str) -> None:
    done = run_script(name, "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: "), done.stdout[:500]


def test_the_hit_profile_compares_layer_groups_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "groups.json"
    done = run_script(
        "hit_path_profile.py",
        "--model",
        "shape:tiny-qwen3.5",
        "--tokens",
        "2048",
        "--repeats",
        "1",
        "--compare-layer-groups",
        "1,2",
        "--layer-group-min-mib",
        "0.001",
        "--kv-cache-memory",  # small: beside the suite's own process
        str(64 << 20),
        "--json",
        str(out),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    firsts = re.findall(
        r"^layer groups (\d+): time to first token .*first tokens (\[.*\])$", done.stdout, re.M
    )
    assert [groups for groups, _ in firsts] == ["1", "2"], done.stdout[-2000:]
    assert firsts[0][1] == firsts[1][1]  # a restore in two groups gives the same token
    assert out.exists()


def test_a_packed_fp8_row_leaves_the_paged_kernel_four_byte_copies() -> None:
    """What docs/fp8.md says of the fp8 kernel's loads, from its sm_90 PTX: 260-byte rows
    (the packed format) come in 4-byte copies only, 272-byte rows in 16-byte ones."""
    done = run_script("paged_kernel_ptx.py", "--rows", "260,272", timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    copies = dict(re.findall(r"^fp8, (\d+)-byte rows +(.*)$", done.stdout, re.MULTILINE))
    assert "16 B" not in copies["260"] and "4 B" in copies["260"], done.stdout
    assert "x 16 B" in copies["272"], done.stdout
