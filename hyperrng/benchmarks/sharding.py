"""Benchmarks of :mod:`hyperrng.sharding` on 8192-rank meshes.

Two questions, each answered against a baseline timed in the same run:

* ``check_all_ranks``: computing and checking the offsets of every rank
  (:func:`~hyperrng.sharding.check_disjoint`) against asking
  :func:`~hyperrng.sharding.rng_offsets` once per rank.
* ``distribute_region``: enter+exit of a region on the current platform, offsets cached,
  against a bare ``tracker.fork()`` (target: at most 2x), on a small mesh and on an
  8192-rank one, to show the cost does not depend on mesh size.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hyperrng import sharding
from hyperrng.benchmarks._timing import BenchResult, interleaved

if TYPE_CHECKING:
    from torch.distributed.tensor.placement_types import Placement

__all__ = ["benchmarks"]


def benchmarks(quick: bool) -> list[BenchResult]:
    """Time the sharding offset math on an 8x16x64 and a 4x8x16x16 mesh (8192 ranks each)."""
    from torch.distributed.tensor import Replicate, Shard

    cases = (
        # Every rank a distinct shard, uneven splits, tensor dim 0 split over two mesh dims.
        ("8x16x64", (8, 16, 64), (Shard(0), Shard(1), Shard(0)), (5000, 3001)),
        # 1024 distinct shards with 8 replicas each, three tensor dims sharded unevenly.
        ("4x8x16x16", (4, 8, 16, 16), (Shard(0), Replicate(), Shard(1), Shard(2)), (1024, 999, 77)),
    )
    repeat = 2 if quick else 5
    results: list[BenchResult] = []
    for label, mesh, placements, shape in cases:
        results.extend(_bench_case(label, mesh, placements, shape, repeat))
    results.extend(_bench_region(quick))
    return results


_REGION_TARGET = 2.0  # a region may cost at most two bare forks once its offsets are cached


def _bench_region(quick: bool) -> list[BenchResult]:
    from torch.distributed.tensor import Replicate, Shard

    import platforms
    from hyperrng.sharded import MeshInfo, ShardedRNGTracker
    from hyperrng.tracker import RNGStatesTracker

    platform = platforms.current()
    number, rounds = (2_000, 3) if quick else (20_000, 7)
    tracker = RNGStatesTracker()
    tracker.add("bench-region", 1)
    sharded = ShardedRNGTracker()
    small = (MeshInfo((2, 2), (1, 0)), [Shard(0), Replicate()], (64, 64))
    large = (MeshInfo((8, 16, 64), (7, 15, 63)), [Shard(0), Shard(1), Shard(0)], (5000, 3001))

    def fork() -> None:
        with tracker.fork("bench-region"):
            pass

    def region(args: tuple[Any, ...]) -> None:
        with sharded.distribute_region(*args):
            pass

    best = interleaved(
        {"fork": fork, "small": lambda: region(small), "large": lambda: region(large)}, number=number, rounds=rounds
    )
    target = _REGION_TARGET if platform.name == "cpu" else None
    return [
        BenchResult(
            f"{platform.name}: distribute_region, 2x2 mesh",
            best["small"],
            "tracker.fork() enter+exit",
            best["fork"],
            target=target,
        ),
        BenchResult(
            f"{platform.name}: distribute_region, 8192-rank mesh",
            best["large"],
            "tracker.fork() enter+exit",
            best["fork"],
            target=target,
            note="offsets cached: the cost does not grow with the mesh",
        ),
    ]


def _bench_case(
    label: str, mesh: tuple[int, ...], placements: Sequence[Placement], shape: tuple[int, ...], repeat: int
) -> list[BenchResult]:
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
