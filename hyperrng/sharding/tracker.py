"""An offset-based RNG tracker with DTensor semantics, written against the Platform interface.

For a random op on a tensor sharded over a device mesh, :meth:`ShardedRNGTracker.distribute_region`
positions the generator for this rank's shard before the op and, on exit (also when the op
raises), moves every rank to the same position after it::

    tracker = ShardedRNGTracker()
    tracker.manual_seed(1234)                      # same seed on every rank of the mesh
    with tracker.distribute_region(mesh, [Shard(0), Replicate()], (1024, 1024)):
        local.uniform_()                           # this rank's shard draws its own window

The positions come from :func:`hyperrng.sharding.offsets.rng_offsets` (pure, cached here by the
region's arguments), so no collective runs per op. What each platform guarantees:

* counter-based platforms (CUDA, NPU, the simulated accelerator): the offsets are real
  Philox offsets. Shard ``k`` draws the counter window ``[start_k, start_k + numel_k)``
  after the region's base offset; windows of distinct shards are disjoint, replicas draw
  identical numbers, and every rank leaves at ``base + end``.
* the CPU platform seeds MT19937 from a 64-bit handle of each position (see
  :mod:`hyperrng.platforms.cpu`): the region positions the op in the *draw* domain
  (``set_seed_offset(..., draw=True)``) and leaves in the *free* one, so replicas draw
  identical numbers, distinct shards draw from distinct streams (independent streams,
  not disjoint windows of one stream), no shard replays the plain draws made before the
  region, and every rank leaves at ``base + end``. The region reads and writes positions
  through the platform only, so it needs nothing CPU-specific.

A region on an empty tensor draws nothing and leaves the generator as it is. The offsets
of a (mesh, placements, shape) are cached per tracker, for the last :data:`OFFSETS_KEPT`
distinct ones; a ``(shape, coordinate)`` pair is keyed by its ints.

:meth:`ShardedRNGTracker.install_dtensor` routes random ops on real
``torch.distributed.tensor`` DTensors through this tracker, on any platform, the CPU
included (where PyTorch's own tracker refuses to run).

**LocalTensor mode.** Under torch's single-process ``LocalTensorMode`` (how PyTorch's own
DTensor tests run every rank in one process), torch keeps one RNG state per simulated rank.
:meth:`~ShardedRNGTracker.distribute_region`, :meth:`~ShardedRNGTracker.manual_seed` and
the DTensor adapter then position every simulated rank's generator, each at its own
shard's window, exactly as the ranks of a real job would be (see :mod:`hyperrng.sharding._local_tensor`).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import hyperrng.platforms as platforms
from hyperrng._guard import exclusive as _exclusive
from hyperrng._guard.interrupts import deferred
from hyperrng.errors import ArgumentTypeError, InvalidArgumentError, InvalidOperationError
from hyperrng.platforms import Platform
from hyperrng.platforms._features import EnteredUntraced
from hyperrng.platforms.validate import check_instance, check_int, check_seed
from hyperrng.sharding import _local_tensor as _local_ranks
from hyperrng.sharding._regions import LocalRegion, Region, active_region
from hyperrng.sharding.offsets import rng_offsets
from hyperrng.streams._device_state import current_device_key

# Portable mode's key (hyperrng.portable._ops.KEY_NAME, which imports this module): a thread in the mode includes it.
_PORTABLE_KEY = torch._C._parse_dispatch_key("CustomRNGKeyId")

__all__ = ["MeshInfo", "OFFSETS_KEPT", "ShardedRNGTracker", "active_region", "as_mesh_info"]

_log = logging.getLogger(__name__)

OFFSETS_KEPT = 4096
"""How many distinct (mesh, placements, shape) answers a :class:`ShardedRNGTracker` keeps; the least
recently used go first."""


@dataclass(frozen=True)
class MeshInfo:
    """A light description of a device mesh as seen by one rank: its shape and this rank's coordinate."""

    shape: tuple[int, ...]
    coordinate: tuple[int, ...]

    def __post_init__(self) -> None:
        for field, values in (("mesh shape", self.shape), ("mesh coordinate", self.coordinate)):
            if not isinstance(values, tuple):
                raise ArgumentTypeError(f"the {field} must be a tuple of ints, got {type(values).__name__}.")
            for value in values:
                check_int(value, f"each entry of the {field}")
        if len(self.shape) != len(self.coordinate):
            raise InvalidArgumentError(
                f"mesh coordinate {self.coordinate} has {len(self.coordinate)} entries but the mesh "
                f"{self.shape} has {len(self.shape)} dimensions; give one coordinate per mesh dimension."
            )
        object.__setattr__(self, "_hash", hash((self.shape, self.coordinate)))

    def __hash__(self) -> int:  # computed once: a region looks its offsets up by it on every op
        return self._hash  # type: ignore[attr-defined, no-any-return]


_NOT_IN_MESH = "this rank is not part of the device mesh; run sharded random ops only on ranks of the mesh."
# Opens with DTensor's own words, so that code matching PyTorch's message keeps working.
_SEED_NOT_IN_MESH = (
    "manual_seed requires the current rank to be a part of the device mesh, and this rank is not part of the "
    "device mesh given; seed each sub-mesh on its own ranks only."
)


def as_mesh_info(mesh: Any, rank: int | None = None) -> MeshInfo:
    """Accept a :class:`MeshInfo`, a ``(shape, coordinate)`` pair or a ``DeviceMesh``.

    Args:
        mesh: the mesh description.
        rank: under torch's LocalTensor mode, the simulated rank whose coordinate a
            ``DeviceMesh`` should give (its coordinate holds one value per simulated rank).

    Raises:
        InvalidOperationError: the rank is not part of the ``DeviceMesh`` (also a ``RuntimeError``,
            as in PyTorch).
        ArgumentTypeError: ``mesh`` is none of the above, or a mesh whose shape or coordinate
            entries are not ints.
        InvalidArgumentError: a ``DeviceMesh`` coordinate differs across simulated ranks and no
            ``rank`` was given.
    """
    if isinstance(mesh, MeshInfo):
        return mesh
    if isinstance(mesh, tuple) and len(mesh) == 2 and all(isinstance(m, (tuple, list)) for m in mesh):
        return MeshInfo(tuple(mesh[0]), tuple(mesh[1]))
    get_coordinate = getattr(mesh, "get_coordinate", None)
    if get_coordinate is not None:
        coordinate = get_coordinate()
        if coordinate is None:
            raise InvalidOperationError(_NOT_IN_MESH, reason="mesh")
        if rank is None:
            if any(_local_ranks.per_rank(c) is not None for c in coordinate):
                raise InvalidArgumentError(
                    "this DeviceMesh coordinate differs across the simulated ranks of torch's LocalTensor mode; "
                    "use distribute_region (which positions every simulated rank) or pass rank=."
                )
            values = [_local_ranks.value_on(c, 0) for c in coordinate]
        else:
            values = [_local_ranks.value_on(c, rank) for c in coordinate]
        shape = getattr(mesh, "shape", None)
        if not isinstance(shape, Sequence) or isinstance(shape, str):
            raise ArgumentTypeError(f"the mesh's shape must be a sequence of ints, got {type(shape).__name__}.")
        # Each entry exactly an int (a NumPy integer too), never truncated: a shape of 2.7 is no mesh.
        return MeshInfo(
            tuple(check_int(s, "each entry of the mesh shape") for s in shape),
            tuple(check_int(c, "each entry of the mesh coordinate") for c in values),
        )
    raise ArgumentTypeError(
        f"expected a DeviceMesh, a MeshInfo or a (shape, coordinate) pair, got {type(mesh).__name__}."
    )


class ShardedRNGTracker:
    """Positions a generator for this rank's shard of a sharded random op.

    Args:
        platform: the platform whose generator is positioned (default: the current one,
            looked up at each call so ``hyperrng.platforms.use`` applies).
    """

    def __init__(self, platform: Platform | None = None) -> None:
        if platform is not None:
            check_instance(platform, Platform, "platform")
        self._platform = platform
        self._offsets: OrderedDict[tuple[Any, ...], tuple[int, int]] = OrderedDict()  # least recently used first
        # The previous call's argument objects and result: an op repeated with the very same
        # (immutable) objects, as a training loop does, skips hashing and comparing them.
        self._last: tuple[Any, Any, Any, tuple[int, int]] | None = None
        self.distribute_region_enabled = True
        self._adapter: tuple[Platform, Any] | None = None  # install_dtensor's, with the platform it serves

    @property
    def platform(self) -> Platform:
        """The platform this tracker positions generators on."""
        return self._platform if self._platform is not None else platforms.current()

    # -- initialisation -------------------------------------------------------------------
    def manual_seed(self, seed: int, mesh: Any | None = None) -> None:
        """Put the device generator at (seed, 0); call it with the same seed on every rank.

        ``mesh``, when given, must include this rank (as DTensor requires). Under torch's
        LocalTensor mode every simulated rank's generator is seeded, each with its own
        value when ``seed`` is a per-rank ``SymInt``.

        Raises (before anything changes):
            ArgumentTypeError: ``seed`` is not an int.
            InvalidArgumentError: ``seed`` is outside [0, 2**64 - 1].
            InvalidOperationError: this rank is not part of ``mesh`` (a ``RuntimeError``, as in PyTorch).
            InvalidOperationError: another thread holds the device's generator (in a fork, a region, ...;
                see :mod:`hyperrng._guard.exclusive`).
        """
        p = self.platform
        mode = _local_ranks.active_mode()
        if mode is None:
            value = check_seed(seed)
            _check_member(mesh, None)
            with deferred(), _exclusive.holding([current_device_key(p)], "ShardedRNGTracker.manual_seed"):
                p.set_seed_offset(value, 0)
            return
        seeds = {rank: check_seed(_local_ranks.value_on(seed, rank)) for rank in sorted(mode.ranks)}
        for rank in seeds:
            _check_member(mesh, rank)
        with deferred(), _exclusive.holding([current_device_key(p)], "ShardedRNGTracker.manual_seed"):
            _local_ranks.each_rank(mode, lambda rank: p.set_seed_offset(seeds[rank], 0))

    def sync_from_rank0(self, group: object | None = None) -> bool:
        """Copy rank 0's device generator position to every rank of ``group``.

        Returns whether this rank's position differed (and logs a warning when it did):
        ranks that run sharded random ops must start from the same position.

        Raises:
            InvalidOperationError: another thread holds the device's generator when the position
                arrives (after the broadcast, which every rank joins); it is left unchanged.
        """
        p = self.platform
        mine = p.get_seed_offset()
        packed = torch.tensor([mine[0] - 2**63, mine[1]], dtype=torch.int64)  # uint64 seed shifted into int64
        theirs = platforms.comm.broadcast(p, packed, src=0, group=group)
        seed, offset = int(theirs[0]) + 2**63, int(theirs[1])
        differed = (seed, offset) != mine
        if differed:
            _log.warning(
                "rank %d had generator position %s but rank 0 has %s; synchronised to rank 0. "
                "Seed every rank with the same seed (ShardedRNGTracker.manual_seed) to avoid this.",
                platforms.comm.rank(group),
                mine,
                (seed, offset),
            )
        with _exclusive.holding([current_device_key(p)], "ShardedRNGTracker.sync_from_rank0"):
            p.set_seed_offset(seed, offset)
        return differed

    # -- the region ------------------------------------------------------------------------
    def offsets(self, mesh: Any, placements: Sequence[Any], global_shape: Sequence[int]) -> tuple[int, int]:
        """``(start, end)`` for this rank's shard; see :func:`hyperrng.sharding.offsets.rng_offsets`.

        Results are cached, but only for arguments whose every entry is exactly an int (a
        ``MeshInfo`` is validated when it is made; a ``DeviceMesh`` is one rank's view of a
        mesh, so it stands for its coordinate): an argument that equals a cached one only
        by ``==`` (``True`` for ``1``, ``8.0`` for ``8``) is validated like a new one.

        Under torch's LocalTensor mode a ``DeviceMesh`` names one coordinate per simulated
        rank: ``start`` is then a ``SymInt`` holding each rank's value (as in PyTorch's
        ``_compute_rng_offsets``) unless they agree.
        """
        mode = _local_ranks.active_mode()
        if mode is not None and not isinstance(mesh, (MeshInfo, tuple)):
            starts, end = self._rank_offsets(mode, mesh, placements, global_shape)
            return _local_ranks.combine(starts), end  # type: ignore[return-value]
        return self._offsets_of(mesh, placements, global_shape)

    def _offsets_of(self, mesh: Any, placements: Sequence[Any], global_shape: Sequence[int]) -> tuple[int, int]:
        last = self._last
        if (
            last is not None
            and mesh is last[0]
            and (placements is last[1] if type(placements) is tuple else placements == last[1])
            and (global_shape is last[2] or (type(global_shape) is torch.Size and global_shape == last[2]))
        ):
            # The same mesh object, the same placements (a list compared with a copy of the last
            # one, as a list may change in place) and the same shape (a torch.Size holds exact
            # ints, so equality is exact). The objects are kept alive by _last, so no other
            # object has their ids.
            return last[3]
        key = _cache_key(mesh, placements, global_shape)
        offsets = self._offsets
        try:
            result = offsets[key]  # type: ignore[index]
            offsets.move_to_end(key)  # type: ignore[arg-type]
        except (KeyError, TypeError):  # not cached (or no key), or unhashable: correct, just not cached
            info = as_mesh_info(mesh)
            result = rng_offsets(info.shape, info.coordinate, placements, global_shape)
            if key is not None:
                try:
                    offsets[key] = result
                except TypeError:
                    pass
                if len(offsets) > OFFSETS_KEPT:
                    _forget_oldest(offsets)
        self._remember(mesh, placements, global_shape, result)
        return result

    def _remember(self, mesh: Any, placements: Any, global_shape: Any, result: tuple[int, int]) -> None:
        """Keep the arguments for the fast path of a repeated op: the mesh and shape when they cannot
        change in place, and the placements themselves (a tuple) or a copy of them (a list)."""
        if type(placements) is list:
            placements = list(placements)
        elif type(placements) is not tuple:
            return
        if isinstance(global_shape, tuple) and _fixed_mesh(mesh):
            self._last = (mesh, placements, global_shape, result)

    def _rank_offsets(
        self, mode: Any, mesh: Any, placements: Sequence[Any], global_shape: Sequence[int]
    ) -> tuple[dict[int, int], int]:
        """``({simulated rank: start}, end)`` under LocalTensor mode; validates everything first."""
        starts: dict[int, int] = {}
        end = 0
        for rank in sorted(mode.ranks):
            starts[rank], end = self._offsets_of(as_mesh_info(mesh, rank), placements, global_shape)
        return starts, end

    def _local_region(
        self,
        mode: Any,
        mesh: Any,
        placements: Sequence[Any],
        global_shape: Sequence[int],
        source: torch.Generator | None,
    ) -> LocalRegion:
        if _PORTABLE_KEY is not None and torch._C._dispatch_tls_is_dispatch_key_included(_PORTABLE_KEY):
            raise _local_ranks.portable_refusal("a DTensor random op")  # this thread is in portable mode
        starts, end = self._rank_offsets(mode, mesh, placements, global_shape)
        return LocalRegion(self._platform or platforms.current(), mode, starts, end, source)

    def distribute_region(
        self,
        mesh: Any,
        placements: Sequence[Any],
        global_shape: Sequence[int],
        generator: torch.Generator | None = None,
    ) -> Region:
        """Context manager: position ``generator`` (default: the device's) for this rank's shard.

        On entry the generator moves from its (seed, base) position to ``base + start``;
        on exit, also on exception, every rank moves to ``base + end``. A passed generator
        is positioned the same way and keeps its advance.

        Under torch's LocalTensor mode every simulated rank's generator is positioned at
        its own shard's start, and every rank leaves at ``base + end``.

        Raises (before anything changes):
            InvalidArgumentError: bad mesh, coordinate, placements or shape.
            InvalidOperationError: this rank is not part of the ``DeviceMesh``.
            InvalidArgumentError: ``generator`` belongs to another device type.
            InvalidArgumentError: the op would push the offset past 2**63 - 1.
            InvalidOperationError: a ``generator`` is passed under LocalTensor mode, where one
                generator object cannot stand for every simulated rank.
        """
        mode = _local_ranks.active_mode()
        if mode is not None:
            if generator is not None:
                raise InvalidOperationError(
                    "under torch's LocalTensor mode a region positions each simulated rank's device generator; "
                    "one generator object cannot stand for every rank. Draw from the device generator inside "
                    "the region (DTensor ops charge a user generator's advance to it for you).",
                    reason="tracker",
                )
            return self._local_region(mode, mesh, placements, global_shape, None)  # type: ignore[return-value]
        start, end = self._offsets_of(mesh, placements, global_shape)
        # A foreign generator is refused by the first read in __enter__, before any write.
        return Region(self._platform or platforms.current(), generator, start, end, mesh, placements, global_shape)

    # -- DTensor interop ----------------------------------------------------------------------
    def install_dtensor(self) -> Any:
        """Route random ops on ``torch.distributed.tensor`` DTensors through this tracker.

        Installs an adapter where DTensor looks for its RNG tracker and returns the
        tracker it replaced (``None`` if none), for :meth:`uninstall_dtensor`.

        Raises:
            InvalidArgumentError: the installed torch has no DTensor RNG hook.
        """
        random_mod = _dtensor_random_module()
        platform = self.platform
        adapter = self._adapter
        if adapter is None or adapter[0] is not platform:  # one adapter per platform (portable mode installs
            adapter = self._adapter = (platform, _dtensor_adapter(self))  # at every outermost entry)
        adapter[1].distribute_region_enabled = True  # as a new adapter would be
        previous = random_mod._rng_tracker
        random_mod._rng_tracker = adapter[1]
        return previous

    @staticmethod
    def uninstall_dtensor(previous: Any = None) -> None:
        """Put back the DTensor RNG tracker that :meth:`install_dtensor` replaced."""
        _dtensor_random_module()._rng_tracker = previous


def _check_member(mesh: Any, rank: int | None) -> None:
    """Refuse a ``mesh`` passed to manual_seed that this rank is not part of, in DTensor's words."""
    if mesh is None:
        return
    try:
        as_mesh_info(mesh, rank)
    except InvalidOperationError:
        raise InvalidOperationError(_SEED_NOT_IN_MESH, reason="mesh") from None


def _fixed_mesh(mesh: object) -> bool:
    """Whether this rank's view of ``mesh`` cannot change: a ``MeshInfo``, a ``(shape, coordinate)``
    pair of tuples, or a ``DeviceMesh`` (only ever constructed once torch's device-mesh module is
    loaded, so it is not imported here)."""
    if type(mesh) is MeshInfo:
        return True
    if type(mesh) is tuple:
        return len(mesh) == 2 and type(mesh[0]) is tuple and type(mesh[1]) is tuple
    module = sys.modules.get("torch.distributed.device_mesh")
    return module is not None and isinstance(mesh, module.DeviceMesh)


def _exact_ints(values: object) -> tuple[int, ...] | None:
    """``values`` as a tuple if it is a tuple or list of exact ints (``True`` is not ``1`` here), else ``None``."""
    if type(values) is not tuple and type(values) is not list:
        return None
    for v in values:  # type: ignore[attr-defined]
        if type(v) is not int:
            return None
    return values if type(values) is tuple else tuple(values)  # type: ignore[return-value, arg-type]


def _cache_key(mesh: Any, placements: Sequence[Any], global_shape: Sequence[int]) -> tuple[Any, ...] | None:
    """A key under which these arguments' offsets may be cached, or ``None`` if they must be validated.

    Every entry must be exactly an int, since ``==`` equates ``1`` with ``True`` and ``8`` with
    ``8.0``: a ``(shape, coordinate)`` pair is keyed by its ints, a ``MeshInfo`` (validated when
    made) or a ``DeviceMesh`` (one rank's view of a mesh) by itself.
    """
    shape = _exact_ints(global_shape) if type(global_shape) is not torch.Size else tuple(global_shape)
    if shape is None:
        return None
    if type(mesh) is tuple:
        if len(mesh) != 2:
            return None
        mesh_shape, coordinate = _exact_ints(mesh[0]), _exact_ints(mesh[1])
        if mesh_shape is None or coordinate is None:
            return None
        mesh = (mesh_shape, coordinate)
    if type(placements) is tuple:
        return (mesh, placements, shape)
    if type(placements) is list:
        return (mesh, tuple(placements), shape)
    return None  # anything else is validated (and refused if it is no sequence) on every call


def _forget_oldest(offsets: OrderedDict[tuple[Any, ...], tuple[int, int]]) -> None:
    try:
        offsets.popitem(last=False)
    except KeyError:  # another thread emptied it first
        pass


def _dtensor_random_module() -> Any:
    loaded = sys.modules.get("torch.distributed.tensor._random")  # no import statement's cost once loaded
    if loaded is not None and hasattr(loaded, "_rng_tracker"):
        return loaded
    try:
        from torch.distributed.tensor import _random
    except ImportError as exc:
        raise InvalidArgumentError(
            f"this torch ({torch.__version__}) has no torch.distributed.tensor RNG hook; "
            "use ShardedRNGTracker.distribute_region directly."
        ) from exc
    if not hasattr(_random, "_rng_tracker"):
        raise InvalidArgumentError(f"torch {torch.__version__} keeps DTensor's RNG tracker elsewhere; cannot install.")
    return _random


def _dtensor_adapter(tracker: ShardedRNGTracker) -> Any:
    """An object with the methods DTensor's dispatcher calls on its RNG tracker, serving ``tracker``."""
    return _adapter_class()(tracker)


@functools.cache
def _adapter_class() -> type:
    """The class of :func:`_dtensor_adapter`'s objects, made once: portable mode installs an adapter at
    every outermost entry while DTensor is loaded, and making a class costs tens of microseconds.

    DTensor sends CUDA ops without a user generator through a traceable path that
    requires an ``OffsetBasedRNGTracker`` and only asks it for ``_compute_rng_offsets``;
    subclassing it (without running its CUDA-only constructor) serves that path too.
    """
    from torch.distributed.tensor import _random

    base: type = getattr(_random, "OffsetBasedRNGTracker", object)

    class HyperRNGDTensorTracker(base):  # type: ignore[misc, valid-type]
        def __init__(self, tracker: ShardedRNGTracker) -> None:  # deliberately not the CUDA-only base constructor
            self._tracker = tracker
            self._use_distribute_region = True
            self._device = tracker.platform.device()

        @property
        def distribute_region_enabled(self) -> bool:
            return self._use_distribute_region and self._tracker.distribute_region_enabled

        @distribute_region_enabled.setter
        def distribute_region_enabled(self, value: bool) -> None:
            self._use_distribute_region = value

        def _compute_rng_offsets(self, spec: Any) -> tuple[int, int]:
            return self._tracker.offsets(spec.mesh, spec.placements, spec.shape)

        def _distribute_region(self, spec: Any, generator: torch.Generator | None = None) -> Any:
            return _DTensorRegion(self._tracker, spec, generator)

    return HyperRNGDTensorTracker


class _DTensorRegion(EnteredUntraced):
    """DTensor pops a user generator off the op, so the op draws from the device generator:
    position the device generator with the user generator's position, and hand the advance
    back to the user generator afterwards, leaving the device generator as it was."""

    def __init__(self, tracker: ShardedRNGTracker, spec: Any, generator: torch.Generator | None) -> None:
        self._tracker = tracker
        self._spec = spec
        self._user = generator
        self._saved: torch.Tensor | None = None
        self._after: tuple[int, int] | None = None  # where the op left the device generator
        self._before: tuple[int, int] | None = None  # the user generator's position before the op
        self._region: Region | LocalRegion | None = None
        self._held: tuple[str, int, int] | None = None  # (device type, index, depth before) of the device held

    def __enter__(self) -> None:
        if torch.compiler.is_dynamo_compiling():
            return self._enter_outside_the_graph()
        t, p, spec = self._tracker, self._tracker.platform, self._spec
        mode = _local_ranks.active_mode()
        if mode is not None:  # every simulated rank's generator, with the user generator's advance charged to it
            local = t._local_region(mode, spec.mesh, spec.placements, spec.shape, self._user)
            local.__enter__()
            self._region = local
            return
        region = t.distribute_region(spec.mesh, spec.placements, spec.shape)
        index = p.current_device()
        try:
            # Held for the whole op: the user generator's position is moved into the device generator.
            self._held = (p.device_type, index, _exclusive.hold(p.device_type, index, "a DTensor random op"))
            if self._user is not None:
                position = self._before = p.get_seed_offset(generator=self._user)  # refuses a foreign one first
                self._saved = p.get_rng_state()
                p.set_seed_offset(*position)
            region.__enter__()
            self._region = region
        except BaseException:
            if self._saved is not None:
                _exclusive.redo(p.set_rng_state, self._saved)
                self._saved = None
            if self._held is not None:
                _exclusive.release(*self._held)
            raise

    def __exit__(self, *exc: object) -> None:
        if torch.compiler.is_dynamo_compiling():
            return self._exit_outside_the_graph(*exc)
        assert self._region is not None
        if isinstance(self._region, LocalRegion):
            self._region.__exit__(*exc)
            return
        try:
            self._leave()
        except BaseException:
            self._leave()  # idempotent: one more go finishes what an interrupt cut short (inline: a call
            # to a helper here would add a frame whose entry an interrupt could hit before any try)
            raise

    def _leave(self) -> None:
        p = self._tracker.platform
        if self._after is None:
            self._region.__exit__()  # type: ignore[union-attr]
            if self._saved is not None:
                self._after = p.get_seed_offset()
        if self._saved is not None and self._after is not None:
            p.set_rng_state(self._saved)
            # Last, so that a user generator that is the device's own (DTensor hands the tracker a new wrapper of it
            # when passed explicitly) keeps the op's advance; none (a refused op) leaves it untouched: on the CPU,
            # positioning a generator reseeds it, which would lose the draws it made before.
            if self._after != self._before:
                p.set_seed_offset(*self._after, generator=self._user)
        if self._held is not None:
            _exclusive.release(*self._held)
