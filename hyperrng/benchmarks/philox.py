"""Throughput of the portable Philox uniform against ``torch.rand`` on CPU.

``torch.rand`` is the natural baseline: it is what a caller gives up portability and
shard-independence to use. Eager Philox runs about a hundred integer tensor operations
per chunk, so it aims for 0.3 of ``torch.rand``'s throughput; the compiled path fuses
them into one loop and aims for 0.8.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hyperrng.benchmarks._timing import BenchResult, interleaved
from hyperrng.philox import uniform

__all__ = ["benchmarks"]

_FULL_ELEMENTS = 2**24
_QUICK_ELEMENTS = 2**20
_KEY = 0x5EED  # any key: the cost does not depend on it
_EAGER_TARGET = 0.3
_COMPILED_TARGET = 0.8


def _versus_rand(name: str, fn: Callable[[], object], n: int, repeat: int, target: float, note: str) -> BenchResult:
    # Interleaved rounds, so both see the same machine load.
    t = interleaved({"base": lambda: torch.rand(n), "ours": fn}, number=1, rounds=repeat)
    return BenchResult(
        name=name,
        timing=t["ours"],
        baseline="torch.rand",
        baseline_timing=t["base"],
        better="higher",
        target=target,
        note=note,
    )


def benchmarks(quick: bool) -> list[BenchResult]:
    """Time float32 ``uniform`` (eager and compiled) against ``torch.rand`` of the same size.

    ``quick`` uses 2**20 elements instead of 2**24 and fewer repeats. The first compiled
    call compiles (tens of seconds on CPU); it is the warm-up and is not timed.
    """
    n = _QUICK_ELEMENTS if quick else _FULL_ELEMENTS
    repeat = 3 if quick else 5
    note = f"{n} float32 elements, CPU, {torch.get_num_threads()} threads"
    return [
        _versus_rand("philox uniform eager", lambda: uniform(n, _KEY), n, repeat, _EAGER_TARGET, note),
        _versus_rand(
            "philox uniform compiled", lambda: uniform(n, _KEY, compiled=True), n, repeat, _COMPILED_TARGET, note
        ),
    ]
