"""The checks of :func:`hyperrng.philox.attention.scaled_dot_product_attention`'s arguments and what they
make of them, before anything is computed: the call's shapes and switches (:class:`_Problem`), the block of
the global probabilities it computes (:class:`_Block`) and its dropout position (:class:`_Dropout`), or a
typed error naming what is wrong.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import torch

from hyperrng.errors import ArgumentTypeError, InvalidArgumentError
from hyperrng.philox import COUNTER_SPACE, check_probability, check_shape
from hyperrng.philox._checks import _check_bool
from hyperrng.philox._shards import ShardGeometry
from hyperrng.platforms.validate import check_int, check_seed

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_WORD_SCALE = 2**32  # a word is below round(q * 2**32) with probability ~q


@dataclass(frozen=True)
class _Problem:
    """The shapes and switches of one call, checked."""

    batch: tuple[int, ...]  # local batch dims of the probabilities (query heads last)
    L: int
    S: int
    E: int
    Ev: int
    group: int  # query heads per key/value head (enable_gqa), else 1
    scale: float
    causal: bool
    dtype: torch.dtype
    device: torch.device

    @property
    def shape(self) -> tuple[int, ...]:
        """Local shape of the probabilities."""
        return (*self.batch, self.L, self.S)

    @property
    def compute_batch(self) -> tuple[int, ...]:
        """Batch dims the torch implementation computes in: query heads split into (key heads, group)."""
        if self.group == 1:
            return self.batch
        return (*self.batch[:-1], self.batch[-1] // self.group, self.group)

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class _Block:
    """Which block of the global probabilities this call computes."""

    global_shape: tuple[int, ...]
    starts: tuple[int, ...]

    @property
    def row_start(self) -> int:
        return self.starts[-2]


@dataclass(frozen=True)
class _Dropout:
    p: float
    key: int
    offset: int

    @property
    def threshold(self) -> int:
        return round((1.0 - self.p) * _WORD_SCALE)  # as hyperrng.philox.bernoulli(shape, 1 - p) rounds it


def _check_tensor(value: object, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ArgumentTypeError(
            f"{name} must be a torch.Tensor of shape (..., L or S, E), got {type(value).__name__}; "
            f"convert it with torch.as_tensor."
        )
    return value


def _check_problem(
    query: object,
    key: object,
    value: object,
    attn_mask: object,
    is_causal: object,
    scale: object,
    enable_gqa: object,
) -> tuple[_Problem, torch.Tensor | None]:
    """The checked problem and mask, or a typed error naming what is wrong."""
    q, k, v = (_check_tensor(t, name) for t, name in ((query, "query"), (key, "key"), (value, "value")))
    for t, name in ((q, "query"), (k, "key"), (v, "value")):
        if t.dtype not in _DTYPES:
            raise ArgumentTypeError(
                f"{name} has dtype {t.dtype}; attention takes float16, bfloat16, float32 or float64 tensors."
            )
    if not q.dtype == k.dtype == v.dtype:
        raise ArgumentTypeError(
            f"query, key and value must have one dtype, got {q.dtype}, {k.dtype} and {v.dtype}; convert them."
        )
    if not q.device == k.device == v.device:
        raise InvalidArgumentError(
            f"query, key and value must be on one device, got {q.device}, {k.device} and {v.device}."
        )
    gqa = _check_bool(enable_gqa, "enable_gqa")
    causal = _check_bool(is_causal, "is_causal")
    least = 3 if gqa else 2
    if q.dim() < least or not q.dim() == k.dim() == v.dim():
        raise InvalidArgumentError(
            f"query, key and value must have the same number of dimensions, at least {least} "
            f"((..., heads, L, E) with enable_gqa), got shapes {tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}."
        )
    L, E, S, Ev = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
    if k.shape[-1] != E or v.shape[-2] != S:
        raise InvalidArgumentError(
            f"shapes do not fit attention: query (..., L, E) {tuple(q.shape)}, key (..., S, E) {tuple(k.shape)}, "
            f"value (..., S, Ev) {tuple(v.shape)} need key's last dim equal to E and value's S equal to key's."
        )
    group, k_batch, v_batch = 1, tuple(k.shape[:-2]), tuple(v.shape[:-2])
    if gqa:
        hq, hk = q.shape[-3], k.shape[-3]
        if v.shape[-3] != hk or hk == 0 or hq % hk:
            raise InvalidArgumentError(
                f"enable_gqa needs key and value with the same number of heads dividing the query's: got "
                f"{hq} query, {hk} key and {v.shape[-3]} value heads."
            )
        group = hq // hk
        k_batch, v_batch = (*k_batch[:-1], hq), (*v_batch[:-1], hq)
    try:
        batch = _broadcast(tuple(q.shape[:-2]), k_batch, v_batch)
    except RuntimeError:
        raise InvalidArgumentError(
            f"the batch dimensions of query {tuple(q.shape)}, key {tuple(k.shape)} and value {tuple(v.shape)} "
            f"do not broadcast{'' if gqa else '; for fewer key/value heads than query heads pass enable_gqa=True'}."
        ) from None
    mask = None if attn_mask is None else _check_mask(attn_mask, q, (*batch, L, S))
    if mask is not None and causal:
        raise InvalidArgumentError(
            "pass attn_mask or is_causal=True, not both (as torch); fold the causal mask into attn_mask."
        )
    if scale is None:
        scale_value = 1.0 / math.sqrt(E) if E else 1.0
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ArgumentTypeError(f"scale must be a real number or None, got {type(scale).__name__} {scale!r}.")
    else:
        scale_value = float(scale)
        if not math.isfinite(scale_value):
            raise InvalidArgumentError(f"scale must be finite, got {scale_value}.")
    problem = _Problem(batch, L, S, E, Ev, group, scale_value, causal, q.dtype, q.device)
    return problem, mask


def _broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """``torch.broadcast_shapes`` of ``shapes``, remembered: it costs tens of microseconds, and a model
    asks the same few shapes in every layer. Symbolic sizes (compiled code with dynamic shapes) have no
    hash: those are computed each time. Raises its RuntimeError where they do not broadcast."""
    try:
        return _remembered_broadcast(*shapes)
    except TypeError:  # unhashable: a SymInt
        return tuple(torch.broadcast_shapes(*shapes))  # type: ignore[no-untyped-call]


@functools.lru_cache(maxsize=256)
def _remembered_broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(*shapes))  # type: ignore[no-untyped-call]


def _check_mask(attn_mask: object, q: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(attn_mask, torch.Tensor):
        raise ArgumentTypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}.")
    if attn_mask.dtype not in (torch.bool, q.dtype):
        raise ArgumentTypeError(
            f"attn_mask must be bool (True: take part) or additive in the query's dtype {q.dtype}, "
            f"got {attn_mask.dtype}."
        )
    if attn_mask.device != q.device:
        raise InvalidArgumentError(f"attn_mask is on {attn_mask.device} but query is on {q.device}.")
    try:
        fits = _broadcast(tuple(attn_mask.shape), shape) == shape
    except RuntimeError:
        fits = False
    if not fits:
        raise InvalidArgumentError(
            f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the attention shape {shape} "
            f"(*batch, L, S)."
        )
    return attn_mask


def _check_dropout_p(dropout_p: object) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise ArgumentTypeError(
            f"dropout_p must be a real number in [0, 1], got {type(dropout_p).__name__} {dropout_p!r}; "
            f"pass a Python float such as 0.1."
        )
    try:
        return check_probability(dropout_p)
    except InvalidArgumentError:
        raise InvalidArgumentError(f"dropout_p must be a probability in [0, 1], got {float(dropout_p)}.") from None


def _check_block(problem: _Problem, global_shape: object, shard: object) -> _Block:
    local = problem.shape
    if global_shape is None:
        if shard is not None:
            raise InvalidArgumentError("shard needs global_shape: pass the shape of the unsharded probabilities too.")
        return _Block(local, (0,) * len(local))
    shape = check_shape(global_shape)
    if len(shape) != len(local):
        raise InvalidArgumentError(
            f"global_shape {shape} must have the {len(local)} dimensions of the probabilities (*batch, L, S), "
            f"like the local {local}."
        )
    if shape[-1] != problem.S:
        raise InvalidArgumentError(
            f"global_shape {shape} has S = {shape[-1]} but key has {problem.S} rows: every call needs all keys "
            f"(the softmax runs over them); shard batch, heads or query rows only."
        )
    geometry = ShardGeometry.of(shape, shard)
    if geometry.local_shape != local:
        raise InvalidArgumentError(
            f"shard {shard!r} of global_shape {shape} has shape {geometry.local_shape}, but the probabilities of "
            f"these tensors have shape {local}."
        )
    if problem.group > 1 and geometry.starts[-3] % problem.group:
        raise InvalidArgumentError(
            f"with enable_gqa a block of heads starts at a multiple of {problem.group} (query heads per key head), "
            f"so that its key and value heads are whole; shard starts at head {geometry.starts[-3]}."
        )
    return _Block(shape, geometry.starts)


def _check_position(p: float, philox_key: object, offset: object, block: _Block) -> _Dropout | None:
    key = None if philox_key is None else check_seed(philox_key, "philox_key")
    start = check_int(offset, "offset")
    numel = math.prod(block.global_shape)
    if start < 0:
        raise InvalidArgumentError(f"offset must be >= 0, got {start}; it is the global index of element 0.")
    if start + numel > COUNTER_SPACE:
        raise InvalidArgumentError(
            f"offset {start} + {numel} probabilities of shape {block.global_shape} overflows the 2**64 counter "
            f"space by {start + numel - COUNTER_SPACE}; start a new philox_key instead of wrapping around."
        )
    if p == 0.0:
        return None
    if key is None:
        raise InvalidArgumentError(
            f"dropout_p={p} draws a dropout mask: pass its position, philox_key (an int in [0, 2**64 - 1]) and offset."
        )
    return _Dropout(p, key, start)
