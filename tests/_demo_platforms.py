"""CPU platforms that let a test steer the demo's rank processes from outside.

A test selects one with ``HYPERRNG_PLATFORM=tests._demo_platforms:<factory>``; the rank
processes inherit the variable and build the same platform. Each acts in
``set_device``, which every rank calls once, right after joining the process group.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from hyperrng.platforms.cpu import CPUPlatform

__all__ = ["GATE_ENV", "DIE_ENV", "gated", "dying"]

GATE_ENV = "HYPERRNG_TEST_GATE"
"""A file path: every rank waits in ``set_device`` until that file exists."""

DIE_ENV = "HYPERRNG_TEST_DIE"
"""``RANK:CODE``: that rank ends with ``os._exit(CODE)`` in ``set_device``."""

_GATE_GIVES_UP_S = 600  # a test that never opens the gate (a regression) fails, rather than hangs forever
_GATE_POLL_S = 0.05


class _GatedCPU(CPUPlatform):
    """The CPU, except that a rank waits for the test's go-ahead before it starts work."""

    name = "gated"

    def set_device(self, index: int) -> None:
        gate = Path(os.environ[GATE_ENV])
        deadline = time.monotonic() + _GATE_GIVES_UP_S
        while not gate.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test never opened the gate {gate}")
            time.sleep(_GATE_POLL_S)
        super().set_device(index)


class _DyingCPU(CPUPlatform):
    """The CPU, except that one rank dies with a chosen exit code as it starts work."""

    name = "dying"

    def set_device(self, index: int) -> None:
        rank, code = (int(part) for part in os.environ[DIE_ENV].split(":"))
        if os.environ.get("RANK") == str(rank):
            os._exit(code)
        super().set_device(index)


def gated() -> CPUPlatform:
    """The factory of the gated CPU platform."""
    return _GatedCPU()


def dying() -> CPUPlatform:
    """The factory of the dying CPU platform."""
    return _DyingCPU()
