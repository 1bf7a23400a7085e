"""Run a function on N spawned worker processes, each a rank of one process group, and collect what each returns.

The one process-spawn helper of the tests (``tests/dist_utils.py``) and the benchmarks (``bench/``): a free port,
the rendezvous variables, one thread per rank unless told otherwise, every rank's result or the tracebacks of the
ranks that failed, and an optional time limit after which every rank is killed. A time limit here is a hang guard,
set far above the normal time of the work; it is never a judgement of speed.

Nothing in the package imports this module (``tests/test_layout.py`` keeps it on its own floor, above the run and
below the command line): it imports only torch and the standard library.
"""
from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["WorkerError", "free_port", "run_workers", "stage_memory_report"]


class WorkerError(RuntimeError):
    """A rank raised or died; the message holds the traceback of every rank that wrote one (``tracebacks``)."""

    def __init__(self, message: str, tracebacks: list[str] = ()):
        super().__init__(message)
        self.tracebacks = list(tracebacks)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the rendezvous of a process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, args: tuple, out_dir: str, backend: str | None, threads: int,
            env: dict, device: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      OMP_NUM_THREADS=str(threads), HF_EVALUATE_OFFLINE="1", HF_HUB_OFFLINE="1")
    os.environ.update(env)  # before the first CUDA call (CUDA_VISIBLE_DEVICES, LOCAL_RANK)
    torch.set_num_threads(threads)
    try:
        kw = {}
        if device is not None and torch.device(device).type == "cuda":
            torch.cuda.set_device(torch.device(device))
            if backend == "nccl":
                kw["device_id"] = torch.device(device)
        if backend:
            dist.init_process_group(backend, rank=rank, world_size=world, **kw)
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 (the rank's own error, if any, is the one to report)
                pass


def run_workers(fn, world: int, *args, backend: str | None = "gloo", threads: int = 1, env: dict | None = None,
                device: str | None = None, timeout_s: float | None = None, name: str | None = None) -> list:
    """``fn(rank, world, *args)`` on ``world`` spawned processes; the list of what each rank returned, by rank.

    ``fn`` and ``args`` must pickle (a module-level function). Each rank gets ``MASTER_ADDR``/``MASTER_PORT`` (a free
    port), ``RANK``, ``WORLD_SIZE``, ``OMP_NUM_THREADS`` and ``threads`` torch threads, the Hub and ``evaluate``
    offline, then ``env``; it joins a ``backend`` process group (``None``: none) before ``fn`` runs, on ``device``
    when that is a CUDA device. A rank that raises or dies makes this raise ``WorkerError`` with the tracebacks;
    ``timeout_s`` (a hang guard, far above the normal time) kills every rank and raises ``TimeoutError``.
    """
    label = name or getattr(fn, "__name__", "workers")
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_worker, args=(world, free_port(), fn, args, d, backend, threads, dict(env or {}), device),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if deadline is not None and time.monotonic() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    for p in ctx.processes:
                        p.join(10)
                    raise TimeoutError(f"{label}: no result after {timeout_s:.0f}s (killed)")
        except TimeoutError:
            raise
        except Exception as e:
            first = getattr(e, "error_index", None)  # the rank torch saw fail first: its traceback leads
            ranks = sorted((r for r in range(world) if os.path.exists(os.path.join(d, f"rank{r}.err"))),
                           key=lambda r: r != first)
            errs = [open(os.path.join(d, f"rank{r}.err")).read() for r in ranks]
            raise WorkerError("distributed run failed:\n" + ("\n".join(errs) or str(e)), errs) from e
        return [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def stage_memory_report(rank: int, world: int, recipe: dict, steps: int = 3) -> dict:
    """One stage's ``PipelineEngine.memory_report`` after ``steps`` tracked steps of ``recipe`` (a recipe dict, so it
    pickles): a worker for :func:`run_workers` with ``world`` = the recipe's stages. What the planner is checked
    against (``pipeline.memtrack.agreement``)."""
    # imported here: every spawned worker imports this module, most of them for other functions
    from .config.recipe import recipe_from_dict
    from .model.build import build_model
    from .pipeline.executor import PipelineEngine
    from .topology import Topology

    r = recipe_from_dict(recipe)
    torch.manual_seed(0)
    eng = PipelineEngine(r, build_model(r.model), Topology(rank=rank, world_size=world, num_stages=world),
                         log=lambda *a: None)
    p = r.pipeline
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, eng.config.vocab_size, (p.num_microbatches, p.microbatch_size, r.data.seq_len),
                             generator=g) for _ in range(steps)]
    eng.track_memory = True
    eng.train_steps(batches, 0)
    out = eng.memory_report()
    eng.close()
    return out
