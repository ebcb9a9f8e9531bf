"""Start N local processes joined by one process group (the demo and the tests use it).

``run_ranks(fn, world_size, *args)`` spawns the ranks, initialises a process group (gloo
unless told otherwise) on a free loopback port, calls ``fn(rank, world_size, *args)`` on
each, and returns the per-rank results (which must be picklable). Every rank runs on the
platform current in the parent, even one chosen programmatically there.

A rank that raises, dies or hangs fails the call with :class:`~hyperrng.errors.RankFailure`:
a rank that dies is noticed within a second, and the ranks still running (typically
blocked in a collective with it) are killed at once rather than waited for.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable, Collection
from typing import Any

import hyperrng.platforms as platforms
from hyperrng.errors import PlatformError, RankFailure

__all__ = ["RankFailure", "free_port", "run_ranks"]

_RESULT_TIMEOUT_S = 240  # a hung collective must fail the run, not block it
_POLL_S = 0.5  # how often to look for ranks that died without answering
_SETTLE_S = 2.0  # after a failure: time for peers' exit codes to become visible before the survivors are killed
_COLLECTIVE_TIMEOUT_S = 120
_JOIN_S = 30  # ranks that all answered only have to tear down their process group


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _platform_for_ranks() -> tuple[type[platforms.Platform], str]:
    """The class and name of the parent's current platform, checked to be rebuildable in a child.

    A child resolves its own platform when it imports hyperrng (the environment and
    entry points are inherited), which keeps a platform built by a configured factory.
    Where the parent's platform was set programmatically the child rebuilds it from its
    class, so that class must be importable and constructible without arguments.
    """
    selection = platforms.selection()
    platform = selection.platform
    cls = type(platform)
    if any(probe.source == "override" for probe in selection.probes):
        try:
            pickle.dumps(cls)
            rebuilt = cls()
        except Exception as exc:
            raise PlatformError(
                f"the platform {platform.name!r} set programmatically cannot be rebuilt in the rank processes "
                f"({type(exc).__name__}: {exc}); define {cls.__qualname__} at module level with a constructor "
                f"that takes no arguments, or select it with {platforms.ENV_VAR}=module:Factory."
            ) from exc
        if rebuilt.name != platform.name:
            raise PlatformError(
                f"{cls.__qualname__}() builds platform {rebuilt.name!r}, not {platform.name!r}; the rank "
                f"processes could not use the same platform. Select it with {platforms.ENV_VAR}=module:Factory."
            )
    return cls, platform.name


def _use_platform(cls: type[platforms.Platform], name: str) -> None:
    """In a child: make the platform match the parent's (kept if the child resolved the same one)."""
    try:
        mine = platforms.current()
    except PlatformError:
        mine = None
    if type(mine) is not cls or mine.name != name:
        platforms.set_current(cls())


def _entry(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    platform: tuple[type[platforms.Platform], str],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    queue: Any,
) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        _use_platform(*platform)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=_COLLECTIVE_TIMEOUT_S)
        )
        try:
            queue.put((rank, True, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:
        queue.put((rank, False, (f"{type(exc).__name__}: {exc}".splitlines()[0], traceback.format_exc())))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; return results by rank.

    Args:
        fn: a picklable (module-level) function; its return value must be picklable.
        world_size: how many processes to start.
        *args: passed to ``fn`` after the rank and world size.
        backend: the ``torch.distributed`` backend of the process group.

    Each rank has ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` set, as
    under torchrun, and uses the parent's current platform.

    Raises:
        PlatformError: the parent's platform cannot be selected, or was set
            programmatically and cannot be rebuilt in a child. No process starts.
        RankFailure: a rank raised, died or never answered. Its ``summary`` names the
            rank that failed first: a rank that died (and its exit code) before ranks
            that raised, since those usually fail because a peer is gone.
    """
    import torch.multiprocessing as mp

    platform = _platform_for_ranks()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, backend, platform, fn, args, queue), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    raised: dict[int, tuple[str, str]] = {}  # in the order the reports arrived
    dead: dict[int, int] = {}
    deadline = time.monotonic() + _RESULT_TIMEOUT_S
    try:
        while len(results) < world_size and not raised:
            if _died(procs, results) or time.monotonic() > deadline:
                break
            _collect(queue, results, raised, _POLL_S)
        if len(results) < world_size:
            # Let the first failure's consequences surface (peers notice a dead rank through
            # their sockets before its exit code is visible) before judging who failed first.
            settle = time.monotonic() + _SETTLE_S
            while time.monotonic() < settle and len(results) + len(raised) < world_size:
                _collect(queue, results, raised, min(_POLL_S, max(settle - time.monotonic(), 0.01)))
            dead = _died(procs, results.keys() | raised.keys())
    finally:
        _stop(procs, wait=len(results) == world_size)
    if len(results) == world_size:
        return [results[r] for r in range(world_size)]
    raise _failure(world_size, results, raised, dead)


def _collect(queue: Any, results: dict[int, Any], raised: dict[int, tuple[str, str]], timeout: float) -> None:
    try:
        rank, ok, value = queue.get(timeout=timeout)
    except queue_module.Empty:
        return
    if ok:
        results[rank] = value
    else:
        raised[rank] = value


def _died(procs: list[Any], answered: Collection[int]) -> dict[int, int]:
    """Exit codes of the ranks that ended without answering (a kill, an abort, ``os._exit``)."""
    return {r: p.exitcode for r, p in enumerate(procs) if r not in answered and p.exitcode not in (None, 0)}


def _stop(procs: list[Any], wait: bool) -> None:
    """Join ranks that all answered; kill at once the survivors of a failed run."""
    for p in procs:
        if wait:
            p.join(timeout=_JOIN_S)
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=_JOIN_S)


def _failure(
    world_size: int, results: dict[int, Any], raised: dict[int, tuple[str, str]], dead: dict[int, int]
) -> RankFailure:
    reports = [f"rank {r} died with exit code {code} without answering" for r, code in sorted(dead.items())]
    reports += [f"rank {r} failed: {line}" for r, (line, _) in raised.items()]
    silent = sorted(set(range(world_size)) - set(results) - set(raised) - set(dead))
    if not reports:
        reports.append(f"rank(s) {silent} gave no answer within {_RESULT_TIMEOUT_S} s")
    details = [f"rank {r} failed:\n{tb}" for r, (_, tb) in sorted(raised.items())]
    return RankFailure(reports[0], "\n".join(reports[1:] + details))
