"""The optional torch features hyperrng uses, whether this torch has each, and the version each needs.

hyperrng supports torch 2.5 and newer. Its core (platforms, trackers, seeding, layouts,
sharded regions, checkpoints, verification, the command line and the demo on the CPU)
needs nothing newer. A few features are built on torch APIs that appeared later; each is
detected here, by the presence of the API it uses (never by parsing ``torch.__version__``,
which builds from source, vendors and nightlies spell in their own ways), so that one
table answers ``hyperrng info``, the code that refuses a feature, and the test suite that
skips what this torch cannot run.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hyperrng.platforms.errors import HyperRNGError

__all__ = [
    "EnteredUntraced",
    "Feature",
    "FEATURES",
    "eager_when_traced",
    "feature",
    "outside_dynamo",
    "report_lines",
    "require",
]


def outside_dynamo(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, which Dynamo runs as Python behind a graph break rather than tracing into it, or ``fn`` itself on a
    torch without torch's lazy ``_disable_dynamo`` (it imports Dynamo at its first call, made only while a
    compilation runs, so eager calls pay one wrapper call). For code whose Python state must not be baked into
    a graph (a tracker's fork, a position table, an eager draw)."""
    disable = getattr(torch, "_disable_dynamo", None)
    return fn if disable is None else disable(fn)


class EnteredUntraced:
    """Mixin for a context manager whose state is Python: while Dynamo traces its ``__enter__`` or ``__exit__``,
    they return ``self._enter_outside_the_graph()`` or ``self._exit_outside_the_graph(*exc)``, which run them as
    Python behind a graph break (:func:`outside_dynamo`), where ``is_dynamo_compiling()`` is false. Under
    ``fullgraph=True`` Dynamo's refusal names these methods."""

    __slots__ = ()

    @outside_dynamo
    def _enter_outside_the_graph(self) -> Any:
        return self.__enter__()  # type: ignore[attr-defined]

    @outside_dynamo
    def _exit_outside_the_graph(self, *exc: Any) -> Any:
        return self.__exit__(*exc)  # type: ignore[attr-defined]


def eager_when_traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` that calls its :func:`outside_dynamo` copy only while Dynamo traces it: the decorator form of the
    ``if torch.compiler.is_dynamo_compiling(): return <fn>_outside_the_graph(...)`` that forks and checkpoints write
    at their call sites. Eager calls pay one frame and never import Dynamo (``outside_dynamo``'s first call
    does, which imports Triton on torch 2.5)."""
    untraced = outside_dynamo(fn)

    @functools.wraps(fn)
    def eager(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            return untraced(*args, **kwargs)
        return fn(*args, **kwargs)

    return eager


@dataclass(frozen=True)
class Feature:
    """One optional feature: its key, what it is, the torch release that brought its API, and a detector.

    Attributes:
        key: the name code and tests refer to it by (``"sim"``, ``"local-tensor"``, ...).
        title: what a user knows it as, for messages.
        needs: the oldest torch release that has the API (``"2.9"``).
        api: the torch API it is built on, for ``hyperrng info``.
    """

    key: str
    title: str
    needs: str
    api: str
    _detect: Callable[[], bool]

    @property
    def available(self) -> bool:
        """Whether the installed torch has the API (asked afresh: nothing is cached)."""
        try:
            return bool(self._detect())
        except Exception:  # a half-present API (a vendor build) counts as absent, never as a crash
            return False

    def refusal(self) -> str:
        """One line saying that this torch lacks the feature and what to install instead."""
        return (
            f"{self.title} needs torch >= {self.needs} ({self.api}); this is torch {torch.__version__}: "
            f"upgrade torch (pip install 'torch>={self.needs}') or do without it"
        )


def _has_python_device_backend() -> bool:
    acc = getattr(torch._C, "_acc", None)
    return all(
        hasattr(acc, name)
        for name in (
            "PrivateUse1Hooks",
            "DeviceGuard",
            "register_python_privateuseone_hook",
            "register_python_privateuseone_device_guard",
        )
    )


def _has_thread_local_rng_key() -> bool:
    # Portable mode registers its kernels on torch's CustomRNGKeyId key and includes that key in
    # a thread's dispatch while the thread is in the mode (hyperrng.portable._ops); its attention
    # kernels hand calls outside the mode back to torch's own, read with torch.library.get_kernel.
    if not hasattr(torch.library, "get_kernel"):
        return False
    c = torch._C
    needed = ("_parse_dispatch_key", "_dispatch_tls_set_dispatch_key_included", "_dispatch_keyset_full_after")
    if not all(hasattr(c, name) for name in needed) or not hasattr(torch.library.Library, "fallback"):
        return False
    return c._parse_dispatch_key("CustomRNGKeyId") is not None


def _can_trace_portable_ops() -> bool:
    # torch.compile records portable ops as hyperrng custom ops (hyperrng.portable._traced): kernels the
    # Python dispatcher runs while tracing (OpOverload.py_impl, _op_dk) on PythonTLSSnapshot, while a
    # TracingContext is set, and custom ops with tags.
    op = torch.ops.aten.uniform_.default
    return (
        _has_thread_local_rng_key()
        and hasattr(op, "py_impl")
        and hasattr(op, "_op_dk")
        and hasattr(torch._C.DispatchKey, "PythonTLSSnapshot")
        and hasattr(torch._guards.TracingContext, "try_get")
        and hasattr(torch.utils._python_dispatch, "_disable_current_modes")
        and "tags" in inspect.signature(torch.library.custom_op).parameters
    )


def _dtensor_takes_a_user_generator() -> bool:
    # torch >= 2.9 pops a random op's generator= off the op and hands it to the RNG tracker's
    # region; older DTensor leaves it on the local op, so every shard draws from the user
    # generator's own position and no tracker (torch's or hyperrng's) ever sees it.
    from torch.distributed.tensor import _random

    return "generator" in inspect.signature(_random._RNGStateTracker._distribute_region).parameters


FEATURES: tuple[Feature, ...] = (
    Feature(
        "sim",
        "the simulated device (platform 'sim')",
        "2.10",
        "torch._C._acc: PrivateUse1 hooks written in Python",
        _has_python_device_backend,
    ),
    Feature(
        "portable-mode",
        "portable mode (hyperrng.portable_random)",
        "2.9",
        "kernels on the CustomRNGKeyId dispatch key, switched per thread; torch.library.get_kernel",
        _has_thread_local_rng_key,
    ),
    Feature(
        "portable-compile",
        "portable mode inside torch.compile",
        "2.9",
        "Python-dispatcher kernels on PythonTLSSnapshot (OpOverload.py_impl); custom ops with tags",
        _can_trace_portable_ops,
    ),
    Feature(
        "local-tensor",
        "LocalTensor support (sharded regions under LocalTensorMode)",
        "2.10",
        "torch.distributed._local_tensor",
        lambda: importlib.util.find_spec("torch.distributed._local_tensor") is not None,
    ),
    Feature(
        "user-generator",
        "a generator= passed to DTensor random ops (drawn per shard, advanced like the default generator)",
        "2.9",
        "DTensor hands generator= to its RNG tracker",
        _dtensor_takes_a_user_generator,
    ),
)
"""Every optional feature, in the order ``hyperrng info`` lists them."""

_BY_KEY = {f.key: f for f in FEATURES}


def feature(key: str) -> Feature:
    """The :class:`Feature` named ``key``.

    Raises:
        KeyError: no feature has that key (a programming error, not a user's).
    """
    return _BY_KEY[key]


def require(key: str, error: type[HyperRNGError]) -> None:
    """Raise ``error`` with :meth:`Feature.refusal` as its one-line message when this torch lacks ``key``.

    Call it before changing anything, so that a refusal leaves every state as it was.
    """
    found = feature(key)
    if not found.available:
        raise error(found.refusal())


def report_lines() -> list[str]:
    """The lines ``hyperrng info`` shows: one per feature, ``available`` or why not."""
    lines = [f"torch features (hyperrng supports torch >= 2.5; this is {torch.__version__}):"]
    for f in FEATURES:
        state = "available" if f.available else f"unavailable - needs torch >= {f.needs}"
        lines.append(f"  {f.key:<16} {state}  [{f.api}]")
    return lines
