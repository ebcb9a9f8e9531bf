"""Activation recompute that replays exactly the random numbers of the forward pass.

:func:`checkpoint` runs ``function`` without keeping its activations, and reruns it in the
backward pass. Before the first run it records torch's CPU generator, every device
generator of the current platform and every stream of the tracker; before the rerun it
puts exactly those states back, so dropout inside ``tracker.fork(...)`` regions draws the
same masks twice; afterwards it restores the states the backward pass had found, so the
recompute leaves no trace on the generators. It works on every platform, because it only
uses the Platform interface and the tracker's ``get_states``/``set_states``.

:func:`checkpoint_context` brings the same replay to ``torch.utils.checkpoint`` (and to
the wrappers built on it, such as FSDP2's and TorchTitan's ``checkpoint_wrapper``):
torch restores its own CPU and device generators around a recompute, but not the
tracker's streams, the CPU platform's position or portable mode, so without it a fork
inside the block would draw other masks in the backward pass than in the forward: such a
fork is refused, as is a portable draw (:mod:`hyperrng.streams._checkpoints` finds the case).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

import hyperrng.platforms as platforms
from hyperrng._guard import exclusive as _exclusive
from hyperrng.errors import ArgumentTypeError, InvalidOperationError
from hyperrng.platforms._features import outside_dynamo
from hyperrng.portable import mode as portable_mode
from hyperrng.streams._checkpoints import (
    CHECKPOINT_FORWARDS,
    REPLAYED,
    SEES_NON_REENTRANT,
    _layers,
    forget,
    rerun_context,
    top_hook,
)
from hyperrng.streams._device_state import Target, host_and_devices
from hyperrng.streams.tracker import RNGStatesTracker, resolve_tracker

__all__ = ["checkpoint", "checkpoint_context"]


class _RNGSnapshot:
    """The host state, every device state of the platform, and the tracker's streams.

    Taken by a thread that holds every target (see :class:`_Holding`).
    """

    def __init__(self, tracker: RNGStatesTracker, targets: list[Target]) -> None:
        self.targets = targets
        self.states = [read() for read, _, _ in targets]
        self.streams = tracker.get_states() if tracker.is_initialized() else None

    def restore(self, tracker: RNGStatesTracker) -> None:
        """Put the snapshot back (idempotent, so an interrupted restore can run again)."""
        if self.streams is not None:
            tracker.set_states(self.streams)
        for (_, write, _), state in zip(self.targets, self.states):
            write(state)


def _held() -> tuple[list[Target], AbstractContextManager[None]]:
    """Torch's CPU generator and every device of the platform, and a context that holds them all for the
    calling thread (see :mod:`hyperrng._guard.exclusive`): on another thread that holds one, entering raises
    :class:`~hyperrng.errors.InvalidOperationError` with nothing changed."""
    targets = host_and_devices(platforms.current())
    return targets, _exclusive.holding([key for _, _, key in targets], "a recompute (hyperrng.checkpoint)")


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, function: Callable[..., Any], tracker: RNGStatesTracker, anchor: torch.Tensor, *args: Any
    ) -> Any:
        ctx.function = function
        ctx.recorded = _Recorded(tracker)
        ctx.recorded.record(sys._getframe().f_back)
        tensor_idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.tensor_idx = tensor_idx
        ctx.others = [None if i in tensor_idx else a for i, a in enumerate(args)]
        ctx.save_for_backward(*(args[i] for i in tensor_idx))
        # An enclosing torch.utils.checkpoint that replays nothing of hyperrng's reruns this block in its own
        # recompute, with the tracker's streams where they then are: forks inside are refused meanwhile.
        REPLAYED.enclosing.append(ctx.recorded.enclosing)
        try:
            with torch.no_grad(), _drawing_as_recorded(ctx.recorded):
                outputs = function(*args)
        finally:
            REPLAYED.enclosing.pop()
        if not _gradable(outputs):
            ctx.recorded.take_back()
            raise ArgumentTypeError(
                "hyperrng.checkpoint(function, *args): function returns a tensor or a tuple of tensors (and "
                f"values that hold none), got {type(outputs).__name__}; tensors inside a list, dict or other "
                "container would silently get no gradient. Return them as a tuple, e.g. tuple(outputs)."
            )
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        if not torch.autograd._is_checkpoint_valid():  # its recompute's backward() would fill every leaf's .grad
            raise InvalidOperationError(
                "hyperrng.checkpoint cannot serve torch.autograd.grad() or backward(inputs=...): its recompute "
                "accumulates into the .grad of every leaf it uses. Call .backward() without inputs, or use "
                "torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, "
                "context_fn=hyperrng.checkpoint_context), which replays the same random numbers."
            )
        args = list(ctx.others)
        inputs = []
        for i, t in zip(ctx.tensor_idx, ctx.saved_tensors):
            x = t.detach()
            x.requires_grad_(t.requires_grad)
            args[i] = x
            inputs.append(x)
        with _replaying(ctx.recorded), torch.enable_grad():
            outputs = ctx.function(*args)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if isinstance(o, torch.Tensor) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        arg_grads = [None] * len(args)
        for i, x in zip(ctx.tensor_idx, inputs):
            arg_grads[i] = x.grad
        return (None, None, None, *arg_grads)


CHECKPOINT_FORWARDS[id(_Checkpoint.forward.__code__)] = _Checkpoint.forward.__code__  # its forward runs without grad


def _gradable(outputs: Any) -> bool:
    """Whether every tensor of ``outputs`` is one that autograd connects: the output itself or an item of its tuple."""
    items = outputs if isinstance(outputs, tuple) else (outputs,)
    return not any(
        not isinstance(item, torch.Tensor) and any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(item))
        for item in items
    )


def checkpoint(function: Callable[..., Any], *args: Any, tracker: RNGStatesTracker | None = None, **kwargs: Any) -> Any:
    """Run ``function(*args)`` now and again in the backward pass, with identical random numbers.

    Inside ``torch.compile`` the graph breaks around it (its holds and snapshots are Python state);
    ``torch.utils.checkpoint`` compiles, and in portable mode replays the forward's numbers there
    without a ``context_fn``.

    Args:
        function: the region to recompute; it may fork tracker streams and draw from any
            generator. Its outputs are a tensor or a tuple of tensors.
        *args: its inputs, positional only; tensors among them receive gradients.
        tracker: whose streams are replayed (default: the process-wide tracker).

    Returns:
        What ``function`` returns. Gradients equal those of running ``function`` without
        checkpointing, bit for bit, when ``function`` is deterministic given its random numbers.
        The backward pass is a whole ``backward()``, as for ``torch.utils.checkpoint``'s reentrant
        flavour: parameters used inside get their ``.grad``, and ``torch.autograd.grad`` is refused.

    Raises:
        ArgumentTypeError: ``function`` is not callable, or ``tracker`` not a tracker; keyword
            arguments for ``function`` (bind them with ``functools.partial`` or a lambda); the first of
            ``args`` is a bool, which is Megatron-core's ``distribute_saved_activations`` (its
            signature is :func:`hyperrng.megatron.checkpoint`); or ``function`` returned tensors in a
            list, dict or other container, which would get no gradient (the generators and streams
            are then put back as they were before the call).
        InvalidOperationError: another thread holds torch's CPU generator or a device's (a
            fork, region, ``fork_rng`` or recompute is open there): now, while the states
            are recorded, or in the backward pass, while they are swapped for the rerun.
            Nothing is changed. The rerun runs on the thread autograd runs the backward
            on, which for accelerator tensors is autograd's own device thread: a thread
            that calls ``backward()`` inside a fork or ``fork_rng`` gets this error. Also in the
            backward pass of ``torch.autograd.grad`` or ``backward(inputs=...)``, before the recompute.
    """
    if torch.compiler.is_dynamo_compiling():  # holds and snapshots are Python state: run behind a graph break
        return _checkpoint_outside_the_graph(function, *args, tracker=tracker, **kwargs)
    if kwargs:
        raise ArgumentTypeError(
            f"checkpoint(function, *args) passes positional arguments only, got keywords {sorted(kwargs)}: bind "
            "them first, checkpoint(functools.partial(function, name=value), *args) or a lambda."
        )
    if not callable(function):
        raise ArgumentTypeError(f"checkpoint() takes the function to recompute first, got {type(function).__name__}.")
    if args and isinstance(args[0], bool):
        raise ArgumentTypeError(
            "checkpoint(function, *args) got a bool first, as in Megatron-core's checkpoint(function, "
            "distribute_saved_activations, *args): call hyperrng.megatron.checkpoint for that signature, or pass "
            "the flag another way (functools.partial) if function really takes a bool first."
        )
    resolved = resolve_tracker(tracker)
    # The anchor requires grad, so the output does too even when no input does (raw data
    # in, parameters inside): without it the parameters would silently get no gradient.
    anchor = torch.empty(0, requires_grad=torch.is_grad_enabled())
    return _Checkpoint.apply(function, resolved, anchor, *args)


@outside_dynamo
def _checkpoint_outside_the_graph(
    function: Callable[..., Any], *args: Any, tracker: RNGStatesTracker | None, **kwargs: Any
) -> Any:
    return checkpoint(function, *args, tracker=tracker, **kwargs)  # run as Python: there is_dynamo_compiling() is false


class _Recorded:
    """What the forward pass of one ``torch.utils.checkpoint`` call found: for its recompute."""

    __slots__ = ("enclosing", "portable", "rerun", "snapshot", "tracker")

    def __init__(self, tracker: RNGStatesTracker) -> None:
        self.tracker = tracker
        self.snapshot: _RNGSnapshot | None = None
        self.portable: bool | None = None
        self.rerun = False  # recorded in the recompute of an enclosing checkpoint: see _forward_mode
        self.enclosing: str | None = None  # see _forward_mode

    def record(self, frame: types.FrameType | None) -> None:
        """Record the states the block may draw from, whether it draws portably, and the flavour of an enclosing
        checkpoint that replays nothing (``frame``: the caller of the checkpoint)."""
        targets, hold = _held()
        with hold:  # a consistent snapshot: no other thread is swapping these generators
            self.snapshot = _RNGSnapshot(self.tracker, targets)
        # The recompute draws as the forward did (in the mode or not).
        self.portable, self.rerun, self.enclosing = _forward_mode(frame, self)

    def take_back(self) -> None:
        """Put the recorded states back: the forward's draws undone, for a refusal after it ran."""
        assert self.snapshot is not None
        _, hold = _held()
        with hold:
            self.snapshot.restore(self.tracker)


_UNSTAMPED = object()


def _forward_mode(frame: types.FrameType | None, own: _Recorded) -> tuple[bool | None, bool, str | None]:
    """The portable mode (:func:`~hyperrng.portable.mode.thread_mode`) that the block of a checkpoint whose forward
    pass runs at ``frame`` draws in, whether it is the one its forward pass had, in a rerun, and the flavour of the
    ``torch.utils.checkpoint`` that replays nothing of hyperrng's and encloses it, if any. ``own``: the checkpoint's
    record, skipped where the walk finds it (a composable checkpoint's module call is above ``frame``).

    The thread's; but the recompute of an enclosing ``torch.utils.checkpoint`` reruns this forward pass, torch's
    generators put back and the mode that ``backward()`` runs in, which need not be the forward's. So the forward
    stamps its mode on what stands for each enclosing checkpoint up to a replayed one (:func:`_layers`), and a
    rerun draws in its stamp and stamps the checkpoints it makes anew. Two replayed checkpoints in one such block
    that draw in different modes are refused. A rerun that finds no stamp draws outside the mode: no replayed
    checkpoint recorded in that forward pass, so none of its portable draws passed the refusal of a checkpoint
    that replays nothing.

    The enclosing flavour is the innermost enclosing checkpoint's, or what that one found if it replays. Its
    recompute reruns this block with the tracker's streams where they then are, so a fork there would draw other
    numbers: ``REPLAYED.enclosing`` keeps it while the block runs, and forks inside are refused
    (:func:`~hyperrng.streams._checkpoints.unreplayed_fork`)."""
    rerun = rerun_context()
    mode = portable_mode.thread_mode() if rerun is None else getattr(rerun, _STAMP, None)
    enclosing, innermost = None, True
    for flavour, outer, recorded in _layers(frame):  # each enclosing checkpoint reruns this block: up to a replayed one
        if recorded is own:  # a composable checkpoint's module call, above where its forward context is entered
            continue
        if innermost:
            enclosing, innermost = flavour if flavour is not None else getattr(recorded, "enclosing", None), False
        stamped = getattr(outer, _STAMP, _UNSTAMPED)
        if stamped is _UNSTAMPED:
            setattr(outer, _STAMP, mode)
        elif stamped != mode:
            raise InvalidOperationError(
                "hyperrng.checkpoint (or checkpoint_context) in and out of portable mode inside one "
                "torch.utils.checkpoint: its recompute could not tell which of them draws portably. Enter "
                "portable_random() around the whole block, or give the outer checkpoint "
                "context_fn=hyperrng.checkpoint_context.",
                reason="tracker",
            )
        if recorded is not None:
            break
    return mode, rerun is not None, enclosing


_STAMP = "_hyperrng_portable_mode"
"""The attribute what stands for a ``torch.utils.checkpoint`` gets: the portable mode its block drew in."""


def _drawing_as_recorded(recorded: _Recorded) -> AbstractContextManager[None]:
    """In a rerun (:func:`_forward_mode`), draw in the mode the forward pass had; else change nothing."""
    return portable_mode.mode_applied(recorded.portable) if recorded.rerun else nullcontext()


def _replaying(recorded: _Recorded) -> ExitStack:
    """Entered: the generators held, the recorded states put back, drawing as the forward did (portable
    mode included). Its exit restores the states it found, then releases the holds."""
    assert recorded.snapshot is not None
    tracker = recorded.tracker
    with ExitStack() as stack:
        targets, hold = _held()
        stack.enter_context(hold)
        now = _RNGSnapshot(tracker, targets)
        stack.callback(_exclusive.redo, now.restore, tracker)  # runs before the holds are released
        recorded.snapshot.restore(tracker)
        stack.enter_context(portable_mode.mode_applied(recorded.portable))
        return stack.pop_all()


class _ForwardContext:
    """Records every state the block may draw from, then enters the composed forward context.

    While entered, it marks the checkpoint's saved-tensor hook (the innermost, entered just before it)
    as one whose recompute replays portable draws, which portable mode's kernels check for
    (:func:`hyperrng.streams._checkpoints.unreplayed_checkpoint`)."""

    # No __slots__: torch sets attributes of its own on a checkpoint's contexts (ac_graph_id, when compiled).

    def __init__(self, recorded: _Recorded, inner: AbstractContextManager[Any] | None) -> None:
        self.recorded, self._inner = recorded, inner  # (recorded: read by hyperrng.streams._checkpoints._layers)
        self._hook: object = None
        self._stack: ExitStack | None = None

    def __enter__(self) -> None:
        # Entered in torch's generator (frame 1), which its checkpoint call (frame 2) runs: the caller is above that.
        self.recorded.record(sys._getframe(2).f_back)
        with ExitStack() as stack:
            stack.enter_context(_drawing_as_recorded(self.recorded))
            self._hook = top_hook()
            REPLAYED.hooks.append(self._hook)
            stack.callback(forget, self._hook)
            REPLAYED.enclosing.append(self.recorded.enclosing)
            stack.callback(REPLAYED.enclosing.pop)
            if self._inner is not None:
                stack.enter_context(self._inner)
            self._stack = stack.pop_all()

    def __exit__(self, *exc: Any) -> bool | None:
        stack, self._stack = self._stack, None
        return stack.__exit__(*exc) if stack is not None else None


class _RecomputeContext:
    """Holds the generators, puts the forward's states back and draws as the forward did (portable mode
    included) while the block reruns; then restores the states it found and releases.

    While entered, it marks the recomputation hook the block reruns under as one that replays, which portable
    mode's kernels check for (:func:`hyperrng.streams._checkpoints.unreplayed_recompute`; ``replays``, where
    another saved-tensor hook in the block hides that hook)."""

    replays = True

    def __init__(self, recorded: _Recorded, inner: AbstractContextManager[Any] | None) -> None:
        self._recorded, self._inner = recorded, inner
        self._stack: ExitStack | None = None

    def __enter__(self) -> None:
        recorded = self._recorded
        if recorded.snapshot is None:
            raise InvalidOperationError(
                "the recompute context of hyperrng.checkpoint_context() was entered before its forward context; "
                "pass checkpoint_context (or a function returning its pair) as torch.utils.checkpoint's context_fn.",
                reason="tracker",
            )
        with ExitStack() as stack:
            stack.enter_context(_replaying(recorded))
            if SEES_NON_REENTRANT:  # torch 2.5 to 2.7 show no hooks, and have no portable mode to tell
                hook = top_hook()
                REPLAYED.hooks.append(hook)
                stack.callback(forget, hook)
            if self._inner is not None:
                stack.enter_context(self._inner)
            self._stack = stack.pop_all()

    def __exit__(self, *exc: Any) -> bool | None:
        stack, self._stack = self._stack, None
        return stack.__exit__(*exc) if stack is not None else None


def _compiling() -> bool:
    """Whether a tracer runs this thread's code, where ``torch.utils.checkpoint`` takes only selective-checkpoint
    contexts: Dynamo; AOTAutograd, ``make_fx`` or export, which a recent torch tells by a proxy mode, and an older
    one by functional tensors (here: the functional mode that makes them, or torch's process-wide compiling flag,
    which export sets). Per thread on a recent torch: a compilation on another thread changes nothing here (on an
    older one a checkpoint there takes the compiled contexts, and refuses what they cannot replay with our error)."""
    modes = torch._C._TorchDispatchModeKey
    return (
        torch.compiler.is_dynamo_compiling()
        or torch._guards.TracingContext.try_get() is not None
        or torch._C._get_dispatch_mode(modes.PROXY) is not None
        or torch._C._get_dispatch_mode(modes.FUNCTIONAL) is not None
        or (_PROCESS_WIDE_FLAG and torch.compiler.is_compiling())
    )


_PROCESS_WIDE_FLAG = not hasattr(torch.compiler, "_is_non_strict_tracing")
"""Whether this torch predates the proxy-mode rule (it lacks ``torch.compiler._is_non_strict_tracing``, which came
with it): export's tracing on torch 2.5 shows neither a proxy mode nor a functional one to a ``context_fn``."""


def _recompute_everything() -> tuple[Any, Any]:
    """What ``context_fn`` gives ``torch.utils.checkpoint`` inside ``torch.compile``, which takes only
    selective-checkpoint contexts there: the policy of a plain checkpoint (recompute every op)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(lambda ctx, op, *args, **kwargs: CheckpointPolicy.PREFER_RECOMPUTE)


def checkpoint_context(
    contexts: tuple[AbstractContextManager[Any], AbstractContextManager[Any]] | None = None,
    *,
    tracker: RNGStatesTracker | None = None,
) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """The ``context_fn`` that makes ``torch.utils.checkpoint`` replay hyperrng's streams on recompute.

    ::

        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=hyperrng.checkpoint_context)
        checkpoint_wrapper(block, context_fn=hyperrng.checkpoint_context)  # torch.distributed's wrapper

    The forward context records torch's CPU generator, every device generator of the
    current platform (the CPU platform's position included), the tracker's streams and
    whether this thread draws in portable mode; the recompute context puts them back while
    the block reruns, so forks, sharded regions and portable draws inside the block draw
    the forward's numbers again, and afterwards restores what it found. Gradients then equal
    those of running the block without checkpointing.

    Args:
        contexts: another ``context_fn``'s pair to compose with, such as selective
            activation checkpointing's: ``context_fn=lambda:
            hyperrng.checkpoint_context(create_selective_checkpoint_contexts(policy))``.
            Its contexts are entered inside these.
        tracker: whose streams are replayed (default: the process-wide tracker).

    Returns:
        ``(forward_context, recompute_context)``, as ``context_fn`` returns them; torch
        calls ``context_fn`` once per checkpointed call.

    Raises:
        ArgumentTypeError: ``contexts`` is not a pair of context managers, or ``tracker``
            is not a tracker.
        InvalidOperationError: as for :func:`checkpoint`, another thread holds torch's CPU
            generator or a device's, when the forward records the states or when the
            recompute swaps them; nothing is changed then.
    """
    resolved = resolve_tracker(tracker)
    if _compiling():  # compiled checkpoints restore the generators and portable draws themselves
        return contexts if contexts is not None else _recompute_everything()
    if contexts is None:
        inner: tuple[Any, Any] = (None, None)
    elif (
        isinstance(contexts, tuple)
        and len(contexts) == 2
        and all(callable(getattr(c, "__enter__", None)) and callable(getattr(c, "__exit__", None)) for c in contexts)
    ):
        inner = contexts
    else:
        raise ArgumentTypeError(
            "checkpoint_context() composes with another context_fn's result, a pair of context managers "
            f"(forward, recompute), got {type(contexts).__name__}; call that context_fn and pass what it returns."
        )
    recorded = _Recorded(resolved)
    return _ForwardContext(recorded, inner[0]), _RecomputeContext(recorded, inner[1])
