"""The GPU session scripts start: they import and parse their flags on a machine without a
GPU (a script that fails there fails on the lent GPU too, and costs its device time), and
the hit profile runs its layer-group and collector comparisons and its hits through HTTP on
the CPU."""

from __future__ import annotations

import json
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


def test_the_hit_profile_compares_settings_and_goes_through_http_on_the_cpu(
    tmp_path: Path,
) -> None:
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
        "--compare-collector",
        "--layer-group-min-mib",
        "0.001",
        "--kv-cache-memory",  # small: beside the suite's own process
        str(64 << 20),
        "--http",
        "1",
        "--http-without-hints",
        "--json",
        str(out),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Through the router and the replica's app, routed and pinned (with the replica's
    # prompt-head hints and without: the CPU transfer prefetches nothing, so none is made):
    # pool hits, timed in each; the replica's pool counters after them.
    result = json.loads(out.read_text())
    http = result["http_hits"]
    assert sorted(http) == ["pinned", "pinned, no hint", "routed"]
    for (hit,) in http.values():
        assert hit["pool_hit_tokens"] == 2048
        assert {"router-upstream", "engine", "total"} <= set(hit["server_timing_ms"])
    (counters,) = result["http_pool_counters"]
    assert counters["lookups"] >= 3 and counters.get("hints", 0) == 0
    firsts = re.findall(
        r"^layer groups (\d+): time to first token .*first tokens (\[.*\])$", done.stdout, re.M
    )
    assert [groups for groups, _ in firsts] == ["1", "2"], done.stdout[-2000:]
    assert firsts[0][1] == firsts[1][1]  # a restore in two groups gives the same token
    # Hits with the collector as served and as CPython's defaults, each with the
    # collector's time inside it.
    compared = json.loads(out.read_text())["compared"]
    for setting in ("collector as served", "collector defaults"):
        (hit,) = compared[setting]
        assert hit["pool_hit_tokens"] == 2048 and hit["gc_ms"] >= 0 and hit["gc_full"] >= 0
        assert hit["first_token"] == compared["layer groups 1"][0]["first_token"]
    assert re.search(r"^collector as served: .* full collections over 1 hits", done.stdout, re.M)


def test_the_fp8_kernel_copies_its_tiles_in_16_byte_pieces_like_bf16() -> None:
    """What docs/fp8.md says of the fp8 kernel's loads, from its sm_90 PTX: with the block
    planes of 16-token, 4-head blocks the K and V tiles come in 16-byte copies, half of
    bf16's bytes a key (each cache at its own tile); blocks whose bytes are not a multiple
    of 16 (15 x 3) leave 4-byte copies only."""
    done = run_script("paged_kernel_ptx.py", "--blocks", "16x4,15x3", "--bf16", timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    copies = {
        label: dict((int(b), int(n)) for n, b in re.findall(r"(\d+) x (\d+) B", sizes))
        for label, sizes in re.findall(r"^(\w+, \d+x\d+) blocks +(.*)$", done.stdout, re.M)
    }
    per_key = dict(
        re.findall(
            r"^(\w+, \d+x\d+) blocks .*; (\d+) B a key in 16-byte copies$", done.stdout, re.M
        )
    )
    fp8, misaligned = copies["fp8, 16x4"], copies["fp8, 15x3"]
    assert 16 in fp8 and 16 in copies["bf16, 16x4"], done.stdout
    assert 2 * int(per_key["fp8, 16x4"]) == int(per_key["bf16, 16x4"]), done.stdout
    assert 16 not in misaligned and misaligned[4] > fp8[4], done.stdout


def test_the_sass_table_shows_the_fp8_kernels_round_trip_through_shared_memory() -> None:
    """What docs/fp8.md says of the fp8 kernel's key loop, from Triton's own ptxas: its tiles
    go back to shared memory after their conversion (STS), bf16's never; dots in bfloat16
    take more instructions than in float16 (e4m3 -> bfloat16 goes through float32)."""
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton ships no ptxas")
    done = run_script("paged_kernel_ptx.py", "--sass", timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    head, *rows = [line.split() for line in done.stdout.splitlines() if line.strip()]
    ops = head[head.index("loop") + 1 :]
    loops = {
        " ".join(r[: len(r) - len(ops) - 3]): (
            int(r[-len(ops) - 1]),
            dict(zip(ops, map(int, r[-len(ops) :]))),
        )
        for r in rows
    }
    (bf16, bf16_ops), (f16, f16_ops), (bf, _) = (
        loops[k] for k in ("bf16", "fp8, float16", "fp8, bfloat16")
    )
    assert bf16_ops["STS"] == 0 and f16_ops["STS"] > 0 and f16_ops["HGMMA"] > 0, done.stdout
    assert bf16 < f16 < bf, done.stdout


def test_the_copy_rates_part_copies_alone_from_copies_beside_the_step(tmp_path: Path) -> None:
    """A trace's copies are told apart by the step kernels beside them: kernels of several
    streams count once where they overlap, the restore's own kernels not at all; short
    copies are left out."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from hit_path_profile import RESTORE_KERNELS, copy_rates
    finally:
        sys.path.remove(str(REPO / "scripts"))

    def copy(ts: int, dur: int, gbps: float) -> dict:
        name = "Memcpy HtoD (Pinned -> Device)"
        args = {"bytes": int(gbps * dur * 1e3)}
        return {"ph": "X", "cat": "gpu_memcpy", "name": name, "ts": ts, "dur": dur, "args": args}

    def kernel(name: str, ts: int, dur: int) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {}}

    kernels = "".join(
        (REPO / "kvshare" / "kvpool" / f).read_text()
        for f in ("block_copy.py", "checksum_kernel.py")
    )
    assert all(f"def {name}(" in kernels for name in RESTORE_KERNELS)  # still their names
    restore = sorted(RESTORE_KERNELS)
    events = [
        copy(0, 1000, 55.0),
        kernel(restore[0], 100, 800),  # the restore's own: still alone
        copy(1000, 1000, 54.0),
        kernel(restore[1], 1000, 1000),
        copy(2000, 1000, 51.0),
        kernel("gemm", 2000, 400),
        kernel("attention", 2300, 400),  # overlaps gemm: 2000-2700 covered, 70%
        copy(3000, 1000, 50.0),
        kernel("gemm", 3000, 300),  # 30%: neither alone nor beside
        copy(4000, 400, 10.0),  # under 0.5 ms: left out
        kernel("gemm", 4000, 400),
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    rates = copy_rates(trace)
    shares = [round(busy, 3) for _, _, busy in rates["copies_ms_gbps_step"]]
    assert shares == [0.0, 0.0, 0.7, 0.3]
    assert rates["alone_gbps"] == pytest.approx(54.5)
    assert rates["beside_step_gbps"] == pytest.approx(51.0)


def test_the_tokenize_ab_checks_the_pieces_ids_and_times_both(tmp_path: Path) -> None:
    out = tmp_path / "tokenize.json"
    done = run_script(
        "tokenize_pieces_ab.py", "--tokens", "40000", "--repeats", "2", "--json", str(out)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["tokens"] > 30_000 and result["pieces"] >= 1
    assert {name: len(ms) for name, ms in result["ms"].items()} == {
        "template": 2,
        "whole": 2,
        "pieces": 2,
        "replica json": 2,
        "replica packed": 2,
        "next turn, whole": 2,
        "next turn, kept": 2,
        "chinese, whole": 2,
        "chinese, pieces": 2,
    }
    assert result["pieces_over_whole"] > 0
