"""The held-out loss of a block of tokens, and the continuation log-likelihoods lm-eval asks for, defined once.

The engines compute them on their own device (the single-process engine on the model, the pipeline on its last
stage) and evaluation (``eval/perplexity.py``; ``eval/lm_eval.py`` hands lm-evaluation-harness the pipeline's
log-likelihoods) on a reloaded model; one definition keeps those numbers comparable. It lives outside ``eval/`` because the core engines need it and must not depend on
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
    """The scorer's batches, as lm-eval's ``HFLM`` makes them: requests longest first, equal lengths by their tokens
    (HFLM's sort key, so that the same requests share a batch), each input the context and continuation cut from the
    left to ``length`` + 1 tokens minus the last, right-padded with ``pad_id`` (no mask: causal attention never looks
    at the pads after a sequence). Per batch: the request indices, the ids ``(B, T)`` and each input's length."""
    def key(k):
        toks = requests[k][0] + requests[k][1]
        return -len(toks), tuple(toks)

    order = sorted(range(len(requests)), key=key)
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
    """lm-eval's answer to each request of a batch, from the model's logits ``(B, T, V)``: float64 ``(B, 2)`` on the
    logits' device, the summed log p(continuation | context) (float32 sums) and ``is_greedy`` (1.0 when every
    continuation token is the argmax), with no host sync per request."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for j, k in enumerate(chunk):
        cont = torch.tensor(requests[k][1], device=logits.device)
        rows = logp[j, torch.arange(lengths[j] - len(cont), lengths[j], device=logits.device)]
        out.append(torch.stack([rows.gather(1, cont[:, None]).sum(), (rows.argmax(-1) == cont).all().float()]))
    return torch.stack(out).double()
