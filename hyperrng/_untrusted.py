"""Checks of a checkpoint file before ``torch.load(weights_only=True)`` reads it.

That loader runs no code, but it does what the file declares: it inflates compressed entries,
reads the entries the zip's central directory points at (several may point at one region), and
follows the pickle's instructions, whose objects can take far more memory than their bytes
(``bytearray(2**31)`` is a few bytes) and whose count sets the time (the loader is written in
Python: microseconds per instruction). :func:`check_file` reads the file's structure first and
refuses it unless what the load will do is bounded by the file's own size:

* **the container**: a zip of the kind ``torch.save`` writes (the only kind ``load_rng_state``
  reads), every entry stored uncompressed, its declared sizes equal, its local header and data
  inside the file and before the central directory, no two entries' regions overlapping. So
  the entries hold at most the file's bytes in all.
* **the pickle** (``data.pkl``), walked once without building anything: at most
  :data:`FREE_INSTRUCTIONS` instructions plus one per :data:`BYTES_PER_INSTRUCTION` bytes of the
  file; only the globals a checkpoint of tensors, numbers, strings, lists and dicts needs (and
  those registered with ``torch.serialization.add_safe_globals`` by other packages than torch),
  called only in the ways ``torch.save`` writes them; every storage it refers to present with
  the size it declares; and the objects it makes, estimated from their sizes in CPython, within
  :data:`EXTRA_MEMORY` plus the file's size less the storages and the pickle torch reads.

A file refused here raises :class:`~hyperrng.errors.InvalidArgumentError` naming the limit,
before torch has read anything of it. Where the pickle names a global that torch's loader
refuses, the walk stops there and leaves the refusal to torch, which makes nothing beyond what
was counted. A checkpoint that legitimately exceeds a limit (more than about 7,000 tensors in
one file, whose objects take some 2 KB each; quantized or sparse tensors) can still be read with
``torch.load(path, weights_only=True)`` directly and its state passed to
:func:`hyperrng.load_rng_state_dict`, whose own checks hold for any dict.
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Callable
from typing import IO, Any

import numpy as np
import torch

from hyperrng.errors import InvalidArgumentError

__all__ = ["BYTES_PER_INSTRUCTION", "EXTRA_MEMORY", "FREE_INSTRUCTIONS", "check_file"]

EXTRA_MEMORY = 16 << 20
"""Bytes (16 MiB) a load may hold beyond the file's size: the objects of its pickle (estimated
from their sizes in CPython, a little above what they take) may fill this much plus the file's
size less the storages it refers to and twice the pickle (torch holds its bytes and a copy)."""

FREE_INSTRUCTIONS = 1 << 13
"""Pickle instructions any file may hold beyond those its size pays for: an RNG state with
:data:`hyperrng.layout.MAX_STREAMS` streams each over :data:`hyperrng.layout.MAX_DIMS`
dimensions holds about 52,500, and its file (350 to 375 KB with a counter-based device's
16-byte states, the smallest) pays for all but about 2,300 of them."""

BYTES_PER_INSTRUCTION = 7
"""Bytes of file that pay for one pickle instruction beyond :data:`FREE_INSTRUCTIONS`:
``torch.save`` writes about one per 10 bytes for a dict of tiny tensors (each stored in an
entry of its own), one per 7 for the largest documented RNG state, far fewer for larger
tensors. torch's loader takes 2 to 4 microseconds per instruction, this walk about one and
the digest one or two, so a file is read or refused in well under a second per megabyte (plus
a few hundredths of a second for the free instructions)."""

_EOCD = struct.Struct("<IHHHHIIH")  # end of central directory
_EOCD_SIG = 0x06054B50
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_ZIP64_LOCATOR_SIG = 0x07064B50
_ZIP64_EOCD = struct.Struct("<IQHHIIQQQQ")
_ZIP64_EOCD_SIG = 0x06064B50
_ENTRY = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory entry
_ENTRY_SIG = 0x02014B50
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local header
_LOCAL_SIG = 0x04034B50
_U16, _U32 = 0xFFFF, 0xFFFFFFFF
_CHUNK = 1 << 20  # the central directory is read in pieces of this size
_PICKLE = b"data.pkl"


def check_file(file: IO[bytes], path: str) -> None:
    """Refuse the checkpoint open as ``file`` unless ``torch.load(file, weights_only=True)`` reads
    it in time and memory bounded by its size (see the module's docstring); leave ``file`` at
    its start.

    Raises:
        InvalidArgumentError: the file is not a zip that ``torch.save`` could have written, or
            its pickle exceeds a limit; the message names which, and nothing has been loaded.
        OSError: reading the file failed.
    """
    size = file.seek(0, os.SEEK_END)
    archive = _Archive(file, size, path)
    offset, length = archive.pickle
    file.seek(offset)
    data = file.read(length)
    if len(data) != length:
        raise archive.damaged("it ends inside its pickle")
    pickle = _Pickle(data, size, archive)
    pickle.walk()
    stored = archive.storages(pickle.storages)
    budget = EXTRA_MEMORY + size - 2 * length - stored  # torch holds the pickle twice (its bytes, a copy to read)
    if pickle.cost > budget:
        raise archive.refuse(
            f"its pickle makes objects of about {pickle.cost >> 20} MiB and {stored >> 20} MiB of storages: a load "
            f"would hold more than the file's size plus {EXTRA_MEMORY >> 20} MiB (hyperrng._untrusted.EXTRA_MEMORY)"
        )
    file.seek(0)


class _Archive:
    """The zip's central directory, checked entry by entry as miniz (torch's zip reader) reads it."""

    def __init__(self, file: IO[bytes], size: int, path: str) -> None:
        self.file, self.size, self.path = file, size, path
        file.seek(0)
        if size < _EOCD.size + _LOCAL.size or file.read(4) != b"PK\x03\x04":
            raise self.damaged(
                "it is not a zip file, the format torch.save writes (older torch files are read by a loader "
                "that allocates what the file declares)"
            )
        file.seek(size - _EOCD.size)
        sig, disk, cd_disk, on_disk, count, cd_size, cd_offset, comment = _EOCD.unpack(file.read(_EOCD.size))
        if sig != _EOCD_SIG or comment:
            raise self.damaged("its zip directory does not end the file (torch.save writes no comment after it)")
        end = size - _EOCD.size  # where the central directory must end
        found = self._zip64(end)
        if found is not None:
            end = found[-1]
            given = (disk, cd_disk, on_disk, count, cd_size, cd_offset)
            sentinels = (_U16, _U16, _U16, _U16, _U32, _U32)
            if any(g != s and g != f for g, s, f in zip(given, sentinels, found[:-1])):
                raise self.damaged("its zip64 directory record contradicts the plain one")
            disk, cd_disk, on_disk, count, cd_size, cd_offset = found[:-1]
        if disk or cd_disk or on_disk != count:
            raise self.damaged("it is a zip split over several disks")
        if count == 0 or cd_size < count * _ENTRY.size or cd_offset + cd_size > end:
            raise self.damaged(f"its zip directory ({count} entries, {cd_size} bytes at {cd_offset}) does not fit it")
        self.count, self.cd_offset, self.cd_size = count, cd_offset, cd_size
        self.pickle = self._walk()

    def refuse(self, detail: str) -> InvalidArgumentError:
        """A file beyond what the load reads safely (see the module's docstring)."""
        return InvalidArgumentError(
            f"refused the RNG state at {self.path!r} before loading it: {detail}. torch.save never writes such a file "
            "for an RNG state; a checkpoint you trust can be read with torch.load(path, weights_only=True) and its "
            "state passed to hyperrng.load_rng_state_dict."
        )

    def damaged(self, detail: str) -> InvalidArgumentError:
        """A file that is not whole or not a torch file."""
        return InvalidArgumentError(
            f"could not read the RNG state at {self.path!r} ({detail}); the file is truncated or not written by "
            "save_rng_state."
        )

    def _zip64(self, eocd: int) -> tuple[int, ...] | None:
        """The zip64 record's (disk, directory disk, entries on disk, entries, directory size and
        offset, its own offset), where a locator precedes the directory's end as miniz looks for it."""
        if eocd < _ZIP64_LOCATOR.size + _ZIP64_EOCD.size:
            return None
        self.file.seek(eocd - _ZIP64_LOCATOR.size)
        sig, _, offset, disks = _ZIP64_LOCATOR.unpack(self.file.read(_ZIP64_LOCATOR.size))
        if sig != _ZIP64_LOCATOR_SIG:
            return None
        if disks != 1 or offset + _ZIP64_EOCD.size > eocd - _ZIP64_LOCATOR.size:
            raise self.damaged("its zip64 directory locator points outside it")
        self.file.seek(offset)
        sig, length, _, _, disk, cd_disk, on_disk, count, cd_size, cd_offset = _ZIP64_EOCD.unpack(
            self.file.read(_ZIP64_EOCD.size)
        )
        if sig != _ZIP64_EOCD_SIG or length < _ZIP64_EOCD.size - 12 or count > _U32 or cd_size > _U32:
            raise self.damaged("its zip64 directory record is malformed")
        return disk, cd_disk, on_disk, count, cd_size, cd_offset, offset

    def _entries(self) -> Any:
        """Each entry of the central directory: (name, method, flags, compressed and plain sizes,
        local header offset), read in pieces so that memory stays small whatever the count."""
        file, position, remaining = self.file, self.cd_offset, self.cd_size
        buffer, at = b"", 0

        def have(n: int) -> bytes:
            nonlocal buffer, at, position, remaining
            if len(buffer) - at < n:
                file.seek(position)  # the local headers are read in between
                more = file.read(min(max(_CHUNK, n), remaining))
                position, remaining = position + len(more), remaining - len(more)
                buffer, at = buffer[at:] + more, 0
                if len(buffer) < n:
                    raise self.damaged("its zip directory ends inside an entry")
            return buffer

        for _ in range(self.count):
            fields = _ENTRY.unpack_from(have(_ENTRY.size), at)
            sig, _, _, flags, method, _, _, _, packed, plain, name_len, extra_len, note_len, disk, _, _, local = fields
            if sig != _ENTRY_SIG or disk:
                raise self.damaged("its zip directory holds a malformed entry")
            whole = _ENTRY.size + name_len + extra_len + note_len
            raw = have(whole)
            name = raw[at + _ENTRY.size : at + _ENTRY.size + name_len]
            if _U32 in (packed, plain, local):
                extra = raw[at + _ENTRY.size + name_len : at + _ENTRY.size + name_len + extra_len]
                plain, packed, local = self._zip64_sizes(extra, plain, packed, local)
            at += whole
            yield name, method, flags, packed, plain, local

    def _zip64_sizes(self, extra: bytes, plain: int, packed: int, local: int) -> tuple[int, int, int]:
        at = 0
        while at + 4 <= len(extra):
            kind, length = struct.unpack_from("<HH", extra, at)
            if kind == 1:
                values = list(struct.unpack_from(f"<{length // 8}Q", extra, at + 4))
                out = []
                for value in (plain, packed, local):
                    if value == _U32:
                        if not values:
                            break
                        value = values.pop(0)
                    out.append(value)
                else:
                    return out[0], out[1], out[2]
            at += 4 + length
        raise self.damaged("a zip64 entry lacks its sizes")

    def _walk(self) -> tuple[int, int]:
        """Check every entry; return the offset and size of the pickle torch reads."""
        starts = np.empty(self.count, dtype=np.uint64)
        ends = np.empty(self.count, dtype=np.uint64)
        pickle: tuple[int, int] | None = None
        header = self.file
        for index, (name, method, flags, packed, plain, local) in enumerate(self._entries()):
            if index == 0:  # torch reads every record under the first entry's folder
                slash = name.find(b"/")
                if slash <= 0:
                    raise self.damaged("its first entry is not inside a folder, as torch.save writes it")
                self.folder = name[: slash + 1].lower()
            if method != 0 or flags & 1:
                raise self.refuse(
                    f"entry {_shown(name)} is compressed or encrypted (torch.save stores every entry as it is, so a "
                    "small file cannot inflate into a large load)"
                )
            if packed != plain:
                raise self.damaged(f"entry {_shown(name)} declares {plain} bytes but stores {packed}")
            header.seek(local)
            raw = header.read(_LOCAL.size)
            if len(raw) != _LOCAL.size or _LOCAL.unpack(raw)[0] != _LOCAL_SIG:
                raise self.damaged(f"entry {_shown(name)} points at no local header")
            *_, name_len, extra_len = _LOCAL.unpack(raw)
            end = local + _LOCAL.size + name_len + extra_len + packed
            if end > self.cd_offset:
                raise self.damaged(f"entry {_shown(name)} ({packed} bytes) runs past the data into the zip directory")
            starts[index], ends[index] = local, end
            if name.lower() == self.folder + _PICKLE:
                if pickle is not None:
                    raise self.refuse(f"it holds two entries named {_shown(name)}")
                pickle = (end - packed, packed)
        starts.sort()
        ends.sort()
        if self.count > 1 and bool((starts[1:] < ends[:-1]).any()):  # disjoint iff they alternate
            raise self.refuse("two of its entries share bytes (a small file could then load as a large one)")
        if pickle is None:
            raise self.damaged(f"it holds no {_PICKLE.decode()}, so torch.save did not write it")
        return pickle

    def storages(self, wanted: dict[str, int]) -> int:
        """Check that every storage the pickle refers to (key: its byte count) is an entry of that
        size; return their bytes in all."""
        names = {(self.folder + b"data/" + key.encode("utf-8", "surrogatepass")).lower(): key for key in wanted}
        found: set[str] = set()
        for name, _, _, _, plain, _ in self._entries():
            key = names.get(name.lower())
            if key is None:
                continue
            if key in found:
                raise self.refuse(f"it holds two entries named {_shown(name)}")
            found.add(key)
            if plain != wanted[key]:
                raise self.damaged(f"storage {key!r} is declared as {wanted[key]} bytes but its entry holds {plain}")
        missing = sorted(set(wanted) - found)
        if missing:
            raise self.damaged(f"its pickle refers to storage(s) {missing[:5]} that it does not hold")
        return sum(wanted.values())


def _shown(name: bytes) -> str:
    return repr(name.decode("utf-8", "replace")[:80])


# -- the pickle ------------------------------------------------------------------------------------


class _Global:
    """A global the pickle names: its name, and what calling it may do (its kind)."""

    __slots__ = ("kind", "name")

    def __init__(self, name: str, kind: str) -> None:
        self.name, self.kind = name, kind


class _Box:
    """A list, dict or set the pickle makes, with the number of items put into it."""

    __slots__ = ("items", "kind")

    def __init__(self, kind: str) -> None:
        self.kind, self.items = kind, 0


class _Text:
    """A string longer than the scan keeps, by its length."""

    __slots__ = ("length",)

    def __init__(self, length: int) -> None:
        self.length = length


_TENSOR = object()  # what a tensor rebuild or a storage reference makes
_OTHER = object()  # another object whose value the scan does not need
_SHORT = 64  # strings up to this many bytes are kept as themselves (keys, locations, encodings)

# Approximate sizes, in bytes, of what the loader makes (CPython on 64 bits; a tensor with its
# storage wrapper). Overestimates, so that a file's estimate covers its load.
_SLOT = 8
_INT, _FLOAT, _STR = 32, 24, 80
_LIST, _DICT, _SET, _TUPLE = 56, 64, 216, 40
_DICT_ITEM, _ODICT_ITEM, _SET_ITEM = 104, 200, 80
_MEMO = 96
_TENSOR_COST, _STORAGE_COST, _TRUSTED_COST = 384, 384, 4096

_TENSOR_REBUILDS = ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
                    "_rebuild_parameter_with_state", "_rebuild_meta_tensor_no_storage")  # fmt: skip
_KINDS: dict[str, str] = {
    **{f"torch._utils.{name}": "tensor" for name in _TENSOR_REBUILDS},
    "torch._tensor._rebuild_from_type_v2": "from_type",
    "torch.nn.parameter.Parameter": "parameter",
    "torch.Tensor": "tensor_type",
    "collections.OrderedDict": "odict",
    "collections.Counter": "counter",
    "torch.Size": "size",
    "torch.device": "device",
    "torch.serialization._get_layout": "layout",
    "_codecs.encode": "encode",
    "builtins.bytearray": "bytearray",
    "builtins.set": "set",
    "builtins.complex": "complex",
}
_LATIN1 = {"latin1", "latin-1"}
_NEW_KINDS = {"parameter", "odict", "counter", "set", "trusted"}  # what NEWOBJ may create


def _kinds() -> dict[str, str]:
    """Every global a scanned pickle may name, by kind: ours, torch's dtypes and storage types, and
    those other packages registered with ``torch.serialization.add_safe_globals`` (trusted)."""
    kinds = dict(_KINDS)
    for dtype in vars(torch).values():
        if isinstance(dtype, torch.dtype):
            kinds[str(dtype)] = "dtype"
    for cls in torch._storage_classes:
        if cls is not torch.storage.TypedStorage:
            kinds[f"{cls.__module__}.{cls.__name__}"] = "storage"
    get: Callable[[], list[Any]] = getattr(torch.serialization, "get_safe_globals", list)
    for entry in get():
        name = entry[1] if isinstance(entry, tuple) else f"{entry.__module__}.{entry.__qualname__}"
        if isinstance(name, str) and not name.startswith("torch."):
            kinds.setdefault(name, "trusted")
    return kinds


def _torch_allows(name: str) -> bool:
    """Whether torch's ``weights_only`` loader accepts the global ``name`` (where its private list
    cannot be read, assumed so: the scan then refuses the global itself)."""
    try:
        from torch._weights_only_unpickler import _get_allowed_globals, _get_user_allowed_globals

        return name in _get_allowed_globals() or name in _get_user_allowed_globals()
    except Exception:  # another torch's internals
        return True


def _itemsize(name: str) -> int:
    short = name.rsplit(".", 1)[-1]
    if short == "UntypedStorage":
        return 1
    return torch._utils._element_size(torch.serialization.StorageType(short).dtype)


class _Pickle:
    """One walk of a pickle as torch's ``weights_only`` unpickler would run it, building markers in
    place of objects: what each instruction makes is estimated (:attr:`cost`), what each call does
    is checked, and the storages referred to are collected (:attr:`storages`, key: bytes)."""

    def __init__(self, data: bytes, file_size: int, archive: _Archive) -> None:
        self.data, self.archive = data, archive
        self.limit = FREE_INSTRUCTIONS + file_size // BYTES_PER_INSTRUCTION
        self.budget = EXTRA_MEMORY + file_size - 2 * len(data)  # the storages' share is taken off later
        self.cost = 0
        self.storages: dict[str, int] = {}

    def fail(self, detail: str) -> InvalidArgumentError:
        return self.archive.refuse(f"its pickle {detail}")

    def damaged(self, detail: str) -> InvalidArgumentError:
        return self.archive.damaged(f"its pickle {detail}")

    def walk(self) -> None:  # noqa: C901 - one loop over the instructions, as the unpickler's
        data, n = self.data, len(self.data)
        kinds = _kinds()
        from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING

        stack: list[Any] = []
        metastack: list[list[Any]] = []
        memo: dict[int, Any] = {}
        globals_seen: dict[bytes, _Global] = {}
        unpack_from, _getsizeof = struct.unpack_from, sys.getsizeof
        cost, limit, budget, count, i = 0, self.limit, self.budget, 0, 0
        try:
            while True:
                if i >= n:
                    raise self.damaged("ends before its STOP instruction")
                op = data[i]
                i += 1
                count += 1
                if count > limit:
                    raise self.fail(
                        f"holds more than {limit} instructions: {FREE_INSTRUCTIONS} plus one per "
                        f"{BYTES_PER_INSTRUCTION} bytes of the file (hyperrng._untrusted.FREE_INSTRUCTIONS, "
                        "BYTES_PER_INSTRUCTION), which bounds the time torch's loader takes"
                    )
                if cost > budget:
                    raise self.fail(
                        f"makes objects of more than {budget >> 20} MiB: the file's size plus "
                        f"{EXTRA_MEMORY >> 20} MiB (hyperrng._untrusted.EXTRA_MEMORY)"
                    )
                if op == 0x71:  # BINPUT
                    memo[data[i]] = stack[-1]
                    i += 1
                    cost += _MEMO
                elif op == 0x68:  # BINGET
                    stack.append(memo[data[i]])
                    i += 1
                    cost += _SLOT
                elif op == 0x58:  # BINUNICODE
                    (length,) = unpack_from("<I", data, i)
                    i += 4
                    raw = data[i : i + length] if length <= _SHORT else None
                    if i + length > n:
                        raise self.damaged("ends inside a string")
                    if raw is not None:
                        text = str(raw, "utf-8", "surrogatepass")
                        stack.append(text)
                        cost += _getsizeof(text)
                    else:
                        ascii_only = data[i : i + length].isascii()
                        stack.append(_Text(length))
                        cost += _STR + (length if ascii_only else 4 * length)
                    i += length
                elif op == 0x28:  # MARK
                    metastack.append(stack)
                    stack = []
                    cost += _LIST
                elif op == 0x4B:  # BININT1: below 256, one of CPython's cached ints
                    stack.append(data[i])
                    i += 1
                    cost += _SLOT
                elif op == 0x74:  # TUPLE
                    items = stack
                    stack = metastack.pop()
                    stack.append(tuple(items))
                    cost += _TUPLE + _SLOT * len(items)
                elif op in (0x85, 0x86, 0x87):  # TUPLE1, TUPLE2, TUPLE3
                    k = op - 0x84
                    if len(stack) < k:
                        raise self.damaged("builds a tuple from an empty stack")
                    stack[-k:] = [tuple(stack[-k:])]
                    cost += _TUPLE + _SLOT * k
                elif op == 0x7D:  # EMPTY_DICT
                    stack.append(_Box("dict"))
                    cost += _DICT
                elif op == 0x5D:  # EMPTY_LIST
                    stack.append(_Box("list"))
                    cost += _LIST
                elif op == 0x75 or op == 0x73:  # SETITEMS, SETITEM
                    if op == 0x75:
                        items = stack
                        stack = metastack.pop()
                        pairs = len(items) // 2
                    else:
                        if len(stack) < 3:
                            raise self.damaged("sets an item without a dict and its key and value")
                        del stack[-2:]
                        pairs = 1
                    target = stack[-1]
                    per = _DICT_ITEM
                    if isinstance(target, _Box):
                        target.items += pairs
                        per = _ODICT_ITEM if target.kind in ("odict", "counter") else _DICT_ITEM
                    cost += per * pairs
                elif op == 0x65 or op == 0x61:  # APPENDS, APPEND
                    if op == 0x65:
                        items = stack
                        stack = metastack.pop()
                        added = len(items)
                    else:
                        if len(stack) < 2:
                            raise self.damaged("appends without a list and an item")
                        stack.pop()
                        added = 1
                    target = stack[-1]
                    if isinstance(target, _Box):
                        target.items += added
                    cost += (_SLOT + 1) * added
                elif op == 0x52:  # REDUCE
                    args = stack.pop()
                    stack[-1], made = self._call(stack[-1], args)
                    cost += made
                elif op == 0x81:  # NEWOBJ
                    args = stack.pop()
                    cls = stack.pop()
                    if not isinstance(cls, _Global) or cls.kind not in _NEW_KINDS:
                        raise self.fail(f"creates an object of {_named(cls)} directly, which torch.save never writes")
                    value, made = self._call(cls, args)
                    stack.append(value)
                    cost += made
                elif op == 0x62:  # BUILD
                    stack.pop()
                    if not stack:
                        raise self.damaged("builds from an empty stack")
                elif op == 0x51:  # BINPERSID
                    stack[-1] = self._storage(stack[-1])
                    cost += _STORAGE_COST
                elif op == 0x63:  # GLOBAL: a module and a name, each ending a line
                    start, end = i, data.find(b"\n", i)
                    last = data.find(b"\n", end + 1) if end >= 0 else -1
                    if last < 0:
                        raise self.damaged("ends inside a GLOBAL instruction")
                    i = last + 1
                    found = globals_seen.get(data[start:last])
                    if found is None:
                        module, name = data[start:end].decode("utf-8"), data[end + 1 : last].decode("utf-8")
                        if (module, name) in NAME_MAPPING:
                            module, name = NAME_MAPPING[(module, name)]
                        elif module in IMPORT_MAPPING:
                            module = IMPORT_MAPPING[module]
                        full = f"{module}.{name}"
                        kind = kinds.get(full)
                        if kind is None and not _torch_allows(full):
                            break  # torch's loader refuses it here, having made only what was counted so far
                        if kind is None:
                            raise self.fail(
                                f"names {full}, which a checkpoint of tensors, numbers, strings, lists and dicts does "
                                "not need (quantized, sparse and nested tensors are among what is refused)"
                            )
                        found = globals_seen[data[start:last]] = _Global(full, kind)
                    stack.append(found)
                    cost += _SLOT
                elif op == 0x4A:  # BININT
                    stack.append(unpack_from("<i", data, i)[0])
                    i += 4
                    cost += _INT
                elif op == 0x4D:  # BININT2
                    stack.append(unpack_from("<H", data, i)[0])
                    i += 2
                    cost += _INT
                elif op == 0x47:  # BINFLOAT
                    i += 8
                    stack.append(_OTHER)
                    cost += _FLOAT
                elif op == 0x8A:  # LONG1
                    length = data[i]
                    stack.append(int.from_bytes(data[i + 1 : i + 1 + length], "little", signed=True))
                    i += 1 + length
                    cost += _INT + length
                elif op == 0x55:  # SHORT_BINSTRING
                    length = data[i]
                    raw = data[i + 1 : i + 1 + length]
                    i += 1 + length
                    stack.append(raw.decode("utf-8", "replace"))
                    cost += _STR + 4 * length
                elif op == 0x72:  # LONG_BINPUT
                    memo[unpack_from("<I", data, i)[0]] = stack[-1]
                    i += 4
                    cost += _MEMO
                elif op == 0x6A:  # LONG_BINGET
                    stack.append(memo[unpack_from("<I", data, i)[0]])
                    i += 4
                    cost += _SLOT
                elif op == 0x4E or op == 0x89 or op == 0x88:  # NONE, NEWFALSE, NEWTRUE
                    stack.append(None if op == 0x4E else op == 0x88)
                    cost += _SLOT
                elif op == 0x29:  # EMPTY_TUPLE
                    stack.append(())
                    cost += _SLOT
                elif op == 0x8F:  # EMPTY_SET
                    stack.append(_Box("set"))
                    cost += _SET
                elif op == 0x80:  # PROTO
                    i += 1
                elif op == 0x2E:  # STOP
                    break
                else:
                    raise self.fail(f"holds the instruction {bytes([op])!r}, which torch's weights_only loader refuses")
        except (IndexError, KeyError, struct.error, UnicodeDecodeError):
            raise self.damaged(f"is malformed at byte {i} (an instruction without its argument or stack)") from None
        if cost > budget:
            raise self.fail(f"makes objects of more than {budget >> 20} MiB")
        self.cost = cost

    def _call(self, func: Any, args: Any) -> tuple[Any, int]:
        """What calling ``func`` with ``args`` makes, and its estimated size; refused unless it is a
        call ``torch.save`` writes."""
        if not isinstance(func, _Global):
            raise self.fail(f"calls {_named(func)}, which is not a global")
        if not isinstance(args, tuple):
            raise self.fail(f"calls {func.name} with arguments that are not a tuple")
        kind = func.kind
        if kind in ("tensor", "parameter"):
            return _TENSOR, _TENSOR_COST
        if kind == "from_type":  # _rebuild_from_type_v2(func, type, args, state) calls func(*args)
            if len(args) != 4 or not isinstance(args[0], _Global) or args[0].kind != "tensor":
                raise self.fail("rebuilds a tensor subclass with a function other than a tensor rebuild")
            if not isinstance(args[1], _Global) or args[1].kind not in ("tensor_type", "parameter", "trusted"):
                raise self.fail(f"rebuilds a tensor as {_named(args[1])}, which is not a tensor type")
            return _TENSOR, _TENSOR_COST
        if kind in ("odict", "counter", "set"):
            items = sum(_length(a) for a in args)
            per = _SET_ITEM if kind == "set" else _ODICT_ITEM
            box = _Box(kind)
            box.items = items
            return box, _DICT + per * items + (_STR * items if any(isinstance(a, (str, _Text)) for a in args) else 0)
        if kind == "size":
            return _OTHER, _TUPLE + (_SLOT + _INT) * sum(_length(a) for a in args)
        if kind in ("device", "layout", "complex"):
            if any(isinstance(a, (_Text, _Box, tuple)) for a in args):
                raise self.fail(f"calls {func.name} with an argument torch.save never gives it")
            return _OTHER, _DICT
        if kind == "encode":
            if len(args) != 2 or args[1] not in _LATIN1 or not isinstance(args[0], (str, _Text)):
                raise self.fail("encodes text other than as torch.save does (latin1)")
            return _Text(_length(args[0])), _STR + _length(args[0])
        if kind == "bytearray":
            if args and not (
                (len(args) == 2 and args[1] in _LATIN1 and isinstance(args[0], (str, _Text)))
                or (len(args) == 1 and isinstance(args[0], _Text))
            ):
                raise self.fail("makes a bytearray other than from its bytes, as torch.save writes it")
            return _OTHER, _STR + (_length(args[0]) if args else 0)
        if kind == "trusted":
            return _OTHER, _TRUSTED_COST
        raise self.fail(
            f"calls {func.name}, which a checkpoint of dense tensors does not need and which can make more than the "
            "file holds (a tensor of a size it names, a copy of a view)"
        )

    def _storage(self, pid: Any) -> object:
        """Record a storage reference ``('storage', type, key, location, numel)``."""
        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _Global)
            and pid[1].kind == "storage"
            and isinstance(pid[2], str)
            and isinstance(pid[3], str)
            and type(pid[4]) is int
            and pid[4] >= 0
        ):
            raise self.fail("refers to a storage in a form torch.save never writes")
        nbytes = pid[4] * _itemsize(pid[1].name)
        if self.storages.setdefault(pid[2], nbytes) != nbytes:
            raise self.fail(f"declares storage {pid[2]!r} with two sizes")
        return _TENSOR


def _length(value: Any) -> int:
    """Items (or characters) of an argument, as far as the scan knows them."""
    if isinstance(value, _Box):
        return value.items
    if isinstance(value, _Text):
        return value.length
    if isinstance(value, (str, tuple)):
        return len(value)
    if type(value) is int:
        return max(value, 0)
    return 1


def _named(value: object) -> str:
    return value.name if isinstance(value, _Global) else f"a {type(value).__name__.strip('_').lower()}"
