"""The held-out loss of a block of tokens, and the downstream scorer's log-likelihoods, defined once.

The engines compute them on their own device (the single-process engine on the model, the pipeline on its last
stage) and evaluation (``eval/perplexity.py``, ``eval/downstream.py``) on a reloaded model; one definition keeps
those numbers comparable. It lives outside ``eval/`` because the core engines need it and must not depend on
evaluation.
"""
from __future__ import annotations

import torch

__all__ = ["nll_per_block", "request_batches", "continuation_logprobs"]


def nll_per_block(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token NLL of each block, float64 ``(B,)``: the one definition every evaluation path uses
    (a model, the single-process engine, the pipeline's last stage). logits ``(B, T, V)``, ids ``(B, T)``."""
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")  # (B, T-1)
    return nll.double().sum(dim=1)


def request_batches(requests: list[tuple[list[int], list[int]]], batch_size: int, pad_id: int,
                    length: int) -> list[tuple[list[int], torch.Tensor, list[int]]]:
    """The scorer's batches, as lm-eval makes them: requests longest first (less padding), each input the context
    and continuation cut from the left to ``length`` + 1 tokens minus the last, right-padded with ``pad_id`` (no
    mask: causal attention never looks at the pads after a sequence). Per batch: the request indices, the ids
    ``(B, T)`` and each input's length."""
    order = sorted(range(len(requests)), key=lambda k: -len(requests[k][0]) - len(requests[k][1]))
    out = []
    for i in range(0, len(order), batch_size):
        chunk = order[i : i + batch_size]
        inps = [(requests[k][0] + requests[k][1])[-(length + 1):][:-1] for k in chunk]
        ids = torch.full((len(chunk), max(map(len, inps))), pad_id, dtype=torch.long)
        for j, s in enumerate(inps):
            ids[j, : len(s)] = torch.tensor(s)
        out.append((chunk, ids, [len(s) for s in inps]))
    return out


def continuation_logprobs(logits: torch.Tensor, chunk: list[int], lengths: list[int],
                          requests: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """Summed log p(continuation | context) of each request of a batch, from the model's logits ``(B, T, V)``: float64
    ``(B,)`` on the logits' device (float32 sums, so no host sync per request)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for j, k in enumerate(chunk):
        cont = requests[k][1]
        pos = torch.arange(lengths[j] - len(cont), lengths[j], device=logits.device)
        out.append(logp[j, pos, torch.tensor(cont, device=logits.device)].sum())
    return torch.stack(out).double()
