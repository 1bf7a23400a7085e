#!/usr/bin/env bash
# The README's main job: set up, prepare the default corpus, pretrain the default
# recipe (recipes/cpu-tiny.yaml) on 2 stages (2 processes on CPU, started by the
# trainer itself), export and evaluate. Extra arguments are recipe overrides,
# e.g. --training.max_steps=50
# accelerate starts one process with recipes/accelerate/one-process.yaml (every value it asks for given, so no
# warning about defaults) and --quiet (a failed run ends on its own `error:` line, not on accelerate's
# CalledProcessError traceback); that process starts the 2 stage processes.
source "$(dirname "$0")/setup_env.sh"
python scripts/prepare_data.py
exec accelerate launch --quiet --config_file recipes/accelerate/one-process.yaml scripts/pretrain.py recipes/cpu-tiny.yaml "$@"
