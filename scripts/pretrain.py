"""Pretrain a transformers causal LM from a recipe.

    accelerate launch --config_file recipes/accelerate/cpu-2proc.yaml scripts/pretrain.py recipes/cpu-tiny.yaml
    python scripts/pretrain.py recipes/cpu-tiny.yaml --training.max_steps=50
"""
import os
import sys

sys.path[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")  # repo root, not scripts/ (scripts/evaluate.py would shadow `evaluate`)

from hf_asyncpp.trainer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
