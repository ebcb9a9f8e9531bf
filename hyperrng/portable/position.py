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
* :func:`draw_at_position` is the rule all of them (and portable mode's ops) follow: read
  the position, draw, then commit; :func:`assemble_blocks` puts a shard drawn block by
  block together.
* :func:`portable_state_dict` / :func:`load_portable_state_dict` save and restore the
  positions portable draws continue from, at any world size.

On the CPU platform positions are modelled (see :mod:`hyperrng.platforms.cpu`), and the numbers
are still exactly Philox's: the same on CPU, CUDA and NPU for the same (key, offset).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

import hyperrng.platforms as platforms
from hyperrng import philox
from hyperrng.errors import ArgumentTypeError, InvalidArgumentError, RNGDesyncError
from hyperrng.platforms._features import eager_when_traced
from hyperrng.platforms.validate import (
    MAX_OFFSET,
    OFFSET_ALIGN,
    check_instance,
    check_int,
    check_offset,
    check_seed,
)
from hyperrng.sharding.offsets import local_index_ranges
from hyperrng.sharding.tracker import as_mesh_info
from hyperrng.streams.tracker import refuse_in_fork, resolve_tracker

__all__ = [
    "PORTABLE_STATE_FORMAT",
    "assemble_blocks",
    "draw_at_position",
    "load_portable_state_dict",
    "portable_state_dict",
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
        InvalidArgumentError: ``numel`` is negative, or the generator's offset would pass 2**63 - 1;
            or ``generator`` belongs to another device type. Nothing moves on error.
    """
    return draw_at_position(numel, generator, lambda key, offset: (key, offset))


def draw_at_position(numel: object, generator: torch.Generator | None, draw: Callable[[int, int], _T]) -> _T:
    """Return ``draw(key, offset)`` run at the generator's position, then advance it past ``numel`` counters.

    The rule of every portable draw (these functions and portable mode's ops): read the
    position of ``generator`` (default: the platform's current device generator), draw,
    then commit ``numel`` rounded up to whole Philox blocks. The generator moves only once
    ``draw`` has returned: a draw that fails (a size limit, an allocation failure) leaves
    it where it was.

    Raises:
        The errors of :func:`reserve`, before ``draw`` runs; and whatever ``draw`` raises.
    """
    count = numel if type(numel) is int else check_int(numel, "numel")
    if count < 0:
        raise InvalidArgumentError(f"numel must be non-negative, got {count}; it is the number of values to draw.")
    p = platforms.current()
    gen = p._position_generator() if generator is None else None
    if gen is not None:  # the device's generator holds the position: read and moved in three calls
        seed, offset = gen.initial_seed(), gen.get_offset()
    else:
        seed, offset = p._position() if generator is None else p.get_seed_offset(generator=generator)
    end = offset - (-count // OFFSET_ALIGN) * OFFSET_ALIGN  # round_up_offset(count), inline: every draw
    if end > MAX_OFFSET:
        raise InvalidArgumentError(
            f"reserving {count} counters at offset {offset} would pass 2**63 - 1; no generator moves past "
            f"2**63 - 1: reseed it (e.g. with portable_random(seed)) before drawing."
        )
    result = draw(seed, offset)
    if gen is not None:
        gen.set_offset(end)  # whole Philox blocks, as set_offset requires
    elif generator is None:
        p._move(seed, end, False)  # the checked values of a position it read, moved forward
    else:
        p.set_seed_offset(seed, end, generator=generator)
    return result


def _draw(
    fn: Callable[..., torch.Tensor],
    shape: Sequence[int],
    generator: torch.Generator | None,
    sharding: tuple[Any, Sequence[Any]] | None = None,
    **kw: Any,
) -> torch.Tensor:
    """``fn(shape, **kw)`` at the generator's position: the whole tensor, or with ``sharding``
    (mesh, placements) this rank's shard of it. ``shape``, ``sharding`` and every parameter
    are checked first (``fn`` draws nothing once), before any generator moves."""
    checked = philox.check_shape(shape)
    fn((0,), key=0, offset=0, **kw)
    per_dim = None if sharding is None else shard_slices(*sharding, checked)

    def draw(key: int, offset: int) -> torch.Tensor:
        if per_dim is None:
            return fn(checked, key=key, offset=offset, **kw)
        return assemble_blocks(per_dim, lambda block: fn(checked, key=key, offset=offset, shard=block, **kw))

    return draw_at_position(math.prod(checked), generator, draw)


@eager_when_traced
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


@eager_when_traced
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


@eager_when_traced
def bernoulli(
    shape: Sequence[int], p: float, *, generator: torch.Generator | None = None, compiled: bool = False
) -> torch.Tensor:
    """:func:`hyperrng.philox.bernoulli` at the generator's position (see :func:`reserve`)."""
    return _draw(philox.bernoulli, shape, generator, p=p, compiled=compiled)


@eager_when_traced
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
    _check_dropout(x, p, training, compiled)
    if not training or p in (0.0, 1.0):
        return philox.dropout(x, p, key=0, training=training)
    return draw_at_position(
        x.numel(), generator, lambda key, offset: philox.dropout(x, p, key=key, offset=offset, compiled=compiled)
    )


def _check_dropout(x: object, p: object, training: object, compiled: object) -> float:
    """``p`` as a float once ``x`` (a floating-point tensor), ``p``, ``training`` and ``compiled`` are checked."""
    if not isinstance(x, torch.Tensor):
        raise ArgumentTypeError(f"x must be a torch.Tensor, got {type(x).__name__}; wrap data with torch.as_tensor(x).")
    philox.dropout(x.new_empty(0), p, key=0, training=training, compiled=compiled)  # type: ignore[arg-type]
    return float(p)  # type: ignore[arg-type]


# -- sharded -------------------------------------------------------------------------------------
def shard_slices(mesh: Any, placements: Sequence[Any], global_shape: Sequence[int]) -> list[list[slice]]:
    """Per tensor dim, the slices of the global tensor this rank holds, in local order.

    ``Shard`` placements give one slice per dim; ``_StridedShard`` may give several.
    """
    info = as_mesh_info(mesh)
    runs = local_index_ranges(info.shape, info.coordinate, placements, global_shape)
    return [[slice(r.start, r.stop) for r in dim_runs] or [slice(0, 0)] for dim_runs in runs]


def assemble_blocks(per_dim: list[list[slice]], draw: Callable[[list[slice]], torch.Tensor]) -> torch.Tensor:
    """Return the tensor made of ``draw(block)`` for every block of the cartesian product of ``per_dim``.

    ``per_dim`` is what :func:`shard_slices` returns: per dim, the slices of the global
    tensor a rank holds, in local order. ``draw`` gets one slice per dim and returns that
    block; the blocks are concatenated in local order.
    """
    for d, slices in enumerate(per_dim):
        if len(slices) > 1:
            parts = [assemble_blocks(per_dim[:d] + [[s]] + per_dim[d + 1 :], draw) for s in slices]
            return torch.cat(parts, dim=d)
    return draw([s[0] for s in per_dim])


@eager_when_traced
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

    ``mesh`` is a ``DeviceMesh``, a :class:`hyperrng.sharding.tracker.MeshInfo` or a
    ``(shape, coordinate)`` pair. Every rank must call it at the same generator position;
    every rank then advances by the global element count. No collective runs.
    """
    kw = {"dtype": dtype, "low": low, "high": high, "compiled": compiled}
    return _draw(philox.uniform, global_shape, generator, (mesh, placements), **kw)


@eager_when_traced
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
    kw = {"dtype": dtype, "mean": mean, "std": std, "compiled": compiled}
    return _draw(philox.normal, global_shape, generator, (mesh, placements), **kw)


@eager_when_traced
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
    return _draw(philox.bernoulli, global_shape, generator, (mesh, placements), p=p, compiled=compiled)


@eager_when_traced
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
        InvalidArgumentError: ``x`` does not have this rank's local shape (nothing moves).
    """
    p_value = _check_dropout(x, p, True, compiled)
    per_dim = shard_slices(mesh, placements, philox.check_shape(global_shape))
    local = tuple(sum(sl.stop - sl.start for sl in slices) for slices in per_dim)
    if local != tuple(x.shape):
        raise InvalidArgumentError(f"x has shape {tuple(x.shape)} but this rank's shard has shape {local}.")
    if p_value in (0.0, 1.0):
        return philox.dropout(x, p_value, key=0)
    keep = _draw(
        philox.bernoulli,
        global_shape,
        generator,
        (mesh, placements),
        p=1.0 - p_value,
        device=x.device,
        compiled=compiled,
    )
    return philox.apply_dropout_mask(x, keep, p_value)


# -- elastic resume ------------------------------------------------------------------------------
PORTABLE_STATE_FORMAT = "hyperrng.portable/1"
"""The ``format`` entry of :func:`portable_state_dict`'s result."""


def portable_state_dict(tracker: Any = None, *, check_ranks: bool = True) -> dict[str, Any]:
    """The positions portable draws continue from: the device generator's and every tracker stream's.

    In portable mode every rank holds the same positions (each op moves every rank by
    its global count), so this dict does not depend on the rank or the world size: save
    it from any rank and give it to :func:`load_portable_state_dict` on every rank of a
    run with another world size, and the next portable draws are the global tensors the
    uninterrupted run would have drawn.

    Args:
        tracker: the :class:`~hyperrng.RNGStatesTracker` whose streams to include
            (default: the global one).
        check_ranks: when ``torch.distributed`` is initialised, gather every rank's
            positions (a collective: call it on every rank) and refuse if they differ.

    Returns:
        ``{"format": PORTABLE_STATE_FORMAT, "position": [seed, offset],
        "streams": {name: [seed, offset]}}``, plain ints (JSON- and torch.save-safe).

    Raises:
        ArgumentTypeError: ``check_ranks`` is not a bool, ``tracker`` not a tracker.
        InvalidOperationError: a fork is active (a stream's position is in the generator).
        RNGDesyncError: ``check_ranks`` and the ranks hold different positions.
    """
    check = check_instance(check_ranks, bool, "check_ranks")
    t = resolve_tracker(tracker)
    refuse_in_fork(t, "portable_state_dict")
    p = platforms.current()
    streams = {}
    for name in sorted(t.get_states()):
        with t.fork(name):
            streams[name] = list(p.get_seed_offset())
    state = {"format": PORTABLE_STATE_FORMAT, "position": list(p.get_seed_offset()), "streams": streams}
    dist = torch.distributed
    if check and dist.is_available() and dist.is_initialized() and platforms.comm.world_size() > 1:
        text = json.dumps(state, sort_keys=True).encode()
        digest = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)
        digests = [int(t) for t in platforms.comm.all_gather(p, torch.tensor([digest], dtype=torch.int64))]
        differ = [rank for rank, other in enumerate(digests) if other != digests[0]]
        if differ:  # every rank sees the same digests, so every rank raises alike
            raise RNGDesyncError(
                f"ranks {differ} hold other portable positions than rank 0 (this rank: {state}); draw only "
                f"portable ops on every rank alike, or seed every rank with portable_random(seed)."
            )
    return state


def load_portable_state_dict(state: Any, tracker: Any = None) -> None:
    """Put the device generator and the tracker's streams at the positions of :func:`portable_state_dict`.

    Works at any world size (see :func:`portable_state_dict`). Everything is checked
    before anything is set.

    Raises:
        ArgumentTypeError: ``state`` is not a dict of the documented shape, or a value not an int.
        InvalidArgumentError: an unknown ``format``; a stream of the state that the tracker
            lacks (add the streams, with any seed, before loading); a seed or offset out of
            range or misaligned. Errors about a position name its entry: the stream, or
            ``state['position']``.
        InvalidOperationError: a fork is active.
    """
    if not isinstance(state, dict) or not isinstance(state.get("streams"), dict):
        raise ArgumentTypeError(
            f"state must be the dict portable_state_dict() returns, got {type(state).__name__}; load it unchanged."
        )
    if state.get("format") != PORTABLE_STATE_FORMAT:
        raise InvalidArgumentError(f"state has format {state.get('format')!r}, not {PORTABLE_STATE_FORMAT!r}.")
    t = resolve_tracker(tracker)

    def position(value: object, entry: str) -> tuple[int, int]:
        """``value`` checked as the ``[seed, offset]`` pair of ``entry``; an error names the entry and the fix."""
        fix = (
            "portable_state_dict() never saves such a value: load the dict it returned unchanged "
            "(was the checkpoint edited or damaged?), or save a fresh one."
        )
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ArgumentTypeError(f"{entry}: expected a [seed, offset] pair, got {value!r}. {fix}")
        try:
            return check_seed(value[0], "seed"), check_offset(value[1], "offset")
        except (ArgumentTypeError, InvalidArgumentError) as exc:  # same class, entry named
            raise type(exc)(f"{entry}: {exc} {fix}") from None

    main = position(state.get("position"), "the generator position (state['position'])")
    streams = {
        name: position(value, f"stream {name!r} (state['streams'][{name!r}])")
        for name, value in state["streams"].items()
    }
    missing = sorted(set(streams) - set(t.get_states()))
    if missing:
        raise InvalidArgumentError(
            f"the state has streams {missing} that the tracker lacks; add them (tracker.add(name, seed)) first."
        )
    refuse_in_fork(t, "load_portable_state_dict")
    p = platforms.current()
    for name, (seed, offset) in streams.items():
        with t.fork(name):
            p.set_seed_offset(seed, offset)
    p.set_seed_offset(*main)
