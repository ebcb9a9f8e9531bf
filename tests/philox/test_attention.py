"""Portable attention: the dropout mask is hyperrng.philox.bernoulli of the global probabilities.

Tolerances. Masks are compared bit for bit. Values and gradients are floating point: the torch
implementation in float64 matches a float64 math reference with the same explicit mask to ``1e-10``
(the same arithmetic in another order), in float32 to ``1e-5``. The Triton kernels (run here through
Triton's interpreter, on a GPU compiled) match the torch implementation to ``1e-5`` in float32 and, for
float16 and bfloat16 inputs, to ``1e-2`` and ``6e-2`` (absolute and relative, as ``assert_close`` reads
them): the kernels round the probabilities to the input dtype before multiplying by ``v``, as flash
attention does, where the torch implementation keeps them in float32: one rounding of ``2**-11`` or
``2**-8`` relative on each term of sums of about one. The largest differences measured here are about
``1e-6``, ``2e-3`` and ``2e-2``, so each tolerance leaves a margin of 3 to 10 for a GPU's other order
of accumulation.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hyperrng
from hyperrng.errors import ArgumentTypeError, InvalidArgumentError
from hyperrng.philox import attention, bernoulli
from hyperrng.philox.attention import probability_shape, scaled_dot_product_attention

needs_triton = pytest.mark.needs_triton  # skipped, naming why, where Triton's interpreter cannot run the kernels

KEY = 0x0123456789ABCDEF
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}


def _inputs(
    shape_q: tuple[int, ...],
    shape_k: tuple[int, ...],
    dtype: torch.dtype = torch.float64,
    shape_v: tuple[int, ...] | None = None,
    seed: int = 0,
) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = (shape_q, shape_k, shape_k if shape_v is None else shape_v)
    return [torch.randn(s, generator=generator, dtype=torch.float64).to(dtype).requires_grad_() for s in shapes]


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None,
    p: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    row_start: int = 0,
    group: int = 1,
) -> torch.Tensor:
    """Math attention in float64 with an explicit keep mask; rows with nothing to attend to give 0."""
    q, k, v = (t.double() for t in (q, k, v))
    if group > 1:
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    s = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.double()
    if causal:
        rows = torch.arange(row_start, row_start + q.shape[-2])
        s = s.masked_fill(torch.arange(k.shape[-2])[None, :] > rows[:, None], -math.inf)
    probs = torch.softmax(s, -1)
    probs = torch.where(torch.isinf(s).all(-1, keepdim=True), 0.0, probs)
    if keep is not None:
        probs = probs * keep / (1 - p)
    return probs @ v


def _grads(out: torch.Tensor, tensors: list[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return list(torch.autograd.grad(out, tensors, upstream.to(out.device, out.dtype)))


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)


def _mask_from_output(out: torch.Tensor, S: int) -> torch.Tensor:
    """The keep mask of attention with uniform probabilities and v = identity: the nonzero outputs."""
    return out[..., :S] != 0


def _uniform_identity(B: int, H: int, L: int, S: int, E: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """q = 0 (every probability 1 / S) and v whose first S columns are the identity."""
    q = torch.zeros(B, H, L, E, dtype=dtype)
    k = torch.randn(B, H, S, E, generator=torch.Generator().manual_seed(2)).to(dtype)
    v = torch.eye(S, E, dtype=dtype).expand(B, H, S, E)
    return [q, k, v]


# -- the mask ------------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 7, 4 * 2**32 - 100, 2**64 - 2 * 3 * 12 * 12])
def test_the_mask_read_from_the_output_is_the_portable_bernoulli_mask(offset: int) -> None:
    q, k, v = _uniform_identity(2, 3, 12, 12, 12, torch.float32)
    out = scaled_dot_product_attention(q, k, v, dropout_p=0.3, philox_key=KEY, offset=offset, backend="torch")
    expected = bernoulli((2, 3, 12, 12), 0.7, KEY, offset)
    assert torch.equal(_mask_from_output(out, 12), expected)
    assert 0.5 < expected.float().mean() < 0.9  # a mask that keeps some and drops some
    torch.testing.assert_close(out[..., :12], expected / (12 * 0.7))


@pytest.mark.needs_portable_mode
def test_torchs_own_sdpa_in_portable_mode_draws_the_same_mask() -> None:
    q, k, v = _inputs((2, 3, 5, 8), (2, 3, 7, 8), torch.float32)
    with hyperrng.portable_random(11):
        theirs = F.scaled_dot_product_attention(q, k, v, dropout_p=0.4, is_causal=True)
    ours = scaled_dot_product_attention(q, k, v, dropout_p=0.4, is_causal=True, philox_key=11, offset=0)
    _close(ours, theirs, torch.float32)


def test_without_dropout_it_is_torchs_attention_and_draws_nothing() -> None:
    mask = torch.rand(5, 7, generator=torch.Generator().manual_seed(3)) > 0.4
    mask[2] = False  # a row with nothing to attend to
    for kwargs in ({}, {"is_causal": True}, {"attn_mask": mask}, {"scale": 0.3}):
        q, k, v = _inputs((2, 3, 5, 4), (2, 3, 7, 4))
        ours = scaled_dot_product_attention(q, k, v, **kwargs)
        theirs = F.scaled_dot_product_attention(q, k, v, **kwargs)
        _close(ours, theirs, torch.float64)
        for a, b in zip(_grads(ours, [q, k, v]), _grads(theirs, [q, k, v])):
            _close(a, b, torch.float64)


def test_p_one_drops_everything_as_torch_does() -> None:
    q, k, v = _inputs((1, 2, 4, 4), (1, 2, 6, 4))
    out = scaled_dot_product_attention(q, k, v, dropout_p=1.0, philox_key=KEY, offset=0)
    assert torch.equal(out, torch.zeros_like(out))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in _grads(out, [q, k, v]))


# -- values and gradients against math attention with the same mask -------------------------------


CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "causal, L < S": {"causal": True, "L": 5, "S": 9},
    "causal, L > S": {"causal": True, "L": 9, "S": 5},
    "bool mask, a row masked out": {"mask": "bool"},
    "additive mask, broadcast over batch": {"mask": "float"},
    "grouped-query heads": {"group": 3},
    "scale": {"scale": 0.7},
}


def _case(case: dict[str, Any], dtype: torch.dtype, head_dim: int = 6, seed: int = 0) -> dict[str, Any]:
    """Inputs and keyword arguments of one of :data:`CASES` (B = 2, 2 key heads)."""
    L, S, group = case.get("L", 7), case.get("S", 6), case.get("group", 1)
    q, k, v = _inputs((2, 2 * group, L, head_dim), (2, 2, S, head_dim), dtype, seed=seed)
    kwargs: dict[str, Any] = {"is_causal": case.get("causal", False), "enable_gqa": group > 1}
    if "scale" in case:
        kwargs["scale"] = case["scale"]
    generator = torch.Generator().manual_seed(seed + 5)
    if case.get("mask") == "bool":
        mask = torch.rand(2 * group, L, S, generator=generator) > 0.3
        mask[1, 2] = False
        kwargs["attn_mask"] = mask
    elif case.get("mask") == "float":
        kwargs["attn_mask"] = torch.randn(2 * group, L, S, generator=generator, dtype=torch.float64).to(dtype)
        kwargs["attn_mask"][0, 1, :2] = -math.inf
    return {"tensors": [q, k, v], "kwargs": kwargs, "group": group}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_values_and_gradients_are_math_attention_with_the_portable_mask(name: str, dtype: torch.dtype) -> None:
    c = _case(CASES[name], dtype)
    q, k, v = c["tensors"]
    kwargs = c["kwargs"]
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        mask.requires_grad_()
    out = scaled_dot_product_attention(q, k, v, dropout_p=0.25, philox_key=KEY, offset=40, **kwargs)
    keep = bernoulli(probability_shape(q, k, v, kwargs["enable_gqa"]), 0.75, KEY, 40)
    expected = _reference(q, k, v, keep, 0.25, mask, kwargs["is_causal"], kwargs.get("scale"), group=c["group"])
    _close(out, expected, dtype)
    differentiable = [q, k, v] + ([mask] if mask is not None and mask.requires_grad else [])
    for a, b in zip(_grads(out, differentiable), _grads(expected, differentiable)):
        _close(a, b, dtype)


def test_broadcast_batch_dimensions_get_gradients_of_their_own_shape() -> None:
    q, k, v = _inputs((3, 2, 4, 5), (1, 2, 6, 5), shape_v=(3, 1, 6, 5))
    out = scaled_dot_product_attention(q, k, v, dropout_p=0.5, philox_key=KEY, offset=1)
    keep = bernoulli((3, 2, 4, 6), 0.5, KEY, 1)
    expected = _reference(q, k, v, keep, 0.5)
    _close(out, expected, torch.float64)
    for a, b, t in zip(_grads(out, [q, k, v]), _grads(expected, [q, k, v]), (q, k, v)):
        assert a.shape == t.shape
        _close(a, b, torch.float64)


@pytest.mark.parametrize("shapes", [((5, 4), (6, 4)), ((3, 5, 4), (3, 6, 4)), ((2, 1, 3, 5, 4), (2, 1, 3, 6, 4))])
def test_any_number_of_batch_dimensions(shapes: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    q, k, v = _inputs(*shapes)
    out = scaled_dot_product_attention(q, k, v, dropout_p=0.3, philox_key=KEY, offset=9)
    keep = bernoulli(probability_shape(q, k, v), 0.7, KEY, 9)
    _close(out, _reference(q, k, v, keep, 0.3), torch.float64)


# -- blocks of the global attention ---------------------------------------------------------------


BLOCKS = {
    "batch": (slice(1, 2),),
    "heads": (slice(None), slice(1, 3)),
    "query rows": (slice(None), slice(None), slice(3, 8)),
    "heads and rows": (slice(0, 1), slice(2, 4), slice(4, 10)),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("block", list(BLOCKS))
def test_a_block_computes_the_matching_slice_of_the_unsharded_attention(block: str, causal: bool) -> None:
    shard = BLOCKS[block]
    q, k, v = _inputs((2, 4, 10, 5), (2, 4, 9, 5))
    mask = None if causal else torch.randn(2, 4, 10, 9, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    full = scaled_dot_product_attention(q, k, v, mask, 0.3, causal, philox_key=KEY, offset=12)
    full_grads = _grads(full, [q, k, v])
    rows = shard[2] if len(shard) > 2 else slice(None)
    kv_shard = shard[:2]
    parts = [t.detach()[shard if i == 0 else kv_shard].requires_grad_() for i, t in enumerate((q, k, v))]
    part = scaled_dot_product_attention(
        *parts,
        None if mask is None else mask[shard],
        0.3,
        causal,
        philox_key=KEY,
        offset=12,
        global_shape=(2, 4, 10, 9),
        shard=shard,
    )
    _close(part, full[shard], torch.float64)
    upstream = torch.randn(full.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    part_grads = torch.autograd.grad(part, parts, upstream[shard])
    _close(part_grads[0], full_grads[0][shard], torch.float64)
    if rows == slice(None):  # whole heads: their key and value gradients are slices too
        for a, b in zip(part_grads[1:], full_grads[1:]):
            _close(a, b[kv_shard], torch.float64)


def test_a_block_of_grouped_query_heads_is_a_slice_with_its_key_and_value_heads() -> None:
    q, k, v = _inputs((2, 6, 5, 4), (2, 3, 7, 4))
    full = scaled_dot_product_attention(q, k, v, dropout_p=0.3, enable_gqa=True, philox_key=KEY, offset=2)
    full_grads = _grads(full, [q, k, v])
    heads, kv_heads = slice(2, 6), slice(1, 3)
    parts = [q.detach()[:, heads], k.detach()[:, kv_heads], v.detach()[:, kv_heads]]
    parts = [t.requires_grad_() for t in parts]
    part = scaled_dot_product_attention(
        *parts, dropout_p=0.3, enable_gqa=True, philox_key=KEY, offset=2, global_shape=(2, 6, 5, 7),
        shard=(slice(None), heads),
    )  # fmt: skip
    _close(part, full[:, heads], torch.float64)
    upstream = torch.randn(full.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for a, b, s in zip(torch.autograd.grad(part, parts, upstream[:, heads]), full_grads, (heads, kv_heads, kv_heads)):
        _close(a, b[:, s], torch.float64)


def test_query_blocks_sum_to_the_unsharded_key_and_value_gradients() -> None:
    q, k, v = _inputs((1, 2, 9, 4), (1, 2, 9, 4))
    full = scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True, philox_key=KEY, offset=3)
    upstream = torch.randn(full.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = torch.autograd.grad(full, [k, v], upstream)
    total = [torch.zeros_like(k), torch.zeros_like(v)]
    for rows in (slice(0, 4), slice(4, 7), slice(7, 9)):
        part = scaled_dot_product_attention(
            q[:, :, rows], k, v, dropout_p=0.3, is_causal=True, philox_key=KEY, offset=3,
            global_shape=(1, 2, 9, 9), shard=(slice(None), slice(None), rows),
        )  # fmt: skip
        for t, g in zip(total, torch.autograd.grad(part, [k, v], upstream[:, :, rows])):
            t += g
    for a, b in zip(total, expected):
        _close(a, b, torch.float64)


# -- memory: chunks, and a backward that recomputes ----------------------------------------------


def test_the_backward_keeps_inputs_output_and_one_value_per_row() -> None:
    q, k, v = _inputs((1, 2, 48, 4), (1, 2, 40, 4))
    out = scaled_dot_product_attention(q, k, v, dropout_p=0.2, philox_key=KEY, offset=0)
    saved = [t for t in out.grad_fn.saved_tensors if t is not None]  # type: ignore[union-attr]
    assert sorted(tuple(t.shape) for t in saved) == sorted(
        [(1, 2, 48, 4), (1, 2, 40, 4), (1, 2, 40, 4), (1, 2, 48, 4), (1, 2, 48)]
    )


def test_chunks_of_query_rows_give_the_values_of_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    c = _case(CASES["bool mask, a row masked out"], torch.float64)
    q, k, v = c["tensors"]
    results = []
    for elements in (attention.CHUNK_ELEMENTS, 2 * 6 * 2 + 1, 1):  # one chunk; two rows per chunk; one row
        monkeypatch.setattr(attention, "CHUNK_ELEMENTS", elements)
        out = scaled_dot_product_attention(q, k, v, dropout_p=0.4, philox_key=KEY, offset=5, **c["kwargs"])
        results.append([out, *_grads(out, [q, k, v])])
    for other in results[1:]:
        for a, b in zip(other, results[0]):
            _close(a, b, torch.float64)


# -- arguments -----------------------------------------------------------------------------------


def _bad_calls() -> list[tuple[str, Callable[[list[torch.Tensor]], dict[str, Any]], type[Exception], str]]:
    def call(**overrides: Any) -> Callable[[list[torch.Tensor]], dict[str, Any]]:
        def make(t: list[torch.Tensor]) -> dict[str, Any]:
            kwargs: dict[str, Any] = {"query": t[0], "key": t[1], "value": t[2], "dropout_p": 0.1}
            kwargs.update({"philox_key": KEY, "offset": 0})
            kwargs.update({name: f(t) if callable(f) else f for name, f in overrides.items()})
            return kwargs

        return make

    return [
        ("query not a tensor", call(query=lambda t: t[0].tolist()), ArgumentTypeError, "query must be a torch.Tensor"),
        ("integer key", call(key=lambda t: t[1].long()), ArgumentTypeError, "key has dtype torch.int64"),
        ("mixed dtypes", call(value=lambda t: t[2].double()), ArgumentTypeError, "one dtype"),
        ("E differs", call(key=lambda t: t[1][..., :3]), InvalidArgumentError, "key's last dim equal to E"),
        ("S differs", call(value=lambda t: t[2][..., :2, :]), InvalidArgumentError, "value's S equal to key's"),
        ("ranks differ", call(key=lambda t: t[1][0]), InvalidArgumentError, "same number of dimensions"),
        ("heads differ", call(key=lambda t: t[1][:, :1].repeat(1, 3, 1, 1)), InvalidArgumentError, "enable_gqa=True"),
        (
            "gqa heads",
            call(enable_gqa=True, key=lambda t: t[1][:, :1].repeat(1, 3, 1, 1)),
            InvalidArgumentError,
            "dividing the query's",
        ),
        (
            "mask dtype",
            call(attn_mask=torch.zeros(5, 6, dtype=torch.int32)),
            ArgumentTypeError,
            "attn_mask must be bool",
        ),
        ("mask shape", call(attn_mask=torch.zeros(5, 5, dtype=torch.bool)), InvalidArgumentError, "does not broadcast"),
        (
            "mask and causal",
            call(attn_mask=torch.ones(5, 6, dtype=torch.bool), is_causal=True),
            InvalidArgumentError,
            "not both",
        ),
        ("causal not bool", call(is_causal=1), ArgumentTypeError, "is_causal must be a bool"),
        ("scale text", call(scale="0.5"), ArgumentTypeError, "scale must be a real number"),
        ("scale nan", call(scale=math.nan), InvalidArgumentError, "scale must be finite"),
        ("p above 1", call(dropout_p=1.5), InvalidArgumentError, "dropout_p must be a probability"),
        ("p tensor", call(dropout_p=torch.tensor(0.1)), ArgumentTypeError, "dropout_p must be a real number"),
        ("no key", call(philox_key=None), InvalidArgumentError, "pass its position, philox_key"),
        ("key too big", call(philox_key=2**64), InvalidArgumentError, "philox_key must be in [0, 2**64 - 1]"),
        ("key float", call(philox_key=1.0), ArgumentTypeError, "philox_key must be an int"),
        ("negative offset", call(offset=-4), InvalidArgumentError, "offset must be >= 0"),
        ("offset overflow", call(offset=2**64 - 2 * 2 * 5 * 6 + 1), InvalidArgumentError, "overflows the 2**64"),
        ("shard alone", call(shard=(slice(0, 1),)), InvalidArgumentError, "shard needs global_shape"),
        ("global rank", call(global_shape=(4, 5, 6)), InvalidArgumentError, "must have the 4 dimensions"),
        ("key columns", call(global_shape=(2, 2, 5, 12)), InvalidArgumentError, "every call needs all keys"),
        ("shard shape", call(global_shape=(4, 2, 5, 6)), InvalidArgumentError, "has shape (4, 2, 5, 6)"),
        ("shard step", call(global_shape=(4, 2, 5, 6), shard=(slice(0, 4, 2),)), InvalidArgumentError, "step"),
        (
            "gqa heads cut a group",
            call(
                enable_gqa=True,
                key=lambda t: t[1][:, :1],
                value=lambda t: t[2][:, :1],
                global_shape=(2, 4, 5, 6),
                shard=(slice(None), slice(1, 3)),
            ),
            InvalidArgumentError,
            "starts at a multiple of 2",
        ),
        ("backend name", call(backend="cuda"), InvalidArgumentError, "backend must be one of"),
        ("backend type", call(backend=None), ArgumentTypeError, "backend must be one of"),
        (
            "triton float64",
            call(
                backend="triton",
                query=lambda t: t[0].double(),
                key=lambda t: t[1].double(),
                value=lambda t: t[2].double(),
            ),
            InvalidArgumentError,
            "backend='triton'",
        ),
    ]


@pytest.mark.parametrize("name, make, error, message", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_a_bad_argument_raises_a_typed_error_and_changes_nothing(
    name: str, make: Callable[[list[torch.Tensor]], dict[str, Any]], error: type[Exception], message: str
) -> None:
    tensors = _inputs((2, 2, 5, 4), (2, 2, 6, 4), torch.float32)
    before = [t.detach().clone() for t in tensors]
    with pytest.raises(error) as raised:
        scaled_dot_product_attention(**make(tensors))
    assert message in str(raised.value)
    assert all(torch.equal(t, b) and t.grad is None for t, b in zip(tensors, before))


def test_backend_triton_without_triton_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "_triton_import_error", lambda: "ModuleNotFoundError: No module named 'triton'")
    q, k, v = _inputs((1, 1, 4, 16), (1, 1, 4, 16), torch.float32)
    with pytest.raises(InvalidArgumentError, match="Triton is not importable"):
        scaled_dot_product_attention(q, k, v, backend="triton")
    _close(scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v), torch.float32)


def test_importing_and_running_on_the_cpu_never_imports_triton() -> None:
    code = (
        "import sys, torch, hyperrng, hyperrng.philox.attention as a\n"
        "q = torch.randn(1, 2, 8, 16)\n"
        "a.scaled_dot_product_attention(q, q, q, dropout_p=0.5, philox_key=1, offset=0)\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- the Triton kernels, through Triton's interpreter --------------------------------------------


@needs_triton
@pytest.mark.parametrize(
    "S, offset",
    [(16, 4 * 2**32 - 64), (16, 2**64 - 2 * 2 * 16 * 16 - 1), (18, 6)],
    ids=["aligned, crossing a counter word", "unaligned offset, at the end", "S not a multiple of 4"],
)
def test_triton_kernels_draw_the_portable_mask(S: int, offset: int) -> None:
    q, k, v = _uniform_identity(2, 2, S, S, 16 if S <= 16 else 32, torch.float32)
    out = scaled_dot_product_attention(q, k, v, dropout_p=0.35, philox_key=KEY, offset=offset, backend="triton")
    assert torch.equal(_mask_from_output(out, S), bernoulli((2, 2, S, S), 0.65, KEY, offset))


TRITON_CASES: dict[str, dict[str, Any]] = {
    "float32": {"dtype": torch.float32},
    "float32, causal query block of heads": {
        "dtype": torch.float32, "causal": True, "B": 2, "shard": (slice(1, 2), slice(1, 3), slice(20, 40)),
    },
    "float32, bool mask, a row masked out, offset 2 mod 4": {"dtype": torch.float32, "mask": "bool", "offset": 6},
    "float32, grouped-query heads, additive mask": {"dtype": torch.float32, "group": 2, "mask": "float"},
    "float16, causal": {"dtype": torch.float16, "causal": True},
    "float16, a block of grouped-query heads": {
        "dtype": torch.float16, "group": 2, "shard": (slice(None), slice(2, 4)),
    },
    "bfloat16": {"dtype": torch.bfloat16, "S": 24},
    # The kernels visit the key blocks below the causal diagonal without masks, those crossing it (or S) with:
    # diagonals and ends that fall inside tiles, with L < S, L > S and a query block starting mid-tile.
    "float32, causal, L < S": {"dtype": torch.float32, "causal": True, "L": 21, "S": 50},
    "float16, causal, L > S, offset 1 mod 4": {"dtype": torch.float16, "causal": True, "L": 50, "S": 21, "offset": 5},
    "float32, causal query block from row 13, L < S": {
        "dtype": torch.float32, "causal": True, "L": 45, "S": 45, "shard": (slice(None), slice(None), slice(13, 30)),
    },
    # Keys beyond S in the last block of dk/dv are not masked there (only their own, unstored, gradient rows
    # see them): with every score near -290 (base 2), their probabilities overflow to inf, and must stay in
    # those rows. (float16: at -290, float32's rounding of the scores is 1e-5 of the probabilities.)
    "float16, padded keys overflow": {"dtype": torch.float16, "S": 37, "mask": -200.0},
}  # fmt: skip


@needs_triton
@pytest.mark.parametrize("name", list(TRITON_CASES))
# "padded keys overflow" makes the scores of keys past S overflow on purpose (the interpreter's NumPy says so)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
def test_triton_kernels_agree_with_the_torch_implementation(name: str) -> None:
    _agree(TRITON_CASES[name])


def _agree(case: dict[str, Any]) -> None:
    """The Triton kernels' output and gradients for ``case`` (of :data:`TRITON_CASES`) are the torch
    implementation's."""
    dtype, group, shard = case["dtype"], case.get("group", 1), case.get("shard")
    B, H, L, S, E = case.get("B", 1), 2 * group, case.get("L", 40), case.get("S", 36), 16
    global_shape = (B, H, L, S)
    q, k, v = _inputs((B, H, L, E), (B, H // group, S, E), dtype)
    if shard is not None:  # this block's rows of the query, its heads of the key and value
        heads = shard[1].indices(H)
        kv = (shard[0], slice(heads[0] // group, heads[1] // group))
        q, k, v = (t.detach()[shard if i == 0 else kv].requires_grad_() for i, t in enumerate((q, k, v)))
    kwargs: dict[str, Any] = {"is_causal": case.get("causal", False), "enable_gqa": group > 1}
    generator = torch.Generator().manual_seed(4)
    if case.get("mask") == "bool":
        kwargs["attn_mask"] = torch.rand(L, S, generator=generator) > 0.3
        kwargs["attn_mask"][3] = False
    elif case.get("mask") == "float":
        kwargs["attn_mask"] = torch.randn(1, H, L, S, generator=generator).to(dtype)
    elif isinstance(case.get("mask"), float):
        kwargs["attn_mask"] = torch.full((L, S), case["mask"], dtype=dtype)
    if shard is not None:
        kwargs.update(global_shape=global_shape, shard=shard)
    results = {}
    for backend in ("torch", "triton"):
        out = scaled_dot_product_attention(
            q, k, v, dropout_p=0.2, philox_key=KEY, offset=case.get("offset", 64), backend=backend, **kwargs
        )
        results[backend] = [out, *_grads(out, [q, k, v])]
    for a, b in zip(results["triton"], results["torch"]):
        _close(a, b, dtype)


@needs_triton
@pytest.mark.parametrize(
    "tiles",
    [{"fwd": (16, 32), "dkdv": (32, 16), "dq": (16, 64)}, {"fwd": (16, 16), "dkdv": (16, 16), "dq": (16, 16)}],
    ids=["keys wider than queries", "square"],
)
def test_triton_kernels_agree_whatever_their_tiles(
    tiles: dict[str, tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled tiles are not the interpreter's (forward 128 x 64, dk/dv 32 x 128, float32 32 x 32...):
    where the loops split at the causal diagonal (key blocks wholly below it unmasked) holds whatever the
    orientation of the tiles, for a query block that starts inside a tile and ends inside another."""
    kernels = attention._kernels(True)
    for name, (block_m, block_n) in tiles.items():
        monkeypatch.setitem(kernels._INTERPRETED, name, kernels._Tiles(block_m, block_n, 1, 1))
    shard = (slice(None), slice(None), slice(7, 40))
    _agree({"dtype": torch.float32, "causal": True, "L": 50, "S": 50, "shard": shard, "offset": 12})


@needs_triton
@pytest.mark.parametrize(
    "shapes",
    [
        ((20, 16), (18, 16), (18, 16)),
        ((3, 20, 16), (3, 18, 16), (3, 18, 16)),
        ((2, 1, 3, 20, 16), (2, 1, 3, 18, 16), (2, 1, 3, 18, 16)),
        ((2, 3, 20, 16), (1, 3, 18, 16), (2, 1, 18, 16)),
    ],
    ids=["2-D", "3-D", "5-D", "broadcast key and value"],
)
def test_triton_kernels_take_any_batch_layout(shapes: tuple[tuple[int, ...], ...]) -> None:
    q, k, v = _inputs(shapes[0], shapes[1], torch.float32, shape_v=shapes[2])
    results = {}
    for backend in ("torch", "triton"):
        out = scaled_dot_product_attention(q, k, v, dropout_p=0.3, philox_key=KEY, offset=4, backend=backend)
        results[backend] = [out, *_grads(out, [q, k, v])]
    for a, b in zip(results["triton"], results["torch"]):
        assert a.shape == b.shape
        _close(a, b, torch.float32)


@needs_triton
def test_the_interpreter_leaves_tritons_language_as_it_found_it() -> None:
    """A process that interprets the kernels can still compile kernels afterwards (tests do both). Triton
    before 3.6 leaves what its interpreter patched; hyperrng puts it back after each interpreted launch."""
    import triton.language as tl

    modules = (tl, tl.core, tl.math, tl.core.tensor, tl.core.dtype)
    before = [dict(vars(m)) for m in modules]
    q, k, v = _inputs((1, 1, 16, 16), (1, 1, 16, 16), torch.bfloat16)
    out = scaled_dot_product_attention(q, k, v, dropout_p=0.5, philox_key=KEY, offset=0, backend="triton")
    out.sum().backward()
    hyperrng.philox.random_bits(8, KEY, 0, backend="triton")  # the distributions' kernels, too
    for module, saved in zip(modules, before):
        changed = [name for name, value in vars(module).items() if saved.get(name, value) is not value]
        assert not changed, f"{module} changed: {changed[:5]}"


@needs_triton
def test_backend_triton_refuses_calls_the_kernels_do_not_take() -> None:
    q, k, v = _inputs((1, 2, 4, 8), (1, 2, 4, 8), torch.float32)
    with pytest.raises(InvalidArgumentError, match=r"head dims must be equal and one of \(16, 32, 64, 128\)"):
        scaled_dot_product_attention(q, k, v, backend="triton")
    q, k, v = _inputs((1, 2, 4, 16), (1, 2, 4, 16), torch.float32)
    mask = torch.zeros(4, 4, requires_grad=True)
    with pytest.raises(InvalidArgumentError, match="do not differentiate attn_mask"):
        scaled_dot_product_attention(q, k, v, mask, backend="triton")
    q, k, v = _inputs((2, 1, 2, 4, 16), (2, 1, 2, 4, 16), torch.float32)
    with pytest.raises(InvalidArgumentError, match="fold into"):
        scaled_dot_product_attention(
            q, k, v, backend="triton", global_shape=(2, 3, 2, 4, 4), shard=(slice(None), slice(1, 2))
        )


# -- a real GPU ----------------------------------------------------------------------------------


@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_on_cuda_the_compiled_kernels_draw_the_cpu_mask_and_agree(
    dtype: torch.dtype, head_dim: int, causal: bool
) -> None:
    B, H, L = 2, 3, 200  # not a multiple of any tile
    q, k, v = _uniform_identity(B, H, L, L, 256, torch.float32)
    q, k, v = (t[..., :head_dim].to("cuda", dtype) for t in (q, k, v))
    out = scaled_dot_product_attention(q, k, v, dropout_p=0.1, philox_key=KEY, offset=8, backend="triton")
    expected = bernoulli((B, H, L, L), 0.9, KEY, 8)[..., :head_dim]
    assert torch.equal(_mask_from_output(out, head_dim).cpu(), expected)
    q, k, v = (t.to("cuda") for t in _inputs((B, H, L, head_dim), (B, H, L, head_dim), dtype))
    results = {}
    for backend in ("torch", "triton"):
        out = scaled_dot_product_attention(
            q, k, v, dropout_p=0.1, is_causal=causal, philox_key=KEY, offset=8, backend=backend
        )
        results[backend] = [out, *_grads(out, [q, k, v])]
    for a, b in zip(results["triton"], results["torch"]):
        _close(a, b, dtype)


@pytest.mark.cuda
@needs_triton
def test_on_cuda_auto_runs_the_kernels_in_memory_linear_in_the_sequence() -> None:
    B, H, L, D = 1, 2, 4096, 64
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    triton_out = scaled_dot_product_attention(q, k, v, dropout_p=0.1, philox_key=KEY, offset=0, backend="triton")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=False, philox_key=KEY, offset=0)
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    assert torch.equal(out, triton_out)  # auto chose the kernels
    probabilities = B * H * L * L * 2  # what one bfloat16 L x S tensor per head would take
    assert torch.cuda.max_memory_allocated() - base < probabilities / 8


@pytest.mark.needs_portable_mode
def test_a_gradient_taken_with_create_graph_is_right_and_refuses_to_be_differentiated_again() -> None:
    """As torch's fused attention, portable attention has no second derivative: with ``create_graph=True`` its
    first-order gradients are those without it, and a gradient of them raises our error (before, the
    gradient came back detached, and a gradient penalty through it silently lost its terms)."""
    from hyperrng.errors import InvalidOperationError

    x, w = torch.randn(1, 1, 4, 8, requires_grad=True), torch.randn(8, requires_grad=True)

    def gradients(create_graph: bool) -> tuple[torch.Tensor, ...]:
        with hyperrng.portable_random(1):
            y = (F.scaled_dot_product_attention(x, x, x, dropout_p=0.3) * w).pow(2).sum()
            return torch.autograd.grad(y, [x, w], create_graph=create_graph)

    first, plain = gradients(True), gradients(False)
    assert all(torch.equal(a, b) for a, b in zip(first, plain))
    with pytest.raises(InvalidOperationError, match="no second derivative"):
        torch.autograd.grad(first[0].pow(2).sum() + x.sum(), x)
