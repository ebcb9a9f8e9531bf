"""RNG checkpoints for exact resume: every generator of this rank, in one plain dict.

:func:`rng_state_dict` captures Python's ``random``, NumPy's legacy global state, torch's
CPU generator, every device of the current platform, the tracker's streams, and metadata
(format version, platform, base seed, layout, this rank's coordinates, rank and world
size). It holds only tensors, numbers, strings, ``None``, lists and dicts, so
``torch.load(path, weights_only=True)`` reads it, and it carries a BLAKE2b digest of its
content so a tampered or damaged state is refused instead of silently resumed.

:func:`load_rng_state_dict` validates everything before applying anything. A state saved
under another platform, world size, rank, layout or mesh position is refused by default;
``on_mismatch="reseed"`` instead re-derives every stream from the base seed and the
*current* layout and coordinates, seeds the host generators from the default stream, and
warns that the run continues reproducibly but not bit-identically.

:class:`RNGStateful` wraps both for ``torch.distributed.checkpoint``: it keys the state by
rank, so DCP never deduplicates one rank's state onto another.
"""

from __future__ import annotations

import hashlib
import random
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

import platforms
from hyperrng.errors import CheckpointError, HyperRNGError
from hyperrng.layout import DEFAULT_STREAM, StreamLayout, mesh_coordinates
from hyperrng.tracker import RNGStatesTracker, get_rng_tracker
from platforms.validate import check_offset, check_seed

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ON_MISMATCH",
    "RNGResumeWarning",
    "RNGStateful",
    "rng_state_dict",
    "load_rng_state_dict",
    "save_rng_state",
    "load_rng_state",
]

FORMAT = "hyperrng.rng_state"
FORMAT_VERSION = 1
ON_MISMATCH = ("error", "reseed")

_PY_STATE_WORDS = 625  # CPython's MT19937: 624 words plus the position
_NP_KEY_WORDS = 624
_DIGEST_BYTES = 16


class RNGResumeWarning(UserWarning):
    """A resume that continues reproducibly but not bit-identically (streams were re-derived)."""


# -- capture --------------------------------------------------------------------------------
def rng_state_dict(
    *,
    tracker: RNGStatesTracker | None = None,
    layout: StreamLayout | None = None,
    coords: Mapping[str, int] | object | None = None,
    base_seed: int | None = None,
    group: object | None = None,
) -> dict[str, Any]:
    """Capture every RNG state of this rank, with the metadata needed to check a resume.

    Args:
        tracker: whose streams to save (default: the process-wide tracker).
        layout, coords, base_seed: the stream layout, this rank's coordinates and the base
            seed the streams came from; stored so a resume can be checked (and, on
            request, re-derived). Optional, but ``on_mismatch="reseed"`` needs all three.
        group: the process group whose rank and size are recorded (default: the world).
    """
    p = platforms.current()
    tracker = tracker if tracker is not None else get_rng_tracker()
    if tracker.active_stream is not None:
        # The device generator holds the stream now, not the default state a resume needs.
        raise CheckpointError(
            f"cannot capture the RNG state inside a fork of stream {tracker.active_stream!r}; "
            "capture it outside any fork."
        )
    py_version, py_words, py_gauss = random.getstate()
    np_state: Any = np.random.get_state(legacy=True)  # the legacy 5-tuple, not the dict form
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np_state
    body: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "platform": p.name,
        "rank": p.rank(group),
        "world_size": p.world_size(group),
        "base_seed": base_seed,
        "layout": layout.to_dict() if layout is not None else None,
        "coords": dict(mesh_coordinates(coords)) if coords is not None else None,
        "python": {"version": py_version, "state": torch.tensor(py_words, dtype=torch.int64), "gauss": py_gauss},
        "numpy": {
            "kind": np_kind,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch_cpu": torch.get_rng_state(),
        "devices": [p.get_rng_state(i) for i in range(p.device_count())],
        # Where positions are modelled (the CPU) the bytes alone do not say the (seed, offset).
        "positions": [list(p.get_seed_offset(i)) for i in range(p.device_count())],
        "streams": tracker.get_states(as_tensors=True) if tracker.is_initialized() else {},
    }
    body["digest"] = _digest(body)
    return body


# -- restore --------------------------------------------------------------------------------
def load_rng_state_dict(
    state: Mapping[str, Any],
    *,
    tracker: RNGStatesTracker | None = None,
    layout: StreamLayout | None = None,
    coords: Mapping[str, int] | object | None = None,
    on_mismatch: str = "error",
    group: object | None = None,
) -> None:
    """Restore a state from :func:`rng_state_dict`; validate everything, then apply.

    Args:
        state: the dict :func:`rng_state_dict` returned (possibly through ``torch.load``).
        tracker: the tracker to restore (default: the process-wide one).
        layout, coords: the current stream layout and this rank's coordinates; when given,
            they must match the saved ones.
        on_mismatch: ``"error"`` (default) refuses a state saved under another platform,
            world size, rank, layout or coordinates; ``"reseed"`` re-derives the streams
            from the saved base seed with ``layout`` and ``coords`` and warns
            (:class:`RNGResumeWarning`).
        group: the process group whose rank and size are checked (default: the world).

    Raises:
        CheckpointError: another format or version, a digest mismatch (tampered or damaged),
            a malformed field, a topology or platform mismatch, or a missing stream.
            Nothing has changed when it is raised.
    """
    if on_mismatch not in ON_MISMATCH:
        raise CheckpointError(f"on_mismatch must be one of {ON_MISMATCH}, got {on_mismatch!r}.")
    tracker = tracker if tracker is not None else get_rng_tracker()
    if tracker.active_stream is not None:
        # The fork's exit would restore the state it saved before this load, losing both.
        raise CheckpointError(
            f"cannot load an RNG state inside a fork of stream {tracker.active_stream!r}; load it outside any fork."
        )
    _check_envelope(state)
    _check_metadata(state)
    p = platforms.current()
    mismatches = _mismatches(state, p, layout, coords, group)
    if mismatches:
        if on_mismatch == "error":
            raise CheckpointError(
                "the RNG state was saved under a different setup: "
                + "; ".join(mismatches)
                + ". Resume with the same setup, or pass on_mismatch='reseed' (with layout and coords) "
                "to re-derive the streams from the saved base seed."
            )
        _reseed(state, tracker, layout, coords, mismatches)
        return
    applied = _decode(state, p, tracker)
    _apply(applied, p, tracker)


def _check_envelope(state: Mapping[str, Any]) -> None:
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        raise CheckpointError(
            f"not a hyperrng RNG state (expected format {FORMAT!r}); pass the dict rng_state_dict() returned."
        )
    if state.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"RNG state format version {state.get('version')!r} cannot be read by this hyperrng, "
            f"which reads version {FORMAT_VERSION}; load it with the hyperrng release that wrote it."
        )
    try:
        digest = _digest(state)
    except Exception as exc:
        raise CheckpointError(f"the RNG state is malformed ({type(exc).__name__}: {exc}).") from exc
    if state.get("digest") != digest:
        raise CheckpointError(
            "the RNG state's digest does not match its content: the file was modified or damaged; "
            "resume from another checkpoint."
        )


_METADATA_TYPES: dict[str, tuple[type, ...]] = {
    "platform": (str,),
    "rank": (int,),
    "world_size": (int,),
    "base_seed": (int, type(None)),
    "layout": (Mapping, type(None)),
    "coords": (Mapping, type(None)),
    "devices": (list, tuple),
    "positions": (list, tuple),
    "streams": (Mapping,),
    "python": (Mapping,),
    "numpy": (Mapping,),
}


def _check_metadata(state: Mapping[str, Any]) -> None:
    """Every top-level field present with its type, so later reads cannot fail halfway."""
    for field, types in _METADATA_TYPES.items():
        if field not in state:
            raise CheckpointError(f"the RNG state is malformed: field {field!r} is missing.")
        value = state[field]
        if not isinstance(value, types) or isinstance(value, bool):
            raise CheckpointError(
                f"the RNG state is malformed: field {field!r} is a {type(value).__name__}, "
                f"expected {' or '.join(t.__name__ for t in types)}."
            )


def _mismatches(
    state: Mapping[str, Any], p: platforms.Platform, layout: StreamLayout | None, coords: object, group: object
) -> list[str]:
    found = []
    if state["platform"] != p.name:
        found.append(f"platform {state['platform']!r} (now {p.name!r})")
    if state["world_size"] != p.world_size(group):
        found.append(f"world size {state['world_size']} (now {p.world_size(group)})")
    elif state["rank"] != p.rank(group):
        found.append(f"rank {state['rank']} (now {p.rank(group)})")
    if state["platform"] == p.name and len(state["devices"]) != p.device_count():
        found.append(f"{len(state['devices'])} device(s) (now {p.device_count()})")
    if layout is not None and state["layout"] is not None and state["layout"] != layout.to_dict():
        found.append("a different stream layout")
    if coords is not None and state["coords"] is not None and state["coords"] != dict(mesh_coordinates(coords)):
        found.append(f"mesh coordinates {state['coords']} (now {dict(mesh_coordinates(coords))})")
    return found


def _decode(state: Mapping[str, Any], p: platforms.Platform, tracker: RNGStatesTracker) -> dict[str, Any]:
    """Check every field's type and size and build the objects to apply; change nothing."""
    try:
        py = state["python"]
        py_words = _tensor(py["state"], torch.int64, _PY_STATE_WORDS, "python state")
        py_state = (int(py["version"]), tuple(int(w) for w in py_words.tolist()), py["gauss"])
        npy = state["numpy"]
        np_keys = _tensor(npy["keys"], torch.int64, _NP_KEY_WORDS, "numpy keys").numpy().astype(np.uint32)
        np_state = (str(npy["kind"]), np_keys, int(npy["pos"]), int(npy["has_gauss"]), float(npy["gauss"]))
        cpu = _tensor(state["torch_cpu"], torch.uint8, torch.get_rng_state().numel(), "torch CPU state")
        devices = [_tensor(d, torch.uint8, p.state_nbytes, f"device {i} state") for i, d in enumerate(state["devices"])]
        for d in devices:
            p.check_rng_state(d)
        positions = [(check_seed(s), check_offset(o)) for s, o in state["positions"]]
        if len(positions) != len(devices):
            raise CheckpointError(f"the RNG state is malformed: {len(positions)} positions for {len(devices)} devices.")
        streams = dict(state["streams"])
        if py_state[2] is not None and not isinstance(py_state[2], float):
            raise CheckpointError(
                f"the RNG state is malformed: the Python cached normal must be None or a float, got {py_state[2]!r}."
            )
        # Apply each value to a scratch generator first: the real ones must not be half-written.
        random.Random().setstate(py_state)
        np.random.RandomState().set_state(np_state)
        torch.Generator().set_state(cpu)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, OverflowError, HyperRNGError) as exc:
        # (InvalidSeedError/InvalidOffsetError of a bad position are ValueErrors too.)
        raise CheckpointError(f"the RNG state is malformed ({type(exc).__name__}: {exc}).") from exc
    held = set(tracker.get_states()) if tracker.is_initialized() else set()
    missing = sorted(held - set(streams))
    if missing:
        raise CheckpointError(
            f"the RNG state lacks stream(s) {missing} that the tracker holds; it was saved before they were "
            "added, or reset() the tracker to adopt the saved streams."
        )
    extra = sorted(set(streams) - held) if held else []
    if extra:
        raise CheckpointError(
            f"the RNG state holds stream(s) {extra} that the tracker does not; add them first, "
            "or reset() the tracker to adopt the saved streams."
        )
    return {
        "python": py_state,
        "numpy": np_state,
        "cpu": cpu,
        "devices": devices,
        "positions": positions,
        "streams": streams,
    }


def _apply(decoded: dict[str, Any], p: platforms.Platform, tracker: RNGStatesTracker) -> None:
    # The tracker validates its entries before applying any; everything else was checked
    # in _decode, so nothing below can fail halfway.
    if decoded["streams"]:
        try:
            tracker.set_states(decoded["streams"])
        except HyperRNGError as exc:
            raise CheckpointError(f"the saved streams do not fit the tracker: {exc}") from exc
    for i, (s, (seed, offset)) in enumerate(zip(decoded["devices"], decoded["positions"])):
        p.set_seed_offset(seed, offset, i)  # makes a modelled position known again; the bytes follow
        p.set_rng_state(s, i)
    torch.set_rng_state(decoded["cpu"])
    np.random.set_state(decoded["numpy"])
    random.setstate(decoded["python"])


def _reseed(
    state: Mapping[str, Any],
    tracker: RNGStatesTracker,
    layout: StreamLayout | None,
    coords: object,
    mismatches: list[str],
) -> None:
    from hyperrng.seeding import seed_host

    base_seed = state.get("base_seed")
    if layout is None or coords is None or base_seed is None:
        raise CheckpointError(
            "on_mismatch='reseed' needs the saved base seed and the current layout and coords; "
            f"the state has base_seed={base_seed!r}, and layout/coords were "
            f"{'given' if layout is not None and coords is not None else 'not given'}."
        )
    seeds = layout.seeds(base_seed, coords)  # validates before anything changes
    layout.seed_tracker(tracker, base_seed, coords)
    seed_host(seeds[DEFAULT_STREAM])
    warnings.warn(
        "RNG state saved under a different setup (" + "; ".join(mismatches) + "): streams re-derived from "
        f"base seed {base_seed} for the current layout; the run continues reproducibly but not bit-identically.",
        RNGResumeWarning,
        stacklevel=3,
    )


# -- files --------------------------------------------------------------------------------------
def save_rng_state(path: str | Path, state: Mapping[str, Any]) -> None:
    """Write a state from :func:`rng_state_dict` to ``path`` with ``torch.save``."""
    torch.save(dict(state), path)


def load_rng_state(path: str | Path) -> dict[str, Any]:
    """Read a state written by :func:`save_rng_state`, with ``weights_only=True``.

    Raises:
        CheckpointError: the file is missing, truncated, or not a torch file of plain data.
    """
    try:
        loaded = torch.load(path, weights_only=True)
    except FileNotFoundError as exc:
        raise CheckpointError(f"no RNG state at {str(path)!r}.") from exc
    except Exception as exc:
        raise CheckpointError(
            f"could not read the RNG state at {str(path)!r} ({type(exc).__name__}: {exc}); "
            "the file is truncated or not written by save_rng_state."
        ) from exc
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{str(path)!r} holds a {type(loaded).__name__}, not an RNG state dict.")
    return loaded


# -- torch.distributed.checkpoint ------------------------------------------------------------
class RNGStateful:
    """A ``torch.distributed.checkpoint`` ``Stateful`` holding this rank's RNG state.

    The state is stored under a key naming the rank (``"rank_3"``), so DCP, which merges
    equal keys across ranks, keeps every rank's own state::

        dcp.save({"model": model, "rng": RNGStateful(layout=layout, coords=coords, base_seed=seed)}, ...)

    Arguments are those of :func:`rng_state_dict` and :func:`load_rng_state_dict`.
    """

    def __init__(
        self,
        *,
        tracker: RNGStatesTracker | None = None,
        layout: StreamLayout | None = None,
        coords: Mapping[str, int] | object | None = None,
        base_seed: int | None = None,
        on_mismatch: str = "error",
        group: object | None = None,
    ) -> None:
        self._tracker = tracker
        self._layout = layout
        self._coords = coords
        self._group = group
        self._base_seed = base_seed
        self._on_mismatch = on_mismatch

    def _key(self) -> str:
        return f"rank_{platforms.current().rank(self._group)}"

    def state_dict(self) -> dict[str, Any]:
        state = rng_state_dict(
            tracker=self._tracker,
            layout=self._layout,
            coords=self._coords,
            base_seed=self._base_seed,
            group=self._group,
        )
        return {self._key(): state}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        key = self._key()
        if key not in state_dict:
            raise CheckpointError(
                f"the checkpoint has no RNG state for {key} (it has {sorted(state_dict)}); "
                "it was saved with a different world size."
            )
        load_rng_state_dict(
            state_dict[key],
            tracker=self._tracker,
            layout=self._layout,
            coords=self._coords,
            on_mismatch=self._on_mismatch,
            group=self._group,
        )


def _digest(state: Mapping[str, Any]) -> str:
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    _feed(h, {k: v for k, v in state.items() if k != "digest"})
    return h.hexdigest()


def _feed(h: Any, value: Any) -> None:
    """Hash ``value`` canonically: dict keys sorted, tensors by dtype, shape and bytes."""
    if isinstance(value, Mapping):
        h.update(b"{")
        for key in sorted(value, key=str):
            h.update(repr(key).encode())
            _feed(h, value[key])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for item in value:
            _feed(h, item)
        h.update(b"]")
    elif isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    else:
        h.update(f"{type(value).__name__}:{value!r};".encode())


def _tensor(value: object, dtype: torch.dtype, numel: int, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != dtype or value.dim() != 1 or value.numel() != numel:
        got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise CheckpointError(f"{what} must be a 1-D {dtype} tensor of {numel} elements, got {got}.")
    return value.to("cpu")
