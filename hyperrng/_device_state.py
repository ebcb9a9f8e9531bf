"""Save and restore the host and device RNG states, as forks, ``fork_rng`` and recompute do.

Each device's snapshot goes through :meth:`platforms.Platform.state_io`, the platform's
fastest exact way (no validation of states it read itself).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hyperrng.platforms import Platform

__all__ = ["ReadWrite", "host_and_devices"]

ReadWrite = tuple[Callable[[], Any], Callable[[Any], Any]]
"""A (read, write) pair for one generator's state."""


def host_and_devices(platform: Platform, indices: Sequence[int] | None = None) -> list[ReadWrite]:
    """(read, write) pairs for torch's CPU generator and devices ``indices`` (default: all).

    Where the platform's device is the host, its one state (position cursor included)
    covers torch's CPU generator, so it is the only pair.
    """
    if platform.is_host:
        io = platform.state_io(0)
        return [(io.read, io.write)]
    host = torch.default_generator
    chosen = range(platform.device_count()) if indices is None else indices
    return [(host.get_state, host.set_state)] + [platform.state_io(i)[:2] for i in chosen]
