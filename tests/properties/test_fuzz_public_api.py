"""A fuzz of the public API: any exception a public call raises is a typed hyperrng error.

Every public function and constructor of ``hyperrng``, ``hyperrng.philox`` and
``hyperrng.platforms`` (and the methods of the objects they build: trackers, layouts,
platforms, simulated devices and generators) is called with arguments drawn by hypothesis: a
valid call with up to two arguments replaced by values of any type (``None``, bools, ints huge
and negative, NaN and infinite floats, odd unicode, bytes, nested lists, tuples and dicts,
tensors of every dtype, 0-d to 65-d, ``torch.device`` objects, arbitrary objects). A call may
succeed or raise; what it raises must be a :class:`~hyperrng.HyperRNGError`, never a bare
``TypeError``, ``ValueError``, ``AttributeError``, ``OverflowError`` or torch's
``RuntimeError``, and a refused call must leave the process's random state as it found it.
Context managers are entered and left, so checks made on entry are fuzzed too.

The suite runs a bounded, derandomized sample (the same examples on every run). To fuzz
broadly, raise the number of examples and draw at random::

    HYPERRNG_FUZZ_EXAMPLES=300 HYPERRNG_FUZZ_RANDOM=1 python -m pytest -q tests/properties/test_fuzz_public_api.py

``HYPERRNG_FUZZ_RECORD=<file>`` records each untyped error as a line of JSON instead of
failing, so that one run counts all of them (and the calls made, in ``<file>.calls``).
"""

from __future__ import annotations

import decimal
import fractions
import inspect
import json
import math
import os
import random
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import hyperrng.platforms as platforms
import hyperrng.platforms.registry as registry
import numpy as np
import pytest
import torch
from hyperrng.platforms import _features
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

import hyperrng
import hyperrng.philox as philox
from hyperrng import HyperRNGError, RNGStatesTracker, StreamLayout

_EXAMPLES = int(os.environ.get("HYPERRNG_FUZZ_EXAMPLES", "6"))
_RECORD = os.environ.get("HYPERRNG_FUZZ_RECORD")
SETTINGS = settings(
    max_examples=_EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("HYPERRNG_FUZZ_RANDOM"),
    database=None,
    suppress_health_check=list(HealthCheck),
)

HAS_SIM = _features.feature("sim").available
LAYOUT = StreamLayout(dims=("dp", "tp"), default=("dp",), streams={"model-parallel-rng": ("tp",)})
COORDS = {"dp": 0, "tp": 0}
SMALL_NUMEL = 1 << 16
"""The largest draw a fuzzed call may ask for: a valid call of a billion elements is no error, only slow."""


# -- values of every type ------------------------------------------------------------------------
class Opaque:
    """An object of a type no hyperrng call takes."""

    def __repr__(self) -> str:
        return "Opaque()"


class IndexLike:
    """An integer-like object (``__index__``), as NumPy integers are."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"IndexLike({self.value})"


_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
]
_HUGE_INTS = [2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, 2**1000]
_ODD_TEXT = ["", " ", "\x00", "a\x00b", "\ud800", "é", "🎲", "ﬁ", "\u202e", "sim", "cpu", "cuda", "meta", "x" * 5000]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], device: str, fill: int) -> torch.Tensor:
    return torch.full(shape, fill, device=device).to(dtype)


_SHAPES = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple),
    st.sampled_from([(1,) * 65, (1,) * 64, (0,) * 65, (2,) * 3 + (1,) * 62]),
)
tensors = st.builds(
    _tensor, st.sampled_from(_DTYPES), _SHAPES, st.sampled_from(["cpu", "cpu", "meta"]), st.integers(-3, 9)
)
shape_like = st.one_of(
    st.sampled_from([(1,) * 65, (1,) * 64, (0,) * 65, (2**40, 2**40), (2**62,), (-1, 4), b"\x02\x03", b"", "23"]),
    st.lists(st.integers(-1, 3), min_size=60, max_size=70).map(tuple),
)
"""Values that are almost a shape: too many dimensions, too many elements, negative sizes, bytes, a string."""
_DEVICE_NAMES = ["cpu", "cuda", "cuda:3", "meta"] + (["sim", "sim:0", "sim:1", "sim:7"] if HAS_SIM else [])
devices = st.sampled_from(_DEVICE_NAMES).map(torch.device)
objects = st.sampled_from(
    [
        object(),
        Opaque(),
        Ellipsis,
        NotImplemented,
        slice(1, 2),
        range(3),
        frozenset({1}),
        bytearray(b"\x01\x02"),
        fractions.Fraction(1, 3),
        decimal.Decimal("nan"),
        decimal.Decimal("1"),
        np.int64(3),
        np.uint64(2**64 - 1),
        np.float32("nan"),
        np.bool_(True),
        np.array([1, 2]),
        np.array(3),
        IndexLike(2),
        IndexLike(-1),
        IndexLike(2**70),
        torch.Size([2, 3]),
        torch.float32,
        torch.int64,
        torch.Generator(),
        len,
        lambda: None,
        Replicate(),
        Shard(0),
        LAYOUT,
        type,
        Exception("x"),
    ]
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(_HUGE_INTS).flatmap(lambda n: st.sampled_from([n, -n])),
    st.floats(allow_nan=True, allow_infinity=True),
    st.complex_numbers(),
    st.text(max_size=8),
    st.sampled_from(_ODD_TEXT),
    st.binary(max_size=8),
)
leaves = st.one_of(scalars, tensors, devices, objects, shape_like)
junk = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-2, 2), st.none()), inner, max_size=3),
    ),
    max_leaves=6,
)
wrong = st.one_of(junk, shape_like, tensors)
"""A value of any type: what the fuzz puts in place of a valid argument (near-shapes and tensors weighed up)."""


# -- the targets ---------------------------------------------------------------------------------
def seeded_tracker() -> RNGStatesTracker:
    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 11)
    tracker.add("data-parallel-rng", 12)
    return tracker


def _state_dict() -> dict[str, Any]:
    return hyperrng.rng_state_dict(tracker=seeded_tracker(), layout=LAYOUT, coords=COORDS, base_seed=7)


def _sim_module() -> platforms.SimulatedDeviceModule:
    return platforms.simulated_backend()


def _sim_platform() -> platforms.Platform:
    return platforms.SimulatedPlatform(_sim_module())


def _counter_state() -> torch.Tensor:
    return platforms.pack_counter_state(5, 8)


seeds = st.sampled_from([0, 1, 1234, 2**64 - 1])
ranks = st.sampled_from([0, 1])
flags = st.booleans()
trackers = st.builds(seeded_tracker)
small_shapes = st.one_of(st.integers(0, 6), st.lists(st.integers(0, 4), max_size=3).map(tuple))


@dataclass
class Target:
    """A public callable, the valid arguments it is fuzzed around and how its result is exercised.

    ``valid`` maps a parameter to a strategy of valid values: required parameters must be in it,
    others may be (or are left out, or get junk). ``use`` is applied to the result (entering a
    context manager); ``keep`` filters out drawn calls that are valid but too costly to run.
    """

    label: str
    make: Callable[[], Callable[..., Any]]
    valid: Mapping[str, st.SearchStrategy[Any]] = field(default_factory=dict)
    use: Callable[[Any], object] | None = None
    keep: Callable[[dict[str, Any]], bool] | None = None
    needs_sim: bool = False


def _enter(result: Any) -> None:
    with result:
        pass


def _enter_pair(result: Any) -> None:
    forward, recompute = result
    with forward:
        pass
    with recompute:
        pass


def _small(*names: str) -> Callable[[dict[str, Any]], bool]:
    """Keep a call whose shape-like arguments (where they are sequences of plain ints) ask for few elements."""

    def keep(kwargs: dict[str, Any]) -> bool:
        for name in names:
            value = kwargs.get(name)
            dims = (value,) if isinstance(value, int) else value
            if isinstance(dims, (tuple, list, torch.Size)) and all(type(d) is int for d in dims):
                if all(d >= 0 for d in dims) and math.prod(dims) > SMALL_NUMEL:
                    return False
        return True

    return keep


def _takes_anything(*args: Any) -> torch.Tensor:
    """What ``checkpoint`` runs: any arguments are fine (an error of the function itself is not hyperrng's)."""
    return torch.ones(1)


def _const(value: Any) -> Callable[[], Any]:
    return lambda: value


def _method(factory: Callable[[], Any], name: str) -> Callable[[], Callable[..., Any]]:
    return lambda: getattr(factory(), name)


_PHILOX_COMMON = {"key": seeds, "offset": st.sampled_from([0, 4, 1000])}
_PHILOX_KEEP = _small("shape", "global_shape")
_DROPOUT_X = st.builds(lambda n: torch.ones(n), st.integers(0, 8))

TARGETS: list[Target] = [
    # hyperrng. Left out: Platform (abstract: built through its subclasses, fuzzed below) and
    # RNGTrackerProtocol (a typing.Protocol, not instantiable); calls that need a process group
    # get group=None and junk that is not one (ShardedRNGTracker.sync_from_rank0 needs one and is
    # left out); nothing here starts processes.
    Target("current_platform", _const(hyperrng.current_platform)),
    Target("RNGStatesTracker", _const(hyperrng.RNGStatesTracker)),
    Target("CudaRNGStatesTracker", _const(hyperrng.CudaRNGStatesTracker)),
    Target("get_rng_tracker", _const(hyperrng.get_rng_tracker)),
    Target("get_cuda_rng_tracker", _const(hyperrng.get_cuda_rng_tracker)),
    Target("set_rng_tracker", _const(hyperrng.set_rng_tracker), {"tracker": trackers}),
    Target(
        "fork_rng",
        _const(hyperrng.fork_rng),
        {"devices": st.sampled_from([None, [], [0]]), "enabled": flags, "device_type": st.sampled_from([None, "cpu"])},
        use=_enter,
    ),
    Target(
        "StreamLayout",
        _const(StreamLayout),
        {
            "dims": st.just(("dp", "tp")),
            "default": st.just(("dp",)),
            "streams": st.just({"model-parallel-rng": ("tp",)}),
        },
    ),
    Target(
        "apply_layout",
        _const(hyperrng.apply_layout),
        {"layout": st.just(LAYOUT), "base_seed": seeds, "coords": st.just(COORDS), "tracker": trackers},
    ),
    Target("mesh_coordinates", _const(hyperrng.mesh_coordinates), {"mesh": st.just(COORDS)}),
    Target("seed_host", _const(hyperrng.seed_host), {"seed": seeds}),
    Target(
        "set_random_seed",
        _const(hyperrng.set_random_seed),
        {"seed": seeds, "dp_rank": ranks, "pp_rank": ranks, "tp_rank": ranks, "tracker": trackers},
    ),
    Target(
        "model_parallel_manual_seed",
        _const(hyperrng.model_parallel_manual_seed),
        {"seed": seeds, "tp_rank": ranks, "tracker": trackers},
    ),
    Target(
        "model_parallel_cuda_manual_seed",
        _const(hyperrng.model_parallel_cuda_manual_seed),
        {"seed": seeds, "tp_rank": ranks, "ep_rank": ranks, "etp_rank": ranks, "tracker": trackers},
    ),
    Target("is_random_seed_set", _const(hyperrng.is_random_seed_set), {"tracker": trackers}),
    Target(
        "MegatronSeeds",
        _const(hyperrng.MegatronSeeds),
        {"data_parallel": seeds, "model_parallel": seeds, "expert_parallel": seeds},
    ),
    Target("megatron_seeds", _const(hyperrng.megatron_seeds), {"seed": seeds, "tp_rank": ranks}),
    Target(
        "megatron_model_parallel_manual_seed",
        _const(hyperrng.megatron_model_parallel_manual_seed),
        {"seed": seeds, "tp_rank": ranks, "tracker": trackers},
    ),
    Target(
        "megatron_set_random_seed",
        _const(hyperrng.megatron_set_random_seed),
        {"seed": seeds, "dp_rank": ranks, "tracker": trackers},
    ),
    Target(
        "set_seeds",
        _const(hyperrng.set_seeds),
        {"seed": seeds, "mesh": st.just({"pp": 0, "dp": 1}), "distinct_dim": st.just("pp")},
    ),
    Target(
        "rng_offsets",
        _const(hyperrng.rng_offsets),
        {
            "mesh_shape": st.just((2,)),
            "coordinate": st.just((1,)),
            "placements": st.just([Shard(0)]),
            "global_shape": st.just((4, 3)),
        },
    ),
    Target("MeshInfo", _const(hyperrng.MeshInfo), {"shape": st.just((2,)), "coordinate": st.just((0,))}),
    Target("ShardedRNGTracker", _const(hyperrng.ShardedRNGTracker), {"platform": st.builds(platforms.CPUPlatform)}),
    Target(
        "verify_rng_sync",
        _const(hyperrng.verify_rng_sync),
        {"layout": st.just(LAYOUT), "coords": st.just(COORDS), "tracker": trackers},
    ),
    Target(
        "rng_state_dict",
        _const(hyperrng.rng_state_dict),
        {"tracker": trackers, "layout": st.just(LAYOUT), "coords": st.just(COORDS), "base_seed": seeds},
    ),
    Target(
        "load_rng_state_dict",
        _const(hyperrng.load_rng_state_dict),
        {
            "state": st.builds(_state_dict),
            "tracker": trackers,
            "layout": st.just(LAYOUT),
            "coords": st.just(COORDS),
            "on_mismatch": st.sampled_from(["error", "warn", "reseed"]),
        },
    ),
    Target(
        "save_rng_state",
        _const(hyperrng.save_rng_state),
        {"path": st.sampled_from(["a.pt", "b"]), "state": st.builds(_state_dict)},
    ),
    Target("load_rng_state", _const(hyperrng.load_rng_state), {"path": st.sampled_from(["saved.pt", "missing.pt"])}),
    Target(
        "RNGStateful",
        _const(hyperrng.RNGStateful),
        {"tracker": trackers, "layout": st.just(LAYOUT), "coords": st.just(COORDS), "base_seed": seeds},
    ),
    Target(
        "RNGStateful.load_state_dict",
        _method(lambda: hyperrng.RNGStateful(tracker=seeded_tracker()), "load_state_dict"),
        {"state_dict": st.builds(lambda: hyperrng.RNGStateful(tracker=seeded_tracker()).state_dict())},
    ),
    Target(
        "checkpoint",
        _const(hyperrng.checkpoint),
        {"function": st.just(_takes_anything), "*args": st.just((torch.ones(2),)), "tracker": trackers},
    ),
    Target("checkpoint_context", _const(hyperrng.checkpoint_context), {"tracker": trackers}, use=_enter_pair),
    Target("portable_random", _const(hyperrng.portable_random), {"seed": seeds}, use=_enter),
    Target("set_portable_random", _const(hyperrng.set_portable_random), {"enabled": flags, "seed": seeds}),
    Target("is_portable_random_enabled", _const(hyperrng.is_portable_random_enabled)),
    # methods of what hyperrng builds
    Target("RNGStatesTracker.add", _method(seeded_tracker, "add"), {"name": st.just("s"), "seed": seeds}),
    Target("RNGStatesTracker.fork", _method(seeded_tracker, "fork"), {"name": st.just("model-parallel-rng")}, _enter),
    Target("RNGStatesTracker.get_states", _method(seeded_tracker, "get_states"), {"as_tensors": flags}),
    Target(
        "RNGStatesTracker.set_states",
        _method(seeded_tracker, "set_states"),
        {"states": st.builds(lambda: seeded_tracker().get_states())},
    ),
    Target("RNGStatesTracker.reseed", _method(seeded_tracker, "reseed"), {"seeds": st.just({"a": 1, "b": 2})}),
    Target("RNGStatesTracker.register_graph", _method(seeded_tracker, "register_graph"), {"graph": st.just(None)}),
    Target("StreamLayout.from_dict", _const(StreamLayout.from_dict), {"data": st.just(LAYOUT.to_dict())}),
    Target(
        "StreamLayout.seed",
        _method(_const(LAYOUT), "seed"),
        {"stream": st.just("default"), "base_seed": seeds, "coords": st.just(COORDS)},
    ),
    Target("StreamLayout.seeds", _method(_const(LAYOUT), "seeds"), {"base_seed": seeds, "coords": st.just(COORDS)}),
    Target(
        "StreamLayout.check_distinct",
        _method(_const(LAYOUT), "check_distinct"),
        {"base_seed": seeds, "sizes": st.just({"dp": 2, "tp": 2})},
    ),
    Target(
        "StreamLayout.seed_tracker",
        _method(_const(LAYOUT), "seed_tracker"),
        {"tracker": trackers, "base_seed": seeds, "coords": st.just(COORDS)},
    ),
    Target(
        "ShardedRNGTracker.manual_seed",
        _method(hyperrng.ShardedRNGTracker, "manual_seed"),
        {"seed": seeds, "mesh": st.just(((2,), (0,)))},
    ),
    Target(
        "ShardedRNGTracker.offsets",
        _method(hyperrng.ShardedRNGTracker, "offsets"),
        {"mesh": st.just(((2,), (0,))), "placements": st.just([Shard(0)]), "global_shape": st.just((4,))},
    ),
    Target(
        "ShardedRNGTracker.distribute_region",
        _method(lambda: _seeded_sharded(), "distribute_region"),
        {"mesh": st.just(((2,), (0,))), "placements": st.just([Shard(0)]), "global_shape": st.just((4,))},
        use=_enter,
    ),
    # hyperrng.philox
    Target(
        "philox.apply_dropout_mask",
        _const(philox.apply_dropout_mask),
        {"x": st.just(torch.ones(4)), "keep": st.just(torch.ones(4, dtype=torch.bool)), "p": st.just(0.5)},
    ),
    Target(
        "philox.bernoulli",
        _const(philox.bernoulli),
        {"shape": small_shapes, "p": st.just(0.5), **_PHILOX_COMMON},
        keep=_PHILOX_KEEP,
    ),
    Target("philox.check_probability", _const(philox.check_probability), {"p": st.just(0.25)}),
    Target("philox.check_shape", _const(philox.check_shape), {"shape": small_shapes}),
    Target(
        "philox.dropout",
        _const(philox.dropout),
        {"x": _DROPOUT_X, "p": st.just(0.5), **_PHILOX_COMMON},
        keep=_PHILOX_KEEP,
    ),
    Target("philox.normal", _const(philox.normal), {"shape": small_shapes, **_PHILOX_COMMON}, keep=_PHILOX_KEEP),
    Target(
        "philox.philox4x32_10",
        _const(philox.philox4x32_10),
        {"counter": st.just(torch.zeros(3, 4, dtype=torch.int64)), "key": st.just(torch.ones(2, dtype=torch.int64))},
    ),
    Target(
        "philox.randint",
        _const(philox.randint),
        {"shape": small_shapes, "low": st.just(0), "high": st.just(10), **_PHILOX_COMMON},
        keep=_PHILOX_KEEP,
    ),
    Target(
        "philox.random_bits", _const(philox.random_bits), {"shape": small_shapes, **_PHILOX_COMMON}, keep=_PHILOX_KEEP
    ),
    Target("philox.uniform", _const(philox.uniform), {"shape": small_shapes, **_PHILOX_COMMON}, keep=_PHILOX_KEEP),
    # hyperrng.platforms. Left out: Platform (abstract), StateIO, ProbeResult and Selection
    # (records of plain fields, checked by nothing), comm (a module).
    Target("platforms.CPUPlatform", _const(platforms.CPUPlatform)),
    Target("platforms.DeviceModulePlatform", _const(platforms.DeviceModulePlatform)),
    Target("platforms.CUDAPlatform", _const(platforms.CUDAPlatform)),
    Target("platforms.NPUPlatform", _const(platforms.NPUPlatform)),
    Target(
        "platforms.SimulatedPlatform",
        _const(platforms.SimulatedPlatform),
        {"module": st.builds(_sim_module)},
        use=lambda p: p.get_rng_state(0),
        needs_sim=True,
    ),
    Target(
        "platforms.SimulatedDeviceModule",
        _const(platforms.SimulatedDeviceModule),
        {"device_count": st.integers(0, 4), "available": flags, "device_type": st.just("cuda")},
        use=lambda m: m.device_count(),
    ),
    Target(
        "platforms.SimulatedGenerator",
        _const(platforms.SimulatedGenerator),
        {"index": ranks, "seed": seeds, "device_type": st.just("sim")},
        use=lambda g: g.get_state(),
    ),
    Target(
        "platforms.seed_generator", _const(platforms.seed_generator), {"gen": st.builds(torch.Generator), "seed": seeds}
    ),
    Target("platforms.seeds_all_64_bits", _const(platforms.seeds_all_64_bits)),
    Target(
        "platforms.simulated_backend",
        _const(platforms.simulated_backend),
        {"device_type": st.just("sim")},
        needs_sim=True,
    ),
    Target("platforms.pack_counter_state", _const(platforms.pack_counter_state), {"seed": seeds, "offset": st.just(8)}),
    Target(
        "platforms.unpack_counter_state", _const(platforms.unpack_counter_state), {"state": st.builds(_counter_state)}
    ),
    Target(
        "platforms.register",
        _const(platforms.register),
        {"name": st.just("fuzzed"), "factory": st.just(platforms.CPUPlatform), "replace": st.just(True)},
    ),
    Target("platforms.registered", _const(platforms.registered)),
    Target(
        "platforms.load", _const(platforms.load), {"spec": st.sampled_from(["cpu", "hyperrng.platforms:CPUPlatform"])}
    ),
    Target("platforms.select", _const(platforms.select), {"env": st.just({"HYPERRNG_PLATFORM": "cpu"})}),
    Target("platforms.selection", _const(platforms.selection)),
    Target("platforms.current", _const(platforms.current)),
    Target("platforms.set_current", _const(platforms.set_current), {"platform": st.just("cpu")}),
    Target("platforms.use", _const(platforms.use), {"platform": st.just("cpu")}, use=_enter),
    # methods of the platforms (CPU and simulated) and the simulated generator
    *[
        Target(f"{kind}.{name}", _method(make, name), valid, needs_sim=kind == "SimulatedPlatform")
        for kind, make in (("CPUPlatform", platforms.CPUPlatform), ("SimulatedPlatform", _sim_platform))
        for name, valid in (
            ("get_rng_state", {"index": st.just(0)}),
            ("set_rng_state", {"state": st.just(None), "index": st.just(0)}),
            ("check_rng_state", {"state": st.just(None)}),
            ("manual_seed", {"seed": seeds, "index": st.just(0)}),
            ("get_seed_offset", {"index": st.just(0)}),
            ("set_seed_offset", {"seed": seeds, "offset": st.sampled_from([0, 8]), "index": st.just(0)}),
            ("default_generator", {"index": st.just(0)}),
            ("device", {"index": st.just(0)}),
            ("set_device", {"index": st.just(0)}),
            ("is_capturing", {"index": st.just(0)}),
        )
    ],
    Target("SimulatedGenerator.manual_seed", _method(platforms.SimulatedGenerator, "manual_seed"), {"seed": seeds}),
    Target(
        "SimulatedGenerator.set_offset", _method(platforms.SimulatedGenerator, "set_offset"), {"offset": st.just(8)}
    ),
    Target(
        "SimulatedGenerator.set_state",
        _method(platforms.SimulatedGenerator, "set_state"),
        {"new_state": st.builds(_counter_state)},
    ),
    Target(
        "SimulatedGenerator.graphsafe_set_state",
        _method(platforms.SimulatedGenerator, "graphsafe_set_state"),
        {"other": st.builds(platforms.SimulatedGenerator)},
    ),
]


def _seeded_sharded() -> hyperrng.ShardedRNGTracker:
    tracker = hyperrng.ShardedRNGTracker()
    tracker.manual_seed(5, ((2,), (0,)))
    return tracker


# The state-tensor arguments above are filled in per platform: a valid state is the platform's own.
for _target in TARGETS:
    if _target.label.endswith(("set_rng_state", "check_rng_state")):
        _make = platforms.CPUPlatform if _target.label.startswith("CPU") else _sim_platform
        _target.valid = {**_target.valid, "state": st.builds(lambda m=_make: m().get_rng_state(0))}


# -- one call ------------------------------------------------------------------------------------
@dataclass
class Snapshot:
    """The process's random state and selections, as comparable values; :meth:`restore` puts them back."""

    host: torch.Tensor
    python: Any
    numpy: Any
    tracker: RNGStatesTracker
    streams: dict[str, Any]
    seeds: dict[str, int]
    selection: Any
    factories: dict[str, Any]
    portable: bool
    sim: list[torch.Tensor]
    sim_device: int

    @classmethod
    def take(cls) -> Snapshot:
        sim = platforms.simulated._Backend.module
        tracker = hyperrng.get_rng_tracker()
        return cls(
            host=platforms.CPUPlatform().get_rng_state(),
            python=random.getstate(),
            numpy=np.random.get_state(),
            tracker=tracker,
            streams=tracker.get_states(as_tensors=True),
            seeds=tracker.seeds(),
            selection=registry._selection,
            factories=dict(registry._FACTORIES),
            portable=hyperrng.is_portable_random_enabled(),
            sim=[g.get_state() for g in sim.default_generators] if sim is not None else [],
            sim_device=sim._current if sim is not None else 0,
        )

    def differences(self, other: Snapshot) -> list[str]:
        found = []
        if not torch.equal(self.host, other.host):
            found.append("torch's CPU generator (or the CPU platform's cursor)")
        if self.python != other.python:
            found.append("Python's random")
        if repr(self.numpy) != repr(other.numpy):
            found.append("NumPy's global generator")
        if self.tracker is not other.tracker:
            found.append("the process-wide tracker")
        elif self.seeds != other.seeds or _streams_differ(self.streams, other.streams):
            found.append("the tracker's streams")
        if self.selection is not other.selection:
            found.append("the platform selection")
        if self.factories != other.factories:
            found.append("the platform registry")
        if self.portable != other.portable:
            found.append("portable mode")
        if len(self.sim) != len(other.sim) or any(not torch.equal(a, b) for a, b in zip(self.sim, other.sim)):
            found.append("the simulated device's generators")
        if self.sim_device != other.sim_device:
            found.append("the simulated device's current device")
        return found

    def restore(self) -> None:
        if hyperrng.is_portable_random_enabled() != self.portable:
            hyperrng.set_portable_random(self.portable)
        platforms.CPUPlatform().set_rng_state(self.host)
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        registry._selection = self.selection
        registry._FACTORIES.clear()
        registry._FACTORIES.update(self.factories)
        if hyperrng.get_rng_tracker() is not self.tracker:
            hyperrng.set_rng_tracker(self.tracker)
        if self.tracker.seeds() != self.seeds or self.tracker.get_states().keys() != self.streams.keys():
            self.tracker.reset()
            for name, seed in self.seeds.items():
                self.tracker.add(name, seed)
        if self.streams:
            self.tracker.set_states(self.streams)
        sim = platforms.simulated._Backend.module
        if sim is not None and self.sim:
            sim._current = self.sim_device
            for gen, state in zip(sim.default_generators, self.sim):
                gen.set_state(state)


def _streams_differ(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a.keys() != b.keys():
        return True
    return any(
        not (torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y)
        for x, y in ((a[k], b[k]) for k in a)
    )


@dataclass
class Outcome:
    """What one call did: ``error`` is what it raised (``None``: it returned), ``changed`` what a refusal changed."""

    error: BaseException | None
    changed: list[str]


def call(target: Target, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Outcome:
    """Call ``target`` (and exercise its result), then put the process's random state back."""
    before = Snapshot.take()
    error: BaseException | None = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = target.make()(*args, **kwargs)
            if target.use is not None:
                target.use(result)
    except Exception as exc:
        error = exc
    changed = before.differences(Snapshot.take()) if isinstance(error, HyperRNGError) else []
    before.restore()
    return Outcome(error, changed)


def draw_call(data: st.DataObject, target: Target) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A valid call of ``target`` with up to two of its parameters replaced by junk."""
    function = target.make()
    parameters = [
        p for p in inspect.signature(function).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    names = [p.name for p in parameters]
    corrupt = data.draw(st.sets(st.sampled_from(names), max_size=2), label="corrupted") if names else set()
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}
    # Parameters before a *args are passed by position, and always (a keyword would collide with it).
    kinds = [p.kind for p in parameters]
    star = kinds.index(inspect.Parameter.VAR_POSITIONAL) if inspect.Parameter.VAR_POSITIONAL in kinds else 0
    positional = {p.name for p in parameters[:star]}
    for p in parameters:
        valid = target.valid.get(p.name if p.kind is not inspect.Parameter.VAR_POSITIONAL else "*args")
        if p.name in corrupt:
            value = data.draw(paths if p.name == "path" else wrong, label=p.name)
            if p.kind is inspect.Parameter.VAR_POSITIONAL:
                args += tuple(value) if isinstance(value, (list, tuple)) else (value,)
                continue
        elif valid is None or (
            p.default is not inspect.Parameter.empty and p.name not in positional and data.draw(st.booleans())
        ):
            continue
        else:
            value = data.draw(valid, label=p.name)
            if p.kind is inspect.Parameter.VAR_POSITIONAL:
                args += value
                continue
        if p.kind is inspect.Parameter.POSITIONAL_ONLY or p.name in positional:
            args += (value,)
        else:
            kwargs[p.name] = value
    return args, kwargs


def _safe_path(value: object) -> bool:
    """A relative name inside the test's folder (the fuzz must not write elsewhere)."""
    if isinstance(value, (str, bytes)):
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        return "/" not in text and text not in (".", "..")
    return True


paths = wrong.filter(_safe_path)


@pytest.fixture
def fuzz_folder(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A folder to run in (relative paths land there), holding a saved state, with the sim device registered."""
    monkeypatch.chdir(tmp_path)
    if HAS_SIM:
        _sim_module()
    hyperrng.save_rng_state(tmp_path / "saved.pt", _state_dict())
    yield tmp_path


def _record(target: Target, args: tuple[Any, ...], kwargs: dict[str, Any], outcome: Outcome) -> None:
    assert _RECORD is not None
    with open(_RECORD, "a", encoding="utf-8") as f:
        f.write(
            json.dumps(
                {
                    "target": target.label,
                    "error": type(outcome.error).__name__ if outcome.error is not None else None,
                    "message": str(outcome.error)[:300] if outcome.error is not None else None,
                    "changed": outcome.changed,
                    "call": f"{args!r:.300} {kwargs!r:.600}",
                    "where": [f"{f.filename}:{f.lineno}" for f in traceback.extract_tb(outcome.error.__traceback__)][
                        -4:
                    ]
                    if outcome.error is not None
                    else [],
                }
            )
            + "\n"
        )


def _count_call() -> None:
    assert _RECORD is not None
    with open(_RECORD + ".calls", "a", encoding="utf-8") as f:
        f.write("1\n")


def fuzz_one(data: st.DataObject, target: Target) -> None:
    args, kwargs = draw_call(data, target)
    if target.keep is not None and not target.keep(kwargs):
        return
    outcome = call(target, args, kwargs)
    if _RECORD is not None:
        _count_call()
        untyped = outcome.error is not None and not isinstance(outcome.error, HyperRNGError)
        if untyped or outcome.changed:
            _record(target, args, kwargs, outcome)
        return
    if outcome.error is not None and not isinstance(outcome.error, HyperRNGError):
        raise AssertionError(
            f"{target.label}(*{args!r:.200}, **{kwargs!r:.400}) raised an untyped "
            f"{type(outcome.error).__name__}: {outcome.error}"
        ) from outcome.error
    assert not outcome.changed, f"{target.label} refused ({outcome.error}) but changed {', '.join(outcome.changed)}"


KNOWN: dict[str, str] = {}
"""Targets that still raise an untyped error, and why: each is expected to fail until it is fixed."""


@pytest.mark.parametrize(
    "target",
    [
        pytest.param(t, marks=pytest.mark.xfail(strict=True, reason=KNOWN[t.label])) if t.label in KNOWN else t
        for t in TARGETS
    ],
    ids=[t.label for t in TARGETS],
)
def test_a_fuzzed_public_call_raises_only_typed_errors_and_a_refusal_changes_nothing(
    target: Target, fuzz_folder: Any
) -> None:
    if target.needs_sim and not HAS_SIM:
        pytest.skip(_features.feature("sim").refusal())

    @SETTINGS
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        fuzz_one(data, target)

    run()


# -- what the fuzz found, kept as examples ---------------------------------------------------------
# The modules, typed as Any: the calls below pass wrong types on purpose.
_H: Any = hyperrng
_P: Any = platforms
_X: Any = philox
_LAYOUT: Any = LAYOUT
_META_INDEX = torch.zeros((), dtype=torch.int64, device="meta")


def _fork_rng(devices: object) -> None:
    with _H.fork_rng(devices=devices):
        pass


FOUND: list[tuple[str, Callable[[], object], type[HyperRNGError]]] = [
    ("pack_counter_state(None, 0)", lambda: _P.pack_counter_state(None, 0), hyperrng.ArgumentTypeError),
    ("pack_counter_state(0, 2**63)", lambda: _P.pack_counter_state(0, 2**63), hyperrng.InvalidArgumentError),
    ("pack_counter_state(2**1000, 0)", lambda: _P.pack_counter_state(2**1000, 0), hyperrng.InvalidArgumentError),
    ("unpack_counter_state(None)", lambda: _P.unpack_counter_state(None), hyperrng.ArgumentTypeError),
    ("unpack_counter_state(float)", lambda: _P.unpack_counter_state(torch.zeros(16)), hyperrng.InvalidArgumentError),
    (
        "unpack_counter_state(meta)",
        lambda: _P.unpack_counter_state(torch.zeros(16, dtype=torch.uint8, device="meta")),
        hyperrng.InvalidArgumentError,
    ),
    ("fork_rng(devices=tensor(7))", lambda: _fork_rng(torch.tensor(7)), hyperrng.ArgumentTypeError),
    ("bernoulli(65 dimensions)", lambda: _X.bernoulli((1,) * 65, 0.5, 1), hyperrng.InvalidArgumentError),
    ("bernoulli(bytes shape)", lambda: _X.bernoulli(b"\x02\x03", 0.5, 1), hyperrng.ArgumentTypeError),
    ("uniform(bytes shape)", lambda: _X.uniform(b"\x04", 1), hyperrng.ArgumentTypeError),
    ("check_shape(str)", lambda: _X.check_shape("23"), hyperrng.ArgumentTypeError),
    ("SimulatedDeviceModule(nan)", lambda: _P.SimulatedDeviceModule(device_count=math.nan), hyperrng.ArgumentTypeError),
    ("SimulatedDeviceModule(129)", lambda: _P.SimulatedDeviceModule(129), hyperrng.InvalidArgumentError),
    ("SimulatedGenerator(seed=-1)", lambda: _P.SimulatedGenerator(seed=-1), hyperrng.InvalidArgumentError),
    ("seed_host(meta tensor)", lambda: _H.seed_host(_META_INDEX), hyperrng.ArgumentTypeError),
    (
        "CPUPlatform.get_rng_state(meta)",
        lambda: _P.CPUPlatform().get_rng_state(_META_INDEX),
        hyperrng.ArgumentTypeError,
    ),
    ("select(env=[])", lambda: _P.select([]), hyperrng.ArgumentTypeError),
    ("StreamLayout.seed(stream=[])", lambda: _LAYOUT.seed([], 1, COORDS), hyperrng.ArgumentTypeError),
    ("apply_dropout_mask(x=None)", lambda: _X.apply_dropout_mask(None, None, 0.5), hyperrng.ArgumentTypeError),
]


@pytest.mark.parametrize(("label", "call_", "error"), FOUND, ids=[f[0] for f in FOUND])
def test_what_the_fuzz_found_is_refused_with_a_typed_error_and_changes_nothing(
    label: str, call_: Callable[[], object], error: type[HyperRNGError]
) -> None:
    before = Snapshot.take()
    with pytest.raises(error):
        call_()
    assert not before.differences(Snapshot.take())


# -- a save and a load short of descriptors or memory -------------------------------------------------
_UNDER_LIMITS = r"""
import os, resource, sys
import hyperrng

folder = sys.argv[1]
path = os.path.join(folder, "rng.pt")
state = hyperrng.rng_state_dict()
hyperrng.save_rng_state(path, state)
wrong = []


def attempt(what, call, allowed=()):
    try:
        call()
    except (hyperrng.StorageError, *allowed):  # the file system (the process's limits) refused: an OSError
        pass
    except Exception as exc:
        wrong.append(f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")


def under(kind, limit, what, allowed=()):
    soft, hard = resource.getrlimit(kind)
    resource.setrlimit(kind, (limit, hard))
    try:
        attempt("save " + what, lambda: hyperrng.save_rng_state(path, state), allowed)
        attempt("load " + what, lambda: hyperrng.load_rng_state(path), allowed)
    finally:
        resource.setrlimit(kind, (soft, hard))
    assert sorted(os.listdir(folder)) == ["rng.pt"], os.listdir(folder)  # nothing left behind
    hyperrng.load_rng_state(path)  # the checkpoint is whole


opened = {int(fd) for fd in os.listdir("/proc/self/fd")}  # with listdir's own, closed when it returns
lowest_free = min(fd for fd in range(len(opened) + 1) if fd not in opened)
for extra in range(-1, 8):  # the save opens a few descriptors: each of its steps meets EMFILE once
    under(resource.RLIMIT_NOFILE, lowest_free + extra, f"with {extra} descriptors free")
for mib in (0, 1, 4):  # Python's own allocations may fail first: a MemoryError is no error of ours
    size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize")) * 1024
    under(resource.RLIMIT_AS, size + mib * 2**20, f"with {mib} MiB of address space free", (MemoryError,))
print("\n".join(wrong))
sys.exit(1 if wrong else 0)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc (Linux)")
def test_a_save_or_load_short_of_descriptors_or_memory_is_a_storage_error_and_keeps_the_file(tmp_path: Any) -> None:
    """Out of descriptors or memory, the file system refuses: a StorageError (an OSError), the checkpoint kept."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _UNDER_LIMITS, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
