"""``from hyperrng import megatron as tensor_parallel``: Megatron-core's ``tensor_parallel.random`` names."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import hyperrng.platforms as platforms
import pytest
import torch
import torch.nn.functional as F

import hyperrng
from hyperrng import megatron as tensor_parallel
from hyperrng.errors import ArgumentTypeError, InvalidArgumentError
from hyperrng.streams.tracker import RNGStatesTracker, get_rng_tracker, set_rng_tracker


@pytest.fixture(autouse=True)
def fresh_process_tracker() -> Iterator[None]:
    with platforms.use(platforms.CPUPlatform()):
        previous = set_rng_tracker(RNGStatesTracker())
        try:
            yield
        finally:
            set_rng_tracker(previous)


# Megatron-core's signatures (megatron/core/tensor_parallel/random.py): parameter names in order.
SIGNATURES = {
    "get_cuda_rng_tracker": ["use_te_rng_tracker", "inference_rng_tracker", "use_cudagraphable_rng"],
    "initialize_rng_tracker": ["use_te_rng_tracker", "inference_rng_tracker", "use_cudagraphable_rng", "force_reset"],
    "get_expert_parallel_rng_tracker_name": [],
    "get_data_parallel_rng_tracker_name": [],
    "checkpoint": ["function", "distribute_saved_activations", "args"],
}


@pytest.mark.parametrize("name", SIGNATURES)
def test_every_name_has_megatron_cores_signature(name: str) -> None:
    assert list(inspect.signature(getattr(tensor_parallel, name)).parameters) == SIGNATURES[name]


def _block(x: torch.Tensor) -> torch.Tensor:
    """A Megatron-style layer: dropout on TP-sharded activations in the model-parallel stream, then an
    expert's dropout in the expert stream."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    with tracker.fork():
        x = F.dropout(x, 0.5)
    with tracker.fork(tensor_parallel.get_expert_parallel_rng_tracker_name()):
        return F.dropout(x * 3, 0.25)


def _train(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tensor_parallel.model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0)
    x = x.clone().requires_grad_()
    out = tensor_parallel.checkpoint(_block, False, x)
    out.sum().backward()
    return out.detach(), x.grad  # type: ignore[return-value]


def test_a_megatron_style_block_runs_unchanged_and_recomputes_its_own_numbers() -> None:
    x = torch.ones(64)
    out, grad = _train(x)
    assert torch.equal(grad != 0, out != 0), "the recompute drew the forward's masks"
    assert torch.equal(_train(x)[0], out), "reseeding reproduces the run"
    names = set(get_rng_tracker().get_states())
    assert names == {"model-parallel-rng", "expert-parallel-rng", tensor_parallel.get_data_parallel_rng_tracker_name()}


def test_initialize_keeps_a_seeded_tracker_and_force_reset_replaces_it() -> None:
    tensor_parallel.model_parallel_cuda_manual_seed(1, tp_rank=0, ep_rank=0, etp_rank=0)
    seeded = get_rng_tracker()
    tensor_parallel.initialize_rng_tracker()
    assert get_rng_tracker() is seeded
    tensor_parallel.initialize_rng_tracker(force_reset=True)
    assert get_rng_tracker() is not seeded and not get_rng_tracker().is_initialized()


@pytest.mark.parametrize(
    ("call", "error", "fragment"),
    [
        (lambda: tensor_parallel.get_cuda_rng_tracker(use_te_rng_tracker=True), InvalidArgumentError, "drop the flag"),
        (lambda: tensor_parallel.initialize_rng_tracker(inference_rng_tracker=True), InvalidArgumentError, "drop"),
        (lambda: tensor_parallel.initialize_rng_tracker(force_reset=1), ArgumentTypeError, "force_reset must be"),
        (lambda: tensor_parallel.checkpoint(_block, True, torch.ones(2)), InvalidArgumentError, "Pass False"),
        (lambda: tensor_parallel.checkpoint(_block, torch.ones(2)), ArgumentTypeError, "takes a bool second"),
        (lambda: tensor_parallel.CheckpointWithoutOutput(), InvalidArgumentError, "hyperrng.megatron.checkpoint"),
        (lambda: hyperrng.checkpoint(_block, False, torch.ones(2)), ArgumentTypeError, "hyperrng.megatron.checkpoint"),
    ],
    ids=["te-tracker", "inference-tracker", "flag-not-bool", "distribute", "no-flag", "without-output", "top-level"],
)
def test_what_has_no_counterpart_is_refused_naming_what_to_use_and_changes_nothing(
    call: object, error: type[Exception], fragment: str
) -> None:
    tracker = get_rng_tracker()
    before = torch.get_rng_state()
    with pytest.raises(error, match=fragment):
        call()  # type: ignore[operator]
    assert get_rng_tracker() is tracker and torch.equal(torch.get_rng_state(), before)


class _MegatronStyleCheckpoint(torch.autograd.Function):
    """The recompute Megatron-core's own ``CheckpointFunction`` does, written against the drop-in: the
    forward snapshots torch's generator and the tracker's streams, the backward puts them back around
    the rerun and restores what it found after."""

    @staticmethod
    def forward(ctx, run, x):  # type: ignore[no-untyped-def, override]
        ctx.run = run
        ctx.cpu, ctx.streams = torch.get_rng_state(), tensor_parallel.get_cuda_rng_tracker().get_states()
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        (x,) = ctx.saved_tensors
        tracker = tensor_parallel.get_cuda_rng_tracker()
        now_cpu, now_streams = torch.get_rng_state(), tracker.get_states()
        torch.set_rng_state(ctx.cpu)
        tracker.set_states(ctx.streams)
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            out = ctx.run(x)
        torch.set_rng_state(now_cpu)
        tracker.set_states(now_streams)
        torch.autograd.backward(out, grad)
        return None, x.grad


def test_a_compiled_model_recomputing_as_megatron_does_gets_the_gradients_of_no_recompute() -> None:
    """Under torch.compile the tracker's get_states and set_states run behind graph breaks (traced, they failed)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)

    def block(x: torch.Tensor) -> torch.Tensor:
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return F.dropout(lin(x), 0.5)

    def grads(step: object) -> torch.Tensor:
        tensor_parallel.model_parallel_cuda_manual_seed(7)
        x = torch.ones(4, 8, requires_grad=True)
        step(x).sum().backward()  # type: ignore[operator]
        assert x.grad is not None
        return x.grad

    plain = grads(block)
    compiled = torch.compile(lambda x: _MegatronStyleCheckpoint.apply(block, x), backend="aot_eager")
    assert torch.equal(grads(compiled), plain)
