"""A simulated accelerator: a torch device of its own, with a counter-based generator.
``HYPERRNG_PLATFORM=sim`` (or ``hyperrng.platforms.use("sim")``) selects it
(:class:`SimulatedPlatform`). It registers, once per process and on first use, torch's
``PrivateUse1`` backend under the name ``"sim"``, with the device module
:class:`SimulatedDeviceModule` as ``torch.sim``; tensors on ``"sim:0"`` and ``"sim:1"`` then
behave like tensors of an accelerator, their ops run by
:mod:`hyperrng.platforms._simulated_dispatch` (whose ``_DeviceTensor`` says how). The same module
also stands in for ``torch.cuda`` or ``torch.npu`` in tests, and is the worked example of plugging
in a device: see docs/plugins.md.
"""

from __future__ import annotations

import contextlib
import re
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from hyperrng.platforms import _features
from hyperrng.platforms._simulated_dispatch import _Backend, _hook_classes, _run
from hyperrng.platforms.base import COUNTER_STATE_NBYTES, pack_counter_state, unpack_counter_state
from hyperrng.platforms.device_module import DeviceModulePlatform
from hyperrng.platforms.errors import InvalidArgumentError, PlatformError
from hyperrng.platforms.validate import (
    check_index,
    check_instance,
    check_int,
    check_offset,
    check_seed,
    check_state_offset,
)
from torch.utils._mode_utils import no_dispatch

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

_DEFAULT_SEED = 67280421310721  # torch's default CUDA seed, so a fresh device looks familiar
_DEFAULT_DEVICE_COUNT = 2
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

    So it also stands in for ``torch.cuda`` or ``torch.npu`` in tests:
    ``CUDAPlatform(module=SimulatedDeviceModule(device_type="cuda"))`` drives the CUDA
    implementation's generator paths without a GPU (no tensors: ``"cuda"`` stays torch's).

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
def backend_conflict(device_type: str = SIM_DEVICE_TYPE) -> str | None:
    """Why ``device_type`` cannot be registered as a simulated backend here (``None`` if it can).

    Changes nothing: the probe of :class:`SimulatedPlatform` calls it at import time.

    Registering a device backend written in Python needs torch's ``torch._C._acc`` hooks
    (torch >= 2.10, see :mod:`hyperrng.platforms._features`): on an older torch this module
    still imports, the platform's probe says which torch it needs, and selecting it raises
    that reason as a :class:`~hyperrng.platforms.errors.PlatformError`.
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


class SimulatedPlatform(DeviceModulePlatform):
    """The simulated accelerator as a platform of its own (``HYPERRNG_PLATFORM=sim``).

    Args:
        module: the device module to drive, a :class:`SimulatedDeviceModule` (else
            :class:`ArgumentTypeError`); by default the one registered with torch as
            the ``"sim"`` device type (registered on first use, never at construction or
            while probing).

    It is never picked automatically. Its collectives run over gloo, staged through the
    host (see :func:`hyperrng.platforms.comm.broadcast`).

    What it does not model: speed (each op pays a Python dispatch; and because torch's Python
    backend hooks report a single device to autograd's per-device worker threads, the thread
    that registered it runs backward passes itself, while a backward through ``sim:1`` on
    another thread fails), CUDA's exact Philox numbers (a draw is a stable mix of (seed,
    offset) fed to a CPU generator: a pure function of the pair, but other numbers than a
    GPU's), streams and events, graph replays, memory limits, explicit ``generator=`` arguments
    in torch ops (refused; position the device generator instead, e.g. through a tracker
    stream), DTensor/``DeviceMesh`` on the ``sim`` device type, ``torch.compile``, pickling
    device tensors, and a second ``PrivateUse1`` backend in the same process (torch has one
    slot: with ``torch_npu`` or another such plug-in loaded, this platform reports itself
    unavailable).
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
