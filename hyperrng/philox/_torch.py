"""The torch backend of :mod:`hyperrng.philox`: Philox4x32-10 and the distributions in torch ops.

Everything here is plain torch integer arithmetic, so the same code runs on any device: it
is the reference that the Triton backend (:mod:`hyperrng.philox._triton`) is proven equal
to. Unsigned 32-bit words live in ``int64`` tensors because torch has no ``uint32``
arithmetic on CPU. A small draw on the CPU reads its words from a readahead buffer
(:func:`readahead_words`): computing sixty operations for a few thousand words costs far
more than the words, so the words of a key's next blocks are computed in one batch and served
to the draws that follow. The batch is computed by a small compiled loop
(``hyperrng/philox/_cphilox.c``, built at install where a C compiler is present: about 8 ns
a block) or, without it, by NumPy (about 40 ns a block, sixty array operations per batch);
:data:`HOST_WORDS` says which. Where the loop was built, a Bernoulli draw of any size into a
contiguous float32, float64 or bool tensor (dropout's noise) skips the readahead: the loop
computes each word and writes its comparison in one pass (:func:`fill_host`).

Counter layout: global element index ``j`` lives in Philox block ``j // 4``, lane
``j % 4``. The block index is the 64-bit counter held in words 0 (low half) and 1 (high
half); words 2 and 3 are zero. Since ``j < 2**64``, block indices are below ``2**62`` and
fit an ``int64`` tensor.

A :class:`Kernel` binds a distribution (a :class:`Transform`), its parameters and a key.
It turns block indices into values, one per lane, and writes whole runs of blocks
straight into the result (:mod:`hyperrng.philox._shards` says which runs). There are two
implementations of the same arithmetic:

* eager: the rounds run in place on a few reused rows of one chunk (no allocation per
  operation), and the distribution writes each lane directly into its strided column of
  the result, so a chunk costs about sixty tensor operations and no extra pass;
* compiled: ``torch.compile`` fuses the functional rounds and the distribution into one
  loop over the blocks, with nothing but the values in memory.

Both run the same integer operations, so they agree bit for bit wherever the
distribution is exact.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

try:  # the optional compiled loop (see the module docstring); NumPy computes the same words without it
    from hyperrng.philox import _cphilox
except ImportError:  # not built here: no C compiler at install, or an install from source without one
    _cphilox = None

__all__ = [
    "ACCELERATOR_CHUNK_BLOCKS",
    "BERNOULLI",
    "HOST_WORDS",
    "BITS",
    "CHUNK_BLOCKS",
    "MAX_CHUNK_THREADS",
    "NORMAL",
    "READAHEAD_BLOCKS",
    "SMALL_BLOCKS",
    "SMALL_NUMEL",
    "PHILOX_M0",
    "PHILOX_M1",
    "PHILOX_ROUNDS",
    "PHILOX_W0",
    "PHILOX_W1",
    "RANDINT",
    "TRANSFORMS",
    "UNIFORM",
    "WORDS_PER_BLOCK",
    "Kernel",
    "Transform",
    "counter_words",
    "fill_host",
    "host_fill_serves",
    "host_words",
    "numpy_words",
    "philox_rounds",
    "chunk_blocks",
    "readahead_words",
    "scratch_bytes",
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

CHUNK_BLOCKS = 2**16
"""Blocks computed per eager step and thread (see :func:`chunk_blocks`). Eager rounds keep
six ``int64`` rows of a chunk (four words and two products) plus at most six value rows,
so working memory stays below :func:`scratch_bytes` whatever the tensor size, and the
rows stay in cache. Measured on CPU with one thread, 2**16 and 2**17 run equally fast;
smaller chunks pay more per-operation overhead than they gain in cache."""

MAX_CHUNK_THREADS = 4
"""Chunks grow with the thread count up to this many threads: each eager operation forks
and joins the threads once, so a chunk of ``CHUNK_BLOCKS`` per thread keeps that cost
small, and the cap keeps the scratch memory bounded on many-core machines."""

ACCELERATOR_CHUNK_BLOCKS = 2**20
"""Blocks per eager step on a device that is not the CPU: four million values, so that the
sixty operations of a chunk are few, large kernels rather than many launch-bound ones
(96 MiB of scratch at most)."""

SMALL_BLOCKS = 2**12
"""CPU eager draws of at most this many blocks (16,384 values) read their words from the
readahead buffer (:func:`readahead_words`); larger ones compute them in place."""

SMALL_NUMEL = 4 * SMALL_BLOCKS - 6
"""The most elements a CPU eager draw may have for :func:`fill_host` to serve it from the readahead
(the worst lane alignment still fits ``SMALL_BLOCKS`` blocks)."""

READAHEAD_BLOCKS = 2**14
"""Most blocks a key's readahead buffer computes at once (512 KiB of words)."""

HOST_WORDS = "compiled" if _cphilox is not None else "numpy"
"""What computes the words of small CPU draws: ``"compiled"`` (the optional C loop
``hyperrng.philox._cphilox``, built at install where a C compiler is present) or ``"numpy"``."""

_NUMPY_DTYPES = frozenset({torch.float32, torch.float64, torch.bool})
"""Result dtypes a small CPU Bernoulli draw writes with NumPy."""

_READAHEAD_KEYS = 8
"""Keys with a readahead buffer per thread, the most recently used: the default stream and a
tracker's streams, each advancing on its own. At most 4 MiB of words per thread."""

_MASK32 = 0xFFFFFFFF
_WRAP32 = 1 << 32
_HALF_SHIFT = 32  # bits between the low and high word of a 64-bit product or counter
_SCRATCH_ROWS = 6  # eager int64 rows per chunk: four words and two products
_VALUE_ROWS = 6  # eager value rows per chunk, at most: normal's radii, angles and one lane pair

Words = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
Scalars = Sequence[float | int]


def chunk_blocks(device_type: str = "cpu") -> int:
    """Blocks per eager step: on the CPU :data:`CHUNK_BLOCKS` per torch thread, for up to
    :data:`MAX_CHUNK_THREADS` threads (read when a draw starts); elsewhere
    :data:`ACCELERATOR_CHUNK_BLOCKS`."""
    if device_type != "cpu":
        return ACCELERATOR_CHUNK_BLOCKS
    return CHUNK_BLOCKS * min(max(torch.get_num_threads(), 1), MAX_CHUNK_THREADS)


def scratch_bytes(threads: int | None = None, device_type: str = "cpu") -> int:
    """Upper bound of the working memory of one eager draw besides its result, in bytes.

    Six ``int64`` rows and at most six value rows (8 bytes an element at most) of one
    chunk: on the CPU 6 MiB with one thread, 24 MiB at most; 96 MiB on an accelerator.
    Compiled draws keep nothing but the result.
    """
    if device_type != "cpu":
        return ACCELERATOR_CHUNK_BLOCKS * (_SCRATCH_ROWS + _VALUE_ROWS) * 8
    count = MAX_CHUNK_THREADS if threads is None else min(max(threads, 1), MAX_CHUNK_THREADS)
    return CHUNK_BLOCKS * count * (_SCRATCH_ROWS + _VALUE_ROWS) * 8


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
    """The four output words of the blocks whose 64-bit counters are ``blocks`` (functional)."""
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


# --- distributions --------------------------------------------------------------------

Writer = Callable[[torch.Tensor, torch.Tensor, "Bound"], None]
Lanes = Callable[..., Sequence[torch.Tensor]]


@dataclass(frozen=True)
class Transform:
    """How a distribution turns the four words of a block into its four values.

    ``lanes(words, *params)`` is the functional form that gets compiled: the four value
    columns of the four word columns ``words``. ``write(words, dst, kernel)`` is the eager
    form: ``words`` are the ``(4, m)`` output rows of the rounds, already masked with
    ``final_mask(scalars)``, and it writes lane ``i`` into column ``i`` of ``dst`` (shape
    ``(m, 4)``, any dtype the values round to), reading the kernel's parameters as 0-d
    tensors (``kernel.params``) or as Python numbers (``kernel.scalars``).
    """

    name: str
    lanes: Lanes
    write: Writer
    final_mask: Callable[[Scalars], int] = lambda scalars: _MASK32
    mutates: bool = False  # whether ``write`` changes ``words`` (it gets rows of its own then)


def _bits_lanes(words: Words) -> Words:
    return words


def _bits_write(words: torch.Tensor, dst: torch.Tensor, kernel: Bound | None = None) -> None:
    """Row ``i`` of ``words`` (the raw words, or any ``(4, m)`` rows) into column ``i`` of ``dst``."""
    if words.shape[1] <= SMALL_BLOCKS:  # one operation: a small chunk pays per operation, not per element
        dst.copy_(words.t())
        return
    for lane in range(WORDS_PER_BLOCK):  # a row into a column: long inner loops, where one copy's would be 4
        dst[:, lane].copy_(words[lane])


def _uniform_lanes(
    words: Words, keep: torch.Tensor, unit: torch.Tensor, span: torch.Tensor, low: torch.Tensor
) -> list[torch.Tensor]:
    # ``word & keep`` keeps the top bits; times 2**-32 it is exactly k * 2**-bits.
    return [(w & keep) * unit * span + low for w in words]


def _uniform_write(words: torch.Tensor, dst: torch.Tensor, kernel: Bound) -> None:
    _, unit, span, low = kernel.params
    default_bounds = kernel.scalars[2] == 1.0 and kernel.scalars[3] == 0.0  # u * 1 + 0 is u exactly (u >= 0: no -0.0)
    if dst.dtype == unit.dtype:
        # The masked word converts to the compute dtype exactly; then one contiguous pass
        # scales it (and applies the bounds, rounding twice as compiled code does).
        if words.shape[1] <= SMALL_BLOCKS:
            torch.mul(words.t(), unit, out=dst)
        else:
            _bits_write(words, dst)
            dst.mul_(unit)
        if not default_bounds:
            dst.mul_(span).add_(low)
        return
    if default_bounds:
        # k * 2**-bits is exact in the half dtype too: compute in unit's dtype, round once.
        if words.shape[1] <= SMALL_BLOCKS:
            torch.mul(words.t(), unit, out=dst)
            return
        for lane in range(WORDS_PER_BLOCK):
            torch.mul(words[lane], unit, out=dst[:, lane])
        return
    values = torch.mul(words, unit)
    values.mul_(span).add_(low)  # two roundings, as compiled code does (no fused multiply-add)
    _bits_write(values, dst)


def _bernoulli_lanes(words: Words, threshold: torch.Tensor) -> list[torch.Tensor]:
    return [w < threshold for w in words]


def _bernoulli_write(words: torch.Tensor, dst: torch.Tensor, kernel: Bound) -> None:
    # One comparison of the transposed rows into dst, whatever its dtype (True is 1.0): on the
    # CPU cheaper than a comparison per lane into dst's strided columns.
    torch.lt(words.t(), kernel.params[0], out=dst)


def _box_muller(
    w_radius: torch.Tensor,
    w_angle: torch.Tensor,
    shift: torch.Tensor,
    unit: torch.Tensor,
    two_pi: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``r`` and ``t`` of Box–Muller: ``u1 = ((w >> shift) + 1) * unit`` is in ``(0, 1]``."""
    u1 = ((w_radius >> shift) + 1) * unit
    u2 = (w_angle >> shift) * unit
    return torch.sqrt(torch.log(u1) * -2.0), u2 * two_pi


def _normal_lanes(
    words: Words, shift: torch.Tensor, unit: torch.Tensor, two_pi: torch.Tensor, std: torch.Tensor, mean: torch.Tensor
) -> list[torch.Tensor]:
    ra, ta = _box_muller(words[0], words[1], shift, unit, two_pi)
    rb, tb = _box_muller(words[2], words[3], shift, unit, two_pi)
    z = (ra * torch.cos(ta), ra * torch.sin(ta), rb * torch.cos(tb), rb * torch.sin(tb))
    return [v * std + mean for v in z]


def _normal_write(words: torch.Tensor, dst: torch.Tensor, kernel: Bound) -> None:
    shift, unit, two_pi, std, mean = kernel.params
    # The operations of _box_muller, in place: rows (0, 2) give the radii and rows (1, 3)
    # the angles of lanes (0, 1) and (2, 3). At most six value rows are alive at once.
    radius = torch.mul(torch.bitwise_right_shift(words[0::2], shift).add_(1), unit)
    radius.log_().mul_(-2.0).sqrt_()
    theta = torch.mul(torch.bitwise_right_shift(words[1::2], shift), unit).mul_(two_pi)
    for column, trig in ((0, torch.cos), (1, torch.sin)):
        z = trig(theta).mul_(radius)  # radius * trig(theta): multiplication commutes exactly
        z.mul_(std).add_(mean)
        dst[:, column::2].copy_(z.t())


def _randint_lanes(words: Words, low: torch.Tensor, span: torch.Tensor) -> list[torch.Tensor]:
    return [w % span + low for w in words]


def _randint_write(words: torch.Tensor, dst: torch.Tensor, kernel: Bound) -> None:
    low, span = kernel.scalars
    _bits_write(words.remainder_(span).add_(low), dst)  # converted as copy_ converts int64 into dst's dtype


BITS = Transform("random_bits", _bits_lanes, _bits_write)
"""The raw words, ``int64`` in ``[0, 2**32)``."""

UNIFORM = Transform("uniform", _uniform_lanes, _uniform_write, lambda scalars: int(scalars[0]))
"""Parameters ``(keep, unit, span, low)``: ``(word & keep) * unit * span + low``, where
``keep`` keeps the top bits of the word and ``unit`` is ``2**-32``."""

BERNOULLI = Transform("bernoulli", _bernoulli_lanes, _bernoulli_write)
"""Parameter ``(threshold,)``: ``word < threshold``."""

NORMAL = Transform("normal", _normal_lanes, _normal_write)
"""Parameters ``(shift, unit, two_pi, std, mean)``: Box–Muller on word pairs (0, 1), (2, 3)."""

RANDINT = Transform("randint", _randint_lanes, _randint_write, mutates=True)
"""Parameters ``(low, span)``: ``low + word % span``, int64."""

TRANSFORMS = {t.name: t for t in (BITS, UNIFORM, BERNOULLI, NORMAL, RANDINT)}
"""Every distribution by name."""


# --- kernels ----------------------------------------------------------------------------

_MIN_COMPILED_BLOCKS = 2
"""Compiled calls never see fewer blocks: sizes 0 and 1 would be specialised and compiled again."""


_SUBNORMAL = 2.0**-1070
"""A double below the smallest normal one (``2**-1022``): what a thread that flushes subnormals makes zero."""

_FILL_GRAIN = 32768
"""Elements per thread above which torch's CPU ops run in parallel (its ``GRAIN_SIZE``)."""


class _ThreadMode(threading.local):
    """How many OpenMP worker threads this thread has started, in its own floating-point mode."""

    workers = 0


_THREAD_MODE = _ThreadMode()


def _flushes_subnormals() -> bool:
    """Whether this thread flushes subnormal numbers to zero (the FTZ or DAZ bit of its FP unit)."""
    return _SUBNORMAL * 1.0 == 0.0


def _start_workers() -> None:
    """Start this thread's OpenMP worker threads now, while its floating-point mode is its own.

    Worker threads copy the mode of the thread that starts them, and torch's CPU ops and
    the kernels inductor compiles share them. Started before compiled code is loaded, they
    keep the caller's mode when that code changes it (see :func:`_keeping_float_mode`).
    """
    threads = torch.get_num_threads()
    if threads > _THREAD_MODE.workers:
        if threads > 1:
            torch.empty(threads * _FILL_GRAIN, dtype=torch.uint8).fill_(0)  # one parallel region of every thread
        _THREAD_MODE.workers = threads


def _keeping_float_mode(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (compiled code) made to leave the calling thread's handling of subnormal numbers as it was.

    torch 2.5's inductor links the CPU code it compiles with ``-ffast-math``; with GCC
    before 13 that adds a constructor which, when the library loads (at the first call
    of each compiled variant), sets the loading thread to flush subnormal floats to zero,
    and every thread started from it afterwards inherits that. Left alone, one compiled
    call would change the arithmetic of the whole process. So: the worker threads are
    started first (:func:`_start_workers`); if the call changed the mode, it is put back
    (``torch.set_flush_denormal(False)``) and the call is made again, so that its values
    too are those of the caller's mode. A torch that does not change the mode pays two
    float multiplications per call.
    """

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        _start_workers()
        flushed = _flushes_subnormals()
        out = fn(*args)
        if not flushed and _flushes_subnormals():
            torch.set_flush_denormal(False)
            out = fn(*args)
        return out

    return call


def _values(
    lanes: Lanes,
    first: torch.Tensor,
    m: int,
    blocks: torch.Tensor | None,
    k0: torch.Tensor,
    k1: torch.Tensor,
    *params: torch.Tensor,
) -> torch.Tensor:
    """The ``(m, 4)`` values of the blocks ``blocks``, or of ``first + arange(m)`` when
    ``blocks`` is None (then no block index is ever stored)."""
    if blocks is None:
        blocks = torch.arange(m, dtype=torch.int64, device=first.device) + first
    return torch.stack(tuple(lanes(counter_words(blocks, k0, k1), *params)), dim=1)


def _values_template(first: torch.Tensor, m: int, blocks: torch.Tensor | None, *args: torch.Tensor) -> torch.Tensor:
    return _values(_LANES, first, m, blocks, *args)  # type: ignore[name-defined]  # noqa: F821 - bound per distribution


def _into_template(
    dst: torch.Tensor, first: torch.Tensor, m: int, blocks: torch.Tensor | None, *args: torch.Tensor
) -> None:
    dst.copy_(_values(_LANES, first, m, blocks, *args))  # type: ignore[name-defined]  # noqa: F821 - as above


@functools.cache
def _compiled(transform: Transform, device_type: str = "cpu", into: bool = False) -> Callable[..., Any]:
    """``transform``'s values compiled for one device type: returned, or with ``into``
    written into a given ``(m, 4)`` tensor in the same loop.

    Compiled once per distribution on first use, never at import. Keys and parameters
    are tensor arguments and block counts are dynamic, so new keys, offsets, bounds or
    sizes reuse the compiled code; the compute dtype and whether the blocks are a range
    (``blocks is None``) or a tensor of indices select among at most four variants. Each
    (distribution, device type, ``into``) runs as its own code object, because
    torch.compile keeps one cache, with a recompile limit, per code object.

    Writing into the result of a random op (torch allocated it already) saves allocating
    a second tensor and copying, which costs as much as the Philox rounds.

    CPU code is built with inductor's ``cpp.dynamic_threads``: otherwise it specialises
    on the thread count it compiles under (serial code for one thread) and keeps running
    that code when the count changes, and inductor's on-disk cache hands a kernel built
    by a one-thread process to later processes whatever their thread count.
    """
    template = _into_template if into else _values_template
    name = f"_{transform.name}_{'into_' if into else ''}{device_type}"
    code = template.__code__.replace(co_name=name)
    if sys.version_info >= (3, 11):
        code = code.replace(co_qualname=name)
    namespace = {**template.__globals__, "_LANES": transform.lanes}
    fn = types.FunctionType(code, namespace, name, template.__defaults__, template.__closure__)
    return _keeping_float_mode(torch.compile(fn, dynamic=True, fullgraph=True, options={"cpp.dynamic_threads": True}))


@functools.lru_cache(maxsize=16)
def _block_offsets(device: torch.device, count: int) -> torch.Tensor:
    """``arange(count)`` on ``device``, shared by every eager chunk: blocks are ``offsets + first``."""
    # arange from 0 plus a scalar stays exact in int64 for blocks up to 2**62, where an
    # arange with large bounds would size itself in floating point.
    return torch.arange(count, dtype=torch.int64, device=device)


class Bound(NamedTuple):
    """A distribution's parameters as the eager writers read them: 0-d tensors on the device
    (``params``) and Python numbers (``scalars``). A :class:`Kernel` is one too."""

    params: tuple[torch.Tensor, ...]
    scalars: tuple[float | int, ...]


def host_fill_serves(transform: Transform, dtype: torch.dtype, numel: int, out: torch.Tensor | None) -> bool:
    """Whether :func:`fill_host` serves an eager CPU draw of ``numel > 0`` elements (into ``out``, if given).

    It serves every draw of at most :data:`SMALL_NUMEL` elements (words from the readahead),
    and, where the compiled loop was built, a Bernoulli draw of any size into a contiguous
    float32, float64 or bool tensor (words and compare in one pass, no words in memory).
    """
    return numel <= SMALL_NUMEL or (_cphilox is not None and _one_pass(transform, dtype, out))


def _one_pass(transform: Transform, dtype: torch.dtype, out: torch.Tensor | None) -> bool:
    """Whether a Bernoulli draw goes into a tensor that NumPy can write in place: contiguous
    float32, float64 or bool, not requiring grad (``None``: a new tensor)."""
    return (
        transform is BERNOULLI
        and dtype in _NUMPY_DTYPES
        and (out is None or (out.is_contiguous() and not out.requires_grad))
    )


def fill_host(
    transform: Transform, scalars: Scalars, param_dtypes: Sequence[torch.dtype], key: int, start: int, out: torch.Tensor
) -> None:
    """Write the values of global indices ``start, ..., start + out.numel() - 1`` into ``out``, a CPU
    tensor that :func:`host_fill_serves` accepts: the eager path of host draws whose cost is their
    fixed cost, and of Bernoulli draws (dropout's noise) where the compiled loop was built.

    What :class:`Kernel` and :mod:`hyperrng.philox._shards` do for a one-run draw, in a few steps:
    a Bernoulli draw into a contiguous float32, float64 or bool tensor by the compiled loop in one
    pass; any other draw (at most :data:`SMALL_NUMEL` elements, any strides) from the readahead's
    words (:func:`readahead_words`).
    """
    n = out.numel()
    k0, k1 = key & _MASK32, key >> _HALF_SHIFT
    one_pass = _one_pass(transform, out.dtype, out)
    if one_pass and _cphilox is not None:  # dropout's noise: words and compare in one pass
        _cphilox.bernoulli(out.numpy(), k0, k1, start, scalars[0])
        return
    lane, first = start % WORDS_PER_BLOCK, start // WORDS_PER_BLOCK
    blocks = (lane + n + WORDS_PER_BLOCK - 1) // WORDS_PER_BLOCK
    bound, mask = _small_setup(transform, tuple(scalars), tuple(param_dtypes))
    whole = lane == 0 and blocks * WORDS_PER_BLOCK == n and out.is_contiguous()
    if one_pass and whole:
        # dropout's noise: one NumPy comparison straight into the result, a third of torch's cost here
        words_np = readahead_array(k0, k1, first, blocks)
        np.less(words_np.T, np.uint64(scalars[0]), out=out.numpy().reshape(blocks, WORDS_PER_BLOCK))
        return
    words = readahead_words(k0, k1, first, blocks)
    if mask is not None:  # rows of the writer's own, masked
        words = torch.bitwise_and(words, mask)
    if whole:
        transform.write(words, out.view(blocks, WORDS_PER_BLOCK), bound)
        return
    dst = torch.empty((blocks, WORDS_PER_BLOCK), dtype=out.dtype)
    transform.write(words, dst, bound)
    out.copy_(dst.view(-1)[lane : lane + n].view(out.shape))


@functools.lru_cache(maxsize=256)
def _small_setup(
    transform: Transform, scalars: tuple[float | int, ...], param_dtypes: tuple[torch.dtype, ...]
) -> tuple[Bound, torch.Tensor | None]:
    """A CPU draw's parameters for the writers, and the mask its words need first (``None``: none)."""
    cpu = torch.device("cpu")
    final_mask = transform.final_mask(scalars)
    needs = final_mask != _MASK32 or transform.mutates
    with torch.inference_mode(False):
        mask = torch.full((), final_mask, dtype=torch.int64) if needs else None
    return Bound(_param_tensors(scalars, param_dtypes, cpu), scalars), mask


@functools.lru_cache(maxsize=256)
def _param_tensors(
    scalars: tuple[float | int, ...], dtypes: tuple[torch.dtype, ...], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """``scalars`` as 0-d tensors of ``dtypes`` on ``device``: an operation given a Python number
    wraps it in a tensor each time, which costs as much as the operation on a small chunk."""
    # torch.full, not torch.tensor(..., device=): the latter fails on a Python-written device
    # backend when called from inside one of its kernels (a torch.library override).
    with torch.inference_mode(False):
        return tuple(torch.full((), v, dtype=d, device=device) for v, d in zip(scalars, dtypes))


class Kernel:
    """A distribution bound to its parameters, a 64-bit key and a device.

    :meth:`values` computes the values of any blocks (at most a chunk); :meth:`run`
    returns those of a range of consecutive blocks and :meth:`fill` writes them into a
    ``(blocks, 4)`` view of the result. Eager kernels work a chunk (:func:`chunk_blocks`)
    at a time; compiled kernels compute a whole range in one fused loop, which keeps
    nothing in memory but the values.
    """

    def __init__(
        self,
        transform: Transform,
        params: Scalars,
        param_dtypes: Sequence[torch.dtype],
        key: int,
        device: torch.device,
        compiled: bool,
        value_dtype: torch.dtype,
    ) -> None:
        self.transform = transform
        self.device = device
        self.compiled = compiled
        self.value_dtype = value_dtype
        self.scalars = tuple(params)
        self._param_dtypes = tuple(param_dtypes)
        self.k0, self.k1 = key & _MASK32, key >> _HALF_SHIFT
        self.final_mask = transform.final_mask(self.scalars)
        self._scratch: torch.Tensor | None = None
        if compiled:
            self._fn = _compiled(transform, device.type)
            self._keys = tuple(torch.full((), k, dtype=torch.int64, device=device) for k in (self.k0, self.k1))

    @functools.cached_property
    def params(self) -> tuple[torch.Tensor, ...]:
        """The parameters as 0-d tensors on the device (shared by every kernel with the same ones)."""
        return _param_tensors(self.scalars, self._param_dtypes, self.device)

    def values(self, blocks: torch.Tensor) -> torch.Tensor:
        """Values of the blocks ``blocks`` (1-D ``int64``), shape ``(m, 4)``, in ``value_dtype``."""
        m = blocks.numel()
        if self.compiled:
            padded = blocks if m >= _MIN_COMPILED_BLOCKS else blocks.expand(_MIN_COMPILED_BLOCKS).contiguous()
            first = torch.zeros((), dtype=torch.int64, device=self.device)
            return self._fn(first, _MIN_COMPILED_BLOCKS, padded, *self._keys, *self.params)[:m]
        out = torch.empty((m, WORDS_PER_BLOCK), dtype=self.value_dtype, device=self.device)
        self._write(out, blocks, 0)
        return out

    def run(self, first: int, m: int) -> torch.Tensor:
        """Values of blocks ``first, ..., first + m - 1`` as a new ``(m, 4)`` tensor of ``value_dtype``."""
        if self.compiled:
            start = torch.full((), first, dtype=torch.int64, device=self.device)
            return self._fn(start, max(m, _MIN_COMPILED_BLOCKS), None, *self._keys, *self.params)[:m]
        out = torch.empty((m, WORDS_PER_BLOCK), dtype=self.value_dtype, device=self.device)
        self.fill(out, first)
        return out

    def fill(self, dst: torch.Tensor, first: int) -> None:
        """Write the values of blocks ``first, first + 1, ...`` into the rows of ``dst`` ``(m, 4)``."""
        if self.compiled:
            m = dst.shape[0]
            # Into the result where it is the whole of an aligned tensor in the compute dtype (what
            # a random op's own result is); other destinations would each compile a variant.
            if (
                m >= _MIN_COMPILED_BLOCKS
                and dst.is_contiguous()
                and dst.storage_offset() == 0
                and dst.dtype == self.value_dtype
            ):
                start = torch.full((), first, dtype=torch.int64, device=self.device)
                _compiled(self.transform, self.device.type, into=True)(dst, start, m, None, *self._keys, *self.params)
            else:
                dst.copy_(self.run(first, m))
            return
        chunk = chunk_blocks(self.device.type)
        offsets = _block_offsets(self.device, chunk)
        for step in range(0, dst.shape[0], chunk):
            part = dst[step : step + chunk]
            self._write(part, offsets[: part.shape[0]], first + step)

    def _write(self, dst: torch.Tensor, blocks: torch.Tensor, first: int) -> None:
        """Eager: write the values of the blocks ``blocks + first`` (at most a chunk) into ``dst``."""
        words, products = self._rows(dst.shape[0])
        constants = _round_constants(self.k0, self.k1, self.final_mask, self.device)
        _rounds_inplace(words, products, blocks, first, constants)
        self.transform.write(words, dst, self)

    def _rows(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Four word rows and two product rows of ``m`` blocks, reused across chunks."""
        if self._scratch is None or self._scratch.shape[1] < m:
            self._scratch = torch.empty((_SCRATCH_ROWS, m), dtype=torch.int64, device=self.device)
        rows = self._scratch if self._scratch.shape[1] == m else self._scratch[:, :m]
        words, products = rows.split((WORDS_PER_BLOCK, _SCRATCH_ROWS - WORDS_PER_BLOCK))
        return words, products
