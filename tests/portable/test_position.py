"""Portable draws at managed positions: every sharding and every platform give the same numbers."""

from __future__ import annotations

import itertools
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from hyperrng import philox
from hyperrng.errors import ArgumentTypeError, InvalidArgumentError
from hyperrng.portable import position as portable
from hyperrng.sharding.tracker import MeshInfo
from hyperrng.streams.tracker import RNGStatesTracker
from tests._dist import run_ranks
from tests._platforms import PLATFORMS, use_each

try:
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # older torch
    _StridedShard = None

SEED = 2024


platform = use_each(PLATFORMS)


def _assemble(mesh_shape: tuple[int, ...], placements: list[Any], shape: tuple[int, ...], draw: Any) -> torch.Tensor:
    """Put every rank's shard back at its global indices; check replicas agree on the way."""
    full = torch.full(shape, float("nan"))
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        mesh = MeshInfo(mesh_shape, coord)
        local = draw(mesh)
        slices = portable.shard_slices(mesh, placements, shape)
        index = [list(itertools.chain(*(range(s.start, s.stop) for s in sl))) for sl in slices]
        block = full[torch.meshgrid(*[torch.tensor(i, dtype=torch.long) for i in index], indexing="ij")]
        if not torch.isnan(block).all():
            assert torch.equal(block, local), f"replica at {coord} drew other numbers"
        full[torch.meshgrid(*[torch.tensor(i, dtype=torch.long) for i in index], indexing="ij")] = local
    return full


SHARDINGS = [
    ((4,), [Shard(0)], (10, 6)),  # uneven: 3, 3, 3, 1 rows
    ((2, 2), [Shard(0), Replicate()], (8, 6)),
    ((2, 3), [Shard(1), Shard(0)], (7, 5)),  # two tensor dims sharded
    ((2, 2), [Shard(0), Shard(0)], (9, 3)),  # one dim sharded over two mesh dims
    ((3,), [Replicate()], (4, 4)),
]
if _StridedShard is not None:
    SHARDINGS.append(((2, 2), [_StridedShard(0, split_factor=2), Shard(0)], (8, 2)))


@pytest.mark.parametrize(("mesh_shape", "placements", "shape"), SHARDINGS)
def test_shards_put_together_equal_the_unsharded_tensor(
    mesh_shape: tuple[int, ...], placements: list[Any], shape: tuple[int, ...]
) -> None:
    def draw(mesh: MeshInfo) -> torch.Tensor:
        platforms.current().manual_seed(SEED)  # every rank starts from the same position (a device not yet
        # registered when torch.manual_seed ran would keep its default seed)
        return portable.sharded_uniform(mesh, placements, shape)

    assert torch.equal(_assemble(mesh_shape, placements, shape, draw), philox.uniform(shape, key=SEED, offset=0))


def test_every_rank_leaves_at_the_same_position(platform: platforms.Platform) -> None:
    positions = set()
    for c in range(4):
        platform.manual_seed(SEED)
        portable.sharded_normal(MeshInfo((4,), (c,)), [Shard(0)], (10, 6))
        positions.add(platform.get_seed_offset())
    assert positions == {(SEED, 60)}


def test_every_platform_draws_the_same_numbers() -> None:
    results = []
    available = [made for made in (make() for make in PLATFORMS.values()) if made.probe() is None]
    assert len(available) >= 2  # the CPU and a plug-in at least, on any supported torch
    for made in available:
        with platforms.use(made) as p:
            p.manual_seed(SEED)
            results.append(
                (
                    portable.uniform((33,)),
                    portable.bernoulli((17,), 0.3),
                    portable.sharded_uniform(MeshInfo((2,), (1,)), [Shard(0)], (6, 5)),
                )  # fmt: skip
            )
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_consecutive_draws_continue_where_the_last_stopped(platform: platforms.Platform) -> None:
    platform.manual_seed(SEED)
    a, b = portable.uniform((5,)), portable.uniform((3,))
    assert platform.get_seed_offset() == (SEED, 12)  # 5 -> 8, then 3 -> 4
    assert torch.equal(a, philox.uniform((5,), key=SEED, offset=0))
    assert torch.equal(b, philox.uniform((3,), key=SEED, offset=8))


def test_inside_a_fork_the_stream_hands_out_positions(platform: platforms.Platform) -> None:
    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 77)
    platform.manual_seed(SEED)
    default_before = platform.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        first = portable.dropout(torch.ones(16), 0.5)
    with tracker.fork("model-parallel-rng"):
        second = portable.uniform((4,))
    assert torch.equal(first, philox.dropout(torch.ones(16), 0.5, key=77, offset=0))
    assert torch.equal(second, philox.uniform((4,), key=77, offset=16))
    assert torch.equal(platform.get_rng_state(), default_before)


def test_sharded_dropout_masks_each_shard_like_the_full_tensor() -> None:
    x = torch.randn(10, 6)
    full = philox.dropout(x, 0.25, key=SEED, offset=0)
    rows = [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 10)]
    for c, sl in enumerate(rows):
        torch.manual_seed(SEED)
        assert torch.equal(portable.sharded_dropout(x[sl], 0.25, MeshInfo((4,), (c,)), [Shard(0)], (10, 6)), full[sl])


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_a_dropout_that_draws_nothing_leaves_the_generator_where_it_was(platform: platforms.Platform, p: float) -> None:
    platform.manual_seed(SEED)
    x = torch.randn(10, 6)
    mesh = MeshInfo((2,), (1,))
    assert torch.equal(portable.dropout(x, p), philox.dropout(x, p, key=SEED))
    assert torch.equal(
        portable.sharded_dropout(x[5:], p, mesh, [Shard(0)], (10, 6)), philox.dropout(x, p, key=SEED)[5:]
    )
    assert platform.get_seed_offset() == (SEED, 0)  # as F.dropout in portable mode: p = 0 and p = 1 draw nothing


def test_dropout_outside_training_changes_nothing(platform: platforms.Platform) -> None:
    before = platform.get_rng_state()
    x = torch.ones(8)
    assert portable.dropout(x, 0.5, training=False) is x
    assert torch.equal(platform.get_rng_state(), before)


def test_a_passed_generator_is_used_and_advanced() -> None:
    with platforms.use(platforms.CPUPlatform()):  # a CPU torch.Generator belongs to the CPU platform only
        gen = torch.Generator().manual_seed(5)
        before = torch.get_rng_state()
        a = portable.uniform((6,), generator=gen)
        assert torch.equal(a, philox.uniform((6,), key=5, offset=0))
        assert platforms.CPUPlatform().get_seed_offset(generator=gen) != (5, 0)
        assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize(
    ("call", "error", "fragment"),
    [
        (lambda: portable.uniform((4,), dtype=torch.int32), TypeError, "int32"),
        (lambda: portable.uniform((-1, 3)), ValueError, "-1"),
        (lambda: portable.bernoulli((4,), 1.5), ValueError, "1.5"),
        (lambda: portable.normal((4,), std=-1.0), ValueError, "std"),
        (lambda: portable.dropout(torch.ones(4), float("nan")), ValueError, "nan"),
        (lambda: portable.dropout(torch.ones(4, dtype=torch.int64), 0.5), TypeError, "floating-point"),
        (lambda: portable.sharded_uniform(MeshInfo((2,), (2,)), [Shard(0)], (4,)), InvalidArgumentError, "coordinate"),
        (lambda: portable.sharded_uniform(MeshInfo((2,), (0,)), [Shard(3)], (4,)), InvalidArgumentError, "dim"),
        (
            lambda: portable.sharded_dropout(torch.ones(3), 0.5, MeshInfo((2,), (0,)), [Shard(0)], (4,)),
            ValueError,
            "this rank's shard has shape (2,)",
        ),  # fmt: skip
        (lambda: portable.reserve(-1), InvalidArgumentError, "non-negative"),
        (lambda: portable.reserve("4"), ArgumentTypeError, "numel must be an int"),
        (lambda: portable.reserve(4.0), ArgumentTypeError, "numel must be an int"),
        (lambda: portable.uniform((4,), generator="x"), ArgumentTypeError, "generator must be a torch.Generator"),
        (lambda: portable.dropout([1.0], 0.5), ArgumentTypeError, "x must be a torch.Tensor"),
        (
            lambda: portable.sharded_dropout([1.0], 0.5, MeshInfo((2,), (0,)), [Shard(0)], (2,)),
            ArgumentTypeError,
            "x must be a torch.Tensor",
        ),
        # Past the per-call size limit: refused before a single counter is taken.
        (lambda: portable.uniform((2**40,)), ValueError, "MAX_NUMEL"),
        (lambda: portable.normal((2**40,)), ValueError, "MAX_NUMEL"),
        (lambda: portable.sharded_uniform(MeshInfo((2,), (0,)), [Replicate()], (2**37,)), ValueError, "MAX_NUMEL"),
    ],
)
def test_bad_input_raises_before_the_generator_moves(
    platform: platforms.Platform, call: Any, error: type[Exception], fragment: str
) -> None:
    platform.manual_seed(SEED)
    before = platform.get_rng_state()
    with pytest.raises(error) as info:
        call()
    assert fragment in str(info.value)
    assert torch.equal(platform.get_rng_state(), before)


def test_a_draw_that_fails_midway_leaves_the_generator_where_it_was(
    platform: platforms.Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An allocation failure inside the draw (simulated: the engine raises) takes no counters."""

    def failing(engine: Any) -> Any:
        def draw(shape: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            if philox.check_shape(shape) == (0,):  # the zero-size validation calls must still pass
                return engine(shape, *args, **kwargs)
            raise RuntimeError("DefaultCPUAllocator: not enough memory")

        return draw

    platform.manual_seed(SEED)
    before = platform.get_rng_state()
    for name in ("uniform", "normal", "bernoulli"):
        monkeypatch.setattr(philox, name, failing(getattr(philox, name)))
    draws = [
        lambda: portable.uniform((8,)),
        lambda: portable.normal((8,)),
        lambda: portable.sharded_uniform(MeshInfo((2,), (1,)), [Shard(0)], (8,)),
        lambda: portable.sharded_dropout(torch.ones(4), 0.5, MeshInfo((2,), (1,)), [Shard(0)], (8,)),
    ]
    for draw in draws:
        with pytest.raises(RuntimeError, match="not enough memory"):
            draw()
        assert torch.equal(platform.get_rng_state(), before)


@pytest.mark.skipif(_StridedShard is None, reason="this torch has no _StridedShard")
def test_a_strided_split_with_too_many_runs_is_refused_at_once(platform: platforms.Platform) -> None:
    platform.manual_seed(SEED)
    before = platform.get_rng_state()
    placements = [_StridedShard(0, split_factor=2**40)]
    with pytest.raises(InvalidArgumentError, match="MAX_INDEX_RUNS"):
        portable.sharded_uniform(MeshInfo((2,), (0,)), placements, (2**41,))
    assert torch.equal(platform.get_rng_state(), before)


def test_an_offset_overflow_is_refused(platform: platforms.Platform) -> None:
    platform.set_seed_offset(1, 2**63 - 8)
    before = platform.get_rng_state()
    with pytest.raises(InvalidArgumentError, match="would pass 2\\*\\*63 - 1"):
        portable.uniform((16,))
    assert torch.equal(platform.get_rng_state(), before)


def _rank_shard(rank: int, world_size: int) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    platforms.current().manual_seed(SEED)  # torch.manual_seed misses a device registered later in the rank
    return portable.sharded_uniform(mesh, [Shard(1)], (3, 7)).flatten().tolist()


@pytest.mark.multiproc
def test_real_ranks_compute_their_shards_with_no_collective() -> None:
    shards = run_ranks(_rank_shard, 3)  # columns 3, 3, 1
    widths = [3, 3, 1]
    full = philox.uniform((3, 7), key=SEED, offset=0)
    got = torch.cat([torch.tensor(s).reshape(3, w) for s, w in zip(shards, widths)], dim=1)
    assert torch.equal(got, full)


_COMPILED_POSITION_DRAWS = """
import torch, torch._dynamo.exc
from hyperrng.portable import position

def step(x):
    return (
        x + position.uniform((8,)),
        position.bernoulli((5000,), 0.3),  # the compiled loop's size
        position.dropout(x, 0.5),
        position.normal((9,)),
    )

x = torch.ones(8)
torch.manual_seed(0)
eager = [step(x) for _ in range(3)]
torch.manual_seed(0)
compiled = torch.compile(step)
for call, want in enumerate(eager):
    assert all(torch.equal(a, b) for a, b in zip(compiled(x), want)), call
assert not torch.equal(eager[0][0], eager[1][0])  # each call draws at the generator's next position
torch._dynamo.reset()
try:
    torch.compile(step, fullgraph=True)(x)
except torch._dynamo.exc.Unsupported:  # Dynamo's refusal of a function it must not trace
    print("refused")
"""


def test_position_draws_inside_torch_compile_read_and_move_the_generator_as_eager_code_does() -> None:
    """Inside a compiled function (inductor, on the CPU) a draw at the generator's position runs as eager
    code behind a graph break, so successive calls draw the eager sequence (the position read and moved at
    run time, never baked into the graph); ``fullgraph=True`` refuses them. In a process of its own, as the
    explicit-key draws' test (inductor's CPU code on older torch flushes subnormals process-wide)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _COMPILED_POSITION_DRAWS], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.split() == ["refused"], run.stderr[-3000:]


_COMPILED_SHARDED_DRAWS = """
import torch, torch._dynamo.exc, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
import hyperrng.platforms as platforms
from hyperrng.portable import position
from hyperrng.sharding.tracker import MeshInfo

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))  # a real DeviceMesh, through Dynamo's own handling of meshes
second = MeshInfo((2,), (1,))  # the second of two ranks: a shard that is not the whole tensor

def step(x):
    return (
        x + position.sharded_uniform(mesh, [Shard(0)], (8,)),
        position.sharded_normal(mesh, [Replicate()], (3, 5)),
        position.sharded_bernoulli(mesh, [Shard(1)], (2, 5000), 0.3),  # the compiled loop's size
        position.sharded_dropout(x, 0.5, mesh, [Shard(0)], (8,)),
        position.sharded_uniform(second, [Shard(0)], (7, 2)),
        position.sharded_normal(second, [Shard(1)], (2, 6)),
        position.sharded_bernoulli(second, [Shard(0)], (5,), 0.7),
        position.sharded_dropout(x[:4], 0.25, second, [Shard(0)], (8,)),
    )

x = torch.ones(8)
p = platforms.current()
p.manual_seed(0)
eager = [step(x) for _ in range(2)]
end = p.get_seed_offset()
p.manual_seed(0)
compiled = torch.compile(step)
for call, want in enumerate(eager):
    assert all(torch.equal(a, b) for a, b in zip(compiled(x), want)), call
assert p.get_seed_offset() == end, (p.get_seed_offset(), end)
assert not any(torch.equal(eager[0][i], eager[1][i]) for i in (0, 1, 4, 5))  # each call draws at the next position
torch._dynamo.reset()
try:
    torch.compile(step, fullgraph=True)(x)
except torch._dynamo.exc.Unsupported:  # Dynamo's refusal of a function it must not trace
    print("refused")
dist.destroy_process_group()
"""


def test_sharded_position_draws_inside_torch_compile_read_and_move_the_generator_as_eager_code_does() -> None:
    """Each sharded draw at the generator's position, on a real one-rank ``DeviceMesh`` and as the second rank
    of two, called twice inside a compiled function (inductor, on the CPU), gives this rank's shard exactly as
    eager code does and leaves the generator at the eager position; ``fullgraph=True`` refuses them. In a
    process of its own, as the unsharded draws' test (inductor's CPU code on older torch flushes subnormals
    process-wide; a gloo world of one is process-wide too)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _COMPILED_SHARDED_DRAWS], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.split() == ["refused"], run.stderr[-3000:]
