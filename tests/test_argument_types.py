"""A wrong type is an ArgumentTypeError (a TypeError) naming the argument, raised before anything changes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch

import hyperrng
from hyperrng import ArgumentTypeError, HyperRNGError, StreamLayout

LAYOUT = StreamLayout(dims=("dp",), default=(), streams={"s": ("dp",)})

CALLS: list[tuple[str, Callable[[], Any], str]] = [
    ("apply_layout(layout='x')", lambda: hyperrng.apply_layout("x", 1, {"dp": 0}), "layout"),  # type: ignore[arg-type]
    ("apply_layout(tracker='x')", lambda: hyperrng.apply_layout(LAYOUT, 1, {"dp": 0}, tracker="x"), "tracker"),  # type: ignore[arg-type]
    ("rng_state_dict(tracker='x')", lambda: hyperrng.rng_state_dict(tracker="x"), "tracker"),  # type: ignore[arg-type]
    ("rng_state_dict(layout='x')", lambda: hyperrng.rng_state_dict(layout="x"), "layout"),  # type: ignore[arg-type]
    ("rng_state_dict(base_seed='1')", lambda: hyperrng.rng_state_dict(base_seed="1"), "base_seed"),  # type: ignore[arg-type]
    ("verify_rng_sync('x', {})", lambda: hyperrng.verify_rng_sync("x", {}), "layout"),  # type: ignore[arg-type]
    ("ShardedRNGTracker(platform='cpu')", lambda: hyperrng.ShardedRNGTracker(platform="cpu"), "platform"),  # type: ignore[arg-type]
    ("checkpoint(5)", lambda: hyperrng.checkpoint(5), "function"),  # type: ignore[arg-type]
    ("checkpoint(fn, tracker='x')", lambda: hyperrng.checkpoint(torch.sin, torch.ones(1), tracker="x"), "tracker"),  # type: ignore[arg-type]
    ("fork_rng(enabled='yes')", lambda: hyperrng.fork_rng(enabled="yes"), "enabled"),  # type: ignore[arg-type]
    ("set_random_seed('7')", lambda: hyperrng.set_random_seed("7"), "seed"),  # type: ignore[arg-type]
    ("set_random_seed(7.0)", lambda: hyperrng.set_random_seed(7.0), "seed"),  # type: ignore[arg-type]
    ("set_random_seed(None)", lambda: hyperrng.set_random_seed(None), "seed"),  # type: ignore[arg-type]
    ("set_random_seed(1, tp_rank='1')", lambda: hyperrng.set_random_seed(1, tp_rank="1"), "tp_rank"),  # type: ignore[arg-type]
    ("set_rng_tracker(None)", lambda: hyperrng.set_rng_tracker(None), "RNGStatesTracker"),  # type: ignore[arg-type]
    ("RNGStatesTracker().add(3, 1)", lambda: hyperrng.RNGStatesTracker().add(3, 1), "stream name"),  # type: ignore[arg-type]
    ("platform.manual_seed('3')", lambda: platforms.current().manual_seed("3"), "seed"),  # type: ignore[arg-type]
    ("platform.get_rng_state(index='0')", lambda: platforms.current().get_rng_state("0"), "device index"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("label", "call", "fragment"), CALLS, ids=[c[0] for c in CALLS])
def test_a_wrong_type_is_a_typed_type_error_and_changes_nothing(
    label: str, call: Callable[[], Any], fragment: str
) -> None:
    platform = platforms.current()
    before = platform.get_rng_state(), torch.get_rng_state()
    with pytest.raises(ArgumentTypeError, match=fragment) as info:
        call()
    assert isinstance(info.value, TypeError) and isinstance(info.value, HyperRNGError)
    assert torch.equal(platform.get_rng_state(), before[0]) and torch.equal(torch.get_rng_state(), before[1])


def test_numpy_integers_are_accepted_wherever_python_ints_are() -> None:
    import numpy as np

    hyperrng.set_random_seed(np.int64(7), tp_rank=np.int64(1), pp_rank=np.uint8(0))
    state = hyperrng.rng_state_dict(base_seed=np.int64(1234))
    assert type(state["base_seed"]) is int  # stored as a plain int: loadable with weights_only
    hyperrng.get_rng_tracker().reset()
