"""The CPU platform: real, the default everywhere no accelerator is found.

torch's CPU generator is MT19937, whose 5056-byte state has no notion of an offset.

**Seeds.** ``torch.manual_seed`` keeps only the low 32 bits of a seed (seeds 5 and
5 + 2**32 draw identical numbers), which would silently merge streams whose 64-bit seeds
differ only in their high bits. This platform's :meth:`CPUPlatform.manual_seed` keeps all
64: a seed below 2**32 gives exactly torch's stream; a larger one gives the word-wise sum
(mod 2**32) of the MT19937 states seeded with its high and its low word, a valid state
that differs from every other seed's.

**Positions.** The (seed, offset) positioning of counter-based devices is *modelled*:

* ``set_seed_offset(seed, 0)`` is exactly ``manual_seed(seed)``;
* ``set_seed_offset(seed, offset)`` with ``offset > 0`` seeds MT19937 with
  ``(M(seed) + offset / 4) mod 2**32``, ``M`` a stable 64-bit mix: equal pairs give equal
  streams on every rank, and two positive offsets of one seed below 2**34 never share a
  stream; any other two positions share one with probability about ``2**-32`` each;
* ``get_seed_offset()`` returns the pair the generator was last positioned at, also
  after its state bytes were saved and restored (the state carries the MT19937 seed,
  which maps back to the pair), until it is reseeded; draws do not move the modelled
  offset. :class:`hyperrng.sharded.ShardedRNGTracker` therefore leaves a one-block gap on
  this platform so that a shard never replays what plain draws at the region's base
  position drew.

What the model does *not* give: the stream at (seed, offset + k) is not the stream at
(seed, offset) advanced by k draws, as it is on CUDA/NPU. Code that needs numbers that
are identical across devices should use the portable Philox generator instead.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from platforms.base import Platform
from platforms.errors import InvalidStateError
from platforms.mix import mix64
from platforms.validate import OFFSET_ALIGN, check_offset, check_seed

__all__ = ["CPUPlatform", "MT19937_STATE_NBYTES", "position_seed", "seed_generator"]

MT19937_STATE_NBYTES = 5056
"""Size of torch's CPU generator state (MT19937 words plus normal-sampling caches)."""

_CPU_POSITION_DOMAIN = 0x43505530  # "CPU0": keeps modelled seeds apart from other mixes
_MASK32 = (1 << 32) - 1  # torch's MT19937 seeding reads only these bits
_POSITION_CACHE = 256  # seeds whose mix is kept: a run positions few distinct seeds
# Layout of torch's CPU state (CPUGeneratorImplState): uint64 initial seed, int32 left,
# int32 seeded, uint64 next, then the 624 MT19937 words, each widened to uint64.
_MT_WORDS_START = 24
_MT_WORDS_END = _MT_WORDS_START + 624 * 8


@functools.lru_cache(maxsize=_POSITION_CACHE)
def _position_base(seed: int) -> int:
    return mix64(seed ^ _CPU_POSITION_DOMAIN)


_POSITIONS: dict[int, tuple[int, int]] = {}
"""MT19937 seed -> the (seed, offset) it models, for every generator and platform instance
(the generators are process-wide too). Bounded: the oldest entries go first."""
_POSITIONS_KEPT = 1 << 16  # far more than the positions one training step sets and restores


def _remember(mt_seed: int, position: tuple[int, int]) -> None:
    _POSITIONS[mt_seed] = position
    if len(_POSITIONS) > _POSITIONS_KEPT:
        del _POSITIONS[next(iter(_POSITIONS))]


_SCRATCH = torch.Generator()  # validates states by trying them; its own numbers are never used


def position_seed(seed: int, offset: int) -> int:
    """The MT19937 seed that models position (seed, offset): ``seed`` itself at offset 0.

    Other offsets count up from a mix of the seed, one per block of 4, in torch's 32-bit
    seed space: injective in positive offsets below 2**34, so the shards of one op never
    share a stream.
    """
    if offset == 0:
        return seed
    return (_position_base(seed) + offset // OFFSET_ALIGN) & _MASK32


def seed_generator(gen: torch.Generator, seed: int) -> None:
    """Seed a CPU generator with all 64 bits of ``seed`` (see the module docstring)."""
    if seed <= _MASK32:
        gen.manual_seed(seed)
        return
    gen.manual_seed(seed >> 32)
    high = gen.get_state().numpy()
    gen.manual_seed(seed & _MASK32)
    state = gen.get_state()
    raw = state.numpy()  # shares memory with ``state``
    words = raw[_MT_WORDS_START:_MT_WORDS_END].view(np.uint64)
    # Word-wise sum mod 2**32 (not XOR, which would cancel to the degenerate all-zero
    # state when the two words of the seed are equal).
    words += high[_MT_WORDS_START:_MT_WORDS_END].view(np.uint64)
    words &= _MASK32
    raw[:8] = np.frombuffer(seed.to_bytes(8, "little"), dtype=np.uint8)  # what initial_seed() reports
    gen.set_state(state)


class CPUPlatform(Platform):
    """The host CPU, drawing from ``torch.default_generator``."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    counter_based = False
    state_nbytes = MT19937_STATE_NBYTES

    def device_count(self) -> int:
        return 1

    def default_generator(self, index: int | None = None) -> torch.Generator:
        self._index(index)
        return torch.default_generator

    def get_seed_offset(self, index: int | None = None, generator: torch.Generator | None = None) -> tuple[int, int]:
        """Return the modelled (seed, offset); ``(initial_seed, 0)`` after a plain reseed.

        The pair is found from the MT19937 seed the generator's state carries, so it
        survives a save and restore of the state bytes (forks, recompute, checkpoints).
        """
        current = self._target(index, generator).initial_seed()
        return _POSITIONS.get(current) or (current, 0)

    def set_seed_offset(
        self, seed: int, offset: int, index: int | None = None, generator: torch.Generator | None = None
    ) -> None:
        """Seed MT19937 from (seed, offset); see the module docstring for the guarantees."""
        s, o = check_seed(seed), check_offset(offset)
        gen = self._target(index, generator)
        mt_seed = position_seed(s, o)
        seed_generator(gen, mt_seed)
        if o:
            _remember(mt_seed, (s, o))

    def check_rng_state(self, state: torch.Tensor) -> torch.Tensor:
        """Also try ``state`` on a scratch generator: MT19937 refuses some byte patterns."""
        checked = super().check_rng_state(state)
        try:
            _SCRATCH.set_state(checked)
        except RuntimeError as exc:
            raise InvalidStateError(
                f"RNG state for platform {self.name!r} is not a valid MT19937 state ({exc}); "
                "pass a state returned by get_rng_state()."
            ) from None
        return checked

    def _target(self, index: int | None, generator: torch.Generator | None) -> torch.Generator:
        if index is not None:
            self._index(index)
        return torch.default_generator if generator is None else self._check_generator(generator)

    def _read_state(self, index: int) -> torch.Tensor:
        return torch.default_generator.get_state()

    def _write_state(self, state: torch.Tensor, index: int) -> None:
        torch.default_generator.set_state(state)

    def _seed(self, seed: int, index: int) -> None:
        seed_generator(torch.default_generator, seed)
