"""How the platform is chosen: environment, plug-ins, built-ins, overrides, and their errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import hyperrng.platforms as platforms
import hyperrng.platforms.registry as registry
import pytest
import torch
from hyperrng.platforms import (
    ArgumentTypeError,
    InvalidArgumentError,
    PlatformError,
    UnknownPlatformError,
)

from tests._platforms import BarePlatform

REPO = Path(__file__).resolve().parents[2]


class _Unavailable(platforms.SimulatedPlatform):
    name = "nodev"

    def probe(self) -> str | None:
        return "no such device on this machine"


def _raising_platform(exc: BaseException) -> type[platforms.Platform]:
    class Raising(platforms.SimulatedPlatform):
        name = "raising"

        def probe(self) -> str | None:
            raise exc

    return Raising


@pytest.fixture
def plugin_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Install tiny plug-in distributions (a dist-info with entry points) on sys.path."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def install(dist: str, entries: dict[str, str], module_source: str) -> None:
        (tmp_path / f"{dist}.py").write_text(textwrap.dedent(module_source))
        info = tmp_path / f"{dist}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        lines = "\n".join(f"{name} = {target}" for name, target in entries.items())
        (info / "entry_points.txt").write_text(f"[{platforms.ENTRY_POINT_GROUP}]\n{lines}\n")

    return install


PLUGIN_SOURCE = """
    import hyperrng.platforms as platforms

    class Plug(platforms.SimulatedPlatform):
        name = "{name}"

        def probe(self):
            return {reason!r}

    def make():
        return Plug()
"""


# -- environment variable ---------------------------------------------------------------


@pytest.mark.needs_sim
def test_env_var_selects_a_registered_platform_by_name() -> None:
    sel = platforms.select({platforms.ENV_VAR: "sim"})
    assert isinstance(sel.platform, platforms.SimulatedPlatform)
    assert "HYPERRNG_PLATFORM='sim'" in sel.reason
    assert platforms.current() is sel.platform


@pytest.mark.needs_sim
def test_env_var_imports_a_module_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "myaccel.py").write_text(
        "from hyperrng import platforms\nclass Accel(platforms.SimulatedPlatform):\n    name = 'myaccel'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sel = platforms.select({platforms.ENV_VAR: "myaccel:Accel"})
    assert sel.platform.name == "myaccel"


def test_unknown_name_fails_listing_the_known_ones_as_a_key_error() -> None:
    before = registry._selection
    with pytest.raises(PlatformError, match="unknown platform 'tpu'; known platforms: cpu, cuda, npu, sim") as info:
        platforms.select({platforms.ENV_VAR: "tpu"})
    assert registry._selection is before
    assert info.value.reason == "unknown"
    assert isinstance(info.value, UnknownPlatformError) and isinstance(info.value, KeyError)


@pytest.mark.parametrize("spec", ["nonexistent", "os:nonexistent", "hyperrng_no_such_module_xyz:Factory"])
def test_an_unknown_platform_is_a_key_error_and_a_platform_error_and_changes_nothing(spec: str) -> None:
    # "os:nonexistent" raised the private _StillImporting: os was imported before, so its missing
    # attribute was taken for a plug-in still running its body.
    outer = platforms.current()
    with pytest.raises(UnknownPlatformError) as info:
        with platforms.use(spec):
            pytest.fail("an unknown platform was selected")
    assert isinstance(info.value, KeyError) and isinstance(info.value, PlatformError)
    assert info.value.reason == "unknown" and not str(info.value).startswith("'")
    assert platforms.current() is outer


def test_known_but_unavailable_fails_with_the_underlying_reason() -> None:
    with pytest.raises(PlatformError, match="platform 'npu' is not available: torch_npu is not installed") as info:
        platforms.select({platforms.ENV_VAR: "npu"})
    assert info.value.reason == "unavailable"


@pytest.mark.parametrize(
    ("spec", "error", "fragment"),
    [
        ("no_such_module_xyz:Factory", PlatformError, "failed to import (ModuleNotFoundError"),
        ("platforms:NoSuchFactory", PlatformError, "has no attribute 'NoSuchFactory'"),
        ("platforms:ENV_VAR", PlatformError, "not a callable factory"),
        ("platforms:registered", PlatformError, "returned tuple, not a platforms.Platform"),
        ("platforms:", PlatformError, "malformed"),
    ],
)
def test_bad_module_factory_specs_fail_clearly(spec: str, error: type[Exception], fragment: str) -> None:
    before = registry._selection
    with pytest.raises(error) as info:
        platforms.select({platforms.ENV_VAR: spec})
    assert fragment in str(info.value)
    assert registry._selection is before


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("sim:", "is malformed"),
        (":", "is malformed"),
        ("os:nonexistent", "has no attribute 'nonexistent'"),
        ("no_such_module_xyz:Factory", "failed to import (ModuleNotFoundError"),
        ("platforms:ENV_VAR", "not a callable factory"),
    ],
)
def test_a_bad_spec_names_the_environment_variable_only_when_it_came_from_there(spec: str, fragment: str) -> None:
    # use("sim:") once said "HYPERRNG_PLATFORM='sim:' is malformed", though the variable was not set.
    outer = platforms.current()
    for give in (platforms.load, _enter_use):
        with pytest.raises(PlatformError) as info:
            give(spec)
        assert fragment in str(info.value) and f"platform spec {spec!r}" in str(info.value)
        assert platforms.ENV_VAR not in str(info.value), str(info.value)
    assert platforms.current() is outer
    with pytest.raises(PlatformError) as info:
        platforms.select({platforms.ENV_VAR: spec})
    assert fragment in str(info.value) and f"{platforms.ENV_VAR}={spec!r}" in str(info.value)


def test_module_factory_that_raises_on_import_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "brokenaccel.py").write_text("raise OSError('libaccel.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PlatformError, match="OSError: libaccel.so"):
        platforms.select({platforms.ENV_VAR: "brokenaccel:Factory"})


# -- automatic order and probes ---------------------------------------------------------


def test_without_env_or_plugins_the_first_available_builtin_wins() -> None:
    sel = platforms.select({})
    names = [p.name for p in sel.probes]
    assert names == list(platforms.AUTO_ORDER[: len(names)])  # probed in order, up to the first available
    assert sel.platform.name == names[-1] == ("cuda" if torch.cuda.is_available() else "cpu")  # no NPU in CI
    assert all(p.reason for p in sel.probes[:-1]) and sel.probes[-1].available


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("driver version mismatch"),
        OSError("libascendcl.so not found"),
        ValueError("bad env"),
        KeyError("x"),
    ],
)
def test_a_probe_raising_anything_is_recorded_and_skipped(exc: Exception, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry._FACTORIES, "npu", _raising_platform(exc))
    sel = platforms.select({})
    assert sel.platform.name == "cpu"
    npu = sel.probes[0]
    assert not npu.available and f"probe raised {type(exc).__name__}" in npu.reason


_BAD_PROBE_RETURNS = [True, False, "", "  ", 0]


def _probe_returning(value: object) -> type[platforms.Platform]:
    class OddProbe(platforms.CPUPlatform):
        name = "oddprobe"

        def probe(self) -> str | None:
            return value  # type: ignore[return-value]

    return OddProbe


def _bad_probe_reason(value: object) -> str:
    return (
        f"invalid platform: its probe() returned {value!r}; it must return None when the platform can run here, or "
        "a non-empty string saying why not"
    )


@pytest.mark.parametrize("value", _BAD_PROBE_RETURNS, ids=repr)
def test_a_probe_returning_neither_none_nor_a_reason_is_recorded_as_invalid(
    value: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # probe() returning True was recorded as unavailable with the reason True; False and "" with no reason.
    from hyperrng.cli import info_lines

    monkeypatch.setitem(registry._FACTORIES, "npu", _probe_returning(value))
    sel = platforms.select({})
    assert sel.platform.name != "oddprobe"
    npu = sel.probes[0]
    assert npu.name == "npu" and not npu.available and isinstance(npu.reason, str)
    assert _bad_probe_reason(value) in npu.reason
    with pytest.raises(PlatformError, match="not available: " + re.escape(_bad_probe_reason(value))):
        platforms.load("npu")
    lines = [line for line in info_lines() if line.lstrip().startswith("npu ")]  # the probe, the known platform
    assert len(lines) == 2 and all("unavailable - " in line and _bad_probe_reason(value) in line for line in lines)


@pytest.mark.parametrize(("value", "dist"), [(True, "plug_odd_true"), ("", "plug_odd_empty")], ids=["True", "''"])
def test_a_plugin_whose_probe_returns_neither_none_nor_a_reason_is_recorded_as_invalid(  # type: ignore[no-untyped-def]
    value: object, dist: str, plugin_env
) -> None:
    plugin_env(dist, {"plugodd": f"{dist}:make"}, PLUGIN_SOURCE.format(name="plugodd", reason=value))
    sel = platforms.select({})
    assert sel.platform.name != "plugodd"
    (probe,) = [p for p in sel.probes if p.name == "plugodd"]
    assert probe.source == "plugin" and not probe.available and _bad_probe_reason(value) in probe.reason


def test_a_factory_raising_is_recorded_and_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> platforms.Platform:
        raise ImportError("torch_npu was built for another torch")

    monkeypatch.setitem(registry._FACTORIES, "cuda", broken)
    sel = platforms.select({})
    assert sel.platform.name == "cpu"
    assert "ImportError: torch_npu was built for another torch" in sel.probes[1].reason


def test_a_forced_platform_whose_probe_raises_fails_with_that_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry._FACTORIES, "npu", _raising_platform(OSError("CANN missing")))
    with pytest.raises(PlatformError, match="OSError: CANN missing"):
        platforms.select({platforms.ENV_VAR: "npu"})


# -- plug-ins through entry points --------------------------------------------------------


def test_an_available_plugin_wins_over_builtins(plugin_env) -> None:  # type: ignore[no-untyped-def]
    plugin_env("plug_a", {"pluga": "plug_a:make"}, PLUGIN_SOURCE.format(name="pluga", reason=None))
    sel = platforms.select({})
    assert sel.platform.name == "pluga"
    assert sel.probes[0].source == "plugin"


def test_an_unavailable_plugin_falls_back_to_builtins(plugin_env) -> None:  # type: ignore[no-untyped-def]
    plugin_env("plug_b", {"plugb": "plug_b:make"}, PLUGIN_SOURCE.format(name="plugb", reason="no board"))
    sel = platforms.select({})
    assert sel.platform.name == "cpu"
    assert ("plugb", "plugin", False, "no board") in [(p.name, p.source, p.available, p.reason) for p in sel.probes]


def test_a_plugin_that_fails_to_load_is_recorded(plugin_env) -> None:  # type: ignore[no-untyped-def]
    plugin_env("plug_c", {"plugc": "plug_c:missing"}, PLUGIN_SOURCE.format(name="plugc", reason=None))
    sel = platforms.select({})
    assert sel.platform.name == "cpu"
    assert "failed to load: AttributeError" in sel.probes[0].reason


def test_two_available_plugins_are_an_error(plugin_env) -> None:  # type: ignore[no-untyped-def]
    plugin_env("plug_d", {"plugd": "plug_d:make"}, PLUGIN_SOURCE.format(name="plugd", reason=None))
    plugin_env("plug_e", {"pluge": "plug_e:make"}, PLUGIN_SOURCE.format(name="pluge", reason=None))
    with pytest.raises(PlatformError, match="plugd, pluge all claim this machine; set HYPERRNG_PLATFORM") as info:
        platforms.select({})
    assert info.value.reason == "ambiguous"


def test_env_var_picks_one_of_two_plugins_by_entry_point_name(plugin_env) -> None:  # type: ignore[no-untyped-def]
    plugin_env("plug_f", {"plugf": "plug_f:make"}, PLUGIN_SOURCE.format(name="plugf", reason=None))
    plugin_env("plug_g", {"plugg": "plug_g:make"}, PLUGIN_SOURCE.format(name="plugg", reason=None))
    assert platforms.select({platforms.ENV_VAR: "plugg"}).platform.name == "plugg"


# -- programmatic override and registration ------------------------------------------------


def test_use_overrides_inside_the_block_and_restores_after() -> None:
    outer = platforms.current()
    sim = platforms.SimulatedPlatform()
    with platforms.use(sim) as p:
        assert p is sim and platforms.current() is sim
    assert platforms.current() is outer


@pytest.mark.needs_sim
def test_use_restores_even_when_the_block_raises() -> None:
    outer = platforms.current()
    with pytest.raises(ZeroDivisionError):
        with platforms.use("sim"):
            raise ZeroDivisionError("inside the block")
    assert platforms.current() is outer


def test_set_current_refuses_what_is_not_a_platform_as_a_type_error() -> None:
    outer = platforms.current()
    with pytest.raises(ArgumentTypeError, match="expected a Platform or a platform name such as 'cpu', got int"):
        platforms.set_current(3)  # type: ignore[arg-type]
    assert platforms.current() is outer


@pytest.mark.needs_sim
def test_register_adds_a_named_factory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    platforms.register("mysim", platforms.SimulatedPlatform)
    assert "mysim" in platforms.registered()
    assert isinstance(platforms.load("mysim"), platforms.SimulatedPlatform)


@pytest.mark.parametrize(
    ("name", "factory", "error", "fragment"),
    [
        ("cpu", platforms.CPUPlatform, InvalidArgumentError, "already registered; pass replace=True"),
        ("", platforms.CPUPlatform, InvalidArgumentError, "non-empty string"),
        ("a:b", platforms.CPUPlatform, InvalidArgumentError, "without ':'"),
        # load() and HYPERRNG_PLATFORM strip the names they are given: they could never select these
        (" a", platforms.CPUPlatform, InvalidArgumentError, "' a' begins or ends with whitespace"),
        ("cpu ", platforms.CPUPlatform, InvalidArgumentError, "strip it: register it as 'cpu'"),
        ("  ", platforms.CPUPlatform, InvalidArgumentError, "begins or ends with whitespace"),
        ("x", 42, ArgumentTypeError, "must be callable"),
        (7, platforms.CPUPlatform, ArgumentTypeError, "platform name must be a string"),
    ],
)
def test_register_refuses_bad_names_and_factories(
    name: str, factory: object, error: type[Exception], fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    before = dict(registry._FACTORIES)
    with pytest.raises(error, match=fragment.replace("(", r"\(")):
        platforms.register(name, factory)  # type: ignore[arg-type]
    assert registry._FACTORIES == before


def test_an_unavailable_registered_platform_cannot_be_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    platforms.register("nodev", _Unavailable)
    with pytest.raises(PlatformError, match="no such device on this machine"):
        platforms.load("nodev")


# -- platforms that do not implement the required methods ------------------------------------


class _Half(platforms.Platform):
    """Implements device_count and _read_state only."""

    name = "half"

    def device_count(self) -> int:
        return 1

    def _read_state(self, index: int) -> torch.Tensor:
        return torch.zeros(16, dtype=torch.uint8)


_ALL_THREE = "device_count(), _read_state(index), _write_state(state, index)"


def _assert_names_the_methods(exc: BaseException, missing: str, present: tuple[str, ...] = ()) -> None:
    assert isinstance(exc, PlatformError) and exc.reason == "invalid"
    message = str(exc)
    assert f"does not implement {missing}, which every platforms.Platform subclass must provide" in message
    assert "implement them in the subclass" in message
    assert not any(name in message for name in present), message


@pytest.mark.parametrize(
    ("cls", "missing", "present"),
    [
        (BarePlatform, _ALL_THREE, ()),
        (_Half, "_write_state(state, index)", ("device_count", "_read_state")),
    ],
)
def test_register_refuses_a_platform_class_that_does_not_implement_the_required_methods(
    cls: type[platforms.Platform], missing: str, present: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    before = dict(registry._FACTORIES)
    with pytest.raises(PlatformError) as info:
        platforms.register("incomplete", cls)
    _assert_names_the_methods(info.value, missing, present)
    assert "cannot register platform 'incomplete'" in str(info.value)
    assert registry._FACTORIES == before


def test_register_with_replace_keeps_the_old_factory_when_the_new_class_is_incomplete(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    with pytest.raises(PlatformError, match="does not implement device_count()"):
        platforms.register("sim", BarePlatform, replace=True)
    assert registry._FACTORIES["sim"] is platforms.SimulatedPlatform


def test_unimplemented_methods_lists_what_a_platform_leaves_to_the_base_class() -> None:
    assert registry.unimplemented_methods(BarePlatform) == tuple(registry.REQUIRED_METHODS.values())
    assert registry.unimplemented_methods(_Half()) == ("_write_state(state, index)",)
    for complete in (platforms.CPUPlatform, platforms.SimulatedPlatform, platforms.CUDAPlatform, platforms.NPUPlatform):
        assert registry.unimplemented_methods(complete) == ()


def test_a_factory_function_returning_an_incomplete_platform_fails_when_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    platforms.register("bare", lambda: BarePlatform())  # a function cannot be checked before it is called
    before = registry._selection
    with pytest.raises(PlatformError) as info:
        platforms.select({platforms.ENV_VAR: "bare"})
    _assert_names_the_methods(info.value, _ALL_THREE)
    assert "the factory of platform 'bare' returned a platform whose class" in str(info.value)
    assert registry._selection is before


def test_env_var_naming_an_incomplete_platform_class_fails_naming_the_methods(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bareaccel.py").write_text(
        "from hyperrng import platforms\nclass Bare(platforms.Platform):\n    name = 'bare'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    before = registry._selection
    with pytest.raises(PlatformError) as info:
        platforms.select({platforms.ENV_VAR: "bareaccel:Bare"})
    _assert_names_the_methods(info.value, _ALL_THREE)
    assert "(bareaccel.Bare)" in str(info.value)
    assert registry._selection is before


def test_an_incomplete_plugin_is_recorded_and_skipped(plugin_env) -> None:  # type: ignore[no-untyped-def]
    source = "from hyperrng import platforms\n\nclass Bare(platforms.Platform):\n    name = 'bareplug'\n"
    plugin_env("plug_bare", {"bareplug": "plug_bare:Bare"}, source)
    sel = platforms.select({})
    assert sel.platform.name == "cpu"
    assert "failed to load: PlatformError" in sel.probes[0].reason
    assert f"does not implement {_ALL_THREE}" in sel.probes[0].reason


def _enter_use(platform: platforms.Platform) -> None:
    with platforms.use(platform):
        pass


@pytest.mark.parametrize("select_it", [platforms.set_current, _enter_use], ids=["set_current", "use"])
def test_selecting_an_incomplete_platform_instance_is_refused(
    select_it: Callable[[platforms.Platform], object],
) -> None:
    outer = platforms.current()
    with pytest.raises(PlatformError) as info:
        select_it(_Half())
    _assert_names_the_methods(info.value, "_write_state(state, index)", ("device_count",))
    assert platforms.current() is outer


class _DictState(platforms.Platform):
    """A plug-in whose ``_read_state`` hands back a dict instead of the state tensor."""

    name = "dictplug"
    counter_based = True

    def __init__(self) -> None:
        self._state = {"seed": 0, "offset": 0}

    def device_count(self) -> int:
        return 1

    def _read_state(self, index: int) -> dict[str, int]:  # type: ignore[override]
        return dict(self._state)

    def _write_state(self, state: torch.Tensor, index: int) -> None:
        seed, offset = platforms.unpack_counter_state(state)
        self._state = {"seed": seed, "offset": offset}


def test_a_platform_whose_state_is_not_a_tensor_is_not_available(monkeypatch: pytest.MonkeyPatch) -> None:
    from hyperrng.cli import info_lines

    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    platforms.register("dictplug", _DictState)
    outer = platforms.current()
    with pytest.raises(PlatformError, match=r"not available: _read_state\(0\) returned a dict, not a 1-D CPU") as info:
        platforms.load("dictplug")
    assert info.value.reason == "unavailable"
    with pytest.raises(PlatformError, match="cannot select platform 'dictplug': _read_state") as info:
        platforms.set_current(_DictState())
    assert info.value.reason == "invalid" and platforms.current() is outer
    (line,) = [line for line in info_lines() if line.lstrip().startswith("dictplug")]
    assert "unavailable - _read_state(0) returned a dict" in line


def test_a_platform_whose_state_cannot_be_read_is_not_available(monkeypatch: pytest.MonkeyPatch) -> None:
    class Unreadable(_DictState):
        def _read_state(self, index: int) -> dict[str, int]:
            raise OSError("device gone")

    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    platforms.register("dictplug", Unreadable)
    with pytest.raises(PlatformError, match="reading its RNG state raised OSError: device gone"):
        platforms.load("dictplug")


@pytest.mark.parametrize(("count", "current"), [(None, 0), (0, 0), (2, 5), (1, None)], ids=["None", "0", "past", "bad"])
def test_a_platform_without_a_usable_device_count_is_not_available(
    count: object, current: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plug-in whose device_count() is None (or 0, or whose current device is not below it) was selected, then
    failed in every later call with torch's TypeError ('<' between int and NoneType)."""

    class Countless(_DictState):
        def device_count(self) -> int:
            return count  # type: ignore[return-value]

        def current_device(self) -> int:
            return current  # type: ignore[return-value]

    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    platforms.register("dictplug", Countless)
    with pytest.raises(PlatformError, match=r"not available: device_count\(\) returned .* and current_device\(\)"):
        platforms.load("dictplug")


# -- import behaviour, in fresh interpreters ------------------------------------------------


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=300)


@pytest.mark.needs_sim
def test_a_plugin_that_imports_hyperrng_before_defining_its_factory_is_still_selected(tmp_path: Path) -> None:
    # The plug-in module is imported first; its own import of hyperrng.platforms runs hyperrng's
    # platform resolution, which asks for the plug-in's factory before the module has defined it.
    (tmp_path / "earlyaccel.py").write_text(
        "from hyperrng import platforms\n"
        "class Early(platforms.SimulatedPlatform):\n    name = 'early'\n"
        "def make():\n    return Early()\n"
    )
    code = "import earlyaccel, hyperrng\nprint(hyperrng.current_platform().name)"
    out = _python(code, HYPERRNG_PLATFORM="earlyaccel:make", PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "early"


def test_a_user_package_named_platforms_does_not_disturb_hyperrng(tmp_path: Path) -> None:
    (tmp_path / "platforms").mkdir()
    (tmp_path / "platforms" / "__init__.py").write_text("OWNER = 'the user'\n")
    code = "import platforms, hyperrng\nprint(platforms.OWNER, hyperrng.current_platform().name)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["the", "user", registry._resolve(os.environ).platform.name]


def test_import_hyperrng_initialises_no_device_and_loads_no_npu_runtime(tmp_path: Path) -> None:
    (tmp_path / "countingaccel.py").write_text(
        "from hyperrng import platforms\nMODULE = platforms.SimulatedDeviceModule()\n"
        "def make():\n    return platforms.CUDAPlatform(module=MODULE)\n"
    )
    code = (
        "import sys, torch, hyperrng, countingaccel\n"
        "assert hyperrng.current_platform().module is countingaccel.MODULE\n"
        "print(countingaccel.MODULE.is_initialized(), torch.cuda.is_initialized(), 'torch_npu' in sys.modules)"
    )
    out = _python(code, HYPERRNG_PLATFORM="countingaccel:make", PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "False"]


def test_with_an_unknown_forced_platform_the_first_call_into_hyperrng_fails() -> None:
    out = _python("import hyperrng\nhyperrng.current_platform()", HYPERRNG_PLATFORM="tpu")
    assert out.returncode != 0
    assert "PlatformError: unknown platform 'tpu'" in out.stderr


def test_a_forced_factory_that_does_not_exist_fails_at_first_use_as_an_unknown_platform() -> None:
    code = (
        "import hyperrng\n"
        "try:\n    hyperrng.current_platform()\n"
        "except KeyError as exc:\n    print(type(exc).__name__, exc.reason, exc)\n"
    )
    out = _python(code, HYPERRNG_PLATFORM="os:NoSuch")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(
        "UnknownPlatformError unknown HYPERRNG_PLATFORM='os:NoSuch': module 'os' has no attribute"
    )


def _plant_a_plugin_in(folder: Path, marker: Path) -> None:
    """A *.dist-info in ``folder`` whose entry point's module writes ``marker`` when imported."""
    (folder / "plantedplug.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\ndef make():\n    raise RuntimeError('not a platform')\n"
    )
    info = folder / "plantedplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plantedplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{platforms.ENTRY_POINT_GROUP}]\nplanted = plantedplug:make\n")


@pytest.mark.parametrize(
    ("code", "env", "runs"),
    [
        ("import torch", {}, False),
        ("import hyperrng", {}, True),
        ("import hyperrng", {"HYPERRNG_PLATFORM": "cpu"}, False),
        ("import hyperrng", {"HYPERRNG_PLATFORM": "sim"}, False),
    ],
    ids=["import-torch", "import-hyperrng", "forced-cpu", "forced-sim"],
)
def test_the_trust_boundary_is_what_the_docs_say(code: str, env: dict[str, str], runs: bool, tmp_path: Path) -> None:
    # A *.dist-info in the working folder runs its plug-in's code at `import hyperrng` (Python puts
    # that folder on sys.path for `python -c`); a built-in HYPERRNG_PLATFORM rules plug-ins out.
    work = tmp_path / "work"
    work.mkdir()
    marker = tmp_path / "ran"
    _plant_a_plugin_in(work, marker)
    full_env = {k: v for k, v in os.environ.items() if k != platforms.ENV_VAR}
    full_env.update(PYTHONPATH=str(REPO), **env)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=work, env=full_env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert marker.exists() is runs
    documented = (platforms.__doc__ or "") + (REPO / "README.md").read_text(encoding="utf-8")
    for promise in ("Code that runs at `import hyperrng`", "Trust: what runs code at import", "*.dist-info"):
        assert promise in documented, f"the trust boundary is no longer documented: {promise!r}"


def test_info_explains_the_choice_and_every_probe() -> None:
    out = _python("from hyperrng.cli import main; raise SystemExit(main(['info']))", HYPERRNG_PLATFORM="")
    assert out.returncode == 0, out.stderr
    assert f"platform: {registry._resolve({}).platform.name}  (" in out.stdout  # cuda on a GPU machine
    assert "chosen because: first available built-in" in out.stdout
    assert "npu      [builtin] unavailable - torch_npu is not installed" in out.stdout
    assert "HYPERRNG_PLATFORM=''" in out.stdout


@pytest.mark.needs_sim
def test_info_shows_the_env_var_when_it_decides() -> None:
    out = _python("from hyperrng.cli import main; raise SystemExit(main(['info']))", HYPERRNG_PLATFORM="sim")
    assert out.returncode == 0, out.stderr
    assert "platform: sim" in out.stdout and "chosen because: HYPERRNG_PLATFORM='sim'" in out.stdout


def test_a_module_factory_that_raises_when_called_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "raisingaccel.py").write_text("def make():\n    raise OSError('no board on the bus')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PlatformError, match="could not create a platform: OSError: no board on the bus"):
        platforms.select({platforms.ENV_VAR: "raisingaccel:make"})
