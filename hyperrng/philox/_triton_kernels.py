"""Triton source of the portable distributions: Philox4x32-10 and each distribution on its words.

Imported only by :mod:`hyperrng.philox._triton`, which loads this file twice: as itself
(compiled kernels, for a device Triton serves) and once more with ``TRITON_INTERPRET=1`` set
while it is decorated (the same kernels run by Triton's interpreter on CPU tensors, which is
how the tests prove them bit-identical to the torch backend without a GPU). Nothing here
knows about torch. The kernels call Triton's builtins only, not the functions of its standard
library written with ``@triton.jit`` (``tl.interleave``, ``tl.zeros``): those were
decorated once, when Triton was imported, for one of the two modes. The module names
``triton.language.core`` (``_core``) so that the interpreter, which patches the modules a
kernel's globals name for the length of a launch, restores it afterwards: left patched, it
breaks the compiled kernels launched later in the same process.

**Counter layout** (the project's, see :mod:`hyperrng.philox`): global index ``j`` is lane
``j % 4`` of the Philox block whose 64-bit counter is ``j // 4``, low half in counter word 0,
high half in word 1, words 2 and 3 zero; the key is the 64-bit key, low word first.

**Work split.** The result is ``segments`` runs of ``n_run`` elements (one run for a whole
tensor; a shard of a larger tensor has several). A program computes ``BLOCK`` consecutive
Philox blocks of one run, interleaves their four lanes into ``4 * BLOCK`` consecutive
elements and stores them with one contiguous (or evenly strided) store; a run that starts
in the middle of a block shifts that store left, masking what falls outside the run.

**Arguments.** Every integer argument is passed in the range of a signed 32-bit int, so that
every call has the same argument types (Triton picks an integer argument's type from its value
and compiles a variant per type): key words as their signed bit patterns (bitcast back to
``uint32``), counts below ``2**62`` as two non-negative 31-bit halves (no sign to strip).
Floating-point parameters arrive as the int64 bit pattern of a float64 that holds their exact
value in the compute dtype.
"""

import triton
import triton.language as tl
from triton.language import core as _core  # noqa: F401 -- see below

PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)
PHILOX_ROUNDS = tl.constexpr(10)

BITS = tl.constexpr(0)
UNIFORM = tl.constexpr(1)
BERNOULLI = tl.constexpr(2)
NORMAL = tl.constexpr(3)
RANDINT = tl.constexpr(4)
DROPOUT = tl.constexpr(5)

_SCALARS = [
    "n_run", "chunks", "seg_stride", "elem_stride", "x_seg_stride", "x_elem_stride", "base_lo", "base_hi",
    "lane0", "key_lo", "key_hi", "i0", "i1", "q0", "q1", "q2", "q3",
]  # fmt: skip


@triton.jit
def philox(blocks, k0, k1):
    """The four words of the Philox4x32-10 blocks whose 64-bit counters are ``blocks`` (int64),
    under the key words ``k0``, ``k1`` (uint32)."""
    c0 = (blocks & 0xFFFFFFFF).to(tl.uint32)
    c1 = (blocks >> 32).to(tl.uint32)
    c2 = tl.full(c0.shape, 0, tl.uint32)
    c3 = tl.full(c0.shape, 0, tl.uint32)
    for _ in tl.static_range(PHILOX_ROUNDS):
        a0 = c0
        a2 = c2
        c0 = tl.umulhi(a2, PHILOX_M1) ^ c1 ^ k0
        c2 = tl.umulhi(a0, PHILOX_M0) ^ c3 ^ k1
        c1 = a2 * PHILOX_M1
        c3 = a0 * PHILOX_M0
        k0 = k0 + PHILOX_W0
        k1 = k1 + PHILOX_W1
    return c0, c1, c2, c3


@triton.jit
def lanes(w0, w1, w2, w3, BLOCK: tl.constexpr):
    """Four lane vectors interleaved into block order: ``w0[0], w1[0], w2[0], w3[0], w0[1], ...``,
    one contiguous vector to store. ``join`` adds its new dimension last, so the pairs are (0, 2)
    and (1, 3): element ``[i, k, j]`` of the result is word ``2 * k + j`` of block ``i``."""
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [4 * BLOCK])


@triton.jit
def joined(high, low):
    """The int64 ``high * 2**31 + low`` of two non-negative 31-bit halves."""
    return (high.to(tl.int64) << 31) | low.to(tl.int64)


@triton.jit
def as_float(bits, COMPUTE: tl.constexpr):
    """The float64 whose bit pattern is ``bits`` (int64), in ``COMPUTE`` (exact: the value is one of it)."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True).to(COMPUTE)


@triton.jit
def rounded(values, dtype: tl.constexpr):
    """``values`` in ``dtype``, rounded to nearest, ties to even, as torch rounds.

    bfloat16 is rounded on the bits of the float32 value (add ``0x7FFF`` plus the lowest kept
    bit, keep the top half; NaNs stay NaN): exact on every device, where the interpreter's own
    conversion truncates.
    """
    if dtype.is_bf16():
        bits = values.to(tl.float32).to(tl.uint32, bitcast=True)
        top = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        top = tl.where(values != values, 0x7FC0, top)  # NaN: the quiet NaN, not whatever the carry made
        return top.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return values.to(dtype)


@triton.jit
def box_muller(w_radius, w_angle, shift, unit, two_pi):
    """``r`` and ``t`` of Box-Muller, as the torch backend computes them (``u1`` in ``(0, 1]``)."""
    u1 = ((w_radius >> shift) + 1).to(unit.dtype) * unit
    u2 = (w_angle >> shift).to(unit.dtype) * unit
    if unit.dtype == tl.float64:
        radius = tl.sqrt(tl.log(u1) * -2.0)  # correctly rounded in double precision
    else:
        radius = tl.sqrt_rn(tl.log(u1) * -2.0)  # the correctly rounded one, not the fast approximation
    return radius, u2 * two_pi


@triton.jit(do_not_specialize=_SCALARS)
def draw_kernel(
    out_ptr,
    x_ptr,
    mask_ptr,
    starts_ptr,
    n_run,
    chunks,
    seg_stride,
    elem_stride,
    x_seg_stride,
    x_elem_stride,
    base_lo,
    base_hi,
    lane0,
    key_lo,
    key_hi,
    i0,
    i1,
    q0,
    q1,
    q2,
    q3,
    DIST: tl.constexpr,
    COMPUTE: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Values of distribution ``DIST`` for one chunk of one run (see the module docstring).

    Run ``s`` starts at global index ``4 * base + lane0 + rel`` (``base`` in 31-bit halves), where ``rel`` is
    ``starts[s]`` (``HAS_STARTS``) or ``s * n_run``; its element ``e`` goes to
    ``out + s * seg_stride + e * elem_stride``. Parameters by ``DIST``:

    * BITS: the words, as int64.
    ``i0`` and ``i1`` are 32-bit parameters, ``q0`` to ``q3`` 64-bit ones (floats as bit patterns):

    * BITS: the words, as int64.
    * UNIFORM: ``(word & i0) * q0 * q1 + q2`` in ``COMPUTE`` (``i0`` keeps the top bits,
      ``q0 = 2**-32``, ``q1 = high - low``, ``q2 = low``), two roundings (launched without
      fused multiply-adds, as every kernel here).
    * BERNOULLI: ``word < threshold``, the threshold (up to ``2**32``) as 31-bit halves ``i1``, ``i0``.
    * NORMAL: Box-Muller on word pairs (0, 1) and (2, 3): ``i0`` the shift to the top bits,
      ``q0`` their unit, ``q1`` 2 pi, ``q2`` std, ``q3`` mean.
    * RANDINT: ``q0 + word % q1`` (low and span, int64).
    * DROPOUT: ``x * (word < threshold ? q0 : 0)`` in ``COMPUTE`` (the threshold as for
      BERNOULLI, ``q0`` the scale rounded to ``x``'s dtype), ``x`` read with its own strides;
      with ``HAS_MASK`` the keep mask too, stored with the result's strides.
    """
    pid = tl.program_id(0).to(tl.int64)
    seg = pid // chunks
    chunk = pid - seg * chunks
    if HAS_STARTS:
        rel = tl.load(starts_ptr + seg)
    else:
        rel = seg * n_run
    start = rel + lane0
    blocks = joined(base_hi, base_lo) + start // 4 + chunk * BLOCK + tl.arange(0, BLOCK)
    w0, w1, w2, w3 = philox(blocks, key_lo.to(tl.uint32, bitcast=True), key_hi.to(tl.uint32, bitcast=True))
    pos = chunk * (4 * BLOCK) - start % 4 + tl.arange(0, 4 * BLOCK)
    inside = (pos >= 0) & (pos < n_run)
    where = seg * seg_stride + pos * elem_stride
    threshold = joined(i1, i0)
    if DIST == NORMAL:
        unit = as_float(q0, COMPUTE)
        two_pi = as_float(q1, COMPUTE)
        std = as_float(q2, COMPUTE)
        mean = as_float(q3, COMPUTE)
        ra, ta = box_muller(w0, w1, i0, unit, two_pi)
        rb, tb = box_muller(w2, w3, i0, unit, two_pi)
        z0 = tl.cos(ta) * ra
        z1 = tl.sin(ta) * ra
        z2 = tl.cos(tb) * rb
        z3 = tl.sin(tb) * rb
        values = lanes(z0, z1, z2, z3, BLOCK) * std + mean
        tl.store(out_ptr + where, rounded(values, out_ptr.dtype.element_ty), mask=inside)
    else:
        words = lanes(w0, w1, w2, w3, BLOCK)
        if DIST == BITS:
            tl.store(out_ptr + where, words.to(tl.int64), mask=inside)
        elif DIST == UNIFORM:
            keep = (words & i0.to(tl.uint32, bitcast=True)).to(COMPUTE)
            values = keep * as_float(q0, COMPUTE) * as_float(q1, COMPUTE) + as_float(q2, COMPUTE)
            tl.store(out_ptr + where, rounded(values, out_ptr.dtype.element_ty), mask=inside)
        elif DIST == BERNOULLI:
            hits = words.to(tl.int64) < threshold
            if out_ptr.dtype.element_ty == tl.int1:
                tl.store(out_ptr + where, hits, mask=inside)
            else:  # 1.0 and 0.0 (through float32: a bool converts to a half type bit by bit in the interpreter)
                tl.store(out_ptr + where, tl.where(hits, 1.0, 0.0).to(out_ptr.dtype.element_ty), mask=inside)
        elif DIST == RANDINT:
            values = words.to(tl.int64) % q1.to(tl.int64) + q0.to(tl.int64)
            if out_ptr.dtype.element_ty.is_fp16() or out_ptr.dtype.element_ty.is_bf16():
                values = values.to(tl.float32)  # torch converts an integer to a half type through float32
            tl.store(out_ptr + where, rounded(values, out_ptr.dtype.element_ty), mask=inside)
        else:  # DROPOUT
            kept = words.to(tl.int64) < threshold
            x = tl.load(x_ptr + seg * x_seg_stride + pos * x_elem_stride, mask=inside, other=0.0)
            scale = tl.where(kept, as_float(q0, COMPUTE), 0.0)
            tl.store(out_ptr + where, rounded(x.to(COMPUTE) * scale, out_ptr.dtype.element_ty), mask=inside)
            if HAS_MASK:
                tl.store(mask_ptr + where, kept, mask=inside)
