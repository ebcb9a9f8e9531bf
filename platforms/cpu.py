"""The CPU platform: real, the default everywhere no accelerator is found.

torch's CPU generator is MT19937, whose 5056-byte state has no notion of an offset. The
(seed, offset) positioning that counter-based devices offer is therefore *modelled*:

* ``set_seed_offset(seed, 0)`` is exactly ``manual_seed(seed)``;
* ``set_seed_offset(seed, offset)`` with ``offset > 0`` seeds MT19937 with a stable
  64-bit mix of the pair, so equal pairs give equal streams on every rank and distinct
  pairs give distinct, statistically independent streams;
* ``get_seed_offset()`` returns the pair last set, as long as nobody reseeded the
  generator since; draws do not move the modelled offset.

What the model does *not* give: the stream at (seed, offset + k) is not the stream at
(seed, offset) advanced by k draws, as it is on CUDA/NPU. Code that needs numbers that
are identical across devices should use the portable Philox generator instead.
"""

from __future__ import annotations

import weakref

import torch

from platforms._mix import mix64
from platforms._validate import check_offset, check_seed
from platforms.base import Platform

__all__ = ["CPUPlatform", "MT19937_STATE_NBYTES", "position_seed"]

MT19937_STATE_NBYTES = 5056
"""Size of torch's CPU generator state (MT19937 words plus normal-sampling caches)."""

_CPU_POSITION_DOMAIN = 0x43505530  # "CPU0": keeps modelled seeds apart from other mixes
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # odd, so multiplying by it permutes 64-bit integers
_MASK64 = (1 << 64) - 1


def position_seed(seed: int, offset: int) -> int:
    """The MT19937 seed that models position (seed, offset): ``seed`` itself at offset 0."""
    # The offset is spread by an odd multiplier (a bijection mod 2**64), folded into the
    # seed and mixed once: for one seed, distinct offsets can never share an MT19937 seed.
    spread = ((offset ^ _CPU_POSITION_DOMAIN) * _GOLDEN_GAMMA) & _MASK64
    return seed if offset == 0 else mix64(seed ^ spread)


class CPUPlatform(Platform):
    """The host CPU, drawing from ``torch.default_generator``."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    counter_based = False
    state_nbytes = MT19937_STATE_NBYTES

    def __init__(self) -> None:
        # generator -> (seed, offset, the MT19937 seed that pair mapped to): lets
        # get_seed_offset tell whether a generator still sits where it was put.
        self._positions: weakref.WeakKeyDictionary[torch.Generator, tuple[int, int, int]] = weakref.WeakKeyDictionary()

    def device_count(self) -> int:
        return 1

    def default_generator(self, index: int | None = None) -> torch.Generator:
        self._index(index)
        return torch.default_generator

    def get_seed_offset(self, index: int | None = None, generator: torch.Generator | None = None) -> tuple[int, int]:
        """Return the modelled (seed, offset); ``(initial_seed, 0)`` after a plain reseed."""
        gen = self._target(index, generator)
        current = gen.initial_seed()
        position = self._positions.get(gen)
        if position is not None and position[2] == current:
            return position[0], position[1]
        return current, 0

    def set_seed_offset(
        self, seed: int, offset: int, index: int | None = None, generator: torch.Generator | None = None
    ) -> None:
        """Seed MT19937 from (seed, offset); see the module docstring for the guarantees."""
        s, o = check_seed(seed), check_offset(offset)
        gen = self._target(index, generator)
        mt_seed = position_seed(s, o)
        gen.manual_seed(mt_seed)
        self._positions[gen] = (s, o, mt_seed)

    def _target(self, index: int | None, generator: torch.Generator | None) -> torch.Generator:
        if index is not None:
            self._index(index)
        return torch.default_generator if generator is None else self._check_generator(generator)

    def _read_state(self, index: int) -> torch.Tensor:
        return torch.default_generator.get_state()

    def _write_state(self, state: torch.Tensor, index: int) -> None:
        torch.default_generator.set_state(state)

    def _seed(self, seed: int, index: int) -> None:
        torch.default_generator.manual_seed(seed)
