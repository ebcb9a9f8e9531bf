"""Portable counter-based random numbers: Philox4x32-10 in plain torch integer ops, with explicit keys.
Every value is a pure function of a 64-bit ``key`` and its *global index*: element ``i`` (row-major) of a
tensor drawn with ``offset`` has global index ``j = offset + i`` and is computed from lane ``j % 4`` of
the Philox block whose 64-bit counter is ``j // 4``, so a shard equals the matching slice of the full
tensor bit for bit, whatever the device, the backend (:mod:`hyperrng.philox.backends`) or the sharding;
the public functions here check their arguments (:mod:`hyperrng.philox._checks`) and draw
(:mod:`hyperrng.philox._draws`), and every portable dropout keeps an element where its word is below
``round((1 - p) * 2**32)`` (:func:`dropout`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from hyperrng.errors import ArgumentTypeError, InvalidArgumentError
from hyperrng.philox import _shards, _triton, backends
from hyperrng.philox import _torch as _k
from hyperrng.philox._checks import _check_bool, _check_device, _check_out, check_probability, check_shape
from hyperrng.philox._draws import (
    _UNIFORM_BITS,
    _WORD_BITS,
    BITS,
    Draw,
    bernoulli_draw,
    dropout_draw,
    normal_draw,
    randint_draw,
    run,
    uniform_draw,
)
from hyperrng.philox._draws import _normal_draw as _normal_draw  # portable mode's ops call it here
from hyperrng.philox._draws import _uniform_draw as _uniform_draw  # as above
from hyperrng.platforms._features import eager_when_traced
from hyperrng.platforms.validate import check_int, check_seed

__all__ = [
    "COUNTER_SPACE",
    "MAX_KEY",
    "MAX_NUMEL",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "apply_dropout_mask",
    "bernoulli",
    "check_probability",
    "check_shape",
    "dropout",
    "normal",
    "philox4x32_10",
    "randint",
    "random_bits",
    "uniform",
]

MAX_KEY = 2**64 - 1
"""Largest key: keys are the two 32-bit key words of Philox4x32, low word first."""

COUNTER_SPACE = 2**64
"""Global indices are below this: ``offset + numel`` (the counters it uses, rounded up to whole 4-word
blocks) may reach it but not exceed it."""

MAX_NUMEL = 2**36
"""Most elements one call returns (the tensor, or the shard with ``shard=``): 64 GiB at one
byte per element, more than one device holds. Larger requests are refused with
:class:`InvalidArgumentError` instead of failing in the allocator; draw them as shards or
as consecutive pieces (``offset`` advanced by each piece's size)."""

SMALL_NUMEL = _k.SMALL_NUMEL
"""Eager CPU draws of at most this many elements in one run read their words from the readahead buffer."""

ShapeLike = int | Sequence[int] | torch.Size
DeviceLike = torch.device | str | int | None


def _check_offset(offset: object, numel: int) -> int:
    value = check_int(offset, "offset")
    if value < 0:
        raise InvalidArgumentError(
            f"offset must be >= 0, got {value}; it is the global index of the first element, "
            f"e.g. the number of values already drawn with this key."
        )
    if value + numel > COUNTER_SPACE:
        raise InvalidArgumentError(
            f"offset {value} + {numel} elements overflows the 2**64 counter space by "
            f"{value + numel - COUNTER_SPACE}; start a new key instead of wrapping around."
        )
    return value


def _generate(
    shape: ShapeLike,
    key: object,
    offset: object,
    shard: object,
    device: object,
    compiled: object,
    out: object,
    draw: Draw,
    backend: object,
) -> torch.Tensor:
    """Check the position, the block, the device, ``out`` and ``backend``, then :func:`run` ``draw``.

    The public draws that come here, and :func:`dropout`, are eager functions: inside ``torch.compile``
    Dynamo runs them as Python behind a graph break
    (:func:`~hyperrng.platforms._features.eager_when_traced`), never traces into their host paths (the
    compiled C loop, the word readahead, ``out=`` writers), so compiled code draws what eager code draws;
    ``fullgraph=True`` refuses them. Portable mode's random ops are what compiles whole."""
    global_shape = check_shape(shape)
    key_value = check_seed(key, "key")
    offset_value = _check_offset(offset, math.prod(global_shape))
    geometry = _shards.ShardGeometry.of(global_shape, shard)
    numel = math.prod(geometry.local_shape)
    if numel > MAX_NUMEL:
        raise InvalidArgumentError(
            f"{'the shard' if shard is not None else 'shape'} {geometry.local_shape} has {numel} elements, more "
            f"than MAX_NUMEL = 2**36 per call; draw it in shards (shard=) or in pieces, advancing offset by each "
            f"piece's size."
        )
    use_compiled = _check_bool(compiled, "compiled")
    chosen = backends.check_backend(backend)
    target = _check_device(device)
    result = None if out is None else _check_out(out, geometry.local_shape, draw.dtype, target)
    return run(draw, geometry, key_value, offset_value, target, use_compiled, result, backends.resolve(chosen, target))


def philox4x32_10(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Apply the Philox4x32-10 block function.

    Args:
        counter: int64 tensor of shape ``(..., 4)``, words in ``[0, 2**32)``.
        key: int64 tensor of shape ``(..., 2)``, words in ``[0, 2**32)``, broadcastable
            against ``counter`` over the leading dimensions, on ``counter``'s device.

    Returns:
        int64 tensor of shape ``(..., 4)``: the output words, each in ``[0, 2**32)``, in
        Random123's word order (``philox4x32(ctr, key)``'s ``v[0..3]``).

    Raises:
        ArgumentTypeError: ``counter`` or ``key`` is not an ``int64`` tensor.
        InvalidArgumentError: a last dimension is not 4 (counter) or 2 (key), the leading
            dimensions do not broadcast, ``counter`` and ``key`` are on different devices,
            or a word is outside ``[0, 2**32)``.
    """
    for name, t, width in (("counter", counter, _k.WORDS_PER_BLOCK), ("key", key, 2)):
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(
                f"{name} must be an int64 torch.Tensor of shape (..., {width}), got {type(t).__name__}; "
                f"build it with torch.tensor(..., dtype=torch.int64)."
            )
        if t.dtype != torch.int64:
            raise ArgumentTypeError(f"{name} must be an int64 tensor, got {t.dtype}; convert it with .long().")
        if t.dim() == 0 or t.shape[-1] != width:
            raise InvalidArgumentError(f"{name} must have shape (..., {width}), got {tuple(t.shape)}.")
    if counter.device != key.device:
        raise InvalidArgumentError(
            f"counter is on {counter.device} but key is on {key.device}; move both to one device."
        )
    try:
        batch = torch.broadcast_shapes(counter.shape[:-1], key.shape[:-1])  # type: ignore[no-untyped-call]
    except RuntimeError:
        raise InvalidArgumentError(
            f"counter {tuple(counter.shape)} and key {tuple(key.shape)} do not broadcast over their leading "
            f"dimensions; give key shape (2,) for one key, or one key per counter."
        ) from None
    for name, t in (("counter", counter), ("key", key)):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) > 2**_WORD_BITS - 1):
            raise InvalidArgumentError(
                f"{name} words must be in [0, 2**32 - 1]; got values in [{int(t.min())}, {int(t.max())}]."
            )
    c = counter.expand(*batch, _k.WORDS_PER_BLOCK).unbind(-1)
    k = key.expand(*batch, 2).unbind(-1)
    return torch.stack(_k.philox_rounds(c[0], c[1], c[2], c[3], k[0], k[1]), dim=-1)


@eager_when_traced
def random_bits(
    shape: ShapeLike,
    key: int,
    offset: int = 0,
    *,
    shard: Sequence[slice] | None = None,
    device: DeviceLike = None,
    compiled: bool = False,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Return raw 32-bit Philox words as an int64 tensor of ``shape`` (values in ``[0, 2**32)``).

    Element ``i`` is lane ``(offset + i) % 4`` of the block with counter
    ``(offset + i) // 4`` under ``key``. With ``shard`` (slices of the global ``shape``,
    step 1, trailing dimensions may be omitted) only that block of the global tensor is
    computed: the result equals ``random_bits(shape, key, offset)[shard]`` bit for bit.
    ``out`` (this and every distribution below) is a tensor of the result's shape, dtype and
    device, any strides, to write the values into and return, instead of a new one.
    ``backend`` (this and every function below) is ``"auto"``, ``"torch"`` or ``"triton"``: see
    :mod:`hyperrng.philox.backends`; every backend gives the same values. ``compiled=True``
    runs the torch backend through ``torch.compile`` (the Triton backend is fused already).

    Consecutive calls that advance ``offset`` by the previous ``numel`` never reuse a value.
    :func:`random_bits`, :func:`bernoulli`, :func:`dropout`'s mask and :func:`uniform` with its
    default bounds are identical on every device, eager or compiled, because they are exact
    integer and power-of-two operations; :func:`normal` depends on each device's
    ``log``/``sin``/``cos`` (see its docstring). Draws of different distributions with the same
    key and offset read the same words, so they are dependent: give independent draws different
    keys or disjoint index ranges.

    Memory: eager draws work a chunk of blocks at a time, so the working memory besides the
    result is at most :func:`~hyperrng.philox._torch.scratch_bytes` (24 MiB) whatever the
    tensor size. ``compiled=True`` runs the same arithmetic through ``torch.compile`` as one
    fused loop per contiguous run, keeping nothing in memory but the values; it is compiled
    on first use, once per distribution and compute dtype, then reused for every key,
    offset, parameter and size, and is bitwise equal to eager for the exact distributions.

    Every argument is checked before anything is allocated or computed.

    Raises:
        ArgumentTypeError: ``key``, ``offset`` or a shape dimension is not an int (bools and
            floats included); ``shape`` is not an int or a sequence; ``shard`` is not a
            sequence of slices with int bounds; ``device`` is not a string, torch.device or
            None; ``compiled`` is not a bool; ``backend`` is not a string; ``out`` is not a
            tensor or has another dtype.
        InvalidArgumentError: ``key`` is not in ``[0, 2**64 - 1]``; ``offset`` is negative
            or ``offset + numel > 2**64``; ``shape`` has a negative dimension or ``2**62``
            elements or more; the result (the shard, with ``shard=``) has more than
            :data:`MAX_NUMEL`; ``shard`` has more slices than ``shape`` has dimensions, or
            a step other than 1; ``device`` names no device, or one this process lacks;
            ``out`` has another shape or device, or overlapping elements; ``backend`` is
            another string, or ``"triton"`` where Triton cannot serve the device.
    """
    return _generate(shape, key, offset, shard, device, compiled, out, BITS, backend)


@eager_when_traced
def uniform(
    shape: ShapeLike,
    key: int,
    offset: int = 0,
    dtype: torch.dtype = torch.float32,
    low: float = 0.0,
    high: float = 1.0,
    *,
    shard: Sequence[slice] | None = None,
    device: DeviceLike = None,
    compiled: bool = False,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Return uniform floats of ``shape``; element ``i`` depends only on ``(key, offset + i)``.

    With the default bounds the values are exactly ``k * 2**-b`` for the top ``b`` bits
    ``k`` of the element's word: ``b`` = 24 for float32 (interval ``[0, 1 - 2**-24]``),
    11 for float16 (``[0, 1 - 2**-11]``), 8 for bfloat16 (``[0, 1 - 2**-8]``) and 32 for
    float64 (``[0, 1 - 2**-32]``: float64 values have 32 random bits, not 53). These
    values are bit-identical on every device and backend, eager or compiled. Other bounds give
    ``low + (high - low) * u`` computed in float32 (float64 for float64) with ``high - low``
    and ``low`` rounded to that precision, then rounded once to ``dtype``; rounding can
    then produce ``high`` itself. That is a multiply and an add, identical wherever they
    are not fused into one FMA: in eager code on any device, in the Triton kernels (built
    without fused multiply-adds) and in compiled CPU code (inductor compiles with
    ``-ffp-contract=off``); compiled GPU code (``compiled=True`` with the torch backend) may
    fuse them and differ by an ulp.

    ``shard`` selects a block of the global ``shape`` as in :func:`random_bits`.

    Raises:
        ArgumentTypeError: ``dtype`` is not float32, float64, float16 or bfloat16, or
            ``low``/``high`` are not real numbers.
        InvalidArgumentError: ``low``/``high`` are not finite values of ``dtype``,
            ``low > high``, or ``high - low`` overflows the compute precision.
        And the errors of :func:`random_bits`.
    """
    return _generate(shape, key, offset, shard, device, compiled, out, uniform_draw(dtype, low, high), backend)


@eager_when_traced
def bernoulli(
    shape: ShapeLike,
    p: float,
    key: int,
    offset: int = 0,
    *,
    dtype: torch.dtype = torch.bool,
    shard: Sequence[slice] | None = None,
    device: DeviceLike = None,
    compiled: bool = False,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Return a tensor of ``shape`` whose elements are True (1.0) with probability ``p``.

    Element ``i`` is ``word < round(p * 2**32)``, an integer comparison on the word of
    global index ``offset + i``: the probability is exactly ``round(p * 2**32) / 2**32``
    (within ``2**-33`` of ``p``; ``p = 0`` and ``p = 1`` are exact) and the result is
    bit-identical on every device and backend, eager or compiled. ``dtype`` is ``torch.bool``
    or one of float32, float64, float16 and bfloat16, which hold 1.0 and 0.0 (what
    ``Tensor.bernoulli_`` writes into a floating-point tensor). ``shard`` works as in
    :func:`random_bits`.

    Raises:
        ArgumentTypeError: ``p`` is not a real number (bools, strings and tensors included);
            ``dtype`` is not one of those above.
        InvalidArgumentError: ``p`` is not in ``[0, 1]`` (NaN included).
        And the errors of :func:`random_bits`.
    """
    return _generate(shape, key, offset, shard, device, compiled, out, bernoulli_draw(p, dtype), backend)


@eager_when_traced
def randint(
    shape: ShapeLike,
    low: int,
    high: int,
    key: int,
    offset: int = 0,
    *,
    dtype: torch.dtype = torch.int64,
    shard: Sequence[slice] | None = None,
    device: DeviceLike = None,
    compiled: bool = False,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Return integers in ``[low, high)`` of ``shape``: element ``i`` is ``low + word % (high - low)``.

    One 32-bit word per element, so the range holds 1 to ``2**32`` values (a range that does
    not divide ``2**32`` is slightly uneven: by at most ``(high - low) / 2**32``). What
    ``torch.randint`` and ``Tensor.random_(low, high)`` draw in portable mode. ``dtype`` is
    any real dtype that holds the range (a floating dtype receives the integers, rounded as
    torch converts them); bit-identical on every device and backend. ``shard`` works as in
    :func:`random_bits`.

    Raises:
        ArgumentTypeError: ``low`` or ``high`` is not an int; ``dtype`` is not a real torch dtype.
        InvalidArgumentError: the range holds fewer than 1 or more than ``2**32`` values, or
            does not fit ``dtype``.
        And the errors of :func:`random_bits`.
    """
    return _generate(shape, key, offset, shard, device, compiled, out, randint_draw(low, high, dtype), backend)


@eager_when_traced
def dropout(
    x: torch.Tensor,
    p: float,
    key: int,
    offset: int = 0,
    training: bool = True,
    *,
    global_shape: ShapeLike | None = None,
    shard: Sequence[slice] | None = None,
    compiled: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Zero each element of ``x`` with probability ``p`` and scale the rest by ``1 / (1 - p)``.

    Element ``i`` is kept exactly where ``bernoulli(x.shape, 1 - p, key, offset)[i]`` is
    True, i.e. where its 32-bit word is below ``round((1 - p) * 2**32)``, so the mask is
    identical on every device and backend. The values are :func:`apply_dropout_mask` of that mask: ``F.dropout`` in
    portable mode at the same position gives the same bits. ``p = 1`` returns ``x * 0``;
    ``p = 0``, ``training=False`` or an empty ``x`` return ``x`` itself. Gradients flow through
    the kept elements.

    The Triton backend masks and scales in one pass and keeps no mask: its backward pass
    draws the same words again, in the same single pass over the gradient. The torch backend
    draws the mask, then multiplies (autograd keeps the scaled mask for the backward pass).

    **Dropout convention.** Every portable dropout (this function, the functions of
    :mod:`hyperrng.portable.position`, and ``F.dropout`` in portable mode) *keeps* element ``i``
    where its word is below ``round((1 - p) * 2**32)``, that is where ``bernoulli(shape, 1 - p)``
    is True, and computes the values as torch does (:func:`apply_dropout_mask`). This is torch's
    own definition: ``F.dropout`` on the CPU decomposes into ``bernoulli_(1 - p)`` and a scale,
    and portable mode replaces ``bernoulli_``, not that decomposition, so the keep-mask
    convention is the one under which the functions and portable mode agree bit for bit.

    For a shard of a larger tensor, pass ``global_shape`` and ``shard`` (slices as in
    :func:`random_bits`); ``x`` must have the shard's shape and is masked exactly as the
    matching block of the global tensor would be.

    Raises:
        ArgumentTypeError: ``x`` is not a floating-point tensor, or ``training`` or
            ``compiled`` is not a bool.
        InvalidArgumentError: ``x.shape`` is not the shape of ``shard`` in ``global_shape``;
            or only one of ``global_shape`` and ``shard`` is given.
        And the errors of :func:`bernoulli`.
    """
    if not isinstance(x, torch.Tensor):
        raise ArgumentTypeError(
            f"dropout expects x to be a floating-point torch.Tensor, got {type(x).__name__}; convert it with "
            f"torch.as_tensor(x, dtype=torch.float32)."
        )
    if not x.is_floating_point():
        raise ArgumentTypeError(f"dropout expects a floating-point torch.Tensor, got {x.dtype}.")
    p_value = check_probability(p)
    is_training = _check_bool(training, "training")
    use_compiled = _check_bool(compiled, "compiled")
    chosen = backends.check_backend(backend)
    if (global_shape is None) != (shard is None):
        raise InvalidArgumentError("pass global_shape and shard together, or neither.")
    shape = tuple(x.shape) if global_shape is None else check_shape(global_shape)
    geometry = _shards.ShardGeometry.of(shape, shard)
    if geometry.local_shape != tuple(x.shape):
        raise InvalidArgumentError(
            f"x has shape {tuple(x.shape)} but shard {shard!r} of {shape} has shape {geometry.local_shape}."
        )
    key_value = check_seed(key, "key")
    offset_value = _check_offset(offset, math.prod(shape))
    if not is_training or p_value == 0.0 or x.numel() == 0:
        return x
    if p_value == 1.0:
        return apply_dropout_mask(x, None, p_value)
    if x.dtype in _UNIFORM_BITS and backends.resolve(chosen, x.device) == "triton":
        return _FusedDropout.apply(x, dropout_draw(p_value, x.dtype), geometry, key_value, offset_value)
    keep = run(bernoulli_draw(1.0 - p_value), geometry, key_value, offset_value, x.device, use_compiled, None, "torch")
    return apply_dropout_mask(x, keep, p_value)


class _FusedDropout(torch.autograd.Function):
    """The Triton backend's dropout: one pass forward, and one pass backward that draws the mask again."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, draw: Draw, geometry: _shards.ShardGeometry, key: int, offset: int
    ) -> torch.Tensor:
        ctx.position = (draw, geometry, key, offset)
        return _triton.dropout(draw.kernel_arguments, geometry, key, offset, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        draw, geometry, key, offset = ctx.position
        args = draw.kernel_arguments
        return _triton.dropout(args, geometry, key, offset, grad), None, None, None, None


def _describe(value: object) -> str:
    return f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else f"{type(value).__name__} {value!r:.60}"


def apply_dropout_mask(x: torch.Tensor, keep: torch.Tensor | None, p: float) -> torch.Tensor:
    """Dropout's values for the bool mask ``keep`` (True: kept) drawn with probability ``1 - p``.

    Torch's dropout arithmetic, so that every portable dropout gives the same bits:
    ``x * keep.to(x.dtype).div_(1 - p)``, the mask scaled in ``x``'s dtype and then
    multiplied, and ``x * 0`` for ``p = 1`` (``keep`` is not read then). Dropped elements
    are ``x * 0``: NaN where ``x`` is inf or NaN, ``-0.0`` where it is negative, as in
    ``F.dropout``. ``keep`` must be on ``x``'s device, its shape broadcast with ``x``'s.

    Raises:
        ArgumentTypeError: ``x`` is not a floating-point or complex tensor, ``keep`` not a bool
            tensor (or ``None``), or ``p`` not a real number.
        InvalidArgumentError: ``p`` is outside ``[0, 1]``; or ``keep`` is on another device, or
            its shape does not broadcast to ``x``'s.
    """
    if not isinstance(x, torch.Tensor) or not (x.is_floating_point() or x.is_complex()):
        raise ArgumentTypeError(f"x must be a floating-point tensor, got {_describe(x)}.")
    if type(p) is not float or not 0.0 <= p <= 1.0:
        p = check_probability(p)
    if keep is not None:
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
            raise ArgumentTypeError(f"keep must be a bool tensor (True: kept) or None, got {_describe(keep)}.")
        if keep.device != x.device:
            raise InvalidArgumentError(f"keep is on {keep.device} but x is on {x.device}; put both on one device.")
        if any(k != n and k != 1 and n != 1 for k, n in zip(reversed(keep.shape), reversed(x.shape))):
            raise InvalidArgumentError(
                f"keep's shape {tuple(keep.shape)} does not broadcast with x's {tuple(x.shape)}."
            )
    if p == 1.0 or keep is None:
        return x * 0.0
    return x * keep.to(x.dtype).div_(1.0 - p)


@eager_when_traced
def normal(
    shape: ShapeLike,
    key: int,
    offset: int = 0,
    dtype: torch.dtype = torch.float32,
    mean: float = 0.0,
    std: float = 1.0,
    *,
    shard: Sequence[slice] | None = None,
    device: DeviceLike = None,
    compiled: bool = False,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Return normal samples of ``shape``; element ``i`` depends only on ``(key, offset + i)``.

    Box–Muller per block: global index ``j`` uses block ``j // 4``; lanes 0 and 1 are
    ``r cos t`` and ``r sin t`` from words (0, 1), lanes 2 and 3 the same from words
    (2, 3), with ``r = sqrt(-2 log u1)``, ``t = 2 pi u2``, ``u1 = (k1 + 1) * 2**-b`` in
    ``(0, 1]`` and ``u2 = k2 * 2**-b`` from the top ``b`` bits of the words. float32,
    float16 and bfloat16 are computed in float32 with ``b = 24`` and rounded once, so
    ``|z| <= 5.77`` before scaling; float64 uses ``b = 32`` (``|z| <= 6.67``). Then
    ``mean + std * z``.

    Exactness: shards and chunks equal slices of the full tensor bit for bit on one
    device and backend. Across device kinds and backends the integer part is identical
    but ``log``, ``sin``, ``cos`` (and on CPU even ``sqrt``) are each one's own
    implementations (SLEEF on CPU, Triton's math functions on a GPU, ...), so values agree to
    a few ulp, not bit for bit. The same holds between eager and ``compiled=True``, whose
    generated code has its own implementations of these functions.

    Raises:
        ArgumentTypeError: ``dtype`` is not float32, float64, float16 or bfloat16, or
            ``mean``/``std`` are not real numbers.
        InvalidArgumentError: ``mean``/``std`` are not finite, ``std < 0``, or samples
            (up to ``mean ± 5.77 std``, ``6.67 std`` for float64) could overflow ``dtype``.
        And the errors of :func:`random_bits`.
    """
    return _generate(shape, key, offset, shard, device, compiled, out, normal_draw(dtype, mean, std), backend)
