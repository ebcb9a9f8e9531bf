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
crash the process, raise an untyped error or leave a generator half-written; and the work
is linear in the file's size (the digest visits each object once and refuses shared or
cyclic references, and nesting or sizes beyond what :func:`rng_state_dict` writes). Sign
the file yourself if it crosses a trust boundary.

:func:`load_rng_state_dict` validates everything before applying anything. A state saved
under another platform, world size, rank, layout or mesh position is refused by default;
``on_mismatch="reseed"`` instead re-derives every stream from the *current* layout and
coordinates (those given, else those :func:`hyperrng.apply_layout` last gave the tracker,
else the saved layout), each from :func:`resume_seed`: the saved base seed mixed with the
saved progress of that stream, which every rank sharing it holds alike, so ranks that share a
stream share it again and the resumed run never replays the numbers of its first steps. It
seeds the host generators from the default stream, and warns that the run continues
reproducibly but not bit-identically.

:class:`RNGStateful` wraps both for ``torch.distributed.checkpoint``: it keys the state by
rank, so DCP never deduplicates one rank's state onto another.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import pickle
import random
import secrets
import stat
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hyperrng.platforms as platforms
from hyperrng._device_state import device_keys
from hyperrng._exclusive import holding
from hyperrng._interrupts import deferred
from hyperrng._state_format import FORMAT, FORMAT_VERSION, check_saved, decode, digest, saved_derivation, saved_layout
from hyperrng.errors import (
    ArgumentTypeError,
    HyperRNGError,
    InvalidArgumentError,
    InvalidOperationError,
    StorageError,
)
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
    bases = None  # the streams' own base seeds, where a resume re-derived them
    if recorded is not None and _agrees(recorded, layout, point, base_seed):
        layout = recorded.layout if layout is None else layout
        point = dict(recorded.coords) if point is None else point
        base_seed = recorded.base_seed if base_seed is None else base_seed
        bases = recorded.bases
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
        "resume_bases": bases,
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


def _idle_tracker(
    tracker: RNGStatesTracker | None, layout: StreamLayout | None, what: str, *, replacing: bool = False
) -> RNGStatesTracker:
    """The tracker to use, refused inside a fork; ``layout`` checked to be a layout or ``None``.
    ``replacing`` (a load) lets through forks it will clear (abandoned or stuck ones: see the tracker)."""
    chosen = resolve_tracker(tracker)
    if layout is not None:
        check_instance(layout, StreamLayout, "layout")
    if chosen.active_stream is None or chosen._abandoned():  # abandoned: get/set_states decide
        return chosen
    if chosen._stuck():
        if replacing:
            chosen._check_forks_leavable(what)
            return chosen
        raise chosen._stuck_error(what)
    verb = what.split()[0]
    raise InvalidOperationError(
        f"cannot {what} inside a fork of stream {chosen.active_stream!r}; {verb} it outside any fork.",
        reason="tracker",
    )


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
    """Restore a state from :func:`rng_state_dict`; validate everything, then apply all of it.

    Nothing is written until every field has been checked, and the writes run with signals
    deferred (see :mod:`hyperrng._interrupts`): a Ctrl-C or another signal's exception finds
    Python's, NumPy's, torch's and the tracker's states all as before the load or all as after
    it, and no hold left behind. Forks of ``tracker`` that their own exits can no longer leave
    (see the tracker's *Recovery*) are cleared first.

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
    tracker = _idle_tracker(tracker, layout, "load an RNG state", replacing=True)
    if coords is not None:
        mesh_coordinates(coords)  # a wrong type is refused whether or not the state records coordinates
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
        with deferred():
            tracker._leave_forks()
            with holding(device_keys(p), "load_rng_state_dict"):
                _reseed(state, tracker, layout, coords, mismatches)
        return
    applied = decode(state, p, tracker)
    derivation = saved_derivation(state)
    # Every state, or none, under Ctrl-C too: signals wait until the last one is written. Held
    # meanwhile: another thread's fork or region refuses the load (nothing written), and none
    # starts halfway through it.
    with deferred():
        tracker._leave_forks()  # forks their own exits can no longer leave (see the tracker's Recovery)
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
    bases = {name: _resume_seed(state, name) for name in (DEFAULT_STREAM, *layout.streams)}
    seeds = layout.seeds(base_seed, coords, bases=bases)  # validates before anything changes
    layout.seed_tracker(tracker, base_seed, coords, bases=bases)
    seed_host(seeds[DEFAULT_STREAM])
    warnings.warn(
        "RNG state saved under a different setup (" + "; ".join(mismatches) + "): streams re-derived from "
        f"base seed {base_seed} and each stream's saved progress for the current layout; the run continues "
        "reproducibly but not bit-identically.",
        RNGResumeWarning,
        stacklevel=3,
    )


def resume_seed(state: Mapping[str, Any], stream: str = DEFAULT_STREAM) -> int:
    """The base seed from which ``load_rng_state_dict(state, on_mismatch="reseed")`` re-derives ``stream``
    (default: the default stream, whose generators the layout seeds); the layout then mixes in the
    stream's name and this rank's coordinates on the stream's dimensions.

    It is ``combine64(RESUME_DOMAIN, base_seed, progress)``
    (:func:`hyperrng.platforms.mix.combine64`), where *progress* fingerprints how far the saved
    stream had gone, and only that: what every rank that shares the stream holds alike. For a
    named stream, its saved state (empty where the state lacks the stream); for the default
    stream, the saved state of torch's CPU generator (on the CPU platform, its device with its
    position), which :func:`hyperrng.apply_layout` seeds from the default stream on every
    platform, and, where the state records its derivation, the position of each saved
    counter-based device generator holding the default stream's seed. So after a resume at any
    world size the ranks that share a stream share it again (having loaded checkpoints of ranks
    that shared it), ranks that must differ do, the streams differ from those of the first steps,
    and two resumes of one checkpoint agree. A checkpoint taken after such a resume records these
    seeds beside the base seed (``resume_bases``).

    Raises:
        ArgumentTypeError, InvalidArgumentError: ``state`` is not a valid RNG state, or has
            no base seed; ``stream`` is not a string.
    """
    check_saved(state)
    if not isinstance(stream, str):
        raise ArgumentTypeError(f"stream must be a stream's name, got {type(stream).__name__}.")
    return _resume_seed(state, stream)


def _resume_seed(state: Mapping[str, Any], stream: str) -> int:
    """:func:`resume_seed` of a state :func:`check_saved` accepted."""
    base_seed = state["base_seed"]
    if base_seed is None:
        raise InvalidArgumentError(
            "the RNG state has no base seed to resume from; save it with rng_state_dict(base_seed=...) or after "
            "apply_layout()."
        )
    progress = hashlib.blake2b(digest_size=8)
    if stream != DEFAULT_STREAM:
        saved = state["streams"].get(stream)
        if isinstance(saved, torch.Tensor):
            progress.update(saved.detach().cpu().contiguous().numpy().tobytes())
        return combine64(RESUME_DOMAIN, base_seed, int.from_bytes(progress.digest(), "little"))
    host = state["torch_cpu"] if state["torch_cpu"] is not None else (state["devices"] or [None])[0]
    if not isinstance(host, torch.Tensor) or host.dtype != torch.uint8 or host.dim() != 1:
        raise InvalidArgumentError(
            "the RNG state is malformed: it holds no state of torch's CPU generator (torch_cpu, or the first "
            "device on a platform whose device is the host)."
        )
    progress.update(host.detach().cpu().contiguous().numpy().tobytes())
    derivation = saved_derivation(state)
    if derivation is not None:
        default_seed = derivation.seeds()[DEFAULT_STREAM]
        for device in state["devices"]:
            if (
                isinstance(device, torch.Tensor)
                and device.dtype == torch.uint8
                and device.shape == (platforms.COUNTER_STATE_NBYTES,)
            ):
                seed, offset = platforms.unpack_counter_state(device)
                if seed == default_seed:
                    progress.update(offset.to_bytes(8, "little", signed=True))
    return combine64(RESUME_DOMAIN, base_seed, int.from_bytes(progress.digest(), "little"))


# -- files --------------------------------------------------------------------------------------
# A save works in a private folder beside the checkpoint, ``.<name>.<16 hex digits>.saving``
# (mode 0700: nobody else can plant a file or a link in it), holding two files: ``lock``, which
# the save holds an OS lock on from before it writes _LOCK_MAGIC into it until the folder is
# gone, and ``checkpoint``, the state, written by torch.save through its path and renamed over
# the checkpoint at the end. The OS releases the lock when the process ends, however it ends,
# so a later save knows a folder whose lock it can take for one left by a save that died, in any
# PID namespace, container or host sharing the folder.
_WORK_SUFFIX = ".saving"
_WORK_TOKEN_BYTES = 8  # random hex in the folder's name: concurrent saves never share one
_LOCK_NAME = "lock"
_DATA_NAME = "checkpoint"
_LOCK_MAGIC = b"hyperrng save_rng_state: a save in progress while this file is locked\n"
# What torch's writer raises when a write fails (a full disk, an I/O error): a RuntimeError.
_WRITER_FAILURES = ("inline_container", "PytorchStreamWriter", "cannot be opened")


def save_rng_state(path: str | os.PathLike[str], state: Mapping[str, Any]) -> None:
    """Write a state from :func:`rng_state_dict` (or any dict of plain data, such as a training
    checkpoint holding one) to ``path``, atomically.

    The state is written by ``torch.save`` into a private folder beside ``path`` (mode 0700),
    fsynced, checked to read back with ``weights_only=True``, then renamed over ``path``
    (``os.replace``), and the folder holding ``path`` is fsynced so the rename itself survives
    a crash. A process killed at any point therefore leaves ``path`` holding either the
    previous complete checkpoint or the new one, never a partial file. Ctrl-C (and any signal
    with a Python handler) is deferred across the steps that create, seal and rename files,
    so an interrupt leaves them as before or as after, and on any exception what the save
    created is closed and removed. An existing file's permission bits are kept (set with
    ``fchmod`` on the open file, never through a path).

    **Leftovers.** A process killed mid-save (SIGKILL, a power cut) leaves its private folder,
    ``.<name>.<random>.saving``. The save holds an OS lock (``flock``) on a file in it for as
    long as it runs, and the OS drops that lock when the process ends, so the next successful
    save of ``path`` removes exactly the folders whose lock it can take: those of saves that
    died, never one still being written, whatever PID namespace, container or host (on a
    shared file system with working locks) it runs in. Nothing else in the folder is touched:
    not another checkpoint's folders, nor files that merely look like ours. Where the file
    system offers no locks, nothing is removed. On Windows, files are locked with
    ``msvcrt.locking`` instead.

    **Symlinks.** When ``path`` is a symbolic link (``latest.pt -> step100.pt``), the link stays
    and the file it points to is replaced, atomically, in that file's folder (a link to a
    missing file creates it). A chain of links is followed to its end.

    Raises:
        ArgumentTypeError: ``path`` is not a ``str`` or ``os.PathLike`` of ``str``, or
            ``state`` is not a mapping or holds something that cannot be pickled (a lambda,
            a lock).
        InvalidArgumentError: ``path`` is a folder, a device, a FIFO or a socket (never
            replaced), its folder does not exist, or it is a link that loops; or ``state``
            holds objects that :func:`load_rng_state` would
            refuse (it reads with ``weights_only=True``: dicts, lists, tuples, strings,
            numbers, tensors). Nothing is written when it is raised: the file is read back,
            tensors memory-mapped, before it replaces ``path``.
        StorageError: the file system refused the save (a full disk or quota:
            ``errno.ENOSPC``; no permission: also a ``PermissionError``; an I/O error); an
            ``OSError``. What the save created is removed and ``path`` is as it was.
    """
    target = _save_target(path)
    if not isinstance(state, Mapping):
        raise ArgumentTypeError(
            f"save_rng_state writes the dict rng_state_dict() returned, got {type(state).__name__}."
        )
    folder = target.parent
    try:
        mode: int | None = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise _storage_error(exc, target, "read the permission bits of") from exc
    work = _Work(folder / f".{target.name}.{secrets.token_hex(_WORK_TOKEN_BYTES)}{_WORK_SUFFIX}")
    replaced = False
    try:
        with deferred():
            work.create()
        _write(state, work.data, target)  # through a path, not a file object: interruptible at any point
        with deferred():
            work.seal(mode)
        _check_loads(work.data, target)
        with deferred():
            os.replace(work.data, target)
            replaced = True
            _fsync_folder(folder)
            work.remove()
    except BaseException as exc:
        with deferred():
            work.remove()
        if isinstance(exc, OSError) and not isinstance(exc, HyperRNGError):
            if replaced:  # the new checkpoint is in place; only its rename's durability failed
                what, kept = "make durable the rename of the new checkpoint to", False
            else:
                what, kept = "save the checkpoint to", True
            raise _storage_error(exc, target, what, kept=kept) from exc
        raise
    _remove_abandoned(folder, target.name)


def _save_target(path: object) -> Path:
    """The file a save of ``path`` replaces: ``path``, or the end of the links it is."""
    target = _file_path(path)
    if target.is_symlink():
        resolved = Path(os.path.realpath(target))
        if resolved.is_symlink():
            raise InvalidArgumentError(f"{str(target)!r} is a symbolic link that loops; point it at a file.")
        target = resolved
    if target.is_dir():
        raise InvalidArgumentError(f"{str(target)!r} is a folder; give the path of the checkpoint file to write.")
    _refuse_special(target, "replace")
    if not target.parent.is_dir():
        raise InvalidArgumentError(f"the folder of {str(target)!r} does not exist; create it before saving.")
    return target


def _write(state: Mapping[str, Any], data: Path, target: Path) -> None:
    try:
        torch.save(dict(state), str(data))
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise ArgumentTypeError(
            f"the state cannot be saved: {error_gist(exc)}; keep only plain data in it (dicts, lists, "
            f"tuples, strings, numbers, tensors). {str(target)!r} is unchanged."
        ) from None
    except RuntimeError as exc:
        if not any(mark in str(exc) for mark in _WRITER_FAILURES):
            raise
        # torch's writer reports no errno: a file system without free blocks or inodes was full.
        try:
            space = os.statvfs(data.parent) if hasattr(os, "statvfs") else None
        except OSError:
            space = None
        full = space is not None and (space.f_bavail == 0 or space.f_favail == 0)
        code = errno.ENOSPC if full else errno.EIO
        raise _storage_error(OSError(code, error_gist(exc)), target, "write the checkpoint to") from exc


def _os_reason(exc: OSError) -> tuple[int, str]:
    """The errno of a file system's refusal (``EIO`` when it gives none) and its words."""
    code = exc.errno if exc.errno is not None else errno.EIO
    return code, exc.strerror or str(exc) or os.strerror(code)


def _storage_error(exc: OSError, target: Path, what: str, *, kept: bool = True) -> StorageError:
    code, reason = _os_reason(exc)
    hint = {
        errno.ENOSPC: "free space on that file system or save elsewhere",
        errno.EDQUOT: "free space within your quota or save elsewhere",
        errno.EACCES: "make its folder writable for this user or save elsewhere",
        errno.EPERM: "make its folder writable for this user or save elsewhere",
        errno.EROFS: "save to a writable file system",
    }.get(code, "check the file system, then save again")
    outcome = "it is as it was" if kept else "it holds the new checkpoint, which a crash now may undo"
    return StorageError(code, f"could not {what} {str(target)!r} ({reason}): {hint}; {outcome}", str(target))


class _Work:
    """One save's private folder: created, sealed and removed under deferred signals, each step
    idempotent and recorded as it is made, so an exception at any point leaves nothing behind
    once :meth:`remove` has run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data = path / _DATA_NAME
        self.made = False
        self.lock: int | None = None  # the locked lock file's descriptor

    def create(self) -> None:
        os.mkdir(self.path, 0o700)
        self.made = True
        self.lock = os.open(self.path / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, 0o600)
        # Nobody else can hold it (a cleaner locks only a file that holds the mark); where the
        # file system has no locks the save goes on unlocked, and no cleaner removes its folder.
        if _try_lock(self.lock) is False:
            raise InvalidOperationError(f"another process locked {str(self.path)!r} first; save again.")
        os.write(self.lock, _LOCK_MAGIC)  # from now on a cleaner that can take the lock knows this save died

    def seal(self, mode: int | None) -> None:
        """Flush the checkpoint to disk and give it ``mode``, through its open descriptor."""
        fd = os.open(self.data, os.O_RDWR | _NO_FOLLOW)
        try:
            os.fsync(fd)
            if mode is not None:
                if hasattr(os, "fchmod"):
                    os.fchmod(fd, mode)
                else:  # Windows before Python 3.13: the path is inside the private folder
                    os.chmod(self.data, mode)
        finally:
            os.close(fd)

    def remove(self) -> None:
        """Close and remove what :meth:`create` made (idempotent; file-system errors are ignored:
        what cannot be removed now is a dead save's folder for the next save)."""
        if not self.made:
            return
        with contextlib.suppress(OSError):
            self.data.unlink(missing_ok=True)
        if self.lock is not None:
            with contextlib.suppress(OSError):
                (self.path / _LOCK_NAME).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                os.close(self.lock)
            self.lock = None
        with contextlib.suppress(OSError):
            os.rmdir(self.path)
        self.made = False


_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)


def _try_lock(fd: int) -> bool | None:
    """Take an exclusive OS lock on the open file ``fd`` without waiting: ``True`` if taken,
    ``False`` if another process holds it, ``None`` if the file system offers no locks."""
    try:
        if sys.platform == "win32":
            import msvcrt

            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        else:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return False if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES, errno.EDEADLK) else None
    return True


def _remove_abandoned(folder: Path, name: str) -> None:
    """Remove the private folders that saves of ``name`` left when they died: those named as a save
    names them whose lock file holds the save's mark and whose lock this process can take."""
    prefix = f".{name}."
    try:
        entries = [entry.name for entry in os.scandir(folder)]
    except OSError:
        return
    for entry in entries:
        token = entry[len(prefix) : -len(_WORK_SUFFIX)] if entry.startswith(prefix) else ""
        if entry.endswith(_WORK_SUFFIX) and len(token) == 2 * _WORK_TOKEN_BYTES and _is_hex(token):
            with deferred():
                _remove_if_abandoned(folder / entry)


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def _remove_if_abandoned(work: Path) -> None:
    try:
        fd = os.open(work / _LOCK_NAME, os.O_RDWR | _NO_FOLLOW)
    except OSError:  # no lock file (not ours, or another save removing it), or a link
        return
    try:
        # Lock first, at byte 0 where a save locks: on Windows the lock is mandatory and covers the
        # bytes from the file position, so a read before it would fail on a live save's file.
        if _try_lock(fd) is not True:
            return  # its save is alive, or no lock can tell
        try:
            if os.read(fd, len(_LOCK_MAGIC) + 1) != _LOCK_MAGIC:
                return  # not made by a save
        except OSError:
            return
        with contextlib.suppress(OSError):
            (work / _DATA_NAME).unlink(missing_ok=True)
            (work / _LOCK_NAME).unlink()
            os.rmdir(work)  # only if empty: a file someone else put there stays
    finally:
        os.close(fd)


def _check_loads(temporary: Path, target: Path) -> None:
    """Refuse a written file that :func:`load_rng_state` would refuse (``weights_only`` reads plain
    data only), before it replaces a good checkpoint. Tensors are memory-mapped, not read."""
    try:
        torch.load(temporary, weights_only=True, mmap=True, map_location="cpu")
    except pickle.UnpicklingError as exc:  # weights_only's refusal; anything else passes through as itself
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


def _refuse_special(target: Path, verb: str, mode: int | None = None) -> None:
    """Refuse ``target`` where it exists and is not a regular file (a device such as ``/dev/null``, a FIFO,
    a socket): a save would replace it with a file, a load of a FIFO would wait forever. ``mode``: its
    ``st_mode`` when already known (from an opened descriptor), else read without following a link."""
    if mode is None:
        try:
            mode = os.stat(target).st_mode
        except OSError:  # missing, or unreadable: the save or load itself says why
            return
    if not stat.S_ISREG(mode):
        kind = "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a FIFO" if stat.S_ISFIFO(mode) else (
            "a socket" if stat.S_ISSOCK(mode) else "not a regular file")  # fmt: skip
        raise InvalidArgumentError(
            f"{str(target)!r} is {kind}, not a regular file: hyperrng will not {verb} it. Give the path of a "
            "checkpoint file."
        )


def _file_path(path: object) -> Path:
    if isinstance(path, str) or (isinstance(path, os.PathLike) and isinstance(os.fspath(path), str)):
        return Path(path)
    raise ArgumentTypeError(
        f"path must be a str or an os.PathLike such as pathlib.Path, got {type(path).__name__} {path!r:.80}."
    )


# The errnos of a read that the file system refused, as opposed to a file whose content is cut off.
_READ_FAILURES = {errno.EIO, errno.ETIMEDOUT, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EISDIR, errno.ESTALE}


def _unreadable(path: object, exc: BaseException) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"could not read the RNG state at {str(path)!r} ({error_gist(exc)}); "
        "the file is truncated or not written by save_rng_state."
    )


def load_rng_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a state written by :func:`save_rng_state`, with ``weights_only=True``.

    Raises:
        ArgumentTypeError: ``path`` is not a ``str`` or ``os.PathLike`` of ``str``.
        InvalidArgumentError: the file is truncated, or not a torch file of plain data; or
            ``path`` is not a regular file (a device, a FIFO, a socket), refused without waiting.
        StorageError: the file system refused the read: no such file (also a
            ``FileNotFoundError``), no permission (also a ``PermissionError``), a time-out or
            an I/O error; an ``OSError``.
    """
    target = _file_path(path)
    _refuse_special(target, "read")  # a socket cannot even be opened
    try:
        # Opened without waiting (a FIFO nobody writes would block), checked to be a regular file by
        # its descriptor, and read through that descriptor: the file checked is the file read.
        fd = os.open(target, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
        with os.fdopen(fd, "rb") as file:
            _refuse_special(target, "read", os.fstat(file.fileno()).st_mode)
            loaded = torch.load(file, weights_only=True)
    except HyperRNGError:
        raise
    except OSError as exc:
        if exc.errno not in _READ_FAILURES and not isinstance(exc, TimeoutError):  # torch's seek past a cut-off end
            raise _unreadable(path, exc) from exc
        code, reason = _os_reason(exc)
        raise StorageError(code, f"could not read the RNG state at {str(path)!r} ({reason})", str(path)) from exc
    except Exception as exc:
        raise _unreadable(path, exc) from exc
    if not isinstance(loaded, dict):
        raise InvalidArgumentError(f"{str(path)!r} holds a {type(loaded).__name__}, not an RNG state dict.")
    return loaded


# -- torch.distributed.checkpoint ------------------------------------------------------------
class RNGStateful:
    """A ``torch.distributed.checkpoint`` ``Stateful`` holding this rank's RNG state.

    The state is stored under a key naming the rank (``"rank_3"``), so DCP, which merges
    equal keys across ranks, keeps every rank's own state::

        dcp.save({"model": model, "rng": RNGStateful(layout=layout, coords=coords, base_seed=seed)}, ...)

    Arguments are those of :func:`rng_state_dict` and :func:`load_rng_state_dict`, and:

    Args:
        load_from: for an instance given to ``dcp.load`` at another world size, the saved rank whose
            state this rank loads: an int, or a function of this rank returning one (``None``: this
            rank's own). DCP reads only the keys the loading instance names, so a rank beyond the
            saved world must name one that exists; pick one that shares this rank's coordinates on
            each stream's dimensions (for ``dp x tp``, ``lambda r: (dp(r) % old_dp) * tp + tp(r)``),
            with ``on_mismatch="reseed"``, and every stream is shared again as the layout says.

    Raises:
        ArgumentTypeError: ``load_from`` is neither ``None``, an int nor callable.
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
        load_from: int | Callable[[int], int] | None = None,
    ) -> None:
        if load_from is not None and not callable(load_from) and (type(load_from) is not int or load_from < 0):
            raise ArgumentTypeError(
                f"load_from must be a saved rank (an int >= 0), a function of this rank returning one, or None; "
                f"got {type(load_from).__name__} {load_from!r:.40}."
            )
        self._group = group
        self._load_from = load_from
        self._save: dict[str, Any] = {"tracker": tracker, "layout": layout, "coords": coords, "group": group}
        self._load = {**self._save, "on_mismatch": on_mismatch}
        self._save["base_seed"] = base_seed

    def _key(self) -> str:
        rank = platforms.comm.rank(self._group)
        source = self._load_from
        if source is None:
            return f"rank_{rank}"
        chosen = source(rank) if callable(source) else source
        if type(chosen) is not int or chosen < 0:
            raise ArgumentTypeError(f"load_from({rank}) must return a saved rank (an int >= 0), got {chosen!r:.40}.")
        return f"rank_{chosen}"

    def state_dict(self) -> dict[str, Any]:
        return {self._key(): rng_state_dict(**self._save)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        key = self._key()
        if key not in state_dict:
            raise InvalidArgumentError(
                f"the checkpoint has no RNG state for {key} (it has {sorted(state_dict)}); "
                "it was saved with a different world size: name a saved rank with load_from=."
            )
        load_rng_state_dict(state_dict[key], **self._load)
