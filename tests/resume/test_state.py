"""RNG checkpoints: an exact resume of every generator, and a clear refusal of anything else."""

from __future__ import annotations

import copy
import datetime
import itertools
import os
import random
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hyperrng.platforms as platforms
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hyperrng.errors import ArgumentTypeError, HyperRNGError, InvalidArgumentError, InvalidOperationError, StorageError
from hyperrng.resume._format import digest as _digest
from hyperrng.resume.state import (
    FORMAT,
    FORMAT_VERSION,
    RNGResumeWarning,
    RNGStateful,
    load_rng_state,
    load_rng_state_dict,
    resume_seed,
    rng_state_dict,
    save_rng_state,
)
from hyperrng.seeding.layout import DEFAULT_STREAM, StreamLayout, apply_layout
from hyperrng.seeding.recipes import megatron_model_parallel_manual_seed, model_parallel_manual_seed, seed_host
from hyperrng.streams.tracker import DATA_PARALLEL_STREAM, MODEL_PARALLEL_STREAM, RNGStatesTracker, get_rng_tracker
from tests._dist import run_ranks
from tests._platforms import PLATFORMS, draw, fresh_tracker_on_cpu, use_each

MP, DP = MODEL_PARALLEL_STREAM, DATA_PARALLEL_STREAM
SEED = 1234
LAYOUT = StreamLayout(dims=("dp", "tp"), default=(), streams={MP: ("tp",), DP: ("dp",)})
COORDS = {"dp": 1, "tp": 0}


platform = use_each(PLATFORMS)
_fresh = fresh_tracker_on_cpu  # autouse: imported fixtures apply to this module


# -- helpers ---------------------------------------------------------------------------------


def device_draw(n: int, index: int | None = None) -> list[float]:
    """``n`` numbers from a device generator of the current platform (the current one by default)."""
    return draw(platforms.current(), n, index=index).tolist()  # type: ignore[no-any-return]


def draw_everything(tracker: RNGStatesTracker) -> list[float]:
    """Numbers from every generator a state dict covers: host, CPU, every device, every stream."""
    p = platforms.current()
    out = [random.random(), random.gauss(0.0, 1.0), float(np.random.rand()), float(np.random.randn())]
    out += torch.rand(3).tolist()
    for index in range(p.device_count()):
        out += device_draw(3, index)
    for name in sorted(tracker.get_states()):
        with tracker.fork(name):
            out += device_draw(3)
            out += F.dropout(torch.ones(8), 0.5).tolist()  # torch's CPU generator inside the fork
    return out


def seeded_tracker(coords: dict[str, int] = COORDS) -> RNGStatesTracker:
    """A tracker seeded from LAYOUT, with host generators holding a cached normal (a state detail)."""
    tracker = RNGStatesTracker()
    apply_layout(LAYOUT, SEED, coords, tracker=tracker)
    random.seed(7)
    np.random.seed(8)
    random.gauss(0.0, 1.0)  # Python and NumPy both cache the second normal of a pair
    np.random.randn()
    return tracker


def snapshot(tracker: RNGStatesTracker) -> dict[str, Any]:
    """Every state a refused load must leave alone, as comparable plain values."""
    p = platforms.current()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()  # type: ignore[misc]
    return {
        "python": random.getstate(),
        "numpy": (kind, np.asarray(keys).tolist(), pos, has_gauss, gauss),
        "cpu": torch.get_rng_state().tolist(),
        "devices": [p.get_rng_state(i).tolist() for i in range(p.device_count())],
        "streams": {k: v.tolist() for k, v in tracker.get_states(as_tensors=True).items()},
    }


def resealed(state: dict[str, Any], edit: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    """A copy of ``state`` changed by ``edit`` with a digest that matches (a crafted, not a damaged, state)."""
    changed = copy.deepcopy(state)
    edit(changed)
    try:
        changed["digest"] = _digest(changed)
    except InvalidArgumentError:  # what the digest itself refuses, the load refuses the same way
        pass
    return changed


def expect_refusal(state: object, tracker: RNGStatesTracker, fragment: str, **load: Any) -> InvalidArgumentError:
    """Loading ``state`` raises InvalidArgumentError (a ValueError) naming ``fragment`` and changes nothing."""
    kwargs = {"layout": LAYOUT, "coords": COORDS, **load}
    before = snapshot(tracker)
    with pytest.raises(InvalidArgumentError, match=re.escape(fragment)) as info:
        load_rng_state_dict(state, tracker=tracker, **kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert snapshot(tracker) == before, "a refused load changed RNG state"
    return info.value


@pytest.fixture
def saved() -> tuple[dict[str, Any], RNGStatesTracker]:
    """A state saved from a seeded tracker on the CPU, and that tracker advanced past it."""
    tracker = seeded_tracker()
    state = rng_state_dict(tracker=tracker, layout=LAYOUT, coords=COORDS, base_seed=SEED)
    draw_everything(tracker)  # a partial load would now show as a changed state
    return state, tracker


# -- exact resume ------------------------------------------------------------------------------


def test_a_loaded_state_replays_every_generator_exactly(platform: platforms.Platform) -> None:
    tracker = seeded_tracker()
    state = rng_state_dict(tracker=tracker, layout=LAYOUT, coords=COORDS, base_seed=SEED)
    expected = draw_everything(tracker)
    load_rng_state_dict(state, tracker=tracker, layout=LAYOUT, coords=COORDS)
    assert draw_everything(tracker) == expected


def test_a_state_file_reads_back_with_weights_only_and_a_fresh_tracker_adopts_its_streams(
    platform: platforms.Platform, tmp_path: Path
) -> None:
    tracker = seeded_tracker()
    save_rng_state(tmp_path / "rng.pt", rng_state_dict(tracker=tracker))
    expected = draw_everything(tracker)
    assert torch.load(tmp_path / "rng.pt", weights_only=True)["format"] == FORMAT
    fresh = RNGStatesTracker()
    load_rng_state_dict(load_rng_state(tmp_path / "rng.pt"), tracker=fresh)
    assert sorted(fresh.get_states()) == [DP, MP]
    assert draw_everything(fresh) == expected


def test_the_process_wide_tracker_is_the_default(tmp_path: Path) -> None:
    apply_layout(LAYOUT, SEED, COORDS)
    state = rng_state_dict()
    assert sorted(state["streams"]) == [DP, MP]
    expected = draw_everything(get_rng_tracker())
    load_rng_state_dict(state)
    assert draw_everything(get_rng_tracker()) == expected


def test_capturing_a_state_draws_nothing() -> None:
    tracker = seeded_tracker()
    before = snapshot(tracker)
    rng_state_dict(tracker=tracker)
    assert snapshot(tracker) == before


def test_the_state_records_its_setup_and_holds_only_plain_data(platform: platforms.Platform) -> None:
    state = rng_state_dict(tracker=seeded_tracker(), layout=LAYOUT, coords=COORDS, base_seed=SEED)
    assert {k: state[k] for k in ("format", "version", "platform", "rank", "world_size", "base_seed", "coords")} == {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "platform": platform.name,
        "rank": 0,
        "world_size": 1,
        "base_seed": SEED,
        "coords": COORDS,
    }
    assert state["layout"] == LAYOUT.to_dict()
    assert len(state["devices"]) == platform.device_count()
    assert state["digest"] == _digest(state)

    def plain(value: object) -> bool:
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return all(plain(v) for v in value)
        return value is None or isinstance(value, (torch.Tensor, int, float, str))

    assert plain(state)


def hand_seeded_tracker() -> RNGStatesTracker:
    """A tracker whose streams were seeded by hand: hyperrng knows no derivation for them."""
    tracker = RNGStatesTracker()
    tracker.reseed({MP: 5, DP: 6})
    return tracker


def test_a_state_without_setup_metadata_still_resumes_exactly() -> None:
    tracker = hand_seeded_tracker()
    state = rng_state_dict(tracker=tracker)
    assert (state["layout"], state["coords"], state["base_seed"]) == (None, None, None)
    expected = draw_everything(tracker)
    load_rng_state_dict(state, tracker=tracker, layout=LAYOUT, coords=COORDS)
    assert draw_everything(tracker) == expected


# -- refusals: a clear error, and nothing changed ------------------------------------------------


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit that sets the field at a dotted path (``"python.state"``) to ``value(old)``."""

    def edit(state: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = state
        for key in parents:
            node = node[key]
        node[last] = value(node[last])

    return edit


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    def edit(state: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = state
        for key in parents:
            node = node[key]
        del node[last]

    return edit


def _flip_byte(tensor: torch.Tensor) -> torch.Tensor:
    changed = tensor.clone()
    changed.view(torch.uint8)[7] ^= 1
    return changed


def refusal(
    name: str,
    edit: Callable[[dict[str, Any]], object] | None,
    fragment: str,
    *,
    reseal: bool = True,
    load: dict[str, Any] | None = None,
    bug: str | None = None,
) -> Any:
    """One bad state: ``edit`` to the saved one (its digest recomputed unless ``reseal=False``)."""
    marks = [pytest.mark.xfail(strict=True, reason=bug)] if bug else []
    return pytest.param(edit, reseal, load or {}, fragment, id=name, marks=marks)


OTHER_LAYOUT = StreamLayout(dims=("dp", "tp"), default=(), streams={MP: ("dp", "tp"), DP: ("dp",)})
DIGEST = "digest does not match its content: the file was modified or damaged"
MALFORMED = "the RNG state is malformed"


def _cursor(seed: int, offset: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """An edit of the CPU platform's state that replaces its position cursor (the last 16 bytes)."""

    def forge(state: torch.Tensor) -> torch.Tensor:
        raw = seed.to_bytes(8, "little") + (offset % 2**64).to_bytes(8, "little")
        return torch.cat([state[: platforms.MT19937_STATE_NBYTES], torch.frombuffer(bytearray(raw), dtype=torch.uint8)])

    return forge


CPU_STATE = f"device 0 state must be a 1-D torch.uint8 CPU tensor of {platforms.CPU_STATE_NBYTES} elements"

REFUSALS = [
    # another format
    refusal(
        "another-format",
        _set("format", lambda _: "torch.rng"),
        f"not a hyperrng RNG state (expected format {FORMAT!r})",
    ),
    refusal(
        "format-version-1",
        _set("version", lambda _: 1),
        "format version 1 cannot be read by this hyperrng, which reads version 2",
    ),
    # damaged: one byte, one field, or the digest itself
    refusal("one-byte-of-the-cpu-state-changed", _set("devices", lambda d: [_flip_byte(d[0])]), DIGEST, reseal=False),
    refusal("one-byte-of-a-stream-changed", _set(f"streams.{MP}", _flip_byte), DIGEST, reseal=False),
    refusal("one-byte-of-the-python-state-changed", _set("python.state", _flip_byte), DIGEST, reseal=False),
    refusal("metadata-edited-without-its-digest", _set("rank", lambda _: 1), DIGEST, reseal=False),
    refusal("digest-removed", _drop("digest"), DIGEST, reseal=False),
    # another setup
    refusal(
        "saved-under-world-size-2",
        _set("world_size", lambda _: 2),
        "saved under a different setup: world size 2 (now 1)",
    ),
    refusal("a-rank-outside-its-world", _set("rank", lambda _: 1), "rank 1 does not lie in a world of size 1"),
    refusal(
        "other-mesh-coordinates",
        None,
        "mesh coordinates {'dp': 1, 'tp': 0} (now {'dp': 0, 'tp': 1})",
        load={"coords": {"dp": 0, "tp": 1}},
    ),
    refusal("other-layout", None, "a different stream layout", load={"layout": OTHER_LAYOUT}),
    refusal("saved-with-more-devices", _set("devices", lambda d: d + [t.clone() for t in d]), "2 device(s) (now 1)"),
    refusal("stream-missing", _drop(f"streams.{DP}"), f"lacks stream(s) [{DP!r}] that the tracker holds"),
    refusal(
        "extra-stream",
        _set("streams", lambda s: {**s, "expert-parallel-rng": s[MP].clone()}),
        "holds stream(s) ['expert-parallel-rng'] that the tracker does not",
    ),
    # malformed fields
    refusal(
        "cpu-state-of-the-wrong-dtype",
        _set("devices", lambda d: [d[0].float()]),
        f"{CPU_STATE}, got a torch.float32 tensor of shape ({platforms.CPU_STATE_NBYTES},)",
    ),
    refusal(
        "cpu-state-truncated",
        _set("devices", lambda d: [d[0][:100]]),
        f"{CPU_STATE}, got a torch.uint8 tensor of shape (100,)",
    ),
    refusal(
        "a-host-copy-where-the-device-is-the-host",
        _set("torch_cpu", lambda _: torch.get_rng_state()),
        "torch_cpu must be None on a platform whose device is the host",
    ),
    refusal(
        "python-state-truncated",
        _set("python.state", lambda t: t[:10]),
        "the Python random state must be a 1-D torch.int64 CPU tensor of 625 elements",
    ),
    refusal(
        "python-state-as-a-list",
        _set("python.state", lambda t: t.tolist()),
        "the Python random state must be a 1-D torch.int64 CPU tensor of 625 elements, got list",
    ),
    refusal(
        "numpy-keys-of-the-wrong-dtype",
        _set("numpy.keys", lambda t: t.int()),
        "the NumPy state keys must be a 1-D torch.int64 CPU tensor of 624 elements, got a torch.int32",
    ),
    refusal(
        "device-state-of-the-wrong-shape",
        _set("devices", lambda d: [d[0].view(2, -1)]),
        "device 0 state must be a 1-D torch.uint8 CPU tensor",
    ),
    refusal(
        "stream-state-of-the-wrong-length",
        _set(f"streams.{MP}", lambda t: t[:16]),
        f"state of stream {MP!r} must be a 1-D torch.uint8 CPU tensor",
    ),
    refusal("numpy-field-missing", _drop("numpy"), f"{MALFORMED}: field 'numpy' is missing"),
    refusal(
        "numpy-position-not-a-number",
        _set("numpy.pos", lambda _: "x"),
        "the NumPy state position must be an int in [0, 624], got 'x'",
    ),
    # a forged position crashes NumPy later: every field is bounded before anything applies
    refusal(
        "numpy-position-past-624",
        _set("numpy.pos", lambda _: 10**6),
        "the NumPy state position must be an int in [0, 624]",
    ),
    refusal(
        "numpy-position-700", _set("numpy.pos", lambda _: 700), "the NumPy state position must be an int in [0, 624]"
    ),
    refusal(
        "numpy-position-negative",
        _set("numpy.pos", lambda _: -1),
        "the NumPy state position must be an int in [0, 624]",
    ),
    refusal(
        "numpy-position-a-float",
        _set("numpy.pos", lambda _: 3.7),
        "the NumPy state position must be an int in [0, 624]",
    ),
    refusal(
        "numpy-position-a-bool",
        _set("numpy.pos", lambda _: True),
        "the NumPy state position must be an int in [0, 624]",
    ),
    refusal(
        "numpy-key-past-32-bits",
        _set("numpy.keys", lambda t: torch.cat([torch.tensor([2**32]), t[1:]])),
        "the NumPy state keys must be 624 words",
    ),
    refusal(
        "numpy-has-gauss-2", _set("numpy.has_gauss", lambda _: 2), "the NumPy has_gauss flag must be an int in [0, 1]"
    ),
    refusal(
        "python-cached-normal-nan",
        _set("python.gauss", lambda _: float("nan")),
        "the Python cached normal must be None or a finite float",
    ),
    refusal(
        "numpy-cached-normal-nan",
        _set("numpy.gauss", lambda _: float("nan")),
        "the NumPy cached normal must be a finite float",
    ),
    refusal(
        "numpy-extra-field",
        _set("numpy", lambda n: {**n, "extra": 1}),
        "the NumPy state must be a mapping with exactly the keys",
    ),
    refusal(
        "numpy-extra-field-with-a-number-for-a-name",
        _set("numpy", lambda n: {**n, 7: 1}),
        "it has a key of type int; rng_state_dict writes string keys only",
    ),
    refusal("devices-field-missing", _drop("devices"), MALFORMED),
    refusal("platform-field-missing", _drop("platform"), MALFORMED),
    refusal("devices-not-a-list", _set("devices", lambda _: 3), MALFORMED),
    refusal("numpy-kind-not-mt19937", _set("numpy.kind", lambda _: "PCG64"), MALFORMED),
    refusal(
        "python-position-beyond-624",
        _set("python.state", lambda t: torch.cat([t[:-1], torch.tensor([700])])),
        MALFORMED,
    ),
    refusal(
        "python-word-negative",
        _set("python.state", lambda t: torch.cat([torch.tensor([-1]), t[1:]])),
        MALFORMED,
    ),
    refusal("python-version-unknown", _set("python.version", lambda _: 7), MALFORMED),
    refusal(
        "python-version-a-float",
        _set("python.version", lambda _: 3.0),
        "the Python random state version must be an int in [3, 3]",
    ),
    refusal("python-cached-normal-not-a-number", _set("python.gauss", lambda _: "x"), MALFORMED),
    refusal(
        "cpu-state-not-a-valid-mt19937",
        _set("devices", lambda d: [torch.full_like(d[0], 255)]),
        "not a valid MT19937 state",
    ),
    # the CPU platform's position cursor, kept beside the MT19937 bytes
    refusal("cursor-offset-negative", _set("devices", lambda d: [_cursor(SEED, -4)(d[0])]), "cursor offset of -4"),
    refusal("cursor-offset-not-a-block", _set("devices", lambda d: [_cursor(SEED, 6)(d[0])]), "cursor offset of 6"),
    refusal(
        "cursor-of-another-position",
        _set("devices", lambda d: [_cursor(SEED + 1, 8)(d[0])]),
        "does not belong to its MT19937 bytes",
    ),
    refusal(  # offsets are stored as int64: 2**64 - 1 reads back as -1
        "cursor-offset-past-2-to-the-63",
        _set("devices", lambda d: [_cursor(SEED, 2**64 - 1)(d[0])]),
        "cursor offset of -1",
    ),
    # metadata typed and bounded
    refusal("base-seed-negative", _set("base_seed", lambda _: -5), "base_seed -5 is outside [0, 2**64 - 1]"),
    refusal("base-seed-past-2-to-the-64", _set("base_seed", lambda _: 2**70), "an integer of 71 bits"),
    refusal("base-seed-a-float", _set("base_seed", lambda _: 1234.0), "field 'base_seed' is a float"),
    refusal(
        "stream-name-empty",
        _set("streams", lambda s: {"": s[MP], DP: s[DP]}),
        "stream name '' is not a non-empty string",
    ),
]


@pytest.mark.parametrize(("edit", "reseal", "load", "fragment"), REFUSALS)
def test_a_bad_state_is_refused_with_a_clear_error_and_changes_nothing(
    saved: tuple[dict[str, Any], RNGStatesTracker],
    edit: Callable[[dict[str, Any]], object] | None,
    reseal: bool,
    load: dict[str, Any],
    fragment: str,
) -> None:
    state, tracker = saved
    if edit is not None:
        if reseal:
            state = resealed(state, edit)
        else:
            state = copy.deepcopy(state)
            edit(state)
    expect_refusal(state, tracker, fragment, **load)


def test_a_tracker_holding_another_stream_refuses_the_state(saved: tuple[dict[str, Any], RNGStatesTracker]) -> None:
    state, tracker = saved
    tracker.add("expert-parallel-rng", 99)
    expect_refusal(state, tracker, "lacks stream(s) ['expert-parallel-rng'] that the tracker holds")


def test_loading_inside_a_fork_is_refused_and_changes_nothing(saved: tuple[dict[str, Any], RNGStatesTracker]) -> None:
    # A valid call that cannot run now: InvalidOperationError, as the README's table of errors says.
    state, tracker = saved
    with tracker.fork(MP):
        before = snapshot(tracker)
        with pytest.raises(InvalidOperationError, match=f"inside a fork of stream {MP!r}") as info:
            load_rng_state_dict(state, tracker=tracker, layout=LAYOUT, coords=COORDS)
        assert info.value.reason == "tracker" and snapshot(tracker) == before


def test_a_dict_of_another_format_is_refused() -> None:
    expect_refusal({"version": 1}, seeded_tracker(), "not a hyperrng RNG state")


@pytest.mark.parametrize("state", [None, [1, 2], "hyperrng.rng_state", 5], ids=repr)
def test_something_that_is_not_a_dict_is_refused_as_a_type_error(state: object) -> None:
    tracker = seeded_tracker()
    before = snapshot(tracker)
    with pytest.raises(ArgumentTypeError, match=re.escape("the dict rng_state_dict() returned")):
        load_rng_state_dict(state, tracker=tracker, layout=LAYOUT, coords=COORDS)  # type: ignore[arg-type]
    assert snapshot(tracker) == before, "a refused load changed RNG state"


def test_an_unknown_on_mismatch_is_refused_before_anything_is_read(
    saved: tuple[dict[str, Any], RNGStatesTracker],
) -> None:
    state, tracker = saved
    expect_refusal(state, tracker, "on_mismatch must be one of ('error', 'reseed'), got 'ignore'", on_mismatch="ignore")


@pytest.mark.parametrize("saved_on", ["sim", "cuda-on-sim"])
def test_a_state_saved_on_another_platform_is_refused(saved_on: str) -> None:
    with platforms.use(PLATFORMS[saved_on]()) as other:
        state = rng_state_dict(tracker=seeded_tracker(), layout=LAYOUT, coords=COORDS, base_seed=SEED)
    with platforms.use(platforms.CPUPlatform()):
        error = expect_refusal(state, seeded_tracker(), f"platform {other.name!r} (now 'cpu')")
    assert "on_mismatch='reseed'" in str(error), "the message says how to resume anyway"


# -- files -----------------------------------------------------------------------------------


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rng.pt"
    save_rng_state(path, rng_state_dict(tracker=seeded_tracker()))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(InvalidArgumentError, match="the file is truncated or not written by save_rng_state"):
        load_rng_state(path)


def test_a_missing_file_is_a_storage_error_that_is_a_file_not_found_error(tmp_path: Path) -> None:
    with pytest.raises(
        FileNotFoundError, match=re.escape(f"could not read the RNG state at {str(tmp_path / 'nope.pt')!r}")
    ) as info:
        load_rng_state(tmp_path / "nope.pt")
    assert isinstance(info.value, StorageError) and info.value.filename == str(tmp_path / "nope.pt")


def test_a_file_of_arbitrary_objects_is_refused_without_unpickling_them(tmp_path: Path) -> None:
    torch.save({"when": datetime.date(2024, 1, 1)}, tmp_path / "rng.pt")
    with pytest.raises(InvalidArgumentError, match="could not read the RNG state .* \\(UnpicklingError"):
        load_rng_state(tmp_path / "rng.pt")


def test_a_file_holding_something_else_than_a_dict_is_refused(tmp_path: Path) -> None:
    torch.save([1, 2], tmp_path / "rng.pt")
    with pytest.raises(InvalidArgumentError, match="holds a list, not an RNG state dict"):
        load_rng_state(tmp_path / "rng.pt")


def test_one_changed_byte_in_a_file_is_caught_by_the_digest(
    saved: tuple[dict[str, Any], RNGStatesTracker], tmp_path: Path
) -> None:
    state, tracker = saved
    path = tmp_path / "rng.pt"
    save_rng_state(path, state)
    raw = bytearray(path.read_bytes())
    at = raw.find(state["python"]["state"].numpy().tobytes())  # torch.save stores tensor bytes as they are
    assert at > 0
    raw[at + 40] ^= 1
    path.write_bytes(bytes(raw))
    expect_refusal(load_rng_state(path), tracker, "digest does not match its content")


# -- atomic saves: a kill at any point leaves the previous or the new checkpoint ------------------

_KILL_POINTS = [("write", k) for k in range(0, 25)] + [("fsync", 0), ("replace", 0), ("folder-fsync", 0)]
"""Where the saving child kills itself: after writing a share k/24 of the file's bytes (24/24: all
of them, before the fsync), at the fsync of the file, at the rename, at the fsync of the folder."""


def _save_and_die(path: str, state: dict[str, Any], point: str, share: int) -> None:
    """In a forked child: save ``state`` to ``path`` and SIGKILL this process at ``point``."""
    import signal

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    real_save, real_fsync = torch.save, os.fsync

    def save_part(obj: object, file: Any) -> None:
        """torch.save's bytes, cut at the share ``share``/24 of the file, then the kill."""
        import io

        if isinstance(file, (str, os.PathLike)):  # a save that writes over the path in place
            file = open(file, "wb")  # noqa: SIM115 (the process dies holding it)
        buffer = io.BytesIO()
        real_save(obj, buffer)
        data = buffer.getvalue()
        file.write(data[: len(data) * share // 24])
        file.flush()
        die()

    fsyncs = []

    def fsync(fd: int) -> None:
        fsyncs.append(fd)
        if (point == "fsync" and len(fsyncs) == 1) or (point == "folder-fsync" and len(fsyncs) == 2):
            die()
        real_fsync(fd)

    if point == "write":
        torch.save = save_part  # type: ignore[assignment]
    os.fsync = fsync
    if point == "replace":
        os.replace = lambda *args, **kwargs: die()  # type: ignore[assignment]
    save_rng_state(path, state)
    os._exit(3)  # a save that was meant to be killed returned


def test_a_save_killed_at_any_point_leaves_the_previous_or_the_new_checkpoint_and_it_loads(tmp_path: Path) -> None:
    import multiprocessing

    fork = multiprocessing.get_context("fork")  # the child needs no second import of torch
    path = tmp_path / "rng.pt"
    outcomes = []
    for trial, (point, share) in enumerate(_KILL_POINTS):
        seed_host(trial)
        previous = rng_state_dict(base_seed=trial)
        save_rng_state(path, previous)
        assert [p.name for p in tmp_path.iterdir()] == ["rng.pt"], "a save removes what the killed one before it left"
        seed_host(1000 + trial)
        new = rng_state_dict(base_seed=1000 + trial)
        child = fork.Process(target=_save_and_die, args=(str(path), new, point, share))
        child.start()
        child.join()
        assert child.exitcode == -9, f"{point} {share}: the child was to die of SIGKILL, exit code {child.exitcode}"
        loaded = load_rng_state(path)
        load_rng_state_dict(loaded)  # intact: the digest and every field check out
        assert loaded["digest"] in (previous["digest"], new["digest"])
        if point != "folder-fsync":  # until the rename, the previous checkpoint stands
            assert loaded["digest"] == previous["digest"], f"{point} {share}"
        outcomes.append(loaded["digest"] == new["digest"])
    assert len(outcomes) >= 25 and outcomes[-1], "the kill after the rename keeps the new checkpoint"


def test_a_successful_save_leaves_only_the_checkpoint_in_its_folder(tmp_path: Path) -> None:
    path = tmp_path / "rng.pt"
    for seed in (1, 2):
        seed_host(seed)
        save_rng_state(path, rng_state_dict(base_seed=seed))
        assert [p.name for p in tmp_path.iterdir()] == ["rng.pt"]
        assert load_rng_state(path)["base_seed"] == seed


def test_an_error_while_serialising_removes_the_temporary_file_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rng.pt"
    previous = rng_state_dict(base_seed=1)
    save_rng_state(path, previous)

    def fail_halfway(obj: object, file: str) -> None:
        Path(file).write_bytes(b"half a checkpoint")
        raise RuntimeError("serialisation failed")

    monkeypatch.setattr(torch, "save", fail_halfway)
    with pytest.raises(ArgumentTypeError, match="cannot be saved: RuntimeError: serialisation failed"):
        save_rng_state(path, rng_state_dict(base_seed=2))
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["rng.pt"]
    assert load_rng_state(path)["digest"] == previous["digest"]


def test_a_save_keeps_the_permission_bits_of_the_file_it_replaces(tmp_path: Path) -> None:
    path = tmp_path / "rng.pt"
    save_rng_state(path, rng_state_dict())
    path.chmod(0o640)
    save_rng_state(path, rng_state_dict())
    assert path.stat().st_mode & 0o777 == 0o640


def test_save_accepts_a_str_path_and_load_reads_it(tmp_path: Path) -> None:
    state = rng_state_dict(base_seed=5)
    save_rng_state(str(tmp_path / "rng.pt"), state)
    assert load_rng_state(str(tmp_path / "rng.pt"))["digest"] == state["digest"]


class _ReduceRaises:
    def __init__(self, error: type[Exception]) -> None:
        self.error = error

    def __reduce__(self) -> Any:
        raise self.error("nope")


def _mkldnn() -> torch.Tensor:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch is built without MKL-DNN")
    return torch.zeros(2).to_mkldnn()


def _nested(depth: int) -> list[Any]:
    outer: list[Any] = []
    inner = outer
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return outer


@pytest.mark.parametrize(
    ("make_path", "make_state", "error", "fragment"),
    [
        (lambda d: 7, lambda: rng_state_dict(), ArgumentTypeError, "path must be a str or an os.PathLike"),
        (lambda d: b"rng.pt", lambda: rng_state_dict(), ArgumentTypeError, "got bytes"),
        (lambda d: None, lambda: rng_state_dict(), ArgumentTypeError, "got NoneType"),
        (lambda d: d, lambda: rng_state_dict(), InvalidArgumentError, "is a folder"),
        (lambda d: d / "missing" / "rng.pt", lambda: rng_state_dict(), InvalidArgumentError, "does not exist"),
        (lambda d: d / "rng.pt", lambda: [1, 2], ArgumentTypeError, "got list"),
        (lambda d: d / "rng.pt", lambda: {"rng": rng_state_dict(), "f": lambda: 0}, ArgumentTypeError, "plain data"),
        (lambda d: d / "rng.pt", lambda: {"rng": rng_state_dict(), "o": object()}, InvalidArgumentError, "read back"),
        # Before, these were saved and then refused by load_rng_state (beyond its limits).
        (
            lambda d: d / "rng.pt",
            lambda: {"perm": list(range(100_000))},
            InvalidArgumentError,
            "read back.*instructions",
        ),
        (lambda d: d / "rng.pt", lambda: {f"p{i}": torch.zeros(2) for i in range(8000)}, InvalidArgumentError, "MiB"),
        (lambda d: d / "rng.pt", lambda: {"s": torch.zeros(3).to_sparse()}, InvalidArgumentError, "sparse"),
        (lambda d: d / "rng.pt", lambda: {"v": [f"w{i}" for i in range(100_000)]}, InvalidArgumentError, "read back"),
        # Before, a bare ValueError and a bare NotImplementedError.
        (lambda d: d / "rng.pt", lambda: {"o": _ReduceRaises(ValueError)}, ArgumentTypeError, "ValueError: nope"),
        (
            lambda d: d / "rng.pt",
            lambda: {"o": _ReduceRaises(NotImplementedError)},
            ArgumentTypeError,
            "cannot be saved",
        ),
        (lambda d: d / "rng.pt", lambda: {"t": _mkldnn()}, ArgumentTypeError, "cannot be saved"),
        (lambda d: d / "rng.pt", lambda: {"deep": _nested(5000)}, ArgumentTypeError, "RecursionError"),
        # Before, a trailing '/' was dropped: the file was replaced, or a file made where a folder was named.
        (lambda d: f"{d}/rng.pt/.", lambda: rng_state_dict(), InvalidArgumentError, "/rng.pt' is not a folder"),
        (lambda d: f"{d}/rng.pt/", lambda: rng_state_dict(), InvalidArgumentError, "/rng.pt' is not a folder"),
        (lambda d: f"{d}/sub/", lambda: rng_state_dict(), InvalidArgumentError, "/sub' does not exist, and the path"),
    ],
    ids=[
        "int-path",
        "bytes-path",
        "none-path",
        "folder",
        "no-folder",
        "not-a-dict",
        "unpicklable",
        "not-plain",
        "100k-ints",
        "8000-tensors",
        "sparse",
        "100k-strings",
        "reduce-valueerror",
        "reduce-notimplemented",
        "mkldnn",
        "too-deep",
        "file-slash-dot",
        "file-slash",
        "missing-folder-slash",
    ],
)
def test_save_refuses_bad_input_and_leaves_the_folder_and_the_previous_checkpoint_as_they_were(
    tmp_path: Path, make_path: Callable[[Path], Any], make_state: Callable[[], Any], error: type, fragment: str
) -> None:
    previous = rng_state_dict(base_seed=3)
    save_rng_state(tmp_path / "rng.pt", previous)
    rng_before = (random.getstate(), torch.get_rng_state().tolist())
    state = make_state()
    with pytest.raises(error, match=fragment):
        save_rng_state(make_path(tmp_path), state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rng.pt"]
    assert load_rng_state(tmp_path / "rng.pt")["digest"] == previous["digest"]
    assert (random.getstate(), torch.get_rng_state().tolist()) == rng_before


def test_load_refuses_a_file_named_as_a_folder_and_a_folder_saying_which(tmp_path: Path) -> None:
    # Before, a trailing '/' was dropped and the file read; a folder "is not a regular file, not a
    # regular file".
    save_rng_state(tmp_path / "rng.pt", rng_state_dict())
    for suffix in ("/", "/.", "/./"):
        with pytest.raises(InvalidArgumentError, match="/rng.pt' is not a folder, yet the path names it as one"):
            load_rng_state(f"{tmp_path}/rng.pt{suffix}")
    for path in (str(tmp_path), f"{tmp_path}/"):
        with pytest.raises(InvalidArgumentError, match=r"is a folder, not a regular file: hyperrng will not read it\."):
            load_rng_state(path)


class _BrokenPath(os.PathLike):  # type: ignore[type-arg]
    def __fspath__(self) -> str:
        raise RuntimeError("boom")


def test_a_path_whose_fspath_raises_is_an_argument_type_error_for_save_and_load() -> None:
    # Before, its RuntimeError came out as it was.
    with pytest.raises(ArgumentTypeError, match="its __fspath__ raised RuntimeError: boom"):
        save_rng_state(_BrokenPath(), rng_state_dict())
    with pytest.raises(ArgumentTypeError, match="its __fspath__ raised RuntimeError: boom"):
        load_rng_state(_BrokenPath())


@pytest.mark.parametrize("path", [7, b"rng.pt", None], ids=["int", "bytes", "none"])
def test_load_refuses_a_path_of_the_wrong_type(path: Any) -> None:
    with pytest.raises(ArgumentTypeError, match="path must be a str or an os.PathLike"):
        load_rng_state(path)


# -- on_mismatch="reseed" -----------------------------------------------------------------------


def test_reseed_rederives_the_streams_for_the_new_setup_and_warns(
    saved: tuple[dict[str, Any], RNGStatesTracker],
) -> None:
    state, tracker = saved
    from_two_ranks = resealed(state, _set("world_size", lambda _: 2))
    new_coords = {"dp": 0, "tp": 0}
    with pytest.warns(RNGResumeWarning, match=r"world size 2 \(now 1\).*re-derived from base seed 1234"):
        load_rng_state_dict(from_two_ranks, tracker=tracker, layout=LAYOUT, coords=new_coords, on_mismatch="reseed")
    assert snapshot(tracker) == snapshot(_resumed_tracker(from_two_ranks, new_coords))


def _resumed_tracker(state: dict[str, Any], coords: dict[str, int]) -> RNGStatesTracker:
    """What a reseed-resume of ``state`` at ``coords`` gives: each stream from its own resume seed."""
    expected = RNGStatesTracker()
    bases = {name: resume_seed(state, name) for name in (DEFAULT_STREAM, *LAYOUT.streams)}
    seed_host(LAYOUT.seed_tracker(expected, SEED, coords, bases=bases)[DEFAULT_STREAM])
    return expected


@pytest.mark.needs_sim
def test_reseed_resumes_a_state_from_another_platform() -> None:
    with platforms.use(platforms.SimulatedPlatform()):
        state = rng_state_dict(tracker=seeded_tracker(), layout=LAYOUT, coords=COORDS, base_seed=SEED)
    tracker = seeded_tracker()
    with pytest.warns(RNGResumeWarning, match="platform 'sim' \\(now 'cpu'\\)"):
        load_rng_state_dict(state, tracker=tracker, layout=LAYOUT, coords=COORDS, on_mismatch="reseed")
    assert {k: v.tolist() for k, v in tracker.get_states().items()} == snapshot(_resumed_tracker(state, COORDS))[
        "streams"
    ]


def test_reseed_is_a_plain_exact_resume_when_nothing_differs(saved: tuple[dict[str, Any], RNGStatesTracker]) -> None:
    state, tracker = saved
    load_rng_state_dict(state, tracker=tracker)
    expected = draw_everything(tracker)
    draw_everything(tracker)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_rng_state_dict(state, tracker=tracker, layout=LAYOUT, coords=COORDS, on_mismatch="reseed")
    assert draw_everything(tracker) == expected


@pytest.mark.parametrize(
    ("saved_layout", "base_seed", "load", "fragment"),
    [
        (None, SEED, {"layout": None}, "layout/coords were not given"),
        (LAYOUT, SEED, {"coords": None}, "layout/coords were not given"),
        (LAYOUT, None, {}, "the state has base_seed=None"),
    ],
    ids=["without-layout-given-or-saved", "without-coords", "state-without-base-seed"],
)
def test_reseed_without_what_it_needs_is_refused_and_changes_nothing(
    saved_layout: StreamLayout | None, base_seed: int | None, load: dict[str, Any], fragment: str
) -> None:
    tracker = hand_seeded_tracker()  # no derivation to fall back on
    state = rng_state_dict(tracker=tracker, layout=saved_layout, coords=COORDS, base_seed=base_seed)
    from_two_ranks = resealed(state, _set("world_size", lambda _: 2))
    draw_everything(tracker)
    error = expect_refusal(from_two_ranks, tracker, fragment, on_mismatch="reseed", **load)
    assert "on_mismatch='reseed' needs the saved base seed and the current layout and coords" in str(error)


_HOST_LIBRARIES = 4  # draw_everything's first numbers: Python's and NumPy's, which apply_layout leaves alone


def _resumed_draws(state: dict[str, Any], coords: dict[str, int]) -> list[float]:
    """What a job restarted at another world size draws from torch's generators and the streams after a
    reseed-resume from ``state``."""
    tracker = RNGStatesTracker()
    apply_layout(LAYOUT, SEED + 7, coords, tracker=tracker)  # the restarted job's own seeding, then the resume
    with pytest.warns(RNGResumeWarning):
        load_rng_state_dict(state, tracker=tracker, layout=LAYOUT, coords=coords, on_mismatch="reseed")
    return draw_everything(tracker)[_HOST_LIBRARIES:]


def test_a_reseed_resume_does_not_replay_the_first_steps_and_two_resumes_agree(platform: platforms.Platform) -> None:
    coords = {"dp": 0, "tp": 0}
    first_steps = RNGStatesTracker()
    apply_layout(LAYOUT, SEED, coords, tracker=first_steps)  # step 0 of the run, on the rank the resume lands
    at_step_0 = draw_everything(first_steps)[_HOST_LIBRARIES:]
    tracker = RNGStatesTracker()
    apply_layout(LAYOUT, SEED, COORDS, tracker=tracker)
    draw_everything(tracker)  # a few steps of training
    at_step_2 = resealed(rng_state_dict(tracker=tracker), _set("world_size", lambda _: 2))
    draw_everything(tracker)
    at_step_4 = resealed(rng_state_dict(tracker=tracker), _set("world_size", lambda _: 2))

    resumed = _resumed_draws(at_step_2, coords)
    assert resumed == _resumed_draws(at_step_2, coords), "two resumes of one checkpoint draw the same numbers"
    assert resumed != at_step_0, "the resume replayed the numbers of step 0"
    assert resumed != _resumed_draws(at_step_4, coords), "resumes from other steps drew the same numbers"


def test_replicas_checkpoints_resume_into_the_same_streams() -> None:
    # Two ranks that share the default stream (LAYOUT's default varies over no dimension) and have drawn
    # alike hold equal progress: either one's checkpoint resumes a rank into the same streams.
    states = []
    for dp in (0, 1):
        tracker = RNGStatesTracker()
        apply_layout(LAYOUT, SEED, {"dp": dp, "tp": 0}, tracker=tracker)
        torch.rand(5)  # the default stream moves on alike on both
        states.append(resealed(rng_state_dict(tracker=tracker), _set("world_size", lambda _: 2)))
    assert resume_seed(states[0]) == resume_seed(states[1])
    assert resume_seed(states[0]) not in (SEED, resume_seed(resealed(states[0], _set("base_seed", lambda _: 1))))


def _rank_state(layout: StreamLayout, coords: dict[str, int], ranks: tuple[int, int]) -> dict[str, Any]:
    """A rank's checkpoint after a few steps: seeded from ``layout``, every generator drawn alike on the
    ranks that share it, saved as rank ``coords`` of a ``dp x tp`` world of ``ranks``."""
    tracker = RNGStatesTracker()
    apply_layout(layout, SEED, coords, tracker=tracker)
    draw_everything(tracker)
    world = ranks[0] * ranks[1]
    rank = coords["dp"] * ranks[1] + coords["tp"]
    return resealed(rng_state_dict(tracker=tracker), lambda state: state.update(world_size=world, rank=rank))


def _stream_states(tracker: RNGStatesTracker) -> dict[str, list[int]]:
    """Every stream's state, the default stream's being its generator's (the CPU platform's device)."""
    return {DEFAULT_STREAM: platforms.current().get_rng_state().tolist(), **snapshot(tracker)["streams"]}


@pytest.mark.parametrize("default", [("dp",), ()], ids=["default-per-dp", "default-shared"])
@pytest.mark.parametrize(
    ("old", "new"),
    [((2, 2), (1, 2)), ((2, 2), (4, 2)), ((2, 1), (3, 1)), ((4, 2), (2, 2))],
    ids=["4->2", "4->8", "2->3", "8->4"],
)
def test_a_resume_at_another_world_size_shares_each_stream_as_the_layout_says(
    default: tuple[str, ...], old: tuple[int, int], new: tuple[int, int]
) -> None:
    """Every new rank loads the checkpoint of the old rank at ``(dp mod old dp, tp mod old tp)``, as a
    restarted job does. Afterwards ranks that share a stream (equal coordinates on its dimensions)
    hold it alike and the others do not; no stream replays the first steps; two resumes agree.
    (Resume seeds that mixed in the default stream's progress gave a TP stream per DP rank.)"""
    layout = StreamLayout(dims=("dp", "tp"), default=default, streams={MP: ("tp",), DP: ("dp",)})
    grid = [{"dp": dp, "tp": tp} for dp in range(old[0]) for tp in range(old[1])]
    states = {(c["dp"], c["tp"]): _rank_state(layout, c, old) for c in grid}
    first_steps = []
    for c in grid:
        fresh = RNGStatesTracker()
        apply_layout(layout, SEED, c, tracker=fresh)
        first_steps.append(_stream_states(fresh))

    def resume(coords: dict[str, int]) -> dict[str, list[int]]:
        tracker = RNGStatesTracker()
        state = states[(coords["dp"] % old[0], coords["tp"] % old[1])]
        with pytest.warns(RNGResumeWarning):
            load_rng_state_dict(state, tracker=tracker, layout=layout, coords=coords, on_mismatch="reseed")
        return _stream_states(tracker)

    new_grid = [{"dp": dp, "tp": tp} for dp in range(new[0]) for tp in range(new[1])]
    resumed = [resume(c) for c in new_grid]
    assert resume(new_grid[-1]) == resumed[-1], "two resumes of one checkpoint must agree"
    for stream, dims in {DEFAULT_STREAM: default, MP: ("tp",), DP: ("dp",)}.items():
        for (a, state_a), (b, state_b) in itertools.combinations(zip(new_grid, resumed), 2):
            share = all(a[d] == b[d] for d in dims)
            same = state_a[stream] == state_b[stream]
            assert same == share, f"stream {stream!r} at {a} and {b}: {'must' if share else 'must not'} be shared"
        assert not any(r[stream] == f[stream] for r in resumed for f in first_steps), f"{stream!r} replayed"


def _elastic_rank(rank: int, world_size: int, directory: str, old_tp_ranks: int) -> list[float]:
    """A rank of a ``dp x 2`` job (default stream per DP rank, a TP stream): at 4 ranks it seeds, draws and
    saves; at another size it resumes from the checkpoint of the old rank at its (dp mod old dp, tp) point,
    checks every stream's sharing across the ranks, and draws."""
    from hyperrng.verify import verify_rng_sync

    layout = StreamLayout(dims=("dp", "tp"), default=("dp",), streams={MP: ("tp",)})
    coords = {"dp": rank // 2, "tp": rank % 2}
    with platforms.use(platforms.CPUPlatform()), warnings.catch_warnings():
        warnings.simplefilter("ignore", RNGResumeWarning)
        tracker = get_rng_tracker()
        apply_layout(layout, SEED, coords)
        if world_size == 4:
            draw_everything(tracker)
            save_rng_state(f"{directory}/rng-{rank}.pt", rng_state_dict())
        else:
            old = (coords["dp"] % 2) * old_tp_ranks + coords["tp"]
            load_rng_state_dict(load_rng_state(f"{directory}/rng-{old}.pt"), on_mismatch="reseed")
        verify_rng_sync(layout, coords)  # raises RNGDesyncError on every rank where a stream is shared wrongly
        with tracker.fork(MP):
            tp = torch.rand(4).tolist()
        return tp + torch.rand(2).tolist()


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_job_saved_at_4_ranks_resumes_at_8_with_every_stream_in_sync(tmp_path: Path) -> None:
    """The issue's case, over gloo: saved at dp 2 x tp 2, resumed at dp 4 x tp 2."""
    run_ranks(_elastic_rank, 4, str(tmp_path), 2)
    draws = run_ranks(_elastic_rank, 8, str(tmp_path), 2)
    for rank, values in enumerate(draws):
        same_tp = [other for other in range(8) if other % 2 == rank % 2]
        assert all(draws[other][:4] == values[:4] for other in same_tp), "the TP stream differs within a TP rank"
        assert draws[rank ^ 1][:4] != values[:4], "TP ranks must draw different TP streams"
        for other in range(8):  # the default stream is the DP rank's: shared by its two TP ranks only
            assert (draws[other][4:] == values[4:]) == (other // 2 == rank // 2), (
                f"default stream, ranks {rank}, {other}"
            )


def test_resume_seed_refuses_a_state_without_a_base_seed() -> None:
    state = rng_state_dict(tracker=hand_seeded_tracker())
    with pytest.raises(InvalidArgumentError, match="no base seed to resume from"):
        resume_seed(state)


# -- elastic resume without planning: the derivation travels in the checkpoint ----------------------


def test_a_tracker_seeded_from_a_layout_is_saved_with_its_derivation_unasked() -> None:
    tracker = RNGStatesTracker()
    apply_layout(LAYOUT, SEED, COORDS, tracker=tracker)
    state = rng_state_dict(tracker=tracker)
    assert (state["layout"], state["coords"], state["base_seed"]) == (LAYOUT.to_dict(), COORDS, SEED)


def test_the_process_wide_tracker_is_saved_with_its_derivation_unasked() -> None:
    apply_layout(LAYOUT, SEED, {"dp": 3, "tp": 1})
    state = rng_state_dict()
    assert (state["layout"], state["coords"], state["base_seed"]) == (LAYOUT.to_dict(), {"dp": 3, "tp": 1}, SEED)


@pytest.mark.parametrize(
    "replace",
    [
        lambda t: t.reseed({MP: 1, DP: 2}),
        lambda t: t.add("extra-rng", 99),
        lambda t: t.reset(),
        lambda t: megatron_model_parallel_manual_seed(SEED, tracker=t),
        lambda t: model_parallel_manual_seed(SEED, 0, tracker=t),
    ],
    ids=["reseed", "add", "reset", "megatron-recipe", "slapo-recipe"],
)
def test_streams_replaced_after_apply_layout_are_saved_without_a_stale_derivation(
    replace: Callable[[RNGStatesTracker], object],
) -> None:
    tracker = RNGStatesTracker()
    apply_layout(LAYOUT, SEED, COORDS, tracker=tracker)
    replace(tracker)
    state = rng_state_dict(tracker=tracker)
    assert (state["layout"], state["coords"], state["base_seed"]) == (None, None, None)


def test_given_metadata_that_agrees_is_completed_from_the_derivation_and_disagreeing_metadata_is_kept_alone() -> None:
    tracker = RNGStatesTracker()
    apply_layout(LAYOUT, SEED, COORDS, tracker=tracker)
    agreeing = rng_state_dict(tracker=tracker, base_seed=SEED)
    assert (agreeing["layout"], agreeing["coords"]) == (LAYOUT.to_dict(), COORDS)
    other = rng_state_dict(tracker=tracker, base_seed=SEED + 1)
    assert (other["layout"], other["coords"], other["base_seed"]) == (None, None, SEED + 1)


def test_loading_a_state_carries_its_derivation_on_to_the_next_checkpoint() -> None:
    source = RNGStatesTracker()
    apply_layout(LAYOUT, SEED, COORDS, tracker=source)
    state = rng_state_dict(tracker=source)
    fresh = RNGStatesTracker()
    load_rng_state_dict(state, tracker=fresh)
    again = rng_state_dict(tracker=fresh)
    assert (again["layout"], again["coords"], again["base_seed"]) == (LAYOUT.to_dict(), COORDS, SEED)


def test_loading_a_state_without_a_derivation_forgets_the_one_the_tracker_had() -> None:
    tracker = RNGStatesTracker()
    apply_layout(LAYOUT, SEED, COORDS, tracker=tracker)
    hand = rng_state_dict(tracker=hand_seeded_tracker())
    load_rng_state_dict(hand, tracker=tracker)  # the same stream names, seeded otherwise
    state = rng_state_dict(tracker=tracker)
    assert (state["layout"], state["coords"], state["base_seed"]) == (None, None, None)


def test_reseed_needs_no_layout_or_coords_after_apply_layout_for_the_new_setup() -> None:
    old_run = RNGStatesTracker()
    apply_layout(LAYOUT, SEED, COORDS, tracker=old_run)
    from_two_ranks = resealed(rng_state_dict(tracker=old_run), _set("world_size", lambda _: 2))
    new_coords = {"dp": 0, "tp": 1}
    tracker = RNGStatesTracker()
    apply_layout(LAYOUT, SEED, new_coords, tracker=tracker)  # what the restarted job does at launch
    draw_everything(tracker)
    with pytest.warns(RNGResumeWarning, match=r"world size 2 \(now 1\).*re-derived from base seed 1234"):
        load_rng_state_dict(from_two_ranks, tracker=tracker, on_mismatch="reseed")
    assert snapshot(tracker) == snapshot(_resumed_tracker(from_two_ranks, new_coords))


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (_set("layout", lambda _: {"dims": ["dp"]}), "its layout cannot be read"),
        (_set("layout", lambda layout: {**layout, "domain": 1}), "its layout cannot be read"),
        (_set("coords", lambda _: {"dp": 0}), "its coordinates do not fit its layout"),
        (_set("coords", lambda _: {"dp": -1, "tp": 0}), "its coordinates cannot be read"),
    ],
    ids=["layout-without-fields", "layout-of-another-domain", "coords-lacking-a-dim", "negative-coord"],
)
def test_a_state_whose_derivation_is_malformed_is_refused_and_changes_nothing(
    edit: Callable[[dict[str, Any]], None], fragment: str
) -> None:
    tracker = seeded_tracker()
    state = resealed(rng_state_dict(tracker=tracker), edit)
    draw_everything(tracker)
    expect_refusal(state, tracker, f"the RNG state is malformed: {fragment}", layout=None, coords=None)


def _save_without_planning(rank: int, world_size: int, directory: str) -> None:
    """A job that seeds from a layout and saves, never thinking of a resume at another world size."""
    with platforms.use(platforms.CPUPlatform()):
        apply_layout(LAYOUT, SEED, {"dp": rank, "tp": 0})
        save_rng_state(f"{directory}/rng-{rank}.pt", rng_state_dict())


@pytest.mark.multiproc
def test_a_checkpoint_of_two_ranks_resumes_on_one_without_any_planning(tmp_path: Path) -> None:
    run_ranks(_save_without_planning, 2, str(tmp_path))
    coords = {"dp": 0, "tp": 0}
    tracker = get_rng_tracker()
    apply_layout(LAYOUT, SEED, coords)
    draw_everything(tracker)
    saved = load_rng_state(tmp_path / "rng-1.pt")
    with pytest.warns(RNGResumeWarning, match=r"world size 2 \(now 1\).*re-derived from base seed 1234"):
        load_rng_state_dict(saved, on_mismatch="reseed")
    assert snapshot(tracker) == snapshot(_resumed_tracker(saved, coords))


# -- the DCP Stateful, in one process -------------------------------------------------------------


def stateful_for(tracker: RNGStatesTracker, **kwargs: Any) -> RNGStateful:
    return RNGStateful(tracker=tracker, layout=LAYOUT, coords=COORDS, base_seed=SEED, **kwargs)


def test_the_stateful_keys_its_state_by_rank_and_resumes_exactly() -> None:
    tracker = seeded_tracker()
    stateful = stateful_for(tracker)
    held = stateful.state_dict()
    assert list(held) == ["rank_0"] and held["rank_0"]["format"] == FORMAT
    expected = draw_everything(tracker)
    stateful.load_state_dict(held)
    assert draw_everything(tracker) == expected


def test_the_stateful_refuses_a_checkpoint_without_this_ranks_key_and_changes_nothing() -> None:
    tracker = seeded_tracker()
    state = rng_state_dict(tracker=tracker, layout=LAYOUT, coords=COORDS, base_seed=SEED)
    draw_everything(tracker)
    before = snapshot(tracker)
    with pytest.raises(InvalidArgumentError, match=re.escape("no RNG state for rank_0 (it holds rank_1, rank_2)")):
        stateful_for(tracker).load_state_dict({"rank_1": state, "rank_2": state})
    assert snapshot(tracker) == before


def test_a_reseed_without_this_ranks_state_resumes_from_the_saved_rank_at_its_coordinates_modulo_the_extents() -> None:
    saved = {}
    for rank, dp in ((5, 0), (6, 1)):  # two saved ranks, at dp 0 and 1; this rank (0) is not among them
        tracker = seeded_tracker({"dp": dp, "tp": 0})
        draw_everything(tracker)
        point = {"dp": dp, "tp": 0}
        saved[f"rank_{rank}"] = rng_state_dict(tracker=tracker, layout=LAYOUT, coords=point, base_seed=SEED)
    here = {"dp": 3, "tp": 0}  # 3 mod 2 = 1: rank_6's point
    tracker = seeded_tracker(here)
    with pytest.warns(RNGResumeWarning):
        RNGStateful(tracker=tracker, layout=LAYOUT, coords=here, on_mismatch="reseed").load_state_dict(saved)
    resumed = snapshot(tracker)["streams"]
    assert resumed == snapshot(_resumed_tracker(saved["rank_6"], here))["streams"]
    assert resumed != snapshot(_resumed_tracker(saved["rank_5"], here))["streams"]


def test_a_reseed_refuses_a_stand_in_it_cannot_choose_and_changes_nothing() -> None:
    tracker = seeded_tracker()
    state = rng_state_dict(tracker=tracker, layout=LAYOUT, coords=COORDS, base_seed=SEED)
    draw_everything(tracker)
    before = snapshot(tracker)
    both = {"rank_4": state, "rank_5": state}  # two states saved at one point: which one is unknowable
    cases = [
        (stateful_for(tracker, on_mismatch="reseed"), both, r"more than one of them was saved at \{'dp': 1, 'tp': 0\}"),
        (stateful_for(tracker, on_mismatch="reseed"), {}, re.escape("(it holds none); was it saved with an RNGSt")),
        (stateful_for(tracker), {"rank_4": state}, re.escape("size: load with planner=RNGStateful.planner() and")),
        (stateful_for(tracker, load_from=9), {"rank_4": state}, "no RNG state for rank_9 .* load_from must name"),
        (
            RNGStateful(tracker=tracker, layout=LAYOUT, coords={"tp": 0}, on_mismatch="reseed"),
            {"rank_4": state},
            "do not all name",
        ),  # fmt: skip
    ]
    for stateful, loaded, match in cases:
        with pytest.raises(InvalidArgumentError, match=match):
            stateful.load_state_dict(loaded)
        assert snapshot(tracker) == before


def test_the_planner_refuses_a_rank_the_checkpoint_lacks_with_our_error_and_keeps_every_other_key_strict(
    tmp_path: Path,
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    tracker = seeded_tracker()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's own, about running without a process group
        dcp.save({"rng": stateful_for(tracker)}, checkpoint_id=str(tmp_path))
        draw_everything(tracker)
        before = snapshot(tracker)
        with pytest.raises(InvalidArgumentError, match=r"no RNG state for rank_3 \(it holds rank_0\); load_from"):
            dcp.load({"rng": stateful_for(tracker, load_from=3)}, checkpoint_id=str(tmp_path),
                     planner=RNGStateful.planner())  # fmt: skip
        assert snapshot(tracker) == before
        with pytest.raises(CheckpointException):  # the planner re-plans only the RNG entries
            dcp.load({"rng": stateful_for(tracker), "weights": torch.zeros(2)}, checkpoint_id=str(tmp_path),
                     planner=RNGStateful.planner())  # fmt: skip


def test_with_the_planner_a_tracker_without_streams_or_with_others_loads_what_was_saved(tmp_path: Path) -> None:
    """DCP reads into what the loading instance's state_dict() gives: a restarted job that loads before it seeds
    (no streams, no layout) failed in DCP's own planner with a key the checkpoint lacks. The planner reads the
    saved structure, so the empty tracker adopts the saved streams and draws what the saving run drew next; one
    holding other streams gets our error, with nothing changed."""
    import torch.distributed.checkpoint as dcp

    tracker = seeded_tracker()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's own, about running without a process group
        dcp.save({"rng": stateful_for(tracker)}, checkpoint_id=str(tmp_path))
        expected = draw_everything(tracker)
        fresh = RNGStatesTracker()
        dcp.load({"rng": RNGStateful(tracker=fresh)}, checkpoint_id=str(tmp_path), planner=RNGStateful.planner())
        assert draw_everything(fresh) == expected
        other = RNGStatesTracker()
        other.add("elsewhere", 3)
        before = snapshot(other)
        with pytest.raises(HyperRNGError):
            dcp.load({"rng": RNGStateful(tracker=other)}, checkpoint_id=str(tmp_path), planner=RNGStateful.planner())
        assert snapshot(other) == before
        # A state with empty containers (no streams, no layout), which leave DCP no path to read them back by
        empty = RNGStatesTracker()
        where = str(tmp_path / "empty")
        dcp.save({"rng": RNGStateful(tracker=empty)}, checkpoint_id=where)
        expected = draw_everything(empty)
        dcp.load({"rng": RNGStateful(tracker=empty)}, checkpoint_id=where, planner=RNGStateful.planner())
        assert draw_everything(empty) == expected
        # A state of this format saved before resume_bases existed (absent, not empty) reads as it was saved
        state = rng_state_dict(tracker=tracker)
        old = {k: v for k, v in state.items() if k not in ("resume_bases", "digest")}
        old["digest"] = _digest(old)
        where = str(tmp_path / "old")
        dcp.save({"rng": {"rank_0": old}}, checkpoint_id=where)  # what RNGStateful.state_dict() handed DCP then
        expected = draw_everything(tracker)
        fresh = RNGStatesTracker()
        dcp.load({"rng": RNGStateful(tracker=fresh)}, checkpoint_id=where, planner=RNGStateful.planner())
        assert draw_everything(fresh) == expected


def test_the_stateful_passes_on_mismatch_through() -> None:
    tracker = seeded_tracker()
    state = resealed(rng_state_dict(tracker=tracker, base_seed=SEED), _set("world_size", lambda _: 2))
    with pytest.warns(RNGResumeWarning):
        stateful_for(tracker, on_mismatch="reseed").load_state_dict({"rank_0": state})


# -- real processes: DCP and an interrupted training run -------------------------------------------

TRAIN_LAYOUT = StreamLayout(dims=("tp",), default=(), streams={MP: ("tp",)})
STEPS, SAVE_AFTER = 6, 3


def _dcp_round_trip(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    with platforms.use(platforms.CPUPlatform()):
        coords = {"tp": rank}
        apply_layout(TRAIN_LAYOUT, SEED, coords)
        random.seed(rank)
        np.random.seed(rank)
        torch.manual_seed(rank)  # every generator now differs between the ranks
        stateful = RNGStateful(layout=TRAIN_LAYOUT, coords=coords, base_seed=SEED)
        dcp.save({"rng": stateful}, checkpoint_id=directory)
        expected = draw_everything(get_rng_tracker())

        apply_layout(TRAIN_LAYOUT, SEED + 1, coords)  # scramble everything before loading
        random.seed(99)
        np.random.seed(99)
        dcp.load({"rng": stateful}, checkpoint_id=directory)
        keys = sorted(dcp.FileSystemReader(directory).read_metadata().state_dict_metadata)
        return {"expected": expected, "loaded": draw_everything(get_rng_tracker()), "keys": keys}


@pytest.mark.multiproc
def test_dcp_gives_every_rank_its_own_state_back(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_dcp_round_trip, 2, str(tmp_path))
    assert r0["expected"] != r1["expected"], "the ranks must hold different states for the test to mean anything"
    assert r0["loaded"] == r0["expected"]
    assert r1["loaded"] == r1["expected"]
    assert {k.split(".")[1] for k in r0["keys"]} == {"rank_0", "rank_1"}, "both ranks' states are in the checkpoint"


_GROWN = StreamLayout(dims=("dp", "tp"), default=("dp",), streams={MP: ("tp",)})


def _dcp_grow(rank: int, world_size: int, directory: str, saved_world: int, how: str) -> Any:
    """``dp x 2`` ranks: at ``saved_world`` they seed, draw and save with DCP; at a larger world each
    loads (``how``): the saved rank at its ``(dp mod old_dp, tp)`` point named with ``load_from``, or
    chosen by the planner (``"planner"``), re-derives the streams, checks their sharing, and draws;
    ``"strict"``: the planner without a reseed, the error each rank gets."""
    import torch.distributed.checkpoint as dcp

    from hyperrng.verify import verify_rng_sync

    coords = {"dp": rank // 2, "tp": rank % 2}
    with platforms.use(platforms.CPUPlatform()), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the resume warning, and DCP's own
        apply_layout(_GROWN, SEED, coords)
        if world_size == saved_world:
            draw_everything(get_rng_tracker())
            dcp.save({"rng": RNGStateful()}, checkpoint_id=directory)
        elif how == "load_from":
            old = lambda r: (r // 2 % (saved_world // 2)) * 2 + r % 2  # noqa: E731 - the saved rank at (dp mod old_dp, tp)
            dcp.load({"rng": RNGStateful(on_mismatch="reseed", load_from=old)}, checkpoint_id=directory)
        else:
            stateful = RNGStateful(on_mismatch="reseed" if how == "planner" else "error")
            before = get_rng_tracker().get_states()
            try:
                dcp.load({"rng": stateful}, checkpoint_id=directory, planner=RNGStateful.planner())
            except InvalidArgumentError as exc:
                assert get_rng_tracker().get_states().keys() == before.keys()
                unchanged = all(torch.equal(get_rng_tracker().get_states()[k], v) for k, v in before.items())
                return type(exc).__name__, str(exc), unchanged
        verify_rng_sync(_GROWN, coords)
        with get_rng_tracker().fork(MP):
            tp = torch.rand(3).tolist()
        return tp + torch.rand(1).tolist()


@pytest.mark.multiproc
@pytest.mark.slow
def test_dcp_resumes_a_checkpoint_of_4_ranks_on_8_with_every_stream_in_sync(tmp_path: Path) -> None:
    run_ranks(_dcp_grow, 4, str(tmp_path), 4, "load_from")
    draws = run_ranks(_dcp_grow, 8, str(tmp_path), 4, "load_from")
    for rank in range(8):
        for other in range(8):
            assert (draws[rank][:3] == draws[other][:3]) == (rank % 2 == other % 2), "TP stream per TP rank"
            assert (draws[rank][3:] == draws[other][3:]) == (rank // 2 == other // 2), "default per DP rank"


@pytest.mark.multiproc
@pytest.mark.slow
def test_dcp_with_the_planner_grows_from_2_ranks_to_4_as_the_explicit_mapping_does_or_refuses_typed(
    tmp_path: Path,
) -> None:
    run_ranks(_dcp_grow, 2, str(tmp_path), 2, "save")
    chosen = run_ranks(_dcp_grow, 4, str(tmp_path), 2, "planner")
    assert chosen == run_ranks(_dcp_grow, 4, str(tmp_path), 2, "load_from"), "the same saved ranks, the same numbers"
    assert len({tuple(d[:3]) for d in chosen}) == 2 and len({tuple(d[3:]) for d in chosen}) == 2
    refused = run_ranks(_dcp_grow, 4, str(tmp_path), 2, "strict")
    for rank, (kind, message, unchanged) in enumerate(refused):
        assert kind == "InvalidArgumentError" and unchanged
        if rank < 2:  # its own key is there, saved by another world size
            assert "saved under a different setup" in message
        else:
            assert f"no RNG state for rank_{rank} (it holds rank_0, rank_1); it was saved by another world size: " \
                "pass on_mismatch='reseed'" in message  # fmt: skip


def test_the_stateful_refuses_a_load_from_that_is_not_a_rank() -> None:
    with pytest.raises(ArgumentTypeError, match="load_from must be a saved rank"):
        RNGStateful(load_from=-1)
    with pytest.raises(ArgumentTypeError, match=r"load_from\(0\) must return a saved rank"):
        RNGStateful(load_from=lambda rank: "0").state_dict()  # type: ignore[arg-type, return-value]


class _TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.hidden(x))
        with get_rng_tracker().fork(MP):  # tensor-parallel dropout: each rank its own mask
            h = F.dropout(h, p=0.25)
        return self.head(F.dropout(h, p=0.1))  # replicated dropout: every rank the same mask


def _start(rank: int) -> tuple[dict[str, int], _TinyModel, torch.optim.Optimizer]:
    """What a job does at launch, whether it is a first run or a restart."""
    coords = {"tp": rank}
    apply_layout(TRAIN_LAYOUT, SEED, coords)
    random.seed(100 + rank)
    np.random.seed(200 + rank)
    model = _TinyModel()
    return coords, model, torch.optim.Adam(model.parameters(), lr=0.01)


def _train_step(model: _TinyModel, optimizer: torch.optim.Optimizer, world_size: int) -> float:
    import torch.distributed as dist

    x = torch.from_numpy(np.random.randn(4, 8).astype(np.float32))
    weight = 1.0 + random.random()
    loss = weight * model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad /= world_size
    optimizer.step()
    return loss.item()


def _params(model: torch.nn.Module) -> list[bytes]:
    return [p.detach().numpy().tobytes() for p in model.parameters()]


def _train_and_save(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """An uninterrupted run that also writes a checkpoint after step SAVE_AFTER."""
    with platforms.use(platforms.CPUPlatform()):
        coords, model, optimizer = _start(rank)
        losses = []
        for step in range(1, STEPS + 1):
            losses.append(_train_step(model, optimizer, world_size))
            if step == SAVE_AFTER:
                rng = rng_state_dict(layout=TRAIN_LAYOUT, coords=coords, base_seed=SEED)
                torch.save(rng, f"{directory}/rng-{rank}.pt")
                torch.save(
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f"{directory}/train-{rank}.pt"
                )
        return {"losses": losses, "params": _params(model)}


def _resume(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """New processes resume from the checkpoint: once without the RNG state, once with it."""
    from hyperrng.verify import verify_rng_sync

    out: dict[str, Any] = {}
    with platforms.use(platforms.CPUPlatform()):
        for restore_rng in (False, True):
            coords, model, optimizer = _start(rank)
            training = torch.load(f"{directory}/train-{rank}.pt", weights_only=True)
            model.load_state_dict(training["model"])
            optimizer.load_state_dict(training["optimizer"])
            if restore_rng:
                load_rng_state_dict(load_rng_state(f"{directory}/rng-{rank}.pt"), layout=TRAIN_LAYOUT, coords=coords)
            losses = [_train_step(model, optimizer, world_size) for _ in range(SAVE_AFTER, STEPS)]
            out["with_rng" if restore_rng else "without_rng"] = {"losses": losses, "params": _params(model)}
        out["streams_in_sync"] = [(v.stream, v.distinct_states) for v in verify_rng_sync(TRAIN_LAYOUT, coords)]
    return out


@pytest.mark.multiproc
def test_a_run_resumed_in_new_processes_is_bit_identical_to_an_uninterrupted_one(tmp_path: Path) -> None:
    uninterrupted = run_ranks(_train_and_save, 2, str(tmp_path))
    resumed = run_ranks(_resume, 2, str(tmp_path))
    assert uninterrupted[0]["losses"] != uninterrupted[1]["losses"], "each rank draws its own TP dropout masks"
    for rank in (0, 1):
        assert resumed[rank]["with_rng"]["losses"] == uninterrupted[rank]["losses"][SAVE_AFTER:]
        assert resumed[rank]["with_rng"]["params"] == uninterrupted[rank]["params"]
        assert resumed[rank]["without_rng"]["losses"] != uninterrupted[rank]["losses"][SAVE_AFTER:], (
            "without the RNG state the resumed run must differ, or this test could not tell"
        )
        assert resumed[rank]["streams_in_sync"] == [(DEFAULT_STREAM, 1), (MP, 2)]


_FRESH_PROCESS_RESUME = """
import sys, torch
import hyperrng.platforms as platforms
from hyperrng.portable import position as portable
from hyperrng.resume.state import load_rng_state, load_rng_state_dict, rng_state_dict, save_rng_state
from hyperrng.streams.tracker import MODEL_PARALLEL_STREAM as MP, get_rng_tracker
platforms.set_current(sys.argv[1])
path, role = sys.argv[2], sys.argv[3]
tracker = get_rng_tracker()
if role == "save":
    tracker.reseed({MP: 1234})
    with tracker.fork(MP):
        portable.uniform((5,))  # the stream moves to (1234, 8)
    save_rng_state(path, rng_state_dict())
    for k in range(1000):  # many other positions in between change nothing
        platforms.current().set_seed_offset(99, 4 * k)
else:
    load_rng_state_dict(load_rng_state(path))
with tracker.fork(MP):
    print(platforms.current().get_seed_offset(), portable.uniform((6,)).tolist())
"""


@pytest.mark.parametrize("name", ["cpu", "sim"])
def test_a_stream_position_resumes_exactly_in_a_fresh_process(name: str, tmp_path: Any) -> None:
    """A position is state kept beside the bytes: a new process has nothing else to recover it from."""
    import subprocess
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    path = str(tmp_path / "rng.pt")

    def run(role: str) -> str:
        out = subprocess.run(
            [sys.executable, "-c", _FRESH_PROCESS_RESUME, name, path, role],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.strip()

    uninterrupted = run("save")
    assert uninterrupted.startswith("(1234, 8) ")
    assert run("load") == uninterrupted


def test_capturing_inside_a_fork_is_refused() -> None:
    tracker = get_rng_tracker()
    tracker.reseed({MODEL_PARALLEL_STREAM: 3})
    with tracker.fork(MODEL_PARALLEL_STREAM):
        with pytest.raises(InvalidOperationError, match="inside a fork of stream 'model-parallel-rng'") as info:
            rng_state_dict()
    assert info.value.reason == "tracker" and not isinstance(info.value, ValueError)


@pytest.mark.needs_sim
@pytest.mark.parametrize("where", ["devices", "streams"])
@pytest.mark.parametrize("offset", [-4, 6, 2**63 - 1])
def test_a_counter_based_state_with_an_impossible_offset_is_refused_and_changes_nothing(
    where: str, offset: int
) -> None:
    with platforms.use(platforms.SimulatedPlatform()):
        tracker = seeded_tracker()
        state = rng_state_dict(tracker=tracker, layout=LAYOUT, coords=COORDS, base_seed=SEED)
        draw_everything(tracker)

        def forge(s: dict[str, Any]) -> None:
            forged = platforms.pack_counter_state(5, offset)
            if where == "devices":
                s["devices"][1] = forged
            else:
                s["streams"][MODEL_PARALLEL_STREAM] = forged

        error = expect_refusal(resealed(state, forge), tracker, f"offset {offset}")
        assert "multiples of 4" in str(error)


@pytest.mark.needs_sim
@pytest.mark.parametrize("offset", [-4, 6, 2**63 - 1])
def test_a_simulated_generator_refuses_a_state_no_device_can_have(offset: int) -> None:
    sim = platforms.SimulatedPlatform()
    sim.set_seed_offset(5, 8, 0)
    with pytest.raises(platforms.InvalidArgumentError, match="non-negative multiples of 4"):
        sim.set_rng_state(platforms.pack_counter_state(5, offset), 0)
    with pytest.raises(platforms.InvalidArgumentError, match="non-negative multiples of 4"):
        sim.default_generator(0).set_state(platforms.pack_counter_state(5, offset))
    assert sim.get_seed_offset(0) == (5, 8)
