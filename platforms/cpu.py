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
  ever looked up elsewhere.
* ``set_seed_offset(seed, offset)`` seeds MT19937 from the pair (``seed`` itself at offset
  0, so it is exactly ``manual_seed(seed)``; otherwise ``(M(seed) + offset / 4) mod 2**32``
  with ``M`` a stable 64-bit mix: equal pairs give equal streams on every rank, two
  positive offsets of one seed below 2**34 never share a stream, any other two positions
  share one with probability about ``2**-32``) and sets the cursor to the pair.
* ``get_seed_offset()`` reads the cursor. Draws cannot move an offset they know nothing
  of, so the cursor models them: once the generator has drawn from the stream of
  (seed, offset) — torch's own draw counters in the state say whether it has — the
  position reads ``(seed, offset + 4)``, the next block, so that nothing positioned
  afterwards replays what was drawn.
* A generator reseeded or replaced behind the platform's back (``torch.manual_seed``,
  ``torch.set_rng_state``) no longer carries the MT19937 seed its cursor models; the
  position then reads ``(initial_seed, 0)``, which is what ``torch.manual_seed`` means.
* Other generators keep their cursor on themselves: a :class:`CursorGenerator` (a
  ``torch.Generator`` that torch's ops accept like any other) is positioned exactly. A
  plain ``torch.Generator`` has nowhere to keep one: positioning it reseeds it, and its
  position reads ``(initial_seed, 0)`` (advanced as above once drawn).

What the model does *not* give: the stream at (seed, offset + k) is not the stream at
(seed, offset) advanced by k draws, as it is on CUDA/NPU. Code that needs numbers that
are identical across devices should use the portable Philox generator instead.
"""

from __future__ import annotations

import numpy as np
import torch

from platforms.base import Platform
from platforms.errors import InvalidStateError
from platforms.mix import mix64
from platforms.validate import MAX_OFFSET, OFFSET_ALIGN, check_offset, check_seed, check_state

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
# Layout of torch's CPU state (CPUGeneratorImplState): uint64 initial seed, int32 left,
# int32 seeded, uint64 next, then the 624 MT19937 words, each widened to uint64.
_HEADER = np.dtype([("seed", "<u8"), ("left", "<i4"), ("seeded", "<i4"), ("next", "<u8")])
_FRESH_LEFT, _FRESH_NEXT = 1, 0  # what seeding leaves in the draw counters, until the first draw
_MT_WORDS_START = _HEADER.itemsize
_MT_WORDS_END = _MT_WORDS_START + 624 * 8
_CURSOR = np.dtype([("seed", "<u8"), ("offset", "<i8")])

_SCRATCH = torch.Generator()  # validates states by trying them; its own numbers are never used


def position_seed(seed: int, offset: int) -> int:
    """The MT19937 seed that models position (seed, offset): ``seed`` itself at offset 0.

    Other offsets count up from a mix of the seed, one per block of 4, in torch's 32-bit
    seed space: injective in positive offsets below 2**34, so the shards of one op never
    share a stream.
    """
    if offset == 0:
        return seed
    return (mix64(seed ^ _CPU_POSITION_DOMAIN) + offset // OFFSET_ALIGN) & _MASK32


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


def _has_drawn(mt_state: np.ndarray) -> bool:
    """Whether the generator drew since it was seeded (torch's draw counters left their start)."""
    header = mt_state[: _HEADER.itemsize].view(_HEADER)[0]
    return bool(header["left"] != _FRESH_LEFT or header["next"] != _FRESH_NEXT)


class _Cursor:
    """The (seed, offset) position of ``torch.default_generator``, and the MT19937 seed it models.

    One exists per process, beside the one process-wide generator it describes.
    """

    __slots__ = ("seed", "offset", "mt_seed")

    def __init__(self) -> None:
        self.seed, self.offset, self.mt_seed = 0, 0, -1  # matches no generator until set

    def set(self, seed: int, offset: int, mt_seed: int) -> None:
        self.seed, self.offset, self.mt_seed = seed, offset, mt_seed

    def read(self, gen: torch.Generator) -> tuple[int, int]:
        """The pair the generator's stream was positioned at (without the draw model)."""
        current = gen.initial_seed()
        if current != self.mt_seed:  # reseeded or replaced outside the platform
            return current, 0
        return self.seed, self.offset


_DEFAULT_CURSOR = _Cursor()


class CursorGenerator(torch.Generator):
    """A CPU ``torch.Generator`` that carries its own (seed, offset) cursor.

    Pass it wherever torch takes a generator; hyperrng positions it exactly (a plain
    ``torch.Generator`` has nowhere to keep a position; see the module docstring).
    """

    def __init__(self) -> None:
        super().__init__()
        self.cursor = _Cursor()


def _cursor_of(gen: torch.Generator) -> _Cursor | None:
    if gen is torch.default_generator:
        return _DEFAULT_CURSOR
    return getattr(gen, "cursor", None) if isinstance(gen, CursorGenerator) else None


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
        gen = self._target(index, generator)
        cursor = _cursor_of(gen)
        seed, offset = cursor.read(gen) if cursor is not None else (gen.initial_seed(), 0)
        if _has_drawn(gen.get_state().numpy()) and offset < MAX_OFFSET - OFFSET_ALIGN:
            offset += OFFSET_ALIGN
        return seed, offset

    def set_seed_offset(
        self, seed: int, offset: int, index: int | None = None, generator: torch.Generator | None = None
    ) -> None:
        """Seed MT19937 from (seed, offset) and set the generator's cursor to the pair (where it has one)."""
        s, o = check_seed(seed), check_offset(offset)
        gen = self._target(index, generator)
        mt_seed = position_seed(s, o)
        seed_generator(gen, mt_seed)
        cursor = _cursor_of(gen)
        if cursor is not None:
            cursor.set(s, o, gen.initial_seed())

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
        if offset < 0 or offset % OFFSET_ALIGN:
            raise InvalidStateError(
                f"RNG state for platform {self.name!r} has a cursor offset of {offset}; offsets are "
                f"non-negative multiples of {OFFSET_ALIGN}. Pass a state returned by get_rng_state()."
            )
        if position_seed(seed, offset) != _SCRATCH.initial_seed():
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

    def _read_state(self, index: int) -> torch.Tensor:
        gen = torch.default_generator
        seed, offset = _DEFAULT_CURSOR.read(gen)
        cursor = np.array([(seed, offset)], dtype=_CURSOR).view(np.uint8)
        return torch.from_numpy(np.concatenate((gen.get_state().numpy(), cursor)))

    def _write_state(self, state: torch.Tensor, index: int) -> None:
        gen = torch.default_generator
        gen.set_state(state[:MT19937_STATE_NBYTES])
        seed, offset = _unpack_cursor(state)
        _DEFAULT_CURSOR.set(seed, offset, gen.initial_seed())

    def _seed(self, seed: int, index: int) -> None:
        seed_generator(torch.default_generator, seed)
        _DEFAULT_CURSOR.set(seed, 0, seed)


def _unpack_cursor(state: torch.Tensor) -> tuple[int, int]:
    cursor = state[MT19937_STATE_NBYTES:].numpy().view(_CURSOR)[0]
    return int(cursor["seed"]), int(cursor["offset"])
