"""Seeding recipes, each checked against its published formula, on the CPU and an accelerator."""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable, Iterator
from typing import Any

import hyperrng.platforms as platforms
import numpy as np
import pytest
import torch
from hyperrng.platforms.mix import combine64

from hyperrng.errors import (
    ArgumentTypeError,
    HyperRNGError,
    InvalidArgumentError,
    InvalidOperationError,
)
from hyperrng.seeding.recipes import (
    NUMPY_DOMAIN,
    PYTHON_RANDOM_DOMAIN,
    SLAPO_DEFAULT_SEED,
    MegatronSeeds,
    is_random_seed_set,
    library_seed,
    megatron_model_parallel_manual_seed,
    megatron_seeds,
    megatron_set_random_seed,
    model_parallel_cuda_manual_seed,
    model_parallel_manual_seed,
    seed_host,
    set_random_seed,
    set_seeds,
)
from hyperrng.streams.tracker import (
    DATA_PARALLEL_STREAM,
    EXPERT_PARALLEL_STREAM,
    MODEL_PARALLEL_STREAM,
    get_rng_tracker,
)
from tests._platforms import PLATFORMS, use_each

TWO_PLATFORMS = {name: PLATFORMS[name] for name in ("cpu", "sim")}


@pytest.fixture(autouse=True)
def _fresh_global_tracker(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # set_seeds writes it; monkeypatch restores it
    get_rng_tracker().reset()
    yield
    get_rng_tracker().reset()


platform = use_each(TWO_PLATFORMS)


def device_state_for(platform: platforms.Platform, seed: int) -> list[int]:
    """The current device's state right after manual_seed(seed), leaving the device as found."""
    saved = platform.get_rng_state()
    platform.manual_seed(seed)
    state = platform.get_rng_state().tolist()
    platform.set_rng_state(saved)
    return state


def everything(platform: platforms.Platform) -> dict[str, Any]:
    """Every piece of global RNG state a recipe may touch, as comparable values."""
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:]),
        "cpu": torch.get_rng_state().tolist(),
        "devices": [platform.get_rng_state(i).tolist() for i in range(platform.device_count())],
        "streams": {k: v.tolist() for k, v in get_rng_tracker().get_states(as_tensors=True).items()},
        "hashseed": os.environ.get("PYTHONHASHSEED"),
    }


def expect_refusal(
    platform: platforms.Platform, call: Callable[[], object], error: type[Exception], fragment: str
) -> None:
    get_rng_tracker().reseed({"existing": 77})
    before = everything(platform)
    with pytest.raises(error, match=fragment) as info:
        call()
    assert isinstance(info.value, HyperRNGError)
    assert everything(platform) == before, "a refused recipe changed state"


def host_seeded_with(seed: int) -> dict[str, Any]:
    """Python, NumPy and torch CPU states after seeding each with ``seed`` the plain way."""
    random.seed(seed)
    np.random.seed(seed)
    torch.default_generator.manual_seed(seed)
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:]),
        "cpu": torch.get_rng_state().tolist(),
    }


# -- slapo ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("dp_rank", "pp_rank", "expected"),
    [(None, None, 2013), (3, None, 2013 + 10 * 3), (None, 2, 2013 + 100 * 2), (3, 2, 2013 + 100 * 2 + 10 * 3)],
)
def test_slapo_set_random_seed_shifts_by_pipeline_and_data_ranks(
    platform: platforms.Platform, dp_rank: int | None, pp_rank: int | None, expected: int
) -> None:
    assert set_random_seed(dp_rank=dp_rank, pp_rank=pp_rank) == expected
    seeded = everything(platform)
    assert {k: seeded[k] for k in ("python", "numpy", "cpu")} == host_seeded_with(expected)
    assert seeded["devices"] == [device_state_for(platform, expected)] * platform.device_count()
    assert not is_random_seed_set(), "without tp_rank the tracker is left alone"


def test_slapo_default_seed_is_2013() -> None:
    assert SLAPO_DEFAULT_SEED == 2013


def test_slapo_tp_rank_adds_the_model_parallel_stream_on_every_platform(platform: platforms.Platform) -> None:
    base = set_random_seed(100, dp_rank=1, pp_rank=1, tp_rank=3)
    assert base == 100 + 100 + 10
    tracker = get_rng_tracker()
    assert tracker.seeds() == {MODEL_PARALLEL_STREAM: base + 2718 + 3}
    assert platform.get_rng_state().tolist() == device_state_for(platform, base)
    assert is_random_seed_set()


def test_slapo_model_parallel_seed_creates_the_one_model_parallel_stream(platform: platforms.Platform) -> None:
    assert model_parallel_manual_seed(50, tp_rank=2) == 50 + 2718 + 2
    assert get_rng_tracker().seeds() == {MODEL_PARALLEL_STREAM: 2770}
    assert platform.get_rng_state().tolist() == device_state_for(platform, 50)


# -- model_parallel_cuda_manual_seed: Megatron-core's name, signature and streams ----------------


@pytest.mark.parametrize(
    "call",
    [
        lambda: model_parallel_cuda_manual_seed(50, tp_rank=2, ep_rank=3, etp_rank=1),
        lambda: model_parallel_cuda_manual_seed(50, False, False, False, 2, 3, 1, True),
        lambda: model_parallel_cuda_manual_seed(50, tp_rank=2, ep_rank=3, etp_rank=1, force_reset_rng=True),
    ],
    ids=["keywords", "positional", "force-reset"],
)
def test_a_megatron_style_call_creates_megatrons_three_streams_with_its_formulas(
    platform: platforms.Platform, call: Callable[[], MegatronSeeds]
) -> None:
    get_rng_tracker().reseed({"left-over": 9})
    seeds = call()
    assert seeds == megatron_seeds(50, 2, 3, 1)
    assert get_rng_tracker().seeds() == {
        DATA_PARALLEL_STREAM: 50,
        MODEL_PARALLEL_STREAM: 50 + 2718 + 2,
        EXPERT_PARALLEL_STREAM: 50 + 1024 + 100 * 3 + 1,
    }
    assert platform.get_rng_state().tolist() == device_state_for(platform, 50)


def test_a_megatron_style_call_with_only_a_seed_uses_rank_0_in_a_process_alone(platform: platforms.Platform) -> None:
    model_parallel_cuda_manual_seed(50)
    assert get_rng_tracker().seeds() == megatron_seeds(50).as_streams()


@pytest.mark.parametrize(
    ("call", "error", "fragment"),
    [
        (lambda: model_parallel_cuda_manual_seed(50, 2), ArgumentTypeError, "te_rng_tracker must be True or False"),
        (
            lambda: model_parallel_cuda_manual_seed(50, 2, True),
            ArgumentTypeError,
            "call hyperrng.model_parallel_manual_seed",
        ),
        (lambda: model_parallel_cuda_manual_seed(50, force_reset_rng=1), ArgumentTypeError, "force_reset_rng must be"),
        (
            lambda: model_parallel_cuda_manual_seed(50, te_rng_tracker=True),
            InvalidArgumentError,
            "te_rng_tracker=True selects",
        ),
        (
            lambda: model_parallel_cuda_manual_seed(50, inference_rng_tracker=True, use_cudagraphable_rng=True),
            InvalidArgumentError,
            "inference_rng_tracker, use_cudagraphable_rng=True selects",
        ),
        (
            lambda: model_parallel_cuda_manual_seed(50, tp_rank=-1),
            InvalidArgumentError,
            "tp_rank must be a non-negative int",
        ),
        (lambda: model_parallel_cuda_manual_seed(-5, tp_rank=0), InvalidArgumentError, "seed must be in"),
        (lambda: model_parallel_cuda_manual_seed(50, tp_rank="0"), ArgumentTypeError, "tp_rank"),
    ],
    ids=[
        "slapo-positional",
        "slapo-always-enable",
        "flag-not-bool",
        "te",
        "inference-and-graphs",
        "rank",
        "seed",
        "rank-type",
    ],
)
def test_a_call_megatron_core_would_not_make_or_hyperrng_cannot_honour_is_refused_and_changes_nothing(
    platform: platforms.Platform, call: Callable[[], object], error: type[Exception], fragment: str
) -> None:
    expect_refusal(platform, call, error, re.escape(fragment))


def test_a_tracker_flag_is_refused_with_a_pointer_to_megatron_model_parallel_manual_seed() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        model_parallel_cuda_manual_seed(50, te_rng_tracker=True)
    assert str(info.value).endswith(
        "Drop the flag, or call hyperrng.megatron_model_parallel_manual_seed(seed, tp_rank, ep_rank, etp_rank)."
    )


def test_the_slapo_style_refusal_points_to_slapos_function() -> None:
    with pytest.raises(ArgumentTypeError) as info:
        model_parallel_cuda_manual_seed(50, 2, True)
    assert "for slapo's (seed, tp_rank, always_enable_tp_seed) call hyperrng.model_parallel_manual_seed" in str(
        info.value
    )


def _megatron_style_without_ranks(rank: int, world_size: int) -> str:
    get_rng_tracker().reset()
    try:
        model_parallel_cuda_manual_seed(50)
    except HyperRNGError as exc:
        return f"{type(exc).__name__}: {exc} / streams {len(get_rng_tracker())}"
    return "seeded"


@pytest.mark.multiproc
def test_a_megatron_style_call_without_ranks_is_refused_where_the_process_has_peers() -> None:
    from tests._dist import run_ranks

    messages = run_ranks(_megatron_style_without_ranks, 2)
    assert len(set(messages)) == 1
    assert messages[0].startswith(
        "InvalidArgumentError: tp_rank, ep_rank, etp_rank not given: "
        "hyperrng does not read Megatron-core's parallel state"
    )
    assert messages[0].endswith("megatron_model_parallel_manual_seed(seed, tp_rank, ep_rank, etp_rank). / streams 0")


def test_slapo_always_enable_tp_seed_gives_the_default_generator_the_tp_seed(platform: platforms.Platform) -> None:
    tp_seed = model_parallel_manual_seed(50, tp_rank=2, always_enable_tp_seed=True)
    assert platform.get_rng_state().tolist() == device_state_for(platform, tp_seed)


def test_slapo_model_parallel_seed_replaces_the_streams(platform: platforms.Platform) -> None:
    get_rng_tracker().add("stale", 1)
    model_parallel_manual_seed(50, tp_rank=0)
    assert list(get_rng_tracker().get_states()) == [MODEL_PARALLEL_STREAM]


def test_is_random_seed_set_follows_the_tracker(platform: platforms.Platform) -> None:
    assert not is_random_seed_set()
    model_parallel_manual_seed(1, tp_rank=0)
    assert is_random_seed_set()
    get_rng_tracker().reset()
    assert not is_random_seed_set()


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"seed": -1}, InvalidArgumentError, "seed must be in"),
        ({"seed": 2**64}, InvalidArgumentError, "seed must be in"),
        ({"seed": True}, ArgumentTypeError, "bool"),
        ({"seed": "7"}, ArgumentTypeError, "must be an int"),
        ({"seed": 1, "dp_rank": -1}, InvalidArgumentError, "dp_rank must be a non-negative int"),
        ({"seed": 1, "pp_rank": 1.0}, ArgumentTypeError, "pp_rank must be an int"),
        ({"seed": 1, "tp_rank": True}, ArgumentTypeError, "tp_rank must be an int"),
        ({"seed": 2**64 - 1, "pp_rank": 1}, InvalidArgumentError, "exceeds 2\\*\\*64 - 1"),
        ({"seed": 2**64 - 1, "tp_rank": 0}, InvalidArgumentError, "exceeds 2\\*\\*64 - 1"),
    ],
)
def test_slapo_refuses_bad_input_and_seeds_nothing(
    platform: platforms.Platform, kwargs: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    expect_refusal(platform, lambda: set_random_seed(**kwargs), error, fragment)


def test_model_parallel_seed_refuses_a_bad_rank(platform: platforms.Platform) -> None:
    expect_refusal(platform, lambda: model_parallel_manual_seed(1, tp_rank=-2), InvalidArgumentError, "tp_rank")


def test_recipes_refuse_to_reseed_inside_a_fork(platform: platforms.Platform) -> None:
    tracker = get_rng_tracker()
    tracker.add("s", 1)
    with tracker.fork("s"):
        before = everything(platform)
        for call in (
            lambda: set_random_seed(1, tp_rank=0),
            lambda: model_parallel_manual_seed(1, 0),
            lambda: megatron_set_random_seed(1),
            lambda: megatron_model_parallel_manual_seed(1),
            lambda: set_seeds(42),  # d9d's: once seeded Python and NumPy, then reseeded the forked stream
            lambda: seed_host(42),
        ):
            with pytest.raises(InvalidOperationError, match="inside a fork"):
                call()
            assert everything(platform) == before


@pytest.mark.parametrize("context", ["another tracker's fork", "fork_rng", "portable_random(seed)"])
def test_seeding_inside_a_context_that_swapped_the_generator_is_refused(
    platform: platforms.Platform, context: str
) -> None:
    """Inside another tracker's fork, fork_rng or a seeded portable block the generator holds that context's stream,
    which its exit puts back: seeding there reseeded that stream, and the run's generator never got its seed."""
    from hyperrng.platforms import _features

    from hyperrng import RNGStatesTracker, apply_layout, fork_rng, portable_random
    from hyperrng.seeding.layout import StreamLayout

    if context == "portable_random(seed)" and not _features.feature("portable-mode").available:
        pytest.skip(_features.feature("portable-mode").refusal())
    other = RNGStatesTracker()
    other.add("u", 1)
    layout = StreamLayout(dims=("dp",), default=("dp",), streams={"a": ()})
    opened = {
        "another tracker's fork": lambda: other.fork("u"),
        "fork_rng": fork_rng,
        "portable_random(seed)": lambda: portable_random(5),
    }[context]
    with opened():
        stuck = RNGStatesTracker()  # forks left stuck by an exit refused as out of order: recipes may clear them
        stuck.reseed({"x": 1, "y": 2})
        x, y = stuck.fork("x"), stuck.fork("y")
        x.__enter__()
        y.__enter__()
        with pytest.raises(InvalidOperationError, match="out of order|reverse order"):
            x.__exit__(None, None, None)
        before = everything(platform)
        for call in (
            lambda: apply_layout(layout, 12, {"dp": 0}, tracker=RNGStatesTracker()),
            lambda: model_parallel_cuda_manual_seed(3, tracker=RNGStatesTracker()),
            lambda: megatron_model_parallel_manual_seed(3, tracker=RNGStatesTracker()),
            lambda: set_seeds(42),
            lambda: seed_host(42),
            lambda: set_random_seed(3, tp_rank=0, tracker=stuck),  # before they cleared the stuck forks
            lambda: megatron_set_random_seed(3, tracker=stuck),
        ):
            with pytest.raises(InvalidOperationError, match="inside a"):
                call()
            assert everything(platform) == before
            assert stuck.active_stream == "y"
        stuck.reset()  # clears them (their holds too), inside the context as they were made


# -- Megatron-core ----------------------------------------------------------------------------
@pytest.mark.parametrize(("tp", "ep", "etp"), [(0, 0, 0), (3, 0, 0), (1, 5, 2), (7, 31, 1)])
def test_megatron_formulas(tp: int, ep: int, etp: int) -> None:
    seed = 1234
    assert megatron_seeds(seed, tp, ep, etp) == MegatronSeeds(
        data_parallel=seed,
        model_parallel=seed + 2718 + tp,
        expert_parallel=seed + 1024 + 100 * ep + etp,
    )


def test_megatron_model_parallel_seed_adds_its_three_streams(platform: platforms.Platform) -> None:
    seeds = megatron_model_parallel_manual_seed(1234, tp_rank=2, ep_rank=3, etp_rank=1)
    assert get_rng_tracker().seeds() == {
        DATA_PARALLEL_STREAM: 1234,
        MODEL_PARALLEL_STREAM: 1234 + 2718 + 2,
        EXPERT_PARALLEL_STREAM: 1234 + 1024 + 300 + 1,
    }
    assert seeds.as_streams() == get_rng_tracker().seeds()
    assert platform.get_rng_state().tolist() == device_state_for(platform, 1234)


def test_megatron_collision_is_refused_and_changes_nothing(platform: platforms.Platform) -> None:
    # One rank whose model-parallel and expert seeds coincide: 2718 + 7 == 1024 + 100 * 17 + 1.
    tp, ep, etp = 7, 17, 1
    assert megatron_seeds(5, tp, ep, etp).model_parallel == megatron_seeds(5, tp, ep, etp).expert_parallel
    expect_refusal(
        platform, lambda: megatron_model_parallel_manual_seed(5, tp, ep, etp), InvalidArgumentError, "additive formulas"
    )
    expect_refusal(
        platform,
        lambda: megatron_set_random_seed(5, tp_rank=tp, ep_rank=ep, etp_rank=etp),
        InvalidArgumentError,
        "additive formulas",
    )


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"pp_rank": 2, "dp_rank": 3}, 1000 + 200),
        ({"pp_rank": 2, "dp_rank": 3, "data_parallel_random_init": True}, 1000 + 200 + 30),
        ({}, 1000),
    ],
)
def test_megatron_set_random_seed_shifts_by_pipeline_and_optionally_data_ranks(
    platform: platforms.Platform, kwargs: dict[str, Any], expected: int
) -> None:
    assert megatron_set_random_seed(1000, tp_rank=1, **kwargs) == expected
    seeded = everything(platform)
    assert {k: seeded[k] for k in ("python", "numpy", "cpu")} == host_seeded_with(expected)
    assert get_rng_tracker().seeds()[MODEL_PARALLEL_STREAM] == expected + 2718 + 1
    assert platform.get_rng_state().tolist() == device_state_for(platform, expected)


def test_megatron_set_random_seed_takes_data_parallel_random_init_where_megatron_passes_it(
    platform: platforms.Platform,
) -> None:
    """Megatron calls ``_set_random_seed(seed, data_parallel_random_init)``: the call ported as it is."""
    assert megatron_set_random_seed(1000, True, dp_rank=3) == 1030
    assert megatron_set_random_seed(1000, False, dp_rank=3) == 1000


@pytest.mark.parametrize(
    ("call", "error", "fragment"),
    [
        (lambda: megatron_set_random_seed(0), InvalidArgumentError, "positive"),
        (lambda: megatron_set_random_seed(1, pp_rank=-1), InvalidArgumentError, "pp_rank"),
        (lambda: megatron_set_random_seed(1, ep_rank=None), ArgumentTypeError, "ep_rank"),  # type: ignore[arg-type]
        (lambda: megatron_model_parallel_manual_seed(2**64 - 1), InvalidArgumentError, "exceeds"),
        (lambda: megatron_model_parallel_manual_seed(1, etp_rank=-3), InvalidArgumentError, "etp_rank"),
    ],
)
def test_megatron_refuses_bad_input_and_seeds_nothing(
    platform: platforms.Platform, call: Callable[[], object], error: type[Exception], fragment: str
) -> None:
    expect_refusal(platform, call, error, fragment)


# -- d9d --------------------------------------------------------------------------------------
class FakeDeviceMesh:
    """What hyperrng reads from a torch DeviceMesh: dimension names and this rank's coordinate."""

    def __init__(self, names: tuple[str, ...] | None, coordinate: list[int] | None) -> None:
        self.mesh_dim_names = names
        self._coordinate = coordinate

    def get_coordinate(self) -> list[int] | None:
        return self._coordinate


def test_d9d_without_a_mesh_seeds_everything_with_the_seed(platform: platforms.Platform) -> None:
    assert set_seeds(42) == 42
    seeded = everything(platform)
    assert {k: seeded[k] for k in ("python", "numpy", "cpu")} == host_seeded_with(42)
    assert seeded["devices"] == [device_state_for(platform, 42)] * platform.device_count()
    assert os.environ["PYTHONHASHSEED"] == "42"


@pytest.mark.parametrize(
    "mesh", [{"dp": 1, "pp": 3, "tp": 0}, FakeDeviceMesh(("dp", "pp", "tp"), [1, 3, 0])], ids=["mapping", "device-mesh"]
)
def test_d9d_shifts_the_seed_by_the_distinct_dimension(platform: platforms.Platform, mesh: object) -> None:
    assert set_seeds(42, mesh) == 45
    assert set_seeds(42, mesh, distinct_dim="dp") == 43


def test_d9d_wraps_modulo_2_to_the_64(platform: platforms.Platform) -> None:
    assert set_seeds(2**64 - 1, {"pp": 2}) == 1
    assert os.environ["PYTHONHASHSEED"] == "1"


def test_d9d_sets_pythonhashseed_modulo_2_to_the_32(platform: platforms.Platform) -> None:
    set_seeds(2**40 + 5)
    assert os.environ["PYTHONHASHSEED"] == "5"


HOST_SEEDS = (0, 5, SLAPO_DEFAULT_SEED, 2**32 - 1, 2**32, 2**32 + 5, 2**33 + 5, 2**40 + 7, 2**63 + 5, 2**64 - 1)


def host_draws() -> tuple[list[float], list[float]]:
    """The next four draws of Python's ``random`` and of NumPy's legacy global state."""
    return [random.random() for _ in range(4)], np.random.random_sample(4).tolist()


@pytest.mark.parametrize("seed", HOST_SEEDS)
def test_python_random_and_numpy_draw_distinct_streams_for_every_host_seed(seed: int) -> None:
    with platforms.use(platforms.CPUPlatform()):
        seed_host(seed)
        python, numpy = host_draws()
        assert set(python).isdisjoint(numpy), f"seed {seed}: random and NumPy drew the same numbers"


@pytest.mark.parametrize(
    "recipe",
    [
        lambda s: seed_host(s),
        lambda s: set_random_seed(s),
        lambda s: set_random_seed(s, tp_rank=0),
        lambda s: set_seeds(s),
        lambda s: megatron_set_random_seed(s),
    ],
    ids=["seed_host", "set_random_seed", "set_random_seed-tp", "set_seeds", "megatron_set_random_seed"],
)
def test_every_recipe_gives_python_and_numpy_distinct_streams_for_a_seed_above_2_to_the_32(
    platform: platforms.Platform, recipe: Callable[[int], object]
) -> None:
    recipe(2**40 + 7)
    python, numpy = host_draws()
    assert set(python).isdisjoint(numpy)


@pytest.mark.parametrize("seed", [s for s in HOST_SEEDS if s < 2**32])
def test_seeds_below_2_to_the_32_seed_python_and_numpy_exactly_as_their_own_seed_functions(seed: int) -> None:
    with platforms.use(platforms.CPUPlatform()):
        seed_host(seed)
        got = everything(platforms.current())
        expected = host_seeded_with(seed)
        assert (got["python"], got["numpy"]) == (expected["python"], expected["numpy"])


@pytest.mark.parametrize("seed", [s for s in HOST_SEEDS if s >= 2**32])
def test_seeds_from_2_to_the_32_reach_each_library_through_its_own_domain(seed: int) -> None:
    with platforms.use(platforms.CPUPlatform()):
        seed_host(seed)
        got = host_draws()
        python_seed, numpy_seed = combine64(PYTHON_RANDOM_DOMAIN, seed), combine64(NUMPY_DOMAIN, seed)
        assert (library_seed(seed, PYTHON_RANDOM_DOMAIN), library_seed(seed, NUMPY_DOMAIN)) == (
            python_seed,
            numpy_seed,
        )
        random.seed(python_seed)
        np.random.seed(np.array([numpy_seed & 0xFFFFFFFF, numpy_seed >> 32], dtype=np.uint32))
        assert host_draws() == got


def test_distinct_64_bit_host_seeds_give_numpy_distinct_states() -> None:
    with platforms.use(platforms.CPUPlatform()):
        draws = set()
        for seed in HOST_SEEDS:
            seed_host(seed)
            draws.add(tuple(np.random.random_sample(4).tolist()))
        assert len(draws) == len(HOST_SEEDS)


def test_the_library_domains_are_distinct_named_constants() -> None:
    assert PYTHON_RANDOM_DOMAIN != NUMPY_DOMAIN
    assert PYTHON_RANDOM_DOMAIN.to_bytes(8, "big") == b"PYRANDOM" and NUMPY_DOMAIN.to_bytes(8, "big") == b"NUMPYRNG"


@pytest.mark.parametrize(
    ("mesh", "fragment", "error"),
    [
        ({"dp": 1}, "no dimension 'pp'", InvalidArgumentError),
        ({"pp": -1}, "coordinate of 'pp'", InvalidArgumentError),
        ({"pp": True}, "bool", ArgumentTypeError),
        (FakeDeviceMesh(("pp",), None), "not part of the mesh", InvalidArgumentError),
        (FakeDeviceMesh(None, [0]), "no mesh_dim_names", InvalidArgumentError),
        (object(), "DeviceMesh", ArgumentTypeError),
    ],
)
def test_d9d_refuses_a_bad_mesh_and_seeds_nothing(
    platform: platforms.Platform, mesh: object, fragment: str, error: type[Exception]
) -> None:
    expect_refusal(platform, lambda: set_seeds(1, mesh), error, fragment)


def test_d9d_refuses_a_bad_seed_and_seeds_nothing(platform: platforms.Platform) -> None:
    expect_refusal(platform, lambda: set_seeds(-5), InvalidArgumentError, "seed must be in")


def test_a_tracker_the_platform_cannot_serve_is_refused_before_the_host_is_seeded() -> None:
    import random as py_random

    import numpy as np

    from hyperrng.seeding.recipes import megatron_set_random_seed, set_random_seed
    from hyperrng.streams.tracker import RNGStatesTracker

    needs_graph_safe = RNGStatesTracker(graph_safe=True)  # the CPU generator has no graph-safe API
    with platforms.use(platforms.CPUPlatform()):
        before = (py_random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
        for call in (
            lambda: set_random_seed(7, tp_rank=0, tracker=needs_graph_safe),
            lambda: megatron_set_random_seed(7, tracker=needs_graph_safe),
        ):
            with pytest.raises(InvalidOperationError, match="graph_safe=True"):
                call()
            assert py_random.getstate() == before[0]
            assert (np.random.get_state()[1] == before[1]).all()
            assert torch.equal(torch.get_rng_state(), before[2])


@pytest.mark.parametrize("kwargs", [{}, {"tp_rank": 0}], ids=["without-tp", "with-tp"])
def test_set_random_seed_inside_a_fork_is_refused_either_way(kwargs: dict[str, int]) -> None:
    tracker = get_rng_tracker()
    tracker.reseed({MODEL_PARALLEL_STREAM: 5})
    platform = platforms.current()
    with tracker.fork(MODEL_PARALLEL_STREAM):
        before = everything(platform)
        with pytest.raises(InvalidOperationError, match="inside a fork"):
            set_random_seed(1, **kwargs)
        assert everything(platform) == before
