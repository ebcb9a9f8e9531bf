"""Signals deferred across a few steps that must run whole: :func:`deferred` holds back, on the main thread, every
signal that has a Python handler while a step that writes several generators, or opens a file and records its
descriptor, runs, and handles each right after it, so that a handler that raises never cuts such a step in the middle;
:class:`SignalExceptions` makes an exception that a signal's handler raises during a save or a load of a checkpoint
reach the caller as itself.

How the deferred signals come out, and what is not deferred: :func:`deferred`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any

try:  # the C functions behind signal's: its wrappers turn every handler into an enum, a hundred times slower
    from _signal import getsignal as _getsignal
    from _signal import signal as _setsignal
except ImportError:  # another Python implementation
    from signal import getsignal as _getsignal
    from signal import signal as _setsignal

__all__ = ["SignalExceptions", "deferred"]

# Every signal a Python handler can be installed for (SIGKILL and SIGSTOP cannot be caught).
_SIGNALS = tuple(
    s for s in signal.valid_signals() if s not in {getattr(signal, "SIGKILL", None), getattr(signal, "SIGSTOP", None)}
)

# What a handler raised, with the signal it handled (None: one the interpreter ran itself).
_Raised = tuple[int | None, BaseException]


class _Deferral:
    """The main thread's deferral: its depth, the handlers it replaced, the signals it recorded.

    The stand-ins record a signal while a block is open (``depth``) and while the recorded ones
    are handled (``draining``); recording never raises, so the interpreter can run a stand-in
    anywhere in this class's code without cutting it. ``pending`` only grows at its end and
    shrinks at its start, one signal at a time.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.swapping = False  # the outermost enter is swapping the handlers
        self.draining = False
        self.replaced: dict[int, Any] = {}  # signal -> the handler its stand-in replaced (kept: see _stand_in)
        self.pending: list[int] = []  # one entry per arrival, oldest first
        self.thread = threading.main_thread().ident  # the thread that runs handlers (see _after_fork_in_child)
        self.stand_in = self._stand_in  # one bound method, so that getsignal() can be compared with it

    def _stand_in(self, signum: int, frame: FrameType | None) -> None:
        if self.depth or self.draining:
            self.pending.append(signum)
            return
        original = self.replaced.get(signum)  # left in place by an interrupted restore: act as the original
        if callable(original):
            original(signum, frame)

    def enter(self) -> None:
        """Open a deferral (or nest in one).

        Entering is itself interruptible: a signal that arrives while the handlers are being
        swapped, before its own, is handled as usual. If its handler raises, nothing is deferred:
        as at the end of a block, what was recorded so far is handled, the handlers are put back,
        and the exception is raised. If it defers signals itself, its section nests in the
        deferral being opened and swaps the handlers left at once (on its own, its end would put
        back the stand-ins swapped so far; unswapped, a signal could cut it short). Each stand-in
        remembers the handler it replaced and, once no deferral is open, passes a signal straight
        to it, so one that a second interrupt left in place behaves as the original.
        """
        if self.depth and not self.swapping:
            self.depth += 1
            return
        # The outermost deferral, or one in a handler run while the outermost swaps (for a signal not
        # yet swapped): that one swaps the rest at once, and nests. Open before swapping: a stand-in
        # already in place records, and a nested section does not put the stand-ins back at its end.
        outermost = not self.swapping
        self.depth += 1
        self.swapping = True
        try:
            for signum in _SIGNALS:
                handler = _getsignal(signum)
                if callable(handler) and handler != self.stand_in:
                    self.replaced[signum] = handler
                    _setsignal(signum, self.stand_in)
        except BaseException as exc:  # a signal not yet swapped fired and its handler raised: defer nothing
            if not outermost:  # the exception goes through the outermost's swap too
                self.depth -= 1
                raise
            self.swapping = False
            if self.draining:  # in a handler being re-delivered: the drain handles the rest
                self.depth = 0
                raise
            self._close(sys._getframe(2), [(None, exc)])  # what was recorded, handled; the handlers back
            raise  # (_close raised already)
        if outermost:
            self.swapping = False

    def leave(self, frame: FrameType | None) -> None:
        if self.depth > 1 or self.draining:  # nested, or a handler's own block: the outermost one handles
            self.depth -= 1
            return
        self._close(frame, [])

    def _close(self, frame: FrameType | None, raised: list[_Raised]) -> None:
        """Handle every signal recorded, put the handlers back, raise one exception of those raised."""
        self.draining = True  # before the depth drops: a signal in between is recorded all the same
        self.depth = 0
        try:
            self._drain(frame, raised)
        finally:
            self.draining = False  # (the drain has cleared it, unless an exception escaped it)
            try:
                self._restore(raised)
            except BaseException as exc:  # a signal handled as usual, between two restores
                raised.append((None, exc))
        if raised:
            raise _reported(raised)

    def _drain(self, frame: FrameType | None, raised: list[_Raised]) -> None:
        pending = self.pending
        while pending:
            signum = pending[0]
            del pending[0]  # taken, with no call in between: a stand-in run meanwhile only appends
            try:
                self._handle(signum, frame)
            except BaseException as exc:  # the others run all the same; one exception is raised at the end
                raised.append((signum, exc))
        # The queue is empty: stop recording, with no call since the test (nothing can slip in between).
        self.draining = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        handler = _getsignal(signum)
        if handler == self.stand_in:
            handler = self.replaced.get(signum)
        if callable(handler):
            handler(signum, frame)
        elif handler != signal.SIG_IGN:  # SIG_DFL, or a handler installed outside Python, put there meanwhile
            signal.raise_signal(signum)

    def _restore(self, raised: list[_Raised]) -> None:
        for signum, handler in list(self.replaced.items()):
            try:
                if _getsignal(signum) == self.stand_in:
                    _setsignal(signum, handler)
            except BaseException as exc:  # a signal already restored fired: restore the others first
                raised.append((None, exc))


def _reported(raised: list[_Raised]) -> BaseException:
    """The exception to raise of those the handlers raised: the first request to stop (one that
    is not an ``Exception``), else the first; the others named in its notes."""
    chosen = next((exc for _, exc in raised if not isinstance(exc, Exception)), raised[0][1])
    for signum, exc in raised:
        if exc is not chosen:
            source = "a signal's handler" if signum is None else f"the handler of {_name(signum)}"
            _note(chosen, f"{source} raised {exc!r} as well")
    return chosen


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _note(exc: BaseException, text: str) -> None:
    if hasattr(exc, "add_note"):  # Python 3.11
        exc.add_note(text)
    else:
        notes = getattr(exc, "__notes__", None)
        if not isinstance(notes, list):
            notes = []
            exc.__notes__ = notes  # type: ignore[attr-defined]
        notes.append(text)


_MAIN = _Deferral()


def _after_fork_in_child() -> None:
    # CPython drops the signals caught but not handled before a fork; so do we (in place: a drain
    # under way in this stack then ends). A child made by fork on another thread while the main
    # thread deferred: its only thread will never leave that deferral, so it starts without one.
    del _MAIN.pending[:]
    forked_by = threading.get_ident()
    if forked_by != _MAIN.thread:
        _MAIN.thread = forked_by  # the child's main thread from now on
        if _MAIN.depth or _MAIN.draining:
            _MAIN.depth, _MAIN.swapping, _MAIN.draining = 0, False, False
            _MAIN._restore([])


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Deferred:
    """What :func:`deferred` returns."""

    __slots__ = ("_active",)

    def __init__(self) -> None:
        self._active = False

    def __enter__(self) -> None:
        if threading.current_thread() is threading.main_thread():
            _MAIN.enter()
            self._active = True

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._active:
            self._active = False
            _MAIN.leave(sys._getframe(1))


def deferred() -> _Deferred:
    """A context manager that defers, on the main thread, every signal with a Python handler
    until its block has run, then handles each (as below); elsewhere it does nothing.

    CPython runs a signal's Python handler on the main thread, between two bytecodes of whatever
    it is executing; a handler that raises (``KeyboardInterrupt`` from SIGINT's default handler,
    ``SystemExit`` from a SIGTERM handler, an alarm's exception) raises *there*. A step that
    writes several generators, or opens a file and records its descriptor, can be cut in the
    middle. :func:`deferred` closes that window: while it is entered on the main thread, every
    signal that has a Python handler is recorded instead of handled, and when the outermost
    ``with`` block leaves, each recorded signal is handled, so the program sees it right after
    the steps, never inside them.

    How the recorded signals are handled when the block leaves:

    * Every one, once per arrival, in the order they arrived. Arrivals of one signal number
      that come before the interpreter gets to run its handler are one arrival to it (as the
      kernel merges a standard signal sent again while pending); the deferral merges nothing.
    * Each is handled by calling the handler in place for it, with the frame of the code that
      ran the block: the handler the block replaced, or the one a handler has installed since
      (``SIG_DFL`` there does what the operating system does, through ``signal.raise_signal``;
      ``SIG_IGN`` nothing).
    * Every handler runs, even when some raise: each exception is kept and the next handler
      runs. Once all have, one of the exceptions leaves the ``with`` statement: the first that is
      not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``: a request to stop, which an
      ``except Exception`` meant for an ordinary error must not swallow), else the first. The
      others are named in its notes (``__notes__``). Raising the first at once and sending the
      others again with ``signal.raise_signal`` would lose some and leave the outcome to timing:
      the interpreter merges a signal sent again with one of the same number arriving meanwhile,
      and each handler that raised while the first exception unwinds would replace it wherever
      the caller's ``except`` or ``finally`` happened to be.
    * The stand-ins stay in place until the last recorded signal is handled: a signal that
      arrives while the handlers run joins the queue behind those still waiting and is handled
      in its turn, after the handler running returns (or raises), never inside it. So a handler
      run here is not cut by a later signal: Ctrl-C waits for it too. Meanwhile
      ``signal.getsignal`` shows the stand-in; a handler that a handler installs is in place at
      once (its signal is handled as usual, and stays installed). A handler that enters a
      deferred section itself (a hyperrng call from a handler) adds what arrives meanwhile to
      the same queue.
    * Then the handlers are put back, the very objects that were replaced; a signal arriving
      from then on is handled as usual.

    Also:

    * Only signals with a Python handler are deferred: one left to the operating system
      (``SIG_DFL``: SIGTERM and SIGKILL end the process; ``SIG_IGN``) acts as before. A process
      that dies cannot leave its memory half-written; a file it leaves is for the next save to
      clean up (see :func:`hyperrng.save_rng_state`).
    * Other threads never run signal handlers, so there is nothing to defer: :func:`deferred`
      does nothing there.
    * A child process made by ``fork`` starts with nothing recorded (CPython likewise drops, in
      the child, the signals caught but not yet handled). One made by another thread while the
      main thread defers starts without the deferral, its handlers put back: its only thread
      will never leave the block. One made inside the block on the main thread leaves it as the
      parent does.
    * Deferrals nest (a seeding recipe that restores the host inside ``apply_layout``): only
      the outermost one swaps, handles and restores.
    * Entering is itself interruptible (see ``_Deferral.enter``).

    Keep the deferred steps short: Ctrl-C waits for them. Nothing here blocks; the steps
    deferred in hyperrng are a handful of generator writes and file-system calls.
    """
    return _Deferred()


# -- signals' exceptions: what a block raised comes out as itself ---------------------------------
class _Recording:
    """A signal's handler that records what the handler it stands in for raises, while its record is open."""

    __slots__ = ("handler", "owner")

    def __init__(self, handler: Any, owner: SignalExceptions) -> None:
        self.handler, self.owner = handler, owner

    def __call__(self, signum: int, frame: FrameType | None) -> Any:
        owner = self.owner
        if owner.open and frame is not None and frame.f_code is _EXIT_CODE and frame.f_locals.get("self") is owner:
            # Run at the very start of the owner's __exit__ (CPython handles a pending signal on entering a
            # function), before it closed its record: a handler that raises here skips that __exit__, which
            # would leave this wrapper installed and recording for good, every later exception kept alive
            # with its frames and the files they hold. Close the record here, as __exit__ would have.
            owner.open = False
            error = owner._restore()  # what a handler raised while the handlers were put back (a Ctrl-C)
            if error is not None:  # raised as __exit__ would have, never lost
                try:
                    self.handler(signum, frame)
                except BaseException as exc:
                    raise _reported([(None, error), (signum, exc)]) from None
                raise error
        try:
            return self.handler(signum, frame)
        except BaseException as exc:
            if owner.open:
                owner.raised.append(exc)
            raise


def _is_deferral(handler: object) -> bool:
    """Whether ``handler`` is the stand-in :func:`deferred` installs (one bound method, compared as
    :mod:`hyperrng._guard.interrupts` compares it)."""
    return callable(handler) and handler == _MAIN.stand_in


class SignalExceptions:
    """An exception that a signal's Python handler raises during a save or a load of a checkpoint (a
    ``KeyboardInterrupt``, a watchdog's ``TimeoutError``) reaches the caller as itself, never rewrapped as a
    :class:`~hyperrng.errors.StorageError` or an :class:`~hyperrng.errors.InvalidArgumentError`, and never
    lost where torch's writer swallowed it.

    A context manager after which an exception raised by a signal's Python handler inside the block
    comes out as itself: when the block raises another exception instead (one that translated it, such
    as the file errors here, or torch's writer, which swallows an exception raised inside a write and
    reports a ``RuntimeError``), or none at all, the first such exception is raised in its place.

    While entered on the main thread it stands a recording wrapper in for every Python handler (other
    threads run no handlers: there it does nothing). Stand-ins of :func:`deferred` that a deferral
    interrupted while it put the handlers back left in place are put back first, by a deferral of
    nothing; one still in place is not wrapped (it passes the signal to the handler it replaced,
    unrecorded). A wrapper that an interrupted exit leaves in place calls the handler it stands in
    for and records nothing; the next entry unwraps it. A signal handled as the exit starts, before its
    first instruction, finds the record open: the wrapper closes it and puts the handlers back first, so
    that a handler raising there leaves no wrapper recording (it would keep every later exception, and
    the files their frames hold, alive).
    """

    __slots__ = ("open", "raised", "_installed")

    def __init__(self) -> None:
        self.open = False
        self.raised: list[BaseException] = []
        self._installed: dict[int, _Recording] = {}

    def __enter__(self) -> SignalExceptions:
        if threading.current_thread() is not threading.main_thread():
            return self
        if any(_is_deferral(_getsignal(signum)) for signum in _SIGNALS):
            with deferred():  # its exit puts back the handlers an interrupted deferral left its stand-ins for
                pass
        self.open = True
        try:
            for signum in _SIGNALS:
                handler = _getsignal(signum)
                if isinstance(handler, _Recording) and not handler.owner.open:  # left by an interrupted exit
                    handler = handler.handler
                # A deferral's stand-in (in place while one is open) passes the signal to the handler it
                # replaced: wrapping it would let the deferral take the wrapper for that handler.
                if callable(handler) and not _is_deferral(handler):
                    stand_in = _Recording(handler, self)
                    self._installed[signum] = stand_in  # recorded first: its handler may run right after
                    _setsignal(signum, stand_in)
        except BaseException:  # a signal fired while the handlers were swapped: put them back, raise it
            self.open = False
            self.raised = []
            self._restore()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.open = False
        error = self._restore()
        first = self.raised[0] if self.raised else error
        self.raised = []
        if first is not None and first is not exc:
            raise first

    def _restore(self) -> BaseException | None:
        error: BaseException | None = None
        for signum, stand_in in self._installed.items():
            try:
                if _getsignal(signum) is stand_in:
                    _setsignal(signum, stand_in.handler)
            except BaseException as exc:  # a signal's handler raised: put back the others first
                error = error or exc
        self._installed = {}
        return error


_EXIT_CODE = SignalExceptions.__exit__.__code__
