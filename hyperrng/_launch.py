"""Start N local processes joined by a gloo process group (the demo and the tests use it).

``run_ranks(fn, world_size, *args)`` spawns the ranks, initialises gloo on a free loopback
port, calls ``fn(rank, world_size, *args)`` on each, and returns the per-rank results
(which must be picklable). An exception on any rank fails the call with that rank's
traceback; a rank that hangs fails it after a timeout instead of blocking forever.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["RankFailure", "free_port", "run_ranks"]

_RESULT_TIMEOUT_S = 240  # a hung collective must fail the run, not block it
_POLL_S = 1.0  # how often to look for ranks that died without answering
_COLLECTIVE_TIMEOUT_S = 120


class RankFailure(RuntimeError):
    """One or more ranks raised; the message holds their tracebacks."""


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], queue: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=_COLLECTIVE_TIMEOUT_S)
        )
        try:
            queue.put((rank, True, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    Raises:
        RankFailure: a rank raised (its traceback is in the message) or never answered.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue), daemon=True) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    answered: set[int] = set()
    deadline = time.monotonic() + _RESULT_TIMEOUT_S
    try:
        while len(answered) < world_size and not failures:
            try:
                rank, ok, value = queue.get(timeout=_POLL_S)
            except queue_module.Empty:
                # A rank killed by the OS (or a C++ abort in a collective) never answers:
                # notice it now instead of waiting out the whole timeout.
                dead = [r for r, p in enumerate(procs) if r not in answered and p.exitcode not in (None, 0)]
                if dead:
                    codes = {r: procs[r].exitcode for r in dead}
                    failures.append(f"rank(s) {dead} died without answering (exit codes {codes})")
                elif time.monotonic() > deadline:
                    failures.append(f"no answer from ranks {sorted(set(range(world_size)) - answered)}")
                continue
            answered.add(rank)
            if ok:
                results[rank] = value
            else:
                failures.append(f"rank {rank} failed:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if failures:
        raise RankFailure("\n".join(failures))
    return [results[r] for r in range(world_size)]
