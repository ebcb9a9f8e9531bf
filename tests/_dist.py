"""Multi-rank tests run real processes over gloo: see :mod:`hyperrng.cli.launch`."""

from hyperrng.cli.launch import free_port, run_ranks

__all__ = ["run_ranks", "free_port"]
