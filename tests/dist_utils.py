"""Run a function on N gloo processes (spawned), collect every rank's result. Shared by the distributed tests; the
helper itself is ``hf_asyncpp.testing`` (the benchmarks in ``bench/`` use it too)."""
from __future__ import annotations

from hf_asyncpp.testing import free_port, run_workers

__all__ = ["free_port", "run_distributed"]


def run_distributed(fn, world: int, *args):
    """Returns the list of per-rank results; raises RuntimeError (``WorkerError``) with the ranks' tracebacks on
    failure."""
    return run_workers(fn, world, *args)
