"""Timing helpers shared by the benchmark modules.

Benchmarks report *ratios* against a baseline measured in the same run, never absolute
limits: machines are shared and noisy. Each measurement takes the best (minimum) of
several repeats, which is the figure least disturbed by other processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BenchResult", "best_time"]


@dataclass(frozen=True)
class BenchResult:
    """One benchmark line: a measured operation against its baseline.

    ``ratio`` is ``seconds / baseline_seconds`` for cost benchmarks (lower is better)
    or ``baseline_seconds / seconds`` for throughput ones (higher is better); ``better``
    says which, and ``target`` is the ratio the project aims for (``None`` if none).
    """

    name: str
    seconds: float
    baseline: str
    baseline_seconds: float
    better: str = "lower"  # "lower": a cost ratio; "higher": a throughput ratio
    target: float | None = None
    note: str = ""

    @property
    def ratio(self) -> float:
        if self.better == "lower":
            return self.seconds / self.baseline_seconds
        return self.baseline_seconds / self.seconds

    @property
    def meets_target(self) -> bool | None:
        if self.target is None:
            return None
        return self.ratio <= self.target if self.better == "lower" else self.ratio >= self.target


def best_time(fn: Callable[[], object], *, number: int, repeat: int = 5) -> float:
    """Return the best per-call time in seconds of ``fn`` over ``repeat`` runs of ``number`` calls."""
    fn()  # warm-up: first calls pay for lazy initialisation
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best
