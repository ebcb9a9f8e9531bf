"""Timing helpers shared by the benchmark modules.

Benchmarks report *ratios* against a baseline measured in the same run, never absolute
limits: machines are shared and noisy. Candidate and baseline are timed in interleaved
rounds (a noisy neighbour slows both alike), and every figure is the **median over
rounds**, shown with its spread. The best round is never reported on its own: it hides
costs that build up over a run (a cache or a map filling), which only the later rounds
show. :attr:`Timing.drift` compares the last rounds with the first, and a result says
so when they drift apart.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["BenchResult", "Timing", "DRIFT_LIMIT", "time_rounds", "interleaved"]

DRIFT_LIMIT = 1.25
"""Late rounds slower than early ones by more than this factor are reported as drift."""


@dataclass(frozen=True)
class Timing:
    """Per-call seconds of each round of one measurement, in the order they ran."""

    rounds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.rounds)

    @property
    def low(self) -> float:
        return min(self.rounds)

    @property
    def high(self) -> float:
        return max(self.rounds)

    @property
    def drift(self) -> float:
        """Median of the last third of the rounds over the median of the first third (1.0: flat)."""
        third = max(1, len(self.rounds) // 3)
        return statistics.median(self.rounds[-third:]) / statistics.median(self.rounds[:third])


def time_rounds(fn: Callable[[], object], *, number: int, rounds: int) -> Timing:
    """Time ``rounds`` rounds of ``number`` calls of ``fn`` (after one warm-up call)."""
    return interleaved({"fn": fn}, number=number, rounds=rounds)["fn"]


def interleaved(fns: Mapping[str, Callable[[], object]], *, number: int, rounds: int) -> dict[str, Timing]:
    """Time every function in turn, ``rounds`` times over, ``number`` calls a round each."""
    for fn in fns.values():
        fn()  # warm-up: first calls pay for lazy initialisation and compilation
    per_round: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(number):
                fn()
            per_round[name].append((time.perf_counter() - start) / number)
    return {name: Timing(tuple(values)) for name, values in per_round.items()}


@dataclass(frozen=True)
class BenchResult:
    """One benchmark line: a measured operation against its baseline, both over rounds.

    ``ratio`` is the median candidate time over the median baseline time for cost
    benchmarks (lower is better), or the inverse for throughput ones (higher is better);
    ``better`` says which, and ``target`` is the ratio the project aims for (``None`` if
    none). ``ratio_range`` is the spread of the per-round ratios.
    """

    name: str
    timing: Timing
    baseline: str
    baseline_timing: Timing
    better: str = "lower"  # "lower": a cost ratio; "higher": a throughput ratio
    target: float | None = None
    note: str = ""

    @property
    def seconds(self) -> float:
        return self.timing.median

    @property
    def baseline_seconds(self) -> float:
        return self.baseline_timing.median

    @property
    def ratio(self) -> float:
        return self._ratio(self.seconds, self.baseline_seconds)

    @property
    def ratio_range(self) -> tuple[float, float]:
        """The lowest and highest ratio of the rounds (paired in order when both have as many)."""
        ours, theirs = self.timing.rounds, self.baseline_timing.rounds
        if len(ours) == len(theirs):
            per_round = [self._ratio(a, b) for a, b in zip(ours, theirs)]
        else:
            per_round = [self._ratio(a, b) for a in (min(ours), max(ours)) for b in (min(theirs), max(theirs))]
        return min(per_round), max(per_round)

    @property
    def drifted(self) -> bool:
        """Whether the candidate's late rounds ran slower than its early ones by more than :data:`DRIFT_LIMIT`."""
        return self.timing.drift > DRIFT_LIMIT

    @property
    def meets_target(self) -> bool | None:
        if self.target is None:
            return None
        return self.ratio <= self.target if self.better == "lower" else self.ratio >= self.target

    def _ratio(self, ours: float, theirs: float) -> float:
        return ours / theirs if self.better == "lower" else theirs / ours
