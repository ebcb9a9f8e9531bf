"""hyperrng's hardware layer: one small :class:`Platform` interface, one implementation per device kind.

Importing this package has no side effects: it resolves nothing and touches no device,
so a plug-in can ``from hyperrng.platforms import Platform`` without an import cycle. The
platform in use is resolved once by ``import hyperrng`` (or lazily by :func:`current`).
"""

from __future__ import annotations

from hyperrng.platforms import comm
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
from hyperrng.platforms.errors import (
    AmbiguousPlatformError,
    ArgumentTypeError,
    DeviceIndexError,
    HyperRNGError,
    InvalidOffsetError,
    InvalidPlatformError,
    InvalidSeedError,
    InvalidStateError,
    PlatformError,
    PlatformNameError,
    PlatformUnavailableError,
    UnknownPlatformError,
)
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
    "HyperRNGError",
    "ArgumentTypeError",
    "PlatformError",
    "UnknownPlatformError",
    "PlatformUnavailableError",
    "AmbiguousPlatformError",
    "InvalidPlatformError",
    "PlatformNameError",
    "InvalidSeedError",
    "InvalidOffsetError",
    "InvalidStateError",
    "DeviceIndexError",
]
