"""The ``hyperrng`` command line: ``demo``, ``info`` and ``bench``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

__all__ = ["main"]


def _dist_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def info_lines() -> list[str]:
    """The report of ``hyperrng info``: which platform runs, why, and what every probe said."""
    import os

    import torch

    import hyperrng
    import platforms

    sel = platforms.selection()
    p = sel.platform
    lines = [
        f"hyperrng {hyperrng.__version__}  (python {sys.version.split()[0]})",
        f"torch {torch.__version__}; torch_npu {_dist_version('torch_npu')}",
        f"{platforms.ENV_VAR}={os.environ.get(platforms.ENV_VAR, '')!r}",
        f"platform: {p.name}  (device type {p.device_type!r}, backend {p.dist_backend!r}, "
        f"{'counter-based' if p.counter_based else 'modelled offsets'})",
        f"chosen because: {sel.reason}",
    ]
    try:
        lines.append(f"devices: {p.device_count()}")
    except Exception as exc:
        lines.append(f"devices: unknown ({type(exc).__name__}: {exc})")
    lines.append("probes:")
    for probe in sel.probes:
        mark = "available" if probe.available else "unavailable"
        detail = f" - {probe.reason}" if probe.reason else ""
        lines.append(f"  {probe.name:<8} [{probe.source}] {mark}{detail}")
    lines.append(f"registered platforms: {', '.join(platforms.registered())}")
    return lines


def _cmd_info(args: argparse.Namespace) -> int:
    print("\n".join(info_lines()))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from hyperrng.benchmarks import format_results, run_benchmarks

    results = run_benchmarks(quick=args.quick, suites=args.suite or None)
    print(format_results(results))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from hyperrng.demo import DemoConfig, main

    cfg = DemoConfig(world_size=args.world_size, tp=args.tp, steps=args.steps, save_step=args.save_step, seed=args.seed)
    return main(cfg)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hyperrng", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="train a tiny TP model on N processes and prove every RNG property, resume included"
    )
    demo.add_argument("--world-size", type=int, default=None, help="processes to start (default 4)")
    demo.add_argument("--tp", type=int, default=2, help="tensor-parallel size; must divide the world size")
    demo.add_argument("--steps", type=int, default=4, help="training steps (default 4)")
    demo.add_argument("--save-step", type=int, default=2, help="step after which the RNG checkpoint is saved")
    demo.add_argument("--seed", type=int, default=1234, help="base seed of the stream layout")
    demo.set_defaults(func=_cmd_demo)
    info = sub.add_parser("info", help="which platform runs and why; every probe's result")
    info.set_defaults(func=_cmd_info)
    bench = sub.add_parser("bench", help="benchmarks, as ratios against baselines measured in the same run")
    bench.add_argument("--quick", action="store_true", help="small sizes and few repeats (for CI)")
    bench.add_argument("--suite", action="append", help="run only this suite (repeatable)")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hyperrng`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except Exception as exc:
        from hyperrng.errors import HyperRNGError

        if not isinstance(exc, HyperRNGError):
            raise
        print(f"hyperrng: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
