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

import torch

from platforms._mix import combine64
from platforms._validate import check_offset, check_seed
from platforms.base import Platform

__all__ = ["CPUPlatform", "MT19937_STATE_NBYTES"]

MT19937_STATE_NBYTES = 5056
"""Size of torch's CPU generator state (MT19937 words plus normal-sampling caches)."""

_CPU_POSITION_DOMAIN = 0x43505530  # "CPU0": keeps modelled seeds apart from other mixes


class CPUPlatform(Platform):
    """The host CPU, drawing from ``torch.default_generator``."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    counter_based = False
    state_nbytes = MT19937_STATE_NBYTES

    def __init__(self) -> None:
        # (seed, offset, the MT19937 seed that pair mapped to): lets get_seed_offset tell
        # whether the generator still sits where set_seed_offset put it.
        self._position: tuple[int, int, int] | None = None

    def device_count(self) -> int:
        return 1

    def default_generator(self, index: int | None = None) -> torch.Generator:
        self._index(index)
        return torch.default_generator

    def get_seed_offset(self, index: int | None = None) -> tuple[int, int]:
        """Return the modelled (seed, offset); ``(initial_seed, 0)`` after a plain reseed."""
        self._index(index)
        current = torch.default_generator.initial_seed()
        if self._position is not None and self._position[2] == current:
            return self._position[0], self._position[1]
        return current, 0

    def set_seed_offset(self, seed: int, offset: int, index: int | None = None) -> None:
        """Seed MT19937 from (seed, offset); see the module docstring for the guarantees."""
        s, o = check_seed(seed), check_offset(offset)
        self._index(index)
        mt_seed = s if o == 0 else combine64(_CPU_POSITION_DOMAIN, s, o)
        torch.default_generator.manual_seed(mt_seed)
        self._position = (s, o, mt_seed)

    def _read_state(self, index: int) -> torch.Tensor:
        return torch.default_generator.get_state()

    def _write_state(self, state: torch.Tensor, index: int) -> None:
        torch.default_generator.set_state(state)

    def _seed(self, seed: int, index: int) -> None:
        torch.default_generator.manual_seed(seed)
