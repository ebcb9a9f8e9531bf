"""hyperrng: random-number state across devices and ranks for PyTorch training.

Importing hyperrng resolves the hardware platform once (see :mod:`platforms.registry`):
``HYPERRNG_PLATFORM`` if set, else an available plug-in, else NPU, CUDA, CPU. The
resolution touches no device. :func:`current_platform` returns the result.
"""

from __future__ import annotations

import platforms as _platforms
from hyperrng.errors import (
    AmbiguousPlatformError,
    CheckpointError,
    DeviceIndexError,
    DistributedNotInitializedError,
    DuplicateStreamError,
    HyperRNGError,
    InvalidOffsetError,
    InvalidPlatformError,
    InvalidSeedError,
    InvalidStateError,
    LayoutError,
    PlatformError,
    PlatformNameError,
    PlatformUnavailableError,
    RNGDesyncError,
    ShardingError,
    StreamError,
    UnknownPlatformError,
    UnknownStreamError,
    UsageError,
)
from platforms import Platform

__version__ = "0.1.0"

_platforms.select()


def current_platform() -> Platform:
    """The platform hyperrng uses now (resolved at import; see ``platforms.use`` to override)."""
    return _platforms.current()


__all__ = [
    "__version__",
    "current_platform",
    "Platform",
    "HyperRNGError",
    "PlatformError",
    "UnknownPlatformError",
    "PlatformUnavailableError",
    "AmbiguousPlatformError",
    "InvalidPlatformError",
    "PlatformNameError",
    "InvalidSeedError",
    "InvalidOffsetError",
    "InvalidStateError",
    "DeviceIndexError",
    "StreamError",
    "UnknownStreamError",
    "DuplicateStreamError",
    "LayoutError",
    "ShardingError",
    "RNGDesyncError",
    "CheckpointError",
    "DistributedNotInitializedError",
    "UsageError",
]
