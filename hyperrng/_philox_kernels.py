"""The Philox4x32-10 block function and the chunked engine behind :mod:`hyperrng.philox`.

Everything here is plain torch integer arithmetic, so the same code runs on any device.
Unsigned 32-bit words live in ``int64`` tensors because torch has no ``uint32``
arithmetic on CPU. The product of two values below ``2**32`` wraps modulo ``2**64`` in
``int64``, so its bit pattern is the exact unsigned 64-bit product: its high word is
``(p >> 32) & 0xFFFFFFFF`` (the mask undoes the sign extension of the arithmetic shift)
and its low word is ``p & 0xFFFFFFFF``.

Counter layout: global element index ``j`` lives in Philox block ``j // 4``, lane
``j % 4``. The block index is the 64-bit counter held in words 0 (low half) and 1 (high
half); words 2 and 3 are zero. Since ``j < 2**64``, block indices are below ``2**62`` and
fit an ``int64`` tensor.

A *kernel* maps a 1-D ``int64`` tensor of block indices to a ``(blocks, 4)`` tensor of
values, one per lane, in the distribution's compute dtype; writing them into the result
rounds them to its dtype. Distributions are *transforms* ``(blocks, k0, k1, *params)``
that take the function producing the words as ``words_fn``: eager kernels pass the
in-place rounds (reused buffers, which is what makes eager fast), compiled kernels
compile the transform with the default functional rounds, which inductor fuses with the
transform into one loop. Both run the same integer operations, so they agree bit for bit
wherever the transform is exact.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "CHUNK_BLOCKS",
    "PHILOX_M0",
    "PHILOX_M1",
    "PHILOX_ROUNDS",
    "PHILOX_W0",
    "PHILOX_W1",
    "WORDS_PER_BLOCK",
    "Kernel",
    "ShardGeometry",
    "Transform",
    "bernoulli_values",
    "bits_values",
    "counter_words",
    "fill",
    "make_kernel",
    "normal_values",
    "philox_rounds",
    "uniform_values",
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
"""Blocks computed per kernel call. At 8 bytes a word the eager working set (four word
rows and two product rows, about 3 MiB) stays in cache, and it bounds working memory
independently of the tensor size."""

_MASK32 = 0xFFFFFFFF
_HALF_SHIFT = 32  # bits between the low and high word of a 64-bit product or counter
_HALF16_SHIFT = 16  # the overflow-free multiply works on 16-bit halves of the multiplier
_MASK16 = 0xFFFF

Kernel = Callable[[torch.Tensor], torch.Tensor]
"""Block indices, a 1-D int64 tensor of shape ``(m,)``, to values of shape ``(m, 4)``."""

Words = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _mulhilo32(c: torch.Tensor, multiplier: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low words of ``c * multiplier`` (both below ``2**32``) without int64 overflow.

    Compiled code must never overflow: inductor emits C++, where signed overflow is
    undefined, and gcc, knowing ``c < 2**32``, then drops the mask that corrects the sign
    of a wrapped product. Splitting the multiplier into 16-bit halves keeps every
    intermediate below ``2**49``.
    """
    upper = c * (multiplier >> _HALF16_SHIFT)
    lower = c * (multiplier & _MASK16)
    middle = upper + (lower >> _HALF16_SHIFT)  # == (c * multiplier) >> 16
    return middle >> _HALF16_SHIFT, ((middle & _MASK16) << _HALF16_SHIFT) | (lower & _MASK16)


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


def _counter_words_inplace(blocks: torch.Tensor, k0: torch.Tensor | int, k1: torch.Tensor | int) -> Words:
    """Eager twin of :func:`counter_words` on reused buffers, with one wrapping multiply.

    Each round writes into the buffers the previous round freed, so a chunk costs six
    word rows of memory and no allocation per operation. Unlike the compiled rounds it
    multiplies 32-bit words directly and lets the int64 product wrap: torch's eager
    kernels are compiled ahead of time and wrap on every backend, and one multiply in
    place of the split one is part of why eager runs these rounds about three times
    faster than :func:`counter_words`.
    """
    words = torch.empty((WORDS_PER_BLOCK, blocks.numel()), dtype=torch.int64, device=blocks.device)
    c0, c1, c2, c3 = words.unbind(0)
    torch.bitwise_and(blocks, _MASK32, out=c0)
    torch.bitwise_right_shift(blocks, _HALF_SHIFT, out=c1)
    c2.zero_()
    c3.zero_()
    p0 = torch.empty_like(c0)
    p1 = torch.empty_like(c2)
    for r in range(PHILOX_ROUNDS):
        kr0 = (k0 + r * PHILOX_W0) & _MASK32
        kr1 = (k1 + r * PHILOX_W1) & _MASK32
        torch.mul(c0, PHILOX_M0, out=p0)
        torch.mul(c2, PHILOX_M1, out=p1)
        torch.bitwise_right_shift(p1, _HALF_SHIFT, out=c0)
        c0.bitwise_xor_(c1).bitwise_xor_(kr0).bitwise_and_(_MASK32)
        torch.bitwise_right_shift(p0, _HALF_SHIFT, out=c2)
        c2.bitwise_xor_(c3).bitwise_xor_(kr1).bitwise_and_(_MASK32)
        # The products become words 1 and 3; their old buffers hold the next products.
        c1, p1 = p1, c1
        c3, p0 = p0, c3
    # An even number of rounds swaps the buffers back, so words 1 and 3 are rows 1 and 3.
    words[1::2].bitwise_and_(_MASK32)
    return c0, words[1], c2, words[3]


WordsFn = Callable[[torch.Tensor, torch.Tensor | int, torch.Tensor | int], Words]
Transform = Callable[..., torch.Tensor]


@functools.cache
def _compiled(transform: Transform) -> Transform:
    # Compiled once per distribution, on first use, never at import. Each transform is
    # its own code object, so each has its own compile cache; keys and parameters are
    # tensor arguments and the block count is dynamic, so new keys, offsets, bounds or
    # sizes reuse the compiled code (only the compute dtype and device select variants).
    return torch.compile(transform, dynamic=True, fullgraph=True)


def make_kernel(
    transform: Transform,
    params: Sequence[float | int],
    param_dtypes: Sequence[torch.dtype],
    key: int,
    device: torch.device,
    compiled: bool,
) -> Kernel:
    """Bind a transform, its parameters and a 64-bit key into a :data:`Kernel`.

    ``params`` become 0-d tensors of ``param_dtypes`` on ``device``, so that eager and
    compiled code round them identically and compiled code is not specialised on them.
    Eager kernels run the in-place rounds; compiled kernels trace the functional ones.
    """
    tensors = tuple(torch.tensor(v, dtype=d, device=device) for v, d in zip(params, param_dtypes))
    k0, k1 = key & _MASK32, key >> _HALF_SHIFT
    if compiled:
        fn = _compiled(transform)
        keys = (torch.tensor(k0, device=device), torch.tensor(k1, device=device))
        return lambda blocks: fn(blocks, *keys, *tensors)
    return lambda blocks: transform(blocks, k0, k1, *tensors, words_fn=_counter_words_inplace)


@dataclass(frozen=True)
class ShardGeometry:
    """A row-major block of a global tensor, seen as ``segments`` runs of ``run`` elements.

    In row-major order a block selected by per-dimension ranges is a set of equally
    long contiguous runs: the innermost dimensions it covers entirely merge with the
    first one it does not. ``split`` is that dimension; the dimensions before it index
    the runs.
    """

    global_shape: tuple[int, ...]
    starts: tuple[int, ...]
    local_shape: tuple[int, ...]
    split: int
    run: int

    @classmethod
    def of(cls, global_shape: tuple[int, ...], ranges: Sequence[tuple[int, int]]) -> ShardGeometry:
        """Geometry of the block ``[start_d, stop_d)`` in each dimension ``d``."""
        starts = tuple(a for a, _ in ranges)
        local = tuple(b - a for a, b in ranges)
        split = len(global_shape) - 1
        while split > 0 and local[split] == global_shape[split]:
            split -= 1
        run = 1
        for d in range(max(split, 0), len(global_shape)):
            run *= local[d]
        return cls(global_shape, starts, local, split, run)

    @property
    def segments(self) -> int:
        count = 1
        for extent in self.local_shape[: self.split]:
            count *= extent
        return count

    def segment_starts(self, ids: torch.Tensor) -> torch.Tensor:
        """Global row-major index (from 0) of the first element of each run in ``ids``."""
        strides = [1] * len(self.global_shape)
        for d in range(len(self.global_shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * self.global_shape[d + 1]
        rel = torch.full_like(ids, self.starts[self.split] * strides[self.split] if self.global_shape else 0)
        rest = ids
        for d in range(self.split - 1, -1, -1):
            rel += (rest % self.local_shape[d] + self.starts[d]) * strides[d]
            rest = rest // self.local_shape[d]
        return rel


def _fill_range(out: torch.Tensor, start: int, kernel: Kernel) -> None:
    """Write the values of global indices ``[start, start + out.numel())`` into 1-D ``out``."""
    n = out.numel()
    first, last = start // WORDS_PER_BLOCK, (start + n - 1) // WORDS_PER_BLOCK
    skip = start % WORDS_PER_BLOCK  # lanes of the first block before ``start``
    written = 0
    block = first
    while block <= last:
        m = min(CHUNK_BLOCKS, last - block + 1)
        # arange from 0 plus a scalar stays exact in int64 for blocks up to 2**62.
        blocks = torch.arange(m, dtype=torch.int64, device=out.device) + block
        values = kernel(blocks).reshape(-1)
        take = min(values.numel() - skip, n - written)
        out[written : written + take].copy_(values[skip : skip + take])
        written += take
        skip = 0
        block += m


def _blocks_spanned(run: int) -> int:
    """Blocks that hold a run of ``run`` elements wherever it starts.

    A run starting at lane ``a`` spans ``(a + run - 1) // 4 + 1`` blocks; this is the
    value for ``a = 3``, the worst case.
    """
    return (run + 2) // WORDS_PER_BLOCK + 1


def _fill_short_runs(out: torch.Tensor, geometry: ShardGeometry, offset: int, kernel: Kernel) -> None:
    """Fill ``out`` of shape ``(segments, run)`` many runs per kernel call, gathering lanes."""
    run = geometry.run
    span = _blocks_spanned(run)
    group = CHUNK_BLOCKS // span
    device = out.device
    steps = torch.arange(span, dtype=torch.int64, device=device)
    columns = torch.arange(run, dtype=torch.int64, device=device)
    base_block, base_lane = offset // WORDS_PER_BLOCK, offset % WORDS_PER_BLOCK
    for g0 in range(0, geometry.segments, group):
        ids = torch.arange(g0, min(g0 + group, geometry.segments), dtype=torch.int64, device=device)
        # Split offset + start into block and lane without forming it: it may exceed int64.
        shifted = geometry.segment_starts(ids) + base_lane
        first_blocks = shifted // WORDS_PER_BLOCK + base_block
        lanes = shifted % WORDS_PER_BLOCK
        blocks = (first_blocks[:, None] + steps[None, :]).reshape(-1)
        values = kernel(blocks).reshape(ids.numel(), span * WORDS_PER_BLOCK)
        out[g0 : g0 + ids.numel()] = values.gather(1, lanes[:, None] + columns[None, :])


def fill(out: torch.Tensor, geometry: ShardGeometry, offset: int, kernel: Kernel) -> torch.Tensor:
    """Fill contiguous ``out`` (of ``geometry.local_shape``) with the kernel's values.

    Element ``e`` of the global tensor gets the value of global index ``offset + e``
    (``e`` row-major in ``geometry.global_shape``). Long runs are computed one range at a
    time; runs shorter than a chunk are batched, as many per kernel call as fit in a
    chunk, and their lanes gathered: that computes up to four words per element kept but
    saves a kernel call (about a hundred tensor operations) per run.
    """
    if out.numel() == 0:
        return out
    rows = out.view(geometry.segments, geometry.run)
    if geometry.segments == 1 or _blocks_spanned(geometry.run) > CHUNK_BLOCKS:
        ids = torch.arange(geometry.segments, dtype=torch.int64)
        for row, start in zip(rows, geometry.segment_starts(ids).tolist()):
            _fill_range(row, offset + start, kernel)
    else:
        _fill_short_runs(rows, geometry, offset, kernel)
    return out


def bits_values(
    blocks: torch.Tensor, k0: torch.Tensor | int, k1: torch.Tensor | int, *, words_fn: WordsFn = counter_words
) -> torch.Tensor:
    """The raw words, lane-major: ``(m, 4)`` int64 in ``[0, 2**32)``."""
    return torch.stack(words_fn(blocks, k0, k1), dim=1)


def uniform_values(
    blocks: torch.Tensor,
    k0: torch.Tensor | int,
    k1: torch.Tensor | int,
    shift: torch.Tensor,
    unit: torch.Tensor,
    span: torch.Tensor,
    low: torch.Tensor,
    *,
    words_fn: WordsFn = counter_words,
) -> torch.Tensor:
    """``low + span * ((word >> shift) * unit)`` in the dtype of ``unit``.

    ``unit`` is ``2**-(32 - shift)``, so the uniform is exact; with ``span = 1`` and
    ``low = 0`` the affine step is exact too.
    """
    u = (torch.stack(words_fn(blocks, k0, k1), dim=1) >> shift) * unit
    return u * span + low


def bernoulli_values(
    blocks: torch.Tensor,
    k0: torch.Tensor | int,
    k1: torch.Tensor | int,
    threshold: torch.Tensor,
    *,
    words_fn: WordsFn = counter_words,
) -> torch.Tensor:
    """``word < threshold``: True with probability exactly ``threshold / 2**32``."""
    return torch.stack(words_fn(blocks, k0, k1), dim=1) < threshold


def normal_values(
    blocks: torch.Tensor,
    k0: torch.Tensor | int,
    k1: torch.Tensor | int,
    shift: torch.Tensor,
    unit: torch.Tensor,
    two_pi: torch.Tensor,
    std: torch.Tensor,
    mean: torch.Tensor,
    *,
    words_fn: WordsFn = counter_words,
) -> torch.Tensor:
    """Box–Muller on the word pairs (0, 1) and (2, 3): lanes 2i and 2i+1 share a radius.

    ``u1 = ((w >> shift) + 1) * unit`` lies in ``(0, 1]`` so the logarithm is finite.
    """
    w0, w1, w2, w3 = words_fn(blocks, k0, k1)
    u1 = ((torch.stack((w0, w2), dim=1) >> shift) + 1) * unit
    u2 = (torch.stack((w1, w3), dim=1) >> shift) * unit
    radius = torch.sqrt(torch.log(u1) * -2.0)
    theta = u2 * two_pi
    z = torch.stack((radius * torch.cos(theta), radius * torch.sin(theta)), dim=2).reshape(-1, WORDS_PER_BLOCK)
    return z * std + mean
