"""Every platform we ship passes the conformance suite that plug-in authors run."""

from __future__ import annotations

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


def _emulate_torch_npu_device_name() -> None:
    """Do what importing torch_npu does: make torch accept the device type 'npu'."""
    import torch

    try:
        torch.device("npu")
    except RuntimeError:
        torch.utils.rename_privateuse1_backend("npu")


class TestNPUCodePathOnSimulatedModule(PlatformConformance):
    @pytest.fixture
    def platform(self) -> platforms.Platform:
        _emulate_torch_npu_device_name()
        return platforms.NPUPlatform(module=platforms.SimulatedDeviceModule(device_count=2, device_type="npu"))


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
