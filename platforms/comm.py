"""Collectives for hyperrng's cross-rank checks, over ``torch.distributed``, placed for a platform.

They depend on a platform only through :meth:`Platform.device`: a collective of a gloo
group runs on the host, any other backend's on the platform's current device, so a
plug-in implements none of them. Without a default process group they act as a
single-rank job: rank 0 of 1, a broadcast returns its input, a gather returns ``[input]``.
"""

from __future__ import annotations

from typing import Any

import torch
from hyperrng.platforms.base import Platform

__all__ = ["rank", "world_size", "broadcast", "all_gather", "comm_device"]


def _dist() -> Any:
    """``torch.distributed`` when a default process group exists, else ``None``."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank(group: object | None = None) -> int:
    """This process's rank in ``group`` (0 when ``torch.distributed`` is not initialised)."""
    dist = _dist()
    return dist.get_rank(group) if dist is not None else 0


def world_size(group: object | None = None) -> int:
    """Size of ``group`` (1 when ``torch.distributed`` is not initialised)."""
    dist = _dist()
    return dist.get_world_size(group) if dist is not None else 1


def comm_device(platform: Platform, group: object | None = None) -> torch.device:
    """Where a tensor must be for a collective of ``group``: the CPU for gloo, else ``platform``'s current device."""
    dist = _dist()
    if dist is None or dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return platform.device()


def broadcast(platform: Platform, tensor: torch.Tensor, src: int = 0, group: object | None = None) -> torch.Tensor:
    """Return ``tensor`` as held by global rank ``src``, on the device ``tensor`` came from.

    The tensor travels on :func:`comm_device`; ``tensor`` itself is not modified.
    Without a process group it is returned unchanged.
    """
    dist = _dist()
    if dist is None:
        return tensor
    buf = tensor.to(comm_device(platform, group), copy=True)
    dist.broadcast(buf, src=src, group=group)
    return buf.to(tensor.device)


def all_gather(platform: Platform, tensor: torch.Tensor, group: object | None = None) -> list[torch.Tensor]:
    """Return every rank's ``tensor`` (same shape on each rank), in rank order, on the device ``tensor`` came from."""
    dist = _dist()
    if dist is None:
        return [tensor.clone()]
    buf = tensor.to(comm_device(platform, group), copy=True)
    out = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, buf, group=group)
    return [t.to(tensor.device) for t in out]
