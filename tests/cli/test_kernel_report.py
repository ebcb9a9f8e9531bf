"""The kernel report (``hyperrng.cli.bench.kernel_report``): the library's Triton kernels compiled for sm_90
without a GPU hold their targets (no spill, instructions per element against the ``tl.philox`` reference),
and the report reads machine code right."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.needs_triton, pytest.mark.slow]

triton = pytest.importorskip("triton")
if not hasattr(triton, "knobs") or not os.path.exists(triton.knobs.nvidia.cuobjdump.path):  # Triton < 3.4
    pytest.skip(f"the kernel report needs Triton 3.4 or newer with its NVIDIA tools; this is {triton.__version__}",
                allow_module_level=True)  # fmt: skip

from hyperrng.cli.bench import kernel_report as kr  # noqa: E402


@pytest.fixture(scope="module")
def quick_sm90() -> list[kr.Figures]:
    return kr.report([90], quick=True)


def test_the_kernels_the_targets_name_meet_them_on_sm90(quick_sm90: list[kr.Figures]) -> None:
    """CI's gate: no kernel spills and every bound of TARGETS holds (what `.ci/kernel-report --check` prints)."""
    assert kr.check(quick_sm90) == []
    names = {r.variant for r in quick_sm90}
    assert {target.variant for target in kr.TARGETS} <= names, "a target names a variant the report does not build"


def test_the_same_kernels_spill_nothing_on_sm80() -> None:
    """Ampere (A100) takes other attention tiles and no register caps: with Hopper's, 16-bit dk/dv at head
    dim 64 spilled up to 540 bytes a thread there."""
    found = kr.report([80], quick=True)
    assert [r for r in found if r.spills] == []
    assert kr.check(found) == []


def test_the_report_reads_the_reference_kernel_as_ptxas_built_it(quick_sm90: list[kr.Figures]) -> None:
    reference = next(r for r in quick_sm90 if r.variant == "reference")
    assert (reference.kernel, reference.elements, reference.warps) == ("uniform_kernel", 2048, 4)
    assert reference.stores == ((128, 4),)  # 2,048 float32 in 128-bit stores: 4 a thread of 128
    assert reference.loop == 0 and not reference.spills and reference.stack_bytes == 0
    assert 0 < reference.instructions < 2048 and 0 < reference.registers <= 255
    assert reference.ctas_per_sm >= 8


def test_every_launch_of_a_variant_is_compiled_and_attention_loops_are_found(quick_sm90: list[kr.Figures]) -> None:
    attention = {r.kernel: r for r in quick_sm90 if r.variant == "attention bf16 d64 dropout"}
    assert set(attention) == {"_attn_fwd", "_attn_bwd_delta", "_attn_bwd_dkdv", "_attn_bwd_dq"}
    for name in ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq"):
        assert 0 < attention[name].loop < attention[name].instructions
    draws = [r for r in quick_sm90 if r.kernel == "draw_kernel"]
    assert draws and all(r.elements == 2048 and r.per_element is not None for r in draws)


def test_compiling_launches_nothing_and_puts_triton_back() -> None:
    from triton.runtime import driver

    from hyperrng import philox
    from hyperrng.philox import _shards

    hook, active = triton.knobs.runtime.jit_cache_hook, getattr(driver, "_active", None)
    out = torch.full((4096,), 7.0, device="meta")
    with kr.compiling(80) as got:
        draw = philox.uniform_draw(torch.float32, 0.0, 1.0)
        philox.run(draw, _shards.ShardGeometry.of((4096,)), 1, 0, torch.device("meta"), False, out, "triton")
    assert len(got) == 1 and got[0][0].metadata.target.arch == 80 and got[0][1]["BLOCK"] == 512
    assert triton.knobs.runtime.jit_cache_hook is hook and getattr(driver, "_active", None) is active


def test_the_report_refuses_to_compile_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="unset TRITON_INTERPRET"):
        with kr.compiling(90):
            pass


def _figures(**changes: object) -> kr.Figures:
    base = dict(arch=90, variant="uniform f32", kernel="draw_kernel", warps=4, registers=40, stack_bytes=0,
                spill_stores=0, spill_loads=0, shared_bytes=0, instructions=300, loop=0, elements=2048,
                stores=((128, 4),))  # fmt: skip
    return kr.Figures(**{**base, **changes})  # type: ignore[arg-type]


def test_check_names_a_spill_and_a_missed_bound() -> None:
    reference = _figures(variant="reference", kernel="uniform_kernel", instructions=300)
    spilling = _figures(variant="attention f32 d128", kernel="_attn_fwd", spill_stores=8, spill_loads=8, elements=0)
    stack_only = _figures(variant="normal f32", stack_bytes=32)  # sin's slow path: a frame, not a spill
    slow = _figures(instructions=600)
    found = kr.check([reference, spilling, stack_only, slow])
    assert any("attention f32 d128 (_attn_fwd): spills registers (8 bytes stored" in line for line in found)
    assert not any("normal f32" in line for line in found)
    uniform_bound = next((t for t in kr.TARGETS if t.variant == "uniform f32"), None)
    if uniform_bound is not None and uniform_bound.bound < 2.0:
        assert any("uniform f32" in line and "2.00x the reference" in line for line in found)


def test_occupancy_follows_registers_warps_and_shared_memory() -> None:
    assert _figures(registers=32, warps=4).ctas_per_sm == 16  # 64 warps a SM, 4 a block
    assert _figures(registers=128, warps=4).ctas_per_sm == 4  # 65,536 registers / (128 x 128 threads)
    assert _figures(registers=173, warps=8).ctas_per_sm == 1
    assert _figures(registers=32, warps=4, shared_bytes=100 * 1024).ctas_per_sm == 2  # 228 KiB on sm_90
    assert _figures(arch=80, registers=32, warps=4, shared_bytes=100 * 1024).ctas_per_sm == 1  # 164 KiB


def test_the_command_prints_a_row_per_kernel_and_its_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert kr.main(["--arch", "90", "--quick", "--check"]) == 0
    out = capsys.readouterr().out
    assert "compiled for sm_90" in out and "reference" in out and "every target met." in out
    assert max(len(line) for line in out.splitlines()) <= 100


@pytest.mark.needs_sim
def test_the_host_path_script_times_every_op() -> None:
    """``.ci/host-path`` (a draw's host time on a GPU, measured without one) runs in a process of its own and
    prints the three figures of each op: it keeps working as the launch code changes. No figure is checked
    (timings; see docs/performance.md)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / ".ci" / "host-path"
    run = subprocess.run([sys.executable, str(script), "--rounds", "1"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in run.stdout.splitlines()[2:]}
    assert set(rows) == {"uniform_", "normal_", "bernoulli_.float", "native_dropout"}, run.stdout
    assert all(len(figures) == 3 and all(float(f) > 0 for f in figures) for figures in rows.values()), run.stdout
