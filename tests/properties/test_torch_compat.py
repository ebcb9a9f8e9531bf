"""Older torch releases: optional features are detected, reported and refused in one line; no side effect leaks.

Where the installed torch is new enough, an older one is stood in for by removing the API a
feature is built on (in this process with ``monkeypatch``, or in a child process through a
``sitecustomize`` module), so these tests say the same on every torch. ``.ci/torch-compat``
runs the whole suite on a real older torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import hyperrng.platforms as platforms
import hyperrng.platforms.registry as registry
import pytest
import torch
from hyperrng.platforms import PlatformError
from hyperrng.platforms._features import FEATURES, feature, report_lines, require

from hyperrng import cli

REPO = Path(__file__).resolve().parents[2]

WITHOUT_PYTHON_DEVICE_HOOKS = """
import torch
if hasattr(torch._C, "_acc"):
    del torch._C._acc
"""
"""A ``sitecustomize`` that makes the child's torch look like one that cannot host a Python device backend."""


def _run(args: list[str], tmp_path: Path, sitecustomize: str = "", **env: str) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in a child with the repository (and ``tmp_path``, holding ``sitecustomize``) importable."""
    if sitecustomize:
        (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(sitecustomize))
    base = {k: v for k, v in os.environ.items() if k != platforms.ENV_VAR}
    full_env = {**base, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), **env}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full_env, cwd=REPO)


# -- the feature table -------------------------------------------------------------------------------


def test_every_optional_feature_names_the_torch_release_and_the_api_it_needs() -> None:
    assert [f.key for f in FEATURES] == ["sim", "portable-mode", "portable-compile", "local-tensor", "user-generator"]
    for f in FEATURES:
        major, minor = f.needs.split(".")
        assert (int(major), int(minor)) > (2, 5), f"{f.key}: the core runs on 2.5, so an extra needs a newer torch"
        assert f.api and f.title


def test_info_lists_every_feature_with_its_state() -> None:
    lines = report_lines()
    assert lines[0].startswith("torch features (hyperrng supports torch >= 2.5; this is ")
    for f, line in zip(FEATURES, lines[1:]):
        state = "available" if f.available else f"unavailable - needs torch >= {f.needs}"
        assert line.split()[:2] == [f.key, state.split()[0]] and state in line
    info = cli.info_lines()
    assert lines[0] in info and all(line in info for line in lines)


def test_a_feature_whose_api_is_missing_is_refused_in_one_typed_line_naming_the_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(torch.library.Library, "fallback", raising=False)
    assert not feature("portable-mode").available
    with pytest.raises(PlatformError) as info:
        require("portable-mode", PlatformError)
    message = str(info.value)
    assert "\n" not in message
    assert "portable mode (hyperrng.portable_random) needs torch >= 2.9 (kernels on the CustomRNGKeyId" in message
    assert f"this is torch {torch.__version__}" in message


@pytest.mark.needs_portable_mode
def test_a_feature_whose_api_is_present_is_not_refused() -> None:
    assert feature("portable-mode").available
    require("portable-mode", PlatformError)


def test_a_dtensor_that_leaves_generator_on_the_local_op_counts_as_lacking_user_generators(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.distributed.tensor import _random

    def region_without_generator(self: object, spec: object) -> None:
        """The signature of torch 2.5 to 2.8, whose DTensor never hands the op's generator to the tracker."""

    monkeypatch.setattr(_random._RNGStateTracker, "_distribute_region", region_without_generator)
    found = feature("user-generator")
    assert not found.available
    assert found.needs == "2.9" and "DTensor" in found.refusal()


def test_a_dtensor_that_hands_generator_to_its_tracker_counts_as_honouring_user_generators(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.distributed.tensor import _random

    def region_with_generator(self: object, spec: object, generator: object = None) -> None:
        """The signature of torch 2.9 and newer."""

    monkeypatch.setattr(_random._RNGStateTracker, "_distribute_region", region_with_generator)
    assert feature("user-generator").available


# -- the simulated device on a torch that cannot host it ----------------------------------------------


def test_selecting_sim_without_python_device_hooks_is_one_typed_line_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(torch._C, "_acc", raising=False)
    before = registry._selection
    for select in (lambda: platforms.select({platforms.ENV_VAR: "sim"}), lambda: platforms.set_current("sim")):
        with pytest.raises(PlatformError) as info:
            select()
        message = str(info.value)
        assert "\n" not in message
        assert message.startswith("platform 'sim' is not available: the simulated device (platform 'sim') needs ")
        assert "torch >= 2.10" in message and f"this is torch {torch.__version__}" in message
        assert registry._selection is before


def test_hyperrng_imports_and_reports_on_a_torch_without_python_device_hooks(tmp_path: Path) -> None:
    code = "import hyperrng, hyperrng.cli as c; print('\\n'.join(c.info_lines()))"
    out = _run(["-c", code], tmp_path, WITHOUT_PYTHON_DEVICE_HOOKS)
    assert out.returncode == 0, out.stderr
    chosen = registry._resolve({}).platform.name  # what the child chooses here: cuda on a GPU machine
    assert f"platform: {chosen}  (" in out.stdout
    assert "  sim              unavailable - needs torch >= 2.10" in out.stdout
    assert "  sim      [builtin] unavailable - the simulated device (platform 'sim') needs torch >= 2.10" in out.stdout


def test_the_cli_refuses_sim_without_python_device_hooks_in_one_line(tmp_path: Path) -> None:
    out = _run(["-m", "hyperrng", "demo"], tmp_path, WITHOUT_PYTHON_DEVICE_HOOKS, HYPERRNG_PLATFORM="sim")
    assert out.returncode != 0 and out.stdout == ""
    assert "Traceback" not in out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith("hyperrng demo: error: platform 'sim' is not available: ")
    assert "needs torch >= 2.10" in line


# -- a plug-in named by HYPERRNG_PLATFORM whose module does not import ---------------------------------


@pytest.fixture
def broken_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A plug-in distribution ``brokenplug`` whose module raises on import (a missing driver library)."""
    (tmp_path / "brokenplug_mod.py").write_text("raise OSError('libbroken.so: cannot open shared object file')\n")
    info = tmp_path / "brokenplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{platforms.ENTRY_POINT_GROUP}]\nbrokenplug = brokenplug_mod:make\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_plugin_named_by_the_env_var_that_fails_to_import_is_one_typed_line(broken_plugin: Path) -> None:
    before = registry._selection
    with pytest.raises(PlatformError) as info:
        platforms.select({platforms.ENV_VAR: "brokenplug"})
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "plug-in platform 'brokenplug' failed to load: OSError: libbroken.so: cannot open shared object file "
        "(entry point 'brokenplug_mod:make'); fix or uninstall the package that provides it"
    )
    assert registry._selection is before


def test_the_cli_reports_a_plugin_that_fails_to_import_in_one_line(broken_plugin: Path) -> None:
    out = _run(["-m", "hyperrng", "demo"], broken_plugin, HYPERRNG_PLATFORM="brokenplug")
    assert out.returncode != 0 and out.stdout == ""
    assert "Traceback" not in out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith("hyperrng demo: error: plug-in platform 'brokenplug' failed to load: OSError: libbroken.so")


# -- compiled code leaves the process's floating-point mode alone --------------------------------------

SUBNORMALS_AFTER_A_COMPILED_CALL = """
import threading
import torch
from hyperrng import philox

def flushes():
    tiny = 2.0**-1070
    return tiny * 1.0 == 0.0

compiled = philox.uniform((1 << 20,), 7, 0, compiled=True)
again = philox.uniform((1 << 20,), 7, 0, compiled=True)
eager = philox.uniform((1 << 20,), 7, 0)
on_new_thread = []
thread = threading.Thread(target=lambda: on_new_thread.append(flushes()))
thread.start()
thread.join()
subnormals = torch.full((1 << 20,), 1e-40)  # large enough to run on every worker thread
print(flushes(), on_new_thread[0], int((subnormals * 1.0).eq(0).sum()))
print(torch.equal(compiled, eager), torch.equal(again, eager))
"""


@pytest.mark.slow
def test_a_subnormal_float_survives_a_compiled_philox_call_on_every_thread(tmp_path: Path) -> None:
    # A child process: the first compiled call of a process is where the compiled library loads.
    out = _run(["-c", SUBNORMALS_AFTER_A_COMPILED_CALL], tmp_path)
    assert out.returncode == 0, out.stderr
    flushes_here, flushes_on_a_new_thread, zeros = out.stdout.split("\n")[0].split()
    assert (flushes_here, flushes_on_a_new_thread, zeros) == ("False", "False", "0")
    assert out.stdout.split("\n")[1] == "True True", "compiled values must equal eager ones, the first call too"
