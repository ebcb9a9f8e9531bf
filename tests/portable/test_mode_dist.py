"""Portable mode across real ranks: DTensor shards, elastic resume and tensor parallelism give the
global tensors of an unsharded process."""

from __future__ import annotations

import subprocess
import sys
import warnings
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch
import torch.nn.functional as F

from hyperrng import philox
from hyperrng.cli.demo._portable import tp_invariance_report
from hyperrng.errors import ArgumentTypeError, InvalidArgumentError
from hyperrng.portable.mode import (
    portable_random,
    set_portable_random,
)
from hyperrng.portable.position import PORTABLE_STATE_FORMAT, load_portable_state_dict, portable_state_dict
from hyperrng.sharding.tracker import ShardedRNGTracker
from hyperrng.streams.tracker import RNGStatesTracker
from tests._dist import run_ranks

pytestmark = pytest.mark.needs_portable_mode

SEED = 97


def _placements(spec: list[tuple[str, int]]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(d) if kind == "S" else Replicate() for kind, d in spec]


# (mesh shape, placements, global shape): uneven, two dims sharded, one dim sharded twice, replicated
LAYOUTS = [
    ((4,), [("S", 0)], (10, 3)),
    ((2, 2), [("S", 0), ("S", 1)], (5, 7)),
    ((2, 2), [("S", 0), ("S", 0)], (9, 2)),
    ((2, 2), [("R", 0), ("S", 1)], (3, 6)),
]


def _draws(mesh: Any, layouts: list[Any]) -> list[torch.Tensor]:
    """For each layout: rand, randn, dropout of ones, kaiming_uniform_ init, as global tensors.

    (Not trunc_normal_: torch's rejection loop asks ``bool(mask.any())`` of a sharded tensor,
    which DTensor answers from the local shard, so ranks may disagree on redrawing.)"""
    from torch.distributed.tensor import distribute_tensor, rand, randn

    out = []
    for _, spec, shape in layouts:
        placements = _placements(spec)
        out.append(rand(shape, device_mesh=mesh, placements=placements).full_tensor())
        out.append(randn(shape, device_mesh=mesh, placements=placements).full_tensor())
        ones = distribute_tensor(torch.ones(shape), mesh, placements)
        out.append(F.dropout(ones, 0.5).full_tensor())
        weight = distribute_tensor(torch.zeros(shape), mesh, placements)
        torch.nn.init.kaiming_uniform_(weight)
        out.append(weight.full_tensor())
    return out


def _unsharded(layouts: list[Any]) -> list[torch.Tensor]:
    out = []
    for _, _, shape in layouts:
        out += [torch.rand(shape), torch.randn(shape), F.dropout(torch.ones(shape), 0.5)]
        out.append(torch.nn.init.kaiming_uniform_(torch.zeros(shape)))
    return out


def _dtensor_rank(
    rank: int, world_size: int, mesh_shape: tuple[int, ...], layouts: list[Any], install: bool
) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import _random

    tracker = ShardedRNGTracker()
    previous = tracker.install_dtensor() if install else None
    before = _random._rng_tracker
    try:
        mesh = init_device_mesh("cpu", mesh_shape)
        with warnings.catch_warnings(), portable_random(SEED):
            warnings.simplefilter("ignore")
            tensors = _draws(mesh, layouts)
            position = platforms.current().get_seed_offset()
        restored = _random._rng_tracker is before
    finally:
        if install:
            tracker.uninstall_dtensor(previous)
    return {"tensors": [t.tolist() for t in tensors], "position": list(position), "restored": restored}


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("mesh_shape", "install"),
    [((4,), False), ((2, 2), False), ((4,), True)],
    ids=["1d-by-itself", "2d-by-itself", "1d-adapter-installed-by-the-user"],
)
def test_dtensor_random_ops_give_every_rank_the_unsharded_tensors(mesh_shape: tuple[int, ...], install: bool) -> None:
    """portable_random(seed) alone routes DTensor ops through the sharded path, and puts DTensor's tracker back."""
    layouts = [layout for layout in LAYOUTS if len(layout[0]) == len(mesh_shape)]
    results = run_ranks(_dtensor_rank, 4, mesh_shape, layouts, install)
    with platforms.use(platforms.CPUPlatform()), portable_random(SEED):
        expected = _unsharded(layouts)
        position = list(platforms.current().get_seed_offset())
    for rank, result in enumerate(results):
        for i, (got, want) in enumerate(zip(result["tensors"], expected)):
            assert torch.equal(torch.tensor(got), want), f"rank {rank}, draw {i}"
        assert result["position"] == position, f"rank {rank} left at another position than an unsharded process"
        assert result["restored"], f"rank {rank}: the exit did not put DTensor's RNG tracker back"


# -- elastic resume ----------------------------------------------------------------------------
_ELASTIC_SHAPE = (10, 3)  # uneven on 4 ranks


def _elastic_rank(rank: int, world_size: int, state: dict[str, Any] | None, before: int, after: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor, rand

    tracker = ShardedRNGTracker()
    previous = tracker.install_dtensor()
    streams = RNGStatesTracker()
    streams.add("model-parallel-rng", 5)
    mesh = init_device_mesh("cpu", (world_size,))
    draws, saved = [], None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if state is None:
                set_portable_random(True, seed=SEED)
            else:
                load_portable_state_dict(state, streams)
                set_portable_random(True)
            for step in range(before + after):
                if step == before:
                    saved = portable_state_dict(streams)
                draws.append(rand(_ELASTIC_SHAPE, device_mesh=mesh, placements=[Shard(0)]).full_tensor())
                with streams.fork("model-parallel-rng"):
                    x = distribute_tensor(torch.ones(_ELASTIC_SHAPE), mesh, [Shard(1)])
                    draws.append(F.dropout(x, 0.5).full_tensor())
    finally:
        set_portable_random(False)
        tracker.uninstall_dtensor(previous)
    return {"draws": [d.tolist() for d in draws], "saved": saved}


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_checkpoint_taken_at_4_ranks_resumes_at_2_and_1_with_the_same_next_draws() -> None:
    uninterrupted = run_ranks(_elastic_rank, 4, None, 2, 2)
    state = uninterrupted[0]["saved"]
    assert all(r["saved"] == state for r in uninterrupted), "every rank saves the same positions"
    expected = uninterrupted[0]["draws"][4:]
    for world_size in (2, 1):
        resumed = run_ranks(_elastic_rank, world_size, state, 0, 2)
        for rank, result in enumerate(resumed):
            assert result["draws"] == expected, f"world size {world_size}, rank {rank}"


# -- tensor parallelism ------------------------------------------------------------------------
@pytest.mark.multiproc
@pytest.mark.slow
def test_a_model_trained_with_tp_1_2_and_4_has_identical_parameters_and_dropout_masks() -> None:
    report = tp_invariance_report((1, 2, 4), world_size=4, steps=3, seed=SEED)
    assert report["params_identical"]
    assert report["masks_identical"]
    assert report["max_loss_difference"] <= 1e-5 * max(abs(v) for v in report["losses"][1])
    assert len(report["losses"][4]) == 3


# -- the portable state dict on one process -----------------------------------------------------
@pytest.fixture
def cpu() -> Any:
    with platforms.use(platforms.CPUPlatform()) as p:
        yield p


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"steps": 0}, InvalidArgumentError, "steps must be at least 1"),
        ({"steps": 1.5}, ArgumentTypeError, "steps"),
        ({"tp_sizes": (3,)}, InvalidArgumentError, "divide world_size"),
        ({"tp_sizes": ()}, InvalidArgumentError, "divide world_size"),
    ],
)
def test_a_bad_tp_invariance_argument_is_refused_before_any_rank_starts(
    kwargs: dict[str, object], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        tp_invariance_report(**kwargs)  # type: ignore[arg-type]


def test_the_portable_state_round_trips_the_device_and_stream_positions(cpu: platforms.Platform) -> None:
    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 31)
    cpu.set_seed_offset(SEED, 0)
    with portable_random():
        torch.rand(6)
        with tracker.fork("model-parallel-rng"):
            torch.rand(3)
    state = portable_state_dict(tracker)
    assert state == {
        "format": PORTABLE_STATE_FORMAT,
        "position": [SEED, 8],
        "streams": {"model-parallel-rng": [31, 4]},
    }
    with portable_random():
        expected = torch.rand(5)
        with tracker.fork("model-parallel-rng"):
            expected_stream = torch.rand(5)
    fresh = RNGStatesTracker()
    fresh.add("model-parallel-rng", 1)
    cpu.set_seed_offset(3, 0)
    load_portable_state_dict(state, fresh)
    with portable_random():
        assert torch.equal(torch.rand(5), expected)
        with fresh.fork("model-parallel-rng"):
            assert torch.equal(torch.rand(5), expected_stream)
    assert torch.equal(expected, philox.uniform(5, SEED, 8))


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (lambda s: [1, 2], ArgumentTypeError, "must be the dict"),
        (lambda s: {**s, "format": "other/1"}, InvalidArgumentError, "format"),
        (lambda s: {**s, "position": [1]}, ArgumentTypeError, r"\[seed, offset\] pair"),
        (lambda s: {**s, "position": [-1, 0]}, InvalidArgumentError, "seed"),
        (lambda s: {**s, "position": [1, 6]}, InvalidArgumentError, "offset"),
        (lambda s: {**s, "position": [1.0, 0]}, ArgumentTypeError, "must be an int"),
        (lambda s: {**s, "streams": {"other": [1, 0]}}, InvalidArgumentError, "tracker lacks"),
        (lambda s: {**s, "streams": {"model-parallel-rng": [1, -4]}}, InvalidArgumentError, "offset"),
    ],
)
def test_a_bad_portable_state_is_refused_before_anything_is_set(
    cpu: platforms.Platform, change: Any, error: type[Exception], message: str
) -> None:
    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 31)
    good = portable_state_dict(tracker)
    cpu.set_seed_offset(11, 40)
    before, streams = cpu.get_seed_offset(), tracker.get_states()
    with pytest.raises(error, match=message):
        load_portable_state_dict(change(good), tracker)
    assert cpu.get_seed_offset() == before
    assert all(torch.equal(streams[k], v) for k, v in tracker.get_states().items())


def _desync_rank(rank: int, world_size: int) -> str:
    from hyperrng.errors import RNGDesyncError

    platforms.current().set_seed_offset(SEED, 4 * rank)  # rank 1 drew something rank 0 did not
    try:
        portable_state_dict(RNGStatesTracker())
    except RNGDesyncError as error:
        return str(error)
    return "no error"


@pytest.mark.multiproc
def test_saving_positions_that_differ_between_ranks_raises_on_every_rank() -> None:
    messages = run_ranks(_desync_rank, 2)
    assert all("ranks [1] hold other portable positions than rank 0" in m for m in messages), messages


# -- DTensor random ops in compiled code ---------------------------------------------------------
def _compiled_dtensor_rank(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor, rand

    mesh = init_device_mesh("cpu", (world_size,))

    def step(x: Any) -> Any:
        return F.dropout(x, 0.5) + rand(x.shape, device_mesh=mesh, placements=[Shard(0)])

    compiled = torch.compile(step, backend="aot_eager")
    x = distribute_tensor(torch.ones(6, 5), mesh, [Shard(0)])
    with warnings.catch_warnings(), portable_random(SEED):
        warnings.simplefilter("ignore")
        got = [compiled(x).full_tensor().tolist() for _ in range(2)]
        position = platforms.current().get_seed_offset()
    return {"tensors": got, "position": list(position)}


@pytest.mark.multiproc
@pytest.mark.needs_portable_compile
def test_dtensor_random_ops_in_compiled_code_give_every_rank_the_unsharded_tensors() -> None:
    """Dynamo leaves a DTensor random op's sharding to eager code behind a graph break: the portable
    draw runs there, untraced (traced, its host arithmetic failed to compile), at its position."""
    results = run_ranks(_compiled_dtensor_rank, 2)
    with platforms.use(platforms.CPUPlatform()), portable_random(SEED):
        expected = [(F.dropout(torch.ones(6, 5), 0.5) + torch.rand(6, 5)).tolist() for _ in range(2)]
        position = list(platforms.current().get_seed_offset())
    for rank, result in enumerate(results):
        assert result["tensors"] == expected, f"rank {rank}"
        assert result["position"] == position, f"rank {rank}"


def _recompute_after_the_mode_rank(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import hyperrng

    mesh = init_device_mesh("cpu", (world_size,))
    with portable_random(SEED):
        x = distribute_tensor(torch.ones(7, 6), mesh, [Shard(0)]).requires_grad_()
        y = hyperrng.checkpoint(lambda t: F.dropout(t * 2, 0.5), x)
    y.sum().backward()  # after the mode: the recompute draws in it all the same, DTensor's draws routed
    return {"out": y.full_tensor().tolist(), "grad": x.grad.full_tensor().tolist()}


@pytest.mark.multiproc
def test_a_checkpointed_dtensor_dropout_recomputed_after_the_mode_draws_the_forwards_mask_on_every_rank() -> None:
    """Before, the mode had uninstalled DTensor's routing when the recompute drew: ranks other than 0 redrew
    their shards from local indices (other gradients)."""
    results = run_ranks(_recompute_after_the_mode_rank, 3)
    with platforms.use(platforms.CPUPlatform()), portable_random(SEED):
        out = F.dropout(torch.ones(7, 6) * 2, 0.5)
    for rank, result in enumerate(results):
        assert result["out"] == out.tolist(), f"rank {rank}"
        assert result["grad"] == ((out != 0).float() * 4).tolist(), f"rank {rank}: the recompute's mask"


_ENTERED_BEFORE_DTENSOR = """
import sys, hyperrng
from hyperrng.portable.mode import portable_random, set_portable_random
assert "torch.distributed.tensor._random" not in sys.modules
with portable_random(1):  # entered and left before DTensor: nothing left waiting for it
    pass
assert not any(type(f).__name__ == "_RouteOnImport" for f in sys.meta_path), "no finder once nothing waits"
if sys.argv[1] == "switch":
    set_portable_random(True, seed=3)
else:
    context = portable_random(3)
    context.__enter__()
import torch.distributed.tensor._random as dtensor_random  # DTensor comes into use inside the mode
routed = type(dtensor_random._rng_tracker).__name__
if sys.argv[1] == "switch":
    set_portable_random(False)
else:
    context.__exit__(None, None, None)
print(routed, dtensor_random._rng_tracker, type(dtensor_random.__loader__).__name__ != "SourceFileLoader")
"""


@pytest.mark.parametrize("form", ["switch", "context"])
def test_the_mode_entered_before_dtensor_is_in_use_routes_its_random_ops_once_it_is(form: str) -> None:
    """Before, such an entry routed nothing: every rank drew its shard from local indices, silently."""
    run = subprocess.run([sys.executable, "-c", _ENTERED_BEFORE_DTENSOR, form], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["HyperRNGDTensorTracker", "None", "True"], "routed inside the mode, put back on exit"
