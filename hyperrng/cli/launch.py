"""Start N local processes joined by one process group (the demo and the tests use it).

``run_ranks(fn, world_size, *args)`` starts the ranks, initialises a process group (gloo
unless told otherwise) on a free loopback port, calls ``fn(rank, world_size, *args)`` on
each, and returns the per-rank results (which must be picklable). Every rank runs on the
platform current in the parent, even one chosen programmatically there. :class:`Placement`
says where ranks run: each on a device of the platform, over its backend where every local
rank has a device of its own, else over gloo with tensors staged through the host.

Ranks are spawned: each imports torch, two or three seconds on a busy machine. With
``fork_server=True`` (the demo and the tests) ranks on the host (the CPU, the simulated device)
are forked instead, on Linux, from a server that the first such call starts with torch
imported: each then starts in a fraction of that. Such a rank gets this process's environment
as of the call, selects its platform in it and draws fresh seeds; where forking could not give
it what spawning would (:func:`_rank_context`), and for ranks on an accelerator, whose runtime
must not be in a process that forks, the ranks are spawned all the same. What a forked rank
cannot get: the modules of ``fn``, of its arguments and of ``__main__`` are imported before
the environment is applied, and every rank shares the server's string-hash secret.

A rank that raises, dies or hangs fails the call with :class:`~hyperrng.errors.RankFailure`:
a rank that dies is noticed within a second, and the ranks still running (typically
blocked in a collective with it) are killed at once rather than waited for. A hang is
counted from the moment every rank has joined the process group (each says so over its
pipe), not from the start: 64 ranks importing torch on a busy machine can take minutes
to start, and a rank that never joins makes the others' ``init_process_group`` fail at
its own timeout instead.

Teardown cannot hang. Each rank sends its answer over a pipe of its own, written by the
rank's main thread before anything else happens (a queue's background thread may never
get to run: see below), then waits until the parent has every rank's answer: from then on
no peer needs it. It then ends without tearing down its process group, since every
collective it took part in has completed on every rank. Tearing it down can deadlock on
torch 2.5: gloo's destructor holds the GIL while it waits for a worker thread that needs
the GIL to free the tensors of the last collective; and the same destructor would run at
interpreter exit, so a rank ends with ``os._exit`` once its output is flushed.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import pickle
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Collection
from dataclasses import dataclass
from multiprocessing import connection as mp_connection
from pathlib import Path
from typing import Any

import hyperrng.platforms as platforms
from hyperrng.errors import PlatformError, RankFailure
from hyperrng.platforms.cpu import CPUPlatform
from hyperrng.platforms.validate import check_instance, error_gist

__all__ = ["Placement", "RankFailure", "free_port", "run_ranks"]

_RESULT_TIMEOUT_S = 240  # once every rank has joined: a hung collective must fail the run, not block it
_JOINED = b"joined"  # a rank's first message, once its process group is up (an answer is a pickle, never this)
_POLL_S = 0.5  # how often to look for ranks that died without answering
_SETTLE_S = 2.0  # after a failure: time for peers' exit codes to become visible before the survivors are killed
_COLLECTIVE_TIMEOUT_S = 120
_JOIN_S = 30  # released ranks only have to flush their output and exit


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Placement:
    """Where the ranks run: the platform's devices, the backend, and whether collectives go through the host."""

    device_type: str
    devices: int  # devices of the platform visible to each process
    local_ranks: int
    backend: str
    staged: bool  # tensors go to the host for each collective (gloo with device tensors)

    @classmethod
    def plan(cls, platform: platforms.Platform, local_ranks: int) -> Placement:
        """The platform's backend where every local rank has a device of its own, else gloo."""
        devices = platform.device_count()
        host = platform.device_type == "cpu"
        backend = platform.dist_backend if host or devices >= local_ranks else "gloo"
        staged = backend == "gloo" and not host
        return cls(platform.device_type, devices, local_ranks, backend, staged)

    def index(self, local_rank: int) -> int:
        """The device of a local rank: its own where there are enough, else shared round-robin."""
        return local_rank % self.devices

    def describe(self) -> str:
        if self.device_type == "cpu":
            return f"over {self.backend} on the host"
        if self.devices >= self.local_ranks:
            where = f"one {self.device_type!r} device each"
        else:
            where = f"{self.local_ranks} ranks sharing {self.devices} {self.device_type!r} device(s)"
        return f"over {self.backend}, {where}" + (", tensors staged through the host" if self.staged else "")


# The modules the fork server imports once for every rank, and the environment variables that Python,
# torch and its libraries read as they start: a rank forked from the server has them as the server started.
_SERVER_PRELOAD = ("torch", "torch.distributed")
_READ_AT_IMPORT = ("TORCH", "PYTORCH", "CUDA", "NCCL", "HIP", "ROCM", "ASCEND", "NPU", "OMP_", "KMP_", "GOMP_",
                   "MKL", "OPENBLAS", "TRITON", "PYTHON", "LD_", "MALLOC", "LC_", "LANG")  # fmt: skip
_READ_LATER = re.compile(r"TORCH(INDUCTOR|DYNAMO)_", re.IGNORECASE)
_server: tuple[int, Any] | None = None  # (this process, what a rank inherits from it) when it started the server
_SERVER_LOCK = threading.Lock()


def _inherited(env: dict[str, str]) -> Any:
    """What a process hands a child as it starts it, and a rank forked from the server has as the server
    started: the variables read at start (not inductor's and Dynamo's, read as they are imported, after
    :func:`_entry` applied the environment), the file-creation mask, the CPUs, the priority, the resource
    limits, the identity, the signals ignored and blocked, and what standard output and error are."""
    import resource

    status = Path("/proc/self/status").read_text()
    outputs = []
    for fd in (1, 2):
        try:
            outputs.append(os.fstat(fd)[1:3])  # (inode, device)
        except OSError:
            outputs.append(None)
    return (
        {k: v for k, v in env.items() if k.upper().startswith(_READ_AT_IMPORT) and not _READ_LATER.match(k)},
        next((line for line in status.splitlines() if line.startswith("Umask:")), None),
        (os.sched_getaffinity(0), os.getpriority(os.PRIO_PROCESS, 0)),
        [resource.getrlimit(getattr(resource, n)) for n in dir(resource) if n.startswith("RLIMIT_")],
        (os.getresuid(), os.getresgid(), os.getgroups()),
        ({n for n in signal.valid_signals() if signal.getsignal(n) is signal.SIG_IGN}, signal.pthread_sigmask(0, [])),
        outputs,
    )


@functools.cache
def _device_backends() -> bool:
    """Whether torch's import loads device backends of other packages (``torch.backends`` entry points,
    such as torch_npu's), unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (checked by the caller)."""
    from importlib.metadata import entry_points

    return bool(entry_points(group="torch.backends"))


def _rank_context(mp: Any, env: dict[str, str], on_host: bool) -> Any:
    """The multiprocessing context ranks start in: the fork server where forking is safe and gives a
    rank what spawning would, else spawn.

    Safe: on Linux, for ranks on the host (the CPU, the simulated device), where importing torch
    loads no device backend (an accelerator's runtime must not be in a process that forks). The
    same as spawn: this process started the server (not code before it, not a process it was forked
    from), and :func:`_inherited` is as then. A rank gets the rest at its start (:func:`_entry`).
    """
    global _server
    autoload = env.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") != "0"
    if sys.platform != "linux" or not on_host or (autoload and _device_backends()):
        return mp.get_context("spawn")
    try:
        inherited = _inherited(env)
    except (OSError, AttributeError, ValueError):  # no /proc, no such call here: what a rank gets is unknown
        return mp.get_context("spawn")
    with _SERVER_LOCK:
        if _server is None:
            from multiprocessing import forkserver

            server = getattr(forkserver, "_forkserver", None)
            if getattr(server, "_forkserver_pid", 0) is not None:  # another's server, or one this Python hides
                _server = (-1, None)
                return mp.get_context("spawn")
            ours = [m for m in getattr(server, "_preload_modules", ()) if m != "__main__"]  # a caller's, kept
            mp.set_forkserver_preload(ours + [m for m in _SERVER_PRELOAD if m not in ours])
            _server = (os.getpid(), inherited)
    return mp.get_context("forkserver" if _server == (os.getpid(), inherited) else "spawn")


def _fresh_seeds() -> None:
    """In a rank forked from the server: new random seeds where a spawned rank's imports draw them (torch's
    CPU generator; NumPy's global one, had the server imported it). Python's ``random`` reseeds itself."""
    import torch

    torch.default_generator.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


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
    env: dict[str, str] | None,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    conn: Any,
) -> None:
    import torch.distributed as dist

    if env is not None:  # forked from the fork server: the caller's environment and fresh seeds
        os.environ.clear()
        os.environ.update(env)
        time.tzset()
        _fresh_seeds()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        if env is not None:  # selected as importing hyperrng in the caller's environment would (or left to below)
            with contextlib.suppress(PlatformError):
                platforms.select()
        _use_platform(*platform)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=_COLLECTIVE_TIMEOUT_S)
        )
        conn.send_bytes(_JOINED)
        ok, answer = True, pickle.dumps((True, fn(rank, world_size, *args)))  # an unpicklable result is a failure
    except BaseException as exc:
        ok, answer = False, pickle.dumps((False, (error_gist(exc), traceback.format_exc())))
    with contextlib.suppress(EOFError, OSError):  # the parent is gone: nobody waits for this rank any more
        conn.send_bytes(answer)
        if ok:
            conn.recv_bytes()  # the parent's release: every rank has answered
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)  # no process group teardown, no interpreter finalisation: see the module docstring


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", fork_server: bool = False
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; return results by rank.

    Args:
        fn: a picklable (module-level) function; its return value must be picklable.
        world_size: how many processes to start.
        *args: passed to ``fn`` after the rank and world size.
        backend: the ``torch.distributed`` backend of the process group.
        fork_server: fork ranks on the host from a server that imported torch, where that gives them
            what spawning would but for what the module docstring says; else spawn them.

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
    env = dict(os.environ)
    on_host = issubclass(platform[0], (CPUPlatform, platforms.SimulatedPlatform))
    spawn = mp.get_context("spawn")
    ctx = _rank_context(mp, env, on_host) if check_instance(fork_server, bool, "fork_server") else spawn
    env_for_ranks = env if ctx.get_start_method() == "forkserver" else None
    port = free_port()
    pipes = [ctx.Pipe() for _ in range(world_size)]
    procs = [
        ctx.Process(
            target=_entry,
            args=(r, world_size, port, backend, platform, env_for_ranks, fn, args, pipes[r][1]),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for _, child_end in pipes:
        child_end.close()  # so that a rank that ends reads as the end of its pipe here
    waiting = {parent_end: r for r, (parent_end, _) in enumerate(pipes)}
    results: dict[int, Any] = {}
    raised: dict[int, tuple[str, str]] = {}  # in the order the reports arrived
    joined: set[int] = set()
    dead: dict[int, int] = {}
    deadline: float | None = None  # set once every rank has joined
    try:
        while len(results) < world_size and not raised:
            if deadline is None and len(joined) == world_size:
                deadline = time.monotonic() + _RESULT_TIMEOUT_S
            if _died(procs, results) or (deadline is not None and time.monotonic() > deadline):
                break
            _collect(waiting, results, raised, joined, _POLL_S)
        if len(results) < world_size:
            # Let the first failure's consequences surface (peers notice a dead rank through
            # their sockets before its exit code is visible) before judging who failed first.
            settle = time.monotonic() + _SETTLE_S
            while time.monotonic() < settle and len(results) + len(raised) < world_size and waiting:
                _collect(waiting, results, raised, joined, min(_POLL_S, max(settle - time.monotonic(), 0.01)))
            # A rank's pipe ends as it exits, a moment before the exit can be reaped (longer on a busy
            # machine): wait, within the settle time, for each rank whose pipe ended without an answer.
            for r in set(range(world_size)) - results.keys() - raised.keys() - set(waiting.values()):
                procs[r].join(timeout=max(settle - time.monotonic(), 0.0))
            dead = _died(procs, results.keys() | raised.keys())
        else:
            for parent_end, _ in pipes:  # every rank has answered: each may end
                with contextlib.suppress(OSError):  # that rank has ended already
                    parent_end.send_bytes(b"")
    finally:
        _stop(procs, wait=len(results) == world_size)
        for parent_end, _ in pipes:
            parent_end.close()
    if len(results) == world_size:
        return [results[r] for r in range(world_size)]
    raise _failure(world_size, results, raised, dead)


def _collect(
    waiting: dict[Any, int],
    results: dict[int, Any],
    raised: dict[int, tuple[str, str]],
    joined: set[int],
    timeout: float,
) -> None:
    """Read the messages that arrive within ``timeout``: a rank's joining, or its answer (which
    ends its pipe's turn); a pipe that ends without an answer is dropped (see :func:`_died`)."""
    ready: list[Any] = mp_connection.wait(list(waiting), timeout)
    for conn in ready:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            waiting.pop(conn)
            continue
        if message == _JOINED:
            joined.add(waiting[conn])
            continue
        rank = waiting.pop(conn)
        ok, value = pickle.loads(message)
        if ok:
            results[rank] = value
        else:
            raised[rank] = value


def _died(procs: list[Any], answered: Collection[int]) -> dict[int, int]:
    """Exit codes of the ranks that ended without answering (a kill, an abort, ``os._exit``).

    A rank ends only after its answer is sent (and, when it succeeded, after the release),
    so any exit code of a rank without an answer is a death, 0 included.
    """
    return {r: p.exitcode for r, p in enumerate(procs) if r not in answered and p.exitcode is not None}


def _stop(procs: list[Any], wait: bool) -> None:
    """Give released ranks until ``_JOIN_S`` to end, together; kill at once the survivors of a failed run."""
    end = time.monotonic() + (_JOIN_S if wait else 0.0)
    for p in procs:
        p.join(timeout=max(end - time.monotonic(), 0.0))
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
        reports.append(f"rank(s) {silent} gave no answer within {_RESULT_TIMEOUT_S} s of the last one joining")
    details = [f"rank {r} failed:\n{tb}" for r, (_, tb) in sorted(raised.items())]
    return RankFailure(reports[0], "\n".join(reports[1:] + details))
