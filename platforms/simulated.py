"""A simulated accelerator: a torch device of its own, with a counter-based generator.

``HYPERRNG_PLATFORM=sim`` (or ``hyperrng.platforms.use("sim")``) selects it. It registers, once per
process and on first use, torch's ``PrivateUse1`` backend under the name ``"sim"``, with
the device module :class:`SimulatedDeviceModule` as ``torch.sim``. Tensors on ``"sim:0"``
and ``"sim:1"`` then behave like tensors of an accelerator:

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
  :class:`SimulatedGraph`) the device reports its stream capturing, and a random op draws
  only from a generator state registered with the graph, as on CUDA (see the class).

What it does not model: speed (each op pays a Python dispatch; and because torch's Python
backend hooks report a single device to autograd's per-device worker threads, the thread
that registered it runs backward passes itself, while a backward through ``sim:1`` on
another thread fails), CUDA's exact Philox numbers (a draw is a stable mix of (seed,
offset) fed to a CPU generator: a pure function of the pair, but other numbers than a
GPU's), streams and events, graph replays, memory limits, explicit ``generator=`` arguments in torch ops
(refused; position the device generator instead, e.g. through a tracker stream),
DTensor/``DeviceMesh`` on the ``sim`` device type, ``torch.compile``, pickling device
tensors, and a second ``PrivateUse1`` backend in the same process (torch has one slot:
with ``torch_npu`` or another such plug-in loaded, this platform reports itself unavailable).

Registering a device backend written in Python needs torch's ``torch._C._acc`` hooks
(torch >= 2.10, see :mod:`hyperrng.platforms._features`): on an older torch this module
still imports, the platform's probe says which torch it needs, and selecting it raises
that reason as a :class:`~hyperrng.platforms.errors.PlatformError`.

The same module also stands in for ``torch.cuda`` or ``torch.npu`` in tests:
``CUDAPlatform(module=SimulatedDeviceModule(device_type="cuda"))`` drives the CUDA
implementation's generator paths without a GPU (no tensors: ``"cuda"`` stays torch's).
It is also the worked example of plugging in a device: see docs/plugins.md.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hyperrng.platforms import _features
from hyperrng.platforms.base import COUNTER_STATE_NBYTES, pack_counter_state, unpack_counter_state
from hyperrng.platforms.device_module import DeviceModulePlatform
from hyperrng.platforms.errors import InvalidArgumentError, PlatformError
from hyperrng.platforms.mix import combine64
from hyperrng.platforms.validate import (
    MAX_OFFSET,
    check_index,
    check_instance,
    check_int,
    check_offset,
    check_seed,
    check_state_offset,
    round_up_offset,
)
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_leaves, tree_map

__all__ = [
    "SIM_DEVICE_TYPE",
    "SimulatedGenerator",
    "SimulatedGraph",
    "SimulatedDeviceModule",
    "SimulatedPlatform",
    "simulated_backend",
]

SIM_DEVICE_TYPE = "sim"
"""The torch device type of the simulated accelerator."""

_DRAW_DOMAIN = 0x53494D30  # "SIM0": separates draw seeds from other uses of the mixer
_DEFAULT_SEED = 67280421310721  # torch's default CUDA seed, so a fresh device looks familiar
_DEFAULT_DEVICE_COUNT = 2
_MAX_DRAW_ADVANCE = 2**40  # more elements than one op on a simulated device can produce in memory
_BUILTIN_DEVICE_TYPES = frozenset({"cpu", "cuda", "meta", "mps", "xpu", "hpu", "mtia", "xla", "lazy"})
_MAX_DEVICES = 128  # torch keeps a device index in 8 signed bits: torch.device("sim", 128) is "sim:-128"
_DEVICE_TYPE = re.compile(r"[A-Za-z_]+")  # what torch.device parses as a device type


def _check_device_type(device_type: object) -> str:
    check_instance(device_type, str, "device_type")
    if not _DEVICE_TYPE.fullmatch(device_type):
        raise InvalidArgumentError(
            f"device_type must be a torch device type name (letters and underscores, such as 'sim'), "
            f"got {device_type!r:.80}."
        )
    return device_type  # type: ignore[return-value]


def _check_device_index(index: object, what: str) -> int:
    value = check_int(index, what)
    if not 0 <= value < _MAX_DEVICES:
        raise InvalidArgumentError(f"{what} must be in [0, {_MAX_DEVICES - 1}] (torch's device indices), got {value}.")
    return value


@dataclass(slots=True)
class _Counter:
    """The mutable (seed, offset) pair; shared between generators by graph-safe swaps."""

    seed: int
    offset: int = 0


class SimulatedGenerator:
    """A Philox-style generator: a seed and an offset that advances by 4-aligned steps.

    It has the generator API of ``torch.cuda`` generators (``get_state``/``set_state``
    with a 16-byte (uint64 seed, int64 offset) state, ``manual_seed``, ``get_offset``,
    ``set_offset``, and the graph-safe ``graphsafe_get_state``/``graphsafe_set_state``/
    ``clone_state``).
    """

    def __init__(self, index: int = 0, seed: int = _DEFAULT_SEED, device_type: str = SIM_DEVICE_TYPE) -> None:
        """Raises :class:`ArgumentTypeError` or :class:`InvalidArgumentError` for an ``index`` outside
        ``[0, 127]``, a ``seed`` outside ``[0, 2**64 - 1]`` or a ``device_type`` torch cannot name."""
        index, seed = _check_device_index(index, "index"), check_seed(seed)
        self.index = index
        self.device_type = _check_device_type(device_type)
        self._counter = _Counter(seed)

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type, self.index)

    def get_state(self) -> torch.Tensor:
        return pack_counter_state(self._counter.seed, self._counter.offset)

    def set_state(self, new_state: torch.Tensor) -> SimulatedGenerator:
        if (
            not isinstance(new_state, torch.Tensor)
            or new_state.dtype != torch.uint8
            or new_state.numel() != COUNTER_STATE_NBYTES
        ):
            raise InvalidArgumentError(f"simulated generator state must be {COUNTER_STATE_NBYTES} uint8 bytes")
        # Torch restores device states from inside its own dispatch modes (LocalTensor mode does, while a
        # FakeTensorMode propagates shardings); CUDA's generator reads the bytes below them, and so does this one.
        with no_dispatch():
            seed, offset = unpack_counter_state(new_state)
        # CUDA's generator refuses these too
        check_state_offset(offset, "simulated generator state has offset", source="get_state()")
        self._counter.seed, self._counter.offset = seed, offset
        return self

    def manual_seed(self, seed: int) -> SimulatedGenerator:
        self._counter.seed, self._counter.offset = check_seed(seed), 0
        return self

    def seed(self) -> int:
        self.manual_seed(secrets.randbits(63))
        return self._counter.seed

    def initial_seed(self) -> int:
        return self._counter.seed

    def get_offset(self) -> int:
        return self._counter.offset

    def set_offset(self, offset: int) -> SimulatedGenerator:
        self._counter.offset = check_offset(offset)
        return self

    # Graph-safe API of CUDA generators: swap the state object instead of copying bytes.
    def graphsafe_get_state(self) -> SimulatedGenerator:
        return self._on(self._counter)

    def graphsafe_set_state(self, other: SimulatedGenerator) -> SimulatedGenerator:
        self._counter = check_instance(other, SimulatedGenerator, "graphsafe_set_state's state")._counter
        return self

    def clone_state(self) -> SimulatedGenerator:
        return self._on(_Counter(self._counter.seed, self._counter.offset))

    def _on(self, counter: _Counter) -> SimulatedGenerator:
        """A generator of the same device over ``counter``."""
        other = SimulatedGenerator.__new__(SimulatedGenerator)  # of a checked one: no checks again (forks swap often)
        other.index, other.device_type, other._counter = self.index, self.device_type, counter
        return other

    def __repr__(self) -> str:
        c = self._counter
        return f"<SimulatedGenerator {self.device_type}:{self.index} seed={c.seed} offset={c.offset}>"


class SimulatedGraph:
    """A graph of a simulated device, as far as capturing random ops goes (``torch.cuda.CUDAGraph``'s part).

    ``with module.graph(g):`` captures on the module's device: meanwhile the module's
    ``is_current_stream_capturing()`` is true, and a random op may only draw from a
    generator state registered with the graph, as on CUDA: the default generator's state
    when capture begins is registered then, any other with :meth:`register_generator_state`
    before capture; a draw from one that is not raises the ``RuntimeError`` CUDA raises. The
    ops run while they are captured, as eager ops; replays are not modelled.
    """

    def __init__(self) -> None:
        self._states: list[_Counter] = []
        self._capturing = False

    def register_generator_state(self, generator: SimulatedGenerator) -> None:
        """Let ``generator``'s state be drawn from while this graph captures; call it before capture."""
        if not isinstance(generator, SimulatedGenerator):
            raise TypeError(f"expected a SimulatedGenerator, got {type(generator).__name__}")
        if self._capturing:
            raise RuntimeError("Cannot register the state during capturing stage.")
        self._register(generator._counter)

    def _register(self, counter: _Counter) -> None:
        if not self._holds(counter):
            self._states.append(counter)

    def _holds(self, counter: _Counter) -> bool:
        return any(c is counter for c in self._states)


class SimulatedStream:
    """The stream of a simulated device: its work runs synchronously on the CPU, so it is always done."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def wait_stream(self, stream: SimulatedStream) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        return True


_STREAM = SimulatedStream()


class SimulatedDeviceModule:
    """A device module in the shape of ``torch.cuda`` / ``torch.npu``, for simulated devices.

    Args:
        device_count: how many devices to simulate, an int in ``[0, 128]`` (torch's device
            indices are 8-bit).
        available: what :meth:`is_available` answers (to simulate a missing device).
        device_type: the device type it serves. ``"sim"`` (or any name that is not a
            built-in torch device type, e.g. ``"npu"``) registers this module as torch's
            ``PrivateUse1`` backend on first use, so tensors of that type exist and draw
            from its generators; ``"cuda"`` only stands in for ``torch.cuda``'s generator
            API (no tensors).

    Raises:
        ArgumentTypeError: ``device_count`` is not an int, ``available`` not a bool or
            ``device_type`` not a string.
        InvalidArgumentError: ``device_count`` is outside ``[0, 128]``, or ``device_type`` is
            not a name torch can parse as a device type (letters and underscores).
    """

    def __init__(
        self, device_count: int = _DEFAULT_DEVICE_COUNT, available: bool = True, device_type: str = SIM_DEVICE_TYPE
    ) -> None:
        count = check_int(device_count, "device_count")
        if not 0 <= count <= _MAX_DEVICES:
            raise InvalidArgumentError(
                f"device_count must be in [0, {_MAX_DEVICES}] (torch's device indices are 8-bit), got {count}."
            )
        self.device_type = _check_device_type(device_type)
        self._count = count
        self._available = check_instance(available, bool, "available")
        self._current = 0
        self._generators: tuple[SimulatedGenerator, ...] = ()
        self._capture: SimulatedGraph | None = None  # the graph being captured, if any
        self.lazy_init_calls = 0

    # -- device module API ----------------------------------------------------------------
    def is_available(self) -> bool:
        return self._available and self._count > 0

    def is_initialized(self) -> bool:
        return bool(self._generators)

    @property
    def _initialized(self) -> bool:
        # What torch.utils.checkpoint reads (as for torch.cuda) to decide whether to save device states.
        return self.is_initialized()

    @contextlib.contextmanager
    def device(self, device: int | str | torch.device) -> Iterator[None]:
        """Context manager that makes ``device`` current inside the block, as ``torch.cuda.device`` does."""
        previous = self.current_device()
        try:
            self.set_device(device)
            yield
        finally:
            self.set_device(previous)

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return self._count if self._available else 0

    def _lazy_init(self) -> None:
        if not self._generators:
            if not self.is_available():
                raise RuntimeError("simulated device is not available")
            if self.device_type not in _BUILTIN_DEVICE_TYPES:
                _register(self)
            self.lazy_init_calls += 1
            self._generators = tuple(SimulatedGenerator(i, device_type=self.device_type) for i in range(self._count))

    @property
    def default_generators(self) -> tuple[SimulatedGenerator, ...]:
        return self._generators

    def current_device(self) -> int:
        self._lazy_init()
        return self._current

    def set_device(self, device: int | str | torch.device) -> None:
        self._current = check_index(self._index_of(device), self._count, self.device_type)

    def synchronize(self, device: int | str | torch.device | None = None) -> None:
        """Nothing to wait for: simulated work runs synchronously on the CPU."""

    def current_stream(self, device: int | str | torch.device | None = None) -> SimulatedStream:
        """The one stream of every simulated device (``torch.distributed.checkpoint`` asks for it)."""
        return _STREAM

    def stream(self, stream: SimulatedStream | None) -> contextlib.AbstractContextManager[None]:
        """Make ``stream`` current inside the block: there is only one."""
        return contextlib.nullcontext()

    def _index_of(self, device: int | str | torch.device | None) -> int:
        """The index ``device`` names; the current device's when it names none (``None``, ``"sim"``)."""
        self._lazy_init()
        index = device if device is None or isinstance(device, int) else torch.device(device).index
        return self._current if index is None else index

    def _gen(self, device: int | str | torch.device | None) -> SimulatedGenerator:
        return self._generators[self._index_of(device)]

    def _all(self) -> tuple[SimulatedGenerator, ...]:
        self._lazy_init()
        return self._generators

    def get_rng_state(self, device: int | str | torch.device | None = None) -> torch.Tensor:
        return self._gen(device).get_state()

    def set_rng_state(self, new_state: torch.Tensor, device: int | str | torch.device | None = None) -> None:
        self._gen(device).set_state(new_state)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [g.get_state() for g in self._all()]

    def set_rng_state_all(self, new_states: Sequence[torch.Tensor]) -> None:
        for g, s in zip(self._all(), new_states):
            g.set_state(s)

    def manual_seed(self, seed: int) -> None:
        self._gen(None).manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        for g in self._all():
            g.manual_seed(seed)

    def seed(self) -> None:
        self._gen(None).seed()

    def seed_all(self) -> None:
        for g in self._all():
            g.seed()

    def initial_seed(self) -> int:
        return self._gen(None).initial_seed()

    def is_current_stream_capturing(self) -> bool:
        """Whether a :class:`SimulatedGraph` is capturing (one stream per device, shared by every thread)."""
        return self._capture is not None

    @contextlib.contextmanager
    def graph(self, graph: SimulatedGraph) -> Iterator[SimulatedGraph]:
        """Capture into ``graph`` inside the block, as ``torch.cuda.graph`` does (see :class:`SimulatedGraph`)."""
        if self._capture is not None:
            raise RuntimeError("a simulated graph is already capturing on this device module")
        graph._register(self._gen(None)._counter)  # as CUDA registers its default generator at capture_begin
        self._capture, graph._capturing = graph, True
        try:
            yield graph
        finally:
            self._capture, graph._capturing = None, False

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        """What autocast may use on this device (``torch.utils.checkpoint`` asks)."""
        return [torch.float16, torch.bfloat16]


# -- the torch backend ----------------------------------------------------------------------
class _Backend:
    """The one module registered with torch as the PrivateUse1 backend, and the hooks it needs."""

    module: SimulatedDeviceModule | None = None
    library: Any = None
    scratch: torch.Generator | None = None  # draws of device ops; reseeded for every draw


def backend_conflict(device_type: str = SIM_DEVICE_TYPE) -> str | None:
    """Why ``device_type`` cannot be registered as a simulated backend here (``None`` if it can).

    Changes nothing: the probe of :class:`SimulatedPlatform` calls it at import time.
    """
    needed = _features.feature("sim")
    if not needed.available:
        return needed.refusal()
    taken = torch._C._get_privateuse1_backend_name()
    if taken not in ("privateuseone", device_type):
        return f"torch's PrivateUse1 backend is already taken by {taken!r} (one per process)"
    if taken == device_type and _Backend.module is None:
        return f"device type {device_type!r} is already registered by another module"
    return None


def simulated_backend(device_type: str = SIM_DEVICE_TYPE) -> SimulatedDeviceModule:
    """The simulated device module registered with torch for ``device_type``, registering one if needed.

    Raises:
        PlatformError: another backend holds torch's PrivateUse1 slot.
        ArgumentTypeError, InvalidArgumentError: ``device_type`` is not a string, or not a name
            torch can parse as a device type.
    """
    _check_device_type(device_type)
    module = _Backend.module
    if module is not None and module.device_type == device_type:
        return module
    module = SimulatedDeviceModule(device_type=device_type)
    module._lazy_init()
    return module


def _register(module: SimulatedDeviceModule) -> None:
    reason = backend_conflict(module.device_type)
    if reason is None and _Backend.module is not None:
        reason = f"a simulated backend is already registered as {_Backend.module.device_type!r}"
    if reason is not None:
        raise PlatformError(
            f"cannot register the simulated device {module.device_type!r}: {reason}", reason="unavailable"
        )
    name = module.device_type
    torch.utils.rename_privateuse1_backend(name)
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=False)
    torch._register_device_module(name, module)
    hooks, guard = _hook_classes()
    torch._C._acc.register_python_privateuseone_hook(hooks())
    torch._C._acc.register_python_privateuseone_device_guard(guard())
    library = torch.library.Library("_", "IMPL")
    library.fallback(_run, "PrivateUse1")  # ops with no device tensor input (factories)
    # torch's Python backend hooks report one device to the autograd engine, whose worker
    # threads are per device index: run backward passes on the calling thread instead,
    # so that every simulated device index works in autograd.
    torch.autograd.set_multithreading_enabled(False)  # takes effect when made, like set_grad_enabled
    _Backend.module, _Backend.library, _Backend.scratch = module, library, torch.Generator()


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
    """A tensor on a simulated device: torch sees the device, the data lives in CPU memory (``_raw``)."""

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


class SimulatedPlatform(DeviceModulePlatform):
    """The simulated accelerator as a platform of its own (``HYPERRNG_PLATFORM=sim``).

    Args:
        module: the device module to drive, a :class:`SimulatedDeviceModule` (else
            :class:`ArgumentTypeError`); by default the one registered with torch as
            the ``"sim"`` device type (registered on first use, never at construction or
            while probing).

    It is never picked automatically. Its collectives run over gloo, staged through the
    host (see :func:`hyperrng.platforms.comm.broadcast`).
    """

    name = "sim"
    device_type = SIM_DEVICE_TYPE
    dist_backend = "gloo"

    def __init__(self, module: SimulatedDeviceModule | None = None) -> None:
        if module is not None:
            check_instance(module, SimulatedDeviceModule, "module")
        super().__init__(module)
        if module is not None:
            self.device_type = module.device_type  # type: ignore[misc]

    def _load_module(self) -> SimulatedDeviceModule:
        return simulated_backend(self.device_type)

    def probe(self) -> str | None:
        if self._module is None:
            return backend_conflict(self.device_type)
        return super().probe()
