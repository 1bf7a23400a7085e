"""Per-step results (loss, grad norm, lr, learned EF lambda) delivered to the trainer without blocking any stage.

At STEP{k} every rank posts an asynchronous all-reduce of [its loss contribution, its lambdas' sum, their count, its
stop vote] on the gloo report group: the last stage contributes step k's mean loss over microbatches, the others zero; the sum over the
data-parallel replicas divided by their number is the step's loss. Under ``ef_lambda: learned`` replica 0 of each
stage adds its groups' lambdas (a group tied across stages on its lowest stage only), so the logged value is the mean
over the groups, as the single-process reference logs it. Ranks post in step order, so the collectives match. ``ready`` returns
the completed reports in step order without waiting; ``drain`` waits for all of them.

The stop vote is 1 on a rank that a stop signal has reached (``supervision.stop_requested``) by its STEP{k}: the
summed vote of step k is the same number on every rank, so all of them take the same decision from it
(:meth:`StepReports.stop_vote`, read by the executor a few steps later, where step k's report has long landed).

On CUDA the loss and the grad norm are copied to pinned host memory without a host sync; the all-reduce is posted
once that copy has landed (``ready`` checks, once per action), so reporting costs no sync per step. The values are
read off the host buffers whole (``tolist``), and under ``training.on_nonfinite: stop`` a non-finite norm raises
``NonFiniteError`` naming its step when its report is delivered: the executor's STEP never waits for the device to
decide it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import supervision
from ..engine import StepResult, finite_step
from ..errors import PeerFailure
from ..topology import timed_out, who_went_silent


@dataclass
class _Report:
    step: int
    buf: torch.Tensor  # float64 [4] on the host: loss, lambdas' sum, their count, stop votes
    norm: float | torch.Tensor | None  # the step's grad norm: a host float, or a float64 [1] host buffer filled async
    lr: float
    finite: bool
    log_norm: bool = True  # a global norm, reported; a stage-local one is only checked
    copied: object = None  # CUDA event: the loss's copy to ``buf`` has landed
    work: object = None  # the all-reduce, once posted


class StepReports:
    """Per-step results delivered without blocking any stage (see the module doc)."""

    def __init__(self, group, dp_size: int, timeout_s: float, stop_on_nonfinite: bool = True):
        self.group, self.dp_size, self.timeout = group, dp_size, timedelta(seconds=timeout_s)
        self.stop_on_nonfinite = stop_on_nonfinite
        self.pending: deque[_Report] = deque()
        self.stop_votes: dict[int, bool] = {}  # step -> whether any rank voted to stop at its STEP, once delivered

    def post(self, step: int, loss_mean: torch.Tensor | None, norm: float | torch.Tensor | None, lr: float,
             finite: bool, lam_sum: torch.Tensor | None = None, lam_count: int = 0, log_norm: bool = True) -> None:
        r = _Report(step, torch.zeros(4, dtype=torch.float64), norm, lr, finite, log_norm=log_norm)
        on_device = [t for t in (loss_mean, lam_sum, norm) if isinstance(t, torch.Tensor)]
        if on_device and on_device[0].is_cuda:  # one asynchronous copy to pinned memory: no host sync
            dev = on_device[0].device
            zero = torch.zeros((), dtype=torch.float64, device=dev)
            vals = torch.stack([loss_mean.detach().reshape(()).double() if loss_mean is not None else zero,
                                lam_sum.double() if lam_sum is not None else zero,
                                torch.full((), float(lam_count), dtype=torch.float64, device=dev)])
            r.buf = r.buf.pin_memory()
            r.buf[:3].copy_(vals, non_blocking=True)
            if isinstance(norm, torch.Tensor):
                r.norm = torch.empty(1, dtype=torch.float64).pin_memory()
                r.norm.copy_(norm.reshape(1), non_blocking=True)
            r.copied = torch.cuda.Event()
            r.copied.record()
        else:
            if loss_mean is not None:
                r.buf[0] = loss_mean.detach().reshape(())
            if lam_sum is not None:
                r.buf[1], r.buf[2] = lam_sum, lam_count
            if isinstance(norm, torch.Tensor):
                r.norm = norm.detach().reshape(1).to(torch.float64, copy=True)
        if supervision.stop_requested():  # a host write, outside what the device copies
            r.buf[3] = 1.0
        self.pending.append(r)
        self._post_landed()

    def _post_landed(self, wait: bool = False, wait_through: int = -1) -> None:
        """Post the all-reduces whose losses are on the host, in step order (``wait``: every one, waiting for the
        device copies; ``wait_through``: those up to that step)."""
        for r in self.pending:
            if r.work is not None:
                continue
            if r.copied is not None:
                if wait or r.step <= wait_through:
                    r.copied.synchronize()
                elif not r.copied.query():
                    return
            r.work = dist.all_reduce(r.buf, group=self.group, async_op=True)

    def _result(self) -> StepResult:
        r = self.pending.popleft()
        try:
            r.work.wait(self.timeout)  # completed already in ``ready``: only surfaces an error
        except RuntimeError as e:
            raise self._failure(r.step, e) from None
        loss, lam_sum, lam_count, votes = r.buf.tolist()  # read off the host buffer whole: no scalar reads, no sync
        self.stop_votes[r.step] = votes > 0
        norm = r.norm.tolist()[0] if isinstance(r.norm, torch.Tensor) else r.norm
        if self.stop_on_nonfinite and norm is not None:
            finite_step(r.step, norm, "stop")  # NonFiniteError naming the step, as the executor's STEP would have
        return StepResult(r.step, loss / self.dp_size, norm if r.log_norm else None, r.lr, r.finite, not r.finite,
                          lam_sum / lam_count if lam_count > 0 else None)

    def _failure(self, step: int, e: RuntimeError) -> PeerFailure:
        """The error for a report that never arrived: the silent ranks named where the wait timed out."""
        return self.failure(f"the loss report of step {step}", e, tag=f"report-{step}")

    def failure(self, what: str, e: RuntimeError, tag: str | None = None) -> PeerFailure:
        """The error for a collective on the report group that never completed (``what``: which one): the silent
        ranks named where the wait timed out, else a peer that died."""
        within = f"{self.timeout.total_seconds():g}s"
        if timed_out(e):
            who = who_went_silent(tag or what.replace(" ", "-"), wait_s=min(30.0, self.timeout.total_seconds()))
            return PeerFailure(f"rank {dist.get_rank()}: {what}: {who} (nothing within {within}: stalled or hung, see "
                               "its log)")
        return PeerFailure(f"rank {dist.get_rank()}: {what} failed within {within}; a peer has probably died ({e})")

    def stop_vote(self, step: int) -> bool:
        """Whether any rank voted to stop by its STEP of ``step`` (the same answer on every rank). Its report has
        normally been delivered already; if not, this waits for it (and for the device copies of the reports before
        it), leaving the results for ``ready`` to deliver in order."""
        if step not in self.stop_votes:
            r = next((r for r in self.pending if r.step == step), None)
            if r is None:
                raise RuntimeError(f"the report of step {step} was never posted on this rank")
            self._post_landed(wait_through=step)
            try:
                r.work.wait(self.timeout)
            except RuntimeError as e:
                raise self._failure(step, e) from None
            return r.buf.tolist()[3] > 0
        for k in [k for k in self.stop_votes if k < step]:
            del self.stop_votes[k]
        return self.stop_votes[step]

    def ready(self) -> list[StepResult]:
        self._post_landed()
        out = []
        while self.pending and self.pending[0].work is not None and self.pending[0].work.is_completed():
            out.append(self._result())
        return out

    def drain(self) -> list[StepResult]:
        self._post_landed(wait=True)
        out = [self._result() for _ in range(len(self.pending))]
        self.stop_votes.clear()  # the next window reads only its own
        return out
