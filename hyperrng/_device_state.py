"""Fast, exact reads and writes of a device's whole RNG state, chosen once per platform.

Forks, ``fork_rng`` and recompute copy states they read themselves, many times a step.
On a counter-based device whose generator is exposed, the generator's own
``get_state``/``set_state`` *are* the whole state and cost least; elsewhere (the CPU,
whose state carries its position cursor, or a platform exposing no generator) the
platform's ``get_rng_state``/``set_rng_state`` are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from platforms import Platform

__all__ = ["StateIO", "state_io", "host_and_devices"]

StateIO = tuple[Callable[[], Any], Callable[[Any], Any]]
"""A (read, write) pair for one device's RNG state."""


def state_io(platform: Platform, index: int | None = None) -> StateIO:
    """The (read, write) pair for device ``index`` (default: the current device) of ``platform``."""
    gen = platform.default_generator(index) if platform.counter_based else None
    if gen is not None:
        return gen.get_state, gen.set_state
    i = platform.current_device() if index is None else index
    return (lambda: platform.get_rng_state(i)), (lambda state: platform.set_rng_state(state, i))


def host_and_devices(platform: Platform, indices: Sequence[int] | None = None) -> list[StateIO]:
    """(read, write) pairs for torch's CPU generator and devices ``indices`` (default: all).

    Where the platform's device is the host, its one state (position cursor included)
    covers torch's CPU generator, so it is the only pair.
    """
    if platform.is_host:
        return [state_io(platform, 0)]
    host = torch.default_generator
    chosen = range(platform.device_count()) if indices is None else indices
    return [(host.get_state, host.set_state)] + [state_io(platform, i) for i in chosen]
