"""Triton kernels of portable attention: flash attention with the portable dropout mask, forward and backward.

Imported only by :mod:`hyperrng.philox.attention`, lazily (``import hyperrng`` never imports Triton), and
loaded a second time under another name with ``TRITON_INTERPRET=1`` to run on CPU tensors through
Triton's interpreter (the kernels are compiled or interpreted according to that variable when they are
decorated, so one module object is one or the other).

Tensors arrive as 4-D views ``(B, H, rows, cols)`` with any strides (0 where broadcast); query head ``h``
reads key/value head ``h // group``. The probability element ``(b, h, i, j)`` of this block has the
global index ``4 * ob + ol + ((b_start + b) * H_g + h_start + h) * L_g * S + (row_start + i) * S + j``:
``ob`` and ``ol`` split the 64-bit offset (``offset // 4`` and ``offset % 4``) so that every quantity
fits ``int64``. Its word is lane ``index % 4`` of Philox4x32-10 at counter ``index // 4`` (words 0 and 1,
low half first; words 2 and 3 zero) under the 64-bit key, low word first: :func:`hyperrng.philox.random_bits`.
The element is kept where ``word <= thr`` (``thr = round((1 - p) * 2**32) - 1``), and kept probabilities
are scaled by ``drop_scale`` (the caller passes 0 where that threshold is 0 and nothing is kept).

When every row of the block starts at a multiple of 4 (``ALIGNED``: ``ol == 0`` and ``S % 4 == 0``) a
tile computes one Philox block per four columns and interleaves the lanes; otherwise each element
computes its own block and picks its lane (four times the Philox work, any offset and shape).

Per-call values (key words, offset words, threshold, block position) are kernel arguments typed as
signed 32-bit bit patterns and excluded from specialisation, so a new key, offset or rank reuses the
compiled kernel. Shapes, strides and the ``tl.constexpr`` switches select variants.

The softmax runs in base 2 (``exp2``, scores scaled by ``log2(e)``); the per-row ``lse`` the forward
stores for the backward is ``log2`` of the row's sum of ``2**score``, ``+inf`` for a row with nothing
to attend to (so the backward's probabilities are 0 there, as torch's math path gives).

Masks only where a block needs them: the forward and dq visit first the key blocks wholly inside ``S`` and
(causal) wholly below the diagonal, without masks, then those that cross the diagonal or ``S``, masked
(:func:`_key_blocks`); dk/dv visit first the query blocks that cross the diagonal, masked, then those below
it. Both loops together visit the blocks of the single masked loop they replace, in its order, with the
same arithmetic: the results are the same bits. The Philox rounds are the draw kernels' own
(:func:`hyperrng.philox._triton_kernels.philox`, from the copy loaded in this copy's mode).

Under the interpreter three things differ from the compiled code, each where marked: Triton's library
reductions are decorated again for the interpreter, runtime loop bounds become Python ints
(``_bound``), and bfloat16 dot operands are converted to float32 first (``UPCAST``; exact), because
the interpreter's bfloat16 dot is wrong. Everything else, the Philox rounds and the mask included, is
the code a GPU compiles.

Launch option ``enable_fp_fusion`` is off (:data:`FP_FUSION`): every product is rounded on its own, so
a score rounds alike in a masked block and an unmasked one (with contraction the compiler fuses the
unmasked block's ``s * scale - m`` into one multiply-add, which the masked block's select prevents),
and a row's values do not depend on which blocks its query tile crosses (the shard of rows a rank
holds), on every Triton backend. It costs a few instructions a loop (the matrix products run on
tensor cores either way).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language import core as _core  # noqa: F401 -- see below

from hyperrng.philox import _triton as _loader

FP_FUSION = False
"""``enable_fp_fusion`` of every launch (see the module docstring)."""

_philox = _loader.load("hyperrng.philox._triton_kernels", triton.knobs.runtime.interpret).philox
_LOW32 = tl.constexpr(0xFFFFFFFF)
_LOG2E = tl.constexpr(1.4426950408889634)


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
    """Block index and lane (int64) of column 0 of the rows ``offs_m`` of head ``(b, h)`` of this block."""
    head = (b_start + b).to(tl.int64) * H_g + (h_start + h)
    rel = (head * L_g + row_start + offs_m) * S + ol
    return ob + rel // 4, rel % 4


@triton.jit
def _keep(row_block, row_lane, start_n, thr, k0, k1, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          ALIGNED: tl.constexpr):  # fmt: skip
    """The keep mask ``[BLOCK_M, BLOCK_N]`` of the columns ``start_n + arange(BLOCK_N)`` of rows whose
    column 0 lies in Philox block ``row_block`` at lane ``row_lane`` (int64)."""
    if ALIGNED:
        # Row starts are multiples of 4 (row_lane == 0) and so is start_n: one block per four columns,
        # the lanes put back in column order (w0[0], w1[0], w2[0], w3[0], w0[1], ...) as one tensor.
        blocks = row_block[:, None] + (start_n // 4 + tl.arange(0, BLOCK_N // 4))[None, :]
    else:
        t = row_lane[:, None] + (start_n + tl.arange(0, BLOCK_N))[None, :]
        blocks = row_block[:, None] + t // 4
    w0, w1, w2, w3 = _philox((blocks & _LOW32).to(tl.uint32), (blocks >> 32).to(tl.uint32), k0, k1)
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
        s += bias.to(tl.float32) * _LOG2E
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
    ``BLOCK_N``, so the two loops visit the blocks of ``range(0, hi, BLOCK_N)`` in its order."""
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
    those that need no mask, then those that do: :func:`_key_blocks`)."""
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
        ob = (ob_hi.to(tl.int64) << 32) | (ob_lo.to(tl.int64) & _LOW32)
        row_block, row_lane = _row_geometry(offs_m, b, h, ob, ol, b_start, h_start, row_start, H_g, L_g, S)
    else:
        key0, key1, threshold, row_block, row_lane = 0, 0, 0, 0, 0  # unused
    qk_scale = sm_scale * _LOG2E
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
        ob = (ob_hi.to(tl.int64) << 32) | (ob_lo.to(tl.int64) & _LOW32)
    else:
        key0, key1, threshold, ob = 0, 0, 0, 0  # unused
    qk_scale = sm_scale * _LOG2E
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
        ob = (ob_hi.to(tl.int64) << 32) | (ob_lo.to(tl.int64) & _LOW32)
        row_block, row_lane = _row_geometry(offs_m, b, h, ob, ol, b_start, h_start, row_start, H_g, L_g, S)
    else:
        key0, key1, threshold, row_block, row_lane = 0, 0, 0, 0, 0  # unused
    qk_scale = sm_scale * _LOG2E
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


# -- launches ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """Everything a launch needs besides the tensors; 32-bit values as signed bit patterns."""

    scale: float
    causal: bool
    dropout: bool
    drop_scale: float
    thr: int
    k0: int
    k1: int
    ob_lo: int
    ob_hi: int
    ol: int
    b_start: int
    h_start: int
    row_start: int
    heads_global: int
    rows_global: int
    aligned: bool
    interpret: bool


@dataclass(frozen=True)
class _Tiles:
    block_m: int
    block_n: int
    warps: int
    stages: int


# Compiled tiles by kernel, head dim and whether the inputs are float32, not timed on a GPU: chosen so that
# ptxas (Triton 3.6, sm_90) reports no register spills in any variant (dropout or not, causal or not, with or
# without a bias, aligned or not; sequences of 256 and of 77), with the largest tiles that do for 16-bit
# inputs at head dims 64 and 128. Float32 products run without tensor cores (IEEE) and need far more
# registers: its tiles are small, and dk/dv at head dims 64 and 128 and the forward at 128 take eight warps
# (with four, those spilled up to 1.5 KB, without dropout too; dk/dv sum the rows in order whatever the tile).
# The interpreter runs small tiles of the same orientations (forward and dq: tall, dk/dv: wide), so that its
# tests cross tile edges at small sizes.
_SMALL = _Tiles(64, 64, 4, 3)
_COMPILED = {
    "fwd": {16: _SMALL, 32: _SMALL, 64: _Tiles(128, 64, 8, 3), 128: _Tiles(128, 32, 8, 2)},
    "dkdv": {16: _Tiles(32, 64, 4, 3), 32: _Tiles(32, 64, 4, 3), 64: _Tiles(32, 128, 8, 3), 128: _Tiles(32, 64, 8, 3)},
    "dq": {16: _SMALL, 32: _SMALL, 64: _Tiles(128, 32, 8, 3), 128: _Tiles(128, 32, 8, 2)},
}
_FLOAT32 = {"fwd": _Tiles(32, 32, 4, 2), "dkdv": _Tiles(16, 32, 4, 2), "dq": _Tiles(32, 16, 4, 2)}
_COMPILED_FLOAT32 = {
    "fwd": {16: _FLOAT32["fwd"], 32: _FLOAT32["fwd"], 64: _FLOAT32["fwd"], 128: _Tiles(16, 32, 8, 2)},
    "dkdv": {16: _FLOAT32["dkdv"], 32: _FLOAT32["dkdv"], 64: _Tiles(16, 32, 8, 1), 128: _Tiles(16, 32, 8, 1)},
    "dq": dict.fromkeys((16, 32, 64, 128), _FLOAT32["dq"]),
}
_INTERPRETED = {"fwd": _Tiles(32, 16, 1, 1), "dkdv": _Tiles(16, 32, 1, 1), "dq": _Tiles(32, 16, 1, 1)}

# Caps of ptxas's registers a thread (maxnreg) by (kernel, head dim, float32, dropout, bias). Left to itself,
# ptxas takes more registers for the two pipelined loops (unmasked, masked) than it took for the one masked
# loop they replace, in places more than fit the CTAs an SM held then; these caps hold those CTAs, spilling
# nothing (checked as the tiles were, with `.ci/kernel-report` for sm_90 and sm_80). Where a cap that holds
# them spilled somewhere, there is none.
_REGISTERS: dict[tuple[str, int, bool, bool, bool], int] = {
    ("fwd", 16, False, True, False): 128,
    ("fwd", 16, False, True, True): 168,
    ("fwd", 32, False, True, True): 168,
    ("fwd", 128, False, False, False): 128,
    ("fwd", 128, True, True, False): 80,  # left to itself, ptxas takes 64 and spills 16 bytes (fusion off)
    ("dkdv", 16, False, False, False): 96,
    ("dkdv", 32, False, False, False): 128,
    ("dkdv", 128, False, False, False): 128,
    ("dq", 16, False, True, False): 168,
    ("dq", 16, False, True, True): 168,
    ("dq", 32, False, False, True): 128,
    ("dq", 16, True, True, False): 72,
    ("dq", 32, True, True, False): 72,
}


# The tables above were set for Hopper (sm_90). Elsewhere (Ampere's sm_80, a Triton backend that is not
# NVIDIA's) no register caps apply, and where 16-bit kernels spilled on sm_80 with Hopper's tiles they take
# these, which spill nothing there (.ci/kernel-report).
_ELSEWHERE = {("dkdv", 64): _Tiles(16, 64, 4, 2), ("dq", 128): _Tiles(64, 32, 4, 2)}


def _tiles(kernel: str, head_dim: int, dtype: torch.dtype, interpret: bool) -> _Tiles:
    if interpret:
        return _INTERPRETED[kernel]
    if dtype != torch.float32 and not _hopper(triton.runtime.driver.active.get_current_device()):
        found = _ELSEWHERE.get((kernel, head_dim))
        if found is not None:
            return found
    return (_COMPILED_FLOAT32 if dtype == torch.float32 else _COMPILED)[kernel][head_dim]


def _registers(kernel: str, head_dim: int, dtype: torch.dtype, call: Call, bias: torch.Tensor | None) -> int | None:
    if call.interpret or not _hopper(triton.runtime.driver.active.get_current_device()):
        return None
    return _REGISTERS.get((kernel, head_dim, dtype == torch.float32, call.dropout, bias is not None))


@functools.cache
def _hopper(device: int) -> bool:
    """Whether Triton compiles for an NVIDIA GPU of compute capability 9.0 or later on its current ``device``."""
    target = triton.runtime.driver.active.get_current_target()
    return target.backend == "cuda" and isinstance(target.arch, int) and target.arch >= 90


def _geometry_args(call: Call) -> tuple[int, ...]:
    return (
        call.thr,
        call.k0,
        call.k1,
        call.ob_lo,
        call.ob_hi,
        call.ol,
        call.b_start,
        call.h_start,
        call.row_start,
        call.heads_global,
        call.rows_global,
    )


def _switches(call: Call, q: torch.Tensor, bias: torch.Tensor | None) -> dict[str, bool]:
    return {
        "CAUSAL": call.causal,
        "HAS_BIAS": bias is not None,
        "DROPOUT": call.dropout,
        "ALIGNED": call.aligned,
        "IEEE": q.dtype == torch.float32,
        "UPCAST": call.interpret and q.dtype == torch.bfloat16,
    }


def _options(tiles: _Tiles, call: Call, registers: int | None = None) -> dict[str, object]:
    if call.interpret:
        return {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n}
    options: dict[str, object] = {
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "num_warps": tiles.warps,
        "num_stages": tiles.stages,
        "enable_fp_fusion": FP_FUSION,
    }
    if registers is not None:
        options["maxnreg"] = registers
    return options


def _bias_tensor(bias: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    return q if bias is None else bias  # q stands in, never read: HAS_BIAS is False


def _bias_strides(bias: torch.Tensor | None) -> tuple[int, ...]:
    return (0, 0, 0, 0) if bias is None else tuple(bias.stride())


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, call: Call
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output ``(B, H, L, D)`` (contiguous, ``q``'s dtype) and the base-2 ``lse`` ``(B, H, L)`` float32."""
    B, H, L, D = q.shape
    S = k.shape[2]
    out = torch.empty((B, H, L, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, L), dtype=torch.float32, device=q.device)
    tiles = _tiles("fwd", D, q.dtype, call.interpret)
    grid = (triton.cdiv(L, tiles.block_m), H, B)
    _attn_fwd[grid](
        q, k, v, _bias_tensor(bias, q), out, lse,
        *q.stride(), *k.stride(), *v.stride(), *_bias_strides(bias), *out.stride(),
        H, L, S, H // k.shape[1], call.scale, call.drop_scale, *_geometry_args(call),
        HEAD_DIM=D, **_switches(call, q, bias), **_options(tiles, call, _registers("fwd", D, q.dtype, call, bias)),
    )  # fmt: skip
    return out, lse


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad: torch.Tensor,
    call: Call,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``q`` ``(B, H, L, D)`` and of ``k``, ``v`` ``(B, H // group, S, D)``, contiguous, each in
    its input's dtype, for the upstream gradient ``grad`` of the forward's ``out``."""
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    group = H // Hk
    delta = torch.empty((B, H, L), dtype=torch.float32, device=q.device)
    tiles = _tiles("dq", D, q.dtype, call.interpret)
    _attn_bwd_delta[(triton.cdiv(L, tiles.block_m), H, B)](
        out, grad, delta, *out.stride(), *grad.stride(), H, L, HEAD_DIM=D, BLOCK_M=tiles.block_m
    )
    dq = torch.empty((B, H, L, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, Hk, S, D), dtype=k.dtype, device=q.device)
    dv = torch.empty((B, Hk, S, D), dtype=v.dtype, device=q.device)
    common = (
        *q.stride(), *k.stride(), *v.stride(), *_bias_strides(bias), *grad.stride(),
        H, L, S, group, call.scale, call.drop_scale, *_geometry_args(call),
    )  # fmt: skip
    switches = _switches(call, q, bias)
    bias_tensor = _bias_tensor(bias, q)
    tiles = _tiles("dkdv", D, q.dtype, call.interpret)
    options = _options(tiles, call, _registers("dkdv", D, q.dtype, call, bias))
    _attn_bwd_dkdv[(triton.cdiv(S, tiles.block_n), Hk, B)](
        q, k, v, bias_tensor, grad, lse, delta, dk, dv, *common, HEAD_DIM=D, **switches, **options
    )
    tiles = _tiles("dq", D, q.dtype, call.interpret)
    options = _options(tiles, call, _registers("dq", D, q.dtype, call, bias))
    _attn_bwd_dq[(triton.cdiv(L, tiles.block_m), H, B)](
        q, k, v, bias_tensor, grad, lse, delta, dq, *common, HEAD_DIM=D, **switches, **options
    )
    return dq, dk, dv
