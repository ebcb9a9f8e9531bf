"""Portable mode: torch's own random ops draw Philox4x32-10, the same numbers everywhere.

Inside ``with hyperrng.portable_random(seed):`` (or after
``hyperrng.set_portable_random(True, seed)``) ``torch.rand``, ``torch.randn``,
``rand_like``, ``randn_like``, ``torch.randint``, ``Tensor.uniform_``/``normal_``/
``bernoulli_``/``random_``, ``F.dropout`` (and ``native_dropout``, its fused form on
accelerators) and every ``torch.nn.init`` function built on them draw from
:mod:`hyperrng.philox` on the calling thread, from one global sequence whose numbers depend on
the generator's position and the shape only.

The kernels are registered with torch once per process, when a thread first enters
the mode, on a dispatch key that only threads in the mode include (see
:mod:`hyperrng.portable._ops`): entering and leaving flip a thread-local bit and never touch
the dispatch table. Outside the mode a random op never reaches Python: torch's kernel,
torch's numbers, torch's cost. Inside it, non-random ops pass through untouched and a random
op costs a Python call plus its draw: on the CPU a few tens of microseconds for a small
tensor (``hyperrng bench --suite philox`` measures ``F.dropout`` on 2,048 elements), and on
a device Triton serves, one fused kernel launch. Entering needs torch 2.9 or newer;
elsewhere it raises :class:`UnsupportedPortableOpError` and changes nothing. Details, and
the limits of each op, in :mod:`hyperrng.portable._ops`.

Details at :class:`portable_random` (draws, positions, threads), :class:`_DTensorRouting`, :class:`_CtrlC` (Ctrl-C).
"""

from __future__ import annotations

import _signal  # signal's functions without the enum conversions (~10 us a call)
import importlib
import importlib.abc
import importlib.util
import signal
import sys
import threading
from types import TracebackType
from typing import Any

import torch

import hyperrng.platforms as platforms
from hyperrng._guard import exclusive as _exclusive
from hyperrng.errors import InvalidArgumentError
from hyperrng.platforms._features import EnteredUntraced
from hyperrng.platforms.validate import check_instance, check_seed
from hyperrng.portable import _traced  # noqa: F401 - joins the kernels' registration (compiled code in the mode)
from hyperrng.portable._kernels import PORTABLE_OPS, THREAD, Entry
from hyperrng.portable._ops import is_switched_on, pop, push, register, registered, switch, unsupported_ops
from hyperrng.sharding.tracker import ShardedRNGTracker
from hyperrng.sharding.tracker import _adapter_class as adapter_class
from hyperrng.sharding.tracker import _dtensor_random_module as dtensor_random_module

__all__ = [
    "PORTABLE_OPS",
    "is_portable_random_enabled",
    "mode_applied",
    "portable_random",
    "registered",
    "set_portable_random",
    "thread_mode",
    "unsupported_ops",
]


# -- DTensor routing -----------------------------------------------------------------------------
class _DTensorRouting:
    """DTensor's RNG tracker (one per process) is hyperrng's while any thread is in portable mode.

    The first entry installs the adapter of :meth:`ShardedRNGTracker.install_dtensor` unless
    hyperrng's is there already; the last exit puts back what was there. Entries are
    counted per thread, and a thread that has ended counts as gone (as its hold does in
    :mod:`hyperrng._guard.exclusive`): one that died inside the mode does not keep the adapter
    installed past the next entry or exit of another thread.

    So ``portable_random(seed)`` alone makes DTensor random ops sharding-invariant. An entry made before
    DTensor is in use (``torch.distributed.tensor`` imported or a process group initialised) waits for it:
    when DTensor's RNG module is first imported (:class:`_RouteOnImport`), it routes from then on. Not yet
    on CUDA meshes: there DTensor runs a random op without ``generator=`` through a traceable path that asks
    the tracker for offsets only, with no region for the portable kernels to draw the shard's global
    indices from.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users: dict[threading.Thread, int] = {}  # thread -> its entries that routed DTensor
        self.waiting: dict[Entry, threading.Thread] = {}  # entries made before DTensor was in use
        self.installed: Any = None  # the adapter this routing installed, if it did
        self.previous: Any = None  # the tracker it replaced
        self.tracker: ShardedRNGTracker | None = None

    def _forget_ended(self) -> None:
        for thread in [t for t in self.users if not _exclusive.alive(t)]:  # never asked where a signal lands
            del self.users[thread]
        for entry in [e for e, t in self.waiting.items() if not _exclusive.alive(t)]:
            del self.waiting[entry]
        if not self.waiting:
            _ROUTE_ON_IMPORT.unwatch()

    def acquire(self, entry: Entry) -> None:
        """Count ``entry`` in (``entry.dtensor``), installing the adapter for the first; where DTensor is not in
        use, it waits for DTensor's RNG module to be imported.

        The module is imported, or an import under way on another thread waited for, before the lock is taken:
        that import routes the waiting entries under the lock, and this one would wait for it holding the lock."""
        me = threading.current_thread()
        for _ in range(2):  # again where another thread imported DTensor between the look and the lock
            random_mod = _dtensor_random_module()
            if random_mod is not None:
                adapter_class()  # made (imports included) before the lock is taken
            with self.lock:
                if random_mod is not None:
                    self._forget_ended()  # (waiting entries of ended threads go when DTensor routes, or here)
                    self._count_in(me, random_mod)
                    entry.dtensor = True
                    return
                if _DTENSOR_RANDOM not in sys.modules and torch.distributed.is_available():
                    self.waiting[entry] = me
                    _ROUTE_ON_IMPORT.watch()
                    return

    def _count_in(self, thread: threading.Thread, random_mod: Any) -> None:
        if not self.users and not _is_hyperrng_adapter(random_mod._rng_tracker):
            if self.tracker is None:
                self.tracker = ShardedRNGTracker()
            previous = self.tracker.install_dtensor()
            self.installed, self.previous = random_mod._rng_tracker, previous
        self.users[thread] = self.users.get(thread, 0) + 1

    def route_waiting(self, random_mod: Any) -> None:
        """DTensor's RNG module was just imported: the entries waiting for it route from now on."""
        with self.lock:
            self._forget_ended()
            waiting, self.waiting = self.waiting, {}
            for entry, thread in waiting.items():
                self._count_in(thread, random_mod)
                entry.dtensor = True

    def release(self, entry: Entry) -> None:
        """Count ``entry`` out; the last puts back the tracker the first replaced (unless someone replaced ours)."""
        me = threading.current_thread()
        with self.lock:
            if self.waiting.pop(entry, None) is not None or not entry.dtensor:
                if not self.waiting:
                    _ROUTE_ON_IMPORT.unwatch()
                return
            entry.dtensor = False
            left = self.users.pop(me, 1) - 1
            if left:
                self.users[me] = left
            self._forget_ended()
            if self.users or self.installed is None:
                return
            random_mod = _dtensor_random_module()
            if random_mod is not None and random_mod._rng_tracker is self.installed:
                ShardedRNGTracker.uninstall_dtensor(self.previous)
            self.installed = self.previous = None


class _RouteOnImport(importlib.abc.MetaPathFinder):
    """On ``sys.meta_path`` while an entry waits for DTensor (:class:`_DTensorRouting`): the loader it finds for
    DTensor's RNG module routes the waiting entries once that module has run, before its first random op."""

    def watch(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def unwatch(self) -> None:
        if self in sys.meta_path:  # asked first: every exit of an entry that waited comes here
            sys.meta_path.remove(self)

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _DTENSOR_RANDOM:
            return None
        self.unwatch()  # once: the module is imported now (again if its import fails)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RoutingLoader(spec.loader)
        return spec


class _RoutingLoader(importlib.abc.Loader):
    """A module's loader that routes the waiting entries once the module has run; the rest is the loader's."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        try:
            self.loader.exec_module(module)
        except BaseException:
            if _DTENSOR.waiting:  # a later import routes them
                _ROUTE_ON_IMPORT.watch()
            raise
        if hasattr(module, "_rng_tracker"):  # a torch with DTensor's RNG hook
            _DTENSOR.route_waiting(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ...: the loader's own
        return getattr(self.loader, name)


_DTENSOR_RANDOM = "torch.distributed.tensor._random"
_ROUTE_ON_IMPORT = _RouteOnImport()


def _dtensor_random_module() -> Any:
    """DTensor's RNG module when DTensor is in use (imported, or a process group is up), else ``None``."""
    loaded = sys.modules.get(_DTENSOR_RANDOM)  # every outermost entry asks: no call beyond this
    if loaded is not None:
        if getattr(loaded.__spec__, "_initializing", False):  # being imported: waits for that import to end
            loaded = importlib.import_module(_DTENSOR_RANDOM)
        return loaded if hasattr(loaded, "_rng_tracker") else None
    dist = torch.distributed
    if "torch.distributed.tensor" not in sys.modules and not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dtensor_random_module()
    except InvalidArgumentError:  # a torch without DTensor's RNG hook: nothing to route
        return None


def _is_hyperrng_adapter(tracker: object) -> bool:
    kind = type(tracker)
    return kind.__module__ == ShardedRNGTracker.__module__ and kind.__name__ == "HyperRNGDTensorTracker"


_DTENSOR = _DTensorRouting()
_SWITCH = object()  # the owner that stands for set_portable_random(True)


class _CtrlC:
    """Ctrl-C while the main thread is in portable mode: raised as usual, except while that thread
    enters or leaves the mode, where it waits until the step is done.

    Only the main thread receives SIGINT. Its first entry puts this handler in place of a
    Python one (the default raises KeyboardInterrupt) and its last exit puts that back. The
    handler looks at the frames it interrupts: inside entering or leaving (from their first
    instruction on) it records the interrupt, which the step raises once done, so an
    interrupt finds the mode and the generator as before the entry or as after the exit.

    Entering and leaving thus run with SIGINT deferred (on the main thread, the one that
    receives it): a KeyboardInterrupt finds the mode and the generator as before the entry or
    as after the exit, never in between. Only SIGINT: an exception raised by the Python
    handler of another signal (a SIGTERM handler raising ``SystemExit``, an alarm) while the
    mode is entered or left can leave the flag, the hold or the generator half changed; such
    handlers should set a flag that the training loop reads instead.
    """

    def __init__(self) -> None:
        self.previous: Any = None  # the handler replaced, while this one is in place
        self.users = 0
        self.pending: Any = None  # the frame a recorded interrupt arrived in

    def install(self) -> bool:
        """Count the main thread's entry in, putting the handler in place for the first; ``False`` elsewhere."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if not self.users:
            handler = _signal.getsignal(signal.SIGINT)
            if not callable(handler):  # ignored, the C default, or a handler set outside Python
                return False
            _signal.signal(signal.SIGINT, self._handle)
            self.previous = handler
        self.users += 1
        return True

    def uninstall(self) -> None:
        self.users -= 1
        if not self.users:
            previous, self.previous = self.previous, None
            if _signal.getsignal(signal.SIGINT) == self._handle:  # unless the program set its own meanwhile
                _signal.signal(signal.SIGINT, previous)

    def _handle(self, signum: int, frame: Any) -> None:
        f = frame
        while f is not None:
            if f.f_code in _STEPS:
                self.pending = frame
                return
            f = f.f_back
        (self.previous or signal.default_int_handler)(signum, frame)

    def raise_pending(self) -> None:
        """Raise the recorded interrupt (through the handler it would have reached)."""
        frame, self.pending = self.pending, None
        (self.previous or signal.default_int_handler)(signal.SIGINT, frame)


_CTRL_C = _CtrlC()


class _SeededBlock:
    """The context a ``portable_random(seed)`` block's hold names (see :mod:`hyperrng._guard.exclusive`).

    Such a block saves the device generator and moves it to (seed, 0) until its exit puts it back, as
    ``fork_rng`` swaps it, so inside it the generator holds the block's stream, not the run's state: what
    reads or replaces that state as the run's (``hyperrng.rng_state_dict``, ``load_rng_state_dict``)
    refuses there (:func:`~hyperrng._guard.exclusive.refuse_inside_contexts`), and an outer context's
    exit that finds the block left open by an interrupt leaves it first
    (:func:`~hyperrng._guard.exclusive.leave_inner`). Portable mode without a seed and its switch put
    nothing back: they draw from the run's generator and hold the device with no context.
    """

    __slots__ = ("entry", "seed")

    def __init__(self, entry: Entry, seed: int) -> None:
        self.entry, self.seed = entry, seed

    def describe(self) -> str:
        return f"`with portable_random({self.seed})` block"

    def _unwind(self) -> None:
        if self.entry in THREAD.entries:
            _leave(self.entry)


def _enter(owner: object, p: platforms.Platform, seed: int | None, compiled: bool, what: str) -> Entry:
    """Put this thread in portable mode: hold the device, save, route DTensor, position; then the flag.

    Validates first; on any exception undoes what it did, so the thread, the generator and
    the DTensor tracker are as before.
    """
    entry = Entry(owner, compiled, None)
    entry.ctrl_c = _CTRL_C.install()  # first: from here on an interrupt waits for the step
    try:
        register()
        device = (p.device_type, p.current_device())
        # A seeded block puts the generator back on exit: its hold names it (not the switch's, which keeps it).
        block = _SeededBlock(entry, seed) if seed is not None and owner is not _SWITCH else None
        _exclusive.hold_key(device, threading.current_thread(), what, block)
        entry.device = device
        if seed is not None:
            io = p._state_io()  # exact snapshots, restored without the checks of set_rng_state
            entry.saved = (io.write, io.read())
        _DTENSOR.acquire(entry)
        if seed is not None:
            p._move(seed, 0, False)
    except BaseException:
        _undo(entry)
        raise
    push(entry, outermost=owner is _SWITCH)  # the switch is the outermost entry: contexts entered before it keep theirs
    return entry


def _leave(entry: Entry) -> None:
    """Take ``entry`` out of this thread's mode, then undo what it did (every step, whatever raises)."""
    pop(entry)
    _undo(entry)


def _undo(entry: Entry) -> None:
    """Undo what entering did, in reverse order, every step whatever an earlier one raises."""
    steps = (_restore_generator, _release_dtensor, _release_device, _release_ctrl_c)
    failure: BaseException | None = None
    for step in steps:  # the Ctrl-C handler last: an interrupt after it finds every step done
        try:
            step(entry)
        except BaseException as exc:  # noqa: BLE001 - the other steps still run; the first failure is raised
            failure = failure or exc
    if failure is not None:
        raise failure


def _restore_generator(entry: Entry) -> None:
    if entry.saved is not None:
        write, snapshot = entry.saved
        write(snapshot)
        entry.saved = None


def _release_dtensor(entry: Entry) -> None:
    _DTENSOR.release(entry)


def _release_device(entry: Entry) -> None:
    if entry.device is not None:
        device, entry.device = entry.device, None
        _exclusive.release(*device)


def _release_ctrl_c(entry: Entry) -> None:
    if entry.ctrl_c:
        entry.ctrl_c = False
        _CTRL_C.uninstall()


def _step_done(entry: Entry | None) -> None:
    """End of entering (``entry``) or leaving (``None``): raise an interrupt that arrived meanwhile,
    after undoing the entry, so the interrupt finds the state as before it."""
    if _CTRL_C.pending is not None and threading.current_thread() is threading.main_thread():
        if entry is not None:
            _leave(entry)
        _CTRL_C.raise_pending()
    if entry is not None and entry.owner is _SWITCH:
        entry.saved = None  # entered: turning the switch off leaves the generator where it is


def _check_optional_seed(seed: object) -> int | None:
    return None if seed is None else check_seed(seed)


class portable_random(EnteredUntraced):  # noqa: N801 - a context manager named like a function, as torch.random.fork_rng
    """Context manager: torch's random ops on this thread draw portable Philox numbers inside.

    Args:
        seed: ``None`` continues from the current generator position (the device
            generator, the active ``tracker.fork`` stream, or a sharded region) and leaves
            it advanced; an int in ``[0, 2**64 - 1]`` starts at (seed, 0) and gives the
            current device generator its previous state back on exit.
        compiled: run the Philox loop through ``torch.compile`` on CPU and CUDA tensors
            (the first call per distribution compiles); bitwise equal to eager except
            :func:`~hyperrng.philox.normal`, within a few ulp.

    Entering holds the current device's generator for this thread (see
    :mod:`hyperrng._guard.exclusive`) until the matching exit, routes DTensor random ops through
    hyperrng's sharded path (see :class:`_DTensorRouting`) and, with a seed, positions the
    generator. It may be nested and re-entered, also from several threads one after
    another; the thread leaves the mode at its outermost exit unless its switch
    (:func:`set_portable_random`) holds it. A Ctrl-C during entry or exit leaves the
    mode and the generator as before the entry or as after the exit (see :class:`_CtrlC`).

    * **One global sequence.** Each op takes the (key, offset) position of the current
      generator, computes element ``i`` of its result from global index ``offset + i``, and
      moves the position by its element count rounded up to a multiple of 4 (whole Philox
      blocks), as CUDA's generator does. The numbers depend on the position and the shape
      only: the same on the CPU, CUDA, an NPU or the simulated device (uniform, bernoulli,
      dropout masks, randint bit for bit; normal within a few ulp, see
      :func:`hyperrng.philox.normal`).
    * **Positions.** With a ``seed`` the context starts at (seed, 0) and gives the generator
      its previous state back on exit. Without one it continues from where the generator
      is and leaves it advanced: the current device generator of the platform, which is
      the stream inside ``tracker.fork(name)``, or the generator passed as ``generator=``.
      The position is the platform's, whatever device a tensor is on. An explicit
      ``generator=`` is honoured where it is one of the platform's counter-based
      generators (CUDA, NPU). A CPU ``torch.Generator`` of the caller's own (not torch's
      default one on the ``cpu`` platform, which holds that platform's positions) draws
      torch's own numbers from it: computed on the host from that generator alone, they are
      the same on every machine. A shuffling ``DataLoader`` works that way: its sampler
      seeds a generator of its own with a portable draw and takes its order from it.
    * **Sharded tensors.** Inside a sharded region (a random op on a DTensor with the
      adapter of :meth:`hyperrng.ShardedRNGTracker.install_dtensor`, or
      :meth:`~hyperrng.ShardedRNGTracker.distribute_region`) an op fills this rank's shard
      from the *global* indices of its elements at the region's base position, and the
      region moves every rank to base + the global count rounded up to 4 (the advance of
      the unsharded op, not the padded shard layout of non-portable sharded draws): no
      collective, replicas equal, the shards put together are the tensor an unsharded
      process draws, and the next op starts where it would in an unsharded process.
    * **No silent fallback.** A random op with no portable kernel (``multinomial``,
      ``exponential_``, ``poisson``, ... see :func:`unsupported_ops`) raises
      :class:`UnsupportedPortableOpError` naming it. Ops that are random only for some arguments
      (attention and RNN kernels with ``dropout_p``/``dropout``, ``rrelu`` with ``training``) run
      torch's kernel when those make them deterministic.

    **Per thread.** Whether a random op draws portably is a flag of the calling thread: on
    while one of its contexts is entered or its switch (:func:`set_portable_random`) is on.
    Random ops on other threads keep torch's own kernels and numbers. Entering also holds
    the current device's generator for the thread (:mod:`hyperrng._guard.exclusive`), so a second
    thread that enters portable mode meanwhile, or anything that holds that generator by the
    same policy, is refused with :class:`~hyperrng.errors.InvalidOperationError`, nothing changed.
    A plain draw on another thread is not intercepted: a draw from the same device generator
    (``torch.rand`` without ``generator=``) moves the position the portable thread draws from.
    Work that torch runs on its own threads does not inherit the flag: on accelerators
    autograd runs the backward pass on per-device threads. A recompute in backward (activation
    checkpointing) therefore draws portably only where it re-applies the flag its forward pass
    ran with (:func:`thread_mode` and :class:`mode_applied` are for that), which is also what it
    needs on the CPU when ``backward()`` runs after the context has exited;
    ``torch.utils.checkpoint`` does so with ``context_fn=hyperrng.checkpoint_context``, and draws
    torch's own numbers then without it.

    **DataLoader.** Iterating a ``torch.utils.data.DataLoader`` in the mode draws its base seed
    portably (``random_()`` over the whole ``int64`` range), so its workers' seeds are the same in
    every run. A shuffling loader orders its samples with ``randperm`` and a CPU ``torch.Generator``
    of its own, seeded by another portable ``random_()``: that generator draws torch's numbers (see
    *Positions*), so the order too repeats with the mode's seed, on every machine.

    **Attention.** ``F.scaled_dot_product_attention`` with dropout draws the portable dropout
    mask of its global ``[*batch, heads, L, S]`` probabilities
    (:mod:`hyperrng.philox.attention`, wired in :mod:`hyperrng.portable._attention`); without
    dropout torch's own kernels run.

    **Dropout.** ``F.dropout`` keeps element ``i`` where its word is below
    ``round((1 - p) * 2**32)``, the convention of every portable dropout (see
    :mod:`hyperrng.philox`): :func:`hyperrng.philox.dropout` at the same position gives the
    same bits.

    Raises:
        ArgumentTypeError: ``seed`` is not an int or ``compiled`` not a bool.
        InvalidArgumentError: ``seed`` is outside ``[0, 2**64 - 1]``.
        UnsupportedPortableOpError (on entry): torch is older than 2.9, or the platform's
            device type has no portable kernels. Nothing changed.
        InvalidOperationError (on entry): another thread holds the device's generator (in
            portable mode, a fork, a region, ...). Nothing changed.
    """

    def __init__(self, seed: int | None = None, *, compiled: bool = False) -> None:
        self._seed = _check_optional_seed(seed)
        self._compiled = check_instance(compiled, bool, "compiled")

    def __enter__(self) -> None:
        if torch.compiler.is_dynamo_compiling():  # the mode's state is Python: entered behind a graph break
            return self._enter_outside_the_graph()
        _step_done(_enter(self, platforms.current(), self._seed, self._compiled, "portable_random"))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if torch.compiler.is_dynamo_compiling():
            return self._exit_outside_the_graph(exc_type, exc, tb)
        for entry in reversed(THREAD.entries):
            if entry.owner is self:
                _leave(entry)
                break
        _step_done(None)


def set_portable_random(enabled: bool, seed: int | None = None, *, compiled: bool = False) -> None:
    """Turn portable mode on or off for the calling thread, outside any ``with`` block.

    Args:
        enabled: ``True`` turns it on (again: only ``seed`` and ``compiled`` apply),
            ``False`` off; contexts entered meanwhile keep it on until they exit.
        seed: with ``enabled``, put the current device generator at (seed, 0) (it is not
            restored when the mode is turned off); ``None`` continues from where it is.
        compiled: as for :class:`portable_random`.

    While on, the thread holds the device's generator, as a context does (until
    ``set_portable_random(False)`` on the same thread).

    Raises:
        ArgumentTypeError: ``enabled`` or ``compiled`` is not a bool, ``seed`` not an int.
        InvalidArgumentError: ``seed`` is outside ``[0, 2**64 - 1]``;
            or a ``seed`` with ``enabled=False``.
        UnsupportedPortableOpError / InvalidOperationError: as on entering :class:`portable_random`.
    """
    on = check_instance(enabled, bool, "enabled")
    value = _check_optional_seed(seed)
    use_compiled = check_instance(compiled, bool, "compiled")
    if not on and value is not None:
        raise InvalidArgumentError("a seed positions the generator for portable draws; pass it with enabled=True.")
    switch = next((e for e in THREAD.entries if e.owner is _SWITCH), None)
    if not on:
        if switch is not None:
            _leave(switch)
        _step_done(None)
    elif switch is None:
        _step_done(_enter(_SWITCH, platforms.current(), value, use_compiled, "set_portable_random"))
    else:
        switch.compiled = use_compiled
        if value is not None:
            platforms.current().set_seed_offset(value, 0)


# The code of entering and leaving: the Ctrl-C handler defers an interrupt that arrives in it.
_STEPS = frozenset(
    {portable_random.__enter__.__code__, portable_random.__exit__.__code__, set_portable_random.__code__}
)


def is_portable_random_enabled() -> bool:
    """Whether torch's random ops on the calling thread draw portable numbers now (a context of this
    thread is entered or its switch is on)."""
    return bool(THREAD.entries)


def thread_mode() -> bool | None:
    """This thread's portable mode for :func:`mode_applied` on another thread: ``None`` when off,
    else whether its draws are compiled."""
    entries = THREAD.entries
    return entries[-1].compiled if entries else None


class mode_applied:  # noqa: N801 - a context manager named like a function
    """Draw on this thread as the thread that took ``mode`` (:func:`thread_mode`) did: portably, or with
    ``None`` outside the mode.

    For work that another thread, or the same one later, runs on behalf of the one that took it: a
    recompute in the backward pass (``hyperrng.checkpoint``) must draw as its forward pass did, on
    autograd's device threads too, and in whatever mode ``backward()`` is called. It holds nothing and
    moves no generator: the thread that took ``mode`` holds the device and waits for the work. ``None``
    takes this thread out of the mode until the exit (a context entered inside draws portably as usual).
    """

    __slots__ = ("_mode", "_entry", "_hidden")

    def __init__(self, mode: bool | None) -> None:
        self._mode = mode
        self._entry: Entry | None = None
        self._hidden: tuple[list[Entry], bool, bool] | None = None  # the thread's entries, inherited, switched on

    def __enter__(self) -> None:
        if self._mode is not None:
            register()  # entered on this thread's behalf by one that was in the mode: registered already
            entry = self._entry = Entry(self, self._mode, None)  # recorded first: the undo below finds it
            try:
                _DTENSOR.acquire(entry)  # the mode may have been left since: DTensor draws route again
                push(entry)
            except BaseException:  # an interrupt (or a failed DTensor import): DTensor's count as before
                self._entry = None
                _leave(entry)
                raise
        elif THREAD.entries or is_switched_on():
            self._hidden = (THREAD.entries, THREAD.inherited, is_switched_on())
            THREAD.entries = []
            switch(False)

    def __exit__(self, *exc: object) -> None:
        if self._entry is not None:
            entry, self._entry = self._entry, None
            _leave(entry)
        elif self._hidden is not None:
            (THREAD.entries, THREAD.inherited, on), self._hidden = self._hidden, None
            switch(on)
