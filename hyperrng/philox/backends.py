"""Which implementation of the Philox arithmetic serves a device, chosen once per device type.

Two backends compute the same numbers (see :mod:`hyperrng.philox`):

* ``"torch"``: plain torch tensor operations (:mod:`hyperrng.philox._torch`). It runs on
  every device and is the reference. On the CPU a small draw computes its rounds with NumPy
  (fewer, cheaper operations than torch's on a few thousand elements) and a large one a chunk
  at a time, in cache; on an accelerator it works in large chunks, so that it is not bound by
  kernel launches.
* ``"triton"``: one fused Triton kernel per draw (:mod:`hyperrng.philox._triton`), as fast as
  the device's own random ops. It serves a device type when Triton is installed, its active
  driver targets that device type, and a test draw there (an odd offset past ``2**32``, a
  48-bit key) equals the torch backend's: probed, not assumed, so that another Triton
  backend (an Ascend NPU's, say) joins by passing the probe.

``backend="auto"`` (every function's default) takes Triton where it serves the device and the
torch backend everywhere else, the CPU included. ``backend="triton"`` on a CPU tensor runs the
kernels under Triton's interpreter: exact and very slow, for tests. The probe runs at the
first draw on a device type that is not the CPU (or at ``hyperrng info``), once per process, and
never while the device's stream captures a graph (a draw there takes the torch backend until the
probe has run); ``hyperrng info`` shows its answer. ``import hyperrng`` never imports Triton.
"""

from __future__ import annotations

import functools
import threading

import torch

from hyperrng.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["BACKENDS", "check_backend", "describe", "device_type", "interpreter_refusal", "resolve"]

BACKENDS = ("auto", "torch", "triton")
"""The values of every ``backend=`` argument."""

_LOCK = threading.Lock()


def check_backend(backend: object) -> str:
    """``backend`` if it is one of :data:`BACKENDS`.

    Raises:
        ArgumentTypeError: it is not a string.
        InvalidArgumentError: it is another string.
    """
    if not isinstance(backend, str):
        raise ArgumentTypeError(f"backend must be one of {BACKENDS}, got {type(backend).__name__} {backend!r}.")
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    return backend


def device_type(device: torch.device) -> str:
    """``device.type``, remembered per device: torch builds a new string at every read of it (a third of a
    microsecond), and a portable draw asks several times."""
    kind = _DEVICE_TYPES.get(device)
    if kind is None:
        kind = _DEVICE_TYPES[device] = device.type
    return kind


_DEVICE_TYPES: dict[torch.device, str] = {}


def resolve(backend: str, device: torch.device) -> str:
    """The backend that computes a draw on ``device``: ``"torch"`` or ``"triton"`` (``backend`` checked).

    Raises:
        InvalidArgumentError: ``backend="triton"`` for a device type Triton does not serve; the
            message says why.
    """
    kind = device_type(device)
    if backend == "torch" or (backend == "auto" and kind == "cpu"):
        return "torch"
    if kind == "cpu":  # "triton" on the host: the interpreter
        reason = interpreter_refusal()
        if reason is None:
            return "triton"
        raise InvalidArgumentError(f"backend='triton' cannot draw on the CPU: {reason}; use backend='auto' or 'torch'.")
    reason = _triton_refusal(kind)
    if reason is None:
        return "triton"
    if backend == "auto":
        return "torch"
    raise InvalidArgumentError(
        f"backend='triton' cannot draw on {kind}: {reason}; use backend='auto' or 'torch' there."
    )


def describe(device: torch.device) -> tuple[str, str]:
    """The backend ``backend="auto"`` uses on ``device``, and why, for ``hyperrng info``."""
    if device.type == "cpu":
        return "torch", "the reference; Triton serves no host device"
    reason = _triton_refusal(device.type)
    if reason is None:
        import triton

        return "triton", f"Triton {triton.__version__} serves {device.type!r} and passed the test draw"
    return "torch", reason


def _triton_refusal(device_type: str) -> str | None:
    if device_type in _PROBED:  # answered: the cached answer, without the lock (every draw asks)
        return _probe(device_type)
    if _capturing(device_type):  # a test draw cannot run, nor be read back, there
        return f"Triton not probed yet on {device_type}: the device's stream is capturing a graph (probed later)"
    with _LOCK:
        reason = _probe(device_type)
        _PROBED.add(device_type)
        return reason


@functools.cache
def interpreter_refusal() -> str | None:
    """Why Triton's interpreter cannot run the kernels on CPU tensors here, or ``None``: Triton missing, or
    an older one than the kernels were written for (torch 2.5's Triton 3.1 is), found by loading them and
    by a test draw that must equal the torch backend's. Asked once per process."""
    from hyperrng.philox import _triton

    try:
        _triton.kernels(True)
        _triton.load("hyperrng.philox._triton_attention", True)  # attention's kernels, on the same Triton
        same = _triton.same_draws(torch.device("cpu"))
    except Exception as exc:  # any failure of a foreign package means: not usable
        return f"Triton's interpreter cannot run the kernels ({type(exc).__name__}: {_triton._gist(exc)})"
    if not same:
        return "Triton's interpreter drew other numbers than the torch backend"
    return None


_PROBED: set[str] = set()
"""Device types whose probe has run; its answer is kept for the process and shown by ``hyperrng info``."""


def _capturing(device_type: str) -> bool:
    import hyperrng.platforms as platforms

    p = platforms.current()
    return p.device_type == device_type and p.is_capturing()


@functools.cache
def _probe(device_type: str) -> str | None:
    from hyperrng.philox import _triton

    try:
        device = torch.device(device_type, torch.get_device_module(device_type).current_device())
    except Exception:  # a device type without a module, or none present: the draw below says so
        device = torch.device(device_type)
    return _triton.probe(device)
