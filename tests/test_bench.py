"""`hyperrng bench` runs in a short mode and reports well-formed ratios (never timed here)."""

from __future__ import annotations

import math

import pytest

from hyperrng.benchmarks import SUITES, BenchResult, format_results, run_benchmarks
from hyperrng.cli import main
from hyperrng.errors import UsageError


def test_every_suite_runs_in_quick_mode_and_reports_ratios() -> None:
    results = run_benchmarks(quick=True)
    assert len(results) >= 2 * len(SUITES)
    for r in results:
        assert isinstance(r, BenchResult)
        assert r.seconds > 0 and r.baseline_seconds > 0 and math.isfinite(r.ratio)
        assert r.better in ("lower", "higher")
    table = format_results(results)
    assert "tracker.fork enter+exit" in table and "distribute_region" in table and "philox uniform" in table


def test_an_unknown_suite_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UsageError, match="unknown benchmark suite"):
        run_benchmarks(quick=True, suites=["nonsense"])
    assert main(["bench", "--quick", "--suite", "nonsense"]) == 2
    assert "unknown benchmark suite(s) ['nonsense']" in capsys.readouterr().err


def test_a_result_knows_which_way_is_better() -> None:
    cost = BenchResult("x", 2.0, "base", 4.0, better="lower", target=1.0)
    speed = BenchResult("y", 2.0, "base", 1.0, better="higher", target=0.8)
    assert (cost.ratio, cost.meets_target) == (0.5, True)
    assert (speed.ratio, speed.meets_target) == (0.5, False)
