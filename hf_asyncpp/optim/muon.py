"""Muon with an AdamW side, in one optimizer (so one LR scheduler drives both).

Pure functions first (Newton-Schulz, the Muon and AdamW updates), then a thin
``torch.optim.Optimizer`` whose param groups carry ``use_muon``. The 2-D path is
numerically the same as ``torch.optim.Muon``; 3-D MoE expert tensors (E, A, B)
are orthogonalized per expert in one batched call. ``ns_calls`` counts the
matrices orthogonalized per parameter, so tests can prove Muon never silently
fell back to another update.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7


def zeropower_via_newtonschulz(g: Tensor, steps: int = 5, coefficients=NS_COEFFICIENTS, eps: float = EPS,
                               dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Approximate orthogonalization of the last two dims of ``g`` (batched over leading dims), in bfloat16.

    The quintic iteration does not converge to U V^T but to roughly U S' V^T with S' in [0.5, 1.5], which
    does not hurt training (Keller Jordan). Rows > cols are transposed first so the Gram matrix is small.
    """
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        if x.dim() > 2:  # one batched call over the MoE experts
            upd = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, upd, x, beta=a)
        else:
            upd = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, upd, x, beta=a)
    return x.mT if tall else x


def adjusted_lr(lr: float, shape: torch.Size, how: str) -> float:
    """Per-matrix lr scale: ``original`` sqrt(max(1, A/B)) or ``match_rms_adamw`` 0.2 sqrt(max(A, B))."""
    A, B = shape[-2], shape[-1]
    if how == "original":
        return lr * math.sqrt(max(1.0, A / B))
    if how == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(A, B))
    raise ValueError(f"optimizer.adjust_lr: {how!r} is not one of 'original', 'match_rms_adamw'")


def muon_update(p: Tensor, grad: Tensor, buf: Tensor, *, lr, momentum, nesterov, weight_decay, ns_steps, adjust_lr,
                ns_dtype: torch.dtype = torch.bfloat16) -> None:
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if nesterov else buf
    update = zeropower_via_newtonschulz(update, ns_steps, dtype=ns_dtype)
    p.mul_(1 - lr * weight_decay)
    p.add_(update.to(p.dtype), alpha=-adjusted_lr(lr, p.shape, adjust_lr))


def adamw_update(p: Tensor, grad: Tensor, state: dict, *, lr, betas, eps, weight_decay) -> None:
    """torch.optim.AdamW's single-tensor update."""
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p)
        state["exp_avg_sq"] = torch.zeros_like(p)
    state["step"] += 1
    step = float(state["step"])
    b1, b2 = betas
    p.mul_(1 - lr * weight_decay)
    state["exp_avg"].lerp_(grad, 1 - b1)
    state["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
    denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - b2**step)).add_(eps)
    p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - b1**step))


class Muon(torch.optim.Optimizer):
    """Hybrid optimizer: groups with ``use_muon=True`` get Muon, the others AdamW.

    Muon groups: lr, momentum, nesterov, weight_decay, ns_steps, adjust_lr, ns_dtype (2-D or 3-D params only).
    AdamW groups: lr, betas, eps, weight_decay.
    """

    def __init__(self, param_groups: list[dict]):
        for g in param_groups:
            if "use_muon" not in g:
                raise ValueError("every Muon param group needs use_muon=True/False")
            if g["use_muon"]:
                for p in g["params"]:
                    if p.dim() not in (2, 3):
                        raise ValueError(f"Muon takes 2-D matrices or 3-D expert stacks, got shape {tuple(p.shape)}")
        super().__init__(param_groups, {})
        self.ns_calls: dict[int, int] = {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if g["use_muon"]:
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    muon_update(p, p.grad, state["momentum_buffer"], lr=g["lr"], momentum=g["momentum"],
                                nesterov=g["nesterov"], weight_decay=g["weight_decay"], ns_steps=g["ns_steps"],
                                adjust_lr=g["adjust_lr"], ns_dtype=getattr(torch, g.get("ns_dtype", "bfloat16")))
                    self.ns_calls[id(p)] = self.ns_calls.get(id(p), 0) + (p.shape[0] if p.dim() == 3 else 1)
                else:
                    adamw_update(p, p.grad, state, lr=g["lr"], betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"])
        return loss
