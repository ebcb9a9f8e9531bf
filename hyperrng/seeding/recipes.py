"""Seeding recipes of slapo, Megatron-core and d9d, on every platform, so existing runs reproduce.

Each recipe keeps its published formula (tested against it) and its stream names, but
seeds the current platform's devices instead of CUDA only, validates everything before it
changes anything, and replaces the tracker's streams all or nothing. New code should
prefer :mod:`hyperrng.seeding.layout`, whose seeds cannot collide the way these additive ones do
(Megatron-core's model-parallel stream of ``tp_rank`` 6 and expert stream of ``ep_rank``
17, ``etp_rank`` 0 are both ``seed + 2724``).

Every recipe validates all of its arguments first, then seeds with signals deferred (see
:mod:`hyperrng._guard.interrupts`): a Ctrl-C finds every generator and the tracker as before the
call or as after it, never some seeded and some not.

What "seed the host" means here (:func:`seed_host`): torch's CPU generator and the default
generator of every device of the current platform get the seed itself (all 64 bits; what
``torch.manual_seed`` does for CUDA). Python's ``random`` and NumPy's legacy global state:

* a seed below 2**32 reaches them unchanged, ``random.seed(seed)`` and
  ``np.random.seed(seed)``, the streams the original recipes give. These two already
  differ (CPython seeds MT19937 from the key array ``[seed]``, NumPy from the integer);
* a seed of 2**32 or more would not: CPython keys MT19937 by the seed's 32-bit words and
  NumPy, which refuses such an int, could only take the same words as an array, so both
  libraries would draw one stream. Each library instead gets its own *library seed*
  (:func:`library_seed`): ``combine64(domain, seed)`` with
  :data:`PYTHON_RANDOM_DOMAIN` for ``random`` and :data:`NUMPY_DOMAIN` for NumPy (passed
  as the ``uint32`` array ``[low word, high word]``). For a fixed seed, two domains
  always give two different library seeds (the last mixing step is a bijection), and
  distinct seeds keep distinct library seeds with probability 1 - 2**-64.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

import hyperrng.platforms as platforms
from hyperrng._guard.exclusive import holding, refuse_inside_contexts
from hyperrng._guard.interrupts import deferred
from hyperrng.errors import ArgumentTypeError, InvalidArgumentError
from hyperrng.platforms.mix import combine64
from hyperrng.platforms.validate import MAX_SEED, check_instance, check_int, check_seed
from hyperrng.seeding.layout import mesh_coordinates
from hyperrng.streams._device_state import current_device_key, device_keys
from hyperrng.streams.tracker import (
    DATA_PARALLEL_STREAM,
    EXPERT_PARALLEL_STREAM,
    MODEL_PARALLEL_STREAM,
    Replacing,
    RNGStatesTracker,
    resolve_tracker,
)

__all__ = [
    "NUMPY_DOMAIN",
    "PYTHON_RANDOM_DOMAIN",
    "SLAPO_DEFAULT_SEED",
    "MegatronSeeds",
    "is_random_seed_set",
    "library_seed",
    "megatron_model_parallel_manual_seed",
    "megatron_seeds",
    "megatron_set_random_seed",
    "model_parallel_cuda_manual_seed",
    "model_parallel_manual_seed",
    "seed_host",
    "set_random_seed",
    "set_seeds",
]

SLAPO_DEFAULT_SEED = 2013
"""slapo's default base seed."""

_PIPELINE_SEED_STRIDE = 100  # slapo and Megatron-core: base seed += 100 * pp_rank
_DATA_PARALLEL_SEED_STRIDE = 10  # slapo (when dp_rank is given) and Megatron-core (data_parallel_random_init)
_MEGATRON_TP_OFFSET = 2718  # model-parallel seed = seed + 2718 + tp_rank ("any positive value works")
_MEGATRON_EXPERT_OFFSET = 1024  # expert seed = seed + 1024 + 100 * ep_rank + etp_rank
_MEGATRON_EP_STRIDE = 100
_NUMPY_LEGACY_SEED_LIMIT = 2**32  # np.random.seed(int) refuses larger seeds
_LIBRARY_SEED_LIMIT = 2**32  # below it Python and NumPy get the seed as it is (distinct streams already)
PYTHON_RANDOM_DOMAIN = 0x505952414E444F4D  # "PYRANDOM"
"""Domain mixed into Python's ``random`` seed for host seeds of 2**32 and more (:func:`library_seed`)."""
NUMPY_DOMAIN = 0x4E554D5059524E47  # "NUMPYRNG"
"""Domain mixed into NumPy's seed for host seeds of 2**32 and more (:func:`library_seed`)."""
_WORD_BITS = 32
_WORD_MASK = (1 << _WORD_BITS) - 1
_PYTHONHASHSEED_MODULUS = 2**32  # PYTHONHASHSEED must lie in [0, 2**32 - 1]
_D9D_SEED_MODULUS = 2**64


# -- shared pieces -------------------------------------------------------------------------
def seed_host(seed: int) -> None:
    """Seed Python's ``random``, NumPy's legacy global state, and torch on the CPU and every device.

    Below 2**32, ``random`` and NumPy get ``seed`` as it is; from 2**32 on, each gets its
    own :func:`library_seed`, so the two never share a stream (see the module docstring).

    Raises:
        InvalidArgumentError: ``seed`` is not an int in [0, 2**64 - 1]; nothing is seeded.
        InvalidOperationError: another thread holds torch's CPU generator or a device's (in a
            fork, a region, ...; see :mod:`hyperrng._guard.exclusive`), or this thread is inside such a
            context, whose stream the generator holds until its exit puts the run's back; nothing is seeded.
    """
    value = check_seed(seed)
    platform = platforms.current()
    keys = device_keys(platform)
    refuse_inside_contexts(keys, "seed the generators")  # a fork's stream would be reseeded, the rest not
    with deferred(), holding(keys, "seed_host"):  # every generator or none, under Ctrl-C too
        random.seed(library_seed(value, PYTHON_RANDOM_DOMAIN))
        _seed_numpy(library_seed(value, NUMPY_DOMAIN))
        if platform.device_type != "cpu":  # where the device is the host, seeding the device seeds it
            platforms.seed_generator(torch.default_generator, value)  # all 64 bits, unlike torch.manual_seed
        for index in range(platform.device_count()):
            platform.manual_seed(value, index)


def library_seed(seed: int, domain: int) -> int:
    """The seed :func:`seed_host` gives one host library (``domain``: :data:`PYTHON_RANDOM_DOMAIN`
    or :data:`NUMPY_DOMAIN`) for a validated host ``seed``.

    ``seed`` itself below 2**32 (compatibility with ``random.seed(seed)`` and
    ``np.random.seed(seed)``), otherwise ``combine64(domain, seed)``
    (:func:`hyperrng.platforms.mix.combine64`): for one seed, distinct domains give
    distinct library seeds, so Python and NumPy draw distinct streams.
    """
    return seed if seed < _LIBRARY_SEED_LIMIT else combine64(domain, seed)


def _seed_numpy(seed: int) -> None:
    if seed < _NUMPY_LEGACY_SEED_LIMIT:
        np.random.seed(seed)
    else:  # NumPy's legacy seeding takes all 64 bits as two uint32 words
        np.random.seed(np.array([seed & _WORD_MASK, seed >> _WORD_BITS], dtype=np.uint32))


def _rank(value: object, what: str) -> int:
    """``value`` as a non-negative int: :class:`ArgumentTypeError` for another type,
    :class:`InvalidArgumentError` below 0."""
    number = check_int(value, what)
    if number < 0:
        raise InvalidArgumentError(f"{what} must be a non-negative int, got {number}.")
    return number


def _derived(value: int, formula: str) -> int:
    if value > MAX_SEED:
        raise InvalidArgumentError(f"{formula} = {value} exceeds 2**64 - 1; use a smaller base seed.")
    return value


def _replacing(tracker: RNGStatesTracker | None, keys: list[tuple[str, int]], what: str) -> Replacing:
    """The reseed of the tracker, refused up front (an active fork, a mode the platform lacks, ``keys`` held by
    another thread), before anything is seeded: a reseed would refuse the same way, but only after the host
    was seeded. Also refused inside another context that swapped one of ``keys``' generators (another tracker's
    fork, ``fork_rng``, a region, ``portable_random(seed)``), whose exit would undo the seeds: checked before
    the tracker's stuck forks are cleared, so that a refusal changes nothing."""
    chosen = resolve_tracker(tracker)
    refuse_inside_contexts(keys, "seed the generators", chosen.owns)
    return Replacing(chosen, "reseed", holds=keys, holding_what=what)


def _reseed(tracker: RNGStatesTracker | None, streams: dict[str, int], device_seed: int, what: str) -> None:
    """Replace the tracker's streams and seed the current device, both under the device's hold, or
    neither (signals deferred meanwhile)."""
    platform = platforms.current()
    keys = [current_device_key(platform)]
    replacement = _replacing(tracker, keys, what)
    with replacement.applying():
        replacement.tracker.reseed(streams)
        platform.manual_seed(device_seed)


# -- slapo -----------------------------------------------------------------------------------
def model_parallel_manual_seed(
    seed: int, tp_rank: int, always_enable_tp_seed: bool = False, *, tracker: RNGStatesTracker | None = None
) -> int:
    """slapo's model-parallel seeding: one stream, ``model-parallel-rng``, seeded ``seed + 2718 + tp_rank``.

    The tracker (default: the process-wide one) is replaced by that single stream. The
    current device's default generator gets ``seed``, or the model-parallel seed when
    ``always_enable_tp_seed`` (slapo's choice with sequence parallelism, where every
    dropout must differ across the TP group).

    Returns:
        The model-parallel seed.

    Raises:
        InvalidArgumentError: ``seed`` is not an int in [0, 2**64 - 1], or the derived seed overflows;
            or ``tp_rank`` is negative or not an int.
        InvalidOperationError: a fork of the tracker is active;
            or another thread holds the current device's generator. Nothing
            changes on error.
    """
    base = check_seed(seed)
    tp = _rank(tp_rank, "tp_rank")
    check_instance(always_enable_tp_seed, bool, "always_enable_tp_seed")
    tp_seed = _derived(base + _MEGATRON_TP_OFFSET + tp, f"seed + {_MEGATRON_TP_OFFSET} + tp_rank")
    device_seed = tp_seed if always_enable_tp_seed else base
    _reseed(tracker, {MODEL_PARALLEL_STREAM: tp_seed}, device_seed, "model_parallel_manual_seed")
    return tp_seed


def set_random_seed(
    seed: int = SLAPO_DEFAULT_SEED,
    dp_rank: int | None = None,
    pp_rank: int | None = None,
    tp_rank: int | None = None,
    always_enable_tp_seed: bool = False,
    *,
    tracker: RNGStatesTracker | None = None,
) -> int:
    """slapo's ``set_random_seed``: shift the seed by the pipeline and data-parallel ranks, seed everything.

    The base seed becomes ``seed + 100 * pp_rank`` (when given) ``+ 10 * dp_rank`` (when
    given); Python, NumPy and torch (CPU and every device) are seeded with it. When
    ``tp_rank`` is given, :func:`model_parallel_manual_seed` follows on every platform
    (slapo only did so when CUDA devices existed).

    Returns:
        The adjusted base seed.

    Raises:
        InvalidArgumentError, InvalidOperationError: as for
            :func:`model_parallel_manual_seed` and :func:`seed_host`, raised before anything is seeded.
    """
    base = check_seed(seed)
    if pp_rank is not None:
        base += _PIPELINE_SEED_STRIDE * _rank(pp_rank, "pp_rank")
    if dp_rank is not None:
        base += _DATA_PARALLEL_SEED_STRIDE * _rank(dp_rank, "dp_rank")
    base = _derived(base, "seed + 100 * pp_rank + 10 * dp_rank")
    check_instance(always_enable_tp_seed, bool, "always_enable_tp_seed")
    if tp_rank is not None:
        tp = _rank(tp_rank, "tp_rank")
        _derived(base + _MEGATRON_TP_OFFSET + tp, f"seed + {_MEGATRON_TP_OFFSET} + tp_rank")
    keys = device_keys(platforms.current())
    # Refused inside a fork, where seeding the device would reseed the forked stream; all or nothing after
    with _replacing(tracker, keys, "set_random_seed").applying():  # held throughout
        seed_host(base)
        if tp_rank is not None:
            model_parallel_manual_seed(base, tp_rank, always_enable_tp_seed, tracker=tracker)
    return base


def is_random_seed_set(tracker: RNGStatesTracker | None = None) -> bool:
    """Whether the tracker (default: the process-wide one) holds at least one stream."""
    return len(resolve_tracker(tracker)) > 0


# -- Megatron-core ---------------------------------------------------------------------------
@dataclass(frozen=True)
class MegatronSeeds:
    """The seeds of Megatron-core's three streams for one rank."""

    data_parallel: int
    model_parallel: int
    expert_parallel: int

    def as_streams(self) -> dict[str, int]:
        """``{stream name: seed}`` under Megatron-core's stream names."""
        return {
            DATA_PARALLEL_STREAM: self.data_parallel,
            MODEL_PARALLEL_STREAM: self.model_parallel,
            EXPERT_PARALLEL_STREAM: self.expert_parallel,
        }


def megatron_seeds(seed: int, tp_rank: int = 0, ep_rank: int = 0, etp_rank: int = 0) -> MegatronSeeds:
    """Megatron-core's formulas (``model_parallel_cuda_manual_seed``), as a pure function.

    data-parallel: ``seed``; model-parallel: ``seed + 2718 + tp_rank``; expert-parallel:
    ``seed + 1024 + 100 * ep_rank + etp_rank``.

    Raises:
        InvalidArgumentError: ``seed`` is not an int in [0, 2**64 - 1], or a derived seed overflows;
            or a rank is negative or not an int.
    """
    base = check_seed(seed)
    tp, ep, etp = _rank(tp_rank, "tp_rank"), _rank(ep_rank, "ep_rank"), _rank(etp_rank, "etp_rank")
    return MegatronSeeds(
        data_parallel=base,
        model_parallel=_derived(base + _MEGATRON_TP_OFFSET + tp, f"seed + {_MEGATRON_TP_OFFSET} + tp_rank"),
        expert_parallel=_derived(
            base + _MEGATRON_EXPERT_OFFSET + _MEGATRON_EP_STRIDE * ep + etp,
            f"seed + {_MEGATRON_EXPERT_OFFSET} + {_MEGATRON_EP_STRIDE} * ep_rank + etp_rank",
        ),
    )


def _check_megatron_distinct(seeds: MegatronSeeds) -> None:
    streams = seeds.as_streams()
    if len(set(streams.values())) != len(streams):
        raise InvalidArgumentError(
            f"Megatron-core's additive formulas give two of this rank's streams one seed: {streams}. "
            "This is the formula's collision, not a bug in your ranks; use hyperrng.StreamLayout for collision-free "
            "seeds."
        )


def megatron_model_parallel_manual_seed(
    seed: int,
    tp_rank: int = 0,
    ep_rank: int = 0,
    etp_rank: int = 0,
    *,
    tracker: RNGStatesTracker | None = None,
) -> MegatronSeeds:
    """Megatron-core's ``model_parallel_cuda_manual_seed`` on the current platform.

    Replaces the tracker's streams (default: the process-wide tracker) by
    ``data-parallel-rng``, ``model-parallel-rng`` and ``expert-parallel-rng`` seeded by
    :func:`megatron_seeds`, and seeds the current device's default generator with the
    data-parallel seed.

    Returns:
        The three seeds.

    Raises:
        InvalidArgumentError: see :func:`megatron_seeds`;
            or the formulas collide for these ranks (Megatron-core raises
            too); nothing changes.
        InvalidOperationError: a fork of the tracker is active;
            or another thread holds the current device's generator; nothing changes.
    """
    seeds = megatron_seeds(seed, tp_rank, ep_rank, etp_rank)
    _check_megatron_distinct(seeds)
    _reseed(tracker, seeds.as_streams(), seeds.data_parallel, "megatron_model_parallel_manual_seed")
    return seeds


def model_parallel_cuda_manual_seed(
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    force_reset_rng: bool = False,
    *,
    tracker: RNGStatesTracker | None = None,
) -> MegatronSeeds:
    """Megatron-core's ``model_parallel_cuda_manual_seed``: its signature and its three streams.

    Creates ``data-parallel-rng``, ``model-parallel-rng`` and ``expert-parallel-rng`` with
    Megatron-core's formulas (:func:`megatron_model_parallel_manual_seed`, on every
    platform). hyperrng does not read Megatron-core's parallel state, so a rank left
    ``None`` is 0 only where the process is alone (no process group, or a world of one);
    otherwise pass it. ``force_reset_rng`` is accepted either way: the streams are always
    replaced. slapo's function of the same name, ``(seed, tp_rank, always_enable_tp_seed)``,
    is :func:`model_parallel_manual_seed`; a slapo-style call here is refused.

    Returns:
        The three seeds.

    Raises:
        ArgumentTypeError: a flag is not a bool (a slapo-style call passes ``tp_rank`` where
            Megatron-core's signature has ``te_rng_tracker``).
        InvalidArgumentError: ``te_rng_tracker``, ``inference_rng_tracker`` or
            ``use_cudagraphable_rng`` is ``True``: they choose Megatron-core's tracker
            classes, which hyperrng's tracker replaces;
            or a rank is ``None`` in a world of more than one process, or negative.
        InvalidArgumentError, InvalidOperationError: see
            :func:`megatron_model_parallel_manual_seed`. Nothing changes on error.
    """
    flags = {
        "te_rng_tracker": te_rng_tracker,
        "inference_rng_tracker": inference_rng_tracker,
        "use_cudagraphable_rng": use_cudagraphable_rng,
        "force_reset_rng": force_reset_rng,
    }
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ArgumentTypeError(
                f"{name} must be True or False, got {type(value).__name__} {value!r:.40}. This is Megatron-core's "
                "model_parallel_cuda_manual_seed(seed, te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, "
                "tp_rank, ep_rank, etp_rank); for slapo's (seed, tp_rank, always_enable_tp_seed) call "
                "hyperrng.model_parallel_manual_seed."
            )
    chosen = [name for name in ("te_rng_tracker", "inference_rng_tracker", "use_cudagraphable_rng") if flags[name]]
    if chosen:
        raise InvalidArgumentError(
            f"{', '.join(chosen)}=True selects one of Megatron-core's tracker classes, which hyperrng's tracker "
            "replaces (for graph-safe streams, set_rng_tracker(RNGStatesTracker(graph_safe=True)) first). Drop "
            "the flag, or call hyperrng.megatron_model_parallel_manual_seed(seed, tp_rank, ep_rank, etp_rank)."
        )
    ranks = {"tp_rank": tp_rank, "ep_rank": ep_rank, "etp_rank": etp_rank}
    unknown = [name for name, value in ranks.items() if value is None]
    if unknown and platforms.comm.world_size() > 1:
        raise InvalidArgumentError(
            f"{', '.join(unknown)} not given: hyperrng does not read Megatron-core's parallel state, and this "
            "process is one of several. Pass tp_rank=, ep_rank= and etp_rank= (0 for a dimension the job does not "
            "use), or call hyperrng.megatron_model_parallel_manual_seed(seed, tp_rank, ep_rank, etp_rank)."
        )
    tp, ep, etp = (0 if value is None else value for value in ranks.values())
    return megatron_model_parallel_manual_seed(seed, tp, ep, etp, tracker=tracker)


def megatron_set_random_seed(
    seed: int,
    data_parallel_random_init: bool = False,
    *,
    pp_rank: int = 0,
    dp_rank: int = 0,
    tp_rank: int = 0,
    ep_rank: int = 0,
    etp_rank: int = 0,
    tracker: RNGStatesTracker | None = None,
) -> int:
    """Megatron-core's ``_set_random_seed`` (megatron/training/initialize.py) on the current platform.

    Called as Megatron calls it, ``(seed, data_parallel_random_init)``, with this rank's coordinates,
    which Megatron reads from its parallel state, given by name.

    The base seed becomes ``seed + 100 * pp_rank``, plus ``10 * dp_rank`` with
    ``data_parallel_random_init``; Python, NumPy and torch (CPU and every device) are
    seeded with it, then :func:`megatron_model_parallel_manual_seed` runs with it.

    Returns:
        The adjusted base seed.

    Raises:
        InvalidArgumentError: ``seed`` is not positive (Megatron-core refuses 0) or not an
            int below 2**64, or a derived seed overflows.
        InvalidArgumentError, InvalidOperationError: see
            :func:`megatron_model_parallel_manual_seed` and :func:`seed_host`; all raised before
            anything is seeded.
    """
    base = check_seed(seed)
    if base == 0:
        raise InvalidArgumentError("Megatron-core's seed must be a positive integer, got 0.")
    base += _PIPELINE_SEED_STRIDE * _rank(pp_rank, "pp_rank")
    dp = _rank(dp_rank, "dp_rank")
    if check_instance(data_parallel_random_init, bool, "data_parallel_random_init"):
        base += _DATA_PARALLEL_SEED_STRIDE * dp
    base = _derived(base, "seed + 100 * pp_rank (+ 10 * dp_rank)")
    _check_megatron_distinct(megatron_seeds(base, tp_rank, ep_rank, etp_rank))
    keys = device_keys(platforms.current())
    # Refused before anything is seeded; held throughout; all or nothing
    with _replacing(tracker, keys, "megatron_set_random_seed").applying():
        seed_host(base)
        megatron_model_parallel_manual_seed(base, tp_rank, ep_rank, etp_rank, tracker=tracker)
    return base


# -- d9d --------------------------------------------------------------------------------------
def set_seeds(seed: int, mesh: Mapping[str, int] | object | None = None, distinct_dim: str = "pp") -> int:
    """d9d's ``set_seeds``: shift the seed by this rank's coordinate on one mesh dimension, seed everything.

    The seed becomes ``(seed + coordinate[distinct_dim]) % 2**64`` (unshifted without a
    mesh); Python, NumPy (64-bit safe, see the module docstring), torch (CPU and every
    device) are seeded with it and ``PYTHONHASHSEED`` is set to it modulo 2**32 (it only
    affects Python processes started afterwards). d9d also seeds DTensor's generator
    over the other dimensions; that belongs to :mod:`hyperrng.sharding.offsets`.

    Args:
        seed: the base seed.
        mesh: ``None``, a mapping ``{dim name: this rank's coordinate}``, or an object
            with ``mesh_dim_names`` and ``get_coordinate()`` such as a ``DeviceMesh``.
        distinct_dim: the dimension along which seeds differ.

    Returns:
        The seed used.

    Raises:
        InvalidArgumentError: ``seed`` is not an int in [0, 2**64 - 1];
            or the mesh is malformed or has no dimension ``distinct_dim``.
        InvalidOperationError: see :func:`seed_host`. Nothing changes on error.
    """
    value = check_seed(seed)
    check_instance(distinct_dim, str, "distinct_dim")
    if mesh is not None:
        coords = mesh_coordinates(mesh)
        if distinct_dim not in coords:
            raise InvalidArgumentError(f"the mesh has no dimension {distinct_dim!r} (it has {list(coords)}).")
        value = (value + coords[distinct_dim]) % _D9D_SEED_MODULUS
    with deferred(), holding(device_keys(platforms.current()), "set_seeds"):
        seed_host(value)
    os.environ["PYTHONHASHSEED"] = str(value % _PYTHONHASHSEED_MODULUS)
    return value
