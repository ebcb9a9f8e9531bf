"""The exception hierarchy shared by ``platforms`` and ``hyperrng``.

Every error the project raises derives from :class:`HyperRNGError` *and* from the
builtin that fits it, so callers may catch either ``hyperrng.HyperRNGError`` or, say,
``ValueError``. The classes live here, in the lowest layer, because both packages raise
them; ``hyperrng.errors`` re-exports them together with the errors of the RNG layer.
"""

from __future__ import annotations

__all__ = [
    "HyperRNGError",
    "ArgumentTypeError",
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
]


class HyperRNGError(Exception):
    """Base class of every error raised by hyperrng and its platform layer."""


class ArgumentTypeError(HyperRNGError, TypeError):
    """An argument of the wrong type: a seed given as a string or a float, a tracker that is
    not one, a flag that is not a bool. Wrong *values* of the right type raise a
    ``ValueError`` subclass instead."""


class InvalidSeedError(HyperRNGError, ValueError):
    """A seed that is not an ``int`` in ``[0, 2**64 - 1]`` (bools are refused too)."""


class InvalidOffsetError(HyperRNGError, ValueError):
    """A generator offset that is negative, too large, or not a multiple of 4."""


class InvalidStateError(HyperRNGError, ValueError):
    """An RNG state tensor of the wrong type, dtype, length or device."""


class DeviceIndexError(HyperRNGError, IndexError):
    """A device index outside ``[0, device_count())``."""


class PlatformError(HyperRNGError, RuntimeError):
    """Base class of platform selection and loading errors."""


class UnknownPlatformError(PlatformError, KeyError):
    """A platform name that nobody registered, or a ``module:Factory`` that does not load."""

    def __str__(self) -> str:  # KeyError would otherwise print the message quoted
        return str(self.args[0]) if self.args else ""


class PlatformUnavailableError(PlatformError):
    """A known platform that cannot run on this machine (its probe says why)."""


class AmbiguousPlatformError(PlatformError):
    """Two or more plug-in platforms claim this machine; one must be chosen explicitly."""


class InvalidPlatformError(PlatformError, TypeError):
    """A factory or plug-in that does not produce a :class:`platforms.Platform`, or produces one whose class
    leaves a required method (see ``hyperrng.platforms.registry.REQUIRED_METHODS``) to the base class."""


class PlatformNameError(PlatformError, ValueError):
    """A platform name that is malformed, or already registered."""
