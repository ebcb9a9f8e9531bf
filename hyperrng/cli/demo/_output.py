"""What the demo's parent prints: a line per phase as the ranks reach it, then the per-rank
table and one verdict per property.

The ranks report each phase on a queue; the parent prints a phase's line once every rank
has reported it (inside a torchrun job, rank 0 prints its own).
"""

from __future__ import annotations

import multiprocessing
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hyperrng.seeding.layout import DEFAULT_STREAM
from hyperrng.streams.tracker import MODEL_PARALLEL_STREAM

__all__ = ["REPORT_WIDTH", "Phases", "Report", "relayed", "table", "verdict_lines"]

REPORT_WIDTH = 100
"""Columns the demo's report is laid out in: a verdict whose detail would pass it puts the detail below."""

_QUIET_S = 15.0
_POLL_S = 0.05  # how soon the relay thread sees a report, or the end of its block


class Report:
    """How a rank reports a phase: onto the parent's queue, or (inside a torchrun job, where
    there is no parent) straight to rank 0's own :class:`Phases`. Picklable with a queue.

    The queue is a ``SimpleQueue``: its ``put`` has written the report to the pipe when it
    returns, so a rank that ends with ``os._exit`` loses none of its reports (a ``Queue``
    hands them to a feeder thread, which such an exit would cut short).
    """

    def __init__(self, events: Any = None, phases: Phases | None = None) -> None:
        self._events = events
        self._phases = phases

    def __call__(self, rank: int, key: str, text: str) -> None:
        if self._events is not None:
            self._events.put((rank, key, text))
        elif self._phases is not None and rank == 0:
            self._phases.record(rank, key, text)


class Phases:
    """The parent's view of the ranks' progress: a phase's line (rank 0's text) is printed
    once ``expected`` ranks have reported it, in the order the phases complete."""

    def __init__(self, emit: Callable[[str], None], expected: int) -> None:
        self._emit = emit
        self._expected = expected
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {}
        self._text: dict[str, str] = {}
        self._stage = ""
        self._started = self._last = time.monotonic()

    def start(self, stage: str, text: str) -> None:
        """A new stage (``train``, ``resume``): its first line, and the clock its phases are timed on."""
        with self._lock:
            self._stage, self._seen, self._text = stage, {}, {}
            self._started = time.monotonic()
            self._say(text)

    def record(self, rank: int, key: str, text: str) -> None:
        with self._lock:
            self._seen[key] = self._seen.get(key, 0) + 1
            if rank == 0:
                self._text[key] = text
            if self._seen[key] == self._expected:
                self._say(self._text[key])

    def still_waiting(self) -> None:
        """Say so after :data:`_QUIET_S` without a line (starting many processes takes a while)."""
        with self._lock:
            if time.monotonic() - self._last > _QUIET_S:
                self._say("... still running" if self._seen else "... still starting")

    def say(self, text: str) -> None:
        """A line of the current stage that no rank reports (the parent's own)."""
        with self._lock:
            self._say(text)

    def _say(self, text: str) -> None:
        self._last = time.monotonic()
        self._emit(f"{self._stage:>8} {self._last - self._started:6.1f}s  {text}")


@contextmanager
def relayed(phases: Phases) -> Iterator[Report]:
    """A report whose queue a thread of this process reads into ``phases`` while the block runs.

    Every rank has exited (or been killed) by the end of the block, so what it reported is in
    the queue by then; the thread reads it to the end before it stops.
    """
    events = multiprocessing.get_context("spawn").SimpleQueue()
    done = threading.Event()

    def relay() -> None:
        while not (done.is_set() and events.empty()):  # done first: once it is set, nothing more arrives
            if not events.empty():
                phases.record(*events.get())
            elif not done.wait(_POLL_S):
                phases.still_waiting()

    thread = threading.Thread(target=relay, name="hyperrng-demo-progress", daemon=True)
    thread.start()
    try:
        yield Report(events)
    finally:
        done.set()
        thread.join()
        events.close()


def table(trained: list[dict[str, Any]]) -> str:
    """One row per rank: coordinates, both seeds, the last step's masks and loss, the sharded op's shard."""
    head = (
        f"{'rank':>4} {'dp':>3} {'tp':>3}  {'default seed':<18} {'TP-stream seed':<18} "
        f"{'mask in':<9} {'mask out':<9} {'shard':<9} {'loss':>9}"
    )
    lines = [head, "-" * len(head)]
    for rank, row in enumerate(trained):
        last = row["steps"][-1]
        lines.append(
            f"{rank:>4} {row['coords']['dp']:>3} {row['coords']['tp']:>3}  "
            f"{row['seeds'][DEFAULT_STREAM]:#018x} {row['seeds'][MODEL_PARALLEL_STREAM]:#018x} "
            f"{last['in']:<9} {last['out']:<9} {row['sharded']['fp']:<9} {last['loss']:>9.5f}"
        )
    return "\n".join(lines)


def verdict_lines(verdicts: list[tuple[str, bool, str]]) -> list[str]:
    """One line per verdict, ``[PASS] name  (detail)``; a detail that would carry the line past
    :data:`REPORT_WIDTH` goes below its verdict instead, wrapped and indented."""
    lines = []
    for name, holds, detail in verdicts:
        verdict = f"  [{'PASS' if holds else 'FAIL'}] {name}"
        line = f"{verdict}  ({detail})"
        if len(line) <= REPORT_WIDTH:
            lines.append(line)
        else:
            pad = " " * 9  # under the name, past "  [PASS] "
            lines += [verdict, *textwrap.wrap(detail, REPORT_WIDTH, initial_indent=pad, subsequent_indent=pad)]
    return lines
