"""The RNG checkpoint's format: its digest, and the checks that turn a saved dict into what
:func:`hyperrng.state.load_rng_state_dict` applies. Every check here reads; none changes a generator.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

import hyperrng.platforms as platforms
from hyperrng.errors import ArgumentTypeError, HyperRNGError, InvalidArgumentError
from hyperrng.layout import Derivation, StreamLayout, mesh_coordinates
from hyperrng.platforms.validate import MAX_SEED
from hyperrng.tracker import RNGStatesTracker

__all__ = ["FORMAT", "FORMAT_VERSION", "check_saved", "decode", "digest", "saved_derivation", "saved_layout"]

FORMAT = "hyperrng.rng_state"
FORMAT_VERSION = 2
"""Version 2: device states in the platform's own format (the CPU's carries its position
cursor), no separate position list, and no copy of torch's CPU state where the platform's
device is the host."""

_MT_WORDS = 624
_PY_STATE_WORDS = _MT_WORDS + 1  # CPython's MT19937: 624 words plus the position
_PY_STATE_VERSION = 3
_DIGEST_BYTES = 16


def check_saved(state: Mapping[str, Any]) -> None:
    """A mapping of this format and version whose digest matches its content, every top-level
    field present with its type and range (so later reads cannot fail halfway)."""
    if not isinstance(state, Mapping):
        raise ArgumentTypeError(
            f"an RNG state is the dict rng_state_dict() returned, got {type(state).__name__}; "
            f"load a saved one with hyperrng.load_rng_state(path)."
        )
    if state.get("format") != FORMAT:
        raise InvalidArgumentError(
            f"not a hyperrng RNG state (expected format {FORMAT!r}); pass the dict rng_state_dict() returned."
        )
    if state.get("version") != FORMAT_VERSION:
        raise InvalidArgumentError(
            f"RNG state format version {state.get('version')!r} cannot be read by this hyperrng, "
            f"which reads version {FORMAT_VERSION}; load it with the hyperrng release that wrote it."
        )
    try:
        expected = digest(state)
    except Exception as exc:
        raise InvalidArgumentError(f"the RNG state is malformed ({type(exc).__name__}: {exc}).") from exc
    if state.get("digest") != expected:
        raise InvalidArgumentError(
            "the RNG state's digest does not match its content: the file was modified or damaged; "
            "resume from another checkpoint."
        )
    _check_fields(state)


_METADATA_TYPES: dict[str, tuple[type, ...]] = {
    "platform": (str,),
    "rank": (int,),
    "world_size": (int,),
    "base_seed": (int, type(None)),
    "layout": (Mapping, type(None)),
    "coords": (Mapping, type(None)),
    "torch_cpu": (torch.Tensor, type(None)),
    "devices": (list, tuple),
    "streams": (Mapping,),
    "python": (Mapping,),
    "numpy": (Mapping,),
}


def _check_fields(state: Mapping[str, Any]) -> None:
    """Every top-level field present with its type, and the numbers among them in range."""
    for field, types in _METADATA_TYPES.items():
        if field not in state:
            raise _malformed(f"field {field!r} is missing.")
        value = state[field]
        if not isinstance(value, types) or isinstance(value, bool):
            expected = " or ".join(t.__name__ for t in types)
            raise _malformed(f"field {field!r} is a {type(value).__name__}, expected {expected}.")
    if state["base_seed"] is not None and not 0 <= state["base_seed"] <= MAX_SEED:
        raise _malformed(f"base_seed {state['base_seed']} is outside [0, 2**64 - 1].")
    if not 0 <= state["rank"] < state["world_size"]:
        raise _malformed(f"rank {state['rank']} does not lie in a world of size {state['world_size']}.")


def decode(state: Mapping[str, Any], p: platforms.Platform, tracker: RNGStatesTracker) -> dict[str, Any]:
    """Check every field's type, size and range and build the objects to apply; change nothing."""
    py_state = _python_state(state["python"])
    np_state = _numpy_state(state["numpy"])
    if p.device_type == "cpu":  # devices[0] carries torch's CPU state
        if state["torch_cpu"] is not None:
            raise _malformed("torch_cpu must be None on a platform whose device is the host.")
        cpu = None
    else:
        cpu = _tensor(state["torch_cpu"], torch.uint8, platforms.MT19937_STATE_NBYTES, "torch CPU state")
        try:
            torch.Generator().set_state(cpu)  # a scratch generator: refuses bytes MT19937 cannot take
        except RuntimeError as exc:
            raise _malformed(f"the torch CPU state is not a valid MT19937 state ({exc}).") from None
    devices = [_platform_state(p, d, f"device {i} state") for i, d in enumerate(state["devices"])]
    streams = {}
    for name, value in state["streams"].items():
        if not isinstance(name, str) or not name:
            raise _malformed(f"stream name {name!r} is not a non-empty string.")
        streams[name] = _platform_state(p, value, f"state of stream {name!r}")
    held = set(tracker.get_states()) if tracker.is_initialized() else set()
    missing = sorted(held - set(streams))
    if missing:
        raise InvalidArgumentError(
            f"the RNG state lacks stream(s) {missing} that the tracker holds; it was saved before they were "
            "added, or reset() the tracker to adopt the saved streams."
        )
    extra = sorted(set(streams) - held) if held else []
    if extra:
        raise InvalidArgumentError(
            f"the RNG state holds stream(s) {extra} that the tracker does not; add them first, "
            "or reset() the tracker to adopt the saved streams."
        )
    return {"python": py_state, "numpy": np_state, "cpu": cpu, "devices": devices, "streams": streams}


def saved_layout(state: Mapping[str, Any]) -> StreamLayout | None:
    """The layout the state records, rebuilt and checked, or ``None``."""
    if state["layout"] is None:
        return None
    try:
        return StreamLayout.from_dict(state["layout"])
    except HyperRNGError as exc:
        raise _malformed(f"its layout cannot be read ({exc})") from None


def saved_derivation(state: Mapping[str, Any]) -> Derivation | None:
    """The derivation the state records, checked; ``None`` when it lacks one of its three parts."""
    layout = saved_layout(state)
    if layout is None or state["coords"] is None or state["base_seed"] is None:
        return None
    try:
        coords = mesh_coordinates(state["coords"])
        layout.seeds(state["base_seed"], coords)  # the coordinates fit the layout
    except HyperRNGError as exc:
        raise _malformed(f"its coordinates do not fit its layout ({exc})") from None
    return Derivation(layout, state["base_seed"], {d: coords[d] for d in layout.dims})


def _malformed(detail: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"the RNG state is malformed: {detail}")


def _wrong(what: str, expected: str, got: object) -> InvalidArgumentError:
    return _malformed(f"{what} must be {expected}, got {got!r:.80}.")


def _exact_int(value: object, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise _wrong(what, f"an int in [{low}, {high}]", value)
    return value


def _fields(value: Mapping[str, Any], what: str, names: tuple[str, ...]) -> Mapping[str, Any]:
    """``value`` (a mapping: :func:`check_saved` checked) if its keys are ``names``; keys of any type are named."""
    if set(value) != set(names):
        raise _wrong(what, f"a mapping with exactly the keys {list(names)}", sorted(value, key=repr))
    return value


def _python_state(value: Mapping[str, Any]) -> tuple[int, tuple[int, ...], float | None]:
    """CPython's ``random`` state: version 3, 624 MT19937 words below 2**32 and a position in [0, 624]."""
    py = _fields(value, "the Python random state", ("version", "state", "gauss"))
    _exact_int(py["version"], "the Python random state version", _PY_STATE_VERSION, _PY_STATE_VERSION)
    words = _tensor(py["state"], torch.int64, _PY_STATE_WORDS, "the Python random state").tolist()
    if not all(0 <= w < 2**32 for w in words[:-1]) or not 0 <= words[-1] <= _MT_WORDS:
        raise _wrong("the Python random state", "624 words in [0, 2**32) then a position in [0, 624]", "out of range")
    gauss = py["gauss"]
    if gauss is not None and type(gauss) is not float:
        raise _wrong("the Python cached normal", "None or a float", gauss)
    return _PY_STATE_VERSION, tuple(words), gauss


def _numpy_state(value: Mapping[str, Any]) -> tuple[str, np.ndarray, int, int, float]:
    """NumPy's legacy MT19937 state: 624 words below 2**32, a position in [0, 624], a cached normal."""
    npy = _fields(value, "the NumPy state", ("kind", "keys", "pos", "has_gauss", "gauss"))
    if npy["kind"] != "MT19937":
        raise _wrong("the NumPy state's kind", "'MT19937'", npy["kind"])
    keys = _tensor(npy["keys"], torch.int64, _MT_WORDS, "the NumPy state keys")
    if bool(((keys < 0) | (keys >= 2**32)).any()):
        raise _wrong("the NumPy state keys", "624 words in [0, 2**32)", "out of range")
    # NumPy does not check the position: one past 624 reads outside its key array later.
    pos = _exact_int(npy["pos"], "the NumPy state position", 0, _MT_WORDS)
    has_gauss = _exact_int(npy["has_gauss"], "the NumPy has_gauss flag", 0, 1)
    gauss = npy["gauss"]
    if type(gauss) is not float or not math.isfinite(gauss):
        raise _wrong("the NumPy cached normal", "a finite float", gauss)
    return "MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, gauss


def _platform_state(p: platforms.Platform, value: object, what: str) -> torch.Tensor:
    state = _tensor(value, torch.uint8, p._state_nbytes, what)
    try:
        return p.check_rng_state(state).clone()
    except HyperRNGError as exc:
        raise _malformed(f"{what}: {exc}") from None


def digest(state: Mapping[str, Any]) -> str:
    """BLAKE2b over the state's canonical form, its own ``digest`` field left out."""
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
    if not isinstance(value, torch.Tensor):
        got = type(value).__name__
    elif value.dtype == dtype and value.dim() == 1 and value.numel() == numel and value.device.type == "cpu":
        return value.contiguous()
    else:
        got = f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    raise _malformed(f"{what} must be a 1-D {dtype} CPU tensor of {numel} elements, got {got}.")
