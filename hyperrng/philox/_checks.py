"""The argument checks of :mod:`hyperrng.philox`'s draws (and of portable attention's): each takes a
value as a caller passed it and returns it in the form the draws use, or raises a typed error before any
work, nothing allocated or computed: a wrong type or an unsupported dtype
:class:`~hyperrng.errors.ArgumentTypeError` (a ``TypeError``), a wrong value
:class:`~hyperrng.errors.InvalidArgumentError` (a ``ValueError``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection, Sequence

import numpy as np
import torch

from hyperrng.errors import ArgumentTypeError, InvalidArgumentError
from hyperrng.platforms.validate import check_int

_MAX_GLOBAL_NUMEL = 2**62
"""Global shapes stay below this so row-major indices fit int64 with room for the lane arithmetic."""

_MAX_DIMS = 64
"""The most dimensions a torch tensor has."""

# What torch raises for a device it cannot name or reach (AssertionError: a backend this build lacks).
_DEVICE_ERRORS = (RuntimeError, AssertionError, ValueError, TypeError, NotImplementedError)


def check_shape(shape: object) -> tuple[int, ...]:
    """``shape`` (an int or a sequence of ints) as a tuple, checked as every draw of :mod:`hyperrng.philox` checks it.

    Raises:
        ArgumentTypeError: ``shape`` is not an int or a sequence of ints (a ``str`` or ``bytes``
            is not one).
        InvalidArgumentError: more than 64 dimensions (torch's limit), a negative dimension, or
            ``2**62`` elements or more.
    """
    dims = (shape,) if isinstance(shape, int) and not isinstance(shape, bool) else shape
    if type(dims) is not tuple and (  # a tuple (every op's) skips the ABC check
        not isinstance(dims, Sequence) or isinstance(dims, (str, bytes, bytearray, memoryview))
    ):
        raise ArgumentTypeError(
            f"shape must be an int or a sequence of ints such as (4, 8), got {type(shape).__name__} {shape!r:.80}."
        )
    if len(dims) > _MAX_DIMS:
        raise InvalidArgumentError(
            f"shape has {len(dims)} dimensions, but a torch tensor has at most {_MAX_DIMS}; merge some of them."
        )
    result = tuple(check_int(d, "each shape dimension") for d in dims)
    if any(d < 0 for d in result):
        raise InvalidArgumentError(f"shape {result} has a negative dimension; every dimension must be >= 0.")
    if math.prod(result) >= _MAX_GLOBAL_NUMEL:
        raise InvalidArgumentError(
            f"shape {result} has 2**62 or more elements, more than the counter space indexes; "
            f"split it into tensors drawn with different keys."
        )
    return result


def _check_bool(value: object, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise ArgumentTypeError(f"{what} must be a bool (True or False), got {type(value).__name__} {value!r}.")


def _check_real(value: object, what: str) -> float:
    if type(value) is float and math.isfinite(value):  # the common case, without the abstract-class check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(
            f"{what} must be a real number (int or float), got {type(value).__name__} {value!r}; "
            f"pass a Python number, e.g. {what}=float(t) for a 0-d tensor t."
        )
    result = float(value)
    if not math.isfinite(result):
        raise InvalidArgumentError(f"{what} must be finite, got {result}.")
    return result


def _check_finite(**values: float) -> None:
    """Refuse a NaN or infinite parameter (floats already: portable mode's ops take them from the op's schema)."""
    for name, value in values.items():
        if not math.isfinite(value):
            raise InvalidArgumentError(f"{name} must be finite, got {value}.")


def check_probability(p: object) -> float:
    """``p`` as a float in ``[0, 1]``, checked as :func:`~hyperrng.philox.bernoulli` and
    :func:`~hyperrng.philox.dropout` check it.

    Raises:
        ArgumentTypeError: ``p`` is not a real number (bools included).
        InvalidArgumentError: ``p`` is outside ``[0, 1]`` or NaN.
    """
    if type(p) is float:  # dropout's and bernoulli_'s own case: no abstract-class check (microseconds a call)
        value = p
    elif isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise ArgumentTypeError(
            f"p must be a real number in [0, 1], got {type(p).__name__} {p!r}; pass a Python float such as 0.1."
        )
    else:
        value = float(p)
    if not 0.0 <= value <= 1.0:  # also refuses NaN, for which every comparison is False
        raise InvalidArgumentError(f"p must be a probability in [0, 1], got {value}.")
    return value


def _check_dtype(dtype: object, supported: Collection[torch.dtype], what: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in supported:
        return dtype
    names = ", ".join(str(d) for d in supported)
    if not isinstance(dtype, torch.dtype):
        raise ArgumentTypeError(
            f"dtype must be a torch.dtype such as torch.float32, got {type(dtype).__name__} {dtype!r}; "
            f"{what} supports {names}."
        )
    raise ArgumentTypeError(f"{what} supports dtypes {names}; got {dtype!r}.")


def _first_line(error: BaseException, limit: int = 160) -> str:
    """The gist of a torch error: its first line, shortened."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_device(device: object) -> torch.device:
    """``device`` as a torch.device that this process can allocate on, or a typed error."""
    if device is None:
        return torch.device("cpu")
    if isinstance(device, torch.device):
        target = device
    elif isinstance(device, str) or (isinstance(device, numbers.Integral) and not isinstance(device, bool)):
        try:
            target = torch.device(device)  # type: ignore[arg-type]
        except _DEVICE_ERRORS as error:
            raise InvalidArgumentError(
                f"device {device!r} is not a device torch knows ({_first_line(error)}); pass e.g. 'cpu' or 'cuda:0'."
            ) from None
    else:
        raise ArgumentTypeError(
            f"device must be a torch.device, a string such as 'cpu' or 'cuda:0', or None; "
            f"got {type(device).__name__} {device!r}."
        )
    if target.type == "cpu":  # always there, whatever its index
        return target
    try:
        torch.empty(0, device=target)  # names an available device: nothing else is touched first
    except _DEVICE_ERRORS as error:
        raise InvalidArgumentError(
            f"device {str(target)!r} is not available in this process ({_first_line(error)}); "
            f"pick one that is, e.g. 'cpu'."
        ) from None
    return target


def _overlapping(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether two elements of a tensor of ``shape`` and ``strides`` share a memory offset. Dims sorted by stride, each
    stride past what the smaller ones reach, cannot (every dense or permuted tensor, a slice of one); any other
    layout (an expanded dim, rows that overlap) is decided by listing the offsets."""
    if 0 in shape:
        return False  # no elements
    dims = [(st, n) for st, n in zip(strides, shape) if n > 1]
    if any(st == 0 for st, _ in dims) or math.prod(n for _, n in dims) > 1 + sum(st * (n - 1) for st, n in dims):
        return True  # an expanded dim, or more elements than offsets they can reach: no listing needed
    reach = 0
    for stride, size in sorted(dims):
        if stride <= reach:
            break
        reach += stride * (size - 1)
    else:
        return False
    offsets = torch.zeros((), dtype=torch.int64)
    for stride, size in zip(strides, shape):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    flat = offsets.reshape(-1)
    return bool(torch.unique(flat).numel() != flat.numel())


def _check_out(out: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``out`` if it can hold the result: a tensor of its shape, dtype and device whose elements do not
    overlap (any strides)."""
    if not isinstance(out, torch.Tensor):
        raise ArgumentTypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}.")
    if out.dtype != dtype:
        raise ArgumentTypeError(f"out has dtype {out.dtype} but the result is {dtype}.")
    if tuple(out.shape) != shape:
        raise InvalidArgumentError(f"out must have the result's shape {shape}, got shape {tuple(out.shape)}.")
    if _overlapping(out.shape, out.stride()):
        raise InvalidArgumentError(
            f"out has overlapping elements (shape {tuple(out.shape)}, strides {out.stride()}: two of its elements "
            "are one place in memory); pass a tensor that owns every element, e.g. out.clone()."
        )
    if out.device != device:
        raise InvalidArgumentError(f"out is on {out.device} but the result is drawn on {device}.")
    return out
