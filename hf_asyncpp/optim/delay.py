"""Exact single-process simulation of the pipeline schedules' gradient delays.

These are the references the distributed schedules are tested against (x = weights, g(x) = the
step's minibatch gradient at x, U = the optimizer's update with its state and lr):

- ``'0'``: synchronous, ``x[t+1] = x[t] - U(g(x[t]))``.
- ``'1'`` (PipeDream-2BW): ``x[t+1] = x[t] - U(g(x[t-1]))``. Each step computes g at the current
  weights, keeps it, and hands the optimizer the gradient kept from the previous step; step 0
  applies nothing (``after_backward`` returns False). The optimizer's state sees the stale gradients
  in order. A parameter that got no gradient at step t-1 gets ``grad = None`` at step t.
- ``'pipedream'`` (p stages): ``x[t+1] = x[t] - U(grad f(W_0[t-p+1], ..., W_s[t-(p-1-s)], ..., W_{p-1}[t]))``.
  The gradient is evaluated with stage s's weights p-1-s versions old (versions before 0 are W[0])
  and applied to the current weights. Stage s stores only its last p-1-s versions: at steady state
  the oldest one is swapped into the parameters for the forward/backward and its buffers then
  receive the current weights, so no extra version-sized copy is made (one tensor at a time is
  the only transient).

Protocol, every step (the trainer's)::

    delay.before_forward()            # pipedream: stale versions into each stage's params (in place)
    ...forward + backward of the step's microbatches, gradients accumulated in p.grad...
    if delay.after_backward():        # pipedream: current weights back (grads kept); '1': swap in last step's grad
        clip_grad_norm_(...); optimizer.step(); scheduler.step()
    optimizer.zero_grad()
    delay.after_step()                # pipedream: the pre-step weights become the newest old version

The LR scheduler advances only on applied updates, so the k-th applied update (k = 0, 1, ...)
uses lr(k): under ``'1'`` step t >= 1 applies g(x[t-1]) with lr(t-1).

``state_dict()`` holds the kept gradient ('1') and the stored versions ('pipedream'), so a run
resumed from it (together with the weights and the optimizer's state) continues exactly. Like
``torch.optim.Optimizer.state_dict()``, it references live tensors (the version buffers are reused
in place): serialize it before the next step.
"""
from __future__ import annotations

from collections import deque

import torch
from torch import Tensor

__all__ = ["MODES", "DelaySimulator"]

MODES = ("0", "1", "pipedream")


@torch.no_grad()
def _swap_(a: Tensor, b: Tensor) -> None:
    """Exchange the contents of two same-shaped tensors in place."""
    tmp = a.detach().clone()
    a.copy_(b)
    b.copy_(tmp)


class DelaySimulator:
    """Delays the gradients of a single-process run exactly as a pipeline schedule would.

    Args:
        mode: ``'0'``, ``'1'`` or ``'pipedream'`` (``optimizer.simulate_delay``; an int is accepted).
        params_per_stage: the parameters of each pipeline stage, in stage order (the partition
            plan's). Only ``'pipedream'`` uses the split; a single list (or a flat list of
            parameters) is fine for the other modes.
    """

    def __init__(self, mode: str, params_per_stage):
        mode = str(mode)
        if mode not in MODES:
            raise ValueError(f"optimizer.simulate_delay: {mode!r} is not one of {', '.join(map(repr, MODES))}")
        stages = list(params_per_stage)
        if stages and isinstance(stages[0], Tensor):
            stages = [stages]
        self.mode = mode
        self.stages: list[list[Tensor]] = [list(s) for s in stages]
        seen: set[int] = set()
        for s, params in enumerate(self.stages):
            for p in params:
                if id(p) in seen:
                    raise ValueError(f"DelaySimulator: a parameter of shape {tuple(p.shape)} is listed twice (again in "
                                     f"stage {s}); tied weights must be owned by one stage")
                seen.add(id(p))
        n = len(self.stages)
        self.lags = [n - 1 - s for s in range(n)] if mode == "pipedream" else [0] * n
        self.history: list[deque[list[Tensor]]] = [deque() for _ in range(n)]  # old versions, oldest first
        self._current: list[list[Tensor] | None] = [None] * n  # the current weights while stale ones are in
        self._kept: list[Tensor | None] | None = None  # '1': the gradient computed at the previous step
        self.steps = 0  # completed steps (after_step calls)
        self._phase = "idle"

    @property
    def params(self) -> list[Tensor]:
        return [p for s in self.stages for p in s]

    def _expect(self, phase: str, call: str) -> None:
        if self._phase != phase:
            raise RuntimeError(f"DelaySimulator.{call}() called out of order (after {self._phase!r}); the protocol is "
                               "before_forward, forward/backward, after_backward, optimizer step, after_step")

    @torch.no_grad()
    def before_forward(self) -> None:
        self._expect("idle", "before_forward")
        self._phase = "forward"
        if self.mode != "pipedream":
            return
        for s, params in enumerate(self.stages):
            lag, old = self.lags[s], self.history[s]
            if lag == 0:
                continue
            if len(old) == lag:  # W[t-lag] leaves the window after this step: its buffers take W[t]
                stale = old.popleft()
                for p, buf in zip(params, stale):
                    _swap_(p, buf)
                self._current[s] = stale
            else:  # t < lag: the stale version is W[0] (oldest stored, or the current one at t = 0), still needed later
                self._current[s] = [p.detach().clone() for p in params]
                if old:
                    for p, w0 in zip(params, old[0]):
                        p.copy_(w0)

    @torch.no_grad()
    def after_backward(self) -> bool:
        """Whether there is a gradient to apply this step (False only at step 0 of ``'1'``)."""
        self._expect("forward", "after_backward")
        self._phase = "backward"
        if self.mode == "pipedream":
            for s, params in enumerate(self.stages):
                if self._current[s] is not None:
                    for p, cur in zip(params, self._current[s]):
                        p.copy_(cur)
            return True
        if self.mode == "1":
            params = self.params
            kept, self._kept = self._kept, [p.grad for p in params]
            for p, g in zip(params, kept or [None] * len(params)):
                p.grad = g
            return kept is not None
        return True

    def after_step(self) -> None:
        self._expect("backward", "after_step")
        self._phase = "idle"
        for s in range(len(self.stages)):
            if self._current[s] is not None:
                self.history[s].append(self._current[s])  # W[t], now one version old
                self._current[s] = None
        self.steps += 1

    def stored_tensors(self) -> int:
        """Version tensors held now, the parked current weights included (stage s: at most p-1-s versions)."""
        return sum(len(v) for h in self.history for v in h) + sum(len(c) for c in self._current if c is not None)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"mode": self.mode, "steps": self.steps, "lags": list(self.lags), "kept": self._kept,
                "history": [[list(v) for v in h] for h in self.history]}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """Restore the kept gradient and stored versions (the weights themselves are the model's to load)."""
        if self._phase != "idle":
            raise RuntimeError("DelaySimulator.load_state_dict() in the middle of a step; load between steps")
        if sd["mode"] != self.mode:
            raise ValueError(f"checkpoint was written with simulate_delay {sd['mode']!r}, this run uses {self.mode!r}")
        lags = sd.get("lags", [None] * len(sd["history"]))  # older checkpoints did not record the lags
        if len(lags) != len(self.lags) or any(a is not None and a != b for a, b in zip(lags, self.lags)):
            raise ValueError(f"checkpoint was written for {len(lags)} simulated stages, this run has {len(self.lags)}")
        params = self.params
        kept = sd["kept"]
        if kept is not None and len(kept) != len(params):
            raise ValueError(f"checkpoint keeps {len(kept)} gradients, this run has {len(params)} parameters")
        self._kept = None if kept is None else [
            None if g is None else g.to(device=p.device, dtype=p.dtype, copy=True) for p, g in zip(params, kept)]
        for s, (h, saved) in enumerate(zip(self.history, sd["history"])):
            if len(saved) > self.lags[s]:
                raise ValueError(f"checkpoint stores {len(saved)} versions for stage {s}, which keeps {self.lags[s]}")
            h.clear()
            for version in saved:
                if [tuple(t.shape) for t in version] != [tuple(p.shape) for p in self.stages[s]]:
                    raise ValueError(f"checkpoint's stored versions of stage {s} do not match its parameters' shapes")
                h.append([t.to(device=p.device, dtype=p.dtype, copy=True) for p, t in zip(self.stages[s], version)])
        self.steps = int(sd["steps"] if "steps" in sd else sd["t"])
