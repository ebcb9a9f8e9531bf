"""Philox4x32-10's words for the torch backend (:mod:`hyperrng.philox._torch`), which turns them into
values: the generator's constants, its block function in torch integer ops (functional, for compiled
code, and in place on reused rows, for eager chunks) and on the host CPU (an optional compiled loop, or
NumPy), whose words small CPU draws read from a per-thread readahead buffer. Unsigned 32-bit words live
in ``int64`` tensors because torch has no ``uint32`` arithmetic on CPU.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import numpy as np
import torch

try:  # the optional compiled loop (see HOST_WORDS); NumPy computes the same words without it
    from hyperrng.philox import _cphilox
except ImportError:  # not built here: no C compiler at install, or an install from source without one
    _cphilox = None

__all__ = [
    "HOST_WORDS",
    "PHILOX_M0",
    "PHILOX_M1",
    "PHILOX_ROUNDS",
    "PHILOX_W0",
    "PHILOX_W1",
    "READAHEAD_BLOCKS",
    "WORDS_PER_BLOCK",
    "counter_words",
    "host_words",
    "numpy_words",
    "philox_rounds",
    "readahead_array",
    "readahead_words",
]

PHILOX_M0 = 0xD2511F53
"""Multiplier of words 0 in each Philox4x32 round (Salmon et al., SC'11)."""

PHILOX_M1 = 0xCD9E8D57
"""Multiplier of word 2 in each Philox4x32 round."""

PHILOX_W0 = 0x9E3779B9
"""Weyl increment of key word 0 between rounds: 2**32 / golden ratio."""

PHILOX_W1 = 0xBB67AE85
"""Weyl increment of key word 1 between rounds: 2**32 * (sqrt(3) - 1)."""

PHILOX_ROUNDS = 10
"""Rounds of the standard Philox4x32-10, the variant Random123, cuRAND and torch use."""

WORDS_PER_BLOCK = 4
"""32-bit words one Philox4x32 block produces; element ``j`` uses lane ``j % 4``."""

READAHEAD_BLOCKS = 2**14
"""Most blocks a key's readahead buffer computes at once (512 KiB of words)."""

HOST_WORDS = "compiled" if _cphilox is not None else "numpy"
"""What computes the words of small CPU draws: ``"compiled"`` (the optional C loop
``hyperrng.philox._cphilox``, ``hyperrng/philox/_cphilox.c``, built at install where a C compiler is
present: about 8 ns a block) or ``"numpy"`` (about 40 ns a block, sixty array operations per batch)."""

_READAHEAD_KEYS = 8
"""Keys with a readahead buffer per thread, the most recently used: the default stream and a
tracker's streams, each advancing on its own. At most 4 MiB of words per thread."""

_MASK32 = 0xFFFFFFFF
_WRAP32 = 1 << 32
_HALF_SHIFT = 32  # bits between the low and high word of a 64-bit product or counter

Words = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _mulhilo32(c: torch.Tensor, multiplier: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low words of ``c * multiplier`` for ``c`` and ``multiplier`` below ``2**32``.

    One multiply and no overflow, which compiled code needs (inductor emits C++, where
    signed overflow is undefined and gcc, knowing ``c < 2**32``, would drop a mask that
    corrects a wrapped product): with ``m' = multiplier - 2**32`` (negative, above
    ``-2**31``) the product ``c * m'`` fits ``int64``, and ``c * multiplier`` is
    ``c * m' + c * 2**32``. So the high word is ``floor(c * m' / 2**32) + c`` (an
    arithmetic shift floors), already in ``[0, 2**32)``, and the low word is the low
    half of ``c * m'``.
    """
    product = c * (multiplier - _WRAP32)
    return (product >> _HALF_SHIFT) + c, product & _MASK32


def philox_rounds(
    c0: torch.Tensor,
    c1: torch.Tensor,
    c2: torch.Tensor,
    c3: torch.Tensor,
    k0: torch.Tensor | int,
    k1: torch.Tensor | int,
) -> Words:
    """Return the four output words of Philox4x32-10, each in ``[0, 2**32)``, as int64.

    Functional (it allocates fresh tensors) and overflow-free, so torch.compile can fuse
    it into correct code for any backend. The counter words must be in ``[0, 2**32)``;
    the key words may be ints or tensors broadcastable against the counter words.
    """
    for r in range(PHILOX_ROUNDS):
        # The key schedule is a Weyl sequence: round r uses key + r * W (mod 2**32).
        kr0 = (k0 + r * PHILOX_W0) & _MASK32
        kr1 = (k1 + r * PHILOX_W1) & _MASK32
        hi0, lo0 = _mulhilo32(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo32(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ kr0, lo1, hi0 ^ c3 ^ kr1, lo0
    return c0, c1, c2, c3


def counter_words(blocks: torch.Tensor, k0: torch.Tensor | int, k1: torch.Tensor | int) -> Words:
    """The four output words of the blocks whose 64-bit counters are ``blocks`` (functional).

    Counter layout: global element index ``j`` lives in Philox block ``j // 4``, lane
    ``j % 4``. The block index is the 64-bit counter held in words 0 (low half) and 1 (high
    half); words 2 and 3 are zero. Since ``j < 2**64``, block indices are below ``2**62`` and
    fit an ``int64`` tensor.
    """
    zeros = torch.zeros_like(blocks)
    return philox_rounds(blocks & _MASK32, blocks >> _HALF_SHIFT, zeros, zeros, k0, k1)


class _Constants(NamedTuple):
    """The operands of :func:`_rounds_inplace` for one key, final mask and device, as tensors there: a
    Python int costs each operation a conversion into a tensor, as long as the operation on a small chunk."""

    shift: torch.Tensor  # 32: the high half of a product down to the low one
    mask: torch.Tensor  # 2**32 - 1
    final_mask: torch.Tensor
    first: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # round 0: key word 0, M0, key word 1
    rounds: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # from round 1: (2, 1) multipliers and keys


@functools.lru_cache(maxsize=32)
def _round_constants(k0: int, k1: int, final_mask: int, device: torch.device) -> _Constants:
    """The constants of :func:`_rounds_inplace`; per round from 1 on, the ``(2, 1)`` multipliers of the pair
    of rows it multiplies and the round keys of the pair it XORs into, each in the order of its rows."""
    rounds = []
    for r in range(1, PHILOX_ROUNDS):
        s = (r + 2) % WORDS_PER_BLOCK  # the row of word 0 in round r
        kr0, kr1 = (k0 + r * PHILOX_W0) & _MASK32, (k1 + r * PHILOX_W1) & _MASK32
        multipliers = (PHILOX_M0, PHILOX_M1) if s < 2 else (PHILOX_M1, PHILOX_M0)
        keys = (kr0, kr1) if s in (0, 3) else (kr1, kr0)
        rounds.append((multipliers, keys))
    # Built on the CPU and moved: torch.tensor(..., device=) fails on a Python-written device
    # backend when called from inside one of its kernels.
    table = torch.tensor(rounds, dtype=torch.int64).unsqueeze(-1).to(device)
    scalars = [_HALF_SHIFT, _MASK32, final_mask, k0 & _MASK32, PHILOX_M0, k1 & _MASK32]
    shift, mask, final, key0, m0, key1 = torch.tensor(scalars, dtype=torch.int64).to(device).unbind(0)
    return _Constants(shift, mask, final, (key0, m0, key1), tuple((row[0], row[1]) for row in table))


def _rounds_inplace(
    words: torch.Tensor, products: torch.Tensor, blocks: torch.Tensor, first: int, constants: _Constants
) -> None:
    """Eager Philox4x32-10 of the blocks ``blocks + first`` into the ``(4, m)`` rows ``words``,
    with ``(2, m)`` scratch.

    The low and high counter words go to rows 0 and 1 (rows 2 and 3, the zero counter
    words, are not written); on exit the four rows hold the output words, masked
    with ``constants.final_mask`` (a distribution that keeps only the top bits of a word
    passes those bits and saves a pass). Nothing is allocated. Unlike :func:`philox_rounds` it
    multiplies the words directly and lets the ``int64`` product wrap: torch's eager
    kernels are compiled ahead of time and wrap on every backend, the wrapped product is
    the exact unsigned 64-bit one, its low half is the low word and ``(p >> 32) &
    0xFFFFFFFF`` the high word (the mask undoes the sign extension of the arithmetic
    shift). The masks are applied once per new word, after the XORs, since garbage in
    the upper half of a word never reaches its low half.

    Words move one row down each round, so that one operation serves two words: from
    round 1 on, word ``j`` of round ``r`` is in row ``(r + 2 + j) % 4``, so words 0 and 2
    are the rows 0 and 2 or 1 and 3, a strided view, and so are words 1 and 3 (round 0,
    with two zero words, puts them there). A round multiplies the
    pair (0, 2) in place: the low halves of the products are the new words 3 and 1, where
    they are; the high halves, XORed with the pair (1, 3) and the round keys, are the
    new words 0 and 2, where words 1 and 3 were. The high halves go through ``products``
    in the order of that pair: one shift where the two pairs' orders agree, two where
    they are opposite. Ten rounds end with the words in rows 0 to 3.
    """
    shift, mask = constants.shift, constants.mask
    r0, r1, r2, r3 = words.unbind(0)
    t0, t1 = products.unbind(0)
    pairs = (words[0::2], words[1::2])
    torch.add(blocks, first, out=r0)
    torch.bitwise_right_shift(r0, shift, out=r1)
    r0.bitwise_and_(mask)
    # Round 0: words 2 and 3 are zero, so its second product is zero and word 1 becomes
    # zero. It leaves word j in row (3 + j) % 4, where round 1 finds it.
    key0, m0, key1 = constants.first
    torch.bitwise_xor(r1, key0, out=r3)  # word 0: word 1 (clean: a counter word) ^ key
    torch.mul(r0, m0, out=r2)  # word 3: the low half of the product
    torch.bitwise_right_shift(r2, shift, out=r1)
    r1.bitwise_xor_(key1).bitwise_and_(mask)  # word 2: high half ^ key
    r0.zero_()  # word 1
    for r, (multipliers, keys) in enumerate(constants.rounds, start=1):
        odd = r % 2  # word 0 is in row (r + 2) % 4, so words 0 and 2 are in rows 1 and 3 in odd rounds
        factors, targets = pairs[odd], pairs[1 - odd]
        factors.mul_(multipliers)
        # The product of word 0 meets word 3, that of word 2 meets word 1: in odd rounds they
        # are in the same places of their pairs, in even rounds in opposite places.
        if odd:
            torch.bitwise_right_shift(factors, shift, out=products)
        else:
            torch.bitwise_right_shift(r2, shift, out=t0)
            torch.bitwise_right_shift(r0, shift, out=t1)
        targets.bitwise_xor_(products).bitwise_xor_(keys).bitwise_and_(
            constants.final_mask if r == PHILOX_ROUNDS - 1 else mask
        )
    pairs[1].bitwise_and_(constants.final_mask)  # words 1 and 3, the low halves of the last products


_NP_MASK = np.uint64(_MASK32)
_NP_SHIFT = np.uint64(_HALF_SHIFT)
_NP_MULTIPLIERS = np.array([[PHILOX_M0], [PHILOX_M1]], dtype=np.uint64)  # of words 0 and 2


@functools.lru_cache(maxsize=64)
def _numpy_keys(k0: int, k1: int) -> np.ndarray:
    """The round keys of ``(k0, k1)``, shape ``(rounds, 2, 1)``: what each round XORs into words 0 and 2."""
    keys = [[[(k0 + r * PHILOX_W0) & _MASK32], [(k1 + r * PHILOX_W1) & _MASK32]] for r in range(PHILOX_ROUNDS)]
    return np.array(keys, dtype=np.uint64)


def host_words(k0: int, k1: int, first: int, m: int) -> np.ndarray:
    """The ``(4, m)`` words of blocks ``first, ..., first + m - 1`` of key ``(k0, k1)``, a new ``uint64``
    array (row ``w`` holds word ``w`` of each block): by the compiled loop where it was built
    (:data:`HOST_WORDS`), else by :func:`numpy_words`. Both give the same words."""
    if _cphilox is None:
        return numpy_words(k0, k1, first, m)
    words = np.empty((WORDS_PER_BLOCK, m), dtype=np.uint64)
    _cphilox.words(words, k0, k1, first)
    return words


def numpy_words(k0: int, k1: int, first: int, m: int) -> np.ndarray:
    """The ``(4, m)`` words of blocks ``first, ..., first + m - 1``, computed with NumPy on ``uint64``.

    The same integer operations as :func:`_rounds_inplace`, five per round on pairs of rows,
    where NumPy's unsigned 64-bit multiply (a 32-bit word times a 32-bit multiplier never
    overflows it) costs about half of torch's ``int64`` one: words (0, 2) times the
    multipliers; their high halves XORed with words (3, 1), reversed, XORed with the round
    keys, are the new words (0, 2); their low halves the new words (3, 1). The pairs are views
    of the result's rows, so the words end where they belong.
    """
    words = np.empty((WORDS_PER_BLOCK, m), dtype=np.uint64)
    even, odd = words[0::2], words[3::-2]  # rows (0, 2) and (3, 1)
    products, high = _READAHEAD.scratch(m)
    np.add(np.arange(m, dtype=np.uint64), np.uint64(first), out=even[0])
    np.right_shift(even[0], _NP_SHIFT, out=odd[1])
    np.bitwise_and(even[0], _NP_MASK, out=even[0])
    even[1].fill(0)
    odd[0].fill(0)
    for round_keys in _numpy_keys(k0, k1):
        np.multiply(even, _NP_MULTIPLIERS, out=products)
        np.right_shift(products, _NP_SHIFT, out=high)
        np.bitwise_xor(high, odd, out=high)
        np.bitwise_xor(high[::-1], round_keys, out=even)
        np.bitwise_and(products, _NP_MASK, out=odd)
    return words


class _Buffer(NamedTuple):
    start: int  # the first block
    words: torch.Tensor  # (4, n) raw words of blocks start, ..., start + n - 1, as int64
    array: np.ndarray  # the same memory as uint64


class _Readahead(threading.local):
    """This thread's buffers, by key, least recently used first, and the scratch rows that fill them."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, int], _Buffer] = {}
        self._scratch = np.empty((2, 2, 0), dtype=np.uint64)

    def scratch(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        """Two ``(2, m)`` scratch arrays, reused: fresh ones of this size would fault their pages in each time."""
        if self._scratch.shape[2] < m:
            self._scratch = np.empty((2, 2, max(m, READAHEAD_BLOCKS)), dtype=np.uint64)
        return self._scratch[0, :, :m], self._scratch[1, :, :m]


_READAHEAD = _Readahead()


def readahead_words(k0: int, k1: int, first: int, m: int) -> torch.Tensor:
    """The raw words of CPU blocks ``first, ..., first + m - 1`` under key ``(k0, k1)``, a ``(4, m)`` view
    (rows of words, as the rounds leave them); :func:`readahead_array` is the same as NumPy's.

    A small draw on the CPU reads its words from here: computing sixty operations for a few
    thousand words costs far more than the words, so the words of a key's next blocks are
    computed in one batch and served to the draws that follow.

    Philox words are a pure function of the key and the block, so a word computed earlier is
    the word: a thread keeps, for each of its last :data:`_READAHEAD_KEYS` keys, the words of a
    range of blocks, and serves a draw inside that range from it. A draw outside computes a new
    range from its first block, twice its own size, or twice the previous range's when it
    continues that range (the sequence of draws of a generator position), up to
    :data:`READAHEAD_BLOCKS`: draws that follow one another pay for their words in batches,
    while a lone draw pays for at most twice its own. The view is read-only by contract.
    """
    buffer, at = _buffer(k0, k1, first, m)
    return buffer.words.narrow(1, at, m)


def readahead_array(k0: int, k1: int, first: int, m: int) -> np.ndarray:
    """:func:`readahead_words` as a ``uint64`` NumPy view (for a writer that is faster in NumPy)."""
    buffer, at = _buffer(k0, k1, first, m)
    return buffer.array[:, at : at + m]


def _buffer(k0: int, k1: int, first: int, m: int) -> tuple[_Buffer, int]:
    """The buffer holding blocks ``first, ..., first + m - 1`` of the key (made now if none does), and
    where in it they start."""
    buffers = _READAHEAD.buffers
    key = (k0, k1)
    buffer = buffers.pop(key, None)  # put back last: the dict stays in least-recently-used order
    if buffer is not None:
        start, held = buffer.start, buffer.array.shape[1]
        if start <= first and first + m <= start + held:
            buffers[key] = buffer
            return buffer, first - start
        continues = start <= first <= start + held
    size = min(max(2 * m, 2 * held if buffer is not None and continues else 0), READAHEAD_BLOCKS)
    size = max(size, m)
    array = host_words(k0, k1, first, size)
    with torch.inference_mode(False):  # a buffer made in inference mode serves draws outside it too
        words = torch.from_numpy(array.view(np.int64))
    if len(buffers) >= _READAHEAD_KEYS:
        del buffers[next(iter(buffers))]
    buffer = buffers[key] = _Buffer(first, words, array)
    return buffer, 0
