"""From records to results: per-block medians, pooled medians per condition, ON/OFF ratios.

A sample is one value of one metric at one point (series, x) in one block. `ttft_s` comes from
every measured request that streamed content; `session_s` is a session's time spent waiting
for answers: the sum of its requests' total times (the bench's own pauses between turns, and
the building of prompts, are not in it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvshare.bench.design import OFF, ON, Design
from kvshare.bench.ideal import PromptShare, computed_over_ideal, ideal_computed_tokens
from kvshare.bench.records import BlockResult, RequestRecord
from kvshare.bench.stats import (
    Agreement,
    BootstrapSpec,
    Estimate,
    block_agreement,
    median_interval,
    ratio_interval,
)
from kvshare.spec import DEFAULT_CHUNK_TOKENS

TTFT = "ttft_s"
SESSION = "session_s"
METRICS = (TTFT, SESSION)

Point = tuple[str, str, int | None]  # (metric, series, x)


@dataclass(frozen=True)
class Sample:
    metric: str
    series: str
    x: int | None
    block: int
    condition: str
    value: float

    @property
    def point(self) -> Point:
        return self.metric, self.series, self.x


def _end(record: RequestRecord) -> float:
    return record.start_s + record.result.total_s


def samples(records: Iterable[RequestRecord]) -> list[Sample]:
    out = []
    sessions: dict[tuple[int, str], list[RequestRecord]] = defaultdict(list)
    for r in records:
        if not r.measured:
            continue
        if r.result.ttft_s is not None:
            out.append(Sample(TTFT, r.tag.series, r.tag.x, r.block, r.condition, r.result.ttft_s))
        if r.tag.session is not None:
            sessions[r.block, r.tag.session].append(r)
    for group in sessions.values():
        first = group[0]
        waited = sum(r.result.total_s for r in group)
        out.append(Sample(SESSION, first.tag.series, None, first.block, first.condition, waited))
    return out


def pool_hit_rate(records: Iterable[RequestRecord]) -> float | None:
    """pool_hit_tokens / prompt_tokens over the records (usage.kv); None with no prompt
    tokens, or when a record has no usage.kv to count from."""
    prompt = hits = 0
    for r in records:
        if not r.counts_kv:
            return None
        prompt += r.usage_int("prompt_tokens")
        hits += r.usage_int("kv", "pool_hit_tokens")
    return hits / prompt if prompt else None


@dataclass(frozen=True)
class Comparison:
    metric: str
    series: str
    x: int | None
    block_medians: tuple[float | None, ...]  # per design block; None: no sample in that block
    counts: tuple[int, int]  # samples (OFF, ON)
    off: Estimate | None
    on: Estimate | None
    ratio: Estimate | None  # median ON / median OFF
    hit_rates: tuple[float | None, float | None]  # pool hit rate (OFF, ON) of the point's requests
    # (OFF, ON): whether the blocks of a condition repeat one another; None under two blocks
    agreement: tuple[Agreement | None, Agreement | None] = (None, None)

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {self.metric!r}")


def paired_ratios(comparison: Comparison, design: Design) -> list[float]:
    """ON / OFF block median of each back-to-back pair of blocks (Design.pairs) that has both."""
    medians = comparison.block_medians
    return [
        on / off
        for off, on in ((medians[i], medians[j]) for i, j in design.pairs())
        if off and on is not None
    ]


def condition_medians(comparison: Comparison, design: Design, condition: str) -> list[float]:
    """The block medians of the blocks with `condition` that have a sample."""
    return [
        m
        for b, m in zip(design.blocks, comparison.block_medians)
        if b.condition == condition and m is not None
    ]


def _strata(samples: Sequence[Sample], design: Design, condition: str) -> list[list[float]]:
    return [
        [s.value for s in samples if s.block == b.index]
        for b in design.blocks
        if b.condition == condition
    ]


def compare(blocks: Sequence[BlockResult], design: Design, spec: BootstrapSpec) -> list[Comparison]:
    """One comparison per (metric, series, x), in metric order, then first appearance, then x."""
    records = [r for b in blocks for r in b.records]
    by_point: dict[Point, list[Sample]] = defaultdict(list)
    for s in samples(records):
        by_point[s.point].append(s)
    series_order = list(dict.fromkeys(r.tag.series for r in records))
    ordered = sorted(
        by_point,
        key=lambda p: (METRICS.index(p[0]), series_order.index(p[1]), -1 if p[2] is None else p[2]),
    )
    return [_compare(point, by_point[point], records, design, spec) for point in ordered]


def _compare(
    point: Point,
    group: list[Sample],
    records: list[RequestRecord],
    design: Design,
    spec: BootstrapSpec,
) -> Comparison:
    metric, series, x = point
    medians = tuple(
        float(np.median(values))
        if (values := [s.value for s in group if s.block == b.index])
        else None
        for b in design.blocks
    )
    off, on = _strata(group, design, OFF), _strata(group, design, ON)
    n_off, n_on = sum(map(len, off)), sum(map(len, on))
    mine = [
        r
        for r in records
        if r.measured and r.tag.series == series and (metric == SESSION or r.tag.x == x)
    ]
    return Comparison(
        metric,
        series,
        x,
        medians,
        (n_off, n_on),
        off=median_interval(off, spec) if n_off else None,
        on=median_interval(on, spec) if n_on else None,
        ratio=ratio_interval(on, off, spec) if n_off and n_on else None,
        hit_rates=(
            pool_hit_rate(r for r in mine if r.condition == OFF),
            pool_hit_rate(r for r in mine if r.condition == ON),
        ),
        agreement=(block_agreement(off), block_agreement(on)),
    )


def prompt_shares(records: Iterable[RequestRecord]) -> list[PromptShare]:
    """What each request shares with earlier ones of its group, in the order they were sent."""
    previous: dict[str, int] = {}  # group -> prompt tokens of its latest request
    out = []
    for r in sorted(records, key=lambda r: r.start_s):
        prompt, group = r.usage_int("prompt_tokens"), r.tag.group
        shared = 0
        if group is not None and group in previous:
            known = r.tag.shared_tokens
            shared = min(prompt, previous[group] if known is None else known)
        if group is not None:
            previous[group] = prompt
        out.append(PromptShare(group, prompt, shared))
    return out


def computed_tokens(records: Iterable[RequestRecord]) -> int:
    return sum(r.usage_int("kv", "computed_tokens") for r in records)


@dataclass(frozen=True)
class BlockRow:
    index: int
    condition: str
    requests: int
    no_content: int  # measured requests that streamed no content (no TTFT)
    median_ttft_s: float | None  # of measured requests
    span_s: float  # first send to last response end
    requests_per_s: float
    tokens_per_s: float  # prompt + completion tokens
    output_tokens_per_s: float
    pool_hit_rate: float | None  # of measured requests
    loaded_bytes: int | None  # pool -> replicas, all replicas
    stored_bytes: int | None  # replicas -> pool
    settle_s: float  # waited in all for stores to commit before requests (runner.settle)
    computed_tokens: int  # prompt tokens the replicas computed (usage.kv), every request
    ideal_tokens: int  # the fewest they could have (kvshare.bench.ideal)
    computed_over_ideal: float | None


def block_row(result: BlockResult) -> BlockRow:
    records = result.records
    measured = [r for r in records if r.measured]
    ttfts = [r.result.ttft_s for r in measured if r.result.ttft_s is not None]
    span = max(map(_end, records)) - min(r.start_s for r in records) if records else 0.0
    prompt = sum(r.usage_int("prompt_tokens") for r in records)
    output = sum(r.usage_int("completion_tokens") for r in records)
    computed = computed_tokens(records)
    ideal = ideal_computed_tokens(prompt_shares(records), DEFAULT_CHUNK_TOKENS)
    return BlockRow(
        index=result.block.index,
        condition=result.block.condition,
        requests=len(records),
        no_content=len(measured) - len(ttfts),
        median_ttft_s=float(np.median(ttfts)) if ttfts else None,
        span_s=span,
        requests_per_s=len(records) / span if span else 0.0,
        tokens_per_s=(prompt + output) / span if span else 0.0,
        output_tokens_per_s=output / span if span else 0.0,
        pool_hit_rate=pool_hit_rate(measured),
        loaded_bytes=result.pool_bytes("loaded_bytes"),
        stored_bytes=result.pool_bytes("stored_bytes"),
        settle_s=sum(r.settle_s or 0.0 for r in records),
        computed_tokens=computed,
        ideal_tokens=ideal,
        computed_over_ideal=(
            computed_over_ideal(computed, ideal) if all(r.counts_kv for r in records) else None
        ),
    )
