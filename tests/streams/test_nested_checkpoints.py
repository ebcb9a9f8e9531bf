"""A replayed checkpoint (``hyperrng.checkpoint``) inside one of torch's that replays nothing of hyperrng's.

The outer checkpoint's recompute reruns the inner one's forward pass, torch's generators put back, in the mode
``backward()`` runs in and with the tracker's streams where they then are. The inner block must draw there what
its forward pass drew (the mode is stamped on the outer checkpoint), and a fork inside it is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import hyperrng
from hyperrng.errors import InvalidOperationError, UnsupportedPortableOpError
from hyperrng.streams.recompute import checkpoint
from hyperrng.streams.tracker import RNGStatesTracker
from tests.streams.test_recompute import _Forward, assert_equal_states, composable, generator_states

OUTER: dict[str, Callable[..., Any]] = {
    "torch reentrant": lambda f, x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=True),
    "torch non-reentrant": lambda f, x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False),
    "composable": lambda f, x: composable(_Forward(f), x),  # torch.distributed._composable.checkpoint
}


def _replaying(inner: str, tracker: RNGStatesTracker | None = None) -> Callable[..., Any]:
    """The checkpoint ``inner`` (a name in :data:`INNER`), replaying ``tracker``'s streams."""
    replay = functools.partial(hyperrng.checkpoint_context, tracker=tracker)
    return {
        "hyperrng.checkpoint": lambda f, x: checkpoint(f, x, tracker=tracker),
        "checkpoint_context": lambda f, x: torch.utils.checkpoint.checkpoint(
            f, x, use_reentrant=False, context_fn=replay
        ),
        # Its forward context is entered below its module's call: that call is not a checkpoint around it.
        "composable checkpoint_context": lambda f, x: composable(_Forward(f), x, context_fn=replay),
    }[inner]


INNER = {
    name: _replaying(name) for name in ("hyperrng.checkpoint", "checkpoint_context", "composable checkpoint_context")
}
"""The checkpoints that replay hyperrng's draws."""
_W = torch.linspace(-1, 1, 64).view(8, 8)
_X = torch.linspace(-2, 2, 32).view(4, 8)


def _dropout(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.dropout(x @ w, 0.5)


def _squared_inner(inner: str, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The inner checkpoint's output, squared: the square saves it, so the outer recompute must redraw it."""
    return INNER[inner](functools.partial(_dropout, w), x) ** 2


def _mode(on: bool) -> Any:
    return hyperrng.portable_random(7) if on else torch.enable_grad()


def _run(
    outer: Callable[..., Any] | None, forward_in_mode: bool, backward_in_mode: bool, inner: str = "hyperrng.checkpoint"
) -> list[Any]:
    w, x = _W.clone().requires_grad_(), _X.clone().requires_grad_()
    torch.manual_seed(1)
    with _mode(forward_in_mode):
        block = functools.partial(_squared_inner, inner, w)
        y = outer(block, x) if outer is not None else F.dropout(x @ w, 0.5) ** 2
    with _mode(backward_in_mode):
        (y * torch.arange(8.0)).sum().backward()
        after = torch.rand(3)  # the next draw, in the backward's mode: the recompute left no trace
    return [y.detach(), w.grad, x.grad, after]


@pytest.mark.needs_portable_mode
@pytest.mark.parametrize("modes", [(True, False), (False, True), (True, True)], ids=["fwd-in", "bwd-in", "both-in"])
@pytest.mark.parametrize("inner", INNER)
@pytest.mark.parametrize("outer", OUTER)
def test_the_outer_recompute_reruns_the_inner_block_in_the_mode_its_forward_had(
    outer: str, inner: str, modes: tuple[bool, bool]
) -> None:
    """Before, with the mode differing between forward and backward, gradients differed silently (by up to 300).
    A reentrant outer runs its forward without grad, where an inner non-reentrant one records nothing: forwarded
    in the mode, that block's draws are refused."""
    plain = _run(None, *modes)
    if outer == "torch reentrant" and inner != "hyperrng.checkpoint" and modes[0]:
        with pytest.raises(UnsupportedPortableOpError, match="use_reentrant=True"):
            _run(OUTER[outer], *modes, inner)
        return
    nested = _run(OUTER[outer], *modes, inner)
    assert all(torch.equal(a, b) for a, b in zip(nested, plain, strict=True))


def _torch_inside(outer: str, inner: str) -> Callable[..., Any]:
    """A torch checkpoint of the flavour ``inner`` inside one of the flavour ``outer``, around the squared dropout."""

    def wrap(block: Callable[..., Any], x: torch.Tensor) -> torch.Tensor:
        w = block.args[-1]  # type: ignore[attr-defined]
        return OUTER[outer](lambda t: OUTER[inner](functools.partial(_dropout, w), t) ** 2, x)

    return wrap


@pytest.mark.needs_portable_mode
@pytest.mark.parametrize(
    ("outer", "inner"),
    [
        ("torch reentrant", "torch reentrant"),
        ("torch reentrant", "torch non-reentrant"),
        ("torch non-reentrant", "torch reentrant"),
    ],
)
def test_nested_torch_checkpoints_forwarded_outside_the_mode_recompute_torchs_numbers_in_a_backward_inside_it(
    outer: str, inner: str
) -> None:
    """The inner forward, rerun by the outer recompute, drew torch's numbers (in the mode it would have been
    refused); before, the rerun refused it in the backward pass. (Two non-reentrant ones still refuse there: the
    inner one's hooks hide the outer one's recompute.)"""
    assert all(
        torch.equal(a, b)
        for a, b in zip(_run(_torch_inside(outer, inner), False, True), _run(None, False, True), strict=True)
    )


@pytest.mark.needs_portable_mode
def test_inner_checkpoints_in_and_out_of_the_mode_inside_one_reentrant_block_are_refused() -> None:
    w, x = _W.clone().requires_grad_(), _X.clone().requires_grad_()

    def block(t: torch.Tensor) -> torch.Tensor:
        t = checkpoint(functools.partial(_dropout, w), t)
        with hyperrng.portable_random(3):
            return checkpoint(functools.partial(_dropout, w), t)

    with pytest.raises(InvalidOperationError, match="in and out of portable mode inside one"):
        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)


@pytest.mark.parametrize("inner", INNER)
@pytest.mark.parametrize("outer", OUTER)
def test_a_fork_in_a_replayed_checkpoint_inside_one_that_replays_nothing_is_refused(outer: str, inner: str) -> None:
    """Before, the outer recompute forked the stream where it then was: other gradients (reentrant), or the
    stream moved on by the recompute (non-reentrant)."""
    tracker = RNGStatesTracker()
    tracker.add("s", 5)
    x = _X.clone().requires_grad_()

    def forked(t: torch.Tensor) -> torch.Tensor:
        with tracker.fork("s"):
            return F.dropout(t, 0.5)

    before = generator_states(tracker)
    with pytest.raises(InvalidOperationError, match="cannot be forked inside torch.utils.checkpoint"):
        OUTER[outer](lambda t: _replaying(inner, tracker)(forked, t), x)
    assert_equal_states(generator_states(tracker), before)
    with tracker.fork("s"):  # nothing was left open
        pass


@pytest.mark.needs_portable_mode
def test_a_hook_on_a_reentrant_checkpoints_output_draws_portably() -> None:
    """The checkpoint's node is the one running while its output's hooks run, outside its recompute: they draw
    portable numbers, as without the checkpoint (before, torch's)."""

    def grads(wrap: Callable[..., Any]) -> list[torch.Tensor]:
        w, x = _W.clone().requires_grad_(), _X.clone().requires_grad_()
        with hyperrng.portable_random(5):
            y = wrap(lambda t: torch.tanh(t @ w), x)
            y.register_hook(lambda g: g + torch.randn_like(g))
            y.sum().backward()
            return [w.grad, x.grad, torch.rand(3)]

    plain = grads(lambda f, x: f(x))
    assert all(torch.equal(a, b) for a, b in zip(grads(OUTER["torch reentrant"]), plain, strict=True))


def test_the_contexts_take_the_attributes_torch_gives_them_when_it_compiles() -> None:
    """Torch's eager backend runs a checkpoint it compiled eagerly and tags its forward context
    (``ac_graph_id``): a context without room for it failed with AttributeError."""

    def step(compiled: bool) -> torch.Tensor:
        x = _X.clone().requires_grad_()
        torch.manual_seed(2)

        def f(t: torch.Tensor) -> torch.Tensor:
            return torch.utils.checkpoint.checkpoint(
                lambda u: F.dropout(u, 0.5).sin(), t, use_reentrant=False, context_fn=hyperrng.checkpoint_context
            )

        (torch.compile(f, backend="eager") if compiled else f)(x).sum().backward()
        assert x.grad is not None
        return x.grad

    torch._dynamo.reset()
    assert torch.equal(step(True), step(False))


def test_a_module_with_the_context_exports_and_runs() -> None:
    """Export's tracing takes only selective-checkpoint contexts; on torch 2.5 the context did not see it there."""

    class Block(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.utils.checkpoint.checkpoint(
                torch.sin, x, use_reentrant=False, context_fn=hyperrng.checkpoint_context
            )

    exported = torch.export.export(Block(), (_X.clone(),), strict=False)
    assert torch.equal(exported.module()(_X.clone()), torch.sin(_X))


@pytest.mark.needs_portable_mode
@pytest.mark.parametrize("modes", [(True, True), (True, False), (False, True)], ids=["both-in", "fwd-in", "bwd-in"])
@pytest.mark.parametrize("outer", OUTER)
def test_a_replayed_checkpoint_two_torch_checkpoints_deep_recomputes_the_forwards_numbers(
    outer: str, modes: tuple[bool, bool]
) -> None:
    """The middle checkpoint is made anew in the outer one's recompute: the rerun stamps it too (before, its own
    recompute found no stamp and drew outside the mode: gradients off by up to 45 with the mode on throughout)."""

    def wrap(block: Callable[..., Any], x: torch.Tensor) -> torch.Tensor:
        return OUTER[outer](lambda t: OUTER[outer](block, t), x)

    plain = _run(None, *modes)
    assert all(torch.equal(a, b) for a, b in zip(_run(wrap, *modes), plain, strict=True))


def test_a_fork_under_a_non_reentrant_checkpoint_begun_without_grad_is_refused_by_the_one_around_it() -> None:
    """A non-reentrant checkpoint inside a reentrant one's forward (no grad) records nothing: the reentrant one's
    recompute reruns the fork (before, on torch 2.13 the inner one counted, and the fork ran: other gradients)."""
    tracker = RNGStatesTracker()
    tracker.add("s", 5)
    x = _X.clone().requires_grad_()
    replay = functools.partial(hyperrng.checkpoint_context, tracker=tracker)

    def forked(t: torch.Tensor) -> torch.Tensor:
        with tracker.fork("s"):
            return F.dropout(t, 0.5)

    def middle(t: torch.Tensor) -> torch.Tensor:
        inner = functools.partial(checkpoint, forked, tracker=tracker)
        return torch.utils.checkpoint.checkpoint(inner, t, use_reentrant=False, context_fn=replay)

    with pytest.raises(InvalidOperationError, match=r"use_reentrant=True"):
        OUTER["torch reentrant"](middle, x)
