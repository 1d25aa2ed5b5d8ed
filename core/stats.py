"""Paired timing statistics for the judge: per-request ratios, geometric mean, bootstrap interval.

A candidate wins when the lower bound of the 95% bootstrap interval of the geometric-mean speedup clears
1 + the noise floor, where the noise floor is how far an A/A comparison (incumbent against itself) reached
above 1 at the start of the run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


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


def noise_floor(aa_ratios: list[float], seed: int = 0) -> float:
    """How far above 1 an A/A comparison's interval reaches (0 if it stays below)."""
    _, high = bootstrap(aa_ratios, seed=seed)
    return max(0.0, high - 1.0)


def compare(ratios: list[float], floor: float, seed: int = 0) -> Comparison:
    low, high = bootstrap(ratios, seed=seed)
    return Comparison(geomean(ratios), low, high, floor, bool(ratios) and low > 1.0 + floor, len(ratios))
