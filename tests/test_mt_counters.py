"""The CPU platform reads MT19937's draw counters in place: found safely, equal to the copy, never a change."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import hyperrng.platforms.cpu as cpu
import pytest
import torch
from hyperrng.platforms import CPUPlatform, CursorGenerator
from hyperrng.platforms._mt_counters import DrawCounters, locate


@pytest.fixture
def copy_only() -> Iterator[None]:
    """Position reads of the default generator through a copy of its state, as where no counters are found."""
    saved = cpu._default_counters
    cpu._default_counters = None
    try:
        yield
    finally:
        cpu._default_counters = saved


def test_the_default_generators_counters_are_found_on_this_torch() -> None:
    # A layout change in a future torch shows here first (position reads then fall back to a copy).
    assert cpu.live_counters_in_use()


def test_locating_the_counters_changes_nothing_of_the_generator() -> None:
    gen = torch.default_generator
    gen.manual_seed(99)
    torch.rand(5)
    before, seed = gen.get_state(), gen.initial_seed()
    counters = locate(gen)
    assert counters is not None
    assert torch.equal(gen.get_state(), before) and gen.initial_seed() == seed
    assert torch.equal(torch.rand(3), (torch.set_rng_state(before), torch.rand(3))[1])


def test_counters_are_found_for_a_generator_of_ones_own_too() -> None:
    gen = CursorGenerator()
    counters = locate(gen)
    assert counters is not None and not counters.drawn()
    torch.rand(2, generator=gen)
    assert counters.drawn() and counters.agrees_with(gen)


@pytest.mark.parametrize("context", ["meta device", "fake tensors", "portable mode"])
def test_the_counters_are_found_from_inside_a_default_device_a_dispatch_mode_or_portable_mode(context: str) -> None:
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    import hyperrng

    contexts: dict[str, Callable[[], contextlib.AbstractContextManager[object]]] = {
        "meta device": lambda: torch.device("meta"),
        "fake tensors": FakeTensorMode,
        "portable mode": lambda: hyperrng.portable_random(5),  # refuses random ops it has no kernel for
    }
    before = torch.get_rng_state()
    with contexts[context]():
        counters = locate(torch.default_generator)
    assert counters is not None and counters.agrees_with(torch.default_generator)
    assert torch.equal(torch.get_rng_state(), before)


def test_nothing_is_located_on_a_generator_of_another_device_type() -> None:
    class NotCPU:
        device = torch.device("meta")

    assert locate(NotCPU()) is None  # type: ignore[arg-type]


# Every way torch's CPU generator moves or is replaced, applied to the default generator.
_STEPS: dict[str, Callable[[], object]] = {
    "one float": lambda: torch.rand(1),
    "a block's worth": lambda: torch.rand(624),
    "past a block": lambda: torch.rand(1000, dtype=torch.float64),
    "normal (caches a sample)": lambda: torch.randn(1),
    "normal, many": lambda: torch.randn(333),
    "randint": lambda: torch.randint(0, 10, (7,)),
    "bernoulli": lambda: torch.bernoulli(torch.full((9,), 0.5)),
    "randperm": lambda: torch.randperm(50),
    "dropout": lambda: torch.nn.functional.dropout(torch.ones(64), 0.5),
    "torch.manual_seed": lambda: torch.manual_seed(5),
    "a 64-bit seed through the platform": lambda: CPUPlatform().manual_seed(2**40 + 3),
    "a position": lambda: CPUPlatform().set_seed_offset(11, 64),
    "set_rng_state to a fresh seed": lambda: torch.set_rng_state(torch.Generator().manual_seed(3).get_state()),
    "set_rng_state to a drawn state": lambda: torch.set_rng_state(_drawn_state()),
}


def _drawn_state() -> torch.Tensor:
    gen = torch.Generator().manual_seed(4)
    torch.rand(10, generator=gen)
    return gen.get_state()


@pytest.mark.parametrize("step", list(_STEPS))
def test_in_place_counters_agree_with_the_copy_after_every_kind_of_step(step: str) -> None:
    counters = cpu._locate_default_counters()
    assert isinstance(counters, DrawCounters)
    gen = torch.default_generator
    CPUPlatform().set_seed_offset(1234, 8)
    assert not counters.drawn() and counters.agrees_with(gen)
    _STEPS[step]()
    assert counters.agrees_with(gen)
    state = gen.get_state().numpy()
    drawn_in_copy = int.from_bytes(state[8:12].tobytes(), "little") != 1 or state[16:24].any()
    assert counters.drawn() == drawn_in_copy


def _positions_after_each_step() -> list[tuple[int, int]]:
    platform = CPUPlatform()
    seen = []
    for step in _STEPS.values():
        platform.set_seed_offset(1234, 8)
        seen.append(platform.get_seed_offset())
        step()
        seen.append(platform.get_seed_offset())
    return seen


def test_positions_read_in_place_equal_those_read_from_a_copy(copy_only: None) -> None:
    from_copy = _positions_after_each_step()
    cpu._default_counters = cpu._UNLOCATED
    in_place = _positions_after_each_step()
    assert cpu.live_counters_in_use()
    assert in_place == from_copy
    assert (1234, 8) in in_place and (1234, 12) in in_place  # both answers occur


def test_a_sharded_region_without_in_place_counters_draws_the_same(copy_only: None) -> None:
    from hyperrng.sharded import MeshInfo, ShardedRNGTracker

    def run() -> tuple[torch.Tensor, tuple[int, int]]:
        tracker = ShardedRNGTracker()
        tracker.manual_seed(7)
        draws = []
        for coordinate in range(4):
            with tracker.distribute_region(MeshInfo((4,), (coordinate,)), [_shard0()], (16,)):
                draws.append(torch.rand(4))
            draws.append(torch.rand(2))  # between regions: the next position must not replay it
        return torch.cat(draws), tracker.platform.get_seed_offset()

    from_copy = run()
    cpu._default_counters = cpu._UNLOCATED
    in_place = run()
    assert torch.equal(in_place[0], from_copy[0]) and in_place[1] == from_copy[1]


def _shard0() -> object:
    from torch.distributed.tensor import Shard

    return Shard(0)
