"""Trackers recover: forks that their own exits can no longer leave (an exit refused as out of order,
a fork a child process inherited, a thread that ended inside one) are cleared by reset(), reseed(),
set_states(), apply_layout and the seeding recipes; out-of-order exits of different trackers on one
thread are refused, not drawn silently wrong. Policies: they hold on whatever platform is current."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from collections.abc import Iterator
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch
from torch.distributed.tensor import Shard

import hyperrng
from hyperrng._guard import exclusive as _exclusive
from hyperrng.errors import InvalidOperationError
from hyperrng.seeding.layout import StreamLayout
from hyperrng.sharding.tracker import MeshInfo, ShardedRNGTracker, active_region
from hyperrng.streams.fork import fork_rng
from hyperrng.streams.tracker import RNGStatesTracker, get_rng_tracker
from tests._threads import OnAnotherThread

LAYOUT = StreamLayout(dims=("tp",), default=(), streams={"a": ("tp",), "b": ("tp",)})


@pytest.fixture(autouse=True)
def _fresh_global_tracker() -> Iterator[None]:
    get_rng_tracker().reset()
    yield
    get_rng_tracker().reset()


def _device() -> torch.Tensor:
    return platforms.current().get_rng_state()


def _no_hold_left() -> bool:
    p = platforms.current()
    return all(_exclusive.holder(*key) is None for key in [("cpu", 0), (p.device_type, p.current_device())])


def _tracker(**seeds: int) -> RNGStatesTracker:
    tracker = RNGStatesTracker()
    tracker.reseed(seeds)
    return tracker


async def _fork_and_wait(tracker: RNGStatesTracker, name: str, entered: asyncio.Event, leave: asyncio.Event) -> None:
    with tracker.fork(name):
        entered.set()
        await leave.wait()


async def _interleave(first: Any, second: Any) -> list[BaseException | None]:
    """Task 1 enters ``first``, task 2 enters ``second``, then task 1 leaves before task 2: the exit
    order asyncio tasks give when they await inside forks. Returns each task's outcome."""
    entered = [asyncio.Event(), asyncio.Event()]
    leave = [asyncio.Event(), asyncio.Event()]
    one = asyncio.ensure_future(_fork_and_wait(*first, entered[0], leave[0]))
    await entered[0].wait()
    two = asyncio.ensure_future(_fork_and_wait(*second, entered[1], leave[1]))
    await entered[1].wait()
    leave[0].set()
    outcomes: list[BaseException | None] = []
    for task, release in ((one, None), (two, leave[1])):
        if release is not None:
            release.set()
        try:
            await task
            outcomes.append(None)
        except InvalidOperationError as exc:
            outcomes.append(exc)
    return outcomes


# -- an exit refused as out of order ------------------------------------------------------------------


def test_after_a_refused_out_of_order_exit_reset_reseed_and_apply_layout_work_again() -> None:
    # Before, the fork whose exit was refused stayed open for good: reset(), reseed(), apply_layout
    # and rng_state_dict refused the tracker for the rest of the process.
    tracker = get_rng_tracker()
    tracker.reseed({"a": 1, "b": 2})
    default = _device()
    outcomes = asyncio.run(_interleave((tracker, "a"), (tracker, "b")))
    assert isinstance(outcomes[0], InvalidOperationError) and outcomes[1] is None
    assert "reverse order" in str(outcomes[0]) and outcomes[0].reason == "tracker"  # type: ignore[attr-defined]
    assert tracker.active_stream == "a", "the refused fork stays open (nothing changed)"
    with pytest.raises(InvalidOperationError, match="reset\\(\\), reseed\\(\\) or set_states\\(\\) clears it"):
        hyperrng.rng_state_dict()
    tracker.reset()
    assert tracker.active_stream is None and _no_hold_left()
    assert torch.equal(_device(), default), "left as the exits would: the generator has its state before the forks"
    hyperrng.apply_layout(LAYOUT, 5, {"tp": 0})
    hyperrng.rng_state_dict()
    with tracker.fork("a"):
        pass


@pytest.mark.parametrize("clear", ["reseed", "set_states", "apply_layout", "load_rng_state_dict"])
def test_each_call_that_replaces_the_streams_clears_a_refused_fork(clear: str) -> None:
    tracker = get_rng_tracker()
    tracker.reseed({"a": 1, "b": 2})
    snapshot, checkpoint = tracker.get_states(), hyperrng.rng_state_dict()
    default = _device()
    asyncio.run(_interleave((tracker, "a"), (tracker, "b")))
    {
        "reseed": lambda: tracker.reseed({"a": 3, "b": 4}),
        "set_states": lambda: tracker.set_states(snapshot),
        "apply_layout": lambda: hyperrng.apply_layout(LAYOUT, 5, {"tp": 0}),
        "load_rng_state_dict": lambda: hyperrng.load_rng_state_dict(checkpoint),
    }[clear]()
    assert tracker.active_stream is None and _no_hold_left()
    if clear in ("reseed", "set_states"):  # these leave the device generator as the forks' exits would
        assert torch.equal(_device(), default)


def test_a_checkpoint_loads_into_a_tracker_whose_fork_a_thread_that_ended_left_open() -> None:
    tracker = get_rng_tracker()
    tracker.reseed({"a": 1, "b": 2})
    checkpoint = hyperrng.rng_state_dict()
    expected = tracker.get_states()
    thread = threading.Thread(target=lambda: tracker.fork("a").__enter__())  # ends inside the fork
    thread.start()
    thread.join()
    with pytest.raises(InvalidOperationError, match="has ended"):
        hyperrng.rng_state_dict()
    hyperrng.load_rng_state_dict(checkpoint)
    assert tracker.active_stream is None and _no_hold_left()
    assert all(torch.equal(expected[k], v) for k, v in tracker.get_states().items())


_REPLACING_CALLS = {
    "load_rng_state_dict": lambda tracker, saved: hyperrng.load_rng_state_dict(saved, tracker=tracker),
    "set_random_seed": lambda tracker, saved: hyperrng.set_random_seed(3, tracker=tracker),
    "apply_layout": lambda tracker, saved: hyperrng.apply_layout(
        StreamLayout(["dp"], [], {"a": []}), 3, {"dp": 0}, tracker=tracker
    ),
}


@pytest.mark.parametrize("call", list(_REPLACING_CALLS))
def test_a_call_refused_because_another_thread_holds_the_device_leaves_an_abandoned_fork_in_place(call: str) -> None:
    """Busy is known before the forks are cleared: the refused call changes nothing, the tracker's record of
    the fork a thread that ended left open included."""
    tracker = _tracker(a=1)
    saved = hyperrng.rng_state_dict(tracker=tracker)
    ended = threading.Thread(target=lambda: tracker.fork("a").__enter__())
    ended.start()
    ended.join()
    with OnAnotherThread(fork_rng):
        before = _device()
        with pytest.raises(InvalidOperationError, match="was refused: thread") as info:
            _REPLACING_CALLS[call](tracker, saved)
        assert info.value.reason == "busy"
        assert tracker.active_stream == "a" and torch.equal(_device(), before)
    _REPLACING_CALLS[call](tracker, saved)  # and once the device is free, it clears the fork and runs
    assert tracker.active_stream is None and _no_hold_left()


def test_a_live_fork_on_this_thread_still_refuses_reset_and_nothing_changes() -> None:
    tracker = _tracker(a=1)
    with tracker.fork("a"):
        before = _device()
        with pytest.raises(InvalidOperationError, match="inside a fork"):
            tracker.reset()
        assert torch.equal(_device(), before) and tracker.active_stream == "a"


def test_a_refused_fork_is_not_cleared_while_a_context_entered_inside_it_is_open() -> None:
    tracker = _tracker(a=1, b=2)
    asyncio.run(_interleave((tracker, "a"), (tracker, "b")))
    with fork_rng():  # entered inside the open fork: clearing it would release this hold too
        with pytest.raises(InvalidOperationError, match="a fork_rng entered inside"):
            tracker.reset()
        assert tracker.active_stream == "a"
    tracker.reset()
    assert tracker.active_stream is None and _no_hold_left()


# -- contexts of different trackers interleaved on one thread ----------------------------------------


_CONTEXTS = {
    "fork": lambda tracker: tracker.fork("a"),
    "sharded-region": lambda tracker: ShardedRNGTracker().distribute_region(MeshInfo((2,), (1,)), [Shard(0)], (8,)),
    "fork_rng": lambda tracker: fork_rng(),  # every device: it overlaps a fork on any platform
}


@pytest.mark.parametrize("second", list(_CONTEXTS))
@pytest.mark.parametrize("first", list(_CONTEXTS))
def test_an_exit_before_a_context_entered_after_it_is_refused_and_can_be_retried_after_it(
    first: str, second: str
) -> None:
    # Before, two trackers' contexts interleaved by asyncio tasks exited without complaint, and every
    # stream and the default generator ended wrong.
    trackers = _tracker(a=1), _tracker(a=2)
    opened = [_CONTEXTS[first](trackers[0]), _CONTEXTS[second](trackers[1])]

    async def run() -> BaseException | None:
        entered = [asyncio.Event(), asyncio.Event()]
        leave = [asyncio.Event(), asyncio.Event()]

        async def hold(index: int) -> None:
            try:
                with opened[index]:
                    entered[index].set()
                    await leave[index].wait()
            finally:
                entered[index].set()  # a context that failed to enter must not leave the test waiting

        one = asyncio.ensure_future(hold(0))
        await entered[0].wait()
        two = asyncio.ensure_future(hold(1))
        await entered[1].wait()
        leave[0].set()
        refused = None
        try:
            await one
        except InvalidOperationError as exc:
            refused = exc
        leave[1].set()
        await two
        return refused

    refused = asyncio.run(run())
    assert isinstance(refused, InvalidOperationError) and refused.reason == "tracker"  # type: ignore[attr-defined]
    assert "entered after it on this thread, is still open" in str(refused)
    assert not _no_hold_left(), "the refused context changed nothing: it is still open"
    opened[0].__exit__(None, None, None)  # in order now: it leaves
    assert _no_hold_left() and trackers[0].active_stream is None and trackers[1].active_stream is None
    assert active_region() is None


# -- a child process made by fork inside a fork ------------------------------------------------------


def _in_the_child(results: Any) -> None:
    """Runs in a child made by fork while its parent's main thread is inside ``tracker.fork("a")``."""
    outcome: dict[str, Any] = {"holds": dict(_exclusive.HOLDS)}
    tracker = get_rng_tracker()
    outcome["inherited"] = tracker.active_stream

    def fork_elsewhere() -> None:
        try:
            with _tracker(c=3).fork("c"):
                pass
            outcome["other-thread"] = "forked"
        except BaseException as exc:  # reported to the parent
            outcome["other-thread"] = repr(exc)

    thread = threading.Thread(target=fork_elsewhere)
    thread.start()
    thread.join()
    try:
        tracker.reset()
        hyperrng.apply_layout(LAYOUT, 9, {"tp": 1})
        hyperrng.seed_host(9)
        with tracker.fork("b"):
            pass
        outcome["recovered"] = tracker.active_stream is None
    except BaseException as exc:  # reported to the parent
        outcome["recovered"] = repr(exc)
    results.put({k: (v if k != "holds" else len(v)) for k, v in outcome.items()})


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method")
def test_a_child_made_by_fork_inside_a_fork_starts_with_no_holds_and_can_reset_and_seed() -> None:
    # Before, the child inherited its parent's hold and the open fork: it could never reset or seed
    # its tracker, and its other threads were refused the device.
    context = multiprocessing.get_context("fork")
    results = context.SimpleQueue()
    tracker = get_rng_tracker()
    tracker.reseed({"a": 1, "b": 2})
    with tracker.fork("a"):
        child = context.Process(target=_in_the_child, args=(results,))
        child.start()
        child.join()
    assert child.exitcode == 0
    outcome = results.get()
    assert outcome == {"holds": 0, "inherited": "a", "other-thread": "forked", "recovered": True}
    assert tracker.active_stream is None and _no_hold_left()
