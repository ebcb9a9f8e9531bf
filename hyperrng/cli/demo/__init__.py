"""``hyperrng demo``: the properties users suffer for, proven with real processes where the platform is.

The demo starts ``world_size`` processes (or joins a ``torchrun`` job), arranges them as
a data-parallel x tensor-parallel mesh, seeds them from one declarative layout, and
trains a tiny tensor-parallel MLP for a few steps with dropout inside the TP region
(drawn from the ``model-parallel-rng`` stream) and after it (the default generator). It
runs one sharded random op, checks the streams across ranks, saves an RNG checkpoint at
``save_step``, and resumes from it in fresh processes. It says what it will check before
any process starts, a line per phase as the ranks reach it (start, each step, the
checkpoint, the resume), then a per-rank table and one verdict per property, and
succeeds only if every property holds:

1. dropout inside the TP region differs across the TP ranks of a data-parallel group;
2. dropout after the TP region agrees across them (and so do their losses);
3. a sharded random op gives replicas equal numbers and distinct shards distinct ones,
   and leaves every rank at the same generator position;
4. ``verify_rng_sync`` finds every stream shared exactly as the layout says;
5. the run resumed from the checkpoint in new processes is bit-identical to the
   uninterrupted one.

Everything runs where the current platform is: the model, the data, the masks and the
sharded op live on ``platform.device(local_rank % device_count)``, which each rank makes
its current device. The process group uses the platform's backend when every local rank
has a device of its own, and gloo otherwise, with tensors staged through the host for
each collective.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hyperrng.platforms as platforms
from hyperrng.cli.demo._output import REPORT_WIDTH, Phases, Report, relayed, table, verdict_lines
from hyperrng.cli.demo._tp import ReduceFromTP, all_reduce
from hyperrng.cli.launch import Placement
from hyperrng.errors import ArgumentTypeError, HyperRNGError, InvalidArgumentError, RankFailure
from hyperrng.platforms import _features
from hyperrng.platforms.mix import combine64
from hyperrng.platforms.validate import check_seed
from hyperrng.seeding.layout import DEFAULT_STREAM, StreamLayout, apply_layout
from hyperrng.streams.tracker import MODEL_PARALLEL_STREAM, get_rng_tracker

__all__ = [
    "DemoConfig",
    "DEFAULT_WORLD_SIZE",
    "LAYOUT",
    "MAX_LOCAL_RANKS",
    "PORTABLE_MAX_RANKS",
    "REPORT_WIDTH",
    "run_demo",
    "main",
]

LAYOUT = StreamLayout(
    dims=("dp", "tp"),
    default=("dp",),  # data-parallel groups see different data, so their dropout may differ
    streams={MODEL_PARALLEL_STREAM: ("tp",)},
)
"""The demo's streams: the default generator varies over dp, the TP stream over tp."""

MAX_LOCAL_RANKS = 64
"""The most processes the demo starts on one machine (a larger job runs under torchrun)."""

DEFAULT_WORLD_SIZE = 4
"""Processes started when neither ``--world-size`` nor a torchrun job says otherwise."""

_DROPOUT = 0.5
_LEARNING_RATE = 0.01
_BATCH, _IN, _HIDDEN_PER_TP, _OUT = 4, 8, 8, 4
_SHARDED_SHAPE = (8, 6)
# Domains of the seeds derived from the base seed with ``combine64``: each use its own,
# so that no two coincide, and every base seed in [0, 2**64) gives seeds in range.
_SHARDED_SEED_DOMAIN = 0x5EED  # the sharded op's seed, the same on every rank
_DATA_SEED_DOMAIN = 0xDA7A  # a step's data, per data-parallel group
_SCRAMBLE_SEED_DOMAIN = 0x5C4A  # what resumed processes hold before the checkpoint is loaded


PORTABLE_MAX_RANKS = 8
"""The most processes --portable runs: it trains once per TP size that divides the world size."""
_PORTABLE_STEPS = 2
_PORTABLE_LOSS_TOLERANCE = 1e-5  # float reductions differ with the sharding; the random numbers do not


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs: mesh, steps, checkpoint step, base seed and where files go.

    ``world_size=None`` means the torchrun job's size inside one, else
    :data:`DEFAULT_WORLD_SIZE`; a world size given under torchrun must match the job's.
    """

    world_size: int | None = None
    tp: int = 2
    steps: int = 4
    save_step: int = 2
    seed: int = 1234
    workdir: str = ""
    portable: bool = False

    def validate(self) -> None:
        """Raise for a configuration the demo cannot run; change nothing.

        Raises:
            InvalidArgumentError: a mesh, step count or checkpoint step the demo cannot run;
                or ``portable`` on a torch without portable mode.
            InvalidArgumentError, ArgumentTypeError: a seed the library refuses.
        """
        check_seed(self.seed, "--seed: seed")
        for name in ("world_size", "tp", "steps"):
            value = getattr(self, name)
            if name == "world_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}.")
        if self.world_size is not None and self.world_size % self.tp:
            raise InvalidArgumentError(
                f"a world size of {self.world_size} cannot be arranged as dp x tp with tp={self.tp}; "
                f"choose a --tp that divides {self.world_size}."
            )
        if not isinstance(self.portable, bool):
            raise ArgumentTypeError(f"portable must be True or False, got {self.portable!r}.")
        if self.portable and not _features.feature("portable-mode").available:  # else every rank fails it
            raise InvalidArgumentError(
                f"--portable: {_features.feature('portable-mode').refusal()}; or run the demo without --portable."
            )
        if self.portable and self.world_size is not None and self.world_size > PORTABLE_MAX_RANKS:
            raise InvalidArgumentError(
                f"--portable trains at every TP size dividing the world size on up to {PORTABLE_MAX_RANKS} "
                f"processes; got --world-size {self.world_size}."
            )
        if isinstance(self.save_step, bool) or not isinstance(self.save_step, int):
            raise InvalidArgumentError(f"--save-step must be an integer, got {self.save_step!r}.")
        if self.steps < 2 or not 1 <= self.save_step < self.steps:
            raise InvalidArgumentError(
                f"--save-step must lie in [1, --steps - 1] so that a resume has steps to replay; "
                f"got save_step={self.save_step}, steps={self.steps}."
            )

    def resolved(self) -> DemoConfig:
        """This configuration with its world size settled and every field validated.

        Raises:
            InvalidArgumentError: see :meth:`validate`; or a world size that contradicts the
                torchrun job, or above :data:`MAX_LOCAL_RANKS` for a local run.
        """
        self.validate()
        job = _torchrun_world_size()
        if job is not None:
            if self.portable:
                raise InvalidArgumentError(
                    "--portable starts processes of its own at several TP sizes; run it outside torchrun."
                )
            if self.world_size is not None and self.world_size != job:
                raise InvalidArgumentError(
                    f"--world-size {self.world_size} contradicts the torchrun job, which has WORLD_SIZE={job} "
                    "ranks; leave --world-size out under torchrun (the job decides), or launch that many ranks."
                )
            cfg = replace(self, world_size=job)
        else:
            cfg = replace(self, world_size=DEFAULT_WORLD_SIZE if self.world_size is None else self.world_size)
            if cfg.size > MAX_LOCAL_RANKS:
                raise InvalidArgumentError(
                    f"--world-size {cfg.size} would start {cfg.size} processes on this machine; the demo starts "
                    f"at most {MAX_LOCAL_RANKS} (run a larger job under torchrun)."
                )
        cfg.validate()
        return cfg

    @property
    def size(self) -> int:
        """The world size of a resolved configuration."""
        if self.world_size is None:
            raise InvalidArgumentError("the world size is not settled yet; call DemoConfig.resolved() first.")
        return self.world_size

    @property
    def dp(self) -> int:
        """The data-parallel size of a resolved configuration."""
        return self.size // self.tp


def _fp(t: torch.Tensor) -> str:
    """A short fingerprint of a tensor's bytes (what the table shows)."""
    return hashlib.blake2b(t.detach().cpu().contiguous().numpy().tobytes(), digest_size=4).hexdigest()


class _Rank:
    """One rank's view of the job: its device, coordinates, groups and model shard."""

    def __init__(self, cfg: DemoConfig, rank: int, placement: Placement) -> None:
        import torch.distributed as dist

        self.cfg = cfg
        self.rank = rank
        platform = platforms.current()
        index = placement.index(int(os.environ.get("LOCAL_RANK", rank)))
        platform.set_device(index)  # forks, seeding and positions act on this rank's device
        self.device = platform.device(index)
        self.coords = {"dp": rank // cfg.tp, "tp": rank % cfg.tp}
        # Every rank must create every group, in the same order.
        tp_groups = [dist.new_group([d * cfg.tp + t for t in range(cfg.tp)]) for d in range(cfg.dp)]
        dp_groups = [dist.new_group([d * cfg.tp + t for d in range(cfg.dp)]) for t in range(cfg.tp)]
        self.tp_group, self.dp_group = tp_groups[self.coords["dp"]], dp_groups[self.coords["tp"]]
        # The same global weights on every rank (from a private host generator), then this rank's shards.
        init = torch.Generator().manual_seed(cfg.seed)
        hidden = _HIDDEN_PER_TP * cfg.tp
        w1 = torch.randn(hidden, _IN, generator=init) * 0.3
        w2 = torch.randn(_OUT, hidden, generator=init) * 0.3
        rows = slice(self.coords["tp"] * _HIDDEN_PER_TP, (self.coords["tp"] + 1) * _HIDDEN_PER_TP)
        self.w1 = w1[rows].clone().to(self.device).requires_grad_()  # column-parallel
        self.w2 = w2[:, rows].clone().to(self.device).requires_grad_()  # row-parallel

    def seed(self, base: int) -> dict[str, int]:
        """Seed every stream of the layout from ``base``; Python, NumPy and torch follow the default one."""
        from hyperrng.seeding.recipes import seed_host

        seeds = LAYOUT.seeds(base, self.coords)
        seed_host(seeds[DEFAULT_STREAM])
        apply_layout(LAYOUT, base, self.coords)
        return seeds

    def run(self, steps: range, report: Report) -> list[dict[str, Any]]:
        """Train ``steps``, reporting each as it ends."""
        rows = []
        for step in steps:
            rows.append(self.step(step))
            report(
                self.rank, f"step {step}", f"step {step}/{self.cfg.steps} done: loss {rows[-1]['loss']:.5f} on rank 0"
            )
        return rows

    def step(self, step: int) -> dict[str, Any]:
        # Data differs per data-parallel group and is identical across its TP ranks; the
        # host generators (seeded per dp) add noise, so their resume is exercised too.
        data = torch.Generator().manual_seed(combine64(_DATA_SEED_DOMAIN, self.cfg.seed, step, self.coords["dp"]))
        noise = float(np.random.rand()) + random.random()
        x = (torch.randn(_BATCH, _IN, generator=data) + noise).to(self.device)
        target = torch.randn(_BATCH, _OUT, generator=data).to(self.device)
        h = x @ self.w1.T
        with get_rng_tracker().fork(MODEL_PARALLEL_STREAM):
            keep_in = torch.rand_like(h) >= _DROPOUT
        h = h * keep_in / (1 - _DROPOUT)
        y = ReduceFromTP.apply(h @ self.w2.T, self.tp_group)
        keep_out = torch.rand_like(y) >= _DROPOUT
        y = y * keep_out / (1 - _DROPOUT)
        loss = ((y - target) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for w in (self.w1, self.w2):
                assert w.grad is not None
                if self.cfg.dp > 1:
                    all_reduce(w.grad, self.dp_group)
                    w.grad /= self.cfg.dp
                w -= _LEARNING_RATE * w.grad
                w.grad = None
        return {"loss": loss.item(), "in": _fp(keep_in), "out": _fp(keep_out), "w": _fp(self.w1) + _fp(self.w2)}

    def sharded_op(self) -> dict[str, Any]:
        from torch.distributed.tensor import Replicate, Shard

        from hyperrng.sharding.tracker import MeshInfo, ShardedRNGTracker
        from hyperrng.streams.fork import fork_rng

        tracker = ShardedRNGTracker()
        mesh = MeshInfo((self.cfg.dp, self.cfg.tp), (self.coords["dp"], self.coords["tp"]))
        with fork_rng():  # leave the default stream where training left it
            tracker.manual_seed(combine64(_SHARDED_SEED_DOMAIN, self.cfg.seed))
            with tracker.distribute_region(mesh, [Replicate(), Shard(0)], _SHARDED_SHAPE):
                local = torch.rand(_SHARDED_SHAPE[0] // self.cfg.tp, _SHARDED_SHAPE[1], device=self.device)
            position = tracker.platform.get_seed_offset()
        return {"fp": _fp(local), "position": position}

    def checkpoint_path(self) -> Path:
        return Path(self.cfg.workdir) / f"rank{self.rank}.pt"


def _train(rank: int, world_size: int, cfg: DemoConfig, placement: Placement, report: Report) -> dict[str, Any]:
    """Phase 1: seed, run one sharded op, train, verify, checkpoint at save_step, go on to the end."""
    from hyperrng.errors import RNGDesyncError
    from hyperrng.resume.state import rng_state_dict, save_rng_state
    from hyperrng.verify import verify_rng_sync

    r = _Rank(cfg, rank, placement)
    seeds = r.seed(cfg.seed)
    report(rank, "up", f"{world_size} ranks up; every stream seeded from base seed {cfg.seed}")
    sharded = r.sharded_op()
    report(rank, "sharded", f"sharded random op drawn on the {cfg.dp} x {cfg.tp} mesh")
    steps, verify_error = r.run(range(1, cfg.save_step + 1), report), ""
    try:
        verify_rng_sync(LAYOUT, r.coords)
    except RNGDesyncError as exc:
        verify_error = str(exc)
    state = rng_state_dict(layout=LAYOUT, coords=r.coords, base_seed=cfg.seed)
    weights = {"w1": r.w1.detach().cpu(), "w2": r.w2.detach().cpu()}  # device tensors are not saved as such
    save_rng_state(r.checkpoint_path(), {"rng": state, **weights})
    report(rank, "checkpoint", f"after step {cfg.save_step}: streams checked across ranks, RNG checkpoint saved")
    steps += r.run(range(cfg.save_step + 1, cfg.steps + 1), report)
    return {"coords": r.coords, "seeds": seeds, "sharded": sharded, "steps": steps, "verify_error": verify_error}


def _resume(rank: int, world_size: int, cfg: DemoConfig, placement: Placement, report: Report) -> list[dict[str, Any]]:
    """Phase 2, in fresh processes: scramble every generator, load the checkpoint, finish the run."""
    from hyperrng.resume.state import load_rng_state, load_rng_state_dict

    r = _Rank(cfg, rank, placement)
    r.seed(combine64(_SCRAMBLE_SEED_DOMAIN, cfg.seed))  # whatever the new processes start with must not matter
    saved = load_rng_state(r.checkpoint_path())
    load_rng_state_dict(saved["rng"], layout=LAYOUT, coords=r.coords)
    with torch.no_grad():
        r.w1.copy_(saved["w1"])
        r.w2.copy_(saved["w2"])
    report(
        rank, "up", f"{world_size} ranks up; generators scrambled, then the checkpoint of step {cfg.save_step} loaded"
    )
    steps = r.run(range(cfg.save_step + 1, cfg.steps + 1), report)
    return steps


def _torchrun_world_size() -> int | None:
    """``WORLD_SIZE`` of the torchrun job this process belongs to, or ``None`` outside one."""
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    try:
        return int(os.environ["WORLD_SIZE"])
    except ValueError as exc:
        raise InvalidArgumentError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer; is this a torchrun job?"
        ) from exc


def _torchrun_job(
    cfg: DemoConfig, placement: Placement, phases: Phases
) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]] | None:
    """Run both phases inside an existing torchrun job; rank 0 reports its progress and gets everyone's results.

    The process group it initialises stays up: the ``hyperrng demo`` command ends the process
    instead (``hyperrng.cli._leave_job`` says why).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        platforms.current().set_device(placement.index(local_rank))  # before the group, as nccl/hccl expect
        dist.init_process_group(placement.backend)
    rank = dist.get_rank()
    report = Report(phases=phases)
    phases.start("train", f"{cfg.size} ranks of the torchrun job joined")
    trained = _train(rank, cfg.size, cfg, placement, report)
    get_rng_tracker().reset()  # a resume inside the same processes: start from a blank tracker
    phases.start("resume", "the same processes start over from a blank tracker")
    resumed = _resume(rank, cfg.size, cfg, placement, report)
    everyone: list[Any] = [None] * cfg.size
    dist.all_gather_object(everyone, (trained, resumed))
    if rank != 0:
        return None
    return [t for t, _ in everyone], [res for _, res in everyone]


def _properties(cfg: DemoConfig) -> list[str]:
    """The properties every run checks, in the order of their verdicts (``--portable`` adds one)."""
    return [
        "dropout inside the TP region differs across TP ranks",
        "dropout after the TP region agrees across TP ranks",
        "sharded op: replicas equal, shards differ, one final position",
        "verify_rng_sync: streams shared exactly as the layout says",
        f"resume from step {cfg.save_step} is bit-identical",
    ]


_PORTABLE_PROPERTY = "portable mode: the same numbers at every TP size"


def _verdicts(
    cfg: DemoConfig, trained: list[dict[str, Any]], resumed: list[list[dict[str, Any]]], fresh: bool = True
) -> list[tuple[str, bool, str]]:
    """``(property, holds, detail)`` for each of :func:`_properties`, from every rank's results."""
    by_dp: dict[int, list[dict[str, Any]]] = {}
    by_tp: dict[int, set[str]] = {}
    for row in trained:
        by_dp.setdefault(row["coords"]["dp"], []).append(row)
        by_tp.setdefault(row["coords"]["tp"], set()).add(row["sharded"]["fp"])
    # Per data-parallel group and step, what its TP ranks drew.
    steps = [[row["steps"][s] for row in group] for group in by_dp.values() for s in range(cfg.steps)]
    sharded = {  # how the sharded op's result reads when a part of it is broken
        "replicas DIFFER": all(len(fps) == 1 for fps in by_tp.values()),
        "shards COLLIDE": len({next(iter(fps)) for fps in by_tp.values()}) == len(by_tp),
        "positions DISAGREE": len({tuple(row["sharded"]["position"]) for row in trained}) == 1,
    }
    errors = [row["verify_error"] for row in trained if row["verify_error"]]
    holds = [
        all(len({step["in"] for step in group}) == len(group) for group in steps),
        all(len({(step["out"], step["loss"]) for step in group}) == 1 for group in steps),
        all(sharded.values()),
        not errors,
        [row["steps"][cfg.save_step :] for row in trained] == resumed,
    ]
    details = [
        f"{cfg.steps} steps x {cfg.dp} dp group(s)",
        "masks and losses",
        ", ".join(broken for broken, ok in sharded.items() if not ok) or f"{len(by_tp)} shards x {cfg.dp} replica(s)",
        errors[0] if errors else "no desync",
        f"{'fresh processes' if fresh else 'after scrambling'}; steps {cfg.save_step + 1}..{cfg.steps}: "
        "losses, masks, weights",
    ]
    return list(zip(_properties(cfg), holds, details))


def _header(cfg: DemoConfig, platform: platforms.Platform, placement: Placement, torchrun: bool) -> list[str]:
    """What the demo will run and check, printed before any process starts."""
    if torchrun:
        how = f"joined a torchrun job of {cfg.size} ranks {placement.describe()}; resumed in the same processes"
    else:
        how = f"{cfg.size} processes {placement.describe()}; then {cfg.size} fresh ones for the resume"
    checks = [*_properties(cfg), _PORTABLE_PROPERTY] if cfg.portable else _properties(cfg)
    return [
        f"hyperrng demo: mesh dp={cfg.dp} x tp={cfg.tp} on platform {platform.name!r}",
        how,
        f"base seed {cfg.seed}; {cfg.steps} training steps; RNG checkpoint at step {cfg.save_step}",
        "checks:",
        *(f"  - {check}" for check in checks),
        "",
    ]


def run_demo(cfg: DemoConfig, progress: Callable[[str], None] | None = None) -> tuple[bool, str]:
    """Run the demo; return whether every property held and the report to print.

    Every flag is checked, and the platform resolved, before any process starts.
    Inside a torchrun job every rank runs it, and ranks other than 0 get ``(True, "")``.

    Args:
        cfg: what to run.
        progress: called with each line of progress as it happens: what will run and be
            checked (before any process starts), then one line per phase that every rank
            has completed. Called from another thread while the ranks run; ``None``: silent.

    Returns:
        Whether every property held, and the report: a per-rank table and one verdict
        per property.

    Raises:
        InvalidArgumentError, ArgumentTypeError: see :meth:`DemoConfig.resolved`.
        PlatformError: the platform cannot be selected, or cannot be rebuilt in the ranks.
        RankFailure: a rank raised or died (the other ranks are stopped at once).
    """
    from hyperrng.cli.launch import run_ranks  # looked up at the call, where a test may replace it

    cfg = cfg.resolved()
    platform = platforms.current()
    torchrun = _torchrun_world_size() is not None
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.size)) if torchrun else cfg.size
    placement = Placement.plan(platform, local_ranks)
    speaks = not torchrun or os.environ.get("RANK") == "0"
    emit = progress if progress is not None and speaks else _silent
    for line in _header(cfg, platform, placement, torchrun):
        emit(line)
    phases = Phases(emit, expected=1 if torchrun else cfg.size)  # inside torchrun, rank 0 reports for itself
    with tempfile.TemporaryDirectory(prefix="hyperrng-demo-") as tmp:
        cfg = replace(cfg, workdir=cfg.workdir or tmp)
        if torchrun:
            result = _torchrun_job(cfg, placement, phases)
            if result is None:
                return True, ""
            trained, resumed = result
        else:
            phases.start("train", f"starting {cfg.size} processes (each imports torch, then joins the group)")
            with relayed(phases) as report:
                trained = run_ranks(
                    _train, cfg.size, cfg, placement, report, backend=placement.backend, fork_server=True
                )
            phases.say(f"{cfg.size} processes finished")
            phases.start("resume", f"starting {cfg.size} fresh processes")
            with relayed(phases) as report:
                resumed = run_ranks(
                    _resume, cfg.size, cfg, placement, report, backend=placement.backend, fork_server=True
                )
            phases.say(f"{cfg.size} processes finished")
    verdicts = _verdicts(cfg, trained, resumed, fresh=not torchrun)
    if cfg.portable:
        phases.start("portable", "training under portable mode at every TP size dividing the world size")
        verdicts.append(_portable_verdict(cfg))
    ok = all(v for _, v, _ in verdicts)
    lines = ["", table(trained), "", *verdict_lines(verdicts)]
    lines += ["", "every property holds" if ok else "SOME PROPERTIES FAILED"]
    return ok, "\n".join(lines)


def _silent(line: str) -> None:
    """Progress nobody asked for."""


def _portable_verdict(cfg: DemoConfig) -> tuple[str, bool, str]:
    """Train the same model under portable mode at every TP size dividing the world size, on the platform's device."""
    from hyperrng.cli.demo._portable import tp_invariance_report

    world = cfg.size
    sizes = tuple(tp for tp in range(1, world + 1) if world % tp == 0)
    report = tp_invariance_report(sizes, world_size=world, steps=_PORTABLE_STEPS, seed=cfg.seed)
    same = report["params_identical"] and report["masks_identical"]
    drift = report["max_loss_difference"]
    holds = same and max(drift, report["max_attention_difference"]) <= _PORTABLE_LOSS_TOLERANCE
    detail = (
        f"TP={', '.join(map(str, sizes))} on {world} processes on {platforms.current().device_type}: "
        f"parameters and masks {'bit-identical' if same else 'DIFFER'}, losses within {drift:.1e}"
    )
    return _PORTABLE_PROPERTY, holds, detail


def main(cfg: DemoConfig | None = None, out: Callable[[str], None] | None = None) -> int:
    """Run the demo with ``cfg`` (default: :class:`DemoConfig`), printing its progress and report.

    A configuration the demo cannot run is one line on stderr, exit status 2, before any
    process starts; a rank that fails is one line naming it, exit status 1.

    Args:
        cfg: what to run.
        out: where each line goes, as it happens (default: ``print`` with a flush).

    Returns:
        0 when every property holds, 1 when one fails or a rank fails, 2 for a bad configuration.
    """
    emit = out if out is not None else _print
    try:
        ok, report = run_demo(cfg if cfg is not None else DemoConfig(), progress=emit)
    except RankFailure as exc:
        print(f"hyperrng demo: error: {exc.summary}", file=sys.stderr)
        return 1
    except HyperRNGError as exc:
        print(f"hyperrng demo: error: {exc}", file=sys.stderr)
        return 2
    for line in report.splitlines():
        emit(line)
    return 0 if ok else 1


def _print(line: str) -> None:
    print(line, flush=True)
