"""Portable attention: scaled dot-product attention whose dropout mask is a pure function of the position.
:func:`scaled_dot_product_attention` is ``torch.nn.functional.scaled_dot_product_attention`` (same
arguments, same semantics) whose attention dropout is the portable dropout mask of the attention
probabilities, drawn at an explicit Philox position ``(philox_key, offset)``, so that the mask is
bit-identical on every device and for every implementation; after its arguments are checked
(:mod:`hyperrng.philox._attention_checks`), torch operations compute it a chunk of query rows at a time
(the reference) or flash-attention Triton kernels do (:data:`BACKENDS`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import FunctionCtx

from hyperrng.errors import InvalidArgumentError, InvalidOperationError
from hyperrng.philox import _triton, apply_dropout_mask, backends, bernoulli
from hyperrng.philox._attention_checks import (
    _Block,
    _check_block,
    _check_dropout_p,
    _check_position,
    _check_problem,
    _Dropout,
    _Problem,
)
from hyperrng.platforms.validate import error_gist

__all__ = ["BACKENDS", "CHUNK_ELEMENTS", "probability_shape", "scaled_dot_product_attention"]

BACKENDS = backends.BACKENDS
"""Values of ``backend=``: the implementations of :func:`scaled_dot_product_attention`.

``backend="torch"`` (every device; the reference) computes math attention a chunk of query rows at a
time: a chunk holds at most :data:`CHUNK_ELEMENTS` scores (``rows x S`` per head, at least one row), its
mask is drawn with :func:`hyperrng.philox.bernoulli` for exactly those rows, and the backward pass
recomputes scores and mask chunk by chunk. It saves ``q``, ``k``, ``v``, the output and one logsumexp per
row, never a mask or an ``L x S`` tensor; its working memory is a few chunks (plus, for float16/bfloat16
inputs, float32 copies of ``k`` and ``v``, and in the backward float32 gradient accumulators of the
broadcast shape, e.g. one key-sized buffer per query head with ``enable_gqa``). Half precision computes
in float32, float64 in float64.

``backend="triton"`` runs flash-attention kernels (:mod:`hyperrng.philox._triton_attention`) that
generate the mask from the global index inside the kernel, forward and backward, never materialising
``L x S``: memory beyond inputs and outputs is two float32 values per query row (logsumexp and the
backward's row term), a bool ``attn_mask`` converted to an additive one of its own shape, and, where
the inputs broadcast over a batch dimension, gradient buffers of the broadcast shape. The backward is
deterministic (no atomics): one kernel for the key/value gradients, one for the query's, each
regenerating the mask of its tiles. CUDA tensors run compiled kernels; CPU tensors run them through
Triton's interpreter (for tests). It takes float16, bfloat16 and float32 (IEEE products, no TF32) with head
dims 16, 32, 64 or 128 (query/key equal to value), no gradient for ``attn_mask``, batch dimensions
that fold into ``(B, H)``. ``backend="auto"`` picks it for CUDA tensors when Triton is importable and
the call fits, the torch implementation otherwise (:func:`_choose`). Empty inputs always take the torch path.

**Tolerance.** Masks are integers: identical between implementations and devices. Values are
floating point and differ by rounding. The tests (``tests/philox/test_attention.py``) hold the torch
implementation to a float64 math reference with the same explicit mask within ``1e-10`` (float64) and
``1e-5`` (float32), and the Triton kernels to the torch implementation within ``1e-5`` (float32),
``1e-2`` (float16) and ``6e-2`` (bfloat16), absolute and relative: the kernels accumulate in float32 but
round the probabilities to the input dtype before the product with ``v``, as flash attention does
(measured at ``L = 40``, ``S = 36``: largest differences about ``1e-6``, ``2e-3`` and ``2e-2``).
"""

CHUNK_ELEMENTS = 2**20
"""Scores one chunk of the torch implementation holds (all local heads, a range of query rows); a chunk
has at least one row. A few float32 buffers of this size (4 MiB each) are its working memory."""

_INT32 = 2**31  # Triton kernel arguments and per-head offsets are 32-bit
_GRID = 65535  # largest extent of grid axes 1 and 2, which hold heads and batches
_KERNELS = "hyperrng.philox._triton_attention"
_HEAD_DIMS = (16, 32, 64, 128)  # the head dims the kernels have tiles for


# -- the plan: a checked call and the implementation that runs it ---------------------------------


@dataclass(frozen=True)
class _Plan:
    problem: _Problem
    block: _Block
    dropout: _Dropout | None
    kernels: types.ModuleType | None  # the Triton kernels module when the Triton backend runs
    interpret: bool = False


# -- backend choice ------------------------------------------------------------------------------


@functools.cache
def _triton_import_error() -> str | None:
    """Why Triton or the kernels module cannot be imported here, or None (asked once per process, on the
    first call that could use them, never at import; importing decorates the kernels, it compiles nothing)."""
    try:
        importlib.import_module(_KERNELS)
    except Exception as error:  # any failure of a foreign package's import means: not usable
        return error_gist(error)
    return None


def _kernels(interpret: bool) -> types.ModuleType:
    """The kernels module, compiled or for Triton's interpreter (:func:`hyperrng.philox._triton.load`)."""
    return _triton.load(_KERNELS, interpret)


def _head_extent(t: torch.Tensor) -> int:
    """Elements between the first and last of one head's rows and columns (the kernels index them in int32)."""
    return sum((n - 1) * s for n, s in zip(t.shape[-2:], t.stride()[-2:]) if n)


def _triton_misfit(
    problem: _Problem, block: _Block, tensors: Sequence[torch.Tensor], mask: torch.Tensor | None
) -> str | None:
    """Why the Triton kernels cannot run this call, or None."""
    error = _triton_import_error()
    if error is not None:
        return f"Triton is not importable, or not a version the kernels were written for (3.6) ({error})"
    if problem.device.type not in ("cuda", "cpu"):
        return f"the kernels run on CUDA tensors (CPU tensors through Triton's interpreter), not {problem.device.type}"
    if problem.dtype == torch.float64:
        return "there is no float64 kernel"
    if problem.E != problem.Ev or problem.E not in _HEAD_DIMS:
        return f"head dims must be equal and one of {_HEAD_DIMS}; got E = {problem.E} and Ev = {problem.Ev}"
    if mask is not None and mask.requires_grad:
        return "the kernels do not differentiate attn_mask"
    batch, global_batch = problem.batch, block.global_shape[:-2]
    if len(batch) > 2 and batch[1:-1] != global_batch[1:-1]:
        return "batch dimensions between the first and the heads must be whole, so that they fold into (B, H)"
    heads = batch[-1] if batch else 1
    if heads > _GRID or math.prod(batch[:-1]) > _GRID:
        return f"at most {_GRID} heads and {_GRID} batches (the launch grid)"
    extents = [_head_extent(t) for t in (*tensors, *([] if mask is None else [mask]))]
    if max(problem.L, problem.S, *block.global_shape[-2:], *block.starts) >= _INT32 or max(extents) >= _INT32:
        return "sequence lengths and per-head extents must stay below 2**31"
    return None


def _choose(backend: object, problem: _Problem, block: _Block, tensors: Sequence[torch.Tensor], mask: Any) -> str:
    backends.check_backend(backend)
    if backend == "torch" or math.prod(problem.shape) == 0 or problem.E == 0:
        return "torch"
    if backend == "auto" and backends.resolve("auto", problem.device) != "triton":  # the draws' probe decides
        return "torch"
    misfit = _triton_misfit(problem, block, tensors, mask)
    if misfit is None:
        return "triton"
    if backend == "auto":
        return "torch"
    raise InvalidArgumentError(f"backend='triton' cannot run this call: {misfit}; use backend='torch' or 'auto'.")


# -- the torch implementation --------------------------------------------------------------------


def _row_chunks(problem: _Problem) -> Iterator[tuple[int, int]]:
    per_row = max(math.prod(problem.batch) * problem.S, 1)
    rows = max(1, min(problem.L, CHUNK_ELEMENTS // per_row))
    for r0 in range(0, problem.L, rows):
        yield r0, min(r0 + rows, problem.L)


def _split_heads(problem: _Problem, t: torch.Tensor, query_side: bool) -> torch.Tensor:
    """``t`` in the compute batch: query-side tensors with heads split (key heads, group), key-side ones
    with a group dimension of 1."""
    if problem.group == 1:
        return t
    if query_side:
        return t.unflatten(-3, (t.shape[-3] // problem.group, problem.group))
    return t.unsqueeze(-3)


def _keep(plan: _Plan, r0: int, r1: int) -> torch.Tensor:
    """The keep mask of local query rows ``[r0, r1)``, in the compute batch."""
    assert plan.dropout is not None
    problem, block = plan.problem, plan.block
    rows = (slice(block.row_start + r0, block.row_start + r1),)
    shard = tuple(slice(s, s + n) for s, n in zip(block.starts, problem.batch)) + rows
    keep = bernoulli(
        block.global_shape,
        1.0 - plan.dropout.p,
        plan.dropout.key,
        plan.dropout.offset,
        shard=shard,
        device=problem.device,
    )
    return _split_heads(problem, keep, query_side=True)


def _scores(
    plan: _Plan, q: torch.Tensor, kt: torch.Tensor, mask: torch.Tensor | None, r0: int, r1: int
) -> torch.Tensor:
    """Scores of local query rows ``[r0, r1)`` with masks applied (``-inf``), in the compute batch and dtype."""
    problem = plan.problem
    s = torch.matmul(q[..., r0:r1, :].to(problem.compute_dtype), kt)
    shape = (*problem.compute_batch, r1 - r0, problem.S)
    if s.shape != shape:  # value alone broadcasts over a batch dimension
        s = s.expand(shape).clone()
    s.mul_(problem.scale)
    if mask is not None:
        rows = mask[..., r0:r1, :]
        if rows.dtype == torch.bool:
            s.masked_fill_(~rows, -math.inf)
        else:
            s.add_(rows)
    if problem.causal:
        first = plan.block.row_start + r0
        global_rows = torch.arange(first, first + r1 - r0, device=s.device)
        columns = torch.arange(problem.S, device=s.device)
        s.masked_fill_(columns[None, :] > global_rows[:, None], -math.inf)
    return s


def _mask_view(problem: _Problem, mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else _split_heads(problem, mask.expand(problem.shape), query_side=True)


def _drop_scale(plan: _Plan, keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What dropout multiplies a probability by: ``keep / (1 - p)``, zeros for ``p = 1`` (as torch)."""
    assert plan.dropout is not None
    return apply_dropout_mask(torch.ones((), dtype=dtype, device=keep.device), keep, plan.dropout.p)


def _torch_forward(
    plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    problem = plan.problem
    dtype = problem.compute_dtype
    out = torch.empty((*problem.batch, problem.L, problem.Ev), dtype=problem.dtype, device=problem.device)
    lse = torch.full((*problem.compute_batch, problem.L), math.inf, dtype=dtype, device=problem.device)
    if problem.S == 0 or out.numel() == 0:
        return out.zero_(), lse  # no keys: every row attends to nothing
    cq = _split_heads(problem, q, query_side=True)
    kt = _split_heads(problem, k, query_side=False).to(dtype).transpose(-2, -1)
    cv = _split_heads(problem, v, query_side=False).to(dtype)
    cmask = _mask_view(problem, mask)
    o = _split_heads(problem, out, query_side=True)
    for r0, r1 in _row_chunks(problem):
        s = _scores(plan, cq, kt, cmask, r0, r1)
        top = s.amax(-1, keepdim=True)
        top.masked_fill_(top == -math.inf, 0.0)  # a row with nothing to attend to: all exp are 0
        p = s.sub_(top).exp_()
        total = p.sum(-1, keepdim=True)
        empty = total == 0
        lse[..., r0:r1] = (top + total.log()).masked_fill_(empty, math.inf).squeeze(-1)
        p.div_(total.masked_fill_(empty, 1.0))
        if plan.dropout is not None:
            p = apply_dropout_mask(p, _keep(plan, r0, r1), plan.dropout.p)
        o[..., r0:r1, :] = torch.matmul(p, cv)
    return out, lse


def _torch_backward(
    plan: _Plan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad: torch.Tensor,
    mask_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    problem = plan.problem
    dtype = problem.compute_dtype
    batch, L, S = problem.compute_batch, problem.L, problem.S
    cq = _split_heads(problem, q, query_side=True)
    ck = _split_heads(problem, k, query_side=False).to(dtype)
    cv = _split_heads(problem, v, query_side=False).to(dtype)
    kt, vt = ck.transpose(-2, -1), cv.transpose(-2, -1)
    g = _split_heads(problem, grad, query_side=True)
    o = _split_heads(problem, out, query_side=True)
    cmask = _mask_view(problem, mask)
    dq = torch.zeros((*batch, L, problem.E), dtype=dtype, device=problem.device)
    dk = torch.zeros((*batch, S, problem.E), dtype=dtype, device=problem.device)
    dv = torch.zeros((*batch, S, problem.Ev), dtype=dtype, device=problem.device)
    dmask = None if not mask_grad or mask is None else torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    for r0, r1 in _row_chunks(problem) if S else ():
        p = _scores(plan, cq, kt, cmask, r0, r1).sub_(lse[..., r0:r1, None]).exp_()
        go = g[..., r0:r1, :].to(dtype)
        scale = None if plan.dropout is None else _drop_scale(plan, _keep(plan, r0, r1), dtype)
        dv += torch.matmul((p if scale is None else p * scale).transpose(-2, -1), go)
        dp = torch.matmul(go, vt)
        if scale is not None:
            dp.mul_(scale)
        delta = (go * o[..., r0:r1, :].to(dtype)).sum(-1, keepdim=True)
        ds = p.mul_(dp.sub_(delta))  # the gradient of the scores
        dq[..., r0:r1, :] = torch.matmul(ds, ck)
        dk += torch.matmul(ds.transpose(-2, -1), cq[..., r0:r1, :].to(dtype))
        if dmask is not None:
            _add_mask_grad(problem, dmask, ds, r0, r1)
    dq.mul_(problem.scale)
    dk.mul_(problem.scale)
    grads = [d.sum_to_size(c.shape).reshape(t.shape).to(t.dtype) for d, c, t in ((dq, cq, q), (dk, ck, k), (dv, cv, v))]
    return grads[0], grads[1], grads[2], None if dmask is None or mask is None else dmask.to(mask.dtype)


def _add_mask_grad(problem: _Problem, dmask: torch.Tensor, ds: torch.Tensor, r0: int, r1: int) -> None:
    """Add the gradient of local query rows ``[r0, r1)`` of the scores to the additive mask's (its shape)."""
    d = ds.flatten(-4, -3) if problem.group > 1 else ds
    if dmask.dim() >= 2 and dmask.shape[-2] != 1:
        dmask[..., r0:r1, :] += d.sum_to_size((*dmask.shape[:-2], r1 - r0, dmask.shape[-1]))
    else:
        dmask += d.sum_to_size(dmask.shape)


# -- the Triton implementation -------------------------------------------------------------------


def _call(plan: _Plan) -> Any:
    problem, block, dropout = plan.problem, plan.block, plan.dropout
    assert plan.kernels is not None
    global_batch = block.global_shape[:-2]
    heads_global, h_start, b_start = 1, 0, 0
    if problem.batch:
        heads_global, h_start = global_batch[-1], block.starts[len(global_batch) - 1]
        if len(global_batch) > 1:
            b_start = block.starts[0] * math.prod(global_batch[1:-1])
    key = offset = threshold = 0
    p = 0.0
    if dropout is not None:
        key, offset, threshold, p = dropout.key, dropout.offset, dropout.threshold, dropout.p
    # A threshold of 0 keeps nothing: every value is then 0, which a scale of 0 gives whatever is "kept".
    drop_scale = 0.0 if p == 1.0 or (dropout is not None and threshold == 0) else 1.0 / (1.0 - p)
    return plan.kernels.Call(
        scale=problem.scale,
        causal=problem.causal,
        dropout=dropout is not None,
        drop_scale=drop_scale,
        thr=_triton._s32(max(threshold - 1, 0)),
        k0=_triton._s32(key),
        k1=_triton._s32(key >> 32),
        ob_lo=_triton._s32(offset >> 2),
        ob_hi=_triton._s32(offset >> 34),
        ol=offset & 3,
        b_start=b_start,
        h_start=h_start,
        row_start=block.row_start,
        heads_global=heads_global,
        rows_global=block.global_shape[-2],
        aligned=offset % 4 == 0 and problem.S % 4 == 0,
        interpret=plan.interpret,
    )


def _four(problem: _Problem, t: torch.Tensor, heads: int, rows: int, cols: int) -> torch.Tensor:
    """``t`` as a ``(B, heads, rows, cols)`` view (broadcast dimensions with stride 0; a copy only where
    leading batch dimensions cannot be merged)."""
    lead = problem.batch[:-1]
    return t.expand((*lead, heads, rows, cols)).reshape(math.prod(lead), heads, rows, cols)


def _four_inputs(
    problem: _Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    H = problem.batch[-1] if problem.batch else 1
    Hk = H // problem.group
    return (
        _four(problem, q, H, problem.L, problem.E),
        _four(problem, k, Hk, problem.S, problem.E),
        _four(problem, v, Hk, problem.S, problem.Ev),
        None if bias is None else _four(problem, bias, H, problem.L, problem.S),
    )


def _triton_forward(
    plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    assert plan.kernels is not None
    problem = plan.problem
    with _triton.launching_on(problem.device), _triton.language_restored(plan.interpret):
        out, lse = plan.kernels.forward(*_four_inputs(problem, q, k, v, bias), _call(plan))
    return out.view(*problem.batch, problem.L, problem.Ev), lse


def _triton_backward(
    plan: _Plan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    assert plan.kernels is not None
    problem = plan.problem
    H = problem.batch[-1] if problem.batch else 1
    q4, k4, v4, b4 = _four_inputs(problem, q, k, v, bias)
    o4 = _four(problem, out, H, problem.L, problem.Ev)
    g4 = _four(problem, grad, H, problem.L, problem.Ev)
    with _triton.launching_on(problem.device), _triton.language_restored(plan.interpret):
        dq, dk, dv = plan.kernels.backward(q4, k4, v4, b4, o4, lse, g4, _call(plan))
    lead = problem.batch[:-1]
    heads = (H,) if problem.batch else ()
    kv_heads = (H // problem.group,) if problem.batch else ()
    return (
        dq.view(*lead, *heads, problem.L, problem.E).sum_to_size(q.shape),
        dk.view(*lead, *kv_heads, problem.S, problem.E).sum_to_size(k.shape),
        dv.view(*lead, *kv_heads, problem.S, problem.Ev).sum_to_size(v.shape),
    )


# -- autograd ------------------------------------------------------------------------------------


def _forward(
    plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and the per-row logsumexp of ``plan``, by the implementation it chose."""
    if plan.kernels is None:
        return _torch_forward(plan, q, k, v, mask)
    return _triton_forward(plan, q, k, v, mask)


def _backward(
    plan: _Plan,
    saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor],
    grad: torch.Tensor,
    mask_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The gradients of ``q``, ``k``, ``v`` and (torch implementation, ``mask_grad``) an additive mask, from
    ``saved = (q, k, v, mask, out, lse)``: the probabilities and the dropout mask are recomputed."""
    q, k, v, mask, out, lse = saved
    if plan.kernels is None:
        return _torch_backward(plan, q, k, v, mask, out, lse, grad, mask_grad)
    dq, dk, dv = _triton_backward(plan, q, k, v, mask, out, lse, grad)
    return dq, dk, dv, None


class _Attention(torch.autograd.Function):
    """Attention whose backward recomputes the probabilities and the dropout mask from the saved inputs."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        plan: _Plan,
    ) -> torch.Tensor:
        out, lse = _forward(plan, q, k, v, mask)
        ctx.save_for_backward(q, k, v, mask, out, lse)  # type: ignore[arg-type]  # None is allowed
        ctx.plan = plan  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with torch.no_grad():
            dq, dk, dv, dmask = _backward(ctx.plan, ctx.saved_tensors, grad, ctx.needs_input_grad[3])
        if torch.is_grad_enabled():  # create_graph=True: differentiating these again must not miss terms silently
            q, k, v = ctx.saved_tensors[:3]
            dq, dk, dv = (None if g is None else _NoSecondDerivative.apply(g, q, k, v) for g in (dq, dk, dv))
        return dq, dk, dv, dmask, None


class _NoSecondDerivative(torch.autograd.Function):
    """A gradient of portable attention, taken with ``create_graph=True``, tied to the attention's inputs by a
    node that refuses to be differentiated: as torch's fused attention, portable attention has no second
    derivative, and a gradient of its gradient fails there (typed) instead of silently missing its terms."""

    @staticmethod
    def forward(ctx: Any, gradient: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return gradient.view_as(gradient)

    @staticmethod
    def backward(ctx: Any, *_: Any) -> Any:
        raise InvalidOperationError(
            "portable attention has no second derivative (nor has torch's fused attention): a gradient of its "
            "gradient cannot be taken. Compute attention with differentiable ops (softmax of q @ k.T) there."
        )


# -- the public functions ------------------------------------------------------------------------


def probability_shape(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool = False
) -> tuple[int, ...]:
    """The local shape ``(*batch, L, S)`` of the attention probabilities of these tensors: what
    :func:`scaled_dot_product_attention` draws its mask over (the block ``shard`` selects, when sharded).

    Raises:
        ArgumentTypeError, InvalidArgumentError: as :func:`scaled_dot_product_attention` for these tensors.
    """
    return _check_problem(query, key, value, None, False, None, enable_gqa)[0].shape


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    philox_key: int | None = None,
    offset: int = 0,
    global_shape: Sequence[int] | None = None,
    shard: Sequence[slice] | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with the portable dropout mask.

    **Contract.** The probabilities form a tensor of *global* shape ``(*batch, L, S)`` (usually
    ``(B, H, L, S)``; ``batch`` is the broadcast of the query's and the key's batch dimensions, the query
    heads with ``enable_gqa``). Element ``(b, h, i, j)`` has the row-major global index
    ``g = offset + ((b * H + h) * L + i) * S + j``; its 32-bit word is lane ``g % 4`` of the Philox4x32-10
    block with 64-bit counter ``g // 4`` under ``philox_key``, the word of
    :func:`hyperrng.philox.random_bits`. The element is kept iff that word is below
    ``round((1 - p) * 2**32)``, i.e. where ``hyperrng.philox.bernoulli((*batch, L, S), 1 - p, philox_key,
    offset)`` is True (the portable dropout convention), and kept probabilities are scaled by
    ``1 / (1 - p)``::

        out = dropout_mask(softmax(q @ k^T * scale + attn_mask)) @ v

    So the mask is bit-identical on every device, for every implementation, and a call that computes a
    block of the global attention (a rank of a batch- or head-sharded run, a query block of sequence or
    context parallelism: ``global_shape`` and ``shard``) gets exactly the matching slice of the unsharded
    mask. The draw covers ``prod(global_shape)`` indices from ``offset``; a caller that draws again
    advances ``offset`` by that count (portable mode rounds it up to a multiple of 4, whole Philox blocks).

    Everything else follows torch's math path: ``attn_mask`` bool (True: take part) or additive (the
    query's dtype), broadcastable to the local ``(*batch, L, S)``; ``is_causal`` masks ``j > i`` for the
    *global* row ``i`` (top-left aligned, as torch); ``scale`` defaults to ``1 / sqrt(E)``; a row with
    nothing to attend to gives zeros and zero gradients (torch's safe softmax); ``dropout_p = 0`` draws
    nothing and needs no position.

    Args:
        query, key, value: ``(..., L, E)``, ``(..., S, E)``, ``(..., S, Ev)`` floating-point tensors of one
            dtype and device, with the same number of dimensions; batch dimensions broadcast.
        attn_mask, dropout_p, is_causal, scale, enable_gqa: as torch's. ``dropout_p`` is applied whenever
            it is above 0 (there is no training flag: pass 0 in evaluation).
        philox_key: the 64-bit Philox key of the mask; needed when ``dropout_p > 0``.
        offset: global index of element 0 of the global probabilities; ``offset + prod(global_shape)``
            must stay within ``2**64``.
        global_shape: shape ``(*batch, L, S)`` of the unsharded probabilities, when this call computes a
            block of them; default: the local shape (:func:`probability_shape`).
        shard: slices of ``global_shape`` (step 1; trailing dimensions may be omitted) selecting this
            call's block: batch, heads or query rows, never key columns. The mask and the causal diagonal
            are those of the block's global rows; ``attn_mask`` is the block's own.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (:data:`BACKENDS`).

    Returns:
        The attention output ``(*batch, L, Ev)`` in the inputs' dtype, differentiable (once: no double
        backward) with respect to ``query``, ``key``, ``value`` and an additive ``attn_mask`` (torch
        backend). The backward pass draws the same mask again from the position the forward was given,
        on whatever thread it runs.

    Raises:
        ArgumentTypeError: an argument of the wrong type: a tensor that is not one, a dtype other than
            float16, bfloat16, float32, float64 (or bool for ``attn_mask``), dtypes that differ, a flag
            that is not a bool, a ``scale`` that is not a real number, a position that is not an int.
        InvalidArgumentError: shapes that do not fit attention or do not broadcast, tensors on different
            devices, ``attn_mask`` with ``is_causal``, ``dropout_p`` outside ``[0, 1]``, ``dropout_p > 0``
            without ``philox_key``, a key outside ``[0, 2**64 - 1]``, a negative offset or one that
            overflows the counter space, a ``global_shape``/``shard`` that does not describe these
            tensors' block (or shards key columns), an unknown backend, or ``backend="triton"`` for a call
            the kernels do not take (the message says why).

    Every argument is checked before anything is computed; on an error nothing has changed.
    """
    plan, mask = _plan(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        philox_key,
        offset,
        global_shape,
        shard,
        backend,
    )
    return _Attention.apply(query, key, value, mask, plan)  # type: ignore[no-any-return]


def _plan(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    philox_key: int | None,
    offset: int,
    global_shape: Sequence[int] | None,
    shard: Sequence[slice] | None,
    backend: str,
) -> tuple[_Plan, torch.Tensor | None]:
    """The checked plan of a call of :func:`scaled_dot_product_attention` and the mask its implementation
    takes (a bool mask made additive for the Triton kernels): the same for the same arguments."""
    problem, mask = _check_problem(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    p = _check_dropout_p(dropout_p)
    block = _check_block(problem, global_shape, shard)
    dropout = _check_position(p, philox_key, offset, block)
    chosen = _choose(backend, problem, block, (query, key, value), mask)
    if chosen == "torch":
        return _Plan(problem, block, dropout, None), mask
    interpret = problem.device.type == "cpu"
    plan = _Plan(problem, block, dropout, _kernels(interpret), interpret)
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=problem.dtype, device=mask.device).masked_fill_(~mask, -math.inf)
    return plan, mask
