"""The thread policy (hyperrng._guard.exclusive) and enter/exit under KeyboardInterrupt.

One thread at a time holds a device's generator; the holder may nest; another thread is
refused with InvalidOperationError before anything changes. Interleavings are made
deterministic with threading.Event: thread A enters and waits inside; the main thread
(B) tries; A leaves only when told to.

The policy holds on every platform, so these tests run on the current one
(``HYPERRNG_PLATFORM=sim`` or ``cuda`` included): draws go to its device, refusals name its
device, and the expected numbers are what its generator draws from a seed.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from types import FrameType
from typing import Any

import hyperrng.platforms as platforms
import numpy as np
import pytest
import torch
from torch.distributed.tensor import Shard

import hyperrng
from hyperrng._guard import exclusive as _exclusive
from hyperrng.errors import InvalidOperationError
from hyperrng.seeding.layout import StreamLayout
from hyperrng.sharding.tracker import MeshInfo, ShardedRNGTracker, active_region
from hyperrng.streams._device_state import HOST, device_keys
from hyperrng.streams.fork import fork_rng
from hyperrng.streams.recompute import checkpoint
from hyperrng.streams.tracker import RNGStatesTracker
from tests._threads import DEADLOCK_GUARD as _DEADLOCK_GUARD
from tests._threads import OnAnotherThread as _OnAnotherThread
from tests._threads import rand as _rand

_REGION_ARGS = (MeshInfo((2,), (1,)), [Shard(0)], (8,))


def _key() -> str:
    """How refusals name the current device's generator: ``"cpu:0"``, ``"cuda:0"``, ``"sim:0"``."""
    platform = platforms.current()
    return f"{platform.device_type}:{platform.current_device()}"


def _seeded(seed: int, *sizes: int) -> torch.Tensor:
    """What draws of ``sizes`` give from a stream seeded with ``seed`` (as a fresh stream starts)."""
    platform = platforms.current()
    with fork_rng():
        platform.manual_seed(seed)
        return torch.cat([_rand(n) for n in sizes])


def _tracker(**seeds: int) -> RNGStatesTracker:
    tracker = RNGStatesTracker()
    tracker.reseed(seeds)
    return tracker


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _no_holds() -> bool:
    """No thread holds torch's CPU generator or a device's generator of the current platform."""
    return all(_exclusive.holder(*key) is None for key in device_keys(platforms.current()) + [HOST])


@pytest.fixture(autouse=True)
def _holds_left_clean() -> Iterator[None]:
    yield
    clean = _no_holds()
    _exclusive._HOLDS.clear()  # a failed test must not make every later one fail too
    assert clean, "a hold was left behind"


# -- the primitive --------------------------------------------------------------------------------
def test_a_hold_returns_the_depth_before_it_and_nested_holds_count() -> None:
    assert _exclusive.hold("dev", 7, "test") == 0
    assert _exclusive.hold("dev", 7, "test") == 1
    assert _exclusive.depth("dev", 7) == 2 and _exclusive.holder("dev", 7) == threading.get_ident()
    _exclusive.release("dev", 7)
    assert _exclusive.depth("dev", 7) == 1
    _exclusive.release("dev", 7)
    assert _exclusive.holder("dev", 7) is None


def test_releasing_down_to_a_level_twice_releases_once() -> None:
    _exclusive.hold("dev", 7, "test")
    below = _exclusive.hold("dev", 7, "test")
    _exclusive.release("dev", 7, below)
    _exclusive.release("dev", 7, below)
    assert _exclusive.depth("dev", 7) == 1
    _exclusive.release("dev", 7, 0)
    assert _exclusive.holder("dev", 7) is None


def test_a_thread_is_refused_a_device_another_thread_holds_and_its_refusal_changes_nothing() -> None:
    held, leave, seen = threading.Event(), threading.Event(), []

    def holder() -> None:
        _exclusive.hold("dev", 7, "test")
        held.set()
        leave.wait(_DEADLOCK_GUARD)
        seen.append(_exclusive.depth("dev", 7))
        _exclusive.release("dev", 7)

    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(_DEADLOCK_GUARD)
    owner = _exclusive.holder("dev", 7)
    with pytest.raises(InvalidOperationError, match=r"positioning on dev:7 was refused: thread \d+ holds"):
        _exclusive.hold("dev", 7, "positioning")
    _exclusive.release("dev", 7)  # not ours: leaves the holder's hold alone
    assert _exclusive.holder("dev", 7) == owner
    assert _exclusive.hold("dev", 8, "test") == 0  # another device is free
    _exclusive.release("dev", 8)
    leave.set()
    thread.join(_DEADLOCK_GUARD)
    assert seen == [1] and _exclusive.holder("dev", 7) is None


# -- forks of two trackers ------------------------------------------------------------------------
def test_a_fork_of_another_tracker_is_refused_while_a_thread_has_a_fork_open_and_changes_nothing() -> None:
    t1, t2 = _tracker(s=1), _tracker(s=2)
    platform = platforms.current()
    with _OnAnotherThread(lambda: t1.fork("s")):
        streams, device = t2.get_states(), platform.get_rng_state()
        with pytest.raises(InvalidOperationError, match=f"tracker.fork on {_key()} was refused"):
            with t2.fork("s"):
                pytest.fail("the block of a refused fork ran")
        assert _same(t2.get_states(), streams) and t2.active_stream is None
        assert torch.equal(platform.get_rng_state(), device), "the refused fork changed the holder's generator"
    with t2.fork("s"):  # once A has left, B forks
        drawn = _rand(4)
    assert torch.equal(drawn, _seeded(2, 4))


def test_the_holder_of_a_fork_draws_exactly_its_stream_while_another_thread_is_refused() -> None:
    t1, t2 = _tracker(s=11), _tracker(s=12)
    platform = platforms.current()
    before = platform.get_rng_state()
    with _OnAnotherThread(lambda: t1.fork("s")) as a:
        for _ in range(3):
            with pytest.raises(InvalidOperationError):
                t2.fork("s").__enter__()
    assert torch.equal(torch.cat(a.drawn), _seeded(11, 4, 4))
    assert torch.equal(platform.get_rng_state(), before)
    ref = _tracker(s=11)
    with ref.fork("s"):
        _rand(4)
        _rand(4)
    assert _same(t1.get_states(), ref.get_states())


def test_adding_a_stream_on_another_thread_is_refused_while_a_fork_is_open() -> None:
    t1, t2 = _tracker(s=1), RNGStatesTracker()
    with _OnAnotherThread(lambda: t1.fork("s")):
        with pytest.raises(InvalidOperationError, match=f"creating a stream on {_key()} was refused"):
            t2.add("x", 5)
        assert "x" not in t2 and not t2.is_initialized()
    t2.add("x", 5)
    assert "x" in t2


def test_setting_a_trackers_states_is_refused_while_another_thread_has_one_of_its_forks_open() -> None:
    tracker = _tracker(s=1)
    with _OnAnotherThread(lambda: tracker.fork("s")):
        streams = tracker.get_states()
        with pytest.raises(InvalidOperationError, match="another thread has a fork of stream 's' open"):
            tracker.set_states(streams)
        with pytest.raises(InvalidOperationError):
            with tracker.fork("s"):
                pass


def test_a_fork_of_one_tracker_on_another_thread_and_another_device_is_refused() -> None:
    sim = platforms.SimulatedPlatform()
    if sim.probe() is not None or sim.device_count() < 2:
        pytest.skip("needs the simulated accelerator with two devices")
    with platforms.use(sim):
        tracker = _tracker(s=1)
        with _OnAnotherThread(lambda: tracker.fork("s")):  # on device 0
            sim.set_device(1)
            try:
                device = sim.get_rng_state(1)
                with pytest.raises(InvalidOperationError, match="a tracker's forks form one chain"):
                    with tracker.fork("s"):
                        pass
                assert torch.equal(sim.get_rng_state(1), device) and _exclusive.holder(sim.device_type, 1) is None
            finally:
                sim.set_device(0)
        assert tracker.active_stream is None and not tracker._claim


# -- regions, fork_rng and recompute against forks ------------------------------------------------
def test_a_sharded_region_is_refused_while_another_thread_has_a_fork_open() -> None:
    t1, sharded = _tracker(s=1), ShardedRNGTracker()
    sharded.manual_seed(7)
    platform = platforms.current()
    with _OnAnotherThread(lambda: t1.fork("s")):
        device = platform.get_rng_state()
        with pytest.raises(InvalidOperationError, match=f"a sharded region on {_key()} was refused"):
            with sharded.distribute_region(*_REGION_ARGS):
                pytest.fail("the block of a refused region ran")
        assert torch.equal(platform.get_rng_state(), device) and active_region() is None


def test_a_fork_is_refused_while_another_thread_is_inside_a_sharded_region() -> None:
    tracker, sharded = _tracker(s=1), ShardedRNGTracker()
    sharded.manual_seed(7)
    with _OnAnotherThread(lambda: sharded.distribute_region(*_REGION_ARGS)) as a:
        streams = tracker.get_states()
        with pytest.raises(InvalidOperationError, match=f"tracker.fork on {_key()} was refused"):
            with tracker.fork("s"):
                pass
        assert _same(tracker.get_states(), streams)
    ref = ShardedRNGTracker()
    ref.manual_seed(7)
    with ref.distribute_region(*_REGION_ARGS):
        expected = torch.cat([_rand(4), _rand(4)])
    assert torch.equal(torch.cat(a.drawn), expected), "the region's draws were disturbed"


def test_a_region_on_a_user_generator_does_not_hold_the_device() -> None:
    t1, sharded = _tracker(s=1), ShardedRNGTracker()
    platform = platforms.current()
    # A generator of the platform's device that is not the device's own (a copy of its state).
    own = torch.Generator() if platform.device_type == "cpu" else platform.default_generator().clone_state()  # type: ignore[union-attr]
    before = own.get_state()
    with _OnAnotherThread(lambda: t1.fork("s")):
        with sharded.distribute_region(*_REGION_ARGS, generator=own):
            assert _exclusive.depth(platform.device_type, platform.current_device()) == 0  # the other thread's
    assert not torch.equal(own.get_state(), before), "the region did not position the user generator"


def test_fork_rng_is_refused_while_another_thread_has_a_fork_open_and_a_fork_while_fork_rng_is_open() -> None:
    tracker = _tracker(s=1)
    platform = platforms.current()
    with _OnAnotherThread(lambda: tracker.fork("s")):
        device = platform.get_rng_state()
        with pytest.raises(InvalidOperationError, match=f"fork_rng on {_key()} was refused"):
            with fork_rng():
                pass
        assert torch.equal(platform.get_rng_state(), device)
    before = platform.get_rng_state()
    with _OnAnotherThread(lambda: fork_rng()):
        with pytest.raises(InvalidOperationError, match=f"tracker.fork on {_key()} was refused"):
            with tracker.fork("s"):
                pass
    assert torch.equal(platform.get_rng_state(), before)


def test_fork_rng_holds_the_host_and_each_forked_device() -> None:
    with platforms.use(platforms.SimulatedPlatform()) as sim:
        if sim.probe() is not None:
            pytest.skip(sim.probe() or "")
        with _OnAnotherThread(lambda: fork_rng()):
            assert _exclusive.holder("cpu", 0) is not None
            assert _exclusive.holder(sim.device_type, 0) is not None
            with pytest.raises(InvalidOperationError):
                _exclusive.hold(sim.device_type, 0, "test")
        assert _exclusive.holder(sim.device_type, 0) is None


def test_a_recompute_is_refused_while_another_thread_has_a_fork_open_and_changes_nothing() -> None:
    tracker = _tracker(s=1)
    platform = platforms.current()
    x = torch.ones(6, requires_grad=True)

    def layer(t: torch.Tensor) -> torch.Tensor:
        with tracker.fork("s"):
            return torch.nn.functional.dropout(t, 0.5)

    y = checkpoint(layer, x, tracker=tracker)
    with _OnAnotherThread(lambda: tracker.fork("s")):
        device = platform.get_rng_state()
        with pytest.raises(
            InvalidOperationError, match=rf"a recompute \(hyperrng.checkpoint\) on {_key()} was refused"
        ):
            checkpoint(layer, x, tracker=tracker)
        with pytest.raises(InvalidOperationError, match="recompute"):
            y.sum().backward()
        assert torch.equal(platform.get_rng_state(), device) and x.grad is None
    y.sum().backward()  # once A has left
    assert torch.equal(x.grad, (y != 0).float() * 2)  # type: ignore[arg-type]


def test_one_thread_nests_forks_of_two_trackers_regions_fork_rng_and_recompute() -> None:
    t1, t2, sharded = _tracker(s=1), _tracker(s=2), ShardedRNGTracker()
    sharded.manual_seed(3)
    platform = platforms.current()
    before = platform.get_rng_state()
    x = torch.ones(4, requires_grad=True)
    with t1.fork("s"):
        with fork_rng():
            with sharded.distribute_region(*_REGION_ARGS):
                with t2.fork("s"):
                    y = checkpoint(lambda t: torch.nn.functional.dropout(t, 0.5), x, tracker=t2)
                    y.sum().backward()
        assert _exclusive.depth(platform.device_type, platform.current_device()) == 1
    assert torch.equal(platform.get_rng_state(), before) and _no_holds()


# -- calls that position a generator for good ----------------------------------------------------
def _everything() -> tuple[object, ...]:
    """Every state a seeding call or a restore may change: Python's, NumPy's, torch's CPU generator, the platform's."""
    device = platforms.current().get_rng_state()
    return random.getstate(), np.random.get_state(legacy=False), torch.get_rng_state(), device


def _unchanged(before: tuple[object, ...]) -> bool:
    python, numpy, host, device = _everything()
    return (
        python == before[0]
        and numpy["state"]["key"].tobytes() == before[1]["state"]["key"].tobytes()  # type: ignore[index]
        and numpy["state"]["pos"] == before[1]["state"]["pos"]  # type: ignore[index]
        and torch.equal(host, before[2])  # type: ignore[arg-type]
        and torch.equal(device, before[3])  # type: ignore[arg-type]
    )


_LAYOUT = StreamLayout(dims=("tp",), default=(), streams={"model-parallel-rng": ("tp",)})
_SEEDING_CALLS: dict[str, Callable[[RNGStatesTracker], object]] = {
    "seed_host": lambda t: hyperrng.seed_host(5),
    "set_random_seed": lambda t: hyperrng.set_random_seed(5, tp_rank=1, tracker=t),
    "set_seeds": lambda t: hyperrng.set_seeds(5),
    "model_parallel_manual_seed": lambda t: hyperrng.model_parallel_manual_seed(5, 1, tracker=t),
    "megatron_model_parallel_manual_seed": lambda t: hyperrng.megatron_model_parallel_manual_seed(5, tracker=t),
    "megatron_set_random_seed": lambda t: hyperrng.megatron_set_random_seed(5, tracker=t),
    "seeding a stream layout": lambda t: hyperrng.apply_layout(_LAYOUT, 5, {"tp": 1}, tracker=t),
}


@pytest.mark.parametrize("what", sorted(_SEEDING_CALLS))
def test_seeding_is_refused_while_another_thread_has_a_fork_open_and_seeds_nothing(what: str) -> None:
    holder_tracker, seeded = _tracker(s=1), _tracker(s=2)
    with _OnAnotherThread(lambda: holder_tracker.fork("s")) as a:
        before, streams = _everything(), seeded.get_states()
        with pytest.raises(InvalidOperationError, match=f"{what} on {_key()} was refused"):
            _SEEDING_CALLS[what](seeded)
        assert _unchanged(before), f"{what} changed a generator while refused"
        assert _same(seeded.get_states(), streams), f"{what} reseeded the tracker while refused"
    assert torch.equal(torch.cat(a.drawn), _seeded(1, 4, 4)), "the holder's stream was disturbed"
    _SEEDING_CALLS[what](seeded)  # once the holder has left, the call goes through


@pytest.mark.parametrize("call", ["manual_seed", "sync_from_rank0"])
def test_positioning_a_sharded_tracker_is_refused_while_another_thread_has_a_fork_open(call: str) -> None:
    holder_tracker, sharded = _tracker(s=1), ShardedRNGTracker()
    platform = platforms.current()
    position = getattr(sharded, call)

    def run() -> object:
        return position(9) if call == "manual_seed" else position()

    with _OnAnotherThread(lambda: holder_tracker.fork("s")) as a:
        device = platform.get_rng_state()
        with pytest.raises(InvalidOperationError, match=f"ShardedRNGTracker.{call} on {_key()} was refused"):
            run()
        assert torch.equal(platform.get_rng_state(), device), f"a refused {call} moved the holder's generator"
    assert torch.equal(torch.cat(a.drawn), _seeded(1, 4, 4)), "the holder's stream was disturbed"
    run()


def test_loading_a_checkpoint_is_refused_while_another_thread_has_a_fork_open_and_restores_nothing() -> None:
    holder_tracker, restored = _tracker(s=1), _tracker(s=2)
    saved = hyperrng.rng_state_dict(tracker=restored)
    with restored.fork("s"):
        _rand(4)  # the streams move on from the checkpoint
    random.random()
    np.random.rand()
    with _OnAnotherThread(lambda: holder_tracker.fork("s")):
        before, streams = _everything(), restored.get_states()
        with pytest.raises(InvalidOperationError, match=f"load_rng_state_dict on {_key()} was refused"):
            hyperrng.load_rng_state_dict(saved, tracker=restored)
        assert _unchanged(before) and _same(restored.get_states(), streams), "a refused load restored something"
    hyperrng.load_rng_state_dict(saved, tracker=restored)
    assert _same(restored.get_states(), saved["streams"])  # type: ignore[arg-type]


# -- a thread that dies holding -------------------------------------------------------------------
def _die_holding(enter: Callable[[], object]) -> int:
    """Run ``enter`` on a thread that then ends without leaving what it entered; return its ident."""
    thread = threading.Thread(target=enter)
    thread.start()
    thread.join(_DEADLOCK_GUARD)
    assert not thread.is_alive() and thread.ident is not None
    return thread.ident


def test_a_hold_whose_thread_has_ended_counts_as_released() -> None:
    _die_holding(lambda: _exclusive.hold("dev", 7, "test"))
    assert _exclusive.holder("dev", 7) is None
    assert _exclusive.hold("dev", 7, "test") == 0  # taken over: this thread's first hold
    assert _exclusive.holder("dev", 7) == threading.get_ident() and _exclusive.depth("dev", 7) == 1
    _exclusive.release("dev", 7)
    assert _exclusive.holder("dev", 7) is None


def test_a_new_thread_does_not_inherit_the_hold_of_an_ended_thread_even_with_its_ident() -> None:
    # Idents of ended threads are reused (often at once, for the next thread): a hold recorded
    # by ident would pass to the new thread as a nested one that it could never release.
    _die_holding(lambda: _exclusive.hold("dev", 7, "test"))
    seen: list[tuple[int, int, int | None]] = []

    def hold_and_release() -> None:
        below = _exclusive.hold("dev", 7, "test")
        seen.append((below, _exclusive.depth("dev", 7), None))
        _exclusive.release("dev", 7, below)
        seen.append((below, _exclusive.depth("dev", 7), _exclusive.holder("dev", 7)))

    _die_holding(hold_and_release)
    assert seen == [(0, 1, None), (0, 0, None)]


def test_a_fork_works_after_a_thread_died_inside_a_fork_of_another_tracker() -> None:
    dead_tracker, tracker = _tracker(s=1), _tracker(s=2)
    _die_holding(lambda: dead_tracker.fork("s").__enter__())  # never left: its hold is never released
    with tracker.fork("s"):
        drawn = _rand(4)
    assert torch.equal(drawn, _seeded(2, 4))
    with fork_rng():
        _rand(4)


def _abandon_fork(tracker: RNGStatesTracker, name: str) -> None:
    """Have a thread enter a fork of ``tracker`` and end without leaving it."""
    _die_holding(lambda: tracker.fork(name).__enter__())


@pytest.mark.parametrize(
    "use",
    [
        pytest.param(lambda t: t.fork("s").__enter__(), id="fork-same-stream"),
        pytest.param(lambda t: t.fork("u").__enter__(), id="fork-other-stream"),
        pytest.param(lambda t: t.get_states(), id="get_states"),
        pytest.param(lambda t: t.add("v", 9), id="add"),
        pytest.param(lambda t: hyperrng.rng_state_dict(tracker=t), id="rng_state_dict"),
    ],
)
def test_a_fork_abandoned_by_an_ended_thread_refuses_every_use_with_a_typed_error_and_changes_nothing(
    use: Callable[[RNGStatesTracker], object],
) -> None:
    # Before, the next fork nested inside the dead thread's fork and its exit wrote that
    # fork's stale stream state into the generator; a snapshot read the generator as that
    # stream's advance whatever had drawn from it since.
    tracker = _tracker(s=1, u=2)
    _abandon_fork(tracker, "s")
    platform = platforms.current()
    generator, streams = platform.get_rng_state(), dict(tracker._states)
    with pytest.raises(InvalidOperationError, match=r"left open by thread \d+ that has ended.*reset\(\)") as info:
        use(tracker)
    assert info.value.reason == "tracker"
    assert torch.equal(platform.get_rng_state(), generator)
    assert tracker._states == streams and tracker.active_stream == "s"
    assert _exclusive.holder(platform.device_type, platform.current_device()) is None  # released what it held


def test_set_states_reset_reseed_and_the_seeding_recipes_replace_the_streams_of_an_abandoned_tracker() -> None:
    tracker = _tracker(s=1)
    snapshot = tracker.get_states()
    expected = _draw_in_fork(_tracker(s=1), "s")

    _abandon_fork(tracker, "s")
    tracker.set_states(snapshot)
    assert tracker.active_stream is None and _draw_in_fork(tracker, "s") == expected

    _abandon_fork(tracker, "s")
    tracker.reset()
    tracker.add("s", 1)
    assert tracker.active_stream is None and _draw_in_fork(tracker, "s") == expected

    _abandon_fork(tracker, "s")
    tracker.reseed({"s": 1})
    assert tracker.active_stream is None and _draw_in_fork(tracker, "s") == expected

    hyperrng.model_parallel_manual_seed(5, 0, tracker=tracker)  # replaces "s" by "model-parallel-rng"
    _abandon_fork(tracker, "model-parallel-rng")
    hyperrng.model_parallel_manual_seed(5, 0, tracker=tracker)
    assert tracker.active_stream is None
    with tracker.fork("model-parallel-rng"):
        _rand(2)


@pytest.mark.parametrize("graph_safe", [False, True], ids=["byte-copies", "graph-safe"])
def test_an_abandoned_fork_on_a_multi_device_tracker_is_refused_and_cleared_by_reset(graph_safe: bool) -> None:
    # Where forks may swap several devices' generators the tracker is claimed by the forking
    # thread; the claim of an ended thread must neither be mistaken for a live one nor survive reset().
    sim = platforms.SimulatedPlatform()
    if sim.probe() is not None or sim.device_count() < 2:
        pytest.skip("needs the simulated accelerator with two devices")
    with platforms.use(sim):
        tracker = RNGStatesTracker(graph_safe=graph_safe)
        tracker.reseed({"s": 1})
        _abandon_fork(tracker, "s")
        with pytest.raises(InvalidOperationError, match="left open by thread .* that has ended"):
            with tracker.fork("s"):
                pass
        tracker.reset()
        assert tracker.active_stream is None and not tracker._claim
        tracker.add("s", 1)
        with tracker.fork("s"):
            pass


def _draw_in_fork(tracker: RNGStatesTracker, name: str) -> list[float]:
    with tracker.fork(name):
        return _rand(4).tolist()


# -- KeyboardInterrupt anywhere in enter/exit -----------------------------------------------------
# CPython raises an asynchronous exception (KeyboardInterrupt from SIGINT) only where it checks
# for pending signals: when a Python function starts, when a call into C returns, at a loop's
# back edge. A profile hook sees exactly the first two ('call', 'c_return'), so raising from it
# at the k-th such event puts the interrupt at every point a real one can land. The one point
# left out is the entry of the __exit__ a with statement calls: _exclusive's docstring names it
# as the window pure Python cannot close. The simulated device's code is left out too: it stands
# for a device's C kernels and generator, which an interrupt reaches only around their calls.
_SIMULATED_DEVICE_CODE = (platforms.simulated.__file__, platforms._simulated_dispatch.__file__)


class _Interrupt:
    def __init__(self, at: int | None) -> None:
        self.at, self.events = at, 0
        self.scope: Any = None

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if frame.f_code.co_filename in _SIMULATED_DEVICE_CODE:
            return
        if event == "c_return" or (event == "call" and not self._with_exit(frame)):
            self.events += 1
            if self.events == self.at:
                raise KeyboardInterrupt

    def _with_exit(self, frame: FrameType) -> bool:
        return frame.f_code.co_name == "__exit__" and frame.f_back is not None and frame.f_back.f_code is self.scope


def _run_interrupted(make: Callable[[], AbstractContextManager[Any]], at: int | None) -> tuple[bool, int]:
    """Enter ``make()``, draw, leave, with one KeyboardInterrupt at event ``at``; (interrupted, events seen)."""
    hook = _Interrupt(at)
    hook.scope = _run_interrupted.__code__
    interrupted = False
    try:
        sys.setprofile(hook)
        with make():
            _rand(4)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        sys.setprofile(None)
    return interrupted, hook.events


def _interrupt_points(make: Callable[[], AbstractContextManager[Any]], seed: int, limit: int = 300) -> list[int]:
    """Every point an interrupt can land at in one enter/draw/exit, or a seeded sample of ``limit``."""
    _, total = _run_interrupted(make, None)
    assert total > 10, "the profile hook saw nothing"
    points = list(range(1, total + 1))
    return points if total <= limit else sorted(random.Random(seed).sample(points, limit))


def test_an_interrupt_anywhere_in_a_fork_leaves_the_stream_before_or_after_and_the_generator_as_it_was() -> None:
    platform = platforms.current()
    tracker = _tracker(s=21, other=22)
    start_device, start_streams = platform.get_rng_state(), tracker.get_states()
    _run_interrupted(lambda: tracker.fork("s"), None)
    after_streams = tracker.get_states()
    assert not _same(after_streams, start_streams)
    landed = 0
    for at in _interrupt_points(lambda: tracker.fork("s"), seed=1):
        platform.set_rng_state(start_device)
        tracker.set_states(start_streams)
        interrupted, _ = _run_interrupted(lambda: tracker.fork("s"), at)
        landed += interrupted
        streams = tracker.get_states()
        assert torch.equal(platform.get_rng_state(), start_device), f"generator changed (interrupt at {at})"
        assert _same(streams, start_streams) or _same(streams, after_streams), f"stream torn (interrupt at {at})"
        assert tracker.active_stream is None and not tracker._claim and _no_holds(), f"left open (interrupt at {at})"
    assert landed > 10
    with tracker.fork("s"):  # the tracker still works
        pass


class _InterruptFirstExit:
    """Raise KeyboardInterrupt as the first ``__exit__`` called from ``scope`` starts: the window
    before its first instruction, which pure Python cannot close (see hyperrng._guard.exclusive.LeavesOnExit)."""

    def __init__(self, scope: Any) -> None:
        self.scope, self.fired = scope, False

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and not self.fired and frame.f_code.co_name == "__exit__":
            if frame.f_back is not None and frame.f_back.f_code is self.scope:
                self.fired = True
                raise KeyboardInterrupt


def _run_nested(
    outer: Callable[[], AbstractContextManager[Any]], inner: Callable[[], AbstractContextManager[Any]], interrupt: bool
) -> bool:
    """Draw in ``outer()``, then in ``inner()`` inside it; with ``interrupt``, the inner exit is cut
    before its first instruction. Returns whether a KeyboardInterrupt came out."""
    hook = _InterruptFirstExit(_run_nested.__code__)
    try:
        if interrupt:
            sys.setprofile(hook)
        with outer():
            _rand(2)
            with inner():
                _rand(3)
    except KeyboardInterrupt:
        return True
    finally:
        sys.setprofile(None)
    return False


_NESTINGS = {
    "fork-in-fork-of-another-tracker": lambda a, b: (lambda: a.fork("s"), lambda: b.fork("s")),
    "fork-in-fork-of-one-tracker": lambda a, b: (lambda: a.fork("s"), lambda: a.fork("other")),
    "region-in-fork": lambda a, b: (lambda: a.fork("s"), lambda: ShardedRNGTracker().distribute_region(*_REGION_ARGS)),
    "fork_rng-in-fork": lambda a, b: (lambda: a.fork("s"), lambda: fork_rng()),
    "fork-in-fork_rng": lambda a, b: (lambda: fork_rng(), lambda: b.fork("s")),
    "fork-in-region": lambda a, b: (lambda: ShardedRNGTracker().distribute_region(*_REGION_ARGS), lambda: b.fork("s")),
}


@pytest.mark.parametrize("nesting", list(_NESTINGS))
def test_an_interrupt_before_an_inner_exit_starts_is_repaired_by_the_outer_exit(nesting: str) -> None:
    platform = platforms.current()
    a, b = _tracker(s=21, other=22), _tracker(s=31)
    start = (platform.get_rng_state(), a.get_states(), b.get_states())

    def outcome() -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return platform.get_rng_state(), a.get_states(), b.get_states()

    assert not _run_nested(*_NESTINGS[nesting](a, b), interrupt=False)
    after = outcome()
    for state, tracker in zip(start[1:], (a, b)):
        tracker.set_states(state)
    platform.set_rng_state(start[0])
    # The KeyboardInterrupt comes out as itself, and everything is as after the blocks: the outer
    # exit left the inner context first (before, the outer fork kept the inner one's borrowed
    # state as its own stream, or raised InvalidOperationError instead of the interrupt).
    assert _run_nested(*_NESTINGS[nesting](a, b), interrupt=True)
    now = outcome()
    assert torch.equal(now[0], after[0]), "the generator is as after the blocks"
    assert _same(now[1], after[1]) and _same(now[2], after[2]), "every stream is as after the blocks"
    assert a.active_stream is None and b.active_stream is None and active_region() is None
    assert _no_holds()


def test_an_interrupt_anywhere_in_fork_rng_leaves_the_generator_as_it_was_and_no_hold() -> None:
    platform = platforms.current()
    start = platform.get_rng_state()
    landed = 0
    for at in _interrupt_points(lambda: fork_rng(), seed=2):
        platform.set_rng_state(start)
        interrupted, _ = _run_interrupted(lambda: fork_rng(), at)
        landed += interrupted
        assert torch.equal(platform.get_rng_state(), start), f"generator changed (interrupt at {at})"
        assert _no_holds(), f"hold left (interrupt at {at})"
    assert landed > 10


def test_an_interrupt_anywhere_in_a_sharded_region_leaves_the_position_before_or_after_it() -> None:
    platform = platforms.current()
    sharded = ShardedRNGTracker()
    sharded.manual_seed(5)
    start = platform.get_rng_state()
    _run_interrupted(lambda: sharded.distribute_region(*_REGION_ARGS), None)
    after = platform.get_rng_state()
    assert not torch.equal(after, start)
    landed = 0
    for at in _interrupt_points(lambda: sharded.distribute_region(*_REGION_ARGS), seed=3):
        platform.set_rng_state(start)
        interrupted, _ = _run_interrupted(lambda: sharded.distribute_region(*_REGION_ARGS), at)
        landed += interrupted
        now = platform.get_rng_state()
        assert torch.equal(now, start) or torch.equal(now, after), f"position torn (interrupt at {at})"
        assert active_region() is None and _no_holds(), f"left open (interrupt at {at})"
    assert landed > 10
