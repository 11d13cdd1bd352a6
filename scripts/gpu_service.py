"""GPU session for issues 5 and 6: `kvshare validate` on CUDA, and the 27B cross-replica bench.

python3 scripts/gpu_service.py validate --out $OUT
python3 scripts/gpu_service.py bench27b --out $OUT [--lengths 32768,130816] [--per-block 8]
python3 scripts/gpu_service.py two-replicas --out $OUT [--sessions 2] [--context 32768]
python3 scripts/gpu_service.py sessions --out $OUT [--sessions 2] [--context 32768]
python3 scripts/gpu_service.py hit --out $OUT --runs auto:131072:2,fp8:131072:2 [--budget-s 560]
    [--layer-groups N]

`validate` runs `kvshare validate all` on CUDA against two float32 replicas of `kvshare up`;
`sessions` starts two replicas of shape:qwen3-8b on the one GPU (0.45 of its memory each)
and the pool, and runs the blocked six-turn sessions benchmark (alternate vs fixed
placement); `two-replicas` runs both.

`hit` measures a cross-replica cache hit at the copy floor: per run (KV dtype, context
tokens, follow-ups per block) it starts `kvshare up` with two shape:qwen3.5-27b replicas on
the one GPU (0.48 of it each, 8 sequences, 8,192-token steps), records each replica's GPU memory, runs the
blocked cross-replica bench A=0 -> B=1 on one shared context per block with a warm-up, and
sets the ON medians beside the floor: the bytes B loaded per hit over the raw pinned
host->GPU memcpy measured in the same call.

`bench27b` starts `kvshare up` with one replica of shape:gemma3-27b (two 54 GB replicas and
a 128k-token KV cache do not fit one H200), waits until the pool arena is registered with
CUDA, measures the raw pinned host->GPU memcpy in the same run, and runs the blocked
OFF-ON-ON-OFF cross-replica benchmark with A = B = replica 0 (GPU-local caches reset
between prefill and follow-up, so only the pool can help).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from gpu_cluster import (
    OUTPUT_TOKENS,
    QUESTION_TOKENS,
    REPO,
    cross_replica_bench,
    env,
    gpu_memory_by_process,
    hit_medians,
    kvshare,
    start_cluster,
    stop_cluster,
)

from kvshare.engine.config import EngineConfig


def validate(out: Path) -> int:
    """`kvshare validate all` on CUDA against two float32 gemma3-1b replicas of `kvshare up`
    (pages of 13.6 MiB; the bytes and corruption checks use the gemma3-27b page layout,
    124 MiB). Token-identical answers need float32: in bf16 a near-tied greedy token flips
    with the batch shape of the recomputed suffix even when the restored bytes are exact."""
    up = (
        "--replicas 2 --model shape:gemma3-1b --dtype float32 --device cuda --gpu-memory-fraction 0.3 "
        "--pool-size 8GiB --pool-preallocate"
    )
    done = subprocess.run(
        kvshare(
            "validate",
            "all",
            "--device",
            "cuda",
            "--up",
            up,
            "--trials",
            "10",
            "--json",
            str(out / "validate_all_cuda.json"),
        ),
        env=env(),
        cwd=REPO,
        timeout=540,
    )
    return done.returncode


def bench27b(out: Path, lengths: str, per_block: int, pool_size: str) -> int:
    deadline = time.monotonic() + 570  # the device call's limit is 600 s
    import torch

    from kvshare.bench.ceilings import pcie_bandwidth

    ceiling = pcie_bandwidth()
    torch.cuda.empty_cache()
    (out / "ceiling.json").write_text(json.dumps(ceiling))
    print("ceiling", ceiling, flush=True)
    max_len = max(int(x) for x in lengths.split(",")) + 256
    up = start_cluster(
        out,
        8180,
        "cuda",
        "--replicas",
        "1",
        "--model",
        "shape:gemma3-27b",
        "--gpu-memory-fraction",
        "0.96",
        "--max-num-batched-tokens",
        "16384",
        "--max-num-seqs",
        "8",
        "--max-model-len",
        str(min(max_len, 131072)),
        "--pool-size",
        pool_size,
    )
    failed = 0
    try:
        for length in lengths.split(
            ","
        ):  # one run per length: a late timeout keeps earlier results
            name = f"bench27b_{length}"
            try:
                done = cross_replica_bench(
                    8180,
                    int(length),
                    per_block,
                    out,
                    name,
                    deadline - time.monotonic(),
                    "--plot",
                    str(out / f"{name}.png"),
                    replica_b=0,
                )
                failed += done.returncode != 0
            except subprocess.TimeoutExpired:
                print(f"{name}: out of time", flush=True)
                failed += 1
        return failed
    finally:
        stop_cluster(up)


def hit_run(
    out: Path,
    port: int,
    run: str,
    deadline: float,
    layer_groups: int,
    block_size: int,
    design: str,
) -> dict:
    """One cluster, one cross-replica bench for `run` (DTYPE:TOKENS:PER_BLOCK[:FRACTION])
    in the blocked `design`, pool restores in at most `layer_groups` groups of layers, KV
    blocks of `block_size` tokens; returns the ON/OFF medians, the bytes loaded per hit and
    the replicas' GPU memory."""
    dtype, tokens, blocks, *fraction = run.split(":")
    length, per_block = int(tokens), int(blocks)
    name = f"hit_{dtype}_{length}"
    up = start_cluster(
        out,
        port,
        "cuda",
        "--replicas",
        "2",
        "--model",
        "shape:qwen3.5-27b",
        "--gpu-memory-fraction",
        # fp8 at 261,888 tokens needs 0.49: 0.48 leaves 258,048 tokens of KV.
        fraction[0] if fraction else "0.48",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "8192",
        # Exactly what the bench's requests need: an asked context must fit the KV cache
        # (the replica refuses to start otherwise), and at 0.48 the bf16 cache holds little
        # more than a 131,072-token context (its hits ran there with 131,112 tokens).
        "--max-model-len",
        str(length + QUESTION_TOKENS + OUTPUT_TOKENS),
        "--kv-cache-dtype",
        dtype,
        "--pool-size",
        "40GiB",
        "--pool-load-layer-groups",
        str(layer_groups),
        "--block-size",
        str(block_size),
    )
    try:
        memory = {"after start": gpu_memory_by_process()}
        left = deadline - time.monotonic()
        done = cross_replica_bench(port, length, per_block, out, name, left, "--design", design)
        memory["after the bench"] = gpu_memory_by_process()  # the allocators keep their peak
    finally:
        stop_cluster(up)
    return {
        "dtype": dtype,
        "tokens": length,
        "layer_groups": layer_groups,
        "block_size": block_size,
        "returncode": done.returncode,
        **hit_medians(out / f"{name}.json"),
        "gpu_memory_mib": memory,
    }


def hit_run_seconds(run: str, design: str) -> float:
    """About how long hit_run takes on the H200: a cluster start and warm-up (~50 s), then
    per request a prefill on replica A and, in an OFF block, the same prefill again on B
    (27 s at 131,072 tokens, 78 s at 261,888). A run the budget cannot finish is skipped
    instead of being cut off by its timeout (a 131k run given 89 s failed in block 0 on
    2026-12-06)."""
    _, tokens, per_block, *_ = run.split(":")
    prefill_s = 27.5 * (int(tokens) / 131072) ** 1.5
    prefills = sum(2 if block == "OFF" else 1 for block in design.split("-"))
    return 50.0 + prefills * int(per_block) * prefill_s


def hit(
    out: Path, runs: str, budget_s: float, layer_groups: int, block_size: int, design: str
) -> int:
    deadline = time.monotonic() + budget_s
    import torch

    from kvshare.bench.ceilings import pcie_bandwidth

    ceiling = pcie_bandwidth()
    torch.cuda.empty_cache()
    h2d = ceiling["h2d_GBps"] * 1e9
    results = []
    for index, run in enumerate(runs.split(",")):
        left, need = deadline - time.monotonic(), hit_run_seconds(run, design)
        if left < need:
            print(
                f"{run}: skipped, needs ~{need:.0f} s, {left:.0f} s of the budget left", flush=True
            )
            results.append({"run": run, "error": f"skipped: ~{need:.0f} s needed, {left:.0f} left"})
            continue
        try:
            result = hit_run(
                out, 8380 + 10 * index, run, deadline, layer_groups, block_size, design
            )
        except (subprocess.TimeoutExpired, RuntimeError, TimeoutError, FileNotFoundError) as exc:
            print(f"{run}: {exc!r}", flush=True)
            results.append({"run": run, "error": repr(exc)})
            continue
        result["floor_s"] = result["bytes_per_hit"] / h2d
        results.append(result)
    (out / "hit.json").write_text(json.dumps({"ceiling": ceiling, "runs": results}, indent=1))
    print(f"raw pinned host->GPU memcpy {ceiling['h2d_GBps']:.2f} GB/s")
    print("| KV | tokens | OFF s | ON s | GB per hit | floor s | ON/floor | OFF/ON |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        if "error" in r:
            print(f"| {r['run']} | failed: {r['error']} |")
            continue
        print(
            f"| {r['dtype']} | {r['tokens']} | {r['off_s']:.2f} | {r['on_s']:.3f} | "
            f"{r['bytes_per_hit'] / 1e9:.2f} | {r['floor_s']:.3f} | "
            f"{r['on_s'] / r['floor_s']:.2f} | {r['off_s'] / r['on_s']:.0f} |"
        )
    for r in results:  # where an ON hit's time went, hop by hop (Server-Timing medians)
        if "error" not in r:
            phases = ", ".join(f"{k} {v:.1f}" for k, v in r["on_timing_ms"].items())
            print(f"{r['dtype']} {r['tokens']} ON, ms: {phases}")
    return sum(1 for r in results if "error" in r or r["returncode"])


def two_replicas(out: Path, sessions: int, context: int, pool_size: str) -> int:
    return validate(out) or sessions_bench(out, sessions, context, pool_size)


def sessions_bench(out: Path, sessions: int, context: int, pool_size: str) -> int:
    """The blocked six-turn sessions bench on two qwen3-8b replicas sharing the GPU."""
    up = start_cluster(
        out,
        8280,
        "cuda",
        "--replicas",
        "2",
        "--model",
        "shape:qwen3-8b",
        "--gpu-memory-fraction",
        "0.45",
        "--max-num-batched-tokens",
        "16384",
        "--max-num-seqs",
        "16",
        "--max-model-len",
        str(context + 8192),
        "--pool-size",
        pool_size,
    )
    try:
        benched = subprocess.run(
            kvshare(
                "bench",
                "sessions",
                "--target",
                "http://127.0.0.1:8280",
                "--sessions",
                str(sessions),
                "--turns",
                "6",
                "--context",
                str(context),
                "--question-tokens",
                "64",
                "--output-tokens",
                "32",
                "--placement",
                "both",
                "--settle-timeout",
                "30",
                "--json",
                str(out / "sessions.json"),
                "--markdown",
                str(out / "sessions.md"),
                "--plot",
                str(out / "sessions.png"),
            ),
            env=env(),
            cwd=REPO,
            timeout=400,
        )
    finally:
        stop_cluster(up)
    return benched.returncode


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("validate", "bench27b", "two-replicas", "sessions", "hit"))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--lengths", default="32768,130816")
    parser.add_argument("--per-block", type=int, default=8)
    parser.add_argument("--pool-size", default="88GiB")
    parser.add_argument(
        "--sessions", type=int, default=2, help="two-replicas: per placement per block"
    )
    parser.add_argument(
        "--context", type=int, default=32768, help="two-replicas: first turn's tokens"
    )
    parser.add_argument(
        "--runs", default="auto:131072:2", help="hit: DTYPE:TOKENS:PER_BLOCK[:GPU_FRACTION],..."
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=560.0,
        help="hit: runs the rest of it cannot finish are skipped",
    )
    parser.add_argument(
        "--layer-groups",
        type=int,
        default=0,
        help="hit: kvshare up --pool-load-layer-groups (0: the engine's default on CUDA)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=EngineConfig.block_size,
        help="hit: kvshare up --block-size (tokens per KV block)",
    )
    parser.add_argument(
        "--design",
        default="OFF-ON-ON-OFF",
        help="hit: the bench's blocked design (more ON blocks: more hits for one prefill each)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "validate":
        return validate(args.out)
    if args.what == "two-replicas":
        return two_replicas(args.out, args.sessions, args.context, args.pool_size)
    if args.what == "hit":
        return hit(
            args.out, args.runs, args.budget_s, args.layer_groups, args.block_size, args.design
        )
    if args.what == "sessions":
        return sessions_bench(args.out, args.sessions, args.context, args.pool_size)
    return bench27b(args.out, args.lengths, args.per_block, args.pool_size)


if __name__ == "__main__":
    sys.exit(main())
