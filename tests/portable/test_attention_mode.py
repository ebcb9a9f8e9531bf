"""``F.scaled_dot_product_attention`` in portable mode: the portable attention, at the mode's position."""

from __future__ import annotations

import warnings
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import hyperrng
from hyperrng.philox import attention
from hyperrng.sharding.tracker import ShardedRNGTracker
from tests._dist import run_ranks

pytestmark = pytest.mark.needs_portable_mode

SEED = 11


@pytest.fixture(autouse=True)
def _cpu() -> Any:
    """These are tests of the CPU's tensors (the takeover is keyed by device; the CUDA tests are marked)."""
    with platforms.use(platforms.CPUPlatform()) as p:
        yield p


def _qkv(b: int = 2, h: int = 4, length: int = 6, s: int = 6, e: int = 8, grad: bool = True) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shapes = [(b, h, length, e), (b, h, s, e), (b, h, s, e)]
    return [torch.randn(shape, generator=g).requires_grad_(grad) for shape in shapes]


def test_sdpa_with_dropout_is_the_portable_attention_at_the_modes_position() -> None:
    q, k, v = _qkv()
    with hyperrng.portable_random(SEED):
        first = torch.rand(3)  # the attention starts at offset 4
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True)
        after = hyperrng.current_platform().get_seed_offset()
    expected = attention.scaled_dot_product_attention(
        q, k, v, dropout_p=0.25, is_causal=True, philox_key=SEED, offset=4
    )
    assert torch.equal(first, hyperrng.philox.uniform(3, SEED, 0))
    assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6)
    assert after == (SEED, 4 + 2 * 4 * 6 * 6)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_sdpa_without_dropout_runs_torchs_kernels_and_draws_nothing() -> None:
    q, k, v = _qkv(grad=False)
    with hyperrng.portable_random(SEED):
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0)
        assert hyperrng.current_platform().get_seed_offset() == (SEED, 0)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))


def test_outside_the_mode_sdpa_draws_torchs_own_mask() -> None:
    q, k, v = _qkv(grad=False)
    with hyperrng.portable_random(SEED):
        pass  # the takeover is registered
    torch.manual_seed(5)
    a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(5)
    b = torch.ops.aten._scaled_dot_product_attention_math.default.decompose(q, k, v, dropout_p=0.5)[0]
    assert torch.equal(a, b)


def test_a_query_block_inside_a_sharded_region_is_the_row_slice_of_the_whole_attention() -> None:
    """Context parallelism: each rank computes its query rows against every key."""
    q, k, v = _qkv(length=8, s=8, grad=False)
    with hyperrng.portable_random(SEED):
        whole = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True)
    tracker = ShardedRNGTracker()
    for rank in range(2):
        rows = slice(4 * rank, 4 * rank + 4)
        with hyperrng.portable_random(SEED):
            with tracker.distribute_region(((2,), (rank,)), [Shard(2)], (2, 4, 8, 8)):
                block = F.scaled_dot_product_attention(q[:, :, rows], k, v, dropout_p=0.5, is_causal=True)
            assert hyperrng.current_platform().get_seed_offset() == (SEED, 2 * 4 * 8 * 8)
        assert torch.allclose(block, whole[:, :, rows], rtol=1e-6, atol=1e-6)


def test_a_transformer_layer_with_dropout_trains_in_portable_mode_with_no_change_to_its_code() -> None:
    def train() -> list[float]:
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.2, batch_first=True)
        mha = torch.nn.MultiheadAttention(16, 2, dropout=0.3, batch_first=True)
        opt = torch.optim.SGD([*layer.parameters(), *mha.parameters()], lr=0.1)
        x = torch.randn(3, 5, 16)
        losses = []
        with hyperrng.portable_random(SEED):
            for _ in range(2):
                h = layer(x)
                h, _ = mha(h, h, h)
                loss = h.pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        return losses

    assert train() == train()  # the same portable numbers twice over


# -- DTensor inputs on a 2-rank mesh ---------------------------------------------------------------
def _dtensor_rank(rank: int, world_size: int, placement_dim: int) -> list[Any] | None:
    """The rank's attention and position; ``None`` where this torch's DTensor cannot run the math
    attention (what portable mode hands a DTensor) on these placements at all."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    q, k, v = _qkv(grad=False)
    try:  # the math attention views (batch, heads) as one; torch 2.9's DTensor refuses it over sharded heads
        distribute_tensor(q, mesh, [Shard(placement_dim)]).view(-1, *q.shape[2:])
    except RuntimeError:
        return None
    with warnings.catch_warnings(), hyperrng.portable_random(SEED):
        warnings.simplefilter("ignore")
        placements = [Shard(placement_dim)]
        dq, dk, dv = (distribute_tensor(t, mesh, placements) for t in (q, k, v))
        out = F.scaled_dot_product_attention(dq, dk, dv, dropout_p=0.5).redistribute(mesh, [Replicate()])
        position = list(hyperrng.current_platform().get_seed_offset())
    return [out.to_local().tolist(), position]


@pytest.mark.multiproc
@pytest.mark.parametrize("placement_dim", [0, 1], ids=["batch", "heads"])
def test_batch_and_head_sharded_dtensor_inputs_give_the_unsharded_attention(placement_dim: int) -> None:
    q, k, v = _qkv(grad=False)
    with hyperrng.portable_random(SEED):
        whole = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        position = list(hyperrng.current_platform().get_seed_offset())
    results = run_ranks(_dtensor_rank, 2, placement_dim)
    if None in results:
        pytest.skip(
            f"torch {torch.__version__}'s DTensor cannot view a tensor sharded on dimension {placement_dim} with that "
            "dimension merged into another, as the math attention does (outside portable mode too)"
        )
    for got, got_position in results:
        assert torch.allclose(torch.tensor(got), whole, rtol=1e-5, atol=1e-6)
        assert got_position == position


@pytest.mark.cuda
def test_on_cuda_sdpa_in_portable_mode_draws_the_cpus_mask() -> None:
    q, k, v = (t.detach().to("cuda", torch.float16) for t in _qkv(h=2, length=64, s=64, e=64))
    eye = torch.eye(64, dtype=torch.float16, device="cuda").expand(2, 2, 64, 64)
    with platforms.use("cuda"), hyperrng.portable_random(SEED):
        out = F.scaled_dot_product_attention(q, k, eye, dropout_p=0.5)
    with hyperrng.portable_random(SEED):
        expected = F.scaled_dot_product_attention(q.cpu().float(), k.cpu().float(), eye.cpu().float(), dropout_p=0.5)
    assert torch.equal(out.cpu() == 0, expected == 0)  # the mask, read off the output with v = identity
