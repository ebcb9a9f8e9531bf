"""Triton kernels of portable attention: flash attention with the portable dropout mask, forward and
backward, launched by :mod:`hyperrng.philox._triton_attention`, which loads this module in its own mode
(Triton compiles or interprets a kernel according to ``TRITON_INTERPRET`` when it is decorated, so one
module object is one or the other: :func:`hyperrng.philox._triton.load`).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language import core as _core  # noqa: F401 -- see below

from hyperrng.philox import _triton as _loader

# The Philox rounds are the draw kernels' own, from the copy loaded in this copy's mode.
_philox = _loader.load("hyperrng.philox._triton_kernels", triton.knobs.runtime.interpret).philox
# Constants are literals (0xFFFFFFFF: the low 32 bits; 1.4426950408889634: log2(e)), not module-level names:
# Triton compares each module-level constant a kernel names with its compile-time value on every launch.

# Under the interpreter three things differ from the compiled code, each where marked: Triton's library
# reductions are decorated again for the interpreter, runtime loop bounds become Python ints (_bound), and
# bfloat16 dot operands are converted to float32 first (UPCAST in _dot; exact), because the interpreter's
# bfloat16 dot is wrong. Everything else, the Philox rounds and the mask included, is the code a GPU compiles.
if triton.knobs.runtime.interpret:
    # Triton's library functions (tl.sum, ...) are jit functions decorated when triton.language was imported,
    # for compiling unless TRITON_INTERPRET was set then; the interpreter cannot call those. This copy
    # decorates their Python bodies again, for the interpreter. Their module names triton.language.core,
    # which the interpreter then patches for each call and never puts back; the kernels here see it too
    # (_core above), so that the interpreter patches it for the whole launch and restores it after:
    # otherwise a later compile in the same process would meet the interpreter's stand-ins.
    _sum, _max = (triton.jit(f.fn) for f in (tl.sum, tl.max))

    def _bound(x: object) -> int:
        """A runtime loop bound as a Python int, in Triton's interpreter: it holds a kernel's scalars as
        one-element arrays and its ``range`` calls ``int()`` on them, which NumPy 2.4 refuses (Triton 3.6)."""
        return x if isinstance(x, int) else int(x.handle.data.item())  # type: ignore[attr-defined]

else:
    _sum, _max = tl.sum, tl.max

    @triton.jit
    def _bound(x):
        """A runtime loop bound (the identity; the interpreter needs a conversion, above)."""
        return x


@triton.jit
def _row_geometry(offs_m, b, h, ob, ol, b_start, h_start, row_start, H_g, L_g, S):
    """Block index and lane (int64) of column 0 of the rows ``offs_m`` of head ``(b, h)`` of this block.

    Tensors arrive as 4-D views ``(B, H, rows, cols)`` with any strides (0 where broadcast); query head
    ``h`` reads key/value head ``h // group``. The probability element ``(b, h, i, j)`` of this block has
    the global index ``4 * ob + ol + ((b_start + b) * H_g + h_start + h) * L_g * S + (row_start + i) * S + j``:
    ``ob`` and ``ol`` split the 64-bit offset (``offset // 4`` and ``offset % 4``) so that every quantity
    fits ``int64``. Its word is lane ``index % 4`` of Philox4x32-10 at counter ``index // 4`` (words 0 and
    1, low half first; words 2 and 3 zero) under the 64-bit key, low word first:
    :func:`hyperrng.philox.random_bits`.
    """
    head = (b_start + b).to(tl.int64) * H_g + (h_start + h)
    rel = (head * L_g + row_start + offs_m) * S + ol
    return ob + rel // 4, rel % 4


@triton.jit
def _keep(row_block, row_lane, start_n, thr, k0, k1, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          ALIGNED: tl.constexpr):  # fmt: skip
    """The keep mask ``[BLOCK_M, BLOCK_N]`` of the columns ``start_n + arange(BLOCK_N)`` of rows whose
    column 0 lies in Philox block ``row_block`` at lane ``row_lane`` (int64).

    The element is kept where ``word <= thr`` (``thr = round((1 - p) * 2**32) - 1``), and kept
    probabilities are scaled by ``drop_scale`` (the caller passes 0 where that threshold is 0 and nothing
    is kept). When every row of the block starts at a multiple of 4 (``ALIGNED``: ``ol == 0`` and
    ``S % 4 == 0``) a tile computes one Philox block per four columns and interleaves the lanes; otherwise
    each element computes its own block and picks its lane (four times the Philox work, any offset and
    shape).
    """
    if ALIGNED:
        # Row starts are multiples of 4 (row_lane == 0) and so is start_n: one block per four columns,
        # the lanes put back in column order (w0[0], w1[0], w2[0], w3[0], w0[1], ...) as one tensor.
        blocks = row_block[:, None] + (start_n // 4 + tl.arange(0, BLOCK_N // 4))[None, :]
    else:
        t = row_lane[:, None] + (start_n + tl.arange(0, BLOCK_N))[None, :]
        blocks = row_block[:, None] + t // 4
    w0, w1, w2, w3 = _philox((blocks & 0xFFFFFFFF).to(tl.uint32), (blocks >> 32).to(tl.uint32), k0, k1)
    if ALIGNED:
        words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK_M, BLOCK_N))
    else:
        lane = t % 4
        words = tl.where(lane == 0, w0, tl.where(lane == 1, w1, tl.where(lane == 2, w2, w3)))
    return words <= thr


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` in float32: IEEE float32 products for float32 inputs (torch's default, no TF32);
    ``UPCAST`` converts bfloat16 operands to float32 first (exactly), for Triton's interpreter, whose
    bfloat16 dot is wrong."""
    if UPCAST:
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        result = tl.dot(a, b, acc, input_precision="ieee")
    else:
        result = tl.dot(a, b, acc)
    return result


@triton.jit
def _scores(q, k, Bias_head, sbm, sbn, offs_m, offs_n, row_ok, col_ok, row_start, qk_scale,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_COLS: tl.constexpr, MASK_DIAGONAL: tl.constexpr,
            HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """Scores ``[BLOCK_M, BLOCK_N]`` in base 2 (``log2(e) * (q k^T * scale + bias)``), ``-inf`` where masked:
    by the bias, beyond ``S`` (``MASK_COLS``: where ``col_ok`` is False) or above the causal diagonal of the
    global rows (``MASK_DIAGONAL``). A block that needs neither mask leaves them out; the bias is read only
    where ``row_ok`` and ``col_ok`` hold."""
    s = _dot(q, tl.trans(k), tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32), IEEE, UPCAST)
    s = s * qk_scale
    if HAS_BIAS:
        bias = tl.load(
            Bias_head + offs_m[:, None] * sbm + offs_n[None, :] * sbn,
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        s += bias.to(tl.float32) * 1.4426950408889634
    if MASK_COLS:
        valid = col_ok[None, :]
        if MASK_DIAGONAL:
            valid = valid & (offs_n[None, :] <= row_start + offs_m[:, None])
        s = tl.where(valid, s, float("-inf"))
    elif MASK_DIAGONAL:
        s = tl.where(offs_n[None, :] <= row_start + offs_m[:, None], s, float("-inf"))
    return s


@triton.jit
def _fwd_block(
    acc, l_i, m_i, q, K_head, V_head, Bias_head, start_n, offs_m, offs_d, row_ok,
    skn, skd, svn, svd, sbm, sbn, S, row_start, qk_scale, drop_rows, drop_lanes, threshold, key0, key1,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, ALIGNED: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """The online-softmax step of the key block at ``start_n``: ``(acc, l_i, m_i)`` updated. ``MASKED``: the
    block may reach beyond ``S`` or above the causal diagonal (masks applied); otherwise it lies wholly
    inside ``S`` and, when causal, below the diagonal, where every mask is all True and is left out."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    col_ok = offs_n < S
    if MASKED:
        k = tl.load(K_head + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=col_ok[:, None], other=0.0)
        s = _scores(q, k, Bias_head, sbm, sbn, offs_m, offs_n, row_ok, col_ok, row_start, qk_scale,
                    BLOCK_M, BLOCK_N, True, CAUSAL, HAS_BIAS, IEEE, UPCAST)  # fmt: skip
    else:
        k = tl.load(K_head + offs_n[:, None] * skn + offs_d[None, :] * skd)
        s = _scores(q, k, Bias_head, sbm, sbn, offs_m, offs_n, row_ok, col_ok, row_start, qk_scale,
                    BLOCK_M, BLOCK_N, False, False, HAS_BIAS, IEEE, UPCAST)  # fmt: skip
    m_new = tl.maximum(m_i, _max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row masked so far: everything is 0
    p = tl.math.exp2(s - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + _sum(p, 1)
    if DROPOUT:
        p = tl.where(_keep(drop_rows, drop_lanes, start_n, threshold, key0, key1, BLOCK_M, BLOCK_N, ALIGNED), p, 0.0)
    if MASKED:
        v = tl.load(V_head + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=col_ok[:, None], other=0.0)
    else:
        v = tl.load(V_head + offs_n[:, None] * svn + offs_d[None, :] * svd)
    acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE, UPCAST)
    return acc, l_i, m_new


@triton.jit
def _key_blocks(S, row_start, pid_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """``(mid, hi)`` of the key loop of query block ``pid_m``: the blocks at ``[0, mid)`` lie wholly inside
    ``S`` and (causal) below the diagonal, those at ``[mid, hi)`` need masks; ``mid`` is a multiple of
    ``BLOCK_N``, so the two loops visit the blocks of ``range(0, hi, BLOCK_N)`` in its order.

    Masks only where a block needs them: the forward and dq visit first the key blocks wholly inside ``S``
    and (causal) wholly below the diagonal, without masks, then those that cross the diagonal or ``S``,
    masked; dk/dv visit first the query blocks that cross the diagonal, masked, then those below it
    (:func:`_attn_bwd_dkdv`). Both loops together visit the blocks of the single masked loop they replace,
    in its order, with the same arithmetic: the results are the same bits.
    """
    if CAUSAL:
        first = row_start + pid_m * BLOCK_M  # the global index of the block's first row
        hi = tl.minimum(S, first + BLOCK_M)  # columns beyond the last row's diagonal are all masked
        mid = tl.minimum(first + 1, S) // BLOCK_N * BLOCK_N  # every row sees the columns up to first
    else:
        hi = S
        mid = S // BLOCK_N * BLOCK_N
    return mid, hi


@triton.jit(do_not_specialize=["thr", "k0", "k1", "ob_lo", "ob_hi", "ol", "b_start", "h_start", "row_start"])
def _attn_fwd(
    Q, K, V, Bias, Out, Lse,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sbb, sbh, sbm, sbn, sob, soh, som, sod,
    H, L, S, GROUP, sm_scale, drop_scale,
    thr, k0, k1, ob_lo, ob_hi, ol, b_start, h_start, row_start, H_g, L_g,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, ALIGNED: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """One program: ``BLOCK_M`` query rows of head ``(b, h)``, online softmax over all key blocks (first
    those that need no mask, then those that do: :func:`_key_blocks`).

    The softmax runs in base 2 (``exp2``, scores scaled by ``log2(e)``); the per-row ``lse`` stored for the
    backward is ``log2`` of the row's sum of ``2**score``, ``+inf`` for a row with nothing to attend to (so
    the backward's probabilities are 0 there, as torch's math path gives).
    """
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < L
    bi = b.to(tl.int64)
    q = tl.load(
        Q + bi * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
        mask=row_ok[:, None],
        other=0.0,
    )
    K_head = K + bi * skb + hk.to(tl.int64) * skh
    V_head = V + bi * svb + hk.to(tl.int64) * svh
    Bias_head = Bias + bi * sbb + h.to(tl.int64) * sbh
    if DROPOUT:
        key0 = k0.to(tl.uint32, bitcast=True)
        key1 = k1.to(tl.uint32, bitcast=True)
        threshold = thr.to(tl.uint32, bitcast=True)
        ob = (ob_hi.to(tl.int64) << 32) | (ob_lo.to(tl.int64) & 0xFFFFFFFF)
        row_block, row_lane = _row_geometry(offs_m, b, h, ob, ol, b_start, h_start, row_start, H_g, L_g, S)
    else:
        key0, key1, threshold, row_block, row_lane = 0, 0, 0, 0, 0  # unused
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)
    mid, hi = _key_blocks(S, row_start, pid_m, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(0, _bound(mid), BLOCK_N):
        acc, l_i, m_i = _fwd_block(
            acc, l_i, m_i, q, K_head, V_head, Bias_head, start_n, offs_m, offs_d, row_ok,
            skn, skd, svn, svd, sbm, sbn, S, row_start, qk_scale, row_block, row_lane, threshold, key0, key1,
            BLOCK_M, BLOCK_N, False, CAUSAL, HAS_BIAS, DROPOUT, ALIGNED, IEEE, UPCAST,
        )  # fmt: skip
    for start_n in range(_bound(mid), _bound(hi), BLOCK_N):
        acc, l_i, m_i = _fwd_block(
            acc, l_i, m_i, q, K_head, V_head, Bias_head, start_n, offs_m, offs_d, row_ok,
            skn, skd, svn, svd, sbm, sbn, S, row_start, qk_scale, row_block, row_lane, threshold, key0, key1,
            BLOCK_M, BLOCK_N, True, CAUSAL, HAS_BIAS, DROPOUT, ALIGNED, IEEE, UPCAST,
        )  # fmt: skip
    attended = l_i > 0.0
    total = tl.where(attended, l_i, 1.0)
    out = acc * (drop_scale / total)[:, None]
    lse = tl.where(attended, m_i + tl.math.log2(total), float("inf"))
    tl.store(
        Out + bi * sob + h.to(tl.int64) * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None],
    )
    tl.store(Lse + (bi * H + h) * L + offs_m, lse, mask=row_ok)


@triton.jit
def _attn_bwd_delta(
    Out, dOut, Delta, sob, soh, som, sod, sgb, sgh, sgm, sgd, H, L,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """``Delta[b, h, i] = sum_d out * d_out`` in float32: the row term of the softmax gradient."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1)
    b = tl.program_id(2)
    bi = b.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < L
    o = tl.load(
        Out + bi * sob + h.to(tl.int64) * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
        mask=row_ok[:, None],
        other=0.0,
    )
    do = tl.load(
        dOut + bi * sgb + h.to(tl.int64) * sgh + offs_m[:, None] * sgm + offs_d[None, :] * sgd,
        mask=row_ok[:, None],
        other=0.0,
    )
    tl.store(Delta + (bi * H + h) * L + offs_m, _sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=row_ok)


@triton.jit
def _dkdv_block(
    dk, dv, k, v, Q_head, G_head, Bias_head, Lse, Delta, rows, start_m, offs_n, offs_d, col_ok,
    sqm, sqd, sgm, sgd, sbm, sbn, L, row_start, qk_scale, drop_scale, ob, ol, b, h, b_start, h_start, H_g, L_g, S,
    threshold, key0, key1, column0,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr, ALIGNED: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """``(dk, dv)`` plus the query block at ``start_m``. ``MASKED``: the block crosses the causal diagonal
    of these keys (masked above it); otherwise every row sees every key. Keys beyond ``S`` are never
    masked: a key's gradient rows take only its own column of the scores, and theirs are not stored."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < L
    q = tl.load(Q_head + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=row_ok[:, None], other=0.0)
    do = tl.load(G_head + offs_m[:, None] * sgm + offs_d[None, :] * sgd, mask=row_ok[:, None], other=0.0)
    lse = tl.load(Lse + rows + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + rows + offs_m, mask=row_ok, other=0.0)
    s = _scores(q, k, Bias_head, sbm, sbn, offs_m, offs_n, row_ok, col_ok, row_start, qk_scale,
                BLOCK_M, BLOCK_N, False, MASKED, HAS_BIAS, IEEE, UPCAST)  # fmt: skip
    p = tl.math.exp2(s - lse[:, None])
    dpd = _dot(do, tl.trans(v), tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32), IEEE, UPCAST)
    if DROPOUT:
        row_block, row_lane = _row_geometry(offs_m, b, h, ob, ol, b_start, h_start, row_start, H_g, L_g, S)
        keep = _keep(row_block, row_lane, column0, threshold, key0, key1, BLOCK_M, BLOCK_N, ALIGNED)
        pd = tl.where(keep, p * drop_scale, 0.0)
        dp = tl.where(keep, dpd * drop_scale, 0.0)
    else:
        pd = p
        dp = dpd
    dv = _dot(tl.trans(pd.to(do.dtype)), do, dv, IEEE, UPCAST)
    ds = p * (dp - delta[:, None])
    dk = _dot(tl.trans(ds.to(q.dtype)), q, dk, IEEE, UPCAST)
    return dk, dv


@triton.jit(do_not_specialize=["thr", "k0", "k1", "ob_lo", "ob_hi", "ol", "b_start", "h_start", "row_start"])
def _attn_bwd_dkdv(
    Q, K, V, Bias, dOut, Lse, Delta, dK, dV,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sbb, sbh, sbm, sbn, sgb, sgh, sgm, sgd,
    H, L, S, GROUP, sm_scale, drop_scale,
    thr, k0, k1, ob_lo, ob_hi, ol, b_start, h_start, row_start, H_g, L_g,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, ALIGNED: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """One program: ``BLOCK_N`` keys of key/value head ``(b, hk)``; gradients summed over the query heads
    of its group and all query blocks that see them. ``dK``/``dV`` are contiguous ``(B, H // GROUP, S, D)``."""
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    bi = b.to(tl.int64)
    column0 = pid_n * BLOCK_N
    offs_n = column0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < S
    k = tl.load(
        K + bi * skb + hk.to(tl.int64) * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
        mask=col_ok[:, None],
        other=0.0,
    )
    v = tl.load(
        V + bi * svb + hk.to(tl.int64) * svh + offs_n[:, None] * svn + offs_d[None, :] * svd,
        mask=col_ok[:, None],
        other=0.0,
    )
    if DROPOUT:
        key0 = k0.to(tl.uint32, bitcast=True)
        key1 = k1.to(tl.uint32, bitcast=True)
        threshold = thr.to(tl.uint32, bitcast=True)
        ob = (ob_hi.to(tl.int64) << 32) | (ob_lo.to(tl.int64) & 0xFFFFFFFF)
    else:
        key0, key1, threshold, ob = 0, 0, 0, 0  # unused
    qk_scale = sm_scale * 1.4426950408889634
    dk = tl.full([BLOCK_N, HEAD_DIM], 0.0, tl.float32)
    dv = tl.full([BLOCK_N, HEAD_DIM], 0.0, tl.float32)
    lo = 0
    mid = 0
    if CAUSAL:
        # Global row row_start + i sees column j iff j <= row_start + i: query blocks before lo (the first
        # that sees this block's first column) contribute nothing, those in [lo, mid) cross the diagonal
        # (mid: the first whose first row sees the block's last column), those from mid see every column.
        # Both are multiples of BLOCK_M: the loops visit the blocks of range(lo, L, BLOCK_M) in its order.
        lo = tl.maximum(column0 - row_start, 0) // BLOCK_M * BLOCK_M
        mid = (tl.maximum(column0 + BLOCK_N - 1 - row_start, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    for g in range(0, _bound(GROUP)):
        h = hk * GROUP + g
        hi64 = h.to(tl.int64)
        Q_head = Q + bi * sqb + hi64 * sqh
        G_head = dOut + bi * sgb + hi64 * sgh
        Bias_head = Bias + bi * sbb + hi64 * sbh
        rows = (bi * H + h) * L
        if CAUSAL:
            for start_m in range(_bound(lo), _bound(tl.minimum(mid, L)), BLOCK_M):
                dk, dv = _dkdv_block(
                    dk, dv, k, v, Q_head, G_head, Bias_head, Lse, Delta, rows, start_m, offs_n, offs_d, col_ok,
                    sqm, sqd, sgm, sgd, sbm, sbn, L, row_start, qk_scale, drop_scale, ob, ol, b, h, b_start, h_start,
                    H_g, L_g, S, threshold, key0, key1, column0,
                    BLOCK_M, BLOCK_N, True, HAS_BIAS, DROPOUT, ALIGNED, IEEE, UPCAST,
                )  # fmt: skip
        for start_m in range(_bound(mid), _bound(L), BLOCK_M):
            dk, dv = _dkdv_block(
                dk, dv, k, v, Q_head, G_head, Bias_head, Lse, Delta, rows, start_m, offs_n, offs_d, col_ok,
                sqm, sqd, sgm, sgd, sbm, sbn, L, row_start, qk_scale, drop_scale, ob, ol, b, h, b_start, h_start,
                H_g, L_g, S, threshold, key0, key1, column0,
                BLOCK_M, BLOCK_N, False, HAS_BIAS, DROPOUT, ALIGNED, IEEE, UPCAST,
            )  # fmt: skip
    out = (bi * (H // GROUP) + hk) * S * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(dK + out, (dk * sm_scale).to(dK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dV + out, dv.to(dV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _dq_block(
    dq, q, do, lse, delta, K_head, V_head, Bias_head, start_n, offs_m, offs_d, row_ok,
    skn, skd, svn, svd, sbm, sbn, S, row_start, qk_scale, drop_scale, drop_rows, drop_lanes, threshold, key0, key1,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, ALIGNED: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """``dq`` plus the key block at ``start_n``; ``MASKED`` as in :func:`_fwd_block`."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    col_ok = offs_n < S
    if MASKED:
        k = tl.load(K_head + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=col_ok[:, None], other=0.0)
        v = tl.load(V_head + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=col_ok[:, None], other=0.0)
        s = _scores(q, k, Bias_head, sbm, sbn, offs_m, offs_n, row_ok, col_ok, row_start, qk_scale,
                    BLOCK_M, BLOCK_N, True, CAUSAL, HAS_BIAS, IEEE, UPCAST)  # fmt: skip
    else:
        k = tl.load(K_head + offs_n[:, None] * skn + offs_d[None, :] * skd)
        v = tl.load(V_head + offs_n[:, None] * svn + offs_d[None, :] * svd)
        s = _scores(q, k, Bias_head, sbm, sbn, offs_m, offs_n, row_ok, col_ok, row_start, qk_scale,
                    BLOCK_M, BLOCK_N, False, False, HAS_BIAS, IEEE, UPCAST)  # fmt: skip
    p = tl.math.exp2(s - lse[:, None])
    dp = _dot(do, tl.trans(v), tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32), IEEE, UPCAST)
    if DROPOUT:
        keep = _keep(drop_rows, drop_lanes, start_n, threshold, key0, key1, BLOCK_M, BLOCK_N, ALIGNED)
        dp = tl.where(keep, dp * drop_scale, 0.0)
    ds = p * (dp - delta[:, None])
    return _dot(ds.to(k.dtype), k, dq, IEEE, UPCAST)


@triton.jit(do_not_specialize=["thr", "k0", "k1", "ob_lo", "ob_hi", "ol", "b_start", "h_start", "row_start"])
def _attn_bwd_dq(
    Q, K, V, Bias, dOut, Lse, Delta, dQ,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sbb, sbh, sbm, sbn, sgb, sgh, sgm, sgd,
    H, L, S, GROUP, sm_scale, drop_scale,
    thr, k0, k1, ob_lo, ob_hi, ol, b_start, h_start, row_start, H_g, L_g,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, ALIGNED: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """One program: ``BLOCK_M`` query rows of head ``(b, h)``; ``dQ`` is contiguous ``(B, H, L, D)``. The key
    blocks in the forward's order (:func:`_key_blocks`)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    bi = b.to(tl.int64)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < L
    q = tl.load(
        Q + bi * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
        mask=row_ok[:, None],
        other=0.0,
    )
    do = tl.load(
        dOut + bi * sgb + h.to(tl.int64) * sgh + offs_m[:, None] * sgm + offs_d[None, :] * sgd,
        mask=row_ok[:, None],
        other=0.0,
    )
    rows = (bi * H + h) * L
    lse = tl.load(Lse + rows + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + rows + offs_m, mask=row_ok, other=0.0)
    K_head = K + bi * skb + hk.to(tl.int64) * skh
    V_head = V + bi * svb + hk.to(tl.int64) * svh
    Bias_head = Bias + bi * sbb + h.to(tl.int64) * sbh
    if DROPOUT:
        key0 = k0.to(tl.uint32, bitcast=True)
        key1 = k1.to(tl.uint32, bitcast=True)
        threshold = thr.to(tl.uint32, bitcast=True)
        ob = (ob_hi.to(tl.int64) << 32) | (ob_lo.to(tl.int64) & 0xFFFFFFFF)
        row_block, row_lane = _row_geometry(offs_m, b, h, ob, ol, b_start, h_start, row_start, H_g, L_g, S)
    else:
        key0, key1, threshold, row_block, row_lane = 0, 0, 0, 0, 0  # unused
    qk_scale = sm_scale * 1.4426950408889634
    dq = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)
    mid, hi = _key_blocks(S, row_start, pid_m, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(0, _bound(mid), BLOCK_N):
        dq = _dq_block(
            dq, q, do, lse, delta, K_head, V_head, Bias_head, start_n, offs_m, offs_d, row_ok,
            skn, skd, svn, svd, sbm, sbn, S, row_start, qk_scale, drop_scale, row_block, row_lane, threshold, key0,
            key1, BLOCK_M, BLOCK_N, False, CAUSAL, HAS_BIAS, DROPOUT, ALIGNED, IEEE, UPCAST,
        )  # fmt: skip
    for start_n in range(_bound(mid), _bound(hi), BLOCK_N):
        dq = _dq_block(
            dq, q, do, lse, delta, K_head, V_head, Bias_head, start_n, offs_m, offs_d, row_ok,
            skn, skd, svn, svd, sbm, sbn, S, row_start, qk_scale, drop_scale, row_block, row_lane, threshold, key0,
            key1, BLOCK_M, BLOCK_N, True, CAUSAL, HAS_BIAS, DROPOUT, ALIGNED, IEEE, UPCAST,
        )  # fmt: skip
    tl.store(
        dQ + (bi * H + h) * L * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
        (dq * sm_scale).to(dQ.dtype.element_ty),
        mask=row_ok[:, None],
    )
