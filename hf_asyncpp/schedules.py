"""Pipeline schedules as data: one list of actions per stage, made by pure functions.

Actions: ``F``/``B`` (forward/backward of microbatch ``i`` of step ``k`` with weight ``version``),
``SEND_ACT``/``RECV_ACT`` (activations to/from the next/previous stage), ``SEND_GRAD``/``RECV_GRAD``
(gradients to/from the previous/next stage), ``REDUCE`` (hand step k's gradients to the reduction
worker: data-parallel all-reduce, tied-embedding sum, global norm) and ``STEP`` (the optimizer update
that applies step k's gradient). Sends are asynchronous; receives block where they stand; per
channel, receives come in the order of the sends (the simulator checks it).

Versions: v = the weights after v optimizer updates at that stage (v = 0: initial weights).

- ``gpipe`` / ``1f1b``: synchronous, flushed every step; step k uses version k; REDUCE(k), STEP(k)
  right after the stage's last backward of step k.
- ``2bw`` (PipeDream-2BW): 1F1B over the continuous stream of microbatches, no flush; step k uses
  version max(0, k-1) everywhere, so ``x[t+1] = x[t] - U(g(x[t-1]))``; STEP(k) (applying step k's
  gradient, producing version k+1) is placed as late as possible -- just before the stage's first
  forward of step k+2 -- so no stage waits on a reduction. Needs ``m >= p``.
- ``pipedream``: 1F1B over the stream, one optimizer step per microbatch (m = 1), weight stashing;
  at stage s microbatch k uses version max(0, k-(p-1-s)).

A window of steps [first_step, first_step + num_steps) starts with an empty pipeline and ends drained;
the version of every microbatch is given by the formulas above, so chunking changes no numerics
(the executor keeps the ``version_lag`` older versions alive across windows).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Op", "Action", "schedule_actions", "version_of", "version_lag", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b", "2bw", "pipedream")


class Op(str, Enum):
    F = "F"
    B = "B"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    REDUCE = "REDUCE"
    STEP = "STEP"


@dataclass(frozen=True)
class Action:
    type: Op
    step: int
    microbatch: int = -1
    version: int = -1
    peer: int = -1

    def __str__(self) -> str:
        s = f"{self.type.value}{self.step}"
        if self.microbatch >= 0:
            s += f".{self.microbatch}"
        if self.version >= 0:
            s += f"@v{self.version}"
        if self.peer >= 0:
            s += f">{self.peer}"
        return s

    @staticmethod
    def from_str(text: str) -> "Action":
        import re

        m = re.fullmatch(r"([A-Z_]+?)(\d+)(?:\.(\d+))?(?:@v(\d+))?(?:>(\d+))?", text)
        if not m:
            raise ValueError(f"not an action: {text!r}")
        op, k, i, v, peer = m.groups()
        return Action(Op(op), int(k), int(i) if i else -1, int(v) if v else -1, int(peer) if peer else -1)


def version_of(schedule: str, step: int, stage: int, num_stages: int) -> int:
    """The weight version every microbatch of ``step`` uses at ``stage`` (the semantics, not timing)."""
    if schedule in ("gpipe", "1f1b"):
        return step
    if schedule == "2bw":
        return max(0, step - 1)
    if schedule == "pipedream":
        return max(0, step - (num_stages - 1 - stage))
    raise ValueError(f"pipeline.schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}")


def version_lag(schedule: str, stage: int, num_stages: int) -> int:
    """How many versions older than the newest a future forward may still need (kept across windows)."""
    return {"2bw": 1, "pipedream": num_stages - 1 - stage}.get(schedule, 0)


def _one_f_one_b(stage: int, p: int, n: int) -> list[tuple[str, int]]:
    """1F1B compute order of ``n`` microbatches at ``stage``: warm-up forwards, steady F/B pairs, cool-down."""
    w = min(p - 1 - stage, n)
    order = [("F", j) for j in range(w)]
    for j in range(n - w):
        order += [("F", j + w), ("B", j)]
    order += [("B", j) for j in range(n - w, n)]
    return order


def _gpipe(n: int) -> list[tuple[str, int]]:
    return [("F", j) for j in range(n)] + [("B", j) for j in range(n)]


def schedule_actions(schedule: str, num_stages: int, num_microbatches: int, num_steps: int, first_step: int = 0) -> list[list[Action]]:
    """One action list per stage for steps [first_step, first_step + num_steps)."""
    p, m = num_stages, num_microbatches
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline.schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or num_steps < 0:
        raise ValueError(f"need num_stages >= 1 and num_microbatches >= 1, got {p}, {m}")
    if schedule == "2bw" and m < p:
        raise ValueError(f"2bw needs num_microbatches >= num_stages ({m} < {p}): a step's gradient must be complete at "
                         f"every stage before the next-but-one step starts; raise pipeline.num_microbatches to {p}")
    if schedule == "pipedream" and m != 1:
        raise ValueError(f"pipedream takes one optimizer step per microbatch: num_microbatches must be 1 (got {m})")
    return [_stage_actions(schedule, s, p, m, num_steps, first_step) for s in range(p)]


def _stage_actions(schedule: str, s: int, p: int, m: int, n: int, k0: int) -> list[Action]:
    if schedule in ("gpipe", "1f1b"):
        order = []
        for k in range(n):
            local = _gpipe(m) if schedule == "gpipe" else _one_f_one_b(s, p, m)
            order += [(op, k * m + j) for op, j in local] + [("END", k)]
    else:
        order = _one_f_one_b(s, p, n * m)
    out: list[Action] = []
    remaining_b = {k: m for k in range(n)}
    pending_steps: list[int] = []  # 2bw: reduced, not yet stepped

    def emit_step(k):
        out.append(Action(Op.STEP, k0 + k))

    for op, j in order:
        if op == "END":
            continue
        k, i = divmod(j, m)
        step = k0 + k
        v = version_of(schedule, step, s, p)
        if op == "F":
            if schedule == "2bw":
                while pending_steps and pending_steps[0] <= k - 2:  # STEP(k-2) just before step k's first forward
                    emit_step(pending_steps.pop(0))
            if s > 0:
                out.append(Action(Op.RECV_ACT, step, i, peer=s - 1))
            out.append(Action(Op.F, step, i, v))
            if s < p - 1:
                out.append(Action(Op.SEND_ACT, step, i, peer=s + 1))
        else:
            if s < p - 1:
                out.append(Action(Op.RECV_GRAD, step, i, peer=s + 1))
            out.append(Action(Op.B, step, i, v))
            if s > 0:
                out.append(Action(Op.SEND_GRAD, step, i, peer=s - 1))
            remaining_b[k] -= 1
            if remaining_b[k] == 0:
                out.append(Action(Op.REDUCE, step))
                if schedule == "2bw":
                    pending_steps.append(k)
                else:
                    emit_step(k)
    for k in pending_steps:
        emit_step(k)
    return out
