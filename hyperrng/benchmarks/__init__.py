"""The benchmark suites behind ``hyperrng bench``.

Each suite is a module of this package with ``benchmarks(quick: bool) -> list[BenchResult]``.
Every figure is a ratio against a baseline measured in the same run: the median over
interleaved rounds, with the spread of the per-round ratios, and a warning when the late
rounds of a measurement ran slower than its early ones (see :mod:`._timing`).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from hyperrng.benchmarks._timing import BenchResult, Timing, interleaved, time_rounds

__all__ = ["SUITES", "BenchResult", "Timing", "interleaved", "time_rounds", "run_benchmarks", "format_results"]

SUITES = ("platform", "streams", "sharding", "philox")


def run_benchmarks(quick: bool = False, suites: Sequence[str] | None = None) -> list[BenchResult]:
    """Run the named suites (default: all) and return their results in order."""
    chosen = list(suites) if suites else list(SUITES)
    unknown = [s for s in chosen if s not in SUITES]
    if unknown:
        from hyperrng.errors import UsageError

        raise UsageError(f"unknown benchmark suite(s) {unknown}; choose from {list(SUITES)}.")
    results: list[BenchResult] = []
    for name in chosen:
        module = importlib.import_module(f"hyperrng.benchmarks.{name}")
        results.extend(module.benchmarks(quick))
    return results


def format_results(results: Sequence[BenchResult]) -> str:
    """A fixed-width table: median time and its spread, baseline, median ratio and its range, target."""
    header = (
        f"{'benchmark':<46} {'median':>10} {'spread':>19} {'baseline':<34} {'ratio':>6} {'ratio range':>13} "
        f"{'target':>7}  ok"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        target = "-" if r.target is None else ("<=" if r.better == "lower" else ">=") + f"{r.target:g}"
        ok = {None: "", True: "yes", False: "NO"}[r.meets_target]
        spread = f"{_fmt_time(r.timing.low)}-{_fmt_time(r.timing.high)}"
        low, high = r.ratio_range
        lines.append(
            f"{r.name:<46} {_fmt_time(r.seconds):>10} {spread:>19} {r.baseline:<34} {r.ratio:>6.2f} "
            f"{f'{low:.2f}-{high:.2f}':>13} {target:>7}  {ok}"
        )
        if r.drifted:
            lines.append(
                f"    DRIFT: its last rounds ran {r.timing.drift:.2f}x slower than its first "
                f"({len(r.timing.rounds)} rounds): something builds up over the run"
            )
        if r.note:
            lines.append(f"    {r.note}")
    return "\n".join(lines)


def _fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f}us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f}ms"
    return f"{seconds:.2f}s"
