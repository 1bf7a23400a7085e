"""Per-step results (loss, grad norm, lr) delivered to the trainer without blocking any stage.

At STEP{k} every rank posts an asynchronous all-reduce of [its loss contribution] on the gloo report group: the last
stage contributes step k's mean loss over microbatches, the others zero; the sum over the data-parallel replicas
divided by their number is the step's loss. Ranks post in step order, so the collectives match. ``ready`` returns
the completed reports in step order without waiting; ``drain`` waits for all of them.

On CUDA the loss is copied to pinned host memory without a host sync; its all-reduce is posted once that copy has
landed (``ready`` checks, once per action), so reporting costs the last stage no sync per step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..engine import StepResult
from .p2p import PeerFailure


@dataclass
class _Report:
    step: int
    buf: torch.Tensor  # float64 [1] on the host
    norm: float | None
    lr: float
    finite: bool
    copied: object = None  # CUDA event: the loss's copy to ``buf`` has landed
    work: object = None  # the all-reduce, once posted


class StepReports:
    """Per-step results delivered without blocking any stage (see the module doc)."""

    def __init__(self, group, dp_size: int, timeout_s: float):
        self.group, self.dp_size, self.timeout = group, dp_size, timedelta(seconds=timeout_s)
        self.pending: deque[_Report] = deque()

    def post(self, step: int, loss_mean: torch.Tensor | None, norm: float | None, lr: float, finite: bool) -> None:
        r = _Report(step, torch.zeros(1, dtype=torch.float64), norm, lr, finite)
        if loss_mean is not None and loss_mean.is_cuda:
            r.buf = r.buf.pin_memory()
            r.buf.copy_(loss_mean.detach().reshape(1), non_blocking=True)
            r.copied = torch.cuda.Event()
            r.copied.record()
        elif loss_mean is not None:
            r.buf[0] = loss_mean.to("cpu", torch.float64)
        self.pending.append(r)
        self._post_landed()

    def _post_landed(self, wait: bool = False) -> None:
        """Post the all-reduces whose losses are on the host, in step order."""
        for r in self.pending:
            if r.work is not None:
                continue
            if r.copied is not None:
                if wait:
                    r.copied.synchronize()
                elif not r.copied.query():
                    return
            r.work = dist.all_reduce(r.buf, group=self.group, async_op=True)

    def _result(self) -> StepResult:
        r = self.pending.popleft()
        try:
            r.work.wait(self.timeout)  # completed already in ``ready``: only surfaces an error
        except RuntimeError as e:
            raise PeerFailure(f"the loss report of step {r.step} did not arrive within "
                              f"{self.timeout.total_seconds():.0f}s; a peer has probably died ({e})") from None
        return StepResult(r.step, float(r.buf[0] / self.dp_size), r.norm, r.lr, r.finite, not r.finite)

    def ready(self) -> list[StepResult]:
        self._post_landed()
        out = []
        while self.pending and self.pending[0].work is not None and self.pending[0].work.is_completed():
            out.append(self._result())
        return out

    def drain(self) -> list[StepResult]:
        self._post_landed(wait=True)
        return [self._result() for _ in range(len(self.pending))]
