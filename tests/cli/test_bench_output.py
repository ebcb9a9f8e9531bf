"""What `hyperrng bench` prints: each row as it is measured, within 100 columns, drift worded as what it is."""

from __future__ import annotations

import datetime

import hyperrng.platforms as platforms
import pytest

import hyperrng.cli.bench as bench
from hyperrng.cli.bench import WIDTH, BenchResult, Timing, format_markdown, format_results, format_row, run_benchmarks

_FLAT = (1.0, 1.1, 1.0, 0.9, 1.0, 1.1)


@pytest.mark.parametrize(
    ("rounds", "trend", "words"),
    [
        (_FLAT, "flat", "late/early rounds 1.00x: flat"),
        ((1.0, 3.0, 1.0, 2.5, 1.1, 3.2), "flat", "late/early rounds 1.08x: flat"),  # scattered, but level
        ((1.0, 1.0, 3.0, 6.0, 12.0, 20.0), "build-up", "late/early rounds 16.00x: build-up"),
        ((4.0, 5.0, 3.0, 2.0, 1.0, 1.2), "warm-up", "late/early rounds 0.24x: warm-up"),
        # slower late on the median, but one early round is slower than a late one: noise as wide as the change
        ((1.0, 3.0, 2.0, 2.0, 1.5, 4.0), "noisy", "late/early rounds 1.38x: noisy machine: spread too wide to tell"),
        ((1.0, 1.0, 2.0), "few rounds", "late/early rounds 2.00x: 3 rounds, too few to tell a build-up from noise"),
        ((1.0, 9.0), "one round", ""),
    ],
)
def test_the_trend_of_the_rounds_is_worded_as_what_it_is(rounds: tuple[float, ...], trend: str, words: str) -> None:
    timing = Timing(rounds)
    assert timing.trend == trend
    assert timing.describe_trend().startswith(words)


def test_only_a_build_up_counts_as_drift() -> None:
    base = Timing((1.0,) * 6)
    noisy = BenchResult("n", Timing((1.0, 3.0, 2.0, 2.0, 1.5, 4.0)), "b", base)
    built = BenchResult("u", Timing((1.0, 1.0, 3.0, 6.0, 12.0, 20.0)), "b", base)
    assert noisy.timing.drift > 1.25 and not noisy.drifted
    assert built.drifted


def _long(index: int) -> BenchResult:
    return BenchResult(
        f"cpu: a benchmark whose name runs on and on past its column {'x' * index * 30}",
        Timing((2e-6, 2.1e-6, 2.2e-6, 2.0e-6, 2.3e-6, 2.4e-6)),
        "a baseline with a name long enough to need a line of its own, " + "y" * 60,
        Timing((1e-6,) * 6),
        target=1.5,
        note="a note that goes on " * 12,
    )


def test_no_printed_line_is_wider_than_100_columns_whatever_the_names() -> None:
    results = [_long(i) for i in range(4)]
    text = "\n".join(
        [
            *bench.header_lines(quick=True),
            *bench.column_titles(),
            *bench.suite_lines(1, 4, "sharding"),
            format_results(results),
            *bench.summary_lines(results, 12.0),
            format_markdown(results, bench.header_lines(quick=False)),
        ]
    )
    assert WIDTH == 100 and max(len(line) for line in text.splitlines()) <= 100


def test_a_row_gives_its_figures_then_its_baseline_and_trend_then_its_note() -> None:
    r = BenchResult("cpu: fork", Timing((2e-6,) * 6), "torch fork", Timing((1e-6,) * 6), target=1.5, note="why")
    first, vs, note = format_row(3, r)
    assert first.split() == ["3", "cpu:", "fork", "2.0us", "2.00x", "(2.00-2.00)", "<=1.5", "NO"]
    assert vs == "      vs torch fork: 1.0us; late/early rounds 1.00x: flat"
    assert note == "      why"


def test_the_header_names_the_cpu_threads_torch_and_the_date() -> None:
    import torch

    when = datetime.datetime(2026, 1, 2, 3, 4, tzinfo=datetime.timezone.utc)
    first, second, third = bench.header_lines(quick=False, when=when)
    assert first.startswith(f"hyperrng bench: {bench._cpu_model()}, ")
    assert f"{torch.get_num_threads()} torch threads, platform {platforms.current().name!r}" in first
    assert second.startswith(f"torch {torch.__version__}, python ") and second.endswith("; 2026-01-02 03:04 UTC")
    assert third.startswith("ratio: median of interleaved rounds against a baseline timed in the same run")


def test_the_markdown_table_has_a_row_per_result_and_the_list_gives_each_in_full() -> None:
    r = BenchResult("cpu: fork", Timing((2e-6,) * 6), "torch fork", Timing((1e-6,) * 6), target=1.5, note="why")
    lines = format_markdown([r, _long(3)], ["machine"]).splitlines()
    assert lines[:4] == ["machine", "", "|#|benchmark|vs|ratio (range)|target|", "|--:|:--|:--|--:|--:|"]
    assert lines[4] == "|1|cpu: fork|torch fork|2.00x (2.00-2.00)|<=1.5 missed|"
    assert lines[5].startswith("|2|cpu: a benchmark") and "..." in lines[5]  # too wide: shortened here
    listed = " ".join(line.strip() for line in lines[7:])
    assert "1. cpu: fork vs torch fork: 2.0us against 1.0us; late/early rounds 1.00x: flat; why" in listed
    assert "2. cpu: a benchmark whose name runs on and on past its column xxx" in listed  # in full


def test_each_row_is_reported_as_soon_as_it_is_measured_not_when_its_suite_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import hyperrng.cli.bench.streams as streams

    seen: list[str] = []
    suites: list[tuple[int, int, str]] = []

    def suite(quick: bool) -> list[BenchResult]:
        first = BenchResult("first", Timing((1.0,)), "b", Timing((1.0,)))
        assert seen == ["first"]  # printed before the suite goes on to measure the next row
        second = BenchResult("second", Timing((1.0,)), "b", Timing((1.0,)))
        return [first, second]

    monkeypatch.setattr(streams, "benchmarks", suite)
    results = run_benchmarks(
        quick=True,
        suites=["streams"],
        on_suite=lambda i, n, name: suites.append((i, n, name)),
        on_result=lambda r: seen.append(r.name),
    )
    assert [r.name for r in results] == seen == ["first", "second"]
    assert suites == [(1, 1, "streams")]
    BenchResult("after the run", Timing((1.0,)), "b", Timing((1.0,)))
    assert seen == ["first", "second"]  # nothing is reported outside a run


def test_a_suite_says_what_it_measures_next_between_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    import hyperrng.cli.bench.streams as streams

    seen: list[str] = []

    def suite(quick: bool) -> list[BenchResult]:
        bench.announce("a long run")
        return [BenchResult("row", Timing((1.0,)), "b", Timing((1.0,)))]

    monkeypatch.setattr(streams, "benchmarks", suite)
    run_benchmarks(quick=True, suites=["streams"], on_result=lambda r: seen.append(r.name), on_progress=seen.append)
    assert seen == ["a long run", "row"]
    bench.announce("outside a run")  # says nothing, raises nothing


@pytest.mark.slow
def test_the_sharding_suite_announces_each_long_measurement_before_it_starts_and_each_row_when_made() -> None:
    events: list[str] = []
    run_benchmarks(
        quick=True,
        suites=["sharding"],
        on_result=lambda r: events.append(f"row: {r.name}"),
        on_progress=lambda text: events.append(f"next: {text}"),
    )
    same = next(i for i, e in enumerate(events) if e.endswith("slowest round, same shape"))
    fresh = next(i for i, e in enumerate(events) if e.endswith("slowest round, new shapes"))
    assert events[same - 1].startswith("next: a long run, same shape: 10 rounds of 2,000 regions")
    assert events[same + 1].startswith("next: a long run, a new shape every region") and fresh == same + 2


def test_a_quiet_bench_says_it_is_still_measuring() -> None:
    import threading
    import time

    from hyperrng import cli

    written: list[str] = []
    said = threading.Event()

    class Out:
        last = time.monotonic()

        def __call__(self, *lines: str, fit: bool = True) -> None:
            written.extend(lines)
            self.last = time.monotonic()
            said.set()

    with cli._Heartbeat(Out(), every=0.01) as heartbeat:  # type: ignore[arg-type]
        heartbeat.doing = "a long run"
        assert said.wait(60), "the heartbeat never spoke"  # a guard against a hang, not a time limit
    assert written[0].startswith("      ... still measuring: a long run (") and written[0].endswith(" s into the run)")
