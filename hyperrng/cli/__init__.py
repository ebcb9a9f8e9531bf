"""The ``hyperrng`` command line: ``demo``, ``info`` and ``bench``.

A mistake (a bad flag, a seed out of range, a platform that cannot be selected, a rank
that fails) is answered with one line on stderr and an exit status, never a traceback:
2 for a command line or configuration that cannot run (a ``HYPERRNG_PLATFORM`` that
selects nothing included), 1 for a run that failed. Output is written line by line as
the work proceeds; a reader that goes away (``hyperrng info | head -1``) ends the command
quietly with status 141, as a closed pipe ends other command-line tools.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, entry_points, version
from typing import NoReturn

import torch

import hyperrng
import hyperrng.platforms as platforms
from hyperrng.errors import HyperRNGError, PlatformError
from hyperrng.platforms import _features

__all__ = ["main", "info_lines"]

_EXIT_USAGE = 2
_EXIT_INTERRUPTED = 130  # what shells report for a process ended by Ctrl-C (128 + SIGINT)
_EXIT_CLOSED_PIPE = 141  # what shells report for a process ended by writing to a closed pipe (128 + SIGPIPE)
_BUILTIN_PLATFORMS = ("cpu", "cuda", "npu", "sim")


def _dist_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _version() -> str:
    return f"hyperrng {hyperrng.__version__} (torch {torch.__version__}, python {sys.version.split()[0]})"


def _known_platforms() -> list[tuple[str, str]]:
    """Every platform that can be named: ``(name, source)`` for built-ins, registrations and entry points."""
    names = {name: "builtin" if name in _BUILTIN_PLATFORMS else "registered" for name in platforms.registered()}
    for ep in sorted(entry_points(group=platforms.ENTRY_POINT_GROUP), key=lambda ep: ep.name):
        names.setdefault(ep.name, f"plugin {ep.value}")  # a registration, or the first of two plug-ins, wins
    return list(names.items())


def _availability(name: str) -> str:
    """``available``, or ``unavailable - <why>``, for the platform ``name`` (built and probed, not selected)."""
    try:
        platforms.load(name)
    except PlatformError as exc:
        reason = str(exc).removeprefix(f"platform {name!r} is not available: ")
        return f"unavailable - {reason.removeprefix(f'plug-in platform {name!r} ')}"
    except Exception as exc:  # a plug-in's entry point that fails to import is a finding, not a crash
        return f"unavailable - failed to load: {type(exc).__name__}: {exc}"
    return "available"


def info_lines() -> list[str]:
    """The report of ``hyperrng info``: which platform runs and why, every probe, every known platform.

    When no platform can be selected (a bad ``HYPERRNG_PLATFORM``, two plug-ins claiming
    the machine) the report says why in place of the platform; it never raises for that.
    """
    lines = [
        f"hyperrng {hyperrng.__version__}  (python {sys.version.split()[0]})",
        f"torch {torch.__version__}; torch_npu {_dist_version('torch_npu')}",
        f"{platforms.ENV_VAR}={os.environ[platforms.ENV_VAR]!r}"
        if platforms.ENV_VAR in os.environ
        else f"{platforms.ENV_VAR} not set",
    ]
    try:
        sel = platforms.selection()
    except PlatformError as exc:
        lines += ["platform: none", f"error: {exc}"]
    else:
        p = sel.platform
        lines += [
            f"platform: {p.name}  (device type {p.device_type!r}, backend {p.dist_backend!r}, "
            f"{'counter-based' if p.counter_based else 'modelled offsets'})",
            f"chosen because: {sel.reason}",
        ]
        try:
            lines.append(f"devices: {p.device_count()}")
        except Exception as exc:
            lines.append(f"devices: unknown ({type(exc).__name__}: {exc})")
        lines.append(_philox_backend_line(p))
        lines.append(_host_words_line())
        lines.append("probes:")
        for probe in sel.probes:
            mark = "available" if probe.available else "unavailable"
            detail = f" - {probe.reason}" if probe.reason else ""
            lines.append(f"  {probe.name:<8} [{probe.source}] {mark}{detail}")
    lines += _features.report_lines()
    lines.append(
        "cpu positions: MT19937 seeded from all 64 bits of a position's handle"
        if platforms.seeds_all_64_bits()
        else "cpu positions: MT19937 seeded from 32 bits (this torch's CPU state layout is not recognised): "
        "two positions share a stream with probability 2**-32"
    )
    lines.append("known platforms (built-in, registered, plug-ins):")
    lines += [f"  {name:<8} [{source}] {_availability(name)}" for name, source in _known_platforms()]
    return lines


def _philox_backend_line(p: platforms.Platform) -> str:
    """Which Philox backend draws portable numbers on the platform's device, and why."""
    from hyperrng.philox import backends

    try:
        device = p.device()
        name, why = backends.describe(device)
    except Exception as exc:  # a device that cannot be reached: say so, the rest of the report stands
        return f"philox backend: unknown ({type(exc).__name__}: {exc})"
    return f"philox backend on {device}: {name} ({why})"


def _host_words_line() -> str:
    """What computes the Philox words of small portable draws on the host CPU."""
    from hyperrng.philox import _torch

    if _torch.HOST_WORDS == "compiled":
        return "philox words on the host: compiled (hyperrng.philox._cphilox, built at install)"
    return (
        "philox words on the host: numpy (the optional compiled loop was not built: no C compiler at "
        "install); small portable CPU draws cost more"
    )


_WIDTH = 100
"""Columns every line a command prints fits in (the demo's report and the bench's table are laid out for it)."""


def _fit(line: str) -> list[str]:
    """``line`` as lines of at most :data:`_WIDTH` columns: a longer one (a probe's reason, a
    rank's error) wraps at spaces, its continuations indented four past its own indent."""
    if len(line) <= _WIDTH:
        return [line]
    indent = " " * (len(line) - len(line.lstrip()) + 4)
    return textwrap.wrap(line, _WIDTH, subsequent_indent=indent, break_on_hyphens=False)


class _Lines:
    """Writes lines to a stream, each flushed at once and fitted to :data:`_WIDTH` columns,
    from any thread; a reader that went away (a closed pipe) silences the rest instead of raising."""

    def __init__(self, stream: str = "stdout") -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self.closed = False
        self.last = time.monotonic()  # when a line was last written

    def __call__(self, *lines: str, fit: bool = True) -> None:
        """Write each line; ``fit=False`` writes them whole (Markdown table rows, meant to be pasted)."""
        with self._lock:
            self.last = time.monotonic()
            if self.closed:
                return
            try:
                for line in lines:
                    for part in _fit(line) if fit else [line]:
                        print(part, file=getattr(sys, self._stream), flush=True)
            except BrokenPipeError:
                self.close()

    def close(self) -> None:
        """Stop writing, and point the stream at the null device so that nothing flushed at exit fails."""
        self.closed = True
        try:
            fd = getattr(sys, self._stream).fileno()
        except (AttributeError, OSError, ValueError):  # a stream without a file descriptor (a test's capture)
            return
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)


def _cmd_info(args: argparse.Namespace, out: _Lines) -> int:
    """The report, every probe included, also where no platform can be selected (the report says why
    in place of the platform, the error line follows on stderr and the status is 2)."""
    out(*info_lines())
    platforms.selection()
    return 0


_QUIET_S = 20.0
"""Longest a running benchmark stays silent: past it, a line says that it is still measuring."""


class _Heartbeat:
    """While its block runs, a line ``... still measuring: <doing>`` whenever ``out`` has been quiet for ``every`` s."""

    def __init__(self, out: _Lines, every: float = _QUIET_S) -> None:
        self._out, self._every = out, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hyperrng-bench-heartbeat", daemon=True)
        self._start = time.monotonic()
        self.doing = ""

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(min(self._every, 1.0)):
            if time.monotonic() - self._out.last >= self._every:
                elapsed = time.monotonic() - self._start
                self._out(f"      ... still measuring: {self.doing} ({elapsed:.0f} s into the run)")


def _cmd_bench(args: argparse.Namespace, out: _Lines) -> int:
    from hyperrng.cli import bench as b

    suites = b.check_suites(args.suite)
    # With --markdown, stdout carries the table alone (to paste or redirect); progress goes to stderr.
    progress = _Lines("stderr") if args.markdown else out
    header = b.header_lines(args.quick)
    progress(*header, "", *b.column_titles())
    rows = itertools.count(1)

    with _Heartbeat(progress) as heartbeat:

        def on_result(result: b.BenchResult) -> None:
            index = next(rows)
            heartbeat.doing = f"the row after #{index}"
            progress(*b.format_row(index, result))

        def on_suite(i: int, n: int, name: str) -> None:
            heartbeat.doing = f"suite {name}"
            progress(*b.suite_lines(i, n, name))

        def on_progress(text: str) -> None:
            heartbeat.doing = text
            progress(f"      ... {text}")

        start = time.monotonic()
        results = b.run_benchmarks(
            quick=args.quick, suites=suites, on_suite=on_suite, on_result=on_result, on_progress=on_progress
        )
    progress("", *b.summary_lines(results, time.monotonic() - start))
    if args.markdown:
        out(*b.format_markdown(results, header[:2]).splitlines(), fit=False)
    return 0


def _cmd_demo(args: argparse.Namespace, out: _Lines) -> int:
    import torch.distributed as dist

    from hyperrng.cli.demo import DemoConfig
    from hyperrng.cli.demo import main as demo_main

    flags = ("world_size", "tp", "steps", "save_step", "seed", "portable")  # each flag's dest is its field's name
    status = demo_main(DemoConfig(**{name: getattr(args, name) for name in flags}), out=out)
    if dist.is_available() and dist.is_initialized():
        _leave_job(status)
    return status


def _leave_job(status: int) -> NoReturn:
    """End a process that joined a torchrun job for the demo, once its output is flushed.

    The demo's process group stays up when the demo returns (every collective has completed
    on every rank by then), and neither way of taking it down is safe: at interpreter exit,
    gloo's worker threads are destroyed while joinable and the process aborts ("terminate
    called without an active exception": 4 of 16 runs of a two-rank job on torch 2.13), and
    ``destroy_process_group`` can deadlock on torch 2.5 (its destructor holds the GIL while
    a worker needs it). The ranks :mod:`hyperrng.cli.launch` starts end the same way.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose complaints are one line on stderr (argparse adds a usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(_EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _CommandParser(_Parser):
    """The parser of one subcommand: it refuses the arguments it does not know itself, so the
    complaint names the subcommand (``hyperrng demo: error: ...``), not ``hyperrng``."""

    def parse_known_args(  # type: ignore[override]  # argparse's stub overloads it
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


_PLATFORM_NOTE = (
    f"The platform: {platforms.ENV_VAR}=cpu, cuda, npu, sim or package.module:Factory chooses it; without it, an "
    "installed plug-in, else NPU, CUDA, CPU (hyperrng info says which and why). Exit status: 0 success, 1 a run "
    "that failed, 2 a command line or configuration that cannot run (one line on stderr)."
)


def _parser() -> argparse.ArgumentParser:
    from hyperrng.cli.bench import SUITES
    from hyperrng.cli.demo import DEFAULT_WORLD_SIZE, MAX_LOCAL_RANKS, PORTABLE_MAX_RANKS, DemoConfig

    parser = _Parser(
        prog="hyperrng",
        description="Random-number state across devices and ranks for PyTorch training: named streams, "
        "collision-free seeding, sharded-tensor offsets, cross-rank checks, exact-resume checkpoints. "
        "'hyperrng demo' proves every property on real processes, 'hyperrng info' says which platform runs "
        "and why, 'hyperrng bench' measures costs against baselines of the same run.",
        epilog=_PLATFORM_NOTE,
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    demo = sub.add_parser(
        "demo",
        help="train a tiny TP model on N processes and prove every RNG property, resume included",
        description="Train a tiny tensor-parallel model with dropout on --world-size processes (or join the "
        "torchrun job it runs in), run a sharded random op, check the streams across ranks, save an RNG "
        "checkpoint and resume from it in fresh processes; print one [PASS] or [FAIL] line per property. "
        f"The ranks run on the current platform: {platforms.ENV_VAR}=sim runs the accelerator code paths on "
        "the simulated device, without a GPU.",
        epilog=_PLATFORM_NOTE,
    )
    int_options = (  # flag, default, help
        (
            "--world-size",
            None,
            f"processes to start (default {DEFAULT_WORLD_SIZE}, at most {MAX_LOCAL_RANKS}); under torchrun, "
            "the job's size (run a larger job there)",
        ),
        ("--tp", DemoConfig.tp, "tensor-parallel size; must divide the world size (default %(default)s)"),
        ("--steps", DemoConfig.steps, "training steps; at least 2 (default %(default)s)"),
        (
            "--save-step",
            DemoConfig.save_step,
            "step after which the RNG checkpoint is saved; in [1, --steps - 1] (default %(default)s)",
        ),
        ("--seed", DemoConfig.seed, "base seed of the stream layout, in [0, 2**64 - 1] (default %(default)s)"),
    )
    for flag, default, text in int_options:
        demo.add_argument(flag, type=int, default=default, help=text)
    demo.add_argument(
        "--portable",
        action="store_true",
        help="also train under portable mode at every TP size dividing the world size and check that "
        f"initial parameters and dropout masks are bit-identical (off by default; a world size of at most "
        f"{PORTABLE_MAX_RANKS}, outside torchrun)",
    )
    demo.set_defaults(func=_cmd_demo)
    info = sub.add_parser(
        "info",
        help="which platform runs and why; every probe's result; every known platform",
        description="Which platform runs and why, every probe's result, the torch features this torch has, and "
        "every platform that can be named.",
        epilog=_PLATFORM_NOTE,
    )
    info.set_defaults(func=_cmd_info)
    bench = sub.add_parser(
        "bench",
        help="benchmarks, as ratios against baselines measured in the same run",
        description="Benchmarks of the current platform, each a ratio against a baseline timed in the same run "
        "(the median of interleaved rounds, with their range). Rows print as they are measured, and a long "
        "measurement says what it measures.",
        epilog=_PLATFORM_NOTE,
    )
    bench.add_argument("--quick", action="store_true", help="small sizes and few repeats, for CI (off by default)")
    bench.add_argument(
        "--suite",
        action="append",
        metavar="NAME",
        help=f"run only this suite, one of: {', '.join(SUITES)} (repeatable; default: every suite)",
    )
    bench.add_argument(
        "--markdown",
        action="store_true",
        help="print the results as a Markdown table on stdout, and the progress on stderr (off by default)",
    )
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hyperrng`` console script and ``python -m hyperrng``; returns the exit status.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        0 on success; 1 when a run fails; 2 for a command line or configuration that
        cannot run (a ``HYPERRNG_PLATFORM`` that selects nothing included, for every
        command); 130 when interrupted; 141 when stdout is a pipe whose reader has gone.
        Bad flags make argparse exit with 2 (``SystemExit``), after one line on stderr.
        ``demo`` inside a torchrun job ends the process with its status instead of returning
        (see ``_leave_job``).
    """
    out = _Lines()
    try:
        status = _run(argv, out)
    except BrokenPipeError:  # argparse's --help and --version print on their own
        out.close()
        return _EXIT_CLOSED_PIPE
    return _EXIT_CLOSED_PIPE if out.closed else status


def _run(argv: Sequence[str] | None, out: _Lines) -> int:
    args = _parser().parse_args(argv)
    prog = f"hyperrng {args.command}"  # every complaint after parsing names the subcommand
    try:
        if args.func is not _cmd_info:  # a platform that cannot be selected: one line for every other command
            platforms.selection()
        return int(args.func(args, out))
    except HyperRNGError as exc:
        print(f"{prog}: error: {_first_line(exc)}", file=sys.stderr)
        return _EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return _EXIT_INTERRUPTED


def _first_line(exc: BaseException) -> str:
    """The error's message as one line (its first non-blank one), or its class name when it has none."""
    return next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
