"""Pretrain a transformers causal LM from a recipe: the one entry point of a training process.

    hf-asyncpp train recipes/cpu-tiny.yaml [--training.max_steps=50 ...]
    accelerate launch scripts/pretrain.py recipes/cpu-tiny.yaml
    torchrun --nproc_per_node 2 -m hf_asyncpp.cli.train recipes/cpu-tiny.yaml
    srun --ntasks-per-node=8 python -m hf_asyncpp.cli.train recipes/moe-10b.yaml    (one task per GPU; SLURM)

Started as one process for a recipe of several stages, it starts the stage processes itself (``launch/spawn.py``),
after checking what can be checked before they start (``run/preflight.py``); each started process comes back here.
This file owns the arguments, ``--debug``, loading the recipe (once per process) and the error line
(``launch/failures.py``); ``run.trainer.train(recipe)`` only trains. ``--debug`` (anywhere) shows the traceback
behind an ``error:`` line, here and in every process started; the recipe's fields are listed in docs/recipes.md.
"""
from __future__ import annotations

from .. import supervision  # noqa: F401  first: it notes the launcher's pid before the slow imports below

import os
import sys

from ..config.recipe import CHECKED, Recipe, load_recipe
from ..launch.failures import debug_requested, report, without_debug
from ..launch.spawn import adopt_slurm, should_spawn, spawn, started_by_launcher
from ..run.preflight import check_recipe
from ..run.trainer import check_topology, train

USAGE = "usage: hf-asyncpp train RECIPE.yaml [--section.field=value ...] [--debug]"


def is_main_rank() -> bool:
    """Rank 0, or a process no launcher started (before the process group exists; SLURM's before adopt_slurm)."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def prepare(recipe: Recipe, recipe_path: str) -> bool:
    """Whether this process starts the stage processes itself; either way, what can be checked before training is
    checked, once per run: by the starting process before it starts them, else by each rank (rank 0 also asks the
    Hub), unless the process that started this one has already checked."""
    if should_spawn(recipe):  # a LaunchError (a mangled SLURM variable) is a RecipeError too
        check_recipe(recipe)
        return True
    adopt_slurm()  # under srun: the ranks' variables, before the checks ask which rank this is
    if not started_by_launcher():  # one process (HF_ASYNCPP_NO_SPAWN=1): first the command that starts them all
        check_topology(recipe, 1, recipe_path)
    if not os.environ.get(CHECKED):
        check_recipe(recipe, hub=is_main_rank())
    return False


def summary_line(summary: dict) -> str | None:
    """What the main process prints at the end of a run."""
    if not summary.get("is_main", True):
        return None
    if summary.get("stopped_early"):
        return (f"stopped after step {summary['step']} (training.stop_after_steps); resume with "
                "--training.resume_from_checkpoint=latest")
    if summary.get("export_dir"):
        return (f"exported {summary['export_dir']}: perplexity {summary['export_eval_ppl']:.2f} "
                f"(untrained {summary['untrained_eval_ppl']:.2f}), eval_loss {summary['export_eval_loss']:.4f}")
    return f"done: step {summary['step']} eval_loss {summary['eval_loss']:.4f} perplexity {summary['eval_ppl']:.2f}"


def main(argv: list[str] | None = None) -> int:
    """Train a recipe; the exit code (docs/troubleshooting.md). The user's errors become one line, anything else keeps
    its traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug, args = debug_requested(argv), without_debug(argv)
    if not args or args[0] in ("-h", "--help"):
        print(f"{USAGE}\n{__doc__}")
        return 0 if args else 2
    try:  # what every rank meets identically: printed by one process per node
        recipe = load_recipe(args[0], args[1:])
        spawn_here = prepare(recipe, args[0])
    except Exception as e:  # noqa: BLE001
        code = report(e, debug, same_everywhere=True)
        if code is None:
            raise
        return code
    if spawn_here:
        return spawn(recipe, argv, debug)
    try:
        summary = train(recipe, args[0])
    except Exception as e:  # noqa: BLE001
        code = report(e, debug)
        if code is None:
            raise
        return code
    line = summary_line(summary)
    if line:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
