"""Platform-layer benchmarks: import cost and the overhead of the validated state API."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from hyperrng.benchmarks._timing import BenchResult, best_time

__all__ = ["benchmarks"]

_REPO = str(Path(__file__).resolve().parents[2])


def _import_seconds(code: str, repeat: int) -> float:
    env = {**os.environ, "PYTHONPATH": _REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, env=env)
        best = min(best, time.perf_counter() - start)
    return best


def benchmarks(quick: bool) -> list[BenchResult]:
    """Import time of hyperrng over torch's, and get/set through the platform over raw calls."""
    import hyperrng

    repeat = 2 if quick else 5
    base = _import_seconds("import torch", repeat)
    ours = _import_seconds("import torch, hyperrng", repeat)
    p = hyperrng.current_platform()
    gen = p.default_generator()
    state = p.get_rng_state()
    number = 2_000 if quick else 20_000
    results = [
        BenchResult(
            "import torch + hyperrng",
            ours,
            "import torch",
            base,
            target=1.10,
            note=f"hyperrng adds {(ours - base) * 1e3:.0f} ms to a {base * 1e3:.0f} ms torch import",
        )
    ]
    if gen is not None:

        def raw() -> None:
            gen.set_state(gen.get_state())

        def validated() -> None:
            p.set_rng_state(p.get_rng_state())

        results.append(
            BenchResult(
                f"{p.name}: platform get+set state",
                best_time(validated, number=number),
                "generator get_state+set_state",
                best_time(raw, number=number),
                note=f"{state.numel()}-byte state; the difference is argument validation",
            )
        )
    return results
