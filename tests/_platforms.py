"""The platforms that platform-neutral tests run on, and a fixture factory over them."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch
from hyperrng.platforms.mix import combine64
from hyperrng.platforms.validate import round_up_offset

__all__ = [
    "BarePlatform",
    "NoGeneratorPlatform",
    "cuda_on_sim",
    "cuda_platform",
    "draw",
    "PLATFORMS",
    "WITH_PLUGIN",
    "use_each",
    "fresh_tracker_on_cpu",
]

_EMULATED_DRAW = 0x54455354  # "TEST": the stand-in's draws, apart from every other use of the mixer


class BarePlatform(platforms.Platform):
    """A plug-in that implements none of the required methods (device_count, _read_state, _write_state)."""

    name = "bare"


class NoGeneratorPlatform(platforms.SimulatedPlatform):
    """A plug-in that exposes no generator object: callers must go through get/set_rng_state."""

    name = "nogen"

    def default_generator(self, index: int | None = None) -> None:
        return None


@pytest.fixture(name="cuda")
def cuda_platform() -> Iterator[platforms.Platform]:
    """The CUDA platform, current; the device's generator as it was afterwards (for ``cuda``-marked tests)."""
    with platforms.use(platforms.CUDAPlatform()) as platform:
        saved = torch.cuda.get_rng_state()
        try:
            yield platform
        finally:
            torch.cuda.set_rng_state(saved)


def cuda_on_sim() -> platforms.Platform:
    """The CUDA implementation driven by a simulated device module (generator paths only: no tensors)."""
    return platforms.CUDAPlatform(module=platforms.SimulatedDeviceModule(device_type="cuda"))


def draw(platform: platforms.Platform, n: int = 8, generator: Any = None, index: int | None = None) -> torch.Tensor:
    """``n`` numbers from device ``index``'s generator (default: the current device's, or ``generator``), on the host.

    Where the platform's device has tensors (the CPU, the simulated device) this is
    torch's own ``torch.rand`` on that device. A stand-in for ``torch.cuda`` has no
    tensors, and torch ops take no simulated generator object: there the draw is
    emulated as a Philox device makes it, a function of the generator's (seed, offset)
    that advances the offset by ``n`` rounded up to 4.
    """
    real_device = platform.device_type in ("cpu", platforms.SIM_DEVICE_TYPE)
    if real_device and (generator is None or platform.device_type == "cpu"):
        return torch.rand(n, device=platform.device(index), generator=generator).cpu()
    if generator is None and index is not None:
        generator = platform.default_generator(index)
    seed, offset = platform.get_seed_offset(generator=generator)
    out = torch.rand(n, generator=torch.Generator().manual_seed(combine64(_EMULATED_DRAW, seed, offset)))
    platform.set_seed_offset(seed, offset + round_up_offset(n), generator=generator)
    return out


PLATFORMS: dict[str, Callable[[], platforms.Platform]] = {
    "cpu": platforms.CPUPlatform,
    "sim": platforms.SimulatedPlatform,
    "cuda-on-sim": cuda_on_sim,
}
WITH_PLUGIN: dict[str, Callable[[], platforms.Platform]] = {
    **PLATFORMS,
    "plugin-without-generator": NoGeneratorPlatform,
}


def use_each(table: Mapping[str, Callable[[], platforms.Platform]]) -> Any:
    """A ``platform`` fixture running the test once on each platform of ``table``, made current."""

    @pytest.fixture(params=list(table))
    def platform(request: pytest.FixtureRequest) -> Iterator[platforms.Platform]:
        with platforms.use(table[request.param]()) as chosen:
            yield chosen

    return platform


@pytest.fixture(autouse=True)
def fresh_tracker_on_cpu() -> Iterator[None]:
    """Autouse where imported: the CPU platform unless a test asks for ``platform``; an empty global tracker."""
    from hyperrng.streams.tracker import get_rng_tracker

    get_rng_tracker().reset()
    with platforms.use(platforms.CPUPlatform()):
        yield
    get_rng_tracker().reset()
