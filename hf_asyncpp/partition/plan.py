"""Where the pieces of a causal LM live, and how its layers are split into stages (no stage is built here).

Everything in this file works on a meta model (or a config, from which a meta model is built), so a 10B
model can be planned without allocating it.
"""
from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from .trace import Anatomy, PartitionError, get_module, trace
from ..model.vocab_parallel import VocabShards, vocab_ranges

_ANATOMY: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def anatomy(model: nn.Module) -> Anatomy:
    """Where the model's pieces run (``trace.trace``), cached per model and per structure of its layers."""
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise PartitionError(f"{type(model).__name__}: cannot find the decoder layers; only transformers causal LMs "
                             "(with a config) can be split")
    key = tuple(id(m) for m in model.modules())
    hit = _ANATOMY.get(model)
    if hit is None or hit[0] != key:
        hit = (key, trace(model))
        _ANATOMY[model] = hit
    return copy.deepcopy(hit[1])


# ---------------------------------------------------------------------------- plan


@dataclass
class StagePlan:
    layers: range
    params: int  # parameters this stage holds (a tied head copy counts on the last stage)
    cost: float  # estimated forward FLOPs per token


@dataclass
class PartitionPlan:
    """The split: per stage its layers, parameter count and cost; which stage owns each parameter name."""

    stages: list[StagePlan]
    anatomy: Anatomy
    num_layers: int
    tied: bool  # input and output embeddings share one parameter in the model
    param_names: list[list[str]]  # per stage, the names its ``named_parameters()`` yields
    _owner: dict[str, int] = field(default_factory=dict, repr=False)
    tied_pairs: list[tuple[str, str]] = field(default_factory=list)  # (name on an earlier stage, copy's name on a later)
    vocab: "VocabShards | None" = None
    """The output layer cut over every stage (``pipeline.vocab_parallel``, ``model/vocab_parallel.py``), or None: the
    last stage holds it whole. With it the output layer and the loss are in no stage's ``cost`` and the head's weight
    in no stage's ``param_names`` but as its rows' shard (``lm_head.weight@v0:v1``) in every stage's; each stage computes
    ``vocab_cost`` in its VOCAB passes."""
    head_cost: float = 0.0
    """Forward FLOPs per token of the output layer and the loss over the whole vocabulary (2 x its weights + 8 x
    vocab), in the last stage's ``cost`` unless the vocabulary is shared."""
    vocab_shard_params: int = 0
    """With the vocabulary shared: the parameters of one stage's shard of the output layer (its largest: ceil(vocab /
    stages) rows)."""

    @property
    def vocab_parallel(self) -> bool:
        """The vocabulary layers shared by every stage."""
        return self.vocab is not None

    @property
    def vocab_cost(self) -> float:
        """Forward FLOPs per token of one stage's shard of the output layer and loss (``head_cost`` / stages) with
        ``vocab_parallel``, else 0."""
        return self.head_cost / len(self.stages) if self.vocab_parallel else 0.0

    def stage_of(self, name: str) -> int:
        """The stage owning original parameter ``name`` (a tied head's name: the last stage, which holds the copy)."""
        try:
            return self._owner[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a parameter of the partitioned model") from None

    def format(self) -> str:
        total = sum(s.cost + self.vocab_cost for s in self.stages) or 1.0
        rows = [f"{'stage':>5}  {'layers':>9}  {'params':>14}  {'GFLOP/token':>11}  {'share':>6}"]
        copies = {b for _, b in self.tied_pairs}
        for i, s in enumerate(self.stages):
            last = i == len(self.stages) - 1
            extra = (" +embed" if i == 0 else "") + ((" +norm" if self.vocab_parallel else " +norm+head") if last else "")
            if self.vocab is not None:  # the head's cost per token in every stage's VOCAB passes, beside the layers'
                v0, v1 = self.vocab.ranges[i]
                extra += f" +head rows {v0}-{v1 - 1} (VOCAB: {self.vocab_cost / 1e9:.4f})"
            n_copies = sum(n in copies for n in self.param_names[i])
            if n_copies:  # tensors an earlier stage also holds (a tied head, a block shared by several layers)
                extra += f" +{n_copies} shared cop{'y' if n_copies == 1 else 'ies'}"
            lay = f"{s.layers.start}-{s.layers.stop - 1}" if len(s.layers) else "-"
            rows.append(f"{i:>5}  {lay:>9}  {s.params:>14,}  {s.cost / 1e9:>11.4f}  {(s.cost + self.vocab_cost) / total:>6.1%}{extra}")
        return "\n".join(rows)

    __str__ = format


def balanced_sizes(costs: list[float], first: float, last: float, p: int, shared: float = 0.0) -> list[int]:
    """Contiguous split of per-layer costs into p non-empty stages minimizing the most expensive stage (exact DP).
    ``shared``: what every stage adds alike (its shard of the vocabulary layers shared by every stage, where the head
    is then not in ``last``); it changes no stage's rank, so the layers split as if the head were not there, evenly
    where the layers are alike."""
    L = len(costs)
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    INF = float("inf")
    best = [[INF] * (L + 1) for _ in range(p + 1)]  # best[k][i]: first i layers in k stages, min of the max stage cost
    cut = [[0] * (L + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for i in range(k, L - (p - k) + 1):
            for j in range(k - 1, i):
                c = pre[i] - pre[j] + (first if k == 1 else 0.0) + (last if k == p else 0.0) + shared
                v = max(best[k - 1][j], c)
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    sizes, i = [], L
    for k in range(p, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def moe_shape(cfg) -> tuple[int | None, int]:
    """(routed experts per MoE layer, or None for a dense model; experts per token) from a transformers config, under
    each family's name for the count (Mixtral's ``num_local_experts``, Qwen's ``num_experts``, DeepSeek's
    ``n_routed_experts``): the one reading of it for the partitioner, the router's loss, the planner and the card."""
    E = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None)
    return E, getattr(cfg, "num_experts_per_tok", None) or 1


def _check_split(num_stages, layers_per_stage, L: int) -> list[int] | None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise PartitionError(f"num_stages: {num_stages!r} must be an integer >= 1")
    if num_stages > L:
        raise PartitionError(f"num_stages: {num_stages} stages for {L} decoder layers; use at most {L} stages")
    if layers_per_stage is None:
        return None
    sizes = list(layers_per_stage)
    # every stage holds a layer: a stage of 0 layers has nothing to run between its neighbours (the model's forward
    # ends before it), and each process runs one stage
    if (len(sizes) != num_stages or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes)
            or sum(sizes) != L):
        raise PartitionError(f"layers_per_stage: {sizes} must have {num_stages} positive integers summing to the {L} "
                             f"decoder layers (it has {len(sizes)} entries summing to {sum(n for n in sizes if isinstance(n, int))})")
    return sizes


def partition_plan(model_or_config, num_stages: int, layers_per_stage: list[int] | None = None,
                   seq_len: int = 2048, vocab_parallel: bool = False) -> PartitionPlan:
    """The split (layers, parameters, estimated cost per stage), without building stages.

    Accepts a model (any device, meta included) or a config (a meta model is built from it). Automatic balance
    minimizes the most expensive stage by forward FLOPs per token: 2 x the parameters of each layer (experts
    weighted by top-k / E), attention 4 x seq_len x hidden per layer; the first stage adds the embedding lookup,
    the last the lm_head's 2 x vocab x hidden plus 8 x vocab for the softmax / cross-entropy (max, subtract, exp,
    sum, log, gather: a handful of element-wise operations per logit). Measured on the 2-process CPU pipeline
    (bench/throughput.py, Llama h128, vocab 4096): the head costs 2.3 layers, as 2 x its parameters predicts; an
    earlier 128 x vocab softmax term overweighted it to 3.4 layers and split 8 layers 6/2 instead of 5/3 (0.72
    instead of 0.90 of the no-bubble limit).

    ``vocab_parallel``: the vocabulary layers shared by every stage: the output layer's weight is cut by vocabulary
    rows over every stage (``model/vocab_parallel.py``): each stage holds its rows under a name of its own
    (``lm_head.weight@v0:v1``); the head and the loss (``head_cost``) leave the last stage, each stage gets 1/num_stages
    of them (``vocab_cost``, its VOCAB passes; ``vocab_shard_params``), and the layers are balanced without them
    (evenly, where the layers are alike).
    """
    model = model_or_config
    if not isinstance(model, nn.Module):
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_or_config)
    a = anatomy(model)
    layers = get_module(model, a.layers)
    L, cfg = len(layers), model.config
    sizes = _check_split(num_stages, layers_per_stage, L)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None) or getattr(cfg, "d_model", 0) or 0
    E, k = moe_shape(cfg)

    def layer_cost(layer: nn.Module) -> float:
        flops = sum(2 * p.numel() * (k / E if (E and p.dim() == 3 and p.shape[0] == E) else 1.0) for p in layer.parameters())
        return flops + 4 * seq_len * hidden

    costs = [layer_cost(layer) for layer in layers]
    vocab = getattr(cfg, "vocab_size", 0) or 0

    def unit_flops(path):  # a lookup table costs a copy of one row per token, anything else 2 x its weights
        m = get_module(model, path)
        return sum(2 * (x.embedding_dim if isinstance(x, nn.Embedding) else sum(q.numel() for q in x.parameters(recurse=False)))
                   for x in m.modules())

    first_cost = sum(unit_flops(u) for u, ph in a.units.items() if ph == "pre") or 2 * hidden
    head_cost = (unit_flops(a.head) if a.head in a.units else 0) + 8 * vocab
    last_cost = sum(unit_flops(u) for u, ph in a.units.items() if ph == "post") + 8 * vocab
    emb, head = get_module(model, a.embed[0]) if a.embed else None, get_module(model, a.head)
    tied = emb is not None and head is not None and getattr(emb, "weight", None) is getattr(head, "weight", 0)
    head_numel = sum(q.numel() for q in head.parameters()) if head is not None else 0
    shards = None
    if vocab_parallel:
        if tied or not isinstance(head, nn.Linear) or head.bias is not None or a.head not in a.units:
            raise PartitionError(f"{type(model).__name__}: the output layer cannot be cut over the stages (vocab_parallel): "
                                 "it must be an untied nn.Linear without bias")
        shards = VocabShards(a.head, tuple(vocab_ranges(head.out_features, num_stages)))
        last_cost -= head_cost  # every stage runs its share in its VOCAB passes: in no stage's cost
    shard_params = -(-head_numel // num_stages) if vocab_parallel else 0  # ceil: the largest shard
    if sizes is None:
        sizes = balanced_sizes(costs, first_cost, last_cost, num_stages, head_cost / num_stages if vocab_parallel else 0.0)
    layer_stage = [s for s, n in enumerate(sizes) for _ in range(n)]
    owner, param_names, tied_pairs = _owners(model, a, layer_stage, num_stages)
    numel = {n: p.numel() for n, p in model.named_parameters(remove_duplicate=False)}
    if shards is not None:
        param_names[-1].remove(shards.name)
        hidden_in = head.in_features
        for s, names in enumerate(param_names):
            v0, v1 = shards.ranges[s]
            names.append(shards.shard_name(s))
            owner[shards.shard_name(s)] = s
            numel[shards.shard_name(s)] = (v1 - v0) * hidden_in
    stages, start = [], 0
    for s, n in enumerate(sizes):
        cost = sum(costs[start:start + n]) + (first_cost if s == 0 else 0.0) + (last_cost if s == num_stages - 1 else 0.0)
        stages.append(StagePlan(range(start, start + n), sum(numel[x] for x in param_names[s]), cost))
        start += n
    return PartitionPlan(stages, a, L, tied, param_names, owner, tied_pairs, shards, head_cost, shard_params)


def stage_of_path(a: Anatomy, path: str, layer_stage: list[int], num_stages: int) -> int:
    """The stage holding the module or parameter at ``path`` (a layer's: its layer's stage; else its unit's)."""
    if path.startswith(a.layers + "."):
        return layer_stage[int(path[len(a.layers) + 1:].split(".", 1)[0])]
    if path in a.direct:
        return num_stages - 1 if a.direct[path] == "post" else 0
    unit = max((u for u in a.units if path == u or path.startswith(u + ".")), key=len, default=None)
    return num_stages - 1 if unit is not None and a.units[unit] == "post" else 0


def _owners(model, a: Anatomy, layer_stage: list[int], num_stages: int):
    """Per parameter name its stage; per stage the names its ``named_parameters()`` yields; the tied pairs.

    A tensor the model uses under several names (tied embeddings) is held once per stage that needs it: later
    stages get a copy, and (earlier name, later name) is a pair whose gradients are summed and values kept equal.
    """
    owner: dict[str, int] = {}
    names: list[list[str]] = [[] for _ in range(num_stages)]
    first_seen: dict[int, tuple[int, str]] = {}  # tensor -> (stage, name) where it is first held
    held: set[tuple[int, int]] = set()
    pairs = []
    for name, p in model.named_parameters(remove_duplicate=False):
        s = stage_of_path(a, name, layer_stage, num_stages)
        owner[name] = s
        if (id(p), s) in held:
            continue  # the stage's named_parameters() yields a shared tensor once
        held.add((id(p), s))
        names[s].append(name)
        if id(p) in first_seen:
            pairs.append((first_seen[id(p)][1], name))
        else:
            first_seen[id(p)] = (s, name)
    return owner, names, pairs
