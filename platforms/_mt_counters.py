"""Whether torch's CPU generator has drawn since it was seeded, without copying its state.

A freshly seeded MT19937 engine has ``left == 1`` and ``next == 0``; the first draw
changes both, and they never return to that pair until the engine is seeded again. The
CPU platform asks this on every position read, and a sharded region reads a position on
every op. ``get_state()`` answers it with a 5 KB copy and a tensor allocation (about
0.7 us); this module finds where the generator keeps the two counters and reads them in
place (about 0.05 us).

The place is found, not assumed:

1. The Python ``Generator`` object must hold exactly one pointer after its object header
   (its C++ generator), or nothing is read.
2. On a scratch ``torch.Generator()`` (the same C++ class as the default generator),
   seeding with a distinctive 64-bit value shows where the engine's seed word sits; the
   counters follow it. The scratch generator is then given states (``set_state``) whose
   counters take values that move each field on its own, and the in-place counters must
   read exactly those values, and what ``get_state()`` reports, every time. No tensor op
   runs, so the probe works the same inside any dispatch mode, default-device context or
   kernel override the caller has installed (portable mode's, say).
3. For the generator actually read (``torch.default_generator``), the seed word at that
   place must equal ``initial_seed()`` and the counters what its ``get_state()`` reports.
   Nothing of that generator is changed by the check.

Any mismatch or error leaves :func:`locate` returning ``None``, and the caller reads a
copy of the state as before. Reads stay within the first few hundred bytes of the C++
generator, whose MT19937 words alone take 2.5 KB, so a layout unlike the one expected
fails a check instead of reading outside the object.
"""

from __future__ import annotations

import ctypes
import sys

import torch
from torch.utils._mode_utils import no_dispatch

__all__ = ["DrawCounters", "drawn_in_copy", "engine_address", "locate"]

_PROBE_SEED = 0x5EED_C0DE_7A6E_0F15  # distinctive in all 64 bits, so it cannot be mistaken for other data
_SEARCH_BYTES = 256  # where the engine's seed word may sit in the C++ generator
_ALIGN = 8
# Offsets from the engine's seed word, as torch's mt19937 data lays it out: uint64 seed,
# int32 left, bool seeded (padded), uint32 next.
_LEFT_AT, _NEXT_AT = 8, 16
# Counter pairs the probe sets (torch accepts left in [1, 624] and next in [0, 624]), each
# field moved on its own so that neither can be mistaken for the other.
_PROBE_COUNTERS = ((624, 1), (1, 0), (300, 0), (1, 323), (17, 607), (1, 0))


class _Header(ctypes.Structure):
    """The head of a ``get_state()`` tensor (torch's CPUGeneratorImplState), read in place:
    the same counters as the engine's, with ``left`` and ``next`` what seeding sets to 1 and 0."""

    _fields_ = [
        ("initial_seed", ctypes.c_uint64),
        ("left", ctypes.c_int32),
        ("seeded", ctypes.c_int32),
        ("next", ctypes.c_uint64),
    ]


def _header(state: torch.Tensor) -> _Header:
    """The header of ``state``, a view into it: keep ``state`` alive while it is read or written."""
    return _Header.from_address(state.data_ptr())


def drawn_in_copy(gen: torch.Generator) -> bool:
    """Whether ``gen`` has drawn since it was last seeded, read from a copy of its state (any generator)."""
    state = gen.get_state()
    header = _header(state)
    return header.left != 1 or header.next != 0


class DrawCounters:
    """MT19937's ``left`` and ``next`` counters of one generator, read where the generator keeps them.

    ``left``, ``next`` and ``seed`` are ctypes views of the engine's fields: ``.value`` reads
    them now (callers on a hot path read them directly; :meth:`drawn` says the same).
    """

    __slots__ = ("left", "next", "seed")

    def __init__(self, address: int) -> None:
        self.seed = ctypes.c_uint64.from_address(address)
        self.left = ctypes.c_int32.from_address(address + _LEFT_AT)
        self.next = ctypes.c_uint32.from_address(address + _NEXT_AT)

    def read(self) -> tuple[int, int]:
        """``(left, next)`` as the engine holds them now."""
        return self.left.value, self.next.value

    def drawn(self) -> bool:
        """Whether the engine has drawn since it was last seeded."""
        return self.left.value != 1 or self.next.value != 0

    def agrees_with(self, gen: torch.Generator) -> bool:
        """Whether these counters and seed word are ``gen``'s, as its ``get_state()`` reports them."""
        state = gen.get_state()
        header = _header(state)
        return (self.seed.value, self.left.value, self.next.value) == (header.initial_seed, header.left, header.next)


def engine_address(gen: torch.Generator) -> int | None:
    """The address of the C++ generator behind ``gen``, if the Python object holds just that pointer
    after its header (besides the slots Python itself keeps for weak references and a ``__dict__``)."""
    kind, word, head = type(gen), ctypes.sizeof(ctypes.c_void_p), object.__basicsize__
    python_slots = [at for at in (kind.__weakrefoffset__, kind.__dictoffset__) if at > 0]
    own_fields = kind.__basicsize__ - head - len(python_slots) * word
    if sys.byteorder != "little" or head in python_slots or own_fields != word:
        return None
    return ctypes.c_void_p.from_address(id(gen) + head).value


def _seed_word_offset() -> int | None:
    """Where the engine's seed word sits in a CPU generator, checked on a scratch generator."""
    scratch = torch.Generator()
    base = engine_address(scratch)
    if not base:
        return None
    scratch.manual_seed(_PROBE_SEED)
    raw = ctypes.string_at(base, _SEARCH_BYTES)
    wanted = _PROBE_SEED.to_bytes(8, "little")
    for offset in range(0, _SEARCH_BYTES - _NEXT_AT - 4 + 1, _ALIGN):
        if raw[offset : offset + 8] != wanted:
            continue
        counters = DrawCounters(base + offset)
        if not counters.drawn() and all(_set_and_agree(scratch, counters, *pair) for pair in _PROBE_COUNTERS):
            return offset
        scratch.manual_seed(_PROBE_SEED)
    return None


def _set_and_agree(gen: torch.Generator, counters: DrawCounters, left: int, next_: int) -> bool:
    """Give ``gen`` a state whose counters are (left, next) and check that the in-place ones read them.

    Through ``set_state`` rather than draws: no tensor op runs, so nothing the caller has
    installed (a dispatch mode, a default device, kernels registered for random ops) can
    turn the probe into no change at all.
    """
    state = gen.get_state()
    header = _header(state)
    header.left, header.next = left, next_
    gen.set_state(state)
    return (
        counters.read() == (left, next_) and counters.drawn() == ((left, next_) != (1, 0)) and counters.agrees_with(gen)
    )


def locate(gen: torch.Generator) -> DrawCounters | None:
    """The in-place draw counters of CPU generator ``gen``, or ``None`` where they cannot be found and confirmed.

    ``gen`` is only read. Call it once per generator and keep the result: the generator's
    C++ object does not move while ``gen`` lives.
    """
    try:
        if gen.device.type != "cpu":
            return None
        # Real host tensors from get_state() whatever the caller is inside (a dispatch mode
        # of fake or local tensors would hand back tensors without data).
        with no_dispatch():
            offset = _seed_word_offset()
            base = engine_address(gen)
            if offset is None or not base:
                return None
            counters = DrawCounters(base + offset)
            return counters if counters.agrees_with(gen) else None
    except Exception:  # any surprise in the layout: fall back to reading a copy of the state
        return None
