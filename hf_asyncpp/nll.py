"""The held-out loss of a block of tokens, defined once.

The engines compute it on their own device (the single-process engine on the model, the pipeline on its last
stage) and evaluation (``eval/perplexity.py``) on a reloaded model; one definition keeps those numbers comparable.
It lives outside ``eval/`` because the core engines need it and must not depend on evaluation.
"""
from __future__ import annotations

import torch

__all__ = ["nll_per_block"]


def nll_per_block(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token NLL of each block, float64 ``(B,)``: the one definition every evaluation path uses
    (a model, the single-process engine, the pipeline's last stage). logits ``(B, T, V)``, ids ``(B, T)``."""
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")  # (B, T-1)
    return nll.double().sum(dim=1)
