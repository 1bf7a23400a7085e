"""The simulator's NCCL rule (``simulate(nccl=True)``): per (rank, communicator, peer) one FIFO of posted
point-to-point operations that complete one at a time, in post order, a send only together with the receive at the
head of the peer's FIFO. ``NcclRule`` holds the simulator's handlers for sends and receives under that rule;
``simulator._Run`` mixes it in. The rule and why it matters: ``simulator``'s module docstring and ``channels``.
"""
from __future__ import annotations

from collections import defaultdict, deque
from typing import Callable, Hashable

from .actions import Action, ActionType

T = ActionType

SEND_OF = {T.RECV_ACT: T.SEND_ACT, T.RECV_GRAD: T.SEND_GRAD}


def message_text(send: Action) -> str:
    """A sent message as error lines name it: ``SEND_ACT3.1`` (``/s5``: the stage it comes from, with several per rank)."""
    return f"{send.type.value}{send.step}.{send.microbatch}" + (f"/s{send.stage}" if send.stage is not None else "")


def awaited_text(recv: Action, rank: int) -> str:
    """The send a receive in ``rank``'s list waits for, as ``message_text`` names it."""
    stage = f"/s{recv.sending_stage(rank)}" if recv.stage is not None else ""
    return f"{SEND_OF[recv.type].value}{recv.step}.{recv.microbatch}{stage}"


class _Op:
    """One posted NCCL send or receive: ``action`` (list index ``idx``) of stage ``rank`` on communicator ``comm``,
    posted while the stage ran its action ``at`` (``at < idx``: a prefetched receive)."""

    __slots__ = ("rank", "idx", "at", "action", "comm", "posted", "done")

    def __init__(self, rank: int, idx: int, at: int, action: Action, comm: Hashable, posted: float):
        self.rank, self.idx, self.at, self.action, self.comm = rank, idx, at, action, comm
        self.posted, self.done = posted, None

    def __str__(self) -> str:
        return str(self.action)

    def message(self) -> tuple:
        a = self.action
        return (SEND_OF.get(a.type, a.type), a.step, a.microbatch, a.sending_stage(self.rank))


class NcclFifos:
    """NCCL's per-(rank, communicator, peer) FIFOs of posted operations (``simulate(nccl=True)``)."""

    def __init__(self, channel: Callable[[int, int], Hashable], prefetch: bool):
        self.channel, self.prefetch = channel, prefetch
        self.fifo: dict[tuple, deque[_Op]] = defaultdict(deque)  # (rank, comm, peer) -> ops not completed, in post order
        self.free: dict[tuple, float] = defaultdict(float)  # (rank, comm, peer) -> its last completion
        self.posted: dict[tuple[int, int], _Op] = {}  # (rank, list index) -> its op, until its action finished
        self.next_recv: list[dict[int, int]] = []  # per rank: RECV index -> the next RECV on its communicator and peer

    def index(self, actions: list[list[Action]]) -> None:
        """What the prefetch posts: after each receive, the rank's next receive from the same peer on the same
        communicator (with one stage per rank: the next of the same kind)."""
        for s, acts in enumerate(actions):
            nxt, last = {}, {}
            for j, a in enumerate(acts):
                if a.type.is_recv:
                    try:
                        fifo = (self.channel(a.peer, s), a.peer)
                    except ValueError:
                        continue  # no communicator: the receive fails when posted
                    if fifo in last:
                        nxt[last[fifo]] = j
                    last[fifo] = j
            self.next_recv.append(nxt)


def _few(ops, n: int = 3) -> str:
    ops = list(ops)
    return ", ".join(map(str, ops[:n])) + (f", ... ({len(ops) - n} more)" if len(ops) > n else "")



class NcclRule:
    """Send and receive handlers of ``simulator._Run`` under NCCL's rule (its state: ``self.nccl``, a ``NcclFifos``)."""

    def post(self, s: int, idx: int) -> _Op:
        """Stage s posts the transfer of its action ``idx`` now; complete whatever pairs that unblocks."""
        a, n = self.actions[s][idx], self.nccl
        src, dst = (s, a.peer) if a.type.is_send else (a.peer, s)
        try:
            comm = n.channel(src, dst)
        except ValueError as e:
            self.fail(s, f"{a}: no communicator for {src} -> {dst}: {e}", "no channel")
        op = n.posted[(s, idx)] = _Op(s, idx, self.ptr[s], a, comm, self.clock[s])
        n.fifo[(s, comm, a.peer)].append(op)
        self.match(s, comm, a.peer)
        return op

    def match(self, s: int, comm: Hashable, d: int) -> None:
        """Complete the heads of s's and d's FIFOs on ``comm`` while they are a send and its receive."""
        n = self.nccl
        mine, theirs = n.fifo[(s, comm, d)], n.fifo[(d, comm, s)]
        while mine and theirs and mine[0].action.type.is_send != theirs[0].action.type.is_send:
            snd, rcv = (mine[0], theirs[0]) if mine[0].action.type.is_send else (theirs[0], mine[0])
            if snd.message() != rcv.message():
                self.fail(rcv.rank, f"{rcv.action}, but the next message from {self.label} {snd.rank} is "
                                    f"{message_text(snd.action)} (receives out of send order; on {comm!r})",
                          "out of send order")
            mine.popleft(), theirs.popleft()
            done = (max(snd.posted, rcv.posted, n.free[(s, comm, d)], n.free[(d, comm, s)])
                    + self.cost(rcv.action, self.where(rcv.action, rcv.rank)))
            snd.done = rcv.done = n.free[(s, comm, d)] = n.free[(d, comm, s)] = done

    def nccl_recv(self, s: int, a: Action) -> bool:
        idx = self.ptr[s]
        op = self.nccl.posted.get((s, idx)) or self.post(s, idx)
        if op.done is None:
            return False
        del self.nccl.posted[(s, idx)]
        self.clock[s] = max(self.clock[s], op.done)
        self.arrived(s, a)
        nxt = self.nccl.next_recv[s].get(idx)
        if self.nccl.prefetch and nxt is not None:  # the executor's prefetch, before the stage's next action
            self.post(s, nxt)
        return True

    def nccl_send(self, s: int, a: Action) -> bool:
        idx = self.ptr[s]
        op = self.nccl.posted.get((s, idx)) or self.post(s, idx)
        if self.blocking_sends:
            if op.done is None:
                return False
            self.clock[s] = max(self.clock[s], op.done)
        del self.nccl.posted[(s, idx)]
        return True

    def why_blocked_nccl(self, s: int, a: Action) -> str:
        """Which FIFO the blocked transfer sits in, what stands in front of it, and what the peer's head is."""
        n = self.nccl
        op = n.posted[(s, self.ptr[s])]
        d, comm = a.peer, op.comm
        if a.type.is_recv:
            wait = f"waits for {awaited_text(a, s)} from {self.label} {d}"
        else:
            wait = "blocking send waits for its receive"
        how = f"prefetched at @{op.at} after {self.actions[s][op.at]}" if op.at != op.idx else "posted here"
        q, other = list(n.fifo[(s, comm, d)]), n.fifo[(d, comm, s)]
        pos = q.index(op)
        where = f"{op} ({how}) " + (f"heads {comm!r} to {self.label} {d}" if pos == 0 else
                                     f"is queued on {comm!r} to {self.label} {d} behind {_few(q[:pos])}")
        head = "it" if pos == 0 else f"the head {q[0]}"
        if not other:
            facing = f"{self.label} {d} has posted nothing there for {head}"
        else:
            kind = "receives" if q[0].action.type.is_recv else "sends"
            facing = f"{self.label} {d}'s head there is {other[0]} (two {kind} wait for each other)"
        behind = f"; behind it: {_few(q[pos + 1:])}" if pos + 1 < len(q) else ""
        return f"{wait}: {where}; {facing}{behind}"

