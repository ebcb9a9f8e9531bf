"""Offset math for random ops on sharded tensors (DTensor semantics), with no process group.

A tensor of ``global_shape`` is placed on a device mesh of ``mesh_shape`` by one placement
per mesh dimension: PyTorch's ``Shard(dim)``, ``_StridedShard(dim, split_factor)`` (where
the installed torch has it), ``Replicate()`` or ``Partial()``. Each rank, named by its
``coordinate`` in the mesh, holds one *shard*; ranks whose coordinates differ only on
``Replicate``/``Partial`` mesh dimensions hold the same shard and are its *replicas*.

Shards follow DTensor exactly: mesh dimensions are applied in order, ``Shard`` splits the
current local extent with ``torch.chunk`` semantics (chunks of ``ceil(n / parts)``, the
trailing ones smaller or empty) and ``_StridedShard`` first cuts the extent into
``split_factor`` chunks, splits each of those, and concatenates piece ``c`` of every chunk
for rank ``c``. :func:`local_shard` and :func:`local_index_ranges` say which global
indices a rank holds.

The offset contract
-------------------
Shards are numbered as PyTorch numbers them: along each tensor dim, a shard's piece index
is the mixed-radix number formed by the rank's coordinates on the mesh dims that shard that
tensor dim (in mesh-dim order); the *linear shard index* ``k`` is the row-major number of
those piece indices over the tensor dims. With ``K`` distinct shards, ``numel_j`` the element
count of shard ``j`` and ``r4(x)`` ``x`` rounded up to a multiple of 4::

    start_k = r4(numel_0) + ... + r4(numel_{k-1})       end = r4(numel_0) + ... + r4(numel_{K-1})

:func:`rng_offsets` returns ``(start_k, end)``: add ``start_k`` to the generator offset
before the op on this rank, and ``end`` to the offset it had before the op, on every rank,
afterwards. Hence, for every placement this module accepts: the windows
``[start_k, start_k + numel_k)`` of distinct shards are disjoint, replicas get identical
windows, every window lies inside ``[0, end)``, and both numbers are multiples of 4 because
CUDA's Philox generator hands out its counter in blocks of four 32-bit values and refuses
other offsets (``aten/src/ATen/cuda/CUDAGeneratorImpl.cpp``). :func:`check_disjoint`
verifies these properties over every rank of a mesh.

Where this differs from PyTorch
-------------------------------
PyTorch's ``OffsetBasedRNGTracker`` (``torch/distributed/tensor/_random.py``) uses
``start = r4(k * numel_first)`` and ``end = r4(numel(global_shape))``, where
``numel_first`` is the size of shard 0 computed by applying each ``Shard`` to the *global*
size of its tensor dim. When every shard has the same element count, that count is a
multiple of 4 and no tensor dim is sharded by more than one mesh dim, both formulas give
the same numbers. Otherwise PyTorch's windows can collide or leave ``[0, end)``:

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
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from hyperrng.errors import RNGDesyncError, ShardingError
from platforms.validate import OFFSET_ALIGN, round_up_offset

if TYPE_CHECKING:
    from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "PHILOX_OFFSET_ALIGNMENT",
    "OffsetFunction",
    "check_disjoint",
    "local_index_ranges",
    "local_shard",
    "rng_offsets",
]

PHILOX_OFFSET_ALIGNMENT: Final = OFFSET_ALIGN
"""Generator offsets advance in multiples of this: one Philox call yields four 32-bit values."""

OffsetFunction = Callable[[Sequence[int], Sequence[int], Sequence["Placement"], Sequence[int]], tuple[int, int]]
"""The signature of :func:`rng_offsets`: ``(mesh_shape, coordinate, placements, global_shape)``."""

_TABLE_CACHE_SIZE: Final = 256  # distinct (mesh, placements, shape) triples kept; a model has few


class _Split(NamedTuple):
    """A normalised ``Shard``/``_StridedShard``: ``Shard(d)`` is ``_Split(d, 1)``."""

    dim: int
    split_factor: int


class _Kind(enum.Enum):
    SHARD = "shard"
    STRIDED = "strided"
    REPLICA = "replica"  # Replicate and Partial: every rank along the mesh dim holds the same shard
    UNKNOWN = "unknown"


class _PlacementTypes(NamedTuple):
    shard: tuple[type[Any], ...]
    strided: tuple[type[Any], ...]
    replica: tuple[type[Any], ...]


@dataclass(frozen=True)
class _Table:
    """Everything about one (mesh, placements, shape) that does not depend on the rank."""

    shard_weights: tuple[int, ...]  # per mesh dim: weight of its coordinate in the linear shard index
    piece_weights: tuple[tuple[int, ...], ...]  # per tensor dim, per mesh dim: weight in the piece index
    pieces: tuple[tuple[tuple[range, ...], ...], ...]  # per tensor dim, per piece: global index runs
    sharded: tuple[bool, ...]  # per tensor dim: split by at least one mesh dim
    starts: tuple[int, ...]  # per linear shard index
    numels: tuple[int, ...]  # per linear shard index
    end: int


def rng_offsets(
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    global_shape: Sequence[int],
) -> tuple[int, int]:
    """Return the generator-offset increments for a random op on this rank's shard.

    Args:
        mesh_shape: sizes of the device mesh, one per mesh dimension.
        coordinate: this rank's index along each mesh dimension.
        placements: one ``Shard``/``_StridedShard``/``Replicate``/``Partial`` per mesh
            dimension; negative ``Shard`` dims count from the end, as in DTensor.
        global_shape: shape of the whole (unsharded) tensor.

    Returns:
        ``(start, end)``: add ``start`` to the offset before the op on this rank; after it,
        every rank sets its offset to the one it had before the op plus ``end``. Both are
        multiples of :data:`PHILOX_OFFSET_ALIGNMENT`; see the module docstring for the
        contract and where it differs from PyTorch's ``OffsetBasedRNGTracker``.

    Raises:
        ShardingError: a coordinate outside the mesh, a placement count other than the
            mesh's dimension count, a ``Shard`` dim outside the tensor, a negative or
            non-integer size, or an unknown placement type.
    """
    mesh, splits, shape = _normalise(mesh_shape, placements, global_shape)
    coord = _normalise_coordinate(coordinate, mesh)
    return _offsets_at(_table(mesh, splits, shape), coord)


def local_shard(
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    global_shape: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return this rank's local shape and the global offset of its first element per dim.

    Takes the same arguments as :func:`rng_offsets` and returns what PyTorch's
    ``compute_local_shape_and_global_offset`` returns: the offset of an unsharded dim is 0,
    and that of a sharded dim whose local extent is empty is the dim's global size.

    .. warning:: With ``_StridedShard`` a rank holds several separate index runs along a
       dim, and the offset names only the first; use :func:`local_index_ranges` for them all.

    Raises:
        ShardingError: as :func:`rng_offsets`.
    """
    mesh, splits, shape = _normalise(mesh_shape, placements, global_shape)
    coord = _normalise_coordinate(coordinate, mesh)
    table = _table(mesh, splits, shape)
    runs_per_dim = _runs_at(table, coord)
    local_shape = tuple(sum(len(run) for run in runs) for runs in runs_per_dim)
    offsets = tuple(
        (runs[0].start if runs else size) if sharded else 0
        for runs, size, sharded in zip(runs_per_dim, shape, table.sharded)
    )
    return local_shape, offsets


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
        ShardingError: as :func:`rng_offsets`.
    """
    mesh, splits, shape = _normalise(mesh_shape, placements, global_shape)
    coord = _normalise_coordinate(coordinate, mesh)
    return _runs_at(_table(mesh, splits, shape), coord)


def check_disjoint(
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    global_shape: Sequence[int],
    *,
    offsets: OffsetFunction | None = None,
) -> None:
    """Check the offset contract over every rank of the mesh.

    Computes ``(start, end)`` for every coordinate with ``offsets`` (default: this module's
    :func:`rng_offsets`, read from one shared table) and checks that every rank gets the
    same ``end``, that both numbers are non-negative multiples of 4, that replicas get the
    same ``start``, and that the windows ``[start, start + local numel)`` of distinct
    non-empty shards are disjoint and lie inside ``[0, end)``. Pass another
    :data:`OffsetFunction` (PyTorch's formula, say) to audit it against the same rules.

    Raises:
        ShardingError: invalid mesh, placements or shape, as :func:`rng_offsets`.
        RNGDesyncError: a rule is broken; the message names the ranks and windows.
    """
    mesh, splits, shape = _normalise(mesh_shape, placements, global_shape)
    table = _table(mesh, splits, shape)
    if offsets is None:
        compute: Callable[[tuple[int, ...]], tuple[int, int]] = functools.partial(_offsets_at, table)
    else:
        given = tuple(placements)
        compute = functools.partial(_call_foreign, offsets, mesh, given, shape)
    origin = (0,) * len(mesh)
    end = compute(origin)[1]
    seen: dict[int, tuple[tuple[int, ...], int]] = {}  # linear shard index -> (first coordinate, start)
    for coord in itertools.product(*(range(size) for size in mesh)):
        start, rank_end = compute(coord)
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
        shard = _linear_index(table, coord)
        if shard not in seen:
            seen[shard] = (coord, start)
        elif seen[shard][1] != start:
            raise RNGDesyncError(
                f"ranks at coordinates {seen[shard][0]} and {coord} hold the same shard but start at "
                f"offsets {seen[shard][1]} and {start}; replicas must draw the same numbers."
            )
    windows = sorted(
        (start, start + table.numels[shard], coord) for shard, (coord, start) in seen.items() if table.numels[shard]
    )
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


def _call_foreign(
    offsets: OffsetFunction,
    mesh: tuple[int, ...],
    placements: tuple[Placement, ...],
    shape: tuple[int, ...],
    coord: tuple[int, ...],
) -> tuple[int, int]:
    start, end = offsets(mesh, coord, placements, shape)
    return int(start), int(end)


def _offsets_at(table: _Table, coord: tuple[int, ...]) -> tuple[int, int]:
    return table.starts[_linear_index(table, coord)], table.end


def _linear_index(table: _Table, coord: tuple[int, ...]) -> int:
    return sum(map(operator.mul, coord, table.shard_weights))


def _runs_at(table: _Table, coord: tuple[int, ...]) -> tuple[tuple[range, ...], ...]:
    return tuple(
        pieces[sum(map(operator.mul, coord, weights))] for pieces, weights in zip(table.pieces, table.piece_weights)
    )


@functools.lru_cache(maxsize=_TABLE_CACHE_SIZE)
def _table(mesh: tuple[int, ...], splits: tuple[_Split | None, ...], shape: tuple[int, ...]) -> _Table:
    """Split every tensor dim, number the shards and lay their offset windows end to end."""
    pieces: list[list[tuple[range, ...]]] = [[(range(size),)] for size in shape]
    piece_weights = [[0] * len(mesh) for _ in shape]
    for mesh_dim, split in enumerate(splits):
        if split is None:
            continue
        parts, weights = mesh[mesh_dim], piece_weights[split.dim]
        # Mixed radix in mesh-dim order: an earlier mesh dim is the more significant digit.
        weights[:] = [weight * parts for weight in weights]
        weights[mesh_dim] = 1
        pieces[split.dim] = [
            child for parent in pieces[split.dim] for child in _split_runs(parent, parts, split.split_factor)
        ]
    counts = [len(dim_pieces) for dim_pieces in pieces]
    shard_weights = [0] * len(mesh)
    for dim, weights in enumerate(piece_weights):
        stride = math.prod(counts[dim + 1 :])  # row-major over tensor dims, as PyTorch numbers shards
        for mesh_dim, weight in enumerate(weights):
            shard_weights[mesh_dim] += weight * stride
    extents = [[sum(len(run) for run in runs) for runs in dim_pieces] for dim_pieces in pieces]
    numels = tuple(math.prod(sizes) for sizes in itertools.product(*extents))
    starts = tuple(itertools.accumulate((round_up_offset(n) for n in numels[:-1]), initial=0))
    return _Table(
        shard_weights=tuple(shard_weights),
        piece_weights=tuple(map(tuple, piece_weights)),
        pieces=tuple(map(tuple, pieces)),
        sharded=tuple(any(weights) for weights in piece_weights),
        starts=starts,
        numels=numels,
        end=starts[-1] + round_up_offset(numels[-1]),
    )


def _split_runs(runs: tuple[range, ...], parts: int, split_factor: int) -> list[tuple[range, ...]]:
    """Split a local extent (given as global index runs) as ``_StridedShard`` does.

    ``split_factor == 1`` is plain ``Shard``: ``torch.chunk`` into ``parts`` pieces.
    """
    length = sum(len(run) for run in runs)
    out: list[list[range]] = [[] for _ in range(parts)]
    for low, high in _chunk_bounds(length, split_factor):
        if low == high:  # an empty chunk adds nothing, and split_factor may far exceed length
            continue
        for part, (a, b) in enumerate(_chunk_bounds(high - low, parts)):
            out[part].extend(_slice_runs(runs, low + a, low + b))
    return [_merge(part_runs) for part_runs in out]


def _chunk_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """``torch.chunk`` bounds, padded with empty chunks to exactly ``parts`` entries."""
    size = -(-length // parts)
    return [(min(i * size, length), min((i + 1) * size, length)) for i in range(parts)]


def _slice_runs(runs: tuple[range, ...], low: int, high: int) -> list[range]:
    """The global runs behind local indices ``[low, high)`` of the concatenated ``runs``."""
    out = []
    position = 0
    for run in runs:
        a, b = max(low - position, 0), min(high - position, len(run))
        if a < b:
            out.append(run[a:b])
        position += len(run)
    return out


def _merge(runs: list[range]) -> tuple[range, ...]:
    merged: list[range] = []
    for run in runs:
        if merged and merged[-1].stop == run.start:
            merged[-1] = range(merged[-1].start, run.stop)
        else:
            merged.append(run)
    return tuple(merged)


def _normalise(
    mesh_shape: Sequence[int], placements: Sequence[Placement], global_shape: Sequence[int]
) -> tuple[tuple[int, ...], tuple[_Split | None, ...], tuple[int, ...]]:
    mesh = _int_tuple(mesh_shape, "mesh_shape", minimum=1)
    shape = _int_tuple(global_shape, "global_shape", minimum=0)
    placements = _sequence(placements, "placements")
    if len(placements) != len(mesh):
        raise ShardingError(
            f"got {len(placements)} placements for a {len(mesh)}-dim mesh {mesh}; give exactly one per mesh "
            f"dim, Replicate() where a mesh dim does not shard the tensor (DTensor requires the same)."
        )
    splits = tuple(_normalise_placement(p, i, shape) for i, p in enumerate(placements))
    return mesh, splits, shape


def _normalise_coordinate(coordinate: Sequence[int], mesh: tuple[int, ...]) -> tuple[int, ...]:
    coord = _int_tuple(coordinate, "coordinate", minimum=0)
    if len(coord) != len(mesh):
        raise ShardingError(
            f"coordinate {coord} has {len(coord)} entries but the mesh {mesh} has {len(mesh)} dims; "
            f"give one index per mesh dim."
        )
    for dim, (index, size) in enumerate(zip(coord, mesh)):
        if index >= size:
            raise ShardingError(
                f"coordinate {coord} is outside the mesh {mesh}: index {index} on mesh dim {dim} must be below {size}."
            )
    return coord


def _normalise_placement(placement: Any, mesh_dim: int, shape: tuple[int, ...]) -> _Split | None:
    kind = _kind_of(placement.__class__)
    if kind is _Kind.REPLICA:
        return None
    if kind is _Kind.UNKNOWN:
        kinds = _placement_types()
        known = ", ".join(t.__name__ for t in (*kinds.shard, *kinds.strided, *kinds.replica)) or "none"
        raise ShardingError(
            f"placements[{mesh_dim}] is {placement!r} of type {type(placement).__name__}, not a placement "
            f"this module knows (this torch offers: {known}); pass torch.distributed.tensor placements."
        )
    split_factor = 1
    if kind is _Kind.STRIDED:
        split_factor = _as_int(placement.split_factor, "split_factor of placements", mesh_dim)
        if split_factor < 1:
            raise ShardingError(
                f"placements[{mesh_dim}] is {placement!r} with split_factor {split_factor}; it must be at least 1."
            )
    dim = _as_int(placement.dim, "dim of placements", mesh_dim)
    ndim = len(shape)
    if not -ndim <= dim < ndim:
        raise ShardingError(
            f"placements[{mesh_dim}] is {placement!r} but the tensor of shape {shape} has {ndim} dims; "
            f"shard a dim in [{-ndim}, {ndim})."
            if ndim
            else f"placements[{mesh_dim}] is {placement!r} but the tensor is 0-dim and cannot be sharded; "
            f"use Replicate()."
        )
    return _Split(dim % ndim, split_factor)


@functools.cache
def _kind_of(cls: type) -> _Kind:
    """Classify a placement class once; torch's placement ``isinstance`` checks are slow."""
    kinds = _placement_types()
    # _StridedShard first: torch releases before 2.6 derive it from Shard.
    if issubclass(cls, kinds.strided):
        return _Kind.STRIDED
    if issubclass(cls, kinds.shard):
        return _Kind.SHARD
    if issubclass(cls, kinds.replica):
        return _Kind.REPLICA
    return _Kind.UNKNOWN


@functools.cache
def _placement_types() -> _PlacementTypes:
    """The installed torch's placement classes, imported on first use (the import takes ~1 s)."""
    try:
        from torch.distributed.tensor import placement_types as types
    except ImportError:
        try:  # torch < 2.4 kept DTensor private
            from torch.distributed._tensor import placement_types as types  # type: ignore[no-redef]
        except ImportError:  # torch built without distributed support: nothing can be placed
            return _PlacementTypes((), (), ())
    partial = getattr(types, "Partial", None) or types._Partial  # renamed in torch 2.4
    strided = getattr(types, "_StridedShard", None)
    return _PlacementTypes(
        shard=(types.Shard,),
        strided=(strided,) if strided is not None else (),
        replica=(types.Replicate, partial),
    )


def _sequence(value: object, name: str) -> Sequence[Any]:
    if isinstance(value, (tuple, list)):  # the common case, and far cheaper than the ABC check
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ShardingError(f"{name} must be a sequence (tuple or list), got {value!r}.")
    return value


def _int_tuple(values: object, name: str, *, minimum: int) -> tuple[int, ...]:
    out = tuple(_as_int(v, name, i) for i, v in enumerate(_sequence(values, name)))
    for i, v in enumerate(out):
        if v < minimum:
            raise ShardingError(f"{name}[{i}] is {v} in {out}; it must be at least {minimum}.")
    return out


def _as_int(value: object, name: str, index: int | None = None) -> int:
    if type(value) is int:  # the common case; bool is excluded here because True as a size is a mistake
        return value
    label = name if index is None else f"{name}[{index}]"
    if isinstance(value, bool):
        raise ShardingError(f"{label} is the bool {value}; pass an int.")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ShardingError(f"{label} is {value!r} of type {type(value).__name__}; pass an int.") from None
