"""Re-deriving a rank's streams from a checkpoint saved under another setup (another world size, mesh or
layout): each stream's seed from the saved base seed and that stream's saved progress (:func:`resume_seed`),
which every rank that shared the stream holds alike; what ``load_rng_state_dict(..., on_mismatch="reseed")``
applies (:func:`_reseed`)."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping
from typing import Any

import torch

import hyperrng.platforms as platforms
from hyperrng.errors import ArgumentTypeError, InvalidArgumentError
from hyperrng.platforms.mix import combine64
from hyperrng.resume._format import check_saved, saved_derivation, saved_layout
from hyperrng.seeding.layout import DEFAULT_STREAM, StreamLayout, recorded_derivation
from hyperrng.streams.tracker import RNGStatesTracker

__all__ = ["RESUME_DOMAIN", "RNGResumeWarning", "resume_seed"]

RESUME_DOMAIN = 0x524553554D453031  # "RESUME01": keeps resume seeds apart from other uses of combine64
"""First value mixed into every :func:`resume_seed`."""


class RNGResumeWarning(UserWarning):
    """A resume that continues reproducibly but not bit-identically (streams were re-derived)."""


def _reseed(
    state: Mapping[str, Any],
    tracker: RNGStatesTracker,
    layout: StreamLayout | None,
    coords: object,
    mismatches: list[str],
) -> None:
    """Re-derive every stream from the *current* layout and coordinates (those given, else those
    :func:`hyperrng.apply_layout` last gave the tracker, else the saved layout), each from
    :func:`resume_seed`: the saved base seed mixed with the saved progress of that stream, which
    every rank sharing it holds alike, so ranks that share a stream share it again and the resumed
    run never replays the numbers of its first steps. Seed the host generators from the default
    stream, and warn that the run continues reproducibly but not bit-identically."""
    from hyperrng.seeding.recipes import seed_host

    base_seed = state.get("base_seed")
    recorded = recorded_derivation(tracker)  # what apply_layout gave this tracker for the current setup
    if layout is None:
        layout = recorded.layout if recorded is not None else saved_layout(state)
    if coords is None and recorded is not None and recorded.layout == layout:
        coords = recorded.coords
    if layout is None or coords is None or base_seed is None:
        raise InvalidArgumentError(
            "on_mismatch='reseed' needs the saved base seed and the current layout and coords; "
            f"the state has base_seed={base_seed!r}, and layout/coords were "
            f"{'given' if layout is not None and coords is not None else 'not given'}. Seed this run with "
            "apply_layout(layout, base_seed, coords) before loading, or pass layout= and coords=."
        )
    bases = {name: _resume_seed(state, name) for name in (DEFAULT_STREAM, *layout.streams)}
    seeds = layout.seeds(base_seed, coords, bases=bases)  # validates before anything changes
    layout.seed_tracker(tracker, base_seed, coords, bases=bases)
    seed_host(seeds[DEFAULT_STREAM])
    warnings.warn(
        "RNG state saved under a different setup (" + "; ".join(mismatches) + "): streams re-derived from "
        f"base seed {base_seed} and each stream's saved progress for the current layout; the run continues "
        "reproducibly but not bit-identically.",
        RNGResumeWarning,
        stacklevel=3,
    )


def resume_seed(state: Mapping[str, Any], stream: str = DEFAULT_STREAM) -> int:
    """The base seed from which ``load_rng_state_dict(state, on_mismatch="reseed")`` re-derives ``stream``
    (default: the default stream, whose generators the layout seeds); the layout then mixes in the
    stream's name and this rank's coordinates on the stream's dimensions.

    It is ``combine64(RESUME_DOMAIN, base_seed, progress)``
    (:func:`hyperrng.platforms.mix.combine64`), where *progress* fingerprints how far the saved
    stream had gone, and only that: what every rank that shares the stream holds alike. For a
    named stream, its saved state (empty where the state lacks the stream); for the default
    stream, the saved state of torch's CPU generator (on the CPU platform, its device with its
    position), which :func:`hyperrng.apply_layout` seeds from the default stream on every
    platform, and, where the state records its derivation, the position of each saved
    counter-based device generator holding the default stream's seed. So after a resume at any
    world size the ranks that share a stream share it again (having loaded checkpoints of ranks
    that shared it), ranks that must differ do, the streams differ from those of the first steps,
    and two resumes of one checkpoint agree. A checkpoint taken after such a resume records these
    seeds beside the base seed (``resume_bases``).

    Raises:
        ArgumentTypeError, InvalidArgumentError: ``state`` is not a valid RNG state, or has
            no base seed; ``stream`` is not a string.
    """
    check_saved(state)
    if not isinstance(stream, str):
        raise ArgumentTypeError(f"stream must be a stream's name, got {type(stream).__name__}.")
    return _resume_seed(state, stream)


def _resume_seed(state: Mapping[str, Any], stream: str) -> int:
    """:func:`resume_seed` of a state :func:`check_saved` accepted."""
    base_seed = state["base_seed"]
    if base_seed is None:
        raise InvalidArgumentError(
            "the RNG state has no base seed to resume from; save it with rng_state_dict(base_seed=...) or after "
            "apply_layout()."
        )
    progress = hashlib.blake2b(digest_size=8)
    if stream != DEFAULT_STREAM:
        saved = state["streams"].get(stream)
        if isinstance(saved, torch.Tensor):
            progress.update(saved.detach().cpu().contiguous().numpy().tobytes())
        return combine64(RESUME_DOMAIN, base_seed, int.from_bytes(progress.digest(), "little"))
    host = state["torch_cpu"] if state["torch_cpu"] is not None else (state["devices"] or [None])[0]
    if not isinstance(host, torch.Tensor) or host.dtype != torch.uint8 or host.dim() != 1:
        raise InvalidArgumentError(
            "the RNG state is malformed: it holds no state of torch's CPU generator (torch_cpu, or the first "
            "device on a platform whose device is the host)."
        )
    progress.update(host.detach().cpu().contiguous().numpy().tobytes())
    derivation = saved_derivation(state)
    if derivation is not None:
        default_seed = derivation.seeds()[DEFAULT_STREAM]
        for device in state["devices"]:
            if (
                isinstance(device, torch.Tensor)
                and device.dtype == torch.uint8
                and device.shape == (platforms.COUNTER_STATE_NBYTES,)
            ):
                seed, offset = platforms.unpack_counter_state(device)
                if seed == default_seed:
                    progress.update(offset.to_bytes(8, "little", signed=True))
    return combine64(RESUME_DOMAIN, base_seed, int.from_bytes(progress.digest(), "little"))
