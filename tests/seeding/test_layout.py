"""The declarative stream layout: replicas share a stream, shards never collide, seeds stay put."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch
from hyperrng.platforms.mix import combine64

from hyperrng.errors import ArgumentTypeError, HyperRNGError, InvalidArgumentError, InvalidOperationError
from hyperrng.seeding.layout import (
    DEFAULT_STREAM,
    LAYOUT_DOMAIN,
    LAYOUT_FORMAT_VERSION,
    Derivation,
    StreamLayout,
    apply_layout,
    name_hash,
    recorded_derivation,
)
from hyperrng.seeding.recipes import megatron_seeds
from hyperrng.streams.tracker import (
    EXPERT_PARALLEL_STREAM,
    MODEL_PARALLEL_STREAM,
    RNGStatesTracker,
    get_rng_tracker,
)

DIMS = ("pp", "dp", "cp", "tp", "ep")
STREAMS = {
    MODEL_PARALLEL_STREAM: ("pp", "tp"),
    "data-parallel-rng": ("pp", "dp"),
    EXPERT_PARALLEL_STREAM: ("pp", "ep", "tp"),
    "context-parallel-rng": ("pp", "cp", "tp"),
}


def megatron_like_layout() -> StreamLayout:
    return StreamLayout(dims=DIMS, default=("pp",), streams=STREAMS)


@pytest.fixture(autouse=True)
def _fresh_global_tracker() -> Iterator[None]:
    get_rng_tracker().reset()
    yield
    get_rng_tracker().reset()


@pytest.fixture(params=["cpu", "sim"])
def platform(request: pytest.FixtureRequest) -> Iterator[platforms.Platform]:
    factory = platforms.CPUPlatform if request.param == "cpu" else platforms.SimulatedPlatform
    with platforms.use(factory()) as chosen:
        yield chosen


# -- the formula -------------------------------------------------------------------------------
def test_a_stream_seed_is_the_documented_mix_of_seed_name_and_coordinates() -> None:
    def blake(name: str, person: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8, person=person).digest(), "little")

    layout = megatron_like_layout()
    coords = {"pp": 1, "dp": 2, "cp": 1, "tp": 5, "ep": 9}
    expected = combine64(
        LAYOUT_DOMAIN,
        77,
        blake(EXPERT_PARALLEL_STREAM, b"hyperrng.stream"),
        blake("pp", b"hyperrng.dim"),
        1,
        blake("ep", b"hyperrng.dim"),
        9,
        blake("tp", b"hyperrng.dim"),
        5,
    )
    assert layout.seed(EXPERT_PARALLEL_STREAM, 77, coords) == expected
    assert name_hash("tp", kind="dim") == blake("tp", b"hyperrng.dim")


def test_seeds_are_pinned_across_releases_machines_and_processes() -> None:
    layout = StreamLayout(dims=("pp", "tp"), default=("pp",), streams={MODEL_PARALLEL_STREAM: ("tp",)})
    assert layout.seeds(1234, {"pp": 1, "tp": 5}) == {
        DEFAULT_STREAM: 8438433269937074658,
        MODEL_PARALLEL_STREAM: 14430681803327920806,
    }


def test_ranks_with_equal_coordinates_on_a_streams_dimensions_share_it() -> None:
    layout = megatron_like_layout()
    a = layout.seeds(5, {"pp": 0, "dp": 0, "cp": 0, "tp": 3, "ep": 0})
    b = layout.seeds(5, {"pp": 0, "dp": 7, "cp": 1, "tp": 3, "ep": 4})
    assert a[MODEL_PARALLEL_STREAM] == b[MODEL_PARALLEL_STREAM]
    assert a[DEFAULT_STREAM] == b[DEFAULT_STREAM]
    assert a["data-parallel-rng"] != b["data-parallel-rng"]
    assert a[EXPERT_PARALLEL_STREAM] != b[EXPERT_PARALLEL_STREAM]


def test_mesh_growth_never_changes_an_existing_streams_seed() -> None:
    small = StreamLayout(dims=("pp", "tp"), default=("pp",), streams={MODEL_PARALLEL_STREAM: ("pp", "tp")})
    grown = StreamLayout(
        dims=("pp", "dp", "tp", "ep"),
        default=("pp",),
        streams={MODEL_PARALLEL_STREAM: ("pp", "tp"), EXPERT_PARALLEL_STREAM: ("ep",)},
    )
    for pp, tp in itertools.product(range(2), range(4)):
        before = small.seeds(9, {"pp": pp, "tp": tp})
        after = grown.seeds(9, {"pp": pp, "dp": 13, "tp": tp, "ep": 40})
        assert after[MODEL_PARALLEL_STREAM] == before[MODEL_PARALLEL_STREAM]
        assert after[DEFAULT_STREAM] == before[DEFAULT_STREAM]


def test_the_order_a_stream_declares_its_dimensions_in_is_part_of_the_formula() -> None:
    ab = StreamLayout(dims=("a", "b"), default=(), streams={"s": ("a", "b")})
    ba = StreamLayout(dims=("a", "b"), default=(), streams={"s": ("b", "a")})
    assert ab.seed("s", 1, {"a": 1, "b": 2}) != ba.seed("s", 1, {"a": 1, "b": 2})


# -- collisions: Megatron's additive formulas against the layout ---------------------------------
def test_megatron_formulas_collide_at_tp_8_ep_18_where_the_layout_does_not() -> None:
    seed = 1234
    tp_stream_of_tp_rank_6 = megatron_seeds(seed, tp_rank=6).model_parallel
    expert_stream_of_ep_rank_17 = megatron_seeds(seed, ep_rank=17, etp_rank=0).expert_parallel
    assert tp_stream_of_tp_rank_6 == expert_stream_of_ep_rank_17 == seed + 2724

    layout = StreamLayout(
        dims=("tp", "ep", "etp"),
        default=(),
        streams={MODEL_PARALLEL_STREAM: ("tp",), EXPERT_PARALLEL_STREAM: ("ep", "etp")},
    )
    tp_rank_6 = layout.seed(MODEL_PARALLEL_STREAM, seed, {"tp": 6, "ep": 0, "etp": 0})
    ep_rank_17 = layout.seed(EXPERT_PARALLEL_STREAM, seed, {"tp": 0, "ep": 17, "etp": 0})
    assert tp_rank_6 != ep_rank_17
    assert layout.check_distinct(seed, {"tp": 8, "ep": 18, "etp": 1}) == 1 + 8 + 18


def test_a_4096_rank_mesh_gets_one_seed_per_stream_and_coordinates() -> None:
    sizes = {"pp": 4, "dp": 4, "cp": 2, "tp": 8, "ep": 16}
    layout = megatron_like_layout()
    every = {DEFAULT_STREAM: layout.default, **layout.streams}
    owner: dict[int, tuple[str, tuple[int, ...]]] = {}
    ranks = 0
    for point in itertools.product(*(range(sizes[d]) for d in DIMS)):
        coords = dict(zip(DIMS, point))
        ranks += 1
        for stream, seed in layout.seeds(2024, coords).items():
            key = (stream, tuple(coords[d] for d in every[stream]))
            # equal (stream, coordinates) -> equal seed; distinct -> distinct seed
            assert owner.setdefault(seed, key) == key
    assert ranks == 4096
    expected_pairs = sum(math.prod(sizes[d] for d in dims) for dims in every.values())
    assert len(owner) == expected_pairs
    assert layout.check_distinct(2024, sizes) == expected_pairs


def test_check_distinct_names_both_sides_of_a_collision(monkeypatch: pytest.MonkeyPatch) -> None:
    import hyperrng.seeding.layout as layout_module

    monkeypatch.setattr(layout_module, "combine64", lambda *values: 0)  # a mixer that collides on purpose
    with pytest.raises(InvalidArgumentError, match="share seed 0"):
        megatron_like_layout().check_distinct(1, {"pp": 1, "dp": 1, "cp": 1, "tp": 2, "ep": 1})


# -- applying a layout -----------------------------------------------------------------------------
def test_apply_layout_adds_every_stream_and_seeds_the_default_generator(platform: platforms.Platform) -> None:
    layout = megatron_like_layout()
    coords = {"pp": 1, "dp": 2, "cp": 0, "tp": 3, "ep": 4}
    seeds = apply_layout(layout, 99, coords)
    assert seeds == layout.seeds(99, coords)
    assert get_rng_tracker().seeds() == {k: v for k, v in seeds.items() if k != DEFAULT_STREAM}
    reference = platforms.current().get_rng_state()
    platform.manual_seed(seeds[DEFAULT_STREAM])
    assert torch.equal(reference, platform.get_rng_state())


@pytest.mark.needs_sim
def test_on_an_accelerator_apply_layout_also_seeds_the_cpu_with_the_default_stream() -> None:
    with platforms.use(platforms.SimulatedPlatform()):
        layout = megatron_like_layout()
        seeds = apply_layout(layout, 99, {"pp": 1, "dp": 2, "cp": 0, "tp": 3, "ep": 4})
        assert torch.default_generator.initial_seed() == seeds[DEFAULT_STREAM]


def test_apply_layout_accepts_a_device_mesh(platform: platforms.Platform) -> None:
    class Mesh:
        mesh_dim_names = DIMS

        def get_coordinate(self) -> list[int]:
            return [1, 2, 0, 3, 4]

    tracker = RNGStatesTracker()
    seeds = apply_layout(megatron_like_layout(), 99, Mesh(), tracker=tracker)
    assert seeds == megatron_like_layout().seeds(99, {"pp": 1, "dp": 2, "cp": 0, "tp": 3, "ep": 4})
    assert tracker.seeds()[MODEL_PARALLEL_STREAM] == seeds[MODEL_PARALLEL_STREAM]


def test_a_stream_of_the_layout_draws_what_its_seed_gives(platform: platforms.Platform) -> None:
    coords = {"pp": 0, "dp": 0, "cp": 0, "tp": 1, "ep": 0}
    seeds = apply_layout(megatron_like_layout(), 3, coords)
    with get_rng_tracker().fork(MODEL_PARALLEL_STREAM):
        inside = platform.get_rng_state()
    platform.manual_seed(seeds[MODEL_PARALLEL_STREAM])
    assert torch.equal(inside, platform.get_rng_state())


# -- serialisation ----------------------------------------------------------------------------------
def test_a_layout_round_trips_through_a_plain_json_dict() -> None:
    layout = megatron_like_layout()
    data = json.loads(json.dumps(layout.to_dict()))
    assert data["version"] == LAYOUT_FORMAT_VERSION
    again = StreamLayout.from_dict(data)
    assert again == layout and hash(again) == hash(layout)
    assert again.seeds(5, {"pp": 1, "dp": 1, "cp": 1, "tp": 1, "ep": 1}) == layout.seeds(
        5, {"pp": 1, "dp": 1, "cp": 1, "tp": 1, "ep": 1}
    )


@pytest.mark.parametrize(
    ("data", "error", "fragment"),
    [
        ([], ArgumentTypeError, "mapping"),
        ({"dims": ["pp"]}, InvalidArgumentError, "lacks"),
        ({**megatron_like_layout().to_dict(), "version": 99}, InvalidArgumentError, "version"),
        ({**megatron_like_layout().to_dict(), "domain": 1}, InvalidArgumentError, "domain"),
        ({**megatron_like_layout().to_dict(), "streams": {"s": ["zz"]}}, InvalidArgumentError, "not a mesh dimension"),
        ({**megatron_like_layout().to_dict(), "streams": {"s": [5]}}, ArgumentTypeError, "must be a string"),
    ],
)
def test_from_dict_refuses_what_to_dict_did_not_write(data: Any, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        StreamLayout.from_dict(data)


# -- bad input: typed error, clear message, nothing changed ----------------------------------------
@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (lambda: StreamLayout(dims=("pp", "tp"), default=(), streams={"s": ("xx",)}), "not a mesh dimension"),
        (lambda: StreamLayout(dims=("pp", "tp"), default=("zz",), streams={}), "not a mesh dimension"),
        (lambda: StreamLayout(dims=("pp", "tp"), default=(), streams={"s": ("tp", "tp")}), "more than once"),
        (lambda: StreamLayout(dims=("pp", "pp"), default=(), streams={}), "repeat a name"),
        (lambda: StreamLayout(dims=("pp",), default=(), streams={DEFAULT_STREAM: ("pp",)}), "reserved"),
        (lambda: StreamLayout(dims=("pp",), default=(), streams={"": ("pp",)}), "non-empty string"),
    ],
)
def test_an_inconsistent_layout_is_refused(build: Callable[[], object], fragment: str) -> None:
    with pytest.raises(InvalidArgumentError, match=fragment) as info:
        build()
    assert isinstance(info.value, HyperRNGError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (lambda: StreamLayout(dims=("pp", 3), default=(), streams={}), "must be a string"),  # type: ignore[list-item]
        (lambda: StreamLayout(dims="pp", default=(), streams={}), "sequence of names"),
        (lambda: StreamLayout(dims=5, default=(), streams={}), "sequence of names"),  # type: ignore[arg-type]
        (lambda: StreamLayout(dims=("pp",), default=(), streams=[("s", ("pp",))]), "map a stream name"),  # type: ignore[arg-type]
        (lambda: StreamLayout(dims=("pp",), default=(), streams={5: ("pp",)}), "must be a string"),  # type: ignore[dict-item]
    ],
)
def test_a_layout_of_wrong_types_is_a_type_error(build: Callable[[], object], fragment: str) -> None:
    with pytest.raises(ArgumentTypeError, match=fragment) as info:
        build()
    assert isinstance(info.value, HyperRNGError) and isinstance(info.value, TypeError)


GOOD = {"pp": 0, "dp": 0, "cp": 0, "tp": 0, "ep": 0}


@pytest.mark.parametrize(
    ("coords", "error", "fragment"),
    [
        ({k: v for k, v in GOOD.items() if k != "ep"}, InvalidArgumentError, "lack dimension"),
        ({**GOOD, "zz": 1}, InvalidArgumentError, "does not have"),
        ({**GOOD, "tp": -1}, InvalidArgumentError, r"must be in \[0, 2\*\*64 - 1\]"),
        ({**GOOD, "tp": 2**64}, InvalidArgumentError, r"must be in \[0, 2\*\*64 - 1\]"),
        ({**GOOD, "tp": True}, ArgumentTypeError, "bool"),
        ({**GOOD, "tp": 1.0}, ArgumentTypeError, "must be an int"),
        ({**GOOD, "tp": "1"}, ArgumentTypeError, "must be an int"),
        (object(), ArgumentTypeError, "DeviceMesh"),
    ],
)
def test_apply_layout_refuses_bad_coordinates_and_changes_nothing(
    platform: platforms.Platform, coords: object, error: type[Exception], fragment: str
) -> None:
    expect_refusal(platform, lambda: apply_layout(megatron_like_layout(), 1, coords), error, fragment)


@pytest.mark.parametrize(
    ("seed", "error"),
    [(-1, InvalidArgumentError), (2**64, InvalidArgumentError), (True, ArgumentTypeError), (2.0, ArgumentTypeError)],
)
def test_apply_layout_refuses_a_bad_base_seed_and_changes_nothing(
    platform: platforms.Platform, seed: object, error: type[Exception]
) -> None:
    expect_refusal(platform, lambda: apply_layout(megatron_like_layout(), seed, GOOD), error, "base_seed")  # type: ignore[arg-type]


def test_apply_layout_inside_a_fork_is_refused_and_changes_nothing(platform: platforms.Platform) -> None:
    tracker = get_rng_tracker()
    tracker.add("s", 1)
    with tracker.fork("s"):
        before = snapshot(platform)
        with pytest.raises(InvalidOperationError, match="inside a fork"):
            apply_layout(megatron_like_layout(), 1, GOOD)
        assert snapshot(platform) == before


@pytest.mark.parametrize("sizes", [{**GOOD}, {**GOOD, "pp": 1, "dp": 1, "cp": 1, "tp": 1, "ep": -2}])
def test_check_distinct_refuses_sizes_below_one(sizes: dict[str, int]) -> None:
    with pytest.raises(InvalidArgumentError, match=r"must be in \[1, 2\*\*64 - 1\]"):
        megatron_like_layout().check_distinct(1, sizes)


def test_seed_of_an_unknown_stream_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="no stream 'nope'"):
        megatron_like_layout().seed("nope", 1, GOOD)


def snapshot(platform: platforms.Platform) -> dict[str, Any]:
    return {
        "streams": {k: v.tolist() for k, v in get_rng_tracker().get_states(as_tensors=True).items()},
        "devices": [platform.get_rng_state(i).tolist() for i in range(platform.device_count())],
        "cpu": torch.get_rng_state().tolist(),
    }


def expect_refusal(
    platform: platforms.Platform, call: Callable[[], object], error: type[Exception], fragment: str
) -> None:
    get_rng_tracker().reseed({"existing": 77})
    before = snapshot(platform)
    with pytest.raises(error, match=fragment) as info:
        call()
    assert isinstance(info.value, HyperRNGError)
    assert snapshot(platform) == before, "a refused call changed state"


# -- the derivation is remembered beside the tracker ---------------------------------------------


def test_apply_layout_records_the_derivation_beside_the_tracker() -> None:
    tracker = RNGStatesTracker()
    assert recorded_derivation(tracker) is None
    apply_layout(megatron_like_layout(), 7, {**GOOD, "tp": 3}, tracker=tracker)
    assert recorded_derivation(tracker) == Derivation(megatron_like_layout(), 7, {**GOOD, "tp": 3})
    assert recorded_derivation() is None, "the process-wide tracker was not seeded"


def test_restoring_states_keeps_the_derivation_and_replacing_streams_drops_it() -> None:
    tracker = RNGStatesTracker()
    apply_layout(megatron_like_layout(), 7, GOOD, tracker=tracker)
    saved = tracker.get_states()
    with tracker.fork(MODEL_PARALLEL_STREAM):
        torch.rand(3)
    tracker.set_states(saved)  # the same streams, at another position
    assert recorded_derivation(tracker) is not None
    tracker.reseed({MODEL_PARALLEL_STREAM: 1})
    assert recorded_derivation(tracker) is None
    tracker.reseed(dict(zip(saved, range(100, 100 + len(saved)))))
    assert recorded_derivation(tracker) is None, "a dropped record does not come back"


def test_a_pickled_or_copied_tracker_keeps_its_derivation_until_its_streams_change() -> None:
    import copy
    import pickle

    tracker = RNGStatesTracker()
    apply_layout(megatron_like_layout(), 7, {**GOOD, "tp": 3}, tracker=tracker)
    for twin in (pickle.loads(pickle.dumps(tracker)), copy.deepcopy(tracker), copy.copy(tracker)):
        assert recorded_derivation(twin) == Derivation(megatron_like_layout(), 7, {**GOOD, "tp": 3})
        twin.reseed({MODEL_PARALLEL_STREAM: 1})
        assert recorded_derivation(twin) is None
    assert recorded_derivation(tracker) is not None, "a copy's reseed dropped the original's record"
    plain = RNGStatesTracker()
    plain.add("a", 1)
    assert recorded_derivation(pickle.loads(pickle.dumps(plain))) is None
    # A reset drops it, even where the streams came with no seeds (a checkpoint loaded): other streams may follow.
    from hyperrng.resume.state import load_rng_state_dict, rng_state_dict

    loaded = RNGStatesTracker()
    finish = load_rng_state_dict(rng_state_dict(tracker=tracker), tracker=loaded)
    if callable(finish):
        finish()
    assert recorded_derivation(loaded) is not None
    loaded.reset()
    loaded.set_states(plain.get_states())
    assert recorded_derivation(loaded) is None


def test_a_refused_apply_layout_records_nothing() -> None:
    tracker = RNGStatesTracker()
    with pytest.raises(InvalidArgumentError):
        apply_layout(megatron_like_layout(), 7, {"tp": 0}, tracker=tracker)
    assert recorded_derivation(tracker) is None


def test_the_record_does_not_keep_a_tracker_alive() -> None:
    import gc
    import weakref

    tracker = RNGStatesTracker()
    apply_layout(megatron_like_layout(), 7, GOOD, tracker=tracker)
    ref = weakref.ref(tracker)
    del tracker
    gc.collect()
    assert ref() is None
