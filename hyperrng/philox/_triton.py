"""The Triton backend of :mod:`hyperrng.philox`: each draw is one fused kernel launch.

The kernels (:mod:`hyperrng.philox._triton_kernels`) compute the same words and the same
arithmetic as the torch backend (:mod:`hyperrng.philox._torch`), so their results are
bit-identical wherever the distribution is exact (bits, uniform, bernoulli, randint,
dropout); :func:`~hyperrng.philox.normal` agrees to a few ulp, its ``log`` being Triton's
and its ``sin``/``cos`` the kernels' own rather than the CPU's.

A draw writes its result straight into the destination: a contiguous tensor, or any tensor
that views as ``(runs, run length)`` with one stride per dimension (a transposed matrix, a
shard's rows). Other layouts are filled through a contiguous copy. Runs that are contiguous
and whole Philox blocks from a block boundary launch the kernels' aligned variant (vector
stores); a long contiguous run that ends inside a block takes two launches, its whole blocks
aligned and its last elements apart.

Triton is imported on first use, never by ``import hyperrng``. On CPU tensors the same
kernels run under Triton's interpreter (see :func:`kernels`): slow, and meant for tests.
Which backend serves a device is decided in :mod:`hyperrng.philox.backends`, which calls
:func:`probe` once per device type.
"""

from __future__ import annotations

import contextlib
import fractions
import functools
import importlib.util
import os
import struct
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

import hyperrng.platforms as platforms
from hyperrng.philox._shards import ShardGeometry

__all__ = ["Arguments", "arguments", "fill", "fill_contiguous", "dropout", "kernels", "launching_on", "load", "probe"]

_MASK32 = 0xFFFFFFFF
_SIGN32 = 0x80000000
_MAX_BLOCK = 512
"""Philox blocks per program at most: 2,048 values, four per thread of four warps. A program
that covers a whole short run (a shard's row) takes fewer, rounded up to a power of two."""
_MIN_BLOCK = 16
_LOAD_LOCK = threading.RLock()  # reentrant: the attention kernels' copy loads the draw kernels' in its mode
_INTERPRET = "TRITON_INTERPRET"

_DISTS = frozenset({"random_bits", "uniform", "bernoulli", "normal", "randint", "dropout"})
_UNIFORM_TINY = "uniform_tiny"  # uniform whose span times 2**-32 is not exact in the compute dtype (see the kernel)
_UNIFORM_FROM_ZERO = "uniform_from_zero"  # uniform from low = 0: no addition


def kernels(interpreted: bool) -> ModuleType:
    """The distributions' kernel module: compiled for devices Triton serves, or ``interpreted`` for CPU tensors.

    Raises:
        ImportError: Triton is not installed.
    """
    return load("hyperrng.philox._triton_kernels", interpreted)


@functools.cache
def load(name: str, interpreted: bool) -> ModuleType:
    """The module of Triton kernels ``name``: imported as usual, or a second copy for Triton's interpreter.

    Triton decides when a function is decorated whether it compiles or interprets it, from
    ``TRITON_INTERPRET``: the interpreted copy is the same file executed under another module
    name (``name + "_interpreted"``, registered in ``sys.modules`` as an import would) while the
    variable is ``"1"``, under a lock, restored after (another thread decorating kernels meanwhile
    would see it). Both copies can live in one process: a GPU machine runs compiled kernels on
    CUDA tensors and the interpreted ones on CPU tensors.

    Raises:
        ImportError: Triton is not installed (or the module fails to import).
    """
    if not interpreted:
        return importlib.import_module(name)
    import triton  # noqa: F401 -- the ImportError of a machine without Triton, before anything else

    origin = importlib.util.find_spec(name)
    assert origin is not None and origin.origin is not None
    spec = importlib.util.spec_from_file_location(name + "_interpreted", origin.origin)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with _LOAD_LOCK:
        previous = os.environ.get(_INTERPRET)
        os.environ[_INTERPRET] = "1"
        sys.modules[spec.name] = module  # dataclasses and Triton look the module up by name
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[spec.name]
            raise
        finally:
            if previous is None:
                del os.environ[_INTERPRET]
            else:
                os.environ[_INTERPRET] = previous
    return module


# -- arguments ----------------------------------------------------------------------------------
def _s32(value: int) -> int:
    """A 32-bit word as the signed int with the same bits (so Triton always types it ``i32``)."""
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def _bits64(value: float) -> int:
    """The int64 bit pattern of ``value`` as a float64."""
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


@functools.lru_cache(maxsize=1024)
def divisor(d: int) -> tuple[int, int]:
    """The magic number and shifts (both below ``2**32``) of the kernels' ``quotient``: ``a // d`` for every
    32-bit ``a``, ``1 <= d <= 2**32``, with one 32-bit high multiply (Granlund and Montgomery, 1994).

    With ``l = ceil(log2 d)``: ``m = floor(2**32 * (2**l - d) / d) + 1``, the shifts ``min(l, 1)`` (bit 0)
    and ``max(l - 1, 0)`` (above). ``d = 2**32`` takes ``m = 0`` and the shifts 1 and 31: a quotient of 0.
    """
    if not 1 <= d <= 1 << 32:
        raise ValueError(f"divisor {d} is outside [1, 2**32]")
    if d == 1 << 32:
        return 0, 1 | 31 << 1
    log = (d - 1).bit_length()
    return ((1 << 32) * ((1 << log) - d)) // d + 1, min(log, 1) | max(log - 1, 0) << 1


@dataclass(frozen=True, eq=False)
class Arguments:
    """A distribution's kernel arguments: its name, compute dtype, 32-bit parameters (``i0`` to ``i2``) and
    64-bit ones (``q0`` to ``q3``), as the kernel's docstring names them. Compared and hashed by identity
    (one is made per distinct set by the cached :func:`arguments`): a launch looks its options up by it."""

    dist: str  # the kernel's DIST: the distribution's name, or a variant's (see the kernel)
    compute: Any  # tl.float32 or tl.float64
    words: tuple[int, int, int]
    quads: tuple[int, int, int, int]


@functools.lru_cache(maxsize=256)
def arguments(name: str, params: tuple[float | int, ...], value_dtype: torch.dtype) -> Arguments:
    """The kernel arguments of distribution ``name`` with the torch backend's ``params``.

    ``params`` are those of :class:`hyperrng.philox._torch.Kernel`: for uniform
    ``(keep, unit, span, low)``, bernoulli and dropout ``(threshold,)`` (dropout adds the
    scale), normal ``(shift, unit, two_pi, std, mean)``, randint ``(low, span)``.
    """
    import triton.language as tl

    compute = tl.float64 if value_dtype == torch.float64 else tl.float32
    if name not in _DISTS:
        raise KeyError(f"no Triton kernel draws {name!r}")
    dist = name
    words, quads = (0, 0, 0), (0, 0, 0, 0)
    if name == "uniform":
        keep, unit, span, low = params
        # One multiply where unit * span is exact in the compute dtype (every span but the tiniest):
        # (word & keep) * unit is exact, so rounding it times span is rounding word & keep times the product.
        exact_in = torch.float64 if value_dtype == torch.float64 else torch.float32
        scale = float(torch.tensor(unit * span, dtype=torch.float64).to(exact_in))
        if fractions.Fraction(scale) == fractions.Fraction(unit) * fractions.Fraction(span):
            dist = _UNIFORM_FROM_ZERO if low == 0.0 else dist  # + 0.0 or + -0.0 changes no value here (>= +0.0)
            words, quads = (_s32(int(keep)), 0, 0), (_bits64(scale), _bits64(low), 0, 0)
        else:
            dist = _UNIFORM_TINY
            words, quads = (_s32(int(keep)), 0, 0), (_bits64(unit), _bits64(span), _bits64(low), 0)
    elif name in ("bernoulli", "dropout"):
        threshold = int(params[0])  # word < threshold, 0 to 2**32: word <= threshold - 1, unless 0
        words = (_s32(threshold - 1) if threshold else 0, 1 if threshold else 0, 0)
        if name == "dropout":
            quads = (_bits64(params[1]), 0, 0, 0)
    elif name == "normal":
        shift, unit, two_pi, std, mean = params
        words, quads = (int(shift), 0, 0), (_bits64(unit), _bits64(two_pi), _bits64(std), _bits64(mean))
    elif name == "randint":
        low, span = params
        magic, shifts = divisor(int(span))
        words, quads = (_s32(magic), _s32(int(span)), shifts), (int(low), 0, 0, 0)
    return Arguments(dist, compute, words, quads)


def _block(run: int, aligned: bool = False) -> tuple[int, int]:
    """Philox blocks per program for runs of ``run`` elements, and the warps that compute them: enough for a
    whole run, up to :data:`_MAX_BLOCK`, whichever lane it starts at (lane 0 where ``aligned``)."""
    blocks = (run + 3) // 4 if aligned else (run + 6) // 4
    block = min(_MAX_BLOCK, max(_MIN_BLOCK, 1 << max(blocks - 1, 0).bit_length()))
    return block, 4 if block >= 256 else (2 if block >= 64 else 1)


def _chunks(run: int, block: int, aligned: bool = False) -> int:
    """Programs per run of ``run`` elements, ``4 * block`` elements each (from lane 3 at worst unless ``aligned``)."""
    return -(-(run if aligned else run + 3) // (4 * block))


def _aligned(geometry: ShardGeometry, start: int) -> bool:
    """Whether every run of ``geometry`` drawn from global index ``start`` (its first element's) begins at a
    Philox block: the first does, and the runs step by multiples of 4 along every dimension that indexes
    more than one of them."""
    if start % 4:
        return False
    stride = 1
    for d in range(len(geometry.global_shape) - 1, -1, -1):
        if d < geometry.split and geometry.local_shape[d] > 1 and stride % 4:
            return False
        stride *= geometry.global_shape[d]
    return True


def _as_runs(t: torch.Tensor, segments: int, run: int) -> tuple[int, int] | None:
    """The strides of ``t`` seen as ``(segments, run)``, or ``None`` if one stride per dimension cannot do."""
    if t.is_contiguous():  # the common case, without a view
        return (run, 1)
    try:
        view = t.view(segments, run)
    except RuntimeError:
        return None
    return view.stride(0), view.stride(1)


def language_restored(interpreted: bool) -> contextlib.AbstractContextManager[None]:
    """Around a launch: where ``interpreted``, put back afterwards what Triton's interpreter patched in
    ``triton.language`` (its modules and the classes of its core module); a compiled launch needs nothing.

    Triton 3.6 restores its patches itself after each launch; earlier releases (3.5, torch 2.9's)
    leave the interpreter's stand-ins in place, and every later compile in the process, of these
    kernels or of torch.compile's, then fails ("Unsupported function referenced"). Where nothing
    was left patched this only compares (a few hundred attributes)."""
    return _restoring_language() if interpreted else contextlib.nullcontext()


@contextlib.contextmanager
def _restoring_language() -> Iterator[None]:
    import triton.language as tl

    core = tl.core
    classes = (v for v in vars(core).values() if isinstance(v, type) and v.__module__ == core.__name__)
    owners = [tl, core, tl.math, *dict.fromkeys(classes)]
    saved = [dict(vars(owner)) for owner in owners]
    try:
        yield
    finally:
        for owner, before in zip(owners, saved):
            for name, value in list(vars(owner).items()):
                if name not in before:
                    delattr(owner, name)
                elif value is not before[name]:
                    setattr(owner, name, before[name])


# -- draws --------------------------------------------------------------------------------------
def launching_on(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` its type's current device while kernels launch on its tensors, and put the
    previous one back after: Triton launches on the current device, not on the tensors'.

    Through the platform, whose device type it must be; a tensor of another type (the CPU's,
    under the interpreter) launches as it is. Costs one ``current_device()`` when nothing changes.
    """
    before = _made_current(device)
    return contextlib.nullcontext() if before is None else _device_restored(before)


def _made_current(device: torch.device) -> int | None:
    """Make ``device`` current (:func:`launching_on`); return the index to make current again after the
    launch, or ``None`` where nothing changed."""
    if device.index is None:  # a CPU tensor, or an index-less device: nothing to make current
        return None
    p = platforms.current()
    if device.type != p.device_type:
        return None
    before = p.current_device()
    if before == device.index:
        return None
    p.set_device(device.index)
    return before


@contextlib.contextmanager
def _device_restored(before: int) -> Any:
    try:
        yield
    finally:
        platforms.current().set_device(before)


def fill(
    args: Arguments,
    geometry: ShardGeometry,
    key: int,
    offset: int,
    out: torch.Tensor,
    x: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write the values of the block ``geometry`` of the global tensor drawn at ``(key, offset)`` into
    ``out`` (the block's shape), in one launch (two for a long contiguous run that ends inside a Philox
    block); return ``out``.

    For dropout ``x`` is the input (the block's shape) and ``mask``, if given, receives the keep
    mask (bool, ``out``'s layout). Arguments must be checked: nothing is validated here.
    """
    numel = out.numel()
    if numel == 0:
        return out
    segments, run = geometry.segments, geometry.run
    start = offset + geometry.first
    if (  # the common case first, in few steps: one contiguous run from a block's start, in one launch
        segments == 1
        and start % 4 == 0
        and (run % 4 == 0 or run <= 4 * _MAX_BLOCK)
        and out.is_contiguous()
        and (x is None or x.is_contiguous())
        and (mask is None or mask.is_contiguous())
    ):
        return fill_contiguous(args, run, key, start, out, x, mask)  # one run: a whole tensor's launch
    strides = _as_runs(out, segments, run)
    if strides is None and segments == 1 and out.dim() > 1:  # one run, stored row by row (a transposed matrix)
        segments, run = numel // out.shape[-1], out.shape[-1]
        strides = _as_runs(out, segments, run)
    if strides is None or (mask is not None and _as_runs(mask, segments, run) != strides):
        dense = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        dense_mask = None if mask is None else torch.empty(out.shape, dtype=torch.bool, device=out.device)
        fill(args, geometry, key, offset, dense, x, dense_mask)
        if mask is not None:
            mask.copy_(dense_mask)  # type: ignore[arg-type]
        return out.copy_(dense)
    x_strides = (0, 0)
    if x is not None:
        found = _as_runs(x, segments, run)
        if found is None:
            x = x.contiguous()
            found = (run, 1)
        x_strides = found
    if geometry.segments > 1:  # the runs' global starts, from 0 (they include the block's first element)
        ids = torch.arange(segments, dtype=torch.int64, device=out.device)
        aligned = run % 4 == 0 and _aligned(geometry, offset + geometry.first)
        _launch(args, out, x, mask, geometry.segment_starts(ids), run, segments, strides, x_strides, key, offset,
                aligned)  # fmt: skip
        return out
    tail = run % 4
    if segments == 1 and tail and start % 4 == 0 and run > 4 * _MAX_BLOCK and _unit(strides, x, x_strides):
        # One long contiguous run whose last block is partial: its whole blocks in an aligned launch,
        # the last block's elements in a second, small one (rather than every element unaligned).
        body = run - tail
        for lo, n in ((0, body), (body, tail)):
            part = out.view(-1)[lo : lo + n]
            _launch(args, part, _piece(x, lo, n), _piece(mask, lo, n), None, n, 1, (n, 1), (n, 1), key, start + lo,
                    n % 4 == 0)  # fmt: skip
        return out
    aligned = start % 4 == 0 and run % 4 == 0
    _launch(args, out, x, mask, None, run, segments, strides, x_strides, key, start, aligned)
    return out


def fill_contiguous(
    args: Arguments,
    run: int,
    key: int,
    offset: int,
    out: torch.Tensor,
    x: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`fill` of one run of ``run`` elements (``out.numel()``, which callers have) from global index
    ``offset``, with ``out``, ``x`` and ``mask`` contiguous (the caller knows): a whole tensor, or a shard
    that is one run. A run from a Philox block's start that takes one launch (most portable draws) launches
    here, without the geometry and layout checks that find it and with the arguments that depend on the run
    alone built once per run length (:func:`_one_run`); any other is drawn by :func:`fill`."""
    if not (run and offset % 4 == 0 and (run % 4 == 0 or run <= 4 * _MAX_BLOCK)):
        return fill(args, ShardGeometry.of(tuple(out.shape)), key, offset, out, x, mask)
    grid, shape, scalars, options = _one_run(args, run, x is not None, mask is not None)
    # The kernel's arguments in its order, joined from tuples (star-unpacking builds a list first): the
    # tensors, the run's, the position (lane 0: offset % 4) and the key's words (_s32, inline), the distribution's.
    tensors = (out, out if x is None else x, out if mask is None else mask, out)
    position = (offset // 4, 0, (key & _MASK32 ^ _SIGN32) - _SIGN32, (key >> 32 & _MASK32 ^ _SIGN32) - _SIGN32)
    _start(grid, tensors + shape + position + scalars, options, out)
    return out


def _piece(t: torch.Tensor | None, start: int, n: int) -> torch.Tensor | None:
    """Elements ``start`` to ``start + n`` of a tensor that views as one contiguous run (``None``: none)."""
    return None if t is None else t.view(-1)[start : start + n]


def _unit(strides: tuple[int, int], x: torch.Tensor | None, x_strides: tuple[int, int]) -> bool:
    """Whether the runs of the result (and of ``x``, if any) have unit element strides."""
    return strides[1] == 1 and (x is None or x_strides[1] == 1)


def _launch(
    args: Arguments,
    out: torch.Tensor,
    x: torch.Tensor | None,
    mask: torch.Tensor | None,
    starts: torch.Tensor | None,
    run: int,
    segments: int,
    strides: tuple[int, int],
    x_strides: tuple[int, int],
    key: int,
    start: int,
    runs_aligned: bool,
) -> None:
    """One launch over ``segments`` runs of ``run`` elements; run ``s`` starts at global index
    ``start + starts[s]`` (``start + s * run`` without ``starts``); ``runs_aligned``: each run is whole
    Philox blocks.

    The launch is ``ALIGNED`` (vector stores) where moreover every run is contiguous in ``out`` and ``x``
    and the runs are multiples of 4 elements apart there. It runs on ``out``'s device, made current for it
    (:func:`launching_on`, inline: every draw)."""
    (seg_stride, elem_stride), (x_seg_stride, x_elem_stride) = strides, x_strides
    aligned = (
        runs_aligned
        and elem_stride == 1
        and (x is None or x_elem_stride == 1)  # unit element strides (_unit, inline: every launch)
        and (segments == 1 or (seg_stride % 4 == 0 and (x is None or x_seg_stride % 4 == 0)))
    )
    chunks, magic, shifts, options = _variant(args, run, aligned, segments == 1, starts is not None, mask is not None)
    if aligned:  # the row strides in fours of elements (any of one run: never used)
        seg_stride, x_seg_stride = (seg_stride // 4, x_seg_stride // 4) if segments > 1 else (0, 0)
    arguments = (
        out,
        out if x is None else x,
        out if mask is None else mask,
        out if starts is None else starts,
        run,
        chunks,
        magic,
        shifts,
        seg_stride,
        elem_stride,
        x_seg_stride,
        x_elem_stride,
        start // 4,
        start % 4,
        (key & _MASK32 ^ _SIGN32) - _SIGN32,  # _s32 of each half, inline (every launch)
        (key >> 32 & _MASK32 ^ _SIGN32) - _SIGN32,
        *args.words,
        *args.quads,
    )
    _start((segments * chunks,), arguments, options, out)


def _start(grid: tuple[int], arguments: tuple[Any, ...], options: dict[str, Any], out: torch.Tensor) -> None:
    """Launch the draw kernel on ``out``'s device (made current for the launch)."""
    interpreted = out.is_cpu
    launch = kernels(interpreted).draw_kernel[grid]
    if interpreted:  # CPU tensors: nothing to make current; the interpreter's patches undone after
        with language_restored(True):
            launch(*arguments, **options)
        return
    before = _made_current(out.device)
    try:
        launch(*arguments, **options)
    finally:
        if before is not None:
            platforms.current().set_device(before)


@functools.lru_cache(maxsize=1024)
def _one_run(
    args: Arguments, run: int, has_x: bool, has_mask: bool
) -> tuple[tuple[int], tuple[int, ...], tuple[int, ...], dict[str, Any]]:
    """The grid, the arguments from ``n_run`` to ``x_elem_stride``, the distribution's (``i0`` to ``q3``) and
    the options of :func:`fill_contiguous`'s launch: those :func:`_launch` computes for one run (``segments``
    1, unit element strides, ``ALIGNED`` where ``run`` is whole Philox blocks, row strides unused)."""
    aligned = run % 4 == 0
    chunks, magic, shifts, options = _variant(args, run, aligned, True, False, has_mask)
    seg_stride, x_seg_stride = (0, 0) if aligned else (run, run if has_x else 0)
    shape = (run, chunks, magic, shifts, seg_stride, 1, x_seg_stride, 1 if has_x else 0)
    return (chunks,), shape, args.words + args.quads, options


@functools.lru_cache(maxsize=1024)
def _variant(
    args: Arguments, run: int, aligned: bool, one_run: bool, has_starts: bool, has_mask: bool
) -> tuple[int, int, int, dict[str, Any]]:
    """A launch's programs a run, the signed magic number and shifts that divide a program's index by them
    (:func:`divisor`), and its compile-time arguments and options: built once per variant and run length
    (a launch only unpacks them)."""
    block, warps = _block(run, aligned)
    chunks = _chunks(run, block, aligned)
    magic, shifts = divisor(chunks)
    options = {
        "DIST": args.dist,
        "COMPUTE": args.compute,
        "ONE_RUN": one_run,
        "HAS_STARTS": has_starts,
        "HAS_MASK": has_mask,
        "ALIGNED": aligned,
        "BLOCK": block,
        "num_warps": warps,
        "enable_fp_fusion": False,  # a * b + c rounds twice, as the torch backend computes it
    }
    return chunks, _s32(magic), shifts, options


def dropout(args: Arguments, geometry: ShardGeometry, key: int, offset: int, x: torch.Tensor) -> torch.Tensor:
    """Fused dropout of ``x`` (the block ``geometry`` of the global tensor): the values, in one pass."""
    return fill(args, geometry, key, offset, torch.empty_like(x), x)


# -- the probe -----------------------------------------------------------------------------------
_PROBE_KEY = 2**48 + 7
_PROBES = (((3, 7), 2**32 + 1), ((4102,), 2**32 + 4))
"""The test draws (shape, offset) of :func:`same_draws`: one unaligned (an odd offset past the 32-bit
boundary of the counter, a run of 21), one aligned launch of whole blocks over several programs with a
second launch for its last 2 elements."""


def same_draws(device: torch.device) -> bool:
    """Whether the kernels' ``random_bits`` at :data:`_PROBES` on ``device`` (a 48-bit key) equal the torch
    backend's on the CPU: every launch path of a draw (unaligned, aligned, a split run) once.

    Raises:
        Whatever the launch raises (a kernel that does not build or run there).
    """
    from hyperrng import philox

    for shape, offset in _PROBES:
        out = torch.empty(shape, dtype=torch.int64, device=device)
        fill(arguments("random_bits", (), torch.int64), ShardGeometry.of(shape), _PROBE_KEY, offset, out)
        if not torch.equal(out.cpu(), philox.random_bits(shape, _PROBE_KEY, offset, backend="torch")):
            return False
    return True


def probe(device: torch.device) -> str | None:
    """``None`` if Triton serves ``device``: its driver targets that device type, and the test draws there
    (:func:`same_draws`) equal the torch backend's. Otherwise why not, in a few words."""
    try:
        import triton
    except ImportError:
        return "Triton is not installed"
    try:
        active = triton.runtime.driver.active.get_active_torch_device()
    except Exception as exc:  # no driver for this machine, a broken install: Triton cannot serve
        return f"Triton {triton.__version__} has no usable driver ({_gist(exc)})"
    kind = getattr(active, "type", str(active))
    if kind != device.type:
        return f"Triton {triton.__version__} targets {kind!r}, not {device.type!r}"
    try:
        same = same_draws(device)
    except Exception as exc:  # a kernel that does not build or run on this device
        return f"Triton {triton.__version__} failed a test draw on {device.type} ({_gist(exc)})"
    if not same:
        return f"Triton {triton.__version__} drew other numbers than the torch backend on {device.type}"
    return None


def _gist(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 120 else line[:117] + "..."


def grid_size(run: int, segments: int, aligned: bool = False) -> int:
    """Programs one launch starts for ``segments`` runs of ``run`` elements, ``aligned`` or not (for tests and docs)."""
    return segments * _chunks(run, _block(run, aligned)[0], aligned)
