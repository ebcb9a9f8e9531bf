"""Simulated ranks: torch's single-process LocalTensor mode, where one process plays every rank.

Under ``torch.distributed._local_tensor.LocalTensorMode`` torch keeps one RNG state per
simulated rank (the CPU generator and the accelerator's) and loads a rank's state before
it runs an op for that rank, storing it back afterwards. A mesh coordinate is then a
``SymInt`` that holds one value per simulated rank. Whatever hyperrng wants a rank's
generator to hold must therefore be written into that rank's stored state: :func:`each_rank`
loads it, lets the caller position the generator through the platform as usual, and
stores it back.

Everything here reads torch's LocalTensor bookkeeping and nothing else; without
LocalTensor support in the installed torch, :func:`active_mode` is always ``None``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from hyperrng.errors import UnsupportedPortableOpError

__all__ = [
    "active_mode",
    "combine",
    "each_rank",
    "load_rank",
    "per_rank",
    "portable_refusal",
    "restore",
    "snapshot",
    "value_on",
]

_MODULE = "torch.distributed._local_tensor"


def portable_refusal(what: str) -> UnsupportedPortableOpError:
    """The refusal of a portable draw (``what``) under LocalTensor mode, before anything moves: its simulated ranks keep
    one generator each, which portable mode neither positions nor reads as one global counter."""
    return UnsupportedPortableOpError(
        f"{what} in portable mode under torch's LocalTensorMode: its simulated ranks keep one generator each, which "
        "portable mode neither positions nor reads as one global counter, so each would draw its shard from its own "
        "position. Run the ranks as processes (torch.multiprocessing with the gloo backend), or leave portable mode."
    )


def active_mode() -> Any | None:
    """The enabled ``LocalTensorMode``, or ``None`` outside one.

    Cheap enough for every sharded op: until something has imported torch's LocalTensor
    module, no such mode can be active, so it is never imported here.
    """
    module = sys.modules.get(_MODULE)
    return None if module is None else module.enabled_local_tensor_mode()


def combine(values: dict[int, int]) -> int | torch.SymInt:
    """One int for per-rank values that agree, else a ``SymInt`` holding each simulated rank's value."""
    distinct = set(values.values())
    if len(distinct) == 1:
        return distinct.pop()
    from torch.distributed._local_tensor import LocalIntNode

    return torch.SymInt(LocalIntNode(values))


def per_rank(value: object) -> dict[int, int] | None:
    """``{rank: int}`` when ``value`` is a ``SymInt`` holding one value per simulated rank, else ``None``."""
    node = getattr(value, "node", None)
    values = getattr(node, "_local_ints", None)
    return dict(values) if isinstance(values, dict) else None


def value_on(value: object, rank: int) -> object:
    """``value`` as simulated rank ``rank`` sees it: its own entry of a per-rank ``SymInt``, a constant
    ``SymInt`` as a plain int, anything else unchanged (so that validation sees what was given)."""
    values = per_rank(value)
    if values is not None:
        return values[rank]
    node = getattr(value, "node", None)
    maybe_as_int = getattr(node, "maybe_as_int", None)
    if callable(maybe_as_int):
        constant = maybe_as_int()
        if constant is not None:
            return int(constant)
    return value


def each_rank(mode: Any, position: Callable[[int], None]) -> None:
    """Run ``position(rank)`` with each simulated rank's RNG state loaded, and keep what it leaves.

    A rank without a stored state yet starts from the process's current state, as torch
    runs it. The process's generators are left holding the last rank's state, as after
    any op torch runs per rank.
    """
    from torch.distributed import _local_tensor as lt

    shared = lt._get_rng_state()
    stored = mode._per_rank_rng_states
    for rank in sorted(mode.ranks):
        lt._set_rng_state(*stored.get(rank, shared))
        position(rank)
        stored[rank] = lt._get_rng_state()


def load_rank(mode: Any, rank: int) -> None:
    """Load simulated rank ``rank``'s stored RNG state into the process's generators (if it has one)."""
    from torch.distributed import _local_tensor as lt

    state = mode._per_rank_rng_states.get(rank)
    if state is not None:
        lt._set_rng_state(*state)


def snapshot(mode: Any) -> dict[int, Any]:
    """Every simulated rank's stored RNG state, to put back with :func:`restore`."""
    return dict(mode._per_rank_rng_states)


def restore(mode: Any, states: dict[int, Any]) -> None:
    """Put back the stored RNG states :func:`snapshot` returned."""
    mode._per_rank_rng_states.clear()
    mode._per_rank_rng_states.update(states)
