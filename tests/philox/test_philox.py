"""Specification of hyperrng.philox: portable counter-based random numbers."""

from __future__ import annotations

import itertools
import math
import random
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from hyperrng.errors import ArgumentTypeError, HyperRNGError, InvalidArgumentError
from hyperrng.philox import (
    MAX_NUMEL,
    bernoulli,
    dropout,
    normal,
    philox4x32_10,
    randint,
    random_bits,
    uniform,
)
from hyperrng.philox import _shards as shards
from hyperrng.philox import _torch as kernels

MASK32 = 0xFFFFFFFF
KEY = 0x0123456789ABCDEF

# Random123's kat_vectors for philox4x32_10: (counter, key, expected output).
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK32,) * 4, (MASK32, MASK32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def philox_reference(counter: tuple[int, ...], key: tuple[int, ...]) -> tuple[int, ...]:
    """Philox4x32-10 on Python ints, written straight from the Random123 definition."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(10):
        if round_index:
            k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32
    return c0, c1, c2, c3


def reference_word(key: int, index: int) -> int:
    """The word of global index ``index``: lane index % 4 of block counter index // 4."""
    block = index // 4
    return philox_reference((block & MASK32, block >> 32, 0, 0), (key & MASK32, key >> 32))[index % 4]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (distinguishes -0.0 from 0.0 and compares NaN payloads)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.view(as_int), b.view(as_int))
    return torch.equal(a, b)


# Each entry draws a global tensor of ``shape`` with ``key``/``offset`` and optional shard.
DISTRIBUTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "random_bits": lambda shape, offset, **kw: random_bits(shape, KEY, offset, **kw),
    "uniform": lambda shape, offset, **kw: uniform(shape, KEY, offset, **kw),
    "uniform_bf16": lambda shape, offset, **kw: uniform(shape, KEY, offset, torch.bfloat16, **kw),
    "uniform_bounds": lambda shape, offset, **kw: uniform(shape, KEY, offset, low=-2.5, high=4.0, **kw),
    "bernoulli": lambda shape, offset, **kw: bernoulli(shape, 0.3, KEY, offset, **kw),
    "bernoulli_f32": lambda shape, offset, **kw: bernoulli(shape, 0.3, KEY, offset, dtype=torch.float32, **kw),
    "normal": lambda shape, offset, **kw: normal(shape, KEY, offset, **kw),
    "normal_f64": lambda shape, offset, **kw: normal(shape, KEY, offset, torch.float64, mean=1.0, std=2.0, **kw),
}


@pytest.fixture
def tiny_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    """Chunks of 3 blocks, so small tensors cross many chunk boundaries."""
    monkeypatch.setattr(kernels, "CHUNK_BLOCKS", 3)
    return 3


# --- the block function -------------------------------------------------------------


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS)
def test_reference_block_function_reproduces_random123_known_answers(
    counter: tuple[int, ...], key: tuple[int, ...], expected: tuple[int, ...]
) -> None:
    assert philox_reference(counter, key) == expected


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS)
def test_tensor_block_function_reproduces_random123_known_answers(
    counter: tuple[int, ...], key: tuple[int, ...], expected: tuple[int, ...]
) -> None:
    out = philox4x32_10(torch.tensor(counter), torch.tensor(key))
    assert tuple(out.tolist()) == expected


def test_tensor_block_function_matches_reference_on_random_inputs() -> None:
    rng = random.Random(20240611)
    counters = [[rng.getrandbits(32) for _ in range(4)] for _ in range(200)]
    keys = [[rng.getrandbits(32) for _ in range(2)] for _ in range(200)]
    out = philox4x32_10(torch.tensor(counters), torch.tensor(keys))
    assert out.tolist() == [list(philox_reference(tuple(c), tuple(k))) for c, k in zip(counters, keys)]


def test_tensor_block_function_broadcasts_one_key_over_many_counters() -> None:
    counters = torch.tensor([[i, 0, 0, 0] for i in range(5)])
    out = philox4x32_10(counters, torch.tensor([7, 9]))
    assert out.tolist() == [list(philox_reference((i, 0, 0, 0), (7, 9))) for i in range(5)]


# --- the index mapping --------------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 3, 2**32 - 6, 4 * 2**32 - 6, 2**64 - 100])
def test_random_bits_are_the_words_of_their_global_index(offset: int) -> None:
    # 4 * 2**32 - 6 makes the block counter carry from word 0 into word 1.
    out = random_bits(20, KEY, offset)
    assert out.tolist() == [reference_word(KEY, offset + i) for i in range(20)]


def test_the_last_elements_of_the_counter_space_can_be_drawn() -> None:
    out = random_bits((2, 3), 2**64 - 1, 2**64 - 6)
    assert out.flatten().tolist() == [reference_word(2**64 - 1, 2**64 - 6 + i) for i in range(6)]


@pytest.mark.parametrize("name", DISTRIBUTIONS)
@pytest.mark.parametrize("offset", [2**32 - 6, 2**64 - 100])
def test_element_depends_only_on_key_and_global_index(name: str, offset: int) -> None:
    draw = DISTRIBUTIONS[name]
    whole = draw(20, offset)
    for cuts in ([0, 20], [0, 1, 20], [0, 5, 6, 13, 20], [0, 3, 7, 8, 9, 19, 20]):
        pieces = [draw(b - a, offset + a) for a, b in itertools.pairwise(cuts)]
        assert same_bits(torch.cat(pieces), whole)


def test_shape_only_arranges_the_elements_in_row_major_order() -> None:
    assert torch.equal(uniform((3, 4, 5), KEY, 9), uniform(60, KEY, 9).reshape(3, 4, 5))


def test_different_keys_give_different_streams() -> None:
    assert not torch.equal(random_bits(64, 1), random_bits(64, 2))


def test_key_words_are_low_half_then_high_half_of_the_key() -> None:
    words = random_bits(4, KEY)
    expected = philox4x32_10(torch.zeros(4, dtype=torch.int64), torch.tensor([KEY & MASK32, KEY >> 32]))
    assert torch.equal(words, expected)


# --- sharding -----------------------------------------------------------------------

SHARDS = [
    (slice(2, 5),),
    (slice(None), slice(3, 7)),
    (slice(1, 6), slice(0, 9), slice(2, 3)),
    (slice(6, 7), slice(8, 9), slice(4, 5)),
    (slice(-3, None), slice(1, -1)),
    (slice(0, 0),),
    (slice(None), slice(None), slice(None)),
]


@pytest.mark.parametrize("name", DISTRIBUTIONS)
@pytest.mark.parametrize("shard", SHARDS, ids=repr)
def test_shard_equals_the_matching_slice_of_the_global_tensor(name: str, shard: tuple[slice, ...]) -> None:
    draw = DISTRIBUTIONS[name]
    assert same_bits(draw((7, 9, 5), 2**32 - 11, shard=shard), draw((7, 9, 5), 2**32 - 11)[shard])


@pytest.mark.parametrize("shard", SHARDS, ids=repr)
def test_shard_equals_slice_when_runs_are_batched_across_chunks(shard: tuple[slice, ...], tiny_chunks: int) -> None:
    # Tiny chunks push short runs through the batched gather path and long ones through ranges.
    for draw in DISTRIBUTIONS.values():
        assert same_bits(draw((7, 9, 5), 13, shard=shard), draw((7, 9, 5), 13)[shard])


def test_uneven_grid_of_shards_reassembles_the_global_tensor() -> None:
    full = normal((10, 7), KEY, 5)
    rows, cols = [0, 3, 4, 10], [0, 5, 7]
    blocks = [
        [normal((10, 7), KEY, 5, shard=(slice(r0, r1), slice(c0, c1))) for c0, c1 in itertools.pairwise(cols)]
        for r0, r1 in itertools.pairwise(rows)
    ]
    assert same_bits(torch.cat([torch.cat(row, dim=1) for row in blocks], dim=0), full)


def test_shard_of_a_tensor_near_the_end_of_the_counter_space() -> None:
    offset = 2**64 - 4 * 6 - 1
    shard = (slice(1, 4), slice(2, 5))
    assert same_bits(random_bits((4, 6), KEY, offset, shard=shard), random_bits((4, 6), KEY, offset)[shard])


# --- chunking and memory ------------------------------------------------------------


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_chunked_result_equals_single_chunk_result(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    draw = DISTRIBUTIONS[name]
    monkeypatch.setattr(kernels, "CHUNK_BLOCKS", 1 << 20)
    single = draw((5, 11), 7)
    monkeypatch.setattr(kernels, "CHUNK_BLOCKS", 3)
    assert same_bits(draw((5, 11), 7), single)


@pytest.mark.parametrize("draw", [uniform, normal, random_bits])
def test_kernels_never_see_more_than_one_chunk_of_blocks(
    draw: Callable[..., torch.Tensor], monkeypatch: pytest.MonkeyPatch, tiny_chunks: int
) -> None:
    seen: list[int] = []
    write = kernels.Kernel._write  # every eager computation of values goes through it

    def recording_write(self: kernels.Kernel, dst: torch.Tensor, blocks: torch.Tensor, first: int) -> None:
        seen.append(dst.shape[0])
        write(self, dst, blocks, first)

    monkeypatch.setattr(kernels.Kernel, "_write", recording_write)
    draw(1000, KEY, 3)
    draw((40, 25), KEY, 3, shard=(slice(None), slice(1, 3)))  # short runs, batched
    draw((40, 25), KEY, 3, shard=(slice(None), slice(1, 12)))  # runs longer than a chunk
    assert seen and max(seen) <= kernels.chunk_blocks() <= tiny_chunks * kernels.MAX_CHUNK_THREADS


@pytest.mark.slow
def test_eager_scratch_memory_is_bounded_by_the_chunk_not_the_tensor() -> None:
    # Six int64 rows of words and products plus six value rows per chunk: 6 MiB a thread, 24 MiB at most.
    assert kernels.scratch_bytes(1) == kernels.CHUNK_BLOCKS * 12 * 8 <= 6 * 2**20
    assert kernels.scratch_bytes() == kernels.scratch_bytes(64) <= 24 * 2**20
    kernel = kernels.Kernel(
        kernels.UNIFORM, (0xFFFFFF00, 2.0**-32, 1.0, 0.0), [torch.int64] + [torch.float32] * 3, KEY,
        torch.device("cpu"), False, torch.float32,
    )  # fmt: skip
    out = torch.empty(6 * kernels.chunk_blocks() + 5, 4)
    kernel.fill(out, 0)
    assert kernel._scratch is not None and kernel._scratch.shape == (6, kernels.chunk_blocks())
    assert torch.equal(out.flatten(), uniform(out.numel(), KEY))


# --- distributions ------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, bits", [(torch.float32, 24), (torch.float16, 11), (torch.bfloat16, 8), (torch.float64, 32)]
)
def test_uniform_is_the_top_bits_of_the_word_scaled_exactly_into_0_1(dtype: torch.dtype, bits: int) -> None:
    words = random_bits(4096, KEY, 5)
    u = uniform(4096, KEY, 5, dtype)
    assert u.dtype == dtype
    assert torch.equal(u.double() * 2**bits, (words >> (32 - bits)).double())
    assert 0.0 <= u.min().item() and u.max().item() <= 1.0 - 2.0**-bits


def test_uniform_with_bounds_is_low_plus_span_times_u_in_float32() -> None:
    u = uniform(1000, KEY, dtype=torch.float16).float()  # the 11-bit grid of float16
    expected = (u * torch.tensor(7.5 - -1.25) + torch.tensor(-1.25)).to(torch.float16)
    assert same_bits(uniform(1000, KEY, dtype=torch.float16, low=-1.25, high=7.5), expected)


def test_uniform_moments_match_the_uniform_distribution() -> None:
    u = uniform(1 << 16, KEY).double()
    assert abs(u.mean().item() - 0.5) < 0.01
    assert abs(u.var().item() - 1 / 12) < 0.005


def test_bernoulli_is_an_integer_threshold_on_the_word() -> None:
    words = random_bits(4096, KEY)
    assert torch.equal(bernoulli(4096, 0.3, KEY), words < round(0.3 * 2**32))


@pytest.mark.parametrize("p, value", [(0.0, False), (1.0, True), (0, False), (1, True)])
def test_bernoulli_extreme_probabilities_are_exact(p: float, value: bool) -> None:
    assert torch.equal(bernoulli(4096, p, KEY), torch.full((4096,), value))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_bernoulli_in_a_floating_dtype_is_the_bool_result_as_ones_and_zeros(dtype: torch.dtype) -> None:
    for offset, shard in [(3, None), (5, (slice(1, 4), slice(2, 6)))]:
        expected = bernoulli((5, 7), 0.3, KEY, offset, shard=shard).to(dtype)
        assert same_bits(bernoulli((5, 7), 0.3, KEY, offset, dtype=dtype, shard=shard), expected)
        out = torch.empty(expected.shape, dtype=dtype)
        assert bernoulli((5, 7), 0.3, KEY, offset, dtype=dtype, shard=shard, out=out) is out
        assert same_bits(out, expected)


def test_bernoulli_frequency_matches_p() -> None:
    assert abs(bernoulli(1 << 16, 0.25, KEY).double().mean().item() - 0.25) < 0.01


def test_dropout_keeps_where_bernoulli_one_minus_p_is_true_and_scales_the_rest() -> None:
    x = torch.randn(8, 16)
    out = dropout(x, 0.4, KEY, 3)
    kept = bernoulli((8, 16), 0.6, KEY, 3)
    assert torch.equal(kept, random_bits((8, 16), KEY, 3) < round(0.6 * 2**32))
    assert torch.equal(out, x * kept.float().div_(0.6))


def test_dropout_of_non_finite_values_gives_nan_where_dropped_as_torchs_dropout() -> None:
    x = torch.full((64,), math.inf)
    out = dropout(x, 0.5, KEY)
    assert torch.equal(out.isnan(), ~bernoulli(64, 0.5, KEY))


def test_dropout_with_p_one_returns_x_times_zero() -> None:
    x = torch.randn(5, 5, requires_grad=True)
    assert same_bits(dropout(x, 1.0, KEY).detach(), x.detach() * 0.0)


@pytest.mark.parametrize("p, training", [(0.0, True), (0.5, False)])
def test_dropout_returns_its_input_when_nothing_is_dropped(p: float, training: bool) -> None:
    x = torch.randn(5, 5)
    assert dropout(x, p, KEY, training=training) is x


def test_dropout_follows_logical_row_major_order_for_non_contiguous_input() -> None:
    x = torch.randn(6, 4).t()
    assert torch.equal(dropout(x, 0.5, KEY), dropout(x.contiguous(), 0.5, KEY))


def test_dropout_passes_gradients_to_kept_elements_only() -> None:
    x = torch.randn(32, requires_grad=True)
    (grad,) = torch.autograd.grad(dropout(x, 0.5, KEY).sum(), x)
    assert torch.equal(grad, torch.where(bernoulli(32, 0.5, KEY), 2.0, 0.0))


def test_dropout_values_and_gradients_equal_torchs_dropout_arithmetic_bit_for_bit() -> None:
    x = torch.randn(4096, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(4096, dtype=torch.float64)
    ours = dropout(x, 0.3, KEY, 5)
    reference = x * bernoulli(4096, 0.7, KEY, 5).double().div_(0.7)  # F.dropout's CPU decomposition
    (g_ours,) = torch.autograd.grad(ours, x, grad_out, create_graph=True)
    (g_reference,) = torch.autograd.grad(reference, x, grad_out, create_graph=True)
    assert same_bits(ours.detach(), reference.detach()) and same_bits(g_ours, g_reference)


def test_dropout_of_a_shard_equals_the_shard_of_the_global_dropout() -> None:
    x = torch.randn(6, 10, dtype=torch.float16)
    shard = (slice(1, 5), slice(3, 8))
    local = dropout(x[shard], 0.3, KEY, 7, global_shape=(6, 10), shard=shard)
    assert same_bits(local, dropout(x, 0.3, KEY, 7)[shard])


def test_normal_is_box_muller_on_word_pairs_within_float32_rounding() -> None:
    words = random_bits(4096, KEY).view(-1, 2, 2).double()
    u1 = (torch.floor(words[..., 0] / 256) + 1) * 2.0**-24
    u2 = torch.floor(words[..., 1] / 256) * 2.0**-24
    radius = torch.sqrt(-2 * torch.log(u1))
    expected = torch.stack((radius * torch.cos(2 * math.pi * u2), radius * torch.sin(2 * math.pi * u2)), -1)
    assert torch.allclose(normal(4096, KEY).double(), expected.flatten(), rtol=0, atol=1e-5)


def test_normal_moments_and_float32_tail_bound() -> None:
    z = normal(1 << 16, KEY).double()
    assert abs(z.mean().item()) < 0.02 and abs(z.std().item() - 1) < 0.02
    assert z.abs().max().item() <= math.sqrt(-2 * math.log(2.0**-24))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_normal_in_half_precision_is_float32_normal_rounded_once(dtype: torch.dtype) -> None:
    expected = (normal(1000, KEY, mean=0.5, std=3.0)).to(dtype)
    assert same_bits(normal(1000, KEY, dtype=dtype, mean=0.5, std=3.0), expected)


def test_results_are_created_on_the_requested_device() -> None:
    assert uniform(3, KEY, device="cpu").device == torch.device("cpu")


# --- compiled path ------------------------------------------------------------------


def test_importing_the_module_compiles_nothing() -> None:
    code = (
        "import hyperrng.philox, hyperrng.philox._torch as k, sys; "
        "assert k._compiled.cache_info().currsize == 0; assert 'torch._inductor.compile_fx' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_compiled_uniform_is_bitwise_equal_to_eager(tiny_chunks: int) -> None:
    # Tiny chunks give varying block counts, so one dynamic-shape compilation is exercised.
    for offset, shard in [(2**32 - 7, None), (5, (slice(2, 9), slice(1, 4))), (2**64 - 200, (slice(3, 4),))]:
        eager = uniform((11, 13), KEY, offset, shard=shard)
        assert same_bits(uniform((11, 13), KEY, offset, shard=shard, compiled=True), eager)


def test_compiled_code_is_reused_for_new_keys_offsets_sizes_shards_and_bounds() -> None:
    from torch._dynamo.utils import counters

    uniform((11, 13), KEY, 2, compiled=True)  # a range and its partial end blocks
    uniform((11, 13), KEY, 2, shard=(slice(2, 9), slice(1, 4)), compiled=True)  # short runs
    graphs = counters["stats"]["unique_graphs"]
    for n, offset in [(1000, 0), (1001, 3), (4 * 2**16 + 7, 1), (5, 2**64 - 8), (2, 1), (1, 0), (4, 0), (8, 0)]:
        uniform(n, offset + 1, offset, compiled=True)
    uniform((40, 25), 9, 3, shard=(slice(None), slice(1, 3)), compiled=True)
    uniform((40, 25), 9, 3, shard=(slice(5, 6), slice(1, 3)), compiled=True)
    uniform(100, 9, 3, dtype=torch.bfloat16, low=-2.0, high=5.0, compiled=True)
    assert counters["stats"]["unique_graphs"] == graphs


def test_compiled_code_serves_every_thread_count_without_recompiling() -> None:
    # CPU code is built thread-count independent (inductor's cpp.dynamic_threads): left
    # to its default, inductor specialises kernels on the count it compiles under.
    from torch._dynamo.utils import counters

    eager = uniform(1001, KEY, 3)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = uniform(1001, KEY, 3, compiled=True)
        graphs = counters["stats"]["unique_graphs"]
        torch.set_num_threads(2)
        parallel = uniform(1001, KEY, 3, compiled=True)
    finally:
        torch.set_num_threads(previous)
    assert same_bits(serial, eager) and same_bits(parallel, eager)
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_compiled_whole_block_draw_is_returned_without_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_copy(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the compiled range was copied")

    eager = uniform((64, 32), KEY, 8)
    monkeypatch.setattr(kernels.Kernel, "fill", no_copy)
    out = uniform((64, 32), KEY, 8, compiled=True)
    assert out.is_contiguous() and out.shape == (64, 32) and same_bits(out, eager)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["random_bits", "bernoulli", "uniform_bf16", "uniform_bounds"])
def test_compiled_exact_distributions_are_bitwise_equal_to_eager(name: str) -> None:
    draw = DISTRIBUTIONS[name]
    assert same_bits(draw((13, 7), 2**32 - 3, compiled=True), draw((13, 7), 2**32 - 3))


@pytest.mark.slow
@pytest.mark.parametrize("dtype, ulp", [(torch.float32, 2.0**-21), (torch.float64, 2.0**-50)])
def test_compiled_normal_is_within_a_few_ulp_of_eager(dtype: torch.dtype, ulp: float) -> None:
    # Inductor's log/sin/cos/sqrt are not eager's vectorised ones, so only ulp-level agreement.
    eager, compiled = normal(1001, KEY, 5, dtype), normal(1001, KEY, 5, dtype, compiled=True)
    assert torch.allclose(compiled, eager, rtol=4 * ulp, atol=8 * ulp)


@pytest.mark.slow
def test_compiled_normal_shards_equal_slices_of_the_compiled_global_tensor() -> None:
    shard = (slice(2, 11), slice(1, 5))
    full = normal((13, 7), KEY, 2**32 - 3, compiled=True)
    assert same_bits(normal((13, 7), KEY, 2**32 - 3, shard=shard, compiled=True), full[shard])
    assert same_bits(normal(1, KEY, 2**32 - 3 + 20, compiled=True), full.flatten()[20:21])


# --- bad input ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, fragment",
    [
        (-1, "[0, 2**64 - 1]"),
        (2**64, "[0, 2**64 - 1]"),
    ],
)
def test_bad_keys_are_refused(key: Any, fragment: str) -> None:
    with pytest.raises(InvalidArgumentError, match=fragment.replace("[", r"\[").replace("*", r"\*")) as info:
        uniform(4, key)
    assert isinstance(info.value, ValueError) and isinstance(info.value, HyperRNGError)


@pytest.mark.parametrize(("key", "fragment"), [(True, "bool"), (1.5, "must be an int"), ("3", "must be an int")])
def test_keys_of_the_wrong_type_are_a_type_error(key: Any, fragment: str) -> None:
    with pytest.raises(ArgumentTypeError, match=fragment) as info:
        uniform(4, key)
    assert isinstance(info.value, TypeError) and isinstance(info.value, HyperRNGError)


@pytest.mark.parametrize(
    "offset, numel, fragment, error",
    [
        (-1, 4, ">= 0", InvalidArgumentError),
        (True, 4, "bool", ArgumentTypeError),
        (2.0, 4, "must be an int", ArgumentTypeError),
        (2**64 - 3, 4, "overflows the 2\\*\\*64 counter", InvalidArgumentError),
    ],
)
def test_bad_offsets_are_refused(offset: Any, numel: int, fragment: str, error: type[Exception]) -> None:
    with pytest.raises(error, match=fragment):
        random_bits(numel, KEY, offset)


def test_counter_range_is_checked_against_the_global_shape_not_the_shard() -> None:
    with pytest.raises(InvalidArgumentError, match="overflows"):
        random_bits((4, 4), KEY, 2**64 - 10, shard=(slice(0, 1),))


@pytest.mark.parametrize(
    "shape, fragment, error",
    [
        ((-1, 2), "negative dimension", InvalidArgumentError),
        ((2, 1.5), "must be an int", ArgumentTypeError),
        ((True,), "bool", ArgumentTypeError),
        ("ab", "must be an int", ArgumentTypeError),
        (2.0, "int or a sequence", ArgumentTypeError),
        ((2**31, 2**31), "2\\*\\*62", InvalidArgumentError),
    ],
)
def test_bad_shapes_are_refused(shape: Any, fragment: str, error: type[Exception]) -> None:
    with pytest.raises(error, match=fragment) as info:
        uniform(shape, KEY)
    assert isinstance(info.value, HyperRNGError)


@pytest.mark.parametrize("p", [-0.1, 1.1, math.nan, math.inf])
def test_probabilities_outside_0_1_are_refused(p: float) -> None:
    with pytest.raises(InvalidArgumentError, match=r"in \[0, 1\]") as info:
        bernoulli(4, p, KEY)
    assert isinstance(info.value, ValueError)
    with pytest.raises(InvalidArgumentError, match=r"in \[0, 1\]"):
        dropout(torch.ones(4), p, KEY)


@pytest.mark.parametrize("p", ["0.5", True, None, torch.tensor(0.5)])
def test_probabilities_that_are_not_real_numbers_are_a_type_error(p: Any) -> None:
    with pytest.raises(ArgumentTypeError, match="p must be a real number"):
        bernoulli(4, p, KEY)
    with pytest.raises(ArgumentTypeError, match="p must be a real number"):
        dropout(torch.ones(4), p, KEY)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64, torch.float8_e4m3fn])
@pytest.mark.parametrize("draw", [uniform, normal])
def test_unsupported_dtypes_are_refused(draw: Any, dtype: Any) -> None:
    with pytest.raises(ArgumentTypeError, match="supports dtypes") as info:
        draw(4, KEY, dtype=dtype)
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.complex64, "float32", None])
def test_bernoulli_refuses_dtypes_other_than_bool_and_floating_point(dtype: Any) -> None:
    with pytest.raises(ArgumentTypeError, match="bernoulli supports|dtype must be a torch.dtype") as info:
        bernoulli(4, 0.5, KEY, dtype=dtype)
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize("dtype", ["float32", float, None, 32])
@pytest.mark.parametrize("draw", [uniform, normal])
def test_dtypes_that_are_not_torch_dtypes_are_a_type_error(draw: Any, dtype: Any) -> None:
    with pytest.raises(ArgumentTypeError, match="dtype must be a torch.dtype such as torch.float32"):
        draw(4, KEY, dtype=dtype)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"low": 2.0, "high": 1.0}, "low must be <= high"),
        ({"low": -math.inf}, "low must be finite"),
        ({"high": math.inf}, "high must be finite"),
        ({"low": math.nan}, "low must be finite"),
        ({"high": 1e5, "dtype": torch.float16}, "high=100000.0 is outside the finite range of torch.float16"),
        ({"low": -1e39}, "low=-1e[+]?39 is outside the finite range of torch.float32"),
        ({"low": -3e38, "high": 3e38}, "high - low = 6e[+]?38 overflows torch.float32"),
        ({"low": -1e308, "high": 1e308, "dtype": torch.float64}, "overflows torch.float64"),
    ],
)
def test_bad_uniform_bounds_are_refused(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidArgumentError, match=fragment):
        uniform(4, KEY, **kwargs)


@pytest.mark.parametrize("kwargs", [{"high": "1"}, {"low": None}, {"low": torch.tensor(0.0)}, {"high": True}])
def test_uniform_bounds_of_the_wrong_type_are_a_type_error(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ArgumentTypeError, match=f"{next(iter(kwargs))} must be a real number"):
        uniform(4, KEY, **kwargs)


def test_normal_parameters_at_the_edge_of_the_dtype_range_are_accepted() -> None:
    assert torch.isfinite(normal(4096, KEY, mean=3.4e38, std=1.0)).all()
    assert torch.isfinite(normal(4096, KEY, dtype=torch.float16, std=1e4)).all()


def test_bounds_at_the_edge_of_the_dtype_range_are_accepted_and_stay_finite() -> None:
    u = uniform(4096, KEY, dtype=torch.float16, low=-65504.0, high=65504.0)
    assert torch.isfinite(u).all() and u.min() >= -65504 and u.max() <= 65504


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"std": -1.0}, "std must be >= 0"),
        ({"mean": math.nan}, "mean must be finite"),
        ({"std": math.inf}, "std must be finite"),
        ({"mean": -math.inf}, "mean must be finite"),
        ({"std": 2e4, "dtype": torch.float16}, "beyond the finite range of torch.float16"),
        ({"mean": 3.4e38, "std": 1e37}, "beyond the finite range of torch.float32"),
    ],
)
def test_bad_normal_parameters_are_refused(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidArgumentError, match=fragment):
        normal(4, KEY, **kwargs)


@pytest.mark.parametrize("kwargs", [{"std": "1"}, {"mean": None}, {"std": False}])
def test_normal_parameters_of_the_wrong_type_are_a_type_error(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ArgumentTypeError, match=f"{next(iter(kwargs))} must be a real number"):
        normal(4, KEY, **kwargs)


@pytest.mark.parametrize(
    "shard, fragment",
    [
        ((slice(0, 4, 2),), "has step 2; only step 1"),
        ((slice(0, 4, 0),), "has step 0; only step 1"),
        ((slice(None, None, -1),), "has step -1; only step 1"),
        ((slice(None),) * 3, "has 3 slices"),
    ],
)
def test_bad_shards_are_refused(shard: Any, fragment: str) -> None:
    with pytest.raises(InvalidArgumentError, match=fragment) as info:
        uniform((4, 4), KEY, shard=shard)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "shard, fragment",
    [
        ((0, 1), r"shard\[0\] must be a slice"),
        ((slice(0, 2), 1), r"shard\[1\] must be a slice"),
        (slice(0, 1), "shard must be a sequence of slices"),
        ("ab", "shard must be a sequence of slices"),
        ({0: slice(0, 1)}, "shard must be a sequence of slices"),
        ([slice("a", None)], r"shard\[0\].start must be an int"),
        ([slice(None, 2.0)], r"shard\[0\].stop must be an int"),
        ([slice(True, 3)], r"shard\[0\].start must be an int, got the bool"),
        ([slice(0, 3, "1")], r"shard\[0\].step must be an int"),
    ],
)
def test_shards_of_the_wrong_type_are_a_type_error(shard: Any, fragment: str) -> None:
    with pytest.raises(ArgumentTypeError, match=fragment) as info:
        uniform((4, 4), KEY, shard=shard)
    assert isinstance(info.value, TypeError) and isinstance(info.value, HyperRNGError)


def test_shard_bounds_may_be_numpy_integers_and_steps_one() -> None:
    shard = (slice(np.int64(1), np.int32(3), 1), slice(None, None, None))
    assert torch.equal(uniform((4, 4), KEY, shard=shard), uniform((4, 4), KEY)[1:3])


def test_dropout_refuses_integer_tensors_and_non_tensors() -> None:
    with pytest.raises(ArgumentTypeError, match="floating-point"):
        dropout(torch.ones(4, dtype=torch.int64), 0.5, KEY)
    with pytest.raises(ArgumentTypeError, match="x to be a floating-point torch.Tensor, got list"):
        dropout([1.0, 2.0], 0.5, KEY)  # type: ignore[arg-type]


@pytest.mark.parametrize("flag", ["training", "compiled"])
@pytest.mark.parametrize("value", ["no", 0, None, 1.0])
def test_dropout_flags_must_be_bools(flag: str, value: Any) -> None:
    with pytest.raises(ArgumentTypeError, match=f"{flag} must be a bool"):
        dropout(torch.ones(4), 0.5, KEY, **{flag: value})


def test_dropout_accepts_numpy_bools_for_training() -> None:
    x = torch.ones(4)
    assert dropout(x, 0.5, KEY, training=np.bool_(False)) is x


def test_dropout_refuses_a_tensor_that_does_not_match_its_shard() -> None:
    with pytest.raises(InvalidArgumentError, match="has shape"):
        dropout(torch.ones(3, 3), 0.5, KEY, global_shape=(6, 6), shard=(slice(0, 2),))
    with pytest.raises(InvalidArgumentError, match="together"):
        dropout(torch.ones(3, 3), 0.5, KEY, global_shape=(6, 6))


def test_dropout_validates_its_key_even_when_not_training() -> None:
    with pytest.raises(InvalidArgumentError):
        dropout(torch.ones(3), 0.5, -1, training=False)


@pytest.mark.parametrize(
    "counter, key, error, fragment",
    [
        (torch.zeros(4, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), ArgumentTypeError, "int64"),
        (torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), InvalidArgumentError, r"\(\.\.\., 4\)"),
        (torch.tensor([2**32, 0, 0, 0]), torch.zeros(2, dtype=torch.int64), InvalidArgumentError, "counter words"),
        (torch.zeros(4, dtype=torch.int64), torch.tensor([-1, 0]), InvalidArgumentError, "key words"),
    ],
)
def test_block_function_refuses_bad_words(
    counter: torch.Tensor, key: torch.Tensor, error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=fragment):
        philox4x32_10(counter, key)


def test_block_function_refuses_non_tensors_and_mismatched_batches() -> None:
    with pytest.raises(ArgumentTypeError, match="counter must be an int64 torch.Tensor"):
        philox4x32_10([0, 0, 0, 0], torch.zeros(2, dtype=torch.int64))  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="key must be an int64 torch.Tensor"):
        philox4x32_10(torch.zeros(4, dtype=torch.int64), (1, 2))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="do not broadcast"):
        philox4x32_10(torch.zeros(3, 4, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64))


# --- devices ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device, fragment",
    [
        ("bogus", "device 'bogus' is not a device torch knows"),
        ("cuda:-1", "is not a device torch knows"),
        (-1, "device -1 is not a device torch knows"),
    ],
)
def test_devices_torch_cannot_name_are_refused(device: Any, fragment: str) -> None:
    with pytest.raises(InvalidArgumentError, match=fragment) as info:
        uniform(4, KEY, device=device)
    assert isinstance(info.value, ValueError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a build or machine without CUDA")
def test_devices_this_process_lacks_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="device 'cuda' is not available in this process"):
        uniform(4, KEY, device="cuda")
    with pytest.raises(InvalidArgumentError, match="is not available in this process"):
        bernoulli(4, 0.5, KEY, device=torch.device("cuda", 3))


@pytest.mark.parametrize("device", [3.5, ["cpu"], True, object()])
def test_devices_of_the_wrong_type_are_a_type_error(device: Any) -> None:
    with pytest.raises(ArgumentTypeError, match="device must be a torch.device, a string"):
        normal(4, KEY, device=device)


@pytest.mark.parametrize("device", ["cpu", "cpu:0", torch.device("cpu"), None])
def test_every_spelling_of_the_cpu_is_accepted(device: Any) -> None:
    assert torch.equal(uniform(6, KEY, device=device), uniform(6, KEY))


# --- sizes and counters -------------------------------------------------------------


def test_max_numel_is_2_to_the_36_elements_per_call() -> None:
    assert MAX_NUMEL == 2**36


@pytest.mark.parametrize("shape", [(2**40,), (2**20, 2**20), (2**36 + 1,), (2**18, 2**18 + 1)])
@pytest.mark.parametrize("draw", [uniform, normal, random_bits])
def test_draws_larger_than_max_numel_are_refused_before_any_allocation(
    draw: Callable[..., torch.Tensor], shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_work(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("work started before the size was checked")

    monkeypatch.setattr(kernels, "Kernel", no_work)
    monkeypatch.setattr(shards, "fill", no_work)
    with pytest.raises(InvalidArgumentError, match="more than MAX_NUMEL = 2\\*\\*36 per call"):
        draw(shape, KEY)


def test_a_small_shard_of_a_global_shape_larger_than_max_numel_is_drawn() -> None:
    shard = (slice(2**40 - 7, None),)
    assert torch.equal(uniform((2**40,), KEY, shard=shard), uniform(7, KEY, 2**40 - 7))
    with pytest.raises(InvalidArgumentError, match="the shard .* more than MAX_NUMEL"):
        uniform((2**40,), KEY, shard=(slice(0, 2**37),))


def test_a_shape_whose_counters_pass_2_to_the_64_is_an_offset_error() -> None:
    with pytest.raises(InvalidArgumentError, match="overflows the 2\\*\\*64 counter space by 4"):
        uniform((2**30, 2**30), KEY, 2**64 - 2**60 + 4)
    with pytest.raises(InvalidArgumentError, match="overflows"):
        bernoulli((2**60,), 0.5, KEY, 2**64 - 2**59)


def test_numpy_integer_keys_and_offsets_are_accepted() -> None:
    assert torch.equal(random_bits(5, np.uint64(2**64 - 1), np.int64(3)), random_bits(5, 2**64 - 1, 3))


@pytest.mark.parametrize("compiled", ["yes", 1, None])
@pytest.mark.parametrize("draw", [uniform, normal, random_bits])
def test_compiled_must_be_a_bool(draw: Callable[..., torch.Tensor], compiled: Any) -> None:
    with pytest.raises(ArgumentTypeError, match="compiled must be a bool"):
        draw(4, KEY, compiled=compiled)


BAD_CALLS: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    ("device", lambda: uniform(4, KEY, device="bogus"), InvalidArgumentError, "device"),
    ("device type", lambda: uniform(4, KEY, device=1.5), ArgumentTypeError, "device"),
    ("shard bound", lambda: uniform((4,), KEY, shard=[slice("a", None)]), ArgumentTypeError, "shard"),
    ("shard step", lambda: uniform((4,), KEY, shard=[slice(0, 4, 0)]), InvalidArgumentError, "step 0"),
    ("size", lambda: uniform((2**40,), KEY), InvalidArgumentError, "MAX_NUMEL"),
    ("nan bound", lambda: uniform(4, KEY, low=math.nan), InvalidArgumentError, "low"),
    ("inf std", lambda: normal(4, KEY, std=math.inf), InvalidArgumentError, "std"),
    ("nan p", lambda: bernoulli(4, math.nan, KEY), InvalidArgumentError, "p must be"),
    ("dtype type", lambda: uniform(4, KEY, dtype="float32"), ArgumentTypeError, "dtype"),
    ("dtype", lambda: normal(4, KEY, dtype=torch.int8), ArgumentTypeError, "normal supports"),
    ("key", lambda: random_bits(4, -1), InvalidArgumentError, "key"),
    ("offset", lambda: random_bits(4, KEY, -1), InvalidArgumentError, "offset"),
    ("counter end", lambda: random_bits(8, KEY, 2**64 - 4), InvalidArgumentError, "overflows"),
    ("compiled", lambda: random_bits(4, KEY, compiled="no"), ArgumentTypeError, "compiled"),
    ("shape", lambda: random_bits((4, -1), KEY), InvalidArgumentError, "negative"),
    ("dropout flag", lambda: dropout(torch.ones(4), 0.5, KEY, training="no"), ArgumentTypeError, "training"),
]


@pytest.mark.parametrize("name, call, error, fragment", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_every_bad_input_is_a_typed_error_raised_before_any_work(
    name: str, call: Callable[[], object], error: type[Exception], fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_work(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(kernels, "Kernel", no_work)
    with pytest.raises(error, match=fragment) as info:
        call()
    assert isinstance(info.value, HyperRNGError)
    expected_builtin = TypeError if issubclass(error, ArgumentTypeError) else ValueError
    assert isinstance(info.value, expected_builtin)


def test_the_triton_backend_without_triton_is_refused_with_a_typed_error() -> None:
    """Where Triton cannot be imported (here: made unimportable in a process of its own), backend="triton"
    on the CPU names why instead of raising Python's ModuleNotFoundError."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from hyperrng import philox\n"
        "from hyperrng.errors import InvalidArgumentError\n"
        "try:\n    philox.uniform((4,), 1, backend='triton')\n"
        "except InvalidArgumentError as exc:\n    print('refused:', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("refused: backend='triton' cannot draw on the CPU: Triton's interpreter cannot")


_COMPILED_DRAWS = """
import torch, torch._dynamo.exc
from hyperrng import philox

def step(x, offset):
    draws = (
        philox.random_bits((8,), key=1, offset=offset),
        philox.uniform((100,), key=2, offset=offset),
        philox.bernoulli((5000,), 0.3, key=3, offset=offset),  # the compiled loop's size
        philox.randint((8,), -3, 9, key=4, offset=offset),
        philox.normal((30,), key=5, offset=offset),
        philox.dropout(x, 0.5, key=6, offset=offset),
    )
    return (x * 2, *draws)  # the graph around the draws is compiled

x = torch.ones(64)
compiled = torch.compile(step)
for offset in (0, 8, 4096, 12):
    got, want = compiled(x, offset), step(x, offset)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), offset
torch._dynamo.reset()
try:
    torch.compile(step, fullgraph=True)(x, 0)
except torch._dynamo.exc.Unsupported:  # Dynamo's refusal of a function it must not trace
    print("refused")
"""


def test_explicit_key_draws_inside_torch_compile_draw_the_eager_numbers_behind_a_graph_break() -> None:
    """Inside a compiled function (inductor, on the CPU) every explicit-key draw runs as eager code behind a
    graph break: the numbers of eager code at every offset, never a host path traced into the graph (whose
    compiled C loop, word readahead and ``out=`` writers inductor cannot compile); ``fullgraph=True``
    refuses them, as the docstring of ``_generate`` says. In a process of its own: inductor's CPU code on
    older torch sets the processor to flush subnormal floats, for every later test of the process."""
    run = subprocess.run([sys.executable, "-c", _COMPILED_DRAWS], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.split() == ["refused"], run.stderr[-3000:]


def test_randint_bounds_at_the_ends_of_the_64_bit_integers() -> None:
    """A uint64 range from 2**63 on is computed as the int64 of the same bits, small draws (the host's
    readahead) as large ones; a range outside the 64-bit integers is refused with what to do, not an overflow."""
    for low, high in ((2**63, 2**63 + 10), (2**63 - 5, 2**63 + 5), (2**64 - 2**32, 2**64)):
        expected = [low + w % (high - low) for w in random_bits((20_000,), 5, 8).tolist()]
        for n in (3, 20_000):  # both sides of the host's small-draw path
            got = randint((n,), low, high, 5, 8, dtype=torch.uint64)
            assert got.tolist() == expected[:n], (low, n)
    for dtype, low in ((torch.float64, 2**70), (torch.float64, -(2**63) - 1), (torch.uint64, 2**64)):
        with pytest.raises(InvalidArgumentError, match="64-bit integers|does not fit"):
            randint((3,), low, low + 10, 5, dtype=dtype)
