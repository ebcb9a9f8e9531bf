"""``fork_rng`` for any platform: torch's ``torch.random.fork_rng`` without the hard-coded device type.

``torch.random.fork_rng`` forks the CPU and the devices of *one* device type, which
defaults to CUDA (or whatever torch guesses), so on an NPU or a plug-in accelerator it
silently forks the wrong backend. :func:`fork_rng` forks the CPU state and the chosen
devices of the *current platform* (``hyperrng.platforms.current()``), and it is cheap: states are
copied straight from and into the generators where they are the whole state, with no
clones and no validation of states it read itself. On the CPU platform the device is the
host, and its state (with its position cursor) is forked once.

A ``device_type`` that is not the current platform's is an error rather than a lookup in
the platform registry: forking a backend that hyperrng does not drive would protect
nothing that hyperrng's streams use, and loading it could initialise a second device
runtime. Select the platform with ``hyperrng.platforms.use(...)`` instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

import hyperrng.platforms as platforms
from hyperrng._guard.exclusive import LeavesOnExit, holding
from hyperrng.errors import ArgumentTypeError, InvalidArgumentError
from hyperrng.platforms.validate import check_index, check_instance
from hyperrng.streams._device_state import Target, host_and_devices

__all__ = ["fork_rng"]


class _ForkRNG(LeavesOnExit):
    """Holds the host and the chosen devices and saves their states on entry; restores, then releases, on exit.

    Entering changes no state, only holds; leaving writes back what was read and is
    idempotent, so one interrupt anywhere leaves the states as before and no hold behind
    (see :mod:`hyperrng._guard.exclusive`).
    """

    __slots__ = ("_hold", "_saved", "_targets")
    continues = True  # the generators draw on the stream they held: a fork inside reads its advance (ForkChain)

    def __init__(self, targets: list[Target]) -> None:
        self._targets = targets
        self._hold = holding([key for _, _, key in targets], "fork_rng", self)
        self._saved: list[Any] = []

    def __enter__(self) -> None:
        saved = self._saved
        self._hold.__enter__()
        try:
            for read, _, _ in self._targets:
                saved.append(read())
        except BaseException:
            self._hold.__exit__()
            saved.clear()
            raise

    def describe(self) -> str:
        """What this context is, for the messages of the thread policy."""
        return "fork_rng"

    def _held_keys(self) -> list[tuple[str, int]]:
        return list(self._hold.keys) if self._hold.held else []

    def _leave(self) -> None:
        for (_, write, _), state in zip(self._targets, self._saved):
            write(state)
        self._saved.clear()
        self._hold.__exit__()


class _NoFork:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_FORK = _NoFork()


def fork_rng(
    devices: Iterable[int] | None = None, enabled: bool = True, device_type: str | None = None
) -> AbstractContextManager[None]:
    """Return a context manager that restores the CPU and device RNG states on exit.

    Args:
        devices: indices of the current platform's devices to fork; ``None`` forks all
            of them (as ``torch.random.fork_rng`` does), ``[]`` only the CPU. On the CPU
            platform the CPU (with its position cursor) is always forked and ``devices``
            adds nothing.
        enabled: ``False`` makes the context manager do nothing.
        device_type: optional check that the current platform is the one meant: its
            torch device type (``"cuda"``, ``"npu"``, ...) or its platform name.

    Returns:
        A context manager; the states are read on entry and written back on exit, also
        when the block raises.

    While the block runs, this thread holds torch's CPU generator and each forked device
    (see :mod:`hyperrng._guard.exclusive`): on another thread, a tracker fork, a sharded region,
    a recompute or another ``fork_rng`` that needs one of them is refused with
    :class:`~hyperrng.errors.InvalidOperationError`, and entering this one while another
    thread holds one of them is refused the same way, with nothing changed. Plain draws on
    other threads are not stopped, and change the states this block then discards.

    Raises:
        ArgumentTypeError: ``enabled`` is not a bool, ``device_type`` not a string, or ``devices``
            not an iterable of ints.
        InvalidArgumentError: ``device_type`` is not the current platform's (select it with
            ``hyperrng.platforms.use(...)``; see the module docstring);
            or a device index is not an int in ``[0, device_count())``.
        InvalidOperationError: on entry, another thread holds one of the generators.

    Nothing is read or changed until the ``with`` block is entered; a bad argument
    raises before that.
    """
    if not isinstance(enabled, bool):
        raise ArgumentTypeError(f"enabled must be True or False, got {type(enabled).__name__} {enabled!r}.")
    if not enabled:
        return _NO_FORK
    if device_type is not None:
        check_instance(device_type, str, "device_type")
    platform = platforms.current()
    if device_type is not None and device_type not in (platform.device_type, platform.name):
        raise InvalidArgumentError(
            f"fork_rng(device_type={device_type!r}), but the current platform is {platform.name!r} "
            f"(device type {platform.device_type!r}); select that platform with platforms.use(...) "
            "or leave device_type out."
        )
    if devices is None:
        indices: list[int] = list(range(platform.device_count()))
    else:
        if isinstance(devices, (str, bytes)) or not isinstance(devices, Iterable):
            raise ArgumentTypeError(
                f"devices must be an iterable of device indices (or None for all), got {type(devices).__name__}."
            )
        try:
            listed = list(devices)  # a 0-d tensor is an Iterable that refuses to iterate
        except TypeError as exc:
            raise ArgumentTypeError(
                f"devices must be an iterable of device indices (or None for all), got {type(devices).__name__} "
                f"that cannot be iterated ({exc}); pass e.g. [0, 1]."
            ) from None
        count = platform.device_count()
        indices = []
        for index in listed:
            value = check_index(index, count, platform.name)
            if value not in indices:
                indices.append(value)
    return _ForkRNG(host_and_devices(platform, indices))
