"""Launching portable attention's Triton kernels (:mod:`hyperrng.philox._triton_attention_kernels`): the
per-call values (:class:`Call`), the tiles and register caps of each kernel and head dim, and the forward
and backward launches. Imported only by :mod:`hyperrng.philox.attention`, lazily (``import hyperrng`` never
imports Triton), and loaded a second time under another name with ``TRITON_INTERPRET=1`` to run on CPU
tensors through Triton's interpreter (:func:`hyperrng.philox._triton.load`): each copy launches the
kernels loaded in its own mode.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from hyperrng.philox import _triton as _loader

FP_FUSION = False
"""``enable_fp_fusion`` of every launch, off: every product is rounded on its own, so a score rounds
alike in a masked block and an unmasked one (with contraction the compiler fuses the unmasked block's
``s * scale - m`` into one multiply-add, which the masked block's select prevents), and a row's values do
not depend on which blocks its query tile crosses (the shard of rows a rank holds), on every Triton
backend. It costs a few instructions a loop (the matrix products run on tensor cores either way)."""

# The kernels, compiled or interpreted as this copy is (TRITON_INTERPRET while it was loaded).
_kernels = _loader.load("hyperrng.philox._triton_attention_kernels", triton.knobs.runtime.interpret)


@dataclass(frozen=True)
class Call:
    """Everything a launch needs besides the tensors; 32-bit values as signed bit patterns.

    The per-call values (key words, offset words, threshold, block position) are kernel arguments typed
    as signed 32-bit bit patterns and excluded from specialisation, so a new key, offset or rank reuses
    the compiled kernel. Shapes, strides and the ``tl.constexpr`` switches select variants.
    """

    scale: float
    causal: bool
    dropout: bool
    drop_scale: float
    thr: int
    k0: int
    k1: int
    ob_lo: int
    ob_hi: int
    ol: int
    b_start: int
    h_start: int
    row_start: int
    heads_global: int
    rows_global: int
    aligned: bool
    interpret: bool


@dataclass(frozen=True)
class _Tiles:
    block_m: int
    block_n: int
    warps: int
    stages: int


# Compiled tiles by kernel, head dim and whether the inputs are float32, not timed on a GPU: chosen so that
# ptxas (Triton 3.6, sm_90) reports no register spills in any variant (dropout or not, causal or not, with or
# without a bias, aligned or not; sequences of 256 and of 77), with the largest tiles that do for 16-bit
# inputs at head dims 64 and 128. Float32 products run without tensor cores (IEEE) and need far more
# registers: its tiles are small, and dk/dv at head dims 64 and 128 and the forward at 128 take eight warps
# (with four, those spilled up to 1.5 KB, without dropout too; dk/dv sum the rows in order whatever the tile).
# The interpreter runs small tiles of the same orientations (forward and dq: tall, dk/dv: wide), so that its
# tests cross tile edges at small sizes.
_SMALL = _Tiles(64, 64, 4, 3)
_COMPILED = {
    "fwd": {16: _SMALL, 32: _SMALL, 64: _Tiles(128, 64, 8, 3), 128: _Tiles(128, 32, 8, 2)},
    "dkdv": {16: _Tiles(32, 64, 4, 3), 32: _Tiles(32, 64, 4, 3), 64: _Tiles(32, 128, 8, 3), 128: _Tiles(32, 64, 8, 3)},
    "dq": {16: _SMALL, 32: _SMALL, 64: _Tiles(128, 32, 8, 3), 128: _Tiles(128, 32, 8, 2)},
}
_FLOAT32 = {"fwd": _Tiles(32, 32, 4, 2), "dkdv": _Tiles(16, 32, 4, 2), "dq": _Tiles(32, 16, 4, 2)}
_COMPILED_FLOAT32 = {
    "fwd": {16: _FLOAT32["fwd"], 32: _FLOAT32["fwd"], 64: _FLOAT32["fwd"], 128: _Tiles(16, 32, 8, 2)},
    "dkdv": {16: _FLOAT32["dkdv"], 32: _FLOAT32["dkdv"], 64: _Tiles(16, 32, 8, 1), 128: _Tiles(16, 32, 8, 1)},
    "dq": dict.fromkeys((16, 32, 64, 128), _FLOAT32["dq"]),
}
_INTERPRETED = {"fwd": _Tiles(32, 16, 1, 1), "dkdv": _Tiles(16, 32, 1, 1), "dq": _Tiles(32, 16, 1, 1)}

# Caps of ptxas's registers a thread (maxnreg) by (kernel, head dim, float32, dropout, bias). Left to itself,
# ptxas takes more registers for the two pipelined loops (unmasked, masked) than it took for the one masked
# loop they replace, in places more than fit the CTAs an SM held then; these caps hold those CTAs, spilling
# nothing (checked as the tiles were, with `.ci/kernel-report` for sm_90 and sm_80). Where a cap that holds
# them spilled somewhere, there is none.
_REGISTERS: dict[tuple[str, int, bool, bool, bool], int] = {
    ("fwd", 16, False, True, False): 128,
    ("fwd", 16, False, True, True): 168,
    ("fwd", 32, False, True, True): 168,
    ("fwd", 128, False, False, False): 128,
    ("fwd", 128, True, True, False): 80,  # left to itself, ptxas takes 64 and spills 16 bytes (fusion off)
    ("dkdv", 16, False, False, False): 96,
    ("dkdv", 32, False, False, False): 128,
    ("dkdv", 128, False, False, False): 128,
    ("dq", 16, False, True, False): 168,
    ("dq", 16, False, True, True): 168,
    ("dq", 32, False, False, True): 128,
    ("dq", 16, True, True, False): 72,
    ("dq", 32, True, True, False): 72,
}


# The tables above were set for Hopper (sm_90). Elsewhere (Ampere's sm_80, a Triton backend that is not
# NVIDIA's) no register caps apply, and where 16-bit kernels spilled on sm_80 with Hopper's tiles they take
# these, which spill nothing there (.ci/kernel-report).
_ELSEWHERE = {("dkdv", 64): _Tiles(16, 64, 4, 2), ("dq", 128): _Tiles(64, 32, 4, 2)}


def _tiles(kernel: str, head_dim: int, dtype: torch.dtype, interpret: bool) -> _Tiles:
    if interpret:
        return _INTERPRETED[kernel]
    if dtype != torch.float32 and not _hopper(triton.runtime.driver.active.get_current_device()):
        found = _ELSEWHERE.get((kernel, head_dim))
        if found is not None:
            return found
    return (_COMPILED_FLOAT32 if dtype == torch.float32 else _COMPILED)[kernel][head_dim]


def _registers(kernel: str, head_dim: int, dtype: torch.dtype, call: Call, bias: torch.Tensor | None) -> int | None:
    if call.interpret or not _hopper(triton.runtime.driver.active.get_current_device()):
        return None
    return _REGISTERS.get((kernel, head_dim, dtype == torch.float32, call.dropout, bias is not None))


@functools.cache
def _hopper(device: int) -> bool:
    """Whether Triton compiles for an NVIDIA GPU of compute capability 9.0 or later on its current ``device``."""
    target = triton.runtime.driver.active.get_current_target()
    return target.backend == "cuda" and isinstance(target.arch, int) and target.arch >= 90


def _geometry_args(call: Call) -> tuple[int, ...]:
    return (
        call.thr,
        call.k0,
        call.k1,
        call.ob_lo,
        call.ob_hi,
        call.ol,
        call.b_start,
        call.h_start,
        call.row_start,
        call.heads_global,
        call.rows_global,
    )


def _switches(call: Call, q: torch.Tensor, bias: torch.Tensor | None) -> dict[str, bool]:
    return {
        "CAUSAL": call.causal,
        "HAS_BIAS": bias is not None,
        "DROPOUT": call.dropout,
        "ALIGNED": call.aligned,
        "IEEE": q.dtype == torch.float32,
        "UPCAST": call.interpret and q.dtype == torch.bfloat16,
    }


def _options(tiles: _Tiles, call: Call, registers: int | None = None) -> dict[str, object]:
    if call.interpret:
        return {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n}
    options: dict[str, object] = {
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "num_warps": tiles.warps,
        "num_stages": tiles.stages,
        "enable_fp_fusion": FP_FUSION,
    }
    if registers is not None:
        options["maxnreg"] = registers
    return options


def _bias_tensor(bias: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    return q if bias is None else bias  # q stands in, never read: HAS_BIAS is False


def _bias_strides(bias: torch.Tensor | None) -> tuple[int, ...]:
    return (0, 0, 0, 0) if bias is None else tuple(bias.stride())


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, call: Call
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output ``(B, H, L, D)`` (contiguous, ``q``'s dtype) and the base-2 ``lse`` ``(B, H, L)`` float32."""
    B, H, L, D = q.shape
    S = k.shape[2]
    out = torch.empty((B, H, L, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, L), dtype=torch.float32, device=q.device)
    tiles = _tiles("fwd", D, q.dtype, call.interpret)
    grid = (triton.cdiv(L, tiles.block_m), H, B)
    _kernels._attn_fwd[grid](
        q, k, v, _bias_tensor(bias, q), out, lse,
        *q.stride(), *k.stride(), *v.stride(), *_bias_strides(bias), *out.stride(),
        H, L, S, H // k.shape[1], call.scale, call.drop_scale, *_geometry_args(call),
        HEAD_DIM=D, **_switches(call, q, bias), **_options(tiles, call, _registers("fwd", D, q.dtype, call, bias)),
    )  # fmt: skip
    return out, lse


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad: torch.Tensor,
    call: Call,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``q`` ``(B, H, L, D)`` and of ``k``, ``v`` ``(B, H // group, S, D)``, contiguous, each in
    its input's dtype, for the upstream gradient ``grad`` of the forward's ``out``."""
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    group = H // Hk
    delta = torch.empty((B, H, L), dtype=torch.float32, device=q.device)
    tiles = _tiles("dq", D, q.dtype, call.interpret)
    _kernels._attn_bwd_delta[(triton.cdiv(L, tiles.block_m), H, B)](
        out, grad, delta, *out.stride(), *grad.stride(), H, L, HEAD_DIM=D, BLOCK_M=tiles.block_m
    )
    dq = torch.empty((B, H, L, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, Hk, S, D), dtype=k.dtype, device=q.device)
    dv = torch.empty((B, Hk, S, D), dtype=v.dtype, device=q.device)
    common = (
        *q.stride(), *k.stride(), *v.stride(), *_bias_strides(bias), *grad.stride(),
        H, L, S, group, call.scale, call.drop_scale, *_geometry_args(call),
    )  # fmt: skip
    switches = _switches(call, q, bias)
    bias_tensor = _bias_tensor(bias, q)
    tiles = _tiles("dkdv", D, q.dtype, call.interpret)
    options = _options(tiles, call, _registers("dkdv", D, q.dtype, call, bias))
    _kernels._attn_bwd_dkdv[(triton.cdiv(S, tiles.block_n), Hk, B)](
        q, k, v, bias_tensor, grad, lse, delta, dk, dv, *common, HEAD_DIM=D, **switches, **options
    )
    tiles = _tiles("dq", D, q.dtype, call.interpret)
    options = _options(tiles, call, _registers("dq", D, q.dtype, call, bias))
    _kernels._attn_bwd_dq[(triton.cdiv(L, tiles.block_m), H, B)](
        q, k, v, bias_tensor, grad, lse, delta, dq, *common, HEAD_DIM=D, **switches, **options
    )
    return dq, dk, dv
