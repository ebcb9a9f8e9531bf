"""Multi-rank tests run real processes over gloo: see :mod:`hyperrng.cli.launch`. Their ranks are forked from
its fork server, as the demo's are (their modules read nothing from the environment as they are imported)."""

from typing import Any

from hyperrng.cli import launch
from hyperrng.cli.launch import free_port

__all__ = ["run_ranks", "free_port"]


def run_ranks(fn: Any, world_size: int, *args: Any, backend: str = "gloo") -> list[Any]:
    """:func:`hyperrng.cli.launch.run_ranks` with ``fork_server=True``."""
    return launch.run_ranks(fn, world_size, *args, backend=backend, fork_server=True)
