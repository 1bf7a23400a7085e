"""Where the pieces of a causal LM live, and how its layers are split into stages (no stage is built here).

Everything in this file works on a meta model (or a config, from which a meta model is built), so a 10B
model can be planned without allocating it.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

# Mask builder per ``config.layer_types`` entry (names from transformers.masking_utils; None: the layer takes no mask).
MASK_BUILDERS = {
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
    "chunked_attention": "create_chunked_causal_mask",
    "linear_attention": None,
}
_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "final_norm")
_PRE_NAMES = ("drop", "emb_dropout", "embed_dropout", "embd_dropout", "embedding_dropout")


class PartitionError(ValueError):
    """The model or the requested split cannot be partitioned; the message names the module or the knob and why."""


@dataclass
class Anatomy:
    """Module paths of a decoder-only model: first stage ``embed[0]`` (+ positions) + ``pre``, then layers, then norm + head."""

    embed: list[str]  # [token embedding]
    layers: str  # the ModuleList of decoder layers
    norm: str  # final norm (last stage)
    head: str  # lm_head (last stage)
    rotary: str | None  # rotary embedding (buffers only): every stage gets its own copy
    learned_positions: str | None = None  # GPT-2's wpe, added to the token embeddings
    pre: list[str] = field(default_factory=list)  # hidden -> hidden modules after the embedding (dropouts), in order


def get_module(model: nn.Module, path: str | None) -> nn.Module | None:
    if not path:
        return None
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _pp_plan_order(model: nn.Module) -> list[str]:
    """Module paths of the model's ``_pp_plan`` / ``base_model_pp_plan`` in execution order (may be empty)."""
    prefix = getattr(model, "base_model_prefix", "model")
    base = get_module(model, prefix)
    base_plan = dict(getattr(base, "_pp_plan", None) or getattr(model, "base_model_pp_plan", None) or {})
    paths = [k if k.startswith(prefix + ".") else f"{prefix}.{k}" for k in base_plan]
    paths += [k for k in (getattr(model, "_pp_plan", None) or {}) if k not in paths]
    return [p for p in paths if get_module(model, p) is not None]


def anatomy(model: nn.Module) -> Anatomy:
    """Find embed / layers / norm / head, following the model's pipeline plan where it has one."""
    cls = type(model).__name__
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    emb, head = (get_in(), get_out()) if get_in and get_out else (None, None)
    if emb is None or head is None:
        raise PartitionError(f"{cls}: cannot find the decoder layers between input and output embeddings; only decoder-only "
                             "causal LMs with embed / layers / norm / head can be split")
    names = {m: n for n, m in model.named_modules(remove_duplicate=False)}
    embed, head_path = names[emb], names[head]
    order = _pp_plan_order(model)
    layers = next((k for k in order if isinstance(get_module(model, k), nn.ModuleList)), None)
    if layers is None:  # no plan (GPT-2, OLMoE, ...): the decoder's one non-empty ModuleList
        cands = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and n.count(".") == 1 and len(m) > 0]
        if len(cands) != 1:
            raise PartitionError(f"{cls}: cannot find the decoder layers (ModuleLists: {cands}); only decoder-only models "
                                 "with embed / layers / norm / head can be split")
        layers = cands[0]
    base = layers.rsplit(".", 1)[0]
    if order and layers in order:
        i = order.index(layers)
        pre = [k for k in order[:i] if k != embed]
        post = [k for k in order[i + 1:] if k != head_path]
    else:
        pre = [f"{base}.{n}" for n in _PRE_NAMES if get_module(model, f"{base}.{n}") is not None]
        post = [f"{base}.{n}" for n in _NORM_NAMES if get_module(model, f"{base}.{n}") is not None][:1]
    wpe = f"{base}.wpe" if get_module(model, f"{base}.wpe") is not None else None
    pre = [p for p in pre if p != wpe]
    if len(post) != 1:
        raise PartitionError(f"{cls}: expected exactly one final norm between {layers} and {head_path}, found {post or 'none'}")
    rotary = f"{base}.rotary_emb" if get_module(model, f"{base}.rotary_emb") is not None else None
    a = Anatomy([embed], layers, post[0], head_path, rotary, wpe, pre)
    _check_supported(model, a)
    return a


def _check_supported(model: nn.Module, a: Anatomy) -> None:
    """Refuse, naming the module, what the stage builder cannot reproduce (instead of computing something else)."""
    cls = type(model).__name__
    placed = [*a.embed, a.layers, a.norm, a.head, *a.pre] + [p for p in (a.rotary, a.learned_positions) if p]
    for name, _ in model.named_parameters(remove_duplicate=False):
        if not any(name.startswith(p + ".") for p in placed):
            owner = name.rsplit(".", 1)[0]
            raise PartitionError(f"{cls}: parameter {name} (module {owner}) is outside embed / layers / norm / head; the stage "
                                 "builder does not know where in the pipeline that module runs")
    layers = get_module(model, a.layers)
    given = {"attention_mask", "position_ids"} | ({"position_embeddings"} if a.rotary else set())  # what stages pass
    for i, layer in enumerate(layers):
        sig = inspect.signature(layer.forward)
        required = [n for n, p in list(sig.parameters.items())[1:] if n not in given
                    and p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if required:
            raise PartitionError(f"{cls}: {a.layers}.{i} ({type(layer).__name__}.forward) requires {required}, which the "
                                 "base model computes outside its layers (e.g. ALiBi biases); it cannot be split into stages")
    types = getattr(model.config, "layer_types", None) or []
    for i, t in enumerate(types[: len(layers)]):
        if t not in MASK_BUILDERS:
            raise PartitionError(f"{cls}: {a.layers}.{i} has layer type {t!r}; the stage builder knows the masks of "
                                 f"{sorted(MASK_BUILDERS)} only")


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

    def stage_of(self, name: str) -> int:
        """The stage owning original parameter ``name`` (a tied head's name: the last stage, which holds the copy)."""
        try:
            return self._owner[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a parameter of the partitioned model") from None

    def format(self) -> str:
        total = sum(s.cost for s in self.stages) or 1.0
        rows = [f"{'stage':>5}  {'layers':>9}  {'params':>14}  {'GFLOP/token':>11}  {'share':>6}"]
        for i, s in enumerate(self.stages):
            extra = (" +embed" if i == 0 else "") + (" +norm+head" if i == len(self.stages) - 1 else "")
            lay = f"{s.layers.start}-{s.layers.stop - 1}" if len(s.layers) else "-"
            rows.append(f"{i:>5}  {lay:>9}  {s.params:>14,}  {s.cost / 1e9:>11.4f}  {s.cost / total:>6.1%}{extra}")
        return "\n".join(rows)

    __str__ = format


def _numel(module: nn.Module | None) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def balanced_sizes(costs: list[float], first: float, last: float, p: int) -> list[int]:
    """Contiguous split of per-layer costs into p non-empty stages minimizing the most expensive stage (exact DP)."""
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
                c = pre[i] - pre[j] + (first if k == 1 else 0.0) + (last if k == p else 0.0)
                v = max(best[k - 1][j], c)
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    sizes, i = [], L
    for k in range(p, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def _moe_shape(cfg) -> tuple[int | None, int]:
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
    if (len(sizes) != num_stages or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes)
            or sum(sizes) != L):
        raise PartitionError(f"layers_per_stage: {sizes} must have {num_stages} non-negative integers summing to the {L} "
                             f"decoder layers (it has {len(sizes)} entries summing to {sum(n for n in sizes if isinstance(n, int))})")
    return sizes


def partition_plan(model_or_config, num_stages: int, layers_per_stage: list[int] | None = None,
                   seq_len: int = 2048) -> PartitionPlan:
    """The split (layers, parameters, estimated cost per stage), without building stages.

    Accepts a model (any device, meta included) or a config (a meta model is built from it). Automatic balance
    minimizes the most expensive stage by forward FLOPs per token: 2 x the parameters of each layer (experts
    weighted by top-k / E), attention 4 x seq_len x hidden per layer; the first stage adds the embedding lookup,
    the last the lm_head's 2 x vocab x hidden plus 8 x vocab for the softmax / cross-entropy (max, subtract, exp,
    sum, log, gather: a handful of element-wise operations per logit). Measured on the 2-process CPU pipeline
    (bench/throughput.py, Llama h128, vocab 4096): the head costs 2.3 layers, as 2 x its parameters predicts; an
    earlier 128 x vocab softmax term overweighted it to 3.4 layers and split 8 layers 6/2 instead of 5/3 (0.72
    instead of 0.90 of the no-bubble limit).
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
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 0)
    E, k = _moe_shape(cfg)

    def layer_cost(layer: nn.Module) -> float:
        flops = sum(2 * p.numel() * (k / E if (E and p.dim() == 3 and p.shape[0] == E) else 1.0) for p in layer.parameters())
        return flops + 4 * seq_len * hidden

    costs = [layer_cost(layer) for layer in layers]
    emb, head = get_module(model, a.embed[0]), get_module(model, a.head)
    tied = emb.weight is head.weight
    vocab = getattr(cfg, "vocab_size", 0) or 0
    first_cost = 2 * hidden  # embedding lookup (+ positions / scale)
    last_cost = 2 * _numel(head) + 8 * vocab + 2 * _numel(get_module(model, a.norm))
    if sizes is None:
        sizes = balanced_sizes(costs, first_cost, last_cost, num_stages)

    layer_stage = [s for s, n in enumerate(sizes) for _ in range(n)]
    first_paths = [*a.embed, *a.pre] + ([a.learned_positions] if a.learned_positions else [])
    owner: dict[str, int] = {}
    for name, _ in model.named_parameters():  # deduplicated: a tied weight appears under its embedding's name
        rest = name[len(a.layers) + 1:] if name.startswith(a.layers + ".") else None
        owner[name] = layer_stage[int(rest.split(".", 1)[0])] if rest else (
            0 if any(name.startswith(p + ".") for p in first_paths) else num_stages - 1)
    head_name = f"{a.head}.weight"
    if tied:
        owner[head_name] = num_stages - 1 if num_stages > 1 else 0
    param_names: list[list[str]] = [[] for _ in range(num_stages)]
    for name, s in owner.items():
        if not (tied and num_stages == 1 and name == head_name):
            param_names[s].append(name)
    sizes_by_name = {n: p.numel() for n, p in model.named_parameters(remove_duplicate=False)}
    stages, start = [], 0
    for s, n in enumerate(sizes):
        cost = sum(costs[start:start + n]) + (first_cost if s == 0 else 0.0) + (last_cost if s == num_stages - 1 else 0.0)
        stages.append(StagePlan(range(start, start + n), sum(sizes_by_name[x] for x in param_names[s]), cost))
        start += n
    return PartitionPlan(stages, a, L, tied, param_names, owner)
