"""The draws of :mod:`hyperrng.philox`: a distribution with checked parameters (:class:`Draw`), made once
per distinct set of parameters by the cached ``*_draw`` functions, and :func:`run`, which has a backend
compute a draw's values for a block of the global tensor at a position, checking nothing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hyperrng.errors import ArgumentTypeError, InvalidArgumentError
from hyperrng.philox import _shards, _triton
from hyperrng.philox import _torch as _k
from hyperrng.philox._checks import _check_dtype, _check_finite, _check_real, check_probability
from hyperrng.platforms.validate import check_int

_WORD_BITS = 32
_PROBABILITY_SCALE = 1 << _WORD_BITS  # a 32-bit word is below round(p * 2**32) with probability ~p
_WORD_UNIT = 2.0**-_WORD_BITS  # the weight of the lowest bit of a word

_UNIFORM_BITS = {torch.float32: 24, torch.float64: 32, torch.float16: 11, torch.bfloat16: 8}
"""Top bits of a word kept by :func:`~hyperrng.philox.uniform`: the significand width of the dtype
(capped at the 32 bits of one word), so ``k * 2**-bits`` is exact for every ``k``."""

_BERNOULLI_DTYPES = (torch.bool, *_UNIFORM_BITS)
"""What :func:`~hyperrng.philox.bernoulli` returns: True and False, or 1.0 and 0.0."""

_NORMAL_BITS = {torch.float32: 24, torch.float64: 32, torch.float16: 24, torch.bfloat16: 24}
"""Bits per Box–Muller uniform; half types are computed in float32 and rounded once."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half types are computed in float32 and rounded once, when written into the result.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _finite_in(value: float, dtype: torch.dtype) -> bool:
    """Whether ``value`` rounds to a finite number of ``dtype``."""
    return bool(torch.isfinite(torch.tensor(value, dtype=torch.float64).to(dtype)))


class _Once:
    """``functools.cached_property`` without its lock, which torch.compile cannot enter on Python 3.10 and 3.11:
    the value, computed at the first read, goes into the instance's dict, which later reads find first (a
    non-data descriptor), so they cost no call. Two threads reading it first compute the same value."""

    def __init__(self, compute: Callable[[Any], Any]) -> None:
        self.compute, self.name = compute, compute.__name__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        value = instance.__dict__[self.name] = self.compute(instance)
        return value


# -- draws: a distribution with checked parameters, computed by a backend ----------------------
@dataclass(frozen=True)
class Draw:
    """A distribution with checked parameters: what either backend computes.

    ``params`` are Python numbers: the first an integer (a word mask, shift, threshold or
    bound), the others values of ``value_dtype``, the dtype the values are computed in;
    ``dtype`` is the result's. Made by the cached ``*_draw`` functions below, which check the
    parameters once per distinct set, so a repeated draw (every op of portable mode) pays no
    checks.
    """

    name: str
    dtype: torch.dtype
    value_dtype: torch.dtype
    params: tuple[float | int, ...] = ()

    @property
    def transform(self) -> _k.Transform:
        return _k.TRANSFORMS[self.name]

    @property
    def param_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.int64,) + (self.value_dtype,) * (len(self.params) - 1)

    def _kernel_arguments(self) -> _triton.Arguments:
        """The Triton kernels' arguments for this draw (imports Triton on first use)."""
        return _triton.arguments(self.name, self.params, self.value_dtype)

    kernel_arguments = _Once(_kernel_arguments)  # draws are made once per set (cached); a launch asks every time


BITS = Draw("random_bits", torch.int64, torch.int64)
"""The raw words: what :func:`~hyperrng.philox.random_bits` draws."""


def uniform_draw(dtype: object, low: object, high: object) -> Draw:
    """:func:`~hyperrng.philox.uniform`'s draw, its parameters checked (that function's errors)."""
    checked = _check_dtype(dtype, _UNIFORM_BITS, "uniform")
    return _uniform_draw(checked, _check_real(low, "low"), _check_real(high, "high"))


@functools.lru_cache(maxsize=256)
def _uniform_draw(dtype: torch.dtype, low: float, high: float) -> Draw:
    _check_finite(low=low, high=high)
    if low > high:
        raise InvalidArgumentError(f"low must be <= high, got low={low} and high={high}.")
    compute = _compute_dtype(dtype)
    for name, value in (("low", low), ("high", high)):
        if not _finite_in(value, dtype):
            raise InvalidArgumentError(
                f"{name}={value} is outside the finite range of {dtype} (|x| <= {torch.finfo(dtype).max:g}); "
                f"narrow the bounds or use a wider dtype."
            )
    span = high - low
    if not _finite_in(span, compute):
        raise InvalidArgumentError(
            f"high - low = {span} overflows {compute}, the precision uniform computes in; narrow the bounds."
        )
    keep = (_PROBABILITY_SCALE - 1) & ~((1 << (_WORD_BITS - _UNIFORM_BITS[dtype])) - 1)  # the top bits of a word
    # The parameters as the compute dtype holds them: what both backends multiply and add.
    span_c, low_c = (float(torch.tensor(v, dtype=torch.float64).to(compute)) for v in (span, low))
    return Draw("uniform", dtype, compute, (keep, _WORD_UNIT, span_c, low_c))


def bernoulli_draw(p: object, dtype: object = torch.bool) -> Draw:
    """:func:`~hyperrng.philox.bernoulli`'s draw, its parameters checked (that function's errors)."""
    threshold = round(check_probability(p) * _PROBABILITY_SCALE)  # p * 2**32 is exact: only this rounding is lossy
    return _bernoulli_draw(threshold, _check_dtype(dtype, _BERNOULLI_DTYPES, "bernoulli"))


@functools.lru_cache(maxsize=256)
def _bernoulli_draw(threshold: int, dtype: torch.dtype) -> Draw:
    return Draw("bernoulli", dtype, torch.bool, (threshold,))


def normal_draw(dtype: object, mean: object, std: object) -> Draw:
    """:func:`~hyperrng.philox.normal`'s draw, its parameters checked (that function's errors)."""
    checked = _check_dtype(dtype, _NORMAL_BITS, "normal")
    return _normal_draw(checked, _check_real(mean, "mean"), _check_real(std, "std"))


@functools.lru_cache(maxsize=256)
def _normal_draw(dtype: torch.dtype, mean: float, std: float) -> Draw:
    _check_finite(mean=mean, std=std)
    if std < 0:
        raise InvalidArgumentError(f"std must be >= 0, got {std}.")
    bits = _NORMAL_BITS[dtype]
    z_max = math.sqrt(-2.0 * math.log(2.0**-bits))  # |z| of the smallest u1, 2**-bits
    if abs(mean) + z_max * std > torch.finfo(dtype).max:
        raise InvalidArgumentError(
            f"mean={mean} and std={std} can give samples up to mean ± {z_max:.2f} * std, beyond "
            f"the finite range of {dtype} (|x| <= {torch.finfo(dtype).max:g}); use a wider dtype or smaller values."
        )
    compute = _compute_dtype(dtype)
    as_compute = [float(torch.tensor(v, dtype=torch.float64).to(compute)) for v in (2.0 * math.pi, std, mean)]
    return Draw("normal", dtype, compute, (_WORD_BITS - bits, 2.0**-bits, *as_compute))


def randint_draw(low: object, high: object, dtype: object = torch.int64) -> Draw:
    """:func:`~hyperrng.philox.randint`'s draw, its parameters checked (that function's errors)."""
    low_value, high_value = check_int(low, "low"), check_int(high, "high")
    if not isinstance(dtype, torch.dtype):
        raise ArgumentTypeError(f"dtype must be a torch.dtype such as torch.int64, got {type(dtype).__name__}.")
    return _randint_draw(low_value, high_value, dtype)


@functools.lru_cache(maxsize=256)
def _randint_draw(low: int, high: int, dtype: torch.dtype) -> Draw:
    span = high - low
    if not 1 <= span <= _PROBABILITY_SCALE:
        raise InvalidArgumentError(
            f"randint: the range [{low}, {high}) holds {span} values; it must hold 1 to 2**32 (one 32-bit word each)."
        )
    if dtype == torch.bool:
        limits: tuple[float, float] = (0, 1)
    elif dtype.is_floating_point:
        limits = (-torch.finfo(dtype).max, torch.finfo(dtype).max)
    elif dtype.is_complex:
        raise ArgumentTypeError(f"randint draws real numbers; got dtype {dtype}.")
    else:
        limits = (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
    if low < limits[0] or high - 1 > limits[1]:
        raise InvalidArgumentError(f"randint: the range [{low}, {high}) does not fit {dtype}.")
    top = 2**64 if dtype == torch.uint64 else 2**63  # the values int64 arithmetic gives, modulo 2**64
    if low < -(2**63) or high > top:
        raise InvalidArgumentError(
            f"randint: the range [{low}, {high}) passes the 64-bit integers its values are computed in "
            f"(low + word % span); draw within [-2**63, {'2**64' if top == 2**64 else '2**63'}) and add an offset."
        )
    # A uint64 bound from 2**63 on, as the int64 of the same 64 bits: the sum wraps to the value's bits.
    return Draw("randint", dtype, torch.int64, (low - 2**64 if low >= 2**63 else low, span))


def dropout_draw(p: float, dtype: torch.dtype) -> Draw:
    """The fused dropout's draw for a checked ``0 < p < 1`` and ``x``'s floating ``dtype``: the keep
    threshold and the scale ``1 / (1 - p)`` as torch rounds it to ``dtype``."""
    return _dropout_draw(round((1.0 - p) * _PROBABILITY_SCALE), p, dtype)


@functools.lru_cache(maxsize=256)
def _dropout_draw(threshold: int, p: float, dtype: torch.dtype) -> Draw:
    scale = float(torch.ones((), dtype=dtype).div_(1.0 - p))  # torch's mask scale: 1 / (1 - p) in dtype
    return Draw("dropout", dtype, _compute_dtype(dtype), (threshold, scale))


def run(
    draw: Draw,
    geometry: _shards.ShardGeometry,
    key: int,
    offset: int,
    device: torch.device,
    compiled: bool,
    out: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """Draw ``draw``'s values for the block ``geometry`` at ``(key, offset)`` with ``backend``
    (``"torch"`` or ``"triton"``, resolved), into ``out`` if given. Nothing is checked: this is
    the path of callers that checked everything once (portable mode's ops)."""
    if backend == "triton":
        target = torch.empty(geometry.local_shape, dtype=draw.dtype, device=device) if out is None else out
        return _triton.fill(draw.kernel_arguments, geometry, key, offset, target)
    if not compiled and device.type == "cpu" and geometry.segments == 1:
        numel = math.prod(geometry.local_shape)
        if 0 < numel and _k.host_fill_serves(draw.transform, draw.dtype, numel, out):  # in a few steps
            target = torch.empty(geometry.local_shape, dtype=draw.dtype) if out is None else out
            _k.fill_host(draw.transform, draw.params, draw.param_dtypes, key, offset + geometry.first, target)
            return target
    kernel = _k.Kernel(draw.transform, draw.params, draw.param_dtypes, key, device, compiled, draw.value_dtype)
    if out is not None and not out.is_contiguous():
        return out.copy_(_shards.fill(geometry, offset, kernel, draw.dtype))
    return _shards.fill(geometry, offset, kernel, draw.dtype, out=out)
