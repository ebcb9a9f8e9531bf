"""The errors of hyperrng and its platform layer: a handful of classes, one per kind of answer.

Every class derives from :class:`HyperRNGError` and from the builtin a caller who does not
know hyperrng would catch. The rule a Python programmer expects holds everywhere: a wrong
*type* is a ``TypeError``, a wrong *value* a ``ValueError``, an unknown *name* a
``KeyError``, a refused file-system operation an ``OSError``.

- :class:`InvalidArgumentError` (``ValueError``): a value of the right type that is wrong:
  a seed, offset, RNG state, device index, stream name or stream already held, layout, mesh
  or sharding, shape, distribution parameter, checkpoint contents, malformed platform name,
  option.
- :class:`ArgumentTypeError` (``TypeError``): an argument of the wrong type, or a dtype the
  operation cannot produce or consume.
- :class:`UnknownStreamError` (``KeyError``): a stream name the tracker does not hold.
- :class:`PlatformError` (``RuntimeError``): no platform can be selected or loaded
  (``reason``: ``"unknown"``, ``"unavailable"``, ``"ambiguous"``, ``"invalid"``).
  Its subclass :class:`UnknownPlatformError` (also a ``KeyError``) is the ``"unknown"`` case:
  a name nobody registered, a ``module:Factory`` whose module or attribute does not exist.
- :class:`InvalidOperationError` (``RuntimeError``): a valid call that cannot run in the
  current state (``reason``: ``"busy"``, ``"tracker"``, ``"distributed"``, ``"mesh"``).
- :class:`RNGDesyncError` (``RuntimeError``): ranks disagree on a stream they must share,
  or agree on one they must not.
- :class:`RankFailure` (``RuntimeError``): a rank process of a local job raised or died.
- :class:`StorageError` (``OSError``): the file system refused to write or read a
  checkpoint (a full disk, a quota, no permission, an I/O error); ``errno`` and
  ``filename`` are set as on any ``OSError``.
- :class:`UnsupportedPortableOpError` (``NotImplementedError``): a random op that portable
  mode cannot draw.

Why these and no more: a class exists where a caller would *handle* the case differently.
A bad value and a bad type are programming errors the message explains; the message, not a
subclass, says which argument and what to do. A missing platform, an operation refused in
the current state, a desync found by a check, a failed rank, a file system that refuses a
checkpoint and an op without a portable form each call for a different response (choose
another platform, retry or restructure, stop the run, read the rank's traceback, free space
or save elsewhere, leave portable mode). Where a program may act on a finer distinction, a
``reason`` attribute carries it: ``InvalidOperationError.reason == "busy"`` is the one case a
second thread may simply retry, and ``PlatformError.reason`` tells a launcher whether falling
back to another platform makes sense.

Each class has one builtin, except :class:`UnknownPlatformError`, which has two on purpose:
every place that must survive an unusable platform (``import hyperrng``, the command line)
catches :class:`PlatformError`, and a caller looking a name up catches ``KeyError``; both
work. A device index out of range is an :class:`InvalidArgumentError` (a ``ValueError``),
not an ``IndexError``: it is an argument with a wrong value, like a negative seed, not a
subscript. A rank outside the mesh it is asked to seed is an :class:`InvalidOperationError`,
a ``RuntimeError`` as PyTorch's DTensor raises there.

The classes live here, in the lowest layer, because both packages raise them and
``hyperrng.platforms`` imports nothing from ``hyperrng``. This module's ``__all__`` is the
one export list: :mod:`hyperrng.errors`, :mod:`hyperrng` and :mod:`hyperrng.platforms`
re-export exactly these names from it.
"""

from __future__ import annotations

__all__ = [
    "HyperRNGError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "UnknownStreamError",
    "PlatformError",
    "UnknownPlatformError",
    "InvalidOperationError",
    "RNGDesyncError",
    "RankFailure",
    "StorageError",
    "UnsupportedPortableOpError",
]


class HyperRNGError(Exception):
    """Base class of every error raised by hyperrng and its platform layer."""


class InvalidArgumentError(HyperRNGError, ValueError):
    """A value of the right type that hyperrng cannot use; nothing was changed.

    A seed outside ``[0, 2**64 - 1]``; a generator offset that is negative, too large or not
    a multiple of 4; an RNG state tensor of the wrong dtype, length or device; a device index
    outside ``[0, device_count())``; an empty stream name, or a stream name or seed the
    tracker already holds; an inconsistent stream layout or mesh; a mesh, coordinate,
    placement or shape that cannot describe a sharded tensor; a distribution parameter
    outside its domain; an RNG state dict that cannot be loaded onto this process; a
    malformed or taken platform name; a command-line option or benchmark that does not
    exist. The message names the argument and what to pass instead.
    """


class ArgumentTypeError(HyperRNGError, TypeError):
    """An argument of the wrong type: a seed given as a string or a float, a tracker that is
    not one, a flag that is not a bool, or a dtype (or tensor) the operation cannot produce or
    consume. Wrong *values* of the right type raise :class:`InvalidArgumentError` instead."""


class UnknownStreamError(HyperRNGError, KeyError):
    """A stream name the tracker does not hold (add it first, or check the spelling)."""

    def __str__(self) -> str:  # KeyError would otherwise print the message quoted
        return str(self.args[0]) if self.args else ""


class PlatformError(HyperRNGError, RuntimeError):
    """No platform could be selected or loaded.

    Attributes:
        reason: ``"unknown"`` (a name nobody registered, or a ``module:Factory`` whose module
            or attribute does not exist: raised as :class:`UnknownPlatformError`, also a
            ``KeyError``), ``"unavailable"`` (a known platform whose probe says it cannot run
            here), ``"ambiguous"`` (two or more plug-ins claim this machine; choose one with
            ``HYPERRNG_PLATFORM``), ``"invalid"`` (a factory or plug-in that does not produce
            a complete :class:`~hyperrng.platforms.Platform`), or ``""`` for other cases.
    """

    def __init__(self, *args: object, reason: str = "") -> None:
        super().__init__(*args)
        self.reason = reason


class UnknownPlatformError(PlatformError, KeyError):
    """A platform name nobody registered, or a ``module:Factory`` whose module or attribute does
    not exist: a :class:`PlatformError` with ``reason == "unknown"`` that is also a ``KeyError``."""

    def __init__(self, *args: object, reason: str = "unknown") -> None:
        super().__init__(*args, reason=reason)

    def __str__(self) -> str:  # KeyError would otherwise print the message quoted
        return str(self.args[0]) if self.args else ""


class InvalidOperationError(HyperRNGError, RuntimeError):
    """A valid call that cannot run in the current state; nothing was changed.

    Attributes:
        reason: ``"busy"`` (another thread holds this device's generator in a fork, a
            sharded region, ``fork_rng``, a recompute or portable mode; see
            :mod:`hyperrng._guard.exclusive`; retrying later may succeed), ``"tracker"`` (the
            tracker cannot do this now: a fork is active, forks exited out of order, streams
            of another platform, graph-safe mode the platform lacks), ``"distributed"`` (a
            cross-rank operation before ``torch.distributed`` is initialised), ``"mesh"``
            (this rank is not part of the device mesh it was asked to seed or position, as
            PyTorch's DTensor ``manual_seed`` reports with a ``RuntimeError``), or ``""``.
    """

    def __init__(self, *args: object, reason: str = "") -> None:
        super().__init__(*args)
        self.reason = reason


class RNGDesyncError(HyperRNGError, RuntimeError):
    """Ranks that must share a stream disagree, or ranks that must differ agree.

    A finding about the run, not a misuse: kept apart so that a training loop can stop (or
    resynchronise) on exactly this and let every programming error propagate.
    """


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


class StorageError(HyperRNGError, OSError):
    """The file system refused to write or read a checkpoint: a full disk or quota, no
    permission, a missing file, an I/O error. The checkpoint file it names is as it was
    before the call.

    Construct and read it as any ``OSError``: ``StorageError(errno, message, filename)``;
    ``errno`` (``errno.ENOSPC``, ``errno.EACCES``, ...) says which. As ``OSError`` itself does,
    an errno with a builtin subclass gives an instance that is also of that subclass: a
    ``StorageError`` for ``EACCES`` is a ``PermissionError``, one for ``ENOENT`` a
    ``FileNotFoundError``, so ``except PermissionError`` catches it as it would the builtin's.
    """

    def __new__(cls, *args: object) -> StorageError:
        if cls is StorageError and len(args) >= 2 and isinstance(args[0], int):
            cls = _storage_error_for(type(OSError(args[0], "")))
        return super().__new__(cls, *args)  # type: ignore[no-any-return]

    def __reduce__(self) -> tuple[object, ...]:  # rebuilt through __new__: the errno picks the class again
        args = (self.errno, self.strerror) if self.filename is None else (self.errno, self.strerror, self.filename)
        return StorageError, args if self.errno is not None else self.args


_STORAGE_ERRORS: dict[type, type] = {}


def _storage_error_for(builtin: type) -> type:
    """The subclass of :class:`StorageError` that is also ``builtin`` (an ``OSError`` subclass), made once."""
    if builtin is OSError:
        return StorageError
    made = _STORAGE_ERRORS.get(builtin)
    if made is None:
        made = _STORAGE_ERRORS[builtin] = type("StorageError", (StorageError, builtin), {"__module__": __name__})
    return made


class UnsupportedPortableOpError(HyperRNGError, NotImplementedError):
    """A random op called in portable mode that has no portable implementation.

    Portable mode never lets such an op draw from a device's own generator (its numbers
    would depend on the device and the sharding); run it outside the mode. A
    ``NotImplementedError``, hence a ``RuntimeError``.
    """
