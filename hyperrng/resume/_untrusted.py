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
  file, a tensor rebuilt over a storage an earlier one used counted as
  :data:`TENSOR_INSTRUCTIONS` more; only the globals a checkpoint of tensors, numbers, strings,
  lists and dicts needs (and those registered with ``torch.serialization.add_safe_globals`` by
  other packages than torch), called only in the ways ``torch.save`` writes them, each argument
  of the kind it writes there (``set(list)``, ``Counter(dict)``, ``OrderedDict()``,
  ``torch.Size(ints)``, a tensor rebuild's storage, sizes and dict of flags, an object's state as
  a dict or a pair of dicts): the loader iterates, hashes, copies or prints what these calls are
  given, and a tensor iterated makes an object per element it declares (a view of one stored
  byte declares any number), a tuple hashed or printed visits every item it reaches (64 levels
  of a tuple holding its inner one twice is a kilobyte); dict keys and set items only strings,
  ints below 2**61 - 1 in size, floats, bools and None (a tuple key is refused: its hash is
  computed anew at each use, and tuples or large ints can be made to share one hash, which makes
  a dict quadratic to build; at most a few hundred floats share one); every storage it refers to
  present with the size it declares; and the objects it makes, estimated from their sizes in
  CPython (a tensor's sizes and strides, and each copy of a dict an object takes as its state,
  included), within :data:`EXTRA_MEMORY` plus the file's size less the storages and twice the
  pickle (torch holds its bytes and a copy). The walk itself compares no value of the file but
  strings and ints, and hashes none but those and the bytes naming a global. What a global registered by another
  package does with its arguments, or with a state its own ``__setstate__`` takes, is that
  package's: the walk counts a fixed size for it.

A file refused here raises :class:`~hyperrng.errors.InvalidArgumentError` naming the limit,
before torch has read anything of it. Where the pickle names a global that torch's loader
refuses, the walk stops there and leaves the refusal to torch, which makes nothing beyond what
was counted. A checkpoint that legitimately exceeds a limit (more than about 7,000 tensors in
one file, whose objects take some 2 KB each; quantized or sparse tensors; tuple dict keys) can
still be read with ``torch.load(path, weights_only=True)`` directly and its state passed to
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

__all__ = ["BYTES_PER_INSTRUCTION", "EXTRA_MEMORY", "FREE_INSTRUCTIONS", "TENSOR_INSTRUCTIONS", "check_file"]

EXTRA_MEMORY = 16 << 20
"""Bytes (16 MiB) a load may hold beyond the file's size: the objects of its pickle (estimated
from their sizes in CPython, a little above what they take) may fill this much plus the file's
size less the storages it refers to and twice the pickle (torch holds its bytes and a copy)."""

FREE_INSTRUCTIONS = 1 << 13
"""Pickle instructions any file may hold beyond those its size pays for: an RNG state with
:data:`hyperrng.seeding.layout.MAX_STREAMS` streams each over :data:`hyperrng.seeding.layout.MAX_DIMS`
dimensions holds about 52,500, and its file (350 to 375 KB with a counter-based device's
16-byte states, the smallest) pays for all but about 2,300 of them."""

TENSOR_INSTRUCTIONS = 12
"""Instructions a tensor rebuilt over a storage that an earlier one used (or over none: a meta
tensor) counts as, beyond its own: torch takes 20 to 40 microseconds to rebuild a tensor (a plain
instruction takes it one to four), and a pickle that gives one memoized tuple of arguments to each
rebuild makes a tensor every three instructions. The first tensor over each storage is not
counted: the storage's entry in the zip (over 100 bytes) pays for it, as in what torch.save
writes, one storage for each tensor that is not a view."""

BYTES_PER_INSTRUCTION = 7
"""Bytes of file that pay for one pickle instruction beyond :data:`FREE_INSTRUCTIONS`:
``torch.save`` writes about one per 10 bytes for a dict of tiny tensors (each stored in an
entry of its own), one per 7 for the largest documented RNG state, far fewer for larger
tensors. torch's loader takes one to four microseconds of processor time per instruction (a
tensor 20 to 40, see :data:`TENSOR_INSTRUCTIONS`; a storage's entry about 50) and this walk
about one, so a file is read or refused in under half a second of processor time per megabyte
(0.2 to 0.45 s for the costliest files built to test this: a tiny tensor over a storage of its
own every 140 bytes, a tensor every three instructions, a tuple nested 150,000 deep), plus a
few hundredths of a second for the free instructions."""

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
            f"its pickle makes objects of about {_mib(pickle.cost)} and refers to {_mib(stored)} of storages: with "
            f"the pickle's {_mib(length)}, which torch holds twice, a load would hold more than the file's size plus "
            f"{_mib(EXTRA_MEMORY)} (hyperrng.resume._untrusted.EXTRA_MEMORY)"
        )
    file.seek(0)


def unreadable(path: str, detail: str) -> InvalidArgumentError:
    """The refusal of a checkpoint file that is not whole or not a torch file (``detail``: what is wrong)."""
    return InvalidArgumentError(
        f"could not read the RNG state at {path!r} ({detail}); the file is truncated or not written by save_rng_state."
    )


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
            f"refused the RNG state at {self.path!r} before loading it: {detail}. load_rng_state reads only files "
            "whose load it can bound by their size (its documentation lists the limits), whoever wrote them; a "
            "checkpoint you trust can be read with torch.load(path, weights_only=True) and its state passed to "
            "hyperrng.load_rng_state_dict."
        )

    def damaged(self, detail: str) -> InvalidArgumentError:
        """A file that is not whole or not a torch file."""
        return unreadable(self.path, detail)

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
            if at + 4 + length > len(extra):  # a field claiming more than the entry holds
                break
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
    """A global the pickle names: its name, what calling it may do (its kind), and for a class
    registered by another package, whether it takes the state ``BUILD`` gives it in code of its
    own (``__setstate__``) rather than torch's."""

    __slots__ = ("kind", "name", "own_state")

    def __init__(self, name: str, kind: str, own_state: bool = True) -> None:
        self.name, self.kind, self.own_state = name, kind, own_state


class _Box:
    """A list, dict or set the pickle makes, with the number of items put into it; for a list, what
    the first of them that does not hash in bounded time is (:func:`_hashes_fast`; ``set(list)``
    hashes them), or ``None``; for a dict, whether each item set maps a string to a bool, as a
    tensor's metadata does (torch's refusal of other metadata prints it whole)."""

    __slots__ = ("flags", "items", "kind", "slow")

    def __init__(self, kind: str) -> None:
        self.kind, self.items, self.flags = kind, 0, True
        self.slow: str | None = None


class _Text:
    """A string longer than the scan keeps, by its length."""

    __slots__ = ("length",)

    def __init__(self, length: int) -> None:
        self.length = length


class _Bytes(_Text):
    """A ``bytes`` object (``_codecs.encode``'s), by its length."""

    __slots__ = ()


class _Made:
    """An object a registered global's call made: :attr:`_Global.own_state` of that global."""

    __slots__ = ("own_state",)

    def __init__(self, own_state: bool) -> None:
        self.own_state = own_state


_TENSOR = object()  # what a tensor rebuild makes


class _StorageRef:
    """What a storage reference makes: the storage's key."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key


_A_FLOAT = object()  # a float
_OTHER = object()  # another object whose value the scan does not need
_HASH_MODULUS = sys.hash_info.modulus  # 2**61 - 1: ints hash to themselves modulo it
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
_MAPPINGS = ("dict", "odict", "counter")

# The arguments of each tensor rebuild, as torch.save writes them, and how many are required:
# S a storage, t a tensor, i an int, T a tuple of ints (sizes, strides), b a bool, d a dtype, H
# the hooks (an OrderedDict, a dict or None), M the metadata (None or a dict of strings to bools),
# s an object's state (see _Pickle._state).
_REBUILDS = {
    "torch._utils._rebuild_tensor": ("SiTT", 4),
    "torch._utils._rebuild_tensor_v2": ("SiTTbHM", 6),
    "torch._utils._rebuild_tensor_v3": ("SiTTbHdM", 7),
    "torch._utils._rebuild_parameter": ("tbH", 3),
    "torch._utils._rebuild_parameter_with_state": ("tbHs", 4),
    "torch._utils._rebuild_meta_tensor_no_storage": ("dTTb", 4),
    "torch.nn.parameter.Parameter": ("tb", 0),
}


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


def _own_state(name: str) -> bool:
    """Whether what the registered global ``name`` makes takes a ``BUILD``'s state in code of its
    own (a class with ``__setstate__``, or a function, whose result's class the scan cannot know),
    rather than in torch's, which copies a dict (or a pair of them) into the object."""
    for entry in getattr(torch.serialization, "get_safe_globals", list)():
        obj = entry[0] if isinstance(entry, tuple) else entry
        if (entry[1] if isinstance(entry, tuple) else f"{obj.__module__}.{obj.__qualname__}") == name:
            own = getattr(obj, "__setstate__", None) if isinstance(obj, type) else _OTHER
            return own is not None and own is not torch.Tensor.__setstate__
    return True


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
        self.rebuilt: set[str] = set()  # the storages a tensor was rebuilt over
        self.work = 0  # the instructions the last call counts as, beyond its own

    def fail(self, detail: str) -> InvalidArgumentError:
        return self.archive.refuse(f"its pickle {detail}")

    def damaged(self, detail: str) -> InvalidArgumentError:
        return self.archive.damaged(f"its pickle {detail}")

    def over_budget(self) -> InvalidArgumentError:
        return self.fail(
            f"makes objects of more than {_mib(self.budget)}: {_mib(EXTRA_MEMORY)} "
            "(hyperrng.resume._untrusted.EXTRA_MEMORY) "
            "plus the file's size less twice its pickle's (torch holds the pickle's bytes and a copy of them)"
        )

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
                        f"holds more than {limit} instructions (each tensor counted as {TENSOR_INSTRUCTIONS} more): "
                        f"{FREE_INSTRUCTIONS} plus one per {BYTES_PER_INSTRUCTION} bytes of the file "
                        "(hyperrng.resume._untrusted.FREE_INSTRUCTIONS, BYTES_PER_INSTRUCTION, TENSOR_INSTRUCTIONS), "
                        "which "
                        "bounds the time torch's loader takes"
                    )
                if cost > budget:
                    raise self.over_budget()
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
                    else:
                        if len(stack) < 3:
                            raise self.damaged("sets an item without a dict and its key and value")
                        items = stack[-2:]
                        del stack[-2:]
                    target, keys = stack[-1], items[0::2]
                    if not isinstance(target, _Box) or target.kind not in _MAPPINGS:
                        raise self.fail(f"sets an item of {_named(target)}, which torch's loader refuses")
                    for key in keys:
                        if not _hashes_fast(key):
                            raise self.fail(_SLOW_HASH.format(what="a dict key", value=_named(key)))
                    if target.flags:
                        target.flags = all(type(key) is str for key in keys) and all(
                            type(value) is bool for value in items[1::2]
                        )
                    target.items += len(keys)
                    cost += (_DICT_ITEM if target.kind == "dict" else _ODICT_ITEM) * len(keys)
                elif op == 0x65 or op == 0x61:  # APPENDS, APPEND
                    if op == 0x65:
                        items = stack
                        stack = metastack.pop()
                        added = len(items)
                    else:
                        if len(stack) < 2:
                            raise self.damaged("appends without a list and an item")
                        items = [stack.pop()]
                        added = 1
                    target = stack[-1]
                    if not isinstance(target, _Box) or target.kind != "list":
                        raise self.fail(f"appends to {_named(target)}, which torch's loader refuses")
                    target.items += added
                    if target.slow is None:
                        target.slow = next((_named(item) for item in items if not _hashes_fast(item)), None)
                    cost += (_SLOT + 1) * added
                elif op == 0x52:  # REDUCE
                    args = stack.pop()
                    stack[-1], made = self._call(stack[-1], args)
                    cost += made
                    count, self.work = count + self.work, 0
                elif op == 0x81:  # NEWOBJ
                    args = stack.pop()
                    cls = stack.pop()
                    if not isinstance(cls, _Global) or cls.kind not in _NEW_KINDS:
                        raise self.fail(f"creates an object of {_named(cls)} directly, which torch.save never writes")
                    value, made = self._call(cls, args)
                    stack.append(value)
                    cost += made
                    count, self.work = count + self.work, 0
                elif op == 0x62:  # BUILD
                    state = stack.pop()
                    cost += self._build(stack[-1], state)
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
                        own = _own_state(full) if kind == "trusted" else False
                        found = globals_seen[data[start:last]] = _Global(full, kind, own)
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
                    stack.append(_A_FLOAT)
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
            raise self.over_budget()
        self.cost = cost

    def _call(self, func: Any, args: Any) -> tuple[Any, int]:  # noqa: C901 - one case per kind
        """What calling ``func`` with ``args`` makes, and its estimated size; refused unless it is a
        call ``torch.save`` writes, with arguments of the shapes it writes: the loader iterates,
        hashes, copies or prints what these calls are given, and an argument of another shape (a
        tensor, whose iteration makes an object per element it declares; a tuple, whose hash or
        text visits each item it reaches, again at each reference) costs what the file does not
        bound."""
        if not isinstance(func, _Global):
            raise self.fail(f"calls {_named(func)}, which is not a global")
        if type(args) is not tuple:
            raise self.fail(f"calls {func.name} with arguments that are not a tuple")
        kind, n = func.kind, len(args)
        if kind in ("tensor", "parameter"):
            return _TENSOR, self._rebuild(func, args)
        if kind == "from_type":  # _rebuild_from_type_v2(func, type, args, state) calls func(*args)
            if n != 4 or not isinstance(args[0], _Global) or args[0].kind != "tensor":
                raise self.fail("rebuilds a tensor subclass with a function other than a tensor rebuild")
            cls = args[1]
            if not isinstance(cls, _Global) or cls.kind not in ("tensor_type", "parameter", "trusted"):
                raise self.fail(f"rebuilds a tensor as {_named(cls)}, which is not a tensor type")
            if type(args[2]) is not tuple:
                raise self.fail(self._shape(args[0].name, args[2]))
            return _TENSOR, self._rebuild(args[0], args[2]) + self._state(args[3], cls.own_state)
        if kind == "odict" and n == 0:  # its items follow, set one by one
            return _Box(kind), _DICT
        if kind == "counter" and (n == 0 or (n == 1 and _is_box(args[0], _MAPPINGS))):  # Counter(dict)
            box = _Box(kind)
            box.items = args[0].items if n else 0
            return box, _DICT + _ODICT_ITEM * box.items
        if kind == "set" and (n == 0 or (n == 1 and _is_box(args[0], ("list",)))):  # set(list)
            if n and args[0].slow is not None:
                raise self.fail(_SLOW_HASH.format(what="a set item", value=args[0].slow))
            box = _Box(kind)
            box.items = args[0].items if n else 0
            return box, _SET + _SET_ITEM * box.items
        if kind == "size" and n == 1 and _ints(args[0]):  # torch.Size(tuple of ints)
            return _OTHER, _TUPLE + (_SLOT + _INT) * len(args[0])
        if kind == "device" and 1 <= n <= 2 and type(args[0]) is str and (n == 1 or type(args[1]) is int):
            return _OTHER, _DICT  # torch.device(type) or torch.device(type, index)
        if kind == "layout" and n == 1 and type(args[0]) is str:  # _get_layout(name)
            return _OTHER, _DICT
        if kind == "complex" and n <= 2 and all(a is _A_FLOAT or type(a) is int for a in args):
            return _OTHER, _DICT
        if kind == "encode":  # _codecs.encode(text, "latin1"): bytes
            if n != 2 or not _is_latin1(args[1]) or not (type(args[0]) is str or type(args[0]) is _Text):
                raise self.fail("encodes text other than as torch.save does (latin1)")
            return _Bytes(_length(args[0])), _STR + _length(args[0])
        if kind == "bytearray":  # bytearray(bytes), bytearray(text, "latin1") or bytearray()
            if not (
                n == 0
                or (n == 1 and type(args[0]) is _Bytes)
                or (n == 2 and _is_latin1(args[1]) and (type(args[0]) is str or type(args[0]) is _Text))
            ):
                raise self.fail("makes a bytearray other than from its bytes, as torch.save writes it")
            return _OTHER, _STR + (_length(args[0]) if args else 0)
        if kind == "trusted":
            return _Made(func.own_state), _TRUSTED_COST
        if kind in ("odict", "counter", "set", "size", "device", "layout", "complex"):
            raise self.fail(self._shape(func.name, args))
        raise self.fail(
            f"calls {func.name}, which a checkpoint of dense tensors does not need and which can make more than the "
            "file holds (a tensor of a size it names, a copy of a view)"
        )

    def _shape(self, name: str, args: Any) -> str:
        kinds = ", ".join(_named(a) for a in args[:8]) if type(args) is tuple else _named(args)
        return (
            f"calls {name} with ({kinds}), arguments of a shape torch.save never gives it (the loader would iterate, "
            "hash, copy or print them, in work the file's size does not bound)"
        )

    def _rebuild(self, func: _Global, args: tuple[Any, ...]) -> int:
        """The estimated size of the tensor ``func(*args)`` makes (its sizes and strides included),
        refused unless each argument is of the kind torch.save writes there (:data:`_REBUILDS`);
        :attr:`work` made :data:`TENSOR_INSTRUCTIONS` unless it is the first over its storage."""
        spec, required = _REBUILDS.get(func.name, ("", 0))
        if not spec or not required <= len(args) <= len(spec):
            raise self.fail(self._shape(func.name, args))
        cost, work = _TENSOR_COST, TENSOR_INSTRUCTIONS
        for code, arg in zip(spec, args):
            if code == "S":
                ok = type(arg) is _StorageRef
                if ok and arg.key not in self.rebuilt:
                    self.rebuilt.add(arg.key)  # its entry's bytes pay for it
                    work = 0
            elif code == "t":
                ok = arg is _TENSOR
            elif code == "i":
                ok = type(arg) is int
            elif code == "b":
                ok = type(arg) is bool
            elif code == "d":
                ok = isinstance(arg, _Global) and arg.kind == "dtype"
            elif code == "T":
                ok = _ints(arg)
                cost += 2 * _SLOT * len(arg) if ok else 0  # each dimension's size and stride, held by the tensor
            elif code == "H":
                ok = arg is None or _is_box(arg, ("odict", "dict"))
            elif code == "M":
                ok = arg is None or (_is_box(arg, ("dict",)) and arg.flags)
                cost += _DICT_ITEM * arg.items if ok and arg is not None else 0  # read into a map at each use
            else:  # "s"
                cost += self._state(arg, own=False)
                ok = True
            if not ok:
                raise self.fail(self._shape(func.name, args))
        self.work += work
        return cost

    def _state(self, state: Any, own: bool) -> int:
        """The estimated size of what an object's state adds to it: torch copies a dict, or a pair
        of (dict, slots' dict), into the object, and prints anything else in its refusal, so only
        those are accepted, unless ``own`` (a registered class's own ``__setstate__`` takes it)."""
        if own:
            return _TRUSTED_COST
        parts = state if type(state) is tuple and len(state) == 2 else (state,)
        if not all(part is None or _is_box(part, _MAPPINGS) for part in parts):
            raise self.fail(
                f"gives an object a state of {_named(state)}, which torch.save never writes (a dict, or a pair of "
                "dicts, copied into the object; torch's refusal of another would print it whole)"
            )
        return sum(_DICT_ITEM * part.items for part in parts if part is not None)

    def _build(self, target: Any, state: Any) -> int:
        """The estimated size of what ``BUILD`` adds to ``target``: an OrderedDict's attributes (a
        module's state dict has ``_metadata``), or the state of an object of a registered class."""
        if _is_box(target, ("odict",)):  # torch: target.__dict__.update(state)
            if not _is_box(state, _MAPPINGS):
                raise self.fail(f"builds an OrderedDict from {_named(state)}, which torch.save never writes")
            return _DICT_ITEM * state.items
        if isinstance(target, _Made):
            return self._state(state, target.own_state)
        raise self.fail(f"builds {_named(target)} from a state, which torch.save never writes")

    def _storage(self, pid: Any) -> object:
        """Record a storage reference ``('storage', type, key, location, numel)``."""
        if not (
            type(pid) is tuple
            and len(pid) == 5
            and type(pid[0]) is str
            and pid[0] == "storage"
            and isinstance(pid[1], _Global)
            and pid[1].kind == "storage"
            and type(pid[2]) is str
            and type(pid[3]) is str
            and type(pid[4]) is int
            and pid[4] >= 0
        ):
            raise self.fail("refers to a storage in a form torch.save never writes")
        nbytes = pid[4] * _itemsize(pid[1].name)
        if self.storages.setdefault(pid[2], nbytes) != nbytes:
            raise self.fail(f"declares storage {pid[2]!r} with two sizes")
        return _StorageRef(pid[2])


_SLOW_HASH = (
    "holds {what} that is {value}: only strings, ints below 2**61 - 1 in size, floats, bools and None are accepted "
    "(a tuple's hash visits every item it reaches, anew at each use, and ints or tuples can be made to share one "
    "hash, so that building the dict or set takes time quadratic in its size)"
)


def _hashes_fast(value: Any) -> bool:
    """Whether the loader hashes ``value`` in bounded time and few values share its hash: a string
    (hashed once, with a per-process key), an int that hashes to itself, a float (at most a few
    hundred share a hash), a bool or None. The check reads types only: it hashes nothing."""
    kind = type(value)
    return (
        kind is str
        or kind is _Text
        or value is _A_FLOAT
        or value is None
        or kind is bool
        or (kind is int and -_HASH_MODULUS < value < _HASH_MODULUS)
    )


def _is_box(value: Any, kinds: tuple[str, ...]) -> bool:
    return type(value) is _Box and value.kind in kinds


def _is_latin1(value: Any) -> bool:
    return type(value) is str and value in _LATIN1  # a string is hashed in its length, once


def _ints(value: Any) -> bool:
    """Whether ``value`` is a tuple of ints (a size or stride)."""
    return type(value) is tuple and all(type(item) is int for item in value)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _length(value: Any) -> int:
    """Characters of a string (or bytes of bytes), as far as the scan knows them."""
    if isinstance(value, _Text):
        return value.length
    return len(value) if type(value) is str else 0


def _named(value: object) -> str:
    """What ``value`` is, in a few words (never its text: a file's value may be of any size)."""
    if isinstance(value, _Global):
        return value.name
    if type(value) is _Box:
        return {"odict": "an OrderedDict", "counter": "a Counter"}.get(value.kind, f"a {value.kind}")
    if type(value) is int:
        return "an int" if -_HASH_MODULUS < value < _HASH_MODULUS else "an int of 2**61 - 1 or more in size"
    if type(value) is _StorageRef:
        return "a storage"
    for marker, name in ((_TENSOR, "a tensor"), (_A_FLOAT, "a float"), (None, "None")):
        if value is marker:
            return name
    names = {str: "a str", _Text: "a str", _Bytes: "a bytes", bool: "a bool", tuple: "a tuple"}
    return names.get(type(value), "an object")
