"""The rank side of :func:`hyperrng.portable_mode.tp_invariance_report` (spawned processes import it)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hyperrng.portable_mode import portable_random

__all__ = ["TinyMLP", "tp_rank"]

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
