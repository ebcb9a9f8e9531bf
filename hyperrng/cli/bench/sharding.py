"""Benchmarks of :mod:`hyperrng.sharding.offsets` on 8192- and 1,048,576-rank meshes.

Each question is answered against a baseline timed in the same run, in interleaved rounds
(median and spread, see :mod:`._timing`):

* ``rng_offsets_vs_pytorch``: one rank's :func:`~hyperrng.sharding.offsets.rng_offsets` call
  against PyTorch's own per-call offset math, ``OffsetBasedRNGTracker._compute_rng_offsets``,
  on a ``DTensorSpec`` over a ``DeviceMesh`` built for that rank without a process group
  (target: at most 3x). ``rng_offsets`` keeps no per-mesh cache, so every call is cold:
  it validates its arguments and computes the offsets in closed form (only the class of
  each placement is classified once per process).
* ``check_all_ranks``: computing and checking the offsets of every rank of an 8192-rank
  mesh (:func:`~hyperrng.sharding.offsets.check_disjoint`) against asking
  :func:`~hyperrng.sharding.offsets.rng_offsets` once per rank.
* ``distribute_region``: enter+exit of a region on the current platform, offsets cached,
  against a bare ``tracker.fork()`` (target on the CPU: at most 2x), for each form a
  mesh takes (a ``(shape, coordinate)`` tuple, a ``MeshInfo``, a ``DeviceMesh``), on an
  8192-rank mesh to show the cost does not depend on mesh size, and with the arguments a
  layer passes (a list made at the call, the tensor's ``torch.Size``); then the slowest
  round of 10,000 regions over 200,000 in one process against the fastest (target 1.5x),
  with the same shape and with a new shape every region, and the highest traced memory of
  the second run's regions, window against window, to show that nothing builds up over a run.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hyperrng.cli.bench._timing import BenchResult, Timing, announce, interleaved, time_rounds
from hyperrng.sharding import offsets as sharding

if TYPE_CHECKING:
    from torch.distributed.tensor.placement_types import Placement

__all__ = ["benchmarks"]

_Case = tuple[str, tuple[int, ...], tuple["Placement", ...], tuple[int, ...]]  # label, mesh, placements, shape


def benchmarks(quick: bool) -> list[BenchResult]:
    """Time the sharding offset math on 8192- and 1,048,576-rank meshes."""
    from torch.distributed.tensor import Replicate, Shard

    checks: tuple[_Case, ...] = (
        # Every rank a distinct shard, uneven splits, tensor dim 0 split over two mesh dims.
        ("8x16x64", (8, 16, 64), (Shard(0), Shard(1), Shard(0)), (5000, 3001)),
        # 1024 distinct shards with 8 replicas each, three tensor dims sharded unevenly.
        ("4x8x16x16", (4, 8, 16, 16), (Shard(0), Replicate(), Shard(1), Shard(2)), (1024, 999, 77)),
    )
    versus_pytorch: tuple[_Case, ...] = (
        checks[0],
        # 1,048,576 ranks: 16,384 distinct shards with 64 replicas each, dim 0 split twice, unevenly.
        ("16x16x64x64", (16, 16, 64, 64), (Shard(0), Shard(1), Shard(0), Replicate()), (50_000, 3001)),
    )
    repeat = 2 if quick else 5
    results: list[BenchResult] = []
    for case in versus_pytorch:
        results.extend(_bench_one_rank(case, quick))
    for case in checks:
        results.extend(_bench_case(case, repeat))
    results.extend(_bench_region(quick))
    return results


_PYTORCH_TARGET = 3.0  # one rank's offsets may cost at most three times PyTorch's own per-call math


def _pytorch_offsets(
    mesh: tuple[int, ...], coord: tuple[int, ...], placements: Sequence[Placement], shape: tuple[int, ...]
) -> Callable[[], tuple[int, int]] | None:
    """PyTorch's ``_compute_rng_offsets`` for the rank at ``coord``, bound to its spec; None if unavailable.

    The ``DeviceMesh`` is built for that rank without a process group, and the tracker
    without its constructor, which demands a CUDA device; the offset math needs neither.
    """
    import torch

    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor._random import OffsetBasedRNGTracker
    except ImportError:
        return None
    rank = sum(index * math.prod(mesh[dim + 1 :]) for dim, index in enumerate(coord))
    try:
        device_mesh = DeviceMesh("cpu", torch.arange(math.prod(mesh)).view(mesh), _init_backend=False, _rank=rank)
    except TypeError:  # this torch cannot build a mesh without a process group
        return None
    strides = tuple(math.prod(shape[dim + 1 :]) for dim in range(len(shape)))
    meta = TensorMeta(torch.Size(shape), strides, torch.float32)
    spec = DTensorSpec(device_mesh, tuple(placements), tensor_meta=meta)
    tracker = object.__new__(OffsetBasedRNGTracker)
    compute = getattr(tracker, "_compute_rng_offsets", None)
    if compute is None:
        return None
    return functools.partial(compute, spec)


def _bench_one_rank(case: _Case, quick: bool) -> list[BenchResult]:
    label, mesh, placements, shape = case
    coord = tuple(size // 2 for size in mesh)
    ranks = math.prod(mesh)
    theirs = _pytorch_offsets(mesh, coord, placements, shape)
    if theirs is None:
        return []

    def ours() -> None:
        sharding.rng_offsets(mesh, coord, placements, shape)

    number, rounds = (500, 3) if quick else (5_000, 7)
    timings = interleaved({"ours": ours, "theirs": theirs}, number=number, rounds=rounds)
    return [
        BenchResult(
            name=f"sharding.rng_offsets_vs_pytorch[{label}]",
            timing=timings["ours"],
            baseline="torch _compute_rng_offsets",
            baseline_timing=timings["theirs"],
            target=_PYTORCH_TARGET,
            note=f"one rank of {ranks:,}, every call cold (validation + closed form): "
            f"{timings['ours'].median * 1e6:.1f} us; PyTorch {timings['theirs'].median * 1e6:.1f} us",
        )
    ]


_REGION_TARGET = 2.0  # a region may cost at most two bare forks once its offsets are cached
_FLAT_TARGET = 1.5  # over a long run, the slowest round of regions within this of the fastest


def _device_mesh() -> tuple[Any, str]:
    """A 2x2 ``DeviceMesh`` seen from rank 2, built without a process group, or ``None`` and why not."""
    import torch

    try:
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh("cpu", torch.arange(4).view(2, 2), _init_backend=False, _rank=2), ""
    except (ImportError, TypeError, RuntimeError) as exc:  # this torch cannot build a mesh without a process group
        return None, f"no DeviceMesh row: {type(exc).__name__}: {exc}"


def _bench_region(quick: bool) -> list[BenchResult]:
    import torch
    from torch.distributed.tensor import Replicate, Shard

    import hyperrng.platforms as platforms
    from hyperrng.sharding.tracker import OFFSETS_KEPT, MeshInfo, ShardedRNGTracker
    from hyperrng.streams.tracker import RNGStatesTracker

    platform = platforms.current()
    # Many short rounds (as in the streams suite): a neighbour's burst on a shared machine falls
    # in a few rounds of each function, which the median drops.
    number, rounds = (2_000, 3) if quick else (4_000, 35)
    tracker = RNGStatesTracker()
    tracker.add("bench-region", 1)
    sharded = ShardedRNGTracker()
    placements = (Shard(0), Replicate())
    device_mesh, why_not = _device_mesh()
    meshes: dict[str, Any] = {"tuple": ((2, 2), (1, 0)), "MeshInfo": MeshInfo((2, 2), (1, 0))}
    if device_mesh is not None:
        meshes["DeviceMesh"] = device_mesh
    large = (MeshInfo((8, 16, 64), (7, 15, 63)), (Shard(0), Shard(1), Shard(0)), (5000, 3001))
    x = torch.empty(64, 64)
    shard, replicate = placements

    def fork() -> None:
        with tracker.fork("bench-region"):
            pass

    def region(args: tuple[Any, ...]) -> Callable[[], None]:
        def run() -> None:
            with sharded.distribute_region(*args):
                pass

        return run

    def rebuilt() -> None:  # as a layer writes it: a list made at the call and the tensor's shape
        with sharded.distribute_region(meshes["MeshInfo"], [shard, replicate], x.shape):
            pass

    fns: dict[str, Callable[[], None]] = {"fork": fork}
    for label, mesh in meshes.items():
        fns[label] = region((mesh, placements, (64, 64)))
    fns["large"] = region(large)
    fns["rebuilt"] = rebuilt
    announce(f"timing {len(fns) - 1} forms of region against a fork: {rounds} rounds of {number:,} calls each")
    best = interleaved(fns, number=number, rounds=rounds)
    target = _REGION_TARGET if platform.name == "cpu" else None
    rebuilt_note = "a new placements list and the tensor's torch.Size at each call" + (
        f"; {why_not}" if why_not else ""
    )
    rows = [(f"2x2 {label}", label, "") for label in meshes] + [
        ("2x2, args rebuilt", "rebuilt", rebuilt_note),
        ("8192-rank mesh", "large", "offsets cached: the cost does not grow with the mesh"),
    ]
    fork_name = "tracker.fork() enter+exit"
    results = [
        BenchResult(
            f"{platform.name}: distribute_region, {what}", best[key], fork_name, best["fork"], target=target, note=note
        )
        for what, key, note in rows
    ]
    # Build-up shows only in a long run: 200,000 regions in rounds of 10,000, each at a new
    # position as in training (every region moves the generator on); then as many with a new
    # shape every region, which also churns the offsets cache.
    long_number, long_rounds = (2_000, 10) if quick else (10_000, 20)
    total = f"{long_rounds} rounds of {long_number:,} regions ({long_rounds * long_number:,} in one process)"

    def slowest_round(label: str, run: Timing, extra: str = "") -> BenchResult:
        return BenchResult(
            f"{platform.name}: distribute_region, slowest round, {label}",
            Timing((run.high,)),
            "its fastest round",
            Timing((run.low,)),
            target=_FLAT_TARGET,
            note=f"{total}; median {run.median * 1e6:.1f} us; late/early rounds {run.drift:.2f}{extra}",
        )

    announce(f"a long run, same shape: {total}")
    same = time_rounds(region((meshes["tuple"], placements, (64, 64))), number=long_number, rounds=long_rounds)
    results.append(slowest_round("same shape", same))
    shapes = itertools.count(1)

    def new_shape() -> None:
        with sharded.distribute_region(meshes["tuple"], placements, (next(shapes), 64)):
            pass

    announce(f"a long run, a new shape every region: {total}")
    fresh = time_rounds(new_shape, number=long_number, rounds=long_rounds)
    # Memory: the highest point of traced memory over one window of regions against the window
    # before it. The positions table drops half its entries at each of its rotations (every
    # POSITIONS_KEPT // 2 regions: a region enters two positions), so traced memory rises and
    # falls; a window of POSITIONS_KEPT regions holds two rotations and so its highest point,
    # and a build-up would raise the second window's. Traced from far enough back that every
    # entry of the bounded tables was allocated while traced (else each replaced entry frees
    # memory tracemalloc never saw). Too slow for --quick, which leaves it out.
    traced = "; traced memory: not measured with --quick"
    if not quick:
        warm = 2 * (platforms.POSITIONS_KEPT + OFFSETS_KEPT)
        announce(f"traced memory over {warm + 2 * platforms.POSITIONS_KEPT:,} regions with new shapes")
        grown = _traced_peak_growth(new_shape, warm, platforms.POSITIONS_KEPT)
        traced = (
            f"; highest traced memory {grown / 1024:+.0f} KiB over {platforms.POSITIONS_KEPT:,} regions against "
            f"the {platforms.POSITIONS_KEPT:,} before, after {warm:,} traced"
        )
    results.append(slowest_round("new shapes", fresh, traced))
    return results


def _traced_peak_growth(fn: Callable[[], None], warm: int, window: int) -> int:
    """The highest traced memory over ``window`` calls of ``fn`` minus that over the ``window`` calls
    before them, traced from ``warm`` calls earlier."""
    import tracemalloc

    tracemalloc.start()
    try:
        for _ in range(warm):
            fn()
        peaks = []
        for _ in range(2):
            tracemalloc.reset_peak()
            for _ in range(window):
                fn()
            peaks.append(tracemalloc.get_traced_memory()[1])
        return peaks[1] - peaks[0]
    finally:
        tracemalloc.stop()


def _bench_case(case: _Case, repeat: int) -> list[BenchResult]:
    label, mesh, placements, shape = case
    coords = list(itertools.product(*(range(size) for size in mesh)))
    ranks = len(coords)

    def check() -> None:
        sharding.check_disjoint(mesh, placements, shape)

    def every_rank() -> None:
        for coord in coords:
            sharding.rng_offsets(mesh, coord, placements, shape)

    pair = interleaved({"check": check, "loop": every_rank}, number=1, rounds=repeat)
    check_timing, loop = pair["check"], pair["loop"]
    return [
        BenchResult(
            name=f"sharding.check_all_ranks[{label}]",
            timing=check_timing,
            baseline=f"{ranks} rng_offsets calls",
            baseline_timing=loop,
            note=f"check_disjoint over {ranks} ranks: {check_timing.median:.4f} s; "
            f"one rng_offsets call per rank: {loop.median:.4f} s",
        ),
    ]
