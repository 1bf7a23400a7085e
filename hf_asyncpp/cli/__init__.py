"""The ``hf-asyncpp`` command: one entry point for everything a user runs.

    hf-asyncpp train RECIPE.yaml [--section.field=value ...]   pretrain (starts the stage processes itself)
    hf-asyncpp export CHECKPOINT OUT                           checkpoint -> Hugging Face folder with a card
    hf-asyncpp evaluate MODEL_DIR ... --tasks ... | --data ... zero-shot tasks and perplexity
    hf-asyncpp plan RECIPE.yaml [--num-stages N]               memory and speed of a recipe, nothing allocated
    hf-asyncpp compare RECIPE.yaml --steps N                    synchronous 1F1B against 2BW: time to the same loss
    hf-asyncpp timeline --schedule 2bw --stages 4              draw a schedule's simulated timeline
    hf-asyncpp prepare-data                                    the default corpus as local jsonl shards

``hf-asyncpp --version`` prints the version. ``python -m hf_asyncpp ...`` is the same command; ``scripts/*.py`` in a checkout are thin wrappers.

================  ======================================================================================
``train``         the one entry point of a training process: arguments, ``--debug``, the recipe, the error line
``export``        a checkpoint to a Hugging Face folder with a model card
``evaluate``      zero-shot tasks and perplexity of model folders, side by side
``plan``          memory, fit and simulated step time of a recipe, nothing allocated
``compare``       synchronous 1F1B against 2BW + EF: the time each needs to reach a loss
``timeline``      a schedule's simulated timeline as a PNG
``prepare_data``  the default corpus as local jsonl shards
================  ======================================================================================
"""
from __future__ import annotations

import argparse
import difflib
import gc
import importlib
import sys

from .. import __version__

COMMANDS = {
    "train": ("hf_asyncpp.cli.train", "pretrain a causal LM from a recipe (starts the stage processes itself)"),
    "export": ("hf_asyncpp.cli.export", "export a checkpoint to a Hugging Face folder with a model card"),
    "evaluate": ("hf_asyncpp.cli.evaluate", "zero-shot tasks and perplexity of model folders, side by side"),
    "plan": ("hf_asyncpp.cli.plan", "will a recipe fit, how fast: memory and simulated step time, nothing allocated"),
    "compare": ("hf_asyncpp.cli.compare", "time to the same loss: synchronous 1F1B + Muon against 2BW + Muon + EF"),
    "timeline": ("hf_asyncpp.cli.timeline", "draw a pipeline schedule's simulated timeline"),
    "prepare-data": ("hf_asyncpp.cli.prepare_data", "prepare the default corpus (State of the Union addresses)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    return "usage: hf-asyncpp COMMAND [ARGS]\n\ncommands:\n" + "\n".join(
        f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()) + "\n\n'hf-asyncpp COMMAND --help' for its options"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"hf-asyncpp {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        near = difflib.get_close_matches(argv[0], list(COMMANDS), n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        print(f"error: unknown command {argv[0]!r}{hint}\n\n{usage()}", file=sys.stderr)
        return 2
    # import only the chosen command: training pulls in torch.distributed and transformers, `plan` does not need them
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:]) or 0


def at_least(lo: int):
    """An argparse ``type`` for an integer option with a floor: a value below it is argparse's one-line usage error
    naming the option (``--steps 0`` used to end in a traceback from deep in the command)."""
    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{value} is out of range; allowed: >= {lo}")
        return value
    integer.__name__ = f"integer >= {lo}"
    return integer


def freeze_for_exit() -> None:
    """Collect the garbage once and freeze what is left, so the interpreter's exit does not walk every object again
    in its own collections: torch and transformers leave about 500,000 tracked objects, and those passes took 1.5-2 s
    per process on 2 cores, paid by every rank and by the launcher of every run. Garbage made before this point is
    still finalized; what is alive at exit gets what Python promises it (no finalizer is guaranteed)."""
    gc.collect()
    gc.freeze()


def run() -> int:
    """The ``hf-asyncpp`` console script and ``python -m hf_asyncpp``: ``main``, then a quick exit."""
    code = main()
    freeze_for_exit()
    return code
