"""Timing helpers shared by the benchmark modules.

Benchmarks report *ratios* against a baseline measured in the same run, never absolute
limits: machines are shared and noisy. Candidate and baseline are timed in interleaved
rounds (a noisy neighbour slows both alike), and every figure is the **median over
rounds**, shown with its spread. The best round is never reported on its own: it hides
costs that build up over a run (a cache or a map filling), which only the later rounds
show. :attr:`Timing.drift` compares the last rounds with the first, and :attr:`Timing.trend`
says what that comparison can honestly be taken for: flat, a build-up, a warm-up, or a
noisy machine whose rounds scatter too widely to tell.

A :class:`BenchResult` is reported as soon as it is made (see :func:`reporting`): every
suite makes a row right after timing it, so a runner can print rows as they are measured.
A suite about to measure for long says what with :func:`announce`, so that a runner can
print progress between rows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

__all__ = ["BenchResult", "Timing", "DRIFT_LIMIT", "TRENDS", "announce", "time_rounds", "interleaved", "reporting"]

DRIFT_LIMIT = 1.25
"""Late rounds slower (or faster) than early ones by more than this factor are a trend worth a word."""

TRENDS = ("flat", "build-up", "warm-up", "noisy", "few rounds", "one round")
"""What :attr:`Timing.trend` can say, from a level run to too little data to say anything."""

_MIN_PER_THIRD = 2  # a build-up is only claimed when each third has this many rounds to compare


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

    @property
    def trend(self) -> str:
        """What the last third of the rounds says against the first third, one of :data:`TRENDS`.

        ``"flat"``: their medians lie within :data:`DRIFT_LIMIT` of each other.
        ``"build-up"`` (``"warm-up"``): the late rounds are slower (faster) by more than
        that, and every late round is slower (faster) than every early one, with at least
        two rounds a third. ``"noisy"``: the medians differ by more than that, but the
        rounds overlap, so the machine's noise is as wide as the difference.
        ``"few rounds"``: they differ, with too few rounds to tell noise from a trend.
        ``"one round"``: fewer than three rounds, nothing to compare.
        """
        if len(self.rounds) < 3:
            return "one round"
        drift = self.drift
        if 1 / DRIFT_LIMIT <= drift <= DRIFT_LIMIT:
            return "flat"
        third = len(self.rounds) // 3
        if third < _MIN_PER_THIRD:
            return "few rounds"
        early, late = self.rounds[:third], self.rounds[-third:]
        if drift > 1 and min(late) > max(early):
            return "build-up"
        if drift < 1 and max(late) < min(early):
            return "warm-up"
        return "noisy"

    def describe_trend(self) -> str:
        """The trend in words, with the late/early ratio: ``"late/early rounds 1.02x: flat"``; empty for one round."""
        trend = self.trend
        if trend == "one round":
            return ""
        words = {
            "flat": "flat",
            "build-up": "build-up (every late round slower than every early one)",
            "warm-up": "warm-up (every early round slower than every late one)",
            "noisy": "noisy machine: spread too wide to tell",
            "few rounds": f"{len(self.rounds)} rounds, too few to tell a build-up from noise",
        }[trend]
        return f"late/early rounds {self.drift:.2f}x: {words}"


def time_rounds(fn: Callable[[], object], *, number: int, rounds: int) -> Timing:
    """Time ``rounds`` rounds of ``number`` calls of ``fn`` (after one warm-up call)."""
    return interleaved({"fn": fn}, number=number, rounds=rounds)["fn"]


def interleaved(
    fns: Mapping[str, Callable[[], object]],
    *,
    number: int,
    rounds: int,
    sync: Callable[[], object] = lambda: None,
) -> dict[str, Timing]:
    """Time every function in turn, ``rounds`` times over, ``number`` calls a round each; ``sync`` is
    called after the warm-up and around each round (a device's synchronize: a round then includes the
    kernels its calls queued)."""
    for fn in fns.values():
        fn()  # warm-up: first calls pay for lazy initialisation and compilation
    sync()
    per_round: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            for _ in range(number):
                fn()
            sync()
            per_round[name].append((time.perf_counter() - start) / number)
    return {name: Timing(tuple(values)) for name, values in per_round.items()}


_ON_RESULT: ContextVar[Callable[[BenchResult], None] | None] = ContextVar("hyperrng_bench_on_result", default=None)
_ON_PROGRESS: ContextVar[Callable[[str], None] | None] = ContextVar("hyperrng_bench_on_progress", default=None)


@contextmanager
def reporting(
    on_result: Callable[[BenchResult], None], on_progress: Callable[[str], None] | None = None
) -> Iterator[None]:
    """Call ``on_result(result)`` for every :class:`BenchResult` made inside the block, as it is made,
    and ``on_progress(text)`` for every :func:`announce`.

    Suites make each row right after timing it and return their rows at the end; this is
    how a runner prints rows while a suite is still measuring the next ones.
    """
    tokens = (_ON_RESULT.set(on_result), _ON_PROGRESS.set(on_progress))
    try:
        yield
    finally:
        _ON_PROGRESS.reset(tokens[1])
        _ON_RESULT.reset(tokens[0])


def announce(text: str) -> None:
    """Say what a suite measures next, where that takes long (nothing outside :func:`reporting`)."""
    on_progress = _ON_PROGRESS.get()
    if on_progress is not None:
        on_progress(text)


@dataclass(frozen=True)
class BenchResult:
    """One benchmark line: a measured operation against its baseline, both over rounds.

    ``ratio`` is the median candidate time over the median baseline time for cost
    benchmarks (lower is better), or the inverse for throughput ones (higher is better);
    ``better`` says which, and ``target`` is the ratio the project aims for (``None`` if
    none). ``ratio_range`` is the spread of the per-round ratios. One made inside
    :func:`reporting` is handed to its callback as soon as it exists.
    """

    name: str
    timing: Timing
    baseline: str
    baseline_timing: Timing
    better: str = "lower"  # "lower": a cost ratio; "higher": a throughput ratio
    target: float | None = None
    note: str = ""

    def __post_init__(self) -> None:
        on_result = _ON_RESULT.get()
        if on_result is not None:
            on_result(self)

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
        """Whether the candidate's rounds show a build-up (see :attr:`Timing.trend`), not merely noise."""
        return self.timing.trend == "build-up"

    @property
    def meets_target(self) -> bool | None:
        if self.target is None:
            return None
        return self.ratio <= self.target if self.better == "lower" else self.ratio >= self.target

    def _ratio(self, ours: float, theirs: float) -> float:
        return ours / theirs if self.better == "lower" else theirs / ours
