"""The dispatch key portable mode's kernels (:mod:`hyperrng.portable._kernels`) live on: registered once,
switched per thread (:func:`push`, :func:`pop`), and the refusal of every random op without a portable kernel
(:func:`unsupported_ops`). :mod:`hyperrng.portable.mode` is the public face (entering, leaving, the switch).

**The mechanism, in a paragraph.** The kernels are registered once per process on torch's
``CustomRNGKeyId`` dispatch key (:data:`KEY_NAME`), which sits below autograd and Python
subclasses and modes, just above the device keys (``CPU``, ``CUDA``, ``PrivateUse1``...),
and which no tensor carries. A thread in portable mode includes the key in its thread-local
dispatch state (:func:`switch`), so its random ops reach the kernels whatever the device;
every other op falls through the key at no cost, and other threads never see it. Outside
the mode nothing of this is on any path: a random op runs exactly torch's kernel, at
torch's cost. Entering and leaving flip one thread-local bit and never touch the dispatch
table (:func:`register` writes it once, at the first entry). Meta and fake tensors (shape
propagation in ``torch.compile`` and DTensor) pass through to torch's kernels; what compiled code
records for a random op in the mode is :mod:`hyperrng.portable._traced`'s.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

import hyperrng.platforms as platforms
from hyperrng.errors import HyperRNGError, UnsupportedPortableOpError
from hyperrng.platforms import _features
from hyperrng.platforms._features import outside_dynamo
from hyperrng.portable import _attention as _attention_ops
from hyperrng.portable._kernels import PORTABLE_OPS, THREAD, Entry, refuse_capture
from hyperrng.sharding._local_tensor import portable_refusal
from hyperrng.sharding._regions import cancel_innermost
from hyperrng.sharding.tracker import active_region
from hyperrng.streams._checkpoints import (
    RERUN,
    checkpoint_forward,
    checkpoint_verdict,
    unreplayed_checkpoint,
    unreplayed_recompute,
)

__all__ = [
    "KEY_NAME",
    "is_switched_on",
    "pop",
    "push",
    "register",
    "registered",
    "switch",
    "unsupported_ops",
]


def push(entry: Entry, outermost: bool = False) -> None:
    """Add ``entry`` to this thread's mode; the first one includes the key in the thread's dispatch.

    Registration (:func:`register`) must have happened."""
    entries = THREAD.entries
    first = not entries
    if first:
        THREAD.inherited = is_switched_on()
    if outermost:
        entries.insert(0, entry)
    else:
        entries.append(entry)
    if first:  # after the entry is in: an interrupt before this finds it, and pop() gives the key its state back
        switch(True)


def pop(entry: Entry) -> None:
    """Take ``entry`` out of this thread's mode (if it is in); the last one gives the key its previous state."""
    entries = THREAD.entries
    for i in range(len(entries) - 1, -1, -1):
        if entries[i] is entry:
            del entries[i]
            if not entries:
                switch(THREAD.inherited)
            return


# -- refusals ----------------------------------------------------------------------------------
_COMPOSITE_KEYS = ("CompositeImplicitAutograd", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")
_DROPOUT_ARGS = ("dropout_p", "dropout")
_TRAINING_ARGS = ("train", "training")


@functools.cache
def _tagged_random_ops() -> tuple[Any, ...]:
    """Every aten op torch tags as random (``nondeterministic_seeded``), and ``random_``.

    Walks the dispatcher's list of every registered op: ``dir(torch.ops.aten)`` lists only the ops
    this process has looked up so far, which left ``binomial``, ``_sample_dirichlet`` (and on torch
    2.5 to 2.9 ``_standard_gamma``) unrefused in the mode, drawing from the device's generator.
    Found once per process (about 20 ms reading the tags from the dispatcher; entering the mode
    must not)."""
    found = []
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, label = qualified.partition("::")
        if namespace != "aten":
            continue
        name, _, overload = label.partition(".")
        if name != "random_" and torch.Tag.nondeterministic_seeded not in _tags(qualified, name, overload):
            continue
        packet = getattr(torch.ops.aten, name, None)
        op = getattr(packet, overload or "default", None) if packet is not None else None
        if op is not None:
            found.append(op)
    return tuple(found)


def _tags(qualified: str, name: str, overload: str) -> Sequence[Any]:
    """The tags of the aten op ``name.overload`` (``qualified``: ``aten::name.overload``), read from the
    dispatcher without building its Python op (the walk over every op then costs ~20 ms, not ~150);
    where this torch's dispatcher does not answer so, from the op that ``torch.ops`` builds."""
    read = getattr(torch._C, "_get_operation_overload", None)
    if read is not None:
        try:
            found = read(f"aten::{name}", overload)
        except Exception:  # an op torch lists but cannot hand out: then the slow path decides
            found = None
        if isinstance(found, tuple) and len(found) == 3 and isinstance(found[2], list):
            return found[2]
    try:
        return getattr(getattr(torch.ops.aten, name), overload or "default").tags
    except (AttributeError, RuntimeError):  # listed by the dispatcher, but no Python op for it
        return ()


@functools.cache
def _random_aten_ops() -> tuple[Any, ...]:
    """Every aten op that draws random numbers in a kernel of its own (no composite decomposition)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return tuple(op for op in _tagged_random_ops() if not any(has(op.name(), k) for k in _COMPOSITE_KEYS))


def _op_label(op: Any) -> str:
    name = op._schema.name.removeprefix("aten::")
    return name if op._overloadname == "default" else f"{name}.{op._overloadname}"


def unsupported_ops() -> list[str]:
    """Names (``name.overload``) of the aten random ops that portable mode refuses with
    :class:`UnsupportedPortableOpError` (some only for arguments that make them random)."""
    return sorted(label for label in map(_op_label, _random_aten_ops()) if label not in PORTABLE_OPS)


class _ArgumentReader:
    """Reads one argument of an op's call, as the dispatcher passes it to a Python kernel."""

    def __init__(self, index: int, argument: Any) -> None:
        self.index, self.name = index, argument.name
        self.default, self.kwarg_only = argument.default_value, argument.kwarg_only

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.kwarg_only and self.index < len(args):
            return args[self.index]
        return kwargs.get(self.name, self.default)


def _argument_reader(op: Any, names: Sequence[str]) -> _ArgumentReader | None:
    for index, argument in enumerate(op._schema.arguments):
        if argument.name in names:
            return _ArgumentReader(index, argument)
    return None


def _refusal(op: Any) -> Callable[..., Any]:
    """What portable mode does with ``op``, a random op without a portable kernel: raise, or run torch's
    kernel (``original(keyset, ...)``) when the arguments make the op deterministic."""
    label = _op_label(op)
    dropout = _argument_reader(op, _DROPOUT_ARGS)
    training = _argument_reader(op, _TRAINING_ARGS)

    def refuse(original: Callable[..., Any], keyset: Any, *args: Any, **kwargs: Any) -> Any:
        deterministic = (dropout is not None and not dropout(args, kwargs)) or (
            training is not None and not training(args, kwargs)
        )
        if deterministic:
            return original(keyset, *args, **kwargs)
        raise UnsupportedPortableOpError(_refusal_message(label))

    return refuse


_USER_OPS = (
    "rand, randn, randint, rand_like, randn_like, uniform_, normal_, bernoulli_, random_, randperm, "
    "F.dropout, F.scaled_dot_product_attention, nn.init"
)
"""The portable ops as users call them (the aten names of PORTABLE_OPS mean little in a message)."""


def _refusal_message(label: str) -> str:
    return (
        f"{label} has no portable implementation, and portable mode never falls back to a device's own "
        f"generator; call it outside portable_random(), or use a portable op ({_USER_OPS})."
    )


def _own_host_generator(kwargs: dict[str, Any]) -> bool:
    """Whether a call in the mode runs torch's own kernel because it names, as ``generator=``, a CPU
    ``torch.Generator`` of its own: one that is not where the platform keeps portable positions (torch's
    default CPU generator, on the ``cpu`` platform, which is taken out of ``kwargs`` here: the call draws
    at the platform's position, as without it). Its numbers are computed on the host from that
    generator's state alone, so they are the same on every machine, as portable numbers are; a shuffling
    DataLoader's sampler draws its order that way (with a seed it draws portably). Not inside a sharded
    region, which positions the generator it was given and draws its block of the global tensor."""
    gen = kwargs.get("generator")
    if gen is None or gen.device.type != "cpu" or active_region() is not None:
        return False
    if platforms.current().device_type == "cpu" and _is_host_default(gen):
        kwargs["generator"] = None
        return False
    if checkpoint_forward() is not None:  # no checkpoint puts a generator of the caller's back
        raise UnsupportedPortableOpError(
            "a random op given generator= a torch.Generator of your own inside an activation checkpoint: its "
            "recompute in the backward pass would draw that generator's next numbers, not the forward's, and "
            "the gradients would silently differ. Draw it outside the checkpointed function, or without "
            "generator= (portable draws are replayed)."
        )
    return True


def _is_host_default(gen: torch.Generator) -> bool:
    """Whether ``gen`` is torch's default CPU generator (a generator passed through the dispatcher arrives as
    a new Python object): its state equals the default's, and reseeding it changes the default's. Both
    states are put back."""
    default = torch.default_generator
    state = default.get_state()
    if not torch.equal(gen.get_state(), state):
        return False
    try:
        gen.manual_seed((default.initial_seed() + 1) & (2**64 - 1))
        return not torch.equal(default.get_state(), state)
    finally:
        default.set_state(state)
        gen.set_state(state)


# -- the dispatch key: registered once, switched per thread --------------------------------------
KEY_NAME = "CustomRNGKeyId"
"""The dispatch key portable mode's kernels live on. torch reserves it for random-number kernels:
it sits just above the backend keys (``CPU``, ``CUDA``, ``PrivateUse1``, ...) and below autograd,
and no tensor carries it, so it takes part in a call only on a thread that includes it."""


def _key() -> Any:
    return torch._C._parse_dispatch_key(KEY_NAME)


def switch(on: bool) -> None:
    """Include the key in this thread's dispatch (``on``) or not: the whole cost of entering or leaving
    for torch's dispatcher. Autograd hands a thread's included keys to the threads that run its
    backward pass, which therefore reach the kernels too; with no entry on that thread, they run
    torch's own kernels (see :func:`_switched`)."""
    torch._C._dispatch_tls_set_dispatch_key_included(_KERNELS.key, on)


def is_switched_on() -> bool:
    """Whether the calling thread includes the key (entered, or inherited by an autograd thread)."""
    key = _KERNELS.key
    return key is not None and torch._C._dispatch_tls_is_dispatch_key_included(key)


# -- torch.utils.checkpoint without a replay ---------------------------------------------------------
def refuse_unreplayed_checkpoint(what: str, flavour: str | None) -> None:
    """Refuse a portable draw in the forward pass of a ``torch.utils.checkpoint`` whose recompute would draw
    other numbers (``flavour``, from :func:`hyperrng.streams._checkpoints.unreplayed_checkpoint`), before
    anything moves."""
    if flavour is not None:
        raise UnsupportedPortableOpError(
            f"{what} in portable mode inside torch.utils.checkpoint ({flavour}) without hyperrng's replay: its "
            "recompute in the backward pass would draw torch's numbers, not the forward's, and the gradients "
            "would silently differ. Pass use_reentrant=False, context_fn=hyperrng.checkpoint_context (also to "
            "checkpoint_wrapper or the composable checkpoint), or use hyperrng.checkpoint(fn, *args); compiled "
            "checkpoints need nothing."
        )


def _draws_portably() -> bool:
    """Whether attention on this thread draws portably: in the mode, and not rerunning a checkpoint whose
    forward drew torch's numbers (:func:`unreplayed_recompute`)."""
    return bool(THREAD.entries) and not unreplayed_recompute()


def _before_attention(what: str, device: torch.device) -> None:
    """The checks of a portable draw, for attention (taken over above this key): no checkpoint that would
    recompute other numbers, no graph capture."""
    refuse_unreplayed_checkpoint(what, unreplayed_checkpoint())
    refuse_capture(platforms.current(), device, what)


def _cancelling(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``kernel``, cancelling the innermost region when it refuses an op (a bad dtype, an unsupported op): every
    rank then stays where it was instead of moving past the op (see ``hyperrng.sharding._regions``)."""

    @functools.wraps(kernel)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return kernel(*args, **kwargs)
        except HyperRNGError:
            cancel_innermost()
            raise

    return run


_LOCAL_TENSOR = "torch.distributed._local_tensor"


_META = torch._C.DispatchKey.Meta
"""Meta tensors, and fake ones (whose kernels run on meta tensors: torch.compile's tracing, DTensor's
sharding propagation), carry this key: they propagate shapes, draw nothing, and move no position."""


def _below(op: Any, below: Any) -> Callable[..., Any]:
    """torch's own kernel for ``op``: the call redispatched to the keys under portable mode's."""

    def original(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        return op.redispatch(keyset & below, *args, **kwargs)

    return original


def _run_untraced(kernel: Callable[..., Any], keyset: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return kernel(keyset, *args, **kwargs)


_untraced = outside_dynamo(_run_untraced)
"""Runs a kernel below as Python where Dynamo would trace it. Dynamo compiles every Python frame that a
compiled function's graph-broken parts call, our kernels too when an op runs eagerly there (a DTensor
random op, whose sharding Dynamo leaves to eager code): traced, a draw would be recorded as the host
arithmetic of one call, baked into a graph. Behind the break it is the eager draw, at its position."""


def _switched(op: Any, portable: Callable[..., Any], below: Any) -> Callable[..., Any]:
    """The kernel registered for ``op``: ``portable`` on a thread in portable mode, else torch's own.

    A thread reaches it only while it includes the key; one that does without an entry of its own
    is an autograd thread running the backward pass of a thread that called ``backward()`` in the
    mode, which draws portably only under :class:`~hyperrng.portable.mode.mode_applied`. So does the rerun of
    a ``torch.utils.checkpoint`` block that replays nothing of hyperrng's (:func:`unreplayed_recompute`): its
    forward drew torch's numbers, outside the mode, and torch has put its generators back."""
    original = _below(op, below)
    key = _key()
    include = torch._C._dispatch_tls_set_dispatch_key_included

    what = _op_label(op)

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():  # Dynamo traces this frame: it runs as Python behind a graph break
            return _untraced(kernel, keyset, args, kwargs)
        if not THREAD.entries or keyset.has(_META):  # torch's: meta and fake tensors only propagate shapes
            return original(keyset, *args, **kwargs)
        local = sys.modules.get(_LOCAL_TENSOR)  # (LocalTensor's simulated ranks: never imported in most runs)
        if local is not None and local.enabled_local_tensor_mode() is not None:
            cancel_innermost(local=True)
            raise portable_refusal(what)
        verdict = checkpoint_verdict()
        if verdict is RERUN or (kwargs.get("generator") is not None and _own_host_generator(kwargs)):
            return original(keyset, *args, **kwargs)  # see unreplayed_recompute and _own_host_generator
        include(key, False)  # the kernel's own tensor ops run as outside the mode, skipping the key's composites
        try:
            if verdict is not None:
                refuse_unreplayed_checkpoint(what, verdict)
            return portable(*args, **kwargs)
        except HyperRNGError:
            cancel_innermost()
            raise
        finally:
            include(key, True)

    return kernel


def _switched_refusal(op: Any, refuse: Callable[..., Any], below: Any) -> Callable[..., Any]:
    """:func:`_switched` for an op without a portable kernel (:func:`_refusal`)."""
    refusing = _cancelling(refuse)
    original = _below(op, below)

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            return _untraced(kernel, keyset, args, kwargs)
        if THREAD.entries and not keyset.has(_META) and not unreplayed_recompute() and not _own_host_generator(kwargs):
            return refusing(original, keyset, *args, **kwargs)
        return original(keyset, *args, **kwargs)

    return kernel


def _has_composite_on_key(name: str) -> bool:
    """Whether op ``name`` has a kernel on the key that is not a fallthrough and that a fallthrough of its
    own may replace (torch's default kernels, except for ops reached from ``BackendSelect``, see :class:`_Kernels`)."""
    has = torch._C._dispatch_has_computed_kernel_for_dispatch_key
    return has(name, KEY_NAME) and not torch._C._dispatch_has_kernel_for_dispatch_key(name, "BackendSelect")


@functools.cache
def composite_random_ops() -> tuple[Any, ...]:
    """The random aten ops whose default kernel (``CompositeExplicitAutograd``) is made of other ops: the
    functional forms (``bernoulli.p`` is ``empty_like`` then ``bernoulli_``) and the factories (``rand``).

    They keep that default on the key, where it runs first, rather than a fallthrough: a device may
    register a kernel of its own for them (torch_xla does, for ``bernoulli``), and functionalization
    (torch_xla's, torch.compile's) turns every in-place random op into its functional form."""
    return tuple(op for op in _tagged_random_ops() if explicit_composite_key(op) is not None)


def explicit_composite_key(op: Any) -> str | None:
    """The key of ``op``'s explicit default kernel (``CompositeExplicitAutograd[NonFunctional]``), if it has one."""
    for key in _COMPOSITE_KEYS[1:]:
        if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key):
            return key
    return None


def defaults_left_on_key() -> list[str]:
    """The ops that keep torch's default kernel on the key although they take tensors: reached from
    ``BackendSelect`` (``_to_copy``, sparse constructors...), where a fallthrough of one op cannot serve.
    Tracing runs them with the key excluded (see hyperrng.portable._traced)."""
    found = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::") or not torch._C._dispatch_has_kernel_for_dispatch_key(name, "BackendSelect"):
            continue
        if not torch._C._dispatch_has_computed_kernel_for_dispatch_key(name, KEY_NAME):
            continue
        base, _, overload = name.partition(".")
        schema = torch._C._get_schema(base, overload)
        if any(isinstance(argument.type, torch._C.TensorType) for argument in schema.arguments):
            found.append(name)
    return found


class _Kernels:
    """Portable mode's kernels on the key, registered once per process and never changed again.

    The portable kernels and the refusals; a fallthrough as the key's fallback, for every op
    without a kernel there; and a fallthrough for each op torch registers a default (composite)
    kernel on the key for, as it does on every backend key: otherwise inside the mode such an
    op (``add``, ``exp_``, ``empty_like``...) would run that default instead of the device's own
    kernel, one more dispatch, and on meta tensors a loop through Python meta functions. The
    dispatcher skips a fallthrough key at no cost, so inside the mode only random ops reach
    Python. Ops reached from ``BackendSelect`` keep their default there (they are redispatched
    with the thread's keys, which a fallthrough of one op cannot serve): ``rand`` runs as
    ``empty`` and ``uniform_``, as on a backend. So do the random ops made of others
    (:func:`composite_random_ops`), so that no device's own kernel for them runs in the mode.
    Ops that libraries register after the first entry keep their defaults too.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.libraries: dict[str, Any] = {}  # kept for the life of the process: destroying one rewrites the table
        self.key: Any = None
        self.labels: list[str] = []  # ops with a portable kernel or a refusal at the key
        self.then: list[Callable[[Any], None]] = []  # called with the key once the kernels are registered

    def ensure(self) -> None:
        if self.key is not None:
            return
        with self.lock, warnings.catch_warnings():
            if self.key is not None:
                return
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            key = _key()
            below = torch._C._dispatch_keyset_full_after(key)
            kernels: dict[str, Callable[..., Any]] = {}
            for label, fn in PORTABLE_OPS.items():
                name, _, overload = label.partition(".")
                op = getattr(getattr(torch.ops.aten, name), overload or "default")
                kernels["aten::" + label] = _switched(op, fn, below)
            for op in _random_aten_ops():
                label = _op_label(op)
                if label not in PORTABLE_OPS:
                    kernels["aten::" + label] = _switched_refusal(op, _refusal(op), below)
            self._library("_").fallback(torch.library.fallthrough_kernel, KEY_NAME)
            made_of_random_ops = {op.name() for op in composite_random_ops()}
            for name in torch._C._dispatch_get_all_op_names():
                if name not in kernels and name not in made_of_random_ops and _has_composite_on_key(name):
                    self._impl(name, torch.library.fallthrough_kernel)
            for name, kernel in kernels.items():
                self._impl(name, kernel, with_keyset=True)
            for name, kernel in _attention_ops.kernels(_draws_portably, _before_attention).items():
                for autograd_key in _attention_ops.AUTOGRAD_KEYS:
                    self._impl("aten::" + name, kernel, with_keyset=True, key=autograd_key)
            self.labels = sorted(name.removeprefix("aten::") for name in kernels)
            for (
                then
            ) in self.then:  # what builds on the kernels (hyperrng.portable._traced), before any thread uses them
                then(key)
            self.key = key  # last: a thread that sees it sees every registration

    def _library(self, namespace: str) -> Any:
        library = self.libraries.get(namespace)
        if library is None:
            library = self.libraries[namespace] = torch.library.Library(namespace, "IMPL")
        return library

    def _impl(self, name: str, kernel: Callable[..., Any], with_keyset: bool = False, key: str = KEY_NAME) -> None:
        namespace, _, label = name.partition("::")
        self._library(namespace).impl(label, kernel, key, with_keyset=with_keyset)


_KERNELS = _Kernels()


def register_then(then: Callable[[Any], None]) -> None:
    """Call ``then(key)`` when the kernels are registered, before any thread sees them (now, if they are):
    how modules that build on them, and that this one does not import, join the registration."""
    with _KERNELS.lock:
        if _KERNELS.key is None:
            _KERNELS.then.append(then)
            return
    then(_KERNELS.key)


def register() -> None:
    """Make sure portable mode's kernels are registered (once per process, for good).

    Raises:
        UnsupportedPortableOpError: this torch cannot host them (the feature "portable-mode" of
            ``hyperrng.platforms._features``); nothing is registered then.
    """
    if _KERNELS.key is None:  # asked until registered: afterwards the kernels are there for good
        _features.require("portable-mode", UnsupportedPortableOpError)
        _KERNELS.ensure()


def registered() -> list[str]:
    """The ops (``name.overload``) with a portable kernel or a refusal on portable mode's key, sorted.

    Empty until a thread first enters portable mode; the kernels then stay (see the module
    docstring). Other ops only fall through the key, and no backend's kernel is touched, so
    outside the mode every op runs exactly as before registration.
    """
    return list(_KERNELS.labels)
