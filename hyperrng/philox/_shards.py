"""Which Philox blocks a draw covers, and how a result is filled from a :class:`Kernel`.

Element ``e`` (row-major) of a global tensor drawn at ``offset`` takes the value of global
index ``offset + e``. A shard, a block of the global tensor given by per-dimension index
ranges, is a set of equally long runs of consecutive global indices
(:class:`ShardGeometry`); :func:`fill` computes each run from the blocks that hold it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hyperrng.errors import ArgumentTypeError, InvalidArgumentError
from hyperrng.philox._torch import WORDS_PER_BLOCK, Kernel, chunk_blocks
from hyperrng.platforms.validate import check_int

__all__ = ["ShardGeometry", "fill"]


@dataclass(frozen=True)
class ShardGeometry:
    """A row-major block of a global tensor, seen as ``segments`` runs of ``run`` elements.

    In row-major order a block selected by per-dimension ranges is a set of equally
    long contiguous runs: the innermost dimensions it covers entirely merge with the
    first one it does not. ``split`` is that dimension; the dimensions before it index
    the runs.
    """

    global_shape: tuple[int, ...]
    starts: tuple[int, ...]
    local_shape: tuple[int, ...]
    split: int
    run: int
    # Derived at construction (a launch reads them every time; computed on first read they would need
    # functools.cached_property, whose lock torch.compile cannot trace on Python 3.10 and 3.11):
    segments: int = field(init=False, compare=False)  # the number of runs
    first: int = field(init=False, compare=False)  # global row-major index (from 0) of the first element

    def __post_init__(self) -> None:
        index = 0
        for start, extent in zip(self.starts, self.global_shape):
            index = index * extent + start
        object.__setattr__(self, "segments", math.prod(self.local_shape[: self.split]))
        object.__setattr__(self, "first", index)

    @classmethod
    def of(cls, global_shape: tuple[int, ...], shard: object = None) -> ShardGeometry:
        """Geometry of the block ``shard`` selects (all of ``global_shape`` when it is None).

        ``shard`` is a sequence of slices with step 1, one per leading dimension; trailing
        dimensions may be omitted.

        Raises:
            ArgumentTypeError: ``shard`` is not a sequence of slices with int bounds.
            InvalidArgumentError: ``shard`` has more slices than ``global_shape`` has
                dimensions, or a step other than 1.
        """
        ranges = _check_shard(shard, global_shape)
        starts = tuple(a for a, _ in ranges)
        local = tuple(b - a for a, b in ranges)
        split = len(global_shape) - 1
        while split > 0 and local[split] == global_shape[split]:
            split -= 1
        return cls(global_shape, starts, local, split, math.prod(local[max(split, 0) :]))

    def segment_starts(self, ids: torch.Tensor) -> torch.Tensor:
        """Global row-major index (from 0) of the first element of each run in ``ids``."""
        strides = [1] * len(self.global_shape)
        for d in range(len(self.global_shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * self.global_shape[d + 1]
        rel = torch.full_like(ids, self.starts[self.split] * strides[self.split] if self.global_shape else 0)
        rest = ids
        for d in range(self.split - 1, -1, -1):
            rel += (rest % self.local_shape[d] + self.starts[d]) * strides[d]
            rest = rest // self.local_shape[d]
        return rel


def _check_shard(shard: object, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    if shard is None:
        return [(0, extent) for extent in shape]
    if isinstance(shard, (slice, str, bytes)) or not isinstance(shard, Sequence):
        raise ArgumentTypeError(
            f"shard must be a sequence of slices, one per leading dimension, such as (slice(0, 4),); "
            f"got {type(shard).__name__} {shard!r}."
        )
    for d, s in enumerate(shard):
        if not isinstance(s, slice):
            raise ArgumentTypeError(
                f"shard[{d}] must be a slice, got {type(s).__name__} {s!r}; write slice(i, i + 1) for one index."
            )
    if len(shard) > len(shape):
        raise InvalidArgumentError(
            f"shard has {len(shard)} slices but the global shape {shape} has {len(shape)} dimensions."
        )
    ranges = []
    for d, (s, extent) in enumerate(zip(shard, shape)):
        first, last, step = (
            None if b is None else check_int(b, f"shard[{d}].{name}")
            for b, name in ((s.start, "start"), (s.stop, "stop"), (s.step, "step"))
        )
        if step not in (None, 1):
            raise InvalidArgumentError(
                f"shard slice {s!r} of dimension {d} has step {step}; only step 1 (or None) is supported."
            )
        start, stop, _ = slice(first, last).indices(extent)
        ranges.append((start, max(start, stop)))
    return ranges + [(0, extent) for extent in shape[len(shard) :]]


def _fill_range(out: torch.Tensor, start: int, kernel: Kernel) -> None:
    """Write the values of global indices ``[start, start + out.numel())`` into 1-D ``out``.

    The whole blocks in the middle are written in place, a chunk at a time; the partial
    blocks at either end (at most two) are computed together and their lanes copied.
    """
    n = out.numel()
    head = min(-start % WORDS_PER_BLOCK, n)  # elements before the first block boundary
    whole = (n - head) // WORDS_PER_BLOCK
    tail = n - head - whole * WORDS_PER_BLOCK
    first = (start + head) // WORDS_PER_BLOCK
    if whole:
        middle = out if whole * WORDS_PER_BLOCK == n else out[head : head + whole * WORDS_PER_BLOCK]
        kernel.fill(middle.view(whole, WORDS_PER_BLOCK), first)
    ends = ([start // WORDS_PER_BLOCK] if head else []) + ([first + whole] if tail else [])
    if ends:
        values = kernel.values(torch.tensor(ends, dtype=torch.int64).to(out.device))
        if head:
            lane = start % WORDS_PER_BLOCK
            out[:head].copy_(values[0, lane : lane + head])
        if tail:
            out[n - tail :].copy_(values[-1, :tail])


def _blocks_spanned(run: int) -> int:
    """Blocks that hold a run of ``run`` elements wherever it starts.

    A run starting at lane ``a`` spans ``(a + run - 1) // 4 + 1`` blocks; this is the
    value for ``a = 3``, the worst case.
    """
    return (run + 2) // WORDS_PER_BLOCK + 1


def _fill_short_runs(out: torch.Tensor, geometry: ShardGeometry, offset: int, kernel: Kernel) -> None:
    """Fill ``out`` of shape ``(segments, run)`` many runs per kernel call, gathering lanes."""
    run = geometry.run
    span = _blocks_spanned(run)
    device = out.device
    group = max(chunk_blocks(device.type) // span, 1)
    steps = torch.arange(span, dtype=torch.int64, device=device)
    columns = torch.arange(run, dtype=torch.int64, device=device)
    base_block, base_lane = offset // WORDS_PER_BLOCK, offset % WORDS_PER_BLOCK
    for g0 in range(0, geometry.segments, group):
        count = min(group, geometry.segments - g0)  # counted here: a device tensor's own shape may lag its data
        ids = torch.arange(g0, g0 + count, dtype=torch.int64, device=device)
        # Split offset + start into block and lane without forming it: it may exceed int64.
        shifted = geometry.segment_starts(ids) + base_lane
        first_blocks = shifted // WORDS_PER_BLOCK + base_block
        lanes = shifted % WORDS_PER_BLOCK
        blocks = (first_blocks[:, None] + steps[None, :]).reshape(-1)
        values = kernel.values(blocks).reshape(count, span * WORDS_PER_BLOCK)
        out[g0 : g0 + count] = values.gather(1, lanes[:, None] + columns[None, :])


def fill(
    geometry: ShardGeometry, offset: int, kernel: Kernel, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Return a tensor of ``geometry.local_shape`` and ``dtype`` holding the kernel's values.

    Element ``e`` of the global tensor gets the value of global index ``offset + e``
    (``e`` row-major in ``geometry.global_shape``). Long runs are computed one range at a
    time; runs shorter than a chunk are batched, as many per kernel call as fit in a
    chunk, and their lanes gathered: that computes up to four words per element kept but
    saves a kernel call (about sixty tensor operations) per run. A compiled kernel
    whose result is one whole-block range in its compute dtype returns that range as the
    result, with no copy. ``out`` (contiguous) is filled and returned when given.
    """
    numel = math.prod(geometry.local_shape)
    if out is None:
        if (
            kernel.compiled
            and geometry.segments == 1
            and dtype == kernel.value_dtype
            and numel > 0
            and numel % WORDS_PER_BLOCK == 0
        ):
            start = offset + geometry.first
            if start % WORDS_PER_BLOCK == 0:
                return kernel.run(start // WORDS_PER_BLOCK, numel // WORDS_PER_BLOCK).view(geometry.local_shape)
        out = torch.empty(geometry.local_shape, dtype=dtype, device=kernel.device)
    if numel == 0:
        return out
    if geometry.segments == 1:  # one run: its start needs no tensor of run starts
        _fill_range(out.view(-1), offset + geometry.first, kernel)
        return out
    rows = out.view(geometry.segments, geometry.run)
    if _blocks_spanned(geometry.run) > chunk_blocks(kernel.device.type):
        ids = torch.arange(geometry.segments, dtype=torch.int64)
        for row, start in zip(rows, geometry.segment_starts(ids).tolist()):
            _fill_range(row, offset + start, kernel)
    else:
        _fill_short_runs(rows, geometry, offset, kernel)
    return out
