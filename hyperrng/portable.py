"""Portable random numbers drawn at the position of a generator, a stream, or a sharded op.

The Philox functions of :mod:`hyperrng.philox` take an explicit ``(key, offset)``. This
module hands those positions out from the generators hyperrng already manages, so the
same code draws numbers that do not depend on the device or on how a tensor is sharded:

* :func:`reserve` takes ``numel`` counters from the current device generator, whatever
  it is right now: inside ``with tracker.fork("model-parallel-rng"):`` that is the
  stream; inside a ``distribute_region`` it is the shard's window. Its (seed, offset)
  position becomes the Philox (key, offset), and the generator advances past them.
* :func:`uniform`, :func:`normal`, :func:`bernoulli` and :func:`dropout` draw with it.
* :func:`sharded_uniform`, :func:`sharded_normal`, :func:`sharded_bernoulli` and
  :func:`sharded_dropout` return this rank's shard of a *global* random tensor, given the
  mesh, placements and global shape, with no collective: every rank reads the same base
  position, computes only its own elements from their global indices, and advances by
  the global element count, so the shards put together equal the unsharded tensor bit
  for bit and every rank leaves at the same position.

On the CPU platform positions are modelled (see :mod:`hyperrng.platforms.cpu`), and the numbers
are still exactly Philox's: the same on CPU, CUDA and NPU for the same (key, offset).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

import hyperrng.platforms as platforms
from hyperrng import philox
from hyperrng.errors import ArgumentTypeError, InvalidOffsetError
from hyperrng.platforms.validate import MAX_OFFSET, check_int, round_up_offset
from hyperrng.sharded import as_mesh_info
from hyperrng.sharding import local_index_ranges

__all__ = [
    "reserve",
    "uniform",
    "normal",
    "bernoulli",
    "dropout",
    "shard_slices",
    "sharded_uniform",
    "sharded_normal",
    "sharded_bernoulli",
    "sharded_dropout",
]

_T = TypeVar("_T")


def reserve(numel: int, generator: torch.Generator | None = None) -> tuple[int, int]:
    """Return ``(key, offset)`` for ``numel`` Philox counters and advance the generator past them.

    The generator (default: the current device generator of the platform, i.e. the
    active stream inside a tracker fork) moves from (seed, offset) to
    (seed, offset + numel rounded up to 4).

    Raises:
        ArgumentTypeError: ``numel`` is not an int (NumPy integers are accepted).
        InvalidOffsetError: ``numel`` is negative, or the generator's offset would pass 2**63 - 1.
        InvalidStateError: ``generator`` belongs to another device type. Nothing moves on error.
    """
    return _reserved(numel, generator, lambda key, offset: (key, offset))


def _reserved(numel: object, generator: torch.Generator | None, draw: Callable[[int, int], _T]) -> _T:
    """Run ``draw(key, offset)`` at the generator's position, then advance it past ``numel`` counters.

    The generator moves only once ``draw`` has returned: a draw that fails (a size limit,
    an allocation failure) leaves it where it was.
    """
    count = check_int(numel, "numel")
    if count < 0:
        raise InvalidOffsetError(f"numel must be non-negative, got {count}; it is the number of values to draw.")
    p = platforms.current()
    seed, offset = p.get_seed_offset(generator=generator)
    end = offset + round_up_offset(count)
    if end > MAX_OFFSET:
        raise InvalidOffsetError(
            f"reserving {count} counters at offset {offset} would pass 2**63 - 1; no generator moves past "
            f"2**63 - 1: reseed it (e.g. with portable_random(seed)) before drawing."
        )
    result = draw(seed, offset)
    p.set_seed_offset(seed, end, generator=generator)
    return result


def _validate(fn: Callable[..., torch.Tensor], shape: Sequence[int], **kw: Any) -> tuple[int, ...]:
    """Check ``shape`` and every parameter of ``fn`` by drawing nothing, before any generator moves."""
    checked = philox.check_shape(shape)
    fn((0,), key=0, offset=0, **kw)
    return checked


def _draw(
    fn: Callable[..., torch.Tensor], shape: Sequence[int], generator: torch.Generator | None, **kw: Any
) -> torch.Tensor:
    checked = _validate(fn, shape, **kw)
    return _reserved(math.prod(checked), generator, lambda key, offset: fn(checked, key=key, offset=offset, **kw))


def uniform(
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    low: float = 0.0,
    high: float = 1.0,
    *,
    generator: torch.Generator | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """:func:`hyperrng.philox.uniform` at the generator's position (see :func:`reserve`)."""
    return _draw(philox.uniform, shape, generator, dtype=dtype, low=low, high=high, compiled=compiled)


def normal(
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    mean: float = 0.0,
    std: float = 1.0,
    *,
    generator: torch.Generator | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """:func:`hyperrng.philox.normal` at the generator's position (see :func:`reserve`)."""
    return _draw(philox.normal, shape, generator, dtype=dtype, mean=mean, std=std, compiled=compiled)


def bernoulli(
    shape: Sequence[int], p: float, *, generator: torch.Generator | None = None, compiled: bool = False
) -> torch.Tensor:
    """:func:`hyperrng.philox.bernoulli` at the generator's position (see :func:`reserve`)."""
    return _draw(philox.bernoulli, shape, generator, p=p, compiled=compiled)


def dropout(
    x: torch.Tensor,
    p: float,
    training: bool = True,
    *,
    generator: torch.Generator | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """:func:`hyperrng.philox.dropout` of ``x`` at the generator's position (see :func:`reserve`).

    A dropout that draws nothing (``training`` false, ``p`` 0 or 1) reserves nothing, as
    ``F.dropout`` in portable mode: the two give the same values and leave the generator
    at the same position.
    """
    _check_input(x)
    # Validates x's dtype, p and training before the generator moves.
    philox.dropout(x.new_empty(0), p, key=0, training=training, compiled=compiled)
    if not training or p in (0.0, 1.0):
        return philox.dropout(x, p, key=0, training=training)
    return _reserved(
        x.numel(), generator, lambda key, offset: philox.dropout(x, p, key=key, offset=offset, compiled=compiled)
    )


def _check_input(x: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise ArgumentTypeError(f"x must be a torch.Tensor, got {type(x).__name__}; wrap data with torch.as_tensor(x).")


# -- sharded -------------------------------------------------------------------------------------
def shard_slices(mesh: Any, placements: Sequence[Any], global_shape: Sequence[int]) -> list[list[slice]]:
    """Per tensor dim, the slices of the global tensor this rank holds, in local order.

    ``Shard`` placements give one slice per dim; ``_StridedShard`` may give several.
    """
    info = as_mesh_info(mesh)
    runs = local_index_ranges(info.shape, info.coordinate, placements, global_shape)
    return [[slice(r.start, r.stop) for r in dim_runs] or [slice(0, 0)] for dim_runs in runs]


def _assemble(per_dim: list[list[slice]], draw: Callable[[list[slice]], torch.Tensor]) -> torch.Tensor:
    """Draw every block of the cartesian product of per-dim slices and put them together."""
    for d, slices in enumerate(per_dim):
        if len(slices) > 1:
            parts = [_assemble(per_dim[:d] + [[s]] + per_dim[d + 1 :], draw) for s in slices]
            return torch.cat(parts, dim=d)
    return draw([s[0] for s in per_dim])


def _sharded(
    fn: Callable[..., torch.Tensor],
    mesh: Any,
    placements: Sequence[Any],
    global_shape: Sequence[int],
    generator: torch.Generator | None,
    **kw: Any,
) -> torch.Tensor:
    shape = _validate(fn, global_shape, **kw)
    per_dim = shard_slices(mesh, placements, shape)  # validates before the generator moves
    return _reserved(
        math.prod(shape),
        generator,
        lambda key, offset: _assemble(per_dim, lambda block: fn(shape, key=key, offset=offset, shard=block, **kw)),
    )


def sharded_uniform(
    mesh: Any,
    placements: Sequence[Any],
    global_shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    low: float = 0.0,
    high: float = 1.0,
    *,
    generator: torch.Generator | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """This rank's shard of ``uniform(global_shape)`` drawn at the generator's position.

    ``mesh`` is a ``DeviceMesh``, a :class:`hyperrng.sharded.MeshInfo` or a
    ``(shape, coordinate)`` pair. Every rank must call it at the same generator position;
    every rank then advances by the global element count. No collective runs.
    """
    return _sharded(
        philox.uniform, mesh, placements, global_shape, generator, dtype=dtype, low=low, high=high, compiled=compiled
    )


def sharded_normal(
    mesh: Any,
    placements: Sequence[Any],
    global_shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    mean: float = 0.0,
    std: float = 1.0,
    *,
    generator: torch.Generator | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """This rank's shard of ``normal(global_shape)``; see :func:`sharded_uniform`."""
    return _sharded(
        philox.normal, mesh, placements, global_shape, generator, dtype=dtype, mean=mean, std=std, compiled=compiled
    )


def sharded_bernoulli(
    mesh: Any,
    placements: Sequence[Any],
    global_shape: Sequence[int],
    p: float,
    *,
    generator: torch.Generator | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """This rank's shard of ``bernoulli(global_shape, p)``; see :func:`sharded_uniform`."""
    return _sharded(philox.bernoulli, mesh, placements, global_shape, generator, p=p, compiled=compiled)


def sharded_dropout(
    x: torch.Tensor,
    p: float,
    mesh: Any,
    placements: Sequence[Any],
    global_shape: Sequence[int],
    *,
    generator: torch.Generator | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """Dropout of this rank's shard ``x`` with the mask of the unsharded tensor's dropout.

    ``x`` must have this rank's local shape; the result equals the matching block of
    :func:`hyperrng.philox.dropout` of the global tensor. See :func:`sharded_uniform`; with
    ``p`` 0 or 1 nothing is drawn and the generator stays put, as in :func:`dropout`.

    Raises:
        InvalidShapeError: ``x`` does not have this rank's local shape (nothing moves).
    """
    _check_input(x)
    p_value = philox.check_probability(p)
    philox.dropout(x.new_empty(0), p_value, key=0)  # validates x's dtype
    shape = philox.check_shape(global_shape)
    per_dim = shard_slices(mesh, placements, shape)
    local = tuple(sum(sl.stop - sl.start for sl in slices) for slices in per_dim)
    if local != tuple(x.shape):
        raise philox.InvalidShapeError(f"x has shape {tuple(x.shape)} but this rank's shard has shape {local}.")
    if p_value in (0.0, 1.0):
        return philox.dropout(x, p_value, key=0)

    def draw(key: int, offset: int) -> torch.Tensor:
        keep = _assemble(
            per_dim,
            lambda block: philox.bernoulli(
                shape, 1.0 - p_value, key=key, offset=offset, shard=block, device=x.device, compiled=compiled
            ),  # fmt: skip
        )
        return philox.apply_dropout_mask(x, keep, p_value)

    return _reserved(math.prod(shape), generator, draw)
