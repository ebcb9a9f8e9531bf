"""``hyperrng demo``: the properties users suffer for, proven with real processes on the CPU.

The demo starts ``world_size`` processes over gloo (or joins a ``torchrun`` job), arranges
them as a data-parallel x tensor-parallel mesh, seeds them from one declarative layout,
and trains a tiny tensor-parallel MLP for a few steps with dropout inside the TP region
(drawn from the ``model-parallel-rng`` stream) and after it (the default generator). It
runs one sharded random op, checks the streams across ranks, saves an RNG checkpoint at
``save_step``, and resumes from it in fresh processes. It prints a per-rank table and one
verdict per property, and succeeds only if every property holds:

1. dropout inside the TP region differs across the TP ranks of a data-parallel group;
2. dropout after the TP region agrees across them (and so do their losses);
3. a sharded random op gives replicas equal numbers and distinct shards distinct ones,
   and leaves every rank at the same generator position;
4. ``verify_rng_sync`` finds every stream shared exactly as the layout says;
5. the run resumed from the checkpoint in new processes is bit-identical to the
   uninterrupted one.
"""

from __future__ import annotations

import hashlib
import os
import random
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hyperrng.errors import HyperRNGError, UsageError
from hyperrng.layout import DEFAULT_STREAM, StreamLayout, apply_layout
from hyperrng.tracker import MODEL_PARALLEL_STREAM, get_rng_tracker

__all__ = ["DemoConfig", "LAYOUT", "run_demo", "main"]

LAYOUT = StreamLayout(
    dims=("dp", "tp"),
    default=("dp",),  # data-parallel groups see different data, so their dropout may differ
    streams={MODEL_PARALLEL_STREAM: ("tp",)},
)
"""The demo's streams: the default generator varies over dp, the TP stream over tp."""

_DROPOUT = 0.5
_LEARNING_RATE = 0.01
_BATCH, _IN, _HIDDEN_PER_TP, _OUT = 4, 8, 8, 4
_SHARDED_SHAPE = (8, 6)
_SHARDED_SEED_SALT = 0x5EED  # the sharded op's seed, derived from the base seed, same on every rank


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs: mesh, steps, checkpoint step, base seed and where files go."""

    world_size: int = 4
    tp: int = 2
    steps: int = 4
    save_step: int = 2
    seed: int = 1234
    workdir: str = ""

    def validate(self) -> None:
        """Raise :class:`UsageError` for a configuration the demo cannot run."""
        for name in ("world_size", "tp", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}.")
        if self.world_size % self.tp:
            raise UsageError(
                f"a world size of {self.world_size} cannot be arranged as dp x tp with tp={self.tp}; "
                f"choose a --tp that divides {self.world_size}."
            )
        if self.steps < 2 or not 1 <= self.save_step < self.steps:
            raise UsageError(
                f"--save-step must lie in [1, --steps - 1] so that a resume has steps to replay; "
                f"got save_step={self.save_step}, steps={self.steps}."
            )

    @property
    def dp(self) -> int:
        return self.world_size // self.tp


class _ReduceFromTP(torch.autograd.Function):
    """Sum the row-parallel partial outputs over the TP group; the gradient passes through."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        out = partial.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _fp(t: torch.Tensor) -> str:
    """A short fingerprint of a tensor's bytes (what the table shows)."""
    return hashlib.blake2b(t.detach().contiguous().numpy().tobytes(), digest_size=4).hexdigest()


class _Rank:
    """One rank's view of the job: its coordinates, groups and model shard."""

    def __init__(self, cfg: DemoConfig, rank: int) -> None:
        import torch.distributed as dist

        self.cfg = cfg
        self.rank = rank
        self.coords = {"dp": rank // cfg.tp, "tp": rank % cfg.tp}
        # Every rank must create every group, in the same order.
        self.tp_group = self.dp_group = None
        for d in range(cfg.dp):
            g = dist.new_group([d * cfg.tp + t for t in range(cfg.tp)])
            if d == self.coords["dp"]:
                self.tp_group = g
        for t in range(cfg.tp):
            g = dist.new_group([d * cfg.tp + t for d in range(cfg.dp)])
            if t == self.coords["tp"]:
                self.dp_group = g
        # The same global weights on every rank (from a private generator), then this rank's shards.
        init = torch.Generator().manual_seed(cfg.seed)
        hidden = _HIDDEN_PER_TP * cfg.tp
        w1 = torch.randn(hidden, _IN, generator=init) * 0.3
        w2 = torch.randn(_OUT, hidden, generator=init) * 0.3
        rows = slice(self.coords["tp"] * _HIDDEN_PER_TP, (self.coords["tp"] + 1) * _HIDDEN_PER_TP)
        self.w1 = w1[rows].clone().requires_grad_()  # column-parallel
        self.w2 = w2[:, rows].clone().requires_grad_()  # row-parallel

    def seed(self) -> dict[str, int]:
        from hyperrng.seeding import seed_host

        seeds = LAYOUT.seeds(self.cfg.seed, self.coords)
        seed_host(seeds[DEFAULT_STREAM])  # Python, NumPy and torch follow the default stream
        apply_layout(LAYOUT, self.cfg.seed, self.coords)
        return seeds

    def step(self, step: int) -> dict[str, Any]:
        # Data differs per data-parallel group and is identical across its TP ranks; the
        # host generators (seeded per dp) add noise, so their resume is exercised too.
        data = torch.Generator().manual_seed(self.cfg.seed * 1000 + step * 10 + self.coords["dp"])
        x = torch.randn(_BATCH, _IN, generator=data) + float(np.random.rand()) + random.random()
        target = torch.randn(_BATCH, _OUT, generator=data)
        h = x @ self.w1.T
        with get_rng_tracker().fork(MODEL_PARALLEL_STREAM):
            keep_in = torch.rand_like(h) >= _DROPOUT
        h = h * keep_in / (1 - _DROPOUT)
        y = _ReduceFromTP.apply(h @ self.w2.T, self.tp_group)
        keep_out = torch.rand_like(y) >= _DROPOUT
        y = y * keep_out / (1 - _DROPOUT)
        loss = ((y - target) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for w in (self.w1, self.w2):
                assert w.grad is not None
                if self.cfg.dp > 1:
                    import torch.distributed as dist

                    dist.all_reduce(w.grad, group=self.dp_group)
                    w.grad /= self.cfg.dp
                w -= _LEARNING_RATE * w.grad
                w.grad = None
        return {"loss": loss.item(), "in": _fp(keep_in), "out": _fp(keep_out), "w": _fp(self.w1) + _fp(self.w2)}

    def sharded_op(self) -> dict[str, Any]:
        from torch.distributed.tensor import Replicate, Shard

        from hyperrng.random import fork_rng
        from hyperrng.sharded import MeshInfo, ShardedRNGTracker

        tracker = ShardedRNGTracker()
        mesh = MeshInfo((self.cfg.dp, self.cfg.tp), (self.coords["dp"], self.coords["tp"]))
        with fork_rng():  # leave the default stream where training left it
            tracker.manual_seed(self.cfg.seed ^ _SHARDED_SEED_SALT)
            with tracker.distribute_region(mesh, [Replicate(), Shard(0)], _SHARDED_SHAPE):
                local = torch.rand(_SHARDED_SHAPE[0] // self.cfg.tp, _SHARDED_SHAPE[1])
            position = tracker.platform.get_seed_offset()
        return {"fp": _fp(local), "position": position}

    def checkpoint_path(self) -> Path:
        return Path(self.cfg.workdir) / f"rank{self.rank}.pt"


def _train(rank: int, world_size: int, cfg: DemoConfig) -> dict[str, Any]:
    """Phase 1: seed, run one sharded op, train, verify, checkpoint at save_step, go on to the end."""
    from hyperrng.errors import RNGDesyncError
    from hyperrng.state import rng_state_dict, save_rng_state
    from hyperrng.verify import verify_rng_sync

    r = _Rank(cfg, rank)
    seeds = r.seed()
    sharded = r.sharded_op()
    steps, verify_error = [], ""
    for step in range(1, cfg.steps + 1):
        steps.append(r.step(step))
        if step == cfg.save_step:
            try:
                verify_rng_sync(LAYOUT, r.coords)
            except RNGDesyncError as exc:
                verify_error = str(exc)
            state = rng_state_dict(layout=LAYOUT, coords=r.coords, base_seed=cfg.seed)
            save_rng_state(r.checkpoint_path(), {"rng": state, "w1": r.w1.detach(), "w2": r.w2.detach()})
    return {"coords": r.coords, "seeds": seeds, "sharded": sharded, "steps": steps, "verify_error": verify_error}


def _resume(rank: int, world_size: int, cfg: DemoConfig) -> list[dict[str, Any]]:
    """Phase 2, in fresh processes: scramble every generator, load the checkpoint, finish the run."""
    from hyperrng.seeding import seed_host
    from hyperrng.state import load_rng_state, load_rng_state_dict

    r = _Rank(cfg, rank)
    seed_host(cfg.seed + 999)  # whatever the new processes start with must not matter
    apply_layout(LAYOUT, cfg.seed + 999, r.coords)
    saved = load_rng_state(r.checkpoint_path())
    load_rng_state_dict(saved["rng"], layout=LAYOUT, coords=r.coords)
    with torch.no_grad():
        r.w1.copy_(saved["w1"])
        r.w2.copy_(saved["w2"])
    return [r.step(step) for step in range(cfg.save_step + 1, cfg.steps + 1)]


def _in_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _torchrun_job(cfg: DemoConfig) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]] | None:
    """Run both phases inside an existing torchrun job; rank 0 gets everyone's results."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    trained = _train(rank, cfg.world_size, cfg)
    get_rng_tracker().reset()  # a resume inside the same processes: start from a blank tracker
    resumed = _resume(rank, cfg.world_size, cfg)
    everyone: list[Any] = [None] * cfg.world_size
    dist.all_gather_object(everyone, (trained, resumed))
    if rank != 0:
        return None
    return [t for t, _ in everyone], [res for _, res in everyone]


def _verdicts(
    cfg: DemoConfig, trained: list[dict[str, Any]], resumed: list[list[dict[str, Any]]], fresh: bool = True
) -> list[tuple[str, bool, str]]:
    by_dp: dict[int, list[dict[str, Any]]] = {}
    for row in trained:
        by_dp.setdefault(row["coords"]["dp"], []).append(row)
    n = cfg.steps
    inside = all(
        len({row["steps"][s]["in"] for row in group}) == len(group) for group in by_dp.values() for s in range(n)
    )
    outside = all(
        len({(row["steps"][s]["out"], row["steps"][s]["loss"]) for row in group}) == 1
        for group in by_dp.values()
        for s in range(n)
    )
    by_tp: dict[int, set[str]] = {}
    for row in trained:
        by_tp.setdefault(row["coords"]["tp"], set()).add(row["sharded"]["fp"])
    replicas_equal = all(len(fps) == 1 for fps in by_tp.values())
    shards_differ = len({next(iter(fps)) for fps in by_tp.values()}) == len(by_tp)
    one_position = len({tuple(row["sharded"]["position"]) for row in trained}) == 1
    errors = [row["verify_error"] for row in trained if row["verify_error"]]
    expected = [row["steps"][cfg.save_step :] for row in trained]
    identical = expected == resumed
    return [
        ("dropout inside the TP region differs across TP ranks", inside, f"{n} steps x {cfg.dp} dp group(s)"),
        ("dropout after the TP region agrees across TP ranks", outside, "masks and losses"),
        (
            "sharded op: replicas equal, shards differ, one final position",
            replicas_equal and shards_differ and one_position,
            f"replicas {'equal' if replicas_equal else 'DIFFER'}, shards {'differ' if shards_differ else 'COLLIDE'}, "
            f"positions {'agree' if one_position else 'DISAGREE'}",
        ),
        (
            "verify_rng_sync: streams shared exactly as the layout says",
            not errors,
            errors[0] if errors else "no desync",
        ),
        (
            f"resume from step {cfg.save_step} {'in fresh processes' if fresh else 'after scrambling'} "
            "is bit-identical",
            identical,
            f"steps {cfg.save_step + 1}..{n}: losses, masks and weights",
        ),
    ]


def _table(cfg: DemoConfig, trained: list[dict[str, Any]]) -> str:
    head = (
        f"{'rank':>4} {'dp':>3} {'tp':>3}  {'default seed':<18} {'TP-stream seed':<18} "
        f"{'mask in':<9} {'mask out':<9} {'shard':<9} {'loss':>9}"
    )
    lines = [head, "-" * len(head)]
    for rank, row in enumerate(trained):
        last = row["steps"][-1]
        lines.append(
            f"{rank:>4} {row['coords']['dp']:>3} {row['coords']['tp']:>3}  "
            f"{row['seeds'][DEFAULT_STREAM]:#018x} {row['seeds'][MODEL_PARALLEL_STREAM]:#018x} "
            f"{last['in']:<9} {last['out']:<9} {row['sharded']['fp']:<9} {last['loss']:>9.5f}"
        )
    return "\n".join(lines)


def run_demo(cfg: DemoConfig) -> tuple[bool, str]:
    """Run the demo; return whether every property held and the report to print."""
    from hyperrng._launch import run_ranks

    cfg.validate()
    with tempfile.TemporaryDirectory(prefix="hyperrng-demo-") as tmp:
        cfg = DemoConfig(**{**cfg.__dict__, "workdir": cfg.workdir or tmp})
        if _in_torchrun():
            cfg = DemoConfig(**{**cfg.__dict__, "world_size": int(os.environ["WORLD_SIZE"])})
            cfg.validate()
            result = _torchrun_job(cfg)
            if result is None:
                return True, ""
            trained, resumed = result
            how = f"joined a torchrun job of {cfg.world_size} ranks; resumed in the same processes"
            fresh = False
        else:
            trained = run_ranks(_train, cfg.world_size, cfg)
            resumed = run_ranks(_resume, cfg.world_size, cfg)
            how = f"{cfg.world_size} processes over gloo, then {cfg.world_size} fresh ones for the resume"
            fresh = True
    verdicts = _verdicts(cfg, trained, resumed, fresh)
    ok = all(v for _, v, _ in verdicts)
    import platforms

    lines = [
        f"hyperrng demo: mesh dp={cfg.dp} x tp={cfg.tp} on platform {platforms.current().name!r} ({how})",
        f"base seed {cfg.seed}; {cfg.steps} training steps; RNG checkpoint at step {cfg.save_step}",
        "",
        _table(cfg, trained),
        "",
    ]
    lines += [f"  [{'PASS' if v else 'FAIL'}] {name}  ({detail})" for name, v, detail in verdicts]
    lines += ["", "every property holds" if ok else "SOME PROPERTIES FAILED"]
    return ok, "\n".join(lines)


def main(argv: Sequence[str] | None = None, cfg: DemoConfig | None = None) -> int:
    """Run the demo with ``cfg`` (default: :class:`DemoConfig`), print the report, return 0 iff it passed."""
    try:
        ok, report = run_demo(cfg if cfg is not None else DemoConfig())
    except HyperRNGError as exc:
        print(f"hyperrng demo: error: {exc}")
        return 2
    if report:
        print(report)
    return 0 if ok else 1
