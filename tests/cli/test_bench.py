"""`hyperrng bench` runs in a short mode and reports well-formed ratios (never timed here)."""

from __future__ import annotations

import math

import pytest

from hyperrng.cli import main
from hyperrng.cli.bench import SUITES, BenchResult, Timing, format_results, run_benchmarks
from hyperrng.errors import InvalidArgumentError


@pytest.mark.slow
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
    with pytest.raises(InvalidArgumentError, match="unknown benchmark suite"):
        run_benchmarks(quick=True, suites=["nonsense"])
    assert main(["bench", "--quick", "--suite", "nonsense"]) == 2
    assert "unknown benchmark suite(s) ['nonsense']" in capsys.readouterr().err


def test_a_result_knows_which_way_is_better() -> None:
    cost = BenchResult("x", Timing((2.0,)), "base", Timing((4.0,)), better="lower", target=1.0)
    speed = BenchResult("y", Timing((2.0,)), "base", Timing((1.0,)), better="higher", target=0.8)
    assert (cost.ratio, cost.meets_target) == (0.5, True)
    assert (speed.ratio, speed.meets_target) == (0.5, False)


def test_a_result_is_the_median_of_its_rounds_with_their_spread() -> None:
    # One fast round must not hide slow ones: the median and the range say what happened.
    r = BenchResult("x", Timing((1.0, 5.0, 6.0)), "base", Timing((2.0, 2.0, 2.0)), target=1.5)
    assert r.seconds == 5.0 and r.ratio == 2.5 and not r.meets_target
    assert r.ratio_range == (0.5, 3.0)


def test_rounds_that_slow_down_over_a_run_are_reported_as_drift() -> None:
    flat = BenchResult("flat", Timing((1.0, 1.1, 1.0, 0.9, 1.0, 1.1)), "b", Timing((1.0,) * 6))
    building = BenchResult("built", Timing((1.0, 1.0, 3.0, 6.0, 12.0, 20.0)), "b", Timing((1.0,) * 6))
    assert not flat.drifted and building.drifted
    table = format_results([flat, building])
    assert table.count("build-up") == 1 and "late/early rounds 16.00x: build-up" in table


def test_the_gpu_suite_says_in_one_line_why_it_is_skipped_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the suite runs")
    assert run_benchmarks(quick=True, suites=["gpu"]) == []
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "gpu suite skipped" in lines[0] and "CUDA" in lines[0]


@pytest.mark.needs_portable_mode
def test_the_gpu_suites_rows_and_block_step_run_on_any_device_at_small_sizes() -> None:
    """The suite's code paths, on the CPU: the rows compare the same calls a GPU run times."""
    import torch

    from hyperrng.cli.bench import gpu
    from hyperrng.philox import philox4x32_10  # noqa: F401 -- the package a row draws from

    rows = gpu.device_rows(torch.device("cpu"), quick=True, sizes=(2**10,))
    names = [r.name for r in rows]
    assert names[0] == "gpu: philox uniform f32, 2**10" and "gpu: F.dropout bf16 in portable mode, 2**10" in names
    assert all(r.seconds > 0 and r.baseline_seconds > 0 and r.target is None for r in rows)
    step, portable_step = gpu.block_step(
        torch.device("cpu"), {"batch": 1, "sequence": 8, "width": 16, "heads": 2}, p_attn=0.1
    )
    step()
    portable_step()
    native, portable = gpu.attention_step(torch.device("cpu"), 1, 2, 8, 16, causal=True)
    native()
    portable()
