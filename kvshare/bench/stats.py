"""Medians with seeded percentile-bootstrap intervals, the ON/OFF ratio of medians, the
geometric mean of paired ratios with a Student-t interval, and whether the blocks of one
condition agree (two-sample Kolmogorov-Smirnov).

Samples of a condition come from several blocks. Resampling is stratified by block (each
block resampled within itself, with its own size), so every bootstrap replicate keeps the
design's balance of blocks; with one block it is the plain bootstrap. That interval leaves
out the variation between blocks (a machine that gets busier between an OFF and an ON
block, and with one sample per block it has no width at all); `geometric_mean_interval`
treats each block median, or each OFF/ON pair of blocks' ratio, as one replicate instead, so
that variation is in its interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_RESAMPLES = 2000
DEFAULT_LEVEL = 0.95


@dataclass(frozen=True)
class Estimate:
    value: float  # the point estimate on the original data
    low: float  # percentile interval
    high: float

    def __post_init__(self) -> None:
        if not self.low <= self.high:
            raise ValueError(f"interval [{self.low}, {self.high}] is reversed")


@dataclass(frozen=True)
class BootstrapSpec:
    resamples: int = DEFAULT_RESAMPLES
    level: float = DEFAULT_LEVEL
    seed: int = 0

    def __post_init__(self) -> None:
        if self.resamples < 1:
            raise ValueError(f"resamples must be >= 1, got {self.resamples}")
        if not 0.0 < self.level < 1.0:
            raise ValueError(f"level must be in (0, 1), got {self.level}")

    def percentiles(self) -> tuple[float, float]:
        tail = 100.0 * (1.0 - self.level) / 2.0
        return tail, 100.0 - tail


def _strata(samples: Sequence[Sequence[float]]) -> list[np.ndarray]:
    strata = [np.asarray(s, dtype=np.float64) for s in samples if len(s)]
    if not strata:
        raise ValueError("no samples")
    return strata


def bootstrap_medians(
    strata: Sequence[Sequence[float]], resamples: int, rng: np.random.Generator
) -> np.ndarray:
    """`resamples` medians, each of the union of one with-replacement resample per stratum."""
    parts = []
    for stratum in _strata(strata):
        idx = rng.integers(0, len(stratum), size=(resamples, len(stratum)))
        parts.append(stratum[idx])
    return np.median(np.concatenate(parts, axis=1), axis=1)


def pooled_median(strata: Sequence[Sequence[float]]) -> float:
    return float(np.median(np.concatenate(_strata(strata))))


def median_interval(strata: Sequence[Sequence[float]], spec: BootstrapSpec) -> Estimate:
    """Median of all samples, with a percentile-bootstrap interval."""
    medians = bootstrap_medians(strata, spec.resamples, np.random.default_rng(spec.seed))
    low, high = np.percentile(medians, spec.percentiles())
    return Estimate(pooled_median(strata), float(low), float(high))


def ratio_interval(
    numerator: Sequence[Sequence[float]],
    denominator: Sequence[Sequence[float]],
    spec: BootstrapSpec,
) -> Estimate:
    """median(numerator) / median(denominator), both resampled independently per replicate."""
    rng = np.random.default_rng(spec.seed)
    top = bootstrap_medians(numerator, spec.resamples, rng)
    bottom = bootstrap_medians(denominator, spec.resamples, rng)
    if np.any(bottom <= 0) or pooled_median(denominator) <= 0:
        raise ValueError("the denominator's median must be positive")
    low, high = np.percentile(top / bottom, spec.percentiles())
    return Estimate(pooled_median(numerator) / pooled_median(denominator), float(low), float(high))


def t_quantile(p: float, df: int) -> float:
    """The p-quantile (p > 0.5) of Student's t with `df` degrees of freedom, by bisection on
    its CDF (the density integrated by Simpson's rule; accurate to ~1e-6 for df >= 1)."""
    if not 0.5 < p < 1.0 or df < 1:
        raise ValueError(f"need 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float) -> float:
        t = np.linspace(0.0, x, 4001)
        density = np.exp(log_norm - (df + 1) / 2 * np.log1p(t * t / df))
        weights = np.ones_like(t)
        weights[1:-1:2], weights[2:-1:2] = 4.0, 2.0
        return 0.5 + float(weights @ density) * (x / 4000) / 3

    low, high = 0.0, 1.0
    while cdf(high) < p:
        low, high = high, 2 * high
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < p else (low, mid)
    return (low + high) / 2


def geometric_mean_interval(values: Sequence[float], level: float = DEFAULT_LEVEL) -> Estimate:
    """Geometric mean of >= 2 positive values, each one independent replicate (a block's
    median, the ratio of one OFF/ON pair of blocks), with a Student-t interval on their logs."""
    if len(values) < 2 or min(values) <= 0:
        raise ValueError(f"need at least 2 positive values, got {list(values)}")
    logs = np.log(np.asarray(values, dtype=np.float64))
    center = float(logs.mean())
    half = (
        t_quantile(0.5 + level / 2, len(logs) - 1) * float(logs.std(ddof=1)) / math.sqrt(len(logs))
    )
    return Estimate(math.exp(center), math.exp(center - half), math.exp(center + half))


@dataclass(frozen=True)
class Agreement:
    """How far apart the blocks of one condition are: the largest two-sample
    Kolmogorov-Smirnov distance over pairs of its blocks (the largest gap between their
    empirical distributions, 0..1) and that pair's asymptotic p-value: small when blocks that
    should repeat one another do not (the machine, the cache or the router drifted).

    Unlike a difference of block medians it does not jump when the median of a bimodal
    block (requests answered from a cache, requests waiting for a prefill) crosses the gap
    between the modes because one or two more requests waited."""

    distance: float
    p_value: float


def ks_distance(a: Sequence[float], b: Sequence[float]) -> float:
    """sup |F_a(x) - F_b(x)| over x, F the empirical distribution functions (ties counted
    on both sides at once, so equal samples are 0 apart)."""
    if not len(a) or not len(b):
        raise ValueError("both samples need values")
    xa, xb = np.sort(np.asarray(a, np.float64)), np.sort(np.asarray(b, np.float64))
    at = np.concatenate([xa, xb])
    fa = np.searchsorted(xa, at, side="right") / len(xa)
    fb = np.searchsorted(xb, at, side="right") / len(xb)
    return float(np.max(np.abs(fa - fb)))


def ks_p_value(distance: float, n: int, m: int) -> float:
    """P(distance or more) for samples of n and m from one continuous distribution: the
    Kolmogorov distribution's tail with Stephens' small-sample correction (within a few
    percent of the exact value from n, m ~ 10)."""
    if not 0.0 <= distance <= 1.0 or n < 1 or m < 1:
        raise ValueError(f"need 0 <= distance <= 1 and n, m >= 1, got {distance}, {n}, {m}")
    root = math.sqrt(n * m / (n + m))
    lam = (root + 0.12 + 0.11 / root) * distance
    if lam < 1e-3:
        return 1.0
    tail = 2.0 * sum((-1) ** (j - 1) * math.exp(-2.0 * j * j * lam * lam) for j in range(1, 101))
    return min(1.0, max(0.0, tail))


def block_agreement(strata: Sequence[Sequence[float]]) -> Agreement | None:
    """The least agreeing pair of the blocks that have samples; None with fewer than two."""
    blocks = [s for s in strata if len(s)]
    pairs = [
        (ks_distance(a, b), len(a), len(b)) for i, a in enumerate(blocks) for b in blocks[i + 1 :]
    ]
    if not pairs:
        return None
    distance, n, m = max(pairs)
    return Agreement(distance, ks_p_value(distance, n, m))
