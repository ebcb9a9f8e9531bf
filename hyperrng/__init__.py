"""hyperrng: random-number state across devices and ranks for PyTorch training.

Every random op of a model split over devices must draw the same numbers where ranks hold
replicas, different ones where they hold shards, the same ones again on recompute and
after a resume. hyperrng does that once, on the CPU, CUDA, an Ascend NPU or a device you
plug in. Everything below is importable from ``hyperrng`` itself (``__all__`` lists it):

* **Streams**: ``get_rng_tracker()`` (``RNGStatesTracker``, Megatron-core's and
  TransformerEngine's ``tracker.fork(name)``), ``fork_rng``; graph-safe trackers and
  ``tracker.register_graph(graph)`` for CUDA graphs.
* **Seeding**: ``StreamLayout`` and ``apply_layout`` (collision-free stream seeds from mesh
  coordinates), and the published recipes (``megatron_model_parallel_manual_seed``,
  ``set_random_seed``, ``set_seeds``, ...).
* **Sharded tensors**: ``ShardedRNGTracker`` (DTensor's RNG tracker, ``distribute_region``),
  ``rng_offsets``.
* **Across ranks**: ``verify_rng_sync``; checkpoints with ``rng_state_dict`` /
  ``load_rng_state_dict``, ``save_rng_state`` / ``load_rng_state`` and ``RNGStateful``.
* **Recompute**: ``checkpoint(fn, *args)``, and ``checkpoint_context`` as
  ``torch.utils.checkpoint``'s ``context_fn``.
* **Megatron-core's names**: :mod:`hyperrng.megatron` (``from hyperrng import megatron as
  tensor_parallel``).
* **Portable mode**: ``portable_random(seed)``, where torch's own random ops draw Philox
  numbers that are the same on every device and mesh (:mod:`hyperrng.portable.mode`); explicit-key
  draws in :mod:`hyperrng.philox`.
* **Errors**: one class per kind of answer, under ``HyperRNGError`` (:mod:`hyperrng.errors`).
* **Hardware**: ``current_platform()`` and :mod:`hyperrng.platforms`, whose docstring is
  the guide to plugging in a device.

Importing hyperrng resolves the hardware platform once (see :mod:`hyperrng.platforms.registry`):
``HYPERRNG_PLATFORM`` if set, else an available plug-in, else NPU, CUDA, CPU. The
resolution touches no device. :func:`current_platform` returns the result, or raises the
error that kept every platform from being selected (an unknown or unusable
``HYPERRNG_PLATFORM``, two plug-ins claiming the machine); so does every call that needs it.
The ``hyperrng`` command (``hyperrng demo``, ``info``, ``bench``) is :mod:`hyperrng.cli`.
Submodules whose names start with ``_`` are internal.
"""

from __future__ import annotations

import contextlib as _contextlib
import sys as _sys

import hyperrng.errors as _errors
from hyperrng import platforms
from hyperrng.errors import *  # noqa: F403 -- the error classes, exported by __all__ += _errors.__all__
from hyperrng.platforms import Platform

__version__ = "0.1.0"


# Resolve the platform once, now: HYPERRNG_PLATFORM, plug-ins, NPU, CUDA, CPU. When none can
# be selected (HYPERRNG_PLATFORM names an unknown or unusable platform, or two plug-ins claim
# the machine) the import still succeeds, and every call that needs the platform, starting with
# ``current_platform()``, raises that error. The import cannot tell a program from the
# ``hyperrng`` command (``python -m hyperrng`` imports this package before its own code runs),
# and the command must be able to report the error: ``hyperrng info`` with every probe, the
# other commands in one line.
with _contextlib.suppress(_errors.PlatformError):
    platforms.registry.select_at_import()

from hyperrng.portable.mode import is_portable_random_enabled, portable_random, set_portable_random  # noqa: E402
from hyperrng.resume.state import (  # noqa: E402
    RNGResumeWarning,
    RNGStateful,
    load_rng_state,
    load_rng_state_dict,
    rng_state_dict,
    save_rng_state,
)
from hyperrng.seeding.layout import DEFAULT_STREAM, StreamLayout, apply_layout, mesh_coordinates  # noqa: E402
from hyperrng.seeding.recipes import (  # noqa: E402
    MegatronSeeds,
    is_random_seed_set,
    megatron_model_parallel_manual_seed,
    megatron_seeds,
    megatron_set_random_seed,
    model_parallel_cuda_manual_seed,
    model_parallel_manual_seed,
    seed_host,
    set_random_seed,
    set_seeds,
)
from hyperrng.sharding.offsets import rng_offsets  # noqa: E402
from hyperrng.sharding.tracker import MeshInfo, ShardedRNGTracker  # noqa: E402
from hyperrng.streams.fork import fork_rng  # noqa: E402
from hyperrng.streams.recompute import checkpoint, checkpoint_context  # noqa: E402
from hyperrng.streams.tracker import (  # noqa: E402
    DATA_PARALLEL_STREAM,
    EXPERT_PARALLEL_STREAM,
    MODEL_PARALLEL_STREAM,
    CudaRNGStatesTracker,
    RNGStatesTracker,
    RNGTrackerProtocol,
    get_cuda_rng_tracker,
    get_rng_tracker,
    set_rng_tracker,
)
from hyperrng.verify import verify_rng_sync  # noqa: E402


def current_platform() -> Platform:
    """The platform hyperrng uses now (resolved at import; see ``hyperrng.platforms.use`` to override)."""
    return platforms.current()


__all__ = [
    "__version__",
    "current_platform",
    "Platform",
    # streams
    "RNGStatesTracker",
    "CudaRNGStatesTracker",
    "RNGTrackerProtocol",
    "get_rng_tracker",
    "get_cuda_rng_tracker",
    "set_rng_tracker",
    "MODEL_PARALLEL_STREAM",
    "DATA_PARALLEL_STREAM",
    "EXPERT_PARALLEL_STREAM",
    "DEFAULT_STREAM",
    "fork_rng",
    # seeding and layout
    "StreamLayout",
    "apply_layout",
    "mesh_coordinates",
    "seed_host",
    "set_random_seed",
    "model_parallel_manual_seed",
    "model_parallel_cuda_manual_seed",
    "is_random_seed_set",
    "MegatronSeeds",
    "megatron_seeds",
    "megatron_model_parallel_manual_seed",
    "megatron_set_random_seed",
    "set_seeds",
    # sharded tensors
    "rng_offsets",
    "MeshInfo",
    "ShardedRNGTracker",
    # across ranks
    "verify_rng_sync",
    "rng_state_dict",
    "load_rng_state_dict",
    "save_rng_state",
    "load_rng_state",
    "RNGStateful",
    "RNGResumeWarning",
    "checkpoint",
    "checkpoint_context",
    # portable mode
    "portable_random",
    "set_portable_random",
    "is_portable_random_enabled",
]
__all__ += _errors.__all__  # the error classes: one list, in hyperrng.platforms.errors

# The modules' paths before they moved into folders by concept: each old name is the moved module itself
# (one module object, so ``import hyperrng.tracker``, ``from hyperrng.philox.mode import ...`` and a pickle
# that names an old path keep working; ``help(hyperrng)`` lists the folders only). ``hyperrng.seeding`` and
# ``hyperrng.sharding`` became folders that export what the modules did.
_OLD_PATHS = {
    "hyperrng.tracker": "hyperrng.streams.tracker",
    "hyperrng.random": "hyperrng.streams.fork",
    "hyperrng.recompute": "hyperrng.streams.recompute",
    "hyperrng.layout": "hyperrng.seeding.layout",
    "hyperrng.sharded": "hyperrng.sharding.tracker",
    "hyperrng.state": "hyperrng.resume.state",
    "hyperrng.philox.mode": "hyperrng.portable.mode",
    "hyperrng.philox.position": "hyperrng.portable.position",
}
for _old, _new in _OLD_PATHS.items():
    _sys.modules[_old] = _sys.modules[_new]
    if _old.startswith("hyperrng.philox."):
        setattr(_sys.modules["hyperrng.philox"], _old.rpartition(".")[2], _sys.modules[_new])


def __getattr__(name: str) -> object:
    """``hyperrng.tracker`` and the other old module paths, as attributes: the moved modules."""
    new = _OLD_PATHS.get(f"hyperrng.{name}")
    if new is None:
        raise AttributeError(f"module 'hyperrng' has no attribute {name!r}")
    return _sys.modules[new]


del annotations, _contextlib, _errors, _old, _new  # names used above (and the __future__ import's), not the API
