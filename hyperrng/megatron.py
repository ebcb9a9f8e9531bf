"""Megatron-core's ``tensor_parallel.random`` names, signatures and meaning, on hyperrng.

Code written for Megatron-core changes one import and nothing else::

    from hyperrng import megatron as tensor_parallel   # was: from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=tp, ep_rank=ep, etp_rank=etp)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        x = dropout(x)
    with tensor_parallel.get_cuda_rng_tracker().fork(tensor_parallel.get_expert_parallel_rng_tracker_name()):
        y = expert(x)
    out = tensor_parallel.checkpoint(block, False, x)

The tracker is hyperrng's process-wide :class:`~hyperrng.streams.tracker.RNGStatesTracker` (any platform,
not only CUDA). What hyperrng has no counterpart for is refused with a typed error naming what to
use instead, never run differently: TransformerEngine's and the inference tracker classes,
``distribute_saved_activations=True`` (which needs Megatron-core's parallel state) and
``CheckpointWithoutOutput`` (which frees its outputs' storage; use :func:`hyperrng.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyperrng.errors import ArgumentTypeError, InvalidArgumentError
from hyperrng.seeding.recipes import model_parallel_cuda_manual_seed
from hyperrng.streams.recompute import checkpoint as _checkpoint
from hyperrng.streams.tracker import (
    DATA_PARALLEL_STREAM,
    EXPERT_PARALLEL_STREAM,
    MODEL_PARALLEL_STREAM,
    CudaRNGStatesTracker,
    RNGStatesTracker,
    get_rng_tracker,
    set_rng_tracker,
)

__all__ = [
    "CheckpointWithoutOutput",
    "CudaRNGStatesTracker",
    "checkpoint",
    "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "initialize_rng_tracker",
    "model_parallel_cuda_manual_seed",
]

_MODEL_PARALLEL_RNG_TRACKER_NAME = MODEL_PARALLEL_STREAM
_EXPERT_PARALLEL_RNG_TRACKER_NAME = EXPERT_PARALLEL_STREAM
_DATA_PARALLEL_RNG_TRACKER_NAME = DATA_PARALLEL_STREAM


def get_expert_parallel_rng_tracker_name() -> str:
    """The expert-parallel stream's name, ``"expert-parallel-rng"``."""
    return EXPERT_PARALLEL_STREAM


def get_data_parallel_rng_tracker_name() -> str:
    """The data-parallel stream's name, ``"data-parallel-rng"``."""
    return DATA_PARALLEL_STREAM


def _check_flags(**flags: object) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ArgumentTypeError(f"{name} must be True or False, got {type(value).__name__} {value!r:.40}.")
    chosen = [name for name in ("use_te_rng_tracker", "inference_rng_tracker") if flags.get(name)]
    if chosen:
        raise InvalidArgumentError(
            f"{', '.join(chosen)}=True selects one of Megatron-core's tracker classes (TransformerEngine's, or the "
            "inference tracker whose fork does nothing), which hyperrng's tracker replaces: drop the flag. "
            "hyperrng's tracker also serves TransformerEngine's modules (pass get_cuda_rng_tracker)."
        )


def initialize_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    force_reset: bool = False,
) -> None:
    """Make the process-wide tracker a fresh one (graph-safe with ``use_cudagraphable_rng``) unless it
    holds streams already (seeded by hyperrng or by an earlier call) and ``force_reset`` is false.

    Raises:
        ArgumentTypeError: a flag is not a bool.
        InvalidArgumentError: ``use_te_rng_tracker`` or ``inference_rng_tracker`` is true.
        InvalidOperationError: a fork of the process-wide tracker is open (see
            :func:`hyperrng.set_rng_tracker`). Nothing changes on error.
    """
    _check_flags(
        use_te_rng_tracker=use_te_rng_tracker,
        inference_rng_tracker=inference_rng_tracker,
        use_cudagraphable_rng=use_cudagraphable_rng,
        force_reset=force_reset,
    )
    if force_reset or not get_rng_tracker().is_initialized():  # a tracker with streams is kept, seeded as it is
        set_rng_tracker(RNGStatesTracker(graph_safe=use_cudagraphable_rng))


def get_cuda_rng_tracker(
    use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False, use_cudagraphable_rng: bool = False
) -> RNGStatesTracker:
    """The process-wide tracker, initialised first as :func:`initialize_rng_tracker` does."""
    initialize_rng_tracker(use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    return get_rng_tracker()


def checkpoint(function: Callable[..., Any], distribute_saved_activations: bool, *args: Any) -> Any:
    """Megatron-core's ``checkpoint``: :func:`hyperrng.checkpoint` of ``function(*args)``.

    Raises:
        ArgumentTypeError: ``distribute_saved_activations`` is not a bool.
        InvalidArgumentError: ``distribute_saved_activations`` is true: splitting the saved
            input across the tensor-parallel group needs Megatron-core's parallel state;
            hyperrng keeps it whole. Pass ``False``.
    """
    if not isinstance(distribute_saved_activations, bool):
        raise ArgumentTypeError(
            "checkpoint(function, distribute_saved_activations, *args) takes a bool second, got "
            f"{type(distribute_saved_activations).__name__}; for checkpoint(function, *args) call hyperrng.checkpoint."
        )
    if distribute_saved_activations:
        raise InvalidArgumentError(
            "distribute_saved_activations=True splits the saved input over the tensor-parallel group, which needs "
            "Megatron-core's parallel state; hyperrng recomputes from the whole input. Pass False."
        )
    return _checkpoint(function, *args)


class CheckpointWithoutOutput:
    """Megatron-core's checkpoint that frees its outputs' storage until the backward pass: not provided.

    Raises:
        InvalidArgumentError: on construction, naming :func:`hyperrng.checkpoint` (which keeps the
            outputs, and replays the forward's random numbers on every platform) instead.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise InvalidArgumentError(
            "CheckpointWithoutOutput frees its outputs' storage and restores it from a hook; hyperrng has no such "
            "checkpoint. Use hyperrng.megatron.checkpoint(function, False, *args) (or hyperrng.checkpoint), which "
            "keeps the outputs and recomputes with the forward's random numbers."
        )
