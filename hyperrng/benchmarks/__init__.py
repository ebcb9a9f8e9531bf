"""The benchmark suites behind ``hyperrng bench``.

Each suite is a module of this package with ``benchmarks(quick: bool) -> list[BenchResult]``.
Every figure is a ratio against a baseline measured in the same run.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from hyperrng.benchmarks._timing import BenchResult, best_time

__all__ = ["SUITES", "BenchResult", "best_time", "run_benchmarks", "format_results"]

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
    """A fixed-width table of results: figure, baseline, ratio, target and verdict."""
    header = f"{'benchmark':<46} {'time':>10} {'baseline':<34} {'ratio':>7} {'target':>8}  ok"
    lines = [header, "-" * len(header)]
    for r in results:
        target = "-" if r.target is None else ("<=" if r.better == "lower" else ">=") + f"{r.target:g}"
        ok = {None: "", True: "yes", False: "NO"}[r.meets_target]
        lines.append(f"{r.name:<46} {_fmt_time(r.seconds):>10} {r.baseline:<34} {r.ratio:>7.2f} {target:>8}  {ok}")
        if r.note:
            lines.append(f"    {r.note}")
    return "\n".join(lines)


def _fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.2f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"
