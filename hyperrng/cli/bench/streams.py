"""Stream benchmarks: the cost of ``tracker.fork()`` and ``fork_rng`` against torch's own fork.

Everything is measured in one run on the current platform, candidates and baselines
interleaved so that a noisy neighbour slows both alike. The targets apply to the CPU
platform, where ``torch.random.fork_rng(devices=[])`` forks the same generator the
tracker switches; on an accelerator that baseline forks only the CPU, so the ratio is
reported without a target.
"""

from __future__ import annotations

from collections.abc import Callable
from threading import current_thread

import torch

import hyperrng.platforms as platforms
from hyperrng._guard import exclusive as _exclusive
from hyperrng.cli.bench._timing import BenchResult, interleaved
from hyperrng.streams.fork import fork_rng
from hyperrng.streams.tracker import RNGStatesTracker

__all__ = ["benchmarks"]

# A fork switches streams, and it and hyperrng's fork_rng hold the generators against other
# threads (hyperrng._guard.exclusive), which torch's fork_rng does not: they may cost this much more.
_FORK_TARGET = 1.2
# Many short rounds rather than a few long ones (same calls in all): on a shared machine a
# neighbour's burst then lands in a few rounds of each function, which the median drops,
# instead of in one long round of one function only.
_QUICK_NUMBER, _FULL_NUMBER = 2_000, 4_000
_QUICK_ROUNDS, _FULL_ROUNDS = 3, 45
_STREAM_SEEDS = {"bench-a": 1, "bench-b": 2}


def _fork_loop(tracker: RNGStatesTracker) -> Callable[[], None]:
    def run() -> None:
        with tracker.fork("bench-a"):
            pass

    return run


def benchmarks(quick: bool) -> list[BenchResult]:
    """Enter+exit of ``tracker.fork()`` against raw get/set and ``torch.random.fork_rng``.

    Also hyperrng's ``fork_rng``, and the device hold alone (the thread policy's share).
    """
    platform = platforms.current()
    number = _QUICK_NUMBER if quick else _FULL_NUMBER
    rounds = _QUICK_ROUNDS if quick else _FULL_ROUNDS
    tracker = RNGStatesTracker()
    tracker.reseed(_STREAM_SEEDS)
    copying = RNGStatesTracker(graph_safe=False)
    copying.reseed(_STREAM_SEEDS)
    read, write, _, unpack = platform._state_io()
    stream_state = unpack(copying.get_states()["bench-a"])

    def raw_switch() -> None:
        # The state copies a stream switch cannot avoid: save, load, read back, restore.
        saved = read()
        write(stream_state)
        read()
        write(saved)

    key = (platform.device_type, platform.current_device())

    def hold_release() -> None:
        # What a fork pays for the thread policy: hold the device, then release it.
        me = current_thread()
        _exclusive.release_key(key, me, _exclusive.hold_key(key, me, "a benchmark"))

    def torch_fork() -> None:
        with torch.random.fork_rng(devices=[]):
            pass

    def our_fork_rng() -> None:
        with fork_rng(devices=[]):
            pass

    fns: dict[str, Callable[[], object]] = {
        "fork": _fork_loop(tracker),
        "raw": raw_switch,
        "torch": torch_fork,
        "fork_rng": our_fork_rng,
        "hold": hold_release,
    }
    if tracker.graph_safe:
        fns["copying"] = _fork_loop(copying)
    t = interleaved(fns, number=number, rounds=rounds)

    on_cpu = platform.device_type == "cpu"
    mode = "graph-safe swap" if tracker.graph_safe else "byte copies"
    results = [
        BenchResult(
            f"{platform.name}: tracker.fork enter+exit",
            t["fork"],
            "torch.random.fork_rng(devices=[])",
            t["torch"],
            target=_FORK_TARGET if on_cpu else None,
            note=f"{mode}; the fork switches streams, torch's fork only saves and restores"
            + ("" if on_cpu else "; torch's fork covers only the CPU here, so no target"),
        ),
        BenchResult(
            f"{platform.name}: tracker.fork enter+exit",
            t["fork"],
            "raw get/set of the state (x2)",
            t["raw"],
            note="the Python cost of the fork over the copies it must make",
        ),
        BenchResult(
            f"{platform.name}: hyperrng fork_rng(devices=[])",
            t["fork_rng"],
            "torch.random.fork_rng(devices=[])",
            t["torch"],
            target=_FORK_TARGET,
        ),
        BenchResult(
            f"{platform.name}: device hold+release",
            t["hold"],
            "torch.random.fork_rng(devices=[])",
            t["torch"],
            note="the thread policy's share of a fork (see hyperrng._guard.exclusive)",
        ),
    ]
    if "copying" in t:
        results.append(
            BenchResult(
                f"{platform.name}: graph-safe tracker.fork",
                t["fork"],
                "byte-copy tracker.fork",
                t["copying"],
                note="swapping generator-state objects instead of copying bytes",
            )
        )
    return results
