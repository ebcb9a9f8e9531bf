"""``F.scaled_dot_product_attention`` in portable mode: its dropout drawn by :mod:`hyperrng.philox.attention`.

torch's SDPA is a composite that picks a kernel (math, flash, memory-efficient, cuDNN, the
CPU's flash) and calls it. Each of those ops draws its own dropout mask, so in portable mode
the call is taken over where the chosen op starts, at its autograd key: with ``dropout_p > 0``,
on a thread in the mode, with plain tensors, the op's output is
:func:`hyperrng.philox.attention.scaled_dot_product_attention` at the current position (the
portable dropout mask of the global ``[*batch, H, L, S]`` probabilities, drawn again in the
backward pass, never stored), and the position advances by the probabilities' element count,
as for any portable op. Inside a sharded region (``distribute_region`` with the global
``[*batch, H, L, S]`` and placements over batch, heads or query rows: context parallelism)
the op computes its block of the global attention, at the region's position.

Everything else runs torch's kernel unchanged: calls without dropout (portable mode does not
slow attention that draws nothing), other threads, subclass tensors (DTensor, which takes the
math path and draws its dropout through DTensor's own portable ops; the simulated device;
fake tensors), and every call outside the mode. Being registered at autograd keys, these five
ops pay one Python call from the first entry into the mode on, in and out of it (a few
microseconds against an attention kernel's hundreds): the only ops outside the mode that do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hyperrng.errors import InvalidArgumentError
from hyperrng.philox import attention
from hyperrng.platforms.validate import round_up_offset
from hyperrng.portable.position import draw_at_position, shard_slices
from hyperrng.sharding.tracker import active_region

__all__ = ["AUTOGRAD_KEYS", "OPS", "kernels"]

AUTOGRAD_KEYS = ("AutogradCPU", "AutogradCUDA", "AutogradPrivateUse1")
"""The keys the takeover is registered at: where a plain tensor of the CPU, a GPU or an NPU enters autograd."""


def _no_mask(args: dict[str, Any]) -> None:
    return None


# op name -> (how to read its attention mask, the number of outputs beyond the attention, their kinds)
OPS: dict[str, tuple[Callable[[dict[str, Any]], Any], tuple[str, ...]]] = {
    "_scaled_dot_product_attention_math": (lambda a: a.get("attn_mask"), ("tensor",)),
    "_scaled_dot_product_flash_attention_for_cpu": (lambda a: a.get("attn_mask"), ("tensor",)),
    "_scaled_dot_product_efficient_attention": (lambda a: a.get("attn_bias"), ("tensor", "tensor", "tensor")),
    "_scaled_dot_product_flash_attention": (
        _no_mask,
        ("tensor", "tensor", "tensor", "int", "int", "tensor", "tensor", "tensor"),
    ),
    "_scaled_dot_product_cudnn_attention": (
        lambda a: a.get("attn_bias"),
        ("tensor", "tensor", "tensor", "int", "int", "tensor", "tensor", "tensor"),
    ),
}
"""The ops SDPA chooses among, with what the takeover reads and returns for each: the attention
output first, then placeholders for the op's other outputs (logsumexp, sequence lengths, RNG
state, debug mask), which SDPA does not read and which carry no gradient."""


Parameters = tuple[tuple[str, bool, Any], ...]


def _parameters(op: Any) -> Parameters:
    """``(name, keyword-only, default)`` of each of the op's arguments (read once: reading the schema
    costs more than the rest of binding a call)."""
    return tuple((a.name, a.kwarg_only, a.default_value) for a in op._schema.arguments)


def _bound_arguments(parameters: Parameters, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name, defaults filled in."""
    named = {}
    for i, (name, kwarg_only, default) in enumerate(parameters):
        if not kwarg_only and i < len(args):
            named[name] = args[i]
        elif name in kwargs:
            named[name] = kwargs[name]
        else:
            named[name] = default
    return named


def _takes_over(named: dict[str, Any]) -> bool:
    """Whether portable mode draws this call's dropout (the thread is in the mode: checked first):
    dropout on plain tensors."""
    if not named.get("dropout_p"):
        return False
    if named.get("dropout_mask") is not None:  # the math op given its mask draws nothing
        return False
    return all(type(named[t]) is torch.Tensor and named[t].device.type != "meta" for t in ("query", "key", "value"))


def _placeholders(kinds: Sequence[str], device: torch.device) -> list[Any]:
    return [0 if kind == "int" else torch.empty(0, device=device) for kind in kinds]


def _attend(named: dict[str, Any], mask: Any, extra: Sequence[str]) -> tuple[Any, ...]:
    """The op's outputs, the attention drawn portably at the current position (or the region's block)."""
    q, k, v = named["query"], named["key"], named["value"]
    gqa = bool(named.get("enable_gqa")) or (q.dim() >= 3 and k.dim() >= 3 and q.shape[-3] != k.shape[-3])
    kw = {
        "attn_mask": mask,
        "dropout_p": named["dropout_p"],
        "is_causal": named.get("is_causal") or False,
        "scale": named.get("scale"),
        "enable_gqa": gqa,
    }
    region = active_region()
    if region is not None:
        global_shape = tuple(region.global_shape)
        per_dim = shard_slices(region.mesh, region.placements, global_shape)
        if any(len(slices) != 1 for slices in per_dim):
            raise InvalidArgumentError(
                "attention inside a sharded region whose placements split a dimension of the probabilities in "
                "more than one block; shard batch, heads or query rows once each."
            )
        shard = [slices[0] for slices in per_dim]
        key, offset = region.position
        out = attention.scaled_dot_product_attention(
            q, k, v, **kw, philox_key=key, offset=offset, global_shape=global_shape, shard=shard
        )
        region.consume(round_up_offset(math.prod(global_shape)))
    else:
        out = draw_at_position(
            math.prod(attention.probability_shape(q, k, v, gqa)),
            None,
            lambda key, offset: attention.scaled_dot_product_attention(q, k, v, **kw, philox_key=key, offset=offset),
        )
    return (out, *_placeholders(extra, out.device))


def kernels(
    in_mode: Callable[[], bool], before_draw: Callable[[str, torch.device], None]
) -> dict[str, Callable[..., Any]]:
    """The takeover kernel of each op of :data:`OPS`, by op name, for registration ``with_keyset``;
    each calls torch's own kernel for the key (saved now) when ``in_mode()`` is false for the calling
    thread or the call draws nothing, and ``before_draw(what, device)`` (which may refuse) before it draws."""
    made = {}
    for name, (read_mask, extra) in OPS.items():
        op = getattr(torch.ops.aten, name).default
        made[name] = _kernel(op, read_mask, extra, in_mode, before_draw)
    return made


def _kernel(
    op: Any,
    read_mask: Callable[[dict[str, Any]], Any],
    extra: tuple[str, ...],
    in_mode: Callable[[], bool],
    before_draw: Callable[[str, torch.device], None],
) -> Callable[..., Any]:
    originals = {key: torch.library.get_kernel(op, key) for key in AUTOGRAD_KEYS}
    parameters = _parameters(op)

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if in_mode():
            named = _bound_arguments(parameters, args, kwargs)
            if _takes_over(named):
                before_draw("scaled_dot_product_attention with dropout", named["query"].device)
                return _attend(named, read_mask(named), extra)
        key = _autograd_key(keyset)
        return originals[key].call_boxed(keyset, *args, **kwargs)

    return kernel


_DISPATCH_KEYS = tuple((name, getattr(torch._C.DispatchKey, name)) for name in AUTOGRAD_KEYS)


def _autograd_key(keyset: Any) -> str:
    """Which of :data:`AUTOGRAD_KEYS` a call arrived on (the highest autograd key of its keyset)."""
    for name, key in _DISPATCH_KEYS:
        if keyset.has(key):
            return name
    return AUTOGRAD_KEYS[0]
