"""The thread policy: one thread at a time borrows a device's generator. Every hyperrng context that swaps or
positions a device's generator for a while (a tracker's fork, a sharded region, ``fork_rng``, a recompute, portable
mode), and every call that seeds or restores one, first holds the device for its thread; another thread is refused at
once, and the contexts' enters and exits leave generators, streams and holds as before or as after even when
interrupted.

The policy is in :func:`hold`; enter/exit order, interrupts and nesting in :class:`LeavesOnExit`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable
from threading import Lock, Thread, current_thread
from typing import Any, TypeVar

from hyperrng._guard.interrupts import deferred
from hyperrng.errors import InvalidOperationError

__all__ = [
    "HOLDS",
    "LeavesOnExit",
    "alive",
    "depth",
    "describe",
    "held_above",
    "hold",
    "hold_key",
    "holder",
    "holding",
    "leave_inner",
    "refuse_inside_contexts",
    "redo",
    "release",
    "release_key",
]

_T = TypeVar("_T")

# (device type, device index) -> (holding thread, nesting depth, the context that took this
# hold or None, the entry below it or None). Entries are immutable tuples replaced whole,
# each change one dict operation: only the holder changes its own entry, and a claim is one
# atomic ``setdefault``, so no lock is needed (with or without the GIL) and an interrupt can
# never find an entry half-written. The one exception, taking over the hold of a thread that
# has ended, is a compare-and-replace made under _TAKE_OVER.
_Entry = tuple[Thread, int, Any, Any]
_HOLDS: dict[tuple[str, int], _Entry] = {}
_TAKE_OVER = Lock()

HOLDS = _HOLDS
"""The holds, for hot paths that only read them (a fork's exit checks that it is innermost)."""


def alive(thread: Thread) -> bool:
    """Whether ``thread`` is alive, asked so that a signal cannot mark it dead.

    ``Thread.is_alive()`` tries the thread's state lock without blocking; before Python 3.13
    its cleanup for an exception raised in that call (a signal handler's, on the main thread)
    releases the lock whenever it is locked and marks the thread stopped, even when the
    thread is running and the lock is its own. So the calling thread is alive without
    asking, and another is asked with signals deferred.
    """
    if thread is current_thread():
        return True
    with deferred():
        return thread.is_alive()


def _after_fork_in_child() -> None:
    """A child made by ``os.fork`` (``multiprocessing``'s ``fork`` start method) has one thread; the holds its
    parent's threads had are not its own, so this at-fork handler clears them: the child starts with no holds,
    whatever its parent was in (and a fresh lock, which a parent's thread may have held at the fork). Forks of a
    tracker that the child inherited open are left by ``reset()``, ``reseed()`` or ``set_states()`` (see
    :mod:`hyperrng.streams.tracker`)."""
    global _TAKE_OVER
    _HOLDS.clear()
    _TAKE_OVER = Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def hold(device_type: str, index: int, what: str) -> int:
    """Hold device ``index`` of ``device_type`` for the calling thread (nested holds count).

    **Policy.** A device generator is one per process and shared by every thread. Everything in
    hyperrng that swaps or positions it for a while — a fork of any tracker, a sharded region,
    ``fork_rng``, a recompute, portable mode — first *holds* the device (this function), keyed by
    ``(platform.device_type, device index)``; torch's CPU generator, which ``fork_rng`` and a
    recompute also save and restore, is ``("cpu", 0)``. The thread that holds a device may nest
    holds freely; any other thread that tries is refused at once with
    :class:`~hyperrng.errors.InvalidOperationError`, before anything changes, until the holder has
    left its outermost hold. Refusal, not waiting: a second thread that waited would draw from
    the generator the first one left, so its numbers would depend on scheduling. Plain draws
    (``torch.rand`` on another thread) are not intercepted: they draw from whatever state the
    generator has, as they would inside ``torch.random.fork_rng``. A thread that needs numbers
    of its own while another borrows the device's generator passes its own ``torch.Generator``.
    Two more rules follow from the same idea: a tracker's open forks form one chain, so they
    stay on one thread even where they swap different devices' generators (another thread gets
    :class:`~hyperrng.errors.InvalidOperationError`); and a recompute's rerun holds the generators
    on the thread autograd runs it on, which for accelerator tensors is autograd's device
    thread, so a ``backward()`` called inside a fork is refused there. The calls that position a
    generator for good hold briefly too (see :func:`holding`).

    **A thread that dies holding.** A hold records the owning ``threading.Thread`` object,
    not its ident (idents are reused by later threads, which must not inherit a hold). A hold
    whose owner has ended (``is_alive()`` is false: it exited, or was killed by an exception
    that skipped its context's exit, such as a generator-based caller abandoned mid-fork)
    counts as released: the next thread that asks takes the device over instead of being
    refused forever. The dead thread's generator state stays as it left it, exactly as if it
    had been a plain draw; a tracker whose fork it left open refuses every use until its streams
    are replaced (see :mod:`hyperrng.streams.tracker`). Threads that CPython did not start (a C++ thread calling into
    Python, such as autograd's device threads) appear as dummy threads that always count as
    alive, so a hold such a thread never released still blocks.

    Returns:
        The thread's depth on the device before this hold (0: this call took the device),
        to pass to :func:`release` as ``down_to`` when undoing it.

    Raises:
        InvalidOperationError: another thread holds it; nothing changed. ``what`` names the
            operation refused, for the message.

    One interrupt cannot leave a hold half taken: it either raises with nothing changed
    or returns with the hold made (nothing that can be interrupted follows the change).
    """
    return hold_key((device_type, index), current_thread(), what)


def release(device_type: str, index: int, down_to: int | None = None) -> None:
    """Leave one hold of the calling thread on device ``index`` (the last one frees the device).

    With ``down_to``, leave instead every hold above that level (what :func:`hold`
    returned): calling it again, or after a :func:`hold` that never happened, changes
    nothing, which is what an undo after an interrupt needs. A thread that does not hold
    the device leaves nothing (an exit after a refused enter).
    """
    key, me = (device_type, index), current_thread()
    if down_to is None:
        entry = _HOLDS.get(key)
        if entry is None or entry[0] is not me:
            return
        down_to = entry[1] - 1
    release_key(key, me, down_to)


def hold_key(key: tuple[str, int], me: Thread, what: str, context: Any = None) -> int:
    """:func:`hold` for callers on a hot path that keep the key and know their thread ``me``
    (``threading.current_thread()``); ``context`` is the context taking the hold, for
    :func:`leave_inner` (it has ``_unwind()``)."""
    mine = (me, 1, context, None)
    try:
        entry = _HOLDS.setdefault(key, mine)
        if entry is not mine and entry[0] is not me and not alive(entry[0]):
            entry = _take_over(key, entry, mine)
    except BaseException:  # interrupted as a call returned: undo a claim it made
        if _HOLDS.get(key) is mine:
            del _HOLDS[key]
        raise
    if entry is mine:
        return 0
    owner, below = entry[0], entry[1]
    if owner is me:
        _HOLDS[key] = (me, below + 1, context, entry)
        return below
    raise _busy(key, what, owner, me)


def refuse_held(keys: Iterable[tuple[str, int]], what: str, advice: str | None = None) -> None:
    """Refuse ``what``, taking nothing, where another live thread holds one of ``keys``: for a call that
    must know it will get its holds before it changes anything else (see ``hyperrng.streams.tracker.Replacing``),
    or that reads those generators as the run's state (``hyperrng.rng_state_dict``: the holder's context may
    have swapped its own stream in). ``advice`` replaces the message's last sentence, what to do instead."""
    me = current_thread()
    for key in keys:
        entry = _HOLDS.get(key)
        if entry is not None and entry[0] is not me and alive(entry[0]):
            raise _busy(key, what, entry[0], me, advice)


def _busy(
    key: tuple[str, int], what: str, owner: Thread, me: Thread, advice: str | None = None
) -> InvalidOperationError:
    advice = advice or (
        "The generator is one per process; use it from one thread at a time, or give each thread its own "
        "torch.Generator."
    )
    return InvalidOperationError(
        f"{what} on {key[0]}:{key[1]} was refused: thread {owner.ident} holds that device's generator (in a fork, "
        "a sharded region, fork_rng, a recompute, portable mode, seeding or a restore) and this is thread "
        f"{me.ident}. {advice}",
        reason="busy",
    )


def _take_over(key: tuple[str, int], dead: _Entry, mine: _Entry) -> _Entry:
    """Replace ``dead``, the hold of a thread that has ended, by ``mine``; return the entry now held.

    Under a lock, so that of two threads finding the same dead hold one takes it over and
    the other finds the first one's hold (and is refused).
    """
    with _TAKE_OVER:
        entry = _HOLDS.get(key)
        if entry is dead:
            _HOLDS[key] = entry = mine
        elif entry is None:  # released meanwhile: claim it as hold_key would
            entry = _HOLDS.setdefault(key, mine)
        return entry


def release_key(key: tuple[str, int], me: Thread, down_to: int) -> None:
    """:func:`release` down to a level, for callers on a hot path that keep the key and know ``me``."""
    entry = _HOLDS.get(key)
    if entry is None or entry[0] is not me:
        return
    if down_to <= 0:
        del _HOLDS[key]
    elif down_to < entry[1]:
        while entry is not None and entry[1] > down_to:
            entry = entry[3]
        _HOLDS[key] = entry if entry is not None else (me, down_to, None, None)


def leave_inner(context: Any, key: tuple[str, int]) -> None:
    """For the exit of ``context`` with an exception passing through, when ``context`` holds
    ``key`` on this thread below holds of other contexts: their exits were skipped by an
    interrupt, so leave them, innermost first, as their exits would have (see *Nesting* in
    :class:`LeavesOnExit`)."""
    inner = []
    entry = _HOLDS.get(key)
    while entry is not None and entry[2] is not context:
        if entry[2] is not None and entry[2] not in inner:
            inner.append(entry[2])
        entry = entry[3]
    if entry is not None:  # ``context`` does hold ``key``: the contexts above it were entered inside it
        for other in inner:
            other._unwind()


def held_above(key: tuple[str, int], level: int, contexts: Collection[Any]) -> _Entry | None:
    """The first of the calling thread's holds on ``key`` above depth ``level`` that none of
    ``contexts`` took (innermost first), or ``None``."""
    entry = _HOLDS.get(key)
    if entry is None or entry[0] is not current_thread():
        return None
    while entry is not None and entry[1] > level:
        if entry[2] is None or entry[2] not in contexts:
            return entry
        entry = entry[3]
    return None


def refuse_inside_contexts(
    keys: Iterable[tuple[str, int]], what: str, exempt: Callable[[Any], bool] = lambda context: False
) -> None:
    """Refuse ``what`` where the calling thread is inside a context that swapped one of ``keys``' generators (a
    fork of any tracker, a sharded region, ``fork_rng``, a ``portable_random(seed)`` block; every context that
    takes its hold with itself as ``context``) and that ``exempt`` does not name (the caller's own,
    which it checks itself): the generator then holds that context's stream, which its exit puts back, not
    the state ``what`` reads or writes. Nothing changes."""
    me = current_thread()
    for key in keys:
        entry = _HOLDS.get(key)
        while entry is not None and entry[0] is me:
            if entry[2] is not None and not exempt(entry[2]):
                raise InvalidOperationError(
                    f"cannot {what} inside a {describe(entry[2])}: the generator holds the stream that context "
                    "swapped in, which its exit puts back, not the state of the run; do it outside that context's "
                    "`with` block (before it or after its exit).",
                    reason="tracker",
                )
            entry = entry[3]


def describe(context: Any) -> str:
    """What a context that took a hold is, for a message (``None``: a brief hold, or portable mode without a seed)."""
    if context is None:
        return "seeding, restore or portable mode"
    what = getattr(context, "describe", None)
    return what() if callable(what) else type(context).__name__


class _Holding:
    """The context manager :func:`holding` returns (its exit is idempotent; ``held`` says whether it holds)."""

    __slots__ = ("_belows", "_context", "_me", "_what", "keys")

    def __init__(self, keys: Iterable[tuple[str, int]], what: str, context: Any = None) -> None:
        self.keys = list(dict.fromkeys(keys))  # each device once, in order
        self._what, self._context = what, context
        self._me = current_thread()
        self._belows: list[int] = []

    @property
    def held(self) -> bool:
        return bool(self._belows)

    def __enter__(self) -> None:
        self._me = me = current_thread()
        try:
            for key in self.keys:
                self._belows.append(hold_key(key, me, self._what, self._context))
        except BaseException:  # refused (or interrupted): give back the holds taken
            self._release()
            raise

    def __exit__(self, *exc: object) -> None:
        self._release()

    def _release(self) -> None:
        for key, below in zip(self.keys, self._belows):
            release_key(key, self._me, below)
        self._belows.clear()


def holding(keys: Iterable[tuple[str, int]], what: str, context: Any = None) -> _Holding:
    """A context manager that holds every device in ``keys`` for the calling thread while its block runs.

    For the calls that position a generator for good — seeding (``hyperrng.seed_host`` and the
    recipes in :mod:`hyperrng.seeding.recipes`, ``apply_layout``,
    :meth:`~hyperrng.sharding.tracker.ShardedRNGTracker.manual_seed` and ``sync_from_rank0``) and
    restoring a checkpoint (:func:`hyperrng.resume.state.load_rng_state_dict`): a brief hold around
    the change makes them follow the policy of the contexts (:func:`hold`); on another thread than
    the holder's they are refused the same way, before anything changes. The platforms' own
    ``manual_seed`` / ``set_rng_state`` sit below this layer and do not hold. A context that
    holds for longer (``fork_rng``, a recompute) passes itself as ``context`` (it has ``_unwind()``,
    see :func:`leave_inner`).

    Raises:
        InvalidOperationError: on entry, another thread holds one of the devices; nothing is
            held then (``what`` names the operation refused, for the message).
    """
    return _Holding(keys, what, context)


def depth(device_type: str, index: int) -> int:
    """How many holds the calling thread has on device ``index`` (0 if it holds none)."""
    entry = _HOLDS.get((device_type, index))
    return entry[1] if entry is not None and entry[0] is current_thread() else 0


def holder(device_type: str, index: int) -> int | None:
    """The ident of the thread holding device ``index``, or ``None`` (also when its holder has ended)."""
    entry = _HOLDS.get((device_type, index))
    return entry[0].ident if entry is not None and alive(entry[0]) else None


def redo(step: Callable[[_T], object], arg: _T) -> None:
    """Run ``step(arg)``, an idempotent restoring step; if an exception cuts it short, run it
    once more and re-raise, so that one interrupt cannot leave it half done (the CPU
    platform's write, for one, sets the generator's bytes and then its cursor)."""
    try:
        step(arg)
    except BaseException:
        step(arg)
        raise


class LeavesOnExit:
    """Base of the contexts whose exit is one idempotent ``_leave()`` (restore, then release).

    If an interrupt cuts ``_leave()`` short, ``__exit__`` runs it once more and re-raises.
    The retry is written inline here rather than through :func:`redo`: a call to a helper
    would add a frame whose entry an interrupt could hit before any ``try``. First, when an
    exception passes, :meth:`_close_inner` leaves contexts an interrupt left open inside
    this one (see *Nesting*).

    **Order.** Entering a context validates its arguments, then holds, then saves what it will
    change, then applies; if anything raises between the hold and the end of the apply, it
    puts back what it saved, releases and re-raises. Leaving restores, then releases.

    **Interrupts.** CPython delivers an asynchronous exception (``KeyboardInterrupt`` from
    SIGINT, or whatever a signal handler raises) only at a few points: when a Python function
    starts, when a call into C returns, and at a loop's back edge. Each change to a generator
    is one C call (``set_state``, ``manual_seed``) or one store, and the contexts are written so
    that one such exception, wherever it lands in their enter or exit, leaves the generator
    (bytes and position cursor), the tracker's streams, the region stack and the holds exactly
    as before the context or as after it:

    * an enter that is interrupted undoes what it did and re-raises (a sharded region instead
      completes to the position its exit would leave, which is its "after" state);
    * an exit that is interrupted runs its restoring steps once more, all of them idempotent
      (:func:`redo`), and re-raises;
    * a hold is one atomic dict operation that nothing interruptible follows, and
      :func:`hold` returns the depth before it; contexts release *down to* that depth, so an
      undo releases exactly what its enter took, and releasing twice releases once.

    The profile-hook test in ``tests/properties/test_threads.py`` raises at every one of those points in
    turn, in a fork, ``fork_rng`` and a sharded region, and checks the states after each;
    another cuts an inner context's exit before its first instruction, in six nestings.
    The guarantee is about hyperrng's contexts; in LocalTensor mode (simulated ranks) a region
    is refused across threads like any other but makes no claim about interrupts. Portable
    mode holds the device like the others, but its enter and exit are not idempotent steps:
    it defers Ctrl-C (SIGINT on the main thread) while entering or leaving instead (see
    :class:`hyperrng.portable.mode._CtrlC`), and an exception that another signal's Python handler
    raises there can leave the flag, the hold or the generator between before and after.

    **Nesting.** A hold records the context that took it (forks of any tracker, ``fork_rng``,
    sharded regions, ``portable_random(seed)`` blocks; ``None`` for the others) and the hold below
    it, so a device's holds form a chain, innermost first. An exit with an exception passing
    through it that finds holds of other contexts above its own knows their exits were skipped
    by an interrupt (the window below): it leaves them first, innermost first, as their exits
    would have (:func:`leave_inner`), then itself. Holds without a context (portable mode
    without a seed or its switch, which put nothing back; seeding) are not left this way.
    Without an exception an exit checks that its own hold is the innermost of the contexts on
    its device (one dict lookup): a fork, region or ``fork_rng`` left while a context entered
    after it on the same thread is still open (asyncio tasks or generators interleaving them)
    is refused with :class:`~hyperrng.errors.InvalidOperationError` and
    changes nothing; exited again in order, it leaves.

    What pure Python cannot close, and so is not guaranteed:

    * CPython checks for a pending signal when ``__exit__`` starts, before its first
      instruction: a signal that arrives after the block's last check and before that one is
      raised there, before ``__exit__`` has done anything, and the context stays entered. The
      window is the few instructions between a ``with`` block's end and ``__exit__``. Inside
      another context (a fork, ``fork_rng`` or a sharded region on the same device) that is
      repaired: the exception passes through the outer context's exit, which finds the inner
      one's hold still there and leaves it first (see *Nesting*), so both end as after their
      blocks. An outermost context stays entered: the generator keeps the borrowed state and
      the thread keeps its hold, so other threads are refused rather than corrupted.
    * A second interrupt that arrives while the first one is being undone or redone can cut
      that repair short.
    """

    __slots__ = ()

    def _leave(self) -> None:
        raise NotImplementedError

    def _unwind(self) -> None:
        """Leave, for the exit of an outer context (see *Nesting* in :class:`LeavesOnExit`)."""
        self._leave()

    def _close_inner(self) -> None:
        """Call :func:`leave_inner` for each device it holds."""
        for key in self._held_keys():
            leave_inner(self, key)

    def _held_keys(self) -> Iterable[tuple[str, int]]:
        """The devices it holds (their holds were taken with this context)."""
        return ()

    def __exit__(self, *exc: object) -> None:
        interleaved = None
        try:
            if exc and exc[0] is not None:  # an interrupt may have skipped the exits of contexts inside it
                self._close_inner()
            else:  # a context entered after this one still open: exits out of order (asyncio tasks, generators)
                for key in self._held_keys():
                    entry = _HOLDS.get(key)
                    if entry is not None and entry[2] is not None and entry[2] is not self:
                        interleaved = entry[2]
                        raise out_of_order(self, interleaved)
            self._leave()
        except BaseException:
            if interleaved is None:
                self._leave()
            raise


def out_of_order(context: Any, inner: Any) -> InvalidOperationError:
    """The refusal of ``context``'s exit while ``inner``, which took a hold after it, is still open."""
    return InvalidOperationError(
        f"{describe(context)} exited while a {describe(inner)}, entered after it on this thread, is still open: exit "
        "contexts in reverse order (asyncio tasks or generators that interleave forks, regions or fork_rng need "
        "a thread each, or contexts that do not overlap). Nothing changed: it stays open; exit it again once "
        "the later context has left.",
        reason="tracker",
    )
