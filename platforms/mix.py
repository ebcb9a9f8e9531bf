"""A stable 64-bit mixing function (SplitMix64's finaliser).

Used wherever a platform or the RNG layer must turn several integers into one seed that
is the same on every machine, Python version and run (``hash()`` is salted per process,
so it cannot be used). SplitMix64's finaliser is a bijection on 64-bit integers with full
avalanche: flipping one input bit flips each output bit with probability ~1/2.
"""

from __future__ import annotations

__all__ = ["mix64", "combine64"]

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64 increment: 2**64 / golden ratio, odd
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def mix64(value: int) -> int:
    """Return SplitMix64's finaliser of ``value`` (taken modulo 2**64): a 64-bit bijection."""
    z = value & _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)


def combine64(*values: int) -> int:
    """Fold a sequence of integers into one well-mixed 64-bit integer.

    The result depends on every value and on their order. Each step adds the golden
    gamma before mixing so that runs of zeros do not cancel.
    """
    acc = 0
    for v in values:
        acc = mix64((acc ^ (v & _MASK64)) + _GOLDEN_GAMMA)
    return acc
