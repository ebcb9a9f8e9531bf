"""Which activation checkpoint's forward pass the calling thread is in, and whether its recompute replays.

A recompute in the backward pass must draw the forward's numbers. Torch's own checkpoints put torch's
generators back before it, but not the tracker's streams or portable mode; those are replayed only by
``hyperrng.checkpoint`` and by ``torch.utils.checkpoint`` given ``context_fn=hyperrng.checkpoint_context``. A
fork or a portable draw in the forward pass of any other checkpoint would draw other numbers in the recompute,
and the gradients would silently differ: :func:`unreplayed_checkpoint` finds that case so that it can be
refused before anything moves. A non-reentrant checkpoint runs its forward with grad and marks it with its
saved-tensor hook (its hooks are the innermost ones; torch 2.5 to 2.7, which cannot show them, by the frame of
its ``checkpoint`` call, or of its module's call for the composable checkpoint, found on the stack); one that
runs its forward without grad (torch's reentrant one, ``hyperrng.checkpoint``) is found by its code on the
stack (a reentrant one whose Function records no backward, as in evaluation under ``no_grad``, recomputes
nothing and is not reported), a walk of the whole stack (a checkpointed block may call its fork from any
depth; about 5 us at 30 frames, 0.1-0.2 us a frame more) that only calls made with grad disabled pay, and none
made in inference mode (which no backward pass follows). :func:`unreplayed_recompute` finds the recompute of
such a checkpoint, whose draws the forward made outside portable mode. Two blocks hide their checkpoint from the
cheap tests and are found by the walk: one that turns grad back on inside a reentrant checkpoint (an autograd
Function's forward leaves forward-mode AD off, :func:`_grad_outside_functions`), and one whose draw sits under a
saved-tensor hook of its own (``save_on_cpu``), above the checkpoint's hook or its recomputation hook.
"""

from __future__ import annotations

import inspect
import sys
import threading
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.checkpoint

_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_fwd_grad = getattr(torch._C, "_is_fwd_grad_enabled", None)


def _grad_outside_functions() -> bool:
    """Whether grad is on and no autograd Function's forward runs: every such forward (a reentrant checkpoint's
    too) turns forward-mode AD off, which ``torch.enable_grad()`` inside its block leaves off, so a block that
    turns grad back on is still found (by the walk of :func:`checkpoint_forward`)."""
    return torch.is_grad_enabled() and _fwd_grad is not None and _fwd_grad()


SEES_NON_REENTRANT = _top_hooks is not None
"""Whether this torch shows a non-reentrant checkpoint's saved-tensor hooks (torch 2.5 to 2.7 do not: there one
is found by the frame of its ``checkpoint`` call, a walk of the stack that every fork and portable draw
made with grad enabled pays)."""
_REENTRANT_FORWARD = torch.utils.checkpoint.CheckpointFunction.forward.__code__
_CHECKPOINT_CALL = inspect.unwrap(torch.utils.checkpoint.checkpoint).__code__
_REENTRANT_BACKWARD = "CheckpointFunctionBackward"  # the autograd node whose backward reruns a reentrant block
_REENTRANT_RERUN = torch.utils.checkpoint.CheckpointFunction.backward.__code__
_MODULE_HOOKED = next(  # where a module's call runs its forward when it has hooks (a composable checkpoint's are two)
    (c for c in torch.nn.Module._call_impl.__code__.co_consts if getattr(c, "co_name", "") == "inner"), None
)
_COMPOSABLE = "torch.distributed._composable.checkpoint_activation"  # looked at once a user has imported it

CHECKPOINT_FORWARDS: dict[int, types.CodeType] = {id(_REENTRANT_FORWARD): _REENTRANT_FORWARD}
"""The code of the functions a checkpoint runs its forward pass in without grad, by ``id`` (a frame's code
is looked up by identity: comparing code objects compares their contents): torch's reentrant
checkpoint's, and :mod:`hyperrng.streams.recompute` adds ``hyperrng.checkpoint``'s."""


class _Replayed(threading.local):
    def __init__(self) -> None:
        self.hooks: list[object] = []  # the hooks of checkpoints whose recompute replays, innermost last
        self.enclosing: list[str | None] = []  # per hyperrng.checkpoint forward: see recompute._forward_mode


REPLAYED = _Replayed()
"""Per thread: ``REPLAYED.hooks``, which ``hyperrng.checkpoint_context``'s contexts enter: the forward context its
checkpoint's hook (:func:`top_hook`), the recompute context the recomputation hook it reruns the block under."""


def forget(mark: object) -> None:
    """Take the innermost ``mark`` out of ``REPLAYED.hooks`` (by identity), when the context that entered it exits."""
    replayed = REPLAYED.hooks
    for i in range(len(replayed) - 1, -1, -1):
        if replayed[i] is mark:
            del replayed[i]
            return


def top_hook() -> object:
    """What marks the non-reentrant checkpoint whose forward context is being entered (for ``REPLAYED.hooks``):
    the innermost saved-tensor hook pair's pack hook, or on torch 2.5 to 2.7 a weak reference to the generator its
    ``checkpoint`` call runs (held weakly: torch 2.5 closes it, and so leaves the forward context, only
    when it is collected after a forward that raised); else ``None``."""
    if _top_hooks is None:
        found = _non_reentrant_call(sys._getframe(1))
        return None if found is None else weakref.ref(found)
    top = _top_hooks(False)
    return top[0] if top is not None else None


def _non_reentrant_call(frame: types.FrameType | None) -> Any:
    """Torch 2.5 to 2.7: the generator of the innermost non-reentrant checkpoint whose forward runs at or above
    ``frame`` (a ``torch.utils.checkpoint.checkpoint`` call's, or a composable checkpoint's module's call, in whose
    frame its ``function`` runs; the generator holds its saved-tensor hooks) if it will be recomputed, else ``None``;
    also ``None`` where the innermost ``checkpoint`` call is reentrant."""
    while frame is not None:  # the whole stack: a block may fork at any depth below its checkpoint
        code = frame.f_code
        if code is _CHECKPOINT_CALL or code is _MODULE_HOOKED:
            gen, record, local = _call_record(frame)
            if code is _CHECKPOINT_CALL or gen is not None:
                return gen if record is not None and _records(record, local) else None
        frame = frame.f_back
    return None


def checkpoint_forward() -> Any:
    """What marks the checkpoint whose forward pass the calling thread is in, else ``None``: a non-reentrant
    ``torch.utils.checkpoint``'s saved-tensor hook (on torch 2.5 to 2.7 the generator its call runs), or for one that
    runs its forward without grad, the code of the function it runs it in (found on the stack)."""
    if _grad_outside_functions():
        if _top_hooks is None:  # torch 2.5 to 2.7
            return _non_reentrant_call(sys._getframe(1))
        top = _top_hooks(False)  # top_hook(), inline: every portable draw asks
        hook = top[0] if top is not None else None
        if hook is None or hook.__qualname__.startswith("_checkpoint_hook."):
            return hook
        # Another saved-tensor hook (save_on_cpu) hides a checkpoint's below it: found by its call, as on torch 2.7.
        return _non_reentrant_call(sys._getframe(1))
    if torch.is_inference_mode_enabled():  # no backward pass will follow, so no recompute: no walk
        return None
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:  # the whole stack: a block may fork or draw at any depth below its checkpoint
        found = CHECKPOINT_FORWARDS.get(id(frame.f_code))
        if found is not None:
            if found is _REENTRANT_FORWARD and not _reentrant_records(frame):
                return None
            return found
        frame = frame.f_back
    # Grad turned off inside a non-reentrant checkpoint's forward: its recompute reruns this all the same.
    if _top_hooks is None:
        return _non_reentrant_call(sys._getframe(1))
    top = _top_hooks(False)
    hook = top[0] if top is not None else None
    return hook if hook is not None and hook.__qualname__.startswith("_checkpoint_hook.") else None


def _layers(frame: types.FrameType | None) -> Iterator[tuple[str | None, Any, Any]]:
    """The activation checkpoints whose forward pass runs at or above ``frame``, innermost first, each as
    ``(flavour, stands_for, recorded)``, found by their frames: a reentrant ``torch.utils.checkpoint`` that records a
    backward (``"use_reentrant=True"``, its context, that is its autograd node); a non-reentrant one that records
    (``"use_reentrant=False"``, or ``None`` where its forward context is hyperrng's; torch's record of it, its
    ``_CheckpointFrame``); ``hyperrng.checkpoint`` (``None``, its context). ``recorded``: what a replayed one
    recorded (its ``enclosing``), else ``None``. Each one's recompute reruns everything inside it."""
    while frame is not None:
        code = frame.f_code
        if code is _REENTRANT_FORWARD:
            if _reentrant_records(frame):
                yield "use_reentrant=True", frame.f_locals.get("ctx"), None
        elif code is _CHECKPOINT_CALL or code is _MODULE_HOOKED:
            _, record, local = _call_record(frame)
            if record is not None and _records(record, local):
                recorded = getattr(local.get("forward_context"), "recorded", None)
                yield (None if recorded is not None else "use_reentrant=False"), record, recorded
        elif id(code) in CHECKPOINT_FORWARDS:
            ctx = frame.f_locals.get("ctx")
            yield None, ctx, getattr(ctx, "recorded", None)
        frame = frame.f_back


def _reentrant_records(frame: types.FrameType) -> bool:
    """Whether the reentrant checkpoint whose forward runs in ``frame`` records a backward, and so recomputes: its
    Function records none where grad was off outside or no input needs it."""
    return any(getattr(frame.f_locals.get("ctx"), "needs_input_grad", (1,)))


def _call_record(frame: types.FrameType) -> tuple[Any, Any, dict[str, Any]]:
    """For the frame of a ``torch.utils.checkpoint.checkpoint`` call, or of the function in which a module's call
    runs its forward where the module has hooks (a composable checkpoint, ``torch.distributed._composable.checkpoint``,
    has two; a module without any is never read, which would cost 1 us a module): the generator that runs the
    non-reentrant checkpoint's forward, torch's record of it (its ``_CheckpointFrame``) and the generator's
    variables, read from the generator's own frame, where it keeps them. ``None`` and nothing for a reentrant call
    (``use_reentrant`` truthy, as torch tests it), one whose generator has not begun, or a module's call outside the
    forward of its composable checkpoint."""
    if frame.f_code is _CHECKPOINT_CALL:
        names = frame.f_locals
        gen = None if names.get("use_reentrant", True) else names.get("gen")
    else:
        gen = _composable_generator(frame.f_back)  # type: ignore[arg-type]  # the module's call
    inner = getattr(gen, "gi_frame", None)
    local = inner.f_locals if inner is not None else {}
    return gen, local.get("new_frame"), local


def _composable_generator(frame: types.FrameType) -> Any:
    """For the frame of a module's call: the generator that runs the forward of the module's composable checkpoint
    while it runs (its state's; a recompute turns its hook off), else ``None``."""
    api = sys.modules.get(_COMPOSABLE)
    if api is None:  # not imported: no composable checkpoint, and no frame read
        return None
    module = frame.f_locals.get("self")
    key = sys.modules["torch.distributed._composable.contract"].STATE_KEY
    if key not in getattr(module, "__dict__", ()):  # no composable API state: not asked (asking would add it)
        return None
    state = api.checkpoint.state(module)
    return getattr(state, "_ac_generator", None) if getattr(state, "enable_hook", False) else None


def _records(record: Any, local: dict[str, Any]) -> bool:
    """Whether torch's record of a non-reentrant checkpoint belongs to one that will recompute (begun without grad,
    it returns before its hooks): on older torch its input saver has a ``grad_fn``; on newer, its generator
    (``local``: its variables) got past that return, or it saved inputs."""
    saver = getattr(record, "input_saver", None)
    if saver is not None:
        return saver.grad_fn is not None
    return "forward_context_suppressed_exc" in local or bool(getattr(record, "saved_args", None))


def reentrant_rerun() -> Any:
    """The context (its autograd node) of the reentrant ``torch.utils.checkpoint`` whose recompute the calling
    thread runs, else ``None``; asked only while a backward pass runs. For a custom autograd Function the node
    running is its ``ctx``; it is also the node running while its tensor hooks and its node's hooks run, outside
    its ``backward``: the frame of that ``backward``, for that very node, tells the recompute."""
    node = torch._C._current_autograd_node()
    if node is None or node.name() != _REENTRANT_BACKWARD:
        return None
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _REENTRANT_RERUN:
            return node if frame.f_locals.get("ctx") is node else None
        frame = frame.f_back
    return None


_UNPACK = next(
    (
        c
        for c in torch.utils.checkpoint._checkpoint_hook.__init__.__code__.co_consts
        if getattr(c, "co_name", "") == "unpack_hook"
    ),
    None,
)  # the saved-tensor hook from which a non-reentrant checkpoint's recompute runs


def rerun_context() -> Any:
    """What stands for the checkpoint whose recompute the calling thread runs (as :func:`_layers` gives it), else
    ``None``: a reentrant one's context (:func:`reentrant_rerun`), or a non-reentrant one's record, read from the
    frame of the saved-tensor hook that runs its recompute."""
    if torch._C._current_graph_task_id() == -1:  # no backward pass runs: no recompute
        return None
    found = reentrant_rerun()
    if found is not None:
        return found
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _UNPACK:
            return frame.f_locals.get("frame")
        frame = frame.f_back
    return None


def _replayed(found: object) -> bool:
    """Whether the non-reentrant checkpoint marked ``found`` replays: its own mark was entered (by identity; on
    torch 2.5 to 2.7 a weak reference to it), anywhere in the list: a checkpoint whose forward raised leaves its
    entry there until torch 2.5 collects its generator."""
    for mark in REPLAYED.hooks:
        if mark is found or (type(mark) is weakref.ref and mark() is found):
            return True
    if SEES_NON_REENTRANT and isinstance(found, types.GeneratorType):  # found by its call, under another hook
        inner = found.gi_frame
        return inner is not None and getattr(inner.f_locals.get("forward_context"), "recorded", None) is not None
    return False


def unreplayed_checkpoint() -> str | None:
    """The flavour of ``torch.utils.checkpoint`` (``"use_reentrant=True"`` or ``"use_reentrant=False"``) whose
    forward pass the calling thread is in, when its recompute would not replay hyperrng's states; else
    ``None`` (no checkpoint, ``hyperrng.checkpoint``, or one given ``hyperrng.checkpoint_context``)."""
    if _top_hooks is not None and _top_hooks(False) is None and torch.is_grad_enabled() and _fwd_grad and _fwd_grad():
        return None  # no saved-tensor hooks, nor a reentrant checkpoint's forward (every portable draw asks)
    found = checkpoint_forward()
    if found is _REENTRANT_FORWARD:
        return "use_reentrant=True"
    if found is None or isinstance(found, types.CodeType):
        return None  # (a hook or, on torch 2.5 to 2.7, its generator marks a non-reentrant checkpoint)
    return None if _replayed(found) else "use_reentrant=False"


def unreplayed_fork() -> str | None:
    """:func:`unreplayed_checkpoint` for a fork of a tracker stream, which is refused also inside a
    ``hyperrng.checkpoint`` that such a checkpoint encloses (``REPLAYED.enclosing``)."""
    return unreplayed_checkpoint() or (REPLAYED.enclosing[-1] if REPLAYED.enclosing else None)


RERUN = "rerun"
""":func:`checkpoint_verdict` for the rerun of a checkpoint that replays nothing of hyperrng's."""


def checkpoint_verdict() -> str | None:
    """What a portable draw on the calling thread must do about ``torch.utils.checkpoint``, in one call (every
    draw asks): ``None`` to draw portably, :data:`RERUN` to run torch's kernel (:func:`unreplayed_recompute`),
    or the flavour of the checkpoint whose forward pass must refuse it (:func:`unreplayed_checkpoint`)."""
    if _top_hooks is not None and _top_hooks(False) is None and torch.is_grad_enabled() and _fwd_grad and _fwd_grad():
        if torch._C._current_graph_task_id() == -1:  # (_grad_outside_functions, inline: every draw asks)
            return None  # no saved-tensor hooks, grad on outside Functions, no backward: no forward nor rerun of one
    return RERUN if unreplayed_recompute() else unreplayed_checkpoint()


def unreplayed_recompute() -> bool:
    """Whether the calling thread reruns a ``torch.utils.checkpoint`` block whose recompute replays nothing of
    hyperrng's (no ``hyperrng.checkpoint_context``).

    Its forward pass refused every portable draw (:func:`unreplayed_checkpoint`), so what the rerun draws, the
    forward drew outside portable mode, from torch's generators, which torch has put back: torch's own kernels
    draw the forward's numbers again, whatever mode the backward pass runs in. A non-reentrant checkpoint reruns
    under its recomputation hook (one that ``hyperrng.checkpoint_context`` entered replays: ``REPLAYED``), a
    reentrant one in its Function's backward, the autograd node then running, and a compiled one each aten random
    op in torch's ``run_with_rng_state`` (a graph traced in the mode draws with hyperrng's own ops instead, and
    the mode is part of what a compiled graph is guarded on). Not in the forward pass of a checkpoint nested in
    the block (:func:`unreplayed_checkpoint` decides there), nor on torch 2.5 to 2.7, which has no portable mode."""
    if _top_hooks is None:
        return False
    top = _top_hooks(False)
    hook = top[0] if top is not None else None
    if hook is not None and getattr(hook, "__qualname__", "").startswith("_recomputation_hook."):
        if any(mark is hook for mark in REPLAYED.hooks):
            return False
    elif torch._C._current_graph_task_id() == -1:  # no backward pass runs: no reentrant recompute (no node asked)
        return False
    elif hook is not None and (rerun := _hidden_rerun(sys._getframe(1))) is not None:
        if rerun:  # another saved-tensor hook (save_on_cpu) in the block hides the recomputation hook: its frames tell
            return False
    elif reentrant_rerun() is None and not in_rng_replay(sys._getframe(1)):
        return False
    # The forward pass of a checkpoint nested in the block: one that replays draws as it records (hyperrng's, in the
    # mode the outer forward had); one that replays nothing drew torch's (in the mode, its forward was refused).
    return checkpoint_forward() is None or unreplayed_checkpoint() is not None


_RECOMPUTE_FN = next(  # the function in which a non-reentrant checkpoint reruns its block, under its recompute context
    (
        c
        for c in torch.utils.checkpoint._checkpoint_without_reentrant_generator.__code__.co_consts
        if getattr(c, "co_name", "") == "recompute_fn"
    ),
    None,
)


def _hidden_rerun(frame: types.FrameType | None) -> bool | None:
    """For a draw under a saved-tensor hook other than a checkpoint's: whether the non-reentrant checkpoint whose
    block reruns at or above ``frame`` replays (its recompute context is hyperrng's), ``None`` where none reruns.
    A walk of the stack, which only draws under such hooks in a backward pass pay."""
    while frame is not None:
        if frame.f_code is _RECOMPUTE_FN:
            context = frame.f_locals.get("recompute_context")
            if getattr(context, "replays", False):
                return True
            # or a @contextmanager around it (the composable checkpoint's): its generator's variables hold it
            inner = getattr(getattr(context, "gen", None), "gi_frame", None)
            return inner is not None and any(getattr(v, "replays", False) for v in inner.f_locals.values())
        frame = frame.f_back
    return None


_RNG_REPLAYS: dict[int, types.CodeType] = {}
"""The code of the kernels of torch's ``run_with_rng_state``, with which a compiled backward pass reruns a
random op at the generator state its forward saved, by ``id``; filled once torch has imported them."""


def in_rng_replay(frame: types.FrameType | None, namespace: str = "aten") -> bool:
    """Whether ``frame`` or one above it runs a kernel of ``run_with_rng_state`` for an op of ``namespace``: by
    default an aten op, not one of hyperrng's (whose implementation draws portably through the aten op). A walk
    of the stack, which only the draws of a backward pass, or of code compiled in the mode run outside it, pay."""
    if not _RNG_REPLAYS:
        prims = sys.modules.get("torch._prims.rng_prims")
        if prims is None:  # no compiled graph has replayed a random op in this process
            return False
        for kernel in prims.run_with_rng_state.py_kernels.values():
            code = getattr(kernel, "__code__", None)
            if code is not None:
                _RNG_REPLAYS[id(code)] = code
    while frame is not None:
        if id(frame.f_code) in _RNG_REPLAYS:
            return getattr(frame.f_locals.get("op"), "namespace", None) == namespace
        frame = frame.f_back
    return False
