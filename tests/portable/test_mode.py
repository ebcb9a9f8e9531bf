"""Portable mode: torch's own random ops draw Philox from the generator's position, on every device."""

from __future__ import annotations

import itertools
import math
import os
import random
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch
import torch.nn.functional as F
from hyperrng.platforms.validate import MAX_OFFSET
from torch.distributed.tensor import Partial, Replicate, Shard

from hyperrng import philox
from hyperrng._guard import exclusive as _exclusive
from hyperrng.errors import (
    ArgumentTypeError,
    HyperRNGError,
    InvalidArgumentError,
    InvalidOperationError,
    UnsupportedPortableOpError,
)
from hyperrng.portable import _ops
from hyperrng.portable import position as portable
from hyperrng.portable.mode import (
    PORTABLE_OPS,
    is_portable_random_enabled,
    mode_applied,
    portable_random,
    registered,
    set_portable_random,
    thread_mode,
    unsupported_ops,
)
from hyperrng.portable.position import load_portable_state_dict, portable_state_dict
from hyperrng.sharding.tracker import MeshInfo, ShardedRNGTracker
from hyperrng.streams.tracker import RNGStatesTracker

pytestmark = pytest.mark.needs_portable_mode

try:
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # older torch
    _StridedShard = None

SEED = 4321


@pytest.fixture(autouse=True)
def cpu_platform() -> Iterator[platforms.Platform]:
    with platforms.use(platforms.CPUPlatform()) as p:
        yield p
    assert not is_portable_random_enabled(), "a test left portable mode on"


@pytest.fixture
def sim() -> Iterator[platforms.Platform]:
    with platforms.use(platforms.SimulatedPlatform()) as p:
        p.device(0)  # registers the device type
        yield p


def _position() -> tuple[int, int]:
    return platforms.current().get_seed_offset()


# -- what each op draws --------------------------------------------------------------------------
# (name, op on a device, what philox gives at (key, offset) for it, elements it draws)
OPS: list[tuple[str, Callable[[str], torch.Tensor], Callable[[int, int], torch.Tensor], int]] = [
    ("rand", lambda d: torch.rand(3, 5, device=d), lambda k, o: philox.uniform((3, 5), k, o), 15),
    ("rand_like", lambda d: torch.rand_like(torch.ones(7, device=d)), lambda k, o: philox.uniform(7, k, o), 7),
    ("randn", lambda d: torch.randn(6, device=d), lambda k, o: philox.normal(6, k, o), 6),
    ("randn_like", lambda d: torch.randn_like(torch.ones(2, 3, device=d)), lambda k, o: philox.normal((2, 3), k, o), 6),
    (
        "randint",
        lambda d: torch.randint(-3, 9, (11,), device=d),
        lambda k, o: philox.random_bits(11, k, o) % 12 - 3,
        11,
    ),
    (
        "uniform_",
        lambda d: torch.empty(9, dtype=torch.float64, device=d).uniform_(-2.0, 3.0),
        lambda k, o: philox.uniform(9, k, o, torch.float64, -2.0, 3.0),
        9,
    ),
    (
        "normal_",
        lambda d: torch.empty(4, 2, device=d).normal_(1.5, 0.25),
        lambda k, o: philox.normal((4, 2), k, o, mean=1.5, std=0.25),
        8,
    ),
    (
        "bernoulli_ with a float p",
        lambda d: torch.empty(10, device=d).bernoulli_(0.3),
        lambda k, o: philox.bernoulli(10, 0.3, k, o).float(),
        10,
    ),
    (
        "bernoulli_ with tensor p",
        lambda d: torch.empty(2, 5, device=d).bernoulli_(torch.linspace(0, 1, 5, device=d)),
        lambda k, o: (philox.random_bits((2, 5), k, o) < torch.round(torch.linspace(0, 1, 5).double() * 2**32)).float(),
        10,
    ),
    (
        "bernoulli",
        lambda d: torch.bernoulli(torch.full((6,), 0.5, device=d)),
        lambda k, o: philox.bernoulli(6, 0.5, k, o).float(),
        6,
    ),
    (
        "F.dropout",
        lambda d: F.dropout(torch.full((13,), 2.0, device=d), 0.4),
        lambda k, o: philox.bernoulli(13, 0.6, k, o).float().div_(0.6) * 2.0,
        13,
    ),
    (
        "native_dropout",
        lambda d: torch.ops.aten.native_dropout(torch.full((5,), 2.0, device=d), 0.25, True)[0],
        lambda k, o: philox.bernoulli(5, 0.75, k, o).float().div_(0.75) * 2.0,
        5,
    ),
]
OP_IDS = [name for name, *_ in OPS]


@pytest.mark.parametrize(("name", "op", "expected", "numel"), OPS, ids=OP_IDS)
def test_with_a_seed_each_op_draws_philox_from_seed_0_and_advances_by_its_rounded_count(
    name: str, op: Callable[[str], torch.Tensor], expected: Callable[[int, int], torch.Tensor], numel: int
) -> None:
    with portable_random(SEED):
        first = op("cpu")
        assert _position() == (SEED, -(-numel // 4) * 4)
        second = op("cpu")
    assert torch.equal(first, expected(SEED, 0))
    assert torch.equal(second, expected(SEED, -(-numel // 4) * 4))


@pytest.mark.parametrize(("name", "op", "expected", "numel"), OPS, ids=OP_IDS)
def test_torch_ops_on_the_simulated_device_give_the_cpu_bits(
    sim: platforms.Platform,
    name: str,
    op: Callable[[str], torch.Tensor],
    expected: Callable[[int, int], torch.Tensor],
    numel: int,
) -> None:
    with portable_random(SEED):
        on_device = op("sim:0")
        assert sim.get_seed_offset(0) == (SEED, -(-numel // 4) * 4)
    assert on_device.device.type == "sim"
    assert torch.equal(on_device.cpu(), expected(SEED, 0))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor (tells -0.0 from 0.0 and NaNs apart), on the CPU."""
    return t.detach().cpu().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.75, 1.0])
def test_every_portable_dropout_gives_the_same_mask_values_and_next_position(
    sim: platforms.Platform, p: float, dtype: torch.dtype
) -> None:
    """F.dropout in portable mode (the CPU's bernoulli_ decomposition, the device's fused
    native_dropout), hyperrng.philox.dropout and hyperrng.portable.position.dropout: one convention."""
    signs = 1.0 - 2.0 * (torch.arange(7 * 13) % 2)  # negative values too: dropped, they give -0.0
    x = (torch.linspace(0.25, 3.0, 7 * 13) * signs).to(dtype).reshape(7, 13)
    x[0, :3] = torch.tensor([math.inf, -math.inf, math.nan], dtype=dtype)  # dropped: NaN, as torch's dropout
    drawn: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, device, dropout in (
        ("F.dropout on the CPU", "cpu", lambda t: F.dropout(t, p)),
        ("F.dropout on the device", "sim:0", lambda t: F.dropout(t, p)),
        ("portable.dropout", "cpu", lambda t: portable.dropout(t, p)),
    ):
        with portable_random(SEED):
            values = dropout(x.to(device))
            following = torch.rand(5, device=device)  # the next draw starts where the dropout left off
        drawn[name] = values.cpu(), following.cpu()
    expected = philox.dropout(x, p, SEED, 0)
    drew = 0.0 < p < 1.0  # p = 0 and p = 1 draw nothing: the position stays
    expected_next = philox.uniform(5, SEED, 92 if drew else 0)  # 91 elements, rounded up to whole blocks
    for name, (values, following) in drawn.items():
        assert torch.equal(_bits(values), _bits(expected)), name
        assert torch.equal(following, expected_next), name
    if drew:
        keep = philox.bernoulli((7, 13), 1.0 - p, SEED, 0)  # kept where the word is below round((1 - p) * 2**32)
        words = philox.random_bits((7, 13), SEED, 0)
        assert torch.equal(keep, words < round((1.0 - p) * 2**32))
        assert torch.equal(expected[1:] != 0, keep[1:])


INIT_FUNCTIONS: list[tuple[str, Callable[[torch.Tensor], Any]]] = [
    ("uniform_", torch.nn.init.uniform_),
    ("normal_", torch.nn.init.normal_),
    ("trunc_normal_", torch.nn.init.trunc_normal_),
    ("kaiming_uniform_", torch.nn.init.kaiming_uniform_),
    ("kaiming_normal_", torch.nn.init.kaiming_normal_),
    ("xavier_uniform_", torch.nn.init.xavier_uniform_),
    ("xavier_normal_", torch.nn.init.xavier_normal_),
]


@pytest.mark.parametrize(("name", "init"), INIT_FUNCTIONS, ids=[n for n, _ in INIT_FUNCTIONS])
def test_nn_init_is_portable_on_the_cpu_and_the_simulated_device(
    sim: platforms.Platform, name: str, init: Callable[[torch.Tensor], Any]
) -> None:
    results = []
    for device in ("cpu", "sim:0", "cpu"):
        with portable_random(SEED):
            weight = torch.empty(6, 4, device=device)
            init(weight)
        results.append(weight.cpu())
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    with portable_random(SEED + 1):
        other = init(torch.empty(6, 4))
    assert not torch.equal(results[0], other)


def test_dropout_passes_gradients_through_the_kept_elements_on_both_devices(sim: platforms.Platform) -> None:
    grads = []
    for device in ("cpu", "sim:0"):
        x = torch.full((32,), 3.0, device=device, requires_grad=True)
        with portable_random(SEED):
            y = F.dropout(x, 0.5)
        y.sum().backward()
        assert x.grad is not None
        kept = philox.bernoulli(32, 0.5, SEED, 0)
        assert torch.equal(x.grad.cpu(), kept.float() * 2.0)
        grads.append(x.grad.cpu())
    assert torch.equal(grads[0], grads[1])


# -- positions -----------------------------------------------------------------------------------
def test_without_a_seed_it_continues_from_the_device_generator_and_writes_the_advance_back() -> None:
    p = platforms.current()
    p.set_seed_offset(77, 40)
    with portable_random():
        a = torch.rand(10)
    assert torch.equal(a, philox.uniform(10, 77, 40))
    assert _position() == (77, 52)
    with portable_random():
        b = torch.rand(3)
    assert torch.equal(b, philox.uniform(3, 77, 52))


def test_with_a_seed_the_generator_gets_its_state_back_on_exit() -> None:
    p = platforms.current()
    p.set_seed_offset(5, 8)
    before = p.get_rng_state()
    with portable_random(SEED):
        torch.rand(100)
    assert torch.equal(p.get_rng_state(), before)


def test_a_tracker_stream_is_the_position_inside_its_fork_and_keeps_the_advance() -> None:
    p = platforms.current()
    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 99)
    p.set_seed_offset(5, 0)
    with portable_random():
        with tracker.fork("model-parallel-rng"):
            a = torch.rand(6)
        outside = torch.rand(2)
        with tracker.fork("model-parallel-rng"):
            b = torch.rand(6)
    assert torch.equal(a, philox.uniform(6, 99, 0))
    assert torch.equal(b, philox.uniform(6, 99, 8)), "the stream kept its advance between forks"
    assert torch.equal(outside, philox.uniform(2, 5, 0)), "the default generator was not touched by the forks"
    assert _position() == (5, 4)


def test_a_cpu_generator_of_its_own_draws_torchs_numbers_from_it_and_moves_no_position() -> None:
    """generator= a CPU torch.Generator of the caller's: torch's kernel draws from it (host numbers from that
    generator alone, the same on every machine), for portable ops and for ops without a portable kernel."""
    gen, twin = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    probs = torch.tensor([0.1, 0.2, 0.7])

    def draws(g: torch.Generator) -> list[torch.Tensor]:
        return [torch.rand(5, generator=g), torch.randperm(6, generator=g), torch.multinomial(probs, 2, generator=g)]

    with portable_random(SEED):
        got = draws(gen)
        assert _position() == (SEED, 0)
    want = draws(twin)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(gen.get_state(), twin.get_state())


@pytest.mark.parametrize("flavour", ["hyperrng", "context_fn", "non-reentrant", "reentrant"])
def test_a_cpu_generator_of_its_own_inside_an_activation_checkpoint_is_refused(flavour: str) -> None:
    """No checkpoint puts a caller's generator back before its recompute, which would draw its next
    numbers: the gradients silently differed under every flavour."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    import hyperrng

    gen = torch.Generator().manual_seed(3)
    gen_state = gen.get_state()
    x = torch.ones(4, requires_grad=True)

    def noisy(t: torch.Tensor) -> torch.Tensor:
        return t * torch.rand(4, generator=gen)

    run = {
        "hyperrng": lambda: hyperrng.checkpoint(noisy, x),
        "context_fn": lambda: torch_checkpoint(noisy, x, use_reentrant=False, context_fn=hyperrng.checkpoint_context),
        "non-reentrant": lambda: torch_checkpoint(noisy, x, use_reentrant=False),
        "reentrant": lambda: torch_checkpoint(noisy, x, use_reentrant=True),
    }[flavour]
    with portable_random(SEED):
        with pytest.raises(UnsupportedPortableOpError, match="inside an activation checkpoint"):
            run()
        assert _position() == (SEED, 0)
    assert torch.equal(gen.get_state(), gen_state)


def test_torchs_default_cpu_generator_named_is_where_the_cpu_platform_keeps_positions() -> None:
    """Named as generator=, torch's default generator draws portably, as without it; a copy of it with the
    same state is a generator of its own (the check that tells them apart puts both states back)."""
    with portable_random(SEED):
        named = torch.rand(5, generator=torch.default_generator)
        assert _position() == (SEED, 8)
        copy = torch.Generator()
        copy.set_state(torch.default_generator.get_state())
        default_state, copy_state = torch.default_generator.get_state(), copy.get_state()
        from_copy = torch.rand(3, generator=copy)
        assert _position() == (SEED, 8) and torch.equal(torch.default_generator.get_state(), default_state)
    assert torch.equal(named, philox.uniform(5, SEED, 0))
    twin = torch.Generator()
    twin.set_state(copy_state)
    assert torch.equal(from_copy, torch.rand(3, generator=twin))


def test_contexts_nest_and_reenter_and_the_outermost_exit_gives_torch_its_numbers_back() -> None:
    mode = portable_random(SEED)
    with mode:
        with portable_random(7):
            inner = torch.rand(4)
        with mode:
            again = torch.rand(4)
        after_inner = torch.rand(4)
        assert is_portable_random_enabled()
    assert not is_portable_random_enabled()
    assert torch.equal(inner, philox.uniform(4, 7, 0))
    assert torch.equal(again, philox.uniform(4, SEED, 0))
    assert torch.equal(after_inner, philox.uniform(4, SEED, 0)), "the inner seeded context restored the state"
    torch.manual_seed(3)
    native = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(torch.rand(4), native)
    assert not torch.equal(native, philox.uniform(4, 3, 0))


def test_the_switch_turns_the_mode_on_for_the_process_until_turned_off() -> None:
    set_portable_random(True, seed=SEED)
    try:
        assert is_portable_random_enabled()
        a = torch.rand(5)
        with portable_random():
            b = torch.rand(3)
        assert is_portable_random_enabled(), "a context exit does not end the switch"
        set_portable_random(True)  # again: no effect on the position
        c = torch.rand(2)
    finally:
        set_portable_random(False)
    assert not is_portable_random_enabled()
    assert torch.equal(a, philox.uniform(5, SEED, 0))
    assert torch.equal(b, philox.uniform(3, SEED, 8))
    assert torch.equal(c, philox.uniform(2, SEED, 12))


def test_entering_changes_no_backend_kernel_and_random_ops_get_kernels_on_the_portable_key() -> None:
    ops = ["aten::add.Tensor", "aten::mm", "aten::uniform_", "aten::bernoulli_.float", "aten::native_dropout"]
    before = [repr(torch.library.get_kernel(op, "CPU")) for op in ops]
    with portable_random(SEED):
        inside = [repr(torch.library.get_kernel(op, "CPU")) for op in ops]
        table = torch._C._dispatch_dump_table("aten::uniform_")
    assert inside == before, "the backends' kernels are torch's own, inside the mode and out"
    assert "portable/_ops.py" in next(line for line in table.splitlines() if line.startswith(_ops.KEY_NAME))
    assert "uniform_" in registered() and "native_dropout" in registered()


def test_outside_the_mode_a_random_op_never_reaches_python_once_the_kernels_are_registered() -> None:
    with portable_random(SEED):
        pass  # registered for good
    library_code = tuple(os.path.dirname(module.__file__) for module in (philox, _ops))  # philox/, portable/
    seen: list[str] = []

    def watch(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(library_code):
            seen.append(frame.f_code.co_name)

    x = torch.ones(16)
    sys.setprofile(watch)
    try:
        torch.rand(8)
        F.dropout(x, 0.5)
        x.bernoulli_(0.5)
        torch.randint(0, 5, (3,))
    finally:
        sys.setprofile(None)
    assert seen == []


def test_meta_and_fake_tensors_inside_the_mode_propagate_shapes_and_move_no_position() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with portable_random(SEED):
        with torch.device("meta"):  # a model built on the meta device, as FSDP users do
            layer = torch.nn.Linear(8, 4)
            h = F.dropout(layer(torch.empty(2, 8)), 0.5) + torch.ones(2, 4)
        assert h.shape == (2, 4) and h.device.type == "meta"
        with FakeTensorMode():
            fake = torch.empty(3, 5).uniform_() * 2 + torch.rand(3, 5)
        assert fake.shape == (3, 5)
        assert _position() == (SEED, 0)
        assert torch.equal(torch.rand(4), philox.uniform(4, SEED, 0))


def test_a_dispatch_mode_of_the_user_inside_the_mode_sees_portable_draws() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    with portable_random(SEED), FlopCounterMode(display=False):
        x = torch.rand(6)
        y = F.dropout(torch.ones(2, 3), 0.5)
    assert torch.equal(x, philox.uniform(6, SEED, 0))
    assert torch.equal(y, philox.dropout(torch.ones(2, 3), 0.5, SEED, 8))


def test_an_autograd_thread_that_inherits_the_key_without_an_entry_runs_torchs_own_kernels() -> None:
    """Autograd hands the thread's included keys to the threads that run backward; such a thread has no
    entry of its own, so its random ops are torch's (a recompute there applies the mode explicitly)."""
    results: list[tuple[bool, bool]] = []

    def worker() -> None:
        _ops.switch(True)  # as the autograd engine's thread-local state would make it
        try:
            torch.manual_seed(3)
            results.append((_ops.is_switched_on(), is_portable_random_enabled()))
            native = torch.rand(4, generator=torch.Generator().manual_seed(3))
            results.append((torch.equal(torch.rand(4), native), True))
        finally:
            _ops.switch(False)

    with portable_random(SEED):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    assert results == [(True, False), (True, True)]


def test_compiled_draws_equal_eager_draws() -> None:
    with portable_random(SEED, compiled=True):
        compiled = torch.rand(4096)
        mask = F.dropout(torch.ones(1024), 0.5)
    with portable_random(SEED):
        eager = torch.rand(4096)
        eager_mask = F.dropout(torch.ones(1024), 0.5)
    assert torch.equal(compiled, eager)
    assert torch.equal(mask, eager_mask)


# -- sharded regions -----------------------------------------------------------------------------
SHARDINGS: list[tuple[tuple[int, ...], list[Any], tuple[int, ...]]] = [
    ((4,), [Shard(0)], (10, 6)),  # uneven
    ((2, 2), [Shard(0), Replicate()], (8, 6)),
    ((2, 3), [Shard(1), Shard(0)], (7, 5)),
    ((2, 2), [Shard(0), Shard(0)], (9, 3)),  # one dim sharded twice
]
if _StridedShard is not None:
    SHARDINGS.append(((2, 2), [_StridedShard(0, split_factor=2), Shard(0)], (8, 2)))


@pytest.mark.parametrize(("mesh_shape", "placements", "shape"), SHARDINGS)
def test_in_a_sharded_region_each_shard_is_its_block_of_the_unsharded_tensor(
    mesh_shape: tuple[int, ...], placements: list[Any], shape: tuple[int, ...]
) -> None:
    tracker = ShardedRNGTracker()
    full = philox.uniform(shape, SEED, 0)
    expected_end = None
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        mesh = MeshInfo(mesh_shape, coord)
        slices = portable.shard_slices(mesh, placements, shape)
        index = [list(itertools.chain(*(range(s.start, s.stop) for s in sl))) for sl in slices]
        local = torch.empty([len(i) for i in index])
        with portable_random(SEED):
            with tracker.distribute_region(mesh, placements, shape):
                local.uniform_()
            end = _position()
        grid = torch.meshgrid(*[torch.tensor(i, dtype=torch.long) for i in index], indexing="ij")
        assert torch.equal(local, full[grid]), f"rank at {coord}"
        assert expected_end in (None, end), "every rank leaves at the same position"
        expected_end = end
    assert expected_end == (SEED, -(-full.numel() // 4) * 4), "ranks move by the global count"


def test_a_partial_placement_or_a_foreign_shape_in_a_region_is_refused() -> None:
    tracker = ShardedRNGTracker()
    mesh = MeshInfo((2,), (0,))
    with portable_random(SEED):
        with (
            pytest.raises(InvalidArgumentError, match="partial tensor"),
            tracker.distribute_region(mesh, [Partial()], (4,)),
        ):
            torch.empty(4).uniform_()
        assert _position() == (SEED, 0)
        with pytest.raises(InvalidArgumentError, match=r"shape \(3,\).*shard has shape \(2,\)"):
            with tracker.distribute_region(mesh, [Shard(0)], (4,)):
                torch.empty(3).uniform_()
        assert _position() == (SEED, 0)


@pytest.mark.parametrize(
    ("op", "error"),
    [
        (lambda: torch.zeros(2, dtype=torch.int32).uniform_(), ArgumentTypeError),
        (lambda: torch.zeros(2, dtype=torch.int64).normal_(), ArgumentTypeError),
        (lambda: torch.empty(2).exponential_(), UnsupportedPortableOpError),
        (lambda: torch.empty(2).random_(0, 2**40), InvalidArgumentError),  # float32 holds integers to 2**24
        (lambda: torch.empty(2, dtype=torch.int64).random_(0, 2**40), UnsupportedPortableOpError),
    ],
)
def test_an_op_refused_inside_a_region_leaves_every_rank_where_it_was(op: Callable[[], object], error: type) -> None:
    tracker = ShardedRNGTracker()
    with portable_random(SEED):
        with pytest.raises(error), tracker.distribute_region(MeshInfo((2,), (1,)), [Shard(0)], (4,)):
            op()
        assert _position() == (SEED, 0)
    # Not only the position: the state, with the draws torch's own ops made from it (on the CPU,
    # putting the generator back at its position would reseed it and lose them).
    p = platforms.current()
    torch.rand(3)
    before = p.get_rng_state()
    g = torch.Generator().manual_seed(5)
    torch.rand(3, generator=g)
    before_g = g.get_state()
    for generator in (None, g):
        with portable_random(), pytest.raises(error):
            with tracker.distribute_region(MeshInfo((2,), (1,)), [Shard(0)], (4,), generator):
                op()
    with pytest.raises(error), tracker.distribute_region(MeshInfo((2,), (1,)), [Shard(0)], (4,)):
        with portable_random():  # entered inside the region
            op()
    assert torch.equal(p.get_rng_state(), before), "a refused op changed the generator"
    assert torch.equal(g.get_state(), before_g), "a refused op changed the generator of the region"
    # The same region entered again, outside the mode, does what a new one does from where the generator is now.
    region = tracker.distribute_region(MeshInfo((2,), (1,)), [Shard(0)], (4,))
    with portable_random(), pytest.raises(error), region:
        op()
    torch.rand(3)
    now = p.get_rng_state()
    with region:
        torch.rand(2)
    again = p.get_rng_state()
    p.set_rng_state(now)
    with tracker.distribute_region(MeshInfo((2,), (1,)), [Shard(0)], (4,)):
        torch.rand(2)
    assert torch.equal(p.get_rng_state(), again), "the region entered again kept its first entry's state"
    # torch's own draws after a refusal in the region end the cancel: they are not drawn again after it.
    with tracker.distribute_region(MeshInfo((2,), (1,)), [Shard(0)], (4,)):
        with portable_random(), pytest.raises(error):
            op()
        inside = torch.rand(2)
    with tracker.distribute_region(MeshInfo((2,), (1,)), [Shard(0)], (4,)):
        assert not torch.equal(torch.rand(2), inside), "numbers drawn after a refusal came out again"


# -- bad input: typed errors, nothing changed ----------------------------------------------------
@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: portable_random("1"), ArgumentTypeError, "seed must be an int"),
        (lambda: portable_random(1.0), ArgumentTypeError, "seed must be an int"),
        (lambda: portable_random(-1), InvalidArgumentError, "seed"),
        (lambda: portable_random(2**64), InvalidArgumentError, "seed"),
        (lambda: portable_random(1, compiled=1), ArgumentTypeError, "compiled must be a bool"),
        (lambda: set_portable_random(1), ArgumentTypeError, "enabled must be a bool"),
        (lambda: set_portable_random(False, seed=3), InvalidArgumentError, "pass it with enabled=True"),
        (lambda: set_portable_random(True, seed=2**64), InvalidArgumentError, "seed"),
    ],
)
def test_bad_arguments_of_the_mode_raise_typed_errors_and_change_nothing(
    call: Callable[[], Any], error: type[Exception], message: str
) -> None:
    before = _position()
    with pytest.raises(error, match=message):
        call()
    assert not is_portable_random_enabled()
    assert _position() == before


BAD_OPS: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    ("randperm too long", lambda: torch.randperm(300, dtype=torch.uint8), InvalidArgumentError, "does not fit"),
    ("multinomial", lambda: torch.multinomial(torch.ones(4), 2), UnsupportedPortableOpError, "multinomial"),
    ("exponential_", lambda: torch.empty(3).exponential_(), UnsupportedPortableOpError, "exponential_"),
    ("poisson", lambda: torch.poisson(torch.ones(3)), UnsupportedPortableOpError, "poisson"),
    ("normal(tensor)", lambda: torch.normal(torch.zeros(3), 1.0), UnsupportedPortableOpError, "normal.Tensor_float"),
    ("rrelu training", lambda: F.rrelu(torch.ones(3), training=True), UnsupportedPortableOpError, "rrelu"),
    (
        "random_ range over 2**62",
        lambda: torch.empty(3, dtype=torch.int64).random_(-(2**62), 2**62 - 5),
        InvalidArgumentError,
        "up to 2\\*\\*62 values",
    ),
    ("random_ complex", lambda: torch.empty(3, dtype=torch.complex64).random_(), ArgumentTypeError, "real numbers"),
    (  # a wide range on bool: torch.iinfo's TypeError came out as it was
        "random_ bool 2**40",
        lambda: torch.zeros(3, dtype=torch.bool).random_(0, 2**40),
        InvalidArgumentError,
        "does not fit torch.bool",
    ),
    ("int uniform_", lambda: torch.empty(3, dtype=torch.int32).uniform_(), ArgumentTypeError, "int32"),
    ("uniform_ low > high", lambda: torch.empty(3).uniform_(2.0, 1.0), InvalidArgumentError, "low must be <= high"),
    ("normal_ std < 0", lambda: torch.empty(3).normal_(0.0, -1.0), InvalidArgumentError, "std must be >= 0"),
    ("uniform_ nan", lambda: torch.empty(3).uniform_(math.nan, 1.0), InvalidArgumentError, "low must be finite"),
    ("uniform_ inf", lambda: torch.empty(3).uniform_(0.0, math.inf), InvalidArgumentError, "high must be finite"),
    ("normal_ nan", lambda: torch.empty(3).normal_(math.nan), InvalidArgumentError, "mean must be finite"),
    ("normal_ inf", lambda: torch.empty(3).normal_(0.0, math.inf), InvalidArgumentError, "std must be finite"),
    ("bernoulli_ p > 1", lambda: torch.empty(3).bernoulli_(1.5), InvalidArgumentError, "probability"),
    (
        "bernoulli_ tensor p",
        lambda: torch.empty(3).bernoulli_(torch.tensor([0.1, float("nan"), 0.2])),
        InvalidArgumentError,
        r"\[0, 1\]",
    ),
    (
        "bernoulli_ int p",
        lambda: torch.empty(3).bernoulli_(torch.ones(3, dtype=torch.int64)),
        ArgumentTypeError,
        "floating-point probabilities",
    ),
    ("bernoulli_ shape", lambda: torch.empty(3).bernoulli_(torch.ones(4) / 2), InvalidArgumentError, "broadcast"),
    ("randint range", lambda: torch.randint(-(2**62), 2**62 + 1, (3,)), InvalidArgumentError, "up to 2\\*\\*62"),
    ("randint dtype", lambda: torch.randint(0, 300, (3,), dtype=torch.uint8), InvalidArgumentError, "fit"),
    ("dropout p", lambda: torch.ops.aten.native_dropout(torch.ones(3), 1.5, True), InvalidArgumentError, "p must"),
]


@pytest.mark.parametrize(("name", "call", "error", "message"), BAD_OPS, ids=[b[0] for b in BAD_OPS])
def test_bad_ops_in_the_mode_raise_typed_errors_and_leave_the_position(
    name: str, call: Callable[[], Any], error: type[Exception], message: str
) -> None:
    platforms.current().set_seed_offset(8, 16)
    with portable_random():
        with pytest.raises(error, match=message):
            call()
        assert _position() == (8, 16)


def test_a_draw_that_would_pass_the_offset_range_is_refused_before_it_moves() -> None:
    platforms.current().set_seed_offset(8, MAX_OFFSET - 3 - (MAX_OFFSET - 3) % 4)
    before = _position()
    with portable_random(), pytest.raises(InvalidArgumentError, match="past 2\\*\\*63 - 1"):
        torch.rand(16)
    assert _position() == before


_STREAM = "model-parallel-rng"
_ENTRY = re.escape(f"stream '{_STREAM}' (state['streams']['{_STREAM}'])")
_POSITION = re.escape("the generator position (state['position'])")
_FIX = re.escape("portable_state_dict() never saves such a value: load the dict it returned unchanged")
BAD_ENTRIES: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]], type[Exception], str]] = [
    (
        "stream offset < 0",
        lambda s: {**s, "streams": {_STREAM: [1, -4]}},
        InvalidArgumentError,
        _ENTRY + r": offset must be in \[0, 2\*\*63 - 1\], got -4\. " + _FIX,
    ),
    (
        "stream offset > max",
        lambda s: {**s, "streams": {_STREAM: [1, MAX_OFFSET + 1]}},
        InvalidArgumentError,
        _ENTRY + ": offset must be in .*" + _FIX,
    ),
    (
        "stream offset misaligned",
        lambda s: {**s, "streams": {_STREAM: [1, 6]}},
        InvalidArgumentError,
        _ENTRY + ": offset must be a multiple of 4.*" + _FIX,
    ),
    (
        "stream seed < 0",
        lambda s: {**s, "streams": {_STREAM: [-1, 0]}},
        InvalidArgumentError,
        _ENTRY + ": seed must be",
    ),
    ("stream seed float", lambda s: {**s, "streams": {_STREAM: [1.0, 0]}}, ArgumentTypeError, _ENTRY + ": seed must"),
    ("stream offset bool", lambda s: {**s, "streams": {_STREAM: [1, True]}}, ArgumentTypeError, _ENTRY + ": offset"),
    (
        "stream not a pair",
        lambda s: {**s, "streams": {_STREAM: [1]}},
        ArgumentTypeError,
        _ENTRY + r": .*\[seed, offset\]",
    ),
    (
        "position offset < 0",
        lambda s: {**s, "position": [1, -4]},
        InvalidArgumentError,
        _POSITION + ": offset must be in",
    ),
    (
        "position seed >= 2**64",
        lambda s: {**s, "position": [2**64, 0]},
        InvalidArgumentError,
        _POSITION + ": seed must",
    ),
    ("position not a pair", lambda s: {**s, "position": None}, ArgumentTypeError, _POSITION + r": .*\[seed, offset\]"),
]


@pytest.mark.parametrize(("name", "change", "error", "message"), BAD_ENTRIES, ids=[b[0] for b in BAD_ENTRIES])
def test_a_bad_entry_of_a_portable_state_is_named_and_nothing_changes(
    name: str, change: Callable[[dict[str, Any]], dict[str, Any]], error: type[Exception], message: str
) -> None:
    tracker = RNGStatesTracker()
    tracker.add(_STREAM, 31)
    good = portable_state_dict(tracker)
    platforms.current().set_seed_offset(11, 40)
    before, streams = _position(), tracker.get_states()
    with pytest.raises(error, match=message) as info:
        load_portable_state_dict(change(good), tracker)
    assert isinstance(info.value, HyperRNGError) and isinstance(info.value, (ValueError, TypeError))
    assert "\n" not in str(info.value)
    assert _position() == before
    assert tracker.get_states().keys() == streams.keys()
    assert all(torch.equal(streams[k], v) for k, v in tracker.get_states().items())


def test_ops_random_only_for_some_arguments_run_torchs_kernel_when_deterministic() -> None:
    q = torch.randn(1, 2, 4, 8)
    expected = F.scaled_dot_product_attention(q, q, q)
    leaky = F.rrelu(torch.tensor([-1.0, 2.0]), training=False)
    with portable_random(SEED):
        assert torch.equal(F.scaled_dot_product_attention(q, q, q), expected)
        assert torch.equal(F.rrelu(torch.tensor([-1.0, 2.0]), training=False), leaky)
        assert _position() == (SEED, 0)


def test_the_refused_ops_are_listed_and_the_portable_ones_are_not() -> None:
    refused = unsupported_ops()
    assert {"multinomial", "exponential_", "poisson"} <= set(refused)
    assert not {"random_", "randperm.generator_out"} & set(refused)
    assert not set(refused) & set(PORTABLE_OPS)


def test_in_a_fresh_process_every_tagged_random_op_is_refused_not_only_those_looked_up_before() -> None:
    # The ops were once found by dir(torch.ops.aten), which lists only the ops a process has looked up:
    # in a fresh process binomial and _sample_dirichlet (and _standard_gamma before torch 2.10) drew
    # from torch's generator inside the mode.
    import subprocess

    code = (
        "import torch\n"
        "from hyperrng.errors import UnsupportedPortableOpError\n"
        "from hyperrng.portable.mode import portable_random, unsupported_ops\n"
        "calls = {'binomial': lambda: torch.binomial(torch.full((4,), 9.0), torch.full((4,), 0.5)),\n"
        "         '_sample_dirichlet': lambda: torch._sample_dirichlet(torch.ones(4)),\n"
        "         '_standard_gamma': lambda: torch._standard_gamma(torch.ones(4))}\n"
        "assert set(calls) <= set(unsupported_ops()), unsupported_ops()\n"
        "for name, call in calls.items():\n"
        "    try:\n"
        "        with portable_random(5):\n"
        "            call()\n"
        "    except UnsupportedPortableOpError as exc:\n"
        "        assert name in str(exc), exc\n"
        "    else:\n"
        "        raise AssertionError(f'{name} drew in portable mode')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("compiled", [False, True])
def test_philox_writes_into_a_given_tensor_the_values_it_would_return(compiled: bool) -> None:
    for dtype in (torch.float32, torch.float16):
        out = torch.empty(3, 50, dtype=dtype)
        assert philox.uniform((3, 50), SEED, 6, dtype, out=out, compiled=compiled) is out
        assert torch.equal(out, philox.uniform((3, 50), SEED, 6, dtype))
    bits = torch.empty(9, dtype=torch.int64)
    assert torch.equal(philox.random_bits(9, SEED, out=bits, compiled=compiled), philox.random_bits(9, SEED))


def test_philox_writes_into_a_strided_tensor_the_values_it_would_return() -> None:
    wide = torch.zeros(6, 20)
    out = wide[:, 3:13].t()  # (10, 6), neither contiguous nor a view of one run
    assert philox.uniform((10, 6), SEED, 5, out=out) is out
    assert torch.equal(out, philox.uniform((10, 6), SEED, 5))
    assert torch.equal(wide[:, :3], torch.zeros(6, 3)) and torch.equal(wide[:, 13:], torch.zeros(6, 7))
    shard = torch.empty(4, 9, dtype=torch.int64)[:, ::2]  # a shard's rows, strided
    assert torch.equal(
        philox.random_bits((9, 10), SEED, 3, shard=[slice(2, 6), slice(1, 6)], out=shard),
        philox.random_bits((9, 10), SEED, 3)[2:6, 1:6],
    )


@pytest.mark.parametrize(
    ("out", "error", "message"),
    [
        ([0.0] * 4, ArgumentTypeError, "out must be a torch.Tensor"),
        (torch.empty(4, dtype=torch.float64), ArgumentTypeError, "out has dtype torch.float64"),
        (torch.empty(5), InvalidArgumentError, "shape"),
        (torch.empty(1).expand(4), InvalidArgumentError, "overlapping"),
    ],
)
def test_a_tensor_that_cannot_hold_the_result_is_refused_untouched(
    out: Any, error: type[Exception], message: str
) -> None:
    before = out.clone() if isinstance(out, torch.Tensor) else None
    with pytest.raises(error, match=message):
        philox.uniform(4, SEED, out=out)
    if before is not None:
        assert torch.equal(out, before) or torch.isnan(before).any()


def test_an_out_whose_rows_overlap_is_refused_and_one_whose_strides_interleave_is_filled() -> None:
    """Not only an expanded tensor: rows two elements apart of four overlap (the draw would keep the last
    write of each shared element, silently other numbers); rows 3 apart with elements 2 apart do not."""
    base = torch.zeros(10)
    with pytest.raises(InvalidArgumentError, match="overlapping"):
        philox.uniform((4, 4), SEED, out=base.as_strided((4, 4), (2, 1)))
    assert torch.equal(base, torch.zeros(10))
    interleaved = base.as_strided((2, 3), (3, 2))
    assert torch.equal(philox.uniform((2, 3), SEED, out=interleaved), philox.uniform((2, 3), SEED))
    # A view without elements holds no two (an expanded one, or one whose empty dim comes last, listed none)
    for empty in (torch.empty(0, 1).expand(0, 3), torch.empty(0).as_strided((10**4, 10**4, 0), (1, 2, 1))):
        assert philox.uniform(tuple(empty.shape), SEED, out=empty) is empty
    # An expanded view of 2**34 elements is refused without listing its offsets (128 GB of them)
    with pytest.raises(InvalidArgumentError, match="overlapping"):
        philox.uniform((2**17, 2**17), SEED, out=torch.empty(1, 1).expand(2**17, 2**17))


@pytest.mark.slow
@pytest.mark.parametrize("fallback_random", [False, True])
def test_compiled_code_draws_portably_whatever_inductors_fallback_random(fallback_random: bool) -> None:
    import torch._dynamo
    import torch._inductor.config as inductor

    with inductor.patch(fallback_random=fallback_random):  # inductor's own patch restores the option
        torch._dynamo.reset()
        draw = torch.compile(lambda: torch.rand(8) + 0)
        with portable_random(SEED):
            assert torch.equal(draw(), philox.uniform((8,), key=SEED, offset=0))
            assert torch.equal(draw(), philox.uniform((8,), key=SEED, offset=8))


# -- threads, Ctrl-C, refusals on entry ----------------------------------------------------------
@pytest.mark.parametrize("others_share_the_default_generator", [True, False], ids=["issue-scenario", "own-generators"])
def test_other_threads_draw_torchs_own_numbers_while_one_thread_loops_in_portable_mode(
    others_share_the_default_generator: bool,
) -> None:
    """One thread enters and leaves portable_random in a loop while two others draw.

    The other threads' draws from their own generators are exactly torch's; their draws
    from the shared default generator (F.dropout, torch.rand without generator=) are
    torch's kernels' values. Such draws move the generator the portable thread positions
    (the thread policy does not intercept plain draws), so that thread's numbers are
    checked exactly when the others draw from their own generators only.
    """
    rounds, problems, portable_draws = 150, [], []
    done = threading.Event()

    def portable_thread() -> None:
        try:
            for _ in range(rounds):
                with portable_random(3):
                    portable_draws.append(torch.rand(8))
        except BaseException as exc:  # reported below: the thread must not die silently
            problems.append(f"portable thread: {exc!r}")
        finally:
            done.set()

    def other_thread(seed: int) -> None:
        own, reference = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        ones = torch.ones(64)
        try:
            for _ in range(2000):
                got = [
                    torch.rand(64, generator=own),
                    torch.empty(64).bernoulli_(0.5, generator=own),
                    torch.empty(64).normal_(generator=own),
                ]
                want = [
                    torch.rand(64, generator=reference),
                    torch.empty(64).bernoulli_(0.5, generator=reference),
                    torch.empty(64).normal_(generator=reference),
                ]
                if not all(torch.equal(g, w) for g, w in zip(got, want)):
                    problems.append(f"thread {seed}: other numbers than its own generator's")
                if others_share_the_default_generator:
                    uniform, dropped = torch.rand(64), F.dropout(ones, 0.5)
                    if not bool(((uniform >= 0) & (uniform < 1)).all()):
                        problems.append(f"thread {seed}: torch.rand gave values outside [0, 1)")
                    if not bool(((dropped == 0) | (dropped == 2)).all()):
                        problems.append(f"thread {seed}: dropout gave {dropped.unique().tolist()}")
                if done.is_set():
                    break
        except BaseException as exc:
            problems.append(f"thread {seed}: {exc!r}")

    threads = [threading.Thread(target=portable_thread)] + [
        threading.Thread(target=other_thread, args=(s,)) for s in (11, 12)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert problems == []
    assert len(portable_draws) == rounds
    if not others_share_the_default_generator:
        assert all(torch.equal(d, philox.uniform(8, 3, 0)) for d in portable_draws)


def test_a_second_thread_entering_portable_mode_is_refused_and_changes_nothing() -> None:
    entered, leave = threading.Event(), threading.Event()

    def holder() -> None:
        with portable_random(SEED):
            entered.set()
            leave.wait()

    t = threading.Thread(target=holder)
    t.start()
    entered.wait()
    try:
        before = platforms.current().get_rng_state()
        for enter in (lambda: portable_random(7).__enter__(), lambda: set_portable_random(True, seed=7)):
            with pytest.raises(InvalidOperationError, match="portable_random|set_portable_random"):
                enter()
            assert not is_portable_random_enabled()
        assert torch.equal(platforms.current().get_rng_state(), before), "the holder's position is untouched"
    finally:
        leave.set()
        t.join()
    with portable_random(7):  # free again once the holder left
        assert torch.equal(torch.rand(2), philox.uniform(2, 7, 0))


def test_the_switch_holds_the_generator_until_it_is_turned_off_on_its_thread() -> None:
    set_portable_random(True, seed=SEED)
    refused: list[BaseException] = []
    try:
        t = threading.Thread(target=lambda: _capture(refused, lambda: portable_random().__enter__()))
        t.start()
        t.join()
        assert len(refused) == 1 and isinstance(refused[0], InvalidOperationError)
        set_portable_random(False)
        assert _exclusive.holder("cpu", 0) is None
    finally:
        set_portable_random(False)


def _capture(into: list[BaseException], call: Callable[[], Any]) -> None:
    try:
        call()
    except BaseException as exc:
        into.append(exc)


def test_the_mode_applied_on_another_thread_draws_as_the_thread_that_took_it() -> None:
    """What a recompute on autograd's device thread needs: the forward thread's flag, re-applied."""
    with portable_random(SEED):
        mode = thread_mode()
        drawn: list[torch.Tensor] = []

        def worker() -> None:
            own = torch.Generator().manual_seed(1)
            drawn.append(torch.rand(4, generator=own))  # the flag is per thread: torch's own kernel here
            with mode_applied(mode):
                drawn.append(torch.rand(4))
            drawn.append(torch.rand(4, generator=own))

        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert _position() == (SEED, 4), "the applied mode drew from the device generator's position"
    assert torch.equal(drawn[1], philox.uniform(4, SEED, 0))
    assert torch.equal(torch.cat([drawn[0], drawn[2]]), torch.rand(8, generator=torch.Generator().manual_seed(1)))
    assert thread_mode() is None and not is_portable_random_enabled()


def test_an_interrupt_while_the_mode_is_applied_leaves_dtensor_routed_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A recompute re-entering the mode counts a DTensor user before it records its entry: an interrupt in
    between left DTensor's random ops routed through hyperrng until the thread ended."""
    from torch.distributed.tensor import _random

    from hyperrng.portable import mode as mode_module

    before = _random._rng_tracker

    def interrupted(entry: object, outermost: bool = False) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(mode_module, "push", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with mode_applied(False):
            pass
    assert _random._rng_tracker is before, "DTensor's tracker is back"
    assert not mode_module._DTENSOR.users and thread_mode() is None


def test_an_interrupt_as_an_entry_turns_the_key_on_leaves_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first entry turned the thread's dispatch key on, then recorded itself: an interrupt in between left
    the key on with no entry, so every later random op on the thread reached portable mode's kernels."""
    real = _ops.switch

    def interrupted_after(on: bool) -> None:
        real(on)
        if on:
            raise KeyboardInterrupt

    monkeypatch.setattr(_ops, "switch", interrupted_after)
    with pytest.raises(KeyboardInterrupt):
        with mode_applied(False):
            pass
    assert not _ops.is_switched_on() and not _ops.THREAD.entries


def test_entering_puts_hyperrngs_dtensor_tracker_in_place_and_the_last_exit_puts_back_what_was_there() -> None:
    from torch.distributed.tensor import _random

    sentinel = object()
    previous, _random._rng_tracker = _random._rng_tracker, sentinel
    try:
        with portable_random(SEED):
            installed = _random._rng_tracker
            assert type(installed).__name__ == "HyperRNGDTensorTracker"
            with portable_random():
                assert _random._rng_tracker is installed
            assert _random._rng_tracker is installed
        assert _random._rng_tracker is sentinel
    finally:
        _random._rng_tracker = previous


def test_a_thread_that_ended_inside_the_mode_does_not_keep_the_dtensor_tracker_installed() -> None:
    from torch.distributed.tensor import _random

    sentinel = object()
    previous, _random._rng_tracker = _random._rng_tracker, sentinel
    try:
        # A thread enters and ends without exiting (an exception that skipped __exit__, an
        # abandoned generator): its hold counts as released, and so must its routing.
        t = threading.Thread(target=lambda: portable_random(SEED).__enter__())
        t.start()
        t.join()
        assert type(_random._rng_tracker).__name__ == "HyperRNGDTensorTracker"
        with portable_random(SEED):
            assert type(_random._rng_tracker).__name__ == "HyperRNGDTensorTracker"
        assert _random._rng_tracker is sentinel, "the last live user's exit put back what was there"
    finally:
        _random._rng_tracker = previous


def test_a_torch_without_the_thread_local_key_is_refused_on_entry_naming_the_version_and_nothing_changes() -> None:
    """In a fresh process (the check is made until the kernels are registered, once per process)."""
    import subprocess

    code = (
        "import torch, hyperrng\n"
        "from hyperrng.errors import UnsupportedPortableOpError\n"
        "from hyperrng._guard import exclusive as _exclusive\n"
        "del torch.library.Library.fallback\n"
        "before = hyperrng.current_platform().get_seed_offset()\n"
        "entries = (lambda: hyperrng.portable_random(5).__enter__(), lambda: hyperrng.set_portable_random(True, 5))\n"
        "for enter in entries:\n"
        "    try:\n"
        "        enter()\n"
        "    except UnsupportedPortableOpError as error:\n"
        "        assert 'needs torch >= 2.9' in str(error) and '\\n' not in str(error), error\n"
        "    else:\n"
        "        raise AssertionError('entered')\n"
        "    assert not hyperrng.is_portable_random_enabled() and _exclusive.holder('cpu', 0) is None\n"
        "assert hyperrng.current_platform().get_seed_offset() == before\n"
        "print('refused')\n"
    )
    env = {**os.environ, "HYPERRNG_PLATFORM": "cpu"}  # the simulated device registers with Library.fallback too
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "refused", run.stderr


# Ctrl-C: a real SIGINT raised at a chosen line of entering or leaving. The trace function counts the
# lines hyperrng and torch run (not this file's, not the body's) and raises SIGINT at one of them;
# Python runs the handler at its next check for signals, as for a real Ctrl-C.
class _CtrlCAt:
    def __init__(self, line: int | None) -> None:
        self.countdown = line
        self.lines = 0
        self.paused = False
        self.drawn: tuple[int, int] | None = None  # the position after the body's draw, once it ran

    def trace(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and not self.paused and frame.f_code.co_filename != __file__:
            self.lines += 1
            if self.countdown is not None:
                self.countdown -= 1
                if self.countdown == 0:
                    signal.raise_signal(signal.SIGINT)
        return self.trace

    def __enter__(self) -> _CtrlCAt:
        sys.settrace(self.trace)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)


def _trial(kind: str, seed: int | None, ctrl_c: _CtrlCAt) -> None:
    """Enter, draw 4 numbers (never interrupted: the body is not counted), leave."""
    if kind == "switch":
        set_portable_random(True, seed=seed)
        ctrl_c.paused = True
        torch.rand(4)
        ctrl_c.drawn = _position()
        ctrl_c.paused = False
        set_portable_random(False)
        return
    with portable_random(seed):
        ctrl_c.paused = True
        torch.rand(4)
        ctrl_c.drawn = _position()
        ctrl_c.paused = False


def test_ctrl_c_at_any_line_of_entering_or_leaving_finds_the_mode_and_generator_before_or_after() -> None:
    from torch.distributed.tensor import _random

    p = platforms.current()
    kinds = [(kind, seed) for kind in ("context", "switch") for seed in (None, SEED)]
    lines = {}
    for kind, seed in kinds:  # how many lines entering and leaving run, to aim within them
        p.set_seed_offset(5, 8)
        with portable_random():  # entering within an entry: the handler is in place already
            pass
        with _CtrlCAt(None) as counted:
            _trial(kind, seed, counted)
        lines[kind, seed] = counted.lines
    rng = random.Random(20240611)
    outcomes = {"before": 0, "after": 0}
    for _ in range(300):
        kind, seed = rng.choice(kinds)
        at = rng.randint(1, lines[kind, seed])
        p.set_seed_offset(5, 8)
        before, dtensor_tracker = p.get_rng_state(), _random._rng_tracker
        try:
            with _CtrlCAt(at) as ctrl_c:
                _trial(kind, seed, ctrl_c)
        except KeyboardInterrupt:
            pass
        else:  # the lines run vary a little from run to run: this one ended before line ``at``
            assert ctrl_c.countdown, f"the interrupt at line {at} of {kind} (seed {seed}) was not raised"
            continue
        where = f"{kind}, seed {seed}, line {at}"
        assert not is_portable_random_enabled(), f"the thread is out of the mode ({where})"
        assert _exclusive.holder("cpu", 0) is None, f"the generator is not held ({where})"
        assert _random._rng_tracker is dtensor_tracker, f"DTensor's tracker is back ({where})"
        if ctrl_c.drawn is None:  # interrupted while entering: as before
            assert torch.equal(p.get_rng_state(), before), f"an interrupted entry moved the generator ({where})"
            outcomes["before"] += 1
        else:  # interrupted while leaving: as after
            if kind == "context" and seed is not None:
                assert torch.equal(p.get_rng_state(), before), f"the seeded exit did not restore ({where})"
            else:
                assert _position() == ctrl_c.drawn, f"the exit lost the draw's advance ({where})"
            outcomes["after"] += 1
        set_portable_random(True)
        set_portable_random(False)
        assert not is_portable_random_enabled(), "set_portable_random(False) turns it off"
    assert min(outcomes.values()) > 50, outcomes


# -- outside the mode: torch's own kernels, through the saved originals ---------------------------
def _rrelu_args() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.linspace(-2.0, 2.0, 6), torch.empty(6)


ORIGINALS: dict[str, Callable[[], Any]] = {
    # every op portable mode overrides on the CPU, called as outside the mode (drawing from the default generator)
    "_scaled_dot_product_flash_attention_for_cpu": lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *[torch.linspace(-1, 1, 64).reshape(1, 2, 4, 8)] * 3, 0.0
    ),
    "_standard_gamma": lambda: torch._standard_gamma(torch.ones(6)),
    "bernoulli.out": lambda: torch.bernoulli(torch.full((6,), 0.5), out=torch.empty(6)),
    "bernoulli_.Tensor": lambda: torch.empty(6).bernoulli_(torch.full((6,), 0.3)),
    "bernoulli_.float": lambda: torch.empty(6).bernoulli_(0.3),
    "cauchy_": lambda: torch.empty(6).cauchy_(),
    "exponential_": lambda: torch.empty(6).exponential_(),
    "geometric_": lambda: torch.empty(6).geometric_(0.3),
    "log_normal_": lambda: torch.empty(6).log_normal_(),
    "multinomial": lambda: torch.multinomial(torch.ones(6), 3),
    "multinomial.out": lambda: torch.multinomial(torch.ones(6), 3, out=torch.empty(3, dtype=torch.int64)),
    "native_dropout": lambda: torch.ops.aten.native_dropout(torch.ones(8), 0.5, True),
    "normal.Tensor_Tensor": lambda: torch.normal(torch.zeros(6), torch.ones(6)),
    "normal.Tensor_Tensor_out": lambda: torch.normal(torch.zeros(6), torch.ones(6), out=torch.empty(6)),
    "normal.Tensor_float": lambda: torch.normal(torch.zeros(6), 1.0),
    "normal.Tensor_float_out": lambda: torch.normal(torch.zeros(6), 1.0, out=torch.empty(6)),
    "normal.float_Tensor": lambda: torch.normal(0.0, torch.ones(6)),
    "normal.float_Tensor_out": lambda: torch.normal(0.0, torch.ones(6), out=torch.empty(6)),
    "normal_": lambda: torch.empty(6).normal_(),
    "poisson": lambda: torch.poisson(torch.ones(6)),
    "random_": lambda: torch.empty(6, dtype=torch.int64).random_(),
    "random_.from": lambda: torch.empty(6).random_(0, 10),
    "random_.to": lambda: torch.empty(6).random_(10),
    "randperm.generator_out": lambda: torch.randperm(8),
    "rrelu_with_noise": lambda: torch.ops.aten.rrelu_with_noise(*_rrelu_args(), 0.1, 0.3, True),
    "rrelu_with_noise.out": lambda: torch.ops.aten.rrelu_with_noise.out(
        *_rrelu_args(), 0.1, 0.3, True, out=torch.empty(6)
    ),
    "rrelu_with_noise_": lambda: torch.ops.aten.rrelu_with_noise_(*_rrelu_args(), 0.1, 0.3, True),
    "uniform_": lambda: torch.empty(6).uniform_(),
}
SIM_ORIGINALS = ("uniform_", "normal_", "bernoulli_.float", "random_.from", "native_dropout", "exponential_")


def _originals_outputs(device: str, labels: Sequence[str]) -> dict[str, list[list[Any]]]:
    out = {}
    for label in labels:
        torch.manual_seed(7)
        if device != "cpu":
            with torch.device(device):
                result = ORIGINALS[label]()
        else:
            result = ORIGINALS[label]()
        tensors = result if isinstance(result, tuple) else (result,)
        out[label] = [t.cpu().tolist() for t in tensors if isinstance(t, torch.Tensor)]
    return out


def _originals_report() -> dict[str, Any]:
    """In a fresh process: every overridden op's values outside the mode, before and after registration, on
    the CPU and, where this torch can host it, the simulated device."""
    from hyperrng.platforms import _features

    from hyperrng.portable.mode import registered

    chosen: list[platforms.Platform] = [platforms.CPUPlatform()]
    devices = {"cpu": list(ORIGINALS)}
    if _features.feature("sim").available:
        sim = platforms.SimulatedPlatform()
        sim.device(0)
        chosen.append(sim)
        devices["sim"] = list(SIM_ORIGINALS)
    before = {device: _originals_outputs(device, labels) for device, labels in devices.items()}
    for platform in chosen:
        with platforms.use(platform), portable_random():
            pass
    after = {device: _originals_outputs(device, labels) for device, labels in devices.items()}
    return {"registered": registered(), "before": before, "after": after}


@pytest.mark.slow
def test_outside_the_mode_every_random_op_gives_torchs_numbers_once_the_kernels_are_registered() -> None:
    import json
    import subprocess

    code = "import json, tests.portable.test_mode as t; print(json.dumps(t._originals_report()))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    report = json.loads(run.stdout.splitlines()[-1])
    assert set(report["registered"]) >= set(ORIGINALS) | set(SIM_ORIGINALS), "a sample call per kernel"
    assert "cpu" in report["before"] and report["before"].keys() == report["after"].keys()
    for device in report["before"]:  # the simulated device too, where this torch hosts it
        for label, values in report["before"][device].items():
            assert report["after"][device][label] == values, f"{label} on {device} drew other numbers once registered"


@pytest.mark.needs_sim  # the subprocess selects the simulated device
def test_a_device_that_registers_its_backend_on_first_use_enters_portable_mode_in_a_fresh_process() -> None:
    import subprocess

    code = (
        "import torch, hyperrng.platforms as p; from hyperrng import philox; "
        "from hyperrng.portable.mode import portable_random\n"
        "with p.use(p.SimulatedPlatform()), portable_random(5):\n"
        "    x = torch.rand(6, device='sim:0')\n"
        "assert torch.equal(x.cpu(), philox.uniform(6, 5, 0)), x"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shuffling_dataloader_draws_its_seed_portably_and_its_order_from_that_seed(workers: int) -> None:
    """Its sampler seeds a CPU generator of its own with a portable random_() and draws the order from it:
    the same order in every run with the same seed, a new one each epoch (it was refused)."""
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2, shuffle=True, num_workers=workers)

    def epochs() -> list[list[int]]:
        with portable_random(SEED):
            return [torch.cat([batch[0] for batch in loader]).tolist() for _ in range(2)]

    first, second = epochs(), epochs()
    assert first == second and first[0] != first[1]
    with portable_random(SEED):  # the iterator draws its workers' base seed, then the sampler its own
        seeds = [int(torch.empty((), dtype=torch.int64).random_().item()) for _ in range(2)]
    assert first[0] == torch.randperm(8, generator=torch.Generator().manual_seed(seeds[1])).tolist()


class _Noisy(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(2)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_without_shuffling_draws_its_seed_portably_and_repeats_per_run(workers: int) -> None:
    """It drew its base seed with random_() over the whole int64 range, which the mode refused (and torch
    then printed an AttributeError of its half-made iterator)."""
    from torch.utils.data import DataLoader

    def run() -> torch.Tensor:
        with portable_random(SEED):
            return torch.cat(list(DataLoader(_Noisy(), batch_size=2, num_workers=workers)))

    first, second = run(), run()
    assert torch.equal(first, second)
    assert len({tuple(row.tolist()) for row in first}) == 8, "every sample draws its own numbers"


_WIDE = {  # (draw, low, high)
    "random_() int64": (lambda: torch.empty(6, dtype=torch.int64).random_(), 0, 2**63),
    "random_() float64": (lambda: torch.empty(6, dtype=torch.float64).random_(), 0, 2**53 + 1),
    "randint 2**40": (lambda: torch.randint(-5, 2**40 - 5, (6,)), -5, 2**40 - 5),
    "random_ 3 * 2**40": (lambda: torch.empty(6, dtype=torch.int64).random_(7, 7 + 3 * 2**40), 7, 7 + 3 * 2**40),
}


@pytest.mark.parametrize("case", list(_WIDE))
def test_ranges_over_2_to_the_32_take_two_words_per_element(case: str) -> None:
    """Element i is low + (words 2i | (words 2i+1 & 0x7FFFFFFF) << 32) mod span (or its bits, for 2**k values)."""
    draw, low, high = _WIDE[case]
    with portable_random(SEED):
        got = draw()
        assert _position() == (SEED, 12), "two words per element"
    words = [int(w) for w in philox.random_bits(12, SEED, 0)]
    values = [words[2 * i] | (words[2 * i + 1] & 0x7FFFFFFF) << 32 for i in range(6)]
    span = high - low
    expected = [low + (v & (span - 1) if span & (span - 1) == 0 else v % span) for v in values]
    assert [int(x) for x in got.tolist()] == expected


def test_randperm_is_the_order_that_sorts_wide_values_and_fits_its_dtype() -> None:
    with portable_random(SEED):
        got = torch.randperm(10)
        small = torch.randperm(10, dtype=torch.int16)
        assert _position() == (SEED, 40)
    words = [int(w) for w in philox.random_bits(20, SEED, 0)]
    values = [words[2 * i] | (words[2 * i + 1] & 0x7FFFFFFF) << 32 for i in range(10)]
    assert got.tolist() == sorted(range(10), key=lambda i: values[i])
    assert sorted(small.tolist()) == list(range(10)) and small.dtype == torch.int16
    with portable_random(SEED):
        assert torch.equal(torch.randperm(10), got)
        assert torch.randperm(0).numel() == 0


@pytest.mark.needs_sim
def test_a_platform_that_overrides_current_device_has_its_own_device_drawn_from() -> None:
    """A plug-in's ``current_device()`` (a method the platform table lets it override) decides which device's
    generator a portable draw reads and moves, as it decides for seeding, forks and checkpoints."""

    class Pinned(platforms.CUDAPlatform):
        def current_device(self) -> int:  # a plug-in that maps this process to device 1
            return 1

    module = platforms.SimulatedDeviceModule(device_type="cuda")
    pinned = Pinned(module=module)
    with platforms.use(pinned), portable_random(7):
        drawn = torch.rand(4)
        assert pinned.get_seed_offset() == (7, 4)
        assert module.default_generators[1].get_offset() == 4 and module.default_generators[0].get_offset() == 0
        assert not pinned.is_capturing(1)
    with platforms.use(platforms.CPUPlatform()), portable_random(7):
        assert torch.equal(drawn, torch.rand(4))
