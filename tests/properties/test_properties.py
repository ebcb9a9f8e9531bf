"""Property-based: generated bad inputs over the public API raise a typed error of the fitting
builtin, and leave Python's ``random``, NumPy, torch's CPU generator, every device and the
tracker exactly as they were."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator
from typing import Any

import hyperrng.platforms as platforms
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import hyperrng
from hyperrng import (
    ArgumentTypeError,
    HyperRNGError,
    InvalidArgumentError,
    StreamLayout,
    get_rng_tracker,
)
from tests._platforms import PLATFORMS

# Derandomized and without an example database: every run draws the same examples, so a
# failure reproduces and CI never fails on a draw it has not seen before.
SETTINGS = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

LAYOUT = StreamLayout(dims=("dp", "tp"), default=("dp",), streams={"model-parallel-rng": ("tp",)})

# Values that are not integers of any kind: never truncated, always a TypeError.
not_ints = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.none(),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
    st.complex_numbers(),
    st.builds(np.float64, st.floats(allow_nan=False)),
)
# Integers outside the unsigned 64-bit range of seeds: always a ValueError.
out_of_range = st.one_of(st.integers(max_value=-1), st.integers(min_value=2**64))


@pytest.fixture(params=["cpu", "sim"])
def platform(request: pytest.FixtureRequest) -> Iterator[platforms.Platform]:
    get_rng_tracker().reset()
    with platforms.use(PLATFORMS[request.param]()) as chosen:
        get_rng_tracker().reseed({"model-parallel-rng": 11, "data-parallel-rng": 12})
        yield chosen
    get_rng_tracker().reset()


def everything(platform: platforms.Platform) -> Any:
    """All the state a refused call must leave alone, as comparable values."""
    tracker = get_rng_tracker()
    return (
        random.getstate(),
        repr(np.random.get_state()),
        torch.get_rng_state().tolist(),
        [platform.get_rng_state(i).tolist() for i in range(platform.device_count())],
        {k: v.tolist() for k, v in tracker.get_states().items()},
        tracker.active_stream,
    )


def refused(platform: platforms.Platform, call: Callable[[], object], builtin: type[Exception]) -> None:
    before = everything(platform)
    with pytest.raises(HyperRNGError) as info:
        call()
    assert isinstance(info.value, builtin), f"{type(info.value).__name__} is not a {builtin.__name__}"
    assert str(info.value), "an error must say what was wrong"
    assert everything(platform) == before, "a refused call changed RNG state"


SEEDED_CALLS: dict[str, Callable[[Any], object]] = {
    "platform.manual_seed": lambda s: platforms.current().manual_seed(s),
    "platform.set_seed_offset(seed)": lambda s: platforms.current().set_seed_offset(s, 0),
    "set_random_seed": lambda s: hyperrng.set_random_seed(s),
    "set_random_seed(tp_rank)": lambda s: hyperrng.set_random_seed(s, tp_rank=1),
    "model_parallel_manual_seed": lambda s: hyperrng.model_parallel_manual_seed(s, 0),
    "megatron_model_parallel_manual_seed": lambda s: hyperrng.megatron_model_parallel_manual_seed(s),
    "model_parallel_cuda_manual_seed": lambda s: hyperrng.model_parallel_cuda_manual_seed(s, tp_rank=1),
    "set_seeds": lambda s: hyperrng.set_seeds(s),
    "apply_layout": lambda s: hyperrng.apply_layout(LAYOUT, s, {"dp": 0, "tp": 1}),
    "seed_host": lambda s: hyperrng.seed_host(s),
    "ShardedRNGTracker.manual_seed": lambda s: hyperrng.ShardedRNGTracker().manual_seed(s),
    "tracker.reseed": lambda s: get_rng_tracker().reseed({"model-parallel-rng": s}),
    "rng_state_dict(base_seed)": lambda s: hyperrng.rng_state_dict(base_seed=s),
}


@pytest.mark.parametrize("name", list(SEEDED_CALLS))
@SETTINGS
@given(seed=not_ints)
def test_a_seed_of_the_wrong_type_is_a_type_error(platform: platforms.Platform, name: str, seed: Any) -> None:
    assume(not (seed is None and name == "rng_state_dict(base_seed)"))  # None: no base seed recorded
    refused(platform, lambda: SEEDED_CALLS[name](seed), TypeError)


@pytest.mark.parametrize("name", list(SEEDED_CALLS))
@SETTINGS
@given(seed=out_of_range)
def test_a_seed_out_of_range_is_a_value_error(platform: platforms.Platform, name: str, seed: int) -> None:
    refused(platform, lambda: SEEDED_CALLS[name](seed), ValueError)


@SETTINGS
@given(
    offset=st.one_of(
        not_ints, st.integers(max_value=-1), st.integers(min_value=2**63), st.integers().filter(lambda o: o % 4)
    )
)
def test_a_bad_offset_is_refused_by_type_or_value(platform: platforms.Platform, offset: Any) -> None:
    builtin = TypeError if not isinstance(offset, int) or isinstance(offset, bool) else ValueError
    refused(platform, lambda: platform.set_seed_offset(7, offset), builtin)


@SETTINGS
@given(
    index=st.one_of(
        not_ints.filter(lambda v: v is not None), st.integers(max_value=-1), st.integers(min_value=2, max_value=2**70)
    )
)
def test_a_bad_device_index_is_refused_by_type_or_value(platform: platforms.Platform, index: Any) -> None:
    builtin = TypeError if not isinstance(index, int) or isinstance(index, bool) else ValueError
    refused(platform, lambda: platform.get_rng_state(index), builtin)
    refused(platform, lambda: platform.manual_seed(1, index), builtin)
    refused(platform, lambda: hyperrng.fork_rng(devices=[index]), builtin)


@SETTINGS
@given(rank=st.one_of(not_ints.filter(lambda v: v is not None), st.integers(max_value=-1)))
def test_a_bad_rank_is_refused_by_type_or_value(platform: platforms.Platform, rank: Any) -> None:
    builtin = TypeError if not isinstance(rank, int) or isinstance(rank, bool) else ValueError
    for keyword in ("dp_rank", "pp_rank", "tp_rank"):
        refused(platform, lambda: hyperrng.set_random_seed(1, **{keyword: rank}), builtin)  # noqa: B023
    refused(platform, lambda: hyperrng.megatron_model_parallel_manual_seed(1, ep_rank=rank), builtin)
    refused(platform, lambda: hyperrng.apply_layout(LAYOUT, 1, {"dp": rank, "tp": 0}), builtin)


@SETTINGS
@given(name=st.one_of(st.integers(), st.none(), st.binary(max_size=3), st.just("")))
def test_a_bad_stream_name_is_refused_by_type_or_value(platform: platforms.Platform, name: Any) -> None:
    builtin = ValueError if isinstance(name, str) else TypeError
    refused(platform, lambda: get_rng_tracker().add(name, 99), builtin)


@SETTINGS
@given(state=st.one_of(not_ints, st.binary(max_size=32), st.integers(min_value=1, max_value=64)))
def test_a_bad_rng_state_is_refused_by_type_or_value(platform: platforms.Platform, state: Any) -> None:
    if isinstance(state, int) and not isinstance(state, bool):  # a tensor of the wrong length
        assume(state != platform._state_nbytes)
        refused(platform, lambda: platform.set_rng_state(torch.zeros(state, dtype=torch.uint8)), ValueError)
    else:
        refused(platform, lambda: platform.set_rng_state(state), TypeError)


# -- checkpoints: every field typed and bounded before anything applies ---------------------------
_FIELDS = [
    "numpy.pos",
    "numpy.has_gauss",
    "numpy.gauss",
    "numpy.kind",
    "python.version",
    "python.gauss",
    "rank",
    "world_size",
    "base_seed",
    "platform",
    "devices",
    "streams",
    "torch_cpu",
]


@SETTINGS
@given(field=st.sampled_from(_FIELDS), value=st.one_of(not_ints, st.integers(min_value=-(2**70), max_value=2**70)))
@example(field="torch_cpu", value=None)  # unchanged where the device is the host: must not count as tampering
@example(field="base_seed", value=None)
def test_a_tampered_checkpoint_is_refused_as_malformed_and_changes_nothing(
    platform: platforms.Platform, field: str, value: Any
) -> None:
    from hyperrng.resume._format import digest as _digest

    saved = hyperrng.rng_state_dict()
    state = copy.deepcopy(saved)
    *parents, last = field.split(".")
    node = state
    for key in parents:
        node = node[key]
    assume(not _same(node[last], value))  # writing back the value already there is no tampering
    node[last] = value
    try:
        state["digest"] = _digest(state)  # a forgery, not damage: the digest is recomputed
    except InvalidArgumentError:  # a value the digest itself refuses (beyond what a state holds): so will the load
        pass
    before = everything(platform)
    try:
        hyperrng.load_rng_state_dict(state)
    except InvalidArgumentError as exc:
        assert isinstance(exc, ValueError) and str(exc)
        assert everything(platform) == before
    else:  # only a value the state could legitimately hold may be accepted
        assert field in ("numpy.pos", "numpy.has_gauss", "python.gauss", "base_seed", "numpy.gauss"), field
        assert (isinstance(value, int) and not isinstance(value, bool)) or isinstance(value, float) or value is None


def _same(original: object, value: object) -> bool:
    """Whether ``value`` is exactly the field's saved value: same type and equal, ``None`` included."""
    if type(original) is not type(value) or isinstance(original, torch.Tensor):
        return False
    if isinstance(original, list) and any(isinstance(item, torch.Tensor) for item in original):
        return False  # saved states are never a drawn list of ints, and comparing them elementwise is ambiguous
    return bool(original == value)


def test_writing_back_an_unchanged_field_is_not_counted_as_tampering() -> None:
    assert _same(None, None) and _same(0, 0) and _same("cpu", "cpu")
    assert not _same(0, False) and not _same(0, 0.0) and not _same(None, 0)
    assert not _same([torch.zeros(2, dtype=torch.uint8)], [0])


def test_the_property_suite_refuses_with_the_documented_classes() -> None:
    assert issubclass(ArgumentTypeError, TypeError) and issubclass(InvalidArgumentError, ValueError)


# -- portable draws, sharded offsets, layouts: the remaining public entry points ------------------
def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@SETTINGS
@given(numel=st.one_of(not_ints, st.integers(max_value=-1)))
def test_a_bad_reservation_size_is_refused_by_type_or_value(platform: platforms.Platform, numel: Any) -> None:
    from hyperrng.portable import position as portable

    refused(platform, lambda: portable.reserve(numel), ValueError if _is_int(numel) else TypeError)


@SETTINGS
@given(
    dim=st.one_of(
        not_ints.filter(lambda v: not isinstance(v, list)),  # a list of ints would be a valid shape
        st.integers(max_value=-1),
        st.integers(min_value=2**40, max_value=2**61),
    )
)
def test_a_bad_shape_for_a_portable_draw_is_refused_by_type_or_value(platform: platforms.Platform, dim: Any) -> None:
    from hyperrng.portable import position as portable

    builtin = ValueError if _is_int(dim) else TypeError
    for draw in (portable.uniform, portable.normal):
        refused(platform, lambda: draw((2, dim)), builtin)  # noqa: B023
    refused(platform, lambda: portable.bernoulli((dim,), 0.5), builtin)


@SETTINGS
@given(p=st.one_of(st.text(max_size=3), st.none(), st.booleans(), st.floats().filter(lambda f: not 0 <= f <= 1)))
def test_a_bad_probability_is_refused_by_type_or_value(platform: platforms.Platform, p: Any) -> None:
    from hyperrng.portable import position as portable

    builtin = ValueError if isinstance(p, float) else TypeError
    refused(platform, lambda: portable.bernoulli((4,), p), builtin)
    refused(platform, lambda: portable.dropout(torch.ones(4), p), builtin)


mesh_sizes = st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=3)


@SETTINGS
@given(
    sizes=mesh_sizes,
    bad=st.one_of(not_ints.filter(lambda v: not isinstance(v, list)), st.integers(max_value=-1)),
    where=st.sampled_from(["mesh", "coordinate", "shape"]),
)
def test_a_bad_mesh_coordinate_or_shape_is_refused_by_type_or_value(
    platform: platforms.Platform, sizes: list[int], bad: Any, where: str
) -> None:
    from torch.distributed.tensor import Shard

    from hyperrng.sharding.tracker import MeshInfo

    mesh, coordinate, shape = list(sizes), [0] * len(sizes), [8, 8]
    {"mesh": mesh, "coordinate": coordinate, "shape": shape}[where][0] = bad
    placements = [Shard(0)] * len(sizes)
    builtin = ValueError if _is_int(bad) else TypeError
    refused(platform, lambda: hyperrng.rng_offsets(tuple(mesh), tuple(coordinate), placements, tuple(shape)), builtin)

    def region() -> None:
        with hyperrng.ShardedRNGTracker().distribute_region(
            MeshInfo(tuple(mesh), tuple(coordinate)), placements, shape
        ):
            pytest.fail("a bad region must not be entered")

    refused(platform, region, builtin)


@SETTINGS
@given(
    sizes=mesh_sizes,
    coordinate=st.lists(st.integers(min_value=0, max_value=8), min_size=1, max_size=3),
)
def test_a_coordinate_outside_the_mesh_is_a_value_error(
    platform: platforms.Platform, sizes: list[int], coordinate: list[int]
) -> None:
    from torch.distributed.tensor import Shard

    assume(len(coordinate) != len(sizes) or any(c >= s for c, s in zip(coordinate, sizes)))
    placements = [Shard(0)] * len(sizes)
    refused(platform, lambda: hyperrng.rng_offsets(tuple(sizes), tuple(coordinate), placements, (8, 8)), ValueError)


@SETTINGS
@given(
    dims=st.one_of(
        st.lists(st.one_of(st.integers(), st.none(), st.binary(max_size=2)), min_size=1, max_size=3),
        st.integers(),
        st.none(),
    )
)
def test_a_layout_of_wrong_types_is_a_type_error(platform: platforms.Platform, dims: Any) -> None:
    refused(platform, lambda: StreamLayout(dims=dims, default=(), streams={}), TypeError)
    refused(platform, lambda: StreamLayout(dims=("dp",), default=dims, streams={}), TypeError)


@SETTINGS
@given(seed=st.one_of(not_ints.filter(lambda v: v is not None), out_of_range))
def test_a_bad_portable_mode_seed_is_refused_by_type_or_value(platform: platforms.Platform, seed: Any) -> None:
    def enter() -> None:
        with hyperrng.portable_random(seed):
            pytest.fail("a bad seed must not enter portable mode")

    refused(platform, enter, ValueError if _is_int(seed) else TypeError)
    assert not hyperrng.is_portable_random_enabled()
