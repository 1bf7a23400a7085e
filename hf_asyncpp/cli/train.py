"""Pretrain a transformers causal LM from a recipe: the one entry point of a training process.

    hf-asyncpp train recipes/cpu-tiny.yaml [--training.max_steps=50 ...]
    accelerate launch scripts/pretrain.py recipes/cpu-tiny.yaml
    torchrun --nproc_per_node 2 -m hf_asyncpp.cli.train recipes/cpu-tiny.yaml
    srun --ntasks-per-node=8 python -m hf_asyncpp.cli.train recipes/moe-10b.yaml    (one task per GPU; SLURM)

Started as one process for a recipe of several stages, it starts the stage processes itself (``launch/spawn.py``),
after checking what can be checked before they start (``run/preflight.py``); each started process comes back here.
This file owns the arguments, ``--debug``, loading the recipe (once per process) and the error line
(``launch/failures.py``); ``run.trainer.train(recipe)`` only trains. ``--debug`` (anywhere) shows the traceback
behind an ``error:`` line, here and in every process started; ``--help`` lists the recipe's fields.

The arguments and the recipe are read before the training machinery is imported (torch, transformers and datasets
take seconds): ``--help``, a missing recipe file or a misspelt field answer at once, in a process no launcher
started without importing torch at all (:func:`early_error`).
"""
from __future__ import annotations

from .. import supervision  # first: it notes the launcher's pid before the slow imports in main()

import os
import sys
import traceback
from pathlib import Path

from ..config.recipe import Recipe, load_recipe
from ..config.reference import help_text
from ..errors import EXIT_CODES, EXIT_INTERRUPTED, EXIT_STOPPED, RecipeError
from . import freeze_for_exit

USAGE = "usage: hf-asyncpp train RECIPE.yaml [--section.field=value | --section.field value ...] [--debug]"
DEBUG_FLAG, DEBUG_ENV = "--debug", "HF_ASYNCPP_DEBUG"
"""``launch.failures``' flag and variable, read here before that module (and torch with it) is imported."""


def prepare(recipe: Recipe, recipe_path: str) -> bool:
    """Whether this process starts the stage processes itself; either way, what can be checked before training is
    checked, once per run: by the starting process before it starts them, else by each rank (rank 0 also asks the
    Hub), unless the process that started this one has already checked."""
    from ..launch.spawn import adopt_slurm, check_topology, should_spawn, started_by_launcher  # lazy: see main()
    from ..run.preflight import check_recipe

    if should_spawn(recipe):  # a LaunchError (a mangled SLURM variable) is a RecipeError too
        check_recipe(recipe)
        return True
    if supervision.restart_count() and recipe.training.resume_from_checkpoint != "latest":
        # torchrun --max-restarts started this worker group again: it continues the run, whatever it started from
        if supervision.is_main_rank():
            print(f"hf_asyncpp: restart {supervision.restart_count()} of this run: resuming from the newest verified "
                  f"checkpoint in {recipe.training.output_dir}", file=sys.stderr, flush=True)
        recipe.training.resume_from_checkpoint = "latest"
    adopt_slurm()  # under srun: the ranks' variables, before the checks ask which rank this is
    if not started_by_launcher():  # one process (HF_ASYNCPP_NO_SPAWN=1): first the command that starts them all
        check_topology(recipe, 1, recipe_path)
    elif os.environ.get("WORLD_SIZE", "").isdigit():  # every rank meets a wrong count: said once per node, here
        check_topology(recipe, int(os.environ["WORLD_SIZE"]), recipe_path)
    if not os.environ.get(supervision.CHECKED):
        check_recipe(recipe, hub=supervision.is_main_rank())
    return False


def stopped_exit_code() -> int:
    """A run stopped by a signal (saved, resumable) exits with EXIT_STOPPED, so that no script takes it for a finished
    one; except under a torchrun that restarts failed workers (``--max-restarts``), which would restart a run that
    was told to stop: there 0, and the line says it stopped."""
    return 0 if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0 else EXIT_STOPPED


def early_error(e: RecipeError, debug: bool) -> int:
    """A recipe mistake met before the training machinery is imported; its exit code. In a process that no launcher
    started it is printed here as ``launch.failures.report`` prints it (the traceback with ``--debug``, then one
    ``error:`` line), without importing torch for it; a rank of a launcher leaves it to ``report``, which decides
    which process prints it."""
    if supervision.launched() or "SLURM_PROCID" in os.environ:
        from ..launch.failures import report  # lazy: see main()

        return report(e, debug, same_everywhere=True)
    if debug:
        traceback.print_exc()
    print(f"error: {e}", file=sys.stderr, flush=True)
    return next(code for kind, code in EXIT_CODES if isinstance(e, kind))


def end_summary(summary: dict) -> str | None:
    """What the main process prints at the end of a run (None elsewhere), the only place the final result is said:
    a finished run's result line (``exported PATH: perplexity P (untrained U), eval_loss L``, or ``done: ...`` without
    an export), then an indented line for each kind of output the run left (:func:`where_lines`). A stopped run, a
    run stopped early and a finished run resumed say so in one line."""
    if not summary.get("is_main", True):
        return None
    if summary.get("complete"):
        return summary["complete"]
    if summary.get("stopped_by"):
        saved = f"saved {summary['checkpoint']}" if summary.get("checkpoint") else "nothing to save"
        return (f"stopped by {summary['stopped_by']} at step {summary['step']}: {saved}; resume with the same command "
                "and --training.resume_from_checkpoint=latest")
    if summary.get("stopped_early"):
        return (f"stopped after step {summary['step']} (training.stop_after_steps); resume with "
                "--training.resume_from_checkpoint=latest")
    if summary.get("export_dir"):
        untrained = summary.get("untrained_eval_perplexity")
        line = (f"exported {summary['export_dir']}: perplexity {summary['export_eval_perplexity']:.2f}"
                + (f" (untrained {untrained:.2f})" if untrained is not None else "")
                + f", eval_loss {summary['export_eval_loss']:.4f}")
    else:
        line = f"done: step {summary['step']} eval_loss {summary['eval_loss']:.4f} perplexity {summary['eval_perplexity']:.2f}"
    return "\n".join([line, *where_lines(summary.get("files") or {})])


def where_lines(files: dict[str, str]) -> list[str]:
    """The end summary's lines naming where the run's outputs are (``run.trainer.run_files``: only what exists)."""
    rows = [("metrics", [files.get(k) for k in ("metrics", "final_eval", "profile")]),
            ("curves", [files.get(k) for k in ("loss_curve", "timeline")]),
            ("logs", [files.get("logs")])]
    lines = [f"  {kind}: {', '.join(p for p in paths if p)}" for kind, paths in rows if any(paths)]
    if files.get("checkpoint"):
        newest = Path(files["checkpoint"])
        lines.append(f"  checkpoints: {newest.parent} (newest {newest.name})")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Train a recipe; the exit code (docs/troubleshooting.md). The user's errors become one line, anything else keeps
    its traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = [a for a in argv if a != DEBUG_FLAG]
    debug = len(args) < len(argv) or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    if "-h" in args or "--help" in args:
        print(help_text(USAGE))
        return 0
    if not args:
        print(f"{USAGE}\n'hf-asyncpp train --help' lists the recipe's fields", file=sys.stderr)
        return 2
    try:
        recipe = load_recipe(args[0], args[1:])
    except RecipeError as e:
        return early_error(e, debug)
    # Imported only now that the arguments and the recipe are known good: torch, transformers and datasets take
    # seconds to import, which --help and a recipe mistake should not wait for (test_cli_inputs.py checks it).
    from ..launch.failures import leave_finished, leave_for_launcher, report
    from ..launch.spawn import spawn, started_by_launcher
    from ..run.trainer import train
    from ..storage.write import remove_if_unused

    made = not os.path.exists(recipe.training.output_dir) and not started_by_launcher()  # by this start, if it fails
    try:  # what every rank meets identically: printed by one process per node
        spawn_here = prepare(recipe, args[0])
    except Exception as e:  # noqa: BLE001
        code = report(e, debug, same_everywhere=True)
        if code is None:
            raise
        if made:
            remove_if_unused(Path(recipe.training.output_dir))
        return code
    if spawn_here:
        code = spawn(recipe, argv, debug)
        if made and code not in (0, EXIT_STOPPED):
            remove_if_unused(Path(recipe.training.output_dir))
        return code
    # for this process's whole life, not only while train() runs: a stop signal that comes after the run has ended
    # (a scheduler's time limit in its last seconds) is noted and ignored, never a kill that fails a finished run
    supervision.stop_on(recipe.training.stop_signals)
    try:
        summary = train(recipe, args[0])
    except KeyboardInterrupt:  # a second SIGINT (the first asks for a saved stop: supervision.stop_on)
        if debug:
            raise
        line = ("error: interrupted by a second SIGINT: stopped at once, unsaved; resume from the newest checkpoint "
                "with --training.resume_from_checkpoint=latest")
        if supervision.is_main_rank() and not leave_for_launcher(line, EXIT_INTERRUPTED):
            print(line, file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001
        code = report(e, debug)
        if code is None:
            raise
        if made:
            remove_if_unused(Path(recipe.training.output_dir))
        return code
    line = end_summary(summary)
    stopped = bool(summary.get("stopped_by"))
    if not stopped and summary.get("is_main", True):
        leave_finished()
    if line and not (stopped and leave_for_launcher(line, EXIT_STOPPED)):  # hf-asyncpp train's launcher prints it
        print(line, flush=True)
    return stopped_exit_code() if stopped else 0


if __name__ == "__main__":  # each rank of a spawned run
    code = main()
    freeze_for_exit()
    sys.exit(code)
