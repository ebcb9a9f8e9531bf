"""Throughput of the portable Philox draws against torch's native ones on CPU.

``torch.rand`` is the natural baseline for :func:`~hyperrng.philox.uniform`: it is what a
caller gives up portability and shard-independence to use; native
``torch.nn.functional.dropout`` is the baseline for :func:`~hyperrng.philox.dropout`.
Both sides of every line run under the same ``torch.set_num_threads`` setting, stated in
the line's name and note: first one thread (like for like: ``torch.rand`` draws its
Mersenne Twister stream on one thread whatever the setting), then the default thread
count of the process when that is more than one (where the portable ops, which are
elementwise, also use the other threads).

The ``portable mode`` lines time torch's own ``torch.rand`` and ``F.dropout`` inside
:class:`~hyperrng.portable_mode.portable_random` (so they include the mode's dispatch
and position bookkeeping, the copy into torch's result tensor, and entering and leaving
the mode, which registers and removes its kernels, on every call) against the same calls
outside it.

Targets (higher is better, portable throughput over native throughput): eager uniform
0.5, compiled uniform 1.5, eager dropout 0.5. Eager Philox runs about a hundred
elementwise integer operations per chunk, ten rounds of which the two 64-bit multiplies
cost most; compiled code fuses them into one loop. Both sides allocate a fresh result
each call, so both pay the same page faults on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from hyperrng.benchmarks._timing import BenchResult, interleaved
from hyperrng.philox import dropout, uniform
from hyperrng.portable_mode import portable_random

__all__ = ["benchmarks"]

_FULL_ELEMENTS = 2**24
_QUICK_ELEMENTS = 2**20
_KEY = 0x5EED  # any key: the cost does not depend on it
_DROPOUT_P = 0.1
_EAGER_TARGET = 0.5
_COMPILED_TARGET = 1.5
_DROPOUT_TARGET = 0.5


@contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(threads)``, then restore the setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _thread_counts() -> list[int]:
    """One thread, then the process's default when it is more."""
    default = torch.get_num_threads()
    return [1] if default <= 1 else [1, default]


def _versus(
    name: str,
    fn: Callable[[], object],
    baseline_name: str,
    baseline: Callable[[], object],
    repeat: int,
    target: float,
    note: str,
) -> BenchResult:
    # Interleaved rounds, so both see the same machine load; the warm-up call compiles.
    t = interleaved({"base": baseline, "ours": fn}, number=1, rounds=repeat)
    return BenchResult(
        name=name,
        timing=t["ours"],
        baseline=baseline_name,
        baseline_timing=t["base"],
        better="higher",
        target=target,
        note=note,
    )


def benchmarks(quick: bool) -> list[BenchResult]:
    """Time float32 ``uniform`` (eager, compiled) against ``torch.rand`` and ``dropout`` against
    ``F.dropout``, at one thread and at the default thread count.

    ``quick`` uses 2**20 elements instead of 2**24 and fewer repeats. The first compiled
    call compiles (tens of seconds on CPU); it is the warm-up and is not timed.
    """
    n = _QUICK_ELEMENTS if quick else _FULL_ELEMENTS
    repeat = 3 if quick else 7
    x = torch.randn(n)
    results = []
    for threads in _thread_counts():
        label = f"{threads} thread" + ("s" if threads > 1 else "")
        note = f"{n} float32 elements, CPU; torch threads: {threads} for both (torch.set_num_threads({threads}))"
        with _torch_threads(threads):
            results += [
                _versus(
                    f"philox uniform eager, {label}",
                    lambda: uniform(n, _KEY),
                    "torch.rand",
                    lambda: torch.rand(n),
                    repeat,
                    _EAGER_TARGET,
                    note,
                ),
                _versus(
                    f"philox uniform compiled, {label}",
                    lambda: uniform(n, _KEY, compiled=True),
                    "torch.rand",
                    lambda: torch.rand(n),
                    repeat,
                    _COMPILED_TARGET,
                    note,
                ),
                _versus(
                    f"philox dropout eager, {label}",
                    lambda: dropout(x, _DROPOUT_P, _KEY),
                    f"F.dropout(p={_DROPOUT_P}, training=True)",
                    lambda: torch.nn.functional.dropout(x, _DROPOUT_P, training=True),
                    repeat,
                    _DROPOUT_TARGET,
                    note,
                ),
            ]
            results += _mode_lines(n, x, repeat, label, note)
    return results


def _in_mode(fn: Callable[[], object], compiled: bool) -> Callable[[], object]:
    def run() -> object:
        with portable_random(_KEY, compiled=compiled):
            return fn()

    return run


def _mode_lines(n: int, x: torch.Tensor, repeat: int, label: str, note: str) -> list[BenchResult]:
    """torch.rand and F.dropout inside portable mode against the same calls outside it."""
    return [
        _versus(
            f"portable mode torch.rand eager, {label}",
            _in_mode(lambda: torch.rand(n), compiled=False),
            "torch.rand",
            lambda: torch.rand(n),
            repeat,
            _EAGER_TARGET,
            note,
        ),
        _versus(
            f"portable mode torch.rand compiled, {label}",
            _in_mode(lambda: torch.rand(n), compiled=True),
            "torch.rand",
            lambda: torch.rand(n),
            repeat,
            _COMPILED_TARGET,
            note,
        ),
        _versus(
            f"portable mode F.dropout eager, {label}",
            _in_mode(lambda: torch.nn.functional.dropout(x, _DROPOUT_P, training=True), compiled=False),
            f"F.dropout(p={_DROPOUT_P}, training=True)",
            lambda: torch.nn.functional.dropout(x, _DROPOUT_P, training=True),
            repeat,
            _DROPOUT_TARGET,
            note,
        ),
    ]
