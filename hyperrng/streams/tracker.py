"""Named RNG streams: the tracker that Megatron-core, TransformerEngine and slapo code forks.

A *stream* is an RNG state that a region of code borrows::

    tracker = hyperrng.get_rng_tracker()
    tracker.add("model-parallel-rng", seed=1234)
    with tracker.fork("model-parallel-rng"):
        y = dropout(x)          # draws from the stream, which then remembers its advance

Streams live on the **current device's default generator** of the current platform (``hyperrng.platforms.current()``,
resolved at every call so ``hyperrng.platforms.use(...)`` works). On an accelerator platform a fork swaps only the
device generator, as Megatron-core's and TransformerEngine's trackers do: random ops on CPU tensors inside a fork keep
drawing from (and advancing) torch's CPU generator, exactly as outside. That keeps forks cheap; wrap the region in
:func:`hyperrng.streams.fork.fork_rng` when the CPU state must be isolated too. On the CPU platform the device
generator *is* torch's CPU generator, so the fork covers it.

How a fork swaps the stream in (state bytes, or generator-state objects with ``graph_safe=True``) is decided when the
tracker binds to a platform (its first stream; :mod:`hyperrng.streams._swap`); :meth:`RNGStatesTracker.get_states` of
a default tracker returns byte tensors on every platform, as Megatron-core's does.

A fork's thread policy and its order under asyncio are told at :class:`~hyperrng.streams._chain._Fork`; forks that
can no longer be left (a thread ended, a process made by ``fork``) at :class:`~hyperrng.streams._chain.ForkChain`;
graphs at :meth:`RNGStatesTracker.register_graph`; TransformerEngine's protocol at :class:`RNGTrackerProtocol`.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping
from threading import Thread
from typing import Any, Protocol, runtime_checkable

import torch

import hyperrng.platforms as platforms
from hyperrng._guard import exclusive as _exclusive
from hyperrng._guard.interrupts import deferred
from hyperrng.errors import ArgumentTypeError, InvalidArgumentError, InvalidOperationError, UnknownStreamError
from hyperrng.platforms import Platform
from hyperrng.platforms._features import outside_dynamo
from hyperrng.platforms.mix import combine64
from hyperrng.platforms.validate import check_instance, check_seed
from hyperrng.streams._chain import ForkChain, Replacing, _Fork, _Process
from hyperrng.streams._swap import Swap, choose_swap

__all__ = [
    "DATA_PARALLEL_STREAM",
    "EXPERT_PARALLEL_STREAM",
    "MODEL_PARALLEL_STREAM",
    "CudaRNGStatesTracker",
    "RNGStatesTracker",
    "RNGTrackerProtocol",
    "InvalidArgumentError",
    "InvalidOperationError",
    "get_cuda_rng_tracker",
    "get_rng_tracker",
    "resolve_tracker",
    "set_rng_tracker",
]

MODEL_PARALLEL_STREAM = "model-parallel-rng"
"""The stream :meth:`RNGStatesTracker.fork` uses by default (Megatron-core's and TE's name)."""

DATA_PARALLEL_STREAM = "data-parallel-rng"
"""Megatron-core's stream that follows the default seed."""

EXPERT_PARALLEL_STREAM = "expert-parallel-rng"
"""Megatron-core's stream for mixture-of-experts layers."""

_SEED_HINT = (
    "seed the streams first: hyperrng.apply_layout(layout, seed, coords) for a layout's streams, "
    "hyperrng.megatron_model_parallel_manual_seed(seed, tp_rank, ep_rank, etp_rank) for Megatron-core's "
    "data-, model- and expert-parallel-rng, or tracker.add(name, seed) for one stream."
)


@runtime_checkable
class RNGTrackerProtocol(Protocol):
    """What TransformerEngine and activation-checkpoint code call on an RNG tracker (``fork(name)`` as a
    context manager, ``get_states()``, ``set_states(states)``): the tracker satisfies it, so
    ``te.TransformerLayer(..., get_rng_state_tracker=hyperrng.get_rng_tracker)`` works."""

    def fork(self, name: str = ...) -> Any: ...

    def get_states(self) -> dict[str, Any]: ...

    def set_states(self, states: Mapping[str, Any]) -> None: ...


class RNGStatesTracker(ForkChain):
    """Named RNG streams on the current platform's device generator.

    Args:
        graph_safe: ``False`` (default) copies state bytes on every platform, so
            :meth:`get_states` returns byte tensors, as Megatron-core's default tracker
            does. ``True`` swaps generator-state objects instead (capturable in CUDA
            graphs; :class:`InvalidOperationError` when the first stream is added on a
            platform without the graph-safe generator API). ``None`` means ``False``.

    The tracker binds to the platform that is current when its first stream is added (or
    :meth:`set_states` fills it); :meth:`reset` unbinds it.

    Raises:
        ArgumentTypeError: ``graph_safe`` is not a bool or ``None``.
    """

    def __init__(self, graph_safe: bool | None = False) -> None:
        if graph_safe is not None and not isinstance(graph_safe, bool):
            raise ArgumentTypeError(
                f"graph_safe must be True or False, got {type(graph_safe).__name__} {graph_safe!r}."
            )
        self._want_graph_safe = bool(graph_safe)
        self._states: dict[str, Any] = {}
        self._seeds: dict[int, str] = {}
        self._process = _Process.token  # the process whose streams these are (see _join_process)
        self._swap: Swap | None = None
        self._initialized = False
        self._active: _Fork | None = None
        # While a fork is open on a tracker whose forks may swap several devices' generators:
        # the thread that has it open (see _Fork.__enter__).
        self._claim: dict[str, Thread] = {}
        self._derivation: Any = None  # what derived these streams, their seeds then (hyperrng.seeding.layout's)

    def __getstate__(self) -> dict[str, Any]:
        """A pickled tracker (a DataLoader worker made by ``spawn`` unpickles its dataset) holds its streams' states,
        seeds and derivation (:func:`hyperrng.seeding.layout.recorded_derivation`). Unpickled, it binds to that
        process's platform and, in a worker, its first fork re-derives the streams as in one made by ``fork``
        (:meth:`_join_process`); elsewhere they continue where they were."""
        states = {name: state.numpy().tobytes() for name, state in self.get_states(as_tensors=True).items()}
        kept = {"graph_safe": self._want_graph_safe, "seeds": self._seeds, "derivation": self._derivation}
        return {**kept, "states": states}  # bytes: no shared memory

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(graph_safe=state["graph_safe"])  # type: ignore[misc]
        if state["states"]:
            self.set_states(
                {name: torch.frombuffer(bytearray(b), dtype=torch.uint8) for name, b in state["states"].items()}
            )
        self._seeds = dict(state["seeds"])
        self._derivation = state.get("derivation")
        self._process = None  # its first fork joins this process

    # -- introspection --------------------------------------------------------------------
    def is_initialized(self) -> bool:
        """``True`` once :meth:`add` or :meth:`set_states` has been called since the last reset."""
        return self._initialized

    @property
    def graph_safe(self) -> bool | None:
        """Whether forks swap generator objects; ``None`` until the tracker is bound to a platform."""
        return self._swap.in_place if self._swap is not None else None

    @property
    def platform(self) -> Platform | None:
        """The platform the streams belong to (``None`` while the tracker holds none)."""
        return self._swap.platform if self._swap is not None else None

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

        Forks of this tracker that can no longer be left by their own exits are cleared first
        (see *Recovery* in :class:`~hyperrng.streams._chain.ForkChain`): those a thread that has ended left open are
        dropped; those this thread left open because an exit was refused as out of order, and
        those a child process inherited from ``fork``, are left as their exits would leave
        them (the generator gets back the state it had before the outermost), and their exits
        then do nothing.

        Raises:
            InvalidOperationError: a fork of the tracker is open, on this thread (leave it
                first: its exit would restore a stream that is gone) or on another live thread;
                or a context entered inside a fork being cleared (a region, ``fork_rng``, a fork
                of another tracker) is still open. Nothing changed.
        """
        with Replacing(self, "reset the tracker", target=False).applying():
            self._states, self._seeds, self._derivation = {}, {}, None
            self._swap = None
            self._initialized = False

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed`` (offset 0) on the current platform.

        The device generator is left exactly as it was. Everything is checked before
        anything changes, so a failed ``add`` leaves the tracker and the device untouched.

        Raises:
            ArgumentTypeError: ``name`` is not a string, or ``seed`` not an int.
            InvalidArgumentError: ``name`` is empty;
                or ``seed`` is outside [0, 2**64 - 1];
                or the tracker already holds ``name``, or a stream with ``seed``.
            InvalidOperationError: the streams belong to another platform, a fork is open on
                another thread, or graph-safe mode was required and the platform lacks it;
                or another thread holds the device's generator, which making a
                byte-copy stream's state seeds for a moment (see :mod:`hyperrng._guard.exclusive`).
        """
        _check_name(name)
        value = check_seed(seed)
        if self._process is not _Process.token:  # inherited streams first (a worker's): the new one is its own
            self._join_process()
        if name in self._states:
            raise InvalidArgumentError(
                f"stream {name!r} already exists; pick another name, or reset() the tracker to reseed it."
            )
        if value in self._seeds:
            raise InvalidArgumentError(
                f"seed {value} is already used by stream {self._seeds[value]!r}; two streams with one seed "
                "would draw identical numbers. Derive distinct seeds (see hyperrng.seeding.layout)."
            )
        self._idle("add a stream", here_ok=True)
        swap = self._target(rebind=False)
        state = swap.new_state(value)
        self._swap = swap
        self._states[name] = state
        self._seeds[value] = name
        self._initialized = True

    def reseed(self, seeds: Mapping[str, int]) -> None:
        """Replace every stream by fresh ones seeded from ``{name: seed}``, all or nothing.

        This is :meth:`reset` followed by one :meth:`add` per entry, except that
        everything is checked and every state created first: on error the tracker keeps
        its old streams. The device generator is left as it was. The seeding recipes and
        :func:`hyperrng.seeding.layout.apply_layout` use it.

        Forks that their own exits can no longer leave are cleared first, as by :meth:`reset`.

        Raises:
            ArgumentTypeError, InvalidArgumentError: as for :meth:`add`.
            InvalidOperationError: a fork is open (see :meth:`reset`), or graph-safe mode was
                required and the current platform lacks it;
                or as for :meth:`add`; the old streams are kept.
        """
        replacement = Replacing(self, "reseed the tracker")
        if not isinstance(seeds, Mapping):
            raise ArgumentTypeError(f"reseed() takes a mapping of stream name to seed, got {type(seeds).__name__}.")
        owners: dict[int, str] = {}
        for name, seed in seeds.items():
            _check_name(name)
            value = check_seed(seed, f"seed of stream {name!r}")
            if value in owners:
                raise InvalidArgumentError(
                    f"streams {owners[value]!r} and {name!r} would share seed {value} and draw identical numbers; "
                    "derive distinct seeds (see hyperrng.seeding.layout)."
                )
            owners[value] = name
        swap = replacement.swap
        states = {name: swap.new_state(seed) for seed, name in owners.items()}  # type: ignore[union-attr]
        with replacement.applying():
            self._swap = swap
            self._states = states
            self._seeds = owners
            self._initialized = True

    def fork(self, name: str = MODEL_PARALLEL_STREAM) -> _Fork:
        """Return a context manager that runs its block on stream ``name``.

        On entry the current device generator switches to the stream; on exit (also when
        the block raises) the stream keeps its advance and the generator gets back the
        state it had before. Forks nest: ``s1 -> s2 -> s1`` draws exactly what three
        sequential forks would, and a fork of the stream already forked continues it (the
        inner block draws what the outer one would have drawn next, never its numbers again).

        While the fork is open this thread holds the device's generator; see the module
        docstring for what other threads meet. Forks nest freely on one thread.

        Raises:
            ArgumentTypeError: ``name`` is not a string.
            UnknownStreamError: the tracker holds no stream ``name`` (with a hint on how to add it).
            InvalidOperationError: the streams belong to another platform than the current one;
                on entry, a fork of this tracker is open on another thread (or was abandoned
                by one that ended); or on entry, another thread holds the device's generator.
        """
        try:
            known = name in self._states
        except TypeError:  # an unhashable name
            known = False
        if not known:
            _check_name(name)
            raise UnknownStreamError(self._unknown(name))
        platform = platforms.current()
        if platform is not self._swap.platform:  # type: ignore[union-attr]  # bound: it holds a stream
            raise self._platform_mismatch(platform)
        return _Fork(self, name)

    # -- snapshots ------------------------------------------------------------------------
    def get_states(self, *, as_tensors: bool = False) -> dict[str, Any]:
        """Return a snapshot ``{name: state}`` of every stream, including an active fork's advance.

        Later forks do not alter the snapshot. States are CPU ``uint8`` tensors (the
        platform's state format), except on a ``graph_safe=True`` tracker, which returns
        cloned generator objects unless ``as_tensors=True`` (call it outside CUDA graph
        capture: it clones). Under ``torch.compile`` it runs behind a graph break.
        """
        if torch.compiler.is_dynamo_compiling():  # Dynamo would trace the byte copies into the graph, and fail
            return _get_states_untraced(self, as_tensors=as_tensors)  # type: ignore[no-any-return]
        swap, active = self._swap, self._active
        if swap is None:
            return {}
        if active is not None:
            self._check_not_abandoned("snapshot the streams")
            self._check_uncovered("snapshot the streams")
        snapshot = {name: swap.export(state, as_tensors) for name, state in self._states.items()}
        if active is not None and not swap.in_place:  # the generator holds the active stream's advance
            snapshot[active.name] = swap.export(active.read(), as_tensors)
        return snapshot

    def set_states(self, states: Mapping[str, Any]) -> None:
        """Restore a snapshot from :meth:`get_states` (either form: tensors or generator objects).

        Every entry is validated before any is applied, and the snapshot is applied whole
        or not at all (an interrupt while it is applied puts the previous streams back). A
        tracker that holds streams requires exactly its own names; an empty tracker adopts
        the names given (restoring a checkpoint into a fresh process). Inside a fork on this
        thread, the active stream continues from its restored state; forks that their own
        exits can no longer leave are cleared first, as by :meth:`reset`.

        Raises:
            ArgumentTypeError: ``states`` is not a mapping, or a key is not a string.
            InvalidArgumentError: ``states`` lacks one of the tracker's streams, or holds a
                state of the wrong kind, dtype, size or device;
                or a key is empty.
            UnknownStreamError: ``states`` names a stream the tracker does not hold.
            InvalidOperationError: the streams belong to another platform, or a fork is open
                on another live thread.

        Under ``torch.compile`` it runs behind a graph break.
        """
        if torch.compiler.is_dynamo_compiling():
            _set_states_untraced(self, states)
            return
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
                raise InvalidArgumentError(
                    f"set_states() lacks stream(s) {missing}; pass the complete mapping get_states() returned."
                )
        self._idle("set the states", replacing=True, here_ok=True)
        if self._active is not None and not self._stuck():
            self._check_uncovered("set the states", writing=True)
        swap = self._target(rebind=False)
        order = list(self._states) or list(states)
        new = {}
        for name in order:
            try:
                new[name] = swap.coerce(name, states[name])
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"state of stream {name!r}: {exc}") from None
        if self._active is not None and self._stuck():
            self._check_forks_leavable("set the states")
            with deferred():
                self._leave_forks()
                self._replace_states(swap, new)
            return
        self._replace_states(swap, new)

    def _replace_states(self, swap: Swap, new: dict[str, Any]) -> None:
        """The apply step of :meth:`set_states`: all of it, or (on any exception, an interrupt
        included) none. Not under deferred signals: recompute calls it on every backward."""
        before = self._swap, self._states, self._initialized
        active = self._active
        live = active.read() if active is not None else None  # the generator holds the active stream
        try:
            self._swap = swap
            self._states = new
            self._initialized = True
            if active is not None:
                active.write(new[active.name])
            self._process = _Process.token  # streams set in this process are its own: no worker re-derives them
        except BaseException:
            self._swap, self._states, self._initialized = before
            if active is not None:
                _exclusive.redo(active.write, live)
            raise

    def graph_safe_states(self) -> dict[str, Any]:
        """The live generator-state objects of every stream (graph-safe mode only).

        :meth:`register_graph` registers them with a graph before capture (what
        ``torch.cuda.CUDAGraph.register_generator_state`` does for each). Do not draw from
        them directly.

        Raises:
            InvalidOperationError: the tracker copies bytes, so it has no such objects.
        """
        if not self.graph_safe:
            raise InvalidOperationError(
                "graph_safe_states() needs a graph-safe tracker (RNGStatesTracker(graph_safe=True)); this one "
                f"copies bytes (platform {self.platform.name if self.platform else None!r}).",
                reason="tracker",
            )
        return dict(self._states)

    def register_graph(self, graph: Any) -> None:
        """Let ``graph`` capture forks of this tracker: register every stream's state with it.

        The platform-neutral form of Megatron-core's ``graph.register_generator_state(state)``
        over its graph-safe states: ``graph`` is the device's graph object
        (``torch.cuda.CUDAGraph``, or any with ``register_generator_state``). Call it after
        the streams are seeded and before capture begins; forks captured in the graph then
        draw, at each replay, the numbers eager forks would draw from the same positions (on a
        CUDA graph, or the graph of any device whose platform answers ``is_capturing()``). A copying
        tracker's fork while the device captures is refused before it copies anything: a graph would
        replay none of its copies.

        Streams made later (:meth:`add`, :meth:`reseed`, :meth:`set_states`, a checkpoint
        load) are new states: register them with the graphs that capture them. Registering
        a state twice, or one torch registered itself, changes nothing.

        Raises:
            ArgumentTypeError: ``graph`` has no ``register_generator_state`` method.
            InvalidOperationError: the tracker copies bytes (build it with
                ``RNGStatesTracker(graph_safe=True)``) or holds no streams yet; the streams
                belong to another platform; or the device is capturing already (register
                before capture). Nothing is registered then.
        """
        if not callable(getattr(graph, "register_generator_state", None)):
            raise ArgumentTypeError(
                f"register_graph() takes the device's graph object (torch.cuda.CUDAGraph or one with "
                f"register_generator_state), got {type(graph).__name__}."
            )
        if not self._states:
            raise InvalidOperationError(
                "the tracker holds no streams to register; seed them first (apply_layout, a seeding recipe, or "
                "tracker.add), then register the graph.",
                reason="tracker",
            )
        if not self.graph_safe:
            raise InvalidOperationError(
                "register_graph() needs a graph-safe tracker, whose streams are generator states a graph can "
                "capture; this one copies bytes. Build it with RNGStatesTracker(graph_safe=True) (Megatron-core's "
                "use_cudagraphable_rng=True) and seed it again.",
                reason="tracker",
            )
        states = dict(self._states)
        platform = platforms.current()
        if platform is not self._swap.platform:  # type: ignore[union-attr]  # bound: it holds a stream
            raise self._platform_mismatch(platform)
        if platform.is_capturing():
            raise InvalidOperationError(
                f"device {platform.device()} is capturing a graph already; register the graph before capture begins.",
                reason="tracker",
            )
        for state in states.values():
            graph.register_generator_state(state)

    # -- helpers --------------------------------------------------------------------------
    def _capture_refusal(self, name: str) -> InvalidOperationError:
        """The refusal of a fork of a copying tracker while the device captures a graph."""
        return InvalidOperationError(
            f"stream {name!r} cannot be forked while device {self.platform.device()} is capturing a graph: this "  # type: ignore[union-attr]
            "tracker copies state bytes in and out, which a graph does not replay. Capture forks of a graph-safe "
            "tracker instead: RNGStatesTracker(graph_safe=True) (Megatron-core's use_cudagraphable_rng=True), "
            "with tracker.register_graph(graph) before capture.",
            reason="tracker",
        )

    def _target(self, *, rebind: bool) -> Swap:
        """The swap strategy new states are made for; raises before anything changes.

        ``rebind`` ignores the current binding (the caller replaces every stream).
        """
        platform = platforms.current()
        if self._swap is not None and not rebind:
            if platform is not self._swap.platform:
                raise self._platform_mismatch(platform)
            return self._swap
        return choose_swap(platform, self._want_graph_safe)

    def _join_process(self) -> None:
        """Before the first fork in a child process made by ``fork``, or of a tracker unpickled: in a DataLoader
        worker, re-derive every stream from the state it held when the worker started and torch's seed for the worker
        (``get_worker_info().seed``, the base seed the loader drew for the epoch plus the worker's id),
        as torch reseeds its own generator there, so that workers draw distinct numbers, the same in
        every run and after a resume: the loader's base seed comes from the restored generator, and a
        stream's state is the same whether a seed, ``set_states`` or a checkpoint made it (its seed is
        not: a restored stream has none). A fork the worker inherited open is dropped without giving
        the generator the state it had before that fork: torch's worker loop has seeded the generator
        for the worker since, which is what the worker must keep. Other children continue the parent's
        streams, as a child continues any generator it inherits."""
        self._process = _Process.token
        data = sys.modules.get("torch.utils.data")
        info = data.get_worker_info() if data is not None else None
        if info is None or not self._states:
            return
        self._active = None  # an inherited chain: no thread of this process can leave it
        self._claim.clear()
        states = self.get_states(as_tensors=True)
        self.reseed({name: combine64(WORKER_DOMAIN, _digest(state), info.seed) for name, state in states.items()})

    def _unknown(self, name: object) -> str:
        held = list(self._states) or "no streams"
        data = sys.modules.get("torch.utils.data")
        if not self._states and data is not None and data.get_worker_info() is not None:
            # A worker started by spawn or forkserver imports hyperrng afresh: the process-wide tracker is empty.
            hint = (
                "in this DataLoader worker the tracker is empty. Workers started by fork inherit the streams the "
                "parent seeded before the loader started them; under spawn or forkserver a worker imports hyperrng "
                "afresh and gets only the dataset: keep the seeded tracker on the dataset "
                "(self.tracker = hyperrng.get_rng_tracker() in its __init__; it pickles with its streams) and fork "
                "from self.tracker."
            )
        else:
            hint = _SEED_HINT
        return f"RNG stream {name!r} is not in the tracker (it holds {held}); {hint}"

    def _platform_mismatch(self, platform: Platform) -> InvalidOperationError:
        return InvalidOperationError(
            f"the tracker's streams belong to platform {self.platform!r}, but the current platform is "
            f"{platform!r}; reset() the tracker and reseed it on the current platform.",
            reason="tracker",
        )

    def __repr__(self) -> str:
        mode = {None: "unbound", True: "graph-safe", False: "byte copies"}[self.graph_safe]
        return f"<RNGStatesTracker streams={list(self._states)} {mode}>"


WORKER_DOMAIN = 0x574F524B45523031  # "WORKER01": keeps a worker's stream seeds apart from other uses of combine64
"""First value mixed into a stream's seed in a DataLoader worker (:meth:`RNGStatesTracker._join_process`)."""


def _digest(state: torch.Tensor) -> int:
    """A 64-bit digest of a stream's state (a CPU ``uint8`` tensor): what a worker's stream seed derives from."""
    return int.from_bytes(hashlib.blake2b(state.numpy().tobytes(), digest_size=8).digest(), "little")


def refuse_in_fork(tracker: RNGStatesTracker, what: str) -> None:
    """Refuse ``what`` (a read of every stream's position, which a fork's exit would make stale) while a
    fork of ``tracker`` is open, on any thread, or left open by a thread that has ended; nothing changes."""
    tracker._idle(what)


_get_states_untraced = outside_dynamo(RNGStatesTracker.get_states)
_set_states_untraced = outside_dynamo(RNGStatesTracker.set_states)


def _check_name(name: object) -> None:
    if not isinstance(name, str):
        raise ArgumentTypeError(f"a stream name must be a non-empty string, got {type(name).__name__} {name!r}.")
    if not name:
        raise InvalidArgumentError("a stream name must be a non-empty string, got ''; name the stream.")


class CudaRNGStatesTracker(RNGStatesTracker):
    """:class:`RNGStatesTracker` under Megatron-core's name and constructor, on every platform.

    For code that builds its own tracker as Megatron-core, TransformerEngine or slapo do.

    Args:
        use_cudagraphable_rng: Megatron-core's name for ``graph_safe``: streams are
            generator objects that a CUDA graph can capture.
        is_inference_rng_tracker: must be ``False``. Megatron-core's inference tracker
            turns ``add`` and ``fork`` into no-ops; hyperrng has no such tracker.

    Raises:
        ArgumentTypeError: a flag is not a bool.
        InvalidArgumentError: ``is_inference_rng_tracker`` is ``True``.
    """

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False) -> None:
        for flag, value in (
            ("use_cudagraphable_rng", use_cudagraphable_rng),
            ("is_inference_rng_tracker", is_inference_rng_tracker),
        ):
            if not isinstance(value, bool):
                raise ArgumentTypeError(f"{flag} must be True or False, got {type(value).__name__} {value!r:.40}.")
        if is_inference_rng_tracker:
            raise InvalidArgumentError(
                "is_inference_rng_tracker=True selects Megatron-core's inference tracker, whose add() and fork() do "
                "nothing; hyperrng has none. Drop the flag (forks then switch streams as in training)."
            )
        super().__init__(graph_safe=use_cudagraphable_rng)

    @property
    def use_cudagraphable_rng(self) -> bool:
        """Megatron-core's name for whether the streams are graph-safe generator objects."""
        return self._want_graph_safe

    @property
    def is_inference_rng_tracker(self) -> bool:
        """Always ``False``: read by Megatron-core's CUDA-graph code."""
        return False


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """Return the process-wide tracker (pass this function as TE's ``get_rng_state_tracker``)."""
    return _TRACKER


get_cuda_rng_tracker = get_rng_tracker
"""Alias of :func:`get_rng_tracker` under Megatron-core's and slapo's name."""


def resolve_tracker(tracker: object) -> RNGStatesTracker:
    """``tracker``, or the process-wide one for ``None``.

    Raises:
        ArgumentTypeError: ``tracker`` is neither ``None`` nor an :class:`RNGStatesTracker`.
    """
    if tracker is None:
        return _TRACKER
    return check_instance(tracker, RNGStatesTracker, "tracker")  # type: ignore[no-any-return]


def set_rng_tracker(tracker: RNGStatesTracker) -> RNGStatesTracker:
    """Make ``tracker`` the process-wide tracker (e.g. one built with ``graph_safe=False``); return the previous one.

    Raises:
        TypeError: ``tracker`` is not an :class:`RNGStatesTracker`.
        InvalidOperationError: a fork of the current process-wide tracker is active.
    """
    global _TRACKER
    if not isinstance(tracker, RNGStatesTracker):
        raise ArgumentTypeError(f"expected an RNGStatesTracker, got {type(tracker).__name__}; pass RNGStatesTracker().")
    _TRACKER._idle("replace the process-wide tracker", replacing=True)
    previous, _TRACKER = _TRACKER, tracker
    return previous
