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
from hyperrng.tracker import RNGStatesTracker, get_rng_tracker, set_rng_tracker


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
