"""Every platform we ship passes the conformance suite that plug-in authors run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch
from hyperrng.platforms import registry
from hyperrng.platforms.testing import CHECKS, PlatformConformance, check_platform

from tests._platforms import BarePlatform


class TestCPUPlatform(PlatformConformance):
    @pytest.fixture
    def platform(self) -> platforms.Platform:
        return platforms.CPUPlatform()


@pytest.mark.needs_sim
class TestSimulatedPlatform(PlatformConformance):
    @pytest.fixture
    def platform(self) -> platforms.Platform:
        return platforms.SimulatedPlatform()


class TestCUDACodePathOnSimulatedModule(PlatformConformance):
    @pytest.fixture
    def platform(self) -> platforms.Platform:
        return platforms.CUDAPlatform(module=platforms.SimulatedDeviceModule(device_count=3, device_type="cuda"))


_NPU_ON_SIM = """
import torch
import hyperrng.platforms as platforms
from hyperrng.platforms.testing import check_platform
module = platforms.SimulatedDeviceModule(device_count=2, device_type="npu")
npu = platforms.NPUPlatform(module=module)  # registers the module as torch.npu, as importing torch_npu does
check_platform(npu)
npu.set_seed_offset(7, 0, 1)
x = torch.rand(5, device=npu.device(1))  # torch's own op on an "npu" tensor draws from device 1
assert x.device == torch.device("npu", 1) and npu.get_seed_offset(1) == (7, 8), npu.get_seed_offset(1)
print("conformant")
"""


@pytest.mark.needs_sim
def test_npu_code_path_on_a_simulated_module_is_conformant() -> None:
    # In a fresh interpreter: naming torch's privateuse1 backend "npu" cannot be undone,
    # and would make torch itself look for a torch.npu module in every later test.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
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


@pytest.mark.needs_sim
def test_check_platform_runs_without_pytest_fixtures() -> None:
    check_platform(platforms.SimulatedPlatform())


@pytest.mark.needs_sim
def test_check_platform_names_the_failing_check() -> None:
    class LaxPlatform(platforms.SimulatedPlatform):
        def manual_seed(self, seed, index=None):  # type: ignore[no-untyped-def]
            self._write_state(platforms.pack_counter_state(int(seed) % 2**64, 0), 0)  # wraps -1 silently

    with pytest.raises(AssertionError, match="conformance check 'refuses_bad_seeds' failed.*manual_seed\\(-1\\)"):
        check_platform(LaxPlatform())


# -- the kit catches platforms that get the device index wrong ----------------------------------
class _DeviceZeroOnly(platforms.CUDAPlatform):
    """A broken plug-in: the hooks named in ``broken`` ignore the device index they are given.

    ``"read"``, ``"write"``: the hook uses device 0; ``"state_io"``: ``_state_io(i)``
    returns device 0's accessors; ``"state_io-current"``: it returns the current device's.
    """

    def __init__(self, broken: set[str]) -> None:
        super().__init__(module=platforms.SimulatedDeviceModule(device_count=3, device_type="cuda"))
        self._broken = broken

    def _read_state(self, index: int) -> Any:
        return super()._read_state(0 if "read" in self._broken else index)

    def _write_state(self, state: Any, index: int) -> None:
        super()._write_state(state, 0 if "write" in self._broken else index)

    def _state_io(self, index: int | None = None) -> platforms.StateIO:
        if "state_io" in self._broken:
            return super()._state_io(0)
        if "state_io-current" in self._broken:
            return super()._state_io(None)
        return super()._state_io(index)


_INDEX = "conformance check 'each_device_is_addressed_by_its_index' failed"
_INDEPENDENT = "conformance check 'devices_are_independent' failed.*seeding device 1 changed device 0"
_STATE_IO = "conformance check 'state_io_addresses_each_device' failed.*state_io\\(1\\).*not device 1's"


_MUTANTS = [
    ({"read"}, _INDEX + ".*report one state"),
    ({"write"}, _INDEPENDENT),
    ({"read", "write"}, _INDEPENDENT),
    ({"state_io"}, _STATE_IO),
    ({"state_io-current"}, _STATE_IO),
]


@pytest.mark.parametrize(("broken", "message"), [pytest.param(b, m, id="+".join(sorted(b))) for b, m in _MUTANTS])
def test_the_kit_catches_a_platform_that_ignores_the_device_index(broken: set[str], message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_platform(_DeviceZeroOnly(broken))


def test_the_kit_passes_the_same_platform_when_it_honours_the_index() -> None:
    check_platform(_DeviceZeroOnly(set()))


class _StateIOOnDeviceZero(platforms.SimulatedPlatform):
    """The audit's case: every other operation honours the index, ``_state_io`` acts on device 0."""

    def _state_io(self, index: int | None = None) -> platforms.StateIO:
        return super()._state_io(0)


@pytest.mark.needs_sim
def test_the_kit_catches_a_simulated_platform_whose_state_io_acts_on_device_0() -> None:
    with pytest.raises(AssertionError, match=_STATE_IO):
        check_platform(_StateIOOnDeviceZero())


class _StateIOWritesDeviceZero(platforms.SimulatedPlatform):
    """Reads the right device, writes device 0."""

    def _state_io(self, index: int | None = None) -> platforms.StateIO:
        right, zero = super()._state_io(index), super()._state_io(0)
        return right._replace(write=zero.write)


@pytest.mark.needs_sim
def test_the_kit_catches_a_state_io_whose_write_lands_on_another_device() -> None:
    with pytest.raises(AssertionError, match="state_io\\(1\\).*did not restore device 1's state \\(device 0 holds"):
        check_platform(_StateIOWritesDeviceZero())


class _StateIOFollowsTheDeviceCurrentWhenUsed(platforms.SimulatedPlatform):
    """Accessors that look the device up when they run, as a fork's cached accessors must not."""

    def _state_io(self, index: int | None = None) -> platforms.StateIO:
        return platforms.StateIO(self.get_rng_state, self.set_rng_state, torch.Tensor.clone, torch.Tensor.clone)


@pytest.mark.needs_sim
def test_the_kit_catches_state_io_accessors_that_follow_the_current_device() -> None:
    with pytest.raises(AssertionError, match=_STATE_IO):
        check_platform(_StateIOFollowsTheDeviceCurrentWhenUsed())


class _MoveIgnoresTheDrawDomain(platforms.CPUPlatform):
    """A fast path that is not the checked one: regions would draw from the free domain."""

    def _move(self, seed: int, offset: int, draw: bool) -> None:
        super()._move(seed, offset, False)


def test_the_kit_catches_a_region_fast_path_that_positions_differently() -> None:
    with pytest.raises(AssertionError, match=r"_move\(11, 8, True\) differs from set_seed_offset"):
        check_platform(_MoveIgnoresTheDrawDomain())


@pytest.mark.needs_sim
def test_the_state_io_check_leaves_every_state_and_the_current_device_as_it_found_them() -> None:
    sim = platforms.SimulatedPlatform()
    saved = [sim.get_rng_state(i) for i in range(sim.device_count())]
    home = sim.current_device()
    sim.set_device(1)
    try:
        sim.set_seed_offset(77, 12, 1)
        before = [sim.get_rng_state(i) for i in range(sim.device_count())]
        CHECKS["state_io_addresses_each_device"](sim)  # alone: no restoring wrapper around it
        assert sim.current_device() == 1
        assert all(torch.equal(sim.get_rng_state(i), s) for i, s in enumerate(before))
    finally:
        sim.set_device(home)
        for i, s in enumerate(saved):
            sim.set_rng_state(s, i)


# -- the kit names the methods a platform does not implement -----------------------------------
class _Half(platforms.Platform):
    """A plug-in that implements device_count, but not _read_state and _write_state."""

    name = "half"

    def device_count(self) -> int:
        return 1


_ALL_THREE = "device_count\\(\\), _read_state\\(index\\), _write_state\\(state, index\\)"


def test_check_platform_names_every_method_a_platform_does_not_implement() -> None:
    with pytest.raises(AssertionError, match="'implements_the_required_methods' failed.*" + _ALL_THREE) as info:
        check_platform(BarePlatform())
    assert "implement them" in str(info.value)
    assert not isinstance(info.value.__cause__, NotImplementedError)


def test_check_platform_names_only_the_methods_that_are_missing() -> None:
    with pytest.raises(AssertionError, match="_Half does not implement _read_state\\(index\\), _write_state") as info:
        check_platform(_Half())
    assert "device_count" not in str(info.value)


_BARE_SUITE = """
import pytest
import hyperrng.platforms as platforms
from hyperrng.platforms.testing import PlatformConformance


class Bare(platforms.Platform):
    name = "bare"


class TestBare(PlatformConformance):
    @pytest.fixture
    def platform(self):
        return Bare()
"""


def test_the_pytest_class_fails_every_check_naming_the_missing_methods(tmp_path: Path) -> None:
    (tmp_path / "test_bare.py").write_text(textwrap.dedent(_BARE_SUITE))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "test_bare.py"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert summary.startswith(f"{len(CHECKS)} failed") and "error" not in summary, summary
    # One failure report per check (the short summary repeats them, in full only under CI=true).
    reports = [line for line in out.stdout.splitlines() if line.startswith("E ") and "AssertionError: Bare" in line]
    assert len(reports) == len(CHECKS) and all("does not implement device_count()" in line for line in reports)
    assert "NotImplementedError:" not in out.stdout  # no check stopped at the base class's raise


class _DictStatePlatform(platforms.Platform):
    """A plug-in that keeps a (seed, offset) "state" in a dict and never touches the device's generator."""

    name = "dictstate"
    device_type = "cpu"
    counter_based = True

    def __init__(self) -> None:
        self._kept = {0: platforms.pack_counter_state(0, 0)}

    def device_count(self) -> int:
        return 1

    def _read_state(self, index: int) -> torch.Tensor:
        return self._kept[index].clone()

    def _write_state(self, state: torch.Tensor, index: int) -> None:
        self._kept[index] = state.clone()


class _StateIsADict(_DictStatePlatform):
    """A plug-in whose ``_read_state`` hands back a dict: the restoring around every check fails too."""

    def _read_state(self, index: int) -> Any:
        return {"state": self._kept[index].clone()}


class _ProbeRaises(platforms.CPUPlatform):
    def probe(self) -> str | None:
        raise RuntimeError("driver crashed")


class _SetDeviceRaises(platforms.CPUPlatform):
    def set_device(self, index: int) -> None:
        raise KeyError(index)


@pytest.mark.parametrize(
    ("platform", "message"),
    [
        (_StateIsADict, "check 'state_is_a_cpu_byte_copy' failed for .*: get_rng_state\\(\\) returned a dict, not a"),
        (_ProbeRaises, "check 'probe_finds_it_available' failed for .*: it raised RuntimeError: driver crashed"),
        (_SetDeviceRaises, "check 'switches_the_current_device' failed for .*: it raised KeyError: 0"),
    ],
    ids=["state-is-a-dict", "probe-raises", "set-device-raises"],
)
def test_check_platform_turns_any_failure_into_an_assertion_naming_the_check(
    platform: type[platforms.Platform], message: str
) -> None:
    with pytest.raises(AssertionError, match=message):
        check_platform(platform())


# -- the kit blames the reading or restoring of states on a check of its own --------------------
class _WriteStateRaises(platforms.CPUPlatform):
    def _write_state(self, state: torch.Tensor, index: int) -> None:
        raise RuntimeError("write refused")


class _ReadStateRaises(platforms.CPUPlatform):
    def _read_state(self, index: int) -> torch.Tensor:
        raise RuntimeError("read refused")


class _DeviceCountIsNone(platforms.CPUPlatform):
    def device_count(self) -> int:
        return None  # type: ignore[return-value]


_RESTORING = "conformance check 'reads_and_restores_its_state' failed for .*: "


@pytest.mark.parametrize(
    ("platform", "message"),
    [
        (
            _WriteStateRaises,
            _RESTORING + "writing back .* after check 'implements_the_required_methods' raised "
            "RuntimeError: write refused",
        ),
        (
            _ReadStateRaises,
            _RESTORING + "reading .* before check 'implements_the_required_methods' raised RuntimeError: read refused",
        ),
        (_DeviceCountIsNone, _RESTORING + "device_count\\(\\) returned None before check .*, not a positive int"),
        pytest.param(
            platforms.CUDAPlatform,
            _RESTORING + "device_count\\(\\) returned 0 before check 'implements_the_required_methods': there is "
            "no device to check \\(probe\\(\\) says: .*\\); run the kit where the platform is available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA"),
        ),
    ],
    ids=["write-state-raises", "read-state-raises", "device-count-is-none", "cuda-without-a-gpu"],
)
def test_check_platform_blames_a_failure_to_read_or_restore_the_states_on_its_own_check(
    platform: type[platforms.Platform], message: str
) -> None:
    # It named 'implements_the_required_methods', which every one of these platforms passes.
    with pytest.raises(AssertionError, match=message) as info:
        check_platform(platform())
    assert "implements_the_required_methods' failed" not in str(info.value)
    assert "reads_and_restores_its_state" in CHECKS


def test_the_restoring_check_passes_a_platform_that_reads_and_restores_its_states() -> None:
    cpu = platforms.CPUPlatform()
    before = cpu.get_rng_state()
    CHECKS["reads_and_restores_its_state"](cpu)  # alone: no restoring wrapper around it
    assert torch.equal(cpu.get_rng_state(), before)


@pytest.mark.needs_sim
def test_the_kit_draws_only_where_torchs_ops_draw_from_the_platforms_own_generators() -> None:
    # On a GPU machine the simulated torch.cuda stand-in has real cuda tensors, whose draws come from
    # torch.cuda's generators, not the stand-in's: drawing there would fail a conformant platform.
    from hyperrng.platforms.testing import _has_tensors

    assert _has_tensors(platforms.SimulatedPlatform())
    stand_in = platforms.SimulatedPlatform(module=platforms.SimulatedDeviceModule())  # not the registered module
    assert torch.empty(0, device="sim:0").device.type == "sim" and not _has_tensors(stand_in)


def test_the_kit_fails_a_platform_whose_state_is_not_what_the_device_draws_from() -> None:
    with pytest.raises(AssertionError, match="conformance check 'random_ops_draw_from_the_state' failed"):
        check_platform(_DictStatePlatform())


# -- the interface is the table in Platform's docstring, and the kit checks its rows ----------------
def _tabled_members() -> list[str]:
    """The member names in the first column of the table in Platform's docstring."""
    doc = platforms.Platform.__doc__ or ""
    return re.findall(r"^\s*``(\w+)[^`]*``\s+(?:must define|may override†?)\s", doc, re.MULTILINE)


def _call_only_members() -> list[str]:
    """The methods the paragraph "*Call only*" below the table names."""
    paragraph = (platforms.Platform.__doc__ or "").split("*Call only*", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"``(\w+)\(", paragraph)


def test_the_platform_docstring_tables_every_member_a_plug_in_defines_or_overrides_and_names_the_rest() -> None:
    public = {name for name in dir(platforms.Platform) if not name.startswith("_")}
    hooks = {name.split("(")[0] for name in registry.REQUIRED_METHODS} - public
    tabled, call_only = _tabled_members(), _call_only_members()
    assert len(tabled) == len(set(tabled)) == 15  # what a plug-in author must know: at most about 15
    assert call_only == ["device", "get_rng_state", "set_rng_state", "manual_seed"]
    assert set(tabled) | set(call_only) == public | hooks
    assert not set(tabled) & set(call_only)


def test_the_plug_in_guide_names_only_members_that_platform_has() -> None:
    # help(hyperrng.platforms) once told plug-in authors to write a _seed hook and set is_host,
    # neither of which Platform has.
    guide = (platforms.__doc__ or "").split("**Writing a plug-in.**", 1)[1].split("* **Factory:**", 1)[0]
    named = set(re.findall(r"``(\w+)(?:\(|\s*=|``)", guide)) - {"help", "None", "generator"}
    assert {"device_count", "_read_state", "_write_state", "_state_nbytes", "check_rng_state"} <= named
    assert named <= set(dir(platforms.Platform)), named - set(dir(platforms.Platform))


def test_the_required_methods_are_the_tabled_must_define_methods() -> None:
    doc = platforms.Platform.__doc__ or ""
    must = re.findall(r"^\s*``(\w+\([^`]*\))``\s+must define\s", doc, re.MULTILINE)
    assert must == list(registry.REQUIRED_METHODS.values())


class _SetDeviceDoesNothing(platforms.CUDAPlatform):
    def __init__(self) -> None:
        super().__init__(module=platforms.SimulatedDeviceModule(device_count=2, device_type="cuda"))

    def set_device(self, index: int) -> None:
        pass


class _ChecksNothing(platforms.CUDAPlatform):
    def __init__(self) -> None:
        super().__init__(module=platforms.SimulatedDeviceModule(device_count=2, device_type="cuda"))

    def check_rng_state(self, state: torch.Tensor) -> torch.Tensor:
        return state


class _CPUClaimingCounterBased(platforms.CPUPlatform):
    counter_based = True


@pytest.mark.parametrize(
    ("platform", "message"),
    [
        (_SetDeviceDoesNothing, "'switches_the_current_device' failed.*set_device\\(1\\) left device 0 current"),
        (_ChecksNothing, "'refuses_bad_states' failed.*check_rng_state\\(tensor.*was accepted"),
        (_CPUClaimingCounterBased, "'describes_itself' failed.*counter-based state is the 16-byte"),
    ],
    ids=["set_device", "check_rng_state", "counter_based"],
)
def test_the_kit_catches_a_platform_that_breaks_a_tabled_promise(
    platform: type[platforms.Platform], message: str
) -> None:
    with pytest.raises(AssertionError, match=message):
        check_platform(platform())
