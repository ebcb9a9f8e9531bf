"""Conformance suite for :class:`platforms.Platform` implementations.

A platform author runs it against their implementation, with pytest::

    import pytest
    from hyperrng.platforms.testing import PlatformConformance

    class TestMyPlatform(PlatformConformance):
        @pytest.fixture
        def platform(self):
            return MyPlatform()

or without pytest: ``hyperrng.platforms.testing.check_platform(MyPlatform())`` raises
``AssertionError`` naming the first check that fails.

The checks cover the interface in :class:`~hyperrng.platforms.Platform`'s docstring, row
by row, with the call-only methods built on it and the private fast paths
(``_state_io``, which forks use, and ``_position`` / ``_move``, which sharded regions
use), and nothing else: the values describe the platform, the device functions enumerate
and switch devices, the state functions read, write, check, seed and position each
device (refusing bad input with nothing changed), the default generator is the one in
use, and the state is what the device's random ops draw from. A platform that does not
implement the methods every platform must (``device_count``, ``_read_state``,
``_write_state``) fails every check with an ``AssertionError`` that names them. Every
check leaves the RNG state of every device, and the current device, as it found them:
:func:`check_platform` reads them before each check and puts them back after it, and a
platform on which that fails (an unusable device, a ``_read_state`` or ``_write_state``
that raises) fails the check ``reads_and_restores_its_state``, with the error it met.
Our CPU, CUDA, NPU and simulated platforms pass it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from hyperrng.platforms.base import COUNTER_STATE_NBYTES, Platform, StateIO, unpack_counter_state
from hyperrng.platforms.device_module import DeviceModulePlatform
from hyperrng.platforms.errors import ArgumentTypeError, HyperRNGError, InvalidArgumentError
from hyperrng.platforms.registry import unimplemented_methods

__all__ = ["CHECKS", "check_platform"]

Check = Callable[[Platform], None]
CHECKS: dict[str, Check] = {}


def _check(fn: Check) -> Check:
    CHECKS[fn.__name__] = fn
    return fn


def _states(p: Platform) -> list[torch.Tensor]:
    return [p.get_rng_state(i) for i in range(p.device_count())]


def _assert_unchanged(p: Platform, before: list[torch.Tensor], what: str) -> None:
    after = _states(p)
    for i, (a, b) in enumerate(zip(before, after)):
        assert torch.equal(a, b), f"{what} changed the RNG state of device {i}"


def _assert_refused(p: Platform, call: Callable[[], object], error: type[Exception], what: str) -> None:
    """``call()`` must raise ``error`` (a :class:`HyperRNGError` with a message), changing no state and
    not the current device."""
    before, home = _states(p), p.current_device()
    try:
        call()
    except error as exc:
        assert isinstance(exc, HyperRNGError), f"{what}: {type(exc).__name__} is not a HyperRNGError"
        assert str(exc), f"{what}: the error has no message"
    else:
        raise AssertionError(f"{what} was accepted; expected {error.__name__}")
    _assert_unchanged(p, before, what)
    assert p.current_device() == home, f"the refused {what} changed the current device"


_WRONG_TYPES: list[Any] = [True, 1.5, 4.0, "3", None]  # never ints, never truncated


def _refusals(invalid: list[Any], wrong_types: list[Any] = _WRONG_TYPES) -> list[tuple[Any, type[Exception]]]:
    """Bad arguments with the error each must raise: :class:`InvalidArgumentError` for ``invalid`` values,
    :class:`ArgumentTypeError` for ``wrong_types``."""
    return [(v, InvalidArgumentError) for v in invalid] + [(t, ArgumentTypeError) for t in wrong_types]


@_check
def implements_the_required_methods(p: Platform) -> None:
    # Runs first: every other check calls them, and would otherwise stop at the base
    # class's NotImplementedError instead of saying what is missing.
    missing = unimplemented_methods(p)
    assert not missing, (
        f"{type(p).__qualname__} does not implement {', '.join(missing)}; every platforms.Platform subclass "
        "must (the base class only raises NotImplementedError): implement them, or subclass "
        "platforms.DeviceModulePlatform when the device has a torch device module."
    )


@_check
def state_is_a_cpu_byte_copy(p: Platform) -> None:
    # Runs second: every check after it reads states, and a state of another type would stop them
    # at an unrelated line.
    state = p.get_rng_state()
    assert isinstance(state, torch.Tensor), (
        f"get_rng_state() returned a {type(state).__name__}, not a tensor: _read_state must return the device's "
        "state as a 1-D CPU uint8 tensor"
    )
    assert state.dtype == torch.uint8 and state.device.type == "cpu" and state.dim() == 1
    assert state.numel() == p._state_nbytes, f"state has {state.numel()} bytes, _state_nbytes says {p._state_nbytes}"
    p.manual_seed(3)  # a state with non-zero bytes, so zeroing the copy is visible
    state = p.get_rng_state()
    expected = state.clone()
    state.zero_()
    assert torch.equal(p.get_rng_state(), expected), "get_rng_state() must return a copy, not the live state"


@_check
def reads_and_restores_its_state(p: Platform) -> None:
    # check_platform reads every device's state and the current device before each check, and puts them
    # back after it; a failure there is reported under this name, not that of the check it surrounds.
    before, home = _states(p), p.current_device()
    with _restored(p, "reseeding every device"):
        for i in range(p.device_count()):
            p.manual_seed(9000 + i, i)
    _assert_unchanged(p, before, "reseeding every device, then writing back the states read before,")
    assert p.current_device() == home, f"restoring the states left device {p.current_device()} current, not {home}"


@_check
def describes_itself(p: Platform) -> None:
    assert isinstance(p.name, str) and p.name, "name must be a non-empty string"
    torch.device(p.device_type)  # a valid torch device type
    assert isinstance(p.dist_backend, str) and p.dist_backend, "dist_backend must name a backend"
    assert isinstance(p.counter_based, bool)
    assert isinstance(p._state_nbytes, int) and p._state_nbytes > 0
    if p.counter_based:
        assert p._state_nbytes == COUNTER_STATE_NBYTES, (
            f"a counter-based state is the {COUNTER_STATE_NBYTES}-byte (seed, offset) pair, _state_nbytes says "
            f"{p._state_nbytes}"
        )


@_check
def probe_finds_it_available(p: Platform) -> None:
    assert p.probe() is None, f"probe() says unavailable: {p.probe()}"


@_check
def enumerates_devices(p: Platform) -> None:
    n = p.device_count()
    assert isinstance(n, int) and n >= 1, "device_count() must be a positive int"
    assert 0 <= p.current_device() < n
    for i in range(n):
        d = p.device(i)
        assert isinstance(d, torch.device) and d.type == p.device_type


@_check
def switches_the_current_device(p: Platform) -> None:
    n, home = p.device_count(), p.current_device()
    for i in [*range(n), home]:  # a platform with one device accepts set_device(0)
        p.set_device(i)
        assert p.current_device() == i, f"set_device({i}) left device {p.current_device()} current"
        assert p.device() == p.device(i), f"device() is not device({i}) while device {i} is current"
    for index, error in _refusals([n, -1], [True, 1.0]):
        _assert_refused(p, functools.partial(p.set_device, index), error, f"set_device({index!r})")


@_check
def set_restores_get(p: Platform) -> None:
    saved = p.get_rng_state()
    p.manual_seed(1234)
    p.set_rng_state(saved)
    assert torch.equal(p.get_rng_state(), saved), "set_rng_state(get_rng_state()) is not a round trip"


@_check
def manual_seed_is_deterministic(p: Platform) -> None:
    p.manual_seed(7)
    a = p.get_rng_state()
    p.manual_seed(8)
    b = p.get_rng_state()
    p.manual_seed(7)
    assert torch.equal(p.get_rng_state(), a), "manual_seed(7) twice gave different states"
    assert not torch.equal(a, b), "manual_seed(7) and manual_seed(8) gave the same state"
    p.manual_seed(2**64 - 1)  # the whole unsigned 64-bit range is accepted


@_check
def seed_offset_round_trips(p: Platform) -> None:
    for seed, offset in [(11, 0), (11, 8), (2**64 - 1, 4), (0, 2**40)]:
        p.set_seed_offset(seed, offset)
        assert p.get_seed_offset() == (seed, offset), f"set_seed_offset({seed}, {offset}) did not round-trip"
    p.set_seed_offset(99, 0)
    at_zero = p.get_rng_state()
    p.manual_seed(99)
    assert torch.equal(p.get_rng_state(), at_zero), "offset 0 must be the state manual_seed gives"
    p.set_seed_offset(99, 4)
    assert not torch.equal(p.get_rng_state(), at_zero), "different offsets must give different states"
    for seed, offset, draw in [(11, 8, False), (11, 8, True), (2**64 - 1, 4, True)]:  # regions' fast path
        p.set_seed_offset(seed, offset, draw=draw)
        expected = p.get_rng_state()
        p.manual_seed(3)
        p._move(seed, offset, draw)
        assert torch.equal(p.get_rng_state(), expected), f"_move({seed}, {offset}, {draw}) differs from set_seed_offset"
        assert p._position() == (seed, offset), f"_position() after _move({seed}, {offset}, {draw}) differs"
        gen = p._position_generator()  # portable draws read and move the position through it where there is one
        if gen is not None:
            read = (gen.initial_seed(), gen.get_offset())
            assert read == (seed, offset), "_position_generator() reads another position"
            gen.set_offset(offset + 4)
            assert p._position() == (seed, offset + 4), "_position_generator().set_offset() moves another position"


@_check
def positions_a_passed_generator(p: Platform) -> None:
    gen = p.default_generator()
    if gen is None:
        return
    p.set_seed_offset(21, 12, generator=gen)
    assert p.get_seed_offset() == (21, 12), "positioning the default generator must position the device"
    assert p.get_seed_offset(generator=gen) == (21, 12)
    if p.device_type != "cpu":
        foreign = torch.Generator()  # a CPU generator cannot stand for this device
        _assert_refused(
            p, lambda: p.set_seed_offset(1, 0, generator=foreign), InvalidArgumentError, "a foreign generator"
        )


@_check
def refuses_bad_states(p: Platform) -> None:
    n = p._state_nbytes
    bad: list[Any] = [  # deliberately wrong dtypes, shapes and devices
        torch.zeros(n, dtype=torch.int64),
        torch.zeros(n + 1, dtype=torch.uint8),
        torch.zeros(1, n, dtype=torch.uint8),
        torch.empty(n, dtype=torch.uint8, device="meta"),
    ]
    for state, error in _refusals(bad, [bytes(n), list(range(n)), None]):
        for name in ("check_rng_state", "set_rng_state"):  # what check_rng_state refuses, set_rng_state does
            call = functools.partial(getattr(p, name), state)
            _assert_refused(p, call, error, f"{name}({state!r:.40})")
    # check_rng_state hands back what set_rng_state then applies; a valid state that is
    # not contiguous is still a valid state.
    state = p.get_rng_state()
    strided = torch.stack([state, state], dim=1)[:, 0]
    assert not strided.is_contiguous()
    before = _states(p)
    checked = p.check_rng_state(strided)
    assert isinstance(checked, torch.Tensor) and torch.equal(checked, state), "check_rng_state changed a valid state"
    _assert_unchanged(p, before, "check_rng_state")
    p.manual_seed(1)
    p.set_rng_state(strided)
    assert torch.equal(p.get_rng_state(), state), "a non-contiguous copy of a valid state was not restored"


@_check
def refuses_bad_seeds(p: Platform) -> None:
    for seed, error in _refusals([-1, 2**64]):
        _assert_refused(p, functools.partial(p.manual_seed, seed), error, f"manual_seed({seed!r})")
        _assert_refused(p, functools.partial(p.set_seed_offset, seed, 0), error, f"set_seed_offset({seed!r}, 0)")
    assert issubclass(InvalidArgumentError, ValueError) and issubclass(ArgumentTypeError, TypeError)


@_check
def refuses_bad_offsets(p: Platform) -> None:
    for offset, error in _refusals([-4, 6, 2**63]):
        _assert_refused(p, functools.partial(p.set_seed_offset, 1, offset), error, f"set_seed_offset(1, {offset!r})")


@_check
def refuses_bad_device_indices(p: Platform) -> None:
    for index, error in _refusals([p.device_count(), -1], [t for t in _WRONG_TYPES if t is not None]):
        _assert_refused(p, functools.partial(p.manual_seed, 1, index), error, f"manual_seed(1, index={index!r})")
        _assert_refused(p, functools.partial(p.get_rng_state, index), error, f"get_rng_state({index!r})")


@_check
def devices_are_independent(p: Platform) -> None:
    if p.device_count() < 2:
        return
    before = p.get_rng_state(0)
    p.manual_seed(5, 1)
    assert torch.equal(p.get_rng_state(0), before), "seeding device 1 changed device 0"


@_check
def each_device_is_addressed_by_its_index(p: Platform) -> None:
    # What is set on device i must be read back from device i, whatever was set on the
    # others since: a platform that always touches one device fails here.
    n = p.device_count()
    seeded = []
    for i in range(n):
        p.manual_seed(1000 + i, i)
        seeded.append(p.get_rng_state(i))
    for i in reversed(range(n)):
        p.manual_seed(2000 + i, i)
    for i in range(n):
        p.set_rng_state(seeded[i], i)
    for i in range(n):
        assert torch.equal(p.get_rng_state(i), seeded[i]), f"device {i} does not hold the state set on it"
    assert n < 2 or not torch.equal(seeded[0], seeded[1]), "two devices seeded differently report one state"
    for i in range(n):
        p.set_seed_offset(3000 + i, 4 * (i + 1), i)
    for i in range(n):
        assert p.get_seed_offset(i) == (3000 + i, 4 * (i + 1)), f"device {i} lost its position"
        gen = p.default_generator(i)
        if gen is not None:
            assert p.get_seed_offset(generator=gen) == (3000 + i, 4 * (i + 1)), (
                f"default_generator({i}) is not device {i}'s generator"
            )


@_check
def exposes_the_generator_in_use(p: Platform) -> None:
    gen = p.default_generator()  # None is allowed: callers then copy state bytes
    if gen is None:
        return
    if p.counter_based:  # the generator's state is the whole (seed, offset) state
        assert torch.equal(gen.get_state(), p.get_rng_state()), "default_generator() is not the generator in use"
    p.manual_seed(11)
    seeded = gen.get_state()
    p.manual_seed(12)
    assert not torch.equal(gen.get_state(), seeded), "seeding the platform did not reach default_generator()"
    before = p.get_rng_state()
    gen.manual_seed(13)
    assert not torch.equal(p.get_rng_state(), before), "seeding default_generator() did not reach the platform"


@_check
def is_not_capturing_outside_a_graph(p: Platform) -> None:
    capturing = p.is_capturing()
    assert capturing is False, f"is_capturing() returned {capturing!r} while nothing captures a graph; return False"


def _holder(p: Platform, packed: torch.Tensor) -> str:
    """Which device holds the state ``packed`` (for messages): ``"device j"`` or ``"no device"``."""
    holders = [f"device {j}" for j, state in enumerate(_states(p)) if torch.equal(state, packed)]
    return " and ".join(holders) or "no device"


def _exercise_state_io(p: Platform, io: StateIO, i: int, what: str) -> None:
    """Check that ``io`` (from ``_state_io(i)``) reads, writes, packs and unpacks device ``i`` only."""
    n = p.device_count()
    for j in range(n):  # a different state on every device, so a read of the wrong one shows
        p.manual_seed(4000 + j, j)
    expected = _states(p)
    snapshot = io.read()
    packed = io.pack(snapshot)
    assert torch.equal(packed, expected[i]), (
        f"{what}: read() returned the state of {_holder(p, packed)}, not device {i}'s; _state_io(index) must act "
        "on device index whatever device is current, when it is called and when its functions are"
    )
    p.manual_seed(5000 + i, i)  # move device i on, then put the snapshot back
    assert torch.equal(io.pack(snapshot), expected[i]), (
        f"{what}: the snapshot read() returned changed when device {i} was reseeded; read() must return a copy"
    )
    restore_missed = f"{what}: write(read()) did not restore device {i}'s state ({{holder}} holds it now)"
    _assert_writes_only(p, i, lambda: io.write(snapshot), expected[i], what, restore_missed)

    p.manual_seed(6000 + i, i)
    state = p.get_rng_state(i)
    original = state.clone()
    unpacked = io.unpack(state)
    state.zero_()  # unpack keeps no reference to the tensor it is given
    packed = io.pack(unpacked)
    assert torch.equal(packed, original), f"{what}: pack(unpack(state)) is not state"
    packed.zero_()  # pack returns a tensor the caller may keep and modify
    assert torch.equal(io.pack(unpacked), original), f"{what}: pack() returned the snapshot's own bytes, not a copy"
    set_missed = f"{what}: write(unpack(state)) did not set device {i} to state"
    _assert_writes_only(p, i, lambda: io.write(io.unpack(expected[i])), expected[i], what, set_missed)


def _assert_writes_only(
    p: Platform, i: int, write: Callable[[], object], state: torch.Tensor, what: str, missed: str
) -> None:
    """``write()`` must leave device ``i`` holding ``state`` (else ``missed``, where ``{holder}`` names
    the device that holds it) and every other device as it was."""
    before = _states(p)
    write()
    after = _states(p)
    assert torch.equal(after[i], state), missed.format(holder=_holder(p, state))
    for j in range(len(after)):
        assert j == i or torch.equal(after[j], before[j]), f"{what}: write() changed device {j}, not only device {i}"


@_check
def state_io_addresses_each_device(p: Platform) -> None:
    # The fast path of tracker forks: _state_io(i) must read and write device i, and only
    # device i, whichever device was current when it was called and whichever is current
    # when its functions run (the tracker keeps the accessors per index). A platform that
    # always touches one device, or the current one, fails here.
    n = p.device_count()
    home = p.current_device()
    currents = list(range(n)) if n > 1 else [home]  # set_device only where there is a choice
    with _restored(p, "the _state_io checks"):  # also when the check runs on its own, outside check_platform
        for made_on in currents:
            if n > 1:
                p.set_device(made_on)
            ios = [p._state_io(i) for i in range(n)]
            current_io = p._state_io()
            packed = current_io.pack(current_io.read())
            assert torch.equal(packed, p.get_rng_state(made_on)), (
                f"_state_io() with device {made_on} current read the state of {_holder(p, packed)}; without an "
                "index it must act on the current device"
            )
            for used_on in currents:
                if n > 1:
                    p.set_device(used_on)
                for i, io in enumerate(ios):
                    what = f"_state_io({i}), made with device {made_on} current and used with device {used_on} current"
                    _exercise_state_io(p, io, i, what)
    assert p.current_device() == home, f"set_device({home}) did not make device {home} current again"


def _draw(p: Platform) -> torch.Tensor:
    """16 uniform numbers drawn by a random op on the current device, as a CPU tensor."""
    return torch.rand(16, device=p.device()).cpu()


def _has_tensors(p: Platform) -> bool:
    """Whether torch's random ops on the platform's device draw from the platform's generators.

    Not where this torch cannot create a tensor on the device (a test double named after a
    device this build lacks), nor where the platform drives another module than the one
    torch registered for its device type (a simulated ``torch.cuda`` stand-in on a machine
    with a GPU: the tensors are real, their generator is not the stand-in's).
    """
    if isinstance(p, DeviceModulePlatform):
        module = p.module  # first: loading it may register it with torch
        if getattr(torch, p.device_type, None) is not module:
            return False
    try:
        torch.empty(0, device=p.device())
    except (RuntimeError, AssertionError):  # torch says "not compiled with ..." in either form
        return False
    return True


@_check
def random_ops_draw_from_the_state(p: Platform) -> None:
    """The state is the device's: random ops on the device draw from it, and only from it.

    A platform that keeps its "state" anywhere else (a dict beside the device) passes the
    byte-level checks but fails here. Where torch's ops on the platform's device do not
    draw from the platform's generators (see :func:`_has_tensors`: a test double), there is
    nothing to draw and the check passes without drawing.
    """
    if not _has_tensors(p):
        return
    p.manual_seed(5)
    state = p.get_rng_state()
    first = _draw(p)
    p.set_rng_state(state)
    assert torch.equal(_draw(p), first), (
        "after set_rng_state(s) a random op on the device drew other numbers than the first time: the state "
        "read and written is not what the device's random ops draw from"
    )
    p.manual_seed(6)
    assert not torch.equal(_draw(p), first), "manual_seed(6) drew the numbers of manual_seed(5)"
    p.set_rng_state(state)
    saved = p.get_rng_state()  # a fork: swap another state in, draw, swap back
    p.manual_seed(99)
    _draw(p)
    p.set_rng_state(saved)
    assert torch.equal(_draw(p), first), "draws made while another state was swapped in moved the restored one"


@_check
def counter_based_states_are_the_position(p: Platform) -> None:
    """``counter_based`` is a promise: the state is the (seed, offset) pair, and draws advance the offset."""
    if not p.counter_based:
        return
    for seed, offset in [(5, 0), (2**64 - 1, 2**40)]:
        p.set_seed_offset(seed, offset)
        state = p.get_rng_state()
        assert unpack_counter_state(state) == (seed, offset), (
            f"counter_based is True but after set_seed_offset({seed}, {offset}) the state holds "
            f"{unpack_counter_state(state)}: the state must be the (uint64 seed, int64 offset) pair"
        )
    if not _has_tensors(p):
        return
    p.set_seed_offset(5, 8)
    _draw(p)
    seed, offset = p.get_seed_offset()
    assert seed == 5 and offset > 8, f"a draw at (5, 8) left the position at {(seed, offset)}; draws advance the offset"


class _NotRestorable(Exception):
    """Reading the states before a check, or writing them back after it, failed (the message says which)."""


@contextlib.contextmanager
def _restored(p: Platform, block: str = "the block") -> Iterator[None]:
    """Run the block (``block`` names it in errors), then put back every device's RNG state and the current device.

    A platform without the required methods, or whose states are not tensors, has no state
    to save; the block then runs as is (a check says what is wrong).

    Raises:
        _NotRestorable: reading the states and the current device before the block, or putting
            them back after it, failed; the message says which, and the error met (chained).
    """
    if unimplemented_methods(p):
        yield
        return
    try:
        n = p.device_count()
        if isinstance(n, int) and not isinstance(n, bool) and n == 0:
            raise _NotRestorable(f"device_count() returned 0 before {block}: {_no_device(p)}")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise _NotRestorable(
                f"device_count() returned {n!r} before {block}, not a positive int: return the number of devices"
            )
        saved = _states(p)
        home = p.current_device()
    except _NotRestorable:
        raise
    except Exception as exc:
        raise _NotRestorable(
            f"reading every device's RNG state and the current device before {block} raised {_named(exc)}"
        ) from exc
    if not all(isinstance(state, torch.Tensor) for state in saved):  # nothing to restore with: a check says why
        yield
        return
    try:
        yield
    finally:
        try:
            if p.current_device() != home:
                p.set_device(home)
            for i, s in enumerate(saved):
                p.set_rng_state(s, i)
        except Exception as exc:
            raise _NotRestorable(
                f"writing back every device's RNG state and the current device after {block} raised {_named(exc)}"
            ) from exc


def _no_device(p: Platform) -> str:
    """Why a platform has no device here, for messages: its probe's reason where it gives one."""
    try:
        reason = p.probe()
    except Exception as exc:
        reason = f"its probe raised {_named(exc)}"
    why = f" (probe() says: {reason})" if isinstance(reason, str) and reason else ""
    return f"there is no device to check{why}; run the kit where the platform is available"


def _named(exc: BaseException) -> str:
    """``Type: message`` (or the type alone where the message is empty)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def check_platform(platform: Platform) -> None:
    """Run every conformance check in :data:`CHECKS` on ``platform``, in order.

    Args:
        platform: the platform to check; it must be available on this machine.

    Raises:
        AssertionError: on the first check that fails, naming the check, the platform and
            what was wrong (a platform missing a required method fails the first check,
            ``implements_the_required_methods``, which names the methods to implement). An
            exception of any other kind that a check meets is turned into this error too,
            naming the check and the exception. Where reading the states before a check, or
            writing them back after it, fails, the check named is ``reads_and_restores_its_state``
            (whichever check it surrounded), with the error met.
    """
    for name in CHECKS:
        _run_check(name, platform, restore=True)


def _run_check(name: str, platform: Platform, restore: bool) -> None:
    """Run check ``name`` (within :func:`_restored` where ``restore``), any failure as an AssertionError naming it."""
    try:
        with _restored(platform, f"check {name!r}") if restore else contextlib.nullcontext():
            CHECKS[name](platform)
    except _NotRestorable as exc:  # the reading or restoring around the check failed, not the check
        raise AssertionError(
            f"conformance check 'reads_and_restores_its_state' failed for {platform!r}: {exc}"
        ) from exc
    except AssertionError as exc:
        raise AssertionError(f"conformance check {name!r} failed for {platform!r}: {exc}") from exc
    except Exception as exc:
        raise AssertionError(
            f"conformance check {name!r} failed for {platform!r}: it raised {type(exc).__name__}: {exc}"
        ) from exc


try:
    import pytest
except ImportError:  # pytest is only needed to use the class below
    pass
else:

    class PlatformConformance:
        """Subclass in a test module and provide a ``platform`` fixture."""

        @pytest.fixture(autouse=True)
        def _restore_states(self, platform: Platform) -> Iterator[None]:
            with _restored(platform, "the test"):
                yield

        @pytest.mark.parametrize("check", list(CHECKS))
        def test_conformance(self, platform: Platform, check: str) -> None:
            implements_the_required_methods(platform)  # else every check stops at a NotImplementedError
            _run_check(check, platform, restore=False)  # the fixture restores

    __all__.append("PlatformConformance")
