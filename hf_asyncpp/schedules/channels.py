"""Which communicator a transfer between two stages travels on (the executor's ``P2P`` and the simulator's NCCL
rule both read it here).

NCCL runs the point-to-point operations of one communicator between two ranks on one stream, in the order they
were posted, in both directions: a receive at the head of that stream holds back every later send and receive of
the pair until its data arrives. The executor posts each stage's next receive of a kind as soon as the previous
one completes (so data moves while the stage computes); with activations and gradients on one communicator that
posted receive sits in front of the stage's next send, and two neighbours wait on each other forever.

So every pair of adjacent stages has two communicators, one per direction: activations s -> s+1 on ``("act", s)``,
gradients s+1 -> s on ``("grad", s)``. Each then carries one sender and one receiver whose orders the action
lists already fix (the simulator checks receives come in send order), a posted receive never stands in front of a
send, and the two directions run on separate streams, overlapping each other and the compute stream. Peers solve
the same problem by fusing what happens together into one grouped call (torch.distributed.pipelining) or by
batching / alternating two groups (Megatron); one communicator per direction keeps the receive posted one ahead,
which a fused send+receive would tie to the slower of the two.
"""
from __future__ import annotations

Channel = tuple[str, int]


def channel(src: int, dst: int) -> Channel:
    """The communicator of a transfer from stage ``src`` to the adjacent stage ``dst``."""
    if dst == src + 1:
        return ("act", src)
    if dst == src - 1:
        return ("grad", dst)
    raise ValueError(f"stages {src} and {dst} are not adjacent: transfers go between neighbours only")


def all_channels(num_stages: int) -> list[Channel]:
    """Every channel of a pipeline, in one order on every rank (its process groups are created collectively)."""
    return [(kind, s) for s in range(num_stages - 1) for kind in ("act", "grad")]
