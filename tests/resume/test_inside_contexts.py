"""Capturing or restoring the RNG state inside a context that swapped the generator (a fork of another tracker,
``fork_rng``, a ``portable_random(seed)`` block) is refused with nothing changed: inside, the generator holds that
context's stream, so a capture saved it as the run's state, and a restore was half undone by the context's exit
(Python's generator kept the checkpoint's state, torch's got the context's back, and the other tracker's stream took
the checkpoint's). So is a capture while another thread holds the generators it reads: it saved that thread's
context's stream."""

from __future__ import annotations

import random
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch

import hyperrng
from hyperrng.errors import InvalidOperationError
from hyperrng.streams.tracker import RNGStatesTracker
from tests._threads import OnAnotherThread

_LAYOUT = hyperrng.StreamLayout(dims=("tp",), default=(), streams={"mp": ("tp",)})
_PORTABLE = pytest.param(
    lambda: hyperrng.portable_random(1), id="portable_random-seed", marks=pytest.mark.needs_portable_mode
)
_CONTEXTS = [
    pytest.param(lambda: _other_fork(), id="another-trackers-fork"),
    pytest.param(hyperrng.fork_rng, id="fork_rng"),
    _PORTABLE,
]


def _other_fork() -> AbstractContextManager[None]:
    other = RNGStatesTracker()
    other.add("x", 77)
    return other.fork("x")


def _states() -> tuple[torch.Tensor, Any, dict[str, torch.Tensor]]:
    return torch.get_rng_state(), random.getstate(), hyperrng.get_rng_tracker().get_states()


def _assert_unchanged(before: tuple[torch.Tensor, Any, dict[str, torch.Tensor]]) -> None:
    cpu, host, streams = before
    assert torch.equal(torch.get_rng_state(), cpu) and random.getstate() == host
    now = hyperrng.get_rng_tracker().get_states()
    assert now.keys() == streams.keys() and all(torch.equal(now[k], v) for k, v in streams.items())


@pytest.mark.parametrize("context", _CONTEXTS)
@pytest.mark.parametrize("what", ["capture", "restore"])
def test_capture_and_restore_inside_a_context_that_swapped_the_generator_are_refused(
    context: Callable[[], AbstractContextManager[None]], what: str
) -> None:
    hyperrng.apply_layout(_LAYOUT, 3, {"tp": 0})
    saved = hyperrng.rng_state_dict()
    hyperrng.apply_layout(_LAYOUT, 5, {"tp": 0})
    with context():
        before = _states()
        with pytest.raises(InvalidOperationError, match="inside a .*: the generator holds the stream") as refused:
            hyperrng.rng_state_dict() if what == "capture" else hyperrng.load_rng_state_dict(saved)
        assert refused.value.reason == "tracker"  # type: ignore[attr-defined]
        _assert_unchanged(before)
    hyperrng.load_rng_state_dict(saved)  # outside it, as before


@pytest.mark.needs_portable_mode
def test_the_refusal_inside_portable_random_names_the_block() -> None:
    with hyperrng.portable_random(1), pytest.raises(InvalidOperationError, match=r"with portable_random\(1\)"):
        hyperrng.rng_state_dict()


@pytest.mark.needs_portable_mode
def test_capture_and_restore_in_portable_mode_that_keeps_the_runs_generator_work() -> None:
    """``portable_random()`` without a seed and the switch draw from the run's generator and put nothing back."""
    hyperrng.apply_layout(_LAYOUT, 3, {"tp": 0})
    torch.rand(3)
    outside = hyperrng.rng_state_dict()
    with hyperrng.portable_random():
        assert torch.equal(hyperrng.rng_state_dict()["devices"][0], outside["devices"][0])
        torch.rand(8)
        hyperrng.load_rng_state_dict(outside)
    assert torch.equal(platforms.current().get_rng_state(0), outside["devices"][0])  # the restore stands after it
    hyperrng.set_portable_random(True)
    try:
        assert torch.equal(hyperrng.rng_state_dict()["devices"][0], outside["devices"][0])
    finally:
        hyperrng.set_portable_random(False)


@pytest.mark.parametrize("context", _CONTEXTS)
def test_capture_while_another_thread_holds_the_generator_is_refused(
    context: Callable[[], AbstractContextManager[None]],
) -> None:
    hyperrng.apply_layout(_LAYOUT, 3, {"tp": 0})
    with OnAnotherThread(context):
        before = _states()
        with pytest.raises(InvalidOperationError, match="capture the RNG state .* was refused: thread") as refused:
            hyperrng.rng_state_dict()
        assert refused.value.reason == "busy"  # type: ignore[attr-defined]
        assert "once that thread has left" in str(refused.value)
        _assert_unchanged(before)
    hyperrng.rng_state_dict()  # once it has left, as before
