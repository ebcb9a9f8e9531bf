"""The demo's portable-mode check: a tiny tensor-parallel model trained at several TP sizes.

:func:`tp_invariance_report` spawns the ranks; :func:`tp_rank` is what each of them runs
(spawned processes import this module to find it). It lives with the demo, not with portable
mode: it is a harness that exercises the mode, not part of it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hyperrng._launch import run_ranks
from hyperrng.errors import InvalidArgumentError
from hyperrng.philox.mode import portable_random
from hyperrng.platforms.validate import check_int, check_seed

__all__ = ["TinyMLP", "tp_invariance_report", "tp_rank"]

_IN, _HIDDEN, _BATCH = 8, 12, 6
_DROPOUT_P = 0.3
_LR = 0.1


class TinyMLP(nn.Module):
    """Linear, dropout, linear: the smallest model with a column- and a row-parallel layer."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(_IN, _HIDDEN)
        self.down = nn.Linear(_HIDDEN, _IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.dropout(self.up(x), _DROPOUT_P, self.training)
        self.masks.append(_full(hidden) == 0)
        return self.down(hidden)

    masks: list[torch.Tensor]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # a collective: every rank calls it


def tp_rank(rank: int, world_size: int, tp_sizes: tuple[int, ...], steps: int, seed: int) -> dict[int, Any]:
    """Per TP size: the initial parameters (flattened, global), the dropout masks and the losses."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    x = torch.linspace(-1.0, 1.0, _BATCH * _IN).reshape(_BATCH, _IN)  # the same batch on every rank
    results: dict[int, Any] = {}
    for tp in tp_sizes:
        mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]
        model = TinyMLP()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DTensor's notes about CPU meshes
            parallelize_module(model, mesh, {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()})
            model.masks = []
            optimizer = torch.optim.SGD(model.parameters(), lr=_LR)
            losses = []
            with portable_random(seed):
                for layer in (model.up, model.down):
                    layer.reset_parameters()  # kaiming_uniform_ and uniform_ on DTensor parameters
                params = torch.cat([_full(p.detach()).flatten() for p in model.parameters()])
                for _ in range(steps):
                    loss = model(x).pow(2).mean()
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    losses.append(float(loss))
        # Plain lists: tensors would travel back through shared memory that dies with the rank.
        results[tp] = {"params": params.tolist(), "masks": torch.stack(model.masks).tolist(), "losses": losses}
    return results


def tp_invariance_report(
    tp_sizes: Sequence[int] = (1, 2, 4), world_size: int = 4, steps: int = 2, seed: int = 1234
) -> dict[str, Any]:
    """Train a tiny tensor-parallel MLP with dropout under portable mode at each TP size, on real ranks.

    Spawns ``world_size`` gloo processes on the CPU; for each TP size the ranks form a
    ``(world_size // tp, tp)`` mesh, parallelise the model over its ``tp`` dimension
    (``torch.distributed.tensor.parallel``), initialise it inside ``portable_random(seed)``
    and train ``steps`` SGD steps with dropout.

    Returns:
        ``{"params_identical", "masks_identical", "max_loss_difference", "losses": {tp: [...]}}``:
        whether every TP size gave bit-identical initial parameters and dropout masks (on
        every rank), and how far the losses drift (float reductions differ with the sharding).

    Raises:
        ArgumentTypeError / InvalidArgumentError: a size that is not a positive int dividing
            ``world_size``, or ``steps`` that is not a positive int.
    """
    world = check_int(world_size, "world_size")
    sizes = tuple(check_int(tp, "each TP size") for tp in tp_sizes)
    if check_int(steps, "steps") < 1:
        raise InvalidArgumentError(f"steps must be at least 1 (the report compares losses); got {steps}.")
    check_seed(seed)
    if world < 1 or not sizes or any(tp < 1 or world % tp for tp in sizes):
        raise InvalidArgumentError(f"every TP size must divide world_size={world}; got {sizes}.")
    per_rank = run_ranks(tp_rank, world, sizes, steps, seed)
    reference = per_rank[0][sizes[0]]
    params = all(r[tp]["params"] == reference["params"] for r in per_rank for tp in sizes)  # exact float equality
    masks = all(r[tp]["masks"] == reference["masks"] for r in per_rank for tp in sizes)
    losses = {tp: per_rank[0][tp]["losses"] for tp in sizes}
    drift = max(abs(a - b) for tp in sizes for a, b in zip(losses[tp], losses[sizes[0]]))
    return {
        "params_identical": params,
        "masks_identical": masks,
        "max_loss_difference": drift,
        "losses": losses,
    }
