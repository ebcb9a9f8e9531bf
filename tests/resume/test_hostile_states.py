"""Forged and hostile RNG states: refused with a typed error, in time linear in their size, with
nothing changed; errors that reading a state raises pass through as themselves."""

from __future__ import annotations

import copy
import errno
import random
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import hyperrng.platforms as platforms
import numpy as np
import pytest
import torch

from hyperrng.errors import HyperRNGError, InvalidArgumentError, StorageError
from hyperrng.resume import _format as _state_format
from hyperrng.resume._format import digest
from hyperrng.resume.state import load_rng_state, load_rng_state_dict, rng_state_dict, save_rng_state
from hyperrng.seeding.layout import StreamLayout, apply_layout
from hyperrng.streams.tracker import RNGStatesTracker

_FEW_OBJECTS = 1000
LAYOUT = StreamLayout(dims=("dp", "tp"), default=(), streams={"mp": ("tp",), "dp-rng": ("dp",)})
COORDS = {"dp": 1, "tp": 0}


@pytest.fixture(autouse=True)
def _on_the_cpu() -> Iterator[None]:
    """The forged states are the CPU platform's (its device state is MT19937 bytes and a cursor)."""
    with platforms.use(platforms.CPUPlatform()):
        yield


@pytest.fixture
def saved() -> tuple[dict[str, Any], RNGStatesTracker]:
    tracker = RNGStatesTracker()
    apply_layout(LAYOUT, 1234, COORDS, tracker=tracker)
    state = rng_state_dict(tracker=tracker)
    with tracker.fork("mp"):
        torch.rand(3)
    random.random()
    np.random.rand()
    return state, tracker


def _snapshot(tracker: RNGStatesTracker) -> list[Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()  # type: ignore[misc]
    return [
        random.getstate(),
        (kind, np.asarray(keys).tolist(), pos, has_gauss, gauss),
        torch.get_rng_state().tolist(),
        {k: v.tolist() for k, v in tracker.get_states(as_tensors=True).items()},
    ]


def _refused(state: object, tracker: RNGStatesTracker) -> HyperRNGError:
    before = _snapshot(tracker)
    with pytest.raises(HyperRNGError) as info:
        load_rng_state_dict(state, tracker=tracker)  # type: ignore[arg-type]
    assert isinstance(info.value, (ValueError, TypeError)), type(info.value)
    assert _snapshot(tracker) == before, "a refused state changed RNG state"
    return info.value


def _resealed(state: dict[str, Any]) -> dict[str, Any]:
    try:
        state["digest"] = digest(state)
    except InvalidArgumentError:  # the digest refuses it itself: so will the load
        pass
    return state


# -- bounded work ---------------------------------------------------------------------------------


class _CountingDict(dict):  # type: ignore[type-arg]
    """A dict that counts the reads of its values, and stops a walk that reads far too many."""

    reads = 0

    def __getitem__(self, key: Any) -> Any:
        _CountingDict.reads += 1
        assert _CountingDict.reads < 10_000, "the walk read values exponentially often"
        return super().__getitem__(key)


def _shared(depth: int, node: Callable[[Any], Any]) -> Any:
    """``depth`` levels, each made by ``node`` from the one below (several references to it make
    exponentially many paths through ``depth`` objects)."""
    inner: Any = "leaf"
    for _ in range(depth):
        inner = node(inner)
    return inner


def test_the_digest_visits_each_object_once_and_refuses_a_shared_reference(
    saved: tuple[dict[str, Any], RNGStatesTracker],
) -> None:
    state, tracker = saved
    _CountingDict.reads = 0
    state["layout"] = _shared(7, lambda inner: _CountingDict({f"k{i}": inner for i in range(10)}))  # 10**7 paths
    error = _refused(state, tracker)
    assert "reaches one object twice (shared or cyclic references)" in str(error)
    assert _CountingDict.reads < 100


def test_a_cyclic_state_is_refused_as_such(saved: tuple[dict[str, Any], RNGStatesTracker]) -> None:
    state, tracker = saved
    loop: list[Any] = []
    loop.append(loop)
    state["coords"] = {"dp": loop}
    assert "shared or cyclic references" in str(_refused(state, tracker))


def test_a_small_file_of_deeply_shared_references_is_refused_at_once(
    saved: tuple[dict[str, Any], RNGStatesTracker], tmp_path: Path
) -> None:
    # A file of a few kilobytes whose 7 levels each refer 8 times to the next: 2 million paths, which
    # the digest walked one by one (22 levels of 2: 13 s; 40 levels: it never finished). torch.save
    # and torch.load keep the sharing, so the file stays small.
    state, tracker = saved
    state["layout"] = _shared(7, lambda inner: [inner] * 8)
    torch.save(state, tmp_path / "rng.pt")
    assert (tmp_path / "rng.pt").stat().st_size < 64 * 1024
    assert "shared or cyclic references" in str(_refused(load_rng_state(tmp_path / "rng.pt"), tracker))


@pytest.mark.parametrize(
    ("where", "make", "fragment"),
    [
        ("layout", lambda: _shared(9, lambda inner: [inner]), "nested more than 8 levels"),
        ("coords", lambda: {f"d{i}": 0 for i in range(_FEW_OBJECTS)}, f"more than {_FEW_OBJECTS} objects"),
        ("platform", lambda: "x" * (1 << 17), "a string of 131072 characters"),
        ("base_seed", lambda: 1 << 200, "an integer of 201 bits"),
        ("devices", lambda: [torch.zeros(1 << 21, dtype=torch.uint8)], "a tensor of 2097152 elements"),
    ],
    ids=["too-deep", "too-many-objects", "too-long-a-string", "too-large-an-integer", "too-large-a-tensor"],
)
def test_a_state_larger_or_deeper_than_any_rng_state_dict_writes_is_refused(
    saved: tuple[dict[str, Any], RNGStatesTracker],
    where: str,
    make: Callable[[], Any],
    fragment: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_state_format, "_MAX_OBJECTS", _FEW_OBJECTS)  # the limit's mechanism, at a size quick to build
    state, tracker = saved
    state[where] = make()
    assert fragment in str(_refused(_resealed(state), tracker))


# -- every field forged ----------------------------------------------------------------------------

_FORGERIES: dict[str, Callable[[], Any]] = {
    "tensor-of-two": lambda: torch.tensor([1, 2]),
    "tensor-0-d": lambda: torch.tensor(3),
    "sparse-tensor": lambda: torch.zeros(16, dtype=torch.uint8).to_sparse(),
    "float-tensor": lambda: torch.rand(4, dtype=torch.float64),
    "nested-list": lambda: _shared(40, lambda inner: [inner]),
    "huge-int": lambda: 2**100,
    "negative-int": lambda: -1,
    "nan": lambda: float("nan"),
    "long-string": lambda: "s" * 100_000,
    "empty-dict": dict,
    "empty-list": list,
    "none": lambda: None,
    "bool": lambda: True,
    "bytes": lambda: b"\x00" * 16,
    "complex": lambda: complex(1, 2),
    "set": lambda: {1, 2},
    "dtype": lambda: torch.float32,
    "int-keyed-dict": lambda: {1: 2},
}


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every field of a state, as the keys and indices leading to it (the digest excluded)."""
    if isinstance(value, Mapping):
        for key in value:
            if prefix or key != "digest":
                yield (*prefix, key)
                yield from _paths(value[key], (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield (*prefix, index)
            yield from _paths(item, (*prefix, index))


def test_every_field_forged_in_every_way_is_refused_with_a_typed_error_and_changes_nothing(
    saved: tuple[dict[str, Any], RNGStatesTracker],
) -> None:
    # Before, some raised "Boolean value of Tensor ... is ambiguous", RecursionError or
    # NotImplementedError instead of a typed error.
    state, tracker = saved
    paths = list(_paths(state))
    assert len(paths) > 30
    refused = 0
    for path in paths:
        for name, make in _FORGERIES.items():
            forged = copy.deepcopy(state)
            node = forged
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = make()
            before = _snapshot(tracker)
            try:
                load_rng_state_dict(_resealed(forged), tracker=tracker)
            except HyperRNGError as exc:
                assert isinstance(exc, (ValueError, TypeError)), (path, name, exc)
                assert _snapshot(tracker) == before, (path, name)
                refused += 1
            except Exception as exc:
                pytest.fail(f"{'.'.join(map(str, path))} = {name}: untyped {type(exc).__name__}: {exc}")
            else:  # a forged value that is valid there (None for an optional field): a plain load
                load_rng_state_dict(state, tracker=tracker)
    assert refused > 0.9 * len(paths) * len(_FORGERIES)


# -- the all-zero MT19937 state --------------------------------------------------------------------


def _zero_words(what: str) -> Callable[[dict[str, Any]], None]:
    def edit(state: dict[str, Any]) -> None:
        if what == "python":
            state["python"]["state"] = torch.tensor([0] * 624 + [624], dtype=torch.int64)
        elif what == "numpy":
            state["numpy"]["keys"] = torch.zeros(624, dtype=torch.int64)
        else:  # the CPU device's MT19937 words, its header and cursor kept
            device = state["devices"][0].clone()
            device[24 : 24 + 8 * 624] = 0
            state["devices"][0] = device

    return edit


@pytest.mark.parametrize("what", ["python", "numpy", "cpu-device"])
def test_an_all_zero_mt19937_state_is_refused_and_changes_nothing(
    saved: tuple[dict[str, Any], RNGStatesTracker], what: str
) -> None:
    # Before, it loaded, and random.random() (or NumPy, or torch) returned 0.0 from then on.
    state, tracker = saved
    _zero_words(what)(state)
    assert "all-zero MT19937 state" in str(_refused(_resealed(state), tracker))


def test_the_cpu_platform_refuses_an_all_zero_mt19937_state() -> None:
    platform = platforms.CPUPlatform()
    before = platform.get_rng_state()
    zero = before.clone()
    zero[24 : 24 + 8 * 624] = 0
    with pytest.raises(InvalidArgumentError, match="all-zero MT19937 state"):
        platform.set_rng_state(zero)
    assert torch.equal(platform.get_rng_state(), before)


# -- errors of reading pass through as themselves ---------------------------------------------------


class _Failing(dict):  # type: ignore[type-arg]
    """A mapping whose values come from storage that fails (a lazy reader of a remote checkpoint)."""

    error: OSError = OSError()

    def __getitem__(self, key: Any) -> Any:
        raise self.error


@pytest.mark.parametrize(
    "error",
    [TimeoutError(errno.ETIMEDOUT, "the storage timed out"), FileNotFoundError(errno.ENOENT, "the shard is gone")],
    ids=["TimeoutError", "FileNotFoundError"],
)
def test_an_error_raised_while_the_state_is_read_is_not_reported_as_a_malformed_state(
    saved: tuple[dict[str, Any], RNGStatesTracker], error: OSError
) -> None:
    state, tracker = saved
    failing = _Failing(state["streams"])
    failing.error = error
    state["streams"] = failing
    before = _snapshot(tracker)
    with pytest.raises(type(error), match=str(error.strerror)):
        load_rng_state_dict(state, tracker=tracker)
    assert _snapshot(tracker) == before


def test_a_file_system_time_out_while_reading_a_file_is_a_storage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_rng_state(tmp_path / "rng.pt", rng_state_dict())

    def time_out(*args: Any, **kwargs: Any) -> Any:
        raise TimeoutError(errno.ETIMEDOUT, "Connection timed out")

    monkeypatch.setattr(torch, "load", time_out)
    with pytest.raises(TimeoutError, match="could not read the RNG state") as info:
        load_rng_state(tmp_path / "rng.pt")
    assert isinstance(info.value, StorageError) and info.value.errno == errno.ETIMEDOUT
