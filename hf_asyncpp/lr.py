"""Learning-rate schedules: transformers' own (``get_scheduler``), by their names and with their meanings.

The scheduler advances once per *applied* update (a skipped non-finite step does not move it), so under a delayed
schedule the k-th applied update uses lr(k) whatever its step index.
"""
from __future__ import annotations

import math

from transformers import get_scheduler

from .config import TrainingConfig


def warmup_steps(cfg: TrainingConfig) -> int:
    """``training.warmup_steps`` as transformers 5 reads it: an integer is steps, a number in [0, 1) a fraction of
    ``max_steps`` (the deprecated ``warmup_ratio`` is that fraction)."""
    w = cfg.warmup_steps
    if cfg.warmup_ratio is not None and not w:
        w = cfg.warmup_ratio
    return math.ceil(w * cfg.max_steps) if isinstance(w, float) and w < 1 else int(w)


def build_scheduler(optimizer, cfg: TrainingConfig):
    return get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup_steps(cfg),
                         num_training_steps=cfg.max_steps, scheduler_specific_kwargs=dict(cfg.lr_scheduler_kwargs))
