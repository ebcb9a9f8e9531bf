"""How a tracker's forks put a stream into the device generator: one strategy per tracker.

The strategy is chosen once, when the tracker binds to a platform (its first stream), and
never branched on again:

* **state bytes** (the default): the device's whole state is copied in and out, through
  the generator's own ``get_state`` / ``set_state`` where they are the whole state
  (counter-based devices: CUDA, NPU, the simulated accelerator), else through
  ``platform.get_rng_state`` / ``set_rng_state`` (the CPU, whose state carries its
  position cursor; platforms that expose no generator);
* **generator objects** (``graph_safe=True``; CUDA, NPU, the simulated accelerator): the
  fork swaps generator-state *objects* with ``graphsafe_get_state`` /
  ``graphsafe_set_state``: no copy, no allocation, capturable in a CUDA graph.
  Snapshots and new streams clone, so call those outside graph capture. Support is
  checked on ``platform.default_generator()`` by calling the API.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hyperrng._guard import exclusive as _exclusive
from hyperrng._guard.interrupts import deferred
from hyperrng.errors import InvalidArgumentError, InvalidOperationError
from hyperrng.platforms import Platform, StateIO

__all__ = ["Bound", "Swap", "choose_swap"]

_GRAPH_SAFE_API = ("graphsafe_get_state", "graphsafe_set_state", "clone_state")


def _supports_graph_safe(gen: object) -> bool:
    """Whether ``gen`` really implements the graph-safe API (CPU generators raise on call)."""
    if gen is None or not all(hasattr(gen, attr) for attr in _GRAPH_SAFE_API):
        return False
    try:
        gen.graphsafe_get_state()  # type: ignore[attr-defined]  # a view: no side effect
    except (NotImplementedError, RuntimeError):
        return False
    return True


# A stream's accessors on one device, and that device's (device type, index): the key that
# hyperrng._guard.exclusive holds it by.
Bound = tuple[Callable[[], Any], Callable[[Any], Any], tuple[str, int]]


class Swap:
    """How forks put a stream into the device generator: one strategy, chosen when the tracker binds.

    ``bind()`` returns the (read, write) pair for the current device and the device's
    (device type, index) for :mod:`hyperrng._guard.exclusive`; ``in_place`` says whether the
    stream's own object advances while swapped in (generator objects), so that nothing
    needs reading back on exit.
    """

    in_place = False
    one_device = True  # every fork swaps one and the same device's generator

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        # Where copies of states would be captured into a graph (which replays none of them): the
        # platform's question "is the current stream capturing?", asked by every fork; None where
        # the platform has no graphs, so that a fork there asks nothing.
        self.capturing: Callable[[], bool] | None = None
        # What bind() returns where that can never change (set by the first bind), so that a
        # fork need not ask the platform for its current device again.
        self.fixed: Bound | None = None

    def bind(self) -> Bound:
        raise NotImplementedError

    def new_state(self, seed: int) -> Any:
        """The state of a fresh stream seeded with ``seed``; the device is left as it was.

        Raises:
            InvalidOperationError: another thread holds the device (seeding it for a moment
                would change that thread's stream).
        """
        read, write, (device_type, index) = self.bind()
        with deferred():  # a signal cannot cut the restore or the release short
            below = _exclusive.hold(device_type, index, "creating a stream")
            saved = None
            try:
                saved = read()
                self.platform.manual_seed(seed)
                return read()
            finally:
                if saved is not None:
                    write(saved)
                _exclusive.release(device_type, index, below)

    def coerce(self, name: str, value: object) -> Any:
        """Validate one snapshot entry and return it in this strategy's own form (a private copy)."""
        raise NotImplementedError

    def export(self, state: Any, as_tensors: bool) -> Any:
        """A snapshot of one stream's state that later forks cannot alter."""
        raise NotImplementedError


class _StateBytes(Swap):
    """Copies of the current device's whole state, through :meth:`platforms.Platform._state_io`."""

    def __init__(self, platform: Platform) -> None:
        super().__init__(platform)
        self.one_device = platform.device_count() <= 1
        # Per device index (the platform's accessors do not change): the state I/O, and what bind() returns.
        self._io: dict[int, StateIO] = {}
        self._bound: dict[int, Bound] = {}
        if type(platform).is_capturing is not Platform.is_capturing:
            self.capturing = platform.is_capturing

    def io(self) -> StateIO:
        index = self.platform.current_device()
        io = self._io.get(index)
        if io is None:
            io = self._io[index] = self.platform._state_io(index)
        return io

    def bind(self) -> Bound:
        index = self.platform.current_device()
        bound = self._bound.get(index)
        if bound is None:
            io = self.io()
            bound = self._bound[index] = (io.read, io.write, (self.platform.device_type, index))
            if self.one_device:
                self.fixed = bound
        return bound

    def coerce(self, name: str, value: object) -> Any:
        return self.io().unpack(self.platform.check_rng_state(_as_state_tensor(name, value)))

    def export(self, state: Any, as_tensors: bool) -> Any:
        return self.io().pack(state)


class _GeneratorObjects(Swap):
    """Graph-safe swaps of generator-state objects on the device that created them."""

    in_place = True

    def __init__(self, platform: Platform) -> None:
        super().__init__(platform)
        self.home: Any = platform.default_generator()
        self.key = (platform.device_type, platform.current_device())

    def bind(self) -> Bound:
        gen = self.platform.default_generator()
        if gen is not self.home:
            raise InvalidOperationError(
                f"graph-safe streams live on device {self.home.device} but the current device is "
                f"{self.platform.current_device()}; fork them on their own device, or use graph_safe=False "
                "for streams that follow the current device.",
                reason="tracker",
            )
        return gen.graphsafe_get_state, gen.graphsafe_set_state, self.key  # type: ignore[union-attr]

    def new_state(self, seed: int) -> Any:
        self.bind()  # clones the generator's state: the device itself is never touched
        state = self.home.clone_state()
        state.manual_seed(seed)
        return state

    def coerce(self, name: str, value: object) -> Any:
        template = self.home
        if isinstance(value, type(template)) and getattr(value, "device", None) == template.device:
            return value.clone_state()
        if not isinstance(value, torch.Tensor):
            raise InvalidArgumentError(
                f"state of stream {name!r} must be a {type(template).__name__} of this platform's device or a "
                f"state tensor, got {type(value).__name__}."
            )
        gen = template.clone_state()
        gen.set_state(self.platform.check_rng_state(value))
        return gen

    def export(self, state: Any, as_tensors: bool) -> Any:
        return state.get_state() if as_tensors else state.clone_state()


def _as_state_tensor(name: str, value: object) -> Any:
    """A snapshot entry as a state tensor: tensors as they are, generator objects by their state."""
    if isinstance(value, torch.Tensor):
        return value
    get_state = getattr(value, "get_state", None)
    if callable(get_state):  # a generator object, e.g. from a graph-safe tracker's snapshot
        return get_state()
    raise InvalidArgumentError(
        f"state of stream {name!r} must be a state tensor as returned by get_states(), got {type(value).__name__}."
    )


def choose_swap(platform: Platform, graph_safe: bool) -> Swap:
    gen = platform.default_generator()
    if graph_safe:
        if not _supports_graph_safe(gen):
            raise InvalidOperationError(
                f"graph_safe=True, but platform {platform.name!r} has no graph-safe generator API "
                f"({', '.join(_GRAPH_SAFE_API)}); use graph_safe=False (byte copies).",
                reason="tracker",
            )
        return _GeneratorObjects(platform)
    return _StateBytes(platform)
