"""Named RNG streams: the tracker that Megatron-core, TransformerEngine and slapo code forks.

A *stream* is an RNG state that a region of code borrows::

    tracker = hyperrng.get_rng_tracker()
    tracker.add("model-parallel-rng", seed=1234)
    with tracker.fork("model-parallel-rng"):
        y = dropout(x)          # draws from the stream, which then remembers its advance

Streams live on the **current device's default generator** of the current platform
(``platforms.current()``, resolved at every call so ``platforms.use(...)`` works). On an
accelerator platform a fork swaps only the device generator, as Megatron-core's and
TransformerEngine's trackers do: random ops on CPU tensors inside a fork keep drawing from
(and advancing) torch's CPU generator, exactly as outside. That keeps forks cheap; wrap the
region in :func:`hyperrng.random.fork_rng` when the CPU state must be isolated too. On the
CPU platform the device generator *is* torch's CPU generator, so the fork covers it.

Two modes, chosen when the first stream is added (``graph_safe`` argument):

* **byte copies** — the stream's state bytes are copied into the generator on entry and
  read back on exit (every platform);
* **graph-safe** — where the platform's generator offers ``graphsafe_get_state``,
  ``graphsafe_set_state`` and ``clone_state`` (CUDA, NPU, the simulated accelerator), the
  fork swaps generator-state *objects* instead of copying bytes: no copy, no allocation,
  and the swap can be captured in a CUDA graph. Snapshots (:meth:`RNGStatesTracker.get_states`)
  and new streams are cloned, so call those outside graph capture. Support is detected on
  ``platform.default_generator()`` by calling the API, never assumed.

The tracker satisfies the protocol TransformerEngine modules and activation-checkpoint code
use (``fork(name)`` as a context manager, ``get_states()``, ``set_states(states)``), so
``te.TransformerLayer(..., get_rng_state_tracker=hyperrng.get_rng_tracker)`` works.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

import torch

import platforms
from hyperrng.errors import (
    ArgumentTypeError,
    DuplicateStreamError,
    InvalidStateError,
    StreamNameError,
    TrackerStateError,
    UnknownStreamError,
)
from platforms import Platform
from platforms.validate import check_seed, check_state

__all__ = [
    "DATA_PARALLEL_STREAM",
    "EXPERT_PARALLEL_STREAM",
    "MODEL_PARALLEL_STREAM",
    "CudaRNGStatesTracker",
    "RNGStatesTracker",
    "RNGTrackerProtocol",
    "StreamNameError",
    "TrackerStateError",
    "get_cuda_rng_tracker",
    "get_rng_tracker",
    "set_rng_tracker",
]

MODEL_PARALLEL_STREAM = "model-parallel-rng"
"""The stream :meth:`RNGStatesTracker.fork` uses by default (Megatron-core's and TE's name)."""

DATA_PARALLEL_STREAM = "data-parallel-rng"
"""Megatron-core's stream that follows the default seed."""

EXPERT_PARALLEL_STREAM = "expert-parallel-rng"
"""Megatron-core's stream for mixture-of-experts layers."""

_SEED_HINT = "did you call set_random_seed / model_parallel_manual_seed (or apply_layout), or tracker.add(name, seed)?"
_GRAPH_SAFE_API = ("graphsafe_get_state", "graphsafe_set_state", "clone_state")


@runtime_checkable
class RNGTrackerProtocol(Protocol):
    """What TransformerEngine and activation-checkpoint code call on an RNG tracker."""

    def fork(self, name: str = ...) -> Any: ...

    def get_states(self) -> dict[str, Any]: ...

    def set_states(self, states: Mapping[str, Any]) -> None: ...


def _supports_graph_safe(gen: object) -> bool:
    """Whether ``gen`` really implements the graph-safe API (CPU generators raise on call)."""
    if gen is None or not all(hasattr(gen, attr) for attr in _GRAPH_SAFE_API):
        return False
    try:
        gen.graphsafe_get_state()  # type: ignore[attr-defined]  # a view: no side effect
    except (NotImplementedError, RuntimeError):
        return False
    return True


class _Fork:
    """One ``with tracker.fork(name):`` region; a plain class because it is cheaper than @contextmanager."""

    __slots__ = ("_tracker", "entered", "gen", "index", "name", "outer", "platform", "saved")

    def __init__(self, tracker: RNGStatesTracker, name: str, platform: Platform) -> None:
        self._tracker = tracker
        self.name = name
        self.platform = platform
        self.gen: Any = None
        self.index = 0
        self.saved: Any = None
        self.outer: _Fork | None = None
        self.entered = False

    def __enter__(self) -> None:
        tracker = self._tracker
        if self.entered:
            raise TrackerStateError(f"this fork of stream {self.name!r} is already entered; call tracker.fork() again.")
        state = tracker._states.get(self.name)
        if state is None:  # the tracker was reset between fork() and entering it
            raise UnknownStreamError(tracker._unknown(self.name))
        platform = self.platform
        gen = platform.default_generator()
        outer = tracker._active
        if tracker._graph_safe:
            if gen is not tracker._home:
                raise tracker._foreign_device(platform)
            # Outside any fork the generator holds the default state: keep a view of it.
            # Inside a fork it holds the outer stream's own object, which needs no saving.
            if outer is None:
                self.saved = gen.graphsafe_get_state()
            gen.graphsafe_set_state(state)
        elif gen is not None:
            current = gen.get_state()
            if outer is None:
                self.saved = current
            else:
                tracker._states[outer.name] = current
            gen.set_state(state)
        else:
            self.index = index = platform.current_device()
            current = platform.get_rng_state(index)
            if outer is None:
                self.saved = current
            else:
                tracker._states[outer.name] = current
            platform.set_rng_state(state, index)
        self.gen = gen
        self.outer = outer
        self.entered = True
        tracker._active = self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        tracker = self._tracker
        if tracker._active is not self:
            raise TrackerStateError(
                f"fork of stream {self.name!r} exited while another fork is innermost; exit forks in reverse order."
            )
        gen, outer, states = self.gen, self.outer, tracker._states
        back = self.saved if outer is None else states[outer.name]
        if tracker._graph_safe:
            # The stream's object advanced in place while it was swapped in: nothing to read back.
            gen.graphsafe_set_state(back)
        elif gen is not None:
            states[self.name] = gen.get_state()
            gen.set_state(back)
        else:
            states[self.name] = self.platform.get_rng_state(self.index)
            self.platform.set_rng_state(back, self.index)
        tracker._active = outer
        self.saved = None
        self.entered = False


class RNGStatesTracker:
    """Named RNG streams on the current platform's device generator.

    Args:
        graph_safe: ``None`` (default) uses the graph-safe mode when the platform's
            default generator supports it and byte copies otherwise; ``True`` requires it
            (:class:`TrackerStateError` when the first stream is added on a platform
            without it); ``False`` always copies bytes. See the module docstring.

    The tracker binds to the platform that is current when its first stream is added (or
    :meth:`set_states` fills it); :meth:`reset` unbinds it.
    """

    def __init__(self, graph_safe: bool | None = None) -> None:
        if graph_safe is not None and not isinstance(graph_safe, bool):
            raise ArgumentTypeError(f"graph_safe must be True, False or None, got {graph_safe!r}.")
        self._want_graph_safe = graph_safe
        self._states: dict[str, Any] = {}
        self._seeds: dict[int, str] = {}
        self._platform: Platform | None = None
        self._graph_safe = False
        self._home: Any = None  # graph-safe mode: the generator whose device owns the state objects
        self._initialized = False
        self._active: _Fork | None = None

    # -- introspection --------------------------------------------------------------------
    def is_initialized(self) -> bool:
        """``True`` once :meth:`add` or :meth:`set_states` has been called since the last reset."""
        return self._initialized

    @property
    def graph_safe(self) -> bool | None:
        """Whether forks swap generator objects; ``None`` until the tracker is bound to a platform."""
        return self._graph_safe if self._platform is not None else None

    @property
    def platform(self) -> Platform | None:
        """The platform the streams belong to (``None`` while the tracker holds none)."""
        return self._platform

    @property
    def active_stream(self) -> str | None:
        """Name of the innermost stream being forked, or ``None`` outside any fork."""
        return self._active.name if self._active is not None else None

    def __contains__(self, name: object) -> bool:
        return name in self._states

    def __len__(self) -> int:
        """Number of streams held."""
        return len(self._states)

    def seeds(self) -> dict[str, int]:
        """Return ``{name: seed}`` for the streams created by :meth:`add` (not those restored by set_states)."""
        return {name: seed for seed, name in self._seeds.items()}

    # -- lifecycle ------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every stream and seed and unbind from the platform.

        Raises:
            TrackerStateError: a fork is active (its exit would restore a stream that is gone).
        """
        if self._active is not None:
            raise TrackerStateError(
                f"cannot reset the tracker inside a fork of stream {self._active.name!r}; reset it outside the fork."
            )
        self._states = {}
        self._seeds = {}
        self._platform = None
        self._graph_safe = False
        self._home = None
        self._initialized = False

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed`` (offset 0) on the current platform.

        The device generator is left exactly as it was. Everything is checked before
        anything changes, so a failed ``add`` leaves the tracker and the device untouched.

        Raises:
            StreamNameError: ``name`` is not a non-empty string.
            InvalidSeedError: ``seed`` is a bool, not an int, or outside [0, 2**64 - 1].
            DuplicateStreamError: the tracker already holds ``name``, or a stream with ``seed``.
            TrackerStateError: the streams belong to another platform, or graph-safe mode
                was required and the platform lacks it.
        """
        _check_name(name)
        value = check_seed(seed)
        if name in self._states:
            raise DuplicateStreamError(
                f"stream {name!r} already exists; pick another name, or reset() the tracker to reseed it."
            )
        if value in self._seeds:
            raise DuplicateStreamError(
                f"seed {value} is already used by stream {self._seeds[value]!r}; two streams with one seed "
                "would draw identical numbers. Derive distinct seeds (see hyperrng.layout)."
            )
        platform, graph_safe = self._target(rebind=False)
        state = self._new_state(platform, graph_safe, value)
        self._bind(platform, graph_safe)
        self._states[name] = state
        self._seeds[value] = name
        self._initialized = True

    def reseed(self, seeds: Mapping[str, int]) -> None:
        """Replace every stream by fresh ones seeded from ``{name: seed}``, all or nothing.

        This is :meth:`reset` followed by one :meth:`add` per entry, except that
        everything is checked and every state created first: on error the tracker keeps
        its old streams. The device generator is left as it was. The seeding recipes and
        :func:`hyperrng.layout.apply_layout` use it.

        Raises:
            StreamNameError, InvalidSeedError, DuplicateStreamError: as for :meth:`add`.
            TrackerStateError: a fork is active, or graph-safe mode was required and the
                current platform lacks it.
        """
        if self._active is not None:
            raise TrackerStateError(
                f"cannot reseed the tracker inside a fork of stream {self._active.name!r}; reseed it outside the fork."
            )
        if not isinstance(seeds, Mapping):
            raise ArgumentTypeError(f"reseed() takes a mapping of stream name to seed, got {type(seeds).__name__}.")
        owners: dict[int, str] = {}
        for name, seed in seeds.items():
            _check_name(name)
            value = check_seed(seed, f"seed of stream {name!r}")
            if value in owners:
                raise DuplicateStreamError(
                    f"streams {owners[value]!r} and {name!r} would share seed {value} and draw identical numbers; "
                    "derive distinct seeds (see hyperrng.layout)."
                )
            owners[value] = name
        platform, graph_safe = self._target(rebind=True)
        states = {name: self._new_state(platform, graph_safe, seed) for seed, name in owners.items()}
        self._bind(platform, graph_safe)
        self._states = states
        self._seeds = owners
        self._initialized = True

    def fork(self, name: str = MODEL_PARALLEL_STREAM) -> _Fork:
        """Return a context manager that runs its block on stream ``name``.

        On entry the current device generator switches to the stream; on exit (also when
        the block raises) the stream keeps its advance and the generator gets back the
        state it had before. Forks nest: ``s1 -> s2 -> s1`` draws exactly what three
        sequential forks would.

        Raises:
            UnknownStreamError: the tracker holds no stream ``name`` (with a hint on how to add it).
            TrackerStateError: the streams belong to another platform than the current one.
        """
        try:
            known = name in self._states
        except TypeError:  # an unhashable name
            known = False
        if not known:
            raise UnknownStreamError(self._unknown(name))
        platform = platforms.current()
        if platform is not self._platform:
            raise self._platform_mismatch(platform)
        return _Fork(self, name, platform)

    # -- snapshots ------------------------------------------------------------------------
    def get_states(self, *, as_tensors: bool = False) -> dict[str, Any]:
        """Return a snapshot ``{name: state}`` of every stream, including an active fork's advance.

        Later forks do not alter the snapshot. States are CPU ``uint8`` tensors in byte-copy
        mode and cloned generator objects in graph-safe mode (``as_tensors=True`` turns
        those into tensors, e.g. for a checkpoint). In graph-safe mode it clones: call it
        outside CUDA graph capture.
        """
        active = self._active
        if self._graph_safe:
            if as_tensors:
                return {name: gen.get_state() for name, gen in self._states.items()}
            return {name: gen.clone_state() for name, gen in self._states.items()}
        snapshot = {name: state.clone() for name, state in self._states.items()}
        if active is not None:
            snapshot[active.name] = (
                active.gen.get_state() if active.gen is not None else active.platform.get_rng_state(active.index)
            )
        return snapshot

    def set_states(self, states: Mapping[str, Any]) -> None:
        """Restore a snapshot from :meth:`get_states` (either form: tensors or generator objects).

        Every entry is validated before any is applied. A tracker that holds streams
        requires exactly its own names; an empty tracker adopts the names given (restoring
        a checkpoint into a fresh process). Inside a fork, the active stream continues from
        its restored state.

        Raises:
            InvalidStateError: ``states`` is not a mapping, lacks one of the tracker's
                streams, or holds a state of the wrong kind, dtype, size or device.
            UnknownStreamError: ``states`` names a stream the tracker does not hold.
            StreamNameError: a key is not a non-empty string.
            TrackerStateError: the streams belong to another platform.
        """
        if not isinstance(states, Mapping):
            raise ArgumentTypeError(
                f"set_states() takes the mapping get_states() returned, got {type(states).__name__}."
            )
        for name in states:
            _check_name(name)
        if self._states:
            extra = [name for name in states if name not in self._states]
            if extra:
                raise UnknownStreamError(
                    f"set_states() got stream(s) {extra} that the tracker does not hold (it holds "
                    f"{list(self._states)}); reset() it first to load a different set of streams."
                )
            missing = [name for name in self._states if name not in states]
            if missing:
                raise InvalidStateError(
                    f"set_states() lacks stream(s) {missing}; pass the complete mapping get_states() returned."
                )
        platform, graph_safe = self._target(rebind=False)
        template = platform.default_generator() if graph_safe else None
        order = list(self._states) or list(states)
        new = {name: self._coerce(name, states[name], platform, graph_safe, template) for name in order}
        self._bind(platform, graph_safe)
        self._states = new
        self._initialized = True
        active = self._active
        if active is not None:  # the generator holds the old state of the active stream
            if graph_safe:
                active.gen.graphsafe_set_state(new[active.name])
            elif active.gen is not None:
                active.gen.set_state(new[active.name])
            else:
                platform.set_rng_state(new[active.name], active.index)

    def graph_safe_states(self) -> dict[str, Any]:
        """The live generator-state objects of every stream (graph-safe mode only).

        Register them with ``torch.cuda.CUDAGraph.register_generator_state`` before
        capturing forks in a graph. Do not draw from them directly.

        Raises:
            TrackerStateError: the tracker copies bytes, so it has no such objects.
        """
        if not self._graph_safe:
            raise TrackerStateError(
                "graph_safe_states() needs a graph-safe tracker; this one copies bytes "
                f"(platform {self._platform.name if self._platform else None!r})."
            )
        return dict(self._states)

    # -- helpers --------------------------------------------------------------------------
    def _target(self, *, rebind: bool) -> tuple[Platform, bool]:
        """The platform and mode new states are made for; raises before anything changes.

        ``rebind`` ignores the current binding (the caller replaces every stream).
        """
        platform = platforms.current()
        if self._platform is not None and not rebind:
            if platform is not self._platform:
                raise self._platform_mismatch(platform)
            if self._graph_safe and platform.default_generator() is not self._home:
                raise self._foreign_device(platform)
            return platform, self._graph_safe
        if self._want_graph_safe is False:
            return platform, False
        supported = _supports_graph_safe(platform.default_generator())
        if self._want_graph_safe and not supported:
            raise TrackerStateError(
                f"graph_safe=True, but platform {platform.name!r} has no graph-safe generator API "
                f"({', '.join(_GRAPH_SAFE_API)}); use graph_safe=None to fall back to byte copies."
            )
        return platform, supported

    def _bind(self, platform: Platform, graph_safe: bool) -> None:
        self._platform = platform
        self._graph_safe = graph_safe
        self._home = platform.default_generator() if graph_safe else None

    def _new_state(self, platform: Platform, graph_safe: bool, seed: int) -> Any:
        if graph_safe:
            state = platform.default_generator().clone_state()  # type: ignore[union-attr]
            state.manual_seed(seed)
            return state
        # Seed the device generator and read the state back: the only portable way to get
        # a platform's state for a seed. The previous state is restored whatever happens.
        saved = platform.get_rng_state()
        try:
            platform.manual_seed(seed)
            return platform.get_rng_state()
        finally:
            platform.set_rng_state(saved)

    @staticmethod
    def _coerce(name: str, value: object, platform: Platform, graph_safe: bool, template: Any) -> Any:
        """Validate one snapshot entry and return it in this tracker's own form (a private copy)."""
        where = f"state of stream {name!r}"
        if isinstance(value, torch.Tensor):
            try:
                tensor = platform.check_rng_state(value)
            except InvalidStateError as exc:
                raise InvalidStateError(f"{where}: {exc}") from None
            if not graph_safe:
                return tensor.clone()
            gen = template.clone_state()
            gen.set_state(tensor)
            return gen
        if graph_safe:
            if isinstance(value, type(template)) and getattr(value, "device", None) == getattr(
                template, "device", None
            ):
                return value.clone_state()
            raise InvalidStateError(
                f"{where} must be a {type(template).__name__} of this platform's device or a state tensor, "
                f"got {type(value).__name__}."
            )
        get_state = getattr(value, "get_state", None)
        if callable(get_state):  # a generator object, e.g. from a graph-safe tracker's snapshot
            try:
                return check_state(get_state(), platform.state_nbytes, platform.name)
            except InvalidStateError as exc:
                raise InvalidStateError(f"{where}: {exc}") from None
        raise InvalidStateError(
            f"{where} must be a state tensor as returned by get_states(), got {type(value).__name__}."
        )

    def _unknown(self, name: object) -> str:
        held = list(self._states) or "no streams"
        return f"RNG stream {name!r} is not in the tracker (it holds {held}); {_SEED_HINT}"

    def _foreign_device(self, platform: Platform) -> TrackerStateError:
        return TrackerStateError(
            f"graph-safe streams live on device {self._home.device} but the current device is "
            f"{platform.current_device()}; fork them on their own device, or use graph_safe=False "
            "for streams that follow the current device."
        )

    def _platform_mismatch(self, platform: Platform) -> TrackerStateError:
        return TrackerStateError(
            f"the tracker's streams belong to platform {self._platform!r}, but the current platform is "
            f"{platform!r}; reset() the tracker and reseed it on the current platform."
        )

    def __repr__(self) -> str:
        mode = {None: "unbound", True: "graph-safe", False: "byte copies"}[self.graph_safe]
        return f"<RNGStatesTracker streams={list(self._states)} {mode}>"


def _check_name(name: object) -> None:
    if not isinstance(name, str):
        raise ArgumentTypeError(f"a stream name must be a non-empty string, got {type(name).__name__} {name!r}.")
    if not name:
        raise StreamNameError("a stream name must be a non-empty string, got ''; name the stream.")


CudaRNGStatesTracker = RNGStatesTracker
"""Alias for code migrating from Megatron-core, TransformerEngine or slapo (works on every platform)."""

_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """Return the process-wide tracker (pass this function as TE's ``get_rng_state_tracker``)."""
    return _TRACKER


get_cuda_rng_tracker = get_rng_tracker
"""Alias of :func:`get_rng_tracker` under Megatron-core's and slapo's name."""


def set_rng_tracker(tracker: RNGStatesTracker) -> RNGStatesTracker:
    """Make ``tracker`` the process-wide tracker (e.g. one built with ``graph_safe=False``); return the previous one.

    Raises:
        TypeError: ``tracker`` is not an :class:`RNGStatesTracker`.
        TrackerStateError: a fork of the current process-wide tracker is active.
    """
    global _TRACKER
    if not isinstance(tracker, RNGStatesTracker):
        raise ArgumentTypeError(f"expected an RNGStatesTracker, got {type(tracker).__name__}; pass RNGStatesTracker().")
    if _TRACKER._active is not None:
        raise TrackerStateError(
            f"cannot replace the process-wide tracker inside a fork of stream {_TRACKER._active.name!r}."
        )
    previous, _TRACKER = _TRACKER, tracker
    return previous
