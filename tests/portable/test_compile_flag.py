"""Portable mode beside torch.compile's process-wide "compiling" flag: the library asks whether Dynamo traces
the calling frame (``torch.compiler.is_dynamo_compiling``), never whether a compilation runs somewhere in the
process (``is_compiling``, true on every thread while any thread compiles, and during fake-tensor propagation).
Asked the second way, a kernel that stepped out of the graph found the flag still set and called itself
until the recursion limit."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hyperrng
from hyperrng.streams.tracker import RNGStatesTracker

pytestmark = pytest.mark.needs_portable_mode


def test_compiled_attention_without_dropout_runs_in_the_mode() -> None:
    """Attention without dropout (a model with dropout 0, an eval loop) traces in the mode as outside it: its
    fake-tensor propagation reached a refusal kernel that called itself (RecursionError)."""
    q = torch.randn(1, 2, 4, 8)
    f = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q), backend="aot_eager")
    with hyperrng.portable_random(0):
        assert torch.allclose(f(q), F.scaled_dot_product_attention(q, q, q))


def test_a_compile_on_another_thread_leaves_draws_forks_and_checkpoints_here_alone() -> None:
    """While another thread compiles (its backend waits here), this thread's portable draws, forks and
    ``hyperrng.checkpoint`` run and draw what they draw alone (each crashed with RecursionError)."""
    started, done = threading.Event(), threading.Event()

    def slow_backend(gm: Any, inputs: Any) -> Any:
        started.set()
        done.wait(60)
        return gm.forward

    compiling = threading.Thread(target=lambda: torch.compile(lambda x: x + 1, backend=slow_backend)(torch.ones(2)))
    tracker = RNGStatesTracker()

    def work() -> list[torch.Tensor]:
        tracker.reseed({"mp": 5})
        x = torch.ones(4, requires_grad=True)
        with hyperrng.portable_random(3):
            drawn = torch.rand(3)
        with tracker.fork("mp"):
            forked = torch.rand(3)
        y = hyperrng.checkpoint(lambda t: F.dropout(t, 0.5), x)
        y.sum().backward()
        return [drawn, forked, y.detach(), x.grad]

    torch.manual_seed(0)
    alone = work()
    compiling.start()
    try:
        assert started.wait(60)
        torch.manual_seed(0)
        beside = work()
    finally:
        done.set()
        compiling.join()
    assert all(torch.equal(a, b) for a, b in zip(alone, beside))


def test_the_mode_entered_inside_a_compiled_function_runs_behind_a_graph_break() -> None:
    """Entered as Python behind a graph break, as a fork is: the eager portable draws, the mode left after. Under
    fullgraph=True, Dynamo's refusal names the mode's entry (before, a builtin deep inside it)."""

    def step(x: torch.Tensor) -> torch.Tensor:
        with hyperrng.portable_random(7):
            return x + torch.rand(3)

    torch._dynamo.reset()
    drawn = torch.compile(step, backend="eager")(torch.zeros(3))
    with hyperrng.portable_random(7):
        assert torch.equal(drawn, torch.rand(3))
    assert not hyperrng.is_portable_random_enabled()
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="_enter_outside_the_graph"):
        torch.compile(step, backend="eager", fullgraph=True)(torch.zeros(3))
    assert not hyperrng.is_portable_random_enabled()
