"""Which platform runs: the registry, the probes, and the one resolution point.

Resolution order (done once, by ``import hyperrng``, or lazily by :func:`current`):

1. ``HYPERRNG_PLATFORM=<name>`` picks a registered or plug-in platform by name;
   ``HYPERRNG_PLATFORM=package.module:Factory`` imports one. Either must be available,
   or resolution fails with the probe's reason.
2. Otherwise every plug-in of the ``hyperrng.platforms`` entry-point group is probed; one
   available plug-in wins, two are a :class:`PlatformError`.
3. Otherwise the built-ins in the order NPU, CUDA, CPU.

A probe that raises anything is caught and its reason recorded (``hyperrng info`` shows
it), so a broken driver never makes ``import hyperrng`` crash unless that backend was
forced; a probe that returns neither ``None`` nor a non-empty reason is recorded as
invalid, naming what it returned. A platform whose probe says yes is available only if
its state is what every caller expects: a plug-in's own ``_read_state`` is called once,
and anything but a 1-D CPU ``uint8`` tensor of ``_state_nbytes`` makes it unavailable,
with that reason, instead of failing later in a fork or a region (the built-in readers,
including :class:`~hyperrng.platforms.DeviceModulePlatform`'s, which would initialise the
device, are not called). The registry is a plain dict from name to factory; importing this
module has no side effects.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points

import torch
from hyperrng.platforms.base import Platform
from hyperrng.platforms.cpu import CPUPlatform
from hyperrng.platforms.device_module import CUDAPlatform, DeviceModulePlatform, NPUPlatform
from hyperrng.platforms.errors import ArgumentTypeError, InvalidArgumentError, PlatformError, UnknownPlatformError
from hyperrng.platforms.simulated import SimulatedPlatform

__all__ = [
    "ENV_VAR",
    "ENTRY_POINT_GROUP",
    "AUTO_ORDER",
    "PlatformFactory",
    "REQUIRED_METHODS",
    "unimplemented_methods",
    "ProbeResult",
    "Selection",
    "register",
    "registered",
    "load",
    "select",
    "current",
    "selection",
    "set_current",
    "use",
]

ENV_VAR = "HYPERRNG_PLATFORM"
ENTRY_POINT_GROUP = "hyperrng.platforms"
AUTO_ORDER = ("npu", "cuda", "cpu")
"""Built-ins tried, in order, when neither the environment nor a plug-in decides."""

PlatformFactory = Callable[[], Platform]

REQUIRED_METHODS: Mapping[str, str] = {
    "device_count": "device_count()",
    "_read_state": "_read_state(index)",
    "_write_state": "_write_state(state, index)",
}
"""The methods every :class:`Platform` subclass must implement (the base class only raises
``NotImplementedError``), by attribute name, with the signature to write."""

_FACTORIES: dict[str, PlatformFactory] = {
    "cpu": CPUPlatform,
    "cuda": CUDAPlatform,
    "npu": NPUPlatform,
    "sim": SimulatedPlatform,
}


@dataclass(frozen=True)
class ProbeResult:
    """What one probe found: ``reason`` is empty when the platform is available."""

    name: str
    source: str  # "builtin", "plugin", "env" or "override"
    available: bool
    reason: str = ""


@dataclass(frozen=True)
class Selection:
    """The outcome of resolution: the platform, why it was chosen, and every probe."""

    platform: Platform
    reason: str
    probes: tuple[ProbeResult, ...] = field(default_factory=tuple)
    env_value: str | None = None


_selection: Selection | None = None


def unimplemented_methods(platform: Platform | type[Platform]) -> tuple[str, ...]:
    """The required methods (see :data:`REQUIRED_METHODS`) that ``platform`` leaves to the base class.

    Args:
        platform: a :class:`Platform` instance, or a :class:`Platform` subclass.

    Returns:
        The signatures of the methods it does not override (``"device_count()"``, ...),
        in the order of :data:`REQUIRED_METHODS`; empty when it implements them all.
        Inspects attributes only: calls nothing on the platform and touches no device.
    """
    missing = []
    for attr, signature in REQUIRED_METHODS.items():
        found = getattr(platform, attr, None)
        if getattr(found, "__func__", found) is getattr(Platform, attr):
            missing.append(signature)
    return tuple(missing)


def _require_methods(platform: Platform | type[Platform], label: str) -> None:
    """Raise :class:`PlatformError` when ``platform`` (instance or class) lacks a required method."""
    missing = unimplemented_methods(platform)
    if missing:
        cls = platform if isinstance(platform, type) else type(platform)
        raise PlatformError(
            f"{label} ({cls.__module__}.{cls.__qualname__}) does not implement {', '.join(missing)}, which "
            "every platforms.Platform subclass must provide (the base class only raises NotImplementedError); "
            "implement them in the subclass, or subclass platforms.DeviceModulePlatform when the device has a "
            "torch device module (see help(hyperrng.platforms) and the README, 'Platforms and plug-ins').",
            reason="invalid",
        )


def register(name: str, factory: PlatformFactory, *, replace: bool = False) -> None:
    """Register ``factory`` (a callable returning a :class:`Platform`) under ``name``.

    A factory that is a :class:`Platform` subclass is checked here for the methods every
    platform must implement (:data:`REQUIRED_METHODS`); any other factory is checked when
    it is first called (by :func:`load`, :func:`select`). Nothing is registered on error.

    Raises:
        ArgumentTypeError: ``name`` is not a string, ``factory`` is not callable, or ``replace``
            is not a bool.
        InvalidArgumentError: ``name`` is empty, contains ``:``, or begins or ends with whitespace
            (which :func:`load` and ``HYPERRNG_PLATFORM`` strip, so they could never select it), or is
            taken and ``replace`` is false.
        PlatformError: ``factory`` is a :class:`Platform` subclass that does not implement a
            required method (the message names them).
    """
    if not isinstance(name, str):
        raise ArgumentTypeError(f"platform name must be a string such as 'myaccel', got {type(name).__name__}.")
    if not name or ":" in name:
        raise InvalidArgumentError(f"platform name must be a non-empty string without ':', got {name!r}.")
    if name != name.strip():
        fix = f"register it as {name.strip()!r}" if name.strip() else "give a name that is not blank"
        raise InvalidArgumentError(
            f"platform name {name!r} begins or ends with whitespace, which load() and {ENV_VAR} strip from the "
            f"names they are given, so neither could select it; strip it: {fix}."
        )
    if not callable(factory):
        raise ArgumentTypeError(
            f"factory for platform {name!r} must be callable (a Platform subclass or a function returning a "
            f"Platform), got {type(factory).__name__}."
        )
    if not isinstance(replace, bool):
        raise ArgumentTypeError(f"replace must be True or False, got {type(replace).__name__}.")
    if isinstance(factory, type) and issubclass(factory, Platform):
        _require_methods(factory, f"cannot register platform {name!r}: its class")
    if name in _FACTORIES and not replace:
        raise InvalidArgumentError(
            f"platform {name!r} is already registered; pass replace=True to override it deliberately."
        )
    _FACTORIES[name] = factory


def registered() -> tuple[str, ...]:
    """Names of the registered platforms (built-ins and :func:`register` calls)."""
    return tuple(_FACTORIES)


def _build(factory: Callable[[], object], label: str) -> Platform:
    """Call ``factory`` and return the platform it made.

    Raises:
        PlatformError: the result is not a :class:`Platform`, or does not implement
            a required method (see :func:`unimplemented_methods`).
        Exception: whatever ``factory`` itself raises, unchanged (callers report it).
    """
    platform = factory()
    if not isinstance(platform, Platform):
        raise PlatformError(
            f"{label} returned {type(platform).__name__}, not a platforms.Platform; "
            "make the factory return an instance of a Platform subclass.",
            reason="invalid",
        )
    _require_methods(platform, f"{label} returned a platform whose class")
    return platform


def _import_factory(spec: str, given: str) -> Callable[[], object]:
    """The factory ``spec`` (``module:Factory``) names; ``given`` says where the spec came from, in messages."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UnknownPlatformError(f"{given} is malformed; use a name or 'package.module:Factory'.")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise UnknownPlatformError(
                f"{given}: module {module_name!r} failed to import ({_one_line(exc)}); install the "
                "package that provides it, or check the spelling."
            ) from exc
        raise _broken_module(given, module_name, exc) from exc
    except Exception as exc:
        raise _broken_module(given, module_name, exc) from exc
    try:
        obj: object = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError as exc:
        if _initializing(module_name):
            raise _StillImporting(module_name) from exc
        raise UnknownPlatformError(
            f"{given}: module {module_name!r} has no attribute {attr!r}; name the factory it defines."
        ) from exc
    if not callable(obj):
        raise PlatformError(f"{given} names a {type(obj).__name__}, not a callable factory.", reason="invalid")
    return obj  # type: ignore[return-value]


def _broken_module(given: str, module_name: str, exc: BaseException) -> PlatformError:
    return PlatformError(
        f"{given}: module {module_name!r} failed to import ({_one_line(exc)}); fix its installation "
        "or choose another platform.",
        reason="unavailable",
    )


def _initializing(module_name: str) -> bool:
    """Whether ``module_name`` is being imported right now: its body is still running (a plug-in that
    imported hyperrng first, which asked for the plug-in back)."""
    module = sys.modules.get(module_name)
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class _StillImporting(Exception):
    """A plug-in's module lacks its factory because its body is still running (it imported
    hyperrng, which asked for the plug-in back): resolution waits for the first use."""

    def platform_error(self) -> PlatformError:
        return PlatformError(
            f"the plug-in module {self.args[0]!r} is still being imported (it imports hyperrng before defining its "
            "factory); ask for the platform after its import has finished.",
            reason="unavailable",
        )


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (the message's first non-blank line), for errors that quote another."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _load_entry_point(ep: EntryPoint) -> Callable[[], object]:
    try:
        return ep.load()
    except AttributeError as exc:
        if _initializing(ep.module):
            raise _StillImporting(ep.module) from exc
        raise


def _named_factory(name: str) -> Callable[[], object]:
    """The factory registered under ``name``, else that of the plug-in whose entry point is ``name``.

    Raises:
        UnknownPlatformError: no platform has that name.
        PlatformError: the plug-in's module fails to import, or lacks the factory it names (one
            line, as for a ``module:Factory`` that does not load).
    """
    factory = _FACTORIES.get(name)
    if factory is not None:
        return factory
    for ep in _plugin_entry_points():
        if ep.name == name:
            try:
                return _load_entry_point(ep)
            except _StillImporting:
                raise
            except Exception as exc:
                raise PlatformError(
                    f"plug-in platform {name!r} failed to load: {_one_line(exc)} (entry point {ep.value!r}); "
                    "fix or uninstall the package that provides it, or choose another platform.",
                    reason="unavailable",
                ) from exc
    known = ", ".join(sorted(set(_FACTORIES) | {ep.name for ep in _plugin_entry_points()}))
    raise UnknownPlatformError(
        f"unknown platform {name!r}; known platforms: {known} (or give 'package.module:Factory')."
    )


def _plugin_entry_points() -> list[EntryPoint]:
    return sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def _probe(platform: Platform) -> str | None:
    """Run ``platform.probe()``, then :func:`_state_problem`, turning any exception into a reason.

    A probe that returns neither ``None`` nor a non-blank string (``True``, ``False``, ``""``)
    breaks its contract: the platform is unavailable, and the reason says what it returned.
    """
    try:
        reason = platform.probe()
    except Exception as exc:
        return f"probe raised {type(exc).__name__}: {exc}"
    if reason is None:
        return _state_problem(platform)
    if not isinstance(reason, str) or not reason.strip():
        return (
            f"invalid platform: its probe() returned {reason!r:.80}; it must return None when the platform can run "
            "here, or a non-empty string saying why not"
        )
    return reason


# Readers whose states are right by construction; DeviceModulePlatform's would initialise the device.
_TRUSTED_READERS = (CPUPlatform._read_state, DeviceModulePlatform._read_state)


def _state_problem(platform: Platform) -> str | None:
    """``None`` if the platform has devices and its state is a 1-D CPU uint8 tensor of ``_state_nbytes``, else why not.

    Asks a plug-in's ``device_count()`` and ``current_device()``, then its own ``_read_state`` for the current
    device's state, once, when the platform is selected; the built-in readers are not called.
    """
    if type(platform)._read_state in _TRUSTED_READERS:
        return None
    try:
        count, index = platform.device_count(), platform.current_device()
    except Exception as exc:
        return f"asking for its devices raised {_one_line(exc)}"
    if type(count) is not int or count < 1 or type(index) is not int or not 0 <= index < count:
        return (
            f"device_count() returned {count!r:.40} and current_device() {index!r:.40}: an available platform "
            "has at least one device (an int) and a current one below that count; return those"
        )
    try:
        state = platform._read_state(index)
    except Exception as exc:
        return f"reading its RNG state raised {_one_line(exc)}"
    nbytes = platform._state_nbytes
    if (
        isinstance(state, torch.Tensor)
        and state.dtype == torch.uint8
        and state.dim() == 1
        and state.device.type == "cpu"
        and state.numel() == nbytes
    ):
        return None
    got = (
        f"a {state.dtype} tensor of shape {tuple(state.shape)} on {state.device}"
        if isinstance(state, torch.Tensor)
        else f"a {type(state).__name__}"
    )
    return (
        f"_read_state({index}) returned {got}, not a 1-D CPU uint8 tensor of {nbytes} bytes (_state_nbytes); "
        "return the device's RNG state as such a tensor"
    )


def load(spec: str) -> Platform:
    """Build and probe the platform named by ``spec`` (a name or ``module:Factory``).

    Raises:
        ArgumentTypeError: ``spec`` is not a string.
        UnknownPlatformError: no such name, no such module or attribute, or a ``module:Factory``
            that lacks one part (also a ``KeyError``).
        PlatformError: the module fails to import;
            or the factory does not return a :class:`Platform`, or returns
            one that does not implement a required method (see :data:`REQUIRED_METHODS`);
            or the platform's probe says it cannot run here (or returns neither ``None`` nor a
            non-empty reason), or its state is not a 1-D CPU uint8 tensor of ``_state_nbytes``.
    """
    if not isinstance(spec, str):
        raise ArgumentTypeError(f"a platform spec is a name or 'package.module:Factory', got {type(spec).__name__}.")
    spec = spec.strip()
    try:
        return _load(spec)
    except _StillImporting as exc:
        raise exc.platform_error() from None


def _load(spec: str, given: str | None = None) -> Platform:
    """:func:`load` for a stripped ``spec``; ``given`` says where it came from (default: the platform spec)."""
    if ":" in spec:
        given = f"the platform spec {spec!r}" if given is None else given
        factory, label, failed = _import_factory(spec, given), spec, f"{spec} could not create a platform"
    else:
        factory, label = _named_factory(spec), f"the factory of platform {spec!r}"
        failed = f"platform {spec!r} could not be created"
    try:
        platform = _build(factory, label)
    except PlatformError:
        raise
    except Exception as exc:
        raise PlatformError(f"{failed}: {type(exc).__name__}: {exc}", reason="unavailable") from exc
    reason = _probe(platform)
    if reason is not None:
        raise PlatformError(f"platform {platform.name!r} is not available: {reason}", reason="unavailable")
    return platform


def select(env: Mapping[str, str] | None = None) -> Selection:
    """Resolve the platform (see the module docstring), remember it, and return why.

    Raises only when ``HYPERRNG_PLATFORM`` forces a platform that cannot be used, or when
    two plug-ins both claim the machine (:class:`PlatformError`; an unknown name is an
    :class:`UnknownPlatformError`, also a ``KeyError``); or :class:`ArgumentTypeError` when
    ``env`` is not a mapping or its ``HYPERRNG_PLATFORM`` is not a string.
    """
    global _selection
    if env is not None:
        if not isinstance(env, Mapping):
            raise ArgumentTypeError(f"env must be a mapping such as os.environ, got {type(env).__name__}.")
        forced = env.get(ENV_VAR)
        if forced is not None and not isinstance(forced, str):
            raise ArgumentTypeError(f"env[{ENV_VAR!r}] must be a platform name (a str), got {type(forced).__name__}.")
    try:
        _selection = _resolve(os.environ if env is None else env)
    except _StillImporting as exc:
        raise exc.platform_error() from None
    return _selection


def _resolve(env: Mapping[str, str]) -> Selection:
    forced = env.get(ENV_VAR, "").strip()
    if forced:
        try:
            platform = _load(forced, f"{ENV_VAR}={forced!r}")
        except PlatformError as exc:
            if exc.reason != "unavailable":
                raise
            raise PlatformError(
                f"{exc} ({ENV_VAR}={forced!r} forces it): install what it needs, or set {ENV_VAR} to a platform "
                "this machine has (`hyperrng info` lists them), or unset it to let hyperrng choose.",
                reason="unavailable",
            ) from exc
        return Selection(platform, f"{ENV_VAR}={forced!r}", (ProbeResult(platform.name, "env", True),), forced)

    probes: list[ProbeResult] = []
    claimed: list[Platform] = []
    for ep in _plugin_entry_points():
        try:
            plugin = _build(_load_entry_point(ep), f"entry point {ep.name!r} ({ep.value})")
        except _StillImporting:
            raise
        except Exception as exc:
            probes.append(ProbeResult(ep.name, "plugin", False, f"failed to load: {_one_line(exc)}"))
            continue
        reason = _probe(plugin)
        probes.append(ProbeResult(ep.name, "plugin", reason is None, reason or ""))
        if reason is None:
            claimed.append(plugin)
    if len(claimed) > 1:
        names = ", ".join(p.name for p in claimed)
        raise PlatformError(
            f"plug-in platforms {names} all claim this machine; set {ENV_VAR} to the one you want.", reason="ambiguous"
        )
    if claimed:
        return Selection(claimed[0], f"plug-in {claimed[0].name!r} is available", tuple(probes))

    for name in AUTO_ORDER:
        try:
            candidate = _build(_FACTORIES[name], f"the factory of platform {name!r}")
        except Exception as exc:
            probes.append(ProbeResult(name, "builtin", False, f"failed to create: {type(exc).__name__}: {exc}"))
            continue
        reason = _probe(candidate)
        probes.append(ProbeResult(name, "builtin", reason is None, reason or ""))
        if reason is None:
            why = "first available built-in (order: " + ", ".join(AUTO_ORDER) + ")"
            return Selection(candidate, why, tuple(probes))
    raise PlatformError(
        "no platform is available, not even the CPU: " + "; ".join(f"{p.name}: {p.reason}" for p in probes),
        reason="unavailable",
    )


def select_at_import() -> None:
    """What ``import hyperrng`` runs: :func:`select`, unless a plug-in it would load is still being
    imported (the plug-in imported hyperrng first); then the platform is resolved at first use."""
    global _selection
    try:
        _selection = _resolve(os.environ)
    except _StillImporting:
        pass


def selection() -> Selection:
    """The current :class:`Selection`, resolving it first if nothing has yet."""
    return _selection if _selection is not None else select()


def current() -> Platform:
    """The platform hyperrng uses now."""
    selected = _selection  # read once, without a call to selection(): every fork and region asks
    return (selected if selected is not None else select()).platform


def set_current(platform: Platform | str) -> Platform:
    """Make ``platform`` (an instance, or a name/``module:Factory`` for :func:`load`) current.

    Returns:
        The platform now current.

    Raises:
        ArgumentTypeError: ``platform`` is neither a :class:`Platform` nor a string.
        PlatformError: ``platform`` is a platform that does not implement a required method,
            or whose state is not a 1-D CPU uint8 tensor of ``_state_nbytes``; or see
            :func:`load`. The selection is unchanged on error.
    """
    global _selection
    if isinstance(platform, str):
        resolved = load(platform)
    elif isinstance(platform, Platform):
        _require_methods(platform, "cannot select the platform: its class")
        problem = _state_problem(platform)
        if problem is not None:
            raise PlatformError(f"cannot select platform {platform.name!r}: {problem}.", reason="invalid")
        resolved = platform
    else:
        raise ArgumentTypeError(f"expected a Platform or a platform name such as 'cpu', got {type(platform).__name__}.")
    _selection = Selection(resolved, "set programmatically", (ProbeResult(resolved.name, "override", True),))
    return resolved


@contextlib.contextmanager
def use(platform: Platform | str) -> Iterator[Platform]:
    """Use ``platform`` inside the ``with`` block, then restore the previous selection."""
    global _selection
    previous = _selection
    resolved = set_current(platform)
    try:
        yield resolved
    finally:
        _selection = previous
