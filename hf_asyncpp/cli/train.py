"""Pretrain a transformers causal LM from a recipe.

    hf-asyncpp train recipes/cpu-tiny.yaml [--training.max_steps=50 ...]
    accelerate launch scripts/pretrain.py recipes/cpu-tiny.yaml
    torchrun --nproc_per_node 2 -m hf_asyncpp.cli.train recipes/cpu-tiny.yaml
    srun --ntasks-per-node=8 python -m hf_asyncpp.cli.train recipes/moe-10b.yaml    (one task per GPU; SLURM)

Started as one process for a recipe of several stages, it starts the stage processes itself (``launch.py``).
"""
from __future__ import annotations

import sys
from pathlib import Path

from hf_asyncpp import trainer
from hf_asyncpp.checkpointer import check_fresh_run
from hf_asyncpp.config import RecipeError, load_recipe
from hf_asyncpp.launch import should_spawn, spawn


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: hf-asyncpp train RECIPE.yaml [--section.field=value ...]\n{__doc__}")
        return 0 if argv else 2
    try:
        recipe = load_recipe(argv[0], argv[1:])
        spawn_here = should_spawn(recipe)  # a LaunchError (a mangled SLURM variable) is a RecipeError too
        if spawn_here and recipe.training.resume_from_checkpoint is None:  # said once, before processes start
            check_fresh_run(Path(recipe.training.output_dir), recipe.training.overwrite_output_dir, main=False)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if spawn_here:
        return spawn(recipe, argv)
    return trainer.main(argv)


if __name__ == "__main__":
    sys.exit(main())
