"""Cross-rank sync check: replicas must share a stream, shards must differ, and every rank says so."""

from __future__ import annotations

import datetime
import hashlib
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch
from hyperrng.platforms._features import feature

from hyperrng.errors import ArgumentTypeError, HyperRNGError, InvalidArgumentError, InvalidOperationError, RankFailure
from hyperrng.seeding.layout import DEFAULT_STREAM, StreamLayout, apply_layout
from hyperrng.streams.fork import fork_rng
from hyperrng.streams.tracker import DATA_PARALLEL_STREAM, MODEL_PARALLEL_STREAM, RNGStatesTracker, get_rng_tracker
from hyperrng.verify import DEFAULT_TIMEOUT, StreamVerdict, fingerprint, verify_rng_sync
from tests._dist import run_ranks
from tests._platforms import draw

SEED = 1234
WORLD = 4
MP, DP = MODEL_PARALLEL_STREAM, DATA_PARALLEL_STREAM


def mesh_of(rank: int) -> dict[str, int]:
    """Ranks 0..3 on a 2 x 2 (dp, tp) mesh: tp varies fastest."""
    return {"dp": rank // 2, "tp": rank % 2}


def megatron_layout() -> StreamLayout:
    return StreamLayout(dims=("dp", "tp"), default=(), streams={MP: ("tp",), DP: ("dp",)})


# Layouts that every rank seeds correctly: verify_rng_sync must accept each of them.
CLEAN_LAYOUTS: dict[str, StreamLayout] = {
    "megatron": megatron_layout(),
    "default-over-dp-and-three-kinds-of-stream": StreamLayout(
        dims=("dp", "tp"),
        default=("dp",),
        streams={MP: ("tp",), "expert-parallel-rng": ("dp", "tp"), "global-rng": ()},
    ),
    "dimensions-declared-in-reverse-order": StreamLayout(
        dims=("dp", "tp"), default=(), streams={"context-parallel-rng": ("tp", "dp"), DP: ("dp",)}
    ),
}
# (stream, dims, distinct states, sharing groups) that each clean layout must report on 4 ranks,
# the default generator first
CLEAN_VERDICTS: dict[str, list[tuple[str, tuple[str, ...], int, int]]] = {
    "megatron": [(DEFAULT_STREAM, (), 1, 1), (MP, ("tp",), 2, 2), (DP, ("dp",), 2, 2)],
    "default-over-dp-and-three-kinds-of-stream": [
        (DEFAULT_STREAM, ("dp",), 2, 2),
        (MP, ("tp",), 2, 2),
        ("expert-parallel-rng", ("dp", "tp"), 4, 4),
        ("global-rng", (), 1, 1),
    ],
    "dimensions-declared-in-reverse-order": [
        (DEFAULT_STREAM, (), 1, 1),
        ("context-parallel-rng", ("tp", "dp"), 4, 4),
        (DP, ("dp",), 2, 2),
    ],
}


@pytest.fixture(autouse=True)
def _fresh_global_tracker() -> Iterator[None]:
    get_rng_tracker().reset()
    yield
    get_rng_tracker().reset()


# -- one 4-rank run holds every multi-rank scenario --------------------------------------------


def _draw_in_sync(tracker: RNGStatesTracker, layout: StreamLayout) -> None:
    """What a training step does on every rank alike: draw from each stream and the default generator."""
    platform = platforms.current()
    for name in layout.streams:
        with tracker.fork(name):
            draw(platform, 5)
    draw(platform, 3)


def _outcome(layout: StreamLayout, coords: Any, **kwargs: Any) -> str | list[tuple[str, tuple[str, ...], int, int]]:
    """The verdicts of a passing check, or the error's type and message (so every rank reports it)."""
    try:
        verdicts = verify_rng_sync(layout, coords, **kwargs)
    except HyperRNGError as exc:
        return f"{type(exc).__name__}: {exc}"
    assert all(isinstance(v, StreamVerdict) for v in verdicts)
    return [(v.stream, v.dims, v.distinct_states, v.groups) for v in verdicts]


def _fault(rank: int, name: str) -> str | list[Any]:
    """Seed every rank as the Megatron layout says, break one thing on one rank, and check."""
    layout, coords, tracker = megatron_layout(), mesh_of(rank), RNGStatesTracker()
    if name == "one-rank-reseeded":
        apply_layout(layout, SEED + 1 if rank == 3 else SEED, coords, tracker=tracker)
    elif name == "tp-stream-not-varied-over-tp":  # the classic bug: every TP rank gets the same TP seed
        apply_layout(layout, SEED, {**coords, "tp": 0}, tracker=tracker)
    else:
        apply_layout(layout, SEED, coords, tracker=tracker)
    if name == "one-stream-advanced-once-more" and rank == 2:
        with tracker.fork(MP):
            torch.rand(1)
    if name == "stream-missing-on-one-rank" and rank == 1:
        tracker.reseed({MP: layout.seed(MP, SEED, coords)})
    if name == "default-generator-advanced-once-more" and rank == 2:
        torch.rand(1)
    if name == "one-rank-uses-another-layout" and rank == 3:
        layout = StreamLayout(dims=("dp", "tp"), default=(), streams={MP: ("dp", "tp"), DP: ("dp",)})
    if name == "every-tp-rank-claims-tp-0":  # seeded and checked with the same wrong coordinates
        coords = {**coords, "tp": 0}
        apply_layout(layout, SEED, coords, tracker=tracker)
    if name == "a-coordinate-outside-the-mesh" and rank == 3:
        coords = {**coords, "tp": 5}
        apply_layout(layout, SEED, coords, tracker=tracker)
    return _outcome(layout, coords, tracker=tracker)


FAULTS = (
    "every-tp-rank-claims-tp-0",
    "a-coordinate-outside-the-mesh",
    "one-rank-reseeded",
    "one-stream-advanced-once-more",
    "stream-missing-on-one-rank",
    "tp-stream-not-varied-over-tp",
    "one-rank-uses-another-layout",
    "default-generator-advanced-once-more",
)


def _every_scenario(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    out: dict[str, Any] = {}
    with platforms.use(platforms.CPUPlatform()):
        for name, layout in CLEAN_LAYOUTS.items():
            tracker = RNGStatesTracker()
            apply_layout(layout, SEED, mesh_of(rank), tracker=tracker)
            _draw_in_sync(tracker, layout)
            out[f"clean/{name}"] = _outcome(layout, mesh_of(rank), tracker=tracker)

        layout = megatron_layout()
        for timeout in (datetime.timedelta(minutes=2), 120.0, None):
            tracker = RNGStatesTracker()
            apply_layout(layout, SEED, mesh_of(rank), tracker=tracker)
            out[f"clean/timeout={timeout}"] = _outcome(layout, mesh_of(rank), tracker=tracker, timeout=timeout)
        apply_layout(layout, SEED, mesh_of(rank))  # the process-wide tracker, the default argument
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        out["clean/device-mesh-and-global-tracker"] = _outcome(layout, mesh)
        get_rng_tracker().reset()

        first_dp_row = dist.new_group([0, 1])  # every rank must create it; ranks 0 and 1 use it
        if rank in (0, 1):
            tracker = RNGStatesTracker()
            apply_layout(layout, SEED, mesh_of(rank), tracker=tracker)
            out["clean/subgroup"] = _outcome(layout, mesh_of(rank), tracker=tracker, group=first_dp_row)

        out["coords-without-tp"] = _outcome(layout, {"dp": rank // 2}, tracker=RNGStatesTracker())
        for name in FAULTS:
            out[name] = _fault(rank, name)

    if not feature("sim").available:  # the tests that read these outcomes skip there
        return out
    with platforms.use(platforms.SimulatedPlatform()):  # graph-safe streams on the simulated device
        tracker = RNGStatesTracker(graph_safe=True)
        apply_layout(layout, SEED, mesh_of(rank), tracker=tracker)
        _draw_in_sync(tracker, layout)
        out["clean/simulated-device"] = _outcome(layout, mesh_of(rank), tracker=tracker)
        if rank == 2:
            with tracker.fork(MP):
                draw(platforms.current(), 1)
        out["simulated-device/one-stream-advanced-once-more"] = _outcome(layout, mesh_of(rank), tracker=tracker)
    return out


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, Any]]:
    """Every rank's outcome of every scenario, from a single 4-rank run."""
    return run_ranks(_every_scenario, WORLD)


def error_on_every_rank(outcomes: list[dict[str, Any]], scenario: str) -> str:
    """The error every rank raised for ``scenario``; fails unless all raised the same one."""
    seen = [o[scenario] for o in outcomes]
    assert all(isinstance(s, str) for s in seen), f"some ranks raised nothing: {seen}"
    assert len(set(seen)) == 1, f"ranks disagree: {seen}"
    return seen[0]


# -- clean runs -------------------------------------------------------------------------------


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(CLEAN_LAYOUTS))
def test_a_correctly_seeded_layout_passes_and_reports_each_streams_sharing(
    outcomes: list[dict[str, Any]], name: str
) -> None:
    assert [o[f"clean/{name}"] for o in outcomes] == [CLEAN_VERDICTS[name]] * WORLD


@pytest.mark.multiproc
def test_a_device_mesh_and_the_process_wide_tracker_are_accepted(outcomes: list[dict[str, Any]]) -> None:
    assert [o["clean/device-mesh-and-global-tracker"] for o in outcomes] == [CLEAN_VERDICTS["megatron"]] * WORLD


@pytest.mark.needs_sim
@pytest.mark.multiproc
@pytest.mark.parametrize("timeout", ["0:02:00", "120.0", "None"])
def test_ranks_that_all_take_part_in_time_pass_with_any_form_of_timeout(
    outcomes: list[dict[str, Any]], timeout: str
) -> None:
    assert [o[f"clean/timeout={timeout}"] for o in outcomes] == [CLEAN_VERDICTS["megatron"]] * WORLD


@pytest.mark.multiproc
@pytest.mark.needs_sim
def test_streams_on_a_simulated_device_pass_when_in_sync(outcomes: list[dict[str, Any]]) -> None:
    assert [o["clean/simulated-device"] for o in outcomes] == [CLEAN_VERDICTS["megatron"]] * WORLD


@pytest.mark.multiproc
def test_a_subgroup_is_checked_on_its_own_ranks(outcomes: list[dict[str, Any]]) -> None:
    # ranks 0 and 1 share dp=0: one data-parallel state, two tensor-parallel ones
    expected = [(DEFAULT_STREAM, (), 1, 1), (MP, ("tp",), 2, 2), (DP, ("dp",), 1, 1)]
    assert [o.get("clean/subgroup") for o in outcomes] == [expected, expected, None, None]


# -- injected faults: every rank raises the same error, naming the stream and both sides --------


@pytest.mark.multiproc
def test_one_reseeded_rank_breaks_both_of_its_replica_groups(outcomes: list[dict[str, Any]]) -> None:
    message = error_on_every_rank(outcomes, "one-rank-reseeded")
    assert message.startswith("RNGDesyncError: RNG streams are out of sync across ranks")
    assert f"stream {DEFAULT_STREAM!r}: ranks [0, 1, 2] vs [3] must share it (every rank)" in message
    assert f"stream {MP!r}: ranks [1] vs [3] must share it (tp=1) but hold different states" in message
    assert f"stream {DP!r}: ranks [2] vs [3] must share it (dp=1) but hold different states" in message


@pytest.mark.multiproc
def test_a_stream_advanced_once_more_on_one_rank_is_named_with_its_replica(outcomes: list[dict[str, Any]]) -> None:
    message = error_on_every_rank(outcomes, "one-stream-advanced-once-more")
    assert f"stream {MP!r}: ranks [0] vs [2] must share it (tp=0) but hold different states" in message
    assert repr(DP) not in message, "only the advanced stream is out of sync"


@pytest.mark.needs_sim
@pytest.mark.multiproc
def test_a_stream_advanced_on_a_simulated_device_is_detected(outcomes: list[dict[str, Any]]) -> None:
    message = error_on_every_rank(outcomes, "simulated-device/one-stream-advanced-once-more")
    assert f"stream {MP!r}: ranks [0] vs [2] must share it (tp=0)" in message


@pytest.mark.multiproc
def test_a_stream_missing_on_one_rank_is_named_with_that_rank(outcomes: list[dict[str, Any]]) -> None:
    message = error_on_every_rank(outcomes, "stream-missing-on-one-rank")
    assert f"stream {DP!r} is missing on rank(s) [1]; seed it on every rank" in message
    assert repr(MP) not in message


@pytest.mark.multiproc
def test_shards_that_draw_identical_numbers_are_refused(outcomes: list[dict[str, Any]]) -> None:
    message = error_on_every_rank(outcomes, "tp-stream-not-varied-over-tp")
    assert f"stream {MP!r}: ranks [0, 2] and [1, 3] must differ (tp=0 vs tp=1) but hold identical states" in message
    assert repr(DP) not in message


@pytest.mark.multiproc
def test_ranks_that_claim_the_same_coordinates_are_named(outcomes: list[dict[str, Any]]) -> None:
    # Seeded and checked with one TP coordinate, every TP rank holds the same TP stream, and the
    # streams alone look in sync: the coordinates themselves give the bug away.
    message = error_on_every_rank(outcomes, "every-tp-rank-claims-tp-0")
    assert message.startswith("RNGDesyncError: the ranks' mesh coordinates are wrong")
    assert "ranks [0, 1] all claim coordinates {dp=0, tp=0}" in message
    assert "ranks [2, 3] all claim coordinates {dp=1, tp=0}" in message


@pytest.mark.multiproc
def test_a_coordinate_outside_the_mesh_is_named(outcomes: list[dict[str, Any]]) -> None:
    message = error_on_every_rank(outcomes, "a-coordinate-outside-the-mesh")
    assert "rank(s) [3] have tp coordinates [5], outside the mesh" in message


def test_coordinates_that_do_not_fill_the_world_s_mesh_are_refused() -> None:
    from hyperrng.verify import _coordinate_problems

    dims = ("dp", "tp")
    assert _coordinate_problems(dims, [(0, 0), (0, 1), (1, 0), (1, 1)], whole_world=True) == []
    assert _coordinate_problems(dims, [(1, 0), (1, 1)], whole_world=False) == []  # a subgroup: a row of the mesh
    (gap,) = _coordinate_problems(dims, [(0, 0), (0, 1), (1, 0)], whole_world=True)
    assert "span a mesh of dp=2 x tp=2 (4 points) but the world has 3 ranks" in gap
    (shifted,) = _coordinate_problems(dims, [(1, 0), (1, 1)], whole_world=True)
    assert "rank(s) [0, 1] have dp coordinates [1, 1], outside the mesh" in shifted


@pytest.mark.multiproc
def test_ranks_with_different_layouts_are_named_on_each_side(outcomes: list[dict[str, Any]]) -> None:
    message = error_on_every_rank(outcomes, "one-rank-uses-another-layout")
    assert message == (
        "RNGDesyncError: ranks use different stream layouts: [0, 1, 2] vs [3]; "
        "build the same StreamLayout on every rank."
    )


@pytest.mark.multiproc
def test_the_default_generator_advanced_on_one_rank_is_detected(outcomes: list[dict[str, Any]]) -> None:
    message = error_on_every_rank(outcomes, "default-generator-advanced-once-more")
    assert (
        f"stream {DEFAULT_STREAM!r}: ranks [0, 1, 3] vs [2] must share it (every rank) but hold different states"
        in message
    )
    assert repr(MP) not in message and repr(DP) not in message


@pytest.mark.multiproc
def test_coords_lacking_a_layout_dimension_are_refused_on_every_rank(outcomes: list[dict[str, Any]]) -> None:
    message = error_on_every_rank(outcomes, "coords-without-tp")
    assert message.startswith("InvalidArgumentError: coords lack the layout's dimension(s) ['tp']")


def _layouts_of_different_sizes(rank: int, world_size: int) -> str | list[Any]:
    streams: dict[str, tuple[str, ...]] = {MP: ("tp",)}
    if rank == 1:
        streams[DP] = ()  # one stream more: a longer fingerprint vector than rank 0's
    layout = StreamLayout(dims=("tp",), default=(), streams=streams)
    tracker = RNGStatesTracker()
    apply_layout(layout, SEED, {"tp": rank}, tracker=tracker)
    return _outcome(layout, {"tp": rank}, tracker=tracker)


@pytest.mark.multiproc
def test_layouts_with_different_numbers_of_streams_are_refused_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    import hyperrng.cli.launch

    # Gathering vectors of different lengths would crash gloo on one rank, which then never answers.
    monkeypatch.setattr(hyperrng.cli.launch, "_RESULT_TIMEOUT_S", 30)
    messages = run_ranks(_layouts_of_different_sizes, 2)
    assert len(set(messages)) == 1
    assert str(messages[0]).startswith("RNGDesyncError: ranks use different stream layouts: [0] vs [1]")


def _one_rank_never_checks(rank: int, world_size: int, folder: str) -> list[tuple[str, bool, str]]:
    """Rank 0 checks, with a timeout as a timedelta and then in seconds; rank 1 never calls the check.

    Rank 1 stays alive (its process group open) until rank 0 is done, so rank 0 can only
    end by its timeout, not by noticing a dead peer.
    """
    done = Path(folder) / "rank0-done"
    if rank == 1:
        while not done.exists():
            time.sleep(0.05)
        return []
    layout, coords, tracker = megatron_layout(), {"dp": 0, "tp": rank}, RNGStatesTracker()
    apply_layout(layout, SEED, coords, tracker=tracker)
    seen = []
    try:
        for timeout in (datetime.timedelta(seconds=1), 0.5):
            try:
                verify_rng_sync(layout, coords, tracker=tracker, timeout=timeout)
            except HyperRNGError as exc:
                seen.append((type(exc).__name__, isinstance(exc, RuntimeError), str(exc)))
    finally:
        done.touch()
    return seen


@pytest.mark.multiproc
def test_a_rank_waiting_for_one_that_never_checks_raises_rank_failure_at_its_timeout(tmp_path: Path) -> None:
    seen, _ = run_ranks(_one_rank_never_checks, 2, str(tmp_path))
    assert [(name, runtime) for name, runtime, _ in seen] == [("RankFailure", True)] * 2
    for (_, _, message), waited in zip(seen, ("1", "0.5")):
        assert message.startswith(
            f"verify_rng_sync: rank 0 waited {waited} s and the other ranks of the group did not all take part; "
            "a rank has stopped, or does not call verify_rng_sync at this point."
        ), message
        assert "end the job (or destroy the group) and restart it" in message


def _one_rank_leaves(rank: int, world_size: int, folder: str) -> str:
    """Rank 1 leaves the job (its process group torn down) without checking; rank 0 checks."""
    joined = Path(folder) / "rank0-joined"
    if rank == 1:
        # Tearing the group down closes rank 1's connections, so rank 0's backend reports the
        # peer gone at once (a rank that merely stayed away would be noticed only at the
        # process group's own timeout, two minutes in the launcher). It waits until rank 0
        # is connected: torn down earlier, it would fail rank 0's init_process_group instead.
        while not joined.exists():
            time.sleep(0.05)
        torch.distributed.destroy_process_group()
        return ""
    joined.touch()
    layout, coords, tracker = megatron_layout(), {"dp": 0, "tp": rank}, RNGStatesTracker()
    apply_layout(layout, SEED, coords, tracker=tracker)
    try:
        verify_rng_sync(layout, coords, tracker=tracker, timeout=None)
    except HyperRNGError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "passed"


@pytest.mark.multiproc
def test_a_rank_whose_peer_left_raises_rank_failure_rather_than_the_backends_error(tmp_path: Path) -> None:
    message, _ = run_ranks(_one_rank_leaves, 2, str(tmp_path))
    assert message.startswith("RankFailure: verify_rng_sync: the collective failed on rank 0 ("), message
    assert message.endswith("a rank has most likely died. End the job (or destroy the group) and restart it.")


# -- single process ----------------------------------------------------------------------------


def test_the_default_timeout_is_five_minutes() -> None:
    assert DEFAULT_TIMEOUT == datetime.timedelta(minutes=5)
    assert issubclass(RankFailure, RuntimeError) and issubclass(RankFailure, HyperRNGError)


@pytest.mark.parametrize(
    ("timeout", "error", "fragment"),
    [
        ("60", ArgumentTypeError, "timeout must be a datetime.timedelta, a number of seconds or None, got str"),
        (True, ArgumentTypeError, "got bool True"),
        ([1], ArgumentTypeError, "got list"),
        (0, InvalidArgumentError, "timeout must be positive and at most 365 days, got 0"),
        (-1.5, InvalidArgumentError, "got -1.5"),
        (datetime.timedelta(seconds=-1), InvalidArgumentError, "got datetime.timedelta"),
        (datetime.timedelta(0), InvalidArgumentError, "must be positive"),
        (float("nan"), InvalidArgumentError, "got nan"),
        (float("inf"), InvalidArgumentError, "got inf"),
        (datetime.timedelta(days=366), InvalidArgumentError, "at most 365 days"),
    ],
    ids=["str", "bool", "list", "zero", "negative", "negative-timedelta", "zero-timedelta", "nan", "inf", "too-long"],
)
def test_a_bad_timeout_is_refused_before_anything_else_and_changes_nothing(
    timeout: Any, error: type[Exception], fragment: str
) -> None:
    tracker = RNGStatesTracker()
    apply_layout(megatron_layout(), SEED, mesh_of(0), tracker=tracker)
    before = (torch.get_rng_state(), tracker.get_states())
    with pytest.raises(error, match=re.escape(fragment)):
        verify_rng_sync(megatron_layout(), mesh_of(0), tracker=tracker, timeout=timeout)
    assert torch.equal(torch.get_rng_state(), before[0])
    after = tracker.get_states()
    assert after.keys() == before[1].keys() and all(torch.equal(after[k], before[1][k]) for k in after)


def test_without_a_process_group_the_check_refuses_and_changes_nothing() -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    tracker = RNGStatesTracker()
    apply_layout(megatron_layout(), SEED, mesh_of(0), tracker=tracker)
    before = (torch.get_rng_state(), tracker.get_states())
    with pytest.raises(InvalidOperationError, match="call torch.distributed.init_process_group first") as info:
        verify_rng_sync(megatron_layout(), mesh_of(0), tracker=tracker)
    assert isinstance(info.value, RuntimeError)
    assert torch.equal(torch.get_rng_state(), before[0])
    after = tracker.get_states()
    assert after.keys() == before[1].keys() and all(torch.equal(after[k], before[1][k]) for k in after)


def test_a_fingerprint_is_the_signed_little_endian_blake2b_of_the_state_bytes() -> None:
    state = torch.arange(16, dtype=torch.uint8)
    digest = hashlib.blake2b(bytes(range(16)), digest_size=8).digest()
    assert fingerprint(state) == int.from_bytes(digest, "little", signed=True)
    assert -(2**63) <= fingerprint(state) < 2**63


def test_equal_states_share_a_fingerprint_and_one_changed_byte_changes_it() -> None:
    state = torch.get_rng_state()
    other = state.clone()
    other[100] ^= 1
    assert fingerprint(state) == fingerprint(state.clone())
    assert fingerprint(state) != fingerprint(other)


def test_a_non_contiguous_state_is_fingerprinted_by_its_contents() -> None:
    wide = torch.arange(32, dtype=torch.uint8)
    assert fingerprint(wide[::2]) == fingerprint(wide[::2].contiguous())


def test_equal_layouts_declared_in_different_orders_fingerprint_alike() -> None:
    from hyperrng.verify import _local_vector

    ab = StreamLayout(dims=("dp", "tp"), default=(), streams={"a": ("tp",), "b": ("dp",)})
    ba = StreamLayout(dims=("dp", "tp"), default=(), streams={"b": ("dp",), "a": ("tp",)})
    assert ab == ba and hash(ab) == hash(ba)
    tracker = RNGStatesTracker()
    tracker.reseed({"a": 1, "b": 2})
    coords = {"dp": 0, "tp": 1}
    assert _local_vector(ab, coords, tracker) == _local_vector(ba, coords, tracker)


def test_checking_inside_a_fork_is_refused_before_any_collective() -> None:
    from hyperrng.errors import InvalidOperationError

    tracker = RNGStatesTracker()
    tracker.reseed({"a": 1})
    layout = StreamLayout(dims=("tp",), default=(), streams={"a": ("tp",)})
    with tracker.fork("a"):
        with pytest.raises(InvalidOperationError, match="inside a fork of stream 'a'"):
            verify_rng_sync(layout, {"tp": 0}, tracker=tracker)
    # Inside another tracker's fork (or fork_rng) the default stream's fingerprint would be that context's stream:
    # a desync missed, or one reported falsely.
    other = RNGStatesTracker()
    other.reseed({"helper": 7})
    with other.fork("helper"), pytest.raises(InvalidOperationError, match="cannot verify the streams' sync inside"):
        verify_rng_sync(layout, {"tp": 0}, tracker=tracker)
    with fork_rng(), pytest.raises(InvalidOperationError, match="process group"):  # fork_rng swaps nothing in
        verify_rng_sync(layout, {"tp": 0}, tracker=tracker)
