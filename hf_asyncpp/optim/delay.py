"""Exact single-process simulation of the pipeline schedules' gradient delays.

These are the references the distributed schedules are tested against (x = weights, g(x) = the
step's minibatch gradient at x, U = the optimizer's update with its state and lr):

- ``'0'``: synchronous, ``x[t+1] = x[t] - U(g(x[t]))``.
- ``'1'`` (PipeDream-2BW): ``x[t+1] = x[t] - U(g(x[t-1]))`` with ``x[-1] = x[0]``. Step t computes
  the gradient of its own batch at the previous step's weights (a one-version weight stash, swapped
  in for the forward/backward) and applies it to the current weights, exactly as the executor's
  STEP{t} applies the gradient of batch t computed on version max(0, t-1). So after N steps both
  have applied N updates, and a step's logged loss, grad norm and lr are those of the same batch
  and the same update in both. (An earlier design kept the gradient and applied it one step later:
  the same update sequence, but one update behind at every evaluation, export and checkpoint.)
- ``'pipedream'`` (p stages): ``x[t+1] = x[t] - U(grad f(W_0[t-p+1], ..., W_s[t-(p-1-s)], ..., W_{p-1}[t]))``.
  The gradient is evaluated with stage s's weights p-1-s versions old (versions before 0 are W[0])
  and applied to the current weights. Stage s stores only its last p-1-s versions: at steady state
  the oldest one is swapped into the parameters for the forward/backward and its buffers then
  receive the current weights, so no extra version-sized copy is made (one tensor at a time is
  the only transient). A parameter used by two stages (tied input/output embeddings) is, as in the
  executor, used at each stage's own lag: ``lag0_uses`` names the later uses (the tied output head,
  on the last stage, lag 0) that run on a copy of the current weights; their gradient is summed into
  the parameter's, as the executor sums the two copies' gradients.

``'1'`` is the ``'pipedream'`` mechanism with lag 1 at every stage, so the two share one code path.

Protocol, every step (the trainer's)::

    delay.before_forward()            # stale versions into the params (in place)
    ...forward + backward of the step's microbatches, gradients accumulated in p.grad...
    delay.after_backward()            # current weights back (grads kept); tied uses' grads summed in
    clip_grad_norm_(...); optimizer.step(); scheduler.step()
    optimizer.zero_grad()
    delay.after_step()                # the pre-step weights become the newest old version

``after_backward`` returns True (every step applies an update in every mode; kept for callers that
ask). The LR scheduler advances only on applied updates, so the k-th applied update uses lr(k).

``state_dict()`` holds the stored versions, so a run resumed from it (together with the weights and
the optimizer's state) continues exactly. Like ``torch.optim.Optimizer.state_dict()``, it references
live tensors (the version buffers are reused in place): serialize it before the next step.
"""
from __future__ import annotations

from collections import deque

import torch
from torch import Tensor

from ..config.recipe import Recipe
from ..partition import partition_plan
from ..schedules.records import SIMULATED_DELAYS, get_simulated_delay
from .ef import LEARNED

__all__ = ["MODES", "DelaySimulator"]

MODES = tuple(SIMULATED_DELAYS)  # the names; what each means is its record in schedules.records


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
        lag0_uses: ``(module, attribute)`` pairs whose parameter belongs to an earlier stage but which
            the pipeline runs on the current weights (the tied output head of ``'pipedream'`` on the
            last stage). Only ``'pipedream'`` uses them: under ``'1'`` every stage, the head's copy
            included, is one version old, so the tied weight is one tensor at one version.
        start_step: "sync start" (``optimizer.delay_start_step``, the paper's baseline mitigation): steps before it
            are synchronous and nothing is stored; the delay starts at this step as a pipeline starts, with no
            older version yet (so this step is synchronous too, as 2BW's step 0), exactly what a pipeline that
            switches from a flushed schedule to 2BW at a drain point computes.
    """

    def __init__(self, mode: str, params_per_stage, lag0_uses=(), start_step: int = 0):
        delay = get_simulated_delay(mode)
        stages = list(params_per_stage)
        if stages and isinstance(stages[0], Tensor):
            stages = [stages]
        self.mode = delay.name
        self.stages: list[list[Tensor]] = [list(s) for s in stages]
        seen: set[int] = set()
        for s, params in enumerate(self.stages):
            for p in params:
                if id(p) in seen:
                    raise ValueError(f"DelaySimulator: a parameter of shape {tuple(p.shape)} is listed twice (again in "
                                     f"stage {s}); tied weights must be owned by one stage")
                seen.add(id(p))
        n = len(self.stages)
        self.lags = delay.lags(n)
        lag_of = {id(p): lag for params, lag in zip(self.stages, self.lags) for p in params}
        self.lag0_uses = [(m, a) for m, a in lag0_uses if delay.per_stage and lag_of.get(id(getattr(m, a)), 0) > 0]
        self._owners: list[torch.nn.Parameter] = []  # while lag0_uses run on copies: their own parameters
        self.history: list[deque[list[Tensor]]] = [deque() for _ in range(n)]  # old versions, oldest first
        self._current: list[list[Tensor] | None] = [None] * n  # the current weights while stale ones are in
        self.steps = 0  # completed steps (after_step calls)
        self.start_step = start_step
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
        if self.steps < self.start_step:  # sync start: no stale version, nothing stored
            return
        for module, attr in self.lag0_uses:  # a copy of the current weights, before the stale ones come in
            owner = getattr(module, attr)
            self._owners.append(owner)
            module._parameters[attr] = torch.nn.Parameter(owner.detach().clone())
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
        """Put the current weights back (the gradients stay) and sum the lag-0 uses' gradients into their owners'.
        Returns True: every step applies an update."""
        self._expect("forward", "after_backward")
        self._phase = "backward"
        for s, params in enumerate(self.stages):
            if self._current[s] is not None:
                for p, cur in zip(params, self._current[s]):
                    p.copy_(cur)
        for (module, attr), owner in zip(self.lag0_uses, self._owners):
            g = module._parameters[attr].grad
            module._parameters[attr] = owner
            if g is not None:
                owner.grad = g if owner.grad is None else owner.grad.add_(g)
        self._owners.clear()
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
        """Version tensors held now, the parked current weights included (stage s: at most its lag)."""
        return sum(len(v) for h in self.history for v in h) + sum(len(c) for c in self._current if c is not None)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"mode": self.mode, "steps": self.steps, "lags": list(self.lags),
                "history": [[list(v) for v in h] for h in self.history]}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """Restore the stored versions (the weights themselves are the model's to load)."""
        if self._phase != "idle":
            raise RuntimeError("DelaySimulator.load_state_dict() in the middle of a step; load between steps")
        if sd["mode"] != self.mode:
            raise ValueError(f"checkpoint was written with simulate_delay {sd['mode']!r}, this run uses {self.mode!r}")
        lags = sd["lags"]
        if len(lags) != len(self.lags) or list(lags) != list(self.lags):
            raise ValueError(f"checkpoint was written for {len(lags)} simulated stages, this run has {len(self.lags)}")
        for s, (h, saved) in enumerate(zip(self.history, sd["history"])):
            if len(saved) > self.lags[s]:
                raise ValueError(f"checkpoint stores {len(saved)} versions for stage {s}, which keeps {self.lags[s]}")
            h.clear()
            for version in saved:
                if [tuple(t.shape) for t in version] != [tuple(p.shape) for p in self.stages[s]]:
                    raise ValueError(f"checkpoint's stored versions of stage {s} do not match its parameters' shapes")
                h.append([t.to(device=p.device, dtype=p.dtype, copy=True) for p, t in zip(self.stages[s], version)])
        self.steps = int(sd["steps"])


def stage_parameter_lists(model, recipe: Recipe) -> tuple[list[list[torch.nn.Parameter]], list[tuple]]:
    """Parameters grouped by the pipeline stage that would own them (for simulate_delay: pipedream), and the
    ``(module, attribute)`` uses of a tied parameter on a later stage (the tied output head): the executor holds a
    copy of it there, at that stage's lag (0 on the last stage), not at the owner's, so the simulation must too."""
    p = recipe.pipeline.num_stages
    if p == 1 or not get_simulated_delay(recipe.optimizer.simulate_delay).per_stage:
        return [list(model.parameters())], []
    plan = partition_plan(model, p, recipe.pipeline.split, seq_len=recipe.data.seq_len)
    by_name = dict(model.named_parameters())
    groups = [[] for _ in range(p)]
    for name, param in by_name.items():
        groups[plan.stage_of(name)].append(param)
    uses = []
    for _, later in plan.tied_pairs:
        if plan.stage_of(later) != p - 1:
            raise NotImplementedError(f"simulate_delay: pipedream: the tied parameter {later!r} is used on stage "
                                      f"{plan.stage_of(later)}, not the last; only a tied output head is simulated")
        module, _, attr = later.rpartition(".")
        uses.append((model.get_submodule(module), attr))
    return groups, uses


def lambda_groups(model, recipe: Recipe) -> list[list[torch.nn.Parameter]] | None:
    """The parameters sharing one learned EF lambda (``ef_lambda: learned``) as the executor groups them: those of
    one pipeline stage, and apart, the tensors tied across stages (one group per pair of stages holding them), so
    this reference equals the pipeline for any number of stages. None (one group) for one stage or another lambda."""
    p = recipe.pipeline.num_stages
    if recipe.optimizer.ef_lambda != LEARNED or p == 1:
        return None
    plan = partition_plan(model, p, recipe.pipeline.split, seq_len=recipe.data.seq_len)
    tied = {a: (plan.stage_of(a), plan.stage_of(b)) for a, b in plan.tied_pairs if plan.stage_of(a) != plan.stage_of(b)}
    groups: dict = {s: [] for s in range(p)}
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups.setdefault(tied.get(name, plan.stage_of(name)), []).append(param)
    return [g for g in groups.values() if g]
