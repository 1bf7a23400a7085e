#!/usr/bin/env bash
# The README's main job: set up, prepare the default corpus, pretrain the default
# recipe (recipes/cpu-tiny.yaml) on 2 stages (2 processes on CPU, started by the
# trainer itself), export and evaluate. Extra arguments are recipe overrides,
# e.g. --training.max_steps=50. `hf-asyncpp train` rather than `accelerate launch`:
# accelerate's one-process launcher passes no signal on and turns every exit code
# into 1, and this script's code (10: stopped and saved) is what a scheduler reads.
# The `eval` extra (lm-evaluation-harness) comes with it: the README's own runs
# score zero-shot tasks (hf-asyncpp evaluate --tasks, eval.tasks) with it.
HF_ASYNCPP_EXTRAS=eval source "$(dirname "$0")/setup_env.sh"
python scripts/prepare_data.py
exec hf-asyncpp train recipes/cpu-tiny.yaml "$@"
