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
- ``lam = "learned"`` (``optimizer.ef_lambda: learned``, after Baydin et al.'s hypergradient
  descent): one lambda per pipeline stage, learned from the loss. ``x[t+1]`` depends on ``lam[t]`` through
  ``-lam[t] d[t]`` (``d[t] = u[t] - u[t-1]``), so ``dL(x[t+1])/dlam[t] = -<grad L(x[t+1]), d[t]>``; under 2BW
  step t+2 computes exactly that gradient (at version t+1) for its own update, so the rule costs no extra
  forward, backward or communication: at step t+2, ``lam <- clip(lam + rate * cos(g[t+2], d[t]), 0, LEARNED_MAX)``,
  the inner products summed over the stage's tensors (the cosine makes ``rate`` scale-free). With
  ``follow_lr`` (``optimizer.ef_lambda_schedule: lr``, the default) the step is ``rate`` times the lr schedule's
  factor (``lr / initial_lr`` of the first group): Baydin et al.'s raw inner product shrinks with the lr by itself,
  the cosine does not, and a constant step was too small early and too large late (docs/benchmarks.md). Why it can
  beat a fixed or cosine lambda: it follows the loss, so it exceeds 1 where extrapolating further helps (a delayed
  momentum method limited by stability) and falls where the extrapolation overshoots (the gradient at the new
  point then points back along ``d``). It needs a one-step delay (2BW, or ``simulate_delay: 1``): the gradient a
  step receives must be at the weights two updates before. It costs two more parameter-sized buffers per tensor
  (``d[t-1]``, ``d[t]``); lambda, its step counter and the buffers are in the state dict, so a resumed run
  continues exactly; ``groups`` (the single-process reference passes the pipeline's stages) says which tensors
  share a lambda.

It is installed through the optimizer's step hooks, so the object stays the same
``torch.optim.Optimizer`` (LR schedulers, ``zero_grad`` and checkpointing work unchanged). Its
buffers travel in the optimizer's own ``state_dict()`` under ``"error_feedback"``:
``{"lam": float, "prev": {param index: u[t-1]}}``, indices in ``param_groups`` order as for ``"state"``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..config.optimizer import EF_AUTO, EF_LEARNED

__all__ = ["KEY", "AUTO", "LEARNED", "auto_lambda", "learned_lambda", "apply_delay_correction", "install_error_feedback", "extrapolate_", "lr_factor", "ef_buffers", "ef_state_by_name",
           "ef_state_from_names", "learned_values", "has_correction"]

KEY = "error_feedback"


AUTO, LEARNED = EF_AUTO, EF_LEARNED  # the recipe's spellings of ef_lambda's two rules
LEARNED_START = 1.0  # the paper's lambda
LEARNED_MAX = 3.0  # a one-step delay never needs a three-step extrapolation
LEARNED_RATE = 0.02


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


def lr_factor(optimizer: torch.optim.Optimizer) -> float:
    """The lr schedule's factor at this step, ``lr / initial_lr`` of the first group (an LR scheduler sets
    ``initial_lr``); 1 without a scheduler."""
    g = optimizer.param_groups[0]
    peak = float(g.get("initial_lr", g["lr"]))
    return float(g["lr"]) / peak if peak > 0 else 1.0


def apply_delay_correction(optimizer: torch.optim.Optimizer, cfg, groups=None) -> torch.optim.Optimizer:
    """The optimizer to use: ``optimizer`` itself, with the correction installed when
    ``cfg.delay_correction == 'error_feedback'`` (``lam = cfg.ef_lambda``), untouched for ``'none'``. ``groups``:
    the parameters sharing one learned lambda (``ef_lambda: learned``), default all of the optimizer's."""
    if cfg.delay_correction == "none":
        return optimizer
    if cfg.delay_correction != "error_feedback":
        raise ValueError(f"optimizer.delay_correction: {cfg.delay_correction!r} is not one of 'none', 'error_feedback'")
    return install_error_feedback(optimizer, cfg.ef_lambda, groups=groups, rate=cfg.ef_lambda_lr,
                                  start_step=cfg.delay_start_step, follow_lr=cfg.ef_lambda_schedule == "lr")


def _params(opt: torch.optim.Optimizer) -> list[Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def install_error_feedback(optimizer: torch.optim.Optimizer, lam: float | str = 1.0, groups=None,
                           rate: float = LEARNED_RATE, start_step: int = 0, follow_lr: bool = False) -> torch.optim.Optimizer:
    """Install the correction on ``optimizer`` in place (step and state-dict hooks); returns it.

    Its state is ``optimizer.error_feedback``: ``{"lam": float | "auto" | "learned", "prev": {param: u[t-1]},
    "t": steps taken}``, and for ``"learned"`` also ``"diffs": {param: {step: d}}`` (the last two) and
    ``"values"``: one 0-dim lambda per group of ``groups`` (lists of parameters; default one group, all of them).
    ``start_step`` (``optimizer.delay_start_step``): the steps before it are synchronous, so they are applied
    plain (their ``u`` is kept: the first delayed step extrapolates from the last synchronous one).
    ``follow_lr``: the learned lambda's step is ``rate`` times the lr schedule's factor at this step.
    """
    if hasattr(optimizer, KEY):
        raise ValueError("error feedback is already installed on this optimizer (it would be applied twice)")
    if lam not in (AUTO, LEARNED) and (isinstance(lam, str) or lam < 0):
        raise ValueError(f"optimizer.ef_lambda: {lam!r} is not allowed; a number >= 0, 'auto' or 'learned'")
    ef = {"lam": lam if isinstance(lam, str) else float(lam), "prev": {}, "t": 0}
    transient: dict[Tensor, Tensor] = {}  # param -> x_before, during one step only
    pending: list = []  # what load_state_dict's pre-hook took out of the state dict
    if lam == LEARNED:
        members = [list(g) for g in (groups or [_params(optimizer)])]
        first = members[0][0] if members and members[0] else None
        ef["groups"] = members
        ef["values"] = [torch.tensor(LEARNED_START, dtype=torch.float64, device=first.device if first is not None else None)
                        for _ in members]
        ef["diffs"] = {}
        group_of = {p: i for i, g in enumerate(members) for p in g}

    @torch.no_grad()
    def learn():
        """lam <- clip(lam + rate cos(g, d[t-2]), 0, max) per group: g is this step's gradient, at the weights
        d[t-2] moved (x[t-1] under a one-step delay)."""
        t = ef["t"]
        step = rate * lr_factor(optimizer) if follow_lr else rate
        for i, members in enumerate(ef["groups"]):
            terms = [(p.grad, ef["diffs"][p][t - 2]) for p in members
                     if p.grad is not None and t - 2 in ef["diffs"].get(p, {})]
            if not terms:
                continue
            dot = sum(torch.sum(g.double() * d.double()) for g, d in terms)
            norms = (torch.sqrt(sum(torch.sum(g.double() ** 2) for g, _ in terms))
                     * torch.sqrt(sum(torch.sum(d.double() ** 2) for _, d in terms)))
            cos = torch.where(norms > 0, dot / norms.clamp_min(1e-300), torch.zeros_like(dot))
            ef["values"][i] = (ef["values"][i] + step * cos.to(ef["values"][i].device)).clamp(0.0, LEARNED_MAX)

    @torch.no_grad()
    def pre(opt, args, kwargs):
        transient.clear()
        stepped = [p for p in _params(opt) if p.grad is not None]
        # x_before: one foreach kernel for every tensor (times 1 is exact: a copy)
        transient.update(zip(stepped, torch._foreach_mul(stepped, 1.0)))
        if ef["lam"] == LEARNED:
            learn()

    @torch.no_grad()
    def post(opt, args, kwargs):
        t = ef["t"]
        params, befores = list(transient), list(transient.values())
        torch._foreach_sub_(befores, params)  # u[t] = x_before - x_after, in the transient copies
        if ef["lam"] not in (AUTO, LEARNED) and t >= start_step:
            # the common case in a few kernels: x <- x - lam (u[t] - u[t-1]); u[t] becomes the kept u (no copy)
            had = [i for i, p in enumerate(params) if p in ef["prev"]]
            if had:
                us = [befores[i] for i in had]
                diffs = torch._foreach_sub(us, [ef["prev"][params[i]] for i in had])
                torch._foreach_sub_([params[i] for i in had], diffs, alpha=ef["lam"])
            ef["prev"].update(zip(params, befores))
            transient.clear()
            ef["t"] = t + 1
            return
        for p, u in zip(params, befores):
            prev = ef["prev"].get(p)
            if prev is None:  # no u[t-1]: plain step, keep u[t]
                ef["prev"][p] = u
            elif t < start_step:  # a synchronous step (sync start): nothing to correct
                ef["prev"][p] = u
            elif ef["lam"] == LEARNED:
                d = u - prev
                p.sub_(d * ef["values"][group_of.get(p, 0)].to(d.dtype))
                prev.copy_(u)
                kept = ef["diffs"].setdefault(p, {})
                kept[t] = d
                for old in [k for k in kept if k < t - 1]:
                    del kept[old]
            else:
                extrapolate_(p, u, prev, ef["lam"])
        transient.clear()
        ef["t"] = t + 1

    def save(opt, state_dict):
        index = {p: i for i, p in enumerate(_params(opt))}
        entry = {"lam": ef["lam"], "t": ef["t"], "prev": {index[p]: t for p, t in ef["prev"].items() if p in index}}
        if ef["lam"] == LEARNED:
            entry["diffs"] = {index[p]: dict(k) for p, k in ef["diffs"].items() if p in index}
            entry["lam_of"] = {index[p]: float(ef["values"][group_of[p]]) for p in index if p in group_of}
        state_dict[KEY] = entry
        return state_dict

    def load_pre(opt, state_dict):
        pending.clear()
        pending.append(state_dict.pop(KEY, None))  # a shallow copy: the caller's dict is not changed
        return state_dict

    @torch.no_grad()
    def load_post(opt):
        saved = pending.pop() if pending else None
        params = _params(opt)

        def own(i, t):
            p = params[int(i)]
            if t.shape != p.shape:
                raise ValueError(f"error feedback buffer {i}: shape {tuple(t.shape)} does not match the parameter's {tuple(p.shape)}")
            return p, t.to(device=p.device, dtype=p.dtype, copy=True)

        ef["prev"] = dict(own(i, t) for i, t in ((saved or {}).get("prev") or {}).items())
        ef["t"] = int((saved or {}).get("t", 0))
        if ef["lam"] == LEARNED:
            ef["diffs"] = {}
            for i, kept in ((saved or {}).get("diffs") or {}).items():
                ef["diffs"][params[int(i)]] = {int(k): own(i, d)[1] for k, d in kept.items()}
            lam_of = {params[int(i)]: v for i, v in ((saved or {}).get("lam_of") or {}).items()}
            for g, members in enumerate(ef["groups"]):  # a changed split: the mean of the saved stages' lambdas
                vals = [lam_of[p] for p in members if p in lam_of]
                if vals:
                    ef["values"][g] = torch.tensor(sum(vals) / len(vals), dtype=torch.float64, device=ef["values"][g].device)

    optimizer.register_step_pre_hook(pre)
    optimizer.register_step_post_hook(post)
    optimizer.register_state_dict_post_hook(save)
    optimizer.register_load_state_dict_pre_hook(load_pre)
    optimizer.register_load_state_dict_post_hook(load_post)
    setattr(optimizer, KEY, ef)
    return optimizer


def learned_lambda(optimizer: torch.optim.Optimizer) -> float | None:
    """The mean of the learned lambdas (one per group; one group per pipeline stage), None unless
    ``ef_lambda: learned``: what the metrics log."""
    ef = getattr(optimizer, KEY, None)
    if not ef or ef["lam"] != LEARNED:
        return None
    return float(sum(float(v) for v in ef["values"]) / len(ef["values"]))


def learned_values(optimizer: torch.optim.Optimizer) -> list[Tensor] | None:
    """The learned lambdas as device tensors, one per group, None unless ``ef_lambda: learned``: for a caller that
    reduces them on the device (a pipeline stage's step report) instead of reading them on the host."""
    ef = getattr(optimizer, KEY, None)
    return ef.get("values") if ef else None


def has_correction(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the Error-Feedback correction is installed on ``optimizer``."""
    return getattr(optimizer, KEY, None) is not None


def ef_buffers(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The correction's u[t-1] buffers (empty without the correction): what it costs in memory."""
    ef = getattr(optimizer, KEY, None)
    if not ef:
        return []
    return list(ef["prev"].values()) + [d for kept in ef.get("diffs", {}).values() for d in kept.values()]


def ef_state_by_name(optimizer_state: dict, names: list[str]) -> dict[str, dict]:
    """The correction's state of a saved optimizer state dict per parameter name (``names`` in the optimizer's
    parameter order), so a checkpoint can be resumed on another split of the model: ``{name: {"prev": u[t-1],
    "t": steps}}``, plus ``"diffs"`` and ``"lam"`` (its stage's learned lambda) under ``ef_lambda: learned``."""
    saved = optimizer_state.get(KEY) or {}
    out = {names[int(i)]: {"prev": t, "t": int(saved.get("t", 0))} for i, t in (saved.get("prev") or {}).items()}
    for key, field in (("diffs", "diffs"), ("lam_of", "lam")):
        for i, v in (saved.get(key) or {}).items():
            out.setdefault(names[int(i)], {"t": int(saved.get("t", 0))})[field] = v
    return out


def ef_state_from_names(by_name: dict[str, Tensor], names: list[str]) -> dict | None:
    """The state-dict entry ``install_error_feedback``'s hooks load, from ``ef_state_by_name``'s entries (None if
    none). The lambda is the one the optimizer was installed with (the recipe's), never a checkpoint's; only a
    learned lambda's value continues from the checkpoint (as a moment of the optimizer would)."""
    if not by_name:
        return None
    mine = {i: by_name[n] for i, n in enumerate(names) if n in by_name}
    return {"prev": {i: e["prev"] for i, e in mine.items() if "prev" in e},
            "diffs": {i: e["diffs"] for i, e in mine.items() if "diffs" in e},
            "lam_of": {i: e["lam"] for i, e in mine.items() if "lam" in e},
            "t": max((e["t"] for e in mine.values()), default=0)}
