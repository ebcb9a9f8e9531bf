"""Cross-rank checks: the ranks that must share a stream do, and the ones that must differ do.

:func:`verify_rng_sync` gathers a digest of every rank's layout (one integer each), then,
when the layouts agree, one small integer vector per rank: its mesh coordinates and a
64-bit fingerprint of every stream's state, the default generator's included. Every rank
applies the same rule to the same data, so every rank reaches the same verdict and, on a
violation, raises the same :class:`RNGDesyncError`:

* every rank must have its own point of the mesh: two ranks with equal coordinates on every
  dimension of the layout are refused (a TP stream checked with every rank claiming ``tp=0``
  would look shared correctly); in the whole world the coordinates must also fill a mesh,
  each dimension's coordinates ``0..n-1`` and every point once;
* ranks with equal coordinates on a stream's dimensions must hold identical states;
* ranks with different coordinates on them must hold different states;
* every rank must hold every stream of the layout.

**Timeout.** Each rank waits at most ``timeout`` (default :data:`DEFAULT_TIMEOUT`, five
minutes, far below a process group's usual 30) for the others to take part. A rank that
waits longer raises :class:`~hyperrng.errors.RankFailure`: another rank has stopped, died,
or does not call the check at this point. The collectives are asynchronous and waited on
with ``Work.wait(timeout)``, so this holds on any backend. After that error the process
group still holds the unfinished collective and cannot be trusted for another one: end the
job (or destroy the group) and restart it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import numbers
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

import hyperrng.platforms as platforms
from hyperrng._guard.exclusive import refuse_inside_contexts
from hyperrng.errors import ArgumentTypeError, InvalidArgumentError, InvalidOperationError, RankFailure, RNGDesyncError
from hyperrng.platforms.validate import check_instance
from hyperrng.seeding.layout import DEFAULT_STREAM, StreamLayout, mesh_coordinates
from hyperrng.streams._device_state import device_keys
from hyperrng.streams.tracker import RNGStatesTracker, resolve_tracker

__all__ = ["DEFAULT_TIMEOUT", "StreamVerdict", "fingerprint", "verify_rng_sync"]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
"""How long :func:`verify_rng_sync` waits for the other ranks unless told otherwise: ample for
ranks that arrive at different moments, far below a process group's 30-minute default."""

_MAX_REPORTED = 8  # violations listed in one error message; the rest are counted
_MAX_TIMEOUT = datetime.timedelta(days=365)  # longer is no bound at all: pass None for that


@dataclass(frozen=True)
class StreamVerdict:
    """What :func:`verify_rng_sync` found for one stream: its dimensions and distinct states."""

    stream: str
    dims: tuple[str, ...]
    distinct_states: int
    groups: int  # sets of ranks that must share the stream


def fingerprint(state: torch.Tensor) -> int:
    """A signed 64-bit BLAKE2b fingerprint of an RNG state's bytes (stable across processes)."""
    digest = hashlib.blake2b(state.contiguous().numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _layout_digest(layout: StreamLayout) -> int:
    text = json.dumps(layout.to_dict(), sort_keys=True).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


def _all_streams(layout: StreamLayout) -> dict[str, tuple[str, ...]]:
    """Every stream the layout declares, the default generator first, the rest by name
    (ranks may declare equal layouts in different orders)."""
    return {DEFAULT_STREAM: layout.default, **dict(sorted(layout.streams.items()))}


def _local_vector(layout: StreamLayout, coords: Mapping[str, int], tracker: RNGStatesTracker) -> list[int]:
    states = tracker.get_states(as_tensors=True) if tracker.is_initialized() else {}
    states = {**states, DEFAULT_STREAM: platforms.current().get_rng_state()}  # the device generator, always held
    vector = [coords[d] for d in layout.dims]
    for name in _all_streams(layout):
        vector += [1, fingerprint(states[name])] if name in states else [0, 0]  # 0: this rank lacks the stream
    return vector


def verify_rng_sync(
    layout: StreamLayout,
    coords: Mapping[str, int] | object,
    *,
    tracker: RNGStatesTracker | None = None,
    group: object | None = None,
    timeout: datetime.timedelta | float | None = DEFAULT_TIMEOUT,
) -> list[StreamVerdict]:
    """Check across the ranks of ``group`` that every stream is shared exactly as ``layout`` says.

    Args:
        layout: which dimensions each stream varies over.
        coords: this rank's mesh coordinates (a ``{dim: coordinate}`` mapping or a named
            ``DeviceMesh``); every dimension of ``layout`` must be given.
        tracker: the tracker whose streams are checked (default: the process-wide one).
            The default stream is the current device generator of the platform.
        group: the process group (default: the world).
        timeout: how long this rank waits for the others in total, a
            ``datetime.timedelta`` or a number of seconds, positive and at most a year
            (default :data:`DEFAULT_TIMEOUT`); ``None`` waits as long as the process
            group's own timeout allows.

    Returns:
        One :class:`StreamVerdict` per stream when everything holds.

    Raises:
        ArgumentTypeError: ``timeout`` is neither a ``timedelta``, a number nor ``None``.
        InvalidArgumentError: ``timeout`` is not positive, not finite, or longer than a year.
        InvalidOperationError: ``torch.distributed`` has no process group yet.
        RNGDesyncError: on every rank, naming each stream that is shared wrongly or
            missing, and the ranks on each side; or naming the ranks that claim one point
            of the mesh, or (in the whole world) coordinates outside a mesh.
        RankFailure: the other ranks did not all take part within ``timeout``, or a
            collective failed because a rank died; the process group should not be used
            again (see the module docstring). Nothing is changed by any of these errors.
    """
    import torch.distributed as dist

    check_instance(layout, StreamLayout, "layout")
    seconds = _timeout_seconds(timeout)
    tracker = resolve_tracker(tracker)
    if tracker.active_stream is not None:
        # Checked before any collective, so every rank raises alike only if every rank forks alike;
        # inside a fork the default generator holds the stream and would be misjudged.
        raise InvalidOperationError(
            f"verify_rng_sync cannot run inside a fork of stream {tracker.active_stream!r}; call it outside any fork.",
            reason="tracker",
        )
    # Nor inside another context that swapped the generator (another tracker's fork, a sharded region): the default
    # stream's fingerprint would be that context's stream, a desync missed or one reported falsely (not fork_rng,
    # which swaps nothing in).
    keys = device_keys(platforms.current())
    refuse_inside_contexts(keys, "verify the streams' sync", lambda context: getattr(context, "continues", False))
    point = mesh_coordinates(coords)  # a wrong type is a TypeError whether or not a group exists
    missing_dims = [d for d in layout.dims if d not in point]
    if missing_dims:
        raise InvalidArgumentError(f"coords lack the layout's dimension(s) {missing_dims}; give a coordinate for each.")
    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidOperationError(
            "verify_rng_sync needs a process group; call torch.distributed.init_process_group first.",
            reason="distributed",
        )
    deadline = None if seconds is None else time.monotonic() + seconds
    # The layouts must agree before the vectors are gathered: their length depends on it.
    digests = [int(t) for t in _gather(torch.tensor([_layout_digest(layout)]), group, deadline, seconds)]
    if len(set(digests)) > 1:
        by_digest: dict[int, list[int]] = defaultdict(list)
        for rank, digest in enumerate(digests):
            by_digest[digest].append(rank)
        raise RNGDesyncError(
            "ranks use different stream layouts: "
            + " vs ".join(str(ranks) for ranks in by_digest.values())
            + "; build the same StreamLayout on every rank."
        )
    local = torch.tensor(_local_vector(layout, point, tracker), dtype=torch.int64)
    rows = [t.tolist() for t in _gather(local, group, deadline, seconds)]
    whole_world = dist.get_world_size(group) == dist.get_world_size()  # type: ignore[arg-type]
    return _judge(layout, rows, whole_world)


def _timeout_seconds(timeout: object) -> float | None:
    """``timeout`` in seconds, checked: ``None``, or a positive finite span of at most a year."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ArgumentTypeError(
            f"timeout must be a datetime.timedelta, a number of seconds or None, got {type(timeout).__name__} "
            f"{timeout!r:.80}."
        )
    if not (math.isfinite(seconds) and 0 < seconds <= _MAX_TIMEOUT.total_seconds()):
        raise InvalidArgumentError(
            f"timeout must be positive and at most {_MAX_TIMEOUT.days} days, got {timeout!r:.80}; "
            "pass None to wait as long as the process group allows."
        )
    return seconds


def _gather(tensor: torch.Tensor, group: Any, deadline: float | None, seconds: float | None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` in rank order, waiting until ``deadline`` at most (``time.monotonic()``)."""
    import torch.distributed as dist

    buf = tensor.to(platforms.comm.comm_device(platforms.current(), group), copy=True)  # as comm.all_gather places it
    out = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(out, buf, group=group, async_op=True)
    try:
        if deadline is None:
            work.wait()
        else:  # what is left of the whole check's budget; torch rounds a wait to whole milliseconds
            work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except RuntimeError as exc:
        rank = dist.get_rank(group)
        if seconds is not None and not work.is_completed():  # a failed collective (a peer died) has completed
            raise RankFailure(
                f"verify_rng_sync: rank {rank} waited {seconds:g} s and the other ranks of the group did not all "
                "take part; a rank has stopped, or does not call verify_rng_sync at this point. The process group "
                "still holds the unfinished collective: end the job (or destroy the group) and restart it."
            ) from exc
        raise RankFailure(
            f"verify_rng_sync: the collective failed on rank {rank} ({type(exc).__name__}: {exc}); a rank has "
            "most likely died. End the job (or destroy the group) and restart it."
        ) from exc
    return [t.to(tensor.device) for t in out]


def _coordinate_problems(dims: tuple[str, ...], points: list[tuple[int, ...]], whole_world: bool) -> list[str]:
    """Ranks that share a point of the mesh; in the whole world, coordinates that do not fill a mesh."""
    problems = []
    by_point: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for rank, point in enumerate(points):
        by_point[point].append(rank)
    for point, ranks in by_point.items():
        if len(ranks) > 1:
            problems.append(
                f"ranks {ranks} all claim coordinates {{{_describe(dims, point)}}}; each rank has its own point of "
                "the mesh: pass every rank its own coordinates, on every dimension of the mesh (declare the "
                "dimensions no stream varies over in the layout's dims too)"
            )
    if not whole_world or problems:
        return problems
    sizes = []
    for j, dim in enumerate(dims):
        values = sorted({point[j] for point in points})
        sizes.append(len(values))
        outside = [rank for rank, point in enumerate(points) if point[j] >= len(values)]
        if outside:
            problems.append(
                f"rank(s) {outside} have {dim} coordinates {[points[r][j] for r in outside]}, outside the mesh: the "
                f"{len(values)} distinct {dim} coordinates of the ranks must be 0..{len(values) - 1}"
            )
    if not problems and math.prod(sizes) != len(points):
        shape = " x ".join(f"{d}={n}" for d, n in zip(dims, sizes))
        problems.append(
            f"the coordinates span a mesh of {shape} ({math.prod(sizes)} points) but the world has {len(points)} "
            "ranks; give each rank its point of the whole mesh"
        )
    return problems


def _judge(layout: StreamLayout, rows: list[list[int]], whole_world: bool = False) -> list[StreamVerdict]:
    """Apply the sharing rule to every rank's gathered vector; raise on any violation.

    Coordinates come first: where ranks claim one point (or, in the whole world, points
    outside a mesh), the streams cannot be judged by them, and only that is reported.
    """
    ndims = len(layout.dims)
    coordinate_problems = _coordinate_problems(layout.dims, [tuple(row[:ndims]) for row in rows], whole_world)
    if coordinate_problems:
        _raise(coordinate_problems, "the ranks' mesh coordinates are wrong")
    problems: list[str] = []
    verdicts: list[StreamVerdict] = []
    for i, (name, dims) in enumerate(_all_streams(layout).items()):
        col = ndims + 2 * i
        absent = [rank for rank, row in enumerate(rows) if row[col] == 0]
        if absent:
            problems.append(f"stream {name!r} is missing on rank(s) {absent}; seed it on every rank")
            continue
        dim_idx = [layout.dims.index(d) for d in dims]
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for rank, row in enumerate(rows):
            groups[tuple(row[j] for j in dim_idx)].append(rank)
        owner: dict[int, tuple[int, ...]] = {}
        for key, ranks in groups.items():
            by_state: dict[int, list[int]] = defaultdict(list)
            for rank in ranks:
                by_state[rows[rank][col + 1]].append(rank)
            if len(by_state) > 1:
                sides = " vs ".join(str(r) for r in by_state.values())
                where = _describe(dims, key) or "every rank"
                problems.append(f"stream {name!r}: ranks {sides} must share it ({where}) but hold different states")
            for state, state_ranks in by_state.items():
                other = owner.setdefault(state, key)
                if other != key:
                    problems.append(
                        f"stream {name!r}: ranks {groups[other]} and {state_ranks} must differ "
                        f"({_describe(dims, other)} vs {_describe(dims, key)}) but hold identical states"
                    )
        verdicts.append(StreamVerdict(name, dims, len(owner), len(groups)))  # owner: one entry per distinct state
    if problems:
        _raise(problems, "RNG streams are out of sync across ranks")
    declared = [DEFAULT_STREAM, *layout.streams]  # report in the order the layout declares them
    return sorted(verdicts, key=lambda v: declared.index(v.stream))


def _raise(problems: list[str], headline: str) -> None:
    shown = problems[:_MAX_REPORTED]
    more = len(problems) - len(shown)
    raise RNGDesyncError(f"{headline}:\n  " + "\n  ".join(shown) + (f"\n  ... and {more} more" if more else ""))


def _describe(dims: tuple[str, ...], key: tuple[int, ...]) -> str:
    return ", ".join(f"{d}={c}" for d, c in zip(dims, key))
