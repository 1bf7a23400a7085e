"""The output layer and its loss shared by every stage (Vocabulary Parallelism, Yeung, Qi, Lin, Wan, MLSys 2025).

A causal LM's head and loss weigh one or two decoder layers, and layers cannot be split, so the stage that holds
them is the slowest of an otherwise even split. Here the head's weight is cut by vocabulary rows over all ``p``
stages of a replica (:func:`vocab_ranges`), and each microbatch's head and loss is one collective pass, forward
and backward at once (:func:`vocab_pass`, the executor's ``VOCAB`` action):

1. the last stage's final hidden states ``h`` (after the model's final norm) and the labels are broadcast to every
   stage of the replica;
2. each stage computes its logits ``z_s = h W_s^T``, one chunk of tokens at a time (``model.fused_loss``'s
   chunking), and per token its local max, its sum of ``exp(z_s - max)`` and the target's logit where the target
   falls in its rows: three numbers per token, gathered from every stage in one collective, which give the global
   log-sum-exp and the loss (the mean over the targets that count, as transformers' ``ForCausalLMLoss``);
3. at once, ``dz_s = softmax_s - onehot_s`` (scaled): the shard's weight gradient ``dz_s^T h`` accumulates where the
   caller says (a weight version's leaf), the partial hidden gradient ``dz_s W_s`` is summed onto the last stage,
   whose backward starts from it.

No full-vocabulary logits exist anywhere; a stage holds its shard's logits in the compute dtype (bf16 under
autocast) between the statistics and the gradient, never an fp32 copy of them whole. Numerics are the fused loss's:
the GEMMs in the autocast dtype, the softmax, the loss and the weight gradient's sum in fp32.

Each stage holds its shard as a parameter named after the model's (:func:`shard_name`: ``lm_head.weight@0:12288``),
so checkpoints, exports and resumes onto another split reassemble or re-cut the full matrix by name
(:func:`assemble`; ``pipeline/stage_state._recut``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..errors import RecipeError
from .fused_loss import chunk_tokens, fused_loss_blocker

__all__ = ["vocab_ranges", "VocabShards", "HeadShard", "shard_name", "parse_shard", "assemble",
           "vocab_pass", "vocab_logits", "vocab_parallel_blocker"]

_SHARD = re.compile(r"^(?P<base>.+)@(?P<v0>\d+):(?P<v1>\d+)$")


def vocab_ranges(vocab_size: int, num_stages: int) -> list[tuple[int, int]]:
    """Each stage's rows ``[v0, v1)`` of the output layer: ``ceil(vocab / p)`` rows each, the last ones fewer (an even
    cut keeps every stage's GEMM the same shape, whatever the remainder)."""
    size = -(-vocab_size // num_stages)
    out = [(min(s * size, vocab_size), min((s + 1) * size, vocab_size)) for s in range(num_stages)]
    if any(v1 <= v0 for v0, v1 in out):
        raise ValueError(f"a vocabulary of {vocab_size} rows cut into {num_stages} shards of {size} leaves a stage "
                         "none: use fewer stages or turn pipeline.vocab_parallel off")
    return out


def shard_name(name: str, rows: tuple[int, int]) -> str:
    """A shard's parameter name: the model's name and its rows (``lm_head.weight@0:12288``)."""
    return f"{name}@{rows[0]}:{rows[1]}"


def parse_shard(name: str) -> tuple[str, tuple[int, int]] | None:
    """``(the model's name, rows)`` of a shard's name; None for any other name (also an optimizer or version key's
    prefix stays the caller's to strip)."""
    hit = _SHARD.match(name)
    return (hit["base"], (int(hit["v0"]), int(hit["v1"]))) if hit else None


def assemble(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every set of shards of one name replaced by the full tensor (rows concatenated in order);
    raises where the shards leave a gap or overlap."""
    groups: dict[str, list[tuple[tuple[int, int], torch.Tensor]]] = {}
    out = {}
    for n, t in tensors.items():
        parsed = parse_shard(n)
        if parsed is None:
            out[n] = t
        else:
            groups.setdefault(parsed[0], []).append((parsed[1], t))
    for base, parts in groups.items():
        parts.sort(key=lambda x: x[0])
        if parts[0][0][0] != 0 or any(a[1] != b[0] for (a, _), (b, _) in zip(parts, parts[1:])):
            raise ValueError(f"{base}: the vocabulary shards {[r for r, _ in parts]} do not cover its rows once")
        out[base] = torch.cat([t for _, t in parts]) if len(parts) > 1 else parts[0][1]
    return out


@dataclass(frozen=True)
class VocabShards:
    """The output layer cut over the stages: the head module's path, its weight's name and each stage's rows."""

    head: str  # the head module's path in the model ("lm_head")
    ranges: tuple[tuple[int, int], ...]

    @property
    def name(self) -> str:
        return f"{self.head}.weight"

    def shard_name(self, stage: int) -> str:
        return shard_name(self.name, self.ranges[stage])


class HeadShard(nn.Module):
    """A stage's rows of the output layer, in the head's place: a parameter named after the head's weight and the
    rows (``weight@v0:v1``, so the stage's name is ``lm_head.weight@v0:v1``). Called by the model's forward on the
    last stage, it records its input (the final hidden states) and returns a stand-in of the logits' shape (an
    expanded scalar: no memory); the stage returns what it recorded. The head and loss run in the VOCAB pass."""

    def __init__(self, head: nn.Linear, rows: tuple[int, int]):
        super().__init__()
        self.rows, self.vocab_size = rows, head.out_features
        self.param_name = f"weight@{rows[0]}:{rows[1]}"
        w = head.weight
        shard = torch.empty((rows[1] - rows[0], w.shape[1]), dtype=w.dtype, device=w.device)
        if not w.is_meta:
            with torch.no_grad():
                shard.copy_(w[rows[0]:rows[1]])
        self.register_parameter(self.param_name, nn.Parameter(shard, requires_grad=w.requires_grad))
        self.hidden: torch.Tensor | None = None

    @property
    def weight(self) -> torch.Tensor:
        return self._parameters[self.param_name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hidden = x
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        return torch.empty((), dtype=dtype, device=x.device).expand(*x.shape[:-1], self.vocab_size)

    @torch.no_grad()
    def init_with(self, init_fn) -> None:
        """Initialise the rows as the model's ``_init_weights`` initialises the whole head (the same random draws:
        a temporary full-size linear layer, drawn, then this shard's rows copied), so the values do not depend on
        the cut."""
        w = self.weight
        # built on meta and emptied: a constructor's own init would draw from the stream the model's init reads
        whole = nn.Linear(w.shape[1], self.vocab_size, bias=False, device="meta", dtype=w.dtype).to_empty(device=w.device)
        init_fn(whole)
        w.copy_(whole.weight[self.rows[0]:self.rows[1]])

    def take(self) -> torch.Tensor:
        """The recorded final hidden states (once)."""
        h, self.hidden = self.hidden, None
        if h is None:
            raise RuntimeError("vocabulary shards: the model's forward never called its output head")
        base = h._base
        if base is not None and (base.shape, base.stride(), base.storage_offset()) == (h.shape, h.stride(), h.storage_offset()):
            # the model's ``hidden_states[:, slice(0, None), :]`` (logits_to_keep 0): the whole tensor, as a view;
            # the final norm's output itself is what a split backward may detach in place
            h = base
        return h


def vocab_pass(hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, rows: tuple[int, int], group, src: int,
               weight_grad: torch.Tensor, *, grad_scale: float = 1.0, ignore_index: int = -100,
               chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One microbatch's head and loss over the stages of ``group`` (every one calls it, in microbatch order):
    ``(loss, hidden's gradient)``, the gradient on rank ``src`` only (None elsewhere).

    ``hidden`` ``(..., T, H)`` and ``labels`` ``(..., T)`` (the model's labels, shifted inside) are rank ``src``'s
    (the last stage), broadcast into these tensors on the others. ``weight``: this rank's rows ``rows`` of the head's
    weight, detached; under autocast it is cast to the autocast dtype (a version's bf16 copy needs none).
    ``weight_grad`` (fp32, the shard's shape): the shard's gradient is added to it. The loss is transformers' (the
    mean over targets other than ``ignore_index``), the same on every rank; the gradients are those of
    ``grad_scale * loss`` (the executor's 1 / microbatches)."""
    dist.broadcast(hidden, src=src, group=group)
    dist.broadcast(labels, src=src, group=group)
    dev = hidden.device
    dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else weight.dtype
    w = weight.to(dtype)
    x2 = hidden.reshape(-1, hidden.shape[-1])
    n, vs = x2.shape[0], w.shape[0]
    targets = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].reshape(-1)
    valid = targets != ignore_index
    local = targets - rows[0]
    mine = valid & (local >= 0) & (local < vs)
    safe = torch.where(mine, local, 0)[:, None]
    chunk = chunk or chunk_tokens(vs)
    logits = torch.empty((n, vs), dtype=dtype, device=dev)  # the shard's, kept for the gradient (compute dtype)
    stats = torch.empty((3, n), dtype=torch.float32, device=dev)  # per token: max, sum of exp(z - max), target's z
    with torch.autocast(dev.type, enabled=False):
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = torch.mm(x2[s:e].to(dtype), w.t(), out=logits[s:e]).float()
            top = z.amax(dim=-1)
            stats[0, s:e] = top
            stats[1, s:e] = (z - top[:, None]).exp_().sum(dim=-1)
            stats[2, s:e] = z.gather(1, safe[s:e]).squeeze(1).masked_fill_(~mine[s:e], 0.0)
            del z
        every = torch.empty((dist.get_world_size(group) * 3, n), dtype=torch.float32, device=dev)
        dist.all_gather_single(every, stats, group=group)  # one collective: every stage's statistics
        every = every.view(-1, 3, n)
        top = every[:, 0].amax(dim=0)
        lse = top + (every[:, 1] * (every[:, 0] - top).exp()).sum(dim=0).log()
        target = every[:, 2].sum(dim=0)  # one stage holds each target; the others add exact zeros
        denom = valid.sum()
        loss = torch.where(valid, lse - target, 0.0).sum() / denom
        coef = valid.to(torch.float32).mul_(grad_scale).div_(denom)  # d (scaled loss) / d logit, before the softmax
        minus = mine.to(torch.float32).neg_()[:, None]
        dh = torch.empty(x2.shape, dtype=hidden.dtype, device=dev)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            g = logits[s:e].float().sub_(lse[s:e, None]).exp_()  # the softmax over the whole vocabulary, our rows
            g.scatter_add_(1, safe[s:e], minus[s:e]).mul_(coef[s:e, None])
            g = g.to(dtype)
            x = x2[s:e].to(dtype)
            if dh.dtype == dtype:
                torch.mm(g, w, out=dh[s:e])
            else:
                dh[s:e] = torch.mm(g, w)
            if dtype == torch.float32:
                weight_grad.addmm_(g.t(), x)
            else:
                weight_grad += torch.mm(g.t(), x)
        del logits
    dist.reduce(dh, dst=src, group=group)
    return loss, (dh.view(hidden.shape) if dist.get_rank() == src else None)


@torch.no_grad()
def vocab_logits(hidden: torch.Tensor, weight: torch.Tensor, group, src: int, vocab_size: int) -> torch.Tensor | None:
    """Forward only (an evaluation through the stages): the whole logits ``(..., T, vocab)`` on rank ``src`` (None
    elsewhere), as the model's head gives them (in the autocast dtype under autocast). ``hidden`` is rank ``src``'s
    final hidden states, broadcast into this tensor on the others; each rank's logits of its rows are gathered
    onto ``src`` (padded to the largest shard: a gather takes one shape), which holds the whole logits as the last
    stage of an unshared head does."""
    dist.broadcast(hidden, src=src, group=group)
    dev = hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
    with torch.autocast(dev, enabled=False):
        z = torch.matmul(hidden.to(dtype), weight.to(dtype).t())
    p = dist.get_world_size(group)
    size = -(-vocab_size // p)
    if z.shape[-1] < size:
        z = nn.functional.pad(z, (0, size - z.shape[-1]))
    mine = dist.get_rank() == src
    parts = [torch.empty_like(z) for _ in range(p)] if mine else None
    dist.gather(z.contiguous(), parts, dst=src, group=group)
    return torch.cat(parts, dim=-1)[..., :vocab_size] if mine else None


# ---------------------------------------------------------------------------- the recipe field


def vocab_parallel_blocker(model: nn.Module) -> str | None:
    """Why the output layer cannot be shared by the stages (None: it can): it must be a plain linear over the final
    norm's output with transformers' loss (``fused_loss_blocker``), untied from the input embedding (a tied one would
    be two tensors: its shards and the first stage's embedding) and without a bias."""
    why = fused_loss_blocker(model)
    if why:
        return why
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if emb is not None and head.weight is getattr(emb, "weight", None):
        return "its output layer is tied to its input embedding (tie_word_embeddings)"
    if head.bias is not None:
        return "its output layer has a bias"
    return None
