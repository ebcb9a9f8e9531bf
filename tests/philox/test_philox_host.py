"""The words of small draws on the host CPU: the optional compiled loop and NumPy give the same words.

``hyperrng.philox._cphilox`` is built at install where a C compiler is present; NumPy computes
the words everywhere else. Both are checked against Random123's definition (tests/philox/test_philox.py's
reference), and the draws built on them (``_torch.fill_host``, portable mode's host path) against
the torch backend's operations (``Kernel``). These are tests of CPU behaviour: the words live in host memory.
"""

from __future__ import annotations

import os
import random
import re

import numpy as np
import pytest
import torch

from hyperrng import philox
from hyperrng.philox import _shards as shards
from hyperrng.philox import _torch as kernels
from hyperrng.philox import _words as words
from hyperrng.philox._shards import ShardGeometry
from tests.philox.test_philox import MASK32, philox_reference, same_bits

compiled = pytest.mark.skipif(
    words._cphilox is None, reason="the optional compiled loop hyperrng.philox._cphilox was not built here"
)


def reference_words(k0: int, k1: int, first: int, m: int) -> list[list[int]]:
    blocks = [philox_reference(((first + i) & MASK32, (first + i) >> 32, 0, 0), (k0, k1)) for i in range(m)]
    return [[block[w] for block in blocks] for w in range(4)]


KEYS = [(0, 0), (MASK32, MASK32), (0x89ABCDEF, 0x01234567)]
FIRSTS = [0, 5, 2**32 - 3, 2**62 - 9]  # 2**32 - 3: the block counter carries into its high word


@pytest.mark.parametrize("k0, k1", KEYS)
@pytest.mark.parametrize("first", FIRSTS)
def test_numpy_words_are_the_philox_words_of_their_blocks(k0: int, k1: int, first: int) -> None:
    assert words.numpy_words(k0, k1, first, 7).tolist() == reference_words(k0, k1, first, 7)


@compiled
@pytest.mark.parametrize("k0, k1", KEYS)
@pytest.mark.parametrize("first", [*FIRSTS, 2**64 - 7])
def test_compiled_words_are_the_philox_words_of_their_blocks(k0: int, k1: int, first: int) -> None:
    out = np.empty((4, 7), dtype=np.uint64)
    assert words._cphilox.words(out, k0, k1, first) is None
    assert out.tolist() == reference_words(k0, k1, first, 7)


@compiled
@pytest.mark.parametrize("m", [0, 1, 4095, 4096, 4097])  # 4096 blocks (16,384 words) and more run without the GIL
def test_compiled_and_numpy_words_agree_on_long_runs(m: int) -> None:
    rng = random.Random(m)
    k0, k1, first = rng.getrandbits(32), rng.getrandbits(32), rng.getrandbits(40)
    assert np.array_equal(words.host_words(k0, k1, first, m), words.numpy_words(k0, k1, first, m))


@compiled
@pytest.mark.parametrize(
    "make_out, fragment",
    [
        (lambda: np.zeros((4, 8), dtype=np.int64), "uint64"),  # signed words
        (lambda: np.zeros((4, 8), dtype=np.uint32), "uint64"),
        (lambda: np.zeros((8, 4), dtype=np.uint64).T, "contiguous"),  # not C-contiguous
        (lambda: np.zeros(6, dtype=np.uint64), "shape (4, m)"),  # not rows of words
        (lambda: np.zeros((2, 8), dtype=np.uint64), "shape (4, m)"),
        (lambda: bytes(256), "writable"),  # read-only
    ],
)
def test_compiled_words_refuse_a_buffer_they_cannot_fill_and_write_nothing(make_out, fragment: str) -> None:
    out = make_out()
    before = bytes(memoryview(np.ascontiguousarray(out)).cast("B")) if not isinstance(out, bytes) else out
    with pytest.raises((ValueError, BufferError, TypeError)) as info:
        words._cphilox.words(out, 1, 2, 3)
    assert fragment in str(info.value) or isinstance(info.value, BufferError)
    after = bytes(memoryview(np.ascontiguousarray(out)).cast("B")) if not isinstance(out, bytes) else out
    assert after == before


@compiled
@pytest.mark.parametrize(
    "args, fragment",
    [((2**32, 0, 0), "key words"), ((0, 2**32, 0), "key words"), ((0, 0, 2**64 - 3), "below 2**64")],
)
def test_compiled_words_refuse_keys_and_blocks_out_of_range_and_write_nothing(args: tuple, fragment: str) -> None:
    out = np.full((4, 4), 7, dtype=np.uint64)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        words._cphilox.words(out, *args)
    assert (out == 7).all()


@compiled
@pytest.mark.parametrize("name", ["words", "bernoulli"])
@pytest.mark.parametrize("bad", [-1, 2**64 + 5])
def test_compiled_functions_refuse_numbers_outside_64_bits_instead_of_wrapping_them(name: str, bad: int) -> None:
    out = np.full((4, 4), 7, dtype=np.uint64) if name == "words" else np.full(4, 7.0, dtype=np.float32)
    args = [0, 0, 0] if name == "words" else [0, 0, 0, 5]
    for i in range(len(args)):
        with pytest.raises(OverflowError):
            getattr(words._cphilox, name)(out, *args[:i], bad, *args[i + 1 :])
    assert (out == 7).all()


@pytest.fixture(params=["compiled", "numpy"])
def word_source(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each word source in turn, with this thread's readahead emptied so the draw computes its words."""
    if request.param == "compiled" and words._cphilox is None:
        pytest.skip("the optional compiled loop hyperrng.philox._cphilox was not built here")
    if request.param == "numpy":
        monkeypatch.setattr(words, "_cphilox", None)  # the readahead's words
        monkeypatch.setattr(kernels, "_cphilox", None)  # fill_host's one-pass Bernoulli
    words._READAHEAD.buffers.clear()
    yield request.param
    words._READAHEAD.buffers.clear()


SMALL_DRAWS = {
    "uniform": (lambda dtype: philox.uniform_draw(dtype, -1.0, 3.0), torch.float32),
    "uniform_bf16": (lambda dtype: philox.uniform_draw(dtype, 0.0, 1.0), torch.bfloat16),
    "bernoulli_f32": (lambda dtype: philox.bernoulli_draw(0.3, dtype), torch.float32),
    "bernoulli_bool": (lambda dtype: philox.bernoulli_draw(0.7, dtype), torch.bool),
    "randint": (lambda dtype: philox.randint_draw(-5, 1000, dtype), torch.int64),
}


def torch_ops_draw(draw: philox.Draw, shape: tuple[int, ...], key: int, offset: int) -> torch.Tensor:
    """The draw by the torch backend's operations (its Kernel), never by fill_host."""
    kernel = kernels.Kernel(
        draw.transform, draw.params, draw.param_dtypes, key, torch.device("cpu"), False, draw.value_dtype
    )
    return shards.fill(ShardGeometry.of(shape), offset, kernel, draw.dtype)


KEY = 0x5EED0000DEADBEEF


@pytest.mark.parametrize("name", SMALL_DRAWS)
@pytest.mark.parametrize("offset", [0, 4, 2**32 * 4 - 8, 2**40 + 12])
@pytest.mark.parametrize("shape", [(32, 64), (5, 3)])
def test_small_cpu_draws_equal_the_torch_backend_with_either_word_source(
    word_source: str, name: str, offset: int, shape: tuple[int, ...]
) -> None:
    make, dtype = SMALL_DRAWS[name]
    draw = make(dtype)
    out = torch.empty(shape, dtype=dtype)
    kernels.fill_host(draw.transform, draw.params, draw.param_dtypes, KEY, offset, out)
    assert same_bits(out, torch_ops_draw(draw, shape, KEY, offset).to(dtype))
    # A second draw right after reads the words the first one's batch computed ahead.
    after = offset + 4 * ((out.numel() + 3) // 4)
    kernels.fill_host(draw.transform, draw.params, draw.param_dtypes, KEY, after, out)
    assert same_bits(out, torch_ops_draw(draw, shape, KEY, after).to(dtype))


@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
@pytest.mark.parametrize("offset", [1, 2, 3, 2**34 - 5, 2**64 - 40_004])  # every lane a draw can start at
@pytest.mark.parametrize("p", [0.0, 0.1, 0.9, 1.0])
def test_compiled_bernoulli_of_any_size_equals_the_torch_backend(dtype: torch.dtype, offset: int, p: float) -> None:
    draw = philox.bernoulli_draw(p, dtype)
    n = 40_001  # beyond the readahead's SMALL_NUMEL: served by the compiled loop alone
    assert n > kernels.SMALL_NUMEL and kernels.host_fill_serves(draw.transform, dtype, n, None)
    out = torch.full((n,), 7, dtype=dtype) if dtype != torch.bool else torch.empty(n, dtype=dtype)
    kernels.fill_host(draw.transform, draw.params, draw.param_dtypes, KEY, offset, out)
    assert same_bits(out, torch_ops_draw(draw, (n,), KEY, offset))


def test_a_large_draw_the_host_path_cannot_serve_goes_to_the_torch_operations() -> None:
    n = kernels.SMALL_NUMEL + 1
    bits = philox.randint_draw(0, 10, torch.int64)
    assert not kernels.host_fill_serves(bits.transform, torch.int64, n, None)  # no words kept for large draws
    draw = philox.bernoulli_draw(0.5, torch.float32)
    strided = torch.empty(2 * n)[::2]
    assert not kernels.host_fill_serves(draw.transform, torch.float32, n, strided)
    assert not kernels.host_fill_serves(draw.transform, torch.float16, n, None)


@compiled
@pytest.mark.parametrize(
    "make_out, args, fragment",
    [
        (lambda: np.zeros(8, dtype=np.float16), (1, 2, 0, 5), "float32, float64 or bool"),
        (lambda: np.zeros((4, 4), dtype=np.float32).T, (1, 2, 0, 5), "contiguous"),
        (lambda: np.zeros(8, dtype=np.float32), (2**32, 2, 0, 5), "key words"),
        (lambda: np.zeros(8, dtype=np.float32), (1, 2, 2**64 - 3, 5), "below 2**64"),
        (lambda: np.zeros(8, dtype=np.float32), (1, 2, 0, 2**32 + 1), "at most 2**32"),
    ],
)
def test_compiled_bernoulli_refuses_what_it_cannot_fill_and_writes_nothing(make_out, args, fragment: str) -> None:
    out = make_out()
    before = out.copy()
    with pytest.raises(ValueError, match=re.escape(fragment)):
        words._cphilox.bernoulli(out, *args)
    assert np.array_equal(out, before)


@pytest.mark.skipif(os.environ.get("HYPERRNG_EXPECT_COMPILED") != "1", reason="HYPERRNG_EXPECT_COMPILED=1 not set")
def test_the_compiled_loop_was_built_where_ci_expects_it() -> None:
    # .ci/run sets the variable: an install that silently stopped building the loop fails here.
    assert words.HOST_WORDS == "compiled" and words._cphilox is not None
