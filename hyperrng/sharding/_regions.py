"""The context managers that position a generator around one sharded random op.

:class:`Region` positions the generator of one process (see :mod:`hyperrng.sharding.tracker` for
what each platform guarantees); :class:`LocalRegion` positions every simulated rank's
generator under torch's LocalTensor mode. Each thread keeps a stack of the regions it is
inside; :func:`active_region` returns the innermost (portable mode reads it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from threading import Thread, current_thread
from typing import Any

import torch

from hyperrng._guard import exclusive as _exclusive
from hyperrng.errors import InvalidArgumentError
from hyperrng.platforms import Platform
from hyperrng.platforms.validate import MAX_OFFSET
from hyperrng.sharding import _local_tensor as _local_ranks

__all__ = ["LocalRegion", "Region", "active_region", "cancel_innermost"]


class _ActiveRegions(threading.local):
    """The regions this thread is inside, innermost last (portable mode reads the innermost)."""

    def __init__(self) -> None:
        self.stack: list[Region] = []
        self.local: list[LocalRegion] = []  # under LocalTensor mode, innermost last


_ACTIVE = _ActiveRegions()


class Region(_exclusive.LeavesOnExit):
    """The context manager of one distribute_region call (a class: cheaper than @contextmanager).

    While entered it is :func:`active_region`: the mesh, placements and global shape of the
    op, and the (seed, base) position the op starts from before this rank's shift.
    """

    __slots__ = (
        "_platform",
        "_generator",
        "_start",
        "_end",
        "_seed",
        "_base",
        "_consumed",
        "_cancelled",
        "_saved",
        "mesh",
        "placements",
        "global_shape",
        "_held",
    )

    def __init__(
        self,
        platform: Platform,
        generator: torch.Generator | None,
        start: int,
        end: int,
        mesh: Any = None,
        placements: Sequence[Any] = (),
        global_shape: Sequence[int] = (),
    ) -> None:
        self._platform = platform
        self._generator = generator
        self._start = start
        self._end = end
        self._seed = 0
        self._base = 0
        self._consumed = 0
        self._cancelled: Any = False  # else the generator's state at the first refusal
        self._saved: tuple[Callable[[Any], object], Any] | None = None  # (write, snapshot): see __enter__
        self.mesh = mesh
        self.placements = placements
        self.global_shape = global_shape
        self._held: tuple[tuple[str, int], Thread, int] | None = None  # (device key, thread, depth before) while held

    @property
    def position(self) -> tuple[int, int]:
        """The (seed, offset) where the next draw of the global tensor starts, the same on every rank:
        the generator's position on entry, moved past what :meth:`consume` recorded."""
        return self._seed, self._base + self._consumed

    def consume(self, count: int) -> None:
        """Record that every rank drew ``count`` counters (a multiple of 4) of the global tensor at
        :attr:`position`: the next draw starts after them, and on exit every rank moves to the
        entry position plus all that was consumed instead of the shard layout's end.

        Raises:
            InvalidArgumentError: the position would pass 2**63 - 1 (nothing recorded).
        """
        if self._base + self._consumed + count > MAX_OFFSET:
            raise InvalidArgumentError(
                f"drawing {count} counters at offset {self._base + self._consumed} would pass 2**63 - 1; "
                "reseed the generator."
            )
        self._consumed += count

    def cancel(self) -> None:
        """Record that an op refused to draw: on exit every rank moves only past what :meth:`consume`
        recorded, not to the shard layout's end; where it drew nothing, the generator gets back the
        very state it had on entry (on the CPU, moving to a position reseeds, which would lose the
        draws torch's own ops made since). Something that draws after the first refusal (torch's own
        op) ends the cancel: the region then moves to its end, so those numbers are not drawn again."""
        if self._cancelled is False:
            self._cancelled = self._state_now()

    def _state_now(self) -> torch.Tensor:
        gen = self._generator
        return self._platform.get_rng_state() if gen is None else gen.get_state()

    def __enter__(self) -> None:
        # Holds the device (hyperrng._guard.exclusive) when it positions the device's generator. One
        # interrupt anywhere leaves the generator before the region, or where its exit leaves it.
        p, gen = self._platform, self._generator
        positioned = False
        self._consumed, self._cancelled, self._saved = 0, False, None  # a region entered again starts afresh
        try:
            if gen is None or gen is p.default_generator():
                key, me = (p.device_type, p.current_device()), current_thread()
                self._held = (key, me, _exclusive.hold_key(key, me, "a sharded region", self))
            # The device's own generator goes through the platform's unchecked fast path: these
            # ints are checked here (the offsets were checked when they were computed).
            seed, base = p._position() if gen is None else p.get_seed_offset(None, gen)
            if base + self._end > MAX_OFFSET:
                _check_room(base, self._end)
            self._seed, self._base = seed, base
            positioned = True
            if self._end:  # an op on an empty tensor draws nothing: the generator and its plain draws stay as they are
                if not p.counter_based and gen is None:  # moving reseeds: a refused op puts the state back (_leave)
                    io = p._state_io()
                    self._saved = (io.write, io.read())
                elif not p.counter_based:
                    self._saved = (gen.set_state, gen.get_state())
                if gen is None:
                    p._move(seed, base + self._start, True)
                else:
                    p.set_seed_offset(seed, base + self._start, None, gen, draw=True)
            _ACTIVE.stack.append(self)
        except BaseException:
            if positioned:  # interrupted: complete to where the exit would leave the generator
                self._leave()
            else:
                self._release()
            raise

    def describe(self) -> str:
        """What this context is, for the messages of the thread policy."""
        return "sharded region"

    def _held_keys(self) -> tuple[tuple[str, int], ...]:
        held = self._held
        return (held[0],) if held is not None else ()

    def _leave(self) -> None:
        stack = _ACTIVE.stack
        if stack and stack[-1] is self:
            stack.pop()
        elif self in stack:  # regions left out of order: this one must not stay active
            stack.remove(self)
        cancelled = self._cancelled is not False and torch.equal(self._cancelled, self._state_now())
        end = self._consumed if self._consumed or cancelled else self._end
        if not end and self._saved is not None:  # an op refused before it drew: the state as it was
            write, snapshot = self._saved
            write(snapshot)
        elif end or self._end:
            if self._generator is None:
                self._platform._move(self._seed, self._base + end, False)
            else:
                self._platform.set_seed_offset(self._seed, self._base + end, None, self._generator)
        self._release()

    def _release(self) -> None:
        held = self._held
        if held is not None:
            _exclusive.release_key(*held)


def _check_room(base: int, end: int) -> None:
    """Refuse a region whose op would carry the generator offset past 2**63 - 1 (before anything moves)."""
    if base + end > MAX_OFFSET:
        raise InvalidArgumentError(
            f"the generator offset {base} plus this op's {end} would pass 2**63 - 1; reseed the generator."
        )


def active_region() -> Region | None:
    """The innermost sharded region (``distribute_region``, or a DTensor random op) this thread is in, if any."""
    stack = _ACTIVE.stack
    return stack[-1] if stack else None


def cancel_innermost(local: bool = False) -> None:
    """Cancel the innermost region this thread is in (a kernel refused its op): a sharded region, else one under
    LocalTensor mode; the other way round for a refusal under that mode (``local``)."""
    for stack in (_ACTIVE.local, _ACTIVE.stack) if local else (_ACTIVE.stack, _ACTIVE.local):
        if stack:
            stack[-1].cancel()
            return


class LocalRegion:
    """A region under torch's LocalTensor mode: every simulated rank's generator at its own shard's start.

    The base position is read from ``source`` (a user generator the op's draws are charged
    to) or else from the first simulated rank, as all ranks of an SPMD region start from
    one position. On exit every rank moves to ``base + end``; with a ``source``, the
    source takes the advance instead and every rank gets back the state it had.
    """

    __slots__ = ("_platform", "_mode", "_starts", "_end", "_source", "_seed", "_base", "_saved", "_cancelled", "_held")

    def __init__(
        self, platform: Platform, mode: Any, starts: dict[int, int], end: int, source: torch.Generator | None
    ) -> None:
        self._platform = platform
        self._mode = mode
        self._starts = starts
        self._end = end
        self._source = source
        self._seed = 0
        self._base = 0
        self._saved: tuple[dict[int, Any], torch.Tensor] | None = None  # every rank's state and the host's, on entry
        self._cancelled = False
        self._held = ("", 0, 0)  # (device type, index, depth before) of the device held

    def __enter__(self) -> None:
        p, mode, starts = self._platform, self._mode, self._starts
        index = p.current_device()  # every simulated rank's state passes through this device's generator
        self._held = (p.device_type, index, _exclusive.hold(p.device_type, index, "a sharded region"))
        try:
            if self._source is not None:
                seed, base = p.get_seed_offset(generator=self._source)  # refuses a foreign generator first
            else:
                _local_ranks.load_rank(mode, min(mode.ranks))
                seed, base = p.get_seed_offset()
            _check_room(base, self._end)
            self._saved, self._cancelled = (_local_ranks.snapshot(mode), p.get_rng_state()), False
            self._seed, self._base = seed, base
            _local_ranks.each_rank(mode, lambda rank: p.set_seed_offset(seed, base + starts[rank], draw=True))
            _ACTIVE.local.append(self)
        except BaseException:
            _exclusive.release(*self._held)
            raise

    def cancel(self) -> None:
        """Record that an op refused to draw: on exit every rank gets back the state it had on entry."""
        self._cancelled = True

    def __exit__(self, *exc: object) -> None:
        p, seed, after = self._platform, self._seed, self._base + self._end
        if self in _ACTIVE.local:
            _ACTIVE.local.remove(self)
        try:
            if not self._cancelled and self._source is None:
                _local_ranks.each_rank(self._mode, lambda rank: p.set_seed_offset(seed, after))
                return
            states, host = self._saved  # type: ignore[misc]
            _local_ranks.restore(self._mode, states)
            p.set_rng_state(host)
            if not self._cancelled:  # the source takes the advance; a cancelled op moved nothing
                p.set_seed_offset(seed, after, generator=self._source)  # last: the source may be the device's own
        finally:
            _exclusive.release(*self._held)
