"""The main job: `hyperrng demo` proves every property with real processes, and says so."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hyperrng.demo import DemoConfig, _verdicts, main, run_demo
from hyperrng.errors import UsageError
from tests._dist import free_port

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.multiproc
def test_the_default_demo_passes_every_property(capsys: pytest.CaptureFixture[str]) -> None:
    assert main() == 0
    out = capsys.readouterr().out
    assert "mesh dp=2 x tp=2 on platform 'cpu'" in out
    assert out.count("[PASS]") == 5 and "[FAIL]" not in out
    assert "every property holds" in out
    for rank in range(4):
        assert f"\n   {rank}   {rank // 2}   {rank % 2}  0x" in out  # one table row per rank


@pytest.mark.multiproc
def test_the_demo_joins_a_torchrun_job() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "hyperrng", "demo", "--tp", "2", "--world-size", "2"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "joined a torchrun job of 2 ranks" in out.stdout
    assert out.stdout.count("[PASS]") == 5


@pytest.mark.parametrize(
    ("cfg", "fragment"),
    [
        (DemoConfig(world_size=4, tp=3), "cannot be arranged as dp x tp with tp=3"),
        (DemoConfig(world_size=0), "--world-size must be a positive integer"),
        (DemoConfig(tp=True), "--tp must be a positive integer"),
        (DemoConfig(steps=3, save_step=3), "--save-step must lie in [1, --steps - 1]"),
        (DemoConfig(steps=1, save_step=0), "--save-step must lie"),
    ],
)
def test_configurations_the_mesh_cannot_run_are_refused_before_any_process_starts(
    cfg: DemoConfig, fragment: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import hyperrng._launch as launch

    monkeypatch.setattr(launch, "run_ranks", lambda *a: pytest.fail("no process may start"))
    with pytest.raises(UsageError) as info:
        run_demo(cfg)
    assert fragment in str(info.value) and isinstance(info.value, ValueError)
    assert main(cfg=cfg) == 2
    assert fragment in capsys.readouterr().out


def _row(dp: int, tp: int, mask_in: str, mask_out: str, shard: str) -> dict:  # type: ignore[type-arg]
    steps = [{"loss": 1.0 + dp, "in": mask_in, "out": mask_out, "w": "w"} for _ in range(4)]
    return {"coords": {"dp": dp, "tp": tp}, "sharded": {"fp": shard, "position": (1, 48)}, "steps": steps,
            "verify_error": ""}  # fmt: skip


def _healthy() -> tuple[list[dict], list[list[dict]]]:  # type: ignore[type-arg]
    trained = [_row(0, 0, "a", "x", "s0"), _row(0, 1, "b", "x", "s1"), _row(1, 0, "a", "y", "s0"),
               _row(1, 1, "b", "y", "s1")]  # fmt: skip
    return trained, copy.deepcopy([row["steps"][2:] for row in trained])


def test_verdicts_pass_a_healthy_run() -> None:
    trained, resumed = _healthy()
    assert all(ok for _, ok, _ in _verdicts(DemoConfig(), trained, resumed))


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
    verdicts = _verdicts(DemoConfig(), trained, resumed)
    assert [i for i, (_, ok, _) in enumerate(verdicts) if not ok] == [failing]
