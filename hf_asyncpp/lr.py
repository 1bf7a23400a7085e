"""Learning-rate schedule: linear warmup, then cosine/linear decay to ``min_lr_ratio`` of the peak."""
from __future__ import annotations

import math

import torch

from .config import TrainingConfig


def warmup_steps(cfg: TrainingConfig) -> int:
    return math.ceil(cfg.warmup_ratio * cfg.max_steps)


def lr_factor(k: int, cfg: TrainingConfig) -> float:
    """Multiplier of the peak lr for the k-th applied update (k = 0, 1, ...)."""
    w = warmup_steps(cfg)
    if k < w:
        return (k + 1) / w
    if cfg.lr_scheduler_type == "constant":
        return 1.0
    span = max(1, cfg.max_steps - w)
    progress = min(1.0, (k - w) / span)
    if cfg.lr_scheduler_type == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer, cfg: TrainingConfig):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: lr_factor(k, cfg))
