"""Run a function on N real processes joined by a gloo process group.

Multi-rank behaviour is tested with real processes over ``torch.distributed``, never by
mocking collectives. ``run_ranks(fn, world_size, *args)`` spawns the ranks, initialises
gloo on a free loopback port, calls ``fn(rank, world_size, *args)`` on each, and returns
the per-rank results (which must be picklable). An exception on any rank fails the call
with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

__all__ = ["run_ranks", "free_port"]

_TIMEOUT_S = 240  # a hung collective must fail the test, not the CI run


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], queue: Any) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
        try:
            queue.put((rank, True, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank."""
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
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=_TIMEOUT_S)
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
        raise AssertionError("\n".join(failures))
    return [results[r] for r in range(world_size)]
