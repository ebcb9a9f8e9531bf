"""The CPU platform: real, the default everywhere no accelerator is found.

torch's CPU generator is MT19937, whose 5056-byte state has no notion of an offset.

**Seeds.** ``torch.manual_seed`` keeps only the low 32 bits of a seed (seeds 5 and
5 + 2**32 draw identical numbers), which would silently merge streams whose 64-bit seeds
differ only in their high bits. This platform's :meth:`CPUPlatform.manual_seed` keeps all
64: a seed below 2**32 gives exactly torch's stream; a larger one gives the word-wise sum
(mod 2**32) of the MT19937 states seeded with its high and its low word, a valid state
that differs from every other seed's.

**Positions.** Counter-based devices (CUDA, NPU) are positioned at a (seed, offset) pair
and their draws advance the offset. MT19937 has no such pair, so this platform keeps it as
**explicit state**: a *cursor* beside the generator's bytes.

* The platform's RNG state (:meth:`CPUPlatform.get_rng_state`) is the 5056 MT19937 bytes
  followed by the cursor (uint64 seed, int64 offset): :data:`CPU_STATE_NBYTES` bytes.
  Whatever saves and restores a state through the platform — tracker streams, checkpoints,
  recompute, :func:`hyperrng.fork_rng` — carries the cursor with the bytes. Nothing is
  ever looked up in a table elsewhere.
* ``set_seed_offset(seed, offset)`` seeds MT19937 from the pair (``seed`` itself at offset
  0, so it is exactly ``manual_seed(seed)``; otherwise a 32-bit stream seed that counts up
  from a stable 64-bit mix of the seed, one per block of 4, moved by a mix of the window
  of 2**34 counters: equal pairs give equal streams on every rank, two positive offsets of
  one seed in one window never share a stream, any other two positions share one only by
  chance, about ``2**-32``, as torch's MT19937 has 2**32 seeds) and sets
  the cursor to the pair. The generator's 64-bit ``initial_seed`` then carries that stream
  seed in its low word and a tag in its high word (see :func:`position_seed`), which
  MT19937 ignores.
* ``get_seed_offset()`` reads the cursor. Draws cannot move an offset they know nothing
  of, so the cursor models them: once the generator has drawn from the stream of
  (seed, offset) — torch's own draw counters in the state say whether it has — the
  position reads ``(seed, offset + 4)``, the next block, so that nothing positioned
  afterwards replays what was drawn. Sharded regions ask on every op, so for
  ``torch.default_generator`` the two counters are read where the generator keeps them
  rather than from a 5 KB copy of its state; that place is found once, on a scratch
  generator, and confirmed against the default generator's own ``get_state()`` before it
  is trusted (:func:`live_counters_in_use` says whether it was; otherwise the copy is
  read, with the same answers).
* A generator reseeded or replaced behind the platform's back (``torch.manual_seed``,
  ``torch.set_rng_state``) no longer carries the initial seed its cursor models. Bytes of
  another position of the cursor's seed — saved and restored by torch's own tools,
  ``torch.get_rng_state``, ``torch.random.fork_rng``, ``torch.utils.checkpoint`` — say
  which in their initial seed, and read as that position (see :func:`_recognise`: exact
  within 2**41 counters of the cursor's offset, and so in a fresh process positioned at
  the seed);
  anything else reads ``(initial_seed, 0)``. A positioned generator's initial seed is
  tagged (at least 2**63), so no ``torch.manual_seed(s)`` with ``s`` below 2**63 can pass
  for it. For ``s`` below 2**32, ``(s, 0)`` is exactly the stream torch seeded; for a
  larger ``s`` torch seeded from its low 32 bits only, which is not this platform's
  ``(s, 0)`` (see :func:`seed_generator`): reseed through the platform to use 64-bit seeds.
* Other generators keep their cursor on themselves: a :class:`CursorGenerator` (a
  ``torch.Generator`` that torch's ops accept like any other) is positioned exactly. A
  plain ``torch.Generator`` has nowhere to keep one: positioning it reseeds it, and its
  position reads ``(initial_seed, 0)`` (advanced as above once drawn).

What the model does *not* give: the stream at (seed, offset + k) is not the stream at
(seed, offset) advanced by k draws, as it is on CUDA/NPU. Code that needs numbers that
are identical across devices should use the portable Philox generator instead.
"""

from __future__ import annotations

import functools
import struct
import weakref

import numpy as np
import torch
from hyperrng.platforms._mt_counters import DrawCounters, drawn_in_copy, engine_address, locate
from hyperrng.platforms.base import Platform, StateIO
from hyperrng.platforms.errors import ArgumentTypeError, InvalidStateError
from hyperrng.platforms.mix import mix64
from hyperrng.platforms.validate import (
    MAX_OFFSET,
    MAX_SEED,
    OFFSET_ALIGN,
    check_offset,
    check_seed,
    check_state,
    check_state_offset,
)

__all__ = [
    "CPUPlatform",
    "CursorGenerator",
    "MT19937_STATE_NBYTES",
    "CPU_STATE_NBYTES",
    "position_seed",
    "seed_generator",
]

MT19937_STATE_NBYTES = 5056
"""Size of torch's CPU generator state (MT19937 words plus normal-sampling caches)."""

_CURSOR_NBYTES = 16  # uint64 seed, int64 offset, little-endian
CPU_STATE_NBYTES = MT19937_STATE_NBYTES + _CURSOR_NBYTES
"""Size of this platform's RNG state: the MT19937 bytes followed by the cursor."""

_CPU_POSITION_DOMAIN = 0x43505530  # "CPU0": keeps modelled seeds apart from other mixes
_MASK32 = (1 << 32) - 1  # torch's MT19937 seeding reads only these bits
_POSITION_TAG_BIT = 1 << 31  # set in the high word of every positioned seed (offset > 0)
_CHECK_BITS, _WINDOW_BITS = 23, 8  # the rest of that high word: bits of the seed, then of the block window
_WINDOW_MASK = (1 << _WINDOW_BITS) - 1
_CPU_WINDOW_DOMAIN = 0x57494E44  # "WIND": keeps window shifts apart from other mixes


_LAST_BLOCK = MAX_OFFSET - OFFSET_ALIGN
_MT_WORDS_START = 24
_MT_WORDS_END = _MT_WORDS_START + 624 * 8
_CURSOR = struct.Struct("<Qq")  # the cursor after the MT19937 bytes: uint64 seed, int64 offset
_INITIAL_SEED = struct.Struct("<Q")  # the first field of the MT19937 bytes

_SCRATCH = torch.Generator()  # validates states by trying them; its own numbers are never used


@functools.lru_cache(maxsize=64)
def _mixed(seed: int) -> tuple[int, int]:
    """What the positions of ``seed`` are built from: the low word they count up from, and the
    high word that tags them (memoised: a run positions few seeds, twice a region)."""
    mixed = mix64(seed ^ _CPU_POSITION_DOMAIN)
    check = (mixed >> (64 - _CHECK_BITS)) << _WINDOW_BITS
    return mixed & _MASK32, (_POSITION_TAG_BIT | check) << 32


@functools.lru_cache(maxsize=64)
def _window_shift(window: int) -> int:
    """How far the stream seeds of block window ``window`` (blocks ``window * 2**32`` on) are moved:
    nothing for the first, a mix of the window for the others, so that positions 2**34 counters
    apart (or any multiple) do not seed the same stream (memoised: a run moves through few windows)."""
    return 0 if window == 0 else mix64(window ^ _CPU_WINDOW_DOMAIN) & _MASK32


def position_seed(seed: int, offset: int) -> int:
    """The 64-bit seed given to MT19937 for position (seed, offset): ``seed`` itself at offset 0.

    torch seeds MT19937 from the low word alone (the stream) and reports all 64 bits as the
    generator's ``initial_seed``. At other offsets, with ``b = offset / 4`` the block:

    * the low word counts up from a mix of the seed, one per block, within each window of
      2**32 blocks (offsets ``[k * 2**34, (k + 1) * 2**34)``), so positions of one seed in
      one window never share a stream; each window is moved by a mix of its number, so
      positions in different windows share one only by chance (about 2**-32), never
      periodically (MT19937 has 2**32 seeds: no map can give both for every pair);
    * the high word tags the position: its top bit is set (so no seed below 2**63 given to
      ``torch.manual_seed`` passes for a position), then 23 bits from the seed, then the
      window number's low 8 bits, so that bytes saved at a position say which one
      (:func:`_recognise`).
    """
    if offset == 0:
        return seed
    low, tag = _mixed(seed)
    block = offset // OFFSET_ALIGN
    window = block >> 32
    return tag | ((window & _WINDOW_MASK) << 32) | ((low + block + _window_shift(window)) & _MASK32)


def _recognise(seed: int, offset: int, initial_seed: int) -> tuple[int, int]:
    """The position of MT19937 bytes whose initial seed is ``initial_seed``, for a cursor at (seed, offset)
    that does not describe them (they were set behind the platform's back, or it was repositioned since).

    Bytes of another position of the cursor's seed say so in their initial seed
    (:func:`position_seed`): its tag carries 23 bits of the seed and the window number's low
    8 bits, its low word the block within the window. They read as that position, taking
    the block nearest the cursor's of those the tag allows: exact within 2**7 windows
    (2**41 counters) of the cursor, and so in a fresh process positioned at the seed for any
    offset below that. Bytes of another seed whose 23 bits agree (about one pair of seeds in
    8 million) would be misread. The seed itself reads as offset 0. Anything else reads as
    ``(initial_seed, 0)``, the stream of ``torch.manual_seed(initial_seed)``.
    """
    if initial_seed == seed:
        return seed, 0
    low, tag = _mixed(seed)
    high = initial_seed >> 32
    if high & ~_WINDOW_MASK != tag >> 32:
        return initial_seed, 0
    cursor_block = offset // OFFSET_ALIGN
    near = cursor_block >> 32
    above = near + ((high - near) & _WINDOW_MASK)  # the two windows nearest the cursor's with these low bits
    best: int | None = None
    for window in (above, above - _WINDOW_MASK - 1):
        block = (window << 32) | ((initial_seed - low - _window_shift(window)) & _MASK32)
        # offset 0 is never tagged; of the two, the block nearer the cursor's is meant
        if window >= 0 and 0 < block * OFFSET_ALIGN <= MAX_OFFSET:
            if best is None or abs(block - cursor_block) < abs(best - cursor_block):
                best = block
    return (initial_seed, 0) if best is None else (seed, best * OFFSET_ALIGN)


def _legacy_position_seed(seed: int, offset: int) -> int:
    """The 32-bit seed positions were given before they were tagged (states saved then still load)."""
    return (_mixed(seed)[0] + offset // OFFSET_ALIGN) & _MASK32 if offset else seed


def seed_generator(gen: torch.Generator, seed: int) -> None:
    """Seed a CPU generator with all 64 bits of ``seed`` (see the module docstring)."""
    if seed <= _MASK32:
        gen.manual_seed(seed)
        return
    gen.manual_seed(seed >> 32)
    high = gen.get_state().numpy()
    gen.manual_seed(seed & _MASK32)
    state = gen.get_state()
    raw = state.numpy()  # shares memory with ``state``
    words = raw[_MT_WORDS_START:_MT_WORDS_END].view(np.uint64)
    # Word-wise sum mod 2**32 (not XOR, which would cancel to the degenerate all-zero
    # state when the two words of the seed are equal).
    words += high[_MT_WORDS_START:_MT_WORDS_END].view(np.uint64)
    words &= _MASK32
    raw[:8] = np.frombuffer(seed.to_bytes(8, "little"), dtype=np.uint8)  # what initial_seed() reports
    gen.set_state(state)


_UNLOCATED = object()
_default_counters: DrawCounters | None | object = _UNLOCATED  # found on first use; None: read a copy


def live_counters_in_use() -> bool:
    """Whether position reads of ``torch.default_generator`` find its draw counters in place
    (see :mod:`platforms._mt_counters`) rather than in a copy of its state; the answers are the same."""
    return _locate_default_counters() is not None


def _locate_default_counters() -> DrawCounters | None:
    global _default_counters
    if _default_counters is _UNLOCATED:
        _default_counters = locate(torch.default_generator)
    return _default_counters  # type: ignore[return-value]


class _Cursor:
    """The (seed, offset) position of a generator, and the MT19937 seed it models.

    One exists beside ``torch.default_generator`` (per process, like the generator), and
    one on each :class:`CursorGenerator`.
    """

    __slots__ = ("seed", "offset", "mt_seed")

    def __init__(self) -> None:
        self.seed, self.offset, self.mt_seed = 0, 0, -1  # matches no generator until set

    def set(self, seed: int, offset: int, mt_seed: int) -> None:
        self.seed, self.offset, self.mt_seed = seed, offset, mt_seed


_DEFAULT_CURSOR = _Cursor()


class CursorGenerator(torch.Generator):
    """A CPU ``torch.Generator`` that carries its own (seed, offset) cursor.

    Pass it wherever torch takes a generator; hyperrng positions it exactly (a plain
    ``torch.Generator`` has nowhere to keep a position; see the module docstring). Code
    that receives it back from torch's dispatcher (DTensor's random ops do) gets a plain
    ``torch.Generator`` wrapping the same C++ generator; the cursor is found from that too.
    """

    def __new__(cls, device: str | torch.device = "cpu") -> CursorGenerator:
        return super().__new__(cls)  # always a CPU generator: the device is checked in __init__

    def __init__(self, device: str | torch.device = "cpu") -> None:
        """Raises:
        ArgumentTypeError: ``device`` is not a string or ``torch.device``.
        InvalidStateError: ``device`` is not the CPU.
        """
        if not isinstance(device, (str, torch.device)):
            raise ArgumentTypeError(f"device must be a string or torch.device, got {type(device).__name__}.")
        try:
            kind = torch.device(device).type
        except RuntimeError:
            kind = str(device)
        if kind != "cpu":
            raise InvalidStateError(
                f"a CursorGenerator is a CPU generator, got device {device!r}; generators of counter-based "
                "devices keep their position in their own state, so use the device's generator there."
            )
        super().__init__()
        self.cursor = _Cursor()
        address = engine_address(self)
        if address:
            _CURSOR_GENERATORS[address] = self

    def __reduce__(self) -> tuple[object, ...]:  # type: ignore[override]  # our state, not torch's
        """Copies and pickles are CursorGenerators with the same bytes and cursor (torch's own
        ``Generator.__reduce__`` would rebuild a plain generator and drop the cursor)."""
        c = self.cursor
        return (CursorGenerator, (), (self.get_state(), c.seed, c.offset, c.mt_seed))

    def __setstate__(self, state: tuple[torch.Tensor, int, int, int]) -> None:  # type: ignore[override]
        mt, seed, offset, mt_seed = state
        self.set_state(mt)
        self.cursor.set(seed, offset, mt_seed)


# Live CursorGenerators by the address of their C++ generator, which each of them keeps alive:
# an entry goes with its generator, so an address here always names that generator.
_CURSOR_GENERATORS: weakref.WeakValueDictionary[int, CursorGenerator] = weakref.WeakValueDictionary()


def _cursor_of(gen: torch.Generator) -> _Cursor | None:
    """The cursor of ``gen``: the default generator's, a CursorGenerator's, or that of the one
    ``gen`` wraps (torch's dispatcher hands code such as DTensor's a new plain wrapper of the
    generator passed to an op); ``None`` for a generator that keeps none."""
    if gen is torch.default_generator:
        return _DEFAULT_CURSOR
    if isinstance(gen, CursorGenerator):
        return gen.cursor
    address = engine_address(gen)
    if address is None:
        return None
    if address == _default_address():
        return _DEFAULT_CURSOR
    owner = _CURSOR_GENERATORS.get(address)
    return owner.cursor if owner is not None else None


@functools.cache
def _default_address() -> int | None:
    """The address of the default generator's C++ generator (it lives as long as the process)."""
    return engine_address(torch.default_generator)


class CPUPlatform(Platform):
    """The host CPU, drawing from ``torch.default_generator``; positions kept as an explicit cursor."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    counter_based = False
    is_host = True
    state_nbytes = CPU_STATE_NBYTES

    def device_count(self) -> int:
        return 1

    def default_generator(self, index: int | None = None) -> torch.Generator:
        self._index(index)
        return torch.default_generator

    def get_seed_offset(self, index: int | None = None, generator: torch.Generator | None = None) -> tuple[int, int]:
        """Return the position of ``generator`` (default: the device's): its cursor, moved past a drawn block.

        See the module docstring: ``(seed, offset)`` as last positioned, ``(seed, offset + 4)``
        once the generator has drawn from that stream, ``(initial_seed, 0)`` (or
        ``(initial_seed, 4)``) for a generator the platform did not position.
        """
        # (The device's own generator without detours: sharded regions read it every op.)
        gen = torch.default_generator if index is None and generator is None else self._target(index, generator)
        cursor = _DEFAULT_CURSOR if gen is torch.default_generator else _cursor_of(gen)
        current = gen.initial_seed()
        if cursor is not None and cursor.mt_seed == current:
            seed, offset = cursor.seed, cursor.offset
        elif cursor is not None:  # bytes set behind the platform's back
            seed, offset = _recognise(cursor.seed, cursor.offset, current)
        else:
            seed, offset = current, 0
        if offset < _LAST_BLOCK:
            counters = _default_counters if gen is torch.default_generator else None
            if counters is _UNLOCATED:
                counters = _locate_default_counters()
            if type(counters) is DrawCounters:  # DrawCounters.drawn(), inlined: regions ask on every op
                drawn = counters.left.value != 1 or counters.next.value != 0
            else:
                drawn = drawn_in_copy(gen)
            if drawn:  # the generator has drawn from this position's stream
                offset += OFFSET_ALIGN
        return seed, offset

    def set_seed_offset(
        self, seed: int, offset: int, index: int | None = None, generator: torch.Generator | None = None
    ) -> None:
        """Seed MT19937 from (seed, offset) and set the generator's cursor to the pair (where it has one)."""
        # Valid ints pass without a call (regions position twice per op); anything else is checked.
        s = seed if type(seed) is int and 0 <= seed <= MAX_SEED else check_seed(seed)
        o = (
            offset
            if type(offset) is int and 0 <= offset <= MAX_OFFSET and not offset % OFFSET_ALIGN
            else check_offset(offset)
        )
        gen = torch.default_generator if index is None and generator is None else self._target(index, generator)
        if o:  # torch seeds from the low word and keeps the tag as initial_seed
            low, tag = _mixed(s)
            block = o // OFFSET_ALIGN
            window = block >> 32
            if window:  # position_seed, inlined
                low += _window_shift(window)
                tag |= (window & _WINDOW_MASK) << 32
            mt_seed = tag | ((low + block) & _MASK32)
            gen.manual_seed(mt_seed)
        elif s <= _MASK32:
            mt_seed = s
            gen.manual_seed(s)
        else:
            mt_seed = s
            seed_generator(gen, s)
        cursor = _DEFAULT_CURSOR if gen is torch.default_generator else _cursor_of(gen)
        if cursor is not None:  # seeding made mt_seed the generator's initial seed
            cursor.seed, cursor.offset, cursor.mt_seed = s, o, mt_seed

    def check_rng_state(self, state: torch.Tensor) -> torch.Tensor:
        """Check the length, the MT19937 bytes (on a scratch generator) and the cursor; change nothing.

        The cursor must be a valid position whose modelled MT19937 seed is the one the
        bytes carry: a cursor that does not belong to its bytes is refused.
        """
        checked = check_state(state, self.state_nbytes, self.name)
        mt = checked[:MT19937_STATE_NBYTES]
        try:
            _SCRATCH.set_state(mt)
        except RuntimeError as exc:
            raise InvalidStateError(
                f"RNG state for platform {self.name!r} is not a valid MT19937 state ({exc}); "
                "pass a state returned by get_rng_state()."
            ) from None
        seed, offset = _unpack_cursor(checked)
        check_state_offset(offset, f"RNG state for platform {self.name!r} has a cursor offset of")
        if _SCRATCH.initial_seed() not in (position_seed(seed, offset), _legacy_position_seed(seed, offset)):
            raise InvalidStateError(
                f"RNG state for platform {self.name!r} has a cursor ({seed}, {offset}) that does not belong "
                "to its MT19937 bytes (they were seeded for another position); pass a state returned by "
                "get_rng_state(), unmodified."
            )
        return checked

    def _target(self, index: int | None, generator: torch.Generator | None) -> torch.Generator:
        if index is not None:
            self._index(index)
        return torch.default_generator if generator is None else self._check_generator(generator)

    def state_io(self, index: int | None = None) -> StateIO:
        """Snapshots are (MT19937 bytes, cursor content) pairs: no packing on the hot path."""
        self._index(index)
        return _STATE_IO

    def _read_state(self, index: int) -> torch.Tensor:
        return _pack(_read())

    def _write_state(self, state: torch.Tensor, index: int) -> None:
        _write(_unpack(state))

    def _seed(self, seed: int, index: int) -> None:
        seed_generator(torch.default_generator, seed)
        _DEFAULT_CURSOR.set(seed, 0, seed)


def _unpack_cursor(state: torch.Tensor) -> tuple[int, int]:
    seed, offset = _CURSOR.unpack_from(state.numpy().data, MT19937_STATE_NBYTES)
    return seed, offset


_Snapshot = tuple[torch.Tensor, int, int, int]  # the MT19937 bytes, then the cursor's seed, offset and MT seed


def _read() -> _Snapshot:
    c = _DEFAULT_CURSOR
    return torch.default_generator.get_state(), c.seed, c.offset, c.mt_seed


def _write(snapshot: _Snapshot) -> None:
    torch.default_generator.set_state(snapshot[0])
    c = _DEFAULT_CURSOR
    _, c.seed, c.offset, c.mt_seed = snapshot


def _pack(snapshot: _Snapshot) -> torch.Tensor:
    mt, seed, offset, mt_seed = snapshot
    raw = mt.numpy()
    (initial_seed,) = _INITIAL_SEED.unpack_from(raw.data)
    if initial_seed != mt_seed:  # the cursor no longer describes these bytes
        seed, offset = _recognise(seed, offset, initial_seed)
    packed = bytearray(CPU_STATE_NBYTES)
    packed[:MT19937_STATE_NBYTES] = raw.data
    _CURSOR.pack_into(packed, MT19937_STATE_NBYTES, seed, offset)
    return torch.frombuffer(packed, dtype=torch.uint8)


def _unpack(state: torch.Tensor) -> _Snapshot:
    """A state :meth:`CPUPlatform.check_rng_state` accepted, as a snapshot (its cursor belongs to its bytes)."""
    raw = state.numpy()
    seed, offset = _CURSOR.unpack_from(raw.data, MT19937_STATE_NBYTES)
    (initial_seed,) = _INITIAL_SEED.unpack_from(raw.data)
    return state[:MT19937_STATE_NBYTES].clone(), seed, offset, initial_seed


_STATE_IO = StateIO(_read, _write, _pack, _unpack)
