"""Capturing or restoring the RNG state inside a context that swapped the generator (a fork of another tracker,
``fork_rng``) is refused with nothing changed: inside, the generator holds that context's stream, so a capture
saved it as the run's state, and a restore was half undone by the context's exit (Python's generator kept the
checkpoint's state, torch's got the context's back, and the other tracker's stream took the checkpoint's)."""

from __future__ import annotations

import random
from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest
import torch

import hyperrng
from hyperrng.errors import InvalidOperationError
from hyperrng.streams.tracker import RNGStatesTracker

_LAYOUT = hyperrng.StreamLayout(dims=("tp",), default=(), streams={"mp": ("tp",)})


def _other_fork() -> AbstractContextManager[None]:
    other = RNGStatesTracker()
    other.add("x", 77)
    return other.fork("x")


@pytest.mark.parametrize("context", [_other_fork, hyperrng.fork_rng], ids=["another-trackers-fork", "fork_rng"])
@pytest.mark.parametrize("what", ["capture", "restore"])
def test_capture_and_restore_inside_a_context_that_swapped_the_generator_are_refused(
    context: Callable[[], AbstractContextManager[None]], what: str
) -> None:
    hyperrng.apply_layout(_LAYOUT, 3, {"tp": 0})
    saved = hyperrng.rng_state_dict()
    hyperrng.apply_layout(_LAYOUT, 5, {"tp": 0})
    tracker = hyperrng.get_rng_tracker()
    with context():
        inside = torch.get_rng_state(), random.getstate(), tracker.get_states()
        with pytest.raises(InvalidOperationError, match="inside a .*: the generator holds the stream") as refused:
            hyperrng.rng_state_dict() if what == "capture" else hyperrng.load_rng_state_dict(saved)
        assert refused.value.reason == "tracker"  # type: ignore[attr-defined]
        cpu, host, streams = inside
        assert torch.equal(torch.get_rng_state(), cpu) and random.getstate() == host
        assert all(torch.equal(tracker.get_states()[k], v) for k, v in streams.items())
    hyperrng.load_rng_state_dict(saved)  # outside it, as before
