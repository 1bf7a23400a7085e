"""Pretrain a transformers causal LM from a recipe.

    hf-asyncpp train recipes/cpu-tiny.yaml [--training.max_steps=50 ...]
    accelerate launch scripts/pretrain.py recipes/cpu-tiny.yaml
    torchrun --nproc_per_node 2 -m hf_asyncpp.cli.train recipes/cpu-tiny.yaml
    srun --ntasks-per-node=8 python -m hf_asyncpp.cli.train recipes/moe-10b.yaml    (one task per GPU; SLURM)

Started as one process for a recipe of several stages, it starts the stage processes itself (``launch.py``), after
checking what can be checked before they start (``preflight.py``). ``--debug`` (anywhere) shows the traceback behind
an ``error:`` line, here and in every process started; the recipe's fields are listed in docs/recipes.md.
"""
from __future__ import annotations

import sys

from hf_asyncpp import trainer
from hf_asyncpp.config import load_recipe
from hf_asyncpp.failures import debug_requested, report, without_debug
from hf_asyncpp.launch import should_spawn, spawn
from hf_asyncpp.preflight import check_recipe


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug, args = debug_requested(argv), without_debug(argv)
    if not args or args[0] in ("-h", "--help"):
        print(f"usage: hf-asyncpp train RECIPE.yaml [--section.field=value ...] [--debug]\n{__doc__}")
        return 0 if args else 2
    try:
        recipe = load_recipe(args[0], args[1:])
        spawn_here = should_spawn(recipe)  # a LaunchError (a mangled SLURM variable) is a RecipeError too
        if spawn_here:  # said once, before the processes start (else trainer.main checks)
            check_recipe(recipe)
    except Exception as e:  # noqa: BLE001 - the user's errors become one line; anything else keeps its traceback
        code = report(e, debug, same_everywhere=True)  # under a launcher every rank gets here
        if code is None:
            raise
        return code
    if spawn_here:
        return spawn(recipe, argv, debug)
    return trainer.main(argv)


if __name__ == "__main__":
    sys.exit(main())
