"""Hostile checkpoint files and states: refused with a message naming the limit, in work bounded by
their size (counted here, never timed), and legitimate checkpoints up to the documented limits
still load.

The attacks, each at a scale that showed it before the limits: views made by ``expand`` (a few
bytes stored, a megabyte seen), one string referred to thousands of times, a forged layout of
thousands of dimensions and streams with its digest recomputed, an entry compressed with deflate,
zip entries sharing one region, and pickles that make far more than their bytes."""

from __future__ import annotations

import _codecs
import collections
import dataclasses
import hashlib
import io
import os
import pickle
import struct
import tracemalloc
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch

import hyperrng.resume._save_load as save_load_module
from hyperrng.errors import InvalidArgumentError
from hyperrng.resume import _format as _state_format
from hyperrng.resume import _pickle_check, _pickle_values, _untrusted
from hyperrng.resume._format import digest
from hyperrng.resume.state import load_rng_state, load_rng_state_dict, rng_state_dict, save_rng_state
from hyperrng.seeding import layout as layout_module
from hyperrng.seeding.layout import MAX_DIMS, MAX_STREAMS, StreamLayout, apply_layout
from hyperrng.streams.tracker import RNGStatesTracker

_MiB = 1 << 20


@pytest.fixture(autouse=True)
def _on_the_cpu() -> Iterator[None]:
    with platforms.use(platforms.CPUPlatform()):
        yield


def _state(layout: StreamLayout | None = None, coords: dict[str, int] | None = None) -> dict[str, Any]:
    layout = layout or StreamLayout(dims=("dp", "tp"), default=(), streams={"mp": ("tp",)})
    tracker = RNGStatesTracker()
    apply_layout(layout, 1234, coords or {d: 1 for d in layout.dims}, tracker=tracker)
    return rng_state_dict(tracker=tracker)


def _resealed(state: dict[str, Any]) -> dict[str, Any]:
    state["digest"] = digest(state)
    return state


@pytest.fixture
def no_torch_load(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """torch.load, recording each call: a file refused by the pre-check never reaches it."""
    calls: list[Any] = []
    real = torch.load

    def load(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    return calls


class _CountingHash:
    """blake2b, counting the bytes the digest feeds it."""

    fed = 0

    def __init__(self, **kwargs: Any) -> None:
        self._h = hashlib.blake2b(**kwargs)

    def update(self, data: Any) -> None:
        _CountingHash.fed += memoryview(data).nbytes
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> type[_CountingHash]:
    class _Hashlib:
        blake2b = _CountingHash

    _CountingHash.fed = 0
    monkeypatch.setattr(_state_format, "hashlib", _Hashlib)
    return _CountingHash


# -- crafted zips and pickles -----------------------------------------------------------------------


def _zip(
    records: list[tuple[str, bytes]],
    aliases: tuple[tuple[str, int], ...] = (),
    deflated: dict[str, tuple[bytes, int]] | None = None,
) -> bytes:
    """A zip of ``records`` (name, bytes), stored, except those ``deflated`` gives as (raw deflate
    stream, plain size); each alias is one more directory entry pointing at record ``index``."""
    out, directory, local = io.BytesIO(), [], []
    for name, data in records:
        raw, plain, method = (*deflated[name], 8) if deflated and name in deflated else (data, len(data), 0)
        encoded, crc = name.encode(), zlib.crc32(data)
        local.append((out.tell(), crc, len(raw), plain, method))
        out.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0, crc, len(raw), plain, len(encoded), 0))
        out.write(encoded + raw)
        directory.append((encoded, *local[-1]))
    directory += [(name.encode(), *local[index]) for name, index in aliases]
    start = out.tell()
    for encoded, offset, crc, packed, plain, method in directory:
        out.write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0, crc, packed, plain,
                              len(encoded), 0, 0, 0, 0, 0, offset) + encoded)  # fmt: skip
    size = out.tell() - start
    out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(directory), len(directory), size, start, 0))
    return out.getvalue()


def _torch_file(pkl: bytes, storages: tuple[tuple[str, bytes], ...] = (), **zip_args: Any) -> bytes:
    """A zip laid out as torch.save lays one out, holding the pickle ``pkl`` and ``storages``."""
    records = [("archive/data.pkl", pkl), ("archive/byteorder", b"little")]
    records += [(f"archive/data/{key}", data) for key, data in storages] + [("archive/version", b"3\n")]
    return _zip(records, **zip_args)


class _Storage:
    def __init__(self, key: str, nbytes: int) -> None:
        self.key, self.nbytes = key, nbytes


class _Tensor:
    """Pickles as torch.save pickles a uint8 tensor over ``storage``."""

    def __init__(self, storage: _Storage, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.storage, self.size, self.stride = storage, size, stride

    def __reduce__(self) -> Any:
        return torch._utils._rebuild_tensor_v2, (
            self.storage,
            0,
            self.size,
            self.stride,
            False,
            collections.OrderedDict(),
        )


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return ("storage", torch.ByteStorage, obj.key, "cpu", obj.nbytes) if isinstance(obj, _Storage) else None


def _dumps(obj: Any) -> bytes:
    out = io.BytesIO()
    _Pickler(out, protocol=2).dump(obj)
    return out.getvalue()


def _refused_file(tmp_path: Path, data: bytes, no_torch_load: list[Any], fragment: str) -> InvalidArgumentError:
    """``data`` written to a file and refused by the pre-check (torch.load never called), the
    message naming ``fragment``; Python's allocations meanwhile stay under the file's size + 16 MiB."""
    path = tmp_path / "rng.pt"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgumentError) as info:
            load_rng_state(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert fragment in str(info.value), str(info.value)
    assert not no_torch_load, "the file reached torch.load"
    assert peak < len(data) + _pickle_check.EXTRA_MEMORY, peak
    return info.value


# -- legitimate checkpoints load -------------------------------------------------------------------


def _round_trips(value: Any) -> bool:
    """Whether this torch's ``torch.save`` writes ``value`` and its ``torch.load(weights_only=True)`` reads it
    back: torch 2.5 has no storage type for uint16 and its loader refuses sets and complex numbers."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except (KeyError, RuntimeError, pickle.UnpicklingError):
        return False
    return True


def test_a_default_state_and_a_full_training_checkpoint_load(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 5])  # its milestones are a Counter
    extras = {"bytes": b"\x00\xff", "bytearray": bytearray(b"ab"), "device": torch.device("cpu"),
              "size": torch.Size([2, 3]), "param": torch.nn.Parameter(torch.ones(2)),
              "ordered": collections.OrderedDict(a=1)}  # fmt: skip
    newer = {"set": {1, 2}, "complex": 1 + 2j, "uint16": torch.zeros(3, dtype=torch.uint16)}
    extras.update({key: value for key, value in newer.items() if _round_trips(value)})  # each where this torch has it
    state = _state()
    checkpoint = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "rng": state,
                  "extras": extras}  # fmt: skip
    save_rng_state(tmp_path / "ckpt.pt", checkpoint)
    loaded = load_rng_state(tmp_path / "ckpt.pt")
    assert loaded["sched"]["milestones"] == collections.Counter({3: 1, 5: 1})
    assert loaded["extras"].keys() == extras.keys() and loaded["extras"]["bytes"] == b"\x00\xff"
    assert loaded["extras"].get("set", {1, 2}) == {1, 2}
    load_rng_state_dict(loaded["rng"], tracker=RNGStatesTracker())
    save_rng_state(tmp_path / "rng.pt", state)
    load_rng_state_dict(load_rng_state(tmp_path / "rng.pt"), tracker=RNGStatesTracker())


@dataclasses.dataclass
class _Config:
    lr: float


def test_a_checkpoint_holding_an_object_registered_as_a_safe_global_loads(tmp_path: Path) -> None:
    torch.save({"config": _Config(0.5), "rng": _state()}, tmp_path / "ckpt.pt")
    with torch.serialization.safe_globals([_Config]):
        assert load_rng_state(tmp_path / "ckpt.pt")["config"] == _Config(0.5)


@pytest.mark.parametrize(("dims", "streams"), [(8, 6), (MAX_DIMS, MAX_STREAMS)], ids=["8-dims", "largest"])
def test_a_state_up_to_the_documented_layout_limits_loads(tmp_path: Path, dims: int, streams: int) -> None:
    names = [f"dim{i}" for i in range(dims)]
    layout = StreamLayout(dims=names, default=names[:1], streams={f"stream-{i}": names for i in range(streams)})
    state = _state(layout, {d: 1 for d in names})
    save_rng_state(tmp_path / "rng.pt", state)
    tracker = RNGStatesTracker()
    load_rng_state_dict(load_rng_state(tmp_path / "rng.pt"), tracker=tracker, layout=layout)
    assert len(tracker.get_states()) == streams


def test_the_largest_documented_state_on_a_counter_based_device_fits_the_instruction_limit() -> None:
    # 16-byte device states make the smallest file for its pickle: the tightest case for the
    # limit of instructions per byte.
    names = [f"d{i}" for i in range(MAX_DIMS)]
    state = _state(StreamLayout(dims=names, default=(), streams={f"s{i}": names for i in range(MAX_STREAMS)}))
    state["streams"] = {name: torch.zeros(16, dtype=torch.uint8) for name in state["streams"]}
    out = io.BytesIO()
    torch.save(state, out)
    _untrusted.check_file(io.BytesIO(out.getvalue()), "rng.pt")  # not refused


# -- stride-0 and overlapping tensors --------------------------------------------------------------


def test_a_file_of_expanded_tensors_is_refused_from_their_strides(tmp_path: Path, hashed: type[_CountingHash]) -> None:
    # 50 views of one element, a megabyte of complex numbers each: the digest copied and hashed
    # 800 MB of a 35 KB file (2.6 s).
    state = _state()
    state["streams"] = {f"s{i}": torch.zeros(1, dtype=torch.complex128).expand(1 << 20) for i in range(50)}
    torch.save(state, tmp_path / "rng.pt")
    assert (tmp_path / "rng.pt").stat().st_size < 64 * 1024
    loaded = load_rng_state(tmp_path / "rng.pt")
    hashed.fed = 0
    with pytest.raises(InvalidArgumentError, match=r"strides \(0,\)"):
        load_rng_state_dict(loaded, tracker=RNGStatesTracker())
    assert hashed.fed < 64 * 1024, "the digest read the views' elements"


@pytest.mark.parametrize(
    "forge",
    [
        lambda: torch.zeros(8, dtype=torch.uint8).as_strided((5072,), (0,)),
        lambda: torch.zeros(5080, dtype=torch.uint8).as_strided((2, 5072), (8, 1)),  # rows overlap
        lambda: torch.zeros(2, 5072, dtype=torch.uint8).t(),
    ],
    ids=["stride-0", "overlapping", "transposed"],
)
def test_an_in_memory_state_with_a_view_is_refused_as_from_a_file(forge: Any) -> None:
    # A state from torch.distributed.checkpoint arrives without a file: the same checks hold.
    state = _state()
    state["streams"]["mp"] = forge()
    with pytest.raises(InvalidArgumentError, match="with strides .* each element stored once"):
        load_rng_state_dict(_resealed(state), tracker=RNGStatesTracker())


def test_two_tensors_over_one_storage_are_refused(hashed: type[_CountingHash]) -> None:
    state = _state()
    buffer = torch.zeros(1 << 20, dtype=torch.uint8)
    state["devices"] = [buffer[:]] + [buffer.view(-1) for _ in range(99)]  # 100 MB to hash from one
    hashed.fed = 0
    with pytest.raises(InvalidArgumentError, match="share one storage"):
        load_rng_state_dict(state, tracker=RNGStatesTracker())
    assert hashed.fed < 2 * _MiB


# -- shared objects -------------------------------------------------------------------------------


def test_one_long_string_referred_to_many_times_is_refused_after_a_bounded_read(
    tmp_path: Path, hashed: type[_CountingHash]
) -> None:
    # torch.save writes the string once and a reference for each use: 20,000 uses of 64 KB in a
    # 129 KB file made the digest hash 1.3 GB (7 to 12 s). 2,000 show it here.
    state = _state()
    state["notes"] = ["x" * (1 << 16)] * 2000
    torch.save(state, tmp_path / "rng.pt")
    assert (tmp_path / "rng.pt").stat().st_size < 128 * 1024
    with pytest.raises(InvalidArgumentError, match=f"more than {_state_format._MAX_TEXT_TOTAL} characters of text"):
        load_rng_state_dict(load_rng_state(tmp_path / "rng.pt"), tracker=RNGStatesTracker())
    assert hashed.fed < _state_format._MAX_TEXT_TOTAL + 2 * (1 << 16) + 64 * 1024


# -- forged sizes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dims", "streams", "fragment"),
    [(6000, 6000, f"at most {MAX_DIMS} mesh dimensions"), (MAX_DIMS, 6000, f"at most {MAX_STREAMS} streams")],
    ids=["6000-dims", "6000-streams"],
)
def test_a_forged_layout_with_its_digest_recomputed_is_refused_before_a_stream_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dims: int, streams: int, fragment: str
) -> None:
    # It was accepted, after 5.4 s (10,000 of each: 15.8 s), each stream checked against a set of
    # all the dimensions built anew. In a file its pickle holds more instructions than the file
    # pays for; as a dict (from DCP) the layout's size is refused before any stream is checked.
    state = _state()
    names = [f"d{i}" for i in range(dims)]
    state["layout"] = {"version": 1, "domain": layout_module.LAYOUT_DOMAIN, "dims": names, "default": [],
                       "streams": {f"st{i}": [names[i % dims]] for i in range(streams)}}  # fmt: skip
    state["coords"] = {d: 0 for d in names}
    torch.save(_resealed(state), tmp_path / "rng.pt")
    with pytest.raises(InvalidArgumentError, match="instructions"):
        load_rng_state(tmp_path / "rng.pt")
    checked: list[str] = []
    real = layout_module._stream_dims

    def counted(name: str, *args: Any) -> tuple[str, ...]:
        checked.append(name)
        return real(name, *args)

    monkeypatch.setattr(layout_module, "_stream_dims", counted)
    with pytest.raises(InvalidArgumentError, match=fragment):
        load_rng_state_dict(state, tracker=RNGStatesTracker())
    assert not checked, "streams were checked before the layout's size was"


def test_a_layout_over_the_limits_is_refused_when_built() -> None:
    with pytest.raises(InvalidArgumentError, match="hyperrng.seeding.layout.MAX_DIMS"):
        StreamLayout(dims=[f"d{i}" for i in range(MAX_DIMS + 1)], default=(), streams={})
    with pytest.raises(InvalidArgumentError, match="hyperrng.seeding.layout.MAX_STREAMS"):
        StreamLayout(dims=["tp"], default=(), streams={f"s{i}": ("tp",) for i in range(MAX_STREAMS + 1)})


# -- the container --------------------------------------------------------------------------------


def test_a_deflate_bomb_is_refused_before_it_is_inflated(tmp_path: Path, no_torch_load: list[Any]) -> None:
    # A 128 MiB storage deflated to 128 KB: torch's zip reader inflated it (+129 MB) before anything
    # was refused.
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    zeros = bytes(_MiB)
    bomb = b"".join(compressor.compress(zeros) for _ in range(128)) + compressor.flush()
    pkl = _dumps({"t": _Tensor(_Storage("0", 128 * _MiB), (128 * _MiB,), (1,))})
    data = _torch_file(pkl, (("0", b""),), deflated={"archive/data/0": (bomb, 128 * _MiB)})
    assert len(data) < 256 * 1024
    _refused_file(tmp_path, data, no_torch_load, "is compressed")


def test_entries_sharing_one_region_are_refused(tmp_path: Path, no_torch_load: list[Any]) -> None:
    # 200 directory entries over one stored megabyte: torch read it 200 times (+201 MB for 1 MB).
    refs = [_Tensor(_Storage(str(k), _MiB), (_MiB,), (1,)) for k in range(200)]
    aliases = tuple((f"archive/data/{k}", 2) for k in range(1, 200))
    data = _torch_file(_dumps({"t": refs}), (("0", bytes(_MiB)),), aliases=aliases)
    _refused_file(tmp_path, data, no_torch_load, "two of its entries share bytes")


def _zip64(records: list[tuple[str, bytes]], claimed: int = 24) -> bytes:
    """A zip of stored ``records`` in the zip64 form (sizes and offsets in each entry's extra field,
    the directory's in the zip64 record), as torch.save writes past 65,535 entries or 4 GiB; each
    extra field says it holds ``claimed`` bytes (it holds 24)."""
    out, directory = io.BytesIO(), []
    for name, data in records:
        encoded, crc = name.encode(), zlib.crc32(data)
        directory.append((encoded, out.tell(), crc, len(data)))
        out.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 0, 0, 0, 0, crc, len(data), len(data), len(encoded), 0))
        out.write(encoded + data)
    start = out.tell()
    for encoded, offset, crc, size in directory:
        extra = struct.pack("<HHQQQ", 1, claimed, size, size, offset)
        out.write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0, 0, 0, 0, crc, 0xFFFFFFFF, 0xFFFFFFFF,
                              len(encoded), len(extra), 0, 0, 0, 0, 0xFFFFFFFF) + encoded + extra)  # fmt: skip
    size, record = out.tell() - start, out.tell()
    out.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, len(directory), len(directory), size, start))
    out.write(struct.pack("<IIQI", 0x07064B50, 0, record, 1))
    out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))
    return out.getvalue()


def test_a_zip64_file_is_read_as_torch_reads_it(tmp_path: Path) -> None:
    pkl = _dumps({"t": _Tensor(_Storage("0", 4), (4,), (1,))})
    records = [("archive/data.pkl", pkl), ("archive/byteorder", b"little"), ("archive/data/0", b"\x01\x02\x03\x04"),
               ("archive/version", b"3\n")]  # fmt: skip
    (tmp_path / "rng.pt").write_bytes(_zip64(records))
    assert load_rng_state(tmp_path / "rng.pt")["t"].tolist() == [1, 2, 3, 4]


def test_a_zip64_field_claiming_more_bytes_than_it_holds_is_refused_as_damaged() -> None:
    # Its sizes were unpacked at the length it claimed: struct.error, not a typed refusal.
    pkl = _dumps({"t": _Tensor(_Storage("0", 4), (4,), (1,))})
    data = _zip64([("archive/data.pkl", pkl), ("archive/data/0", b"\x01\x02\x03\x04")], claimed=64)
    with pytest.raises(InvalidArgumentError, match="lacks its sizes"):
        _untrusted.check_file(io.BytesIO(data), "rng.pt")


def test_a_legacy_torch_file_is_refused_unread(tmp_path: Path, no_torch_load: list[Any]) -> None:
    # The format before torch 1.6 allocates each storage at the size its header declares.
    out = io.BytesIO()
    torch.save({"a": torch.zeros(3)}, out, _use_new_zipfile_serialization=False)
    _refused_file(tmp_path, out.getvalue(), no_torch_load, "it is not a zip file")


def test_a_storage_declared_larger_than_its_entry_is_refused(tmp_path: Path, no_torch_load: list[Any]) -> None:
    pkl = _dumps({"t": _Tensor(_Storage("0", 1 << 30), (16,), (1,))})
    _refused_file(tmp_path, _torch_file(pkl, (("0", bytes(16)),)), no_torch_load, "declared as 1073741824 bytes")


# -- the pickle -----------------------------------------------------------------------------------


def _program(*parts: bytes) -> bytes:
    return b"\x80\x02" + b"".join(parts) + b"."


@pytest.mark.parametrize(
    ("pkl", "fragment"),
    [
        (_program(b"c__builtin__\nbytearray\nJ" + struct.pack("<i", 1 << 28) + b"\x85R"), "makes a bytearray"),
        (_program(b"ctorch\nTensor\nJ" + struct.pack("<i", 1 << 28) + b"\x85R"), "calls torch.Tensor"),
        (
            _program(
                b"ctorch._tensor\n_rebuild_from_type_v2\n(c__builtin__\nbytearray\nctorch\nTensor\nJ"
                + struct.pack("<i", 1 << 28)
                + b"\x85}tR"
            ),
            "other than a tensor rebuild",
        ),  # fmt: skip
        (_program(b"c_codecs\nencode\nX\x03\x00\x00\x00abcX\x08\x00\x00\x00punycode\x86R"), "latin1"),
        (_program(b"ctorch._utils\n_rebuild_qtensor\n"), "names torch._utils._rebuild_qtensor"),
        (_program(b"ctorch._utils\n_rebuild_sparse_tensor\n"), "names torch._utils._rebuild_sparse_tensor"),
    ],
    ids=["bytearray-of-a-size", "tensor-of-a-size", "rebuild-calling-bytearray", "punycode", "quantized", "sparse"],
)
def test_a_pickle_calling_what_torch_save_never_calls_is_refused(
    tmp_path: Path, no_torch_load: list[Any], pkl: bytes, fragment: str
) -> None:
    # bytearray(2**28) is 17 bytes of pickle and was 256 MB of memory.
    _refused_file(tmp_path, _torch_file(pkl), no_torch_load, fragment)


def test_a_pickle_of_more_instructions_than_its_file_pays_for_is_refused_after_counting_them(
    tmp_path: Path, no_torch_load: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A megabyte of one-byte instructions (empty dicts): torch's loader took 1.8 s and 79 MB.
    monkeypatch.setattr(_pickle_check, "FREE_INSTRUCTIONS", 1000)  # the limit's mechanism, at a size quick to build
    n = 100_000
    data = _torch_file(_program(b"](" + b"}" * n + b"e"))
    error = _refused_file(tmp_path, data, no_torch_load, "FREE_INSTRUCTIONS")
    limit = 1000 + len(data) // _pickle_check.BYTES_PER_INSTRUCTION
    assert f"more than {limit} instructions" in str(error)


def test_tensors_rebuilt_over_one_storage_count_as_more_instructions(tmp_path: Path, no_torch_load: list[Any]) -> None:
    # One memoized tuple of arguments given to each rebuild makes a tensor every few instructions,
    # each 20 to 40 microseconds for torch: 36,000 in a 1 MB file took 0.6 s of processor time
    # (1.4 s on a busy machine). The first tensor over each storage is paid for by its entry.
    args = (_Storage("0", 1), 0, (1,), (1,), False, _ODICT())
    tensors = [_Call(torch._utils._rebuild_tensor_v2, args) for _ in range(1000)]  # 4 instructions each
    data = _torch_file(_dumps({"k": tensors}), (("0", b"\x00"),))
    assert len(data) < 16 * 1024
    error = _refused_file(tmp_path, data, no_torch_load, "TENSOR_INSTRUCTIONS")
    assert f"each tensor counted as {_pickle_check.TENSOR_INSTRUCTIONS} more" in str(error)


def test_a_pickle_whose_objects_outgrow_the_file_is_refused(
    tmp_path: Path, no_torch_load: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_pickle_check, "EXTRA_MEMORY", 64 * 1024)  # the limit's mechanism, at a size quick to build
    data = _torch_file(_program(b"](" + b"\x8f" * 2000 + b"e"))  # 2,000 empty sets, 216 bytes each
    error = str(_refused_file(tmp_path, data, no_torch_load, "EXTRA_MEMORY"))
    # The message states the rule the check applies: the pickle's bytes count twice.
    budget = 64 * 1024 + len(data) - 2 * len(_program(b"](" + b"\x8f" * 2000 + b"e"))
    assert f"more than {budget / _MiB:.1f} MiB: 0.1 MiB" in error and "less twice its pickle's" in error, error
    assert "torch.save never writes such a file" not in error  # save_rng_state may have written it


def test_a_pickle_naming_a_global_torch_refuses_is_left_for_torch_to_refuse(tmp_path: Path) -> None:
    path = tmp_path / "rng.pt"
    path.write_bytes(_torch_file(_program(b"cos\nsystem\n")))
    with pytest.raises(InvalidArgumentError, match="UnpicklingError"):
        load_rng_state(path)


# -- what the loader's calls iterate, hash or copy -------------------------------------------------


class _Call:
    """Pickles as ``func(*args)``, then ``BUILD`` with ``state`` where one is given."""

    def __init__(self, func: Any, args: tuple[Any, ...], state: Any = None) -> None:
        self.func, self.args, self.state = func, args, state

    def __reduce__(self) -> Any:
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


def _view(n: int, rows: int = 0) -> _Tensor:
    """``n`` elements (``rows`` of 2 where given) seen over one stored byte, by stride 0."""
    return _Tensor(_Storage("0", 1), (rows, 2) if rows else (n,), (0, 0) if rows else (0,))


def _shared_tuple(levels: int) -> Any:
    """A tuple of ``levels`` levels, each level its inner one twice: pickled in a few bytes per level,
    hashed or printed in 2**levels steps."""
    value: Any = 0
    for _ in range(levels):
        value = (value, value)
    return value


_ODICT = collections.OrderedDict


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (_Call(set, (_view(1 << 16),)), "calls builtins.set with"),
        (_Call(collections.Counter, (_view(1 << 16),)), "calls collections.Counter with"),
        (_Call(_ODICT, (_view(0, rows=1 << 16),)), "calls collections.OrderedDict with"),
        (_Call(torch.Size, (_view(1 << 16),)), "calls torch.Size with"),
        (_Call(torch.serialization._get_layout, (_view(1 << 16),)), "calls torch.serialization._get_layout with"),
        (_Call(_ODICT, (), _view(0, rows=1 << 16)), "builds an OrderedDict from"),
        (
            _Call(torch._utils._rebuild_tensor_v2, (_Storage("0", 1), 0, (1,), (1,), False, _ODICT()), _view(1 << 16)),
            "builds a tensor",
        ),
        (
            _Call(
                torch._tensor._rebuild_from_type_v2, (torch._utils._rebuild_tensor_v2, torch.Tensor, _view(1 << 16), {})
            ),
            "calls torch._utils._rebuild_tensor_v2 with",
        ),
    ],  # fmt: skip
    ids=["set", "Counter", "OrderedDict", "Size", "layout", "OrderedDict-state", "tensor-state", "subclass-args"],
)
def test_a_call_that_would_iterate_a_tensor_is_refused(
    tmp_path: Path, no_torch_load: list[Any], value: Any, fragment: str
) -> None:
    # Iterating a tensor makes an object per element, and a stride-0 view of one stored byte
    # declares any number: set(<2**20 elements>) in a 1 KB file took 918 MB; printing one (the
    # KeyError of torch.serialization._get_layout) took 29 s and 870 MB for 2**20 elements.
    _refused_file(tmp_path, _torch_file(_dumps({"k": value}), (("0", b"\x00"),)), no_torch_load, fragment)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ({_shared_tuple(20): 1}, "a dict key"),
        (_Call(set, ([_shared_tuple(20)],)), "a set item"),
        ({(1, 2): 1}, "a dict key"),
        ({k * ((1 << 61) - 1): 0 for k in range(1, 4)}, "a dict key"),
        (_Call(set, ([1 << 61],)), "a set item"),
    ],
    ids=["shared-tuple-key", "shared-tuple-item", "tuple-key", "colliding-int-keys", "large-int-item"],
)
def test_a_dict_key_or_set_item_whose_hash_is_not_bounded_is_refused(
    tmp_path: Path, no_torch_load: list[Any], value: Any, fragment: str
) -> None:
    # A tuple is hashed anew at each use, over every item it reaches: 64 levels of shared tuples
    # (1.2 KB) never finished hashing, and a key 300,000 tuples deep crashed CPython's recursive
    # hash. Ints that are multiples of 2**61 - 1 all hash to 0: 20,000 such keys (280 KB) took
    # 6.6 s to insert.
    _refused_file(tmp_path, _torch_file(_dumps({"k": value})), no_torch_load, fragment)


_PRINTED = _shared_tuple(20)  # 2**20 steps to print


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (
            _Call(
                torch._utils._rebuild_parameter_with_state,
                (_Tensor(_Storage("0", 1), (1,), (1,)), False, _ODICT(), (_PRINTED, 0, 0)),
            ),
            "gives an object a state of a tuple",
        ),
        (
            _Call(
                torch._tensor._rebuild_from_type_v2,
                (
                    torch._utils._rebuild_tensor_v2,
                    torch.Tensor,
                    (_Storage("0", 1), 0, (1,), (1,), False, _ODICT()),
                    (_PRINTED, 0, 0),
                ),
            ),
            "gives an object a state of a tuple",
        ),
        (
            _Call(
                torch._utils._rebuild_tensor_v2, (_Storage("0", 1), 0, (1,), (1,), False, _ODICT(), {"conj": _PRINTED})
            ),
            "calls torch._utils._rebuild_tensor_v2 with",
        ),
    ],
    ids=["parameter-state", "subclass-state", "metadata"],
)
def test_what_torch_would_print_in_its_refusal_is_refused_first(
    tmp_path: Path, no_torch_load: list[Any], value: Any, fragment: str
) -> None:
    # torch refuses an object's state that is not a dict or a pair of dicts, and metadata that is not
    # a dict of strings to bools, by printing it in its error: 2**22 steps took 3.3 s, and 64
    # shared levels (1.2 KB) never end.
    _refused_file(tmp_path, _torch_file(_dumps({"k": value}), (("0", b"\x00"),)), no_torch_load, fragment)


def test_keys_and_set_items_of_every_kind_the_check_accepts_load(tmp_path: Path) -> None:
    keys = {"s": 0, -1: 1, -2: 2, (1 << 61) - 2: 3, 0.5: 4, float("inf"): 5, None: 6, True: 7}
    value: dict[str, Any] = {"keys": keys, "counter": collections.Counter("aab")}
    if _round_trips({1}):  # torch 2.5's loader refuses sets
        value["set"] = {"a", 1, -(1 << 61) + 2, 2.5, None, False}
    torch.save(value, tmp_path / "rng.pt")
    assert load_rng_state(tmp_path / "rng.pt") == value


def test_the_walk_compares_no_value_of_the_file_but_strings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `args[1] in {"latin1", ...}` hashed the file's tuple before refusing it: 2**24 steps took
    # 0.3 s in the check itself, and a deep one would crash it.
    looked_up: list[type] = []

    class Latin1(set[str]):
        def __contains__(self, value: object) -> bool:
            looked_up.append(type(value))
            return super().__contains__(value)

    monkeypatch.setattr(_pickle_values, "_LATIN1", Latin1(_pickle_values._LATIN1))
    pkl = _dumps({"k": _Call(_codecs.encode, ("x", _shared_tuple(3)))})
    path = tmp_path / "rng.pt"
    path.write_bytes(_torch_file(pkl))
    with pytest.raises(InvalidArgumentError, match="latin1"):
        load_rng_state(path)
    assert set(looked_up) <= {str}, looked_up


@pytest.mark.parametrize("kind", ["tensor-dims", "shared-state", "shared-build", "shared-metadata"])
def test_what_each_tensor_or_object_copies_is_counted(
    tmp_path: Path, no_torch_load: list[Any], monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    # One memoized size of 3,000 dimensions given to 20,000 tensors over one byte: each holds its
    # sizes and strides (48 KB), 930 MB and 8 s for a 1.7 MB file. One memoized dict given as the
    # state of many objects is copied into each. Shown at 1 MiB of EXTRA_MEMORY, quick to build.
    monkeypatch.setattr(_pickle_check, "EXTRA_MEMORY", _MiB)
    shared = {f"a{i}": False for i in range(1000)}
    if kind == "tensor-dims":
        size, stride = (1,) * 1000, (0,) * 1000  # one object each, pickled once
        items: list[Any] = [_Tensor(_Storage("0", 1), size, stride) for _ in range(100)]
    elif kind == "shared-state":
        param = _Tensor(_Storage("0", 1), (1,), (1,))
        items = [
            _Call(torch._utils._rebuild_parameter_with_state, (param, False, _ODICT(), shared)) for _ in range(100)
        ]
    elif kind == "shared-build":
        items = [_Call(_ODICT, (), shared) for _ in range(100)]
    else:
        items = [_Call(torch._utils._rebuild_tensor_v2, (_Storage("0", 1), 0, (1,), (1,), False, _ODICT(), shared))
                 for _ in range(100)]  # fmt: skip
    data = _torch_file(_dumps({"k": items}), (("0", b"\x00"),))
    assert len(data) < 64 * 1024
    _refused_file(tmp_path, data, no_torch_load, "EXTRA_MEMORY")


# -- a file rewritten while it loads ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "owner"),
    [(0o644, None), (0o666, None), (0o620, None), (0o644, 65534)],
    ids=["own", "writable-by-others", "writable-by-group", "another-users"],
)
def test_a_file_another_user_can_write_is_checked_and_loaded_from_one_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int, owner: int | None
) -> None:
    # Whoever can write the file could rewrite it between the check and torch's read of the same
    # descriptor: a file checked as plain data could then load as anything the check refuses (a set
    # of a 2**20-element view: 918 MB from 1 KB).
    if owner is not None and getattr(os, "geteuid", lambda: 1)() != 0:
        pytest.skip("giving a file to another user needs root")
    path = tmp_path / "rng.pt"
    save_rng_state(path, {"k": 1})
    path.chmod(mode)
    if owner is not None:
        os.chown(path, owner, -1)
    hostile = _torch_file(_dumps({"k": 2}))
    real, checked = save_load_module.check_file, []

    def check_then_rewrite(file: Any, shown: str) -> None:
        real(file, shown)
        checked.append(file)
        path.write_bytes(hostile)  # its owner, or whoever may write it, rewrites it now

    monkeypatch.setattr(save_load_module, "check_file", check_then_rewrite)
    loaded = load_rng_state(path)
    if mode == 0o644 and owner is None and hasattr(os, "geteuid"):  # only this user writes it: read in place
        assert not isinstance(checked[0], io.BytesIO) and loaded == {"k": 2}
    else:
        assert isinstance(checked[0], io.BytesIO) and loaded == {"k": 1}
