"""Portable draws on a CUDA GPU against the device's own random ops, and the block step that uses them.

Runs where CUDA is available and prints one line saying why it is skipped elsewhere. Every
row is a ratio against torch's own op timed in the same rounds, the GPU synchronised at the
end of each round (a round times its launches and the kernels they queue):

* ``philox`` draws (Triton backend) against ``torch.rand``, ``torch.randn``, ``bernoulli_``
  and ``F.dropout``, at 2**20, 2**24 and 2**26 elements (float32 and bfloat16);
* ``F.dropout`` inside portable mode against the same call outside it;
* a transformer block's training step (:class:`TransformerBlock`: batch 8, sequence 1024,
  width 1024, 16 heads, bfloat16, dropout 0.1 on the residuals and in the MLP, none in
  attention) in portable mode against the same step native; then with attention dropout,
  eager and under ``torch.compile`` (default and ``mode="reduce-overhead"``, whose CUDA graphs
  leave the portable ops out) against the same compiled step native;
* a tracker fork, copying and graph-safe, against a Megatron-style state copy;
* portable attention: ``F.scaled_dot_product_attention`` with dropout 0.1 in portable mode,
  forward and backward (batch 8, 16 heads, L = S = 1024 and 4096, head dims 64 and 128,
  bfloat16, causal and not) against torch's SDPA with the same dropout, and the memory it
  holds beyond inputs and outputs (``torch.cuda.max_memory_allocated``); the block step again
  with attention dropout 0.1.

Targets: portable uniform, bernoulli and dropout at least 1.0x torch's throughput at 2**24
and 2**26, normal at least 0.9x; the block step at most 1.10x native, 1.15x with attention
dropout; portable attention at most 1.5x torch's.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from hyperrng.cli.bench._timing import BenchResult, Timing, interleaved

__all__ = ["TransformerBlock", "benchmarks", "time_on_device"]

_SIZES = (2**20, 2**24, 2**26)
_QUICK_SIZES = (2**20,)
_TARGETED = (2**24, 2**26)  # sizes whose throughput rows carry targets
_KEY = 0x5EED
_P = 0.1
_BLOCK = {"batch": 8, "sequence": 1024, "width": 1024, "heads": 16}
_QUICK_BLOCK = {"batch": 2, "sequence": 256, "width": 256, "heads": 4}
_STEP_TARGET = 1.10
_ATTENTION_STEP_TARGET = 1.15
_ATTENTION_TARGET = 1.5
_ATTENTION = [(1024, 64, False), (1024, 64, True), (1024, 128, True), (4096, 64, True), (4096, 128, False)]
_QUICK_ATTENTION = [(256, 64, True)]


def time_on_device(
    fns: dict[str, Callable[[], object]], *, number: int, rounds: int, device: torch.device
) -> dict[str, Timing]:
    """:func:`~hyperrng.cli.bench._timing.interleaved` with the device synchronised around each round,
    so a round's time includes the kernels its calls queued (on the CPU, plain rounds)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return interleaved(fns, number=number, rounds=rounds, sync=sync)


class TransformerBlock(nn.Module):
    """A pre-norm transformer block: attention with ``F.scaled_dot_product_attention``, a 4x MLP.

    Dropout ``p_resid`` after attention, inside the MLP and after it; ``p_attn`` on the attention
    probabilities (0: torch's fused kernels run, in portable mode too).
    """

    def __init__(self, width: int, heads: int, p_resid: float, p_attn: float = 0.0) -> None:
        super().__init__()
        self.heads, self.p_resid, self.p_attn = heads, p_resid, p_attn
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        p_attn = self.p_attn if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p_attn, is_causal=True)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, s, w)), self.p_resid, self.training)
        h = F.dropout(F.gelu(self.up(self.norm2(x))), self.p_resid, self.training)
        return x + F.dropout(self.down(h), self.p_resid, self.training)


def block_step(
    device: torch.device, dims: dict[str, int], p_attn: float = 0.0, compile_mode: str | None = None
) -> tuple[Callable[[], None], Callable[[], None]]:
    """A block's training step (forward, backward, SGD) native, and the same step in portable mode;
    with ``compile_mode`` (``"default"``, ``"reduce-overhead"``) the block runs ``torch.compile``'d."""
    from hyperrng.portable.mode import portable_random

    model = TransformerBlock(dims["width"], dims["heads"], _P, p_attn).to(device, torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(dims["batch"], dims["sequence"], dims["width"], device=device, dtype=torch.bfloat16)
    forward = model if compile_mode is None else torch.compile(model, mode=compile_mode)

    def step() -> None:
        loss = forward(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def portable_step() -> None:
        with portable_random():
            step()

    return step, portable_step


@contextmanager
def _skip_line(reason: str) -> Iterator[None]:
    print(f"hyperrng bench: gpu suite skipped: {reason}.", file=sys.stderr)
    yield


def benchmarks(quick: bool) -> list[BenchResult]:
    """The rows above on ``cuda:0``; none (and one line on stderr saying why) without CUDA."""
    if not torch.cuda.is_available():
        with _skip_line("no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine"):
            return []
    return device_rows(torch.device("cuda", torch.cuda.current_device()), quick)


def device_rows(device: torch.device, quick: bool, sizes: tuple[int, ...] | None = None) -> list[BenchResult]:
    """Every row of the suite on ``device`` (the tests run it on the CPU at tiny sizes)."""
    from hyperrng.philox import backends

    backend, why = backends.describe(device)
    number, rounds = (3, 3) if quick else (10, 7)
    note = f"{device}, philox backend {backend} ({why})"
    rows = []
    for n in sizes or (_QUICK_SIZES if quick else _SIZES):
        rows += _draw_rows(device, n, number, rounds, note)
    rows.append(_in_mode_row(device, (sizes or (_QUICK_SIZES if quick else (2**24,)))[-1], number, rounds, note))
    if sizes is None:
        dims = _QUICK_BLOCK if quick else _BLOCK
        rows.append(_step_row(device, dims, rounds, note))
        rows.append(_step_row(device, dims, rounds, note, p_attn=_P))
        for compile_mode in ("default", "reduce-overhead"):
            rows.append(_step_row(device, dims, rounds, note, p_attn=_P, compile_mode=compile_mode))
        rows += _fork_rows(device, rounds)
        batch, heads = (2, 4) if quick else (8, 16)
        for length, head_dim, causal in _QUICK_ATTENTION if quick else _ATTENTION:
            rows.append(_attention_row(device, batch, heads, length, head_dim, causal, rounds, note))
    return rows


def attention_step(
    device: torch.device, batch: int, heads: int, length: int, head_dim: int, causal: bool
) -> tuple[Callable[[], None], Callable[[], None]]:
    """SDPA with dropout, forward and backward: torch's, and the same call in portable mode."""
    from hyperrng.portable.mode import portable_random

    q, k, v = (
        torch.randn(batch, heads, length, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn(batch, heads, length, head_dim, device=device, dtype=torch.bfloat16)

    def native() -> None:
        F.scaled_dot_product_attention(q, k, v, dropout_p=_P, is_causal=causal).backward(grad)

    def portable() -> None:
        with portable_random():
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=_P, is_causal=causal)
        out.backward(grad)

    return native, portable


def _attention_row(
    device: torch.device, batch: int, heads: int, length: int, head_dim: int, causal: bool, rounds: int, note: str
) -> BenchResult:
    native, portable = attention_step(device, batch, heads, length, head_dim, causal)
    t = time_on_device({"base": native, "ours": portable}, number=3, rounds=rounds, device=device)
    memory = ""
    if device.type == "cuda":
        extra = []
        for fn in (native, portable):
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.memory_allocated(device)
            fn()
            torch.cuda.synchronize(device)
            extra.append((torch.cuda.max_memory_allocated(device) - start) / 2**20)
        memory = f"; peak beyond inputs: torch {extra[0]:.0f} MiB, portable {extra[1]:.0f} MiB"
    return BenchResult(
        f"gpu: portable SDPA fwd+bwd, L={length}, d={head_dim}{', causal' if causal else ''}",
        t["ours"],
        "F.scaled_dot_product_attention, same dropout",
        t["base"],
        target=_ATTENTION_TARGET,
        note=f"{note}; batch {batch}, {heads} heads, bf16, dropout {_P}{memory}",
    )


def _draw_rows(device: torch.device, n: int, number: int, rounds: int, note: str) -> list[BenchResult]:
    from hyperrng import philox

    x32 = torch.randn(n, device=device)
    x16 = x32.to(torch.bfloat16)
    cases: list[tuple[str, Callable[[], object], str, Callable[[], object], float | None]] = [
        (
            "uniform f32",
            lambda: philox.uniform(n, _KEY, device=device),
            "torch.rand",
            lambda: torch.rand(n, device=device),
            1.0,
        ),
        (
            "normal f32",
            lambda: philox.normal(n, _KEY, device=device),
            "torch.randn",
            lambda: torch.randn(n, device=device),
            0.9,
        ),
        (
            "bernoulli f32",
            lambda: philox.bernoulli(n, 1 - _P, _KEY, dtype=torch.float32, device=device),
            "Tensor.bernoulli_",
            lambda: torch.empty(n, device=device).bernoulli_(1 - _P),
            1.0,
        ),
        ("dropout f32", lambda: philox.dropout(x32, _P, _KEY), "F.dropout", lambda: F.dropout(x32, _P), 1.0),
        ("dropout bf16", lambda: philox.dropout(x16, _P, _KEY), "F.dropout", lambda: F.dropout(x16, _P), 1.0),
    ]
    rows = []
    for name, ours, base, theirs, target in cases:
        t = time_on_device({"base": theirs, "ours": ours}, number=number, rounds=rounds, device=device)
        rows.append(
            BenchResult(
                f"gpu: philox {name}, 2**{round(math.log2(n))}",
                t["ours"],
                base,
                t["base"],
                better="higher",
                target=target if n in _TARGETED else None,
                note=note,
            )
        )
    return rows


def _in_mode_row(device: torch.device, n: int, number: int, rounds: int, note: str) -> BenchResult:
    from hyperrng.portable.mode import set_portable_random

    x = torch.randn(n, device=device, dtype=torch.bfloat16)

    def outside() -> object:
        return F.dropout(x, _P)

    def inside() -> object:
        set_portable_random(True)
        try:
            return F.dropout(x, _P)
        finally:
            set_portable_random(False)

    t = time_on_device({"base": outside, "ours": inside}, number=number, rounds=rounds, device=device)
    return BenchResult(
        f"gpu: F.dropout bf16 in portable mode, 2**{round(math.log2(n))}",
        t["ours"],
        "the same call outside the mode",
        t["base"],
        better="higher",
        target=1.0 if n in _TARGETED else None,
        note=f"{note}; the mode switched on and off around each call",
    )


def _step_row(
    device: torch.device,
    dims: dict[str, int],
    rounds: int,
    note: str,
    p_attn: float = 0.0,
    compile_mode: str | None = None,
) -> BenchResult:
    step, portable_step = block_step(device, dims, p_attn, compile_mode)
    t = time_on_device({"base": step, "ours": portable_step}, number=3, rounds=max(rounds, 5), device=device)
    shape = "x".join(str(dims[k]) for k in ("batch", "sequence", "width"))
    where = f"{p_attn} in attention" if p_attn else "none in attention"
    compiled = "" if compile_mode is None else f"torch.compile(mode={compile_mode!r}) "
    if compile_mode == "reduce-overhead":
        where += "; portable ops run outside the CUDA graphs"
    return BenchResult(
        f"gpu: {compiled}transformer block step in portable mode{', attention dropout' if p_attn else ''}",
        t["ours"],
        "the same step, native",
        t["base"],
        target=_ATTENTION_STEP_TARGET if p_attn else _STEP_TARGET,
        note=f"{note}; {shape}, {dims['heads']} heads, bf16, dropout {_P} on residuals and MLP, {where}",
    )


def _fork_rows(device: torch.device, rounds: int) -> list[BenchResult]:
    from hyperrng.streams.tracker import RNGStatesTracker

    copying, graph_safe = RNGStatesTracker(graph_safe=False), RNGStatesTracker(graph_safe=True)
    for tracker in (copying, graph_safe):
        tracker.add("bench", 1234)
    stream = {"state": torch.cuda.get_rng_state(device)}

    def megatron_copy() -> None:  # the state swap Megatron-core's tracker makes around a fork
        saved = torch.cuda.get_rng_state(device)
        torch.cuda.set_rng_state(stream["state"], device)
        stream["state"] = torch.cuda.get_rng_state(device)
        torch.cuda.set_rng_state(saved, device)

    def fork(tracker: RNGStatesTracker) -> Callable[[], None]:
        def run() -> None:
            with tracker.fork("bench"):
                pass

        return run

    t = time_on_device(
        {"base": megatron_copy, "copying": fork(copying), "graph-safe": fork(graph_safe)},
        number=1000,
        rounds=rounds,
        device=device,
    )
    return [
        BenchResult(f"gpu: {name} tracker.fork enter+exit", t[name], "Megatron-style state copy", t["base"])
        for name in ("copying", "graph-safe")
    ]
