"""What each platform guarantees beyond the conformance suite: positions, draws, collectives."""

from __future__ import annotations

import hyperrng.platforms as platforms
import pytest
import torch
from hyperrng.platforms import CPUPlatform, SimulatedDeviceModule, SimulatedPlatform

from tests._dist import run_ranks

# -- the CPU's modelled (seed, offset) positions --------------------------------------------


def test_cpu_offset_zero_is_exactly_manual_seed() -> None:
    cpu = CPUPlatform()
    cpu.set_seed_offset(42, 0)
    a = torch.rand(8)
    torch.manual_seed(42)
    assert torch.equal(a, torch.rand(8))


def test_cpu_equal_positions_draw_equal_numbers_and_distinct_ones_differ() -> None:
    cpu = CPUPlatform()
    draws = {}
    for pos in [(7, 0), (7, 4), (7, 8), (8, 4)]:
        cpu.set_seed_offset(*pos)
        draws[pos] = torch.rand(16)
    cpu.set_seed_offset(7, 4)
    assert torch.equal(torch.rand(16), draws[(7, 4)])
    values = list(draws.values())
    assert all(not torch.equal(a, b) for i, a in enumerate(values) for b in values[i + 1 :])


def test_cpu_plain_draws_do_not_move_a_position_and_a_reseed_behind_its_back_reads_as_the_new_seed() -> None:
    cpu = CPUPlatform()
    cpu.set_seed_offset(5, 12)
    torch.rand(100)
    assert cpu.get_seed_offset() == (5, 12)
    torch.manual_seed(77)
    assert cpu.get_seed_offset() == (77, 0)


def test_cpu_a_positioned_draw_never_replays_the_plain_draws_of_the_same_position() -> None:
    cpu = CPUPlatform()
    cpu.set_seed_offset(5, 12)
    plain = torch.rand(16)
    cpu.set_seed_offset(5, 12, draw=True)
    positioned = torch.rand(16)
    assert not torch.equal(plain, positioned)
    assert cpu.get_seed_offset() == (5, 12)
    cpu.set_seed_offset(5, 12, draw=True)
    assert torch.equal(torch.rand(16), positioned), "a draw position is a function of (seed, offset)"


def test_cpu_bytes_restored_by_torchs_own_tools_read_as_the_position_they_were_saved_at() -> None:
    cpu = CPUPlatform()
    cpu.set_seed_offset(7, 8)
    saved = torch.get_rng_state()  # the bytes alone, as fork_rng and torch.utils.checkpoint keep them
    expected = torch.rand(5)
    cpu.set_seed_offset(7, 400)
    torch.set_rng_state(saved)
    assert cpu.get_seed_offset() == (7, 8)
    assert platforms.unpack_counter_state(cpu.get_rng_state()[platforms.MT19937_STATE_NBYTES :]) == (7, 8)
    assert torch.equal(torch.rand(5), expected)


def test_cpu_the_position_table_keeps_the_last_positions_kept_and_stays_bounded() -> None:
    from hyperrng.platforms import cpu as cpu_module

    kept = platforms.POSITIONS_KEPT
    cpu = CPUPlatform()
    cpu.set_seed_offset(1234, 8)
    first = torch.get_rng_state()
    for k in range(1, kept):  # the first position and the kept - 1 after it are all remembered
        cpu.set_seed_offset(99, 4 * k)
    last = torch.get_rng_state()
    torch.set_rng_state(first)
    assert cpu.get_seed_offset() == (1234, 8)
    for k in range(kept, 3 * kept):  # two generations later the first is forgotten, the newest is not
        cpu.set_seed_offset(99, 4 * k)
        assert len(cpu_module._young) + len(cpu_module._old) < 2 * kept
    assert cpu.get_seed_offset() == (99, 4 * (3 * kept - 1))
    torch.set_rng_state(first)
    assert cpu.get_seed_offset() == (torch.initial_seed(), 0)
    torch.set_rng_state(last)
    assert cpu.get_seed_offset() == (torch.initial_seed(), 0)


def test_cpu_2_to_the_16_positions_give_2_to_the_16_distinct_streams() -> None:
    # Seeded from 32 bits, two of them would share an MT19937 stream with probability about 0.4.
    cpu = CPUPlatform()
    firsts = set()
    for k in range(2**16):
        cpu.set_seed_offset(k % 256, 4 * (k // 256), draw=bool(k % 3))
        firsts.add(tuple(torch.randint(0, 2**62, (2,)).tolist()))
    assert len(firsts) == 2**16


def test_cpu_positions_seed_mt19937_from_all_64_bits_on_this_torch() -> None:
    # A layout change in a future torch shows here first (positions would fall back to 32 bits).
    assert platforms.seeds_all_64_bits()


def test_cpu_state_is_the_mt19937_bytes_followed_by_the_position() -> None:
    cpu = CPUPlatform()
    cpu.set_seed_offset(2**40 + 9, 64)
    state = cpu.get_rng_state()
    assert state.numel() == platforms.CPU_STATE_NBYTES == platforms.MT19937_STATE_NBYTES + 16
    assert torch.equal(state[: platforms.MT19937_STATE_NBYTES], torch.get_rng_state())
    assert platforms.unpack_counter_state(state[platforms.MT19937_STATE_NBYTES :]) == (2**40 + 9, 64)


def test_cpu_a_saved_state_keeps_its_position_after_the_table_forgot_it() -> None:
    cpu = CPUPlatform()
    cpu.set_seed_offset(1234, 8)
    saved = cpu.get_rng_state()
    for k in range(platforms.POSITIONS_KEPT + 10):
        cpu.set_seed_offset(99, 4 * k, draw=True)
    cpu.set_rng_state(saved)
    assert cpu.get_seed_offset() == (1234, 8)


@pytest.mark.parametrize(
    ("cursor", "fragment"),
    [((1234, -4), "non-negative multiples"), ((1234, 6), "non-negative multiples"), ((1235, 8), "does not belong")],
)
def test_cpu_refuses_a_cursor_that_does_not_fit_its_bytes(cursor: tuple[int, int], fragment: str) -> None:
    from hyperrng.platforms import InvalidArgumentError

    cpu = CPUPlatform()
    cpu.set_seed_offset(1234, 8)
    state = cpu.get_rng_state()
    forged = torch.cat((state[: platforms.MT19937_STATE_NBYTES], platforms.pack_counter_state(*cursor)))
    cpu.manual_seed(5)
    before = cpu.get_rng_state()
    with pytest.raises(InvalidArgumentError, match=fragment):
        cpu.set_rng_state(forged)
    assert torch.equal(cpu.get_rng_state(), before)


def test_cpu_position_is_restored_with_the_state() -> None:
    cpu = CPUPlatform()
    cpu.set_seed_offset(5, 12)
    saved = cpu.get_rng_state()
    torch.manual_seed(1)
    cpu.set_rng_state(saved)
    assert cpu.get_seed_offset() == (5, 12)


# -- the simulated accelerator behaves like a Philox device ---------------------------------


@pytest.mark.needs_sim
def test_simulated_draws_are_a_function_of_seed_and_offset() -> None:
    sim = SimulatedPlatform()
    device = sim.device(0)
    sim.set_seed_offset(3, 0)
    a, b = torch.rand(5, device=device), torch.rand(6, device=device)
    assert sim.get_seed_offset() == (3, 16)  # 5 -> 8, 6 -> 8: offsets advance in steps of 4
    sim.set_seed_offset(3, 8)
    assert torch.equal(torch.rand(6, device=device).cpu(), b.cpu())
    sim.set_seed_offset(3, 0)
    assert torch.equal(torch.rand(5, device=device).cpu(), a.cpu())


@pytest.mark.needs_sim
def test_simulated_graph_safe_swap_shares_state_objects() -> None:
    sim = SimulatedPlatform()
    gen = sim.default_generator(0)
    stream = gen.clone_state()
    stream.manual_seed(9)
    original = gen.graphsafe_get_state()
    gen.graphsafe_set_state(stream)
    torch.rand(4, device=sim.device(0))
    assert stream.get_offset() == 4  # drawing on the device advanced the swapped-in state
    gen.graphsafe_set_state(original)
    assert gen.initial_seed() != 9


def test_simulated_module_initialises_lazily() -> None:
    mod = SimulatedDeviceModule(device_type="cuda")
    p = platforms.CUDAPlatform(module=mod)
    assert p.probe() is None and p.device_count() == 2
    assert not mod.is_initialized()
    p.get_rng_state(1)
    assert mod.is_initialized() and mod.lazy_init_calls == 1


def test_unavailable_device_module_gives_a_reason() -> None:
    p = platforms.CUDAPlatform(module=SimulatedDeviceModule(available=False, device_type="cuda"))
    assert "is_available() returned False" in (p.probe() or "")


@pytest.mark.needs_sim
def test_simulated_device_is_a_device_type_of_its_own() -> None:
    sim = SimulatedPlatform()
    assert sim.device(1) == torch.device("sim", 1) and sim.device_type == "sim"
    assert torch.rand(2, device=sim.device(1)).device == torch.device("sim", 1)


# -- collectives over real processes ----------------------------------------------------------


def test_collectives_without_a_process_group_act_as_a_job_of_one_rank() -> None:
    cpu, comm, t = platforms.CPUPlatform(), platforms.comm, torch.arange(4)
    assert (comm.rank(), comm.world_size()) == (0, 1)
    assert comm.broadcast(cpu, t) is t
    gathered = comm.all_gather(cpu, t)
    assert len(gathered) == 1 and torch.equal(gathered[0], t) and gathered[0] is not t
    assert comm.comm_device(cpu) == torch.device("cpu")


def _collectives(rank: int, world_size: int) -> tuple[int, int, list[int], list[list[int]]]:
    cpu, comm = platforms.CPUPlatform(), platforms.comm
    mine = torch.full((3,), rank + 10, dtype=torch.int64)
    got = comm.broadcast(cpu, mine, src=world_size - 1)
    gathered = comm.all_gather(cpu, torch.tensor([rank, rank * rank]))
    assert torch.equal(mine, torch.full((3,), rank + 10)), "broadcast must not modify its input"
    return comm.rank(), comm.world_size(), got.tolist(), [t.tolist() for t in gathered]


@pytest.mark.multiproc
def test_broadcast_and_all_gather_over_gloo() -> None:
    results = run_ranks(_collectives, 3)
    for rank, (r, w, got, gathered) in enumerate(results):
        assert (r, w) == (rank, 3)
        assert got == [12, 12, 12]
        assert gathered == [[0, 0], [1, 1], [2, 4]]


# -- the CPU keeps all 64 bits of a seed ------------------------------------------------------


def test_torch_alone_merges_seeds_that_differ_only_in_their_high_bits() -> None:
    torch.manual_seed(5)
    a = torch.rand(8)
    torch.manual_seed(5 + 2**32)
    assert torch.equal(torch.rand(8), a), "why the CPU platform seeds with all 64 bits itself"


def test_cpu_seeds_that_differ_only_in_their_high_bits_draw_different_numbers() -> None:
    cpu = CPUPlatform()
    draws = []
    for seed in [5, 5 + 2**32, 5 + 2**63, 2**64 - 1, 7 * 2**32 + 7]:  # the last: equal high and low words
        cpu.manual_seed(seed)
        draws.append(torch.rand(64))
        assert torch.default_generator.initial_seed() == seed
    assert all(not torch.equal(a, b) for i, a in enumerate(draws) for b in draws[i + 1 :])
    assert all(0.0 < float(d.std()) for d in draws), "no degenerate (all-zero) MT19937 state"


def test_cpu_seeds_below_2_to_the_32_are_exactly_torchs() -> None:
    cpu = CPUPlatform()
    cpu.manual_seed(2**32 - 1)
    a = torch.rand(8)
    torch.manual_seed(2**32 - 1)
    assert torch.equal(torch.rand(8), a)


def test_cpu_64_bit_seeds_are_reproducible_and_restorable() -> None:
    cpu = CPUPlatform()
    cpu.manual_seed(2**40 + 3)
    saved = cpu.get_rng_state()
    a = torch.rand(8)
    cpu.manual_seed(2**40 + 3)
    assert torch.equal(torch.rand(8), a)
    cpu.set_rng_state(saved)
    assert torch.equal(torch.rand(8), a)


def test_cpu_handles_of_one_seed_never_collide_and_stay_apart_across_domains() -> None:
    from hyperrng.platforms.cpu import position_handle

    for seed in [0, 7, 2**63 + 11]:
        for step in [4, 2**24, 2**34]:
            handles = {position_handle(seed, step * k, draw) for k in range(1, 4097) for draw in (False, True)}
            assert len(handles) == 2 * 4096
        assert position_handle(seed, 0) == seed


def test_cpu_refuses_bytes_that_are_no_mt19937_state_and_keeps_its_own() -> None:
    from hyperrng.platforms import InvalidArgumentError

    cpu = CPUPlatform()
    before = cpu.get_rng_state()
    with pytest.raises(InvalidArgumentError, match="not a valid MT19937 state"):
        cpu.set_rng_state(torch.zeros(platforms.CPU_STATE_NBYTES, dtype=torch.uint8))
    assert torch.equal(cpu.get_rng_state(), before)


@pytest.mark.needs_sim
def test_set_device_makes_a_simulated_device_current_and_refuses_a_missing_one() -> None:
    from hyperrng.platforms.errors import InvalidArgumentError

    p = SimulatedPlatform()
    p.set_device(1)
    assert p.current_device() == 1 and p.default_generator() is p.default_generator(1)
    with pytest.raises(InvalidArgumentError, match="device index 2 is out of range for platform 'sim'"):
        p.set_device(2)
    assert p.current_device() == 1
    p.set_device(0)


def test_set_device_on_a_one_device_platform_accepts_only_that_device() -> None:
    from hyperrng.platforms.errors import ArgumentTypeError, InvalidArgumentError

    p = CPUPlatform()
    p.set_device(0)
    assert p.current_device() == 0
    with pytest.raises(InvalidArgumentError, match="has 1 device"):
        p.set_device(1)
    with pytest.raises(ArgumentTypeError):
        p.set_device("0")  # type: ignore[arg-type]
