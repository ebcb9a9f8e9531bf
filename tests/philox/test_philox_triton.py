"""Specification of the Triton backend: every distribution bit-identical to the torch backend.

On CPU tensors ``backend="triton"`` runs the kernels under Triton's interpreter (see
:mod:`hyperrng.philox._triton`), so these tests prove the kernels without a GPU; the
``cuda``-marked ones repeat the comparison on a real device. Sizes stay small: the
interpreter runs every program of a launch in Python.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hyperrng import philox
from hyperrng.errors import ArgumentTypeError, InvalidArgumentError
from hyperrng.philox import _triton, backends
from hyperrng.philox._shards import ShardGeometry
from hyperrng.portable.mode import portable_random

pytestmark = [pytest.mark.needs_triton, pytest.mark.filterwarnings("ignore::RuntimeWarning")]  # NumPy on x * 0 for inf

# (shape, offset, key): lanes 0 to 3 at the start; a range across global index 2**32 and one
# across block 2**32 (global index 2**34); a key with both words set and the largest key.
POSITIONS = [
    ((7,), 0, 5),
    ((37,), 2**32 - 3, 2**48 + 7),
    ((3, 50), 6, 2**64 - 1),
    ((2, 3, 5), 2**34 - 5, 0x0123456789ABCDEF),
]
# Aligned launches (whole blocks from a block boundary: vector stores on a GPU): one whose counter's low
# word wraps inside a program (blocks 2**32 - 8 to 2**32 + 7), one past 2**32, and a run longer than a
# program and not whole blocks (2,048 elements aligned, the last 3 in a launch of their own).
ALIGNED_POSITIONS = [
    ((4, 8), 0, 5),
    ((64,), 2**34 - 32, 2**48 + 7),
    ((2, 3, 8), 2**32 + 4, 2**64 - 1),
    ((2051,), 8, 0x0123456789ABCDEF),
]

Draw = Callable[[str, tuple[int, ...], int, int, str], torch.Tensor]

EXACT: dict[str, Draw] = {
    "bits": lambda b, s, o, k, d: philox.random_bits(s, k, o, device=d, backend=b),
    "uniform f32": lambda b, s, o, k, d: philox.uniform(s, k, o, device=d, backend=b),
    "uniform f64 bounds": lambda b, s, o, k, d: philox.uniform(s, k, o, torch.float64, -1.5, 2.25, device=d, backend=b),
    "uniform f16": lambda b, s, o, k, d: philox.uniform(s, k, o, torch.float16, device=d, backend=b),
    "uniform bf16 bounds": lambda b, s, o, k, d: philox.uniform(s, k, o, torch.bfloat16, -2, 3, device=d, backend=b),
    "bernoulli bool": lambda b, s, o, k, d: philox.bernoulli(s, 0.3, k, o, device=d, backend=b),
    "bernoulli bf16": lambda b, s, o, k, d: philox.bernoulli(s, 0.7, k, o, dtype=torch.bfloat16, device=d, backend=b),
    "randint int32": lambda b, s, o, k, d: philox.randint(s, -7, 100, k, o, dtype=torch.int32, device=d, backend=b),
    "randint f16": lambda b, s, o, k, d: philox.randint(s, -7, 1000, k, o, dtype=torch.float16, device=d, backend=b),
    "randint full range": lambda b, s, o, k, d: philox.randint(s, 0, 2**32, k, o, device=d, backend=b),
    "dropout f32": lambda b, s, o, k, d: philox.dropout(_x(s, torch.float32).to(d), 0.3, k, o, backend=b),
    "dropout bf16": lambda b, s, o, k, d: philox.dropout(_x(s, torch.bfloat16).to(d), 0.3, k, o, backend=b),
}
# Every other result dtype of each distribution, and uniform spans too small for one multiply (2**-32 times
# the span is not exact in the compute dtype: the kernel multiplies twice, as the torch backend does).
EXACT_DTYPES: dict[str, Draw] = {
    "uniform f32 tiny span": lambda b, s, o, k, d: philox.uniform(s, k, o, torch.float32, -1e-30, 1e-30, device=d,
                                                                 backend=b),
    "uniform bf16 tiny span": lambda b, s, o, k, d: philox.uniform(s, k, o, torch.bfloat16, 0, 3e-39, device=d,
                                                                  backend=b),
    "uniform f64 tiny span": lambda b, s, o, k, d: philox.uniform(s, k, o, torch.float64, 1e-300, 2e-300, device=d,
                                                                 backend=b),
    "uniform f32 from -0.0": lambda b, s, o, k, d: philox.uniform(s, k, o, torch.float32, -0.0, 2.0, device=d,
                                                                 backend=b),
    "bernoulli f32": lambda b, s, o, k, d: philox.bernoulli(s, 0.3, k, o, dtype=torch.float32, device=d, backend=b),
    "bernoulli f16": lambda b, s, o, k, d: philox.bernoulli(s, 0.3, k, o, dtype=torch.float16, device=d, backend=b),
    "bernoulli f64": lambda b, s, o, k, d: philox.bernoulli(s, 0.3, k, o, dtype=torch.float64, device=d, backend=b),
    "randint int8": lambda b, s, o, k, d: philox.randint(s, -100, 27, k, o, dtype=torch.int8, device=d, backend=b),
    "randint uint8": lambda b, s, o, k, d: philox.randint(s, 0, 256, k, o, dtype=torch.uint8, device=d, backend=b),
    "randint int16": lambda b, s, o, k, d: philox.randint(s, -300, 9, k, o, dtype=torch.int16, device=d, backend=b),
    "randint bool": lambda b, s, o, k, d: philox.randint(s, 0, 2, k, o, dtype=torch.bool, device=d, backend=b),
    "randint bf16": lambda b, s, o, k, d: philox.randint(s, -7, 1000, k, o, dtype=torch.bfloat16, device=d, backend=b),
    "randint f32 large": lambda b, s, o, k, d: philox.randint(s, 2**40, 2**40 + 2**32, k, o, dtype=torch.float32,
                                                             device=d, backend=b),
    "randint f64": lambda b, s, o, k, d: philox.randint(s, -(2**50), -(2**50) + 12345, k, o, dtype=torch.float64,
                                                       device=d, backend=b),
    "dropout f16": lambda b, s, o, k, d: philox.dropout(_x(s, torch.float16).to(d), 0.3, k, o, backend=b),
    "dropout f64": lambda b, s, o, k, d: philox.dropout(_x(s, torch.float64).to(d), 0.3, k, o, backend=b),
}  # fmt: skip


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (-0.0 apart from 0.0), NaN where NaN: a NaN's payload is each device's own."""
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(
        a.masked_fill(nan, 0).view(-1).view(torch.uint8), b.masked_fill(nan, 0).view(-1).view(torch.uint8)
    )


def _x(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    x.view(-1)[:3] = torch.tensor([float("inf"), float("nan"), -0.0])  # what x * 0 keeps: NaN, -0.0
    return x


@pytest.mark.parametrize("name", sorted(EXACT))
@pytest.mark.parametrize(("shape", "offset", "key"), POSITIONS + ALIGNED_POSITIONS)
def test_every_exact_distribution_is_bit_identical_to_the_torch_backend(
    name: str, shape: tuple[int, ...], offset: int, key: int
) -> None:
    draw = EXACT[name]
    expected, got = draw("torch", shape, offset, key, "cpu"), draw("triton", shape, offset, key, "cpu")
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert _same_bits(got, expected), name


@pytest.mark.parametrize("name", sorted(EXACT_DTYPES))
@pytest.mark.parametrize(("shape", "offset", "key"), [POSITIONS[1], POSITIONS[3], *ALIGNED_POSITIONS[1:3]])
def test_every_result_dtype_is_bit_identical_to_the_torch_backend(
    name: str, shape: tuple[int, ...], offset: int, key: int
) -> None:
    draw = EXACT_DTYPES[name]
    expected, got = draw("torch", shape, offset, key, "cpu"), draw("triton", shape, offset, key, "cpu")
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert _same_bits(got, expected), name


def test_a_tiny_uniform_span_is_multiplied_twice_and_others_once() -> None:
    """The kernel folds 2**-32 into the span where the product is exact; where it is not, it keeps both.
    A low bound of 0 (either sign) is not added: the values are those of adding it."""
    tiny = _triton.arguments("uniform", (0xFFFFFF00, 2.0**-32, 2e-30, -1e-30), torch.float32)
    usual = _triton.arguments("uniform", (0xFFFFFF00, 2.0**-32, 3.0, -1.0), torch.float32)
    assert tiny.dist == "uniform_tiny" and usual.dist == "uniform"
    assert _triton.arguments("uniform", (0xFFFFFFFF, 2.0**-32, 1e-300, 0.0), torch.float64).dist == "uniform_tiny"
    for low in (0.0, -0.0):
        assert _triton.arguments("uniform", (0xFFFFFF00, 2.0**-32, 1.0, low), torch.float32).dist == "uniform_from_zero"


SPANS = [1, 2, 3, 7, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 1, 2**32]


def test_the_quotient_by_an_invariant_divisor_is_exact() -> None:
    """The Granlund-Montgomery magic numbers of the kernels' 32-bit quotients (randint's remainder, the
    program's run), computed as the kernel does, for the spans randint meets and random divisors."""
    rng = np.random.default_rng(0)
    edges = np.array([0, 1, 2, 3, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 2, 2**32 - 1], dtype=np.uint64)
    divisors = SPANS + [int(d) for d in rng.integers(1, 2**32 + 1, 2000, dtype=np.uint64)]
    for d in divisors:
        magic, shifts = _triton.divisor(d)
        assert 0 <= magic < 2**32 and 0 <= shifts < 2**32 and shifts >> 1 < 32
        near = np.array([k * d + e for k in (1, 2, 3) for e in (-1, 0, 1) if 0 <= k * d + e < 2**32], dtype=np.uint64)
        a = np.concatenate([edges, near, rng.integers(0, 2**32, 200, dtype=np.uint64)])
        t = (a * np.uint64(magic)) >> np.uint64(32)
        q = (t + ((a - t) >> np.uint64(shifts & 1))) >> np.uint64(shifts >> 1)
        assert np.array_equal(q, a // np.uint64(d)), d
    with pytest.raises(ValueError):
        _triton.divisor(2**32 + 1)


@pytest.mark.parametrize("span", SPANS)
def test_randint_is_the_remainder_for_every_span(span: int) -> None:
    """word % span in 32 bits: 1, powers of two, 2**31 +- 1, 2**32 - 1 and 2**32 (no remainder at all), added
    to low bounds negative and large, in 64-bit, 32-bit and floating-point results (uint64 from 2**63 on)."""
    lows = [(0, torch.int64), (-(2**40), torch.int64), (2**40, torch.int64), (-(2**63), torch.int64),
            (-(2**31), torch.int32), (-5, torch.float32), (2**63, torch.uint64)]  # fmt: skip
    for low, dtype in lows:
        for shape, offset, key in (((3, 40), 2**32 + 1, 2**48 + 7), ((64,), 0, 5)):
            expected = philox.randint(shape, low, low + span, key, offset, dtype=dtype, backend="torch")
            got = philox.randint(shape, low, low + span, key, offset, dtype=dtype, backend="triton")
            assert _same_bits(got, expected), (low, dtype, shape)


def test_a_randint_span_past_32_bits_is_refused_by_both_backends() -> None:
    for backend in ("torch", "triton"):
        with pytest.raises(InvalidArgumentError, match="2\\*\\*32"):
            philox.randint((4,), 0, 2**40, 1, backend=backend)


@pytest.mark.parametrize("p", [0.0, 2.0**-32, 0.5, 1 - 2.0**-32, 1.0])
def test_bernoulli_at_the_extremes_of_the_threshold(p: float) -> None:
    """Thresholds 0 (nothing below), 1, 2**31, 2**32 - 1 and 2**32 (everything below) in 32-bit compares."""
    for dtype in (torch.bool, torch.float32, torch.bfloat16):
        for shape, offset in (((64,), 0), ((37,), 2**32 - 3)):
            expected = philox.bernoulli(shape, p, 3, offset, dtype=dtype, backend="torch")
            got = philox.bernoulli(shape, p, 3, offset, dtype=dtype, backend="triton")
            assert torch.equal(got, expected), (p, dtype, shape)


@pytest.mark.parametrize("p", [2.0**-40, 1 - 2.0**-34])
def test_dropout_that_keeps_everything_or_nothing(p: float) -> None:
    """Keep thresholds 2**32 and 0 (what rounds there: p below 2**-33 or above 1 - 2**-33)."""
    for shape, offset in (((4, 8), 0), ((37,), 3)):
        x = _x(shape, torch.float32)
        expected = philox.dropout(x, p, 3, offset, backend="torch")
        assert _same_bits(philox.dropout(x, p, 3, offset, backend="triton"), expected), (p, shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "mask contiguous, values transposed"])
@pytest.mark.parametrize("offset", [0, 2**32 + 2])
def test_dropout_with_its_keep_mask(dtype: torch.dtype, layout: str, offset: int) -> None:
    """What the fused native_dropout launches: values and keep mask in one pass, in any layout of both."""
    x = _x((16, 12), dtype) if layout == "contiguous" else _x((12, 16), dtype).t()
    draw = philox.dropout_draw(0.3, dtype)
    args = _triton.arguments(draw.name, draw.params, draw.value_dtype)
    out = torch.empty_like(x)
    keep = torch.empty_like(x, dtype=torch.bool)
    if layout.startswith("mask"):
        keep = torch.empty(x.shape, dtype=torch.bool)
    _triton.fill(args, ShardGeometry.of(tuple(x.shape)), 9, offset, out, x, keep)
    assert torch.equal(keep, philox.bernoulli(tuple(x.shape), 0.7, 9, offset, backend="torch"))
    assert _same_bits(out, philox.dropout(x.contiguous(), 0.3, 9, offset, backend="torch"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_normal_agrees_with_the_torch_backend_within_a_few_ulp(dtype: torch.dtype) -> None:
    """The integer part is exact; log, sin and cos are each backend's own (the documented few ulp)."""
    for shape, offset, key in POSITIONS + ALIGNED_POSITIONS + [((4096,), 4, 11)]:
        expected = philox.normal(shape, key, offset, dtype, 0.5, 2.0, backend="torch")
        got = philox.normal(shape, key, offset, dtype, 0.5, 2.0, backend="triton")
        ulp = torch.finfo(dtype).eps * expected.abs().clamp(min=1.0)
        assert ((got - expected).abs() <= 4 * ulp).all(), (shape, offset, key)


@pytest.mark.parametrize(
    "shard",
    [
        [slice(2, 6)],  # whole rows: one run
        [slice(2, 6), slice(1, 6)],  # a block of rows and columns: a run per row
        [slice(0, 9), slice(9, 10)],  # one column: runs of one element
        [slice(1, 2), slice(3, 4)],  # one element
    ],
)
def test_a_shard_equals_the_slice_of_the_whole_tensor(shard: list[slice]) -> None:
    for offset in (0, 3, 2**32 - 1):
        whole = philox.uniform((9, 10), 11, offset, backend="torch")
        part = philox.uniform((9, 10), 11, offset, shard=shard, backend="triton")
        assert torch.equal(part, whole[tuple(shard)])


SHARDED: dict[str, Callable[..., torch.Tensor]] = {
    "bits": lambda s, o, **kw: philox.random_bits(s, 7, o, **kw),
    "uniform f32": lambda s, o, **kw: philox.uniform(s, 7, o, **kw),
    "bernoulli bool": lambda s, o, **kw: philox.bernoulli(s, 0.3, 7, o, **kw),
    "randint int32": lambda s, o, **kw: philox.randint(s, -7, 100, 7, o, dtype=torch.int32, **kw),
}


@pytest.mark.parametrize(
    ("global_shape", "shard"),
    [
        ((6, 16), [slice(1, 5), slice(4, 12)]),  # runs of 8, 16 apart: whole blocks from offsets that are
        ((3, 4, 8), [slice(0, 2), slice(1, 3)]),  # multiples of 4; runs of 16, 32 apart
        ((3, 4, 8), [slice(0, 2), slice(1, 3), slice(2, 6)]),  # runs of 4 from lane 2 (aligned from offset 2)
        ((6, 10), [slice(1, 5), slice(4, 8)]),  # runs of 4, 10 apart: never all aligned
    ],
)
def test_a_shard_of_several_runs_equals_the_slice_of_the_whole_tensor(
    global_shape: tuple[int, ...], shard: list[slice]
) -> None:
    """Runs from a table of starts (HAS_STARTS), aligned launches where every run is whole blocks."""
    index = tuple(shard)
    for offset in (0, 2, 2**32 + 4):
        for name, draw in SHARDED.items():
            whole = draw(global_shape, offset, backend="torch")
            assert torch.equal(draw(global_shape, offset, shard=shard, backend="triton"), whole[index]), (name, offset)
        x = _x(tuple(whole[index].shape), torch.bfloat16)
        expected = philox.dropout(x, 0.4, 7, offset, global_shape=global_shape, shard=shard, backend="torch")
        got = philox.dropout(x, 0.4, 7, offset, global_shape=global_shape, shard=shard, backend="triton")
        assert _same_bits(got, expected), offset


def test_every_distribution_is_written_through_the_strides_of_out() -> None:
    """Transposed results: one run per row of the result, element stride > 1 (stored element by element)."""
    for dtype, draw in (
        (torch.int64, lambda o: philox.random_bits((10, 6), 5, 1, out=o, backend="triton")),
        (torch.bool, lambda o: philox.bernoulli((10, 6), 0.3, 5, 8, out=o, backend="triton")),
        (torch.bfloat16, lambda o: philox.uniform((10, 6), 5, 2**32 + 4, torch.bfloat16, out=o, backend="triton")),
        (torch.int64, lambda o: philox.randint((10, 6), -(2**40), 2**31 + 1 - 2**40, 5, 7, out=o, backend="triton")),
    ):
        out = torch.zeros(6, 10, dtype=dtype).t()
        draw(out)
        expected = torch.zeros(10, 6, dtype=dtype)
        draw(expected)
        assert torch.equal(out, expected), dtype


def test_values_are_written_through_any_strides_of_out() -> None:
    wide = torch.zeros(6, 20)
    transposed = wide[:, 3:13].t()  # (10, 6): runs of 6 stored column-wise
    philox.uniform((10, 6), 5, 1, out=transposed, backend="triton")
    assert torch.equal(transposed, philox.uniform((10, 6), 5, 1, backend="torch"))
    assert not wide[:, :3].any() and not wide[:, 13:].any()
    permuted = torch.zeros(4, 3, 5).permute(2, 0, 1)  # no single stride per run: filled through a copy
    philox.random_bits((5, 4, 3), 5, 2, out=permuted.long(), backend="triton")
    bits = torch.zeros(4, 3, 5, dtype=torch.int64).permute(2, 0, 1)
    philox.random_bits((5, 4, 3), 5, 2, out=bits, backend="triton")
    assert torch.equal(bits, philox.random_bits((5, 4, 3), 5, 2, backend="torch"))


def test_the_fused_dropout_backward_equals_the_torch_backends_gradient() -> None:
    """The backward pass draws the mask again (no mask kept) and multiplies as autograd would."""
    grads = {}
    for backend in ("torch", "triton"):
        x = _x((5, 9), torch.float32).nan_to_num().requires_grad_()
        y = philox.dropout(x, 0.4, 3, 2**32 - 2, backend=backend)
        y.backward(torch.linspace(-2, 2, 45).view(5, 9))
        grads[backend] = x.grad
    assert torch.equal(grads["triton"], grads["torch"])


def test_a_dropout_of_a_shard_is_the_slice_of_the_whole_tensors_dropout() -> None:
    x = _x((6, 8), torch.float32)
    whole = philox.dropout(x, 0.5, 9, 4, backend="torch")
    shard = [slice(1, 4), slice(2, 7)]
    part = philox.dropout(x[1:4, 2:7], 0.5, 9, 4, global_shape=(6, 8), shard=shard, backend="triton")
    assert torch.equal(part.nan_to_num(), whole[1:4, 2:7].nan_to_num())


def test_portable_mode_on_the_triton_backend_gives_the_torch_backends_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a GPU runs: every op of the mode drawn by the kernels (forced onto CPU tensors here)."""

    def run() -> list[torch.Tensor]:
        with portable_random(21):
            x = torch.ones(3, 8)
            out, keep = torch.ops.aten.native_dropout(x, 0.25, True)  # the fused dropout of accelerators
            return [torch.rand(5), torch.randn(2, 3), F.dropout(x, 0.5), out, keep, torch.randint(0, 9, (7,))]

    expected = run()
    monkeypatch.setattr(backends, "resolve", lambda backend, device: "triton")
    got = run()
    for i, (a, b) in enumerate(zip(got, expected)):
        same = torch.allclose(a, b, rtol=1e-6) if i == 1 else torch.equal(a, b)  # randn: a few ulp
        assert same, i


def test_backend_is_checked_before_anything_is_drawn() -> None:
    with pytest.raises(ArgumentTypeError, match="backend must be one of"):
        philox.uniform(4, 1, backend=None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="backend must be one of"):
        philox.dropout(torch.ones(4), 0.5, 1, backend="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine where Triton serves no device")
def test_triton_is_refused_by_name_where_it_serves_no_device_and_auto_takes_torch() -> None:
    device = torch.device("cuda")
    with pytest.raises(InvalidArgumentError, match="backend='triton' cannot draw on cuda"):
        backends.resolve("triton", device)
    assert backends.resolve("auto", device) == "torch"
    assert backends.resolve("auto", torch.device("cpu")) == "torch"
    assert backends.resolve("triton", torch.device("cpu")) == "triton"  # the interpreter
    assert backends.describe(torch.device("cpu"))[0] == "torch"


def test_the_probe_names_the_device_type_triton_targets_instead() -> None:
    reason = _triton.probe(torch.device("xla"))
    assert reason is not None and "Triton" in reason


def test_import_hyperrng_imports_no_triton() -> None:
    code = "import sys, hyperrng, hyperrng.philox; print('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_one_launch_covers_a_run_with_programs_of_whole_blocks() -> None:
    assert _triton.grid_size(7, 1) == 1
    # 512 blocks a program, whichever lane a run starts at: 2,045 elements fit one from lane 3
    assert _triton.grid_size(2045, 1) == 1 and _triton.grid_size(2046, 1) == 2
    assert _triton.grid_size(3, 1000) == 1000  # short runs: a program each, of the smallest width
    # runs of whole blocks from lane 0: 2,048 elements fit one program, 64 one of the smallest width
    assert _triton.grid_size(2048, 1, aligned=True) == 1 and _triton.grid_size(2052, 1, aligned=True) == 2
    assert _triton.grid_size(64, 1000, aligned=True) == 1000


def test_contiguous_runs_of_whole_blocks_launch_aligned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which launches take the vector stores (ALIGNED), the blocks they compute, and the split of a long
    run that is not whole blocks into an aligned launch and one for its last elements."""
    launches: list[tuple[int, bool, int]] = []
    real = _triton.kernels

    class Spy:
        def __init__(self, module: object) -> None:
            self.kernel = module.draw_kernel  # type: ignore[attr-defined]

        @property
        def draw_kernel(self) -> object:
            return self

        def __getitem__(self, grid: tuple[int]) -> Callable[..., object]:
            def launch(*args: object, **kwargs: object) -> object:
                launches.append((args[4], kwargs["ALIGNED"], kwargs["BLOCK"]))  # type: ignore[arg-type]
                return self.kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(_triton, "kernels", lambda interpreted: Spy(real(interpreted)))

    def launched(draw: Callable[[], object]) -> list[tuple[int, bool, int]]:
        launches.clear()
        draw()
        return list(launches)

    assert launched(lambda: philox.uniform((4, 8), 1, 4, backend="triton")) == [(32, True, 16)]
    assert launched(lambda: philox.uniform((4, 8), 1, 2, backend="triton")) == [(32, False, 16)]
    assert launched(lambda: philox.uniform((7,), 1, 0, backend="triton")) == [(7, False, 16)]
    assert launched(lambda: philox.uniform((2051,), 1, 8, backend="triton")) == [(2048, True, 512), (3, False, 16)]
    assert launched(lambda: philox.uniform((6, 16), 1, 0, shard=[slice(1, 5), slice(4, 12)], backend="triton")) == [
        (8, True, 16)
    ]
    assert launched(lambda: philox.uniform((6, 10), 1, 0, shard=[slice(1, 5), slice(4, 8)], backend="triton")) == [
        (4, False, 16)
    ]
    out = torch.empty(8, 4).t()
    assert launched(lambda: philox.uniform((4, 8), 1, 0, out=out, backend="triton")) == [(8, False, 16)]
    x = _x((4, 16), torch.float32)[:, ::2]  # an input whose runs are strided: the launch is not aligned
    shard = [slice(1, 5), slice(4, 12)]
    got: list[torch.Tensor] = []
    assert launched(lambda: got.append(philox.dropout(x, 0.5, 1, 0, global_shape=(6, 16), shard=shard,
                                                      backend="triton"))) == [(8, False, 16)]  # fmt: skip
    kept = philox.bernoulli((6, 16), 0.5, 1, 0, backend="torch")[1:5, 4:12]
    assert _same_bits(got[0], philox.apply_dropout_mask(x, kept, 0.5))


def test_the_probe_draws_through_every_launch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test draws that decide whether Triton serves a device (and whether its interpreter runs the kernels)
    cross the unaligned launch, the aligned one over several programs and a split run's tail: a kernel wrong
    on any path is caught before the first draw, and a wrong word there makes the probe refuse."""
    launches: list[tuple[int, bool]] = []
    real = _triton._launch

    def spy(*args: object) -> None:
        launches.append((args[5], args[-1]))  # type: ignore[arg-type]  # (run, runs_aligned)
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_triton, "_launch", spy)
    assert _triton.same_draws(torch.device("cpu"))
    assert launches == [(21, False), (4100, True), (2, False)]
    real_fill = _triton.fill

    def wrong_tail(args: object, geometry: object, key: int, offset: int, out: torch.Tensor, *rest: object) -> object:
        real_fill(args, geometry, key, offset, out, *rest)  # type: ignore[arg-type]
        if out.numel() > 4096:
            out[-1] ^= 1  # one wrong bit, where only the split launch writes
        return out

    monkeypatch.setattr(_triton, "fill", wrong_tail)
    assert not _triton.same_draws(torch.device("cpu"))


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(EXACT))
def test_on_a_gpu_every_exact_distribution_is_bit_identical_to_the_cpu(name: str) -> None:
    draw = EXACT[name]
    for shape, offset, key in [*POSITIONS, (((1 << 20) + 5,), 2**33 + 2, 2**48)]:
        expected = draw("torch", shape, offset, key, "cpu")
        got = draw("auto", shape, offset, key, "cuda")
        assert _same_bits(got.cpu(), expected), name


@pytest.mark.cuda
def test_on_a_gpu_auto_is_the_triton_backend_and_normal_is_within_a_few_ulp() -> None:
    device = torch.device("cuda")
    assert backends.resolve("auto", device) == "triton", backends.describe(device)
    expected = philox.normal((1 << 16) + 3, 7, 2**32 + 1)
    got = philox.normal((1 << 16) + 3, 7, 2**32 + 1, device="cuda").cpu()
    assert ((got - expected).abs() <= 4 * torch.finfo(torch.float32).eps * expected.abs().clamp(min=1.0)).all()


@pytest.mark.needs_sim
def test_kernels_launch_with_the_tensors_device_current_and_the_previous_one_back_after() -> None:
    """Triton launches on the current device: a launch on device 1's tensors makes device 1 current through
    the platform for the launch only; tensors of the current device or of another type change nothing."""
    import hyperrng.platforms as platforms

    with platforms.use("sim") as p:
        assert p.current_device() == 0
        with _triton.launching_on(torch.device("sim", 1)):
            assert p.current_device() == 1
        assert p.current_device() == 0
        for same_or_other in (torch.device("sim", 0), torch.device("cpu")):
            with _triton.launching_on(same_or_other):
                assert p.current_device() == 0
        with pytest.raises(RuntimeError, match="boom"), _triton.launching_on(torch.device("sim", 1)):
            raise RuntimeError("boom")
        assert p.current_device() == 0


@pytest.mark.needs_sim
def test_a_portable_draw_launches_on_its_tensors_device_and_gives_the_current_one_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A draw makes its tensor's device current for its launch only (the draw's own launch, not
    :func:`launching_on`): the launch, stubbed, sees device 1 for a tensor on device 1 while device 0 is
    current, and device 0 is current again after it, after a launch that raises too."""
    import types

    import hyperrng.platforms as platforms

    seen: list[int] = []
    fail = [False]

    class _Kernel:
        def __getitem__(self, grid: object) -> Callable[..., None]:
            def launch(*args: object, **kwargs: object) -> None:
                seen.append(platforms.current().current_device())
                if fail[0]:
                    raise RuntimeError("launch failed")

            return launch

    monkeypatch.setattr(_triton, "kernels", lambda interpreted: types.SimpleNamespace(draw_kernel=_Kernel()))
    monkeypatch.setattr(backends, "resolve", lambda backend, device: "triton")
    with platforms.use("sim") as p, portable_random(7):
        assert p.current_device() == 0
        for index in (1, 0):
            torch.empty(64, device=p.device(index)).uniform_()
            assert seen[-1] == index and p.current_device() == 0
        fail[0] = True
        position = p.get_seed_offset()
        with pytest.raises(RuntimeError, match="launch failed"):
            torch.empty(64, device=p.device(1)).uniform_()
        assert seen[-1] == 1 and p.current_device() == 0
        assert p.get_seed_offset() == position, "a failed launch moves no position"


def test_a_device_draw_makes_few_python_calls_before_its_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host path of a portable draw on a GPU, counted: the Triton backend forced onto CPU tensors, the
    launch stubbed, positions read and moved through a CUDA platform's generator API (the simulated module
    stands in for torch.cuda; its own calls are not counted, as torch.cuda's are C). A draw's host time is
    mostly Python, so the calls of ours it makes are the regression guard (a wall-clock limit would be
    flaky): each op stays within the budget counted when the path was last trimmed (a contiguous tensor's
    launch without the geometry checks, dropout's checks inline and its arguments one look-up: 18 before for
    dropout; the checkpoint checks one call: 22 and 20 before that, 25 and 23 before that, 47 to 50 at first)."""
    import os
    import sys
    import types

    import hyperrng.platforms as platforms

    import hyperrng
    from hyperrng.portable import _kernels

    launches: list[object] = []

    class _Kernel:
        def __getitem__(self, grid: object) -> Callable[..., None]:
            return lambda *args, **kwargs: launches.append(grid)

    monkeypatch.setattr(_triton, "kernels", lambda interpreted: types.SimpleNamespace(draw_kernel=_Kernel()))
    monkeypatch.setattr(_triton, "language_restored", lambda interpreted: contextlib.nullcontext())
    monkeypatch.setattr(backends, "resolve", lambda backend, device: "triton")
    monkeypatch.setattr(_kernels, "_on_the_host", lambda target: False)  # the CPU's own fast path is not a GPU's
    ours = (os.path.dirname(hyperrng.__file__), os.path.dirname(platforms.__file__))
    stand_in = (platforms.simulated.__file__, platforms._simulated_dispatch.__file__)
    calls: list[str] = []

    def count(frame: types.FrameType, event: str, arg: object) -> None:
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(ours) and name not in stand_in:
            calls.append(frame.f_code.co_name)

    x, y = torch.ones(1024), torch.empty(1024)
    ops: dict[str, Callable[[], object]] = {
        "uniform_": lambda: y.uniform_(),
        "normal_": lambda: y.normal_(),
        "bernoulli_": lambda: y.bernoulli_(0.5),
        "native_dropout": lambda: torch.native_dropout(x, 0.1, True),
    }
    budget = {"uniform_": 17, "normal_": 17, "bernoulli_": 19, "native_dropout": 16}
    cuda = platforms.CUDAPlatform(module=platforms.SimulatedDeviceModule(device_type="cuda"))
    with platforms.use(cuda), portable_random(7):
        for name, op in ops.items():
            op()  # first use: caches filled
            before, calls[:] = len(launches), []
            sys.setprofile(count)
            try:
                op()
            finally:
                sys.setprofile(None)
            assert len(launches) == before + 1, f"{name}: one launch"
            assert len(calls) <= budget[name], f"{name}: {len(calls)} calls of ours, budget {budget[name]}: {calls}"


def test_the_kernels_name_no_module_level_constant_that_triton_checks_at_every_launch() -> None:
    """Triton records each module-level constant a kernel (or a kernel it calls) names, with its value at
    compile time, and compares them all again before every launch: twelve cost the draw kernel's launch
    8 us of Python (a third of Triton's own launch). The kernels write their constants as literals, and
    the distribution as a string, so that the list stays empty. Read where this Triton keeps the list."""
    import triton

    for name in ("hyperrng.philox._triton_kernels", "hyperrng.philox._triton_attention_kernels"):
        for interpreted in (False, True):
            module = _triton.load(name, interpreted)
            for fn_name, fn in vars(module).items():
                if not isinstance(fn, triton.runtime.jit.JITFunction):
                    continue
                fn.cache_key  # noqa: B018 -- computes the dependencies, and the list with them
                if not hasattr(fn, "used_global_vals"):
                    pytest.skip(f"Triton {triton.__version__} keeps no list of the constants it checks")
                assert not fn.used_global_vals, f"{name}.{fn_name} names {sorted(n for n, _ in fn.used_global_vals)}"
