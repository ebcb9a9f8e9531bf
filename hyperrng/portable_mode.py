"""Portable mode: torch's own random ops draw Philox4x32-10, the same numbers everywhere.

Inside ``with hyperrng.portable_random(seed):`` (or after
``hyperrng.set_portable_random(True, seed)``) ``torch.rand``, ``torch.randn``,
``rand_like``, ``randn_like``, ``torch.randint``, ``Tensor.uniform_``/``normal_``/
``bernoulli_``/``random_``, ``F.dropout`` (and ``native_dropout``, its fused form on
accelerators) and every ``torch.nn.init`` function built on them draw from
:mod:`hyperrng.philox`:

* **One global sequence.** Each op takes the (key, offset) position of the current
  generator, computes element ``i`` of its result from global index ``offset + i``, and
  moves the position by its element count rounded up to a multiple of 4 (whole Philox
  blocks), as CUDA's generator does. The numbers depend on the position and the shape
  only: the same on the CPU, CUDA, an NPU or the simulated device (uniform, bernoulli,
  dropout masks, randint bit for bit; normal within a few ulp, see
  :func:`hyperrng.philox.normal`).
* **Positions.** With a ``seed`` the context starts at (seed, 0) and gives the generator
  its previous state back on exit. Without one it continues from where the generator
  is and leaves it advanced: the current device generator of the platform, which is
  the stream inside ``tracker.fork(name)``, or the generator passed as ``generator=``.
  The position is the platform's, whatever device a tensor is on. An explicit
  ``generator=`` is honoured where it is one of the platform's counter-based
  generators (CUDA, NPU); elsewhere (a CPU ``torch.Generator``, which has no position
  that survives torch's dispatcher) it is refused with :class:`UnsupportedPortableOpError`.
* **Sharded tensors.** Inside a sharded region (a random op on a DTensor with the
  adapter of :meth:`hyperrng.ShardedRNGTracker.install_dtensor`, or
  :meth:`~hyperrng.ShardedRNGTracker.distribute_region`) an op fills this rank's shard
  from the *global* indices of its elements at the region's base position, and the
  region moves every rank to base + the global count rounded up to 4 (the advance of
  the unsharded op, not the padded shard layout of non-portable sharded draws): no
  collective, replicas equal, the shards put together are the tensor an unsharded
  process draws, and the next op starts where it would in an unsharded process.
* **No silent fallback.** A random op with no portable kernel (``randperm``,
  ``multinomial``, ``exponential_``, ``poisson``, ... see :func:`unsupported_ops`)
  raises :class:`UnsupportedPortableOpError` naming it. Ops that are random only for
  some arguments (attention and RNN kernels with ``dropout_p``/``dropout``, ``rrelu``
  with ``training``) run torch's kernel when those make them deterministic.

**Per thread.** Whether a random op draws portably is a flag of the calling thread: on
while one of its contexts is entered or its switch (:func:`set_portable_random`) is on.
Random ops on other threads keep torch's own kernels and numbers. Entering also holds
the current device's generator for the thread (:mod:`hyperrng._exclusive`), so a second
thread that enters portable mode meanwhile, or anything that holds that generator by the
same policy, is refused with :class:`~hyperrng.errors.GeneratorBusyError`, nothing changed.
A plain draw on another thread is not intercepted: a draw from the same device generator
(``torch.rand`` without ``generator=``) moves the position the portable thread draws from.
Work that torch runs on its own threads does not inherit the flag: on accelerators
autograd runs the backward pass on per-device threads. A recompute in backward (activation
checkpointing) therefore draws portably only where it re-applies the flag its forward pass
ran with (``_thread_mode`` and ``_mode_applied`` here are for that), which is also what it
needs on the CPU when ``backward()`` runs after the context has exited;
``torch.utils.checkpoint`` does not, so its recompute draws torch's own numbers then.

**Kernels.** The kernels are registered with torch once per dispatch key (the CPU's, and
``CUDA`` or ``PrivateUse1`` for the platform's device) when a thread first enters the
mode, and stay: entering and leaving only set the flag, and never touch torch's dispatch
table. Registration changes the table, so a program that starts threads which draw
should enter the mode once before it starts them. Non-random ops never pass through
Python. Outside the mode a random op of the CPU, CUDA or PrivateUse1 key pays one Python
call that reads the flag and calls torch's own kernel, saved with
``torch.library.get_kernel`` when it was overridden (a few microseconds per op, see
``hyperrng bench --suite philox``): the same numbers as before registration. That
function exists from torch 2.9 on; on older torch, and on a platform whose device type
has no portable kernels (not ``cpu``, ``cuda`` or the PrivateUse1 backend), entering
raises :class:`UnsupportedPortableOpError` and changes nothing.

**DTensor.** While any thread is in the mode, DTensor's RNG tracker (one per process) is
hyperrng's adapter (:meth:`hyperrng.ShardedRNGTracker.install_dtensor`), installed by the
first entry unless it is there already and replaced by what was there at the last exit,
so ``portable_random(seed)`` alone makes DTensor random ops sharding-invariant. It does
so when DTensor is in use: ``torch.distributed.tensor`` imported or a process group
initialised at entry. Not yet on CUDA meshes: there DTensor runs a random op without
``generator=`` through a traceable path that asks the tracker for offsets only, with no
region for the portable kernels to draw the shard's global indices from.

**Ctrl-C.** Entering and leaving run with SIGINT deferred (on the main thread, the one
that receives it): a KeyboardInterrupt finds the mode and the generator as before the
entry or as after the exit, never in between.

Limits: float32/float64/float16/bfloat16 for ``uniform_``/``normal_`` (float64 values
carry 32 random bits), ``random_``/``randint`` ranges of at most ``2**32`` values (one
word each, ``low + word % range``), positions within the generator's offset range
(``2**63 - 1``); errors are typed and raised before any position moves.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import torch

import hyperrng.platforms as platforms
from hyperrng import _exclusive, philox
from hyperrng.errors import (
    ArgumentTypeError,
    HyperRNGError,
    InvalidParameterError,
    InvalidShapeError,
    ShardingError,
    UnsupportedDTypeError,
    UnsupportedPortableOpError,
)
from hyperrng.platforms import _features
from hyperrng.platforms.validate import check_seed, round_up_offset
from hyperrng.portable import _assemble, _reserved, shard_slices
from hyperrng.sharded import ShardedRNGTracker, active_region

__all__ = [
    "PORTABLE_OPS",
    "PORTABLE_STATE_FORMAT",
    "is_portable_random_enabled",
    "load_portable_state_dict",
    "portable_random",
    "portable_state_dict",
    "set_portable_random",
    "tp_invariance_report",
    "unsupported_ops",
]

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
    kw.update(device=device, compiled=_THREAD.entries[-1].compiled and device.type in _COMPILED_DEVICE_TYPES)
    region = active_region()
    if region is not None:  # a refusal here cancels the region (see _cancelling): every rank stays put
        global_shape, blocks = _shard_of(region, target, what)
        key, offset = region.position
        values = _assemble(blocks, lambda block: fn(global_shape, key=key, offset=offset, shard=block, **kw))
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
    return _reserved(target.numel(), generator, lambda key, offset: fn(shape, key=key, offset=offset, **kw))


def _shard_of(region: Any, target: torch.Tensor, what: str) -> tuple[tuple[int, ...], list[list[slice]]]:
    """The global shape of the region's op and, per dim, the slices of it that ``target`` holds."""
    for placement in region.placements:
        if getattr(placement, "is_partial", lambda: False)():
            raise ShardingError(
                f"{what} on a tensor with placement {placement}: a partial tensor holds summands, not elements, "
                f"so portable mode cannot fill it; redistribute it to Replicate() or Shard() first."
            )
    global_shape = philox._check_shape(region.global_shape)
    per_dim = shard_slices(region.mesh, region.placements, global_shape)
    local = tuple(sum(s.stop - s.start for s in slices) for slices in per_dim)
    if local != tuple(target.shape):
        raise ShardingError(
            f"{what} on a tensor of shape {tuple(target.shape)} inside a sharded region whose shard has shape "
            f"{local} (global {global_shape}); run ops on other tensors outside the region."
        )
    return global_shape, per_dim


# -- the portable kernels ----------------------------------------------------------------------
def _check_floating(target: torch.Tensor, what: str) -> None:
    if target.dtype not in _FLOAT_DTYPES:
        names = ", ".join(str(d) for d in _FLOAT_DTYPES)
        raise UnsupportedDTypeError(f"portable {what} fills {names} tensors; got a {target.dtype} tensor.")


def _fill(what: str, fn: Callable[..., torch.Tensor], self: torch.Tensor, generator: Any, **kw: Any) -> torch.Tensor:
    """Draw ``fn``'s values into ``self``: in place where it is one contiguous block of the draw,
    which saves a second tensor and a copy (as much work as the rounds), else through a copy."""
    if self.is_contiguous() and active_region() is None:
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
    return self.copy_(_draw("bernoulli_", philox.bernoulli, self, generator, p=p))


def _bernoulli_tensor(self: torch.Tensor, p: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
    if not p.is_floating_point():
        raise UnsupportedDTypeError(f"bernoulli_ takes floating-point probabilities, got a {p.dtype} tensor.")
    try:
        probabilities = p.expand(self.shape)
    except RuntimeError:
        raise InvalidShapeError(
            f"bernoulli_: probabilities of shape {tuple(p.shape)} do not broadcast to the tensor's shape "
            f"{tuple(self.shape)}."
        ) from None
    if p.numel() and not bool(((p >= 0) & (p <= 1)).all()):  # NaN fails both comparisons
        raise InvalidParameterError("bernoulli_: every probability must be in [0, 1] (NaN is not).")
    # A word is below round(p * 2**32) with probability p: the scalar path's integer compare,
    # with p * 2**32 exact in float64 for every float32/float16/bfloat16/float64 p.
    threshold = torch.round(probabilities.to(torch.float64) * float(_MAX_RANGE)).to(torch.int64)
    return self.copy_(_draw("bernoulli_", philox.random_bits, self, generator) < threshold)


def _random_from(
    self: torch.Tensor, low: int, high: int | None = None, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    if high is None:
        raise InvalidParameterError(
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
        raise InvalidParameterError(
            f"random_/randint: the range [{low}, {high}) holds {span} values; portable mode needs 1 to 2**32."
        )
    if self.dtype == torch.bool:
        limits: tuple[float, float] = (0, 1)
    elif self.is_floating_point():
        limits = (-torch.finfo(self.dtype).max, torch.finfo(self.dtype).max)
    else:
        limits = (torch.iinfo(self.dtype).min, torch.iinfo(self.dtype).max)
    if low < limits[0] or high - 1 > limits[1]:
        raise InvalidParameterError(f"random_/randint: the range [{low}, {high}) does not fit {self.dtype}.")
    bits = _draw("random_", philox.random_bits, self, generator)
    return self.copy_(bits.remainder_(span).add_(low))


def _random_to(self: torch.Tensor, high: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    return _random_from(self, 0, high, generator=generator)


def _native_dropout(x: torch.Tensor, p: float, train: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    if train is False:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    if not x.is_floating_point():
        raise UnsupportedDTypeError(f"dropout expects a floating-point tensor, got {x.dtype}.")
    keep_p = 1.0 - philox._check_probability(p)
    keep = _draw("native_dropout", philox.bernoulli, x, None, p=keep_p)
    if keep_p == 0.0:
        return torch.zeros_like(x), keep
    # The same ops as torch's unfused dropout on the CPU (a 0/1 mask divided by 1 - p, then
    # a product), so fused and unfused dropout give the same bits.
    return x * keep.to(x.dtype).div_(keep_p), keep


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
        if _THREAD.entries:
            return portable(*args, **kwargs)
        return passthrough(keyset, *args, **kwargs)

    return kernel


def _switched_refusal(refuse: Callable[..., Any], original: _Original) -> Callable[..., Any]:
    """:func:`_switched` for an op without a portable kernel (:func:`_refusal`)."""
    refusing = _cancelling(refuse)
    passthrough = original.call

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if _THREAD.entries:
            return refusing(passthrough, keyset, *args, **kwargs)
        return passthrough(keyset, *args, **kwargs)

    return kernel


class _Kernels:
    """The portable kernels, registered with torch once per dispatch key and never removed.

    Registering changes torch's dispatch table, so it happens at most once per key in a
    process: when a thread first enters portable mode with a platform that needs the key.
    Each kernel looks at a per-thread flag (:data:`_THREAD`) and, outside the mode, calls
    torch's own kernel, saved with ``torch.library.get_kernel`` just before overriding it.
    """

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


def _check_supported(p: platforms.Platform) -> list[str]:
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
            f"draw with hyperrng.portable's functions on that device instead."
        )
    return keys


# -- DTensor routing -----------------------------------------------------------------------------
class _DTensorRouting:
    """DTensor's RNG tracker (one per process) is hyperrng's while any thread is in portable mode.

    The first entry installs the adapter of :meth:`ShardedRNGTracker.install_dtensor` unless
    hyperrng's is there already; the last exit puts back what was there.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.installed: Any = None  # the adapter this routing installed, if it did
        self.previous: Any = None  # the tracker it replaced
        self.tracker: ShardedRNGTracker | None = None

    def acquire(self) -> bool:
        """Count one user; install the adapter if it is the first. ``False``: DTensor is not in use."""
        random_mod = _dtensor_random_module()
        if random_mod is None:
            return False
        with self.lock:
            if not self.users and not _is_hyperrng_adapter(random_mod._rng_tracker):
                if self.tracker is None:
                    self.tracker = ShardedRNGTracker()
                previous = self.tracker.install_dtensor()
                self.installed, self.previous = random_mod._rng_tracker, previous
            self.users += 1
        return True

    def release(self) -> None:
        """Count one user out; the last puts back the tracker the first replaced (unless someone replaced ours)."""
        with self.lock:
            self.users -= 1
            if self.users or self.installed is None:
                return
            random_mod = _dtensor_random_module()
            if random_mod is not None and random_mod._rng_tracker is self.installed:
                ShardedRNGTracker.uninstall_dtensor(self.previous)
            self.installed = self.previous = None


def _dtensor_random_module() -> Any:
    """DTensor's RNG module when DTensor is in use (imported, or a process group is up), else ``None``."""
    dist = torch.distributed
    if "torch.distributed.tensor" not in sys.modules and not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        from torch.distributed.tensor import _random
    except ImportError:  # a torch built without distributed tensors
        return None
    return _random if hasattr(_random, "_rng_tracker") else None


def _is_hyperrng_adapter(tracker: object) -> bool:
    kind = type(tracker)
    return kind.__module__ == ShardedRNGTracker.__module__ and kind.__name__ == "HyperRNGDTensorTracker"


_DTENSOR = _DTensorRouting()


# -- the per-thread flag, and Ctrl-C -------------------------------------------------------------
class _Entry:
    """One entered context (or the switch) on a thread: what its exit undoes."""

    __slots__ = ("owner", "compiled", "device", "saved", "dtensor", "ctrl_c")

    def __init__(self, owner: object, compiled: bool, device: tuple[str, int] | None) -> None:
        self.owner = owner
        self.compiled = compiled
        self.device = device  # the device whose generator this entry holds, if any
        self.saved: torch.Tensor | None = None  # the generator state its exit restores, if any
        self.dtensor = False  # whether it counts as a user of the DTensor routing
        self.ctrl_c = False  # whether it counts as a user of the Ctrl-C handler


class _ThreadMode(threading.local):
    """This thread's entries, outermost first: the thread draws portably while there is one."""

    def __init__(self) -> None:
        self.entries: list[_Entry] = []


_THREAD = _ThreadMode()
_SWITCH = object()  # the owner that stands for set_portable_random(True)


class _CtrlC:
    """Ctrl-C while the main thread is in portable mode: raised as usual, except while that thread
    enters or leaves the mode, where it waits until the step is done.

    Only the main thread receives SIGINT. Its first entry puts this handler in place of a
    Python one (the default raises KeyboardInterrupt) and its last exit puts that back. The
    handler looks at the frames it interrupts: inside entering or leaving (from their first
    instruction on) it records the interrupt, which the step raises once done, so an
    interrupt finds the mode and the generator as before the entry or as after the exit.
    """

    def __init__(self) -> None:
        self.previous: Any = None  # the handler replaced, while this one is in place
        self.users = 0
        self.pending: Any = None  # the frame a recorded interrupt arrived in

    def install(self) -> bool:
        """Count the main thread's entry in, putting the handler in place for the first; ``False`` elsewhere."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if not self.users:
            handler = signal.getsignal(signal.SIGINT)
            if not callable(handler):  # ignored, the C default, or a handler set outside Python
                return False
            signal.signal(signal.SIGINT, self._handle)
            self.previous = handler
        self.users += 1
        return True

    def uninstall(self) -> None:
        self.users -= 1
        if not self.users:
            previous, self.previous = self.previous, None
            if signal.getsignal(signal.SIGINT) == self._handle:  # unless the program set its own meanwhile
                signal.signal(signal.SIGINT, previous)

    def _handle(self, signum: int, frame: Any) -> None:
        f = frame
        while f is not None:
            if f.f_code in _STEPS:
                self.pending = frame
                return
            f = f.f_back
        (self.previous or signal.default_int_handler)(signum, frame)

    def raise_pending(self) -> None:
        """Raise the recorded interrupt (through the handler it would have reached)."""
        frame, self.pending = self.pending, None
        (self.previous or signal.default_int_handler)(signal.SIGINT, frame)


_CTRL_C = _CtrlC()


def _enter(owner: object, p: platforms.Platform, seed: int | None, compiled: bool, what: str) -> _Entry:
    """Put this thread in portable mode: hold the device, save, route DTensor, position; then the flag.

    Validates first; on any exception undoes what it did, so the thread, the generator and
    the DTensor tracker are as before.
    """
    entry = _Entry(owner, compiled, None)
    entry.ctrl_c = _CTRL_C.install()  # first: from here on an interrupt waits for the step
    try:
        _KERNELS.ensure(_check_supported(p))
        device = (p.device_type, p.current_device())
        _exclusive.hold(*device, what)
        entry.device = device
        if seed is not None:
            entry.saved = p.get_rng_state()
        entry.dtensor = _DTENSOR.acquire()
        if seed is not None:
            p.set_seed_offset(seed, 0)
    except BaseException:
        _undo(entry)
        raise
    if owner is _SWITCH:  # the switch is the outermost entry: contexts entered before it keep their settings
        _THREAD.entries.insert(0, entry)
    else:
        _THREAD.entries.append(entry)
    return entry


def _leave(entry: _Entry) -> None:
    """Take ``entry`` out of this thread's mode, then undo what it did (every step, whatever raises)."""
    entries = _THREAD.entries
    for i in range(len(entries) - 1, -1, -1):
        if entries[i] is entry:
            del entries[i]
            break
    _undo(entry)


def _undo(entry: _Entry) -> None:
    try:
        if entry.saved is not None:
            platforms.current().set_rng_state(entry.saved)
            entry.saved = None
    finally:
        try:
            if entry.dtensor:
                entry.dtensor = False
                _DTENSOR.release()
        finally:
            try:
                if entry.device is not None:
                    device, entry.device = entry.device, None
                    _exclusive.release(*device)
            finally:
                if entry.ctrl_c:  # last: an interrupt after it finds every step done
                    entry.ctrl_c = False
                    _CTRL_C.uninstall()


def _step_done(entry: _Entry | None) -> None:
    """End of entering (``entry``) or leaving (``None``): raise an interrupt that arrived meanwhile,
    after undoing the entry, so the interrupt finds the state as before it."""
    if _CTRL_C.pending is not None and threading.current_thread() is threading.main_thread():
        if entry is not None:
            _leave(entry)
        _CTRL_C.raise_pending()
    if entry is not None and entry.owner is _SWITCH:
        entry.saved = None  # entered: turning the switch off leaves the generator where it is


def _check_bool(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{what} must be a bool (True or False), got {type(value).__name__} {value!r}.")
    return value


def _check_optional_seed(seed: object) -> int | None:
    return None if seed is None else check_seed(seed)


class portable_random:  # noqa: N801 - a context manager named like a function, as torch.random.fork_rng
    """Context manager: torch's random ops on this thread draw portable Philox numbers inside
    (see the module docstring).

    Args:
        seed: ``None`` continues from the current generator position (the device
            generator, the active ``tracker.fork`` stream, or a sharded region) and leaves
            it advanced; an int in ``[0, 2**64 - 1]`` starts at (seed, 0) and gives the
            current device generator its previous state back on exit.
        compiled: run the Philox loop through ``torch.compile`` on CPU and CUDA tensors
            (the first call per distribution compiles); bitwise equal to eager except
            :func:`~hyperrng.philox.normal`, within a few ulp.

    Entering holds the current device's generator for this thread (see
    :mod:`hyperrng._exclusive`) until the matching exit, routes DTensor random ops through
    hyperrng's sharded path (see the module docstring) and, with a seed, positions the
    generator. It may be nested and re-entered, also from several threads one after
    another; the thread leaves the mode at its outermost exit unless its switch
    (:func:`set_portable_random`) holds it. A Ctrl-C during entry or exit leaves the
    mode and the generator as before the entry or as after the exit.

    Raises:
        ArgumentTypeError: ``seed`` is not an int or ``compiled`` not a bool.
        InvalidSeedError: ``seed`` is outside ``[0, 2**64 - 1]``.
        UnsupportedPortableOpError (on entry): torch is older than 2.9, or the platform's
            device type has no portable kernels. Nothing changed.
        GeneratorBusyError (on entry): another thread holds the device's generator (in
            portable mode, a fork, a region, ...). Nothing changed.
    """

    def __init__(self, seed: int | None = None, *, compiled: bool = False) -> None:
        self._seed = _check_optional_seed(seed)
        self._compiled = _check_bool(compiled, "compiled")

    def __enter__(self) -> None:
        _step_done(_enter(self, platforms.current(), self._seed, self._compiled, "portable_random"))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for entry in reversed(_THREAD.entries):
            if entry.owner is self:
                _leave(entry)
                break
        _step_done(None)


def set_portable_random(enabled: bool, seed: int | None = None, *, compiled: bool = False) -> None:
    """Turn portable mode on or off for the calling thread, outside any ``with`` block.

    Args:
        enabled: ``True`` turns it on (again: only ``seed`` and ``compiled`` apply),
            ``False`` off; contexts entered meanwhile keep it on until they exit.
        seed: with ``enabled``, put the current device generator at (seed, 0) (it is not
            restored when the mode is turned off); ``None`` continues from where it is.
        compiled: as for :class:`portable_random`.

    While on, the thread holds the device's generator, as a context does (until
    ``set_portable_random(False)`` on the same thread).

    Raises:
        ArgumentTypeError: ``enabled`` or ``compiled`` is not a bool, ``seed`` not an int.
        InvalidSeedError: ``seed`` is outside ``[0, 2**64 - 1]``.
        InvalidParameterError: a ``seed`` with ``enabled=False``.
        UnsupportedPortableOpError / GeneratorBusyError: as on entering :class:`portable_random`.
    """
    on = _check_bool(enabled, "enabled")
    value = _check_optional_seed(seed)
    use_compiled = _check_bool(compiled, "compiled")
    if not on and value is not None:
        raise InvalidParameterError("a seed positions the generator for portable draws; pass it with enabled=True.")
    switch = next((e for e in _THREAD.entries if e.owner is _SWITCH), None)
    if not on:
        if switch is not None:
            _leave(switch)
        _step_done(None)
    elif switch is None:
        _step_done(_enter(_SWITCH, platforms.current(), value, use_compiled, "set_portable_random"))
    else:
        switch.compiled = use_compiled
        if value is not None:
            platforms.current().set_seed_offset(value, 0)


# The code of entering and leaving: the Ctrl-C handler defers an interrupt that arrives in it.
_STEPS = frozenset(
    {portable_random.__enter__.__code__, portable_random.__exit__.__code__, set_portable_random.__code__}
)


def is_portable_random_enabled() -> bool:
    """Whether torch's random ops on the calling thread draw portable numbers now (a context of this
    thread is entered or its switch is on)."""
    return bool(_THREAD.entries)


def _thread_mode() -> bool | None:
    """This thread's portable mode for :func:`_mode_applied` on another thread: ``None`` when off,
    else whether its draws are compiled."""
    entries = _THREAD.entries
    return entries[-1].compiled if entries else None


class _mode_applied:  # noqa: N801 - a context manager named like a function
    """Draw portably on this thread as the thread that took ``mode`` (:func:`_thread_mode`) did.

    For work that another thread runs on behalf of one in portable mode: autograd runs the
    backward pass of accelerator tensors on its own device threads, so a recompute there
    (``hyperrng.checkpoint``) must draw as the forward pass did. It holds nothing and moves
    no generator: the thread that took ``mode`` holds the device and waits for the work.
    ``None`` applies nothing.
    """

    __slots__ = ("_mode", "_entry")

    def __init__(self, mode: bool | None) -> None:
        self._mode = mode
        self._entry: _Entry | None = None

    def __enter__(self) -> None:
        if self._mode is not None:
            self._entry = _Entry(self, self._mode, None)
            _THREAD.entries.append(self._entry)

    def __exit__(self, *exc: object) -> None:
        if self._entry is not None:
            entry, self._entry = self._entry, None
            _leave(entry)


# -- elastic resume ----------------------------------------------------------------------------
PORTABLE_STATE_FORMAT = "hyperrng.portable/1"
"""The ``format`` entry of :func:`portable_state_dict`'s result."""


def portable_state_dict(tracker: Any = None, *, check_ranks: bool = True) -> dict[str, Any]:
    """The positions portable draws continue from: the device generator's and every tracker stream's.

    In portable mode every rank holds the same positions (each op moves every rank by
    its global count), so this dict does not depend on the rank or the world size: save
    it from any rank and give it to :func:`load_portable_state_dict` on every rank of a
    run with another world size, and the next portable draws are the global tensors the
    uninterrupted run would have drawn.

    Args:
        tracker: the :class:`~hyperrng.RNGStatesTracker` whose streams to include
            (default: the global one).
        check_ranks: when ``torch.distributed`` is initialised, gather every rank's
            positions (a collective: call it on every rank) and refuse if they differ.

    Returns:
        ``{"format": PORTABLE_STATE_FORMAT, "position": [seed, offset],
        "streams": {name: [seed, offset]}}``, plain ints (JSON- and torch.save-safe).

    Raises:
        ArgumentTypeError: ``check_ranks`` is not a bool, ``tracker`` not a tracker.
        TrackerStateError: a fork is active (a stream's position is in the generator).
        RNGDesyncError: ``check_ranks`` and the ranks hold different positions.
    """
    from hyperrng.errors import RNGDesyncError
    from hyperrng.tracker import resolve_tracker

    check = _check_bool(check_ranks, "check_ranks")
    t = resolve_tracker(tracker)
    t._idle("portable_state_dict")
    p = platforms.current()
    streams = {}
    for name in sorted(t.get_states()):
        with t.fork(name):
            streams[name] = list(p.get_seed_offset())
    state = {"format": PORTABLE_STATE_FORMAT, "position": list(p.get_seed_offset()), "streams": streams}
    dist = torch.distributed
    if check and dist.is_available() and dist.is_initialized() and platforms.comm.world_size() > 1:
        text = json.dumps(state, sort_keys=True).encode()
        digest = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)
        digests = [int(t) for t in platforms.comm.all_gather(p, torch.tensor([digest], dtype=torch.int64))]
        differ = [rank for rank, other in enumerate(digests) if other != digests[0]]
        if differ:  # every rank sees the same digests, so every rank raises alike
            raise RNGDesyncError(
                f"ranks {differ} hold other portable positions than rank 0 (this rank: {state}); draw only "
                f"portable ops on every rank alike, or seed every rank with portable_random(seed)."
            )
    return state


def load_portable_state_dict(state: Any, tracker: Any = None) -> None:
    """Put the device generator and the tracker's streams at the positions of :func:`portable_state_dict`.

    Works at any world size (see :func:`portable_state_dict`). Everything is checked
    before anything is set.

    Raises:
        ArgumentTypeError: ``state`` is not a dict of the documented shape, or a value not an int.
        CheckpointError: an unknown ``format``, or a stream of the state that the tracker lacks
            (add the streams, with any seed, before loading).
        InvalidSeedError / InvalidOffsetError: a seed or offset out of range or misaligned.
            Errors about a position name its entry: the stream, or ``state['position']``.
        TrackerStateError: a fork is active.
    """
    from hyperrng.errors import CheckpointError, InvalidOffsetError, InvalidSeedError
    from hyperrng.platforms.validate import check_offset
    from hyperrng.tracker import resolve_tracker

    if not isinstance(state, dict) or not isinstance(state.get("streams"), dict):
        raise ArgumentTypeError(
            f"state must be the dict portable_state_dict() returns, got {type(state).__name__}; load it unchanged."
        )
    if state.get("format") != PORTABLE_STATE_FORMAT:
        raise CheckpointError(f"state has format {state.get('format')!r}, not {PORTABLE_STATE_FORMAT!r}.")
    t = resolve_tracker(tracker)

    def position(value: object, entry: str) -> tuple[int, int]:
        """``value`` checked as the ``[seed, offset]`` pair of ``entry``; an error names the entry and the fix."""
        fix = (
            "portable_state_dict() never saves such a value: load the dict it returned unchanged "
            "(was the checkpoint edited or damaged?), or save a fresh one."
        )
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ArgumentTypeError(f"{entry}: expected a [seed, offset] pair, got {value!r}. {fix}")
        try:
            return check_seed(value[0], "seed"), check_offset(value[1], "offset")
        except (ArgumentTypeError, InvalidSeedError, InvalidOffsetError) as exc:  # same class, entry named
            raise type(exc)(f"{entry}: {exc} {fix}") from None

    main = position(state.get("position"), "the generator position (state['position'])")
    streams = {
        name: position(value, f"stream {name!r} (state['streams'][{name!r}])")
        for name, value in state["streams"].items()
    }
    missing = sorted(set(streams) - set(t.get_states()))
    if missing:
        raise CheckpointError(
            f"the state has streams {missing} that the tracker lacks; add them (tracker.add(name, seed)) first."
        )
    t._idle("load_portable_state_dict")
    p = platforms.current()
    for name, (seed, offset) in streams.items():
        with t.fork(name):
            p.set_seed_offset(seed, offset)
    p.set_seed_offset(*main)


def tp_invariance_report(
    tp_sizes: Sequence[int] = (1, 2, 4), world_size: int = 4, steps: int = 2, seed: int = 1234
) -> dict[str, Any]:
    """Train a tiny tensor-parallel MLP with dropout under portable mode at each TP size, on real ranks.

    Spawns ``world_size`` gloo processes on the CPU; for each TP size the ranks form a
    ``(world_size // tp, tp)`` mesh, parallelise the model over its ``tp`` dimension
    (``torch.distributed.tensor.parallel``), initialise it inside ``portable_random(seed)``
    and train ``steps`` SGD steps with dropout.

    Returns:
        ``{"tp_sizes", "params_identical", "masks_identical", "max_loss_difference",
        "losses": {tp: [...]}}``: whether every TP size gave bit-identical initial
        parameters and dropout masks (on every rank), and how far the losses drift
        (float reductions differ with the sharding).

    Raises:
        ArgumentTypeError / InvalidParameterError: a size that is not a positive int dividing ``world_size``.
    """
    from hyperrng._launch import run_ranks
    from hyperrng._portable_tp import tp_rank
    from hyperrng.platforms.validate import check_int

    world = check_int(world_size, "world_size")
    sizes = tuple(check_int(tp, "each TP size") for tp in tp_sizes)
    check_int(steps, "steps")
    check_seed(seed)
    if world < 1 or not sizes or any(tp < 1 or world % tp for tp in sizes):
        raise InvalidParameterError(f"every TP size must divide world_size={world}; got {sizes}.")
    per_rank = run_ranks(tp_rank, world, sizes, steps, seed)
    reference = per_rank[0][sizes[0]]
    params = all(r[tp]["params"] == reference["params"] for r in per_rank for tp in sizes)  # exact float equality
    masks = all(r[tp]["masks"] == reference["masks"] for r in per_rank for tp in sizes)
    losses = {tp: per_rank[0][tp]["losses"] for tp in sizes}
    drift = max(abs(a - b) for tp in sizes for a, b in zip(losses[tp], losses[sizes[0]]))
    return {
        "tp_sizes": sizes,
        "params_identical": params,
        "masks_identical": masks,
        "max_loss_difference": drift,
        "losses": losses,
    }
