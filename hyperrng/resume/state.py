"""RNG checkpoints for exact resume: every generator of this rank in one plain dict
(:func:`rng_state_dict`), checked whole and then restored whole (:func:`load_rng_state_dict`, which
can instead re-derive the streams for another world size or layout from :func:`resume_seed`),
written to and read from a file (:func:`save_rng_state`, :func:`load_rng_state`, defined in
:mod:`hyperrng.resume._save_load`), and kept per rank by ``torch.distributed.checkpoint``
(:class:`RNGStateful`).
"""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

import numpy as np
import torch

import hyperrng.platforms as platforms
from hyperrng._guard.exclusive import refuse_held, refuse_inside_contexts
from hyperrng.errors import ArgumentTypeError, HyperRNGError, InvalidArgumentError, RankFailure
from hyperrng.platforms.validate import check_instance, check_seed
from hyperrng.resume._dcp_planner import Entry, planner_class, saved_template
from hyperrng.resume._format import FORMAT, FORMAT_VERSION, check_saved, decode, digest, saved_derivation
from hyperrng.resume._reseed import RESUME_DOMAIN, RNGResumeWarning, _reseed, resume_seed
from hyperrng.resume._save_load import load_rng_state, save_rng_state
from hyperrng.seeding.layout import (
    Derivation,
    StreamLayout,
    _record,
    mesh_coordinates,
    recorded_derivation,
)
from hyperrng.streams._device_state import device_keys
from hyperrng.streams.tracker import Replacing, RNGStatesTracker, refuse_in_fork, resolve_tracker

_T = TypeVar("_T")

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

    It captures Python's ``random``, NumPy's legacy global state, torch's CPU generator, every
    device of the current platform, the tracker's streams, and metadata (format version,
    platform, base seed, layout, this rank's coordinates, rank and world size). Where
    :func:`hyperrng.apply_layout` seeded the streams, the base seed, layout and coordinates are
    recorded without being asked for (:func:`hyperrng.seeding.layout.recorded_derivation`), so any
    such checkpoint can be resumed at another world size. It holds only tensors, numbers, strings,
    ``None``, lists and dicts, so ``torch.load(path, weights_only=True)`` reads it (that loader
    runs no code), and it carries a BLAKE2b digest of its content so that a damaged state (a
    truncated or corrupted file) is refused instead of silently resumed.

    Args:
        tracker: whose streams to save (default: the process-wide tracker).
        layout, coords, base_seed: the stream layout, this rank's coordinates and the base
            seed the streams came from; stored so a resume can be checked (and, on
            request, re-derived). Where :func:`hyperrng.apply_layout` seeded the
            tracker, those not given are taken from that derivation (when the given ones
            agree with it), so they need not be passed.
        group: the process group whose rank and size are recorded (default: the world).

    Returns:
        Plain data (tensors, numbers, strings, lists, dicts) with its digest.

    Raises:
        InvalidOperationError: inside a fork of any tracker, a sharded region, ``fork_rng`` or a
            ``portable_random(seed)`` block (``reason`` ``"tracker"``): the generator holds what the context
            swapped in; or another thread holds torch's CPU generator or a device's (in such a context,
            portable mode, seeding, ...; ``reason`` ``"busy"``): what it reads may be that thread's context's
            stream. Nothing has changed; capture outside the context, once that thread has left it.
        InvalidArgumentError: a base seed or coordinate out of range.
        ArgumentTypeError: ``layout`` is not a :class:`~hyperrng.seeding.layout.StreamLayout`.
    """
    p = platforms.current()
    # The device generator holds the stream inside a fork, not the default state a resume needs.
    tracker = _idle_tracker(tracker, layout, "capture the RNG state")
    keys = device_keys(p)
    refuse_inside_contexts(keys, "capture the RNG state")  # another tracker's fork, a region, fork_rng, portable_random
    # On another thread such a context would be saved as the run's state too (a load is refused so by Replacing).
    refuse_held(
        keys,
        "capture the RNG state",
        "It may hold that thread's fork, region, fork_rng or portable_random stream, not the run's state: capture "
        "once that thread has left its context (or on that thread, outside it).",
    )
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


def _checked_tracker(tracker: RNGStatesTracker | None, layout: StreamLayout | None) -> RNGStatesTracker:
    """The tracker to use; ``layout`` checked to be a layout or ``None``."""
    chosen = resolve_tracker(tracker)
    if layout is not None:
        check_instance(layout, StreamLayout, "layout")
    return chosen


def _idle_tracker(tracker: RNGStatesTracker | None, layout: StreamLayout | None, what: str) -> RNGStatesTracker:
    """The tracker to read, refused inside a fork (see :func:`_checked_tracker`)."""
    chosen = _checked_tracker(tracker, layout)
    refuse_in_fork(chosen, what)
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
    """Restore a state from :func:`rng_state_dict`; validate everything, then apply all of it.

    Nothing is written until every field has been checked, and the writes run with signals
    deferred (see :mod:`hyperrng._guard.interrupts`): a Ctrl-C or another signal's exception finds
    Python's, NumPy's, torch's and the tracker's states all as before the load or all as after
    it, and no hold left behind. Forks of ``tracker`` that their own exits can no longer leave
    (see the tracker's *Recovery*) are cleared first.

    **Trust.** The digest is not keyed: it detects accidental damage, not forgery (anyone who
    edits the dict can recompute it). Every field is nevertheless typed and bounded before
    anything is applied, so a forged state can at worst resume other random numbers, never
    crash the process, raise an untyped error or leave a generator half-written; and the work
    is linear in the file's size (the digest visits each object once and refuses shared or
    cyclic references, and nesting or sizes beyond what :func:`rng_state_dict` writes), as is the
    memory: :func:`load_rng_state` checks a file's structure before torch reads it
    (:mod:`hyperrng.resume._untrusted`). Sign the file yourself if it crosses a trust boundary.

    **Limits.** Whatever its source (a file, ``torch.distributed.checkpoint``), a state larger
    than any :func:`rng_state_dict` writes is refused, each limit checked before the work it
    bounds, so a hostile state costs time linear in its size and no copy of it: nesting of at
    most 8 levels and 262,144 objects; tensors dense and on the CPU, each with a storage of its
    own, of at most 2**20 elements and 256 MiB in all (a view whose elements repeat or overlap,
    as ``expand()`` makes, is refused from its strides); strings of at most 65,536 characters
    and 4 Mi characters in all, a string counted each time it is reached; a layout of at most
    :data:`hyperrng.seeding.layout.MAX_DIMS` (16) dimensions and :data:`hyperrng.seeding.layout.MAX_STREAMS`
    (1,024) streams.

    Args:
        state: the dict :func:`rng_state_dict` returned (possibly through ``torch.load``).
        tracker: the tracker to restore (default: the process-wide one).
        layout, coords: the current stream layout and this rank's coordinates, which must match
            the saved ones. Not given, they are those :func:`hyperrng.apply_layout` last gave
            ``tracker`` in this process, if it did (a mesh that changed at the same world size
            is a mismatch too).
        on_mismatch: ``"error"`` (default) refuses a state saved under another platform,
            world size, rank, layout or coordinates; ``"reseed"`` re-derives the streams
            from the saved base seed with ``layout`` and ``coords`` and warns
            (:class:`RNGResumeWarning`). Not given, they are those
            :func:`hyperrng.apply_layout` last gave ``tracker`` in this process (the
            layout falls back to the saved one).
        group: the process group whose rank and size are checked (default: the world).

    Raises:
        InvalidArgumentError: another format or version, a digest mismatch (a damaged state),
            a malformed field or one beyond a limit (the message names it), a topology or
            platform mismatch, or a missing stream. Nothing has changed when it is raised.
        InvalidOperationError: inside a fork of any tracker, a sharded region or ``fork_rng`` (``reason``
            ``"tracker"``), or
            another thread holds torch's CPU generator or a device's (in a fork, a region, ...;
            see :mod:`hyperrng._guard.exclusive`); nothing has changed.
    """
    _load(state, tracker=tracker, layout=layout, coords=coords, on_mismatch=on_mismatch, group=group)()


def _load(
    state: Mapping[str, Any],
    *,
    tracker: RNGStatesTracker | None,
    layout: StreamLayout | None,
    coords: Mapping[str, int] | object | None,
    on_mismatch: str,
    group: object | None,
    elsewhere: str | None = None,
) -> Callable[[], None]:
    """:func:`load_rng_state_dict`'s checks, which raise, and its apply step, returned for the caller to run (a
    collective load runs it once every rank's checks passed); ``elsewhere``, a mismatch found on another rank (its
    own setup matching), after which every rank must re-derive its streams (:class:`RNGStateful`)."""
    if not isinstance(on_mismatch, str):
        raise ArgumentTypeError(
            f"on_mismatch must be one of the strings {ON_MISMATCH}, got {type(on_mismatch).__name__} {on_mismatch!r}."
        )
    if on_mismatch not in ON_MISMATCH:
        raise InvalidArgumentError(f"on_mismatch must be one of {ON_MISMATCH}, got {on_mismatch!r}.")
    # Inside a fork, the fork's exit would restore the state it saved before this load, losing both.
    tracker = _checked_tracker(tracker, layout)
    keys = device_keys(platforms.current())
    replacement = Replacing(tracker, "load an RNG state", target=False, holds=keys, holding_what="load_rng_state_dict")
    refuse_inside_contexts(keys, "load an RNG state", tracker.owns)  # their exits would undo the load
    if coords is not None:
        mesh_coordinates(coords)  # a wrong type is refused whether or not the state records coordinates
    check_saved(state)
    p = platforms.current()
    derivation = saved_derivation(state)  # a malformed derivation is refused as such, before any comparison
    recorded = recorded_derivation(tracker)  # the current setup, where apply_layout made it and none is given
    mismatches = _mismatches(
        state,
        p,
        layout if layout is not None or recorded is None else recorded.layout,
        coords if coords is not None or recorded is None else recorded.coords,
        group,
    )
    if elsewhere is not None:
        mismatches.append(elsewhere)
    if mismatches:
        if on_mismatch == "error":
            raise InvalidArgumentError(
                "the RNG state was saved under a different setup: "
                + "; ".join(mismatches)
                + ". Resume with the same setup, or pass on_mismatch='reseed' (with layout and coords) "
                "to re-derive the streams from the saved base seed."
            )

        def reseed() -> None:
            with replacement.applying():
                _reseed(state, tracker, layout, coords, mismatches)

        return reseed
    applied = decode(state, p, tracker)

    def apply() -> None:
        # Every state, or none, under Ctrl-C too: signals wait until the last one is written. Held
        # meanwhile: another thread's fork or region refuses the load (nothing written), and none
        # starts halfway through it.
        with replacement.applying():  # first the forks their own exits can no longer leave (the tracker's Recovery)
            _apply(applied, p, tracker)
            _record(tracker, derivation)  # the next checkpoint carries the derivation on (or none, if it had none)

    return apply


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


# -- torch.distributed.checkpoint ------------------------------------------------------------
class RNGStateful:
    """A ``torch.distributed.checkpoint`` ``Stateful`` holding this rank's RNG state.

    The state is stored under a key naming the rank (``"rank_3"``), so DCP, which merges
    equal keys across ranks, keeps every rank's own state::

        dcp.save({"model": model, "rng": RNGStateful(layout=layout, coords=coords, base_seed=seed)}, ...)

    Arguments are those of :func:`rng_state_dict` and :func:`load_rng_state_dict`, and:

    **Load with the planner.** DCP reads into the structure :meth:`state_dict` gives at the load, and refuses,
    with its own ``CheckpointException``, a key the checkpoint lacks: a rank whose tracker holds no streams yet
    (a restarted job that loads before seeding), or other ones, would fail there. With
    ``planner=RNGStateful.planner()`` each state is read in the structure it was saved in, and
    :func:`load_rng_state_dict`'s rules apply (an empty tracker adopts the saved streams).

    **A larger world.** DCP reads only the keys each loading instance names, and refuses a key
    the checkpoint lacks before any ``Stateful`` runs: a rank beyond the saved world would get
    torch's ``CheckpointException``. Load with ``planner=RNGStateful.planner()``: where this
    rank's key is missing, the planner asks instead for every saved rank's state (nothing else
    about the load changes; any other missing key is still refused). Then ``on_mismatch="error"``
    refuses with :class:`~hyperrng.errors.InvalidArgumentError` naming the saved ranks, and
    ``"reseed"`` resumes from the saved rank whose coordinates equal this rank's modulo the saved
    mesh's extent on each dimension (for ``dp x tp`` grown along ``dp``: ``(dp mod old_dp, tp)``),
    so every stream is shared again as the layout says::

        dcp.load({"rng": RNGStateful(on_mismatch="reseed")}, checkpoint_id=path, planner=RNGStateful.planner())

    **Another mesh.** A rank whose own key holds a state saved at other coordinates than its own
    (the mesh changed, at the same world size or not) is a mismatch too, and with ``"reseed"`` it
    also resumes from the saved rank at its coordinates, not from the state its rank number held:
    ranks that share a stream must resume from states that shared it. With ``"reseed"`` the
    planner therefore reads every saved rank's state (a few KB each); without the planner such a
    rank refuses, saying to load with it.

    **Every rank, or one alone.** In a job of several ranks, :meth:`state_dict` and
    :meth:`load_state_dict` are collective over ``group`` (DCP's ``process_group``): small all-gathers
    tell every rank whether some rank's checks failed (then every rank raises, nothing changed: that
    rank its own error, the others :class:`~hyperrng.errors.RankFailure` naming it) and whether some
    rank's state was saved elsewhere on the mesh (then all refuse, or all re-derive); a rank failing
    alone would leave the others in a gather until the group's timeout. A rank that saves or loads
    without the others (``no_dist=True``) passes ``alone=True``: DCP does not tell a ``Stateful``.

    Args:
        load_from: the saved rank whose state this rank loads instead of its own: an int, or a
            function of this rank returning one (``None``: this rank's own). For meshes the
            rule above does not fit; with ``on_mismatch="reseed"``, pick one that shares this
            rank's coordinates on each stream's dimensions.
        alone: this rank saves or loads without the other ranks of ``group`` (see above): no
            collective, each check raises where it fails, and a load checks this rank's state only.

    Raises:
        ArgumentTypeError: ``load_from`` is neither ``None``, an int nor callable, or ``alone``
            is not a bool.
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
        alone: bool = False,
    ) -> None:
        if load_from is not None and not callable(load_from) and (type(load_from) is not int or load_from < 0):
            raise ArgumentTypeError(
                f"load_from must be a saved rank (an int >= 0), a function of this rank returning one, or None; "
                f"got {type(load_from).__name__} {load_from!r:.40}."
            )
        if type(alone) is not bool:
            raise ArgumentTypeError(f"alone must be a bool, got {type(alone).__name__} {alone!r:.40}.")
        self._group = group
        self._load_from = load_from
        self._alone = alone
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
        """This rank's state, under its key; collective unless ``alone`` (see the class docstring).

        Raises:
            RankFailure: another rank's capture failed (it raises its own error).
        """
        # DCP calls it first, on every rank: a rank that raised here alone would leave the others in DCP's gathers.
        return self._agreed("state_dict", lambda: Entry(self, {self._key(): rng_state_dict(**self._save)}))[0]

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load this rank's state from what DCP read (see the class docstring for a larger world).

        Raises:
            ArgumentTypeError: ``state_dict`` is not a mapping.
            InvalidArgumentError: it holds no state for this rank and no single saved rank
                to resume from (see the class docstring), or :func:`load_rng_state_dict` refuses
                the state. Nothing has changed when it is raised.
            RankFailure: in a collective load, another rank's checks failed (it raises its own
                error; see the class docstring). Nothing has changed.
        """

        def where() -> tuple[str, Any, Any, Any, bool]:
            if not isinstance(state_dict, Mapping):
                raise ArgumentTypeError(
                    "load_state_dict takes the mapping DCP loaded (rank keys to states), "
                    f"got {type(state_dict).__name__}."
                )
            key = self._key()
            own = state_dict.get(key)
            here = self._coordinates()
            there = own.get("coords") if isinstance(own, Mapping) else None
            moved = own is None or (here is not None and isinstance(there, Mapping) and dict(there) != here)
            return key, own, here, there, moved

        (key, own, here, there, moved), anywhere = self._agreed("load_state_dict", where, lambda found: found[-1])
        if self._load_from is not None:  # the state this rank chose: only its own coordinates count
            anywhere = moved
        # Every check of the load, then once more every rank learns whether all passed; then all apply, or none.
        self._agreed("load_state_dict", lambda: self._checked(state_dict, key, own, moved, anywhere, here, there))[0]()

    def _checked(
        self, state_dict: Mapping[str, Any], key: str, own: Any, moved: bool, anywhere: bool, here: Any, there: Any
    ) -> Callable[[], None]:
        """:meth:`load_state_dict`'s choice of the saved state and the checks of its load; returns the apply step."""
        if own is None:
            key = self._stand_in(f"the checkpoint has no RNG state for {key}", state_dict)
        elif anywhere and self._load["on_mismatch"] == "reseed" and self._load_from is None:
            if getattr(state_dict, "saved", None) is None:  # DCP read each rank's own state only
                raise InvalidArgumentError(
                    f"the mesh changed since the checkpoint ({'this' if moved else 'another'} rank's state was saved "
                    "at other coordinates): load with planner=RNGStateful.planner() and on_mismatch='reseed', so "
                    "that every rank resumes from the saved rank at its coordinates, or name one with load_from=."
                )
            if moved:
                key = self._stand_in(f"the RNG state of {key} was saved at {dict(there)}, not at {here}", state_dict)
        elsewhere = "coordinates changed on another rank" if anywhere and not moved else None  # re-derive here too
        return _load(state_dict[key], **self._load, elsewhere=elsewhere)

    def _agreed(
        self, what: str, step: Callable[[], _T], moved: Callable[[_T], bool] = lambda _: False
    ) -> tuple[_T, bool]:
        """``step()``, run on every rank at the same point of ``what``, and whether any rank found ``moved`` of its
        result (:meth:`_together`); where a step raised, every rank raises, once all know."""
        try:
            result = step()
        except Exception as exc:
            self._together(what, exc)  # raises exc, once the other ranks know
            raise
        return result, self._together(what, moved=moved(result))

    def _together(self, what: str, failed: Exception | None = None, moved: bool = False) -> bool:
        """Whether any rank of ``group`` found ``moved`` (its saved state made at other coordinates than its own,
        or none), asked of every rank at the same point of ``what`` (unless ``alone``), so that none waits for one
        that gave up. A rank whose checks ``failed`` raises its error, every other one
        :class:`~hyperrng.errors.RankFailure`."""
        if self._alone or platforms.comm.world_size(self._group) == 1:
            if failed is not None:
                raise failed
            return moved
        why = b"" if failed is None else f"{type(failed).__name__}: {failed}".encode()[:_WHY]
        mine = torch.zeros(1 + _WHY, dtype=torch.uint8)  # ok 0, moved 1, failed 2; then why
        mine[0] = 2 if failed is not None else int(moved)
        mine[1 : 1 + len(why)] = torch.tensor(list(why), dtype=torch.uint8)
        flags = platforms.comm.all_gather(platforms.current(), mine, self._group)
        if failed is not None:
            raise failed
        failures = [(rank, flag) for rank, flag in enumerate(flags) if int(flag[0]) == 2]
        if failures:
            rank, flag = failures[0]
            raise RankFailure(
                f"RNGStateful.{what}: rank {rank} of the group"
                + (f" (and {len(failures) - 1} other(s))" if len(failures) > 1 else "")
                + f" failed ({bytes(flag[1:].tolist()).rstrip(bytes(1)).decode(errors='replace')}); "
                "every rank raises, and nothing has changed on this one."
            )
        return any(int(flag[0]) == 1 for flag in flags)

    @staticmethod
    def planner(**kwargs: Any) -> Any:
        """A ``torch.distributed.checkpoint.DefaultLoadPlanner`` (``kwargs`` go to it) that lets a
        rank beyond the saved world load: see the class docstring.

        It changes only the requests of :class:`RNGStateful` instances whose rank the checkpoint
        lacks, before DCP plans the reads: such an instance asks for every saved rank's state
        (``on_mismatch="reseed"`` without ``load_from``) or for none (otherwise), and its
        :meth:`load_state_dict` then resumes or refuses with our error.
        """
        return planner_class()(**kwargs)

    def _plan(self, name: str, entry: Entry, metadata: Any) -> None:
        """The planner's step for this instance's ``entry``, DCP's top-level key ``name``, in a checkpoint described
        by ``metadata``: each state is read in the structure it was saved in (``saved_template``), whatever this
        rank's own holds (no streams yet, another layout: :func:`load_rng_state_dict` then adopts or refuses it);
        where this rank's key is absent, ask for every saved rank's state (reseed, no ``load_from``) or for none,
        and note which ranks it holds."""
        prefix = f"{name}."
        saved: Collection[str] = metadata.state_dict_metadata
        ranks = {int(m[1]) for fqn in saved if fqn.startswith(prefix) and (m := _RANK_KEY.match(fqn, len(prefix)))}
        [(key, template)] = entry.items()
        reseed = self._load["on_mismatch"] == "reseed" and self._load_from is None
        if int(key[len("rank_") :]) in ranks and not reseed:
            entry[key] = saved_template(metadata, name, key) or template
            return
        entry.saved = sorted(ranks)
        entry.clear()
        if reseed:  # its own state may have been saved elsewhere on the mesh: every rank's, to choose by coordinates
            entry.update(
                {f"rank_{r}": saved_template(metadata, name, f"rank_{r}") or copy.deepcopy(template) for r in ranks}
            )  # DCP reads into each

    def _stand_in(self, why: str, loaded: Mapping[str, Any]) -> str:
        """The key of the saved state this rank resumes from where its own key cannot serve (``why``: none,
        or one saved at other coordinates): the one saved at this rank's coordinates modulo the saved
        extents (``on_mismatch="reseed"``, no ``load_from``); otherwise our error, naming what the
        checkpoint holds."""
        saved = getattr(loaded, "saved", None)
        held = [f"rank_{r}" for r in saved] if saved is not None else sorted(map(str, loaded), key=_in_rank_order)
        refusal = f"{why} (it holds {_ranks_named(held)}); "
        if not held:
            raise InvalidArgumentError(refusal + "was it saved with an RNGStateful under this key?")
        if self._load["on_mismatch"] != "reseed" or self._load_from is not None or not loaded:
            if self._load_from is not None:
                raise InvalidArgumentError(refusal + "load_from must name a saved rank.")
            how = "pass" if saved is not None else "load with planner=RNGStateful.planner() and"
            raise InvalidArgumentError(
                refusal + f"it was saved by another world size: {how} on_mismatch='reseed' to resume from the saved "
                "rank at this rank's coordinates, or name one with load_from=."
            )
        states = dict(loaded)
        for state in states.values():
            check_saved(state)  # typed errors for anything that is not a saved state
        here = self._coordinates()
        points = {
            name: point
            for name, state in states.items()
            if isinstance(point := state.get("coords"), Mapping) and here is not None and set(point) == set(here)
        }
        if here is None or len(points) != len(states):
            raise InvalidArgumentError(
                refusal + "a saved rank to resume from is chosen by its coordinates, and "
                + ("this rank's are not known (pass coords= or seed with apply_layout)" if here is None else
                   f"the saved ranks' do not all name this rank's dimensions {sorted(here)}")
                + ": name one with load_from=."
            )  # fmt: skip
        extents = {dim: 1 + max(p[dim] for p in points.values()) for dim in here}
        wanted = {dim: here[dim] % extents[dim] for dim in here}
        found = [name for name, p in points.items() if dict(p) == wanted]
        if len(found) != 1:
            raise InvalidArgumentError(
                refusal + f"{'none' if not found else 'more than one'} of them was saved at {wanted} (this rank's "
                f"coordinates {here} modulo the saved extents {extents}): name one with load_from=."
            )
        return found[0]

    def _coordinates(self) -> dict[str, int] | None:
        """This rank's coordinates: those given, else those :func:`hyperrng.apply_layout` recorded."""
        if self._load["coords"] is not None:
            return dict(mesh_coordinates(self._load["coords"]))
        recorded = recorded_derivation(self._load["tracker"])
        return None if recorded is None else dict(recorded.coords)


_RANK_KEY = re.compile(r"rank_(\d+)\.")
_WHY = 200  # bytes of a failed rank's error that reach the others


def _in_rank_order(key: str) -> tuple[int, str]:
    """Sorts ``rank_2`` before ``rank_10``."""
    return len(key), key


def _ranks_named(keys: list[str]) -> str:
    """``keys`` for a message: all of a few, else the first and last and how many."""
    if not keys:
        return "none"
    if len(keys) <= 4:
        return ", ".join(keys)
    return f"{len(keys)} ranks' states, {keys[0]} to {keys[-1]}"
