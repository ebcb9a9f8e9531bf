"""A tracker's chain of open forks: the context of one ``with tracker.fork(name):`` (:class:`_Fork`), and
the checks on the chain that every other use of the tracker makes first (:class:`ForkChain`, which
:class:`~hyperrng.streams.tracker.RNGStatesTracker` is): whether a fork is open, and on which thread;
whether its thread has ended (abandoned); whether its own exits can still leave it (stuck), and how a call
that replaces every stream clears it (:class:`Replacing`, the preamble of every such call).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from threading import Thread, current_thread
from types import TracebackType
from typing import Any

import torch

from hyperrng._guard import exclusive as _exclusive
from hyperrng._guard.exclusive import HOLDS as _HOLDS
from hyperrng._guard.interrupts import deferred
from hyperrng.errors import InvalidOperationError, UnknownStreamError
from hyperrng.platforms._features import outside_dynamo
from hyperrng.streams._checkpoints import unreplayed_fork

_OWNER = "thread"


_MODES = torch._C._TorchDispatchModeKey
_exporting = getattr(torch.compiler, "is_exporting", lambda: False)  # a process-wide flag, where torch has it
_tls_included = torch._C._dispatch_tls_is_dispatch_key_included
_PRE_DISPATCH = torch._C.DispatchKey.PreDispatch


def _pre_dispatch_proxy() -> bool:
    """Whether a proxy mode traces at pre-dispatch (the process's stack): with this thread's pre-dispatch key,
    ``make_fx(pre_dispatch=True)`` or torch 2.5's export, which has no flag, traces this thread."""
    return torch._ops._get_dispatch_mode_pre_dispatch(_MODES.PROXY) is not None


_mode_on = torch._C._get_dispatch_mode


def _checkpoint_refusal(name: str, flavour: str) -> InvalidOperationError:
    """The refusal of a fork in the forward pass of a checkpoint whose recompute would not replay the stream."""
    return InvalidOperationError(
        f"stream {name!r} cannot be forked inside torch.utils.checkpoint ({flavour}) without hyperrng's replay: "
        "torch puts its own generators back before the recompute in the backward pass, not the tracker's streams, "
        "so the recompute would draw the stream's next numbers and the gradients would silently differ. Pass "
        "use_reentrant=False, context_fn=hyperrng.checkpoint_context (also to checkpoint_wrapper or the composable "
        "checkpoint), or use hyperrng.checkpoint(fn, *args).",
        reason="tracker",
    )


class _Fork:
    """One ``with tracker.fork(name):`` region; a plain class because it is cheaper than @contextmanager.

    Enter holds the device, claims the tracker, saves what the generator holds, then swaps
    the stream in; exit reads the stream's advance back, restores, pops, releases. Both are
    written so that one interrupt anywhere leaves everything as before the fork or as after
    it (see :mod:`hyperrng._guard.exclusive`).

    One thread at a time (see :mod:`hyperrng._guard.exclusive`): an open fork holds the device
    generator, which the whole process shares. A fork of *any* tracker, a sharded region,
    ``fork_rng`` or a recompute entered on another thread meanwhile raises
    :class:`~hyperrng.errors.InvalidOperationError` there and changes nothing; so do
    :meth:`RNGStatesTracker.add` and :meth:`RNGStatesTracker.reseed`, which seed the generator
    for a moment. A tracker's open forks form one chain, so they stay on one thread even across
    devices.

    One order per thread (asyncio): On one thread, forks of any tracker, sharded regions and
    ``fork_rng`` must be left in the reverse order of entry. asyncio tasks (or generators) that
    ``await`` inside forks interleave them: the first exit out of order raises
    :class:`InvalidOperationError` and changes nothing, the fork stays open, and it leaves when
    exited again once the contexts entered after it have left. Keep ``await`` out of forks, or
    give each task a thread and a tracker of its own.
    """

    # Set by __enter__ before the fork becomes active: read, write, outer, saved (the state to give back
    # outside any fork), thread (its Thread object), held (the device's key, the hold depth before this fork).
    __slots__ = (
        "_tracker",
        "entered",
        "held",
        "name",
        "outer",
        "outside_graph",
        "read",
        "refused",
        "saved",
        "thread",
        "write",
    )
    thread: Thread

    def __init__(self, tracker: Any, name: str) -> None:
        self._tracker = tracker
        self.name = name
        self.entered = False
        self.refused = False  # its exit was refused (out of order): the chain is left open until replaced
        self.outside_graph = False  # entered as Python behind a graph break, while Dynamo traced the block

    @outside_dynamo
    def _enter_outside_the_graph(self) -> None:
        self.__enter__()  # run as Python: there is_dynamo_compiling() is false
        self.outside_graph = True

    @outside_dynamo
    def _exit_outside_the_graph(self, *exc: Any) -> None:
        self.outside_graph = False
        self.__exit__(*exc)

    def __enter__(self) -> None:
        if torch.compiler.is_dynamo_compiling():  # Dynamo: the swap runs as Python behind a graph break, never traced
            return self._enter_outside_the_graph()
        # make_fx (a proxy mode) or torch.export traces this thread's tensor ops, which become a graph. Export's flag
        # is process-wide, so its fake-tensor mode, which is this thread's, must be on here too (asked first: a C call).
        if (
            _mode_on(_MODES.PROXY) is not None
            or (_mode_on(_MODES.FAKE) is not None and _exporting())
            or (_tls_included(_PRE_DISPATCH) and _pre_dispatch_proxy())
        ):
            raise InvalidOperationError(
                f"stream {self.name!r} cannot be forked while torch.export or make_fx traces the code: the fork "
                "swaps the generator in Python, which a graph does not record, so the graph would draw from the "
                "default generator instead. Compile with torch.compile (a fork runs behind a graph break there), "
                "or draw in portable mode (hyperrng.portable_random), whose draws a graph records.",
                reason="tracker",
            )
        tracker = self._tracker
        if tracker._process is not _Process.token:  # the first fork in a child made by fork (a DataLoader worker)
            tracker._join_process()
        if self.entered:
            raise InvalidOperationError(
                f"this fork of stream {self.name!r} is already entered; call tracker.fork() again.", reason="tracker"
            )
        states = tracker._states
        state = states.get(self.name)
        if state is None:  # the tracker was reset between fork() and entering it
            raise UnknownStreamError(tracker._unknown(self.name))
        me = current_thread()
        if tracker._active is not None and tracker._active.thread is not me:
            tracker._check_not_abandoned("fork a stream")
        swap = tracker._swap
        if swap.capturing is not None and swap.capturing():  # type: ignore[union-attr]
            raise tracker._capture_refusal(self.name)
        flavour = unreplayed_fork()
        if flavour is not None:
            raise _checkpoint_refusal(self.name, flavour)
        if tracker._active is not None:  # the other context's stream would be taken for the outer fork's advance
            tracker._check_uncovered(f"fork stream {self.name!r}")
        read, write, key = swap.fixed or swap.bind()  # type: ignore[union-attr]
        below = back = None  # set once the device is held / once what the generator must get back is known
        try:
            below = _exclusive.hold_key(key, me, "tracker.fork", self)
            # A tracker's open forks form one chain, so they stay on one thread. Holding the device
            # ensures that where all of them swap one device's generator; where they may swap
            # several, the tracker is claimed too (dict.setdefault is atomic).
            if not swap.one_device and tracker._claim.setdefault(_OWNER, me) != me:  # type: ignore[union-attr]
                raise InvalidOperationError(
                    f"stream {self.name!r} cannot be forked on this thread while another thread has a fork of "
                    f"stream {tracker.active_stream!r} open: a tracker's forks form one chain. Fork on one "
                    "thread at a time, or give each thread its own tracker.",
                    reason="tracker",
                )
            outer = tracker._active
            if swap.in_place:  # type: ignore[union-attr]
                # Outside any fork the generator holds the default state: keep a view of it.
                # Inside a fork it holds the outer stream's own object, which needs no saving.
                back = read() if outer is None else states[outer.name]
            else:
                back = read()
                if outer is not None:
                    states[outer.name] = back
            self.read, self.write, self.outer, self.thread = read, write, outer, me
            self.held = (key, below)
            self.saved = back if outer is None else None
            write(states[self.name])  # read now: inside a fork of the same stream, its advance just kept
            self.entered = True
            tracker._active = self
        except BaseException:
            if back is not None:
                _exclusive.redo(write, back)
            if tracker._active is self:
                tracker._active = self.outer
            self.entered = False
            if tracker._active is None and tracker._claim.get(_OWNER) == me:
                del tracker._claim[_OWNER]
            if below is not None:
                _exclusive.release_key(key, me, below)
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        tracker = self._tracker
        copies = False
        advanced = None  # the stream's state as the block left it
        if self.outside_graph:  # entered behind a graph break (an attribute read: no point an interrupt lands on)
            return self._exit_outside_the_graph(exc_type, exc, tb)
        try:
            if exc_type is not None and self.entered:  # an interrupt may have skipped exits of contexts inside it
                _exclusive.leave_inner(self, self.held[0])
            # Innermost of its tracker, and of the contexts holding its device on this thread (a fork of
            # another tracker, a region, fork_rng): else contexts were interleaved (asyncio tasks, generators).
            top = _HOLDS.get(self.held[0])
            if tracker._active is not self or (top is not None and top[2] is not self and top[2] is not None):
                if not self.entered:  # reset(), reseed() or set_states() left this fork already
                    return
                raise self._out_of_order(top)
            copies = not tracker._swap.in_place  # type: ignore[union-attr]
            if copies:
                advanced = self.read()
            self._leave(advanced)
        except InvalidOperationError:  # exited out of order: nothing changed (leaving itself never raises it)
            raise
        except BaseException:
            if copies and advanced is None and tracker._active is self:  # cut short before the read: read it now
                advanced = self.read()
            self._leave(advanced)
            raise

    def describe(self) -> str:
        """What this context is, for the messages of the thread policy."""
        return f"fork of stream {self.name!r}"

    def _out_of_order(self, top: Any) -> InvalidOperationError:
        """Refuse this exit (nothing changes) and mark the chain, so that replacing the streams can
        clear it if the exit is never retried (see *Recovery* in :class:`Replacing`)."""
        self.refused = True
        if self._tracker._active is not self:
            inner = f"fork of stream {self._tracker.active_stream!r} of the same tracker"
        else:
            inner = _exclusive.describe(top[2])
        return InvalidOperationError(
            f"fork of stream {self.name!r} exited while a {inner}, entered after it on this thread, is still "
            "open: exit contexts in reverse order (asyncio tasks or generators that interleave forks need a "
            "tracker, and a thread, each). Nothing changed: the fork stays open; exit it again once the later "
            "context has left, or reset(), reseed() or set_states() the tracker to clear it.",
            reason="tracker",
        )

    def _unwind(self) -> None:
        """Leave as ``__exit__`` would, for the exit of an outer context (see :mod:`hyperrng._guard.exclusive`)."""
        active = self._tracker._active is self
        self._leave(self.read() if active and not self._tracker._swap.in_place else None)  # type: ignore[union-attr]

    def _leave(self, advanced: Any) -> None:
        """Keep the stream's advance, restore the generator, pop the fork, release.

        Idempotent, so that an exit cut short by an interrupt can run it again: until the
        fork is popped every step may repeat, and after it only the releases remain.
        """
        tracker = self._tracker
        outer = self.outer
        if tracker._active is self:
            if advanced is not None:
                tracker._states[self.name] = advanced
            self.write(self.saved if outer is None else tracker._states[outer.name])
            self.entered = False
            tracker._active = outer
        self.saved = None
        me, claim = self.thread, tracker._claim
        if outer is None and claim and claim.get(_OWNER) == me:  # the outermost fork: drop the claim
            del claim[_OWNER]
        key, below = self.held
        _exclusive.release_key(key, me, below)


class ForkChain:
    """The chain of a tracker's open forks (``_active``, innermost, each linking to its ``outer``), and the
    checks every use of the tracker makes on it first.

    **Recovery.** Some forks can no longer be left by their own exits: one whose exit was
    refused as out of order and never retried, one whose thread ended without leaving it
    (*abandoned*), and one that a child process made by ``fork`` inherited from the parent's
    thread (the child starts with no holds: :mod:`hyperrng._guard.exclusive` clears them at the
    fork). Other uses of such a tracker are refused with :class:`InvalidOperationError`.
    :meth:`RNGStatesTracker.reset`, :meth:`RNGStatesTracker.reseed` and
    :meth:`RNGStatesTracker.set_states` (and so ``apply_layout``, the seeding recipes and
    ``load_rng_state_dict``) clear them on the calling thread: an abandoned chain is dropped,
    with the device generator left as its thread left it; the others are left as their exits
    would leave them (the generator gets back the state it had before the outermost fork),
    and their exits then do nothing. A fork still open, and still exitable, on the calling
    thread is not cleared: ``reset()`` and ``reseed()`` refuse inside it, since its exit would
    restore a stream that is gone.
    """

    _active: _Fork | None

    def _idle(self, what: str, *, replacing: bool = False, here_ok: bool = False) -> None:
        """Refuse ``what`` inside a fork (``here_ok``: only inside one open on another thread); refuse an
        abandoned fork too. ``replacing`` (``what`` replaces every stream) lets stuck forks through
        (:meth:`_stuck`): the caller clears them (:meth:`_leave_forks`)."""
        active = self._active
        if active is None or (replacing and self._stuck()):
            return
        mine = active.thread is current_thread()
        if mine and here_ok:
            return
        self._check_not_abandoned(what)
        if mine and self._stuck():
            raise self._stuck_error(what)
        raise InvalidOperationError(
            f"cannot {what} inside a fork of stream {active.name!r}; do it outside the fork."
            if mine
            else f"cannot {what} while another thread has a fork of stream {active.name!r} open; nothing changed. "
            "Do it once that thread has left the fork (join it, or order the two with a lock or a barrier).",
            reason="tracker",
        )

    def owns(self, context: object) -> bool:
        """Whether ``context`` is one of this tracker's forks (whose holds its own checks cover)."""
        return isinstance(context, _Fork) and context._tracker is self

    def _abandoned(self) -> bool:
        """Whether the open fork's thread ended without leaving it (see *Recovery*)."""
        return self._active is not None and not _exclusive.alive(self._active.thread)

    def _stuck(self) -> bool:
        """Whether the open forks can no longer be left by their own exits (see *Recovery*): their
        thread ended, an exit in the chain was refused as out of order, or this process is a child
        made by ``fork`` inside them (it started without their holds)."""
        if self._abandoned():
            return True
        fork = self._active
        if fork is None or fork.thread is not current_thread():
            return False
        entry = _HOLDS.get(fork.held[0])
        if entry is None or entry[0] is not fork.thread:  # inherited: the child's holds were cleared
            return True
        while fork is not None:
            if fork.refused:
                return True
            fork = fork.outer
        return False

    def _check_uncovered(self, what: str, writing: bool = False) -> None:
        """Refuse ``what`` (nothing changes) while this thread's active fork has a context that swapped its device's
        generator open inside it (a fork of another tracker, a sharded region, a ``portable_random(seed)`` block):
        the generator holds that context's stream until its exit, not the fork's, whose advance that context keeps
        to put back. ``fork_rng`` swaps nothing in (the fork's stream draws on) but puts back what it found at its
        exit, which would undo ``writing`` the stream."""
        fork = self._active
        if fork is None or fork.thread is not current_thread():
            return
        top = _HOLDS.get(fork.held[0])
        if top is not None and top[0] is fork.thread and top[2] is not fork and top[2] is not None:
            if not writing and getattr(top[2], "continues", False):
                return
            raise InvalidOperationError(
                f"cannot {what} while a {_exclusive.describe(top[2])} is open inside this tracker's fork of stream "
                f"{fork.name!r}: the generator holds that context's stream until its exit; do it after that exit, "
                "or before the context was entered.",
                reason="tracker",
            )

    def _stuck_error(self, what: str) -> InvalidOperationError:
        return InvalidOperationError(
            f"cannot {what}: the fork of stream {self.active_stream!r} is still open on this thread but its own exit "
            "can no longer leave it (an exit was refused as out of order, or this process was made by fork inside "
            "it); reset(), reseed() or set_states() clears it.",
            reason="tracker",
        )

    def _check_forks_leavable(self, what: str) -> None:
        """Refuse, before anything changes, to leave this thread's open forks while a context
        entered inside them still holds their device: leaving them would release its hold too."""
        chain = []
        fork = self._active
        while fork is not None:
            chain.append(fork)
            fork = fork.outer
        if not chain or self._abandoned() or not self._stuck():
            return
        for key in {f.held[0] for f in chain}:
            bottom = min(f.held[1] for f in chain if f.held[0] == key)
            other = _exclusive.held_above(key, bottom, chain)
            if other is not None:
                raise InvalidOperationError(
                    f"cannot {what}: a {_exclusive.describe(other[2])} entered inside the tracker's open fork of "
                    f"stream {chain[-1].name!r} is still open on this thread; leave it first.",
                    reason="tracker",
                )

    def _leave_forks(self) -> None:
        """Clear a stuck chain of forks (:meth:`_stuck`; nothing otherwise): on this thread, leave
        them as their exits would, innermost first (their own exits then do nothing); a chain whose
        thread has ended is dropped, the generator left as that thread left it. Call
        :meth:`_check_forks_leavable` first."""
        if self._active is None or not self._stuck():
            return
        if self._abandoned():
            self._active = None
            self._claim.clear()
            return
        while self._active is not None:
            self._active._unwind()

    def _check_not_abandoned(self, what: str) -> None:
        if self._abandoned():
            raise InvalidOperationError(
                f"cannot {what}: a fork of stream {self.active_stream!r} was left open by thread "
                f"{self._active.thread.ident} that has ended, so the tracker no longer knows what its streams hold; "  # type: ignore[union-attr]
                "reset() and reseed it, or set_states() a snapshot taken before.",
                reason="tracker",
            )


class _Process:
    """A token that a child made by ``fork`` replaces: each tracker compares its own with it before a fork."""

    token = object()


def _after_fork_in_child() -> None:
    _Process.token = object()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Replacing:
    """The preamble of every call that replaces all of a tracker's streams (``reset()``, ``reseed()``,
    ``apply_layout``, the seeding recipes, ``load_rng_state_dict``), in one place.

    Made before anything changes, it refuses what such a call may not do, with nothing changed: inside
    a fork whose own exit could still leave it (that exit would restore a stream that is gone), or
    while a context entered inside a fork it would clear still holds the device; with ``target``, also
    a platform the tracker cannot bind to, whose swap it then holds (``swap``) for the new states; and
    while another thread holds one of the generators ``holds`` (named ``holding_what`` in the refusal, as
    :func:`hyperrng._guard.exclusive.holding` names it). :meth:`applying` is the block that replaces them: it
    defers signals (all of it or none, under Ctrl-C too), first clears the forks their own exits can no
    longer leave (*Recovery* in :class:`~hyperrng.streams._chain.ForkChain`), then holds ``holds`` while the block runs.

    """

    __slots__ = ("tracker", "swap", "_holds", "_holding_what")

    def __init__(
        self,
        tracker: Any,
        what: str,
        *,
        target: bool = True,
        holds: Sequence[tuple[str, int]] = (),
        holding_what: str = "",
    ) -> None:
        tracker._idle(what, replacing=True)
        self.tracker = tracker
        self.swap = tracker._target(rebind=True) if target else None
        tracker._check_forks_leavable(what)
        self._holds, self._holding_what = holds, holding_what or what
        # Refused here, before applying() clears forks: the hold's own refusal would come after that.
        _exclusive.refuse_held(holds, self._holding_what)

    @contextlib.contextmanager
    def applying(self) -> Iterator[None]:
        with deferred():
            self.tracker._leave_forks()  # first: leaving a fork releases holds down to its own level
            with _exclusive.holding(self._holds, self._holding_what):
                yield
            self.tracker._process = _Process.token  # new streams are this process's: no worker re-derives them
