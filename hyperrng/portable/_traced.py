"""Portable mode in compiled code: what ``torch.compile`` records for a random op on a thread in the mode.

**The mechanism, in a paragraph.** ``torch.compile`` (Dynamo, AOTAutograd, inductor) sees an op only
while it traces it, through torch's Python dispatcher, which nothing but tracing turns on. There, on
a thread in portable mode, each portable random op is recorded as a hyperrng custom op
(``torch.ops.hyperrng.*``, :data:`OPS`) instead of torch's: opaque to the compilers, so inductor
never replaces it with random numbers of its own; with a fake implementation that gives shapes; and
*ordered*: each draw takes the previous draw's last output as an input, so no scheduler can reorder
two draws; each is tagged as torch tags its random ops, so no pass merges or recomputes one (except
inside an activation checkpoint, where torch first puts the generator's state back, and with it the
position), and marked side-effectful (``torch.fx.node.has_side_effect``: while compiling, torch's
passes drop an unused random op), so no pass drops one whose outputs nothing uses. The custom op's
implementation, run by the compiled code, is the eager op in the mode: it reads and advances the
position exactly as eager code does. A compiled function therefore draws the sequence eager code
draws, fresh at every call, bit for bit. The substitution is a Python-dispatcher kernel on torch's
``PythonTLSSnapshot`` key, the first key a traced op meets (``torch.rand`` and the other factories
included), active while a compilation traces user code (a ``TracingContext`` is set; inductor traces
its own patterns without one): eager code never reaches it, in the mode or out. A random op without
a portable kernel is refused while it is traced, before anything runs. Dynamo guards compiled code
on the thread's dispatch keys, through its tensor inputs, so a function compiled outside the mode is
compiled again when it first runs in it, and code compiled outside the mode keeps torch's own random
ops (AOTAutograd's cache, which cannot tell the two apart, is off from the first entry into the mode
on). Code without a tensor input is not compiled again: traced in the mode, it runs torch's ops
outside it (:class:`_Portable`); compiled by inductor outside it, its seeds' draw is refused in it.

Limits: enter the mode outside the compiled function (Dynamo does not trace entering it);
``generator=`` arguments, DTensor random ops and sharded regions inside compiled code are
refused while tracing (compiled code cannot yet draw a shard's block of a global tensor). Dynamo
turns the DTensor refusal, a ``NotImplementedError``, into a graph break unless ``fullgraph=True``:
DTensor's random path then runs as eager code, and the sharded region it enters and the portable
kernels it reaches run behind graph breaks of their own (``_ops._untraced``), drawing as eager does.
The custom ops are tagged ``cudagraph_unsafe`` where torch has the tag, so ``mode="reduce-overhead"`` runs them outside
CUDA graphs rather than replaying a captured position (an eager draw under capture is refused).

Private torch hooks, detected by feature (``hyperrng.platforms._features``, key
``"portable-compile"``) and tested: ``OpOverload.py_impl`` and ``_op_dk`` (Python-dispatcher
kernels), ``DispatchKey.PythonTLSSnapshot``, ``torch._guards.TracingContext``, and
``torch.utils._python_dispatch._disable_current_modes`` (checks computed outside the trace).
"""

from __future__ import annotations

import math
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from hyperrng.errors import ArgumentTypeError, InvalidArgumentError, UnsupportedPortableOpError
from hyperrng.philox import attention
from hyperrng.platforms import _features
from hyperrng.portable import _attention as _attention_ops
from hyperrng.portable import _kernels as kernels
from hyperrng.portable import _ops as ops
from hyperrng.portable.position import draw_at_position
from hyperrng.sharding.tracker import active_region
from hyperrng.streams._checkpoints import in_rng_replay

__all__ = ["NAMESPACE", "OPS", "installed"]

NAMESPACE = "hyperrng"
"""The namespace of the custom ops: ``torch.ops.hyperrng``."""

_MASK64 = (1 << 64) - 1


class _Portable:
    """Entered around a custom op's implementation; entered, it says whether the op draws portably.

    On a thread in the mode, it does. Out of it, only where a compiled backward pass recomputes the draw (in
    an activation checkpoint, at the position torch's ``run_with_rng_state`` puts back), which may run after
    the mode was left or on autograd's own thread. Elsewhere it runs torch's own op, as the function compiled
    outside the mode would: torch.compile guards a graph on the mode only through its tensor inputs, so one
    without any (a piece after a graph break that takes only ints), traced in the mode, runs again outside it."""

    __slots__ = ("entry",)

    def __enter__(self) -> bool:
        self.entry = None
        if not kernels.THREAD.entries:
            if not in_rng_replay(sys._getframe(1), NAMESPACE):
                return False
            self.entry = kernels.Entry(self, False, None)
            ops.push(self.entry)
        return True

    def __exit__(self, *exc: object) -> None:
        if self.entry is not None:
            ops.pop(self.entry)


def _fresh(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


def _link() -> torch.Tensor:
    """The order output of a draw: nothing but a value the next draw of the graph takes as an input."""
    return torch.empty(0, dtype=torch.int64)


# -- the custom ops' implementations: the eager op, on the thread in the mode ----------------------
def _filling(method: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The implementation of a fill's custom op: ``method`` (``uniform_``, ...) on a new tensor like
    ``self`` with the op's parameters (its last input, ``after``, only orders it)."""

    def fill(self: torch.Tensor, *params_then_after: Any) -> tuple[torch.Tensor, torch.Tensor]:
        with _Portable():
            return getattr(_fresh(self), method)(*params_then_after[:-1]), _link()

    return fill


def _native_dropout(
    input: torch.Tensor, p: float, train: bool | None, after: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with _Portable():
        out, keep = torch.ops.aten.native_dropout.default(input, p, train)
    return out.contiguous(), keep.contiguous(), _link()  # the fake's layout, whatever the input's


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    after: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Portable attention at the current position: its output, its rows' logsumexp (flat, in the compute
    dtype, for the backward) and the position it drew at, as ``[key, offset]`` (int64), which is also its
    order output."""
    kw = _attention_kw(attn_mask, dropout_p, is_causal, scale, enable_gqa)
    used: list[tuple[int, int, torch.Tensor]] = []

    def draw(key: int, offset: int) -> torch.Tensor:
        plan, mask = attention._plan(q, k, v, **kw, philox_key=key, offset=offset, global_shape=None, shard=None,
                                     backend="auto")  # fmt: skip
        out, lse = attention._forward(plan, q, k, v, mask)
        used.append((key, offset, lse.reshape(-1).to(plan.problem.compute_dtype)))
        return out

    with _Portable() as portable:
        if not portable:
            raise UnsupportedPortableOpError(  # (see _Portable) and portable attention has no torch counterpart
                "scaled_dot_product_attention compiled in portable mode ran outside it, and compiled code without "
                "a tensor input is not compiled again there: call it inside portable_random(), or compile it again "
                "outside the mode (torch._dynamo.reset(), or a separate torch.compile)."
            )
        out = draw_at_position(math.prod(attention.probability_shape(q, k, v, enable_gqa)), None, draw)
    key, offset, lse = used[0]
    return out.contiguous(), lse, torch.tensor([key - (1 << 64) if key >= 1 << 63 else key, offset], dtype=torch.int64)


def _attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    position: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    mask_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`_attention`'s inputs from its output and logsumexp, the dropout mask drawn
    again at the position it drew at (an empty tensor stands for no mask gradient)."""
    key, offset = (int(x) for x in position.tolist())
    kw = _attention_kw(attn_mask, dropout_p, is_causal, scale, enable_gqa)
    plan, mask = attention._plan(q, k, v, **kw, philox_key=key & _MASK64, offset=offset, global_shape=None,
                                 shard=None, backend="auto")  # fmt: skip
    problem = plan.problem
    if plan.kernels is None:  # the layout each implementation's forward gave its logsumexp
        rows = lse.view(*problem.compute_batch, problem.L)
    else:
        rows = lse.view(math.prod(problem.batch[:-1]), problem.batch[-1] if problem.batch else 1, problem.L)
        rows = rows.to(torch.float32)
    dq, dk, dv, dmask = attention._backward(plan, (q, k, v, mask, out, rows), grad, mask_grad)
    # contiguous, as the fake says: each implementation has a layout of its own (the Triton kernels
    # write contiguous gradients, the torch path the inputs' layout), and compiled code trusts the fake
    dmask = torch.empty(0, dtype=q.dtype, device=q.device) if dmask is None else dmask.contiguous()
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dmask


def _attention_kw(
    attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool
) -> dict[str, Any]:
    return dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


# -- their fake implementations: shapes only -------------------------------------------------------
def _fake_fill(self: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _fresh(self), _link()


def _fake_dropout(input: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fresh(input), torch.empty(input.shape, dtype=torch.bool, device=input.device), _link()


def _fake_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any, dropout_p: float, is_causal: bool,
    scale: float | None, enable_gqa: bool, after: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    batch = attention.probability_shape(q, k, v, enable_gqa)[:-2]
    out = torch.empty((*batch, q.shape[-2], v.shape[-1]), dtype=q.dtype, device=q.device)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.empty(math.prod(batch) * q.shape[-2], dtype=compute, device=q.device)
    return out, lse, torch.empty(2, dtype=torch.int64)


def _fake_attention_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
    *args: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    mask_grad = args[-1]
    dmask = attn_mask.new_empty(attn_mask.shape) if mask_grad and attn_mask is not None else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dmask


# -- autograd: dropout's backward as eager computes it, attention's from the position it drew at ----
def _fill_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    ctx.inputs = [(t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else (0, None, None) for t in inputs]


def _fill_backward(ctx: Any, *_: Any) -> tuple[torch.Tensor | None, ...]:
    """Zeros for the tensor inputs of a fill (``self``, ``bernoulli_``'s probabilities), as torch's own
    derivatives of its random fills give them (not ``None``): the values drawn do not depend on them."""
    needed = ctx.needs_input_grad
    return tuple(torch.zeros(s, dtype=d, device=v) if n else None for n, (s, d, v) in zip(needed, ctx.inputs))


def _dropout_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    ctx.save_for_backward(output[1])
    ctx.p = inputs[1]
    ctx.host = inputs[0].device.type == "cpu"


def _dropout_backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[Any, None, None, None]:
    (keep,) = ctx.saved_tensors
    if ctx.host:  # eager F.dropout on the CPU multiplies by its noise, keep / (1 - p): the same product
        return grad * keep.to(grad.dtype).div_(1.0 - ctx.p), None, None, None
    return torch.ops.aten.native_dropout_backward.default(grad, keep, 1.0 / (1.0 - ctx.p)), None, None, None


def _attention_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    q, k, v, mask = inputs[:4]
    ctx.save_for_backward(q, k, v, mask, *output)  # the output, its logsumexp, the position
    ctx.args = inputs[4:8]


def _attention_backward_rule(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[Any, ...]:
    q, k, v, mask, out, lse, position = ctx.saved_tensors
    mask_grad = bool(ctx.needs_input_grad[3])
    dq, dk, dv, dmask = torch.ops.hyperrng.attention_backward(
        grad, q, k, v, mask, out, lse, position, *ctx.args, mask_grad
    )
    return dq, dk, dv, dmask if mask_grad else None, None, None, None, None, None


def _fill_schema(params: str, method: str) -> tuple[str, Callable[..., Any], Callable[..., Any]]:
    return f"(Tensor self, {params}, Tensor after) -> (Tensor, Tensor)", _filling(method), _fake_fill


_SCHEMAS: dict[str, tuple[str, Callable[..., Any], Callable[..., Any]]] = {
    "uniform": _fill_schema("float low, float high", "uniform_"),
    "normal": _fill_schema("float mean, float std", "normal_"),
    "bernoulli": _fill_schema("float p", "bernoulli_"),
    "bernoulli_tensor": _fill_schema("Tensor p", "bernoulli_"),
    "random": _fill_schema("int low, int high", "random_"),
    "native_dropout": (
        "(Tensor input, float p, bool? train, Tensor after) -> (Tensor, Tensor, Tensor)",
        _native_dropout,
        _fake_dropout,
    ),
    "attention": (
        "(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float dropout_p, bool is_causal, float? scale, "
        "bool enable_gqa, Tensor after) -> (Tensor, Tensor, Tensor)",
        _attention,
        _fake_attention,
    ),
    "attention_backward": (
        "(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor out, Tensor lse, Tensor position, "
        "float dropout_p, "
        "bool is_causal, float? scale, bool enable_gqa, bool mask_grad) -> (Tensor, Tensor, Tensor, Tensor)",
        _attention_backward,
        _fake_attention_backward,
    ),
}
OPS = tuple(_SCHEMAS)
"""The custom ops, ``torch.ops.hyperrng.<name>``. All but ``attention_backward`` draw: their last input
(``after``) is the previous draw's last output, their last output the next draw's input."""

_ORDER: weakref.WeakKeyDictionary[Any, torch.Tensor] = weakref.WeakKeyDictionary()
"""Per trace (its proxy mode), the last output of the last draw recorded: what the next draw comes after."""


def _ordered(op: Any, *args: Any) -> tuple[Any, ...]:
    """Record ``op(*args, after)``, ``after`` being the last draw's order output in this trace (a new empty
    tensor for the first), and keep its own for the next draw; returns its outputs but that one."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    trace = get_proxy_mode()  # None while Dynamo propagates shapes: nothing to order there
    after = _ORDER.get(trace) if trace is not None else None
    *outputs, order = op(*args, torch.empty(0, dtype=torch.int64) if after is None else after)
    if trace is not None:
        _ORDER[trace] = order
    return tuple(outputs)


_AUTOGRAD = {
    **dict.fromkeys(("uniform", "normal", "bernoulli", "bernoulli_tensor", "random"), (_fill_backward, _fill_setup)),
    "native_dropout": (_dropout_backward, _dropout_setup),
    "attention": (_attention_backward_rule, _attention_setup),
}


# -- what tracing records: the substitution on the PythonTLSSnapshot key ----------------------------
def _no_generator(what: str, generator: object) -> None:
    if generator is not None:
        raise UnsupportedPortableOpError(
            f"{what} with generator= inside compiled code in portable mode: compiled code draws from the "
            f"position of the current generator only; draw from a tracker stream (tracker.fork) instead."
        )


def _local(what: str, *tensors: object) -> None:
    """Refuse a DTensor: compiled code would draw its local shard at the position tracing saw, not its
    block of the global tensor (DTensor's random path runs while tracing, not when the code runs)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    if dtensor is not None and any(isinstance(t, dtensor) for t in tensors):
        raise UnsupportedPortableOpError(
            f"{what} on a DTensor inside compiled code in portable mode: compiled code cannot draw a shard's "
            "block of the global tensor yet. Draw it in eager code (outside the compiled function), or compile "
            "without portable mode."
        )


def _outside_region(what: str) -> None:
    if active_region() is not None:
        raise UnsupportedPortableOpError(
            f"{what} inside a sharded region in compiled code: portable mode draws a region's shard in eager "
            f"code only; open the region around an eager call, or compile the function without it."
        )


def _fill_kernel(what: str, check: Callable[..., Any], custom: str) -> Callable[..., Any]:
    """The traced form of an in-place fill: checked as eagerly, then ``self.copy_(custom op(self, ...))``."""
    fn = getattr(torch.ops.hyperrng, custom)

    def traced(self: torch.Tensor, *args: Any, generator: object = None) -> torch.Tensor:
        _no_generator(what, generator)
        _local(what, self, *args)
        _outside_region(what)
        with _disable_current_modes():  # the checks round parameters with real tensors, not traced ones
            params = check(self, *args)
        (values,) = _ordered(fn, self, *params)
        return self.copy_(values)

    return traced


def _check_uniform(self: torch.Tensor, low: float = 0.0, high: float = 1.0) -> tuple[float, float]:
    kernels._check_floating(self, "uniform_")
    from hyperrng import philox

    philox.uniform_draw(self.dtype, low, high)
    return float(low), float(high)


def _check_normal(self: torch.Tensor, mean: float = 0.0, std: float = 1.0) -> tuple[float, float]:
    kernels._check_floating(self, "normal_")
    from hyperrng import philox

    philox.normal_draw(self.dtype, mean, std)
    return float(mean), float(std)


def _check_bernoulli(self: torch.Tensor, p: float = 0.5) -> tuple[float]:
    from hyperrng import philox

    return (philox.check_probability(p),)


def _check_bernoulli_tensor(self: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor]:
    if not p.is_floating_point():
        raise ArgumentTypeError(f"bernoulli_ takes floating-point probabilities, got a {p.dtype} tensor.")
    try:
        fits = torch.broadcast_shapes(p.shape, self.shape) == self.shape  # shapes only: p may be a traced tensor
    except RuntimeError:
        fits = False
    if not fits:
        raise InvalidArgumentError(
            f"bernoulli_: probabilities of shape {tuple(p.shape)} do not broadcast to the tensor's shape "
            f"{tuple(self.shape)}."
        )
    return (p,)


def _check_random(self: torch.Tensor, low: int, high: int | None = None) -> tuple[int, int]:
    if high is None:
        raise UnsupportedPortableOpError(
            f"random_({low}, None) inside compiled code in portable mode: compiled code draws ranges with an "
            "upper bound; pass one, or draw it in eager code."
        )
    return kernels.random_bounds(self.dtype, int(low), int(high))


def _check_random_to(self: torch.Tensor, high: int) -> tuple[int, int]:
    return _check_random(self, 0, high)


def _traced_dropout(input: torch.Tensor, p: float, train: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    _local("dropout", input)
    p_value = kernels.undrawn_dropout(input, p, train)  # recorded as plain ops where nothing is drawn
    if not isinstance(p_value, float):
        return p_value
    _outside_region("dropout")
    out, keep = _ordered(torch.ops.hyperrng.native_dropout, input, p_value, train)
    return out, keep


def _traced_attention(name: str) -> Callable[..., Any]:
    read_mask, extra = _attention_ops.OPS[name]
    parameters = _attention_ops._parameters(getattr(torch.ops.aten, name).default)

    def traced(*args: Any, **kwargs: Any) -> Any:
        named = _attention_ops._bound_arguments(parameters, args, kwargs)
        if not named.get("dropout_p") or named.get("dropout_mask") is not None:
            return None  # draws nothing: torch's op
        _local("scaled_dot_product_attention", named["query"], named["key"], named["value"])
        _outside_region("scaled_dot_product_attention")
        q = named["query"]
        gqa = bool(named.get("enable_gqa")) or (q.dim() >= 3 and q.shape[-3] != named["key"].shape[-3])
        out, _ = _ordered(  # the logsumexp is for the backward only
            torch.ops.hyperrng.attention, q, named["key"], named["value"], read_mask(named),
            float(named["dropout_p"]), bool(named.get("is_causal") or False), named.get("scale"), gqa,
        )  # fmt: skip
        return (out, *_attention_ops._placeholders(extra, out.device))

    return traced


def _refused(op: Any) -> Callable[..., Any]:
    """The traced form of a random op without a portable kernel: refused, unless its arguments make it
    deterministic (then ``None``: torch's op)."""
    label = ops._op_label(op)
    dropout = ops._argument_reader(op, ops._DROPOUT_ARGS)
    training = ops._argument_reader(op, ops._TRAINING_ARGS)

    def traced(*args: Any, **kwargs: Any) -> Any:
        if (dropout is not None and not dropout(args, kwargs)) or (training is not None and not training(args, kwargs)):
            return None
        raise UnsupportedPortableOpError(ops._refusal_message(label))

    return traced


def _eager_only(what: str) -> Callable[..., Any]:
    """The traced form of a portable op that compiled code does not draw (two words per element)."""

    def traced(*args: Any, **kwargs: Any) -> Any:
        raise UnsupportedPortableOpError(
            f"{what} inside compiled code in portable mode: it draws portably in eager code only; draw it "
            "outside the compiled function (or, for random_, pass an upper bound)."
        )

    return traced


def _decomposed(op: Any) -> Callable[..., Any]:
    """The traced form of a random op whose default kernel is made of others (``torch.rand`` is
    ``empty`` then ``uniform_``): that kernel, so that tracing meets the ops it is made of."""

    key = getattr(torch._C.DispatchKey, ops.explicit_composite_key(op) or "CompositeExplicitAutograd")

    def traced(*args: Any, **kwargs: Any) -> Any:
        return op._op_dk(key, *args, **kwargs)

    return traced


_FACTORY_FILLS = {  # a factory taking a size after the fill's parameters: that fill, its default dtype
    "rand": ("uniform_", None), "randn": ("normal_", None),
    "normal": ("normal_", None), "randint": ("random_", torch.int64),
}  # fmt: skip


def _factory(op: Any) -> Callable[..., Any] | None:
    """The traced form of a factory of :data:`_FACTORY_FILLS` (``torch.rand(size)`` is ``empty(size)`` then
    ``uniform_()``), written out: its default kernel, in C++, takes concrete sizes only, and code compiled with
    dynamic shapes (as torch.compile does from a second batch size on) passes symbolic ones. ``None`` for
    another op (their ``out=`` forms included)."""
    name = op._schema.name.removeprefix("aten::")
    if name not in _FACTORY_FILLS or not {"size", "dtype"} <= {argument.name for argument in op._schema.arguments}:
        return None
    fill, default_dtype = _FACTORY_FILLS[name]

    def traced(*params_then_size: Any, generator: object = None, dtype: Any = default_dtype, **options: Any) -> Any:
        *params, size = params_then_size
        return getattr(torch.empty(size, dtype=dtype, **options), fill)(*params, generator=generator)

    return traced


def _on_snapshot_key(op: Any, portable: Callable[..., Any]) -> Callable[..., Any]:
    """The Python-dispatcher kernel of ``op`` on ``PythonTLSSnapshot``: ``portable`` on a thread in the
    mode (``None`` from it: torch's op), torch's own handling of the key everywhere else."""
    key = torch._C.DispatchKey.PythonTLSSnapshot
    tracing = torch._guards.TracingContext.try_get

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if kernels.THREAD.entries and tracing() is not None:  # not the compiler's own tracing of its patterns
            result = portable(*args, **kwargs)
            if result is not None:
                return result
        return op._op_dk(key, *args, **kwargs)

    return kernel


def _below_the_key(op: Any, key: Any) -> Callable[..., Any]:
    """For a default kernel left on portable mode's key (an op reached from ``BackendSelect`` with tensors,
    such as ``_to_copy``), what tracing runs there: the op with the key excluded. Under the Python
    dispatcher that default would loop through torch's Python meta kernels (``copy_`` calls ``.to()``)."""
    excluded = torch._C.DispatchKeySet(key)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return op(*args, **kwargs)

    return kernel


def _overload(label: str) -> Any:
    name, _, overload = label.partition(".")
    return getattr(getattr(torch.ops.aten, name), overload or "default")


class _Installed:
    """The custom ops and the tracing kernels, made once per process, when portable mode's kernels are
    registered (the first entry into the mode); a torch that lacks a hook leaves eager portable mode as
    it is, and :func:`installed` says why."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = False
        self.refusal: str | None = None  # why compiled code cannot draw portably here, if it cannot
        self.keep: list[Any] = []  # the custom ops' definitions, alive for the process

    def install(self, key: Any) -> None:
        with self.lock:
            if self.done:
                return
            self.done = True
            found = _features.feature("portable-compile")
            if not found.available:
                self.refusal = found.refusal()
                return
            try:
                _autograd_cache_off()
                self._define()
                self._register(key)
            except Exception as exc:  # a torch whose hooks changed: eager portable mode still works
                self.refusal = f"torch.compile cannot trace portable ops on this torch ({type(exc).__name__}: {exc})"

    def _define(self) -> None:
        tags = [torch.Tag.nondeterministic_seeded]
        if hasattr(torch.Tag, "cudagraph_unsafe"):
            tags.append(torch.Tag.cudagraph_unsafe)
        for name, (schema, impl, fake) in _SCHEMAS.items():
            drawing = name != "attention_backward"
            op = torch.library.custom_op(
                f"{NAMESPACE}::{name}", impl, mutates_args=(), schema=schema, tags=tags if drawing else ()
            )
            op.register_fake(fake)
            if drawing:  # or the compilers drop a draw whose outputs nothing uses (see the module docstring)
                torch.fx.node.has_side_effect(getattr(torch.ops.hyperrng, name).default)
            if name in _AUTOGRAD:
                backward, setup = _AUTOGRAD[name]
                op.register_autograd(backward, setup_context=setup)
            self.keep.append(op)

    def _register(self, key: Any) -> None:
        snapshot = torch._C.DispatchKey.PythonTLSSnapshot
        traced: dict[Any, Callable[..., Any]] = {
            _overload("uniform_"): _fill_kernel("uniform_", _check_uniform, "uniform"),
            _overload("normal_"): _fill_kernel("normal_", _check_normal, "normal"),
            _overload("bernoulli_.float"): _fill_kernel("bernoulli_", _check_bernoulli, "bernoulli"),
            _overload("bernoulli_.Tensor"): _fill_kernel("bernoulli_", _check_bernoulli_tensor, "bernoulli_tensor"),
            _overload("random_.from"): _fill_kernel("random_", _check_random, "random"),
            _overload("random_.to"): _fill_kernel("random_", _check_random_to, "random"),
            _overload("native_dropout"): _traced_dropout,
            _overload("random_"): _eager_only("random_() without an upper bound"),
            _overload("randperm.generator_out"): _eager_only("randperm"),
        }
        for name in _attention_ops.OPS:
            traced[_overload(name)] = _traced_attention(name)
        for op in ops._random_aten_ops():
            traced.setdefault(op, _refused(op))
        for op in ops.composite_random_ops():
            traced.setdefault(op, _factory(op) or _decomposed(op))
        for op in traced:
            if snapshot in op.py_kernels:
                raise RuntimeError(f"{op} already has a Python kernel on PythonTLSSnapshot")
        for op, portable in traced.items():
            op.py_impl(snapshot)(_on_snapshot_key(op, portable))
        for name in ops.defaults_left_on_key():
            op = _overload(name.removeprefix("aten::"))
            if key not in op.py_kernels:
                op.py_impl(key)(_below_the_key(op, key))


_INSTALLED = _Installed()
ops.register_then(_INSTALLED.install)  # defined at the first entry into the mode, with the kernels


def installed() -> str | None:
    """``None`` when compiled code draws portably in this process, else why not (``"not yet"`` before the
    first entry into the mode)."""
    if not _INSTALLED.done:
        return "not yet: the custom ops are defined at the first entry into portable mode"
    return _INSTALLED.refusal


def _autograd_cache_off() -> None:
    """Switch AOTAutograd's cache of compiled code off for this process, at the first entry into the mode.

    That cache finds a compiled artifact by Dynamo's graph, which is the same in the mode and
    outside it (the substitution happens below it, while AOTAutograd traces): left on, a function
    compiled outside the mode would hand its code, with torch's own random ops, to the same
    function compiled in it, and code compiled in the mode, with portable ops, to a later
    compilation outside it, in this process or, from the cache on disk, in the next. Switching
    it back on at the last exit from the mode would cost every entry two writes of torch's
    configuration (8 us); so it stays off, a cost in compile time only (inductor's own cache
    keys the graph after the substitution and stays on).
    """
    import torch._functorch.config as config

    config.enable_autograd_cache = False
