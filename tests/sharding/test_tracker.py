"""The offset-based tracker: replicas agree, shards differ, every rank leaves at one position."""

from __future__ import annotations

import logging
import re
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from hyperrng.errors import ArgumentTypeError, InvalidArgumentError, InvalidOperationError
from hyperrng.sharding.offsets import rng_offsets
from hyperrng.sharding.tracker import MeshInfo, ShardedRNGTracker, as_mesh_info
from tests._dist import run_ranks
from tests._platforms import PLATFORMS, draw, use_each

MESH = (2, 2)
COORDS = [(0, 0), (0, 1), (1, 0), (1, 1)]
PLACEMENTS = [Shard(0), Replicate()]
SHAPE = (8, 6)


platform = use_each(PLATFORMS)


def test_on_the_cpu_no_shard_replays_the_plain_draws_made_at_the_base_position() -> None:
    with platforms.use(platforms.CPUPlatform()) as cpu:
        tracker = ShardedRNGTracker()
        tracker.manual_seed(1234)
        for _ in range(2):  # at the first op's base, and again after an op
            base = cpu.get_seed_offset()
            plain = torch.rand(4)
            with tracker.distribute_region(MeshInfo((2,), (0,)), [Shard(0)], (8,)):
                shard0 = torch.rand(4)
            assert not torch.equal(plain, shard0), f"shard 0 replayed the plain draws at {base}"


def test_a_sharded_op_inside_recompute_replays_its_mask(platform: platforms.Platform) -> None:
    from hyperrng.streams.recompute import checkpoint

    tracker = ShardedRNGTracker()
    tracker.manual_seed(1234)
    with tracker.distribute_region(MeshInfo((2,), (1,)), [Shard(0)], (8,)):
        pass  # leave offset 0, where a lost position would go unnoticed
    masks: list[torch.Tensor] = []

    def block(x: torch.Tensor) -> torch.Tensor:
        with tracker.distribute_region(MeshInfo((2,), (1,)), [Shard(0)], (8,)):
            mask = (draw(platform, 4) > 0.5).float()
        masks.append(mask)
        return x * mask

    x = torch.ones(4, requires_grad=True)
    checkpoint(block, x).sum().backward()
    assert len(masks) == 2 and torch.equal(masks[0], masks[1])
    assert x.grad is not None and torch.equal(x.grad, masks[0])


def test_a_position_survives_a_save_and_restore_of_the_state_bytes(platform: platforms.Platform) -> None:
    tracker = ShardedRNGTracker()
    tracker.manual_seed(5)
    with tracker.distribute_region(MeshInfo(MESH, (1, 0)), PLACEMENTS, SHAPE):
        pass
    position, saved = platform.get_seed_offset(), platform.get_rng_state()
    platform.manual_seed(99)
    platform.set_rng_state(saved)
    assert platform.get_seed_offset() == position


Draw = dict[tuple[int, int], tuple[torch.Tensor, tuple[int, int]]]


def _run_every_rank(p: platforms.Platform, seed: int = 11) -> Draw:
    out = {}
    for coord in COORDS:
        tracker = ShardedRNGTracker()
        tracker.manual_seed(seed)
        with tracker.distribute_region(MeshInfo(MESH, coord), PLACEMENTS, SHAPE):
            local = draw(p, 4 * 6)
        out[coord] = (local, p.get_seed_offset())
    return out


def test_replicas_draw_the_same_numbers_and_shards_differ(platform: platforms.Platform) -> None:
    out = _run_every_rank(platform)
    assert torch.equal(out[(0, 0)][0], out[(0, 1)][0])
    assert torch.equal(out[(1, 0)][0], out[(1, 1)][0])
    assert not torch.equal(out[(0, 0)][0], out[(1, 0)][0])


def test_every_rank_leaves_at_the_same_position(platform: platforms.Platform) -> None:
    out = _run_every_rank(platform)
    _, end = rng_offsets(MESH, (0, 0), PLACEMENTS, SHAPE)
    assert {pos for _, pos in out.values()} == {(11, end)}


def test_inside_the_region_the_generator_sits_at_the_shard_start(platform: platforms.Platform) -> None:
    tracker = ShardedRNGTracker()
    tracker.manual_seed(3)
    platform.set_seed_offset(3, 40)
    with tracker.distribute_region(MeshInfo(MESH, (1, 1)), PLACEMENTS, SHAPE):
        assert platform.get_seed_offset() == (3, 40 + 24)
    assert platform.get_seed_offset() == (3, 40 + 48)


def test_consecutive_regions_draw_new_numbers(platform: platforms.Platform) -> None:
    tracker = ShardedRNGTracker()
    tracker.manual_seed(3)
    mesh = MeshInfo(MESH, (0, 0))
    with tracker.distribute_region(mesh, PLACEMENTS, SHAPE):
        first = draw(platform, 24)
    with tracker.distribute_region(mesh, PLACEMENTS, SHAPE):
        second = draw(platform, 24)
    assert not torch.equal(first, second)


def test_an_exception_inside_the_region_still_synchronises(platform: platforms.Platform) -> None:
    tracker = ShardedRNGTracker()
    tracker.manual_seed(3)
    with pytest.raises(RuntimeError, match="boom"):
        with tracker.distribute_region(MeshInfo(MESH, (1, 0)), PLACEMENTS, SHAPE):
            raise RuntimeError("boom")
    assert platform.get_seed_offset() == (3, 48)


def test_a_passed_generator_is_positioned_and_keeps_its_advance(platform: platforms.Platform) -> None:
    tracker = ShardedRNGTracker()
    tracker.manual_seed(5)
    device_before = platform.get_rng_state()
    default = platform.default_generator()
    gen = torch.Generator() if platform.device_type == "cpu" else default.clone_state()  # type: ignore[union-attr]
    platform.set_seed_offset(77, 8, generator=gen)
    with tracker.distribute_region(MeshInfo(MESH, (1, 0)), PLACEMENTS, SHAPE, generator=gen):
        assert platform.get_seed_offset(generator=gen) == (77, 8 + 24)
    assert platform.get_seed_offset(generator=gen) == (77, 8 + 48)
    assert torch.equal(platform.get_rng_state(), device_before), "the device generator must not move"


def test_offsets_are_cached_after_the_first_call(monkeypatch: pytest.MonkeyPatch) -> None:
    tracker = ShardedRNGTracker()
    mesh = MeshInfo(MESH, (1, 0))
    assert tracker.offsets(mesh, PLACEMENTS, SHAPE) == (24, 48)
    import hyperrng.sharding.tracker as sharded

    monkeypatch.setattr(sharded, "rng_offsets", lambda *a: pytest.fail("recomputed"))
    assert tracker.offsets(mesh, PLACEMENTS, SHAPE) == (24, 48)


def test_mesh_descriptions_are_accepted_in_three_forms() -> None:
    class FakeDeviceMesh:
        shape = (2, 4)

        def get_coordinate(self) -> list[int]:
            return [1, 3]

    expected = MeshInfo((2, 4), (1, 3))
    assert as_mesh_info(expected) is expected
    assert as_mesh_info(((2, 4), (1, 3))) == expected
    assert as_mesh_info(FakeDeviceMesh()) == expected


# -- bad input: typed errors, nothing changed ----------------------------------------------


class _NotInMesh:
    shape = (2, 2)

    def get_coordinate(self) -> None:
        return None


@pytest.mark.parametrize(
    ("mesh", "placements", "shape", "fragment"),
    [
        (((2, 2), (2, 0)), PLACEMENTS, SHAPE, "coordinate"),
        (((2, 2), (0,)), PLACEMENTS, SHAPE, "coordinate"),
        (((2, 2), (0, 0)), [Shard(0), Replicate(), Replicate()], SHAPE, "placement"),
        (((2, 2), (0, 0)), [Shard(2), Replicate()], SHAPE, "dim"),
        (((2, 2), (0, 0)), PLACEMENTS, (-1, 6), "must be at least 0"),
    ],
)
def test_bad_regions_raise_before_anything_changes(
    platform: platforms.Platform, mesh: Any, placements: Any, shape: Any, fragment: str
) -> None:
    tracker = ShardedRNGTracker()
    tracker.manual_seed(9)
    before = platform.get_rng_state()
    with pytest.raises(InvalidArgumentError) as info:
        with tracker.distribute_region(mesh, placements, shape):
            pytest.fail("the region body must not run")
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)
    assert torch.equal(platform.get_rng_state(), before)


class _FractionalMesh:
    """A DeviceMesh look-alike whose shape is not made of ints."""

    shape = (2.7,)
    mesh_dim_names = ("dp",)

    def get_coordinate(self) -> list[int]:
        return [1]


@pytest.mark.parametrize(
    ("mesh", "placements", "fragment"),
    [
        ("2x2", PLACEMENTS, "expected a DeviceMesh"),
        ([(2, 2), (0, 0)], PLACEMENTS, "expected a DeviceMesh"),
        (_FractionalMesh(), [Shard(0)], "each entry of the mesh shape must be an int, got float 2.7"),
        (((2, 2), (0, 0)), 5, "placements must be a sequence"),
    ],
    ids=["str", "list", "fractional-shape", "placements-int"],
)
def test_a_region_of_the_wrong_type_is_a_type_error_and_changes_nothing(
    platform: platforms.Platform, mesh: Any, placements: Any, fragment: str
) -> None:
    tracker = ShardedRNGTracker()
    tracker.manual_seed(9)
    before = platform.get_rng_state()
    with pytest.raises(ArgumentTypeError, match=re.escape(fragment)) as info:
        with tracker.distribute_region(mesh, placements, SHAPE):
            pytest.fail("the region body must not run")
    assert isinstance(info.value, TypeError)
    assert torch.equal(platform.get_rng_state(), before)


def test_a_region_on_a_mesh_without_this_rank_is_an_invalid_operation_and_changes_nothing(
    platform: platforms.Platform,
) -> None:
    tracker = ShardedRNGTracker()
    tracker.manual_seed(9)
    before = platform.get_rng_state()
    with pytest.raises(InvalidOperationError, match="not part of the device mesh") as info:
        with tracker.distribute_region(_NotInMesh(), PLACEMENTS, SHAPE):
            pytest.fail("the region body must not run")
    assert info.value.reason == "mesh"
    assert torch.equal(platform.get_rng_state(), before)


def test_a_generator_of_another_device_is_refused(platform: platforms.Platform) -> None:
    if isinstance(platform, platforms.CUDAPlatform):
        foreign = torch.Generator()
    else:
        foreign = platforms.CUDAPlatform(module=platforms.SimulatedDeviceModule(device_type="cuda")).default_generator()
    tracker = ShardedRNGTracker()
    before = platform.get_rng_state()
    with pytest.raises(InvalidArgumentError, match="does not belong to platform"):
        with tracker.distribute_region(MeshInfo(MESH, (0, 0)), PLACEMENTS, SHAPE, generator=foreign):
            pytest.fail("the region body must not run")
    assert torch.equal(platform.get_rng_state(), before)


def test_an_offset_overflow_is_refused(platform: platforms.Platform) -> None:
    platform.set_seed_offset(1, 2**63 - 8)
    before = platform.get_rng_state()
    with pytest.raises(InvalidArgumentError, match="would pass 2\\*\\*63 - 1"):
        with ShardedRNGTracker().distribute_region(MeshInfo(MESH, (0, 0)), PLACEMENTS, SHAPE):
            pytest.fail("the region body must not run")
    assert torch.equal(platform.get_rng_state(), before)


def test_manual_seed_refuses_bad_seeds_and_foreign_meshes() -> None:
    tracker = ShardedRNGTracker()
    before = torch.get_rng_state()
    with pytest.raises(ValueError, match="seed must be in"):
        tracker.manual_seed(-1)
    with pytest.raises(InvalidOperationError, match="not part of the device mesh") as info:
        tracker.manual_seed(1, _NotInMesh())
    assert info.value.reason == "mesh"
    assert torch.equal(torch.get_rng_state(), before)


# -- real processes ----------------------------------------------------------------------------


def _sync_ranks(rank: int, world_size: int) -> tuple[bool, tuple[int, int]]:
    tracker = ShardedRNGTracker()
    tracker.platform.manual_seed(100 + (rank % 2))  # ranks 1 and 3 disagree with rank 0, on any platform
    differed = tracker.sync_from_rank0()
    return differed, tracker.platform.get_seed_offset()


@pytest.mark.multiproc
def test_sync_from_rank0_aligns_every_rank_and_reports_who_differed(caplog: pytest.LogCaptureFixture) -> None:
    results = run_ranks(_sync_ranks, 4)
    assert [d for d, _ in results] == [False, True, False, True]
    assert {pos for _, pos in results} == {(100, 0)}


def _dtensor_random_ops(rank: int, world_size: int, install: bool) -> dict[str, list[float]]:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    tracker = ShardedRNGTracker()
    previous = tracker.install_dtensor() if install else None
    try:
        torch.manual_seed(2024)  # the same seed everywhere
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows = distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0), Replicate()])
            rows.uniform_()
            cols = distribute_tensor(torch.zeros(4, 10), mesh, [Replicate(), Shard(1)])
            torch.nn.init.normal_(cols)
        position = tracker.platform.get_seed_offset()
    finally:
        if install:
            tracker.uninstall_dtensor(previous)
    return {
        "rows": rows.to_local().flatten().tolist(),
        "cols": cols.to_local().flatten().tolist(),
        "position": list(position),
    }


def _on_the_cpu(fn: Any, world_size: int, *args: Any) -> list[Any]:
    """``run_ranks`` with the CPU platform in every rank: DTensor ops on a CPU mesh draw from the CPU's generator."""
    with platforms.use(platforms.CPUPlatform()):
        return run_ranks(fn, world_size, *args)


@pytest.mark.multiproc
def test_dtensor_random_ops_on_a_cpu_mesh_go_through_our_tracker() -> None:
    r = _on_the_cpu(_dtensor_random_ops, 4, True)  # coordinates: rank = 2 * i + j
    # Shard(0) over mesh dim 0: ranks (i, 0) and (i, 1) are replicas.
    assert r[0]["rows"] == r[1]["rows"] and r[2]["rows"] == r[3]["rows"]
    assert r[0]["rows"] != r[2]["rows"]
    # Shard(1) over mesh dim 1: ranks (0, j) and (1, j) are replicas.
    assert r[0]["cols"] == r[2]["cols"] and r[1]["cols"] == r[3]["cols"]
    assert r[0]["cols"] != r[1]["cols"]
    assert len({tuple(x["position"]) for x in r}) == 1, "every rank must leave at the same position"


def _ops_with_an_explicit_default_generator(rank: int, world_size: int) -> dict[str, list[list[float]]]:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    tracker = ShardedRNGTracker()
    previous = tracker.install_dtensor()
    out: dict[str, list[list[float]]] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for label, generator in (("explicit", torch.default_generator), ("implicit", None)):
                tracker.manual_seed(42)
                out[label] = []
                for _ in range(3):
                    t = distribute_tensor(torch.zeros(8), mesh, [Shard(0)])
                    t.uniform_(generator=generator)
                    out[label].append(t.to_local().tolist())
    finally:
        tracker.uninstall_dtensor(previous)
    out["refused"] = _a_refused_op_leaves_a_user_generator(mesh)
    return out


def _a_refused_op_leaves_a_user_generator(mesh: Any) -> list[list[float]]:
    """A portable DTensor op refused (an int tensor) with generator=g: g's next numbers, which must be those it had
    (on the CPU, putting g back at its position reseeded it, losing the draws it made before)."""
    import warnings

    from hyperrng.platforms import _features
    from torch.distributed.tensor import distribute_tensor

    import hyperrng
    from hyperrng.errors import ArgumentTypeError

    g = torch.Generator().manual_seed(5)
    torch.rand(3, generator=g)
    if _features.feature("portable-mode").available:
        with warnings.catch_warnings(), hyperrng.portable_random(7):
            warnings.simplefilter("ignore")
            t = distribute_tensor(torch.zeros(4, 4, dtype=torch.int32), mesh, [Shard(0)])
            try:
                t.uniform_(generator=g)
            except ArgumentTypeError:
                pass
    return [torch.rand(2, generator=g).tolist()]


@pytest.mark.multiproc
def test_dtensor_ops_given_the_default_generator_explicitly_draw_what_implicit_ones_draw() -> None:
    """DTensor hands the tracker a new wrapper of the default generator; each op must still move it on."""
    g = torch.Generator().manual_seed(5)
    torch.rand(3, generator=g)
    for result in _on_the_cpu(_ops_with_an_explicit_default_generator, 2):
        assert result["explicit"] == result["implicit"]
        assert result["explicit"][0] != result["explicit"][1] != result["explicit"][2]
        assert result["refused"] == [torch.rand(2, generator=g).tolist()], "a refused op moved the user generator"
        g = torch.Generator().manual_seed(5)
        torch.rand(3, generator=g)


@pytest.mark.multiproc
def test_without_our_tracker_pytorch_draws_identical_shards_on_a_cpu_mesh() -> None:
    r = _on_the_cpu(_dtensor_random_ops, 4, False)
    assert r[0]["rows"] == r[2]["rows"], "PyTorch gives every shard the same numbers on CPU meshes"


def test_sync_logs_a_warning_when_ranks_disagree(caplog: pytest.LogCaptureFixture) -> None:
    tracker = ShardedRNGTracker()
    with caplog.at_level(logging.WARNING):
        assert tracker.sync_from_rank0() is False  # single process: rank 0 agrees with itself
    assert not caplog.records


@pytest.mark.parametrize(
    ("mesh", "shape", "error"),
    [
        (((2,), (True,)), (8,), ArgumentTypeError),  # equal to ((2,), (1,)) by ==, but a bool
        (MeshInfo((2,), (1,)), (8.0,), ArgumentTypeError),  # equal to (8,) by ==, but a float
    ],
)
def test_the_offset_cache_never_skips_validation(mesh: Any, shape: Any, error: Any) -> None:
    tracker = ShardedRNGTracker()
    assert tracker.offsets(MeshInfo((2,), (1,)), [Shard(0)], (8,)) == (4, 8)
    with pytest.raises(error):
        tracker.distribute_region(mesh, [Shard(0)], shape)


def test_on_the_cpu_a_plain_generator_reads_as_its_seed_and_keeps_a_position_it_is_given() -> None:
    with platforms.use(platforms.CPUPlatform()) as cpu:
        plain = torch.Generator().manual_seed(42)
        assert cpu.get_seed_offset(generator=plain) == (42, 0)
        cpu.set_seed_offset(42, 8, generator=plain)
        assert cpu.get_seed_offset(generator=plain) == (42, 8)
        torch.rand(3, generator=plain)  # plain draws do not move a position: the next region seeds another domain
        assert cpu.get_seed_offset(generator=plain) == (42, 8)


def test_offsets_follow_a_placements_list_changed_in_place_between_ops() -> None:
    """Repeated ops reuse the previous answer only for the very same immutable objects."""
    tracker = ShardedRNGTracker()
    mesh = MeshInfo((2, 2), (1, 0))
    placements = [Shard(0), Replicate()]
    first = tracker.offsets(mesh, placements, (8, 6))
    placements[0], placements[1] = Replicate(), Shard(0)  # same list object, other sharding
    assert tracker.offsets(mesh, placements, (8, 6)) == rng_offsets((2, 2), (1, 0), placements, (8, 6))
    assert tracker.offsets(mesh, placements, (8, 6)) != first
    fixed = (Shard(0), Replicate())
    assert tracker.offsets(mesh, fixed, (8, 6)) == tracker.offsets(mesh, fixed, (8, 6)) == first


def test_a_repeated_op_with_a_rebuilt_list_and_shape_reuses_the_answer_and_a_changed_one_does_not() -> None:
    """The fast path for a repeated op compares a list of placements and a torch.Size by value."""
    tracker = ShardedRNGTracker()
    mesh = MeshInfo((4, 2), (3, 1))
    first = tracker.offsets(mesh, [Shard(0), Replicate()], torch.Size((10, 6)))
    assert tracker.offsets(mesh, [Shard(0), Replicate()], torch.Size((10, 6))) == first
    assert tracker.offsets(mesh, [Shard(1), Replicate()], torch.Size((10, 6))) == rng_offsets(
        (4, 2), (3, 1), [Shard(1), Replicate()], (10, 6)
    )
    assert tracker.offsets(mesh, [Shard(1), Replicate()], torch.Size((1, 7))) == rng_offsets(
        (4, 2), (3, 1), [Shard(1), Replicate()], (1, 7)
    )
    with pytest.raises(ArgumentTypeError):  # equal to the last shape by ==, but a bool: validated, not reused
        tracker.offsets(mesh, [Shard(1), Replicate()], (True, 7))


def test_a_region_left_out_of_order_is_refused_and_leaves_no_active_region_behind_once_retried() -> None:
    from hyperrng.sharding.tracker import active_region

    tracker = ShardedRNGTracker()
    tracker.manual_seed(3)
    outer = tracker.distribute_region(MeshInfo((2,), (0,)), [Shard(0)], (5,))
    inner = tracker.distribute_region(MeshInfo((2,), (1,)), [Shard(0)], (9,))
    outer.__enter__()
    inner.__enter__()
    position = platforms.current().get_seed_offset()
    with pytest.raises(InvalidOperationError, match="entered after it on this thread, is still open"):
        outer.__exit__(None, None, None)
    assert active_region() is inner and platforms.current().get_seed_offset() == position, "nothing changed"
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)  # in order now
    assert active_region() is None
