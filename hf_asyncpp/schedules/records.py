"""Pipeline schedules as data: one ``Schedule`` record per schedule, one list of actions per stage.

A record (``GPIPE``, ``ONE_F_ONE_B``, ``ZB_H1``, ``TWO_BW``, ``PIPEDREAM``; ``SCHEDULES`` by name) holds every fact of its
schedule: the weight version each step uses, how many older versions a stage keeps, where STEP goes, its
constraints, and ``actions(num_stages, num_microbatches, num_steps, first_step)`` returning ``lists[s]``, the
actions stage ``s`` executes in order (data parallelism is the executor's business: every replica of stage ``s``
runs ``lists[s]``). ``simulator.simulate`` runs the lists without processes. No module outside this one switches
on a schedule's name: the executor, simulator, planner, run profile and recipe checks ask the record. The two
single-process names are here too: ``NO_PIPELINE`` (``pipeline.schedule: none``; ``pipelined``,
``processes_per_pipeline``) and ``SimulatedDelay`` (``optimizer.simulate_delay``: the delays of a record,
reproduced in one process; ``SIMULATED_DELAYS`` by name).

Actions (``str(a)`` / ``Action.from_str`` round-trip; ``k`` = step, ``i`` = microbatch in the step):

==========================  ============================================================================
``F{k}.{i}@v{v}``           forward of microbatch (k, i) with weight version v
``B{k}.{i}@v{v}``           backward of (k, i) with the same version v as its forward (weight stashing);
                            gradients accumulate over the step's microbatches (all use one version)
``I{k}.{i}@v{v}``           zero-bubble schedules: the first half of B, the gradient to the stage's input only
                            (sent to s-1 like B's); the graph is kept for the W that completes it
``W{k}.{i}@v{v}``           the second half: the weight gradient of (k, i), from what its I kept; it may come
                            later, into a bubble, and completes the microbatch as a B does
``SEND_ACT{k}.{i}>{s+1}``   after F on s < p-1: isend the outputs to stage s+1 (non-blocking)
``RECV_ACT{k}.{i}<{s-1}``   before F on s > 0: the inputs from stage s-1 (blocks until they are here)
``SEND_GRAD{k}.{i}>{s-1}``  after B (or I) on s > 0: isend the input gradients to stage s-1 (non-blocking)
``RECV_GRAD{k}.{i}<{s+1}``  before B (or I) on s < p-1: the output gradients from stage s+1 (blocks)
``REDUCE{k}``               after the stage's last B (or W) of step k: post step k's gradient
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

- ``gpipe`` / ``1f1b`` / ``zbh1``: synchronous, flushed every step: step k uses version k; REDUCE{k} and STEP{k}
  right after the stage's last backward of step k: ``x[k+1] = x[k] - U(g(x[k]))``. ``zbh1`` is 1F1B with each
  B split into I and W, the W's delayed into the cool-down (``_order_zb_h1``).
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
older than the newest by the record's ``lag``, which the executor keeps across windows. The trainer cuts windows
only where the numbers need a drained pipeline (a checkpoint, an evaluation, the end): logging never drains.
"""
from __future__ import annotations

import re
from collections import deque
import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterator, Optional

__all__ = [
    "Schedule", "SCHEDULES", "GPIPE", "ONE_F_ONE_B", "ZB_H1", "TWO_BW", "PIPEDREAM", "BACKWARDS", "get_schedule",
    "ActionType", "Action", "schedule_actions", "version_lag", "format_actions", "parse_actions", "NO_PIPELINE", "pipelined",
    "processes_per_pipeline", "one_step_delay", "SimulatedDelay", "SIMULATED_DELAYS", "get_simulated_delay",
]


class ActionType(str, Enum):
    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the zero-bubble papers' name: the backward to the stage's input
    W = "W"
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


_COMPUTE = (ActionType.F, ActionType.B, ActionType.I, ActionType.W)
BACKWARDS = frozenset({ActionType.B, ActionType.W})
"""The actions that complete a microbatch's backward at a stage (B, or the W after its I): its activations are
released, its weight gradient accumulated, and the step's REDUCE may follow the last of them."""
_FIELDS = {t: (t in _COMPUTE or t.is_send or t.is_recv, t in _COMPUTE, t.is_send or t.is_recv) for t in ActionType}
"""Which of (microbatch, version, peer) each type has: looked up, not derived, for every one of the million actions
a planner's search lowers."""
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
        t = self.type
        if type(t) is not ActionType:
            t = ActionType(t)
            object.__setattr__(self, "type", t)
        mb, v, peer = self.microbatch, self.version, self.peer
        if (_FIELDS[t] != (mb is not None, v is not None, peer is not None) or self.step < 0
                or (mb is not None and mb < 0) or (v is not None and v < 0) or (peer is not None and peer < 0)):
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


# ---------------------------------------------------------------------------- compute orders
# Orders and lowering are generators: a stage's list for a long stretch of steps is produced as it is executed, so
# the executor's memory does not grow with the number of steps between two drain points.

Order = Iterator[tuple[ActionType, int]]  # (F, B, I or W, microbatch index counted from the window's start)


def _order_1f1b(stage: int, p: int, n: int, extra: int = 0) -> Order:
    """1F1B at ``stage`` over ``n`` microbatches: p-1-stage (+ extra, except at the last stage) warm-up
    forwards, F/B pairs, cool-down backwards."""
    w = min(p - 1 - stage + (extra if stage < p - 1 else 0), n)
    for j in range(w):
        yield ActionType.F, j
    for j in range(n - w):
        yield ActionType.F, j + w
        yield ActionType.B, j
    for j in range(n - w, n):
        yield ActionType.B, j


def _order_zb_h1(stage: int, p: int, n: int) -> Order:
    """ZB-H1 at ``stage`` over ``n`` microbatches (Qi et al., "Zero Bubble Pipeline Parallelism", 2024; torch's
    ``ScheduleInterleavedZeroBubble`` with one stage per rank): 1F1B with each B split into I and W. Stage s
    runs p-1-s warm-up forwards and F/I pairs as 1F1B does; its first s I's are not followed by their W, so the
    W's trail the I's by s microbatches and fill the cool-down, where 1F1B's stages wait for the backwards to come
    back. Activations live from F to W, so a stage holds at most p-s microbatches plus the s whose W trails:
    1F1B's p at stage 0, about 1F1B's at the others (the papers' "H1": 1F1B's peak memory)."""
    T = ActionType
    w = min(p - 1 - stage, n)
    weights = 0  # W's placed so far (in microbatch order)
    for j in range(w):
        yield T.F, j
    for j in range(n - w):
        yield T.F, j + w
        yield T.I, j
        if j >= stage:
            yield T.W, weights
            weights += 1
    for j in range(n - w, n):
        yield T.I, j
        if j >= stage:
            yield T.W, weights
            weights += 1
    for j in range(weights, n):
        yield T.W, j


def _order_gpipe(stage: int, p: int, n: int) -> Order:
    for j in range(n):
        yield ActionType.F, j
    for j in range(n):
        yield ActionType.B, j


def _per_step(local: Callable[[int, int, int], Order], s: int, p: int, m: int, n: int) -> Order:
    """A flushed schedule: ``local`` applied to each step's m microbatches in turn."""
    for k in range(n):
        for t, j in local(s, p, m):
            yield t, k * m + j


def _lower(order: Order, s: int, p: int, m: int, k0: int, version: Callable[[int], int], late_step: bool) -> Iterator[Action]:
    """Turn a compute order into actions: transfers around F and B (or I), REDUCE after a step's last B (or W), and
    STEP."""
    A, T = Action, ActionType
    b_done: dict[int, int] = {}
    pending: deque[int] = deque()  # late_step: reduced steps whose STEP is not placed yet
    for t, j in order:
        k, i = k0 + j // m, j % m
        v = version(k)
        if t == T.F:
            while pending and pending[0] <= k - 2:  # 2bw: STEP(k-2) just before the first forward of step k
                yield A(T.STEP, pending.popleft())
            if s > 0:
                yield A(T.RECV_ACT, k, i, peer=s - 1)
            yield A(T.F, k, i, v)
            if s < p - 1:
                yield A(T.SEND_ACT, k, i, peer=s + 1)
        elif t == T.W:
            yield A(T.W, k, i, v)
        else:
            if s < p - 1:
                yield A(T.RECV_GRAD, k, i, peer=s + 1)
            yield A(t, k, i, v)
            if s > 0:
                yield A(T.SEND_GRAD, k, i, peer=s - 1)
        if t in BACKWARDS:
            b_done[k] = b_done.get(k, 0) + 1
            if b_done[k] == m:  # the stage's last backward of step k
                del b_done[k]
                yield A(T.REDUCE, k)
                if late_step:
                    pending.append(k)
                else:
                    yield A(T.STEP, k)
    for k in pending:
        yield A(T.STEP, k)


# ---------------------------------------------------------------------------- builders


def _check(name: str, p: int, m: int, n: int, k0: int, extra: int = 0) -> None:
    for what, val, lo in (("num_stages", p, 1), ("num_microbatches", m, 1), ("num_steps", n, 0), ("first_step", k0, 0),
                          ("extra_warmup", extra, 0)):
        if not isinstance(val, int) or val < lo:
            raise ValueError(f"{name}: {what} must be an integer >= {lo}, got {val!r}")


def _flushed(local: Callable[[int, int, int, int], Order]):
    """Builder of a synchronous schedule: ``local`` per step, REDUCE and STEP right after a step's last backward."""
    def build(sched: "Schedule", s: int, p: int, m: int, n: int, k0: int, extra: int) -> Iterator[Action]:
        order = _per_step(lambda s_, p_, m_: local(s_, p_, m_, extra), s, p, m, n)
        return _lower(order, s, p, m, k0, lambda k: sched.version(k, s, p), False)
    return build


def _stream_1f1b(sched: "Schedule", s: int, p: int, m: int, n: int, k0: int, extra: int) -> Iterator[Action]:
    """Builder of an asynchronous schedule: 1F1B over the continuous stream of n*m microbatches, no flush."""
    return _lower(_order_1f1b(s, p, n * m, extra), s, p, m, k0, lambda k: sched.version(k, s, p), sched.late_step)


def _check_2bw(p: int, m: int, extra: int) -> None:
    if m < p:
        raise ValueError(f"2bw needs num_microbatches >= num_stages ({m} < {p}): a step's gradient must be reduced "
                         f"at every stage before the next-but-one step starts; raise pipeline.num_microbatches to {p} "
                         f"or use fewer stages")
    if extra and m < p + extra:
        raise ValueError(f"2bw with extra_warmup {extra} needs num_microbatches >= num_stages + extra_warmup "
                         f"({m} < {p + extra}): stage 0 runs p-1+extra_warmup forwards ahead, and step k's "
                         f"gradient reduction must still overlap at least one forward/backward pair")


def _check_pipedream(p: int, m: int, extra: int) -> None:
    if m != 1:
        raise ValueError(f"pipedream takes one optimizer step per microbatch: num_microbatches must be 1 (got {m}); "
                         f"set pipeline.microbatch_size to the batch you want per update")


# ---------------------------------------------------------------------------- the records


@dataclass(frozen=True)
class Schedule:
    """Everything a schedule means. The executor, the simulator, the planner, the run profile and the recipe
    checks ask this record and never switch on a schedule's name."""

    name: str
    title: str
    """One line for model cards and reports."""
    synchronous: bool
    """Every step computed on the newest weights (a flush per step)."""
    version: Callable[[int, int, int], int]
    """(step, stage, p) -> the weight version every microbatch of the step uses at the stage."""
    lag: Callable[[int, int], int]
    """(stage, p) -> how many versions older than the newest a later forward may still need."""
    late_step: bool
    """STEP{k} placed just before the stage's first forward of step k+2 (one gradient set waits, one accumulates)."""
    one_update_per_microbatch: bool
    """A step is one microbatch (m = 1)."""
    extra_warmup_ok: bool
    _build: Callable = field(repr=False)
    _constraints: Callable[[int, int, int], None] = field(repr=False, default=lambda p, m, extra: None)

    def check(self, num_stages: int, num_microbatches: int, extra_warmup: int = 0) -> None:
        """ValueError naming the knob when (p, m, extra_warmup) cannot run this schedule."""
        if extra_warmup and not self.extra_warmup_ok:
            raise ValueError(f"pipeline.extra_warmup applies to {' and '.join(n for n, s in SCHEDULES.items() if s.extra_warmup_ok)}, "
                             f"not {self.name!r}; set it to 0")
        self._constraints(num_stages, num_microbatches, extra_warmup)

    def actions(self, num_stages: int, num_microbatches: int, num_steps: int, first_step: int = 0,
                extra_warmup: int = 0) -> list[list[Action]]:
        """One action list per stage for steps [first_step, first_step + num_steps), empty at the start and drained
        at the end. Versions follow ``version``, so where a run is cut into such windows changes no numerics."""
        _check(self.name, num_stages, num_microbatches, num_steps, first_step, extra_warmup)
        return [list(self.stage_actions(s, num_stages, num_microbatches, num_steps, first_step, extra_warmup))
                for s in range(num_stages)]

    def stage_actions(self, stage: int, num_stages: int, num_microbatches: int, num_steps: int, first_step: int = 0,
                      extra_warmup: int = 0) -> Iterator[Action]:
        """Stage ``stage``'s list of ``actions``, produced lazily (checked now, generated as it is consumed)."""
        p, m, n, k0 = num_stages, num_microbatches, num_steps, first_step
        _check(self.name, p, m, n, k0, extra_warmup)
        self.check(p, m, extra_warmup)
        if not 0 <= stage < p:
            raise ValueError(f"{self.name}: stage {stage} is not in 0..{p - 1}")
        return self._build(self, stage, p, m, n, k0, extra_warmup)

    def weight_versions(self, stage: int, num_stages: int) -> int:
        """Weight buffers a stage holds at most."""
        return self.lag(stage, num_stages) + 1

    @property
    def grad_sets(self) -> int:
        """Gradient sets alive at once: with a late STEP one step's gradient waits while the next accumulates."""
        return 2 if self.late_step else 1

    def reduce_scope(self, max_grad_norm: float) -> str:
        """``"global"``: STEP{k} waits for every stage's REDUCE{k} (the grad norm is all-reduced across stages);
        ``"stage"``: it waits only for its own. An update per microbatch without clipping needs no global norm, and
        a global one would make each update wait for the earlier stages' backward of that microbatch."""
        return "stage" if self.one_update_per_microbatch and not max_grad_norm else "global"

    def representative(self, num_stages: int, num_microbatches: int) -> tuple[int, int]:
        """(m, steps) of a short simulation that reaches the steady state (report, planner)."""
        if self.one_update_per_microbatch:
            return 1, 3 * num_stages
        return num_microbatches, 3


GPIPE = Schedule(
    name="gpipe", title="GPipe, synchronous", synchronous=True, version=lambda k, s, p: k, lag=lambda s, p: 0,
    late_step=False, one_update_per_microbatch=False, extra_warmup_ok=False,
    _build=_flushed(lambda s, p, m, extra: _order_gpipe(s, p, m)))
"""GPipe: per step all forwards then all backwards, flush; step k uses version k."""

ONE_F_ONE_B = Schedule(
    name="1f1b", title="1F1B, synchronous", synchronous=True, version=lambda k, s, p: k, lag=lambda s, p: 0,
    late_step=False, one_update_per_microbatch=False, extra_warmup_ok=True,
    _build=_flushed(_order_1f1b))
"""1F1B with a flush every step (PipeDream-Flush); step k uses version k."""

TWO_BW = Schedule(
    name="2bw", title="PipeDream-2BW, asynchronous", synchronous=False,
    version=lambda k, s, p: max(0, k - 1), lag=lambda s, p: 1, late_step=True, one_update_per_microbatch=False,
    extra_warmup_ok=True, _build=_stream_1f1b, _constraints=_check_2bw)
"""PipeDream-2BW, ``x[t+1] = x[t] - U(g(x[t-1]))``: 1F1B over the stream with no flush; step k runs on version
max(0, k-1) at every stage, so a stage holds two weight buffers (the version in use and the one its STEP writes,
``versions.Versions`` with lag 1); STEP{k} waits as late as that allows, just before the first forward of step k+2,
which leaves the reduction (m - p + 1) forward/backward pairs to finish; needs m >= p."""

PIPEDREAM = Schedule(
    name="pipedream", title="PipeDream with weight stashing, asynchronous", synchronous=False,
    version=lambda k, s, p: max(0, k - (p - 1 - s)), lag=lambda s, p: p - 1 - s, late_step=False,
    one_update_per_microbatch=True, extra_warmup_ok=False, _build=_stream_1f1b, _constraints=_check_pipedream)
"""Original PipeDream: one update per microbatch, weight stashing; stage s applies gradients p-1-s versions old."""

ZB_H1 = Schedule(
    name="zbh1", title="ZB-H1 zero bubble, synchronous", synchronous=True, version=lambda k, s, p: k,
    lag=lambda s, p: 0, late_step=False, one_update_per_microbatch=False, extra_warmup_ok=False,
    _build=_flushed(lambda s, p, m, extra: _order_zb_h1(s, p, m)))
"""ZB-H1: 1F1B with each backward split into I (the input gradient, sent on at once) and W (the weight gradient,
later); the W's fill the cool-down. It computes 1F1B's gradients, flushed every step (version k)."""

SCHEDULES: dict[str, Schedule] = {s.name: s for s in (GPIPE, ONE_F_ONE_B, ZB_H1, TWO_BW, PIPEDREAM)}


def with_sync_start(schedule: Schedule, start_step: int) -> Schedule:
    """``optimizer.delay_start_step`` ("sync start") in the pipeline: ``schedule`` (asynchronous) whose steps before
    ``start_step`` run as 1F1B with a flush each (version k), then ``schedule`` itself from that drain point on, as
    it starts: no older version exists yet, so step ``start_step`` uses its own weights (2BW: version
    ``max(start_step, k - 1)``), exactly the single-process reference's sync start (``optim/delay.py``). A
    window of steps across ``start_step`` is the 1F1B part, drained, followed by the asynchronous part."""
    if start_step <= 0 or schedule.synchronous:
        return schedule
    if schedule.one_update_per_microbatch:
        raise ValueError(f"optimizer.delay_start_step: not available with pipeline.schedule {schedule.name!r}; use 2bw")
    K = start_step

    def version(k: int, s: int, p: int) -> int:
        return k if k < K else max(K, schedule.version(k, s, p))

    def build(sched: Schedule, s: int, p: int, m: int, n: int, k0: int, extra: int) -> Iterator[Action]:
        sync = max(0, min(n, K - k0))  # steps of this window before K
        if sync:
            yield from ONE_F_ONE_B._build(sched, s, p, m, sync, k0, extra)
        if n > sync:
            yield from schedule._build(sched, s, p, m, n - sync, k0 + sync, extra)

    return dataclasses.replace(schedule, name=f"{schedule.name}", title=f"{schedule.title}, synchronous for the first {K} steps",
                               version=version, _build=build)


def get_schedule(name: "str | Schedule") -> Schedule:
    if isinstance(name, Schedule):
        return name
    if name not in SCHEDULES:
        raise ValueError(f"pipeline.schedule: {name!r} is not one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def schedule_actions(name: str, num_stages: int, num_microbatches: int, num_steps: int, first_step: int = 0,
                     extra_warmup: int = 0) -> list[list[Action]]:
    """``get_schedule(name).actions(...)``.

    ``extra_warmup`` (1f1b and 2bw): forwards every non-last stage runs ahead of plain 1F1B. Each costs one
    microbatch of activation memory there and lets the next stage find its input already waiting, which absorbs
    timing jitter when stages are nearly balanced; versions, and so numerics, do not change.
    """
    return get_schedule(name).actions(num_stages, num_microbatches, num_steps, first_step, extra_warmup)


def version_lag(schedule: str, stage: int, num_stages: int) -> int:
    return get_schedule(schedule).lag(stage, num_stages)


# ---------------------------------------------------------------------------- one process: no schedule, or its delays

NO_PIPELINE = "none"
"""``pipeline.schedule`` for the whole model in each process (``engine.LocalEngine``): no record, no action lists."""


def pipelined(schedule: str) -> bool:
    """Whether ``pipeline.schedule`` names a record (its stages are processes), not ``none``."""
    return schedule != NO_PIPELINE


def processes_per_pipeline(schedule: str, num_stages: int) -> int:
    """Processes one copy of the model takes: its stages when pipelined; 1 for ``none``, where ``num_stages`` only
    shapes a simulated delay."""
    return num_stages if pipelined(schedule) else 1


@dataclass(frozen=True)
class SimulatedDelay:
    """An ``optimizer.simulate_delay`` value: one process applying each gradient as late as ``schedule`` does
    (stage s's parameters get gradients ``schedule.lag(s, p)`` versions old; ``optim.delay.DelaySimulator``)."""

    name: str
    schedule: Schedule
    per_stage: bool
    """The lag differs between stages, so the model's split into stages matters (and a tied head on the last stage
    runs on current weights)."""

    @property
    def delayed(self) -> bool:
        return not self.schedule.synchronous

    def lags(self, num_stages: int) -> list[int]:
        return [self.schedule.lag(s, num_stages) for s in range(num_stages)]


SIMULATED_DELAYS: dict[str, SimulatedDelay] = {d.name: d for d in (
    SimulatedDelay("0", ONE_F_ONE_B, per_stage=False), SimulatedDelay("1", TWO_BW, per_stage=False),
    SimulatedDelay("pipedream", PIPEDREAM, per_stage=True))}


def one_step_delay(schedule: str, simulate_delay: "str | int") -> bool:
    """Whether a run's gradients are exactly one step stale at every stage, as the EF correction's learned lambda
    and sync start assume: 2BW in the pipeline, or its single-process reference (``simulate_delay: 1``)."""
    s = get_schedule(schedule) if pipelined(schedule) else get_simulated_delay(simulate_delay).schedule
    return s is TWO_BW


def get_simulated_delay(name: "str | int | SimulatedDelay") -> SimulatedDelay:
    """The record of an ``optimizer.simulate_delay`` value (YAML may read ``1`` as an int)."""
    if isinstance(name, SimulatedDelay):
        return name
    if str(name) not in SIMULATED_DELAYS:
        raise ValueError(f"optimizer.simulate_delay: {name!r} is not one of {', '.join(map(repr, SIMULATED_DELAYS))}")
    return SIMULATED_DELAYS[str(name)]
