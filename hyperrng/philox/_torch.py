"""The torch backend of :mod:`hyperrng.philox`: its distributions, and the kernels that compute them in
torch ops. Everything here is plain torch integer arithmetic on the words of
:mod:`hyperrng.philox._words`, so the same code runs on any device: it is the reference that the Triton
backend (:mod:`hyperrng.philox._triton`) is proven equal to. A :class:`Transform` turns the four words of
a block into a distribution's four values; a :class:`Kernel` binds one to its parameters, a key and a
device, and writes whole runs of blocks straight into the result (:mod:`hyperrng.philox._shards` says
which runs), eagerly or through ``torch.compile``; :func:`fill_host` serves small CPU draws, and
dropout's noise, in a few steps from words computed on the host.
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

from hyperrng.philox._words import (  # what the kernels use, and the names this module exported before
    _HALF_SHIFT,
    _MASK32,
    HOST_WORDS,
    PHILOX_M0,
    PHILOX_M1,
    PHILOX_ROUNDS,
    PHILOX_W0,
    PHILOX_W1,
    READAHEAD_BLOCKS,
    WORDS_PER_BLOCK,
    Words,
    _cphilox,
    _round_constants,
    _rounds_inplace,
    counter_words,
    host_words,
    numpy_words,
    philox_rounds,
    readahead_array,
    readahead_words,
)

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

_NUMPY_DTYPES = frozenset({torch.float32, torch.float64, torch.bool})
"""Result dtypes a small CPU Bernoulli draw writes with NumPy."""

_SCRATCH_ROWS = 6  # eager int64 rows per chunk: four words and two products
_VALUE_ROWS = 6  # eager value rows per chunk, at most: normal's radii, angles and one lane pair

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
    nothing in memory but the values. Two implementations of the same arithmetic:

    * eager: the rounds run in place on a few reused rows of one chunk (no allocation per
      operation), and the distribution writes each lane directly into its strided column of
      the result, so a chunk costs about sixty tensor operations and no extra pass;
    * compiled: ``torch.compile`` fuses the functional rounds and the distribution into one
      loop over the blocks, with nothing but the values in memory.

    Both run the same integer operations, so they agree bit for bit wherever the
    distribution is exact.
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
