"""The RNG stream tracker: forks, nesting, snapshots, graph-safe swaps, and refusal of bad input."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch

import hyperrng
from hyperrng.errors import (
    ArgumentTypeError,
    HyperRNGError,
    InvalidArgumentError,
    InvalidOperationError,
    UnknownStreamError,
)
from hyperrng.streams.tracker import (
    MODEL_PARALLEL_STREAM,
    CudaRNGStatesTracker,
    RNGStatesTracker,
    RNGTrackerProtocol,
    get_cuda_rng_tracker,
    get_rng_tracker,
    set_rng_tracker,
)
from tests._platforms import WITH_PLUGIN, draw

PLATFORMS = WITH_PLUGIN
# (platform, graph_safe argument): every code path of the fork
SETUPS = [
    ("cpu", False),
    ("sim", False),
    ("sim", True),
    ("cuda-on-sim", False),
    ("cuda-on-sim", True),
    ("plugin-without-generator", False),
]


@pytest.fixture(autouse=True)
def _fresh_global_tracker() -> Iterator[None]:
    get_rng_tracker().reset()
    yield
    get_rng_tracker().reset()


@pytest.fixture(params=SETUPS, ids=[f"{p}-graph_safe={g}" for p, g in SETUPS])
def setup(request: pytest.FixtureRequest) -> Iterator[tuple[platforms.Platform, RNGStatesTracker]]:
    name, graph_safe = request.param
    with platforms.use(PLATFORMS[name]()) as platform:
        yield platform, RNGStatesTracker(graph_safe=graph_safe)


@pytest.fixture
def cpu() -> Iterator[platforms.Platform]:
    """The CPU platform, whatever HYPERRNG_PLATFORM chose: for tests whose draws are CPU tensors (a fork on a
    device platform swaps the device's generator, which CPU tensors never read)."""
    with platforms.use(platforms.CPUPlatform()) as platform:
        yield platform


@pytest.fixture
def sim() -> Iterator[platforms.Platform]:
    with platforms.use(platforms.SimulatedPlatform()) as platform:
        yield platform


def device_states(platform: platforms.Platform) -> list[torch.Tensor]:
    return [platform.get_rng_state(i) for i in range(platform.device_count())]


def everything(platform: platforms.Platform, tracker: RNGStatesTracker) -> dict[str, Any]:
    """All state a tracker operation could touch, as comparable values."""
    return {
        "streams": {k: v.tolist() for k, v in tracker.get_states(as_tensors=True).items()},
        "seeds": tracker.seeds(),
        "initialized": tracker.is_initialized(),
        "devices": [s.tolist() for s in device_states(platform)],
        "cpu": torch.get_rng_state().tolist(),
    }


def expect_refusal(
    platform: platforms.Platform,
    tracker: RNGStatesTracker,
    call: Callable[[], object],
    error: type[Exception],
    fragment: str,
) -> None:
    before = everything(platform, tracker)
    with pytest.raises(error, match=fragment) as info:
        call()
    assert isinstance(info.value, HyperRNGError)
    assert everything(platform, tracker) == before, "a refused call changed state"


# -- streams --------------------------------------------------------------------------------
def test_a_stream_draws_what_its_seed_gives(setup: tuple[platforms.Platform, RNGStatesTracker]) -> None:
    platform, tracker = setup
    tracker.add("s", 1234)
    with tracker.fork("s"):
        inside = draw(platform)
    saved = platform.get_rng_state()
    platform.manual_seed(1234)
    expected = draw(platform)
    platform.set_rng_state(saved)
    assert torch.equal(inside, expected)


def test_add_leaves_the_device_generator_untouched(setup: tuple[platforms.Platform, RNGStatesTracker]) -> None:
    platform, tracker = setup
    before = device_states(platform)
    tracker.add("s", 1)
    tracker.add("t", 2)
    assert all(torch.equal(a, b) for a, b in zip(before, device_states(platform)))


def test_a_fork_leaves_the_default_generator_exactly_as_before(
    setup: tuple[platforms.Platform, RNGStatesTracker],
) -> None:
    platform, tracker = setup
    tracker.add("s", 7)
    platform.manual_seed(99)
    reference = [draw(platform), draw(platform)]
    platform.manual_seed(99)
    first = draw(platform)
    with tracker.fork("s"):
        draw(platform, 100)
    second = draw(platform)
    assert torch.equal(first, reference[0]) and torch.equal(second, reference[1])


def test_a_stream_remembers_its_advance_between_forks(setup: tuple[platforms.Platform, RNGStatesTracker]) -> None:
    platform, tracker = setup
    tracker.add("s", 5)
    with tracker.fork("s"):
        a = draw(platform)
    with tracker.fork("s"):
        b = draw(platform)
    platform.manual_seed(5)
    assert torch.equal(a, draw(platform)) and torch.equal(b, draw(platform))


@pytest.mark.parametrize("inner", ["another tracker's fork", "fork_rng"])
def test_a_tracker_refuses_its_stream_ops_while_another_context_is_open_inside_its_fork(
    setup: tuple[platforms.Platform, RNGStatesTracker], inner: str
) -> None:
    """Inside ``T.fork("a")``, a context entered after it swaps the generator to its own stream until its exit: a
    fork of ``a`` there would take that stream for ``a``'s advance, a snapshot would read it as ``a``, and a restore
    of ``a`` would be undone by that context's exit, each silently. They are refused, and nothing changes; in
    order, after that context's exit, the same calls continue ``a`` as if nothing had been tried."""
    platform, tracker = setup
    other = RNGStatesTracker(graph_safe=tracker.graph_safe)
    reference = RNGStatesTracker(graph_safe=tracker.graph_safe)
    for t in (tracker, reference):
        t.add("a", 1)
    other.add("u", 2)
    snapshot = tracker.get_states(as_tensors=True)
    with reference.fork("a"):
        expected = [draw(platform) for _ in range(3)]
    with tracker.fork("a"):
        first = draw(platform)
        context = other.fork("u") if inner != "fork_rng" else hyperrng.fork_rng()
        with context:
            inside = draw(platform)
            calls = [lambda: tracker.set_states(snapshot)]  # undone by the context's exit
            if inner != "fork_rng":  # (inside fork_rng the fork's stream draws on: a fork or snapshot reads it)
                calls += [lambda: tracker.fork("a").__enter__(), tracker.get_states]
            for call in calls:
                with pytest.raises(InvalidOperationError, match="is open inside this tracker's fork of stream 'a'"):
                    call()
        with tracker.fork("a"):
            second = draw(platform)
        third = draw(platform)
    assert [torch.equal(a, b) for a, b in zip([first, second, third], expected)] == [True, True, True]
    if inner != "fork_rng":  # (fork_rng continues the generator as it found it, and puts that back)
        assert not any(torch.equal(inside, e) for e in expected)


def test_fork_defaults_to_the_model_parallel_stream(setup: tuple[platforms.Platform, RNGStatesTracker]) -> None:
    platform, tracker = setup
    tracker.add(MODEL_PARALLEL_STREAM, 11)
    tracker.add("other", 12)
    with tracker.fork():
        assert tracker.active_stream == MODEL_PARALLEL_STREAM
        inside = draw(platform)
    platform.manual_seed(11)
    assert torch.equal(inside, draw(platform))


def test_nested_forks_give_exactly_the_streams_of_sequential_forks(
    setup: tuple[platforms.Platform, RNGStatesTracker],
) -> None:
    platform, tracker = setup
    tracker.add("s1", 1)
    tracker.add("s2", 2)
    platform.manual_seed(42)
    default_before = device_states(platform)

    with tracker.fork("s1"):
        a = draw(platform)
        with tracker.fork("s2"):
            b = draw(platform)
            with tracker.fork("s1"):
                c = draw(platform)
            d = draw(platform)
        e = draw(platform)
    nested = everything(platform, tracker)
    assert all(torch.equal(x, y) for x, y in zip(default_before, device_states(platform)))

    sequential = RNGStatesTracker(graph_safe=tracker.graph_safe)
    sequential.add("s1", 1)
    sequential.add("s2", 2)
    platform.manual_seed(42)
    expected = []
    for stream in ("s1", "s2", "s1", "s2", "s1"):
        with sequential.fork(stream):
            expected.append(draw(platform))
    assert everything(platform, sequential) == nested
    assert all(torch.equal(x, y) for x, y in zip([a, b, c, d, e], expected))


def test_a_fork_inside_a_fork_of_the_same_stream_continues_it(
    setup: tuple[platforms.Platform, RNGStatesTracker],
) -> None:
    """Never a replay: the inner block draws what the outer one would have drawn next, and the outer
    one then continues after it (a copying fork used to hand the inner one the stream's start again)."""
    platform, tracker = setup
    tracker.add("x", 5)
    with tracker.fork("x"):
        a = draw(platform)
        with tracker.fork("x"):
            b = draw(platform)
            with tracker.fork("x"):
                c = draw(platform)
        d = draw(platform)
    nested = everything(platform, tracker)

    straight = RNGStatesTracker(graph_safe=tracker.graph_safe)
    straight.add("x", 5)
    with straight.fork("x"):
        expected = [draw(platform) for _ in range(4)]
    assert all(torch.equal(x, y) for x, y in zip([a, b, c, d], expected))
    assert everything(platform, straight) == nested


def test_an_exception_inside_a_fork_restores_the_state_and_keeps_the_advance(
    setup: tuple[platforms.Platform, RNGStatesTracker],
) -> None:
    platform, tracker = setup
    tracker.add("s", 3)
    before = device_states(platform)
    with pytest.raises(RuntimeError, match="raised inside the block"), tracker.fork("s"):
        first = draw(platform)
        raise RuntimeError("raised inside the block")
    assert tracker.active_stream is None
    assert all(torch.equal(x, y) for x, y in zip(before, device_states(platform)))
    with tracker.fork("s"):
        second = draw(platform)
    platform.manual_seed(3)
    assert torch.equal(first, draw(platform)) and torch.equal(second, draw(platform))


def test_byte_copy_forks_follow_the_current_device(sim: platforms.Platform) -> None:
    tracker = RNGStatesTracker(graph_safe=False)
    tracker.add("s", 8)
    device0 = sim.get_rng_state(0)
    sim.module.set_device(1)
    with tracker.fork("s"):
        inside = draw(sim)
    assert torch.equal(sim.get_rng_state(0), device0)
    sim.manual_seed(8, 1)
    assert torch.equal(inside, draw(sim))


# -- snapshots ------------------------------------------------------------------------------
def test_get_states_is_a_snapshot_that_later_forks_do_not_alter(
    setup: tuple[platforms.Platform, RNGStatesTracker],
) -> None:
    platform, tracker = setup
    tracker.add("s", 1)
    snapshot = tracker.get_states()
    frozen = {k: (v.tolist() if isinstance(v, torch.Tensor) else v.get_state().tolist()) for k, v in snapshot.items()}
    with tracker.fork("s"):
        draw(platform)
    after = {k: (v.tolist() if isinstance(v, torch.Tensor) else v.get_state().tolist()) for k, v in snapshot.items()}
    assert after == frozen


def test_set_states_replays_a_snapshot(setup: tuple[platforms.Platform, RNGStatesTracker]) -> None:
    platform, tracker = setup
    tracker.add("s", 1)
    tracker.add("t", 2)
    snapshot = tracker.get_states()
    with tracker.fork("s"):
        first = draw(platform)
    tracker.set_states(snapshot)
    with tracker.fork("s"):
        again = draw(platform)
    assert torch.equal(first, again)


def test_get_states_inside_a_fork_includes_the_active_advance(
    setup: tuple[platforms.Platform, RNGStatesTracker],
) -> None:
    platform, tracker = setup
    tracker.add("s", 1)
    with tracker.fork("s"):
        draw(platform)
        midway = tracker.get_states()
        rest = draw(platform)
    tracker.set_states(midway)
    with tracker.fork("s"):
        assert torch.equal(draw(platform), rest)


def test_set_states_inside_a_fork_moves_the_active_stream(setup: tuple[platforms.Platform, RNGStatesTracker]) -> None:
    platform, tracker = setup
    tracker.add("s", 1)
    start = tracker.get_states()
    with tracker.fork("s"):
        first = draw(platform)
        tracker.set_states(start)
        assert torch.equal(draw(platform), first)


def test_an_empty_tracker_adopts_the_streams_of_a_snapshot(setup: tuple[platforms.Platform, RNGStatesTracker]) -> None:
    platform, tracker = setup
    tracker.add("s", 1)
    snapshot = tracker.get_states(as_tensors=True)
    with tracker.fork("s"):
        expected = draw(platform)
    fresh = RNGStatesTracker()
    fresh.set_states(snapshot)
    assert fresh.is_initialized()
    with fresh.fork("s"):
        assert torch.equal(draw(platform), expected)


def test_snapshots_cross_between_graph_safe_and_byte_copy_trackers(sim: platforms.Platform) -> None:
    swapping, copying = RNGStatesTracker(graph_safe=True), RNGStatesTracker(graph_safe=False)
    swapping.add("s", 1)
    copying.set_states(swapping.get_states())
    swapping.set_states(copying.get_states())
    with swapping.fork("s"):
        a = draw(sim)
    with copying.fork("s"):
        b = draw(sim)
    assert torch.equal(a, b)


# -- TransformerEngine / Megatron-core protocol ----------------------------------------------
def test_the_tracker_satisfies_the_transformer_engine_protocol() -> None:
    assert isinstance(get_rng_tracker(), RNGTrackerProtocol)
    assert get_cuda_rng_tracker is get_rng_tracker
    assert issubclass(CudaRNGStatesTracker, RNGStatesTracker)
    assert isinstance(CudaRNGStatesTracker(), RNGTrackerProtocol)


def test_activation_recompute_replays_the_forward_numbers(setup: tuple[platforms.Platform, RNGStatesTracker]) -> None:
    """TE's CheckpointFunction: get_states() before forward, set_states() around the recompute."""
    platform, tracker = setup
    tracker.add(MODEL_PARALLEL_STREAM, 9)

    def layer() -> torch.Tensor:
        with tracker.fork():
            return draw(platform) + draw(platform)

    fwd_device, fwd_tracker = platform.get_rng_state(), tracker.get_states()
    forward = layer()
    layer()  # training moves on
    bwd_device, bwd_tracker = platform.get_rng_state(), tracker.get_states()
    platform.set_rng_state(fwd_device)
    tracker.set_states(fwd_tracker)
    recomputed = layer()
    platform.set_rng_state(bwd_device)
    tracker.set_states(bwd_tracker)
    assert torch.equal(forward, recomputed)


def test_the_process_wide_tracker_can_be_replaced() -> None:
    mine = RNGStatesTracker(graph_safe=False)
    previous = set_rng_tracker(mine)
    try:
        assert get_rng_tracker() is mine and get_cuda_rng_tracker() is mine
    finally:
        assert set_rng_tracker(previous) is mine


def test_is_initialized_follows_add_set_states_and_reset(setup: tuple[platforms.Platform, RNGStatesTracker]) -> None:
    _, tracker = setup
    assert not tracker.is_initialized()
    tracker.add("s", 1)
    assert tracker.is_initialized()
    tracker.reset()
    assert not tracker.is_initialized() and tracker.get_states() == {}
    tracker.set_states({})
    assert tracker.is_initialized()


def test_reseed_replaces_every_stream(setup: tuple[platforms.Platform, RNGStatesTracker]) -> None:
    platform, tracker = setup
    tracker.add("old", 1)
    tracker.reseed({"a": 10, "b": 11})
    assert tracker.seeds() == {"a": 10, "b": 11} and "old" not in tracker
    with tracker.fork("b"):
        inside = draw(platform)
    platform.manual_seed(11)
    assert torch.equal(inside, draw(platform))


# -- graph-safe mode ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(PLATFORMS))
def test_the_default_tracker_copies_bytes_and_snapshots_are_tensors_on_every_platform(name: str) -> None:
    # Drop-in: code that saves or compares get_states() (as Megatron-core's own tests do)
    # must see byte tensors whatever the platform, graph-safe generator API or not.
    with platforms.use(PLATFORMS[name]()) as platform:
        for tracker in (RNGStatesTracker(), CudaRNGStatesTracker(), get_rng_tracker()):
            tracker.add("s", 1)
            assert tracker.graph_safe is False
            with tracker.fork("s"):
                draw(platform)
            snapshot = tracker.get_states()
            assert all(isinstance(v, torch.Tensor) and v.dtype == torch.uint8 for v in snapshot.values())
            assert all(v.numel() == platform._state_nbytes for v in snapshot.values())
            tracker.reset()


@pytest.mark.parametrize("name", ["sim", "cuda-on-sim"])
def test_a_graph_safe_fork_swaps_the_generator_state_without_copying(name: str) -> None:
    with platforms.use(PLATFORMS[name]()) as platform:
        tracker = RNGStatesTracker(graph_safe=True)
        tracker.add("s", 1)
        gen = platform.default_generator()
        live = tracker.graph_safe_states()["s"]
        with tracker.fork("s"):
            # The generator now shares the stream's state object: a draw advances both.
            draw(platform)
            assert torch.equal(gen.get_state(), live.get_state())
        assert platform.default_generator() is gen
        assert not torch.equal(gen.get_state(), live.get_state())


def test_graph_safe_streams_stay_on_the_device_that_created_them(sim: platforms.Platform) -> None:
    tracker = RNGStatesTracker(graph_safe=True)
    tracker.add("s", 1)
    sim.module.set_device(1)
    expect_refusal(sim, tracker, lambda: tracker.fork("s").__enter__(), InvalidOperationError, "current device is 1")
    expect_refusal(sim, tracker, lambda: tracker.add("t", 2), InvalidOperationError, "current device is 1")
    sim.module.set_device(0)
    with tracker.fork("s"):
        draw(sim)


def test_graph_safe_snapshots_are_clones(sim: platforms.Platform) -> None:
    tracker = RNGStatesTracker(graph_safe=True)
    tracker.add("s", 1)
    snapshot = tracker.get_states()
    assert snapshot["s"] is not tracker.graph_safe_states()["s"]


def test_requiring_graph_safe_mode_on_the_cpu_is_refused() -> None:
    with platforms.use(platforms.CPUPlatform()) as platform:
        tracker = RNGStatesTracker(graph_safe=True)
        expect_refusal(platform, tracker, lambda: tracker.add("s", 1), InvalidOperationError, "graph-safe")
        expect_refusal(platform, tracker, lambda: tracker.reseed({"s": 1}), InvalidOperationError, "graph-safe")


def test_graph_safe_states_needs_a_graph_safe_tracker() -> None:
    with platforms.use(platforms.CPUPlatform()) as platform:
        tracker = RNGStatesTracker()
        tracker.add("s", 1)
        expect_refusal(platform, tracker, tracker.graph_safe_states, InvalidOperationError, "graph-safe tracker")


def test_on_an_accelerator_a_fork_leaves_the_cpu_generator_to_cpu_draws(sim: platforms.Platform) -> None:
    tracker = RNGStatesTracker()
    tracker.add("s", 1)
    torch.manual_seed(5)
    expected = [torch.rand(4), torch.rand(4)]
    torch.manual_seed(5)
    with tracker.fork("s"):
        first = torch.rand(4)
    assert torch.equal(first, expected[0]) and torch.equal(torch.rand(4), expected[1])


# -- bad input: typed error, clear message, nothing changed ----------------------------------------
def test_a_duplicate_name_is_refused(setup: tuple[platforms.Platform, RNGStatesTracker]) -> None:
    platform, tracker = setup
    tracker.add("s", 1)
    expect_refusal(platform, tracker, lambda: tracker.add("s", 2), InvalidArgumentError, "already exists")


def test_a_duplicate_seed_is_refused_and_burns_nothing(setup: tuple[platforms.Platform, RNGStatesTracker]) -> None:
    platform, tracker = setup
    tracker.add("s", 1)
    expect_refusal(platform, tracker, lambda: tracker.add("t", 1), InvalidArgumentError, "already used by stream 's'")
    tracker.add("t", 2)  # the failed add reserved neither the name nor a seed
    expect_refusal(platform, tracker, lambda: tracker.add("s", 3), InvalidArgumentError, "already exists")
    tracker.add("u", 3)


@pytest.mark.parametrize(
    ("seed", "error"),
    [(-1, InvalidArgumentError), (2**64, InvalidArgumentError)]
    + [(t, ArgumentTypeError) for t in (True, 1.5, "3", None)],
)
def test_a_bad_seed_is_refused(
    setup: tuple[platforms.Platform, RNGStatesTracker], seed: object, error: type[Exception]
) -> None:
    platform, tracker = setup
    tracker.add("s", 1)
    expect_refusal(platform, tracker, lambda: tracker.add("t", seed), error, "seed must be")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "error"), [("", InvalidArgumentError), (3, ArgumentTypeError), (None, ArgumentTypeError)]
)
def test_a_bad_stream_name_is_refused(
    setup: tuple[platforms.Platform, RNGStatesTracker], name: object, error: type[Exception]
) -> None:
    platform, tracker = setup
    expect_refusal(platform, tracker, lambda: tracker.add(name, 1), error, "non-empty string")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "error", "fragment"),
    [
        ("missing", UnknownStreamError, "seed the streams first: hyperrng.apply_layout"),
        ("Model-Parallel-RNG", UnknownStreamError, "hyperrng.megatron_model_parallel_manual_seed"),
        (5, ArgumentTypeError, "must be a non-empty string"),
        (["unhashable"], ArgumentTypeError, "must be a non-empty string"),
        (None, ArgumentTypeError, "must be a non-empty string"),
    ],
)
def test_forking_a_name_that_is_no_stream_is_refused_unknown_names_with_a_hint(
    setup: tuple[platforms.Platform, RNGStatesTracker], name: object, error: type[Exception], fragment: str
) -> None:
    platform, tracker = setup
    tracker.add("s", 1)

    def enter() -> None:
        with tracker.fork(name):  # type: ignore[arg-type]
            pass

    expect_refusal(platform, tracker, enter, error, fragment)
    assert issubclass(UnknownStreamError, KeyError) and issubclass(ArgumentTypeError, TypeError)


@pytest.mark.needs_sim
def test_forking_streams_of_another_platform_is_refused() -> None:
    tracker = RNGStatesTracker()
    with platforms.use(platforms.SimulatedPlatform()):
        tracker.add("s", 1)
    with platforms.use(platforms.CPUPlatform()) as platform:
        expect_refusal(platform, tracker, lambda: tracker.fork("s"), InvalidOperationError, "belong to platform")
        expect_refusal(platform, tracker, lambda: tracker.add("t", 2), InvalidOperationError, "belong to platform")


def test_reset_inside_a_fork_is_refused(setup: tuple[platforms.Platform, RNGStatesTracker]) -> None:
    platform, tracker = setup
    tracker.add("s", 1)
    with tracker.fork("s"):
        expect_refusal(platform, tracker, tracker.reset, InvalidOperationError, "inside a fork")
        expect_refusal(platform, tracker, lambda: tracker.reseed({"t": 2}), InvalidOperationError, "inside a fork")


def test_forks_exited_out_of_order_are_refused(setup: tuple[platforms.Platform, RNGStatesTracker]) -> None:
    _, tracker = setup
    tracker.add("s", 1)
    tracker.add("t", 2)
    outer, inner = tracker.fork("s"), tracker.fork("t")
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(InvalidOperationError, match="reverse order"):
        outer.__exit__(None, None, None)
    assert tracker.active_stream == "t"
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)
    assert tracker.active_stream is None


def test_a_fork_object_cannot_be_entered_twice_at_once(setup: tuple[platforms.Platform, RNGStatesTracker]) -> None:
    _, tracker = setup
    tracker.add("s", 1)
    fork = tracker.fork("s")
    with fork, pytest.raises(InvalidOperationError, match="already entered"):
        fork.__enter__()
    with fork:  # once exited it may be used again
        pass


def test_reseed_with_a_duplicate_seed_keeps_the_old_streams(setup: tuple[platforms.Platform, RNGStatesTracker]) -> None:
    platform, tracker = setup
    tracker.add("old", 1)
    expect_refusal(
        platform, tracker, lambda: tracker.reseed({"a": 5, "b": 5}), InvalidArgumentError, "would share seed 5"
    )
    expect_refusal(
        platform, tracker, lambda: tracker.reseed({"a": 5, "b": -1}), InvalidArgumentError, "seed of stream 'b'"
    )


def _malformed_states(platform: platforms.Platform) -> list[tuple[object, str]]:
    n = platform._state_nbytes
    return [
        (torch.zeros(n, dtype=torch.int64), "uint8"),
        (torch.zeros(n + 1, dtype=torch.uint8), "bytes"),
        (torch.zeros(1, n, dtype=torch.uint8), "1-D"),
        (torch.empty(n, dtype=torch.uint8, device="meta"), "CPU tensor"),
        (bytes(n), "state"),
        (None, "state"),
    ]


def test_set_states_refuses_a_malformed_entry_and_applies_none(
    setup: tuple[platforms.Platform, RNGStatesTracker],
) -> None:
    platform, tracker = setup
    tracker.add("a", 1)
    tracker.add("b", 2)
    with tracker.fork("a"):
        draw(platform)
    for bad, fragment in _malformed_states(platform):
        states = {"a": tracker.get_states()["a"], "b": bad}
        expect_refusal(platform, tracker, lambda s=states: tracker.set_states(s), InvalidArgumentError, fragment)


def test_set_states_refuses_a_missing_or_extra_stream(setup: tuple[platforms.Platform, RNGStatesTracker]) -> None:
    platform, tracker = setup
    tracker.add("a", 1)
    tracker.add("b", 2)
    states = tracker.get_states()
    missing = {"a": states["a"]}
    extra = {**states, "c": states["a"]}
    expect_refusal(platform, tracker, lambda: tracker.set_states(missing), InvalidArgumentError, "lacks stream")
    expect_refusal(platform, tracker, lambda: tracker.set_states(extra), UnknownStreamError, "does not hold")
    expect_refusal(platform, tracker, lambda: tracker.set_states([states["a"]]), ArgumentTypeError, "mapping")  # type: ignore[arg-type]
    expect_refusal(platform, tracker, lambda: tracker.set_states({**states, 4: states["a"]}), ArgumentTypeError, "name")  # type: ignore[dict-item]


def test_set_states_refuses_a_generator_of_another_device(sim: platforms.Platform) -> None:
    tracker = RNGStatesTracker(graph_safe=True)
    tracker.add("s", 1)
    cpu_generator = torch.Generator()
    expect_refusal(
        sim, tracker, lambda: tracker.set_states({"s": cpu_generator}), InvalidArgumentError, "SimulatedGenerator"
    )


def test_graph_safe_argument_must_be_a_bool() -> None:
    with pytest.raises(ArgumentTypeError, match="graph_safe"):
        RNGStatesTracker(graph_safe="yes")  # type: ignore[arg-type]
    assert RNGStatesTracker(graph_safe=None)._want_graph_safe is False  # None: the default


def test_replacing_the_global_tracker_inside_its_fork_is_refused(sim: platforms.Platform) -> None:
    tracker = get_rng_tracker()
    tracker.add("s", 1)
    with tracker.fork("s"), pytest.raises(InvalidOperationError, match="inside a fork"):
        set_rng_tracker(RNGStatesTracker())
    assert get_rng_tracker() is tracker
    with pytest.raises(TypeError, match="RNGStatesTracker"):
        set_rng_tracker(object())  # type: ignore[arg-type]


def test_creating_a_tracker_touches_no_device() -> None:
    module = platforms.SimulatedDeviceModule(device_type="cuda")
    with platforms.use(platforms.SimulatedPlatform(module)):
        tracker = RNGStatesTracker()
        assert tracker.graph_safe is None and len(tracker) == 0
    assert module.lazy_init_calls == 0


@pytest.mark.cuda
@pytest.mark.parametrize("graph_safe", [False, True])
def test_on_a_real_cuda_device_a_stream_draws_what_its_seed_gives(graph_safe: bool) -> None:
    with platforms.use(platforms.CUDAPlatform()) as platform:
        tracker = RNGStatesTracker(graph_safe=graph_safe)
        tracker.add("s", 1234)
        before = platform.get_rng_state()
        with tracker.fork("s"):
            inside = torch.rand(8, device=platform.device())
        assert torch.equal(before, platform.get_rng_state())
        platform.manual_seed(1234)
        expected = torch.rand(8, device=platform.device())
        platform.set_rng_state(before)
        assert torch.equal(inside, expected)
        snapshot = tracker.get_states(as_tensors=True)
        assert all(state.device.type == "cpu" for state in snapshot.values())


# -- threads ------------------------------------------------------------------------------------
def test_a_fork_on_a_second_thread_is_refused_while_another_thread_has_one_open() -> None:
    import threading

    from hyperrng.errors import InvalidOperationError

    tracker = get_rng_tracker()
    tracker.reseed({"a": 1, "b": 2})
    platform = platforms.current()
    default_before = platform.get_rng_state()
    inside, release, errors = threading.Event(), threading.Event(), []

    def first() -> None:
        with tracker.fork("a"):
            inside.set()
            release.wait(timeout=60)

    def second() -> None:
        inside.wait(timeout=60)
        try:
            with tracker.fork("b"):
                pass
        except InvalidOperationError as exc:
            errors.append(str(exc))
        try:
            tracker.set_states(tracker.get_states())
        except InvalidOperationError as exc:
            errors.append(str(exc))
        release.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    key = f"{platform.device_type}:{platform.current_device()}"
    assert len(errors) == 2 and f"tracker.fork on {key} was refused" in errors[0]
    assert "another thread has a fork of stream 'a' open" in errors[1]
    assert tracker.active_stream is None
    assert torch.equal(platform.get_rng_state(), default_before), "the default generator was not restored"
    tracker.reset()  # nothing left half-open


# -- DataLoader workers ---------------------------------------------------------------------------
class _Noise(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Samples drawn inside a fork of a tracker stream, as a data pipeline adding noise would; or, ``beside``,
    from torch's own generator after a fork of stream ``"a"``."""

    def __init__(self, tracker: RNGStatesTracker, beside: bool = False, stream: str = "model-parallel-rng") -> None:
        self.tracker, self.beside, self.stream = tracker, beside, stream

    def __len__(self) -> int:
        return 4 if self.beside else 8

    def __getitem__(self, index: int) -> torch.Tensor:
        with self.tracker.fork("a" if self.beside else self.stream):
            if not self.beside:
                return torch.rand(3)
        return torch.rand(2)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="DataLoader workers made by fork")
def test_dataloader_workers_draw_distinct_streams_the_same_in_every_run(cpu: platforms.Platform) -> None:
    """A worker made by fork inherits the tracker; at its first fork each stream is re-derived from torch's
    seed for the worker, as torch reseeds its own generator (before, 4 of 8 samples repeated)."""
    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)

    def epoch() -> list[tuple[float, ...]]:
        loader = torch.utils.data.DataLoader(_Noise(tracker), num_workers=2, multiprocessing_context="fork")
        return [tuple(batch.flatten().tolist()) for batch in loader]

    torch.manual_seed(0)
    first, second = epoch(), epoch()
    assert len(set(first)) == 8, "two workers drew the same noise"
    assert set(first).isdisjoint(second), "the next epoch's workers must draw new numbers"
    torch.manual_seed(0)  # a resume puts the generator back: the loader draws its workers' seeds again
    assert epoch() == first
    with tracker.fork("model-parallel-rng"):  # the parent's stream is its own: workers never moved it
        parent = torch.rand(3)
    fresh = RNGStatesTracker()
    fresh.add("model-parallel-rng", 1234)
    with fresh.fork("model-parallel-rng"):
        assert torch.equal(parent, torch.rand(3))


def _worker_seeded(worker_id: int) -> None:
    """A worker_init_fn that sets the streams itself, the same in every worker."""
    info = torch.utils.data.get_worker_info()
    assert info is not None
    info.dataset.tracker.reseed({"model-parallel-rng": 77})  # type: ignore[attr-defined]


def _worker_adds(worker_id: int) -> None:
    """A worker_init_fn that adds a stream of its own beside the inherited one."""
    info = torch.utils.data.get_worker_info()
    assert info is not None
    info.dataset.tracker.add("own", 1000 + worker_id)  # type: ignore[attr-defined]


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="compared with DataLoader workers made by fork")
def test_dataloader_workers_made_by_spawn_draw_what_forked_ones_draw(cpu: platforms.Platform) -> None:
    """A spawned worker unpickles the tracker with its dataset and re-derives its streams at its first fork, as a
    forked one does (before, its first fork failed: the unpickled tracker's platform was another object). A
    worker_init_fn that sets the streams itself keeps them, under either start method."""
    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)

    def epoch(context: str, init: Any = None, stream: str = "model-parallel-rng") -> list[tuple[float, ...]]:
        torch.manual_seed(0)
        loader = torch.utils.data.DataLoader(
            _Noise(tracker, stream=stream), num_workers=2, multiprocessing_context=context, worker_init_fn=init
        )
        return [tuple(batch.flatten().tolist()) for batch in loader]

    spawned = epoch("spawn")
    assert len(set(spawned)) == 8 and spawned == epoch("fork")
    seeded = epoch("fork", _worker_seeded)
    assert len(set(seeded)) == 4 and seeded[0::2] == seeded[1::2], "each worker keeps the streams it set"
    own = epoch("fork", _worker_adds, "own")  # the stream a worker adds is its own; the inherited one is derived
    for worker in (0, 1):
        alone = RNGStatesTracker()
        alone.add("own", 1000 + worker)
        with alone.fork("own"):
            assert own[worker] == tuple(torch.rand(3).tolist())


def test_a_fork_of_an_empty_tracker_in_a_dataloader_worker_says_to_keep_the_tracker_on_the_dataset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker started by spawn imports hyperrng afresh: a dataset that forks the process-wide tracker finds it
    empty. The refusal says so and names the remedy, rather than "seed the streams first", which the user did."""
    tracker = RNGStatesTracker()
    with pytest.raises(UnknownStreamError, match="seed the streams first"):
        tracker.fork("model-parallel-rng").__enter__()
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())  # as inside a worker
    with pytest.raises(UnknownStreamError, match=r"DataLoader worker.*self\.tracker = hyperrng\.get_rng_tracker\(\)"):
        tracker.fork("model-parallel-rng").__enter__()
    tracker.add("a", 1)  # a tracker that holds streams: the usual message
    with pytest.raises(UnknownStreamError, match="seed the streams first"):
        tracker.fork("model-parallel-rng").__enter__()


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="DataLoader workers made by fork")
def test_dataloader_workers_draw_the_same_after_a_resume_whatever_made_the_streams(cpu: platforms.Platform) -> None:
    """Workers derive their streams from the states the parent's streams hold, not from seeds: a tracker
    restored from a snapshot (a resume: set_states, which records no seed), into a fresh tracker or over one
    seeded otherwise, gives its workers the numbers of the uninterrupted run (before, the fresh tracker's
    workers lost every stream, and the reseeded one's drew from the other seeds)."""
    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)

    def epoch(t: RNGStatesTracker) -> list[tuple[float, ...]]:
        loader = torch.utils.data.DataLoader(_Noise(t), num_workers=2, multiprocessing_context="fork")
        return [tuple(batch.flatten().tolist()) for batch in loader]

    torch.manual_seed(0)
    epoch(tracker)
    generator, snapshot = torch.get_rng_state(), tracker.get_states()  # a checkpoint between two epochs
    second = epoch(tracker)
    assert len(set(second)) == 8
    fresh = RNGStatesTracker()
    fresh.set_states(snapshot)
    other = RNGStatesTracker()
    other.add("model-parallel-rng", 999)
    other.set_states(snapshot)
    for resumed in (fresh, other):
        torch.set_rng_state(generator)
        assert epoch(resumed) == second


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="DataLoader workers made by fork")
def test_workers_started_inside_a_fork_keep_the_generator_torch_seeded_for_them(cpu: platforms.Platform) -> None:
    """A loader iterated inside a fork: each worker inherits the open fork, which its first fork of its own
    drops without giving the generator the state from before it; torch seeded that generator for the worker
    since (before, every worker drew the parent's next numbers, the same in each)."""
    tracker = RNGStatesTracker()
    tracker.reseed({"a": 11, "b": 12})

    def items() -> list[tuple[float, ...]]:
        loader = torch.utils.data.DataLoader(
            _Noise(tracker, beside=True), batch_size=None, num_workers=2, multiprocessing_context="fork"
        )
        return [tuple(x.tolist()) for x in loader]

    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        tracker.reseed({"a": 11, "b": 12})
        with tracker.fork("b"):  # the loader draws its workers' base seed from stream b, current here
            inside = items()
            parent = tuple(torch.rand(2).tolist())
        assert len(set(inside)) == 4 and parent not in inside
        runs.append(inside)
    assert runs[0] == runs[1]


def test_a_compiled_function_with_a_fork_draws_the_eager_numbers_without_tracing_the_swap(
    cpu: platforms.Platform,
) -> None:
    """The swap runs as Python behind a graph break: Dynamo never traces into it (it warned twice about
    the tracker's internals, threading and Generator.set_state)."""
    import warnings

    def step(tracker: RNGStatesTracker, x: torch.Tensor) -> torch.Tensor:
        with tracker.fork("model-parallel-rng"):
            y = torch.nn.functional.dropout(x, 0.5)
        return y * 2

    def fresh() -> RNGStatesTracker:
        tracker = RNGStatesTracker()
        tracker.add("model-parallel-rng", 1234)
        return tracker

    x = torch.ones(64)
    eager, compiled_tracker = step(fresh(), x), fresh()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(step, backend="aot_eager")(compiled_tracker, x)
    assert torch.equal(compiled, eager)
    assert not [w for w in caught if "Dynamo" in str(w.message)], [str(w.message)[:120] for w in caught]
    assert compiled_tracker.active_stream is None


@pytest.mark.parametrize("tracer", ["make_fx", "make_fx at pre-dispatch", "export"])
def test_a_fork_that_a_graph_tracer_would_bake_out_is_refused_before_it_moves_a_stream(
    cpu: platforms.Platform, tracer: str
) -> None:
    """make_fx and (non-strict) torch.export record tensor ops, not the fork's swap of the generator: the
    graph drew from the default generator (before, silently)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)

    class Step(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with tracker.fork("model-parallel-rng"):
                return torch.nn.functional.dropout(x, 0.5)

    before, default = tracker.get_states(), torch.get_rng_state()
    with pytest.raises(InvalidOperationError, match="cannot be forked while torch.export or make_fx traces"):
        if tracer.startswith("make_fx"):
            make_fx(Step(), pre_dispatch=tracer.endswith("pre-dispatch"))(torch.ones(4))
        else:
            torch.export.export(Step(), (torch.ones(4),), strict=False)
    assert torch.equal(tracker.get_states()["model-parallel-rng"], before["model-parallel-rng"])
    assert torch.equal(torch.get_rng_state(), default)
    assert tracker.active_stream is None


@pytest.mark.skipif(not hasattr(torch.compiler, "is_exporting"), reason="this torch has no export flag to look at")
def test_an_export_on_another_thread_refuses_no_fork_on_this_one(cpu: platforms.Platform) -> None:
    """torch.export's flag is process-wide: a fork here is refused only where export's fake tensors are too."""
    import threading

    inside, release = threading.Event(), threading.Event()

    class Waits(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            inside.set()
            release.wait(60)
            return x + 1

    exporter = threading.Thread(target=lambda: torch.export.export(Waits(), (torch.ones(2),), strict=False))
    exporter.start()
    try:
        assert inside.wait(60)
        tracker = RNGStatesTracker()
        tracker.add("model-parallel-rng", 1234)
        with tracker.fork("model-parallel-rng"):
            drawn = torch.rand(2)
    finally:
        release.set()
        exporter.join()
    fresh = RNGStatesTracker()
    fresh.add("model-parallel-rng", 1234)
    with fresh.fork("model-parallel-rng"):
        assert torch.equal(drawn, torch.rand(2))
