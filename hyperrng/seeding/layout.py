"""A declarative stream layout: each stream names the mesh dimensions it varies over.

A layout derives each stream's seed from this rank's coordinates on those dimensions. The
additive recipes of Megatron-core and slapo (``seed + 2718 + tp_rank``,
``seed + 1024 + 100 * ep_rank + etp_rank``) give two different streams the same seed as
soon as a parallel dimension is large enough (TP=8 and EP >= 18 is enough). A layout
replaces them::

    layout = StreamLayout(
        dims=("pp", "dp", "cp", "tp", "ep"),
        default=("pp",),
        streams={
            "model-parallel-rng": ("pp", "tp"),
            "expert-parallel-rng": ("pp", "ep"),
            "context-parallel-rng": ("pp", "cp", "tp"),
        },
    )
    apply_layout(layout, base_seed=1234, coords={"pp": 1, "dp": 3, "cp": 0, "tp": 5, "ep": 2})

The seed formula and what it guarantees: :meth:`StreamLayout.seed`; recorded derivations: :func:`recorded_derivation`.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import hyperrng.platforms as platforms
from hyperrng._guard.exclusive import refuse_inside_contexts
from hyperrng.errors import ArgumentTypeError, InvalidArgumentError
from hyperrng.platforms.mix import combine64
from hyperrng.platforms.validate import MAX_SEED, check_instance, check_int, check_seed
from hyperrng.streams._device_state import device_keys
from hyperrng.streams.tracker import Replacing, RNGStatesTracker, resolve_tracker

__all__ = [
    "DEFAULT_STREAM",
    "LAYOUT_DOMAIN",
    "LAYOUT_FORMAT_VERSION",
    "MAX_DIMS",
    "MAX_STREAMS",
    "Derivation",
    "StreamLayout",
    "apply_layout",
    "mesh_coordinates",
    "name_hash",
    "recorded_derivation",
]

DEFAULT_STREAM = "default"
"""Reserved name of the default generator's stream (what code outside any fork draws from)."""

LAYOUT_DOMAIN = 0x4C41594F55543031  # "LAYOUT01": keeps layout seeds apart from other uses of combine64
"""First value mixed into every layout seed; changing it would change every derived seed."""

LAYOUT_FORMAT_VERSION = 1
"""Version of the :meth:`StreamLayout.to_dict` format."""

MAX_DIMS = 16
"""Mesh dimensions a layout may name. Megatron-style meshes use at most six or seven
(pp, dp, cp, tp, ep, etp); a mesh of 16 dimensions of size 2 already has 65,536 ranks."""

MAX_STREAMS = 1024
"""Named streams a layout may declare (the default stream not counted). Training code uses a
handful; the limit bounds what a checkpoint's layout can make a load build."""

_HASH_BYTES = 8
_PERSONS = {"stream": b"hyperrng.stream", "dim": b"hyperrng.dim"}
_NAME_HASH_CACHE = 1024  # names are few; caching keeps per-rank seed tables cheap


@functools.lru_cache(maxsize=_NAME_HASH_CACHE)
def name_hash(name: str, *, kind: str = "stream") -> int:
    """Return the stable 64-bit hash of a stream name (``kind="stream"``) or dimension name (``"dim"``).

    It is the first 8 bytes, little-endian, of BLAKE2b over the UTF-8 name, personalised
    with ``b"hyperrng.stream"`` or ``b"hyperrng.dim"``.
    """
    if kind not in _PERSONS:
        raise InvalidArgumentError(f"kind must be one of {list(_PERSONS)}, got {kind!r}.")
    person = _PERSONS[kind]
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=_HASH_BYTES, person=person).digest()
    return int.from_bytes(digest, "little")


class StreamLayout:
    """Which mesh dimensions each stream varies over.

    Args:
        dims: the names of the mesh dimensions (e.g. ``("pp", "dp", "cp", "tp", "ep")``).
        default: the dimensions the default generator varies over (``()`` for "the same
            on every rank").
        streams: ``{stream name: dimensions it varies over}``, in the order the seed
            formula mixes them.

    Raises:
        InvalidArgumentError: a name is not a non-empty string, ``dims`` repeats a name, a stream
            varies over a dimension twice or over one that ``dims`` does not name, or a
            stream is called :data:`DEFAULT_STREAM`; or ``dims`` names more than :data:`MAX_DIMS`
            dimensions or ``streams`` declares more than :data:`MAX_STREAMS` streams (both
            counted before anything else is read, so a forged checkpoint's layout costs time
            linear in its size).
    """

    def __init__(self, dims: Sequence[str], default: Sequence[str], streams: Mapping[str, Sequence[str]]) -> None:
        dim_list = _names(dims, "mesh dimension", limit=MAX_DIMS)
        known = set(dim_list)
        if len(known) != len(dim_list):
            raise InvalidArgumentError(f"mesh dimensions {dim_list} repeat a name; each dimension needs its own name.")
        if not isinstance(streams, Mapping):
            raise ArgumentTypeError(
                f"streams must map a stream name to its dimensions, such as {{'tp-rng': ('tp',)}}, "
                f"got {type(streams).__name__}."
            )
        if len(streams) > MAX_STREAMS:
            raise InvalidArgumentError(
                f"a layout declares at most {MAX_STREAMS} streams (hyperrng.seeding.layout.MAX_STREAMS), "
                f"got {len(streams)}; "
                "declare only the streams the run forks."
            )
        table: dict[str, tuple[str, ...]] = {DEFAULT_STREAM: _stream_dims(DEFAULT_STREAM, default, dim_list, known)}
        for name in _names(list(streams), "stream"):
            if name == DEFAULT_STREAM:
                raise InvalidArgumentError(
                    f"{DEFAULT_STREAM!r} is reserved for the default generator; declare its dimensions with default=."
                )
            table[name] = _stream_dims(name, streams[name], dim_list, known)
        self._dims = tuple(dim_list)
        self._dim_set = frozenset(known)
        self._streams = table

    @property
    def dims(self) -> tuple[str, ...]:
        """The mesh dimension names, in declaration order."""
        return self._dims

    @property
    def streams(self) -> dict[str, tuple[str, ...]]:
        """``{stream name: dimensions}`` for the named streams (the default stream excluded)."""
        return {name: dims for name, dims in self._streams.items() if name != DEFAULT_STREAM}

    @property
    def default(self) -> tuple[str, ...]:
        """The dimensions the default generator varies over."""
        return self._streams[DEFAULT_STREAM]

    # -- seeds ----------------------------------------------------------------------------
    def seed(self, stream: str, base_seed: int, coords: Mapping[str, int] | object) -> int:
        """Return the seed of ``stream`` (or :data:`DEFAULT_STREAM`) for the rank at ``coords``.

        ``coords`` maps every dimension of the layout to this rank's coordinate, or is a
        mesh object (see :func:`mesh_coordinates`).

        **The seed of a stream** is, for a stream ``name`` varying over dimensions
        ``d1, ..., dk`` (in the order the stream declares them) with this rank's coordinates
        ``c1, ..., ck``::

            combine64(LAYOUT_DOMAIN, base_seed, name_hash(name),
                      dim_hash(d1), c1, ..., dim_hash(dk), ck)

        where ``combine64`` is :func:`hyperrng.platforms.mix.combine64` (SplitMix64 steps) and the hashes
        are the first 8 bytes, little-endian, of BLAKE2b over the UTF-8 name with a personalisation
        string (``hyperrng.stream`` / ``hyperrng.dim``) — stable across processes, machines and
        Python versions, unlike ``hash()``. The default generator's seed is the same formula with
        the reserved name :data:`DEFAULT_STREAM`.

        Consequences:

        * ranks with equal coordinates on a stream's dimensions share that stream (replicas
          draw the same numbers), whatever their coordinates on the other dimensions;
        * mesh *sizes* never enter the formula, so growing a dimension, or adding a dimension a
          stream does not vary over, leaves every existing stream's seed unchanged;
        * two ranks of one stream that differ only in its last dimension are guaranteed distinct
          (the last mixing step is a bijection); any other pair collides with probability
          2**-64, i.e. below 1e-12 for a million (stream, coordinate) pairs.
          :meth:`StreamLayout.check_distinct` verifies a concrete mesh exhaustively.

        Raises:
            InvalidArgumentError: unknown stream, or coordinates that are missing, extra, negative or not ints;
                or ``base_seed`` is not an int in [0, 2**64 - 1].
            ArgumentTypeError: ``stream`` is not a string.
        """
        check_instance(stream, str, "stream")
        if stream not in self._streams:
            raise InvalidArgumentError(f"the layout has no stream {stream!r}; it declares {list(self._streams)}.")
        return self.seeds(base_seed, coords)[stream]

    def seeds(
        self, base_seed: int, coords: Mapping[str, int] | object, *, bases: Mapping[str, int] | None = None
    ) -> dict[str, int]:
        """Return ``{stream: seed}`` for every stream, the default stream first (see :meth:`seed`).

        ``bases`` gives some streams a base seed of their own in place of ``base_seed``: a resume
        at another world size re-derives each stream from what the ranks that share it share
        (:func:`hyperrng.resume.state.resume_seed`); a mapping of stream name to seed, else
        :class:`ArgumentTypeError`."""
        base = check_seed(base_seed, "base_seed")
        point = self._coords(coords)
        if bases is not None and not isinstance(bases, Mapping):
            raise ArgumentTypeError(f"bases must be a mapping of stream name to base seed, got {type(bases).__name__}.")
        own = (
            {}
            if bases is None
            else {name: check_seed(value, f"base seed of {name!r}") for name, value in bases.items()}
        )
        return {name: self._mix(own.get(name, base), name, dims, point) for name, dims in self._streams.items()}

    def check_distinct(self, base_seed: int, sizes: Mapping[str, int]) -> int:
        """Verify that every (stream, coordinates) of a mesh of ``sizes`` gets its own seed.

        Enumerates, for each stream, the coordinates on its own dimensions only (ranks
        that share a stream share its seed by construction), so the cost is the sum over
        streams of the product of their dimensions' sizes, not the number of ranks.

        Returns:
            The number of distinct (stream, coordinates) pairs checked.

        Raises:
            InvalidArgumentError: two pairs share a seed (the message names both), or ``sizes``
                does not give a positive int for every dimension.
        """
        base = check_seed(base_seed, "base_seed")
        extent = self._coords(sizes, what="size", minimum=1)
        seen: dict[int, tuple[str, tuple[int, ...]]] = {}
        for name, dims in self._streams.items():
            for point in itertools.product(*(range(extent[d]) for d in dims)):
                seed = self._mix(base, name, dims, dict(zip(dims, point)))
                other = seen.setdefault(seed, (name, point))
                if other != (name, point):
                    raise InvalidArgumentError(
                        f"streams {other[0]!r} at {dict(zip(self._streams[other[0]], other[1]))} and {name!r} at "
                        f"{dict(zip(dims, point))} share seed {seed} for base seed {base}; pick another base seed."
                    )
        return len(seen)

    def seed_tracker(
        self,
        tracker: RNGStatesTracker,
        base_seed: int,
        coords: Mapping[str, int] | object,
        *,
        bases: Mapping[str, int] | None = None,
    ) -> dict[str, int]:
        """Reset ``tracker``, add every named stream, and seed the default generator
        (``bases``: see :meth:`seeds`).

        The default stream's seed goes to the current device's default generator and, on
        a platform whose device is not the CPU, also to torch's CPU generator, so code
        outside forks follows the default stream's sharing on both. Python's ``random``
        and NumPy are left alone (the seeding recipes cover them).

        Returns:
            ``{stream: seed}`` as :meth:`seeds` computes it.

        Raises:
            InvalidArgumentError: see :meth:`seeds`; raised before anything changes;
                or two of this rank's streams share a seed (probability 2**-64).
            InvalidOperationError: a fork of ``tracker`` is active;
                or another thread holds torch's CPU generator or the current device's.
            ArgumentTypeError: ``tracker`` is not an :class:`RNGStatesTracker`.

        Everything is validated first; then the tracker is replaced (:meth:`RNGStatesTracker.reseed`)
        and the default generator seeded with signals deferred, so an error or a Ctrl-C leaves
        everything as it was or as after the call. Forks of ``tracker`` that their own exits can
        no longer leave are cleared first (see the tracker's *Recovery*).
        """
        check_instance(tracker, RNGStatesTracker, "tracker")
        seeds = self.seeds(base_seed, coords, bases=bases)
        default_seed = seeds[DEFAULT_STREAM]
        own = None if bases is None else {name: int(value) for name, value in bases.items() if name in self._streams}
        derivation = Derivation(self, check_seed(base_seed, "base_seed"), self._coords(coords), own or None)
        platform = platforms.current()
        keys = device_keys(platform, [platform.current_device()])
        # Refused before anything is seeded (inside another context that swapped the generator too: its exit would
        # undo the default generator's seed); then the streams, the generators and the record, or none of them
        refuse_inside_contexts(keys, "seed a stream layout", tracker.owns)
        with Replacing(tracker, "reseed the tracker", holds=keys, holding_what="seeding a stream layout").applying():
            tracker.reseed({name: seed for name, seed in seeds.items() if name != DEFAULT_STREAM})
            platform.manual_seed(default_seed)
            if platform.device_type != "cpu":  # the host too; all 64 bits, unlike torch.manual_seed
                platforms.seed_generator(torch.default_generator, default_seed)
            _record(tracker, derivation)
        return seeds

    # -- serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Return the layout as JSON-compatible plain data (lists, strings, ints).

        A layout is plain data: this and :meth:`StreamLayout.from_dict` round-trip it through
        JSON-compatible values (checkpoints store it).
        """
        return {
            "version": LAYOUT_FORMAT_VERSION,
            "domain": LAYOUT_DOMAIN,
            "dims": list(self._dims),
            "default": list(self.default),
            "streams": {name: list(dims) for name, dims in self.streams.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StreamLayout:
        """Rebuild a layout from :meth:`to_dict` output.

        Raises:
            InvalidArgumentError: ``data`` is not such a dict, or comes from another format
                version or mixing domain (its seeds would not be reproduced).
        """
        if not isinstance(data, Mapping):
            raise ArgumentTypeError(
                f"a layout dict is a mapping (what StreamLayout.to_dict() returned), got {type(data).__name__}."
            )
        missing = [key for key in ("version", "domain", "dims", "default", "streams") if key not in data]
        if missing:
            raise InvalidArgumentError(f"layout dict lacks {missing}; pass what StreamLayout.to_dict() returned.")
        version, domain = data["version"], data["domain"]
        exact = type(version) is int and type(domain) is int  # a forged tensor here has no truth value
        if not exact or (version, domain) != (LAYOUT_FORMAT_VERSION, LAYOUT_DOMAIN):
            raise InvalidArgumentError(
                f"layout dict has version {data['version']!r} and domain {data['domain']!r}; this hyperrng "
                f"reads version {LAYOUT_FORMAT_VERSION} with domain {LAYOUT_DOMAIN} only."
            )
        return cls(dims=data["dims"], default=data["default"], streams=data["streams"])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StreamLayout):
            return NotImplemented
        return self._dims == other._dims and self._streams == other._streams

    def __hash__(self) -> int:
        return hash((self._dims, frozenset(self._streams.items())))  # order-free, like __eq__

    def __repr__(self) -> str:
        return f"StreamLayout(dims={self._dims}, default={self.default}, streams={self.streams})"

    # -- helpers --------------------------------------------------------------------------
    @staticmethod
    def _mix(base: int, name: str, dims: tuple[str, ...], point: Mapping[str, int]) -> int:
        values = [LAYOUT_DOMAIN, base, name_hash(name)]
        for dim in dims:
            values += (name_hash(dim, kind="dim"), point[dim])
        return combine64(*values)

    def _coords(self, coords: object, what: str = "coordinate", minimum: int = 0) -> dict[str, int]:
        point = coords if isinstance(coords, Mapping) else mesh_coordinates(coords)
        extra = [d for d in point if d not in self._dim_set]
        if extra:
            raise InvalidArgumentError(
                f"{what}s given for {extra}, which the layout does not have (dims {list(self._dims)}): give "
                f"{what}s for those dims only, or add {extra} to the layout's dims."
            )
        missing = [d for d in self._dims if d not in point]
        if missing:
            raise InvalidArgumentError(
                f"{what}s lack dimension(s) {missing}; give one for every dimension {list(self._dims)}."
            )
        return {d: _check_int(point[d], f"{what} of {d!r}", minimum) for d in self._dims}


@dataclass(frozen=True)
class Derivation:
    """How a tracker's streams were derived: ``layout.seeds(base_seed, coords, bases=bases)``
    (``bases``: the streams' own base seeds after a resume at another world size, else ``None``)."""

    layout: StreamLayout
    base_seed: int
    coords: dict[str, int] = field(hash=False)
    bases: dict[str, int] | None = field(default=None, hash=False)

    def seeds(self) -> dict[str, int]:
        """``{stream: seed}`` as derived."""
        return self.layout.seeds(self.base_seed, self.coords, bases=self.bases)


def _record(tracker: RNGStatesTracker, derivation: Derivation | None) -> None:
    """Remember beside ``tracker`` (pickled and copied with it) that its current streams come from
    ``derivation``, with their seeds now, or forget (``None``) what was remembered. A recipe, reseed,
    add or reset changes those seeds, which retires the record (see :func:`recorded_derivation`)."""
    tracker._derivation = None if derivation is None else (derivation, tracker.seeds())


def recorded_derivation(tracker: RNGStatesTracker | None = None) -> Derivation | None:
    """The derivation of ``tracker``'s streams (default: the process-wide tracker), or ``None``.

    ``None`` unless :func:`apply_layout` (or loading a checkpoint that carried one) seeded
    the streams it holds now: once anything else reseeds, adds or resets its streams,
    the record no longer describes them and is dropped. Restoring states with
    ``set_states`` keeps it (the same streams, at other positions).

    **Derivations are remembered.** Seeding a tracker from a layout (:func:`apply_layout`)
    records the :class:`Derivation` (layout, base seed, coordinates) beside that tracker;
    this function returns it for as long as the tracker still holds the streams
    it created. :func:`hyperrng.rng_state_dict` stores it in every checkpoint, so a resume at
    another world size can re-derive the streams without the user having planned for it.
    """
    chosen = resolve_tracker(tracker)
    record = chosen._derivation
    if record is None:
        return None
    derivation, seeds = record
    if chosen.seeds() != seeds:
        chosen._derivation = None
        return None
    return derivation


def mesh_coordinates(mesh: Mapping[str, int] | object) -> dict[str, int]:
    """Return ``{dim name: this rank's coordinate}`` of ``mesh``.

    ``mesh`` is either such a mapping or an object with ``mesh_dim_names`` and
    ``get_coordinate()``, like ``torch.distributed.DeviceMesh``.

    Raises:
        ArgumentTypeError: ``mesh`` is neither a mapping nor a mesh, or a name or
            coordinate has the wrong type.
        InvalidArgumentError: the mesh has no dimension names, this rank is not in it, or a
            coordinate is negative.
    """
    if isinstance(mesh, Mapping):
        if not all(isinstance(k, str) for k in mesh):
            raise ArgumentTypeError(f"mesh dimension names must be strings, got {list(mesh)}.")
        if not all(mesh):
            raise InvalidArgumentError(f"mesh dimension names must be non-empty strings, got {list(mesh)}.")
        return {name: _check_int(value, f"coordinate of {name!r}") for name, value in mesh.items()}
    names = getattr(mesh, "mesh_dim_names", None)
    get_coordinate = getattr(mesh, "get_coordinate", None)
    if not callable(get_coordinate):
        raise ArgumentTypeError(
            f"expected a mapping of dimension name to coordinate or a DeviceMesh, got {type(mesh).__name__}."
        )
    if not names:
        raise InvalidArgumentError(
            "the mesh has no mesh_dim_names; create it with names (e.g. init_device_mesh(..., mesh_dim_names=...))."
        )
    coordinate = get_coordinate()
    if coordinate is None:
        raise InvalidArgumentError("this rank is not part of the mesh (get_coordinate() returned None).")
    if len(coordinate) != len(names):
        raise InvalidArgumentError(f"the mesh has {len(names)} dimension names but {len(coordinate)} coordinates.")
    return {name: _check_int(value, f"coordinate of {name!r}") for name, value in zip(names, coordinate)}


def apply_layout(
    layout: StreamLayout,
    base_seed: int,
    coords: Mapping[str, int] | object,
    *,
    tracker: RNGStatesTracker | None = None,
) -> dict[str, int]:
    """Seed ``tracker`` (default: the process-wide one) and the default generator from ``layout``.

    See :meth:`StreamLayout.seed_tracker`; returns ``{stream: seed}``.
    """
    check_instance(layout, StreamLayout, "layout")
    return layout.seed_tracker(resolve_tracker(tracker), base_seed, coords)


def _names(values: object, what: str, limit: int | None = None, owner: str = "") -> list[str]:
    """``values`` checked as a sequence of names of ``what`` (``owner``: whose, as " of stream 'x'")."""
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise ArgumentTypeError(
            f"{what}s{owner} must be a sequence of names such as ('pp', 'tp'), got {values!r:.200}."
        )
    if limit is not None and len(values) > limit:
        raise InvalidArgumentError(
            f"a layout names at most {limit} {what}s (hyperrng.seeding.layout.MAX_DIMS), got {len(values)}; "
            "leave out dimensions no stream varies over."
        )
    for value in values:
        if not isinstance(value, str):
            raise ArgumentTypeError(f"a {what} name{owner} must be a string, got {type(value).__name__} {value!r}.")
        if not value:
            raise InvalidArgumentError(f"a {what} name{owner} must be a non-empty string, got ''.")
    return list(values)


def _stream_dims(name: str, varies: object, dims: Sequence[str], known: set[str]) -> tuple[str, ...]:
    """``varies`` checked against the layout's dimensions ``dims`` (``known``: their set, built once
    by the caller, so that checking every stream costs time linear in the layout's size)."""
    listed = _names(varies, "dimension", owner=f" of stream {name!r}")
    unknown = [d for d in listed if d not in known]
    if unknown:
        raise InvalidArgumentError(
            f"stream {name!r} varies over {unknown}, which is not a mesh dimension {list(dims)}."
        )
    seen: set[str] = set()
    repeated: set[str] = set()
    for d in listed:
        (repeated if d in seen else seen).add(d)
    if repeated:
        raise InvalidArgumentError(
            f"stream {name!r} varies over {sorted(repeated)} more than once; list each dimension once."
        )
    return tuple(listed)


def _check_int(value: object, what: str, minimum: int = 0) -> int:
    number = check_int(value, what)
    if not minimum <= number <= MAX_SEED:
        # The mix takes 64-bit words: a larger coordinate would alias a smaller one.
        raise InvalidArgumentError(f"{what} must be in [{minimum}, 2**64 - 1], got {number}.")
    return number
