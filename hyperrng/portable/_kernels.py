"""The aten kernels of portable mode: a kernel per random aten op (:data:`PORTABLE_OPS`) that draws at the
current position with :func:`hyperrng.portable.position.draw_at_position`, or inside a sharded region fills this
rank's shard from global indices, and :data:`THREAD`, whose entries say whether the calling thread draws
portably. :mod:`hyperrng.portable._ops` registers them on their dispatch key and switches them per thread.

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
from collections.abc import Callable, Sequence
from typing import Any

import torch

import hyperrng.platforms as platforms
from hyperrng import philox
from hyperrng.errors import ArgumentTypeError, InvalidArgumentError, UnsupportedPortableOpError
from hyperrng.philox import _torch, _triton, backends
from hyperrng.philox._shards import ShardGeometry
from hyperrng.platforms import _features
from hyperrng.platforms.validate import MAX_OFFSET, round_up_offset
from hyperrng.portable.position import assemble_blocks, draw_at_position, shard_slices
from hyperrng.sharding.tracker import active_region

__all__ = ["HOST_DRAWN", "PORTABLE_OPS", "THREAD", "Entry", "random_bounds", "refuse_capture", "undrawn_dropout"]


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
    refuse_capture(p, device, what, kind)  # first: the backend's probe below must not run under capture either
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
        arguments, numel = draw.kernel_arguments, target.numel()
        # The two fills take the same arguments, the extent aside: a contiguous tensor (most) has no geometry to find.
        fill, extent = (_triton.fill_contiguous, numel) if out.is_contiguous() else (_triton.fill, _whole(target.shape))
        return draw_at_position(numel, generator, lambda key, offset: fill(arguments, extent, key, offset, out))
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


def refuse_capture(p: platforms.Platform, device: torch.device, what: str, kind: str | None = None) -> None:
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
        why = (
            "torch.compile compiled it outside the mode and did not compile it again in it, as it does where a "
            "tensor input shows the mode, or the op ran under torch.inference_mode() entered inside the compiled "
            "function, which hides it from the mode's tracing. Compile it again inside the mode "
            "(torch._dynamo.reset(), or a separate torch.compile), enter inference_mode outside the compiled call, "
            "or call it outside portable_random()."
            if _features.feature("portable-compile").available
            else "compiled code draws portably only where torch.compile traced it in the mode, which needs the "
            "torch feature 'portable-compile' ('hyperrng info' says what it needs). Call the compiled function "
            "outside portable_random()."
        )
        raise UnsupportedPortableOpError(
            "compiled code that draws torch's own random numbers (from seeds it takes with randint over the "
            f"whole int64 range) ran in portable mode; {why}"
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
    if train is not False and type(p) is float and 0.0 < p < 1.0 and x.dtype in _FLOAT_DTYPES:
        return p  # what the checks below give for every draw of the kernels' dtypes, without their calls
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
        refuse_capture(platforms.current(), device, "native_dropout", kind)  # before the backend's probe
        if backends.resolve("auto", device) == "triton":  # mask and values in one pass
            return _fused_dropout(x, p_value)
    # The keep mask and arithmetic of F.dropout's CPU decomposition (bernoulli_(1 - p), then
    # a scale), so fused and unfused dropout, and hyperrng.philox.dropout, give the same bits.
    keep = _draw("native_dropout", philox.bernoulli_draw(1.0 - p_value), x, None)
    return philox.apply_dropout_mask(x, keep, p_value), keep


def _fused_dropout(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``native_dropout`` of ``x`` by the Triton backend: values and keep mask from one kernel."""
    args, numel = _dropout_arguments(p, x.dtype), x.numel()
    if x.is_contiguous():  # empty_like keeps x's (contiguous) strides: the fewest arguments to parse
        out, keep = torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)
        fill, extent = _triton.fill_contiguous, numel  # all three contiguous: no geometry to find
    else:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        keep = torch.empty(x.shape, dtype=torch.bool, device=x.device)
        fill, extent = _triton.fill, _whole(x.shape)

    def fused(key: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        fill(args, extent, key, offset, out, x, keep)
        return out, keep

    return draw_at_position(numel, None, fused)


@functools.lru_cache(maxsize=256)
def _dropout_arguments(p: float, dtype: torch.dtype) -> _triton.Arguments:
    """The fused dropout's kernel arguments for a checked ``0 < p < 1`` and a dtype of :data:`_FLOAT_DTYPES`, in one
    look-up per draw (:func:`~hyperrng.philox.dropout_draw` rounds ``p`` to its threshold, then looks up its draw)."""
    return philox.dropout_draw(p, dtype).kernel_arguments


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
