"""Forward-only passes through a pipeline's stages: held-out NLL, the export read back stage by stage, and the
downstream tasks' log-likelihoods.

Why here and not on one device: every evaluation of a pipelined run goes through the stages, each rank holding only
its stage's weights (the newest version, or tensors it read by name from an exported folder), so no rank ever
needs the whole model beside its stage (``moe-10b``: 41 GB in fp32). The first stage feeds the ids, the boundary
tensors travel as in training (``P2P``, with a header: batch shapes vary), the last stage turns logits into numbers,
and one collective gives every rank the result. Data-parallel replicas split the batches between them.

Every function here is collective: every rank of the run calls it, with the same arguments.
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.func import functional_call

from ..model.build import autocast
from ..model.build import read_stage_tensors
from ..model.nll import continuation_logprobs, nll_per_block, request_batches
from ..model.vocab_parallel import vocab_logits


@torch.no_grad()
def forward_batches(engine, batches: list[torch.Tensor], on_logits: Callable[[int, torch.Tensor, torch.Tensor], None],
                    weights: dict[str, torch.Tensor] | None = None, rounds: int = 0) -> None:
    """Run each id batch ``(B, T)`` forward through the stages with the newest weights (or ``weights``: this stage's
    tensors by name); the last stage calls ``on_logits(index, logits, ids)`` for each. Every stage of a replica gets
    the same list (the ids reach only the first stage's modules and the last stage's callback). With the output
    layer cut over the stages (``vocab_parallel``) the last stage's forward gives the final hidden states, and every
    stage's rows of the logits are gathered onto it (``vocab_logits``) before the callback. ``rounds``: the most
    batches any replica has; with the experts sharded (``pipeline.expert_parallel``) every forward's all-to-alls need
    every replica of the block, so a replica with fewer runs its first batch again (or one token) until it has run
    that many, its results dropped."""
    stage, p2p, topo = engine.stage, engine.p2p, engine.topo
    real = len(batches)  # the last stage reports these; the rest fill the rounds
    if engine.recipe.pipeline.expert_parallel > 1 and rounds > real:  # every stage: they feed each other
        batches = list(batches) + [batches[0] if batches else torch.zeros((1, 1), dtype=torch.long)] * (rounds - real)
    stage.eval()
    leaves = weights if weights is not None else engine.versions.compute_for(engine.versions.latest)
    # before the first training step has chosen the weights held in bf16 (the evaluation of the untrained model), the
    # weights are fp32 leaves that no later forward reads: compiled layers would compile graphs for them alone, used
    # once, so these batches run eagerly (the kernels aot_eager and the training's compiled graphs run too)
    eager = weights is None and engine.bf16_versions and engine.versions.cast is None
    shard = engine.shard
    try:
        for i, ids in enumerate(batches):
            ids = ids.to(engine.device)
            arg = ids
            if not engine.first:
                inputs = p2p.recv(topo.stage - 1)
                arg = inputs[0] if len(inputs) == 1 else tuple(inputs)
            with autocast(engine.bf16), \
                    (torch.compiler.set_stance("force_eager") if eager else nullcontext()):
                out = functional_call(stage, leaves, (arg,), strict=False)
            if not engine.last:
                p2p.send(list(out) if isinstance(out, (tuple, list)) else [out], topo.stage + 1, with_header=True)
            if shard is not None:  # every stage: its rows of the logits, gathered onto the last
                w = leaves[shard]
                hidden = (out[0] if isinstance(out, tuple) else out).to(w.dtype).contiguous() if engine.last else \
                    torch.empty((*ids.shape, w.shape[1]) if engine.first else inputs[0].shape, dtype=w.dtype,
                                device=engine.device)
                with autocast(engine.bf16):
                    out = vocab_logits(hidden, w, engine.groups.vocab, topo.rank_of(topo.num_stages - 1),
                                       stage.vocab.ranges[-1][1])
            if engine.last:
                if i < real:
                    on_logits(i, out if torch.is_tensor(out) else out.logits, ids)
        p2p.drain()
    finally:
        stage.train()


def eval_nll(engine, blocks: torch.Tensor, batch_size: int, weights: dict | None = None) -> tuple[float, int]:
    """Summed next-token NLL and token count over ``blocks`` (split over the replicas), on every rank."""
    topo = engine.topo
    mine = blocks[topo.dp_rank :: topo.dp_size]
    total = torch.zeros(2, dtype=torch.float64, device=engine.device)

    def add(_, logits, ids):
        total[0] += nll_per_block(logits, ids).sum()
        total[1] += ids[:, 1:].numel()

    most = -(-len(blocks) // topo.dp_size)  # replica 0's blocks, the most any replica has
    forward_batches(engine, [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)], add, weights,
                    rounds=-(-most // batch_size))
    dist.all_reduce(total)
    return float(total[0]), int(total[1])


def read_export(engine, folder: Path) -> dict[str, torch.Tensor] | None:
    """This stage's tensors read by name from an exported HF folder (``modeling.read_stage_tensors``), in fp32 on
    the stage's device; None on every rank when any stage cannot be read alone (a layout transformers converts on
    load, such as MoE experts saved one by one). Waits for the main process to finish the folder."""
    dist.barrier()  # the main process writes the index and the config after the stages' shards
    experts = getattr(engine, "experts", None)
    try:
        weights = {n: t.to(engine.device, torch.float32) for n, t in read_stage_tensors(engine.stage, str(folder)).items()}
        if experts is not None:  # the folder holds every expert: this rank's slice
            weights.update({n: weights[n][experts.local_slice(n)] for n in experts.names if n in weights})
    except KeyError:
        weights = None
    readable = torch.tensor([0 if weights is None else 1], device=engine.device)
    dist.all_reduce(readable, op=dist.ReduceOp.MIN)
    return weights if readable.item() else None


class StageScorer:
    """The model behind lm-eval's log-likelihood requests (``eval.lm_eval.PipelineLM``) as a pipeline: its
    ``score_requests`` runs the request batches through the stages with the newest weights, or ``weights`` (an
    export read back by :func:`read_export`). Collective: every rank scores the same requests."""

    def __init__(self, engine, weights: dict[str, torch.Tensor] | None = None):
        self.engine, self.weights, self.config = engine, weights, engine.config

    def score_requests(self, requests: list[tuple[list[int], list[int]]], batch_size: int, pad_id: int,
                       length: int) -> list[tuple[float, bool]]:
        """lm-eval's answer to each (context ids, continuation ids) request, on every rank: the summed
        log p(continuation | context) and whether the continuation is the greedy one. The batches are ``HFLM``'s
        (``request_batches``); replica r scores batches r, r + dp, ...; the last stages fill their requests' answers
        and a sum over all ranks gives everyone all of them."""
        topo = self.engine.topo
        every = request_batches(requests, batch_size, pad_id, length)
        batches = every[topo.dp_rank :: topo.dp_size]
        answers = torch.zeros(len(requests), 2, dtype=torch.float64, device=self.engine.device)

        def fill(i, logits, _):
            chunk, _, lengths = batches[i]
            answers[chunk] = continuation_logprobs(logits, chunk, lengths, requests)

        forward_batches(self.engine, [ids for _, ids, _ in batches], fill, self.weights,
                        rounds=-(-len(every) // topo.dp_size))
        dist.all_reduce(answers)
        return [(logprob, greedy == 1.0) for logprob, greedy in answers.tolist()]
