"""Every file name of a run folder and of a checkpoint in it, spelled here and nowhere else.

The layout of a checkpoint::

    checkpoint-0000100/
      manifest.json                  written last: its presence makes the checkpoint complete
      run_state.json                 step, tokens, the data files, topology, schedule
      trainer_state.json             transformers.TrainerState of the run (global_step, log_history): not read on resume
      rng-rank000.pt ...             python/torch RNG per rank
      data-rank000.json ...          the data position of each rank that reads the training stream, written by it
      config.json  tokenizer/  recipe.yaml
      model.safetensors  optimizer.pt                                      single-process run
      stage-00.safetensors  stage-00-optimizer.pt  [stage-00-versions.safetensors]   pipelined run, per stage
      [stage-00-optimizer-replica01.pt ...]   ZeRO-1: the optimizer state each further replica of the stage owns
      model.safetensors.index.json   pipelined run: each weight's stage file, so from_pretrained loads the folder
"""
from __future__ import annotations

import re
from pathlib import Path

MANIFEST = "manifest.json"
RUN_STATE = "run_state.json"
TRAINER_STATE = "trainer_state.json"  # transformers.TrainerState of the run: what tools for Trainer checkpoints read
MODEL_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # a pipelined checkpoint's stage files by name: from_pretrained opens it
OPTIMIZER_FILE = "optimizer.pt"
CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
_VERSIONS = "-versions.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_DIR = "tokenizer"
RECIPE_FILE = "recipe.yaml"
# the run folder's own outputs beside its checkpoints (run/reporting.py, run/evaluator.py, plan/profile.py)
METRICS = "metrics.jsonl"
FINAL_EVAL = "final_eval.json"
LOSS_CURVE = "loss_curve.png"
PROFILE = "pipeline_profile.json"
TIMELINE = "pipeline_timeline.png"
EXPORT_DIR = "export"
LOGS_DIR = "logs"
RUN_LOCK = ".run.lock"  # held by a run's main process for its life (run/folder.py: lock_output_dir); never removed


# what a finished or interrupted run leaves in its output_dir besides checkpoints (run/reporting.py, model/export.py and
# plan/profile.py write them); a fresh run must not mix its own with these
RUN_OUTPUTS = (METRICS, FINAL_EVAL, EXPORT_DIR, LOSS_CURVE, PROFILE, TIMELINE, LOGS_DIR, TOKENIZER_DIR, RECIPE_FILE)


def run_owned(name: str) -> bool:
    """Whether an entry of ``output_dir`` named ``name`` is one the run writes, replaces or removes: its outputs,
    its checkpoints, and the hidden names it makes (temporary checkpoints and exports, staging, the lock)."""
    return name in RUN_OUTPUTS or bool(CHECKPOINT_DIR.match(name)) or name.startswith(".")


def rng_file(rank: int) -> str:
    return f"rng-rank{rank:03d}.pt"


def data_file(rank: int) -> str:
    """The data position of ``rank`` (a rank reading the training stream: the first and the last stage's)."""
    return f"data-rank{rank:03d}.json"


def stage_file(stage: int) -> str:
    """The stage's newest weights, by the model's parameter names."""
    return f"stage-{stage:02d}.safetensors"


def stage_versions_file(stage: int) -> str:
    """Older weight versions the stage still holds (2BW: the one in use), ``v{version}/{name}``."""
    return f"stage-{stage:02d}{_VERSIONS}"


def stage_optimizer_file(stage: int) -> str:
    return f"stage-{stage:02d}-optimizer.pt"


def stage_optimizer_part_file(stage: int, replica: int) -> str:
    """ZeRO-1: the optimizer (and Error-Feedback) state of the tensors replica ``replica`` (> 0) of the stage owns;
    replica 0's is in :func:`stage_optimizer_file`, with the scheduler and the rest of the stage's state."""
    return f"stage-{stage:02d}-optimizer-replica{replica:02d}.pt"


def stage_weight_files(path: Path) -> list[Path]:
    """The ``stage-XX.safetensors`` files of a pipelined checkpoint, in stage order."""
    return sorted(p for p in Path(path).glob("stage-*.safetensors") if not p.name.endswith(_VERSIONS))


def versions_of(weights_file: Path) -> Path:
    return weights_file.with_name(weights_file.stem + _VERSIONS)


def optimizer_of(weights_file: Path) -> Path:
    return weights_file.with_name(weights_file.stem + "-optimizer.pt")


def optimizer_parts_of(weights_file: Path) -> list[Path]:
    """The further replicas' optimizer files of a stage (ZeRO-1), in replica order; empty otherwise."""
    return sorted(weights_file.parent.glob(weights_file.stem + "-optimizer-replica*.pt"))


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step:07d}"


def temp_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f".tmp-{checkpoint_name(step)}"
