"""DCP resumes after the mesh changed (:class:`hyperrng.RNGStateful`): a rank whose own saved state was made at
other coordinates is a mismatch, and with ``on_mismatch="reseed"`` every rank re-derives its streams from the
saved state at its coordinates, so that streams the layout shares are shared again. Before, a rank loaded the
state its rank number held: at the same world size the load passed as an exact resume, each rank holding
another rank's streams (data-parallel replicas drawing alike, tensor-parallel peers apart).

Saves and loads are collective: a rank whose checks fail makes every rank raise at once (before, the others
waited in a gather for the process group's timeout), and a rank that loads alone (``no_dist=True``) says so
with ``alone=True``."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch

from hyperrng.errors import ArgumentTypeError, InvalidArgumentError
from hyperrng.resume.state import RNGStateful
from hyperrng.seeding.layout import StreamLayout, apply_layout
from hyperrng.streams.tracker import MODEL_PARALLEL_STREAM as MP
from hyperrng.streams.tracker import get_rng_tracker
from tests._dist import run_ranks

pytestmark = pytest.mark.multiproc

_LAYOUT = StreamLayout(dims=("dp", "tp"), default=("dp",), streams={MP: ("tp",)})


def _reshaped(rank: int, world_size: int, directory: str, tp: int, how: str) -> Any:
    """``world_size`` ranks as ``dp x tp``: ``"save"`` seeds, draws and saves; otherwise each seeds anew and
    loads: ``"reseed"`` with the planner, ``"reseed-alone"`` without it, ``"error"`` the default. Returns the
    streams' draws after a reseeding load (verified in sync), or the error and whether the streams held."""
    import torch.distributed.checkpoint as dcp

    from hyperrng.verify import verify_rng_sync

    coords = {"dp": rank // tp, "tp": rank % tp}
    with platforms.use(platforms.CPUPlatform()), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_layout(_LAYOUT, 1234 if how == "save" else 7, coords)
        tracker = get_rng_tracker()
        if how == "save":
            with tracker.fork(MP):
                torch.rand(5)
            dcp.save({"rng": RNGStateful()}, checkpoint_id=directory)
            return None
        stateful = RNGStateful(on_mismatch="error" if how == "error" else "reseed")
        planner = RNGStateful.planner() if how == "reseed" else None
        before = tracker.get_states()
        try:
            dcp.load({"rng": stateful}, checkpoint_id=directory, planner=planner)
        except InvalidArgumentError as exc:
            after = tracker.get_states()
            return str(exc), all(torch.equal(after[k], v) for k, v in before.items())
        verify_rng_sync(_LAYOUT, coords)
        with tracker.fork(MP):
            shared = torch.rand(3).tolist()
        resumed = [w for w in caught if w.category.__name__ == "RNGResumeWarning"]
        return shared, torch.rand(3).tolist(), len(resumed)


def test_a_mesh_reshaped_at_the_same_world_size_is_a_mismatch_and_reseeds_in_sync(tmp_path: Path) -> None:
    run_ranks(_reshaped, 2, str(tmp_path), 2, "save")  # dp 1 x tp 2
    refused = run_ranks(_reshaped, 2, str(tmp_path), 1, "error")  # dp 2 x tp 1
    assert all(unchanged and "saved under a different setup" in message for message, unchanged in refused)
    assert "coordinates changed on another rank" in refused[0][0]  # rank 0 is where it was: rank 1 moved
    assert "mesh coordinates {'dp': 0, 'tp': 1} (now {'dp': 1, 'tp': 0})" in refused[1][0]
    (mp0, default0, warned0), (mp1, default1, warned1) = run_ranks(_reshaped, 2, str(tmp_path), 1, "reseed")
    assert mp0 == mp1, "the two ranks share tp = 0: one model-parallel stream"
    assert default0 != default1, "two data-parallel ranks: two default streams"
    assert warned0 == warned1 == 1, "each rank re-derived its streams, the one whose coordinates held too"


def test_without_the_planner_every_rank_refuses_and_says_to_load_with_it(tmp_path: Path) -> None:
    run_ranks(_reshaped, 2, str(tmp_path), 2, "save")
    (message0, unchanged0), (message1, unchanged1) = run_ranks(_reshaped, 2, str(tmp_path), 1, "reseed-alone")
    assert unchanged0 and unchanged1, "every rank refuses, the one whose coordinates held too"
    assert "another rank's state was saved at other coordinates" in message0
    assert "this rank's state was saved at other coordinates" in message1
    assert "load with planner=RNGStateful.planner()" in message1


@pytest.mark.slow
def test_a_mesh_of_4_reseeds_on_2_and_3_ranks_with_every_stream_in_sync(tmp_path: Path) -> None:
    run_ranks(_reshaped, 4, str(tmp_path), 2, "save")  # dp 2 x tp 2
    for world in (2, 3):  # dp x tp 1: one model-parallel stream, a default stream per rank
        draws = run_ranks(_reshaped, world, str(tmp_path), 1, "reseed")
        assert len({tuple(mp) for mp, _, _ in draws}) == 1
        assert len({tuple(default) for _, default, _ in draws}) == world


def _one_rank_fails(rank: int, world_size: int, directory: str) -> list[tuple[str, str, str, bool]]:
    """Two ranks as ``dp 1 x tp 2`` save, then rank 1 alone fails each step's checks: a save inside a fork, a DCP
    load with a coordinate refused, a direct load of what is not a mapping, a DCP load inside a fork (refused by
    the checks of the load itself: before, the other rank loaded). Per step: the error's class and
    message, and whether the streams held."""
    import torch.distributed.checkpoint as dcp

    from hyperrng.errors import HyperRNGError

    coords = {"dp": 0, "tp": rank}
    steps: list[tuple[str, str, str, bool]] = []
    with platforms.use(platforms.CPUPlatform()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_layout(_LAYOUT, 1234, coords)
        tracker = get_rng_tracker()
        dcp.save({"rng": RNGStateful()}, checkpoint_id=directory)
        entry = RNGStateful().state_dict()  # collective too: both ranks
        apply_layout(_LAYOUT, 7, coords)
        before = tracker.get_states()

        def save_in_fork() -> None:
            with tracker.fork(MP) if rank == 1 else contextlib.nullcontext():
                dcp.save({"rng": RNGStateful()}, checkpoint_id=f"{directory}-unused")

        def load_with_bad_coords() -> None:
            dcp.load({"rng": RNGStateful(coords={"dp": 0, "tp": -1} if rank == 1 else None)}, checkpoint_id=directory)

        def load_no_mapping() -> None:
            RNGStateful().load_state_dict(42 if rank == 1 else entry)  # type: ignore[arg-type]

        def load_in_fork() -> None:  # refused by the load's own checks, after the first gather
            with tracker.fork(MP) if rank == 1 else contextlib.nullcontext():
                dcp.load({"rng": RNGStateful()}, checkpoint_id=directory)

        for step in (save_in_fork, load_with_bad_coords, load_no_mapping, load_in_fork):
            try:
                step()
                outcome = ("none", "")
            except HyperRNGError as exc:
                outcome = (type(exc).__name__, str(exc))
            after = tracker.get_states()
            unchanged = all(torch.equal(after[k], v) for k, v in before.items())
            steps.append((step.__name__, *outcome, unchanged))
    return steps


def test_a_rank_whose_checks_fail_makes_every_rank_raise_at_once_with_nothing_changed(tmp_path: Path) -> None:
    """Before, the failing rank raised alone and the other waited in a gather (DCP's or ours) for the process
    group's timeout: 30 minutes by default."""
    rank0, rank1 = run_ranks(_one_rank_fails, 2, str(tmp_path / "ckpt"))
    expected = {"save_in_fork": "InvalidOperationError", "load_with_bad_coords": "InvalidArgumentError"}
    expected["load_no_mapping"] = "ArgumentTypeError"
    expected["load_in_fork"] = "InvalidOperationError"
    for (step, kind0, message0, unchanged0), (_, kind1, message1, unchanged1) in zip(rank0, rank1, strict=True):
        assert kind1 == expected[step], (step, kind1, message1)  # the failing rank: its own error
        assert kind0 == "RankFailure", (step, kind0, message0)  # the other: ours, naming it and why
        assert f"rank 1 of the group failed ({kind1}: {message1[:40]}" in message0
        assert unchanged0 and unchanged1, step  # and no rank waited: a hang fails at the group's timeout
    assert "coordinate of 'tp' must be in [0, 2**64 - 1], got -1" in rank0[1][2]


def _no_dist() -> bool:
    import inspect

    import torch.distributed.checkpoint as dcp

    return "no_dist" in inspect.signature(dcp.load).parameters  # torch 2.5's load has none


def _evaluates_alone(rank: int, world_size: int, directory: str) -> bool | None:
    """Both ranks save; then rank 0 alone reloads with ``no_dist=True`` (``alone=True``) while rank 1 goes on
    without it. Rank 0 returns whether its draws resumed exactly."""
    import torch.distributed.checkpoint as dcp

    coords = {"dp": 0, "tp": rank}
    with platforms.use(platforms.CPUPlatform()), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no_dist loads in a single process
        apply_layout(_LAYOUT, 1234, coords)
        tracker = get_rng_tracker()
        dcp.save({"rng": RNGStateful()}, checkpoint_id=directory)
        if rank != 0:
            return None  # no collective from here on: a gather on rank 0 would wait for the group's timeout
        with tracker.fork(MP):
            shared = torch.rand(3)
        default = torch.rand(3)
        apply_layout(_LAYOUT, 7, coords)
        dcp.load({"rng": RNGStateful(alone=True)}, checkpoint_id=directory, no_dist=True)
        with tracker.fork(MP):
            resumed = torch.equal(torch.rand(3), shared)
        return resumed and torch.equal(torch.rand(3), default)


@pytest.mark.skipif(not _no_dist(), reason="this torch's torch.distributed.checkpoint.load has no no_dist")
def test_one_rank_reloads_alone_with_no_dist_while_the_group_is_up(tmp_path: Path) -> None:
    resumed, idle = run_ranks(_evaluates_alone, 2, str(tmp_path))  # a gather would wait for the group's timeout
    assert resumed and idle is None


def test_alone_must_be_a_bool() -> None:
    with pytest.raises(ArgumentTypeError, match="alone must be a bool"):
        RNGStateful(alone=1)  # type: ignore[arg-type]
