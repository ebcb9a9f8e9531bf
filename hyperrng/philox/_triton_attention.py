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

Under the interpreter three things differ from the compiled code, each where marked: Triton's library
reductions are decorated again for the interpreter, runtime loop bounds become Python ints
(``_bound``), and bfloat16 dot operands are converted to float32 first (``UPCAST``; exact), because
the interpreter's bfloat16 dot is wrong. Everything else, the Philox rounds and the mask included, is
the code a GPU compiles.

Launch option ``enable_fp_fusion`` stays on (:data:`FP_FUSION`): the keep mask is integer arithmetic,
which contraction cannot change, and the values are compared with the torch implementation within a
tolerance that a multiply-add contracted into an FMA is far inside.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language import core as _core  # see below, and the Philox rounds

FP_FUSION = True
"""``enable_fp_fusion`` of every launch (see the module docstring)."""

_M0 = tl.constexpr(0xD2511F53)  # multiplier of word 0
_M1 = tl.constexpr(0xCD9E8D57)  # multiplier of word 2
_W0 = tl.constexpr(0x9E3779B9)  # key increment of word 0
_W1 = tl.constexpr(0xBB67AE85)  # key increment of word 1
_ROUNDS = tl.constexpr(10)
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
def _philox(c0, c1, k0, k1):
    """Philox4x32-10 of the counters ``(c0, c1, 0, 0)`` (uint32) under the key ``(k0, k1)`` (uint32)."""
    c2 = tl.full(c0.shape, 0, tl.uint32)
    c3 = tl.full(c0.shape, 0, tl.uint32)
    for _ in tl.static_range(_ROUNDS):
        _c0, _c2 = c0, c2
        c0 = tl.umulhi(_M1, _c2) ^ c1 ^ k0
        c2 = tl.umulhi(_M0, _c0) ^ c3 ^ k1
        # The products and sums wrap by design. Triton before 3.6 exports no tl.mul: its core module has both.
        c1 = _core.mul(_M1, _c2, sanitize_overflow=False)
        c3 = _core.mul(_M0, _c0, sanitize_overflow=False)
        k0 = _core.add(k0, _W0, sanitize_overflow=False)
        k1 = _core.add(k1, _W1, sanitize_overflow=False)
    return c0, c1, c2, c3


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
def _scores(q, k, Bias_head, sbm, sbn, offs_m, offs_n, row_ok, S, row_start, qk_scale,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
            IEEE: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """Scores ``[BLOCK_M, BLOCK_N]`` in base 2 (``log2(e) * (q k^T * scale + bias)``), ``-inf`` where masked:
    beyond ``S``, by the bias, or above the causal diagonal of the global rows."""
    s = _dot(q, tl.trans(k), tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32), IEEE, UPCAST) * qk_scale
    col_ok = offs_n < S
    if HAS_BIAS:
        bias = tl.load(
            Bias_head + offs_m[:, None] * sbm + offs_n[None, :] * sbn,
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        s += bias.to(tl.float32) * _LOG2E
    valid = col_ok[None, :]
    if CAUSAL:
        valid = valid & (offs_n[None, :] <= row_start + offs_m[:, None])
    return tl.where(valid, s, float("-inf"))


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
    """One program: ``BLOCK_M`` query rows of head ``(b, h)``, online softmax over all key blocks."""
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
    qk_scale = sm_scale * _LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)
    hi = S
    if CAUSAL:
        hi = tl.minimum(S, row_start + (pid_m + 1) * BLOCK_M)
    for start_n in range(0, _bound(hi), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < S
        k = tl.load(K_head + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=col_ok[:, None], other=0.0)
        s = _scores(q, k, Bias_head, sbm, sbn, offs_m, offs_n, row_ok, S, row_start, qk_scale,
                    BLOCK_M, BLOCK_N, CAUSAL, HAS_BIAS, IEEE, UPCAST)  # fmt: skip
        m_new = tl.maximum(m_i, _max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row masked so far: everything is 0
        p = tl.math.exp2(s - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + _sum(p, 1)
        if DROPOUT:
            p = tl.where(_keep(row_block, row_lane, start_n, threshold, key0, key1, BLOCK_M, BLOCK_N, ALIGNED), p, 0.0)
        v = tl.load(V_head + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=col_ok[:, None], other=0.0)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE, UPCAST)
        m_i = m_new
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
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
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
    qk_scale = sm_scale * _LOG2E
    dk = tl.full([BLOCK_N, HEAD_DIM], 0.0, tl.float32)
    dv = tl.full([BLOCK_N, HEAD_DIM], 0.0, tl.float32)
    lo = 0
    if CAUSAL:
        # Global row row_start + i sees column j iff j <= row_start + i: rows before the first that
        # sees this block's first column contribute nothing.
        lo = tl.maximum(pid_n * BLOCK_N - row_start, 0) // BLOCK_M * BLOCK_M
    for g in range(0, _bound(GROUP)):
        h = hk * GROUP + g
        hi64 = h.to(tl.int64)
        Q_head = Q + bi * sqb + hi64 * sqh
        G_head = dOut + bi * sgb + hi64 * sgh
        Bias_head = Bias + bi * sbb + hi64 * sbh
        rows = (bi * H + h) * L
        for start_m in range(_bound(lo), _bound(L), BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < L
            q = tl.load(Q_head + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=row_ok[:, None], other=0.0)
            do = tl.load(G_head + offs_m[:, None] * sgm + offs_d[None, :] * sgd, mask=row_ok[:, None], other=0.0)
            lse = tl.load(Lse + rows + offs_m, mask=row_ok, other=float("inf"))
            delta = tl.load(Delta + rows + offs_m, mask=row_ok, other=0.0)
            s = _scores(q, k, Bias_head, sbm, sbn, offs_m, offs_n, row_ok, S, row_start, qk_scale,
                        BLOCK_M, BLOCK_N, CAUSAL, HAS_BIAS, IEEE, UPCAST)  # fmt: skip
            p = tl.math.exp2(s - lse[:, None])
            dpd = _dot(do, tl.trans(v), tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32), IEEE, UPCAST)
            if DROPOUT:
                row_block, row_lane = _row_geometry(offs_m, b, h, ob, ol, b_start, h_start, row_start, H_g, L_g, S)
                keep = _keep(row_block, row_lane, pid_n * BLOCK_N, threshold, key0, key1, BLOCK_M, BLOCK_N, ALIGNED)
                pd = tl.where(keep, p * drop_scale, 0.0)
                dp = tl.where(keep, dpd * drop_scale, 0.0)
            else:
                pd = p
                dp = dpd
            dv = _dot(tl.trans(pd.to(do.dtype)), do, dv, IEEE, UPCAST)
            ds = p * (dp - delta[:, None])
            dk = _dot(tl.trans(ds.to(q.dtype)), q, dk, IEEE, UPCAST)
    out = (bi * (H // GROUP) + hk) * S * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(dK + out, (dk * sm_scale).to(dK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dV + out, dv.to(dV.dtype.element_ty), mask=col_ok[:, None])


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
    """One program: ``BLOCK_M`` query rows of head ``(b, h)``; ``dQ`` is contiguous ``(B, H, L, D)``."""
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
    qk_scale = sm_scale * _LOG2E
    dq = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)
    hi = S
    if CAUSAL:
        hi = tl.minimum(S, row_start + (pid_m + 1) * BLOCK_M)
    for start_n in range(0, _bound(hi), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < S
        k = tl.load(K_head + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=col_ok[:, None], other=0.0)
        v = tl.load(V_head + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=col_ok[:, None], other=0.0)
        s = _scores(q, k, Bias_head, sbm, sbn, offs_m, offs_n, row_ok, S, row_start, qk_scale,
                    BLOCK_M, BLOCK_N, CAUSAL, HAS_BIAS, IEEE, UPCAST)  # fmt: skip
        p = tl.math.exp2(s - lse[:, None])
        dp = _dot(do, tl.trans(v), tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32), IEEE, UPCAST)
        if DROPOUT:
            keep = _keep(row_block, row_lane, start_n, threshold, key0, key1, BLOCK_M, BLOCK_N, ALIGNED)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq = _dot(ds.to(k.dtype), k, dq, IEEE, UPCAST)
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
# ptxas (Triton 3.6, sm_90, dropout) reports no register spills for 16-bit inputs at head dims 64 and 128
# without a bias and at most 56 bytes with one, with the largest tiles that do. Float32 products run
# without tensor cores (IEEE) and need far more registers: its tiles are small (larger ones spill
# kilobytes; these up to 1.5 KB with a bias at head dim 128). The interpreter runs small tiles of the
# same orientations (forward and dq: tall, dk/dv: wide), so that its tests cross tile edges at small sizes.
_SMALL = _Tiles(64, 64, 4, 3)
_COMPILED = {
    "fwd": {16: _SMALL, 32: _SMALL, 64: _Tiles(128, 64, 8, 3), 128: _Tiles(128, 32, 8, 2)},
    "dkdv": {16: _Tiles(32, 64, 4, 3), 32: _Tiles(32, 64, 4, 3), 64: _Tiles(32, 128, 8, 3), 128: _Tiles(32, 64, 8, 2)},
    "dq": {16: _SMALL, 32: _SMALL, 64: _Tiles(128, 32, 8, 3), 128: _Tiles(128, 32, 8, 2)},
}
_COMPILED_FLOAT32 = {"fwd": _Tiles(32, 32, 4, 2), "dkdv": _Tiles(16, 32, 4, 2), "dq": _Tiles(32, 16, 4, 2)}
_INTERPRETED = {"fwd": _Tiles(32, 16, 1, 1), "dkdv": _Tiles(16, 32, 1, 1), "dq": _Tiles(32, 16, 1, 1)}


def _tiles(kernel: str, head_dim: int, dtype: torch.dtype, interpret: bool) -> _Tiles:
    if interpret:
        return _INTERPRETED[kernel]
    return _COMPILED_FLOAT32[kernel] if dtype == torch.float32 else _COMPILED[kernel][head_dim]


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


def _options(tiles: _Tiles, call: Call) -> dict[str, object]:
    if call.interpret:
        return {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n}
    return {
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "num_warps": tiles.warps,
        "num_stages": tiles.stages,
        "enable_fp_fusion": FP_FUSION,
    }


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
        HEAD_DIM=D, **_switches(call, q, bias), **_options(tiles, call),
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
    _attn_bwd_dkdv[(triton.cdiv(S, tiles.block_n), Hk, B)](
        q, k, v, bias_tensor, grad, lse, delta, dk, dv, *common, HEAD_DIM=D, **switches, **_options(tiles, call)
    )
    tiles = _tiles("dq", D, q.dtype, call.interpret)
    _attn_bwd_dq[(triton.cdiv(L, tiles.block_m), H, B)](
        q, k, v, bias_tensor, grad, lse, delta, dq, *common, HEAD_DIM=D, **switches, **_options(tiles, call)
    )
    return dq, dk, dv
