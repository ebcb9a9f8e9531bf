"""Throughput of the portable Philox draws against torch's native ones on CPU.

``torch.rand`` is the natural baseline for :func:`~hyperrng.philox.uniform`: it is what a
caller gives up portability and shard-independence to use; native
``torch.nn.functional.dropout`` is the baseline for :func:`~hyperrng.philox.dropout`.
Both sides of every line run under the same ``torch.set_num_threads`` setting, stated in
the line's name and note: first one thread (like for like: ``torch.rand`` draws its
Mersenne Twister stream on one thread whatever the setting), then the default thread
count of the process when that is more than one (where the portable ops, which are
elementwise, also use the other threads).

The ``portable mode`` lines time torch's own ``torch.rand`` and ``F.dropout`` inside
:class:`~hyperrng.portable.mode.portable_random` (so they include the mode's dispatch
and position bookkeeping, the copy into torch's result tensor, and entering and leaving
the mode on every call) against the same calls outside it. ``portable mode training
step`` times one eager step of a small MLP with dropout (forward, backward, SGD), entering
and leaving the mode around each step, against the same step without it (target 1.10);
``portable mode compiled training step`` the same step under ``torch.compile`` (target 1.10), and
``compile time in portable mode`` its first call, compiling with the caches off (target 1.5).
The ``outside portable mode`` lines time a small random op on a thread that is not in the
mode, once the portable kernels are registered, against the same op before registration
(in a fresh process: registration is once per process; the rounds cannot interleave).

Targets (higher is better, portable throughput over native throughput): eager uniform
0.5, compiled uniform 1.5, eager dropout 0.5. Eager Philox runs about sixty
elementwise integer operations per chunk, ten rounds of which the two 64-bit multiplies
cost most; compiled code fuses them into one loop. Both sides allocate a fresh result
each call, so both pay the same page faults on it.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from hyperrng.cli.bench._timing import BenchResult, Timing, interleaved
from hyperrng.philox import dropout, uniform
from hyperrng.platforms import _features
from hyperrng.portable.mode import portable_random
from hyperrng.streams.tracker import RNGStatesTracker

__all__ = ["benchmarks"]

_FULL_ELEMENTS = 2**24
_QUICK_ELEMENTS = 2**20
_KEY = 0x5EED  # any key: the cost does not depend on it
_DROPOUT_P = 0.1
_EAGER_TARGET = 0.5
_COMPILED_TARGET = 1.5
_DROPOUT_TARGET = 0.5
_STEP_TARGET = 1.10  # portable training step over a native one
_COMPILED_STEP_TARGET = 1.10  # the same, both compiled
_COMPILE_TIME_TARGET = 1.5  # compiling that step in the mode over compiling it outside
_FIXED_TARGET = 3.0  # entering and leaving over a tracker fork; a small op inside the mode over outside it
_OUTSIDE_TARGET = 1.2  # a random op outside the mode, kernels registered, over the same before registration
_SMALL_DROPOUT = (32, 64)
_ATTENTION_SHAPE = (4, 8, 256, 64)  # batch, heads, L = S, head dim
_ATTENTION_TARGET = 2.0  # portable SDPA with dropout over torch's math SDPA with dropout, on the CPU
_MLP_WIDTH, _MLP_BATCH, _MLP_DROPOUT = 1024, 32, 0.1


@contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(threads)``, then restore the setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def benchmarks(quick: bool) -> list[BenchResult]:
    """Time float32 ``uniform`` (eager, compiled) against ``torch.rand`` and ``dropout`` against
    ``F.dropout``, at one thread and at the default thread count.

    ``quick`` uses 2**20 elements instead of 2**24 and fewer repeats. The first compiled
    call compiles (tens of seconds on CPU); it is the warm-up and is not timed.
    """
    n = _QUICK_ELEMENTS if quick else _FULL_ELEMENTS
    repeat = 3 if quick else 7
    x = torch.randn(n)
    portable_mode_here = _features.feature("portable-mode").available

    def rand() -> torch.Tensor:
        return torch.rand(n)

    def f_dropout() -> torch.Tensor:
        return F.dropout(x, _DROPOUT_P, training=True)

    # Each line: its name, the timed call, the baseline's name, the baseline call, the target.
    f_dropout_name = f"F.dropout(p={_DROPOUT_P}, training=True)"
    lines: list[tuple[str, Callable[[], object], str, Callable[[], object], float]] = [
        ("philox uniform eager", lambda: uniform(n, _KEY), "torch.rand", rand, _EAGER_TARGET),
        ("philox uniform compiled", lambda: uniform(n, _KEY, compiled=True), "torch.rand", rand, _COMPILED_TARGET),
        ("philox dropout eager", lambda: dropout(x, _DROPOUT_P, _KEY), f_dropout_name, f_dropout, _DROPOUT_TARGET),
    ]
    if portable_mode_here:  # torch's own calls inside portable mode against the same calls outside it
        in_mode_dropout = _in_mode(f_dropout, compiled=False)
        lines += [
            ("portable mode torch.rand eager", _in_mode(rand, compiled=False), "torch.rand", rand, _EAGER_TARGET),
            ("portable mode torch.rand compiled", _in_mode(rand, compiled=True), "torch.rand", rand, _COMPILED_TARGET),
            ("portable mode F.dropout eager", in_mode_dropout, f_dropout_name, f_dropout, _DROPOUT_TARGET),
        ]
    results = []
    default_threads = torch.get_num_threads()
    for threads in [1] if default_threads <= 1 else [1, default_threads]:
        label = f"{threads} thread" + ("s" if threads > 1 else "")
        note = f"{n} float32 elements, CPU; torch threads: {threads} for both (torch.set_num_threads({threads}))"
        with _torch_threads(threads):
            for name, fn, base, base_fn, target in lines:
                # Interleaved rounds, so both see the same machine load; the warm-up call compiles.
                t = interleaved({"base": base_fn, "ours": fn}, number=1, rounds=repeat)
                row = BenchResult(
                    f"{name}, {label}", t["ours"], base, t["base"], better="higher", target=target, note=note
                )
                results.append(row)
    if portable_mode_here:
        with _torch_threads(1):
            results += _fixed_costs(repeat)
            results.append(_training_step(repeat))
            if _features.feature("portable-compile").available:
                results += _compiled_training_step(repeat, compiles=1 if quick else 3)
            results.append(_attention(repeat))
        results += _outside_the_mode(repeat)
    else:  # an older torch: say so on the bench's error stream, measure the rest
        print(
            f"hyperrng bench: portable-mode rows skipped: {_features.feature('portable-mode').refusal()}.",
            file=sys.stderr,
        )
    return results


class _MLP(nn.Module):
    """Three linear layers with dropout after the first two: a small model's step, dropout included."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(_MLP_WIDTH, _MLP_WIDTH) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = F.dropout(torch.relu(layer(x)), _MLP_DROPOUT, self.training)
        return self.layers[-1](x)


def _training_step(repeat: int) -> BenchResult:
    model = _MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(_MLP_BATCH, _MLP_WIDTH)

    def step() -> None:
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def portable_step() -> None:
        with portable_random():
            step()

    # The two sides differ by a few percent of a step, and on a shared machine one round of
    # either side varies by more than that: three times the rounds of the other lines, so
    # that a handful of disturbed rounds does not decide the medians and their ratio.
    t = interleaved({"base": step, "ours": portable_step}, number=5, rounds=max(3 * repeat, 15))
    return BenchResult(
        name="portable mode training step, 1 thread",
        timing=t["ours"],
        baseline="the same step, native",
        baseline_timing=t["base"],
        target=_STEP_TARGET,
        note=f"MLP {_MLP_WIDTH}x{_MLP_WIDTH}x3 with dropout {_MLP_DROPOUT}, batch {_MLP_BATCH}, eager, "
        "forward+backward+SGD; portable_random() entered and left around every step",
    )


def _compiled_training_step(repeat: int, compiles: int) -> list[BenchResult]:
    """The MLP's step under ``torch.compile`` (inductor) in portable mode against the same compiled step
    outside it, and the first call's time (compiling, caches off) in the mode against outside it, ``compiles``
    rounds each (a compile takes seconds on the CPU)."""
    import torch._dynamo
    import torch._inductor.config as inductor

    x = torch.randn(_MLP_BATCH, _MLP_WIDTH)

    def make() -> Callable[[bool], None]:
        model = _MLP()
        compiled = torch.compile(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step(in_mode: bool) -> None:
            with portable_random() if in_mode else contextlib.nullcontext():
                compiled(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        return step

    def first_call(in_mode: bool) -> float:
        torch._dynamo.reset()
        step = make()
        with inductor.patch(force_disable_caches=True), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that its caches are off, which is the point
            start = time.perf_counter()
            step(in_mode)
            return time.perf_counter() - start

    compile_rounds = {"base": [], "ours": []}  # type: dict[str, list[float]]
    first_call(False)  # untimed: a process's first compile also pays one-time imports and set-up (5x a compile)
    for _ in range(compiles):
        compile_rounds["base"].append(first_call(False))
        compile_rounds["ours"].append(first_call(True))
    torch._dynamo.reset()
    step = make()
    t = interleaved({"base": lambda: step(False), "ours": lambda: step(True)}, number=5, rounds=max(3 * repeat, 15))
    shape = f"MLP {_MLP_WIDTH}x{_MLP_WIDTH}x3 with dropout {_MLP_DROPOUT}, batch {_MLP_BATCH}"
    return [
        BenchResult(
            name="portable mode compiled training step, 1 thread",
            timing=t["ours"],
            baseline="the same compiled step, native",
            baseline_timing=t["base"],
            target=_COMPILED_STEP_TARGET,
            note=f"{shape}, torch.compile (inductor), forward+backward+SGD; portable_random() around every step",
        ),
        BenchResult(
            name="compile time in portable mode, 1 thread",
            timing=Timing(tuple(compile_rounds["ours"])),
            baseline="the same compile outside the mode",
            baseline_timing=Timing(tuple(compile_rounds["base"])),
            target=_COMPILE_TIME_TARGET,
            note=f"{shape}: the first compiled step (Dynamo, AOTAutograd, inductor), caches off, "
            f"{compiles} round(s) each after an untimed one",
        ),
    ]


def _fixed_costs(repeat: int) -> list[BenchResult]:
    """What entering the mode and a small op inside it cost, against a tracker fork and the op outside."""
    tracker = RNGStatesTracker()
    tracker.add("bench", 1234)

    def fork() -> None:
        with tracker.fork("bench"):
            pass

    def enter_exit() -> None:
        with portable_random():
            pass

    def enter_exit_seeded() -> None:
        with portable_random(_KEY):
            pass

    rounds = max(3 * repeat, 15)
    t = interleaved({"fork": fork, "plain": enter_exit, "seeded": enter_exit_seeded}, number=2_000, rounds=rounds)
    rows = [
        BenchResult(
            f"portable_random({arg}) enter+exit",
            t[name],
            "tracker.fork() enter+exit",
            t["fork"],
            target=_FIXED_TARGET,
            note="1 thread; the seeded form saves the generator's state and restores it on exit",
        )
        for name, arg in (("plain", ""), ("seeded", "seed"))
    ]
    x = torch.randn(*_SMALL_DROPOUT)

    def small_dropout() -> object:
        return F.dropout(x, _DROPOUT_P)

    outside, inside = _in_and_out(small_dropout, number=500, rounds=rounds)
    shape = "x".join(map(str, _SMALL_DROPOUT))
    rows.append(
        BenchResult(
            f"F.dropout {shape} in portable mode",
            inside,
            "the same call outside the mode",
            outside,
            target=_FIXED_TARGET,
            note="1 thread; the mode entered once per round, so consecutive draws advance one position",
        )
    )
    return rows


def _attention(repeat: int) -> BenchResult:
    """SDPA with dropout, forward and backward, in portable mode against torch's (its math path on the CPU)."""
    from hyperrng.cli.bench.gpu import attention_step

    batch, heads, length, head_dim = _ATTENTION_SHAPE
    native, portable = attention_step(torch.device("cpu"), batch, heads, length, head_dim, causal=False)
    t = interleaved({"base": native, "ours": portable}, number=1, rounds=max(repeat, 5))
    return BenchResult(
        f"portable SDPA fwd+bwd, L=S={length}, 1 thread",
        t["ours"],
        "F.scaled_dot_product_attention, same dropout",
        t["base"],
        target=_ATTENTION_TARGET,
        note=f"batch {batch}, {heads} heads, head dim {head_dim}, bf16, dropout 0.1, CPU (torch's math path)",
    )


def _in_and_out(fn: Callable[[], object], *, number: int, rounds: int) -> tuple[Timing, Timing]:
    """``fn`` outside portable mode and inside it (entered once per round), in interleaved rounds."""
    fn()
    with portable_random(_KEY):
        fn()
    out_rounds: list[float] = []
    in_rounds: list[float] = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        out_rounds.append((time.perf_counter() - start) / number)
        with portable_random(_KEY):
            start = time.perf_counter()
            for _ in range(number):
                fn()
            in_rounds.append((time.perf_counter() - start) / number)
    return Timing(tuple(out_rounds)), Timing(tuple(in_rounds))


def _outside_rounds(rounds: int, number: int) -> dict[str, dict[str, list[float]]]:
    """Per op: seconds per call before and after the portable kernels are registered (this process)."""
    from hyperrng.portable.mode import registered

    if registered():
        raise RuntimeError("the portable kernels are registered already: run this in a fresh process")
    x = torch.ones(16)
    calls: dict[str, Callable[[], object]] = {
        "torch.rand(64)": lambda: torch.rand(64),
        "F.dropout(16 elements)": lambda: F.dropout(x, 0.5),
    }
    before = interleaved(calls, number=number, rounds=rounds)
    with portable_random():
        pass
    after = interleaved(calls, number=number, rounds=rounds)
    return {name: {"before": list(before[name].rounds), "after": list(after[name].rounds)} for name in calls}


def _outside_the_mode(repeat: int) -> list[BenchResult]:
    code = (
        "import json, torch; torch.set_num_threads(1); from hyperrng.cli.bench.philox import _outside_rounds; "
        f"print(json.dumps(_outside_rounds({max(repeat, 5)}, 2000)))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    measured = json.loads(run.stdout.splitlines()[-1])
    return [
        BenchResult(
            name=f"{name} outside portable mode",
            timing=Timing(tuple(rounds["after"])),
            baseline="the same before registration",
            baseline_timing=Timing(tuple(rounds["before"])),
            target=_OUTSIDE_TARGET,
            note="a thread not in the mode, once the portable kernels are registered (on a key only threads in "
            "the mode include: no Python on the way); fresh process, 1 thread, rounds before then after",
        )
        for name, rounds in measured.items()
    ]


def _in_mode(fn: Callable[[], object], compiled: bool) -> Callable[[], object]:
    def run() -> object:
        with portable_random(_KEY, compiled=compiled):
            return fn()

    return run
