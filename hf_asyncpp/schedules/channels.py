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


def channel(src: int, dst: int, num_ranks: int | None = None) -> Channel:
    """The communicator of a transfer from stage ``src`` to the adjacent stage ``dst``.

    Where ranks hold several stages (virtual stages) the transfers go between ranks and the same rule holds: one
    communicator per direction between two ranks, whatever it carries (in V placement rank r sends r+1 both its
    first stage's activations and its second stage's input gradients; they leave in one order and the receiver takes
    them in it). With ``num_ranks`` the ranks form a ring, as a looping placement needs (stage p-1 on rank p-1 feeds
    stage p on rank 0): its wrap-around pair gets ("act", p-1) for p-1 -> 0 and ("grad", p-1) for 0 -> p-1."""
    if dst == src + 1:
        return ("act", src)
    if dst == src - 1:
        return ("grad", dst)
    if num_ranks is not None and num_ranks > 2 and (src, dst) in ((num_ranks - 1, 0), (0, num_ranks - 1)):
        return ("act", src) if dst == 0 else ("grad", dst)
    raise ValueError(f"stages {src} and {dst} are not adjacent: transfers go between neighbours only")


def all_channels(num_stages: int) -> list[Channel]:
    """Every channel of a pipeline, in one order on every rank (its process groups are created collectively)."""
    return [(kind, s) for s in range(num_stages - 1) for kind in ("act", "grad")]
