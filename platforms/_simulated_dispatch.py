"""How the tensors of the simulated accelerator (:mod:`hyperrng.platforms.simulated`) run: once
its device module is registered as torch's ``PrivateUse1`` backend, every op on a ``"sim"`` tensor
(a :class:`_DeviceTensor`, whose data lives in CPU memory) and every factory naming the device
comes here (:func:`_run`), runs on the CPU memory behind the device tensors, keeps devices apart as
real hardware does, and draws random ops from the device generator's (seed, offset) position
(:func:`_draw`); :class:`_Backend` holds the registered module torch's hooks answer for.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from hyperrng.platforms.errors import InvalidArgumentError
from hyperrng.platforms.mix import combine64
from hyperrng.platforms.validate import MAX_OFFSET, round_up_offset
from torch.utils._pytree import tree_leaves, tree_map

_DRAW_DOMAIN = 0x53494D30  # "SIM0": separates draw seeds from other uses of the mixer
_MAX_DRAW_ADVANCE = 2**40  # more elements than one op on a simulated device can produce in memory


class _Backend:
    """The one module registered with torch as the PrivateUse1 backend, and the hooks it needs."""

    # a SimulatedDeviceModule (hyperrng.platforms.simulated, which imports this module)
    module: Any = None
    library: Any = None
    scratch: torch.Generator | None = None  # draws of device ops; reseeded for every draw


def _hook_classes() -> tuple[type, type]:
    """The hook and device-guard classes torch calls back into, defined only when registering.

    Their base classes exist only in a torch that can host a Python backend (see
    ``hyperrng.platforms._features``): defining them at import would make this module,
    and so ``import hyperrng``, fail on every older torch.
    """

    class _Hooks(torch._C._acc.PrivateUse1Hooks):  # type: ignore[misc, name-defined]
        def is_available(self) -> bool:
            return _Backend.module is not None and _Backend.module.is_available()

        def has_primary_context(self, dev_id: int) -> bool:
            return True

        def is_built(self) -> bool:
            return True

    class _Guard(torch._C._acc.DeviceGuard):  # type: ignore[misc, name-defined]
        def type_(self) -> Any:
            return torch._C._autograd.DeviceType.PrivateUse1

    return _Hooks, _Guard


class _DeviceTensor(torch.Tensor):
    """A tensor on a simulated device: torch sees the device, the data lives in CPU memory (``_raw``).

    Tensors on ``"sim:0"`` and ``"sim:1"`` behave like tensors of an accelerator:

    * **Random ops draw from the device generator, never from the host's.** Every op torch
      tags as random (``rand``, ``randn``, ``rand_like``, ``randn_like``, ``randint``,
      ``uniform_``, ``normal_``, ``bernoulli_``, ``random_``, ``native_dropout`` behind
      ``F.dropout``, ``randperm``, ``multinomial``, ...) draws at the device generator's
      (seed, offset) position and advances the offset by the number of elements it produced,
      rounded up to a multiple of 4, as CUDA's and Ascend's Philox generators do: positioning
      a generator at a pair reproduces exactly what was drawn there, whatever ran before.
      ``torch.manual_seed`` seeds it too, ``torch.random.fork_rng(device_type="sim")`` forks it.
      As on a compiled backend, a kernel registered for the device's key (``PrivateUse1``)
      with ``torch.library`` replaces the backend's own for that op, and a random op with a
      composite kernel in torch runs it (``rand_like`` as ``empty_like`` then ``uniform_``).
    * **Everything else a small model needs works**: creation, ``.to("sim")``/``.cpu()``,
      elementwise ops, matmul, reductions, views, in-place ops and autograd. Each op runs on
      CPU memory behind the device tensor.
    * **Devices are kept apart as on real hardware**: an op mixing a ``sim`` tensor with a
      CPU tensor (other than a 0-dim scalar or the source/target of a copy), or tensors of two
      ``sim`` devices, raises torch's "Expected all tensors to be on the same device".
      ``.numpy()`` and collectives of a backend that needs host memory (gloo) refuse device
      tensors: stage through the host, as with a GPU.
    * **Graph capture, as far as random ops go**: inside ``with torch.sim.graph(g):`` (a
      :class:`~hyperrng.platforms.simulated.SimulatedGraph`) the device reports its stream
      capturing, and a random op draws only from a generator state registered with the graph,
      as on CUDA (see the class).
    """

    _raw: torch.Tensor

    @staticmethod
    def __new__(cls, raw: torch.Tensor, device: torch.device) -> _DeviceTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            raw.shape,
            strides=raw.stride(),
            storage_offset=raw.storage_offset(),
            dtype=raw.dtype,
            layout=raw.layout,
            device=device,
            requires_grad=False,
        )
        wrapper._raw = raw
        return wrapper  # type: ignore[no-any-return]

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        body = repr(self._raw)
        grad = f", grad_fn=<{type(self.grad_fn).__name__}>" if self.grad_fn is not None else ""
        grad = grad or (", requires_grad=True" if self.requires_grad else "")
        return f"{body[: body.rindex(')')]}, device='{self.device}'{grad})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        return _run(func, *args, **(kwargs or {}))


_CROSS_DEVICE_COPIES = frozenset(
    {
        torch.ops.aten.copy_.default,
        torch.ops.aten._to_copy.default,
        torch.ops.aten._copy_from.default,
        torch.ops.aten._copy_from_and_resize.default,
    }
)
_COPY_OPS = _CROSS_DEVICE_COPIES | {
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put_.default,
    torch.ops.aten._index_put_impl_.default,
}
"""Ops that may mix a device tensor with host tensors of more than 0 dims (copies, and host index tensors)."""


def _copy_target(func: Any, args: Any, kwargs: dict[str, Any]) -> torch.device:
    """The device a copy writes to: ``_to_copy``'s ``device=``, ``copy_``'s self, ``_copy_from``'s dst."""
    if func is torch.ops.aten._to_copy.default:
        return torch.device(kwargs["device"])
    dst = args[0] if func is torch.ops.aten.copy_.default else args[1]
    return dst.device  # type: ignore[no-any-return]


_UNTAGGED_RANDOM_OPS = frozenset(
    {torch.ops.aten.random_.default, getattr(torch.ops.aten.random_, "from"), torch.ops.aten.random_.to}
)
"""Random ops that torch does not tag ``nondeterministic_seeded`` but that draw all the same."""

_PRIVATEUSE1 = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
_RNG_KEY = torch._C._parse_dispatch_key("CustomRNGKeyId") if hasattr(torch._C, "_parse_dispatch_key") else None
_HAS_KERNEL = torch._C._dispatch_has_kernel_for_dispatch_key


class _Dispatching(threading.local):
    """The random ops this thread is running through the dispatch table right now."""

    def __init__(self) -> None:
        self.ops: set[Any] = set()


_DISPATCHING = _Dispatching()


def _is_random(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags or func in _UNTAGGED_RANDOM_OPS


def _table_entry(func: Any) -> bool:
    """Whether torch's dispatch table has a PrivateUse1 entry for ``func`` besides this backend's fallback:
    a kernel registered for the key (``torch.library`` overrides included) or torch's composite kernel."""
    name = func.name()
    return _HAS_KERNEL(name, "PrivateUse1") or _HAS_KERNEL(name, "CompositeExplicitAutograd")


def _random_op_keys(func: Any) -> Any:
    """The keys a random op is redispatched to before this backend draws it itself, or ``None``.

    A C++ backend's random op passes through every key of the call below the tensor
    subclass's: the device's key (``PrivateUse1``) and ``CustomRNGKeyId`` where the thread
    includes it (portable mode does, see ``hyperrng.portable._ops``). Both are modelled here.
    """
    if _RNG_KEY is not None and torch._C._dispatch_tls_is_dispatch_key_included(_RNG_KEY):
        name = func.name()
        if _HAS_KERNEL(name, "CustomRNGKeyId") and not torch._C._dispatch_kernel_for_dispatch_key_is_fallthrough(
            name, "CustomRNGKeyId"
        ):
            return _PRIVATEUSE1.add(_RNG_KEY)
    return _PRIVATEUSE1 if _table_entry(func) else None


def _run(func: Any, /, *args: Any, **kwargs: Any) -> Any:
    """Run ``func`` on the CPU memory behind the device tensors and wrap what it makes.

    A random op goes through the kernels torch's dispatch table holds for the keys of the
    call (see :func:`_random_op_keys`; a kernel that calls the one below it, in the end
    this fallback, gets the device generator's draw), else draws from the device generator.
    """
    if _is_random(func) and func not in _DISPATCHING.ops:
        keys = _random_op_keys(func)
        if keys is not None:
            _DISPATCHING.ops.add(func)
            try:
                return func.redispatch(keys, *args, **kwargs)
            finally:
                _DISPATCHING.ops.discard(func)
    devices: set[torch.device] = set()
    host_arrays = False
    wrappers: dict[int, _DeviceTensor] = {}

    def unwrap(x: Any) -> Any:
        nonlocal host_arrays
        if isinstance(x, _DeviceTensor):
            devices.add(x.device)
            wrappers[id(x._raw)] = x
            return x._raw
        if isinstance(x, torch.Tensor):
            host_arrays = host_arrays or x.dim() > 0
        elif isinstance(x, torch.device) and x.type == _Backend.module.device_type:  # type: ignore[union-attr]
            devices.add(_existing(x))
            return torch.device("cpu")
        return x

    raw_args, raw_kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
    if func in _CROSS_DEVICE_COPIES and len(devices) > 1:  # a copy between devices, as CUDA allows
        devices = {_copy_target(func, args, kwargs)}
    if len(devices) > 1 or (host_arrays and devices and func not in _COPY_OPS):
        found = sorted(str(d) for d in devices) + (["cpu"] if host_arrays else [])
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, {found[0]} and "
            f"{found[1]}! (in {func})"
        )
    device = next(iter(devices)) if devices else torch.device(_Backend.module.device_type, 0)  # type: ignore[union-attr]
    if _is_random(func):
        out = _draw(func, raw_args, raw_kwargs, device)
    else:
        out = func(*raw_args, **raw_kwargs)
    target = kwargs.get("device")
    if target is not None and torch.device(target).type == "cpu":  # a copy to the host: hand back host tensors
        return out

    def wrap(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, _DeviceTensor):
            same = wrappers.get(id(x))
            return same if same is not None else _DeviceTensor(x, device)
        return x

    return tree_map(wrap, out)


def _existing(device: torch.device) -> torch.device:
    """``device`` with its index (the current device's when it names none), if the backend has that
    device; else the ``RuntimeError`` CUDA raises for an invalid ordinal, so that nothing is made
    on a device that does not exist."""
    module = _Backend.module
    assert module is not None
    index = device.index if device.index is not None else module.current_device()
    if not 0 <= index < module.device_count():
        raise RuntimeError(
            f"{device.type} error: invalid device ordinal {index}: the simulated backend has "
            f"{module.device_count()} device(s)."
        )
    return torch.device(device.type, index)


def _draw(func: Any, args: Any, kwargs: dict[str, Any], device: torch.device) -> Any:
    """A random op: draw at the device generator's (seed, offset) and advance it past what was drawn."""
    if kwargs.get("generator") is not None:
        raise RuntimeError(
            f"{func}: the simulated device draws only from its device generators; generator= is not supported "
            f"on '{device.type}' tensors (position the device generator instead, e.g. with a tracker stream)."
        )
    module = _Backend.module
    assert module is not None and _Backend.scratch is not None
    counter = module._gen(device.index)._counter
    capture = module._capture
    if capture is not None and not capture._holds(counter):
        raise RuntimeError(
            f"{func}: Attempt to increase offset for a {device.type} generator not in capture mode: its state is not "
            "registered with the graph being captured (graph.register_generator_state(generator) before capture)."
        )
    if counter.offset > MAX_OFFSET - _MAX_DRAW_ADVANCE:
        # Refused before drawing, so the generator stays where it was.
        raise InvalidArgumentError(
            f"{func}: the generator of {device} is at offset {counter.offset}, too close to 2**63 - 1 for a "
            f"draw to advance it; reseed it (torch.manual_seed, or a tracker stream) first."
        )
    draw_seed = combine64(_DRAW_DOMAIN, counter.seed, counter.offset)
    if any(a.name == "generator" for a in func._schema.arguments):
        out = func(*args, **{**kwargs, "generator": _Backend.scratch.manual_seed(draw_seed)})
    else:  # ops without a generator argument draw from the host generator: lend it, then restore it
        host = torch.default_generator
        saved = host.get_state()
        host.manual_seed(draw_seed)
        try:
            out = func(*args, **kwargs)
        finally:
            host.set_state(saved)
    produced = max((t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)), default=0)
    counter.offset += round_up_offset(produced)
    return out
