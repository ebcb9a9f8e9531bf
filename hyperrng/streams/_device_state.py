"""Save and restore the host and device RNG states, as forks, ``fork_rng`` and recompute do.

Each device's snapshot goes through :meth:`platforms.Platform._state_io`, the platform's
fastest exact way (no validation of states it read itself). Each target names the
generator it covers as :mod:`hyperrng._guard.exclusive` holds it: torch's CPU generator is
``("cpu", 0)``, device ``i`` of the platform is ``(platform.device_type, i)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hyperrng.platforms import Platform

__all__ = ["HOST", "Target", "current_device_key", "device_keys", "host_and_devices"]

Target = tuple[Callable[[], Any], Callable[[Any], Any], tuple[str, int]]
"""(read, write, (device type, device index)) for one generator's state."""

HOST = ("cpu", 0)
"""How :mod:`hyperrng._guard.exclusive` names torch's CPU generator."""


def host_and_devices(platform: Platform, indices: Sequence[int] | None = None) -> list[Target]:
    """Targets for torch's CPU generator and devices ``indices`` (default: all).

    Where the platform's device is the host, its one state (position cursor included)
    covers torch's CPU generator, so it is the only target.
    """
    if platform.device_type == "cpu":
        io = platform._state_io(0)
        return [(io.read, io.write, (platform.device_type, 0))]
    host = torch.default_generator
    chosen = range(platform.device_count()) if indices is None else indices
    devices = [(*platform._state_io(i)[:2], (platform.device_type, i)) for i in chosen]
    return [(host.get_state, host.set_state, HOST), *devices]  # type: ignore[list-item]


def current_device_key(platform: Platform) -> tuple[str, int]:
    """How :mod:`hyperrng._guard.exclusive` names ``platform``'s current device generator."""
    return platform.device_type, platform.current_device()


def device_keys(platform: Platform, indices: Sequence[int] | None = None) -> list[tuple[str, int]]:
    """How :mod:`hyperrng._guard.exclusive` names torch's CPU generator and devices ``indices`` (default: all)
    of ``platform``: the generators that seeding or restoring every state changes."""
    chosen = range(platform.device_count()) if indices is None else indices
    devices = [(platform.device_type, i) for i in chosen]
    return devices if platform.device_type == "cpu" else [HOST, *devices]
