"""Portable mode where large runs live: torch.compile, activation checkpoints, graph capture, traced devices.

Compiled code in the mode must draw exactly the numbers eager code draws (fresh at every call, in
program order, gradients included); every checkpoint flavour must recompute the forward's numbers or
refuse before anything moves; a draw under graph capture is refused, never baked into the graph.
Inductor compiles take seconds on the CPU, so most tests use the ``aot_eager`` backend (the same
tracing, the graph run by torch) and a few run inductor itself.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch
import torch.nn.functional as F
from hyperrng.platforms.simulated import SimulatedGraph
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import hyperrng
from hyperrng import philox
from hyperrng.errors import UnsupportedPortableOpError
from hyperrng.philox import attention, backends
from hyperrng.portable import _traced
from hyperrng.portable.mode import is_portable_random_enabled, portable_random
from tests._platforms import cuda_platform  # noqa: F401 - the fixture `cuda`

pytestmark = [pytest.mark.needs_portable_mode, pytest.mark.needs_portable_compile]

SEED = 4321


@pytest.fixture(autouse=True)
def cpu_platform() -> Iterator[platforms.Platform]:
    import torch._dynamo

    torch._dynamo.reset()
    with platforms.use(platforms.CPUPlatform()) as p:
        yield p
    assert not is_portable_random_enabled(), "a test left portable mode on"


def _position() -> tuple[int, int]:
    return platforms.current().get_seed_offset()


def _every_draw(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One of each portable op, as user code calls them."""
    return (
        F.dropout(x, 0.3, True),
        torch.rand(5),
        torch.randn(3, 3),
        torch.randint(0, 10, (6,)),
        torch.empty(7).uniform_(-1, 1),
        torch.bernoulli(torch.full((8,), 0.3)),
        torch.rand_like(x),
        torch.randn(9, dtype=torch.float64),
        torch.empty(4, 5).normal_(2.0, 3.0),
        torch.empty(10).bernoulli_(torch.linspace(0, 1, 10)),
        torch.randint_like(x, 3, 17),
        torch.rand(3, dtype=torch.bfloat16),
        torch.randint(-3, 5, (6,), dtype=torch.int32),
    )


def _equal(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# -- tracing in the mode ---------------------------------------------------------------------------
def test_tracing_a_non_random_op_inside_the_mode_does_not_recurse() -> None:
    """The issue's smallest case: a meta reduction under torch's Python dispatcher (what tracing runs)."""
    from torch._dispatch.python import enable_python_dispatcher

    with portable_random(SEED), enable_python_dispatcher():
        assert torch.empty(4, 8, device="meta", dtype=torch.bool).sum(1).shape == (4,)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_every_portable_op_compiled_draws_what_eager_draws_at_every_call(backend: str) -> None:
    x = torch.ones(4, 8)
    with portable_random(SEED):
        first, second = _every_draw(x), _every_draw(x)
        after_eager = _position()
    compiled = torch.compile(_every_draw, backend=backend, fullgraph=True)
    with portable_random(SEED):
        assert _equal(compiled(x), first)
        assert _equal(compiled(x), second), "a second call must draw fresh numbers, the eager sequence"
        assert _position() == after_eager


@pytest.mark.slow
def test_inductor_compiled_code_draws_what_eager_draws_in_program_order() -> None:
    """Inductor, the default backend: every op, called twice, and draws on independent branches that a
    scheduler would like to reorder (the position follows the program, not the schedule)."""

    def branches(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        big = F.dropout(x.expand(64, 64).contiguous(), 0.5)  # a large branch first
        small = torch.rand(3)  # then a small independent one
        unused = torch.rand(4)  # noqa: F841 - drawn and dropped: the position still moves past it
        return (*_every_draw(x), big.sum(0), small, torch.rand(2))

    x = torch.ones(4, 8)
    with portable_random(SEED):
        first, second = branches(x[:1, :1]), branches(x[:1, :1])
        eager_end = _position()
    compiled = torch.compile(branches, fullgraph=True)
    with portable_random(SEED):
        assert _equal(compiled(x[:1, :1]), first)
        assert _equal(compiled(x[:1, :1]), second)
        assert _position() == eager_end


class _Net(torch.nn.Module):
    """Linear -> ReLU -> Dropout -> Linear -> Dropout: the issue's model, with a second dropout."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.b(F.dropout(torch.relu(self.a(x)), 0.1)), 0.3)


def _train_step(model: Callable[[torch.Tensor], torch.Tensor], net: _Net) -> list[torch.Tensor]:
    x = torch.linspace(-1, 1, 32).view(4, 8)
    y = model(x)
    (y * torch.arange(y.numel()).view(y.shape)).sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
    net.zero_grad(set_to_none=True)
    return [y.detach(), *grads]


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_compiled_training_step_equals_the_eager_step_bit_for_bit(backend: str) -> None:
    net = _Net()
    with portable_random(SEED):
        eager = [_train_step(net, net) for _ in range(2)]
    compiled = torch.compile(net, backend=backend, fullgraph=True)
    with portable_random(SEED):
        steps = [_train_step(compiled, net) for _ in range(2)]
    for got, want in zip(steps, eager):
        assert _equal(got, want)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_draw_whose_result_is_unused_still_moves_the_position_in_compiled_code(backend: str) -> None:
    """The compilers drop an unused pure op (dead-code elimination): an unused last draw must stay."""

    def draw(x: torch.Tensor) -> torch.Tensor:
        y = F.dropout(x, 0.5)
        torch.rand(4)  # drawn and dropped, after every other draw: no later draw takes its order output
        return y

    x = torch.ones(8)
    with portable_random(SEED):
        eager = [draw(x) for _ in range(3)]
        eager_end = _position()
    compiled = torch.compile(draw, backend=backend, fullgraph=True)
    with portable_random(SEED):
        assert _equal([compiled(x) for _ in range(3)], eager)
        assert _position() == eager_end


def _sized_draws(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Factories whose sizes come from the input: symbolic sizes once compiled with dynamic shapes."""
    n = x.shape[0]
    return (
        torch.rand(n, 2),
        torch.randn(x.shape),
        torch.randint(0, 9, (n,)),
        torch.randint(5, (n, 2), dtype=torch.int32),
        torch.normal(0.5, 2.0, (n,)),
        torch.empty(n).uniform_(-1, 1),
        torch.rand_like(x),
    )


def _attention_dropout(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (F.scaled_dot_product_attention(x, x, x, dropout_p=0.25),)


@pytest.mark.parametrize(
    "backend, dynamic",
    [("aot_eager", None), ("aot_eager", True), pytest.param("inductor", None, marks=pytest.mark.slow)],
    ids=["aot_eager-recompiled-dynamic", "aot_eager-dynamic-from-the-first-call", "inductor-recompiled-dynamic"],
)
@pytest.mark.parametrize("fn", [_sized_draws, _attention_dropout], ids=["factories", "attention"])
def test_compiled_code_with_dynamic_shapes_draws_what_eager_draws(
    fn: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], backend: str, dynamic: bool | None
) -> None:
    """A batch of another size makes torch.compile compile again with symbolic sizes (``dynamic=None``)."""
    torch.manual_seed(0)
    batches = [torch.randn(b, 2, 4, 8) for b in (2, 2, 3)]
    with portable_random(SEED):
        eager = [fn(x) for x in batches]
        eager_end = _position()
    compiled = torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=True)
    with portable_random(SEED):
        for x, want in zip(batches, eager):
            assert _equal(compiled(x), want)
        assert _position() == eager_end


_GRADIENT_THROUGH_A_DRAW: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "bernoulli(p)": lambda x: torch.bernoulli(torch.sigmoid(x)) * x,
    "bernoulli_(p)": lambda x: torch.empty(4).bernoulli_(torch.sigmoid(x)) * x,
    "uniform_": lambda x: (x * 1).uniform_(),
    "normal_": lambda x: (x * 2).normal_(0.5, 2.0) * x,
}


@pytest.mark.parametrize("name", _GRADIENT_THROUGH_A_DRAW)
def test_a_gradient_reaching_a_draws_inputs_compiles_and_equals_eager(name: str) -> None:
    """A random fill's values do not depend on its inputs: torch's derivatives give them zero gradients
    (not none), in eager code and compiled, in the mode and outside it."""
    fn = _GRADIENT_THROUGH_A_DRAW[name]

    def step(f: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        x = torch.linspace(-1, 1, 4).requires_grad_()
        y = f(x)
        y.sum().backward()
        return [y.detach(), x.grad]  # type: ignore[list-item]

    with portable_random(SEED):
        eager = [step(fn), step(fn)]
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    with portable_random(SEED):
        assert _equal(step(compiled), eager[0])
        assert _equal(step(compiled), eager[1])


_ATTENTION_CASES = {
    "bool-mask": ((2, 4, 16, 8), (2, 4, 12, 8), torch.float32, {"attn_mask": torch.rand(16, 12) > 0.3}),
    "causal-float64": ((2, 3, 8, 4), (2, 3, 8, 4), torch.float64, {"is_causal": True}),
    "grouped-query-heads": ((1, 4, 6, 8), (1, 2, 10, 8), torch.float32, {"enable_gqa": True}),
}


@pytest.mark.parametrize("case", list(_ATTENTION_CASES))
def test_compiled_attention_with_dropout_equals_eager_gradients_included(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    q_shape, kv_shape, dtype, options = _ATTENTION_CASES[case]
    torch.manual_seed(0)
    inputs = [torch.randn(q_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype)]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, **options)

    forwards: list[int] = []

    def step(fn: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        out = fn(q, k, v)
        before = len(forwards)
        (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view(out.shape)).sum().backward()
        assert len(forwards) == before, "the backward pass recomputed the attention's forward"
        return [out.detach(), q.grad, k.grad, v.grad]  # type: ignore[list-item]

    with portable_random(SEED):
        eager = [step(attend), step(attend)]
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    counted = attention._forward
    monkeypatch.setattr(attention, "_forward", lambda *a: forwards.append(1) or counted(*a))
    with portable_random(SEED):
        assert _equal(step(compiled), eager[0])
        assert _equal(step(compiled), eager[1])
    assert len(forwards) == 2, "one forward per compiled call"


def test_parameters_never_drawn_before_are_checked_outside_the_trace_without_a_graph_break() -> None:
    """Checking a draw's parameters rounds them with tensors; while tracing those were fake, and their
    value a data-dependent graph break (fullgraph=True refused the function)."""

    def draw() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.rand(5), torch.empty(3).normal_(0.3125, 2.71875)

    philox._uniform_draw.cache_clear()  # as in a process that never drew them: the checks run while tracing
    philox._normal_draw.cache_clear()
    compiled = torch.compile(draw, backend="aot_eager", fullgraph=True)
    with portable_random(SEED):
        got = compiled()
    with portable_random(SEED):
        assert _equal(got, draw())


def test_a_function_compiled_outside_the_mode_is_compiled_again_for_it_and_stays_torchs_outside() -> None:
    def draw(x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(4)

    compiled = torch.compile(draw, backend="aot_eager")
    x = torch.zeros(4)
    torch.manual_seed(7)
    outside = compiled(x)
    with portable_random(SEED):
        assert torch.equal(compiled(x), philox.uniform((4,), key=SEED, offset=0))
    torch.manual_seed(7)
    assert torch.equal(compiled(x), outside), "outside the mode compiled code keeps torch's numbers"


@pytest.mark.slow
def test_inductors_caches_never_hand_code_compiled_outside_the_mode_to_it_or_back() -> None:
    """A fresh process compiles with inductor outside the mode first (AOTAutograd caches the result by
    Dynamo's graph, the same in the mode), then in it, then outside again: each draws its own numbers."""
    script = textwrap.dedent(
        """
        import torch, hyperrng
        from hyperrng import philox
        def draw(x):
            return x + torch.rand(4)
        compiled, x = torch.compile(draw), torch.zeros(4)
        torch.manual_seed(7); outside = compiled(x)
        with hyperrng.portable_random(11):
            assert torch.equal(compiled(x), philox.uniform((4,), key=11, offset=0)), "outside code in the mode"
        torch._dynamo.reset()  # a new compilation outside the mode must not find the mode's code
        torch.manual_seed(7); assert torch.equal(torch.compile(draw)(x), outside), "the mode's code outside it"
        print("separate")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "separate" in result.stdout, result.stderr[-3000:]


def test_a_random_op_without_a_portable_kernel_is_refused_while_tracing_before_anything_draws() -> None:
    def draw(x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(2).sum() + torch.multinomial(torch.ones(4), 1)

    with portable_random(SEED):
        with pytest.raises(Exception) as caught:
            torch.compile(draw, backend="aot_eager", fullgraph=True)(torch.zeros(1))
        assert _position() == (SEED, 0), "a refusal while tracing runs nothing"
    cause: BaseException | None = caught.value
    while cause is not None and not isinstance(cause, UnsupportedPortableOpError):
        cause = cause.__cause__ or cause.__context__
    assert cause is not None and "multinomial" in str(cause)


def test_the_custom_ops_draw_torchs_numbers_outside_the_mode_but_in_a_compiled_recompute() -> None:
    """Only a compiled backward pass recomputing a draw (``run_with_rng_state``, tested with the compiled
    checkpoints below) draws portably outside the mode: it may run after the mode was left."""
    with portable_random(SEED):
        pass  # registers the custom ops
    torch.manual_seed(3)
    values, _ = torch.ops.hyperrng.uniform(torch.empty(6), 0.0, 1.0, torch.empty(0, dtype=torch.int64))
    torch.manual_seed(3)
    assert torch.equal(values, torch.empty(6).uniform_())


def _noise(n: int) -> torch.Tensor:
    return torch.rand(n) * 2


def _attention_of(n: int) -> torch.Tensor:
    q = torch.ones(1, 1, n, 4)
    return F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)


def test_code_compiled_in_the_mode_without_a_tensor_input_draws_torchs_numbers_outside_it() -> None:
    """torch.compile sees the mode only through its tensor inputs: code without any (a piece after a graph break
    that takes ints), compiled in the mode, runs again outside it. Before, it drew portable numbers there."""
    compiled = torch.compile(_noise, backend="aot_eager")
    with portable_random(SEED):
        assert torch.equal(compiled(5), philox.uniform((5,), key=SEED, offset=0) * 2)
    torch.manual_seed(7)
    got = (compiled(5), torch.rand(3))
    torch.manual_seed(7)
    assert all(torch.equal(a, b) for a, b in zip(got, (_noise(5), torch.rand(3)), strict=True))
    attend = torch.compile(_attention_of, backend="aot_eager")
    with portable_random(SEED):
        attend(4)
    before = torch.get_rng_state()
    with pytest.raises(UnsupportedPortableOpError, match="compiled in portable mode ran outside it"):
        attend(4)  # portable attention has no torch counterpart to run instead
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("where", ["checkpoint", "hook"])
def test_code_compiled_in_the_mode_run_outside_it_in_a_backward_pass_draws_torchs_numbers(where: str) -> None:
    """A recompute of a forward run outside the mode, or a backward hook: no compiled backward pass recomputes
    there (before, a backward pass drew portably: the gradient was not the forward's noise)."""
    compiled = torch.compile(_noise, backend="aot_eager")
    with portable_random(SEED):
        compiled(6)
        with torch.no_grad():
            compiled(6)  # traced without grad too: the hook runs without it
    x = torch.ones(6, requires_grad=True)
    torch.manual_seed(0)
    if where == "checkpoint":
        y = hyperrng.checkpoint(lambda t: t * compiled(6), x)
        y.sum().backward()
        assert x.grad is not None and torch.equal(x.grad, y.detach()), "the recompute drew the forward's noise"
        return
    drawn: list[torch.Tensor] = []
    y = x * 2
    y.register_hook(lambda g: drawn.append(compiled(6)) or g)  # type: ignore[func-returns-value]
    y.sum().backward()
    torch.manual_seed(0)
    assert torch.equal(drawn[0], _noise(6))


@pytest.mark.slow
def test_inductor_code_compiled_outside_the_mode_without_a_tensor_input_is_refused_in_it_with_the_remedy() -> None:
    compiled = torch.compile(_noise)
    compiled(5)
    with portable_random(SEED):
        with pytest.raises(UnsupportedPortableOpError, match=r"Compile it again inside the mode"):
            compiled(5)
        assert _position() == (SEED, 0)


def test_inductors_own_pattern_tracing_is_untouched_by_the_mode() -> None:
    """Inductor traces its patterns without a TracingContext: the substitution must not reach them."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx.experimental.proxy_tensor import make_fx

    def pattern(x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, 0.5) + torch.rand_like(x)

    with portable_random(SEED), enable_python_dispatcher():
        graph = make_fx(pattern)(torch.ones(3))
    assert not any("hyperrng" in str(node.target) for node in graph.graph.nodes)


# -- activation checkpoints -----------------------------------------------------------------------
def _block(lin: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    def block(x: torch.Tensor) -> torch.Tensor:
        return F.dropout(torch.relu(lin(x)), 0.5) * torch.rand_like(x)  # both draws needed by the backward

    return block


def _grads(wrap: Callable[..., torch.Tensor], backward_inside: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    x = torch.linspace(-2, 2, 128).view(8, 16).requires_grad_()
    with portable_random(SEED):
        y = wrap(_block(lin), x)
        if backward_inside:
            y.sum().backward()
    if not backward_inside:
        y.sum().backward()
    return [x.grad, lin.weight.grad]  # type: ignore[list-item]


def _wrapper(block: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    class Block(torch.nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return block(t)

    return checkpoint_wrapper(Block(), **kwargs)(x)  # type: ignore[no-any-return]


REPLAYING: dict[str, Callable[..., torch.Tensor]] = {
    "torch non-reentrant, context_fn": lambda f, x: torch_checkpoint(
        f, x, use_reentrant=False, context_fn=hyperrng.checkpoint_context
    ),
    "checkpoint_wrapper, context_fn": lambda f, x: _wrapper(f, x, context_fn=hyperrng.checkpoint_context),
    "hyperrng.checkpoint": lambda f, x: hyperrng.checkpoint(f, x),
}
UNREPLAYED: dict[str, Callable[..., torch.Tensor]] = {
    "torch reentrant": lambda f, x: torch_checkpoint(f, x, use_reentrant=True),
    "torch non-reentrant": lambda f, x: torch_checkpoint(f, x, use_reentrant=False),
    "checkpoint_wrapper": lambda f, x: _wrapper(f, x),
}


@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward-after-the-mode", "backward-in-it"])
@pytest.mark.parametrize("name", REPLAYING)
def test_a_replaying_checkpoint_gives_the_unchecked_gradients(name: str, backward_inside: bool) -> None:
    plain = _grads(lambda f, x: f(x), backward_inside)
    assert _equal(_grads(REPLAYING[name], backward_inside), plain)


@pytest.mark.parametrize("name", UNREPLAYED)
def test_a_checkpoint_whose_recompute_would_draw_other_numbers_is_refused_before_anything_moves(name: str) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    x = torch.ones(8, 16, requires_grad=True)
    with portable_random(SEED):
        with pytest.raises(UnsupportedPortableOpError, match="context_fn=hyperrng.checkpoint_context"):
            UNREPLAYED[name](_block(lin), x)
        assert _position() == (SEED, 0)


def test_draws_outside_a_checkpoint_and_in_its_recompute_are_not_refused() -> None:
    with portable_random(SEED):
        a = torch.rand(3)
        out = torch_checkpoint(lambda t: t * 2, torch.ones(3, requires_grad=True), use_reentrant=False)
        b = torch.rand(3)
    out.sum().backward()
    assert torch.equal(torch.cat([a, b]), torch.cat([philox.uniform((3,), key=SEED, offset=o) for o in (0, 4)]))


@pytest.mark.parametrize(
    "name",
    ["torch reentrant", "torch non-reentrant", "torch non-reentrant, context_fn", "hyperrng.checkpoint"],
)
def test_a_compiled_checkpoint_gives_the_unchecked_gradients_with_backward_after_the_mode(name: str) -> None:
    """Compiled, torch puts the generator back before a recompute and the custom ops draw portably on
    their own: every flavour works, whatever thread or mode the backward pass runs in."""
    wrap = {**REPLAYING, **UNREPLAYED}[name]
    plain = _grads(lambda f, x: f(x), False)
    compiled = torch.compile(lambda f, x: wrap(f, x), backend="aot_eager")
    assert _equal(_grads(compiled, False), plain)


# -- graph capture ----------------------------------------------------------------------------------
@pytest.mark.needs_sim
@pytest.mark.parametrize(
    "op",
    [
        lambda d: F.dropout(torch.ones(8, device=d), 0.5),
        lambda d: torch.rand(3, device=d),
        lambda d: torch.empty(4, device=d).bernoulli_(0.3),
        lambda d: F.scaled_dot_product_attention(*(torch.ones(1, 2, 4, 8, device=d),) * 3, dropout_p=0.5),
    ],
    ids=["dropout", "rand", "bernoulli_", "attention"],
)
def test_a_portable_draw_under_graph_capture_is_refused_and_moves_nothing(op: Callable[[Any], Any]) -> None:
    with platforms.use(platforms.SimulatedPlatform()) as sim:
        device = sim.device(0)
        with portable_random(SEED):
            with sim.module.graph(SimulatedGraph()):  # type: ignore[attr-defined]
                with pytest.raises(UnsupportedPortableOpError, match="captures a graph"):
                    op(device)
            assert sim.get_seed_offset() == (SEED, 0)
            assert torch.equal(torch.rand(3, device=device).cpu(), philox.uniform((3,), key=SEED, offset=0))


@pytest.mark.needs_sim
def test_the_backend_probe_never_runs_under_capture_and_then_runs_once() -> None:
    with platforms.use(platforms.SimulatedPlatform()) as sim:
        device_type = sim.device_type
        backends._PROBED.discard(device_type)
        backends._probe.cache_clear()
        with sim.module.graph(SimulatedGraph()):  # type: ignore[attr-defined]
            reason = backends._triton_refusal(device_type)
            assert reason is not None and "capturing" in reason
        assert device_type not in backends._PROBED, "nothing about the device was learnt or kept under capture"
        backends._triton_refusal(device_type)
        assert device_type in backends._PROBED


# -- devices that trace their ops ---------------------------------------------------------------------
@pytest.mark.slow
def test_a_devices_own_kernel_for_a_functional_random_op_never_runs_in_the_mode() -> None:
    """torch_xla implements ``bernoulli.p`` itself; in the mode torch's default (``bernoulli_`` on a new
    tensor) must run first, or the device draws its own numbers silently. A kernel that returns zeros
    on the CPU stands for the device's (in a process of its own: torch keeps a registration for good)."""
    script = textwrap.dedent(
        """
        import torch, hyperrng
        library = torch.library.Library("aten", "IMPL")
        library.impl("bernoulli.p", lambda self, p, generator=None: torch.zeros_like(self), "CPU")
        with hyperrng.portable_random(1234):
            drawn = torch.bernoulli(torch.empty(64), 0.5)
        with hyperrng.portable_random(1234):
            expected = torch.empty(64).bernoulli_(0.5)
        assert torch.equal(drawn, expected) and drawn.sum() > 0, drawn
        print("portable")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "portable" in result.stdout, result.stderr[-2000:]


def test_functionalized_random_ops_draw_portably() -> None:
    """Functionalization (torch_xla's, torch.compile's) turns bernoulli_ into bernoulli.p, which a device may
    implement itself: in the mode it runs as bernoulli_ on a new tensor, portably."""
    with portable_random(SEED):
        functional = torch.func.functionalize(lambda x: x.bernoulli_(0.5))(torch.empty(8))
    with portable_random(SEED):
        assert torch.equal(functional, torch.empty(8).bernoulli_(0.5))


def test_compiled_code_reports_whether_it_draws_portably() -> None:
    with portable_random(SEED):
        pass
    assert _traced.installed() is None


def _fake_and_real(name: str, *args: Any) -> tuple[Any, Any]:
    """``torch.ops.hyperrng.<name>``'s fake outputs (what compiled code is built on) and its real ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = getattr(torch.ops.hyperrng, name).default
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = op(*args)
    with portable_random(SEED):
        real = op(*args)
    return fake, real


def _layouts(outputs: Any) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [(tuple(t.shape), t.stride()) for t in outputs]


def _transposed_attention_inputs() -> tuple[torch.Tensor, ...]:
    """q, k, v laid out (batch, sequence, heads, dim) and viewed as (batch, heads, sequence, dim), as a
    model's projections give them: not contiguous."""
    q, k, v = (torch.randn(2, 8, 2, 16, dtype=torch.float32).transpose(1, 2) for _ in range(3))
    return q, k, v


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.needs_triton)])
def test_every_custom_op_returns_the_layout_its_fake_promises(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled code lays out buffers by the fake implementation and checks the real outputs against it
    (inductor's assert_size_stride): attention's backward on the Triton kernels (contiguous gradients for
    transposed inputs) once failed every compiled training step with attention dropout on a GPU."""
    if backend == "triton":  # the kernels through Triton's interpreter, on CPU tensors
        real_resolve = backends.resolve
        monkeypatch.setattr(backends, "resolve", lambda b, d: "triton" if b == "auto" else real_resolve(b, d))
    with portable_random(SEED):  # the first entry registers the custom ops
        pass
    q, k, v = _transposed_attention_inputs()
    link = torch.empty(0, dtype=torch.int64)
    fake, real = _fake_and_real("attention", q, k, v, None, 0.25, False, None, False, link)
    assert _layouts(fake[:2]) == _layouts(real[:2])
    out, lse, position = real
    grad = torch.randn(out.shape).transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous either
    args = (grad, q, k, v, None, out, lse, position, 0.25, False, None, False, False)
    fake, real = _fake_and_real("attention_backward", *args)
    assert _layouts(fake) == _layouts(real)
    x = torch.randn(6, 4).t()
    fake, real = _fake_and_real("native_dropout", x, 0.5, True, link)
    assert _layouts(fake[:2]) == _layouts(real[:2])
    for name, params in [("uniform", (0.0, 1.0)), ("normal", (0.0, 1.0)), ("bernoulli", (0.5,)), ("random", (0, 7))]:
        fake, real = _fake_and_real(name, x, *params, link)
        assert _layouts(fake[:1]) == _layouts(real[:1]), name


# -- on a real GPU (.ci/gpu) ---------------------------------------------------------------------------
def _cuda_draws(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (F.dropout(x, 0.3), torch.rand(1000, device=x.device), torch.randint(0, 7, (33,), device=x.device))


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_on_cuda_compiled_code_draws_what_eager_draws(cuda: platforms.Platform, mode: str) -> None:
    """Inductor on the GPU; with reduce-overhead the portable ops run outside its CUDA graphs."""
    x = torch.ones(64, 64, device="cuda")
    with portable_random(SEED):
        eager = [_cuda_draws(x) for _ in range(3)]
        normal = torch.randn(4096, device="cuda")
    compiled = torch.compile(_cuda_draws, mode=mode)
    with portable_random(SEED):
        for want in eager:  # the third call replays a recorded graph where reduce-overhead records one
            assert _equal(compiled(x), want)
        got = torch.compile(lambda: torch.randn(4096, device="cuda"), mode=mode)()
    assert torch.allclose(got, normal, rtol=0, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_on_cuda_compiled_attention_with_dropout_trains_on_projections_laid_out_as_models_do(
    cuda: platforms.Platform, mode: str
) -> None:
    """q, k, v as (batch, sequence, heads, dim) projections viewed per head: the Triton kernels' gradients
    have the layout the compiled graph was built for (this once failed every compiled step)."""

    def attend(x: torch.Tensor) -> torch.Tensor:
        q, k, v = ((x * s).view(2, 128, 4, 64).transpose(1, 2) for s in (1.0, 0.5, 0.25))
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1).transpose(1, 2).sum()

    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)
    grads = []
    for fn in (attend, torch.compile(attend, mode=mode)):
        with portable_random(SEED):
            for _ in range(2):
                leaf = x.clone().requires_grad_(True)
                fn(leaf).backward()
                grads.append(leaf.grad.float())
    for eager, compiled in zip(grads[:2], grads[2:]):
        assert torch.allclose(eager, compiled, rtol=2e-2, atol=2e-2)
    assert not torch.equal(grads[0], grads[1])  # a fresh mask at each call


@pytest.mark.cuda
def test_on_cuda_a_portable_draw_under_capture_is_refused_and_the_probe_waits(cuda: platforms.Platform) -> None:
    x = torch.ones(256, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with portable_random(SEED):
        with pytest.raises(UnsupportedPortableOpError, match="captures a graph"):
            with torch.cuda.graph(graph):
                F.dropout(x, 0.5)
        assert cuda.get_seed_offset() == (SEED, 0)
        assert torch.equal(F.dropout(x, 0.5).cpu(), philox.dropout(x.cpu(), 0.5, key=SEED, offset=0))
    assert backends.describe(torch.device("cuda"))[0] in ("triton", "torch")  # probed after capture, not during


def test_wide_ranges_compile_and_randperm_is_refused_with_fullgraph_and_drawn_eagerly_without() -> None:
    def wide() -> torch.Tensor:
        return torch.randint(-3, 2**40, (5,)) + torch.randint(0, 7, (2,)).sum()

    def permute() -> torch.Tensor:
        return torch.randperm(6) + 0

    with portable_random(SEED):
        expected = [wide(), permute()]
    with portable_random(SEED):
        assert torch.equal(torch.compile(wide, backend="aot_eager", fullgraph=True)(), expected[0])
        assert torch.equal(torch.compile(permute, backend="aot_eager")(), expected[1]), "behind a graph break"

    def permute_again() -> torch.Tensor:  # another code object: Dynamo would reuse permute's compiled frames
        return torch.randperm(6) + 0

    with portable_random(SEED), pytest.raises(Exception) as caught:
        torch.compile(permute_again, backend="aot_eager", fullgraph=True)()
    cause: BaseException | None = caught.value
    while cause is not None and not isinstance(cause, UnsupportedPortableOpError):
        cause = cause.__cause__ or cause.__context__
    assert cause is not None and "randperm inside compiled code" in str(cause)
