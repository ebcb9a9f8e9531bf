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
tensor, ``ONE_RUN``; a shard of a larger tensor has several). A program computes ``BLOCK``
consecutive Philox blocks of one run, interleaves their four lanes into ``4 * BLOCK``
consecutive elements (``BLOCK`` rows of four) and stores them with one contiguous (or evenly
strided) store; a run that starts in the middle of a block shifts that store left, masking
what falls outside the run. A program finds its positions once, as 64-bit scalars (its first
block, its first element's offsets); per element, the arithmetic is 32-bit but for one 64-bit
add per Philox counter.

**Aligned launches** (``ALIGNED``): where every run of the result (and of ``x``) is contiguous,
starts at a Philox block and is whole blocks long, and the runs lie multiples of 4 elements
apart, the four lanes of a block are four adjacent elements that one thread writes with one
vector store (Triton specialises on 16-byte aligned tensors). :func:`hyperrng.philox._triton.fill`
launches a long contiguous run that ends inside a block as two: its whole blocks aligned, its
last elements on their own. Other launches store element by element.

**Arguments.** Triton picks an integer argument's type from its value and compiles a variant
per type, so no value of a draw selects one: 32-bit words (key words, parameters ``i0`` to ``i2``)
arrive as their signed bit patterns (bitcast back to ``uint32``), and the 64-bit values (the first
Philox block ``base``, below ``2**62``, and the parameters ``q0`` to ``q3``, floating-point ones as
the bit pattern of a float64 that holds their exact value in the compute dtype) are declared
``int64``. Lengths and strides are the call's shape (one variant for those below ``2**31``).
Quotients by a number fixed for the launch (the programs per run, randint's span) are
Granlund-Montgomery multiplications: :func:`quotient`.
"""

import triton
import triton.language as tl
from triton.language import core as _core  # noqa: F401 -- see below

_SCALARS = [
    "n_run", "chunks", "chunk_magic", "chunk_shifts", "seg_stride", "elem_stride", "x_seg_stride", "x_elem_stride",
    "base", "lane0", "key_lo", "key_hi", "i0", "i1", "i2", "q0", "q1", "q2", "q3",
]  # fmt: skip


@triton.jit
def mul_wide(a, m: tl.constexpr):
    """``(high, low)`` 32-bit words of the 64-bit product ``m * a`` (uint32): one wide multiply, where
    ``umulhi`` and a wrapping ``*`` compile to two (the same words). The attention kernels call :func:`philox` too."""
    product = _core.mul(a.to(tl.uint64), m, sanitize_overflow=False)
    return (product >> 32).to(tl.uint32), product.to(tl.uint32)


@triton.jit
def philox(c0, c1, k0, k1):
    """The four words of the Philox4x32-10 blocks whose counter words 0 and 1 are ``c0`` and ``c1`` (uint32;
    words 2 and 3 zero), under the key words ``k0``, ``k1`` (uint32): ten rounds, multipliers ``0xD2511F53``
    and ``0xCD9E8D57``, key increments ``0x9E3779B9`` and ``0xBB67AE85`` (Salmon et al., SC'11).

    The constants are literals, as every value a kernel here uses: Triton compares each module-level
    constant a kernel names with its value at compile time on every launch, several microseconds a
    launch for a handful (``tests/philox/test_philox_triton.py`` holds the kernels to none)."""
    c2 = tl.full(c0.shape, 0, tl.uint32)
    c3 = tl.full(c0.shape, 0, tl.uint32)
    for _ in tl.static_range(10):
        hi0, lo0 = mul_wide(c0, 0xD2511F53)
        hi2, lo2 = mul_wide(c2, 0xCD9E8D57)
        c0 = hi2 ^ c1 ^ k0
        c2 = hi0 ^ c3 ^ k1
        c1 = lo2
        c3 = lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def lanes(w0, w1, w2, w3, BLOCK: tl.constexpr):
    """Four lane vectors as the ``(BLOCK, 4)`` rows of their blocks: ``w0[0], w1[0], w2[0], w3[0], w0[1], ...``
    in row-major order, the layout of the elements. ``join`` adds its new dimension last, so the pairs
    are (0, 2) and (1, 3): element ``[i, k, j]`` of the joined words is word ``2 * k + j`` of block ``i``.
    The four words of a block stay in the thread that computed them, and a row has only four contiguous
    elements, so that Triton stores a row with one vector store (not wider ones it would first gather
    through shared memory)."""
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [BLOCK, 4])


@triton.jit
def word(value):
    """A signed 32-bit argument as the uint32 with its bits."""
    return value.to(tl.int32).to(tl.uint32, bitcast=True)


@triton.jit
def quotient(a, magic, shifts):
    """``a // d`` of uint32 ``a`` for a divisor ``1 <= d <= 2**32`` fixed for the launch, by Granlund and
    Montgomery's multiplication (division by invariant integers, 1994): ``magic`` and ``shifts`` (uint32)
    as :func:`hyperrng.philox._triton.divisor` makes them, the first shift (0 or 1) in bit 0 of
    ``shifts`` and the second (0 to 31) above it. Exact for every ``a``; no shift reaches 32."""
    t = tl.umulhi(a, magic)
    return (t + ((a - t) >> (shifts & 1))) >> (shifts >> 1)


@triton.jit
def spaced(p, stride):
    """``p * stride`` as 64-bit offsets, for non-negative 32-bit ``p``; a 32-bit ``stride`` is non-negative (a torch
    stride), and both zero-extended make the product one 32-by-32-bit wide multiply."""
    if stride.dtype == tl.int32:
        offsets = (p.to(tl.uint64) * stride.to(tl.uint32, bitcast=True).to(tl.uint64)).to(tl.int64, bitcast=True)
    else:
        offsets = p.to(tl.int64) * stride
    return offsets


@triton.jit
def as_float(bits, COMPUTE: tl.constexpr):
    """The float64 whose bit pattern is ``bits`` (int64), in ``COMPUTE`` (exact: the value is one of it)."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True).to(COMPUTE)


@triton.jit
def rounded(values, dtype: tl.constexpr, NANS: tl.constexpr = False):
    """``values`` in ``dtype``, rounded to nearest, ties to even, as torch rounds.

    bfloat16 is rounded on the bits of the float32 value (add ``0x7FFF`` plus the lowest kept
    bit, keep the top half): exact on every device, where the interpreter's own conversion
    truncates. Where ``values`` may hold NaNs (``NANS``), those stay NaN.
    """
    if dtype.is_bf16():
        bits = values.to(tl.float32).to(tl.uint32, bitcast=True)
        top = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        if NANS:
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


@triton.jit
def sin_cos(t):
    """``sin(t)`` and ``cos(t)`` of float32 ``0 <= t < 2 pi`` (Box-Muller's angles), both from one reduction,
    within 1.6 ulp of the exact values (every angle checked, against 2 ulp for CUDA's ``sinf`` and ``cosf``).

    CUDA's polynomials for ``sinf`` and ``cosf``, without the slow path for huge arguments that an angle
    never takes: ``t = j * pi / 2 + r``, ``j`` the nearest integer (rounded by adding ``1.5 * 2**23``, whose
    low bits are then the quadrant) and ``r`` in ``[-pi / 4, pi / 4]`` by ``pi / 2`` in three parts of 21
    bits, so that each part times ``j <= 4`` is exact and the reduction rounds the same with or without
    fused multiply-adds (under the interpreter, without); then sine and cosine polynomials of ``r``,
    swapped and negated by quadrant.
    """
    big = 12582912.0  # 1.5 * 2**23: adding it rounds to an integer, kept in the low bits
    shifted = t * 0.636619772 + big  # t * 2 / pi
    quadrant = shifted.to(tl.uint32, bitcast=True)
    j = shifted - big
    r = tl.fma(j, -1.570796012878418, t)  # pi / 2 in three parts of 21 bits: 0x1.921fb0p+0,
    r = tl.fma(j, -3.139164164167596e-07, r)  # 0x1.5110b0p-22,
    r = tl.fma(j, -6.22337468017542e-14, r)  # 0x1.1846a0p-44 (2.5e-20 short of pi / 2)
    r2 = r * r
    s = tl.fma(tl.fma(-1.95152959e-4, r2, 8.33216087e-3), r2, -1.66666546e-1)
    s = tl.fma(s * r2, r, r)
    c = tl.fma(tl.fma(tl.fma(2.44331571e-5, r2, -1.38873163e-3), r2, 4.16666457e-2), r2, -0.5)
    c = tl.fma(c, r2, 1.0)
    odd = (quadrant & 1) != 0
    sine = tl.where(odd, c, s)
    cosine = tl.where(odd, s, c)
    sine = tl.where((quadrant & 2) != 0, -sine, sine)
    cosine = tl.where(((quadrant + 1) & 2) != 0, -cosine, cosine)
    return sine, cosine


@triton.jit
def finish(
    out_ptrs, x_ptrs, mask_ptrs, inside, words, i0, i1, i2, q0, q1, q2,
    DIST: tl.constexpr, COMPUTE: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    """Store the values of ``words`` (for ``"normal"``: the values themselves) at ``out_ptrs`` where ``inside``:
    the distribution's arithmetic, parameters as :func:`draw_kernel` names them."""
    dtype: tl.constexpr = out_ptrs.dtype.element_ty
    if DIST == "normal":
        tl.store(out_ptrs, rounded(words, dtype), mask=inside)
    elif DIST == "random_bits":
        tl.store(out_ptrs, words.to(tl.int64), mask=inside)
    elif DIST == "uniform":
        values = (words & word(i0)).to(COMPUTE) * as_float(q0, COMPUTE) + as_float(q1, COMPUTE)
        tl.store(out_ptrs, rounded(values, dtype), mask=inside)
    elif DIST == "uniform_from_zero":
        values = (words & word(i0)).to(COMPUTE) * as_float(q0, COMPUTE)
        tl.store(out_ptrs, rounded(values, dtype), mask=inside)
    elif DIST == "uniform_tiny":
        values = (words & word(i0)).to(COMPUTE) * as_float(q0, COMPUTE) * as_float(q1, COMPUTE) + as_float(q2, COMPUTE)
        tl.store(out_ptrs, rounded(values, dtype), mask=inside)
    elif DIST == "bernoulli":
        hits = (words <= word(i0)) & (i1 != 0)
        if dtype == tl.int1:
            tl.store(out_ptrs, hits, mask=inside)
        else:  # 1.0 and 0.0 (through float32: a bool converts to a half type bit by bit in the interpreter)
            tl.store(out_ptrs, tl.where(hits, 1.0, 0.0).to(dtype), mask=inside)
    elif DIST == "randint":
        rest = words - quotient(words, word(i0), word(i2)) * word(i1)  # word % span, in 32 bits
        if dtype.is_int() and dtype.primitive_bitwidth <= 32:  # the value fits dtype: 32-bit arithmetic
            values = q0.to(tl.int32) + rest.to(tl.int32, bitcast=True)
            tl.store(out_ptrs, values.to(dtype), mask=inside)
        else:
            values = q0.to(tl.int64) + rest.to(tl.int64)
            if dtype.is_fp16() or dtype.is_bf16():
                values = values.to(tl.float32)  # torch converts an integer to a half type through float32
            tl.store(out_ptrs, rounded(values, dtype), mask=inside)
    else:  # "dropout"
        kept = (words <= word(i0)) & (i1 != 0)
        x = tl.load(x_ptrs, mask=inside, other=0.0)
        scale = tl.where(kept, as_float(q0, COMPUTE), 0.0)
        tl.store(out_ptrs, rounded(x.to(COMPUTE) * scale, dtype, True), mask=inside)
        if HAS_MASK:
            tl.store(mask_ptrs, kept, mask=inside)


@triton.jit(do_not_specialize=_SCALARS)
def draw_kernel(
    out_ptr,
    x_ptr,
    mask_ptr,
    starts_ptr,
    n_run,
    chunks,
    chunk_magic,
    chunk_shifts,
    seg_stride,
    elem_stride,
    x_seg_stride,
    x_elem_stride,
    base: tl.int64,
    lane0,
    key_lo,
    key_hi,
    i0,
    i1,
    i2,
    q0: tl.int64,
    q1: tl.int64,
    q2: tl.int64,
    q3: tl.int64,
    DIST: tl.constexpr,
    COMPUTE: tl.constexpr,
    ONE_RUN: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Values of distribution ``DIST`` (its name, a string) for one chunk of one run (see the module docstring).

    Program ``p`` computes chunk ``p % chunks`` of run ``p // chunks`` (the quotient by ``chunk_magic``
    and ``chunk_shifts``, see :func:`quotient`; chunk ``p`` where the launch is ``ONE_RUN``). Run ``s``
    starts at global index ``4 * base + lane0 + rel``,
    where ``rel`` is ``starts[s]`` (``HAS_STARTS``) or ``s * n_run``; its element ``e`` goes to
    ``out + s * seg_stride + e * elem_stride``. ``ALIGNED`` launches have every ``lane0 + rel`` and
    ``n_run`` a multiple of 4, unit element strides, and the row strides ``seg_stride`` and
    ``x_seg_stride`` counted in fours of elements.
    ``i0`` to ``i2`` are 32-bit parameters, ``q0`` to ``q3`` 64-bit ones (floats as bit patterns);
    by ``DIST``:

    * ``"random_bits"``: the words, as int64.
    * ``"uniform"``: ``(word & i0) * q0 + q1`` in ``COMPUTE`` (``i0`` keeps the top bits,
      ``q0 = 2**-32 * (high - low)``, exact, ``q1 = low``), two roundings (launched without
      fused multiply-adds, as every kernel here).
    * ``"uniform_from_zero"``: uniform where ``low`` is 0 (either sign): ``(word & i0) * q0``; adding it to a
      value ``>= +0.0`` would change nothing.
    * ``"uniform_tiny"``: where ``2**-32 * (high - low)`` is not exact in ``COMPUTE`` (a span below
      ``2**-94`` in float32): ``(word & i0) * q0 * q1 + q2`` (``q0 = 2**-32``, ``q1 = high - low``,
      ``q2 = low``), three roundings.
    * ``"bernoulli"``: ``word < threshold`` as ``word <= i0 and i1 != 0`` in uint32 (``i0 = threshold - 1``;
      ``i1 = 0`` for the threshold 0, where nothing is below).
    * ``"normal"``: Box-Muller on word pairs (0, 1) and (2, 3): ``i0`` the shift to the top bits,
      ``q0`` their unit, ``q1`` 2 pi, ``q2`` std, ``q3`` mean.
    * ``"randint"``: ``q0 + word % span`` (``q0`` the low bound), the remainder in 32 bits: ``i1`` the span's
      low 32 bits (0 for ``2**32``), ``i0`` and ``i2`` its magic and shifts (:func:`quotient`); the sum
      in 32 bits for integer results of at most 32 bits (where it fits), else in 64.
    * ``"dropout"``: ``x * (word < threshold ? q0 : 0)`` in ``COMPUTE`` (the threshold as for
      bernoulli, ``q0`` the scale rounded to ``x``'s dtype), ``x`` read with its own strides;
      with ``HAS_MASK`` the keep mask too, stored with the result's strides.
    """
    pid = tl.program_id(0)
    if ONE_RUN:
        seg = 0
        chunk = pid
    else:
        run = quotient(pid.to(tl.uint32, bitcast=True), word(chunk_magic), word(chunk_shifts))
        chunk = pid - run.to(tl.int32, bitcast=True) * chunks
        seg = run.to(tl.int64)
    if HAS_STARTS:
        rel = tl.load(starts_ptr + seg)
    else:
        rel = seg * n_run
    start = rel + lane0
    if ALIGNED:
        shift = 0  # every start is a multiple of 4
    else:
        shift = start & 3
    # The program's first block and the run's element at its first lane (negative in a run's first
    # program where the run starts past lane 0), as 64-bit scalars; per element, the counter's add is
    # 64-bit, positions and offsets are 32-bit.
    block = base.to(tl.int64) + (start >> 2) + chunk.to(tl.int64) * BLOCK
    first = chunk.to(tl.int64) * (4 * BLOCK) - shift
    blocks = block + tl.arange(0, BLOCK).to(tl.int64)
    c0 = (blocks & 0xFFFFFFFF).to(tl.uint32)
    c1 = (blocks >> 32).to(tl.uint32)
    w0, w1, w2, w3 = philox(c0, c1, word(key_lo), word(key_hi))
    if DIST == "normal":
        unit = as_float(q0, COMPUTE)
        two_pi = as_float(q1, COMPUTE)
        ra, ta = box_muller(w0, w1, i0, unit, two_pi)
        rb, tb = box_muller(w2, w3, i0, unit, two_pi)
        if COMPUTE == tl.float64:
            sa, ca = tl.sin(ta), tl.cos(ta)
            sb, cb = tl.sin(tb), tl.cos(tb)
        else:
            sa, ca = sin_cos(ta)
            sb, cb = sin_cos(tb)
        z0 = ca * ra
        z1 = sa * ra
        z2 = cb * rb
        z3 = sb * rb
        words = lanes(z0, z1, z2, z3, BLOCK) * as_float(q2, COMPUTE) + as_float(q3, COMPUTE)
    else:
        words = lanes(w0, w1, w2, w3, BLOCK)
    p = tl.arange(0, BLOCK)[:, None] * 4 + tl.arange(0, 4)[None, :]  # the element of each word, from first
    left = n_run - first  # the run's elements from this program's first lane on
    if ALIGNED:
        # Offsets and the count multiples of 4 (strides in fours, whole blocks): one vector store per block.
        at = seg * seg_stride * 4 + first
        x_at = seg * x_seg_stride * 4 + first
        inside = p < tl.minimum(left >> 2, BLOCK).to(tl.int32) * 4
        finish(out_ptr + at + p, x_ptr + x_at + p, mask_ptr + at + p, inside, words, i0, i1, i2, q0, q1, q2,
               DIST, COMPUTE, HAS_MASK)  # fmt: skip
    else:
        inside = (p >= tl.maximum(-first, 0).to(tl.int32)) & (p < tl.minimum(left, 4 * BLOCK).to(tl.int32))
        at = seg * seg_stride + first * elem_stride
        x_at = seg * x_seg_stride + first * x_elem_stride
        finish(out_ptr + at + spaced(p, elem_stride), x_ptr + x_at + spaced(p, x_elem_stride),
               mask_ptr + at + spaced(p, elem_stride), inside, words, i0, i1, i2, q0, q1, q2,
               DIST, COMPUTE, HAS_MASK)  # fmt: skip
