"""A context held on another thread while the main thread tries something: the tests of the thread policy."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import hyperrng.platforms as platforms
import torch

DEADLOCK_GUARD = 60.0  # seconds: only so that a broken hold fails the test instead of hanging it


def rand(n: int) -> torch.Tensor:
    """``n`` numbers from the current device's generator (a fork's stream inside a fork), on the host."""
    return torch.rand(n, device=platforms.current().device()).cpu()


class OnAnotherThread:
    """Thread A: enters ``context``, runs ``inside`` there, then waits until the ``with`` block ends."""

    def __init__(self, context: Callable[[], AbstractContextManager[Any]], inside: Callable[[], object] = lambda: None):
        self._context, self._inside = context, inside
        self._entered, self._leave = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run)
        self.drawn: list[torch.Tensor] = []

    def _run(self) -> None:
        try:
            with self._context():
                self.drawn.append(rand(4))
                self._entered.set()
                assert self._leave.wait(DEADLOCK_GUARD)
                self.drawn.append(rand(4))
        except BaseException as exc:  # handed to the main thread
            self._error = exc
            self._entered.set()

    def __enter__(self) -> OnAnotherThread:
        self._thread.start()
        assert self._entered.wait(DEADLOCK_GUARD)
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        self._leave.set()
        self._thread.join(DEADLOCK_GUARD)
        assert not self._thread.is_alive()
        if self._error is not None:
            raise self._error
