"""The benchmark suites behind ``hyperrng bench``, and how their results are printed.

Each suite is a module of this package with ``benchmarks(quick: bool) -> list[BenchResult]``.
Every figure is a ratio against a baseline measured in the same run: the median over
interleaved rounds, with the range of the per-round ratios, and what the late rounds say
against the early ones (flat, a build-up, or a machine too noisy to tell; see :mod:`._timing`).

:func:`run_benchmarks` hands each row to a callback as soon as it is measured;
:func:`format_row` prints it in at most :data:`WIDTH` columns, under :func:`header_lines`
(the machine, torch and the date, so that a table can be quoted from one run).
:func:`format_markdown` gives the whole run as a Markdown table for a README.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import platform as _host
import re
import sys
import textwrap
from collections.abc import Callable, Sequence

from hyperrng.cli.bench._timing import BenchResult, Timing, announce, interleaved, reporting, time_rounds

__all__ = [
    "SUITES",
    "WIDTH",
    "BenchResult",
    "Timing",
    "announce",
    "interleaved",
    "time_rounds",
    "check_suites",
    "run_benchmarks",
    "header_lines",
    "column_titles",
    "suite_lines",
    "format_row",
    "summary_lines",
    "format_results",
    "format_markdown",
]

SUITES = ("platform", "streams", "sharding", "philox", "gpu")

WIDTH = 100
"""No printed line is wider than this."""

_NAME = 42  # the benchmark column; a longer name gets a line of its own
_INDENT = " " * 6  # where a row's baseline, trend and note lines start


def check_suites(suites: Sequence[str] | None) -> list[str]:
    """The suites to run, in order (default: all).

    Raises:
        InvalidArgumentError: a name that is not one of :data:`SUITES`.
    """
    chosen = list(suites) if suites else list(SUITES)
    unknown = [s for s in chosen if s not in SUITES]
    if unknown:
        from hyperrng.errors import InvalidArgumentError

        raise InvalidArgumentError(f"unknown benchmark suite(s) {unknown}; choose from {list(SUITES)}.")
    return chosen


def run_benchmarks(
    quick: bool = False,
    suites: Sequence[str] | None = None,
    *,
    on_suite: Callable[[int, int, str], None] | None = None,
    on_result: Callable[[BenchResult], None] | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> list[BenchResult]:
    """Run the named suites (default: all) and return their results in order.

    Args:
        quick: small sizes and few rounds.
        suites: names from :data:`SUITES`.
        on_suite: called as ``on_suite(i, n, name)`` before the ``i``-th of ``n`` suites starts.
        on_result: called with each result as soon as it is measured.
        on_progress: called with what a suite measures next, where that takes long (:func:`announce`).

    Raises:
        InvalidArgumentError: an unknown suite name; nothing runs.
    """
    chosen = check_suites(suites)
    results: list[BenchResult] = []
    for i, name in enumerate(chosen, 1):
        if on_suite is not None:
            on_suite(i, len(chosen), name)
        module = importlib.import_module(f"hyperrng.cli.bench.{name}")
        reports = on_result is not None or on_progress is not None
        with reporting(on_result or _ignore, on_progress) if reports else contextlib.nullcontext():
            results.extend(module.benchmarks(quick))
    return results


def _ignore(result: BenchResult) -> None:
    """The result callback of a run that only wants progress."""


def _cpu_model() -> str:
    """The CPU's model name, from ``/proc/cpuinfo`` where there is one."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return _host.processor() or _host.machine() or "unknown CPU"


def header_lines(quick: bool, when: datetime.datetime | None = None) -> list[str]:
    """Where the figures come from: CPU model and count, torch threads, versions, platform, date."""
    import torch

    import hyperrng
    from hyperrng.errors import PlatformError

    when = when or datetime.datetime.now(datetime.timezone.utc)
    try:
        where = f"platform {hyperrng.current_platform().name!r}"
    except PlatformError as exc:  # the command refuses to run without one; a library caller may not
        where = f"no platform ({type(exc).__name__})"
    lines = [
        f"hyperrng bench{' --quick' if quick else ''}: {_cpu_model()}, {os.cpu_count()} CPUs, "
        f"{torch.get_num_threads()} torch threads, {where}",
        f"torch {torch.__version__}, python {sys.version.split()[0]}, hyperrng {hyperrng.__version__}, "
        f"{_host.system()}; {when:%Y-%m-%d %H:%M} UTC",
        "ratio: median of interleaved rounds against a baseline timed in the same run; (range): per round",
    ]
    return [wrapped for line in lines for wrapped in _wrap(line, "")]


def column_titles() -> list[str]:
    """The titles above the rows of :func:`format_row`."""
    return [f"{'#':>3}  {'benchmark':<{_NAME}} {'median':>8} {'ratio':>7} {'(range)':>13} {'target':>7} {'ok':>3}"]


def suite_lines(i: int, n: int, name: str) -> list[str]:
    """The progress line printed as suite ``i`` of ``n`` starts: its name and the first sentence of its docstring."""
    module = importlib.import_module(f"hyperrng.cli.bench.{name}")
    first = " ".join((module.__doc__ or "").strip().split("\n\n")[0].split()).split(". ")[0].rstrip(".")
    about = re.sub(r":\w+:|`", "", first)  # reST roles and literals read badly on a terminal
    return _wrap(f"[{i}/{n}] {name}" + (f": {about}" if about else ""), "", "      ")


def format_row(index: int, r: BenchResult) -> list[str]:
    """One result: number, name, median, ratio, range, target, verdict; then baseline, trend and note.

    Every line is at most :data:`WIDTH` columns: a name too long for its column gets a
    line of its own, and the note is wrapped.
    """
    target = "-" if r.target is None else ("<=" if r.better == "lower" else ">=") + f"{r.target:g}"
    ok = {None: "", True: "yes", False: "NO"}[r.meets_target]
    low, high = r.ratio_range
    name = r.name if len(r.name) <= _NAME else ""
    lines = [] if name else _wrap(r.name, f"{index:>3}  ", "     ")
    figures = f"{_fmt_time(r.seconds):>8} {f'{r.ratio:.2f}x':>7} {f'({low:.2f}-{high:.2f})':>13} {target:>7} {ok:>3}"
    lines.append(f"{index if name else '':>3}  {name:<{_NAME}} {figures}".rstrip())
    vs = f"vs {r.baseline}: {_fmt_time(r.baseline_seconds)}"
    trend = r.timing.describe_trend()
    lines += _wrap(vs + (f"; {trend}" if trend else ""), _INDENT)
    if r.note:
        lines += _wrap(r.note, _INDENT)
    return lines


def summary_lines(results: Sequence[BenchResult], seconds: float) -> list[str]:
    """How many rows, how long, which rows missed their target and which built up over their rounds."""
    missed = [f"#{i} {r.name} ({r.ratio:.2f}x)" for i, r in enumerate(results, 1) if r.meets_target is False]
    built = [f"#{i} {r.name}" for i, r in enumerate(results, 1) if r.drifted]
    text = f"{len(results)} rows in {seconds:.0f} s; " + (
        f"{len(missed)} missed their target: {', '.join(missed)}" if missed else "every target met"
    )
    lines = _wrap(text + ".", "")
    if built:
        lines += _wrap(f"build-up over the rounds: {', '.join(built)}.", "")
    return lines


def format_results(results: Sequence[BenchResult]) -> str:
    """Every result as :func:`format_row` prints it, under :func:`column_titles`."""
    lines = column_titles()
    for i, r in enumerate(results, 1):
        lines += format_row(i, r)
    return "\n".join(lines)


def format_markdown(results: Sequence[BenchResult], header: Sequence[str] = ()) -> str:
    """The run as Markdown: ``header`` as a paragraph, a table with one row per result, then
    a numbered list with each row in full: both medians, the trend of its rounds, its note.

    Lines stay within :data:`WIDTH` columns: a row too wide shortens its baseline, then its
    name, with "..." (the list below gives them in full).
    """
    lines = [*header, ""] if header else []
    # No padding around the bars (it renders the same): room for the longest names and baselines.
    lines += ["|#|benchmark|vs|ratio (range)|target|", "|--:|:--|:--|--:|--:|"]
    notes = [""]
    for i, r in enumerate(results, 1):
        low, high = r.ratio_range
        target = "" if r.target is None else ("<=" if r.better == "lower" else ">=") + f"{r.target:g}"
        target += {None: "", True: "", False: " missed"}[r.meets_target]
        rest = f"|{r.ratio:.2f}x ({low:.2f}-{high:.2f})|{target}|"
        name, baseline = r.name, r.baseline
        over = len(f"|{i}|{name}|{baseline}{rest}") - WIDTH
        if over > 0:
            baseline = _shorten(baseline, len(baseline) - over)
            over = len(f"|{i}|{name}|{baseline}{rest}") - WIDTH
        if over > 0:
            name = _shorten(name, len(name) - over)
        lines.append(f"|{i}|{name}|{baseline}{rest}")
        about = f"{r.name} vs {r.baseline}: {_fmt_time(r.seconds)} against {_fmt_time(r.baseline_seconds)}"
        trend = r.timing.describe_trend()
        text = "; ".join(part for part in (about, trend, r.note) if part)
        notes += _wrap(text, f"{i}. ", " " * len(f"{i}. "))
    return "\n".join(lines + notes)


def _shorten(text: str, room: int) -> str:
    """``text`` in at most ``room`` characters (at least 12), ending in "..." when cut."""
    room = max(room, 12)
    return text if len(text) <= room else text[: room - 3] + "..."


def _wrap(text: str, first: str, rest: str | None = None) -> list[str]:
    return textwrap.wrap(
        text, WIDTH, initial_indent=first, subsequent_indent=first if rest is None else rest, break_on_hyphens=False
    ) or [first.rstrip()]


def _fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f}us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f}ms"
    return f"{seconds:.2f}s"
