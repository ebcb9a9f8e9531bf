"""Drop-in means unmodified: code written against Megatron-core's tracker or PyTorch's DTensor RNG runs as it is.

Each test states one behaviour that such code relies on: byte-tensor snapshots from the
default tracker on every platform, DTensor random ops under torch's single-process
LocalTensor mode (how PyTorch's own DTensor tests simulate every rank), the builtin
exception PyTorch raises for a rank outside the mesh, and forks inside ``torch.compile``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch
import torch.distributed as dist
from hyperrng.platforms._features import feature
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from hyperrng.errors import InvalidArgumentError, InvalidOperationError
from hyperrng.sharding import _local_tensor as _local_ranks
from hyperrng.sharding.offsets import rng_offsets
from hyperrng.sharding.tracker import MeshInfo, ShardedRNGTracker
from hyperrng.streams.tracker import CudaRNGStatesTracker, RNGStatesTracker, get_cuda_rng_tracker
from tests._platforms import PLATFORMS, draw, fresh_tracker_on_cpu, use_each  # noqa: F401 (autouse fixture)

if feature("local-tensor").available:  # its tests are marked needs_local_tensor and skip elsewhere
    from torch.distributed._local_tensor import LocalIntNode, LocalTensorMode

platform = use_each(PLATFORMS)

WORLD = 4
MESH_2X2 = (2, 2)
SEED = 2024


# -- Megatron-core's tracker test, on every platform ----------------------------------------------


def test_the_default_tracker_keeps_byte_tensors_on_every_platform(platform: platforms.Platform) -> None:
    for tracker in (CudaRNGStatesTracker(), get_cuda_rng_tracker()):
        tracker.add("model-parallel-rng", 1234)
        assert tracker.graph_safe is False, "a default tracker must not turn graph-safe by itself"
        state = tracker.get_states()["model-parallel-rng"]
        assert isinstance(state, torch.Tensor)
        assert state.dtype == torch.uint8 and state.device.type == "cpu"
        tracker.reset()


def test_a_megatron_style_session_compares_restores_and_forks_byte_states(platform: platforms.Platform) -> None:
    tracker = CudaRNGStatesTracker()
    tracker.add("state2", 1111)
    tracker.fork("state2")  # made but never entered: changes nothing
    platform.manual_seed(1111)
    outside = platform.get_rng_state()
    assert torch.equal(tracker.get_states()["state2"], outside)

    tracker.add("state1", 1234)
    saved = tracker.get_states()
    with tracker.fork("state1"):
        first = draw(platform, 10)
        with tracker.fork("state2"):
            draw(platform, 10)
    advanced = tracker.get_states()
    assert not torch.equal(advanced["state1"], saved["state1"])

    tracker.set_states(saved)
    with tracker.fork("state1"):
        again = draw(platform, 10)
        with tracker.fork("state2"):
            draw(platform, 10)
    assert torch.equal(first, again)
    for name in ("state1", "state2"):
        assert torch.equal(tracker.get_states()[name], advanced[name])
    assert torch.equal(platform.get_rng_state(), outside), "forks must give the device its state back"


# -- torch's LocalTensor mode: every rank simulated in one process --------------------------------


@pytest.fixture
def fake_world() -> Iterator[None]:
    """A process group of WORLD ranks that runs no communication (torch's "fake" backend), on the CPU."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"; no env:// rendezvous

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def installed(fake_world: None) -> Iterator[ShardedRNGTracker]:
    tracker = ShardedRNGTracker()
    previous = tracker.install_dtensor()
    try:
        yield tracker
    finally:
        tracker.uninstall_dtensor(previous)


def _coordinate(rank: int, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    coordinate = []
    for size in reversed(mesh_shape):
        coordinate.append(rank % size)
        rank //= size
    return tuple(reversed(coordinate))


def _as_real_ranks(
    seed: int, mesh_shape: tuple[int, ...], placements: list[Any], global_shape: tuple[int, ...], local_shape: Any
) -> tuple[dict[int, torch.Tensor], tuple[int, int]]:
    """What each rank of a real job draws for the op (one rank at a time, in this process), and the final position."""
    p = platforms.current()
    tracker = ShardedRNGTracker()
    shards = {}
    for rank in range(WORLD):
        p.set_seed_offset(seed, 0)
        with tracker.distribute_region(MeshInfo(mesh_shape, _coordinate(rank, mesh_shape)), placements, global_shape):
            shards[rank] = torch.empty(local_shape).uniform_()
    return shards, p.get_seed_offset()


def _positions(mode: LocalTensorMode) -> dict[int, tuple[int, int]]:
    """Each simulated rank's generator position, read through the platform."""
    out = {}
    for rank in sorted(mode.ranks):
        _local_ranks.load_rank(mode, rank)
        out[rank] = platforms.current().get_seed_offset()
    return out


PLACEMENT_CASES = [
    pytest.param([Shard(0), Replicate()], (8, 6), id="rows-over-dim0"),
    pytest.param([Replicate(), Shard(1)], (4, 8), id="cols-over-dim1"),
    pytest.param([Shard(0), Shard(1)], (8, 8), id="both"),
    pytest.param([Shard(1), Shard(1)], (4, 8), id="one-dim-twice"),
    pytest.param([Replicate(), Replicate()], (4, 4), id="replicated"),
]


@pytest.mark.needs_local_tensor
@pytest.mark.parametrize(("placements", "shape"), PLACEMENT_CASES)
def test_dtensor_random_ops_under_local_tensor_mode_draw_what_real_ranks_draw(
    installed: ShardedRNGTracker, placements: list[Any], shape: tuple[int, int]
) -> None:
    mesh = DeviceMesh("cpu", torch.arange(WORLD).reshape(MESH_2X2))
    with LocalTensorMode(WORLD) as mode, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        installed.manual_seed(SEED)
        dtensor = distribute_tensor(torch.zeros(shape), mesh, placements)
        dtensor.uniform_()
        simulated = {rank: t.clone() for rank, t in dtensor.to_local()._local_tensors.items()}
        positions = _positions(mode)
    local_shape = simulated[0].shape
    expected, position = _as_real_ranks(SEED, MESH_2X2, placements, shape, local_shape)
    for rank in range(WORLD):
        assert torch.equal(simulated[rank], expected[rank]), f"simulated rank {rank} drew other numbers"
    assert set(positions.values()) == {position}, "every simulated rank must leave at the real ranks' position"


@pytest.mark.needs_local_tensor
@pytest.mark.needs_portable_mode
def test_portable_draws_under_local_tensor_mode_are_refused_with_nothing_moved(fake_world: None) -> None:
    """Portable mode neither positions LocalTensor's simulated ranks nor reads them as one counter: each drew its
    shard by local index from its own padded window, and every rank left at the padded end, silently. Refused."""
    from hyperrng import portable_random
    from hyperrng.errors import UnsupportedPortableOpError

    mesh = DeviceMesh("cpu", torch.arange(WORLD))
    with portable_random(SEED), LocalTensorMode(WORLD) as mode, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dtensor = distribute_tensor(torch.zeros(2, 6), mesh, [Shard(1)])
        before, host = _positions(mode), torch.get_rng_state()
        for op in (dtensor.uniform_, lambda: torch.rand(4)):  # a sharded op, and a plain one on every rank
            with pytest.raises(UnsupportedPortableOpError, match="LocalTensorMode"):
                op()
            assert _positions(mode) == before and torch.equal(torch.get_rng_state(), host)
    # Inside a region entered outside the mode, the refusal cancels that region (not a sharded region around it),
    # once or twice: no rank moves.
    with ShardedRNGTracker().distribute_region(mesh, [Shard(0)], (8, 3)):
        with LocalTensorMode(WORLD) as mode, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tracker = ShardedRNGTracker()
            tracker.manual_seed(SEED)
            local = mode.rank_map(lambda rank: torch.zeros(2, 3))
            before, host = _positions(mode), torch.get_rng_state()
            for refusals in (1, 2):
                with pytest.raises(UnsupportedPortableOpError, match="LocalTensorMode"):
                    with tracker.distribute_region(mesh, [Shard(0)], (8, 3)), portable_random():
                        if refusals == 2:
                            with contextlib.suppress(UnsupportedPortableOpError):
                                local.uniform_()
                        local.uniform_()
                assert _positions(mode) == before and torch.equal(torch.get_rng_state(), host), refusals


@pytest.mark.needs_local_tensor
def test_distribute_region_under_local_tensor_mode_positions_every_simulated_rank(fake_world: None) -> None:
    mesh = DeviceMesh("cpu", torch.arange(WORLD))
    tracker = ShardedRNGTracker()
    with LocalTensorMode(WORLD) as mode:
        tracker.manual_seed(SEED)
        local = mode.rank_map(lambda rank: torch.zeros(2, 3))
        with tracker.distribute_region(mesh, [Shard(0)], (8, 3)):
            local.uniform_()
        drawn = {rank: t.clone() for rank, t in local._local_tensors.items()}
        positions = _positions(mode)
    expected, position = _as_real_ranks(SEED, (WORLD,), [Shard(0)], (8, 3), (2, 3))
    for rank in range(WORLD):
        assert torch.equal(drawn[rank], expected[rank])
    assert len({tuple(t.flatten().tolist()) for t in drawn.values()}) == WORLD, "shards must differ"
    assert set(positions.values()) == {position}


@pytest.mark.needs_local_tensor
def test_the_traceable_offsets_under_local_tensor_mode_hold_each_simulated_rank_start(
    installed: ShardedRNGTracker,
) -> None:
    from torch.distributed.tensor import _random

    mesh = DeviceMesh("cpu", torch.arange(WORLD).reshape(MESH_2X2))
    with LocalTensorMode(WORLD), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = distribute_tensor(torch.zeros(8, 8), mesh, [Shard(0), Shard(1)])._spec
        start, end = _random._rng_tracker._compute_rng_offsets(spec)  # type: ignore[union-attr]
    assert isinstance(start, torch.SymInt) and isinstance(start.node, LocalIntNode)
    for rank in range(WORLD):
        want = rng_offsets(MESH_2X2, _coordinate(rank, MESH_2X2), [Shard(0), Shard(1)], (8, 8))
        assert (start.node._local_ints[rank], end) == want


@pytest.mark.needs_local_tensor
def test_manual_seed_under_local_tensor_mode_seeds_each_simulated_rank_with_its_own_value(fake_world: None) -> None:
    tracker = ShardedRNGTracker()
    with LocalTensorMode(WORLD) as mode:
        tracker.manual_seed(torch.SymInt(LocalIntNode({rank: 100 + rank for rank in range(WORLD)})))
        per_rank = _positions(mode)
        tracker.manual_seed(7)
        shared = _positions(mode)
    assert per_rank == {rank: (100 + rank, 0) for rank in range(WORLD)}
    assert shared == dict.fromkeys(range(WORLD), (7, 0))


@pytest.mark.needs_local_tensor
def test_a_bad_per_rank_seed_under_local_tensor_mode_changes_no_rank(fake_world: None) -> None:
    tracker = ShardedRNGTracker()
    with LocalTensorMode(WORLD) as mode:
        tracker.manual_seed(5)
        before = _positions(mode)
        bad = torch.SymInt(LocalIntNode({0: 1, 1: 2, 2: -3, 3: 4}))
        with pytest.raises(InvalidArgumentError, match="seed must be in"):
            tracker.manual_seed(bad)
        assert _positions(mode) == before


@pytest.mark.needs_local_tensor
def test_a_user_generator_under_local_tensor_mode_takes_the_advance_of_a_dtensor_op(
    installed: ShardedRNGTracker,
) -> None:
    mesh = DeviceMesh("cpu", torch.arange(WORLD))
    user = torch.Generator().manual_seed(42)
    with LocalTensorMode(WORLD) as mode, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        installed.manual_seed(42)
        device_before = _positions(mode)
        from_user = distribute_tensor(torch.zeros(8, 3), mesh, [Shard(0)])
        torch.nn.init.uniform_(from_user, 0.0, 1.0, user)
        assert _positions(mode) == device_before, "the device generators must not move for a user generator"
        from_device = distribute_tensor(torch.zeros(8, 3), mesh, [Shard(0)])
        torch.nn.init.uniform_(from_device, 0.0, 1.0)
        user_numbers = {r: t.clone() for r, t in from_user.to_local()._local_tensors.items()}
        device_numbers = {r: t.clone() for r, t in from_device.to_local()._local_tensors.items()}
    assert device_before == dict.fromkeys(range(WORLD), (42, 0))
    for rank in range(WORLD):
        assert torch.equal(user_numbers[rank], device_numbers[rank])
    # The op's advance is charged to the user generator.
    _, end = rng_offsets((WORLD,), (0,), [Shard(0)], (8, 3))
    assert platforms.current().get_seed_offset(generator=user) == (42, end)


@pytest.mark.needs_local_tensor
def test_a_plain_generator_keeps_its_position_through_dtensor_ops_that_hand_it_on_as_a_new_wrapper(
    installed: ShardedRNGTracker,
) -> None:
    """DTensor hands the tracker a new torch.Generator wrapping the user's generator; its position is found."""
    mesh = DeviceMesh("cpu", torch.arange(WORLD))
    user = torch.Generator().manual_seed(42)
    with LocalTensorMode(WORLD), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        installed.manual_seed(42)
        draws: dict[str, list[dict[int, torch.Tensor]]] = {"user": [], "device": []}
        for _ in range(3):  # the second op starts where the first ended, on both
            for source, generator in (("user", user), ("device", None)):
                t = distribute_tensor(torch.zeros(8, 3), mesh, [Shard(0)])
                torch.nn.init.uniform_(t, 0.0, 1.0, generator)
                draws[source].append({r: x.clone() for r, x in t.to_local()._local_tensors.items()})
    _, end = rng_offsets((WORLD,), (0,), [Shard(0)], (8, 3))
    assert platforms.current().get_seed_offset(generator=user) == (42, 3 * end)
    for from_user, from_device in zip(draws["user"], draws["device"]):
        assert all(torch.equal(from_user[r], from_device[r]) for r in range(WORLD))
    assert not torch.equal(draws["user"][0][0], draws["user"][1][0])


@pytest.mark.needs_local_tensor
def test_distribute_region_under_local_tensor_mode_refuses_a_generator_and_changes_nothing(fake_world: None) -> None:
    mesh = DeviceMesh("cpu", torch.arange(WORLD))
    tracker = ShardedRNGTracker()
    with LocalTensorMode(WORLD) as mode:
        tracker.manual_seed(3)
        before = _positions(mode)
        with pytest.raises(InvalidOperationError, match="one generator object cannot stand for every rank"):
            with tracker.distribute_region(mesh, [Shard(0)], (8,), generator=torch.Generator()):
                pytest.fail("the region body must not run")
        assert _positions(mode) == before


# -- the builtin PyTorch raises --------------------------------------------------------------------


def test_the_out_of_mesh_manual_seed_error_is_a_runtime_error(fake_world: None) -> None:
    tracker = ShardedRNGTracker()
    tracker.manual_seed(11)
    before = platforms.current().get_rng_state()
    other_rank_only = DeviceMesh("cpu", [1], _rank=0)  # a sub-mesh without this rank
    with pytest.raises(
        RuntimeError, match="manual_seed requires the current rank to be a part of the device mesh"
    ) as info:
        tracker.manual_seed(12, other_rank_only)
    assert isinstance(info.value, InvalidOperationError) and info.value.reason == "mesh"
    assert not isinstance(info.value, ValueError), "one builtin base: a RuntimeError, as DTensor's manual_seed"
    assert torch.equal(platforms.current().get_rng_state(), before)


def test_a_region_on_a_mesh_without_this_rank_is_a_runtime_error_and_changes_nothing(fake_world: None) -> None:
    before = platforms.current().get_rng_state()
    with pytest.raises(RuntimeError, match="not part of the device mesh"):
        with ShardedRNGTracker().distribute_region(DeviceMesh("cpu", [1], _rank=0), [Shard(0)], (8,)):
            pytest.fail("the region body must not run")
    assert torch.equal(platforms.current().get_rng_state(), before)


# -- torch.compile ---------------------------------------------------------------------------------


def _forked_dropout(tracker: RNGStatesTracker) -> Any:
    def fn(x: torch.Tensor) -> torch.Tensor:
        with tracker.fork():
            y = torch.nn.functional.dropout(x, 0.5, training=True)
        return y + torch.rand_like(x)  # and a draw outside the fork, from the default state

    return fn


def _two_calls(fn: Any, tracker: RNGStatesTracker) -> list[torch.Tensor]:
    torch.manual_seed(7)
    tracker.reset()
    tracker.add("model-parallel-rng", 1234)
    x = torch.ones(64)
    return [fn(x), fn(x), torch.get_rng_state(), tracker.get_states()["model-parallel-rng"]]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_function_with_a_fork_gives_eager_numbers(backend: str) -> None:
    tracker = RNGStatesTracker()
    fn = _forked_dropout(tracker)
    eager = _two_calls(fn, tracker)
    torch._dynamo.reset()
    compiled = _two_calls(torch.compile(fn, backend=backend), tracker)
    for what, want, got in zip(("first call", "second call", "default state", "stream state"), eager, compiled):
        assert torch.equal(want, got), f"{what} differs from eager under backend {backend!r}"


@pytest.mark.slow
def test_an_inductor_compiled_function_with_a_fork_gives_eager_numbers_where_torch_does() -> None:
    import torch._inductor.config as inductor_config

    tracker = RNGStatesTracker()
    fn = _forked_dropout(tracker)
    eager = _two_calls(fn, tracker)
    torch._dynamo.reset()
    with inductor_config.patch(fallback_random=True):  # where torch's own compiled numbers equal eager's
        compiled = _two_calls(torch.compile(fn, backend="inductor"), tracker)
    for want, got in zip(eager, compiled):
        assert torch.equal(want, got)


def test_fullgraph_cannot_trace_a_fork_but_a_fullgraph_body_runs_inside_one() -> None:
    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 99)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(_forked_dropout(tracker), backend="eager", fullgraph=True)(torch.ones(8))
    assert tracker.active_stream is None

    def body(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x, 0.5, training=True)

    compiled = torch.compile(body, backend="aot_eager", fullgraph=True)
    saved = tracker.get_states()
    with tracker.fork():
        want = body(torch.ones(64))
    tracker.set_states(saved)
    with tracker.fork():
        got = compiled(torch.ones(64))
    assert torch.equal(want, got)


@pytest.mark.parametrize("platform_name", ["cpu", "sim"])
def test_a_dtensor_op_given_the_devices_own_generator_keeps_its_advance(platform_name: str) -> None:
    """DTensor hands the tracker a new wrapper of an explicitly passed default generator: the advance is kept."""
    from types import SimpleNamespace

    from hyperrng.sharding.tracker import _dtensor_adapter

    spec = SimpleNamespace(mesh=MeshInfo((2,), (0,)), placements=[Shard(0)], shape=(16,))
    with platforms.use(platform_name) as p:
        tracker = ShardedRNGTracker()
        adapter = _dtensor_adapter(tracker)
        tracker.manual_seed(42)
        with adapter._distribute_region(spec, None):
            pass
        implicit = p.get_seed_offset()
        tracker.manual_seed(42)
        explicit = []
        for _ in range(3):
            with adapter._distribute_region(spec, p.default_generator()):
                pass
            explicit.append(p.get_seed_offset())
    assert explicit[0] == implicit
    assert explicit == [(42, implicit[1] * k) for k in (1, 2, 3)]


def test_adapters_share_one_class_and_each_serves_its_own_tracker() -> None:
    """Portable mode installs an adapter at every outermost entry while DTensor is loaded: its class is made
    once (a class statement per entry cost more than the rest of entering), each object serves its tracker."""
    from hyperrng.sharding.tracker import _dtensor_adapter

    first, second = ShardedRNGTracker(), ShardedRNGTracker()
    second.distribute_region_enabled = False
    a, b = _dtensor_adapter(first), _dtensor_adapter(second)
    assert type(a) is type(b)
    assert a.distribute_region_enabled and not b.distribute_region_enabled
    a.distribute_region_enabled = False
    assert not a.distribute_region_enabled
    assert _dtensor_adapter(first).distribute_region_enabled  # a new adapter starts enabled
