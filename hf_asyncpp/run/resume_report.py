"""What a resume does with a recipe that differs from its checkpoint's, said before step 1.

A checkpoint keeps the recipe it was written under (``recipe.yaml``). A resume runs the *new* recipe from the
checkpoint's position: the optimizer's hyperparameters and the learning-rate schedule are the recipe's
(``lr.continue_schedule``), the weights, optimizer moments, data position and RNG are the checkpoint's. That is
what a user who extends a run (``max_steps`` 30 -> 40) or lowers the weight decay means, and it is what the
numbers do; but it must not happen silently (the HF Trainer restores the saved scheduler and its users learn of it
from a jump in the lr curve), so every changed field that changes what is computed is named here with both values,
and a changed schedule with the learning rate of the next update under the old and the new schedule.

Not reported here: fields that change where and how often things are written or shown (nothing computed differs),
and the fields checked elsewhere: the model (``checkpointer.check_model``, an error), ``pipeline.schedule`` (an
error) and the training files (a warning of their own: the stream restarts on new files).
"""
from __future__ import annotations

from ..config.recipe import Recipe, recipe_to_dict
from ..config.sections import TrainingConfig
from ..optim.lr import lr_at

UNCHANGED_NUMBERS = {
    "model": None,  # every field: check_model refuses another model
    "hub": None,
    "eval": None,  # downstream tasks are scored apart from training
    "training": {"output_dir", "resume_from_checkpoint", "overwrite_output_dir", "logging_steps", "save_steps",
                 "save_total_limit", "eval_steps", "report_to", "run_name", "project", "peak_tflops", "torch_threads",
                 "stop_after_steps", "export", "stop_signals", "max_restarts", "max_consecutive_skips",
                 "max_skipped_fraction"},
    "pipeline": {"schedule", "num_stages", "layers_per_stage", "extra_warmup", "p2p_timeout_s", "collective_timeout_s",
                 "init_timeout_s", "checkpoint_timeout_s"},
    "data": {"train_files"},
}
"""Recipe fields whose change leaves every computed number as it was (None: the whole section)."""

SCHEDULE = {("training", k) for k in ("max_steps", "warmup_steps", "warmup_ratio", "lr_scheduler_type",
                                      "lr_scheduler_kwargs")} | {("optimizer", "learning_rate")}
"""The fields that shape the learning-rate schedule."""


def changed_fields(saved: dict, now: dict) -> list[tuple[str, str, object, object]]:
    """(section, field, checkpoint's value, recipe's value) of each number-changing field that differs. A field
    the checkpoint's recipe lacks (written by an older version) is not compared."""
    out = []
    for section, fields in now.items():
        silent = UNCHANGED_NUMBERS.get(section, set())
        if silent is None or not isinstance(fields, dict):
            continue
        old = saved.get(section) or {}
        for name, value in fields.items():
            if name in silent or name not in old or old[name] == value:
                continue
            out.append((section, name, old[name], value))
    return out


def resume_report(saved: dict, recipe: Recipe, applied: int, checkpoint: str) -> list[str]:
    """One line per changed field, saying what the resumed run does; ``applied``: the updates the checkpoint's
    optimizer has applied (the schedule's position)."""
    changes = changed_fields(saved, recipe_to_dict(recipe))
    if not changes:
        return []
    lines = [f"{section}.{name}: {old!r} in {checkpoint}, {new!r} now; the run continues with {new!r}"
             for section, name, old, new in changes]
    if any((section, name) in SCHEDULE for section, name, _, _ in changes):
        lines.append(_schedule_line(saved, recipe, applied))
    return lines


def _schedule_line(saved: dict, recipe: Recipe, applied: int) -> str:
    then_cfg = TrainingConfig(**{k: v for k, v in saved["training"].items() if k in TrainingConfig.__dataclass_fields__})
    then_peak = saved.get("optimizer", {}).get("learning_rate", recipe.optimizer.learning_rate)
    then = lr_at(then_cfg, then_peak, applied)
    now = lr_at(recipe.training, recipe.optimizer.learning_rate, applied)
    change = f" ({(now - then) / then:+.0%})" if then else ""
    return (f"the learning-rate schedule is this recipe's from update {applied + 1} on "
            f"({recipe.training.lr_scheduler_type} over {recipe.training.max_steps} steps): the next update's lr is "
            f"{now:.3e} where the checkpoint's schedule gives {then:.3e}{change}")
