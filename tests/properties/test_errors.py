"""The error classes: a handful, each a HyperRNGError and one builtin (UnknownPlatformError two,
on purpose), listed once; finer distinctions a program may act on are a ``reason``, set where
the error is raised."""

from __future__ import annotations

import pickle
import threading

import hyperrng.platforms as platforms
import hyperrng.platforms.errors
import pytest
import torch

import hyperrng
import hyperrng.errors
from hyperrng import (
    HyperRNGError,
    InvalidArgumentError,
    InvalidOperationError,
    PlatformError,
    RNGStatesTracker,
    StreamLayout,
    UnknownStreamError,
    verify_rng_sync,
)

_BUILTINS = (ValueError, TypeError, KeyError, RuntimeError, NotImplementedError, OSError)
# The one class with two builtins: a PlatformError (what import and the CLI catch) that is a KeyError.
_TWO_BUILTINS = {"UnknownPlatformError": {RuntimeError, KeyError}}


class OfflinePlatform(platforms.CPUPlatform):
    """A complete platform whose probe says it cannot run here."""

    name = "offline"

    def probe(self) -> str | None:
        return "no board in this machine"


def not_a_platform() -> object:
    return 42


def _error_classes(module: object, names: list[str]) -> set[type]:
    return {
        obj
        for obj in (getattr(module, n) for n in names)
        if isinstance(obj, type) and issubclass(obj, Exception) and not issubclass(obj, Warning)
    }


def test_every_error_class_is_a_hyperrng_error_and_one_fitting_builtin() -> None:
    for name in hyperrng.errors.__all__:
        cls = getattr(hyperrng.errors, name)
        assert issubclass(cls, HyperRNGError), name
        if cls is HyperRNGError:
            continue
        builtins = [
            b for b in cls.__mro__ if b.__module__ == "builtins" and b not in (Exception, BaseException, object)
        ]
        direct = {b for b in builtins if not any(issubclass(other, b) and other is not b for other in builtins)}
        assert direct <= set(_BUILTINS), (name, builtins)
        assert direct == _TWO_BUILTINS.get(name, direct) and len(direct) == len(_TWO_BUILTINS.get(name, [0])), name


def test_the_error_classes_are_one_list_that_every_public_module_exports() -> None:
    names = hyperrng.platforms.errors.__all__
    assert len(names) == len(set(names)) <= 11
    assert hyperrng.errors.__all__ == names
    expected = {getattr(hyperrng.platforms.errors, n) for n in names}
    for module in (hyperrng, hyperrng.errors, platforms):
        assert _error_classes(module, module.__all__) == expected, module.__name__


def test_a_thread_refused_a_generator_another_thread_holds_gets_reason_busy() -> None:
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    tracker.add("b", 2)
    inside, release = threading.Event(), threading.Event()
    refused: list[BaseException] = []

    def holder() -> None:
        with tracker.fork("a"):
            inside.set()
            release.wait(timeout=60)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        inside.wait(timeout=60)
        try:
            with tracker.fork("b"):
                pass
        except InvalidOperationError as exc:
            refused.append(exc)
    finally:
        release.set()
        thread.join(timeout=60)
    assert len(refused) == 1 and refused[0].reason == "busy"  # type: ignore[attr-defined]
    assert "was refused" in str(refused[0])


def test_resetting_a_tracker_inside_its_fork_gets_reason_tracker_and_changes_nothing() -> None:
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    with tracker.fork("a"):
        with pytest.raises(InvalidOperationError, match="reset the tracker") as info:
            tracker.reset()
    assert info.value.reason == "tracker"
    assert set(tracker.get_states()) == {"a"}


def test_a_cross_rank_check_without_a_process_group_gets_reason_distributed() -> None:
    assert not torch.distributed.is_initialized()
    layout = StreamLayout(dims=("dp",), default=(), streams={"s": ("dp",)})
    with pytest.raises(InvalidOperationError, match="init_process_group") as info:
        verify_rng_sync(layout, {"dp": 0}, tracker=RNGStatesTracker())
    assert info.value.reason == "distributed"


@pytest.mark.parametrize(
    "spec, reason, fragment",
    [
        (f"{__name__}:OfflinePlatform", "unavailable", "no board in this machine"),
        (f"{__name__}:not_a_platform", "invalid", "not a platforms.Platform"),
        ("hyperrng_no_such_module:Factory", "unknown", "module 'hyperrng_no_such_module' failed to import"),
    ],
)
def test_a_platform_that_cannot_be_loaded_says_why_in_its_reason(spec: str, reason: str, fragment: str) -> None:
    with pytest.raises(PlatformError, match=fragment) as info:
        platforms.load(spec)
    assert info.value.reason == reason


def test_a_platform_factory_that_is_not_callable_is_refused_as_a_type_error() -> None:
    with pytest.raises(TypeError, match="must be callable") as info:
        platforms.register("errors-test-not-callable", 42)  # type: ignore[arg-type]
    assert isinstance(info.value, HyperRNGError)
    assert "errors-test-not-callable" not in platforms.registered()


def test_a_reason_survives_pickling_as_errors_crossing_processes_do() -> None:
    for exc in (InvalidOperationError("held elsewhere", reason="busy"), PlatformError("gone", reason="unavailable")):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc) and back.reason == exc.reason


def test_an_unknown_stream_is_a_key_error_whose_message_is_not_quoted() -> None:
    tracker = RNGStatesTracker()
    with pytest.raises(KeyError) as info:
        with tracker.fork("missing"):
            pass
    assert isinstance(info.value, UnknownStreamError)
    assert not str(info.value).startswith("'") and "'missing'" in str(info.value)


def test_a_wrong_value_is_a_value_error_that_names_the_argument() -> None:
    with pytest.raises(ValueError, match="seed") as info:
        RNGStatesTracker().add("a", -1)
    assert isinstance(info.value, InvalidArgumentError)
