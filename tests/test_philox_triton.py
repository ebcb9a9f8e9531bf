"""Specification of the Triton backend: every distribution bit-identical to the torch backend.

On CPU tensors ``backend="triton"`` runs the kernels under Triton's interpreter (see
:mod:`hyperrng.philox._triton`), so these tests prove the kernels without a GPU; the
``cuda``-marked ones repeat the comparison on a real device. Sizes stay small: the
interpreter runs every program of a launch in Python.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from hyperrng import philox
from hyperrng.errors import ArgumentTypeError, InvalidArgumentError
from hyperrng.philox import _triton, backends
from hyperrng.philox.mode import portable_random

pytestmark = [pytest.mark.needs_triton, pytest.mark.filterwarnings("ignore::RuntimeWarning")]  # NumPy on x * 0 for inf

# (shape, offset, key): lanes 0 to 3 at the start; a range across global index 2**32 and one
# across block 2**32 (global index 2**34); a key with both words set and the largest key.
POSITIONS = [
    ((7,), 0, 5),
    ((37,), 2**32 - 3, 2**48 + 7),
    ((3, 50), 6, 2**64 - 1),
    ((2, 3, 5), 2**34 - 5, 0x0123456789ABCDEF),
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
@pytest.mark.parametrize(("shape", "offset", "key"), POSITIONS)
def test_every_exact_distribution_is_bit_identical_to_the_torch_backend(
    name: str, shape: tuple[int, ...], offset: int, key: int
) -> None:
    draw = EXACT[name]
    expected, got = draw("torch", shape, offset, key, "cpu"), draw("triton", shape, offset, key, "cpu")
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert _same_bits(got, expected), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_normal_agrees_with_the_torch_backend_within_a_few_ulp(dtype: torch.dtype) -> None:
    """The integer part is exact; log, sin and cos are each backend's own (the documented few ulp)."""
    for shape, offset, key in POSITIONS:
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
    reason = _triton.probe(torch.device("xla"), torch.zeros(_triton._PROBE_SHAPE, dtype=torch.int64))
    assert reason is not None and "Triton" in reason


def test_import_hyperrng_imports_no_triton() -> None:
    code = "import sys, hyperrng, hyperrng.philox; print('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_one_launch_covers_a_run_with_programs_of_whole_blocks() -> None:
    assert _triton.grid_size(7, 1) == 1
    # 512 blocks a program, whichever lane a run starts at: 2,045 elements fit one from lane 3
    assert _triton.grid_size(2045, 1) == 1 and _triton.grid_size(2046, 1) == 2
    assert _triton.grid_size(3, 1000) == 1000  # short runs: a program each, of the smallest width


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
