"""The tensor-parallel plumbing of the demo's models: Megatron's two functions at a layer boundary.

A column-parallel layer's input is whole on every rank and its gradient is a sum over the ranks
(:class:`CopyToTP`); a row-parallel layer's output is a sum over the ranks and its gradient whole
on every rank (:class:`ReduceFromTP`). Collectives run through the host where the backend needs
it (gloo with device tensors).
"""

from __future__ import annotations

from typing import Any

import torch

import hyperrng.platforms as platforms

__all__ = ["CopyToTP", "ReduceFromTP", "all_reduce"]


def all_reduce(tensor: torch.Tensor, group: Any) -> None:
    """Sum ``tensor`` in place over ``group``, through a host copy where the backend needs one (gloo)."""
    import torch.distributed as dist

    buf = tensor.to(platforms.comm.comm_device(platforms.current(), group))  # ``tensor`` itself where it can be
    dist.all_reduce(buf, group=group)
    tensor.copy_(buf)  # a no-op when ``buf`` is ``tensor``


class ReduceFromTP(torch.autograd.Function):
    """Sum the row-parallel partial outputs over the TP group; the gradient passes through."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: Any) -> torch.Tensor:
        out = partial.clone()
        all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class CopyToTP(torch.autograd.Function):
    """The input of a column-parallel layer: the same forward, its gradient summed over the TP group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        all_reduce(grad, ctx.group)
        return grad, None
