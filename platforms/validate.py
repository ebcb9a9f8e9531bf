"""Argument checks shared by every platform: validate first, then touch the device."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch
from hyperrng.platforms.errors import ArgumentTypeError, InvalidArgumentError

__all__ = [
    "MAX_SEED",
    "MAX_OFFSET",
    "OFFSET_ALIGN",
    "round_up_offset",
    "check_int",
    "check_instance",
    "check_seed",
    "check_offset",
    "check_state",
    "check_state_offset",
    "check_index",
    "error_gist",
]

MAX_SEED = 2**64 - 1
"""Largest seed a torch generator accepts (seeds are unsigned 64-bit)."""

MAX_OFFSET = 2**63 - 1
"""Largest offset a counter-based state can hold (CUDA/NPU store it as int64)."""

OFFSET_ALIGN = 4
"""Philox draws 4 numbers per counter; CUDA and NPU keep offsets multiples of 4."""


def error_gist(exc: BaseException, limit: int = 200) -> str:
    """``"Type: first line"`` of an exception raised by code hyperrng does not own, for a typed error's message."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else "no message"
    return f"{type(exc).__name__}: {line if len(line) <= limit else line[: limit - 3] + '...'}"


def round_up_offset(n: int) -> int:
    """``n`` rounded up to the next multiple of :data:`OFFSET_ALIGN` (whole Philox blocks)."""
    return -(-n // OFFSET_ALIGN) * OFFSET_ALIGN


def check_int(value: object, what: str) -> int:
    """Return ``value`` as an int, else raise :class:`ArgumentTypeError` naming ``what``.

    Python and NumPy integers (anything with ``__index__``) are accepted; bools, floats
    (even integral ones such as ``7.0``), strings and ``None`` are refused, never truncated.
    """
    if type(value) is int:
        return value
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise ArgumentTypeError(f"{what} must be an int, got the bool {value!r}; pass an integer such as 1234.")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except Exception:  # TypeError, or what a tensor raises (a meta tensor has no value to read)
        raise ArgumentTypeError(
            f"{what} must be an int, got {type(value).__name__} {value!r:.80}; pass a Python or NumPy integer."
        ) from None


def check_instance(value: object, types: type | tuple[type, ...], what: str) -> Any:
    """Return ``value`` if it is an instance of ``types``, else raise :class:`ArgumentTypeError` naming ``what``."""
    allowed = types if isinstance(types, tuple) else (types,)
    if isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed):
        return value
    names = " or ".join(t.__name__ for t in allowed)
    raise ArgumentTypeError(f"{what} must be a {names}, got {type(value).__name__} {value!r:.60}.")


def check_seed(seed: object, what: str = "seed") -> int:
    """Return ``seed`` as an int in ``[0, 2**64 - 1]`` or raise :class:`InvalidArgumentError`."""
    if type(seed) is int and 0 <= seed <= MAX_SEED:  # the common case, checked cheaply (forks are hot)
        return seed
    value = check_int(seed, what)
    if not 0 <= value <= MAX_SEED:
        raise InvalidArgumentError(
            f"{what} must be in [0, 2**64 - 1], got {value}; reduce it modulo 2**64 if you mean a 64-bit pattern."
        )
    return value


def check_offset(offset: object, what: str = "offset") -> int:
    """Return ``offset`` as a non-negative multiple of 4 or raise :class:`InvalidArgumentError`."""
    if type(offset) is int and 0 <= offset <= MAX_OFFSET and not offset % OFFSET_ALIGN:
        return offset
    value = check_int(offset, what)
    if not 0 <= value <= MAX_OFFSET:
        raise InvalidArgumentError(f"{what} must be in [0, 2**63 - 1], got {value}.")
    if value % OFFSET_ALIGN:
        raise InvalidArgumentError(
            f"{what} must be a multiple of {OFFSET_ALIGN} (Philox draws 4 values per counter), got {value}; "
            f"round it up to {value + OFFSET_ALIGN - value % OFFSET_ALIGN}."
        )
    return value


def check_state(state: object, nbytes: int, platform: str) -> torch.Tensor:
    """Return ``state`` (made contiguous) if it is a 1-D CPU ``torch.uint8`` tensor of ``nbytes`` bytes, else raise.

    Raises:
        ArgumentTypeError: ``state`` is not a tensor.
        InvalidArgumentError: a tensor of another dtype, shape, size or device.
    """
    expected = f"a 1-D torch.uint8 CPU tensor of {nbytes} bytes, as returned by get_rng_state()"
    if not isinstance(state, torch.Tensor):
        raise ArgumentTypeError(f"RNG state for platform {platform!r} must be {expected}; got {type(state).__name__}.")
    if state.dtype != torch.uint8 or state.device.type != "cpu" or state.dim() != 1 or state.numel() != nbytes:
        raise InvalidArgumentError(
            f"RNG state for platform {platform!r} must be {expected}; got a {state.dtype} tensor of shape "
            f"{tuple(state.shape)} on {state.device}."
        )
    return state.contiguous()


def check_state_offset(offset: int, what: str, source: str = "get_rng_state()") -> int:
    """Return the offset read from a state if a generator can hold it, else raise :class:`InvalidArgumentError`.

    ``what`` opens the message and is followed by the offset ("RNG state for platform
    'sim' has offset"); ``source`` names what returns valid states.
    """
    if offset < 0 or offset % OFFSET_ALIGN:
        raise InvalidArgumentError(
            f"{what} {offset}; offsets are non-negative multiples of {OFFSET_ALIGN}. "
            f"Pass a state returned by {source}, unmodified."
        )
    return offset


def check_index(index: object, count: int, platform: str) -> int:
    """Return ``index`` if it names one of ``count`` devices, else raise :class:`InvalidArgumentError`."""
    value = check_int(index, "device index")
    if not 0 <= value < count:
        raise InvalidArgumentError(
            f"device index {value} is out of range for platform {platform!r}, which has {count} device(s); "
            f"use an index in [0, {count - 1}]."
            if count
            else f"platform {platform!r} has no devices."
        )
    return value
