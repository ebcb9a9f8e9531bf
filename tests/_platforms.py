"""The platforms that platform-neutral tests run on, and a fixture factory over them."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

import platforms

__all__ = ["NoGeneratorPlatform", "cuda_on_sim", "PLATFORMS", "WITH_PLUGIN", "use_each", "fresh_tracker_on_cpu"]


class NoGeneratorPlatform(platforms.SimulatedPlatform):
    """A plug-in that exposes no generator object: callers must go through get/set_rng_state."""

    name = "nogen"

    def default_generator(self, index: int | None = None) -> None:
        return None


def cuda_on_sim() -> platforms.Platform:
    """The CUDA implementation driven by a simulated device module."""
    return platforms.CUDAPlatform(module=platforms.SimulatedDeviceModule(device_type="cuda"))


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
    from hyperrng.tracker import get_rng_tracker

    get_rng_tracker().reset()
    with platforms.use(platforms.CPUPlatform()):
        yield
    get_rng_tracker().reset()
