"""Signals deferred across a few steps that must run whole.

CPython runs a signal's Python handler on the main thread, between two bytecodes of whatever
it is executing; a handler that raises (``KeyboardInterrupt`` from SIGINT's default handler,
``SystemExit`` from a SIGTERM handler, an alarm's exception) raises *there*. A step that
writes several generators, or opens a file and records its descriptor, can be cut in the
middle. :func:`deferred` closes that window: while it is entered on the main thread, every
signal that has a Python handler is recorded instead of handled, and when the outermost
``with`` block leaves, the handlers are put back and each recorded signal is raised again
(``signal.raise_signal``), so the program sees it right after the steps, never inside them.

* Only signals with a Python handler are deferred: one left to the operating system
  (``SIG_DFL``: SIGTERM and SIGKILL end the process; ``SIG_IGN``) acts as before. A process
  that dies cannot leave its memory half-written; a file it leaves is for the next save to
  clean up (see :func:`hyperrng.save_rng_state`).
* Other threads never run signal handlers, so there is nothing to defer: :func:`deferred`
  does nothing there.
* Entering is itself interruptible: a signal that arrives while the handlers are being
  swapped raises as before, and the handlers already swapped are put back first. Each
  stand-in remembers the handler it replaced and, once no deferral is open, passes a signal
  straight to it, so one that a second interrupt left in place behaves as the original.
* A child process made by ``fork`` (on another thread) while the main thread defers starts
  without the deferral: its handlers are put back.
* Deferrals nest (a seeding recipe that restores the host inside ``apply_layout``): only
  the outermost one swaps and restores.

Keep the deferred steps short: Ctrl-C waits for them. Nothing here blocks; the steps
deferred in hyperrng are a handful of generator writes and file-system calls.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

try:  # the C functions behind signal's: its wrappers turn every handler into an enum, a hundred times slower
    from _signal import getsignal as _getsignal
    from _signal import signal as _setsignal
except ImportError:  # another Python implementation
    from signal import getsignal as _getsignal
    from signal import signal as _setsignal

__all__ = ["deferred"]

# Every signal a Python handler can be installed for (SIGKILL and SIGSTOP cannot be caught).
_SIGNALS = tuple(
    s for s in signal.valid_signals() if s not in {getattr(signal, "SIGKILL", None), getattr(signal, "SIGSTOP", None)}
)


class _Deferral:
    """The main thread's deferral: its depth, the handlers it replaced, the signals it recorded."""

    def __init__(self) -> None:
        self.depth = 0
        self.replaced: dict[int, Any] = {}  # signal -> the handler its stand-in replaced (kept: see _stand_in)
        self.pending: list[int] = []
        self.stand_in = self._stand_in  # one bound method, so that getsignal() can be compared with it

    def _stand_in(self, signum: int, frame: FrameType | None) -> None:
        if self.depth:
            if signum not in self.pending:
                self.pending.append(signum)
            return
        original = self.replaced.get(signum)  # left in place by an interrupted restore: act as the original
        if callable(original):
            original(signum, frame)

    def enter(self) -> None:
        if self.depth:
            self.depth += 1
            return
        try:
            for signum in _SIGNALS:
                handler = _getsignal(signum)
                if callable(handler) and handler != self.stand_in:
                    self.replaced[signum] = handler
                    _setsignal(signum, self.stand_in)
        except BaseException:  # a signal not yet swapped fired: nothing is deferred, put back what was
            self._restore()
            raise
        self.depth = 1

    def leave(self) -> None:
        self.depth -= 1
        if self.depth:
            return
        try:
            self._restore()
        finally:
            pending, self.pending = self.pending, []
            for signum in pending:
                signal.raise_signal(signum)  # handled now, by the handler in place again

    def _restore(self) -> None:
        error: BaseException | None = None
        for signum, handler in list(self.replaced.items()):
            try:
                if _getsignal(signum) == self.stand_in:
                    _setsignal(signum, handler)
            except BaseException as exc:  # a signal already restored fired: restore the others first
                error = error or exc
        if error is not None:
            raise error


_MAIN = _Deferral()


def _after_fork_in_child() -> None:
    # A child made by fork on another thread while the main thread deferred: its only thread will
    # never leave that deferral, so it starts without one (its handlers back, nothing recorded).
    if _MAIN.depth:
        _MAIN.depth, _MAIN.pending = 0, []
        _MAIN._restore()


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
            _MAIN.leave()


def deferred() -> _Deferred:
    """A context manager that defers, on the main thread, every signal with a Python handler
    until its block has run (see the module docstring); elsewhere it does nothing."""
    return _Deferred()
