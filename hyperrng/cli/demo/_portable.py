"""The demo's portable-mode check: a tiny tensor-parallel model trained at several TP sizes.

The model runs on the platform's device (a GPU, the simulated device, the CPU), split by hand
over the TP ranks as Megatron-style code splits it, every random op inside a sharded region
(:meth:`hyperrng.ShardedRNGTracker.distribute_region`) with the global shape of its tensor:
portable mode then gives every TP size the numbers of the unsharded model.

:func:`tp_invariance_report` starts the ranks; :func:`tp_rank` is what each of them runs
(rank processes import this module to find it). It lives with the demo, not with portable
mode: it is a harness that exercises the mode, not part of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import hyperrng.platforms as platforms
from hyperrng.cli.demo._tp import CopyToTP, ReduceFromTP
from hyperrng.cli.launch import run_ranks
from hyperrng.errors import InvalidArgumentError
from hyperrng.platforms.validate import check_int, check_seed
from hyperrng.portable.mode import portable_random
from hyperrng.sharding.tracker import ShardedRNGTracker

__all__ = ["TinyMLP", "tp_invariance_report", "tp_rank"]

_BATCH = 6
_HEAD_WIDTH, _HIDDEN_PER_HEAD = 2, 3  # the model's width is 2 and its hidden layer 3 per attention head
_DROPOUT_P = 0.3
_LR = 0.1


def _gather_columns(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """The column blocks of every rank of ``group`` side by side (rank order), on the host."""
    pieces = platforms.comm.all_gather(platforms.current(), tensor.detach(), group)
    return torch.cat([piece.cpu() for piece in pieces], dim=-1)


class TinyMLP(nn.Module):
    """Causal self-attention with dropout, then linear, dropout, linear; split over ``tp`` ranks as
    Megatron splits them: attention by heads, the first linear layer by output rows (column
    parallel), the second and the attention's output projection by input columns (row parallel),
    each with an all-reduce after it.

    Every random op draws inside a sharded region with the *global* shape of its tensor, so
    each rank draws its block of the numbers an unsharded model draws: the initialisation of
    each parameter, the attention's dropout mask over the global ``(1, heads, L, L)``
    probabilities, and the dropout mask of the hidden activation.
    """

    def __init__(self, tp: int, tp_rank: int, group: Any, device: torch.device, heads: int = 4) -> None:
        super().__init__()
        self.tp, self.tp_rank, self.group = tp, tp_rank, group
        self.tracker = ShardedRNGTracker()
        # ``heads`` must be a multiple of ``tp``: every rank holds whole heads and hidden units.
        self.heads, self.width, self.hidden = heads, _HEAD_WIDTH * heads, _HIDDEN_PER_HEAD * heads
        width, rows = self.width, self.hidden // tp  # the model's width; this rank's hidden units
        self.qkv_w = nn.Parameter(torch.empty(3, width // tp, width, device=device))
        self.out_w = nn.Parameter(torch.empty(width, width // tp, device=device))
        self.up_w = nn.Parameter(torch.empty(rows, width, device=device))
        self.up_b = nn.Parameter(torch.empty(rows, device=device))
        self.down_w = nn.Parameter(torch.empty(width, rows, device=device))
        self.down_b = nn.Parameter(torch.empty(width, device=device))
        self.masks: list[torch.Tensor] = []
        self.attention: list[torch.Tensor] = []

    def _region(self, shard_dim: int | None, global_shape: tuple[int, ...]) -> Any:
        placement = Replicate() if shard_dim is None else Shard(shard_dim)
        return self.tracker.distribute_region(((self.tp,), (self.tp_rank,)), [placement], global_shape)

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation of the unsharded layers (bounds from the global fans), per block."""
        width, hidden = self.width, self.hidden
        with torch.no_grad():
            for param, shard_dim, shape, fan_in in (
                (self.qkv_w, 1, (3, width, width), width),
                (self.out_w, 1, (width, width), width),
                (self.up_w, 0, (hidden, width), width),
                (self.up_b, 0, (hidden,), width),
                (self.down_w, 1, (width, hidden), hidden),
                (self.down_b, None, (width,), hidden),
            ):
                bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)) and the bias bound coincide
                with self._region(shard_dim, shape):
                    param.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = self.heads // self.tp
        q, k, v = (F.linear(x, w).view(1, _BATCH, heads, _HEAD_WIDTH).transpose(1, 2) for w in self.qkv_w)
        with self._region(1, (1, self.heads, _BATCH, _BATCH)):  # this rank's heads of the probabilities
            a = F.scaled_dot_product_attention(q, k, v, dropout_p=_DROPOUT_P if self.training else 0.0, is_causal=True)
        a = a.transpose(1, 2).reshape(_BATCH, self.width // self.tp)
        if not self.attention:  # the first forward's output, attention dropout included, is compared
            self.attention.append(_gather_columns(a, self.group))
        x = x + ReduceFromTP.apply(F.linear(a, self.out_w), self.group)
        hidden = F.linear(CopyToTP.apply(x, self.group), self.up_w, self.up_b)
        with self._region(1, (x.shape[0], self.hidden)):
            hidden = F.dropout(hidden, _DROPOUT_P, self.training)
        self.masks.append(_gather_columns(hidden == 0, self.group))
        return ReduceFromTP.apply(F.linear(hidden, self.down_w), self.group) + self.down_b

    def global_parameters(self) -> torch.Tensor:
        """Every parameter of the unsharded model, flattened, on the host (a collective)."""
        qkv_w = _gather_columns(self.qkv_w.transpose(1, 2), self.group).transpose(1, 2)
        out_w = _gather_columns(self.out_w, self.group)
        up_w = _gather_columns(self.up_w.t(), self.group).t()
        up_b = _gather_columns(self.up_b, self.group)
        down_w = _gather_columns(self.down_w, self.group)
        parts = (qkv_w, out_w, up_w, up_b, down_w, self.down_b.detach().cpu())
        return torch.cat([t.flatten() for t in parts])


def tp_rank(rank: int, world_size: int, tp_sizes: tuple[int, ...], steps: int, seed: int) -> dict[int, Any]:
    """Per TP size: the initial parameters (flattened, global), the dropout masks and the losses.

    Runs on the platform's device: this rank's device when there is one per rank, else the
    one every rank shares.
    """
    import torch.distributed as dist

    p = platforms.current()
    p.set_device(rank % p.device_count())
    device = p.device()
    heads = math.lcm(*tp_sizes)  # every TP size holds whole heads: 4 for TP sizes 1, 2 and 4
    width = _HEAD_WIDTH * heads
    x = torch.linspace(-1.0, 1.0, _BATCH * width, device=device).reshape(_BATCH, width)  # the same batch everywhere
    results: dict[int, Any] = {}
    for tp in tp_sizes:
        groups = [dist.new_group(list(range(start, start + tp))) for start in range(0, world_size, tp)]
        model = TinyMLP(tp, rank % tp, groups[rank // tp], device, heads)
        optimizer = torch.optim.SGD(model.parameters(), lr=_LR)
        losses = []
        with portable_random(seed):
            model.reset_parameters()
            params = model.global_parameters()
            for _ in range(steps):
                loss = model(x).pow(2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
        # Plain lists: tensors would travel back through shared memory that dies with the rank.
        results[tp] = {
            "params": params.tolist(),
            "masks": torch.stack(model.masks).tolist(),
            "attention": torch.stack(model.attention).tolist(),
            "losses": losses,
        }
    return results


def tp_invariance_report(
    tp_sizes: Sequence[int] = (1, 2, 4), world_size: int = 4, steps: int = 2, seed: int = 1234
) -> dict[str, Any]:
    """Train a tiny tensor-parallel MLP with dropout under portable mode at each TP size, on real ranks.

    Starts ``world_size`` gloo processes on the platform's device; for each TP size the
    ranks form groups of ``tp`` consecutive ranks, split the model over them (:class:`TinyMLP`),
    initialise it inside ``portable_random(seed)`` and train ``steps`` SGD steps with dropout.

    Returns:
        ``{"params_identical", "masks_identical", "max_attention_difference", "max_loss_difference",
        "losses": {tp: [...]}}``: whether every TP size gave bit-identical initial parameters and
        dropout masks (on every rank), how far the first attention outputs (their dropout included)
        and the losses drift (float products and reductions differ with the sharding).

    Raises:
        ArgumentTypeError / InvalidArgumentError: a size that is not a positive int dividing
            ``world_size``, or ``steps`` that is not a positive int.

    The model has as many attention heads as the least common multiple of the sizes (4 for 1, 2
    and 4), so that every TP size holds whole heads and hidden units.
    """
    world = check_int(world_size, "world_size")
    sizes = tuple(check_int(tp, "each TP size") for tp in tp_sizes)
    if check_int(steps, "steps") < 1:
        raise InvalidArgumentError(f"steps must be at least 1 (the report compares losses); got {steps}.")
    check_seed(seed)
    if world < 1 or not sizes or any(tp < 1 or world % tp for tp in sizes):
        raise InvalidArgumentError(f"every TP size must divide world_size={world}; got {sizes}.")
    per_rank = run_ranks(tp_rank, world, sizes, steps, seed, fork_server=True)
    reference = per_rank[0][sizes[0]]
    params = all(r[tp]["params"] == reference["params"] for r in per_rank for tp in sizes)  # exact float equality
    masks = all(r[tp]["masks"] == reference["masks"] for r in per_rank for tp in sizes)
    # The attention's outputs: a rank's share of the heads is a smaller matrix product, which may
    # round differently; a different dropout mask would move them by far more than rounding.
    first = torch.tensor(reference["attention"][0])
    attention = max(float((torch.tensor(r[tp]["attention"][0]) - first).abs().max()) for r in per_rank for tp in sizes)
    losses = {tp: per_rank[0][tp]["losses"] for tp in sizes}
    drift = max(abs(a - b) for tp in sizes for a, b in zip(losses[tp], losses[sizes[0]]))
    return {
        "params_identical": params,
        "masks_identical": masks,
        "max_attention_difference": attention,
        "max_loss_difference": drift,
        "losses": losses,
    }
