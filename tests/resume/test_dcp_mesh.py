"""DCP resumes after the mesh changed (:class:`hyperrng.RNGStateful`): a rank whose own saved state was made at
other coordinates is a mismatch, and with ``on_mismatch="reseed"`` every rank re-derives its streams from the
saved state at its coordinates, so that streams the layout shares are shared again. Before, a rank loaded the
state its rank number held: at the same world size the load passed as an exact resume, each rank holding
another rank's streams (data-parallel replicas drawing alike, tensor-parallel peers apart)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch

from hyperrng.errors import InvalidArgumentError
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
