"""Every platform we ship passes the conformance suite that plug-in authors run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import platforms
from platforms.testing import PlatformConformance, check_platform


class TestCPUPlatform(PlatformConformance):
    @pytest.fixture
    def platform(self) -> platforms.Platform:
        return platforms.CPUPlatform()


class TestSimulatedPlatform(PlatformConformance):
    @pytest.fixture
    def platform(self) -> platforms.Platform:
        return platforms.SimulatedPlatform()


class TestCUDACodePathOnSimulatedModule(PlatformConformance):
    @pytest.fixture
    def platform(self) -> platforms.Platform:
        return platforms.CUDAPlatform(module=platforms.SimulatedDeviceModule(device_count=3, device_type="cuda"))


_NPU_ON_SIM = """
import torch, platforms
from platforms.testing import check_platform
module = platforms.SimulatedDeviceModule(device_count=2, device_type="npu")
npu = platforms.NPUPlatform(module=module)  # registers the module as torch.npu, as importing torch_npu does
check_platform(npu)
npu.set_seed_offset(7, 0, 1)
x = torch.rand(5, device=npu.device(1))  # torch's own op on an "npu" tensor draws from device 1
assert x.device == torch.device("npu", 1) and npu.get_seed_offset(1) == (7, 8), npu.get_seed_offset(1)
print("conformant")
"""


def test_npu_code_path_on_a_simulated_module_is_conformant() -> None:
    # In a fresh interpreter: naming torch's privateuse1 backend "npu" cannot be undone,
    # and would make torch itself look for a torch.npu module in every later test.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", _NPU_ON_SIM], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "conformant"


@pytest.mark.cuda
class TestRealCUDA(PlatformConformance):
    @pytest.fixture
    def platform(self) -> platforms.Platform:
        return platforms.CUDAPlatform()


@pytest.mark.npu
class TestRealNPU(PlatformConformance):
    @pytest.fixture
    def platform(self) -> platforms.Platform:
        return platforms.NPUPlatform()


def test_check_platform_runs_without_pytest_fixtures() -> None:
    check_platform(platforms.SimulatedPlatform())


def test_check_platform_names_the_failing_check() -> None:
    class LaxPlatform(platforms.SimulatedPlatform):
        def manual_seed(self, seed, index=None):  # type: ignore[no-untyped-def]
            self._seed(int(seed) % 2**64, 0)  # skips validation: wraps -1 silently

    with pytest.raises(AssertionError, match="conformance check 'refuses_bad_seeds' failed.*manual_seed\\(-1\\)"):
        check_platform(LaxPlatform())


# -- the kit catches platforms that get the device index wrong ----------------------------------
class _DeviceZeroOnly(platforms.CUDAPlatform):
    """A broken plug-in: every hook that takes a device index uses device 0 instead."""

    def __init__(self, broken: set[str]) -> None:
        super().__init__(module=platforms.SimulatedDeviceModule(device_count=3, device_type="cuda"))
        self._broken = broken

    def _read_state(self, index: int) -> Any:
        return super()._read_state(0 if "read" in self._broken else index)

    def _write_state(self, state: Any, index: int) -> None:
        super()._write_state(state, 0 if "write" in self._broken else index)

    def _seed(self, seed: int, index: int) -> None:
        super()._seed(seed, 0 if "seed" in self._broken else index)


@pytest.mark.parametrize("broken", [{"read"}, {"write"}, {"seed"}, {"read", "write"}, {"read", "write", "seed"}])
def test_the_kit_catches_a_platform_that_ignores_the_device_index(broken: set[str]) -> None:
    with pytest.raises(AssertionError, match="conformance check"):
        check_platform(_DeviceZeroOnly(broken))


def test_the_kit_passes_the_same_platform_when_it_honours_the_index() -> None:
    check_platform(_DeviceZeroOnly(set()))
