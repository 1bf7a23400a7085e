"""Learning-rate schedules: transformers' own (``get_scheduler``), by their names and with their meanings.

The scheduler advances once per *applied* update (a skipped non-finite step does not move it), so under a delayed
schedule the k-th applied update uses lr(k) whatever its step index.

On resume the checkpoint gives the position (how many updates were applied) and the recipe gives the schedule and
the optimizer's hyperparameters (:func:`continue_schedule`): a run resumed with a longer ``max_steps`` follows the
schedule for the new length from where it stands, and says so (``resume_report``).
"""
from __future__ import annotations

import math

import torch
from transformers import get_scheduler

from ..config.sections import TrainingConfig


def warmup_steps(cfg: TrainingConfig) -> int:
    """``training.warmup_steps`` as transformers 5 reads it: an integer is steps, a number in [0, 1) a fraction of
    ``max_steps`` (the deprecated ``warmup_ratio`` is that fraction)."""
    w = cfg.warmup_steps
    if cfg.warmup_ratio is not None and not w:
        w = cfg.warmup_ratio
    return math.ceil(w * cfg.max_steps) if isinstance(w, float) and w < 1 else int(w)


def lr_at(cfg: TrainingConfig, peak_lr: float, applied: int) -> float:
    """The learning rate the schedule of ``cfg`` gives after ``applied`` updates, for a peak of ``peak_lr``."""
    probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak_lr)
    scheduler = build_scheduler(probe, cfg)
    return scheduler.base_lrs[0] * scheduler.lr_lambdas[0](applied)


def continue_schedule(optimizer, scheduler, saved: dict) -> None:
    """Put a freshly built ``scheduler`` (the recipe's schedule; its optimizer holds the recipe's hyperparameters)
    at the position of a saved scheduler state, and set each group's lr for it. Every schedule of transformers' is
    a ``LambdaLR`` whose lr is closed-form in the position, so with an unchanged recipe this is bitwise the lr of
    an uninterrupted run; with a changed one it is the new schedule's lr at that point, with no step back to
    replay."""
    state = scheduler.state_dict()
    state.update({k: saved[k] for k in ("last_epoch", "_step_count") if k in saved})
    scheduler.load_state_dict(state)
    for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def build_scheduler(optimizer, cfg: TrainingConfig):
    return get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup_steps(cfg),
                         num_training_steps=cfg.max_steps, scheduler_specific_kwargs=dict(cfg.lr_scheduler_kwargs))
