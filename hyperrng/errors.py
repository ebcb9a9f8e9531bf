"""Typed errors of hyperrng.

Each class derives from :class:`HyperRNGError` and from the builtin that fits, so
``except ValueError`` keeps working for callers who do not know hyperrng. Messages say
what was wrong and what to do next.
"""

from __future__ import annotations

from hyperrng.platforms.errors import (
    AmbiguousPlatformError,
    ArgumentTypeError,
    DeviceIndexError,
    HyperRNGError,
    InvalidOffsetError,
    InvalidPlatformError,
    InvalidSeedError,
    InvalidStateError,
    PlatformError,
    PlatformNameError,
    PlatformUnavailableError,
    UnknownPlatformError,
)

__all__ = [
    "HyperRNGError",
    "GeneratorBusyError",
    "InvalidSeedError",
    "InvalidOffsetError",
    "InvalidStateError",
    "DeviceIndexError",
    "PlatformError",
    "UnknownPlatformError",
    "PlatformUnavailableError",
    "AmbiguousPlatformError",
    "InvalidPlatformError",
    "PlatformNameError",
    "StreamError",
    "UnknownStreamError",
    "DuplicateStreamError",
    "LayoutError",
    "ShardingError",
    "RankNotInMeshError",
    "RNGDesyncError",
    "CheckpointError",
    "DistributedNotInitializedError",
    "UsageError",
    "RankFailure",
    "ArgumentTypeError",
    "StreamNameError",
    "TrackerStateError",
    "InvalidParameterError",
    "InvalidShapeError",
    "UnsupportedDTypeError",
    "UnsupportedPortableOpError",
]


class StreamError(HyperRNGError):
    """Base class of errors about named RNG streams."""


class StreamNameError(StreamError, ValueError):
    """A stream name that is an empty string."""


class TrackerStateError(StreamError, RuntimeError):
    """An operation the tracker cannot do in its current state.

    Raised when a fork is active during :meth:`~hyperrng.RNGStatesTracker.reset`, when
    forks are exited out of order, when the streams belong to another platform than the
    current one, when graph-safe mode is required on a platform that lacks it, or when
    one generator object would have to stand for every simulated rank of torch's
    LocalTensor mode.
    """


class UnknownStreamError(StreamError, KeyError):
    """A stream name the tracker does not hold."""

    def __str__(self) -> str:  # KeyError would otherwise print the message quoted
        return str(self.args[0]) if self.args else ""


class DuplicateStreamError(StreamError, ValueError):
    """A stream name or seed that the tracker already holds."""


class LayoutError(HyperRNGError, ValueError):
    """A stream layout or mesh description that is inconsistent."""


class ShardingError(HyperRNGError, ValueError):
    """A mesh, coordinate, placement or shape that cannot describe a sharded tensor."""


class RankNotInMeshError(ShardingError, RuntimeError):
    """This rank is not part of the device mesh it was asked to seed or position.

    A :class:`ShardingError` (a ``ValueError``) for hyperrng's callers and a
    ``RuntimeError`` as PyTorch's DTensor ``manual_seed`` raises for the same case.
    """


class GeneratorBusyError(HyperRNGError, RuntimeError):
    """Another thread holds this device's generator (in a fork, a sharded region, ``fork_rng``,
    a recompute or portable mode); nothing was changed. See :mod:`hyperrng._exclusive`."""


class RNGDesyncError(HyperRNGError, RuntimeError):
    """Ranks that must share a stream disagree, or ranks that must differ agree."""


class CheckpointError(HyperRNGError, ValueError):
    """An RNG state dict that cannot be loaded onto this process as it stands."""


class InvalidParameterError(HyperRNGError, ValueError):
    """A distribution parameter outside its domain: a probability outside ``[0, 1]`` or
    NaN, non-finite bounds, ``low > high``, a negative standard deviation."""


class InvalidShapeError(HyperRNGError, ValueError):
    """A shape with a negative dimension, or too many elements."""


class UnsupportedDTypeError(HyperRNGError, TypeError):
    """A dtype (or tensor) the requested operation cannot produce or consume."""


class DistributedNotInitializedError(HyperRNGError, RuntimeError):
    """A cross-rank operation called before ``torch.distributed`` was initialised."""


class UsageError(HyperRNGError, ValueError):
    """A request that cannot be carried out as given (an unknown benchmark, a bad CLI option)."""


class RankFailure(HyperRNGError, RuntimeError):
    """A rank process of a local job raised, died, or never answered.

    Attributes:
        summary: one line naming the rank that failed first and how (its exception, or
            the exit code it died with); what a command line prints.
        details: every failing rank's report, with the tracebacks of those that raised.
    """

    def __init__(self, summary: str, details: str = "") -> None:
        super().__init__(f"{summary}\n{details}" if details else summary)
        self.summary = summary
        self.details = details


class UnsupportedPortableOpError(HyperRNGError, NotImplementedError):
    """A random op called in portable mode that has no portable implementation.

    Portable mode never lets such an op draw from a device's own generator (its numbers
    would depend on the device and the sharding); run it outside the mode. A
    ``NotImplementedError``, hence a ``RuntimeError``.
    """
