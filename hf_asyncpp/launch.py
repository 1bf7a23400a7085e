"""Starting the stage processes when no launcher did, so the documented command just works.

A recipe with p pipeline stages needs p processes. ``accelerate launch`` without a multi-process config (on a
CPU-only machine it starts one process), ``python scripts/pretrain.py`` and ``hf-asyncpp train`` all start one.
Then, rather than stopping, the trainer hands over to ``torch.distributed.run`` (torchrun's own code: rendezvous
on a free local port, one worker per stage, a dead worker ends the others): on CPU with gloo, on a machine with at
least p GPUs with NCCL, and with fewer GPUs than stages with gloo and the stages sharing the GPUs (NCCL refuses two
ranks on one GPU). A process started by a launcher (``WORLD_SIZE`` set: torchrun, ``accelerate launch`` with a
multi-process config, SLURM's srun through them, MPI) is used as it is; ``HF_ASYNCPP_NO_SPAWN=1`` turns the hand-over
off (the trainer then stops with the command to run).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from .config import Recipe
from .shipped import shipped_file

log = logging.getLogger("hf_asyncpp")

NO_SPAWN = "HF_ASYNCPP_NO_SPAWN"
_LAUNCHER_VARS = ("WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def processes_needed(recipe: Recipe) -> int:
    """Processes per pipeline (1 for ``schedule: none``, where num_stages only shapes a simulated delay)."""
    return recipe.pipeline.num_stages if recipe.pipeline.schedule != "none" else 1


def started_by_launcher() -> bool:
    return any(v in os.environ for v in _LAUNCHER_VARS)


def should_spawn(recipe: Recipe) -> bool:
    return processes_needed(recipe) > 1 and not started_by_launcher() and os.environ.get(NO_SPAWN, "0") in ("", "0")


def accelerate_config(n: int) -> Path | None:
    """The shipped accelerate config for n CPU processes (package data), if there is one."""
    path = shipped_file("accelerate_configs", f"cpu-{n}proc.yaml")
    return path if path.is_file() else None


def spawn(recipe: Recipe, argv: list[str]) -> int:
    """Run ``hf_asyncpp.cli.train argv`` on ``processes_needed(recipe)`` local processes; their exit code."""
    n = processes_needed(recipe)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    how = "gloo on CPU"
    if gpus:
        how = f"NCCL on {n} GPUs" if gpus >= n else f"gloo, {n} stages sharing {gpus} GPU{'s' if gpus > 1 else ''}"
        if gpus < n:
            os.environ["ACCELERATE_USE_CPU"] = "1"  # gloo process groups; the stages still compute on the GPU
    print(f"hf_asyncpp: pipeline.num_stages={n} needs {n} processes and 1 was started: starting {n} local processes "
          f"({how}; set {NO_SPAWN}=1 to launch them yourself)", flush=True)
    args = torchrun.get_args_parser().parse_args(
        ["--standalone", f"--nproc_per_node={n}", "--module", "hf_asyncpp.cli.train", *argv])
    try:
        torchrun.run(args)
    except ChildFailedError as e:  # the workers printed their own errors
        codes = [f.exitcode for f in e.failures.values()]
        return next((c for c in codes if c > 0), 1)
    return 0


def launch_command(recipe: Recipe, recipe_path: str) -> str:
    """Commands that start the recipe's processes, valid from any directory."""
    n = processes_needed(recipe)
    path = Path(recipe_path).resolve() if Path(recipe_path).exists() else recipe_path
    cfg = accelerate_config(n)
    cpu = (f"accelerate launch --config_file {cfg} -m hf_asyncpp.cli.train {path}" if cfg else
           f"ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes {n} -m hf_asyncpp.cli.train {path}")
    return (f"  hf-asyncpp train {path}   (starts the {n} processes itself unless {NO_SPAWN}=1)\n  {cpu}\n"
            f"(on {n} GPUs: accelerate launch --multi_gpu --num_processes {n} -m hf_asyncpp.cli.train {path}); "
            "note that on a CPU-only machine `accelerate launch --num_processes N` silently starts ONE process")
