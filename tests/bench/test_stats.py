"""Bootstrap intervals, ratio intervals, the design, and the blocked bookkeeping."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from kvshare.bench.client import StreamResult
from kvshare.bench.design import Block, Design
from kvshare.bench.records import MEASURE, PREFILL, BlockResult, RequestRecord, Tag
from kvshare.bench.stats import (
    BootstrapSpec,
    block_agreement,
    bootstrap_medians,
    ks_distance,
    ks_p_value,
    median_interval,
    pooled_median,
    ratio_interval,
)
from kvshare.bench.summary import SESSION, TTFT, block_row, compare, pool_hit_rate, samples


def test_median_interval_covers_the_true_median_at_about_the_nominal_rate() -> None:
    # Exponential(1) has median ln 2. 400 seeded experiments of 41 draws each.
    rng = np.random.default_rng(1)
    trials, hits = 400, 0
    for trial in range(trials):
        est = median_interval([rng.exponential(size=41)], BootstrapSpec(resamples=1000, seed=trial))
        hits += est.low <= math.log(2) <= est.high
    assert 0.90 <= hits / trials <= 0.99


def test_ratio_interval_covers_the_true_ratio_of_medians() -> None:
    # Lognormal medians are exp(mu): ON/OFF = exp(-2) exactly. Two strata per condition.
    rng = np.random.default_rng(2)
    truth, trials, hits = math.exp(-2.0), 300, 0
    for trial in range(trials):
        off = [rng.lognormal(0.0, 0.5, 20), rng.lognormal(0.0, 0.5, 20)]
        on = [rng.lognormal(-2.0, 0.5, 20), rng.lognormal(-2.0, 0.5, 20)]
        est = ratio_interval(on, off, BootstrapSpec(resamples=1000, seed=trial))
        hits += est.low <= truth <= est.high
    assert 0.90 <= hits / trials <= 0.99


def test_intervals_are_seeded_and_narrow_with_more_data() -> None:
    rng = np.random.default_rng(3)
    small, large = rng.normal(5, 1, 20), rng.normal(5, 1, 2000)
    spec = BootstrapSpec(resamples=500, seed=7)
    assert median_interval([small], spec) == median_interval([small], spec)
    draws = [bootstrap_medians([small], 50, np.random.default_rng(seed)) for seed in (7, 7, 8)]
    assert np.array_equal(draws[0], draws[1]) and not np.array_equal(draws[0], draws[2])
    width = [
        (e.high - e.low) for e in (median_interval([small], spec), median_interval([large], spec))
    ]
    assert width[1] < width[0] / 4


def test_stratified_resampling_keeps_each_block_in_every_replicate() -> None:
    # Two blocks far apart: a plain bootstrap of the union could draw all from one block and
    # put the median near 0 or 100; stratified, every replicate holds 3 of each, median 50.
    est = median_interval([[0.0, 0.0, 0.0], [100.0, 100.0, 100.0]], BootstrapSpec(300, seed=0))
    assert (est.value, est.low, est.high) == (50.0, 50.0, 50.0)


def test_ratio_of_a_constant_is_exact_and_zero_denominators_are_refused() -> None:
    est = ratio_interval([[1.0, 1.0]], [[4.0, 4.0, 4.0]], BootstrapSpec(100))
    assert (est.value, est.low, est.high) == (0.25, 0.25, 0.25)
    with pytest.raises(ValueError, match="positive"):
        ratio_interval([[1.0]], [[0.0]], BootstrapSpec(100))
    with pytest.raises(ValueError, match="no samples"):
        pooled_median([[], []])


@pytest.mark.parametrize("bad", [{"resamples": 0}, {"level": 1.0}, {"level": 0.0}])
def test_bootstrap_spec_validates(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BootstrapSpec(**bad)  # type: ignore[arg-type]


def test_design_parses_and_validates() -> None:
    design = Design.parse("off-on,ON-OFF")
    assert design.label == "OFF-ON-ON-OFF"
    assert [b.pool_enabled for b in design.blocks] == [False, True, True, False]
    assert design.has_both_conditions() and not Design.parse("ON").has_both_conditions()
    for bad in ("", "OFF-MAYBE", "OFF--ON"):
        with pytest.raises(ValueError, match="design"):
            Design.parse(bad)
    with pytest.raises(ValueError, match="in order"):
        Design((Block(1, "ON"),))


def _record(
    block: Block,
    ttft: float | None,
    x: int | None = 8,
    role: str = MEASURE,
    session: str | None = None,
    start: float = 0.0,
    hits: int = 0,
) -> RequestRecord:
    usage = {"prompt_tokens": 100, "completion_tokens": 4, "kv": {"pool_hit_tokens": hits}}
    result = StreamResult(ttft, (ttft or 0.0) + 0.5, "x", (), usage, None, 3)
    return RequestRecord(
        block.index, block.condition, Tag("s", x, role, "r", session), 1, start, result
    )


def _blocks(design: Design, ttfts: list[list[float]], hits: int = 0) -> list[BlockResult]:
    out = []
    for block, values in zip(design.blocks, ttfts):
        records = [_record(block, v, hits=hits if block.pool_enabled else 0) for v in values]
        records.append(_record(block, 99.0, role=PREFILL))  # never a sample
        out.append(
            BlockResult(
                block,
                1.0,
                ({"kv_pool": {"loaded_bytes": 10 * block.index}},),
                ({"kv_pool": {"loaded_bytes": 10 * block.index + 5}},),
                tuple(records),
            )
        )
    return out


def test_compare_reports_per_block_medians_and_pooled_conditions() -> None:
    design = Design.parse("OFF-ON-ON-OFF")
    blocks = _blocks(design, [[10, 11, 12], [1, 2, 3], [2, 3, 4], [12, 13, 14]], hits=60)
    [c] = compare(blocks, design, BootstrapSpec(500, seed=0))
    assert (c.metric, c.series, c.x) == (TTFT, "s", 8)
    assert c.block_medians == (11.0, 2.0, 3.0, 13.0)
    assert c.counts == (6, 6)
    assert c.off is not None and c.off.value == 12.0  # median of 10..14 with 12 twice
    assert c.on is not None and c.on.value == 2.5
    assert c.ratio is not None and c.ratio.value == pytest.approx(2.5 / 12.0)
    assert c.ratio.low <= c.ratio.value <= c.ratio.high
    assert c.hit_rates == (0.0, 0.6)
    off_apart, on_apart = c.agreement
    assert off_apart is not None and off_apart.distance == pytest.approx(2 / 3)
    assert on_apart is not None and on_apart.distance == pytest.approx(1 / 3)
    row = block_row(blocks[1])
    assert (row.requests, row.median_ttft_s, row.pool_hit_rate, row.loaded_bytes) == (
        4,
        2.0,
        0.6,
        5,
    )


def test_compare_with_one_condition_has_no_ratio() -> None:
    design = Design.parse("ON-ON")
    [c] = compare(_blocks(design, [[1.0], [3.0]]), design, BootstrapSpec(100))
    assert c.off is None and c.ratio is None and c.on is not None and c.on.value == 2.0
    assert c.agreement[0] is None and c.agreement[1] is not None


def test_ks_distance_is_the_largest_gap_between_the_empirical_distributions() -> None:
    assert ks_distance([1, 1, 2], [1, 2, 2]) == pytest.approx(1 / 3)  # at 1: 2/3 against 1/3
    assert ks_distance([1, 1, 2], [1, 1, 2]) == 0.0  # ties on both sides count together
    assert ks_distance([1, 2], [3, 4, 5]) == 1.0
    assert ks_distance([5, 1, 3], [2, 4]) == ks_distance([2, 4], [1, 3, 5])
    with pytest.raises(ValueError):
        ks_distance([], [1.0])


def test_ks_p_values_reject_one_distribution_at_about_the_nominal_rate() -> None:
    # Blocks of 32 from one distribution: p < 0.05 about one time in twenty; from
    # distributions one standard deviation apart: nearly always.
    rng = np.random.default_rng(0)
    same = [
        ks_p_value(ks_distance(rng.normal(size=32), rng.normal(size=32)), 32, 32)
        for _ in range(2000)
    ]
    shifted = [
        ks_p_value(ks_distance(rng.normal(size=32), rng.normal(1.0, size=32)), 32, 32)
        for _ in range(500)
    ]
    assert 0.02 <= np.mean(np.asarray(same) < 0.05) <= 0.07
    assert np.mean(np.asarray(shifted) < 0.05) > 0.9
    assert ks_p_value(0.0, 32, 32) == 1.0 and ks_p_value(1.0, 32, 32) < 1e-10


def test_blocks_whose_median_crosses_a_bimodal_gap_still_agree_and_drift_does_not() -> None:
    # What the H200's concurrency-8 blocks look like: requests answered from a cache (~0.1
    # s) and requests waiting for a prefill (1-15 s); two more waiting requests move one
    # block's median across the gap (0.19 -> 1.1 s, 5.8x) while the distributions agree.
    fast = [0.1 + 0.005 * i for i in range(17)]
    slow = [1.0 + 0.9 * i for i in range(17)]
    cached_more, waited_more = fast + slow[:15], fast[:15] + slow
    assert np.median(waited_more) / np.median(cached_more) > 5
    agreed = block_agreement([cached_more, waited_more])
    assert agreed is not None and agreed.p_value > 0.9
    # Drift: the same block, every request 6x slower (the router stopped finding the cache).
    drifted = block_agreement([cached_more, [6 * v for v in cached_more]])
    assert drifted is not None and drifted.p_value < 0.001
    assert block_agreement([cached_more]) is None and block_agreement([cached_more, []]) is None


def test_samples_skip_prefills_and_missing_ttft_and_time_sessions() -> None:
    block = Block(0, "OFF")
    records = [
        _record(block, 0.2, x=0, session="a", start=1.0),
        _record(block, 0.3, x=1, session="a", start=2.0),
        _record(block, None, x=2, session="a", start=3.0),  # no content: no TTFT, still timed
        _record(block, 9.0, role=PREFILL),
    ]
    got = samples(records)
    assert sorted(s.value for s in got if s.metric == TTFT) == [0.2, 0.3]
    [session] = [s for s in got if s.metric == SESSION]
    assert session.value == pytest.approx((0.2 + 0.5) + (0.3 + 0.5) + 0.5)  # answer waits only
    assert pool_hit_rate([]) is None
    assert block_row(BlockResult(block, 1.0, (), (), tuple(records))).no_content == 1


def test_t_quantiles_match_the_tables() -> None:
    from kvshare.bench.stats import t_quantile

    for df, table in ((1, 12.706), (3, 3.182), (5, 2.571), (30, 2.042)):
        assert t_quantile(0.975, df) == pytest.approx(table, abs=1e-3)


def test_a_paired_ratio_interval_widens_with_the_spread_between_pairs() -> None:
    from kvshare.bench.stats import geometric_mean_interval

    steady = geometric_mean_interval([0.04, 0.041, 0.039, 0.04])
    loaded = geometric_mean_interval(
        [0.03, 0.05, 0.035, 0.06]
    )  # the machine's load changed between pairs
    assert steady.low < 0.04 < steady.high and steady.high - steady.low < 0.003
    assert loaded.low < 0.03 and loaded.high > 0.05  # every pair's ratio is within reach
    with pytest.raises(ValueError):
        geometric_mean_interval([0.04])


def test_paired_designs_put_one_off_and_one_on_block_in_each_neighbour_pair() -> None:
    design = Design.paired(3)
    assert design.label == "OFF-ON-ON-OFF-OFF-ON"
    assert design.pairs() == [(0, 1), (3, 2), (4, 5)]
    assert Design.parse("OFF-OFF-ON-ON").pairs() == []  # neighbours of one condition are no pair


def test_a_server_without_kvshares_counters_has_no_hit_rate_rather_than_zero() -> None:
    # vLLM sends no usage.kv: its hits are unknown, not 0 %.
    block = Design.parse("ON").blocks[0]
    counted = _record(block, 1.0, hits=60)
    vllm = dataclasses.replace(
        counted, result=dataclasses.replace(counted.result, usage={"prompt_tokens": 100})
    )
    assert pool_hit_rate([counted]) == 0.6
    assert pool_hit_rate([counted, vllm]) is None
    row = block_row(BlockResult(block, 1.0, ({},), ({},), (vllm,)))
    assert row.pool_hit_rate is None and row.computed_over_ideal is None
