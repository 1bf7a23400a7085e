"""Update-level Error-Feedback delay correction (arXiv 2606.30634), for any optimizer.

With a one-step-stale gradient, the wrapped optimizer's own step produces
``u[t] = x_before - x_after``. The correction extrapolates it:

    x[t+1] = x_before - u[t] - lam * (u[t] - u[t-1])      (lam = 1: x[t] - 2 u[t] + u[t-1])

and keeps ``u[t]`` for the next step. The wrapped optimizer's own state is never touched.

Choices (documented here, tested in tests/test_optim.py):

- First step: there is no ``u[t-1]`` yet, so the step is applied plain (no extrapolation; treating
  ``u[-1]`` as 0 would apply ``(1 + lam) u[0]``, an oversized first update). The same holds for a
  parameter's first step with a gradient, and after loading a state dict without EF buffers.
- Weight decay: ``u`` is the full delta of ``optimizer.step()``, decoupled weight decay included,
  so the correction is blind to how the optimizer built its update (Muon, AdamW, SGD alike).
- Scope: every parameter with a gradient this step, in every param group. A parameter without a
  gradient is left alone and keeps its buffer.
- Memory: one persistent parameter-sized buffer per corrected parameter (``u[t-1]``), plus a
  transient copy of the weights between the step's pre- and post-hook (reused as ``u[t]``).
- ``lam`` is the configured one (``optimizer.error_feedback["lam"]``); the value saved in a state
  dict is informational and does not override it on load.
- ``lam = "auto"`` (``optimizer.ef_lambda: auto``, beyond the paper, which names an adaptive lambda as
  future work): per parameter tensor and step, ``lam = clip(cos(u[t], u[t-1]), 0, 1)``. Why: the
  correction predicts the update at the current weights from the last change of the update,
  ``u[t] + (u[t] - u[t-1])``, which is exact (lam = 1) when the update drifts smoothly. Where
  consecutive updates disagree, ``u[t] - u[t-1]`` is mostly minibatch noise or an oscillation across a
  high-curvature direction, and extrapolating it amplifies exactly that (at ``u[t] = -u[t-1]``, lam = 1
  triples the step). The cosine of consecutive updates measures that agreement with what is already
  held (no extra state, nothing new to checkpoint); it is clipped to [0, 1] because a one-step delay
  needs a one-step extrapolation at most, and a negative cosine means "do not extrapolate". It is
  computed per tensor (each layer's matrices drift at their own pace) from ``u`` and ``u[t-1]`` alone,
  so the pipeline executor (per stage) and the single-process reference compute the same values.

It is installed through the optimizer's step hooks, so the object stays the same
``torch.optim.Optimizer`` (LR schedulers, ``zero_grad`` and checkpointing work unchanged). Its
buffers travel in the optimizer's own ``state_dict()`` under ``"error_feedback"``:
``{"lam": float, "prev": {param index: u[t-1]}}``, indices in ``param_groups`` order as for ``"state"``.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KEY", "AUTO", "auto_lambda", "apply_delay_correction", "install_error_feedback", "extrapolate_", "ef_buffers", "ef_state_by_name",
           "ef_state_from_names"]

KEY = "error_feedback"


AUTO = "auto"


def auto_lambda(u: Tensor, prev: Tensor) -> Tensor:
    """``ef_lambda: auto``'s weight for one tensor: ``clip(cos(u, prev), 0, 1)`` (0 when either is zero), as a
    0-dim tensor on ``u``'s device (no host sync)."""
    dot = torch.sum(u.double() * prev.double())
    norms = torch.linalg.vector_norm(u, dtype=torch.float64) * torch.linalg.vector_norm(prev, dtype=torch.float64)
    return torch.where(norms > 0, dot / norms.clamp_min(1e-300), torch.zeros_like(dot)).clamp(0.0, 1.0).to(u.dtype)


def extrapolate_(p: Tensor, u: Tensor, prev: Tensor, lam: float | str) -> None:
    """``p`` holds ``x_before - u``: move it to ``x_before - u - lam (u - prev)``, then ``prev <- u``.
    ``lam = "auto"``: ``auto_lambda(u, prev)``."""
    if lam == AUTO:
        p.sub_((u - prev).mul_(auto_lambda(u, prev)))
    else:
        p.sub_(u - prev, alpha=lam)
    prev.copy_(u)


def apply_delay_correction(optimizer: torch.optim.Optimizer, cfg) -> torch.optim.Optimizer:
    """The optimizer to use: ``optimizer`` itself, with the correction installed when
    ``cfg.delay_correction == 'error_feedback'`` (``lam = cfg.ef_lambda``), untouched for ``'none'``."""
    if cfg.delay_correction == "none":
        return optimizer
    if cfg.delay_correction != "error_feedback":
        raise ValueError(f"optimizer.delay_correction: {cfg.delay_correction!r} is not one of 'none', 'error_feedback'")
    return install_error_feedback(optimizer, cfg.ef_lambda)


def _params(opt: torch.optim.Optimizer) -> list[Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def install_error_feedback(optimizer: torch.optim.Optimizer, lam: float | str = 1.0) -> torch.optim.Optimizer:
    """Install the correction on ``optimizer`` in place (step and state-dict hooks); returns it.

    Its state is ``optimizer.error_feedback``: ``{"lam": float, "prev": {param: u[t-1]}}``.
    """
    if hasattr(optimizer, KEY):
        raise ValueError("error feedback is already installed on this optimizer (it would be applied twice)")
    if lam != AUTO and (isinstance(lam, str) or lam < 0):
        raise ValueError(f"optimizer.ef_lambda: {lam!r} is not allowed; a number >= 0 or 'auto'")
    ef = {"lam": lam if lam == AUTO else float(lam), "prev": {}}
    transient: dict[Tensor, Tensor] = {}  # param -> x_before, during one step only
    pending: list = []  # what load_state_dict's pre-hook took out of the state dict

    @torch.no_grad()
    def pre(opt, args, kwargs):
        transient.clear()
        transient.update({p: p.detach().clone() for p in _params(opt) if p.grad is not None})

    @torch.no_grad()
    def post(opt, args, kwargs):
        for p, before in transient.items():
            u = before.sub_(p)  # u[t] = x_before - x_after, in the transient copy
            prev = ef["prev"].get(p)
            if prev is None:  # no u[t-1]: plain step, keep u[t]
                ef["prev"][p] = u
            else:
                extrapolate_(p, u, prev, ef["lam"])
        transient.clear()

    def save(opt, state_dict):
        index = {p: i for i, p in enumerate(_params(opt))}
        state_dict[KEY] = {"lam": ef["lam"], "prev": {index[p]: t for p, t in ef["prev"].items() if p in index}}
        return state_dict

    def load_pre(opt, state_dict):
        pending.clear()
        pending.append(state_dict.pop(KEY, None))  # a shallow copy: the caller's dict is not changed
        return state_dict

    @torch.no_grad()
    def load_post(opt):
        saved = pending.pop() if pending else None
        params = _params(opt)
        prev = {}
        for i, t in ((saved or {}).get("prev") or {}).items():
            p = params[int(i)]
            if t.shape != p.shape:
                raise ValueError(f"error feedback buffer {i}: shape {tuple(t.shape)} does not match the parameter's {tuple(p.shape)}")
            prev[p] = t.to(device=p.device, dtype=p.dtype, copy=True)
        ef["prev"] = prev

    optimizer.register_step_pre_hook(pre)
    optimizer.register_step_post_hook(post)
    optimizer.register_state_dict_post_hook(save)
    optimizer.register_load_state_dict_pre_hook(load_pre)
    optimizer.register_load_state_dict_post_hook(load_post)
    setattr(optimizer, KEY, ef)
    return optimizer


def ef_buffers(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The correction's u[t-1] buffers (empty without the correction): what it costs in memory."""
    ef = getattr(optimizer, KEY, None)
    return list(ef["prev"].values()) if ef else []


def ef_state_by_name(optimizer_state: dict, names: list[str]) -> dict[str, Tensor]:
    """The u[t-1] buffers of a saved optimizer state dict, keyed by parameter name (``names`` in the optimizer's
    parameter order), so a checkpoint can be resumed on another split of the model."""
    return {names[int(i)]: t for i, t in ((optimizer_state.get(KEY) or {}).get("prev") or {}).items()}


def ef_state_from_names(by_name: dict[str, Tensor], names: list[str]) -> dict | None:
    """The state-dict entry ``install_error_feedback``'s hooks load, from name-keyed buffers (None if none). It
    holds the buffers only: the lambda is the one the optimizer was installed with (the recipe's), never a
    checkpoint's."""
    if not by_name:
        return None
    return {"prev": {i: by_name[n] for i, n in enumerate(names) if n in by_name}}
