"""RNG checkpoints for exact resume: every generator of this rank, in one plain dict.

:func:`rng_state_dict` captures Python's ``random``, NumPy's legacy global state, torch's
CPU generator, every device of the current platform, the tracker's streams, and metadata
(format version, platform, base seed, layout, this rank's coordinates, rank and world
size). Where :func:`hyperrng.apply_layout` seeded the streams, the base seed, layout and
coordinates are recorded without being asked for
(:func:`hyperrng.layout.recorded_derivation`), so any such checkpoint can be resumed at
another world size. It holds only tensors, numbers, strings, ``None``, lists and dicts, so
``torch.load(path, weights_only=True)`` reads it (that loader runs no code), and it carries
a BLAKE2b digest of its content so that a damaged state (a truncated or corrupted file) is
refused instead of silently resumed.

**Trust.** The digest is not keyed: it detects accidental damage, not forgery (anyone who
edits the dict can recompute it). Every field is nevertheless typed and bounded before
anything is applied, so a forged state can at worst resume other random numbers, never
crash the process or leave a generator half-written. Sign the file yourself if it crosses
a trust boundary.

:func:`load_rng_state_dict` validates everything before applying anything. A state saved
under another platform, world size, rank, layout or mesh position is refused by default;
``on_mismatch="reseed"`` instead re-derives every stream from the *current* layout and
coordinates (those given, else those :func:`hyperrng.apply_layout` last gave the tracker,
else the saved layout) and from :func:`resume_seed`: the saved base seed mixed with the
saved progress of the default stream, so the resumed run never replays the numbers of its
first steps. It seeds the host generators from the default stream, and warns that the run
continues reproducibly but not bit-identically.

:class:`RNGStateful` wraps both for ``torch.distributed.checkpoint``: it keys the state by
rank, so DCP never deduplicates one rank's state onto another.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import random
import secrets
import socket
import stat
import warnings
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hyperrng.platforms as platforms
from hyperrng._device_state import device_keys
from hyperrng._exclusive import holding
from hyperrng._state_format import FORMAT, FORMAT_VERSION, check_saved, decode, digest, saved_derivation, saved_layout
from hyperrng.errors import ArgumentTypeError, HyperRNGError, InvalidArgumentError, InvalidOperationError
from hyperrng.layout import DEFAULT_STREAM, Derivation, StreamLayout, _record, mesh_coordinates, recorded_derivation
from hyperrng.platforms.mix import combine64
from hyperrng.platforms.validate import check_instance, check_seed, error_gist
from hyperrng.tracker import RNGStatesTracker, resolve_tracker

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ON_MISMATCH",
    "RESUME_DOMAIN",
    "RNGResumeWarning",
    "RNGStateful",
    "rng_state_dict",
    "load_rng_state_dict",
    "save_rng_state",
    "load_rng_state",
    "resume_seed",
]

ON_MISMATCH = ("error", "reseed")

RESUME_DOMAIN = 0x524553554D453031  # "RESUME01": keeps resume seeds apart from other uses of combine64
"""First value mixed into every :func:`resume_seed`."""

_TEMP_NAME_BYTES = 8  # random hex in a temporary file's name: concurrent saves never share one
# A temporary file's name also says which host and process wrote it, so that a later save can
# tell the files of saves that were killed (their process has ended) from those still being written.
_HOST_TAG = f"{zlib.crc32(socket.gethostname().encode()):08x}"


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
            request, re-derived). Where :func:`hyperrng.apply_layout` seeded the
            tracker, those not given are taken from that derivation (when the given ones
            agree with it), so they need not be passed.
        group: the process group whose rank and size are recorded (default: the world).

    Returns:
        Plain data (tensors, numbers, strings, lists, dicts) with its digest; see the module docstring.

    Raises:
        InvalidOperationError: inside a fork of the tracker (``reason`` ``"tracker"``).
        InvalidArgumentError: a base seed or coordinate out of range.
        ArgumentTypeError: ``layout`` is not a :class:`~hyperrng.layout.StreamLayout`.
    """
    p = platforms.current()
    # The device generator holds the stream inside a fork, not the default state a resume needs.
    tracker = _idle_tracker(tracker, layout, "capture the RNG state")
    if base_seed is not None:
        base_seed = check_seed(base_seed, "base_seed")  # a NumPy integer is stored as a plain int
    point = dict(mesh_coordinates(coords)) if coords is not None else None
    recorded = recorded_derivation(tracker)
    if recorded is not None and _agrees(recorded, layout, point, base_seed):
        layout = recorded.layout if layout is None else layout
        point = dict(recorded.coords) if point is None else point
        base_seed = recorded.base_seed if base_seed is None else base_seed
    py_version, py_words, py_gauss = random.getstate()
    np_state: Any = np.random.get_state(legacy=True)  # the legacy 5-tuple, not the dict form
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np_state
    body: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "platform": p.name,
        "rank": platforms.comm.rank(group),
        "world_size": platforms.comm.world_size(group),
        "base_seed": base_seed,
        "layout": layout.to_dict() if layout is not None else None,
        "coords": point,
        "python": {"version": py_version, "state": torch.tensor(py_words, dtype=torch.int64), "gauss": py_gauss},
        "numpy": {
            "kind": np_kind,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        # Where the platform's device is the host, devices[0] already holds torch's CPU state.
        "torch_cpu": None if p.device_type == "cpu" else torch.get_rng_state(),
        "devices": [p.get_rng_state(i) for i in range(p.device_count())],
        "streams": tracker.get_states(as_tensors=True) if tracker.is_initialized() else {},
    }
    body["digest"] = digest(body)
    return body


def _idle_tracker(tracker: RNGStatesTracker | None, layout: StreamLayout | None, what: str) -> RNGStatesTracker:
    """The tracker to use, refused inside a fork; ``layout`` checked to be a layout or ``None``."""
    chosen = resolve_tracker(tracker)
    if layout is not None:
        check_instance(layout, StreamLayout, "layout")
    if chosen.active_stream is not None and not chosen._abandoned():  # abandoned: get/set_states decide
        verb = what.split()[0]
        raise InvalidOperationError(
            f"cannot {what} inside a fork of stream {chosen.active_stream!r}; {verb} it outside any fork.",
            reason="tracker",
        )
    return chosen


def _agrees(recorded: Derivation, layout: StreamLayout | None, point: dict[str, int] | None, base: int | None) -> bool:
    """Whether the values given explicitly (``None``: not given) match the recorded derivation."""
    return (
        (layout is None or layout == recorded.layout)
        and (base is None or base == recorded.base_seed)
        and (point is None or all(point.get(d) == c for d, c in recorded.coords.items()))
    )


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
            (:class:`RNGResumeWarning`). Not given, they are those
            :func:`hyperrng.apply_layout` last gave ``tracker`` in this process (the
            layout falls back to the saved one).
        group: the process group whose rank and size are checked (default: the world).

    Raises:
        InvalidArgumentError: another format or version, a digest mismatch (a damaged state),
            a malformed field, a topology or platform mismatch, or a missing stream.
            Nothing has changed when it is raised.
        InvalidOperationError: inside a fork of the tracker (``reason`` ``"tracker"``), or
            another thread holds torch's CPU generator or a device's (in a fork, a region, ...;
            see :mod:`hyperrng._exclusive`); nothing has changed.
    """
    if not isinstance(on_mismatch, str):
        raise ArgumentTypeError(
            f"on_mismatch must be one of the strings {ON_MISMATCH}, got {type(on_mismatch).__name__} {on_mismatch!r}."
        )
    if on_mismatch not in ON_MISMATCH:
        raise InvalidArgumentError(f"on_mismatch must be one of {ON_MISMATCH}, got {on_mismatch!r}.")
    # Inside a fork, the fork's exit would restore the state it saved before this load, losing both.
    tracker = _idle_tracker(tracker, layout, "load an RNG state")
    check_saved(state)
    p = platforms.current()
    mismatches = _mismatches(state, p, layout, coords, group)
    if mismatches:
        if on_mismatch == "error":
            raise InvalidArgumentError(
                "the RNG state was saved under a different setup: "
                + "; ".join(mismatches)
                + ". Resume with the same setup, or pass on_mismatch='reseed' (with layout and coords) "
                "to re-derive the streams from the saved base seed."
            )
        with holding(device_keys(p), "load_rng_state_dict"):
            _reseed(state, tracker, layout, coords, mismatches)
        return
    applied = decode(state, p, tracker)
    derivation = saved_derivation(state)
    # Held while every state is written: another thread's fork or region refuses the load
    # (nothing written), and none starts halfway through it.
    with holding(device_keys(p), "load_rng_state_dict"):
        _apply(applied, p, tracker)
    _record(tracker, derivation)  # the next checkpoint carries the derivation on (or none, if it had none)


def _mismatches(
    state: Mapping[str, Any], p: platforms.Platform, layout: StreamLayout | None, coords: object, group: object
) -> list[str]:
    found = []
    if state["platform"] != p.name:
        found.append(f"platform {state['platform']!r} (now {p.name!r})")
    if state["world_size"] != platforms.comm.world_size(group):
        found.append(f"world size {state['world_size']} (now {platforms.comm.world_size(group)})")
    elif state["rank"] != platforms.comm.rank(group):
        found.append(f"rank {state['rank']} (now {platforms.comm.rank(group)})")
    if state["platform"] == p.name and len(state["devices"]) != p.device_count():
        found.append(f"{len(state['devices'])} device(s) (now {p.device_count()})")
    if layout is not None and state["layout"] is not None and state["layout"] != layout.to_dict():
        found.append("a different stream layout")
    if coords is not None and state["coords"] is not None and state["coords"] != dict(mesh_coordinates(coords)):
        found.append(f"mesh coordinates {state['coords']} (now {dict(mesh_coordinates(coords))})")
    return found


def _apply(decoded: dict[str, Any], p: platforms.Platform, tracker: RNGStatesTracker) -> None:
    # The tracker validates its entries before applying any; everything else was checked
    # in _decode, so nothing below can fail halfway.
    if decoded["streams"]:
        try:
            tracker.set_states(decoded["streams"])
        except HyperRNGError as exc:
            raise InvalidArgumentError(f"the saved streams do not fit the tracker: {exc}") from exc
    for i, device_state in enumerate(decoded["devices"]):
        p.set_rng_state(device_state, i)
    if decoded["cpu"] is not None:
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
    recorded = recorded_derivation(tracker)  # what apply_layout gave this tracker for the current setup
    if layout is None:
        layout = recorded.layout if recorded is not None else saved_layout(state)
    if coords is None and recorded is not None and recorded.layout == layout:
        coords = recorded.coords
    if layout is None or coords is None or base_seed is None:
        raise InvalidArgumentError(
            "on_mismatch='reseed' needs the saved base seed and the current layout and coords; "
            f"the state has base_seed={base_seed!r}, and layout/coords were "
            f"{'given' if layout is not None and coords is not None else 'not given'}. Seed this run with "
            "apply_layout(layout, base_seed, coords) before loading, or pass layout= and coords=."
        )
    resumed = _resume_seed(state)
    seeds = layout.seeds(resumed, coords)  # validates before anything changes
    layout.seed_tracker(tracker, resumed, coords)
    seed_host(seeds[DEFAULT_STREAM])
    warnings.warn(
        "RNG state saved under a different setup (" + "; ".join(mismatches) + "): streams re-derived from "
        f"base seed {base_seed} and the saved progress (resume seed {resumed}) for the current layout; the run "
        "continues reproducibly but not bit-identically.",
        RNGResumeWarning,
        stacklevel=3,
    )


def resume_seed(state: Mapping[str, Any]) -> int:
    """The base seed from which ``load_rng_state_dict(state, on_mismatch="reseed")`` re-derives the streams.

    It is ``combine64(RESUME_DOMAIN, base_seed, progress)``
    (:func:`hyperrng.platforms.mix.combine64`), where *progress* fingerprints how far the
    saved default stream had gone: the saved state of torch's CPU generator (on the CPU
    platform, its device with its position), which :func:`hyperrng.apply_layout` seeds from
    the default stream on every platform, and, where the state records its derivation,
    the position of each saved counter-based device generator holding the default stream's
    seed. So the streams after a resume differ from those of the first steps, two resumes
    of one checkpoint agree, and so do resumes of replicas' checkpoints (ranks that share
    the default stream hold equal progress). A checkpoint taken after such a resume records
    this seed as its base seed.

    Raises:
        ArgumentTypeError, InvalidArgumentError: ``state`` is not a valid RNG state, or has
            no base seed.
    """
    check_saved(state)
    return _resume_seed(state)


def _resume_seed(state: Mapping[str, Any]) -> int:
    """:func:`resume_seed` of a state :func:`check_saved` accepted."""
    base_seed = state["base_seed"]
    if base_seed is None:
        raise InvalidArgumentError(
            "the RNG state has no base seed to resume from; save it with rng_state_dict(base_seed=...) or after "
            "apply_layout()."
        )
    host = state["torch_cpu"] if state["torch_cpu"] is not None else (state["devices"] or [None])[0]
    if not isinstance(host, torch.Tensor) or host.dtype != torch.uint8 or host.dim() != 1:
        raise InvalidArgumentError(
            "the RNG state is malformed: it holds no state of torch's CPU generator (torch_cpu, or the first "
            "device on a platform whose device is the host)."
        )
    progress = hashlib.blake2b(host.detach().cpu().contiguous().numpy().tobytes(), digest_size=8)
    derivation = saved_derivation(state)
    if derivation is not None:
        default_seed = derivation.layout.seeds(derivation.base_seed, derivation.coords)[DEFAULT_STREAM]
        for device in state["devices"]:
            if isinstance(device, torch.Tensor) and device.dtype == torch.uint8 and device.shape == (16,):
                seed, offset = platforms.unpack_counter_state(device)
                if seed == default_seed:
                    progress.update(offset.to_bytes(8, "little", signed=True))
    return combine64(RESUME_DOMAIN, base_seed, int.from_bytes(progress.digest(), "little"))


# -- files --------------------------------------------------------------------------------------
def save_rng_state(path: str | os.PathLike[str], state: Mapping[str, Any]) -> None:
    """Write a state from :func:`rng_state_dict` (or any dict of plain data, such as a training
    checkpoint holding one) to ``path``, atomically.

    The state goes to a hidden temporary file in ``path``'s folder, which is flushed and
    fsynced, then renamed over ``path`` (``os.replace``), and the folder is fsynced so the
    rename itself survives a crash. A process killed at any point therefore leaves
    ``path`` holding either the previous complete checkpoint or the new one, never a
    partial file. On success or on an exception nothing else is left in the folder; a
    process killed mid-save may leave a hidden ``.<name>.<host>-<pid>-<random>.tmp`` file,
    which is never read, and which the next successful save of ``path`` on the same host
    removes once that process has ended (on POSIX systems). An existing file's permission
    bits are kept.

    Raises:
        ArgumentTypeError: ``path`` is not a ``str`` or ``os.PathLike`` of ``str``, or
            ``state`` is not a mapping or holds something that cannot be pickled (a lambda,
            a lock).
        InvalidArgumentError: ``path`` is a folder, or its folder does not exist; or ``state``
            holds objects that :func:`load_rng_state` would refuse (it reads with
            ``weights_only=True``: dicts, lists, tuples, strings, numbers, tensors). Nothing is
            written when it is raised: the file is read back, tensors memory-mapped, before
            it replaces ``path``.
        OSError: the file system refused the write (full disk, no permission); the
            temporary file is removed and ``path`` is as it was.
    """
    target = _file_path(path)
    if not isinstance(state, Mapping):
        raise ArgumentTypeError(
            f"save_rng_state writes the dict rng_state_dict() returned, got {type(state).__name__}."
        )
    if target.is_dir():
        raise InvalidArgumentError(f"{str(target)!r} is a folder; give the path of the checkpoint file to write.")
    folder = target.parent
    if not folder.is_dir():
        raise InvalidArgumentError(f"the folder of {str(target)!r} does not exist; create it before saving.")
    try:
        mode: int | None = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        mode = None
    temporary = folder / f".{target.name}.{_HOST_TAG}-{os.getpid()}-{secrets.token_hex(_TEMP_NAME_BYTES)}.tmp"
    # O_EXCL: never write through a file (or link) someone else put there; 0o666 lets the umask decide.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as file:
            try:
                torch.save(dict(state), file)
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                raise ArgumentTypeError(
                    f"the state cannot be saved: {error_gist(exc)}; keep only plain data in it (dicts, lists, "
                    f"tuples, strings, numbers, tensors). {str(target)!r} is unchanged."
                ) from None
            file.flush()
            os.fsync(file.fileno())
        _check_loads(temporary, target)
        if mode is not None:
            os.chmod(temporary, mode)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_folder(folder)
    _remove_abandoned(folder, target.name)


def _remove_abandoned(folder: Path, name: str) -> None:
    """Remove the temporary files that saves of ``name`` left when they were killed: those written
    on this host by a process that has ended. Never those of a live process or of another host
    sharing the folder; nothing on Windows, where there is no harmless probe of a process."""
    if os.name != "posix":
        return
    prefix = f".{name}.{_HOST_TAG}-"
    try:
        entries = [entry.name for entry in os.scandir(folder) if entry.name.startswith(prefix)]
    except OSError:
        return
    for entry in entries:
        pid, _, rest = entry[len(prefix) :].partition("-")
        if pid.isdigit() and int(pid) != os.getpid() and rest.endswith(".tmp") and not _running(int(pid)):
            with contextlib.suppress(OSError):
                (folder / entry).unlink()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except OSError:  # it exists, owned by another user
        return True
    return True


def _check_loads(temporary: Path, target: Path) -> None:
    """Refuse a written file that :func:`load_rng_state` would refuse (``weights_only`` reads plain
    data only), before it replaces a good checkpoint. Tensors are memory-mapped, not read."""
    try:
        torch.load(temporary, weights_only=True, mmap=True, map_location="cpu")
    except Exception as exc:
        # torch's weights_only refusal names the object on a later line than its first.
        reason = next((line.strip() for line in str(exc).splitlines() if "Unsupported" in line), error_gist(exc))
        raise InvalidArgumentError(
            f"the state holds data that load_rng_state cannot read back ({reason}); keep only plain "
            f"data in it (dicts, lists, tuples, strings, numbers, tensors). {str(target)!r} is unchanged."
        ) from None


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable; Windows cannot open a folder, and needs no such step."""
    if os.name == "nt":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_path(path: object) -> Path:
    if isinstance(path, str) or (isinstance(path, os.PathLike) and isinstance(os.fspath(path), str)):
        return Path(path)
    raise ArgumentTypeError(
        f"path must be a str or an os.PathLike such as pathlib.Path, got {type(path).__name__} {path!r:.80}."
    )


def load_rng_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a state written by :func:`save_rng_state`, with ``weights_only=True``.

    Raises:
        ArgumentTypeError: ``path`` is not a ``str`` or ``os.PathLike`` of ``str``.
        InvalidArgumentError: the file is missing, truncated, or not a torch file of plain data.
    """
    target = _file_path(path)
    try:
        loaded = torch.load(target, weights_only=True)
    except FileNotFoundError as exc:
        raise InvalidArgumentError(f"no RNG state at {str(path)!r}.") from exc
    except Exception as exc:
        raise InvalidArgumentError(
            f"could not read the RNG state at {str(path)!r} ({type(exc).__name__}: {exc}); "
            "the file is truncated or not written by save_rng_state."
        ) from exc
    if not isinstance(loaded, dict):
        raise InvalidArgumentError(f"{str(path)!r} holds a {type(loaded).__name__}, not an RNG state dict.")
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
        self._group = group
        self._save: dict[str, Any] = {"tracker": tracker, "layout": layout, "coords": coords, "group": group}
        self._load = {**self._save, "on_mismatch": on_mismatch}
        self._save["base_seed"] = base_seed

    def _key(self) -> str:
        return f"rank_{platforms.comm.rank(self._group)}"

    def state_dict(self) -> dict[str, Any]:
        return {self._key(): rng_state_dict(**self._save)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        key = self._key()
        if key not in state_dict:
            raise InvalidArgumentError(
                f"the checkpoint has no RNG state for {key} (it has {sorted(state_dict)}); "
                "it was saved with a different world size."
            )
        load_rng_state_dict(state_dict[key], **self._load)
