"""`kvshare bench` from the command line: arguments, and a whole run writing JSON, Markdown, PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvshare.cli import build_parser, main
from tests.bench.fake_server import RunningFake

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_arguments_parse_with_defaults() -> None:
    args = build_parser().parse_args(
        ["bench", "cross-replica", "--target", "http://h:1", "--lengths", "8,16"]
    )
    assert (args.lengths, args.requests_per_block, args.design.label, args.seed) == (
        (8, 16),
        8,
        "OFF-ON-ON-OFF",
        0,
    )
    args = build_parser().parse_args(
        ["bench", "sessions", "--up=--replicas 2", "--design", "on-off"]
    )
    assert (args.up, args.target, args.placement, args.turns, args.design.label) == (
        "--replicas 2",
        None,
        "both",
        6,
        "ON-OFF",
    )
    args = build_parser().parse_args(["bench", "shared-prefix", "--up", ""])
    assert (args.up, args.documents, args.concurrency) == ("", 4, 8)


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "cross-replica"],  # neither --target nor --up
        ["bench", "cross-replica", "--target", "u", "--up", ""],  # both
        ["bench", "cross-replica", "--target", "u", "--design", "OFF-MAYBE"],
        ["bench", "cross-replica", "--target", "u", "--lengths", "8,x"],
        ["bench", "sessions", "--target", "u", "--placement", "random"],
    ],
)
def test_bad_arguments_exit_with_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2 and "usage:" in capsys.readouterr().err


def test_invalid_workload_values_and_unreachable_targets_fail_cleanly(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "cross-replica", "--target", "http://127.0.0.1:9", "--lengths", "0"]) == 2
    assert "lengths" in capsys.readouterr().out
    assert main(["bench", "shared-prefix", "--target", "http://127.0.0.1:9"]) == 1
    assert "kvshare bench:" in capsys.readouterr().out


def test_a_run_writes_json_markdown_and_png(fake: RunningFake, tmp_path: Path) -> None:
    out = {
        kind: tmp_path / name
        for kind, name in (("json", "r.json"), ("markdown", "r.md"), ("plot", "plots/r.png"))
    }
    out["plot"].parent.mkdir()
    argv = [
        "bench",
        "cross-replica",
        "--target",
        fake.url,
        "--lengths",
        "16,32",
        "--requests-per-block",
        "2",
        "--resamples",
        "200",
        "--seed",
        "3",
        *(a for kind, path in out.items() for a in (f"--{kind}", str(path))),
    ]
    assert main(argv) == 0

    data = json.loads(out["json"].read_text())
    assert data["info"]["design"] == "OFF-ON-ON-OFF" and data["info"]["seed"] == 3
    assert data["info"]["replicas"] == [fake.url + "/r0", fake.url + "/r1"]
    assert len(data["requests"]) == 4 * 2 * 2 * 2
    measured = [r for r in data["requests"] if r["role"] == "measure"]
    assert all(r["ttft_s"] > 0 and r["usage"]["prompt_tokens"] > r["x"] for r in measured)
    assert all(r["settle_s"] >= 0 for r in measured)
    assert [c["x"] for c in data["comparisons"]] == [16, 32]
    assert all(c["ratio"]["value"] < 1 for c in data["comparisons"])
    assert [b["condition"] for b in data["blocks"]] == ["OFF", "ON", "ON", "OFF"]
    assert all("kv_pool" in b["stats_after"][0] for b in data["blocks"])

    md = out["markdown"].read_text()
    assert md.startswith("# kvshare bench: cross-replica") and "warning" not in md
    assert "| metric | series | context tokens | OFF median [95%]" in md
    assert "![cross-replica](plots/r.png)" in md  # relative to the Markdown file
    assert out["plot"].read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize(
    "workload",
    [
        ["sessions", "--sessions", "1", "--turns", "2", "--context", "20", "--output-tokens", "2"],
        [
            "shared-prefix",
            "--documents",
            "2",
            "--users",
            "6",
            "--concurrency",
            "2",
            "--doc-tokens",
            "24",
        ],
    ],
)
def test_other_workloads_plot_too(fake: RunningFake, tmp_path: Path, workload: list[str]) -> None:
    plot = tmp_path / "p.png"
    assert (
        main(
            [
                "bench",
                *workload,
                "--target",
                fake.url,
                "--design",
                "OFF-ON",
                "--resamples",
                "50",
                "--plot",
                str(plot),
            ]
        )
        == 0
    )
    assert plot.read_bytes().startswith(PNG_MAGIC)


def test_stores_that_never_commit_in_time_are_flagged(fake: RunningFake, tmp_path: Path) -> None:
    fake.cluster.commit_delay_s = 5.0  # far beyond the settle timeout: pool hits cannot happen
    md = tmp_path / "r.md"
    assert (
        main(
            [
                "bench",
                "cross-replica",
                "--target",
                fake.url,
                "--lengths",
                "16",
                "--requests-per-block",
                "1",
                "--design",
                "OFF-ON",
                "--settle-timeout",
                "0.05",
                "--resamples",
                "50",
                "--markdown",
                str(md),
            ]
        )
        == 0
    )
    text = md.read_text()
    assert "warning: 1 requests were sent after waiting the whole settle timeout (0.05 s)" in text
    assert "| 0.0%/0.0% |" in text  # and indeed the ON follow-up found nothing in the pool


def _fake_up(url: str | None, logs: list[Path]) -> object:
    """A cluster_target that writes to its log and yields `url`, or fails to start (url None)."""
    from collections.abc import Iterator
    from contextlib import contextmanager

    from kvshare.bench.cluster import Target

    @contextmanager
    def cluster_target(target: str | None, up_args: str | None, log: Path) -> Iterator[Target]:
        logs.append(log)
        log.write_text("replica output\n")
        if url is None:
            raise RuntimeError("replica 0 exited with status 1")
        yield Target(url, None)

    return cluster_target


def test_the_cluster_log_is_removed_after_a_good_run(
    fake: RunningFake, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvshare.bench import cluster

    logs: list[Path] = []
    monkeypatch.setattr(cluster, "cluster_target", _fake_up(fake.url, logs))
    assert (
        main(
            [
                "bench",
                "cross-replica",
                "--up",
                "",
                "--lengths",
                "16",
                "--requests-per-block",
                "1",
                "--design",
                "OFF-ON",
                "--resamples",
                "50",
            ]
        )
        == 0
    )
    assert len(logs) == 1 and not logs[0].exists() and not logs[0].parent.exists()


def test_the_cluster_log_is_kept_and_named_when_the_run_fails(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvshare.bench import cluster

    logs: list[Path] = []
    monkeypatch.setattr(cluster, "cluster_target", _fake_up(None, logs))
    assert main(["bench", "cross-replica", "--up", "", "--lengths", "16"]) == 1
    out = capsys.readouterr().out.replace("\n", "")
    try:
        assert logs[0].read_text() == "replica output\n"
        assert str(logs[0]) in out
    finally:
        logs[0].unlink()
        logs[0].parent.rmdir()


def test_a_plot_of_one_length_labels_values_counts_and_the_ratio(
    fake: RunningFake,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    from kvshare.bench import driver, plots

    plotted: list[tuple] = []
    monkeypatch.setattr(
        driver, "plot_run", lambda run, comparisons, path: plotted.append((run, comparisons))
    )
    assert (
        main(
            [
                "bench",
                "cross-replica",
                "--target",
                fake.url,
                "--lengths",
                "16",
                "--requests-per-block",
                "2",
                "--resamples",
                "50",
                "--plot",
                str(tmp_path / "p.png"),
            ]
        )
        == 0
    )
    run, comparisons = plotted[0]
    (point,) = comparisons
    texts = [t.get_text() for t in plots.plot_figure(run, comparisons).axes[0].texts]
    assert f"{point.off.value:.3g} s (n={point.counts[0]})" in texts
    assert f"{point.on.value:.3g} s (n={point.counts[1]})" in texts
    r = point.ratio
    assert f"ON/OFF {r.value:.3g} [{r.low:.3g}, {r.high:.3g}]" in texts


def test_piped_output_is_markdown_with_whole_cells(
    fake: RunningFake, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "bench",
                "cross-replica",
                "--target",
                fake.url,
                "--lengths",
                "16",
                "--requests-per-block",
                "1",
                "--design",
                "OFF-ON",
                "--resamples",
                "50",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    header = (
        "| metric | series | context tokens | OFF median [95%] | ON median [95%] | ON/OFF [95%] "
        "| block medians | blocks apart OFF/ON: KS (p) | n OFF/ON | pool hit OFF/ON |"
    )
    assert header in out.splitlines()
    row = next(line for line in out.splitlines() if line.startswith("| ttft_s |"))
    assert len(row.split("|")) == 12 and "…" not in out
