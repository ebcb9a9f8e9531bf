"""Sharded tensors: where each shard's numbers start, and the tracker that positions a generator there.

:mod:`~hyperrng.sharding.offsets` is the pure offset math (no process group: any mesh can be tested on
one machine); :mod:`~hyperrng.sharding.tracker` is DTensor's RNG tracker over it; ``_regions`` positions a
generator around one op, ``_local_tensor`` serves torch's single-process LocalTensor mode, and
``_offset_sums`` holds the closed-form sums the offsets need.

The offset functions are importable from here, as they were when this was one module.
"""

from hyperrng.sharding.offsets import *  # noqa: F403 -- the offset math, as hyperrng.sharding exported it
from hyperrng.sharding.offsets import __all__ as __all__
