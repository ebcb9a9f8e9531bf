"""Offset math for random ops on sharded tensors (DTensor semantics), with no process group.

For a tensor placed on a device mesh as DTensor places it, this module says which global
indices each rank's shard holds (:func:`local_shard`, :func:`local_index_ranges`), which window
of generator offsets a random op on that shard draws from and where every rank's offset goes
after it (:func:`rng_offsets`), and checks those windows over every rank of a mesh
(:func:`check_disjoint`), all from the mesh shape, placements and global shape alone.

Shards and placements: :func:`local_shard`; the offset contract, PyTorch's differences, limits: :func:`rng_offsets`.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from hyperrng.errors import ArgumentTypeError, InvalidArgumentError, RNGDesyncError
from hyperrng.platforms.validate import MAX_OFFSET, OFFSET_ALIGN, check_int
from hyperrng.sharding._offset_sums import DimState, Level, dim_state, start_of, tail_sums

if TYPE_CHECKING:
    from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "MAX_GLOBAL_NUMEL",
    "MAX_INDEX_RUNS",
    "MAX_MESH_SIZE",
    "PHILOX_OFFSET_ALIGNMENT",
    "OffsetFunction",
    "check_disjoint",
    "local_index_ranges",
    "local_shard",
    "rng_offsets",
]

PHILOX_OFFSET_ALIGNMENT: Final = OFFSET_ALIGN
"""Generator offsets advance in multiples of this: one Philox call yields four 32-bit values."""

MAX_MESH_SIZE: Final = 2**63
"""Most ranks a mesh may have, so that every rank index fits an int64 as in torch."""

MAX_GLOBAL_NUMEL: Final = 2**63 - 1
"""Largest element count of a global shape, and largest size of one of its dims (int64, as
``torch.Size`` stores them)."""

MAX_INDEX_RUNS: Final = 2**20
"""Most separate index runs :func:`local_index_ranges` lists for one tensor dim. Only
``_StridedShard`` splits a dim into several runs, about ``split_factor`` of them per level;
a larger product is refused at once instead of being enumerated."""

OffsetFunction = Callable[[Sequence[int], Sequence[int], Sequence["Placement"], Sequence[int]], tuple[int, int]]
"""The signature of :func:`rng_offsets`: ``(mesh_shape, coordinate, placements, global_shape)``."""


class _Split(NamedTuple):
    """A normalised ``Shard``/``_StridedShard``: ``Shard(d)`` is ``_Split(d, 1)``."""

    dim: int
    split_factor: int


# ------------------------------------------------------------------------------------ public


def rng_offsets(
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    global_shape: Sequence[int],
) -> tuple[int, int]:
    """Return the generator-offset increments for a random op on this rank's shard.

    **The offset contract.** Shards are numbered as PyTorch numbers them (shards and replicas
    as :func:`local_shard` describes them): along each tensor dim, a shard's piece index
    is the mixed-radix number formed by the rank's coordinates on the mesh dims that shard that
    tensor dim (in mesh-dim order); the *linear shard index* ``k`` is the row-major number of
    those piece indices over the tensor dims. With ``K`` distinct shards, ``numel_j`` the element
    count of shard ``j`` and ``r4(x)`` ``x`` rounded up to a multiple of 4::

        start_k = r4(numel_0) + ... + r4(numel_{k-1})       end = r4(numel_0) + ... + r4(numel_{K-1})

    This function returns ``(start_k, end)``: add ``start_k`` to the generator offset
    before the op on this rank, and ``end`` to the offset it had before the op, on every rank,
    afterwards. Hence, for every placement this module accepts: the windows
    ``[start_k, start_k + numel_k)`` of distinct shards are disjoint, replicas get identical
    windows, every window lies inside ``[0, end)``, and both numbers are multiples of 4 because
    CUDA's Philox generator hands out its counter in blocks of four 32-bit values and refuses
    other offsets (``aten/src/ATen/cuda/CUDAGeneratorImpl.cpp``). :func:`check_disjoint`
    verifies these properties over every rank of a mesh.

    **Where this differs from PyTorch.** PyTorch's ``OffsetBasedRNGTracker``
    (``torch/distributed/tensor/_random.py``) uses ``start = r4(k * numel_first)`` and
    ``end = r4(numel(global_shape))``, where ``numel_first`` is the size of shard 0 computed by
    applying each ``Shard`` to the *global* size of its tensor dim. When every shard has the same
    element count, that count is a multiple of 4 and no tensor dim is sharded by more than one
    mesh dim, both formulas give the same numbers. Otherwise PyTorch's windows can collide or
    leave ``[0, end)``:

    * uneven splits: a ``(10,)`` tensor over 4 ranks has shards of 3, 3, 3 and 1 elements;
      PyTorch gives the last one ``[12, 13)`` with ``end = 12``, so its numbers are drawn
      again by the next random op. Here the windows start at 0, 4, 8, 12 and ``end = 16``.
    * shard sizes that are not multiples of 4: rounding ``k * numel_first`` up makes windows
      overlap (a ``(10, 10)`` tensor on a 4x4 mesh: ``[12, 21)`` and ``[20, 29)``).
    * a tensor dim sharded by two mesh dims: PyTorch sizes the shard from the last mesh dim
      alone, so a ``(16,)`` tensor on a 2x2 mesh gets windows at 0, 8, 16, 24 with
      ``end = 16``. Here they start at 0, 4, 8, 12.

    The price is that ``end`` may exceed ``r4(numel(global_shape))`` by less than 4 per shard, so
    the generator advances a little further than under PyTorch when shard sizes are uneven or
    not multiples of 4.

    **Cost, limits and errors.** This function, :func:`local_shard` and :func:`local_index_ranges`
    answer for one rank without enumerating ranks or shards: the cost grows with the number of
    mesh and tensor dims (and, for a tensor dim split by several mesh dims or by ``_StridedShard``,
    with the number of *distinct* piece sizes, a few per level), never with the number of ranks;
    ``local_index_ranges`` also costs as much as the ranges it returns. :func:`check_disjoint`
    visits every rank. Nothing is cached: every call validates all its arguments. A mesh may
    have up to :data:`MAX_MESH_SIZE` (``2**63``) ranks and a global shape up to
    :data:`MAX_GLOBAL_NUMEL` (``2**63 - 1``) elements; larger ones, and shardings whose ``end``
    would pass ``2**63 - 1`` (the largest generator offset), raise
    :class:`~hyperrng.errors.InvalidArgumentError`.

    One rule throughout: an argument of the wrong type (a size given as ``2.7`` or ``True``,
    a mesh shape given as a string, an object that is not a placement) raises
    :class:`~hyperrng.errors.ArgumentTypeError`, a ``TypeError``; a wrong value of the right
    type (a coordinate outside the mesh, a ``Shard`` dim outside the tensor, a negative size)
    raises :class:`~hyperrng.errors.InvalidArgumentError`, a ``ValueError``. Both messages name the
    argument. NumPy integers are accepted wherever Python ints are; floats are never truncated.

    Args:
        mesh_shape: sizes of the device mesh, one positive int per mesh dimension.
        coordinate: this rank's index along each mesh dimension.
        placements: one ``Shard``/``_StridedShard``/``Replicate``/``Partial`` per mesh
            dimension; negative ``Shard`` dims count from the end, as in DTensor.
        global_shape: shape of the whole (unsharded) tensor.

    Returns:
        ``(start, end)``: add ``start`` to the offset before the op on this rank; after it,
        every rank sets its offset to the one it had before the op plus ``end``. Both are
        multiples of :data:`PHILOX_OFFSET_ALIGNMENT` and at most ``2**63 - 1`` (the contract,
        and where it differs from PyTorch's, are stated above).

    Raises:
        ArgumentTypeError: a sequence that is not one, a size, index, ``dim`` or
            ``split_factor`` that is not an integer, or a placement of none of the four kinds.
        InvalidArgumentError: a coordinate outside the mesh, a placement count other than the
            mesh's dimension count, a ``Shard`` dim outside the tensor, a ``split_factor``
            below 1, a negative size, a mesh dim below 1, a mesh or shape past the limits
            above, or offsets that would pass ``2**63 - 1``.
    """
    mesh, splits, shape, coord = _validate(mesh_shape, placements, global_shape, coordinate)
    levels = _levels(mesh, splits, len(shape))
    states = [dim_state(size, dim_levels, coord) for size, dim_levels in zip(shape, levels)]
    numels, tails, end = tail_sums(shape, [state[3] for state in states])
    if end > MAX_OFFSET:
        raise _end_overflow(mesh, splits, shape, end)
    return start_of(states, numels, tails), end


def local_shard(
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    global_shape: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return this rank's local shape and the global offset of its first element per dim.

    A tensor of ``global_shape`` is placed on a device mesh of ``mesh_shape`` by one placement
    per mesh dimension: PyTorch's ``Shard(dim)``, ``_StridedShard(dim, split_factor)`` (where
    the installed torch has it), ``Replicate()`` or ``Partial()``. Each rank, named by its
    ``coordinate`` in the mesh, holds one *shard*; ranks whose coordinates differ only on
    ``Replicate``/``Partial`` mesh dimensions hold the same shard and are its *replicas*.

    Shards follow DTensor exactly: mesh dimensions are applied in order, ``Shard`` splits the
    current local extent with ``torch.chunk`` semantics (chunks of ``ceil(n / parts)``, the
    trailing ones smaller or empty) and ``_StridedShard`` first cuts the extent into
    ``split_factor`` chunks, splits each of those, and concatenates piece ``c`` of every chunk
    for rank ``c``. This function and :func:`local_index_ranges` say which global
    indices a rank holds.

    Takes the same arguments as :func:`rng_offsets` and returns what PyTorch's
    ``compute_local_shape_and_global_offset`` returns: the offset of an unsharded dim is 0,
    and that of a sharded dim whose local extent is empty is the dim's global size.

    .. warning:: With ``_StridedShard`` a rank holds several separate index runs along a
       dim, and the offset names only the first; use :func:`local_index_ranges` for them all.

    Raises:
        ArgumentTypeError: as :func:`rng_offsets`.
        InvalidArgumentError: as :func:`rng_offsets`, except that offsets past ``2**63 - 1``
            are no error here.
    """
    mesh, splits, shape, coord = _validate(mesh_shape, placements, global_shape, coordinate)
    runs_per_dim = _runs_at(mesh, splits, shape, coord)
    local_shape = tuple(sum(map(len, runs)) for runs in runs_per_dim)
    # An unsharded dim holds one run from 0, also when empty; only a sharded dim can hold none.
    return local_shape, tuple(runs[0].start if runs else size for runs, size in zip(runs_per_dim, shape))


def local_index_ranges(
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    global_shape: Sequence[int],
) -> tuple[tuple[range, ...], ...]:
    """Return, per tensor dim, the global index ranges this rank holds, in local order.

    Takes the same arguments as :func:`rng_offsets`. Local index ``i`` along dim ``d`` is
    global index ``list(itertools.chain(*result[d]))[i]``. A ``Shard``-only placement gives
    at most one range per dim; ``_StridedShard`` may give several; an empty extent gives
    none. Adjacent ranges are merged.

    Raises:
        ArgumentTypeError: as :func:`rng_offsets`.
        InvalidArgumentError: as :func:`local_shard`.
    """
    return _runs_at(*_validate(mesh_shape, placements, global_shape, coordinate))


def check_disjoint(
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    global_shape: Sequence[int],
    *,
    offsets: OffsetFunction | None = None,
) -> None:
    """Check the offset contract over every rank of the mesh.

    Computes ``(start, end)`` for every coordinate with ``offsets`` (default: this module's
    closed form, as :func:`rng_offsets` computes it) and checks that every rank gets the
    same ``end``, that both numbers are non-negative multiples of 4, that replicas get the
    same ``start``, and that the windows ``[start, start + local numel)`` of distinct
    non-empty shards are disjoint and lie inside ``[0, end)``. Local element counts come
    from the index ranges of :func:`local_index_ranges`, not from the offset formula. Pass
    another :data:`OffsetFunction` (PyTorch's formula, say) to audit it against the same
    rules.

    Raises:
        ArgumentTypeError: as :func:`rng_offsets`.
        InvalidArgumentError: invalid mesh, placements or shape, as :func:`rng_offsets`.
        RNGDesyncError: a rule is broken; the message names the ranks and windows.
    """
    mesh, splits, shape, _ = _validate(mesh_shape, placements, global_shape)
    levels = _levels(mesh, splits, len(shape))
    origin = (0,) * len(mesh)
    numels, tails, end = tail_sums(shape, [dim_state(size, lv, origin)[3] for size, lv in zip(shape, levels)])
    given = tuple(placements)
    if offsets is not None:
        end = int(offsets(mesh, origin, given, shape)[1])
    elif end > MAX_OFFSET:
        raise _end_overflow(mesh, splits, shape, end)
    # Per tensor dim and piece (the rank's coordinates on the mesh dims splitting it): its
    # closed-form state and its local size, counted from the index runs.
    memo: list[dict[tuple[int, ...], tuple[DimState, int]]] = [{} for _ in shape]
    seen: dict[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], int, int]] = {}  # shard -> (coord, start, numel)
    for coord in itertools.product(*(range(size) for size in mesh)):
        shard = tuple(tuple(coord[m] for m, _, _ in dim_levels) for dim_levels in levels)
        states, numel = [], 1
        for size, dim_levels, dim_memo, piece in zip(shape, levels, memo, shard):
            entry = dim_memo.get(piece)
            if entry is None:
                runs = _rank_runs(size, dim_levels, coord)
                entry = dim_memo[piece] = (dim_state(size, dim_levels, coord), sum(map(len, runs)))
            states.append(entry[0])
            numel *= entry[1]
        if offsets is None:
            start, rank_end = start_of(states, numels, tails), end
        else:
            start, rank_end = (int(n) for n in offsets(mesh, coord, given, shape))
        if start < 0 or start % PHILOX_OFFSET_ALIGNMENT or rank_end % PHILOX_OFFSET_ALIGNMENT:
            raise RNGDesyncError(
                f"rank at coordinate {coord} got offsets (start={start}, end={rank_end}); both must be "
                f"non-negative multiples of {PHILOX_OFFSET_ALIGNMENT}, the step of the Philox offset."
            )
        if rank_end != end:
            raise RNGDesyncError(
                f"ranks at coordinates {origin} and {coord} advance to different offsets after the op "
                f"(end={end} vs {rank_end}); every rank must apply the same end increment."
            )
        if shard not in seen:
            seen[shard] = (coord, start, numel)
        elif seen[shard][1] != start:
            raise RNGDesyncError(
                f"ranks at coordinates {seen[shard][0]} and {coord} hold the same shard but start at "
                f"offsets {seen[shard][1]} and {start}; replicas must draw the same numbers."
            )
    windows = sorted((start, start + numel, coord) for coord, start, numel in seen.values() if numel)
    for low, high, coord in windows:
        if high > end:
            raise RNGDesyncError(
                f"shard at coordinate {coord} draws from offsets [{low}, {high}), past end={end}; the next "
                f"random op would draw the same numbers again."
            )
    for (low_a, high_a, coord_a), (low_b, high_b, coord_b) in itertools.pairwise(windows):
        if low_b < high_a:
            raise RNGDesyncError(
                f"shards at coordinates {coord_a} and {coord_b} draw from overlapping offset windows "
                f"[{low_a}, {high_a}) and [{low_b}, {high_b}); they would hold repeated random values."
            )


def _levels(mesh: tuple[int, ...], splits: tuple[_Split | None, ...], ndim: int) -> list[list[Level]]:
    """Per tensor dim, the mesh dims that split it, in mesh-dim order; one-part splits dropped."""
    levels: list[list[Level]] = [[] for _ in range(ndim)]
    for mesh_dim, split in enumerate(splits):
        if split is not None and mesh[mesh_dim] > 1:  # one part is the whole extent, strided or not
            levels[split.dim].append((mesh_dim, mesh[mesh_dim], split.split_factor))
    return levels


def _end_overflow(
    mesh: tuple[int, ...], splits: tuple[_Split | None, ...], shape: tuple[int, ...], end: int
) -> InvalidArgumentError:
    shards = math.prod(size for size, split in zip(mesh, splits) if split is not None)
    return InvalidArgumentError(
        f"offsets for global_shape {shape} on mesh_shape {mesh} would end at {end}, past {MAX_OFFSET} "
        f"(2**63 - 1), the largest generator offset: each of the {shards} shards pads its window to a "
        f"multiple of {PHILOX_OFFSET_ALIGNMENT}. Use a smaller tensor or fewer shards."
    )


# ------------------------------------------------------------------------------------ index runs


def _runs_at(
    mesh: tuple[int, ...], splits: tuple[_Split | None, ...], shape: tuple[int, ...], coord: tuple[int, ...]
) -> tuple[tuple[range, ...], ...]:
    """Per tensor dim, the global runs the rank holds; an unsharded dim is one whole range."""
    sharded = {split.dim for split in splits if split is not None}
    return tuple(
        _rank_runs(size, dim_levels, coord) if dim in sharded else (range(size),)
        for dim, (size, dim_levels) in enumerate(zip(shape, _levels(mesh, splits, len(shape))))
    )


def _rank_runs(length: int, levels: list[Level], coord: Sequence[int]) -> tuple[range, ...]:
    """The global index runs the rank at ``coord`` holds along one tensor dim."""
    bound = math.prod(split_factor for _, _, split_factor in levels)
    if bound > MAX_INDEX_RUNS:
        raise InvalidArgumentError(
            f"the _StridedShard split factors {[f for _, _, f in levels if f > 1]} give a rank up to {bound} "
            f"separate index runs along one dim, more than MAX_INDEX_RUNS = 2**20 that are listed; "
            f"use a smaller split_factor."
        )
    runs = [range(length)] if length else []
    for mesh_dim, parts, split_factor in levels:
        if not runs:
            break
        runs = _part_runs(runs, parts, split_factor, coord[mesh_dim])
    return tuple(runs)


def _part_runs(runs: list[range], parts: int, split_factor: int, part: int) -> list[range]:
    """Piece ``part`` of a non-empty extent (global runs), split as ``_StridedShard`` splits it.

    ``split_factor == 1`` is plain ``Shard``. Only chunks where the piece is non-empty are
    visited, so the cost follows the number of runs returned.
    """
    length = sum(map(len, runs))
    chunk = -(-length // split_factor)
    full, rest = divmod(length, chunk)
    picks: list[tuple[int, int]] = []  # local [low, high) bounds of the piece, chunk by chunk
    low, high = _piece(chunk, parts, part)
    if low < high:
        picks.extend((i * chunk + low, i * chunk + high) for i in range(full))
    if rest:
        low, high = _piece(rest, parts, part)
        if low < high:
            picks.append((full * chunk + low, full * chunk + high))
    if len(runs) == 1:
        base = runs[0].start
        return _merge([range(base + a, base + b) for a, b in picks])
    starts = list(itertools.accumulate(map(len, runs[:-1]), initial=0))
    return _merge([piece for a, b in picks for piece in _take(runs, starts, a, b)])


def _piece(length: int, parts: int, part: int) -> tuple[int, int]:
    """``torch.chunk`` bounds of piece ``part`` of ``length`` in ``parts`` (empty past the end)."""
    size = -(-length // parts)
    return min(part * size, length), min((part + 1) * size, length)


def _take(runs: list[range], starts: list[int], low: int, high: int) -> list[range]:
    """The global runs behind local indices ``[low, high)`` of the concatenated ``runs``."""
    out = []
    i = bisect.bisect_right(starts, low) - 1
    while i < len(runs) and starts[i] < high:
        run, position = runs[i], starts[i]
        a, b = max(low - position, 0), min(high - position, len(run))
        if a < b:
            out.append(range(run.start + a, run.start + b))
        i += 1
    return out


def _merge(runs: list[range]) -> list[range]:
    merged: list[range] = []
    for run in runs:
        if merged and merged[-1].stop == run.start:
            merged[-1] = range(merged[-1].start, run.stop)
        else:
            merged.append(run)
    return merged


# ------------------------------------------------------------------------------------ validation


_NO_COORDINATE = object()  # check_disjoint's call: every coordinate of the mesh, none given


def _validate(
    mesh_shape: object, placements: object, global_shape: object, coordinate: object = _NO_COORDINATE
) -> tuple[tuple[int, ...], tuple[_Split | None, ...], tuple[int, ...], tuple[int, ...]]:
    """The arguments checked and normalised; ``coordinate`` too when given (else ``()``)."""
    mesh = _int_tuple(mesh_shape, "mesh_shape", minimum=1)
    ranks = math.prod(mesh)
    if ranks > MAX_MESH_SIZE:
        raise InvalidArgumentError(
            f"mesh_shape {mesh} has {ranks} ranks, more than {MAX_MESH_SIZE} (2**63); rank indices must fit an int64."
        )
    shape = _int_tuple(global_shape, "global_shape", minimum=0)
    numel = math.prod(shape)
    if numel > MAX_GLOBAL_NUMEL or (not numel and any(size > MAX_GLOBAL_NUMEL for size in shape)):
        raise InvalidArgumentError(
            f"global_shape {shape} has {numel} elements or a dim past {MAX_GLOBAL_NUMEL} (2**63 - 1); "
            f"torch sizes and element counts are int64."
        )
    given = _sequence(placements, "placements")
    if len(given) != len(mesh):
        raise InvalidArgumentError(
            f"got {len(given)} placements for a {len(mesh)}-dim mesh {mesh}; give exactly one per mesh "
            f"dim, Replicate() where a mesh dim does not shard the tensor (DTensor requires the same)."
        )
    splits = tuple(_split_of(placement, i, shape) for i, placement in enumerate(given))
    if coordinate is _NO_COORDINATE:
        return mesh, splits, shape, ()
    coord = _int_tuple(coordinate, "coordinate", minimum=0)
    if len(coord) != len(mesh):
        raise InvalidArgumentError(
            f"coordinate {coord} has {len(coord)} entries but the mesh {mesh} has {len(mesh)} dims; "
            f"give one index per mesh dim."
        )
    for dim, (index, size) in enumerate(zip(coord, mesh)):
        if index >= size:
            raise InvalidArgumentError(
                f"coordinate {coord} is outside the mesh {mesh}: index {index} on mesh dim {dim} must be below {size}."
            )
    return mesh, splits, shape, coord


def _split_of(placement: Any, mesh_dim: int, shape: tuple[int, ...]) -> _Split | None:
    kind = _kind_of(placement.__class__)
    if kind == "replica":
        return None
    if kind is None:
        known = ", ".join(t.__name__ for types in _placement_types().values() for t in types) or "none"
        raise ArgumentTypeError(
            f"placements[{mesh_dim}] is {placement!r} of type {type(placement).__name__}, not a placement "
            f"this module knows (this torch offers: {known}); pass torch.distributed.tensor placements."
        )
    split_factor = 1
    if kind == "strided":
        split_factor = check_int(getattr(placement, "split_factor", None), f"placements[{mesh_dim}].split_factor")
        if split_factor < 1:
            raise InvalidArgumentError(
                f"placements[{mesh_dim}] is {placement!r} with split_factor {split_factor}; it must be at least 1."
            )
    dim = check_int(getattr(placement, "dim", None), f"placements[{mesh_dim}].dim")
    ndim = len(shape)
    if not -ndim <= dim < ndim:
        raise InvalidArgumentError(
            f"placements[{mesh_dim}] is {placement!r} but the tensor of shape {shape} has {ndim} dims; "
            f"shard a dim in [{-ndim}, {ndim})."
            if ndim
            else f"placements[{mesh_dim}] is {placement!r} but the tensor is 0-dim and cannot be sharded; "
            f"use Replicate()."
        )
    return _Split(dim % ndim, split_factor)


@functools.lru_cache(maxsize=64)  # bounded like every cache here: a run has a handful of placement classes
def _kind_of(cls: type) -> str | None:
    """Classify a placement class once (``None``: not a placement); torch's ``isinstance`` checks are slow."""
    kinds = _placement_types()
    # _StridedShard first: torch releases before 2.6 derive it from Shard.
    return next((kind for kind in ("strided", "shard", "replica") if issubclass(cls, kinds[kind])), None)


@functools.cache
def _placement_types() -> dict[str, tuple[type[Any], ...]]:
    """The installed torch's placement classes by kind, imported on first use (the import takes ~1 s)."""
    try:
        from torch.distributed.tensor import placement_types as types
    except ImportError:  # torch built without distributed support: nothing can be placed
        return {"shard": (), "strided": (), "replica": ()}
    strided = (types._StridedShard,) if hasattr(types, "_StridedShard") else ()
    return {"shard": (types.Shard,), "strided": strided, "replica": (types.Replicate, types.Partial)}


def _sequence(value: object, name: str) -> Sequence[Any]:
    if isinstance(value, (tuple, list)):  # the common case, and far cheaper than the ABC check
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ArgumentTypeError(
            f"{name} must be a sequence (tuple, list or torch.Size), got {type(value).__name__} {value!r}."
        )
    return value


def _int_tuple(values: object, name: str, *, minimum: int) -> tuple[int, ...]:
    out = tuple(v if type(v) is int else check_int(v, f"{name}[{i}]") for i, v in enumerate(_sequence(values, name)))
    for i, v in enumerate(out):
        if v < minimum:
            raise InvalidArgumentError(f"{name}[{i}] is {v} in {out}; it must be at least {minimum}.")
    return out
