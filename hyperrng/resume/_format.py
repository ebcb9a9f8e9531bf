"""The RNG checkpoint's format: its digest, and the checks that turn a saved dict into what
:func:`hyperrng.resume.state.load_rng_state_dict` applies. Every check here reads; none changes a generator.
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
from hyperrng.platforms.cpu import check_mt19937_state, mt19937_degenerate
from hyperrng.platforms.validate import MAX_SEED
from hyperrng.seeding.layout import Derivation, StreamLayout, mesh_coordinates
from hyperrng.streams.tracker import RNGStatesTracker

__all__ = [
    "CONTAINERS",
    "FORMAT",
    "FORMAT_VERSION",
    "check_saved",
    "decode",
    "digest",
    "saved_derivation",
    "saved_layout",
]

FORMAT = "hyperrng.rng_state"
FORMAT_VERSION = 2
"""Version 2: device states in the platform's own format (the CPU's carries its position
cursor), no separate position list, and no copy of torch's CPU state where the platform's
device is the host."""

CONTAINERS: dict[tuple[str, ...], type] = {
    ("streams",): dict,
    ("coords",): dict,
    ("layout", "streams"): dict,
    ("devices",): list,
}
"""The containers of a saved state, by path, that the format writes even when empty (and that a reader of it
field by field, such as DCP's, which records no path for an empty one, must put back). ``resume_bases`` is not
one: None, or it holds the default stream; states saved before it existed lack it."""

_MT_WORDS = 624
_PY_STATE_WORDS = _MT_WORDS + 1  # CPython's MT19937: 624 words plus the position
_PY_STATE_VERSION = 3
_DIGEST_BYTES = 16


def check_saved(state: Mapping[str, Any]) -> None:
    """A mapping of this format and version whose digest matches its content, every top-level
    field present with its type and range (so later reads cannot fail halfway).

    Bounded work on any input: the digest visits each object once and refuses shared or cyclic
    references, nesting deeper and sizes larger than :func:`hyperrng.rng_state_dict` ever
    writes (see :func:`digest` for each limit), all counted before the work they bound, so a
    hostile state costs time linear in its size and no memory beyond what it holds; the layout
    is counted against :data:`hyperrng.seeding.layout.MAX_DIMS` and :data:`hyperrng.seeding.layout.MAX_STREAMS`
    before it is rebuilt. An exception that reading the state itself raises (a mapping that
    fetches its values, a time-out) passes through as itself.
    """
    if not isinstance(state, Mapping):
        raise ArgumentTypeError(
            f"an RNG state is the dict rng_state_dict() returned, got {type(state).__name__}; "
            f"load a saved one with hyperrng.load_rng_state(path)."
        )
    found = state.get("format")
    if type(found) is not str or found != FORMAT:
        raise InvalidArgumentError(
            f"not a hyperrng RNG state (expected format {FORMAT!r}); pass the dict rng_state_dict() returned."
        )
    version = state.get("version")
    if type(version) is not int or version != FORMAT_VERSION:
        shown = version if type(version) in (int, str) else f"of type {type(version).__name__}"
        raise InvalidArgumentError(
            f"RNG state format version {shown!r} cannot be read by this hyperrng, "
            f"which reads version {FORMAT_VERSION}; load it with the hyperrng release that wrote it."
        )
    expected = digest(state)
    saved = state.get("digest")
    if type(saved) is not str or saved != expected:
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
    saved_layout(state)  # compared with the current layout later: checked before anything compares it
    if state["coords"] is not None:
        try:
            mesh_coordinates(state["coords"])
        except HyperRNGError as exc:
            raise _malformed(f"its coordinates cannot be read ({exc})") from None
    _resume_bases(state)


def _resume_bases(state: Mapping[str, Any]) -> dict[str, int] | None:
    """The streams' own base seeds a resume re-derived them from (``resume_bases``; absent from
    states written before they were recorded), checked, or ``None``."""
    bases = state.get("resume_bases")
    if bases is None:
        return None
    if not isinstance(bases, Mapping) or not all(
        isinstance(name, str) and type(value) is int and 0 <= value <= MAX_SEED for name, value in bases.items()
    ):
        raise _malformed("resume_bases must map stream names to seeds in [0, 2**64 - 1].")
    return dict(bases)


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
            check_mt19937_state(cpu)  # on a scratch generator: bytes MT19937 cannot take, or the all-zero state
        except HyperRNGError as exc:
            raise _malformed(f"the torch CPU state: {exc}") from None
    devices = [_platform_state(p, d, f"device {i} state") for i, d in enumerate(state["devices"])]
    streams = {}
    for name, value in state["streams"].items():
        if not isinstance(name, str) or not name:
            raise _malformed(f"stream name {name!r} is not a non-empty string.")
        streams[name] = _platform_state(p, value, f"state of stream {name!r}")
    held = set(tracker._states) if tracker.is_initialized() else set()  # names only: no read of a generator
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
    return Derivation(layout, state["base_seed"], {d: coords[d] for d in layout.dims}, _resume_bases(state))


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
    _check_not_degenerate(words[:-1], "the Python random state")
    gauss = py["gauss"]
    if gauss is not None and (type(gauss) is not float or not math.isfinite(gauss)):
        raise _wrong("the Python cached normal", "None or a finite float", gauss)
    return _PY_STATE_VERSION, tuple(words), gauss


def _numpy_state(value: Mapping[str, Any]) -> tuple[str, np.ndarray, int, int, float]:
    """NumPy's legacy MT19937 state: 624 words below 2**32, a position in [0, 624], a cached normal."""
    npy = _fields(value, "the NumPy state", ("kind", "keys", "pos", "has_gauss", "gauss"))
    if type(npy["kind"]) is not str or npy["kind"] != "MT19937":
        raise _wrong("the NumPy state's kind", "'MT19937'", npy["kind"])
    keys = _tensor(npy["keys"], torch.int64, _MT_WORDS, "the NumPy state keys")
    if bool(((keys < 0) | (keys >= 2**32)).any()):
        raise _wrong("the NumPy state keys", "624 words in [0, 2**32)", "out of range")
    _check_not_degenerate(keys.tolist(), "the NumPy state keys")
    # NumPy does not check the position: one past 624 reads outside its key array later.
    pos = _exact_int(npy["pos"], "the NumPy state position", 0, _MT_WORDS)
    has_gauss = _exact_int(npy["has_gauss"], "the NumPy has_gauss flag", 0, 1)
    gauss = npy["gauss"]
    if type(gauss) is not float or not math.isfinite(gauss):
        raise _wrong("the NumPy cached normal", "a finite float", gauss)
    return "MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, gauss


def _check_not_degenerate(words: list[int], what: str) -> None:
    """Refuse the MT19937 state that is all zeros where it counts (the top bit of the first word and
    every other word): it draws 0 forever, and CPython and NumPy would take it."""
    if mt19937_degenerate(words):
        raise _malformed(
            f"{what} is the all-zero MT19937 state, which draws 0 forever; no generator reaches it, "
            "so the file was forged or damaged. Resume from another checkpoint."
        )


def _platform_state(p: platforms.Platform, value: object, what: str) -> torch.Tensor:
    state = _tensor(value, torch.uint8, p._state_nbytes, what)
    try:
        return p.check_rng_state(state).clone()
    except HyperRNGError as exc:
        raise _malformed(f"{what}: {exc}") from None


_MAX_DEPTH = 8
"""Nesting the digest follows: rng_state_dict writes four levels (state, layout, its streams, a
stream's dimensions); a checkpoint may hold the state one or two levels down."""
_MAX_OBJECTS = 1 << 18
"""Containers, tensors and values the digest visits: far above the streams and layout dimensions of
any real run (a state holds a few dozen), far below what would keep a load busy."""
_MAX_NUMEL = 1 << 20
"""Elements of one tensor: rng_state_dict's largest is a device state (5072 bytes on the CPU)."""
_MAX_TEXT = 1 << 16
"""Characters of one string (a stream, dimension or platform name)."""
_MAX_TEXT_TOTAL = 1 << 22
"""Characters of text the digest reads in all, keys included, a string counted each time it is
reached (a file may refer to one string from many places): a state's names total a few
thousand characters, and :data:`hyperrng.seeding.layout.MAX_STREAMS` streams with names of 1,000
characters, each name written three times (layout, streams, resume bases), about three million."""
_MAX_TENSOR_BYTES = 1 << 28
"""Bytes of tensor data the digest reads in all (256 MiB): rng_state_dict writes a device state
per device and per stream, 5072 bytes each on the CPU and 16 on a counter-based device, so
even 10,000 streams on the CPU stay below 51 MiB."""
_INT_RANGE = (-(2**63), 2**64 - 1)
"""Every integer rng_state_dict writes is a seed, a rank, a coordinate or a 64-bit domain."""


def digest(state: Mapping[str, Any]) -> str:
    """BLAKE2b over the state's canonical form, its own ``digest`` field left out.

    Raises:
        InvalidArgumentError: the state holds what :func:`hyperrng.rng_state_dict` never writes:
            one object reached twice (shared or cyclic references), nesting deeper than
            :data:`_MAX_DEPTH`, more than :data:`_MAX_OBJECTS` objects, a tensor that is not a
            dense CPU tensor of at most :data:`_MAX_NUMEL` elements (a view whose elements repeat
            or overlap, such as one ``expand`` made, or two tensors over one storage), more than
            :data:`_MAX_TENSOR_BYTES` bytes of tensors, a string longer than :data:`_MAX_TEXT`
            or more than :data:`_MAX_TEXT_TOTAL` characters of text in all, a key that is not a
            string, an integer out of bounds, or an object of another type. Each object is
            visited once and each limit is checked before the work it bounds (a view is refused
            from its strides, before any of its elements is read), so the time is linear in the
            state's size and the digest copies no tensor.
    """
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    _Digest(h).feed({k: v for k, v in state.items() if k != "digest"}, 0)
    return h.hexdigest()


class _Digest:
    """One walk of :func:`digest`: what it has visited, and how much."""

    def __init__(self, h: Any) -> None:
        self.h = h
        self.seen: set[int] = set()
        self.held: list[object] = []  # keeps every visited object alive, so no id can be reused mid-walk
        self.count = 0
        self.text = 0  # characters read, each string counted every time it is reached
        self.tensor_bytes = 0
        self.storages: set[int] = set()  # the data pointers of the tensors' storages, each read once

    def feed(self, value: Any, depth: int) -> None:
        """Hash ``value`` canonically: dict keys sorted, tensors by dtype, shape and bytes."""
        h = self.h
        self.count += 1
        if self.count > _MAX_OBJECTS:
            raise _malformed(f"it holds more than {_MAX_OBJECTS} objects, far more than rng_state_dict writes.")
        if isinstance(value, (Mapping, list, tuple, torch.Tensor)):
            self._visit(value, depth)
        if isinstance(value, Mapping):
            keys = list(value)
            if not all(type(key) is str for key in keys):
                odd = next(key for key in keys if type(key) is not str)
                raise _malformed(f"it has a key of type {type(odd).__name__}; rng_state_dict writes string keys only.")
            h.update(b"{")
            for key in sorted(keys):
                self._text(key)
                h.update(repr(key).encode())
                self.feed(value[key], depth + 1)
            h.update(b"}")
        elif isinstance(value, (list, tuple)):
            h.update(b"[")
            for item in value:
                self.feed(item, depth + 1)
            h.update(b"]")
        elif isinstance(value, torch.Tensor):
            t = self._dense(value)
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():  # the bytes in place: a dense tensor is hashed without a copy
                h.update(t.reshape(-1).view(torch.uint8).numpy())
        elif value is None or type(value) in (bool, float) or self._atom(value):
            h.update(f"{type(value).__name__}:{value!r};".encode())
        else:
            raise _malformed(f"it holds a {type(value).__name__}, which rng_state_dict never writes.")

    def _visit(self, value: object, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise _malformed(f"it is nested more than {_MAX_DEPTH} levels deep; rng_state_dict writes four.")
        if isinstance(value, torch.Tensor) or len(value):  # type: ignore[arg-type]  # empty ones cannot multiply work
            if id(value) in self.seen:
                raise _malformed(
                    "it reaches one object twice (shared or cyclic references), which rng_state_dict never "
                    "writes; a forged file could make the digest walk it exponentially often."
                )
            self.seen.add(id(value))
            self.held.append(value)

    def _atom(self, value: object) -> bool:
        if type(value) is int:
            if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:  # type: ignore[operator]
                raise _malformed(f"it holds an integer of {value.bit_length()} bits; rng_state_dict's fit in 64.")  # type: ignore[attr-defined]
            return True
        if type(value) is str:
            self._text(value)
            return True
        return False

    def _text(self, value: str) -> None:
        if len(value) > _MAX_TEXT:
            raise _malformed(f"it holds a string of {len(value)} characters; rng_state_dict's names are short.")
        self.text += len(value)
        if self.text > _MAX_TEXT_TOTAL:
            raise _malformed(
                f"it holds more than {_MAX_TEXT_TOTAL} characters of text in all (a string counted each time it "
                "is reached); rng_state_dict's names total a few thousand."
            )

    def _dense(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` detached, if it is a dense CPU tensor of its own elements within the limits;
        read from its metadata only (a view's elements are never materialised)."""
        if value.layout != torch.strided or value.is_quantized or value.is_nested or value.device.type != "cpu":
            raise _malformed(
                f"it holds a {value.layout} tensor on {value.device}; rng_state_dict writes dense CPU tensors only."
            )
        if value.numel() > _MAX_NUMEL:
            raise _malformed(f"it holds a tensor of {value.numel()} elements; rng_state_dict's have at most 5072.")
        if not value.is_contiguous() or value.is_conj() or value.is_neg():
            raise _malformed(
                f"it holds a view of shape {tuple(value.shape)} with strides {value.stride()} (elements that repeat, "
                "overlap or are skipped, as expand() makes) or a lazily conjugated or negated tensor; rng_state_dict "
                "writes dense tensors, each element stored once."
            )
        nbytes = value.numel() * value.element_size()
        if nbytes:
            storage = value.untyped_storage().data_ptr()
            if storage in self.storages:
                raise _malformed(
                    "two of its tensors share one storage (views of one buffer), which rng_state_dict never writes; "
                    "a forged file could make the digest read one buffer many times."
                )
            self.storages.add(storage)
            self.tensor_bytes += nbytes
            if self.tensor_bytes > _MAX_TENSOR_BYTES:
                raise _malformed(
                    f"its tensors hold more than {_MAX_TENSOR_BYTES} bytes in all; rng_state_dict writes a few "
                    "kilobytes per stream and device."
                )
        return value.detach()


def _tensor(value: object, dtype: torch.dtype, numel: int, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        got = type(value).__name__
    elif (
        value.dtype == dtype
        and value.dim() == 1
        and value.numel() == numel
        and value.device.type == "cpu"
        and value.layout == torch.strided
    ):
        return value.contiguous()
    else:
        got = f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    raise _malformed(f"{what} must be a 1-D {dtype} CPU tensor of {numel} elements, got {got}.")
