"""A wrong type is an ArgumentTypeError (a TypeError) naming the argument, raised before anything changes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch
from torch.distributed.tensor import Shard

import hyperrng
from hyperrng import ArgumentTypeError, HyperRNGError, StreamLayout

LAYOUT = StreamLayout(dims=("dp",), default=(), streams={"s": ("dp",)})


# The modules, typed as Any: the calls below pass wrong types on purpose.
_H: Any = hyperrng
_P: Any = platforms


def _megatron(data_parallel_random_init: object) -> None:
    _H.megatron_set_random_seed(1, data_parallel_random_init=data_parallel_random_init)


def _region(mesh: object, placements: object) -> None:
    _H.ShardedRNGTracker().distribute_region(mesh, placements, (4,)).__enter__()


class _FractionalMesh:
    """A DeviceMesh look-alike whose shape is 2.7: once truncated to 2, and the generator moved."""

    shape = (2.7,)
    mesh_dim_names = ("dp",)

    def get_coordinate(self) -> list[int]:
        return [0]


CALLS: list[tuple[str, Callable[[], Any], str]] = [
    ("apply_layout(layout='x')", lambda: hyperrng.apply_layout("x", 1, {"dp": 0}), "layout"),  # type: ignore[arg-type]
    ("apply_layout(tracker='x')", lambda: hyperrng.apply_layout(LAYOUT, 1, {"dp": 0}, tracker="x"), "tracker"),  # type: ignore[arg-type]
    ("rng_state_dict(tracker='x')", lambda: hyperrng.rng_state_dict(tracker="x"), "tracker"),  # type: ignore[arg-type]
    ("rng_state_dict(layout='x')", lambda: hyperrng.rng_state_dict(layout="x"), "layout"),  # type: ignore[arg-type]
    ("rng_state_dict(base_seed='1')", lambda: hyperrng.rng_state_dict(base_seed="1"), "base_seed"),  # type: ignore[arg-type]
    ("verify_rng_sync('x', {})", lambda: hyperrng.verify_rng_sync("x", {}), "layout"),  # type: ignore[arg-type]
    ("ShardedRNGTracker(platform='cpu')", lambda: hyperrng.ShardedRNGTracker(platform="cpu"), "platform"),  # type: ignore[arg-type]
    ("checkpoint(5)", lambda: hyperrng.checkpoint(5), "function"),  # type: ignore[arg-type]
    ("checkpoint(fn, tracker='x')", lambda: hyperrng.checkpoint(torch.sin, torch.ones(1), tracker="x"), "tracker"),  # type: ignore[arg-type]
    ("fork_rng(enabled='yes')", lambda: hyperrng.fork_rng(enabled="yes"), "enabled"),  # type: ignore[arg-type]
    ("set_random_seed('7')", lambda: hyperrng.set_random_seed("7"), "seed"),  # type: ignore[arg-type]
    ("set_random_seed(7.0)", lambda: hyperrng.set_random_seed(7.0), "seed"),  # type: ignore[arg-type]
    ("set_random_seed(None)", lambda: hyperrng.set_random_seed(None), "seed"),  # type: ignore[arg-type]
    ("set_random_seed(1, tp_rank='1')", lambda: hyperrng.set_random_seed(1, tp_rank="1"), "tp_rank"),  # type: ignore[arg-type]
    ("set_rng_tracker(None)", lambda: hyperrng.set_rng_tracker(None), "RNGStatesTracker"),  # type: ignore[arg-type]
    ("RNGStatesTracker().add(3, 1)", lambda: hyperrng.RNGStatesTracker().add(3, 1), "stream name"),  # type: ignore[arg-type]
    ("platform.manual_seed('3')", lambda: platforms.current().manual_seed("3"), "seed"),  # type: ignore[arg-type]
    ("platform.get_rng_state(index='0')", lambda: platforms.current().get_rng_state("0"), "device index"),  # type: ignore[arg-type]
    # Each of these raised a ValueError, a RuntimeError, an IndexError or nothing at all before.
    ("set_random_seed(always_enable_tp_seed=tensor)", lambda: _H.set_random_seed(1, 0, 0, 0, torch.ones(2)), "always"),
    (
        "model_parallel_manual_seed(always_enable_tp_seed='yes')",
        lambda: _H.model_parallel_manual_seed(1, 0, "y"),
        "always",
    ),
    ("megatron_set_random_seed(data_parallel_random_init=t)", lambda: _megatron(torch.ones(2)), "data_parallel"),
    ("set_seeds(distinct_dim=['pp'])", lambda: _H.set_seeds(1, {"pp": 0}, ["pp"]), "distinct_dim"),
    ("rng_offsets(coordinate=None)", lambda: _H.rng_offsets((2,), None, [Shard(0)], (4,)), "coordinate"),
    ("ShardedRNGTracker().manual_seed(mesh='x')", lambda: _H.ShardedRNGTracker().manual_seed(1, "x"), "DeviceMesh"),
    ("distribute_region(mesh=[shape, coordinate])", lambda: _region([(2,), (0,)], [Shard(0)]), "DeviceMesh"),
    (
        "distribute_region(a mesh of shape 2.7)",
        lambda: _region(_FractionalMesh(), [Shard(0)]),
        "mesh shape must be an int",
    ),
    ("distribute_region(placements=5)", lambda: _region(((2,), (0,)), 5), "placements"),
    ("fork_rng(device_type=3)", lambda: _H.fork_rng(device_type=3), "device_type"),
    ("verify_rng_sync(coords='dp=0')", lambda: _H.verify_rng_sync(LAYOUT, "dp=0"), "mapping"),
    ("platforms.use(3)", lambda: _P.use(3).__enter__(), "platform name"),
    ("platforms.set_current(None)", lambda: _P.set_current(None), "platform name"),
    ("platforms.load(None)", lambda: _P.load(None), "platform spec"),
    ("platforms.register(7, CPUPlatform)", lambda: _P.register(7, platforms.CPUPlatform), "name must be a string"),
    ("platforms.register('x', 42)", lambda: _P.register("x", 42), "must be callable"),
    ("platforms.seed_generator('g', 1)", lambda: _P.seed_generator("g", 1), "gen"),
    (
        "load_rng_state_dict(coords='dp=0')",
        lambda: _H.load_rng_state_dict(_H.rng_state_dict(), coords="dp=0"),
        "mapping",
    ),
]


@pytest.mark.parametrize(("label", "call", "fragment"), CALLS, ids=[c[0] for c in CALLS])
def test_a_wrong_type_is_a_typed_type_error_and_changes_nothing(
    label: str, call: Callable[[], Any], fragment: str
) -> None:
    platform = platforms.current()
    before = platform.get_rng_state(), torch.get_rng_state()
    with pytest.raises(ArgumentTypeError, match=fragment) as info:
        call()
    assert isinstance(info.value, TypeError) and isinstance(info.value, HyperRNGError)
    assert torch.equal(platform.get_rng_state(), before[0]) and torch.equal(torch.get_rng_state(), before[1])


def test_numpy_integers_are_accepted_wherever_python_ints_are() -> None:
    import numpy as np

    hyperrng.set_random_seed(np.int64(7), tp_rank=np.int64(1), pp_rank=np.uint8(0))
    state = hyperrng.rng_state_dict(base_seed=np.int64(1234))
    assert type(state["base_seed"]) is int  # stored as a plain int: loadable with weights_only
    hyperrng.get_rng_tracker().reset()


# -- a sweep: every wrong type of a seed, a rank, a flag or a name is refused as a TypeError ------------

_NOT_INTS = {
    "str": "7",
    "float": 7.5,
    "none": None,
    "bool": True,
    "list": [7],
    "tensor": torch.ones(2),
    "object": object(),
}
_NOT_OPTIONAL_INTS = {kind: value for kind, value in _NOT_INTS.items() if value is not None}
_NOT_BOOLS = {"str": "yes", "int": 1, "none": None, "list": [True], "tensor": torch.ones(2)}
_NOT_STRS = {"int": 7, "float": 7.5, "none": None, "list": ["a"], "bytes": b"a", "object": object()}

_SWEEP: list[tuple[str, Callable[..., Any], dict[str, Any], dict[str, dict[str, Any]]]] = [
    ("seed_host", hyperrng.seed_host, {"seed": 1}, {"seed": _NOT_INTS}),
    (
        "set_random_seed",
        hyperrng.set_random_seed,
        {"seed": 1, "dp_rank": 0, "pp_rank": 0, "tp_rank": 0, "always_enable_tp_seed": False},
        {"seed": _NOT_INTS, "dp_rank": _NOT_OPTIONAL_INTS, "always_enable_tp_seed": _NOT_BOOLS},
    ),
    (
        "megatron_set_random_seed",
        hyperrng.megatron_set_random_seed,
        {"seed": 1, "tp_rank": 0, "data_parallel_random_init": False},
        {"seed": _NOT_INTS, "tp_rank": _NOT_INTS, "data_parallel_random_init": _NOT_BOOLS},
    ),
    (
        "set_seeds",
        hyperrng.set_seeds,
        {"seed": 1, "mesh": {"pp": 0}, "distinct_dim": "pp"},
        {"distinct_dim": _NOT_STRS},
    ),
    (
        "apply_layout",
        hyperrng.apply_layout,
        {"layout": LAYOUT, "base_seed": 1, "coords": {"dp": 0}},
        {"base_seed": _NOT_INTS, "layout": _NOT_STRS},
    ),
    (
        "tracker.add",
        lambda **k: hyperrng.RNGStatesTracker().add(**k),
        {"name": "a", "seed": 1},
        {"name": _NOT_STRS, "seed": _NOT_INTS},
    ),
    ("platform.manual_seed", lambda **k: platforms.current().manual_seed(**k), {"seed": 1}, {"seed": _NOT_INTS}),
    ("platforms.use", lambda **k: platforms.use(**k).__enter__(), {"platform": "cpu"}, {"platform": _NOT_STRS}),
    (
        "platforms.register",
        lambda **k: platforms.register(**k, replace=True),
        {"name": "sweep", "factory": platforms.CPUPlatform},
        {"name": _NOT_STRS},
    ),
]


@pytest.mark.parametrize(
    ("label", "call", "valid", "arg", "value"),
    [
        (label, call, valid, arg, value)
        for label, call, valid, wrong in _SWEEP
        for arg, values in wrong.items()
        for value in values.values()
    ],
    ids=[f"{label}-{arg}-{kind}" for label, _, _, wrong in _SWEEP for arg, values in wrong.items() for kind in values],
)
def test_every_wrong_type_in_the_sweep_is_a_typed_type_error_and_changes_nothing(
    label: str,
    call: Callable[..., Any],
    valid: dict[str, Any],
    arg: str,
    value: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(platforms.registry, "_FACTORIES", dict(platforms.registry._FACTORIES))
    platform = platforms.current()
    before = platform.get_rng_state(), torch.get_rng_state()
    with pytest.raises(ArgumentTypeError, match=arg.split("_")[0]) as info:
        call(**{**valid, arg: value})
    assert isinstance(info.value, TypeError)
    assert torch.equal(platform.get_rng_state(), before[0]) and torch.equal(torch.get_rng_state(), before[1])
    assert "sweep" not in platforms.registered()
