"""Closed-form sums of padded shard sizes, behind :func:`hyperrng.sharding.offsets.rng_offsets`.

Along one tensor dim, the mesh dims that shard it (its *levels*, in mesh-dim order) cut it
into pieces numbered in mixed radix. Only the sizes of the pieces matter for the offsets,
and one split of a length into ``parts`` pieces yields at most five runs of equal sizes
(three for ``Shard``: ceil(n / parts) repeated, a remainder, then empties). So a tensor
dim is summed up, for one rank, by its own extent, the total size of the pieces before
it, and how many of those and of all pieces are 1, 2 or 3 mod 4 (the padding r4 adds
depends on nothing else). Pieces before the rank's one are tracked as a multiset of sizes
(dict size -> count), split level by level; equal sizes merge, so its length depends on
the sizes, never on the number of ranks. The row-major sum over tensor dims then follows
from sums of products being products of sums, and residues mod 4 multiplying.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

__all__ = ["DimState", "Level", "dim_state", "start_of", "tail_sums"]

Level = tuple[int, int, int]
"""One mesh dim splitting a tensor dim: ``(mesh dim, parts, split_factor)``."""
_Runs = list[tuple[int, int]]  # piece sizes in piece order, run-length coded: (count, size)
_Residues = tuple[int, int, int]  # how many values are 1, 2 and 3 mod 4; multiples of 4 need no padding
DimState = tuple[int, int, _Residues, _Residues]
"""One tensor dim summed up for one rank: see :func:`dim_state`."""

_NO_RESIDUES: Final[_Residues] = (0, 0, 0)
_ONE: Final[_Residues] = (1, 0, 0)  # the residues of the empty product: a single 1
_RESIDUES_OF: Final[tuple[_Residues, ...]] = ((0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1))


def _chunk_runs(length: int, parts: int) -> _Runs:
    """``torch.chunk`` sizes of ``length`` in ``parts`` pieces: full chunks, a remainder, empties."""
    if not length:
        return [(parts, 0)]
    size = -(-length // parts)
    full, rest = divmod(length, size)
    runs = [(full, size)]
    if rest:
        runs.append((1, rest))
    if parts > full + (rest > 0):
        runs.append((parts - full - (rest > 0), 0))
    return runs


def _split_runs(length: int, parts: int, split_factor: int) -> _Runs:
    """Piece sizes of ``length`` split into ``parts`` as ``_StridedShard(split_factor)`` splits it.

    The extent is cut into ``split_factor`` chunks (``full`` of size ``chunk``, maybe one of
    ``rest``); piece ``c`` takes piece ``c`` of each, so its size is
    ``full * size_c(chunk) + size_c(rest)``: the merge of two chunk-run lists.
    """
    if split_factor == 1 or not length:
        return _chunk_runs(length, parts)
    chunk = -(-length // split_factor)
    full, rest = divmod(length, chunk)
    runs: _Runs = []
    whole, partial = _chunk_runs(chunk, parts), _chunk_runs(rest, parts)
    i = j = 0
    left_i, left_j = whole[0][0], partial[0][0]
    while i < len(whole):
        count = min(left_i, left_j)
        size = full * whole[i][1] + partial[j][1]
        if runs and runs[-1][1] == size:
            runs[-1] = (runs[-1][0] + count, size)
        else:
            runs.append((count, size))
        left_i -= count
        left_j -= count
        if not left_i:
            i += 1
            left_i = whole[i][0] if i < len(whole) else 0
        if not left_j:
            j += 1
            left_j = partial[j][0] if j < len(partial) else 0
    return runs


def _expand(sizes: dict[int, int], parts: int, split_factor: int) -> dict[int, int]:
    """Split every piece of a size multiset; empty pieces are dropped (they add nothing)."""
    out: dict[int, int] = {}
    for size, count in sizes.items():
        for run_count, run_size in _split_runs(size, parts, split_factor):
            if run_size:
                out[run_size] = out.get(run_size, 0) + count * run_count
    return out


def _residues(sizes: Iterable[tuple[int, int]]) -> _Residues:
    """How many of the ``(size, count)`` values are 1, 2 and 3 mod 4."""
    counts = [0, 0, 0, 0]
    for size, count in sizes:
        counts[size & 3] += count
    return counts[1], counts[2], counts[3]


def dim_state(length: int, levels: list[Level], coord: Sequence[int]) -> DimState:
    """Sum up one tensor dim for the rank at ``coord``.

    Returns ``(extent, before, before_residues, all_residues)``: the rank's piece size, the
    total size of the pieces before it in mixed-radix order, and how many pieces before it
    and in all are 1, 2 and 3 mod 4.
    """
    if not levels:
        return length, 0, _NO_RESIDUES, _RESIDUES_OF[length & 3]
    earlier: dict[int, int] = {}  # sizes of the pieces before the rank's one, at the current level
    every: dict[int, int] = {length: 1} if length else {}
    extent = length
    for mesh_dim, parts, split_factor in levels:
        index = coord[mesh_dim]
        earlier = _expand(earlier, parts, split_factor)
        every = _expand(every, parts, split_factor)
        position = 0
        for count, size in _split_runs(extent, parts, split_factor):
            if index < position + count:
                if size and index > position:
                    earlier[size] = earlier.get(size, 0) + index - position
                extent = size
                break
            if size:
                earlier[size] = earlier.get(size, 0) + count
            position += count
    before = sum(size * count for size, count in earlier.items())
    return extent, before, _residues(earlier.items()), _residues(every.items())


def _times(u: _Residues, v: _Residues) -> _Residues:
    """Residues of the products of every value counted by ``u`` with every one counted by ``v``."""
    u1, u2, u3 = u
    v1, v2, v3 = v
    return u1 * v1 + u3 * v3, u1 * v2 + u2 * v1 + u2 * v3 + u3 * v2, u1 * v3 + u3 * v1


def _padding(scale: int, x: _Residues) -> int:
    """Sum of ``r4(v) - v`` over the values counted by ``x``, each multiplied by ``scale`` (mod 4)."""
    x1, x2, x3 = x
    return (-scale & 3) * x1 + (-2 * scale & 3) * x2 + (-3 * scale & 3) * x3  # residue r, times scale: -r * scale mod 4


def tail_sums(shape: tuple[int, ...], all_residues: Sequence[_Residues]) -> tuple[list[int], list[_Residues], int]:
    """What the offsets need from the tensor dims after each dim ``t``, the same on every rank.

    Returns ``(numels, tails, end)``: the product of the global sizes of the dims after
    ``t``, the residues mod 4 of the products of piece sizes over those dims, and ``end``.
    """
    numels = [1] * len(shape)
    tails = [_ONE] * len(shape)
    numel, tail = 1, _ONE
    for t in range(len(shape) - 1, -1, -1):
        numels[t], tails[t] = numel, tail
        numel *= shape[t]
        tail = _times(all_residues[t], tail)
    return numels, tails, numel + _padding(1, tail)


def start_of(states: Sequence[DimState], numels: list[int], tails: list[_Residues]) -> int:
    """This rank's ``start`` from its per-dim states, shards numbered row-major over tensor dims.

    Shards before the rank's one are, for each tensor dim ``t``, those that agree with it on
    dims before ``t``, hold an earlier piece on ``t`` and anything after ``t``. Their
    element counts sum to ``head * before_t * numels[t]`` (``head`` the product of the
    rank's extents before ``t``); their padding follows from the residues mod 4.
    """
    start = 0
    head = 1
    for (extent, before, before_residues, _), numel, tail in zip(states, numels, tails):
        if before:
            start += head * before * numel + _padding(head & 3, _times(before_residues, tail))
        head *= extent
    return start
