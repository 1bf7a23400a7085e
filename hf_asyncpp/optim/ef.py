"""Update-level Error-Feedback delay correction (arXiv 2606.30634), for any optimizer.

With a one-step-stale gradient, the optimizer's own step produces ``u[t] = x_before - x_after``.
The correction extrapolates it: ``x[t+1] = x_before - u[t] - lam * (u[t] - u[t-1])``
(lam = 1: ``x[t+1] = x[t] - 2u[t] + u[t-1]``). The wrapped optimizer's state is untouched.

Choices (documented and tested):
- First step: there is no ``u[t-1]`` yet, so the step is applied plain (no extrapolation from zero,
  which would double the first update).
- Weight decay: ``u`` is the full delta of ``optimizer.step()``, decoupled weight decay included, so
  the correction is blind to how the optimizer built its update.
- Every parameter with a gradient is corrected; a parameter without one this step keeps its buffer.
- State: one parameter-sized buffer per corrected parameter (``u[t-1]``), plus a transient copy of
  the weights during the step. It is saved under ``"error_feedback"`` in the optimizer's state dict.
It is installed through optimizer step hooks, so the object stays a ``torch.optim.Optimizer`` and
LR schedulers work unchanged.
"""
from __future__ import annotations

import torch

KEY = "error_feedback"


def apply_delay_correction(optimizer: torch.optim.Optimizer, cfg) -> torch.optim.Optimizer:
    """Install the correction when ``cfg.delay_correction == 'error_feedback'``; returns the optimizer."""
    if cfg.delay_correction == "none":
        return optimizer
    if cfg.delay_correction != "error_feedback":
        raise ValueError(f"optimizer.delay_correction: {cfg.delay_correction!r} is not one of 'none', 'error_feedback'")
    install_error_feedback(optimizer, cfg.ef_lambda)
    return optimizer


def _params(opt) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def install_error_feedback(optimizer: torch.optim.Optimizer, lam: float = 1.0) -> None:
    ef = {"lam": float(lam), "prev": {}, "before": {}}  # prev: param -> u[t-1]
    optimizer.error_feedback = ef

    def pre(opt, args, kwargs):
        ef["before"] = {p: p.detach().clone() for p in _params(opt) if p.grad is not None}

    @torch.no_grad()
    def post(opt, args, kwargs):
        for p, before in ef["before"].items():
            u = before.sub_(p)  # u[t] = x_before - x_after (reuses the transient copy)
            prev = ef["prev"].get(p)
            if prev is not None:
                p.sub_(u - prev, alpha=ef["lam"])  # x_after - lam (u[t] - u[t-1])
                prev.copy_(u)
            else:
                ef["prev"][p] = u
        ef["before"] = {}

    def save(opt, state_dict):
        index = {p: i for i, p in enumerate(_params(opt))}
        state_dict[KEY] = {"lam": ef["lam"], "prev": {index[p]: t.clone() for p, t in ef["prev"].items()}}
        return state_dict

    def load_pre(opt, state_dict):
        saved = state_dict.pop(KEY, None)
        ef["pending"] = saved

    def load_post(opt):
        saved = ef.pop("pending", None)
        if saved is None:
            return
        params = _params(opt)
        ef["lam"] = saved["lam"]
        ef["prev"] = {params[int(i)]: t.clone().to(params[int(i)].device) for i, t in saved["prev"].items()}

    optimizer.register_step_pre_hook(pre)
    optimizer.register_step_post_hook(post)
    optimizer.register_state_dict_post_hook(save)
    optimizer.register_load_state_dict_pre_hook(load_pre)
    optimizer.register_load_state_dict_post_hook(load_post)
