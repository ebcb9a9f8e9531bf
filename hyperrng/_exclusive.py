"""The thread policy: one thread at a time borrows a device's generator.

A device generator is one per process and shared by every thread. Everything in hyperrng
that swaps or positions it for a while — a tracker's ``fork``, a sharded region, ``fork_rng``,
a recompute, portable mode — first *holds* the device (:func:`hold`). The thread that holds
it may nest holds freely; any other thread that tries is refused at once with
:class:`~hyperrng.errors.GeneratorBusyError`, before anything changes, until the holder has
left its outermost hold. Plain draws (``torch.rand`` on another thread) are not intercepted:
they draw from whatever state the generator has, as they would inside
``torch.random.fork_rng``.
"""

from __future__ import annotations

import threading

from hyperrng.errors import GeneratorBusyError

__all__ = ["hold", "release", "holder"]

_LOCK = threading.Lock()
# (device type, device index) -> [holding thread's ident, nesting depth]
_HOLDS: dict[tuple[str, int], list[int]] = {}


def hold(device_type: str, index: int, what: str) -> None:
    """Hold device ``index`` of ``device_type`` for the calling thread (nested holds count).

    Raises:
        GeneratorBusyError: another thread holds it; nothing changed. ``what`` names the
            operation refused, for the message.
    """
    me = threading.get_ident()
    with _LOCK:
        entry = _HOLDS.get((device_type, index))
        if entry is None:
            _HOLDS[(device_type, index)] = [me, 1]
            return
        if entry[0] == me:
            entry[1] += 1
            return
        owner = entry[0]
    raise GeneratorBusyError(
        f"{what} on {device_type}:{index} was refused: thread {owner} holds that device's generator (in a fork, "
        f"a sharded region, fork_rng, a recompute or portable mode) and this is thread {me}. The generator is one "
        "per process; use it from one thread at a time, or give each thread its own torch.Generator."
    )


def release(device_type: str, index: int) -> None:
    """Leave one hold of the calling thread on device ``index`` (the last one frees the device)."""
    with _LOCK:
        entry = _HOLDS.get((device_type, index))
        if entry is None or entry[0] != threading.get_ident():
            return  # not held by this thread: nothing to leave (an exit after a refused enter)
        entry[1] -= 1
        if not entry[1]:
            del _HOLDS[(device_type, index)]


def holder(device_type: str, index: int) -> int | None:
    """The ident of the thread holding device ``index``, or ``None``."""
    entry = _HOLDS.get((device_type, index))
    return entry[0] if entry is not None else None
