"""The bench against a real cluster of two tiny-llama replicas (`kvshare up`, CPU, cache-aware
router): repeated ON blocks of shared-prefix do the same work in times near each other, and a
concurrency sweep runs end to end with its JSON and PNG."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from kvshare.bench.design import Design
from kvshare.bench.driver import BenchOptions, run_bench
from kvshare.bench.plots import SWEEP_PANELS, sweep_figure
from kvshare.bench.shared_prefix import SharedPrefix
from kvshare.bench.summary import block_row
from kvshare.bench.sweep import SweepRow
from kvshare.bench.synthetic import load_prompt_model
from kvshare.cli import main
from kvshare.serve.launcher import Cluster, UpConfig
from tests.bench.test_workloads import RecordingObserver

MODEL = "shape:tiny-llama"
MIB = 1 << 20


@pytest.fixture(scope="module")
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    config = UpConfig(
        replicas=2,
        model=MODEL,
        port=0,
        pool_size=64 * MIB,
        router_args=("--health-interval", "0.5"),
        ready_timeout=300.0,
    )
    log_path = tmp_path_factory.mktemp("tiny-cluster") / "cluster.log"
    with log_path.open("w") as log, Cluster(config, log=log) as running:
        yield running
    if request.session.testsfailed:  # the children's side of the story
        lines = log_path.read_text(errors="replace").splitlines()
        sys.__stderr__.write(
            f"\n--- last lines of {log_path} ---\n" + "\n".join(lines[-80:]) + "\n"
        )


# One document of 2,048 tokens (a ~0.1 s prefill on one core), each question 256 new tokens
# (tens of ms, far above the HTTP's few), 32 users, 2 in flight over 2 replicas.
STEADY = SharedPrefix(
    documents=1,
    users=32,
    concurrency=2,
    doc_tokens=2048,
    question_tokens=256,
    output_tokens=2,
)
# The counters of a block summary (block_row) that every ON block of STEADY has alike, and
# why. The cache-aware router learns that the pool holds the document only when the first
# prefill of it ends (it records a prompt once its answer begins), so until then the
# document's requests go to the replica computing it. After that, a request that finds that
# replica busy and the other idle goes to the idle one (pool credit 0.97 x 2,048 tokens beats
# 2,048 less the load penalty of 64 per request in flight), which restores the document from
# the pool; from then on both replicas hold it. So whatever the timing, the document is
# computed once and restored once, every other request finds it in its replica's GPU cache,
# and each computed chunk is stored once. With the pool off in a block, or a router that does
# not learn what the pool holds, all 32 requests went to the first replica (no pool hits,
# nothing loaded, computed still ideal); a restore that fails (and is recomputed) or a
# document prefilled on both replicas would compute more than the ideal. Left out: which
# replica serves each request after the restore; it follows which request in flight ends
# first, so the split varies from block to block (seen 21/11 to 13/19).
WORK = (
    "requests",
    "no_content",
    "pool_hit_rate",
    "computed_tokens",
    "ideal_tokens",
    "loaded_bytes",
    "stored_bytes",
)
# The bar for block medians is within 15% of each other, judged on the block medians of the
# H200 runs of scripts/gpu_concurrency.py. Not here: on the 2-vCPU CI VM the CPU's speed
# varies up to 1.6x over seconds and block medians (~25 ms) follow it (correlation 0.90 with
# the cluster's CPU time per block), so ON blocks doing identical work were more than 15%
# apart in about a third of runs (up to 1.48x in 67 runs), while a block with the pool off
# stayed within 15% of two ON blocks in 2 of 6 runs. This bound only catches gross stalls.
GROSS_SPREAD = 2.0
# Above this 1-minute load per core, other processes take most of the two cores in bursts of
# seconds and block medians measure them, not the cluster (seen: load 10 on 2 cores, medians
# 1.6-4.4x apart with every request's routing and cache use alike).
OVERSUBSCRIBED_LOAD_PER_CORE = 3.0


@pytest.mark.slow
def test_repeated_on_blocks_do_the_same_work_in_about_the_same_time(cluster: Cluster) -> None:
    # The warm-up takes each replica's one-time costs (allocator growth) out of block 0.
    options = BenchOptions(Design.parse("ON-ON-ON"), warmup_tokens=STEADY.doc_tokens)
    model = load_prompt_model(MODEL)
    run = asyncio.run(run_bench(STEADY, cluster.url, options, RecordingObserver(), model))
    rows = [block_row(b) for b in run.blocks]
    work = [{name: getattr(row, name) for name in WORK} for row in rows]
    assert work == [work[0]] * len(work), f"the ON blocks did different work: {work}"
    computed = STEADY.doc_tokens + STEADY.users * STEADY.question_tokens
    prompt = STEADY.users * (STEADY.doc_tokens + STEADY.question_tokens)
    expected = {
        "requests": STEADY.users,
        "no_content": 0,
        "pool_hit_rate": STEADY.doc_tokens / prompt,  # the same division of the same ints
        "computed_tokens": computed,
        "ideal_tokens": computed,
    }
    assert {name: work[0][name] for name in expected} == expected, (
        f"an ON block did not compute the document once and restore it once: {work[0]}"
    )

    medians = [row.median_ttft_s for row in rows]
    assert all(m is not None for m in medians)
    spread = max(medians) / min(medians)
    if spread > GROSS_SPREAD:
        load = os.getloadavg()[0]
        message = f"block medians {[round(m, 4) for m in medians]} s, load {load:.1f}"
        if load > OVERSUBSCRIBED_LOAD_PER_CORE * (os.cpu_count() or 1):
            pytest.skip(
                f"work alike in every block; host oversubscribed, times not judged: {message}"
            )
        pytest.fail(f"block medians {spread:.2f}x apart (over {GROSS_SPREAD}x): {message}")


@pytest.mark.slow
def test_a_tiny_concurrency_sweep_writes_its_rows_json_and_plot(
    cluster: Cluster, tmp_path: Path
) -> None:
    out = {kind: tmp_path / f"sweep.{kind}" for kind in ("json", "png", "md")}
    argv = ["bench", "concurrency", "--target", cluster.url, "--model", MODEL]
    argv += ["--concurrency", "1,3", "--design", "OFF-ON", "--documents", "2", "--users", "6"]
    argv += ["--doc-tokens", "512", "--question-tokens", "16", "--output-tokens", "2"]
    argv += ["--warmup-tokens", "64", "--resamples", "50"]
    argv += ["--json", str(out["json"]), "--plot", str(out["png"]), "--markdown", str(out["md"])]
    assert main(argv) == 0

    data = json.loads(out["json"].read_text())
    assert data["workload"] == "concurrency" and data["params"]["concurrency"] == [1, 3]
    rows = [SweepRow(**row) for row in data["rows"]]
    assert [(r.concurrency, r.condition) for r in rows] == [
        (1, "OFF"),
        (1, "ON"),
        (3, "OFF"),
        (3, "ON"),
    ]
    for r in rows:
        assert r.requests == 6 and r.pool_size is None  # the target's pool: not resized
        assert 0 < r.p50_ttft_s <= r.p99_ttft_s and r.requests_per_s > 0
        assert r.output_tokens_per_s == pytest.approx(2 * r.requests_per_s)
        assert r.computed_over_ideal is not None and r.computed_over_ideal >= 0.9
        assert r.pool_hit_rate == 0.0 or r.condition == "ON"
    # Each point is its own blocked run at its concurrency, with every request kept.
    runs = data["runs"]
    assert [(run["concurrency"], run["run"]["info"]["params"]["concurrency"]) for run in runs] == [
        (1, 1),
        (3, 3),
    ]
    assert [len(run["run"]["warmup"]) for run in runs] == [4, 0]  # 2 prefills, 2 restores
    for run in runs:
        assert [b["condition"] for b in run["run"]["blocks"]] == ["OFF", "ON"]
        assert len(run["run"]["requests"]) == 12
        spans = sorted(
            (r["start_s"], r["start_s"] + r["total_s"], r["block"]) for r in run["run"]["requests"]
        )
        most = max(
            sum(s <= start < e and b == block for s, e, b in spans) for start, _, block in spans
        )
        assert most <= run["concurrency"]

    # The PNG is the figure of these rows: four panels, a curve per condition.
    image = imread(out["png"])
    assert image.shape[:2] == (840, 1200) and np.ptp(image[..., :3]) > 0.5
    fig = sweep_figure(rows, "t")
    for ax, (field, _, _) in zip(fig.axes, SWEEP_PANELS):
        for line in ax.get_lines():
            condition = line.get_label().rsplit(", ", 1)[1]
            expected = [getattr(r, field) for r in rows if r.condition == condition]
            assert list(line.get_xdata()) == [1, 3] and list(line.get_ydata()) == expected
    text = out["md"].read_text()
    assert "| target's | ON | 3 | 6 |" in text and "![concurrency sweep](sweep.png)" in text
