"""The recipe's optimizer over a module: parameter classification and ``build_optimizer``.

Classification (by the original HF parameter names, so a whole ``*ForCausalLM`` and a pipeline
stage module built from it classify alike), in this order:

- ``adamw_no_decay``: biases (a name ending in ``bias``, which also catches GPT-OSS's 2-D
  ``experts.*_proj_bias`` stacks) and every tensor below 2-D (norm weights, attention sinks).
- ``adamw``: embeddings (``nn.Embedding`` owners), everything outside the decoder layers
  (``lm_head``), MoE routers, and tensors above 3-D. A router is a module whose class name ends in
  ``Router`` (any case: ``MixtralTopKRouter``, ``DeepseekV3TopkRouter``, ``GptOssTopKRouter``, ...),
  a ``shared_expert_gate``, or a module named ``gate``/``router`` next to an ``experts`` sibling
  (older or custom MoE blocks). Llama's ``mlp.gate_proj`` is an ordinary matrix.
- ``muon``: 2-D matrices and 3-D expert stacks inside decoder layers (a name with
  ``layers.N.``, ``layer.N.``, ``h.N.``, ``blocks.N.`` or ``block.N.``), GPT-2's Conv1D included.

Weight decay: ``muon`` and ``adamw`` tensors decay, ``adamw_no_decay`` ones never do (for every
optimizer name).
"""
from __future__ import annotations

import re

import torch

from .muon import Muon

__all__ = ["classify_parameters", "build_optimizer", "fused_gate_up", "KINDS"]

KINDS = ("muon", "adamw", "adamw_no_decay")
_LAYER = re.compile(r"(^|\.)(layers|layer|h|blocks|block)\.\d+\.")
_ROUTER_CLASS = re.compile(r"router$", re.IGNORECASE)
_HEAD = re.compile(r"(^|\.)(lm_head|embed_out|output)\.")


def _is_router(name: str, module: torch.nn.Module, parent: torch.nn.Module | None) -> bool:
    last = name.rsplit(".", 1)[-1]
    if _ROUTER_CLASS.search(type(module).__name__) or last == "shared_expert_gate":
        return True
    return last in ("gate", "router") and parent is not None and hasattr(parent, "experts")


def classify_parameters(module: torch.nn.Module) -> dict[str, str]:
    """Parameter name -> ``'muon'`` | ``'adamw'`` | ``'adamw_no_decay'`` (rules in the module docstring).

    Works on meta-device models (only names, shapes and module classes are read).
    """
    modules = dict(module.named_modules())
    routers, embeddings = set(), set()
    for name, m in modules.items():
        parent = modules.get(name.rsplit(".", 1)[0] if "." in name else "") if name else None
        if isinstance(m, torch.nn.Embedding):
            embeddings.add(name)
        elif name and _is_router(name, m, parent):
            routers.add(name)
    out = {}
    for name, p in module.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if leaf.endswith("bias") or p.dim() < 2:
            out[name] = "adamw_no_decay"
        elif owner in routers or owner in embeddings or p.dim() > 3 or not _LAYER.search(name):
            out[name] = "adamw"
        else:
            out[name] = "muon"
    return out


def fused_gate_up(module: torch.nn.Module) -> list[str]:
    """Names of fused MoE expert ``gate_up_proj`` stacks laid out (E, 2I, H): gate rows then up rows, as transformers 5
    stores Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3 and most MoE experts (``...chunk(2, dim=-1)`` of the product).

    The layout is read from the sibling ``down_proj`` (E, H, I): a ``gate_up_proj`` of shape (E, 2I, H) next to it is
    split. Another layout (GPT-OSS stores (E, H, 2I) with gate and up interleaved) is left fused, and the caller logs
    it, rather than split wrongly."""
    params = dict(module.named_parameters())
    out = []
    for name, p in params.items():
        prefix, _, leaf = name.rpartition(".")
        down = params.get(f"{prefix}.down_proj")
        if leaf != "gate_up_proj" or p.dim() != 3 or down is None or down.dim() != 3:
            continue
        e, h, i = down.shape
        if tuple(p.shape) == (e, 2 * i, h):
            out.append(name)
    return out


def _summary(opt_name: str, group: dict) -> str:
    hyper = {"lr": group["lr"], "weight decay": group["weight_decay"]}
    if group.get("use_muon"):
        hyper.update({"momentum": group["momentum"], "adjust_lr": group["adjust_lr"], "ns_steps": group["ns_steps"]})
    params = group["params"]
    return (f"optimizer {opt_name} group {group['name']}: {len(params)} tensors, {sum(p.numel() for p in params):,} "
            f"parameters, " + ", ".join(f"{k} {v}" for k, v in hyper.items()))


def build_optimizer(module: torch.nn.Module, cfg, log=print) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` (an ``OptimizerConfig``) asks for over ``module``'s trainable parameters.

    ``module`` is a whole model or a pipeline stage (original HF names). ``cfg.name``:

    - ``muon``: one ``Muon`` with a Muon group (``learning_rate``, ``weight_decay``, ``momentum``,
      ``nesterov``, ``ns_steps``, ``adjust_lr``, ``ns_dtype``) and two AdamW groups, ``adamw`` and
      ``adamw_no_decay`` (lr ``adamw_lr`` or ``learning_rate``; betas, eps; weight decay
      ``adamw_weight_decay`` or ``weight_decay``, 0 for the no-decay group). With
      ``muon_split_fused`` (default), fused MoE expert ``gate_up_proj`` stacks (``fused_gate_up``) go to a
      ``muon_split`` group that orthogonalizes the gate and the up projection of each expert apart.
    - ``adamw``: ``torch.optim.AdamW`` (``learning_rate``, betas, eps, ``weight_decay``).
    - ``nadam``: ``torch.optim.NAdam`` (AdamW with a Nesterov first moment) with decoupled weight decay and
      beta1 ``adam_beta1`` (unset: 0.99, Ajanthan et al.'s Nesterov baseline for asynchronous pipelines). Its
      ``momentum_decay`` is ``nadam_momentum_decay`` (default 1000: the effective beta1 is beta1 from the
      first step, as that work means; torch's default 0.004 keeps it near 0.5-0.89 of beta1 for 10k steps).
    - ``sgd``: ``torch.optim.SGD`` with ``momentum`` and ``nesterov``; its weight decay is torch's
      (L2, added to the gradient).

    The non-Muon optimizers get groups ``decay`` and ``no_decay`` (``adamw_lr`` and
    ``adamw_weight_decay`` only concern Muon's AdamW side). Every group is logged through ``log``.
    A module with decoder layers always has Muon matrices; a pipeline stage without any (only the
    head, say) gets the AdamW groups alone, and that is logged.
    """
    kinds = classify_parameters(module)
    groups: dict[str, list] = {k: [] for k in KINDS}
    for n, p in module.named_parameters():
        if p.requires_grad:
            groups[kinds[n]].append(p)
    betas = (adam_beta1(cfg), cfg.adam_beta2)
    if cfg.name == "muon":
        if not groups["muon"]:
            stray = [n for n, p in module.named_parameters() if kinds[n] == "adamw" and p.dim() >= 2
                     and not _HEAD.search(n) and not any(n.startswith(e + ".") for e, m in module.named_modules()
                                                         if isinstance(m, torch.nn.Embedding))]
            if stray:
                raise ValueError(f"optimizer.name: muon found no matrix inside a decoder layer (names like "
                                 f"'model.layers.0.mlp.up_proj.weight'), but matrices such as {stray[:3]}; "
                                 "this model's layout is not recognized: use optimizer.name adamw")
            log("optimizer muon: this module has no decoder-layer matrices (a stage without layers?); AdamW side only")
        adam_lr = cfg.adamw_lr if cfg.adamw_lr is not None else cfg.learning_rate
        adam_wd = cfg.adamw_weight_decay if cfg.adamw_weight_decay is not None else cfg.weight_decay
        adam = dict(use_muon=False, lr=adam_lr, betas=betas, eps=cfg.adam_epsilon)
        muon = dict(use_muon=True, lr=cfg.learning_rate, momentum=cfg.momentum, nesterov=cfg.nesterov,
                    weight_decay=cfg.weight_decay, ns_steps=cfg.ns_steps, adjust_lr=cfg.adjust_lr,
                    ns_dtype=_ns_dtype(cfg.ns_dtype, groups["muon"]))
        split = set(fused_gate_up(module)) if cfg.muon_split_fused else set()
        fused = {id(p) for n, p in module.named_parameters() if n in split}
        if cfg.muon_split_fused:
            left = [n for n, p in module.named_parameters() if n.endswith("gate_up_proj") and kinds[n] == "muon"
                    and n not in split]
            if left:
                log(f"optimizer muon: {left[0]} (and {len(left) - 1} more) is not in the (E, 2I, H) gate-then-up layout; "
                    "orthogonalized fused")
        pg = [dict(params=[p for p in groups["muon"] if id(p) not in fused], name="muon", **muon),
              dict(params=[p for p in groups["muon"] if id(p) in fused], name="muon_split", split_rows=2, **muon),
              dict(params=groups["adamw"], name="adamw", weight_decay=adam_wd, **adam),
              dict(params=groups["adamw_no_decay"], name="adamw_no_decay", weight_decay=0.0, **adam)]
        opt = Muon([g for g in pg if g["params"]])
    else:
        pg = [dict(params=groups["muon"] + groups["adamw"], name="decay", weight_decay=cfg.weight_decay),
              dict(params=groups["adamw_no_decay"], name="no_decay", weight_decay=0.0)]
        pg = [g for g in pg if g["params"]]
        if cfg.name == "adamw":
            opt = torch.optim.AdamW(pg, lr=cfg.learning_rate, betas=betas, eps=cfg.adam_epsilon,
                                    fused=True if cfg.fused else None)
        elif cfg.name == "nadam":
            opt = torch.optim.NAdam(pg, lr=cfg.learning_rate, betas=betas, eps=cfg.adam_epsilon,
                                    momentum_decay=cfg.nadam_momentum_decay, decoupled_weight_decay=True)
        elif cfg.name == "sgd":
            opt = torch.optim.SGD(pg, lr=cfg.learning_rate, momentum=cfg.momentum,
                                  nesterov=cfg.nesterov and cfg.momentum > 0)
        else:
            raise ValueError(f"optimizer.name: {cfg.name!r} is not one of 'muon', 'adamw', 'nadam', 'sgd'")
    for g in opt.param_groups:
        log(_summary(cfg.name, g))
    return opt


def adam_beta1(cfg) -> float:
    """``optimizer.adam_beta1``, or its default when unset: 0.99 for NAdam (the constant high Nesterov momentum of
    Ajanthan et al.), 0.9 (transformers' and torch's) for AdamW and Muon's AdamW side."""
    if cfg.adam_beta1 is not None:
        return cfg.adam_beta1
    return 0.99 if cfg.name == "nadam" else 0.9


def _ns_dtype(setting: str, params: list) -> str:
    """``optimizer.ns_dtype: auto``: the fast dtype of the device the matrices live on (bfloat16 on a GPU,
    float32 on a CPU, which emulates bfloat16 matmuls)."""
    if setting != "auto":
        return setting
    return "bfloat16" if params and params[0].device.type == "cuda" else "float32"
