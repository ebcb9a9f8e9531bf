"""Benchmarks of :mod:`hyperrng.sharding` on 8192-rank meshes.

Two questions, each answered against a baseline timed in the same run:

* ``check_all_ranks``: computing and checking the offsets of every rank
  (:func:`~hyperrng.sharding.check_disjoint`, starting from an empty cache) against asking
  :func:`~hyperrng.sharding.rng_offsets` once per rank with a warm cache.
* ``rng_offsets_cached``: one rank's lookup once its mesh, placements and shape are cached,
  against the same lookup that has to rebuild the table first.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hyperrng import sharding
from hyperrng.benchmarks._timing import BenchResult, best_time

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
    return results


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

    check = best_time(check_cold, number=1, repeat=repeat)
    loop = best_time(every_rank_warm, number=1, repeat=repeat)
    cold = best_time(one_rank_cold, number=1, repeat=repeat)
    warm = best_time(one_rank_warm, number=100, repeat=repeat)
    return [
        BenchResult(
            name=f"sharding.check_all_ranks[{label}]",
            seconds=check,
            baseline=f"{ranks} warm rng_offsets calls",
            baseline_seconds=loop,
            note=f"check_disjoint from a cold cache over {ranks} ranks: {check:.4f} s; "
            f"one rng_offsets call per rank: {loop:.4f} s",
        ),
        BenchResult(
            name=f"sharding.rng_offsets_cached[{label}]",
            seconds=warm,
            baseline="rng_offsets rebuilding its table",
            baseline_seconds=cold,
            note=f"cached lookup {warm * 1e6:.1f} us; uncached (table for {ranks} ranks) {cold:.4f} s",
        ),
    ]
