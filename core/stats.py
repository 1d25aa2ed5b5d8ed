"""Paired timing statistics for the judge: per-request ratios, geometric mean, bootstrap interval.

An A/A comparison at the start of a run (the incumbent on the baseline worker against the incumbent on a
fresh worker, as candidates are measured) gives two facts about timing noise: the bias between the two
sides and the spread of one request's ratio, both in log space. The noise floor is how far apart two
workers of one recipe may stand, in either direction: the bias's size plus its own 95% margin. It is 0 only
when every A/A ratio is identical, never because one side happened to run slower.

A candidate wins when the lower end of its 95% interval clears 1 + the floor. That interval is the wider of
the bootstrap over its requests and the normal interval with the larger of its own spread and the A/A's:
with two requests a bootstrap cannot see the noise, and the A/A's many samples can.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


Z95 = 1.959964  # two-sided 95% normal quantile


@dataclass
class Noise:
    """What an A/A comparison says about timing: bias and per-request spread of the log ratio, over n samples."""

    bias: float
    spread: float
    n: int

    @property
    def floor(self) -> float:
        """The bias in either direction plus its 95% margin, as a speedup fraction (0.05 = 5%)."""
        if self.n == 0:
            return 0.0
        return math.exp(abs(self.bias) + Z95 * self.spread / math.sqrt(self.n)) - 1.0


@dataclass
class Comparison:
    speedup: float
    low: float
    high: float
    noise_floor: float
    passed: bool
    n: int

    def to_dict(self) -> dict:
        return asdict(self)


def speedups(baseline_rates: list[float], candidate_rates: list[float]) -> list[float]:
    """Per-request speedups: candidate tokens/s over baseline tokens/s on the same request."""
    return [c / b for b, c in zip(baseline_rates, candidate_rates) if b > 0 and c > 0]


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def bootstrap(ratios: list[float], draws: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the geometric mean (resampling requests), seeded."""
    if not ratios:
        return float("nan"), float("nan")
    import numpy as np

    logs = np.log(np.asarray(ratios, dtype=np.float64))
    n = len(logs)
    rng = np.random.default_rng(seed)
    means = np.sort(logs[rng.integers(0, n, size=(draws, n))].mean(axis=1))
    lo = means[int((1 - level) / 2 * draws)]
    hi = means[min(draws - 1, int((1 + level) / 2 * draws))]
    return math.exp(lo), math.exp(hi)


def spread(ratios: list[float]) -> float:
    """Sample standard deviation of the log ratios (0 for fewer than two)."""
    if len(ratios) < 2:
        return 0.0
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / len(logs)
    return math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))


def noise(aa_ratios: list[float]) -> Noise:
    """The A/A comparison's bias and spread in log space."""
    if not aa_ratios:
        return Noise(0.0, 0.0, 0)
    return Noise(math.log(geomean(aa_ratios)), spread(aa_ratios), len(aa_ratios))


def noise_floor(aa_ratios: list[float]) -> float:
    """How far apart the two sides of an A/A comparison stand, in either direction, with its 95% margin."""
    return noise(aa_ratios).floor


def compare(ratios: list[float], floor: float, seed: int = 0, noise_spread: float = 0.0) -> Comparison:
    """The geometric-mean speedup and its 95% interval (see the module doc); passed when low > 1 + floor."""
    low, high = bootstrap(ratios, seed=seed)
    if ratios:
        centre = math.log(geomean(ratios))
        margin = Z95 * max(noise_spread, spread(ratios)) / math.sqrt(len(ratios))
        low, high = min(low, math.exp(centre - margin)), max(high, math.exp(centre + margin))
    return Comparison(geomean(ratios), low, high, floor, bool(ratios) and low > 1.0 + floor, len(ratios))
