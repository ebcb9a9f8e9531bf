"""The simulated accelerator is a device: torch's own ops run on its tensors as they would on a GPU."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import hyperrng.platforms as platforms
import pytest
import torch
import torch.nn.functional as F
from hyperrng.platforms.validate import round_up_offset

from tests._dist import run_ranks

pytestmark = pytest.mark.needs_sim


@pytest.fixture
def sim() -> Iterator[platforms.Platform]:
    with platforms.use(platforms.SimulatedPlatform()) as platform:
        platform.device(0)  # registers the device type
        yield platform


DEV = "sim:1"
# Every random op a model uses, as code written for CUDA calls it: (name, op, elements drawn).
RANDOM_OPS: list[tuple[str, Callable[[], torch.Tensor], int]] = [
    ("rand", lambda: torch.rand(3, 5, device=DEV), 15),
    ("randn", lambda: torch.randn(7, device=DEV), 7),
    ("rand_like", lambda: torch.rand_like(torch.zeros(2, 3, device=DEV)), 6),
    ("randn_like", lambda: torch.randn_like(torch.zeros(9, device=DEV)), 9),
    ("randint", lambda: torch.randint(0, 100, (10,), device=DEV), 10),
    ("uniform_", lambda: torch.empty(6, device=DEV).uniform_(-1, 1), 6),
    ("normal_", lambda: torch.empty(5, device=DEV).normal_(2.0, 0.5), 5),
    ("bernoulli_ (scalar p)", lambda: torch.empty(12, device=DEV).bernoulli_(0.3), 12),
    ("bernoulli_ (tensor p)", lambda: torch.empty(4, device=DEV).bernoulli_(torch.full((4,), 0.5, device=DEV)), 4),
    ("F.dropout", lambda: F.dropout(torch.ones(3, 4, device=DEV), 0.5), 12),
    ("nn.init.kaiming_uniform_", lambda: torch.nn.init.kaiming_uniform_(torch.empty(4, 4, device=DEV)), 16),
]


@pytest.mark.parametrize(("name", "op", "numel"), RANDOM_OPS, ids=[r[0] for r in RANDOM_OPS])
def test_torch_random_ops_draw_from_the_device_generator_at_its_position(
    sim: platforms.Platform, name: str, op: Callable[[], torch.Tensor], numel: int
) -> None:
    host = torch.get_rng_state()
    sim.set_seed_offset(1234, 40, 1)
    first = op()
    seed, offset = sim.get_seed_offset(1)
    assert first.device == torch.device(DEV)
    assert seed == 1234 and offset >= 40 + round_up_offset(numel) and offset % 4 == 0, (name, offset)
    sim.set_seed_offset(1234, 40, 1)
    assert torch.equal(op().cpu(), first.cpu()), f"{name} is not a function of the generator's position"
    sim.set_seed_offset(1234, 44, 1)
    assert not torch.equal(op().cpu(), first.cpu()), f"{name} drew the same numbers at another position"
    assert torch.equal(torch.get_rng_state(), host), f"{name} on the device touched the host generator"
    assert sim.get_seed_offset(0) != (1234, offset), "a draw on device 1 moved device 0"


def test_host_draws_never_touch_the_device_generators(sim: platforms.Platform) -> None:
    before = [sim.get_rng_state(i) for i in range(sim.device_count())]
    torch.rand(100)
    F.dropout(torch.ones(50), 0.5)
    assert all(torch.equal(sim.get_rng_state(i), s) for i, s in enumerate(before))


def test_torch_seeds_and_forks_the_device_as_it_does_cuda(sim: platforms.Platform) -> None:
    torch.manual_seed(77)
    assert [sim.get_seed_offset(i) for i in range(sim.device_count())] == [(77, 0), (77, 0)]
    with torch.random.fork_rng(devices=[0], device_type="sim"):
        torch.rand(8, device="sim:0")
    assert sim.get_seed_offset(0) == (77, 0)


def test_a_small_model_trains_on_the_device_exactly_as_on_the_host(sim: platforms.Platform) -> None:
    def train(device: str) -> tuple[list[float], torch.Tensor]:
        torch.manual_seed(0)  # the host generator initialises both models alike
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(5, 6).to(device), torch.randn(5, 2).to(device)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, model[0].weight.detach().cpu()

    for device in ("sim:0", "sim:1"):
        on_device, weight = train(device)
        on_host, host_weight = train("cpu")
        assert on_device == on_host and torch.equal(weight, host_weight), device


def test_views_in_place_ops_and_reductions_behave_as_on_the_host(sim: platforms.Platform) -> None:
    x = torch.arange(12.0).reshape(3, 4).to("sim:0")
    view = x[:, 1]
    view.mul_(10)  # through a view, into the base
    assert x.cpu()[:, 1].tolist() == [10.0, 50.0, 90.0]
    assert x.t().contiguous().cpu().tolist() == x.cpu().t().tolist()
    assert (x @ x.t()).sum().item() == float((x.cpu() @ x.cpu().t()).sum())
    assert x.max(dim=1).values.device == torch.device("sim:0")
    assert repr(torch.ones(2, device="sim:1")) == "tensor([1., 1.], device='sim:1')"


def test_mixing_devices_fails_as_it_does_on_a_gpu(sim: platforms.Platform) -> None:
    on_device = torch.ones(3, device="sim:0")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device.*sim:0 and cpu"):
        on_device + torch.ones(3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device.*sim:0 and sim:1"):
        on_device + torch.ones(3, device="sim:1")
    assert (on_device + torch.tensor(2.0)).cpu().tolist() == [3.0, 3.0, 3.0]  # a host scalar is fine
    on_device.copy_(torch.full((3,), 5.0))  # copies cross devices
    assert on_device.cpu().tolist() == [5.0, 5.0, 5.0]
    with pytest.raises((TypeError, RuntimeError)):
        on_device.numpy()


def test_copies_move_tensors_between_devices_as_on_a_gpu(sim: platforms.Platform) -> None:
    source = torch.arange(6.0, device="sim:0")
    moved = source.to("sim:1")
    assert moved.device == torch.device("sim:1") and moved.cpu().tolist() == list(range(6))
    target = torch.zeros(6, device="sim:1")
    target.copy_(source)
    assert target.device == torch.device("sim:1") and target.cpu().tolist() == list(range(6))
    back = target.to("sim:0")
    assert back.device == torch.device("sim:0") and torch.equal(back.cpu(), source.cpu())


def test_a_distributed_checkpoint_saves_and_loads_while_the_device_is_registered(
    sim: platforms.Platform, tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's own, about running without a process group
        dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(tmp_path))  # it asks the device module for its stream
        loaded = {"w": torch.zeros(4)}
        dcp.load(loaded, checkpoint_id=str(tmp_path))
    assert loaded["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_draw_that_would_pass_the_last_offset_is_refused_and_changes_nothing(sim: platforms.Platform) -> None:
    from hyperrng.platforms.errors import InvalidArgumentError

    sim.set_seed_offset(1, 2**63 - 4, index=0)
    with pytest.raises(InvalidArgumentError, match="too close to 2\\*\\*63 - 1"):
        torch.rand(8, device="sim:0")
    assert sim.get_seed_offset(0) == (1, 2**63 - 4)


@pytest.mark.parametrize("reentrant", [True, False])
def test_torch_checkpoint_replays_device_dropout_in_backward_as_on_a_gpu(
    sim: platforms.Platform, reentrant: bool
) -> None:
    import torch.utils.checkpoint as checkpoint

    x = torch.ones(64, device=DEV, requires_grad=True)
    y = x
    for _ in range(3):  # the recompute must draw the forward's masks again, layer by layer
        y = checkpoint.checkpoint(lambda t: F.dropout(t * 1.0, 0.5), y, use_reentrant=reentrant)
    y.sum().backward()
    assert x.grad is not None
    assert torch.equal((x.grad != 0).cpu(), (y != 0).cpu())


def test_an_explicit_generator_is_refused_and_changes_nothing(sim: platforms.Platform) -> None:
    before = sim.get_rng_state(0)
    with pytest.raises(RuntimeError, match="generator= is not supported"):
        torch.rand(3, device="sim:0", generator=torch.Generator())
    assert torch.equal(sim.get_rng_state(0), before)


def test_a_second_privateuse1_backend_makes_the_platform_unavailable_with_a_reason() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import torch\nimport hyperrng.platforms as platforms\n"
        "torch.utils.rename_privateuse1_backend('otheraccel')\n"
        "print(platforms.SimulatedPlatform().probe())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "already taken by 'otheraccel'" in out.stdout


def _staged_collectives(rank: int, world_size: int) -> tuple[list[float], list[list[float]], str]:
    with platforms.use("sim") as sim:
        mine = torch.full((2,), float(rank), device=sim.device(0))
        got = platforms.comm.broadcast(sim, mine, src=world_size - 1)
        gathered = platforms.comm.all_gather(sim, mine * 10)
        return got.cpu().tolist(), [t.cpu().tolist() for t in gathered], str(got.device)


@pytest.mark.multiproc
def test_collectives_stage_device_tensors_through_the_host_over_gloo() -> None:
    for got, gathered, device in run_ranks(_staged_collectives, 2):
        assert got == [1.0, 1.0] and device == "sim:0"
        assert gathered == [[0.0, 0.0], [10.0, 10.0]]


@pytest.mark.parametrize("device", ["sim:5", 5], ids=["sim:5", "index-5"])
def test_a_device_index_the_backend_lacks_is_refused_as_cuda_refuses_an_invalid_ordinal(
    sim: platforms.Platform, device: object
) -> None:
    # Before, tensors were made on sim:5 of a two-device backend, and philox.random_bits(device=5)
    # drew onto it.
    from hyperrng import philox
    from hyperrng.errors import InvalidArgumentError

    with pytest.raises(RuntimeError, match="invalid device ordinal 5"):
        torch.empty(3, device="sim:5")
    with pytest.raises(InvalidArgumentError, match="invalid device ordinal 5"):
        philox.random_bits(4, 1, device=device)  # type: ignore[arg-type]
    assert philox.random_bits(4, 1, device="sim:1").device == torch.device("sim:1")


def test_positions_use_the_generators_offset_accessors_only_where_they_agree_with_its_state(
    sim: platforms.Platform,
) -> None:
    """A portable draw reads and moves its position through initial_seed()/get_offset()/set_offset() (no
    state tensor built), after one check that they mean the state's seed and offset; a generator whose
    accessors mean something else, or which has none, keeps the state's bytes. The check leaves every
    generator's state as it found it."""
    from hyperrng.platforms import device_module

    gen = sim.default_generator()
    before = gen.get_state().clone()
    assert device_module._accessors_agree(gen) and torch.equal(gen.get_state(), before)

    class Doubling:  # get_offset in other units than the state's offset
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

        def get_offset(self) -> int:
            return 2 * self.inner.get_offset()  # type: ignore[attr-defined]

    for offset in (0, 40):  # at 0 the two agree until the offset moves
        sim.set_seed_offset(9, offset)
        assert not device_module._accessors_agree(Doubling(gen)) and sim.get_seed_offset() == (9, offset)
    host = torch.Generator().manual_seed(3)
    host_state = host.get_state()
    assert not device_module._accessors_agree(host) and torch.equal(host.get_state(), host_state)
    sim._move(9, 64, True)
    assert sim._position() == sim.get_seed_offset() == (9, 64)
    sim._move(10, 8, True)  # another seed: through the state
    assert sim._position() == sim.get_seed_offset() == (10, 8)
