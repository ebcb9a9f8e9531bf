"""Benchmarks of :mod:`hyperrng.sharding` on 8192-rank meshes.

Two questions, each answered against a baseline timed in the same run:

* ``check_all_ranks``: computing and checking the offsets of every rank
  (:func:`~hyperrng.sharding.check_disjoint`, starting from an empty cache) against asking
  :func:`~hyperrng.sharding.rng_offsets` once per rank with a warm cache.
* ``rng_offsets_cached``: one rank's lookup once its mesh, placements and shape are cached,
  against the same lookup that has to rebuild the table first.
* ``distribute_region``: enter+exit of a region on the current platform, offsets cached,
  against a bare ``tracker.fork()`` (target on the CPU: at most 1.5x), on a small mesh and
  on an 8192-rank one, to show the cost does not depend on mesh size; and the slowest
  round of 10,000 regions over 200,000 in one process against the fastest (target 1.5x),
  to show that nothing builds up over a run.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hyperrng import sharding
from hyperrng.benchmarks._timing import BenchResult, Timing, interleaved, time_rounds

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


_REGION_TARGET = 1.5  # a region may cost at most one and a half bare forks once its offsets are cached
_FLAT_TARGET = 1.5  # over a long run, the slowest round of regions within this of the fastest


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
    # Build-up shows only in a long run: 200,000 regions in rounds of 10,000, each at a new
    # position as in training (every region moves the generator on).
    long_number, long_rounds = (2_000, 10) if quick else (10_000, 20)
    long_run = time_rounds(lambda: region(small), number=long_number, rounds=long_rounds)
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
        BenchResult(
            f"{platform.name}: distribute_region, slowest round",
            Timing((long_run.high,)),
            "its fastest round",
            Timing((long_run.low,)),
            target=_FLAT_TARGET,
            note=f"{long_rounds} rounds of {long_number:,} regions ({long_rounds * long_number:,} in one process); "
            f"median {long_run.median * 1e6:.1f} us; late/early rounds {long_run.drift:.2f}",
        ),
    ]


def _bench_case(
    label: str, mesh: tuple[int, ...], placements: Sequence[Placement], shape: tuple[int, ...], repeat: int
) -> list[BenchResult]:
    coords = list(itertools.product(*(range(size) for size in mesh)))
    ranks = len(coords)
    middle = coords[ranks // 2]

    def check_cold() -> None:
        sharding._table.cache_clear()
        sharding.check_disjoint(mesh, placements, shape)

    def every_rank_warm() -> None:
        for coord in coords:
            sharding.rng_offsets(mesh, coord, placements, shape)

    def one_rank_warm() -> None:
        sharding.rng_offsets(mesh, middle, placements, shape)

    def one_rank_cold() -> None:
        sharding._table.cache_clear()
        sharding.rng_offsets(mesh, middle, placements, shape)

    pair = interleaved({"check": check_cold, "loop": every_rank_warm}, number=1, rounds=repeat)
    check, loop = pair["check"], pair["loop"]
    cold = time_rounds(one_rank_cold, number=1, rounds=repeat)
    warm = time_rounds(one_rank_warm, number=100, rounds=repeat)
    return [
        BenchResult(
            name=f"sharding.check_all_ranks[{label}]",
            timing=check,
            baseline=f"{ranks} warm rng_offsets calls",
            baseline_timing=loop,
            note=f"check_disjoint from a cold cache over {ranks} ranks: {check.median:.4f} s; "
            f"one rng_offsets call per rank: {loop.median:.4f} s",
        ),
        BenchResult(
            name=f"sharding.rng_offsets_cached[{label}]",
            timing=warm,
            baseline="rng_offsets rebuilding its table",
            baseline_timing=cold,
            note=f"cached lookup {warm.median * 1e6:.1f} us; uncached (table for {ranks} ranks) {cold.median:.4f} s",
        ),
    ]
