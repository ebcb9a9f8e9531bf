"""A simulated accelerator: a CPU-backed device module with a counter-based generator.

It has the RNG API of ``torch.cuda`` / ``torch.npu`` (``default_generators``,
``get_rng_state``, ``set_rng_state``, ``manual_seed``, ``initial_seed``, ...) and a
16-byte (uint64 seed, int64 offset) state, so every CUDA/NPU code path of hyperrng runs
on a machine without an accelerator: ``CUDAPlatform(module=SimulatedDeviceModule())``
drives the CUDA implementation, ``NPUPlatform(module=...)`` the NPU one, and
``HYPERRNG_PLATFORM=sim`` selects it as a platform of its own.

Tensors of the simulated device live in CPU memory. Its random draws (:meth:`rand`,
:meth:`randn`, :meth:`dropout`) behave like a Philox device: they are a pure function of
(seed, offset) and advance the offset by the element count rounded up to 4, so
positioning a generator at a (seed, offset) pair reproduces exactly what was drawn there.

It is also the worked example of plugging in a device: see the README.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

from platforms.base import COUNTER_STATE_NBYTES, pack_counter_state, unpack_counter_state
from platforms.device_module import DeviceModulePlatform
from platforms.errors import InvalidStateError
from platforms.mix import combine64
from platforms.validate import check_index, check_offset, check_seed, round_up_offset

__all__ = ["SimulatedGenerator", "SimulatedDeviceModule", "SimulatedPlatform"]

_DRAW_DOMAIN = 0x53494D30  # "SIM0": separates draw seeds from other uses of the mixer
_DEFAULT_SEED = 67280421310721  # torch's default CUDA seed, so a fresh device looks familiar


class _Counter:
    """The mutable (seed, offset) pair; shared between generators by graph-safe swaps."""

    __slots__ = ("seed", "offset")

    def __init__(self, seed: int, offset: int = 0) -> None:
        self.seed = seed
        self.offset = offset


class SimulatedGenerator:
    """A Philox-style generator: a seed and an offset that advances by 4-aligned steps."""

    def __init__(self, index: int = 0, seed: int = _DEFAULT_SEED, device_type: str = "cpu") -> None:
        self.index = index
        self.device_type = device_type
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
            raise InvalidStateError(f"simulated generator state must be {COUNTER_STATE_NBYTES} uint8 bytes")
        self._counter.seed, self._counter.offset = unpack_counter_state(new_state)
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
        view = SimulatedGenerator(self.index, device_type=self.device_type)
        view._counter = self._counter
        return view

    def graphsafe_set_state(self, other: SimulatedGenerator) -> SimulatedGenerator:
        self._counter = other._counter
        return self

    def clone_state(self) -> SimulatedGenerator:
        clone = SimulatedGenerator(self.index, device_type=self.device_type)
        clone._counter = _Counter(self._counter.seed, self._counter.offset)
        return clone

    def _take(self, numel: int) -> torch.Generator:
        """Return a CPU generator for the next ``numel`` draws and advance the offset."""
        g = torch.Generator().manual_seed(combine64(_DRAW_DOMAIN, self._counter.seed, self._counter.offset))
        self._counter.offset += round_up_offset(numel)
        return g


class SimulatedDeviceModule:
    """A stand-in for ``torch.cuda`` / ``torch.npu`` with CPU-backed devices.

    Args:
        device_count: how many devices to simulate.
        available: what :meth:`is_available` answers (to simulate a missing device).
        device_type: the device type its generators report (``"cuda"`` when it stands in
            for ``torch.cuda``); tensors stay in CPU memory whatever it says.
    """

    def __init__(self, device_count: int = 2, available: bool = True, device_type: str = "cpu") -> None:
        self.device_type = device_type
        self._count = device_count
        self._available = available
        self._current = 0
        self._generators: tuple[SimulatedGenerator, ...] = ()
        self.lazy_init_calls = 0

    # -- device module API ----------------------------------------------------------------
    def is_available(self) -> bool:
        return self._available and self._count > 0

    def is_initialized(self) -> bool:
        return bool(self._generators)

    def device_count(self) -> int:
        return self._count if self._available else 0

    def _lazy_init(self) -> None:
        if not self._generators:
            if not self.is_available():
                raise RuntimeError("simulated device is not available")
            self.lazy_init_calls += 1
            self._generators = tuple(SimulatedGenerator(i, device_type=self.device_type) for i in range(self._count))

    @property
    def default_generators(self) -> tuple[SimulatedGenerator, ...]:
        return self._generators

    def current_device(self) -> int:
        self._lazy_init()
        return self._current

    def set_device(self, index: int) -> None:
        self._lazy_init()
        self._current = check_index(index, self._count, "sim")

    def synchronize(self, device: int | None = None) -> None:
        """Nothing to wait for: simulated work runs synchronously on the CPU."""

    def _gen(self, device: int | str | torch.device | None) -> SimulatedGenerator:
        self._lazy_init()
        if device is None or isinstance(device, (str, torch.device)):
            idx = torch.device(device).index if device is not None else None
            return self._generators[self._current if idx is None else idx]
        return self._generators[device]

    def get_rng_state(self, device: int | str | torch.device | None = None) -> torch.Tensor:
        return self._gen(device).get_state()

    def set_rng_state(self, new_state: torch.Tensor, device: int | str | torch.device | None = None) -> None:
        self._gen(device).set_state(new_state)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        self._lazy_init()
        return [g.get_state() for g in self._generators]

    def set_rng_state_all(self, new_states: Sequence[torch.Tensor]) -> None:
        self._lazy_init()
        for g, s in zip(self._generators, new_states):
            g.set_state(s)

    def manual_seed(self, seed: int) -> None:
        self._gen(None).manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self._lazy_init()
        for g in self._generators:
            g.manual_seed(seed)

    def seed(self) -> None:
        self._gen(None).seed()

    def initial_seed(self) -> int:
        return self._gen(None).initial_seed()

    # -- random draws on the simulated device ---------------------------------------------
    def rand(self, *size: int, generator: SimulatedGenerator | None = None) -> torch.Tensor:
        """Uniform [0, 1) float32 numbers drawn at the generator's (seed, offset)."""
        gen = generator if generator is not None else self._gen(None)
        numel = _numel(size)
        return torch.rand(size, generator=gen._take(numel))

    def randn(self, *size: int, generator: SimulatedGenerator | None = None) -> torch.Tensor:
        """Standard normal float32 numbers drawn at the generator's (seed, offset)."""
        gen = generator if generator is not None else self._gen(None)
        numel = _numel(size)
        return torch.randn(size, generator=gen._take(numel))

    def dropout(self, x: torch.Tensor, p: float = 0.5, generator: SimulatedGenerator | None = None) -> torch.Tensor:
        """Inverted dropout of ``x`` with a mask drawn at the generator's (seed, offset)."""
        keep = self.rand(*x.shape, generator=generator) >= p
        return x * keep / (1.0 - p) if p < 1.0 else torch.zeros_like(x)


def _numel(size: Sequence[int]) -> int:
    n = 1
    for s in size:
        n *= s
    return n


class SimulatedPlatform(DeviceModulePlatform):
    """The simulated accelerator as a platform of its own (``HYPERRNG_PLATFORM=sim``).

    It is never picked automatically. The gloo backend carries its collectives, since its
    tensors live in CPU memory.
    """

    name = "sim"
    device_type = "cpu"
    dist_backend = "gloo"

    def __init__(self, module: SimulatedDeviceModule | None = None) -> None:
        super().__init__(module if module is not None else SimulatedDeviceModule())

    def device(self, index: int | None = None) -> torch.device:
        self._index(index)
        return torch.device("cpu")

    def _check_generator(self, generator: torch.Generator) -> torch.Generator:
        # Its tensors live on the CPU, so the device type cannot tell its generators apart
        # from torch's CPU ones (whose 5056-byte state would be misread as a position).
        if not isinstance(generator, SimulatedGenerator) or generator.device.type != self.device_type:
            raise InvalidStateError(
                f"{type(generator).__name__} on {getattr(generator, 'device', None)} does not belong to platform "
                "'sim'; pass platform.default_generator() or a clone_state() of it."
            )
        return generator
