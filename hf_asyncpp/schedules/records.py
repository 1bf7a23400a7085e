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

Virtual stages (``VIRTUAL_SCHEDULES``: ``INTERLEAVED_1F1B``, ``ZBV``, ``DUALPIPEV``): a rank holds
``stages_per_rank`` model stages, placed by ``stage_ranks`` (looping: rank r holds r, r+p, ...; V: r and 2p-1-r).
Their ``actions(num_stages, ...)`` take the number of ranks and return one list per rank, whose F, B, I, W and
transfers name their model stage (``Action.stage``, written ``/s{g}``); a transfer goes only between stages on
different ranks (``peer`` is a rank), and stages on one rank hand their tensors over in memory. The simulator and the
planner run them; the executor runs one stage per rank, so a recipe cannot select them yet (``runs_in_executor``).

Actions and their text form: ``actions``.

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

from collections import deque
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from .actions import BACKWARDS, Action, ActionType
from .torch_orders import Item, torch_chunks, torch_slots

__all__ = [
    "Schedule", "SCHEDULES", "GPIPE", "ONE_F_ONE_B", "ZB_H1", "TWO_BW", "PIPEDREAM", "get_schedule",
    "VIRTUAL_SCHEDULES", "INTERLEAVED_1F1B", "ZBV", "DUALPIPEV", "interleaved_1f1b", "stage_ranks",
    "schedule_actions", "version_lag", "NO_PIPELINE", "pipelined",
    "processes_per_pipeline", "one_step_delay", "SimulatedDelay", "SIMULATED_DELAYS", "get_simulated_delay",
]


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


def _order_zb_h1(stage: int, p: int, n: int, extra: int = 0) -> Order:
    """ZB-H1 at ``stage`` over ``n`` microbatches (Qi et al., "Zero Bubble Pipeline Parallelism", 2024; torch's
    ``ScheduleInterleavedZeroBubble`` with one stage per rank): 1F1B with each B split into I and W. Stage s
    runs p-1-s warm-up forwards and F/I pairs as 1F1B does; its first s I's are not followed by their W, so the
    W's trail the I's by s microbatches and fill the cool-down, where 1F1B's stages wait for the backwards to come
    back. Activations live from F to W, so a stage holds at most p-s microbatches plus the s whose W trails:
    1F1B's p at stage 0, about 1F1B's at the others (the papers' "H1": 1F1B's peak memory)."""
    T = ActionType
    w = min(p - 1 - stage + extra, n)  # extra: the vocabulary passes' deeper warm-up (``vocab_warmup``)
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


def vocab_warmup(stage: int, p: int, n: int, extra: int = 0) -> int:
    """Forwards stage ``stage`` runs ahead of plain 1F1B (ZB-H1) where the vocabulary layers are shared by every stage:
    p-1-stage, so its warm-up is 2 (p-1-stage) (+ ``extra``); where that exceeds ``n`` microbatches at stage 0 (2BW's
    STEP k-2 must come before the first forward of step k, and its reduction overlap a pair: fewer than m forwards
    ahead), at most n - p - ``extra``
    at every stage, so each stage still runs at least one forward more than the next (fewer, and stage s-1 would
    wait at a VOCAB for a backward of stage s that waits at the next VOCAB: a deadlock).

    A VOCAB is a barrier of every stage: between VOCAB j and VOCAB j+1 each stage runs one forward and one backward,
    and a forward (backward) that needs its neighbour's output of the same interval waits for it, so a chain of them
    through the stages runs one after the other. Stage s's forward in the interval is of microbatch j + p-1-s (its
    predecessor's of j + p-s ran an interval earlier: no chain), and its backward must be of microbatch j - (p-1-s)
    for the same reason (the gradient left stage s+1 an interval earlier), so F and B are 2 (p-1-s) microbatches apart:
    plain 1F1B's warm-up of p-1-s would chain every backward of the interval through all the stages (simulated: 1F1B
    on 8 stages 3x slower). The price is activation memory: stage s holds 2 (p-1-s) + 1 microbatches in flight
    instead of p-s (the planner counts it; the Vocabulary Parallelism paper's schedules pay a similar
    amount)."""
    return max(0, min(p - 1 - stage, n - p - extra))


def _vocab_passes(order: Order, stage: int, p: int, n: int) -> Order:
    """``order`` (one stage per rank, ``n`` microbatches, with the ``vocab_warmup`` forwards ahead) with a VOCAB pass
    per microbatch, for the vocabulary layers shared by every stage: VOCAB j right after the stage's forward of
    microbatch j + p-1-stage (after its last forward where there is none). Every stage then runs the VOCABs in
    microbatch order, as the collective they are needs; the last stage runs VOCAB j between F j and its B (or I) j,
    which waits for the loss's gradient; and stage s reaches VOCAB j when, in a steady pipeline, the last stage reaches
    it too: its forward of j + p-1-s runs in the same interval as the last stage's forward of j. Every order here runs
    F j + p-1-s before B (or I) j at stage s (the warm-up is at least p-1-s forwards, GPipe's every forward), so no
    stage waits at a VOCAB for a backward that needs it."""
    ahead, placed = p - 1 - stage, 0
    for t, j in order:
        yield t, j
        if t == ActionType.F:
            upto = n if j == n - 1 else j - ahead + 1  # VOCAB placed..upto-1 follow this forward
            while placed < upto:
                yield ActionType.VOCAB, placed
                placed += 1


def _per_step(local: Callable[[int, int, int], Order], s: int, p: int, m: int, n: int) -> Order:
    """A flushed schedule: ``local`` applied to each step's m microbatches in turn."""
    for k in range(n):
        for t, j in local(s, p, m):
            yield t, k * m + j


# ---------------------------------------------------------------------------- virtual stages: several per rank
# A rank holding several model stages runs an order of chunks: each a tuple of (F, B, I or W, microbatch, stage) run
# as one unit. A chunk is one computation, except DualPipeV's overlapped pair (torch's OVERLAP_F_B): a forward of one
# stage and a backward of the other, both inputs received before it and both outputs sent after it, computed one
# after the other as torch's runtime does without a custom overlap function. The orders are torch's own
# (``torch_orders``); this module lowers them.

Chunks = Iterator[tuple[Item, ...]]


def stage_ranks(placement: str, num_ranks: int, stages_per_rank: int) -> list[int]:
    """The rank holding each model stage. ``loop``: rank r holds r, r + p, r + 2p, ... (Megatron's interleaving, torch's
    default); ``v``: rank r holds r and 2p-1-r, so the first and last stages share rank 0 and the model's activations
    turn back at rank p-1 without a transfer (ZBV, DualPipeV)."""
    p, v = num_ranks, stages_per_rank
    if placement == "loop":
        return [g % p for g in range(p * v)]
    if placement == "v" and v == 2:
        return list(range(p)) + list(range(p - 1, -1, -1))
    raise ValueError(f"placement {placement!r} with {v} stages per rank: 'loop' takes any number, 'v' exactly 2")


Message = tuple[ActionType, int, int]  # (SEND_ACT or SEND_GRAD, microbatch from the window's start, sending stage)


def _sends(chunks: Chunks, src: int, dst: int, ranks: list[int]) -> Iterator[Message]:
    """The messages rank ``src`` sends rank ``dst``, in its order (``_lower``'s: per chunk, in the order of its items)."""
    T, last = ActionType, len(ranks) - 1
    for chunk in chunks:
        for t, j, g in chunk:
            if t == T.F and g < last and ranks[g + 1] == dst != src:
                yield T.SEND_ACT, j, g
            elif t in (T.B, T.I) and g > 0 and ranks[g - 1] == dst != src:
                yield T.SEND_GRAD, j, g


def _lower(chunks: Chunks, rank: int, ranks: list[int], m: int, k0: int, version: Callable[[int], int], late_step: bool,
           label_stages: bool, senders: Optional[dict[int, Iterator[Message]]] = None) -> Iterator[Action]:
    """Turn a rank's compute order into actions: a chunk's receives, its computations, its sends (a transfer only
    between stages on different ranks: ``ranks[g]`` holds stage g); REDUCE after a step's last B (or W) on the rank, and
    STEP. ``chunks`` count microbatches from the window's start (j: step k0 + j // m, microbatch j % m);
    ``label_stages``: the actions name their stage (several per rank).

    ``senders``: per peer rank, the messages it sends this rank in its order (``_sends``). Messages between two ranks
    are received in send order (no tags; NCCL completes them in that order), so where this rank needs a message
    before one its peer sent earlier -- in V placement one pair of ranks carries the first stage's activations and
    the second stage's gradients -- the earlier one is received first, ahead of its place (it left no later, so
    this waits no longer), and not again at its place. With one stage per rank each pair carries one kind of message
    in microbatch order, the order it is needed in: None."""
    A, T = Action, ActionType
    last = len(ranks) - 1
    per_step = m * ranks.count(rank)  # backwards that complete a step on this rank
    b_done: dict[int, int] = {}
    pending: deque[int] = deque()  # late_step: reduced steps whose STEP is not placed yet
    early: set[Message] = set()  # received ahead of their place

    def receive(out: list[Action], kind: ActionType, j: int, g: int) -> None:
        """The receive of stage g's input (RECV_ACT) or output gradient (RECV_GRAD) of microbatch j, and any message
        its peer sent before it that is not received yet."""
        sender = g - 1 if kind == T.RECV_ACT else g + 1
        peer = ranks[sender]
        msg = (T.SEND_ACT if kind == T.RECV_ACT else T.SEND_GRAD, j, sender)
        if senders is not None:
            if msg in early:
                early.remove(msg)
                return
            for sent in senders[peer]:
                if sent == msg:
                    break
                early.add(sent)
                send_kind, j_sent, g_sent = sent
                at = g_sent + 1 if send_kind == T.SEND_ACT else g_sent - 1
                out.append(A(T.RECV_ACT if send_kind == T.SEND_ACT else T.RECV_GRAD, k0 + j_sent // m, j_sent % m,
                             peer=peer, stage=at if label_stages else None))
        out.append(A(kind, k0 + j // m, j % m, peer=peer, stage=g if label_stages else None))

    for chunk in chunks:
        receives, computes, sends, reduced = [], [], [], []
        for t, j, g in chunk:
            k, i = k0 + j // m, j % m
            tag = g if label_stages else None
            if t == T.F:
                while pending and pending[0] <= k - 2:  # 2bw: STEP(k-2) just before the first forward of step k
                    yield A(T.STEP, pending.popleft())
                if g > 0 and ranks[g - 1] != rank:
                    receive(receives, T.RECV_ACT, j, g)
                computes.append(A(T.F, k, i, version(k), stage=tag))
                if g < last and ranks[g + 1] != rank:
                    sends.append(A(T.SEND_ACT, k, i, peer=ranks[g + 1], stage=tag))
            elif t in (T.W, T.VOCAB):  # a VOCAB is the rank's (one shard per rank), whatever stages it holds
                computes.append(A(t, k, i, version(k), stage=tag if t == T.W else None))
            else:
                if g < last and ranks[g + 1] != rank:
                    receive(receives, T.RECV_GRAD, j, g)
                computes.append(A(t, k, i, version(k), stage=tag))
                if g > 0 and ranks[g - 1] != rank:
                    sends.append(A(T.SEND_GRAD, k, i, peer=ranks[g - 1], stage=tag))
            if t in BACKWARDS:
                b_done[k] = b_done.get(k, 0) + 1
                if b_done[k] == per_step:  # the rank's last backward of step k
                    del b_done[k]
                    reduced.append(k)
        yield from receives
        yield from computes
        yield from sends
        for k in reduced:
            yield A(T.REDUCE, k)
            if late_step:
                pending.append(k)
            else:
                yield A(T.STEP, k)
    for k in pending:
        yield A(T.STEP, k)


def _one_stage(order: Order, s: int) -> Chunks:
    """A one-stage-per-rank order as chunks of one computation each."""
    return (((t, j, s),) for t, j in order)


# ---------------------------------------------------------------------------- builders


def _check(name: str, p: int, m: int, n: int, k0: int, extra: int = 0) -> None:
    for what, val, lo in (("num_stages", p, 1), ("num_microbatches", m, 1), ("num_steps", n, 0), ("first_step", k0, 0),
                          ("extra_warmup", extra, 0)):
        if not isinstance(val, int) or val < lo:
            raise ValueError(f"{name}: {what} must be an integer >= {lo}, got {val!r}")


def _flushed(local: Callable[[int, int, int, int], Order]):
    """Builder of a synchronous schedule: ``local`` per step, REDUCE and STEP right after a step's last backward."""
    def build(sched: "Schedule", s: int, p: int, m: int, n: int, k0: int, extra: int, vocab: bool) -> Iterator[Action]:
        step = (lambda s_, p_, m_: _vocab_passes(local(s_, p_, m_, extra + vocab_warmup(s_, p_, m_, extra)), s_, p_,
                                                 m_)) if vocab else (lambda s_, p_, m_: local(s_, p_, m_, extra))
        order = _per_step(step, s, p, m, n)
        return _lower(_one_stage(order, s), s, list(range(p)), m, k0, lambda k: sched.version(k, s, p), False, False)
    return build


def _stream_1f1b(sched: "Schedule", s: int, p: int, m: int, n: int, k0: int, extra: int, vocab: bool) -> Iterator[Action]:
    """Builder of an asynchronous schedule: 1F1B over the continuous stream of n*m microbatches, no flush."""
    if vocab and sched.one_update_per_microbatch:
        raise ValueError(f"{sched.name}: the vocabulary layers shared by every stage need one version of the output "
                         "layer per step at every stage; an update per microbatch (weight stashing) has none: use 2bw")
    # 2BW's STEP k-2 comes before the first forward of step k: a warm-up of at most m forwards keeps it there
    order = _order_1f1b(s, p, n * m, extra + (vocab_warmup(s, p, m, extra) if vocab else 0))
    return _lower(_one_stage(_vocab_passes(order, s, p, n * m) if vocab else order, s), s, list(range(p)), m, k0,
                  lambda k: sched.version(k, s, p), sched.late_step, False)


def _flushed_virtual(sched: "Schedule", r: int, p: int, m: int, n: int, k0: int, extra: int, vocab: bool) -> Iterator[Action]:
    """Builder of a synchronous schedule with ``stages_per_rank`` stages per rank: one step's chunks of torch's order
    (``torch_orders.torch_chunks``) per step; REDUCE and STEP right after the rank's last backward of the step (of
    every stage it holds)."""
    ranks = stage_ranks(sched.placement, p, sched.stages_per_rank)
    order = torch_chunks(sched.name, p, sched.stages_per_rank, m)
    if vocab:
        order = _vocab_cut(order, ranks, torch_slots(sched.name, p, sched.stages_per_rank, m))

    def chunks(rank: int) -> Chunks:
        for k in range(n):
            for chunk in order[rank]:
                yield tuple((t, k * m + j, g) for t, j, g in chunk)
    peers = {ranks[g + d] for g in range(len(ranks)) if ranks[g] == r for d in (-1, 1) if 0 <= g + d < len(ranks)}
    senders = {q: _sends(chunks(q), q, r, ranks) for q in peers - {r}}
    return _lower(chunks(r), r, ranks, m, k0, lambda k: sched.version(k, r, p), False, True, senders)


_UNIT = {ActionType.F: 1.0, ActionType.B: 2.0, ActionType.I: 1.0, ActionType.W: 1.0}
"""Durations of ``_unit_times``: a backward twice a forward, each half of a split backward one forward."""


def _needs(t: ActionType, j: int, g: int, last: int) -> list[tuple[str, int, int]]:
    """What item (t, j, g) of a chunk order needs computed first: ("F", j, g) a forward, ("G", j, g) the input gradient
    (B or I), ("I", j, g) an I."""
    if t == ActionType.F:
        return [("F", j, g - 1)] if g > 0 else []
    if t == ActionType.W:
        return [("I", j, g)]
    return [("F", j, g)] + ([("G", j, g + 1)] if g < last else [])


def _produces(t: ActionType, j: int, g: int) -> list[tuple[str, int, int]]:
    """What item (t, j, g) computes, in ``_needs``' terms."""
    return {ActionType.F: [("F", j, g)], ActionType.B: [("G", j, g)], ActionType.I: [("G", j, g), ("I", j, g)],
            ActionType.W: []}[t]


def _slot_times(order, ranks: list[int], slots) -> Optional[list[list[tuple[float, float]]]]:
    """torch's time slots of ``order`` as (start, end) = (slot, slot + 1), if every chunk's inputs come from chunks of
    earlier slots (interleaved 1F1B's and ZBV's grids); None where one does not (DualPipeV's overlapped chunks)."""
    slot_of = {d: slot for chunks, at in zip(order, slots) for chunk, slot in zip(chunks, at)
               for item in chunk for d in _produces(*item)}
    last = len(ranks) - 1
    for chunks, at in zip(order, slots):
        for chunk, slot in zip(chunks, at):
            own = {d for item in chunk for d in _produces(*item)}
            if any(d not in own and slot_of[d] >= slot for item in chunk for d in _needs(*item, last)):
                return None
    return [[(float(slot), slot + 1.0) for slot in at] for at in slots]


def _unit_times(order, ranks: list[int]) -> list[list[tuple[float, float]]]:
    """Per rank, (start, end) of each chunk of one step's ``order`` run with ``_UNIT`` durations and free transfers: a
    chunk starts when its rank is free and every input of its items is there (its forward's input, its backward's
    output gradient; ``_lower`` receives all of a chunk's inputs before it), as the simulator would run it."""
    last = len(ranks) - 1
    done: dict[tuple[str, int, int], float] = {}  # ("F" | "G" (input gradient) | "I", microbatch, stage) -> end

    ptr, free = [0] * len(order), [0.0] * len(order)
    times: list[list[tuple[float, float]]] = [[] for _ in order]
    progress = True
    while progress:
        progress = False
        for r, chunks in enumerate(order):
            while ptr[r] < len(chunks):
                chunk = chunks[ptr[r]]
                own = {d for item in chunk for d in _produces(*item)}
                deps = [d for item in chunk for d in _needs(*item, last) if d not in own]
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                end = start + sum(_UNIT[t] for t, _, _ in chunk)
                done.update(dict.fromkeys(own, end))
                times[r].append((start, end))
                free[r], ptr[r] = end, ptr[r] + 1
                progress = True
    if any(p < len(chunks) for p, chunks in zip(ptr, order)):
        raise RuntimeError("a virtual-stage order waits on itself")  # torch's orders never do
    return times


def _vocab_cut(order, ranks: list[int], slots=None) -> list[list[tuple[Item, ...]]]:
    """One step's chunk ``order`` per rank with a VOCAB pass per microbatch, for the vocabulary layers shared by every
    stage, placed by the rule of the one-stage orders (``_vocab_passes``): every rank reaches VOCAB j when the last
    stage has run its forward of j. With the chunks timed by torch's grid where it is one (``_slot_times``; it
    keeps the order's own pacing: simulated within 1% of the order without VOCABs plus their time at 8 ranks and 16
    microbatches), else by ``_unit_times`` (DualPipeV: within 9% there, 2.4% at 64 microbatches), VOCAB j goes on
    every rank after the chunks that start before the last stage's forward of j ends (on the rank holding it: right
    after that forward).
    No rank then waits at a VOCAB for a rank that waits for it: a chunk that starts before that time needs only
    chunks that ended before it, so started before it too and come before VOCAB j on their ranks as well; and a
    chunk that needs VOCAB j (the last stage's backward of j, every backward of j after it) starts after the
    forward ended, so comes after VOCAB j (``tests/test_virtual_stages.py`` simulates every schedule so). VOCABs go
    in microbatch order (the last stage forwards in that order)."""
    T, last = ActionType, len(ranks) - 1
    times = (_slot_times(order, ranks, slots) if slots is not None else None) or _unit_times(order, ranks)
    holder = ranks[last]
    ends = {j: end for chunk, (_, end) in zip(order[holder], times[holder]) for t, j, g in chunk
            if t == T.F and g == last}
    out = []
    for chunks, rank_times in zip(order, times):
        placed, pending = [], sorted(ends)
        for chunk, (start, _) in zip(chunks, rank_times):
            while pending and ends[pending[0]] <= start:
                placed.append(((T.VOCAB, pending.pop(0), last),))
            placed.append(chunk)
        placed.extend(((T.VOCAB, j, last),) for j in pending)
        out.append(placed)
    return out


def _check_interleaved(p: int, m: int, extra: int) -> None:
    rounds = max(1, m // p)
    if m % rounds:
        raise ValueError(f"interleaved 1F1B runs the microbatches in rounds of about num_stages; num_microbatches "
                         f"must be a multiple of max(1, m // p) = {rounds} (got {m}): use {m - m % rounds} or "
                         f"{m - m % rounds + rounds}")


def _check_dualpipev(p: int, m: int, extra: int) -> None:
    if m < 2 * p:
        raise ValueError(f"dualpipev needs num_microbatches >= 2 x num_stages, one per model stage ({m} < {2 * p})")


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
    stages_per_rank: int = 1
    """Model stages each rank (process) holds: 1, or more for the virtual-stage schedules (interleaved 1F1B: v; ZBV and
    DualPipeV: 2), whose ``num_stages`` arguments count ranks: p ranks run p x stages_per_rank model stages, their
    actions name the stage (``Action.stage``) and their ``version``/``lag`` take a rank."""
    placement: str = "loop"
    """Which rank holds which stage where there are several per rank (``stage_ranks``): ``loop`` or ``v``."""
    split_backward: bool = False
    """Each backward runs as I (input gradient) and W (weight gradient), two passes over the stage's graph."""

    @property
    def runs_in_executor(self) -> bool:
        """Whether ``pipeline/executor.py`` can run it: it runs one stage per rank; the virtual-stage schedules are
        data for the simulator and the planner only, for now."""
        return self.stages_per_rank == 1

    def stage_ranks(self, num_ranks: int) -> list[int]:
        """The rank holding each of the ``num_ranks x stages_per_rank`` model stages."""
        return stage_ranks(self.placement, num_ranks, self.stages_per_rank)

    def check(self, num_stages: int, num_microbatches: int, extra_warmup: int = 0) -> None:
        """ValueError naming the knob when (p, m, extra_warmup) cannot run this schedule."""
        if extra_warmup and not self.extra_warmup_ok:
            raise ValueError(f"pipeline.extra_warmup applies to {' and '.join(n for n, s in SCHEDULES.items() if s.extra_warmup_ok)}, "
                             f"not {self.name!r}; set it to 0")
        self._constraints(num_stages, num_microbatches, extra_warmup)

    def actions(self, num_stages: int, num_microbatches: int, num_steps: int, first_step: int = 0,
                extra_warmup: int = 0, vocab_parallel: bool = False) -> list[list[Action]]:
        """One action list per stage for steps [first_step, first_step + num_steps), empty at the start and drained
        at the end. Versions follow ``version``, so where a run is cut into such windows changes no numerics.
        ``vocab_parallel``: every stage holds a shard of the output layer and loss, and runs a VOCAB pass per
        microbatch (``_vocab_passes``; the 1F1B-shaped orders then run ``vocab_warmup`` more forwards ahead, and the
        virtual-stage ones place the passes by ``_vocab_cut``)."""
        _check(self.name, num_stages, num_microbatches, num_steps, first_step, extra_warmup)
        return [list(self.stage_actions(s, num_stages, num_microbatches, num_steps, first_step, extra_warmup,
                                        vocab_parallel)) for s in range(num_stages)]

    def stage_actions(self, stage: int, num_stages: int, num_microbatches: int, num_steps: int, first_step: int = 0,
                      extra_warmup: int = 0, vocab_parallel: bool = False) -> Iterator[Action]:
        """Stage ``stage``'s list of ``actions``, produced lazily (checked now, generated as it is consumed); with
        several stages per rank, rank ``stage``'s list (of ``num_stages`` ranks)."""
        p, m, n, k0 = num_stages, num_microbatches, num_steps, first_step
        _check(self.name, p, m, n, k0, extra_warmup)
        self.check(p, m, extra_warmup)
        if not 0 <= stage < p:
            raise ValueError(f"{self.name}: stage {stage} is not in 0..{p - 1}")
        return self._build(self, stage, p, m, n, k0, extra_warmup, vocab_parallel)

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
    _build=_flushed(_order_zb_h1), split_backward=True)
"""ZB-H1: 1F1B with each backward split into I (the input gradient, sent on at once) and W (the weight gradient,
later); the W's fill the cool-down. It computes 1F1B's gradients, flushed every step (version k)."""

SCHEDULES: dict[str, Schedule] = {s.name: s for s in (GPIPE, ONE_F_ONE_B, ZB_H1, TWO_BW, PIPEDREAM)}
"""The schedules the executor runs (``pipeline.schedule``)."""

INTERLEAVED_1F1B = Schedule(
    name="interleaved1f1b", title="interleaved 1F1B (2 stages per rank), synchronous", synchronous=True,
    version=lambda k, r, p: k, lag=lambda r, p: 0, late_step=False, one_update_per_microbatch=False,
    extra_warmup_ok=False, _build=_flushed_virtual, _constraints=_check_interleaved,
    stages_per_rank=2, placement="loop")
"""Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters", 2021), torch's
``ScheduleInterleaved1F1B`` order: v stages per rank in looping placement (``interleaved_1f1b(v)``; 2 here), the
microbatches in rounds of m // max(1, m // p) (m a multiple of the number of rounds), flushed every step (version
k); it computes 1F1B's gradients on a p x v-stage split, whose fill and drain take 1/v as long as 1F1B's."""

ZBV = Schedule(
    name="zbv", title="ZBV zero bubble (2 stages per rank, V placement), synchronous", synchronous=True,
    version=lambda k, r, p: k, lag=lambda r, p: 0, late_step=False, one_update_per_microbatch=False,
    extra_warmup_ok=False, _build=_flushed_virtual, stages_per_rank=2,
    placement="v", split_backward=True)
"""ZBV (Qi et al., "Zero Bubble Pipeline Parallelism", 2024, section 6), torch's ``ScheduleZBVZeroBubble`` order: 2
stages per rank in V placement (the V turns on rank p-1 without a transfer), F, I and W, any m (fewer than 2p-1
leave bubbles); with F = I = W its steady state has no bubble, at 1F1B's activation memory per rank. Flushed every
step (version k)."""

DUALPIPEV = Schedule(
    name="dualpipev", title="DualPipeV (2 stages per rank, V placement), synchronous", synchronous=True,
    version=lambda k, r, p: k, lag=lambda r, p: 0, late_step=False, one_update_per_microbatch=False,
    extra_warmup_ok=False, _build=_flushed_virtual, _constraints=_check_dualpipev, stages_per_rank=2, placement="v",
    split_backward=True)
"""DualPipeV (DeepSeek-V3's DualPipe folded onto p ranks), torch's ``ScheduleDualPipeV`` order: 2 stages per rank in V
placement, m >= 2p; its main phase runs overlapped pairs, a forward of one stage with a backward of the other (one
chunk each, computed one after the other as torch's runtime does without a custom overlap function: DeepSeek
overlaps them to hide the expert all-to-all, which a cost model of compute alone cannot show), B and I/W; flushed
every step (version k)."""

VIRTUAL_SCHEDULES: dict[str, Schedule] = {s.name: s for s in (INTERLEAVED_1F1B, ZBV, DUALPIPEV)}
"""The virtual-stage schedules (several stages per rank): simulator and planner only, not the executor."""


def interleaved_1f1b(stages_per_rank: int) -> Schedule:
    """Interleaved 1F1B with ``stages_per_rank`` (v >= 2) stages per rank."""
    if not isinstance(stages_per_rank, int) or stages_per_rank < 2:
        raise ValueError(f"interleaved 1F1B needs at least 2 stages per rank, got {stages_per_rank!r}")
    return dataclasses.replace(INTERLEAVED_1F1B, stages_per_rank=stages_per_rank,
                               title=f"interleaved 1F1B ({stages_per_rank} stages per rank), synchronous")


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

    def build(sched: Schedule, s: int, p: int, m: int, n: int, k0: int, extra: int, vocab: bool) -> Iterator[Action]:
        sync = max(0, min(n, K - k0))  # steps of this window before K
        if sync:
            yield from ONE_F_ONE_B._build(sched, s, p, m, sync, k0, extra, vocab)
        if n > sync:
            yield from schedule._build(sched, s, p, m, n - sync, k0 + sync, extra, vocab)

    return dataclasses.replace(schedule, name=f"{schedule.name}", title=f"{schedule.title}, synchronous for the first {K} steps",
                               version=version, _build=build)


def get_schedule(name: "str | Schedule") -> Schedule:
    if isinstance(name, Schedule):
        return name
    if name in VIRTUAL_SCHEDULES:
        return VIRTUAL_SCHEDULES[name]
    if name not in SCHEDULES:
        raise ValueError(f"pipeline.schedule: {name!r} is not one of {', '.join(SCHEDULES)} (planner only: "
                         f"{', '.join(VIRTUAL_SCHEDULES)})")
    return SCHEDULES[name]


def schedule_actions(name: str, num_stages: int, num_microbatches: int, num_steps: int, first_step: int = 0,
                     extra_warmup: int = 0, vocab_parallel: bool = False) -> list[list[Action]]:
    """``get_schedule(name).actions(...)``.

    ``extra_warmup`` (1f1b and 2bw): forwards every non-last stage runs ahead of plain 1F1B. Each costs one
    microbatch of activation memory there and lets the next stage find its input already waiting, which absorbs
    timing jitter when stages are nearly balanced; versions, and so numerics, do not change.
    """
    return get_schedule(name).actions(num_stages, num_microbatches, num_steps, first_step, extra_warmup, vocab_parallel)


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
