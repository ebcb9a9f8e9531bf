"""Specification of hyperrng.sharding.offsets: RNG offset windows for shards of a DTensor.

PyTorch is the reference twice over. Its offsets come from its own
``OffsetBasedRNGTracker._compute_rng_offsets`` run on a real ``DTensorSpec`` whose
``DeviceMesh`` is built for the rank in question without a process group
(``_init_backend=False, _rank=r``); only the tracker's constructor, which demands a CUDA
device, is bypassed. Which elements a rank holds comes from splitting ``torch.arange``
with each placement's own ``_split_tensor``, in mesh-dim order, as ``distribute_tensor``
does. Tests that need these torch internals skip when the installed torch lacks them.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard, placement_types

from hyperrng.errors import ArgumentTypeError, HyperRNGError, InvalidArgumentError, RNGDesyncError
from hyperrng.sharding.offsets import (
    PHILOX_OFFSET_ALIGNMENT,
    check_disjoint,
    local_index_ranges,
    local_shard,
    rng_offsets,
)

_StridedShard: Any = getattr(placement_types, "_StridedShard", None)  # absent from older torch releases

_strided_types: tuple[type, ...] = (_StridedShard,) if _StridedShard is not None else ()

needs_strided = pytest.mark.skipif(_StridedShard is None, reason="this torch has no _StridedShard")

Config = tuple[tuple[int, ...], tuple[Any, ...], tuple[int, ...]]


def _strided(dim: int, split_factor: int) -> Any:
    assert _StridedShard is not None
    return _StridedShard(dim, split_factor=split_factor)


# --------------------------------------------------------------------------- references


def _coords(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(size) for size in mesh_shape)))


def _normalised(placements: Sequence[Any], ndim: int) -> tuple[Any, ...]:
    """Placements with negative dims made positive, as distribute_tensor stores them."""
    out: list[Any] = []
    for p in placements:
        if _StridedShard is not None and isinstance(p, _StridedShard):
            out.append(_StridedShard(p.dim % ndim, split_factor=p.split_factor))
        elif isinstance(p, Shard):
            out.append(Shard(p.dim % ndim))
        else:
            out.append(p)
    return tuple(out)


def _torch_offsets(
    mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any], global_shape: Sequence[int]
) -> tuple[int, int]:
    """PyTorch's (start, end) for the rank at ``coordinate``; has the signature of rng_offsets."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor._random import OffsetBasedRNGTracker
    except ImportError as exc:
        pytest.skip(f"this torch lacks DTensor's RNG internals: {exc}")
    rank = int(np.ravel_multi_index(tuple(coordinate), tuple(mesh_shape)))
    try:
        mesh = DeviceMesh(
            "cpu", torch.arange(math.prod(mesh_shape)).view(tuple(mesh_shape)), _init_backend=False, _rank=rank
        )
    except TypeError as exc:
        pytest.skip(f"this torch cannot build a DeviceMesh without a process group: {exc}")
    meta = TensorMeta(torch.Size(global_shape), torch.empty(tuple(global_shape)).stride(), torch.float32)
    spec = DTensorSpec(mesh, _normalised(placements, len(global_shape)), tensor_meta=meta)
    tracker = object.__new__(OffsetBasedRNGTracker)  # __init__ demands CUDA; the offset math does not
    if not hasattr(tracker, "_compute_rng_offsets"):
        pytest.skip("this torch has no OffsetBasedRNGTracker._compute_rng_offsets")
    start, end = tracker._compute_rng_offsets(spec)
    return int(start), int(end)


def _torch_local_elements(
    mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any], global_shape: Sequence[int]
) -> torch.Tensor:
    """The flat global indices the rank holds, in local layout, split as distribute_tensor splits."""
    local = torch.arange(math.prod(global_shape)).reshape(tuple(global_shape))
    for mesh_dim, placement in enumerate(_normalised(placements, len(global_shape))):
        if isinstance(placement, Shard) or (_StridedShard is not None and isinstance(placement, _StridedShard)):
            if not hasattr(placement, "_split_tensor"):
                pytest.skip("this torch has no Placement._split_tensor")
            try:
                pieces, _ = placement._split_tensor(local, mesh_shape[mesh_dim], with_padding=False, contiguous=False)
            except AssertionError as exc:  # torch before 2.7 splits a _StridedShard evenly only
                pytest.skip(f"this torch refuses the split the test compares with: {exc}")
            local = pieces[coordinate[mesh_dim]]
    return local


def _our_local_elements(
    mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any], global_shape: Sequence[int]
) -> torch.Tensor:
    local = torch.arange(math.prod(global_shape)).reshape(tuple(global_shape))
    for dim, runs in enumerate(local_index_ranges(mesh_shape, coordinate, placements, global_shape)):
        local = local.index_select(dim, torch.tensor([i for run in runs for i in run], dtype=torch.long))
    return local


def _reference_offsets(config: Config) -> dict[tuple[int, ...], tuple[int, int]]:
    """Every rank's (start, end) by enumerating all shards, as the docstring of rng_offsets defines them.

    Shards are numbered as PyTorch numbers them (per tensor dim, the mixed-radix number of
    the coordinates on the mesh dims sharding it; then row-major over tensor dims); each
    shard's size comes from splitting the tensor as distribute_tensor does; the windows are
    laid end to end, each rounded up to 4.
    """
    mesh, placements, shape = config
    normalised = _normalised(placements, len(shape))
    by_dim = [
        [m for m, p in enumerate(normalised) if isinstance(p, (Shard, *_strided_types)) and p.dim == d]
        for d in range(len(shape))
    ]

    def shard_index(coord: tuple[int, ...]) -> int:
        index = 0
        for dims in by_dim:
            piece, count = 0, 1
            for m in dims:
                piece, count = piece * mesh[m] + coord[m], count * mesh[m]
            index = index * count + piece
        return index

    numels: dict[int, int] = {}
    for coord in _coords(mesh):
        numel = _torch_local_elements(mesh, coord, placements, shape).numel()
        assert numels.setdefault(shard_index(coord), numel) == numel, "replicas hold different sizes"
    shards = math.prod(math.prod(mesh[m] for m in dims) for dims in by_dim)
    assert sorted(numels) == list(range(shards))
    starts = list(itertools.accumulate((-(-numels[k] // 4) * 4 for k in range(shards)), initial=0))
    return {coord: (starts[shard_index(coord)], starts[shards]) for coord in _coords(mesh)}


def _torch_shard_numels(config: Config) -> set[int]:
    mesh, placements, shape = config
    return {_torch_local_elements(mesh, c, placements, shape).numel() for c in _coords(mesh)}


def _assert_contract(config: Config, offsets: Callable[..., tuple[int, int]] = rng_offsets) -> None:
    """The offset contract, checked independently of hyperrng's shard numbering.

    Replicas are found from the data PyTorch gives each rank (equal element sets), not from
    hyperrng's linear shard index.
    """
    mesh, placements, shape = config
    ends = set()
    by_shard: dict[frozenset[int], set[tuple[int, int]]] = {}
    for coord in _coords(mesh):
        start, end = offsets(mesh, coord, placements, shape)
        assert start % PHILOX_OFFSET_ALIGNMENT == 0 and end % PHILOX_OFFSET_ALIGNMENT == 0, (coord, start, end)
        assert start >= 0
        ends.add(end)
        elements = _torch_local_elements(mesh, coord, placements, shape).flatten().tolist()
        if elements:
            by_shard.setdefault(frozenset(elements), set()).add((start, start + len(elements)))
    assert len(ends) == 1, f"ranks disagree on end: {ends}"
    (end,) = ends
    assert all(len(windows) == 1 for windows in by_shard.values()), "replicas got different windows"
    windows = sorted(w for (w,) in by_shard.values())
    assert all(high <= end for _, high in windows), (windows, end)
    assert all(a_high <= b_low for (_, a_high), (b_low, _) in itertools.pairwise(windows)), windows


# --------------------------------------------------------------------------- configurations


def _shardings() -> list[Any]:
    cases: list[Any] = [
        pytest.param(((4,), (Shard(0),), (10,)), id="1d-uneven"),
        pytest.param(((4, 4), (Shard(0), Shard(1)), (10, 10)), id="2d-uneven-4x4"),
        pytest.param(((2, 2), (Shard(0), Shard(0)), (16,)), id="dim-sharded-twice"),
        pytest.param(((2, 3), (Shard(0), Shard(0)), (7, 2)), id="dim-sharded-twice-uneven"),
        pytest.param(((2, 2, 3), (Shard(1), Replicate(), Shard(1)), (3, 11)), id="twice-around-a-replicate"),
        pytest.param(((2, 3, 2), (Shard(1), Replicate(), Shard(0)), (5, 7)), id="several-dims-and-replicas"),
        pytest.param(((3, 2), (Partial(), Shard(-1)), (4, 9)), id="partial-and-negative-dim"),
        pytest.param(((8,), (Shard(0),), (3, 2)), id="more-ranks-than-rows"),
        pytest.param(((4,), (Shard(0),), (0, 5)), id="empty-tensor"),
        pytest.param(((2,), (Replicate(),), ()), id="scalar-replicated"),
        pytest.param(((2, 2, 2), (Shard(0), Shard(1), Shard(2)), (3, 5, 6)), id="three-dims-uneven"),
    ]
    if _StridedShard is not None:
        cases += [
            pytest.param(((2, 2), (_strided(0, 2), Shard(0)), (8, 8)), id="strided-fsdp2-tp"),
            pytest.param(((2, 3), (_strided(1, 3), Shard(1)), (5, 10)), id="strided-uneven"),
            pytest.param(((3, 2), (Shard(0), _strided(0, 2)), (11,)), id="shard-then-strided"),
        ]
    return cases


def _sweep(seed: int, count: int) -> list[Config]:
    """Random small shardings: uneven sizes, empty extents, dims sharded several times."""
    rng = random.Random(seed)
    configs = []
    for _ in range(count):
        mesh = tuple(rng.randint(1, 3) for _ in range(rng.randint(1, 3)))
        ndim = rng.randint(1, 3)
        placements: list[Any] = []
        for _ in mesh:
            roll = rng.random()
            if roll < 0.2:
                placements.append(Replicate())
            elif roll < 0.3:
                placements.append(Partial())
            elif roll < 0.45 and _StridedShard is not None:
                placements.append(_strided(rng.randrange(ndim), rng.randint(1, 3)))
            else:
                placements.append(Shard(rng.randrange(-ndim, ndim)))
        shape = tuple(rng.randint(0, 9) for _ in range(ndim))
        configs.append((mesh, tuple(placements), shape))
    return configs


def _even_sweep(seed: int, count: int) -> list[Config]:
    """Random shardings with equal shards whose numel is a multiple of 4, each dim sharded once."""
    rng = random.Random(seed)
    configs = []
    for _ in range(count):
        mesh = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        ndim = rng.randint(1, 3)
        free_dims = list(range(ndim))
        rng.shuffle(free_dims)
        parts = [1] * ndim
        placements: list[Any] = []
        for size in mesh:
            if free_dims and rng.random() < 0.7:
                dim = free_dims.pop()
                if _StridedShard is not None and rng.random() < 0.25:
                    split_factor = rng.randint(1, 2)
                    placements.append(_strided(dim, split_factor))
                    parts[dim] = size * split_factor
                else:
                    placements.append(Shard(dim))
                    parts[dim] = size
            else:
                placements.append(rng.choice([Replicate(), Partial()]))
        shape = [p * rng.randint(1, 3) for p in parts]
        shape[-1] *= 4  # every shard's last extent, hence its numel, becomes a multiple of 4
        configs.append((mesh, tuple(placements), tuple(shape)))
    return configs


EQUAL_SHARDINGS = [
    pytest.param(((4,), (Shard(0),), (16,)), id="1d"),
    pytest.param(((2, 2, 2), (Shard(1), Replicate(), Shard(0)), (8, 16)), id="pytorch-docstring-example"),
    pytest.param(((2, 4), (Shard(0), Shard(1)), (8, 8)), id="2d"),
    pytest.param(((2, 2), (Partial(), Shard(1)), (4, 8)), id="partial"),
    pytest.param(((2, 2, 2), (Shard(0), Shard(2), Replicate()), (4, 3, 8)), id="shard-numel-24"),
    pytest.param(((3,), (Shard(-1),), (2, 6)), id="negative-dim"),
]


# --------------------------------------------------------------------------- agreement with PyTorch


@pytest.mark.parametrize("config", EQUAL_SHARDINGS)
def test_offsets_equal_pytorch_when_shards_are_equal_multiples_of_four_and_no_dim_is_sharded_twice(
    config: Config,
) -> None:
    numels = _torch_shard_numels(config)
    assert len(numels) == 1 and numels.pop() % 4 == 0
    mesh, placements, shape = config
    for coord in _coords(mesh):
        assert rng_offsets(mesh, coord, placements, shape) == _torch_offsets(mesh, coord, placements, shape), coord


def test_offsets_equal_pytorch_on_every_even_sharding_of_a_seeded_sweep() -> None:
    compared = 0
    for config in _even_sweep(seed=20240611, count=40):
        numels = _torch_shard_numels(config)
        assert len(numels) == 1 and next(iter(numels)) % 4 == 0, config
        mesh, placements, shape = config
        for coord in _coords(mesh):
            ours = rng_offsets(mesh, coord, placements, shape)
            assert ours == _torch_offsets(mesh, coord, placements, shape), (config, coord)
            compared += 1
    assert compared > 100


@pytest.mark.parametrize("config", _shardings())
def test_local_shard_equals_pytorch_compute_local_shape_and_global_offset(config: Config) -> None:
    try:
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    except ImportError:
        pytest.skip("this torch has no _compute_local_shape_and_global_offset")
    mesh, placements, shape = config
    for coord in _coords(mesh):
        expected = _compute_local_shape_and_global_offset(shape, mesh, list(coord), _normalised(placements, len(shape)))
        assert local_shard(mesh, coord, placements, shape) == expected, coord


@pytest.mark.parametrize("config", _shardings())
def test_local_index_ranges_hold_exactly_what_distribute_tensor_gives_each_rank(config: Config) -> None:
    mesh, placements, shape = config
    for coord in _coords(mesh):
        expected = _torch_local_elements(mesh, coord, placements, shape)
        assert torch.equal(_our_local_elements(mesh, coord, placements, shape), expected), coord


def test_local_shards_match_pytorch_on_a_seeded_sweep_of_uneven_shardings() -> None:
    for mesh, placements, shape in _sweep(seed=7, count=60):
        for coord in _coords(mesh):
            expected = _torch_local_elements(mesh, coord, placements, shape)
            assert torch.equal(_our_local_elements(mesh, coord, placements, shape), expected), (mesh, placements)


# --------------------------------------------------------------------------- the offset contract


@pytest.mark.parametrize("config", _shardings())
def test_windows_of_distinct_shards_are_disjoint_replicas_share_one_and_all_lie_below_end(config: Config) -> None:
    _assert_contract(config)
    check_disjoint(*config)


def test_contract_holds_on_a_seeded_sweep_of_uneven_shardings() -> None:
    for config in _sweep(seed=11, count=60):
        _assert_contract(config)
        check_disjoint(*config)


def test_window_starts_are_packed_sums_of_the_earlier_shards_numels_rounded_to_four() -> None:
    assert [rng_offsets((4,), (r,), [Shard(0)], (10,)) for r in range(4)] == [(0, 16), (4, 16), (8, 16), (12, 16)]
    assert [rng_offsets((2,), (r,), [Shard(0)], (5,)) for r in range(2)] == [(0, 8), (4, 8)]
    # (10, 10) on 4x4: shard extents 3, 3, 3, 1 per dim, so rows of numels 9 9 9 3 / ... / 3 3 3 1.
    rounded = [12, 12, 12, 4] * 3 + [4, 4, 4, 4]
    starts = [rng_offsets((4, 4), c, [Shard(0), Shard(1)], (10, 10))[0] for c in _coords((4, 4))]
    assert starts == list(itertools.accumulate(rounded[:-1], initial=0))
    assert rng_offsets((4, 4), (0, 0), [Shard(0), Shard(1)], (10, 10))[1] == sum(rounded) == 136


def test_replicas_on_replicate_and_partial_mesh_dims_get_the_same_offsets() -> None:
    placements = (Replicate(), Shard(0), Partial())
    for shard in range(3):
        got = {rng_offsets((2, 3, 2), (r, shard, p), placements, (7, 5)) for r in range(2) for p in range(2)}
        assert len(got) == 1


def test_a_replicated_tensor_starts_at_zero_and_ends_at_its_numel_rounded_up() -> None:
    assert rng_offsets((2, 2), (1, 0), [Replicate(), Partial()], (5, 3)) == (0, 16)
    assert rng_offsets((2, 2), (1, 0), [Replicate(), Partial()], (5, 3)) == _torch_offsets(
        (2, 2), (1, 0), [Replicate(), Partial()], (5, 3)
    )
    assert rng_offsets((2,), (1,), [Replicate()], ()) == (0, 4)


def test_a_negative_shard_dim_counts_from_the_end_like_dtensor() -> None:
    for coord in _coords((2, 3)):
        assert rng_offsets((2, 3), coord, [Shard(-1), Shard(0)], (5, 7)) == rng_offsets(
            (2, 3), coord, [Shard(1), Shard(0)], (5, 7)
        )
        assert local_shard((2, 3), coord, [Shard(-1), Shard(0)], (5, 7)) == local_shard(
            (2, 3), coord, [Shard(1), Shard(0)], (5, 7)
        )


def test_distinct_shards_partition_the_tensor() -> None:
    mesh, placements, shape = (2, 3, 2), (Shard(1), Shard(0), Shard(1)), (7, 9)
    held = {local_index_ranges(mesh, c, placements, shape) for c in _coords(mesh)}
    cells = [cell for ranges in held for cell in itertools.product(*(list(itertools.chain(*r)) for r in ranges))]
    assert sorted(cells) == list(itertools.product(range(7), range(9)))


@needs_strided
def test_strided_shard_follows_the_fsdp2_plus_tp_right_to_left_row_order() -> None:
    placements = (_strided(0, 2), Shard(0))
    rows = {c: local_index_ranges((2, 2), c, placements, (8, 8))[0] for c in _coords((2, 2))}
    assert rows == {(0, 0): (range(2),), (0, 1): (range(4, 6),), (1, 0): (range(2, 4),), (1, 1): (range(6, 8),)}
    assert local_index_ranges((2,), (1,), (_strided(0, 2),), (8,)) == ((range(2, 4), range(6, 8)),)
    check_disjoint((2, 2), placements, (8, 8))


# --------------------------------------------------------------------------- closed form against enumeration


@pytest.mark.parametrize("config", _shardings() + EQUAL_SHARDINGS)
def test_closed_form_equals_a_brute_force_enumeration_of_the_shards(config: Config) -> None:
    mesh, placements, shape = config
    expected = _reference_offsets(config)
    assert {coord: rng_offsets(mesh, coord, placements, shape) for coord in _coords(mesh)} == expected


def test_closed_form_equals_enumeration_on_a_seeded_sweep_of_uneven_and_even_shardings() -> None:
    for config in _sweep(seed=13, count=80) + _even_sweep(seed=17, count=20):
        mesh, placements, shape = config
        expected = _reference_offsets(config)
        assert {coord: rng_offsets(mesh, coord, placements, shape) for coord in _coords(mesh)} == expected, config


@st.composite
def _configs(draw: st.DrawFn) -> Config:
    """Small meshes and shapes: replicas, partials, uneven and empty pieces, dims split twice, strided."""
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    ndim = draw(st.integers(0, 3))
    kinds = ["replicate", "partial"] + (["shard", "shard", "strided"] if ndim else [])
    placements: list[Any] = []
    for _ in mesh:
        kind = draw(st.sampled_from(kinds))
        if kind == "replicate":
            placements.append(Replicate())
        elif kind == "partial":
            placements.append(Partial())
        elif kind == "strided" and _StridedShard is not None:
            placements.append(_strided(draw(st.integers(0, ndim - 1)), draw(st.integers(1, 4))))
        else:
            placements.append(Shard(draw(st.integers(-ndim, ndim - 1))))
    shape = tuple(draw(st.lists(st.integers(0, 23), min_size=ndim, max_size=ndim)))
    return mesh, tuple(placements), shape


@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(_configs())
def test_closed_form_and_local_pieces_equal_enumeration_for_any_small_sharding(config: Config) -> None:
    mesh, placements, shape = config
    expected = _reference_offsets(config)
    for coord in _coords(mesh):
        assert rng_offsets(mesh, coord, placements, shape) == expected[coord], coord
        held = _torch_local_elements(mesh, coord, placements, shape)
        assert torch.equal(_our_local_elements(mesh, coord, placements, shape), held), coord
        assert local_shard(mesh, coord, placements, shape)[0] == tuple(held.shape), coord
    check_disjoint(mesh, placements, shape)


# --------------------------------------------------------------------------- where PyTorch breaks the contract


def test_pytorch_overruns_end_on_an_uneven_1d_split_and_ours_does_not() -> None:
    mesh, placements, shape = (4,), (Shard(0),), (10,)
    theirs = [_torch_offsets(mesh, (r,), placements, shape) for r in range(4)]
    assert theirs == [(0, 12), (4, 12), (8, 12), (12, 12)]  # the last shard's 1 element: [12, 13), past 12
    with pytest.raises(RNGDesyncError, match=r"\[12, 13\), past end=12"):
        check_disjoint(mesh, placements, shape, offsets=_torch_offsets)
    with pytest.raises(AssertionError):
        _assert_contract((mesh, placements, shape), offsets=_torch_offsets)
    assert [rng_offsets(mesh, (r,), placements, shape) for r in range(4)] == [(0, 16), (4, 16), (8, 16), (12, 16)]
    _assert_contract((mesh, placements, shape))
    check_disjoint(mesh, placements, shape)


def test_pytorch_windows_overlap_on_a_10x10_tensor_over_a_4x4_mesh_and_ours_do_not() -> None:
    mesh, placements, shape = (4, 4), (Shard(0), Shard(1)), (10, 10)
    windows = {}
    for coord in _coords(mesh):
        start, end = _torch_offsets(mesh, coord, placements, shape)
        windows[coord] = (start, start + math.prod(local_shard(mesh, coord, placements, shape)[0]))
    assert end == 100
    assert windows[(0, 1)] == (12, 21) and windows[(0, 2)] == (20, 29)  # overlapping
    assert windows[(3, 3)] == (136, 137)  # and far past end
    with pytest.raises(RNGDesyncError, match="overlapping|past end"):
        check_disjoint(mesh, placements, shape, offsets=_torch_offsets)
    with pytest.raises(AssertionError):
        _assert_contract((mesh, placements, shape), offsets=_torch_offsets)
    _assert_contract((mesh, placements, shape))
    check_disjoint(mesh, placements, shape)


def test_pytorch_overruns_end_when_a_dim_is_sharded_twice_and_ours_does_not() -> None:
    mesh, placements, shape = (2, 2), (Shard(0), Shard(0)), (16,)
    assert {math.prod(local_shard(mesh, c, placements, shape)[0]) for c in _coords(mesh)} == {4}
    # PyTorch sizes the shard from the last mesh dim alone (16 / 2 = 8 instead of 4).
    assert [_torch_offsets(mesh, c, placements, shape) for c in _coords(mesh)] == [(0, 16), (8, 16), (16, 16), (24, 16)]
    with pytest.raises(RNGDesyncError, match="past end=16"):
        check_disjoint(mesh, placements, shape, offsets=_torch_offsets)
    with pytest.raises(AssertionError):
        _assert_contract((mesh, placements, shape), offsets=_torch_offsets)
    assert [rng_offsets(mesh, c, placements, shape) for c in _coords(mesh)] == [(0, 16), (4, 16), (8, 16), (12, 16)]
    check_disjoint(mesh, placements, shape)


# --------------------------------------------------------------------------- check_disjoint on foreign offsets


def test_check_disjoint_rejects_replicas_that_start_at_different_offsets() -> None:
    def by_rank(mesh: Sequence[int], coord: Sequence[int], placements: Any, shape: Sequence[int]) -> tuple[int, int]:
        return 4 * coord[0], 8

    with pytest.raises(RNGDesyncError, match="hold the same shard but start at offsets 0 and 4"):
        check_disjoint((2,), (Replicate(),), (3,), offsets=by_rank)


def test_check_disjoint_rejects_ranks_that_disagree_on_end() -> None:
    def by_rank(mesh: Sequence[int], coord: Sequence[int], placements: Any, shape: Sequence[int]) -> tuple[int, int]:
        return 4 * coord[0], 8 + 4 * coord[0]

    with pytest.raises(RNGDesyncError, match="advance to different offsets after the op"):
        check_disjoint((2,), (Shard(0),), (8,), offsets=by_rank)


def test_check_disjoint_rejects_offsets_that_are_not_multiples_of_four() -> None:
    def unaligned(mesh: Sequence[int], coord: Sequence[int], placements: Any, shape: Sequence[int]) -> tuple[int, int]:
        return 3 * coord[0], 8

    with pytest.raises(RNGDesyncError, match="multiples of 4"):
        check_disjoint((2,), (Shard(0),), (6,), offsets=unaligned)


# --------------------------------------------------------------------------- scale


def test_every_rank_of_8192_rank_3d_and_4d_meshes_passes_the_check() -> None:
    check_disjoint((8, 16, 64), (Shard(0), Shard(1), Shard(0)), (5000, 3001))
    check_disjoint((4, 8, 16, 16), (Shard(0), Replicate(), Shard(1), Shard(2)), (1024, 999, 77))


def test_offsets_on_an_even_8192_rank_4d_mesh_equal_pytorch_on_sampled_ranks() -> None:
    mesh, placements, shape = (4, 8, 16, 16), (Shard(0), Replicate(), Shard(1), Shard(2)), (64, 64, 64)
    check_disjoint(mesh, placements, shape)
    rng = random.Random(3)
    for _ in range(8):
        coord = tuple(rng.randrange(size) for size in mesh)
        assert rng_offsets(mesh, coord, placements, shape) == _torch_offsets(mesh, coord, placements, shape)


def test_a_2_62_rank_mesh_answers_with_the_values_derived_by_hand() -> None:
    ranks = 2**62
    # Shard(0) of 2**40 elements: ranks below 2**40 hold one element each (windows of 4),
    # the others nothing; end is 4 * 2**40.
    shape = (2**40,)
    assert rng_offsets((ranks,), (0,), [Shard(0)], shape) == (0, 2**42)
    assert rng_offsets((ranks,), (2**40 - 1,), [Shard(0)], shape) == (2**42 - 4, 2**42)
    assert rng_offsets((ranks,), (2**61 + 3,), [Shard(0)], shape) == (2**42, 2**42)
    assert rng_offsets((ranks,), (ranks - 1,), [Shard(0)], shape) == (2**42, 2**42)
    assert local_index_ranges((ranks,), (12345,), [Shard(0)], shape) == ((range(12345, 12346),),)
    assert local_index_ranges((ranks,), (ranks - 1,), [Shard(0)], shape) == ((),)
    assert local_shard((ranks,), (ranks - 1,), [Shard(0)], shape) == ((0,), (2**40,))
    # An evenly divisible split across a 2**31 x 2**31 mesh, replicated along the second dim:
    # shards of 4 elements, one window of 4 per row of the mesh.
    mesh, placements = (2**31, 2**31), [Shard(0), Replicate()]
    assert rng_offsets(mesh, (2**31 - 1, 7), placements, (2**33,)) == (2**33 - 4, 2**33)
    assert rng_offsets(mesh, (1000, 2**31 - 1), placements, (2**33,)) == (4000, 2**33)
    # _StridedShard over 2**40 ranks: two chunks of 2**42 elements, four of each per rank.
    if _StridedShard is not None:
        assert rng_offsets((2**40,), (99,), [_strided(0, 2)], (2**43,)) == (8 * 99, 2**43)
        assert local_index_ranges((2**40,), (99,), [_strided(0, 2)], (2**43,)) == (
            (range(396, 400), range(2**42 + 396, 2**42 + 400)),
        )
    # Replicated, on the largest mesh there is.
    assert rng_offsets((2**63,), (2**63 - 1,), [Replicate()], (5,)) == (0, 8)


def test_a_2_20_rank_mesh_answers_with_the_values_derived_by_hand_and_equals_pytorch() -> None:
    mesh, placements, shape = (2**20,), [Shard(0)], (2**23,)
    for rank in (0, 1, 2**19 + 5, 2**20 - 1):
        assert rng_offsets(mesh, (rank,), placements, shape) == (8 * rank, 2**23)
    # 2**10 x 2**10 over a (2**12, 2**13) tensor: shards of 4 x 8 elements, numbered row-major.
    mesh2, placements2, shape2 = (2**10, 2**10), [Shard(0), Shard(1)], (2**12, 2**13)
    for i, j in ((0, 0), (3, 1000), (1023, 1023)):
        assert rng_offsets(mesh2, (i, j), placements2, shape2) == (32 * (i * 1024 + j), 2**25)
    assert rng_offsets(mesh2, (3, 1000), placements2, shape2) == _torch_offsets(mesh2, (3, 1000), placements2, shape2)
    # Uneven: 10**6 + 3 rows over 2**20 ranks leave ranks past 10**6 + 2 empty.
    assert rng_offsets(mesh, (999_999,), placements, (10**6 + 3, 3)) == (999_999 * 4, (10**6 + 3) * 4)
    assert rng_offsets(mesh, (2**20 - 1,), placements, (10**6 + 3, 3)) == ((10**6 + 3) * 4, (10**6 + 3) * 4)


def test_numpy_ints_and_torch_size_are_accepted_as_sizes() -> None:
    got = rng_offsets((np.int64(4),), torch.Size([np.int64(1)]), [Shard(0)], torch.Size([10]))
    assert got == rng_offsets((4,), (1,), [Shard(0)], (10,)) == (4, 16)
    got = rng_offsets([np.int32(2), np.uint8(3)], (np.int16(1), np.int64(2)), (Shard(np.int64(1)), Shard(0)), (7, 5))
    assert got == rng_offsets((2, 3), (1, 2), (Shard(1), Shard(0)), (7, 5))


def test_every_call_validates_nothing_is_remembered_from_a_valid_call() -> None:
    mesh, placements, shape = (2, 6), (Shard(1), Shard(0)), (13, 17)
    for function in (rng_offsets, local_shard, local_index_ranges):
        for _ in range(2):
            function(mesh, (1, 5), placements, shape)
            with pytest.raises(InvalidArgumentError, match="outside the mesh"):
                function(mesh, (2, 5), placements, shape)
            with pytest.raises(ArgumentTypeError, match=r"coordinate\[0\] must be an int, got float 1.0"):
                function(mesh, (1.0, 5), placements, shape)
            with pytest.raises(ArgumentTypeError, match=r"mesh_shape\[1\] must be an int, got float 6.0"):
                function((2, 6.0), (1, 5), placements, shape)


# --------------------------------------------------------------------------- bad input


class _FloatDimShard(Shard):
    """A Shard whose dim is not an integer, as a hand-written placement might have."""

    @property
    def dim(self) -> Any:  # type: ignore[override]
        return 1.5

    @dim.setter
    def dim(self, value: Any) -> None:  # where Shard is a dataclass (older torch), its __init__ sets dim
        pass


BAD_INPUTS = [
    pytest.param(
        ((4,), (0, 1), [Shard(0)], (8,)),
        InvalidArgumentError,
        "has 2 entries but the mesh (4,) has 1 dims",
        id="coord-length",
    ),
    pytest.param(
        ((4,), (4,), [Shard(0)], (8,)), InvalidArgumentError, "outside the mesh (4,): index 4", id="coord-too-large"
    ),
    pytest.param(((4,), (-1,), [Shard(0)], (8,)), InvalidArgumentError, "coordinate[0] is -1", id="coord-negative"),
    pytest.param(
        ((4,), (True,), [Shard(0)], (8,)),
        ArgumentTypeError,
        "coordinate[0] must be an int, got the bool",
        id="coord-bool",
    ),
    pytest.param(
        ((4,), (np.bool_(True),), [Shard(0)], (8,)),
        ArgumentTypeError,
        "coordinate[0] must be an int, got the bool",
        id="coord-numpy-bool",
    ),
    pytest.param(
        ((4,), (1.9,), [Shard(0)], (8,)),
        ArgumentTypeError,
        "coordinate[0] must be an int, got float 1.9",
        id="coord-float",
    ),
    pytest.param(
        ((4,), (np.float64(1.0),), [Shard(0)], (8,)),
        ArgumentTypeError,
        "coordinate[0] must be an int, got float64",
        id="coord-numpy-float",
    ),
    pytest.param(((4,), 1, [Shard(0)], (8,)), ArgumentTypeError, "coordinate must be a sequence", id="coord-scalar"),
    pytest.param(
        ((4,), (0,), [Shard(0), Replicate()], (8,)),
        InvalidArgumentError,
        "got 2 placements for a 1-dim mesh",
        id="too-many",
    ),
    pytest.param(
        ((2, 2), (0, 0), [Shard(0)], (8,)), InvalidArgumentError, "got 1 placements for a 2-dim mesh", id="too-few"
    ),
    pytest.param(
        ((2,), (0,), [Shard(2)], (4, 4)), InvalidArgumentError, "has 2 dims; shard a dim in [-2, 2)", id="dim-too-large"
    ),
    pytest.param(
        ((2,), (0,), [Shard(-3)], (4, 4)),
        InvalidArgumentError,
        "has 2 dims; shard a dim in [-2, 2)",
        id="dim-too-negative",
    ),
    pytest.param(
        ((2,), (0,), [Shard(0)], ()), InvalidArgumentError, "0-dim and cannot be sharded", id="shard-a-scalar"
    ),
    pytest.param(((2,), (0,), [Shard(0)], (4, -1)), InvalidArgumentError, "global_shape[1] is -1", id="negative-size"),
    pytest.param(((0,), (0,), [Shard(0)], (4,)), InvalidArgumentError, "mesh_shape[0] is 0", id="empty-mesh-dim"),
    pytest.param(
        ((2.7,), (0,), [Shard(0)], (4,)),
        ArgumentTypeError,
        "mesh_shape[0] must be an int, got float 2.7",
        id="float-mesh",
    ),
    pytest.param(
        ((np.float32(2),), (0,), [Shard(0)], (4,)),
        ArgumentTypeError,
        "mesh_shape[0] must be an int, got float32",
        id="numpy-float-mesh",
    ),
    pytest.param(
        ((2,), (0,), [Shard(0)], (2.5,)),
        ArgumentTypeError,
        "global_shape[0] must be an int, got float 2.5",
        id="float-size",
    ),
    pytest.param(
        ((2,), (0,), [Shard(0)], (True,)),
        ArgumentTypeError,
        "global_shape[0] must be an int, got the bool",
        id="bool-size",
    ),
    pytest.param(("2", (0,), [Shard(0)], (4,)), ArgumentTypeError, "mesh_shape must be a sequence", id="string-mesh"),
    pytest.param((4, (0,), [Shard(0)], (4,)), ArgumentTypeError, "mesh_shape must be a sequence", id="int-mesh"),
    pytest.param(
        ((2,), (0,), [Shard(0)], "4"), ArgumentTypeError, "global_shape must be a sequence", id="string-shape"
    ),
    pytest.param(((2,), (0,), Shard(0), (4,)), ArgumentTypeError, "placements must be a sequence", id="bare-placement"),
    pytest.param(
        ((2,), (0,), ["Shard(0)"], (4,)), ArgumentTypeError, "of type str, not a placement", id="string-placement"
    ),
    pytest.param(
        ((2,), (0,), [object()], (4,)), ArgumentTypeError, "of type object, not a placement", id="object-placement"
    ),
    pytest.param(
        ((2,), (0,), [None], (4,)), ArgumentTypeError, "placements[0] is None of type NoneType", id="none-placement"
    ),
    pytest.param(
        ((2,), (0,), [_FloatDimShard(0)], (4, 4)),
        ArgumentTypeError,
        "placements[0].dim must be an int, got float 1.5",
        id="float-dim",
    ),
    pytest.param(
        ((2**32, 2**32), (0, 0), [Replicate(), Replicate()], (4,)),
        InvalidArgumentError,
        "has 18446744073709551616 ranks, more than 9223372036854775808 (2**63)",
        id="mesh-past-2**63-ranks",
    ),
    pytest.param(
        ((1,), (0,), [Replicate()], (2**32, 2**31)),
        InvalidArgumentError,
        "has 9223372036854775808 elements or a dim past 9223372036854775807",
        id="numel-past-2**63-1",
    ),
    pytest.param(
        ((1,), (0,), [Replicate()], (0, 2**63)),
        InvalidArgumentError,
        "or a dim past 9223372036854775807",
        id="empty-shape-with-a-dim-past-2**63-1",
    ),
]
if _StridedShard is not None:
    BAD_INPUTS.append(
        pytest.param(
            ((2,), (0,), [_strided(0, 0)], (4,)),
            InvalidArgumentError,
            "split_factor 0; it must be at least 1",
            id="split-zero",
        )
    )


@pytest.mark.parametrize(("args", "error", "fragment"), BAD_INPUTS)
@pytest.mark.parametrize("function", [rng_offsets, local_shard, local_index_ranges])
def test_bad_input_raises_a_typed_error_naming_the_argument(
    function: Callable[..., object], args: tuple[Any, ...], error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error) as info:
        function(*args)
    assert fragment in str(info.value)
    assert isinstance(info.value, HyperRNGError)
    if error is ArgumentTypeError:  # wrong type: a TypeError, never a ValueError
        assert isinstance(info.value, TypeError) and not isinstance(info.value, ValueError)
    else:  # wrong value
        assert isinstance(info.value, ValueError) and not isinstance(info.value, TypeError)


def test_offsets_past_2_63_raise_sharding_error_not_overflow_error() -> None:
    # 2**62 shards of one element each pad to 4: end would be 2**64.
    mesh, placements, shape = (2**62,), [Shard(0)], (2**62,)
    with pytest.raises(InvalidArgumentError, match="would end at 18446744073709551616, past 9223372036854775807"):
        rng_offsets(mesh, (0,), placements, shape)
    with pytest.raises(InvalidArgumentError, match="would end at"):
        check_disjoint(mesh, placements, shape)
    # The layout itself is fine: only the offsets do not fit a generator.
    assert local_shard(mesh, (2**62 - 1,), placements, shape) == ((1,), (2**62 - 1,))
    # Just inside: 2**61 - 1 one-element shards and an empty one end at 2**63 - 4.
    assert rng_offsets((2**61,), (2**61 - 1,), [Shard(0)], (2**61 - 1,)) == (2**63 - 4, 2**63 - 4)


def test_check_disjoint_rejects_bad_input_with_typed_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="got 1 placements for a 2-dim mesh"):
        check_disjoint((2, 2), [Shard(0)], (8,))
    with pytest.raises(InvalidArgumentError, match="has 1 dims; shard a dim"):
        check_disjoint((2,), [Shard(1)], (8,))
    with pytest.raises(ArgumentTypeError, match=r"mesh_shape\[0\] must be an int, got float 2.7"):
        check_disjoint((2.7,), [Shard(0)], (8,))
    with pytest.raises(ArgumentTypeError, match="not a placement"):
        check_disjoint((2,), [object()], (8,))
