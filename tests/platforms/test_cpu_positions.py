"""The CPU's positions as users rely on them: any torch.Generator keeps its position, torch's own
tools replay within a process, hyperrng's checkpoints resume in a fresh one, nothing crashes."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch
from hyperrng.platforms import ArgumentTypeError, CPUPlatform, InvalidArgumentError
from torch.distributed.tensor import Replicate, Shard

from hyperrng.sharding.tracker import MeshInfo, ShardedRNGTracker
from tests._dist import run_ranks


@pytest.fixture(autouse=True)
def on_the_cpu() -> Any:
    with platforms.use(CPUPlatform()) as cpu:
        yield cpu


# -- any CPU torch.Generator ----------------------------------------------------------------------


class Slotted(torch.Generator):
    __slots__ = ()


class EmptyState(torch.Generator):
    def get_state(self) -> torch.Tensor:  # type: ignore[override]
        return torch.empty(0, dtype=torch.uint8)


@pytest.mark.parametrize("kind", [torch.Generator, Slotted, EmptyState])
def test_every_kind_of_cpu_generator_keeps_the_position_it_is_given(kind: type[torch.Generator]) -> None:
    cpu = CPUPlatform()
    gen = kind()
    cpu.set_seed_offset(42, 8, generator=gen)
    assert cpu.get_seed_offset(generator=gen) == (42, 8)
    tracker = ShardedRNGTracker()
    with tracker.distribute_region(MeshInfo((2,), (1,)), [Shard(0)], (8,), generator=gen):
        torch.rand(4, generator=gen)
    assert cpu.get_seed_offset(generator=gen) == (42, 16)


def test_an_object_that_only_looks_like_a_generator_is_a_typed_error_and_changes_nothing() -> None:
    class LookAlike:
        device = torch.device("cpu")

    cpu = CPUPlatform()
    cpu.set_seed_offset(3, 4)
    before = cpu.get_rng_state()
    for call in (
        lambda: cpu.get_seed_offset(generator=LookAlike()),  # type: ignore[arg-type]
        lambda: cpu.set_seed_offset(1, 0, generator=LookAlike()),  # type: ignore[arg-type]
    ):
        with pytest.raises(ArgumentTypeError, match="must be a torch.Generator"):
            call()
    assert torch.equal(cpu.get_rng_state(), before)


def test_a_generator_whose_device_cannot_be_read_is_a_typed_error_and_changes_nothing() -> None:
    class Broken(torch.Generator):
        @property
        def device(self) -> torch.device:  # type: ignore[override]
            return torch.device("nosuchdevice", 0)  # torch raises RuntimeError

    class LookAlike:  # the whole generator API, and a device that raises something else
        get_state = set_state = manual_seed = initial_seed = staticmethod(lambda *a: None)

        @property
        def device(self) -> torch.device:
            raise ZeroDivisionError("no device")

    cpu = CPUPlatform()
    cpu.set_seed_offset(3, 4)
    before = cpu.get_rng_state()
    for gen in (Broken(), LookAlike()):
        for call in (
            lambda g=gen: cpu.get_seed_offset(generator=g),
            lambda g=gen: cpu.set_seed_offset(1, 0, generator=g),
            lambda g=gen: ShardedRNGTracker().distribute_region(MeshInfo((2,), (1,)), [Shard(0)], (8,), generator=g),
        ):
            with pytest.raises(InvalidArgumentError, match="cannot be read"):
                with call():
                    pass
            assert torch.equal(cpu.get_rng_state(), before)


def test_a_device_generator_whose_state_is_garbage_is_an_invalid_state_error() -> None:
    class Garbage(platforms.SimulatedGenerator):
        def get_state(self) -> torch.Tensor:
            return torch.empty(0, dtype=torch.uint8)

    device = platforms.CUDAPlatform(module=platforms.SimulatedDeviceModule(device_type="cuda"))
    with pytest.raises(InvalidArgumentError, match="get_state\\(\\) returned a torch.uint8 tensor of 0 elements"):
        device.get_seed_offset(generator=Garbage(0, device_type="cuda"))


def test_draw_must_be_a_bool_and_nothing_changes_otherwise() -> None:
    cpu = CPUPlatform()
    cpu.set_seed_offset(3, 4)
    before = cpu.get_rng_state()
    with pytest.raises(ArgumentTypeError, match="draw must be a bool"):
        cpu.set_seed_offset(3, 8, draw=1)  # type: ignore[arg-type]
    assert torch.equal(cpu.get_rng_state(), before)


# -- plain draws and positioned draws ---------------------------------------------------------------


def test_plain_draws_between_two_regions_are_not_replayed_by_the_second() -> None:
    tracker = ShardedRNGTracker()
    tracker.manual_seed(1234)
    mesh = MeshInfo((2,), (0,))  # shard 0 starts at the region's base: where the plain draws were made
    with tracker.distribute_region(mesh, [Shard(0)], (8,)):
        first = torch.rand(4)
    plain = torch.rand(4)
    with tracker.distribute_region(mesh, [Shard(0)], (8,)):
        second = torch.rand(4)
    assert not torch.equal(second, plain) and not torch.equal(second, first)


def test_a_region_on_an_empty_tensor_leaves_the_plain_draws_going_on() -> None:
    tracker = ShardedRNGTracker()
    tracker.manual_seed(99)
    torch.rand(3)
    expected = torch.rand(5)
    tracker.manual_seed(99)
    torch.rand(3)
    with tracker.distribute_region(MeshInfo((2,), (0,)), [Shard(0)], (0,)):
        pass
    assert torch.equal(torch.rand(5), expected)


# -- torch's own tools, within a process ------------------------------------------------------------


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_torch_utils_checkpoint_replays_a_regions_dropout(use_reentrant: bool) -> None:
    import torch.utils.checkpoint

    tracker = ShardedRNGTracker()
    tracker.manual_seed(1234)
    mesh = MeshInfo((2,), (1,))
    with tracker.distribute_region(mesh, [Shard(0)], (128,)):
        pass  # away from offset 0, where a lost position would go unnoticed
    masks: list[torch.Tensor] = []

    def block(x: torch.Tensor) -> torch.Tensor:
        with tracker.distribute_region(mesh, [Shard(0)], (128,)):
            out = torch.nn.functional.dropout(x, 0.5)
        masks.append(out.detach() != 0)  # the recompute may stop before this line (non-reentrant early stop)
        return out

    x = torch.ones(64, requires_grad=True)
    torch.utils.checkpoint.checkpoint(block, x, use_reentrant=use_reentrant).sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad != 0, masks[0]), "the gradient follows the recomputed mask: it must be the forward's"
    assert all(torch.equal(mask, masks[0]) for mask in masks)


def _user_generator_like_the_default(rank: int, world_size: int) -> dict[str, Any]:
    """PyTorch's test_init_with_user_generator, on a CPU mesh with our tracker installed."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    tracker = ShardedRNGTracker()
    previous = tracker.install_dtensor()
    equal: list[bool] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(42)
            rng = torch.Generator().manual_seed(42)
            t1 = torch.distributed.tensor.empty((8, 3), device_mesh=mesh, placements=[Shard(0)])
            t2 = torch.distributed.tensor.empty((8, 3), device_mesh=mesh, placements=[Shard(0)])
            for _ in range(2):  # the second time, rng must have advanced like the default generator
                torch.nn.init.uniform_(t1, 0.0, 1.0)
                torch.nn.init.uniform_(t2, 0.0, 1.0, rng)
                equal.append(torch.equal(t1.full_tensor(), t2.full_tensor()))
            torch.manual_seed(55)
            rng.manual_seed(55)
            torch.nn.init.uniform_(t1, 0.0, 1.0)
            torch.nn.init.uniform_(t2, 0.0, 1.0, rng)
            equal.append(torch.equal(t1.full_tensor(), t2.full_tensor()))
    finally:
        tracker.uninstall_dtensor(previous)
    return {"equal": equal, "local": t1.to_local().flatten().tolist()}


@pytest.mark.multiproc
@pytest.mark.needs_user_generator
def test_a_plain_generator_passed_to_dtensor_ops_advances_like_the_default_generator() -> None:
    results = run_ranks(_user_generator_like_the_default, 2)
    for result in results:
        assert result["equal"] == [True, True, True]
    assert results[0]["local"] != results[1]["local"], "shards must differ"


# -- hyperrng's checkpoints, in a fresh process ---------------------------------------------------

_RESUME = """
import sys, torch
import hyperrng.platforms as platforms
from torch.distributed.tensor import Shard
from hyperrng.sharding.tracker import MeshInfo, ShardedRNGTracker

cpu = platforms.CPUPlatform()
platforms.set_current(cpu)
cpu.set_rng_state(torch.load(sys.argv[1], weights_only=True))
position = cpu.get_seed_offset()
plain = torch.rand(3)
with ShardedRNGTracker().distribute_region(MeshInfo((2,), (1,)), [Shard(0)], (8,)):
    shard = torch.rand(4)
torch.save({"position": position, "plain": plain, "shard": shard}, sys.argv[2])
"""


def test_a_checkpoint_resumes_exactly_in_a_fresh_process(tmp_path: Any) -> None:
    cpu = CPUPlatform()
    tracker = ShardedRNGTracker()
    tracker.manual_seed(2**40 + 7)
    for _ in range(3):
        with tracker.distribute_region(MeshInfo((2,), (0,)), [Shard(0)], (8,)):
            torch.rand(4)
    position = cpu.get_seed_offset()
    torch.save(cpu.get_rng_state(), tmp_path / "state.pt")
    plain = torch.rand(3)
    with tracker.distribute_region(MeshInfo((2,), (1,)), [Shard(0)], (8,)):
        shard = torch.rand(4)
    subprocess.run(
        [sys.executable, "-c", _RESUME, str(tmp_path / "state.pt"), str(tmp_path / "out.pt")],
        check=True,
        timeout=600,
    )
    resumed = torch.load(tmp_path / "out.pt", weights_only=True)
    assert resumed["position"] == position == (2**40 + 7, 24)
    assert torch.equal(resumed["plain"], plain) and torch.equal(resumed["shard"], shard)


# -- bounded and thread-safe ------------------------------------------------------------------------


def test_the_position_table_stays_consistent_under_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    from hyperrng.platforms import cpu as cpu_module

    # A smaller table, the same code: the 80,000 positions below rotate it about five times, and
    # 2**14 entries are more than the other threads can enter while one waits for the GIL.
    monkeypatch.setattr(cpu_module, "POSITIONS_KEPT", 2**14)
    cpu = CPUPlatform()
    errors: list[str] = []
    start = threading.Barrier(4)

    def work(seed: int) -> None:
        gen = torch.Generator()
        start.wait()
        for k in range(20_000):
            cpu.set_seed_offset(seed, 4 * k, generator=gen, draw=bool(k % 2))
            if cpu.get_seed_offset(generator=gen) != (seed, 4 * k):
                errors.append(f"thread of seed {seed} lost position {4 * k}")

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(cpu_module._young) + len(cpu_module._old) < 2 * cpu_module.POSITIONS_KEPT


_MEMORY_OVER_NEW_SHAPES = """
import tracemalloc
from torch.distributed.tensor import Replicate, Shard
from hyperrng.platforms import cpu
from hyperrng.sharding.tracker import OFFSETS_KEPT, ShardedRNGTracker

tracker = ShardedRNGTracker()
placements = (Shard(0), Replicate())


def regions(first, count):
    for n in range(first, first + count):
        with tracker.distribute_region(((2, 2), (1, 0)), placements, (n, 8)):
            pass


cpu.POSITIONS_KEPT = 4096  # the same code with a smaller table: it rotates every 2048 regions
tracemalloc.start()  # before the caches fill, so that what they drop is counted as freed
regions(1, 2 * (cpu.POSITIONS_KEPT + OFFSETS_KEPT))  # both caches full, every entry allocated while traced
peaks = []
for first in (10**6, 2 * 10**6):  # two windows of two rotations each: each holds the table's highest point
    tracemalloc.reset_peak()
    regions(first, cpu.POSITIONS_KEPT)
    peaks.append(tracemalloc.get_traced_memory()[1])
print(peaks[1] - peaks[0], len(tracker._offsets) == OFFSETS_KEPT)
"""


def test_the_offsets_cache_is_bounded_and_memory_stays_flat_over_new_shapes() -> None:
    # In a fresh process: the positions table is process-wide, and storage that earlier tests made
    # it allocate before tracemalloc started would not count as freed when churn reallocates it.
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_OVER_NEW_SHAPES], check=True, timeout=600, capture_output=True, text=True
    )
    grown, full = out.stdout.split()
    assert full == "True", "the offsets cache must hold exactly OFFSETS_KEPT entries"
    assert int(grown) < 256 * 1024, f"the highest memory grew by {grown} bytes over 4096 regions with new shapes"


def test_a_tuple_mesh_is_cached_by_its_ints() -> None:
    tracker = ShardedRNGTracker()
    placements = [Shard(0), Replicate()]
    tracker.offsets(((2, 2), (1, 0)), placements, (8, 6))
    tracker.offsets(([2, 2], [1, 0]), placements, (8, 6))  # equal ints in lists: the same entry
    assert len(tracker._offsets) == 1
    with pytest.raises(ArgumentTypeError):
        tracker.offsets(((2, 2), (True, 0)), placements, (8, 6))  # equal by ==, but a bool


def test_a_compiled_fork_with_a_full_position_table_draws_the_eager_numbers() -> None:
    # Tracing into the table made torch.compile turn each of its entries into a guard: this
    # test took about a minute before lookups under compilation ran outside the graph.
    from hyperrng.platforms.cpu import POSITIONS_KEPT

    import hyperrng

    cpu = CPUPlatform()
    for block in range(1, POSITIONS_KEPT + 1):  # fill the table
        cpu.set_seed_offset(5, 4 * block)
    tracker = hyperrng.RNGStatesTracker()
    tracker.add("s", 3)

    def fn(x: torch.Tensor) -> torch.Tensor:
        with tracker.fork("s"):
            y = torch.nn.functional.dropout(x, 0.5)
        return y * 2

    before = tracker.get_states()
    eager = fn(torch.ones(64))
    tracker.set_states(before)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager")(torch.ones(64))
    assert torch.equal(compiled, eager)
