"""Platform-layer benchmarks: import cost and the overhead of the validated state API."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hyperrng.cli.bench._timing import BenchResult, Timing, interleaved

__all__ = ["benchmarks"]

_REPO = str(Path(__file__).resolve().parents[3])


def _import_seconds(repeat: int) -> tuple[Timing, Timing]:
    """Cumulative import times of torch and of torch plus hyperrng, per run, from ``-X importtime``.

    The interpreter's own accounting excludes process start-up, which dwarfs and blurs
    the difference when whole processes are timed.
    """
    env = {**os.environ, "PYTHONPATH": _REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    torch_runs: list[float] = []
    both_runs: list[float] = []
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
        torch_runs.append(cumulative["torch"])
        both_runs.append(cumulative["torch"] + cumulative["hyperrng"])
    return Timing(tuple(torch_runs)), Timing(tuple(both_runs))


def benchmarks(quick: bool) -> list[BenchResult]:
    """Import time of hyperrng over torch's, and get/set through the platform over raw calls."""
    import hyperrng

    repeat = 2 if quick else 5
    base, ours = _import_seconds(repeat)
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
            note=f"hyperrng adds {(ours.median - base.median) * 1e3:.0f} ms "
            f"to a {base.median * 1e3:.0f} ms torch import",
        )
    ]
    if gen is not None:

        def raw() -> None:
            gen.set_state(gen.get_state())

        def validated() -> None:
            p.set_rng_state(p.get_rng_state())

        t = interleaved({"validated": validated, "raw": raw}, number=number, rounds=5)
        results.append(
            BenchResult(
                f"{p.name}: platform get+set state",
                t["validated"],
                "generator get_state+set_state",
                t["raw"],
                note=f"{state.numel()}-byte state; the difference is argument validation",
            )
        )
    return results
