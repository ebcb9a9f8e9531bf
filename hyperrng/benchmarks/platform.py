"""Platform-layer benchmarks: import cost and the overhead of the validated state API."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hyperrng.benchmarks._timing import BenchResult, best_time

__all__ = ["benchmarks"]

_REPO = str(Path(__file__).resolve().parents[2])


def _import_seconds(repeat: int) -> tuple[float, float]:
    """Best cumulative import time of torch and of hyperrng after it, from ``-X importtime``.

    The interpreter's own accounting excludes process start-up, which dwarfs and blurs
    the difference when whole processes are timed.
    """
    env = {**os.environ, "PYTHONPATH": _REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    best_torch = best_ours = float("inf")
    for _ in range(repeat):
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", "import torch, hyperrng"],
            check=True,
            env=env,
            capture_output=True,
            text=True,
        ).stderr
        cumulative = {}
        for line in out.splitlines():
            parts = line.split("|")
            if len(parts) == 3 and parts[1].strip().isdigit() and not parts[2].startswith("  "):  # top level
                cumulative[parts[2].strip()] = int(parts[1]) / 1e6
        best_torch = min(best_torch, cumulative["torch"])
        best_ours = min(best_ours, cumulative["hyperrng"])
    return best_torch, best_ours


def benchmarks(quick: bool) -> list[BenchResult]:
    """Import time of hyperrng over torch's, and get/set through the platform over raw calls."""
    import hyperrng

    repeat = 2 if quick else 5
    base, extra = _import_seconds(repeat)
    ours = base + extra
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
