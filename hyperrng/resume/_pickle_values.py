"""What the pickle walk of :mod:`hyperrng.resume._pickle_check` builds in place of a pickle's objects,
and what it knows of them: the markers it puts on its stack (a list, dict or set by its item count, a
long string by its length, a tensor, a float, a storage by its key), their estimated sizes in CPython,
the globals a checkpoint of plain data may name (by kind, with the arguments each tensor rebuild
takes), and the few questions the walk asks of a value, read from its type, never its content.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch


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
# s an object's state (see hyperrng.resume._pickle_check's _Pickle._state).
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
