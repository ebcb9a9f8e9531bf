"""The DCP side of :class:`hyperrng.RNGStateful`: what its ``state_dict()`` hands DCP (:class:`_Entry`, which knows
its owner), the load planner that lets the owner re-plan its entries before DCP plans the reads
(:meth:`RNGStateful.planner <hyperrng.resume.state.RNGStateful.planner>`), and the structure a state was saved in,
read from the checkpoint's metadata (:func:`saved_template`), so that a loading rank reads what was saved whatever
its own state holds.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from hyperrng.resume._format import CONTAINERS

__all__ = ["Entry", "planner_class", "saved_template"]


class Entry(dict):  # type: ignore[type-arg]
    """What :meth:`RNGStateful.state_dict` gives DCP: ``{rank key: state}``, knowing its owner,
    so that :meth:`RNGStateful.planner` finds the entries it may re-plan."""

    def __init__(self, owner: Any, items: dict[str, Any]) -> None:
        super().__init__(items)
        self.owner = owner
        self.saved: list[int] | None = None  # the saved ranks, once the planner found this rank's missing


def saved_template(metadata: Any, name: str, key: str) -> dict[str, Any] | None:
    """The structure in which DCP saved the state under ``name.key``, from the paths its save planner recorded
    (tensors allocated at their saved size and dtype, other values read whole): what a load reads into, so that
    a loading rank whose own state differs in structure reads the saved one rather than failing in DCP's planner
    on a key the checkpoint lacks. ``None`` where the checkpoint records no paths (saved without flattening)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    paths = getattr(metadata, "planner_data", None)
    if not isinstance(paths, Mapping):
        return None
    template: dict[Any, Any] = {}
    for fqn, path in paths.items():
        if not isinstance(path, tuple) or len(path) < 3 or path[:2] != (name, key):
            continue
        stored = metadata.state_dict_metadata.get(fqn)
        node = template
        for part in path[2:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = (
            torch.empty(stored.size, dtype=stored.properties.dtype)
            if isinstance(stored, TensorStorageMetadata)
            else None
        )
    if not template:
        return None
    for *parents, last in CONTAINERS:  # an empty one left no path: put it back, or the digest would not match
        node = template
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and last not in node:
            node[last] = CONTAINERS[(*parents, last)]()
    return _as_lists(template)


def _as_lists(node: Any) -> Any:
    """``node`` with every dict keyed ``0..n-1`` turned into the list it was saved as (DCP's paths index lists)."""
    if not isinstance(node, dict):
        return node
    items = {k: _as_lists(v) for k, v in node.items()}
    if items and all(type(k) is int for k in items) and sorted(items) == list(range(len(items))):
        return [items[i] for i in range(len(items))]
    return items


@functools.cache
def planner_class() -> type:
    """:meth:`RNGStateful.planner`'s class, made at first use (importing DCP takes most of a second)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class RNGLoadPlanner(DefaultLoadPlanner):  # type: ignore[misc]
        """DCP's default load planner, letting :class:`hyperrng.RNGStateful` re-plan its entries first."""

        def set_up_planner(self, state_dict: Any, *args: Any, **kwargs: Any) -> None:
            metadata = args[0] if args else kwargs.get("metadata")
            if metadata is not None:
                for name, value in state_dict.items():
                    if isinstance(value, Entry):
                        value.owner._plan(name, value, metadata)
            super().set_up_planner(state_dict, *args, **kwargs)

    return RNGLoadPlanner
