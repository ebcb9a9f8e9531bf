"""The :class:`Platform` interface: everything hyperrng asks of a kind of device.

A platform is mostly plain values (its name, torch device type, distributed backend,
whether its generator is counter-based) plus a few functions. The public methods
validate their arguments and then call two small hooks; a plug-in implements the hooks
and inherits the validation, so every platform refuses bad input the same way and never
touches the device before the input is known to be good. The class docstring lists the
whole interface in one table; collectives are functions of :mod:`hyperrng.platforms.comm`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal, NamedTuple

import torch
from hyperrng.platforms.errors import ArgumentTypeError, InvalidArgumentError, PlatformError
from hyperrng.platforms.validate import (
    MAX_OFFSET,
    check_index,
    check_instance,
    check_int,
    check_offset,
    check_seed,
    check_state,
    check_state_offset,
    error_gist,
)

__all__ = ["Platform", "StateIO", "COUNTER_STATE_NBYTES", "pack_counter_state", "unpack_counter_state"]

COUNTER_STATE_NBYTES = 16
"""Size of a counter-based (Philox) state: uint64 seed then int64 offset, little-endian."""

_BYTE_ORDER: Literal["little"] = "little"
_GENERATOR_API = ("get_state", "set_state", "manual_seed", "initial_seed")


class Platform:
    """One kind of device, seen through the few operations hyperrng needs.

    The table lists every member a plug-in author must know. *Must define*: the base
    class has no usable default. *May override*: the default (in brackets) fits a
    counter-based device. The three rows marked † exist for a generator without offsets,
    whose positions the platform models beside the generator's bytes (the CPU's MT19937,
    :mod:`hyperrng.platforms.cpu`): a counter-based platform keeps their defaults.
    :mod:`hyperrng.platforms.testing` checks every row.

    =====================================  =============  =================================================
    member                                 role           meaning [default]
    =====================================  =============  =================================================
    ``name``                               must define    registered name: ``"cpu"``, ``"cuda"``, a plug-in's
    ``device_type``                        must define    torch device type of its tensors [``"cpu"``]
    ``device_count()``                     must define    number of devices of this kind visible to the process
    ``_read_state(index)``                 must define    a new 1-D CPU uint8 tensor: device ``index``'s state
    ``_write_state(state, index)``         must define    make ``state`` (already checked) device ``index``'s
    ``dist_backend``                       may override   ``torch.distributed`` backend between ranks [``"gloo"``]
    ``counter_based``                      may override   state is a (seed, offset) pair that draws advance [no]
    ``probe()``                            may override   ``None`` if usable here, else why not; cheap [``None``]
    ``current_device()``                   may override   index used when none is given [0]
    ``set_device(index)``                  may override   make device ``index`` current [only the current one]
    ``default_generator(index)``           may override   generator random ops on ``index`` draw from [``None``]
    ``is_capturing(index)``                may override   device ``index`` captures a graph now [no]
    ``check_rng_state(state)``             may override†  ``state`` if ``set_rng_state`` takes it, else raise
    ``get_seed_offset(index, generator)``  may override†  (seed, offset) position [read from the 16 bytes]
    ``set_seed_offset(seed, offset, …)``   may override†  position device or generator [write the 16 bytes]
    =====================================  =============  =================================================

    *Call only*, implemented here on top of the table (a plug-in inherits them):
    ``device(index)``, ``get_rng_state(index)``, ``set_rng_state(state, index)``,
    ``manual_seed(seed, index)``.

    A counter-based accelerator needs the first eleven rows (twelve where it captures
    graphs), or only ``name``, ``device_type`` and ``dist_backend`` when it subclasses
    :class:`~hyperrng.platforms.DeviceModulePlatform`. The device of a platform whose
    ``device_type`` is ``"cpu"`` is the host: its generator is torch's CPU generator.
    Everything else is private (a platform whose state is not 16 bytes sets
    ``_state_nbytes``; one with a faster exact save/restore overrides :meth:`_state_io`, one
    that positions faster without checks :meth:`_position` and :meth:`_move`), or a function
    of :mod:`hyperrng.platforms.comm` (rank, world size, broadcast, all-gather).
    """

    name: ClassVar[str] = "abstract"
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"
    counter_based: ClassVar[bool] = False
    _state_nbytes: int = COUNTER_STATE_NBYTES  # the length check_rng_state's default expects

    # -- availability and devices ---------------------------------------------------
    def probe(self) -> str | None:
        """Return ``None`` when this platform can run here, else a non-empty string saying why not.

        Anything else (``True``, ``False``, ``""``) makes the platform unavailable as an invalid one.

        Must be cheap and must not initialise the device (it runs at ``import hyperrng``).
        """
        return None

    def device_count(self) -> int:
        """Number of devices of this kind visible to the process."""
        raise NotImplementedError(f"{type(self).__name__} must implement device_count()")

    def current_device(self) -> int:
        """Index of the device that operations without an explicit index use."""
        return 0

    def device(self, index: int | None = None) -> torch.device:
        """The ``torch.device`` of device ``index`` (default: the current device)."""
        return torch.device(self.device_type, self._index(index))

    def set_device(self, index: int) -> None:
        """Make device ``index`` the current device of this process.

        Forks, seeding and positions without an explicit index then act on it. The
        default serves platforms with one device; a platform with several overrides it.

        Raises:
            ArgumentTypeError: ``index`` is not an int.
            InvalidArgumentError: ``index`` names no device.
            PlatformError: the platform cannot switch to ``index`` (it does not implement switching).
        """
        chosen = check_index(index, self.device_count(), self.name)
        if chosen != self.current_device():
            raise PlatformError(
                f"platform {self.name!r} cannot make device {chosen} current: it does not implement "
                "set_device(); override Platform.set_device for a platform with several devices."
            )

    def default_generator(self, index: int | None = None) -> torch.Generator | None:
        """The generator object that random ops on device ``index`` draw from, if exposed."""
        return None

    def is_capturing(self, index: int | None = None) -> bool:
        """Whether work on device ``index``'s current stream is being captured into a graph now.

        While it is, a generator's state must not be copied in or out (a CUDA graph
        replays the capture, not the copies): a copying tracker's fork refuses to start.
        The default, ``False``, fits a device without graphs. Must not initialise the
        device: a device that was never used is not capturing.
        """
        return False

    # -- RNG state ----------------------------------------------------------------------
    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        """Return a copy of device ``index``'s RNG state as a 1-D CPU ``uint8`` tensor."""
        return self._read_state(self._index(index))

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        """Restore a state returned by :meth:`get_rng_state`.

        Raises:
            InvalidArgumentError: ``state`` is not a 1-D CPU uint8 tensor of ``_state_nbytes``;
                or ``index`` names no device. Nothing changes on error.
        """
        idx = self._index(index)
        self._write_state(self.check_rng_state(state), idx)

    def check_rng_state(self, state: torch.Tensor) -> torch.Tensor:
        """Return ``state`` if :meth:`set_rng_state` would accept it; change nothing.

        A counter-based state in the 16-byte (seed, offset) form must hold an offset that
        a device can have: non-negative and a multiple of 4 (Philox draws whole blocks).

        Raises:
            InvalidArgumentError: wrong type, dtype, length or device, an impossible offset,
                or (where the platform can tell) contents its generator refuses.
        """
        checked = check_state(state, self._state_nbytes, self.name)
        if self.counter_based and self._state_nbytes == COUNTER_STATE_NBYTES:
            check_state_offset(unpack_counter_state(checked)[1], f"RNG state for platform {self.name!r} has offset")
        return checked

    def manual_seed(self, seed: int, index: int | None = None) -> None:
        """Seed device ``index``: exactly ``set_seed_offset(seed, 0, index)``.

        Raises:
            InvalidArgumentError: ``seed`` is outside [0, 2**64 - 1];
                or ``index`` names no device. Nothing changes on error.
            ArgumentTypeError: ``seed`` is a bool or not an int.
        """
        self.set_seed_offset(seed, 0, index)

    def get_seed_offset(self, index: int | None = None, generator: torch.Generator | None = None) -> tuple[int, int]:
        """Return the (seed, offset) position of ``generator`` (default: device ``index``'s).

        On counter-based platforms this is read from the state; see subclasses for
        platforms that model positions.

        Raises:
            ArgumentTypeError: ``generator`` is not a generator.
            InvalidArgumentError: ``generator`` belongs to another device type, or its state is
                not a 16-byte (seed, offset) state.
        """
        if generator is None:
            return unpack_counter_state(self.get_rng_state(index))
        gen = self._check_generator(generator)
        state = gen.get_state()
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.numel() != COUNTER_STATE_NBYTES:
            raise InvalidArgumentError(
                f"{type(gen).__name__}.get_state() returned {_describe(state)}, not the {COUNTER_STATE_NBYTES}-byte "
                f"(seed, offset) state of a {self.name!r} generator; pass a generator of this device."
            )
        return unpack_counter_state(state)

    def set_seed_offset(
        self,
        seed: int,
        offset: int,
        index: int | None = None,
        generator: torch.Generator | None = None,
        *,
        draw: bool = False,
    ) -> None:
        """Position ``generator`` (default: device ``index``'s) at (seed, offset).

        ``draw=True`` says that the caller positions for a positioned draw (a sharded
        region's op) rather than for the plain draws that follow. A counter-based
        generator has one stream whose draws advance the offset, so it ignores the flag;
        a platform that models positions (the CPU) seeds the two kinds from separate
        domains so that a positioned draw never replays plain draws. One keyword, with a
        default, rather than a second method: existing plug-ins keep working unchanged.

        Raises:
            InvalidArgumentError: see :meth:`manual_seed`;
                or ``offset`` is negative, too large or not a multiple of 4;
                or ``generator`` belongs to another device type.
            ArgumentTypeError: ``draw`` is not a bool, or ``generator`` is not a generator.
        """
        state = pack_counter_state(check_seed(seed), check_offset(offset))
        check_instance(draw, bool, "draw")
        if generator is None:
            self._write_state(state, self._index(index))
        else:
            self._check_generator(generator).set_state(state)

    # -- private fast paths for sharded regions (a platform may override them for speed) --
    def _position(self) -> tuple[int, int]:
        """The current device's (seed, offset): :meth:`get_seed_offset` for a caller on a hot path."""
        return self.get_seed_offset()

    def _move(self, seed: int, offset: int, draw: bool) -> None:
        """:meth:`set_seed_offset` on the current device, for a caller that passes values it has checked
        (a sharded region, twice per op): an override may skip the checks, not change the result."""
        self.set_seed_offset(seed, offset, draw=draw)

    def _position_generator(self) -> Any:
        """The current device's generator where its ``initial_seed()``, ``get_offset()`` and ``set_offset()``
        are exactly :meth:`_position` and :meth:`_move` at the same seed, else ``None`` (here): one lookup
        for a portable draw that reads its position and then moves it."""
        return None

    # -- hooks: a plug-in implements the first two, and may override _state_io for speed --
    def _read_state(self, index: int) -> torch.Tensor:
        """Return a new 1-D CPU uint8 tensor of ``_state_nbytes``: device ``index``'s whole RNG state.

        ``index`` is already checked. The tensor is the caller's: it must not share memory
        with the device's live state.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement _read_state(index)")

    def _write_state(self, state: torch.Tensor, index: int) -> None:
        """Make ``state`` device ``index``'s RNG state; both are already checked, so nothing can fail here."""
        raise NotImplementedError(f"{type(self).__name__} must implement _write_state(state, index)")

    def _state_io(self, index: int | None = None) -> StateIO:
        """The fastest exact way to save and restore device ``index``'s whole RNG state (private: the
        default is exact for every platform, an override only makes it faster).

        For hot paths that copy states they read themselves (tracker forks, ``fork_rng``,
        recompute). ``read()`` returns an opaque snapshot and ``write(snapshot)`` puts one
        back *without validation*: pass it only what ``read`` returned. ``pack`` turns a
        snapshot into the tensor :meth:`get_rng_state` returns; ``unpack`` turns a state
        tensor that :meth:`check_rng_state` accepted into a snapshot.

        The default copies the default generator's bytes where those are the whole state
        (counter-based devices), and goes through :meth:`get_rng_state` /
        :meth:`set_rng_state` otherwise. A platform whose state has parts outside the
        generator (the CPU's position) overrides it.
        """
        gen = self.default_generator(index) if self.counter_based else None
        if gen is not None:
            return StateIO(gen.get_state, gen.set_state)
        i = self._index(index)
        return StateIO(lambda: self.get_rng_state(i), lambda state: self.set_rng_state(state, i))

    # -- shared helpers -------------------------------------------------------------------
    def _index(self, index: int | None) -> int:
        if index is None:
            return self.current_device()
        return check_index(index, self.device_count(), self.name)

    def _check_generator(self, generator: object) -> Any:
        """Return ``generator`` if it is a generator of this platform's device type, else raise.

        A generator is a ``torch.Generator`` (subclasses included) or an object with the
        whole generator API (device modules written in Python have their own, such as
        the simulated device's); an object that merely has a ``device`` is not.

        Raises:
            ArgumentTypeError: ``generator`` is not a generator.
            InvalidArgumentError: it belongs to another device type.
        """
        try:  # a look-alike's attributes may raise anything: read them here, where it becomes a typed error
            generator_api = isinstance(generator, torch.Generator) or all(
                callable(getattr(generator, method, None)) for method in _GENERATOR_API
            )
            device = getattr(generator, "device", None) if generator_api else None
        except Exception as exc:
            raise InvalidArgumentError(
                f"the device of generator {type(generator).__name__} cannot be read ({error_gist(exc)}); pass a "
                f"generator of device type {self.device_type!r} whose device module is registered, or None."
            ) from None
        if not generator_api:
            raise ArgumentTypeError(
                f"generator must be a torch.Generator (or a device module's generator, with "
                f"{', '.join(_GENERATOR_API)}), got {type(generator).__name__}; pass None for the default generator."
            )
        if not isinstance(device, torch.device) or device.type != self.device_type:
            raise InvalidArgumentError(
                f"generator on {device} does not belong to platform {self.name!r} (device type "
                f"{self.device_type!r}); pass a generator created on that device, or None for the default."
            )
        return generator

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} device_type={self.device_type!r}>"


class StateIO(NamedTuple):
    """What :meth:`Platform._state_io` returns: read/write of snapshots, and their conversion to state tensors.

    ``pack`` returns a tensor the caller may keep and modify; ``unpack`` keeps no
    reference to the tensor it is given. Both default to ``torch.Tensor.clone``, which is
    right where a snapshot is itself a state tensor.
    """

    read: Callable[[], Any]
    write: Callable[[Any], object]
    pack: Callable[[Any], torch.Tensor] = torch.Tensor.clone
    unpack: Callable[[torch.Tensor], Any] = torch.Tensor.clone


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of {value.numel()} elements"
    return f"a {type(value).__name__}"


def unpack_counter_state(state: torch.Tensor) -> tuple[int, int]:
    """Split a 16-byte counter-based state into ``(seed, offset)``.

    Works on every torch version: the bytes are read in Python, never through uint64
    tensor ops (which older torch lacks).

    Raises:
        ArgumentTypeError: ``state`` is not a tensor.
        InvalidArgumentError: a tensor that is not ``torch.uint8``, does not hold 16 elements, or
            has no values to read (a meta tensor).
    """
    if not isinstance(state, torch.Tensor):
        raise ArgumentTypeError(
            f"state must be the {COUNTER_STATE_NBYTES}-byte torch.uint8 tensor of a counter-based generator, "
            f"got {type(state).__name__}."
        )
    if state.dtype != torch.uint8 or state.numel() != COUNTER_STATE_NBYTES or state.device.type == "meta":
        raise InvalidArgumentError(
            f"state must be the {COUNTER_STATE_NBYTES}-byte torch.uint8 tensor of a counter-based generator "
            f"(uint64 seed, int64 offset), got {_describe(state)} on {state.device}."
        )
    raw = bytes(state.reshape(-1).tolist())
    seed = int.from_bytes(raw[:8], _BYTE_ORDER, signed=False)
    offset = int.from_bytes(raw[8:16], _BYTE_ORDER, signed=True)
    return seed, offset


def pack_counter_state(seed: int, offset: int) -> torch.Tensor:
    """Build the 16-byte state (uint64 seed, int64 offset, little-endian) that CUDA and NPU use.

    Any int64 ``offset`` is packed, also one no generator accepts (negative, or not a multiple
    of 4): :meth:`Platform.check_rng_state` refuses those when the state is set.

    Raises:
        ArgumentTypeError: ``seed`` or ``offset`` is not an int (bools refused).
        InvalidArgumentError: ``seed`` is outside ``[0, 2**64 - 1]`` or ``offset`` outside
            ``[-2**63, 2**63 - 1]``.
    """
    seed = check_seed(seed)
    offset = check_int(offset, "offset")
    if not -(2**63) <= offset <= MAX_OFFSET:
        raise InvalidArgumentError(f"offset must fit an int64, in [-2**63, 2**63 - 1], got {offset}.")
    raw = seed.to_bytes(8, _BYTE_ORDER, signed=False) + offset.to_bytes(8, _BYTE_ORDER, signed=True)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)
