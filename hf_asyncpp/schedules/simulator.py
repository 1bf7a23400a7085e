"""Run schedule action lists without processes: deadlocks, FIFO order, coverage, timelines, bubbles, memory.

Model (one clock per stage, each stage runs its list in order; an action starts when the stage is free and
its inputs are ready):

- ``F``, ``B``, ``I``, ``W``, ``STEP`` take their cost on the stage (a split backward's ``I`` and ``W`` half of
  ``B``'s each unless given; F, B and I plus the stage's expert all-to-alls, ``Costs.all_to_all``).
- A send costs the sender nothing (``isend``). A receive waits until the matching send happened plus the
  ``comm`` latency. Messages between two stages are matched in FIFO order per (source, destination) pair
  -- type, step and microbatch must equal the head of the queue -- so an executor needs no tags.
  ``blocking_sends=True`` models a send that is waited for in place (gloo completes a large ``isend``
  only when the peer receives): the sender also waits until the receiver reaches the matching receive.
- ``VOCAB{k}.{i}`` (the vocabulary layers shared by every stage, ``records._vocab_passes``): a computation and a
  collective of every stage (every rank) of the replica. It starts when the last of them reaches it, and all end
  together, after the slowest stage's ``vocab`` (its shard of the output layer and loss, forward and backward) plus
  ``vocab_comm`` (the broadcast of the final hidden states from the last stage and the reduce of their gradient back
  to it; 2 x ``comm`` unless given). The rank holding the last model stage must have run that stage's forward of
  (k, i) before it, and that stage's backward (B or I) of (k, i) needs it (the hidden states' gradient). Every rank
  runs the VOCABs in the same order, each microbatch once, with the step's version, before the step's REDUCE (it
  accumulates the shard's weight gradient).
- ``REDUCE{k}`` costs the stage nothing: it posts step k's reduction, a collective of all stages (global
  grad norm, tied embeddings, data parallel) that runs off the compute stream, starts when the last stage
  posts it and takes ``reduce``. Every stage must post the reductions in the same step order.
  ``STEP{k}`` waits for that reduction to finish.

NCCL (``nccl=True``). gloo matches a receive with its send whatever else is in flight, so the model above is
all it needs. NCCL does not: the point-to-point operations a rank posts on one communicator to one peer run on
one stream and complete one at a time, in the order they were posted, in both directions. A receive at the head
of that FIFO holds back every later send and receive behind it until its data arrives, and a send completes only
together with the receive at the head of the peer's FIFO (no buffering: the strict case of large messages). So
``nccl=True`` keeps one FIFO of posted operations per (rank, communicator, peer), the communicator being
``channel(src, dst)`` (``channels.channel``: one per direction between adjacent stages), and posts in the
executor's order: a send at its SEND action (the program goes on); a receive at its RECV action unless posted
already, and with ``prefetch`` the stage's next receive of the same kind right after a receive completed (at the
RECV action, before the next action), so it sits in front of every send the stage posts after it. The head send
of one FIFO and the head receive of the peer's FIFO on the same communicator complete together at
max(both posts, the previous completion on either FIFO) + ``comm``; a stage blocks at a RECV until its receive
completed (and, with ``blocking_sends``, at a SEND until its send completed). With everything on one communicator
(``channel=lambda s, d: "world"``, the executor before ``channels``) a prefetched receive stands in front of the
stage's next send while the peer's stands in front of its own: a deadlock gloo never shows (without the prefetch
1F1B still hangs there: two unbuffered sends meet at the heads). With the per-direction channels each FIFO holds
only sends or only receives, and for the schedules' lists the rule costs nothing (same timeline at comm = 0).

Virtual stages (a rank holding several model stages, its actions naming them: ``Action.stage``): the clock, the
timeline, versions, REDUCE and STEP are the rank's; forwards and backwards are counted per model stage, costs of F,
B, I, W and receives are looked up by model stage (STEP and REDUCE by rank), and messages are matched per pair of
ranks with the stage they come from. A stage's forward needs its input: received from the previous stage's rank, or
computed before it by the previous stage on the same rank; a backward (B or I) needs its output's gradient likewise.

Bubble (``SimResult.bubble``, idle share of stage-time) in two parts that sum to it (``split_bubble``): ``imbalance``,
the idle that exists only because the stages' work differs (each stage idles at least as long as the busiest stage
works more than it), and ``fill_drain``, the rest: the schedule's own warm-up and cool-down and its waits on
dependencies, which the busiest stage pays too and equal stages would still pay.

Checks (``ScheduleError``): deadlock (with a grid of each stage's blocked action, ``<-- ERROR HERE``; with
``nccl`` also the FIFO the blocked transfer sits in, what stands in front of it and the peer's head), a
receive out of send order, a message never received, a microbatch not forwarded and backwarded exactly
once on every stage, a backward with another version than its forward, microbatches of one step on
different versions at one stage, a forward on a version not produced yet, a step's REDUCE before its last
backward, STEPs out of order or missing, collectives out of order; VOCAB passes out of order across ranks, twice,
missing on a rank, on another version than the step's, before the last stage's forward or after the step's REDUCE
or the last stage's backward of its microbatch; with ``schedule``, also every forward's version against the schedule
record's ``version`` rule.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict, deque
from dataclasses import dataclass, field, fields
from typing import Callable, Hashable, Mapping, NamedTuple, Optional, Sequence, Union

from . import channels
from .nccl_rule import NcclFifos, NcclRule, SEND_OF, awaited_text, message_text
from .actions import Action, ActionType
from .records import get_schedule

__all__ = ["BubbleSplit", "Costs", "Interval", "SimResult", "ScheduleError", "simulate", "split_bubble"]

T = ActionType
Number = Union[float, Sequence[float]]


_COMPUTED = frozenset({T.F, T.B, T.I, T.W})
"""A microbatch's compute on a stage."""
_TIMED = _COMPUTED | {T.STEP}
"""What takes time on a stage's compute stream."""
_TRANSFERS = frozenset({T.SEND_ACT, T.RECV_ACT, T.SEND_GRAD, T.RECV_GRAD})


class ScheduleError(RuntimeError):
    """An action list that would hang, mismatch messages or compute the wrong thing."""


@dataclass
class Costs:
    """Per-action costs in any time unit; a list gives one value per stage."""

    forward: Number = 1.0
    backward: Number = 1.0
    step: Number = 0.0
    """Optimizer update, on the stage."""
    reduce: Number = 0.0
    """Latency of a step's gradient reduction (off the compute stream; STEP waits for it)."""
    comm: Number = 0.0
    """Latency of one transfer (send to matching receive)."""
    backward_input: Optional[Number] = None
    """``I`` of a split backward (zero-bubble schedules); None: half of ``backward``."""
    backward_weight: Optional[Number] = None
    """``W`` of a split backward; None: half of ``backward``."""
    vocab: Number = 0.0
    """``VOCAB``: a stage's shard of the output layer and loss for one microbatch, forward and backward (the head's
    forward + backward / num_stages where the vocabulary is split evenly)."""
    vocab_comm: Optional[Number] = None
    """Latency a VOCAB adds to its computation: the broadcast of the last stage's final hidden states and the reduce
    of their gradient back to it (each the size of one boundary transfer); None: 2 x ``comm``.

    With several stages per rank, lists index F, B, I, W, comm and all_to_all by model stage and STEP, REDUCE and
    VOCAB by rank."""
    all_to_all: Number = 0.0
    """Seconds a stage's expert all-to-alls take per microbatch and pass (expert parallelism: the forward's dispatch
    and combine; the backward's, their gradients, the same bytes), on the compute stream: transformers'
    ``AllToAllEP`` waits for each before the experts or the next layer run. Added to every F and B, and to I, which
    carries the gradient back through the collectives (W, the weight gradients, needs none). Kept apart from F and
    B so that measured compute and modelled communication stay apart."""

    _KEYS = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight", "STEP": "step",
             "REDUCE": "reduce", "RECV_ACT": "comm", "RECV_GRAD": "comm", "VOCAB": "vocab"}

    def of(self, action: Action, stage: int) -> float:
        name = self._KEYS.get(action.type.value)
        if name is None:  # sends
            return 0.0
        at = lambda v: float(v[stage] if isinstance(v, (list, tuple)) else v)
        v = getattr(self, name)
        if v is None:  # a split backward's half of the compute, where only the whole was given
            v = 0.5 * at(self.backward)
        exchange = at(self.all_to_all) if action.type in (T.F, T.B, T.I) else 0.0
        return at(v) + exchange

    def vocab_latency(self) -> float:
        """What a VOCAB's collectives add to its slowest stage's computation (``vocab_comm``, else 2 x the largest
        ``comm``): one value for the whole replica, as the pass ends on every stage together."""
        v = self.vocab_comm if self.vocab_comm is not None else self.comm
        v = max(v) if isinstance(v, (list, tuple)) else v
        return float(v if self.vocab_comm is not None else 2 * v)

    def per_rank(self, stage_ranks: list[int]) -> "Costs":
        """These per-stage costs for lists whose ranks hold several stages (``stage_ranks[g]``: the rank of stage g):
        F, B, I, W, comm and all_to_all stay per stage; STEP and REDUCE, one per rank for all its stages, become the
        sums of its stages' (a single number counts once per stage)."""
        num_ranks = max(stage_ranks) + 1

        def summed(x: Number) -> list[float]:
            per_stage = x if isinstance(x, (list, tuple)) else [x] * len(stage_ranks)
            return [float(sum(c for c, r in zip(per_stage, stage_ranks) if r == rank)) for rank in range(num_ranks)]
        return dataclasses.replace(self, step=summed(self.step), reduce=summed(self.reduce))

    def checkpointed(self) -> "Costs":
        """These costs (of layers that keep their activations) under activation checkpointing, as the executor runs
        it: every backward pass (a graph task) that reaches a checkpointed layer replays its forward first, so a B
        costs one more F, and a split backward, two passes, one F in its I and one in its W. The first stage sends
        no input gradient: its I does nothing and its W is its whole backward, one pass, so only its W replays
        (a single number stands for every stage as one after the first)."""
        def plus(x: Number, y: Number, first: bool = True) -> Number:
            if not isinstance(x, (list, tuple)) and not isinstance(y, (list, tuple)):
                return x + y
            n = len(x) if isinstance(x, (list, tuple)) else len(y)
            at = lambda v, i: v[i] if isinstance(v, (list, tuple)) else v
            return [at(x, i) + (at(y, i) if first or i > 0 else 0.0) for i in range(n)]

        half = [0.5 * b for b in self.backward] if isinstance(self.backward, (list, tuple)) else 0.5 * self.backward
        i = self.backward_input if self.backward_input is not None else half
        w = self.backward_weight if self.backward_weight is not None else half
        replay = plus(self.forward, self.all_to_all)  # the replayed forward runs its all-to-alls again
        return dataclasses.replace(self, backward=plus(self.backward, replay),
                                   backward_input=plus(i, replay, first=False),
                                   backward_weight=plus(w, replay))

    @classmethod
    def from_dict(cls, d: Mapping[str, Number]) -> "Costs":
        """``{"forward": 1, "backward": 2}`` or by action type: ``{"F": 1, "B": 2, "STEP": 0.1}``."""
        names = {f.name for f in fields(cls)}
        out = {}
        for k, v in d.items():
            name = cls._KEYS.get(k, k)
            if name not in names:
                raise ValueError(f"unknown cost {k!r}; use {sorted(names)} or {sorted(cls._KEYS)}")
            out[name] = v
        return cls(**out)

    @classmethod
    def from_measured(cls, seconds, counts, *, comm: Number = 0.0, reduce: Number = 0.0) -> "Costs":
        """Mean seconds per F, B and STEP from a run (``PipelineEngine.action_seconds``/``action_counts``;
        one dict per stage gives per-stage costs). A measured STEP includes any wait for its reduction and
        a measured receive includes waiting for the peer, so ``comm`` and ``reduce`` are given, not measured."""
        per_stage = isinstance(seconds, (list, tuple))
        secs, cnts = (seconds, counts) if per_stage else ([seconds], [counts])
        mean = lambda kind: [sc.get(kind, 0.0) / max(1, c.get(kind, 0)) for sc, c in zip(secs, cnts)]
        kinds = [("F", "forward"), ("B", "backward"), ("STEP", "step")]
        kinds += [(k, n) for k, n in (("I", "backward_input"), ("W", "backward_weight")) if any(c.get(k) for c in cnts)]
        vals = {name: (mean(kind) if per_stage else mean(kind)[0]) for kind, name in kinds}
        return cls(**vals, comm=comm, reduce=reduce)


CostsLike = Union[Costs, Mapping[str, Number], Callable[[Action, int], float], None]


def _cost_fn(costs: CostsLike) -> Callable[[Action, int], float]:
    if costs is None:
        return Costs().of
    if isinstance(costs, Costs):
        return costs.of
    if isinstance(costs, Mapping):
        return Costs.from_dict(costs).of
    if callable(costs):
        return costs  # (action, stage) -> cost; for a receive: its latency, for REDUCE: the reduction's
    raise TypeError(f"costs must be Costs, a dict or a callable (action, stage) -> float, not {type(costs).__name__}")


def _vocab_latency(costs: CostsLike) -> float:
    """The VOCAB pass's collective latency (``Costs.vocab_latency``); 0 where the costs are a dict without it or a
    callable (whose VOCAB cost is then the whole pass)."""
    if isinstance(costs, Mapping):
        costs = Costs.from_dict(costs)
    return costs.vocab_latency() if isinstance(costs, Costs) else 0.0


class Interval(NamedTuple):
    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class BubbleSplit:
    """A schedule's idle share of stage-time by cause; ``fill_drain + imbalance == total``."""

    total: float
    """Idle share of stage-time: 1 - busy / (stages x span)."""
    fill_drain: float
    """Idle the busiest stage has too, 1 - max busy / span: warm-up, cool-down and waits on dependencies (and on
    transfers and reductions), which no rebalancing of the stages removes."""
    imbalance: float
    """Idle that exists only because stages have unequal work: sum over stages of (max busy - busy) / (stages x span);
    zero when every stage works as long as the busiest."""


def split_bubble(busy: Sequence[float], span: float) -> BubbleSplit:
    """The bubble of stages busy ``busy[s]`` (seconds, any unit) within ``span``, split into fill/drain and
    imbalance. The one place the planner and the simulator compute a bubble, so the parts always sum to it."""
    if span <= 0 or not busy:
        return BubbleSplit(0.0, 0.0, 0.0)
    most = max(busy)
    imbalance = sum(most - b for b in busy) / (len(busy) * span)
    fill_drain = max(0.0, 1 - most / span)  # float noise of a steady-state difference is no negative idle
    return BubbleSplit(fill_drain + imbalance, fill_drain, imbalance)


@dataclass
class SimResult:
    timeline: list[list[Interval]]
    """Per stage, every action in list order; receives are points at the time their data is there."""
    makespan: float
    num_steps: int
    num_microbatches: int
    bubble: float
    """Idle share of stage-time over the whole run: 1 - busy / (stages x makespan) (``fill_drain + imbalance``)."""
    steady_bubble: float
    """Idle share between every stage finishing the first step's F/B and the last step's first forward (nan if empty)."""
    throughput: float
    """Microbatches per unit time."""
    peak_inflight: list[int] = field(default_factory=list)
    """Per stage: most microbatches forwarded and not yet backwarded (activations held); with several stages per rank,
    per rank, counting (stage, microbatch) pairs."""
    peak_versions: list[int] = field(default_factory=list)
    """Per stage: most weight versions alive at once (the newest + older ones a later F/B of this list uses)."""
    busy: list[float] = field(default_factory=list)
    """Per stage: time spent computing (F, B, I, W, STEP)."""
    fill_drain: float = 0.0
    """The bubble's part that equal stages would still idle (``BubbleSplit.fill_drain``)."""
    imbalance: float = 0.0
    """The bubble's part due to unequal stage work (``BubbleSplit.imbalance``)."""


def _grid(actions: list[list[Action]], ptr: list[int], notes: dict[int, str], width: int = 4, label: str = "stage") -> str:
    """Each stage's (or rank's) last actions, the one it stands at in brackets, and why it cannot go on."""
    lines = []
    for s, acts in enumerate(actions):
        words = (["..."] if ptr[s] > width else []) + [str(a) for a in acts[max(0, ptr[s] - width):ptr[s]]]
        words.append(f"[{acts[ptr[s]]}]" if ptr[s] < len(acts) else "(done)")
        if s in notes:
            words.append(f" <-- ERROR HERE: {notes[s]}")
        lines.append(f"{label} {s} @{ptr[s]:>4}: " + " ".join(words))
    return "\n".join(lines)


def simulate(actions: list[list[Action]], costs: CostsLike = None, schedule: Optional[str] = None,
             num_microbatches: Optional[int] = None, *, blocking_sends: bool = False,
             reduce_scope: str = "global", nccl: bool = False,
             channel: Optional[Callable[[int, int], Hashable]] = None, prefetch: bool = True,
             reduce_on_compute_stream: bool = False) -> SimResult:
    """Run one window's action lists (``actions[s]`` for stage s, or for rank s where it holds several stages); raise
    ``ScheduleError`` on any defect.

    Args:
        actions: per stage, its actions in order (``schedules.schedule_actions``); with several stages per rank, per
            rank, every F, B, I, W and transfer naming its stage (``Action.stage``).
        costs: ``Costs``, a dict (``{"forward": 1, "B": 2, ...}``) or a callable ``(action, stage) -> cost``.
        schedule: a schedule name or record; if given, every forward's version is checked against its ``version``.
        num_microbatches: if given, every step must have exactly these microbatches.
        blocking_sends: a send waits until its receiver reaches the matching receive (with ``nccl``: until the
            send completed, which a receive posted ahead by ``prefetch`` allows before the receiver's RECV action).
        reduce_scope: ``"global"`` (the executor's: STEP{k} waits until every stage posted REDUCE{k}, for the
            global grad norm) or ``"stage"`` (a stage's reduction only needs its own post, e.g. per-stage clipping).
        nccl: also obey NCCL's ordering rule, which gloo forgives: per (rank, communicator, peer) the posted
            sends and receives complete one at a time in post order, in both directions, and a send completes only
            with the receive at the head of the peer's FIFO. A receive posted early (``prefetch``) therefore holds
            back every send the stage posts after it on that communicator; lists and channels that make two
            neighbours' heads wait on each other deadlock (module docstring). Timing: a pair completes at
            max(its two posts, the previous completion on either FIFO) + ``comm``; the receiver's clock becomes
            max(its clock, completion). Sends never block the program (with ``blocking_sends`` they wait for
            their completion in place).
        channel: ``(src, dst) -> communicator`` of a transfer between two ranks (``nccl`` only); ``channels.channel``
            by default, one per direction between adjacent ranks (and the ring's wrap-around pair, where the lists'
            stages loop over the ranks); ``lambda s, d: "world"`` is the old single communicator.
        prefetch: (``nccl`` only) post a stage's next receive from the same peer on the same communicator as soon as
            its previous one completed, as the executor's ``_receive`` does (with one stage per rank: the next
            receive of the same kind); False: every receive is posted at its RECV action.
        reduce_on_compute_stream: a stage computes nothing after its REDUCE{k} until step k's reduction has
            finished: what a collective waited for on the compute stream does (a reduction issued with NCCL from
            a thread that never selected a stream), against the default, a reduction off the compute stream that
            only STEP{k} waits for.
    """
    if reduce_scope not in ("global", "stage"):
        raise ValueError(f"reduce_scope must be 'global' or 'stage', got {reduce_scope!r}")
    ranks = _stage_ranks(actions)
    if channel is None:
        channel = channels.channel if ranks is None else functools.partial(channels.channel, num_ranks=len(actions))
    sim = _Run(actions, _cost_fn(costs), schedule, blocking_sends, reduce_scope == "global",
               NcclFifos(channel, prefetch) if nccl else None, reduce_on_compute_stream, ranks,
               _vocab_latency(costs))
    sim.run()
    sim.check_complete(num_microbatches)
    return _metrics(actions, sim.timeline, sim.fwd, sim.peak_inflight, sim.k0, sim.steps)


def _stage_ranks(actions: list[list[Action]]) -> Optional[list[int]]:
    """The rank holding each model stage where the actions name their stages (several stages per rank), else None
    (each list is one stage)."""
    holder: dict[int, int] = {}
    for r, acts in enumerate(actions):
        for a in acts:
            if a.stage is not None and holder.setdefault(a.stage, r) != r:
                raise ScheduleError(f"stage {a.stage} has actions on ranks {holder[a.stage]} and {r}: a stage lives on "
                                    f"one rank")
    if not holder:
        return None
    if any(a.stage is None and (a.type in _COMPUTED or a.type in _TRANSFERS) for acts in actions for a in acts):
        raise ScheduleError("some actions name their stage and some do not: where a rank holds several stages every "
                            "F, B, I, W and transfer names its own")
    if sorted(holder) != list(range(len(holder))):
        raise ScheduleError(f"the lists hold stages {sorted(holder)}, expected 0..{len(holder) - 1}")
    return [holder[g] for g in range(len(holder))]


class _Message:
    __slots__ = ("action", "key", "sent", "done")

    def __init__(self, a: Action, rank: int, sent: float):
        self.action, self.sent, self.done = a, sent, None
        self.key = (a.type, a.step, a.microbatch, a.sending_stage(rank))


class _Run(NcclRule):
    """The simulation state; ``run`` advances every rank as far as it can until all are done or stuck. A rank runs one
    list; it holds one stage (the stages are the ranks) or several (``stage_rank``: the rank of each stage)."""

    def __init__(self, actions, cost, schedule, blocking_sends, global_reduce, nccl: Optional[NcclFifos] = None,
                 reduce_blocks: bool = False, stage_rank: Optional[list[int]] = None, vocab_latency: float = 0.0):
        p = self.p = len(actions)
        self.stage_rank = stage_rank if stage_rank is not None else list(range(p))
        self.label = "stage" if stage_rank is None else "rank"
        n_stages = self.num_stages = len(self.stage_rank)
        self.reduce_blocks, self.reduce_waiting = reduce_blocks, {}
        self.nccl = nccl
        if nccl is not None:
            nccl.index(actions)
        self.actions, self.cost = actions, cost
        self.schedule = get_schedule(schedule) if schedule is not None else None
        self.blocking_sends, self.global_reduce = blocking_sends, global_reduce
        self.steps = sorted({a.step for acts in actions for a in acts})
        self.k0 = self.steps[0] if self.steps else 0  # the window's first step: every stage holds version k0
        self.ptr, self.clock, self.latest = [0] * p, [0.0] * p, [self.k0] * p
        self.timeline: list[list[Interval]] = [[] for _ in range(p)]
        self.chan: dict[tuple[int, int], deque[_Message]] = defaultdict(deque)  # (src, dst) rank -> in send order
        self.sending: dict[int, _Message] = {}  # blocking sends: the message a stage waits on
        self.reduce_at: dict[int, dict[int, float]] = defaultdict(dict)  # step -> rank -> time posted
        self.reduce_seq: list[list[int]] = [[] for _ in range(p)]
        self.reduce_idx: list[dict[int, int]] = [{} for _ in range(p)]  # step -> list index of REDUCE
        # per model stage
        self.fwd: list[dict[tuple[int, int], int]] = [{} for _ in range(n_stages)]  # (k, i) -> version
        self.bwd: list[set] = [set() for _ in range(n_stages)]
        self.inp: list[set] = [set() for _ in range(n_stages)]  # (k, i) whose I ran (a split backward's first half)
        self.act_in: set[tuple[int, int, int]] = set()  # (stage, k, i): its input is here (received, or computed on its rank)
        self.grad_in: set[tuple[int, int, int]] = set()  # (stage, k, i): the gradient of its output is here
        # per rank
        self.step_version: list[dict[int, int]] = [{} for _ in range(p)]
        self.last_b: list[dict[int, int]] = [{} for _ in range(p)]  # step -> list index of its last B
        self.inflight, self.peak_inflight = [0] * p, [0] * p
        # the VOCAB passes (a collective of every rank): per rank the (k, i) posted in order and where; per (k, i) the
        # time each rank reached it, and its end once all have
        self.vocab_on = any(a.type == T.VOCAB for acts in actions for a in acts)
        self.vocab_latency = vocab_latency
        self.vocab_seq: list[list[tuple[int, int]]] = [[] for _ in range(p)]
        self.vocab_idx: list[dict[tuple[int, int], int]] = [{} for _ in range(p)]
        self.vocab_at: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
        self.vocab_end: dict[tuple[int, int], float] = {}
        self.span: list[float] = [0.0] * p  # the duration of the rank's last VOCAB (it waits for the slowest rank)
        recv, send = (self.nccl_recv, self.nccl_send) if nccl is not None else (self.recv, self.send)
        self.handlers = {T.F: self.forward, T.B: self.backward, T.I: self.backward_input, T.W: self.backward_weight,
                         T.REDUCE: self.reduce, T.STEP: self.step, T.RECV_ACT: recv, T.RECV_GRAD: recv,
                         T.SEND_ACT: send, T.SEND_GRAD: send, T.VOCAB: self.vocab}

    def where(self, a: Action, s: int) -> int:
        """The model stage of rank s's action ``a`` (its own where the rank holds one)."""
        return s if a.stage is None else a.stage

    def fail(self, s: int, msg: str, note: str):
        raise ScheduleError(f"{self.label} {s}: {msg}\n" + _grid(self.actions, self.ptr, {s: note}, label=self.label))

    def run(self) -> None:
        progress = True
        while progress:
            progress = False
            for s, acts in enumerate(self.actions):
                while self.ptr[s] < len(acts) and self.execute(s, acts[self.ptr[s]]):
                    self.ptr[s] += 1
                    progress = True
        stuck = {s: self.why_blocked(s, acts[self.ptr[s]]) for s, acts in enumerate(self.actions) if self.ptr[s] < len(acts)}
        if stuck:
            raise ScheduleError("deadlock: no stage can go on\n" + _grid(self.actions, self.ptr, stuck, label=self.label))

    def execute(self, s: int, a: Action) -> bool:
        """Run ``a`` on rank s if it can start now (False: blocked); record it on the timeline."""
        t = a.type
        if t in _TRANSFERS:
            if not 0 <= a.peer < self.p or a.peer == s:
                self.fail(s, f"{a} names no other {self.label}", "bad peer")
            if a.stage is not None:
                self.check_neighbour(s, a)
        if not self.handlers[t](s, a):
            return False
        dur = self.span[s] if t == T.VOCAB else self.cost(a, s if a.stage is None else a.stage) if t in _TIMED else 0.0
        self.timeline[s].append(Interval(self.clock[s] - dur, self.clock[s], a))
        return True

    def check_neighbour(self, s: int, a: Action) -> None:
        """A transfer naming its stage goes to or comes from the rank holding the neighbouring stage."""
        g = a.stage
        other = g + 1 if a.type in (T.SEND_ACT, T.RECV_GRAD) else g - 1
        if not 0 <= other < self.num_stages:
            self.fail(s, f"{a}: stage {g} has no stage {other} to exchange with", "no neighbour")
        if self.stage_rank[other] != a.peer:
            self.fail(s, f"{a} names rank {a.peer}, but stage {other} is on rank {self.stage_rank[other]}", "wrong peer")

    def arrived(self, s: int, a: Action) -> None:
        """A receive completed: its stage's input (or output gradient) for (k, i) is here."""
        (self.act_in if a.type == T.RECV_ACT else self.grad_in).add((self.where(a, s), a.step, a.microbatch))

    def recv(self, s: int, a: Action) -> bool:
        q = self.chan[(a.peer, s)]
        if not q:
            return False
        msg = q[0]
        if (SEND_OF[a.type], a.step, a.microbatch, a.sending_stage(s)) != msg.key:
            self.fail(s, f"{a}, but the next message from {self.label} {a.peer} is {message_text(msg.action)} "
                         f"(receives out of send order)", "out of send order")
        q.popleft()
        self.clock[s] = msg.done = max(self.clock[s], msg.sent) + self.cost(a, self.where(a, s))
        self.arrived(s, a)
        return True

    def send(self, s: int, a: Action) -> bool:
        if s not in self.sending:
            self.sending[s] = _Message(a, s, self.clock[s])
            self.chan[(s, a.peer)].append(self.sending[s])
        if self.blocking_sends:
            if self.sending[s].done is None:
                return False
            self.clock[s] = max(self.clock[s], self.sending[s].done)
        del self.sending[s]
        return True

    def reduce(self, s: int, a: Action) -> bool:
        if self.reduce_waiting.get(s) != a.step:  # not already posted and waiting (reduce_on_compute_stream)
            n = len(self.reduce_seq[s])
            for o, seq in enumerate(self.reduce_seq):
                if len(seq) > n and seq[n] != a.step:
                    self.fail(s, f"reduction #{n} is step {a.step} here but step {seq[n]} on {self.label} {o} "
                                 f"(collectives out of order)", "collective out of order")
            if a.step in self.reduce_idx[s]:
                self.fail(s, f"{a} twice", "duplicate")
            self.reduce_seq[s].append(a.step)
            self.reduce_idx[s][a.step] = self.ptr[s]
            self.reduce_at[a.step][s] = self.clock[s]
        if not self.reduce_blocks:
            return True
        # on the compute stream: the stage computes nothing more until the reduction has finished
        self.reduce_waiting[s] = a.step
        ready = self._reduction_done(s, a.step)
        if ready is None:
            return False
        del self.reduce_waiting[s]
        self.clock[s] = max(self.clock[s], ready)
        return True

    def _reduction_done(self, s: int, k: int) -> Optional[float]:
        """When step k's reduction finishes as seen from rank s (None: not every rank it needs has posted it)."""
        posted = self.reduce_at[k] if self.global_reduce else {s: self.reduce_at[k][s]}
        if len(posted) < (self.p if self.global_reduce else 1):
            return None
        return max(posted.values()) + max(self.cost(Action(T.REDUCE, k), o) for o in posted)

    def step(self, s: int, a: Action) -> bool:
        if a.step != self.latest[s]:
            self.fail(s, f"{a} but the {self.label} holds version {self.latest[s]}: STEP{self.latest[s]} must come next",
                      "STEP out of order")
        if a.step not in self.reduce_idx[s]:
            self.fail(s, f"{a} before REDUCE{a.step}", "no reduction posted")
        ready = self._reduction_done(s, a.step)
        if ready is None:
            return False
        self.clock[s] = max(self.clock[s], ready) + self.cost(a, s)
        self.latest[s] += 1
        return True

    def vocab(self, s: int, a: Action) -> bool:
        """VOCAB: posted once (checked then), blocked until every rank has posted it; then all end together."""
        key, last = (a.step, a.microbatch), self.num_stages - 1
        if key not in self.vocab_at or s not in self.vocab_at[key]:
            n = len(self.vocab_seq[s])
            for o, seq in enumerate(self.vocab_seq):
                if len(seq) > n and seq[n] != key:
                    self.fail(s, f"VOCAB #{n} is {key} here but {seq[n]} on {self.label} {o} (collectives out of "
                                 f"order)", "collective out of order")
            if key in self.vocab_idx[s]:
                self.fail(s, f"{a} twice", "duplicate VOCAB")
            if a.version > self.latest[s]:
                self.fail(s, f"{a} uses version {a.version}, only {self.latest[s]} exists yet", "future version")
            if self.step_version[s].setdefault(a.step, a.version) != a.version:
                self.fail(s, f"{a}: step {a.step} uses version {self.step_version[s][a.step]} here (the shard's "
                             f"gradient accumulates in the step's version)", "mixed versions")
            if a.step in self.reduce_idx[s]:
                self.fail(s, f"{a} after REDUCE{a.step} (its shard's gradient would miss the reduction)",
                          "VOCAB after its step's reduction")
            if self.stage_rank[last] == s and key not in self.fwd[last]:
                self.fail(s, f"{a} before the last stage's forward of {key} (no hidden states to broadcast)",
                          "dependency not met")
            self.vocab_seq[s].append(key)
            self.vocab_idx[s][key] = self.ptr[s]
            self.vocab_at[key][s] = self.clock[s]
        arrived = self.vocab_at[key]
        if len(arrived) < self.p:
            return False
        if key not in self.vocab_end:
            start = max(arrived.values())
            self.vocab_end[key] = start + max(self.cost(a, o) for o in range(self.p)) + self.vocab_latency
        self.span[s] = self.vocab_end[key] - max(self.clock[s], max(arrived.values()))
        self.clock[s] = self.vocab_end[key]
        return True

    def forward(self, s: int, a: Action) -> bool:
        g, key, p = self.where(a, s), (a.step, a.microbatch), self.p
        if key in self.fwd[g]:
            self.fail(s, f"forward of {key} twice", "duplicate forward")
        if a.version > self.latest[s]:
            self.fail(s, f"{a} uses version {a.version}, only {self.latest[s]} exists yet", "future version")
        if self.step_version[s].setdefault(a.step, a.version) != a.version:
            self.fail(s, f"{a}: step {a.step} already uses version {self.step_version[s][a.step]} here "
                         f"(gradients of one step accumulate in one version)", "mixed versions")
        if self.schedule is not None and a.version != self.schedule.version(a.step, s, p):
            self.fail(s, f"{a}: {self.schedule.name} prescribes version {self.schedule.version(a.step, s, p)}", "wrong version")
        if g > 0:
            need = (g, a.step, a.microbatch)
            if need not in self.act_in:
                self.missing(s, a, g - 1, "forwarded", "RECV_ACT")
            self.act_in.discard(need)
        self.fwd[g][key] = a.version
        self.inflight[s] += 1
        self.peak_inflight[s] = max(self.peak_inflight[s], self.inflight[s])
        self.clock[s] += self.cost(a, g)
        if g + 1 < self.num_stages and self.stage_rank[g + 1] == s:  # the next stage is here: no transfer
            self.act_in.add((g + 1, a.step, a.microbatch))
        return True

    def missing(self, s: int, a: Action, source: int, done: str, transfer: str) -> None:
        """``a`` needs what the neighbouring stage ``source`` computes (its output, or its input gradient), and it is
        neither received nor computed on this rank before it."""
        if self.stage_rank[source] == s:
            why = f"stage {source}, on this rank, has not {done} it yet"
        else:
            why = f"no {transfer}{a.step}.{a.microbatch} from {self.label} {self.stage_rank[source]} before it"
        self.fail(s, f"{a} before its {'input' if transfer == 'RECV_ACT' else 'output gradient'}: {why}",
                  "dependency not met")

    def _check_backward(self, s: int, a: Action) -> tuple[int, int]:
        g, key = self.where(a, s), (a.step, a.microbatch)
        if key not in self.fwd[g]:
            self.fail(s, f"backward of {key} before its forward", "no forward")
        if key in self.bwd[g]:
            self.fail(s, f"backward of {key} twice", "duplicate backward")
        if self.fwd[g][key] != a.version:
            self.fail(s, f"{a} but its forward used version {self.fwd[g][key]}", "version mismatch")
        if a.step in self.reduce_idx[s]:
            self.fail(s, f"{a} after REDUCE{a.step}", "backward after its step's reduction")
        return key

    def _input_gradient(self, s: int, a: Action) -> None:
        """B or I: needs the gradient of the stage's output; hands the input gradient to the previous stage if here."""
        g = self.where(a, s)
        if self.vocab_on and g == self.num_stages - 1 and (a.step, a.microbatch) not in self.vocab_end:
            self.fail(s, f"{a} before VOCAB{a.step}.{a.microbatch} (the loss's gradient of the hidden states)",
                      "dependency not met")
        if g + 1 < self.num_stages:
            need = (g, a.step, a.microbatch)
            if need not in self.grad_in:
                self.missing(s, a, g + 1, "computed its input gradient for", "RECV_GRAD")
            self.grad_in.discard(need)
        if g > 0 and self.stage_rank[g - 1] == s:
            self.grad_in.add((g - 1, a.step, a.microbatch))

    def backward_input(self, s: int, a: Action) -> bool:
        """I: the input gradient only; the microbatch stays in flight (its graph is kept) until its W."""
        key, g = self._check_backward(s, a), self.where(a, s)
        if key in self.inp[g]:
            self.fail(s, f"I of {key} twice", "duplicate I")
        self._input_gradient(s, a)
        self.inp[g].add(key)
        self.clock[s] += self.cost(a, g)
        return True

    def backward_weight(self, s: int, a: Action) -> bool:
        """W: completes the backward its I began."""
        key, g = self._check_backward(s, a), self.where(a, s)
        if key not in self.inp[g]:
            self.fail(s, f"W of {key} before its I", "no I")
        self.inp[g].discard(key)
        return self._completed(s, a, key)

    def backward(self, s: int, a: Action) -> bool:
        key, g = self._check_backward(s, a), self.where(a, s)
        if key in self.inp[g]:
            self.fail(s, f"B of {key} after its I (a split backward ends with W)", "B after I")
        self._input_gradient(s, a)
        return self._completed(s, a, key)

    def _completed(self, s: int, a: Action, key: tuple[int, int]) -> bool:
        g = self.where(a, s)
        self.bwd[g].add(key)
        self.last_b[s][a.step] = self.ptr[s]
        self.inflight[s] -= 1
        self.clock[s] += self.cost(a, g)
        return True

    def why_blocked(self, s: int, a: Action) -> str:
        if self.nccl is not None and (a.type.is_recv or a.type.is_send):
            return self.why_blocked_nccl(s, a)
        if a.type.is_recv:
            return f"waits for {awaited_text(a, s)} from {self.label} {a.peer}"
        if a.type.is_send:
            return f"blocking send waits for {self.label} {a.peer} to receive it"
        if a.type == T.VOCAB:
            missing = sorted(set(range(self.p)) - set(self.vocab_at.get((a.step, a.microbatch), ())))
            return f"waits for VOCAB{a.step}.{a.microbatch} of {self.label}(s) {missing}"
        missing = sorted(set(range(self.p)) - set(self.reduce_at[a.step]))
        return f"waits for REDUCE{a.step} of {self.label}(s) {missing}"

    def check_complete(self, m: Optional[int]) -> None:
        """After a run without deadlock: every message received, every microbatch done, one update per step."""
        for (src, dst), q in self.chan.items():
            if q:
                raise ScheduleError(f"{self.label} {src} sent {len(q)} message(s) {self.label} {dst} never received, "
                                    f"first {message_text(q[0].action)}")
        for (src, comm, dst), q in (self.nccl.fifo.items() if self.nccl is not None else ()):
            if q:  # only sends can be left: a posted receive blocks its stage at its RECV
                raise ScheduleError(f"{self.label} {src} sent {len(q)} message(s) {self.label} {dst} never received, "
                                    f"first {q[0].action} (on {comm!r})")
        ref = set(self.fwd[0]) if self.p else set()
        sizes: dict[int, list[int]] = defaultdict(list)
        for k, i in sorted(ref):
            sizes[k].append(i)
        counts = {len(v) for v in sizes.values()}
        for k, v in sizes.items():
            if v != list(range(len(v))) or len(counts) > 1 or (m is not None and len(v) != m):
                raise ScheduleError(f"step {k} has microbatches {v} on stage 0, expected 0..{(m or max(counts)) - 1}")
        for g in range(self.num_stages):
            if self.inp[g]:
                raise ScheduleError(f"stage {g}: I without its W for {sorted(self.inp[g])[:4]} (its weight gradient "
                                    "is never computed)")
            for what, got in (("forwards", set(self.fwd[g])), ("backwards", self.bwd[g])):
                if got != ref:
                    raise ScheduleError(f"stage {g} {what} {len(got)} microbatches, stage 0 forwards {len(ref)}: "
                                        f"extra {sorted(got - ref)[:4]}, missing {sorted(ref - got)[:4]}")
        for s in range(self.p):
            if self.vocab_on and set(self.vocab_idx[s]) != ref:
                got = set(self.vocab_idx[s])
                raise ScheduleError(f"{self.label} {s} runs VOCAB for {len(got)} microbatches, stage 0 forwards "
                                    f"{len(ref)}: extra {sorted(got - ref)[:4]}, missing {sorted(ref - got)[:4]}")
            for k in sizes:
                if k not in self.reduce_idx[s]:
                    raise ScheduleError(f"{self.label} {s}: step {k} has no REDUCE")
                if self.reduce_idx[s][k] < self.last_b[s][k]:
                    raise ScheduleError(f"{self.label} {s}: REDUCE{k} comes before the step's last backward")
            if self.latest[s] != self.k0 + len(sizes):
                raise ScheduleError(f"{self.label} {s} ends with version {self.latest[s]}, expected "
                                    f"{self.k0 + len(sizes)} (one STEP per step, {len(sizes)} steps from step {self.k0})")


def _peak_versions(acts: list[Action], k0: int) -> int:
    """Most versions alive at once: the newest, plus older ones an F/B later in the list still uses."""
    last_use: dict[int, int] = {}
    for idx, a in enumerate(acts):
        if a.type in _COMPUTED or a.type == T.VOCAB:
            last_use[a.version] = idx
    latest = k0
    live = lambda idx: len({latest} | {v for v, u in last_use.items() if v < latest and u >= idx})
    peak = live(0)
    for idx, a in enumerate(acts):
        if a.type == T.STEP:
            latest += 1
            peak = max(peak, live(idx + 1))
    return peak


def _metrics(actions, timeline, fwd, peak_inflight, k0, steps) -> SimResult:
    p = len(actions)
    makespan = max((iv.end for tl in timeline for iv in tl), default=0.0)
    busy = [sum(iv.end - iv.start for iv in tl) for tl in timeline]
    split = split_bubble(busy, makespan)
    n_mb = len(fwd[0]) if p else 0
    m = n_mb // len(steps) if steps else 0
    return SimResult(
        timeline=timeline, makespan=makespan, num_steps=len(steps), num_microbatches=m,
        bubble=split.total, steady_bubble=_steady_bubble(timeline, steps),
        throughput=n_mb / makespan if makespan else 0.0,
        peak_inflight=peak_inflight, peak_versions=[_peak_versions(acts, k0) for acts in actions],
        busy=busy, fill_drain=split.fill_drain, imbalance=split.imbalance)


def _steady_bubble(timeline: list[list[Interval]], steps: list[int]) -> float:
    """Idle share in [every stage has finished the first step's F/B, the last step's first forward anywhere]."""
    if len(steps) < 3:
        return math.nan
    first, last = steps[0], steps[-1]
    comp = [[iv for iv in tl if iv.action.type in _COMPUTED] for tl in timeline]
    t0 = max(max(iv.end for iv in tl if iv.action.step == first) for tl in comp)
    t1 = min(min(iv.start for iv in tl if iv.action.step == last) for tl in comp)
    if t1 <= t0:
        return math.nan
    busy = sum(max(0.0, min(iv.end, t1) - max(iv.start, t0)) for tl in timeline for iv in tl)
    return 1 - busy / ((t1 - t0) * len(timeline))
