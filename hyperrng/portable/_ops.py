"""The aten kernels of portable mode, the dispatch key they live on, and the per-thread flag.

:mod:`hyperrng.portable.mode` is the public face (entering, leaving, the switch); this
module is what it switches: a kernel per random aten op (:data:`PORTABLE_OPS`) that draws
at the current position with :func:`hyperrng.portable.position.draw_at_position`, or inside a
sharded region fills this rank's shard from global indices; a refusal for every other
random op (:func:`unsupported_ops`); and :data:`THREAD`, whose entries say whether the
calling thread draws portably.

**The mechanism, in a paragraph.** The kernels are registered once per process on torch's
``CustomRNGKeyId`` dispatch key (:data:`KEY_NAME`), which sits below autograd and Python
subclasses and modes, just above the device keys (``CPU``, ``CUDA``, ``PrivateUse1``...),
and which no tensor carries. A thread in portable mode includes the key in its thread-local
dispatch state (:func:`switch`), so its random ops reach the kernels whatever the device;
every other op falls through the key at no cost, and other threads never see it. Outside
the mode nothing of this is on any path: a random op runs exactly torch's kernel, at
torch's cost. Entering and leaving flip one thread-local bit and never touch the dispatch
table (:func:`register` writes it once, at the first entry). Meta and fake tensors (shape
propagation in ``torch.compile`` and DTensor) pass through to torch's kernels; what compiled code
records for a random op in the mode is :mod:`hyperrng.portable._traced`'s.

Limits: float32/float64/float16/bfloat16 for ``uniform_``/``normal_`` (float64 values
carry 32 random bits), ``random_``/``randint`` ranges of at most ``2**32`` values take one
word each (``low + word % range``), wider ones (up to ``2**62`` values, or ``2**63``: ``random_()``
on ``int64``) two (:func:`_wide_words`), as does ``randperm`` (the order that sorts such values);
positions within the generator's offset range (``2**63 - 1``); errors are typed and raised before
any position moves.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

import hyperrng.platforms as platforms
from hyperrng import philox
from hyperrng.errors import ArgumentTypeError, HyperRNGError, InvalidArgumentError, UnsupportedPortableOpError
from hyperrng.philox import _torch, _triton, backends
from hyperrng.philox._shards import ShardGeometry
from hyperrng.platforms import _features
from hyperrng.platforms._features import outside_dynamo
from hyperrng.platforms.validate import MAX_OFFSET, round_up_offset
from hyperrng.portable import _attention as _attention_ops
from hyperrng.portable.position import assemble_blocks, draw_at_position, shard_slices
from hyperrng.sharding.tracker import active_region
from hyperrng.streams._checkpoints import checkpoint_forward, unreplayed_checkpoint

__all__ = [
    "HOST_DRAWN",
    "KEY_NAME",
    "PORTABLE_OPS",
    "THREAD",
    "Entry",
    "is_switched_on",
    "pop",
    "push",
    "register",
    "registered",
    "switch",
    "unsupported_ops",
]


# -- the per-thread flag ------------------------------------------------------------------------
class Entry:
    """One entered context (or the switch) on a thread: what its exit undoes.

    :mod:`hyperrng.portable.mode` makes and removes entries; the kernels read only the
    last entry's ``compiled``.
    """

    __slots__ = ("owner", "compiled", "device", "saved", "dtensor", "ctrl_c")

    def __init__(self, owner: object, compiled: bool, device: tuple[str, int] | None) -> None:
        self.owner = owner
        self.compiled = compiled
        self.device = device  # the device whose generator this entry holds, if any
        self.saved: tuple[Callable[[Any], None], Any] | None = None  # (write, snapshot) its exit restores, if any
        self.dtensor = False  # whether it counts as a user of the DTensor routing
        self.ctrl_c = False  # whether it counts as a user of the Ctrl-C handler


class _ThreadEntries(threading.local):
    """This thread's entries, outermost first: the thread draws portably while there is one."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.inherited = False  # whether the thread included the key before its first entry (an autograd thread)


THREAD = _ThreadEntries()
"""The per-thread flag: ``THREAD.entries`` (outermost first) of the calling thread; it draws
portably while there is one."""


def push(entry: Entry, outermost: bool = False) -> None:
    """Add ``entry`` to this thread's mode; the first one includes the key in the thread's dispatch.

    Registration (:func:`register`) must have happened."""
    entries = THREAD.entries
    if not entries:
        THREAD.inherited = is_switched_on()
        switch(True)
    if outermost:
        entries.insert(0, entry)
    else:
        entries.append(entry)


def pop(entry: Entry) -> None:
    """Take ``entry`` out of this thread's mode (if it is in); the last one gives the key its previous state."""
    entries = THREAD.entries
    for i in range(len(entries) - 1, -1, -1):
        if entries[i] is entry:
            del entries[i]
            if not entries:
                switch(THREAD.inherited)
            return


_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_MAX_RANGE = 2**32  # random_/randint draw one 32-bit word per element
_COMPILED_SEED_RANGE = (-(2**63), 2**63 - 1)  # how torch.compile'd code draws the seeds of its random ops
_COMPILED_DEVICE_TYPES = frozenset({"cpu", "cuda"})  # where torch.compile runs the Philox loop


# -- positions ---------------------------------------------------------------------------------
def _draw(
    what: str,
    draw: philox.Draw,
    target: torch.Tensor,
    generator: torch.Generator | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``draw``'s values for ``target``'s elements at the current position (into ``out`` if given);
    advance the position past them.

    Inside a sharded region the values are this rank's block of the region's global
    tensor at the region's base position, and the region advances every rank on exit.
    Everything is checked before any position moves, so a refusal leaves everything as it was.
    """
    device = target.device
    kind = backends.device_type(device)
    p = platforms.current()
    _refuse_capture(p, device, what, kind)  # first: the backend's probe below must not run under capture either
    on_host = kind in HOST_DRAWN  # drawn on the host, then copied: never written through a traced view
    backend = "torch" if on_host else backends.resolve("auto", device)
    region = active_region()
    if generator is not None and region is None and not (p.counter_based and generator.device.type == p.device_type):
        raise UnsupportedPortableOpError(
            f"{what} with generator= a {generator.device.type} generator: portable mode reads positions only "
            f"from counter-based generators of the platform, and {p.name!r} has "
            f"{'another device type' if p.counter_based else 'none'}. Draw from a tracker stream (tracker.fork) "
            f"or portable_random(seed) instead."
        )
    if backend == "triton" and out is not None and region is None:  # most device draws: philox.run's Triton case
        arguments, geometry = draw.kernel_arguments, _whole(target.shape)
        return draw_at_position(
            target.numel(), generator, lambda key, offset: _triton.fill(arguments, geometry, key, offset, out)
        )
    where = _HOST if on_host else device
    compiled = THREAD.entries[-1].compiled and ("cpu" if on_host else kind) in _COMPILED_DEVICE_TYPES

    def values_at(geometry: ShardGeometry, key: int, offset: int, into: torch.Tensor | None) -> torch.Tensor:
        return philox.run(draw, geometry, key, offset, where, compiled, None if on_host else into, backend)

    if region is not None:  # a refusal here cancels the region (see _switched): every rank stays put
        global_shape, blocks = _shard_of(region, target, what)
        key, offset = region.position
        values = assemble_blocks(
            blocks, lambda block: values_at(ShardGeometry.of(global_shape, block), key, offset, None)
        )
        region.consume(round_up_offset(math.prod(global_shape)))
        return values.to(device) if on_host else values
    geometry = _whole(target.shape)
    values = draw_at_position(target.numel(), generator, lambda key, offset: values_at(geometry, key, offset, out))
    if not on_host:
        return values
    return values.to(device) if out is None else out.copy_(values)


HOST_DRAWN = frozenset({"xla", "lazy", "hpu"})
"""Device types whose ops are traced and run later (torch_xla, torch's lazy tensors, Gaudi's lazy mode):
portable draws there are computed on the host and copied over in one op. Written through views of the
device tensor, as elsewhere, they were lost (torch_xla's tensors read zeros, or other numbers)."""

_HOST = torch.device("cpu")


def _refuse_capture(p: platforms.Platform, device: torch.device, what: str, kind: str | None = None) -> None:
    """Refuse a draw on a device whose stream is capturing a graph, before anything moves: a portable draw
    reads its position on the host, so every replay would repeat the captured numbers. ``kind``: the
    device's type, where the caller has read it already."""
    if kind is None:
        kind = backends.device_type(device)
    if kind != "cpu" and kind == p.device_type and p.is_capturing(device.index):
        raise UnsupportedPortableOpError(
            f"{what} while the device's stream captures a graph: a portable draw reads its position on the "
            "host, so every replay would repeat the captured numbers. Capture the step outside "
            "portable_random(), or compile it without CUDA graphs (torch.compile's default mode; "
            "mode='reduce-overhead' runs portable ops outside its graphs)."
        )


def _on_the_host(target: torch.Tensor) -> bool:
    """Whether ``target`` is a CPU tensor drawn eagerly outside a sharded region (the fast path's
    candidates; :func:`hyperrng.philox._torch.host_fill_serves` says which it serves)."""
    # backends.resolve("auto", cpu) is "torch" by rule: the host never takes the interpreter unasked
    return target.is_cpu and not THREAD.entries[-1].compiled and active_region() is None


@functools.lru_cache(maxsize=1024)
def _whole(shape: tuple[int, ...]) -> ShardGeometry:
    """The geometry of a whole tensor of ``shape`` (a tensor's ``torch.Size``, which hashes as its tuple:
    valid by construction)."""
    return ShardGeometry.of(tuple(shape))


def _shard_of(region: Any, target: torch.Tensor, what: str) -> tuple[tuple[int, ...], list[list[slice]]]:
    """The global shape of the region's op and, per dim, the slices of it that ``target`` holds."""
    for placement in region.placements:
        if getattr(placement, "is_partial", lambda: False)():
            raise InvalidArgumentError(
                f"{what} on a tensor with placement {placement}: a partial tensor holds summands, not elements, "
                f"so portable mode cannot fill it; redistribute it to Replicate() or Shard() first."
            )
    global_shape = philox.check_shape(region.global_shape)
    per_dim = shard_slices(region.mesh, region.placements, global_shape)
    local = tuple(sum(s.stop - s.start for s in slices) for slices in per_dim)
    if local != tuple(target.shape):
        raise InvalidArgumentError(
            f"{what} on a tensor of shape {tuple(target.shape)} inside a sharded region whose shard has shape "
            f"{local} (global {global_shape}); run ops on other tensors outside the region."
        )
    return global_shape, per_dim


# -- the portable kernels ----------------------------------------------------------------------
def _check_floating(target: torch.Tensor, what: str) -> None:
    if target.dtype not in _FLOAT_DTYPES:
        names = ", ".join(str(d) for d in _FLOAT_DTYPES)
        raise ArgumentTypeError(f"portable {what} fills {names} tensors; got a {target.dtype} tensor.")


def _fill(what: str, draw: philox.Draw, self: torch.Tensor, generator: Any) -> torch.Tensor:
    """Draw ``draw``'s values into ``self``: in place where its dtype is the draw's (any strides;
    that saves a second tensor and a copy, as much work as the rounds), else through a copy."""
    numel = self.numel()
    if (
        draw.dtype == self.dtype
        and generator is None
        and numel
        and _on_the_host(self)
        and _torch.host_fill_serves(draw.transform, draw.dtype, numel, self)
    ):
        # draw_at_position's rule in a few steps, for the host tensors whose cost is their fixed cost
        p = platforms.current()
        seed, offset = p._position()
        end = offset + round_up_offset(numel)
        if end <= MAX_OFFSET:
            _torch.fill_host(draw.transform, draw.params, draw.param_dtypes, seed, offset, self)
            p._move(seed, end, False)
            return self
    if draw.dtype == self.dtype:
        values = _draw(what, draw, self, generator, out=self)
        return self if values is self else self.copy_(values)  # a sharded region's block comes back as a copy
    return self.copy_(_draw(what, draw, self, generator))


def _uniform_(
    self: torch.Tensor, low: float = 0.0, high: float = 1.0, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    _check_floating(self, "uniform_")  # then the checks of uniform's values alone: the schema makes them floats
    return _fill("uniform_", philox._uniform_draw(self.dtype, low, high), self, generator)


def _normal_(
    self: torch.Tensor, mean: float = 0.0, std: float = 1.0, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    _check_floating(self, "normal_")  # then the checks of normal's values alone: the schema makes them floats
    return _fill("normal_", philox._normal_draw(self.dtype, mean, std), self, generator)


def _bernoulli_float(self: torch.Tensor, p: float = 0.5, *, generator: torch.Generator | None = None) -> torch.Tensor:
    # Straight into a floating-point tensor (dropout's noise): no bool mask and no copy.
    dtype = self.dtype if self.dtype in _FLOAT_DTYPES else torch.bool
    return _fill("bernoulli_", philox.bernoulli_draw(p, dtype), self, generator)


def _bernoulli_tensor(self: torch.Tensor, p: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
    if self.device.type in HOST_DRAWN:  # see HOST_DRAWN: the whole draw on the host, one copy
        host = torch.empty(self.shape, dtype=self.dtype)
        return self.copy_(_bernoulli_tensor(host, p.cpu(), generator=generator))
    if not p.is_floating_point():
        raise ArgumentTypeError(f"bernoulli_ takes floating-point probabilities, got a {p.dtype} tensor.")
    try:
        probabilities = p.expand(self.shape)
    except RuntimeError:
        raise InvalidArgumentError(
            f"bernoulli_: probabilities of shape {tuple(p.shape)} do not broadcast to the tensor's shape "
            f"{tuple(self.shape)}."
        ) from None
    if p.numel() and not bool(((p >= 0) & (p <= 1)).all()):  # NaN fails both comparisons
        raise InvalidArgumentError("bernoulli_: every probability must be in [0, 1] (NaN is not).")
    # A word is below round(p * 2**32) with probability p: the scalar path's integer compare,
    # with p * 2**32 exact in float64 for every float32/float16/bfloat16/float64 p.
    threshold = torch.round(probabilities.to(torch.float64) * float(_MAX_RANGE)).to(torch.int64)
    return self.copy_(_draw("bernoulli_", philox.BITS, self, generator) < threshold)


def _integer_limits(dtype: torch.dtype) -> tuple[int, int]:
    """The smallest and largest integers a real ``dtype`` holds, every one between them exactly: ``2**digits``
    for a floating dtype (``2**24`` for float32; above it, it skips integers), ``1`` for bool."""
    if dtype == torch.bool:
        return 0, 1
    if dtype.is_floating_point:
        top = 2 ** (round(-math.log2(torch.finfo(dtype).eps)) + 1)
        return -top, top
    info = torch.iinfo(dtype)
    return info.min, info.max


def random_bounds(dtype: torch.dtype, low: int, high: int | None) -> tuple[int, int]:
    """``random_(low, high)``'s checked range ``[low, high)`` for ``dtype``; ``high=None`` is torch's top of
    the dtype's range (its largest integer, or ``2**digits`` for a floating dtype, included)."""
    if dtype.is_complex:
        raise ArgumentTypeError(f"random_ draws real numbers; got a {dtype} tensor.")
    limits = _integer_limits(dtype)
    if high is None:
        high = limits[1] + 1
    span = high - low
    if span > _MAX_RANGE and not (span <= _MAX_WIDE_RANGE or span & (span - 1) == 0) or span > 2**63:
        raise InvalidArgumentError(
            f"random_/randint: the range [{low}, {high}) holds {span} values; portable mode draws ranges of up "
            f"to 2**62 values, or of 2**63."
        )
    if span > _MAX_RANGE:  # floats: integers kept exact
        if low < limits[0] or high - 1 > limits[1]:
            raise InvalidArgumentError(f"random_/randint: the range [{low}, {high}) does not fit {dtype}.")
        return low, high
    try:
        philox.randint_draw(low, high, dtype)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"random_/randint: {exc}".replace("randint: ", "", 1)) from None
    return low, high


def _random_from(
    self: torch.Tensor, low: int, high: int | None = None, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    if (low, high) == _COMPILED_SEED_RANGE:
        raise UnsupportedPortableOpError(
            "compiled code that draws torch's own random numbers (from seeds it takes with randint over the "
            "whole int64 range) ran in portable mode; compiled code draws portably only where torch.compile "
            "traced it in the mode, which needs the torch feature 'portable-compile' ('hyperrng info' says "
            "whether this torch has it). Call the compiled function outside portable_random()."
        )
    low, high = random_bounds(self.dtype, low, high)
    span = high - low
    if span <= _MAX_RANGE:
        return _fill("random_", philox.randint_draw(low, high, self.dtype), self, generator)
    if span & (span - 1) == 0:  # 2**k values: the low k bits
        values = _wide_words("random_", self.shape, self.device, generator).bitwise_and_(span - 1)
    else:
        values = _wide_words("random_", self.shape, self.device, generator).remainder_(span)
    return self.copy_(values.add_(low))


def _random_to(self: torch.Tensor, high: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    return _random_from(self, 0, high, generator=generator)


def _random_full(self: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
    return _random_from(self, 0, None, generator=generator)


_MAX_WIDE_RANGE = 2**62  # a range of more than 2**32 values takes two words per element (_wide_words)


def _wide_words(what: str, shape: Sequence[int], device: torch.device, generator: Any) -> torch.Tensor:
    """One 63-bit value per element of ``shape`` (int64, in ``[0, 2**63)``), from two words each: element ``i``
    takes words ``2 i`` (its low 32 bits) and ``2 i + 1`` (its high 31 bits) at the position, which advances
    past ``2 * numel``. Its low ``k`` bits are a uniform draw from ``2**k`` values; its remainder by another
    range of ``span`` values gives each value ``2**63 // span`` or one more chances in ``2**63`` (as a
    remainder of 64 random bits does in torch's own wide ``random_``): a relative difference of at most
    ``span / 2**62``, ``2**-9`` for ``float64``'s whole range (``2**53 + 1`` values)."""
    if active_region() is not None:
        raise UnsupportedPortableOpError(
            f"{what} of a range over 2**32 values inside a sharded region: portable mode draws such ranges "
            "(two words per element), and randperm, for whole tensors only. Draw it outside the region."
        )
    pairs = _draw(what, philox.BITS, torch.empty((*shape, 2), dtype=torch.int64, device=device), generator)
    return pairs[..., 1].bitwise_and(0x7FFFFFFF).bitwise_left_shift_(32).bitwise_or_(pairs[..., 0])


def _randperm(n: int, *, generator: torch.Generator | None = None, out: torch.Tensor) -> torch.Tensor:
    """A portable permutation of ``range(n)``: the order that sorts ``n`` values of :func:`_wide_words` (ties,
    one chance in ``2**63`` per pair, keep index order), the same on every device."""
    if n < 0:
        raise InvalidArgumentError(f"randperm: n must be >= 0, got {n}.")
    if n - 1 > _integer_limits(out.dtype)[1]:
        raise InvalidArgumentError(f"randperm: n={n} does not fit {out.dtype}; use a wider dtype such as int64.")
    order = torch.argsort(_wide_words("randperm", (n,), out.device, generator), stable=True)
    return out.resize_(n).copy_(order)


def undrawn_dropout(x: torch.Tensor, p: float, train: bool | None) -> float | tuple[torch.Tensor, torch.Tensor]:
    """``native_dropout``'s checks, then its result where it draws nothing (not training, ``p`` 0 or 1: all
    kept or none, as ``F.dropout`` on every device), else the checked ``p`` it draws with."""
    if train is False:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    if not x.is_floating_point():
        raise ArgumentTypeError(f"dropout expects a floating-point tensor, got {x.dtype}.")
    p_value = philox.check_probability(p)
    if p_value in (0.0, 1.0):
        keep = torch.full(x.shape, p_value == 0.0, dtype=torch.bool, device=x.device)
        return philox.apply_dropout_mask(x, keep, p_value), keep
    return p_value


def _native_dropout(x: torch.Tensor, p: float, train: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    p_value = undrawn_dropout(x, p, train)
    if not isinstance(p_value, float):
        return p_value
    device = x.device
    kind = backends.device_type(device)
    if x.dtype in _FLOAT_DTYPES and active_region() is None and kind not in HOST_DRAWN:
        _refuse_capture(platforms.current(), device, "native_dropout", kind)  # before the backend's probe
        if backends.resolve("auto", device) == "triton":  # mask and values in one pass
            return _fused_dropout(x, p_value)
    # The keep mask and arithmetic of F.dropout's CPU decomposition (bernoulli_(1 - p), then
    # a scale), so fused and unfused dropout, and hyperrng.philox.dropout, give the same bits.
    keep = _draw("native_dropout", philox.bernoulli_draw(1.0 - p_value), x, None)
    return philox.apply_dropout_mask(x, keep, p_value), keep


def _fused_dropout(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``native_dropout`` of ``x`` by the Triton backend: values and keep mask from one kernel."""
    draw = philox.dropout_draw(p, x.dtype)
    args = draw.kernel_arguments
    geometry = _whole(x.shape)
    if x.is_contiguous():  # empty_like keeps x's (contiguous) strides: the fewest arguments to parse
        out, keep = torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)
    else:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        keep = torch.empty(x.shape, dtype=torch.bool, device=x.device)

    def fused(key: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        _triton.fill(args, geometry, key, offset, out, x, keep)
        return out, keep

    return draw_at_position(x.numel(), None, fused)


PORTABLE_OPS: dict[str, Callable[..., Any]] = {
    "uniform_": _uniform_,
    "normal_": _normal_,
    "bernoulli_.float": _bernoulli_float,
    "bernoulli_.Tensor": _bernoulli_tensor,
    "random_.from": _random_from,
    "random_.to": _random_to,
    "random_": _random_full,
    "randperm.generator_out": _randperm,
    "native_dropout": _native_dropout,
}
"""The aten ops portable mode implements, by ``name.overload``; torch's ``rand``, ``randn``,
``rand_like``, ``randn_like``, ``randint``, ``randint_like``, ``bernoulli``, ``normal``
with float arguments, ``dropout`` and ``nn.init`` reach them through torch's own
decompositions."""


# -- refusals ----------------------------------------------------------------------------------
_COMPOSITE_KEYS = ("CompositeImplicitAutograd", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")
_DROPOUT_ARGS = ("dropout_p", "dropout")
_TRAINING_ARGS = ("train", "training")


@functools.cache
def _tagged_random_ops() -> tuple[Any, ...]:
    """Every aten op torch tags as random (``nondeterministic_seeded``), and ``random_``.

    Walks the dispatcher's list of every registered op: ``dir(torch.ops.aten)`` lists only the ops
    this process has looked up so far, which left ``binomial``, ``_sample_dirichlet`` (and on torch
    2.5 to 2.9 ``_standard_gamma``) unrefused in the mode, drawing from the device's generator.
    Found once per process (about 20 ms reading the tags from the dispatcher; entering the mode
    must not)."""
    found = []
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, label = qualified.partition("::")
        if namespace != "aten":
            continue
        name, _, overload = label.partition(".")
        if name != "random_" and torch.Tag.nondeterministic_seeded not in _tags(qualified, name, overload):
            continue
        packet = getattr(torch.ops.aten, name, None)
        op = getattr(packet, overload or "default", None) if packet is not None else None
        if op is not None:
            found.append(op)
    return tuple(found)


def _tags(qualified: str, name: str, overload: str) -> Sequence[Any]:
    """The tags of the aten op ``name.overload`` (``qualified``: ``aten::name.overload``), read from the
    dispatcher without building its Python op (the walk over every op then costs ~20 ms, not ~150);
    where this torch's dispatcher does not answer so, from the op that ``torch.ops`` builds."""
    read = getattr(torch._C, "_get_operation_overload", None)
    if read is not None:
        try:
            found = read(f"aten::{name}", overload)
        except Exception:  # an op torch lists but cannot hand out: then the slow path decides
            found = None
        if isinstance(found, tuple) and len(found) == 3 and isinstance(found[2], list):
            return found[2]
    try:
        return getattr(getattr(torch.ops.aten, name), overload or "default").tags
    except (AttributeError, RuntimeError):  # listed by the dispatcher, but no Python op for it
        return ()


@functools.cache
def _random_aten_ops() -> tuple[Any, ...]:
    """Every aten op that draws random numbers in a kernel of its own (no composite decomposition)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return tuple(op for op in _tagged_random_ops() if not any(has(op.name(), k) for k in _COMPOSITE_KEYS))


def _op_label(op: Any) -> str:
    name = op._schema.name.removeprefix("aten::")
    return name if op._overloadname == "default" else f"{name}.{op._overloadname}"


def unsupported_ops() -> list[str]:
    """Names (``name.overload``) of the aten random ops that portable mode refuses with
    :class:`UnsupportedPortableOpError` (some only for arguments that make them random)."""
    return sorted(label for label in map(_op_label, _random_aten_ops()) if label not in PORTABLE_OPS)


class _ArgumentReader:
    """Reads one argument of an op's call, as the dispatcher passes it to a Python kernel."""

    def __init__(self, index: int, argument: Any) -> None:
        self.index, self.name = index, argument.name
        self.default, self.kwarg_only = argument.default_value, argument.kwarg_only

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.kwarg_only and self.index < len(args):
            return args[self.index]
        return kwargs.get(self.name, self.default)


def _argument_reader(op: Any, names: Sequence[str]) -> _ArgumentReader | None:
    for index, argument in enumerate(op._schema.arguments):
        if argument.name in names:
            return _ArgumentReader(index, argument)
    return None


def _refusal(op: Any) -> Callable[..., Any]:
    """What portable mode does with ``op``, a random op without a portable kernel: raise, or run torch's
    kernel (``original(keyset, ...)``) when the arguments make the op deterministic."""
    label = _op_label(op)
    dropout = _argument_reader(op, _DROPOUT_ARGS)
    training = _argument_reader(op, _TRAINING_ARGS)

    def refuse(original: Callable[..., Any], keyset: Any, *args: Any, **kwargs: Any) -> Any:
        deterministic = (dropout is not None and not dropout(args, kwargs)) or (
            training is not None and not training(args, kwargs)
        )
        if deterministic:
            return original(keyset, *args, **kwargs)
        raise UnsupportedPortableOpError(_refusal_message(label))

    return refuse


_USER_OPS = (
    "rand, randn, randint, rand_like, randn_like, uniform_, normal_, bernoulli_, random_, randperm, "
    "F.dropout, F.scaled_dot_product_attention, nn.init"
)
"""The portable ops as users call them (the aten names of PORTABLE_OPS mean little in a message)."""


def _refusal_message(label: str) -> str:
    return (
        f"{label} has no portable implementation, and portable mode never falls back to a device's own "
        f"generator; call it outside portable_random(), or use a portable op ({_USER_OPS})."
    )


def _own_host_generator(kwargs: dict[str, Any]) -> bool:
    """Whether a call in the mode runs torch's own kernel because it names, as ``generator=``, a CPU
    ``torch.Generator`` of its own: one that is not where the platform keeps portable positions (torch's
    default CPU generator, on the ``cpu`` platform, which is taken out of ``kwargs`` here: the call draws
    at the platform's position, as without it). Its numbers are computed on the host from that
    generator's state alone, so they are the same on every machine, as portable numbers are; a shuffling
    DataLoader's sampler draws its order that way (with a seed it draws portably). Not inside a sharded
    region, which positions the generator it was given and draws its block of the global tensor."""
    gen = kwargs.get("generator")
    if gen is None or gen.device.type != "cpu" or active_region() is not None:
        return False
    if platforms.current().device_type == "cpu" and _is_host_default(gen):
        kwargs["generator"] = None
        return False
    if checkpoint_forward() is not None:  # no checkpoint puts a generator of the caller's back
        raise UnsupportedPortableOpError(
            "a random op given generator= a torch.Generator of your own inside an activation checkpoint: its "
            "recompute in the backward pass would draw that generator's next numbers, not the forward's, and "
            "the gradients would silently differ. Draw it outside the checkpointed function, or without "
            "generator= (portable draws are replayed)."
        )
    return True


def _is_host_default(gen: torch.Generator) -> bool:
    """Whether ``gen`` is torch's default CPU generator (a generator passed through the dispatcher arrives as
    a new Python object): its state equals the default's, and reseeding it changes the default's. Both
    states are put back."""
    default = torch.default_generator
    state = default.get_state()
    if not torch.equal(gen.get_state(), state):
        return False
    try:
        gen.manual_seed((default.initial_seed() + 1) & (2**64 - 1))
        return not torch.equal(default.get_state(), state)
    finally:
        default.set_state(state)
        gen.set_state(state)


# -- the dispatch key: registered once, switched per thread --------------------------------------
KEY_NAME = "CustomRNGKeyId"
"""The dispatch key portable mode's kernels live on. torch reserves it for random-number kernels:
it sits just above the backend keys (``CPU``, ``CUDA``, ``PrivateUse1``, ...) and below autograd,
and no tensor carries it, so it takes part in a call only on a thread that includes it."""


def _key() -> Any:
    return torch._C._parse_dispatch_key(KEY_NAME)


def switch(on: bool) -> None:
    """Include the key in this thread's dispatch (``on``) or not: the whole cost of entering or leaving
    for torch's dispatcher. Autograd hands a thread's included keys to the threads that run its
    backward pass, which therefore reach the kernels too; with no entry on that thread, they run
    torch's own kernels (see :func:`_switched`)."""
    torch._C._dispatch_tls_set_dispatch_key_included(_KERNELS.key, on)


def is_switched_on() -> bool:
    """Whether the calling thread includes the key (entered, or inherited by an autograd thread)."""
    key = _KERNELS.key
    return key is not None and torch._C._dispatch_tls_is_dispatch_key_included(key)


# -- torch.utils.checkpoint without a replay ---------------------------------------------------------
def refuse_unreplayed_checkpoint(what: str) -> None:
    """Refuse a portable draw in the forward pass of a ``torch.utils.checkpoint`` whose recompute would draw
    other numbers (:func:`hyperrng.streams._checkpoints.unreplayed_checkpoint`), before anything moves."""
    flavour = unreplayed_checkpoint()
    if flavour is not None:
        raise UnsupportedPortableOpError(
            f"{what} in portable mode inside torch.utils.checkpoint ({flavour}) without hyperrng's replay: its "
            "recompute in the backward pass would draw torch's numbers, not the forward's, and the gradients "
            "would silently differ. Pass use_reentrant=False, context_fn=hyperrng.checkpoint_context (or to "
            "checkpoint_wrapper), or use hyperrng.checkpoint(fn, *args); compiled checkpoints need nothing."
        )


def _before_attention(what: str, device: torch.device) -> None:
    """The checks of a portable draw, for attention (taken over above this key): no checkpoint that would
    recompute other numbers, no graph capture."""
    refuse_unreplayed_checkpoint(what)
    _refuse_capture(platforms.current(), device, what)


def _cancel_active_region() -> None:
    """Cancel the active sharded region, for a kernel that refuses an op (a bad dtype, an unsupported
    op): every rank then stays where it was instead of moving past the op."""
    region = active_region()
    if region is not None:
        region.cancel()


def _cancelling(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``kernel``, cancelling the active sharded region when it refuses an op (:func:`_cancel_active_region`)."""

    @functools.wraps(kernel)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return kernel(*args, **kwargs)
        except HyperRNGError:
            _cancel_active_region()
            raise

    return run


_META = torch._C.DispatchKey.Meta
"""Meta tensors, and fake ones (whose kernels run on meta tensors: torch.compile's tracing, DTensor's
sharding propagation), carry this key: they propagate shapes, draw nothing, and move no position."""


def _below(op: Any, below: Any) -> Callable[..., Any]:
    """torch's own kernel for ``op``: the call redispatched to the keys under portable mode's."""

    def original(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        return op.redispatch(keyset & below, *args, **kwargs)

    return original


def _run_untraced(kernel: Callable[..., Any], keyset: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return kernel(keyset, *args, **kwargs)


_untraced = outside_dynamo(_run_untraced)
"""Runs a kernel below as Python where Dynamo would trace it. Dynamo compiles every Python frame that a
compiled function's graph-broken parts call, our kernels too when an op runs eagerly there (a DTensor
random op, whose sharding Dynamo leaves to eager code): traced, a draw would be recorded as the host
arithmetic of one call, baked into a graph. Behind the break it is the eager draw, at its position."""


def _switched(op: Any, portable: Callable[..., Any], below: Any) -> Callable[..., Any]:
    """The kernel registered for ``op``: ``portable`` on a thread in portable mode, else torch's own.

    A thread reaches it only while it includes the key; one that does without an entry of its own
    is an autograd thread running the backward pass of a thread that called ``backward()`` in the
    mode, which draws portably only under :class:`~hyperrng.portable.mode.mode_applied`."""
    original = _below(op, below)
    key = _key()
    include = torch._C._dispatch_tls_set_dispatch_key_included

    what = _op_label(op)

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # Dynamo traces this frame: it runs as Python behind a graph break
            return _untraced(kernel, keyset, args, kwargs)
        if (  # torch's kernels: meta and fake tensors only propagate shapes; see _own_host_generator
            not THREAD.entries
            or keyset.has(_META)
            or (kwargs.get("generator") is not None and _own_host_generator(kwargs))
        ):
            return original(keyset, *args, **kwargs)
        include(key, False)  # the kernel's own tensor ops run as outside the mode, skipping the key's composites
        try:
            refuse_unreplayed_checkpoint(what)
            return portable(*args, **kwargs)
        except HyperRNGError:
            _cancel_active_region()
            raise
        finally:
            include(key, True)

    return kernel


def _switched_refusal(op: Any, refuse: Callable[..., Any], below: Any) -> Callable[..., Any]:
    """:func:`_switched` for an op without a portable kernel (:func:`_refusal`)."""
    refusing = _cancelling(refuse)
    original = _below(op, below)

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return _untraced(kernel, keyset, args, kwargs)
        if THREAD.entries and not keyset.has(_META) and not _own_host_generator(kwargs):
            return refusing(original, keyset, *args, **kwargs)
        return original(keyset, *args, **kwargs)

    return kernel


def _has_composite_on_key(name: str) -> bool:
    """Whether op ``name`` has a kernel on the key that is not a fallthrough and that a fallthrough of its
    own may replace (torch's default kernels, except for ops reached from ``BackendSelect``, see :class:`_Kernels`)."""
    has = torch._C._dispatch_has_computed_kernel_for_dispatch_key
    return has(name, KEY_NAME) and not torch._C._dispatch_has_kernel_for_dispatch_key(name, "BackendSelect")


@functools.cache
def composite_random_ops() -> tuple[Any, ...]:
    """The random aten ops whose default kernel (``CompositeExplicitAutograd``) is made of other ops: the
    functional forms (``bernoulli.p`` is ``empty_like`` then ``bernoulli_``) and the factories (``rand``).

    They keep that default on the key, where it runs first, rather than a fallthrough: a device may
    register a kernel of its own for them (torch_xla does, for ``bernoulli``), and functionalization
    (torch_xla's, torch.compile's) turns every in-place random op into its functional form."""
    return tuple(op for op in _tagged_random_ops() if explicit_composite_key(op) is not None)


def explicit_composite_key(op: Any) -> str | None:
    """The key of ``op``'s explicit default kernel (``CompositeExplicitAutograd[NonFunctional]``), if it has one."""
    for key in _COMPOSITE_KEYS[1:]:
        if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key):
            return key
    return None


def defaults_left_on_key() -> list[str]:
    """The ops that keep torch's default kernel on the key although they take tensors: reached from
    ``BackendSelect`` (``_to_copy``, sparse constructors...), where a fallthrough of one op cannot serve.
    Tracing runs them with the key excluded (see hyperrng.portable._traced)."""
    found = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::") or not torch._C._dispatch_has_kernel_for_dispatch_key(name, "BackendSelect"):
            continue
        if not torch._C._dispatch_has_computed_kernel_for_dispatch_key(name, KEY_NAME):
            continue
        base, _, overload = name.partition(".")
        schema = torch._C._get_schema(base, overload)
        if any(isinstance(argument.type, torch._C.TensorType) for argument in schema.arguments):
            found.append(name)
    return found


class _Kernels:
    """Portable mode's kernels on the key, registered once per process and never changed again.

    The portable kernels and the refusals; a fallthrough as the key's fallback, for every op
    without a kernel there; and a fallthrough for each op torch registers a default (composite)
    kernel on the key for, as it does on every backend key: otherwise inside the mode such an
    op (``add``, ``exp_``, ``empty_like``...) would run that default instead of the device's own
    kernel, one more dispatch, and on meta tensors a loop through Python meta functions. The
    dispatcher skips a fallthrough key at no cost, so inside the mode only random ops reach
    Python. Ops reached from ``BackendSelect`` keep their default there (they are redispatched
    with the thread's keys, which a fallthrough of one op cannot serve): ``rand`` runs as
    ``empty`` and ``uniform_``, as on a backend. So do the random ops made of others
    (:func:`composite_random_ops`), so that no device's own kernel for them runs in the mode.
    Ops that libraries register after the first entry keep their defaults too.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.libraries: dict[str, Any] = {}  # kept for the life of the process: destroying one rewrites the table
        self.key: Any = None
        self.labels: list[str] = []  # ops with a portable kernel or a refusal at the key
        self.then: list[Callable[[Any], None]] = []  # called with the key once the kernels are registered

    def ensure(self) -> None:
        if self.key is not None:
            return
        with self.lock, warnings.catch_warnings():
            if self.key is not None:
                return
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            key = _key()
            below = torch._C._dispatch_keyset_full_after(key)
            kernels: dict[str, Callable[..., Any]] = {}
            for label, fn in PORTABLE_OPS.items():
                name, _, overload = label.partition(".")
                op = getattr(getattr(torch.ops.aten, name), overload or "default")
                kernels["aten::" + label] = _switched(op, fn, below)
            for op in _random_aten_ops():
                label = _op_label(op)
                if label not in PORTABLE_OPS:
                    kernels["aten::" + label] = _switched_refusal(op, _refusal(op), below)
            self._library("_").fallback(torch.library.fallthrough_kernel, KEY_NAME)
            made_of_random_ops = {op.name() for op in composite_random_ops()}
            for name in torch._C._dispatch_get_all_op_names():
                if name not in kernels and name not in made_of_random_ops and _has_composite_on_key(name):
                    self._impl(name, torch.library.fallthrough_kernel)
            for name, kernel in kernels.items():
                self._impl(name, kernel, with_keyset=True)
            for name, kernel in _attention_ops.kernels(lambda: bool(THREAD.entries), _before_attention).items():
                for autograd_key in _attention_ops.AUTOGRAD_KEYS:
                    self._impl("aten::" + name, kernel, with_keyset=True, key=autograd_key)
            self.labels = sorted(name.removeprefix("aten::") for name in kernels)
            for (
                then
            ) in self.then:  # what builds on the kernels (hyperrng.portable._traced), before any thread uses them
                then(key)
            self.key = key  # last: a thread that sees it sees every registration

    def _library(self, namespace: str) -> Any:
        library = self.libraries.get(namespace)
        if library is None:
            library = self.libraries[namespace] = torch.library.Library(namespace, "IMPL")
        return library

    def _impl(self, name: str, kernel: Callable[..., Any], with_keyset: bool = False, key: str = KEY_NAME) -> None:
        namespace, _, label = name.partition("::")
        self._library(namespace).impl(label, kernel, key, with_keyset=with_keyset)


_KERNELS = _Kernels()


def register_then(then: Callable[[Any], None]) -> None:
    """Call ``then(key)`` when the kernels are registered, before any thread sees them (now, if they are):
    how modules that build on them, and that this one does not import, join the registration."""
    with _KERNELS.lock:
        if _KERNELS.key is None:
            _KERNELS.then.append(then)
            return
    then(_KERNELS.key)


def register() -> None:
    """Make sure portable mode's kernels are registered (once per process, for good).

    Raises:
        UnsupportedPortableOpError: this torch cannot host them (the feature "portable-mode" of
            ``hyperrng.platforms._features``); nothing is registered then.
    """
    if _KERNELS.key is None:  # asked until registered: afterwards the kernels are there for good
        _features.require("portable-mode", UnsupportedPortableOpError)
        _KERNELS.ensure()


def registered() -> list[str]:
    """The ops (``name.overload``) with a portable kernel or a refusal on portable mode's key, sorted.

    Empty until a thread first enters portable mode; the kernels then stay (see the module
    docstring). Other ops only fall through the key, and no backend's kernel is touched, so
    outside the mode every op runs exactly as before registration.
    """
    return list(_KERNELS.labels)
