"""fork_rng: the CPU and the current platform's devices come back as they were, on any platform."""

from __future__ import annotations

from collections.abc import Iterator

import hyperrng.platforms as platforms
import pytest
import torch

from hyperrng.errors import ArgumentTypeError, HyperRNGError, InvalidArgumentError
from hyperrng.streams.fork import fork_rng
from tests._platforms import WITH_PLUGIN, use_each

PLATFORMS = WITH_PLUGIN
ACCELERATORS = ["sim", "cuda-on-sim", "plugin-without-generator"]


platform = use_each(PLATFORMS)


@pytest.fixture(params=ACCELERATORS)
def accelerator(request: pytest.FixtureRequest) -> Iterator[platforms.Platform]:
    with platforms.use(PLATFORMS[request.param]()) as chosen:
        yield chosen


def scramble(platform: platforms.Platform) -> None:
    """Advance the CPU generator and every device's generator."""
    torch.rand(16)
    for index in range(platform.device_count()):
        platform.manual_seed(1000 + index, index)


def snapshot(platform: platforms.Platform) -> list[list[int]]:
    return [torch.get_rng_state().tolist()] + [
        platform.get_rng_state(i).tolist() for i in range(platform.device_count())
    ]


def test_the_cpu_and_every_device_come_back_by_default(platform: platforms.Platform) -> None:
    before = snapshot(platform)
    with fork_rng():
        scramble(platform)
    assert snapshot(platform) == before


def test_states_come_back_when_the_block_raises(platform: platforms.Platform) -> None:
    before = snapshot(platform)
    with pytest.raises(RuntimeError, match="raised inside the block"), fork_rng():
        scramble(platform)
        raise RuntimeError("raised inside the block")
    assert snapshot(platform) == before


def test_an_empty_device_list_forks_only_the_cpu(accelerator: platforms.Platform) -> None:
    before = snapshot(accelerator)
    with fork_rng(devices=[]):
        scramble(accelerator)
    after = snapshot(accelerator)
    assert after[0] == before[0]
    assert all(a != b for a, b in zip(after[1:], before[1:]))


def test_only_the_chosen_devices_come_back(accelerator: platforms.Platform) -> None:
    before = snapshot(accelerator)
    with fork_rng(devices=[1, 1]):
        scramble(accelerator)
    after = snapshot(accelerator)
    assert after[0] == before[0] and after[2] == before[2]
    assert after[1] != before[1]


def test_disabled_forks_nothing(platform: platforms.Platform) -> None:
    before = snapshot(platform)
    with fork_rng(enabled=False):
        scramble(platform)
    assert snapshot(platform) != before


def test_draws_after_the_fork_continue_the_outer_sequence() -> None:
    with platforms.use(platforms.CPUPlatform()):
        torch.manual_seed(3)
        expected = [torch.rand(4), torch.rand(4)]
        torch.manual_seed(3)
        first = torch.rand(4)
        with fork_rng():
            torch.rand(100)
        assert torch.equal(first, expected[0]) and torch.equal(torch.rand(4), expected[1])


def test_device_type_may_name_the_current_platform(accelerator: platforms.Platform) -> None:
    before = snapshot(accelerator)
    for name in (accelerator.device_type, accelerator.name):
        with fork_rng(device_type=name):
            scramble(accelerator)
        assert snapshot(accelerator) == before


def test_another_device_type_is_refused_and_changes_nothing(platform: platforms.Platform) -> None:
    before = snapshot(platform)
    with pytest.raises(InvalidArgumentError, match="platforms.use") as info:
        fork_rng(device_type="xpu")
    assert isinstance(info.value, HyperRNGError) and "current platform is" in str(info.value)
    assert snapshot(platform) == before


@pytest.mark.parametrize(
    ("devices", "error"),
    [
        ([2], InvalidArgumentError),
        ([-1], InvalidArgumentError),
        ([True], ArgumentTypeError),
        (["0"], ArgumentTypeError),
        ([0, 5], InvalidArgumentError),
    ],
)
def test_a_bad_device_index_is_refused_and_changes_nothing(
    accelerator: platforms.Platform, devices: list[object], error: type[Exception]
) -> None:
    before = snapshot(accelerator)
    with pytest.raises(error, match="device index|must be an int"):
        fork_rng(devices=devices)  # type: ignore[arg-type]
    assert snapshot(accelerator) == before


def test_on_the_cpu_platform_device_zero_is_the_cpu() -> None:
    with platforms.use(platforms.CPUPlatform()):
        context = fork_rng(devices=[0])
        before = torch.get_rng_state()
        with context:
            torch.rand(8)
        assert torch.equal(torch.get_rng_state(), before)


def test_devices_that_are_not_an_iterable_are_refused() -> None:
    from hyperrng.errors import ArgumentTypeError

    with pytest.raises(ArgumentTypeError, match="devices must be an iterable of device indices"):
        fork_rng(devices=0)  # type: ignore[arg-type]
