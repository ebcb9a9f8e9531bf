"""Typed errors of hyperrng: the classes of :mod:`hyperrng.platforms.errors`, under the library's name.

They are defined once, in the platform layer, because both layers raise them and
``hyperrng.platforms`` imports nothing from ``hyperrng``; that module's docstring says which
class is raised for what, and its ``__all__`` is the one list of them.
"""

from __future__ import annotations

from hyperrng.platforms import errors as _errors
from hyperrng.platforms.errors import (  # noqa: F401 -- re-exported: __all__ below is the platform layer's list
    ArgumentTypeError,
    HyperRNGError,
    InvalidArgumentError,
    InvalidOperationError,
    PlatformError,
    RankFailure,
    RNGDesyncError,
    StorageError,
    UnknownPlatformError,
    UnknownStreamError,
    UnsupportedPortableOpError,
)

__all__ = _errors.__all__
