"""The scenarios of the upstream projects' own RNG tests, run against hyperrng's drop-in API.

hyperrng claims to replace Megatron-core's tracker and to give PyTorch's DTensor random
ops what its ``OffsetBasedRNGTracker`` gives them. Each test below restates one test of
Megatron-LM's ``tests/unit_tests/tensor_parallel/test_random.py`` or PyTorch's
``test/distributed/tensor/test_random_ops.py`` (named in its docstring) in this project's
words, on the CPU, with every rank a real process over gloo. Where hyperrng deliberately
differs, the test pins the difference and says why.
"""

from __future__ import annotations

import warnings
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch

import hyperrng
from hyperrng.errors import ArgumentTypeError, InvalidArgumentError
from hyperrng.streams.tracker import CudaRNGStatesTracker, get_cuda_rng_tracker
from tests._dist import run_ranks
from tests._platforms import PLATFORMS, draw, fresh_tracker_on_cpu, use_each  # noqa: F401 (autouse fixture)

platform = use_each(PLATFORMS)

# -- Megatron-LM: tests/unit_tests/tensor_parallel/test_random.py ------------------------------


def test_a_tracker_resets_refuses_reused_names_and_seeds_and_stores_the_seeded_state() -> None:
    """Upstream ``test_cuda_rng_states_tracker``.

    One difference, on purpose: upstream stores any object given to ``set_states`` (its test
    passes an int); hyperrng refuses what is not a state, before anything changes.
    """
    tracker = CudaRNGStatesTracker()
    with pytest.raises(InvalidArgumentError, match="state tensor"):
        tracker.set_states({"state1": 1234})
    assert tracker.get_states() == {}, "a refused set_states must change nothing"
    tracker.add("state1", 7)
    tracker.reset()
    assert tracker.get_states() == {}

    tracker.add("state2", 1111)
    with pytest.raises(InvalidArgumentError, match="seed 1111"):
        tracker.add("state3", 1111)
    with pytest.raises(InvalidArgumentError, match="already exists"):
        tracker.add("state2", 111)
    assert list(tracker.get_states()) == ["state2"]

    tracker.fork("state2")  # made, never entered: changes nothing
    platform = platforms.current()
    platform.manual_seed(1111)
    # The platform's state, not torch.get_rng_state(): on the CPU it carries the (seed, offset)
    # position beside torch's 5056 bytes, so that a restore knows where it is.
    assert torch.equal(tracker.get_states()["state2"], platform.get_rng_state())


@pytest.mark.parametrize("graph_safe", [False, True], ids=["byte-states", "generator-states"])
def test_nested_forks_draw_what_separate_forks_draw(platform: platforms.Platform, graph_safe: bool) -> None:
    """Upstream ``test_double_fork_cuda_rng_states_tracker`` (both tracker kinds)."""
    if graph_safe and platform.device_type == "cpu":
        pytest.skip("torch's CPU generator has no graph-safe API; the simulated devices run this case")

    def session(nested: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, Any]]:
        tracker = CudaRNGStatesTracker(use_cudagraphable_rng=graph_safe)
        tracker.add("state1", 1234)
        tracker.add("state2", 5678)
        one: list[torch.Tensor] = []
        two: list[torch.Tensor] = []
        if nested:
            with tracker.fork("state1"):
                one.append(draw(platform, 10))
                with tracker.fork("state2"):
                    two.append(draw(platform, 10))
                    with tracker.fork("state1"):
                        one.append(draw(platform, 10))
                    two.append(draw(platform, 10))
                one.append(draw(platform, 10))
        else:
            with tracker.fork("state1"):
                one += [draw(platform, 10) for _ in range(3)]
            with tracker.fork("state2"):
                two += [draw(platform, 10) for _ in range(2)]
        states = tracker.get_states()
        if graph_safe:
            states = {k: v.get_state() for k, v in states.items()}
        return one, two, states

    nested = session(True)
    flat = session(False)
    for got, want in zip(nested[0] + nested[1], flat[0] + flat[1]):
        assert torch.equal(got, want)
    for name in ("state1", "state2"):
        assert torch.equal(nested[2][name], flat[2][name])


def test_the_megatron_constructor_takes_its_flags_and_refuses_the_inference_tracker() -> None:
    """Upstream constructs ``CudaRNGStatesTracker(use_cudagraphable_rng=...)`` and reads the flags back."""
    assert CudaRNGStatesTracker().use_cudagraphable_rng is False
    tracker = CudaRNGStatesTracker(use_cudagraphable_rng=True)
    assert tracker.use_cudagraphable_rng is True
    assert tracker.is_inference_rng_tracker is False
    with pytest.raises(InvalidArgumentError, match="inference tracker"):
        CudaRNGStatesTracker(is_inference_rng_tracker=True)
    with pytest.raises(ArgumentTypeError, match="use_cudagraphable_rng must be True or False"):
        CudaRNGStatesTracker(use_cudagraphable_rng="yes")  # type: ignore[arg-type]


def test_the_megatron_call_with_force_reset_creates_the_model_parallel_stream() -> None:
    """Upstream ``test_model_parallel_cuda_manual_seed``: one process, so every rank is 0."""
    seeds = hyperrng.model_parallel_cuda_manual_seed(0, force_reset_rng=True)
    states = get_cuda_rng_tracker().get_states()
    assert states["model-parallel-rng"] is not None
    # Megatron-core's formulas: data parallel = seed, model parallel = seed + 2718 + tp_rank.
    assert (seeds.data_parallel, seeds.model_parallel) == (0, 2718)


def test_recompute_returns_what_the_function_returns_and_the_gradients_of_a_plain_run() -> None:
    """Upstream ``test_checkpoint``, in hyperrng's signature: ``checkpoint(fn, *args)``.

    Megatron-core's ``checkpoint(fn, distribute_saved_activations, *args)`` takes a flag
    first; hyperrng has no activation distribution, so the migration drops that argument.
    """

    def forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    assert torch.equal(hyperrng.checkpoint(forward, torch.ones(16), torch.ones(16) * 2), torch.ones(16) * 3)
    x = torch.ones(4, 4, requires_grad=True)
    out = hyperrng.checkpoint(forward, x, torch.ones(4, 4) * 2)
    assert torch.equal(out, torch.ones(4, 4) * 3)
    out.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.ones(4, 4))


def test_recompute_replays_a_forked_dropout_mask_exactly() -> None:
    """Upstream ``test_checkpoint_recompute_preserves_context_parallel_rng_behavior``, one rank:
    dropout inside a fork gives the same output and gradient with and without recompute."""

    def dropout_forward(x: torch.Tensor) -> torch.Tensor:
        with get_cuda_rng_tracker().fork("model-parallel-rng"):
            return torch.nn.functional.dropout(x, p=0.5, training=True)

    plain_in = torch.full((8, 4), 4.0, requires_grad=True)
    ckpt_in = plain_in.detach().clone().requires_grad_(True)
    hyperrng.model_parallel_cuda_manual_seed(999, force_reset_rng=True)
    plain = dropout_forward(plain_in)
    hyperrng.model_parallel_cuda_manual_seed(999, force_reset_rng=True)
    ckpt = hyperrng.checkpoint(dropout_forward, ckpt_in)
    assert torch.equal(plain, ckpt)
    plain.sum().backward()
    ckpt.sum().backward()
    assert plain_in.grad is not None and ckpt_in.grad is not None
    assert torch.equal(plain_in.grad, ckpt_in.grad)


# -- PyTorch: test/distributed/tensor/test_random_ops.py, on a gloo CPU mesh of 4 ranks ----------

WORLD = 4


def _blocks(full: torch.Tensor, dim: int, parts: int) -> list[torch.Tensor]:
    return list(torch.chunk(full, parts, dim=dim))


def _dtensor_scenarios(rank: int, world_size: int) -> dict[str, Any]:
    """Each upstream scenario on this rank, with hyperrng's tracker routing DTensor's random ops."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from hyperrng.sharding.tracker import ShardedRNGTracker

    out: dict[str, Any] = {}
    tracker = ShardedRNGTracker()
    previous = tracker.install_dtensor()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mesh = init_device_mesh("cpu", (world_size,))
            tracker.manual_seed(1234)

            # test_init_ops: every init op gives each Shard(1) shard its own numbers.
            # log_normal_, exponential_ and geometric_ are in upstream's list too, but torch's
            # DTensor dispatcher (2.13) does not treat them as random ops: it hands them to no
            # tracker, so every shard draws the same numbers on any mesh whose generator is not
            # counter-based. They are left out here; the README lists them under limits.
            init_ops: list[tuple[str, Any, dict[str, Any]]] = [
                ("kaiming_uniform_", torch.nn.init.kaiming_uniform_, {"a": 0, "mode": "fan_in"}),
                ("normal_", torch.nn.init.normal_, {"mean": 1.5, "std": 0.8}),
                ("uniform_", torch.nn.init.uniform_, {"a": 0, "b": 1.2}),
            ]
            for dtype in (torch.float32, torch.float16):
                init_ops += [
                    (f"rand_like-{dtype}", torch.rand_like, {"dtype": dtype}),
                    (f"randn_like-{dtype}", torch.randn_like, {"dtype": dtype}),
                    (f"randint_like-{dtype}", torch.randint_like, {"low": 0, "high": 100, "dtype": dtype}),
                ]
            out["init"] = {}
            for name, op, kwargs in init_ops:
                d = distribute_tensor(torch.empty(8, 4 * world_size), mesh, [Shard(1)])
                d = op(d, **kwargs)
                full = d.full_tensor()
                mine = d.to_local()
                out["init"][name] = [
                    torch.equal(block, mine) for block in _blocks(full, 1, world_size)
                ]  # True only at this rank's own block

            # test_meta_tensor_init: a replicated tensor materialised from meta is equal everywhere.
            meta = distribute_tensor(torch.empty(64, 32, device="meta"), mesh, [Replicate()])
            real = torch.empty_like(meta, device="cpu")
            real.uniform_()
            out["replicated"] = real.to_local().flatten().tolist()

            # test_tp_model_meta_init: a column-parallel Linear built on meta, then reset, differs per shard.
            with torch.device("meta"):
                model = torch.nn.Linear(world_size, world_size, bias=False)
                parallelize_module(model, mesh, ColwiseParallel())
            model.to_empty(device="cpu")
            model.reset_parameters()
            out["tp_weight"] = model.weight.to_local().flatten().tolist()

            # test_deterministic_rand_1d: rand/randn sharded differ per rank; replicated agree.
            import torch.distributed.tensor as dt

            out["rand_1d"] = {}
            for fn in (dt.rand, dt.randn):
                sharded = fn((4, 4 * world_size), device_mesh=mesh, placements=[Shard(1)])
                tracker.manual_seed(0)
                replicated = fn((4, 4 * world_size), device_mesh=mesh, placements=[Replicate()])
                out["rand_1d"][fn.__name__] = (
                    sharded.to_local().flatten().tolist(),
                    replicated.to_local().flatten().tolist(),
                )

            # test_deterministic_uniform_2d: on a 2 x 2 mesh, for every placement, each rank's
            # shard is its own block of the full tensor, equal to its replicas' and no other.
            mesh2 = init_device_mesh("cpu", (2, 2))
            out["uniform_2d"] = []
            placements_list = [
                [Shard(0), Shard(1)],
                [Shard(1), Shard(0)],
                [Shard(0), Replicate()],
                [Replicate(), Shard(0)],
                [Shard(1), Replicate()],
                [Replicate(), Shard(1)],
                [Replicate(), Replicate()],
            ]
            for placements in placements_list:
                d = distribute_tensor(torch.empty(4, 4), mesh2, placements)
                d.uniform_(0, 1)
                out["uniform_2d"].append((str(placements), d.to_local().flatten().tolist()))

            # test_pipeline_parallel_manual_seed: each pipeline stage seeds its SPMD sub-mesh.
            world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "spmd"))
            pp_rank = world["pp"].get_local_rank()
            tracker.manual_seed(123 + pp_rank, world["spmd"])
            weight = dt.ones(4, 2, device_mesh=world["spmd"], placements=[Shard(0)])
            torch.nn.init.normal_(weight)
            out["pipeline"] = weight.to_local().flatten().tolist()
            out["position"] = list(platforms.current().get_seed_offset())
            dist.barrier()
    finally:
        tracker.uninstall_dtensor(previous)
    return out


@pytest.fixture(scope="module")
def dtensor_runs() -> list[dict[str, Any]]:
    with platforms.use(platforms.CPUPlatform()):  # upstream's scenarios on CPU meshes: the ranks' platform too
        return run_ranks(_dtensor_scenarios, WORLD)


@pytest.mark.multiproc
def test_every_init_op_gives_each_shard_its_own_numbers(dtensor_runs: list[dict[str, Any]]) -> None:
    """Upstream ``test_init_ops``: the shard a rank holds is its block of the full tensor, and no other."""
    for rank, run in enumerate(dtensor_runs):
        for name, matches in run["init"].items():
            assert matches == [i == rank for i in range(WORLD)], f"{name} on rank {rank}"


@pytest.mark.multiproc
def test_a_replicated_tensor_materialised_from_meta_is_equal_on_every_rank(
    dtensor_runs: list[dict[str, Any]],
) -> None:
    """Upstream ``test_meta_tensor_init`` (the distribute region enabled)."""
    assert all(run["replicated"] == dtensor_runs[0]["replicated"] for run in dtensor_runs)


@pytest.mark.multiproc
def test_a_column_parallel_linear_initialised_after_meta_differs_on_every_rank(
    dtensor_runs: list[dict[str, Any]],
) -> None:
    """Upstream ``test_tp_model_meta_init``."""
    weights = [tuple(run["tp_weight"]) for run in dtensor_runs]
    assert len(set(weights)) == WORLD


@pytest.mark.multiproc
def test_sharded_rand_differs_per_rank_and_replicated_rand_agrees(dtensor_runs: list[dict[str, Any]]) -> None:
    """Upstream ``test_deterministic_rand_1d`` (rand and randn)."""
    for fn in ("rand", "randn"):
        sharded = [tuple(run["rand_1d"][fn][0]) for run in dtensor_runs]
        replicated = [tuple(run["rand_1d"][fn][1]) for run in dtensor_runs]
        assert len(set(sharded)) == WORLD, fn
        assert len(set(replicated)) == 1, fn


# Which ranks hold the same block on a 2 x 2 mesh (rank = 2 * i + j), per placement above:
# upstream's shard_index_list.
_SHARD_INDEX = [
    [0, 1, 2, 3],
    [0, 2, 1, 3],
    [0, 0, 1, 1],
    [0, 1, 0, 1],
    [0, 0, 1, 1],
    [0, 1, 0, 1],
    [0, 0, 0, 0],
]


@pytest.mark.multiproc
def test_on_a_2d_mesh_replicas_draw_equal_blocks_and_shards_distinct_ones(
    dtensor_runs: list[dict[str, Any]],
) -> None:
    """Upstream ``test_deterministic_uniform_2d``: the shard index of every placement."""
    for k, index in enumerate(_SHARD_INDEX):
        label = dtensor_runs[0]["uniform_2d"][k][0]
        values = [tuple(run["uniform_2d"][k][1]) for run in dtensor_runs]
        for a in range(WORLD):
            for b in range(WORLD):
                same = values[a] == values[b]
                assert same == (index[a] == index[b]), f"{label}: ranks {a} and {b}"


@pytest.mark.multiproc
def test_pipeline_stages_seeded_apart_initialise_every_rank_differently(
    dtensor_runs: list[dict[str, Any]],
) -> None:
    """Upstream ``test_pipeline_parallel_manual_seed``: seed 123 + stage on each SPMD sub-mesh."""
    weights = [tuple(run["pipeline"]) for run in dtensor_runs]
    assert len(set(weights)) == WORLD
    # The stages were seeded apart, so the two ranks of a stage agree on their position and
    # the stages do not.
    positions = [tuple(run["position"]) for run in dtensor_runs]
    assert positions[0] == positions[1] and positions[2] == positions[3]
    assert positions[0] != positions[2]
