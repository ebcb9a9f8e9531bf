"""Multi-rank tests run real processes over gloo: see :mod:`hyperrng._launch`."""

from hyperrng._launch import free_port, run_ranks

__all__ = ["run_ranks", "free_port"]
