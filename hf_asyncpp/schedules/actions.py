"""The action vocabulary of a pipeline schedule: what one stage (or rank) does, and its text form.

The records (``records``), the simulator, the NCCL rule, the executor and the planner all speak it; only the records
build orders from it. Actions (``str(a)`` / ``Action.from_str`` round-trip; ``k`` = step, ``i`` = microbatch in the step):

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
``F{k}.{i}@v{v}/s{g}``      with several stages per rank: the forward at model stage g (likewise every
                            F, B, I, W and transfer names its stage)
``VOCAB{k}.{i}@v{v}``       with the vocabulary layers shared by every stage (``pipeline.vocab_parallel``): this
                            stage's vocabulary shard of the output layer and loss for microbatch (k, i), forward
                            and backward in one pass, with version v; a collective of all the stages of one
                            replica, run by each in microbatch order (the last stage's final hidden states
                            broadcast, the softmax's statistics combined, the gradient to the hidden states
                            summed back onto the last stage). It accumulates the shard's weight gradient as a B
                            does; the last stage runs it between F and B (or I) of the microbatch, stage s
                            after its forward of microbatch (k, i) + p-1-s (``records._vocab_passes``); with
                            several stages per rank it names no stage (the shard is the rank's) and goes where
                            the rank stands when the last stage's forward of (k, i) ends (``records._vocab_cut``)
``REDUCE{k}``               after the stage's last B (or W) of step k: post step k's gradient
                            reductions (data-parallel all-reduce, tied-embedding sum, global grad norm),
                            a collective every stage issues in the same step order
``STEP{k}``                 the optimizer update applying step k's (reduced, clipped) gradient; it waits
                            for REDUCE{k} to complete and produces the stage's next version
==========================  ============================================================================
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Optional

__all__ = ["ActionType", "Action", "BACKWARDS", "format_actions", "parse_actions"]


class ActionType(str, Enum):
    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the zero-bubble papers' name: the backward to the stage's input
    W = "W"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    VOCAB = "VOCAB"
    REDUCE = "REDUCE"
    STEP = "STEP"

    @property
    def is_send(self) -> bool:
        return self in (ActionType.SEND_ACT, ActionType.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (ActionType.RECV_ACT, ActionType.RECV_GRAD)


_COMPUTE = (ActionType.F, ActionType.B, ActionType.I, ActionType.W, ActionType.VOCAB)
BACKWARDS = frozenset({ActionType.B, ActionType.W})
"""The actions that complete a microbatch's backward at a stage (B, or the W after its I): its activations are
released, its weight gradient accumulated, and the step's REDUCE may follow the last of them."""
_FIELDS = {t: (t in _COMPUTE or t.is_send or t.is_recv, t in _COMPUTE, t.is_send or t.is_recv) for t in ActionType}
"""Which of (microbatch, version, peer) each type has: looked up, not derived, for every one of the million actions
a planner's search lowers."""
_PATTERN = re.compile(r"([A-Z_]+?)(\d+)(?:\.(\d+))?(?:@v(\d+))?(?:([<>])(\d+))?(?:/s(\d+))?")


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
    """The other rank of a transfer (destination of a send, source of a receive); with one stage per rank, the other
    stage."""
    stage: Optional[int] = None
    """Where a rank holds several model stages (``Schedule.stages_per_rank`` > 1): the stage an F, B, I or W computes,
    whose output (SEND_ACT) or input gradient (SEND_GRAD) a send carries, or whose input (RECV_ACT) or output
    gradient (RECV_GRAD) a receive brings. None where each rank holds one stage, the list's own (stage = rank)."""

    def __post_init__(self):
        t = self.type
        if type(t) is not ActionType:
            t = ActionType(t)
            object.__setattr__(self, "type", t)
        mb, v, peer, g = self.microbatch, self.version, self.peer, self.stage
        if (_FIELDS[t] != (mb is not None, v is not None, peer is not None) or self.step < 0
                or (mb is not None and mb < 0) or (v is not None and v < 0) or (peer is not None and peer < 0)
                or (g is not None and (g < 0 or mb is None))):
            raise ValueError(f"malformed action {t.value}: step={self.step} microbatch={self.microbatch} "
                             f"version={self.version} peer={self.peer} stage={self.stage}")

    def sending_stage(self, rank: int) -> int:
        """For a transfer in ``rank``'s list: the stage whose output or input gradient it carries. A send's own stage;
        for a receive the neighbour it comes from: the stage before for activations, the one after for gradients.
        With one stage per rank the stages are the ranks (a send's rank, a receive's peer)."""
        if self.stage is None:
            return rank if self.type.is_send else self.peer
        if self.type.is_send:
            return self.stage
        return self.stage - 1 if self.type == ActionType.RECV_ACT else self.stage + 1

    def __str__(self) -> str:
        s = f"{self.type.value}{self.step}"
        if self.microbatch is not None:
            s += f".{self.microbatch}"
        if self.version is not None:
            s += f"@v{self.version}"
        if self.peer is not None:
            s += f"{'>' if self.type.is_send else '<'}{self.peer}"
        if self.stage is not None:
            s += f"/s{self.stage}"
        return s

    __repr__ = __str__

    @staticmethod
    def from_str(text: str) -> "Action":
        m = _PATTERN.fullmatch(text.strip())
        if not m or m.group(1) not in ActionType.__members__:
            raise ValueError(f"not an action: {text!r} (e.g. F3.1@v2, SEND_ACT3.1>2, RECV_GRAD3.1<2, STEP3)")
        op, k, i, v, arrow, peer, stage = m.groups()
        t = ActionType(op)
        if arrow is not None and arrow != (">" if t.is_send else "<"):
            raise ValueError(f"not an action: {text!r} (sends name their peer with '>', receives with '<')")
        num = lambda x: None if x is None else int(x)
        return Action(t, int(k), num(i), num(v), num(peer), num(stage))


def format_actions(lists: list[list[Action]]) -> str:
    """One line per stage (``stage s: a a a``), or per rank where the actions name their stages (``rank r: ...``,
    virtual stages), for logs and for ``parse_actions``."""
    head = "rank" if any(a.stage is not None for acts in lists for a in acts) else "stage"
    return "\n".join(f"{head} {s}: " + " ".join(map(str, acts)) for s, acts in enumerate(lists))


def parse_actions(text: str) -> list[list[Action]]:
    out = []
    for line in filter(None, map(str.strip, text.splitlines())):
        head, _, body = line.partition(":")
        if head not in (f"stage {len(out)}", f"rank {len(out)}"):
            raise ValueError(f"expected 'stage {len(out)}: ...' (or 'rank {len(out)}: ...'), got {line[:40]!r}")
        out.append([Action.from_str(w) for w in body.split()])
    return out
