"""Optimizers: hybrid Muon (+AdamW side), AdamW, NAdam, SGD; the EF delay correction; the delay simulator."""
from __future__ import annotations

import re

import torch

from .delay import DelaySimulator
from .ef import apply_delay_correction, install_error_feedback
from .muon import Muon, zeropower_via_newtonschulz

__all__ = ["build_optimizer", "classify_parameters", "apply_delay_correction", "install_error_feedback",
           "DelaySimulator", "Muon", "zeropower_via_newtonschulz"]

_LAYER = re.compile(r"(^|\.)(layers|h|blocks|block)\.\d+\.")
_ROUTER = re.compile(r"(router|topkrouter)$", re.IGNORECASE)


def classify_parameters(module: torch.nn.Module) -> dict[str, str]:
    """name -> 'muon' | 'adamw' | 'adamw_no_decay'.

    Muon: matrices (2-D, or 3-D expert stacks) inside decoder layers. AdamW: embeddings, lm_head,
    MoE routers (``*Router`` modules, ``shared_expert_gate``). No weight decay: norms and biases (< 2-D).
    """
    routers = {name for name, m in module.named_modules() if _ROUTER.search(type(m).__name__)}
    embeddings = {name for name, m in module.named_modules() if isinstance(m, torch.nn.Embedding)}
    out = {}
    for name, p in module.named_parameters():
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if p.dim() < 2:
            out[name] = "adamw_no_decay"
        elif owner in routers or owner in embeddings or name.endswith("shared_expert_gate.weight") or not _LAYER.search(name):
            out[name] = "adamw"
        else:
            out[name] = "muon"
    return out


def build_optimizer(module: torch.nn.Module, cfg, log=print) -> torch.optim.Optimizer:
    """The recipe's optimizer over ``module``'s parameters (a whole model or a pipeline stage)."""
    kinds = classify_parameters(module)
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    groups: dict[str, list] = {"muon": [], "adamw": [], "adamw_no_decay": []}
    for n, p in named:
        groups[kinds[n]].append(p)
    wd_adam = cfg.weight_decay if cfg.adamw_weight_decay is None else cfg.adamw_weight_decay
    if cfg.name == "muon":
        if not groups["muon"]:
            raise ValueError("optimizer.name: muon found no matrix inside a decoder layer to optimize; use adamw")
        adam_lr = cfg.adamw_lr or cfg.learning_rate
        adam = dict(use_muon=False, lr=adam_lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
        pg = [dict(params=groups["muon"], use_muon=True, lr=cfg.learning_rate, momentum=cfg.momentum,
                   nesterov=cfg.nesterov, weight_decay=cfg.weight_decay, ns_steps=cfg.ns_steps, adjust_lr=cfg.adjust_lr,
                   ns_dtype=cfg.ns_dtype,
                   name="muon"),
              dict(params=groups["adamw"], weight_decay=wd_adam, name="adamw", **adam),
              dict(params=groups["adamw_no_decay"], weight_decay=0.0, name="adamw_no_decay", **adam)]
        opt = Muon([g for g in pg if g["params"]])
    else:
        merged = groups["muon"] + groups["adamw"]
        pg = [dict(params=merged, weight_decay=wd_adam if cfg.name != "sgd" else cfg.weight_decay, name="decay"),
              dict(params=groups["adamw_no_decay"], weight_decay=0.0, name="no_decay")]
        pg = [g for g in pg if g["params"]]
        if cfg.name == "adamw":
            opt = torch.optim.AdamW(pg, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
        elif cfg.name == "nadam":  # Ajanthan et al.'s async-pipeline baseline: Nesterov with beta1 = 0.99
            opt = torch.optim.NAdam(pg, lr=cfg.learning_rate, betas=(0.99, cfg.adam_beta2), eps=cfg.adam_epsilon,
                                    decoupled_weight_decay=True)
        elif cfg.name == "sgd":
            opt = torch.optim.SGD(pg, lr=cfg.learning_rate, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0)
        else:
            raise ValueError(f"optimizer.name: {cfg.name!r} is not one of 'muon', 'adamw', 'nadam', 'sgd'")
    for g in opt.param_groups:
        log(f"optimizer group {g.get('name')}: {len(g['params'])} tensors, {sum(p.numel() for p in g['params']):,} parameters, lr {g['lr']}")
    return opt
