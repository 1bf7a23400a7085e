"""Pretrain a transformers causal LM from a recipe (the ``hf-asyncpp train`` command).

    accelerate launch scripts/pretrain.py recipes/cpu-tiny.yaml
    python scripts/pretrain.py recipes/cpu-tiny.yaml --training.max_steps=50
"""
import sys

from hf_asyncpp.cli import freeze_for_exit
from hf_asyncpp.cli.train import main

if __name__ == "__main__":
    code = main()
    freeze_for_exit()
    sys.exit(code)
