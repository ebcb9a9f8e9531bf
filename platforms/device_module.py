"""Accelerators that torch exposes as a device module (``torch.cuda``, ``torch.npu``, ...).

CUDA and Ascend NPU have the same shape: a module with ``is_available()``,
``device_count()``, ``current_device()`` and a tuple ``default_generators`` of Philox
generators whose state is 16 bytes (uint64 seed, int64 offset). One implementation,
:class:`DeviceModulePlatform`, drives any such module; :class:`CUDAPlatform` and
:class:`NPUPlatform` only say where the module comes from, which backend talks between
ranks, and how to explain a missing device. A third-party accelerator that registers its
own module with torch can be served by the same class (see docs/plugins.md).

Nothing here initialises a device until an RNG operation is actually asked for: probing
only calls ``is_available()``, which torch documents as not creating a context.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any

import torch
from hyperrng.platforms.base import Platform, unpack_counter_state
from hyperrng.platforms.errors import ArgumentTypeError
from hyperrng.platforms.validate import check_index

__all__ = ["DeviceModulePlatform", "CUDAPlatform", "NPUPlatform"]

_MODULE_FUNCTIONS = ("is_available", "device_count")  # what probing calls first


class DeviceModulePlatform(Platform):
    """A counter-based accelerator driven through a torch device module.

    Args:
        module: the device module, or ``None`` to look it up lazily with
            :meth:`_load_module` (so that constructing the platform imports nothing).
            An object without the module functions the platform calls first
            (``is_available()``, ``device_count()``) is refused with :class:`ArgumentTypeError`.
    """

    counter_based = True

    def __init__(self, module: Any | None = None) -> None:
        if module is not None and not all(callable(getattr(module, f, None)) for f in _MODULE_FUNCTIONS):
            raise ArgumentTypeError(
                f"module must be a torch device module such as torch.cuda (with is_available() and device_count()), "
                f"got {type(module).__name__} {module!r:.60}; leave it out to use torch.{self.device_type}."
            )
        self._module = module

    @property
    def module(self) -> Any:
        """The device module (loaded on first use)."""
        if self._module is None:
            self._module = self._load_module()
        return self._module

    def _load_module(self) -> Any:
        """Import and return the device module; raise with the reason when it cannot."""
        get_device_module = getattr(torch, "get_device_module", None)  # torch >= 2.3
        if get_device_module is not None:
            return get_device_module(self.device_type)
        return getattr(torch, self.device_type)

    def probe(self) -> str | None:
        try:
            module = self.module
        except ImportError as exc:
            return str(exc)
        if not module.is_available():
            return self._unavailable_reason()
        if module.device_count() < 1:
            return f"torch.{self.device_type} reports no visible device"
        return None

    def _unavailable_reason(self) -> str:
        return f"torch.{self.device_type}.is_available() returned False"

    def device_count(self) -> int:
        return int(self.module.device_count())

    def current_device(self) -> int:
        return int(self.module.current_device())

    def set_device(self, index: int) -> None:
        self.module.set_device(check_index(index, self.device_count(), self.name))

    def is_capturing(self, index: int | None = None) -> bool:
        """Whether the current stream of device ``index`` is capturing a graph (the module's
        ``is_current_stream_capturing()``); ``False`` for a module without graphs, and for a
        device not initialised yet, which this never initialises."""
        module = self._module or self.module  # (the property's frame, saved: every portable draw asks)
        is_initialized = getattr(module, "is_initialized", None)
        capturing = getattr(module, "is_current_stream_capturing", None)
        live = capturing is not None and (is_initialized is None or is_initialized())
        current = None
        if live and index is not None:  # current_device(), as in _position_generator
            own = type(self).current_device is DeviceModulePlatform.current_device
            current = int(module.current_device()) if own else self.current_device()
        if index is not None and not (type(index) is int and index == current):  # the current device is valid
            index = check_index(index, self.device_count(), self.name)
        if not live:
            return False
        if index is None or index == current:  # (index None: the current device's stream)
            return bool(capturing())
        with module.device(index):
            return bool(capturing())

    def default_generator(self, index: int | None = None) -> torch.Generator:
        return self._generator(self._index(index))

    def _generator(self, index: int) -> Any:
        # default_generators is filled by the module's lazy initialisation; calling it
        # here (never at import) keeps fork-before-use safe.
        lazy_init = getattr(self.module, "_lazy_init", None)
        if lazy_init is not None:
            lazy_init()
        return self.module.default_generators[index]

    def _read_state(self, index: int) -> torch.Tensor:
        return self._generator(index).get_state()

    # -- a portable draw's position, read and moved through the generator's seed and offset accessors:
    # two method calls instead of a 16-byte state tensor built, read and written (a GPU draw's host
    # time is mostly Python); used once a first comparison shows they agree with the state's bytes
    def _position(self) -> tuple[int, int]:
        gen = self._position_generator()
        if gen is not None:
            return gen.initial_seed(), gen.get_offset()
        return super()._position()

    def _move(self, seed: int, offset: int, draw: bool) -> None:
        gen = self._position_generator()
        if gen is not None and gen.initial_seed() == seed:
            gen.set_offset(offset)  # offsets passed here are whole Philox blocks, as set_offset requires
        else:
            super()._move(seed, offset, draw)

    def _position_generator(self) -> Any:
        """The current device's default generator if its accessors agree with its state (:meth:`_offsets_agree`),
        else ``None``. Every portable draw asks, so the generator of a device that agrees is kept (a module's
        default generators are made once, at its initialisation)."""
        # current_device(), without its frames unless a subclass overrides it (then its answer: the platform's)
        if type(self).current_device is DeviceModulePlatform.current_device:
            index = int((self._module or self.module).current_device())
        else:
            index = self.current_device()
        agreeing: dict[int, Any] | None = self.__dict__.get("_agreeing")
        if agreeing is not None:
            gen = agreeing.get(index)
            if gen is not None:
                return gen
        gen = self._generator(index)
        if not self._offsets_agree(index, gen):
            return None
        self.__dict__.setdefault("_agreeing", {})[index] = gen
        return gen

    def _offsets_agree(self, index: int, gen: Any) -> bool:
        """Whether device ``index``'s generator ``gen`` has ``initial_seed()``/``get_offset()``/``set_offset()``
        that are its state's seed and offset (a device module may lack them or mean other things): checked at
        the first use on that device, remembered by this platform."""
        verdicts: dict[int, bool] = self.__dict__.setdefault("_accessor_verdicts", {})
        known = verdicts.get(index)
        if known is None:
            if self.is_capturing():  # the check moves the offset and back: not while a graph records that
                return False
            known = verdicts[index] = _accessors_agree(gen)
        return known

    def _write_state(self, state: torch.Tensor, index: int) -> None:
        # Straight into the default generator: no clone, no lazy-call queue (the
        # module's own set_rng_state clones when the device is not initialised yet).
        self._generator(index).set_state(state)


class CUDAPlatform(DeviceModulePlatform):
    """NVIDIA GPUs through ``torch.cuda`` (ROCm builds of torch expose the same module)."""

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"

    def probe(self) -> str | None:
        if self._module is None and not torch.backends.cuda.is_built():
            return f"this torch build ({torch.__version__}) has no CUDA support"
        return super().probe()

    def _unavailable_reason(self) -> str:
        return "torch.cuda.is_available() returned False (no NVIDIA GPU visible, or no usable driver)"


class NPUPlatform(DeviceModulePlatform):
    """Huawei Ascend NPUs through ``torch_npu``, imported only when this platform is probed."""

    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"

    def _load_module(self) -> ModuleType:
        if importlib.util.find_spec("torch_npu") is None:
            raise ModuleNotFoundError("torch_npu is not installed (pip install 'hyperrng[npu]')")
        importlib.import_module("torch_npu")  # registers torch.npu as a side effect
        return torch.npu  # type: ignore[attr-defined, no-any-return]

    def _unavailable_reason(self) -> str:
        return "torch.npu.is_available() returned False (no Ascend NPU visible, or CANN not set up)"


def _accessors_agree(gen: Any) -> bool:
    """Read ``gen``'s seed and offset both ways, move the offset by one block with ``set_offset`` and read
    the state again; then put the state back exactly as it was."""
    if not all(callable(getattr(gen, name, None)) for name in ("initial_seed", "get_offset", "set_offset")):
        return False
    before = gen.get_state()
    try:
        seed, offset = unpack_counter_state(before)
        if (gen.initial_seed(), gen.get_offset()) != (seed, offset) or offset + 4 > 2**63 - 1:
            return False
        gen.set_offset(offset + 4)
        return bool(unpack_counter_state(gen.get_state()) == (seed, offset + 4) == (seed, gen.get_offset()))
    except Exception:  # an accessor the device does not implement, or a state of another format
        return False
    finally:
        gen.set_state(before)
