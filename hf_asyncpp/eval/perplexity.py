"""Perplexity of a model, an exported folder, or pipeline stages: ``exp(total NLL / predicted tokens)``.

A pipeline runtime computes per-block NLL sums on its last stage (``model/nll.py``, the one definition) and hands
them to :func:`perplexity_from_sums`; a plain model goes through :func:`evaluate_perplexity`. Both end in
:func:`perplexity_from_sums`: two lines of arithmetic, where an ``evaluate`` metric cost seconds of import and an
Arrow write per call in every evaluating process.
"""
from __future__ import annotations

import math

import torch
from accelerate.utils import find_executable_batch_size

from .. import __version__
from ..model.nll import nll_per_block

__all__ = ["SCORER", "block_nll", "evaluate_model_dir", "evaluate_perplexity", "perplexity_from_sums", "resolve_device"]

SCORER = f"hf_asyncpp {__version__}"
"""Who computed a perplexity (the model card's ``metric_config``); zero-shot scores name lm-eval and its version."""


def resolve_device(device=None) -> torch.device:
    """The device evaluation runs on: ``device`` when given, else this process's accelerator as training uses it
    (``cuda:<current device>``, which accelerate sets per process), else the CPU."""
    if device is not None and str(device) != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def perplexity_from_sums(nll_sums, token_counts) -> dict:
    """``{eval_loss, eval_perplexity, num_tokens}`` from per-block (or per-batch) summed next-token NLLs and the
    number of predicted tokens in each, e.g. as computed by the last pipeline stage."""
    nll_sums, token_counts = [float(x) for x in nll_sums], [int(x) for x in token_counts]
    if len(nll_sums) != len(token_counts):
        raise ValueError(f"{len(nll_sums)} NLL sums but {len(token_counts)} token counts; give one of each per block")
    total, n = sum(nll_sums), sum(token_counts)
    if n <= 0:
        raise ValueError(f"perplexity of {n} tokens: give the number of predicted tokens of each block")
    loss = total / n
    return {"eval_loss": loss, "eval_perplexity": math.exp(loss) if loss < 709.0 else math.inf, "num_tokens": n}


@torch.no_grad()
def block_nll(model, blocks: torch.Tensor, batch_size: int = 8) -> tuple[list[float], list[int]]:
    """Per-block summed next-token NLL (labels = inputs, shifted as HF does) and predicted-token counts.

    Forward only, in eval mode (the model's mode is restored after), on the model's device. MoE auxiliary losses
    are not part of it. The batch size halves on an out-of-memory error (accelerate's ``find_executable_batch_size``).
    """
    if blocks.ndim != 2 or len(blocks) == 0:
        raise ValueError(f"blocks must be a non-empty (n, seq_len) tensor of token ids, got shape {tuple(blocks.shape)}")
    device = next(model.parameters()).device

    @find_executable_batch_size(starting_batch_size=batch_size)
    def run(bs: int) -> tuple[list[float], list[int]]:
        sums, counts = [], []
        for i in range(0, len(blocks), bs):
            ids = blocks[i : i + bs].to(device)  # (B, T)
            sums.extend(nll_per_block(model(input_ids=ids).logits, ids).tolist())
            counts.extend([ids.shape[1] - 1] * len(ids))
        return sums, counts

    was_training = model.training
    model.eval()
    try:
        return run()
    finally:
        model.train(was_training)


def evaluate_perplexity(model, blocks: torch.Tensor, batch_size: int = 8) -> dict:
    """``{eval_loss, eval_perplexity, num_tokens}`` of ``model`` on ``blocks`` (LongTensor ``(n, seq_len)``)."""
    return perplexity_from_sums(*block_nll(model, blocks, batch_size))


def evaluate_model_dir(model_dir, blocks: torch.Tensor, batch_size: int = 8, device: str | torch.device | None = None,
                       bf16: bool = False) -> dict:
    """Reload a model folder with ``from_pretrained`` (fp32 weights) and measure its perplexity on ``blocks``, on
    ``device`` (None: see :func:`resolve_device`, the training device after a GPU run). ``bf16``: under bf16 autocast,
    the precision a ``training.bf16`` run trains and evaluates in, so the export's perplexity is read in the run's
    precision whichever way it is read back (through the stages or whole)."""
    from transformers import AutoModelForCausalLM

    device = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        return evaluate_perplexity(model, blocks, batch_size)
