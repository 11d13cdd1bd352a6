"""GPU session for issue 17: the shared-prefix workload under concurrency, per router policy,
and two gemma3-27b replicas sharing one H200 at 130,816 tokens.

python3 scripts/gpu_concurrency.py shared-prefix --out $OUT [--policies round-robin,cache-aware] \
    [--router-arg=--queued-work-weight=0 --tag w0]
python3 scripts/gpu_concurrency.py gemma-pair --out $OUT [--length 130816] [--per-block 1]
python3 scripts/gpu_concurrency.py verdicts --out DIR A/shared_prefix_round-robin.json \
    B/shared_prefix_cache-aware.json

`shared-prefix` starts, per policy, `kvshare up` with two shape:qwen3.5-27b replicas on the one
GPU (0.48 of it each, 8 sequences, 8,192-token steps, a 40 GiB pool) and runs `kvshare bench
concurrency` on it: 8 documents x 16,384 tokens, 32 users, concurrency 8 and 32, OFF-ON-ON-OFF
per point, a warm-up request per replica first. It then checks the issue's bars: computed
<= 1.05x ideal with the pool ON for every policy and concurrency, and per concurrency the
best ON median TTFT <= 0.8x the lower of (cache-aware OFF, round-robin ON), and whether the
repeated ON blocks agree: their medians within 15% of each other, and (what a bimodal block
median cannot show) the bench's two-sample Kolmogorov-Smirnov p-value. One policy per
device call fits its limit (`--policies cache-aware`); `verdicts` checks the bars across
the calls' JSON files afterwards.

`gemma-pair` starts two shape:gemma3-27b replicas on the one GPU (0.49 each; only their
sliding-window layers' windows are cached) and runs the blocked cross-replica bench A=0 ->
B=1 at `--length` tokens, with the raw pinned host->GPU memcpy measured in the same call.

`--device cpu --model shape:tiny-qwen3.5` runs either mode on the CPU at toy sizes
(`--doc-tokens`, `--length`), to check the script before a GPU call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_cluster import (
    REPO,
    cross_replica_bench,
    env,
    gpu_memory_by_process,
    hit_medians,
    kvshare,
    start_cluster,
    stop_cluster,
)

from kvshare.bench.stats import block_agreement
from kvshare.serve.policies import POLICIES

CALL_LIMIT_S = 570  # the device call's limit is 600 s


def qwen_pair(args: argparse.Namespace, policy: str, max_len: int) -> tuple[str, ...]:
    return (
        "--replicas",
        "2",
        "--model",
        args.model,
        "--gpu-memory-fraction",
        "0.48",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "8192",
        "--max-model-len",
        str(max_len),
        "--pool-size",
        args.pool_size,
        "--policy",
        policy,
        *(f"--router-arg={flag}" for flag in args.router_arg),
    )


def sweep_policy(args: argparse.Namespace, policy: str, port: int, deadline: float) -> dict:
    max_len = args.doc_tokens + 1024
    up = start_cluster(args.out, port, args.device, *qwen_pair(args, policy, max_len))
    name = f"shared_prefix_{policy}" + (f"-{args.tag}" if args.tag else "")
    try:
        returncode = bench_until(
            deadline,
            kvshare(
                "bench",
                "concurrency",
                "--target",
                f"http://127.0.0.1:{port}",
                "--documents",
                str(args.documents),
                "--users",
                str(args.users),
                "--doc-tokens",
                str(args.doc_tokens),
                "--question-tokens",
                "32",
                "--output-tokens",
                "16",
                "--concurrency",
                args.concurrency,
                "--design",
                args.design,
                "--warmup-tokens",
                str(args.warmup_tokens),
                "--settle-timeout",
                "60",
                "--json",
                str(args.out / f"{name}.json"),
                "--markdown",
                str(args.out / f"{name}.md"),
                "--plot",
                str(args.out / f"{name}.png"),
            ),
        )
    finally:
        stop_cluster(up)
    # The bench rewrites its JSON after each concurrency: a timed-out sweep keeps its points.
    report = json.loads((args.out / f"{name}.json").read_text())
    return {
        "policy": policy,
        "returncode": returncode,
        "rows": report["rows"],
        "repeats": on_repeats(report),
    }


def on_repeats(report: dict) -> list[dict[str, Any]]:
    """Per point of a sweep report, whether its ON blocks repeat one another: their TTFT
    medians, the largest over the smallest, and the two-sample KS distance and p-value of
    their measured requests' TTFTs."""
    out = []
    for point in report.get("runs", []):
        run = point["run"]
        on = {b["index"] for b in run["blocks"] if b["condition"] == "ON"}
        ttfts: dict[int, list[float]] = {b: [] for b in sorted(on)}
        for r in run["requests"]:
            if r["block"] in on and r["role"] == "measure" and r["ttft_s"] is not None:
                ttfts[r["block"]].append(r["ttft_s"])
        medians = [statistics.median(v) for v in ttfts.values() if v]
        agreement = block_agreement(list(ttfts.values()))
        out.append(
            {
                "concurrency": point["concurrency"],
                "pool_size": point["pool_size"],
                "on_block_medians_s": medians,
                "median_spread": max(medians) / min(medians) if medians else None,
                "ks_distance": agreement.distance if agreement else None,
                "ks_p_value": agreement.p_value if agreement else None,
            }
        )
    return out


def bench_until(deadline: float, command: list[str]) -> int | str:
    """The bench's return code, or "timeout" when it was stopped at the deadline."""
    try:
        done = subprocess.run(
            command, env=env(), cwd=REPO, timeout=max(1.0, deadline - time.monotonic())
        )
    except subprocess.TimeoutExpired:
        return "timeout"
    return done.returncode


def verdicts(results: list[dict]) -> list[dict[str, Any]]:
    """The issue's bars per concurrency, from the sweeps' rows."""
    rows = [dict(r, policy=res["policy"]) for res in results if "rows" in res for r in res["rows"]]
    checks = []
    for concurrency in sorted({r["concurrency"] for r in rows}):
        at = {(r["policy"], r["condition"]): r for r in rows if r["concurrency"] == concurrency}
        on = {p: r for (p, c), r in at.items() if c == "ON"}
        computed = {p: r["computed_over_ideal"] for p, r in on.items()}
        best_policy = min(on, key=lambda p: on[p]["p50_ttft_s"])
        baselines = [
            at[key]["p50_ttft_s"]
            for key in (("cache-aware", "OFF"), ("round-robin", "ON"))
            if key in at
        ]
        bar = 0.8 * min(baselines) if baselines else None
        best = on[best_policy]["p50_ttft_s"]
        checks.append(
            {
                "concurrency": concurrency,
                "computed_over_ideal_on": computed,
                "computed_ok": all(v is not None and v <= 1.05 for v in computed.values()),
                "best_policy": best_policy,
                "best_on_p50_s": best,
                "bar_s": bar,
                "ttft_ok": bar is not None and best <= bar,
            }
        )
    return checks


def shared_prefix(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.budget_s
    results = []
    for index, policy in enumerate(args.policies.split(",")):
        try:
            results.append(sweep_policy(args, policy, 8480 + 10 * index, deadline))
        except (subprocess.TimeoutExpired, RuntimeError, TimeoutError, FileNotFoundError) as exc:
            print(f"{policy}: {exc!r}", flush=True)
            results.append({"policy": policy, "error": repr(exc)})
    summarize(results, args.out / "shared_prefix_summary.json")
    return int(any("error" in r or r["returncode"] for r in results))


def merged_verdicts(args: argparse.Namespace) -> int:
    """The bars across policies swept in separate device calls (one policy per call fits
    the call's limit): reads each call's `shared_prefix_<policy>.json`."""
    results = []
    for path in args.reports:
        # The file names the policy: shared_prefix_<policy>.json, or a copy that keeps it.
        named = [p for p in POLICIES if p in path.stem]
        if len(named) != 1:
            raise SystemExit(f"{path}: its name must contain one router policy of {POLICIES}")
        report = json.loads(path.read_text())
        results.append({"policy": named[0], "rows": report["rows"], "repeats": on_repeats(report)})
    summarize(results, args.out / "shared_prefix_summary.json")
    return 0


def summarize(results: list[dict], path: Path) -> None:
    """Write the results and the bars' checks to `path`; print the table and the verdicts."""
    checks = verdicts(results)
    path.write_text(json.dumps({"results": results, "checks": checks}, indent=1))
    print("| policy | conc | cond | p50 TTFT s | p99 TTFT s | req/s | computed/ideal | pool hits |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for res in results:
        for r in res.get("rows", []):
            print(
                f"| {res['policy']} | {r['concurrency']} | {r['condition']} | "
                f"{r['p50_ttft_s']:.2f} | {r['p99_ttft_s']:.2f} | {r['requests_per_s']:.2f} | "
                f"{r['computed_over_ideal']:.2f} | {r['pool_hit_rate']} |"
            )
        if "error" in res:
            print(f"| {res['policy']} | failed: {res['error']} |")
    for c in checks:
        print(
            f"concurrency {c['concurrency']}: computed/ideal ON {c['computed_over_ideal_on']} "
            f"(<= 1.05: {c['computed_ok']}); best {c['best_policy']} ON p50 "
            f"{c['best_on_p50_s']:.2f} s vs bar {c['bar_s']} (ok: {c['ttft_ok']})"
        )
    for res in results:
        for r in res.get("repeats", []):
            if r["median_spread"] is None or r["ks_p_value"] is None:
                continue
            print(
                f"{res['policy']}, concurrency {r['concurrency']}: ON block medians "
                f"{', '.join(f'{m:.3f}' for m in r['on_block_medians_s'])} s, "
                f"{r['median_spread']:.2f}x (within 15%: {r['median_spread'] <= 1.15}); "
                f"KS {r['ks_distance']:.3f}, p {r['ks_p_value']:.2f} "
                f"(agree at 0.05: {r['ks_p_value'] >= 0.05})"
            )


def gemma_pair(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.budget_s
    ceiling = pcie_ceiling(args.device)
    up = start_cluster(
        args.out,
        8580,
        args.device,
        "--replicas",
        "2",
        "--model",
        args.model,
        "--gpu-memory-fraction",
        "0.49",  # 0.48 leaves 129,776 tokens once the attention step's context is planned
        "--max-num-seqs",
        "4",
        # The sliding-window layers hold each sequence's window plus the step being
        # computed: 8,192-token steps left 114,144 tokens of global context at 0.49 on the
        # H200, 2,048-token steps leave about 146k by the plan's arithmetic.
        "--max-num-batched-tokens",
        "2048",
        "--max-model-len",
        str(args.length + 256),
        "--pool-size",
        args.pool_size,
        # One 130,816-token prefix is 62 GiB of pages: more than the default half of the
        # pool one replica may pin, which cut the hit to 297 of its 511 pages.
        "--pool-max-client-fraction",
        "0.95",
    )
    name = f"gemma_pair_{args.length}"
    try:
        memory = {"after start": gpu_memory_by_process()}
        done = cross_replica_bench(
            8580,
            args.length,
            args.per_block,
            args.out,
            name,
            deadline - time.monotonic(),
            "--warmup-tokens",
            str(min(args.warmup_tokens, args.length)),  # a warm-up fits the context
            "--plot",
            str(args.out / f"{name}.png"),
        )
        memory["after the bench"] = gpu_memory_by_process()
    finally:
        stop_cluster(up)
    medians = hit_medians(args.out / f"{name}.json")
    h2d = ceiling["h2d_GBps"] * 1e9 if ceiling else None
    summary = {
        "ceiling": ceiling,
        "returncode": done.returncode,
        **medians,
        "floor_s": medians["bytes_per_hit"] / h2d if h2d else None,
        "gpu_memory_mib": memory,
    }
    (args.out / "gemma_pair_summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return done.returncode


def pcie_ceiling(device: str) -> dict | None:
    if device != "cuda":
        return None
    import torch

    from kvshare.bench.ceilings import pcie_bandwidth

    ceiling = pcie_bandwidth()
    torch.cuda.empty_cache()
    return ceiling


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("shared-prefix", "gemma-pair", "verdicts"))
    parser.add_argument(
        "reports", nargs="*", type=Path, help="verdicts: shared_prefix_<policy>.json files"
    )
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", help="default: shape:qwen3.5-27b / shape:gemma3-27b")
    parser.add_argument(
        "--pool-size",
        help="default: 40GiB for shared-prefix; 72GiB for gemma-pair (130,816 tokens of "
        "gemma3-27b are 511 pages of 124 MiB: 62 GiB)",
    )
    parser.add_argument("--policies", default="round-robin,cache-aware")
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="shared-prefix: a `kvshare router` flag for the clusters, repeatable "
        "(--router-arg=--queued-work-weight=0)",
    )
    parser.add_argument("--tag", help="shared-prefix: appended to the files' names")
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--design", default="OFF-ON-ON-OFF")
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--doc-tokens", type=int, default=16384)
    parser.add_argument("--warmup-tokens", type=int, default=8192)
    parser.add_argument("--length", type=int, default=130816)
    parser.add_argument("--per-block", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=CALL_LIMIT_S)
    args = parser.parse_intermixed_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "verdicts":
        return merged_verdicts(args)
    if args.what == "shared-prefix":
        args.model = args.model or "shape:qwen3.5-27b"
        args.pool_size = args.pool_size or "40GiB"
        return shared_prefix(args)
    args.model = args.model or "shape:gemma3-27b"
    args.pool_size = args.pool_size or "72GiB"
    return gemma_pair(args)


if __name__ == "__main__":
    sys.exit(main())
