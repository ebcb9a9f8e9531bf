"""Checks of a checkpoint file before ``torch.load(weights_only=True)`` reads it.

That loader runs no code, but it does what the file declares: it inflates compressed entries,
reads the entries the zip's central directory points at (several may point at one region), and
follows the pickle's instructions, whose objects can take far more memory than their bytes
(``bytearray(2**31)`` is a few bytes) and whose count sets the time (the loader is written in
Python: microseconds per instruction). :func:`check_file` reads the file's structure first and
refuses it unless what the load will do is bounded by the file's own size: the container here
(:class:`_Archive`), the pickle in :mod:`hyperrng.resume._pickle_check`, whose limits
(``EXTRA_MEMORY``, ``FREE_INSTRUCTIONS``, ``BYTES_PER_INSTRUCTION``, ``TENSOR_INSTRUCTIONS``) are
defined and read there.
"""

from __future__ import annotations

import os
import struct
from typing import IO, Any

import numpy as np

import hyperrng.resume._pickle_check as _pickle_check
from hyperrng.errors import InvalidArgumentError
from hyperrng.resume._pickle_check import (
    BYTES_PER_INSTRUCTION,
    EXTRA_MEMORY,
    FREE_INSTRUCTIONS,
    TENSOR_INSTRUCTIONS,
    _mib,
    _Pickle,
)

__all__ = ["BYTES_PER_INSTRUCTION", "EXTRA_MEMORY", "FREE_INSTRUCTIONS", "TENSOR_INSTRUCTIONS", "check_file"]

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
    it in time and memory bounded by its size (the container: :class:`_Archive`; the pickle:
    :class:`hyperrng.resume._pickle_check._Pickle`); leave ``file`` at its start.

    A file refused here raises :class:`~hyperrng.errors.InvalidArgumentError` naming the limit,
    before torch has read anything of it. A checkpoint that legitimately exceeds a limit (more
    than about 7,000 tensors in one file, whose objects take some 2 KB each; quantized or sparse
    tensors; tuple dict keys) can still be read with ``torch.load(path, weights_only=True)``
    directly and its state passed to :func:`hyperrng.load_rng_state_dict`, whose own checks hold
    for any dict.

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
    # torch holds the pickle twice (its bytes, a copy to read). EXTRA_MEMORY is read where the walk
    # reads it, so that one value bounds both (tests patch it there).
    budget = _pickle_check.EXTRA_MEMORY + size - 2 * length - stored
    if pickle.cost > budget:
        raise archive.refuse(
            f"its pickle makes objects of about {_mib(pickle.cost)} and refers to {_mib(stored)} of storages: with "
            f"the pickle's {_mib(length)}, which torch holds twice, a load would hold more than the file's size plus "
            f"{_mib(_pickle_check.EXTRA_MEMORY)} (hyperrng.resume._pickle_check.EXTRA_MEMORY)"
        )
    file.seek(0)


def unreadable(path: str, detail: str) -> InvalidArgumentError:
    """The refusal of a checkpoint file that is not whole or not a torch file (``detail``: what is wrong)."""
    return InvalidArgumentError(
        f"could not read the RNG state at {path!r} ({detail}); the file is truncated or not written by save_rng_state."
    )


class _Archive:
    """The zip's central directory, checked entry by entry as miniz (torch's zip reader) reads it.

    The container is refused unless it is a zip of the kind ``torch.save`` writes (the only kind
    ``load_rng_state`` reads), every entry stored uncompressed, its declared sizes equal, its local
    header and data inside the file and before the central directory, no two entries' regions
    overlapping. So the entries hold at most the file's bytes in all.
    """

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
        """A file beyond what the load reads safely (see :func:`check_file`); ``detail`` is kept on it as
        ``refused``, for a save's own words."""
        error = InvalidArgumentError(
            f"refused the RNG state at {self.path!r} before loading it: {detail}. load_rng_state reads only files "
            "whose load it can bound by their size (its documentation lists the limits), whoever wrote them; a "
            "checkpoint you trust can be read with torch.load(path, weights_only=True) and its state passed to "
            "hyperrng.load_rng_state_dict."
        )
        error.refused = detail  # type: ignore[attr-defined]
        return error

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
