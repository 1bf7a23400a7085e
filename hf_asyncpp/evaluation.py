"""Perplexity of a model, an exported folder, or pipeline stages, through the shipped ``evaluate`` metric."""
from __future__ import annotations

import os
from pathlib import Path

import torch

METRICS_DIR = Path(__file__).parent / "metrics"


def load_metric(name: str = "perplexity"):
    """Load a metric module shipped with the package (never the network: Hub metric scripts can't load here)."""
    os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
    import evaluate

    path = METRICS_DIR / name / f"{name}.py"
    if not path.exists():
        known = sorted(p.name for p in METRICS_DIR.iterdir() if p.is_dir())
        raise ValueError(f"unknown metric {name!r}; shipped metrics: {known}")
    return evaluate.load(str(path))


def perplexity_from_sums(nll_sums: list[float], token_counts: list[int]) -> dict:
    """eval_loss and perplexity from per-block NLL sums (e.g. from the last pipeline stage)."""
    res = load_metric("perplexity").compute(nll_sum=list(map(float, nll_sums)), num_tokens=list(map(int, token_counts)))
    return {"eval_loss": res["eval_loss"], "eval_ppl": res["perplexity"], "num_tokens": res["num_tokens"]}


@torch.no_grad()
def block_nll(model, blocks: torch.Tensor, batch_size: int = 8) -> tuple[list[float], list[int]]:
    """Per-block summed next-token NLL (labels = inputs, shifted as HF does) and predicted-token counts."""
    was_training = model.training
    model.eval()
    sums, counts = [], []
    for i in range(0, len(blocks), batch_size):
        ids = blocks[i : i + batch_size]
        logits = model(input_ids=ids).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").sum(dim=1)
        sums.extend(nll.double().tolist())
        counts.extend([ids.shape[1] - 1] * len(ids))
    model.train(was_training)
    return sums, counts


def evaluate_perplexity(model, blocks: torch.Tensor, batch_size: int = 8) -> dict:
    return perplexity_from_sums(*block_nll(model, blocks, batch_size))


def evaluate_model_dir(model_dir, blocks: torch.Tensor, batch_size: int = 8) -> dict:
    """Reload an exported folder with ``from_pretrained`` and measure its perplexity on ``blocks``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return evaluate_perplexity(model, blocks, batch_size)
