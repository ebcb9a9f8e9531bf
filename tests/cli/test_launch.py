"""The local launcher: ranks start from a server that imported torch, in the caller's environment; every
rank's answer arrives, and no rank's teardown can hold the run up."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch
import torch.distributed as dist
from hyperrng.platforms.cpu import CPUPlatform

from hyperrng.cli.launch import run_ranks
from hyperrng.errors import ArgumentTypeError, RankFailure

pytestmark = pytest.mark.multiproc


def _hang_holding_the_gil() -> None:
    """What torch 2.5's gloo teardown can do: block forever without letting another thread run."""
    sys.setswitchinterval(1e6)
    while True:
        pass


def _sum_then_teardown_would_hang(rank: int, world_size: int) -> float:
    dist.destroy_process_group = _hang_holding_the_gil  # this rank's process only
    t = torch.full((2,), float(rank))
    dist.all_reduce(t)
    return float(t[0])


def test_every_answer_arrives_even_where_tearing_down_the_process_group_would_hang() -> None:
    assert run_ranks(_sum_then_teardown_would_hang, 2) == [1.0, 1.0]


def _unpicklable(rank: int, world_size: int) -> Any:
    return (lambda: rank) if rank == 1 else rank


def test_a_result_that_cannot_be_sent_fails_the_run_naming_the_rank() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_unpicklable, 2)
    assert info.value.summary.startswith("rank 1 failed: ")
    assert "pickle" in info.value.summary.lower()


class _StartGate:
    """An argument of the ranks' function whose unpickling, in each rank process before it
    joins the process group, waits until the test creates ``path``: the ranks start late."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        while not self.path.exists():
            time.sleep(0.05)


def _rank(rank: int, world_size: int, gate: _StartGate) -> int:
    return rank


def test_ranks_slow_to_start_are_not_failed_by_the_hang_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The hang timeout counts from the moment every rank has joined: 64 ranks on a busy
    # machine can take minutes to start, and that is not a hang. Here the ranks start well
    # after the (shortened) timeout, then answer at once.
    import hyperrng.cli.launch

    gate = tmp_path / "start"
    monkeypatch.setattr(hyperrng.cli.launch, "_RESULT_TIMEOUT_S", 5)
    opener = threading.Timer(8, gate.touch)
    opener.start()
    try:
        assert run_ranks(_rank, 2, _StartGate(gate)) == [0, 1]
    finally:
        opener.cancel()
    assert gate.exists(), "the ranks answered before they could have started"


class _Configured(CPUPlatform):
    """A platform only its factory can build (its class takes an argument)."""

    name = "configured"

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how


def configured() -> CPUPlatform:
    """The factory a test names in ``HYPERRNG_PLATFORM``."""
    return _Configured("by its factory")


def _what_the_rank_sees(rank: int, world_size: int) -> tuple[str, str | None, str | None, str, int]:
    p = platforms.current()
    return p.name, getattr(p, "how", None), os.environ.get("LAUNCH_TEST"), time.tzname[0], os.getppid()


def _forked(fn: Any, world_size: int) -> Any:
    return run_ranks(fn, world_size, fork_server=True)


def test_ranks_see_the_callers_environment_as_of_the_call_and_select_their_platform_in_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first call starts the fork server, in this environment; later ranks are forked from it.
    _forked(_what_the_rank_sees, 1)
    monkeypatch.setenv("LAUNCH_TEST", "as of the call")
    monkeypatch.setenv("TZ", "JST-9")
    monkeypatch.setenv(platforms.ENV_VAR, f"{__name__}:configured")
    assert platforms.select().platform.name == "configured"  # the caller's platform, built by its factory
    seen = _forked(_what_the_rank_sees, 2)
    assert [s[:4] for s in seen] == [("configured", "by its factory", "as of the call", "JST")] * 2
    assert all(parent != os.getpid() for *_, parent in seen), "the ranks were not forked from the server"


def test_ranks_are_spawned_unless_asked_and_the_request_is_checked() -> None:
    assert all(parent == os.getpid() for *_, parent in run_ranks(_what_the_rank_sees, 2))
    with pytest.raises(ArgumentTypeError, match="fork_server"):
        run_ranks(_what_the_rank_sees, 2, fork_server="yes")


def test_where_a_variable_python_or_torch_reads_at_start_changed_the_ranks_are_spawned_in_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _forked(_what_the_rank_sees, 1)
    monkeypatch.setenv("LAUNCH_TEST", "spawned")
    monkeypatch.setenv("TORCH_LAUNCH_TEST", "1")  # a name torch's variables have: read as torch starts
    seen = _forked(_what_the_rank_sees, 2)
    assert [s[2] for s in seen] == ["spawned"] * 2
    assert all(parent == os.getpid() for *_, parent in seen), "the ranks were forked from a server started before"


def _seeds(rank: int, world_size: int) -> tuple[int, float]:
    import random

    return torch.initial_seed(), random.random()


def test_every_rank_of_every_call_starts_from_seeds_of_its_own_as_a_spawned_one_does() -> None:
    # Forked from one server, ranks would share the seeds it drew as it imported torch: unseeded
    # draws would be the same on every rank and in every call.
    drawn = _forked(_seeds, 2) + _forked(_seeds, 2)
    assert len({seed for seed, _ in drawn}) == 4 and len({value for _, value in drawn}) == 4, drawn


_FORKED_AFTER_THE_SERVER = """
import os, sys
from hyperrng.cli.launch import run_ranks
from tests.cli.test_launch import _seeds
run_ranks(_seeds, 1, fork_server=True)  # starts the fork server
child = os.fork()
if child == 0:  # this process's copy of the server's handle is not its own: its ranks are spawned
    os._exit(0 if len(run_ranks(_seeds, 2, fork_server=True)) == 2 else 1)
_, status = os.waitpid(child, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_process_forked_after_the_first_call_starts_its_own_ranks() -> None:
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _FORKED_AFTER_THE_SERVER], capture_output=True, text=True,
                         env=env, cwd=repo, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
