"""hyperrng's hardware layer: one small :class:`Platform` interface, one implementation per device kind.

Importing this package has no side effects: it resolves nothing and touches no device,
so a plug-in can ``from hyperrng.platforms import Platform`` without an import cycle. The
platform in use is resolved once by ``import hyperrng`` (or lazily by :func:`current`).

**Trust: what runs code at import.** Resolving the platform runs code that the environment
names, in two ways only (``import torch`` alone runs neither):

* ``HYPERRNG_PLATFORM=package.module:Factory`` imports ``package.module`` and calls
  ``Factory`` (and its ``probe()``), whoever set the variable;
* while ``HYPERRNG_PLATFORM`` is unset, every entry point of the group
  ``hyperrng.platforms`` declared by a distribution on ``sys.path`` is loaded (its module
  imported) and its factory and ``probe()`` called: installed packages, and a
  ``*.dist-info`` folder in the current directory when Python puts that directory on
  ``sys.path`` (``python -c``, ``python -m``, an interactive session).

A plain ``HYPERRNG_PLATFORM`` name loads only the plug-in registered under that name, and a
built-in name (``cpu``, ``cuda``, ``npu``, ``sim``) loads none: set one to rule plug-ins out
where the directory or the environment is not yours. Nothing else runs foreign code: RNG
checkpoints are read with ``weights_only=True`` (plain data, no code).

**Writing a plug-in.** What a plug-in author needs to know beyond the example in docs/plugins.md:

* **The interface** is the table in :class:`Platform`'s docstring (``help(Platform)``):
  fifteen members, each marked *must define* or *may override*. A class missing a
  required one (``device_count()``, ``_read_state(index)``, ``_write_state(state, index)``)
  is refused with :class:`PlatformError`; ``probe()`` (``None`` if usable, else a non-empty
  string saying why; anything else is reported as invalid) must be cheap and must not
  initialise the device. :class:`DeviceModulePlatform` has them all, for a device module
  shaped like ``torch.cuda``.
* **``counter_based = True``:** the state is the 16-byte (uint64 seed, int64 offset) pair
  and draws advance the offset; the inherited ``get_seed_offset`` / ``set_seed_offset``
  use it, ``set_rng_state`` refuses offsets that are negative or not multiples of 4, forks
  copy the generator's state directly, and portable mode accepts the device's ``generator=``.
* **Otherwise** override ``check_rng_state``, ``get_seed_offset`` and ``set_seed_offset``
  (and set ``_state_nbytes`` if a state is not 16 bytes). A position is a pure function
  of (seed, offset): equal pairs draw equal numbers on every rank, distinct pairs
  independent ones, ``(seed, 0)`` is ``manual_seed(seed)``; the getter reads back the pair
  just set; ``get_rng_state()`` carries it (the CPU platform, :mod:`hyperrng.platforms.cpu`,
  is the worked example for a generator that is not counter-based). Only sharded regions
  (and DTensor ops), :mod:`hyperrng.portable.position` and portable mode need positions; streams,
  seeding, checks and checkpoints need state bytes only.
* **``dist_backend``:** the process-group backend when each rank has its own device (the
  demo uses it); collectives stage tensors through the host on gloo. A ``device_type`` of
  ``"cpu"`` means the device is the host: its generator is torch's CPU generator.
* **Factory:** any no-argument callable returning a :class:`Platform`. In
  ``HYPERRNG_PLATFORM=module:Factory`` or an entry point, the module must be importable in
  every process (torchrun's and the demo's ranks import it again).
* **Names:** selection uses the registered name (:func:`register`'s or the entry
  point's); ``Platform.name`` is what ``hyperrng info`` shows and checkpoints record, and a
  checkpoint is refused on a platform of another name. Keep them equal.
* **An installed entry-point plug-in** is probed by every ``import hyperrng`` in that
  environment and, unless ``HYPERRNG_PLATFORM`` is set, wins over CUDA and the CPU when
  its probe says yes. So the probe should encode intent (device present, or an opt-in
  variable set), not "my package imports".
* **Meshes:** ``distribute_region`` takes a ``DeviceMesh`` (any object with ``shape`` and
  ``get_coordinate()``), a ``hyperrng.MeshInfo(shape, coordinate)`` or a tuple
  ``(shape, coordinate)``, and DTensor placements (``Shard``, ``_StridedShard``,
  ``Replicate``, ``Partial``).
* **The conformance kit** (:mod:`hyperrng.platforms.testing`) runs single-process checks
  of states, seeding, positions, bad input and device indexing, and draws on the device:
  after ``set_rng_state(s)`` torch's random ops must draw the same numbers every time,
  other states other numbers, and a swapped-in state must not move the restored one (a
  plug-in keeping its state in a dict fails). It draws only where torch's ops on the
  device draw from the platform's generators (not for a stand-in module over another
  backend's device type). Any failure, an exception included, comes out as an
  ``AssertionError`` naming the check (``reads_and_restores_its_state`` where reading the
  states before a check, or writing them back after it, fails). It does not check how far
  a draw advances a position, collectives in a process group, ``dist_backend``, a cheap
  ``probe()``, threads, graph-safe swaps or graph capture.
* **Selection checks the state:** a platform whose own ``_read_state`` returns anything but
  a 1-D CPU ``uint8`` tensor of ``_state_nbytes`` is reported unavailable, with the reason
  (``hyperrng info``), and ``set_current`` refuses it.
"""

from __future__ import annotations

from hyperrng.platforms import comm
from hyperrng.platforms import errors as _errors
from hyperrng.platforms.base import COUNTER_STATE_NBYTES, Platform, StateIO, pack_counter_state, unpack_counter_state
from hyperrng.platforms.cpu import (
    CPU_STATE_NBYTES,
    MT19937_STATE_NBYTES,
    POSITIONS_KEPT,
    CPUPlatform,
    seed_generator,
    seeds_all_64_bits,
)
from hyperrng.platforms.device_module import CUDAPlatform, DeviceModulePlatform, NPUPlatform
from hyperrng.platforms.errors import *  # noqa: F403 -- the error classes, exported by __all__ += _errors.__all__
from hyperrng.platforms.registry import (
    AUTO_ORDER,
    ENTRY_POINT_GROUP,
    ENV_VAR,
    ProbeResult,
    Selection,
    current,
    load,
    register,
    registered,
    select,
    selection,
    set_current,
    use,
)
from hyperrng.platforms.simulated import (
    SIM_DEVICE_TYPE,
    SimulatedDeviceModule,
    SimulatedGenerator,
    SimulatedPlatform,
    simulated_backend,
)

__all__ = [
    "Platform",
    "comm",
    "StateIO",
    "CPUPlatform",
    "DeviceModulePlatform",
    "CUDAPlatform",
    "NPUPlatform",
    "SimulatedPlatform",
    "SimulatedDeviceModule",
    "SimulatedGenerator",
    "COUNTER_STATE_NBYTES",
    "MT19937_STATE_NBYTES",
    "CPU_STATE_NBYTES",
    "SIM_DEVICE_TYPE",
    "POSITIONS_KEPT",
    "seed_generator",
    "seeds_all_64_bits",
    "simulated_backend",
    "pack_counter_state",
    "unpack_counter_state",
    "ENV_VAR",
    "ENTRY_POINT_GROUP",
    "AUTO_ORDER",
    "ProbeResult",
    "Selection",
    "register",
    "registered",
    "load",
    "select",
    "selection",
    "current",
    "set_current",
    "use",
]
__all__ += _errors.__all__  # the error classes: one list, in hyperrng.platforms.errors
