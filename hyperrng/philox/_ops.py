"""The aten kernels of portable mode, their registration with torch, and the per-thread flag.

:mod:`hyperrng.philox.mode` is the public face (entering, leaving, the switch); this
module is what it switches: a kernel per random aten op (:data:`PORTABLE_OPS`) that draws
at the current position with :func:`hyperrng.philox.position.draw_at_position`, or inside a
sharded region fills this rank's shard from global indices; a refusal for every other
random op (:func:`unsupported_ops`); and :data:`THREAD`, whose entries say whether the
calling thread draws portably.

Registration (:func:`register`) happens once per dispatch key (the CPU's, and ``CUDA`` or
``PrivateUse1`` for the platform's device) and is never undone, so entering and leaving
the mode never touch torch's dispatch table. Non-random ops never pass through Python.
Outside the mode a random op of those keys pays one Python call that reads :data:`THREAD`
and calls torch's own kernel, saved with ``torch.library.get_kernel`` (torch 2.9 and
newer) just before it was overridden: a few microseconds per op (``hyperrng bench --suite
philox``), and the same numbers as before registration.

Limits: float32/float64/float16/bfloat16 for ``uniform_``/``normal_`` (float64 values
carry 32 random bits), ``random_``/``randint`` ranges of at most ``2**32`` values (one
word each, ``low + word % range``), positions within the generator's offset range
(``2**63 - 1``); errors are typed and raised before any position moves.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

import hyperrng.platforms as platforms
from hyperrng import philox
from hyperrng.errors import ArgumentTypeError, HyperRNGError, InvalidArgumentError, UnsupportedPortableOpError
from hyperrng.philox.position import assemble_blocks, draw_at_position, shard_slices
from hyperrng.platforms import _features
from hyperrng.platforms.validate import round_up_offset
from hyperrng.sharded import active_region

__all__ = ["PORTABLE_OPS", "THREAD", "Entry", "register", "registered", "unsupported_ops"]


# -- the per-thread flag ------------------------------------------------------------------------
class Entry:
    """One entered context (or the switch) on a thread: what its exit undoes.

    :mod:`hyperrng.philox.mode` makes and removes entries; the kernels read only the
    last entry's ``compiled``.
    """

    __slots__ = ("owner", "compiled", "device", "saved", "dtensor", "ctrl_c")

    def __init__(self, owner: object, compiled: bool, device: tuple[str, int] | None) -> None:
        self.owner = owner
        self.compiled = compiled
        self.device = device  # the device whose generator this entry holds, if any
        self.saved: torch.Tensor | None = None  # the generator state its exit restores, if any
        self.dtensor = False  # whether it counts as a user of the DTensor routing
        self.ctrl_c = False  # whether it counts as a user of the Ctrl-C handler


class _ThreadEntries(threading.local):
    """This thread's entries, outermost first: the thread draws portably while there is one."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []


THREAD = _ThreadEntries()
"""The per-thread flag: ``THREAD.entries`` (outermost first) of the calling thread; it draws
portably while there is one."""


_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_MAX_RANGE = 2**32  # random_/randint draw one 32-bit word per element
_COMPILED_SEED_RANGE = (-(2**63), 2**63 - 1)  # how torch.compile'd code draws the seeds of its random ops
_COMPILED_DEVICE_TYPES = frozenset({"cpu", "cuda"})  # where torch.compile runs the Philox loop


# -- positions ---------------------------------------------------------------------------------
def _draw(
    what: str,
    fn: Callable[..., torch.Tensor],
    target: torch.Tensor,
    generator: torch.Generator | None,
    **kw: Any,
) -> torch.Tensor:
    """Values of ``fn`` for ``target``'s elements at the current position; advance it past them.

    Inside a sharded region the values are this rank's block of the region's global
    tensor at the region's base position, and the region advances every rank on exit.
    ``fn`` runs before any position moves, so its validation leaves everything as it was.
    """
    device = target.device
    kw.update(device=device, compiled=THREAD.entries[-1].compiled and device.type in _COMPILED_DEVICE_TYPES)
    region = active_region()
    if region is not None:  # a refusal here cancels the region (see _cancelling): every rank stays put
        global_shape, blocks = _shard_of(region, target, what)
        key, offset = region.position
        values = assemble_blocks(blocks, lambda block: fn(global_shape, key=key, offset=offset, shard=block, **kw))
        region.consume(round_up_offset(math.prod(global_shape)))
        return values
    p = platforms.current()
    if generator is not None and not (p.counter_based and generator.device.type == p.device_type):
        raise UnsupportedPortableOpError(
            f"{what} with generator= a {generator.device.type} generator: portable mode reads positions only "
            f"from counter-based generators of the platform, and {p.name!r} has "
            f"{'another device type' if p.counter_based else 'none'}. Draw from a tracker stream (tracker.fork) "
            f"or portable_random(seed) instead."
        )
    shape = tuple(target.shape)
    return draw_at_position(target.numel(), generator, lambda key, offset: fn(shape, key=key, offset=offset, **kw))


def _shard_of(region: Any, target: torch.Tensor, what: str) -> tuple[tuple[int, ...], list[list[slice]]]:
    """The global shape of the region's op and, per dim, the slices of it that ``target`` holds."""
    for placement in region.placements:
        if getattr(placement, "is_partial", lambda: False)():
            raise InvalidArgumentError(
                f"{what} on a tensor with placement {placement}: a partial tensor holds summands, not elements, "
                f"so portable mode cannot fill it; redistribute it to Replicate() or Shard() first."
            )
    global_shape = philox.check_shape(region.global_shape)
    per_dim = shard_slices(region.mesh, region.placements, global_shape)
    local = tuple(sum(s.stop - s.start for s in slices) for slices in per_dim)
    if local != tuple(target.shape):
        raise InvalidArgumentError(
            f"{what} on a tensor of shape {tuple(target.shape)} inside a sharded region whose shard has shape "
            f"{local} (global {global_shape}); run ops on other tensors outside the region."
        )
    return global_shape, per_dim


# -- the portable kernels ----------------------------------------------------------------------
def _check_floating(target: torch.Tensor, what: str) -> None:
    if target.dtype not in _FLOAT_DTYPES:
        names = ", ".join(str(d) for d in _FLOAT_DTYPES)
        raise ArgumentTypeError(f"portable {what} fills {names} tensors; got a {target.dtype} tensor.")


def _fill(what: str, fn: Callable[..., torch.Tensor], self: torch.Tensor, generator: Any, **kw: Any) -> torch.Tensor:
    """Draw ``fn``'s values, of dtype ``kw["dtype"]``, into ``self``: in place where it is one contiguous
    block of the draw in that dtype, which saves a second tensor and a copy (as much work as the
    rounds), else through a copy."""
    if kw["dtype"] == self.dtype and self.is_contiguous() and active_region() is None:
        _draw(what, fn, self, generator, out=self, **kw)
        return self
    return self.copy_(_draw(what, fn, self, generator, **kw))


def _uniform_(
    self: torch.Tensor, low: float = 0.0, high: float = 1.0, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    _check_floating(self, "uniform_")
    return _fill("uniform_", philox.uniform, self, generator, dtype=self.dtype, low=low, high=high)


def _normal_(
    self: torch.Tensor, mean: float = 0.0, std: float = 1.0, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    _check_floating(self, "normal_")
    return _fill("normal_", philox.normal, self, generator, dtype=self.dtype, mean=mean, std=std)


def _bernoulli_float(self: torch.Tensor, p: float = 0.5, *, generator: torch.Generator | None = None) -> torch.Tensor:
    # Straight into a floating-point tensor (dropout's noise): no bool mask and no copy.
    dtype = self.dtype if self.dtype in _FLOAT_DTYPES else torch.bool
    return _fill("bernoulli_", philox.bernoulli, self, generator, p=p, dtype=dtype)


def _bernoulli_tensor(self: torch.Tensor, p: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
    if not p.is_floating_point():
        raise ArgumentTypeError(f"bernoulli_ takes floating-point probabilities, got a {p.dtype} tensor.")
    try:
        probabilities = p.expand(self.shape)
    except RuntimeError:
        raise InvalidArgumentError(
            f"bernoulli_: probabilities of shape {tuple(p.shape)} do not broadcast to the tensor's shape "
            f"{tuple(self.shape)}."
        ) from None
    if p.numel() and not bool(((p >= 0) & (p <= 1)).all()):  # NaN fails both comparisons
        raise InvalidArgumentError("bernoulli_: every probability must be in [0, 1] (NaN is not).")
    # A word is below round(p * 2**32) with probability p: the scalar path's integer compare,
    # with p * 2**32 exact in float64 for every float32/float16/bfloat16/float64 p.
    threshold = torch.round(probabilities.to(torch.float64) * float(_MAX_RANGE)).to(torch.int64)
    return self.copy_(_draw("bernoulli_", philox.random_bits, self, generator) < threshold)


def _random_from(
    self: torch.Tensor, low: int, high: int | None = None, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    if high is None:
        raise InvalidArgumentError(
            f"random_({low}, None) draws the whole range of {self.dtype}; portable mode draws ranges of at most "
            f"2**32 values: pass an upper bound."
        )
    span = high - low
    if (low, high) == _COMPILED_SEED_RANGE:
        raise UnsupportedPortableOpError(
            "a torch.compile'd function draws its random numbers from seeds it takes with randint over the "
            "whole int64 range, and compiled random ops are not portable. Set "
            "torch._inductor.config.fallback_random = True (compiled code then calls torch's random ops, "
            "which are portable here), or call the compiled function outside portable_random()."
        )
    if not 1 <= span <= _MAX_RANGE:
        raise InvalidArgumentError(
            f"random_/randint: the range [{low}, {high}) holds {span} values; portable mode needs 1 to 2**32."
        )
    if self.dtype == torch.bool:
        limits: tuple[float, float] = (0, 1)
    elif self.is_floating_point():
        limits = (-torch.finfo(self.dtype).max, torch.finfo(self.dtype).max)
    else:
        limits = (torch.iinfo(self.dtype).min, torch.iinfo(self.dtype).max)
    if low < limits[0] or high - 1 > limits[1]:
        raise InvalidArgumentError(f"random_/randint: the range [{low}, {high}) does not fit {self.dtype}.")
    bits = _draw("random_", philox.random_bits, self, generator)
    return self.copy_(bits.remainder_(span).add_(low))


def _random_to(self: torch.Tensor, high: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    return _random_from(self, 0, high, generator=generator)


def _native_dropout(x: torch.Tensor, p: float, train: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    if train is False:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    if not x.is_floating_point():
        raise ArgumentTypeError(f"dropout expects a floating-point tensor, got {x.dtype}.")
    p_value = philox.check_probability(p)
    # The keep mask and arithmetic of F.dropout's CPU decomposition (bernoulli_(1 - p), then
    # a scale), so fused and unfused dropout, and hyperrng.philox.dropout, give the same bits.
    keep = _draw("native_dropout", philox.bernoulli, x, None, p=1.0 - p_value)
    return philox.apply_dropout_mask(x, keep, p_value), keep


PORTABLE_OPS: dict[str, Callable[..., Any]] = {
    "uniform_": _uniform_,
    "normal_": _normal_,
    "bernoulli_.float": _bernoulli_float,
    "bernoulli_.Tensor": _bernoulli_tensor,
    "random_.from": _random_from,
    "random_.to": _random_to,
    "native_dropout": _native_dropout,
}
"""The aten ops portable mode implements, by ``name.overload``; torch's ``rand``, ``randn``,
``rand_like``, ``randn_like``, ``randint``, ``randint_like``, ``bernoulli``, ``normal``
with float arguments, ``dropout`` and ``nn.init`` reach them through torch's own
decompositions."""


# -- refusals ----------------------------------------------------------------------------------
_COMPOSITE_KEYS = ("CompositeImplicitAutograd", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")
_DROPOUT_ARGS = ("dropout_p", "dropout")
_TRAINING_ARGS = ("train", "training")


@functools.cache
def _random_aten_ops() -> tuple[Any, ...]:
    """Every aten op that draws random numbers in a kernel of its own (no composite decomposition).

    Found once per process (walking aten's ops takes ~20 ms; entering the mode must not)."""
    found = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        overloads = getattr(packet, "overloads", None)
        if overloads is None:
            continue
        for overload in overloads():
            op = getattr(packet, overload)
            random = torch.Tag.nondeterministic_seeded in op.tags or name == "random_"
            if random and not any(
                torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), k) for k in _COMPOSITE_KEYS
            ):
                found.append(op)
    return tuple(found)


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
    kernel (``original``, given the dispatch key set) when the arguments make the op deterministic."""
    label = _op_label(op)
    dropout = _argument_reader(op, _DROPOUT_ARGS)
    training = _argument_reader(op, _TRAINING_ARGS)

    def refuse(original: Callable[..., Any], keyset: Any, *args: Any, **kwargs: Any) -> Any:
        deterministic = (dropout is not None and not dropout(args, kwargs)) or (
            training is not None and not training(args, kwargs)
        )
        if deterministic:
            return original(keyset, *args, **kwargs)
        raise UnsupportedPortableOpError(
            f"{label} has no portable implementation, and portable mode never falls back to a device's own "
            f"generator; call it outside portable_random(), or use a portable op ({', '.join(PORTABLE_OPS)})."
        )

    return refuse


# -- registration: once per dispatch key, for good ----------------------------------------------


def _portable_keys(device_type: str) -> list[str] | None:
    """The dispatch keys whose kernels make ``device_type``'s random ops portable (with the CPU's,
    which host tensors need), or ``None`` when portable mode has no kernels for that device type."""
    if device_type == "cpu":
        return ["CPU"]
    if device_type == "cuda":
        return ["CPU", "CUDA"]
    if device_type == torch._C._get_privateuse1_backend_name():  # an NPU, the simulated device, a plug-in
        return ["CPU", "PrivateUse1"]
    return None


def _has_kernel(op: Any, key: str) -> bool:
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key):
        return True
    # A PrivateUse1 backend written as a fallback (the simulated device) has no kernel per op.
    return key == "PrivateUse1" and torch._C._get_privateuse1_backend_name() != "privateuseone"


@functools.cache
def _cancelling(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``kernel``, cancelling the active sharded region when it refuses an op (a bad dtype, an
    unsupported op): every rank then stays where it was instead of moving past the op."""

    @functools.wraps(kernel)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return kernel(*args, **kwargs)
        except HyperRNGError:
            region = active_region()
            if region is not None:
                region.cancel()
            raise

    return run


class _Original:
    """Torch's kernel for one op and dispatch key, saved before portable mode overrode it; ``call``
    takes the dispatch key set and the op's arguments."""

    __slots__ = ("call",)

    def __init__(self, op: Any, key: str) -> None:
        kernel = torch.library.get_kernel(op, key)
        self.call: Callable[..., Any] = kernel.call_boxed
        if key == "PrivateUse1" and not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key):
            self.call = functools.partial(_fallback, op, kernel)


def _fallback(op: Any, kernel: Any, keyset: Any, *args: Any, **kwargs: Any) -> Any:
    """A PrivateUse1 backend's fallback for ``op``, where it has no kernel of its own.

    For tensor subclasses (the simulated device) torch reaches a Python fallback through the
    Python kernel the key holds now, which is the portable one: call the backend's
    ``__torch_dispatch__`` instead, which is what its fallback runs. Other backends' fallbacks
    are called as saved.
    """
    for arg in args:
        kind = type(arg)
        if isinstance(arg, torch.Tensor) and kind is not torch.Tensor and hasattr(kind, "__torch_dispatch__"):
            return kind.__torch_dispatch__(op, (kind,), args, kwargs)
    return kernel.call_boxed(keyset, *args, **kwargs)


def _switched(portable: Callable[..., Any], original: _Original) -> Callable[..., Any]:
    """The kernel registered for one op and key: ``portable`` on a thread in portable mode, else
    ``original`` (torch's kernel for that key, saved before it was overridden) with torch's key set."""
    passthrough = original.call

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if THREAD.entries:
            return portable(*args, **kwargs)
        return passthrough(keyset, *args, **kwargs)

    return kernel


def _switched_refusal(refuse: Callable[..., Any], original: _Original) -> Callable[..., Any]:
    """:func:`_switched` for an op without a portable kernel (:func:`_refusal`)."""
    refusing = _cancelling(refuse)
    passthrough = original.call

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if THREAD.entries:
            return refusing(passthrough, keyset, *args, **kwargs)
        return passthrough(keyset, *args, **kwargs)

    return kernel


class _Kernels:
    """The (op, dispatch key) pairs registered so far: once per key, for good (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.library: Any = None  # kept for the life of the process: destroying it would rewrite the table
        self.done: set[tuple[str, str]] = set()  # (op, key) pairs overridden
        self.keys: set[str] = set()  # keys whose every op is overridden

    def ensure(self, keys: Sequence[str]) -> None:
        if self.keys.issuperset(keys):
            return
        with self.lock, warnings.catch_warnings():
            # torch warns once that an override replaces its kernel: that is the point here.
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            if self.library is None:
                self.library = torch.library.Library("aten", "IMPL")
            for key in keys:
                if key not in self.keys:
                    self._register(key)
                    self.keys.add(key)

    def _register(self, key: str) -> None:
        # Every original is read before anything is overridden, so each is torch's own kernel.
        kernels: list[tuple[str, Callable[..., Any]]] = []
        for label, fn in PORTABLE_OPS.items():
            if (label, key) not in self.done:
                name, _, overload = label.partition(".")
                op = getattr(getattr(torch.ops.aten, name), overload or "default")
                kernels.append((label, _switched(_cancelling(fn), _Original(op, key))))
        for op in _random_aten_ops():
            label = _op_label(op)
            if label not in PORTABLE_OPS and (label, key) not in self.done and _has_kernel(op, key):
                kernels.append((label, _switched_refusal(_refusal(op), _Original(op, key))))
        for label, kernel in kernels:
            self.library.impl(label, kernel, key, with_keyset=True)
            self.done.add((label, key))


_KERNELS = _Kernels()


def register(p: platforms.Platform) -> None:
    """Make sure the portable kernels that platform ``p`` needs are registered (once per key, for good).

    Raises:
        UnsupportedPortableOpError: torch is older than 2.9, or ``p``'s device type has no
            portable kernels. Nothing is registered then.
    """
    _KERNELS.ensure(_supported_keys(p))


def registered() -> list[tuple[str, str]]:
    """The ``(op, dispatch key)`` pairs this process has registered portable kernels for, sorted.

    Empty until a thread first enters portable mode; the kernels then stay (see the module
    docstring), which is what outside-the-mode costs and numbers are measured against.
    """
    return sorted(_KERNELS.done)


def _supported_keys(p: platforms.Platform) -> list[str]:
    """The dispatch keys portable mode needs on platform ``p``; refuse, changing nothing, where it cannot run."""
    _features.require("portable-mode", UnsupportedPortableOpError)
    keys = _portable_keys(p.device_type)
    if keys is None:
        p.device()  # a backend that registers with torch on first use (the simulated device) does so now
        keys = _portable_keys(p.device_type)
    if keys is None:
        raise UnsupportedPortableOpError(
            f"portable mode has no kernels for device type {p.device_type!r} (platform {p.name!r}): it has them "
            f"for 'cpu', 'cuda' and torch's PrivateUse1 backend ({torch._C._get_privateuse1_backend_name()!r}); "
            f"draw with hyperrng.philox.position's functions on that device instead."
        )
    return keys
