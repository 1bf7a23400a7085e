"""Pipeline schedules as data: one list of actions per stage, made by pure functions.

Every schedule is a pure function ``(num_stages, num_microbatches, num_steps, first_step=0)`` returning
``lists[s]``, the actions stage ``s`` executes in order (data parallelism is the executor's business: every
replica of stage ``s`` runs ``lists[s]``). ``simulator.simulate`` runs the lists without processes.

Actions (``str(a)`` / ``Action.from_str`` round-trip; ``k`` = step, ``i`` = microbatch in the step):

==========================  ============================================================================
``F{k}.{i}@v{v}``           forward of microbatch (k, i) with weight version v
``B{k}.{i}@v{v}``           backward of (k, i) with the same version v as its forward (weight stashing);
                            gradients accumulate over the step's microbatches (all use one version)
``SEND_ACT{k}.{i}>{s+1}``   after F on s < p-1: isend the outputs to stage s+1 (non-blocking)
``RECV_ACT{k}.{i}<{s-1}``   before F on s > 0: the inputs from stage s-1 (blocks until they are here)
``SEND_GRAD{k}.{i}>{s-1}``  after B on s > 0: isend the input gradients to stage s-1 (non-blocking)
``RECV_GRAD{k}.{i}<{s+1}``  before B on s < p-1: the output gradients from stage s+1 (blocks)
``REDUCE{k}``               after the stage's last B of step k (and its SEND_GRAD): post step k's gradient
                            reductions (data-parallel all-reduce, tied-embedding sum, global grad norm),
                            a collective every stage issues in the same step order
``STEP{k}``                 the optimizer update applying step k's (reduced, clipped) gradient; it waits
                            for REDUCE{k} to complete and produces the stage's next version
==========================  ============================================================================

Executor contract: a send may not wait for its completion before the stage's next receive (gloo completes
an ``isend`` of a large tensor only once the peer receives it; keep the tensor alive and ``wait()`` later,
e.g. at the end of the window). Receives may be posted early (``irecv``) but per (source, destination)
pair the messages arrive in send order -- the simulator checks that the lists receive them in that order,
so no tags are needed. All microbatches of one step use one version at a stage.

Versions: v = the stage's weights after v optimizer updates (v = 0: the initial weights); STEP{k} produces
v = k + 1 for every schedule (one update per step), so the k-th update uses lr(k).

- ``gpipe`` / ``1f1b``: synchronous, flushed every step: step k uses version k; REDUCE{k} and STEP{k}
  right after the stage's last backward of step k: ``x[k+1] = x[k] - U(g(x[k]))``.
- ``2bw`` (PipeDream-2BW): 1F1B over the continuous stream of microbatches (global index j = k*m + i),
  no flush, two versions per stage. Reference (single process): batch k is computed at x[k], x[1] = x[0],
  and the update applying g(batch k) produces x[k+2], i.e. ``x[t+1] = x[t] - U(g(x[t-1]))``. In versions
  (x[t] = version max(0, t-1)): step k uses version max(0, k-1) at every stage and STEP{k} (applying
  g(batch k)) produces version k+1. STEP{k} is placed as late as that allows -- just before the stage's
  first forward of step k+2 (at the end of the list for the window's last two steps) -- so the reduction
  has at least (m-p+1) forward/backward pairs to complete at stage 0 before anyone waits for it. Needs
  m >= p (with m = p-1 stage 0 would stall for the whole reduction every step).
- ``pipedream`` (original): one optimizer step per microbatch, so a step *is* a microbatch (m must be 1;
  run m*n steps of one microbatch for the same data). 1F1B over the stream with weight stashing: at stage
  s, microbatch j's forward follows the backward of microbatch j-(p-s) and its update, so it uses version
  max(0, j-(p-1-s)): stage s applies gradients computed with weights p-1-s versions old. REDUCE and STEP
  right after each backward; up to p versions are alive at stage 0.

A window of steps [first_step, first_step + num_steps) starts with an empty pipeline and ends drained (all
its STEPs done, so the stage holds version first_step + num_steps). Versions follow from the formulas
above, never from timing, so the chunking changes no numerics; a window's first forwards may use versions
older than the newest by ``version_lag``, which the executor keeps across windows.
"""
from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Optional

__all__ = [
    "SCHEDULES", "ActionType", "Action", "schedule_actions", "gpipe", "one_f_one_b", "pipedream_2bw",
    "pipedream", "version_of", "version_lag", "reduce_scope", "format_actions", "parse_actions",
]

SCHEDULES = ("gpipe", "1f1b", "2bw", "pipedream")


class ActionType(str, Enum):
    F = "F"
    B = "B"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    REDUCE = "REDUCE"
    STEP = "STEP"

    @property
    def is_send(self) -> bool:
        return self in (ActionType.SEND_ACT, ActionType.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (ActionType.RECV_ACT, ActionType.RECV_GRAD)


_COMPUTE = (ActionType.F, ActionType.B)
_PATTERN = re.compile(r"([A-Z_]+?)(\d+)(?:\.(\d+))?(?:@v(\d+))?(?:([<>])(\d+))?")


@dataclass(frozen=True, slots=True)
class Action:
    """One thing a stage does. Fields that do not apply to the type are None (checked on construction)."""

    type: ActionType
    step: int
    microbatch: Optional[int] = None
    """Index inside the step (0..m-1) for F, B and the four transfers."""
    version: Optional[int] = None
    """Weight version of F and B."""
    peer: Optional[int] = None
    """The other stage of a transfer (destination of a send, source of a receive)."""

    def __post_init__(self):
        t = ActionType(self.type)
        object.__setattr__(self, "type", t)
        fields = (self.microbatch, self.version, self.peer)
        want = (t in _COMPUTE or t.is_send or t.is_recv, t in _COMPUTE, t.is_send or t.is_recv)
        if want != tuple(x is not None for x in fields) or min((x for x in (self.step, *fields) if x is not None)) < 0:
            raise ValueError(f"malformed action {t.value}: step={self.step} microbatch={self.microbatch} "
                             f"version={self.version} peer={self.peer}")

    def __str__(self) -> str:
        s = f"{self.type.value}{self.step}"
        if self.microbatch is not None:
            s += f".{self.microbatch}"
        if self.version is not None:
            s += f"@v{self.version}"
        if self.peer is not None:
            s += f"{'>' if self.type.is_send else '<'}{self.peer}"
        return s

    __repr__ = __str__

    @staticmethod
    def from_str(text: str) -> "Action":
        m = _PATTERN.fullmatch(text.strip())
        if not m or m.group(1) not in ActionType.__members__:
            raise ValueError(f"not an action: {text!r} (e.g. F3.1@v2, SEND_ACT3.1>2, RECV_GRAD3.1<2, STEP3)")
        op, k, i, v, arrow, peer = m.groups()
        t = ActionType(op)
        if arrow is not None and arrow != (">" if t.is_send else "<"):
            raise ValueError(f"not an action: {text!r} (sends name their peer with '>', receives with '<')")
        num = lambda x: None if x is None else int(x)
        return Action(t, int(k), num(i), num(v), num(peer))


def format_actions(lists: list[list[Action]]) -> str:
    """One line per stage (``stage s: a a a``), for logs and for ``parse_actions``."""
    return "\n".join(f"stage {s}: " + " ".join(map(str, acts)) for s, acts in enumerate(lists))


def parse_actions(text: str) -> list[list[Action]]:
    out = []
    for line in filter(None, map(str.strip, text.splitlines())):
        head, _, body = line.partition(":")
        if head != f"stage {len(out)}":
            raise ValueError(f"expected 'stage {len(out)}: ...', got {line[:40]!r}")
        out.append([Action.from_str(w) for w in body.split()])
    return out


# ---------------------------------------------------------------------------- semantics


def version_of(schedule: str, step: int, stage: int, num_stages: int) -> int:
    """The weight version every microbatch of ``step`` uses at ``stage`` (semantics, not timing)."""
    if schedule in ("gpipe", "1f1b"):
        return step
    if schedule == "2bw":
        return max(0, step - 1)
    if schedule == "pipedream":
        return max(0, step - (num_stages - 1 - stage))
    raise ValueError(f"pipeline.schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}")


def reduce_scope(schedule: str, max_grad_norm: float) -> str:
    """``"global"``: STEP{k} waits for every stage's REDUCE{k} (the grad norm is all-reduced across stages);
    ``"stage"``: it waits only for its own. PipeDream without clipping needs no global norm, and a global one would
    make each per-microbatch update wait for the earlier stages' backward of that microbatch (the executor, the
    planner and the simulator all take the scope from here)."""
    return "stage" if schedule == "pipedream" and not max_grad_norm else "global"


def version_lag(schedule: str, stage: int, num_stages: int) -> int:
    """How many versions older than the newest a later window's forward may still need (kept across windows)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline.schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}")
    return {"2bw": 1, "pipedream": num_stages - 1 - stage}.get(schedule, 0)


# ---------------------------------------------------------------------------- compute orders

Order = list[tuple[ActionType, int]]  # (F or B, microbatch index counted from the window's start)


def _order_1f1b(stage: int, p: int, n: int, extra: int = 0) -> Order:
    """1F1B at ``stage`` over ``n`` microbatches: p-1-stage (+ extra, except at the last stage) warm-up
    forwards, F/B pairs, cool-down backwards."""
    w = min(p - 1 - stage + (extra if stage < p - 1 else 0), n)
    order = [(ActionType.F, j) for j in range(w)]
    for j in range(n - w):
        order += [(ActionType.F, j + w), (ActionType.B, j)]
    return order + [(ActionType.B, j) for j in range(n - w, n)]


def _order_gpipe(stage: int, p: int, n: int) -> Order:
    return [(ActionType.F, j) for j in range(n)] + [(ActionType.B, j) for j in range(n)]


def _per_step(local: Callable[[int, int, int], Order], m: int, n: int) -> Callable[[int, int], Order]:
    """A flushed schedule: ``local`` applied to each step's m microbatches in turn."""
    return lambda s, p: [(t, k * m + j) for k in range(n) for t, j in local(s, p, m)]


def _lower(order: Order, s: int, p: int, m: int, k0: int, version: Callable[[int, int], int], late_step: bool) -> list[Action]:
    """Turn a compute order into actions: transfers around F/B, REDUCE after a step's last B, and STEP."""
    A, T = Action, ActionType
    out: list[Action] = []
    b_done: dict[int, int] = {}
    pending: deque[int] = deque()  # late_step: reduced steps whose STEP is not placed yet
    for t, j in order:
        k, i = k0 + j // m, j % m
        v = version(k, i)
        if t == T.F:
            while pending and pending[0] <= k - 2:  # 2bw: STEP(k-2) just before the first forward of step k
                out.append(A(T.STEP, pending.popleft()))
            if s > 0:
                out.append(A(T.RECV_ACT, k, i, peer=s - 1))
            out.append(A(T.F, k, i, v))
            if s < p - 1:
                out.append(A(T.SEND_ACT, k, i, peer=s + 1))
        else:
            if s < p - 1:
                out.append(A(T.RECV_GRAD, k, i, peer=s + 1))
            out.append(A(T.B, k, i, v))
            if s > 0:
                out.append(A(T.SEND_GRAD, k, i, peer=s - 1))
            b_done[k] = b_done.get(k, 0) + 1
            if b_done[k] == m:  # the stage's last backward of step k
                out.append(A(T.REDUCE, k))
                if late_step:
                    pending.append(k)
                else:
                    out.append(A(T.STEP, k))
    out += [A(T.STEP, k) for k in pending]
    return out


def _check(name: str, p: int, m: int, n: int, k0: int, extra: int = 0) -> None:
    for what, val, lo in (("num_stages", p, 1), ("num_microbatches", m, 1), ("num_steps", n, 0), ("first_step", k0, 0),
                          ("extra_warmup", extra, 0)):
        if not isinstance(val, int) or val < lo:
            raise ValueError(f"{name}: {what} must be an integer >= {lo}, got {val!r}")


def gpipe(num_stages: int, num_microbatches: int, num_steps: int, first_step: int = 0) -> list[list[Action]]:
    """GPipe: per step all forwards then all backwards, flush; step k uses version k."""
    p, m, n, k0 = num_stages, num_microbatches, num_steps, first_step
    _check("gpipe", p, m, n, k0)
    return [_lower(_per_step(_order_gpipe, m, n)(s, p), s, p, m, k0, lambda k, i: k, False) for s in range(p)]


def one_f_one_b(num_stages: int, num_microbatches: int, num_steps: int, first_step: int = 0,
                extra_warmup: int = 0) -> list[list[Action]]:
    """1F1B with a flush every step (PipeDream-Flush); step k uses version k."""
    p, m, n, k0 = num_stages, num_microbatches, num_steps, first_step
    _check("1f1b", p, m, n, k0, extra_warmup)
    order = _per_step(lambda s, p, m: _order_1f1b(s, p, m, extra_warmup), m, n)
    return [_lower(order(s, p), s, p, m, k0, lambda k, i: k, False) for s in range(p)]


def pipedream_2bw(num_stages: int, num_microbatches: int, num_steps: int, first_step: int = 0,
                  extra_warmup: int = 0) -> list[list[Action]]:
    """PipeDream-2BW: 1F1B over the stream, no flush; step k uses version max(0, k-1); STEP(k) placed late."""
    p, m, n, k0 = num_stages, num_microbatches, num_steps, first_step
    _check("2bw", p, m, n, k0, extra_warmup)
    if m < p:
        raise ValueError(f"2bw needs num_microbatches >= num_stages ({m} < {p}): a step's gradient must be reduced "
                         f"at every stage before the next-but-one step starts; raise pipeline.num_microbatches to {p} "
                         f"or use fewer stages")
    if extra_warmup and m < p + extra_warmup:
        raise ValueError(f"2bw with extra_warmup {extra_warmup} needs num_microbatches >= num_stages + extra_warmup "
                         f"({m} < {p + extra_warmup}): stage 0 runs p-1+extra_warmup forwards ahead, and step k's "
                         f"gradient reduction must still overlap at least one forward/backward pair")
    return [_lower(_order_1f1b(s, p, n * m, extra_warmup), s, p, m, k0, lambda k, i: max(0, k - 1), True)
            for s in range(p)]


def pipedream(num_stages: int, num_microbatches: int, num_steps: int, first_step: int = 0) -> list[list[Action]]:
    """Original PipeDream: one update per microbatch (m = 1), weight stashing; stage s lags p-1-s versions."""
    p, m, n, k0 = num_stages, num_microbatches, num_steps, first_step
    _check("pipedream", p, m, n, k0)
    if m != 1:
        raise ValueError(f"pipedream takes one optimizer step per microbatch: num_microbatches must be 1 (got {m}); "
                         f"run {m * max(n, 1)} steps of one microbatch for the same data")
    return [_lower(_order_1f1b(s, p, n), s, p, 1, k0, lambda k, i, s=s: max(0, k - (p - 1 - s)), False) for s in range(p)]


_BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b, "2bw": pipedream_2bw, "pipedream": pipedream}


def schedule_actions(name: str, num_stages: int, num_microbatches: int, num_steps: int, first_step: int = 0,
                     extra_warmup: int = 0) -> list[list[Action]]:
    """One action list per stage for steps [first_step, first_step + num_steps), empty at the start, drained at the end.

    ``extra_warmup`` (1f1b and 2bw): forwards every non-last stage runs ahead of plain 1F1B. Each costs one
    microbatch of activation memory there and lets the next stage find its input already waiting, which absorbs
    timing jitter when stages are nearly balanced; versions, and so numerics, do not change.
    """
    if name not in _BUILDERS:
        raise ValueError(f"pipeline.schedule: {name!r} is not one of {', '.join(SCHEDULES)}")
    if extra_warmup and name not in ("1f1b", "2bw"):
        raise ValueError(f"pipeline.extra_warmup applies to 1f1b and 2bw, not {name!r}; set it to 0")
    kw = {"extra_warmup": extra_warmup} if extra_warmup else {}
    return _BUILDERS[name](num_stages, num_microbatches, num_steps, first_step, **kw)

