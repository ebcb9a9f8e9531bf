"""What the Triton kernels cost on a GPU, read without one: registers, spills, shared memory, occupancy,
machine instructions per element and store widths of every kernel variant the library launches.

Triton compiles for a GPU architecture on any machine: its compiler and NVIDIA's ``ptxas`` come with
it. :func:`compiling` makes Triton believe a device of the architecture is current (a stand-in
driver that names the target) and sets Triton's compile hook, which compiles each launch for that
target and then tells Triton to skip the launch; so the library's own launch code runs unchanged
(:func:`hyperrng.philox.run` as portable mode calls it, on meta tensors; the fused dropout; the
attention plan and its kernels) and every kernel variant it would launch on a GPU is compiled,
none is run. From each compiled kernel :func:`figures` reads ptxas' resource use
(``ptxas -v`` on its PTX) and its SASS (instructions, local-memory spills, global store widths,
the longest loop).

A draw kernel has no loop: its SASS count divided by the elements a program writes is its cost per
element, compared with :mod:`._reference_kernel`'s (a ``tl.philox`` kernel measured at
``torch.rand``'s speed on an H200). Attention kernels are compared by their inner loop. These are
static counts: they predict, a GPU measures (``hyperrng bench --suite gpu``).

Run ``python -m hyperrng.cli.bench.kernel_report`` (or ``.ci/kernel-report``); ``--check`` exits 1
where a figure misses :data:`TARGETS` (CI runs the same check through the test suite).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ARCHS", "TARGETS", "Figures", "Variant", "check", "compiling", "figures", "main", "report", "variants"]

ARCHS = (90, 80)
"""The architectures reported by default: Hopper (H100, H200) and Ampere (A100)."""

_ELEMENTS = 1 << 21  # a draw big enough for full programs (2,048 elements each)
_KEY = 0x5EED_0000_0001
_REFERENCE = "reference"
_SM = {  # per multiprocessor: registers, warps, CTAs, shared memory (bytes)
    80: (65536, 64, 32, 164 * 1024),
    90: (65536, 64, 32, 228 * 1024),
}


@dataclass(frozen=True)
class Figures:
    """One compiled kernel variant on one architecture, as ptxas built it."""

    arch: int
    variant: str
    kernel: str
    warps: int
    registers: int
    stack_bytes: int  # a thread's stack frame (spilled registers, and local arrays such as sin's slow path)
    spill_stores: int  # bytes of registers a thread spills, as ptxas counts them
    spill_loads: int  # bytes it loads back
    shared_bytes: int
    instructions: int  # SASS instructions of the whole kernel
    loop: int  # SASS instructions of its longest loop (0: none)
    elements: int  # elements one program writes (draw kernels), else 0
    stores: tuple[tuple[int, int], ...]  # (bits, count) of the global stores

    @property
    def per_element(self) -> float | None:
        return self.instructions / self.elements if self.elements else None

    @property
    def ctas_per_sm(self) -> int:
        """Blocks one multiprocessor holds at once, by registers (allocated 256 a warp), warps and shared memory."""
        registers, warps, ctas, shared = _SM[self.arch]
        per_warp = -(-self.registers * 32 // 256) * 256
        by_registers = (registers // per_warp) // self.warps if per_warp else ctas
        by_shared = shared // (self.shared_bytes + 1024) if self.shared_bytes else ctas
        return min(by_registers, warps // self.warps, by_shared, ctas)

    @property
    def spills(self) -> bool:
        return bool(self.spill_stores or self.spill_loads)


@dataclass(frozen=True)
class Variant:
    """A call of the library's launch code, named for the report (``launch`` makes the launches)."""

    name: str
    launch: Callable[[], object]


# -- compiling for a target without a device ------------------------------------------------------


class _Target:
    """Triton's driver interface, as far as a launch asks it before compiling: a device of ``arch``."""

    def __init__(self, arch: int) -> None:
        self.arch = arch

    def get_current_device(self) -> int:
        return self.arch  # one compile cache per architecture

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.arch, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cuda")

    def is_active(self) -> bool:
        return True


@contextlib.contextmanager
def compiling(arch: int) -> Iterator[list[tuple[Any, dict[str, Any]]]]:
    """Inside, a Triton launch compiles its kernel for ``sm_<arch>`` and launches nothing; yields the list
    that receives ``(compiled kernel, constexpr arguments by name)`` per launch. The driver and the hook
    are Triton's process-wide settings: nothing else in the process may launch kernels meanwhile.

    Raises:
        RuntimeError: ``TRITON_INTERPRET`` is set (kernels decorated then are interpreted, not compiled).
    """
    import triton
    from triton.runtime import driver

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("the kernel report compiles kernels: unset TRITON_INTERPRET and run it again.")
    got: list[tuple[Any, dict[str, Any]]] = []
    inside = False

    def hook(*, key: Any, repr: str, fn: Any, compile: dict[str, Any], **_: Any) -> bool | None:
        nonlocal inside
        if inside:  # the compile below asks the hook again: let it compile
            return None
        inside = True
        try:
            kernel = fn.jit_function.preload(compile["specialization_data"])
        finally:
            inside = False
        # preload cached the kernel: a second launch of it would find it there and run it
        cache = fn.jit_function.device_caches[compile["device"]][0]
        for cached in [k for k, v in cache.items() if v is kernel]:
            del cache[cached]
        names = fn.jit_function.arg_names
        constants = {names[path[0]]: value for path, value in compile["constants"].items() if len(path) == 1}
        got.append((kernel, constants))
        return True  # compiled: skip the launch

    previous = getattr(driver, "_active", None)  # Triton has no getter that does not create a driver
    before = triton.knobs.runtime.jit_cache_hook
    driver.set_active(_Target(arch))
    triton.knobs.runtime.jit_cache_hook = hook
    try:
        yield got
    finally:
        triton.knobs.runtime.jit_cache_hook = before
        driver.set_active(previous)


def _ptxas(kernel: Any, arch: int) -> dict[str, int]:
    """ptxas' own account of ``kernel``'s PTX for ``sm_<arch>`` (``ptxas -v``, the options Triton compiled
    it with): registers, stack frame and spilled bytes a thread. ptxas runs a second time: Triton keeps no
    log of its own run, and a cubin records no spills."""
    import triton

    fmad = "--fmad=true" if kernel.metadata.enable_fp_fusion else "--fmad=false"
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w", encoding="utf-8") as f:
            f.write(kernel.asm["ptx"])
        command = [triton.knobs.nvidia.ptxas.path, "-v", fmad, f"--gpu-name=sm_{arch}{'a' if arch >= 90 else ''}"]
        log = subprocess.run(
            [*command, source, "-o", os.path.join(folder, "kernel.cubin")], capture_output=True, text=True, check=True
        ).stderr
    figures = {"registers": r"Used (\d+) registers", "stack": r"(\d+) bytes stack frame",
               "spill_stores": r"(\d+) bytes spill stores", "spill_loads": r"(\d+) bytes spill loads"}  # fmt: skip
    return {name: int(m.group(1)) if (m := re.search(pattern, log)) else 0 for name, pattern in figures.items()}


_STORE_BITS = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128}
_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;", re.IGNORECASE)


def _sass(cubin: bytes) -> list[tuple[int, str]]:
    """``(address, instruction)`` of every SASS instruction in ``cubin`` but the padding ``NOP``s, from
    ``cuobjdump -sass`` (Triton's own listing stops at address 0xffff: the longest kernels lose their end)."""
    import triton

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        listing = subprocess.run(
            [triton.knobs.nvidia.cuobjdump.path, "-sass", path], capture_output=True, text=True, check=True
        ).stdout
    found = [(int(m.group(1), 16), m.group(2)) for m in map(_SASS_LINE.match, listing.splitlines()) if m]
    return [(address, text) for address, text in found if text != "NOP"]


def _opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P[T\d]+\s+", "", instruction).split()[0]


def _longest_loop(sass: list[tuple[int, str]]) -> int:
    """Instructions from a backward branch's target to the branch, for the longest such span (0: no loop)."""
    longest = 0
    for address, text in sass:
        branch = re.search(r"\bBRA\s+(?:\S+\s+)?0x([0-9a-f]+)$", text, re.IGNORECASE)
        if branch and int(branch.group(1), 16) < address:
            target = int(branch.group(1), 16)
            longest = max(longest, sum(target <= a <= address for a, _ in sass))
    return longest


def figures(arch: int, variant: str, kernel: Any, constants: dict[str, Any]) -> Figures:
    """What ptxas made of ``kernel`` (a Triton compiled kernel for ``sm_<arch>``), launched as ``variant``."""
    sass = _sass(kernel.asm["cubin"])
    ops = [_opcode(text) for _, text in sass]
    resources = _ptxas(kernel, arch)
    widths: dict[int, int] = {}
    for op in ops:
        if op.startswith("STG"):
            suffix = op.split(".")[-1]
            bits = _STORE_BITS.get(suffix, 32)
            widths[bits] = widths.get(bits, 0) + 1
    block = constants.get("BLOCK")
    return Figures(
        arch=arch,
        variant=variant,
        kernel=kernel.name,
        warps=kernel.metadata.num_warps,
        registers=resources["registers"],
        stack_bytes=resources["stack"],
        spill_stores=resources["spill_stores"],
        spill_loads=resources["spill_loads"],
        shared_bytes=kernel.metadata.shared,
        instructions=len(ops),
        loop=_longest_loop(sass),
        elements=4 * int(block) if kernel.name in ("draw_kernel", "uniform_kernel") and block else 0,
        stores=tuple(sorted(widths.items(), reverse=True)),
    )


# -- what the library launches --------------------------------------------------------------------


def _draw(draw: Any, shape: tuple[int, ...], shard: Any = None, out: Callable[[], torch.Tensor] | None = None) -> Any:
    from hyperrng import philox
    from hyperrng.philox import _shards

    def launch() -> object:
        geometry = _shards.ShardGeometry.of(shape, shard)
        target = None if out is None else out()
        return philox.run(draw, geometry, _KEY, 0, torch.device("meta"), False, target, "triton")

    return launch


def _dropout(dtype: torch.dtype, with_mask: bool) -> Callable[[], object]:
    from hyperrng import philox
    from hyperrng.philox import _shards, _triton

    def launch() -> object:
        x = torch.empty(_ELEMENTS, dtype=dtype, device="meta")
        mask = torch.empty(_ELEMENTS, dtype=torch.bool, device="meta") if with_mask else None
        draw = philox.dropout_draw(0.1, dtype)
        args = draw.kernel_arguments
        return _triton.fill(args, _shards.ShardGeometry.of(x.shape), _KEY, 0, torch.empty_like(x), x, mask)

    return launch


def _reference() -> object:
    from hyperrng.philox import _triton

    module = _triton.load("hyperrng.cli.bench._reference_kernel", False)
    out = torch.empty(_ELEMENTS, dtype=torch.float32, device="meta")
    return module.uniform_kernel[(_ELEMENTS // 2048,)](out, _ELEMENTS, _KEY, BLOCK=512, num_warps=4)


def _attention(dtype: torch.dtype, head_dim: int, dropout: bool, causal: bool, offset: int = 0) -> Callable[[], object]:
    """Forward and backward of one attention problem, through the plan the public function makes; the
    kernels module swapped for the compiled one (the tensors are CPU tensors, whose plan would interpret)."""
    from hyperrng.philox import _triton, attention

    def launch() -> object:
        q, k, v = (torch.zeros(1, 2, 256, head_dim, dtype=dtype) for _ in range(3))
        plan, mask = attention._plan(
            q, k, v, None, 0.1 if dropout else 0.0, causal, None, False, _KEY, offset, None, None, "triton"
        )
        compiled = _triton.load(attention._KERNELS, False)
        plan = dataclasses.replace(plan, kernels=compiled, interpret=False)
        out, lse = attention._triton_forward(plan, q, k, v, mask)
        out = torch.zeros_like(q) if out is None else out
        lse = torch.zeros(q.shape[:-1], dtype=torch.float32) if lse is None else lse
        return attention._triton_backward(plan, q, k, v, mask, out, lse, torch.zeros_like(q))

    return launch


def variants(quick: bool = False) -> list[Variant]:
    """The kernel variants the library launches, each as the call that launches it (``quick``: the few
    that the targets name)."""
    from hyperrng import philox

    f32, bf16 = torch.float32, torch.bfloat16
    n = (_ELEMENTS,)
    found = [
        Variant(_REFERENCE, _reference),
        Variant("uniform f32", _draw(philox.uniform_draw(f32, 0.0, 1.0), n)),
        Variant("bernoulli f32", _draw(philox.bernoulli_draw(0.5, f32), n)),
        Variant("dropout f32", _dropout(f32, False)),
        Variant("dropout+mask bf16", _dropout(bf16, True)),
        Variant("normal f32", _draw(philox.normal_draw(f32, 0.0, 1.0), n)),
        Variant("randint int64 [0,1000)", _draw(philox.randint_draw(0, 1000), n)),
        Variant("attention bf16 d64", _attention(bf16, 64, False, False)),
        Variant("attention bf16 d64 dropout", _attention(bf16, 64, True, False)),
        Variant("attention bf16 d64 dropout causal", _attention(bf16, 64, True, True)),
        Variant("attention f32 d128", _attention(f32, 128, False, False)),
        Variant("attention f32 d128 dropout causal", _attention(f32, 128, True, True)),
    ]
    if quick:
        return found
    found += [
        Variant("random_bits int64", _draw(philox.BITS, n)),
        Variant("uniform bf16", _draw(philox.uniform_draw(bf16, 0.0, 1.0), n)),
        Variant("uniform f64", _draw(philox.uniform_draw(torch.float64, 0.0, 1.0), n)),
        Variant("uniform f32 transposed", _draw(philox.uniform_draw(f32, 0.0, 1.0), (1024, 2048),
                                                out=lambda: torch.empty(2048, 1024, device="meta").t())),
        Variant("uniform f32 shard of rows", _draw(philox.uniform_draw(f32, 0.0, 1.0), (4096, 1024),
                                                   shard=(slice(None), slice(256, 768)))),
        Variant("bernoulli bool", _draw(philox.bernoulli_draw(0.5), n)),
        Variant("dropout bf16", _dropout(bf16, False)),
        Variant("dropout+mask f32", _dropout(f32, True)),
        Variant("normal bf16", _draw(philox.normal_draw(bf16, 0.0, 1.0), n)),
        Variant("normal f64", _draw(philox.normal_draw(torch.float64, 0.0, 1.0), n)),
        Variant("randint int32 [-5,2**31)", _draw(philox.randint_draw(-5, 2**31, torch.int32), n)),
    ]  # fmt: skip
    for dtype in (bf16, torch.float16, f32):
        for head_dim in (64, 128):
            for dropout in (False, True):
                for causal in (False, True):
                    name = f"attention {_short(dtype)} d{head_dim}{' dropout' if dropout else ''}"
                    name += " causal" if causal else ""
                    if name not in {variant.name for variant in found}:
                        found.append(Variant(name, _attention(dtype, head_dim, dropout, causal)))
    found.append(Variant("attention bf16 d64 dropout unaligned", _attention(bf16, 64, True, False, offset=1)))
    return found


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64"}[dtype]


def report(
    archs: Sequence[int] = ARCHS, quick: bool = False, on_figures: Callable[[Figures], None] | None = None
) -> list[Figures]:
    """Compile every variant (:func:`variants`) for each architecture; the figures of every kernel launched."""
    found: list[Figures] = []
    for arch in archs:
        for variant in variants(quick):
            with compiling(arch) as got:
                variant.launch()
            for kernel, constants in got:
                result = figures(arch, variant.name, kernel, constants)
                found.append(result)
                if on_figures is not None:
                    on_figures(result)
    return found


# -- targets ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A bound on one figure of the kernels of the variants named ``variant``, on the architectures ``archs``."""

    variant: str
    kernel: str  # the kernel's name, or "" for every kernel of the variant
    what: str  # "per element vs reference", "loop", "ctas"
    bound: float
    why: str
    archs: tuple[int, ...] = ARCHS  # where it holds (attention's tiles are set for sm_90)

    def check(self, result: Figures, reference: Figures | None) -> str | None:
        """Why ``result`` misses this target, or ``None``."""
        if self.what == "per element vs reference":
            if reference is None or result.per_element is None or reference.per_element is None:
                return None
            ratio = result.per_element / reference.per_element
            if ratio > self.bound:
                return f"{ratio:.2f}x the reference's instructions per element, over {self.bound:g}x ({self.why})"
        elif self.what == "ctas" and result.ctas_per_sm < self.bound:
            return f"{result.ctas_per_sm} CTAs per SM, under {self.bound:g} ({self.why})"
        elif self.what == "instructions per element" and (result.per_element or 0) > self.bound:
            return f"{result.per_element:.3f} instructions per element, over {self.bound:g} ({self.why})"
        elif self.what == "loop" and result.loop > self.bound:
            return f"inner loop {result.loop} instructions, over {self.bound:g} ({self.why})"
        return None


_VS = "per element vs reference"
TARGETS: tuple[Target, ...] = (
    Target("uniform f32", "draw_kernel", _VS, 1.20, "the reference's work plus the offset and length masks"),
    Target("bernoulli f32", "draw_kernel", _VS, 1.20, "a 32-bit compare per word instead of a float conversion"),
    Target("dropout f32", "draw_kernel", _VS, 1.30, "it also reads its input"),
    Target("dropout+mask bf16", "draw_kernel", _VS, 1.80, "it reads its input and writes two outputs"),
    Target("dropout+mask bf16", "draw_kernel", "ctas", 2, "enough warps to hide its loads"),
    Target("normal f32", "draw_kernel", _VS, 3.20, "a log, a square root and one sin/cos reduction a word pair"),
    Target("randint int64 [0,1000)", "draw_kernel", _VS, 1.70, "a 32-bit division by multiplication, 64-bit stores"),
    Target("attention bf16 d64", "_attn_fwd", "loop", 400, "the flash-attention step", (90,)),
    Target("attention bf16 d64", "_attn_fwd", "ctas", 2, "two blocks an SM", (90,)),
    Target("attention bf16 d64 dropout", "_attn_fwd", "loop", 950, "the step plus 8 Philox blocks a thread", (90,)),
    Target("attention bf16 d64 dropout causal", "_attn_fwd", "loop", 1000, "masked: the diagonal's blocks", (90,)),
)
"""The bounds :func:`check` holds the kernels to, besides "no spill anywhere": about the figures of the
kernels when the bounds were set, so that a change that makes a kernel markedly longer fails."""


def check(found: Sequence[Figures]) -> list[str]:
    """Every way ``found`` misses its targets: a spill in any kernel, or a bound of :data:`TARGETS`."""
    problems = []
    references = {r.arch: r for r in found if r.variant == _REFERENCE}
    for r in found:
        if r.spills:
            problems.append(
                f"sm_{r.arch} {r.variant} ({r.kernel}): spills registers "
                f"({r.spill_stores} bytes stored, {r.spill_loads} loaded a thread)"
            )
        for target in TARGETS:
            if target.variant == r.variant and target.kernel in ("", r.kernel) and r.arch in target.archs:
                why = target.check(r, references.get(r.arch))
                if why:
                    problems.append(f"sm_{r.arch} {r.variant} ({r.kernel}): {why}")
    return problems


# -- printing ---------------------------------------------------------------------------------------

_COLUMNS = (
    f"{'variant':<33} {'kernel':<15} {'regs':>4} {'spill':>5} {'smem':>5} {'CTA':>3} {'SASS':>5} {'cost':>11}  stores"
)


def format_row(r: Figures, reference: Figures | None = None) -> str:
    """One kernel: registers, spilled bytes, shared KiB, CTAs per SM, SASS, cost (per element or loop), stores."""
    if r.per_element is not None:
        cost = f"{r.per_element:.3f}/el"
        if reference is not None and reference.per_element and r is not reference:
            cost = f"{r.per_element / reference.per_element:.2f}x ref"
    else:
        cost = f"loop {r.loop}" if r.loop else "-"
    stores = " ".join(f"{bits}x{count}" for bits, count in r.stores) or "-"
    name = r.variant if len(r.variant) <= 33 else r.variant[:30] + "..."
    return (
        f"{name:<33} {r.kernel[:15]:<15} {r.registers:>4} {r.spill_stores:>5} {math.ceil(r.shared_bytes / 1024):>4}K "
        f"{r.ctas_per_sm:>3} {r.instructions:>5} {cost:>11}  {stores}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: print the report, and with ``--check`` exit 1 where a target is missed."""
    parser = argparse.ArgumentParser(
        prog="python -m hyperrng.cli.bench.kernel_report",
        description="Compile every Triton kernel variant hyperrng launches for a GPU architecture (no GPU needed) "
        "and print what ptxas made of it.",
    )
    parser.add_argument("--arch", type=int, action="append", choices=sorted(_SM), help="repeatable; default: 90 and 80")
    parser.add_argument("--quick", action="store_true", help="only the variants the targets name")
    parser.add_argument("--check", action="store_true", help="exit 1 where a kernel spills or misses a target")
    args = parser.parse_args(argv)
    try:
        import triton
    except ImportError:
        print("the kernel report needs Triton: python -m pip install triton", file=sys.stderr)
        return 2
    archs = args.arch or list(ARCHS)
    print(f"hyperrng kernel report: Triton {triton.__version__}, compiled for {', '.join(f'sm_{a}' for a in archs)}")
    print("regs: registers a thread; spill: bytes it spills; smem: shared memory a block; CTA: blocks an SM")
    print("holds; SASS: instructions; cost: SASS per element (x ref: against the tl.philox yardstick) or in")
    print("the longest loop; stores: global stores, bits x count")
    references: dict[int, Figures] = {}
    arch_now = [0]

    def show(r: Figures) -> None:
        if r.arch != arch_now[0]:
            arch_now[0] = r.arch
            print(f"\nsm_{r.arch}\n{_COLUMNS}", flush=True)
        if r.variant == _REFERENCE:
            references[r.arch] = r
        print(format_row(r, references.get(r.arch)), flush=True)

    found = report(archs, args.quick, show)
    problems = check(found)
    print()
    for line in problems:
        print(f"MISSED {line}")
    verdict = f"{len(problems)} missed a target." if problems else "every target met."
    print(f"{len(found)} kernels compiled; {verdict}")
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    sys.exit(main())
