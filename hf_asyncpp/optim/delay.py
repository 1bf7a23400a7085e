"""Exact single-process simulation of the pipeline schedules' gradient delays.

These are the references the distributed schedules are tested against:

- ``'0'``: synchronous, ``x[t+1] = x[t] - U(g(x[t]))``.
- ``'1'`` (PipeDream-2BW): ``x[t+1] = x[t] - U(g(x[t-1]))``. Each step computes g at the current
  weights, keeps it, and hands the optimizer the gradient kept from the previous step; step 0
  applies nothing (``after_backward`` returns False). The optimizer state sees stale gradients in order.
- ``'pipedream'`` (p stages): ``x[t+1] = x[t] - U(grad f(W_0[t-p+1], ..., W_s[t-(p-1-s)], ..., W_{p-1}[t]))``.
  The gradient is evaluated with stage s's weights p-1-s versions old (versions before 0 are W[0])
  and applied to the current weights. Stage s keeps only its last p-1-s versions.

The trainer's LR scheduler advances only on applied updates: the k-th applied update uses lr(k).
Protocol per step: ``before_forward()``; forward/backward; ``apply = after_backward()``;
if apply: clip, ``optimizer.step()``, ``scheduler.step()``; ``after_step()``.
"""
from __future__ import annotations

from collections import deque

import torch

MODES = ("0", "1", "pipedream")


class DelaySimulator:
    def __init__(self, mode: str, params_per_stage: list[list[torch.nn.Parameter]]):
        if mode not in MODES:
            raise ValueError(f"optimizer.simulate_delay: {mode!r} is not one of {', '.join(map(repr, MODES))}")
        self.mode = mode
        self.stages = [list(s) for s in params_per_stage]
        p = len(self.stages)
        self.lags = [p - 1 - s for s in range(p)] if mode == "pipedream" else [0] * p
        self.history = [deque(maxlen=lag) for lag in self.lags]  # oldest first
        self.current: list[list[torch.Tensor] | None] = [None] * p
        self.kept: list[torch.Tensor] | None = None
        self.t = 0

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for s in self.stages for p in s]

    @torch.no_grad()
    def before_forward(self) -> None:
        if self.mode != "pipedream":
            return
        for s, params in enumerate(self.stages):
            if self.lags[s] == 0:
                continue
            self.current[s] = [p.detach().clone() for p in params]
            if self.history[s]:  # else t == 0: the stale version is W[0], the current one
                for p, old in zip(params, self.history[s][0]):
                    p.copy_(old)

    @torch.no_grad()
    def after_backward(self) -> bool:
        """Returns whether there is a gradient to apply this step."""
        if self.mode == "pipedream":
            for s, params in enumerate(self.stages):
                if self.current[s] is not None:
                    for p, cur in zip(params, self.current[s]):
                        p.copy_(cur)
            return True
        if self.mode == "1":
            fresh = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            kept, self.kept = self.kept, fresh
            if kept is None:
                for p in self.params:
                    p.grad = None
                return False
            for p, g in zip(self.params, kept):
                p.grad = g
        return True

    def after_step(self) -> None:
        if self.mode == "pipedream":
            for s in range(len(self.stages)):
                if self.current[s] is not None:
                    self.history[s].append(self.current[s])  # W[t], now one version old
                    self.current[s] = None
        self.t += 1

    def state_dict(self) -> dict:
        return {"mode": self.mode, "t": self.t, "kept": self.kept,
                "history": [[list(v) for v in h] for h in self.history]}

    def load_state_dict(self, sd: dict) -> None:
        if sd["mode"] != self.mode:
            raise ValueError(f"checkpoint was written with simulate_delay {sd['mode']!r}, this run uses {self.mode!r}")
        self.t, self.kept = sd["t"], sd["kept"]
        for h, saved in zip(self.history, sd["history"]):
            h.clear()
            h.extend([list(v) for v in saved])
