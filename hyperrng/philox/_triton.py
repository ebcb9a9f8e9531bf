"""The Triton backend of :mod:`hyperrng.philox`: each draw is one fused kernel launch.

The kernels (:mod:`hyperrng.philox._triton_kernels`) compute the same words and the same
arithmetic as the torch backend (:mod:`hyperrng.philox._torch`), so their results are
bit-identical wherever the distribution is exact (bits, uniform, bernoulli, randint,
dropout); :func:`~hyperrng.philox.normal` agrees to a few ulp, its ``log``/``sin``/``cos``
being Triton's rather than the CPU's.

A draw writes its result straight into the destination: a contiguous tensor, or any tensor
that views as ``(runs, run length)`` with one stride per dimension (a transposed matrix, a
shard's rows). Other layouts are filled through a contiguous copy.

Triton is imported on first use, never by ``import hyperrng``. On CPU tensors the same
kernels run under Triton's interpreter (see :func:`kernels`): slow, and meant for tests.
Which backend serves a device is decided in :mod:`hyperrng.philox.backends`, which calls
:func:`probe` once per device type.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
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

__all__ = ["Arguments", "arguments", "fill", "dropout", "kernels", "launching_on", "load", "probe"]

_MASK32 = 0xFFFFFFFF
_MAX_BLOCK = 512
"""Philox blocks per program at most: 2,048 values, four per thread of four warps. A program
that covers a whole short run (a shard's row) takes fewer, rounded up to a power of two."""
_MIN_BLOCK = 16
_LOAD_LOCK = threading.Lock()
_INTERPRET = "TRITON_INTERPRET"

_DISTS = {"random_bits": 0, "uniform": 1, "bernoulli": 2, "normal": 3, "randint": 4, "dropout": 5}


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


def _halves(value: int) -> tuple[int, int]:
    """A non-negative ``value`` below ``2**62`` as its high and low 31-bit halves."""
    return value >> 31, value & 0x7FFFFFFF


def _bits64(value: float) -> int:
    """The int64 bit pattern of ``value`` as a float64."""
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


@dataclass(frozen=True)
class Arguments:
    """A distribution's kernel arguments: its code, compute dtype, 32-bit and 64-bit parameters."""

    dist: int
    compute: Any  # tl.float32 or tl.float64
    words: tuple[int, int]
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
    dist = _DISTS[name]
    words, quads = (0, 0), (0, 0, 0, 0)
    if name == "uniform":
        keep, unit, span, low = params
        words, quads = (_s32(int(keep)), 0), (_bits64(unit), _bits64(span), _bits64(low), 0)
    elif name in ("bernoulli", "dropout"):
        high, low = _halves(int(params[0]))
        words = (low, high)
        if name == "dropout":
            quads = (_bits64(params[1]), 0, 0, 0)
    elif name == "normal":
        shift, unit, two_pi, std, mean = params
        words, quads = (int(shift), 0), (_bits64(unit), _bits64(two_pi), _bits64(std), _bits64(mean))
    elif name == "randint":
        low, span = params
        quads = (int(low), int(span), 0, 0)
    return Arguments(dist, compute, words, quads)


def _block(run: int) -> tuple[int, int]:
    """Philox blocks per program for runs of ``run`` elements, and the warps that compute them."""
    block = min(_MAX_BLOCK, max(_MIN_BLOCK, 1 << max((run + 6) // 4 - 1, 0).bit_length()))
    return block, 4 if block >= 256 else (2 if block >= 64 else 1)


def _as_runs(t: torch.Tensor, segments: int, run: int) -> tuple[int, int] | None:
    """The strides of ``t`` seen as ``(segments, run)``, or ``None`` if one stride per dimension cannot do."""
    if t.numel() == 0:
        return (run, 1)
    try:
        view = t.view(segments, run)
    except RuntimeError:
        return None
    return view.stride(0), view.stride(1)


@contextlib.contextmanager
def language_restored(interpreted: bool) -> Iterator[None]:
    """Around a launch: where ``interpreted``, put back afterwards what Triton's interpreter patched in
    ``triton.language`` (its modules and the classes of its core module).

    Triton 3.6 restores its patches itself after each launch; earlier releases (3.5, torch 2.9's)
    leave the interpreter's stand-ins in place, and every later compile in the process, of these
    kernels or of torch.compile's, then fails ("Unsupported function referenced"). Where nothing
    was left patched this only compares (a few hundred attributes)."""
    if not interpreted:
        yield
        return
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
    p = platforms.current()
    if device.index is None or device.type != p.device_type:
        return contextlib.nullcontext()
    before = p.current_device()
    if before == device.index:
        return contextlib.nullcontext()
    return _current_device(p, device.index, before)


@contextlib.contextmanager
def _current_device(p: platforms.Platform, index: int, before: int) -> Any:
    p.set_device(index)
    try:
        yield
    finally:
        p.set_device(before)


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
    ``out`` (the block's shape), in one launch; return ``out``.

    For dropout ``x`` is the input (the block's shape) and ``mask``, if given, receives the keep
    mask (bool, ``out``'s layout). Arguments must be checked: nothing is validated here.
    """
    numel = out.numel()
    if numel == 0:
        return out
    segments, run = geometry.segments, geometry.run
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
    with launching_on(out.device):
        if geometry.segments > 1:  # the runs' global starts, from 0 (they include the block's first element)
            ids = torch.arange(segments, dtype=torch.int64, device=out.device)
            _launch(args, out, x, mask, geometry.segment_starts(ids), run, segments, strides, x_strides, key, offset)
        else:
            _launch(args, out, x, mask, None, run, segments, strides, x_strides, key, offset + geometry.first)
    return out


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
) -> None:
    """One launch over ``segments`` runs of ``run`` elements; run ``s`` starts at global index
    ``start + starts[s]`` (``start + s * run`` without ``starts``)."""
    block, warps = _block(run)
    chunks = -(-(run + 3) // (4 * block))
    interpreted = out.device.type == "cpu"
    module = kernels(interpreted)
    base_hi, base_lo = _halves(start // 4)
    with language_restored(interpreted):
        module.draw_kernel[(segments * chunks,)](
            out,
            out if x is None else x,
            out if mask is None else mask,
            out if starts is None else starts,
            run,
            chunks,
            strides[0],
            strides[1],
            x_strides[0],
            x_strides[1],
            base_lo,
            base_hi,
            start % 4,
            _s32(key),
            _s32(key >> 32),
            args.words[0],
            args.words[1],
            *args.quads,
            DIST=args.dist,
            COMPUTE=args.compute,
            HAS_STARTS=starts is not None,
            HAS_MASK=mask is not None,
            BLOCK=block,
            num_warps=warps,
            enable_fp_fusion=False,  # a * b + c rounds twice, as the torch backend computes it
        )


def dropout(args: Arguments, geometry: ShardGeometry, key: int, offset: int, x: torch.Tensor) -> torch.Tensor:
    """Fused dropout of ``x`` (the block ``geometry`` of the global tensor): the values, in one pass."""
    return fill(args, geometry, key, offset, torch.empty_like(x), x)


# -- the probe -----------------------------------------------------------------------------------
_PROBE_KEY = 2**48 + 7
_PROBE_OFFSET = 2**32 + 1  # not a multiple of 4, and past the 32-bit boundary of the counter
_PROBE_SHAPE = (3, 7)


def probe(device: torch.device, reference: torch.Tensor) -> str | None:
    """``None`` if Triton serves ``device``: its driver targets that device type, and a small draw
    there (odd offset past 2**32, a 48-bit key) equals ``reference``, the torch backend's
    ``random_bits(_PROBE_SHAPE, _PROBE_KEY, _PROBE_OFFSET)`` on the CPU. Otherwise why not, in a
    few words."""
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
        out = torch.empty(_PROBE_SHAPE, dtype=torch.int64, device=device)
        geometry = ShardGeometry.of(_PROBE_SHAPE)
        fill(arguments("random_bits", (), torch.int64), geometry, _PROBE_KEY, _PROBE_OFFSET, out)
        same = bool(torch.equal(out.cpu(), reference))
    except Exception as exc:  # a kernel that does not build or run on this device
        return f"Triton {triton.__version__} failed a test draw on {device.type} ({_gist(exc)})"
    if not same:
        return f"Triton {triton.__version__} drew other numbers than the torch backend on {device.type}"
    return None


def _gist(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 120 else line[:117] + "..."


def grid_size(run: int, segments: int) -> int:
    """Programs one launch starts for ``segments`` runs of ``run`` elements (for tests and docs)."""
    block, _ = _block(run)
    return segments * math.ceil((run + 3) / (4 * block))
