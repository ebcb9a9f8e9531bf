"""The main job: `hyperrng demo` proves every property with real processes where the platform is, and says so."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import hyperrng.platforms as platforms
import pytest
import torch
from hyperrng.platforms import _features

from hyperrng.cli.demo import MAX_LOCAL_RANKS, DemoConfig, _header, _verdicts, main, run_demo
from hyperrng.cli.demo._output import verdict_lines as _verdict_lines
from hyperrng.cli.launch import Placement as _Placement
from hyperrng.errors import ArgumentTypeError, InvalidArgumentError
from tests._demo_platforms import DIE_ENV, GATE_ENV
from tests._dist import free_port
from tests._platforms import cuda_on_sim

REPO = Path(__file__).resolve().parents[2]


def _positions(lines: list[str], fragments: list[str]) -> list[int]:
    """The index of the first line containing each fragment, in turn (each searched after the previous one)."""
    found, start = [], 0
    for fragment in fragments:
        index = next((i for i in range(start, len(lines)) if fragment in lines[i]), None)
        assert index is not None, f"{fragment!r} not found after line {start} of:\n" + "\n".join(lines)
        found.append(index)
        start = index + 1
    return found


# What the demo prints, in this order: what it will do and check, each phase, then the results.
_PHASES = [
    "hyperrng demo: mesh dp=",
    "checks:",
    "train ",
    "ranks up; every stream seeded from base seed",
    "sharded random op drawn",
    "step 1/4 done: loss ",
    "step 2/4 done",
    "after step 2: streams checked across ranks, RNG checkpoint saved",
    "step 3/4 done",
    "step 4/4 done",
    "4 processes finished",
    "resume ",
    "ranks up; generators scrambled, then the checkpoint of step 2 loaded",
    "step 3/4 done",
    "step 4/4 done",
    "[PASS] dropout inside the TP region",
    "every property holds",
]


@pytest.mark.multiproc
def test_the_default_demo_passes_every_property_in_lines_of_at_most_100_columns(
    capsys: pytest.CaptureFixture[str],
) -> None:
    platform = platforms.current()  # the demo runs where the platform is: HYPERRNG_PLATFORM=cuda on a GPU
    assert main() == 0
    out = capsys.readouterr().out
    placement = _Placement.plan(platform, 4).describe()
    assert f"mesh dp=2 x tp=2 on platform {platform.name!r}\n4 processes {placement};" in out
    assert out.count("[PASS]") == 5 and "[FAIL]" not in out
    _positions(out.splitlines(), _PHASES)
    for rank in range(4):
        assert f"\n   {rank}   {rank // 2}   {rank % 2}  0x" in out  # one table row per rank
    assert max(len(line) for line in out.splitlines()) <= 100, max(out.splitlines(), key=len)


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_demo_prints_its_plan_and_each_phase_while_the_ranks_run(tmp_path: Path) -> None:
    # The ranks wait at a gate (a file) as they start: a line the test reads before opening it
    # was printed while no rank had done any work. The gate closes again once every train rank
    # is past it, so the resume's fresh ranks wait too while the test reads the train's lines.
    gate = tmp_path / "gate"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HYPERRNG_PLATFORM": "tests._demo_platforms:gated",
           GATE_ENV: str(gate)}  # fmt: skip
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "hyperrng", "demo"], stdout=subprocess.PIPE, stderr=err,
                                text=True, env=env, cwd=REPO)  # fmt: skip
        assert proc.stdout is not None
        lines: list[str] = []

        def read_through(fragment: str) -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                lines.append(line.rstrip("\n"))
                if fragment in line:
                    return
            pytest.fail(f"the demo ended before printing {fragment!r}:\n" + "\n".join(lines))

        read_through("starting 4 processes")
        assert lines[0].startswith("hyperrng demo: mesh dp=2 x tp=2 on platform 'gated'") and "checks:" in lines
        gate.touch()
        read_through("step 1/4 done")
        gate.unlink()
        read_through("starting 4 fresh processes")
        assert not any("checkpoint of step 2 loaded" in line for line in lines)  # no resume rank has started work
        gate.touch()
        lines += proc.stdout.read().splitlines()
        assert proc.wait() == 0
    assert (tmp_path / "stderr").read_text() == ""
    _positions(lines, _PHASES)


def _demo(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The demo in a fresh process, with ``env`` and without the caller's HYPERRNG_PLATFORM unless ``env`` sets it."""
    base = {k: v for k, v in os.environ.items() if k != platforms.ENV_VAR}
    full_env = {**base, "PYTHONPATH": os.pathsep.join([str(REPO), env.pop("PYTHONPATH", "")]), **env}
    return subprocess.run([sys.executable, "-m", "hyperrng", "demo", *args], capture_output=True, text=True,
                          env=full_env, timeout=600, cwd=REPO)  # fmt: skip


@pytest.mark.needs_sim
@pytest.mark.slow
@pytest.mark.multiproc
def test_on_the_simulated_accelerator_four_ranks_share_two_devices_and_every_property_holds() -> None:
    out = _demo(HYPERRNG_PLATFORM="sim")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (
        "on platform 'sim'\n4 processes over gloo, 4 ranks sharing 2 'sim' device(s), tensors staged through the host;"
        in out.stdout
    )
    assert out.stdout.count("[PASS]") == 5 and "every property holds" in out.stdout


PLUGIN = """
import hyperrng.platforms as platforms


class SimPlug(platforms.SimulatedPlatform):
    name = "simplug"
"""


@pytest.mark.needs_sim
@pytest.mark.slow
@pytest.mark.multiproc
def test_an_installed_plugin_on_the_simulated_device_is_chosen_and_every_rank_runs_on_it(tmp_path: Path) -> None:
    (tmp_path / "simplug.py").write_text(PLUGIN)
    info = tmp_path / "simplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: simplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{platforms.ENTRY_POINT_GROUP}]\nsimplug = simplug:SimPlug\n")
    out = _demo("--world-size", "2", "--steps", "2", "--save-step", "1", PYTHONPATH=str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "on platform 'simplug'\n2 processes over gloo, one 'sim' device each, tensors staged" in out.stdout
    assert out.stdout.count("[PASS]") == 5


class ProgrammaticPlug(platforms.SimulatedPlatform):
    """A plug-in chosen with ``hyperrng.platforms.use``: the rank processes rebuild it from its class."""

    name = "progplug"


@pytest.mark.needs_sim
@pytest.mark.slow
@pytest.mark.multiproc
def test_a_platform_chosen_programmatically_reaches_the_rank_processes(capsys: pytest.CaptureFixture[str]) -> None:
    with platforms.use(ProgrammaticPlug()):
        assert main(DemoConfig(world_size=2, steps=2, save_step=1)) == 0
    out = capsys.readouterr().out
    assert "on platform 'progplug'\n2 processes over gloo, one 'sim' device each" in out
    assert out.count("[PASS]") == 5


@pytest.mark.multiproc
def test_the_demo_joins_a_torchrun_job() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "hyperrng", "demo", "--tp", "2", "--world-size", "2"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-8000:]  # a rank's own last words come before torchrun's summary
    placement = _Placement.plan(platforms.current(), 2).describe()  # the job runs where HYPERRNG_PLATFORM says
    assert f"joined a torchrun job of 2 ranks {placement}" in out.stdout
    assert out.stdout.count("[PASS]") == 5


@pytest.mark.multiproc
def test_under_torchrun_a_world_size_that_contradicts_the_job_is_an_error() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "hyperrng", "demo", "--world-size", "4"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert out.returncode != 0
    assert "hyperrng demo: error: --world-size 4 contradicts the torchrun job, which has WORLD_SIZE=2" in out.stderr
    assert "[PASS]" not in out.stdout


@pytest.mark.parametrize(
    ("cfg", "error", "fragment"),
    [
        (DemoConfig(world_size=4, tp=3), InvalidArgumentError, "cannot be arranged as dp x tp with tp=3"),
        (DemoConfig(world_size=0), InvalidArgumentError, "--world-size must be a positive integer"),
        (
            DemoConfig(world_size=MAX_LOCAL_RANKS + 2),
            InvalidArgumentError,
            f"the demo starts at most {MAX_LOCAL_RANKS}",
        ),
        (DemoConfig(tp=True), InvalidArgumentError, "--tp must be a positive integer"),
        (DemoConfig(steps=3, save_step=3), InvalidArgumentError, "--save-step must lie in [1, --steps - 1]"),
        (DemoConfig(steps=1, save_step=0), InvalidArgumentError, "--save-step must lie"),
        (DemoConfig(seed=-1), InvalidArgumentError, "--seed: seed must be in [0, 2**64 - 1], got -1"),
        (DemoConfig(seed=2**64), InvalidArgumentError, "got 18446744073709551616"),
        (DemoConfig(seed="7"), ArgumentTypeError, "--seed: seed must be an int"),  # type: ignore[arg-type]
        pytest.param(
            DemoConfig(world_size=16, tp=4, portable=True),
            InvalidArgumentError,
            "--portable trains at every TP size",
            marks=pytest.mark.needs_portable_mode,  # before 2.9, --portable is refused first, for lack of it
        ),
        (DemoConfig(portable=1), ArgumentTypeError, "portable must be True or False"),  # type: ignore[arg-type]
    ],
)
def test_configurations_the_demo_cannot_run_are_refused_before_any_process_starts(
    cfg: DemoConfig,
    error: type[Exception],
    fragment: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import hyperrng.cli.launch as launch

    monkeypatch.setattr(launch, "run_ranks", lambda *a, **k: pytest.fail("no process may start"))
    with pytest.raises(error) as info:
        run_demo(cfg)
    assert fragment in str(info.value)
    assert main(cfg) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"hyperrng demo: error: {info.value}\n"


def test_on_a_torch_without_portable_mode_the_portable_demo_is_refused_before_any_process_starts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import hyperrng.cli.launch as launch
    from hyperrng import cli

    # portable mode is detected by the APIs its mechanism uses; take one away
    monkeypatch.delattr(torch.library.Library, "fallback")
    monkeypatch.setattr(launch, "run_ranks", lambda *a, **k: pytest.fail("no process may start"))
    assert cli.main(["demo", "--portable"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("hyperrng demo: error: --portable: portable mode (hyperrng.portable_random) needs")
    assert "torch >= 2.9" in captured.err and captured.err.count("\n") == 1


def test_outside_torchrun_the_world_size_defaults_to_four(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert DemoConfig().resolved().world_size == 4
    assert DemoConfig(world_size=6, tp=3).resolved().dp == 2


def test_inside_torchrun_the_job_decides_the_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert DemoConfig().resolved().world_size == 8
    assert DemoConfig(world_size=8).resolved().world_size == 8
    with pytest.raises(
        InvalidArgumentError, match="--world-size 2 contradicts the torchrun job, which has WORLD_SIZE=8"
    ):
        DemoConfig(world_size=2).resolved()
    if _features.feature("portable-mode").available:  # before 2.9, --portable is refused for lack of it
        with pytest.raises(InvalidArgumentError, match="run it outside torchrun"):
            DemoConfig(portable=True).resolved()


@pytest.mark.needs_sim
@pytest.mark.slow
@pytest.mark.multiproc
def test_with_portable_the_demo_trains_every_tp_size_to_the_same_numbers_on_the_simulated_device() -> None:
    out = _demo("--portable", HYPERRNG_PLATFORM="sim")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (
        "[PASS] portable mode: the same numbers at every TP size\n"
        "         TP=1, 2, 4 on 4 processes on sim: parameters and masks bit-identical, losses within "
    ) in out.stdout
    assert out.stdout.count("[PASS]") == 6 and "every property holds" in out.stdout


# -- where the ranks run ----------------------------------------------------------------------


def test_on_the_cpu_every_rank_runs_on_the_host_over_gloo_without_staging() -> None:
    plan = _Placement.plan(platforms.CPUPlatform(), local_ranks=4)
    assert (plan.backend, plan.staged, plan.index(3)) == ("gloo", False, 0)
    assert plan.describe() == "over gloo on the host"


def test_an_accelerator_with_a_device_per_rank_uses_its_own_backend() -> None:
    plan = _Placement.plan(cuda_on_sim(), local_ranks=2)  # two devices, backend nccl
    assert (plan.backend, plan.staged, [plan.index(r) for r in range(2)]) == ("nccl", False, [0, 1])
    assert plan.describe() == "over nccl, one 'cuda' device each"


def test_ranks_that_must_share_devices_fall_back_to_gloo_staged_through_the_host() -> None:
    plan = _Placement.plan(cuda_on_sim(), local_ranks=4)
    assert (plan.backend, plan.staged, [plan.index(r) for r in range(4)]) == ("gloo", True, [0, 1, 0, 1])
    assert plan.describe() == "over gloo, 4 ranks sharing 2 'cuda' device(s), tensors staged through the host"


@pytest.mark.needs_sim
def test_the_simulated_device_stages_through_the_host_even_with_a_device_per_rank() -> None:
    plan = _Placement.plan(platforms.SimulatedPlatform(), local_ranks=2)  # its backend is gloo
    assert (plan.backend, plan.staged) == ("gloo", True)


# -- a rank that dies -----------------------------------------------------------------------------


@pytest.mark.multiproc
def test_a_rank_that_dies_ends_the_demo_with_one_line_naming_it_and_its_exit_code() -> None:
    out = _demo("--world-size", "2", "--steps", "3", HYPERRNG_PLATFORM="tests._demo_platforms:dying",
                **{DIE_ENV: "1:7"})  # fmt: skip
    assert out.returncode == 1
    assert out.stderr.splitlines() == ["hyperrng demo: error: rank 1 died with exit code 7 without answering"]
    assert "Traceback" not in out.stdout + out.stderr and "[PASS]" not in out.stdout
    assert "starting 2 processes" in out.stdout and "ranks up" not in out.stdout  # the progress up to the death


def _row(dp: int, tp: int, mask_in: str, mask_out: str, shard: str) -> dict:  # type: ignore[type-arg]
    steps = [{"loss": 1.0 + dp, "in": mask_in, "out": mask_out, "w": "w"} for _ in range(4)]
    return {"coords": {"dp": dp, "tp": tp}, "sharded": {"fp": shard, "position": (1, 48)}, "steps": steps,
            "verify_error": ""}  # fmt: skip


def _healthy() -> tuple[list[dict], list[list[dict]]]:  # type: ignore[type-arg]
    trained = [_row(0, 0, "a", "x", "s0"), _row(0, 1, "b", "x", "s1"), _row(1, 0, "a", "y", "s0"),
               _row(1, 1, "b", "y", "s1")]  # fmt: skip
    return trained, copy.deepcopy([row["steps"][2:] for row in trained])


def test_a_verdict_whose_detail_is_too_long_puts_it_below_wrapped_and_loses_no_word() -> None:
    detail = "stream 'model-parallel-rng' out of sync on ranks " + ", ".join(map(str, range(40)))
    lines = _verdict_lines([("short", True, "fine"), ("verify_rng_sync: streams shared", False, detail)])
    assert lines[:2] == ["  [PASS] short  (fine)", "  [FAIL] verify_rng_sync: streams shared"]
    assert all(len(line) <= 100 and line.startswith(" " * 9) for line in lines[2:])
    assert " ".join(" ".join(lines[2:]).split()) == detail


def test_verdicts_pass_a_healthy_run() -> None:
    trained, resumed = _healthy()
    assert all(ok for _, ok, _ in _verdicts(DemoConfig(world_size=4), trained, resumed))


def test_the_plan_lists_each_property_by_the_name_its_verdict_gives_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    cpu = platforms.CPUPlatform()
    for cfg in (DemoConfig(world_size=4).resolved(), DemoConfig(world_size=4, save_step=3).resolved()):
        plan = _header(cfg, cpu, _Placement.plan(cpu, cfg.size), torchrun=False)
        trained, resumed = _healthy()
        named = [name for name, _, _ in _verdicts(cfg, trained, resumed)]
        assert [line.removeprefix("  - ") for line in plan if line.startswith("  - ")] == named


@pytest.mark.parametrize(
    ("damage", "failing"),
    [
        (lambda t, r: t[1]["steps"][0].update({"in": "a"}), 0),  # TP ranks drew one mask inside the region
        (lambda t, r: t[1]["steps"][1].update({"out": "z"}), 1),  # TP ranks disagree after the region
        (lambda t, r: t[2]["sharded"].update({"fp": "s9"}), 2),  # a replica drew other numbers
        (lambda t, r: t[3]["sharded"].update({"position": (1, 52)}), 2),  # a rank left elsewhere
        (lambda t, r: t[0].update({"verify_error": "stream 'x' out of sync"}), 3),
        (lambda t, r: r[3][1].update({"loss": 2.5}), 4),  # the resume diverged on its last step
    ],
)
def test_verdicts_fail_exactly_the_broken_property(damage, failing: int) -> None:  # type: ignore[no-untyped-def]
    trained, resumed = copy.deepcopy(_healthy())
    damage(trained, resumed)
    verdicts = _verdicts(DemoConfig(world_size=4), trained, resumed)
    assert [i for i, (_, ok, _) in enumerate(verdicts) if not ok] == [failing]
