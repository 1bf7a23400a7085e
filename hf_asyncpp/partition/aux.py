"""transformers' router auxiliary loss, pooled across stages (2E + 1 numbers cross a stage boundary)."""
from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from .trace import PartitionError, get_module


@dataclass(frozen=True)
class AuxLoss:
    """transformers' Switch load-balancing loss, computed from statistics pooled over every MoE layer of every stage.

    ``load_balancing_loss_func`` only needs, summed over all router calls: the softmax probabilities per expert
    (differentiable), the top-k assignment counts per expert, and the number of rows. Stages add their layers' sums
    to the running totals they receive, so what crosses a stage boundary is 2E + 1 numbers, whatever the depth.
    """

    num_experts: int
    top_k: int
    coef: float
    recorders: tuple  # transformers OutputRecorder specs that capture router logits

    def zeros(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        prob = torch.zeros(self.num_experts, dtype=torch.float32, device=device, requires_grad=torch.is_grad_enabled())
        return prob, torch.zeros(self.num_experts + 1, dtype=torch.int64, device=device)

    def accumulate(self, prob_sum, counts, logits_list):
        """Add router logits to (probability sums (E,), [assignment counts (E,), rows]) in transformers' order."""
        E = self.num_experts
        for logits in logits_list:
            weights = torch.nn.functional.softmax(logits.to(prob_sum.device), dim=-1)
            _, selected = torch.topk(weights, self.top_k, dim=-1)
            sel = selected.reshape(-1)
            hits = torch.zeros(E + 1, dtype=torch.int64, device=counts.device).scatter_add_(0, sel, torch.ones_like(sel))
            hits[E] = weights.shape[0]
            counts = counts + hits
            prob_sum = prob_sum + weights.float().sum(dim=0)
        return prob_sum, counts

    def loss(self, prob_sum, counts) -> torch.Tensor:
        rows = counts[-1].to(torch.float32)
        tokens_per_expert = counts[:-1].to(torch.float32) / rows
        router_prob_per_expert = prob_sum / rows
        return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * self.num_experts


def _aux_loss(model: nn.Module) -> AuxLoss | None:
    """The router aux loss the model adds to its loss, or None; refuses a loss it cannot reproduce from pooled sums."""
    cfg, cls = model.config, type(model).__name__
    if not getattr(cfg, "output_router_logits", False):
        return None
    fn = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    if fn is None:
        if "aux_loss" in inspect.getsource(type(model).forward):
            raise PartitionError(f"{cls}: adds a router aux loss without a module-level load_balancing_loss_func; "
                                 "the stage builder cannot reproduce it")
        return None  # e.g. DeepSeek-V3: auxiliary-loss-free balancing, nothing is added
    rec = None
    for m in (model, get_module(model, getattr(model, "base_model_prefix", "model"))):
        rec = (getattr(m, "_can_record_outputs", None) or {}).get("router_logits") if m is not None else None
        if rec:
            break
    recorders = tuple(rec if isinstance(rec, (list, tuple)) else [rec]) if rec else ()
    if not recorders or any(getattr(r, "target_class", None) is None and getattr(r, "class_name", None) is None for r in recorders):
        raise PartitionError(f"{cls}: adds a router aux loss but declares no router_logits recorder; cannot pool router "
                             "statistics across stages")
    E = getattr(model, "num_experts", None) or _cfg_experts(cfg)
    k = getattr(model, "num_experts_per_tok", None) or getattr(cfg, "num_experts_per_tok", None)
    coef = getattr(model, "router_aux_loss_coef", None)
    coef = coef if coef is not None else getattr(cfg, "router_aux_loss_coef", None)
    if not (E and k and coef is not None):
        raise PartitionError(f"{cls}: adds a router aux loss but its number of experts, top-k or router_aux_loss_coef "
                             "is not where transformers' Switch-loss models keep them")
    aux = AuxLoss(int(E), int(k), float(coef), recorders)
    # The pooled sums are exact only for the Switch loss; check this transformers' function is that loss.
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(7, aux.num_experts, generator=g) for _ in range(3))
    try:
        with torch.no_grad():
            want = fn(logits, aux.num_experts, aux.top_k, None)
            got = aux.loss(*aux.accumulate(*aux.zeros("cpu"), logits))
    except Exception:  # another signature: not the Switch loss
        want = None
    if not torch.is_tensor(want) or not torch.allclose(got, want.float(), rtol=1e-5, atol=1e-7):
        raise PartitionError(f"{cls}: {type(model).__module__}.load_balancing_loss_func is not the Switch loss of pooled "
                             "router statistics; pooling across stages would change the loss")
    return aux


def _cfg_experts(cfg):
    return getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts")


def _router_modules(layer_path: str, layer: nn.Module, recorders) -> list[tuple[nn.Module, int]]:
    """The modules whose outputs transformers records as router logits (same matching rules as its recorder)."""
    out = []
    for name, m in layer.named_modules():
        full = f"{layer_path}.{name}" if name else layer_path
        for r in recorders:
            hit = (r.target_class is not None and isinstance(m, r.target_class)) or (
                r.class_name is not None and full.endswith(r.class_name))
            if hit and r.layer_name is not None:
                hit = "." + r.layer_name.strip(".") + "." in full + "."
            if hit:
                out.append((m, r.index))
    return out


@contextmanager
def _capture(routers: list[tuple[nn.Module, int]]):
    """Collect router logits during the block; the hooks live only as long as the forward."""
    sink: list[torch.Tensor] = []

    def hook(index):
        def fn(module, args, output):
            if not isinstance(output, tuple):
                sink.append(output)
            elif output[index] is not None:
                sink.append(output[index])
        return fn

    handles = [m.register_forward_hook(hook(i)) for m, i in routers]
    try:
        yield sink
    finally:
        for h in handles:
            h.remove()
