"""The walk of a checkpoint's pickle (``data.pkl``) that :func:`hyperrng.resume._untrusted.check_file`
runs before ``torch.load(weights_only=True)`` reads it: one pass over the instructions, building
markers in place of objects (:mod:`hyperrng.resume._pickle_values`), that refuses the pickle unless
the time and memory of its load are bounded by the file's size, within the limits defined here.
"""

from __future__ import annotations

import struct
import sys
from typing import Any

from hyperrng.errors import InvalidArgumentError
from hyperrng.resume._pickle_values import (
    _A_FLOAT,
    _DICT,
    _DICT_ITEM,
    _FLOAT,
    _INT,
    _LIST,
    _MAPPINGS,
    _MEMO,
    _NEW_KINDS,
    _ODICT_ITEM,
    _OTHER,
    _REBUILDS,
    _SET,
    _SET_ITEM,
    _SHORT,
    _SLOT,
    _STORAGE_COST,
    _STR,
    _TENSOR,
    _TENSOR_COST,
    _TRUSTED_COST,
    _TUPLE,
    _Box,
    _Bytes,
    _Global,
    _hashes_fast,
    _ints,
    _is_box,
    _is_latin1,
    _itemsize,
    _kinds,
    _length,
    _Made,
    _named,
    _own_state,
    _StorageRef,
    _Text,
    _torch_allows,
)

__all__ = ["BYTES_PER_INSTRUCTION", "EXTRA_MEMORY", "FREE_INSTRUCTIONS", "TENSOR_INSTRUCTIONS"]

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


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class _Pickle:
    """One walk of a pickle as torch's ``weights_only`` unpickler would run it, building markers in
    place of objects: what each instruction makes is estimated (:attr:`cost`), what each call does
    is checked, and the storages referred to are collected (:attr:`storages`, key: bytes).

    What it accepts (the walk checks it once, building nothing): at most :data:`FREE_INSTRUCTIONS`
    instructions plus one per :data:`BYTES_PER_INSTRUCTION` bytes of the file, a tensor rebuilt over
    a storage an earlier one used counted as :data:`TENSOR_INSTRUCTIONS` more; only the globals a
    checkpoint of tensors, numbers, strings, lists and dicts needs (and those registered with
    ``torch.serialization.add_safe_globals`` by other packages than torch), called only in the ways
    ``torch.save`` writes them, each argument of the kind it writes there (``set(list)``,
    ``Counter(dict)``, ``OrderedDict()``, ``torch.Size(ints)``, a tensor rebuild's storage, sizes
    and dict of flags, an object's state as a dict or a pair of dicts): the loader iterates, hashes,
    copies or prints what these calls are given, and a tensor iterated makes an object per element
    it declares (a view of one stored byte declares any number), a tuple hashed or printed visits
    every item it reaches (64 levels of a tuple holding its inner one twice is a kilobyte); dict
    keys and set items only strings, ints below 2**61 - 1 in size, floats, bools and None (a tuple
    key is refused: its hash is computed anew at each use, and tuples or large ints can be made to
    share one hash, which makes a dict quadratic to build; at most a few hundred floats share one);
    every storage it refers to present with the size it declares; and the objects it makes,
    estimated from their sizes in CPython (a tensor's sizes and strides, and each copy of a dict an
    object takes as its state, included), within :data:`EXTRA_MEMORY` plus the file's size less the
    storages and twice the pickle (torch holds its bytes and a copy). The walk itself compares no
    value of the file but strings and ints, and hashes none but those and the bytes naming a global.
    What a global registered by another package does with its arguments, or with a state its own
    ``__setstate__`` takes, is that package's: the walk counts a fixed size for it. Where the pickle
    names a global that torch's loader refuses, the walk stops there and leaves the refusal to
    torch, which makes nothing beyond what was counted.

    ``archive`` is the :class:`hyperrng.resume._untrusted._Archive` the pickle was read from: its
    refusals name the file.
    """

    def __init__(self, data: bytes, file_size: int, archive: Any) -> None:
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
            "(hyperrng.resume._pickle_check.EXTRA_MEMORY) "
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
                        "(hyperrng.resume._pickle_check.FREE_INSTRUCTIONS, BYTES_PER_INSTRUCTION, "
                        "TENSOR_INSTRUCTIONS), which "
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
