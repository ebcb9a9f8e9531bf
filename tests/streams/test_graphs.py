"""Forks captured in graphs: graph-safe streams registered with a graph, copying forks refused under capture.

The simulated device models what capture means for random ops (see ``SimulatedGraph``): the
device reports its stream capturing, and a draw from a generator state the graph does not
know fails as on CUDA. The ``cuda``-marked tests check the real thing, replays included.
"""

from __future__ import annotations

from collections.abc import Iterator

import hyperrng.platforms as platforms
import pytest
import torch
from hyperrng.platforms.simulated import SimulatedGraph

from hyperrng._guard import exclusive as _exclusive
from hyperrng.errors import ArgumentTypeError, InvalidArgumentError, InvalidOperationError
from hyperrng.streams.tracker import RNGStatesTracker
from tests._platforms import (
    cuda_on_sim,
    cuda_platform,  # noqa: F401 - the fixture `cuda`
)


@pytest.fixture
def sim() -> Iterator[platforms.Platform]:
    with platforms.use(platforms.SimulatedPlatform()) as platform:
        yield platform


def _module(platform: platforms.Platform) -> platforms.SimulatedDeviceModule:
    return platform.module  # type: ignore[attr-defined, no-any-return]


def _draw(platform: platforms.Platform, n: int = 6) -> torch.Tensor:
    return torch.rand(n, device=platform.device()).cpu()


def _no_holds(platform: platforms.Platform) -> bool:
    keys = [("cpu", 0)] + [(platform.device_type, i) for i in range(platform.device_count())]
    return all(_exclusive.holder(*key) is None for key in keys)


# -- asking the platform -------------------------------------------------------------------------
def test_a_platform_without_graphs_is_never_capturing() -> None:
    assert platforms.CPUPlatform().is_capturing() is False


@pytest.mark.needs_sim
def test_the_simulated_device_is_capturing_only_inside_a_graph(sim: platforms.Platform) -> None:
    module = _module(sim)
    assert not sim.is_capturing()
    with module.graph(SimulatedGraph()):
        assert sim.is_capturing()
    assert not sim.is_capturing()


def test_asking_whether_a_device_captures_does_not_initialise_it() -> None:
    module = platforms.SimulatedDeviceModule(device_type="cuda")
    cuda = platforms.CUDAPlatform(module=module)
    assert cuda.is_capturing() is False
    assert module.lazy_init_calls == 0 and not module.is_initialized()


def test_a_device_index_is_checked_unless_it_is_the_current_device_and_capture_is_seen_on_each() -> None:
    """Every portable draw asks about its tensor's device, nearly always the current one: that index needs no
    check; any other is checked as before (out of range, a bool), initialised or not."""
    module = platforms.SimulatedDeviceModule(device_type="cuda")
    cuda = platforms.CUDAPlatform(module=module)
    for bad in (7, -1):
        with pytest.raises(InvalidArgumentError, match="out of range"):
            cuda.is_capturing(bad)
    assert module.lazy_init_calls == 0, "asking initialised nothing"
    module._lazy_init()
    assert cuda.is_capturing(0) is False and cuda.is_capturing(1) is False
    module.set_device(1)
    with pytest.raises(ArgumentTypeError, match="bool"):
        cuda.is_capturing(True)  # equal to the current device, 1, and still not an index
    with pytest.raises(InvalidArgumentError, match="out of range"):
        cuda.is_capturing(7)
    with module.graph(SimulatedGraph()):
        assert (cuda.is_capturing(), cuda.is_capturing(0), cuda.is_capturing(1)) == (True, True, True)
    assert cuda.is_capturing(0) is False


def test_a_device_module_without_graphs_is_never_capturing() -> None:
    class NoGraphs(platforms.SimulatedDeviceModule):
        is_current_stream_capturing = None  # type: ignore[assignment]

    module = NoGraphs(device_type="cuda")
    module._lazy_init()
    assert platforms.CUDAPlatform(module=module).is_capturing() is False


# -- a copying tracker's fork under capture ---------------------------------------------------------
@pytest.mark.parametrize("make", [platforms.SimulatedPlatform, cuda_on_sim], ids=["sim", "cuda-on-sim"])
def test_a_copying_fork_under_capture_is_refused_with_a_typed_error_and_changes_nothing(make: type) -> None:
    platform = make()
    if platform.probe() is not None:
        pytest.skip(platform.probe() or "")
    with platforms.use(platform):
        tracker = RNGStatesTracker()
        tracker.add("s", 5)
        module = _module(platform)
        module._lazy_init()
        streams, device = tracker.get_states(), platform.get_rng_state()
        with module.graph(SimulatedGraph()):
            with pytest.raises(InvalidOperationError, match=r"graph_safe=True.*register_graph\(graph\)") as info:
                with tracker.fork("s"):
                    pytest.fail("the block of a refused fork ran")
        assert info.value.reason == "tracker"
        assert "stream 's' cannot be forked while device" in str(info.value)
        assert tracker.active_stream is None and _no_holds(platform)
        assert torch.equal(platform.get_rng_state(), device)
        assert all(torch.equal(tracker.get_states()[k], v) for k, v in streams.items())
        with tracker.fork("s"):  # outside capture it forks as ever
            pass


def test_a_copying_tracker_on_a_platform_without_graphs_asks_nothing() -> None:
    tracker = RNGStatesTracker()
    with platforms.use(platforms.CPUPlatform()):
        tracker.add("s", 5)
    assert tracker._swap is not None and tracker._swap.capturing is None


# -- a graph-safe tracker's forks in a graph ---------------------------------------------------------
@pytest.mark.needs_sim
def test_an_unregistered_stream_cannot_be_drawn_from_under_capture(sim: platforms.Platform) -> None:
    tracker = RNGStatesTracker(graph_safe=True)
    tracker.add("s", 5)
    with _module(sim).graph(SimulatedGraph()):
        with pytest.raises(RuntimeError, match="not in capture mode"):
            with tracker.fork("s"):
                _draw(sim)
    assert tracker.active_stream is None and _no_holds(sim)


@pytest.mark.needs_sim
def test_registered_streams_draw_under_capture_what_eager_forks_draw_from_the_same_position(
    sim: platforms.Platform,
) -> None:
    tracker = RNGStatesTracker(graph_safe=True)
    tracker.reseed({"a": 5, "b": 6})
    with tracker.fork("a"):
        _draw(sim)  # not at offset 0
    start = tracker.get_states()
    graph = SimulatedGraph()
    tracker.register_graph(graph)
    tracker.register_graph(graph)  # twice: nothing more happens
    with _module(sim).graph(graph):
        with tracker.fork("a"):
            captured = [_draw(sim)]
            with tracker.fork("b"):
                captured.append(_draw(sim))
        _draw(sim)  # the default generator, which the capture registered itself
    eager = RNGStatesTracker(graph_safe=True)
    eager.set_states(start)
    with eager.fork("a"):
        expected = [_draw(sim)]
        with eager.fork("b"):
            expected.append(_draw(sim))
    assert all(torch.equal(c, e) for c, e in zip(captured, expected, strict=True))


@pytest.mark.needs_sim
@pytest.mark.parametrize(
    ("graph_safe", "make_graph", "error", "fragment"),
    [
        (False, SimulatedGraph, InvalidOperationError, "needs a graph-safe tracker"),
        (True, object, ArgumentTypeError, "register_generator_state"),
    ],
    ids=["copying-tracker", "not-a-graph"],
)
def test_register_graph_refuses_what_cannot_be_registered(
    sim: platforms.Platform, graph_safe: bool, make_graph: type, fragment: str, error: type[Exception]
) -> None:
    tracker = RNGStatesTracker(graph_safe=graph_safe)
    tracker.add("s", 5)
    graph = make_graph()
    with pytest.raises(error, match=fragment):
        tracker.register_graph(graph)
    if isinstance(graph, SimulatedGraph):
        assert graph._states == []


@pytest.mark.needs_sim
def test_register_graph_refuses_an_empty_tracker_and_a_capture_already_begun(sim: platforms.Platform) -> None:
    tracker = RNGStatesTracker(graph_safe=True)
    with pytest.raises(InvalidOperationError, match="holds no streams"):
        tracker.register_graph(SimulatedGraph())
    tracker.add("s", 5)
    graph = SimulatedGraph()
    with _module(sim).graph(graph):
        with pytest.raises(InvalidOperationError, match="register the graph before capture begins"):
            tracker.register_graph(graph)
    assert len(graph._states) == 1  # only the default generator, which the capture registered


# -- real CUDA ------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_on_cuda_a_fork_draws_what_manual_seed_draws_and_leaves_the_default_offset(cuda: platforms.Platform) -> None:
    tracker = RNGStatesTracker()
    tracker.add("s", 1234)
    torch.cuda.manual_seed(7)
    torch.rand(5, device="cuda")  # the default generator is past offset 0
    before = torch.cuda.get_rng_state()
    with tracker.fork("s"):
        drawn = [torch.rand(1000, device="cuda"), torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5)]
    assert torch.equal(torch.cuda.get_rng_state(), before), "the fork moved torch's default offset"
    own = torch.Generator(device="cuda").manual_seed(1234)
    assert torch.equal(drawn[0], torch.rand(1000, device="cuda", generator=own))
    torch.cuda.manual_seed(1234)
    torch.rand(1000, device="cuda")
    assert torch.equal(drawn[1], torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5))


@pytest.mark.cuda
def test_on_cuda_graph_safe_forks_replay_fresh_numbers_equal_to_eager_forks(cuda: platforms.Platform) -> None:
    tracker = RNGStatesTracker(graph_safe=True)
    tracker.reseed({"a": 11, "b": 12})
    start = tracker.get_states()
    graph = torch.cuda.CUDAGraph()
    tracker.register_graph(graph)
    out_a = torch.empty(4096, device="cuda")
    out_b = torch.empty(4096, device="cuda")
    with torch.cuda.graph(graph):
        with tracker.fork("a"):
            out_a.copy_(torch.rand(4096, device="cuda"))
            with tracker.fork("b"):
                out_b.copy_(torch.nn.functional.dropout(torch.ones(4096, device="cuda"), 0.3))
    replays = []
    for _ in range(3):
        graph.replay()
        replays.append((out_a.clone(), out_b.clone()))
    torch.cuda.synchronize()
    eager = RNGStatesTracker(graph_safe=True)
    eager.set_states(start)
    for a, b in replays:
        with eager.fork("a"):
            expected_a = torch.rand(4096, device="cuda")
            with eager.fork("b"):
                expected_b = torch.nn.functional.dropout(torch.ones(4096, device="cuda"), 0.3)
        assert torch.equal(a, expected_a) and torch.equal(b, expected_b)
    assert not torch.equal(replays[0][0], replays[1][0]), "each replay draws fresh numbers"


@pytest.mark.cuda
def test_on_cuda_a_copying_fork_under_capture_is_refused_before_torch_fails(cuda: platforms.Platform) -> None:
    tracker = RNGStatesTracker()
    tracker.add("s", 5)
    streams = tracker.get_states()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(InvalidOperationError, match="graph_safe=True"):
        with torch.cuda.graph(graph):
            with tracker.fork("s"):
                torch.rand(4, device="cuda")
    assert torch.equal(tracker.get_states()["s"], streams["s"]) and tracker.active_stream is None
