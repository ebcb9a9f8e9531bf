"""Activation recompute: the backward pass replays the forward's random numbers, bit for bit, and leaves no trace."""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
import torch.utils.checkpoint

import hyperrng
from hyperrng.errors import HyperRNGError, InvalidOperationError, UnsupportedPortableOpError
from hyperrng.streams._checkpoints import REPLAYED
from hyperrng.streams.recompute import checkpoint
from hyperrng.streams.tracker import MODEL_PARALLEL_STREAM, RNGStatesTracker, get_rng_tracker
from tests._platforms import PLATFORMS, draw, fresh_tracker_on_cpu, use_each

MP = MODEL_PARALLEL_STREAM


platform = use_each(PLATFORMS)
_fresh = fresh_tracker_on_cpu  # autouse: imported fixtures apply to this module


def tensor_device() -> torch.device:
    """Where the model lives: the platform's device where it has tensors, else (a stand-in) the host."""
    plat = platforms.current()
    return plat.device() if plat.device_type in ("cpu", platforms.SIM_DEVICE_TYPE) else torch.device("cpu")


def device_mask(like: torch.Tensor, p: float) -> torch.Tensor:
    """An inverted-dropout mask drawn from the current device generator (a fork's stream inside a fork)."""
    u = draw(platforms.current(), like.numel()).reshape(like.shape).to(like.device)
    return (u >= p).float() / (1.0 - p)


class Block(torch.nn.Module):
    """A layer that draws from a tracker stream, from the device's default generator and from torch's CPU one.

    Its dropout runs on its tensors' device: inside the fork it draws from the stream.
    """

    def __init__(self, tracker: RNGStatesTracker | None = None) -> None:
        super().__init__()
        self.up = torch.nn.Linear(6, 12)
        self.down = torch.nn.Linear(12, 6)
        self.tracker = tracker
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.relu(self.up(x))
        with (self.tracker if self.tracker is not None else get_rng_tracker()).fork(MP):  # tensor-parallel dropout
            h = h * device_mask(h, 0.3)
            h = F.dropout(h, 0.1)
        h = h * device_mask(h, 0.2)  # the device's default generator
        h = h + 0.01 * torch.rand(h.shape).to(h.device)  # the host generator, on every platform
        return self.down(F.dropout(h, 0.2))


def generator_states(tracker: RNGStatesTracker) -> dict[str, Any]:
    p = platforms.current()
    return {
        "cpu": torch.get_rng_state(),
        "devices": [p.get_rng_state(i) for i in range(p.device_count())],
        "streams": tracker.get_states(as_tensors=True),
    }


def assert_equal_states(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert torch.equal(a["cpu"], b["cpu"])
    assert len(a["devices"]) == len(b["devices"])
    assert all(torch.equal(x, y) for x, y in zip(a["devices"], b["devices"]))
    assert a["streams"].keys() == b["streams"].keys()
    assert all(torch.equal(a["streams"][k], b["streams"][k]) for k in a["streams"])


def train_step(recompute: Callable[..., Any] | None, tracker: RNGStatesTracker | None = None) -> dict[str, Any]:
    """Two blocks, a draw between forward and backward, one backward; everything a comparison needs."""
    streams = tracker if tracker is not None else get_rng_tracker()
    device = tensor_device()  # first: torch.manual_seed seeds the devices that exist
    torch.manual_seed(0)
    blocks = [Block(tracker).to(device), Block(tracker).to(device)]
    streams.reseed({MP: 4321})
    platforms.current().manual_seed(99)
    x = torch.randn(5, 6).to(device).requires_grad_()
    h = x
    for block in blocks:
        h = recompute(block, h) if recompute else block(h)
    out = F.dropout(h, 0.5)  # after the forward, before the backward: the recompute must not replay this
    after_forward = generator_states(streams)
    (out**2).sum().backward()
    return {
        "out": out.detach().cpu(),
        "grads": [g.cpu() for g in [x.grad] + [p.grad for b in blocks for p in b.parameters()] if g is not None],
        "after_forward": after_forward,
        "after_backward": generator_states(streams),
        "calls": [b.calls for b in blocks],
    }


def ours(tracker: RNGStatesTracker | None = None) -> Callable[..., Any]:
    return lambda block, h: checkpoint(block, h, tracker=tracker)


def test_gradients_and_generators_equal_those_of_the_run_without_recompute(platform: platforms.Platform) -> None:
    plain = train_step(None)
    recomputed = train_step(ours())
    assert recomputed["calls"] == [2, 2], "each block ran again in the backward pass"
    assert torch.equal(recomputed["out"], plain["out"])
    assert all(torch.equal(a, b) for a, b in zip(recomputed["grads"], plain["grads"], strict=True))
    assert_equal_states(recomputed["after_forward"], plain["after_forward"])
    assert_equal_states(recomputed["after_backward"], plain["after_backward"])
    assert_equal_states(recomputed["after_backward"], recomputed["after_forward"])  # the backward drew nothing


def test_the_tracker_passed_is_the_one_replayed(platform: platforms.Platform) -> None:
    get_rng_tracker().reseed({MP: 1})  # a decoy: same stream name, other seed
    decoy = get_rng_tracker().get_states(as_tensors=True)[MP]
    mine = RNGStatesTracker()
    plain = train_step(None, mine)
    recomputed = train_step(ours(mine), mine)
    assert all(torch.equal(a, b) for a, b in zip(recomputed["grads"], plain["grads"], strict=True))
    assert_equal_states(recomputed["after_backward"], plain["after_backward"])
    assert torch.equal(get_rng_tracker().get_states(as_tensors=True)[MP], decoy)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    "reentrant",
    [True, False],
    ids=["reentrant", "non-reentrant"],
)
def test_a_fork_inside_torch_checkpoint_without_the_context_is_refused_before_it_moves_a_stream(
    reentrant: bool, compiled: bool
) -> None:
    """Torch restores its own generators before a recompute, not the streams: without the context the
    recompute would draw other masks and the gradients would silently differ."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    def theirs(block: Block, h: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint(block, h, use_reentrant=reentrant)  # type: ignore[no-any-return]

    tracker = get_rng_tracker()
    tracker.reseed({MP: 4321})
    block = Block()
    before = generator_states(tracker)
    flavour = f"use_reentrant={reentrant}"
    with pytest.raises(InvalidOperationError, match=rf"inside torch.utils.checkpoint \({flavour}\) without hyperrng"):
        (torch.compile(theirs, backend="aot_eager") if compiled else theirs)(
            block, torch.ones(5, 6, requires_grad=True)
        )
    assert_equal_states(generator_states(tracker), before)


def test_a_fork_in_a_checkpoint_without_the_context_nested_in_one_with_it_is_refused() -> None:
    """The innermost checkpoint decides: the outer one would replay the streams, the inner one, whose
    recompute runs first, would not (on torch 2.5 to 2.7 too, where the checkpoints are told apart by their calls)."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    block = Block()

    def outer(h: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint(block, h, use_reentrant=False)  # type: ignore[no-any-return]

    tracker = get_rng_tracker()
    tracker.reseed({MP: 4321})
    before = generator_states(tracker)
    with pytest.raises(InvalidOperationError, match=r"inside torch.utils.checkpoint \(use_reentrant=False\)"):
        torch_checkpoint(
            outer, torch.ones(5, 6, requires_grad=True), use_reentrant=False, context_fn=hyperrng.checkpoint_context
        )
    assert_equal_states(generator_states(tracker), before)
    gc.collect()  # torch 2.5 leaves a forward that raised only when its checkpoint's generator is collected
    assert REPLAYED.hooks == [], "the refused forward's context was left: nothing of it is held"
    replayed = torch_checkpoint(  # and the same block checkpointed once, with the context, runs
        block, torch.ones(5, 6, requires_grad=True), use_reentrant=False, context_fn=hyperrng.checkpoint_context
    )
    replayed.sum().backward()


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_fork_far_below_the_checkpoint_without_the_context_is_refused(reentrant: bool) -> None:
    """However deep the block calls its fork (100 frames here: a model of nested modules): the stack is walked
    to its end, not to a fixed depth, where the checkpoint is found that way."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    block = Block()

    def deep(n: int, h: torch.Tensor) -> torch.Tensor:
        return block(h) if n == 0 else deep(n - 1, h)

    tracker = get_rng_tracker()
    tracker.reseed({MP: 4321})
    before = generator_states(tracker)
    with pytest.raises(InvalidOperationError, match=rf"inside torch.utils.checkpoint \(use_reentrant={reentrant}\)"):
        torch_checkpoint(functools.partial(deep, 100), torch.ones(5, 6, requires_grad=True), use_reentrant=reentrant)
    assert_equal_states(generator_states(tracker), before)


def test_use_reentrant_is_read_as_torch_reads_it() -> None:
    """Any false value runs torch's non-reentrant checkpoint (``use_reentrant=0`` too): a fork inside it without
    the context is refused, as with ``False``."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    get_rng_tracker().reseed({MP: 4321})
    with pytest.raises(InvalidOperationError, match=r"inside torch.utils.checkpoint \(use_reentrant=False\)"):
        torch_checkpoint(Block(), torch.ones(5, 6, requires_grad=True), use_reentrant=0)


@pytest.mark.parametrize("context", [False, True], ids=["plain", "context"])
def test_a_fork_runs_in_a_checkpoint_begun_without_grad_that_turns_grad_on(context: bool) -> None:
    """A non-reentrant checkpoint called under ``no_grad`` saves nothing and recomputes nothing, even where
    its function turns grad on: the fork inside runs and draws what it draws without the checkpoint."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    block = Block()

    def with_grad(h: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            return block(h)  # type: ignore[no-any-return]

    extra = {"context_fn": hyperrng.checkpoint_context} if context else {}
    outputs = []
    for checkpointed in (False, True):
        get_rng_tracker().reseed({MP: 4321})
        torch.manual_seed(5)
        with torch.no_grad():
            h = torch.ones(5, 6)
            outputs.append(
                torch_checkpoint(with_grad, h, use_reentrant=False, **extra) if checkpointed else with_grad(h)
            )
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # torch's, meant here
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_fork_inside_torch_checkpoint_runs_where_no_backward_will_recompute_it(reentrant: bool) -> None:
    """Evaluation under no_grad with the checkpoint wrapper still applied: nothing to replay, nothing refused."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    block = Block()
    with torch.no_grad():
        get_rng_tracker().reseed({MP: 4321})
        torch.manual_seed(5)
        plain = block(torch.ones(5, 6))
        get_rng_tracker().reseed({MP: 4321})
        torch.manual_seed(5)
        assert torch.equal(torch_checkpoint(block, torch.ones(5, 6), use_reentrant=reentrant), plain)


REPLAYING = {
    "hyperrng.checkpoint": lambda block, h: checkpoint(block, h),
    "torch, context_fn": lambda block, h: torch.utils.checkpoint.checkpoint(
        block, h, use_reentrant=False, context_fn=hyperrng.checkpoint_context
    ),
}


@pytest.mark.parametrize(
    ("backend", "portable"),
    [("aot_eager", False), ("inductor", False), pytest.param("aot_eager", True, marks=pytest.mark.needs_portable_mode)],
)
@pytest.mark.parametrize("name", list(REPLAYING))
def test_a_compiled_recompute_with_a_fork_inside_gives_the_gradients_of_no_checkpoint(
    name: str, backend: str, portable: bool
) -> None:
    mode = hyperrng.portable_random(7) if portable else contextlib.nullcontext()
    with mode:
        plain = train_step(None)
    wrap = REPLAYING[name]
    compiled = torch.compile(lambda block, h: wrap(block, h), backend=backend)
    with mode:
        recomputed = train_step(compiled)
    assert recomputed["calls"] == [2, 2], "each block ran again in the backward pass"
    assert all(torch.equal(a, b) for a, b in zip(recomputed["grads"], plain["grads"], strict=True))
    assert_equal_states(recomputed["after_backward"], plain["after_backward"])


def test_non_tensor_arguments_pass_through_to_both_runs() -> None:
    seen: list[tuple[Any, ...]] = []
    options = {"mode": "train"}

    def scaled(x: torch.Tensor, scale: float, label: str, opts: dict[str, str], nothing: None) -> torch.Tensor:
        seen.append((scale, label, opts, nothing))
        return x * scale

    x = torch.ones(3, requires_grad=True)
    checkpoint(scaled, x, 2.5, "block-0", options, None).sum().backward()
    assert len(seen) == 2
    assert all(s == (2.5, "block-0", options, None) and s[2] is options for s in seen)
    assert x.grad is not None and torch.equal(x.grad, torch.full((3,), 2.5))


def test_tuple_outputs_get_their_gradients() -> None:
    get_rng_tracker().reseed({MP: 7})

    def two(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with get_rng_tracker().fork(MP):
            return F.dropout(x * w, 0.5), x + w

    def grads(recompute: bool) -> list[torch.Tensor]:
        get_rng_tracker().reseed({MP: 7})
        x, w = torch.ones(4, requires_grad=True), torch.full((4,), 3.0, requires_grad=True)
        a, b = checkpoint(two, x, w) if recompute else two(x, w)
        (a.sum() + 2 * b.sum()).backward()
        assert x.grad is not None and w.grad is not None
        return [x.grad, w.grad]

    assert all(torch.equal(a, b) for a, b in zip(grads(True), grads(False), strict=True))


def test_an_exception_in_the_forward_propagates_and_leaves_no_fork_open() -> None:
    get_rng_tracker().reseed({MP: 7})

    def broken(x: torch.Tensor) -> torch.Tensor:
        with get_rng_tracker().fork(MP):
            raise ValueError("bad shape")

    with pytest.raises(ValueError, match="bad shape"):
        checkpoint(broken, torch.ones(2, requires_grad=True))
    assert get_rng_tracker().active_stream is None


def test_an_exception_in_the_recompute_propagates_and_the_generators_are_put_back() -> None:
    get_rng_tracker().reseed({MP: 7})
    calls = []

    def fails_the_second_time(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        with get_rng_tracker().fork(MP):
            y = F.dropout(x, 0.5)
        if len(calls) == 2:
            raise RuntimeError("recompute failed")
        return y

    y = checkpoint(fails_the_second_time, torch.ones(8, requires_grad=True))
    torch.rand(2)
    before = generator_states(get_rng_tracker())
    with pytest.raises(RuntimeError, match="recompute failed"):
        y.sum().backward()
    assert_equal_states(generator_states(get_rng_tracker()), before)
    assert get_rng_tracker().active_stream is None


def test_parameters_inside_get_gradients_when_no_input_requires_grad() -> None:
    get_rng_tracker().reseed({MP: 7})
    torch.manual_seed(0)
    block = Block()
    data = torch.randn(5, 6)  # raw input data never requires grad
    checkpoint(block, data).sum().backward()
    assert all(p.grad is not None for p in block.parameters())


def test_torch_checkpoint_replays_a_sharded_regions_dropout_on_the_cpu() -> None:
    """torch.utils.checkpoint restores torch's CPU bytes alone; the position is read back from them."""
    from torch.distributed.tensor import Shard

    from hyperrng.sharding.tracker import MeshInfo, ShardedRNGTracker

    with platforms.use(platforms.CPUPlatform()):
        sharded = ShardedRNGTracker()
        mesh = MeshInfo((2,), (1,))

        def layer(x: torch.Tensor) -> torch.Tensor:
            with sharded.distribute_region(mesh, [Shard(0)], (2 * x.shape[0], x.shape[1])):
                return F.dropout(x, 0.5) * 3.0

        def run(recompute: bool) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
            sharded.manual_seed(11)
            layer(torch.ones(16, 8))  # the checkpointed op starts past offset 0, at a tagged position
            x = torch.ones(16, 8, requires_grad=True)
            y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
            y.sum().backward()
            assert x.grad is not None
            return y.detach(), x.grad, platforms.current().get_seed_offset()

        plain, recomputed = run(False), run(True)
    assert torch.equal(plain[0], recomputed[0])
    assert torch.equal(plain[1], recomputed[1]), "the recompute must draw the forward's mask"
    assert plain[2] == recomputed[2]


def _dropout_layer(t: torch.Tensor) -> torch.Tensor:
    return F.dropout(t, p=0.5, training=True) * 3.0


def _portable_first_op(x: torch.Tensor) -> torch.Tensor:
    """:func:`_dropout_layer` of ``x`` as the first op at portable position (11, 0)."""
    import hyperrng

    with hyperrng.portable_random(11):
        return _dropout_layer(x.detach()).detach()


@pytest.mark.needs_portable_mode
def test_a_recompute_after_portable_mode_has_exited_draws_the_forwards_portable_numbers() -> None:
    import hyperrng

    x = torch.ones(64, requires_grad=True)
    layer = _dropout_layer
    expected = _portable_first_op(x)  # the portable mask of the first op at (11, 0)
    with hyperrng.portable_random(11):
        out = checkpoint(layer, x)
    assert torch.equal(out.detach(), expected)
    out.sum().backward()  # the recompute runs here, after the context: it must draw portably again
    assert torch.equal(x.grad, (expected != 0).float() * 2.0 * 3.0)


# -- torch.utils.checkpoint with hyperrng.checkpoint_context ---------------------------------------
def torch_with_context(inner: Callable[[], Any] | None = None, **kwargs: Any) -> Callable[..., Any]:
    """``torch.utils.checkpoint`` with hyperrng's context, composed with ``inner()``'s pair where given
    (a context_fn: a fresh pair for every call)."""

    def context_fn() -> Any:
        return hyperrng.checkpoint_context(inner() if inner is not None else None, **kwargs)

    return lambda block, h: torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False, context_fn=context_fn)


def test_torch_checkpoint_with_the_context_replays_the_streams_like_no_checkpoint(
    platform: platforms.Platform,
) -> None:
    plain = train_step(None)
    recomputed = train_step(
        lambda block, h: torch.utils.checkpoint.checkpoint(
            block, h, use_reentrant=False, context_fn=hyperrng.checkpoint_context
        )
    )
    assert recomputed["calls"] == [2, 2], "each block ran again in the backward pass"
    assert torch.equal(recomputed["out"], plain["out"])
    assert all(torch.equal(a, b) for a, b in zip(recomputed["grads"], plain["grads"], strict=True))
    assert_equal_states(recomputed["after_forward"], plain["after_forward"])
    assert_equal_states(recomputed["after_backward"], plain["after_backward"])


def test_the_context_replays_the_tracker_it_is_given(platform: platforms.Platform) -> None:
    mine = RNGStatesTracker()
    plain = train_step(None, mine)
    recomputed = train_step(torch_with_context(tracker=mine), mine)
    assert all(torch.equal(a, b) for a, b in zip(recomputed["grads"], plain["grads"], strict=True))
    assert_equal_states(recomputed["after_backward"], plain["after_backward"])


def test_checkpoint_wrapper_with_the_context_replays_the_streams() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain = train_step(None)
    recomputed = train_step(lambda block, h: checkpoint_wrapper(block, context_fn=hyperrng.checkpoint_context)(h))
    assert recomputed["calls"] == [2, 2]
    assert all(torch.equal(a, b) for a, b in zip(recomputed["grads"], plain["grads"], strict=True))


class _Forward(torch.nn.Module):
    """``f`` as a module's forward pass (the composable checkpoint takes modules)."""

    def __init__(self, f: Callable[..., Any]) -> None:
        super().__init__()
        self.f = f

    def forward(self, *args: Any) -> Any:
        return self.f(*args)


def composable(block: torch.nn.Module, h: torch.Tensor, **kwargs: Any) -> Any:
    """``block(h)`` under ``torch.distributed._composable.checkpoint`` (given ``kwargs``), applied to it now."""
    from torch.distributed._composable import checkpoint as composable_checkpoint

    return composable_checkpoint(block, **kwargs)(h)


def test_the_composable_checkpoint_with_the_context_replays_the_streams() -> None:
    plain = train_step(None)
    recomputed = train_step(functools.partial(composable, context_fn=hyperrng.checkpoint_context))
    assert recomputed["calls"] == [2, 2]
    assert torch.equal(recomputed["out"], plain["out"])
    assert all(torch.equal(a, b) for a, b in zip(recomputed["grads"], plain["grads"], strict=True))
    assert_equal_states(recomputed["after_backward"], plain["after_backward"])


def test_a_fork_inside_the_composable_checkpoint_without_the_context_is_refused_before_it_moves_a_stream() -> None:
    """Its module's call stands for its checkpoint call: on torch 2.5 to 2.7 the fork ran, and the recompute
    forked the stream where it then was (other gradients, silently)."""
    tracker = get_rng_tracker()
    tracker.reseed({MP: 4321})
    block = Block()
    before = generator_states(tracker)
    with pytest.raises(InvalidOperationError, match=r"inside torch.utils.checkpoint \(use_reentrant=False\)"):
        composable(block, torch.ones(5, 6, requires_grad=True))
    assert_equal_states(generator_states(tracker), before)
    gc.collect()
    assert REPLAYED.hooks == []
    with torch.no_grad():  # no backward will follow: the fork runs
        composable(Block(), torch.ones(5, 6))


class _NoGradInside(torch.nn.Module):
    """A block that draws a mask under ``no_grad`` in its forward (in a fork, or in portable mode), used with grad."""

    def __init__(self, fork: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.fork = fork

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        with torch.no_grad(), get_rng_tracker().fork(MP) if self.fork else contextlib.nullcontext():
            keep = torch.rand_like(h) > 0.5
        return (h * keep) ** 2


@pytest.mark.parametrize(
    "fork", [True, pytest.param(False, marks=pytest.mark.needs_portable_mode)], ids=["fork", "portable"]
)
@pytest.mark.parametrize("flavour", ["torch non-reentrant", "composable"])
def test_a_draw_under_no_grad_inside_a_checkpoints_forward_is_refused(flavour: str, fork: bool) -> None:
    """Its recompute reruns the block, grad off inside included (before, such a draw ran: other gradients)."""
    block = _NoGradInside(fork)
    tracker = get_rng_tracker()
    tracker.reseed({MP: 4321})
    x = torch.ones(4, 8, requires_grad=True)
    before = generator_states(tracker)
    with hyperrng.portable_random(5) if not fork else contextlib.nullcontext():
        with pytest.raises(HyperRNGError, match=r"inside torch.utils.checkpoint \(use_reentrant=False\)"):
            if flavour == "composable":
                composable(block, x)
            else:
                torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    assert_equal_states(generator_states(tracker), before)


def test_the_context_composes_with_selective_activation_checkpointing(platform: platforms.Platform) -> None:
    sac = pytest.importorskip("torch.utils.checkpoint")
    if not hasattr(sac, "create_selective_checkpoint_contexts"):
        pytest.skip(f"torch {torch.__version__} has no selective activation checkpointing")
    saved_ops = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]  # the matmuls kept, the rest recomputed
    plain = train_step(None)
    recomputed = train_step(torch_with_context(lambda: sac.create_selective_checkpoint_contexts(saved_ops)))
    assert recomputed["calls"] == [2, 2]
    assert all(torch.equal(a, b) for a, b in zip(recomputed["grads"], plain["grads"], strict=True))
    assert_equal_states(recomputed["after_backward"], plain["after_backward"])


def test_the_context_replays_a_sharded_region_and_a_fork_inside_one_block(platform: platforms.Platform) -> None:
    from torch.distributed.tensor import Shard

    from hyperrng.sharding.tracker import MeshInfo, ShardedRNGTracker

    sharded = ShardedRNGTracker()
    device = tensor_device()

    def layer(x: torch.Tensor) -> torch.Tensor:
        with sharded.distribute_region(MeshInfo((2,), (1,)), [Shard(0)], (2 * x.shape[0], x.shape[1])):
            x = x * device_mask(x, 0.5)
        with get_rng_tracker().fork(MP):
            return x * device_mask(x, 0.25)

    def run(recompute: bool) -> torch.Tensor:
        sharded.manual_seed(11)
        get_rng_tracker().reseed({MP: 5})
        x = torch.ones(16, 8, device=device, requires_grad=True)
        layer(x.detach())  # the checkpointed ops start past offset 0
        if recompute:
            y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False, context_fn=hyperrng.checkpoint_context)
        else:
            y = layer(x)
        y.sum().backward()
        assert x.grad is not None
        return x.grad.cpu()

    assert torch.equal(run(True), run(False))


@pytest.mark.needs_portable_mode
def test_the_context_recomputes_in_portable_mode_after_the_mode_has_exited() -> None:
    x = torch.ones(64, requires_grad=True)
    layer = _dropout_layer
    expected = _portable_first_op(x)
    with hyperrng.portable_random(11):
        out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False, context_fn=hyperrng.checkpoint_context)
    out.sum().backward()  # torch's recompute, after the context: the mask must be the forward's portable one
    assert torch.equal(x.grad, (expected != 0).float() * 2.0 * 3.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "contexts", [(), "ab", (None, None), [object(), object()]], ids=["empty", "str", "nones", "list"]
)
def test_the_context_refuses_what_is_not_a_pair_of_context_managers(contexts: Any) -> None:
    from hyperrng.errors import ArgumentTypeError

    with pytest.raises(ArgumentTypeError, match="a pair of context managers"):
        hyperrng.checkpoint_context(contexts)


@pytest.mark.cuda
def test_on_cuda_recompute_replays_dropout_in_a_fork_exactly() -> None:
    def grads(recompute: Callable[..., Any] | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layer = torch.nn.Linear(64, 64).cuda()
        get_rng_tracker().reseed({MP: 4321})
        torch.cuda.manual_seed(99)

        def block(h: torch.Tensor) -> torch.Tensor:
            with get_rng_tracker().fork(MP):  # tensor-parallel dropout: the stream's masks
                h = F.dropout(torch.relu(layer(h)), 0.3)
            return F.dropout(h, 0.2)  # the default generator's mask

        x = torch.randn(32, 64, device="cuda", requires_grad=True)
        out = recompute(block, x) if recompute is not None else block(x)
        (out**2).sum().backward()
        return [x.grad, *(p.grad for p in layer.parameters())]  # type: ignore[list-item]

    with platforms.use(platforms.CUDAPlatform()):
        saved = torch.cuda.get_rng_state()
        try:
            plain = grads(None)
            for recompute in (
                lambda block, h: checkpoint(block, h),
                lambda block, h: torch.utils.checkpoint.checkpoint(
                    block, h, use_reentrant=False, context_fn=hyperrng.checkpoint_context
                ),
            ):
                assert all(torch.equal(a, b) for a, b in zip(grads(recompute), plain, strict=True))
        finally:
            torch.cuda.set_rng_state(saved)


# -- a recompute draws in the mode its forward pass ran in ---------------------------------------------
_W = torch.linspace(-1, 1, 64).view(8, 8)
_X = torch.linspace(-2, 2, 32).view(4, 8)

FLAVOURS: dict[str, Callable[..., Any]] = {
    "hyperrng.checkpoint": lambda f, x: checkpoint(f, x),
    "context_fn": lambda f, x: torch.utils.checkpoint.checkpoint(
        f, x, use_reentrant=False, context_fn=hyperrng.checkpoint_context
    ),
}
FLAVOURS["composable context_fn"] = lambda f, x: composable(_Forward(f), x, context_fn=hyperrng.checkpoint_context)
UNREPLAYED: dict[str, Callable[..., Any]] = {  # torch puts its generators back; hyperrng replays nothing
    "composable": lambda f, x: composable(_Forward(f), x),
    "torch non-reentrant": lambda f, x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False),
    "torch reentrant": lambda f, x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=True),
    "compiled (aot_eager)": lambda f, x: torch.compile(
        lambda t: torch.utils.checkpoint.checkpoint(f, t, use_reentrant=False), backend="aot_eager"
    )(x),
}


def _backward_in_the_mode(
    wrap: Callable[..., Any] | None, block: Callable[..., Any]
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``block``'s gradient for its weight, forward outside portable mode and backward inside it; the states after."""
    w = _W.clone().requires_grad_()
    x = _X.clone().requires_grad_()
    torch.manual_seed(1)
    y = wrap(functools.partial(block, w), x) if wrap is not None else block(w, x)
    with hyperrng.portable_random(7):
        y.sum().backward()
    assert w.grad is not None
    return w.grad, generator_states(get_rng_tracker())


def _torch_dropout(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.dropout(x @ w, 0.5)


def _torch_attention(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    q = (x @ w).view(1, 2, 4, 4)
    return F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)  # taken over above portable mode's key


def _portable_dropout_inside(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    with hyperrng.portable_random(11):  # the block enters the mode itself: its recompute must too
        return F.dropout(x @ w, 0.5)


def _dropout_under_save_on_cpu(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    with torch.autograd.graph.save_on_cpu():  # a saved-tensor hook of its own, above the checkpoint's
        mask = torch.rand_like(x)
    return torch.relu((x * mask) @ w)


def _dropout_with_grad_turned_on(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():  # on again inside a reentrant checkpoint's forward, which runs without it
        return F.dropout(x @ w, 0.5)


HIDING_BLOCKS = [_dropout_under_save_on_cpu, _dropout_with_grad_turned_on]
"""Blocks that once hid their checkpoint from the refusal: drawn portably in the forward pass, torch's numbers in
the recompute, the gradients silently other."""


@pytest.mark.needs_portable_mode
@pytest.mark.parametrize(
    "block", [_torch_dropout, _torch_attention, *HIDING_BLOCKS], ids=["dropout", "attention", "save_on_cpu", "grad on"]
)
@pytest.mark.parametrize("name", [*FLAVOURS, *UNREPLAYED])
def test_a_forward_outside_portable_mode_is_recomputed_outside_it_by_a_backward_inside_it(
    name: str, block: Callable[..., Any]
) -> None:
    if name.startswith("compiled"):
        torch._dynamo.reset()
    plain, plain_after = _backward_in_the_mode(None, block)
    grad, after = _backward_in_the_mode({**FLAVOURS, **UNREPLAYED}[name], block)
    assert torch.equal(grad, plain)
    assert_equal_states(after, plain_after)


@pytest.mark.needs_portable_mode
@pytest.mark.parametrize("name", FLAVOURS)
def test_a_block_that_enters_portable_mode_itself_is_recomputed_in_it_by_a_backward_in_another(name: str) -> None:
    plain, plain_after = _backward_in_the_mode(None, _portable_dropout_inside)
    grad, after = _backward_in_the_mode(FLAVOURS[name], _portable_dropout_inside)
    assert torch.equal(grad, plain)
    assert_equal_states(after, plain_after)
    assert not hyperrng.is_portable_random_enabled()


@pytest.mark.needs_portable_mode
@pytest.mark.parametrize("block", HIDING_BLOCKS, ids=["save_on_cpu", "grad on"])
@pytest.mark.parametrize("preserve", [True, False], ids=["rng preserved", "not preserved"])
@pytest.mark.parametrize("name", [*FLAVOURS, *UNREPLAYED])
def test_a_forward_in_the_mode_hidden_from_its_checkpoint_is_replayed_or_refused(
    name: str, block: Callable[..., Any], preserve: bool
) -> None:
    """A block whose draw sits under a saved-tensor hook of its own, or turns grad back on inside a reentrant
    checkpoint, forward and backward in the mode: the unchecked block's gradient and states, or a typed refusal
    before anything moves, never other numbers. A compiled checkpoint replays where Dynamo traced the block, and
    runs eagerly, refused as the eager one, where the block breaks its graph (``save_on_cpu``)."""
    if name.startswith("compiled"):
        torch._dynamo.reset()
    wrap = {**FLAVOURS, **UNREPLAYED}[name]

    def run(checked: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        w, x = _W.clone().requires_grad_(), _X.clone().requires_grad_()
        torch.manual_seed(1)
        with hyperrng.portable_random(7):
            if checked and not preserve and name.startswith("torch"):
                kind = name == "torch reentrant"
                y = torch.utils.checkpoint.checkpoint(
                    functools.partial(block, w), x, use_reentrant=kind, preserve_rng_state=False
                )
            else:
                y = wrap(functools.partial(block, w), x) if checked else block(w, x)
            y.sum().backward()
        assert w.grad is not None
        return w.grad, generator_states(get_rng_tracker())

    plain, plain_after = run(False)
    torch.manual_seed(1)
    before = generator_states(get_rng_tracker())
    try:
        grad, after = run(True)
    except UnsupportedPortableOpError:
        assert name in UNREPLAYED, f"{name} replays hyperrng's draws: refused"
        assert_equal_states(generator_states(get_rng_tracker()), before)
        return
    assert name in FLAVOURS or name.startswith("compiled"), f"{name} replays nothing of hyperrng's, yet drew"
    assert torch.equal(grad, plain)
    assert_equal_states(after, plain_after)


# -- hyperrng.checkpoint: what its reentrant backward cannot serve is refused -------------------------
def _forked_dropout(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    with get_rng_tracker().fork(MP):
        return F.dropout(torch.tanh(x @ w), 0.5)


@pytest.mark.parametrize("call", ["autograd.grad", "backward(inputs=)"])
def test_a_backward_for_some_inputs_only_is_refused_before_the_recompute_moves_anything(call: str) -> None:
    get_rng_tracker().reseed({MP: 7})
    w, x = _W.clone().requires_grad_(), _X.clone().requires_grad_()
    calls: list[int] = []

    def block(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return _forked_dropout(w, t)

    y = checkpoint(block, x)
    before = generator_states(get_rng_tracker())
    with pytest.raises(InvalidOperationError, match="use_reentrant=False, context_fn=hyperrng.checkpoint_context"):
        if call == "autograd.grad":
            torch.autograd.grad(y.sum(), x)
        else:
            y.sum().backward(inputs=[x])
    assert calls == [1], "no recompute ran"
    assert w.grad is None and x.grad is None, "nothing was accumulated into an inner leaf"
    assert_equal_states(generator_states(get_rng_tracker()), before)


@pytest.mark.parametrize(
    "shape",
    [lambda t: [t], lambda t: {"out": t}, lambda t: (t, [t])],
    ids=["list", "dict", "tuple-holding-a-list"],
)
def test_outputs_other_than_a_tensor_or_a_tuple_of_them_are_refused_and_the_generators_put_back(
    shape: Callable[[torch.Tensor], Any],
) -> None:
    from hyperrng.errors import ArgumentTypeError

    get_rng_tracker().reseed({MP: 7})
    w, x = _W.clone().requires_grad_(), _X.clone().requires_grad_()
    torch.rand(2)
    before = generator_states(get_rng_tracker())
    with pytest.raises(ArgumentTypeError, match="a tensor or a tuple of tensors"):
        checkpoint(lambda t: shape(_forked_dropout(w, t)), x)
    assert_equal_states(generator_states(get_rng_tracker()), before)
    assert get_rng_tracker().active_stream is None


def test_keyword_arguments_are_refused_with_a_typed_error_before_anything_runs() -> None:
    from hyperrng.errors import ArgumentTypeError

    calls: list[int] = []

    def scaled(t: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        calls.append(1)
        return t * scale

    before = generator_states(get_rng_tracker())
    with pytest.raises(ArgumentTypeError, match="functools.partial"):
        checkpoint(scaled, torch.ones(2, requires_grad=True), scale=2.0)
    assert calls == []
    assert_equal_states(generator_states(get_rng_tracker()), before)
