"""Split a transformers ``*ForCausalLM`` into exact pipeline stages, without touching its code.

Stage contract (the runtime and the tests rely on it):
- ``stages[0](input_ids)`` -> activation; ``stages[i](activation)`` -> activation;
  ``stages[-1](activation, labels=labels)`` -> loss (``stages[-1](activation)`` -> logits).
- An activation is a tensor (hidden states) or a tuple ``(hidden, router_logits_0, ...)``: MoE models
  with the router auxiliary loss carry the per-layer router logits forward, so the last stage computes
  ``router_aux_loss_coef * load_balancing_loss_func(all layers)`` exactly as transformers does, and the
  router gradients flow back through the same tuple. Every element is a float tensor that needs a
  gradient sent back.
- Parameter names are the original model's (``model.layers.3.mlp.gate_proj.weight``); every original
  parameter is in exactly one stage, except tied input/output embeddings, which the first and the last
  stage each hold (see ``tied_parameters``).
- Rotary embeddings and causal / sliding-window masks are rebuilt inside each stage.
"""
from __future__ import annotations

import copy
import inspect
import re
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["partition_model", "partition_plan", "tied_parameters", "merge_state_dicts", "PartitionPlan", "PartitionError"]


class PartitionError(ValueError):
    """The model or the requested split cannot be partitioned; the message says which module and why."""


# ---------------------------------------------------------------------------- anatomy


@dataclass
class Anatomy:
    """Where the pieces of a decoder-only model live (module paths)."""

    embed: list[str]  # first-stage modules applied to input_ids, in order
    layers: str
    norm: str
    head: str
    rotary: str | None
    learned_positions: str | None = None  # GPT-2's wpe
    dropout: str | None = None


def _get(model: nn.Module, path: str | None):
    if not path:
        return None
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def anatomy(model: nn.Module) -> Anatomy:
    """Find embed / layers / norm / head, from ``_pp_plan`` where the model has one."""
    plan = dict(getattr(model, "_pp_plan", None) or {})
    base_prefix = getattr(model, "base_model_prefix", "model")
    base_plan = dict(getattr(getattr(model, base_prefix, None), "_pp_plan", None) or getattr(model, "base_model_pp_plan", None) or {})
    plan.update({f"{base_prefix}.{k}" if not k.startswith(base_prefix + ".") else k: v for k, v in base_plan.items()})
    layers = next((k for k in plan if isinstance(_get(model, k), nn.ModuleList)), None)
    if layers is None:  # no plan (GPT-2, OLMoE): the decoder's ModuleList
        cands = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and n.count(".") == 1 and len(m) > 0]
        if len(cands) != 1:
            raise PartitionError(f"{type(model).__name__}: cannot find the decoder layers (ModuleLists: {cands}); "
                                 "only decoder-only models with embed / layers / norm / head can be split")
        layers = cands[0]
    base = layers.rsplit(".", 1)[0]
    names = {m: n for n, m in model.named_modules()}
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if emb is None or head is None:
        raise PartitionError(f"{type(model).__name__}: no input or output embeddings; not a causal LM with an lm_head")
    norm = next((k for k in plan if k not in (layers, names[emb], names[head]) and _get(model, k) is not None
                 and k.startswith(base + ".")), None)
    if norm is None:
        for cand in ("norm", "ln_f", "final_layernorm", "final_layer_norm"):
            if _get(model, f"{base}.{cand}") is not None:
                norm = f"{base}.{cand}"
                break
    if norm is None:
        raise PartitionError(f"{type(model).__name__}: cannot find the final norm under {base}")
    rotary = f"{base}.rotary_emb" if _get(model, f"{base}.rotary_emb") is not None else None
    wpe = f"{base}.wpe" if _get(model, f"{base}.wpe") is not None else None
    drop = f"{base}.drop" if _get(model, f"{base}.drop") is not None else None
    for extra in ("embed_positions", "embed_scale"):
        if _get(model, f"{base}.{extra}") is not None:
            raise PartitionError(f"{type(model).__name__}: module {base}.{extra} is not supported by the stage builder")
    return Anatomy([names[emb]], layers, norm, names[head], rotary, wpe, drop)


# ---------------------------------------------------------------------------- plan


@dataclass
class StagePlan:
    layers: range
    params: int
    cost: float  # FLOPs per token (forward), estimated


@dataclass
class PartitionPlan:
    stages: list[StagePlan]
    anatomy: Anatomy
    num_layers: int
    tied: bool
    _layer_stage: list[int] = field(default_factory=list, repr=False)

    def stage_of(self, name: str) -> int:
        """Which stage owns the original parameter ``name`` (the first stage for a tied embedding)."""
        a = self.anatomy
        m = re.match(re.escape(a.layers) + r"\.(\d+)\.", name)
        if m:
            return self._layer_stage[int(m.group(1))]
        if any(name.startswith(p + ".") for p in a.embed + [a.learned_positions or "\0"]):
            return 0
        if name.startswith(a.norm + ".") or name.startswith(a.head + "."):
            return len(self.stages) - 1
        raise KeyError(f"{name!r} is not a parameter the partition knows")

    def format(self) -> str:
        total = sum(s.cost for s in self.stages)
        rows = [f"{'stage':>5}  {'layers':>9}  {'params':>12}  {'GFLOP/token':>11}  {'share':>6}"]
        for i, s in enumerate(self.stages):
            extra = (" +embed" if i == 0 else "") + (" +norm+head" if i == len(self.stages) - 1 else "")
            lay = f"{s.layers.start}-{s.layers.stop - 1}" if len(s.layers) else "-"
            rows.append(f"{i:>5}  {lay:>9}  {s.params:>12,}  {s.cost / 1e9:>11.4f}  {s.cost / total:>6.1%}{extra}")
        return "\n".join(rows)

    __str__ = format


def _numel(module: nn.Module | None) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def _balanced(costs: list[float], first: float, last: float, p: int) -> list[int]:
    """Contiguous split of layer costs into p stages minimizing the most expensive stage (exact DP)."""
    L = len(costs)
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    INF = float("inf")
    # best[k][i]: min over splits of the first i layers into k stages of the max stage cost
    best = [[INF] * (L + 1) for _ in range(p + 1)]
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


def partition_plan(model_or_config, num_stages: int, layers_per_stage: list[int] | None = None, seq_len: int = 2048) -> PartitionPlan:
    """The split (layers, parameters, estimated cost per stage), without building stages.

    Accepts a model (any device, meta included) or a config (a meta model is built from it). Automatic
    balance uses forward FLOPs per token: 2 x parameters of each layer (experts weighted by top-k / E),
    attention 4 x seq_len x hidden per layer, and on the last stage the lm_head's 2 x vocab x hidden plus
    128 x vocab for the softmax/cross-entropy (memory-bound; calibrated on the CPU pipeline).
    """
    model = model_or_config
    if not isinstance(model, nn.Module):
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_or_config)
    a = anatomy(model)
    layers = _get(model, a.layers)
    L = len(layers)
    cfg = model.config
    if num_stages < 1:
        raise PartitionError(f"num_stages: {num_stages} must be >= 1")
    if num_stages > L:
        raise PartitionError(f"num_stages: {num_stages} stages for {L} decoder layers; use at most {L} stages")
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 0)
    E = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None)
    k = getattr(cfg, "num_experts_per_tok", None) or 1

    def layer_cost(layer: nn.Module) -> float:
        flops = 0.0
        for n, p in layer.named_parameters():
            active = k / E if (E and p.dim() == 3 and p.shape[0] == E) else 1.0
            flops += 2 * p.numel() * active
        return flops + 4 * seq_len * hidden

    costs = [layer_cost(layer) for layer in layers]
    head = _get(model, a.head)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    first_cost = 2 * hidden  # embedding lookup (+ scale / positions)
    vocab = getattr(cfg, "vocab_size", 0) or 0
    # lm_head matmul + the softmax / cross-entropy over the vocabulary, which is memory-bound. Calibrated from the
    # per-stage compute times of bench/throughput.py (2 pipeline processes sharing the memory bus): about 128
    # FLOP-equivalents per logit (a lone process measures about 64: the loss suffers most from contention)
    last_cost = 2 * _numel(head) + 128 * vocab + 2 * _numel(_get(model, a.norm))
    if layers_per_stage is None:
        sizes = _balanced(costs, first_cost, last_cost, num_stages)
    else:
        sizes = list(layers_per_stage)
        if len(sizes) != num_stages or sum(sizes) != L or min(sizes) < 0:
            raise PartitionError(f"layers_per_stage: {sizes} must have {num_stages} non-negative entries summing to the "
                                 f"{L} decoder layers (it sums to {sum(sizes)})")
    stages, start, layer_stage = [], 0, []
    for s, n in enumerate(sizes):
        r = range(start, start + n)
        params = sum(_numel(layers[i]) for i in r)
        cost = sum(costs[i] for i in r)
        if s == 0:
            params += sum(_numel(_get(model, e)) for e in a.embed) + _numel(_get(model, a.learned_positions))
            cost += first_cost
        if s == num_stages - 1:
            params += _numel(_get(model, a.norm)) + (_numel(head) if not (tied and num_stages == 1) else 0)
            cost += last_cost
        stages.append(StagePlan(r, params, cost))
        layer_stage += [s] * n
        start += n
    return PartitionPlan(stages, a, L, tied, layer_stage)


# ---------------------------------------------------------------------------- stages


class _Box(nn.Module):
    """A plain container so stage parameters keep their original dotted names."""


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    parts = path.split(".")
    node = root
    for p in parts[:-1]:
        if not hasattr(node, p):
            node.add_module(p, _Box())
        node = getattr(node, p)
    node.add_module(parts[-1], module)


def _aux_loss_info(model: nn.Module):
    """(load_balancing_loss_func, num_experts, top_k, coef, router classes) when the model adds a router aux loss."""
    cfg = model.config
    if not getattr(cfg, "output_router_logits", False):
        return None
    mod = sys.modules[type(model).__module__]
    fn = getattr(mod, "load_balancing_loss_func", None)
    if fn is None:
        return None  # e.g. DeepSeek-V3: auxiliary-loss-free balancing
    recorders = getattr(model, "_can_record_outputs", None) or getattr(getattr(model, model.base_model_prefix), "_can_record_outputs", None) or {}
    rec = recorders.get("router_logits")
    router_cls = getattr(rec, "target_class", None)
    index = getattr(rec, "index", 0) or 0
    if router_cls is None:
        raise PartitionError(f"{type(model).__name__}: adds a router aux loss but declares no router_logits recorder; "
                             "cannot carry router statistics between stages")
    E = getattr(model, "num_experts", None) or getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts")
    k = getattr(model, "num_experts_per_tok", None) or getattr(cfg, "num_experts_per_tok")
    return fn, E, k, float(getattr(cfg, "router_aux_loss_coef", 0.0)), router_cls, index


class PipelineStage(nn.Module):
    """One contiguous slice of the model: [embed] + layers[a:b] + [norm + head]."""

    def __init__(self, model: nn.Module, plan: PartitionPlan, index: int):
        super().__init__()
        a, cfg = plan.anatomy, model.config
        self.config = cfg
        self.index, self.num_stages = index, len(plan.stages)
        self.is_first, self.is_last = index == 0, index == self.num_stages - 1
        self.layer_ids = list(plan.stages[index].layers)
        self._layers_path, self._a = a.layers, a
        if self.is_first:
            for e in a.embed + [p for p in (a.learned_positions, a.dropout) if p]:
                _place(self, e, _get(model, e))
        if a.rotary:
            _place(self, a.rotary, copy.deepcopy(_get(model, a.rotary)))
        layers = _get(model, a.layers)
        _place(self, a.layers, nn.ModuleDict({str(i): layers[i] for i in self.layer_ids}))
        if self.is_last:
            _place(self, a.norm, _get(model, a.norm))
            head = _get(model, a.head)
            if plan.tied and self.num_stages > 1:  # the last stage holds its own copy of the tied embedding
                head = copy.deepcopy(head)
            _place(self, a.head, head)
        self._rotary_by_type = a.rotary is not None and "layer_type" in inspect.signature(_get(model, a.rotary).forward).parameters
        self._emb_scale = None
        if self.is_first and cfg.model_type.startswith("gemma") and "Scaled" not in type(_get(model, a.embed[0])).__name__:
            self._emb_scale = float(cfg.hidden_size) ** 0.5
        self._softcap = getattr(cfg, "final_logit_softcapping", None)
        self._loss_fn = model.loss_function if self.is_last else None
        self._aux = _aux_loss_info(model)
        self._router_out: list[torch.Tensor] = []
        if self._aux:
            cls, idx = self._aux[4], self._aux[5]
            for i in self.layer_ids:
                for m in layers[i].modules():
                    if isinstance(m, cls):
                        m.register_forward_hook(lambda mod, inp, out, _i=idx: self._router_out.append(out[_i] if isinstance(out, tuple) else out))

    # -------------------------------------------------------------- helpers
    def _masks(self, h: torch.Tensor, pos: torch.Tensor):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        cfg = self.config
        kw = dict(config=cfg, inputs_embeds=h, attention_mask=None, past_key_values=None, position_ids=pos)
        types = getattr(cfg, "layer_types", None)
        if types:
            out = {}
            for t in set(types[i] for i in self.layer_ids):
                out[t] = create_sliding_window_causal_mask(**kw) if t == "sliding_attention" else create_causal_mask(**kw)
            return lambda i: out[types[i]]
        if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
            m = create_sliding_window_causal_mask(**kw)
        else:
            m = create_causal_mask(**kw)
        return lambda i: m

    def _rope(self, h, pos):
        if not self._a.rotary:
            return lambda i: None
        rot = self.get_submodule(self._a.rotary)
        types = getattr(self.config, "layer_types", None)
        if self._rotary_by_type:
            pe = {t: rot(h, pos, t) for t in set(types[i] for i in self.layer_ids)}
            return lambda i: pe[types[i]]
        pe = rot(h, pos)
        return lambda i: pe

    # -------------------------------------------------------------- forward
    def forward(self, x, labels: torch.Tensor | None = None):
        a = self._a
        self._router_out = []
        if self.is_first:
            ids = x
            h = self.get_submodule(a.embed[0])(ids)
            if self._emb_scale is not None:
                h = h * torch.tensor(self._emb_scale, dtype=h.dtype)
            carried: list[torch.Tensor] = []
        else:
            h, *carried = x if isinstance(x, (tuple, list)) else (x,)
        T = h.shape[1]
        pos = torch.arange(T, device=h.device).unsqueeze(0)
        if self.is_first and a.learned_positions:
            h = h + self.get_submodule(a.learned_positions)(pos)
            if a.dropout:
                h = self.get_submodule(a.dropout)(h)
        mask, rope = self._masks(h, pos), self._rope(h, pos)
        layers = self.get_submodule(a.layers)
        for i in self.layer_ids:
            kw = {"attention_mask": mask(i)}
            pe = rope(i)
            if pe is not None:
                kw.update(position_embeddings=pe, position_ids=pos)
            out = layers[str(i)](h, **kw)
            h = out[0] if isinstance(out, tuple) else out
        routers = carried + list(self._router_out)
        self._router_out = []
        if not self.is_last:
            return (h, *routers) if routers else h
        h = self.get_submodule(a.norm)(h)
        logits = self.get_submodule(a.head)(h)
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        if labels is None:
            return logits
        loss = self._loss_fn(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        if self._aux and routers:
            fn, E, k, coef = self._aux[:4]
            loss = loss + coef * fn(tuple(routers), E, k, None).to(loss.device)
        return loss


def partition_model(model: nn.Module, num_stages: int, layers_per_stage: list[int] | None = None, seq_len: int = 2048) -> list[nn.Module]:
    """``num_stages`` stage modules sharing the model's parameters (tied head copied for the last stage)."""
    plan = partition_plan(model, num_stages, layers_per_stage, seq_len)
    return [PipelineStage(model, plan, s) for s in range(num_stages)]


def tied_parameters(stages: list[nn.Module]) -> list[tuple[str, str]]:
    """(first-stage name, last-stage name) pairs whose gradients must be summed and values kept equal."""
    if len(stages) < 2:
        return []
    first, last = stages[0], stages[-1]
    cfg = first.config
    if not getattr(cfg, "tie_word_embeddings", False):
        return []
    a = first._a
    return [(f"{a.embed[0]}.weight", f"{a.head}.weight")]


def merge_state_dicts(state_dicts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One state dict by original names (a tied head appears under both names, equal values)."""
    merged: dict[str, torch.Tensor] = {}
    for sd in state_dicts:
        merged.update(sd)
    return merged
