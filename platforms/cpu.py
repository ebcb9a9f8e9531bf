"""The CPU platform: real, the default everywhere no accelerator is found.

torch's CPU generator is MT19937, whose state has no offset. This platform gives every
(seed, offset) position a 64-bit **handle** and seeds MT19937 from it:

* Two domains. A *free* position, where plain draws happen (after ``set_seed_offset``,
  after a sharded region), has the handle ``seed`` at offset 0 (so ``(s, 0)`` is exactly
  ``torch.manual_seed(s)`` for ``s < 2**32``) and a stable mix of (seed, offset) otherwise.
  A *draw* position, where a sharded region's op draws (``set_seed_offset(..., draw=True)``),
  has another mix. The mix is a bijection of ``mix64(seed) + offset + draw``, so two
  positions of one seed never share a handle, and positions of different seeds do with
  probability ``2**-64`` per pair. Plain draws after a region come from a free position
  and the next region's op from a draw position, so no positioned draw replays a plain
  one, and nothing needs to know whether the generator has drawn.
* All 64 bits count. A handle below 2**32 seeds MT19937 as ``manual_seed`` does; a larger
  one fills the 624 MT19937 words with 624 multiply-shift hashes of the handle (torch
  itself keeps only the low 32 bits of a seed). The generator reports the handle as its
  ``initial_seed()``. Where the words sit is torch's persisted state format; it is checked
  once, on a scratch generator, and if it ever differs positions fall back to the handle's
  low 32 bits (:func:`seeds_all_64_bits` says which).
* A bounded table maps the handles positioned in this process to their (seed, offset): at
  least the last :data:`POSITIONS_KEPT`, at most twice as many (two generations of dicts:
  when the newer one is full it becomes the older, and the older is dropped). The position
  of any CPU generator is ``table[initial_seed()]``, or ``(initial_seed(), 0)`` for a
  handle it does not hold: a plain ``torch.Generator``, bytes restored by
  ``torch.set_rng_state``, ``torch.utils.checkpoint`` or ``fork_rng`` read as the position
  they were saved at while the table remembers it.
* The platform's own state (:meth:`CPUPlatform.get_rng_state`) is the 5056 MT19937 bytes
  followed by the position (uint64 seed, int64 offset): :data:`CPU_STATE_NBYTES` bytes.
  Restoring it checks that the position's handle is the bytes' initial seed and enters it
  in the table again, so checkpoints resume exactly in a fresh process. States saved by
  releases before this model do not load (their position does not match their bytes).

What the model does *not* give: the stream at (seed, offset + k) is not the stream at
(seed, offset) advanced by k draws, as it is on CUDA/NPU. Code that needs numbers that
are identical across devices should use the portable Philox generator instead.
"""

from __future__ import annotations

import functools
import struct
import threading
from typing import Any

import numpy as np
import torch
from hyperrng.platforms._features import outside_dynamo
from hyperrng.platforms.base import Platform, StateIO
from hyperrng.platforms.errors import ArgumentTypeError, InvalidArgumentError
from hyperrng.platforms.mix import mix64
from hyperrng.platforms.validate import (
    check_instance,
    check_offset,
    check_seed,
    check_state,
    check_state_offset,
)

__all__ = [
    "CPUPlatform",
    "CPU_STATE_NBYTES",
    "MT19937_STATE_NBYTES",
    "POSITIONS_KEPT",
    "check_mt19937_state",
    "mt19937_degenerate",
    "position_handle",
    "seed_generator",
    "seeds_all_64_bits",
]

MT19937_STATE_NBYTES = 5056
"""Size of torch's CPU generator state (MT19937 words plus normal-sampling caches)."""

CPU_STATE_NBYTES = MT19937_STATE_NBYTES + 16
"""Size of this platform's RNG state: the MT19937 bytes followed by the (seed, offset) position."""

POSITIONS_KEPT = 2**16
"""The table remembers at least this many of the handles positioned last, and at most twice as many
(about 150 bytes each: at most about 20 MB); older ones are forgotten."""

_MASK32 = (1 << 32) - 1
_HANDLE_DOMAIN = 0x43505531  # "CPU1": keeps handles apart from other uses of the mixer
_WORD_DOMAIN = 0x57524453  # "WRDS": the multipliers of the 624 word hashes
_MT_WORDS = 624
_WORDS_AT = 24  # torch's state: uint64 initial seed, int32 left, int32 seeded, uint64 next, then uint64 words
_POSITION = struct.Struct("<Qq")  # after the MT19937 bytes: uint64 seed, int64 offset


def position_handle(seed: int, offset: int, draw: bool = False) -> int:
    """The 64-bit handle of position (seed, offset) in the free or the draw domain (see the module docstring)."""
    if offset == 0 and not draw:
        return seed
    last = _last_seed  # a region positions one seed twice: its mix is remembered (one pair, replaced atomically)
    base = last[1] if last[0] == seed else _seed_mix(seed)
    return mix64(base + offset + draw)  # offset is a multiple of 4: + draw keeps the domains apart


def _seed_mix(seed: int) -> int:
    global _last_seed
    base = mix64(seed ^ _HANDLE_DOMAIN)
    _last_seed = (seed, base)
    return base


_last_seed = (-1, 0)


# The table: handle -> (seed, offset), in two generations. Handles are entered in ``_young``; when
# it holds POSITIONS_KEPT of them it becomes ``_old`` and the old one is dropped, so the table
# holds the last POSITIONS_KEPT to 2 * POSITIONS_KEPT handles entered. Each step is one dict
# operation or one rebinding, so readers take no lock: a lookup that races a rotation finds its
# handle in one of the two generations unless it is older than the last POSITIONS_KEPT. Writers
# take the lock only to rotate, or in the unlikely case that the dict they entered a handle in
# was dropped meanwhile (a free-threaded build can run two rotations during one entry).
_young: dict[int, tuple[int, int]] = {}
_old: dict[int, tuple[int, int]] = {}
_rotation = threading.Lock()
# Bound once (torch.compile recognises the function itself, not its name): a fork asks twice.
# Only dynamo traces Python code such as the table's lookups into a graph, so its own flag is
# the one that matters; it is also a third of the cost of ``torch.compiler.is_compiling``.
_is_compiling = torch.compiler.is_dynamo_compiling
# torch's CPU generator is one object for the life of the process: it and its methods are bound
# once, for the reads and writes of every fork and region, not looked up on ``torch`` at each call.
_default = torch.default_generator
_initial_seed = _default.initial_seed
_get_state = _default.get_state
_set_default_state = _default.set_state


def _entry(handle: int) -> tuple[int, int] | None:
    """The position ``handle`` was entered for, or ``None`` when the table does not hold it."""
    if _is_compiling():  # see _outside_the_graph
        return _outside_the_graph(_entry)(handle)  # type: ignore[no-any-return]
    return _young.get(handle) or _old.get(handle)


def _remember(handle: int, position: tuple[int, int]) -> None:
    """Enter ``handle`` in the newer generation (a handle names one position: entering it again only
    keeps it there, as a fork does when it writes its saved state back)."""
    global _old, _young
    if _is_compiling():
        _outside_the_graph(_remember)(handle, position)
        return
    young = _young
    if handle in young:
        return
    young[handle] = position
    if len(young) >= POSITIONS_KEPT or (young is not _young and young is not _old):
        with _rotation:
            if _young is young:
                _old, _young = young, {}
            elif _old is not young:  # entered in a dropped generation: enter it again
                _young[handle] = position


_outside_the_graph = functools.cache(outside_dynamo)
"""``fn`` run eagerly when torch.compile traces code that reaches it (a fork inside a compiled function):
tracing the table would turn each of its up to POSITIONS_KEPT entries into a graph input. Eager calls never
come here, so they pay no wrapper; each function is wrapped once."""


# -- seeding MT19937 from 64 bits ------------------------------------------------------------

_PROBE_SEED, _PROBE_HANDLE = 0x5EED1234, 0xC0FFEE005EED1234
_MULTIPLIERS = np.array([mix64(i ^ _WORD_DOMAIN) | 1 for i in range(_MT_WORDS)], dtype=np.uint64)
_HALF = np.array(32, dtype=np.uint64)
_multiply, _right_shift, _set_state = np.multiply, np.right_shift, torch.Generator.set_state
_UNPROBED = object()
_template: Any = _UNPROBED  # a freshly seeded state's bytes, or None: 32-bit fallback


class _Seating(threading.local):
    """A thread's buffer for one position's state (``set_state`` copies it at once).

    Word i of a handle's state is the high half of ``multiplier_i * handle`` mod 2**64
    (multiply-shift hashing); the other bytes are those of a freshly seeded generator.
    """

    def __init__(self, template: np.ndarray) -> None:
        self.raw = template.copy()
        self.tensor = torch.frombuffer(self.raw, dtype=torch.uint8)  # shares memory; immune to dispatch modes
        # The initial-seed field as a 0-d array: it is also the multiplication's operand, which
        # NumPy takes as it is, where a Python int or a NumPy scalar costs a conversion per call.
        seed = self.raw[:8].view(np.uint64).reshape(())
        words = self.raw[_WORDS_AT : _WORDS_AT + 8 * _MT_WORDS].view(np.uint64)
        self.parts = (seed, words, self.tensor)  # one lookup of this thread's attributes per fill

    def seat(self, gen: torch.Generator, handle: int) -> None:
        """Fill the buffer for ``handle`` and set it as the state of ``gen``."""
        seed, words, tensor = self.parts
        seed[()] = handle
        # ``out`` passed by position: NumPy parses a keyword argument on every call.
        _multiply(_MULTIPLIERS, seed, words)
        _right_shift(words, _HALF, words)  # each word is below 2**32, as MT19937's words are
        _set_state(gen, tensor)


def _probe() -> np.ndarray | None:
    """The bytes of a freshly seeded generator, if torch keeps MT19937's words where :class:`_Seating` writes them.

    Public APIs, a scratch generator, no tensor op (no dispatch mode can intervene): after
    ``manual_seed(s)`` the words follow MT19937's initialisation from ``s``, and words
    written there come back from ``get_state()`` as written.
    """
    scratch = torch.Generator().manual_seed(_PROBE_SEED)
    raw = np.from_dlpack(scratch.get_state()).copy()
    if raw.dtype != np.uint8 or raw.shape != (MT19937_STATE_NBYTES,) or raw[:8].view(np.uint64)[0] != _PROBE_SEED:
        return None
    expected = _PROBE_SEED
    for i, word in enumerate(raw[_WORDS_AT : _WORDS_AT + 8 * _MT_WORDS].view(np.uint64).tolist()):
        if word != expected:
            return None
        expected = (1812433253 * (expected ^ (expected >> 30)) + i + 1) & _MASK32
    trial = _Seating(raw)
    trial.seat(scratch, _PROBE_HANDLE)
    written = np.from_dlpack(scratch.get_state())
    return raw if scratch.initial_seed() == _PROBE_HANDLE and np.array_equal(written, trial.raw) else None


def seeds_all_64_bits() -> bool:
    """Whether handles of 2**32 and above fill MT19937 from all 64 bits (``hyperrng info`` reports it).

    ``False`` only where the installed torch keeps its CPU generator state in a layout
    this platform does not recognise: handles then seed MT19937 from their low 32 bits
    (as ``torch.manual_seed`` does), and two positions share a stream with probability
    ``2**-32`` per pair.
    """
    global _template
    if _template is _UNPROBED:
        _template = _probe()
    return _template is not None


_seating: _Seating | None = None


def _seat(gen: torch.Generator, handle: int) -> None:
    """Seed MT19937 of ``gen`` from all 64 bits of ``handle`` and make ``handle`` its ``initial_seed()``.

    Calls ``torch.Generator``'s own methods: a subclass's Python overrides are not what
    torch's kernels draw from either.
    """
    global _seating
    if handle > _MASK32 and _seating is not None:
        _seating.seat(gen, handle)
    elif handle <= _MASK32 or not seeds_all_64_bits():
        torch.Generator.manual_seed(gen, handle)
    else:
        _seating = _Seating(_template)
        _seating.seat(gen, handle)


def _place(gen: torch.Generator, seed: int, offset: int, draw: bool) -> None:
    """Seed ``gen`` from the handle of (seed, offset) and enter the handle in the table (ints already checked)."""
    handle = position_handle(seed, offset, draw)
    _seat(gen, handle)
    if handle != seed or offset:  # (seed, 0) reads as itself without an entry
        _remember(handle, (seed, offset))


def seed_generator(gen: torch.Generator, seed: int) -> None:
    """Seed a CPU generator with all 64 bits of ``seed``: exactly ``gen.manual_seed(seed)`` below 2**32.

    Raises:
        ArgumentTypeError: ``gen`` is not a ``torch.Generator``, or ``seed`` not an int.
        InvalidArgumentError: ``seed`` is outside [0, 2**64 - 1], or ``gen`` is not a CPU
            generator. Nothing changes on error.
    """
    value = check_seed(seed)
    check_instance(gen, torch.Generator, "gen")
    if gen.device.type != "cpu":
        raise InvalidArgumentError(f"seed_generator seeds CPU generators, got one on {gen.device}.")
    _seat(gen, value)


# -- the platform ------------------------------------------------------------------------------


class CPUPlatform(Platform):
    """The host CPU, drawing from ``torch.default_generator``; positions seeded from 64-bit handles."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    counter_based = False
    _state_nbytes = CPU_STATE_NBYTES

    def device_count(self) -> int:
        return 1

    def default_generator(self, index: int | None = None) -> torch.Generator:
        self._index(index)
        return torch.default_generator

    def get_seed_offset(self, index: int | None = None, generator: torch.Generator | None = None) -> tuple[int, int]:
        """Return the position of ``generator`` (default: the device's): the table's entry for its
        ``initial_seed()``, else ``(initial_seed(), 0)``.

        Raises:
            ArgumentTypeError: ``generator`` is not a ``torch.Generator``.
            InvalidArgumentError: ``generator`` belongs to another device type.
        """
        if index is None and generator is None:
            return self._position()
        handle = torch.Generator.initial_seed(self._target(index, generator))
        return _entry(handle) or (handle, 0)

    def set_seed_offset(
        self,
        seed: int,
        offset: int,
        index: int | None = None,
        generator: torch.Generator | None = None,
        *,
        draw: bool = False,
    ) -> None:
        """Seed MT19937 from the handle of (seed, offset) and enter the handle in the table.

        ``draw=True`` positions in the draw domain (a sharded region's op), otherwise in the
        free domain; see the module docstring.
        """
        s, o = check_seed(seed), check_offset(offset)
        check_instance(draw, bool, "draw")
        _place(_default if index is None and generator is None else self._target(index, generator), s, o, draw)

    def _position(self) -> tuple[int, int]:
        handle = _initial_seed()
        return _entry(handle) or (handle, 0)

    def _move(self, seed: int, offset: int, draw: bool) -> None:
        _place(_default, seed, offset, draw)

    def check_rng_state(self, state: torch.Tensor) -> torch.Tensor:
        """Check the length, the MT19937 bytes (on a scratch generator; the degenerate all-zero
        state refused) and that the position belongs to them (its handle, in either domain, is their
        initial seed); change nothing."""
        checked = check_state(state, self._state_nbytes, self.name)
        initial_seed = check_mt19937_state(checked[:MT19937_STATE_NBYTES], self.name)
        seed, offset = _POSITION.unpack_from(np.from_dlpack(checked).tobytes(), MT19937_STATE_NBYTES)
        check_state_offset(offset, f"RNG state for platform {self.name!r} has a cursor offset of")
        if initial_seed not in (position_handle(seed, offset), position_handle(seed, offset, True)):
            raise InvalidArgumentError(
                f"RNG state for platform {self.name!r} has a cursor ({seed}, {offset}) that does not belong to its "
                "MT19937 bytes (they were seeded for another position, or saved by a release before positions had "
                "64-bit handles); pass a state returned by get_rng_state(), unmodified."
            )
        return checked

    def _target(self, index: int | None, generator: torch.Generator | None) -> torch.Generator:
        if index is not None:
            self._index(index)
        if generator is None:
            return torch.default_generator
        checked = self._check_generator(generator)
        if not isinstance(checked, torch.Generator):  # torch's CPU kernels take nothing else
            raise ArgumentTypeError(
                f"a CPU generator must be a torch.Generator, got {type(generator).__name__}; "
                "pass None for the default generator."
            )
        return checked

    def _state_io(self, index: int | None = None) -> StateIO:
        """Snapshots are (MT19937 bytes, handle, table entry): the position is resolved when read, and
        entered in the table again when written, so a snapshot outlives the table's memory."""
        self._index(index)
        return _STATE_IO

    def _read_state(self, index: int) -> torch.Tensor:
        return _pack(_read())

    def _write_state(self, state: torch.Tensor, index: int) -> None:
        _write(_unpack(state))


_TOP_BIT = 1 << 31


def mt19937_degenerate(words: Any) -> bool:
    """Whether 624 MT19937 words (a sequence or array of ints) are the degenerate state: the top bit
    of the first word and all other words zero. No seeding reaches it, and it draws 0 forever;
    torch, CPython and NumPy all accept it."""
    return not int(words[0]) & _TOP_BIT and not any(int(w) for w in words[1:])


def _refuse_degenerate(mt: torch.Tensor, platform: str) -> None:
    """Refuse MT19937 bytes (a state torch's generator took) that hold the degenerate words."""
    if seeds_all_64_bits():  # torch's layout is known: read the words
        words = np.from_dlpack(mt.contiguous())[_WORDS_AT : _WORDS_AT + 8 * _MT_WORDS].view(np.uint64)
        degenerate = mt19937_degenerate(words)  # a real state stops at its second word
    else:  # a layout this module does not know: such a state draws only zeros
        scratch = torch.Generator()
        scratch.set_state(mt)
        degenerate = not bool(torch.randint(0, 2**31, (8,), generator=scratch).any())
    if degenerate:
        raise InvalidArgumentError(
            f"RNG state for platform {platform!r} holds the all-zero MT19937 state, which draws 0 forever and no "
            "seeding reaches; pass a state returned by get_rng_state(), unmodified."
        )


def check_mt19937_state(state: torch.Tensor, platform: str = "cpu") -> int:
    """The initial seed of torch MT19937 bytes (:data:`MT19937_STATE_NBYTES` of them, already checked to
    be a CPU uint8 tensor) if torch's CPU generator takes them and they are not the degenerate
    all-zero state; change nothing.

    Raises:
        InvalidArgumentError: torch refuses the bytes, or they hold the degenerate state.
    """
    seed = _initial_seed_of(state, platform)
    _refuse_degenerate(state, platform)
    return seed


def _initial_seed_of(state: torch.Tensor, platform: str) -> int:
    """The initial seed of MT19937 bytes, as torch reads it: set on a scratch generator, never parsed."""
    scratch = torch.Generator()  # one per call: checks on several threads never share it
    try:
        scratch.set_state(state[:MT19937_STATE_NBYTES])
    except RuntimeError as exc:
        raise InvalidArgumentError(
            f"RNG state for platform {platform!r} is not a valid MT19937 state ({exc}); "
            "pass a state returned by get_rng_state()."
        ) from None
    return scratch.initial_seed()


# MT19937 bytes, their handle, and its (seed, offset) when the handle needs a table entry to
# read as it (None when it reads as itself: (handle, 0)).
_Snapshot = tuple[torch.Tensor, int, "tuple[int, int] | None"]


def _read() -> _Snapshot:
    if _is_compiling():  # _entry's check, made here: a fork reads twice
        return _outside_the_graph(_read)()  # type: ignore[no-any-return]
    handle = _initial_seed()
    return _get_state(), handle, _young.get(handle) or _old.get(handle)


def _write(snapshot: _Snapshot) -> None:
    mt, handle, position = snapshot
    _set_default_state(mt)
    if position is not None:
        _remember(handle, position)


def _pack(snapshot: _Snapshot) -> torch.Tensor:
    mt, handle, position = snapshot
    seed, offset = position or (handle, 0)
    return torch.frombuffer(bytearray(np.from_dlpack(mt).tobytes() + _POSITION.pack(seed, offset)), dtype=torch.uint8)


def _unpack(state: torch.Tensor) -> _Snapshot:
    """A state :meth:`CPUPlatform.check_rng_state` accepted, as a snapshot."""
    raw = np.from_dlpack(state).tobytes()
    seed, offset = _POSITION.unpack_from(raw, MT19937_STATE_NBYTES)
    mt = torch.frombuffer(bytearray(raw[:MT19937_STATE_NBYTES]), dtype=torch.uint8)
    handle = _initial_seed_of(mt, "cpu")
    return mt, handle, (seed, offset) if handle != seed or offset else None


_STATE_IO = StateIO(_read, _write, _pack, _unpack)
